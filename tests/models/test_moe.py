"""models/moe.py: the routers against a loop over tokens in fp64, the MoE MLP (outputs and every gradient, aux and z
losses included) against a loop over experts with the 2x rule, capacity dropping (which assignments drop, every
time the same), the aux / z losses against hand-computed values, the bias update rule, the statistics a training
micro-batch adds (once, also under recomputation), GPTConfig's MoE errors, active-parameter counts."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_to_ref
from megakern.models.gpt import GPT, GPTConfig
from megakern.models.moe import (AUX, KEPT, NONFINITE, ROUTED, SHARE, Z, MoEMLP, capacity, drop_over_capacity,
                                 expert_counts, load_balancing_loss, route, router_z_loss, stat_width,
                                 update_expert_bias)


def _config(**kw) -> GPTConfig:
    base = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, max_seqlen=16, norm="rmsnorm", position="rotary",
                activation="swiglu", bias=False, n_experts=6, moe_top_k=2, moe_ffn_hidden=20,
                moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0)
    return GPTConfig(**{**base, **kw}).validate()


# ---- router math ---------------------------------------------------------------------------------------------------
def _route_loop(logits, k, router, bias, renormalize, n_groups, topk_groups):
    """Token by token in fp64: the chosen experts (best first) and their weights."""
    n, e = logits.shape
    idx, weights = [], []
    for t in range(n):
        row = logits[t].double()
        if router == "softmax":
            s = [math.exp(v) for v in row.tolist()]
            s = [v / sum(s) for v in s]
            choice = list(s)
        else:
            s = [1 / (1 + math.exp(-v)) for v in row.tolist()]
            choice = [v + (bias[i].item() if bias is not None else 0.0) for i, v in enumerate(s)]
        if n_groups > 1:
            size = e // n_groups
            groups = []
            for g in range(n_groups):
                members = sorted(choice[g * size:(g + 1) * size], reverse=True)
                groups.append((members[0] if router == "softmax" else sum(members[:2]), g))
            keep = {g for _, g in sorted(groups, key=lambda p: -p[0])[:topk_groups]}
            choice = [v if i // size in keep else -math.inf for i, v in enumerate(choice)]
        best = sorted(range(e), key=lambda i: -choice[i])[:k]
        w = [s[i] for i in best]
        if renormalize:
            w = [v / sum(w) for v in w]
        idx.append(best)
        weights.append(w)
    return torch.tensor(idx), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("router, renormalize, groups, with_bias", [
    ("softmax", False, (1, 1), False), ("softmax", True, (1, 1), False), ("softmax", False, (4, 2), False),
    ("sigmoid", True, (1, 1), True), ("sigmoid", False, (4, 2), True), ("sigmoid", True, (2, 1), False)])
def test_router_against_a_loop(router, renormalize, groups, with_bias):
    torch.manual_seed(0)
    n, e, k = 37, 8, 3 if groups[0] != 2 else 2
    logits = torch.randn(n, e) * 2
    bias = torch.randn(e) * 0.3 if with_bias else None
    r = route(logits, k, router=router, bias=bias, renormalize=renormalize, n_groups=groups[0],
              topk_groups=groups[1])
    idx, weights = _route_loop(logits, k, router, bias, renormalize, *groups)
    assert r.expert_idx.dtype == torch.int64 and r.weights.dtype == torch.float32
    assert torch.equal(r.expert_idx, idx)
    torch.testing.assert_close(r.weights.double(), weights, rtol=1e-6, atol=1e-7)
    if groups[0] > 1:  # every choice within the token's topk_groups groups
        size = e // groups[0]
        assert all(len({i // size for i in row}) <= groups[1] for row in r.expert_idx.tolist())
    if router == "sigmoid":  # the bias chooses, the weights are the unbiased scores
        s = torch.sigmoid(logits).gather(1, r.expert_idx)
        expect = s / s.sum(-1, keepdim=True) if renormalize else s
        torch.testing.assert_close(r.weights, expect)


def test_router_math_is_fp32_under_bf16_inputs():
    torch.manual_seed(1)
    layer = MoEMLP(_config())
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer.router.logits(x.bfloat16())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.bfloat16().float() @ layer.router.weight.t())


# ---- the layer against a loop over experts ---------------------------------------------------------------------------
def _reference(layer: MoEMLP, x, idx, dtype, aux_scale=0.0):
    """The layer's output by a loop over tokens and their experts in ``dtype`` (the routing ``idx`` fixed, its
    weights and the losses differentiable), plus aux_scale * (coef_aux * aux + coef_z * z)."""
    params = {n: p.detach().to(dtype).requires_grad_() for n, p in layer.named_parameters()}
    xr = x.detach().to(dtype).requires_grad_()
    logits = xr @ params["router.weight"].t()
    probs = torch.softmax(logits, -1)
    w = probs.gather(1, idx)
    if layer.renormalize:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(xr)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = xr[t] @ params["w_in"][e]
            h = h.unflatten(-1, (-1, 2))
            h = F.silu(h[..., 0]) * h[..., 1]
            out[t] = out[t] + w[t, j] * (h @ params["w_out"][e])
    if layer.shared is not None:
        h = (xr @ params["shared.fc.weight"].t()).unflatten(-1, (-1, 2))
        out = out + (F.silu(h[..., 0]) * h[..., 1]) @ params["shared.proj.weight"].t()
    extra = 0.0
    if aux_scale:
        counts = torch.bincount(idx.reshape(-1), minlength=layer.n_experts).to(dtype)
        aux = layer.n_experts * ((counts / counts.sum()) * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        extra = aux_scale * (layer.aux_coef * aux + layer.z_coef * z)
    return out, extra, xr, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared, renormalize, losses", [(0, False, False), (1, True, True)])
def test_layer_against_a_loop_over_experts(dtype, shared, renormalize, losses):
    from megakern.models.gpt import MLP

    torch.manual_seed(2)
    cfg = _config(moe_shared_experts=shared, moe_renormalize=renormalize,
                  moe_aux_loss_coef=0.1 if losses else 0.0, moe_z_loss_coef=0.01 if losses else 0.0)
    layer = MoEMLP(cfg, MLP(cfg, shared * cfg.moe_ffn_hidden) if shared else None)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer = layer.to(dtype)
    layer.aux_loss_scale = 0.5
    n = 23  # odd: some experts get few or no tokens
    x = torch.randn(n, 32)
    g = torch.randn(n, 32)
    xl = x.to(dtype).requires_grad_()
    out = layer(xl)
    assert out.dtype == dtype
    (out.float() * g).sum().backward()
    idx = layer.routing(layer.router.logits(xl.detach())).expert_idx
    results = {}
    for name, ref_dtype in (("truth", torch.float64), ("lowp", dtype)):
        ref, extra, xr, params = _reference(layer, x, idx, ref_dtype, aux_scale=0.5 if losses else 0.0)
        ((ref.double() * g.double()).sum() + extra).backward()
        results[name] = (ref, xr.grad, {k: p.grad for k, p in params.items()})
    truth, lowp = results["truth"], results["lowp"]
    assert_close_to_ref("out", out, truth[0], lowp[0], atol=1e-5)
    assert_close_to_ref("dx", xl.grad, truth[1], lowp[1], atol=1e-5)
    for name, p in layer.named_parameters():
        assert_close_to_ref(f"d{name}", p.grad, truth[2][name], lowp[2][name], atol=1e-5)


@pytest.mark.parametrize("activation,approximate", [("gelu", "tanh"), ("gelu_exact", "none")])
def test_gelu_experts_and_zero_token_experts(activation, approximate):
    torch.manual_seed(3)
    cfg = _config(activation=activation, n_experts=8, moe_top_k=1)
    layer = MoEMLP(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        layer.router.weight[5:] = -100.0  # experts 5..7 get nothing (x > 0)
    x = torch.randn(9, 32).abs()
    out = layer(x)
    r = layer.routing(layer.router.logits(x))
    expect = torch.stack([r.weights[t, 0] * (F.gelu(x[t] @ layer.w_in[i], approximate=approximate) @ layer.w_out[i])
                          for t, i in enumerate(r.expert_idx[:, 0].tolist())])
    assert r.expert_idx.max() < 5
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)


# ---- capacity ------------------------------------------------------------------------------------------------------
def test_capacity_drops_lowest_scores_ties_to_the_earlier_assignment():
    # 4 tokens x k=2 over 3 experts; capacity 2 per expert
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    score = torch.tensor([[0.5, 0.2], [0.7, 0.1], [0.5, 0.3], [0.6, 0.1]])
    kept = drop_over_capacity(idx, score, 3, 2)
    # expert 0: assignments 0 (0.5), 2 (0.7), 4 (0.5), 7 (0.1): keeps 2 (0.7) and 0 (0.5, earlier than 4)
    # expert 1: assignments 1 (0.2), 5 (0.3), 6 (0.6): keeps 6 and 5; expert 2: assignment 3 kept
    assert kept.tolist() == [[0, -1], [0, 2], [-1, 1], [1, -1]]
    for _ in range(3):
        assert torch.equal(drop_over_capacity(idx, score, 3, 2), kept)
    assert capacity(4, 2, 3, 0.75) == 2 and capacity(4, 2, 3, None) is None


def test_capacity_in_the_layer_is_deterministic_and_bounded():
    torch.manual_seed(4)
    cfg = _config(moe_capacity_factor=0.5)
    layer = MoEMLP(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(40, 32)
    r = layer.routing(layer.router.logits(x))
    cap = capacity(40, 2, 6, 0.5)
    counts = expert_counts(r.expert_idx, 6)
    assert counts.max() <= cap and (r.expert_idx < 0).any()
    # what is kept is the top of each expert's scores
    for e in range(6):
        mine = r.routed == e
        scores = r.score[mine]
        kept = r.expert_idx[mine] == e
        if kept.any() and (~kept).any():
            assert scores[kept].min() >= scores[~kept].max()
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_forced_balance_draws_experts_evenly_weighted_by_the_router(router):
    """moe_force_balance (benchmarks): whatever the router prefers (here one expert by far), the k distinct experts
    are drawn evenly; the weights are the router's scores of them (renormalized), so the router gets gradients."""
    torch.manual_seed(5)
    layer = MoEMLP(_config(moe_force_balance=True, moe_router=router, moe_renormalize=True))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        layer.router.weight[0] += 0.4  # with inputs around 2: expert 0's logit about 26 above the others
    x = torch.randn(3000, 32) + 2.0
    logits = layer.router.logits(x)
    assert (route(logits, 2, router=router).expert_idx[:, 0] == 0).float().mean() > 0.95
    r = layer.routing(logits)
    counts = expert_counts(r.expert_idx, 6)
    assert counts.sum() == 6000 and (counts - 1000).abs().max() < 150, counts  # 1000 each, +-4.5 sigma
    assert (r.expert_idx[:, 0] != r.expert_idx[:, 1]).all()
    scores = torch.softmax(logits, -1) if router == "softmax" else torch.sigmoid(logits)
    picked = scores.gather(1, r.expert_idx)
    torch.testing.assert_close(r.weights, picked / picked.sum(-1, keepdim=True))
    layer(x[:64]).square().sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="moe_force_balance must be a bool, got 1"):
        _config(moe_force_balance=1)


