// LayerNorm / RMSNorm CUDA kernels: flags and host launchers (no torch; see csrc/common/common.h).
//
// Launch geometry is decided in one place, megakern/_norm_cuda.py (`launch_config`), and handed to the
// launchers here, so the extension and the NVRTC path run the very same kernels with the same shapes:
//   block = (threads per row, rows per block), rows per block > 1 only with 32 threads per row;
//   NV > 0: each thread keeps NV groups of 16 bytes of its row in registers (one read of the row); the forward's
//           row groups may take row_batch consecutive rows at once (all their loads in flight, shared barriers);
//   NV == 0: streaming, for rows too long for registers (the row is read again from L2).
#pragma once

namespace megakern {

// Bit values are mirrored in megakern/_norm_cuda.py.
enum NormFlags {
  NORM_RMS = 1 << 0,          // RMSNorm (no mean subtraction, no bias)
  NORM_VECTORIZED = 1 << 1,   // every row pointer 16-byte aligned and cols % (16 / sizeof(T)) == 0
  NORM_HAS_WEIGHT = 1 << 2,
  NORM_HAS_BIAS = 1 << 3,
  NORM_W_F32 = 1 << 4,        // weight / bias are fp32 (else T)
  NORM_HAS_RESIDUAL = 1 << 5, // fwd: residual added before the norm, sum stored to residual_out
  NORM_RES_F32 = 1 << 6,      // residual / residual_out (fwd), x / dres_out (bwd) are fp32 (else T)
  NORM_HAS_DRES_OUT = 1 << 7, // bwd: gradient of residual_out added to dx
  NORM_HAS_DRES = 1 << 8,     // bwd: dx also written as fp32 to dres (fp32 residual)
  NORM_HAS_DW = 1 << 9,       // bwd: weight gradient partials wanted
  NORM_STAGED = 1 << 10,      // bwd: the staged kernel (needs NORM_VECTORIZED and x of the kernel's dtype)
  NORM_GENERIC = 1 << 11,     // the kernel that reads its flags at run time, where a specialized one exists
  NORM_TEAM = 1 << 12,        // fwd: the persistent team kernel (16-bit rows, 16-byte I/O, one of NORM_FWD_SPECS)
  NORM_NO_PREFETCH = 1 << 13, // fwd, team kernel: without the next row's loads in flight
  NORM_WEIGHT_REGS = 1 << 14, // fwd, team kernel: the weight (and bias) held in registers for every row
  NORM_RELOAD = 1 << 15,      // fwd, team kernel: the row read again from L1 after each reduction (not with the two
                              // above)
};

}  // namespace megakern

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

