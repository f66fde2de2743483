/* The low-latency decode mode on one GPU (epx.h, "Low-latency decode";
 * core/ll.h): a CUDA buffer created with config.low_latency = 1 over a comm
 * of one rank gets epx_cuda_ll_backend as its table (cuda/backend.c) and the
 * epx_ll_* calls reach epx_cuda_ll_ops. The layout is one kernel
 * (layout.cu); the rows move with the one-GPU scatter and gather kernels
 * (launch.h), so the bits are the normal one-GPU path's, which are the CPU
 * backend's. Nothing synchronises the host and nothing is allocated after
 * buffer creation: the calls can be captured in a CUDA graph and replayed
 * with a new token count (a device value). */
#ifndef EPX_CUDA_LL_LL_H
#define EPX_CUDA_LL_LL_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

struct epx_backend;
struct epx_ll_backend;
extern const struct epx_backend epx_cuda_ll_backend;
extern const struct epx_ll_backend epx_cuda_ll_ops;

/* A handle's layout in device memory: the fixed shape [E, G] rows (G =
 * max_tokens on one GPU). */
typedef struct epx_cuda_ll_layout {
  int32_t *route_row;  /* [T, K] row of each route, -1 for none (what scatter and gather read) */
  int64_t *counts;     /* [E] rows per expert */
  int64_t *offsets;    /* [E + 1] e * G */
  int32_t *src_token;  /* [E * G] the row's token, -1 past the expert's count */
  int32_t *row_expert; /* [E * G] the row's expert, -1 past the count */
  float *row_weight;   /* [E * G] its route's weight, 0 past the count (or without weights) */
} epx_cuda_ll_layout_t;

/* The layout of T = min(*num_tokens, rows) tokens (num_tokens NULL: rows)
 * of topk_idx [rows, K] over E experts in blocks of G rows: expert e's rows
 * are the tokens that chose it, in token order, from e * G. A route to an id
 * outside [0, E), or a token's second route to the same expert, is dropped.
 * recv_count [E] (int32, may be NULL) gets the counts. topk_w may be NULL.
 * route_row must be all -1 on entry (the launcher memsets it first). */
cudaError_t epx_cuda_ll_layout_launch(const int32_t *topk_idx, const float *topk_w,
                                      const int32_t *num_tokens, int64_t rows, int32_t top_k,
                                      int32_t experts, int64_t block, const epx_cuda_ll_layout_t *out,
                                      int32_t *recv_count, cudaStream_t stream);

/* src_rank [n] = 0 where src_token [n] >= 0, else -1 (one GPU: every row is
 * this rank's). */
cudaError_t epx_cuda_ll_source_launch(const int32_t *src_token, int64_t n, int32_t *src_rank,
                                      cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
