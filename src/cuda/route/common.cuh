/* Device helpers of the routing kernels (route/forward.cu, route/backward.cu):
 * warp reductions, order keys, and the per-token scores and selection
 * (steps 1-5 of src/core/route_spec.h). Included by .cu files only. */
#ifndef EPX_CUDA_ROUTE_COMMON_CUH
#define EPX_CUDA_ROUTE_COMMON_CUH

#include <climits>
#include <cmath>
#include <cstdint>

#include "core/route_spec.h"
#include "cuda/common/device_cache.h"
#include "cuda/launch.h"

namespace route_dev {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kTokenWarps = EPX_CUDA_ROUTE_MAX_TOKEN_WARPS;
constexpr int kWarps = EPX_CUDA_ROUTE_WARPS;

typedef epx_cuda_select_args_t SelectArgs;

struct TokenState {
  float m;      /* max logit */
  float sumexp; /* sum_e exp(l - m) (softmax, or with need_lse) */
  float psum;   /* sum_e p (sigmoid, sqrt-softplus) */
  float S;      /* sum of the base weights in k order */
};

/* One pad word every 32 so that lane-strided and group-strided accesses of
 * a warp's arrays fall in distinct banks. */
__device__ __forceinline__ int pad(int i) { return i + (i >> 5); }

/* Marks an entry as out of the running: NaN never compares greater or equal. */
__device__ __forceinline__ float removed() { return __int_as_float(0x7fffffff); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

/* A 32-bit key that orders like the float (larger value, larger key); 0
 * for removed (NaN) entries, which never win. -0 counts as +0, as it
 * compares equal. */
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned u = __float_as_uint(v + 0.0f);
  return isnan(v) ? 0u : ((u & 0x80000000u) ? ~u : (u | 0x80000000u));
}

/* 2^(i/64), i = 0..63, rounded to double (sigmoid_f32_try's table). */
static __device__ const double kExp2Sixtyfourths[64] = {
    0x1.0000000000000p+0, 0x1.02c9a3e778061p+0, 0x1.059b0d3158574p+0, 0x1.0874518759bc8p+0,
    0x1.0b5586cf9890fp+0, 0x1.0e3ec32d3d1a2p+0, 0x1.11301d0125b51p+0, 0x1.1429aaea92de0p+0,
    0x1.172b83c7d517bp+0, 0x1.1a35beb6fcb75p+0, 0x1.1d4873168b9aap+0, 0x1.2063b88628cd6p+0,
    0x1.2387a6e756238p+0, 0x1.26b4565e27cddp+0, 0x1.29e9df51fdee1p+0, 0x1.2d285a6e4030bp+0,
    0x1.306fe0a31b715p+0, 0x1.33c08b26416ffp+0, 0x1.371a7373aa9cbp+0, 0x1.3a7db34e59ff7p+0,
    0x1.3dea64c123422p+0, 0x1.4160a21f72e2ap+0, 0x1.44e086061892dp+0, 0x1.486a2b5c13cd0p+0,
    0x1.4bfdad5362a27p+0, 0x1.4f9b2769d2ca7p+0, 0x1.5342b569d4f82p+0, 0x1.56f4736b527dap+0,
    0x1.5ab07dd485429p+0, 0x1.5e76f15ad2148p+0, 0x1.6247eb03a5585p+0, 0x1.6623882552225p+0,
    0x1.6a09e667f3bcdp+0, 0x1.6dfb23c651a2fp+0, 0x1.71f75e8ec5f74p+0, 0x1.75feb564267c9p+0,
    0x1.7a11473eb0187p+0, 0x1.7e2f336cf4e62p+0, 0x1.82589994cce13p+0, 0x1.868d99b4492edp+0,
    0x1.8ace5422aa0dbp+0, 0x1.8f1ae99157736p+0, 0x1.93737b0cdc5e5p+0, 0x1.97d829fde4e50p+0,
    0x1.9c49182a3f090p+0, 0x1.a0c667b5de565p+0, 0x1.a5503b23e255dp+0, 0x1.a9e6b5579fdbfp+0,
    0x1.ae89f995ad3adp+0, 0x1.b33a2b84f15fbp+0, 0x1.b7f76f2fb5e47p+0, 0x1.bcc1e904bc1d2p+0,
    0x1.c199bdd85529cp+0, 0x1.c67f12e57d14bp+0, 0x1.cb720dcef9069p+0, 0x1.d072d4a07897cp+0,
    0x1.d5818dcfba487p+0, 0x1.da9e603db3285p+0, 0x1.dfc97337b9b5fp+0, 0x1.e502ee78b3ff6p+0,
    0x1.ea4afa2a490dap+0, 0x1.efa1bee615a27p+0, 0x1.f50765b6e4540p+0, 0x1.fa7c1819e90d8p+0,
};

/* Step 1's float32 sigmoid, epx_route_sigmoid_f32(l) bit for bit, in about
 * half its instructions (its double exp and division were a large share of
 * route_fast's instructions). Returns the float32 rounding of
 * y, an approximation of the sigmoid, and sets redo when y lies within
 * kNear double ulps of a float32 rounding midpoint or below float32's
 * normal range (or l is NaN); then the caller must take
 * epx_route_sigmoid_f32(l) instead. Otherwise the two agree: y and the
 * exact sigmoid differ by < 2^-44 y, i.e. < 2^9 ulps of y (e^r by Taylor to
 * r^4 on |r| <= 0.00547, < 4.1e-14; c3 = 1/6 to 21 bits, < 6.6e-15; r from
 * ln2/64 rounded, < 9.2e-15; the reciprocal's cubic step, e0^3 with
 * rcp.approx's error e0, ~2^-20 as it reads the high word; roundings), and
 * epx_route_sigmoid_f32's double and the exact one by < 4 ulps (CUDA's exp
 * is within 1 ulp, the add and the division round once), so no midpoint
 * lies between y and that double: both round to the same float.
 * bench/gpu/bench_route.cu checks all 2^32 inputs (0 differ on an H200).
 * Redo rate: at most 2 kNear / 2^29 = 2^-16 per score in (-87, 60).
 * Clamping l to [-105, 60] keeps every result: sigmoid(60) rounds to 1 and
 * sigmoid(-105) < 2^-150 to 0 (taken by redo, as below 2^-126); NaN clamps
 * to -105 and takes redo too. */
constexpr unsigned kNear = 4096u;

__device__ __forceinline__ float sigmoid_f32_try(float l, bool &redo) {
  const double z = -(double)fminf(fmaxf(l, -105.0f), 60.0f);
  /* n = rint(z 64 / ln2) (the factor to 21 bits: n may be off by one from
   * the nearest, which |r| <= 0.00547 allows), r = z - n ln2 / 64 */
  const double t = fma(z, 0x1.71547p+6, 0x1.8p52);
  const int n = __double2loint(t);
  const double r = fma(t - 0x1.8p52, -0x1.62e42fefa39efp-7, z);
  /* e^z = 2^(n >> 6) 2^((n & 63) / 64) e^r; n >> 6 in [-87, 151] */
  const double tab = __ldg(kExp2Sixtyfourths + (n & 63));
  const double s = __hiloint2double(__double2hiint(tab) + (n >> 6) * (1 << 20), __double2loint(tab));
  const double er = fma(fma(fma(fma(0x1.55555p-5, r, 0x1.55555p-3), r, 0.5), r, 1.0), r, 1.0);
  const double d = fma(er, s, 1.0); /* 1 + e^z in [1, 2^152] */
  double y0;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(y0) : "d"(d));
  double e = fma(-d, y0, 1.0); /* y = y0 (1 + e + e^2): error e^3 */
  e = fma(e, e, e);
  const double y = fma(e, y0, y0);
  /* float32 rounding by bits: the 29 bits below float32's last one against
   * the midpoint 2^28 (y > 0; the exponent rebiased 1023 -> 127) */
  const unsigned long long bits = (unsigned long long)__double_as_longlong(y);
  const unsigned lo = (unsigned)bits, hi = (unsigned)(bits >> 32);
  redo = ((lo + (kNear - 0x10000000u)) & 0x1fffffffu) < 2u * kNear || hi < 0x38100000u;
  return __uint_as_float((unsigned)((bits + 0x10000000ull - 0x3800000000000000ull) >> 29));
}

