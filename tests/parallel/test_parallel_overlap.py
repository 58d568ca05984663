"""parallel.overlap on spawned gloo ranks: gemm_reduce_scatter's ring (the sequence-parallel GEMM + reduce-scatter,
transfers hidden behind the chunks' matmuls) against layers.linear_reduce (the matmul, then the reduce-scatter):
output and both gradients, fp64 and bf16 autocast, the sequence first or second, odd sizes; all_gather_gemm's
unfused path; bad input. The symmetric-memory path: test_overlap_gpu.py."""
import pytest
import torch
import torch.distributed as dist
from rankpool import pool

from megakern.parallel.mappings import token_shard


def check_against_linear_reduce(n, seq_dim, autocast):
    from megakern.parallel.layers import linear_reduce
    from megakern.parallel.overlap import gemm_reduce_scatter

    g, r = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(1234 + r)  # each rank its own feature shard of x and of the weight
    dtype = torch.float32 if autocast else torch.float64
    shape = [3, 5 * n, 7] if seq_dim == 1 else [3 * n, 5, 7]  # (B, T, K) or (T, B, K); K the local features
    x0 = torch.randn(shape, dtype=dtype)
    w0 = torch.randn(11, 7, dtype=dtype)
    torch.manual_seed(99)
    b0 = torch.randn(11, dtype=dtype)  # the bias: whole, the same on every rank
    out_shape = list(shape[:-1]) + [11]
    out_shape[seq_dim] //= n
    dy = torch.randn(out_shape, dtype=dtype)  # the same downstream gradient on every rank's shard
    from megakern.parallel import overlap

    exchanges = []
    original = overlap._exchange

    def counted(*args):
        exchanges.append(args[0] is not None)
        return original(*args)

    overlap._exchange = counted
    results = []
    for fn in (linear_reduce, gemm_reduce_scatter):
        x, w, b = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(x, w, g, True, seq_dim, bias=b)
        y.backward(dy.to(y.dtype))
        results.append((y.detach().double(), x.grad.double(), w.grad.double(), b.grad.double(), y.dtype,
                        w.grad.dtype, b.grad.dtype))
    overlap._exchange = original
    # the ring ran: n - 1 transfers in the forward, n - 1 in the backward
    assert exchanges.count(True) == 2 * (n - 1), exchanges
    (y_ref, dx_ref, dw_ref, db_ref, *types_ref), (y, dx, dw, db, *types) = results
    assert types == types_ref, (types, types_ref)
    # the bias: added once (the output's dtype, as F.linear), its gradient this rank's rows' sum (partial over tp)
    torch.testing.assert_close(db, dy.double().reshape(-1, 11).sum(0),
                               **(dict(rtol=2e-2, atol=2e-1) if autocast else dict(rtol=1e-12, atol=1e-12)))
    assert y.shape == y_ref.shape and tuple(y.shape) == tuple(out_shape)
    tol = dict(rtol=2e-2, atol=2e-1) if autocast else dict(rtol=1e-12, atol=1e-12)
    for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref), ("db", db, db_ref)):
        torch.testing.assert_close(got, want, msg=f"{name} (rank {r})", **tol)
    if not autocast:  # the reduction is real: the output is not this rank's partial product
        assert not torch.allclose(y, token_shard(torch.nn.functional.linear(x0, w0, b0), n, r, seq_dim).double())
    return True


@pytest.mark.parametrize("n,seq_dim,autocast", [(2, 1, False), (3, 0, False), (4, 1, False), (2, 1, True)])
def test_gemm_reduce_scatter_matches_linear_reduce(n, seq_dim, autocast):
    assert all(pool(n).run(check_against_linear_reduce, n, seq_dim, autocast))


def check_bad_input_and_fallback(n):
    from megakern.parallel.overlap import gemm_reduce_scatter

    g = dist.group.WORLD
    with pytest.raises(ValueError, match="not divisible by the group size"):
        gemm_reduce_scatter(torch.randn(2, 2 * n + 1, 4), torch.randn(3, 4), g, True, 1)
    with pytest.raises(ValueError, match="does not fit weight"):
        gemm_reduce_scatter(torch.randn(2, 2 * n, 4), torch.randn(3, 5), g, True, 1)
    with pytest.raises(ValueError, match="other than the features"):
        gemm_reduce_scatter(torch.randn(2, 2 * n, 4), torch.randn(3, 4), g, True, -1)
    # without sequence parallel: the all-reduce of linear_reduce
    x, w = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    y = gemm_reduce_scatter(x, w, g, False, 1)
    want = torch.nn.functional.linear(x, w)
    dist.all_reduce(want, group=g)
    torch.testing.assert_close(y, want)
    return True


def test_bad_input_and_all_reduce_fallback():
    assert all(pool(2).run(check_bad_input_and_fallback, 2))


