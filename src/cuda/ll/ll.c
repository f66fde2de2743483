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

/* Live handles per buffer: two micro-batches, each with a step in flight
 * and the next one dispatched (DeepEP keeps two buffers per rank). */
#define LL_SLOTS 4

typedef struct {
  epx_cuda_ll_layout_t layout;
  float *w;          /* [max_tokens, K] copy of the routing's weights (combine reads it) */
  int32_t in_use;
  int32_t pending;   /* epx_ll_phase_t */
} ll_slot_t;

/* buffer->backend_state */
typedef struct {
  void *block;       /* one device allocation: every slot's arrays and `rows` */
  int64_t *rows;     /* device copy of N (epx_handle_recv_rows_device) */
  int64_t N;         /* E * max_tokens */
  ll_slot_t slots[LL_SLOTS];
} ll_buffer_t;

/* Bytes of one slot, and its arrays carved from `at` when not NULL. */
static size_t slot_carve(const epx_buffer_t b, char *at, ll_slot_t *s) {
  const size_t E = (size_t)b->experts_per_rank, TK = (size_t)b->max_tokens * (size_t)b->config.max_top_k;
  const size_t N = E * (size_t)b->max_tokens;
  const size_t sizes[] = {TK * 4, TK * 4, E * 8, (E + 1) * 8, N * 4, N * 4, N * 4};
  void **fields[] = {(void **)&s->layout.route_row, (void **)&s->w, (void **)&s->layout.counts,
                     (void **)&s->layout.offsets, (void **)&s->layout.src_token,
                     (void **)&s->layout.row_expert, (void **)&s->layout.row_weight};
  size_t used = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    if (at) *fields[i] = at + used;
    used += epx_round256(sizes[i]);
  }
  return used;
}

static epx_status_t ll_buffer_init(epx_buffer_t b) {
  const char *fn = "epx_buffer_create";
  epx_status_t status = EPX_SUCCESS;
  if (b->config.layout != EPX_LAYOUT_EXPERT_MAJOR)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: config.low_latency = 1 on a CUDA buffer over one rank is served with "
                     "EPX_LAYOUT_EXPERT_MAJOR in this version (rank-major runs over several ranks, and on CPU "
                     "buffers); use EPX_LAYOUT_EXPERT_MAJOR", fn);
  ll_buffer_t *s = calloc(1, sizeof *s);
  if (!s) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  ll_slot_t probe;
  const size_t slot_bytes = slot_carve(b, NULL, &probe);
  s->N = (int64_t)b->experts_per_rank * b->max_tokens;
  CUDA_CHECK(cudaMalloc(&s->block, slot_bytes * LL_SLOTS + 256), fn,
             "cudaMalloc (the low-latency handles' layouts)");
  for (int i = 0; i < LL_SLOTS; i++) slot_carve(b, (char *)s->block + (size_t)i * slot_bytes, &s->slots[i]);
  s->rows = (int64_t *)((char *)s->block + slot_bytes * LL_SLOTS);
  CUDA_CHECK(cudaMemcpy(s->rows, &s->N, sizeof s->N, cudaMemcpyHostToDevice), fn, "cudaMemcpy");
  b->backend_state = s;
  return EPX_SUCCESS;
fail:
  if (s->block) cudaFree(s->block);
  free(s);
  return status;
}

/* Waits for the stream first: enqueued work may still use the slots. */
static void ll_buffer_fini(epx_buffer_t b) {
  ll_buffer_t *s = b->backend_state;
  if (!s) return;
  cudaStreamSynchronize(stream_of(b));
  cudaFree(s->block);
  free(s);
  b->backend_state = NULL;
}

static void ll_handle_fini(epx_handle_t h) {
  ll_slot_t *slot = h->backend_state;
  if (slot) slot->in_use = 0, slot->pending = EPX_LL_NONE;
  h->backend_state = NULL;
}

/* ------------------------------------------------------------------------ */
/* The epx_ll_* calls                                                        */
/* ------------------------------------------------------------------------ */

static ll_slot_t *free_slot(ll_buffer_t *s) {
  for (int i = 0; i < LL_SLOTS; i++)
    if (!s->slots[i].in_use) return &s->slots[i];
  return NULL;
}

static epx_status_t ll_dispatch_send(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t h,
                                     const epx_ll_rows_t *rows, int32_t *recv_count, const int32_t *num_tokens) {
  const char *fn = rows->fp8 ? "epx_ll_dispatch_fp8" : "epx_ll_dispatch";
  epx_status_t status = local;
  if (status != EPX_SUCCESS) return status;
  ll_buffer_t *s = b->backend_state;
  ll_slot_t *slot = free_slot(s);
  if (!slot)
    return epx_error(EPX_ERROR_BUSY, "%s: the buffer's %d low-latency handles are all live; release one "
                     "(epx_handle_release) before the next step", fn, LL_SLOTS);
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
  slot->in_use = 1;
  slot->pending = EPX_LL_DISPATCH;
  h->backend_state = slot;
  h->recv_rows = s->N;
  return EPX_SUCCESS;
fail:
  return status;
}

