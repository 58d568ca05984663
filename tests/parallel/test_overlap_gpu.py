"""The fused GEMM + collective ops of parallel.overlap through symmetric memory (NCCL ranks, one GPU each), against
the fp64 truth with the 2x rule next to the unfused pair (layers.linear_reduce; gather_from_sp then the matmul):
output, dX, dW and the bias gradient of GEMM + reduce-scatter and of all-gather + GEMM (each with a bias), at tp 2
and 4, fp32 and bf16, the sequence first or second, shards of odd length, calls repeated with growing shapes (both
buffers of each role used, grown), and the ops captured in a CUDA graph and replayed on new inputs; GEMM +
reduce-scatter by both of the workspace's implementations (the Triton kernel storing tiles into the owners' buffers,
and cuBLAS + copy-engine pulls, its blocks whole or in 3 or 4 runs of rows: 37-row shards cut unequally; or by the
peers' inputs and weights pushed, forced, and where the "auto" route takes it); the kept all-gathers pushed (the
default) and pulled; the joins at each op's end and deferred to end_step's flush; ranks signalling each other by
stream memory operations (the default) and by torch's signal kernels."""
import pytest
import torch
from conftest import HAS_CUDA
from rankpool import free_port, spawn

pytestmark = pytest.mark.gpu
DEVICES = torch.cuda.device_count() if HAS_CUDA else 0
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _setup(rank, world, port, rs_impl="kernel"):
    import os

    os.environ.update(ENV)
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    from megakern.parallel.symmetric import SymmetricWorkspace

    from megakern.parallel.symmetric import GATHERS, SIGNALS

    ws = SymmetricWorkspace(dist.group.WORLD, torch.device("cuda", rank))
    # options after ":", comma-separated: a signal method ("copy:kernel": torch's signal kernels instead of stream
    # signals), a gather ("pull": the kept all-gathers pulled, not pushed), "defer" (the joins deferred to end_step's
    # flush)
    rs_impl, _, options = rs_impl.partition(":")
    options = [o for o in options.split(",") if o]
    for option in options:
        if option in SIGNALS:
            ws.signals = option
        elif option in GATHERS:
            ws.gather = option
        elif option == "defer":
            ws.defer_joins = True
        else:
            raise ValueError(option)
    if not set(options) & set(SIGNALS):  # the default where the driver has stream writes (every CUDA machine here)
        from megakern.parallel import stream_memops

        assert ws.signals == "stream", f"signals {ws.signals!r}: {stream_memops.unavailable()}"
    impl, _, pieces = rs_impl.partition("-p")  # "copy-p3": cuBLAS + pulls, each block in 3 runs of rows
    if impl == "inputs":  # cuBLAS + pulls of the peers' inputs and weights, every GEMM + reduce-scatter
        impl, ws.rs_route = "copy", "inputs"
    ws.rs_impl = impl
    if pieces:
        ws.rs_pieces = int(pieces)
    return dist.group.WORLD, ws


def _global(shape, seed, dtype=torch.float64):
    g = torch.Generator(device="cuda").manual_seed(seed)  # the same tensor on every rank
    return torch.randn(shape, device="cuda", generator=g, dtype=torch.float64).to(dtype)


