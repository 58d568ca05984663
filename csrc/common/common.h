// Shared device helpers for megakern's CUDA kernels.
//
// CUDA headers only, never torch: every kernel source compiles unchanged with `nvcc -c` (the extension
// megakern._C, bound in csrc/bindings.cpp) and with NVRTC (cupy.RawModule, megakern/_cuda.py). Host-only
// code sits behind `#ifndef __CUDACC_RTC__`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#endif

namespace megakern {

typedef long long i64;

// ---- conversions: every kernel computes in fp32 ------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Round through T and back: the value a tensor of dtype T would hold.
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

// ---- N consecutive elements of S <-> float[N] --------------------------------------------------------
// VECTORIZED: p is 16-byte aligned and all N elements exist; moved as 16-byte transactions.
// Otherwise element by element, the first `valid` only (loads give 0 beyond).
// N elements of S held as raw 16-byte chunks (loaded earlier, e.g. all of a thread's loads at once) as floats.
template <typename S, int N>
__device__ __forceinline__ void unpack16(const uint4* raw, float (&out)[N]) {
  static_assert((N * sizeof(S)) % 16 == 0, "whole 16-byte chunks");
  constexpr int PER = 16 / sizeof(S);
#pragma unroll
  for (int c = 0; c < N / PER; ++c) {
    const S* e = reinterpret_cast<const S*>(&raw[c]);
#pragma unroll
    for (int i = 0; i < PER; ++i) out[c * PER + i] = to_float(e[i]);
  }
}

template <typename S, int N>
__device__ __forceinline__ void load_n(const S* __restrict__ p, float (&out)[N], int valid, bool vectorized) {
  static_assert((N * sizeof(S)) % 16 == 0, "a group must be a whole number of 16-byte chunks");
  if (vectorized) {
    uint4 raw[N * sizeof(S) / 16];
#pragma unroll
    for (int c = 0; c < N * (int)sizeof(S) / 16; ++c) raw[c] = reinterpret_cast<const uint4*>(p)[c];
    unpack16<S, N>(raw, out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = i < valid ? to_float(p[i]) : 0.f;
  }
}

template <typename S, int N>
__device__ __forceinline__ void store_n(S* __restrict__ p, const float (&in)[N], int valid, bool vectorized) {
  if (vectorized) {
    constexpr int PER = 16 / sizeof(S);
#pragma unroll
    for (int c = 0; c < N / PER; ++c) {
      uint4 raw;
      S* e = reinterpret_cast<S*>(&raw);
#pragma unroll
      for (int i = 0; i < PER; ++i) e[i] = from_float<S>(in[c * PER + i]);
      reinterpret_cast<uint4*>(p)[c] = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < valid) p[i] = from_float<S>(in[i]);
  }
}

// NV groups of VEC elements of a row, group g at column (g * blockDim.x + threadIdx.x) * VEC, into v[g].
// All loads are issued before the first use (one straight-line phase, predicated, no branches), which is what
// keeps NV * 16 bytes per thread in flight. VECIO: 16-byte transactions (row start 16-byte aligned, cols a
// multiple of VEC); else element by element. Groups past the row's end read as 0.
template <typename S, int NV, int VEC, bool VECIO>
__device__ __forceinline__ void load_groups(const S* __restrict__ row, int cols, float (&v)[NV][VEC]) {
  if constexpr (VECIO) {
    constexpr int CH = VEC * sizeof(S) / 16;
    static_assert((VEC * sizeof(S)) % 16 == 0, "a group must be a whole number of 16-byte chunks");
    uint4 raw[NV][CH];
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
      for (int k = 0; k < CH; ++k)
        raw[g][k] = c < cols ? reinterpret_cast<const uint4*>(row + c)[k] : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int g = 0; g < NV; ++g) unpack16<S, VEC>(raw[g], v[g]);
  } else {
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[g][i] = c + i < cols ? to_float(row[c + i]) : 0.f;
    }
  }
}

