"""MoE kernels (megakern/moe.py, megakern/_moe_triton.py, megakern/_grouped_gemm_triton.py) against the references.

permute, unpermute and grouped_mm on the triton backend, forward and every gradient (x, y, the combine weights, the
expert weights), held to the 2x rule against the fp64 reference (see conftest): odd sizes (37 tokens, 24 and 40
columns, 5 experts, top-2), experts that receive no token, dropped assignments (-1) and a plan that drops every
assignment, padded plans (fixed slots per expert that cut rows or leave them empty), non-contiguous inputs and
incoming gradients, the grouped GEMM's pointer and TMA paths, persistent and one program per tile. On a CPU the kernels run under the interpreter at tiny sizes in fp32 and fp16 (the interpreter
rounds bf16 wrongly); bf16, larger shapes, TMA on Hopper and the absence of host syncs run on a GPU.
"""
from __future__ import annotations

import pytest
import torch
from conftest import ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, poison_cuda_allocator, require_triton, seed

from megakern import _backend, moe
from megakern.moe import grouped_mm_ref, padded_plan, permute_ref, route_plan, unpermute_ref

DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())

# tokens, top_k, experts, columns, experts left without tokens, assignments dropped
PLANS = {
    "odd": (37, 2, 5, 24, (1,), 3),
    "k1-wide": (19, 1, 3, 40, (), 0),
    "fine": (23, 3, 9, 24, (0, 4, 8), 5),
    "all-dropped": (5, 2, 3, 24, (), 10),
}


LAYOUTS = ("contiguous", "rows", "cols")
# every plan with contiguous inputs, the plans that route tokens with the non-contiguous ones
PLAN_LAYOUTS = [(name, layout) for name in PLANS for layout in LAYOUTS
                if layout == "contiguous" or name != "all-dropped"]
# padded plans (expert parallelism's fixed-size dispatch): slots that cut some experts' rows (odd@6: about 15 a
# expert), slots with room to spare (fine@12), a plan that drops every assignment
PADDED = ("odd@6", "fine@12", "all-dropped@2")
PADDED_LAYOUTS = [("odd@6", "rows"), ("fine@12", "cols"), ("all-dropped@2", "contiguous")]


def _expert_idx(n, k, experts, empty, dropped):
    """(n, k) distinct experts per token drawn from the experts not in ``empty``, ``dropped`` of them set to -1."""
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    choice = torch.rand(n, len(allowed)).argsort(dim=1)[:, :k]
    idx = allowed[choice]
    flat = idx.reshape(-1)
    flat[torch.randperm(flat.numel())[:dropped]] = -1
    return flat.reshape(n, k).to(DEVICE)


def _plan(name):
    """PLANS[name]'s plan; "name@C": that plan padded to C slots per expert (padded_plan)."""
    name, _, cap = name.partition("@")
    n, k, experts, cols, empty, dropped = PLANS[name]
    plan = route_plan(_expert_idx(n, k, experts, empty, dropped), experts)
    if cap:
        plan = padded_plan(plan, int(cap))
    return plan, n, k, experts, cols


def _leaf(shape, dtype, layout="contiguous", scale=1.0):
    """A fresh random leaf of ``shape`` (2-D or 3-D): contiguous, with a row stride of twice its width ("rows"), or
    the transpose of the last two dims' storage ("cols")."""
    if layout == "rows":
        t = torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE)[..., :shape[-1]]
    elif layout == "cols":
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], device=DEVICE).transpose(-1, -2)
    else:
        t = torch.randn(shape, device=DEVICE)
    return (t * scale).to(dtype).requires_grad_()


def _like(t, dtype):
    return t.detach().to(dtype).requires_grad_()


def _grad_out(shape, dtype):
    """An incoming gradient that is not contiguous (the transpose of its storage)."""
    return torch.randn(shape[::-1], device=DEVICE).to(dtype).t()


