/* A CUDA buffer's placement, host side (place.h). */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/backend.h"
#include "core/error.h"
#include "core/placement.h"
#include "cuda/common/buffer.h"
#include "cuda/common/check.h"
#include "cuda/place/place.h"

epx_status_t epx_cuda_place_init(epx_buffer_t b) {
  const char *fn = "epx_buffer_create";
  epx_status_t status = EPX_SUCCESS;
  const epx_placement_table_t *t = b->placement;
  const int64_t words = epx_placement_device_words(t);
  cudaStream_t stream = stream_of(b);
  int32_t *host = malloc(sizeof(int32_t) * (size_t)words);
  epx_cuda_place_t *s = calloc(1, sizeof *s);
  if (!host || !s) {
    free(host);
    free(s);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory (the placement's table)", fn);
  }
  b->place_state = s;
  s->identity = t->contiguous;
  s->identity_out = t->contiguous || b->world_size == 1;
  epx_placement_pack_device(t, host);
  CUDA_CHECK(cudaMalloc((void **)&s->table, sizeof(int32_t) * (size_t)words), fn, "cudaMalloc of the placement");
  CUDA_CHECK(cudaMalloc((void **)&s->load, sizeof *s->load * (size_t)t->num_logical), fn,
             "cudaMalloc of the load counts");
  CUDA_CHECK(cudaMallocHost((void **)&s->load_host, sizeof(int64_t) * (size_t)t->num_logical), fn, "cudaMallocHost");
  CUDA_CHECK(cudaMemcpyAsync(s->table, host, sizeof(int32_t) * (size_t)words, cudaMemcpyHostToDevice, stream), fn,
             "cudaMemcpyAsync of the placement");
  CUDA_CHECK(cudaMemsetAsync(s->load, 0, sizeof *s->load * (size_t)t->num_logical, stream), fn, "cudaMemsetAsync");
  /* a copy from pageable memory has read `host` when it returns */
fail:
  free(host);
  if (status != EPX_SUCCESS) epx_cuda_place_fini(b);
  return status;
}

void epx_cuda_place_fini(epx_buffer_t b) {
  epx_cuda_place_t *s = b->place_state;
  if (!s) return;
  /* the stream's work may still read them: freed in stream order */
  cudaStream_t stream = stream_of(b);
  if (s->table) cudaFreeAsync(s->table, stream);
  if (s->load) cudaFreeAsync(s->load, stream);
  if (s->ranked) cudaFreeAsync(s->ranked, stream);
  if (s->ranked_before) cudaFreeAsync(s->ranked_before, stream);
  if (s->load_host) cudaFreeHost(s->load_host);
  free(s);
  b->place_state = NULL;
}

int32_t epx_cuda_place_routing_ids(epx_buffer_t b) { return epx_placement_routing_ids(b->placement); }

/* The rank-ordered routing's scratch, grown to `routes` (at least the
 * buffer's largest batch) outside a capture. */
static epx_status_t ranked_scratch(epx_buffer_t b, epx_cuda_place_t *s, int64_t routes, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = stream_of(b);
  if (routes <= s->ranked_routes) return EPX_SUCCESS;
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture), fn, "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the placement's routing scratch must grow (%lld routes) while the stream is captured "
                     "into a CUDA graph; run one step of at least this size eagerly before capturing", fn,
                     (long long)routes);
  const int64_t bound = b->max_tokens * b->config.max_top_k;
  const int64_t want = routes > bound ? routes : bound;
  /* Once max_tokens_per_rank is agreed the bound covers every batch, so the
   * scratch grows at most once after its first allocation. */
  if (s->ranked_before) CUDA_CHECK(cudaFreeAsync(s->ranked_before, stream), fn, "cudaFreeAsync");
  s->ranked_before = s->ranked;
  s->ranked = NULL;
  s->ranked_routes = 0;
  CUDA_CHECK(cudaMallocAsync((void **)&s->ranked, sizeof(int32_t) * (size_t)want, stream), fn,
             "cudaMallocAsync of the placement's routing");
  s->ranked_routes = want;
fail:
  return status;
}

epx_status_t epx_cuda_place_routing(epx_buffer_t b, const epx_routing_t *r, epx_routing_t *ranked, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  epx_cuda_place_t *s = b->place_state;
  const epx_placement_table_t *t = b->placement;
  const int64_t routes = r->num_tokens * r->top_k;
  *ranked = *r;
  if (routes <= 0 || !s) return EPX_SUCCESS; /* !s: a low-latency buffer, the contiguous map */
  if (!s->identity) {
    EPX_CHECK(ranked_scratch(b, s, routes, fn));
    ranked->topk_idx = s->ranked;
  }
  CUDA_CHECK((cudaError_t)epx_cuda_place_rank_launch(s->table, t->num_logical, t->num_physical,
                                                     t->rule == EPX_REPLICA_CALLER, b->rank, r->num_tokens,
                                                     r->top_k, r->topk_idx, s->identity ? NULL : s->ranked,
                                                     s->load, stream_of(b)),
             fn, "the placement's routing kernel");
fail:
  return status;
}

epx_status_t epx_cuda_place_recv_expert(epx_handle_t handle, int32_t *recv_expert, int32_t words) {
  const char *fn = "epx_handle_recv_routing";
  epx_status_t status = EPX_SUCCESS;
  epx_buffer_t b = handle->buffer;
  const epx_cuda_place_t *s = b->place_state;
  if (!recv_expert || !s || s->identity_out) return EPX_SUCCESS;
  const int64_t *rows = NULL;
  EPX_CHECK(b->backend->recv_rows_device(handle, &rows));
  const epx_placement_table_t *t = b->placement;
  const int32_t *rank_experts = s->table + (epx_placement_table_words(t) - t->num_physical);
  CUDA_CHECK((cudaError_t)epx_cuda_place_ids_launch(rank_experts, recv_expert, words, rows, handle->recv_rows,
                                                    stream_of(b)),
             fn, "the placement's id kernel");
fail:
  return status;
}

epx_status_t epx_cuda_place_expert_load(epx_buffer_t b, int64_t *load, int32_t reset,
                                        epx_cuda_place_wait_fn wait) {
  const char *fn = "epx_buffer_expert_load";
  epx_status_t status = EPX_SUCCESS;
  const epx_cuda_place_t *s = b->place_state;
  if (!s)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: this low-latency CUDA buffer does not count its routes in this version; count them from "
                     "the routing, or use a buffer without config.low_latency", fn);
  const size_t bytes = sizeof *s->load * (size_t)b->placement->num_logical;
  cudaStream_t stream = stream_of(b);
  /* unsigned long long and int64_t have one size; counts stay below 2^63 */
  CUDA_CHECK(cudaMemcpyAsync(s->load_host, s->load, bytes, cudaMemcpyDeviceToHost, stream), fn,
             "cudaMemcpyAsync of the load counts");
  if (reset) CUDA_CHECK(cudaMemsetAsync(s->load, 0, bytes, stream), fn, "cudaMemsetAsync of the load counts");
  EPX_CHECK(wait(b, fn));
  memcpy(load, s->load_host, bytes);
fail:
  return status;
}
