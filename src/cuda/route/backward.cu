/* The routing backward kernel behind launch.h: a warp per token recomputes
 * the selection (route/common.cuh) and writes the token's grad_logits row
 * through the weights (renormalised before or after the drop, scaled), the
 * aux loss (F fixed) and the z loss. The counts F and the valid tokens come
 * from a forward-kernel pass the host glue (route.c) runs first. */
#include <cuda_runtime.h>

#include "cuda/route/common.cuh"

using namespace route_dev;

typedef epx_cuda_route_bwd_args_t BackwardArgs;

namespace {

__device__ __forceinline__ float backward_grad_w(const BackwardArgs &a, int t, int k) {
  const size_t i = (size_t)t * a.s.K + k;
  if (!a.grad_w || (a.topk_idx && a.topk_idx[i] < 0)) return 0.f;
  return a.grad_w[i];
}

__device__ __forceinline__ bool backward_kept(const BackwardArgs &a, int t, int k) {
  return !a.topk_idx || a.topk_idx[(size_t)t * a.s.K + k] >= 0;
}

/* d loss / d (p or, after top-k, logits) of the token's weights into Y:
 * w_k = scale * b_k / S (renormalised; S over the K chosen, or the kept
 * after the drop) or scale * b_k. */
__device__ void weight_grads(const BackwardArgs &a, int t, const int *CI, const float *CP,
                             const TokenState &st, float *Y, int lane) {
  const int K = a.s.K;
  float S = st.S, dot = 0.f;
  if (a.renorm_after) {
    S = 0.f;
    for (int k = 0; k < K; ++k) S += backward_kept(a, t, k) ? CP[k] : 0.f; /* k order, as on the CPU */
  }
  const bool wgrad = !a.renorm || S > 0.f; /* weights were 0 when S underflowed */
  if (a.renorm && wgrad) {
    for (int k = lane; k < K; k += 32) dot += backward_grad_w(a, t, k) * CP[k];
    dot = warp_sum(dot);
  }
  for (int e = lane; e < a.s.E; e += 32) Y[pad(e)] = 0.f;
  __syncwarp();
  /* gb_k, then through b: p_e directly, or the softmax of the chosen logits. */
  float gbb = 0.f;
  for (int k = lane; k < K; k += 32) {
    const float g = backward_grad_w(a, t, k);
    const bool in_sum = !a.renorm_after || backward_kept(a, t, k);
    const float gb = !wgrad ? 0.f
                     : a.renorm ? (in_sum ? a.scale * (g / S - dot / (S * S)) : 0.f)
                                : a.scale * g;
    gbb += gb * CP[k];
    if (CI[k] >= 0) Y[pad(CI[k])] = gb;
  }
  __syncwarp();
  if (a.s.score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK) {
    gbb = warp_sum(gbb);
    for (int k = lane; k < K; k += 32)
      if (CI[k] >= 0) Y[pad(CI[k])] = CP[k] * (Y[pad(CI[k])] - gbb);
    __syncwarp();
  }
}

}  // namespace

