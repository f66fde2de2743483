/* The CUDA backend's table (core/backend.h) over the functions of
 * cuda_backend.c and route.c (routing). */
#include <cuda_runtime.h>

#include "core/backend.h"
#include "core/error.h"
#include "cuda/cuda_backend.h"
#include "cuda/ep.h"
#include "cuda/launch.h"

/* A comm of several ranks runs the W-rank backend of ep.c (NCCL); one rank
 * the one-GPU backend of cuda_backend.c, unless epx_cuda_ep_at_one_rank
 * asked for the W-rank one. Every rank has the same config (agreed before
 * this), so every rank refuses together. The choice is made at buffer
 * creation and kept. */
static _Atomic int g_ep_at_one_rank;

void epx_cuda_ep_at_one_rank(int on) { g_ep_at_one_rank = on != 0; }

static int ranks(epx_buffer_t buffer) { return buffer->cuda_ranks; }

static epx_status_t cuda_buffer_init(epx_buffer_t buffer) {
  buffer->cuda_ranks = buffer->world_size > 1 || g_ep_at_one_rank;
  return ranks(buffer) ? epx_cuda_ep_buffer_init(buffer) : epx_cuda_buffer_init(buffer);
}

static void cuda_buffer_fini(epx_buffer_t buffer) {
  if (ranks(buffer)) epx_cuda_ep_buffer_fini(buffer);
  else epx_cuda_buffer_fini(buffer);
}

/* The device routing's hash (one read-back: recorder validation only). */
static epx_status_t cuda_routing_hash(epx_buffer_t buffer, const epx_routing_t *routing, uint64_t *hash) {
  return epx_cuda_routing_hash(buffer, routing, hash);
}

/* One rank: the verdict is this rank's; several: ep.c agrees it (a payload
 * call with its handle and grad_w). */
static epx_status_t cuda_agree(epx_buffer_t buffer, epx_status_t local, const char *caller) {
  return ranks(buffer) ? epx_cuda_ep_agree(buffer, local, caller) : local;
}
static epx_status_t cuda_agree_call(epx_buffer_t buffer, epx_handle_t handle, const float *grad_w,
                                    epx_status_t local, const char *caller) {
  return ranks(buffer) ? epx_cuda_ep_agree_call(buffer, handle, grad_w != NULL, local, caller) : local;
}

/* Later work, frees of memory allocated on the old stream included, must run
 * after what was enqueued on it: the new stream waits for an event recorded
 * on the old one. */
static epx_status_t cuda_set_stream(epx_buffer_t buffer, void *stream) {
  const char *fn = "epx_buffer_set_stream";
  cudaStream_t old_stream = (cudaStream_t)buffer->config.stream, new_stream = (cudaStream_t)stream;
  if (old_stream == new_stream) return EPX_SUCCESS;
  cudaEvent_t done;
  cudaError_t err = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  if (err == cudaSuccess) {
    err = cudaEventRecord(done, old_stream);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(new_stream, done, 0);
    cudaEventDestroy(done);
  }
  if (err != cudaSuccess)
    return epx_error(EPX_ERROR_CUDA,
                     "%s: ordering the new stream after the old one failed with %s (%s); the "
                     "buffer keeps its old stream", fn, cudaGetErrorName(err), cudaGetErrorString(err));
  buffer->config.stream = stream;
  return EPX_SUCCESS;
}

static epx_status_t cuda_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                         epx_status_t local, epx_handle_t handle) {
  if (ranks(buffer)) return epx_cuda_ep_dispatch_layout(buffer, routing, local, handle);
  if (local != EPX_SUCCESS) return local;
  if (buffer->max_tokens == 0) epx_buffer_agree_max_tokens(buffer, routing->num_tokens);
  return epx_cuda_dispatch_layout(buffer, routing, handle);
}

static void cuda_handle_fini(epx_handle_t handle) {
  if (ranks(handle->buffer)) epx_cuda_ep_handle_fini(handle);
  else epx_cuda_handle_fini(handle);
}

static epx_status_t cuda_dispatch(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                  const void *x, void *recv_x) {
  local = cuda_agree_call(buffer, handle, NULL, local, "epx_dispatch");
  if (local != EPX_SUCCESS) return local;
  return ranks(buffer) ? epx_cuda_ep_dispatch(buffer, handle, x, recv_x) : epx_cuda_dispatch(buffer, handle, x, recv_x);
}

static epx_status_t cuda_combine(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                 const void *expert_out, void *out) {
  local = cuda_agree_call(buffer, handle, NULL, local, "epx_combine");
  if (local != EPX_SUCCESS) return local;
  return ranks(buffer) ? epx_cuda_ep_combine(buffer, handle, expert_out, out)
                       : epx_cuda_combine(buffer, handle, expert_out, out);
}

