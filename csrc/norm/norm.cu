// LayerNorm and RMSNorm, forward and backward, with an optional fused residual add.
//
//   h    = x + residual                    (rounded to the residual's dtype, stored as residual_out)
//   xhat = (h - mean) * rstd,  rstd = 1 / sqrt(var + eps)      (RMSNorm: mean = 0, var = mean(h^2))
//   y    = xhat * w + b
// Backward, per row, with g = dy * w:
//   dh = rstd * (g - xhat * mean(g * xhat) - mean(g))  (+ d residual_out)     (RMSNorm: no mean(g))
//   dw = sum over rows of dy * xhat,  db = sum over rows of dy
// dw / db are reduced in two stages: each row slot of the persistent grid keeps its partial sums in
// registers and writes one line of dw_partial; the caller sums the lines.
//
// All math in fp32. Geometry and flags: see norm.h. Kernel names are referenced by megakern/_norm_cuda.py
// for the NVRTC path ("megakern::norm_fwd_kernel<__nv_bfloat16, 2, 1, true, 5>").
#include "common/common.h"
#include "norm/norm.h"

namespace megakern {

// MEGAKERN_NORM_FWD_MAXNREG (tuning, NVRTC only: profiles/tune_norm.py): a cap on the forward's registers a thread
// in place of its launch bounds (nvcc and NVRTC ignore --maxrregcount for a kernel with launch bounds); at most 64,
// so that a block of 1024 threads still fits an SM.
#ifdef MEGAKERN_NORM_FWD_MAXNREG
static_assert(MEGAKERN_NORM_FWD_MAXNREG <= 64, "MEGAKERN_NORM_FWD_MAXNREG above 64 does not bound 1024-thread blocks");
#define MEGAKERN_NORM_FWD_BOUNDS __maxnreg__(MEGAKERN_NORM_FWD_MAXNREG)
#else
#define MEGAKERN_NORM_FWD_BOUNDS __launch_bounds__(1024 / ROWS)
#endif

// SPEC: 0, the flags read at run time, or one of NORM_FWD_SPECS (csrc/norm/norm.h), the same flags as constants
template <typename T, int NV, int ROWS, bool VECIO, int SPEC>
__global__ void MEGAKERN_NORM_FWD_BOUNDS
norm_fwd_kernel(const T* __restrict__ x, const void* __restrict__ residual, const void* __restrict__ weight,
                const void* __restrict__ bias, T* __restrict__ y, void* __restrict__ residual_out,
                float* __restrict__ mean_out, float* __restrict__ rstd_out, i64 rows, int cols, i64 stride_x,
                i64 stride_res, i64 stride_y, i64 stride_res_out, float eps, int flags) {
  static_assert(ROWS >= 1 && (ROWS == 1 || NV > 0), "streaming (NV = 0) takes one row at a time");
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float smem[32 * ROWS];
  constexpr bool vec = VECIO;
  const int f = SPEC ? SPEC : flags;  // a constant in the specialized instances: their unused paths fold away
  const bool rms = f & NORM_RMS;
  const bool has_w = f & NORM_HAS_WEIGHT, has_b = f & NORM_HAS_BIAS, w_f32 = f & NORM_W_F32;
  const bool has_res = f & NORM_HAS_RESIDUAL, res_f32 = f & NORM_RES_F32;
  // This row group's first row; it takes ROWS consecutive rows (those past the end are neither read nor written)
  const i64 row = ((i64)blockIdx.x * blockDim.y + threadIdx.y) * ROWS;
  if (row >= rows) return;  // only with a warp per row, where no barrier follows
  const T* xr = x + row * stride_x;
  const float inv_cols = 1.f / cols;
  // sum / cols, corrected by one fma: sum * (1 / cols) alone can miss the quotient by an ulp, and a row of one
  // value must have that value as its mean (a variance of zero, y equal to the bias)
  auto row_mean = [&](float sum) {
    const float m = sum * inv_cols;
    return m + fmaf(-m, (float)cols, sum) * inv_cols;
  };

  // The group of VEC inputs at column c. First visit: x (+ residual, rounded and stored as residual_out);
  // later visits (streaming mode) read the stored sum back.
  auto input = [&](int c, float(&v)[VEC], int valid, bool first) {
    if (!has_res) return load_n<T, VEC>(xr + c, v, valid, vec);
    if (!first) return load_t_or_f32<T, VEC>(residual_out, res_f32, row * stride_res_out + c, v, valid, vec);
    float r[VEC];
    load_n<T, VEC>(xr + c, v, valid, vec);
    load_t_or_f32<T, VEC>(residual, res_f32, row * stride_res + c, r, valid, vec);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = res_f32 ? v[i] + r[i] : round_to<T>(v[i] + r[i]);
    store_t_or_f32<T, VEC>(residual_out, res_f32, row * stride_res_out + c, v, valid, vec);
  };
  auto output = [&](i64 rw, int c, const float(&v)[VEC], int valid, float mean, float rstd) {
    float w[VEC], b[VEC], o[VEC];
    if (has_w) load_t_or_f32<T, VEC>(weight, w_f32, c, w, valid, vec);
    if (has_b) load_t_or_f32<T, VEC>(bias, w_f32, c, b, valid, vec);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      // the multiply-add written out, so that every instance rounds alike (no contraction left to the compiler)
      const float t = (v[i] - mean) * rstd;
      o[i] = has_w ? (has_b ? fmaf(t, w[i], b[i]) : t * w[i]) : (has_b ? t + b[i] : t);
    }
    store_n<T, VEC>(y + rw * stride_y + c, o, valid, vec);
  };
  auto sq_dev = [&](int c, const float(&v)[VEC], float mean) {
    float s = 0.f;
    if constexpr (VECIO) {  // a group lies wholly inside the row or wholly past its end (cols % VEC == 0)
#pragma unroll
      for (int i = 0; i < VEC; ++i) s = fmaf(v[i] - mean, v[i] - mean, s);
      return c < cols ? s : 0.f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) s += c + i < cols ? (v[i] - mean) * (v[i] - mean) : 0.f;
    return s;
  };

