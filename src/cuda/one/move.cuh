/* What the two one-GPU move kernels share (one/combine.cu's gather,
 * one/dispatch.cu's scatter): their common arguments and the launchers'
 * filling of them, the blocks and shared memory they launch with. The
 * kernels' prologues (a warp's token, slice and slot table) stay in each
 * kernel: written as a shared helper they cost registers (bench/NOTES.md). */
#ifndef EPX_CUDA_ONE_MOVE_CUH
#define EPX_CUDA_ONE_MOVE_CUH

#include <cuda_runtime.h>

#include "cuda/common/device.cuh"
#include "cuda/launch.h"

constexpr int epx_move_warps = EPX_CUDA_MOVE_WARPS; /* warps a block */
static_assert(epx_move_warps >= 8, "a token's slices (up to 8 warps) share one block");

/* Token t's K routes rows[t, K] (-1: none) between token rows and routed
 * rows, nvec 16-byte vectors each. */
struct epx_move_args {
  const uint4 *src;
  uint4 *dst;
  const int32_t *rows; /* [T, K] */
  const float *w;      /* [T, K] when weighting */
  const uint4 *other;  /* the rows the dots are formed with, when computing grad_w */
  float *grad_w;       /* [T, K] when computing grad_w */
  int64_t tokens;
  int64_t nvec;  /* 16-byte vectors per row */
  int64_t slice; /* vectors per warp's slice of a row (a multiple of 8) */
  int k;
  int wpt_shift; /* log2 of the warps per token */
};

/* Fills a launcher's common arguments; cudaErrorInvalidValue for top_k out
 * of range, grad_w without other or warps_per_token not 0, 1, 2, 4 or 8. */
static inline cudaError_t epx_move_args_fill(epx_move_args &a, epx_dtype_t dtype, const void *src, void *dst,
                                             int64_t num_tokens, int64_t hidden, const int32_t *rows,
                                             int32_t top_k, const float *w, const void *other, float *grad_w,
                                             int32_t warps_per_token) {
  if (top_k < 1 || top_k > EPX_CUDA_MAX_TOP_K || (grad_w && !other)) return cudaErrorInvalidValue;
  a.src = static_cast<const uint4 *>(src);
  a.dst = static_cast<uint4 *>(dst);
  a.rows = rows;
  a.w = w;
  a.other = static_cast<const uint4 *>(other);
  a.grad_w = grad_w;
  a.tokens = num_tokens;
  a.nvec = epx_payload_row_vectors(dtype, hidden);
  a.k = top_k;
  a.wpt_shift = epx_cuda_move_split(a.nvec, warps_per_token, &a.slice);
  return a.wpt_shift < 0 ? cudaErrorInvalidValue : cudaSuccess;
}

/* The blocks the tokens' warps fill, and the dynamic shared memory of a
 * block: a slot table of [4, K] words a warp. */
static inline int64_t epx_move_token_blocks(const epx_move_args &a) {
  return ((a.tokens << a.wpt_shift) + epx_move_warps - 1) / epx_move_warps;
}
static inline size_t epx_move_shared_bytes(int32_t top_k) {
  return (size_t)epx_move_warps * 4 * sizeof(int32_t) * (size_t)top_k;
}

#endif
