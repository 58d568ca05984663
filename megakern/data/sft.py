"""Supervised fine-tuning (SFT) data: prompt/response or chat examples in JSONL -> a megakern dataset whose loss mask
(PREFIX.mask.bin, ``megakern.data.indexed``) marks the tokens trained, the responses'.

    python -m megakern.data.preprocess --format sft --input chats.jsonl --tokenizer hf:tokenizer.json \\
        --chat-template tokenizer_config.json --max-length 4096 --output-prefix data/sft

Examples, one JSON object per line (.jsonl, .jsonl.gz; blank lines are ignored), in either form:

- ``{"prompt": str, "response": str}``: the prompt's text then the response's, as they are (the prompt carries its own
  format, Alpaca-style); trained: the response and the end-of-document token.
- ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``: a conversation, rendered by a
  chat template; trained: every assistant message's content and the end of its turn, and the end-of-document token
  when the conversation ends with an assistant message. System and user messages and the role headers are not.

Chat templates:

- ``plain`` (the default, ``PlainChatTemplate``): role headers in plain text, for any tokenizer (Phi-3's layout)::

      <|system|>\\n{content}<|end|>\\n<|user|>\\n{content}<|end|>\\n<|assistant|>\\n{content}<|end|>\\n

  An assistant's ``{content}<|end|>\\n`` is trained, its header ``<|assistant|>\\n`` is not. ``PLAIN_CHAT_TEMPLATE``
  is the same as a Hugging Face (jinja) chat template, for generation with other tools; ``render(messages,
  add_generation_prompt=True)`` gives the prompt of a reply.
- a Hugging Face chat template (``HFChatTemplate``): the ``chat_template`` of a ``tokenizer_config.json`` (or a
  ``chat_template.jinja`` beside it, or a .jinja file), rendered with jinja2 as transformers renders it (a sandbox,
  ``raise_exception``, ``bos_token`` / ``eos_token`` from tokenizer_config.json). jinja2 is needed only then. Message
  i's text is what rendering messages[:i+1] adds to rendering messages[:i], and an assistant's header what
  ``add_generation_prompt`` adds: the template must render every message the same whatever follows it
  (prefix-stable; one that drops earlier turns' reasoning is not, and its conversations are refused). The special
  tokens the template writes ('<|im_start|>' ...) are encoded as such; a message that spells one is refused.

Each example becomes one document ending in the tokenizer's end-of-document token (appended, unless the template
wrote it last). The template must not write that token inside a conversation: documents are told apart by it
(``data.packed_documents``); pick another with ``--eod-token``. The text is tokenized piece by piece at the message
and header boundaries, as a prompt is at inference up to the assistant's header. A document's first token is never
trained (it would be predicted from the previous document's end).

Bad examples are errors naming the file and line (``--skip-bad-lines`` skips and counts them instead): a line that
is not JSON or not an object; both forms or neither; a missing or non-string field; an empty prompt, response or
assistant message; no assistant message; a message that is not an object, or of another role; the template's own
errors. ``--max-length N`` bounds an example's tokens (the end-of-document token included): longer ones are dropped
(``--overlong drop``, the default), truncated (``truncate``: the first N - 1 tokens and the end-of-document token,
which is then not trained; dropped if nothing trained is left) or an error (``error``), and the count of dropped and
truncated examples is reported. A tokenizer that cannot encode a text, or whose ids do not fit the dataset's
dtype, is always an error.

``preprocess_sft()`` is the same as a function, ``preprocess_examples()`` takes the examples as dicts.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megakern.data.tokenizers import Tokenizer
from megakern.data.writer import input_paths, json_object, read_inputs, write_dataset

ROLES = ("system", "user", "assistant")
OVERLONG = ("drop", "truncate", "error")
MIN_JINJA2 = (3, 0)

# PlainChatTemplate as a Hugging Face chat template (jinja2; rendered with trim_blocks and lstrip_blocks as
# transformers does).
PLAIN_CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
                       "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

Segments = list[tuple[str, bool]]  # (text, trained), in order


class ChatTemplate:
    """Renders a conversation (checked messages: dicts with a known 'role' and a str 'content') as text."""

    name: str
    special_tokens = False  # whether its text is encoded with the tokenizer's special tokens recognized

    def segments(self, messages: Sequence[Mapping[str, Any]]) -> Segments:
        """The conversation's text in pieces, each with whether it is trained."""
        raise NotImplementedError

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation's text; with ``add_generation_prompt`` followed by an assistant's header (a prompt)."""
        raise NotImplementedError


class PlainChatTemplate(ChatTemplate):
    """Role headers in plain text (see the module doc): ``<|role|>\\n{content}<|end|>\\n`` per message."""

    name = "plain"

    def segments(self, messages: Sequence[Mapping[str, Any]]) -> Segments:
        out = []
        for m in messages:
            out.append((f"<|{m['role']}|>\n", False))
            out.append((f"{m['content']}<|end|>\n", m["role"] == "assistant"))
        return out

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        return "".join(text for text, _ in self.segments(messages)) + ("<|assistant|>\n" * add_generation_prompt)


class HFChatTemplate(ChatTemplate):
    """A Hugging Face chat template (jinja2) from ``path``: a tokenizer_config.json (its 'chat_template', a string or
    the list of named templates whose 'default' is taken; else a chat_template.jinja beside it) or a template file
    (with the special-token variables of a tokenizer_config.json beside it, if there is one)."""

    special_tokens = True

    def __init__(self, path: str | Path):
        self.path = Path(path)
        _jinja2()  # a clear ImportError now, not in a worker
        config, source = {}, None
        if self.path.suffix == ".json":
            config = _read_json_object(self.path)
            source = config.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                if "default" not in named:
                    raise ValueError(f"{self.path}: 'chat_template' is a list of templates without one named "
                                     f"'default' (names: {', '.join(map(str, named))})")
                source = named["default"]
            if source is None and (beside := self.path.with_name("chat_template.jinja")).is_file():
                source = _read_text(beside, "chat template")
            if source is None:
                raise ValueError(f"{self.path} has no 'chat_template' (and no chat_template.jinja beside it); use "
                                 "--chat-template plain, or a tokenizer_config.json that has one")
        else:
            source = _read_text(self.path, "chat template")
            if (beside := self.path.with_name("tokenizer_config.json")).is_file():
                config = _read_json_object(beside)
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{self.path}: the chat template is {type(source).__name__ if source else 'empty'}, "
                             "not a jinja template string")
        self.source = source
        self.variables = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                self.variables[key] = value
        self.name = f"hf-chat:{hashlib.sha256(source.encode()).hexdigest()[:16]}"
        self._template = None
        try:
            self._compiled()
        except Exception as exc:  # jinja2.TemplateSyntaxError and the like
            raise ValueError(f"{self.path}: the chat template does not compile: {exc}") from None

    def __getstate__(self) -> dict:  # the compiled template does not pickle: workers compile their own
        return {**self.__dict__, "_template": None}

    def _compiled(self):
        if self._template is None:
            jinja2 = _jinja2()
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(self.source)
        return self._template

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        try:
            return self._compiled().render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                           **self.variables)
        except Exception as exc:  # raise_exception's TemplateError, and whatever the template trips on
            raise ValueError(f"the chat template failed: {type(exc).__name__}: {exc}") from None

    def segments(self, messages: Sequence[Mapping[str, Any]]) -> Segments:
        out, done = [], ""
        for i, m in enumerate(messages):
            assistant = m["role"] == "assistant"
            steps = [(self.render(messages[:i], add_generation_prompt=True), False)] if assistant else []
            steps.append((self.render(messages[:i + 1]), assistant))
            for text, trained in steps:
                if not text.startswith(done):
                    extends = ("the first {i} messages and their generation prompt (add_generation_prompt)" if assistant
                               else "the first {i} messages").format(i=i)
                    raise ValueError(
                        f"the chat template is not prefix-stable: rendering message {i + 1} ({m['role']}) does not "
                        f"extend the text of {extends}, so the tokens of each message cannot be told apart; loss "
                        "masking needs a template that renders every message the same whatever follows it, and "
                        "starts an assistant's message with its generation prompt")
                out.append((text[len(done):], trained))
                done = text
        return out


def load_chat_template(spec: str | Path | ChatTemplate) -> ChatTemplate:
    """'plain', a path (HFChatTemplate), or a ChatTemplate as it is."""
    if isinstance(spec, ChatTemplate):
        return spec
    if spec == "plain":
        return PlainChatTemplate()
    if not isinstance(spec, (str, Path)) or not str(spec):
        raise ValueError(f"a chat template is 'plain' or the path of a tokenizer_config.json or .jinja file, got "
                         f"{spec!r}")
    if not Path(spec).is_file():
        raise FileNotFoundError(f"chat template {spec} does not exist (expected 'plain', a tokenizer_config.json "
                                "or a .jinja file)")
    return HFChatTemplate(spec)


def _jinja2():
    from megakern.data.tokenizers import _require

    try:
        return _require("jinja2", MIN_JINJA2, "a Hugging Face chat template")
    except ImportError as exc:
        raise ImportError(f"{exc}; or use --chat-template plain (the default), which needs none") from None


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None


def _read_json_object(path: Path) -> dict:
    try:
        config = json.loads(_read_text(path, "tokenizer config"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); expected a tokenizer_config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON {type(config).__name__}, not a tokenizer_config.json object")
    return config


class _Unusable(ValueError):
    """An example that no --skip-bad-lines may skip: the setup is wrong, not the line."""


class _Examples:
    """Record (preprocess's) -> (source, line, input bytes, ids or None, loss mask or None, problem or None, whether
    the problem is a skippable bad line, note or None): an SFT example tokenized with its loss mask. Notes:
    ('dropped' | 'truncated', what) for examples over max_length. Runs in the worker processes (or inline)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, *, max_length: int | None, overlong: str,
                 prompt_key: str, response_key: str, messages_key: str):
        self.tokenizer, self.template, self.max_length, self.overlong = tokenizer, template, max_length, overlong
        self.prompt_key, self.response_key, self.messages_key = prompt_key, response_key, messages_key
        self.special = tuple(tokenizer.special_tokens) if template.special_tokens else ()

    def __call__(self, record) -> tuple:
        src, line, kind, payload = record
        if kind == "error":
            return src, line, 0, None, None, payload, False, None
        nbytes = len(payload)
        try:
            segments, special, eod_trained = self.segments(payload)
            ids, mask, note = self.tokenize(segments, special, eod_trained)
        except _Unusable as exc:
            return src, line, nbytes, None, None, str(exc), False, None
        except ValueError as exc:
            return src, line, nbytes, None, None, str(exc), True, None
        if ids is None:
            return src, line, nbytes, None, None, None, False, note
        try:  # int32: half the bytes of int64 back from the workers; the writer checks them against the vocabulary
            ids = np.asarray(ids, dtype=np.int32)
        except OverflowError:
            problem = f"tokenizer {self.tokenizer.name}: an id does not fit int32"
            return src, line, nbytes, None, None, problem, False, None
        return src, line, nbytes, ids, np.asarray(mask, dtype=np.uint8), None, False, note

    def segments(self, payload: bytes) -> tuple[Segments, bool, bool]:
        """(segments, whether they are encoded with special tokens, whether the end-of-document token is trained)
        of a JSONL line; ValueError saying what is wrong with it."""
        obj = json_object(payload)
        pk, rk, mk = self.prompt_key, self.response_key, self.messages_key
        pair = pk in obj or rk in obj
        if mk in obj and pair:
            raise ValueError(f"both {mk!r} and {pk!r}/{rk!r}: an example is a conversation or a prompt and a "
                             "response, not both")
        if mk in obj:
            messages = self._messages(obj[mk])
            segments = self.template.segments(messages)
            return segments, self.template.special_tokens, messages[-1]["role"] == "assistant"
        if not pair:
            keys = ", ".join(map(repr, list(obj)[:8])) or "none"
            raise ValueError(f"neither {mk!r} nor {pk!r} and {rk!r} (keys: {keys}); name them with --messages-key, "
                             "--prompt-key, --response-key")
        texts = []
        for key, what in ((pk, "prompt"), (rk, "response")):
            if key not in obj:
                raise ValueError(f"no {what} {key!r} beside the {'response' if what == 'prompt' else 'prompt'}")
            if not isinstance(obj[key], str):
                raise ValueError(f"{key!r} holds a JSON {type(obj[key]).__name__}, not a string")
            if not obj[key].strip():
                raise ValueError(f"empty {what} {key!r}" + (": nothing to train" if what == "response" else
                                                            ": the response would have nothing to follow"))
            texts.append(obj[key])
        return [(texts[0], False), (texts[1], True)], False, True

    def _messages(self, messages) -> list[dict]:
        mk = self.messages_key
        if not isinstance(messages, list) or not messages:
            what = "an empty list" if isinstance(messages, list) else f"a JSON {type(messages).__name__}"
            raise ValueError(f"{mk!r} holds {what}, not a list of messages")
        for n, m in enumerate(messages, 1):
            if not isinstance(m, dict):
                raise ValueError(f"message {n} is a JSON {type(m).__name__}, not an object with 'role' and 'content'")
            for key in ("role", "content"):
                if key not in m:
                    raise ValueError(f"message {n} has no {key!r}")
                if not isinstance(m[key], str):
                    raise ValueError(f"message {n}: {key!r} holds a JSON {type(m[key]).__name__}, not a string")
            if m["role"] not in ROLES:
                raise ValueError(f"message {n} has role {m['role']!r}; known roles: {', '.join(ROLES)}")
            if m["role"] == "assistant" and not m["content"].strip():
                raise ValueError(f"message {n} (assistant) is empty: nothing to train")
            for token in self.special:
                if token in m["content"]:
                    raise ValueError(f"message {n} ({m['role']}) spells the special token {token!r}, which the chat "
                                     "template's text would encode as that token")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("no assistant message: nothing to train")
        return messages

    def tokenize(self, segments: Segments, special: bool, eod_trained: bool):
        """(ids, mask, note) of an example's segments, ids None when it is dropped; _Unusable or ValueError."""
        tok, eod = self.tokenizer, self.tokenizer.eod_id
        encode = tok.encode_with_special_tokens if special else tok.encode
        ids, mask = [], []
        for text, trained in segments:
            if text:
                try:
                    piece = encode(text)
                except ValueError as exc:
                    raise _Unusable(f"tokenizer {tok.name}: {exc}") from None
                ids += piece
                mask += [trained] * len(piece)
        inside = [k for k, t in enumerate(ids[:-1]) if t == eod]
        if inside:
            raise _Unusable(f"the chat template writes the end-of-document token (id {eod}) inside the conversation "
                            f"(token {inside[0]} of {len(ids)}); documents are told apart by that token "
                            "(data.packed_documents), so it may only end them: choose another with --eod-token")
        if not ids or ids[-1] != eod:
            ids.append(eod)
            mask.append(eod_trained)
        mask[0] = False  # predicted from the previous document's end: never trained
        if not any(mask):
            raise ValueError("nothing to train: the response's text encodes to no tokens")
        note = None
        if self.max_length is not None and len(ids) > self.max_length:
            what = f"{len(ids)} tokens, over max_length {self.max_length}"
            if self.overlong == "error":
                raise _Unusable(f"{what} (--overlong drop or truncate to keep going)")
            if self.overlong == "truncate":
                ids, mask = ids[:self.max_length - 1] + [eod], mask[:self.max_length - 1] + [False]
            if self.overlong == "drop" or not any(mask):
                reason = "" if self.overlong == "drop" else "; nothing trained left after truncating"
                return None, None, ("dropped", what + reason)
            note = ("truncated", what)
        return ids, mask, note


