/* The gradient of routing weights the expert applied itself, brought home on
 * one GPU: grad_w[t, k] is the value at the route's recv row (rank-major: at
 * the token's row, slot k), 0 for slots without a route. A thread per route.
 *
 * Bytes moved: 4*T*K read of the route rows (plus 4*T*K of the expert ids for
 * rank-major), 4*T*K gathered from grad_recv_w, 4*T*K written. */
#include <cuda_runtime.h>

#include "cuda/launch.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    weights_back_kernel(const int32_t *route_row, const int32_t *token_row, const int32_t *idx,
                        const float *grad_recv_w, float *grad_w, int64_t routes, int32_t top_k) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i >= routes) return;
  float value = 0.0f;
  if (token_row) {
    const int32_t row = token_row[i / top_k];
    if (idx[i] >= 0 && row >= 0) value = grad_recv_w[(int64_t)row * top_k + i % top_k];
  } else {
    const int32_t row = route_row[i];
    if (row >= 0) value = grad_recv_w[row];
  }
  grad_w[i] = value;
}

}  // namespace

extern "C" cudaError_t epx_cuda_weights_back_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                                    int64_t num_tokens, int32_t top_k,
                                                    const float *grad_recv_w, float *grad_w,
                                                    cudaStream_t stream) {
  const int64_t routes = num_tokens * top_k;
  if (routes == 0) return cudaSuccess;
  const int rank_major = layout == EPX_LAYOUT_RANK_MAJOR;
  weights_back_kernel<<<(unsigned)((routes + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      rank_major ? nullptr : lay->route_row, rank_major ? lay->token_row : nullptr, lay->idx, grad_recv_w,
      grad_w, routes, top_k);
  return cudaGetLastError();
}
