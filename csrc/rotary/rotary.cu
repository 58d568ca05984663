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
// of cu_seqlens), plus any offset. Then each thread takes items (token, group), group fastest (the rotary groups
// of the block's tokens, then their pass-through groups), so a warp covers contiguous runs of rows: it loads the group's (cos, sin) chunk once and walks the block's heads with it, ITEMS
// heads at a time (all their loads issued before any math, so several 16-byte loads are in flight), the row's
// address advanced by the head stride: no division or table load per head.
// A group is two chunks of VEC = 16 / sizeof(T) elements:
//   rotary group g (pairs g*VEC .. g*VEC + VEC - 1): NeoX chunk a from the first half, chunk b from the second;
//   GPT-J the 2 VEC consecutive elements holding those pairs; the (cos, sin) chunk is VEC entries of row m;
//   pass-through group: 2 VEC elements past rotary_dim, copied.
// I/O: 16-byte transactions where a chunk is whole and 16-byte aligned; 8-byte ones where it starts 8-byte aligned
// (a NeoX second half that starts mid-chunk, as with rotary_dim 24 in bf16, or half a chunk); element by element
// otherwise.
//
// All math in fp32. Kernel names are referenced by megakern/_rotary_cuda.py for the NVRTC path
// ("megakern::rotary_kernel<__nv_bfloat16, float, false, 2, 2>").
#include "common/common.h"
#include "rotary/rotary.h"

