// megakern._C: the one translation unit that sees torch. It turns tensors into raw pointers, strides and
// torch's current stream, and calls the torch-free launchers of csrc/<op>/. Validation and launch geometry
// live in Python (megakern/_norm_cuda.py); the checks here guard against misuse of the raw entry points.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "norm/norm.h"

namespace {

using OptTensor = c10::optional<at::Tensor>;

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda(), "megakern._C: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), "megakern._C: ", name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == like.size(0) && t.size(1) == like.size(1) && t.stride(1) == 1,
              "megakern._C: ", name, " must be a (rows, cols) view with unit column stride, got sizes ", t.sizes(),
              " strides ", t.strides());
}

const at::Tensor* opt(const OptTensor& t) { return t.has_value() ? &t.value() : nullptr; }
const void* cptr(const OptTensor& t) { return t.has_value() ? t->data_ptr() : nullptr; }
void* mptr(const OptTensor& t) { return t.has_value() ? t->data_ptr() : nullptr; }
long long row_stride(const OptTensor& t) { return t.has_value() ? t->stride(0) : 0; }

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "megakern._C: ", what, " failed: ", cudaGetErrorString(err));
}

void norm_fwd(const at::Tensor& x, const OptTensor& residual, const OptTensor& weight, const OptTensor& bias,
              at::Tensor& y, const OptTensor& residual_out, const OptTensor& mean, at::Tensor& rstd, double eps,
              int64_t flags, int64_t dtype, int64_t nv, int64_t threads, int64_t rows_per_block, int64_t grid) {
  check_rows(x, x, "x");
  check_rows(y, x, "y");
  for (auto [t, name] : {std::pair{opt(residual), "residual"}, {opt(residual_out), "residual_out"}})
    if (t) check_rows(*t, x, name);
  TORCH_CHECK(rstd.is_cuda() && rstd.numel() == x.size(0), "megakern._C: rstd must hold one float per row");
  const c10::cuda::CUDAGuard guard(x.device());
  megakern::NormFwdArgs a{x.data_ptr(), cptr(residual), cptr(weight), cptr(bias), y.data_ptr(), mptr(residual_out),
                          mean.has_value() ? mean->data_ptr<float>() : nullptr, rstd.data_ptr<float>(), x.size(0),
                          static_cast<int>(x.size(1)), x.stride(0), row_stride(residual), y.stride(0),
                          row_stride(residual_out), static_cast<float>(eps), static_cast<int>(flags)};
  check_launch(megakern::norm_fwd(static_cast<int>(dtype), static_cast<int>(nv), dim3(grid),
                                  dim3(threads, rows_per_block), a, at::cuda::getCurrentCUDAStream()),
               "norm_fwd launch");
}

void norm_bwd(const at::Tensor& x, const at::Tensor& dy, const OptTensor& dres_out, const OptTensor& weight,
              const OptTensor& mean, const at::Tensor& rstd, at::Tensor& dx, const OptTensor& dres,
              const OptTensor& dw_partial, const OptTensor& db_partial, int64_t flags, int64_t dtype, int64_t nv,
              bool has_db, int64_t threads, int64_t rows_per_block, int64_t grid) {
  check_rows(dy, dy, "dy");
  check_rows(x, dy, "x");
  check_rows(dx, dy, "dx");
  for (auto [t, name] : {std::pair{opt(dres_out), "dres_out"}, {opt(dres), "dres"}})
    if (t) check_rows(*t, dy, name);
  for (auto [t, name] : {std::pair{opt(dw_partial), "dw_partial"}, {opt(db_partial), "db_partial"}})
    if (t) TORCH_CHECK(t->is_contiguous() && t->size(0) == grid * rows_per_block && t->size(1) == dy.size(1),
                       "megakern._C: ", name, " must be contiguous (grid * rows_per_block, cols)");
  const c10::cuda::CUDAGuard guard(dy.device());
  megakern::NormBwdArgs a{x.data_ptr(), dy.data_ptr(), cptr(dres_out), cptr(weight),
                          mean.has_value() ? mean->data_ptr<float>() : nullptr, rstd.data_ptr<float>(),
                          dx.data_ptr(), dres.has_value() ? dres->data_ptr<float>() : nullptr,
                          dw_partial.has_value() ? dw_partial->data_ptr<float>() : nullptr,
                          db_partial.has_value() ? db_partial->data_ptr<float>() : nullptr, dy.size(0),
                          static_cast<int>(dy.size(1)), x.stride(0), dy.stride(0), row_stride(dres_out), dx.stride(0),
                          row_stride(dres), static_cast<int>(flags)};
  check_launch(megakern::norm_bwd(static_cast<int>(dtype), static_cast<int>(nv), has_db, dim3(grid),
                                  dim3(threads, rows_per_block), a, at::cuda::getCurrentCUDAStream()),
               "norm_bwd launch");
}

int64_t norm_bwd_num_regs(int64_t dtype, int64_t nv, bool has_db, bool vectorized) {
  int regs = 0;
  check_launch(megakern::norm_bwd_num_regs(static_cast<int>(dtype), static_cast<int>(nv), has_db, vectorized, &regs),
               "norm_bwd_num_regs");
  return regs;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megakern CUDA kernels (raw entry points; use megakern.rms_norm / megakern.layer_norm)";
  m.def("norm_fwd", &norm_fwd, "LayerNorm / RMSNorm forward (see csrc/norm/norm.cu)");
  m.def("norm_bwd", &norm_bwd, "LayerNorm / RMSNorm backward (see csrc/norm/norm.cu)");
  m.def("norm_bwd_num_regs", &norm_bwd_num_regs, "registers per thread of a norm_bwd kernel instance");
}
