/* What the files of the W-rank backend share: the buffer's and the handle's
 * state, and the path interface. ep.c is the backend's common part (the
 * agreement of every call, the layout's sizing, counts and verdicts, the
 * handle's queries and statistics); a path moves a handle's rows and
 * answers its queries:
 *   host.c   the transport's groups (cuda/xport/xport.h: NCCL's grouped
 *            ncclSend/ncclRecv and ncclAllGather, or in-process copies)
 *            between kernels that pack and expand staging buffers;
 *   fused.c  the fused NVLink kernels (src/cuda/fused), which reach peers
 *            without load/store access through NCCL's host API themselves;
 *   hier.c   the hierarchical exchange: the host path's layout, rows moved
 *            once per other node then inside the node (NCCL's host API);
 *   ll/ranks.c  the low-latency decode mode (config.low_latency): the
 *            epx_ll_* calls over slabs of a fixed size or a fused window;
 *            the normal calls never reach it (the API refuses them on a
 *            low-latency buffer by name, epx_ll_refuse, and the refusal is
 *            agreed as any other), so its entries for them are NULL.
 * A buffer takes the first path of ep.c's list whose setup accepts it, once
 * its max_tokens_per_rank is known; every handle keeps its buffer's path.
 * Another path is a new file defining an ep_path_t and one entry in that
 * list. */
#ifndef EPX_CUDA_EP_INTERNAL_H
#define EPX_CUDA_EP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "core/align.h"
#include "core/objects.h"
#include "cuda/common/buffer.h"
#include "cuda/ep/ep.h"
#include "cuda/fused/fused.h"
#include "cuda/launch.h"
#include "cuda/xport/xport.h"
#include "epx.h"

struct epx_ll_backend; /* core/ll.h */

/* The fused module (src/cuda/fused) is compiled where NCCL has its device
 * API (nccl_device.h, NCCL >= 2.28): EPX_HAVE_FUSED. Without it the AUTO
 * path is the host path. */
#ifndef EPX_HAVE_FUSED
#define EPX_HAVE_FUSED 0
#endif

/* The fused senders move whole rows through the bulk copy engine (faster at
 * 8-32 SMs, equal from 64: bench/NOTES-gpu.md, the fused exchange). */
enum { EP_FUSED_BULK_COPY = 1 };

enum { HOME_PAIRS = 0, HOME_ROUTES = 1, RECV_PAIRS = 2, RECV_ROUTES = 3, KINDS = 4 };

struct ep_path;

/* buffer->backend_state on W ranks */
typedef struct ep_buffer {
  const struct ep_path *path; /* NULL until max_tokens_per_rank is known (ep.c, choose_path) */
  const struct epx_cuda_xport *xport; /* how rows move between the ranks (cuda/xport/xport.h) */
  void *send, *recv;  /* host path: staging (device), `bytes` each */
  size_t bytes;
  int64_t *readback;  /* pinned host copy of a handle's summary */
  size_t readback_bytes;
  /* The fused NVLink exchange (peers without load/store access relayed) or NULL: the host
   * path for every peer. `fused_tried`: created or refused once, not again. */
  epx_fused_t *fused;
  int fused_tried;
  int32_t fused_ctas; /* the SM budget, clamped to the device's SMs */
  epx_fused_plan_t *spare; /* the empty layout of an oversize rank (worst_case_sizing) */
  /* Plans of released handles, for the next layouts: every plan is sized for
   * the buffer's worst case, so reusing one saves an allocation and a free
   * (both stream-ordered, as the handle's block: capturable). */
  epx_fused_plan_t *pool[8];
  int pooled;
  int64_t id; /* 1 + the buffers made over the comm before it (the same on every rank) */
  void *path_state; /* the path's own (hier.c: its staging), or NULL */
} ep_buffer_t;

/* handle->backend_state on W ranks */
typedef struct ep_handle {
  const struct ep_path *path; /* its buffer's, fixed at the layout */
  void *block; /* one device allocation holding every array below */
  size_t block_bytes;
  epx_cuda_ep_dims_t d;
  int64_t row_bound;  /* rows of the receive layout at most */
  int64_t pair_rows;  /* receive-side pair staging rows (table size) */
  int64_t route_rows; /* receive-side route staging rows */
  epx_cuda_layout_t own;  /* validation of this rank's routing over all experts */
  epx_cuda_layout_t recv; /* the receive layout over the gathered tokens */
  float *w;               /* [T, K] this rank's weights (copy) or NULL */
  int32_t *sidx, *sloc, *shdr, *gidx, *gloc, *ghdr, *ridx, *rloc, *flags, *scan;
  float *sw, *gw;
  void *cub, *scratch;
  size_t cub_bytes;
  epx_cuda_ep_tables_t tab;
  int64_t *summary;
  int64_t *count[KINDS]; /* [W] rows per peer of each item kind (host) */
  int64_t *displ[KINDS]; /* [W] their first staging row */
  int64_t total[KINDS];
  int64_t rows; /* N on the host, -1 until read */
  epx_fused_plan_t *plan; /* the fused layout of this handle, or NULL (host path) */
  int64_t seq;            /* the comm's layout number (the same on every rank) */
  int has_w;              /* the routing came with weights (the host layout keeps a copy) */
  void *path_state;       /* the path's own (hier.c: its plan), or NULL */
} ep_handle_t;

/* How a handle's rows move. Every function is collective where the public
 * call it serves is; `fn` names that call. The summary is ep/tables.cu's
 * format (counts of every item kind per peer, every rank's header, N, this
 * rank's first invalid route). */
