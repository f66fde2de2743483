/* The fused NVLink exchange, part 3: the routing-weight gradients. A route's
 * gradient is formed on its expert's rank (a value the caller computed per
 * recv row, or the dot of combine_backward or dispatch_backward) and
 * belongs to its token's rank:
 * grad_w [T, K]. One combine-like op of two kernels, K floats per received
 * row (see fused.h, epx_fused_values_home_launch):
 *   send   a thread per received rank-major row and k-slot (a warp each
 *          for the dots): the slot's value, if its expert is on this rank,
 *          written into the source rank's window (back[this rank][token][k]);
 *          the last CTA raises each rank's flag;
 *   home   a thread per (token, k): waits for every rank's flag, then reads
 *          the value of the rank that holds the route's expert (0 for a slot
 *          without a route, and everywhere in an empty layout).
 * The dots are formed exactly as the host path forms them, so both paths
 * give the same bits: combine_backward's as its expand kernel does
 * (src/cuda/one/dispatch.cu, kDot: per lane a float32 sum over
 * EPX_CUDA_MOVE_VECS 16-byte vectors per step), dispatch_backward's as its
 * sum kernel does (src/cuda/ep/tables.cu, reduce_kernel's kDot: per lane a float32
 * sum over 2 chunks of 8 elements per step, chunk c0 = step + lane then
 * c0 + 32); in both the warp's butterfly sum per step, the steps added in
 * order from 0. tests/gpu/mpi_gpu_exchange.c (test_dot_order) checks the
 * bits with inexact data, where another order would show. */
#include <cuda_runtime.h>

#include "cuda/fused/impl.cuh"

using namespace epx_fused_impl;

namespace {

constexpr int kValuesThreads = 256;

/* <a, b> by one warp, in steps: per step each lane sums the products of its
 * S 16-byte vectors of a and b (slot order, elements in order; vec_of(step,
 * s) names slot s's vector, -1 for none) in float32 without FMA, and the
 * warp's butterfly sum of that is added to the total in step order. A
 * slot without a vector adds zeros (kSkipEmpty false: the host expand
 * kernel's zero loads) or nothing (true: the host sum kernel's skipped
 * chunks), so a signed zero comes out as the host path's. The next step's
 * loads are in flight while this step is summed. kWindowA: a is window
 * memory. */
template <typename T, bool kWindowA, int S, bool kSkipEmpty, typename VecOf>
__device__ float warp_dot_steps(const uint4 *a, const uint4 *b, int64_t steps, VecOf vec_of) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  uint4 av[S], bv[S], an[S], bn[S];
  auto load = [&](int64_t step, uint4 (&x)[S], uint4 (&y)[S]) {
#pragma unroll
    for (int s = 0; s < S; s++) {
      const int64_t i = vec_of(step, s);
      x[s] = i >= 0 ? ld_row<kWindowA>(a + i) : zero;
      y[s] = i >= 0 ? ld_stream(b + i) : zero;
    }
  };
  float acc = 0.0f;
  if (steps > 0) load(0, av, bv);
  for (int64_t step = 0; step < steps; step++) {
    const bool more = step + 1 < steps;
    if (more) load(step + 1, an, bn);
    float part = 0.0f;
#pragma unroll
    for (int s = 0; s < S; s++) {
      if (kSkipEmpty && vec_of(step, s) < 0) continue;
      float af[n], bf[n];
      vec::unpack(av[s], af);
      vec::unpack(bv[s], bf);
#pragma unroll
      for (int e = 0; e < n; e++) part = __fadd_rn(part, __fmul_rn(af[e], bf[e]));
    }
    acc = __fadd_rn(acc, epx_warp_sum(part));
    if (more) {
#pragma unroll
      for (int s = 0; s < S; s++) av[s] = an[s], bv[s] = bn[s];
    }
  }
  return acc;
}

/* The host expand kernel's order (see the file comment): per step, lane l's
 * vectors v0 + u * 32 + l for u < EPX_CUDA_MOVE_VECS. */
template <typename T, bool kWindowA>
__device__ float warp_dot(const uint4 *a, const uint4 *b, int64_t nvec, int lane) {
  constexpr int U = EPX_CUDA_MOVE_VECS;
  const int64_t steps = (nvec + 32 * U - 1) / (32 * U);
  return warp_dot_steps<T, kWindowA, U, false>(a, b, steps, [&](int64_t step, int u) -> int64_t {
    const int64_t i = step * 32 * U + u * 32 + lane;
    return i < nvec ? i : -1;
  });
}

/* The host sum kernel's order (see the file comment): chunks of 8 elements,
 * 16 bytes (bf16, f16) or 32 (float32); per step, lane l's chunks
 * c0 = step + l and c0 + 32, each in element order. */
