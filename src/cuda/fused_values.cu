/* The fused NVLink exchange, part 3: the routing-weight gradients. A route's
 * gradient is formed on its expert's rank (a value the caller computed per
 * recv row, or the dot of combine_backward) and belongs to its token's rank:
 * grad_w [T, K]. One combine-like op of two kernels, K floats per received
 * row (see fused.h, epx_fused_values_home_launch):
 *   send   a thread per received rank-major row and k-slot (a warp per row
 *          for the dots): the slot's value, if its expert is on this rank,
 *          written into the source rank's window (back[this rank][token][k]);
 *          the last CTA raises each rank's flag;
 *   home   a thread per (token, k): waits for every rank's flag, then reads
 *          the value of the rank that holds the route's expert (0 for a slot
 *          without a route, and everywhere in an empty layout).
 * The dots are formed exactly as the host path forms them, so both paths
 * give the same bits: combine_backward's as its expand kernel does
 * (src/cuda/dispatch.cu, kDot: per lane a float32 sum over
 * EPX_CUDA_MOVE_VECS 16-byte vectors per step), dispatch_backward's as its
 * sum kernel does (src/cuda/ep.cu, reduce_kernel's kDot: per lane a float32
 * sum over 2 chunks of 8 elements per step, chunk c0 = step + lane then
 * c0 + 32); in both the warp's butterfly sum per step, the steps added in
 * order from 0. tests/gpu/mpi_gpu_exchange.c (test_dot_order) checks the
 * bits with inexact data, where another order would show. */
#include <cuda_runtime.h>

#include "cuda/fused_impl.cuh"

using namespace epx_fused_impl;

namespace {

constexpr int kValuesThreads = 256;

/* <a, b> over one row of nvec 16-byte vectors, by one warp, in the host
 * path's order (see the file comment). kWindowA: a is window memory. */
template <typename T, bool kWindowA>
__device__ float warp_dot(const uint4 *a, const uint4 *b, int64_t nvec, int lane) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  constexpr int U = EPX_CUDA_MOVE_VECS;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  float acc = 0.0f;
  for (int64_t v0 = 0; v0 < nvec; v0 += 32 * U) {
    uint4 av[U], bv[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int64_t i = v0 + u * 32 + lane;
      av[u] = i < nvec ? ld_row<kWindowA>(a + i) : zero;
      bv[u] = i < nvec ? ld_stream(b + i) : zero;
    }
    float part = 0.0f;
#pragma unroll
    for (int u = 0; u < U; u++) {
      float af[n], bf[n];
      vec::unpack(av[u], af);
      vec::unpack(bv[u], bf);
#pragma unroll
      for (int e = 0; e < n; e++) part = __fadd_rn(part, __fmul_rn(af[e], bf[e]));
    }
    acc = __fadd_rn(acc, epx_warp_sum(part));
  }
  return acc;
}

/* <a, b> in the order of the host path's sum kernel (see the file comment):
 * chunks of 8 elements, 16 bytes (bf16, f16) or 32 (float32). */
template <typename T, bool kWindowA>
__device__ float warp_dot_chunks(const uint4 *a, const uint4 *b, int64_t nvec, int lane) {
  using vec = epx_vec<T>;
  constexpr int per_chunk = 8 / vec::n; /* vectors per chunk */
  constexpr int kChunks = 2;
  const int64_t chunks = nvec / per_chunk;
  float acc = 0.0f;
  for (int64_t step = 0; step < chunks; step += 32 * kChunks) {
    float part = 0.0f;
#pragma unroll
    for (int u = 0; u < kChunks; u++) {
      const int64_t c = step + u * 32 + lane;
      if (c >= chunks) continue;
#pragma unroll
      for (int v = 0; v < per_chunk; v++) {
        float af[vec::n], bf[vec::n];
        vec::unpack(ld_row<kWindowA>(a + c * per_chunk + v), af);
        vec::unpack(ld_stream(b + c * per_chunk + v), bf);
#pragma unroll
        for (int e = 0; e < vec::n; e++) part = __fadd_rn(part, __fmul_rn(af[e], bf[e]));
      }
    }
    acc = __fadd_rn(acc, epx_warp_sum(part));
  }
  return acc;
}