  if constexpr (NV > 0) {
    // The rows live in registers: one read of x (and residual), one write of y. Every row's loads are issued
    // before the first reduction, and the ROWS rows share the reductions' barriers.
    // weight and bias are read after the row reductions' barriers: start bringing them into L1 now
    if (has_w) {
      if (w_f32) prefetch_groups_l1<float, NV, VEC>(static_cast<const float*>(weight), cols);
      else prefetch_groups_l1<T, NV, VEC>(static_cast<const T*>(weight), cols);
    }
    if (has_b) {
      if (w_f32) prefetch_groups_l1<float, NV, VEC>(static_cast<const float*>(bias), cols);
      else prefetch_groups_l1<T, NV, VEC>(static_cast<const T*>(bias), cols);
    }
    const int live = rows - row < ROWS ? (int)(rows - row) : ROWS;  // rows of this group inside the tensor
    float v[ROWS][NV][VEC];
    if constexpr (VECIO) {
      load_rows_vec<T, ROWS, NV, VEC>(xr, stride_x, cols, live, v);
    } else {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r < live) {
          load_groups<T, NV, VEC, VECIO>(xr + r * stride_x, cols, v[r]);
        } else {
#pragma unroll
          for (int g = 0; g < NV; ++g)
#pragma unroll
            for (int i = 0; i < VEC; ++i) v[r][g][i] = 0.f;
        }
      }
    }
    if (has_res) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r >= live) continue;
        float rs[NV][VEC];
        load_groups_t_or_f32<T, NV, VEC, VECIO>(residual, res_f32, (row + r) * stride_res, cols, rs);
#pragma unroll
        for (int g = 0; g < NV; ++g) {
          const int c = (g * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
          for (int i = 0; i < VEC; ++i)
            v[r][g][i] = res_f32 ? v[r][g][i] + rs[g][i] : round_to<T>(v[r][g][i] + rs[g][i]);
          if (c < cols)
            store_t_or_f32<T, VEC>(residual_out, res_f32, (row + r) * stride_res_out + c, v[r][g], cols - c, vec);
        }
      }
    }
    float mean[ROWS], rstd[ROWS];
    if (!rms) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        mean[r] = 0.f;
#pragma unroll
        for (int g = 0; g < NV; ++g)
#pragma unroll
          for (int i = 0; i < VEC; ++i) mean[r] += v[r][g][i];
      }
      row_sum<ROWS>(mean, smem);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) mean[r] = row_mean(mean[r]);
    } else {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) mean[r] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rstd[r] = 0.f;
#pragma unroll
      for (int g = 0; g < NV; ++g) rstd[r] += sq_dev((g * blockDim.x + threadIdx.x) * VEC, v[r][g], mean[r]);
    }
    row_sum<ROWS>(rstd, smem);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rstd[r] = rsqrtf(rstd[r] * inv_cols + eps);
      if (r >= live) continue;
#pragma unroll
      for (int g = 0; g < NV; ++g) {
        const int c = (g * blockDim.x + threadIdx.x) * VEC;
        if (c < cols) output(row + r, c, v[r][g], cols - c, mean[r], rstd[r]);
      }
      if (threadIdx.x == 0) {
        rstd_out[row + r] = rstd[r];
        if (mean_out != nullptr) mean_out[row + r] = mean[r];
      }
    }
  } else {
    // Streaming: rows too long for registers are read again (from L2) for each pass.
    float mean = 0.f, rstd;
    const int step = blockDim.x * VEC;
    bool first = true;
    if (!rms) {
      float s[1] = {0.f};
      for (int c = threadIdx.x * VEC; c < cols; c += step) {
        float v[VEC];
        input(c, v, cols - c, true);
#pragma unroll
        for (int i = 0; i < VEC; ++i) s[0] += v[i];
      }
      row_sum<1>(s, smem);
      mean = row_mean(s[0]);
      first = false;
    }
    float ss[1] = {0.f};
    for (int c = threadIdx.x * VEC; c < cols; c += step) {
      float v[VEC];
      input(c, v, cols - c, first);
      ss[0] += sq_dev(c, v, mean);
    }
    row_sum<1>(ss, smem);
    rstd = rsqrtf(ss[0] * inv_cols + eps);
    for (int c = threadIdx.x * VEC; c < cols; c += step) {
      float v[VEC];
      input(c, v, cols - c, false);
      output(row, c, v, cols - c, mean, rstd);
    }
    if (threadIdx.x == 0) {
      rstd_out[row] = rstd;
      if (mean_out != nullptr) mean_out[row] = mean;
    }
  }
}

