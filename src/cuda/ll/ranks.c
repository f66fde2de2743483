/* The low-latency decode mode on W ranks over the device transport
 * (cuda/xport/xport.h: NCCL's host API, in-process or ipc copies; ll.h, "W
 * ranks"): the low-latency path of the W-rank table (ep/internal.h), which
 * a CUDA buffer with config.low_latency = 1 over several ranks (or, in a
 * test build, one rank after epx_cuda_ep_at_one_rank) takes at creation.
 * It serves the epx_ll_* calls and the handle queries; the normal calls
 * never reach it (the API refuses them by name, epx_ll_refuse, agreed as
 * ep.c agrees a low-latency buffer's calls: not on the host).
 *
 * Dispatch: the home packs one slab per peer (its pairs' rows, then a
 * header with the count and each pair's token, routes and weights: the
 * counts travel with the rows, no layout exchange), one grouped
 * ncclSend/ncclRecv of the fixed slab size per peer, and the receiver lays
 * its rows out from the slabs on the device and expands them into the fixed
 * shape (expert-major; rank-major rows are the pairs as they came). Combine
 * mirrors it: the receiver sums each pair's routes into a partial (float32
 * or the dtype: combine_precision; a rank-major row is its pair's), a
 * partial slab goes home, and the home sums its pairs in rank order. These
 * are the normal dedup exchange's items, tables and kernels (scatter,
 * reduce, gather of launch.h; fp8 rows packed with their scales as the host
 * path packs them), in the same order, so the bits are the normal
 * exchange's. The load/store variant (window.c) takes expert-major buffers
 * of the dtype where the fused module serves them.
 *
 * Graph capture: sizes are the fixed worst case (max_tokens rows a peer),
 * the token count stays on the device, nothing is allocated after buffer
 * creation and nothing waits on the host. Each live handle owns a slot (its
 * layout and its staging both ways), allocated with the buffer, so a
 * second micro-batch's send never overwrites rows a first has not
 * completed. The send enqueues the moves up to NCCL's; complete enqueues
 * the receiving side (the layout and expansion, or the home's sums).
 *
 * Agreement: none on the host (that would wait): a call refused on one
 * rank only leaves its peers' transfers unmatched, and they fail at their
 * next bounded wait (as with worst_case_sizing); epx_buffer_destroy waits
 * for the stream bounded by the comm's timeout. */
#include <stdint.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "core/align.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/ll.h"
#include "core/transport.h"
#include "core/objects.h"
#include "core/payload.h"
#include "cuda/backend.h"
#include "cuda/common/buffer.h"
#include "cuda/common/check.h"
#include "cuda/ep/internal.h"
#include "cuda/launch.h"
#include "cuda/ll/ll.h"
#include "cuda/xport/xport.h"

#if EPX_HAVE_NCCL

typedef struct {
  epx_cuda_ll_dims_t d; /* the pending step's (its rows' bytes and slab size) */
  epx_cuda_ll_recv_t recv;
  int32_t *pair_stage; /* [max_tokens, W] home: staging row of the token's pair with each peer */
  char *send, *stage;  /* [W * S, unit] staging: outgoing slabs / incoming slabs */
  void *recv_x;        /* the pending dispatch's outputs (complete writes them) */
  void *recv_scales;   /* fp8: its scales, else NULL */
  int32_t *recv_count;
  void *out;           /* the pending combine's */
} slot_t;

/* The path's state of a buffer (ep_buffer_t.path_state) */
typedef struct {
  epx_cuda_ll_slots_t slots; /* N = El * W * max_tokens (rank-major: W * max_tokens) */
  epx_cuda_ll_dims_t d; /* the largest slab (S of the narrowest rows); row_bytes set per step */
  size_t unit;   /* bytes of a staging row: the widest of a dispatch row, an fp8 packed row, a partial */
  epx_cuda_ll_window_t *window; /* the load/store variant (window.c), or NULL: the slabs */
  int rank_major;               /* the layout: rank-major (the slabs only) or expert-major */
  slot_t slot[EPX_CUDA_LL_SLOTS];
} ranks_t;

