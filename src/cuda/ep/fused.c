/* The fused path of the W-rank backend (ep/internal.h): the fused NVLink
 * kernels of src/cuda/fused (dedup; EPX_PATH_FUSED, or AUTO for rank-major;
 * peers without load/store access relayed through NCCL's host API between
 * the fused kernels, fused/relay.cu). The buffer holds the fused state,
 * each handle a fused plan, and the layout is the fused layout alone (three
 * kernels, no NCCL call, no memset): it validates the routing as the host
 * path's stage kernel does, exchanges the counts and every rank's header
 * {tokens, oversize, invalid, top_k, weighting} through the window, and lays
 * out both sides. The handle's queries read the plan (rows, counts,
 * offsets, sources, routing) and its verdicts and stats its read-back (the
 * summary's format, the same values as the tables kernel's; with default
 * sizing read once at the layout, as on the host path). An oversize rank
 * (worst_case_sizing) joins with an empty fused layout and its header, which
 * empties every rank's plan, as its gather header empties the host layout.
 * The routing weights' gradients are fused too (each route's value formed
 * on its expert's rank goes home through the window, fused/values.cu;
 * dispatch_backward's <grad_recv_x(t, k), x[t]> after a dispatch of x into
 * the window), so a fused handle never makes the host layout. dispatch /
 * combine_backward are the fused dispatch, combine / dispatch_backward the
 * fused combine: the same bits as the host path (P(t, r) in k order in
 * float32 without FMA, rounded once to the dtype in payload precision — own
 * partial included, as the host path rounds its self block — summed over r
 * ascending, rounded once). fp8 dispatch packs rows as the host path does
 * (fused_dispatch_fp8): each token's row and scales in one packed row,
 * moved by the fused dispatch kernels once per destination rank into the
 * window's rank-major rows, unpacked from there into the buffer's layout:
 * the host path's bytes. */
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/placement.h"
#include "core/nccl.h"
#include "core/payload.h"
#include "core/transport.h"
#include "cuda/backend.h"
#include "cuda/common/check.h"
#include "cuda/ep/internal.h"

#if EPX_HAVE_NCCL && EPX_HAVE_FUSED

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

/* An fp8 buffer's own memory on the fused path (ep_buffer_t.path_state):
 * [max_tokens, packed] rows, this rank's quantized and packed with their
 * scales by epx_dispatch_quantize; one stream-ordered allocation made with
 * the fused state. */
static epx_status_t fp8_staging_create(epx_buffer_t b, const char *fn, char **rows) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const epx_payload_format_t f = epx_payload_fp8(c->fp8_format, c->dtype, c->hidden);
  CUDA_CHECK(cudaMallocAsync((void **)rows, (size_t)(b->max_tokens * epx_payload_fp8_packed_bytes(&f)),
                             stream_of(b)),
             fn, "cudaMallocAsync of the fp8 rows' staging");
fail:
  return status;
}