typedef struct ep_path {
  const char *name;
  /* What the path does not serve of a config that asks for it (the
   * exchange it names, or the mode), as core/backend.h's supports: 1, or 0
   * with *why naming it. Asked before a buffer is made (epx_cuda_ep_supports);
   * NULL: every config. */
  int (*supports)(const epx_buffer_config_t *c, const char **why);
  /* Buffer: whether this path serves it (*takes), setting up what it needs
   * (collective: every rank comes to the same answer); and its teardown. */
  epx_status_t (*setup)(epx_buffer_t b, const char *fn, int *takes);
  void (*buffer_fini)(epx_buffer_t b);
  /* The low-latency calls of the path's buffers (core/ll.h; ep.c makes each
   * dispatch's ep_handle_t, the path fills it: path_state, rows); NULL on
   * the paths of the normal calls. */
  const struct epx_ll_backend *ll;
  /* The handle's layout, enqueued (h->d, row_bound set). */
  epx_status_t (*layout)(epx_buffer_t b, const epx_routing_t *r, ep_handle_t *h, const char *fn);
  /* worst_case_sizing, this rank oversize: what its peers' layouts meet in
   * place of its own, so theirs complete empty. */
  epx_status_t (*join_oversize)(epx_buffer_t b, const epx_cuda_ep_dims_t *d, const char *fn);
  /* The summary to host memory `host` ([summary_bytes], then
   * readback_bytes(h) of the path's own): enqueued by readback, formed by
   * summary (NULL: nothing to form) once the stream reached it. */
  size_t (*readback_bytes)(const ep_handle_t *h);
  epx_status_t (*readback)(epx_buffer_t b, const ep_handle_t *h, int64_t *host, size_t summary_bytes,
                           const char *fn);
  epx_status_t (*summary)(epx_buffer_t b, const ep_handle_t *h, int64_t *host, size_t summary_bytes,
                          const char *fn);
  /* After the layout: the counts read back (default sizing) or NULL
   * (worst_case_sizing). */
  epx_status_t (*laid_out)(epx_buffer_t b, ep_handle_t *h, const int64_t *summary, const char *fn);
  void (*handle_fini)(epx_buffer_t b, ep_handle_t *h);
  /* The payload calls (agreed already), as epx_cuda_ep_* (ep.h). */
  epx_status_t (*dispatch)(epx_buffer_t b, epx_handle_t handle, const void *x, void *recv_x);
  /* NULL: the path has no fp8 dispatch, and its setup declines buffers with
   * an fp8_format (so no handle of one reaches it). */
  epx_status_t (*dispatch_fp8)(epx_buffer_t b, epx_handle_t handle, const void *x, const void *x_scales,
                               int quantize, void *recv_x_q, void *recv_scales);
  epx_status_t (*combine)(epx_buffer_t b, epx_handle_t handle, const void *expert_out, void *out);
  epx_status_t (*dispatch_backward)(epx_buffer_t b, epx_handle_t handle, const void *grad_recv_x, void *grad_x,
                                    const void *x, float *grad_w);
  epx_status_t (*combine_backward)(epx_buffer_t b, epx_handle_t handle, const void *grad_out,
                                   const void *expert_out, void *grad_expert_out, float *grad_w);
  epx_status_t (*weights_backward)(epx_buffer_t b, epx_handle_t handle, const float *grad_recv_w, float *grad_w);
  /* The handle's queries, as epx_cuda_ep_* (ep.h). */
  epx_status_t (*recv_rows_device)(epx_handle_t handle, const int64_t **rows);
  epx_status_t (*expert_counts)(epx_handle_t handle, int64_t *counts, int64_t *offsets);
  /* The rows' routing and sources, copied on the buffer's stream. */
  epx_status_t (*recv_routing)(epx_handle_t handle, int32_t *recv_expert, float *recv_w);
  epx_status_t (*recv_source)(epx_handle_t handle, int32_t *src_rank, int32_t *src_token);
  /* paths[W]: how this rank reaches each peer (EPX_PATH_FUSED or _HOST). */
  void (*peer_paths)(epx_buffer_t b, int32_t *paths);
  /* The handle's statistics; NULL: the counts per peer (ep.c). */
  epx_status_t (*stats)(epx_handle_t handle, epx_handle_stats_t *stats);
  /* The rows a dispatch sends to other ranks of this rank's node and to
   * other nodes, or a refusal; NULL: the flat exchange's items per peer
   * (ep.c). */
  epx_status_t (*traffic)(epx_handle_t handle, int64_t *same_node_rows, int64_t *other_node_rows);
} ep_path_t;

extern const ep_path_t epx_cuda_ep_host_path;  /* host.c */
extern const ep_path_t epx_cuda_ep_hier_path;  /* hier.c: EPX_EXCHANGE_HIERARCHICAL */
extern const ep_path_t epx_cuda_ep_ll_path;    /* ll/ranks.c: config.low_latency */
#if EPX_HAVE_FUSED
extern const ep_path_t epx_cuda_ep_fused_path; /* fused.c */
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Per-peer sizes of the dims' item kinds with worst_case_sizing. */
static inline int64_t kind_bound(const epx_cuda_ep_dims_t *d, int kind) {
  return kind == HOME_PAIRS || kind == RECV_PAIRS ? d->Bp : d->Br;
}

/* Items of a kind this rank holds in staging (the tables' row count). */
static inline int64_t kind_rows(const ep_handle_t *h, int kind) {
  return h->d.worst ? h->d.W * kind_bound(&h->d, kind) : h->total[kind];
}

#endif
