/* The one-kernel routing forward (launch.h, "one-kernel forward"): dropless,
 * no locations, no losses, non-finite tokens dropped. A warp per token holds
 * the token's E = 32 V scores in registers, lane l experts [l V, l V + V):
 * scores, the group scores (a group is L = 32 / G whole lanes; its top-2 by
 * xor shuffles of each lane's top-2 candidates), the kept groups (each lane
 * ranks its group against the G group scores), K rounds of warp arg-max
 * (redux.sync) over the lanes' best candidates, and lane k writes route k.
 * The selection is route/common.cuh's token_select step for step (the same
 * float32 operations and tie rules, src/core/route_spec.h), so the routes
 * are those of the queue kernels; only the softmax's float32 sum runs in
 * another order (the spec allows it: softmax agrees away from ties).
 *
 * Why: the queue pipeline (route_tokens + expert_scan + assign, a memset and
 * the scratch) costs several times what reading the logits and writing the
 * routes takes (bench/NOTES-gpu.md); without locations nothing needs the
 * scan. */
#include <cuda_runtime.h>

#include "cuda/common/pdl.cuh"
#include "cuda/route/common.cuh"

using namespace route_dev;

namespace {

constexpr int kFastWarps = 8; /* tokens per block */

typedef epx_cuda_route_fast_args_t FastArgs;

/* V consecutive floats at p (16-byte vectors where V allows; the host
 * checks the alignment). */
template <int V>
__device__ __forceinline__ void load_lane(const float *__restrict__ p, float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const float4 q = __ldg(reinterpret_cast<const float4 *>(p + j));
      v[j] = q.x;
      v[j + 1] = q.y;
      v[j + 2] = q.z;
      v[j + 3] = q.w;
    }
  } else if constexpr (V == 2) {
    const float2 q = __ldg(reinterpret_cast<const float2 *>(p));
    v[0] = q.x;
    v[1] = q.y;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = __ldg(p + j);
  }
}

/* Step 1: x (the logits) -> p (scores; the logits for softmax after top-k).
 * The score function is a template parameter so that each kernel holds one
 * function's code and registers (the double-precision ones need many). */
template <int V, int SCORE>
__device__ __forceinline__ void fast_scores(const float (&x)[V], float (&p)[V]) {
  if constexpr (SCORE == EPX_SCORE_SOFTMAX) {
    float m = x[0];
#pragma unroll
    for (int j = 1; j < V; ++j) m = fmaxf(m, x[j]);
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      p[j] = expf(x[j] - m);
      s += p[j];
    }
    s = warp_sum(s);
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = p[j] / s;
  } else if constexpr (SCORE == EPX_SCORE_SIGMOID) {
    sigmoid_f32_v<V>(x, p);
  } else if constexpr (SCORE == EPX_SCORE_SQRT_SOFTPLUS) {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = epx_route_sqrt_softplus_f32(x[j]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = x[j];
  }
}

/* A lane's candidate: an entry's key (0: none), index j and score p. */
struct Cand {
  unsigned k;
  int j;
  float p;
};

/* The float a non-zero order_key came from (-0 comes back as +0, which
 * compares and adds alike); -inf for 0 (no entry), as the group scan's
 * start value. */
__device__ __forceinline__ float key_value(unsigned k) {
  const unsigned u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return k == 0u ? -INFINITY : __uint_as_float(u);
}

/* This lane's best two entries (key, then lower j), c1 before c2; with
 * BOUNDED only those after (lk, lj) in that order, i.e. the entries this
 * lane has not given out yet (a lane gives out its entries best first). */
template <int V, bool BOUNDED>
__device__ __forceinline__ void fast_lane_top2(const unsigned (&key)[V], const float (&p)[V],
                                               unsigned lk, int lj, Cand &c1, Cand &c2) {
  c1 = Cand{0u, 0, 0.f};
  c2 = Cand{0u, 0, 0.f};
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const unsigned kj = key[j];
    const bool live = !BOUNDED || kj < lk || (kj == lk && j > lj);
    if (live && kj > c1.k) {
      c2 = c1;
      c1 = Cand{kj, j, p[j]};
    } else if (live && kj > c2.k) {
      c2 = Cand{kj, j, p[j]};
    }
  }
}