static void fp8_staging_free(epx_buffer_t b, char *rows) {
  if (rows) cudaFreeAsync(rows, stream_of(b));
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
  const epx_buffer_config_t *c = &b->config;
  /* The kernels' waits on a peer give up a little before the host's
   * bounded waits that enclose them, so a dead peer is reported by the
   * fused error word (naming the peer and the phase) and the comm is
   * aborted only after the kernels have returned. */
  /* the expert-major combine stages float32 partials (dispatch_backward's
   * always, combine's with EPX_COMBINE_PARTIALS_FLOAT32) in the window's
   * payload rows: they are float32 rows then */
  const int f32_rows = c->layout != EPX_LAYOUT_RANK_MAJOR;
  /* the kernels' experts are the placement's physical ones, in rank order */
  const epx_fused_config_t fc = {c->dtype, c->hidden, b->placement->num_physical, c->max_top_k, b->max_tokens,
                                 0.9 * b->comm->timeout_seconds, EP_FUSED_BULK_COPY, f32_rows};
  epx_fused_t *f = NULL;
  char reason[768] = "";
  /* the highest refusing rank + 1, 0 where none refused */
  const epx_fused_ranks_t ranks = {s->xport == &epx_cuda_xport_nccl ? epx_nccl_comm(b->comm) : NULL, b->comm,
                                   s->xport};
  int64_t refused = epx_fused_create(&ranks, &fc, &f) != EPX_SUCCESS ? b->rank + 1 : 0;
  char *fp8_rows = NULL; /* an fp8 buffer's staging, agreed with the window */
  if (!refused && c->fp8_format != EPX_FP8_NONE && fp8_staging_create(b, fn, &fp8_rows) != EPX_SUCCESS)
    refused = b->rank + 1;
  if (refused) snprintf(reason, sizeof reason, "%s", epx_last_error());
  epx_status_t status = b->comm->ops->allreduce_max_i64(b->comm, fn, &refused, 1);
  if (status != EPX_SUCCESS || refused) {
    fp8_staging_free(b, fp8_rows);
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
  s->fused_ctas = epx_fused_ctas(f, c->sm_budget);
  s->fused = f;
  s->path_state = fp8_rows;
  return EPX_SUCCESS;
}

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
  char what[768], shared[512];
  epx_fused_co_resident_note(s->fused, shared, sizeof shared);
  snprintf(what, sizeof what, "rank %d did not answer the fused exchange (%s) within the comm's timeout, or the "
           "relay to it failed; the buffer's fused state has failed%s", (int)peer, phase ? phase : "?", shared);
  return s->xport->fail_timeout(b->comm, fn, what);
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
static epx_status_t fused_setup(epx_buffer_t b, const char *fn, int *takes) {
  const epx_status_t status = ensure_fused(b, fn);
  *takes = status == EPX_SUCCESS && ((const ep_buffer_t *)b->backend_state)->fused != NULL;
  return status;
}

static void fused_buffer_fini(epx_buffer_t b) {
  ep_buffer_t *s = b->backend_state;
  /* a fused wait that timed out (no call since reported it) fails the comm
   * first: then the window is abandoned, not deregistered collectively */
  if (s->fused && !b->comm->failed) (void)fused_alive(b, "epx_buffer_destroy");
  while (s->pooled > 0) epx_fused_plan_destroy(s->pool[--s->pooled], stream_of(b));
  if (s->spare) epx_fused_plan_destroy(s->spare, stream_of(b));
  /* collective: the window is deregistered, unless the comm failed (its
   * NCCL comm was aborted, windows and all) */
  if (s->fused && !b->comm->failed) epx_fused_destroy(s->fused);
  else if (s->fused) epx_fused_abandon(s->fused);
  fp8_staging_free(b, s->path_state);
  s->path_state = NULL;
}

static epx_status_t fused_join(epx_buffer_t b, const epx_cuda_ep_dims_t *d, const char *fn) {
  return fused_join_oversize(b, d->weighting, fn);
}

static size_t fused_readback_bytes(const ep_handle_t *h) { return epx_fused_plan_readback_bytes(h->plan); }

/* The plan's read-back, after the summary's place. */
static epx_status_t fused_readback(epx_buffer_t b, const ep_handle_t *h, int64_t *host, size_t summary_bytes,
                                   const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  CUDA_CHECK(epx_fused_plan_readback_launch(h->plan, (char *)host + summary_bytes, stream_of(b)), fn,
             "cudaMemcpyAsync of the counts");
fail:
  return status;
}

/* A fused layout whose wait on a peer timed out left no valid counts. */
static epx_status_t fused_form_summary(epx_buffer_t b, const ep_handle_t *h, int64_t *host, size_t summary_bytes,
                                       const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  EPX_CHECK(fused_alive(b, fn));
  fused_summary(h, (const char *)host + summary_bytes, host);
fail:
  return status;
}

/* Every rank reads its counts at a layout with default sizing: the relay's
 * messages to peers without load/store access take their sizes from them. */
static epx_status_t fused_laid_out(epx_buffer_t b, ep_handle_t *h, const int64_t *summary, const char *fn) {
  (void)fn;
  if (summary) epx_fused_plan_host_counts(h->plan, summary + HOME_PAIRS * b->world_size,
                                          summary + RECV_PAIRS * b->world_size);
  return EPX_SUCCESS;
}

/* A released handle's plan goes back to the buffer's pool (or is freed). */
static void fused_handle_fini(epx_buffer_t b, ep_handle_t *h) {
  ep_buffer_t *s = b->backend_state;
  if (h->plan && s->pooled < (int)(sizeof s->pool / sizeof s->pool[0])) s->pool[s->pooled++] = h->plan;
  else if (h->plan) epx_fused_plan_destroy(h->plan, stream_of(b));
}

static epx_status_t fused_dispatch(epx_buffer_t b, epx_handle_t handle, const void *x, void *recv_x) {
  return fused_move(b, handle, x, recv_x, 1, handle->weighting == EPX_WEIGHTS_IN_DISPATCH,
                    b->config.combine_precision, "epx_dispatch");
}

/* A fused handle's plan, as its queries and fp8 dispatch read it (the same
 * arrays and values as the host layout's: tested against it and the CPU
 * backend on 2 GPUs). */
static epx_fused_plan_view_t view_of(epx_handle_t handle) {
  epx_fused_plan_view_t v;
  epx_fused_plan_view(((const ep_handle_t *)handle->backend_state)->plan, &v);
  return v;
}

/* fp8 dispatch: the host path's packed rows (ep/host.c, move_fp8) through
 * the fused dispatch kernels. Each token's e4m3 row and scales, gathered
 * by the senders on the way (or its row of the dtype, quantized first into
 * packed rows), in one row of epx_payload_fp8_packed_bytes (never wider
 * than the dtype's rows: the window holds them), moved unweighted once per
 * destination rank into the receivers' windows as rank-major rows
 * (epx_fused_dispatch_rows_launch, this rank's own rows too), and unpacked
 * from there into recv_x_q [N, H] and recv_scales [N, S] in the buffer's
 * layout by the one-GPU fp8 kernel: rank-major row q to row q, rank-major
 * row q's k-slots to their expert-major (capacity) rows (the plan's
 * pair_rows), padding rows and unfilled slots zero in both. The bytes
 * arrive as sent. With worst_case_sizing the unpack reads the received
 * rows' count on the device. */
static epx_status_t fused_dispatch_fp8(epx_buffer_t b, epx_handle_t handle, const void *x, const void *x_scales,
                                       int quantize, void *recv_q, void *recv_scales) {
  const char *fn = quantize ? "epx_dispatch_quantize" : "epx_dispatch_fp8";
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  ep_buffer_t *s = b->backend_state;
  const ep_handle_t *h = handle->backend_state;
  char *staging = s->path_state; /* epx_dispatch_quantize's packed rows */
  cudaStream_t stream = stream_of(b);
  const epx_payload_format_t f = epx_payload_fp8(c->fp8_format, c->dtype, c->hidden);
  const int64_t packed = epx_payload_fp8_packed_bytes(&f);
  const epx_cuda_fp8_strides_t pack = {epx_payload_row_bytes(c->dtype, c->hidden), f.scale_bytes, packed, packed};
  const epx_cuda_fp8_strides_t unpack = {packed, packed, f.row_bytes, f.scale_bytes};
  const epx_fused_plan_view_t v = view_of(handle);
  const int rank_major = c->layout == EPX_LAYOUT_RANK_MAJOR;
  /* the window's rank-major rows to read: the received ones, or their bound
   * and their count on the device */
  const int64_t pairs = h->d.worst ? (int64_t)h->d.W * h->d.Tm : h->total[RECV_PAIRS];
  const char *window = epx_fused_recv_window(s->fused);
  EPX_CHECK(fused_alive(b, fn));
  if (quantize) {
    CUDA_CHECK(epx_cuda_fp8_scatter_strided_launch(c->fp8_format, c->dtype, 1, x, NULL, staging,
                                                   staging + f.row_bytes, &pack, h->d.T, c->hidden, NULL, 1, NULL,
                                                   NULL, NULL, 0, stream),
               fn, "the quantize and pack kernel");
    FUSED_CHECK(epx_fused_dispatch_rows_launch(s->fused, h->plan, staging, packed, NULL, 0, packed, s->fused_ctas,
                                               stream),
                fn, "the fused dispatch kernels");
  } else {
    FUSED_CHECK(epx_fused_dispatch_rows_launch(s->fused, h->plan, x, f.row_bytes, x_scales, f.scale_bytes, packed,
                                               s->fused_ctas, stream),
                fn, "the fused dispatch kernels");
  }
  CUDA_CHECK(epx_cuda_fp8_scatter_strided_launch(c->fp8_format, c->dtype, 0, window, window + f.row_bytes, recv_q,
                                                 recv_scales, &unpack, pairs, c->hidden,
                                                 rank_major ? NULL : v.pair_rows, rank_major ? 1 : v.top_k,
                                                 h->d.worst ? v.pairs : NULL, rank_major ? NULL : v.row_src_rank,
                                                 v.rows, h->row_bound, stream),
             fn, "the fp8 unpack kernel");
fail:
  return status;
}

static epx_status_t fused_combine_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_out,
                                           const void *expert_out, void *grad_expert_out, float *grad_w) {
  /* the dots read the grad_out rows this dispatch leaves in the window */
  const epx_status_t status = fused_move(b, handle, grad_out, grad_expert_out, 1,
                                         handle->weighting == EPX_WEIGHTS_IN_COMBINE, b->config.combine_precision,
                                         "epx_combine_backward");
  if (status != EPX_SUCCESS || !grad_w) return status;
  return fused_values_home(b, handle, EPX_FUSED_VALUES_COMBINE_DOTS, expert_out, grad_out, grad_w,
                           "epx_combine_backward");
}

