"""megakern.optim.MasterAdamW against torch.optim.AdamW on fp32 copies of the same weights and gradients, and
megakern.optim.SumOfSquares against an fp64 sum.

The reference runs torch's for-loop AdamW in fp64 on the masters with the same (bf16-rounded) gradients divided by
the same divisor; MasterAdamW must follow it within fp32 rounding over several steps, write the bf16 model weights as
the rounded masters, skip a step flagged by found_inf without touching anything, and keep torch's state layout.
"""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, require_triton, seed
from megakern.optim import MasterAdamW, SumOfSquares, total_norm

SHAPES = [(37, 19), (5,), (3, 130), (1,), (2100,)]  # odd sizes; 2100 spans several blocks
BLOCK = 512


def make(shapes, model_dtype, grad_on: str, unaligned: bool = False):
    """Masters and their model copies; ``unaligned``: both laid out in flat buffers from element 1 on (4- and 2-byte
    aligned addresses, as views into a flat parameter buffer may be), which the kernel must take element by element."""
    masters = [torch.randn(s, device=DEVICE) for s in shapes]
    if unaligned:
        flat = torch.empty(1 + sum(m.numel() for m in masters), device=DEVICE)
        views, at = [], 1
        for m in masters:
            views.append(flat[at:at + m.numel()].view(m.shape).copy_(m))
            at += m.numel()
        masters = views
    models = [m.detach().to(model_dtype) if model_dtype is not None else None for m in masters]
    if unaligned and model_dtype is not None:
        flat = torch.empty(1 + sum(w.numel() for w in models), device=DEVICE, dtype=model_dtype)
        views, at = [], 1
        for w in models:
            views.append(flat[at:at + w.numel()].view(w.shape).copy_(w))
            at += w.numel()
        models = views
    return masters, models


def set_grads(masters, models, grad_on: str, grad_dtype):
    """Fresh random gradients on the model weights (bf16 from the backward) or the masters (fp32 accumulation);
    returns their values in fp64 for the reference."""
    values = []
    for m, w in zip(masters, models):
        g = (torch.randn(m.shape, device=DEVICE) * 3).to(grad_dtype)
        m.grad = w.grad = None
        if grad_on == "model":
            w.grad = g
        else:
            m.grad = g
        values.append(g.double())
    return values


def assert_rounded(model: torch.Tensor, master: torch.Tensor, what: str) -> None:
    """The model weight is the master rounded to nearest even, as torch's .to() rounds (on CPU tensors the kernel
    rounds bf16 by integer arithmetic: the interpreter's own cast truncates)."""
    assert torch.equal(model, master.to(model.dtype)), f"{what} is not the master rounded"


@pytest.mark.parametrize("model_dtype,grad_on,grad_dtype", [
    (torch.bfloat16, "model", torch.bfloat16), (torch.bfloat16, "master", torch.float32),
    (torch.float16, "model", torch.float16), (None, "master", torch.float32)])
