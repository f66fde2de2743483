/* The load/store variant of the low-latency mode on W ranks (ll.h,
 * "window"): the fused module's symmetric window and kernels (src/cuda/fused:
 * rows stored straight into the peers' windows over NVLink, counts and
 * routing exchanged through the window by the layout kernels; a peer without
 * load/store access relayed through NCCL's host API inside the same
 * launches). Each slot of the buffer holds a fused plan; a step is the fused
 * layout of the routing cut at the device count, the fused dispatch into a
 * compact expert-major staging and its placement in the fixed shape
 * (remap.cu), and combine the reverse placement then the fused combine:
 * the fused path's bits, which are the host path's. With worst-case sizes
 * everywhere (the relay's messages too) nothing reads a count on the host:
 * graph-capturable. The staging is shared by the slots: a send leaves
 * nothing in it (its placement is enqueued inside the send). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/nccl.h"
#include "core/objects.h"
#include "core/transport.h"
#include "cuda/common/check.h"
#include "cuda/ep/internal.h" /* the fused path's bulk copy, EPX_HAVE_FUSED */
#include "cuda/ll/ll.h"
#include "cuda/xport/xport.h"

#if EPX_HAVE_NCCL && EPX_HAVE_FUSED

struct epx_cuda_ll_window {
  epx_fused_t *fused;
  epx_fused_plan_t *plans[EPX_CUDA_LL_SLOTS];
  int32_t *idx; /* [max_tokens, max_top_k] the step's routing, cut at the count */
  void *rows;   /* [W * max_tokens * min(max_top_k, El), H] compact expert-major rows */
  int32_t ctas;
};

static int window_wanted(epx_buffer_t b) {
  const epx_buffer_config_t *c = &b->config;
  /* the fused kernels move rows of the dtype only (fp8 buffers take the
   * slabs), and remap.cu places expert-major rows (rank-major: the slabs) */
  return c->exchange_path != EPX_PATH_HOST && c->fp8_format == EPX_FP8_NONE && c->layout == EPX_LAYOUT_EXPERT_MAJOR &&
         b->world_size <= EPX_FUSED_MAX_RANKS && c->max_top_k <= EPX_FUSED_MAX_TOP_K;
}

/* The fused state, agreed as the normal fused path agrees it (ep/fused.c):
 * a refusal on any rank leaves every rank on the slabs, the reason readable
 * from epx_last_error() after the successful creation. */
static epx_status_t create_fused(epx_buffer_t b, epx_fused_t **out) {
  const char *fn = "epx_buffer_create";
  const epx_buffer_config_t *c = &b->config;
  /* expert-major: the combine stages float32 partials in the window's rows;
   * the kernels' waits give up before the host's bounded waits around them */
  const epx_fused_config_t fc = {c->dtype, c->hidden, c->num_experts, c->max_top_k, b->max_tokens,
                                 0.9 * b->comm->timeout_seconds, EP_FUSED_BULK_COPY, 1};
  epx_fused_t *f = NULL;
  char reason[768] = "";
  const epx_cuda_xport_t *xport = epx_cuda_xport_of(b->comm);
  const epx_fused_ranks_t ranks = {xport == &epx_cuda_xport_nccl ? epx_nccl_comm(b->comm) : NULL, b->comm, xport};
  int64_t refused = epx_fused_create(&ranks, &fc, &f) != EPX_SUCCESS ? b->rank + 1 : 0;
  if (refused) snprintf(reason, sizeof reason, "%s", epx_last_error());
  epx_status_t status = b->comm->ops->allreduce_max_i64(b->comm, fn, &refused, 1);
  if (status == EPX_SUCCESS && !refused) {
    *out = f;
    return EPX_SUCCESS;
  }
  if (f && b->comm->failed) epx_fused_abandon(f);
  else if (f) epx_fused_destroy(f);
  if (status != EPX_SUCCESS) return status;
  if (reason[0])
    epx_error(EPX_ERROR_UNSUPPORTED, "%s: the low-latency load/store path was refused (the NCCL slabs serve every "
              "peer): %s", fn, reason);
  else
    epx_error(EPX_ERROR_UNSUPPORTED, "%s: rank %lld refused the low-latency load/store path (its epx_last_error "
              "says why); the NCCL slabs serve every peer", fn, (long long)(refused - 1));
  return EPX_SUCCESS;
}