/* epx_route_sigmoid_f32 of V scores: sigmoid_f32_try, then the exact
 * double expression for the few it cannot vouch for (a branch that a
 * warp takes for at most ~1 token in 250 at E = 256). */
template <int V>
__device__ __forceinline__ void sigmoid_f32_v(const float (&x)[V], float (&p)[V]) {
  unsigned redo = 0u;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    bool r;
    p[j] = sigmoid_f32_try(x[j], r);
    redo |= r ? 1u << j : 0u;
  }
  if (redo) {
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (redo & (1u << j)) p[j] = epx_route_sigmoid_f32(x[j]);
  }
}

/* The best entry among a[lane], a[lane + 32], ... below n: its key and
 * index (0, INT_MAX when there is none). Lower index on ties. */
__device__ inline void lane_best(const float *a, int n, int lane, unsigned &bk, int &bi) {
  bk = 0u;
  bi = INT_MAX;
  for (int i = lane; i < n; i += 32) {
    const unsigned k = order_key(a[pad(i)]);
    if (k > bk) {
      bk = k;
      bi = i;
    }
  }
}

/* The warp's best entry (larger value, then lower index), the same on every
 * lane; -1 when no lane has one. */
__device__ __forceinline__ int warp_argmax(unsigned key, int index) {
  const unsigned best = __reduce_max_sync(kFull, key);
  const unsigned win = __reduce_min_sync(kFull, key == best ? (unsigned)index : 0xffffffffu);
  return best == 0u ? -1 : (int)win;
}