def _check(names, outs, truths, lowps, dtype):
    for name, out, truth, lowp in zip(names, outs, truths, lowps):
        assert out.dtype == lowp.dtype, f"{name}: dtype {out.dtype}, expected {lowp.dtype}"
        assert_close_to_ref(name, out, truth, lowp, ATOL[dtype])


def _skip_interpreter_bf16(dtype):
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("the Triton CPU interpreter rounds fp32->bf16 casts wrongly; bf16 runs on the GPU")


# ---- low-precision torch: the same math in the input dtype (the 2x rule's baseline) -------------------------------
def _unpermute_lowp(y, w, plan):
    kept = (plan.position >= 0).to(y.dtype)
    rows = y.index_select(0, plan.position.clamp(min=0))
    scale = w.to(y.dtype).reshape(-1) * kept
    return (rows * scale.unsqueeze(1)).reshape(w.shape[0], plan.top_k, y.shape[1]).sum(1)


def _grouped_mm_lowp(x, w, offsets):
    bounds = offsets.tolist()
    parts = [x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(w.shape[0])]
    parts.append(x.new_zeros(x.shape[0] - bounds[-1], w.shape[2]))
    return torch.cat(parts)


# ---- route plan ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PLANS))
def test_route_plan(name):
    seed("plan", name)
    plan, n, k, experts, _ = _plan(name)
    flat = plan.order.new_empty(0)
    for e in range(experts):
        rows = plan.order[plan.offsets[e]:plan.offsets[e + 1]]
        flat = torch.cat([flat, rows])
        assert torch.equal(rows, rows.sort().values), "an expert's rows keep assignment order"
    kept = plan.position >= 0
    assert int(plan.offsets[-1]) == int(kept.sum()) == int(plan.counts.sum())
    assert torch.equal(plan.position[plan.order[:int(plan.offsets[-1])]], torch.arange(int(plan.offsets[-1]),
                                                                                     device=DEVICE))
    assert sorted(plan.order.tolist()) == list(range(n * k))


@pytest.mark.parametrize("name", PADDED)
def test_padded_plan(name):
    """Expert e's slot holds its first min(count, C) rows of the plan in order, then -1; position points each kept
    assignment at its row (-1 past the capacity); the shapes depend on E and C alone."""
    seed("padded", name)
    base, _, cap = name.partition("@")
    cap = int(cap)
    n, k, experts, _, empty, dropped = PLANS[base]
    plan = route_plan(_expert_idx(n, k, experts, empty, dropped), experts)
    padded = padded_plan(plan, cap)
    assert padded.order.shape == (experts * cap,) and padded.position.shape == (n * k,)
    assert padded.offsets.tolist() == [e * cap for e in range(experts + 1)]
    assert padded.counts.tolist() == [min(c, cap) for c in plan.counts.tolist()]
    want_position = torch.full((n * k,), -1, dtype=torch.int64)
    for e in range(experts):
        rows = plan.order[plan.offsets[e]:plan.offsets[e + 1]][:cap].cpu()
        slot = padded.order[e * cap:(e + 1) * cap].cpu()
        assert torch.equal(slot[:len(rows)], rows) and (slot[len(rows):] == -1).all(), (e, slot, rows)
        want_position[rows] = torch.arange(e * cap, e * cap + len(rows))
    assert torch.equal(padded.position.cpu(), want_position)
    if base == "odd":
        assert int((padded.position < 0).sum()) > int((plan.position < 0).sum()), "the slots must cut rows"
    with pytest.raises(ValueError, match="padded_plan: capacity must be an int >= 1, got 0"):
        padded_plan(plan, 0)
    with pytest.raises(ValueError, match="padded_plan: plan is padded already"):
        padded_plan(padded_plan(plan, 1), 1)


