"""Tokenizers: text to token ids and back, behind one small interface.

Every tokenizer has ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` (ids are in
[0, vocab_size)), ``eod_id`` (the end-of-document id that preprocessing appends), ``name`` (a stable description
that goes into dataset fingerprints; file-based tokenizers carry the sha256 of their files) and ``to_config()``, a
small JSON-able dict recorded next to a dataset from which ``Tokenizer.from_config`` rebuilds the tokenizer
(checking that the files it names still have the recorded checksum).

- ``ByteTokenizer``: the UTF-8 bytes 0..255; eod 256.
- ``CharTokenizer``: one id per character of a fixed alphabet (nanoGPT's shakespeare_char); eod = len(alphabet).
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``encoder.json`` + ``vocab.bpe``, run by tiktoken (identical
  ids to GPT-2's own encoder, about 5x faster than the ``tokenizers`` library on it); eod ``<|endoftext|>``.
- ``HFTokenizer``: any Hugging Face ``tokenizer.json``, run by the ``tokenizers`` library.

Text is always encoded as ordinary text: a document that contains the spelling of a special token (e.g.
'<|endoftext|>') gets the ids of those characters, never the special id, so data cannot forge document ends. The one
exception is ``encode_with_special_tokens``, for text a chat template wrote (megakern.data.sft), whose special tokens
('<|im_start|>', '<|eot_id|>' ...) are meant as such; ``special_tokens`` lists their spellings. Byte and char
tokenizers decode their eod id to nothing (it has no text); GPT-2 and Hugging Face ones to its token string.

``load_tokenizer(spec)`` builds one from a command-line spec ('byte', 'char:PATH', 'gpt2:DIR', 'hf:FILE') or from a
``to_config()`` dict.
"""
from __future__ import annotations

import abc
import hashlib
import importlib
import importlib.metadata
import inspect
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from megakern._deps import version_tuple

# Oldest versions tested (tiktoken 0.5.2, tokenizers 0.19.1; tokenizers needs Tokenizer.encode_special_tokens).
MIN_TIKTOKEN = (0, 5)
MIN_TOKENIZERS = (0, 19)

# GPT-2's pre-tokenization pattern (openai/gpt-2, src/encoder.py).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"
HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")