/* Step 3: whether this lane's group is among the TG best (select_groups: a
 * group's score is its best, or best two, summed; groups rank by order_key,
 * the lower index on ties; a NaN score is never kept). The lane's best two
 * selection scores are those of its top-2 candidates (c1, c2). */
__device__ __forceinline__ bool fast_group_kept(const FastArgs &a, const Cand &c1, const Cand &c2,
                                                int lane) {
  const int L = 32 / a.G; /* lanes per group, a power of two */
  float b1 = key_value(c1.k), b2 = key_value(c2.k);
  for (int o = L >> 1; o > 0; o >>= 1) {
    const float d1 = __shfl_xor_sync(kFull, b1, o), d2 = __shfl_xor_sync(kFull, b2, o);
    const float hi = fmaxf(b1, d1), lo = fmaxf(fminf(b1, d1), fmaxf(b2, d2));
    b1 = hi;
    b2 = lo;
  }
  const unsigned gk = order_key(a.group_top == 1 ? b1 : b1 + b2);
  const int g = lane / L;
  int ahead = 0;
  for (int h = 0; h < a.G; ++h) {
    const unsigned hk = __shfl_sync(kFull, gk, h * L);
    ahead += (hk > gk || (hk == gk && h < g)) ? 1 : 0;
  }
  return gk != 0u && ahead < a.TG;
}

/* Steps 4-5: K rounds of warp arg-max over the lanes' best candidates
 * (larger key, then lower expert). The lanes that hold the best key tie
 * only when their experts' scores are equal, and the lowest such lane
 * holds the lowest expert (lanes own consecutive experts; a lane's best is
 * its lowest on ties), so a ballot finds the winner: no second reduction.
 * The winner moves its second candidate up and rescans (for its next two)
 * only when it has no second known, at its 3rd, 5th, ... win: a rescan at
 * every win was most of a round's instructions. Lane k ends with route k's
 * expert (-1: none) and base weight; returns S, the base weights summed in
 * k order. */
template <int V, int SCORE>
__device__ __forceinline__ float fast_topk(const FastArgs &a, const unsigned (&key)[V],
                                           const float (&p)[V], Cand c1, Cand c2, int lane,
                                           int &my_e, float &my_b) {
  bool have2 = true; /* c2 is this lane's next entry (or none: k 0) */
  float S = 0.f;
  my_e = -1;
  my_b = 0.f;
  for (int k = 0; k < a.K; ++k) {
    const unsigned best = __reduce_max_sync(kFull, c1.k);
    const int src = __ffs(__ballot_sync(kFull, c1.k == best)) - 1;
    const int j = __shfl_sync(kFull, c1.j, src);
    float v = __shfl_sync(kFull, c1.p, src);
    const int e = best == 0u ? -1 : src * V + j;
    if (e < 0) v = 0.f;
    if (lane == k) {
      my_e = e;
      my_b = v;
    }
    S += v;
    if (e >= 0 && lane == src) {
      if (have2) {
        c1 = c2;
        have2 = false;
      } else {
        fast_lane_top2<V, true>(key, p, c1.k, c1.j, c1, c2);
        have2 = true;
      }
    }
  }
  if constexpr (SCORE == EPX_SCORE_SOFTMAX_AFTER_TOPK) {
    /* base_weights: the softmax of the K chosen logits, summed in k order. */
    const float mx = warp_max(lane < a.K ? my_b : -INFINITY);
    const float ex = expf(my_b - mx);
    float sum = 0.f;
    for (int k = 0; k < a.K; ++k) sum += __shfl_sync(kFull, ex, k);
    my_b = ex / sum;
    S = 0.f;
    for (int k = 0; k < a.K; ++k) S += __shfl_sync(kFull, my_b, k);
  }
  return S;
}

/* Blocks per SM asked of ptxas: 5 (at most 48 registers: 40 warps) at E =
 * 256, where the top-2 cache took softmax after top-k from 40 to 59
 * registers (32 warps) and the other scores fit without spilling; not for
 * sqrt-softplus (its double log1p would spill) nor E = 512 (it spills). */