static int rank_major(epx_buffer_t b) { return b->config.layout == EPX_LAYOUT_RANK_MAJOR; }

static ranks_t *state_of(epx_buffer_t b) { return ((ep_buffer_t *)b->backend_state)->path_state; }

/* A handle's slot (its ep_handle_t's path_state) and the slot's index. */
static slot_t *slot_of(epx_handle_t h) { return ((ep_handle_t *)h->backend_state)->path_state; }
static int index_of(epx_handle_t h) { return (int)(slot_of(h) - state_of(h->buffer)->slot); }

/* Bytes of one slot, and its arrays carved from `at` when not NULL. */
static size_t slot_carve(const ranks_t *s, char *at, slot_t *slot) {
  const epx_cuda_ll_dims_t *d = &s->d;
  const size_t N = (size_t)s->slots.N, El = (size_t)d->El;
  const size_t items = s->window ? 0 : (size_t)(d->W * d->S); /* the slabs' tables and staging */
  const size_t NK = N * (size_t)(s->rank_major ? d->Kb : 1); /* a row's routing: [N] or [N, K] */
  const size_t sizes[] = {items * (size_t)d->Kb * 4, items * (size_t)d->Kb * 4, El * 8, (El + 1) * 8, N * 4, N * 4,
                          NK * 4, NK * 4, items ? (size_t)(d->Tm * d->W) * 4 : 0, items * s->unit, items * s->unit};
  void **const fields[] = {(void **)&slot->recv.rp_rows,    (void **)&slot->recv.rp_w,
                           (void **)&slot->recv.counts,     (void **)&slot->recv.offsets,
                           (void **)&slot->recv.src_rank,   (void **)&slot->recv.src_token,
                           (void **)&slot->recv.row_expert, (void **)&slot->recv.row_weight,
                           (void **)&slot->pair_stage,      (void **)&slot->send,
                           (void **)&slot->stage};
  return epx_cuda_ll_carve(at, sizes, fields, sizeof sizes / sizeof sizes[0]);
}

/* An fp8 buffer's rows packed with their scales (core/payload.h), as the
 * normal host path moves them (ep/host.c). */
static epx_payload_format_t fp8_format_of(epx_buffer_t b) {
  return epx_payload_fp8(b->config.fp8_format, b->config.dtype, b->config.hidden);
}

static int64_t packed_bytes(epx_buffer_t b) {
  const epx_payload_format_t f = fp8_format_of(b);
  return epx_payload_fp8_packed_bytes(&f);
}

/* Slabs of rows of rb bytes: max_tokens of them, then the header's. */
static epx_cuda_ll_dims_t dims_of(epx_buffer_t b, int64_t rb) {
  const int64_t Tm = b->max_tokens;
  const int64_t header_rows = (epx_cuda_ll_header_bytes(Tm, b->config.max_top_k) + rb - 1) / rb;
  return (epx_cuda_ll_dims_t){b->world_size, b->rank, b->experts_per_rank, b->config.max_top_k, 0, Tm,
                              Tm + header_rows, rb};
}

/* The hierarchical exchange is not the low-latency path's: its slabs and
 * window move in one level. */
static int ll_supports(const epx_buffer_config_t *c, const char **why) {
  if (!c->low_latency || c->exchange != EPX_EXCHANGE_HIERARCHICAL) return 1;
  if (why) *why = "config.low_latency";
  return 0;
}

