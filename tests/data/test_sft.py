"""Supervised fine-tuning data (megakern/data/sft.py and the loss mask of indexed.py, gpt_dataset.py, batch.py,
blended.py, build.py): the loss mask exact against hand-written expectations (prompt/response, multi-turn chats under
the plain and a Hugging Face template), targets ignored exactly where it says, whole documents packed with
cu_seqlens at the examples' boundaries, blends of SFT and plain data, every bad input named by file and line with
nothing written, the mask file's own checks, the command line, and a training run on CPU."""
import json
import math
import os
import random
import sys

import numpy as np
import pytest
import torch

from megakern.config import ConfigError, load_config
from megakern.data import (IGNORE_INDEX, BlendedDataset, ByteTokenizer, DataError, GPTDataset, IndexedDataset,
                           build_data, document_offsets, load_tokenizer, to_batch)
from megakern.data import preprocess as pp
from megakern.data.gpt_dataset import PAD_ID, build_packed_indices, pack_documents
from megakern.data.indexed import IndexedDatasetWriter
from megakern.data.preprocess import preprocess_documents
from megakern.data.sft import (PLAIN_CHAT_TEMPLATE, HFChatTemplate, PlainChatTemplate, preprocess_examples,
                               preprocess_sft)
from megakern.data.tokenizers import Tokenizer

BYTE = ByteTokenizer()
EOD = BYTE.eod_id
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def pieces(*parts) -> tuple[list[int], list[int]]:
    """Expected (ids, mask) of (text, trained) pieces under the byte tokenizer; an int is a token id as it is."""
    ids, mask = [], []
    for part, trained in parts:
        new = [part] if isinstance(part, int) else list(part.encode())
        ids += new
        mask += [int(trained)] * len(new)
    return ids, mask


def examples(prefix, rows, **kw):
    return preprocess_examples(rows, kw.pop("tokenizer", BYTE), prefix, progress=False, **kw)


def read(prefix) -> list[tuple[list[int], list[int]]]:
    ds = IndexedDataset(prefix)
    return [(ds.get(i).tolist(), ds.get_mask(i).tolist()) for i in range(len(ds))]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def random_examples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        if i % 2:
            rows.append({"prompt": f"{a} plus {b} is ", "response": f"{a + b}."})
        else:
            rows.append({"messages": [{"role": "user", "content": f"{a} times {b}?"},
                                      {"role": "assistant", "content": f"{a * b}"}]})
    return rows


# -- the mask, by hand ------------------------------------------------------------------------------------------------

def test_prompt_response_mask_exact(tmp_path):
    stats = examples(tmp_path / "d", [{"prompt": "Q: ab\n", "response": "A: cd"}, {"prompt": "x", "response": "y"}])
    assert read(tmp_path / "d") == [pieces(("Q: ab\n", 0), ("A: cd", 1), (EOD, 1)), pieces(("x", 0), ("y", 1),
                                                                                            (EOD, 1))]
    assert (stats["docs"], stats["tokens"], stats["trained_tokens"]) == (2, 15, 8)
    assert (tmp_path / "d.mask.bin").is_file() and IndexedDataset(tmp_path / "d").has_loss_mask


def test_chat_messages_only_assistant_content_trained(tmp_path):
    examples(tmp_path / "d", [{"messages": CHAT}, {"messages": CHAT[1:4]}])
    first = pieces(("<|system|>\nBe brief.<|end|>\n", 0), ("<|user|>\nHi<|end|>\n", 0), ("<|assistant|>\n", 0),
                   ("Hello<|end|>\n", 1), ("<|user|>\n2+2?<|end|>\n", 0), ("<|assistant|>\n", 0), ("4<|end|>\n", 1),
                   (EOD, 1))
    # a conversation that ends with a user message: its end-of-document token is not trained
    second = pieces(("<|user|>\nHi<|end|>\n", 0), ("<|assistant|>\n", 0), ("Hello<|end|>\n", 1),
                    ("<|user|>\n2+2?<|end|>\n", 0), (EOD, 0))
    assert read(tmp_path / "d") == [first, second]
    template = PlainChatTemplate()
    assert template.render(CHAT[:2], add_generation_prompt=True) == ("<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>"
                                                                     "\n<|assistant|>\n")


def test_a_documents_first_token_is_never_trained(tmp_path):
    """An assistant's text first (a template without headers): the token that would be predicted from the previous
    document's end is not trained."""

    class Bare(PlainChatTemplate):
        def segments(self, messages):
            return [(m["content"], m["role"] == "assistant") for m in messages]

    examples(tmp_path / "d", [{"messages": [{"role": "assistant", "content": "ok"}]}], chat_template=Bare())
    assert read(tmp_path / "d") == [([111, 107, EOD], [0, 1, 1])]