def preprocess_sft(inputs: Sequence[str | Path], tokenizer: Tokenizer, output_prefix: str | Path, *,
                   chat_template: str | Path | ChatTemplate = "plain", max_length: int | None = None,
                   overlong: str = "drop", prompt_key: str = "prompt", response_key: str = "response",
                   messages_key: str = "messages", workers: int = 1, skip_bad_lines: bool = False,
                   overwrite: bool = False, chunksize: int = 64, progress: bool = True) -> dict[str, Any]:
    """Tokenizes the SFT examples of ``inputs`` (.jsonl, .jsonl.gz; see the module doc) into ``output_prefix``.bin/
    .idx/.mask.bin/.tokenizer.json. Returns the stats: docs (examples written), tokens, trained_tokens, dropped,
    truncated, bad_lines, bytes, seconds, mb_per_s, docs_per_s, workers, template."""

    paths = input_paths(inputs, (".jsonl", ".jsonl.gz"), "SFT examples are JSON lines")
    examples = _make_examples(tokenizer, chat_template, max_length, overlong, prompt_key, response_key, messages_key)
    total = None if any(p.name.endswith(".gz") for p in paths) else sum(p.stat().st_size for p in paths)
    return _run_sft(read_inputs(paths, None), [str(p) for p in paths], tokenizer, output_prefix, examples,
                    workers=workers, skip_bad_lines=skip_bad_lines, overwrite=overwrite, chunksize=chunksize,
                    progress=progress, total_bytes=total)


