// Per-tensor FP8 casts: host launcher (no torch; see csrc/fp8/fp8.cu and csrc/common/common.h).
//
// Launch geometry is decided in one place, megakern/_fp8_cuda.py (grid = min(ceil(n / (256 * VEC)), SMs * 8)), and
// handed to the launcher here, so the extension and the NVRTC path run the very same kernels with the same shapes.
#pragma once

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

namespace megakern {

enum Fp8DType { FP8_IN_F32 = 0, FP8_IN_F16 = 1, FP8_IN_BF16 = 2 };  // x's dtype; mirrored in megakern/_fp8_cuda.py

// y (n bytes) = sat(x * *scale) in E4M3 (e4m3) or E5M2; with amax non-null, x's amax (NaN as +inf) maxed into
// *amax. vecio: x 16-byte aligned, y aligned to VEC bytes and n a multiple of VEC (the launcher checks). Returns
// the launch's error, if any.
cudaError_t fp8_cast(int dtype, bool e4m3, bool vecio, int grid, const void* x, void* y, const float* scale,
                     float* amax, long long n, cudaStream_t stream);

}  // namespace megakern
#endif
