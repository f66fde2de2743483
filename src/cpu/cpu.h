/* The CPU backend as the backend table (src/cpu/backend.c) calls it: the
 * router (route*.c) and the exchange engine over any number of ranks on the
 * comm's transport — layout.c (the layout and the handle's accessors),
 * move.c (the payload moves), call.c (the agreement of collective calls),
 * sharing the private cpu/exchange.h. The one-rank case moves rows directly
 * with no staging. Arguments are checked by src/api/; routing values here. */
#ifndef EPX_CPU_CPU_H
#define EPX_CPU_CPU_H

#include "epx.h"
#include "core/objects.h"

struct epx_backend;
extern const struct epx_backend epx_cpu_backend;
/* The low-latency decode mode on the CPU (ll.c; core/ll.h). */
struct epx_ll_backend;
extern const struct epx_ll_backend epx_cpu_ll_backend;

/* The router (src/cpu/route.c); the public entry points in src/api/route.c
 * have checked the arguments. */
epx_status_t epx_cpu_route(const epx_route_config_t *config, int64_t num_tokens, const float *logits,
                           const float *bias, epx_route_output_t *output);
epx_status_t epx_cpu_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                    const float *logits, const float *bias, const int32_t *topk_idx,
                                    const float *grad_topk_w, float grad_aux_loss, float grad_z_loss,
                                    float *grad_logits);

/* The float64 routing reference (src/cpu/route_reference.c), behind
 * epx_reference_route / epx_reference_route_backward. */
epx_status_t epx_cpu_reference_route(const epx_route_config_t *config, int64_t num_tokens,
                                     const float *logits, const float *bias, int32_t *topk_idx,
                                     double *topk_w, int32_t *locations, int32_t *expert_counts,
                                     double *aux_loss, double *z_loss, int32_t *capacity);
epx_status_t epx_cpu_reference_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                              const float *logits, const float *bias,
                                              const int32_t *topk_idx, const float *grad_topk_w,
                                              double grad_aux_loss, double grad_z_loss,
                                              double *grad_logits);

/* Checks the routing's values on this rank (expert ids, duplicates, capacity
 * locations); the layout agrees the result across ranks. */
epx_status_t epx_cpu_validate_routing(epx_buffer_t buffer, const epx_routing_t *routing);
epx_status_t epx_cpu_buffer_init(epx_buffer_t buffer);
void epx_cpu_buffer_fini(epx_buffer_t buffer);
void epx_cpu_handle_fini(epx_handle_t handle);

/* Collective calls. Each takes this rank's verdict `local` on its arguments
 * and agrees it, with the call's identity, in its first message: a call
 * refused (or mismatched) on one rank fails on every rank before anything
 * moves; the refusing rank returns `local` with its own message. The layout
 * also agrees max_tokens_per_rank on its first call. */
epx_status_t epx_cpu_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                     epx_status_t local, epx_handle_t handle);
epx_status_t epx_cpu_dispatch(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                              const void *x, void *recv_x);
/* fp8 rows with their scales (src/cpu/fp8.c), packed one row and its
 * scales together and moved as opaque rows of that many bytes. */
epx_status_t epx_cpu_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                  const void *x, const void *x_scales, int quantize, void *recv_x_q,
                                  void *recv_scales);
epx_status_t epx_cpu_combine(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                             const void *expert_out, void *out);
epx_status_t epx_cpu_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                       const void *grad_recv_x, void *grad_x, const void *x,
                                       float *grad_w);
epx_status_t epx_cpu_combine_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                      const void *grad_out, const void *expert_out,
                                      void *grad_expert_out, float *grad_w);
epx_status_t epx_cpu_weights_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                      const float *grad_recv_w, float *grad_w);
/* A verdict agreed with nothing to move (a refused handle, a replay's
 * validation), meeting the peers' first message of the call `caller` names. */
epx_status_t epx_cpu_agree(epx_buffer_t buffer, epx_status_t local, const char *caller);

/* Handle queries (rank-local). */
epx_status_t epx_cpu_handle_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets);
epx_status_t epx_cpu_handle_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w);
epx_status_t epx_cpu_handle_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token);
/* Host bytes the handle's layout holds. */
int64_t epx_cpu_handle_bytes(epx_handle_t handle);
epx_status_t epx_cpu_handle_stats(epx_handle_t handle, epx_handle_stats_t *stats);

#endif