// The forward's team kernel: 16-bit rows with 16-byte I/O whose flags are one of NORM_FWD_SPECS (SPEC, a weight and
// residual of the rows' dtype). A row belongs to a team of blockDim.x threads (one warp, or several with blockDim.y
// == 1); the grid is persistent, each team walks rows team, team + teams, ... Each thread keeps CH 16-byte chunks of
// its row as raw bits (chunk k at column (k * blockDim.x + threadIdx.x) * 8) and converts them where they are used:
// the next row's chunks are loaded before this row's reductions and stay in flight across them, and a warp team
// reduces by shuffles alone (several warps: one barrier a reduction, the partial sums alternating between two
// buffers). PREFETCH false: no next row in flight (fewer registers; the SM's other teams hide the loads). WREG: the
// thread's chunks of the weight (and bias) loaded once, held in registers for every row; else read a row at a time
// after the reductions (L1 or L2). The rows stream past L1 (ld.global.nc.L1::no_allocate), which keeps the weight
// there. RELOAD (without PREFETCH and WREG): no chunk is held across a reduction; the row is loaded into L1 and read
// again from there after each reduction (x and the residual, their sum recomputed), the last time to leave L1, so
// that a thread needs few registers and an SM holds a full complement of teams (bounded for 4 blocks of 512 threads,
// 3 with 4 chunks a thread: at 32 registers those spill).
// Same arithmetic as norm_fwd_kernel a value; the row sums are added in the team's order.
// MEGAKERN_NORM_TEAM_MAXNREG (tuning, NVRTC only): a cap on its registers a thread in place of the launch bounds.
#ifdef MEGAKERN_NORM_TEAM_MAXNREG
#define MEGAKERN_NORM_TEAM_BOUNDS __maxnreg__(MEGAKERN_NORM_TEAM_MAXNREG)
#else
#define MEGAKERN_NORM_TEAM_BOUNDS __launch_bounds__(512, RELOAD ? (CH > 2 ? 3 : 4) : 1)
#endif
template <typename T, int CH, int SPEC, bool PREFETCH, bool WREG, bool RELOAD>
__global__ void MEGAKERN_NORM_TEAM_BOUNDS
norm_fwd_team_kernel(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ weight,
                     const T* __restrict__ bias, T* __restrict__ y, T* __restrict__ residual_out,
                     float* __restrict__ mean_out, float* __restrict__ rstd_out, i64 rows, int cols, i64 stride_x,
                     i64 stride_res, i64 stride_y, i64 stride_res_out, float eps) {
  static_assert(sizeof(T) == 2, "16-bit rows");
  static_assert((SPEC & NORM_HAS_WEIGHT) && !(SPEC & (NORM_W_F32 | NORM_RES_F32)), "one of NORM_FWD_SPECS");
  static_assert(!(RELOAD && (PREFETCH || WREG)), "RELOAD holds nothing across a row's reductions");
  constexpr int VEC = 8;
  constexpr bool RMS = SPEC & NORM_RMS, HAS_B = SPEC & NORM_HAS_BIAS, RES = SPEC & NORM_HAS_RESIDUAL;
  __shared__ float partial[2][32];
  const i64 teams = (i64)gridDim.x * blockDim.y;
  i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) return;  // a whole block where blockDim.y == 1; else a warp team, which meets no barrier
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const float inv_cols = 1.f / cols;
  int buf = 0;
  auto team_sum = [&](float v) {
    v = warp_sum(v);
    if (warps == 1) return v;
    if (lane == 0) partial[buf][warp] = v;
    __syncthreads();
    v = warp_sum(lane < warps ? partial[buf][lane] : 0.f);
    buf ^= 1;
    return v;
  };
  auto column = [&](int k) { return (k * blockDim.x + threadIdx.x) * VEC; };
  // After a reduction the chunks are unpacked again rather than kept as floats (twice the registers): an empty asm
  // statement that "changes" them keeps the compiler from reusing the earlier conversion.
  auto opaque = [](uint4(&c)[CH]) {
#pragma unroll
    for (int k = 0; k < CH; ++k) asm volatile("" : "+r"(c[k].x), "+r"(c[k].y), "+r"(c[k].z), "+r"(c[k].w));
  };
  constexpr uint4 zero = {0u, 0u, 0u, 0u};
  // 16 bytes of a row by the read-only path, with an L1 policy: 0 past L1 (no_allocate), 1 into L1 to stay there
  // (evict_last), 2 from L1 for the last time (evict_first)
  auto load = [](const T* p, int policy) {
    uint4 v;
    if (policy == 0)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else if (policy == 1)
      asm volatile("ld.global.nc.L1::evict_last.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
      asm volatile("ld.global.nc.L1::evict_first.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  };
  // a row's first read: past L1, or (RELOAD) into it for the reads after the reductions
  constexpr int first_policy = RELOAD ? 1 : 0;
  // x + residual, rounded to T, 8 values at a time
  auto add = [](const uint4& xa, const uint4& ra) {
    float a[VEC], b[VEC];
    unpack16<T, VEC>(&xa, a);
    unpack16<T, VEC>(&ra, b);
    uint4 h;
    T* e = reinterpret_cast<T*>(&h);
#pragma unroll
    for (int i = 0; i < VEC; ++i) e[i] = from_float<T>(a[i] + b[i]);
    return h;
  };
  uint4 wk[WREG ? CH : 1], bk[WREG && HAS_B ? CH : 1];
  if constexpr (WREG) {
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int c = column(k);
      wk[k] = c < cols ? *reinterpret_cast<const uint4*>(weight + c) : zero;
      if constexpr (HAS_B) bk[k] = c < cols ? *reinterpret_cast<const uint4*>(bias + c) : zero;
    }
  }
  uint4 nx[CH], nr[RES ? CH : 1];
  // the chunks of row r; a row past the end reads the last row again (no branch between the loads)
  auto fetch = [&](i64 r) {
    r = r < rows ? r : rows - 1;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int c = column(k);
      nx[k] = c < cols ? load(x + r * stride_x + c, first_policy) : zero;
      if constexpr (RES) nr[k] = c < cols ? load(residual + r * stride_res + c, first_policy) : zero;
    }
  };
  // after a reduction: the chunks unpacked again from the same registers, or (RELOAD) read again from L1
  auto again = [&](uint4(&h)[CH], bool last) {
    if constexpr (RELOAD) {
#pragma unroll
      for (int k = 0; k < CH; ++k) {
        const int c = column(k);
        const uint4 a = c < cols ? load(x + row * stride_x + c, last ? 2 : 1) : zero;
        if constexpr (RES) h[k] = add(a, c < cols ? load(residual + row * stride_res + c, last ? 2 : 1) : zero);
        else h[k] = a;
      }
    } else {
      opaque(h);
    }
  };
  if constexpr (PREFETCH) fetch(row);
  for (; row < rows; row += teams) {
    uint4 h[CH];
    if constexpr (!PREFETCH) fetch(row);
    if constexpr (RES) {
#pragma unroll
      for (int k = 0; k < CH; ++k) {
        h[k] = add(nx[k], nr[k]);
        const int c = column(k);
        if (c < cols) *reinterpret_cast<uint4*>(residual_out + row * stride_res_out + c) = h[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < CH; ++k) h[k] = nx[k];
    }
    if constexpr (PREFETCH) fetch(row + teams);
    float mean = 0.f;
    if constexpr (!RMS) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < CH; ++k) {
        float v[VEC];
        unpack16<T, VEC>(&h[k], v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) s += v[i];
      }
      s = team_sum(s);
      again(h, false);
      mean = s * inv_cols;
      mean += fmaf(-mean, (float)cols, s) * inv_cols;  // as norm_fwd_kernel's row_mean
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      float v[VEC], s = 0.f;
      unpack16<T, VEC>(&h[k], v);
#pragma unroll
      for (int i = 0; i < VEC; ++i) s = fmaf(v[i] - mean, v[i] - mean, s);
      ss += column(k) < cols ? s : 0.f;
    }
    const float rstd = rsqrtf(team_sum(ss) * inv_cols + eps);
    again(h, true);
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int c = column(k);
      if (c >= cols) continue;
      float v[VEC], w[VEC], b[VEC], o[VEC];
      unpack16<T, VEC>(&h[k], v);
      const uint4 wr = WREG ? wk[k] : *reinterpret_cast<const uint4*>(weight + c);
      unpack16<T, VEC>(&wr, w);
      if constexpr (HAS_B) {
        const uint4 br = WREG ? bk[k] : *reinterpret_cast<const uint4*>(bias + c);
        unpack16<T, VEC>(&br, b);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float t = (v[i] - mean) * rstd;
        o[i] = HAS_B ? fmaf(t, w[i], b[i]) : t * w[i];
      }
      uint4 packed;  // stored as streaming (st.global.cs: evict first), which measured 2% faster at hidden 1024
      T* e = reinterpret_cast<T*>(&packed);
#pragma unroll
      for (int i = 0; i < VEC; ++i) e[i] = from_float<T>(o[i]);
      asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(y + row * stride_y + c), "r"(packed.x),
                   "r"(packed.y), "r"(packed.z), "r"(packed.w) : "memory");
    }
    if (threadIdx.x == 0) {
      rstd_out[row] = rstd;
      if (!RMS && mean_out != nullptr) mean_out[row] = mean;
    }
  }
}

