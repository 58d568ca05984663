"""megakern.fp8: recipes, scaling state, and the casts against the torch reference.

On a GPU every FP8 byte must equal the reference's. Under the Triton interpreter (CPU) fp32 -> fp8 casts round
wrongly where rounding carries into the next power of two and for subnormals (a known interpreter fault), so there
the bytes are compared where that cannot happen, and amaxes and scales (fp32) everywhere, exactly.
"""
import pytest
import torch
from conftest import DEVICE, HAS_CUDA, shared_data, sm90_lowering

from megakern import fp8
from megakern.fp8 import (BlockScaling, CurrentScaling, DelayedScaling, DelayedScalingState, Format, quantize,
                          quantize_ref, scale_from_amax)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
SMALLEST_NORMAL = {E4: 2.0 ** -6, E5: 2.0 ** -14}


def _backends():
    status = fp8._backend.available_backends(DEVICE)
    return [b for b in ("torch", "triton") if not status[b]]


MANTISSA_BITS = {E4: 3, E5: 2}


def _comparable(pre_cast: torch.Tensor, ref: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Where the interpreter's fp8 rounding is trustworthy: normal values whose rounding stays in their binade and
    that are not exact ties (the interpreter rounds ties away from zero, not to even; bf16 inputs make many)."""
    if HAS_CUDA:
        return torch.ones_like(pre_cast, dtype=torch.bool)
    r = ref.float().abs()
    p = pre_cast.abs().clamp(max=fp8.FP8_DTYPES[fp8_dtype])
    exponent = torch.floor(torch.log2(p))
    same_binade = torch.floor(torch.log2(r)) == exponent
    half_step = torch.exp2(exponent - MANTISSA_BITS[fp8_dtype] - 1)
    tie = (p - r).abs() == half_step
    return same_binade & ~tie & (p >= SMALLEST_NORMAL[fp8_dtype]) & torch.isfinite(pre_cast)


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor, pre_cast: torch.Tensor, fp8_dtype) -> None:
    assert got.dtype == want.dtype == fp8_dtype and got.shape == want.shape
    ok = _comparable(pre_cast.reshape(want.shape), want, fp8_dtype)
    assert ok.float().mean() > 0.8, "too few comparable elements for a meaningful check"
    g, w = got.view(torch.uint8)[ok], want.view(torch.uint8)[ok]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} FP8 bytes differ from the reference, first at {bad[0].tolist()}: "
                              f"{got.float()[ok][bad[0]].item()} vs {want.float()[ok][bad[0]].item()}")


def assert_dequantizes(q, x: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """|dequantized - x| within E4M3's rounding: 2^-4 relative for normals, half the smallest subnormal step (2^-10
    in scaled units) absolute. Under the interpreter, pass the reference's result (its casts round correctly)."""
    err = (q.dequantize() - x.float()).abs()
    bound = 2.0 ** -4 * x.float().abs() + scale_inv * 2.0 ** -10 + 1e-12
    assert (err <= bound).all(), f"dequantized off by up to {(err - bound).max().item():.3g} over E4M3's rounding"


def _x(shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


# ---- recipes and state -------------------------------------------------------------------------------------------
def test_recipes_validate_and_document_defaults():
    r = DelayedScaling()
    assert (r.fp8_format, r.margin, r.amax_history_len, r.amax_compute) == (Format.HYBRID, 0, 1024, "max")
    assert Format.HYBRID.dtype("grad") == E5 and Format.HYBRID.dtype("x") == E4 and Format.E4M3.dtype("grad") == E4
    assert DelayedScaling(fp8_format="E4M3").fp8_format is Format.E4M3
    with pytest.raises(ValueError, match="unknown format 'E3M4'"):
        DelayedScaling(fp8_format="E3M4")
    with pytest.raises(ValueError, match="margin must be an int >= 0"):
        DelayedScaling(margin=-1)
    with pytest.raises(ValueError, match="amax_history_len must be an int >= 1"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="amax_compute must be 'max' or 'most_recent'"):
        DelayedScaling(amax_compute="mean")
    with pytest.raises(ValueError, match="margin must be an int >= 0"):
        CurrentScaling(margin=True)
    with pytest.raises(ValueError, match="block must be a power of 2 >= 32"):
        BlockScaling(block=96)
    with pytest.raises(ValueError, match="block must be a power of 2 >= 32"):
        BlockScaling(block=16)
    with pytest.raises(ValueError, match="role must be"):
        Format.E4M3.dtype("bias")


def test_scale_from_amax_zero_and_nonfinite_keep_previous():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 448.0])
    prev = torch.full((5,), 7.0)
    got = scale_from_amax(amax, 448.0, margin=1, previous=prev)
    assert torch.equal(got, torch.tensor([112.0, 7.0, 7.0, 7.0, 0.5]))
    assert torch.equal(scale_from_amax(torch.tensor([0.0]), 448.0), torch.tensor([1.0]))