# ---- losses, bias, statistics --------------------------------------------------------------------------------------
def test_aux_and_z_loss_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    counts = torch.tensor([1.0, 2.0, 1.0])  # top-2 of each token: (0, 1) and (1, 2)
    # E * sum_e f_e P_e = 3 * (0.25 * 0.4 + 0.5 * 0.4 + 0.25 * 0.2) = 1.05
    assert load_balancing_loss(probs, counts, 2.0).item() == pytest.approx(1.05)
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    # lse = log 4 and 1 + log 2: z = (log(4)^2 + (1 + log 2)^2) / 2
    assert router_z_loss(logits, 2.0).item() == pytest.approx((math.log(4) ** 2 + (1 + math.log(2)) ** 2) / 2)
    uniform = torch.full((4, 4), 0.25)
    assert load_balancing_loss(uniform, torch.full((4,), 2.0), 4.0).item() == pytest.approx(1.0)


def test_bias_update_rule():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10.0, 0.0, 5.0, 5.0]), 0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    update_expert_bias(bias, torch.tensor([0.0, 10.0, 5.0, 5.0]), 0.1, skip=torch.tensor(True))
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])  # a skipped step leaves it
    update_expert_bias(bias, torch.tensor([float("nan"), 1.0, 5.0, 5.0]), 0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])  # a non-finite load leaves it