/* Takes every low-latency buffer: its slots (and window) for good. */
static epx_status_t ll_setup(epx_buffer_t b, const char *fn, int *takes) {
  *takes = b->config.low_latency != 0;
  if (!*takes) return EPX_SUCCESS;
  ranks_t *s = calloc(1, sizeof *s);
  if (!s) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  const int fp8 = b->config.fp8_format != EPX_FP8_NONE;
  const size_t rb = (size_t)epx_buffer_row_bytes(b), pb = (size_t)epx_payload_partial_row_bytes(b->config.hidden);
  const size_t packed = fp8 ? (size_t)packed_bytes(b) : rb;
  s->d = dims_of(b, (int64_t)(packed < rb ? packed : rb));
  s->rank_major = rank_major(b);
  s->slots.N = (s->rank_major ? 1 : (int64_t)s->d.El) * s->d.W * s->d.Tm;
  s->unit = rb > packed ? rb : packed;
  if (f32_partials(b, b->config.combine_precision) && pb > s->unit) s->unit = pb;
  epx_status_t status = epx_cuda_ll_window_create(b, &s->window);
  if (status != EPX_SUCCESS) {
    free(s);
    return status;
  }
  slot_t probe;
  const size_t slot_bytes = slot_carve(s, NULL, &probe);
  status = epx_cuda_ll_slots_alloc(&s->slots, slot_bytes, s->slots.N, fn,
                                   "cudaMalloc (the low-latency handles' layouts and staging)");
  if (status != EPX_SUCCESS) {
    epx_cuda_ll_window_destroy(b, s->window);
    free(s);
    return status;
  }
  for (int i = 0; i < EPX_CUDA_LL_SLOTS; i++) slot_carve(s, (char *)s->slots.block + (size_t)i * slot_bytes, &s->slot[i]);
  ((ep_buffer_t *)b->backend_state)->path_state = s;
  return EPX_SUCCESS;
}

/* Waits for the stream first, bounded (a transfer a peer never matched
 * fails the comm instead of hanging): enqueued work may use the slots.
 * Collective with a window (its deregistration), unless the comm failed. */
static void ll_buffer_fini(epx_buffer_t b) {
  const ep_buffer_t *e = b->backend_state;
  ranks_t *s = e->path_state;
  if (!s) return;
  if (e->xport->wait(b->comm, stream_of(b), "epx_buffer_destroy") == EPX_SUCCESS) cudaFree(s->slots.block);
  epx_cuda_ll_window_destroy(b, s->window);
  free(s);
}

static void ll_handle_fini(epx_buffer_t b, ep_handle_t *h) {
  ranks_t *s = state_of(b);
  if (h->path_state) epx_cuda_ll_slot_release(&s->slots, (int)((slot_t *)h->path_state - s->slot));
}

/* ------------------------------------------------------------------------ */
/* The moves                                                                 */
/* ------------------------------------------------------------------------ */

/* One group of the comm's transport: `bytes` from send + p * sstride to
 * every peer p, as many from p into recv + p * rstride. */
static epx_status_t p2p(epx_buffer_t b, const char *send, size_t sstride, char *recv, size_t rstride, size_t bytes,
                        const char *fn) {
  const epx_cuda_xport_t *xport = ((const ep_buffer_t *)b->backend_state)->xport;
  const int32_t W = b->world_size;
  epx_cuda_move_t *m = malloc(2 * sizeof *m * (size_t)W);
  if (!m) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t p = 0; p < W; p++) {
    m[p] = (epx_cuda_move_t){p, (char *)send + (size_t)p * sstride, bytes};
    m[W + p] = (epx_cuda_move_t){p, recv + (size_t)p * rstride, bytes};
  }
  const epx_status_t status = xport->sendrecv(b->comm, m, W, m + W, W, stream_of(b), fn);
  free(m);
  return status;
}

