// megakern._C: the one translation unit that sees torch. It turns tensors into raw pointers, strides and
// torch's current stream, and calls the torch-free launchers of csrc/<op>/. Validation and launch geometry
// live in Python (megakern/_norm_cuda.py, megakern/_rotary_cuda.py); the checks here guard against misuse of
// the raw entry points.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "fp8/fp8.h"
#include "norm/norm.h"
#include "rotary/rotary.h"

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
              int64_t flags, int64_t dtype, int64_t nv, int64_t row_batch, int64_t threads, int64_t rows_per_block,
              int64_t grid) {
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
  check_launch(megakern::norm_fwd(static_cast<int>(dtype), static_cast<int>(nv), static_cast<int>(row_batch),
                                  dim3(grid), dim3(threads, rows_per_block), a, at::cuda::getCurrentCUDAStream()),
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

int64_t norm_fwd_kernel_regs(int64_t dtype, int64_t nv, int64_t flags) {
  int regs = 0;
  check_launch(megakern::norm_fwd_num_regs(static_cast<int>(dtype), static_cast<int>(nv), static_cast<int>(flags),
                                           &regs),
               "norm_fwd_num_regs");
  return regs;
}

int64_t norm_bwd_kernel_regs(int64_t dtype, int64_t nv, bool has_db, int64_t flags) {
  int regs = 0;
  check_launch(megakern::norm_bwd_num_regs(static_cast<int>(dtype), static_cast<int>(nv), has_db,
                                           static_cast<int>(flags), &regs),
               "norm_bwd_num_regs");
  return regs;
}

// q / k (B, T, heads, hs) with unit stride along hs, outputs likewise (q_out may be q: in place).
void check_heads(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), "megakern._C: ", name, " must be a CUDA tensor on ", q.device());
  TORCH_CHECK(t.dim() == 4 && t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(3) == q.size(3) &&
                  t.stride(3) == 1 && t.scalar_type() == q.scalar_type(),
              "megakern._C: ", name, " must be (B, T, heads, hs) of q's dtype with unit stride along hs, got sizes ",
              t.sizes(), " strides ", t.strides());
}

void rotary(const at::Tensor& q, const OptTensor& k, at::Tensor& q_out, const OptTensor& k_out, const at::Tensor& cos,
            const at::Tensor& sin, const OptTensor& position_ids, const OptTensor& cu_seqlens, const OptTensor& offsets,
            int64_t offset, int64_t rot_half, int64_t flags, int64_t dtype, bool table_f32, bool interleaved,
            int64_t items, int64_t threads, int64_t tokens_per_block, int64_t grid, int64_t head_runs) {
  check_heads(q, q, "q");
  check_heads(q_out, q, "q_out");
  TORCH_CHECK(k.has_value() == k_out.has_value(), "megakern._C: k and k_out must be given together");
  if (k) {
    check_heads(*k, q, "k");
    check_heads(*k_out, *k, "k_out");
  }
  for (auto [t, name] : {std::pair{&cos, "cos"}, {&sin, "sin"}})
    TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->dim() == 2 && t->size(1) == rot_half &&
                    t->stride(1) == 1 && (t->scalar_type() == at::kFloat) == table_f32,
                "megakern._C: ", name, " must be a (positions, rot_half) CUDA table with unit column stride");
  for (auto [t, name] : {std::pair{opt(position_ids), "position_ids"}, {opt(cu_seqlens), "cu_seqlens"},
                         {opt(offsets), "offsets"}})
    if (t) TORCH_CHECK(t->is_cuda() && t->device() == q.device(), "megakern._C: ", name, " must be on ", q.device());
  TORCH_CHECK(!position_ids || position_ids->dim() == 2, "megakern._C: position_ids must be (1 or B, T)");
  TORCH_CHECK(!cu_seqlens || (cu_seqlens->scalar_type() == at::kInt && cu_seqlens->is_contiguous()),
              "megakern._C: cu_seqlens must be contiguous int32");
  TORCH_CHECK(grid >= 1 && head_runs >= 1 && head_runs <= 65535 && head_runs <= q.size(2) + (k ? k->size(2) : 0),
              "megakern._C: rotary launch needs grid >= 1 and 1 <= head_runs <= min(65535, heads), got ", grid, ", ",
              head_runs);
  const c10::cuda::CUDAGuard guard(q.device());
  megakern::RotaryArgs a{};
  a.q = q.data_ptr();
  a.k = k ? k->data_ptr() : nullptr;
  a.q_out = q_out.data_ptr();
  a.k_out = k_out ? k_out->data_ptr() : nullptr;
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.pos_ids = cptr(position_ids);
  a.cu_seqlens = cu_seqlens ? cu_seqlens->data_ptr<int>() : nullptr;
  a.offsets = cptr(offsets);
  a.tokens = q.size(0) * q.size(1);
  a.seqlen = q.size(1);
  a.nh = static_cast<int>(q.size(2));
  a.nkv = k ? static_cast<int>(k->size(2)) : 0;
  a.head_dim = static_cast<int>(q.size(3));
  a.rot_half = static_cast<int>(rot_half);
  a.tokens_per_block = static_cast<int>(tokens_per_block);
  a.stride_qb = q.stride(0), a.stride_qt = q.stride(1), a.stride_qh = q.stride(2);
  a.stride_qob = q_out.stride(0), a.stride_qot = q_out.stride(1), a.stride_qoh = q_out.stride(2);
  if (k) {
    a.stride_kb = k->stride(0), a.stride_kt = k->stride(1), a.stride_kh = k->stride(2);
    a.stride_kob = k_out->stride(0), a.stride_kot = k_out->stride(1), a.stride_koh = k_out->stride(2);
  }
  a.stride_cos = cos.stride(0);
  a.stride_sin = sin.stride(0);
  a.stride_pb = position_ids && position_ids->size(0) > 1 ? position_ids->stride(0) : 0;
  a.stride_pt = position_ids ? position_ids->stride(1) : 0;
  a.ndocs = cu_seqlens ? static_cast<int>(cu_seqlens->numel() - 1) : 1;
  a.offset = offset;
  a.flags = static_cast<int>(flags);
  check_launch(megakern::rotary(static_cast<int>(dtype), table_f32, interleaved, static_cast<int>(items),
                                dim3(static_cast<unsigned>(grid), static_cast<unsigned>(head_runs)),
                                dim3(threads), a, at::cuda::getCurrentCUDAStream()),
               "rotary launch");
}