namespace megakern {

// MEGAKERN_ROTARY_MAXNREG (tuning, NVRTC only: bench_rotary --tune): a cap on the kernel's registers a thread in place
// of its launch bounds (nvcc and NVRTC ignore --maxrregcount for a kernel with launch bounds), so that more blocks fit
// an SM, at the cost of spills (megakern/_rotary_cuda.py's LaunchConfig.max_registers: 24-255).
#ifdef MEGAKERN_ROTARY_MAXNREG
#define MEGAKERN_ROTARY_BOUNDS __maxnreg__(MEGAKERN_ROTARY_MAXNREG)
#else
#define MEGAKERN_ROTARY_BOUNDS __launch_bounds__(ROTARY_MAX_THREADS)
#endif

// N elements of S at p as floats, the first `valid` only (0 beyond): MODE 16, whole 16-byte transactions (all N
// exist, p 16-byte aligned); MODE 8, 8-byte ones for every whole 8-byte piece that exists (p 8-byte aligned), the
// rest element by element; MODE 0, element by element.
template <typename S, int N>
__device__ __forceinline__ void rotary_load(const S* p, float (&v)[N], int valid, int mode) {
  constexpr int PER8 = 8 / sizeof(S);
  if (mode == 16) {
    uint4 raw[N * sizeof(S) / 16];
#pragma unroll
    for (int c = 0; c < N * (int)sizeof(S) / 16; ++c) raw[c] = reinterpret_cast<const uint4*>(p)[c];
    unpack16<S, N>(raw, v);
  } else if (mode == 8) {
#pragma unroll
    for (int c = 0; c < N / PER8; ++c) {
      if ((c + 1) * PER8 <= valid) {
        const uint2 raw = reinterpret_cast<const uint2*>(p)[c];
        const S* e = reinterpret_cast<const S*>(&raw);
#pragma unroll
        for (int i = 0; i < PER8; ++i) v[c * PER8 + i] = to_float(e[i]);
      } else {
#pragma unroll
        for (int i = 0; i < PER8; ++i) v[c * PER8 + i] = c * PER8 + i < valid ? to_float(p[c * PER8 + i]) : 0.f;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = i < valid ? to_float(p[i]) : 0.f;
  }
}

// The first `valid` of N floats to S at p, in the transactions of rotary_load's MODE.
template <typename S, int N>
__device__ __forceinline__ void rotary_store(S* p, const float (&v)[N], int valid, int mode) {
  constexpr int PER8 = 8 / sizeof(S), PER16 = 16 / sizeof(S);
  if (mode == 16) {
#pragma unroll
    for (int c = 0; c < N / PER16; ++c) {
      uint4 raw;
      S* e = reinterpret_cast<S*>(&raw);
#pragma unroll
      for (int i = 0; i < PER16; ++i) e[i] = from_float<S>(v[c * PER16 + i]);
      reinterpret_cast<uint4*>(p)[c] = raw;
    }
  } else if (mode == 8) {
#pragma unroll
    for (int c = 0; c < N / PER8; ++c) {
      if ((c + 1) * PER8 <= valid) {
        uint2 raw;
        S* e = reinterpret_cast<S*>(&raw);
#pragma unroll
        for (int i = 0; i < PER8; ++i) e[i] = from_float<S>(v[c * PER8 + i]);
        reinterpret_cast<uint2*>(p)[c] = raw;
      } else {
#pragma unroll
        for (int i = 0; i < PER8; ++i)
          if (c * PER8 + i < valid) p[c * PER8 + i] = from_float<S>(v[c * PER8 + i]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < valid) p[i] = from_float<S>(v[i]);
  }
}

// The transactions a chunk of `valid` elements of S at column `col` of a row takes (rotary_load's MODE); VECIO:
// every row starts 16-byte aligned.
template <typename S, int N, bool VECIO>
__device__ __forceinline__ int rotary_io(int col, int valid) {
  const int at = col * (int)sizeof(S);
  if (!VECIO || valid <= 0) return 0;
  if (valid == N && at % 16 == 0) return 16;
  return (at % 8 == 0 && valid * (int)sizeof(S) >= 8) ? 8 : 0;
}

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

// One group of heads lo .. hi - 1 of a token (rows at src + h * sh, written to dst + h * dh), ITEMS heads at a time:
// every load of the ITEMS heads issued before any is converted. A step past hi reads head hi - 1 again (through its
// address, not a branch) and stores nothing. V16: both chunks whole 16-byte transactions (ma = mb = 16).
template <typename T, int VEC, bool INTERLEAVED, int ITEMS, bool V16>
__device__ __forceinline__ void rotary_heads(const T* src, T* dst, i64 sh, i64 dh, int lo, int hi, int ca, int cb,
                                             int va, int vb, int ma, int mb, bool rot, const float (&c)[VEC],
                                             const float (&s)[VEC]) {
  for (int h = lo; h < hi; h += ITEMS) {
    if (V16) {
      // the chunks stay packed (4 registers each, not VEC floats) until their head's math
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
        float xa[VEC], xb[VEC];
        unpack16<T, VEC>(&ra[u], xa);
        unpack16<T, VEC>(&rb[u], xb);
        if (rot) rotate_group<VEC, INTERLEAVED>(xa, xb, c, s);
        T* p = dst + (i64)(h + u) * dh;
        rotary_store<T, VEC>(p + ca, xa, VEC, 16);
        rotary_store<T, VEC>(p + cb, xb, VEC, 16);
      }
    } else {
      float xa[ITEMS][VEC], xb[ITEMS][VEC];
#pragma unroll
      for (int u = 0; u < ITEMS; ++u) {
        const T* p = src + (i64)min(h + u, hi - 1) * sh;
        rotary_load<T, VEC>(p + ca, xa[u], va, ma);
        rotary_load<T, VEC>(p + cb, xb[u], vb, mb);
      }
#pragma unroll
      for (int u = 0; u < ITEMS; ++u) {
        if (h + u >= hi) break;
        if (rot) rotate_group<VEC, INTERLEAVED>(xa[u], xb[u], c, s);
        T* p = dst + (i64)(h + u) * dh;
        rotary_store<T, VEC>(p + ca, xa[u], va, ma);
        rotary_store<T, VEC>(p + cb, xb[u], vb, mb);
      }
    }
  }
}

// IO 3: rows of whole, 16-byte aligned chunks whose rotary pairs do not fall into whole groups (a partial rotary
// dim whose NeoX second half starts mid-chunk, as rotary_dim 24 in bf16). A thread per (token, chunk) of the
// block's rows, `row_chunks` chunks a row (the rotary part, or the whole row when the rest is copied); the block
// walks its run of heads, ITEMS at a time: every thread loads its chunks (16 bytes each), puts them in shared
// memory, and after a barrier reads each feature's pair partner from there, at whatever column it lies. Each
// feature's table entry and partner column are resolved once, before the walk. Features past rotary_dim keep
// their bits. Needs ntok * row_chunks <= blockDim.x (the launcher's tokens_per_block).
template <typename T, typename TC, bool INTERLEAVED, int ITEMS>
__device__ __forceinline__ void rotary_rows(const T* q, const T* k, T* q_out, T* k_out, const TC* __restrict__ cos,
                                            const TC* __restrict__ sin, const int* s_b, const int* s_t,
                                            const int* s_pos, int ntok, int nh, int h0, int h1, int rot_half,
                                            int row_chunks, bool conj, i64 stride_qb, i64 stride_qt, i64 stride_qh,
                                            i64 stride_kb, i64 stride_kt, i64 stride_kh, i64 stride_qob,
                                            i64 stride_qot, i64 stride_qoh, i64 stride_kob, i64 stride_kot,
                                            i64 stride_koh, i64 stride_cos, i64 stride_sin) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ uint4 stage[ITEMS][ROTARY_MAX_THREADS];
  const bool active = (int)threadIdx.x < ntok * row_chunks;
  const int slot = active ? threadIdx.x / row_chunks : 0;
  const int col = (threadIdx.x - slot * row_chunks) * VEC;
  const i64 b = s_b[slot], t = s_t[slot], m = s_pos[slot];
  // y_e = x_e c_e + x_partner(e) s_e, the sign of s_e folded in; features past rotary_dim are not rotated
  float c[VEC], s[VEC];
  int partner[VEC];
  unsigned rotated = 0;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const int f = col + e;
    c[e] = 1.f;
    s[e] = 0.f;
    partner[e] = f;
    if (active && f < 2 * rot_half) {
      int i;
      float sign;
      if (INTERLEAVED) {
        i = f >> 1;
        partner[e] = f ^ 1;
        sign = (f & 1) ? 1.f : -1.f;
      } else {
        const bool first = f < rot_half;
        i = first ? f : f - rot_half;
        partner[e] = first ? f + rot_half : f - rot_half;
        sign = first ? -1.f : 1.f;
      }
      c[e] = to_float(cos[m * stride_cos + i]);
      s[e] = (conj ? -sign : sign) * to_float(sin[m * stride_sin + i]);
      rotated |= 1u << e;
    }
  }
  const T* qs = q + b * stride_qb + t * stride_qt + col;
  const T* ks = k + b * stride_kb + t * stride_kt + col;
  T* qd = q_out + b * stride_qob + t * stride_qot + col;
  T* kd = k_out + b * stride_kob + t * stride_kot + col;
  const int row0 = slot * row_chunks;  // this token's row in the stage, in chunks
  for (int h = h0; h < h1; h += ITEMS) {  // the same steps for every thread of the block (barriers inside)
    uint4 raw[ITEMS];
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      const int hh = min(h + u, h1 - 1);
      const T* p = hh < nh ? qs + (i64)hh * stride_qh : ks + (i64)(hh - nh) * stride_kh;
      if (active) raw[u] = *reinterpret_cast<const uint4*>(p);
    }
    if (active) {
#pragma unroll
      for (int u = 0; u < ITEMS; ++u) stage[u][threadIdx.x] = raw[u];
    }
    __syncthreads();
    if (active) {
#pragma unroll
      for (int u = 0; u < ITEMS; ++u) {
        if (h + u >= h1) break;
        const T* row = reinterpret_cast<const T*>(&stage[u][row0]);
        const T* x = reinterpret_cast<const T*>(&raw[u]);
        uint4 out;
        T* y = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          y[e] = (rotated >> e & 1u) ? from_float<T>(to_float(x[e]) * c[e] + to_float(row[partner[e]]) * s[e]) : x[e];
        const int hh = h + u;
        T* p = hh < nh ? qd + (i64)hh * stride_qoh : kd + (i64)(hh - nh) * stride_koh;
        *reinterpret_cast<uint4*>(p) = out;
      }
    }
    __syncthreads();  // the stage is rewritten by the next step
  }
}

// IO: 0, element by element; 1, rows 16-byte aligned, each chunk in the widest transactions its column allows;
// 2, every chunk of every group (and of the table) whole and 16-byte aligned (only the 16-byte path is compiled);
// 3, rows of whole 16-byte chunks staged in shared memory (rotary_rows).
template <typename T, typename TC, bool INTERLEAVED, int IO, int ITEMS>
__global__ void MEGAKERN_ROTARY_BOUNDS
rotary_kernel(const T* q, const T* k, T* q_out, T* k_out, const TC* __restrict__ cos, const TC* __restrict__ sin,
              const void* __restrict__ pos_ids, const int* __restrict__ cu_seqlens, const void* __restrict__ offsets,
              i64 tokens, i64 seqlen, int nh, int nkv, int head_dim, int rot_half, int tokens_per_block,
              i64 stride_qb, i64 stride_qt, i64 stride_qh, i64 stride_kb, i64 stride_kt, i64 stride_kh,
              i64 stride_qob, i64 stride_qot, i64 stride_qoh, i64 stride_kob, i64 stride_kot, i64 stride_koh,
              i64 stride_cos, i64 stride_sin, i64 stride_pb, i64 stride_pt, int ndocs, i64 offset, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr bool VECIO = IO >= 1;
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
  if constexpr (IO == 3) {
    rotary_rows<T, TC, INTERLEAVED, ITEMS>(q, k, q_out, k_out, cos, sin, s_b, s_t, s_pos, ntok, nh, h0, h1, rot_half,
                                           rotary_row_chunks(head_dim, rot_half, VEC, flags), flags & ROTARY_CONJ, stride_qb, stride_qt, stride_qh, stride_kb,
                                           stride_kt, stride_kh, stride_qob, stride_qot, stride_qoh, stride_kob,
                                           stride_kot, stride_koh, stride_cos, stride_sin);
    return;
  }
  const int groups_rot = (rot_half + VEC - 1) / VEC;
  const int groups = groups_rot + ((flags & ROTARY_COPY_REST) ? (head_dim - 2 * rot_half + 2 * VEC - 1) / (2 * VEC) : 0);
  const int items = ntok * groups;
  const bool conj = flags & ROTARY_CONJ;

  // Items: the block's rotary groups first (token major), then its pass-through groups, so that a warp's threads take
  // the same path (rotating, perhaps in narrower transactions; or copying) rather than both one after the other.
  const int items_rot = ntok * groups_rot, groups_copy = groups - groups_rot;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    int slot, g;
    if (i < items_rot) {
      slot = i / groups_rot;
      g = i - slot * groups_rot;
    } else {
      slot = (i - items_rot) / groups_copy;
      g = groups_rot + (i - items_rot) - slot * groups_copy;
    }
    const i64 b = s_b[slot], t = s_t[slot];
    // the columns of the group's two chunks and how many of their elements exist (<= 0: none)
    int ca, cb, va, vb;
    const bool rot = g < groups_rot;
    const int j = g * VEC;  // first pair of a rotary group
    if (rot) {
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
    // the table chunk, once for all the heads
    float c[VEC], s[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) c[e] = s[e] = 0.f;
    if (rot) {
      const i64 m = s_pos[slot];
      const int valid = min(VEC, rot_half - j), mode = IO == 2 ? 16 : rotary_io<TC, VEC, VECIO>(j, valid);
      rotary_load<TC, VEC>(cos + m * stride_cos + j, c, valid, mode);
      rotary_load<TC, VEC>(sin + m * stride_sin + j, s, valid, mode);
      if (conj) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) s[e] = -s[e];
      }
    }
    const int ma = IO == 2 ? 16 : rotary_io<T, VEC, VECIO>(ca, va), mb = IO == 2 ? 16 : rotary_io<T, VEC, VECIO>(cb, vb);
    for (int part = 0; part < 2; ++part) {  // q's heads, then k's
      const int lo = part ? max(h0, nh) - nh : h0, hi = part ? h1 - nh : min(h1, nh);
      if (lo >= hi) continue;
      const T* src = part ? k + b * stride_kb + t * stride_kt : q + b * stride_qb + t * stride_qt;
      T* dst = part ? k_out + b * stride_kob + t * stride_kot : q_out + b * stride_qob + t * stride_qot;
      const i64 sh = part ? stride_kh : stride_qh, dh = part ? stride_koh : stride_qoh;
      if constexpr (IO == 2) {
        rotary_heads<T, VEC, INTERLEAVED, ITEMS, true>(src, dst, sh, dh, lo, hi, ca, cb, va, vb, ma, mb, rot, c, s);
      } else {
        if (ma == 16 && mb == 16)
          rotary_heads<T, VEC, INTERLEAVED, ITEMS, true>(src, dst, sh, dh, lo, hi, ca, cb, va, vb, ma, mb, rot, c, s);
        else
          rotary_heads<T, VEC, INTERLEAVED, ITEMS, false>(src, dst, sh, dh, lo, hi, ca, cb, va, vb, ma, mb, rot, c, s);
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
  constexpr int VEC = 16 / sizeof(T);
  const int io = (a.flags & ROTARY_VECTORIZED)
                     ? ((a.flags & ROTARY_WHOLE_CHUNKS) ? 2 : (a.flags & ROTARY_ROWS) ? 3 : 1) : 0;
  if (io == 3) {  // a thread per chunk of the block's rows: they must all have one
    const int row_chunks = rotary_row_chunks(a.head_dim, a.rot_half, VEC, a.flags);
    if (a.head_dim % VEC || (long long)a.tokens_per_block * row_chunks > (long long)block.x)
      return cudaErrorInvalidValue;
  }
  if (interleaved) {
    return io == 3 ? rotary_items<T, TC, true, 3>(items, grid, block, a, stream)
         : io == 2 ? rotary_items<T, TC, true, 2>(items, grid, block, a, stream)
         : io == 1 ? rotary_items<T, TC, true, 1>(items, grid, block, a, stream)
                   : rotary_items<T, TC, true, 0>(items, grid, block, a, stream);
  }
  return io == 3 ? rotary_items<T, TC, false, 3>(items, grid, block, a, stream)
       : io == 2 ? rotary_items<T, TC, false, 2>(items, grid, block, a, stream)
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
