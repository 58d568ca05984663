"""megakern.gemm_scatter (the Triton GEMM + reduce-scatter of parallel.overlap's symmetric-memory path) in one
process: n ranks simulated by n buffers on one device, whose addresses stand in for the symmetric memory's mapped
peers. Every rank's launch 1 runs, then every rank's launch 2; each rank's output against the fp64 sum of all ranks'
products (2x rule: plain torch, each rank's product rounded to the dtype and summed in it, as a reduce-scatter
does). Odd sizes (chunks of 3 and 5 rows, K 33, N 17), 2 to 4 ranks, sequence first / second / in the middle
(P, S, Q), w as stored and transposed, non-contiguous x, slots poisoned with NaN (a tile never written shows). On a
CPU under the interpreter in fp32 and fp16; bf16, TMA and larger shapes on a GPU. The multi-GPU path is in
tests/parallel/test_overlap_gpu.py.
"""
from __future__ import annotations

import pytest
import torch
from conftest import ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, require_triton, seed

from megakern import gemm_scatter

DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())
# (P, S, Q, K, N, ranks): x (P, S, Q, K), the sequence S split among the ranks
CASES = {
    "seq-second": (2, 6, 1, 20, 24, 2),
    "seq-first": (1, 9, 2, 16, 10, 3),
    "seq-middle-odd": (3, 20, 1, 33, 17, 4),
}
GPU_CASES = {
    "gpt-row": (2, 512, 1, 1024, 768, 2),
    "tp4-odd": (1, 4 * 150, 3, 520, 1000, 4),
    "narrow": (4, 96, 1, 40, 24, 2),  # 80-byte rows: TMA cannot take them, pointer loads
}


def _simulate(xs, ws, n, w_layout):
    """Every rank's output, computed by the two launches over n simulated buffers."""
    p, _, length, _ = xs[0].shape
    cols = ws[0].shape[0]
    bufs = [torch.full((n, p * length, cols), float("nan"), dtype=xs[0].dtype, device=DEVICE) for _ in range(n)]
    addresses = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEVICE)
    if w_layout == "transposed":  # (N, K) read through a (K, N) storage
        ws = [w.t().contiguous().t() for w in ws]
    for r in range(n):
        gemm_scatter.scatter_partials(xs[r], ws[r], addresses, r)
    outs = [gemm_scatter.reduce_own(xs[r], ws[r], addresses, r) for r in range(n)]
    return outs


