/* A CUDA buffer's placement (epx.h, "Expert placement and replicas";
 * core/placement.h): the table uploaded at creation, the routing turned
 * into rank-ordered physical ids at the layout's entry, the ids handed
 * back turned into physical ones, and the per-logical-expert load counts
 * kept on the device.
 *
 * The exchange's kernels (one/, ep/, fused/) take expert ids in rank order
 * (core/placement.h, epx_placement_pack_device): id / E_local is the rank,
 * id % E_local the slot, the arithmetic they have always done. The layout
 * entries of one/ and ep/ pass them the routing of epx_cuda_place_routing,
 * whose kernel picks each route's replica (the CPU backend's rule, the
 * same code) and counts the load; the contiguous map's routing is its own
 * rank order, so there the kernel only counts. Low-latency buffers (ll/ll.c
 * on one rank, ep/'s low-latency path on W) take the contiguous map only
 * (cuda/backend.c, supports) and have no place_state: the calls below pass
 * their routing and ids through and refuse their load counts by name. */
#ifndef EPX_CUDA_PLACE_PLACE_H
#define EPX_CUDA_PLACE_PLACE_H

#include <stdint.h>

#include "core/objects.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* buffer->place_state: the device copy of the placement. */
typedef struct epx_cuda_place {
  int32_t *table;              /* device [epx_placement_device_words] (core/placement.h) */
  unsigned long long *load;    /* device [E] routes per logical expert since the last reset */
  int64_t *load_host;          /* pinned [E]: the read-back, so that the wait for it is the bounded one */
  int32_t *ranked;             /* device [ranked_routes] the last layout's rank-ordered routing */
  int64_t ranked_routes;
  /* The scratch before its one growth (the first layout's batch, before
   * max_tokens_per_rank was agreed): a graph captured in between still
   * reads it, so it lives as long as the buffer. */
  int32_t *ranked_before;
  int32_t identity;            /* the contiguous map: routing ids are already in rank order */
  int32_t identity_out;        /* ids handed back need no mapping (the contiguous map, or one rank) */
} epx_cuda_place_t;

/* At epx_buffer_create, after the table's buffer_init: uploads the table and
 * zeroes the counts (enqueued on the buffer's stream). */
epx_status_t epx_cuda_place_init(epx_buffer_t buffer);
void epx_cuda_place_fini(epx_buffer_t buffer);

/* *ranked = *routing with topk_idx in rank order (the buffer's scratch; the
 * caller's own array for the contiguous map), and routing's routes counted.
 * Enqueued; the scratch is grown outside a CUDA graph capture only. */
epx_status_t epx_cuda_place_routing(epx_buffer_t buffer, const epx_routing_t *routing, epx_routing_t *ranked,
                                    const char *fn);

/* The range of the caller's ids, for the layout's error messages: E, or P
 * under EPX_REPLICA_CALLER. */
int32_t epx_cuda_place_routing_ids(epx_buffer_t buffer);

/* recv_expert (written by the table's recv_routing: rank-ordered ids) made
 * physical ids in place: rows below min(*rows, bound) of `words` ids each,
 * where rows is the handle's device row count. */
epx_status_t epx_cuda_place_recv_expert(epx_handle_t handle, int32_t *recv_expert, int32_t words);

/* epx_buffer_expert_load of a CUDA buffer: the device counts, read back
 * after the stream's work (`wait`: the table's bounded host wait on the
 * buffer's stream, cuda/backend.h), zeroed with reset. */
typedef epx_status_t (*epx_cuda_place_wait_fn)(epx_buffer_t buffer, const char *fn);
epx_status_t epx_cuda_place_expert_load(epx_buffer_t buffer, int64_t *load, int32_t reset,
                                        epx_cuda_place_wait_fn wait);

/* Launchers (place.cu). */
int epx_cuda_place_rank_launch(const int32_t *table, int32_t E, int32_t P, int32_t caller, int32_t src_rank,
                               int64_t T, int32_t K, const int32_t *topk_idx, int32_t *ranked,
                               unsigned long long *load, void *stream);
int epx_cuda_place_ids_launch(const int32_t *rank_experts, int32_t *ids, int32_t words, const int64_t *rows,
                              int64_t bound, void *stream);

#ifdef __cplusplus
}
#endif
#endif
