"""What every preprocessing format shares (``megakern.data.preprocess`` for text, ``megakern.data.sft`` for
supervised fine-tuning examples): the input files read as a stream of records (``read_inputs``, ``json_object`` for a
JSONL line), tokenized by worker processes in input order with a bounded read-ahead, and written as one dataset
(``write_dataset``: PREFIX.bin / .idx / .tokenizer.json, and .mask.bin with loss masks) with progress, the bad lines
counted or named, and the tokenizer's config written atomically (``write_json_atomic``).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megakern.data.indexed import DataError, IndexedDatasetWriter
from megakern.data.tokenizers import Tokenizer

IN_FLIGHT_BYTES_PER_WORKER = 16 << 20  # input bytes read ahead of the writer, per worker
PROGRESS_EVERY_S = 10.0  # seconds between progress lines when tqdm is not installed
BAD_EXAMPLES = 5  # bad lines quoted in the report

# A record: (source index, line number or 0 for a whole file, kind, payload). Kinds: 'json' (a JSONL line, bytes),
# 'text' (a document: UTF-8 bytes or a str), 'lines' (UTF-8 bytes of a document, less its final line break),
# 'error' (the reader's message: the input could not be read from there on).
Record = tuple[int, int, str, Any]


def write_dataset(records: Iterable[Record], sources: list[str], tokenizer: Tokenizer, output_prefix: str | Path,
                  *, tokenize, workers: int, skip_bad_lines: bool, overwrite: bool, chunksize: int, progress: bool,
                  total_bytes: int | None, loss_mask: bool = False) -> dict[str, Any]:
    """Writes the documents that ``tokenize`` (_Tokenize, or megakern.data.sft's examples with ``loss_mask``) makes
    of ``records``; see the module doc."""
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a megakern.data.tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    if chunksize < 1:
        raise ValueError(f"chunksize must be >= 1, got {chunksize}")
    workers = cap_workers(workers)
    prefix = Path(output_prefix)
    suffixes = (".bin", ".idx", ".tokenizer.json") + ((".mask.bin",) if loss_mask else ())
    outputs = [prefix.with_name(prefix.name + s) for s in suffixes]
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} already exist; pass --overwrite (overwrite=True) to replace")

    stats = {"docs": 0, "tokens": 0, "bytes": 0, "empty_docs": 0, "bad_lines": 0, "workers": workers}
    if loss_mask:
        stats.update(trained_tokens=0, dropped=0, truncated=0)
    bad_examples, noted = [], {}
    meter = _Progress(progress, total_bytes)
    try:
        with (IndexedDatasetWriter(prefix, vocab_size=tokenizer.vocab_size, overwrite=overwrite,
                                   loss_mask=loss_mask) as writer,
              _tokenized(records, tokenize, workers, chunksize) as results):
            for src, line, nbytes, ids, mask, problem, skippable, note in results:
                where = f"{sources[src]}:{line}" if line else sources[src]
                stats["bytes"] += nbytes
                if note is not None:  # (kind, what): an example dropped or truncated
                    stats[note[0]] += 1
                    if len(examples := noted.setdefault(note[0], [])) < BAD_EXAMPLES:
                        examples.append(f"{where}: {note[1]}")
                if problem is not None:
                    if not (skippable and skip_bad_lines):
                        hint = "; --skip-bad-lines skips such lines" if skippable else ""
                        raise DataError(f"{where}: {problem}{hint}")
                    stats["bad_lines"] += 1
                    if len(bad_examples) < BAD_EXAMPLES:
                        bad_examples.append(f"{where}: {problem}")
                elif ids is None:  # dropped (noted)
                    pass
                elif not len(ids):
                    stats["empty_docs"] += 1
                else:
                    try:
                        writer.add_document(ids) if mask is None else writer.add_document(ids, mask)
                    except ValueError as exc:
                        raise DataError(f"{where}: {exc} (tokenizer {tokenizer.name})") from exc
                    stats["docs"] += 1
                    stats["tokens"] += len(ids)
                meter.update(stats["docs"], stats["bytes"])
            if loss_mask:
                stats["trained_tokens"] = writer.trained_tokens
    finally:
        meter.close()
    write_json_atomic(outputs[2], tokenizer.to_config())
    seconds = time.perf_counter() - meter.start
    stats.update(seconds=seconds, mb_per_s=stats["bytes"] / 1e6 / seconds, docs_per_s=stats["docs"] / seconds)
    if stats["bad_lines"]:
        warnings.warn(f"skipped {stats['bad_lines']} bad lines, e.g.\n  " + "\n  ".join(bad_examples), stacklevel=3)
    for kind, examples in noted.items():
        warnings.warn(f"{kind} {stats[kind]} examples, e.g.\n  " + "\n  ".join(examples), stacklevel=3)
    return stats


def cap_workers(workers: int) -> int:
    """``workers``, capped to the CPUs this process may use (with a warning)."""
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers > available:
        warnings.warn(f"{workers} workers asked for but only {available} CPUs are available; using {available}",
                      stacklevel=3)
        return available
    return workers


def _init_worker(tokenize) -> None:
    global _worker_tokenize
    _worker_tokenize = tokenize
    # a forked worker inherits its parent's Python signal handlers: a SIGTERM handler of the parent (an application
    # that saves state on SIGTERM) would keep Pool.terminate() from stopping a worker blocked on the task queue.
    # SIGTERM stays blocked from the fork to here (_pool): one sent meanwhile is delivered now, with the default
    # action, instead of reaching the inherited handler and being lost (terminate() then waited forever)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _pool(workers: int, tokenize):
    """A process pool whose workers start with SIGTERM blocked until their initializer restores its default action
    (a worker still starting when a fast error makes the parent call terminate() then ends too). The parent's mask
    is restored at once: a SIGTERM for the parent meanwhile stays pending and reaches its own handler."""
    masks = hasattr(signal, "pthread_sigmask")  # (POSIX)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if masks else None
    try:
        return multiprocessing.get_context().Pool(workers, _init_worker, (tokenize,))
    finally:
        if masks:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _work(record: Record) -> tuple:
    return _worker_tokenize(record)


@contextlib.contextmanager
def _tokenized(records: Iterable[Record], tokenize, workers: int,
               chunksize: int) -> Iterator[Iterator[tuple]]:
    """The tokenized records in input order: inline for one worker, else from a process pool whose read-ahead a
    _Window bounds."""
    if workers == 1:
        yield map(tokenize, records)
        return
    window = _Window(max_items=4 * chunksize * workers, min_items=chunksize,
                     max_bytes=IN_FLIGHT_BYTES_PER_WORKER * workers)
    pool = _pool(workers, tokenize)

    def in_order() -> Iterator[tuple]:
        for result in pool.imap(_work, window.feed(records), chunksize=chunksize):
            window.done()
            yield result

    try:
        yield in_order()
    finally:
        window.close()  # unblocks the pool's feeder thread, which terminate() joins
        pool.terminate()
        pool.join()


class _Window:
    """Bounds the records read but not yet written (count and payload size), so memory stays constant: Pool.imap
    alone reads its whole input ahead of slower workers. It only blocks with at least ``min_items`` (the chunksize)
    records in flight, so the chunk holding the record the writer waits for is always complete and sent."""

    def __init__(self, max_items: int, min_items: int, max_bytes: int):
        self.max_items, self.min_items, self.max_bytes = max_items, min_items, max_bytes
        self._sizes: deque[int] = deque()  # of the records in flight, in order
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    def _open(self) -> bool:
        items = len(self._sizes)
        return self._closed or (items < self.max_items and (self._bytes < self.max_bytes or items < self.min_items))

    def feed(self, records: Iterable[Record]) -> Iterator[Record]:
        for record in records:
            with self._cond:
                self._cond.wait_for(self._open)
                if self._closed:
                    return
                self._sizes.append(len(record[3]))
                self._bytes += self._sizes[-1]
            yield record

    def done(self) -> None:
        """Marks the oldest record in flight written."""
        with self._cond:
            self._bytes -= self._sizes.popleft()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def input_paths(inputs, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """The input files as paths, each checked to exist and to end in one of ``suffixes`` (``what`` says what they
    hold, in the error)."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no inputs given")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input {path} does not exist or is not a file")
        if not path.name.endswith(suffixes):
            raise DataError(f"input {path}: {what}; expected one of {', '.join(suffixes)}")
    return paths


