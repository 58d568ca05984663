"""Preprocessing: text files to a tokenized PREFIX.bin / PREFIX.idx dataset (``megakern.data.indexed``).

    python -m megakern.data.preprocess --input a.jsonl b.jsonl.gz notes.txt --tokenizer gpt2:../shared/data/gpt2 \\
        --output-prefix data/mix --workers 8

Inputs, read as streams (memory stays bounded however large they are):

- ``.jsonl`` and ``.jsonl.gz``: one JSON object per line, the document's text under ``--json-key`` (default 'text');
  blank lines are ignored. A line that is not valid UTF-8 JSON, not an object, lacks the key or holds a non-string
  there is an error naming the file and line.
- ``.txt`` (UTF-8): the whole file is one document. ``--txt-split lines`` makes every non-blank line a document,
  ``--txt-split paragraphs`` every run of non-blank lines (blank lines separate them).

With ``--skip-bad-lines``, such bad lines (and .txt documents that are not UTF-8) are skipped, counted and reported
instead. A tokenizer that cannot encode a document (a character outside a char vocabulary) is always an error.

Documents are tokenized by ``--workers`` processes in input order, so the output does not depend on the worker
count; each gets the tokenizer's eod id appended (``--no-append-eod`` to leave it off). Documents with no tokens are
skipped and counted. The output is PREFIX.bin / PREFIX.idx from ``IndexedDatasetWriter`` (which checks every id
against the vocabulary) and PREFIX.tokenizer.json, the tokenizer's ``to_config()``, from which
``load_tokenizer(json.load(f))`` rebuilds it. Existing outputs are refused unless ``--overwrite``.

``preprocess()`` is the same as a function; ``preprocess_documents()`` tokenizes an iterable of strings.

``--format sft`` reads supervised fine-tuning examples instead ({"prompt", "response"} or {"messages": [...]} JSONL
lines, rendered by ``--chat-template``, bounded by ``--max-length`` and ``--overlong``) and writes PREFIX.mask.bin
beside the tokens, the loss mask that keeps the responses only: ``megakern.data.sft``, through the same readers,
workers and writer.
"""
from __future__ import annotations

import argparse
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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megakern.data.indexed import DataError, IndexedDatasetWriter
from megakern.data.tokenizers import SPEC_FORMS, Tokenizer, load_tokenizer

TXT_SPLITS = ("lines", "paragraphs")
SUFFIXES = (".jsonl", ".jsonl.gz", ".txt")
IN_FLIGHT_BYTES_PER_WORKER = 16 << 20  # input bytes read ahead of the writer, per worker
PROGRESS_EVERY_S = 10.0  # seconds between progress lines when tqdm is not installed
BAD_EXAMPLES = 5  # bad lines quoted in the report

# A record: (source index, line number or 0 for a whole file, kind, payload). Kinds: 'json' (a JSONL line, bytes),
# 'text' (a document: UTF-8 bytes or a str), 'lines' (UTF-8 bytes of a document, less its final line break),
# 'error' (the reader's message: the input could not be read from there on).
Record = tuple[int, int, str, Any]


