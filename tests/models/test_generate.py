"""Generation with the KV cache (megakern.models.generate): cached steps equal the uncached model's argmax
continuation; sampling is reproducible and respects top_k and top_p; stop ids, lengths, memory and modes are
checked."""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from megakern.models import generate as gen
from megakern.models.gpt import GPT, GPTConfig

CONFIGS = {
    "gpt2-like": dict(n_layer=2, n_embd=48, n_head=3, vocab_size=101, max_seqlen=32),
    "llama-like": dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=72, vocab_size=131, max_seqlen=32,
                       norm="rmsnorm", position="rotary", rotary_pct=0.5, activation="swiglu", bias=False,
                       tie_embeddings=False),
}


def make(name: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CONFIGS[name]))
    with torch.no_grad():  # larger logits than the init's, so that argmax decisions are far from ties
        model.output_weight().mul_(20)
    return model


def uncached_greedy(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx)[:, -1, :model.config.vocab_size]
            idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_greedy_equals_uncached(name):
    model = make(name)
    idx = torch.randint(0, model.config.vocab_size, (3, 5))
    out = model.generate(idx, 12, temperature=0)
    assert out.shape == (3, 17) and torch.equal(out[:, :5], idx)
    assert torch.equal(out, uncached_greedy(model.eval(), idx, 12))
    # top_k=1 sampling is greedy too; the prompt may fill all but one position
    assert torch.equal(model.generate(idx, 12, top_k=1), out)
    long = torch.randint(0, model.config.vocab_size, (1, 31))
    assert torch.equal(gen.generate(model, long, 1, temperature=0), uncached_greedy(model, long, 1))


def test_triton_kernels_generation_matches_torch():
    import megakern

    if megakern.available_backends(DEVICE)["triton"]:
        pytest.skip("Triton unavailable")
    config = dict(CONFIGS["llama-like"], kernels={"rms_norm": "triton", "rotary": "triton", "attention": "triton"})
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config)).to(DEVICE, torch.float16)
    idx = torch.randint(0, 131, (2, 4), device=DEVICE)
    out = model.generate(idx, 6, temperature=0)
    model.config.kernels.clear()
    with torch.no_grad():
        logits = model(out)[:, 3:-1, :131].float()  # the uncached model's view of every generated position
    chosen = logits.gather(-1, out[:, 4:, None])[..., 0]
    assert (chosen >= logits.max(-1).values - 2e-2).all()  # each step took an argmax (to fp16 rounding)


def test_sampling_is_seeded_and_respects_top_k():
    model = make("gpt2-like")
    with torch.no_grad():
        model.output_weight().div_(20)  # flat distributions: sampling varies
    idx = torch.randint(0, 101, (4, 3))
    a = model.generate(idx, 10, generator=torch.Generator().manual_seed(1))
    b = model.generate(idx, 10, generator=torch.Generator().manual_seed(1))
    c = model.generate(idx, 10, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a < 101).all()  # padded vocabulary rows never come out
    # top_k = 3: every token is among the 3 most likely of its step under the uncached model
    out = model.generate(idx, 8, top_k=3, temperature=2.0, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(out)[:, 2:-1, :101]
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == out[:, 3:, None]).any(-1).all()


