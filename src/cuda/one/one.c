/* The CUDA backend's host glue for a comm of one rank: per-buffer and
 * per-handle device state, allocation, the stream, and CUDA errors turned
 * into epx statuses. Kernels are behind the launchers of launch.h.
 *
 * Stream and synchronisation: everything is enqueued on
 * buffer->config.stream. The only host synchronisation is in
 * epx_cuda_dispatch_layout (to learn N and the validation verdict), and none
 * at all with worst_case_sizing: the handle then reports the bound as its
 * rows, the true N lives in device memory (epx_handle_recv_rows_device), and
 * invalid routes are dropped (treated as -1) instead of refused — the verdict
 * is reported by the next epx_handle_recv_rows, which synchronises.
 *
 * Memory: a handle's arrays are one stream-ordered allocation
 * (cudaMallocAsync) made by its layout and freed (cudaFreeAsync) when it is
 * released; the layout's scratch is the buffer's, grown on demand; dispatch,
 * combine and the backward passes allocate nothing, so they can be captured
 * in a CUDA graph. */
#include <stdint.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "core/align.h"
#include "core/error.h"
#include "core/placement.h"
#include "core/route_spec.h"
#include "cuda/backend.h"
#include "cuda/common/buffer.h"
#include "cuda/common/check.h"
#include "cuda/ep/ep.h"
#include "cuda/launch.h"
#include "cuda/place/place.h"

/* buffer->backend_state */
typedef struct cuda_buffer_state {
  void *scratch;          /* layout scratch (device), scratch_bytes long */
  size_t scratch_bytes;
  cudaStream_t scratch_stream; /* the stream of the last layout that used scratch */
  cudaEvent_t scratch_free;    /* recorded after that layout; waited on from another stream */
  epx_cuda_layout_result_t *readback; /* pinned host memory for one layout result */
} cuda_buffer_state_t;

/* handle->backend_state */
typedef struct cuda_handle_state {
  void *block;              /* one device allocation holding every array below */
  epx_cuda_layout_t layout; /* pointers into block */
  float *w;                 /* [T, K] copy of routing.topk_w, NULL when none was given */
  int64_t row_bound;        /* rows the layout can have: N, or the worst-case bound */
  int64_t rows;             /* N on the host; -1 until known (worst_case_sizing) */
} cuda_handle_state_t;

epx_status_t epx_cuda_buffer_init(epx_buffer_t buffer) {
  const char *fn = "epx_buffer_create";
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &buffer->config;
  if (buffer->placement->num_physical > EPX_CUDA_MAX_EXPERTS)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: config.num_experts is %d (%d physical experts); the CUDA backend takes at most %d "
                     "experts", fn, c->num_experts, buffer->placement->num_physical, EPX_CUDA_MAX_EXPERTS);
  if (c->max_top_k > EPX_CUDA_MAX_TOP_K)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: config.max_top_k is %d; the CUDA backend takes at most top-%d",
                     fn, c->max_top_k, EPX_CUDA_MAX_TOP_K);
  cuda_buffer_state_t *s = calloc(1, sizeof *s);
  if (!s) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  CUDA_CHECK(cudaEventCreateWithFlags(&s->scratch_free, cudaEventDisableTiming), fn, "cudaEventCreate");
  CUDA_CHECK(cudaMallocHost((void **)&s->readback, sizeof *s->readback), fn, "cudaMallocHost");
  buffer->backend_state = s;
  return EPX_SUCCESS;
fail:
  if (s->scratch_free) cudaEventDestroy(s->scratch_free);
  free(s);
  return status;
}

void epx_cuda_buffer_fini(epx_buffer_t buffer) {
  cuda_buffer_state_t *s = buffer->backend_state;
  if (!s) return;
  if (s->scratch) {
    cudaStreamWaitEvent(stream_of(buffer), s->scratch_free, 0);
    cudaFreeAsync(s->scratch, stream_of(buffer));
  }
  cudaEventDestroy(s->scratch_free);
  cudaFreeHost(s->readback);
  free(s);
  buffer->backend_state = NULL;
}

void epx_cuda_handle_fini(epx_handle_t handle) {
  cuda_handle_state_t *h = handle->backend_state;
  if (!h) return;
  if (h->block) cudaFreeAsync(h->block, stream_of(handle->buffer));
  free(h);
  handle->backend_state = NULL;
}

/* The message of the first invalid route; topk_idx and locations are the
 * caller's device arrays when still available (NULL: the value is not named). */