def test_statistics_count_each_training_micro_batch_once():
    torch.manual_seed(5)
    cfg = _config(n_layer=3, moe_first_dense=1, moe_capacity_factor=0.6, recompute="full", moe_router="sigmoid")
    model = GPT(cfg)
    assert cfg.moe_blocks == [1, 2] and isinstance(model.blocks["0"].mlp, torch.nn.Module)
    stats = torch.zeros(2, model.moe_statistics_width)
    model.track_moe_statistics(stats)
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        model(idx, idx)  # no backward: nothing counted
    model.eval()
    model(idx, idx).backward()  # eval mode: nothing counted
    assert stats.abs().sum() == 0
    model.train()
    model(idx, idx).backward()
    e = cfg.n_experts
    assert stats[:, :e].sum(1).tolist() == [64.0, 64.0]  # 32 tokens x top-2, before the capacity
    assert stats[:, e + ROUTED].tolist() == [64.0, 64.0] and (stats[:, e + KEPT] < 64).all()
    assert stats[:, e + SHARE].tolist() == [1.0, 1.0] and stats[:, e + NONFINITE].sum() == 0
    assert (stats[:, e + AUX] > 0).all() and (stats[:, e + Z] > 0).all()
    model.discard_moe_statistics()
    assert stats.abs().sum() == 0