# -- Hugging Face chat templates --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A byte-level tokenizer.json with ChatML's special tokens, and a tokenizer_config.json with CHATML."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers.pre_tokenizers import ByteLevel

    folder = tmp_path_factory.mktemp("chatml")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))},
                                                     merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>",
                                  "bos_token": {"content": "<|im_start|>"}}))
    return load_tokenizer(f"hf:{folder / 'tokenizer.json'}"), config


def test_hf_chat_template_special_tokens_and_mask(tmp_path, chatml):
    tok, config = chatml
    eod, start, end = (tok.encode_with_special_tokens(t)[0] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert (eod, start, end) == (256, 257, 258) and tok.eod_id == eod
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    stats = examples(tmp_path / "d", [{"messages": messages}], tokenizer=tok, chat_template=config)
    enc = tok.encode
    ids = [start, *enc("user\nhi"), end, *enc("\n"), start, *enc("assistant\n"), *enc("yo"), end, *enc("\n"), eod]
    trained = 1 + len(enc("user\nhi")) + 1 + 1 + 1 + len(enc("assistant\n"))  # the first trained position
    assert read(tmp_path / "d") == [(ids, [0] * trained + [1] * (len(ids) - trained))]
    assert stats["template"] == HFChatTemplate(config).name


def test_plain_template_is_its_jinja_form(tmp_path):
    pytest.importorskip("jinja2")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": PLAIN_CHAT_TEMPLATE}))
    hf, plain = HFChatTemplate(config), PlainChatTemplate()

    def characters(segments):  # each character and whether it is trained
        return [(c, trained) for text, trained in segments for c in text]

    for conversation in (CHAT, CHAT[1:3], CHAT[1:4]):
        assert characters(hf.segments(conversation)) == characters(plain.segments(conversation))
        for prompt in (False, True):
            assert hf.render(conversation, prompt) == plain.render(conversation, prompt)
    examples(tmp_path / "a", [{"messages": CHAT}], chat_template=config)
    examples(tmp_path / "b", [{"messages": CHAT}])
    assert read(tmp_path / "a") == read(tmp_path / "b")


def test_hf_template_errors(tmp_path, chatml):
    tok, config = chatml
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "x <|im_end|> y"},
                                                            {"role": "assistant", "content": "ok"}]}])
    with pytest.raises(DataError, match=f"{src}:1: message 1 \\(user\\) spells the special token '<\\|im_end\\|>'"):
        preprocess_sft([src], tok, tmp_path / "o", chat_template=config, progress=False)

    def template(name, source, **extra):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"chat_template": source, **extra}))
        return path

    turns = [{"messages": CHAT[1:]}]
    unstable = template("unstable", "{% for m in messages %}{% if loop.last %}[{{ m['role'] }}]{% else %}"
                                     "<{{ m['role'] }}>{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match="<examples>:1: the chat template is not prefix-stable: rendering message 2 "
                                        "\\(assistant\\) does not extend the text of the first 1 messages and their "
                                        "generation prompt"):
        examples(tmp_path / "o", turns, tokenizer=tok, chat_template=unstable)
    raising = template("raising", "{% if messages[0]['role'] != 'system' %}{{ raise_exception('start with a system "
                                  "message') }}{% endif %}" + CHATML)
    with pytest.raises(DataError, match="the chat template failed: TemplateError: start with a system message"):
        examples(tmp_path / "o", turns, tokenizer=tok, chat_template=raising)
    # eos after every assistant message: one conversation ends with it (not doubled); inside one it is refused, even
    # with --skip-bad-lines (the setup is wrong, not the line)
    eos = template("eos", CHATML.replace("'<|im_end|>' + '\\n'", "'<|im_end|>' + '\\n' + (eos_token if "
                                                                 "message['role'] == 'assistant' else '')"),
                   eos_token="<|endoftext|>")
    examples(tmp_path / "one", [{"messages": CHAT[1:3]}], tokenizer=tok, chat_template=eos)
    ((ids, mask),) = read(tmp_path / "one")
    assert ids.count(tok.eod_id) == 1 and ids[-1] == tok.eod_id and mask[-1] == 1
    with pytest.raises(DataError, match="writes the end-of-document token \\(id 256\\) inside the conversation .*"
                                        "--eod-token"):
        examples(tmp_path / "o", turns, tokenizer=tok, chat_template=eos, skip_bad_lines=True)
    with pytest.raises(ValueError, match="does not compile"):
        HFChatTemplate(template("broken", "{% for m in messages %}"))
    with pytest.raises(ValueError, match="has no 'chat_template'"):
        HFChatTemplate(template("none", None))
    with pytest.raises(FileNotFoundError, match="chat template nope.json does not exist"):
        examples(tmp_path / "o", turns, chat_template="nope.json")
    assert not list(tmp_path.glob("o.*"))