epx_status_t epx_cuda_routing_error(const char *fn, uint64_t error, int32_t K, int32_t E, int32_t C,
                                  const int32_t *topk_idx, const int32_t *locations,
                                  const char *note) {
  int64_t route = (int64_t)(error >> 3), t = route / K;
  int32_t k = (int32_t)(route % K), e = 0, l = 0;
  int known = topk_idx && cudaMemcpy(&e, topk_idx + route, sizeof e, cudaMemcpyDeviceToHost) == cudaSuccess;
  if (known && locations)
    known = cudaMemcpy(&l, locations + route, sizeof l, cudaMemcpyDeviceToHost) == cudaSuccess;
  switch ((int)(error & 7)) {
    case EPX_CUDA_BAD_EXPERT:
      if (known)
        return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                         "%s: routing.topk_idx[%lld][%d] is %d, outside [-1, num_experts = %d); use -1 "
                         "for no expert%s", fn, (long long)t, k, e, E, note);
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: routing.topk_idx[%lld][%d] is outside [-1, num_experts = %d); use -1 for "
                       "no expert%s", fn, (long long)t, k, E, note);
    case EPX_CUDA_DUPLICATE_EXPERT:
      if (known)
        return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                         "%s: routing.topk_idx[%lld] names expert %d twice; a token picks each expert "
                         "at most once%s", fn, (long long)t, e, note);
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: routing.topk_idx[%lld] names an expert twice (slot %d repeats an earlier "
                       "one); a token picks each expert at most once%s", fn, (long long)t, k, note);
    case EPX_CUDA_BAD_LOCATION:
      if (known)
        return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                         "%s: routing.locations[%lld][%d] is %d, outside the capacity [0, %d); drop the "
                         "route (topk_idx = -1) or raise config.capacity%s", fn, (long long)t, k, l, C,
                         note);
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: routing.locations[%lld][%d] is outside the capacity [0, %d); drop the route "
                       "(topk_idx = -1) or raise config.capacity%s", fn, (long long)t, k, C, note);
    default:
      if (known)
        return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                         "%s: routing.locations[%lld][%d] = %d is taken twice for expert %d; locations "
                         "must be unique per expert (use epx_route's)%s", fn, (long long)t, k, l, e, note);
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: routing.locations[%lld][%d] is taken twice for its expert; locations must "
                       "be unique per expert (use epx_route's)%s", fn, (long long)t, k, note);
  }
}

/* The buffer's layout scratch made ready on `stream` for T tokens.
 * The scratch may still be in use by the last layout, on another stream:
 * this stream is ordered after it (nothing to do on the same stream). Under
 * stream capture (a CUDA graph; *capturing set) nothing runs now and the
 * replays are ordered by the stream they are launched on, like all captured
 * work: an event recorded in the capture could not be waited on outside it
 * (cudaErrorInvalidValue at the next eager layout on another stream), so the
 * caller records no event and the wait is not made; scratch_stream stays the
 * last eager layout's. Growing the scratch in a capture would free memory
 * made outside it: refused (warm up at this size first). */
static epx_status_t layout_scratch(cuda_buffer_state_t *bs, cudaStream_t stream, int64_t T,
                                   int32_t E, int *capturing, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const size_t need = epx_cuda_layout_scratch_bytes(T, E);
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture), fn, "cudaStreamIsCapturing");
  *capturing = capture != cudaStreamCaptureStatusNone;
  if (*capturing && need > bs->scratch_bytes)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the layout scratch must grow (%zu bytes for %lld tokens) while the "
                     "stream is captured into a CUDA graph; run one step of at least this size "
                     "eagerly on the capture stream before capturing", fn, need, (long long)T);
  if (bs->scratch && bs->scratch_stream != stream && !*capturing)
    CUDA_CHECK(cudaStreamWaitEvent(stream, bs->scratch_free, 0), fn, "cudaStreamWaitEvent");
  if (need > bs->scratch_bytes) {
    if (bs->scratch) CUDA_CHECK(cudaFreeAsync(bs->scratch, stream), fn, "cudaFreeAsync");
    bs->scratch = NULL;
    bs->scratch_bytes = 0;
    CUDA_CHECK(cudaMallocAsync(&bs->scratch, need, stream), fn, "cudaMallocAsync of the layout scratch");
    bs->scratch_bytes = need;
  }
fail:
  return status;
}

