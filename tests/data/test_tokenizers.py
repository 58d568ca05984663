"""megakern/data/tokenizers.py: round trips, GPT-2's known ids on tinyshakespeare (from ../shared/data, skipped with
a message where it is absent), a Hugging Face tokenizer.json, configs, and a clear error for every bad input."""
import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import conftest
import pytest

from megakern.data.tokenizers import (
    ByteTokenizer, CharTokenizer, GPT2BPETokenizer, HFTokenizer, Tokenizer, _gpt2_alphabet, load_tokenizer,
)

# ../shared/data/README.md
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SAMPLES = ["Hello world", "", "  two  spaces\n\nand\ttabs \r\n", "I'm don't we'll", "naïve café 日本語 🎉",
           "x" * 3000]


def shared_data() -> Path:
    return conftest.shared_data("tinyshakespeare.txt", "gpt2")


@pytest.fixture(scope="module")
def gpt2_dir() -> Path:
    folder = shared_data() / "gpt2"
    for name, sha in GPT2_SHA256.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha, f"{folder / name} is not GPT-2's"
    return folder


@pytest.fixture(scope="module")
def gpt2(gpt2_dir) -> GPT2BPETokenizer:
    pytest.importorskip("tiktoken")
    return load_tokenizer(f"gpt2:{gpt2_dir}")


@pytest.fixture(scope="module")
def shakespeare() -> str:
    path = shared_data() / "tinyshakespeare.txt"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHAKESPEARE_SHA256
    return path.read_text(encoding="utf-8")


def tiny_gpt2_files(folder: Path, merges=(("h", "e"), ("l", "l"), ("he", "ll"))) -> tuple[Path, Path]:
    """A miniature GPT-2-format pair: the 256 byte tokens, ``merges``, then '<|endoftext|>'."""
    vocab = {c: b for b, c in _gpt2_alphabet().items()}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "encoder.json").write_text(json.dumps(vocab))
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return folder / "encoder.json", folder / "vocab.bpe"


def test_byte_round_trip():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod_id, tok.name) == (257, 256, "byte")
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and tok.decode(ids + [tok.eod_id]) == text
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut UTF-8 sequence is replaced, not an error
    assert Tokenizer.from_config(tok.to_config()).name == "byte"


def test_char_round_trip_and_unknown_character(tmp_path):
    tok = CharTokenizer.from_text("hello world\n")
    assert tok.chars == "\n dehlorw" and tok.vocab_size == 10 and tok.eod_id == 9
    assert tok.decode(tok.encode("hello\nworld") + [tok.eod_id]) == "hello\nworld"
    with pytest.raises(ValueError, match=r"character 'é' \(U\+00E9, position 3\)"):
        tok.encode("helé")
    again = Tokenizer.from_config(json.loads(json.dumps(tok.to_config())))
    assert again.chars == tok.chars and again.name == tok.name
    (tmp_path / "vocab.json").write_text(json.dumps(tok.to_config()))
    (tmp_path / "corpus.txt").write_text("hello world\n")
    assert load_tokenizer(f"char:{tmp_path / 'vocab.json'}").chars == tok.chars
    assert load_tokenizer(f"char:{tmp_path / 'corpus.txt'}").chars == tok.chars
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("aba")


def test_char_tokenizer_on_shakespeare(shakespeare):
    tok = CharTokenizer.from_text(shakespeare)
    assert tok.vocab_size == 66 and tok.decode(tok.encode(shakespeare)) == shakespeare


def test_gpt2_known_ids(gpt2):
    assert (gpt2.vocab_size, gpt2.eod_id) == (50257, 50256)
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]  # text, never the eod id
    assert gpt2.decode([gpt2.eod_id]) == "<|endoftext|>"
    for text in SAMPLES:
        assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_on_tinyshakespeare(gpt2, shakespeare):
    ids = gpt2.encode(shakespeare)
    assert len(ids) == 338_025 and gpt2.decode(ids) == shakespeare


def test_gpt2_config_records_the_files(gpt2, gpt2_dir, tmp_path):
    config = json.loads(json.dumps(gpt2.to_config()))
    assert config["sha256"] in gpt2.name and Tokenizer.from_config(config).name == gpt2.name
    copy = tmp_path / "gpt2"
    shutil.copytree(gpt2_dir, copy)
    moved = dict(config, encoder_json=str(copy / "encoder.json"), vocab_bpe=str(copy / "vocab.bpe"))
    assert Tokenizer.from_config(moved).name == gpt2.name
    vocab = json.loads((copy / "encoder.json").read_text())
    (copy / "encoder.json").write_text(json.dumps(vocab, indent=1))  # the same vocabulary in other bytes
    with pytest.raises(ValueError, match="changed since it was recorded"):
        Tokenizer.from_config(moved)


def test_tiny_gpt2_format(tmp_path):
    pytest.importorskip("tiktoken")
    tok = GPT2BPETokenizer(*tiny_gpt2_files(tmp_path))
    assert tok.vocab_size == 260 and tok.eod_id == 259
    assert tok.encode("hello") == [258, ord("o")]  # 'o' is printable ASCII: its alphabet id is its byte
    assert tok.decode(tok.encode("hello, wörld")) == "hello, wörld"