def test_delayed_state_history_nonfinite_and_checkpoint():
    state = DelayedScalingState(DelayedScaling(amax_history_len=3, margin=0), E4)
    assert state.scale.item() == 1.0
    for amax, want_scale in ((4.0, 112.0), (2.0, 112.0), (8.0, 56.0), (1.0, 56.0), (1.0, 56.0), (1.0, 448.0)):
        bad = state.update(torch.tensor(amax))
        assert not bad.item() and state.scale.item() == want_scale, (amax, state.scale.item())
    before = state.amax_history.clone(), state.scale.clone()
    assert state.update(torch.tensor(float("nan"))).item()
    assert state.update(torch.tensor(float("inf"))).item()
    assert torch.equal(state.amax_history, before[0]) and torch.equal(state.scale, before[1])
    assert state.nonfinite_steps.item() == 2
    assert not state.update(torch.tensor(3.0), skip=torch.tensor(True)).item()  # a step discarded elsewhere
    assert torch.equal(state.amax_history, before[0]) and torch.equal(state.scale, before[1])
    recent = DelayedScalingState(DelayedScaling(amax_history_len=4, amax_compute="most_recent"), E5)
    recent.update(torch.tensor(100.0))
    recent.update(torch.tensor(1.0))
    assert recent.scale.item() == 57344.0
    sd = state.state_dict()
    assert set(sd) == {"amax_history", "scale", "nonfinite_steps"}
    other = DelayedScalingState(DelayedScaling(amax_history_len=3), E4)
    other.load_state_dict(sd)
    assert torch.equal(other.scale, state.scale) and torch.equal(other.amax_history, state.amax_history)
    with pytest.raises(TypeError, match="recipe must be a DelayedScaling"):
        DelayedScalingState(CurrentScaling(), E4)


# ---- the casts -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_delayed_cast_one_pass_with_amax_and_transpose(backend, fp8_dtype, dtype):
    if backend not in _backends():
        pytest.skip(f"backend {backend} unavailable here")
    x = _x((3, 37, 45), dtype, scale=40.0)
    x.view(-1)[7] = 4096.0  # exact in every input dtype; saturates at these scales
    scale = torch.tensor([0.5], device=DEVICE) if fp8_dtype == E4 else torch.tensor([16.0], device=DEVICE)
    amax_out = torch.tensor([1.0], device=DEVICE)
    q = quantize(x, fp8_dtype, scale=scale, amax_out=amax_out, transpose=True, backend=backend)
    ref = quantize_ref(x, fp8_dtype, scale=scale, transpose=True)
    pre = x.float() * scale
    assert_same_fp8(q.data, ref.data, pre, fp8_dtype)
    assert torch.equal(q.data_t.view(torch.uint8), q.data.reshape(-1, 45).t().view(torch.uint8))
    assert q.data_t.shape == (45, 111)
    assert q.amax.item() == x.float().abs().max().item() == 4096.0
    assert amax_out.item() == 4096.0
    assert q.scale_inv.item() == 1.0 / scale.item()
    assert q.data.float().abs().max().item() == fp8.FP8_DTYPES[fp8_dtype]  # saturated, not inf / NaN
    assert not q.nonfinite().item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_current_scaling_and_nonfinite(backend):
    if backend not in _backends():
        pytest.skip(f"backend {backend} unavailable here")
    x = _x((50, 70), scale=0.01)
    q = quantize(x, E4, margin=1, backend=backend)
    amax = x.abs().max()
    scale = (torch.full_like(amax, 448.0) / amax) / 2  # a true division, as scale_from_amax
    assert torch.allclose(q.scale_inv, (1.0 / scale).reshape(1), rtol=0, atol=0)
    assert_same_fp8(q.data, quantize_ref(x, E4, margin=1).data, x * scale, E4)
    assert abs(q.data.float().abs().max().item() - 224.0) <= 16.0
    assert_dequantizes(q if HAS_CUDA else quantize_ref(x, E4, margin=1), x, q.scale_inv)
    y = x.clone()
    y[3, 4] = float("nan")
    bad = quantize(y, E4, backend=backend)
    assert bad.nonfinite().item() and bad.amax.item() == float("inf")
    assert bad.scale_inv.item() == 1.0  # a non-finite amax is never made into a scale
    z = torch.zeros(4, 8, device=DEVICE)
    zq = quantize(z, E5, backend=backend)
    assert zq.scale_inv.item() == 1.0 and not zq.data.float().any() and not zq.nonfinite().item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("granularity,block", [("row", 128), ("block", 32), ("tile", 16)])
