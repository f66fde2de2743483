/* The one-GPU backend's table (core/backend.h): a comm of one rank, every
 * expert local, nothing to agree with a peer (one.c does the work). A CUDA
 * buffer over one rank gets it at creation (cuda/backend.c). */
#include <cuda_runtime.h>

#include "core/backend.h"
#include "cuda/backend.h"
#include "cuda/common/check.h"
#include "cuda/place/place.h"

static epx_status_t one_wait(epx_buffer_t buffer, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)buffer->config.stream), fn, "cudaStreamSynchronize");
fail:
  return status;
}

/* The device routing's hash (one read-back: recorder validation only). */
static epx_status_t one_routing_hash(epx_buffer_t buffer, const epx_routing_t *routing, uint64_t *hash) {
  return epx_cuda_routing_hash(buffer, routing, hash, one_wait);
}

/* One rank: the verdict is this rank's. */
static epx_status_t one_agree(epx_buffer_t buffer, epx_status_t local, const char *caller) {
  (void)buffer, (void)caller;
  return local;
}

static epx_status_t one_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing, epx_status_t local,
                                        epx_handle_t handle) {
  if (local != EPX_SUCCESS) return local;
  if (buffer->max_tokens == 0) epx_buffer_agree_max_tokens(buffer, routing->num_tokens);
  return epx_cuda_dispatch_layout(buffer, routing, handle);
}

static epx_status_t one_dispatch(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local, const void *x,
                                 void *recv_x) {
  return local != EPX_SUCCESS ? local : epx_cuda_dispatch(buffer, handle, x, recv_x);
}

static epx_status_t one_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local, const void *x,
                                     const void *x_scales, int quantize, void *recv_x_q, void *recv_scales) {
  return local != EPX_SUCCESS ? local
                              : epx_cuda_dispatch_fp8(buffer, handle, x, x_scales, quantize, recv_x_q, recv_scales);
}

static epx_status_t one_combine(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                const void *expert_out, void *out) {
  return local != EPX_SUCCESS ? local : epx_cuda_combine(buffer, handle, expert_out, out);
}

static epx_status_t one_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                          const void *grad_recv_x, void *grad_x, const void *x, float *grad_w) {
  return local != EPX_SUCCESS ? local : epx_cuda_dispatch_backward(buffer, handle, grad_recv_x, grad_x, x, grad_w);
}

static epx_status_t one_combine_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                         const void *grad_out, const void *expert_out, void *grad_expert_out,
                                         float *grad_w) {
  return local != EPX_SUCCESS
             ? local
             : epx_cuda_combine_backward(buffer, handle, grad_out, expert_out, grad_expert_out, grad_w);
}

static epx_status_t one_weights_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                         const float *grad_recv_w, float *grad_w) {
  return local != EPX_SUCCESS ? local : epx_cuda_weights_backward(buffer, handle, grad_recv_w, grad_w);
}

static epx_status_t one_stats(epx_handle_t handle, epx_handle_stats_t *stats) {
  *stats = (epx_handle_stats_t){0, 0, 0, 0, handle->recv_rows};
  return EPX_SUCCESS;
}

static int64_t one_handle_bytes(epx_handle_t handle) {
  (void)handle;
  return 0;
}

static epx_status_t one_expert_load(epx_buffer_t buffer, int64_t *load, int32_t reset) {
  return epx_cuda_place_expert_load(buffer, load, reset, one_wait);
}

static void one_buffer_fini(epx_buffer_t buffer) {
  epx_cuda_buffer_fini(buffer);
  epx_cuda_place_fini(buffer);
}

const epx_backend_t epx_cuda_one_backend = {
    .name = "cuda",
    .route = epx_cuda_route,
    .route_backward = epx_cuda_route_backward,
    .buffer_init = epx_cuda_buffer_init,
    .buffer_fini = one_buffer_fini,
    .set_stream = epx_cuda_set_stream,
    .validate_routing = NULL,
    .routing_hash = one_routing_hash,
    .agree = one_agree,
    .dispatch_layout = one_dispatch_layout,
    .handle_fini = epx_cuda_handle_fini,
    .dispatch = one_dispatch,
    .dispatch_fp8 = one_dispatch_fp8,
    .combine = one_combine,
    .dispatch_backward = one_dispatch_backward,
    .combine_backward = one_combine_backward,
    .weights_backward = one_weights_backward,
    .recv_rows = epx_cuda_handle_recv_rows,
    .recv_rows_device = epx_cuda_handle_recv_rows_device,
    .expert_counts = epx_cuda_handle_expert_counts,
    .recv_routing = epx_cuda_handle_recv_routing,
    .recv_source = epx_cuda_handle_recv_source,
    .stats = one_stats,
    .expert_load = one_expert_load,
    .handle_bytes = one_handle_bytes,
    .peer_paths = NULL, /* the API's default: the host path */
};
