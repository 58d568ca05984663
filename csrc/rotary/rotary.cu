// Rotary position embeddings (RoPE) for q and k in one launch, forward and backward.
//
// A token at position m, pair i < rotary_dim / 2 of a head, (c, s) = (cos, sin)[m, i]:
//   y_a = x_a * c - x_b * s,   y_b = x_b * c + x_a * s
// a = i, b = i + rotary_dim / 2 (GPT-NeoX halves), or a = 2i, b = 2i + 1 (GPT-J, INTERLEAVED). The backward is
// the inverse rotation (ROTARY_CONJ: s -> -s). Features rotary_dim .. head_dim are copied (ROTARY_COPY_REST, out
// of place) or left alone (in place).
//
// Work split. A block takes `tokens_per_block` consecutive tokens of the flattened (B, T). Its threads first
// resolve each token's (b, t, position) into shared memory: the token index, an explicit position id, or the
// offset inside its document (a binary search of cu_seqlens), plus any offset. Then they stride over the block's
// items (token, head, group), group fastest, q's heads before k's, so a warp covers contiguous runs of rows.
// A group is two chunks of VEC = 16 / sizeof(T) elements:
//   rotary group g (pairs g*VEC .. g*VEC + VEC - 1): NeoX chunk a from the first half, chunk b from the second;
//   GPT-J the 2 VEC consecutive elements holding those pairs; the (cos, sin) chunk is VEC entries of row m;
//   pass-through group: 2 VEC elements past rotary_dim, copied.
// Each thread issues the loads of ITEMS groups before any math, so several 16-byte loads are in flight.
//
// All math in fp32. Kernel names are referenced by megakern/_rotary_cuda.py for the NVRTC path
// ("megakern::rotary_kernel<__nv_bfloat16, float, false, true, 2>").
#include "common/common.h"
#include "rotary/rotary.h"

