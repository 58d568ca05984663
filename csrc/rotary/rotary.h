// Rotary position embeddings: flags and host launcher (no torch; see csrc/common/common.h).
//
// Launch geometry is decided in one place, megakern/_rotary_cuda.py (`launch_config`), and handed to the
// launcher here, so the extension and the NVRTC path run the very same kernels with the same shapes:
//   grid.x = ceil(B * T / tokens_per_block), grid.y = runs of heads, block.x = threads (<= ROTARY_MAX_THREADS);
//   ITEMS (template, 1, 2 or 4): heads whose group of 2 x 16 bytes each thread loads before any math.
#pragma once

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>  // __host__ / __device__ (rotary_row_chunks) in translation units not compiled by nvcc
#endif

namespace megakern {

// Bit values are mirrored in megakern/_rotary_cuda.py.
enum RotaryFlags {
  ROTARY_VECTORIZED = 1 << 0,   // wide I/O: every row and table row starts 16-byte aligned (the launcher checks)
  ROTARY_CONJ = 1 << 1,         // rotate by -theta (the backward)
  ROTARY_COPY_REST = 1 << 2,    // copy features rotary_dim .. head_dim to the output (out of place)
  ROTARY_POS_IDS = 1 << 3,      // positions from position_ids (else the token index t)
  ROTARY_POS_I64 = 1 << 4,      // position_ids are int64 (else int32)
  ROTARY_CU_SEQLENS = 1 << 5,   // packed documents: positions restart at each cu_seqlens entry
  ROTARY_OFFSETS = 1 << 6,      // a per-sequence (or per-document) offset tensor is added
  ROTARY_OFFSETS_I64 = 1 << 7,  // offsets are int64 (else int32)
  ROTARY_WHOLE_CHUNKS = 1 << 8, // with ROTARY_VECTORIZED: every chunk of every group and of the table is whole and
                                // 16-byte aligned (the launcher checks), so only the 16-byte path is compiled in
  ROTARY_ROWS = 1 << 9,         // with ROTARY_VECTORIZED, without ROTARY_WHOLE_CHUNKS: rows of whole 16-byte chunks,
                                // a thread per chunk, pair partners through shared memory (tokens_per_block times
                                // the chunks a row takes <= block.x; the launcher checks)
};

// Shared-memory capacity for per-token (b, t, position): the most tokens a block may take.
constexpr int ROTARY_MAX_TOKENS = 256;
constexpr int ROTARY_MAX_THREADS = 256;

// The 16-byte chunks of a row (of `vec` elements each) that the staged-rows instance gives a thread each: the whole
// row when the features past rotary_dim are copied (ROTARY_COPY_REST), else those holding the rotary part. Mirrored
// in megakern/_rotary_cuda.py (row_chunks).
__host__ __device__ inline int rotary_row_chunks(int head_dim, int rot_half, int vec, int flags) {
  return (flags & ROTARY_COPY_REST) ? head_dim / vec : (2 * rot_half + vec - 1) / vec;
}

}  // namespace megakern

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

namespace megakern {

enum RotaryDType { ROTARY_F32 = 0, ROTARY_F16 = 1, ROTARY_BF16 = 2 };

struct RotaryArgs {
  const void* q;           // (B, T, nh, hs), unit stride along hs
  const void* k;           // (B, T, nkv, hs) or null (nkv == 0)
  void* q_out;             // q itself in place
  void* k_out;
  const void* cos;         // (positions, rot_half), fp32 or q's dtype
  const void* sin;
  const void* pos_ids;     // (Bp, T) int32 / int64, or null
  const int* cu_seqlens;   // (ndocs + 1,), or null
  const void* offsets;     // (B,) or (ndocs,) int32 / int64, or null
  long long tokens, seqlen;  // B * T, T
  int nh, nkv, head_dim, rot_half, tokens_per_block;
  long long stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh;  // in elements
  long long stride_qob, stride_qot, stride_qoh, stride_kob, stride_kot, stride_koh;
  long long stride_cos, stride_sin, stride_pb, stride_pt;
  int ndocs;
  long long offset;
  int flags;
};

// dtype: RotaryDType of q / k; table_f32: cos / sin are fp32 (else q's dtype); items in {1, 2, 4};
// args.flags & (ROTARY_VECTORIZED | ROTARY_WHOLE_CHUNKS | ROTARY_ROWS) picks the I/O instance. Returns the launch's
// error, if any (cudaErrorInvalidValue for a ROTARY_ROWS launch whose block lacks a thread per chunk).
cudaError_t rotary(int dtype, bool table_f32, bool interleaved, int items, dim3 grid, dim3 block,
                   const RotaryArgs& args, cudaStream_t stream);

}  // namespace megakern
#endif