def test_hf_template_needs_jinja2(tmp_path, monkeypatch):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHATML}))
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 fails
    with pytest.raises(ImportError, match="a Hugging Face chat template needs the jinja2 package.*--chat-template "
                                          "plain"):
        examples(tmp_path / "o", [{"messages": CHAT}], chat_template=config)
    examples(tmp_path / "o", [{"messages": CHAT}])  # the plain template needs none


# -- bad input --------------------------------------------------------------------------------------------------------

def _msg(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


BAD = [
    ('{"prompt": "a", "response": "b"', "not valid JSON"),
    ([1, 2], "a JSON list, not an object"),
    ({"prompt": "a"}, "no response 'response' beside the prompt"),
    ({"response": "a"}, "no prompt 'prompt' beside the response"),
    ({"text": "a"}, "neither 'messages' nor 'prompt' and 'response' \\(keys: 'text'\\)"),
    ({"prompt": "a", "response": "b", **_msg(("user", "a"), ("assistant", "b"))}, "both 'messages' and"),
    ({"prompt": "a", "response": ""}, "empty response 'response': nothing to train"),
    ({"prompt": "a", "response": " \n"}, "empty response 'response': nothing to train"),
    ({"prompt": "", "response": "b"}, "empty prompt 'prompt'"),
    ({"prompt": 1, "response": "b"}, "'prompt' holds a JSON int, not a string"),
    ({"messages": []}, "'messages' holds an empty list, not a list of messages"),
    ({"messages": "hi"}, "'messages' holds a JSON str, not a list of messages"),
    ({"messages": ["hi"]}, "message 1 is a JSON str, not an object"),
    ({"messages": [{"role": "user"}]}, "message 1 has no 'content'"),
    ({"messages": [{"content": "x"}]}, "message 1 has no 'role'"),
    ({"messages": [{"role": "user", "content": None}]}, "message 1: 'content' holds a JSON NoneType, not a string"),
    (_msg(("user", "a"), ("tool", "b"), ("assistant", "c")), "message 2 has role 'tool'; known roles: system, user, "
                                                              "assistant"),
    (_msg(("system", "a"), ("user", "b")), "no assistant message: nothing to train"),
    (_msg(("user", "a"), ("assistant", "")), "message 2 \\(assistant\\) is empty: nothing to train"),
]


@pytest.mark.parametrize("row, message", BAD, ids=[m.split(":")[0][:30] for _, m in BAD])
def test_bad_examples_name_file_and_line(tmp_path, row, message):
    good = {"prompt": "ok", "response": "fine"}
    src = write_jsonl(tmp_path / "in.jsonl", [good, row, good])
    with pytest.raises(DataError, match=f"{src}:2: {message}.*--skip-bad-lines skips such lines"):
        preprocess_sft([src], BYTE, tmp_path / "o", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written, no temporary file left
    with pytest.warns(UserWarning, match=f"skipped 1 bad lines, e.g.\n  {src}:2: {message}"):
        stats = preprocess_sft([src], BYTE, tmp_path / "o", progress=False, skip_bad_lines=True)
    assert stats["docs"] == 2 and stats["bad_lines"] == 1 and len(read(tmp_path / "o")) == 2


def test_other_keys(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"instruction": "a", "output": "b"},
                                              {"conversations": [{"role": "user", "content": "u"},
                                                                 {"role": "assistant", "content": "v"}]}])
    preprocess_sft([src], BYTE, tmp_path / "o", prompt_key="instruction", response_key="output",
                   messages_key="conversations", progress=False)
    assert [ids for ids, _ in read(tmp_path / "o")] == [[97, 98, EOD], list(b"<|user|>\nu<|end|>\n<|assistant|>\n"
                                                                            b"v<|end|>\n") + [EOD]]
    for kw, match in [({"max_length": 1}, "max_length must be an int >= 2"), ({"overlong": "cut"}, "overlong must be"),
                      ({"prompt_key": "messages"}, "must differ"),
                      ({"chat_template": 3}, "a chat template is 'plain'")]:
        with pytest.raises(ValueError, match=match):
            preprocess_sft([src], BYTE, tmp_path / "x", progress=False, **kw)
    txt = tmp_path / "in.txt"
    txt.write_text("text")
    with pytest.raises(DataError, match="SFT examples are JSON lines"):
        preprocess_sft([txt], BYTE, tmp_path / "x", progress=False)