static epx_status_t ll_combine_send(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *expert_out,
                                    void *out) {
  const char *fn = "epx_ll_combine";
  epx_status_t status = local;
  if (status != EPX_SUCCESS) return status;
  ll_slot_t *slot = h->backend_state;
  const epx_buffer_config_t *c = &b->config;
  if (h->num_tokens)
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, expert_out, out, h->num_tokens, c->hidden, slot->layout.route_row,
                                      h->top_k, h->weighting == EPX_WEIGHTS_IN_COMBINE ? slot->w : NULL, NULL,
                                      NULL, 0, stream_of(b)),
               fn, "the combine kernel");
  slot->pending = EPX_LL_COMBINE;
  return EPX_SUCCESS;
fail:
  return status;
}

static epx_ll_phase_t ll_pending(epx_handle_t h) { return (epx_ll_phase_t)((ll_slot_t *)h->backend_state)->pending; }

static epx_status_t ll_complete(epx_buffer_t b, epx_handle_t h) {
  (void)b;
  ((ll_slot_t *)h->backend_state)->pending = EPX_LL_NONE;
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
/* return the refusal they are given (ll.h: the W-rank table's too).         */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cuda_ll_agree(epx_buffer_t b, epx_status_t local, const char *caller) {
  (void)b, (void)caller;
  return local;
}

epx_status_t epx_cuda_ll_routing_hash(epx_buffer_t b, const epx_routing_t *r, uint64_t *hash) {
  (void)b, (void)r;
  *hash = 0;
  return EPX_SUCCESS;
}

epx_status_t epx_cuda_ll_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t h) {
  (void)b, (void)r, (void)h;
  return local;
}

epx_status_t epx_cuda_ll_rows(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *in, void *out) {
  (void)b, (void)h, (void)in, (void)out;
  return local;
}

epx_status_t epx_cuda_ll_dispatch_backward(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *in,
                                           void *out, const void *x, float *grad_w) {
  (void)b, (void)h, (void)in, (void)out, (void)x, (void)grad_w;
  return local;
}

epx_status_t epx_cuda_ll_combine_backward(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *in,
                                          const void *expert_out, void *out, float *grad_w) {
  (void)b, (void)h, (void)in, (void)expert_out, (void)out, (void)grad_w;
  return local;
}

epx_status_t epx_cuda_ll_weights(epx_buffer_t b, epx_handle_t h, epx_status_t local, const float *in, float *out) {
  (void)b, (void)h, (void)in, (void)out;
  return local;
}

static epx_status_t ll_recv_rows(epx_handle_t h, int64_t *rows) {
  *rows = h->recv_rows;
  return EPX_SUCCESS;
}

static epx_status_t ll_recv_rows_device(epx_handle_t h, const int64_t **rows) {
  *rows = ((const ll_buffer_t *)h->buffer->backend_state)->rows;
  return EPX_SUCCESS;
}

static epx_status_t ll_expert_counts(epx_handle_t h, int64_t *counts, int64_t *offsets) {
  const ll_slot_t *slot = h->backend_state;
  return epx_cuda_copy_expert_counts(slot->layout.counts, slot->layout.offsets, h->buffer->experts_per_rank, counts,
                                     offsets, h->buffer->config.stream);
}

static epx_status_t ll_copy(void *dst, const void *src, size_t bytes, epx_handle_t h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  if (dst) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(h->buffer)), fn,
                      "cudaMemcpyAsync");
fail:
  return status;
}

static epx_status_t ll_recv_routing(epx_handle_t h, int32_t *recv_expert, float *recv_w) {
  const char *fn = "epx_handle_recv_routing";
  const ll_slot_t *slot = h->backend_state;
  const size_t n = (size_t)h->recv_rows;
  epx_status_t status = ll_copy(recv_expert, slot->layout.row_expert, n * sizeof(int32_t), h, fn);
  return status != EPX_SUCCESS ? status : ll_copy(recv_w, slot->layout.row_weight, n * sizeof(float), h, fn);
}

static epx_status_t ll_recv_source(epx_handle_t h, int32_t *src_rank, int32_t *src_token) {
  const char *fn = "epx_handle_recv_source";
  const ll_slot_t *slot = h->backend_state;
  epx_status_t status = ll_copy(src_token, slot->layout.src_token, (size_t)h->recv_rows * sizeof(int32_t), h, fn);
  if (status == EPX_SUCCESS && src_rank)
    CUDA_CHECK(epx_cuda_ll_source_launch(slot->layout.src_token, h->recv_rows, src_rank, stream_of(h->buffer)), fn,
               "the source kernel");
fail:
  return status;
}

static epx_status_t ll_stats(epx_handle_t h, epx_handle_stats_t *stats) {
  *stats = (epx_handle_stats_t){0, 0, 0, 0, h->recv_rows};
  return EPX_SUCCESS;
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
    .routing_hash = epx_cuda_ll_routing_hash,
    .agree = epx_cuda_ll_agree,
    .dispatch_layout = epx_cuda_ll_layout,
    .handle_fini = ll_handle_fini,
    .dispatch = epx_cuda_ll_rows,
    .dispatch_fp8 = NULL,
    .combine = epx_cuda_ll_rows,
    .dispatch_backward = epx_cuda_ll_dispatch_backward,
    .combine_backward = epx_cuda_ll_combine_backward,
    .weights_backward = epx_cuda_ll_weights,
    .recv_rows = ll_recv_rows,
    .recv_rows_device = ll_recv_rows_device,
    .expert_counts = ll_expert_counts,
    .recv_routing = ll_recv_routing,
    .recv_source = ll_recv_source,
    .stats = ll_stats,
    .handle_bytes = ll_handle_bytes,
    .peer_paths = NULL,
};