def test_gpt2_file_errors(tmp_path):
    pytest.importorskip("tiktoken")
    encoder, merges = tiny_gpt2_files(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope.json")):
        GPT2BPETokenizer(tmp_path / "nope.json", merges)
    with pytest.raises(FileNotFoundError, match="directory"):
        load_tokenizer(f"gpt2:{tmp_path / 'nowhere'}")
    good = encoder.read_text()
    encoder.write_text(good[:-10])
    with pytest.raises(ValueError, match=f"{encoder} is not valid JSON"):
        GPT2BPETokenizer(encoder, merges)
    encoder.write_text(json.dumps({k: v for k, v in json.loads(good).items() if k != "<|endoftext|>"}))
    with pytest.raises(ValueError, match="no '<|endoftext|>' token"):
        GPT2BPETokenizer(encoder, merges)
    encoder.write_text(good)
    merges.write_text("#version: 0.2\nh e\nl l l\n")
    with pytest.raises(ValueError, match=f"{merges}:3: not a merge"):
        GPT2BPETokenizer(encoder, merges)
    merges.write_text("#version: 0.2\nl l\nh e\n")  # merge order disagrees with the ids
    with pytest.raises(ValueError, match=f"{merges}:3: the merge result 'he' has id 256"):
        GPT2BPETokenizer(encoder, merges)


def test_missing_or_old_library_is_named(tmp_path, monkeypatch):
    files = tiny_gpt2_files(tmp_path)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # not installed
    with pytest.raises(ImportError, match="the GPT-2 tokenizer needs the tiktoken package .*pip install 'tiktoken>="):
        GPT2BPETokenizer(*files)
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(__version__="0.1.0"))
    with pytest.raises(ImportError, match="needs tiktoken>=.*, found tiktoken 0.1.0"):
        GPT2BPETokenizer(*files)


@pytest.fixture(scope="module")
def gpt2_tokenizer_json(gpt2_dir, tmp_path_factory) -> Path:
    """GPT-2 as a Hugging Face tokenizer.json, built from the two files by the tokenizers library."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(gpt2_dir / "encoder.json"),
                                                               str(gpt2_dir / "vocab.bpe")))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_matches_gpt2(gpt2_tokenizer_json, gpt2, shakespeare):
    tok = load_tokenizer(f"hf:{gpt2_tokenizer_json}")
    assert (tok.vocab_size, tok.eod_id, tok.eod_token) == (50257, 50256, "<|endoftext|>")
    assert tok.encode("<|endoftext|>") == gpt2.encode("<|endoftext|>")  # text, never the eod id
    ids = tok.encode(shakespeare)
    assert ids == gpt2.encode(shakespeare) and tok.decode(ids) == shakespeare
    assert Tokenizer.from_config(tok.to_config()).name == tok.name


def test_hf_tokenizer_errors(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match="--eod-token"):
        HFTokenizer(path)
    with pytest.raises(ValueError, match="no token '</s>'"):
        load_tokenizer(f"hf:{path}", eod_token="</s>")
    assert load_tokenizer(f"hf:{path}", eod_token="b").encode("a b a") == [0, 1, 0]
    path.write_text("{ not json")
    with pytest.raises(ValueError, match=f"{path} is not a valid Hugging Face tokenizer.json"):
        HFTokenizer(path, "b")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        HFTokenizer(tmp_path / "nope.json")


def test_bad_specs_configs_and_ids():
    for spec, message in [("bpe", "unknown tokenizer spec 'bpe'"), ("char:", "unknown tokenizer spec"),
                          ({"type": "sentencepiece"}, "unknown tokenizer type 'sentencepiece'"),
                          ({"chars": "ab"}, "with a 'type' key"),
                          ({"type": "char", "chars": "ab", "size": 3}, "does not fit CharTokenizer")]:
        with pytest.raises(ValueError, match=message):
            load_tokenizer(spec)
    with pytest.raises(ValueError, match="'hf:' tokenizers only"):
        load_tokenizer("byte", eod_token="</s>")
    with pytest.raises(ValueError, match="CharTokenizer.from_config got a config of type 'byte'"):
        CharTokenizer.from_config({"type": "byte"})
    with pytest.raises(ValueError, match=r"id 257 is outside the vocabulary \[0, 257\)"):
        ByteTokenizer().decode([1, 257])
    with pytest.raises(TypeError, match="encode takes a str"):
        ByteTokenizer().encode(b"bytes")


def _sentencepiece_style_json(path: Path, text: str) -> Path:
    """A tokenizer.json as transformers converts a SentencePiece BPE model (Llama 2, Mistral): a BPE with byte
    fallback (<0x00> .. <0xFF> in the vocabulary), the Metaspace prepend / replace of spaces by '▁', and the decoder
    chain Replace('▁', ' ') + ByteFallback + Fuse + Strip(one leading space); <unk>, <s>, </s> special."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_],
                                  initial_alphabet=sorted(set(text.replace(" ", "▁"))), show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_converted_from_sentencepiece(tmp_path):
    """A SentencePiece-style tokenizer.json (Llama 2's layout): ids equal transformers' fast tokenizer's for text with
    characters outside the vocabulary (byte fallback), decode gives the text back, and '</s>' is the eod."""
    transformers = pytest.importorskip("transformers")
    corpus = "the quick brown fox jumps over the lazy dog. " * 40 + "Sphinx of black quartz, judge my vow."
    path = _sentencepiece_style_json(tmp_path / "tokenizer.json", corpus)
    tok = load_tokenizer(f"hf:{path}")
    assert tok.eod_token == "</s>" and tok.eod_id == 2 and tok.vocab_size <= 600
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    for text in ("the lazy dog", "naïve café 日本語 🎉", "  two  spaces\nand\ttabs", "Judge", "x" * 50):
        ids = tok.encode(text)
        assert ids == fast.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text, text
    assert any(3 <= i < 3 + 256 for i in tok.encode("🎉"))  # the emoji's UTF-8 bytes, as <0xF0> <0x9F> ...