def parallelize_error(**options) -> str:
    """The ValueError's message of parallelize on a tiny GPT under tp2 (gloo ranks) with ``options``."""
    from megakern.models.gpt import GPT
    from megakern.parallel import ParallelDims, parallelize

    from gpt_check import tiny_config

    pm = ParallelDims(tp=2).build("cpu", timeout=60)
    try:
        parallelize(GPT(tiny_config("gpt")), pm, None, **options)
    except ValueError as exc:
        return str(exc)
    return "no error"


def overlap_choice(**options) -> tuple:
    """(tp_overlap, tp_overlap_note) of parallelize on a tiny GPT under tp2 (gloo ranks) with ``options``."""
    from megakern.models.gpt import GPT
    from megakern.parallel import ParallelDims, parallelize

    from gpt_check import tiny_config

    pm = ParallelDims(tp=2).build("cpu", timeout=60)
    model = parallelize(GPT(tiny_config("gpt")), pm, None, **options)
    return model.tp_overlap, model.tp_overlap_note


def test_overlap_auto_on_gloo():
    """The default (auto) on gloo ranks: off, saying why (symmetric memory needs CUDA; eager steps first)."""
    for choice in pool(2).run(overlap_choice):
        assert choice == (None, "tp_comm_overlap=auto: off: the step is eager (the overlap measured faster in "
                                "CUDA-graph steps only)"), choice
    for choice in pool(2).run(overlap_choice, cuda_graph=True):
        assert choice == (None, "tp_comm_overlap=auto: off: symmetric memory cannot be used (the device is cpu, "
                                "not cuda)"), choice
    for choice in pool(2).run(overlap_choice, tp_comm_overlap=True):
        assert choice == ("ring", ""), choice


@pytest.mark.parametrize("overlap, impl, tp, sp, graph, problem, want, others", [
    ("auto", "auto", 2, True, True, "", (True, "symmetric", "on, symmetric"), ""),
    ("auto", "auto", 4, True, False, "", (False, "ring", "off: the step is eager"), ""),
    ("auto", "auto", 2, False, True, "", (False, "symmetric", "off: sequence parallelism is off"), ""),
    ("auto", "auto", 2, True, True, "the group spans hosts", (False, "ring", "the group spans hosts"), ""),
    ("auto", "ring", 2, True, True, "", (False, "ring", "tp_overlap_impl='ring' did not measure faster"), ""),
    ("auto", "symmetric-kernel", 2, True, True, "", (True, "symmetric-kernel", "on, symmetric-kernel"), ""),
    ("auto", "auto", 1, True, True, "", (False, "symmetric", None), ""),
    (True, "auto", 2, True, False, "", (True, "ring", None), ""),
    (True, "auto", 2, True, True, "", (True, "symmetric", None), ""),
    (True, "symmetric", 2, True, False, "", (True, "symmetric", None), ""),
    (False, "auto", 2, True, True, "", (False, "symmetric", None), ""),
    (True, "ring", 1, True, True, "", (False, "ring", None), ""),
    ("auto", "auto", 2, True, True, "", (False, "symmetric", "off: not yet measured beside dp=2"), "dp=2"),
    (True, "auto", 2, True, True, "", (True, "symmetric", None), "dp=2"),
])
def test_choose_tp_overlap(overlap, impl, tp, sp, graph, problem, want, others):
    from megakern.parallel.parallelize import choose_tp_overlap

    on, chosen, note = choose_tp_overlap(overlap, impl, tp, sp, graph, problem, others)
    assert (on, chosen) == want[:2]
    if want[2] is None:  # nothing chosen for the user: no log line
        assert note == ""
    else:
        assert note.startswith("tp_comm_overlap=auto: ") and want[2] in note, note


def test_overlap_needs_sequence_parallel():
    for message in pool(2).run(parallelize_error, sequence_parallel=False, tp_comm_overlap=True):
        assert "tp_comm_overlap" in message and "sequence_parallel=True" in message, message


def check_all_gather_gemm(n):
    """The gloo path of all_gather_gemm: gather_from_sp then the matmul, its gradients reduce-scattered back (the
    layer's unfused path); its operand checks."""
    from megakern.parallel.mappings import gather_from_sp
    from megakern.parallel.overlap import all_gather_gemm

    g, r = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(7)
    X = torch.randn(3, 5 * n, 6, dtype=torch.float64)  # the whole sequence, the same on every rank
    torch.manual_seed(100 + r)
    w0 = torch.randn(4, 6, dtype=torch.float64)  # this rank's output columns
    dy = torch.randn(3, 5 * n, 4, dtype=torch.float64)
    out = []
    for fused in (True, False):
        x = token_shard(X, n, r, 1).clone().requires_grad_()
        w = w0.clone().requires_grad_()
        y = all_gather_gemm(x, w, g, 1) if fused else torch.nn.functional.linear(gather_from_sp(x, g, 1), w)
        y.backward(dy)
        out.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0][0], X @ w0.t())  # the whole sequence, this rank's columns
    with pytest.raises(ValueError, match="does not fit weight"):
        all_gather_gemm(torch.randn(2, 3, 4), torch.randn(5, 3), g, 1)
    with pytest.raises(ValueError, match="other than the features"):
        all_gather_gemm(torch.randn(2, 3, 4), torch.randn(5, 4), g, 2)
    return True


