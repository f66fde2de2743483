/* The CUDA backend on W ranks, one process per GPU, over an NCCL comm: the
 * layout of a dispatch and the payload moves, on NCCL's host API (grouped
 * ncclSend/ncclRecv and one ncclAllGather) on the buffer's stream.
 *
 * Layout: each rank validates its own routing on its GPU (in the kernel that
 * stages its send block; the capacity layout, whose slots must be claimed,
 * by the one-rank layout over all E experts; invalid routes become -1), and
 * every rank all-gathers every rank's sanitised routing [Tm, Kb] with a
 * header {tokens, oversize, invalid, top_k, weighting}. That gather is the
 * count exchange:
 * from it each rank computes (ep/tables.cu) both sides of every exchange — where
 * each of its rows goes, and where each row it receives comes from and
 * lands — so no other metadata moves and no count is read on the host
 * except to size NCCL's messages.
 *
 * Items: the dedup exchange sends a row per (token, destination rank) with a
 * route there, the collective a row per route, both in token (then k)
 * order, per peer in rank order. The receiver expands them into its layout
 * (the one-rank layout of the gathered routing restricted to its experts).
 * Combine returns, per item, the per-rank partial P(t, r) (dedup, float32 or
 * payload dtype: combine_precision) or the route's row (collective; the
 * token's rank forms the same partials), and the token's rank sums the
 * partials over r in ascending order: the two exchanges give the same bits.
 * Rank-major rows are pairs already, so they travel as they are both ways.
 *
 * Host synchronisation: without worst_case_sizing the layout waits once (a
 * polled, bounded wait: epx_nccl_wait) to read the message sizes, and every
 * collective call first all-gathers what each rank is doing (the call, the
 * buffer, the handle, grad_w and its verdict: one small host all-gather on
 * the control comm) so that a refusal, or ranks in different calls, fail on
 * every rank before anything moves. The layout's headers also carry each
 * rank's top_k and weighting, checked by every rank alike. With
 * worst_case_sizing nothing waits: messages have their per-peer bound as
 * size (Tm rows per peer for pairs, Tm*min(Kb, E_local) for routes), rows
 * land at peer * bound + index, the receive layout's N stays on the device;
 * a host refusal on one rank then reaches its peers only as a timeout of
 * their next bounded wait (documented in epx.h).
 *
 * The fused path (EPX_PATH_FUSED, or AUTO for rank-major; dedup; fused.h;
 * peers without load/store access relayed through NCCL's host API between
 * the fused kernels, fused/relay.cu): the buffer holds the fused state, each
 * handle a fused plan, and the layout is the fused layout alone (three
 * kernels, no NCCL call, no memset): it validates the routing as the stage
 * kernel does, exchanges the counts and every rank's header {tokens,
 * oversize, invalid, top_k, weighting} through the window, and lays out both
 * sides. The handle's queries read the plan (rows, counts, offsets, sources,
 * routing) and its verdicts and stats its read-back (the summary's format,
 * the same values as the tables kernel's; with default sizing read once at
 * the layout, as on the host path). An oversize rank (worst_case_sizing)
 * joins with an empty fused layout and its header, which empties every
 * rank's plan, as its gather header empties the host layout. The routing
 * weights' gradients are fused too (each route's value formed on its
 * expert's rank goes home through the window, fused/values.cu;
 * dispatch_backward's <grad_recv_x(t, k), x[t]> after a dispatch of x into
 * the window), so a fused handle never makes the host layout.
 * dispatch / combine_backward are the fused dispatch, combine /
 * dispatch_backward the fused combine: the same bits as the host path
 * (P(t, r) in k order in float32 without FMA, rounded once to the dtype in
 * payload precision — own partial included, as the host path rounds its self
 * block — summed over r ascending, rounded once). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/nccl.h"
#include "core/route_spec.h"
#include "core/transport.h"
#include "cuda/common/check.h"
#include "cuda/backend.h"
#include "cuda/ep/ep.h"
#include "cuda/launch.h"
#include "cuda/fused/fused.h"

#if EPX_HAVE_NCCL
#include <nccl.h>

/* The fused module (fused/) is compiled where NCCL has its device API
 * (nccl_device.h, NCCL >= 2.28): EPX_HAVE_FUSED. Without it the AUTO path is
 * the host path. */
#ifndef EPX_HAVE_FUSED
#define EPX_HAVE_FUSED 0
#endif

/* The fused senders move whole rows through the bulk copy engine (faster at
 * 8-32 SMs, equal from 64: bench/NOTES-gpu.md, the fused exchange). The
 * default SM budget is the whole-step sweep's fastest (bench/NOTES-gpu.md,
 * "the SM budget"). */
enum { EP_FUSED_BULK_COPY = 1, EP_FUSED_DEFAULT_CTAS = 32 };

enum { HOME_PAIRS = 0, HOME_ROUTES = 1, RECV_PAIRS = 2, RECV_ROUTES = 3, KINDS = 4 };

/* buffer->backend_state on W ranks */
typedef struct ep_buffer {
  void *send, *recv;  /* staging (device), `bytes` each */
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
} ep_buffer_t;

/* handle->backend_state on W ranks */
typedef struct ep_handle {
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
} ep_handle_t;