static epx_status_t fused_combine(epx_buffer_t b, epx_handle_t handle, const void *expert_out, void *out) {
  return fused_move(b, handle, expert_out, out, 0, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                    b->config.combine_precision, "epx_combine");
}

static epx_status_t fused_dispatch_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_recv_x,
                                            void *grad_x, const void *x, float *grad_w) {
  if (grad_w) {
    const epx_status_t status = fused_dispatch_dots(b, handle, grad_recv_x, x, grad_w, "epx_dispatch_backward");
    if (status != EPX_SUCCESS) return status;
  }
  /* float32 partials whatever the combine_precision (epx.h) */
  return fused_move(b, handle, grad_recv_x, grad_x, 0, handle->weighting == EPX_WEIGHTS_IN_DISPATCH,
                    EPX_COMBINE_PARTIALS_FLOAT32, "epx_dispatch_backward");
}

static epx_status_t fused_weights_backward(epx_buffer_t b, epx_handle_t handle, const float *grad_recv_w,
                                           float *grad_w) {
  return fused_values_home(b, handle,
                           b->config.layout == EPX_LAYOUT_RANK_MAJOR ? EPX_FUSED_VALUES_PER_SLOT
                                                                     : EPX_FUSED_VALUES_PER_ROW,
                           grad_recv_w, NULL, grad_w, "epx_weights_backward");
}