/* Home: the slabs (pairs' rows, headers) packed and sent. */
static epx_status_t send_slabs(epx_buffer_t b, slot_t *slot, const epx_routing_t *r, const int32_t *num_tokens,
                               const epx_ll_rows_t *rows) {
  const char *fn = rows->fp8 ? "epx_ll_dispatch_fp8" : "epx_ll_dispatch";
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const epx_cuda_ll_dims_t d = slot->d;
  CUDA_CHECK(epx_cuda_ll_pack_launch(&d, r->topk_idx, r->topk_w, num_tokens, r->num_tokens, slot->send,
                                     slot->pair_stage, stream_of(b)),
             fn, "the low-latency pack kernel");
  if (r->num_tokens && rows->fp8) {
    /* each row packed with its scales (quantized into them from x when no
     * x_scales come), as the normal host path packs them */
    const int quantize = !rows->x_scales;
    const epx_payload_format_t f = fp8_format_of(b);
    const epx_cuda_fp8_strides_t pack = {quantize ? epx_buffer_row_bytes(b) : f.row_bytes, f.scale_bytes,
                                         d.row_bytes, d.row_bytes};
    CUDA_CHECK(epx_cuda_fp8_scatter_strided_launch(c->fp8_format, c->dtype, quantize, rows->x, rows->x_scales,
                                                   slot->send, slot->send + f.row_bytes, &pack, r->num_tokens,
                                                   c->hidden, slot->pair_stage, d.W, NULL, NULL, NULL, 0, stream_of(b)),
               fn, quantize ? "the quantize and pack kernel" : "the fp8 pack kernel");
  } else if (r->num_tokens) {
    CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, rows->x, slot->send, r->num_tokens, c->hidden, slot->pair_stage, d.W,
                                       NULL, NULL, NULL, NULL, NULL, 0, 0, stream_of(b)),
               fn, "the pack kernel");
  }
  const size_t slab = (size_t)(d.S * d.row_bytes);
  EPX_CHECK(p2p(b, slot->send, slab, slot->stage, slab, slab, fn));
fail:
  return status;
}

/* The slabs' send (complete places the rows), or the window's whole step. */
static epx_status_t ll_dispatch_send(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t h,
                                     const epx_ll_rows_t *rows, int32_t *recv_count, const int32_t *num_tokens) {
  const char *fn = rows->fp8 ? "epx_ll_dispatch_fp8" : "epx_ll_dispatch";
  epx_status_t status = local;
  if (status != EPX_SUCCESS) return status;
  ranks_t *s = state_of(b);
  int index = 0;
  EPX_CHECK(epx_cuda_ll_slot_take(&s->slots, fn, &index));
  slot_t *slot = &s->slot[index];
  epx_cuda_ll_dims_t d = dims_of(b, rows->fp8 ? packed_bytes(b) : epx_buffer_row_bytes(b));
  d.K = r->top_k;
  slot->d = d;
  if (s->window)
    EPX_CHECK(epx_cuda_ll_window_dispatch(b, s->window, index, r, num_tokens, rows->x, rows->recv_x,
                                          &d, &slot->recv, recv_count));
  else
    EPX_CHECK(send_slabs(b, slot, r, num_tokens, rows));
  slot->recv_x = rows->recv_x;
  slot->recv_scales = rows->fp8 ? rows->recv_scales : NULL;
  slot->recv_count = recv_count;
  epx_cuda_ll_slot_hold(&s->slots, index, h);
  ep_handle_t *eh = h->backend_state;
  eh->path_state = slot;
  eh->rows = s->slots.N;
  return EPX_SUCCESS;
fail:
  return status;
}

/* Receiver: the layout from the slabs, then each pair's row to its rows. */
static epx_status_t place_rows(epx_buffer_t b, slot_t *slot) {
  const char *fn = "epx_ll_complete";
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const epx_cuda_ll_dims_t *d = &slot->d;
  CUDA_CHECK((rank_major(b) ? epx_cuda_ll_place_ranks_launch : epx_cuda_ll_place_launch)(
                 d, slot->stage, &slot->recv, slot->recv_count, stream_of(b)),
             fn, "the low-latency layout kernel");
  /* items: every slab's rows up to the last slab's header */
  const int64_t items = (d->W - 1) * d->S + d->Tm;
  if (slot->recv_scales) {
    const epx_payload_format_t f = fp8_format_of(b);
    const epx_cuda_fp8_strides_t unpack = {d->row_bytes, d->row_bytes, f.row_bytes, f.scale_bytes};
    CUDA_CHECK(epx_cuda_fp8_scatter_strided_launch(c->fp8_format, c->dtype, 0, slot->stage, slot->stage + f.row_bytes,
                                                   slot->recv_x, slot->recv_scales, &unpack, items, c->hidden,
                                                   slot->recv.rp_rows, d->Kb, NULL, NULL, NULL, 0, stream_of(b)),
               fn, "the fp8 expand kernel");
  } else {
    CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, slot->stage, slot->recv_x, items, c->hidden, slot->recv.rp_rows,
                                       d->Kb, NULL, NULL, NULL, NULL, NULL, 0, 0, stream_of(b)),
               fn, "the expand kernel");
  }