static cudaStream_t stream_of(epx_buffer_t b) { return (cudaStream_t)b->config.stream; }
static size_t round256(size_t n) { return (n + 255) / 256 * 256; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

#define NCCL_CHECK(call, fn, what) EPX_CHECK(epx_nccl_result(comm, (int)(call), fn, what))

/* Per-peer sizes of the dims' item kinds with worst_case_sizing. */
static int64_t kind_bound(const epx_cuda_ep_dims_t *d, int kind) {
  return kind == HOME_PAIRS || kind == RECV_PAIRS ? d->Bp : d->Br;
}

/* Items of a kind this rank holds in staging (the tables' row count). */
static int64_t kind_rows(const ep_handle_t *h, int kind) {
  return h->d.worst ? h->d.W * kind_bound(&h->d, kind) : h->total[kind];
}

/* Whether partials of `precision` travel as float32 rows: they differ from
 * the dtype's only for a 16-bit dtype. combine takes the buffer's
 * combine_precision, dispatch_backward float32 always (epx.h). */
static int f32_partials(epx_buffer_t b, epx_combine_precision_t precision) {
  return precision == EPX_COMBINE_PARTIALS_FLOAT32 && b->config.dtype != EPX_FLOAT32;
}

/* ------------------------------------------------------------------------ */
/* Buffers                                                                   */
/* ------------------------------------------------------------------------ */

static epx_status_t ensure_fused(epx_buffer_t b, const char *fn);
#if EPX_HAVE_FUSED
static epx_status_t fused_alive(epx_buffer_t b, const char *fn);
#endif

epx_status_t epx_cuda_ep_buffer_init(epx_buffer_t b) {
  const char *fn = "epx_buffer_create";
  if (!epx_comm_is_nccl(b->comm))
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: a CUDA buffer over %d ranks needs an NCCL comm (epx_comm_create_nccl, "
                     "epx_comm_create_nccl_id or epx_comm_create_nccl_mpi); this comm is %s", fn,
                     b->world_size, b->comm->ops->name);
  if (b->world_size > EPX_CUDA_MAX_EXPERTS)
    return epx_error(EPX_ERROR_UNSUPPORTED, "%s: %d ranks; the CUDA backend takes at most %d", fn,
                     b->world_size, EPX_CUDA_MAX_EXPERTS);
  ep_buffer_t *s = calloc(1, sizeof *s);
  if (!s) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  b->backend_state = s;
  s->id = ++b->comm->buffers_made;
  epx_status_t status = ensure_fused(b, fn);
  if (status != EPX_SUCCESS) {
    free(s);
    b->backend_state = NULL;
  }
  return status;
}

void epx_cuda_ep_buffer_fini(epx_buffer_t b) {
  ep_buffer_t *s = b->backend_state;
  if (!s) return;
  /* With worst_case_sizing a host refusal on one rank reaches its peers only
   * as a timeout of their next bounded wait; a peer that destroys the buffer
   * instead could leave a transfer on the stream that no rank will match,
   * and NCCL's blocking finalize at epx_comm_destroy would wait for it for
   * ever. A bounded wait here turns that into EPX_ERROR_TIMEOUT, which
   * aborts the comm (its kernels too). */
  if (b->config.worst_case_sizing && !b->comm->failed) (void)epx_nccl_wait(b->comm, stream_of(b), "epx_buffer_destroy");
#if EPX_HAVE_FUSED
  /* a fused wait that timed out (no call since reported it) fails the comm
   * first: then the window is abandoned, not deregistered collectively */
  if (s->fused && !b->comm->failed) (void)fused_alive(b, "epx_buffer_destroy");
  while (s->pooled > 0) epx_fused_plan_destroy(s->pool[--s->pooled], stream_of(b));
  if (s->spare) epx_fused_plan_destroy(s->spare, stream_of(b));
  /* collective: the window is deregistered, unless the comm failed (its
   * NCCL comm was aborted, windows and all) */
  if (s->fused && !b->comm->failed) epx_fused_destroy(s->fused);
  else if (s->fused) epx_fused_abandon(s->fused);
#endif
  if (s->send) cudaFreeAsync(s->send, stream_of(b));
  if (s->recv) cudaFreeAsync(s->recv, stream_of(b));
  if (s->readback) cudaFreeHost(s->readback);
  free(s);
  b->backend_state = NULL;
}

/* Staging of `bytes` each way (stream-ordered: a later layout's growth
 * waits for the moves of earlier handles on the same stream). */
static epx_status_t ensure_staging(epx_buffer_t b, size_t bytes, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  if (bytes <= s->bytes) return EPX_SUCCESS;
  cudaStream_t stream = stream_of(b);
  if (s->send) CUDA_CHECK(cudaFreeAsync(s->send, stream), fn, "cudaFreeAsync of the staging");
  if (s->recv) CUDA_CHECK(cudaFreeAsync(s->recv, stream), fn, "cudaFreeAsync of the staging");
  s->send = s->recv = NULL;
  s->bytes = 0;
  CUDA_CHECK(cudaMallocAsync(&s->send, bytes, stream), fn, "cudaMallocAsync of the send staging");
  CUDA_CHECK(cudaMallocAsync(&s->recv, bytes, stream), fn, "cudaMallocAsync of the receive staging");
  s->bytes = bytes;
fail:
  return status;
}

/* ------------------------------------------------------------------------ */
/* The fused path                                                            */
/* ------------------------------------------------------------------------ */

/* Whether the config lets the fused kernels serve this buffer: FUSED (or
 * AUTO, rank-major), dedup, within the module's rank and top-k bounds, in a
 * build that has it. The collective exchange, one row per route, has no
 * fused form. */
static int fused_wanted(epx_buffer_t b) {
  const epx_buffer_config_t *c = &b->config;
  /* AUTO takes the fused kernels where they make a step faster: rank-major
   * (an expert-major step measured the same on both paths, epx.h). */
  const int asked = c->exchange_path == EPX_PATH_FUSED ||
                    (c->exchange_path == EPX_PATH_AUTO && c->layout == EPX_LAYOUT_RANK_MAJOR);
  return EPX_HAVE_FUSED && asked && c->exchange == EPX_EXCHANGE_DEDUP && b->world_size <= EPX_FUSED_MAX_RANKS &&
         c->max_top_k <= EPX_FUSED_MAX_TOP_K;
}

/* Collective, once max_tokens_per_rank is known (at buffer creation, or the
 * first layout that agrees it): creates the fused state (peers without
 * load/store access relayed through NCCL's host API: fused/relay.cu).
 * epx_fused_create agrees every step that may refuse on one rank alone (no
 * memory for the window or the relay, an NCCL without symmetric memory);
 * the all-reduce here also covers what fails before its first agreement (a
 * comm busy past the timeout, no stream), so every rank leaves
 * on the same path: a refusal anywhere leaves every rank on the host path,
 * and epx_last_error() after the (successful) call says why (epx.h,
 * EPX_PATH_AUTO); only a failing comm fails the caller. */
static epx_status_t ensure_fused(epx_buffer_t b, const char *fn) {
  ep_buffer_t *s = b->backend_state;
  if (s->fused_tried || !fused_wanted(b) || b->max_tokens == 0) return EPX_SUCCESS;
  s->fused_tried = 1;
#if EPX_HAVE_FUSED
  const epx_buffer_config_t *c = &b->config;
  /* The kernels' waits on a peer give up a little before the host's
   * bounded waits that enclose them, so a dead peer is reported by the
   * fused error word (naming the peer and the phase) and the comm is
   * aborted only after the kernels have returned. */
  /* the expert-major combine stages float32 partials (dispatch_backward's
   * always, combine's with EPX_COMBINE_PARTIALS_FLOAT32) in the window's
   * payload rows: they are float32 rows then */
  const int f32_rows = c->layout != EPX_LAYOUT_RANK_MAJOR;
  const epx_fused_config_t fc = {c->dtype, c->hidden, c->num_experts, c->max_top_k, b->max_tokens,
                                 0.9 * b->comm->timeout_seconds, EP_FUSED_BULK_COPY, f32_rows};
  epx_fused_t *f = NULL;
  char reason[768] = "";
  /* the highest refusing rank + 1, 0 where none refused */
  int64_t refused = epx_fused_create(epx_nccl_comm(b->comm), &fc, &f) != EPX_SUCCESS ? b->rank + 1 : 0;
  if (refused) snprintf(reason, sizeof reason, "%s", epx_last_error());
  epx_status_t status = b->comm->ops->allreduce_max_i64(b->comm, fn, &refused, 1);
  if (status != EPX_SUCCESS || refused) {
    /* a failed all-reduce aborted the NCCL comm, windows and all: no NCCL calls then */
    if (f && b->comm->failed) epx_fused_abandon(f);
    else if (f) epx_fused_destroy(f);
    if (status != EPX_SUCCESS) return status;
    /* not an error: the host path serves the buffer; the reason stays readable */
    if (reason[0])
      epx_error(EPX_ERROR_UNSUPPORTED, "%s: the fused path was refused (every peer takes the host path): %s", fn,
                reason);
    else
      epx_error(EPX_ERROR_UNSUPPORTED, "%s: rank %lld refused the fused path (its epx_last_error says why); every "
                "peer takes the host path", fn, (long long)(refused - 1));
    return EPX_SUCCESS;
  }
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    sms = EP_FUSED_DEFAULT_CTAS;
  const int32_t ctas = c->sm_budget > 0 ? c->sm_budget : EP_FUSED_DEFAULT_CTAS;
  s->fused_ctas = ctas < sms ? ctas : sms;
  s->fused = f;
#else
  (void)fn;
#endif
  return EPX_SUCCESS;
}

#if EPX_HAVE_FUSED
/* A wait of an earlier fused launch that timed out (the host-mapped error
 * word, no synchronisation): the fused state is failed for good. */
static epx_status_t fused_alive(epx_buffer_t b, const char *fn) {
  const ep_buffer_t *s = b->backend_state;
  int32_t peer = -1;
  const char *phase = "";
  if (!epx_fused_error(s->fused, &peer, &phase)) return EPX_SUCCESS;
  /* The comm fails as on a host-path timeout: its NCCL comm is aborted
   * (windows and all), so destroying the buffer attempts no collective
   * deregistration with a peer that no longer answers. */
  char what[256];
  snprintf(what, sizeof what, "rank %d did not answer the fused exchange (%s) within the comm's timeout, or the "
           "host-API relay to it failed; the buffer's fused state has failed", (int)peer, phase ? phase : "?");
  return epx_nccl_fail_timeout(b->comm, fn, what);
}

/* A fused launch's result: where a relay step to a peer without load/store
 * access failed (the error word names the peer), the comm fails as on a
 * timed-out wait (fused_alive); any other error is the CUDA error. */
#define FUSED_CHECK(call, fn, what)                                                   \
  do {                                                                                \
    const cudaError_t fused_err_ = (call);                                            \
    if (fused_err_ != cudaSuccess) {                                                  \
      status = fused_alive(b, fn);                                                    \
      if (status == EPX_SUCCESS) status = epx_cuda_fail(fused_err_, fn, what);        \
      goto fail;                                                                      \
    }                                                                                 \
  } while (0)

/* The handle's fused layout, the only layout a fused handle makes up front:
 * it validates the routing, exchanges counts and every rank's header on the
 * GPU and lays out both sides; the handle's queries and verdicts read its
 * plan. */
static epx_status_t fused_layout(epx_buffer_t b, const epx_routing_t *r, ep_handle_t *h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  EPX_CHECK(fused_alive(b, fn));
  if (s->pooled > 0) h->plan = s->pool[--s->pooled];
  else EPX_CHECK(epx_fused_plan_create(s->fused, b->config.layout, b->config.expert_alignment, b->config.capacity,
                                       stream_of(b), &h->plan));
  FUSED_CHECK(epx_fused_layout_launch(s->fused, h->plan, r->topk_idx, r->topk_w, r->locations, r->num_tokens,
                                     r->top_k, 0, (int32_t)r->weighting, stream_of(b)),
             fn, "the fused layout kernels");
fail:
  return status;
}

/* worst_case_sizing, this rank oversize: an empty fused layout with its
 * oversize header keeps the ranks' sequences of fused launches equal; its
 * peers' layouts come out empty and their recv_rows names this rank. */
static epx_status_t fused_join_oversize(epx_buffer_t b, int32_t weighting, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  if (!s->spare)
    EPX_CHECK(epx_fused_plan_create(s->fused, b->config.layout, b->config.expert_alignment, b->config.capacity,
                                    stream_of(b), &s->spare));
  FUSED_CHECK(epx_fused_layout_launch(s->fused, s->spare, NULL, NULL, NULL, 0, 1, 1, weighting, stream_of(b)), fn,
             "the fused layout kernels");
fail:
  return status;
}

/* The four payload calls on the fused kernels. forward: dispatch-like (x ->
 * rows), else combine-like (rows -> out) with partials of `precision`.
 * weighted only in expert-major (rank-major rows carry no weight: the
 * contract's EPX_WEIGHTS_NONE). */
static epx_status_t fused_move(epx_buffer_t b, epx_handle_t handle, const void *src, void *dst, int forward,
                               int weighted, epx_combine_precision_t precision, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  const ep_handle_t *h = handle->backend_state;
  const int expert = b->config.layout != EPX_LAYOUT_RANK_MAJOR; /* expert-major or capacity: rows per route */
  cudaStream_t stream = stream_of(b);
  EPX_CHECK(fused_alive(b, fn));
  /* An expert-major dispatch needs a destination even with no rows to write
   * (N = 0, recv_x NULL): any device address, never written then. */
  if (forward && expert && !dst) {
    epx_fused_plan_view_t v;
    epx_fused_plan_view(h->plan, &v);
    dst = (void *)v.row_w;
  }
  FUSED_CHECK(forward ? epx_fused_dispatch_launch(s->fused, h->plan, src, dst, weighted && expert, s->fused_ctas, 0,
                                                 stream)
                     : epx_fused_combine_launch(s->fused, h->plan, src, dst, weighted && expert, precision,
                                                s->fused_ctas, 0, stream),
             fn, forward ? "the fused dispatch kernels" : "the fused combine kernels");
fail:
  return status;
}
#endif

void epx_cuda_ep_peer_paths(epx_buffer_t b, int32_t *paths) {
  const ep_buffer_t *s = b->backend_state;
  /* a relayed peer (no load/store access) is served by NCCL's host API */
  int fused = 0;
  uint32_t relayed = 0;
#if EPX_HAVE_FUSED /* (a build without the module has no fused state) */
  fused = s && s->fused;
  if (fused) relayed = epx_fused_relayed_peers(s->fused);
#else
  (void)s;
#endif
  for (int32_t r = 0; r < b->world_size; r++)
    paths[r] = fused && !(relayed >> r & 1u) ? EPX_PATH_FUSED : EPX_PATH_HOST;
}

/* ------------------------------------------------------------------------ */
/* Handles                                                                   */
/* ------------------------------------------------------------------------ */

void epx_cuda_ep_handle_fini(epx_handle_t handle) {
  ep_handle_t *h = handle->backend_state;
  if (!h) return;
#if EPX_HAVE_FUSED
  ep_buffer_t *s = handle->buffer->backend_state;
  if (h->plan && s->pooled < (int)(sizeof s->pool / sizeof s->pool[0])) s->pool[s->pooled++] = h->plan;
  else if (h->plan) epx_fused_plan_destroy(h->plan, stream_of(handle->buffer));
#endif
  if (h->block) cudaFreeAsync(h->block, stream_of(handle->buffer));
  free(h->count[0]);
  free(h);
  handle->backend_state = NULL;
}

int64_t epx_cuda_ep_handle_bytes(epx_handle_t handle) {
  const ep_handle_t *h = handle->backend_state;
  return h ? (int64_t)(h->block_bytes + sizeof *h) : 0;
}

/* Carves the handle's block: every array of ep_handle_t, one allocation. */
static epx_status_t carve(epx_buffer_t b, ep_handle_t *h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_cuda_ep_dims_t *d = &h->d;
  const int cap = b->config.layout == EPX_LAYOUT_CAPACITY, rank_major = b->config.layout == EPX_LAYOUT_RANK_MAJOR;
  const int64_t T = d->T, K = d->K, Kb = d->Kb, W = d->W, G = W * d->Tm, E = b->config.num_experts,
                El = d->El, C = b->config.capacity;
  const int64_t own_rows = cap ? E * C : T * min64(K, E);
  const int64_t nf = epx_cuda_ep_flag_count(d);
  h->cub_bytes = epx_cuda_ep_scan_bytes(nf);
  const size_t scratch = max64((int64_t)epx_cuda_layout_scratch_bytes(T, (int32_t)E),
                               (int64_t)epx_cuda_layout_scratch_bytes(G, (int32_t)El));
  struct {
    void **ptr;
    int64_t bytes;
  } parts[] = {
      /* the one-rank layout of this rank's routing: the capacity layout only */
      {(void **)&h->own.idx, cap ? 4 * T * K : 0}, {(void **)&h->own.route_row, cap ? 4 * T * K : 0},
      {(void **)&h->own.row_src, cap ? 4 * own_rows : 0}, {(void **)&h->own.counts, cap ? 8 * E : 0},
      {(void **)&h->own.offsets, cap ? 8 * (E + 1) : 0}, {(void **)&h->own.result, sizeof(epx_cuda_layout_result_t)},
      {(void **)&h->w, h->has_w ? 4 * T * K : 0}, {(void **)&h->sidx, 4 * d->Tm * Kb},
      {(void **)&h->sw, 4 * d->Tm * Kb}, {(void **)&h->sloc, cap ? 4 * d->Tm * Kb : 0},
      {(void **)&h->shdr, 4 * EPX_CUDA_EP_HDR_INTS}, {(void **)&h->gidx, 4 * G * Kb},
      {(void **)&h->gw, 4 * G * Kb}, {(void **)&h->gloc, cap ? 4 * G * Kb : 0},
      {(void **)&h->ghdr, 4 * W * EPX_CUDA_EP_HDR_INTS}, {(void **)&h->ridx, 4 * G * Kb},
      {(void **)&h->rloc, cap ? 4 * G * Kb : 0}, {(void **)&h->flags, 4 * nf}, {(void **)&h->scan, 4 * nf},
      {&h->cub, (int64_t)h->cub_bytes}, {&h->scratch, (int64_t)scratch},
      {(void **)&h->recv.idx, 4 * G * Kb}, {(void **)&h->recv.route_row, 4 * G * Kb},
      {(void **)&h->recv.token_row, rank_major ? 4 * G : 0}, {(void **)&h->recv.row_src, 4 * h->row_bound},
      {(void **)&h->recv.counts, 8 * El}, {(void **)&h->recv.offsets, 8 * (El + 1)},
      {(void **)&h->recv.result, sizeof(epx_cuda_layout_result_t)},
      {(void **)&h->tab.pair_stage, 4 * T * W}, {(void **)&h->tab.route_stage, 4 * T * K},
      {(void **)&h->tab.group, 4 * T * K}, {(void **)&h->tab.rp_rows, 4 * h->pair_rows * Kb},
      {(void **)&h->tab.rp_w, 4 * h->pair_rows * Kb}, {(void **)&h->tab.rr_row, 4 * h->route_rows},
      {(void **)&h->tab.rr_all, 4 * h->route_rows}, {(void **)&h->tab.rr_slot, 4 * h->route_rows},
      {(void **)&h->tab.rr_w, 4 * h->route_rows}, {(void **)&h->tab.stage_of_row, 4 * h->row_bound},
      {(void **)&h->summary, 8 * (EPX_CUDA_EP_SUMMARY_ROWS(W) + 2)},
  };
  const size_t n = sizeof parts / sizeof parts[0];
  size_t bytes = 0;
  for (size_t i = 0; i < n; i++) bytes += round256((size_t)parts[i].bytes);
  CUDA_CHECK(cudaMallocAsync(&h->block, bytes, stream_of(b)), fn, "cudaMallocAsync of the handle's layout");
  h->block_bytes = bytes;
  char *at = h->block;
  for (size_t i = 0; i < n; i++) {
    *parts[i].ptr = parts[i].bytes ? at : NULL;
    at += round256((size_t)parts[i].bytes);
  }
  if (!h->has_w) h->w = NULL;
  h->tab.scan = h->scan, h->tab.gidx = h->gidx, h->tab.ridx = h->ridx, h->tab.ghdr = h->ghdr;
  h->tab.gw = h->gw, h->tab.recv = &h->recv, h->tab.own_result = h->own.result, h->tab.summary = h->summary;
fail:
  return status;
}

/* ------------------------------------------------------------------------ */
/* The agreement of a call (default sizing)                                  */
/* ------------------------------------------------------------------------ */

/* What a rank is doing, all-gathered before anything moves (one small host
 * all-gather on the control comm, the same for the layout and the payload
 * calls, so a rank in another call meets a block it can read rather than
 * another collective). Every rank checks every block the same way. */
typedef struct {
  int64_t verdict; /* epx_status_t */
  int64_t call;    /* index in call_names */
  int64_t buffer;  /* ep_buffer_t.id */
  int64_t handle;  /* ep_handle_t.seq (a layout: the one being made); 0: none */
  int64_t tokens;  /* the layout's routing.num_tokens */
  int64_t grad_w;  /* the call asks for grad_w */
} ep_call_t;

static const char *const call_names[] = {"epx_dispatch_layout", "epx_dispatch", "epx_combine",
                                         "epx_dispatch_backward", "epx_combine_backward",
                                         "epx_weights_backward"};
enum { CALL_LAYOUT = 0, CALLS = sizeof call_names / sizeof call_names[0] };

static int64_t call_of(const char *caller) {
  for (int64_t i = 0; i < CALLS; i++)
    if (!strcmp(caller, call_names[i])) return i;
  return CALLS; /* not reached: every caller is one of them */
}

/* "rank 0 in epx_dispatch on buffer #1, layout #3; rank 1 ...", up to 8 ranks. */
static void describe_calls(const ep_call_t *all, int32_t W, char *text, size_t size) {
  size_t used = 0;
  text[0] = '\0';
  for (int32_t p = 0; p < W && used < size; p++) {
    const ep_call_t *c = &all[p];
    const int n = p == 8 ? snprintf(text + used, size - used, "; ... (%d ranks)", W)
                         : snprintf(text + used, size - used, "%srank %d in %s on buffer #%lld, layout #%lld",
                                    p ? "; " : "", p, c->call < CALLS ? call_names[c->call] : "another call",
                                    (long long)c->buffer, (long long)c->handle);
    if (n < 0 || p == 8) break;
    used += (size_t)n;
  }
}

static epx_status_t call_mismatch(const ep_call_t *all, int32_t W, const char *fn, const char *what) {
  char text[768];
  describe_calls(all, W, text, sizeof text);
  return epx_error(EPX_ERROR_SHAPE_MISMATCH,
                   "%s: the ranks are %s: %s; every rank must make the same collective calls, on the same "
                   "buffer and handle, in the same order; nothing moved on any rank", fn, what, text);
}

/* The checks of the gathered blocks (the same on every rank). A failed
 * verdict names its rank (an oversize batch by its numbers); this rank's own
 * refusal keeps its message. */
static epx_status_t check_calls(epx_buffer_t b, const ep_call_t *all, epx_status_t local, const char *message,
                                const char *fn) {
  const int32_t W = b->world_size;
  for (int32_t p = 1; p < W; p++)
    if (all[p].call != all[0].call) return call_mismatch(all, W, fn, "in different collective calls");
  if (local != EPX_SUCCESS) return epx_error(local, "%s", message);
  for (int32_t p = 0; p < W; p++)
    if (all[p].verdict == EPX_ERROR_CAPACITY_EXCEEDED && all[p].call == CALL_LAYOUT)
      return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                       "%s: rank %d has %lld tokens, above the buffer's max_tokens_per_rank %lld; nothing "
                       "moved on any rank; create the buffer with a larger config.max_tokens_per_rank", fn, p,
                       (long long)all[p].tokens, (long long)b->max_tokens);
  for (int32_t p = 0; p < W; p++)
    if (all[p].verdict != EPX_SUCCESS)
      return epx_error(EPX_ERROR_PEER_FAILED,
                       "%s: rank %d refused the call (its epx_last_error says why); nothing moved on any rank", fn,
                       p);
  for (int32_t p = 1; p < W; p++) {
    if (all[p].buffer != all[0].buffer) return call_mismatch(all, W, fn, "on different buffers");
    if (all[p].handle != all[0].handle)
      return call_mismatch(all, W, fn,
                           all[0].call == CALL_LAYOUT ? "out of step (they have made different numbers of layouts)"
                                                      : "on different handles");
  }
  for (int32_t p = 1; p < W; p++)
    if (all[p].grad_w != all[0].grad_w)
      return epx_error(EPX_ERROR_SHAPE_MISMATCH,
                       "%s: rank %d passes grad_w and rank %d does not; the weight gradient is exchanged, so "
                       "pass grad_w on every rank or on none; nothing moved on any rank", fn,
                       all[p].grad_w ? p : 0, all[p].grad_w ? 0 : p);
  return EPX_SUCCESS;
}