static epx_status_t cuda_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                           const void *grad_recv_x, void *grad_x, const void *x,
                                           float *grad_w) {
  local = cuda_agree_call(buffer, handle, grad_w, local, "epx_dispatch_backward");
  if (local != EPX_SUCCESS) return local;
  return ranks(buffer) ? epx_cuda_ep_dispatch_backward(buffer, handle, grad_recv_x, grad_x, x, grad_w)
                       : epx_cuda_dispatch_backward(buffer, handle, grad_recv_x, grad_x, x, grad_w);
}

static epx_status_t cuda_combine_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                          const void *grad_out, const void *expert_out,
                                          void *grad_expert_out, float *grad_w) {
  local = cuda_agree_call(buffer, handle, grad_w, local, "epx_combine_backward");
  if (local != EPX_SUCCESS) return local;
  return ranks(buffer) ? epx_cuda_ep_combine_backward(buffer, handle, grad_out, expert_out, grad_expert_out, grad_w)
                       : epx_cuda_combine_backward(buffer, handle, grad_out, expert_out, grad_expert_out, grad_w);
}

static epx_status_t cuda_weights_backward(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                                          const float *grad_recv_w, float *grad_w) {
  local = cuda_agree_call(buffer, handle, NULL, local, "epx_weights_backward");
  if (local != EPX_SUCCESS) return local;
  return ranks(buffer) ? epx_cuda_ep_weights_backward(buffer, handle, grad_recv_w, grad_w)
                       : epx_cuda_weights_backward(buffer, handle, grad_recv_w, grad_w);
}

static epx_status_t cuda_stats(epx_handle_t handle, epx_handle_stats_t *stats) {
  if (ranks(handle->buffer)) return epx_cuda_ep_stats(handle, stats);
  *stats = (epx_handle_stats_t){0, 0, 0, 0, handle->recv_rows};
  return EPX_SUCCESS;
}

static int64_t cuda_handle_bytes(epx_handle_t handle) {
  return ranks(handle->buffer) ? epx_cuda_ep_handle_bytes(handle) : 0;
}

#define CUDA_QUERY(ep_name, one_name, ...) \
  return ranks(handle->buffer) ? ep_name(handle, __VA_ARGS__) : one_name(handle, __VA_ARGS__)
static epx_status_t cuda_recv_rows(epx_handle_t handle, int64_t *rows) {
  CUDA_QUERY(epx_cuda_ep_recv_rows, epx_cuda_handle_recv_rows, rows);
}
static epx_status_t cuda_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  CUDA_QUERY(epx_cuda_ep_recv_rows_device, epx_cuda_handle_recv_rows_device, rows);
}
static epx_status_t cuda_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  CUDA_QUERY(epx_cuda_ep_expert_counts, epx_cuda_handle_expert_counts, counts, offsets);
}
static epx_status_t cuda_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  CUDA_QUERY(epx_cuda_ep_recv_routing, epx_cuda_handle_recv_routing, recv_expert, recv_w);
}
static epx_status_t cuda_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  CUDA_QUERY(epx_cuda_ep_recv_source, epx_cuda_handle_recv_source, src_rank, src_token);
}

static void cuda_peer_paths(epx_buffer_t buffer, int32_t *paths) {
  if (ranks(buffer)) epx_cuda_ep_peer_paths(buffer, paths); /* one rank: the API's host default */
}

const epx_backend_t epx_cuda_backend = {
    .name = "cuda",
    .route = epx_cuda_route,
    .route_backward = epx_cuda_route_backward,
    .buffer_init = cuda_buffer_init,
    .buffer_fini = cuda_buffer_fini,
    .set_stream = cuda_set_stream,
    .validate_routing = NULL,
    .routing_hash = cuda_routing_hash,
    .agree = cuda_agree,
    .dispatch_layout = cuda_dispatch_layout,
    .handle_fini = cuda_handle_fini,
    .dispatch = cuda_dispatch,
    .combine = cuda_combine,
    .dispatch_backward = cuda_dispatch_backward,
    .combine_backward = cuda_combine_backward,
    .weights_backward = cuda_weights_backward,
    .recv_rows = cuda_recv_rows,
    .recv_rows_device = cuda_recv_rows_device,
    .expert_counts = cuda_expert_counts,
    .recv_routing = cuda_recv_routing,
    .recv_source = cuda_recv_source,
    .stats = cuda_stats,
    .handle_bytes = cuda_handle_bytes,
    .peer_paths = cuda_peer_paths,
};