/* Group of expert e (groups of gs experts). */
__device__ __forceinline__ int group_of(const SelectArgs &a, int e, int gs) {
  return a.gmagic ? (int)__umulhi((unsigned)e, a.gmagic) : (gs == 1 ? e : e / gs);
}

/* The token of warp w of this block: blocks in token order, or aligned to
 * sequences (each block within one sequence). -1: none. */
__device__ __forceinline__ long long token_of(const SelectArgs &a, int w, int W) {
  if (a.seqs <= 1) {
    const long long t = (long long)blockIdx.x * W + w;
    return t < a.T ? t : -1;
  }
  const int b = blockIdx.x / a.seq_blocks, j = blockIdx.x % a.seq_blocks;
  const long long pos = (long long)j * W + w;
  return pos < a.seq_len ? pos * a.seqs + b : -1;
}

/* Whether token t is real and every logit finite (warp-uniform); *real
 * tells a masked token from a non-finite one. */
__device__ inline bool row_valid(const SelectArgs &a, int t, int lane, bool *real) {
  *real = !a.mask || a.mask[t] != 0;
  if (!*real) return false;
  const float *row = a.logits + (size_t)t * a.E;
  int fin = 1;
  for (int e = lane; e < a.E; e += 32) fin &= isfinite(row[e]) ? 1 : 0;
  return __all_sync(kFull, fin) != 0;
}

/* Sum of the n best of Y over group g (value, then lower index), best
 * first, by one lane: Megatron's group score for n > 2. */
__device__ inline float group_top_n(const float *Y, int g, int gs, int n) {
  float sum = 0.f, pv = INFINITY;
  int pi = -1;
  for (int j = 0; j < n; ++j) {
    float bv = -INFINITY;
    int bi = -1;
    for (int i = 0; i < gs; ++i) {
      const float v = Y[pad(g * gs + i)];
      const bool after = v < pv || (v == pv && i > pi); /* worse than the previous pick */
      if (after && (bi < 0 || v > bv)) {
        bv = v;
        bi = i;
      }
    }
    sum += bv;
    pv = bv;
    pi = bi;
  }
  return sum;
}

/* Step 3: group scores into Gs, the topk_groups best kept, the other groups'
 * experts removed from Y. */