/* Gathers `mine` from every rank and checks the blocks. *largest (layout,
 * may be NULL): the largest batch of the ranks. */
static epx_status_t agree_call(epx_buffer_t b, ep_call_t mine, const char *fn, int64_t *largest) {
  epx_comm_t comm = b->comm;
  epx_status_t status = epx_comm_check_alive(comm, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_status_t local = (epx_status_t)mine.verdict;
  char message[1024];
  snprintf(message, sizeof message, "%s", local != EPX_SUCCESS ? epx_last_error() : "");
  ep_call_t *all = calloc((size_t)b->world_size, sizeof *all);
  if (!all) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  status = comm->ops->allgather(comm, fn, &mine, all, sizeof mine);
  if (status == EPX_SUCCESS && mine.call == CALL_LAYOUT) {
    /* Ranks out of step fail this layout (check_calls) and make the next
     * one in step: every rank in a layout takes the largest number, as the
     * CPU layouts do. */
    int all_layouts = 1;
    int64_t top = 0;
    for (int32_t p = 0; p < b->world_size; p++) all_layouts &= all[p].call == CALL_LAYOUT, top = max64(top, all[p].handle);
    if (all_layouts && top > comm->layouts_made) comm->layouts_made = top;
  }
  if (status == EPX_SUCCESS) status = check_calls(b, all, local, message, fn);
  for (int32_t p = 0; status == EPX_SUCCESS && largest && p < b->world_size; p++)
    if (all[p].tokens > *largest) *largest = all[p].tokens;
  free(all);
  return status;
}

/* The layout's agreement: the verdict, and on the first call
 * max_tokens_per_rank (the largest batch). */
static epx_status_t agree_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, int64_t seq) {
  const ep_buffer_t *s = b->backend_state;
  const ep_call_t mine = {local, CALL_LAYOUT, s->id, seq, r ? r->num_tokens : 0, 0};
  int64_t largest = 0;
  epx_status_t status = agree_call(b, mine, "epx_dispatch_layout", &largest);
  if (status == EPX_SUCCESS && b->max_tokens == 0) epx_buffer_agree_max_tokens(b, largest);
  return status;
}