template <typename T, int NV, bool HAS_DB, bool VECIO>
__global__ void __launch_bounds__(512)
norm_bwd_kernel(const void* __restrict__ x, const T* __restrict__ dy, const void* __restrict__ dres_out,
                const void* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd,
                T* __restrict__ dx, float* __restrict__ dres, float* __restrict__ dw_partial,
                float* __restrict__ db_partial, i64 rows, int cols, i64 stride_x, i64 stride_dy,
                i64 stride_dres_out, i64 stride_dx, i64 stride_dres, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float smem[64];
  constexpr bool vec = VECIO;
  const bool rms = flags & NORM_RMS, x_f32 = flags & NORM_RES_F32;
  const bool has_w = flags & NORM_HAS_WEIGHT, w_f32 = flags & NORM_W_F32, has_dw = flags & NORM_HAS_DW;
  const bool has_dres_out = flags & NORM_HAS_DRES_OUT, has_dres = flags & NORM_HAS_DRES;
  const int slot = blockIdx.x * blockDim.y + threadIdx.y;  // this row slot's line of the partials
  const i64 row_step = (i64)gridDim.x * blockDim.y;
  const float inv_cols = 1.f / cols;

  // Pass 1 for a group: xhat, dy and the two row sums sum(g * xhat), sum(g).
  auto pass1 = [&](i64 row, int c, int valid, float mu, float rs, float(&xh)[VEC], float(&d)[VEC],
                   float(&sums)[2]) {
    float w[VEC];
    load_t_or_f32<T, VEC>(x, x_f32, row * stride_x + c, xh, valid, vec);
    load_n<T, VEC>(dy + row * stride_dy + c, d, valid, vec);
    if (has_w) load_t_or_f32<T, VEC>(weight, w_f32, c, w, valid, vec);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      xh[i] = i < valid ? (xh[i] - mu) * rs : 0.f;
      const float g = has_w ? d[i] * w[i] : d[i];
      sums[0] += g * xh[i];
      sums[1] += g;
    }
  };
  // Pass 2 for a group: dx (+ d residual_out), stored; dw / db contributions added to acc_w / acc_b.
  auto pass2 = [&](i64 row, int c, int valid, float rs, float a, float b, const float(&xh)[VEC],
                   const float(&d)[VEC], float(&acc_w)[VEC], float(&acc_b)[VEC]) {
    float w[VEC], o[VEC], r[VEC];
    if (has_w) load_t_or_f32<T, VEC>(weight, w_f32, c, w, valid, vec);
    if (has_dres_out) load_t_or_f32<T, VEC>(dres_out, x_f32, row * stride_dres_out + c, r, valid, vec);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float g = has_w ? d[i] * w[i] : d[i];
      o[i] = rs * (g - xh[i] * a - b);
      if (has_dres_out) o[i] += r[i];
      acc_w[i] += d[i] * xh[i];
      if (HAS_DB) acc_b[i] += d[i];
    }
    store_n<T, VEC>(dx + row * stride_dx + c, o, valid, vec);
    if (has_dres) store_n<float, VEC>(dres + row * stride_dres + c, o, valid, vec);
  };
  auto row_stats = [&](i64 row, float& mu, float& rs) {
    mu = rms ? 0.f : mean[row];
    rs = rstd[row];
  };
  auto finish_sums = [&](float(&sums)[2], float& a, float& b) {
    row_sum<2>(sums, smem);
    a = sums[0] * inv_cols;
    b = rms ? 0.f : sums[1] * inv_cols;
  };
  float* pw = dw_partial + (i64)slot * cols;
  float* pb = HAS_DB ? db_partial + (i64)slot * cols : nullptr;

  if constexpr (NV > 0) {
    // x and dy of a row are loaded in one phase (all groups in flight) and held in registers across the row
    // reduction; dw / db accumulate in registers over the rows this slot visits and are written once at the end.
    float acc_w[NV][VEC], acc_b[HAS_DB ? NV : 1][VEC];
#pragma unroll
    for (int g = 0; g < NV; ++g)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        acc_w[g][i] = 0.f;
        acc_b[HAS_DB ? g : 0][i] = 0.f;
      }
    // Software pipelining: the next row's x and dy are loaded before this row's reduction and stay in flight
    // across its barriers. With 16-byte I/O of 16-bit rows they stay raw bits until the next iteration converts
    // them: a conversion right after the loads would wait for them there (and a branch between x's and dy's loads
    // would wait for x's before issuing dy's). fp32 rows keep converted prefetches (raw ones spill more there).
    float xh[NV][VEC], d[NV][VEC];
    // One row: its statistics, the two row sums, dx stored and the dw / db contributions added (xh, d converted)
    auto row_work = [&](i64 row) {
      float sums[2] = {0.f, 0.f}, mu, rs, a, b;
      row_stats(row, mu, rs);
#pragma unroll
      for (int g = 0; g < NV; ++g) {
        const int c = (g * blockDim.x + threadIdx.x) * VEC;
        float w[VEC] = {};
        if (has_w && c < cols) load_t_or_f32<T, VEC>(weight, w_f32, c, w, cols - c, vec);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          xh[g][i] = c + i < cols ? (xh[g][i] - mu) * rs : 0.f;
          const float gw = has_w ? d[g][i] * w[i] : d[g][i];
          sums[0] += gw * xh[g][i];
          sums[1] += gw;
        }
      }
      finish_sums(sums, a, b);