def test_overlong_dropped_truncated_or_refused(tmp_path):
    rows = [{"prompt": "abc", "response": "de"},          # 6 tokens
            {"prompt": "abcdefgh", "response": "ij"},     # 11 tokens, the response beyond 8
            {"prompt": "ab", "response": "cdefghijk"}]    # 12 tokens
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.warns(UserWarning, match=f"dropped 2 examples, e.g.\n  {src}:2: 11 tokens, over max_length 8"):
        stats = preprocess_sft([src], BYTE, tmp_path / "drop", max_length=8, progress=False)
    assert (stats["docs"], stats["dropped"], stats["truncated"]) == (1, 2, 0)
    with pytest.warns(UserWarning) as caught:
        stats = preprocess_sft([src], BYTE, tmp_path / "cut", max_length=8, overlong="truncate", progress=False)
    text = "\n".join(str(w.message) for w in caught)
    assert f"{src}:2: 11 tokens, over max_length 8; nothing trained left after truncating" in text
    assert f"truncated 1 examples, e.g.\n  {src}:3: 12 tokens, over max_length 8" in text
    assert (stats["docs"], stats["dropped"], stats["truncated"]) == (2, 1, 1)
    # truncated: the first 7 tokens and the end-of-document token, which is not trained (the response was cut)
    assert read(tmp_path / "cut") == [pieces(("abc", 0), ("de", 1), (EOD, 1)), pieces(("ab", 0), ("cdefg", 1),
                                                                                    (EOD, 0))]
    with pytest.raises(DataError, match=f"{src}:2: 11 tokens, over max_length 8 \\(--overlong drop or truncate"):
        preprocess_sft([src], BYTE, tmp_path / "err", max_length=8, overlong="error", skip_bad_lines=True,
                       progress=False)
    assert not list(tmp_path.glob("err*"))


class _Huge(Tokenizer):
    """Ids beyond its vocabulary, or beyond int32."""

    type = "huge"

    def __init__(self, big):
        self.vocab_size, self.eod_id, self.name, self.big = 300, 299, "huge", big

    def _encode(self, text):
        return [1, self.big] if "!" in text else [1]

    def _decode(self, ids):
        return ""

    def to_config(self):
        return {"type": self.type}