/* The routing all-gather (idx, w, locations, header) on the buffer's stream
 * (a failed call still ends the group first: epx_nccl_group_end). */
static epx_status_t gather_routing(epx_buffer_t b, const epx_cuda_ep_dims_t *d, const int32_t *sidx,
                                   const float *sw, const int32_t *sloc, const int32_t *shdr, int32_t *gidx,
                                   float *gw, int32_t *gloc, int32_t *ghdr, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t comm = b->comm;
  ncclComm_t nc = epx_nccl_data_comm(comm);
  cudaStream_t stream = stream_of(b);
  const size_t n = (size_t)(d->Tm * d->Kb);
  ncclResult_t r = ncclGroupStart();
  NCCL_CHECK(r, fn, "ncclGroupStart");
  const char *what = "ncclAllGather of the routing";
  r = ncclAllGather(sidx, gidx, n, ncclInt32, nc, stream);
  if (epx_nccl_went(r)) what = "ncclAllGather of the weights", r = ncclAllGather(sw, gw, n, ncclFloat32, nc, stream);
  if (epx_nccl_went(r) && sloc)
    what = "ncclAllGather of the locations", r = ncclAllGather(sloc, gloc, n, ncclInt32, nc, stream);
  if (epx_nccl_went(r))
    what = "ncclAllGather of the headers", r = ncclAllGather(shdr, ghdr, EPX_CUDA_EP_HDR_INTS, ncclInt32, nc, stream);
  EPX_CHECK(epx_nccl_group_end(comm, r, fn, what));
fail:
  return status;
}

/* worst_case_sizing, this rank oversize: it still joins the routing gather
 * (with no routes and its oversize header) so the peers' layouts complete;
 * their handles are empty and their recv_rows names this rank. */
static epx_status_t join_oversize(epx_buffer_t b, const epx_cuda_ep_dims_t *d, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = stream_of(b);
  const int cap = b->config.layout == EPX_LAYOUT_CAPACITY;
  const size_t n = (size_t)(d->Tm * d->Kb), G = n * (size_t)d->W;
  const size_t hdr = 4 * EPX_CUDA_EP_HDR_INTS;
  const size_t send = round256(4 * n) * 3 + round256(hdr), recv = round256(4 * G) * 3 + round256(hdr * (size_t)d->W);
  char *block = NULL;
  CUDA_CHECK(cudaMallocAsync((void **)&block, send + recv, stream), fn, "cudaMallocAsync");
  int32_t *sidx = (int32_t *)block, *sloc = (int32_t *)(block + 2 * round256(4 * n));
  float *sw = (float *)(block + round256(4 * n));
  int32_t *shdr = (int32_t *)(block + 3 * round256(4 * n));
  char *g = block + send;
  CUDA_CHECK(epx_cuda_ep_stage_launch(d, NULL, NULL, NULL, NULL, 1, sidx, sw, cap ? sloc : NULL, shdr, stream), fn,
             "the routing stage kernel");
  status = gather_routing(b, d, sidx, sw, cap ? sloc : NULL, shdr, (int32_t *)g, (float *)(g + round256(4 * G)),
                          (int32_t *)(g + 2 * round256(4 * G)), (int32_t *)(g + 3 * round256(4 * G)), fn);
fail:
  if (block) cudaFreeAsync(block, stream);
  return status;
}

static epx_status_t enqueue_exchange(epx_buffer_t b, ep_handle_t *h, const char *fn);

/* Own routing -> sanitised ids and the send block (validated by the stage
 * kernel itself; the capacity layout, whose slots must be claimed, by the
 * one-rank layout over all experts first), gather, flags, scan, receive
 * layout, tables. All enqueued. */
static epx_status_t enqueue_layout(epx_buffer_t b, const epx_routing_t *r, ep_handle_t *h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const epx_cuda_ep_dims_t *d = &h->d;
  cudaStream_t stream = stream_of(b);
  const int cap = c->layout == EPX_LAYOUT_CAPACITY;
  if (!cap)
    CUDA_CHECK(epx_cuda_ep_stage_validate_launch(d, d->T > 0 ? r->topk_idx : NULL, d->T > 0 ? r->topk_w : NULL,
                                                 c->num_experts, h->w, h->own.result, h->sidx, h->sw, h->shdr,
                                                 stream),
               fn, "the routing stage kernel");
  else if (d->T > 0)
    CUDA_CHECK(epx_cuda_layout_launch(r->topk_idx, r->locations, r->topk_w, h->w, d->T, d->K, c->num_experts,
                                      EPX_LAYOUT_CAPACITY, 1, c->capacity, &h->own, h->scratch, stream),
               fn, "the routing validation kernels");
  else
    CUDA_CHECK(cudaMemsetAsync(h->own.result, 0xff, sizeof *h->own.result, stream), fn, "cudaMemsetAsync");
  if (cap)
    CUDA_CHECK(epx_cuda_ep_stage_launch(d, h->own.idx, h->w, r->locations, h->own.result, 0, h->sidx, h->sw,
                                        h->sloc, h->shdr, stream),
               fn, "the routing stage kernel");
  EPX_CHECK(enqueue_exchange(b, h, fn));
fail:
  return status;
}

/* From the staged send block on (collective: the routing gather), all
 * enqueued: gather, flags, scan, receive layout, tables. */