#pragma unroll
      for (int g = 0; g < NV; ++g) {
        const int c = (g * blockDim.x + threadIdx.x) * VEC;
        if (c < cols) pass2(row, c, cols - c, rs, a, b, xh[g], d[g], acc_w[g], acc_b[HAS_DB ? g : 0]);
      }
    };
    const bool raw_prefetch = VECIO && sizeof(T) == 2 && !x_f32;  // (an fp32 residual stream: converted)
    if constexpr (VECIO && sizeof(T) == 2) {
      if (raw_prefetch) {
        constexpr int CH = VEC * sizeof(T) / 16;
        uint4 xraw[NV][CH], draw[NV][CH];
        auto fetch = [&](i64 row) {  // predicated loads only, no conversion
          const T* xr = static_cast<const T*>(x) + row * stride_x;
          const T* dr = dy + row * stride_dy;
#pragma unroll
          for (int g = 0; g < NV; ++g) {
            const int c = (g * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
            for (int k = 0; k < CH; ++k) {
              xraw[g][k] = c < cols ? reinterpret_cast<const uint4*>(xr + c)[k] : make_uint4(0u, 0u, 0u, 0u);
              draw[g][k] = c < cols ? reinterpret_cast<const uint4*>(dr + c)[k] : make_uint4(0u, 0u, 0u, 0u);
            }
          }
        };
        if (slot < rows) fetch(slot);
        for (i64 row = slot; row < rows; row += row_step) {
#pragma unroll
          for (int g = 0; g < NV; ++g) {
            unpack16<T, VEC>(xraw[g], xh[g]);
            unpack16<T, VEC>(draw[g], d[g]);
          }
          if (row + row_step < rows) fetch(row + row_step);
          row_work(row);
        }
      }
    }
    if (!raw_prefetch) {
      float xn[NV][VEC], dn[NV][VEC];
      auto load_row = [&](i64 row, float(&xv)[NV][VEC], float(&dv)[NV][VEC]) {
        load_groups_t_or_f32<T, NV, VEC, VECIO>(x, x_f32, row * stride_x, cols, xv);
        load_groups<T, NV, VEC, VECIO>(dy + row * stride_dy, cols, dv);
      };
      if (slot < rows) load_row(slot, xn, dn);
      for (i64 row = slot; row < rows; row += row_step) {
#pragma unroll
        for (int g = 0; g < NV; ++g)
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            xh[g][i] = xn[g][i];
            d[g][i] = dn[g][i];
          }
        if (row + row_step < rows) load_row(row + row_step, xn, dn);
        row_work(row);
      }
    }
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
      if (c >= cols) continue;
      if (has_dw) store_n<float, VEC>(pw + c, acc_w[g], cols - c, vec);
      if (HAS_DB) store_n<float, VEC>(pb + c, acc_b[g], cols - c, vec);
    }
  } else {
    // Streaming: as above, with the partial lines updated in place in global memory (each thread owns
    // its columns of its slot's line, so no two threads touch one element).
    const int step = blockDim.x * VEC;
    const float zero[VEC] = {};
    for (int c = threadIdx.x * VEC; c < cols; c += step) {
      if (has_dw) store_n<float, VEC>(pw + c, zero, cols - c, vec);
      if (HAS_DB) store_n<float, VEC>(pb + c, zero, cols - c, vec);
    }
    for (i64 row = slot; row < rows; row += row_step) {
      float sums[2] = {0.f, 0.f}, mu, rs, a, b;
      row_stats(row, mu, rs);
      for (int c = threadIdx.x * VEC; c < cols; c += step) {
        float xh[VEC], d[VEC];
        pass1(row, c, cols - c, mu, rs, xh, d, sums);
      }
      finish_sums(sums, a, b);
      for (int c = threadIdx.x * VEC; c < cols; c += step) {
        float xh[VEC], d[VEC], s[2] = {0.f, 0.f}, acc_w[VEC], acc_b[VEC];
        pass1(row, c, cols - c, mu, rs, xh, d, s);
        if (has_dw) load_n<float, VEC>(pw + c, acc_w, cols - c, vec);
        if (HAS_DB) load_n<float, VEC>(pb + c, acc_b, cols - c, vec);
        pass2(row, c, cols - c, rs, a, b, xh, d, acc_w, acc_b);
        if (has_dw) store_n<float, VEC>(pw + c, acc_w, cols - c, vec);
        if (HAS_DB) store_n<float, VEC>(pb + c, acc_b, cols - c, vec);
      }
    }
  }
}

// The staged backward: a row of a block's persistent sequence at a time, one block a row slot (blockDim.y == 1), x and
// dy of the kernel's dtype T (16-bit), 16-byte aligned rows. The next row's x and dy are copied into shared memory
// (cp.async, each thread its own groups) while this row is reduced and written, so the prefetch takes no registers;
// the dweight (dbias) sums stay in registers for NV <= 2 and in shared memory above (again each thread its own
// columns: no barrier guards them). Dynamic shared memory: norm_staged_smem_bytes (norm.h).
// SPEC: 0, the flags read at run time, or one of NORM_BWD_SPECS (norm.h), the same flags as constants; a 16-bit
// weight is then loaded once, kept packed in registers for every row of the block (NV <= 2; at 4 it would spill).
template <typename T, int NV, bool HAS_DB, int SPEC>
__global__ void __launch_bounds__(512)
norm_bwd_staged_kernel(const T* __restrict__ x, const T* __restrict__ dy, const void* __restrict__ dres_out,
                       const void* __restrict__ weight, const float* __restrict__ mean,
                       const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ dres,
                       float* __restrict__ dw_partial, float* __restrict__ db_partial, i64 rows, int cols,
                       i64 stride_x, i64 stride_dy, i64 stride_dres_out, i64 stride_dx, i64 stride_dres, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr bool ACC_SMEM = NV > 2;  // as norm_staged_smem_bytes
  static_assert(sizeof(T) == 2, "the staged backward takes 16-bit rows");
  extern __shared__ __align__(16) unsigned char staged_smem[];
  __shared__ float smem[64];
  const int f = SPEC ? SPEC : flags;  // a constant in the specialized instances: their unused paths fold away
  const bool rms = f & NORM_RMS, has_w = f & NORM_HAS_WEIGHT, w_f32 = f & NORM_W_F32;
  const bool has_dw = f & NORM_HAS_DW, has_dres_out = f & NORM_HAS_DRES_OUT, has_dres = f & NORM_HAS_DRES;
  const bool res_f32 = flags & NORM_RES_F32;
  // a specialized instance's 16-bit weight: this thread's groups, loaded once, packed (NV <= 2)
  constexpr bool W_KEPT = SPEC != 0 && NV <= 2 && (SPEC & NORM_HAS_WEIGHT) && !(SPEC & NORM_W_F32);
  uint4 w_kept[W_KEPT ? NV : 1];
  if constexpr (W_KEPT) {
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
      w_kept[g] = c < cols ? *reinterpret_cast<const uint4*>(static_cast<const T*>(weight) + c) : make_uint4(0, 0, 0, 0);
    }
  }
  auto load_w = [&](int g, int c, float(&w)[VEC]) {
    if constexpr (W_KEPT) unpack16<T, VEC>(&w_kept[g], w);
    else load_t_or_f32<T, VEC>(weight, w_f32, c, w, VEC, true);
  };
  const float inv_cols = 1.f / cols;
  float* sw = reinterpret_cast<float*>(staged_smem);  // [cols] dweight sums, then [cols] dbias sums (ACC_SMEM)
  float* sb = sw + cols;
  T* xs = reinterpret_cast<T*>(staged_smem + (ACC_SMEM ? (HAS_DB ? 8 : 4) * (i64)cols : 0));
  T* ds = xs + cols;
  const i64 row_step = gridDim.x;

  float acc_w[ACC_SMEM ? 1 : NV][VEC], acc_b[(ACC_SMEM || !HAS_DB) ? 1 : NV][VEC];