@pytest.mark.parametrize("lr_tensor", [False, True])
@pytest.mark.parametrize("unaligned", [False, True], ids=("aligned", "unaligned"))
def test_master_adamw_matches_torch(model_dtype, grad_on, grad_dtype, lr_tensor, unaligned, monkeypatch):
    from megakern import _optim_triton

    require_triton()
    seed("master_adamw", model_dtype, grad_on, grad_dtype, lr_tensor, unaligned)
    launched = []
    launch = _optim_triton.launch
    monkeypatch.setattr(_optim_triton, "launch", lambda *a, **k: launched.append(k["aligned"]) or launch(*a, **k))
    masters, models = make(SHAPES, model_dtype, grad_on, unaligned)
    if model_dtype is None:
        models = [torch.zeros_like(m) for m in masters]  # the gradients' holders only; no copy is written
    ref = [m.detach().double().clone().requires_grad_() for m in masters]
    hyper = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8)
    lr = torch.tensor(hyper["lr"], device=DEVICE) if lr_tensor else hyper["lr"]
    groups = [{"params": masters[:3], "weight_decay": 0.1}, {"params": masters[3:], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, **{**hyper, "lr": lr}, **({"capturable": True} if lr_tensor else {}))
    ref_opt = torch.optim.AdamW([{"params": ref[:3], "weight_decay": 0.1}, {"params": ref[3:], "weight_decay": 0.0}],
                                **hyper, foreach=False)
    step = MasterAdamW(opt, {m: (w if model_dtype is not None else None) for m, w in zip(masters, models)},
                       block=BLOCK)
    for i in range(4):
        grads = set_grads(masters, models, grad_on, grad_dtype)
        divisor = 1.0 + i  # gradient clipping's divisor: the gradients are divided by it
        if lr_tensor:
            lr.fill_(hyper["lr"] * (1 - 0.1 * i))
        for group in ref_opt.param_groups:
            group["lr"] = hyper["lr"] * (1 - 0.1 * i) if lr_tensor else hyper["lr"]
        for r, g in zip(ref, grads):
            r.grad = g / divisor
        ref_opt.step()
        step.step(grad_scale=torch.full((), divisor, device=DEVICE))
        for j, (m, r) in enumerate(zip(masters, ref)):
            torch.testing.assert_close(m.double(), r.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}, tensor {j}")
            st, rst = opt.state[m], ref_opt.state[r]
            assert st["step"].dtype == torch.float32 and st["step"].item() == i + 1
            torch.testing.assert_close(st["exp_avg_sq"].double(), rst["exp_avg_sq"], rtol=1e-5, atol=1e-9)
            if model_dtype is not None:
                assert_rounded(models[j], m, f"step {i}: model weight {j}")
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # 16-byte aligned tensors take the vectorized launch, the others (most of the flat buffers' views) the
    # element-wise one
    assert (False in launched) if unaligned else set(launched) == {True}, launched


def test_master_adamw_untouched_rows_keep_their_bits():
    """An embedding whose rows no token touched (zero gradients, zero moments, no weight decay): those rows' masters
    and moments keep their exact bits step after step (the kernel skips the moments' update of such blocks and writes
    back only what changed: a row of -0 becomes +0 and is written) while the touched rows follow torch's AdamW; under
    weight decay the same rows decay, their moments staying +0; the model copy is rewritten everywhere as the rounded
    master."""
    require_triton()
    seed("untouched rows")
    rows, width = 64, 48  # 3072 elements: blocks of 512 cover 10.7 rows, so blocks mix touched and untouched rows
    master = torch.randn(rows, width, device=DEVICE)
    master[45] = -0.0  # p - lr * wd * p turns -0 into +0 (as torch's fused AdamW computes it): a change, written
    model = master.to(torch.bfloat16)
    decayed = torch.randn(rows, width, device=DEVICE)  # the same zero rows under weight decay: they change
    decayed_model = decayed.to(torch.bfloat16)
    ref, ref_decayed = (t.detach().double().clone().requires_grad_() for t in (master, decayed))
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    opt = torch.optim.AdamW([{"params": [master], "weight_decay": 0.0}, {"params": [decayed], "weight_decay": 0.1}],
                            **hyper)
    ref_opt = torch.optim.AdamW([{"params": [ref], "weight_decay": 0.0},
                                 {"params": [ref_decayed], "weight_decay": 0.1}], **hyper, foreach=False)
    step = MasterAdamW(opt, {master: model, decayed: decayed_model}, block=BLOCK)
    touched = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
    touched[[1, 2, 30, 31, 32, 63]] = True
    untouched_bits = master[~touched].view(torch.int32).clone()
    untouched_bits[(~touched).cumsum(0)[45] - 1] = 0  # row 45 (a block of untouched rows): +0 after the first step
    for i in range(3):
        g = torch.randn(rows, width, device=DEVICE).to(torch.bfloat16) * touched[:, None]
        model.grad = decayed_model.grad = g
        ref.grad = ref_decayed.grad = g.double()
        model.fill_(7.0)  # not the rounded master: the step writes every element of the copy
        step.step()
        ref_opt.step()
        assert torch.equal(master[~touched].view(torch.int32), untouched_bits), f"step {i}"
        state = opt.state[master]
        assert torch.equal(state["exp_avg"][~touched].view(torch.int32), torch.zeros_like(untouched_bits))
        assert torch.equal(state["exp_avg_sq"][~touched].view(torch.int32), torch.zeros_like(untouched_bits))
        for key in ("exp_avg", "exp_avg_sq"):  # under weight decay the moments of untouched rows stay +0 too
            assert torch.equal(opt.state[decayed][key][~touched].view(torch.int32), torch.zeros_like(untouched_bits))
        torch.testing.assert_close(master.double(), ref.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")
        torch.testing.assert_close(decayed.double(), ref_decayed.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")
        assert_rounded(model, master, f"step {i}")
        assert_rounded(decayed_model, decayed, f"step {i}: decayed")

def test_master_adamw_found_inf_skips_everything():
    require_triton()
    seed("master_adamw_skip")
    masters, models = make(SHAPES, torch.bfloat16, "model")
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    step = MasterAdamW(opt, dict(zip(masters, models)), block=BLOCK)
    set_grads(masters, models, "model", torch.bfloat16)
    step.step()
    before = [(m.clone(), w.clone(), opt.state[m]["exp_avg"].clone(), opt.state[m]["exp_avg_sq"].clone())
              for m, w in zip(masters, models)]
    set_grads(masters, models, "model", torch.bfloat16)
    models[0].grad[0] = float("nan")
    step.step(found_inf=torch.ones((), device=DEVICE))
    for (m0, w0, a0, s0), m, w in zip(before, masters, models):  # bit for bit, the NaN gradient unread
        assert torch.equal(m, m0) and torch.equal(w, w0)
        assert torch.equal(opt.state[m]["exp_avg"], a0) and torch.equal(opt.state[m]["exp_avg_sq"], s0)
        assert opt.state[m]["step"].item() == 1
    step.step(found_inf=torch.zeros((), device=DEVICE))  # a good step after the skip counts as the second
    assert all(opt.state[m]["step"].item() == 2 for m in masters)
    assert all(torch.isfinite(m).all() for m in masters[1:])


def test_master_adamw_skips_masters_without_gradients_and_follows_new_addresses():
    require_triton()
    seed("master_adamw_nograd")
    masters, models = make(SHAPES[:3], torch.bfloat16, "model")
    opt = torch.optim.AdamW(masters, lr=1e-2)
    step = MasterAdamW(opt, dict(zip(masters, models)), block=BLOCK)
    set_grads(masters, models, "model", torch.bfloat16)
    models[1].grad = None
    untouched = masters[1].clone()
    step.step()
    assert torch.equal(masters[1], untouched) and masters[1] not in opt.state
    for _ in range(2):  # new gradient tensors (new addresses) each step: the table follows them
        set_grads(masters, models, "model", torch.bfloat16)
        step.step()
    assert [opt.state[m]["step"].item() for m in masters] == [3, 2, 3]


def test_master_adamw_rejects_bad_input():
    master = torch.randn(4, 3, device=DEVICE)
    model = master.to(torch.bfloat16)
    with pytest.raises(TypeError, match="torch.optim.AdamW"):
        MasterAdamW(torch.optim.Adam([master]), {master: model})
    with pytest.raises(ValueError, match="amsgrad"):
        MasterAdamW(torch.optim.AdamW([master], amsgrad=True), {master: model})
    half = torch.randn(4, 3, device=DEVICE).half()
    with pytest.raises(TypeError, match="float32"):
        MasterAdamW(torch.optim.AdamW([half]), {half: None})
    with pytest.raises(KeyError, match="no entry"):
        MasterAdamW(torch.optim.AdamW([master]), {})
    with pytest.raises(ValueError, match="shape"):
        MasterAdamW(torch.optim.AdamW([master]), {master: model.t().contiguous()})
    with pytest.raises(ValueError, match="power of two"):
        MasterAdamW(torch.optim.AdamW([master]), {master: model}, block=1000)
    require_triton()
    step = MasterAdamW(torch.optim.AdamW([master]), {master: model})
    model.grad = torch.randn(4, 3, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="one-element float32"):
        step.step(grad_scale=torch.ones(2, device=DEVICE))


def test_total_norm_sums_in_fp32():
    seed("total_norm")
    tensors = [torch.randn(1000, device=DEVICE).to(torch.bfloat16) for _ in range(3)] + [torch.randn(7, device=DEVICE)]
    truth = torch.cat([t.double().reshape(-1) for t in tensors]).norm()
    got = total_norm(tensors)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), truth, rtol=1e-6, atol=0)


def _sumsq_truth(tensors) -> torch.Tensor:
    return sum((t.double().square().sum() for t in tensors), torch.zeros((), dtype=torch.float64, device=DEVICE))


def _sumsq_inputs():
    """Odd sizes in every kernel dtype (whole blocks, a partial block, one element), a bf16 view from element 1 on
    (a 2-byte aligned address: the unaligned launch), a transposed and an fp64 tensor (torch's path), an empty one."""
    flat = torch.randn(1 + 3000, device=DEVICE).to(torch.bfloat16)
    return [torch.randn(37, 19, device=DEVICE).to(torch.bfloat16), torch.randn(2100, device=DEVICE),
            torch.randn(1, device=DEVICE).to(torch.float16), torch.randn(3, 513, device=DEVICE).to(torch.bfloat16),
            flat[1:].view(30, 100), torch.randn(40, 9, device=DEVICE).t(), torch.randn(5, device=DEVICE).double(),
            torch.empty(0, 4, device=DEVICE)]


@pytest.mark.parametrize("block, warps", [(512, 4), (16, 1)])
def test_sum_of_squares_matches_fp64(block, warps):
    require_triton()
    seed("sumsq", block)
    tensors = _sumsq_inputs()
    assert tensors[4].data_ptr() % 16 and tensors[4].is_contiguous() and not tensors[5].is_contiguous()
    sumsq = SumOfSquares(block=block, warps=warps)
    got = sumsq(tensors)
    assert got.dtype == torch.float32 and got.shape == () and got.device.type == torch.device(DEVICE).type
    torch.testing.assert_close(got.double(), _sumsq_truth(tensors), rtol=2e-6, atol=0)
    assert torch.equal(sumsq(tensors), got)  # a fixed order of additions: the same bits again
    # new tensors of the same sizes (other addresses: the table is rewritten), then other sizes
    fresh = [torch.randn_like(t) if t.numel() else t for t in tensors]
    torch.testing.assert_close(sumsq(fresh).double(), _sumsq_truth(fresh), rtol=2e-6, atol=0)
    fewer = fresh[1:4]
    torch.testing.assert_close(sumsq(fewer).double(), _sumsq_truth(fewer), rtol=2e-6, atol=0)


def test_sum_of_squares_propagates_nonfinite_and_takes_empty_input():
    require_triton()
    seed("sumsq nonfinite")
    sumsq = SumOfSquares(block=64)
    a, b = torch.randn(300, device=DEVICE).to(torch.bfloat16), torch.randn(70, device=DEVICE)
    b[69] = float("nan")
    assert torch.isnan(sumsq([a, b]))
    b[69] = float("inf")
    assert torch.isinf(sumsq([a, b]))
    zero = sumsq([])
    assert zero.item() == 0.0 and zero.dtype == torch.float32
    assert sumsq([torch.empty(0, device=DEVICE)]).item() == 0.0


def test_sum_of_squares_rejects_bad_input():
    with pytest.raises(TypeError, match="expected tensors, got a list"):
        SumOfSquares()([[1.0, 2.0]])
    with pytest.raises(TypeError, match="floating-point tensor on .*got torch.int64"):
        SumOfSquares()([torch.ones(3), torch.ones(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="block must be a power of two >= 16, got 100"):
        SumOfSquares(block=100)
    with pytest.raises(ValueError, match="warps must be a power of two >= 1, got 3"):
        SumOfSquares(warps=3)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device (none here)")
def test_sum_of_squares_in_a_cuda_graph():
    """An eager call first, then a capture over tensors at other addresses: flush() writes their table; every replay
    reads the tensors' current values. A capture with no eager call first takes torch's path instead."""
    require_triton()
    seed("sumsq graph")
    sumsq, cold = SumOfSquares(), SumOfSquares()
    eager = [torch.randn(5000, device=DEVICE).to(torch.bfloat16), torch.randn(3, 333, device=DEVICE)]
    sumsq(eager)
    captured = [torch.randn_like(t) for t in eager]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = sumsq(captured)
        out_cold = cold(captured)
    torch.cuda.current_stream().wait_stream(stream)
    sumsq.flush()
    cold.flush()
    for _ in range(2):
        for t in captured:
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double(), _sumsq_truth(captured), rtol=2e-6, atol=0)
        torch.testing.assert_close(out_cold.double(), _sumsq_truth(captured), rtol=2e-6, atol=0)
    torch.testing.assert_close(sumsq(eager).double(), _sumsq_truth(eager), rtol=2e-6, atol=0)


def _sm90_ptx(kernel, constexprs: dict, types: dict, warps: int) -> str:
    """``kernel``'s PTX for sm_90: ``constexprs`` fixed, pointer arguments typed by ``types``, the rest fp32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {a: "constexpr" if a in constexprs else types.get(a, "fp32") for a in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps)).asm["ptx"]


def compile_for_sm90():
    """The kernel lowered for sm_90 in each variant the trainer launches (bf16 or fp32 gradients)."""
    import triton.language as tl

    from megakern import _optim_triton as kern

    out = []
    for grad in (tl.bfloat16, tl.float32):
        for aligned in (False, True):
            constexprs = {"LR_ON_DEVICE": True, "HAS_SCALE": True, "HAS_INF": True, "GRAD_DTYPE": grad,
                          "MODEL_DTYPE": tl.bfloat16, "WRITE_MODEL": True, "ROUND_BY_BITS": False,
                          "ALIGNED": aligned, "BLOCK": 4096}
            types = {"WORK": "*i64", "TABLE": "*i64", "LR": "*fp32", "SCALE": "*fp32", "FOUND_INF": "*fp32"}
            ptx = _sm90_ptx(kern._adamw_kernel, constexprs, types, 8)
            assert "st.global" in ptx
            # aligned launches move whole blocks in 16-byte vectors (the masters, moments and gradients)
            vectors = ptx.count("ld.global.v4") + ptx.count("st.global.v4")
            assert (vectors >= 8) if aligned else vectors == 0, (str(grad), aligned, vectors)
        out.append(str(grad))
    return out


def compile_sumsq_for_sm90():
    """The sum-of-squares kernel lowered for sm_90: aligned launches read whole blocks in 16-byte vectors."""
    import triton.language as tl

    from megakern import _sumsq_triton as kern

    out = []
    for dtype in (tl.bfloat16, tl.float32):
        for aligned in (False, True):
            ptx = _sm90_ptx(kern._sumsq_kernel, {"DTYPE": dtype, "ALIGNED": aligned, "BLOCK": 4096},
                            {"WORK": "*i64", "TABLE": "*i64", "PARTIALS": "*fp32"}, 4)
            vectors = ptx.count("ld.global.v4")
            assert (vectors >= 4) if aligned else vectors == 0, (str(dtype), aligned, vectors)
        out.append(str(dtype))
    return out


def test_kernels_compile_for_sm90():
    """MasterAdamW's and SumOfSquares' kernels, lowered for sm_90 in a subprocess (see the two functions above)."""
    from conftest import sm90_lowering

    assert sm90_lowering("test_optim", "compile_for_sm90()") == ["bf16", "fp32"]
    assert sm90_lowering("test_optim", "compile_sumsq_for_sm90()") == ["bf16", "fp32"]


def test_address_tables_work_lists_and_rewrites():
    """megakern._tables on the CPU: a work list of (row, first element) blocks per set of sizes, one table per key
    rewritten in place when an address moves, a new one for other sizes; malformed rows refused by name."""
    from megakern._tables import AddressTables

    tables = AddressTables(2, 16, "test")
    cpu = torch.device("cpu")
    work, table, programs = tables.get("k", ((40, 1000), (16, 2000)), cpu)
    assert programs == 4 and work.tolist() == [0, 0, 0, 16, 0, 32, 1, 0] and table.tolist() == [40, 1000, 16, 2000]
    same = tables.get("k", ((40, 1000), (16, 2000)), cpu)
    assert same[1] is table and same[0] is work
    moved = tables.get("k", ((40, 3000), (16, 2000)), cpu)
    assert moved[1] is table and table.tolist() == [40, 3000, 16, 2000]  # rewritten in place
    other = tables.get("k", ((8, 3000),), cpu)
    assert other[2] == 1 and other[1].tolist() == [8, 3000]
    assert tables.ready("k", ((8, 1),), cpu)  # outside a capture, always
    with pytest.raises(ValueError, match="every row must hold 2 entries"):
        tables.get("k", ((8, 1, 2),), cpu)
    with pytest.raises(ValueError, match="row must be >= 1"):
        AddressTables(0, 16)
