/* What the low-latency code of one GPU (ll.c) and of W ranks (ranks.c)
 * share (ll.h, "Slots"): the buffer's slots in one device block, taken by a
 * dispatch and given back by its handle's release, and the handle queries
 * over a slot's fixed layout. */
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "core/align.h"
#include "core/error.h"
#include "core/ll.h"
#include "core/objects.h"
#include "cuda/backend.h"
#include "cuda/common/buffer.h"
#include "cuda/common/check.h"
#include "cuda/ll/ll.h"

size_t epx_cuda_ll_carve(char *at, const size_t *sizes, void **const *fields, size_t n) {
  size_t used = 0;
  for (size_t i = 0; i < n; i++) {
    if (at) *fields[i] = at + used;
    used += epx_round256(sizes[i]);
  }
  return used;
}

epx_status_t epx_cuda_ll_slots_alloc(epx_cuda_ll_slots_t *s, size_t slot_bytes, int64_t N, const char *fn,
                                     const char *what) {
  epx_status_t status = EPX_SUCCESS;
  s->N = N;
  CUDA_CHECK(cudaMalloc(&s->block, slot_bytes * EPX_CUDA_LL_SLOTS + 256), fn, what);
  s->rows = (int64_t *)((char *)s->block + slot_bytes * EPX_CUDA_LL_SLOTS);
  CUDA_CHECK(cudaMemcpy(s->rows, &s->N, sizeof s->N, cudaMemcpyHostToDevice), fn, "cudaMemcpy");
  return EPX_SUCCESS;
fail:
  if (s->block) cudaFree(s->block);
  s->block = NULL;
  return status;
}

epx_status_t epx_cuda_ll_slot_take(epx_cuda_ll_slots_t *s, const char *fn, int *slot) {
  for (int i = 0; i < EPX_CUDA_LL_SLOTS; i++)
    if (!s->in_use[i]) {
      *slot = i;
      return EPX_SUCCESS;
    }
  return epx_error(EPX_ERROR_BUSY, "%s: the buffer's %d low-latency handles are all live; release one "
                   "(epx_handle_release) before the next step", fn, EPX_CUDA_LL_SLOTS);
}

void epx_cuda_ll_slot_hold(epx_cuda_ll_slots_t *s, int slot, epx_handle_t h) {
  s->in_use[slot] = 1;
  s->pending[slot] = EPX_LL_DISPATCH;
  h->recv_rows = s->N;
}

void epx_cuda_ll_slot_release(epx_cuda_ll_slots_t *s, int slot) {
  s->in_use[slot] = 0;
  s->pending[slot] = EPX_LL_NONE;
}

/* ------------------------------------------------------------------------ */
/* Handle queries                                                            */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cuda_ll_expert_counts(const epx_cuda_ll_view_t *v, epx_handle_t h, int64_t *counts,
                                       int64_t *offsets) {
  return epx_cuda_copy_expert_counts(v->counts, v->offsets, h->buffer->experts_per_rank, counts, offsets,
                                     h->buffer->config.stream);
}

/* dst = src (bytes, device to device) on the buffer's stream; dst NULL: nothing. */
static epx_status_t copy_out(void *dst, const void *src, size_t bytes, epx_handle_t h, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  if (dst)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(h->buffer)), fn,
               "cudaMemcpyAsync");
fail:
  return status;
}

epx_status_t epx_cuda_ll_recv_routing(const epx_cuda_ll_view_t *v, epx_handle_t h, int32_t *recv_expert,
                                      float *recv_w) {
  const char *fn = "epx_handle_recv_routing";
  const size_t n = (size_t)v->routes;
  epx_status_t status = copy_out(recv_expert, v->row_expert, n * sizeof(int32_t), h, fn);
  return status != EPX_SUCCESS ? status : copy_out(recv_w, v->row_weight, n * sizeof(float), h, fn);
}

epx_status_t epx_cuda_ll_recv_source(const epx_cuda_ll_view_t *v, epx_handle_t h, int32_t *src_rank,
                                     int32_t *src_token) {
  const char *fn = "epx_handle_recv_source";
  epx_status_t status = EPX_SUCCESS;
  const size_t n = (size_t)h->recv_rows;
  if (v->src_rank) EPX_CHECK(copy_out(src_rank, v->src_rank, n * sizeof(int32_t), h, fn));
  else if (src_rank)
    CUDA_CHECK(epx_cuda_ll_source_launch(v->src_token, h->recv_rows, src_rank, stream_of(h->buffer)), fn,
               "the source kernel");
  EPX_CHECK(copy_out(src_token, v->src_token, n * sizeof(int32_t), h, fn));
fail:
  return status;
}

epx_status_t epx_cuda_ll_stats(epx_handle_t h, epx_handle_stats_t *stats) {
  *stats = (epx_handle_stats_t){0, 0, 0, 0, h->recv_rows};
  return EPX_SUCCESS;
}