def json_object(payload: bytes | str) -> dict:
    """The JSON object of one JSONL line; ValueError saying what it is instead."""
    try:
        obj = json.loads(payload)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    return obj


def read_inputs(paths: list[Path], txt_split: str | None) -> Iterator[Record]:
    """The records of each input in turn; a read failure becomes an 'error' record and ends the stream."""
    for src, path in enumerate(paths):
        line = 0
        try:
            if path.name.endswith(".txt") and txt_split is None:
                yield src, 0, "text", path.read_bytes()
                continue
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as f:
                if path.name.endswith(".txt") and txt_split == "paragraphs":
                    paragraph, start = [], 0
                    for line, text in enumerate(f, 1):
                        if text.strip():
                            start = start or line
                            paragraph.append(text)
                        elif paragraph:
                            yield src, start, "lines", b"".join(paragraph)
                            paragraph, start = [], 0
                    if paragraph:
                        yield src, start, "lines", b"".join(paragraph)
                else:
                    kind = "lines" if path.name.endswith(".txt") else "json"
                    for line, text in enumerate(f, 1):
                        if text.strip():
                            yield src, line, kind, text
        except (OSError, EOFError, zlib.error) as exc:
            yield src, line + 1 if line else 0, "error", f"cannot read the input: {exc}"
            return


class _Progress:
    """Docs/s and MB/s on stderr: a tqdm bar where tqdm is installed, else a line every PROGRESS_EVERY_S."""

    def __init__(self, enabled: bool, total_bytes: int | None):
        self.start = time.perf_counter()
        self.enabled, self.bar = enabled, None
        self.docs = self.bytes = 0
        self.next_show = self.start + PROGRESS_EVERY_S
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing")
            self.next_show = self.start

    def update(self, docs: int, nbytes: int) -> None:
        self.docs, self.bytes = docs, nbytes
        now = time.perf_counter()
        if not self.enabled or now < self.next_show:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"{docs / (now - self.start):,.0f} docs/s", refresh=False)
            self.bar.update(nbytes - self.bar.n)
            self.next_show = now + 0.5
        else:
            self._line()
            self.next_show = now + PROGRESS_EVERY_S

    def _line(self) -> None:
        s = time.perf_counter() - self.start
        print(f"tokenizing: {self.docs:,} docs, {self.bytes / 1e6:,.1f} MB in {s:.1f} s "
              f"({self.docs / s:,.0f} docs/s, {self.bytes / 1e6 / s:.2f} MB/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.docs / (time.perf_counter() - self.start):,.0f} docs/s", refresh=False)
            self.bar.update(self.bytes - self.bar.n)
            self.bar.close()
        elif self.enabled:
            self._line()


def write_json_atomic(path: Path, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` through a synced temporary file and a rename: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
