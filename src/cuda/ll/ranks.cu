/* The low-latency layout on W ranks (ll.h, "W ranks"): pack_kernel writes
 * the home side (a block per destination rank numbers, in token order, the
 * tokens with a route there, and writes their pair rows and the slab's
 * header), place_kernel the receiver's (a block per local expert numbers
 * the received pairs that chose it in (source rank, slab order) = (source
 * rank, source token) order: the normal expert-major layout's rows). Both
 * with the block scan of scan.cuh: no atomics, the same result every run.
 * Work per step: W blocks reading T x K ids, El blocks reading W x T x Kb
 * header ids (at most 8 x 256 x 8 ints, from L2). */
#include <cuda_runtime.h>

#include "cuda/ll/ll.h"
#include "cuda/ll/scan.cuh"

namespace {

using epx_ll::block_scan;
using epx_ll::kThreads;

/* The header's arrays of slab `slab` of a staging buffer. */
struct header {
  int32_t *count, *token, *ids;
  float *w;
};

__device__ __forceinline__ header header_of(const epx_cuda_ll_dims_t &d, const void *staging, int64_t slab) {
  int32_t *h = (int32_t *)((char *)staging + (slab * d.S + d.Tm) * d.row_bytes);
  int32_t *token = h + EPX_CUDA_LL_HDR_PAD, *ids = token + d.Tm;
  return {h, token, ids, (float *)(ids + d.Tm * d.Kb)};
}

/* Whether route k of token t is valid and the token's first to its expert. */
__device__ __forceinline__ bool first_route(const int32_t *idx, int64_t t, int k, int K, int E) {
  const int32_t e = idx[t * K + k];
  if (e < 0 || e >= E) return false;
  for (int j = 0; j < k; j++)
    if (idx[t * K + j] == e) return false;
  return true;
}

struct pack_args {
  epx_cuda_ll_dims_t d;
  const int32_t *idx;
  const float *w;
  const int32_t *num_tokens;
  int64_t rows;
  void *send;
  int32_t *pair_stage;
};

__global__ void __launch_bounds__(kThreads) pack_kernel(const pack_args a) {
  __shared__ int s_warp[kThreads / 32];
  const epx_cuda_ll_dims_t &d = a.d;
  const int p = blockIdx.x, K = d.K, E = d.W * d.El;
  const int32_t lo = p * d.El, hi = lo + d.El;
  const int64_t tokens = a.num_tokens ? min((int64_t)max(*a.num_tokens, 0), a.rows) : a.rows;
  const header h = header_of(d, a.send, p);
  int64_t base = 0;
  for (int64_t t0 = 0; t0 < a.rows; t0 += kThreads) {
    const int64_t t = t0 + threadIdx.x;
    bool to_p = false;
    if (t < tokens)
      for (int k = 0; k < K; k++) {
        const int32_t e = a.idx[t * K + k];
        to_p |= e >= lo && e < hi && first_route(a.idx, t, k, K, E);
      }
    int total;
    const int j = (int)base + block_scan(to_p, s_warp, &total);
    if (t < a.rows) a.pair_stage[t * d.W + p] = to_p ? (int32_t)(p * d.S + j) : -1;
    if (to_p) {
      h.token[j] = (int32_t)t;
      for (int k = 0; k < d.Kb; k++) {
        const int32_t e = k < K ? a.idx[t * K + k] : -1;
        const bool mine = k < K && e >= lo && e < hi && first_route(a.idx, t, k, K, E);
        h.ids[(int64_t)j * d.Kb + k] = mine ? e : -1;
        h.w[(int64_t)j * d.Kb + k] = mine && a.w ? a.w[t * K + k] : 0.0f;
      }
    }
    base += total;
  }
  if (threadIdx.x == 0) *h.count = (int32_t)base;
}

struct place_args {
  epx_cuda_ll_dims_t d;
  const void *recv;
  epx_cuda_ll_recv_t out;
  int32_t *recv_count;
};

__global__ void __launch_bounds__(kThreads) place_kernel(const place_args a) {
  __shared__ int s_warp[kThreads / 32];
  const epx_cuda_ll_dims_t &d = a.d;
  const int e = blockIdx.x;
  const int32_t g = d.rank * d.El + e;
  const int64_t block = (int64_t)d.W * d.Tm, first = (int64_t)e * block;
  int64_t base = 0;
  for (int s = 0; s < d.W; s++) {
    const header h = header_of(d, a.recv, s);
    const int64_t n = min((int64_t)max(*h.count, 0), d.Tm);
    for (int64_t j0 = 0; j0 < n; j0 += kThreads) {
      const int64_t j = j0 + threadIdx.x;
      int slot = -1;
      if (j < n)
        for (int k = 0; k < d.Kb && slot < 0; k++)
          if (h.ids[j * d.Kb + k] == g) slot = k;
      int total;
      const int pos = block_scan(slot >= 0, s_warp, &total);
      if (slot >= 0) {
        const int64_t row = first + base + pos, at = (s * d.S + j) * d.Kb + slot;
        const float w = h.w[j * d.Kb + slot];
        a.out.rp_rows[at] = (int32_t)row;
        a.out.rp_w[at] = w;
        a.out.src_rank[row] = s;
        a.out.src_token[row] = h.token[j];
        a.out.row_expert[row] = g;
        a.out.row_weight[row] = w;
      }
      base += total;
    }
  }
  for (int64_t r = base + threadIdx.x; r < block; r += kThreads) {
    a.out.src_rank[first + r] = -1;
    a.out.src_token[first + r] = -1;
    a.out.row_expert[first + r] = -1;
    a.out.row_weight[first + r] = 0.0f;
  }
  if (threadIdx.x == 0) {
    a.out.counts[e] = base;
    a.out.offsets[e] = first;
    if (e == d.El - 1) a.out.offsets[d.El] = first + block;
    if (a.recv_count) a.recv_count[e] = (int32_t)base;
  }
}

/* Rank-major: pair j of source s is row s * Tm + j as it is (a thread per
 * row); its routes' experts and weights [K] beside it. counts (zeroed
 * first) gather the routes per local expert: integer atomics, so the same
 * counts every run. */
__global__ void place_ranks_kernel(const place_args a) {
  const epx_cuda_ll_dims_t &d = a.d;
  const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= d.W * d.Tm) return;
  const int s = (int)(row / d.Tm);
  const int64_t j = row % d.Tm;
  const header h = header_of(d, a.recv, s);
  const int64_t n = min((int64_t)max(*h.count, 0), d.Tm);
  if (row == 0) a.out.offsets[d.El] = d.W * d.Tm;
  if (j == 0 && a.recv_count) a.recv_count[s] = (int32_t)n;
  const bool in = j < n;
  int first = -1;
  for (int k = 0; k < d.Kb && in; k++) {
    const int32_t e = h.ids[j * d.Kb + k];
    if (e < 0) continue;
    if (first < 0) first = k;
    atomicAdd((unsigned long long *)&a.out.counts[e - d.rank * d.El], 1ull);
  }
  if (first >= 0) a.out.rp_rows[(s * d.S + j) * d.Kb + first] = (int32_t)row;
  a.out.src_rank[row] = in ? s : -1;
  a.out.src_token[row] = in ? h.token[j] : -1;
  for (int k = 0; k < d.K; k++) {
    a.out.row_expert[row * d.K + k] = in ? h.ids[j * d.Kb + k] : -1;
    a.out.row_weight[row * d.K + k] = in ? h.w[j * d.Kb + k] : 0.0f;
  }
}

}  // namespace