#pragma unroll
  for (int g = 0; g < NV; ++g) {
    const int c = (g * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if constexpr (ACC_SMEM) {
        if (c < cols) {
          sw[c + i] = 0.f;
          if constexpr (HAS_DB) sb[c + i] = 0.f;
        }
      } else {
        acc_w[g][i] = 0.f;
        if constexpr (HAS_DB) acc_b[g][i] = 0.f;
      }
    }
  }
  auto stage = [&](i64 row) {  // this thread's groups of the row's x and dy, copied into shared memory
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
      if (c < cols) {
        cp_async16(xs + c, x + row * stride_x + c);
        cp_async16(ds + c, dy + row * stride_dy + c);
      }
    }
    cp_async_commit();
  };

  if (blockIdx.x < rows) stage(blockIdx.x);
  for (i64 row = blockIdx.x; row < rows; row += row_step) {
    float xh[NV][VEC], d[NV][VEC];
    cp_async_wait_all();  // this thread's copies of the row (only its own columns are read below)
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
      if (c < cols) {
        load16<T>(xs + c, xh[g]);
        load16<T>(ds + c, d[g]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) xh[g][i] = d[g][i] = 0.f;
      }
    }
    // the reads above are consumed (converted) before the next row's copies overwrite the same bytes
    if (row + row_step < rows) stage(row + row_step);
    const float mu = rms ? 0.f : mean[row], rs = rstd[row];
    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
      float w[VEC];
      if (has_w && c < cols) load_w(g, c, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        xh[g][i] = c < cols ? (xh[g][i] - mu) * rs : 0.f;
        const float gw = has_w && c < cols ? d[g][i] * w[i] : d[g][i];
        sums[0] += gw * xh[g][i];
        sums[1] += gw;
      }
    }
    row_sum<2>(sums, smem);
    const float a = sums[0] * inv_cols, b = rms ? 0.f : sums[1] * inv_cols;
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
      if (c >= cols) continue;
      float w[VEC], r[VEC], o[VEC];
      if (has_w) load_w(g, c, w);
      if (has_dres_out) load_t_or_f32<T, VEC>(dres_out, res_f32, row * stride_dres_out + c, r, VEC, true);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float gw = has_w ? d[g][i] * w[i] : d[g][i];
        const float t = gw - xh[g][i] * a - b;
        // the residual gradient's multiply-add written out: the compiler contracted it only where the residual was
        // a compile-time constant, so the specialized instances and the generic one rounded differently
        o[i] = has_dres_out ? fmaf(rs, t, r[i]) : rs * t;
        if constexpr (ACC_SMEM) {
          sw[c + i] += d[g][i] * xh[g][i];
          if constexpr (HAS_DB) sb[c + i] += d[g][i];
        } else {
          acc_w[g][i] += d[g][i] * xh[g][i];
          if constexpr (HAS_DB) acc_b[g][i] += d[g][i];
        }
      }
      store_n<T, VEC>(dx + row * stride_dx + c, o, VEC, true);
      if (has_dres) store_n<float, VEC>(dres + row * stride_dres + c, o, VEC, true);
    }
  }
  float* pw = dw_partial + (i64)blockIdx.x * cols;
  float* pb = HAS_DB ? db_partial + (i64)blockIdx.x * cols : nullptr;
#pragma unroll
  for (int g = 0; g < NV; ++g) {
    const int c = (g * blockDim.x + threadIdx.x) * VEC;
    if (c >= cols) continue;
    if constexpr (ACC_SMEM) {
      if (has_dw) store_n<float, VEC>(pw + c, *reinterpret_cast<const float(*)[VEC]>(sw + c), VEC, true);
      if constexpr (HAS_DB) store_n<float, VEC>(pb + c, *reinterpret_cast<const float(*)[VEC]>(sb + c), VEC, true);
    } else {
      if (has_dw) store_n<float, VEC>(pw + c, acc_w[g], VEC, true);
      if constexpr (HAS_DB) store_n<float, VEC>(pb + c, acc_b[g], VEC, true);
    }
  }
}

}  // namespace megakern

