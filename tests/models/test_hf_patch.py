"""megakern.models.hf_patch: transformers' Llama, Mistral and Qwen2 with megakern's RMSNorm, rotary + attention,
SwiGLU and loss, against the unpatched model under the same weights: loss, logits and every gradient within the 2x
rule of the fp64 model (CPU: fp32 through the ops' torch paths; GPU: bf16 through the kernels); the fallbacks
(padding masks, generation, packed position ids) equal to transformers; packed sequences by cu_seq_lens; the
loss's num_items_in_batch / shift_labels / ignore_index as transformers computes them; refusals named, nothing
changed."""
import copy
import logging

import pytest
import torch

from tests.conftest import ATOL, DEVICE, HAS_CUDA, assert_close_to_ref

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[dev]')")

from megakern.models import hf_patch  # noqa: E402

V = 211


def _model(family: str, seed: int = 0, **kw):
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0)
    common.update(kw)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "mistral": (MistralForCausalLM, MistralConfig),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[family]
    torch.manual_seed(seed)
    model = cls(cfg(**common))
    with torch.no_grad():  # norms away from their initial ones
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


FAMILIES = {
    "llama-gqa": ("llama", {}),
    "llama3-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 32})),
    "mistral-window": ("mistral", dict(sliding_window=96)),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),
}


def _ids(shape=(3, 29), seed=1, device="cpu"):
    return torch.randint(1, V, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _loss_and_grads(model, ids, labels=None, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids if labels is None else labels, use_cache=False, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _check_against_fp64(name, model, dtype, device, ids, labels=None, **kw):
    """Patched and plain copies of ``model`` in ``dtype`` against the plain model in fp64: loss and every gradient
    within the 2x rule."""
    truth = copy.deepcopy(model).double().to(device)
    plain = copy.deepcopy(model).to(device=device, dtype=dtype)
    patched = hf_patch.patch(copy.deepcopy(model).to(device=device, dtype=dtype))
    loss64, grads64 = _loss_and_grads(truth, ids, labels, **kw)
    loss_p, grads_p = _loss_and_grads(plain, ids, labels, **kw)
    loss_m, grads_m = _loss_and_grads(patched, ids, labels, **kw)
    atol = ATOL[dtype]
    assert_close_to_ref(f"{name} loss", loss_m.reshape(1), loss64.reshape(1), loss_p.reshape(1), atol)
    assert grads64.keys() == grads_m.keys()
    for key in grads64:
        assert_close_to_ref(f"{name} d{key}", grads_m[key], grads64[key], grads_p[key], atol)
    return patched


@pytest.mark.parametrize("name", list(FAMILIES))
def test_patched_loss_and_gradients_cpu(name):
    family, kw = FAMILIES[name]
    model = _model(family, **kw)
    ids = _ids()
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt's tokens left out of the loss
    patched = _check_against_fp64(name, model, torch.float32, "cpu", ids, labels)
    assert hf_patch.is_patched(patched)
    out = patched(input_ids=ids, labels=labels)
    assert out.logits is None  # the fused loss never makes them


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_patched_loss_and_gradients_gpu_bf16(name):
    family, kw = FAMILIES[name]
    # head dim 64 and a longer sequence: the kernels' tiles, and a window shorter than nothing (96 > T)
    model = _model(family, hidden_size=256, intermediate_size=344, **kw)
    _check_against_fp64(name, model, torch.bfloat16, DEVICE, _ids((2, 93), device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_patched_under_autocast_gpu():
    """fp32 weights under bf16 autocast (HF Trainer's bf16=True): the patched step against the plain one."""
    model = _model("llama", hidden_size=256, intermediate_size=344)
    ids = _ids((2, 77), device=DEVICE)
    truth = copy.deepcopy(model).double().to(DEVICE)
    plain, patched = copy.deepcopy(model).to(DEVICE), hf_patch.patch(copy.deepcopy(model).to(DEVICE))
    loss64, grads64 = _loss_and_grads(truth, ids)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_p, grads_p = _loss_and_grads(plain, ids)
        loss_m, grads_m = _loss_and_grads(patched, ids)
    assert loss_m.dtype == torch.float32
    assert_close_to_ref("autocast loss", loss_m.reshape(1), loss64.reshape(1), loss_p.reshape(1), ATOL[torch.bfloat16])
    for key in grads64:
        assert grads_m[key].dtype == torch.float32
        assert_close_to_ref(f"autocast d{key}", grads_m[key], grads64[key], grads_p[key], ATOL[torch.bfloat16])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_and_generation_equal_transformers(name):
    family, kw = FAMILIES[name]
    model = _model(family, **kw).eval()
    patched = hf_patch.patch(copy.deepcopy(model))
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        got = patched(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        prompt = ids[:1, :6]
        want = model.generate(prompt, max_new_tokens=8, do_sample=False)
        got = patched.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def test_fallbacks_equal_transformers_and_are_logged(caplog):
    """A padding mask and packed position ids make transformers build a mask: the patched attention takes the
    module's own forward (logged once per module) and the results stay transformers'."""
    model = _model("llama").eval()
    patched = hf_patch.patch(copy.deepcopy(model))
    ids = _ids((2, 19))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    positions = torch.cat([torch.arange(11), torch.arange(8)])[None]
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="megakern.hf_patch"):
        torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                                   model(input_ids=ids, attention_mask=mask, use_cache=False).logits)
        torch.testing.assert_close(patched(input_ids=ids[:1], position_ids=positions, use_cache=False).logits,
                                   model(input_ids=ids[:1], position_ids=positions, use_cache=False).logits)
    lines = [r.getMessage() for r in caplog.records if "takes transformers' attention" in r.getMessage()]
    assert len(lines) == 2 and all("attention mask" in line for line in lines)  # one per layer, once


def test_packed_sequences_by_cu_seq_lens():
    """Batch 1 holding two documents, with flash attention's keyword arguments: each attends within itself, as the
    two documents run one by one through the unpatched model."""
    model = _model("qwen2").eval()
    patched = hf_patch.patch(copy.deepcopy(model))
    a, b = _ids((1, 13), seed=3), _ids((1, 10), seed=4)
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(13), torch.arange(10)])[None]
    cu = torch.tensor([0, 13, 23], dtype=torch.int32)
    with torch.no_grad():
        got = patched.model(input_ids=packed, position_ids=positions, use_cache=False, cu_seq_lens_q=cu,
                            cu_seq_lens_k=cu, max_length_q=13, max_length_k=13).last_hidden_state
        want = torch.cat([model.model(input_ids=a, use_cache=False).last_hidden_state,
                          model.model(input_ids=b, use_cache=False).last_hidden_state], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="packed sequences take batch 1"):
        patched.model(input_ids=torch.cat([packed, packed]), use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=13, max_length_k=13)


def test_loss_keywords_as_transformers():
    """num_items_in_batch (sum over the batch's items), shift_labels (given already shifted) and ignore_index."""
    model = _model("llama")
    patched = hf_patch.patch(copy.deepcopy(model))
    ids = _ids()
    labels = ids.clone()
    labels[:, :4] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    with torch.no_grad():
        for kw in ({"num_items_in_batch": torch.tensor(50)}, {"shift_labels": shifted}, {"num_items_in_batch": 7}):
            want = model(input_ids=ids, labels=labels, use_cache=False, **kw).loss
            got = patched(input_ids=ids, labels=labels, **kw).loss
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="labels of shape"):
            patched(input_ids=ids, labels=labels[:, :-1])