fail:
  return status;
}

/* Receiver: each received pair's partial (its routes in k order, weighted
 * in combine) into the slot's send staging at the pair's row, and home. */
static epx_status_t ll_combine_send(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *expert_out,
                                    void *out) {
  const char *fn = "epx_ll_combine";
  epx_status_t status = local;
  if (status != EPX_SUCCESS) return status;
  ranks_t *s = state_of(b);
  const epx_buffer_config_t *c = &b->config;
  slot_t *slot = slot_of(h);
  const int index = index_of(h);
  const epx_cuda_ll_dims_t *d = &slot->d;
  if (s->window) {
    EPX_CHECK(epx_cuda_ll_window_combine(b, s->window, index, d, expert_out, out,
                                         h->weighting == EPX_WEIGHTS_IN_COMBINE));
    s->slots.pending[index] = EPX_LL_COMBINE;
    return EPX_SUCCESS;
  }
  const size_t rb = (size_t)epx_buffer_row_bytes(b);
  if (s->rank_major) {
    /* rank-major rows are pairs already (no weights): source s's block of
     * expert_out goes home as it is, as the normal path returns them */
    EPX_CHECK(p2p(b, expert_out, (size_t)d->Tm * rb, slot->stage, (size_t)d->S * rb, (size_t)d->Tm * rb, fn));
    slot->out = out;
    s->slots.pending[index] = EPX_LL_COMBINE;
    return EPX_SUCCESS;
  }
  const int64_t items = (d->W - 1) * d->S + d->Tm;
  const float *w = h->weighting == EPX_WEIGHTS_IN_COMBINE ? slot->recv.rp_w : NULL;
  const int f32 = f32_partials(b, b->config.combine_precision);
  if (f32) {
    const epx_cuda_reduce_t red = {c->dtype, EPX_FLOAT32, expert_out, slot->send, items, c->hidden,
                                   slot->recv.rp_rows, NULL, d->Kb, w, NULL, NULL, 0};
    CUDA_CHECK(epx_cuda_reduce_launch(&red, stream_of(b)), fn, "the partial sum kernel");
  } else {
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, expert_out, slot->send, items, c->hidden, slot->recv.rp_rows, d->Kb,
                                      w, NULL, NULL, 0, stream_of(b)),
               fn, "the partial sum kernel");
  }
  /* partials are rows of float32 or of the dtype (not the dispatch's rows, fp8 ones perhaps) */
  const size_t unit = f32 ? (size_t)epx_payload_partial_row_bytes(c->hidden) : rb;
  EPX_CHECK(p2p(b, slot->send, (size_t)d->S * unit, slot->stage, (size_t)d->S * unit, (size_t)d->Tm * unit, fn));
  slot->out = out;
  s->slots.pending[index] = EPX_LL_COMBINE;
  return EPX_SUCCESS;
fail:
  return status;
}

/* Home: out[t] = the sum of its pairs' partials over the peers in rank
 * order, rounded once (zeros for tokens past the count). */
static epx_status_t sum_home(epx_buffer_t b, epx_handle_t h, slot_t *slot) {
  const char *fn = "epx_ll_complete";
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  if (!h->num_tokens) return EPX_SUCCESS;
  if (f32_partials(b, b->config.combine_precision) && !rank_major(b)) {
    const epx_cuda_reduce_t red = {EPX_FLOAT32, c->dtype, slot->stage, slot->out, h->num_tokens, c->hidden,
                                   slot->pair_stage, NULL, b->world_size, NULL, NULL, NULL, 0};
    CUDA_CHECK(epx_cuda_reduce_launch(&red, stream_of(b)), fn, "the sum kernel");
  } else {
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, slot->stage, slot->out, h->num_tokens, c->hidden, slot->pair_stage,
                                      b->world_size, NULL, NULL, NULL, 0, stream_of(b)),
               fn, "the sum kernel");
  }
