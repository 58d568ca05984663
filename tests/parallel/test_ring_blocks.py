"""The blocks ring attention is made of, on each attention backend: partial (out, lse) merged, and each block's
backward from the merged statistics, against attention over all the keys at once. The two cases a rank meets
(a source rank before it: all its queries see the source's first chunk; after it: its second query chunk sees
the whole source) are one bottom-right-aligned causal attention over [source keys, own keys], so the reference is
megakern's own fp32 attention with autograd. Triton runs under the CPU interpreter (fp16, tiny) or on a GPU."""
import pytest
import torch
from conftest import DEVICE, HAS_CUDA

from megakern.attention import attention_ref, merge_attention
from megakern.parallel import context

CASES = [("torch", torch.float64, 2, 8, 16), ("triton", torch.float16, 1, 8, 16)]
if HAS_CUDA:
    CASES.append(("triton", torch.bfloat16, 2, 256, 64))


def _tol(dtype):
    return {torch.float64: 1e-10, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


@pytest.mark.parametrize("source_before", [True, False])
@pytest.mark.parametrize("backend,dtype,batch,c,hs", CASES)
def test_ring_blocks_match_attention_over_all_keys(backend, dtype, batch, c, hs, source_before):
    if backend == "triton":
        from megakern import available_backends

        problem = available_backends(DEVICE)["triton"]
        if problem:
            pytest.skip(f"Triton unavailable: {problem}")
    torch.manual_seed(0)
    nh, nkv = 4, 2
    mk = lambda heads: torch.randn(batch, 2 * c, heads, hs, device=DEVICE, dtype=dtype)  # noqa: E731
    q, k, v, ks, vs = mk(nh), mk(nkv), mk(nkv), mk(nkv), mk(nkv)  # own queries and keys, a source rank's keys
    dout = torch.randn_like(q)
    scale = hs ** -0.5
    # the ring's way: own block (causal), then the source block, merged; backward per block from merged stats
    out, lse = context._block_fwd(q, k, v, True, scale, backend)
    out = out.to(torch.promote_types(dtype, torch.float32))  # the ring accumulates in fp32 (fp64 for fp64)
    if source_before:  # all queries, the source's first chunk, no mask
        src_k, src_v, rows = ks[:, :c], vs[:, :c], slice(None)
    else:  # the second query chunk, the whole source, no mask
        src_k, src_v, rows = ks, vs, slice(c, None)
    o2, l2 = context._block_fwd(q[:, rows], src_k, src_v, False, scale, backend)
    out[:, rows], lse[..., rows] = merge_attention(out[:, rows], lse[..., rows], o2, l2)
    out = out.to(dtype)
    up = lambda t: t.to(torch.promote_types(t.dtype, torch.float32))  # noqa: E731
    dq, dk, dv = (up(t) for t in context._block_bwd(dout, q, k, v, out, lse, True, scale, backend, True))
    dq2, dks, dvs = (up(t) for t in context._block_bwd(dout[:, rows], q[:, rows], src_k, src_v, out[:, rows],
                                                       lse[..., rows], False, scale, backend, True))
    dq[:, rows] += dq2
    # the reference: causal (bottom-right) attention of the same queries over [source keys, own keys]
    qr = q[:, rows].double().requires_grad_()
    kr = torch.cat([src_k, k], 1).double().requires_grad_()
    vr = torch.cat([src_v, v], 1).double().requires_grad_()
    ref, ref_lse = attention_ref(qr, kr, vr, causal=True, softmax_scale=scale)
    (ref * dout[:, rows].double()).sum().backward()
    tol = _tol(dtype)
    n_src = src_k.shape[1]
    torch.testing.assert_close(out[:, rows].double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse[..., rows].double(), ref_lse.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(dq[:, rows].double(), qr.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(dks.double(), kr.grad[:, :n_src], rtol=tol, atol=tol)
    torch.testing.assert_close(dvs.double(), vr.grad[:, :n_src], rtol=tol, atol=tol)
    if source_before:  # own keys: the whole local block's gradient (every query row took part)
        torch.testing.assert_close(dk.double(), kr.grad[:, n_src:], rtol=tol, atol=tol)
        torch.testing.assert_close(dv.double(), vr.grad[:, n_src:], rtol=tol, atol=tol)
