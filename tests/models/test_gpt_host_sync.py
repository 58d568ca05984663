"""GPT.forward(check_values=False): no host read of device values in the forward and backward (on a GPU: no
host-device sync), the same loss and gradients as the checked call; packed documents take the caller's max_seqlen."""
from __future__ import annotations

import pytest
import torch

from host_reads import host_reads

import megakern.models.gpt as gpt_module
from megakern.models.gpt import GPT, GPTConfig

CONFIG = dict(n_layer=2, n_embd=48, n_head=3, vocab_size=101, max_seqlen=40, norm="layernorm", position="learned",
              activation="gelu", bias=True, tie_embeddings=True)
LLAMA_LIKE = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=72, vocab_size=101, max_seqlen=40,
                  norm="rmsnorm", position="rotary", rotary_pct=0.5, activation="swiglu", bias=False,
                  tie_embeddings=False)


def _model_and_batch(B=2, T=13, seed=0, device="cpu", dtype=torch.float32, config=CONFIG):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config)).to(device=device, dtype=dtype)
    idx = torch.randint(0, 101, (B, T), device=device)
    targets = torch.randint(0, 101, (B, T), device=device)
    targets[0, 3] = -100
    return model, idx, targets


def _step(model, idx, targets, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets, **kwargs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("config", [CONFIG, LLAMA_LIKE], ids=["gpt2-like", "llama-like"])
def test_check_values_false_reads_nothing_and_changes_nothing(config):
    model, idx, targets = _model_and_batch(config=config)
    checked = _step(model, idx, targets)
    assert host_reads(_step, model, idx, targets), "the checked call should read the targets' range"
    assert host_reads(_step, model, idx, targets, check_values=False) == []
    trusted = _step(model, idx, targets, check_values=False)
    assert torch.equal(checked[0], trusted[0])
    assert all(torch.equal(a, b) for a, b in zip(checked[1], trusted[1]))


def test_packed_documents_trust_the_callers_max_seqlen(monkeypatch):
    model, idx, targets = _model_and_batch(B=1, T=20)
    cu = torch.tensor([0, 7, 15, 20], dtype=torch.int32)
    checked = _step(model, idx, targets, cu_seqlens=cu)

    def refuse(*args, **kwargs):
        raise AssertionError("GPT read cu_seqlens although the caller vouched for it")

    monkeypatch.setattr(gpt_module, "document_lengths", refuse)
    trusted = _step(model, idx, targets, cu_seqlens=cu, max_seqlen=8, check_values=False)
    assert torch.equal(checked[0], trusted[0])
    assert all(torch.equal(a, b) for a, b in zip(checked[1], trusted[1]))
    with pytest.raises(ValueError, match="a packed document has 41 tokens; max_seqlen is 40"):
        model(idx, targets, cu_seqlens=cu, max_seqlen=41, check_values=False)
    with pytest.raises(AssertionError, match="vouched"):  # without max_seqlen the offsets must be read
        model(idx, targets, cu_seqlens=cu, check_values=False)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIG, LLAMA_LIKE], ids=["gpt2-like", "llama-like"])
def test_gpu_forward_backward_without_sync(config):
    model, idx, targets = _model_and_batch(B=2, T=32, device="cuda", dtype=torch.bfloat16, config=config)
    _step(model, idx, targets, check_values=False)  # warm-up: kernels compiled, backends probed
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, idx, targets, check_values=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