fail:
  return status;
}

static epx_ll_phase_t ll_pending(epx_handle_t h) {
  return (epx_ll_phase_t)state_of(h->buffer)->slots.pending[index_of(h)];
}

/* The slabs' receiving side; nothing with a window (its sends did all). */
static epx_status_t ll_complete(epx_buffer_t b, epx_handle_t h) {
  ranks_t *s = state_of(b);
  slot_t *slot = slot_of(h);
  const int index = index_of(h);
  epx_status_t status = s->window                                    ? EPX_SUCCESS
                        : s->slots.pending[index] == EPX_LL_DISPATCH ? place_rows(b, slot)
                                                                     : sum_home(b, h, slot);
  if (status == EPX_SUCCESS) s->slots.pending[index] = EPX_LL_NONE;
  return status;
}

static const epx_ll_backend_t ll_ops = {
    .dispatch_send = ll_dispatch_send,
    .combine_send = ll_combine_send,
    .pending = ll_pending,
    .complete = ll_complete,
};

/* ------------------------------------------------------------------------ */
/* Handle queries                                                            */
/* ------------------------------------------------------------------------ */

static epx_status_t ll_recv_rows_device(epx_handle_t h, const int64_t **rows) {
  *rows = state_of(h->buffer)->slots.rows;
  return EPX_SUCCESS;
}

/* The slot's layout as the shared queries read it. */
static epx_cuda_ll_view_t view_of(epx_handle_t h) {
  const epx_cuda_ll_recv_t *r = &slot_of(h)->recv;
  const int64_t routes = h->recv_rows * (rank_major(h->buffer) ? h->top_k : 1);
  return (epx_cuda_ll_view_t){r->counts, r->offsets, r->src_rank, r->src_token, r->row_expert, r->row_weight, routes};
}

static epx_status_t ll_expert_counts(epx_handle_t h, int64_t *counts, int64_t *offsets) {
  const epx_cuda_ll_view_t v = view_of(h);
  return epx_cuda_ll_expert_counts(&v, h, counts, offsets);
}

static epx_status_t ll_recv_routing(epx_handle_t h, int32_t *recv_expert, float *recv_w) {
  const epx_cuda_ll_view_t v = view_of(h);
  return epx_cuda_ll_recv_routing(&v, h, recv_expert, recv_w);
}

static epx_status_t ll_recv_source(epx_handle_t h, int32_t *src_rank, int32_t *src_token) {
  const epx_cuda_ll_view_t v = view_of(h);
  return epx_cuda_ll_recv_source(&v, h, src_rank, src_token);
}

/* The counts stay on the device (nothing reads them on the host). */
static epx_status_t ll_traffic(epx_handle_t h, int64_t *same_node_rows, int64_t *other_node_rows) {
  (void)h, (void)same_node_rows, (void)other_node_rows;
  return epx_error(EPX_ERROR_UNSUPPORTED, "epx_handle_traffic: the handle is a low-latency CUDA buffer's, whose "
                   "counts stay on the device; this version counts link classes on CPU buffers and normal CUDA "
                   "buffers over several ranks only");
}

static void ll_peer_paths(epx_buffer_t b, int32_t *paths) {
  const ranks_t *s = state_of(b);
  if (s->window) epx_cuda_ll_window_paths(s->window, b->world_size, paths);
}

/* No layout, payload or backward entry: the API refuses every normal call
 * on a low-latency buffer (epx_ll_refuse) before it reaches a backend. */
const ep_path_t epx_cuda_ep_ll_path = {
    .name = "low-latency",
    .supports = ll_supports,
    .setup = ll_setup,
    .buffer_fini = ll_buffer_fini,
    .ll = &ll_ops,
    .handle_fini = ll_handle_fini,
    .recv_rows_device = ll_recv_rows_device,
    .expert_counts = ll_expert_counts,
    .recv_routing = ll_recv_routing,
    .recv_source = ll_recv_source,
    .peer_paths = ll_peer_paths,
    .stats = epx_cuda_ll_stats,
    .traffic = ll_traffic,
};

#endif
