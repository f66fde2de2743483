/* The load/store variant's moves between a fused plan's compact
 * expert-major rows and the low-latency fixed shape (ll.h, window.c): a
 * warp per fixed row (its metadata by lane 0, its bytes in 16-byte vectors
 * by the warp), and the routing's rows past the device count cut off. */
#include <cuda_runtime.h>

#include "cuda/ll/ll.h"

namespace {

constexpr int kWarps = 8;

struct remap_args {
  epx_cuda_ll_remap_t m;
  int64_t block;
  int32_t El;
  int to_fixed;
};

__global__ void __launch_bounds__(kWarps * 32) remap_kernel(const remap_args a) {
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (r >= a.El * a.block) return;
  const epx_cuda_ll_remap_t &m = a.m;
  const int e = (int)(r / a.block);
  const int64_t i = r % a.block, count = m.counts[e], comp = m.offsets[e] + i;
  const bool valid = i < count;
  if (a.to_fixed && lane == 0) {
    m.out.src_rank[r] = valid ? m.src_rank[comp] : -1;
    m.out.src_token[r] = valid ? m.src_token[comp] : -1;
    m.out.row_expert[r] = valid ? m.row_expert[comp] : -1;
    m.out.row_weight[r] = valid ? m.row_w[comp] : 0.0f;
    if (i == 0) {
      m.out.counts[e] = count;
      m.out.offsets[e] = r;
      if (e == a.El - 1) m.out.offsets[a.El] = r + a.block;
      if (m.recv_count) m.recv_count[e] = (int32_t)count;
    }
  }
  if (!valid) return;
  const int64_t nvec = m.row_bytes / 16;
  const uint4 *src = (const uint4 *)((const char *)m.src + (a.to_fixed ? comp : r) * m.row_bytes);
  uint4 *dst = (uint4 *)((char *)m.dst + (a.to_fixed ? r : comp) * m.row_bytes);
  for (int64_t v = lane; v < nvec; v += 32) dst[v] = src[v];
}

__global__ void clip_kernel(const int32_t *idx, const int32_t *num_tokens, int64_t rows, int32_t K, int32_t *out) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * K) return;
  const int64_t tokens = num_tokens ? min((int64_t)max(*num_tokens, 0), rows) : rows;
  out[i] = i / K < tokens ? idx[i] : -1;
}

}  // namespace

extern "C" cudaError_t epx_cuda_ll_remap_launch(const epx_cuda_ll_dims_t *d, int to_fixed,
                                                const epx_cuda_ll_remap_t *m, cudaStream_t stream) {
  const int64_t block = (int64_t)d->W * d->Tm, rows = block * d->El;
  const remap_args a = {*m, block, d->El, to_fixed};
  remap_kernel<<<(unsigned int)((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ll_clip_launch(const int32_t *topk_idx, const int32_t *num_tokens, int64_t rows,
                                               int32_t top_k, int32_t *out, cudaStream_t stream) {
  const int64_t n = rows * top_k;
  if (n == 0) return cudaSuccess;
  clip_kernel<<<(unsigned int)((n + 255) / 256), 256, 0, stream>>>(topk_idx, num_tokens, rows, top_k, out);
  return cudaGetLastError();
}