static epx_status_t enqueue_exchange(epx_buffer_t b, ep_handle_t *h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const epx_cuda_ep_dims_t *d = &h->d;
  cudaStream_t stream = stream_of(b);
  const int64_t G = (int64_t)d->W * d->Tm;
  EPX_CHECK(gather_routing(b, d, h->sidx, h->sw, h->sloc, h->shdr, h->gidx, h->gw, h->gloc, h->ghdr, fn));
  CUDA_CHECK(epx_cuda_ep_flags_launch(d, h->gidx, h->gloc, h->ghdr, h->ridx, h->rloc, h->flags, stream), fn,
             "the flags kernel");
  CUDA_CHECK(epx_cuda_ep_scan_launch(h->flags, h->scan, epx_cuda_ep_flag_count(d), h->cub, h->cub_bytes, stream),
             fn, "the scan");
  CUDA_CHECK(epx_cuda_layout_launch(h->ridx, h->rloc, NULL, NULL, G, d->Kb, d->El, c->layout, c->expert_alignment,
                                    d->W * c->capacity, &h->recv, h->scratch, stream),
             fn, "the receive layout kernels");
  const struct {
    int32_t *p;
    int64_t n;
  } minus_one[] = {{h->tab.rp_rows, h->pair_rows * d->Kb}, {h->tab.rr_row, h->route_rows},
                   {h->tab.rr_all, h->route_rows}, {h->tab.stage_of_row, h->row_bound}};
  for (size_t i = 0; i < 4; i++)
    if (minus_one[i].n)
      CUDA_CHECK(cudaMemsetAsync(minus_one[i].p, 0xff, 4 * (size_t)minus_one[i].n, stream), fn, "cudaMemsetAsync");
  CUDA_CHECK(epx_cuda_ep_tables_launch(d, &h->tab, stream), fn, "the tables kernel");
fail:
  return status;
}

/* Host counts per peer: read back (default) or the bounds (worst case). */
static void set_counts(ep_handle_t *h, const int64_t *summary) {
  const int32_t W = h->d.W;
  for (int kind = 0; kind < KINDS; kind++) {
    int64_t sum = 0;
    for (int32_t p = 0; p < W; p++) {
      const int64_t n = summary ? summary[kind * W + p] : kind_bound(&h->d, kind);
      h->count[kind][p] = n;
      h->displ[kind][p] = sum;
      sum += n;
    }
    h->total[kind] = sum;
  }
}

/* Every rank's routing.weighting must be rank 0's: the receiver applies the
 * weights of its peers' routes by its own handle's weighting. */
static epx_status_t weighting_verdict(const int64_t *hdr, int32_t W, const char *fn, const char *note) {
  const int64_t first = hdr[EPX_CUDA_EP_HDR_WEIGHTING];
  for (int32_t p = 1; p < W; p++) {
    const int64_t theirs = hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_WEIGHTING];
    if (theirs != first) return epx_weighting_mismatch(fn, first, p, theirs, note);
  }
  return EPX_SUCCESS;
}

/* The verdicts in the read-back headers, the same on every rank. */
static epx_status_t header_verdict(epx_buffer_t b, const ep_handle_t *h, const int64_t *summary, const char *fn,
                                   const char *note) {
  const int32_t W = h->d.W;
  const int64_t *hdr = summary + 4 * W;
  for (int32_t p = 0; p < W; p++)
    if (hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_OVERSIZE])
      return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                       "%s: rank %d had more tokens than the buffer's max_tokens_per_rank %lld, so no row moved "
                       "on any rank%s", fn, p, (long long)b->max_tokens, note);
  for (int32_t p = 0; p < W; p++) {
    if (!hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_INVALID]) continue;
    if (p == b->rank)
      return epx_cuda_routing_error(fn, (uint64_t)summary[EPX_CUDA_EP_SUMMARY_ROWS(W) + 1], h->d.K, b->config.num_experts,
                                    b->config.capacity, NULL, NULL, note);
    return epx_error(EPX_ERROR_PEER_FAILED, "%s: rank %d has an invalid route (its epx_last_error names it)%s", fn,
                     p, note);
  }
  for (int32_t p = 0; p < W; p++)
    if (hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_TOPK] != h->d.K)
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: rank %d routes with top_k %lld and this rank with %d; a CUDA buffer over several "
                       "ranks needs the same routing.top_k on every rank", fn, p,
                       (long long)hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_TOPK], h->d.K);
  return weighting_verdict(hdr, W, fn, note);
}

#if EPX_HAVE_FUSED
/* The fused plan's own copy of what the tables kernel summarises (the same
 * layout of the summary: counts of every kind per peer, every rank's header
 * as it exchanged them, N, this rank's first invalid route), from its
 * read-back `raw`. */
_Static_assert((int)EPX_FUSED_HDR_INTS == (int)EPX_CUDA_EP_HDR_INTS &&
                   (int)EPX_FUSED_HDR_TOKENS == (int)EPX_CUDA_EP_HDR_TOKENS &&
                   (int)EPX_FUSED_HDR_OVERSIZE == (int)EPX_CUDA_EP_HDR_OVERSIZE &&
                   (int)EPX_FUSED_HDR_INVALID == (int)EPX_CUDA_EP_HDR_INVALID &&
                   (int)EPX_FUSED_HDR_TOPK == (int)EPX_CUDA_EP_HDR_TOPK &&
                   (int)EPX_FUSED_HDR_WEIGHTING == (int)EPX_CUDA_EP_HDR_WEIGHTING,
               "the fused header is the host layout's");
static void fused_summary(const ep_handle_t *h, const void *raw, int64_t *summary) {
  const int32_t W = h->d.W;
  epx_fused_plan_summary_t f;
  epx_fused_plan_summary(h->plan, raw, &f);
  for (int32_t p = 0; p < W; p++) {
    summary[HOME_PAIRS * W + p] = f.send_pairs[p];
    summary[HOME_ROUTES * W + p] = f.send_routes[p];
    summary[RECV_PAIRS * W + p] = f.recv_pairs[p];
    summary[RECV_ROUTES * W + p] = f.recv_routes[p];
  }
  for (int64_t i = 0; i < (int64_t)W * EPX_CUDA_EP_HDR_INTS; i++) summary[KINDS * W + i] = f.headers[i];
  summary[EPX_CUDA_EP_SUMMARY_ROWS(W)] = f.rows;
  summary[EPX_CUDA_EP_SUMMARY_ROWS(W) + 1] = (int64_t)f.invalid;
}
#endif

/* Copies the summary to the host and waits for it (bounded): the tables
 * kernel's, or on a fused handle the plan's. */
static epx_status_t read_summary(epx_buffer_t b, ep_handle_t *h, const char *fn, const int64_t **out) {
  epx_status_t status = EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  const size_t bytes = 8 * (size_t)(EPX_CUDA_EP_SUMMARY_ROWS(h->d.W) + 2);
  size_t raw = 0; /* the fused plan's read-back, after the summary */
#if EPX_HAVE_FUSED
  if (h->plan) raw = epx_fused_plan_readback_bytes(h->plan);
#endif
  if (bytes + raw > s->readback_bytes) {
    if (s->readback) cudaFreeHost(s->readback);
    s->readback = NULL;
    s->readback_bytes = 0;
    CUDA_CHECK(cudaMallocHost((void **)&s->readback, bytes + raw), fn, "cudaMallocHost");
    s->readback_bytes = bytes + raw;
  }
#if EPX_HAVE_FUSED
  if (h->plan)
    CUDA_CHECK(epx_fused_plan_readback_launch(h->plan, (char *)s->readback + bytes, stream_of(b)), fn,
               "cudaMemcpyAsync of the counts");
#endif
  if (!raw)
    CUDA_CHECK(cudaMemcpyAsync(s->readback, h->summary, bytes, cudaMemcpyDeviceToHost, stream_of(b)), fn,
               "cudaMemcpyAsync of the counts");
  EPX_CHECK(epx_nccl_wait(b->comm, stream_of(b), fn));
#if EPX_HAVE_FUSED
  /* a fused layout whose wait on a peer timed out left no valid counts */
  if (h->plan) EPX_CHECK(fused_alive(b, fn));
  if (h->plan) fused_summary(h, (const char *)s->readback + bytes, s->readback);
#endif
  *out = s->readback;
fail:
  return status;
}

static size_t staging_bytes(epx_buffer_t b, const ep_handle_t *h) {
  const size_t rb = (size_t)epx_buffer_row_bytes(b);
  /* a float32 partial per pair: combine's with float32 partials,
   * dispatch_backward's always (expert-major and capacity; a rank-major
   * row is its rank's partial) */
  const int f32 = f32_partials(b, b->config.combine_precision) ||
                  (f32_partials(b, EPX_COMBINE_PARTIALS_FLOAT32) && b->config.layout != EPX_LAYOUT_RANK_MAJOR);
  const size_t unit = f32 ? 4 * (size_t)b->config.hidden : rb;
  int64_t rows = 0, pairs = 0;
  for (int kind = 0; kind < KINDS; kind++) rows = max64(rows, kind_rows(h, kind));
  pairs = max64(kind_rows(h, HOME_PAIRS), kind_rows(h, RECV_PAIRS));
  const size_t need = (size_t)rows * (unit > rb ? unit : rb);
  const size_t floats = (size_t)pairs * (size_t)h->d.Kb * 4;
  return (need > floats ? need : floats) + 256;
}