extern "C" cudaError_t epx_cuda_ll_pack_launch(const epx_cuda_ll_dims_t *d, const int32_t *topk_idx,
                                               const float *topk_w, const int32_t *num_tokens, int64_t rows,
                                               void *send, int32_t *pair_stage, cudaStream_t stream) {
  const pack_args a = {*d, topk_idx, topk_w, num_tokens, rows, send, pair_stage};
  pack_kernel<<<d->W, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ll_place_launch(const epx_cuda_ll_dims_t *d, const void *recv,
                                                const epx_cuda_ll_recv_t *out, int32_t *recv_count,
                                                cudaStream_t stream) {
  cudaError_t err =
      cudaMemsetAsync(out->rp_rows, 0xff, sizeof(int32_t) * (size_t)(d->W * d->S * d->Kb), stream);
  if (err != cudaSuccess) return err;
  const place_args a = {*d, recv, *out, recv_count};
  place_kernel<<<d->El, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ll_place_ranks_launch(const epx_cuda_ll_dims_t *d, const void *recv,
                                                      const epx_cuda_ll_recv_t *out, int32_t *recv_count,
                                                      cudaStream_t stream) {
  cudaError_t err =
      cudaMemsetAsync(out->rp_rows, 0xff, sizeof(int32_t) * (size_t)(d->W * d->S * d->Kb), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(out->counts, 0, sizeof(int64_t) * (size_t)d->El, stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(out->offsets, 0, sizeof(int64_t) * (size_t)d->El, stream);
  if (err != cudaSuccess) return err;
  const place_args a = {*d, recv, *out, recv_count};
  const int64_t rows = d->W * d->Tm;
  place_ranks_kernel<<<(unsigned int)((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}