def test_nonfinite_router_logits_are_counted():
    cfg = _config(moe_router="sigmoid")
    layer = MoEMLP(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    stats = torch.zeros(1, stat_width(6))
    layer.track_statistics(stats)
    with torch.no_grad():
        layer.router.weight[0, 0] = float("inf")
    x = torch.randn(4, 32).abs().requires_grad_()
    layer(x).sum().backward()
    assert stats[0, 6 + NONFINITE] == 4


def test_update_expert_bias_through_the_model():
    cfg = _config(moe_router="sigmoid", moe_bias_update_rate=0.01)
    model = GPT(cfg)
    assert [b.tolist() for b in (m.router.expert_bias for m in model.moe_layers())] == [[0.0] * 6] * 2
    loads = torch.tensor([[3.0, 1, 1, 1, 1, 5], [1.0, 1, 1, 1, 1, 1]])
    model.update_expert_bias(loads)
    assert model.moe_layers()[0].router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01, 0.01, -0.01])
    assert model.moe_layers()[1].router.expert_bias.tolist() == [0.0] * 6
    assert "blocks.0.mlp.router.expert_bias" in model.state_dict()


# ---- config, parameters -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(moe_top_k=7), "moe_top_k (7) must be <= n_experts (6)"),
    (dict(moe_capacity_factor=0.0), "moe_capacity_factor must be None (dropless) or a number > 0, got 0.0"),
    (dict(moe_capacity_factor=-1), "moe_capacity_factor must be None (dropless) or a number > 0, got -1"),
    (dict(moe_n_groups=4), "moe_n_groups (4) must divide n_experts (6)"),
    (dict(moe_n_groups=3, moe_topk_groups=4), "moe_topk_groups (4) must be <= moe_n_groups (3)"),
    (dict(moe_n_groups=3, moe_topk_groups=1, moe_top_k=3), "moe_top_k (3) exceeds the 2 experts"),
    (dict(moe_router="switch"), "moe_router must be 'softmax' or 'sigmoid', got 'switch'"),
    (dict(moe_first_dense=2), "moe_first_dense (2) leaves no MoE block"),
    (dict(moe_aux_loss_coef=float("nan")), "moe_aux_loss_coef must be a number >= 0, got nan"),
    (dict(n_experts=-1), "n_experts must be an int >= 0, got -1"),
    (dict(moe_top_k=0), "moe_top_k must be an int >= 1, got 0"),
])
def test_config_errors_name_the_value(overrides, message):
    with pytest.raises(ValueError) as err:
        _config(**overrides)
    assert message in str(err.value)