static epx_status_t fused_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  *rows = view_of(handle).rows;
  return EPX_SUCCESS;
}

static epx_status_t fused_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  const ep_handle_t *h = handle->backend_state;
  const epx_fused_plan_view_t v = view_of(handle);
  return epx_cuda_copy_expert_counts(v.counts, v.offsets, h->d.El, counts, offsets, handle->buffer->config.stream);
}

/* Two of the plan's per-row tables (`words` 4-byte words a row) copied into
 * the caller's tensors, the received rows only; a NULL destination is
 * skipped. */
static cudaError_t copy_row_tables(epx_handle_t handle, const void *src_a, void *dst_a, const void *src_b,
                                   void *dst_b, int32_t words) {
  const ep_handle_t *h = handle->backend_state;
  const epx_fused_plan_view_t v = view_of(handle);
  cudaError_t err =
      epx_cuda_ep_copy_rows_launch(src_a, dst_a, words, v.rows, h->row_bound, stream_of(handle->buffer));
  if (err == cudaSuccess)
    err = epx_cuda_ep_copy_rows_launch(src_b, dst_b, words, v.rows, h->row_bound, stream_of(handle->buffer));
  return err;
}

static epx_status_t fused_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  const epx_fused_plan_view_t v = view_of(handle);
  /* rank-major rows hold top_k slots (the plan's K is the routing's) */
  const int32_t words = handle->buffer->config.layout == EPX_LAYOUT_RANK_MAJOR ? v.top_k : 1;
  return epx_cuda_status(copy_row_tables(handle, v.row_expert, recv_expert, v.row_w, recv_w, words),
                         "epx_handle_recv_routing", "the recv routing kernel");
}

static epx_status_t fused_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  const epx_fused_plan_view_t v = view_of(handle);
  return epx_cuda_status(copy_row_tables(handle, v.row_src_rank, src_rank, v.row_src_token, src_token, 1),
                         "epx_handle_recv_source", "the recv source kernel");
}

/* Each peer's transport (chosen at the fused state's creation): a relayed
 * peer (no load/store access) is served by NCCL's host API. */
static void fused_peer_paths(epx_buffer_t b, int32_t *paths) {
  int32_t transport[EPX_FUSED_MAX_RANKS];
  epx_fused_peer_transports(((const ep_buffer_t *)b->backend_state)->fused, transport);
  for (int32_t r = 0; r < b->world_size; r++)
    paths[r] = transport[r] == EPX_FUSED_PEER_RELAY ? EPX_PATH_HOST : EPX_PATH_FUSED;
}

const ep_path_t epx_cuda_ep_fused_path = {
    .name = "fused",
    .setup = fused_setup,
    .buffer_fini = fused_buffer_fini,
    .layout = fused_layout,
    .join_oversize = fused_join,
    .readback_bytes = fused_readback_bytes,
    .readback = fused_readback,
    .summary = fused_form_summary,
    .laid_out = fused_laid_out,
    .handle_fini = fused_handle_fini,
    .dispatch = fused_dispatch,
    .dispatch_fp8 = fused_dispatch_fp8,
    .combine = fused_combine,
    .dispatch_backward = fused_dispatch_backward,
    .combine_backward = fused_combine_backward,
    .weights_backward = fused_weights_backward,
    .recv_rows_device = fused_recv_rows_device,
    .expert_counts = fused_expert_counts,
    .recv_routing = fused_recv_routing,
    .recv_source = fused_recv_source,
    .peer_paths = fused_peer_paths,
};

#endif