def _err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _row_case(group, ws, n, r, dtype, seq_dim, B, T, K, N, seed):
    """GEMM + reduce-scatter of the row-parallel layer: errors (fused, unfused) of y, dx, dw against fp64."""
    from megakern.parallel.layers import linear_reduce
    from megakern.parallel.mappings import token_shard
    from megakern.parallel.overlap import gemm_reduce_scatter

    shape = [B, T, K * n] if seq_dim == 1 else [T, B, K * n]
    X, W = _global(shape, seed), _global([N, K * n], seed + 1) / (K * n) ** 0.5
    bias = _global([N], seed + 3)
    x64, w64 = X[..., r * K:(r + 1) * K], W[:, r * K:(r + 1) * K]
    out_shape = list(shape[:-1]) + [N]
    dY = _global(out_shape, seed + 2)
    y_true = token_shard(X @ W.t() + bias, n, r, seq_dim)
    dx_true = dY @ w64  # the gathered gradient times this rank's weight columns
    dw_true = dY.reshape(-1, N).t() @ x64.reshape(-1, K)
    dy_shard = token_shard(dY, n, r, seq_dim)
    db_true = dy_shard.reshape(-1, N).sum(0)  # this rank's rows: the bias gradient's partial sum
    errs = []
    for fused in (True, False):
        x = x64.to(dtype).requires_grad_()
        w = w64.to(dtype).requires_grad_()
        b = bias.to(dtype).requires_grad_()
        y = (gemm_reduce_scatter(x, w, group, True, seq_dim, workspace=ws, bias=b) if fused
             else linear_reduce(x, w, group, True, seq_dim, bias=b))
        y.backward(dy_shard.to(dtype))
        assert y.dtype == dtype and tuple(y.shape) == tuple(y_true.shape), (y.dtype, y.shape)
        errs.append((_err(y, y_true), _err(x.grad, dx_true), _err(w.grad, dw_true), _err(b.grad, db_true)))
    return errs


def _column_case(group, ws, n, r, dtype, seq_dim, B, T, K, N, seed):
    """All-gather + GEMM of the column-parallel layer: errors (fused, unfused) of y, dx, dw against fp64."""
    import torch.nn.functional as F

    from megakern.parallel.mappings import gather_from_sp, token_shard
    from megakern.parallel.overlap import all_gather_gemm

    shape = [B, T, K] if seq_dim == 1 else [T, B, K]
    X, W = _global(shape, seed), _global([N * n, K], seed + 1) / K ** 0.5
    bias = _global([N], seed + 3 + r)  # this rank's columns' bias
    x64, w64 = token_shard(X, n, r, seq_dim), W[r * N:(r + 1) * N]
    dY = _global(list(shape[:-1]) + [N * n], seed + 2)
    dy64 = dY[..., r * N:(r + 1) * N]
    y_true = X @ w64.t() + bias
    db_true = dy64.reshape(-1, N).sum(0)
    dx_true = token_shard(dY @ W, n, r, seq_dim)
    dw_true = dy64.reshape(-1, N).t() @ X.reshape(-1, K)
    errs = []
    for fused in (True, False):
        x = x64.to(dtype).contiguous().requires_grad_()
        w = w64.to(dtype).requires_grad_()
        b = bias.to(dtype).requires_grad_()
        y = (all_gather_gemm(x, w, group, seq_dim, workspace=ws, bias=b) if fused
             else F.linear(gather_from_sp(x, group, seq_dim), w, b))
        y.backward(dy64.to(dtype))
        assert y.dtype == dtype and tuple(y.shape) == tuple(y_true.shape), (y.dtype, y.shape)
        errs.append((_err(y, y_true), _err(x.grad, dx_true), _err(w.grad, dw_true), _err(b.grad, db_true)))
    return errs


CASES = [  # dtype, seq_dim, B, T (a multiple of n; T / n odd where possible), K, N
    ("float32", 1, 3, 0, 96, 80), ("bfloat16", 1, 2, 0, 256, 192), ("bfloat16", 0, 3, 0, 128, 64),
    ("float32", 0, 1, 0, 64, 48), ("bfloat16", 0, 2, 0, 16, 160), ("bfloat16", 1, 4, 1, 512, 384),
]  # (K 16, N 160: the row op's "auto" route pulls the inputs)


def _ops_check(rank, world, port, rs_impl):
    torch.backends.cuda.matmul.allow_tf32 = False
    group, ws = _setup(rank, world, port, rs_impl)
    n, r = world, rank
    out = []
    for i, (dtype, seq_dim, B, big, K, N) in enumerate(CASES):
        T = n * (37 if not big else 129)  # shards of odd length; the last case grows every buffer
        for case in (_row_case, _column_case):
            errs = case(group, ws, n, r, getattr(torch, dtype), seq_dim, B, T, K, N, 100 * i)
            out.append((case.__name__, dtype, seq_dim, errs))
    out.append(("grown", ws.grown))
    import torch.distributed as dist

    dist.destroy_process_group()
    return out