def preprocess_examples(examples: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, output_prefix: str | Path, *,
                        chat_template: str | Path | ChatTemplate = "plain", max_length: int | None = None,
                        overlong: str = "drop", prompt_key: str = "prompt", response_key: str = "response",
                        messages_key: str = "messages", workers: int = 1, skip_bad_lines: bool = False,
                        overwrite: bool = False, chunksize: int = 64, progress: bool = True) -> dict[str, Any]:
    """Like ``preprocess_sft`` for examples given as dicts (errors name '<examples>:N', the Nth example)."""
    make = _make_examples(tokenizer, chat_template, max_length, overlong, prompt_key, response_key, messages_key)
    records = ((0, n, "json", json.dumps(example).encode()) for n, example in enumerate(examples, 1))
    return _run_sft(records, ["<examples>"], tokenizer, output_prefix, make, workers=workers,
                    skip_bad_lines=skip_bad_lines, overwrite=overwrite, chunksize=chunksize, progress=progress,
                    total_bytes=None)


def _make_examples(tokenizer, chat_template, max_length, overlong, prompt_key, response_key,
                   messages_key) -> _Examples:
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a megakern.data.tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 2):
        raise ValueError(f"max_length must be an int >= 2 (tokens, the end-of-document token included) or None, got "
                         f"{max_length!r}")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    keys = {"prompt_key": prompt_key, "response_key": response_key, "messages_key": messages_key}
    for name, key in keys.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name} must be a non-empty str, got {key!r}")
    if len(set(keys.values())) < 3:
        raise ValueError(f"prompt_key, response_key and messages_key must differ, got {list(keys.values())}")
    return _Examples(tokenizer, load_chat_template(chat_template), max_length=max_length, overlong=overlong, **keys)


def _run_sft(records, sources, tokenizer, output_prefix, examples: _Examples, **kw) -> dict[str, Any]:

    stats = write_dataset(records, sources, tokenizer, output_prefix, tokenize=examples, loss_mask=True, **kw)
    stats["template"] = examples.template.name
    return stats