def test_active_parameters_and_flops():
    cfg = _config(moe_shared_experts=1)
    with torch.device("meta"):
        model = GPT(cfg)
    per_expert = 32 * 40 + 20 * 32  # w_in (C, 2F) + w_out (F, C)
    total, active = model.num_params(), model.num_params(active=True)
    assert total - active == 2 * (6 - 2) * per_expert
    dense = GPTConfig(**{**cfg.__dict__, "n_experts": 0, "moe_shared_experts": 0, "ffn_hidden": 3 * 20})
    with torch.device("meta"):
        same = GPT(dense)  # a dense MLP of the active experts' units (2 routed + 1 shared)
    router = 2 * 6 * 32
    assert active == same.num_params() + router
    assert model.flops_per_token(16) - same.flops_per_token(16) == 6 * router


def test_presets_build_and_validate():
    for name in ("moe-tiny", "moe-mixtral", "moe-deepseek"):
        cfg = GPTConfig.preset(name)
        with torch.device("meta"):
            model = GPT(cfg)
        assert cfg.n_experts and model.num_params(active=True) < model.num_params()
    ds = GPTConfig.preset("moe-deepseek")
    assert (ds.n_experts, ds.moe_top_k, ds.moe_shared_experts, ds.moe_router) == (64, 6, 2, "sigmoid")
    mx = GPTConfig.preset("moe-mixtral")
    assert (mx.n_experts, mx.moe_top_k) == (8, 2)


def test_training_forward_and_backward_read_nothing_on_the_host(monkeypatch):
    """The MoE layer (routing, capacity, losses, statistics) reads no device value on the host, so a step that routes
    can be captured in a CUDA graph. megakern.moe's torch reference of the grouped GEMM reads the offsets (its Triton
    kernel does not): a gather-based stand-in takes its place here."""
    from host_reads import host_reads

    import megakern.models.moe as moe_module

    def grouped_mm(x, w, offsets, backend=None):
        rows = torch.arange(x.shape[0])
        e = torch.searchsorted(offsets[1:], rows, right=True).clamp(max=w.shape[0] - 1)
        out = torch.bmm(x.unsqueeze(1), w[e]).squeeze(1)
        return out * (rows < offsets[-1]).unsqueeze(1).to(out.dtype)

    monkeypatch.setattr(moe_module, "grouped_mm", grouped_mm)
    torch.manual_seed(6)
    cfg = _config(moe_router="sigmoid", moe_capacity_factor=1.0, moe_shared_experts=1, moe_aux_loss_coef=0.01,
                  moe_z_loss_coef=0.01, moe_n_groups=3, moe_topk_groups=2)
    model = GPT(cfg)
    stats = torch.zeros(2, model.moe_statistics_width)
    model.track_moe_statistics(stats)
    idx = torch.randint(0, 64, (2, 16))

    def step():
        model(idx, idx, check_values=False).backward()
        model.update_expert_bias(stats[:, :cfg.n_experts], torch.tensor(False))

    assert host_reads(step) == []
    assert stats[:, :cfg.n_experts].sum() > 0