def test_switches_and_unpatch_restore():
    model = _model("mistral", sliding_window=None)
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids, use_cache=False).loss
    only_norms = hf_patch.patch(model, attention=False, swiglu=False, loss=False)
    replaced = [m for m in model.modules() if "forward" in vars(m)]
    assert replaced and all(type(m).__name__.endswith("RMSNorm") for m in replaced)
    hf_patch.unpatch(only_norms)
    assert not hf_patch.is_patched(model) and not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=ids, use_cache=False).loss, want)


def test_eager_attention_switched_to_sdpa():
    model = _model("llama", attn_implementation="eager")
    hf_patch.patch(model)
    assert model.config._attn_implementation == "sdpa"


def test_refusals_name_the_problem_and_change_nothing():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        hf_patch.patch(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
    with pytest.raises(TypeError, match="expected a transformers"):
        hf_patch.patch(torch.nn.Linear(2, 2))
    for kw, match in ((dict(hidden_act="gelu"), "hidden_act 'gelu'"), (dict(mlp_bias=True), "mlp_bias true"),
                      (dict(attention_dropout=0.1), "attention_dropout 0.1"),
                      (dict(hidden_size=72, num_attention_heads=4), "head dim 18")):
        model = _model("llama", **kw)
        with pytest.raises(ValueError, match=match):
            hf_patch.patch(model)
        assert not hf_patch.is_patched(model) and not any("forward" in vars(m) for m in model.modules())
    model = hf_patch.patch(_model("llama"))
    with pytest.raises(ValueError, match="patched already"):
        hf_patch.patch(model)
    with pytest.raises(ValueError, match="not patched"):
        hf_patch.unpatch(_model("llama"))
