"""The default corpus: real text that every machine has, so training and tests need no downloads.

It is the Python standard library's own source: the public top-level modules (``<stdlib>/*.py`` whose names do not
start with '_'; symlinks and site/user customizations left out), sorted by name, one document per file; about
4.2 MB in 151 files on CPython 3.11. The same Python version gives the same files; ``default_corpus_id()`` (the
implementation, its version and a sha256 over the file names and contents) tells when a machine's files differ
(a distribution's patches, say) and keys the cache.

``ensure_default_dataset(cache_dir, tokenizer)`` tokenizes the corpus on first use into
``<cache_dir>/<corpus id>-<tokenizer hash>`` .bin/.idx/.tokenizer.json, then writes ``.corpus.json`` (what the
dataset was built from) last, which marks it complete. Builders hold an exclusive lock (``.lock``) so that
concurrent processes build it once and no process sees a partial dataset. The cache directory is the argument,
else ``$MEGAKERN_CACHE/data``, else ``~/.cache/megakern/data``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from megakern.data.tokenizers import Tokenizer

LEFT_OUT = {"sitecustomize.py", "usercustomize.py"}  # site-specific, where present


def default_corpus_files() -> list[Path]:
    """The corpus's files, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in stdlib.glob("*.py")
                    if not p.name.startswith("_") and p.name not in LEFT_OUT and p.is_file() and not p.is_symlink()),
                   key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no Python standard library sources (*.py) in {stdlib}; the default corpus is made "
                                "of them (an installation without sources?)")
    return files


def default_corpus_documents() -> Iterator[str]:
    """The corpus's documents (one per file, in order), read one at a time."""
    for path in default_corpus_files():
        yield _read_source(path)


def default_corpus_id() -> str:
    """'stdlib-<implementation><version>-<sha256 prefix of the file names and contents>'."""
    h = hashlib.sha256()
    for path in default_corpus_files():
        for blob in (path.name.encode(), path.read_bytes()):
            h.update(len(blob).to_bytes(8, "little"))
            h.update(blob)
    return f"stdlib-{sys.implementation.name}{platform.python_version()}-{h.hexdigest()[:16]}"


def default_cache_dir() -> Path:
    """``$MEGAKERN_CACHE/data`` where the variable is set, else ``~/.cache/megakern/data``."""
    root = os.environ.get("MEGAKERN_CACHE")
    return Path(root) / "data" if root else Path.home() / ".cache" / "megakern" / "data"


def ensure_default_dataset(cache_dir: str | Path | None, tokenizer: Tokenizer, *, workers: int = 1,
                           progress: bool = False, lock_timeout_s: float = 600.0) -> Path:
    """The prefix of the default corpus tokenized by ``tokenizer`` in ``cache_dir`` (None: ``default_cache_dir()``),
    built there first if it is not yet."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus_id = default_corpus_id()
    tokenizer_hash = hashlib.sha256(tokenizer.name.encode()).hexdigest()[:16]
    prefix = cache / f"{corpus_id}-{tokenizer_hash}"
    if _complete(prefix):
        return prefix
    cache.mkdir(parents=True, exist_ok=True)
    with _exclusive(prefix.with_name(prefix.name + ".lock"), lock_timeout_s):
        if _complete(prefix):  # built by another process while this one waited
            return prefix
        # imported here: `python -m megakern.data.preprocess` must find that module not yet imported
        from megakern.data.preprocess import preprocess_documents
        from megakern.data.writer import write_json_atomic

        files = default_corpus_files()
        total = sum(p.stat().st_size for p in files)
        stats = preprocess_documents(default_corpus_documents(), tokenizer, prefix, workers=workers, append_eod=True,
                                     overwrite=True, progress=progress, total_bytes=total)
        record = {"corpus": corpus_id, "python": platform.python_version(), "implementation": sys.implementation.name,
                  "stdlib": str(files[0].parent), "files": [p.name for p in files], "tokenizer": tokenizer.name,
                  "docs": stats["docs"], "tokens": stats["tokens"], "bytes": stats["bytes"]}
        write_json_atomic(prefix.with_name(prefix.name + ".corpus.json"), record)
    return prefix


def _complete(prefix: Path) -> bool:
    return all(prefix.with_name(prefix.name + s).is_file() for s in (".corpus.json", ".bin", ".idx", ".tokenizer.json"))


def _read_source(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 ({exc}); the default corpus reads standard library sources as "
                         "UTF-8") from None


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """Holds an exclusive advisory lock on ``lock_path`` (released by the OS if the process dies)."""
    with open(lock_path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path} has been locked by another process for over {timeout_s:.0f} s "
                                       "(building the default dataset); is it stuck?") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