def test_top_p_keeps_the_nucleus():
    """top_p: every token drawn lies in the smallest set of most likely tokens whose mass reaches top_p (from the
    uncached model's probabilities at temperature 1); top_p 1 is plain sampling with the same draws."""
    model = make("gpt2-like")
    with torch.no_grad():
        model.output_weight().div_(5)
    idx = torch.randint(0, 101, (4, 3))
    out = model.generate(idx, 8, top_p=0.6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        probs = model(out)[:, 2:-1, :101].float().softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    kept = (sorted_probs.cumsum(-1) - sorted_probs) < 0.6  # the nucleus, in rank order
    rank = (order == out[:, 3:, None]).float().argmax(-1)  # each drawn token's rank
    assert kept.gather(-1, rank[..., None]).all()
    assert (kept.sum(-1) < 101).any()  # the nucleus did cut tokens away somewhere
    a = model.generate(idx, 8, top_p=1.0, generator=torch.Generator().manual_seed(5))
    b = model.generate(idx, 8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_stop_ids():
    model = make("gpt2-like")
    idx = torch.randint(0, 101, (2, 4))
    free = model.generate(idx, 10, temperature=0)
    first = int(free[0, 4])  # the first generated token of sequence 0, used as a stop id
    out = model.generate(idx, 10, temperature=0, eos_id=first)
    assert out[0, 4] == first and (out[0, 4:] == first).all()  # padded with the stop id after stopping
    stopped_1 = (free[1, 4:] == first).nonzero()
    if stopped_1.numel():  # sequence 1 met it too: generation ends there
        assert out.shape[1] == 4 + int(stopped_1[0]) + 1
    else:
        assert torch.equal(out[1], free[1])
    both = model.generate(idx, 10, temperature=0, eos_id=[int(free[0, 4]), int(free[1, 4])])
    assert both.shape == (2, 5)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_new_tokens=28), ValueError, "prompt \\(5\\) \\+ max_new_tokens \\(28\\) = 33 exceeds the model's "
                                          "max_seqlen \\(32\\)"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0"),
    (dict(eos_id=101), ValueError, "stop id 101 is not a token of the vocabulary \\[0, 101\\)"),
    (dict(eos_id=[3, -1]), ValueError, "stop id -1 is not a token"),
    (dict(eos_id="a"), TypeError, "eos_id must be None, an int or a list of ints"),
    (dict(temperature=-0.5), ValueError, "temperature must be a finite number >= 0"),
    (dict(top_k=0), ValueError, "top_k must be None or an int in 1..101"),
    (dict(top_k=102), ValueError, "top_k must be None or an int in 1..101"),
    (dict(top_p=0.0), ValueError, "top_p must be None or a number in \\(0, 1\\]"),
    (dict(top_p=1.5), ValueError, "top_p must be None or a number in \\(0, 1\\]"),
])
def test_argument_errors(kwargs, error, message):
    model = make("gpt2-like")
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=message):
        model.generate(torch.zeros(2, 5, dtype=torch.long), **kwargs)


def test_prompt_errors():
    model = make("gpt2-like")
    with pytest.raises(ValueError, match="prompt ids span 0..101, outside the vocabulary \\[0, 101\\)"):
        model.generate(torch.tensor([[0, 101]]), 2)
    with pytest.raises(ValueError, match="the prompt is empty"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="idx must be a \\(B, T\\) int64"):
        model.generate(torch.zeros(5, dtype=torch.long), 2)
    stage = make("gpt2-like")
    stage.norm_f = None
    with pytest.raises(ValueError, match="pipeline stage"):
        stage.generate(torch.zeros(1, 3, dtype=torch.long), 2)


def test_memory_is_checked_before_allocating(monkeypatch):
    model = make("gpt2-like")
    monkeypatch.setattr(gen, "available_bytes", lambda device: 1000)
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    with pytest.raises(MemoryError, match="the KV cache needs 0.00 GiB .* has 0.00 GiB free"):
        model.generate(torch.zeros(2, 5, dtype=torch.long), 10)
    assert not allocated
    assert model.training  # the mode is restored on errors too


@pytest.mark.parametrize("training", [True, False])
def test_mode_and_grad_mode_restored(training):
    model = make("gpt2-like")
    model.train(training)
    out = model.generate(torch.zeros(1, 2, dtype=torch.long), 3)
    assert model.training == training and torch.is_grad_enabled()
    assert not out.requires_grad and out.dtype == torch.long
    assert model.generate(torch.zeros(1, 2, dtype=torch.long), 0).shape == (1, 2)


@pytest.mark.parametrize("name", CONFIGS)
def test_generation_under_autocast(name):
    """Under torch.autocast the keys come out in the autocast dtype: the cache takes it (the trainer's sample runs
    so), and greedy steps match the uncached model's under the same autocast."""
    model = make(name).to(DEVICE)
    idx = torch.randint(0, model.config.vocab_size, (2, 4), device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = model.generate(idx, 6, temperature=0)
        with torch.no_grad():
            logits = model.eval()(out)[:, 3:-1, :model.config.vocab_size].float()
    chosen = logits.gather(-1, out[:, 4:, None])[..., 0]
    assert out.shape == (2, 10) and (chosen >= logits.max(-1).values - 0.1).all()