epx_status_t epx_cuda_ep_dispatch_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t local,
                                         epx_handle_t handle) {
  const char *fn = "epx_dispatch_layout";
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const int worst = c->worst_case_sizing != 0;
  const int64_t seq = ++b->comm->layouts_made; /* every rank calls, refused or not */
  if (!worst || b->max_tokens == 0) {
    EPX_CHECK(agree_layout(b, r, local, seq));
    EPX_CHECK(ensure_fused(b, fn)); /* max_tokens_per_rank may have been agreed just now */
  } else if (local != EPX_SUCCESS) {
    /* only an oversize batch joins (its routing is valid); any other refusal
     * may come with no routing at all */
    if (local == EPX_ERROR_CAPACITY_EXCEEDED && r) {
      epx_cuda_ep_dims_t d = {b->world_size, b->rank, b->experts_per_rank, c->max_top_k, r->top_k,
                              b->max_tokens, 0, c->layout, c->capacity, 1, 0, 0, (int32_t)r->weighting};
      char message[1024];
      snprintf(message, sizeof message, "%s", epx_last_error());
#if EPX_HAVE_FUSED
      /* a fused buffer's layouts are fused only: the peers gather nothing */
      if (((ep_buffer_t *)b->backend_state)->fused) status = fused_join_oversize(b, (int32_t)r->weighting, fn);
      else
#endif
        status = join_oversize(b, &d, fn);
      if (status == EPX_SUCCESS) status = epx_error(local, "%s", message);
      return status;
    }
    return local;
  }
  const int64_t W = b->world_size, Tm = b->max_tokens, Kb = c->max_top_k, El = b->experts_per_rank;
  const int64_t G = W * Tm, kk = min64(Kb, El);
  if (G * Kb >= INT32_MAX / 4)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: %lld ranks x %lld tokens x top-%lld; the CUDA backend indexes the gathered routes with "
                     "int32; lower max_tokens_per_rank", fn, (long long)W, (long long)Tm, (long long)Kb);
  ep_handle_t *h = calloc(1, sizeof *h);
  if (!h) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  handle->backend_state = h;
  h->rows = -1;
  h->seq = seq;
  h->count[0] = malloc(sizeof(int64_t) * 2 * KINDS * (size_t)W);
  if (!h->count[0]) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int kind = 0; kind < KINDS; kind++)
    h->count[kind] = h->count[0] + kind * W, h->displ[kind] = h->count[0] + (KINDS + kind) * W;
  h->d = (epx_cuda_ep_dims_t){(int32_t)W, b->rank, (int32_t)El, (int32_t)Kb, r->top_k, Tm, r->num_tokens,
                              c->layout, c->capacity, worst, Tm, Tm * kk, (int32_t)r->weighting};
  h->row_bound = epx_recv_rows_bound(c->layout, W, Tm, (int32_t)Kb, El, c->expert_alignment, c->capacity);
  h->pair_rows = W * h->d.Bp;
  h->route_rows = W * h->d.Br;
  h->has_w = r->topk_w != NULL;
  const int fused = ((ep_buffer_t *)b->backend_state)->fused != NULL;
#if EPX_HAVE_FUSED
  if (fused) EPX_CHECK(fused_layout(b, r, h, fn));
#endif
  if (!fused) {
    EPX_CHECK(carve(b, h, fn));
    EPX_CHECK(enqueue_layout(b, r, h, fn));
  }
  if (worst) {
    set_counts(h, NULL);
    handle->recv_rows = h->row_bound;
  } else {
    const int64_t *summary = NULL;
    EPX_CHECK(read_summary(b, h, fn, &summary));
    EPX_CHECK(header_verdict(b, h, summary, fn, ""));
    set_counts(h, summary);
    h->rows = summary[EPX_CUDA_EP_SUMMARY_ROWS(W)];
    handle->recv_rows = h->rows;
#if EPX_HAVE_FUSED
    /* every rank reads its counts here: the relay's messages to peers
     * without load/store access take their sizes from them */
    if (h->plan) epx_fused_plan_host_counts(h->plan, summary + HOME_PAIRS * W, summary + RECV_PAIRS * W);
#endif
  }
  /* The staging, sized at the layout: a captured step never grows it (the
   * fused path stages nothing). */
  if (!fused) EPX_CHECK(ensure_staging(b, staging_bytes(b, h), fn));
fail:
  return status;
}

/* ------------------------------------------------------------------------ */
/* Moves                                                                     */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cuda_ep_agree_call(epx_buffer_t b, epx_handle_t handle, int grad_w, epx_status_t local,
                                    const char *caller) {
  if (b->config.worst_case_sizing) return local; /* no host round trip: see the top of this file */
  const ep_handle_t *h = handle ? handle->backend_state : NULL;
  const ep_call_t mine = {local, call_of(caller), ((const ep_buffer_t *)b->backend_state)->id, h ? h->seq : 0, 0, grad_w != 0};
  return agree_call(b, mine, caller, NULL);
}

epx_status_t epx_cuda_ep_agree(epx_buffer_t b, epx_status_t local, const char *caller) {
  return epx_cuda_ep_agree_call(b, NULL, 0, local, caller);
}

/* Grouped send/recv of `unit`-byte rows: this rank's items of kind `skind`
 * to each peer from send, the peers' items of kind `rkind` into recv. The
 * self block goes through NCCL too, which copies it while the remote rows
 * travel (a separate copy before the group would serialise it; a copy
 * beside it on a second stream, from x straight into recv_x with only the
 * remote rows packed first, measured 2% slower: bench/NOTES-gpu.md). */
static epx_status_t p2p(epx_buffer_t b, const ep_handle_t *h, int skind, int rkind, const void *send, void *recv,
                        size_t unit, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t comm = b->comm;
  ncclComm_t nc = epx_nccl_data_comm(comm);
  cudaStream_t stream = stream_of(b);
  const char *s = send;
  char *d = recv;
  ncclResult_t r = ncclGroupStart();
  NCCL_CHECK(r, fn, "ncclGroupStart");
  const char *what = "ncclGroupStart";
  for (int32_t p = 0; p < h->d.W && epx_nccl_went(r); p++) {
    if (h->count[skind][p])
      what = "ncclSend", r = ncclSend(s + (size_t)h->displ[skind][p] * unit, (size_t)h->count[skind][p] * unit,
                                      ncclUint8, p, nc, stream);
    if (epx_nccl_went(r) && h->count[rkind][p])
      what = "ncclRecv", r = ncclRecv(d + (size_t)h->displ[rkind][p] * unit, (size_t)h->count[rkind][p] * unit,
                                      ncclUint8, p, nc, stream);
  }
  /* a failed call still ends the group first (epx_nccl_group_end) */
  EPX_CHECK(epx_nccl_group_end(comm, r, fn, what));
fail:
  return status;
}

/* Forward direction: src [T, H] on the token's rank -> dst [N, H] in the
 * layout (dispatch; combine_backward with its dots). weighted: the route's
 * weight scales its row. grad_w / other: the dots of combine_backward. */
static epx_status_t move_forward(epx_buffer_t b, epx_handle_t handle, const void *src, void *dst, int weighted,
                                 const void *other, float *grad_w, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const ep_handle_t *h = handle->backend_state;
  const ep_buffer_t *s = b->backend_state;
  cudaStream_t stream = stream_of(b);
  const int dedup = c->exchange == EPX_EXCHANGE_DEDUP;
  const int hk = dedup ? HOME_PAIRS : HOME_ROUTES, rk = dedup ? RECV_PAIRS : RECV_ROUTES;
  const size_t rb = (size_t)epx_buffer_row_bytes(b);
  const int direct = dedup && c->layout == EPX_LAYOUT_RANK_MAJOR && !h->d.worst;
  CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, src, s->send, h->d.T, c->hidden,
                                     dedup ? h->tab.pair_stage : h->tab.route_stage, dedup ? h->d.W : h->d.K,
                                     NULL, NULL, NULL, NULL, NULL, 0, 0, stream),
             fn, "the pack kernel");
  /* Rank-major rows are the received pairs in order: they land in place. */
  EPX_CHECK(p2p(b, h, hk, rk, s->send, direct ? dst : s->recv, rb, fn));
  if (direct) return EPX_SUCCESS;
  const int32_t slots = dedup ? h->d.Kb : 1;
  CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, s->recv, dst, kind_rows(h, rk), c->hidden,
                                     dedup ? h->tab.rp_rows : h->tab.rr_row, slots,
                                     weighted ? (dedup ? h->tab.rp_w : h->tab.rr_w) : NULL, grad_w ? other : NULL,
                                     grad_w ? (float *)s->send : NULL, h->recv.row_src, &h->recv.result->rows,
                                     h->row_bound, 0, stream),
             fn, "the expand kernel");
  if (!grad_w) return EPX_SUCCESS;
  /* The dots go home: Kb floats per pair, or one per route. */
  EPX_CHECK(p2p(b, h, rk, hk, s->send, s->recv, 4 * (size_t)slots, fn));
  CUDA_CHECK(epx_cuda_ep_home_values_launch(&h->d, dedup, h->tab.pair_stage, h->tab.route_stage, h->tab.group,
                                            (const float *)s->recv, grad_w, stream),
             fn, "the weight gradient kernel");
fail:
  return status;
}

/* The fused kernels serve every call on a handle with a plan. */
#if EPX_HAVE_FUSED
#define FUSED_SERVES(handle) (((const ep_handle_t *)(handle)->backend_state)->plan != NULL)
/* Each route's value from its expert's rank to grad_w on its token's rank
 * (epx_fused_values_home_launch's mode: values per slot or row, or the dots
 * of combine_backward or dispatch_backward). */
static epx_status_t fused_values_home(epx_buffer_t b, epx_handle_t handle, int mode, const void *values,
                                      const void *home_rows, float *grad_w, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const ep_buffer_t *s = b->backend_state;
  EPX_CHECK(fused_alive(b, fn));
  FUSED_CHECK(epx_fused_values_home_launch(s->fused, ((const ep_handle_t *)handle->backend_state)->plan, mode, values,
                                          home_rows, grad_w, stream_of(b)),
             fn, "the fused weight gradient kernels");
fail:
  return status;
}

/* dispatch_backward's grad_w: x goes to the experts' ranks again, into the
 * window only (this rank's own rows stay in x), where each route's dot
 * <grad_recv_x(t, k), x[t]> is formed and sent home. The host path brings
 * every route row home instead (K rows per token, not one per rank). */
