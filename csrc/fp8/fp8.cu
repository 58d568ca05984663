// Per-tensor FP8 casts: y = sat(x * scale) in E4M3 or E5M2, and x's amax, in one pass (see megakern/fp8.py).
//
// x is a flat contiguous array of n elements (T = float, __half or __nv_bfloat16), y n bytes. Each thread moves 16
// bytes of x a step (VEC elements) in a grid-stride loop; VECIO: x and y aligned and n a multiple of VEC, so x moves
// as 16-byte and y as VEC-byte transactions, else element by element. The conversion is the hardware's
// cvt.rn.satfinite (sm_89 and newer): round to nearest even, finite values and infinities saturate to the
// format's largest, NaN stays NaN. amax: max |x| with NaN counted as +inf (so a non-finite input always shows),
// reduced per warp and per block, then one atomicMax per block on the float's bits (non-negative floats order as
// their bit patterns do). WRITE_AMAX false: the scale came from this tensor's amax already (current scaling).
//
// CUDA headers only (no torch): compiled by nvcc into megakern._C and by NVRTC (megakern/_fp8_cuda.py).
#include "common/common.h"
#include "fp8/fp8.h"

namespace megakern {

template <bool E4M3>
__device__ __forceinline__ unsigned short fp8x2(float hi, float lo) {
  unsigned short out = 0;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
  if constexpr (E4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
  }
#else
  __trap();  // built for an architecture without FP8 conversions; the launcher never runs it there
#endif
  return out;
}

__device__ __forceinline__ float abs_nan_inf(float v) { return v == v ? fabsf(v) : __int_as_float(0x7f800000); }

template <typename T, bool E4M3, bool VECIO, bool WRITE_AMAX>
__global__ void __launch_bounds__(256) fp8_cast_kernel(const T* __restrict__ x, unsigned char* __restrict__ y,
                                                       const float* __restrict__ scale, float* __restrict__ amax,
                                                       i64 n) {
  constexpr int VEC = 16 / sizeof(T);  // elements per 16 bytes of x: 4 (fp32) or 8 (fp16, bf16)
  const float s = *scale;
  float local = 0.f;
  const i64 stride = (i64)gridDim.x * blockDim.x * VEC;
  for (i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * VEC; i < n; i += stride) {
    float v[VEC];
    const int valid = n - i < VEC ? (int)(n - i) : VEC;
    load_n<T, VEC>(x + i, v, valid, VECIO);
    unsigned short packed[VEC / 2];
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      if (WRITE_AMAX) local = fmaxf(local, fmaxf(k < valid ? abs_nan_inf(v[k]) : 0.f,
                                                 k + 1 < valid ? abs_nan_inf(v[k + 1]) : 0.f));
      packed[k / 2] = fp8x2<E4M3>(v[k + 1] * s, v[k] * s);  // element k in the low byte
    }
    if (VECIO) {
      if constexpr (VEC == 8) {
        reinterpret_cast<uint2*>(y + i)[0] = *reinterpret_cast<const uint2*>(packed);
      } else {
        reinterpret_cast<unsigned int*>(y + i)[0] = *reinterpret_cast<const unsigned int*>(packed);
      }
    } else {
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(packed);
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        if (k < valid) y[i + k] = bytes[k];
    }
  }
  if (WRITE_AMAX) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, off));
    __shared__ float warp_max[256 / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_max[warp] = local;
    __syncthreads();
    if (warp == 0) {
      local = lane < (int)(blockDim.x / 32) ? warp_max[lane] : 0.f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, off));
      if (lane == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(local));
    }
  }
}

// The instances the launcher asks for (NVRTC takes them by name: megakern/_fp8_cuda.py kernel_names()).
#define MEGAKERN_FP8_ONE(T, E4M3, VECIO, AMAX) \
  template __global__ void fp8_cast_kernel<T, E4M3, VECIO, AMAX>(const T*, unsigned char*, const float*, float*, i64);
#define MEGAKERN_FP8_FORMAT(T, E4M3)                                                                \
  MEGAKERN_FP8_ONE(T, E4M3, true, true) MEGAKERN_FP8_ONE(T, E4M3, true, false)                    \
  MEGAKERN_FP8_ONE(T, E4M3, false, true) MEGAKERN_FP8_ONE(T, E4M3, false, false)
#define MEGAKERN_FP8_INSTANCES(T) MEGAKERN_FP8_FORMAT(T, true) MEGAKERN_FP8_FORMAT(T, false)

#ifndef __CUDACC_RTC__
MEGAKERN_FP8_INSTANCES(float)
MEGAKERN_FP8_INSTANCES(__half)
MEGAKERN_FP8_INSTANCES(__nv_bfloat16)

template <typename T, bool E4M3>
static cudaError_t fp8_cast_t(bool vecio, int grid, const void* x, void* y, const float* scale, float* amax, i64 n,
                              cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  unsigned char* yb = static_cast<unsigned char*>(y);
  float* a = amax ? amax : const_cast<float*>(scale);  // unused without WRITE_AMAX
  if (vecio) {
    if (amax) fp8_cast_kernel<T, E4M3, true, true><<<grid, 256, 0, stream>>>(xt, yb, scale, a, n);
    else fp8_cast_kernel<T, E4M3, true, false><<<grid, 256, 0, stream>>>(xt, yb, scale, a, n);
  } else {
    if (amax) fp8_cast_kernel<T, E4M3, false, true><<<grid, 256, 0, stream>>>(xt, yb, scale, a, n);
    else fp8_cast_kernel<T, E4M3, false, false><<<grid, 256, 0, stream>>>(xt, yb, scale, a, n);
  }
  return cudaGetLastError();
}

cudaError_t fp8_cast(int dtype, bool e4m3, bool vecio, int grid, const void* x, void* y, const float* scale,
                     float* amax, long long n, cudaStream_t stream) {
  switch (dtype * 2 + (e4m3 ? 1 : 0)) {
    case FP8_IN_F32 * 2 + 1: return fp8_cast_t<float, true>(vecio, grid, x, y, scale, amax, n, stream);
    case FP8_IN_F32 * 2: return fp8_cast_t<float, false>(vecio, grid, x, y, scale, amax, n, stream);
    case FP8_IN_F16 * 2 + 1: return fp8_cast_t<__half, true>(vecio, grid, x, y, scale, amax, n, stream);
    case FP8_IN_F16 * 2: return fp8_cast_t<__half, false>(vecio, grid, x, y, scale, amax, n, stream);
    case FP8_IN_BF16 * 2 + 1: return fp8_cast_t<__nv_bfloat16, true>(vecio, grid, x, y, scale, amax, n, stream);
    case FP8_IN_BF16 * 2: return fp8_cast_t<__nv_bfloat16, false>(vecio, grid, x, y, scale, amax, n, stream);
    default: return cudaErrorInvalidValue;
  }
}
#endif

}  // namespace megakern