template <int V, int SCORE>
constexpr int fast_min_blocks() {
  return V == 8 && SCORE != EPX_SCORE_SQRT_SOFTPLUS ? 5 : 1;
}

template <int V, int SCORE>
__global__ void __launch_bounds__(kFastWarps * 32, (fast_min_blocks<V, SCORE>()))
    route_fast_kernel(const FastArgs a, int pdl_early) {
  pdl_begin(pdl_early != 0);
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * kFastWarps + (threadIdx.x >> 5);
  if (t >= a.T) return; /* whole warps */
  int32_t *idx = a.idx + (size_t)t * a.K;
  float *w = a.w + (size_t)t * a.K;
  float x[V];
  load_lane<V>(a.logits + (size_t)t * a.E + (size_t)lane * V, x);
  bool fin = true;
#pragma unroll
  for (int j = 0; j < V; ++j) fin &= isfinite(x[j]) != 0;
  const bool real = !a.mask || a.mask[t] != 0;
  if (!__all_sync(kFull, fin) || !real) {
    /* Masked, or non-finite and dropped: routes nowhere. */
    if (lane < a.K) {
      idx[lane] = -1;
      w[lane] = 0.f;
    }
    return;
  }
  float p[V];
  fast_scores<V, SCORE>(x, p);
  unsigned key[V];
  if (a.bias) {
    float b[V];
    load_lane<V>(a.bias + (size_t)lane * V, b);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = p[j] + b[j];
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = p[j];
  }
#pragma unroll
  for (int j = 0; j < V; ++j) key[j] = order_key(x[j]);
  Cand c1, c2;
  fast_lane_top2<V, false>(key, p, 0u, 0, c1, c2);
  if (a.G > 1 && !fast_group_kept(a, c1, c2, lane)) {
    /* The lane's group is out: it never wins, so never rescans its keys. */
    c1.k = 0u;
    c2.k = 0u;
  }
  int e;
  float b;
  const float S = fast_topk<V, SCORE>(a, key, p, c1, c2, lane, e, b);
  if (lane < a.K) {
    /* emit_routes' weight, and assign's -1 / 0 for no expert. */
    const float wk = (a.renorm ? (S > 0.f ? b / S : 0.f) : b) * a.scale;
    idx[lane] = e;
    w[lane] = e >= 0 ? wk : 0.f;
    if (e >= 0 && a.counts) atomicAdd(a.counts + e, 1);
  }
}

template <int V, int SCORE>
cudaError_t launch_fast(const FastArgs &a, cudaStream_t stream) {
  const unsigned blocks = (unsigned)((a.T + kFastWarps - 1) / kFastWarps);
  const int early = (epx_cuda_launch_flags() & EPX_CUDA_PDL_ROUTE_EARLY) != 0;
  return launch_pdl(route_fast_kernel<V, SCORE>, blocks, kFastWarps * 32, 0, stream, a, early);
}

template <int V>
cudaError_t launch_fast_v(const FastArgs &a, cudaStream_t stream) {
  switch (a.score_fn) {
    case EPX_SCORE_SOFTMAX: return launch_fast<V, EPX_SCORE_SOFTMAX>(a, stream);
    case EPX_SCORE_SIGMOID: return launch_fast<V, EPX_SCORE_SIGMOID>(a, stream);
    case EPX_SCORE_SQRT_SOFTPLUS: return launch_fast<V, EPX_SCORE_SQRT_SOFTPLUS>(a, stream);
    case EPX_SCORE_SOFTMAX_AFTER_TOPK: return launch_fast<V, EPX_SCORE_SOFTMAX_AFTER_TOPK>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" cudaError_t epx_cuda_route_fast_launch(const epx_cuda_route_fast_args_t *a,
                                                  cudaStream_t stream) {
  if (a->T <= 0) return cudaSuccess;
  switch (a->E) {
    case 32: return launch_fast_v<1>(*a, stream);
    case 64: return launch_fast_v<2>(*a, stream);
    case 128: return launch_fast_v<4>(*a, stream);
    case 256: return launch_fast_v<8>(*a, stream);
    case 512: return launch_fast_v<16>(*a, stream);
    default: return cudaErrorInvalidValue;
  }
}
