/* The CUDA backend as the host library calls it: plain C declarations of
 * functions implemented in src/cuda (host C11 glue in .c files, kernels
 * behind extern "C" launchers in .cu files). The public API layer
 * (src/api/) has already checked every argument that can be checked on the
 * host (NULLs, sizes, dtype, alignment, handle ownership) before calling
 * these; they check what only the device can see (routing values).
 *
 * The API reaches the backend through epx_cuda_backend (backend.c), whose
 * buffer_init gives each buffer one of two tables for good: the one-GPU
 * table (one/ops.c over one/one.c, declared below: a comm of one rank) or
 * the W-rank table (ep/ops.c over ep/ep.c, cuda/ep/ep.h). All work is
 * enqueued on buffer->config.stream (route: config->stream) and is
 * asynchronous unless stated. A build without CUDA has no such table, and
 * the API refuses CUDA configs with EPX_ERROR_UNSUPPORTED. */
#ifndef EPX_CUDA_BACKEND_H
#define EPX_CUDA_BACKEND_H

#include <stdint.h>

#include "core/objects.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

struct epx_backend;
extern const struct epx_backend epx_cuda_backend;     /* the API's: routes, picks a buffer's table */
extern const struct epx_backend epx_cuda_one_backend; /* one GPU (one/ops.c) */
extern const struct epx_backend epx_cuda_ep_backend;  /* W ranks (ep/ops.c) */

/* What both tables share (backend.c): the stream change, and the routing's
 * hash read back once (recorder validation), after `wait` (the table's
 * bounded host wait on the buffer's stream). */
epx_status_t epx_cuda_set_stream(epx_buffer_t buffer, void *stream);
typedef epx_status_t (*epx_cuda_wait_fn)(epx_buffer_t buffer, const char *fn);
epx_status_t epx_cuda_routing_hash(epx_buffer_t buffer, const epx_routing_t *routing, uint64_t *hash,
                                   epx_cuda_wait_fn wait);

epx_status_t epx_cuda_route(const epx_route_config_t *config, int64_t num_tokens,
                            const float *logits, const float *bias, epx_route_output_t *output);
epx_status_t epx_cuda_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                     const float *logits, const float *bias,
                                     const int32_t *topk_idx, const float *grad_topk_w,
                                     float grad_aux_loss, float grad_z_loss, float *grad_logits);

/* Copies a layout's per-expert counts [E_local] and offsets [E_local + 1]
 * (device int64) into the caller's device arrays (either may be NULL) on
 * the stream: the one-rank and the W-rank handles share it. */
epx_status_t epx_cuda_copy_expert_counts(const int64_t *device_counts, const int64_t *device_offsets,
                                         int64_t experts_local, int64_t *counts, int64_t *offsets,
                                         void *stream);

/* The one-GPU backend (one/one.c). Per-buffer device state (scratch,
 * counters); called from epx_buffer_create and epx_buffer_destroy. */
epx_status_t epx_cuda_buffer_init(epx_buffer_t buffer);
void epx_cuda_buffer_fini(epx_buffer_t buffer);

/* Fills handle->backend_state and handle->recv_rows from device routing arrays. */
epx_status_t epx_cuda_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                      epx_handle_t handle);
void epx_cuda_handle_fini(epx_handle_t handle);

epx_status_t epx_cuda_dispatch(epx_buffer_t buffer, epx_handle_t handle, const void *x,
                               void *recv_x);
/* fp8 rows and scales on one GPU (src/cuda/one/fp8.cu), or quantized from
 * x of the buffer's dtype when quantize (x_scales NULL). */
epx_status_t epx_cuda_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, const void *x,
                                   const void *x_scales, int quantize, void *recv_x_q,
                                   void *recv_scales);
epx_status_t epx_cuda_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out,
                              void *out);
epx_status_t epx_cuda_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle,
                                        const void *grad_recv_x, void *grad_x, const void *x,
                                        float *grad_w);
epx_status_t epx_cuda_combine_backward(epx_buffer_t buffer, epx_handle_t handle,
                                       const void *grad_out, const void *expert_out,
                                       void *grad_expert_out, float *grad_w);

epx_status_t epx_cuda_weights_backward(epx_buffer_t buffer, epx_handle_t handle,
                                       const float *grad_recv_w, float *grad_w);

epx_status_t epx_cuda_handle_recv_rows(epx_handle_t handle, int64_t *rows);
epx_status_t epx_cuda_handle_recv_rows_device(epx_handle_t handle, const int64_t **rows);
epx_status_t epx_cuda_handle_expert_counts(epx_handle_t handle, int64_t *counts,
                                           int64_t *offsets);
epx_status_t epx_cuda_handle_recv_routing(epx_handle_t handle, int32_t *recv_expert,
                                          float *recv_w);
epx_status_t epx_cuda_handle_recv_source(epx_handle_t handle, int32_t *src_rank,
                                         int32_t *src_token);

#ifdef __cplusplus
}
#endif
#endif