epx_status_t epx_cuda_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                      epx_handle_t handle) {
  const char *fn = "epx_dispatch_layout";
  epx_status_t status = EPX_SUCCESS;
  cuda_buffer_state_t *bs = buffer->backend_state;
  const epx_buffer_config_t *c = &buffer->config;
  cudaStream_t stream = stream_of(buffer);
  const int64_t T = routing->num_tokens;
  const int32_t K = routing->top_k, E = buffer->experts_per_rank;
  const int64_t align = c->expert_alignment, C = c->capacity;
  const int worst = c->worst_case_sizing != 0;

  /* Rows this routing can have, and the bound every handle reports with
   * worst_case_sizing (epx_buffer_max_recv_rows). */
  const int64_t row_bound = epx_recv_rows_bound(c->layout, 1, T, K, E, (int32_t)align, (int32_t)C);
  const int64_t buffer_bound = epx_recv_rows_bound(c->layout, 1, buffer->max_tokens, c->max_top_k,
                                                   E, (int32_t)align, (int32_t)C);
  if (T * K >= INT32_MAX || buffer_bound >= INT32_MAX)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: %lld routes and up to %lld recv rows; the CUDA backend indexes routes and "
                     "rows with int32 (below 2^31); split the batch", fn, (long long)(T * K),
                     (long long)buffer_bound);

  cuda_handle_state_t *h = calloc(1, sizeof *h);
  if (!h) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);

  /* One block: result | idx [T*K] | route_row [T*K] | token_row [T] |
   * row_src [row_bound] | counts [E] | offsets [E+1] | w [T*K] */
  const size_t routes = (size_t)(T * K);
  size_t at[8], bytes = 0;
  const size_t sizes[8] = {sizeof(epx_cuda_layout_result_t), 4 * routes, 4 * routes,
                           c->layout == EPX_LAYOUT_RANK_MAJOR ? 4 * (size_t)T : 0,
                           4 * (size_t)row_bound, 8 * (size_t)E, 8 * ((size_t)E + 1),
                           routing->topk_w ? 4 * routes : 0};
  for (int i = 0; i < 8; i++) {
    at[i] = bytes;
    bytes += epx_round256(sizes[i]);
  }
  CUDA_CHECK(cudaMallocAsync(&h->block, bytes, stream), fn, "cudaMallocAsync of the handle's layout");
  char *base = h->block;
  h->layout.result = (epx_cuda_layout_result_t *)(base + at[0]);
  h->layout.idx = (int32_t *)(base + at[1]);
  h->layout.route_row = (int32_t *)(base + at[2]);
  h->layout.token_row = c->layout == EPX_LAYOUT_RANK_MAJOR ? (int32_t *)(base + at[3]) : NULL;
  h->layout.row_src = (int32_t *)(base + at[4]);
  h->layout.counts = (int64_t *)(base + at[5]);
  h->layout.offsets = (int64_t *)(base + at[6]);
  h->w = routing->topk_w ? (float *)(base + at[7]) : NULL;

  int capturing = 0;
  status = layout_scratch(bs, stream, T, E, &capturing, fn);
  if (status != EPX_SUCCESS) goto fail;
  /* the routing in physical ids (one rank: rank order is physical order) */
  epx_routing_t ranked;
  EPX_CHECK(epx_cuda_place_routing(buffer, routing, &ranked, fn));
  CUDA_CHECK(epx_cuda_layout_launch(ranked.topk_idx, routing->locations, routing->topk_w, h->w, T, K, E,
                                    c->layout, c->expert_alignment, c->capacity, &h->layout, bs->scratch,
                                    stream),
             fn, "the layout kernels");
  if (!capturing) {
    CUDA_CHECK(cudaEventRecord(bs->scratch_free, stream), fn, "cudaEventRecord");
    bs->scratch_stream = stream;
  }

  if (worst) {
    h->row_bound = row_bound;
    h->rows = -1;
    handle->recv_rows = buffer_bound;
  } else {
    CUDA_CHECK(cudaMemcpyAsync(bs->readback, h->layout.result, sizeof *bs->readback,
                               cudaMemcpyDeviceToHost, stream), fn, "cudaMemcpyAsync of the row count");
    CUDA_CHECK(cudaStreamSynchronize(stream), fn, "cudaStreamSynchronize");
    if (bs->readback->error != EPX_CUDA_NO_ERROR) {
      status = epx_cuda_routing_error(fn, bs->readback->error, K, epx_cuda_place_routing_ids(buffer), c->capacity,
                                      routing->topk_idx,
                             c->layout == EPX_LAYOUT_CAPACITY ? routing->locations : NULL, "");
      goto fail;
    }
    h->rows = h->row_bound = bs->readback->rows;
    handle->recv_rows = h->rows;
  }
  handle->backend_state = h;
  return EPX_SUCCESS;
