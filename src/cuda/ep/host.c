/* The host path of the W-rank backend (ep/internal.h): the buffer's device
 * transport (xport.h: NCCL's host API, in-process or ipc copies) on the
 * buffer's stream between the kernels of ep/tables.cu and one/.
 *
 * Layout: each rank validates its own routing on its GPU (in the kernel that
 * stages its send block; the capacity layout, whose slots must be claimed,
 * by the one-rank layout over all E experts; invalid routes become -1), and
 * every rank all-gathers every rank's sanitised routing [Tm, Kb] with a
 * header {tokens, oversize, invalid, top_k, weighting}. That gather is the
 * count exchange: from it each rank computes (ep/tables.cu) both sides of
 * every exchange — where each of its rows goes, and where each row it
 * receives comes from and lands — so no other metadata moves and no count
 * is read on the host except to size NCCL's messages.
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
 * fp8 dispatch moves the same items as dispatch: each row packed with its
 * scales into one staging row (core/payload.h's epx_payload_fp8_packed_bytes;
 * quantized into it from the payload dtype, once per token, with
 * quantize-on-dispatch), sent, and unpacked into recv_x_q and recv_scales
 * by the table that expands dispatch's rows (one/fp8.cu, strided): the
 * bytes arrive as sent, whatever the exchange. */
#include <stdint.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/placement.h"
#include "core/payload.h"
#include "cuda/backend.h"
#include "cuda/common/check.h"
#include "cuda/ep/internal.h"
#include "cuda/xport/xport.h"

#if EPX_HAVE_NCCL

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

/* Carves the handle's block: every array of ep_handle_t, one allocation. */
static epx_status_t carve(epx_buffer_t b, ep_handle_t *h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_cuda_ep_dims_t *d = &h->d;
  const int cap = b->config.layout == EPX_LAYOUT_CAPACITY, rank_major = b->config.layout == EPX_LAYOUT_RANK_MAJOR;
  const int64_t T = d->T, K = d->K, Kb = d->Kb, W = d->W, G = W * d->Tm, E = b->placement->num_physical,
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
  for (size_t i = 0; i < n; i++) bytes += epx_round256((size_t)parts[i].bytes);
  CUDA_CHECK(cudaMallocAsync(&h->block, bytes, stream_of(b)), fn, "cudaMallocAsync of the handle's layout");
  h->block_bytes = bytes;
  char *at = h->block;
  for (size_t i = 0; i < n; i++) {
    *parts[i].ptr = parts[i].bytes ? at : NULL;
    at += epx_round256((size_t)parts[i].bytes);
  }
  if (!h->has_w) h->w = NULL;
  h->tab.scan = h->scan, h->tab.gidx = h->gidx, h->tab.ridx = h->ridx, h->tab.ghdr = h->ghdr;
  h->tab.gw = h->gw, h->tab.recv = &h->recv, h->tab.own_result = h->own.result, h->tab.summary = h->summary;
fail:
  return status;
}

/* The routing all-gather (idx, w, locations, header) on the buffer's
 * stream: one group of the buffer's transport. */