__device__ inline void select_groups(const SelectArgs &a, float *Y, float *Gs, int lane) {
  const int E = a.E, gs = E / a.G, L = a.glanes, sub = lane & (L - 1);
  if (a.group_top <= 2) {
    /* The glanes lanes of a group each take every glanes-th expert, then
     * merge their top-2 pairs. */
    for (int g0 = 0; g0 < a.G; g0 += 32 / L) {
      const int g = g0 + lane / L;
      float b1 = -INFINITY, b2 = -INFINITY;
      if (g < a.G) {
        for (int i = sub; i < gs; i += L) {
          const float v = Y[pad(g * gs + i)];
          if (v > b1) {
            b2 = b1;
            b1 = v;
          } else if (v > b2) {
            b2 = v;
          }
        }
      }
      for (int o = L >> 1; o > 0; o >>= 1) {
        const float c1 = __shfl_xor_sync(kFull, b1, o), c2 = __shfl_xor_sync(kFull, b2, o);
        const float hi = fmaxf(b1, c1), lo = fmaxf(fminf(b1, c1), fmaxf(b2, c2));
        b1 = hi;
        b2 = lo;
      }
      if (g < a.G && sub == 0) Gs[pad(g)] = a.group_top == 1 ? b1 : b1 + b2;
    }
  } else {
    for (int g = lane; g < a.G; g += 32) Gs[pad(g)] = group_top_n(Y, g, gs, a.group_top);
  }
  __syncwarp();
  /* The topk_groups best groups: a bit each in `kept` (G <= 32), or marked
   * removed() in Gs; the other groups' experts are excluded. */
  unsigned gk, kept = 0u;
  int gi;
  lane_best(Gs, a.G, lane, gk, gi);
  for (int r = 0; r < a.TG; ++r) {
    const int g = warp_argmax(gk, gi);
    if (g < 0) break;
    if (a.G <= 32) kept |= 1u << g;
    if (lane == (g & 31)) {
      Gs[pad(g)] = removed();
      lane_best(Gs, a.G, lane, gk, gi);
    }
  }
  __syncwarp();
  for (int e = lane; e < E; e += 32) {
    const int g = group_of(a, e, gs);
    const bool keep = a.G <= 32 ? ((kept >> g) & 1u) != 0u : isnan(Gs[pad(g)]);
    if (!keep) Y[pad(e)] = removed();
  }
  __syncwarp();
}

/* The K best of Y (K rounds of warp arg-max; a lane rescans only when it
 * loses its best), removing them from Y: CI [K] and CP [K] = X of each. */
__device__ inline void select_topk(const float *X, float *Y, int E, int K, int *CI, float *CP,
                                   int lane) {
  unsigned bk;
  int bi;
  lane_best(Y, E, lane, bk, bi);
  for (int k = 0; k < K; ++k) {
    const int e = warp_argmax(bk, bi);
    if (lane == 0) {
      CI[k] = e;
      CP[k] = e >= 0 ? X[pad(e)] : 0.f;
    }
    if (e >= 0 && lane == (e & 31)) {
      Y[pad(e)] = removed();
      lane_best(Y, E, lane, bk, bi);
    }
  }
  __syncwarp();
}

/* Step 1 into X (p; the logits for softmax after top-k) and Y (selection
 * scores); returns the max logit and fills sumexp / psum. */
__device__ inline void token_scores(const SelectArgs &a, float *X, float *Y, float m, int lane,
                                    float &sumexp, float &psum) {
  const int E = a.E;
  sumexp = 0.f;
  psum = 0.f;
  for (int e = lane; e < E; e += 32) {
    const float l = X[pad(e)];
    float p;
    switch (a.score_fn) {
      case EPX_SCORE_SOFTMAX: p = expf(l - m); sumexp += p; break;
      case EPX_SCORE_SIGMOID: p = epx_route_sigmoid_f32(l); break;
      case EPX_SCORE_SQRT_SOFTPLUS: p = epx_route_sqrt_softplus_f32(l); break;
      default: p = l; break;
    }
    if (a.score_fn != EPX_SCORE_SOFTMAX && a.need_lse) sumexp += expf(l - m);
    psum += p;
    X[pad(e)] = p;
  }
  sumexp = warp_sum(sumexp);
  psum = warp_sum(psum);
  for (int e = lane; e < E; e += 32) {
    float p = X[pad(e)];
    if (a.score_fn == EPX_SCORE_SOFTMAX) X[pad(e)] = p = p / sumexp;
    Y[pad(e)] = a.bias ? p + a.bias[e] : p;
  }
  __syncwarp();
}

/* Step 5's base weights in CP (the softmax of the chosen logits after
 * top-k) and their sum S in k order; by lane 0, in the CPU's order. */