# ---- permute -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,layout", PLAN_LAYOUTS + PADDED_LAYOUTS)
def test_permute_matches_reference(name, layout, dtype):
    require_triton()
    seed("permute", name, layout, dtype)
    plan, n, k, _, cols = _plan(name)
    x = _leaf((n, cols), dtype, layout)
    poison_cuda_allocator(1 << 20)
    out = moe.permute(x, plan, backend="triton")
    assert torch.equal(out, permute_ref(x.detach(), plan)), "permute moves rows exactly"
    g = _grad_out(out.shape, dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    x64, xl = _like(x, torch.float64), _like(x, dtype)
    (dx64,) = torch.autograd.grad(permute_ref(x64, plan), x64, g.double())
    (dxl,) = torch.autograd.grad(permute_ref(xl, plan), xl, g)
    _check(["grad x"], [dx], [dx64], [dxl], dtype)


# ---- unpermute -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,layout,w_dtype", [(name, layout, "fp32") for name, layout in PLAN_LAYOUTS]
                         + [("odd", "contiguous", "same"), ("fine", "cols", "same")]
                         + [(name, layout, "same") for name, layout in PADDED_LAYOUTS])
def test_unpermute_matches_reference(name, layout, w_dtype, dtype):
    require_triton()
    _skip_interpreter_bf16(dtype)
    seed("unpermute", name, layout, w_dtype, dtype)
    plan, n, k, _, cols = _plan(name)
    y = _leaf((plan.order.numel(), cols), dtype, layout)
    w = _leaf((n, k), torch.float32 if w_dtype == "fp32" else dtype, "cols" if layout == "cols" else "contiguous")
    poison_cuda_allocator(1 << 20)
    out = moe.unpermute(y, w, plan, backend="triton")
    g = _grad_out(out.shape, dtype)
    dy, dw = torch.autograd.grad(out, (y, w), g)
    y64, w64 = _like(y, torch.float64), _like(w, torch.float64)
    truth = unpermute_ref(y64, w64, plan)
    yl, wl = _like(y, dtype), _like(w, w.dtype)
    lowp = _unpermute_lowp(yl, wl, plan)
    _check(["out"], [out], [truth], [lowp], dtype)
    _check(["grad y", "grad weights"], [dy, dw], torch.autograd.grad(truth, (y64, w64), g.double()),
           [t.to(r.dtype) for t, r in zip(torch.autograd.grad(lowp, (yl, wl), g), (y, w))], dtype)
    assert dw.dtype == w.dtype and dw.shape == w.shape
    assert (dw.reshape(-1)[plan.position < 0] == 0).all(), "dropped assignments get no weight gradient"


# ---- grouped GEMM --------------------------------------------------------------------------------------------------
def _grouped_mm_case(name, dtype, x_layout, w_layout, features=40):
    plan, n, k, experts, cols = _plan(name)
    x = _leaf((n * k, cols), dtype, x_layout)
    w = _leaf((experts, cols, features), dtype, w_layout, scale=cols ** -0.5)
    return plan.offsets, x, w


def _grouped_mm_truth(x, w, offsets, g, dtype):
    x64, w64 = _like(x, torch.float64), _like(w, torch.float64)
    truth = grouped_mm_ref(x64, w64, offsets)
    xl, wl = _like(x, dtype), _like(w, dtype)
    lowp = _grouped_mm_lowp(xl, wl, offsets)
    return ([truth, *torch.autograd.grad(truth, (x64, w64), g.double())],
            [lowp, *torch.autograd.grad(lowp, (xl, wl), g)])


GEMM_LAYOUTS = {"contiguous": ("contiguous", "contiguous"), "rows": ("rows", "cols"), "cols": ("cols", "rows")}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,layout", PLAN_LAYOUTS)
def test_grouped_mm_matches_reference(name, layout, dtype):
    require_triton()
    _skip_interpreter_bf16(dtype)
    seed("grouped_mm", name, layout, dtype)
    offsets, x, w = _grouped_mm_case(name, dtype, *GEMM_LAYOUTS[layout])
    poison_cuda_allocator(1 << 20)
    out = moe.grouped_mm(x, w, offsets, backend="triton")
    g = _grad_out(out.shape, dtype)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    truths, lowps = _grouped_mm_truth(x, w, offsets, g, dtype)
    _check(["out", "grad x", "grad w"], [out, dx, dw], truths, lowps, dtype)
    tail = int(offsets[-1])
    assert (out[tail:] == 0).all() and (dx[tail:] == 0).all(), "rows past offsets[E] are zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("tma", [False, True])