static epx_status_t gather_routing(epx_buffer_t b, const epx_cuda_ep_dims_t *d, const int32_t *sidx,
                                   const float *sw, const int32_t *sloc, const int32_t *shdr, int32_t *gidx,
                                   float *gw, int32_t *gloc, int32_t *ghdr, const char *fn) {
  const ep_buffer_t *s = b->backend_state;
  const size_t n = 4 * (size_t)(d->Tm * d->Kb);
  const void *send[4] = {sidx, sw, sloc ? sloc : shdr, shdr};
  void *recv[4] = {gidx, gw, sloc ? gloc : ghdr, ghdr};
  const size_t bytes[4] = {n, n, sloc ? n : 4 * EPX_CUDA_EP_HDR_INTS, 4 * EPX_CUDA_EP_HDR_INTS};
  return s->xport->allgather(b->comm, send, recv, bytes, sloc ? 4 : 3, stream_of(b), fn);
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
  const size_t send = epx_round256(4 * n) * 3 + epx_round256(hdr),
               recv = epx_round256(4 * G) * 3 + epx_round256(hdr * (size_t)d->W);
  char *block = NULL;
  CUDA_CHECK(cudaMallocAsync((void **)&block, send + recv, stream), fn, "cudaMallocAsync");
  int32_t *sidx = (int32_t *)block, *sloc = (int32_t *)(block + 2 * epx_round256(4 * n));
  float *sw = (float *)(block + epx_round256(4 * n));
  int32_t *shdr = (int32_t *)(block + 3 * epx_round256(4 * n));
  char *g = block + send;
  CUDA_CHECK(epx_cuda_ep_stage_launch(d, NULL, NULL, NULL, NULL, 1, sidx, sw, cap ? sloc : NULL, shdr, stream), fn,
             "the routing stage kernel");
  status = gather_routing(b, d, sidx, sw, cap ? sloc : NULL, shdr, (int32_t *)g, (float *)(g + epx_round256(4 * G)),
                          (int32_t *)(g + 2 * epx_round256(4 * G)), (int32_t *)(g + 3 * epx_round256(4 * G)), fn);
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
                                                 b->placement->num_physical, h->w, h->own.result, h->sidx, h->sw, h->shdr,
                                                 stream),
               fn, "the routing stage kernel");
  else if (d->T > 0)
    CUDA_CHECK(epx_cuda_layout_launch(r->topk_idx, r->locations, r->topk_w, h->w, d->T, d->K, b->placement->num_physical,
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

static int64_t fp8_packed_bytes(epx_buffer_t b) {
  const epx_payload_format_t f = epx_payload_fp8(b->config.fp8_format, b->config.dtype, b->config.hidden);
  return epx_payload_fp8_packed_bytes(&f);
}

static size_t staging_bytes(epx_buffer_t b, const ep_handle_t *h) {
  const size_t rb = (size_t)epx_buffer_row_bytes(b);
  /* a float32 partial per pair: combine's with float32 partials,
   * dispatch_backward's always (expert-major and capacity; a rank-major
   * row is its rank's partial) */
  const int f32 = f32_partials(b, b->config.combine_precision) ||
                  (f32_partials(b, EPX_COMBINE_PARTIALS_FLOAT32) && b->config.layout != EPX_LAYOUT_RANK_MAJOR);
  const size_t unit = f32 ? (size_t)epx_payload_partial_row_bytes(b->config.hidden) : rb;
  int64_t rows = 0, pairs = 0;
  for (int kind = 0; kind < KINDS; kind++) rows = max64(rows, kind_rows(h, kind));
  pairs = max64(kind_rows(h, HOME_PAIRS), kind_rows(h, RECV_PAIRS));
  /* an fp8 buffer's packed rows are smaller than its dtype's (bf16 or f32)
   * rows; the max says so rather than relying on it */
  const size_t packed = b->config.fp8_format == EPX_FP8_NONE ? 0 : (size_t)fp8_packed_bytes(b);
  const size_t widest = unit > rb ? unit : rb;
  const size_t need = (size_t)rows * (widest > packed ? widest : packed);
  const size_t floats = (size_t)pairs * (size_t)h->d.Kb * 4;
  return (need > floats ? need : floats) + 256;
}

/* Grouped send/recv of `unit`-byte rows (the buffer's transport, xport.h):
 * this rank's items of kind `skind` to each peer from send, the peers'
 * items of kind `rkind` into recv. The self block goes through the group
 * too: NCCL copies it while the remote rows travel (a separate copy before
 * the group would serialise it; a copy beside it on a second stream, from x
 * straight into recv_x with only the remote rows packed first, measured
 * slower: bench/NOTES-gpu.md). */
static epx_status_t p2p(epx_buffer_t b, const ep_handle_t *h, int skind, int rkind, const void *send, void *recv,
                        size_t unit, const char *fn) {
  const ep_buffer_t *s = b->backend_state;
  const int32_t W = h->d.W;
  epx_cuda_move_t *m = malloc(2 * sizeof *m * (size_t)W);
  if (!m) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t p = 0; p < W; p++) {
    m[p] = (epx_cuda_move_t){p, (char *)send + (size_t)h->displ[skind][p] * unit, (size_t)h->count[skind][p] * unit};
    m[W + p] = (epx_cuda_move_t){p, (char *)recv + (size_t)h->displ[rkind][p] * unit, (size_t)h->count[rkind][p] * unit};
  }
  const epx_status_t status = s->xport->sendrecv(b->comm, m, W, m + W, W, stream_of(b), fn);
  free(m);
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

/* fp8 dispatch: move_forward's items as packed rows (x_q and x_scales, or x
 * of the payload dtype quantized into them), unpacked by the expand table
 * into recv_q [N, H] and recv_scales [N, S]; padding rows zero in both.
 * Rank-major rows are unpacked too (they cannot land in place: the row and
 * its scales go to two tensors). */
static epx_status_t move_fp8(epx_buffer_t b, epx_handle_t handle, const void *x, const void *x_scales, int quantize,
                             void *recv_q, void *recv_scales, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const ep_handle_t *h = handle->backend_state;
  const ep_buffer_t *s = b->backend_state;
  cudaStream_t stream = stream_of(b);
  const int dedup = c->exchange == EPX_EXCHANGE_DEDUP;
  const int hk = dedup ? HOME_PAIRS : HOME_ROUTES, rk = dedup ? RECV_PAIRS : RECV_ROUTES;
  const epx_payload_format_t f = epx_payload_fp8(c->fp8_format, c->dtype, c->hidden);
  const int64_t packed = epx_payload_fp8_packed_bytes(&f);
  const epx_cuda_fp8_strides_t pack = {quantize ? epx_payload_row_bytes(c->dtype, c->hidden) : f.row_bytes,
                                       f.scale_bytes, packed, packed};
  const epx_cuda_fp8_strides_t unpack = {packed, packed, f.row_bytes, f.scale_bytes};
  char *send = s->send, *recv = s->recv;
  CUDA_CHECK(epx_cuda_fp8_scatter_strided_launch(c->fp8_format, c->dtype, quantize, x, x_scales, send,
                                                 send + f.row_bytes, &pack, h->d.T, c->hidden,
                                                 dedup ? h->tab.pair_stage : h->tab.route_stage,
                                                 dedup ? h->d.W : h->d.K, NULL, NULL, NULL, 0, stream),
             fn, quantize ? "the quantize and pack kernel" : "the fp8 pack kernel");
  EPX_CHECK(p2p(b, h, hk, rk, send, recv, (size_t)packed, fn));
  CUDA_CHECK(epx_cuda_fp8_scatter_strided_launch(c->fp8_format, c->dtype, 0, recv, recv + f.row_bytes, recv_q,
                                                 recv_scales, &unpack, kind_rows(h, rk), c->hidden,
                                                 dedup ? h->tab.rp_rows : h->tab.rr_row, dedup ? h->d.Kb : 1, NULL,
                                                 h->recv.row_src, &h->recv.result->rows, h->row_bound, stream),
             fn, "the fp8 expand kernel");
fail:
  return status;
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
  EPX_CHECK(p2p(b, h, RECV_PAIRS, HOME_PAIRS, s->send, s->recv, f32 ? (size_t)epx_payload_partial_row_bytes(c->hidden) : rb, fn));
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

static epx_status_t host_setup(epx_buffer_t b, const char *fn, int *takes) {
  (void)b, (void)fn;
  *takes = 1;
  return EPX_SUCCESS;
}

static void host_buffer_fini(epx_buffer_t b) {
  ep_buffer_t *s = b->backend_state;
  if (s->send) cudaFreeAsync(s->send, stream_of(b));
  if (s->recv) cudaFreeAsync(s->recv, stream_of(b));
}

static epx_status_t host_layout(epx_buffer_t b, const epx_routing_t *r, ep_handle_t *h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  EPX_CHECK(carve(b, h, fn));
  EPX_CHECK(enqueue_layout(b, r, h, fn));
fail:
  return status;
}

static size_t host_readback_bytes(const ep_handle_t *h) {
  (void)h;
  return 0;
}

/* The tables kernel's summary. */
static epx_status_t host_readback(epx_buffer_t b, const ep_handle_t *h, int64_t *host, size_t summary_bytes,
                                  const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  CUDA_CHECK(cudaMemcpyAsync(host, h->summary, summary_bytes, cudaMemcpyDeviceToHost, stream_of(b)), fn,
             "cudaMemcpyAsync of the counts");
fail:
  return status;
}

/* The staging, sized at the layout: a captured step never grows it. */
static epx_status_t host_laid_out(epx_buffer_t b, ep_handle_t *h, const int64_t *summary, const char *fn) {
  (void)summary;
  return ensure_staging(b, staging_bytes(b, h), fn);
}

static void host_handle_fini(epx_buffer_t b, ep_handle_t *h) { (void)b, (void)h; }

static epx_status_t host_dispatch(epx_buffer_t b, epx_handle_t handle, const void *x, void *recv_x) {
  return move_forward(b, handle, x, recv_x, handle->weighting == EPX_WEIGHTS_IN_DISPATCH, NULL, NULL,
                      "epx_dispatch");
}

static epx_status_t host_dispatch_fp8(epx_buffer_t b, epx_handle_t handle, const void *x, const void *x_scales,
                                      int quantize, void *recv_x_q, void *recv_scales) {
  return move_fp8(b, handle, x, x_scales, quantize, recv_x_q, recv_scales,
                  quantize ? "epx_dispatch_quantize" : "epx_dispatch_fp8");
}

static epx_status_t host_combine_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_out,
                                          const void *expert_out, void *grad_expert_out, float *grad_w) {
  return move_forward(b, handle, grad_out, grad_expert_out, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                      expert_out, grad_w, "epx_combine_backward");
}

static epx_status_t host_combine(epx_buffer_t b, epx_handle_t handle, const void *expert_out, void *out) {
  return move_backward(b, handle, expert_out, out, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                       b->config.combine_precision, NULL, NULL, "epx_combine");
}

static epx_status_t host_dispatch_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_recv_x,
                                           void *grad_x, const void *x, float *grad_w) {
  return move_backward(b, handle, grad_recv_x, grad_x, handle->weighting == EPX_WEIGHTS_IN_DISPATCH,
                       EPX_COMBINE_PARTIALS_FLOAT32, x, grad_w, "epx_dispatch_backward");
}

static epx_status_t host_weights_backward(epx_buffer_t b, epx_handle_t handle, const float *grad_recv_w,
                                          float *grad_w) {
  const char *fn = "epx_weights_backward";
  epx_status_t status = EPX_SUCCESS;
  const ep_handle_t *h = handle->backend_state;
  const ep_buffer_t *s = b->backend_state;
  cudaStream_t stream = stream_of(b);
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

static epx_status_t host_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  const ep_handle_t *h = handle->backend_state;
  *rows = &h->recv.result->rows;
  return EPX_SUCCESS;
}

static epx_status_t host_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  const ep_handle_t *h = handle->backend_state;
  return epx_cuda_copy_expert_counts(h->recv.counts, h->recv.offsets, h->d.El, counts, offsets,
                                     handle->buffer->config.stream);
}

