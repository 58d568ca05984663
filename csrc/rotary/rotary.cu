// Rotary position embeddings (RoPE) for q and k in one launch, forward and backward.
//
// A token at position m, pair i < rotary_dim / 2 of a head, (c, s) = (cos, sin)[m, i]:
//   y_a = x_a * c - x_b * s,   y_b = x_b * c + x_a * s
// a = i, b = i + rotary_dim / 2 (GPT-NeoX halves), or a = 2i, b = 2i + 1 (GPT-J, INTERLEAVED). The backward is
// the inverse rotation (ROTARY_CONJ: s -> -s). Features rotary_dim .. head_dim are copied (ROTARY_COPY_REST, out
// of place) or left alone (in place).
//
// Work split. grid.x cuts the flattened (B, T) into blocks of `tokens_per_block` consecutive tokens; grid.y cuts the
// heads (q's, then k's) into gridDim.y equal runs. A block's threads first resolve each token's (b, t, position)
// into shared memory: the token index, an explicit position id, or the offset inside its document (a binary search
// of cu_seqlens), plus any offset. Then two paths:
//
// Whole chunks (IO 2: rows 16-byte aligned, every chunk below whole). Each thread takes items (token, group), group
// fastest, so a warp covers contiguous runs of a row; it loads the group's (cos, sin) chunk once and walks the
// block's heads with it, ITEMS heads at a time (all their 16-byte loads issued before any math), the row's address
// advanced by the head stride: no division or table load per head. A group is two chunks of VEC = 16 / sizeof(T)
// elements:
//   rotary group g (pairs g*VEC .. g*VEC + VEC - 1): NeoX chunk a from the first half, chunk b from the second;
//   GPT-J the 2 VEC consecutive elements holding those pairs; the (cos, sin) chunk is VEC entries of row m;
//   pass-through group: 2 VEC elements past rotary_dim, copied.
//
// Staged (IO 0 and 1: a partial rotary dim whose second half starts mid-chunk, as rotary_dim 24 in bf16; a head dim
// that is not whole chunks; rows not 16-byte aligned). The block copies whole rows of its tokens and head run into
// shared memory, a batch at a time, then each thread writes an output chunk of VEC features, each feature's pair
// partner and table entry read where they lie (rotary_staged).
//
// All math in fp32. Kernel names are referenced by megakern/_rotary_cuda.py for the NVRTC path
// ("megakern::rotary_kernel<__nv_bfloat16, float, false, 2, 2>").
#include "common/common.h"
#include "rotary/rotary.h"

namespace megakern {

// Rotate one group (chunks a, b of VEC elements) by the table chunk (c, s), s already negated for the backward.
template <int VEC, bool INTERLEAVED>
__device__ __forceinline__ void rotate_group(float (&xa)[VEC], float (&xb)[VEC], const float (&c)[VEC],
                                             const float (&s)[VEC]) {
  if (INTERLEAVED) {
    // chunk a holds pairs 0 .. VEC/2 - 1 of the group, chunk b pairs VEC/2 .. VEC - 1
#pragma unroll
    for (int e = 0; e < VEC / 2; ++e) {
      const float ca = c[e], sa = s[e], cb = c[VEC / 2 + e], sb = s[VEC / 2 + e];
      const float a0 = xa[2 * e], a1 = xa[2 * e + 1], b0 = xb[2 * e], b1 = xb[2 * e + 1];
      xa[2 * e] = a0 * ca - a1 * sa;
      xa[2 * e + 1] = a1 * ca + a0 * sa;
      xb[2 * e] = b0 * cb - b1 * sb;
      xb[2 * e + 1] = b1 * cb + b0 * sb;
    }
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float x1 = xa[e], x2 = xb[e];
      xa[e] = x1 * c[e] - x2 * s[e];
      xb[e] = x2 * c[e] + x1 * s[e];
    }
  }
}

// VEC floats as one 16-byte chunk of T.
template <typename T, int VEC>
__device__ __forceinline__ uint4 pack16(const float (&v)[VEC]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) e[i] = from_float<T>(v[i]);
  return raw;
}