def test_group_scales(backend, granularity, block):
    if backend not in _backends():
        pytest.skip(f"backend {backend} unavailable here")
    x = _x((45, 77), scale=2.0, seed=1)
    x[5] *= 1000.0  # one loud row: per-group scales keep the others precise
    x[9] = 0.0  # an all-zero row: scale 1
    xt = x.t()  # non-contiguous input
    q = quantize(xt, E4, granularity=granularity, block=block, backend=backend)
    ref = quantize_ref(xt, E4, granularity=granularity, block=block)
    assert q.scale_inv.shape == ref.scale_inv.shape
    assert q.scale_inv.shape == {"row": (77, 1), "block": (77, 2), "tile": (5, 3)}[granularity]
    assert torch.equal(q.scale_inv, ref.scale_inv)
    group_scale = 1.0 / torch.where(ref.scale_inv > 0, ref.scale_inv, 1.0)
    pre = _pre_cast(xt, group_scale, granularity, block)
    assert_same_fp8(q.data, ref.data, pre, E4)
    assert_dequantizes(q if HAS_CUDA else ref, xt, 1.0 / _pre_cast(torch.ones_like(xt), group_scale, granularity, block))
    assert not q.nonfinite().item()
    y = xt.clone()
    y[2, 3] = float("inf")
    bad = quantize(y, E4, granularity=granularity, block=block, backend=backend)
    assert bad.nonfinite().item()


def _pre_cast(x, group_scale, granularity, block):
    """x * its group's quantizing scale (the value before the fp8 rounding)."""
    x2 = x.float()
    rows, n = x2.shape
    if granularity == "row":
        return x2 * group_scale
    if granularity == "block":
        return x2 * group_scale.repeat_interleave(block, dim=1)[:, :n]
    full = group_scale.repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :n]
    return x2 * full


def test_bad_inputs_name_the_problem():
    x = _x((4, 8))
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        quantize(torch.ones(4, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="fp8_dtype must be"):
        quantize(x, torch.float16)
    with pytest.raises(ValueError, match="granularity must be"):
        quantize(x, granularity="column")
    with pytest.raises(ValueError, match="block must be a power of 2"):
        quantize(x, granularity="block", block=100)
    with pytest.raises(ValueError, match="a given scale is per tensor"):
        quantize(x, scale=torch.ones(1, device=DEVICE), granularity="row")
    with pytest.raises(TypeError, match="scale must be a one-element float32 tensor"):
        quantize(x, scale=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="give the scale too"):
        quantize(x, amax_out=torch.zeros(1, device=DEVICE))
    with pytest.raises(ValueError, match="transpose=True is for per-tensor scaling"):
        quantize(x, granularity="row", transpose=True)
    with pytest.raises(ValueError, match="at least one dimension"):
        quantize(torch.tensor(1.0, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("granularity", ["tensor", "row", "block", "tile"])
def test_gpu_bytes_equal_reference_at_scale(granularity):
    x = _x((4096 + 3, 1024 + 5), torch.bfloat16, scale=10.0, seed=2)
    q = quantize(x, E4, granularity=granularity, backend="triton")
    ref = quantize_ref(x, E4, granularity=granularity)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(q.scale_inv, ref.scale_inv)
    if granularity == "tensor":  # delayed scaling with the transposed copy, ragged tiles on both edges
        scale = torch.tensor([0.37], device=DEVICE)
        q = quantize(x, E4, scale=scale, transpose=True, backend="triton")
        ref = quantize_ref(x, E4, scale=scale, transpose=True)
        assert torch.equal(q.data_t.view(torch.uint8), ref.data_t.view(torch.uint8))
        assert torch.equal(q.amax, ref.amax)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 64), (17, 200), (130, 33), (64, 128), (1, 7), (300, 520)])