static epx_status_t host_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  const ep_handle_t *h = handle->backend_state;
  return epx_cuda_status(epx_cuda_recv_routing_ranks_launch(handle->buffer->config.layout, &h->recv, h->gw,
                                                            handle->top_k, h->d.Kb, h->d.rank * h->d.El,
                                                            h->row_bound, recv_expert, recv_w,
                                                            stream_of(handle->buffer)),
                         "epx_handle_recv_routing", "the recv routing kernel");
}

static epx_status_t host_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  const ep_handle_t *h = handle->backend_state;
  return epx_cuda_status(epx_cuda_recv_source_ranks_launch(handle->buffer->config.layout, &h->recv, h->d.Kb,
                                                           h->d.Tm, h->row_bound, src_rank, src_token,
                                                           stream_of(handle->buffer)),
                         "epx_handle_recv_source", "the recv source kernel");
}

static void host_peer_paths(epx_buffer_t b, int32_t *paths) {
  for (int32_t r = 0; r < b->world_size; r++) paths[r] = EPX_PATH_HOST;
}

const ep_path_t epx_cuda_ep_host_path = {
    .name = "host",
    .setup = host_setup,
    .buffer_fini = host_buffer_fini,
    .layout = host_layout,
    .join_oversize = join_oversize,
    .readback_bytes = host_readback_bytes,
    .readback = host_readback,
    .summary = NULL,
    .laid_out = host_laid_out,
    .handle_fini = host_handle_fini,
    .dispatch = host_dispatch,
    .dispatch_fp8 = host_dispatch_fp8,
    .combine = host_combine,
    .dispatch_backward = host_dispatch_backward,
    .combine_backward = host_combine_backward,
    .weights_backward = host_weights_backward,
    .recv_rows_device = host_recv_rows_device,
    .expert_counts = host_expert_counts,
    .recv_routing = host_recv_routing,
    .recv_source = host_recv_source,
    .peer_paths = host_peer_paths,
};

#endif
