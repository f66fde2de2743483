/* The low-latency decode mode's host glue on one GPU (ll.h): the buffer's
 * table and the epx_ll_* calls. Every handle's layout lives in one of the
 * buffer's slots, allocated with the buffer (cudaMalloc, once), so that the
 * calls allocate nothing and never wait for the device: a dispatch takes a
 * free slot (EPX_ERROR_BUSY when every slot holds a live handle), its
 * release gives it back. All work is enqueued on the buffer's stream, in
 * order, so a slot reused after a release is written after the work that
 * read it. On one GPU nothing is in flight between ranks: a send enqueues
 * the whole exchange and returns, and completion enqueues nothing. */
#include <stdint.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "core/align.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/ll.h"
#include "core/objects.h"
#include "cuda/backend.h"
#include "cuda/common/buffer.h"
#include "cuda/common/check.h"
#include "cuda/launch.h"
#include "cuda/ll/ll.h"

typedef struct {
  epx_cuda_ll_layout_t layout;
  float *w; /* [max_tokens, K] copy of the routing's weights (combine reads it) */
} ll_slot_t;

/* buffer->backend_state */
typedef struct {
  epx_cuda_ll_slots_t slots; /* N = E * max_tokens */
  ll_slot_t slot[EPX_CUDA_LL_SLOTS];
} ll_buffer_t;

/* Bytes of one slot, and its arrays carved from `at` when not NULL. */
static size_t slot_carve(const epx_buffer_t b, char *at, ll_slot_t *s) {
  const size_t E = (size_t)b->experts_per_rank, TK = (size_t)b->max_tokens * (size_t)b->config.max_top_k;
  const size_t N = E * (size_t)b->max_tokens;
  const size_t sizes[] = {TK * 4, TK * 4, E * 8, (E + 1) * 8, N * 4, N * 4, N * 4};
  void **const fields[] = {(void **)&s->layout.route_row, (void **)&s->w, (void **)&s->layout.counts,
                           (void **)&s->layout.offsets, (void **)&s->layout.src_token,
                           (void **)&s->layout.row_expert, (void **)&s->layout.row_weight};
  return epx_cuda_ll_carve(at, sizes, fields, sizeof sizes / sizeof sizes[0]);
}

static epx_status_t ll_buffer_init(epx_buffer_t b) {
  const char *fn = "epx_buffer_create";
  if (b->config.layout != EPX_LAYOUT_EXPERT_MAJOR)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: config.low_latency = 1 on a CUDA buffer over one rank is served with "
                     "EPX_LAYOUT_EXPERT_MAJOR in this version (rank-major runs over several ranks, and on CPU "
                     "buffers); use EPX_LAYOUT_EXPERT_MAJOR", fn);
  ll_buffer_t *s = calloc(1, sizeof *s);
  if (!s) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  ll_slot_t probe;
  const size_t slot_bytes = slot_carve(b, NULL, &probe);
  epx_status_t status = epx_cuda_ll_slots_alloc(&s->slots, slot_bytes, (int64_t)b->experts_per_rank * b->max_tokens,
                                                fn, "cudaMalloc (the low-latency handles' layouts)");
  if (status != EPX_SUCCESS) {
    free(s);
    return status;
  }
  for (int i = 0; i < EPX_CUDA_LL_SLOTS; i++) slot_carve(b, (char *)s->slots.block + (size_t)i * slot_bytes, &s->slot[i]);
  b->backend_state = s;
  return EPX_SUCCESS;
}

/* Waits for the stream first: enqueued work may still use the slots. */
static void ll_buffer_fini(epx_buffer_t b) {
  ll_buffer_t *s = b->backend_state;
  if (!s) return;
  cudaStreamSynchronize(stream_of(b));
  cudaFree(s->slots.block);
  free(s);
  b->backend_state = NULL;
}

/* The index of a handle's slot. */
static int slot_index(epx_handle_t h) {
  return (int)((const ll_slot_t *)h->backend_state - ((const ll_buffer_t *)h->buffer->backend_state)->slot);
}

