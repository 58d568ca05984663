"""Attention kernels for Hopper (sm_90) in Gluon: FlashAttention-3's structure, which plain Triton cannot express.
The forward:

- Warp specialization: one producer warp moves tiles with TMA (q once per tile, k and v through a ring of NUM_BUF
  shared-memory slots); the consumer warps (two warpgroups, 64 query rows each) only do tensor-core and softmax work.
  Ready / empty mbarriers hand each slot back and forth.
- Ping-pong: the two consumer warpgroups take turns issuing their matmuls (an mbarrier per turn), so one's softmax
  runs while the other's matmuls keep the tensor cores busy (``default_turns``: not at head dim 64's short tiles).
- Persistent: one program per SM walks its list of tiles; while the consumers finish a tile (the last P V, the
  normalization, the stores), the producer already loads the next tile's q, k and v. The lists (``_schedule``) keep
  the tiles of a few heads running together, so the k and v they stream come from L2 rather than HBM, and balance the
  causal tiles' unequal work (the longest first, handed out greedily).
- Intra-warpgroup overlap: block j's q k^T is issued before block j-1's P V, and the softmax of block j runs while
  that P V is on the tensor cores (asynchronous wgmma, waited on by count).

The deterministic backward's two passes have the same frame:

- dq (``bwd_dq``, first): the forward's producer warp, loading dO beside q, and a ring of k / v slots; two consumer
  warpgroups with 64 query rows each make delta = rowsum(dO * O) of their rows (stored for the next pass), then per
  key block S = Q K^T and dP = dO V^T, P from the saved lse, dS = P (dP - delta), dQ += dS K. Block j's S, block
  j-1's dS K and block j's dP are issued together; P is computed while the latter two run.
- dk / dv (``bwd_dkdv``, second): a producer warp moving k and v (double buffered across tiles) and a ring of q / dO
  slots, each with its rows' base-2 lse and delta (loaded by the producer ahead of use, so the consumers read them
  from shared memory), two consumer warpgroups with 64 key rows each (S^T = K Q^T, dP^T = V dO^T, P^T from the
  saved lse, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q, dk and dv in registers, summed over the GQA
  group).

Both are persistent, with the forward's tile schedules (the dk / dv pass's keep a head's q and dO in L2).

The single-pass backward (``bwd_single``, ``deterministic=False``) is the dk / dv kernel with SUM_DQ: per query block
the two consumers put their dS^T rows into a shared (128, 64) tile, each then computes half of dq's columns over the
whole key tile and adds them into an fp32 dq by a TMA reduce (FlashAttention-3's structure; delta made beforehand).

Fixed-length batches (B, T, heads, hs) with 16-byte aligned strides, head dims 64, 96 (on 128-column tiles) and 128,
fp16 / bf16, causal or full, GQA; everything else (packed documents, windows, other head dims) takes the Triton
kernels. Same outputs as _attention_triton's: out like q, lse (B, nh, Tq) fp32 in natural log, -inf
(and out 0) for a row that sees no key; dq, dk, dv like q, k, v. GLUON_FWD / GLUON_DQ / GLUON_BWD in
megakern/attention.py say where these kernels are the default.
"""
from __future__ import annotations

import functools

import torch

from megakern._cuda import sm_count
from megakern._intmath import tma_aligned