class Tokenizer(abc.ABC):
    """Text <-> ids. Subclasses set ``vocab_size``, ``eod_id`` and ``name`` in ``__init__``, implement ``_encode``,
    ``_decode`` and ``to_config``, and take ``to_config()``'s fields (less 'type' and 'sha256') as constructor
    arguments."""

    type: ClassVar[str]
    vocab_size: int
    eod_id: int
    name: str
    sha256: str | None = None  # of the files the tokenizer was built from, where it has any

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no eod appended)."""
        if not isinstance(text, str):
            raise TypeError(f"{self.name}: encode takes a str, got {type(text).__name__}")
        return self._encode(text)

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """The ids of ``text`` with the spellings of the tokenizer's special tokens (``special_tokens``) encoded as
        those tokens: for text a chat template wrote, never for data (no eod appended)."""
        if not isinstance(text, str):
            raise TypeError(f"{self.name}: encode takes a str, got {type(text).__name__}")
        return self._encode_special(text)

    def _encode_special(self, text: str) -> list[int]:
        return self._encode(text)  # tokenizers without special tokens

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The spellings of the special tokens that ``encode_with_special_tokens`` recognizes."""
        return ()

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; raises ValueError on an id outside [0, vocab_size)."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{self.name}: id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self._decode(ids)

    @abc.abstractmethod
    def _encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def _decode(self, ids: list[int]) -> str: ...

    @abc.abstractmethod
    def to_config(self) -> dict[str, Any]:
        """A JSON-able dict with 'type' from which ``Tokenizer.from_config`` rebuilds this tokenizer."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer that ``config`` (from ``to_config()``) describes; ValueError if the config is malformed
        or the files it names changed since it was recorded."""
        if not isinstance(config, Mapping) or "type" not in config:
            raise ValueError(f"a tokenizer config is a dict with a 'type' key, got {config!r}")
        kind = TOKENIZER_TYPES.get(config["type"])
        if kind is None:
            raise ValueError(f"unknown tokenizer type {config['type']!r} (known: {', '.join(TOKENIZER_TYPES)})")
        if not issubclass(kind, cls):
            raise ValueError(f"{cls.__name__}.from_config got a config of type {config['type']!r}")
        args = {k: v for k, v in config.items() if k not in ("type", "sha256")}
        try:
            inspect.signature(kind).bind(**args)
        except TypeError as exc:
            raise ValueError(f"tokenizer config {dict(config)!r} does not fit {kind.__name__}: {exc}") from None
        tokenizer = kind(**args)
        if config.get("sha256") not in (None, tokenizer.sha256):
            raise ValueError(f"the files of tokenizer config {dict(config)!r} changed since it was recorded "
                             f"(sha256 now {tokenizer.sha256})")
        return tokenizer

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text as ids 0..255; eod 256 (vocab 257). Decoding replaces invalid UTF-8."""

    type = "byte"

    def __init__(self):
        self.vocab_size, self.eod_id, self.name = 257, 256, "byte"

    def _encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eod_id).decode("utf-8", errors="replace")

    def to_config(self) -> dict[str, Any]:
        return {"type": self.type}


class CharTokenizer(Tokenizer):
    """One id per character of ``chars`` (distinct characters, id = position); eod = len(chars). Encoding a
    character outside ``chars`` raises ValueError naming it."""

    type = "char"

    def __init__(self, chars: str):
        if not isinstance(chars, str) or not chars or len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer takes a non-empty str of distinct characters, got {chars!r:.80}")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}
        self.vocab_size, self.eod_id = len(chars) + 1, len(chars)
        self.name = f"char:{_sha256(chars.encode('utf-8', 'surrogatepass'))}"

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose alphabet is the sorted distinct characters of ``text``."""
        return cls("".join(sorted(set(text))))

    def _encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as exc:
            c = exc.args[0]
            raise ValueError(f"character {c!r} (U+{ord(c):04X}, position {text.index(c)}) is not in the "
                             f"{len(self.chars)}-character vocabulary of {self.name}") from None

    def _decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if i != self.eod_id)

    def to_config(self) -> dict[str, Any]:
        return {"type": self.type, "chars": self.chars}


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from its two files, ``encoder.json`` (token -> id) and ``vocab.bpe`` (the merges, in
    priority order), run by tiktoken. The files are checked for consistency (every token a byte, a merge result or a
    special token; merge results numbered in merge order, which tiktoken's rank-based BPE needs to match GPT-2's);
    eod is '<|endoftext|>'."""

    type = "gpt2"

    def __init__(self, encoder_json: str | Path, vocab_bpe: str | Path):
        tiktoken = _require("tiktoken", MIN_TIKTOKEN, "the GPT-2 tokenizer")
        self.encoder_json, self.vocab_bpe = Path(encoder_json).resolve(), Path(vocab_bpe).resolve()
        vocab_bytes = _read_bytes(self.encoder_json, "GPT-2 vocabulary (encoder.json)")
        merges_bytes = _read_bytes(self.vocab_bpe, "GPT-2 merges (vocab.bpe)")
        ranks, special = _gpt2_ranks(self.encoder_json, vocab_bytes, self.vocab_bpe, merges_bytes)
        if GPT2_EOD not in special:
            raise ValueError(f"{self.encoder_json}: no {GPT2_EOD!r} token (GPT-2's end of document)")
        self._enc = tiktoken.Encoding(f"gpt2-{self.encoder_json}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=special)
        self.vocab_size = max(*ranks.values(), *special.values()) + 1
        self.eod_id = special[GPT2_EOD]
        self.sha256 = _sha256(vocab_bytes, merges_bytes)
        self.name = f"gpt2-bpe:{self.sha256}"

    def _encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def _encode_special(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tuple(sorted(self._enc.special_tokens_set))

    def _decode(self, ids: list[int]) -> str:
        try:
            return self._enc.decode(ids, errors="replace")
        except KeyError as exc:  # an id in the range that the files leave unassigned
            raise ValueError(f"{self.name}: {exc.args[0]}") from None

    def to_config(self) -> dict[str, Any]:
        return {"type": self.type, "encoder_json": str(self.encoder_json), "vocab_bpe": str(self.vocab_bpe),
                "sha256": self.sha256}


class HFTokenizer(Tokenizer):
    """Any Hugging Face ``tokenizer.json``, run by the ``tokenizers`` library. ``eod_token`` names the end-of-document
    token; by default the first of '<|endoftext|>', '</s>', '<eos>' that the vocabulary has. No special tokens (BOS
    and the like) are added by encode: preprocessing appends eod itself."""

    type = "hf"

    def __init__(self, tokenizer_json: str | Path, eod_token: str | None = None):
        tokenizers = _require("tokenizers", MIN_TOKENIZERS, "Hugging Face tokenizers")
        self.tokenizer_json = Path(tokenizer_json).resolve()
        data = _read_bytes(self.tokenizer_json, "Hugging Face tokenizer file")
        try:
            self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the library raises plain Exception for malformed files
            raise ValueError(f"{self.tokenizer_json} is not a valid Hugging Face tokenizer.json: {exc}") from None
        self._tok.encode_special_tokens = True
        if eod_token is None:
            eod_token = next((t for t in HF_EOD_CANDIDATES if self._tok.token_to_id(t) is not None), None)
            if eod_token is None:
                raise ValueError(f"{self.tokenizer_json} has none of the usual end-of-document tokens "
                                 f"{', '.join(HF_EOD_CANDIDATES)}; name its eod token with --eod-token (eod_token=)")
        eod_id = self._tok.token_to_id(eod_token)
        if eod_id is None:
            raise ValueError(f"{self.tokenizer_json} has no token {eod_token!r} (the requested eod token)")
        self.eod_token, self.eod_id = eod_token, eod_id
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        self.sha256 = _sha256(data)
        self.name = f"hf:{self.sha256}"

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _encode_special(self, text: str) -> list[int]:
        self._tok.encode_special_tokens = False  # the special tokens' spellings become their ids, for this call
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = True

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tuple(sorted(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special))

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def to_config(self) -> dict[str, Any]:
        return {"type": self.type, "tokenizer_json": str(self.tokenizer_json), "eod_token": self.eod_token,
                "sha256": self.sha256}


TOKENIZER_TYPES: dict[str, type[Tokenizer]] = {
    t.type: t for t in (ByteTokenizer, CharTokenizer, GPT2BPETokenizer, HFTokenizer)
}

SPEC_FORMS = ("'byte'", "'char:<vocab .json or corpus file>'", "'gpt2:<dir with encoder.json and vocab.bpe>'",
              "'hf:<tokenizer.json>'", "a to_config() dict")


def load_tokenizer(spec: str | Mapping[str, Any], *, eod_token: str | None = None) -> Tokenizer:
    """The tokenizer a spec names: 'byte'; 'char:PATH' (PATH a .json config written by ``CharTokenizer.to_config``,
    or any text file whose characters become the alphabet); 'gpt2:DIR' (DIR holding encoder.json and vocab.bpe);
    'hf:FILE' (a tokenizer.json; ``eod_token`` names its eod token); or a ``to_config()`` dict."""
    if eod_token is not None and not (isinstance(spec, str) and spec.startswith("hf:")):
        raise ValueError(f"eod_token (--eod-token) applies to 'hf:' tokenizers only, not to {spec!r}")
    if isinstance(spec, Mapping):
        return Tokenizer.from_config(spec)
    if not isinstance(spec, str):
        raise TypeError(f"a tokenizer spec is a str or a config dict, got {type(spec).__name__}")
    kind, sep, arg = spec.partition(":")
    if spec == "byte":
        return ByteTokenizer()
    if kind == "char" and arg:
        path = Path(arg)
        data = _read_bytes(path, "char tokenizer file")
        if path.suffix == ".json":
            return CharTokenizer.from_config(_parse_json(path, data, "a char tokenizer config"))
        try:
            return CharTokenizer.from_text(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text ({exc})") from None
    if kind == "gpt2" and arg:
        folder = Path(arg)
        if not folder.is_dir():
            raise FileNotFoundError(f"GPT-2 tokenizer directory {folder} does not exist")
        return GPT2BPETokenizer(folder / "encoder.json", folder / "vocab.bpe")
    if kind == "hf" and arg:
        return HFTokenizer(arg, eod_token)
    raise ValueError(f"unknown tokenizer spec {spec!r}; expected one of {', '.join(SPEC_FORMS)}")


def _require(module: str, minimum: tuple[int, int], purpose: str):
    """The imported optional dependency ``module``, or ImportError saying how to install it."""
    wanted = f"{module}>={'.'.join(map(str, minimum))}"
    try:
        mod = importlib.import_module(module)
        version = getattr(mod, "__version__", None) or importlib.metadata.version(module)
    except ImportError as exc:  # PackageNotFoundError is an ImportError too
        raise ImportError(f"{purpose} needs the {module} package ({exc}); pip install '{wanted}'") from exc
    if version_tuple(version) < minimum:
        raise ImportError(f"{purpose} needs {wanted}, found {module} {version}; pip install -U '{wanted}'")
    return mod


def _sha256(*blobs: bytes) -> str:
    h = hashlib.sha256()
    for blob in blobs:
        h.update(len(blob).to_bytes(8, "little"))
        h.update(blob)
    return h.hexdigest()


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise OSError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _parse_json(path: Path, data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); expected {what}") from None


def _gpt2_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, the alphabet of encoder.json and vocab.bpe."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in mapping)})
    return mapping


def _gpt2_ranks(vocab_path: Path, vocab_data: bytes, merges_path: Path,
                merges_data: bytes) -> tuple[dict[bytes, int], dict[str, int]]:
    """(tiktoken's mergeable ranks, special tokens) of GPT-2-format files, checked for consistency."""
    vocab = _parse_json(vocab_path, vocab_data, "a GPT-2 vocabulary")
    if not isinstance(vocab, dict) or not all(type(v) is int and v >= 0 for v in vocab.values()):
        raise ValueError(f"{vocab_path}: not a GPT-2 vocabulary (a JSON object mapping tokens to ids >= 0)")
    if len(set(vocab.values())) != len(vocab):
        raise ValueError(f"{vocab_path}: several tokens share an id")
    try:
        lines = merges_data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{merges_path} is not UTF-8 text ({exc})") from None
    alphabet = _gpt2_alphabet()
    byte_of = {c: b for b, c in alphabet.items()}
    ranks: dict[bytes, int] = {}
    for b, c in alphabet.items():
        if c not in vocab:
            raise ValueError(f"{vocab_path}: the token of byte {b} ({c!r}) is missing")
        ranks[bytes([b])] = vocab[c]
    previous = max(ranks.values())
    for number, line in enumerate(lines, 1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts) or any(c not in byte_of for c in parts[0] + parts[1]):
            raise ValueError(f"{merges_path}:{number}: not a merge 'A B' of two tokens in GPT-2's byte alphabet: "
                             f"{line!r:.80}")
        token = parts[0] + parts[1]
        if token not in vocab:
            raise ValueError(f"{merges_path}:{number}: the merge result {token!r} is not in {vocab_path}")
        if vocab[token] <= previous:
            raise ValueError(f"{merges_path}:{number}: the merge result {token!r} has id {vocab[token]}, not above "
                             f"the ids of the bytes and earlier merges ({previous}) as GPT-2's format requires")
        previous = vocab[token]
        ranks[bytes(byte_of[c] for c in token)] = previous
    if len(ranks) == len(alphabet):
        raise ValueError(f"{merges_path} holds no merges")
    merged = {"".join(alphabet[b] for b in token) for token in ranks}
    special = {token: i for token, i in vocab.items() if token not in merged}
    return ranks, special