def test_tokenizer_errors_name_file_and_line(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "a", "response": "b!"}])
    with pytest.raises(DataError, match=f"{src}:2: document 1: token id 70000 outside the vocabulary \\[0, 300\\) "
                                        "\\(tokenizer huge\\)"):
        preprocess_sft([src], _Huge(70_000), tmp_path / "o", progress=False, skip_bad_lines=True)
    with pytest.raises(DataError, match=f"{src}:2: tokenizer huge: an id does not fit int32"):
        preprocess_sft([src], _Huge(1 << 40), tmp_path / "o", progress=False)
    chars = tmp_path / "chars.txt"
    chars.write_text("ab<|>\nuserntd")
    with pytest.raises(DataError, match=f"{src}:2: tokenizer char:.*character '!'"):
        preprocess_sft([src], load_tokenizer(f"char:{chars}"), tmp_path / "o", progress=False, skip_bad_lines=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chars.txt", "in.jsonl"]


def test_outputs_refused_unless_overwrite_and_workers_agree(tmp_path):
    rows = random_examples(300, 0)
    one = examples(tmp_path / "one", rows)
    two = examples(tmp_path / "two", rows, workers=2, chunksize=8)
    assert read(tmp_path / "one") == read(tmp_path / "two") and one["trained_tokens"] == two["trained_tokens"]
    (tmp_path / "three.mask.bin").write_bytes(b"")
    with pytest.raises(FileExistsError, match="three.mask.bin already exist"):
        examples(tmp_path / "three", rows)
    examples(tmp_path / "three", rows, overwrite=True)
    assert read(tmp_path / "three") == read(tmp_path / "one")
    # a plain dataset written over an SFT one takes its mask away
    preprocess_documents(["plain text"], BYTE, tmp_path / "three", overwrite=True, progress=False)
    assert not (tmp_path / "three.mask.bin").exists() and not IndexedDataset(tmp_path / "three").has_loss_mask


def test_command_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", random_examples(20, 1))
    stats = pp.main(["--format", "sft", "--input", str(src), "--tokenizer", "byte", "--output-prefix",
                     str(tmp_path / "o"), "--max-length", "64", "--quiet"])
    out = capsys.readouterr().out
    assert f"{tmp_path / 'o'}: 20 examples" in out and "template plain" in out and f"{stats['trained_tokens']:,} " \
        "trained" in out
    examples(tmp_path / "f", random_examples(20, 1), max_length=64)
    assert read(tmp_path / "o") == read(tmp_path / "f")
    for argv, flag in [(["--format", "sft", "--json-key", "x"], "--json-key do not apply to --format sft"),
                       (["--max-length", "5"], "--max-length do not apply to --format text")]:
        with pytest.raises(SystemExit):
            pp.main(["--input", str(src), "--tokenizer", "byte", "--output-prefix", str(tmp_path / "x"), *argv])
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pp.main(["--format", "sft", "--input", str(src), "--tokenizer", "byte", "--output-prefix", str(tmp_path / "x"),
                 "--chat-template", str(tmp_path / "missing.json")])
    assert "missing.json does not exist" in capsys.readouterr().err


# -- the mask file ----------------------------------------------------------------------------------------------------

def _sft(tmp_path, name="d", n=40):
    examples(tmp_path / name, random_examples(n, 2))
    return tmp_path / name


@pytest.mark.parametrize("damage", ["missing", "truncated", "appended", "flipped", "value", "other-pair",
                                    "stale", "bad-magic"])
def test_mask_file_checked(tmp_path, damage):
    prefix = _sft(tmp_path)
    mask = tmp_path / "d.mask.bin"
    raw = bytearray(mask.read_bytes())
    if damage == "missing":
        mask.unlink()
        match = "d.mask.bin: missing; d.bin was written with a loss mask"
    elif damage == "truncated":
        mask.write_bytes(raw[:-3])
        match = "d.mask.bin: .* bytes, expected"
    elif damage == "appended":
        mask.write_bytes(raw + b"\0")
        match = "truncated or appended"
    elif damage in ("flipped", "value"):
        first = IndexedDataset(prefix).sizes[0]
        raw[56 + int(first) + 3] ^= 0x01 if damage == "flipped" else 0x02  # a token of the second example
        mask.write_bytes(bytes(raw))
        match = "d.mask.bin: checksum mismatch in the mask of tokens 0..\\d+ \\(chunk 0\\)"
    elif damage == "other-pair":
        _sft(tmp_path, "other")
        os.replace(tmp_path / "other.mask.bin", mask)
        match = "d.mask.bin does not belong to .*d.idx"
    elif damage == "stale":
        preprocess_documents(["x" * 50], BYTE, tmp_path / "plain", progress=False)
        os.replace(mask, tmp_path / "plain.mask.bin")
        prefix = tmp_path / "plain"
        match = "plain.mask.bin: a loss mask beside plain.bin, which was written without one"
    else:
        raw[:8] = b"XXXXXXXX"
        mask.write_bytes(bytes(raw))
        match = "not a megakern loss mask"
    with pytest.raises(DataError, match=match):
        IndexedDataset(prefix)


def test_mask_writer_and_verify_refuse_bad_masks(tmp_path):
    for mask, match in [([0, 1], "loss mask of shape \\(2,\\) for 3 tokens"),
                        ([0, 2, 1], "loss mask values must be 0 or 1"),
                        ([1, 1, 1], "its first token is marked trained"), (None, "no loss mask")]:
        with pytest.raises(ValueError, match=f"document 0: {match}"):
            with IndexedDatasetWriter(tmp_path / "w", 300, loss_mask=True) as w:
                w.add_document([1, 2, 3], mask)
    with pytest.raises(ValueError, match="a loss mask given to a writer without one"):
        with IndexedDatasetWriter(tmp_path / "w", 300) as w:
            w.add_document([1, 2, 3], [0, 1, 1])
    assert not list(tmp_path.iterdir())
    # a hand-made file (right checksums) whose second document starts trained: verify names it
    with IndexedDatasetWriter(tmp_path / "h", 300, loss_mask=True) as w:
        w.add_document([1, 2], [0, 1])
        w._bin.write(np.array([3, 4], w.dtype).tobytes())
        w._checksum(np.array([3, 4], w.dtype).tobytes())
        w._mask.write(b"\1\1")
        w._mask_crcs.update(b"\1\1")
        w._sizes.append(2)
        w._tokens += 2
    with pytest.raises(DataError, match="h.mask.bin: the first token of document 1 is marked trained"):
        IndexedDataset(tmp_path / "h")
    with IndexedDatasetWriter(tmp_path / "v", 300, loss_mask=True) as w:  # a value other than 0 and 1
        w.add_document([1, 2], [0, 1])
        w._mask.seek(-1, os.SEEK_CUR)
        w._mask.write(b"\2")
        w._mask_crcs = type(w._mask_crcs)(w._mask_crcs.chunk_bytes)
        w._mask_crcs.update(b"\0\2")
    with pytest.raises(DataError, match="v.mask.bin: value 2 in chunk 0; a loss mask holds 0 or 1"):
        IndexedDataset(tmp_path / "v")


def test_mask_modification_after_open_detected(tmp_path):
    prefix = _sft(tmp_path)
    ds = IndexedDataset(prefix)
    ds.check_unmodified()
    st = (tmp_path / "d.mask.bin").stat()
    os.utime(tmp_path / "d.mask.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(DataError, match="d.mask.bin: changed on disk since it was opened"):
        ds.check_unmodified()
    (tmp_path / "d.mask.bin").unlink()
    with pytest.raises(DataError, match="d.mask.bin: removed while in use"):
        ds.check_unmodified()


def test_mask_in_the_fingerprint(tmp_path):
    rows = [{"prompt": "ab", "response": "cd"}]
    examples(tmp_path / "a", rows)
    examples(tmp_path / "b", [{"prompt": "a", "response": "bcd"}])  # the same tokens, another mask
    examples(tmp_path / "c", rows)
    a, b, c = (IndexedDataset(tmp_path / n) for n in "abc")
    assert a.tokens.tolist() == b.tokens.tolist() and a.fingerprint != b.fingerprint == b.fingerprint
    assert a.fingerprint == c.fingerprint


# -- samples and batches ----------------------------------------------------------------------------------------------

def test_targets_ignored_exactly_at_the_prompt(tmp_path):
    examples(tmp_path / "one", [{"prompt": "ab", "response": "cd"}])
    ds = GPTDataset(IndexedDataset(tmp_path / "one"), 4, None, 0)
    sample = ds[0]
    assert sample["tokens"].tolist() == [97, 98, 99, 100, EOD]
    assert sample["loss_mask"].tolist() == [False, False, True, True, True]
    batch = to_batch({k: v[None] for k, v in sample.items()}, torch.device("cpu"), None)
    assert batch.inputs.tolist() == [[97, 98, 99, 100]]
    assert batch.targets.tolist() == [[IGNORE_INDEX, 99, 100, EOD]]  # the mask of the token predicted
    assert not GPTDataset(IndexedDataset(tmp_path / "one"), 4, None, 0, loss_mask=False)[0].keys() - {"tokens"}

    import megakern.models.gpt as gpt
    assert IGNORE_INDEX == gpt.IGNORE_INDEX


def test_stream_samples_and_batches_follow_the_mask(tmp_path):
    """Every sample of the shuffled stream, batched: targets are the next tokens, IGNORE_INDEX exactly where the
    stream's mask is 0; with packed documents a target that crosses into the next document (after an eod input) is
    never trained."""
    indexed = IndexedDataset(_sft(tmp_path, n=60))
    ds = GPTDataset(indexed, 16, None, 3)
    stream = np.concatenate([indexed.get(d) for d in ds.doc_idx]).astype(np.int64)
    mask = np.concatenate([indexed.get_mask(d) for d in ds.doc_idx]).astype(bool)
    items = [ds[i] for i in range(len(ds))]
    batch = to_batch({k: torch.stack([it[k] for it in items]) for k in items[0]}, torch.device("cpu"), EOD)
    for i, item in enumerate(items):
        j = int(ds.shuffle_idx[i])
        assert item["tokens"].tolist() == stream[j * 16:j * 16 + 17].tolist()
        expected = np.where(mask[j * 16 + 1:j * 16 + 17], stream[j * 16 + 1:j * 16 + 17], IGNORE_INDEX)
        assert batch.targets[i].tolist() == expected.tolist()
    assert (batch.targets[batch.inputs == EOD] == IGNORE_INDEX).all()
    assert 0 < (batch.targets != IGNORE_INDEX).float().mean() < 0.5


def test_plain_dataset_unchanged(tmp_path):
    preprocess_documents(["some plain text"] * 10, BYTE, tmp_path / "p", progress=False)
    ds = GPTDataset(IndexedDataset(tmp_path / "p"), 8, None, 0)
    sample = ds[0]
    assert list(sample) == ["tokens"]
    batch = to_batch({"tokens": sample["tokens"][None]}, torch.device("cpu"), None)
    assert torch.equal(batch.targets, sample["tokens"][None, 1:])


def test_whole_documents_packed_with_cu_seqlens_at_example_boundaries(tmp_path):
    rows = random_examples(80, 4)
    examples(tmp_path / "d", rows)
    indexed = IndexedDataset(tmp_path / "d")
    seq = 63
    ds = GPTDataset(indexed, seq, None, 5, whole_documents=True)
    assert ds.has_loss_mask and ds.epochs == 1 and 0.5 < ds.fill <= 1
    docs = [ds.doc_idx[int(ds.sample_idx[j, 0]):int(ds.sample_idx[j + 1, 0])].tolist() for j in range(len(ds))]
    assert sorted(d for b in docs for d in b) == list(range(len(indexed)))  # every example once, none split
    items = [ds[i] for i in range(len(ds))]
    batch = to_batch({k: torch.stack([it[k] for it in items]) for k in items[0]}, torch.device("cpu"), EOD)
    cu = batch.cu_seqlens.tolist()
    for i, item in enumerate(items):
        contents = docs[int(ds.shuffle_idx[i])]
        lengths = [int(indexed.sizes[d]) for d in contents]
        used = sum(lengths)
        assert used <= seq + 1
        tokens = np.concatenate([indexed.get(d) for d in contents] + [np.full(seq + 1 - used, PAD_ID)])
        mask = np.concatenate([indexed.get_mask(d) for d in contents] + [np.zeros(seq + 1 - used)]).astype(bool)
        assert item["tokens"].tolist() == tokens.tolist() and item["loss_mask"].tolist() == mask.tolist()
        # the documents of row i: each example, then the padding (if any input is left for it)
        ends = np.cumsum(lengths)
        bounds = [i * seq] + [i * seq + int(e) for e in ends if e < seq] + [(i + 1) * seq]
        assert [b for b in cu if i * seq <= b <= (i + 1) * seq] == bounds
        starts = [0] + [int(e) for e in ends[:-1]]
        assert all(batch.targets[i, s - 1] == IGNORE_INDEX for s in starts if s)  # first tokens never trained
        assert (batch.targets[i, used - 1:] == IGNORE_INDEX).all()  # nor the padding
    offsets, longest = document_offsets(batch.inputs, EOD)
    assert offsets.tolist() == cu and longest <= seq


def test_packing_order_epochs_and_limits():
    sizes = np.array([5, 9, 3, 10, 1, 7, 8, 2])
    order, counts = pack_documents(sizes, np.arange(8), 10, open_bins=2)
    # 5 opens A; 9 opens B; 3 joins A; 10 is full alone; 1 joins A (room 1 left); 7 fits neither: the fullest of
    # A and B (A, the first of equals) closes, 7 opens C; 8 fits neither: B closes, 8 opens D; 2 joins C; C, D close
    groups = [g.tolist() for g in np.split(order, np.cumsum(counts)[:-1])]
    assert groups == [[3], [0, 2, 4], [1], [5, 7], [6]]
    indices, epochs = build_packed_indices(sizes, 9, 0, min_samples=12, max_epochs=5)
    assert epochs == 3 and len(indices.shuffle_idx) >= 12 and len(indices.doc_idx) == 3 * 8
    again, _ = build_packed_indices(sizes, 9, 0, min_samples=12, max_epochs=5)
    assert all(np.array_equal(a, b) for a, b in zip(indices, again))
    exact, _ = build_packed_indices(sizes, 9, 0, num_samples=7, max_epochs=5)
    assert len(exact.shuffle_idx) == 7 and exact.sample_idx[:, 1].tolist() == [0] * 8
    with pytest.raises(DataError, match="30 samples of whole documents .* but max_epochs=2"):
        build_packed_indices(sizes, 9, 0, num_samples=30, max_epochs=2)
    with pytest.raises(DataError, match="2 of 8 documents are longer than a sample of whole documents \\(seq_length 7 "
                                        "\\+ 1 = 8 tokens; the longest has 10\\).*--max-length 8"):
        build_packed_indices(sizes, 7, 0)


def test_whole_documents_cached(tmp_path):
    indexed = IndexedDataset(_sft(tmp_path))
    built = GPTDataset(indexed, 63, None, 1, whole_documents=True, cache_dir=tmp_path / "cache")
    loaded = GPTDataset(indexed, 63, None, 1, whole_documents=True, cache_dir=tmp_path / "cache", strict=True)
    assert isinstance(loaded.doc_idx, np.memmap) and built.fingerprint == loaded.fingerprint
    assert [loaded[i]["tokens"].tolist() for i in range(len(loaded))] == [built[i]["tokens"].tolist()
                                                                          for i in range(len(built))]
    stream = GPTDataset(indexed, 63, None, 1, cache_dir=tmp_path / "cache2")
    assert stream.fingerprint != built.fingerprint


# -- the run's data ---------------------------------------------------------------------------------------------------

def _config(tmp_path, paths, *extra):
    return load_config(None, ["train.device=cpu", "train.steps=2", "train.micro_batch_size=2", "model.max_seqlen=64",
                              "train.seq_length=64", f"data.paths=[{','.join(map(str, paths))}]", "eval.batches=2",
                              "data.valid_fraction=0.2", *extra])


def _build(config, seq_length=64):
    return build_data(config, seq_length=seq_length, eval_seq_length=seq_length, train_samples=8, eval_samples=4,
                      log=lambda m: None)


@pytest.mark.parametrize("whole", [False, True])
def test_blend_of_sft_and_plain_data(tmp_path, whole):
    sft = _sft(tmp_path, "sft", n=120)
    preprocess_documents(["".join(random.Random(i).choice("xyz") for _ in range(25)) for i in range(120)], BYTE,
                         tmp_path / "plain", progress=False)
    data = _build(_config(tmp_path, [sft, tmp_path / "plain"], f"data.whole_documents={str(whole).lower()}"))
    assert isinstance(data.train, BlendedDataset) and data.train.has_loss_mask
    assert "loss masks of sft-train (PREFIX.mask.bin) applied" in data.description
    loader = torch.utils.data.DataLoader(data.train, batch_size=len(data.train))
    sample = next(iter(loader))
    batch = to_batch(sample, torch.device("cpu"), EOD)
    for i in range(len(data.train)):
        plain = data.train.dataset_index[i] == 1
        row = batch.targets[i]
        ignored = (row == IGNORE_INDEX).sum().item()
        if plain:  # every token trains but the padding of whole documents
            assert ignored == (int((sample["tokens"][i, 1:] == PAD_ID).sum()) if whole else 0)
            assert set(batch.inputs[i].tolist()) <= {ord(c) for c in "xyz"} | {EOD, PAD_ID}
        else:
            assert 0 < ignored < len(row)
    valid = data.valid[0]
    assert set(valid) == {"tokens", "loss_mask"}
    off = _build(_config(tmp_path, [sft, tmp_path / "plain"], "data.loss_mask=false"))
    assert not off.train.has_loss_mask and "ignored: data.loss_mask=false" in off.description


def test_single_sft_dataset_whole_documents(tmp_path):
    sft = _sft(tmp_path, "sft", n=120)
    data = _build(_config(tmp_path, [sft], "data.whole_documents=true"))
    assert "whole documents filling" in data.description and data.train.has_loss_mask
    assert len(data.train) >= 8 and data.train.whole_documents and data.valid.whole_documents
    with pytest.raises(DataError, match="data.whole_documents: .*longer than a sample of whole documents"):
        _build(_config(tmp_path, [sft], "data.whole_documents=true"), seq_length=16)
    with pytest.raises(DataError, match="data.whole_documents: the run needs 500 samples .*set data.max_epochs"):
        build_data(_config(tmp_path, [sft], "data.whole_documents=true"), seq_length=64, eval_seq_length=64,
                   train_samples=500, eval_samples=4, log=lambda m: None)


def _sft_run_config(tmp_path, sft, name, *extra):
    return load_config(None, [
        "log.tensorboard=false", "log.progress=false", "train.sample_tokens=0", "data.num_workers=0",
        "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.max_seqlen=64",
        "train.micro_batch_size=2", "eval.every=0", "eval.batches=1", "data.valid_fraction=0.2",
        "checkpoint.final=false", f"data.paths=[{sft}]", "data.whole_documents=true",
        f"log.run_dir={tmp_path / name}", *extra])


@pytest.mark.gpu
def test_gpu_cuda_graph_trains_what_the_mask_keeps(tmp_path):
    """train.cuda_graph on SFT data: the captured step reads each sample's masked targets (not tokens[:, 1:]), so
    its losses equal the eager run's, step by step, after the capture."""
    from megakern.train import Trainer

    sft = _sft(tmp_path, "sft", n=200)
    common = ["train.device=cuda", "train.cuda_graph=false", "train.precision=fp32", "train.steps=6"]
    with open(os.devnull, "w") as quiet:
        eager = Trainer(_sft_run_config(tmp_path, sft, "eager", *common), stream=quiet).run()
        graphed = Trainer(_sft_run_config(tmp_path, sft, "graph", *common, "train.cuda_graph=true",
                                          "train.cuda_graph_warmup=2"), stream=quiet).run()
    assert "captured the training step in a CUDA graph" in (tmp_path / "graph" / "train.log").read_text()
    for s in range(1, 7):
        assert graphed.losses[s] == pytest.approx(eager.losses[s], abs=1e-4), s


def test_training_run_masks_the_prompts(tmp_path, monkeypatch):
    """megakern-train in-process on SFT data with packed whole documents: every batch it trains on ignores exactly
    the targets its samples' masks leave out, and the losses are finite."""
    import megakern.train.step as step
    from megakern.train import Trainer

    sft = _sft(tmp_path, "sft", n=200)
    seen = []

    def spy(sample, device, eod_id):
        seen.append(sample)
        return to_batch(sample, device, eod_id)

    monkeypatch.setattr(step, "to_batch", spy)
    config = _sft_run_config(tmp_path, sft, "run", "train.device=cpu", "train.steps=2", "data.packed_documents=true")
    with open(os.devnull, "w") as quiet:
        result = Trainer(config, stream=quiet).run()
    assert len(result.losses) == 2 and all(math.isfinite(v) for v in result.losses.values())
    assert seen and all("loss_mask" in s for s in seen)
    for sample in seen:
        batch = to_batch(sample, torch.device("cpu"), EOD)
        kept = sample["loss_mask"][:, 1:]
        assert torch.equal(batch.targets == IGNORE_INDEX, ~kept)
        assert kept.any() and not kept.all()