namespace megakern {

template <typename T, typename TC, bool INTERLEAVED, bool VECIO, int ITEMS>
__global__ void __launch_bounds__(ROTARY_MAX_THREADS)
rotary_kernel(const T* q, const T* k, T* q_out, T* k_out, const TC* __restrict__ cos, const TC* __restrict__ sin,
              const void* __restrict__ pos_ids, const int* __restrict__ cu_seqlens, const void* __restrict__ offsets,
              i64 tokens, i64 seqlen, int nh, int nkv, int head_dim, int rot_half, int tokens_per_block,
              i64 stride_qb, i64 stride_qt, i64 stride_qh, i64 stride_kb, i64 stride_kt, i64 stride_kh,
              i64 stride_qob, i64 stride_qot, i64 stride_qoh, i64 stride_kob, i64 stride_kot, i64 stride_koh,
              i64 stride_cos, i64 stride_sin, i64 stride_pb, i64 stride_pt, int ndocs, i64 offset, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ int s_b[ROTARY_MAX_TOKENS], s_t[ROTARY_MAX_TOKENS], s_pos[ROTARY_MAX_TOKENS];
  const i64 first = (i64)blockIdx.x * tokens_per_block;
  const int ntok = (int)min((i64)tokens_per_block, tokens - first);

  // Each token's (b, t) and position, once per block.
  for (int i = threadIdx.x; i < ntok; i += blockDim.x) {
    const i64 tok = first + i, b = tok / seqlen, t = tok - b * seqlen;
    i64 pos = t, seq = b;
    if (flags & ROTARY_POS_IDS) {
      const i64 at = b * stride_pb + t * stride_pt;
      pos = (flags & ROTARY_POS_I64) ? static_cast<const long long*>(pos_ids)[at] : static_cast<const int*>(pos_ids)[at];
    } else if (flags & ROTARY_CU_SEQLENS) {
      int lo = 0, hi = ndocs - 1;  // the last document starting at or before t
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_seqlens[mid] <= t) lo = mid;
        else hi = mid - 1;
      }
      seq = lo;
      pos = t - cu_seqlens[lo];
    }
    if (flags & ROTARY_OFFSETS)
      pos += (flags & ROTARY_OFFSETS_I64) ? static_cast<const long long*>(offsets)[seq]
                                          : static_cast<const int*>(offsets)[seq];
    s_b[i] = (int)b;
    s_t[i] = (int)t;
    s_pos[i] = (int)(pos + offset);
  }
  __syncthreads();

  const int heads = nh + nkv;
  const int groups_rot = (rot_half + VEC - 1) / VEC;
  const int groups = groups_rot + ((flags & ROTARY_COPY_REST) ? (head_dim - 2 * rot_half + 2 * VEC - 1) / (2 * VEC) : 0);
  const int items = ntok * heads * groups;
  const bool conj = flags & ROTARY_CONJ;

  // Where item i lives: source and destination rows, its group, and its token slot.
  auto locate = [&](int i, const T*& src, T*& dst, int& g, int& slot) {
    g = i % groups;
    const int r = i / groups, h = r % heads;
    slot = r / heads;
    const i64 b = s_b[slot], t = s_t[slot];
    if (h < nh) {
      src = q + b * stride_qb + t * stride_qt + h * stride_qh;
      dst = q_out + b * stride_qob + t * stride_qot + h * stride_qoh;
    } else {
      src = k + b * stride_kb + t * stride_kt + (h - nh) * stride_kh;
      dst = k_out + b * stride_kob + t * stride_kot + (h - nh) * stride_koh;
    }
  };
  // The columns of a group's two chunks and how many of their elements exist (<= 0: none).
  auto columns = [&](int g, int& ca, int& cb, int& va, int& vb) {
    if (g < groups_rot) {
      const int j = g * VEC;  // first pair
      if (INTERLEAVED) {
        ca = 2 * j;
        cb = 2 * j + VEC;
        va = min(VEC, 2 * (rot_half - j));
        vb = min(VEC, 2 * (rot_half - j) - VEC);
      } else {
        ca = j;
        cb = rot_half + j;
        va = vb = min(VEC, rot_half - j);
      }
    } else {
      ca = 2 * rot_half + (g - groups_rot) * 2 * VEC;
      cb = ca + VEC;
      va = min(VEC, head_dim - ca);
      vb = min(VEC, head_dim - cb);
    }
  };
  // 16-byte I/O for a whole chunk at a column that is a multiple of VEC (VECIO: rows start 16-byte aligned);
  // element by element otherwise (a partial chunk, or a NeoX second half / pass-through part that starts
  // mid-chunk, as with rotary_dim 24 in bf16), so a partial rotary dim never drops the whole row to scalar I/O.
  auto vec_ok = [&](int col, int valid) { return VECIO && valid == VEC && col % VEC == 0; };
  auto load_chunk = [&](const T* p, float(&v)[VEC], int valid, int col) {
    if (valid > 0) {
      load_n<T, VEC>(p, v, valid, vec_ok(col, valid));
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[e] = 0.f;
    }
  };
  auto store_chunk = [&](T* p, const float(&v)[VEC], int valid, int col) {
    if (valid > 0) store_n<T, VEC>(p, v, valid, vec_ok(col, valid));
  };

  for (int base = 0; base < items; base += blockDim.x * ITEMS) {
    float xa[ITEMS][VEC], xb[ITEMS][VEC], c[ITEMS][VEC], s[ITEMS][VEC];
    // Loads of all ITEMS groups first: x (independent of the position), then the table rows.
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;
      if (i >= items) continue;
      const T* src;
      T* dst;
      int g, slot, ca, cb, va, vb;
      locate(i, src, dst, g, slot);
      columns(g, ca, cb, va, vb);
      const bool rot = g < groups_rot;
      const int j = g * VEC;
      const i64 m = rot ? s_pos[slot] : 0;
      if (vec_ok(ca, va) && vec_ok(cb, vb)) {
        // Whole 16-byte chunks (with a rotary group, whole table chunks too: rot_half - j >= VEC): the x chunks'
        // and the table rows' loads issued together, predicated, before any is converted, so they are in flight
        // at once (separate branches would each wait for their load before the next one is issued).
        constexpr int CT = VEC * sizeof(TC) / 16;
        const uint4 ra = *reinterpret_cast<const uint4*>(src + ca), rb = *reinterpret_cast<const uint4*>(src + cb);
        uint4 rc[CT], rs[CT];
#pragma unroll
        for (int k = 0; k < CT; ++k) {
          rc[k] = rot ? reinterpret_cast<const uint4*>(cos + m * stride_cos + j)[k] : make_uint4(0u, 0u, 0u, 0u);
          rs[k] = rot ? reinterpret_cast<const uint4*>(sin + m * stride_sin + j)[k] : make_uint4(0u, 0u, 0u, 0u);
        }
        unpack16<T, VEC>(&ra, xa[u]);
        unpack16<T, VEC>(&rb, xb[u]);
        unpack16<TC, VEC>(rc, c[u]);
        unpack16<TC, VEC>(rs, s[u]);
        continue;
      }
      load_chunk(src + ca, xa[u], va, ca);
      load_chunk(src + cb, xb[u], vb, cb);
      if (rot) {
        const int valid = min(VEC, rot_half - j);
        load_n<TC, VEC>(cos + m * stride_cos + j, c[u], valid, VECIO && valid == VEC);
        load_n<TC, VEC>(sin + m * stride_sin + j, s[u], valid, VECIO && valid == VEC);
      }
    }
    // Rotate and store.
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;
      if (i >= items) continue;
      const T* src;
      T* dst;
      int g, slot, ca, cb, va, vb;
      locate(i, src, dst, g, slot);
      columns(g, ca, cb, va, vb);
      if (g < groups_rot) {
        if (INTERLEAVED) {
          // chunk a holds pairs 0 .. VEC/2 - 1 of the group, chunk b pairs VEC/2 .. VEC - 1
#pragma unroll
          for (int e = 0; e < VEC / 2; ++e) {
            const float ca_ = c[u][e], sa_ = conj ? -s[u][e] : s[u][e];
            const float cb_ = c[u][VEC / 2 + e], sb_ = conj ? -s[u][VEC / 2 + e] : s[u][VEC / 2 + e];
            const float a0 = xa[u][2 * e], a1 = xa[u][2 * e + 1], b0 = xb[u][2 * e], b1 = xb[u][2 * e + 1];
            xa[u][2 * e] = a0 * ca_ - a1 * sa_;
            xa[u][2 * e + 1] = a1 * ca_ + a0 * sa_;
            xb[u][2 * e] = b0 * cb_ - b1 * sb_;
            xb[u][2 * e + 1] = b1 * cb_ + b0 * sb_;
          }
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const float ce = c[u][e], se = conj ? -s[u][e] : s[u][e];
            const float x1 = xa[u][e], x2 = xb[u][e];
            xa[u][e] = x1 * ce - x2 * se;
            xb[u][e] = x2 * ce + x1 * se;
          }
        }
      }
      store_chunk(dst + ca, xa[u], va, ca);
      store_chunk(dst + cb, xb[u], vb, cb);
    }
  }
}

}  // namespace megakern