/* One route's dot in the order of the host path that forms it. */
template <typename T, bool kWindowA>
__device__ __forceinline__ float route_dot(int mode, const uint4 *a, const uint4 *b, int64_t nvec, int lane) {
  return mode == EPX_FUSED_VALUES_DISPATCH_DOTS ? warp_dot_chunks<T, kWindowA>(a, b, nvec, lane)
                                                : warp_dot<T, kWindowA>(a, b, nvec, lane);
}

struct values_args {
  int mode;            /* EPX_FUSED_VALUES_* */
  const float *values; /* PER_SLOT [N, K], PER_ROW [N] */
  /* the dots: rows [N, H] in the layout (expert_out, grad_recv_x) and
   * [T, H] at home (grad_out, x) */
  const uint4 *route_rows, *home_rows;
  float *grad_w;       /* [T, K] */
};

__device__ __forceinline__ float *back_at(const fused_dev &d, char *window, int from, int64_t t) {
  return reinterpret_cast<float *>(window + d.off_back) + ((int64_t)from * d.maxT + t) * d.Kmax;
}

template <typename T>
__global__ void __launch_bounds__(kValuesThreads) values_send_kernel(const fused_dev d, const fused_plan_dev p,
                                                                     const values_args a) {
  __shared__ int s_bad;
  __shared__ int64_t s_rbase[EPX_FUSED_MAX_RANKS + 1];
  if (failed(d)) return;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const info_index ii = make_info_index(d.W, d.El);
  if (blockIdx.x == 0) send_cts(d, seq);
  if (threadIdx.x == 0) s_bad = 0;
  if (threadIdx.x <= d.W) s_rbase[threadIdx.x] = p.info[ii.rbase + threadIdx.x];
  __syncthreads();
  /* a source's back region is free once it entered this op */
  if (threadIdx.x < d.W && threadIdx.x != d.rank &&
      !wait_flag(d, flag_at(d.local, d.off_cts, threadIdx.x), seq + 1, threadIdx.x, PH_VALUES_CTS))
    s_bad = 1;
  __syncthreads();
  const int K = p.K;
  const int64_t pairs = s_rbase[d.W];
  const bool dots = a.mode == EPX_FUSED_VALUES_COMBINE_DOTS || a.mode == EPX_FUSED_VALUES_DISPATCH_DOTS;
  if (!s_bad && !dots) {
    /* a thread per (row, k-slot): a few bytes each, latency-bound */
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < pairs * K;
         i += (int64_t)gridDim.x * blockDim.x) {
      const int64_t q = i / K;
      const int k = (int)(i % K);
      int s = 0;
      while (s + 1 < d.W && s_rbase[s + 1] <= q) s++;
      int32_t at = -1; /* where the slot's value is, -1: no route of this rank */
      if (a.mode == EPX_FUSED_VALUES_PER_SLOT) at = p.pair_expert[i] >= 0 ? (int32_t)i : -1;
      else at = p.pair_rows[i];
      if (at >= 0) back_at(d, d.peer[s], d.rank, p.pair_token[q])[k] = a.values[at];
    }
  } else if (!s_bad) {
    const int lane = threadIdx.x & 31;
    const uint4 *pay = reinterpret_cast<const uint4 *>(d.local + d.off_pay);
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t q = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < pairs; q += warps) {
      int s = 0;
      while (s + 1 < d.W && s_rbase[s + 1] <= q) s++;
      const int32_t t = p.pair_token[q];
      float *home = back_at(d, d.peer[s], d.rank, t);
      /* the home row as it arrived (this rank's own rows never went
       * through the window: read at home) against each slot's route row */
      const int32_t my_row = lane < K ? p.pair_rows[q * K + lane] : -1;
      for (unsigned m = __ballot_sync(0xffffffffu, my_row >= 0); m; m &= m - 1) {
        const int k = __ffs(m) - 1;
        const int64_t row = __shfl_sync(0xffffffffu, my_row, k);
        const uint4 *rr = a.route_rows + row * d.nvec;
        const float dot = s == d.rank
                              ? route_dot<T, false>(a.mode, a.home_rows + (int64_t)t * d.nvec, rr, d.nvec, lane)
                              : route_dot<T, true>(a.mode, pay + q * d.nvec, rr, d.nvec, lane);
        if (lane == 0) home[k] = dot;
      }
    }
  }
  if (last_cta(d, true) && threadIdx.x < d.W) /* the values went to the sources' windows */
    st_release_sys(flag_at(d.peer[threadIdx.x], d.off_vflag, d.rank), seq + 1);
}