__device__ inline float base_weights(const SelectArgs &a, float *CP, int lane) {
  float S = 0.f;
  if (lane == 0) {
    if (a.score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK) {
      float mx = CP[0], sum = 0.f;
      for (int k = 1; k < a.K; ++k) mx = fmaxf(mx, CP[k]);
      for (int k = 0; k < a.K; ++k) sum += (CP[k] = expf(CP[k] - mx));
      for (int k = 0; k < a.K; ++k) CP[k] = CP[k] / sum;
    }
    for (int k = 0; k < a.K; ++k) S += CP[k];
  }
  __syncwarp();
  return __shfl_sync(kFull, S, 0);
}

/* Steps 1-5 for token t. Returns false, with nothing else computed, when a
 * logit is not finite. On return X holds p (logits after top-k), CI/CP the
 * K choices best first and their base weights, and st the token's sums. */
__device__ inline bool token_select(const SelectArgs &a, int t, float *X, float *Y, float *Gs,
                                    int *CI, float *CP, int lane, TokenState &st) {
  const float *row = a.logits + (size_t)t * a.E;
  float m = -INFINITY;
  int fin = 1;
#pragma unroll 4
  for (int e = lane; e < a.E; e += 32) {
    float l = row[e];
    fin &= isfinite(l) ? 1 : 0;
    m = fmaxf(m, l);
    X[pad(e)] = l;
  }
  if (!__all_sync(kFull, fin)) return false;
  m = warp_max(m);
  token_scores(a, X, Y, m, lane, st.sumexp, st.psum);
  if (a.G > 1) select_groups(a, Y, Gs, lane);
  select_topk(X, Y, a.E, a.K, CI, CP, lane);
  st.m = m;
  st.S = base_weights(a, CP, lane);
  return true;
}

/* q of the aux loss from X into Q: p, p / sum p, or the softmax of the
 * logits after top-k. */
__device__ inline void aux_scores(const SelectArgs &a, const float *X, float *Q,
                                  const TokenState &st, int lane) {
  for (int e = lane; e < a.E; e += 32) {
    const float x = X[pad(e)];
    float q;
    switch (a.score_fn) {
      case EPX_SCORE_SOFTMAX: q = x; break;
      case EPX_SCORE_SOFTMAX_AFTER_TOPK: q = expf(x - st.m) / st.sumexp; break;
      default: q = st.psum > 0.f ? x / st.psum : 0.f; break;
    }
    Q[pad(e)] = q;
  }
  __syncwarp();
}

__device__ __forceinline__ int queue_index(int by_token, int t, int k, int T, int K) {
  return by_token ? t * K + k : k * T + t;
}

__device__ __forceinline__ size_t output_index(int by_token, int r, int T, int K) {
  int t, k;
  if (by_token) {
    t = r / K;
    k = r - t * K;
  } else {
    k = r / T;
    t = r - k * T;
  }
  return (size_t)t * K + k;
}

/* Warps per block (at most max_warps) of a kernel whose warps each need
 * per_warp bytes of dynamic shared memory, and the block's bytes; raises the
 * kernel's dynamic limit when one warp needs more than the default 48 KB
 * (less a 1 KB reserve for the kernels' static shared memory). */
static inline cudaError_t smem_fit(const void *kernel, size_t per_warp, int max_warps, int *warps,
                                   size_t *bytes) {
  const size_t default_smem = 48 * 1024, static_smem = 1024;
  size_t w = (default_smem - static_smem) / per_warp;
  if (w > (size_t)max_warps) w = (size_t)max_warps;
  if (w >= 1) {
    *warps = (int)w;
    *bytes = w * per_warp;
    return cudaSuccess;
  }
  int device = 0;
  epx_cuda_device_info_t info; /* both cached per device (device_cache.h) */
  cudaError_t err = epx_cuda_device_info(&device, &info);
  if (err != cudaSuccess) return err;
  if (per_warp + static_smem > (size_t)info.smem_optin) return cudaErrorInvalidValue;
  err = epx_cuda_kernel_smem(kernel, device, per_warp);
  if (err != cudaSuccess) return err;
  *warps = 1;
  *bytes = per_warp;
  return cudaSuccess;
}

static_assert(kTokenWarps * (sizeof(int) + sizeof(double)) <= 1024,
              "the token kernels' static shared memory exceeds smem_fit's reserve");

}  // namespace route_dev

#endif