def test_all_gather_gemm_gloo_path():
    assert all(pool(2).run(check_all_gather_gemm, 2))


def test_symmetric_workspace_refuses_gloo():
    """The symmetric-memory workspace names why it cannot run: a CPU device, a one-rank group."""
    from megakern.parallel.symmetric import SymmetricWorkspace, symmetric_memory_usable

    assert "not cuda" in symmetric_memory_usable(None, torch.device("cpu"))
    with pytest.raises(ValueError, match="symmetric memory cannot be used: the device is cpu"):
        SymmetricWorkspace(None, torch.device("cpu"))


def check_column_gather_gemm_seam(n):
    """ColumnParallelLinear under sequence parallel with a gather_gemm (all_gather_gemm, its gloo path) equals the
    layer gathering by gather_from_sp: it takes the shard and returns the whole sequence, bias added, gradients of
    the shard, the weight and the bias."""
    import functools

    from megakern.parallel.layers import ColumnParallelLinear
    from megakern.parallel.overlap import all_gather_gemm

    g, r = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(3)
    full = torch.nn.Linear(6, 4 * n, dtype=torch.float64)
    X = torch.randn(2, 3 * n, 6, dtype=torch.float64)
    dy = torch.randn(2, 3 * n, 4, dtype=torch.float64)
    out = []
    for seam in (functools.partial(all_gather_gemm, workspace=None), None):
        layer = ColumnParallelLinear.from_linear(full, g, sequence_parallel=True, gather_gemm=seam)
        x = token_shard(X, n, r, 1).clone().requires_grad_()
        y = layer(x)
        y.backward(dy)
        out.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert out[0][0].shape == (2, 3 * n, 4)
    # under bf16 autocast the fused path returns the product's dtype, as the unfused F.linear (bias included) does
    layer = ColumnParallelLinear.from_linear(full.float(), g, sequence_parallel=True,
                                             gather_gemm=functools.partial(all_gather_gemm, workspace=None))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(token_shard(X, n, r, 1).float())
    assert y.dtype == torch.bfloat16, y.dtype
    return True


def test_column_gather_gemm_seam():
    assert all(pool(2).run(check_column_gather_gemm_seam, 2))


def test_symmetric_impl_refused_on_gloo():
    for message in pool(2).run(parallelize_error, sequence_parallel=True, tp_comm_overlap=True,
                               tp_overlap_impl="symmetric"):
        assert "tp_overlap_impl='symmetric' cannot run here: the device is cpu" in message, message
    for message in pool(2).run(parallelize_error, sequence_parallel=True, tp_overlap_signals="flag"):
        assert "tp_overlap_signals must be one of stream, kernel, got 'flag'" in message, message
    for message in pool(2).run(parallelize_error, sequence_parallel=True, tp_overlap_gather="fetch"):
        assert "tp_overlap_gather must be one of pull, push, got 'fetch'" in message, message


@pytest.mark.parametrize("rows, k, n, want", [
    (4096, 1024, 2048, "inputs"),  # GPT-1.3B's attention projection at tp 2: k (rows + n) = 6.3M < 8.4M elements
    (4096, 4096, 2048, "partials"),  # its MLP projection: the input rows outweigh the partial sum
    (4096, 3072, 2048, "partials"),  # the qkv layer's dX (its backward) at tp 2
    (16, 64, 256, "partials"),  # few rows: the weight outweighs the partial sum (64 x 272 > 16 x 256)
    (2048, 512, 4096, "inputs"),
])
def test_rs_route_moves_fewer_bytes(rows, k, n, want):
    from megakern.parallel.overlap import rs_route

    assert rs_route(rows, k, n) == want
    assert rs_route(rows, k, n, "partials") == "partials" and rs_route(rows, k, n, "inputs") == "inputs"
    with pytest.raises(ValueError, match="unknown route 'output'.*auto, partials, inputs"):
        rs_route(rows, k, n, "output")



@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU build's answer")
def test_stream_signals_say_why_they_cannot_run_on_a_cpu_build():
    import re

    from megakern.parallel import stream_memops

    why = stream_memops.unavailable()
    assert "not a CUDA build" in why
    with pytest.raises(RuntimeError, match=re.escape(f"write_value32: {why}")):
        stream_memops.write_value32(None, 0, 1)