epx_status_t epx_cuda_ll_window_create(epx_buffer_t b, epx_cuda_ll_window_t **out) {
  const char *fn = "epx_buffer_create";
  *out = NULL;
  if (!window_wanted(b)) return EPX_SUCCESS;
  epx_fused_t *f = NULL;
  epx_status_t status = create_fused(b, &f);
  if (status != EPX_SUCCESS || !f) return status;
  epx_cuda_ll_window_t *w = calloc(1, sizeof *w);
  if (!w) {
    epx_fused_destroy(f);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  w->fused = f;
  w->ctas = epx_fused_ctas(f, b->config.sm_budget);
  const int64_t Kb = b->config.max_top_k, El = b->experts_per_rank;
  const int64_t bound = (int64_t)b->world_size * b->max_tokens * (Kb < El ? Kb : El);
  for (int i = 0; i < EPX_CUDA_LL_SLOTS; i++)
    EPX_CHECK(epx_fused_plan_create(f, EPX_LAYOUT_EXPERT_MAJOR, 1, 0, stream_of(b), &w->plans[i]));
  CUDA_CHECK(cudaMalloc((void **)&w->idx, sizeof(int32_t) * (size_t)(b->max_tokens * Kb + 1)), fn,
             "cudaMalloc (the low-latency routing)");
  CUDA_CHECK(cudaMalloc(&w->rows, (size_t)(bound + 1) * (size_t)epx_buffer_row_bytes(b)), fn,
             "cudaMalloc (the low-latency compact rows)");
  *out = w;
  return EPX_SUCCESS;
fail:
  epx_cuda_ll_window_destroy(b, w);
  return status;
}

/* After the buffer's stream was waited for. Collective unless the comm
 * failed (the window is then abandoned). */
void epx_cuda_ll_window_destroy(epx_buffer_t b, epx_cuda_ll_window_t *w) {
  if (!w) return;
  for (int i = 0; i < EPX_CUDA_LL_SLOTS; i++)
    if (w->plans[i]) epx_fused_plan_destroy(w->plans[i], stream_of(b));
  cudaStreamSynchronize(stream_of(b)); /* the plans' stream-ordered frees */
  if (w->idx) cudaFree(w->idx);
  if (w->rows) cudaFree(w->rows);
  if (!b->comm->failed) epx_fused_destroy(w->fused);
  else epx_fused_abandon(w->fused);
  free(w);
}

/* A wait of an earlier fused launch that timed out (the host-mapped error
 * word): the comm fails, as on the normal fused path. */
static epx_status_t window_alive(epx_buffer_t b, const epx_cuda_ll_window_t *w, const char *fn) {
  int32_t peer = -1;
  const char *phase = "";
  if (!epx_fused_error(w->fused, &peer, &phase)) return EPX_SUCCESS;
  char what[768], shared[512];
  epx_fused_co_resident_note(w->fused, shared, sizeof shared);
  snprintf(what, sizeof what, "rank %d did not answer the low-latency load/store exchange (%s) within the comm's "
           "timeout, or the relay to it failed%s", (int)peer, phase ? phase : "?", shared);
  return epx_cuda_xport_of(b->comm)->fail_timeout(b->comm, fn, what);
}

#define FUSED_CHECK(call, fn, what)                                            \
  do {                                                                         \
    const cudaError_t fused_err_ = (call);                                     \
    if (fused_err_ != cudaSuccess) {                                           \
      status = window_alive(b, w, fn);                                         \
      if (status == EPX_SUCCESS) status = epx_cuda_fail(fused_err_, fn, what); \
      goto fail;                                                               \
    }                                                                          \
  } while (0)

static epx_cuda_ll_remap_t remap_of(const epx_cuda_ll_window_t *w, int slot, const void *src, void *dst,
                                    epx_buffer_t b) {
  epx_fused_plan_view_t v;
  epx_fused_plan_view(w->plans[slot], &v);
  const epx_cuda_ll_recv_t none = {0};
  return (epx_cuda_ll_remap_t){v.counts,     v.offsets, src,     dst,  epx_buffer_row_bytes(b), v.row_src_rank,
                               v.row_src_token, v.row_expert, v.row_w, none, NULL};
}

epx_status_t epx_cuda_ll_window_dispatch(epx_buffer_t b, epx_cuda_ll_window_t *w, int slot, const epx_routing_t *r,
                                         const int32_t *num_tokens, const void *x, void *recv_x,
                                         const epx_cuda_ll_dims_t *d, const epx_cuda_ll_recv_t *out,
                                         int32_t *recv_count) {
  const char *fn = "epx_ll_dispatch";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = stream_of(b);
  EPX_CHECK(window_alive(b, w, fn));
  CUDA_CHECK(epx_cuda_ll_clip_launch(r->topk_idx, num_tokens, r->num_tokens, r->top_k, w->idx, stream), fn,
             "the low-latency clip kernel");
  FUSED_CHECK(epx_fused_layout_launch(w->fused, w->plans[slot], w->idx, r->topk_w, NULL, r->num_tokens, r->top_k, 0,
                                     (int32_t)r->weighting, stream),
             fn, "the fused layout kernels");
  FUSED_CHECK(epx_fused_dispatch_launch(w->fused, w->plans[slot], x ? x : w->rows, w->rows, 0, w->ctas, 0, stream),
             fn, "the fused dispatch kernels");
  epx_cuda_ll_remap_t m = remap_of(w, slot, w->rows, recv_x, b);
  m.out = *out, m.recv_count = recv_count;
  CUDA_CHECK(epx_cuda_ll_remap_launch(d, 1, &m, stream), fn, "the low-latency placement kernel");
fail:
  return status;
}

epx_status_t epx_cuda_ll_window_combine(epx_buffer_t b, epx_cuda_ll_window_t *w, int slot,
                                        const epx_cuda_ll_dims_t *d, const void *expert_out, void *out,
                                        int weighted) {
  const char *fn = "epx_ll_combine";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = stream_of(b);
  EPX_CHECK(window_alive(b, w, fn));
  const epx_cuda_ll_remap_t m = remap_of(w, slot, expert_out, w->rows, b);
  CUDA_CHECK(epx_cuda_ll_remap_launch(d, 0, &m, stream), fn, "the low-latency placement kernel");
  FUSED_CHECK(epx_fused_combine_launch(w->fused, w->plans[slot], w->rows, out ? out : w->rows, weighted,
                                      b->config.combine_precision, w->ctas, 0, stream),
             fn, "the fused combine kernels");
fail:
  return status;
}

void epx_cuda_ll_window_paths(const epx_cuda_ll_window_t *w, int32_t world_size, int32_t *paths) {
  int32_t transport[EPX_FUSED_MAX_RANKS];
  epx_fused_peer_transports(w->fused, transport);
  for (int32_t r = 0; r < world_size; r++)
    paths[r] = transport[r] == EPX_FUSED_PEER_RELAY ? EPX_PATH_HOST : EPX_PATH_FUSED;
}

#else /* no fused module in this build: the NCCL slabs serve every buffer */

epx_status_t epx_cuda_ll_window_create(epx_buffer_t b, epx_cuda_ll_window_t **out) {
  (void)b;
  *out = NULL;
  return EPX_SUCCESS;
}

void epx_cuda_ll_window_destroy(epx_buffer_t b, epx_cuda_ll_window_t *w) { (void)b, (void)w; }

epx_status_t epx_cuda_ll_window_dispatch(epx_buffer_t b, epx_cuda_ll_window_t *w, int slot, const epx_routing_t *r,
                                         const int32_t *num_tokens, const void *x, void *recv_x,
                                         const epx_cuda_ll_dims_t *d, const epx_cuda_ll_recv_t *out,
                                         int32_t *recv_count) {
  (void)b, (void)w, (void)slot, (void)r, (void)num_tokens, (void)x, (void)recv_x, (void)d, (void)out;
  (void)recv_count;
  return epx_error(EPX_ERROR_INTERNAL, "epx_ll_dispatch: no load/store path in this build");
}

epx_status_t epx_cuda_ll_window_combine(epx_buffer_t b, epx_cuda_ll_window_t *w, int slot,
                                        const epx_cuda_ll_dims_t *d, const void *expert_out, void *out,
                                        int weighted) {
  (void)b, (void)w, (void)slot, (void)d, (void)expert_out, (void)out, (void)weighted;
  return epx_error(EPX_ERROR_INTERNAL, "epx_ll_combine: no load/store path in this build");
}

void epx_cuda_ll_window_paths(const epx_cuda_ll_window_t *w, int32_t world_size, int32_t *paths) {
  (void)w, (void)world_size, (void)paths;
}

#endif