static __global__ void __launch_bounds__(kTokenWarps * 32) route_backward_kernel(BackwardArgs a) {
  if (a.bad && *a.bad) return;
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
  const SelectArgs &s = a.s;
  const long long tl = token_of(s, w, W);
  if (tl < 0) return;
  const int t = (int)tl, E = s.E;
  float *X = smem + (size_t)w * s.words;
  float *Y = X + s.y, *Gs = X + s.g, *CP = X + s.cp;
  int *CI = reinterpret_cast<int *>(X + s.ci);
  float *grow = a.grad + (size_t)t * E;
  TokenState st;
  if ((s.mask && !s.mask[t]) || !token_select(s, t, X, Y, Gs, CI, CP, lane, st)) {
    for (int e = lane; e < E; e += 32) grow[e] = 0.f;
    return;
  }
  weight_grads(a, t, CI, CP, st, Y, lane);
  const bool after = s.score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK;
  const bool normed = s.score_fn == EPX_SCORE_SIGMOID || s.score_fn == EPX_SCORE_SQRT_SOFTPLUS;
  const float *row = s.logits + (size_t)t * E;
  /* softmax of the logits: p for softmax, else from the token's sums. */
#define EPX_ROUTE_SOFTMAX_OF(e, x) \
  (s.score_fn == EPX_SCORE_SOFTMAX ? (x) : expf(row[e] - st.m) / st.sumexp)
  float sig = 0.f;
  if (s.score_fn == EPX_SCORE_SOFTMAX) {
    for (int e = lane; e < E; e += 32) sig += X[pad(e)] * Y[pad(e)];
    sig = warp_sum(sig);
  }

  const int tv = (a.aux_scale != 0.0 || a.z_scale != 0.0) ? *a.valid : 0;
  const bool aux = a.aux_scale != 0.0 && tv > 0;
  const bool zl = a.z_scale != 0.0 && tv > 0;
  /* aux: d/dq[t,e] = A_e = aux_scale * E * F[b(t), e] / D. */
  const int b = s.seqs > 1 ? t % s.seqs : 0;
  float ca = 0.f, beta = 0.f;
  if (aux) {
    ca = (float)(a.aux_scale * E /
                 epx_route_aux_denominator_of(a.aux_k, (double)tv, s.seqs, a.aux_tokens));
    float part = 0.f;
    for (int e = lane; e < E; e += 32) {
      const float F = a.aux_global ? a.aux_global[e] : (float)a.counts[(size_t)b * E + e];
      const float q = after ? EPX_ROUTE_SOFTMAX_OF(e, 0.f) : X[pad(e)];
      part += q * (ca * F);
    }
    beta = warp_sum(part);
    if (normed) beta = st.psum > 0.f ? beta / st.psum : 0.f;
  }
  /* z: d/dl[t,e] = z_scale * 2 lse softmax(l)_e / Tv. */
  float cz = 0.f;
  if (zl) cz = (float)(2.0 * a.z_scale * ((double)st.m + log((double)st.sumexp)) / tv);
  for (int e = lane; e < E; e += 32) {
    const float p = X[pad(e)], gp = Y[pad(e)];
    float dp = 1.f; /* d p / d l of the elementwise scores */
    if (s.score_fn == EPX_SCORE_SIGMOID) dp = p * (1.f - p);
    if (s.score_fn == EPX_SCORE_SQRT_SOFTPLUS)
      dp = p > 0.f ? (row[e] > EPX_SOFTPLUS_THRESHOLD ? 1.f : 1.f / (1.f + expf(-row[e]))) / (2.f * p)
                   : 0.f;
    float gl = s.score_fn == EPX_SCORE_SOFTMAX ? p * (gp - sig) : after ? gp : gp * dp;
    if (aux) {
      const float A = ca * (a.aux_global ? a.aux_global[e] : (float)a.counts[(size_t)b * E + e]);
      if (s.score_fn == EPX_SCORE_SOFTMAX) gl += p * (A - beta);
      else if (after) gl += EPX_ROUTE_SOFTMAX_OF(e, 0.f) * (A - beta);
      else if (st.psum > 0.f) gl += (A - beta) / st.psum * dp;
    }
    if (zl) gl += cz * EPX_ROUTE_SOFTMAX_OF(e, p);
    grow[e] = gl;
  }
#undef EPX_ROUTE_SOFTMAX_OF
}

extern "C" cudaError_t epx_cuda_route_backward_plan(size_t per_warp, int max_warps, int *warps,
                                                    size_t *bytes) {
  return smem_fit((const void *)route_backward_kernel, per_warp, max_warps, warps, bytes);
}

extern "C" cudaError_t epx_cuda_route_backward_launch(const epx_cuda_route_bwd_args_t *a, int blocks,
                                                      int warps, size_t smem, cudaStream_t stream) {
  route_backward_kernel<<<blocks, warps * 32, smem, stream>>>(*a);
  return cudaGetLastError();
}