void fp8_cast(const at::Tensor& x, at::Tensor& y, const at::Tensor& scale, const OptTensor& amax, int64_t dtype,
              bool e4m3, bool vecio, int64_t grid) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "megakern._C: x must be a contiguous CUDA tensor");
  TORCH_CHECK(y.device() == x.device() && y.is_contiguous() && y.numel() == x.numel() && y.element_size() == 1,
              "megakern._C: y must be a contiguous 1-byte tensor of x's size on x's device");
  for (auto [t, name] : {std::pair{&scale, "scale"}, {opt(amax), "amax"}})
    if (t) TORCH_CHECK(t->device() == x.device() && t->scalar_type() == at::kFloat && t->numel() == 1,
                       "megakern._C: ", name, " must be a one-element float32 tensor on x's device");
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(megakern::fp8_cast(static_cast<int>(dtype), e4m3, vecio, static_cast<int>(grid), x.data_ptr(),
                                  y.data_ptr(), scale.data_ptr<float>(),
                                  amax.has_value() ? amax->data_ptr<float>() : nullptr, x.numel(),
                                  at::cuda::getCurrentCUDAStream()),
               "fp8_cast launch");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megakern CUDA kernels (raw entry points; use megakern.rms_norm / megakern.layer_norm / megakern.apply_rotary / megakern.fp8.quantize)";
  m.def("norm_fwd_rows", &norm_fwd, "LayerNorm / RMSNorm forward, several rows a row group (see csrc/norm/norm.cu)");
  m.def("norm_bwd", &norm_bwd, "LayerNorm / RMSNorm backward (see csrc/norm/norm.cu)");
  m.def("norm_fwd_kernel_regs", &norm_fwd_kernel_regs,
        "registers per thread of the forward's team kernel instance a launch's flags select");
  m.def("norm_bwd_kernel_regs", &norm_bwd_kernel_regs,
        "registers per thread of the norm_bwd kernel instance a launch's flags select (register or staged kernel)");
  m.def("fp8_cast", &fp8_cast, "per-tensor FP8 cast with the amax in the same pass (see csrc/fp8/fp8.cu)");
  m.def("rotary", &rotary, "rotary position embeddings of q and k, either direction (see csrc/rotary/rotary.cu)");
}