fail:
  if (h->block) cudaFreeAsync(h->block, stream);
  free(h);
  return status;
}

/* Token rows [T, H] -> the layout's rows (dispatch, combine_backward):
 * rank-major moves each token once, to its token row; the other layouts
 * move it route by route, scaled by the routing weight when weighted, the
 * rows no route fills zeroed; grad_w [T, K] gets the dots with other. */
static cudaError_t scatter_rows(epx_buffer_t buffer, epx_handle_t handle, const void *src, void *dst, int weighted,
                                const void *other, float *grad_w) {
  const cuda_handle_state_t *h = handle->backend_state;
  const epx_buffer_config_t *c = &buffer->config;
  const epx_cuda_layout_t *l = &h->layout;
  if (c->layout == EPX_LAYOUT_RANK_MAJOR)
    return epx_cuda_scatter_launch(c->dtype, src, dst, handle->num_tokens, c->hidden, l->token_row, 1, NULL, NULL,
                                   NULL, NULL, &l->result->rows, 0, 0, stream_of(buffer));
  return epx_cuda_scatter_launch(c->dtype, src, dst, handle->num_tokens, c->hidden, l->route_row, handle->top_k,
                                 weighted ? h->w : NULL, weighted && grad_w ? other : NULL,
                                 weighted ? grad_w : NULL, l->row_src, &l->result->rows, h->row_bound, 0,
                                 stream_of(buffer));
}

/* The layout's rows -> token rows [T, H] (combine, dispatch_backward): each
 * token's rows summed, scaled by the routing weight when weighted; grad_w
 * [T, K] gets the dots with other. */
static cudaError_t gather_rows(epx_buffer_t buffer, epx_handle_t handle, const void *src, void *dst, int weighted,
                               const void *other, float *grad_w) {
  const cuda_handle_state_t *h = handle->backend_state;
  const epx_buffer_config_t *c = &buffer->config;
  const int rank_major = c->layout == EPX_LAYOUT_RANK_MAJOR;
  return epx_cuda_gather_launch(c->dtype, src, dst, handle->num_tokens, c->hidden,
                                rank_major ? h->layout.token_row : h->layout.route_row,
                                rank_major ? 1 : handle->top_k, weighted ? h->w : NULL,
                                weighted && grad_w ? other : NULL, weighted ? grad_w : NULL, 0, stream_of(buffer));
}

epx_status_t epx_cuda_dispatch(epx_buffer_t buffer, epx_handle_t handle, const void *x,
                               void *recv_x) {
  return epx_cuda_status(
      scatter_rows(buffer, handle, x, recv_x, handle->weighting == EPX_WEIGHTS_IN_DISPATCH, NULL, NULL),
      "epx_dispatch", "the dispatch kernel");
}

epx_status_t epx_cuda_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, const void *x,
                                   const void *x_scales, int quantize, void *recv_x_q, void *recv_scales) {
  const cuda_handle_state_t *h = handle->backend_state;
  const epx_buffer_config_t *c = &buffer->config;
  const epx_cuda_layout_t *l = &h->layout;
  const int rank_major = c->layout == EPX_LAYOUT_RANK_MAJOR;
  return epx_cuda_status(
      epx_cuda_fp8_scatter_launch(c->fp8_format, c->dtype, quantize, x, x_scales, recv_x_q, recv_scales,
                                  handle->num_tokens, c->hidden, rank_major ? l->token_row : l->route_row,
                                  rank_major ? 1 : handle->top_k, rank_major ? NULL : l->row_src,
                                  &l->result->rows, rank_major ? 0 : h->row_bound, stream_of(buffer)),
      quantize ? "epx_dispatch_quantize" : "epx_dispatch_fp8", "the fp8 dispatch kernel");
}

epx_status_t epx_cuda_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out,
                              void *out) {
  return epx_cuda_status(
      gather_rows(buffer, handle, expert_out, out, handle->weighting == EPX_WEIGHTS_IN_COMBINE, NULL, NULL),
      "epx_combine", "the combine kernel");
}

epx_status_t epx_cuda_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle,
                                        const void *grad_recv_x, void *grad_x, const void *x,
                                        float *grad_w) {
  return epx_cuda_status(gather_rows(buffer, handle, grad_recv_x, grad_x,
                                     handle->weighting == EPX_WEIGHTS_IN_DISPATCH, x, grad_w),
                         "epx_dispatch_backward", "the dispatch backward kernel");
}

