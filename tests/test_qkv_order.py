"""megakern.qkv_rows: a fused qkv projection's rows between the grouped order (per kv head: its query heads, k, v) and
the heads-major one (every query head, every k head, every v head). The Triton pass against an index-built truth,
bit-exact (a permutation), both ways and round trip; odd head sizes and column counts, MHA and MQA, a bias (one
column), trailing dims, non-contiguous input, empty trailing dims; bad input. Under the CPU interpreter at small
sizes; larger ones on a GPU."""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, poison_cuda_allocator, require_triton, seed

from megakern.qkv_order import qkv_rows, qkv_rows_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (nkv, g, hs, trailing shape)
CASES = [(2, 3, 5, (7,)), (4, 1, 3, (33,)), (1, 4, 2, (5, 3)), (3, 2, 4, ()), (2, 2, 1, (1,))]
if HAS_CUDA:
    CASES += [(8, 4, 128, (4096,)), (8, 3, 64, (3000,)), (1, 8, 128, (4097,))]


def truth(w: torch.Tensor, nkv: int, g: int, hs: int) -> torch.Tensor:
    """The heads-major rows by an index: query head h (kv head h // g, slot h % g), then the k heads, then the v
    heads, each of hs rows."""
    rows = []
    for head in range(nkv * g):
        rows += [((head // g) * (g + 2) + head % g) * hs + i for i in range(hs)]
    for slot in (g, g + 1):
        for kv in range(nkv):
            rows += [(kv * (g + 2) + slot) * hs + i for i in range(hs)]
    return w[torch.tensor(rows, device=w.device)]


@pytest.mark.parametrize("backend", ("triton", "torch"))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:3])) + "-" + "x".join(map(str, c[3])))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_both_ways_exact(dtype, case, backend):
    nkv, g, hs, trailing = case
    if backend == "triton":
        require_triton()
    seed("qkv_rows", dtype, case, backend)
    w = torch.randn(nkv * (g + 2) * hs, *trailing, device=DEVICE, dtype=dtype)
    poison_cuda_allocator(2 * w.numel() * w.element_size() + 4096)
    major = qkv_rows(w, nkv, g, hs, backend=backend)
    assert major.shape == w.shape and major.dtype == w.dtype
    assert torch.equal(major, truth(w, nkv, g, hs))
    back = qkv_rows(major, nkv, g, hs, heads_major=False, backend=backend)
    assert torch.equal(back, w)


def test_non_contiguous_and_empty():
    require_triton()
    seed("qkv_rows views")
    base = torch.randn(2 * 4 * 3, 2 * 9, device=DEVICE)
    w = base[:, ::2]  # strided columns
    assert not w.is_contiguous()
    assert torch.equal(qkv_rows(w, 2, 2, 3, backend="triton"), qkv_rows_ref(w, 2, 2, 3))
    empty = torch.empty(2 * 4 * 3, 0, device=DEVICE)
    assert qkv_rows(empty, 2, 2, 3, backend="triton").shape == empty.shape


def test_bad_input():
    w = torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"w has 10 rows, but nkv \* \(g \+ 2\) \* hs = 2 \* 4 \* 3 = 24"):
        qkv_rows(w, 2, 2, 3)
    with pytest.raises(ValueError, match="nkv, g and hs must be positive, got 0, 2, 3"):
        qkv_rows(w, 0, 2, 3)
    with pytest.raises(TypeError, match="at least one dim"):
        qkv_rows(torch.tensor(1.0), 1, 1, 1)