#ifndef __CUDACC_RTC__
namespace megakern {

// Instantiates the kernel for each NV the launch rule can pick: NV groups of 16 bytes per thread, at most
// CAP elements (the register budget, in megakern/_norm_cuda.py too), or 0 for streaming.
// The forward's budget: 16 elements a thread, 32 for 16-bit rows (those wider than 512 threads x 16 elements take
// twice the elements a thread, so that half the threads hold the row and two rows run at once: FWD_WIDE_CAP).
template <typename T>
constexpr int norm_fwd_cap() { return sizeof(T) == 2 ? 32 : 16; }

#define MEGAKERN_NV_SWITCH(nv, CAP, ...)                                                          \
  switch (nv) {                                                                                  \
    case 0: { constexpr int NV = 0; __VA_ARGS__; break; }                                        \
    case 1: { constexpr int NV = 1; __VA_ARGS__; break; }                                        \
    case 2: { constexpr int NV = 2; __VA_ARGS__; break; }                                        \
    case 4: { constexpr int NV = 4; if constexpr (4 * 16 / sizeof(T) <= CAP) { __VA_ARGS__; break; } } \
    case 8: { constexpr int NV = 8; if constexpr (8 * 16 / sizeof(T) <= CAP) { __VA_ARGS__; break; } } \
    default: return cudaErrorInvalidValue;                                                       \
  }

template <typename T, int ROWS, bool VECIO, int SPEC>
static cudaError_t norm_fwd_r(int nv, dim3 grid, dim3 block, const NormFwdArgs& a, cudaStream_t stream) {
  if constexpr (ROWS > 1) {
    if (nv == 0) return cudaErrorInvalidValue;  // streaming takes one row at a time
  }
  MEGAKERN_NV_SWITCH(nv, norm_fwd_cap<T>(), if constexpr (ROWS == 1 || NV > 0) {
    norm_fwd_kernel<T, NV, ROWS, VECIO, SPEC><<<grid, block, 0, stream>>>(
        static_cast<const T*>(a.x), a.residual, a.weight, a.bias, static_cast<T*>(a.y), a.residual_out, a.mean,
        a.rstd, a.rows, a.cols, a.stride_x, a.stride_res, a.stride_y, a.stride_res_out, a.eps, a.flags);
  });
  return cudaGetLastError();
}

template <typename T, bool VECIO, int SPEC>
static cudaError_t norm_fwd_v(int nv, int row_batch, dim3 grid, dim3 block, const NormFwdArgs& a,
                              cudaStream_t stream) {
  switch (row_batch) {
    case 1: return norm_fwd_r<T, 1, VECIO, SPEC>(nv, grid, block, a, stream);
    case 2: return norm_fwd_r<T, 2, VECIO, SPEC>(nv, grid, block, a, stream);
    case 4: return norm_fwd_r<T, 4, VECIO, SPEC>(nv, grid, block, a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
static cudaError_t norm_fwd_t(int nv, int row_batch, dim3 grid, dim3 block, const NormFwdArgs& a,
                              cudaStream_t stream) {
  if (!(a.flags & NORM_VECTORIZED)) return norm_fwd_v<T, false, 0>(nv, row_batch, grid, block, a, stream);
  if constexpr (sizeof(T) == 2) {  // 16-bit rows: the specialized instances (NORM_FWD_SPECS)
    constexpr int RMS_W = NORM_RMS | NORM_HAS_WEIGHT, W_B = NORM_HAS_WEIGHT | NORM_HAS_BIAS, RES = NORM_HAS_RESIDUAL;
    switch (norm_fwd_spec(a.flags)) {
      case RMS_W: return norm_fwd_v<T, true, RMS_W>(nv, row_batch, grid, block, a, stream);
      case RMS_W | RES: return norm_fwd_v<T, true, RMS_W | RES>(nv, row_batch, grid, block, a, stream);
      case W_B: return norm_fwd_v<T, true, W_B>(nv, row_batch, grid, block, a, stream);
      case W_B | RES: return norm_fwd_v<T, true, W_B | RES>(nv, row_batch, grid, block, a, stream);
      default: break;
    }
  }
  return norm_fwd_v<T, true, 0>(nv, row_batch, grid, block, a, stream);
}

template <typename T, bool HAS_DB, bool VECIO>
static cudaError_t norm_bwd_v(int nv, dim3 grid, dim3 block, const NormBwdArgs& a, cudaStream_t stream, int* regs) {
  if (regs != nullptr) {  // a query, no launch
    cudaFuncAttributes attr;
    MEGAKERN_NV_SWITCH(nv, 16, MEGAKERN_CUDA_CHECK(cudaFuncGetAttributes(&attr, norm_bwd_kernel<T, NV, HAS_DB, VECIO>)));
    *regs = attr.numRegs;
    return cudaSuccess;
  }
  MEGAKERN_NV_SWITCH(nv, 16, norm_bwd_kernel<T, NV, HAS_DB, VECIO><<<grid, block, 0, stream>>>(
      a.x, static_cast<const T*>(a.dy), a.dres_out, a.weight, a.mean, a.rstd, static_cast<T*>(a.dx), a.dres,
      a.dw_partial, a.db_partial, a.rows, a.cols, a.stride_x, a.stride_dy, a.stride_dres_out, a.stride_dx,
      a.stride_dres, a.flags));
  return cudaGetLastError();
}

template <typename T, bool HAS_DB>
static cudaError_t norm_bwd_t(int nv, dim3 grid, dim3 block, const NormBwdArgs& a, cudaStream_t stream, int* regs) {
  return (a.flags & NORM_VECTORIZED) ? norm_bwd_v<T, HAS_DB, true>(nv, grid, block, a, stream, regs)
                                     : norm_bwd_v<T, HAS_DB, false>(nv, grid, block, a, stream, regs);
}

// The team kernel (NORM_TEAM, 16-bit T): a launch, or (regs non-null) a registers query.
template <typename T, int CH, int SPEC>
static cudaError_t norm_fwd_team_run(dim3 grid, dim3 block, const NormFwdArgs& a, cudaStream_t stream, int* regs) {
  const bool pf = !(a.flags & NORM_NO_PREFETCH), wreg = a.flags & NORM_WEIGHT_REGS, reload = a.flags & NORM_RELOAD;
  if (reload && (pf || wreg)) return cudaErrorInvalidValue;  // RELOAD holds nothing across a row's reductions
  auto kernel = reload ? norm_fwd_team_kernel<T, CH, SPEC, false, false, true>
                : pf   ? (wreg ? norm_fwd_team_kernel<T, CH, SPEC, true, true, false>
                               : norm_fwd_team_kernel<T, CH, SPEC, true, false, false>)
                       : (wreg ? norm_fwd_team_kernel<T, CH, SPEC, false, true, false>
                               : norm_fwd_team_kernel<T, CH, SPEC, false, false, false>);
  if (regs != nullptr) {
    cudaFuncAttributes attr;
    MEGAKERN_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    *regs = attr.numRegs;
    return cudaSuccess;
  }
  kernel<<<grid, block, 0, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.residual), static_cast<const T*>(a.weight),
      static_cast<const T*>(a.bias), static_cast<T*>(a.y), static_cast<T*>(a.residual_out), a.mean, a.rstd, a.rows,
      a.cols, a.stride_x, a.stride_res, a.stride_y, a.stride_res_out, a.eps);
  return cudaGetLastError();
}

template <typename T, int SPEC>
static cudaError_t norm_fwd_team_c(int nv, dim3 grid, dim3 block, const NormFwdArgs& a, cudaStream_t stream,
                                   int* regs) {
  switch (nv) {
    case 1: return norm_fwd_team_run<T, 1, SPEC>(grid, block, a, stream, regs);
    case 2: return norm_fwd_team_run<T, 2, SPEC>(grid, block, a, stream, regs);
    case 4: return norm_fwd_team_run<T, 4, SPEC>(grid, block, a, stream, regs);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
static cudaError_t norm_fwd_team_t(int nv, dim3 grid, dim3 block, const NormFwdArgs& a, cudaStream_t stream,
                                   int* regs) {
  constexpr int RMS_W = NORM_RMS | NORM_HAS_WEIGHT, W_B = NORM_HAS_WEIGHT | NORM_HAS_BIAS, RES = NORM_HAS_RESIDUAL;
  switch (norm_fwd_spec(a.flags)) {
    case RMS_W: return norm_fwd_team_c<T, RMS_W>(nv, grid, block, a, stream, regs);
    case RMS_W | RES: return norm_fwd_team_c<T, RMS_W | RES>(nv, grid, block, a, stream, regs);
    case W_B: return norm_fwd_team_c<T, W_B>(nv, grid, block, a, stream, regs);
    case W_B | RES: return norm_fwd_team_c<T, W_B | RES>(nv, grid, block, a, stream, regs);
    default: return cudaErrorInvalidValue;  // the team kernel takes only the specialized flags
  }
}

static cudaError_t norm_fwd_team(int dtype, int nv, dim3 grid, dim3 block, const NormFwdArgs& a,
                                 cudaStream_t stream, int* regs) {
  if (regs == nullptr && ((long long)block.x * block.y > 512 || block.x % 32 || (block.y > 1 && block.x != 32)))
    return cudaErrorInvalidValue;  // launch bounds; a team is whole warps, several teams a block only of one warp
  switch (dtype) {
    case NORM_F16: return norm_fwd_team_t<__half>(nv, grid, block, a, stream, regs);
    case NORM_BF16: return norm_fwd_team_t<__nv_bfloat16>(nv, grid, block, a, stream, regs);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t norm_fwd_num_regs(int dtype, int nv, int flags, int* regs) {
  if (!(flags & NORM_TEAM)) return cudaErrorInvalidValue;
  NormFwdArgs args{};
  args.flags = flags;
  return norm_fwd_team(dtype, nv, dim3(), dim3(), args, nullptr, regs);
}

cudaError_t norm_fwd(int dtype, int nv, int row_batch, dim3 grid, dim3 block, const NormFwdArgs& args,
                     cudaStream_t stream) {
  if (args.flags & NORM_TEAM) return norm_fwd_team(dtype, nv, grid, block, args, stream, nullptr);
  if ((long long)block.x * block.y * row_batch > 1024) return cudaErrorInvalidValue;  // the kernel's launch bounds
  switch (dtype) {
    case NORM_F32: return norm_fwd_t<float>(nv, row_batch, grid, block, args, stream);
    case NORM_F16: return norm_fwd_t<__half>(nv, row_batch, grid, block, args, stream);
    case NORM_BF16: return norm_fwd_t<__nv_bfloat16>(nv, row_batch, grid, block, args, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The staged backward (16-bit T): a launch with its dynamic shared memory, or (regs non-null) a registers query.
template <typename T, int NV, bool HAS_DB, int SPEC>
static cudaError_t norm_bwd_staged_run(dim3 grid, dim3 block, const NormBwdArgs& a, cudaStream_t stream, int* regs) {
  auto kernel = norm_bwd_staged_kernel<T, NV, HAS_DB, SPEC>;
  if (regs != nullptr) {
    cudaFuncAttributes attr;
    MEGAKERN_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    *regs = attr.numRegs;
    return cudaSuccess;
  }
  if (!(a.flags & NORM_VECTORIZED) || (a.flags & NORM_RES_F32) || block.y != 1) return cudaErrorInvalidValue;
  const long long smem = norm_staged_smem_bytes(a.cols, sizeof(T), NV, HAS_DB);
  cudaFuncAttributes attr;
  MEGAKERN_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (smem > attr.maxDynamicSharedSizeBytes)  // by default 48 KiB less the kernel's static shared memory
    MEGAKERN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<grid, block, smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.dy), a.dres_out, a.weight, a.mean, a.rstd,
      static_cast<T*>(a.dx), a.dres, a.dw_partial, a.db_partial, a.rows, a.cols, a.stride_x, a.stride_dy,
      a.stride_dres_out, a.stride_dx, a.stride_dres, a.flags);
  return cudaGetLastError();
}

template <typename T, bool HAS_DB, int SPEC>
static cudaError_t norm_bwd_staged_s(int nv, dim3 grid, dim3 block, const NormBwdArgs& a, cudaStream_t stream,
                                     int* regs) {
  switch (nv) {
    case 1: return norm_bwd_staged_run<T, 1, HAS_DB, SPEC>(grid, block, a, stream, regs);
    case 2: return norm_bwd_staged_run<T, 2, HAS_DB, SPEC>(grid, block, a, stream, regs);
    case 4: return norm_bwd_staged_run<T, 4, HAS_DB, SPEC>(grid, block, a, stream, regs);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, bool HAS_DB>
static cudaError_t norm_bwd_staged_t(int nv, dim3 grid, dim3 block, const NormBwdArgs& a, cudaStream_t stream,
                                     int* regs) {
  constexpr int RMS_W = NORM_RMS | NORM_HAS_WEIGHT | NORM_HAS_DW, W = NORM_HAS_WEIGHT | NORM_HAS_DW;
  constexpr int DRO = NORM_HAS_DRES_OUT;
  switch (norm_bwd_spec(a.flags, HAS_DB)) {
    case RMS_W: return norm_bwd_staged_s<T, HAS_DB, RMS_W>(nv, grid, block, a, stream, regs);
    case RMS_W | DRO: return norm_bwd_staged_s<T, HAS_DB, RMS_W | DRO>(nv, grid, block, a, stream, regs);
    case W: return norm_bwd_staged_s<T, HAS_DB, W>(nv, grid, block, a, stream, regs);
    case W | DRO: return norm_bwd_staged_s<T, HAS_DB, W | DRO>(nv, grid, block, a, stream, regs);
    default: return norm_bwd_staged_s<T, HAS_DB, 0>(nv, grid, block, a, stream, regs);
  }
}

static cudaError_t norm_bwd_dispatch(int dtype, int nv, bool has_db, dim3 grid, dim3 block, const NormBwdArgs& a,
                                     cudaStream_t stream, int* regs) {
  if (a.flags & NORM_STAGED) {
    switch (dtype * 2 + (has_db ? 1 : 0)) {
      case NORM_F16 * 2: return norm_bwd_staged_t<__half, false>(nv, grid, block, a, stream, regs);
      case NORM_F16 * 2 + 1: return norm_bwd_staged_t<__half, true>(nv, grid, block, a, stream, regs);
      case NORM_BF16 * 2: return norm_bwd_staged_t<__nv_bfloat16, false>(nv, grid, block, a, stream, regs);
      case NORM_BF16 * 2 + 1: return norm_bwd_staged_t<__nv_bfloat16, true>(nv, grid, block, a, stream, regs);
      default: return cudaErrorInvalidValue;  // fp32 rows: the register kernels
    }
  }
  switch (dtype * 2 + (has_db ? 1 : 0)) {
    case NORM_F32 * 2: return norm_bwd_t<float, false>(nv, grid, block, a, stream, regs);
    case NORM_F32 * 2 + 1: return norm_bwd_t<float, true>(nv, grid, block, a, stream, regs);
    case NORM_F16 * 2: return norm_bwd_t<__half, false>(nv, grid, block, a, stream, regs);
    case NORM_F16 * 2 + 1: return norm_bwd_t<__half, true>(nv, grid, block, a, stream, regs);
    case NORM_BF16 * 2: return norm_bwd_t<__nv_bfloat16, false>(nv, grid, block, a, stream, regs);
    case NORM_BF16 * 2 + 1: return norm_bwd_t<__nv_bfloat16, true>(nv, grid, block, a, stream, regs);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t norm_bwd(int dtype, int nv, bool has_db, dim3 grid, dim3 block, const NormBwdArgs& args,
                     cudaStream_t stream) {
  return norm_bwd_dispatch(dtype, nv, has_db, grid, block, args, stream, nullptr);
}

cudaError_t norm_bwd_num_regs(int dtype, int nv, bool has_db, int flags, int* regs) {
  NormBwdArgs args{};
  args.flags = flags;
  return norm_bwd_dispatch(dtype, nv, has_db, dim3(), dim3(), args, nullptr, regs);
}

}  // namespace megakern
#endif