// One group of heads lo .. hi - 1 of a token (rows at src + h * sh, written to dst + h * dh), ITEMS heads at a time,
// both chunks whole 16-byte transactions: every load of the ITEMS heads issued first, each head's chunks then
// unpacked, rotated and stored in turn (the others stay packed, 4 registers a chunk). A step past hi reads head
// hi - 1 again (through its address, not a branch) and stores nothing.
template <typename T, int VEC, bool INTERLEAVED, int ITEMS>
__device__ __forceinline__ void rotary_heads(const T* src, T* dst, i64 sh, i64 dh, int lo, int hi, int ca, int cb,
                                             bool rot, const float (&c)[VEC], const float (&s)[VEC]) {
  for (int h = lo; h < hi; h += ITEMS) {
    uint4 ra[ITEMS], rb[ITEMS];
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      const T* p = src + (i64)min(h + u, hi - 1) * sh;
      ra[u] = *reinterpret_cast<const uint4*>(p + ca);
      rb[u] = *reinterpret_cast<const uint4*>(p + cb);
    }
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      if (h + u >= hi) break;
      T* p = dst + (i64)(h + u) * dh;
      if (rot) {
        float xa[VEC], xb[VEC];
        unpack16<T, VEC>(&ra[u], xa);
        unpack16<T, VEC>(&rb[u], xb);
        rotate_group<VEC, INTERLEAVED>(xa, xb, c, s);
        ra[u] = pack16<T, VEC>(xa);
        rb[u] = pack16<T, VEC>(xb);
      }
      *reinterpret_cast<uint4*>(p + ca) = ra[u];
      *reinterpret_cast<uint4*>(p + cb) = rb[u];
    }
  }
}

// Bytes of shared memory a block stages rows through (the path for rows that are not whole 16-byte chunks).
constexpr int ROTARY_STAGE_BYTES = 16384;

// The staged path: rows (token, head) of the block's tokens and head run, a batch at a time, copied whole into shared
// memory (16-byte transactions where every row is whole 16-byte chunks, else element by element), then each thread
// writes an output chunk of VEC features, reading each feature's pair partner and table entry where it lies, so a
// second NeoX half that starts mid-chunk (rotary_dim 24 in bf16) costs no narrow global transaction. Writes the
// first `span` features of each row: all of them out of place with the pass-through copy, else the rotary ones.
template <typename T, typename TC, bool INTERLEAVED, bool VECIO>
__device__ __forceinline__ void rotary_staged(
    T* stage, const T* q, const T* k, T* q_out, T* k_out, const TC* __restrict__ cos, const TC* __restrict__ sin,
    const int* s_b, const int* s_t, const int* s_pos, int ntok, int h0, int h1, int nh, int head_dim, int rot_half,
    int span, bool conj, i64 stride_qb, i64 stride_qt, i64 stride_qh, i64 stride_kb, i64 stride_kt, i64 stride_kh,
    i64 stride_qob, i64 stride_qot, i64 stride_qoh, i64 stride_kob, i64 stride_kot, i64 stride_koh, i64 stride_cos,
    i64 stride_sin) {
  constexpr int VEC = 16 / sizeof(T);
  const int run = h1 - h0;
  if (run <= 0) return;
  const int rows = ntok * run, batch = max(1, ROTARY_STAGE_BYTES / (head_dim * (int)sizeof(T)));
  const bool wide = VECIO && head_dim % VEC == 0;
  const int chunks = (head_dim + VEC - 1) / VEC, out_chunks = (span + VEC - 1) / VEC;
  // row r of the block: its token slot, and its source and destination
  auto locate = [&](int r, int& slot, const T*& src, T*& dst) {
    slot = r / run;
    const int h = h0 + r - slot * run;
    const i64 b = s_b[slot], t = s_t[slot];
    if (h < nh) {
      src = q + b * stride_qb + t * stride_qt + h * stride_qh;
      dst = q_out + b * stride_qob + t * stride_qot + h * stride_qoh;
    } else {
      src = k + b * stride_kb + t * stride_kt + (h - nh) * stride_kh;
      dst = k_out + b * stride_kob + t * stride_kot + (h - nh) * stride_koh;
    }
  };
  for (int r0 = 0; r0 < rows; r0 += batch) {
    const int nr = min(batch, rows - r0);
    if (wide) {
      constexpr int U = 4;  // chunks a thread loads before it stores any (their loads in flight together)
      for (int base = threadIdx.x; base < nr * chunks; base += U * blockDim.x) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = min(base + u * (int)blockDim.x, nr * chunks - 1), r = i / chunks;
          int slot;
          const T* src;
          T* dst;
          locate(r0 + r, slot, src, dst);
          raw[u] = reinterpret_cast<const uint4*>(src)[i - r * chunks];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int i = base + u * (int)blockDim.x;
          if (i < nr * chunks) reinterpret_cast<uint4*>(stage)[i] = raw[u];  // row r at stage + r * head_dim
        }
      }
    } else {
      for (int i = threadIdx.x; i < nr * head_dim; i += blockDim.x) {
        const int r = i / head_dim;
        int slot;
        const T* src;
        T* dst;
        locate(r0 + r, slot, src, dst);
        stage[i] = src[i - r * head_dim];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nr * out_chunks; i += blockDim.x) {
      const int r = i / out_chunks, c0 = (i - r * out_chunks) * VEC;
      int slot;
      const T* src;
      T* dst;
      locate(r0 + r, slot, src, dst);
      const T* x = stage + r * head_dim;
      const i64 m = s_pos[slot];
      float y[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int col = c0 + e;
        y[e] = 0.f;
        if (col >= span) continue;
        float v = to_float(x[col]);
        if (col < 2 * rot_half) {
          int j, partner;
          float sign;
          if (INTERLEAVED) {
            j = col >> 1, partner = col ^ 1, sign = (col & 1) ? 1.f : -1.f;
          } else if (col < rot_half) {
            j = col, partner = col + rot_half, sign = -1.f;
          } else {
            j = col - rot_half, partner = j, sign = 1.f;
          }
          const float cs = to_float(cos[m * stride_cos + j]), sn = to_float(sin[m * stride_sin + j]);
          const float xp = to_float(x[partner]);
          v = v * cs + sign * (xp * (conj ? -sn : sn));
        }
        y[e] = v;
      }
      const int valid = min(VEC, span - c0);
      if (VECIO && valid == VEC) {
        *reinterpret_cast<uint4*>(dst + c0) = pack16<T, VEC>(y);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (e < valid) dst[c0 + e] = from_float<T>(y[e]);
      }
    }
    __syncthreads();  // the batch is written before the next one is staged over it
  }
}

