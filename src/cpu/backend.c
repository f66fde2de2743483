/* The CPU backend's table (core/backend.h): the exchange engine of layout.c
 * and move.c and the router of route.c. Collective calls agree the calling
 * rank's verdict, with what the call is, in their first message (call.c):
 * no round trip of their own. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/transport.h"
#include "core/backend.h"
#include "core/error.h"
#include "cpu/cpu.h"
#include "cpu/hier.h"

static epx_status_t cpu_routing_hash(epx_buffer_t buffer, const epx_routing_t *routing, uint64_t *hash) {
  (void)buffer;
  *hash = routing->num_tokens ? epx_hash_topk(routing->topk_idx, routing->num_tokens * routing->top_k) : 0;
  return EPX_SUCCESS;
}

static epx_status_t cpu_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                        epx_status_t local, epx_handle_t handle) {
  epx_status_t status = epx_cpu_dispatch_layout(buffer, routing, local, handle);
  if (status != EPX_SUCCESS) return status;
  return cpu_routing_hash(buffer, routing, &handle->routing_hash);
}

static epx_status_t cpu_recv_rows(epx_handle_t handle, int64_t *rows) {
  *rows = handle->recv_rows;
  return EPX_SUCCESS;
}

static epx_status_t cpu_traffic(epx_handle_t handle, epx_handle_traffic_t *traffic) {
  epx_cpu_traffic(handle->cpu, handle->buffer->comm, traffic);
  return EPX_SUCCESS;
}

/* The counts the layout keeps on the host (cpu/layout.c, count_load). */
static epx_status_t cpu_expert_load(epx_buffer_t buffer, int64_t *load, int32_t reset) {
  size_t bytes = sizeof(int64_t) * (size_t)buffer->config.num_experts;
  memcpy(load, buffer->expert_load, bytes);
  if (reset) memset(buffer->expert_load, 0, bytes);
  return EPX_SUCCESS;
}

const epx_backend_t epx_cpu_backend = {
    .name = "cpu",
    .supports = NULL, /* every valid config */
    .hierarchical_auto = 1,
    .ll = &epx_cpu_ll_backend,
    .route = epx_cpu_route,
    .route_backward = epx_cpu_route_backward,
    .buffer_init = epx_cpu_buffer_init,
    .buffer_fini = epx_cpu_buffer_fini,
    .set_stream = NULL,
    .validate_routing = epx_cpu_validate_routing,
    .routing_hash = cpu_routing_hash,
    .agree = epx_cpu_agree,
    .dispatch_layout = cpu_dispatch_layout,
    .handle_fini = epx_cpu_handle_fini,
    .dispatch = epx_cpu_dispatch,
    .dispatch_fp8 = epx_cpu_dispatch_fp8,
    .combine = epx_cpu_combine,
    .dispatch_backward = epx_cpu_dispatch_backward,
    .combine_backward = epx_cpu_combine_backward,
    .weights_backward = epx_cpu_weights_backward,
    .recv_rows = cpu_recv_rows,
    .recv_rows_device = NULL,
    .expert_load = cpu_expert_load,
    .expert_counts = epx_cpu_handle_expert_counts,
    .recv_routing = epx_cpu_handle_recv_routing,
    .recv_source = epx_cpu_handle_recv_source,
    .stats = epx_cpu_handle_stats,
    .traffic = cpu_traffic,
    .handle_bytes = epx_cpu_handle_bytes,
};