namespace megakern {

// The forward's specializations: 16-bit rows with 16-byte I/O whose flags (the bits of NORM_SPEC_MASK) are one of
// these have a kernel instance with them as compile-time constants (SPEC), which keeps the pointers and branches of
// unused features out of its registers; any other call takes SPEC 0, its flags read at run time. The list is
// mirrored in megakern/_norm_cuda.py (FWD_SPECS).
constexpr int NORM_SPEC_MASK =
    NORM_RMS | NORM_HAS_WEIGHT | NORM_HAS_BIAS | NORM_W_F32 | NORM_HAS_RESIDUAL | NORM_RES_F32;
constexpr int NORM_FWD_SPECS[] = {NORM_RMS | NORM_HAS_WEIGHT, NORM_RMS | NORM_HAS_WEIGHT | NORM_HAS_RESIDUAL,
                                  NORM_HAS_WEIGHT | NORM_HAS_BIAS, NORM_HAS_WEIGHT | NORM_HAS_BIAS | NORM_HAS_RESIDUAL};

// SPEC for a forward with ``flags`` on 16-bit rows (0: the run-time flags kernel)
constexpr int norm_fwd_spec(int flags) {
  if (!(flags & NORM_VECTORIZED) || (flags & NORM_GENERIC)) return 0;
  for (int spec : NORM_FWD_SPECS)
    if ((flags & NORM_SPEC_MASK) == spec) return spec;
  return 0;
}

// The staged backward's specializations, the same way: the flags of NORM_BWD_SPEC_MASK as compile-time constants
// where they are one of these (with or without the dbias sums, a template argument of their own). Mirrored in
// megakern/_norm_cuda.py (BWD_SPECS).
constexpr int NORM_BWD_SPEC_MASK =
    NORM_RMS | NORM_HAS_WEIGHT | NORM_W_F32 | NORM_HAS_DW | NORM_HAS_DRES_OUT | NORM_HAS_DRES;
constexpr int NORM_BWD_SPECS[] = {NORM_RMS | NORM_HAS_WEIGHT | NORM_HAS_DW,
                                  NORM_RMS | NORM_HAS_WEIGHT | NORM_HAS_DW | NORM_HAS_DRES_OUT,
                                  NORM_HAS_WEIGHT | NORM_HAS_DW, NORM_HAS_WEIGHT | NORM_HAS_DW | NORM_HAS_DRES_OUT};

// SPEC for a staged backward with ``flags`` (0: the run-time flags kernel); RMSNorm takes no dbias sums
constexpr int norm_bwd_spec(int flags, bool has_db) {
  if (!(flags & NORM_STAGED) || (flags & NORM_GENERIC) || (has_db && (flags & NORM_RMS))) return 0;
  for (int spec : NORM_BWD_SPECS)
    if ((flags & NORM_BWD_SPEC_MASK) == spec) return spec;
  return 0;
}

enum NormDType { NORM_F32 = 0, NORM_F16 = 1, NORM_BF16 = 2 };

struct NormFwdArgs {
  const void* x;
  const void* residual;
  const void* weight;
  const void* bias;
  void* y;
  void* residual_out;
  float* mean;  // per-row mean (LayerNorm only), may be null
  float* rstd;  // per-row 1 / sqrt(var + eps)
  long long rows;
  int cols;
  long long stride_x, stride_res, stride_y, stride_res_out;  // row strides, in elements
  float eps;
  int flags;
};

struct NormBwdArgs {
  const void* x;         // the tensor that was normalized: x, or residual_out when a residual was fused
  const void* dy;
  const void* dres_out;  // gradient of residual_out, may be null
  const void* weight;
  const float* mean;
  const float* rstd;
  void* dx;
  float* dres;           // fp32 copy of dx for an fp32 residual, may be null
  float* dw_partial;     // [grid.x * block.y, cols] per-row-slot partial sums, may be null
  float* db_partial;     // same, for the bias; null unless has_db
  long long rows;
  int cols;
  long long stride_x, stride_dy, stride_dres_out, stride_dx, stride_dres;
  int flags;
};

// dtype: NormDType of x / y / dy / dx. nv in {0, 1, 2, 4, 8}; row_batch (forward) in {1, 2, 4}: the rows each
// row's threads take at once (1 when streaming; block.x * block.y * row_batch <= 1024); args.flags &
// NORM_VECTORIZED picks the 16-byte instance, args.flags & NORM_STAGED the staged backward (16-bit dtypes, nv in
// {1, 2, 4}, one row a block), args.flags & NORM_TEAM the forward's team kernel (16-bit dtypes, flags one of
// NORM_FWD_SPECS, nv in {1, 2, 4} chunks a thread, row_batch ignored, block.x a multiple of 32, block.y > 1 only
// with block.x == 32, at most 512 threads; NORM_RELOAD only without NORM_WEIGHT_REGS and with NORM_NO_PREFETCH).
// Returns the launch's error, if any.
cudaError_t norm_fwd(int dtype, int nv, int row_batch, dim3 grid, dim3 block, const NormFwdArgs& args,
                     cudaStream_t stream);
// Registers per thread of the forward's team kernel (flags with NORM_TEAM; nv: its chunks a thread) that the same
// arguments select (sizes its persistent grid).
cudaError_t norm_fwd_num_regs(int dtype, int nv, int flags, int* regs);
cudaError_t norm_bwd(int dtype, int nv, bool has_db, dim3 grid, dim3 block, const NormBwdArgs& args,
                     cudaStream_t stream);
// The staged backward's dynamic shared memory, in bytes, for rows of `cols` elements of `elem_bytes` each: the next
// row's x and dy, plus the dweight (and dbias) sums when they live there (nv > 2; below, in registers). Mirrored in
// megakern/_norm_cuda.py (staged_smem_bytes).
inline long long norm_staged_smem_bytes(int cols, int elem_bytes, int nv, bool has_db) {
  return (long long)cols * (2 * elem_bytes + (nv > 2 ? 4 * (has_db ? 2 : 1) : 0));
}
// Registers per thread of the backward kernel the same arguments (and the launch's flags) select (sizes its
// persistent grid).
cudaError_t norm_bwd_num_regs(int dtype, int nv, bool has_db, int flags, int* regs);

}  // namespace megakern
#endif