def _operands(case, dtype, layout):
    p, s, q, k, cols, n = case
    xs, ws = [], []
    for _ in range(n):
        if layout == "strided":  # a unit inner stride, rows further apart than K
            x = torch.randn(p, s, q, k + 8, device=DEVICE).to(dtype)[..., 3:3 + k]
        else:
            x = torch.randn(p, s, q, k, device=DEVICE).to(dtype)
        xs.append(x.unflatten(1, (n, s // n)).flatten(2, 3))  # (P, n, L, K), a view
        ws.append((torch.randn(cols, k, device=DEVICE) / k ** 0.5).to(dtype))
    return xs, ws


def _check(name, case, dtype, layout, w_layout):
    xs, ws = _operands(case, dtype, layout)
    n = case[-1]
    outs = _simulate(xs, ws, n, w_layout)
    truth = gemm_scatter.gemm_reduce_scatter_ref(xs, ws)
    lowp = sum((x.transpose(0, 1).float() @ w.float().t()).to(dtype) for x, w in zip(xs, ws))  # (n, P, L, N)
    for r in range(n):
        assert_close_to_ref(f"{name} rank {r}", outs[r], truth[r], lowp[r].reshape(-1, lowp.shape[-1]), ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_layout", ["stored", "transposed"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("name", list(CASES))
def test_gemm_reduce_scatter_matches_fp64(name, layout, w_layout, dtype):
    require_triton()
    seed("gemm_scatter", name, layout, w_layout, dtype)
    _check(name, CASES[name], dtype, layout, w_layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("w_layout", ["stored", "transposed"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gemm_reduce_scatter_gpu_shapes(name, w_layout, dtype):
    require_triton()
    seed("gemm_scatter gpu", name, w_layout, dtype)
    _check(name, GPU_CASES[name], dtype, "contiguous", w_layout)


def test_refusals():
    x = torch.randn(1, 2, 3, 4, device=DEVICE)
    w = torch.randn(5, 4, device=DEVICE)
    addresses = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be 4-D \(P, n, L, K\); got shape \(2, 3, 4\)"):
        gemm_scatter.scatter_partials(x[0], w, addresses, 0)
    with pytest.raises(ValueError, match=r"w must be \(N, K\) with K = 4"):
        gemm_scatter.scatter_partials(x, w.t(), addresses, 0)
    with pytest.raises(ValueError, match="share one of"):
        gemm_scatter.scatter_partials(x, w.double(), addresses, 0)
    with pytest.raises(ValueError, match=r"addresses must be \(2,\) int64"):
        gemm_scatter.scatter_partials(x, w, addresses[:1], 0)
    with pytest.raises(ValueError, match=r"rank 2 is not in 0..1"):
        gemm_scatter.reduce_own(x, w, addresses, 2)
    with pytest.raises(ValueError, match=r"out must be contiguous \(3, 5\)"):
        gemm_scatter.reduce_own(x, w, addresses, 0, out=torch.empty(5, 3, device=DEVICE))


def compile_for_sm90() -> list:
    """(launch, shared memory bytes, uses wgmma, moves tiles by TMA, element-wise 16-bit global loads and stores) for
    both launches at the bf16 tile, w as stored and transposed, and with sizes and rank of 1 as constants, compiled
    for sm_90 (TRITON_INTERPRET=0), the sizes and strides divisible by 16 as the launcher specializes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _gemm_scatter_triton as gs

    cfg = gs.default_config(torch.bfloat16, torch.device("cuda"))
    results = []
    for reduce, w_kn, ones in ((False, False, False), (False, True, False), (True, False, False),
                               (True, True, False), (True, False, True)):
        constexprs = dict(REDUCE=reduce, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          GROUP_M=cfg.group_m, STAGES=cfg.stages, TMA=True, W_KN=w_kn, UPCAST=False,
                          PRECISION="tf32")
        if ones:  # sizes and rank of 1 as a specializing launcher would pass them, made constants
            constexprs.update(P=1, RANK=1, CHUNKS=1)
        pointers = {"X": "*bf16", "W": "*bf16", "DEST_PTRS": "*i64", "OUT": "*bf16"}
        names = gs._gemm_scatter_kernel.arg_names
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in names}
        divisible = [*pointers, "L", "N", "K", "stride_xp", "stride_xc", "stride_xl", "stride_wn"]
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible if a not in constexprs}
        compiled = triton.compile(ASTSource(fn=gs._gemm_scatter_kernel, signature=signature,
                                            constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 64),
                                  options=dict(num_warps=cfg.warps, num_stages=cfg.stages))
        ptx = compiled.asm["ptx"]
        results.append((f"{'reduce' if reduce else 'scatter'}{' w^T' if w_kn else ''}{' ones' if ones else ''}",
                        compiled.metadata.shared, "wgmma" in ptx, "cp.async.bulk.tensor" in ptx,
                        ptx.count("st.global.b16") + ptx.count("ld.global.b16")))
    return results


def test_kernel_compiles_for_sm90():
    """Both launches lower for Hopper onto wgmma with TMA loads, within shared memory."""
    from conftest import sm90_lowering

    results = sm90_lowering("test_gemm_scatter", "compile_for_sm90()")
    assert [name for name, *_ in results] == ["scatter", "scatter w^T", "reduce", "reduce w^T", "reduce ones"]
    for name, shared, wgmma, tma, scalar in results:
        assert shared <= 227 * 1024, f"{name}: {shared} bytes of shared memory"
        assert wgmma and tma, f"{name}: wgmma {wgmma}, TMA {tma} in the sm_90 PTX"
        # the tiles' stores to the peers and the loads of their partial sums through the table's addresses move in
        # 16-byte vectors, not element by element
        assert scalar == 0, f"{name}: {scalar} element-wise 16-bit global loads and stores"
