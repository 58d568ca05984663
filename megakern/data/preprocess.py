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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megakern.data.tokenizers import SPEC_FORMS, Tokenizer, load_tokenizer
from megakern.data.writer import Record, input_paths, json_object, read_inputs, write_dataset

TXT_SPLITS = ("lines", "paragraphs")
SUFFIXES = (".jsonl", ".jsonl.gz", ".txt")


def preprocess(inputs: Sequence[str | Path], tokenizer: Tokenizer, output_prefix: str | Path, *,
               json_key: str = "text", txt_split: str | None = None, workers: int = 1, append_eod: bool = True,
               skip_bad_lines: bool = False, overwrite: bool = False, chunksize: int = 64,
               progress: bool = True) -> dict[str, Any]:
    """Tokenizes the documents of ``inputs`` (.jsonl, .jsonl.gz, .txt; see the module docstring) into
    ``output_prefix``.bin/.idx/.tokenizer.json. Returns the stats: docs, tokens, bytes (of input read), seconds,
    mb_per_s, docs_per_s, empty_docs, bad_lines, workers."""
    paths = input_paths(inputs, SUFFIXES, "unsupported file type")
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
