/* The CUDA backend's entry (core/backend.h): the routing of route/ and the
 * choice, once per buffer at its creation, of the table that serves it:
 * for a comm of one rank one/ (one GPU: every expert local), or ll/ll.c for
 * a low-latency buffer; ep/ (W ranks over an NCCL or a local comm)
 * otherwise, whose paths serve both modes (ep/internal.h). Every rank has
 * the same config and comm size (agreed before this), so every rank picks
 * the same table. What the tables share (the stream, the routing's hash) is
 * here too. */
#include <cuda_runtime.h>

#include "core/backend.h"
#include "core/error.h"
#include "core/placement.h"
#include "cuda/backend.h"
#include "cuda/common/check.h"
#include "cuda/ep/ep.h"
#include "cuda/launch.h"
#include "cuda/ll/ll.h"
#include "cuda/place/place.h"

#if EPX_TEST_HOOKS
static _Atomic int g_ep_at_one_rank;

void epx_cuda_ep_at_one_rank(int on) { g_ep_at_one_rank = on != 0; }

static int ep_at_one_rank(void) { return g_ep_at_one_rank; }
#else
static int ep_at_one_rank(void) { return 0; }
#endif

/* Buffers of the normal mode (one/, ep/) also get the placement's device
 * copy (place/place.h), freed by their table's buffer_fini; low-latency
 * buffers (ll/ll.c, ep/'s low-latency path) keep the contiguous map and
 * none. */
static epx_status_t cuda_buffer_init(epx_buffer_t buffer) {
  const int ranks = buffer->world_size > 1 || ep_at_one_rank();
  if (ranks) buffer->backend = &epx_cuda_ep_backend;
  else buffer->backend = buffer->config.low_latency ? &epx_cuda_ll_backend : &epx_cuda_one_backend;
  epx_status_t status = buffer->backend->buffer_init(buffer);
  if (status != EPX_SUCCESS || buffer->config.low_latency) return status;
  status = epx_cuda_place_init(buffer);
  if (status != EPX_SUCCESS) buffer->backend->buffer_fini(buffer);
  return status;
}

/* What the CUDA paths do not serve in this version (core/backend.h,
 * supports): the low-latency kernels (ll/) place experts by the contiguous
 * map only; the rest is the W-rank paths' rules (ep/internal.h). */
static int cuda_supports(const epx_buffer_config_t *c, const char **why) {
  if (c->low_latency && !epx_placement_is_contiguous(c->placement, c->num_experts)) {
    if (why) *why = "config.low_latency (the low-latency kernels take the contiguous map only)";
    return 0;
  }
  return epx_cuda_ep_supports(c, why);
}

/* A buffer's calls go to the table cuda_buffer_init chose; this one only
 * routes, creates and says what the device serves (the hierarchical
 * exchange only when asked for by name: the flat exchanges sum in one
 * level, epx.h). */
const epx_backend_t epx_cuda_backend = {
    .name = "cuda",
    .supports = cuda_supports, /* the placement's rule, then the W-rank paths' (ep/internal.h) */
    .hierarchical_auto = 0,
    .ll = &epx_cuda_ll_ops,
    .route = epx_cuda_route,
    .route_backward = epx_cuda_route_backward,
    .buffer_init = cuda_buffer_init,
};

/* Later work, frees of memory allocated on the old stream included, must run
 * after what was enqueued on it: the new stream waits for an event recorded
 * on the old one. */
epx_status_t epx_cuda_set_stream(epx_buffer_t buffer, void *stream) {
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

epx_status_t epx_cuda_routing_hash(epx_buffer_t b, const epx_routing_t *r, uint64_t *hash, epx_cuda_wait_fn wait) {
  const char *fn = "epx_dispatch_layout";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = (cudaStream_t)b->config.stream;
  uint64_t *dev = NULL, *host = NULL;
  *hash = 0;
  CUDA_CHECK(cudaMallocHost((void **)&host, sizeof *host), fn, "cudaMallocHost");
  CUDA_CHECK(cudaMallocAsync((void **)&dev, sizeof *dev, stream), fn, "cudaMallocAsync");
  CUDA_CHECK(epx_cuda_hash_launch(r->topk_idx, r->num_tokens * r->top_k, dev, stream), fn, "the hash kernel");
  CUDA_CHECK(cudaMemcpyAsync(host, dev, sizeof *dev, cudaMemcpyDeviceToHost, stream), fn, "cudaMemcpyAsync");
  EPX_CHECK(wait(b, fn));
  *hash = *host;
fail:
  if (dev) cudaFreeAsync(dev, stream);
  if (host) cudaFreeHost(host);
  return status;
}