template <typename T, bool kWindowA>
__device__ float warp_dot_chunks(const uint4 *a, const uint4 *b, int64_t nvec, int lane) {
  constexpr int per_chunk = 8 / epx_vec<T>::n; /* vectors per chunk */
  constexpr int kChunks = 2;
  const int64_t chunks = nvec / per_chunk, steps = (chunks + 32 * kChunks - 1) / (32 * kChunks);
  return warp_dot_steps<T, kWindowA, kChunks * per_chunk, true>(a, b, steps, [&](int64_t step, int s) -> int64_t {
    const int64_t c = step * 32 * kChunks + (s / per_chunk) * 32 + lane;
    return c < chunks ? c * per_chunk + s % per_chunk : -1;
  });
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
/* Where this rank's value for token t of rank s goes: s's window, or this
 * rank's outbox to a relayed s. */
__device__ __forceinline__ float *back_to(const fused_dev &d, int s, int64_t t) {
  return relayed(d, s) ? reinterpret_cast<float *>(d.relay[s] + d.relay_off_back) + t * d.Kmax
                       : back_at(d, d.peer[s], d.rank, t);
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
  if (threadIdx.x < d.W && threadIdx.x != d.rank && !relayed(d, threadIdx.x) &&
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
      const int s = source_of_row(s_rbase, d.W, q);
      int32_t at = -1; /* where the slot's value is, -1: no route of this rank */
      if (a.mode == EPX_FUSED_VALUES_PER_SLOT) at = p.pair_expert[i] >= 0 ? (int32_t)i : -1;
      else at = p.pair_rows[i];
      if (at >= 0) back_to(d, s, p.pair_token[q])[k] = a.values[at];
    }
  } else if (!s_bad) {
    /* a warp per (row, k-slot): each route's dot is a warp's, so every
     * warp of the grid has one in flight */
    const int lane = threadIdx.x & 31;
    const uint4 *pay = reinterpret_cast<const uint4 *>(d.local + d.off_pay);
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < pairs * K; i += warps) {
      const int32_t row = p.pair_rows[i];
      if (row < 0) continue; /* the slot's expert is elsewhere, or no route */
      const int64_t q = i / K;
      const int s = source_of_row(s_rbase, d.W, q);
      const int32_t t = p.pair_token[q];
      /* the home row as it arrived (this rank's own rows never went
       * through the window: read at home) against the slot's route row */
      const uint4 *rr = a.route_rows + (int64_t)row * d.nvec;
      const float dot = s == d.rank
                            ? route_dot<T, false>(a.mode, a.home_rows + (int64_t)t * d.nvec, rr, d.nvec, lane)
                            : route_dot<T, true>(a.mode, pay + q * d.nvec, rr, d.nvec, lane);
      if (lane == 0) back_to(d, s, t)[i % K] = dot;
    }
  }
  if (last_cta(d, true) && threadIdx.x < d.W && !relayed(d, threadIdx.x)) /* the values went to the sources' windows */
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
  if (threadIdx.x < d.W && !relayed(d, threadIdx.x) && /* (relayed: came by the relay step) */
      !wait_flag(d, flag_at(d.local, d.off_vflag, threadIdx.x), seq + 1, threadIdx.x, PH_VALUES))
    s_bad = 1;
  __syncthreads();
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; !s_bad && i < p.T * p.K;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / p.K;
    const int k = (int)(i % p.K);
    const int32_t e = p.idx[i];
    /* an empty layout (a rank was oversize) moved nothing: no route has a value */
    grad_w[i] = e >= 0 && !p.info[ii.empty] ? __ldcg(back_at(d, d.local, e / d.El, t) + k) : 0.0f;
  }
  end_op(d, seq);
}

/* n: the send kernel's CTAs; the home kernel's are as many as its routes
 * need, at most f->num_sms (a rank's share of the SMs where ranks share
 * the GPU: every CTA of both waits on the peers, which must find room). */
template <typename T>
cudaError_t launch_values(epx_fused_t *f, const epx_fused_plan_t *plan, const values_args &a, int n,
                          cudaStream_t stream) {
  const fused_plan_dev &p = plan->dev;
  values_send_kernel<T><<<n, kValuesThreads, 0, stream>>>(f->dev, p, a);
  if (f->dev.relay_mask) {
    const cudaError_t e = epx_fused_relay_step(f, plan, RELAY_VALUES, 0, stream);
    if (e != cudaSuccess) return e;
  }
  int64_t home_blocks = (p.T * p.K + kValuesThreads - 1) / kValuesThreads;
  if (home_blocks > f->num_sms) home_blocks = f->num_sms;
  values_home_kernel<<<(unsigned)(home_blocks > 0 ? home_blocks : 1), kValuesThreads, 0, stream>>>(f->dev, p,
                                                                                                   a.grad_w);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t epx_fused_values_home_launch(epx_fused_t *f, const epx_fused_plan_t *plan, int mode,
                                                    const void *values, const void *home_rows, float *grad_w,
                                                    cudaStream_t stream) {
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
  /* Every SM, briefly, as the expansion apart: moving values is a few
   * bytes per route and bound by latency (a thread per slot on every SM
   * beat a warp per row on the budget's CTAs, whatever the budget); the dots
   * read two rows per route, bound by the loads in flight (on the budget's
   * CTAs alone combine_backward with grad_w took several times as long as
   * without; bench/NOTES.md, "v0.4 house", has the figures). Where ranks
   * share this GPU, a rank's share of the SMs only: the send kernel's CTAs
   * wait for the peers' clear-to-send, and four per SM of this register-heavy
   * kernel would fill the whole GPU before a peer's could start. */
  const int shared = epx_fused_ranks_on_device(f, nullptr, nullptr) > 1;
  const int n = dots && !shared ? 4 * f->num_sms : f->num_sms;
  return epx_payload_visit(f->config.dtype,
                           [&](auto tag) { return launch_values<typename decltype(tag)::type>(f, plan, a, n, stream); });
}
