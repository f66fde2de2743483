/* The low-latency layout on one GPU (ll.h): a block per expert walks the
 * tokens in order, 256 at a time, and numbers the tokens that chose its
 * expert by a block-wide prefix sum, so the rows of an expert are in token
 * order — the normal expert-major layout's order on one rank, with no
 * atomics and the same result on every run. Work: E blocks each read the
 * T x K ids (at most 256 x 8 = 8 KB, from L2), and write their G rows'
 * metadata. */
#include <cuda_runtime.h>

#include "cuda/ll/ll.h"
#include "cuda/ll/scan.cuh"

namespace {

using epx_ll::block_scan;
using epx_ll::kThreads;

struct layout_args {
  const int32_t *idx;
  const float *w;
  const int32_t *num_tokens;
  int64_t rows, block;
  int32_t k, experts;
  epx_cuda_ll_layout_t out;
  int32_t *recv_count;
};

__global__ void __launch_bounds__(kThreads) layout_kernel(const layout_args a) {
  __shared__ int s_warp[kThreads / 32];
  const int e = blockIdx.x;
  const int64_t tokens = a.num_tokens ? min((int64_t)max(*a.num_tokens, 0), a.rows) : a.rows;
  const int64_t first = (int64_t)e * a.block;
  int64_t base = 0;
  for (int64_t t0 = 0; t0 < tokens; t0 += kThreads) {
    const int64_t t = t0 + threadIdx.x;
    int slot = -1;
    if (t < tokens)
      for (int k = 0; k < a.k && slot < 0; k++)
        if (a.idx[t * a.k + k] == e) slot = k; /* a second route to e is dropped */
    int total;
    const int pos = block_scan(slot >= 0, s_warp, &total);
    if (slot >= 0 && base + pos < a.block) {
      const int64_t row = first + base + pos;
      a.out.route_row[t * a.k + slot] = (int32_t)row;
      a.out.src_token[row] = (int32_t)t;
      a.out.row_expert[row] = e;
      a.out.row_weight[row] = a.w ? a.w[t * a.k + slot] : 0.0f;
    }
    base += total;
  }
  const int64_t count = min(base, a.block);
  for (int64_t r = count + threadIdx.x; r < a.block; r += kThreads) {
    a.out.src_token[first + r] = -1;
    a.out.row_expert[first + r] = -1;
    a.out.row_weight[first + r] = 0.0f;
  }
  if (threadIdx.x == 0) {
    a.out.counts[e] = count;
    a.out.offsets[e] = first;
    if (e == a.experts - 1) a.out.offsets[a.experts] = first + a.block;
    if (a.recv_count) a.recv_count[e] = (int32_t)count;
  }
}

__global__ void source_kernel(const int32_t *src_token, int64_t n, int32_t *src_rank) {
  const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r < n) src_rank[r] = src_token[r] >= 0 ? 0 : -1;
}

}  // namespace

extern "C" cudaError_t epx_cuda_ll_layout_launch(const int32_t *topk_idx, const float *topk_w,
                                                 const int32_t *num_tokens, int64_t rows, int32_t top_k,
                                                 int32_t experts, int64_t block,
                                                 const epx_cuda_ll_layout_t *out, int32_t *recv_count,
                                                 cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(out->route_row, 0xff, sizeof(int32_t) * (size_t)(rows * top_k), stream);
  if (err != cudaSuccess) return err;
  layout_args a = {topk_idx, topk_w, num_tokens, rows, block, top_k, experts, *out, recv_count};
  layout_kernel<<<experts, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ll_source_launch(const int32_t *src_token, int64_t n, int32_t *src_rank,
                                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  source_kernel<<<(unsigned int)((n + 255) / 256), 256, 0, stream>>>(src_token, n, src_rank);
  return cudaGetLastError();
}