def test_gpu_transposed_copy_small_ragged(shape, dtype):
    """The transposed copy of tensors inside one tile or a few (fp8.Linear's weights and gradients), every byte,
    from each source dtype (fp32: master weights)."""
    x = _x(shape, dtype, scale=3.0, seed=11)
    scale = torch.tensor([0.37], device=DEVICE)
    amax = torch.zeros(1, device=DEVICE)
    for fmt in (E4, E5):
        q = quantize(x, fmt, scale=scale, amax_out=amax, transpose=True, backend="triton")
        ref = quantize_ref(x, fmt, scale=scale, transpose=True)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(q.data_t.view(torch.uint8), ref.data_t.view(torch.uint8)), (
            f"{fmt}: {(q.data_t.view(torch.uint8) != ref.data_t.view(torch.uint8)).nonzero()[:8].tolist()}")
        assert torch.equal(q.amax, ref.amax) and torch.equal(amax, ref.amax)


# ---- lowering for Hopper -------------------------------------------------------------------------------------------
def compile_for_sm90() -> list[tuple[str, int]]:
    """(kernel and variant, number of cvt-to-fp8 instructions in its PTX) for each cast kernel compiled for sm_90.
    Needs real (not interpreted) Triton kernels: run with TRITON_INTERPRET=0."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _fp8_triton as kern

    out = []
    common = {"X": "*bf16", "Y": "*fp8e4nv", "YT": "*fp8e4nv", "SCALE": "*fp32", "AMAX": "*fp32",
              "AMAX_OUT": "*fp32", "SCALE_INV": "*fp32"}
    per_tensor = dict(CURRENT=False, ACCUMULATE=True, MARGIN_SCALE=1.0, BLOCK_M=64, BLOCK_N=128)
    variants = [
        (kern._amax_kernel, "amax", dict(BLOCK_M=64, BLOCK_N=128)),
        (kern._cast_kernel, "cast e4m3 +T +amax", dict(per_tensor, FMAX=448.0, E4M3=True, TRANSPOSE=True,
                                                       WRITE_AMAX=True)),
        (kern._cast_kernel, "cast e5m2 current", dict(per_tensor, FMAX=57344.0, E4M3=False, TRANSPOSE=False,
                                                      CURRENT=True, WRITE_AMAX=False, ACCUMULATE=False)),
        (kern._rows_kernel, "rows", dict(FMAX=448.0, E4M3=True, GROUPS_PER_ROW=False, BLOCK_M=32, BLOCK_N=1024)),
        (kern._rows_kernel, "1x128 blocks", dict(FMAX=448.0, E4M3=True, GROUPS_PER_ROW=True, BLOCK_M=32,
                                                 BLOCK_N=128)),
        (kern._tiles_kernel, "128x128 tiles", dict(FMAX=448.0, E4M3=True, BLOCK_M=128, BLOCK_N=128)),
    ]
    for fn, name, constexprs in variants:
        types = dict(common)
        if constexprs.get("E4M3") is False:
            types.update(Y="*fp8e5", YT="*fp8e5")
        signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=8))
        out.append((name, len(re.findall(r"cvt\.rn\.satfinite\.e[45]m[23]x2", compiled.asm["ptx"]))))
    # the GEMM, with the unit K strides the runtime specializes: FP8 wgmma fed by pipelined async copies
    from megakern import _fp8_gemm_triton as gemm_kern

    fn = gemm_kern._fp8_gemm_kernel
    types = {"A": "*fp8e4nv", "B": "*fp8e5", "C": "*bf16", "SA": "*fp32", "SB": "*fp32", "BIAS": "*bf16"}
    for scaling in (gemm_kern.TENSOR, gemm_kern.ROW, gemm_kern.BLOCK, gemm_kern.BLOCK_ROWS):
        constexprs = dict(SCALING=scaling, HAS_BIAS=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8,
                          stride_ak=1, stride_bk=1, stride_cn=1)
        signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
        aligned = {"stride_am", "stride_bn", "stride_cm", "K", *types}  # the 16-divisibility aligned launches get
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=8, num_stages=3)).asm["ptx"]
        out.append((f"gemm scaling {scaling}", int("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2" in ptx
                                                   and "cp.async" in ptx)))
    return out


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the kernels run; this checks their lowering where none is present")
def test_cast_kernels_compile_for_sm90():
    """Every cast kernel lowers for Hopper, the casts onto the hardware's saturating round-to-nearest-even
    conversions."""
    for name, cvts in sm90_lowering("test_fp8", "compile_for_sm90()"):
        if name.startswith("gemm"):
            assert cvts == 1, f"{name}: not an e4m3 x e5m2 wgmma fed by cp.async in the sm_90 PTX"
        elif name != "amax":
            assert cvts > 0, f"{name}: no cvt.rn.satfinite to fp8 in the sm_90 PTX"


# ---- GEMM -----------------------------------------------------------------------------------------------------------
# The FP8 products' error against fp32 matmuls of the dequantized operands, relative to the output's largest value:
# on CPU the emulation is that matmul (rounding only); Hopper's FP8 tensor cores add their products in a narrower
# accumulator than fp32 (measured up to 5e-5 on the H200 at K = 72).
_FP8_ACC = 1e-5 if DEVICE.type == "cpu" else 1e-3


def _gemm_operands(granularity, m=48, n=32, k=64, seed=3):
    a = _x((m, k), scale=2.0, seed=seed)
    b = _x((n, k), scale=0.05, seed=seed + 1)
    both_blocks = granularity == "block_rows"  # a and b per 1 x B block (block scaling's weight gradient)
    granularity = "block" if both_blocks else granularity
    kw = dict(granularity=granularity, block=32) if granularity != "tensor" else {}
    qa = quantize_ref(a, E4, **kw)
    qb = quantize_ref(b, E4, **{**kw, "granularity": "tile"} if granularity == "block" and not both_blocks else kw)
    return a, b, qa, qb


@pytest.mark.parametrize("granularity", ["tensor", "row", "block", "block_rows"])
def test_gemm_reference_matches_dequantized_matmul(granularity):
    a, b, qa, qb = _gemm_operands(granularity)
    bias = _x((32,), seed=9)
    out = fp8.gemm(qa, qb, out_dtype=torch.float32, bias=bias, backend="torch")
    want = qa.dequantize() @ qb.dequantize().t() + bias
    assert torch.equal(out, want)
    # and close to the high-precision product (FP8's error)
    exact = a @ b.t() + bias
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 0.06


@pytest.mark.parametrize("granularity", ["tensor", "row", "block", "block_rows"])
def test_gemm_triton_matches_reference(granularity):
    if "triton" not in _backends():
        pytest.skip("triton unavailable here")
    a, b, qa, qb = _gemm_operands(granularity, m=37, n=40, k=72)  # ragged M, N and K tiles
    bias = _x((40,), seed=9)
    got = fp8.gemm(qa, qb, out_dtype=torch.float32, bias=bias, backend="triton")
    want = fp8.gemm(qa, qb, out_dtype=torch.float32, bias=bias, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=_FP8_ACC * want.abs().max().item())
    if granularity == "tensor":
        with pytest.raises(ValueError, match="the operands' scales must be"):
            fp8.gemm(qa, quantize_ref(b, E4, granularity="row"), backend="triton")


def test_gemm_bad_inputs():
    _, _, qa, qb = _gemm_operands("tensor")
    with pytest.raises(TypeError, match="a must be a Quantized"):
        fp8.gemm(torch.ones(2, 2), qb)
    with pytest.raises(ValueError, match="K differs"):
        fp8.gemm(qa, quantize_ref(_x((32, 48)), E4))
    with pytest.raises(TypeError, match="both operands are E5M2"):
        fp8.gemm(quantize_ref(_x((4, 64)), E5), quantize_ref(_x((32, 64)), E5))
    with pytest.raises(ValueError, match="bias must be"):
        fp8.gemm(qa, qb, bias=torch.ones(5, device=DEVICE))
    with pytest.raises(ValueError, match="unknown backend 'cublas'"):
        fp8.gemm(qa, qb, backend="cublas")
    with pytest.raises(TypeError, match="out_dtype must be"):
        fp8.gemm(qa, qb, out_dtype=torch.int32)
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="backend 'scaled_mm' is not available: FP8 GEMMs need a CUDA device"):
            fp8.gemm(qa, qb, backend="scaled_mm")
        assert fp8._gemm_backend(qa, None) == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_gemm_scaled_mm_matches_reference(granularity):
    if fp8.scaled_mm_problem(DEVICE):
        pytest.skip(fp8.scaled_mm_problem(DEVICE))
    _, _, qa, qb = _gemm_operands(granularity, m=200, n=96, k=256)
    bias = _x((96,), torch.bfloat16, seed=9)
    got = fp8.gemm(qa, qb, bias=bias, backend="scaled_mm")
    want = fp8.gemm(qa, qb, bias=bias.float(), out_dtype=torch.float32, backend="torch")
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    with pytest.raises(ValueError, match="K and N multiples of 16"):
        fp8.gemm(*_gemm_operands(granularity, n=40, k=72)[2:], backend="scaled_mm")


# ---- FP8 Linear ------------------------------------------------------------------------------------------------
def _linear_pair(recipe, seed=5, bias=True):
    torch.manual_seed(seed)
    ref = torch.nn.Linear(64, 48, bias=bias).to(DEVICE)
    lin = fp8.Linear(64, 48, bias=bias, recipe=recipe, emulate=True, device=DEVICE)
    lin.weight, lin.bias = torch.nn.Parameter(ref.weight.detach().clone()), (
        torch.nn.Parameter(ref.bias.detach().clone()) if bias else None)
    return ref, lin


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling(), BlockScaling(block=32)],
                         ids=["delayed", "current", "block"])
def test_linear_forward_backward_within_fp8_error(recipe):
    ref, lin = _linear_pair(recipe)
    x = _x((3, 17, 64), seed=6).requires_grad_()
    dy = _x((3, 17, 48), scale=0.01, seed=7)
    if isinstance(recipe, DelayedScaling):  # scales that fit this data, as after a few steps
        for role, t in (("x", x), ("w", lin.weight), ("grad", dy)):
            lin.scaling_state(role).update(t.detach().abs().max())
    y = lin(x)
    want = ref(x)
    assert y.shape == want.shape and _rel(y, want) < 0.06
    dx, dw, db = torch.autograd.grad(y, (x, lin.weight, lin.bias), dy)
    rx, rw, rb = torch.autograd.grad(want, (x, ref.weight, ref.bias), dy)
    assert _rel(dx, rx) < 0.08 and _rel(dw, rw) < 0.08
    torch.testing.assert_close(db, rb)  # the bias gradient is a plain sum, not FP8


def test_linear_forward_is_the_fp8_product():
    _, lin = _linear_pair(DelayedScaling(fp8_format="E4M3"), bias=False)
    x = _x((5, 64), seed=8)
    y = lin(x)
    qx = quantize_ref(x, E4, scale=lin.x_scaling.scale)
    qw = quantize_ref(lin.weight.detach(), E4, scale=lin.w_scaling.scale)
    want = qx.dequantize() @ qw.dequantize().t()
    torch.testing.assert_close(y, want, rtol=0, atol=_FP8_ACC * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none here)")
def test_gpu_linear_sizes():
    lin = fp8.Linear(24, 48, device=DEVICE)
    with pytest.raises(ValueError, match="need in_features and out_features multiples of 16, got 24 -> 48"):
        lin(_x((4, 24)))
    # block scales take any size; 5 tokens are padded to 16 for the weight-gradient GEMM and sliced back
    ref, lin = torch.nn.Linear(24, 40).to(DEVICE), fp8.Linear(24, 40, recipe=BlockScaling(block=32), device=DEVICE)
    lin.weight, lin.bias = ref.weight, ref.bias
    x = _x((5, 24), seed=4).requires_grad_()
    y = lin(x)
    assert y.shape == (5, 40) and _rel(y, ref(x)) < 0.06
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    (rx,) = torch.autograd.grad(ref(x), x, torch.ones_like(y))
    assert dx.shape == x.shape and _rel(dx, rx) < 0.08


def test_linear_delayed_scaling_steps_weight_cache_and_checkpoint():
    _, lin = _linear_pair(DelayedScaling(amax_history_len=4))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x1, x2 = _x((8, 64), scale=2.0, seed=10), _x((8, 64), scale=5.0, seed=11)
    for x in (x1, x2):  # two micro-batches of one step share the weight's FP8 copy
        lin(x.requires_grad_()).square().mean().backward()
    cached = lin._w_cache
    lin(x1)
    assert lin._w_cache is cached
    assert lin.x_amax_pending.item() == max(x1.abs().max().item(), x2.abs().max().item())
    assert lin.grad_amax_pending.item() > 0 and lin.w_amax_pending.item() == lin.weight.abs().max().item()
    assert not fp8.update_scales(lin).item()
    hist_max = lin.x_scaling.amax_history.max().reshape(1)
    assert torch.equal(lin.x_scaling.scale, torch.full_like(hist_max, 448.0) / hist_max)
    assert lin.x_amax_pending.item() == 0.0
    opt.step()  # the weight changes: a new FP8 copy on the next forward
    lin(x1)
    assert lin._w_cache is not cached
    sd = lin.state_dict()
    assert {"x_scaling.amax_history", "w_scaling.scale", "grad_scaling.nonfinite_steps"} <= set(sd)
    other = fp8.Linear(64, 48, recipe=DelayedScaling(amax_history_len=4), emulate=True, device=DEVICE)
    other.load_state_dict(sd)
    assert torch.equal(other.grad_scaling.scale, lin.grad_scaling.scale)


def test_linear_nonfinite_amax_signals_a_skip():
    _, lin = _linear_pair(DelayedScaling())
    scales = [lin.scaling_state(r).scale.clone() for r in ("x", "w", "grad")]
    x = _x((4, 64), seed=12)
    x[1, 2] = float("nan")
    lin(x)
    assert fp8.update_scales(lin).item()
    assert lin.x_scaling.nonfinite_steps.item() == 1 and lin.w_scaling.nonfinite_steps.item() == 0
    assert all(torch.equal(s, lin.scaling_state(r).scale) for s, r in zip(scales, ("x", "w", "grad")))


def test_linear_without_fp8_falls_back_with_a_message():
    if HAS_CUDA and not fp8.scaled_mm_problem(DEVICE):
        pytest.skip("this GPU runs FP8 GEMMs")
    torch.manual_seed(0)
    lin = fp8.Linear(16, 8, device=DEVICE)
    x = _x((2, 16))
    with pytest.warns(UserWarning, match="computing a plain linear instead"):
        y = lin(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    with pytest.raises(ValueError, match="x has 15 features, the layer takes 16"):
        lin(_x((2, 15)))
    with pytest.raises(TypeError, match="recipe must be"):
        fp8.Linear(4, 4, recipe="delayed")


def test_convert_linears_keeps_parameters_and_skips():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)))
    w = model[2][0].weight
    fp8.convert_linears(model, emulate=True, skip={"2.1"})
    assert isinstance(model[0], fp8.Linear) and isinstance(model[2][0], fp8.Linear)
    assert type(model[2][1]) is torch.nn.Linear and model[2][0].weight is w
    assert model(torch.randn(3, 8)).shape == (3, 4)


# ---- training ------------------------------------------------------------------------------------------------
def _train_char_mlp(text: str, use_fp8: bool, steps: int, batch: int, hidden: int, device, dtype, seed=0):
    """Next-character MLP on ``text`` (8 characters of context, two hidden layers, a high-precision head): the
    mean loss of the last tenth of the steps. fp8: the hidden layers are fp8.Linear (delayed scaling), with
    update_scales once per step and the step skipped on a non-finite amax."""
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], device=device)
    ctx, emb = 8, 32
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(len(vocab), emb), torch.nn.Flatten(),
        torch.nn.Linear(ctx * emb, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, len(vocab))).to(device=device, dtype=dtype)
    if use_fp8:
        fp8.convert_linears(model, emulate=device.type != "cuda", skip={"6"})
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    losses, skipped = [], 0
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - ctx - 1, (batch,), generator=gen).to(device)
        window = starts[:, None] + torch.arange(ctx + 1, device=device)
        x, y = ids[window[:, :ctx]], ids[window[:, ctx]]
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        if use_fp8 and fp8.update_scales(model).item():
            skipped += 1
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert skipped == 0, f"{skipped} steps skipped for non-finite amaxes"
    tail = losses[-max(1, steps // 10):]
    return sum(tail) / len(tail), losses[0]


def test_training_loss_tracks_the_high_precision_run():
    """A small next-character model on tinyshakespeare trains with FP8 hidden layers to within 2% of the same model
    in high precision (bf16 on a GPU, a few hundred steps; fp32 with emulated FP8 on CPU, fewer steps)."""
    text = (shared_data("tinyshakespeare.txt") / "tinyshakespeare.txt").read_text()[:200_000]
    if HAS_CUDA:
        kw = dict(steps=400, batch=512, hidden=512, device=DEVICE, dtype=torch.bfloat16)
    else:
        kw = dict(steps=60, batch=64, hidden=64, device=DEVICE, dtype=torch.float32)
    ref, first = _train_char_mlp(text, False, **kw)
    got, _ = _train_char_mlp(text, True, **kw)
    assert ref < 0.8 * first, f"the model did not learn ({first:.3f} -> {ref:.3f})"
    assert abs(got - ref) / ref < 0.02, f"FP8 loss {got:.4f} vs high precision {ref:.4f}"


# ---- the CUDA C++ cast ---------------------------------------------------------------------------------------------
def test_cuda_backend_is_per_tensor_only():
    x = _x((4, 32))
    if "cuda" in fp8._backend.available_backends(DEVICE) and not fp8._backend.available_backends(DEVICE)["cuda"]:
        with pytest.raises(ValueError, match="backend 'cuda' casts per tensor without the transposed copy"):
            quantize(x, granularity="row", backend="cuda")
    else:
        with pytest.raises(RuntimeError, match="backend 'cuda' is not available"):
            quantize(x, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(257, 1000), (3, 5, 7)], ids=["vectorized", "ragged"])
def test_cuda_cast_bytes_and_amax(fp8_dtype, dtype, shape):
    from megakern import _fp8_cuda

    if _fp8_cuda.problem():
        pytest.skip(_fp8_cuda.problem())
    x = _x(shape, dtype, scale=30.0, seed=4)
    x.view(-1)[3] = 4096.0  # saturates
    x.view(-1)[-1] = -float("inf")
    scale = torch.tensor([0.5 if fp8_dtype == E4 else 16.0], device=DEVICE)
    amax_out = torch.zeros(1, device=DEVICE)
    q = quantize(x, fp8_dtype, scale=scale, amax_out=amax_out, backend="cuda")
    ref = quantize_ref(x, fp8_dtype, scale=scale)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert q.amax.item() == amax_out.item() == float("inf") and q.nonfinite().item()
    cur = quantize(x[..., :-1], fp8_dtype, backend="cuda")  # current scaling on a strided view
    want = quantize_ref(x[..., :-1], fp8_dtype)
    assert torch.equal(cur.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(cur.scale_inv, want.scale_inv)


def test_linear_under_autocast_and_torch_compile():
    """Under autocast the output takes the autocast dtype; under torch.compile the layer gives eager's values and
    gradients (its FP8 product runs between traced graphs)."""
    _, lin = _linear_pair(CurrentScaling())
    x = _x((8, 64), seed=13).requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
    eager = torch.autograd.grad(lin(x).square().sum(), (x, lin.weight))
    torch.compiler.reset()
    compiled = torch.autograd.grad(torch.compile(lambda t: lin(t).square().sum())(x), (x, lin.weight))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
