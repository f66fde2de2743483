/* The CUDA backend on W ranks over an NCCL comm (ep.c): the same calls as
 * the one-GPU backend of cuda/backend.h, and the low-latency calls, behind
 * the W-rank table (ops.c) that a buffer over more than one rank gets at
 * creation (or, in a test build, one over a single rank after
 * epx_cuda_ep_at_one_rank). */
#ifndef EPX_CUDA_EP_H
#define EPX_CUDA_EP_H

#include <cuda_runtime_api.h>

#include "core/objects.h"
#include "cuda/launch.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the W-rank paths a config asks for serve (core/backend.h's
 * supports; ep/internal.h, ep_path_t.supports): every path's answer. */
int epx_cuda_ep_supports(const epx_buffer_config_t *config, const char **why);

epx_status_t epx_cuda_ep_buffer_init(epx_buffer_t buffer);
void epx_cuda_ep_buffer_fini(epx_buffer_t buffer);
/* local: the API's verdict on this rank; agreed with the peers before
 * anything moves (except with worst_case_sizing, see ep.c). */
epx_status_t epx_cuda_ep_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                         epx_status_t local, epx_handle_t handle);
void epx_cuda_ep_handle_fini(epx_handle_t handle);
epx_status_t epx_cuda_ep_agree(epx_buffer_t buffer, epx_status_t local, const char *caller);
/* A payload call's agreement: the verdict with the call, the buffer, the
 * handle and whether grad_w is asked for, all-gathered and checked alike on
 * every rank (EPX_ERROR_SHAPE_MISMATCH naming the ranks' calls when they
 * differ). Nothing with worst_case_sizing. */
epx_status_t epx_cuda_ep_agree_call(epx_buffer_t buffer, epx_handle_t handle, int grad_w, epx_status_t local,
                                    const char *caller);
epx_status_t epx_cuda_ep_dispatch(epx_buffer_t buffer, epx_handle_t handle, const void *x, void *recv_x);
/* x_q and x_scales, or (quantize) x of the dtype with x_scales NULL. */
epx_status_t epx_cuda_ep_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, const void *x, const void *x_scales,
                                      int quantize, void *recv_x_q, void *recv_scales);
epx_status_t epx_cuda_ep_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out, void *out);
epx_status_t epx_cuda_ep_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, const void *grad_recv_x,
                                           void *grad_x, const void *x, float *grad_w);
epx_status_t epx_cuda_ep_combine_backward(epx_buffer_t buffer, epx_handle_t handle, const void *grad_out,
                                          const void *expert_out, void *grad_expert_out, float *grad_w);
epx_status_t epx_cuda_ep_weights_backward(epx_buffer_t buffer, epx_handle_t handle, const float *grad_recv_w,
                                          float *grad_w);
epx_status_t epx_cuda_ep_recv_rows(epx_handle_t handle, int64_t *rows);
epx_status_t epx_cuda_ep_recv_rows_device(epx_handle_t handle, const int64_t **rows);
epx_status_t epx_cuda_ep_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets);
epx_status_t epx_cuda_ep_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w);
epx_status_t epx_cuda_ep_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token);
epx_status_t epx_cuda_ep_stats(epx_handle_t handle, epx_handle_stats_t *stats);
int64_t epx_cuda_ep_handle_bytes(epx_handle_t handle);
/* paths[W]: EPX_PATH_FUSED for every peer when the buffer runs the fused
 * NVLink kernels (src/cuda/fused/fused.h), else EPX_PATH_HOST. */
void epx_cuda_ep_peer_paths(epx_buffer_t buffer, int32_t *paths);
epx_status_t epx_cuda_ep_traffic(epx_handle_t handle, epx_handle_traffic_t *traffic);
/* The epx_ll_* calls (core/ll.h) of a buffer on the low-latency path
 * (ll/ranks.c); a normal buffer's dispatch_send agrees the API's refusal. */
struct epx_ll_backend;
extern const struct epx_ll_backend epx_cuda_ep_ll_ops;

/* Kernels of ep/tables.cu that serve the handles of the fused path (launch.h has
 * the host path's). */
/* dst[r] = src[r] (rows of `words` 4-byte words) for r < min(*rows, row_bound)
 * (*rows on the device); dst NULL: nothing. */
cudaError_t epx_cuda_ep_copy_rows_launch(const void *src, void *dst, int32_t words, const int64_t *rows,
                                         int64_t row_bound, cudaStream_t stream);

/* The message of a routing verdict of the layout kernel (one/one.c). */
epx_status_t epx_cuda_routing_error(const char *fn, uint64_t error, int32_t K, int32_t E, int32_t C,
                                    const int32_t *topk_idx, const int32_t *locations, const char *note);

#ifdef __cplusplus
}
#endif
#endif
