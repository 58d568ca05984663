"""GPT (megakern.models.gpt) against an independent plain-torch model of the same config loading the same weights:
logits, loss and every parameter gradient; packed documents; meta-device init; recomputation; config and input
errors; pipeline-stage pieces; the Triton kernels under the interpreter."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, require_triton
from reference_gpt import RefGPT

from megakern.attention import packed_qkv as megakern_packed
from megakern.models.gpt import GPT, PRESETS, GPTConfig

GPT2_LIKE = dict(n_layer=2, n_embd=48, n_head=3, vocab_size=101, max_seqlen=40, norm="layernorm", position="learned",
                 activation="gelu", bias=True, tie_embeddings=True)
LLAMA_LIKE = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=72, vocab_size=131, max_seqlen=40,
                  norm="rmsnorm", position="rotary", rotary_pct=0.5, activation="swiglu", bias=False,
                  tie_embeddings=False)
MQA = dict(n_layer=1, n_embd=64, n_head=4, n_kv_head=1, vocab_size=77, max_seqlen=40, norm="layernorm",
           position="rotary", activation="gelu", bias=False, tie_embeddings=True, rotary_base=500.0)
MHA_ROTARY = dict(LLAMA_LIKE, n_kv_head=4, rotary_pct=1.0)
# GPT-NeoX: partial rotary, erf GELU with biases, attention and MLP in parallel off one residual stream
NEOX_LIKE = dict(n_layer=2, n_embd=48, n_head=3, vocab_size=101, max_seqlen=40, norm="layernorm", position="rotary",
                 rotary_pct=0.25, activation="gelu_exact", bias=True, tie_embeddings=False, parallel_residual=True)
CONFIGS = {"gpt2-like": GPT2_LIKE, "llama-like": LLAMA_LIKE, "mqa": MQA, "mha-rotary": MHA_ROTARY,
           "neox-like": NEOX_LIKE}


def make(config: dict, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**config, **overrides}))


def reference(model: GPT, dtype: torch.dtype) -> RefGPT:
    ref = RefGPT(model.config).to(dtype)
    missing, unexpected = ref.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()}, strict=True)
    assert not missing and not unexpected
    return ref


def batch(config: GPTConfig, B: int, T: int, seed: int = 1, ignore: int = 3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, config.vocab_size, (B, T), generator=g)
    targets.view(-1)[torch.randperm(B * T, generator=g)[:ignore]] = -100
    return idx, targets


def loss_and_grads(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(*args, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_against_reference(model: GPT, B: int, T: int, atol: float, doc_lengths=None, cu_seqlens=None):
    """Loss, logits and every gradient of ``model`` against the reference in fp64 (truth) and in model's dtype
    (plain low-precision torch), by the 2x rule."""
    p = next(model.parameters())
    idx, targets = batch(model.config, B, T)  # the references run on CPU, the model on its device
    truth, lowp = reference(model, torch.float64), reference(model, p.dtype)
    dev = dict(device=p.device)
    cu_seqlens = None if cu_seqlens is None else cu_seqlens.to(**dev)
    loss, grads = loss_and_grads(model, idx.to(**dev), targets.to(**dev), cu_seqlens=cu_seqlens)
    loss64, grads64 = loss_and_grads(truth, idx, targets, doc_lengths=doc_lengths)
    lossl, gradsl = loss_and_grads(lowp, idx, targets, doc_lengths=doc_lengths)
    assert_close_to_ref("loss", loss, loss64, lossl, atol)
    with torch.no_grad():
        assert_close_to_ref("logits", model(idx.to(**dev), cu_seqlens=cu_seqlens),
                            truth(idx, doc_lengths=doc_lengths), lowp(idx, doc_lengths=doc_lengths), atol)
    assert grads.keys() == grads64.keys()
    for name in grads:
        assert_close_to_ref(f"grad {name}", grads[name], grads64[name], gradsl[name], atol)


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_reference(name):
    model = make(CONFIGS[name])
    check_against_reference(model, B=2, T=13, atol=ATOL[torch.float32])


@pytest.mark.parametrize("bias", [False, True], ids=("no-bias", "bias"))
def test_heads_major_projection_is_the_grouped_one_reordered(bias):
    """The grouped-query projection's heads-major product: q, k, v are views of it (q too) with the values of the
    grouped product's split, and the weight's and bias's gradients are the grouped product's, back in its order."""
    import megakern.models.gpt as gpt

    torch.manual_seed(7)
    B, T, C, nkv, g, hs = 2, 5, 24, 3, 4, 8
    w = torch.randn(nkv * (g + 2) * hs, C, dtype=torch.float64, requires_grad=True)
    b = torch.randn(nkv * (g + 2) * hs, dtype=torch.float64, requires_grad=True) if bias else None
    x = torch.randn(B, T, C, dtype=torch.float64)
    ref = torch.nn.functional.linear(x, w, b).view(B, T, nkv, g + 2, hs)
    want = gpt._split_qkv(ref, nkv, hs)
    wh = gpt._HeadsMajor.apply(w, nkv, g, hs, None)
    bh = gpt._HeadsMajor.apply(b, nkv, g, hs, None) if bias else None
    got = gpt._split_heads_major(torch.nn.functional.linear(x, wh, bh).view(B, T, nkv * (g + 2), hs), nkv)
    weights = [torch.randn_like(t) for t in want]
    for name, a, e in zip("qkv", got, want):
        assert a.shape == e.shape and a._base is not None, name
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)
    leaves = (w, b) if bias else (w,)
    grads = torch.autograd.grad(sum((t * r).sum() for t, r in zip(got, weights)), leaves)
    grads_ref = torch.autograd.grad(sum((t * r).sum() for t, r in zip(want, weights)), leaves)
    for a, e in zip(grads, grads_ref):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_packed_documents_match_reference_and_separate_runs():
    model = make(LLAMA_LIKE)
    lengths = [5, 11, 1, 7]
    T = sum(lengths)
    cu = torch.tensor([0, 5, 16, 17, 24], dtype=torch.int32)
    check_against_reference(model, B=1, T=T, atol=ATOL[torch.float32], doc_lengths=lengths, cu_seqlens=cu)
    # the same as each document on its own
    idx, targets = batch(model.config, 1, T)
    with torch.no_grad():
        packed = model(idx, targets, cu_seqlens=cu, reduction="sum")
        logits = model(idx, cu_seqlens=cu)
        alone, start = 0.0, 0
        for n in lengths:
            alone = alone + model(idx[:, start:start + n], targets[:, start:start + n], reduction="sum")
            torch.testing.assert_close(logits[:, start:start + n], model(idx[:, start:start + n]), rtol=1e-5,
                                       atol=1e-5)
            start += n
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_packed_documents_learned_positions_two_rows():
    model = make(GPT2_LIKE)
    lengths = [4, 6, 3, 7]  # rows of 10: documents end at the row boundary
    check_against_reference(model, B=2, T=10, atol=ATOL[torch.float32], doc_lengths=lengths,
                            cu_seqlens=torch.tensor([0, 4, 10, 13, 20], dtype=torch.int32))


def test_meta_init_equals_normal_init():
    config = GPTConfig(**LLAMA_LIKE)
    torch.manual_seed(5)
    normal = GPT(config)
    with torch.device("meta"):
        meta = GPT(config)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.init_weights()
    for (name, a), (_, b) in zip(normal.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    # another seed gives other weights; a generator gives reproducible ones
    torch.manual_seed(6)
    meta.init_weights()
    assert not torch.equal(meta.blocks["0"].attn.qkv.weight, normal.blocks["0"].attn.qkv.weight)
    meta.init_weights(torch.Generator().manual_seed(1))
    first = meta.blocks["1"].mlp.fc.weight.clone()
    meta.init_weights(torch.Generator().manual_seed(1))
    assert torch.equal(first, meta.blocks["1"].mlp.fc.weight)


def test_init_statistics():
    config = GPTConfig(n_layer=8, n_embd=256, n_head=4, vocab_size=500, max_seqlen=64, init_std=0.03)
    model = GPT(config)
    blk = model.blocks["3"]
    assert abs(blk.attn.qkv.weight.std().item() - 0.03) < 0.002
    assert abs(blk.mlp.proj.weight.std().item() - 0.03 / 4) < 0.0005  # / sqrt(2 * 8)
    assert abs(blk.attn.proj.weight.std().item() - 0.03 / 4) < 0.0005
    assert abs(model.wte.weight.std().item() - 0.03) < 0.002
    assert torch.equal(blk.attn.qkv.bias, torch.zeros_like(blk.attn.qkv.bias))
    assert torch.equal(blk.mlp_norm.weight, torch.ones_like(blk.mlp_norm.weight))
    assert torch.equal(model.norm_f.bias, torch.zeros_like(model.norm_f.bias))
    # blocks initialize the same whatever other blocks exist (pipeline stages)
    torch.manual_seed(3)
    whole = GPT(config)
    with torch.device("meta"):
        stage = GPT(config)
    for i in range(4):
        del stage.blocks[str(i)]
    stage.to_empty(device="cpu")
    torch.manual_seed(3)
    stage.init_weights()
    assert torch.equal(stage.blocks["6"].mlp.fc.weight, whole.blocks["6"].mlp.fc.weight)


@pytest.mark.parametrize("name,dropout", [("llama-like", 0.0), ("llama-like", 0.1), ("neox-like", 0.1)])
def test_recompute_modes_give_identical_gradients(name, dropout):
    idx, targets = batch(GPTConfig(**CONFIGS[name]), 2, 12)
    results = {}
    for mode in ("none", "selective", "full"):
        model = make(CONFIGS[name], recompute=mode, dropout=dropout)
        torch.manual_seed(11)
        results[mode] = loss_and_grads(model, idx, targets)
    for mode in ("selective", "full"):
        assert torch.equal(results[mode][0], results["none"][0]), mode
        for name, g in results["none"][1].items():
            assert torch.equal(results[mode][1][name], g), (mode, name)


def test_deterministic_attention_reaches_the_attention_op(attention_determinism):
    """``deterministic_attention`` is what every block's attention call asks for, and the model's loss and gradients
    do not depend on it where the backend has one backward (here the reference)."""
    idx, targets = batch(GPTConfig(**CONFIGS["llama-like"]), 2, 12)
    results = {}
    for flag in (True, False):
        attention_determinism.clear()
        model = make(CONFIGS["llama-like"], deterministic_attention=flag)
        torch.manual_seed(11)
        results[flag] = loss_and_grads(model, idx, targets)
        assert attention_determinism and set(attention_determinism) == {flag}, attention_determinism
    assert torch.equal(results[True][0], results[False][0])


def test_dropout_only_in_training():
    model = make(GPT2_LIKE, dropout=0.5)
    idx, targets = batch(model.config, 2, 8)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(idx, targets), model(idx, targets))
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(idx, targets), model(idx, targets))


def test_padded_vocab_and_counts():
    config = GPTConfig(**GPT2_LIKE)
    assert config.padded_vocab == 128
    assert GPTConfig(**{**GPT2_LIKE, "vocab_size": 256}).padded_vocab == 256
    model = GPT(config)
    idx, _ = batch(config, 2, 5)
    assert model(idx).shape == (2, 5, 128)
    assert model.wte.weight.shape == (128, 48)
    C, L, V, T = 48, 2, 128, 40
    assert model.num_params() == L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C
    assert model.num_params(exclude_embeddings=True) == L * (12 * C * C + 13 * C) + 2 * C
    # gpt-350m, built on the meta device: 6 N + attention
    with torch.device("meta"):
        big = GPT(GPTConfig.preset("gpt-350m"))
    C, L, V = 1024, 24, 50304
    n = L * (12 * C * C + 13 * C) + 2 * C + V * C
    assert big.flops_per_token(1024) == 6 * n + 12 * L * C * 1024


def test_presets_validate_and_build_on_meta():
    for name in PRESETS:
        config = GPTConfig.preset(name)
        assert config.padded_vocab % 128 == 0
        with torch.device("meta"):
            GPT(config)
    llama = GPTConfig.preset("llama-1b")
    assert (llama.n_kv_head, llama.norm, llama.activation, llama.position) == (8, "rmsnorm", "swiglu", "rotary")
    assert GPTConfig.preset("gpt-350m").n_layer == 24 and GPTConfig.preset("gpt-350m", n_layer=2).n_layer == 2
    assert GPTConfig(activation="swiglu", n_embd=96).ffn_hidden == 256  # 8/3 * 96 up to a multiple of 64


@pytest.mark.parametrize("fields, message", [
    (dict(n_embd=50, n_head=4), "n_head \\(4\\) must divide n_embd \\(50\\)"),
    (dict(n_head=4, n_embd=64, n_kv_head=3), "n_kv_head \\(3\\) must divide n_head \\(4\\)"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(position="alibi"), "position must be one of"),
    (dict(activation="relu"), "activation must be one of"),
    (dict(recompute="some"), "recompute must be one of"),
    (dict(dropout=1.0), "dropout must be in \\[0, 1\\)"),
    (dict(n_layer=0), "n_layer must be an int >= 1"),
    (dict(vocab_size=2.5), "vocab_size must be an int"),
    (dict(position="rotary", rotary_pct=0.0), "rotary_pct must be in"),
    (dict(position="rotary", n_embd=64, n_head=4, rotary_pct=0.1), "rotates 0 features"),
    (dict(position="rotary", rope_scaling={"rope_type": "yarn"}), "rope_scaling"),
    (dict(kernels={"attention": "cuda"}), "attention has no backend 'cuda'"),
    (dict(kernels={"softmax": "triton"}), "unknown op 'softmax'"),
    (dict(kernels={"embedding": "cuda"}), "embedding has no backend 'cuda'"),
    (dict(ce_chunk=0), "ce_chunk must be None or an int >= 1"),
    (dict(norm_eps=-1.0), "norm_eps must be > 0"),
    (dict(parallel_residual="yes"), "parallel_residual must be a bool"),
    (dict(deterministic_attention=0), "deterministic_attention must be a bool"),
])
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields).validate()
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(**fields))


def test_config_names_every_op():
    """Every op the model runs can be named in config.kernels, with each backend it offers."""
    import megakern
    from megakern.models.gpt import KERNEL_OPS

    assert {"qkv_order", "embedding", "swiglu"} <= set(KERNEL_OPS)
    for op in KERNEL_OPS:
        for backend in megakern.op_backends(op):
            GPTConfig(kernels={op: backend}).validate()


def test_preset_errors():
    with pytest.raises(ValueError, match="unknown preset 'gpt-9b'"):
        GPTConfig.preset("gpt-9b")
    with pytest.raises(ValueError, match="unknown fields \\['layers'\\]"):
        GPTConfig.preset("gpt-tiny", layers=3)


def test_input_errors():
    model = make(GPT2_LIKE)
    idx, targets = batch(model.config, 2, 8)
    with pytest.raises(ValueError, match="idx must be a \\(B, T\\) int64"):
        model(idx.float())
    with pytest.raises(ValueError, match="idx must be a \\(B, T\\) int64"):
        model(idx[0])
    with pytest.raises(ValueError, match="sequence length 41 exceeds max_seqlen 40"):
        model(torch.zeros(1, 41, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be a \\(2, 8\\)"):
        model(idx, targets[:, :4])
    with pytest.raises(ValueError, match="position_ids span 0..40"):
        model(idx, position_ids=torch.arange(33, 41).clone().index_fill_(0, torch.tensor([0]), 0))
    with pytest.raises(ValueError, match="a packed document has 41 tokens"):
        model(torch.zeros(1, 50, dtype=torch.long), cu_seqlens=torch.tensor([0, 41, 50], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens ends at 15"):
        model(idx, cu_seqlens=torch.tensor([0, 15], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside the vocabulary \\[0, 128\\)"):
        model(idx, torch.full_like(targets, 128))
    with pytest.raises(ValueError, match="reduction must be one of"):
        model(idx, targets, reduction="max")
    with pytest.raises(ValueError, match="grad_scale is the loss's incoming gradient; it needs targets"):
        model(idx, grad_scale=torch.tensor(0.5))
    with pytest.raises(ValueError, match="grad_scale must hold one element"):
        model(idx, targets, grad_scale=torch.ones(2))


def test_position_ids_move_learned_and_rotary_positions():
    for config in (GPT2_LIKE, LLAMA_LIKE):
        model = make(config)
        idx, _ = batch(model.config, 1, 6)
        with torch.no_grad():
            base = model(idx)
            same = model(idx, position_ids=torch.arange(6))
            spread = model(idx, position_ids=torch.tensor([[0, 2, 3, 5, 8, 9]]))  # rotary sees relative positions
        torch.testing.assert_close(base, same)
        assert (base - spread).abs().max() > 1e-4


def test_pipeline_stages_compose_to_the_whole_model():
    model = make(LLAMA_LIKE)
    idx, targets = batch(model.config, 2, 9)
    first, second = make(LLAMA_LIKE), make(LLAMA_LIKE)
    del first.blocks["1"]
    first.norm_f = None
    first.lm_head = None if first.config.tie_embeddings else first.lm_head
    del second.blocks["0"]
    second.wte = None
    with torch.no_grad():
        hidden = first(idx)
        assert hidden.shape == (2, 9, 64)
        torch.testing.assert_close(second(hidden, targets), model(idx, targets))
        torch.testing.assert_close(second(hidden), model(idx))
    with pytest.raises(ValueError, match="input is the hidden state"):
        second(idx)


def test_sum_reduction_and_all_ignored():
    model = make(GPT2_LIKE)
    idx, targets = batch(model.config, 2, 7, ignore=4)
    with torch.no_grad():
        total = model(idx, targets, reduction="sum")
        mean = model(idx, targets)
    torch.testing.assert_close(total / 10, mean)
    with torch.no_grad():
        assert torch.isnan(model(idx, torch.full_like(targets, -100)))  # as torch: 0 / 0


# ---- the Triton kernels inside the model (interpreter on CPU) ---------------------------------------------------------
TRITON_KERNELS = {"rms_norm": "triton", "layer_norm": "triton", "rotary": "triton", "cross_entropy": "triton",
                  "bias_gelu": "triton", "linear": "triton", "embedding": "triton"}


@pytest.mark.parametrize("name", CONFIGS)
def test_triton_kernels_match_reference_fp32(name):
    """Norms, rotary and the fused cross-entropy in Triton (attention in fp32 takes the reference)."""
    require_triton()
    model = make(CONFIGS[name], n_layer=1, kernels=TRITON_KERNELS, ce_chunk=7).to(DEVICE)
    check_against_reference(model, B=2, T=9, atol=ATOL[torch.float32])


@pytest.mark.parametrize("bias", [True, False])
def test_mlp_gelu_takes_the_bias_gelu_op(bias, monkeypatch):
    """The tanh GELU runs as megakern.bias_gelu with fc's bias or without one (None), the product without the bias
    when there is one; torch's own GELU only where the op's backend is torch."""
    import megakern

    require_triton()
    calls = []
    real = megakern.bias_gelu
    monkeypatch.setattr(megakern, "bias_gelu", lambda h, b, **kw: calls.append(b) or real(h, b, **kw))
    model = make(GPT2_LIKE, n_layer=1, bias=bias, kernels={"bias_gelu": "triton"}).to(DEVICE)
    check_against_reference(model, B=2, T=9, atol=ATOL[torch.float32])
    assert calls and all((b is model.blocks["0"].mlp.fc.bias) if bias else b is None for b in calls)
    calls.clear()
    idx, targets = (t.to(DEVICE) for t in batch(model.config, 1, 5))
    make(GPT2_LIKE, n_layer=1, bias=bias, kernels={"bias_gelu": "torch"}).to(DEVICE)(idx, targets)
    assert not calls


@pytest.mark.parametrize("name", ["llama-like", "mqa"])
def test_traced_rotary_path_matches_in_place(name, monkeypatch):
    """Under torch.compile the rotation runs out of place after a plain split; same loss and gradients."""
    require_triton()
    model = make(CONFIGS[name], n_layer=1, kernels={"rotary": "triton"}).to(DEVICE)
    idx, targets = (t.to(DEVICE) for t in batch(model.config, 2, 9))
    loss, grads = loss_and_grads(model, idx, targets)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced_loss, traced_grads = loss_and_grads(model, idx, targets)
    torch.testing.assert_close(traced_loss, loss, rtol=1e-6, atol=1e-6)
    for key, g in grads.items():
        torch.testing.assert_close(traced_grads[key], g, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("heads", [(4, 2), (2, 1), (2, 2)], ids=("gqa", "mqa", "mha"))
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if HAS_CUDA else []))
def test_triton_kernels_with_attention_low_precision(dtype, heads, monkeypatch):
    """Every op in Triton, fp16 weights (and bf16 on a GPU): the 2x rule against the fp64 reference and plain torch
    in the same dtype, for the packed layout too. q, k and v are views of the projection's output (grouped queries:
    its heads-major product), so the attention backward writes the qkv gradient whole (the rotation undone in place
    on it), with no concatenation."""
    import megakern.models.gpt as gpt

    require_triton()
    packed = []
    monkeypatch.setattr(gpt, "packed_qkv", lambda *t: packed.append(megakern_packed(*t)) or packed[-1])
    n_head, kv_heads = heads
    config = dict(LLAMA_LIKE, n_layer=1, n_embd=16 * n_head, n_head=n_head, n_kv_head=kv_heads, ffn_hidden=24)
    model = make(config, kernels={**TRITON_KERNELS, "attention": "triton"}).to(DEVICE, dtype)
    check_against_reference(model, B=1, T=18, atol=ATOL[dtype])
    assert packed and all(p is not None for p in packed), "the qkv gradient comes whole from attention"
    cu = torch.tensor([0, 7, 18], dtype=torch.int32)
    check_against_reference(model, B=1, T=18, atol=ATOL[dtype], doc_lengths=[7, 11], cu_seqlens=cu)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
def test_gpu_default_kernels_bf16_match_reference(name):
    """The default kernels of a GPU (Triton) in bf16, against the reference on CPU in fp64 and in bf16."""
    config = dict(CONFIGS[name], n_embd=128, n_head=2, n_kv_head=1 if name == "llama-like" else None, max_seqlen=64)
    with torch.device("cuda"):
        model = make(config)
    model = model.to(torch.bfloat16)
    idx, targets = batch(model.config, 2, 64)
    loss, grads = loss_and_grads(model, idx.cuda(), targets.cuda())
    ref64, refl = reference(model, torch.float64).cpu(), reference(model, torch.bfloat16).cpu()
    loss64, grads64 = loss_and_grads(ref64, idx, targets)
    lossl, gradsl = loss_and_grads(refl, idx, targets)
    assert_close_to_ref("loss", loss, loss64, lossl, ATOL[torch.bfloat16])
    for key in grads:
        assert_close_to_ref(f"grad {key}", grads[key], grads64[key], gradsl[key], ATOL[torch.bfloat16])


def test_autocast_bf16_cpu_runs_and_tracks_fp32():
    model = make(LLAMA_LIKE)
    idx, targets = batch(model.config, 2, 10)
    with torch.no_grad():
        full = model(idx, targets)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(idx, targets)
    assert low.dtype == torch.float32
    assert abs(low.item() - full.item()) < 0.05


def test_config_is_a_plain_dataclass():
    config = GPTConfig.preset("llama-tiny", kernels={"attention": "torch"})
    copy = GPTConfig(**dataclasses.asdict(config))
    assert copy == config and copy.validate() is copy