epx_status_t epx_cuda_combine_backward(epx_buffer_t buffer, epx_handle_t handle,
                                       const void *grad_out, const void *expert_out,
                                       void *grad_expert_out, float *grad_w) {
  return epx_cuda_status(scatter_rows(buffer, handle, grad_out, grad_expert_out,
                                      handle->weighting == EPX_WEIGHTS_IN_COMBINE, expert_out, grad_w),
                         "epx_combine_backward", "the combine backward kernel");
}

epx_status_t epx_cuda_weights_backward(epx_buffer_t buffer, epx_handle_t handle,
                                       const float *grad_recv_w, float *grad_w) {
  const cuda_handle_state_t *h = handle->backend_state;
  return epx_cuda_status(epx_cuda_weights_back_launch(buffer->config.layout, &h->layout, handle->num_tokens,
                                                      handle->top_k, grad_recv_w, grad_w, stream_of(buffer)),
                         "epx_weights_backward", "the weights backward kernel");
}

epx_status_t epx_cuda_handle_recv_rows(epx_handle_t handle, int64_t *rows) {
  const char *fn = "epx_handle_recv_rows";
  epx_status_t status = EPX_SUCCESS;
  cuda_handle_state_t *h = handle->backend_state;
  epx_buffer_t buffer = handle->buffer;
  cuda_buffer_state_t *bs = buffer->backend_state;
  if (h->rows < 0) {
    cudaStream_t stream = stream_of(buffer);
    CUDA_CHECK(cudaMemcpyAsync(bs->readback, h->layout.result, sizeof *bs->readback,
                               cudaMemcpyDeviceToHost, stream), fn, "cudaMemcpyAsync of the row count");
    CUDA_CHECK(cudaStreamSynchronize(stream), fn, "cudaStreamSynchronize");
    if (bs->readback->error != EPX_CUDA_NO_ERROR)
      return epx_cuda_routing_error(fn, bs->readback->error, handle->top_k, epx_cuda_place_routing_ids(buffer),
                           buffer->config.capacity, NULL, NULL,
                           " (with worst_case_sizing epx_dispatch_layout does not wait for the "
                           "verdict: the invalid route was dropped, treated as -1)");
    h->rows = bs->readback->rows;
  }
  *rows = h->rows;
fail:
  return status;
}

epx_status_t epx_cuda_handle_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  const cuda_handle_state_t *h = handle->backend_state;
  *rows = &h->layout.result->rows;
  return EPX_SUCCESS;
}

epx_status_t epx_cuda_copy_expert_counts(const int64_t *device_counts, const int64_t *device_offsets,
                                         int64_t experts_local, int64_t *counts, int64_t *offsets,
                                         void *stream_handle) {
  const char *fn = "epx_handle_expert_counts";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = (cudaStream_t)stream_handle;
  const size_t E = (size_t)experts_local;
  if (counts)
    CUDA_CHECK(cudaMemcpyAsync(counts, device_counts, 8 * E, cudaMemcpyDeviceToDevice, stream), fn,
               "cudaMemcpyAsync of the counts");
  if (offsets)
    CUDA_CHECK(cudaMemcpyAsync(offsets, device_offsets, 8 * (E + 1), cudaMemcpyDeviceToDevice, stream),
               fn, "cudaMemcpyAsync of the offsets");
fail:
  return status;
}

epx_status_t epx_cuda_handle_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  const cuda_handle_state_t *h = handle->backend_state;
  return epx_cuda_copy_expert_counts(h->layout.counts, h->layout.offsets, handle->buffer->experts_per_rank,
                                     counts, offsets, handle->buffer->config.stream);
}

epx_status_t epx_cuda_handle_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  const char *fn = "epx_handle_recv_routing";
  epx_status_t status = EPX_SUCCESS;
  const cuda_handle_state_t *h = handle->backend_state;
  CUDA_CHECK(epx_cuda_recv_routing_launch(handle->buffer->config.layout, &h->layout, h->w, handle->top_k,
                                          h->row_bound, recv_expert, recv_w, stream_of(handle->buffer)),
             fn, "the recv routing kernel");
fail:
  return status;
}

epx_status_t epx_cuda_handle_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  const char *fn = "epx_handle_recv_source";
  epx_status_t status = EPX_SUCCESS;
  const cuda_handle_state_t *h = handle->backend_state;
  CUDA_CHECK(epx_cuda_recv_source_launch(handle->buffer->config.layout, &h->layout, handle->top_k,
                                         h->row_bound, src_rank, src_token, stream_of(handle->buffer)),
             fn, "the recv source kernel");
fail:
  return status;
}