// ROWS rows of NV groups each (row r at row0 + r * stride, group g as in load_groups), 16-byte transactions, every
// load of every row issued before any is converted: one straight-line phase of predicated loads, so that ROWS * NV
// * 16 bytes per thread are in flight at once (converting a row before loading the next would wait on its loads
// first). Rows from `live` on (1 <= live) hold row live - 1 again, read through its address rather than skipped:
// a condition on the row would become a branch per row, which ptxas schedules as separate blocks of loads and
// conversions. Groups past the row's end read as 0; cols a multiple of VEC, rows 16-byte aligned.
template <typename S, int ROWS, int NV, int VEC>
__device__ __forceinline__ void load_rows_vec(const S* __restrict__ row0, i64 stride, int cols, int live,
                                              float (&v)[ROWS][NV][VEC]) {
  constexpr int CH = VEC * sizeof(S) / 16;
  static_assert((VEC * sizeof(S)) % 16 == 0, "a group must be a whole number of 16-byte chunks");
  uint4 raw[ROWS][NV][CH];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const S* row = row0 + (r < live ? r : live - 1) * stride;
#pragma unroll
    for (int g = 0; g < NV; ++g) {
      const int c = (g * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
      for (int k = 0; k < CH; ++k)
        raw[r][g][k] = c < cols ? reinterpret_cast<const uint4*>(row + c)[k] : make_uint4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int g = 0; g < NV; ++g) unpack16<S, VEC>(raw[r][g], v[r][g]);
}

// Tensors whose dtype is either the kernel's T or fp32, chosen at run time (a uniform branch).
template <typename T, int NV, int VEC, bool VECIO>
__device__ __forceinline__ void load_groups_t_or_f32(const void* base, bool f32, i64 offset, int cols,
                                                     float (&v)[NV][VEC]) {
  if (f32) load_groups<float, NV, VEC, VECIO>(static_cast<const float*>(base) + offset, cols, v);
  else load_groups<T, NV, VEC, VECIO>(static_cast<const T*>(base) + offset, cols, v);
}

template <typename T, int N>
__device__ __forceinline__ void load_t_or_f32(const void* p, bool f32, i64 offset, float (&out)[N], int valid,
                                              bool vectorized) {
  if (f32) load_n<float, N>(static_cast<const float*>(p) + offset, out, valid, vectorized);
  else load_n<T, N>(static_cast<const T*>(p) + offset, out, valid, vectorized);
}

template <typename T, int N>
__device__ __forceinline__ void store_t_or_f32(void* p, bool f32, i64 offset, const float (&in)[N], int valid,
                                               bool vectorized) {
  if (f32) store_n<float, N>(static_cast<float*>(p) + offset, in, valid, vectorized);
  else store_n<T, N>(static_cast<T*>(p) + offset, in, valid, vectorized);
}

// Ask for the NV groups of this thread in L1 ahead of use (a parameter row read after a barrier).
template <typename S, int NV, int VEC>
__device__ __forceinline__ void prefetch_groups_l1(const S* row, int cols) {
#pragma unroll
  for (int g = 0; g < NV; ++g) {
    const int c = (g * blockDim.x + threadIdx.x) * VEC;
    if (c < cols) asm volatile("prefetch.global.L1 [%0];" ::"l"(row + c));
  }
}

// ---- asynchronous copies global -> shared (sm_80+): 16 bytes a copy, completed by cp_async_wait_all --------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// This thread's outstanding copies are complete and visible to it (other threads' need a barrier as well).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// 16 bytes of S at p (shared or global, 16-byte aligned) as floats.
template <typename S>
__device__ __forceinline__ void load16(const S* p, float (&out)[16 / sizeof(S)]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  unpack16<S, 16 / sizeof(S)>(&raw, out);
}

// ---- reductions --------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sums K values over the blockDim.x threads that share one row; every one of them gets the totals.
// blockDim.x is 32 (a warp per row, several rows per block) or a multiple of 32 with blockDim.y == 1.
// smem holds 32 * K floats. The leading barrier lets a block call this repeatedly on the same smem.
template <int K>
__device__ __forceinline__ void row_sum(float (&v)[K], float* smem) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if (blockDim.x == 32) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) smem[k * 32 + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(lane < warps ? smem[k * 32 + lane] : 0.f);
}

}  // namespace megakern

// ---- host-side checks ---------------------------------------------------------------------------------
#ifndef __CUDACC_RTC__
#define MEGAKERN_CUDA_CHECK(expr)                                            \
  do {                                                                       \
    cudaError_t err_ = (expr);                                               \
    if (err_ != cudaSuccess) return err_;                                    \
  } while (0)
#endif
