/* The W-rank backend's table (core/backend.h): a comm of W ranks over NCCL or in-process
 * (ep.c). Every payload call first agrees the ranks' verdicts and calls
 * (epx_cuda_ep_agree_call), then runs the handle's path; the low-latency
 * calls go to the buffer's path (ep.c, epx_cuda_ep_ll_ops). A CUDA buffer
 * over several ranks gets it at creation (cuda/backend.c), in either mode. */
#include "core/backend.h"
#include "core/error.h"
#include "core/nccl.h"
#include "cuda/backend.h"
#include "cuda/ep/ep.h"
#include "cuda/place/place.h"
#include "cuda/xport/xport.h"

#if EPX_HAVE_NCCL

static epx_status_t ep_wait(epx_buffer_t buffer, const char *fn) {
  return epx_cuda_xport_of(buffer->comm)->wait(buffer->comm, buffer->config.stream, fn);
}

/* The device routing's hash (one read-back: recorder validation only). */
static epx_status_t ep_routing_hash(epx_buffer_t buffer, const epx_routing_t *routing, uint64_t *hash) {
  return epx_cuda_routing_hash(buffer, routing, hash, ep_wait);
}

static epx_status_t ep_dispatch(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local, const void *x,
                                void *recv_x) {
  local = epx_cuda_ep_agree_call(buffer, handle, 0, local, "epx_dispatch");
  return local != EPX_SUCCESS ? local : epx_cuda_ep_dispatch(buffer, handle, x, recv_x);
}

/* Only buffers with an fp8_format get here (the API checks it first); their
 * handles are on a path with fp8 dispatch (ep/internal.h). */
static epx_status_t ep_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local, const void *x,
                                    const void *x_scales, int quantize, void *recv_x_q, void *recv_scales) {
  const char *fn = quantize ? "epx_dispatch_quantize" : "epx_dispatch_fp8";
  local = epx_cuda_ep_agree_call(buffer, handle, 0, local, fn);
  return local != EPX_SUCCESS
             ? local
             : epx_cuda_ep_dispatch_fp8(buffer, handle, x, x_scales, quantize, recv_x_q, recv_scales);
}

static epx_status_t ep_combine(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                               const void *expert_out, void *out) {
  local = epx_cuda_ep_agree_call(buffer, handle, 0, local, "epx_combine");
  return local != EPX_SUCCESS ? local : epx_cuda_ep_combine(buffer, handle, expert_out, out);
}

static epx_status_t ep_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                         const void *grad_recv_x, void *grad_x, const void *x, float *grad_w) {
  local = epx_cuda_ep_agree_call(buffer, handle, grad_w != NULL, local, "epx_dispatch_backward");
  return local != EPX_SUCCESS ? local
                              : epx_cuda_ep_dispatch_backward(buffer, handle, grad_recv_x, grad_x, x, grad_w);
}

static epx_status_t ep_combine_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                        const void *grad_out, const void *expert_out, void *grad_expert_out,
                                        float *grad_w) {
  local = epx_cuda_ep_agree_call(buffer, handle, grad_w != NULL, local, "epx_combine_backward");
  return local != EPX_SUCCESS
             ? local
             : epx_cuda_ep_combine_backward(buffer, handle, grad_out, expert_out, grad_expert_out, grad_w);
}

static epx_status_t ep_weights_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                        const float *grad_recv_w, float *grad_w) {
  local = epx_cuda_ep_agree_call(buffer, handle, 0, local, "epx_weights_backward");
  return local != EPX_SUCCESS ? local : epx_cuda_ep_weights_backward(buffer, handle, grad_recv_w, grad_w);
}

static epx_status_t ep_expert_load(epx_buffer_t buffer, int64_t *load, int32_t reset) {
  return epx_cuda_place_expert_load(buffer, load, reset, ep_wait);
}

static void ep_buffer_fini(epx_buffer_t buffer) {
  epx_cuda_ep_buffer_fini(buffer);
  epx_cuda_place_fini(buffer);
}

/* The layout takes the routing in rank order (place/place.h); a failure to
 * make it is this rank's verdict, agreed like any other. */
static epx_status_t ep_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing, epx_status_t local,
                                       epx_handle_t handle) {
  epx_routing_t ranked;
  if (local == EPX_SUCCESS && routing) {
    local = epx_cuda_place_routing(buffer, routing, &ranked, "epx_dispatch_layout");
    if (local == EPX_SUCCESS) routing = &ranked;
  }
  return epx_cuda_ep_dispatch_layout(buffer, routing, local, handle);
}

/* The paths hand back rank-ordered ids; the caller gets physical ones. */
static epx_status_t ep_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  epx_status_t status = epx_cuda_ep_recv_routing(handle, recv_expert, recv_w);
  const int32_t words = handle->buffer->config.layout == EPX_LAYOUT_RANK_MAJOR ? handle->top_k : 1;
  return status != EPX_SUCCESS ? status : epx_cuda_place_recv_expert(handle, recv_expert, words);
}

const epx_backend_t epx_cuda_ep_backend = {
    .name = "cuda",
    .ll = &epx_cuda_ep_ll_ops,
    .route = epx_cuda_route,
    .route_backward = epx_cuda_route_backward,
    .buffer_init = epx_cuda_ep_buffer_init,
    .buffer_fini = ep_buffer_fini,
    .set_stream = epx_cuda_set_stream,
    .validate_routing = NULL,
    .routing_hash = ep_routing_hash,
    .agree = epx_cuda_ep_agree,
    .dispatch_layout = ep_dispatch_layout,
    .handle_fini = epx_cuda_ep_handle_fini,
    .dispatch = ep_dispatch,
    .dispatch_fp8 = ep_dispatch_fp8,
    .combine = ep_combine,
    .dispatch_backward = ep_dispatch_backward,
    .combine_backward = ep_combine_backward,
    .weights_backward = ep_weights_backward,
    .recv_rows = epx_cuda_ep_recv_rows,
    .recv_rows_device = epx_cuda_ep_recv_rows_device,
    .expert_counts = epx_cuda_ep_expert_counts,
    .recv_routing = ep_recv_routing,
    .recv_source = epx_cuda_ep_recv_source,
    .stats = epx_cuda_ep_stats,
    .expert_load = ep_expert_load,
    .handle_bytes = epx_cuda_ep_handle_bytes,
    .peer_paths = epx_cuda_ep_peer_paths,
    .traffic = epx_cuda_ep_traffic,
};

#else /* a CUDA build without NCCL: one rank only, so no buffer gets this table past its creation */

/* No W-rank path in this build: a one-rank buffer's table (one/, ll/ll.c)
 * takes every exchange as its one flat level. */
int epx_cuda_ep_supports(const epx_buffer_config_t *c, const char **why) {
  (void)c, (void)why;
  return 1;
}

static epx_status_t ep_refuse(epx_buffer_t b) {
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "epx_buffer_create: this build of epx has no NCCL transport, so the CUDA backend runs on a "
                   "comm of one rank (comm has %d); rebuild with NCCL (EPX_NCCL_ROOT) or use EPX_DEVICE_CPU",
                   b->world_size);
}

const epx_backend_t epx_cuda_ep_backend = {
    .name = "cuda",
    .route = epx_cuda_route,
    .route_backward = epx_cuda_route_backward,
    .buffer_init = ep_refuse,
};

#endif