try:  # Gluon (Triton >= 3.5); its Hopper API as of Triton 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    # the TMA load's name: async_copy_global_to_shared up to Triton 3.6, async_load from 3.7 on
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # the TMA store's name: async_copy_shared_to_global up to Triton 3.6, async_store from 3.7 on
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    from triton._C.libtriton import gluon_ir as _gluon_ir

    # the TMA reduce (cp.reduce.async.bulk.tensor, add) that the single-pass backward adds dq with
    TMA_REDUCE = hasattr(tma, "async_atomic_add") or hasattr(_gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    if hasattr(tma, "async_atomic_add"):
        _tma_reduce_add = tma.async_atomic_add
    else:  # Triton 3.6: the builder's op, which async_atomic_add wraps from 3.7 on
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    AVAILABLE = TMA_REDUCE = False

LOG2E = 1.4426950408889634
# head dims the kernels take; 96 runs on 128-column tiles (TMA reads the columns past it as zeros, the stores and
# reduces leave them out)
HEAD_DIMS = (64, 96, 128)


def block_d(hs: int) -> int:
    """The kernels' tile width for head dim ``hs`` (the key of the config tables)."""
    return 64 if hs <= 64 else 128


if AVAILABLE:  # a barrier across a partition's warps: gl.thread_barrier in Triton 3.6, gl.barrier in later releases
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# (BLOCK_M, BLOCK_N, warps per consumer, k/v ring slots, ping-pong) per head dim; with ping-pong a consumer
# warpgroup for each 64 rows of BLOCK_M (128: two, 192: three; registers a thread 240 and 160 by setmaxnreg)
CONFIGS = {64: (128, 128, 4, 3, True), 128: (128, 128, 4, 2, True)}
# Head dim 64: three consumer warpgroups (192-row tiles) where they measured faster on the H200 (docs/tuning.md,
# attention): (tiles, full attention from this many query rows, causal from this many; causal tiles of three
# warpgroups compute each warpgroup's own key ranges, see ``fwd``).
CONFIGS_THREE = {64: ((192, 128, 4, 3, True), 2048, 2048)}


def default_turns(hs: int, config: tuple) -> bool:
    """Whether the forward's ping-pong warpgroups take turns on the tensor cores by default: yes, except two of them
    (BLOCK_M 128) at head dim 64, measured 1-4% faster without turns at T 256-1024 and never slower there
    (docs/tuning.md); three at head dim 64 (T from 2048) and every tile at head dim 96-128 keep them."""
    block_m, pingpong = config[0], config[4]
    return not (pingpong and block_m == 128 and block_d(hs) == 64)


def default_config(hs: int, causal: bool, tq: int) -> tuple:
    """The forward's tiles for head dim ``hs`` (CONFIGS, or CONFIGS_THREE where it applies)."""
    three = CONFIGS_THREE.get(hs)
    if three is not None and tq >= three[2 if causal else 1]:
        return three[0]
    return CONFIGS[block_d(hs)]


if AVAILABLE:
    @gluon.constexpr_function
    def _wgmma_layouts(warps, n, head_dim):
        """(layout of an (m, n) wgmma accumulator, of an (m, head_dim) one, of a 16-bit register A operand of the
        latter) over ``warps`` warps, 16 rows per warp."""
        acc_n = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16])
        acc_d = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, head_dim, 16])
        return acc_n, acc_d, gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)

    @gluon.jit
    def _span(SCHED, n_tiles):
        """(first, end, step) of this program's walk over its tiles: with a schedule SCHED (int32, made by
        ``_schedule``: the grid + 1 offsets of each program's list, then the lists) the indices of its list in
        SCHED; without one (None: tiles of equal length), tiles pid, pid + grid, ... of the head-major order. A tile
        is (batch * heads + head) * blocks + block."""
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        if SCHED is None:
            return pid, n_tiles, grid
        else:
            return gl.load(SCHED + pid) + grid + 1, gl.load(SCHED + pid + 1) + grid + 1, 1

    @gluon.jit
    def _tile_at(SCHED, idx):
        if SCHED is None:
            return idx
        else:
            return gl.load(SCHED + idx)

    @gluon.jit
    def _tile(t, NH, num_blocks, BLOCK: gl.constexpr):
        """(batch, head, first row) of tile t."""
        bh = t // num_blocks
        return bh // NH, bh % NH, (t - bh * num_blocks) * BLOCK

    @gluon.jit
    def _key_range(start_m, TQ, TK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """(number of key blocks, first block that needs the mask) for the queries start_m .. + BLOCK_M - 1; keys
        from 0, blocks of BLOCK_N; the causal diagonal aligned bottom-right."""
        hi = TK
        full = TK
        if CAUSAL:
            diag = TK - TQ
            hi = gl.minimum(hi, start_m + BLOCK_M + diag)
            full = gl.minimum(full, start_m + diag + 1)
        hi = gl.maximum(hi, 0)
        n = gl.cdiv(hi, BLOCK_N)
        first_masked = gl.minimum(gl.maximum(full, 0) // BLOCK_N, n)
        return n, first_masked

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                  v_empty, B, NH, GROUP, TQ, TK, SCHED,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr,
                  do_desc=None, do_bufs=None, WITH_DO: gl.constexpr = False, QPARTS: gl.constexpr = 1):
        """Per query tile: q (and dO beside it for the dq pass, WITH_DO) into one of two slots, then the tile's k and
        v blocks through the ring of NUM_BUF slots. QPARTS > 1: q's tile is QPARTS tiles of q_desc's rows, slot qs
        being q_bufs' slots qs * QPARTS ...."""
        num_m = gl.cdiv(TQ, BLOCK_M)
        cnt = 0
        i = 0
        lo, hi, step = _span(SCHED, num_m * B * NH)
        t = _tile_at(SCHED, lo)
        for idx in range(lo, hi, step):
            b, h, start_m = _tile(t, NH, num_m, BLOCK_M)
            t = _tile_at(SCHED, gl.minimum(idx + step, hi - 1))  # the next tile, read ahead
            qs = i % 2
            mbarrier.wait(q_empty.index(qs), ((i // 2) & 1) ^ 1)
            if WITH_DO:
                mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                _tma_load(do_desc, [b, start_m, h, 0], q_ready.index(qs), do_bufs.index(qs))
                _tma_load(q_desc, [b, start_m, h, 0], q_ready.index(qs), q_bufs.index(qs))
            elif QPARTS == 1:
                mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
                _tma_load(q_desc, [b, start_m, h, 0], q_ready.index(qs), q_bufs.index(qs))
            else:
                mbarrier.expect(q_ready.index(qs), QPARTS * q_desc.block_type.nbytes)
                for part in gl.static_range(QPARTS):
                    _tma_load(q_desc, [b, start_m + part * (BLOCK_M // QPARTS), h, 0], q_ready.index(qs),
                              q_bufs.index(qs * QPARTS + part))
            n, _first_masked = _key_range(start_m, TQ, TK, BLOCK_M, BLOCK_N, CAUSAL)
            hk = h // GROUP
            for j in range(n):
                s = cnt % NUM_BUF
                ph = ((cnt // NUM_BUF) & 1) ^ 1
                mbarrier.wait(k_empty.index(s), ph)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                _tma_load(k_desc, [b, j * BLOCK_N, hk, 0], k_ready.index(s), k_bufs.index(s))
                mbarrier.wait(v_empty.index(s), ph)
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                _tma_load(v_desc, [b, j * BLOCK_N, hk, 0], v_ready.index(s), v_bufs.index(s))
                cnt += 1
            i += 1

    @gluon.jit
    def _seen(rows, j, TQ, TK, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
        """Which of key block j's keys each query row sees: those before the keys' end, and under causal those on or
        below the diagonal (aligned bottom-right)."""
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = cols[None, :] < TK
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + (TK - TQ))
        return ok

    @gluon.jit
    def _scores(s, j, first_masked, start_m, m_i, l_i, TQ, TK, scale_log2,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
        """Online softmax of one block of scores: (p, new running max, new running sum, rescale factor)."""
        if j >= first_masked:
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            s = gl.where(_seen(rows, j, TQ, TK, BLOCK_N, CAUSAL, s_layout), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * scale_log2 - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _turn_wait(turn, slot, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until the consumer warpgroup before this one (round robin) has issued its matmuls of the
        slot (the first warpgroup goes first, and then after the last one's matmuls of the previous slot)."""
        if PINGPONG:
            if WG == 0:
                mbarrier.wait(turn.index(0), (slot & 1) ^ 1)
            else:
                mbarrier.wait(turn.index(WG), slot & 1)
        return slot + 1

    @gluon.jit
    def _store_rows(base, stride_t, tile, first_row, T, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                    WARPS: gl.constexpr, D: gl.constexpr = 0):
        """A (ROWS, HEAD_DIM) tile of rows first_row.. (those below T) stored at base + row * stride_t: moved first
        into a layout of 8 consecutive elements a thread, so that a row goes out in 16-byte stores (the wgmma
        accumulator's layout gives a thread 2 consecutive elements, 4-byte stores that fill half of each sector).
        D > 0: the head dim when the tile is wider (its first D columns only)."""
        st: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [WARPS, 1], [1, 0])
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st))
        mask = (rows < T)[:, None]
        if D > 0:
            mask = mask & (cols < D)[None, :]
        gl.store(base + rows.to(gl.int64)[:, None] * stride_t + cols[None, :], gl.convert_layout(tile, st),
                 mask=mask)

    @gluon.jit
    def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr, WGS: gl.constexpr = 2):
        """Ping-pong: hand the tensor cores to the next of the WGS consumer warpgroups."""
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % WGS), count=1)

    @gluon.jit
    def _consumer(WG: gl.constexpr, PINGPONG: gl.constexpr, turn, q_bufs, k_bufs, v_bufs, q_ready, q_empty,
                  k_ready, k_empty, v_ready, v_empty, O, LSE,
                  stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, B, NH, TQ, TK, SCHED, scale_log2,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
                  CAUSAL: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr, WGS: gl.constexpr = 2,
                  OWN: gl.constexpr = False, D: gl.constexpr = 0, O_TMA: gl.constexpr = False, o_desc=None,
                  o_bufs=None, TURNS: gl.constexpr = True):
        """The rows WG * ROWS .. + ROWS - 1 of each tile (all of them without ping-pong), on WARPS warps; with
        ping-pong one of WGS consumer warpgroups taking turns. O_TMA: the output rows go out through this
        warpgroup's slot of o_bufs by a TMA store (o_desc's tiles: ROWS rows), in place of 16-byte stores after a
        layout conversion through shared memory. TURNS (ping-pong): the warpgroups take turns issuing their
        matmuls; without, each issues as soon as its operands are ready (the k / v slots still wait for every
        warpgroup to free them). OWN: the warpgroup computes only the key blocks its own rows see (causal: fewer
        than the tile's), and for the tile's others frees their slots and keeps its turns, so that every warpgroup
        takes the same number of turns a tile."""
        layouts: gl.constexpr = _wgmma_layouts(WARPS, BLOCK_N, HEAD_DIM)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        p_layout: gl.constexpr = layouts[2]
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_bufs.dtype
        num_m = gl.cdiv(TQ, BLOCK_M)
        cnt = 0
        i = 0
        slot = 0
        lo, hi, step = _span(SCHED, num_m * B * NH)
        t = _tile_at(SCHED, lo)
        for idx in range(lo, hi, step):
            b, h, start_m = _tile(t, NH, num_m, BLOCK_M)
            t = _tile_at(SCHED, gl.minimum(idx + step, hi - 1))  # the next tile, read ahead
            my_m = start_m + WG * ROWS
            n, first_masked = _key_range(start_m, TQ, TK, BLOCK_M, BLOCK_N, CAUSAL)
            n_tile = n
            if OWN:
                n, first_masked = _key_range(my_m, TQ, TK, ROWS, BLOCK_N, CAUSAL)
            qs = i % 2
            mbarrier.wait(q_ready.index(qs), (i // 2) & 1)
            if WGS == 3:  # q in a 64-row part a warpgroup (_producer's QPARTS)
                q = q_bufs.index(qs * 3 + WG).reshape([ROWS, HEAD_DIM])
            else:
                q = q_bufs.index(qs).reshape([BLOCK_M, HEAD_DIM])
                if PINGPONG:
                    q = q.slice(WG * ROWS, ROWS, dim=0)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
            if n > 0:
                # block 0: its scores, then its softmax
                s = cnt % NUM_BUF
                mbarrier.wait(k_ready.index(s), (cnt // NUM_BUF) & 1)
                k = k_bufs.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
                slot = _turn_wait(turn, slot, WG, PINGPONG and TURNS)
                sc = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
                _turn_pass(turn, WG, PINGPONG and TURNS, WGS)
                sc = warpgroup_mma_wait(0, deps=[sc])
                mbarrier.arrive(k_empty.index(s), count=1)
                p, m_i, l_i, alpha = _scores(sc, 0, first_masked, my_m, m_i, l_i, TQ, TK, scale_log2,
                                             ROWS, BLOCK_N, CAUSAL, s_layout)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                prev = s
                prev_ph = (cnt // NUM_BUF) & 1
                cnt += 1
                for j in range(1, n):
                    # issue block j's scores and block j-1's P V; block j's softmax runs while P V does
                    s = cnt % NUM_BUF
                    ph = (cnt // NUM_BUF) & 1
                    mbarrier.wait(k_ready.index(s), ph)
                    k = k_bufs.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
                    slot = _turn_wait(turn, slot, WG, PINGPONG and TURNS)
                    sc = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    mbarrier.wait(v_ready.index(prev), prev_ph)
                    v = v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM])
                    acc = warpgroup_mma(p_op, v, acc, is_async=True)
                    _turn_pass(turn, WG, PINGPONG and TURNS, WGS)
                    sc = warpgroup_mma_wait(1, deps=[sc])
                    mbarrier.arrive(k_empty.index(s), count=1)
                    p, m_i, l_i, alpha = _scores(sc, j, first_masked, my_m, m_i, l_i, TQ, TK, scale_log2,
                                                 ROWS, BLOCK_N, CAUSAL, s_layout)
                    p_next = gl.convert_layout(p.to(dtype), p_layout)
                    acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    p_op = p_next
                    prev = s
                    prev_ph = ph
                    cnt += 1
                mbarrier.arrive(q_empty.index(qs), count=1)
                mbarrier.wait(v_ready.index(prev), prev_ph)
                v = v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM])
                slot = _turn_wait(turn, slot, WG, PINGPONG and TURNS)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                acc = warpgroup_mma(p_op, v, acc, is_async=True)
                _turn_pass(turn, WG, PINGPONG and TURNS, WGS)
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(prev), count=1)
            else:
                mbarrier.arrive(q_empty.index(qs), count=1)
            if OWN:
                # the tile's blocks past this warpgroup's rows: their slots freed, their turns kept (n + 1 turns a
                # tile for every warpgroup: one more when this one had no block of its own)
                for _j in range(n, n_tile):
                    s = cnt % NUM_BUF
                    ph = (cnt // NUM_BUF) & 1
                    mbarrier.wait(k_ready.index(s), ph)
                    mbarrier.arrive(k_empty.index(s), count=1)
                    mbarrier.wait(v_ready.index(s), ph)
                    mbarrier.arrive(v_empty.index(s), count=1)
                    slot = _turn_wait(turn, slot, WG, PINGPONG and TURNS)
                    _turn_pass(turn, WG, PINGPONG and TURNS, WGS)
                    cnt += 1
                if n == 0 and n_tile > 0:
                    slot = _turn_wait(turn, slot, WG, PINGPONG and TURNS)
                    _turn_pass(turn, WG, PINGPONG and TURNS, WGS)
            i += 1
            # normalize and store; a row that saw no key gets 0 and lse -inf
            seen = l_i > 0.0
            l_use = gl.where(seen, l_i, 1.0)
            out = acc / gl.convert_layout(l_use, row_o)[:, None]
            lse = gl.where(seen, (m_i + gl.log2(l_use)) * 0.6931471805599453, float("-inf"))
            bb = b.to(gl.int64)
            if O_TMA:  # rows past TQ (and columns past the head dim) are clipped by the store
                o_slot = o_bufs.index(WG)
                tma.store_wait(0)  # the previous tile's store has read the slot
                o_slot.reshape([ROWS, HEAD_DIM]).store(out.to(dtype))
                fence_async_shared()
                _tma_store(o_desc, [b, my_m, h, 0], o_slot)
            else:
                _store_rows(O + bb * stride_ob + h.to(gl.int64) * stride_oh, stride_ot, out.to(dtype), my_m, TQ,
                            ROWS, HEAD_DIM, WARPS, D)
            rows_l = my_m + gl.arange(0, ROWS, layout=row_s)
            gl.store(LSE + bb * stride_lb + h.to(gl.int64) * stride_lh + rows_l, lse, mask=rows_l < TQ)
        if O_TMA:
            tma.store_wait(0)  # the shared memory stays in use until the last store has read it

    @gluon.jit
    def _query_tile_rings(q_desc, k_desc, v_desc, NUM_BUF: gl.constexpr, CONSUMERS: gl.constexpr, do_desc=None,
                          WITH_DO: gl.constexpr = False, Q_SLOTS: gl.constexpr = 2):
        """Shared memory and mbarriers of the kernels that walk query tiles (the forward, the dq pass), initialized:
        two q slots (and dO slots beside them, WITH_DO), a ring of NUM_BUF k / v slots, ready / empty barriers for
        each (an empty one completes when all CONSUMERS warpgroups have arrived), and the ping-pong turns (three,
        one a consumer warpgroup). Q_SLOTS: q's slots (two, or two of QPARTS parts each).
        Returns (q, k, v slots, q ready / empty, k ready / empty, v ready / empty, turns, dO slots or q's)."""
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [Q_SLOTS] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = q_bufs
        if WITH_DO:
            do_bufs = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(q_ready.index(s), count=1)
            mbarrier.init(q_empty.index(s), count=CONSUMERS)
        for s in gl.static_range(3):
            mbarrier.init(turn.index(s), count=1)
        for s in gl.static_range(NUM_BUF):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=CONSUMERS)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(v_empty.index(s), count=CONSUMERS)
        fence_async_shared()
        return q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, do_bufs

    @gluon.jit
    def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, O, LSE, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                            B, NH, GROUP, TQ, TK, SCHED, scale_log2,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                            num_warps: gl.constexpr, OWN_RANGES: gl.constexpr = False, D: gl.constexpr = 0,
                            o_desc=None, O_TMA: gl.constexpr = False, TURNS: gl.constexpr = True):
        """PINGPONG: consumer warpgroups (num_warps 4 each) of 64 rows of the tile each, two (BLOCK_M 128) or three
        (BLOCK_M 192), taking turns on the tensor cores; else one consumer of num_warps warps for the whole tile.
        OWN_RANGES (three warpgroups): each computes only the key blocks its own rows see (_consumer's OWN). D > 0:
        the head dim, narrower than the HEAD_DIM columns of the tiles. O_TMA: the output by TMA stores of o_desc's
        tiles (a consumer warpgroup's rows each), through a slot a consumer warpgroup. TURNS: the ping-pong
        warpgroups take turns on the tensor cores (_consumer's TURNS)."""
        if PINGPONG and BLOCK_M == 192:  # q_desc's tiles are a warpgroup's 64 rows, two slots of three
            rings = _query_tile_rings(q_desc, k_desc, v_desc, NUM_BUF, 3, Q_SLOTS=8)
        else:
            rings = _query_tile_rings(q_desc, k_desc, v_desc, NUM_BUF, 2 if PINGPONG else 1)
        q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, _do = rings
        o_bufs = q_bufs  # without O_TMA the consumers never touch it: a stand-in, as warp_specialize takes values only
        if O_TMA:
            slots: gl.constexpr = (3 if BLOCK_M == 192 else 2) if PINGPONG else 1  # one a consumer warpgroup
            o_bufs = gl.allocate_shared_memory(o_desc.dtype, [slots] + o_desc.block_type.shape, o_desc.layout)
        if PINGPONG and BLOCK_M == 192:
            gl.warp_specialize([
                (_consumer, (0, True, turn, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, O, LSE, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, B, NH, TQ, TK,
                             SCHED, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, 64, num_warps, 3,
                             OWN_RANGES, D, O_TMA, o_desc, o_bufs, TURNS)),
                (_consumer, (1, True, turn, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, O, LSE, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, B, NH, TQ, TK,
                             SCHED, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, 64, num_warps, 3,
                             OWN_RANGES, D, O_TMA, o_desc, o_bufs, TURNS)),
                (_consumer, (2, True, turn, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, O, LSE, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, B, NH, TQ, TK,
                             SCHED, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, 64, num_warps, 3,
                             OWN_RANGES, D, O_TMA, o_desc, o_bufs, TURNS)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                             v_ready, v_empty, B, NH, GROUP, TQ, TK, SCHED, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL,
                             None, None, False, 3)),
            ], [num_warps, num_warps, 1], [160, 160, 24])
        elif PINGPONG:
            gl.warp_specialize([
                (_consumer, (0, True, turn, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, O, LSE, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, B, NH, TQ, TK,
                             SCHED, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, BLOCK_M // 2, num_warps,
                             2, False, D, O_TMA, o_desc, o_bufs, TURNS)),
                (_consumer, (1, True, turn, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, O, LSE, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, B, NH, TQ, TK,
                             SCHED, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, BLOCK_M // 2, num_warps,
                             2, False, D, O_TMA, o_desc, o_bufs, TURNS)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                             v_ready, v_empty, B, NH, GROUP, TQ, TK, SCHED, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL)),
            ], [num_warps, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (0, False, turn, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, O, LSE, stride_ob, stride_ot, stride_oh, stride_lb, stride_lh, B, NH, TQ, TK,
                             SCHED, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, BLOCK_M, num_warps,
                             2, False, D, O_TMA, o_desc, o_bufs, TURNS)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                             v_ready, v_empty, B, NH, GROUP, TQ, TK, SCHED, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL)),
            ], [1], [24])


    # ---- backward: dk and dv ------------------------------------------------------------------------------------
    @gluon.jit
    def _query_range(start_n, TQ, TK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """(first query row, number of query blocks, first query row past the masked ones) for the keys start_n ..
        + BLOCK_N - 1; the causal diagonal aligned bottom-right."""
        lo = 0
        full = 0
        if CAUSAL:
            diag = TK - TQ
            lo = gl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
            full = start_n + BLOCK_N - 1 - diag
        n = gl.cdiv(gl.maximum(TQ - lo, 0), BLOCK_M)
        return lo, n, full

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, kv_empty,
                      q_ready, q_empty, B, NKV, GROUP, TQ, TK, SCHED, LSE, DELTA, stride_lb, stride_lh, stat_bufs,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr,
                      KV_BUF: gl.constexpr = 2):
        """Per key tile: k and v into one of KV_BUF slots (2: the next tile's load runs under this one's work), then
        the tile's q / dO blocks, every head of the GQA group, through the ring of NUM_BUF slots, each slot with its
        rows' base-2 lse (+inf where a row sees no key or lies past the end) and delta in ``stat_bufs`` (rows 2 s and
        2 s + 1): loaded before the slot is free, so that the consumers read them from shared memory, never waiting
        on a global load. The slot's ready barrier completes with the TMA bytes and this warp's arrival."""
        stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        offs = gl.arange(0, BLOCK_M, layout=stat_layout)
        num_n = gl.cdiv(TK, BLOCK_N)
        cnt = 0
        i = 0
        lo, hi, step = _span(SCHED, num_n * B * NKV)
        t = _tile_at(SCHED, lo)
        for idx in range(lo, hi, step):
            b, hk, start_n = _tile(t, NKV, num_n, BLOCK_N)
            t = _tile_at(SCHED, gl.minimum(idx + step, hi - 1))  # the next tile, read ahead
            kvs = i % KV_BUF
            mbarrier.wait(kv_empty.index(kvs), ((i // KV_BUF) & 1) ^ 1)
            mbarrier.expect(kv_ready.index(kvs), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [b, start_n, hk, 0], kv_ready.index(kvs), k_bufs.index(kvs))
            _tma_load(v_desc, [b, start_n, hk, 0], kv_ready.index(kvs), v_bufs.index(kvs))
            lo, n, _full = _query_range(start_n, TQ, TK, BLOCK_M, BLOCK_N, CAUSAL)
            for g in range(GROUP):
                h = hk * GROUP + g
                stats = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
                for mi in range(n):
                    s = cnt % NUM_BUF
                    rows = lo + mi * BLOCK_M + offs
                    ok = rows < TQ
                    lse = gl.load(LSE + stats + rows, mask=ok, other=float("-inf"))
                    delta = gl.load(DELTA + stats + rows, mask=ok, other=0.0)
                    mbarrier.wait(q_empty.index(s), ((cnt // NUM_BUF) & 1) ^ 1)
                    mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                    _tma_load(q_desc, [b, lo + mi * BLOCK_M, h, 0], q_ready.index(s), q_bufs.index(s))
                    _tma_load(do_desc, [b, lo + mi * BLOCK_M, h, 0], q_ready.index(s), do_bufs.index(s))
                    stat_bufs.index(2 * s).store(gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634))
                    stat_bufs.index(2 * s + 1).store(delta)
                    _thread_barrier()  # every lane's stores before the arrival
                    mbarrier.arrive(q_ready.index(s), count=1)
                    cnt += 1
            i += 1

    @gluon.jit
    def _key_rows_probs(k, v, q_bufs, do_bufs, q_ready, stat_bufs, cnt, start_m, full, rows_n, s_zero, TQ, TK,
                        scale_log2, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr,
                        CAUSAL: gl.constexpr, col_s: gl.constexpr, LATE_STATS: gl.constexpr):
        """The dk/dv passes' step for a consumer's key rows (k, v) and the cnt-th query block it takes (at start_m),
        once its q and dO have landed in their ring slot: (slot, q, dO, P^T, dS^T = P^T (dP^T - delta)) from
        S^T = K Q^T and dP^T = V dO^T on the tensor cores and the rows' base-2 lse and delta, which the producer put
        beside them (``stat_bufs``), P^T 0 above the causal diagonal (the queries before ``full``).

        LATE_STATS: lse and delta read from shared memory where they are used rather than held in registers across
        the two products (fewer live registers, a shared-memory read on the critical path)."""
        s = cnt % NUM_BUF
        mbarrier.wait(q_ready.index(s), (cnt // NUM_BUF) & 1)
        if not LATE_STATS:
            lse2 = stat_bufs.index(2 * s).load(col_s)
            delta = stat_bufs.index(2 * s + 1).load(col_s)
        q = q_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
        do = do_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
        st = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[st])  # P^T's exponentials run under dP^T's product
        if LATE_STATS:
            lse2 = stat_bufs.index(2 * s).load(col_s)
        pt = gl.exp2(st * scale_log2 - lse2[None, :])
        if CAUSAL:
            if start_m < full:
                cols_m = start_m + gl.arange(0, BLOCK_M, layout=col_s)
                pt = gl.where(rows_n[:, None] <= cols_m[None, :] + (TK - TQ), pt, 0.0)
        dpt = warpgroup_mma_wait(0, deps=[dpt])
        if LATE_STATS:
            delta = stat_bufs.index(2 * s + 1).load(col_s)
        return s, q, do, pt, pt * (dpt - delta[None, :])

    @gluon.jit
    def _bwd_consumer(WG: gl.constexpr, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, kv_empty, q_ready, q_empty,
                      stat_bufs, DK, DV, stride_dkb, stride_dkt, stride_dkh, stride_dvb,
                      stride_dvt, stride_dvh, B, NKV, GROUP, TQ, TK, SCHED, scale_log2, scale,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
                      CAUSAL: gl.constexpr, WARPS: gl.constexpr, KV_BUF: gl.constexpr, SUM_DQ: gl.constexpr,
                      DS_BUF: gl.constexpr, ds_bufs, dq_bufs, ds_ready, ds_empty, dq_desc, D: gl.constexpr = 0):
        """dk and dv of the key rows WG * BLOCK_N / 2 .. of each tile: per query block, S^T = K Q^T and dP^T = V dO^T,
        P^T from the saved lse, dS^T = P^T (dP^T - delta), then dV += P^T dO and dK += dS^T Q.

        SUM_DQ (the single pass): also a share of dq. This warpgroup's dS^T rows go into the tile's shared dS^T
        (DS_BUF slots of ``ds_bufs``, handed over by ``ds_ready`` / ``ds_empty``), and once both warpgroups' are there,
        dQ[:, WG * HEAD_DIM / 2 ..] = dS K over the whole key block (one (BLOCK_M, HEAD_DIM / 2) wgmma), scaled, goes
        into this warpgroup's fp32 slot of ``dq_bufs`` and is added into ``dq_desc``'s tensor by a TMA reduce, which
        runs under the next query block's work."""
        ROWS: gl.constexpr = BLOCK_N // 2
        DQ_N: gl.constexpr = HEAD_DIM // 2
        layouts: gl.constexpr = _wgmma_layouts(WARPS, BLOCK_M, HEAD_DIM)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        a_layout: gl.constexpr = layouts[2]
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = q_bufs.dtype
        # lse and delta out of registers where registers are tightest: 128-row query blocks and the single pass at
        # 128-column tiles (in registers these spill; timed faster, docs/tuning.md); elsewhere in registers (faster)
        LATE_STATS: gl.constexpr = BLOCK_M == 128 or (SUM_DQ and HEAD_DIM == 128)
        num_n = gl.cdiv(TK, BLOCK_N)
        cnt = 0
        i = 0
        s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=s_layout)
        if SUM_DQ:
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                                instr_shape=[16, DQ_N, 16])
            dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
            dq_slot = dq_bufs.index(WG)
        lo, hi, step = _span(SCHED, num_n * B * NKV)
        t = _tile_at(SCHED, lo)
        for idx in range(lo, hi, step):
            b, hk, start_n = _tile(t, NKV, num_n, BLOCK_N)
            t = _tile_at(SCHED, gl.minimum(idx + step, hi - 1))  # the next tile, read ahead
            my_n = start_n + WG * ROWS
            kvs = i % KV_BUF
            mbarrier.wait(kv_ready.index(kvs), (i // KV_BUF) & 1)
            k = k_bufs.index(kvs).reshape([BLOCK_N, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
            v = v_bufs.index(kvs).reshape([BLOCK_N, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
            if SUM_DQ:
                k_dq = k_bufs.index(kvs).reshape([BLOCK_N, HEAD_DIM]).slice(WG * DQ_N, DQ_N, dim=1)
            dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            lo, n, full = _query_range(start_n, TQ, TK, BLOCK_M, BLOCK_N, CAUSAL)
            rows_n = my_n + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            bb = b.to(gl.int64)
            for g in range(GROUP):
                h = hk * GROUP + g
                for mi in range(n):
                    start_m = lo + mi * BLOCK_M
                    s, q, do, pt, dst = _key_rows_probs(k, v, q_bufs, do_bufs, q_ready, stat_bufs, cnt, start_m,
                                                        full, rows_n, s_zero, TQ, TK, scale_log2, HEAD_DIM, BLOCK_M,
                                                        NUM_BUF, CAUSAL, col_s, LATE_STATS)
                    if SUM_DQ:  # each pass keeps the order of the casts it was measured with
                        dst = dst.to(dtype)
                        pt_op = gl.convert_layout(pt.to(dtype), a_layout)
                    else:
                        pt_op = gl.convert_layout(pt.to(dtype), a_layout)
                        dst = dst.to(dtype)
                    dst_op = gl.convert_layout(dst, a_layout)
                    dv = warpgroup_mma(pt_op, do, dv, is_async=True)
                    dk = warpgroup_mma(dst_op, q, dk, is_async=True)
                    if SUM_DQ:
                        # this warpgroup's rows of dS^T into the shared tile while dv's and dk's products run; dq's
                        # product waits for the other warpgroup's rows
                        ds_s = cnt % DS_BUF
                        ds_ph = (cnt // DS_BUF) & 1
                        mbarrier.wait(ds_empty.index(ds_s), ds_ph ^ 1)
                        ds_tile = ds_bufs.index(ds_s)
                        ds_tile.slice(WG * ROWS, ROWS, dim=0).store(dst)
                        fence_async_shared()
                        mbarrier.arrive(ds_ready.index(ds_s), count=1)
                        mbarrier.wait(ds_ready.index(ds_s), ds_ph)
                        dq = warpgroup_mma(ds_tile.permute((1, 0)), k_dq, dq_zero, use_acc=False, is_async=True)
                        dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(0, deps=[dv, dk, dq, pt_op, dst_op])
                        mbarrier.arrive(q_empty.index(s), count=1)
                        mbarrier.arrive(ds_empty.index(ds_s), count=1)
                        tma.store_wait(0)  # the previous block's reduce has read the slot
                        dq_slot.reshape([BLOCK_M, DQ_N]).store(dq * scale)
                        fence_async_shared()
                        _tma_reduce_add(dq_desc, [b, start_m, h, WG * DQ_N], dq_slot)
                    else:
                        dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=[dv, dk, pt_op, dst_op])
                        mbarrier.arrive(q_empty.index(s), count=1)
                    cnt += 1
            mbarrier.arrive(kv_empty.index(kvs), count=1)
            i += 1
            hh = hk.to(gl.int64)
            _store_rows(DK + bb * stride_dkb + hh * stride_dkh, stride_dkt, (dk * scale).to(dtype), my_n, TK, ROWS,
                        HEAD_DIM, WARPS, D)
            _store_rows(DV + bb * stride_dvb + hh * stride_dvh, stride_dvt, dv.to(dtype), my_n, TK, ROWS, HEAD_DIM,
                        WARPS, D)
        if SUM_DQ:
            tma.store_wait(0)

    @gluon.jit
    def _attn_bwd_dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, DK, DV, stride_lb, stride_lh,
                                 stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                                 B, NKV, GROUP, TQ, TK, SCHED, scale_log2, scale,
                                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                 NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr, KV_BUF: gl.constexpr,
                                 SUM_DQ: gl.constexpr, DS_BUF: gl.constexpr, num_warps: gl.constexpr,
                                 D: gl.constexpr = 0):
        """dk and dv: two consumer warpgroups of num_warps warps, half the key block each, and a producer warp moving
        k and v (KV_BUF slots: 2, the next tile's load under this one's work) and a ring of NUM_BUF q / dO slots.
        Without SUM_DQ, the deterministic backward's second pass (delta comes from the dq pass). SUM_DQ: the
        single-pass backward, FlashAttention-3's structure: dq also added into the fp32 tensor of ``dq_desc``
        (zeros beforehand; delta made beforehand) by TMA reduces of (BLOCK_M, HEAD_DIM / 2) tiles, one a warpgroup and
        query block, the two warpgroups sharing each query block's dS^T through DS_BUF slots of shared memory."""
        dtype: gl.constexpr = q_desc.dtype
        k_bufs = gl.allocate_shared_memory(dtype, [KV_BUF] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [KV_BUF] + v_desc.block_type.shape, v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF] + do_desc.block_type.shape, do_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [KV_BUF, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [KV_BUF, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(KV_BUF):
            mbarrier.init(kv_ready.index(s), count=1)
            mbarrier.init(kv_empty.index(s), count=2)
        for s in gl.static_range(NUM_BUF):
            mbarrier.init(q_ready.index(s), count=2)  # the TMA bytes' expect and the producer's stats
            mbarrier.init(q_empty.index(s), count=2)
        # each q / dO slot's rows' base-2 lse (row 2 s) and delta (row 2 s + 1), put there by the producer
        stat_bufs = gl.allocate_shared_memory(gl.float32, [2 * NUM_BUF, BLOCK_M],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        # without SUM_DQ the consumers never touch these: stand-ins, as warp_specialize takes values only
        ds_bufs = q_bufs
        dq_bufs = q_bufs
        ds_ready = q_ready
        ds_empty = q_empty
        if SUM_DQ:
            gl.static_assert(BLOCK_M == 64 or BLOCK_M == 128, "a query block is one or two wgmma rows of 64")
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
            ds_bufs = gl.allocate_shared_memory(dtype, [DS_BUF, BLOCK_N, BLOCK_M], ds_layout)
            dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
            ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUF, 1], mbarrier.MBarrierLayout())
            ds_empty = gl.allocate_shared_memory(gl.int64, [DS_BUF, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(DS_BUF):
                mbarrier.init(ds_ready.index(s), count=2)
                mbarrier.init(ds_empty.index(s), count=2)
        fence_async_shared()
        gl.warp_specialize([
            (_bwd_consumer, (0, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, kv_empty, q_ready, q_empty, stat_bufs,
                             DK, DV, stride_dkb, stride_dkt, stride_dkh, stride_dvb,
                             stride_dvt, stride_dvh, B, NKV, GROUP, TQ, TK, SCHED, scale_log2, scale, HEAD_DIM,
                             BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, num_warps, KV_BUF, SUM_DQ, DS_BUF, ds_bufs, dq_bufs,
                             ds_ready, ds_empty, dq_desc, D)),
            (_bwd_consumer, (1, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, kv_empty, q_ready, q_empty, stat_bufs,
                             DK, DV, stride_dkb, stride_dkt, stride_dkh, stride_dvb,
                             stride_dvt, stride_dvh, B, NKV, GROUP, TQ, TK, SCHED, scale_log2, scale, HEAD_DIM,
                             BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, num_warps, KV_BUF, SUM_DQ, DS_BUF, ds_bufs, dq_bufs,
                             ds_ready, ds_empty, dq_desc, D)),
            (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, kv_empty,
                             q_ready, q_empty, B, NKV, GROUP, TQ, TK, SCHED, LSE, DELTA, stride_lb, stride_lh,
                             stat_bufs, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, KV_BUF)),
        ], [num_warps, 1], [240, 24])

    # ---- backward: dq (and delta) -------------------------------------------------------------------------------
    @gluon.jit
    def _probs(sc, j, first_masked, rows, lse2, TQ, TK, scale_log2, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               s_layout: gl.constexpr):
        """P of key block j from the scores and the rows' saved base-2 lse (+inf where a row sees no key or lies past
        the end), 0 past the keys' end and above the causal diagonal."""
        p = gl.exp2(sc * scale_log2 - lse2[:, None])
        if j >= first_masked:
            p = gl.where(_seen(rows, j, TQ, TK, BLOCK_N, CAUSAL, s_layout), p, 0.0)
        return p

    @gluon.jit
    def _delta(o, do, DELTA_H, rows_o, TQ, o_layout: gl.constexpr, row_s: gl.constexpr):
        """delta = rowsum(dO * O) of a tile's rows (O in registers, dO in shared memory), stored for the dk/dv pass;
        returned in the layout of the score rows."""
        delta = gl.sum(o.to(gl.float32) * do.load(o_layout).to(gl.float32), 1)
        gl.store(DELTA_H + rows_o, delta, mask=rows_o < TQ)
        return gl.convert_layout(delta, row_s)

    @gluon.jit
    def _kv_slot(cnt, k_bufs, v_bufs, k_ready, v_ready, NUM_BUF: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr):
        """(ring slot, k, v) of the cnt-th key block a consumer takes, once both have landed."""
        s = cnt % NUM_BUF
        ph = (cnt // NUM_BUF) & 1
        mbarrier.wait(k_ready.index(s), ph)
        k = k_bufs.index(s).reshape([BLOCK_N, HEAD_DIM])
        mbarrier.wait(v_ready.index(s), ph)
        return s, k, v_bufs.index(s).reshape([BLOCK_N, HEAD_DIM])

    @gluon.jit
    def _dq_consumer(WG: gl.constexpr, PINGPONG: gl.constexpr, turn, q_bufs, do_bufs, k_bufs, v_bufs, q_ready,
                     q_empty, k_ready, k_empty, v_ready, v_empty, O, LSE, DELTA, DQ, stride_ob, stride_ot, stride_oh,
                     stride_lb, stride_lh, stride_dqb, stride_dqt, stride_dqh, B, NH, TQ, TK, SCHED, scale_log2, scale,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
                     CAUSAL: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr, D: gl.constexpr = 0):
        """dq of the query rows WG * ROWS .. + ROWS - 1 of each tile, and their delta = rowsum(dO * O) (stored for
        the dk/dv pass): per key block, S = Q K^T and dP = dO V^T, P from the saved lse, dS = P (dP - delta),
        dQ += dS K. Block j's P is computed while its dP is still on the tensor cores; its dS K runs while the next
        block's S and dP are issued. PINGPONG: the two warpgroups take turns issuing their matmuls, as in the
        forward."""
        layouts: gl.constexpr = _wgmma_layouts(WARPS, BLOCK_N, HEAD_DIM)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        a_layout: gl.constexpr = layouts[2]
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_bufs.dtype
        num_m = gl.cdiv(TQ, BLOCK_M)
        cnt = 0
        i = 0
        slot = 0
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        lo, hi, step = _span(SCHED, num_m * B * NH)
        t = _tile_at(SCHED, lo)
        for idx in range(lo, hi, step):
            b, h, start_m = _tile(t, NH, num_m, BLOCK_M)
            t = _tile_at(SCHED, gl.minimum(idx + step, hi - 1))  # the next tile, read ahead
            my_m = start_m + WG * ROWS
            n, first_masked = _key_range(start_m, TQ, TK, BLOCK_M, BLOCK_N, CAUSAL)
            bb = b.to(gl.int64)
            hh = h.to(gl.int64)
            rows_o = my_m + gl.arange(0, ROWS, layout=row_o)
            r64 = rows_o.to(gl.int64)[:, None]
            # this tile's O rows and lse: loads issued first, used once the first block's matmuls run
            o_mask = (rows_o < TQ)[:, None]
            if D > 0:  # the tile's columns past the head dim: 0, as TMA fills dO's
                o_mask = o_mask & (cols_o < D)[None, :]
            o = gl.load(O + bb * stride_ob + hh * stride_oh + r64 * stride_ot + cols_o[None, :], mask=o_mask,
                        other=0.0)
            rows = my_m + gl.arange(0, ROWS, layout=row_s)
            lse = gl.load(LSE + bb * stride_lb + hh * stride_lh + rows, mask=rows < TQ, other=float("-inf"))
            qs = i % 2
            mbarrier.wait(q_ready.index(qs), (i // 2) & 1)
            q = q_bufs.index(qs).reshape([BLOCK_M, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
            do = do_bufs.index(qs).reshape([BLOCK_M, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
            stats = bb * stride_lb + hh * stride_lh
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            if n > 0:
                # block 0: S and dP issued, delta while they run, then P, then dS
                s, k, v = _kv_slot(cnt, k_bufs, v_bufs, k_ready, v_ready, NUM_BUF, BLOCK_N, HEAD_DIM)
                slot = _turn_wait(turn, slot, WG, PINGPONG)
                sc = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                _turn_pass(turn, WG, PINGPONG)
                delta = _delta(o, do, DELTA + stats, rows_o, TQ, o_layout, row_s)
                sc = warpgroup_mma_wait(1, deps=[sc])
                p = _probs(sc, 0, first_masked, rows, lse2, TQ, TK, scale_log2, BLOCK_N, CAUSAL, s_layout)
                dp = warpgroup_mma_wait(0, deps=[dp])
                mbarrier.arrive(v_empty.index(s), count=1)
                ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), a_layout)
                prev = s
                cnt += 1
                for j in range(1, n):
                    # issued in this order: block j's S, block j-1's dS K, block j's dP; block j's P is computed
                    # while the other two run
                    s, k, v = _kv_slot(cnt, k_bufs, v_bufs, k_ready, v_ready, NUM_BUF, BLOCK_N, HEAD_DIM)
                    slot = _turn_wait(turn, slot, WG, PINGPONG)
                    sc = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    dq = warpgroup_mma(ds_op, k_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
                    dp = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    _turn_pass(turn, WG, PINGPONG)
                    sc = warpgroup_mma_wait(2, deps=[sc])
                    p = _probs(sc, j, first_masked, rows, lse2, TQ, TK, scale_log2, BLOCK_N, CAUSAL, s_layout)
                    dq, ds_op, dp = warpgroup_mma_wait(0, deps=[dq, ds_op, dp])
                    mbarrier.arrive(k_empty.index(prev), count=1)
                    mbarrier.arrive(v_empty.index(s), count=1)
                    ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), a_layout)
                    prev = s
                    cnt += 1
                slot = _turn_wait(turn, slot, WG, PINGPONG)
                dq = warpgroup_mma(ds_op, k_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
                _turn_pass(turn, WG, PINGPONG)
                dq, ds_op = warpgroup_mma_wait(0, deps=[dq, ds_op])
                mbarrier.arrive(k_empty.index(prev), count=1)
            else:  # rows that see no key: delta all the same (the dk/dv pass reads it)
                _delta(o, do, DELTA + stats, rows_o, TQ, o_layout, row_s)
            mbarrier.arrive(q_empty.index(qs), count=1)
            i += 1
            # in the accumulator's layout: the 16-byte store's layout conversion needs 16 KiB of shared memory more,
            # which head dim 128 lacks here
            gl.store(DQ + bb * stride_dqb + hh * stride_dqh + r64 * stride_dqt + cols_o[None, :],
                     (dq * scale).to(dtype), mask=o_mask)

    # TQ not specialized: with TQ = TK = 1 both constants, Triton 3.6 fails to lower the kernel (an LLVM assertion)
    @gluon.jit(do_not_specialize=["TQ"])
    def _attn_bwd_dq_ws_kernel(q_desc, k_desc, v_desc, do_desc, O, LSE, DELTA, DQ, stride_ob, stride_ot, stride_oh,
                               stride_lb, stride_lh, stride_dqb, stride_dqt, stride_dqh,
                               B, NH, GROUP, TQ, TK, SCHED, scale_log2, scale,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                               num_warps: gl.constexpr, D: gl.constexpr = 0):
        """dq and delta (the deterministic backward's first pass): two consumer warpgroups of num_warps warps, half
        the query tile each (taking turns on the tensor cores with PINGPONG), and the forward's producer warp, which
        loads dO beside q."""
        rings = _query_tile_rings(q_desc, k_desc, v_desc, NUM_BUF, 2, do_desc, True)
        q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, do_bufs = rings
        gl.warp_specialize([
            (_dq_consumer, (0, PINGPONG, turn, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                            k_empty, v_ready, v_empty, O, LSE, DELTA, DQ, stride_ob, stride_ot, stride_oh, stride_lb,
                            stride_lh, stride_dqb, stride_dqt, stride_dqh, B, NH, TQ, TK, SCHED, scale_log2, scale,
                            HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, BLOCK_M // 2, num_warps, D)),
            (_dq_consumer, (1, PINGPONG, turn, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                            k_empty, v_ready, v_empty, O, LSE, DELTA, DQ, stride_ob, stride_ot, stride_oh, stride_lb,
                            stride_lh, stride_dqb, stride_dqt, stride_dqh, B, NH, TQ, TK, SCHED, scale_log2, scale,
                            HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, BLOCK_M // 2, num_warps, D)),
            (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, B, NH, GROUP, TQ, TK, SCHED, BLOCK_M, BLOCK_N, NUM_BUF, CAUSAL, do_desc,
                         do_bufs, True)),
        ], [num_warps, 1], [240, 24])


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    block = [1, rows, 1, cols]
    return block, gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GL_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None):
    """The 4-D (B, T, heads, hs) TMA descriptor of (1, rows, 1, cols) tiles, cols = hs by default (rows past T read
    as zeros; a reduce into them is dropped)."""
    block, layout = _smem_layout(rows, cols or t.shape[-1], t.dtype)
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


# ---- tile schedules --------------------------------------------------------------------------------------------
# Which tiles each persistent program takes, in an order that keeps the k / v (dq and forward) or q / dO (dk / dv)
# a tile streams in L2 while the other tiles of its head stream the same rows: heads in groups of about
# L2_GROUP_BYTES of those rows, and inside a group, block by block, the longest first. Tiles of equal length (no
# causal mask, or one query block) need no table: program p takes tiles p, p + grid, ... of the head-major order.
# Causal tiles go to programs greedily (the least loaded program takes the next tile, a tile's cost being its
# blocks plus TILE_OVERHEAD), which balances the programs' work and leaves the shortest tiles for last.
L2_GROUP_BYTES = 4 << 20  # groups of 2 or 8 heads instead: within 1-5% (docs/tuning.md, attention, Gluon)
TILE_OVERHEAD = 1
_SCHEDULES: dict = {}  # (device, shape, group) -> table or None
_CAPTURED: dict = {}  # id -> the tables CUDA graphs hold
_MISSING = object()
_SCHEDULES_MAX = 256


@functools.lru_cache(maxsize=1024)
def tile_lengths(keys: bool, tq: int, tk: int, block_m: int, block_n: int, causal: bool) -> tuple[int, ...]:
    """Blocks each tile of one head visits: key blocks per query tile (the forward and dq pass, _key_range), or with
    ``keys`` query blocks per key tile (the dk / dv pass, _query_range)."""
    out = []
    if keys:
        for start_n in range(0, tk, block_n):
            lo = max(start_n - (tk - tq), 0) // block_m * block_m if causal else 0
            out.append(-(-max(tq - lo, 0) // block_m))
    else:
        for start_m in range(0, tq, block_m):
            hi = min(tk, start_m + block_m + tk - tq) if causal else tk
            out.append(-(-max(hi, 0) // block_n))
    return tuple(out)


def schedule_lists(n_heads: int, lengths: tuple[int, ...], grid: int, heads_per_group: int) -> list[list[int]]:
    """Each program's tiles, in order: tile (head * len(lengths) + block) of length lengths[block] (blocks), for
    ``n_heads`` heads (batch * heads) over ``grid`` programs, heads in groups of ``heads_per_group``."""
    import heapq

    by_length = sorted(range(len(lengths)), key=lambda blk: -lengths[blk])
    n = len(lengths)
    lists = [[] for _ in range(grid)]
    loads = [(0, p) for p in range(grid)]
    # the last group takes enough heads for two tiles a program: longest first over those, so the work ends evenly
    last = max(0, n_heads - max(heads_per_group, -(-2 * grid // n)))
    starts = [*range(0, last, heads_per_group), last]
    for first, end in zip(starts, starts[1:] + [n_heads]):
        heads = range(first, end)
        for blk in by_length:
            cost = lengths[blk] + TILE_OVERHEAD
            for head in heads:
                load, p = heapq.heappop(loads)
                lists[p].append(head * n + blk)
                heapq.heappush(loads, (load + cost, p))
    return lists


def _schedule(device: torch.device, n_heads: int, lengths: tuple[int, ...], grid: int, row_bytes: int,
              heads: int | None):
    """The SCHED argument of a launch: None where the tiles have equal length, else the int32 table (cached per
    device and shape): grid + 1 offsets, then each program's tiles (schedule_lists), then one pad. ``row_bytes``:
    bytes of the rows a tile streams, per head (sizes the head groups); ``heads`` overrides the group size.
    While a CUDA graph is captured, a table made before stays alive for good (the graph replays its address), and a
    shape with none yet takes None (the head-major walk: the same results, the work less evenly spread), as a copy to
    the GPU cannot be made then."""
    group = heads or max(1, L2_GROUP_BYTES // max(row_bytes, 1))
    key = (device.index, n_heads, lengths, grid, group, heads is None)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    entry = _SCHEDULES.get(key, _MISSING)
    if entry is _MISSING:
        if capturing:
            return None
        if heads is None and min(lengths) == max(lengths):
            entry = None
        else:
            lists = schedule_lists(n_heads, lengths, grid, group)
            offsets = [0]
            for tiles in lists:
                offsets.append(offsets[-1] + len(tiles))
            entry = torch.tensor(offsets + [t for tiles in lists for t in tiles] + [0], dtype=torch.int32,
                                 device=device)
        while len(_SCHEDULES) >= _SCHEDULES_MAX:
            _SCHEDULES.pop(next(iter(_SCHEDULES)))
        _SCHEDULES[key] = entry
    if capturing and entry is not None:
        _CAPTURED[id(entry)] = entry
    return entry


def supported(q, k, v, causal, window, cu_seqlens, others=()) -> bool:
    """These kernels can take the call: Gluon present, an sm_90 GPU, fixed-length fp16 / bf16 batches with head dim
    in HEAD_DIMS, no window (``window`` as megakern.attention._window gives it: (-1, -1), or (-1, 0) under causal); q, k,
    v and ``others`` (the backward's dout, out and gradients) tensors TMA can address (16-byte aligned base and
    strides, unit stride along hs)."""
    left, right = window
    if not AVAILABLE or not q.is_cuda or cu_seqlens is not None or left >= 0 or (right >= 0 and not causal):
        return False
    if q.shape[-1] not in HEAD_DIMS or q.dtype not in (torch.float16, torch.bfloat16) or not _is_sm90(q.device.index):
        return False
    tensors = (q, k, v, *others)
    return all(t.stride(-1) == 1 for t in tensors) and tma_aligned(tensors)


# (BLOCK_M query rows per step, BLOCK_N key rows per tile, warps per consumer, q / dO ring slots) per head dim
BWD_CONFIGS = {64: (128, 128, 4, 2), 128: (64, 128, 4, 2)}
# The single-pass backward (bwd_single: dq added by TMA reduces in the dk/dv pass): the head dims it takes
ATOMIC_HEAD_DIMS = (64, 96, 128)
# bwd_single's (BLOCK_M query rows per step, BLOCK_N key rows per tile, warps per consumer, q / dO ring slots, k / v
# slots, dS^T slots) per tile width (``block_d``): 128 columns have the shared memory for one k / v slot only (213 KiB)
SINGLE_CONFIGS = {64: (64, 128, 4, 3, 2, 2), 128: (64, 128, 4, 2, 1, 2)}


def bwd_single(dout, q, k, v, lse, delta, dk, dv, dq_acc, causal: bool, scale: float, config=None, heads=None,
               programs=None):
    """The single-pass backward: dk and dv into ``dk`` / ``dv`` as ``bwd_dkdv`` writes them, and dq * scale added
    into ``dq_acc`` (fp32, shaped like q, zeros beforehand, 16-byte aligned strides) by TMA reduces, given lse and
    delta = rowsum(dO * O). ``config``: a SINGLE_CONFIGS entry; ``heads``, ``programs``: as for ``fwd``."""
    hs = q.shape[-1]
    if hs not in ATOMIC_HEAD_DIMS:
        raise ValueError(f"attention: the Gluon single-pass backward takes head dims {ATOMIC_HEAD_DIMS}, not {hs}")
    block_m, block_n, warps, bufs, kv_bufs, ds_bufs = config or SINGLE_CONFIGS[block_d(hs)]
    if not TMA_REDUCE:
        raise ValueError("attention: the Gluon single-pass backward adds dq by TMA reduces, which this Triton lacks")
    if block_m not in (64, 128) or block_n != 128:
        raise ValueError(f"attention: the Gluon single-pass backward takes (64, 128) or (128, 128) tiles, not "
                         f"{(block_m, block_n)}")
    if (dq_acc.shape != q.shape or dq_acc.dtype != torch.float32 or dq_acc.stride(-1) != 1
            or not tma_aligned((dq_acc,))):
        raise ValueError("attention: dq_acc must be an fp32 tensor shaped like q with unit stride along hs and "
                         "16-byte aligned strides")
    return _launch_dkdv(dout, q, k, v, lse, delta, dk, dv, causal, scale, (block_m, block_n, warps, bufs), heads,
                        programs, kv_bufs, ds_bufs, dq_acc)


def bwd_dkdv(dout, q, k, v, lse, delta, dk, dv, causal: bool, scale: float, config=None, heads=None, programs=None,
             dq_acc=None):
    """dk and dv into ``dk`` / ``dv`` (shaped like k / v, unit stride along hs) for what ``supported`` accepts,
    given the saved lse and delta = rowsum(dO * O) (B, nh, Tq) fp32 (the dq pass makes delta). ``dq_acc``: the
    single-pass backward (``bwd_single``, ``config`` then a SINGLE_CONFIGS entry), dq added into this fp32 tensor
    shaped like q (zeros beforehand). ``heads``, ``programs``: as for ``fwd``."""
    if dq_acc is not None:
        return bwd_single(dout, q, k, v, lse, delta, dk, dv, dq_acc, causal, scale, config, heads, programs)
    return _launch_dkdv(dout, q, k, v, lse, delta, dk, dv, causal, scale, config or BWD_CONFIGS[block_d(q.shape[-1])],
                        heads, programs)


def _launch_dkdv(dout, q, k, v, lse, delta, dk, dv, causal, scale, tiles, heads, programs, kv_bufs=2, ds_bufs=1,
                 dq_acc=None):
    """The dk/dv kernel over q's batch: ``tiles`` (BLOCK_M, BLOCK_N, warps per consumer, q / dO slots); with
    ``dq_acc`` the single pass (SUM_DQ)."""
    batch, tq, nh, hs = q.shape
    tk, nkv = k.shape[1], k.shape[2]
    block_m, block_n, warps, bufs = tiles
    width = block_d(hs)
    lengths = tile_lengths(True, tq, tk, block_m, block_n, causal)
    grid = min(batch * nkv * len(lengths), programs or sm_count(q.device.index))
    sched = _schedule(q.device, batch * nkv, lengths, grid, 2 * tq * hs * q.element_size() * (nh // nkv), heads)
    _attn_bwd_dkdv_ws_kernel[(grid,)](
        _descriptor(q, block_m, width), _descriptor(k, block_n, width), _descriptor(v, block_n, width),
        _descriptor(dout, block_m, width), None if dq_acc is None else _descriptor(dq_acc, block_m, width // 2),
        lse, delta, dk, dv,
        lse.stride(0), lse.stride(1), dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1),
        dv.stride(2), batch, nkv, nh // nkv, tq, tk, sched, scale * LOG2E, scale,
        HEAD_DIM=width, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=bufs, CAUSAL=causal, KV_BUF=kv_bufs,
        SUM_DQ=dq_acc is not None, DS_BUF=ds_bufs, num_warps=warps, D=0 if hs == width else hs,
    )
    return dk, dv


# (BLOCK_M query rows per tile, BLOCK_N key rows per step, warps per consumer, k / v ring slots, ping-pong) per
# head dim
DQ_CONFIGS = {64: (128, 64, 4, 4, False), 128: (128, 64, 4, 3, False)}


def bwd_dq(dout, q, k, v, out, lse, delta, dq, causal: bool, scale: float, config=None, heads=None, programs=None):
    """dq into ``dq`` (shaped like q, unit stride along hs) and delta = rowsum(dO * O) into ``delta`` (like lse),
    for what ``supported`` accepts, given the forward's out and lse. ``heads``, ``programs``: as for
    ``fwd``."""
    batch, tq, nh, hs = q.shape
    tk, nkv = k.shape[1], k.shape[2]
    width = block_d(hs)
    block_m, block_n, warps, bufs, pingpong = config or DQ_CONFIGS[width]
    lengths = tile_lengths(False, tq, tk, block_m, block_n, causal)
    grid = min(batch * nh * len(lengths), programs or sm_count(q.device.index))
    sched = _schedule(q.device, batch * nh, lengths, grid, 2 * tk * hs * k.element_size(), heads)
    _attn_bwd_dq_ws_kernel[(grid,)](
        _descriptor(q, block_m, width), _descriptor(k, block_n, width), _descriptor(v, block_n, width),
        _descriptor(dout, block_m, width),
        out, lse, delta, dq, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        dq.stride(0), dq.stride(1), dq.stride(2), batch, nh, nh // nkv, tq, tk, sched,
        scale * LOG2E, scale,
        HEAD_DIM=width, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=bufs, CAUSAL=causal, PINGPONG=pingpong,
        num_warps=warps, D=0 if hs == width else hs,
    )
    return dq, delta


def fwd(q, k, v, causal: bool, scale: float, config=None, heads=None, programs=None, own_ranges: bool | None = None,
        o_tma: bool = True, turns: bool | None = None):
    """(out, lse) for fixed-length (B, T, heads, hs) q, k, v that ``supported`` accepts. ``heads`` (heads per group
    of the tile schedule, see _schedule) and ``programs`` (at most this many persistent programs instead of one per
    SM) are for tests and tuning; any value gives the same results. ``own_ranges`` (tiles of three consumer
    warpgroups): each warpgroup computes only the key blocks its own rows see; None: with causal masks (the faster
    one there; without one every warpgroup sees every block). ``o_tma``: the output by TMA stores (_consumer's
    O_TMA), measured level or ahead of the 16-byte stores at every length (docs/tuning.md); False: those stores.
    ``turns``: the ping-pong warpgroups take turns on the tensor cores (_consumer's TURNS); None: as
    ``default_turns`` says."""
    batch, tq, nh, hs = q.shape
    tk, nkv = k.shape[1], k.shape[2]
    config = config or default_config(hs, causal, tq)
    block_m, block_n, warps, bufs, pingpong = config
    if turns is None:
        turns = default_turns(hs, config)
    if own_ranges is None:
        own_ranges = causal and pingpong and block_m == 192
    if pingpong and (block_m not in (128, 192) or warps != 4 or (block_m == 192 and hs != 64)):
        raise ValueError(f"attention: the Gluon forward's ping-pong takes 4-warp consumers of 64 rows, two (BLOCK_M "
                         f"128) or, at head dim 64, three (192); not BLOCK_M {block_m} with {warps} warps at head dim "
                         f"{hs}")
    if own_ranges and not (pingpong and block_m == 192):
        raise ValueError("attention: own_ranges takes the Gluon forward's three consumer warpgroups (BLOCK_M 192)")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nh, tq), dtype=torch.float32, device=q.device)
    if batch == 0 or tq == 0:
        return out, lse
    if tk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    lengths = tile_lengths(False, tq, tk, block_m, block_n, causal)
    grid = min(batch * nh * len(lengths), programs or sm_count(q.device.index))
    sched = _schedule(q.device, batch * nh, lengths, grid, 2 * tk * hs * k.element_size(), heads)
    width = block_d(hs)
    _attn_fwd_ws_kernel[(grid,)](
        _descriptor(q, 64 if block_m == 192 else block_m, width), _descriptor(k, block_n, width),
        _descriptor(v, block_n, width), out, lse,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        batch, nh, nh // nkv, tq, tk, sched, scale * LOG2E,
        HEAD_DIM=width, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=bufs, CAUSAL=causal, PINGPONG=pingpong,
        num_warps=warps, OWN_RANGES=own_ranges, D=0 if hs == width else hs,
        o_desc=_descriptor(out, 64 if pingpong else block_m, width) if o_tma else None, O_TMA=o_tma,
        TURNS=turns,
    )
    return out, lse