def preprocess(inputs: Sequence[str | Path], tokenizer: Tokenizer, output_prefix: str | Path, *,
               json_key: str = "text", txt_split: str | None = None, workers: int = 1, append_eod: bool = True,
               skip_bad_lines: bool = False, overwrite: bool = False, chunksize: int = 64,
               progress: bool = True) -> dict[str, Any]:
    """Tokenizes the documents of ``inputs`` (.jsonl, .jsonl.gz, .txt; see the module docstring) into
    ``output_prefix``.bin/.idx/.tokenizer.json. Returns the stats: docs, tokens, bytes (of input read), seconds,
    mb_per_s, docs_per_s, empty_docs, bad_lines, workers."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no inputs given")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input {path} does not exist or is not a file")
        if not path.name.endswith(SUFFIXES):
            raise DataError(f"input {path}: unsupported file type; expected one of {', '.join(SUFFIXES)}")
    if not isinstance(json_key, str) or not json_key:
        raise ValueError(f"json_key must be a non-empty str, got {json_key!r}")
    if txt_split not in (None, *TXT_SPLITS):
        raise ValueError(f"txt_split must be None (a .txt file is one document) or one of {TXT_SPLITS}, "
                         f"got {txt_split!r}")
    gzipped = any(p.name.endswith(".gz") for p in paths)
    total = None if gzipped else sum(p.stat().st_size for p in paths)
    return write_dataset(read_inputs(paths, txt_split), [str(p) for p in paths], tokenizer, output_prefix,
                         tokenize=_Tokenize(tokenizer, json_key, append_eod), workers=workers,
                         skip_bad_lines=skip_bad_lines, overwrite=overwrite, chunksize=chunksize, progress=progress,
                         total_bytes=total)


def preprocess_documents(documents: Iterable[str], tokenizer: Tokenizer, output_prefix: str | Path, *,
                         workers: int = 1, append_eod: bool = True, overwrite: bool = False, chunksize: int = 64,
                         progress: bool = True, total_bytes: int | None = None) -> dict[str, Any]:
    """Like ``preprocess`` for documents given as strings (errors name '<documents>:N', the Nth document)."""
    records = ((0, n, "text", doc) for n, doc in enumerate(documents, 1))
    return write_dataset(records, ["<documents>"], tokenizer, output_prefix,
                         tokenize=_Tokenize(tokenizer, "text", append_eod), workers=workers, skip_bad_lines=False,
                         overwrite=overwrite, chunksize=chunksize, progress=progress, total_bytes=total_bytes)


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


class _Tokenize:
    """Record -> (source, line, input bytes, ids or None, loss mask (None), problem or None, whether the problem is
    a skippable bad line, note (None)). Runs in the worker processes (or inline for one worker)."""

    def __init__(self, tokenizer: Tokenizer, json_key: str, append_eod: bool):
        self.tokenizer, self.json_key, self.append_eod = tokenizer, json_key, append_eod

    def __call__(self, record: Record) -> tuple:
        src, line, kind, payload = record
        if kind == "error":
            return src, line, 0, None, None, payload, False, None
        nbytes = len(payload) if isinstance(payload, bytes) else len(payload.encode("utf-8", "surrogatepass"))
        try:
            text = self._text(kind, payload)
        except ValueError as exc:
            return src, line, nbytes, None, None, str(exc), True, None
        try:
            ids = self.tokenizer.encode(text)
        except ValueError as exc:
            return src, line, nbytes, None, None, f"tokenizer {self.tokenizer.name}: {exc}", False, None
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod_id)
        try:  # int32: half the bytes of int64 back from the workers; the writer checks them against the vocabulary
            return src, line, nbytes, np.asarray(ids, dtype=np.int32), None, None, False, None
        except OverflowError:
            problem = f"tokenizer {self.tokenizer.name}: an id does not fit int32"
            return src, line, nbytes, None, None, problem, False, None

    def _text(self, kind: str, payload: bytes | str) -> str:
        if isinstance(payload, str):
            return payload
        if kind != "json":
            try:
                return (payload.rstrip(b"\r\n") if kind == "lines" else payload).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"not UTF-8 text ({exc})") from None
        obj = json_object(payload)
        if self.json_key not in obj:
            keys = ", ".join(map(repr, list(obj)[:8])) or "none"
            raise ValueError(f"no key {self.json_key!r} (keys: {keys}); choose it with --json-key")
        text = obj[self.json_key]
        if not isinstance(text, str):
            raise ValueError(f"{self.json_key!r} holds a JSON {type(text).__name__}, not a string")
        return text


_worker_tokenize = None  # each pool worker's own _Tokenize (or SFT examples), set once by _init_worker


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


SFT_OPTIONS = ("chat_template", "max_length", "overlong", "prompt_key", "response_key", "messages_key")
TEXT_OPTIONS = ("json_key", "txt_split", "append_eod")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m megakern.data.preprocess", description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE", help="inputs: .jsonl, .jsonl.gz, .txt")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC", help="one of " + ", ".join(SPEC_FORMS[:-1]))
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json (and PREFIX.mask.bin with "
                             "--format sft)")
    parser.add_argument("--format", choices=("text", "sft"), default="text",
                        help="text: documents (default); sft: prompt/response or chat examples, with a loss mask on "
                             "the responses (megakern.data.sft)")
    parser.add_argument("--json-key", help="the key holding the text in JSONL inputs (default: text)")
    parser.add_argument("--txt-split", choices=TXT_SPLITS,
                        help="split .txt inputs into documents by lines or paragraphs (default: one per file)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (capped to the CPU count)")
    parser.add_argument("--chunksize", type=int, default=64, help="documents per task sent to a worker")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction,
                        help="append the tokenizer's end-of-document id to every document (default: on)")
    parser.add_argument("--eod-token", help="the end-of-document token of an 'hf:' tokenizer")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) records that are not documents (JSONL lines that are not JSON objects "
                             "with the key, text that is not UTF-8; with --format sft: examples that are not "
                             "valid) instead of failing")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    sft = parser.add_argument_group("--format sft")
    sft.add_argument("--chat-template", metavar="TEMPLATE",
                     help="how 'messages' are rendered: 'plain' (role headers in text; the default) or a Hugging Face "
                          "tokenizer_config.json / .jinja chat template (needs jinja2)")
    sft.add_argument("--max-length", type=int, metavar="N",
                     help="most tokens of an example, the end-of-document token included (default: no bound)")
    sft.add_argument("--overlong", choices=("drop", "truncate", "error"),
                     help="examples over --max-length: dropped (default), truncated, or an error; counted either way")
    sft.add_argument("--prompt-key", help="the prompt's key (default: prompt)")
    sft.add_argument("--response-key", help="the response's key (default: response)")
    sft.add_argument("--messages-key", help="the conversation's key (default: messages)")
    args = parser.parse_args(argv)
    given = {name for name in SFT_OPTIONS + TEXT_OPTIONS if getattr(args, name) is not None}
    wrong = given & set(SFT_OPTIONS if args.format == "text" else TEXT_OPTIONS)
    if wrong:
        flags = ", ".join(sorted("--" + name.replace("_", "-") for name in wrong))
        parser.error(f"{flags} do not apply to --format {args.format}")
    try:
        tokenizer = load_tokenizer(args.tokenizer, eod_token=args.eod_token)
        if args.format == "sft":
            from megakern.data.sft import preprocess_sft

            options = {name: getattr(args, name) for name in SFT_OPTIONS if getattr(args, name) is not None}
            stats = preprocess_sft(args.input, tokenizer, args.output_prefix, workers=args.workers,
                                   skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite,
                                   chunksize=args.chunksize, progress=not args.quiet, **options)
        else:
            stats = preprocess(args.input, tokenizer, args.output_prefix, json_key=args.json_key or "text",
                               txt_split=args.txt_split, workers=args.workers,
                               append_eod=args.append_eod is not False, skip_bad_lines=args.skip_bad_lines,
                               overwrite=args.overwrite, chunksize=args.chunksize, progress=not args.quiet)
    except (ValueError, OSError, ImportError) as exc:  # DataError is a ValueError
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    speed = (f"{stats['bytes'] / 1e6:,.1f} MB in {stats['seconds']:.1f} s: {stats['mb_per_s']:.2f} MB/s, "
             f"{stats['docs_per_s']:,.0f} docs/s, {stats['workers']} workers")
    if args.format == "sft":
        share = stats["trained_tokens"] / max(stats["tokens"], 1)
        print(f"{args.output_prefix}: {stats['docs']:,} examples, {stats['tokens']:,} tokens ({tokenizer.name}, "
              f"template {stats['template']}), {stats['trained_tokens']:,} trained ({share:.1%}), from {speed}; "
              f"{stats['dropped']} dropped and {stats['truncated']} truncated over --max-length, "
              f"{stats['bad_lines']} bad lines skipped")
    else:
        print(f"{args.output_prefix}: {stats['docs']:,} documents, {stats['tokens']:,} tokens ({tokenizer.name}) "
              f"from {speed}; {stats['empty_docs']} empty documents and {stats['bad_lines']} bad lines skipped")
    return stats


if __name__ == "__main__":
    main()
