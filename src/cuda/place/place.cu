/* The placement's kernels (place.h): a layout's routing in rank order with
 * its load counted, and ids handed back made physical. */
#include <cuda_runtime.h>

#include "core/placement.h"
#include "cuda/launch.h"
#include "cuda/place/place.h"

namespace {

constexpr int kThreads = 256;

/* The block's histogram of E experts (int32 of shared memory), zeroed for
 * its routes. */
__device__ void clear_counts(int *s_count, int32_t E) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_count[e] = 0;
  __syncthreads();
}

/* Counts into the block's histogram (E int32 of shared memory), then adds
 * its non-zero entries to the device counts. */
__device__ void flush_counts(const int *s_count, int32_t E, unsigned long long *load) {
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (s_count[e]) atomicAdd(load + e, (unsigned long long)s_count[e]);
}

/* The contiguous map: the routing is its own rank order; one thread a
 * route, counting ids in [0, E) (the layout refuses the others). */
__global__ void __launch_bounds__(kThreads) count_kernel(const int32_t *topk_idx, int64_t routes, int32_t E,
                                                         unsigned long long *load) {
  extern __shared__ int s_count[];
  clear_counts(s_count, E);
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < routes) {
    const int32_t e = __ldg(topk_idx + i);
    if (e >= 0 && e < E) atomicAdd(&s_count[e], 1);
  }
  flush_counts(s_count, E, load);
}

/* One thread a token: epx_placement_rank_token, the host's code. */
__global__ void __launch_bounds__(kThreads) rank_kernel(const int32_t *table, int32_t E, int32_t P, int32_t caller,
                                                        int32_t src_rank, int64_t T, int32_t K,
                                                        const int32_t *topk_idx, int32_t *ranked,
                                                        unsigned long long *load) {
  extern __shared__ int s_count[];
  clear_counts(s_count, E);
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t < T) {
    int32_t logical[EPX_CUDA_MAX_TOP_K];
    epx_placement_rank_token(table, E, P, caller, src_rank, t, K, topk_idx + t * K, ranked + t * K, logical);
    for (int32_t k = 0; k < K; k++)
      if (logical[k] >= 0) atomicAdd(&s_count[logical[k]], 1);
  }
  flush_counts(s_count, E, load);
}

/* ids[i] = rank_experts[ids[i]] for i below min(*rows, bound) * words; -1 kept. */
__global__ void __launch_bounds__(kThreads) ids_kernel(const int32_t *rank_experts, int32_t *ids, int32_t words,
                                                       const int64_t *rows, int64_t bound) {
  const int64_t n = min(*rows, bound) * words;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int32_t id = ids[i];
    if (id >= 0) ids[i] = __ldg(rank_experts + id);
  }
}

unsigned blocks_for(int64_t n) { return (unsigned)((n + kThreads - 1) / kThreads); }

}  // namespace

extern "C" int epx_cuda_place_rank_launch(const int32_t *table, int32_t E, int32_t P, int32_t caller,
                                          int32_t src_rank, int64_t T, int32_t K, const int32_t *topk_idx,
                                          int32_t *ranked, unsigned long long *load, void *stream_handle) {
  cudaStream_t stream = (cudaStream_t)stream_handle;
  const size_t smem = sizeof(int) * (size_t)E;
  if (T <= 0 || K <= 0) return cudaSuccess;
  if (K > EPX_CUDA_MAX_TOP_K || E > EPX_CUDA_MAX_EXPERTS) return cudaErrorInvalidValue;
  if (!ranked)
    count_kernel<<<blocks_for(T * K), kThreads, smem, stream>>>(topk_idx, T * K, E, load);
  else
    rank_kernel<<<blocks_for(T), kThreads, smem, stream>>>(table, E, P, caller, src_rank, T, K, topk_idx, ranked,
                                                           load);
  return cudaGetLastError();
}

extern "C" int epx_cuda_place_ids_launch(const int32_t *rank_experts, int32_t *ids, int32_t words,
                                         const int64_t *rows, int64_t bound, void *stream_handle) {
  if (!ids || bound <= 0 || words <= 0) return cudaSuccess;
  const int64_t n = bound * words;
  const unsigned blocks = blocks_for(n) < 1024 ? blocks_for(n) : 1024;
  ids_kernel<<<blocks, kThreads, 0, (cudaStream_t)stream_handle>>>(rank_experts, ids, words, rows, bound);
  return cudaGetLastError();
}