def _graph_check(rank, world, port, rs_impl):
    """Row + column ops forward and backward captured once, replayed on new inputs: equal to eager calls."""
    from megakern.parallel.overlap import all_gather_gemm, gemm_reduce_scatter

    group, ws = _setup(rank, world, port, rs_impl)
    B, L, K, N = 2, 33, 128, 96
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    x = torch.randn(B, L, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w_col = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16).requires_grad_()
    w_row = (torch.randn(K, N, device="cuda", generator=g) / N ** 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(B, L, K, device="cuda", generator=g, dtype=torch.bfloat16)

    def step(inp):
        xi = inp.detach().requires_grad_()
        h = all_gather_gemm(xi, w_col, group, 1, workspace=ws)  # (B, n L, N)
        y = gemm_reduce_scatter(h, w_row, group, True, 1, workspace=ws)  # (B, L, K)
        y.backward(dy)
        ws.end_step()
        return y.detach(), xi.grad, w_col.grad, w_row.grad

    def fresh():
        w_col.grad = w_row.grad = None
        return step(x)

    x0 = x.clone()
    eager = [t.clone() for t in fresh()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fresh()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    w_col.grad = w_row.grad = None
    with torch.cuda.graph(graph):
        static = step(x)
    diffs = []
    for i in range(3):
        x.copy_(torch.randn(B, L, K, device="cuda", generator=g, dtype=torch.bfloat16))
        w_col.grad.zero_()
        w_row.grad.zero_()
        graph.replay()
        replayed = [t.clone() for t in static]
        want = [t.clone() for t in fresh()]
        diffs.append(max((a.float() - b.float()).abs().max().item() for a, b in zip(replayed, want)))
    x.copy_(x0)  # eager again on the first input, after the graph: the same as before it
    diffs.append(max((a.float() - b.float()).abs().max().item() for a, b in zip(eager, fresh())))
    import torch.distributed as dist

    dist.destroy_process_group()
    return diffs


def _worlds():
    return [w for w in (2, 4) if w <= DEVICES]


@pytest.mark.skipif(DEVICES < 2, reason=f"needs 2 CUDA devices, this machine has {DEVICES}")
@pytest.mark.parametrize("rs_impl", ["kernel", "copy", "copy-p1", "copy-p3", "inputs", "inputs-p3", "copy-p3:kernel",
                                     "inputs:kernel", "copy-p1:pull", "copy:pull,defer", "copy-p3:pull,kernel",
                                     "copy-p3:defer,kernel", "inputs:defer"])
@pytest.mark.parametrize("world", [2, 4])
def test_fused_ops_match_fp64(world, rs_impl):
    if world > DEVICES:
        pytest.skip(f"tp {world} needs {world} CUDA devices, this machine has {DEVICES}")
    results = spawn(_ops_check, list(range(world)), world, free_port(), rs_impl, timeout=600)
    for rank, out in results.items():
        *cases, (_, grown) = out
        assert grown >= 4, f"rank {rank}: {grown} allocations (both buffers of both roles, and the growth)"
        for name, dtype, seq_dim, ((fy, fdx, fdw, fdb), (uy, udx, udw, udb)) in cases:
            floor = 1e-6 if dtype == "float32" else 2e-3
            for what, f, u in (("y", fy, uy), ("dx", fdx, udx), ("dw", fdw, udw), ("db", fdb, udb)):
                assert f <= 2 * u + floor, (f"rank {rank} {name} {dtype} seq_dim {seq_dim} {what}: fused error {f:.3g}"
                                            f" vs unfused {u:.3g}")


@pytest.mark.skipif(DEVICES < 2, reason=f"needs 2 CUDA devices, this machine has {DEVICES}")
@pytest.mark.parametrize("rs_impl", ["kernel", "copy", "inputs", "copy:kernel", "copy:pull", "copy:defer",
                                     "inputs:pull,defer"])
def test_fused_ops_in_a_cuda_graph(rs_impl):
    results = spawn(_graph_check, [0, 1], 2, free_port(), rs_impl, timeout=600)
    for rank, diffs in results.items():
        assert max(diffs) <= 1e-2, f"rank {rank}: replay vs eager {diffs}"
