/* The backend interface: what a device (CPU, CUDA) implements so that the
 * public API never asks which device it is talking to. One table per backend,
 * chosen once when a buffer is created (from config.device; see
 * src/api/backends.c) and kept in buffer->backend; routing picks its table from
 * the route config's device the same way. A device may serve buffers with
 * more than one table (CUDA: one GPU, W ranks): its buffer_init then sets
 * buffer->backend to the table that serves this buffer, once, before anything
 * else is called on it.
 *
 * The API layer has checked everything that can be checked on the host (NULLs,
 * sizes, alignment, handle ownership) before calling an operation. Collective
 * operations receive the calling rank's verdict `local`: a backend must agree
 * it with the peers before anything moves (carrying it in its first message
 * where it can), so a refusal on one rank is a refusal on every rank, and
 * return `local` itself when it failed (its message is already set). */
#ifndef EPX_CORE_BACKEND_H
#define EPX_CORE_BACKEND_H

#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

struct epx_ll_backend; /* core/ll.h */

typedef struct epx_backend {
  const char *name; /* "cpu", "cuda" */

  /* What the device serves, asked by src/api before a buffer is made (the
   * API never branches on the device): supports(config, &why) is 1, or 0
   * with *why naming what of config the backend does not serve (NULL: it
   * serves every valid config). hierarchical_auto: EPX_EXCHANGE_AUTO takes
   * the hierarchical exchange where the comm spans nodes (else only when
   * asked by name). ll: the low-latency mode's table of this backend's
   * buffers (core/ll.h), NULL where it has none. */
  int (*supports)(const epx_buffer_config_t *config, const char **why);
  int hierarchical_auto;
  const struct epx_ll_backend *ll;

  /* Routing (not collective). */
  epx_status_t (*route)(const epx_route_config_t *config, int64_t num_tokens, const float *logits,
                        const float *bias, epx_route_output_t *output);
  epx_status_t (*route_backward)(const epx_route_config_t *config, int64_t num_tokens,
                                 const float *logits, const float *bias, const int32_t *topk_idx,
                                 const float *grad_topk_w, float grad_aux_loss, float grad_z_loss,
                                 float *grad_logits);

  /* Buffers: per-buffer state (buffer->backend_state, core/objects.h),
   * created after the ranks agreed the config. set_stream orders the change after the work
   * already enqueued (CUDA); NULL when the device has no streams. */
  epx_status_t (*buffer_init)(epx_buffer_t buffer);
  void (*buffer_fini)(epx_buffer_t buffer);
  epx_status_t (*set_stream)(epx_buffer_t buffer, void *stream);

  /* Routing values the host can check before the layout (NULL: checked on
   * the device during the layout). Rank-local. */
  epx_status_t (*validate_routing)(epx_buffer_t buffer, const epx_routing_t *routing);
  /* The routing's fingerprint for recorder validation (a hash of topk_idx).
   * Rank-local; may enqueue device work and read it back. */
  epx_status_t (*routing_hash)(epx_buffer_t buffer, const epx_routing_t *routing, uint64_t *hash);
  /* Agrees a rank-local verdict across the ranks (recorder validation). */
  epx_status_t (*agree)(epx_buffer_t buffer, epx_status_t local, const char *caller);

  /* Collective: agrees `local`, the batch size (and, on the first call,
   * max_tokens_per_rank), then fills the handle's layout. */
  epx_status_t (*dispatch_layout)(epx_buffer_t buffer, const epx_routing_t *routing,
                                  epx_status_t local, epx_handle_t handle);
  void (*handle_fini)(epx_handle_t handle);

  /* Collective payload calls on a handle of this backend. */
  epx_status_t (*dispatch)(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                           const void *x, void *recv_x);
  /* fp8 rows in the buffer's fp8_format (epx.h, epx_fp8_format_t): x_q
   * [T, H] with x_scales, or, with quantize, x [T, H] of the buffer's dtype
   * (x_scales NULL) quantized once per token. NULL where the device has no
   * fp8 path: buffers with an fp8 format are then refused at creation. */
  epx_status_t (*dispatch_fp8)(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                               const void *x, const void *x_scales, int quantize, void *recv_x_q,
                               void *recv_scales);
  epx_status_t (*combine)(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                          const void *expert_out, void *out);
  epx_status_t (*dispatch_backward)(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                    const void *grad_recv_x, void *grad_x, const void *x,
                                    float *grad_w);
  epx_status_t (*combine_backward)(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                   const void *grad_out, const void *expert_out,
                                   void *grad_expert_out, float *grad_w);
  epx_status_t (*weights_backward)(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                   const float *grad_recv_w, float *grad_w);

  /* Handle queries (rank-local). recv_rows_device is NULL where the row
   * count lives on the host. */
  epx_status_t (*recv_rows)(epx_handle_t handle, int64_t *rows);
  epx_status_t (*recv_rows_device)(epx_handle_t handle, const int64_t **rows);
  epx_status_t (*expert_counts)(epx_handle_t handle, int64_t *counts, int64_t *offsets);
  epx_status_t (*recv_routing)(epx_handle_t handle, int32_t *recv_expert, float *recv_w);
  epx_status_t (*recv_source)(epx_handle_t handle, int32_t *src_rank, int32_t *src_token);
  epx_status_t (*stats)(epx_handle_t handle, epx_handle_stats_t *stats);
  /* Rows and bytes sent per link class (epx_handle_traffic); NULL where
   * this version does not count them. */
  epx_status_t (*traffic)(epx_handle_t handle, epx_handle_traffic_t *traffic);
  /* epx_buffer_expert_load: the buffer's routes per logical expert
   * [num_experts] into load (host memory), zeroed with reset; NULL where
   * this table does not count them in this version. Rank-local. */
  epx_status_t (*expert_load)(epx_buffer_t buffer, int64_t *load, int32_t reset);
  /* Host and device bytes the handle keeps alive (recorder statistics). */
  int64_t (*handle_bytes)(epx_handle_t handle);
  /* paths[W]: EPX_PATH_FUSED or EPX_PATH_HOST per peer (NULL: the host path
   * everywhere). Rank-local. */
  void (*peer_paths)(epx_buffer_t buffer, int32_t *paths);
} epx_backend_t;

#ifdef __cplusplus
}
#endif

#endif