__global__ void __launch_bounds__(kValuesThreads) values_home_kernel(const fused_dev d, const fused_plan_dev p,
                                                                     float *grad_w) {
  __shared__ int s_bad;
  if (failed(d)) return;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  if (threadIdx.x < d.W &&
      !wait_flag(d, flag_at(d.local, d.off_vflag, threadIdx.x), seq + 1, threadIdx.x, PH_VALUES))
    s_bad = 1;
  __syncthreads();
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (!s_bad && i < p.T * p.K) {
    const int64_t t = i / p.K;
    const int k = (int)(i % p.K);
    const int32_t e = p.idx[i];
    /* an empty layout (a rank was oversize) moved nothing: no route has a value */
    grad_w[i] = e >= 0 && !p.info[ii.empty] ? __ldcg(back_at(d, d.local, e / d.El, t) + k) : 0.0f;
  }
  end_op(d, seq);
}

template <typename T>
cudaError_t launch_values(epx_fused_t *f, const epx_fused_plan_t *plan, const values_args &a, int n,
                          cudaStream_t stream) {
  const fused_plan_dev &p = plan->dev;
  values_send_kernel<T><<<n, kValuesThreads, 0, stream>>>(f->dev, p, a);
  const int64_t home_blocks = (p.T * p.K + kValuesThreads - 1) / kValuesThreads;
  values_home_kernel<<<(unsigned)(home_blocks > 0 ? home_blocks : 1), kValuesThreads, 0, stream>>>(f->dev, p,
                                                                                                   a.grad_w);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t epx_fused_values_home_launch(epx_fused_t *f, const epx_fused_plan_t *plan, int mode,
                                                    const void *values, const void *home_rows, float *grad_w,
                                                    int32_t num_ctas, cudaStream_t stream) {
  const fused_plan_dev &p = plan->dev;
  const bool dots = mode == EPX_FUSED_VALUES_COMBINE_DOTS || mode == EPX_FUSED_VALUES_DISPATCH_DOTS;
  if ((mode != EPX_FUSED_VALUES_PER_SLOT && mode != EPX_FUSED_VALUES_PER_ROW && !dots) ||
      (mode == EPX_FUSED_VALUES_PER_SLOT && p.expert_major) || (mode != EPX_FUSED_VALUES_PER_SLOT && !p.expert_major) ||
      (!grad_w && p.T > 0) || (dots && !home_rows && p.T > 0))
    return cudaErrorInvalidValue;
  values_args a;
  a.mode = mode;
  a.values = dots ? nullptr : static_cast<const float *>(values);
  a.route_rows = dots ? static_cast<const uint4 *>(values) : nullptr;
  a.home_rows = static_cast<const uint4 *>(home_rows);
  a.grad_w = grad_w;
  /* The dots read every expert row (the SM budget's CTAs); moving values is
   * a few bytes per route and bound by latency: every SM, briefly (on 2
   * H200 a warp per row on the budget's 32 CTAs took 60 us; a thread per
   * slot on every SM 43-48 us, whatever the budget). */
  int n = dots ? num_ctas : f->num_sms;
  n = n < 1 ? 1 : n > f->num_sms ? f->num_sms : n;
  switch (f->config.dtype) {
    case EPX_FLOAT32: return launch_values<float>(f, plan, a, n, stream);
    case EPX_BFLOAT16: return launch_values<__nv_bfloat16>(f, plan, a, n, stream);
    case EPX_FLOAT16: return launch_values<__half>(f, plan, a, n, stream);
  }
  return cudaErrorInvalidValue;
}