def test_grouped_gemm_launch_paths(tma, persistent, dtype):
    """The kernels' tile moves (masked pointers, TMA descriptors) and grids (persistent, a program per tile slot),
    with tiles that cut K and N unevenly; TMA here also under the interpreter."""
    require_triton()
    _skip_interpreter_bf16(dtype)
    from megakern import _grouped_gemm_triton as gg

    if tma and HAS_CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90+")
    seed("launch", tma, persistent, dtype)
    offsets, x, w = _grouped_mm_case("odd", dtype, "contiguous", "contiguous", features=48)
    cfg = gg.Config(16, 32, 16, 2, 2, 4, persistent) if x.is_cuda else gg.Config(16, 32, 16, 2, 1, 4, persistent)
    g = _grad_out((x.shape[0], w.shape[2]), dtype).contiguous()
    out = gg.grouped_mm(x.detach(), w.detach(), offsets, config=cfg, tma=tma)
    dx = gg.grouped_mm(g, w.detach().transpose(1, 2), offsets, config=cfg, tma=tma)
    dw = gg.grouped_mm_dw(x.detach(), g, offsets, w.shape[0], config=cfg, tma=tma)
    truths, lowps = _grouped_mm_truth(x, w, offsets, g, dtype)
    _check(["out", "grad x", "grad w"], [out, dx, dw], truths, lowps, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tma", [False, True])
def test_grouped_gemm_dw_prefetched_tail(tma, dtype):
    """dW with each expert's last (masked) step loaded before its whole steps, two programs per SM: experts without
    rows, with fewer rows than a step and with a remainder, against the fp64 truth."""
    require_triton()
    _skip_interpreter_bf16(dtype)
    from megakern import _grouped_gemm_triton as gg

    if tma and HAS_CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90+")
    seed("dw tail", tma, dtype)
    offsets, x, w = _grouped_mm_case("odd", dtype, "contiguous", "contiguous", features=48)
    stages = 2 if x.is_cuda else 1
    cfg = gg.Config(16, 32, 16, 2, stages, 4, True, occupancy=2, prefetch_tail=True)
    g = _grad_out((x.shape[0], w.shape[2]), dtype).contiguous()
    dw = gg.grouped_mm_dw(x.detach(), g, offsets, w.shape[0], config=cfg, tma=tma)
    truths, lowps = _grouped_mm_truth(x, w, offsets, g, dtype)
    _check(["grad w"], [dw], truths[2:], lowps[2:], dtype)


def test_permute_rows():
    """x[index] with the gradient gathered by the inverse permutation: index_select's values and gradient, exactly."""
    seed("permute_rows")
    x = torch.randn(29, 6, device=DEVICE, dtype=torch.float64)[:, ::2].requires_grad_()  # strided rows
    index = torch.randperm(29, device=DEVICE)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(29, device=DEVICE)
    g = torch.randn(29, 3, device=DEVICE, dtype=torch.float64)
    out = moe.permute_rows(x, index, inverse)
    (dx,) = torch.autograd.grad(out, x, g)
    (ref_dx,) = torch.autograd.grad(x.index_select(0, index), x, g)
    assert torch.equal(out, x.detach()[index]) and torch.equal(dx, ref_dx)
    with pytest.raises(ValueError, match=r"permute_rows: index \(28,\) and inverse \(29,\)"):
        moe.permute_rows(x, index[:28], inverse)


def test_deterministic():
    require_triton()
    seed("deterministic")
    plan, n, k, experts, cols = _plan("odd")
    x = _leaf((n, cols), torch.float32)
    w = _leaf((experts, cols, 40), torch.float32)
    wts = _leaf((n, k), torch.float32)

    def run():
        out = moe.unpermute(moe.grouped_mm(moe.permute(x, plan, backend="triton"), w, plan.offsets, backend="triton"),
                            wts, plan, backend="triton")
        return [out, *torch.autograd.grad(out.square().sum(), (x, w, wts))]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


# ---- backends and bad input ----------------------------------------------------------------------------------------
def test_backends_and_checks():
    seed("checks")
    plan, n, k, experts, cols = _plan("odd")
    x = torch.randn(n, cols, device=DEVICE)
    y = torch.randn(n * k, cols, device=DEVICE)
    w = torch.randn(experts, cols, 8, device=DEVICE)
    assert _backend.op_backends("moe") == _backend.op_backends("grouped_mm") == ("triton", "torch")
    expected = "triton" if HAS_CUDA else "torch"
    assert moe.moe_backend(x) == moe.grouped_mm_backend(y) == expected
    assert moe.moe_backend(x.double(), {"grouped_mm": "triton"}) == "torch"  # fp64: the reference by default
    with pytest.raises(ValueError, match="moe: unknown backend 'cuda'"):
        moe.permute(x, plan, backend="cuda")
    with pytest.raises(TypeError, match="permute: the triton backend takes .*float64"):
        moe.permute(x.double(), plan, backend={"moe": "triton"})
    with pytest.raises(TypeError, match="grouped_mm: w is torch.float16 but x is torch.float32"):
        moe.grouped_mm(y, w.half(), plan.offsets)
    with pytest.raises(ValueError, match="grouped_mm: w is on meta but x is on"):
        moe.grouped_mm(y, w.to("meta"), plan.offsets)
    with pytest.raises(ValueError, match="unpermute: weights is on meta"):
        moe.unpermute(y, torch.rand(n, k, device="meta"), plan)
    with pytest.raises(ValueError, match="permute: the plan routes 3 assignments, x has 37 tokens x top_k 2"):
        moe.permute(x, plan._replace(position=plan.position[:3]))
    with pytest.raises(ValueError, match="unpermute: the plan lays out 15 rows, the input has 74 rows"):
        moe.unpermute(y, torch.rand(n, k, device=DEVICE), padded_plan(plan, 3))
    with pytest.raises(TypeError, match="permute: plan.offsets must be an int64/int32 tensor, got torch.float32"):
        moe.permute(x, plan._replace(offsets=plan.offsets.float()))
    with pytest.raises(ValueError, match="unpermute: weights has shape \\(37, 3\\), expected \\(37, 2\\)"):
        moe.unpermute(y, torch.rand(n, 3, device=DEVICE), plan)


def test_empty_inputs():
    require_triton()
    plan = route_plan(torch.empty(0, 2, dtype=torch.long, device=DEVICE), 4)
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    out = moe.permute(x, plan, backend="triton")
    assert out.shape == (0, 16)
    w = torch.randn(4, 16, 8, device=DEVICE, requires_grad=True)
    h = moe.grouped_mm(out, w, plan.offsets, backend="triton")
    y = moe.unpermute(h, torch.rand(0, 2, device=DEVICE), plan, backend="triton")
    assert y.shape == (0, 8)
    (dw,) = torch.autograd.grad(h.sum(), w)
    assert torch.equal(dw, torch.zeros_like(dw))


# ---- lowering for Hopper (Triton's sm_90 compiler runs without a GPU) ----------------------------------------------
def compile_for_sm90() -> list:
    """(kernel, shared memory bytes, uses wgmma, moves tiles by TMA) for the grouped GEMM's kernels at their default
    bf16 tiles for the issue's shapes (forward, dX with w transposed, dW) and the gather / combine kernels, compiled
    for sm_90. Needs real (not interpreted) Triton kernels: run with TRITON_INTERPRET=0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _grouped_gemm_triton as gg
    from megakern import _moe_triton as mt

    cuda = torch.device("cuda")
    gemm = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "OFFSETS": "*i64"}
    moves = {"SRC": "*bf16", "Y": "*bf16", "OUT": "*bf16", "ORDER": "*i64", "OFFSETS": "*i64", "POSITION": "*i64",
             "W": "*fp32", "DW": "*fp32"}
    kernels = []
    for name, (m, n, k, e) in {"fwd E=8": (65536, 14336, 4096, 8), "dX E=8": (65536, 4096, 14336, 8),
                               "fwd E=64": (32768, 1408, 2048, 64)}.items():
        cfg = gg.default_config(m, n, k, e, torch.bfloat16, cuda)
        kernels.append((name, gg._grouped_mm_kernel, cfg, dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, E_POW2=e,
            STAGES=cfg.stages, TMA=True, TRANS_B=name.startswith("dX"), UPCAST=False, PRECISION="tf32")))
    for name, (m, n, k, e) in {"dW E=8": (65536, 14336, 4096, 8), "dW E=64": (32768, 1408, 2048, 64)}.items():
        cfg = gg.default_config(m, n, k, e, torch.bfloat16, cuda, dw=True)
        kernels.append((name, gg._grouped_mm_dw_kernel, cfg, dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.stages,
            TMA=True, UPCAST=False, PRECISION="tf32", PREFETCH_TAIL=cfg.prefetch_tail)))
    block_r, block_c, warps = mt._gather_blocks(4096, cuda)
    kernels.append(("gather", mt._gather_kernel, gg.Config(0, 0, 0, 0, 1, warps), dict(
        TOP_K=2, HAS_W=True, HAS_DW=True, BLOCK_R=block_r, BLOCK_C=block_c)))
    block_t, block_c, warps = mt._combine_blocks(4096, cuda)
    kernels.append(("combine", mt._combine_kernel, gg.Config(0, 0, 0, 0, 1, warps), dict(
        TOP_K=2, HAS_W=True, BLOCK_T=block_t, BLOCK_C=block_c)))
    results = []
    for name, fn, cfg, constexprs in kernels:
        pointers = moves if name in ("gather", "combine") else gemm
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 64),
                                  options=dict(num_warps=cfg.warps, num_stages=cfg.stages))
        ptx = compiled.asm["ptx"]
        results.append((name, compiled.metadata.shared, "wgmma" in ptx, "cp.async.bulk.tensor" in ptx,
                        cfg.occupancy))
    return results


def test_kernels_compile_for_sm90():
    """The grouped GEMM lowers for Hopper onto wgmma with TMA tile moves, within shared memory (two programs of the
    dW tile for few rows an expert fit one SM); so do the gather and combine kernels."""
    from conftest import sm90_lowering

    results = sm90_lowering("test_moe_kernels", "compile_for_sm90()")
    assert [name for name, *_ in results] == ["fwd E=8", "dX E=8", "fwd E=64", "dW E=8", "dW E=64", "gather",
                                              "combine"]
    assert [occupancy for *_, occupancy in results[3:5]] == [1, 2], "dW E=64's tile is the two-programs-an-SM one"
    for name, shared, wgmma, tma, occupancy in results:
        assert shared <= 227 * 1024, f"{name}: {shared} bytes of shared memory"
        # an SM has 228 KiB, of which each resident program reserves 1 KiB
        assert occupancy * (shared + 1024) <= 228 * 1024, f"{name}: {occupancy} programs of {shared} bytes an SM"
        if name not in ("gather", "combine"):
            assert wgmma and tma, f"{name}: wgmma {wgmma}, TMA {tma} in the sm_90 PTX"


# ---- GPU: larger shapes, TMA, no host syncs ------------------------------------------------------------------------
GPU_GEMMS = [  # experts, K, N, rows, experts left without tokens
    (8, 512, 1024, 4096, (3,)),
    (64, 256, 176, 6000, (0, 17, 63)),
    (128, 128, 96, 3001, tuple(range(0, 128, 5))),
    (6, 40, 20, 999, (2,)),  # 40-byte rows of w and out: TMA cannot take them, pointer loads
]


def _skewed_offsets(rows, experts, empty):
    """Expert row counts drawn unevenly (some ten times others), the listed experts empty, summing to <= rows."""
    weight = torch.rand(experts) ** 3 + 0.05
    weight[list(empty)] = 0
    counts = (weight / weight.sum() * rows * 0.97).long()
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [None, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(GPU_GEMMS)))
def test_grouped_mm_gpu_shapes(case, dtype, tma):
    from megakern import _grouped_gemm_triton as gg

    experts, k, n, rows, empty = GPU_GEMMS[case]
    seed("gpu gemm", case, dtype, tma)
    offsets = _skewed_offsets(rows, experts, empty)
    x = _leaf((rows, k), dtype)
    w = _leaf((experts, k, n), dtype, scale=k ** -0.5)
    g = torch.randn(rows, n, device=DEVICE).to(dtype)
    poison_cuda_allocator(1 << 26)
    out = gg.grouped_mm(x.detach(), w.detach(), offsets, tma=tma)
    poison_cuda_allocator(1 << 26)
    dx = gg.grouped_mm(g, w.detach().transpose(1, 2), offsets, tma=tma)
    poison_cuda_allocator(1 << 26)
    dw = gg.grouped_mm_dw(x.detach(), g, offsets, experts, tma=tma)
    truths, lowps = _grouped_mm_truth(x, w, offsets, g, dtype)
    _check(["out", "grad x", "grad w"], [out, dx, dw], truths, lowps, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_ops_gpu_shapes(dtype, padded):
    """The three ops chained at a layer's size; padded: slots of 1100 rows (about 1170 a expert: some cut)."""
    seed("gpu moe", dtype, padded)
    n, k, experts, cols = 4096, 2, 8, 1024
    plan = route_plan(_expert_idx(n, k, experts, (5,), 100), experts)
    if padded:
        plan = padded_plan(plan, 1100)
    x = _leaf((n, cols), dtype)
    w = _leaf((experts, cols, 512), dtype, scale=cols ** -0.5)
    wts = _leaf((n, k), torch.float32)
    poison_cuda_allocator(1 << 26)
    h = moe.permute(x, plan)
    hh = moe.grouped_mm(h, w, plan.offsets)
    out = moe.unpermute(hh, wts, plan)
    g = torch.randn(out.shape, device=DEVICE).to(dtype)
    grads = torch.autograd.grad(out, (x, w, wts), g)
    x64, w64, wts64 = (_like(t, torch.float64) for t in (x, w, wts))
    truth = unpermute_ref(grouped_mm_ref(permute_ref(x64, plan), w64, plan.offsets), wts64, plan)
    xl, wl, wtsl = _like(x, dtype), _like(w, dtype), _like(wts, torch.float32)
    lowp = _unpermute_lowp(_grouped_mm_lowp(permute_ref(xl, plan), wl, plan.offsets), wtsl, plan)
    _check(["out"], [out], [truth], [lowp], dtype)
    lowp_grads = [t.to(r.dtype) for t, r in zip(torch.autograd.grad(lowp, (xl, wl, wtsl), g), (x, w, wts))]
    _check(["grad x", "grad w", "grad weights"], grads, torch.autograd.grad(truth, (x64, w64, wts64), g.double()),
           lowp_grads, dtype)


@pytest.mark.gpu
def test_no_host_sync_gpu():
    """route_plan, the three ops and their gradients never read the device on the host (CUDA-graph capturable)."""
    seed("sync")
    n, k, experts, cols = 512, 2, 8, 256
    idx = _expert_idx(n, k, experts, (2,), 7)
    x = _leaf((n, cols), torch.bfloat16)
    w = _leaf((experts, cols, 128), torch.bfloat16)
    wts = _leaf((n, k), torch.float32)

    def step(cap=None):
        plan = route_plan(idx, experts)
        if cap:
            plan = padded_plan(plan, cap)
        out = moe.unpermute(moe.grouped_mm(moe.permute(x, plan), w, plan.offsets), wts, plan)
        return torch.autograd.grad(out.float().square().sum(), (x, w, wts))

    step()  # compile the kernels first
    step(100)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step(100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
