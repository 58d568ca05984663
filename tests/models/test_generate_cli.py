"""megakern-generate on CPU: from a Hugging Face directory (a tiny Llama and a byte-level BPE tokenizer.json), greedy
completions equal transformers' greedy tokens decoded, prompts of several lengths batched by length give what each
gives alone, and bad input (no prompt, a context overflow, a stop id outside the tokenizer, a tokenizer larger than
the model) is named with exit code 2."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install '.[hf]')")

from megakern.models.generate_cli import main  # noqa: E402

V = 300
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\nfor i in range(10):\n    print(i * i)\n") * 20


def _tokenizer_json(path, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("gen") / "hf"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    tok = _tokenizer_json(path / "tokenizer.json", V)
    assert tok.get_vocab_size() <= V
    return path, model.eval(), tok


def _completions(out: str) -> list[str]:
    """The printed prompt + completion of each "=== prompt" block (each ends with the newline print adds; the last
    is followed by the summary line)."""
    blocks = [b.split("\n", 1)[1] for b in out.split("=== ")[1:]]
    return [b[:-1] for b in blocks[:-1]] + [blocks[-1].rsplit("\nmegakern-generate:", 1)[0]]


def test_greedy_matches_transformers(hf_dir, capsys):
    path, ref, tok = hf_dir
    prompt = "def add(a, b):"
    assert main([f"hf:{path}", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "1 prompts" in out
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
                            attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
    eod = tok.token_to_id("<|endoftext|>")
    if eod in want:
        want = want[:want.index(eod)]
    assert _completions(out)[0] == prompt + tok.decode(want)


def test_prompts_batched_by_length(hf_dir, capsys):
    path, _, _ = hf_dir
    prompts = ["class Point:", "for i in", "def add(a", "print(i"]
    args = [f"hf:{path}", "--temperature", "0", "--max-new-tokens", "8"]
    assert main([*args, *sum((["--prompt", p] for p in prompts), [])]) == 0
    together = _completions(capsys.readouterr().out)
    alone = []
    for p in prompts:
        assert main([*args, "--prompt", p]) == 0
        alone += _completions(capsys.readouterr().out)
    assert together == alone


@pytest.mark.parametrize("extra, message", [
    ([], "no prompt"),
    (["--prompt", "x", "--max-new-tokens", "100"], "exceeds the model's max_seqlen \\(64\\)"),
    (["--prompt", "x", "--stop", "5000"], "stop id 5000 is not a token of the tokenizer"),
    (["--prompt", "x", "--top-p", "0", "--max-new-tokens", "4"], "top_p must be None or a number in"),
])
def test_bad_input(hf_dir, capsys, extra, message):
    import re

    path, _, _ = hf_dir
    assert main([f"hf:{path}", *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_tokenizer_larger_than_the_model(hf_dir, tmp_path, capsys):
    path, _, _ = hf_dir
    _tokenizer_json(tmp_path / "big.json", 400)
    assert main([f"hf:{path}", "--prompt", "x", "--tokenizer", f"hf:{tmp_path / 'big.json'}"]) == 2
    assert "more than the model's vocabulary (300)" in capsys.readouterr().err