static void ll_handle_fini(epx_handle_t h) {
  if (h->backend_state) epx_cuda_ll_slot_release(&((ll_buffer_t *)h->buffer->backend_state)->slots, slot_index(h));
  h->backend_state = NULL;
}

/* ------------------------------------------------------------------------ */
/* The epx_ll_* calls                                                        */
/* ------------------------------------------------------------------------ */

static epx_status_t ll_dispatch_send(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t h,
                                     const epx_ll_rows_t *rows, int32_t *recv_count, const int32_t *num_tokens) {
  const char *fn = rows->fp8 ? "epx_ll_dispatch_fp8" : "epx_ll_dispatch";
  epx_status_t status = local;
  if (status != EPX_SUCCESS) return status;
  ll_buffer_t *s = b->backend_state;
  int index = 0;
  EPX_CHECK(epx_cuda_ll_slot_take(&s->slots, fn, &index));
  ll_slot_t *slot = &s->slot[index];
  const epx_buffer_config_t *c = &b->config;
  const int64_t TK = r->num_tokens * r->top_k;
  const float *w = r->weighting == EPX_WEIGHTS_IN_COMBINE ? r->topk_w : NULL;
  if (w && TK)
    CUDA_CHECK(cudaMemcpyAsync(slot->w, w, sizeof(float) * (size_t)TK, cudaMemcpyDeviceToDevice, stream_of(b)), fn,
               "cudaMemcpyAsync (the routing weights)");
  CUDA_CHECK(epx_cuda_ll_layout_launch(r->topk_idx, r->topk_w, num_tokens, r->num_tokens, r->top_k,
                                       b->experts_per_rank, b->max_tokens, &slot->layout, recv_count, stream_of(b)),
             fn, "the low-latency layout kernel");
  /* fp8: the normal one-GPU fp8 dispatch's kernel, quantizing x once per
   * token when no x_scales come with it */
  if (r->num_tokens && rows->fp8)
    CUDA_CHECK(epx_cuda_fp8_scatter_launch(c->fp8_format, c->dtype, !rows->x_scales, rows->x, rows->x_scales,
                                           rows->recv_x, rows->recv_scales, r->num_tokens, c->hidden,
                                           slot->layout.route_row, r->top_k, NULL, NULL, 0, stream_of(b)),
               fn, "the fp8 dispatch kernel");
  else if (r->num_tokens)
    CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, rows->x, rows->recv_x, r->num_tokens, c->hidden, slot->layout.route_row,
                                       r->top_k, NULL, NULL, NULL, NULL, NULL, 0, 0, stream_of(b)),
               fn, "the dispatch kernel");
  epx_cuda_ll_slot_hold(&s->slots, index, h);
  h->backend_state = slot;
  return EPX_SUCCESS;
fail:
  return status;
}

static epx_status_t ll_combine_send(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *expert_out,
                                    void *out) {
  const char *fn = "epx_ll_combine";
  epx_status_t status = local;
  if (status != EPX_SUCCESS) return status;
  ll_buffer_t *s = b->backend_state;
  const ll_slot_t *slot = h->backend_state;
  const epx_buffer_config_t *c = &b->config;
  if (h->num_tokens)
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, expert_out, out, h->num_tokens, c->hidden, slot->layout.route_row,
                                      h->top_k, h->weighting == EPX_WEIGHTS_IN_COMBINE ? slot->w : NULL, NULL,
                                      NULL, 0, stream_of(b)),
               fn, "the combine kernel");
  s->slots.pending[slot_index(h)] = EPX_LL_COMBINE;
  return EPX_SUCCESS;
fail:
  return status;
}

static epx_ll_phase_t ll_pending(epx_handle_t h) {
  return (epx_ll_phase_t)((const ll_buffer_t *)h->buffer->backend_state)->slots.pending[slot_index(h)];
}