static epx_status_t fused_dispatch_dots(epx_buffer_t b, epx_handle_t handle, const void *grad_recv_x, const void *x,
                                        float *grad_w, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  EPX_CHECK(fused_alive(b, fn));
  FUSED_CHECK(epx_fused_dispatch_launch(s->fused, ((const ep_handle_t *)handle->backend_state)->plan, x,
                                       epx_fused_recv_window(s->fused), 0, s->fused_ctas, 0, stream_of(b)),
             fn, "the fused dispatch kernels");
  EPX_CHECK(fused_values_home(b, handle, EPX_FUSED_VALUES_DISPATCH_DOTS, grad_recv_x, x, grad_w, fn));
fail:
  return status;
}
#else
#define FUSED_SERVES(handle) 0
#define fused_move(b, handle, src, dst, forward, weighted, precision, fn) EPX_ERROR_INTERNAL
#define fused_values_home(b, handle, mode, values, home_rows, grad_w, fn) EPX_ERROR_INTERNAL
#define fused_dispatch_dots(b, handle, grad_recv_x, x, grad_w, fn) EPX_ERROR_INTERNAL
#endif

epx_status_t epx_cuda_ep_dispatch(epx_buffer_t b, epx_handle_t handle, const void *x, void *recv_x) {
  if (FUSED_SERVES(handle))
    return fused_move(b, handle, x, recv_x, 1, handle->weighting == EPX_WEIGHTS_IN_DISPATCH,
                      b->config.combine_precision, "epx_dispatch");
  return move_forward(b, handle, x, recv_x, handle->weighting == EPX_WEIGHTS_IN_DISPATCH, NULL, NULL,
                      "epx_dispatch");
}

epx_status_t epx_cuda_ep_combine_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_out,
                                          const void *expert_out, void *grad_expert_out, float *grad_w) {
  if (FUSED_SERVES(handle)) {
    /* the dots read the grad_out rows this dispatch leaves in the window */
    const epx_status_t status = fused_move(b, handle, grad_out, grad_expert_out, 1,
                                           handle->weighting == EPX_WEIGHTS_IN_COMBINE, b->config.combine_precision,
                                           "epx_combine_backward");
    if (status != EPX_SUCCESS || !grad_w) return status;
    return fused_values_home(b, handle, EPX_FUSED_VALUES_COMBINE_DOTS, expert_out, grad_out, grad_w,
                             "epx_combine_backward");
  }
  return move_forward(b, handle, grad_out, grad_expert_out, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                      expert_out, grad_w, "epx_combine_backward");
}

/* Rank-major: each layout row is a pair; it goes home as it is and the
 * token's rank sums its pairs in rank order. */
static epx_status_t return_pairs(epx_buffer_t b, epx_handle_t handle, const void *rows, void *out, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const ep_handle_t *h = handle->backend_state;
  const ep_buffer_t *s = b->backend_state;
  cudaStream_t stream = stream_of(b);
  const size_t rb = (size_t)epx_buffer_row_bytes(b);
  const void *send = rows;
  if (h->d.worst) {
    CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, rows, s->send, h->row_bound, c->hidden, h->tab.stage_of_row, 1,
                                       NULL, NULL, NULL, NULL, NULL, 0, 0, stream),
               fn, "the pack kernel");
    send = s->send;
  }
  EPX_CHECK(p2p(b, h, RECV_PAIRS, HOME_PAIRS, send, s->recv, rb, fn));
  CUDA_CHECK(epx_cuda_gather_launch(c->dtype, s->recv, out, h->d.T, c->hidden, h->tab.pair_stage, h->d.W, NULL,
                                    NULL, NULL, 0, stream),
             fn, "the sum kernel");
fail:
  return status;
}

/* Backward direction: rows [N, H] in the layout -> out [T, H], the
 * canonical per-rank partial sums with partials of `precision`. weighted: w
 * applied; dot_x / grad_w:
 * grad_w[t, k] = <row(t, k), dot_x[t]> (dispatch_backward; needs the route
 * rows at home). */
static epx_status_t move_backward(epx_buffer_t b, epx_handle_t handle, const void *rows, void *out, int weighted,
                                  epx_combine_precision_t precision, const void *dot_x, float *grad_w,
                                  const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const ep_handle_t *h = handle->backend_state;
  const ep_buffer_t *s = b->backend_state;
  cudaStream_t stream = stream_of(b);
  const size_t rb = (size_t)epx_buffer_row_bytes(b);
  if (c->layout == EPX_LAYOUT_RANK_MAJOR) return return_pairs(b, handle, rows, out, fn);
  if (c->exchange == EPX_EXCHANGE_COLLECTIVE || grad_w) {
    /* Each route's row goes home; the token's rank forms the partials. */
    const int64_t n = h->d.worst ? h->row_bound : h->rows;
    CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, rows, s->send, n, c->hidden, h->tab.stage_of_row, 1, NULL, NULL,
                                       NULL, NULL, NULL, 0, 0, stream),
               fn, "the pack kernel");
    EPX_CHECK(p2p(b, h, RECV_ROUTES, HOME_ROUTES, s->send, s->recv, rb, fn));
    const epx_cuda_reduce_t red = {c->dtype, c->dtype, s->recv, out, h->d.T, c->hidden, h->tab.route_stage,
                                   h->tab.group, h->d.K, weighted ? h->w : NULL, grad_w ? dot_x : NULL, grad_w,
                                   precision == EPX_COMBINE_PARTIALS_PAYLOAD && c->dtype != EPX_FLOAT32};
    CUDA_CHECK(epx_cuda_reduce_launch(&red, stream), fn, "the sum kernel");
    return EPX_SUCCESS;
  }
  /* Dedup: the receiver sums each pair's routes, the token's rank the pairs. */
  const int f32 = f32_partials(b, precision);
  const int64_t items = kind_rows(h, RECV_PAIRS);
  const float *w = weighted ? h->tab.rp_w : NULL;
  if (f32) {
    const epx_cuda_reduce_t red = {c->dtype, EPX_FLOAT32, rows, s->send, items, c->hidden, h->tab.rp_rows, NULL,
                                   h->d.Kb, w, NULL, NULL, 0};
    CUDA_CHECK(epx_cuda_reduce_launch(&red, stream), fn, "the partial sum kernel");
  } else {
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, rows, s->send, items, c->hidden, h->tab.rp_rows, h->d.Kb, w, NULL,
                                      NULL, 0, stream),
               fn, "the partial sum kernel");
  }
  EPX_CHECK(p2p(b, h, RECV_PAIRS, HOME_PAIRS, s->send, s->recv, f32 ? 4 * (size_t)c->hidden : rb, fn));
  if (f32) {
    const epx_cuda_reduce_t red = {EPX_FLOAT32, c->dtype, s->recv, out, h->d.T, c->hidden, h->tab.pair_stage, NULL,
                                   h->d.W, NULL, NULL, NULL, 0};
    CUDA_CHECK(epx_cuda_reduce_launch(&red, stream), fn, "the sum kernel");
  } else {
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, s->recv, out, h->d.T, c->hidden, h->tab.pair_stage, h->d.W, NULL,
                                      NULL, NULL, 0, stream),
               fn, "the sum kernel");
  }
fail:
  return status;
}

epx_status_t epx_cuda_ep_combine(epx_buffer_t b, epx_handle_t handle, const void *expert_out, void *out) {
  if (FUSED_SERVES(handle))
    return fused_move(b, handle, expert_out, out, 0, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                      b->config.combine_precision, "epx_combine");
  return move_backward(b, handle, expert_out, out, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                       b->config.combine_precision, NULL, NULL, "epx_combine");
}

epx_status_t epx_cuda_ep_dispatch_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_recv_x,
                                           void *grad_x, const void *x, float *grad_w) {
  if (FUSED_SERVES(handle)) {
    if (grad_w) {
      const epx_status_t status = fused_dispatch_dots(b, handle, grad_recv_x, x, grad_w, "epx_dispatch_backward");
      if (status != EPX_SUCCESS) return status;
    }
    /* float32 partials whatever the combine_precision (epx.h) */
    return fused_move(b, handle, grad_recv_x, grad_x, 0, handle->weighting == EPX_WEIGHTS_IN_DISPATCH,
                      EPX_COMBINE_PARTIALS_FLOAT32, "epx_dispatch_backward");
  }
  return move_backward(b, handle, grad_recv_x, grad_x, handle->weighting == EPX_WEIGHTS_IN_DISPATCH,
                       EPX_COMBINE_PARTIALS_FLOAT32, x, grad_w, "epx_dispatch_backward");
}

epx_status_t epx_cuda_ep_weights_backward(epx_buffer_t b, epx_handle_t handle, const float *grad_recv_w,
                                          float *grad_w) {
  const char *fn = "epx_weights_backward";
  epx_status_t status = EPX_SUCCESS;
  const ep_handle_t *h = handle->backend_state;
  const ep_buffer_t *s = b->backend_state;
  cudaStream_t stream = stream_of(b);
  if (FUSED_SERVES(handle))
    return fused_values_home(b, handle,
                             b->config.layout == EPX_LAYOUT_RANK_MAJOR ? EPX_FUSED_VALUES_PER_SLOT
                                                                       : EPX_FUSED_VALUES_PER_ROW,
                             grad_recv_w, NULL, grad_w, fn);
  const int32_t slots = b->config.layout == EPX_LAYOUT_RANK_MAJOR ? handle->top_k : 1;
  CUDA_CHECK(epx_cuda_ep_route_values_launch(kind_rows(h, RECV_ROUTES), h->tab.rr_all, h->tab.rr_slot, slots,
                                             grad_recv_w, (float *)s->send, stream),
             fn, "the weight gradient kernel");
  EPX_CHECK(p2p(b, h, RECV_ROUTES, HOME_ROUTES, s->send, s->recv, 4, fn));
  CUDA_CHECK(epx_cuda_ep_home_values_launch(&h->d, 0, h->tab.pair_stage, h->tab.route_stage, h->tab.group,
                                            (const float *)s->recv, grad_w, stream),
             fn, "the weight gradient kernel");
fail:
  return status;
}