#ifndef __CUDACC_RTC__
namespace megakern {

template <typename T, typename TC, bool IL, bool VECIO, int ITEMS>
static cudaError_t rotary_launch(dim3 grid, dim3 block, const RotaryArgs& a, cudaStream_t stream) {
  rotary_kernel<T, TC, IL, VECIO, ITEMS><<<grid, block, 0, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<T*>(a.q_out), static_cast<T*>(a.k_out),
      static_cast<const TC*>(a.cos), static_cast<const TC*>(a.sin), a.pos_ids, a.cu_seqlens, a.offsets, a.tokens,
      a.seqlen, a.nh, a.nkv, a.head_dim, a.rot_half, a.tokens_per_block, a.stride_qb, a.stride_qt, a.stride_qh,
      a.stride_kb, a.stride_kt, a.stride_kh, a.stride_qob, a.stride_qot, a.stride_qoh, a.stride_kob, a.stride_kot,
      a.stride_koh, a.stride_cos, a.stride_sin, a.stride_pb, a.stride_pt, a.ndocs, a.offset, a.flags);
  return cudaGetLastError();
}

template <typename T, typename TC, bool IL, bool VECIO>
static cudaError_t rotary_items(int items, dim3 grid, dim3 block, const RotaryArgs& a, cudaStream_t stream) {
  switch (items) {
    case 1: return rotary_launch<T, TC, IL, VECIO, 1>(grid, block, a, stream);
    case 2: return rotary_launch<T, TC, IL, VECIO, 2>(grid, block, a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename TC>
static cudaError_t rotary_t(bool interleaved, int items, dim3 grid, dim3 block, const RotaryArgs& a,
                            cudaStream_t stream) {
  const bool vec = a.flags & ROTARY_VECTORIZED;
  if (interleaved) {
    return vec ? rotary_items<T, TC, true, true>(items, grid, block, a, stream)
               : rotary_items<T, TC, true, false>(items, grid, block, a, stream);
  }
  return vec ? rotary_items<T, TC, false, true>(items, grid, block, a, stream)
             : rotary_items<T, TC, false, false>(items, grid, block, a, stream);
}

cudaError_t rotary(int dtype, bool table_f32, bool interleaved, int items, dim3 grid, dim3 block,
                   const RotaryArgs& args, cudaStream_t stream) {
  switch (dtype * 2 + (table_f32 ? 1 : 0)) {
    case ROTARY_F32 * 2 + 1: return rotary_t<float, float>(interleaved, items, grid, block, args, stream);
    case ROTARY_F16 * 2: return rotary_t<__half, __half>(interleaved, items, grid, block, args, stream);
    case ROTARY_F16 * 2 + 1: return rotary_t<__half, float>(interleaved, items, grid, block, args, stream);
    case ROTARY_BF16 * 2: return rotary_t<__nv_bfloat16, __nv_bfloat16>(interleaved, items, grid, block, args, stream);
    case ROTARY_BF16 * 2 + 1: return rotary_t<__nv_bfloat16, float>(interleaved, items, grid, block, args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace megakern
#endif