static epx_status_t ll_complete(epx_buffer_t b, epx_handle_t h) {
  ((ll_buffer_t *)b->backend_state)->slots.pending[slot_index(h)] = EPX_LL_NONE;
  return EPX_SUCCESS;
}

const epx_ll_backend_t epx_cuda_ll_ops = {
    .dispatch_send = ll_dispatch_send,
    .combine_send = ll_combine_send,
    .pending = ll_pending,
    .complete = ll_complete,
};

/* ------------------------------------------------------------------------ */
/* The buffer's table: handle queries; every normal call is refused by the  */
/* API before it reaches a backend (epx_ll_refuse), so those entries only   */
/* return the refusal they are given, on this rank (no peers to agree with). */
/* ------------------------------------------------------------------------ */

static epx_status_t ll_agree(epx_buffer_t b, epx_status_t local, const char *caller) {
  (void)b, (void)caller;
  return local;
}

static epx_status_t ll_routing_hash(epx_buffer_t b, const epx_routing_t *r, uint64_t *hash) {
  (void)b, (void)r;
  *hash = 0;
  return EPX_SUCCESS;
}

static epx_status_t ll_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t h) {
  (void)b, (void)r, (void)h;
  return local;
}

static epx_status_t ll_rows(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *in, void *out) {
  (void)b, (void)h, (void)in, (void)out;
  return local;
}

static epx_status_t ll_dispatch_backward(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *in,
                                         void *out, const void *x, float *grad_w) {
  (void)b, (void)h, (void)in, (void)out, (void)x, (void)grad_w;
  return local;
}

static epx_status_t ll_combine_backward(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *in,
                                        const void *expert_out, void *out, float *grad_w) {
  (void)b, (void)h, (void)in, (void)expert_out, (void)out, (void)grad_w;
  return local;
}

static epx_status_t ll_weights(epx_buffer_t b, epx_handle_t h, epx_status_t local, const float *in, float *out) {
  (void)b, (void)h, (void)in, (void)out;
  return local;
}

static epx_status_t ll_recv_rows(epx_handle_t h, int64_t *rows) {
  *rows = h->recv_rows;
  return EPX_SUCCESS;
}

static epx_status_t ll_recv_rows_device(epx_handle_t h, const int64_t **rows) {
  *rows = ((const ll_buffer_t *)h->buffer->backend_state)->slots.rows;
  return EPX_SUCCESS;
}

/* The slot's layout as the shared queries read it (every row is this rank's). */
static epx_cuda_ll_view_t view_of(epx_handle_t h) {
  const epx_cuda_ll_layout_t *l = &((const ll_slot_t *)h->backend_state)->layout;
  return (epx_cuda_ll_view_t){l->counts, l->offsets, NULL, l->src_token, l->row_expert, l->row_weight, h->recv_rows};
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

static int64_t ll_handle_bytes(epx_handle_t h) {
  (void)h;
  return 0;
}

const epx_backend_t epx_cuda_ll_backend = {
    .name = "cuda",
    .ll = &epx_cuda_ll_ops,
    .route = epx_cuda_route,
    .route_backward = epx_cuda_route_backward,
    .buffer_init = ll_buffer_init,
    .buffer_fini = ll_buffer_fini,
    .set_stream = epx_cuda_set_stream,
    .validate_routing = NULL,
    .routing_hash = ll_routing_hash,
    .agree = ll_agree,
    .dispatch_layout = ll_layout,
    .handle_fini = ll_handle_fini,
    .dispatch = ll_rows,
    .dispatch_fp8 = NULL,
    .combine = ll_rows,
    .dispatch_backward = ll_dispatch_backward,
    .combine_backward = ll_combine_backward,
    .weights_backward = ll_weights,
    .recv_rows = ll_recv_rows,
    .recv_rows_device = ll_recv_rows_device,
    .expert_counts = ll_expert_counts,
    .recv_routing = ll_recv_routing,
    .recv_source = ll_recv_source,
    .stats = epx_cuda_ll_stats,
    .handle_bytes = ll_handle_bytes,
    .peer_paths = NULL,
};