// IO: 0, element by element; 1, rows and table rows start 16-byte aligned; 2, besides, every chunk of every group (and
// of the table) is whole, so the 16-byte head-walking path runs. 0 and 1 take the staged path.
template <typename T, typename TC, bool INTERLEAVED, int IO, int ITEMS>
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

  // This block's heads: run blockIdx.y of gridDim.y, q's heads first.
  const int heads = nh + nkv, per_run = (heads + gridDim.y - 1) / gridDim.y;
  const int h0 = blockIdx.y * per_run, h1 = min(heads, h0 + per_run);
  const bool conj = flags & ROTARY_CONJ;

  if constexpr (IO < 2) {
    __shared__ __align__(16) T stage[ROTARY_STAGE_BYTES / sizeof(T)];
    const int span = (flags & ROTARY_COPY_REST) ? head_dim : 2 * rot_half;
    rotary_staged<T, TC, INTERLEAVED, IO == 1>(
        stage, q, k, q_out, k_out, cos, sin, s_b, s_t, s_pos, ntok, h0, h1, nh, head_dim, rot_half, span, conj,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_qob, stride_qot, stride_qoh,
        stride_kob, stride_kot, stride_koh, stride_cos, stride_sin);
  } else {
    const int groups_rot = rot_half / VEC;
    const int groups = groups_rot + ((flags & ROTARY_COPY_REST) ? (head_dim - 2 * rot_half) / (2 * VEC) : 0);
    for (int i = threadIdx.x; i < ntok * groups; i += blockDim.x) {
      const int slot = i / groups, g = i - slot * groups;
      const i64 b = s_b[slot], t = s_t[slot];
      // the columns of the group's two chunks (every chunk whole here)
      const bool rot = g < groups_rot;
      const int j = g * VEC;  // first pair of a rotary group
      const int ca = rot ? (INTERLEAVED ? 2 * j : j) : 2 * rot_half + (g - groups_rot) * 2 * VEC;
      const int cb = rot ? (INTERLEAVED ? 2 * j + VEC : rot_half + j) : ca + VEC;
      // the table chunk, once for all the heads
      float c[VEC], s[VEC];
      if (rot) {
        const i64 m = s_pos[slot];
        constexpr int CT = VEC * sizeof(TC) / 16;
        uint4 rc[CT], rs[CT];
#pragma unroll
        for (int u = 0; u < CT; ++u) {
          rc[u] = reinterpret_cast<const uint4*>(cos + m * stride_cos + j)[u];
          rs[u] = reinterpret_cast<const uint4*>(sin + m * stride_sin + j)[u];
        }
        unpack16<TC, VEC>(rc, c);
        unpack16<TC, VEC>(rs, s);
        if (conj) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) s[e] = -s[e];
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) c[e] = s[e] = 0.f;
      }
      for (int part = 0; part < 2; ++part) {  // q's heads, then k's
        const int lo = part ? max(h0, nh) - nh : h0, hi = part ? h1 - nh : min(h1, nh);
        if (lo >= hi) continue;
        const T* src = part ? k + b * stride_kb + t * stride_kt : q + b * stride_qb + t * stride_qt;
        T* dst = part ? k_out + b * stride_kob + t * stride_kot : q_out + b * stride_qob + t * stride_qot;
        rotary_heads<T, VEC, INTERLEAVED, ITEMS>(src, dst, part ? stride_kh : stride_qh, part ? stride_koh : stride_qoh,
                                                 lo, hi, ca, cb, rot, c, s);
      }
    }
  }
}

}  // namespace megakern

