/* The CPU backend's table (core/backend.h): the exchange engine of
 * exchange.c and the router of route.c. Collective calls agree the calling
 * rank's verdict over the comm before anything moves. */
#include <stdint.h>
#include <stdio.h>

#include "core/transport.h"
#include "core/backend.h"
#include "core/error.h"
#include "cpu/cpu.h"

static epx_status_t cpu_buffer_init(epx_buffer_t buffer) {
  (void)buffer; /* staging buffers grow on demand */
  return EPX_SUCCESS;
}

static epx_status_t cpu_routing_hash(epx_buffer_t buffer, const epx_routing_t *routing, uint64_t *hash) {
  (void)buffer;
  *hash = routing->num_tokens ? epx_hash_topk(routing->topk_idx, routing->num_tokens * routing->top_k) : 0;
  return EPX_SUCCESS;
}

static epx_status_t cpu_agree(epx_buffer_t buffer, epx_status_t local, const char *caller) {
  return epx_comm_agree(buffer->comm, local, caller);
}

/* Agrees the verdict and, on the first call, max_tokens_per_rank, in one
 * all-reduce: {failing rank + 1, oversize rank + 1, its tokens, tokens}. */
static epx_status_t cpu_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                        epx_status_t local, epx_handle_t handle) {
  const char *fn = "epx_dispatch_layout";
  epx_comm_t comm = buffer->comm;
  int oversize = local == EPX_ERROR_CAPACITY_EXCEEDED;
  int64_t agreed[4] = {local != EPX_SUCCESS ? comm->rank + 1 : 0, oversize ? comm->rank + 1 : 0,
                       oversize ? routing->num_tokens : 0, local == EPX_SUCCESS ? routing->num_tokens : 0};
  if (comm->size > 1) {
    char message[1024];
    snprintf(message, sizeof message, "%s", epx_last_error());
    epx_status_t status = comm->ops->allreduce_max_i64(comm, fn, agreed, 4);
    if (status != EPX_SUCCESS) return status;
    if (local != EPX_SUCCESS) epx_error(local, "%s", message);
  }
  if (local != EPX_SUCCESS) return local;
  if (agreed[1])
    return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                     "%s: rank %lld has %lld tokens, above the buffer's max_tokens_per_rank %lld; "
                     "nothing moved on any rank; create the buffer with a larger "
                     "config.max_tokens_per_rank", fn, (long long)(agreed[1] - 1),
                     (long long)agreed[2], (long long)buffer->max_tokens);
  if (agreed[0])
    return epx_error(EPX_ERROR_PEER_FAILED,
                     "%s: rank %lld refused its routing (its epx_last_error says why); nothing "
                     "moved on any rank", fn, (long long)(agreed[0] - 1));
  if (buffer->max_tokens == 0) epx_buffer_agree_max_tokens(buffer, agreed[3]);
  epx_status_t status = epx_cpu_dispatch_layout(buffer, routing, handle);
  if (status != EPX_SUCCESS) return status;
  return cpu_routing_hash(buffer, routing, &handle->routing_hash);
}

static epx_status_t cpu_dispatch(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                 const void *x, void *recv_x) {
  epx_status_t status = epx_comm_agree(buffer->comm, local, "epx_dispatch");
  return status != EPX_SUCCESS ? status : epx_cpu_dispatch(buffer, handle, x, recv_x);
}

static epx_status_t cpu_combine(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                const void *expert_out, void *out) {
  epx_status_t status = epx_comm_agree(buffer->comm, local, "epx_combine");
  return status != EPX_SUCCESS ? status : epx_cpu_combine(buffer, handle, expert_out, out);
}

static epx_status_t cpu_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                          const void *grad_recv_x, void *grad_x, const void *x,
                                          float *grad_w) {
  epx_status_t status = epx_comm_agree(buffer->comm, local, "epx_dispatch_backward");
  return status != EPX_SUCCESS ? status
                               : epx_cpu_dispatch_backward(buffer, handle, grad_recv_x, grad_x, x, grad_w);
}

static epx_status_t cpu_combine_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                         const void *grad_out, const void *expert_out,
                                         void *grad_expert_out, float *grad_w) {
  epx_status_t status = epx_comm_agree(buffer->comm, local, "epx_combine_backward");
  return status != EPX_SUCCESS
             ? status
             : epx_cpu_combine_backward(buffer, handle, grad_out, expert_out, grad_expert_out, grad_w);
}

static epx_status_t cpu_weights_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                         const float *grad_recv_w, float *grad_w) {
  epx_status_t status = epx_comm_agree(buffer->comm, local, "epx_weights_backward");
  return status != EPX_SUCCESS ? status : epx_cpu_weights_backward(buffer, handle, grad_recv_w, grad_w);
}

static epx_status_t cpu_recv_rows(epx_handle_t handle, int64_t *rows) {
  *rows = handle->recv_rows;
  return EPX_SUCCESS;
}

const epx_backend_t epx_cpu_backend = {
    .name = "cpu",
    .route = epx_cpu_route,
    .route_backward = epx_cpu_route_backward,
    .buffer_init = cpu_buffer_init,
    .buffer_fini = epx_cpu_buffer_fini,
    .set_stream = NULL,
    .validate_routing = epx_cpu_validate_routing,
    .routing_hash = cpu_routing_hash,
    .agree = cpu_agree,
    .dispatch_layout = cpu_dispatch_layout,
    .handle_fini = epx_cpu_handle_fini,
    .dispatch = cpu_dispatch,
    .combine = cpu_combine,
    .dispatch_backward = cpu_dispatch_backward,
    .combine_backward = cpu_combine_backward,
    .weights_backward = cpu_weights_backward,
    .recv_rows = cpu_recv_rows,
    .recv_rows_device = NULL,
    .expert_counts = epx_cpu_handle_expert_counts,
    .recv_routing = epx_cpu_handle_recv_routing,
    .recv_source = epx_cpu_handle_recv_source,
    .stats = epx_cpu_handle_stats,
    .handle_bytes = epx_cpu_handle_bytes,
};