/* ------------------------------------------------------------------------ */
/* Queries                                                                   */
/* ------------------------------------------------------------------------ */

/* worst_case_sizing: the counts, N and the verdicts, read once. */
static epx_status_t settle_handle(epx_handle_t handle, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  ep_handle_t *h = handle->backend_state;
  if (h->rows >= 0) return EPX_SUCCESS;
  const int64_t *summary = NULL;
  EPX_CHECK(read_summary(handle->buffer, h, fn, &summary));
  EPX_CHECK(header_verdict(handle->buffer, h, summary, fn,
                           " (with worst_case_sizing epx_dispatch_layout does not wait for the verdict: invalid "
                           "routes were dropped, treated as -1; an oversize batch moved nothing)"));
  h->rows = summary[EPX_CUDA_EP_SUMMARY_ROWS(h->d.W)];
fail:
  return status;
}

epx_status_t epx_cuda_ep_recv_rows(epx_handle_t handle, int64_t *rows) {
  epx_status_t status = settle_handle(handle, "epx_handle_recv_rows");
  if (status == EPX_SUCCESS) *rows = ((ep_handle_t *)handle->backend_state)->rows;
  return status;
}

/* A fused handle's queries read its plan (the same arrays and values as the
 * host layout's: tested against it and the CPU backend on 2 GPUs). */
static int plan_view(const ep_handle_t *h, epx_fused_plan_view_t *v) {
#if EPX_HAVE_FUSED
  if (h->plan) epx_fused_plan_view(h->plan, v);
  return h->plan != NULL;
#else
  (void)h, (void)v;
  return 0;
#endif
}

epx_status_t epx_cuda_ep_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  const ep_handle_t *h = handle->backend_state;
  epx_fused_plan_view_t v;
  *rows = plan_view(h, &v) ? v.rows : &h->recv.result->rows;
  return EPX_SUCCESS;
}

epx_status_t epx_cuda_ep_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  const ep_handle_t *h = handle->backend_state;
  epx_fused_plan_view_t v;
  if (plan_view(h, &v))
    return epx_cuda_copy_expert_counts(v.counts, v.offsets, h->d.El, counts, offsets, handle->buffer->config.stream);
  return epx_cuda_copy_expert_counts(h->recv.counts, h->recv.offsets, h->d.El, counts, offsets,
                                     handle->buffer->config.stream);
}

epx_status_t epx_cuda_ep_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  const char *fn = "epx_handle_recv_routing";
  epx_status_t status = EPX_SUCCESS;
  const ep_handle_t *h = handle->backend_state;
  epx_fused_plan_view_t v;
  if (plan_view(h, &v)) {
    /* rank-major rows hold top_k slots (the plan's K is the routing's) */
    const int32_t words = handle->buffer->config.layout == EPX_LAYOUT_RANK_MAJOR ? v.top_k : 1;
    CUDA_CHECK(epx_cuda_ep_copy_rows_launch(v.row_expert, recv_expert, words, v.rows, h->row_bound,
                                            stream_of(handle->buffer)),
               fn, "the recv routing copy");
    CUDA_CHECK(epx_cuda_ep_copy_rows_launch(v.row_w, recv_w, words, v.rows, h->row_bound, stream_of(handle->buffer)),
               fn, "the recv routing copy");
    return EPX_SUCCESS;
  }
  CUDA_CHECK(epx_cuda_recv_routing_ranks_launch(handle->buffer->config.layout, &h->recv, h->gw, handle->top_k,
                                                h->d.Kb, h->d.rank * h->d.El, h->row_bound, recv_expert, recv_w,
                                                stream_of(handle->buffer)),
             fn, "the recv routing kernel");
fail:
  return status;
}

epx_status_t epx_cuda_ep_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  const char *fn = "epx_handle_recv_source";
  epx_status_t status = EPX_SUCCESS;
  const ep_handle_t *h = handle->backend_state;
  epx_fused_plan_view_t v;
  if (plan_view(h, &v)) {
    CUDA_CHECK(epx_cuda_ep_copy_rows_launch(v.row_src_rank, src_rank, 1, v.rows, h->row_bound,
                                            stream_of(handle->buffer)),
               fn, "the recv source copy");
    CUDA_CHECK(epx_cuda_ep_copy_rows_launch(v.row_src_token, src_token, 1, v.rows, h->row_bound,
                                            stream_of(handle->buffer)),
               fn, "the recv source copy");
    return EPX_SUCCESS;
  }
  CUDA_CHECK(epx_cuda_recv_source_ranks_launch(handle->buffer->config.layout, &h->recv, h->d.Kb, h->d.Tm,
                                               h->row_bound, src_rank, src_token, stream_of(handle->buffer)),
             fn, "the recv source kernel");
fail:
  return status;
}

epx_status_t epx_cuda_ep_stats(epx_handle_t handle, epx_handle_stats_t *stats) {
  ep_handle_t *h = handle->backend_state;
  epx_buffer_t b = handle->buffer;
  const int dedup = b->config.exchange == EPX_EXCHANGE_DEDUP;
  const int hk = dedup ? HOME_PAIRS : HOME_ROUTES, rk = dedup ? RECV_PAIRS : RECV_ROUTES;
  const int64_t *counts = NULL; /* worst_case_sizing: the true counts, read back */
  if (h->d.worst) {
    epx_status_t status = read_summary(b, h, "epx_handle_stats", &counts);
    if (status != EPX_SUCCESS) return status;
  }
  int64_t send = 0, recv = 0, self = 0;
  for (int32_t p = 0; p < h->d.W; p++) {
    const int64_t out = counts ? counts[hk * h->d.W + p] : h->count[hk][p];
    const int64_t in = counts ? counts[rk * h->d.W + p] : h->count[rk][p];
    if (p == b->rank) self = out;
    else send += out, recv += in;
  }
  const int64_t rb = epx_buffer_row_bytes(b);
  *stats = (epx_handle_stats_t){send, recv, send * rb, recv * rb, self};
  return EPX_SUCCESS;
}

#else /* a CUDA build without NCCL: one rank only */

epx_status_t epx_cuda_ep_buffer_init(epx_buffer_t b) {
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "epx_buffer_create: this build of epx has no NCCL transport, so the CUDA backend runs on a "
                   "comm of one rank (comm has %d); rebuild with NCCL (EPX_NCCL_ROOT) or use EPX_DEVICE_CPU",
                   b->world_size);
}
void epx_cuda_ep_buffer_fini(epx_buffer_t b) { (void)b; }
#define EPX_EP_UNREACHABLE return epx_error(EPX_ERROR_INTERNAL, "the CUDA backend has no W-rank path in this build")
epx_status_t epx_cuda_ep_dispatch_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t l, epx_handle_t h) {
  (void)b, (void)r, (void)l, (void)h;
  EPX_EP_UNREACHABLE;
}
void epx_cuda_ep_handle_fini(epx_handle_t h) { (void)h; }
epx_status_t epx_cuda_ep_agree(epx_buffer_t b, epx_status_t local, const char *caller) {
  (void)b, (void)caller;
  return local;
}
epx_status_t epx_cuda_ep_agree_call(epx_buffer_t b, epx_handle_t h, int grad_w, epx_status_t local,
                                    const char *caller) {
  (void)b, (void)h, (void)grad_w, (void)caller;
  return local;
}
epx_status_t epx_cuda_ep_dispatch(epx_buffer_t b, epx_handle_t h, const void *x, void *r) {
  (void)b, (void)h, (void)x, (void)r;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_combine(epx_buffer_t b, epx_handle_t h, const void *e, void *o) {
  (void)b, (void)h, (void)e, (void)o;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_dispatch_backward(epx_buffer_t b, epx_handle_t h, const void *g, void *gx, const void *x,
                                           float *gw) {
  (void)b, (void)h, (void)g, (void)gx, (void)x, (void)gw;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_combine_backward(epx_buffer_t b, epx_handle_t h, const void *g, const void *e, void *ge,
                                          float *gw) {
  (void)b, (void)h, (void)g, (void)e, (void)ge, (void)gw;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_weights_backward(epx_buffer_t b, epx_handle_t h, const float *g, float *gw) {
  (void)b, (void)h, (void)g, (void)gw;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_recv_rows(epx_handle_t h, int64_t *r) {
  (void)h, (void)r;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_recv_rows_device(epx_handle_t h, const int64_t **r) {
  (void)h, (void)r;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_expert_counts(epx_handle_t h, int64_t *c, int64_t *o) {
  (void)h, (void)c, (void)o;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_recv_routing(epx_handle_t h, int32_t *e, float *w) {
  (void)h, (void)e, (void)w;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_recv_source(epx_handle_t h, int32_t *r, int32_t *t) {
  (void)h, (void)r, (void)t;
  EPX_EP_UNREACHABLE;
}
epx_status_t epx_cuda_ep_stats(epx_handle_t h, epx_handle_stats_t *s) {
  (void)h, (void)s;
  EPX_EP_UNREACHABLE;
}
int64_t epx_cuda_ep_handle_bytes(epx_handle_t h) { (void)h; return 0; }
void epx_cuda_ep_peer_paths(epx_buffer_t b, int32_t *paths) {
  for (int32_t r = 0; r < b->world_size; r++) paths[r] = EPX_PATH_HOST;
}
#endif