#ifndef __CUDACC_RTC__
namespace megakern {

template <typename T, typename TC, bool IL, int IO, int ITEMS>
static cudaError_t rotary_launch(dim3 grid, dim3 block, const RotaryArgs& a, cudaStream_t stream) {
  rotary_kernel<T, TC, IL, IO, ITEMS><<<grid, block, 0, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<T*>(a.q_out), static_cast<T*>(a.k_out),
      static_cast<const TC*>(a.cos), static_cast<const TC*>(a.sin), a.pos_ids, a.cu_seqlens, a.offsets, a.tokens,
      a.seqlen, a.nh, a.nkv, a.head_dim, a.rot_half, a.tokens_per_block, a.stride_qb, a.stride_qt, a.stride_qh,
      a.stride_kb, a.stride_kt, a.stride_kh, a.stride_qob, a.stride_qot, a.stride_qoh, a.stride_kob, a.stride_kot,
      a.stride_koh, a.stride_cos, a.stride_sin, a.stride_pb, a.stride_pt, a.ndocs, a.offset, a.flags);
  return cudaGetLastError();
}

template <typename T, typename TC, bool IL, int IO>
static cudaError_t rotary_items(int items, dim3 grid, dim3 block, const RotaryArgs& a, cudaStream_t stream) {
  switch (items) {
    case 1: return rotary_launch<T, TC, IL, IO, 1>(grid, block, a, stream);
    case 2: return rotary_launch<T, TC, IL, IO, 2>(grid, block, a, stream);
    case 4: return rotary_launch<T, TC, IL, IO, 4>(grid, block, a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename TC>
static cudaError_t rotary_t(bool interleaved, int items, dim3 grid, dim3 block, const RotaryArgs& a,
                            cudaStream_t stream) {
  const int io = (a.flags & ROTARY_VECTORIZED) ? ((a.flags & ROTARY_WHOLE_CHUNKS) ? 2 : 1) : 0;
  if (interleaved) {
    return io == 2 ? rotary_items<T, TC, true, 2>(items, grid, block, a, stream)
         : io == 1 ? rotary_items<T, TC, true, 1>(items, grid, block, a, stream)
                   : rotary_items<T, TC, true, 0>(items, grid, block, a, stream);
  }
  return io == 2 ? rotary_items<T, TC, false, 2>(items, grid, block, a, stream)
       : io == 1 ? rotary_items<T, TC, false, 1>(items, grid, block, a, stream)
                 : rotary_items<T, TC, false, 0>(items, grid, block, a, stream);
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
