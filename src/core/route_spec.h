/* The routing spec, written once: what every router (the CPU fast path
 * src/cpu/route.c, the CUDA kernels of src/cuda/route/, the float64
 * reference src/cpu/route_reference.c and tools/epx-bench) computes the same
 * way. Usable from C and from CUDA device code (plain inline functions, no
 * library calls but ceil/ceilf and the double exp/log1p/sqrt of the scores).
 *
 * Per token t with finite logits l[E] that the token mask keeps:
 *  1. scores p[E]: softmax(l) (EPX_SCORE_SOFTMAX), sigmoid(l), or
 *     sqrt(softplus(l)) with torch's softplus (l > 20: l).
 *     EPX_SCORE_SOFTMAX_AFTER_TOPK selects on l itself.
 *  2. selection scores s[e] = p32[e] (l[e] after top-k) + bias[e] if a bias,
 *     added in float32: selection compares float32 numbers, as the peers
 *     (torch, float32 scores) do. p32 is the float32 rounding of the exact
 *     score: sigmoid and sqrt-softplus by epx_route_sigmoid_f32 /
 *     epx_route_sqrt_softplus_f32 below (double, rounded once, so every
 *     backend and the reference get the same bits but where the exact score
 *     lies within 2^-29 of a float32 rounding boundary); softmax's float32
 *     sum depends on the summation order, so for softmax the backends agree
 *     with the reference's (float)p only away from float32 ties.
 *     Why float32: float32 scores tie where float64 ones do not (a sigmoid
 *     of 0.9454 plus a bias of 0.010 equals one of 0.9514 plus 0.004 in
 *     float32), and such ties are decided by the rule in step 4 everywhere.
 *  3. group-limited (num_groups > 1): a group's score is the float32 sum of
 *     its epx_route_group_top() best s, best first from 0 (all of them if
 *     the group is smaller); the topk_groups best groups are kept; the
 *     others' experts are out.
 *  4. top-k of s among the allowed experts, best first. Ties, everywhere in
 *     selection (experts and groups): the lower index wins.
 *  5. base weight b_k: p[chosen k], or for softmax-after-top-k the softmax
 *     of the K chosen logits. Weight before the drop:
 *     w_k = scale * (renormalize && !renormalize_after_drop ? b_k / S : b_k),
 *     S = sum_k b_k in k order (a zero S gives weight 0).
 *  6. capacity C (epx_route_capacity_f32 / _f64); each route's location is
 *     a running count per expert in queue order (by choice: every first
 *     choice before any second; by token: (t, k) in order).
 *  7. drop (capacity mode): per expert, the C routes that stay are the first
 *     C in queue order (by position) or the C best by the drop key
 *     (epx_route_drop_key) with ties to the earlier in queue order; the kept
 *     are located 0.. in queue order among themselves. Dropped: idx -1,
 *     w 0, location -1.
 *  8. with renormalize_after_drop: w_k = scale * b_k / S_kept over the kept
 *     routes of the token in k order (a zero S_kept gives 0).
 *  9. losses over the valid tokens (finite, unmasked), see epx.h.
 * Masked and (EPX_NONFINITE_DROP) non-finite tokens route nowhere and count
 * in no loss. */
#ifndef EPX_CORE_ROUTE_SPEC_H
#define EPX_CORE_ROUTE_SPEC_H

#include <stdint.h>

#include "epx.h"

#ifdef __CUDACC__
#define EPX_SPEC_FN static inline __host__ __device__
#else
#include <math.h>
#define EPX_SPEC_FN static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The softplus of torch (beta 1, threshold 20): above the threshold the
 * identity. */
#define EPX_SOFTPLUS_THRESHOLD 20.0f

/* Step 1's float32 sigmoid: the exact score rounded once (double exp, then
 * float32), so the CPU, the GPU and the reference select on the same bits. */
EPX_SPEC_FN float epx_route_sigmoid_f32(float l) {
  return (float)(1.0 / (1.0 + exp(-(double)l)));
}

/* Step 1's float32 sqrt(softplus(l)) with torch's threshold, rounded once. */
EPX_SPEC_FN float epx_route_sqrt_softplus_f32(float l) {
  const double x = (double)l;
  return (float)sqrt(l > EPX_SOFTPLUS_THRESHOLD ? x : log1p(exp(x)));
}

/* Capacity in float32 as torch computes DeepSpeed's _capacity,
 * torch.ceil((T / E) * torch.tensor(capacity_factor * K)): T/E and
 * factor*K are formed in double and each rounded once to float32 (a Python
 * float times a float32 tensor), the product and ceil in float32; then at
 * least min_capacity. The factor is a double, as the Python float is: a
 * float32 factor times K differs from it where K is not a power of two
 * (T=30, E=4, K=3, factor 1.2: f32(1.2 * 3) gives 27, f32(f32(1.2) * 3) 28). */
EPX_SPEC_FN int32_t epx_route_capacity_f32(int64_t num_tokens, int32_t num_experts, int32_t top_k,
                                           double capacity_factor, int32_t min_capacity) {
  const float per_expert = (float)((double)num_tokens / (double)num_experts);
  const float factor = (float)(capacity_factor * (double)top_k);
  const float product = per_expert * factor;
  const float cap = ceilf(product);
  int64_t c = cap >= 2147483647.0f ? INT32_MAX : (int64_t)cap;
  return (int32_t)(c < min_capacity ? min_capacity : c);
}

/* Capacity in double as Megatron's get_capacity computes it in Python:
 * ceil((T * K / E) * capacity_factor), then at least min_capacity. */
EPX_SPEC_FN int32_t epx_route_capacity_f64(int64_t num_tokens, int32_t num_experts, int32_t top_k,
                                           double capacity_factor, int32_t min_capacity) {
  const double cap = ceil((double)(num_tokens * top_k) / (double)num_experts * capacity_factor);
  int64_t c = cap >= 2147483647.0 ? INT32_MAX : (int64_t)cap;
  return (int32_t)(c < min_capacity ? min_capacity : c);
}

/* The factor of a config: capacity_factor_f64 when set (> 0; the only one
 * EPX_CAPACITY_FLOAT64 reads), else the float capacity_factor. */
EPX_SPEC_FN double epx_route_capacity_factor(const epx_route_config_t *c) {
  return c->capacity_factor_f64 > 0 ? c->capacity_factor_f64 : (double)c->capacity_factor;
}

/* C of a config in capacity mode (0 in dropless mode). */
EPX_SPEC_FN int32_t epx_route_capacity(const epx_route_config_t *c, int64_t num_tokens) {
  if (!c->capacity_mode) return 0;
  if (c->capacity_arithmetic == EPX_CAPACITY_FLOAT64)
    return epx_route_capacity_f64(num_tokens, c->num_experts, c->top_k, c->capacity_factor_f64,
                                  c->min_capacity);
  return epx_route_capacity_f32(num_tokens, c->num_experts, c->top_k,
                                epx_route_capacity_factor(c), c->min_capacity);
}

/* Experts summed into a group's score (step 3). */
EPX_SPEC_FN int32_t epx_route_group_top(int32_t group_score_experts, int32_t group_size) {
  const int32_t n = group_score_experts > 0 ? group_score_experts : 2;
  return n < group_size ? n : group_size;
}

/* The seeded priority of route (t, k) for EPX_DROP_BY_RANDOM_PRIORITY: 24
 * bits of splitmix64 of (seed, t * K + k), a uniform draw in [0, 2^24) that
 * every backend computes alike. Larger stays. */
EPX_SPEC_FN uint32_t epx_route_priority(uint64_t seed, int64_t route) {
  uint64_t x = seed + (uint64_t)(route + 1) * 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return (uint32_t)(x >> 40);
}

/* The key by which a drop policy ranks an expert's routes (larger stays):
 * the weight before the drop (by probability), the base weight (by score),
 * or the seeded priority. */
EPX_SPEC_FN double epx_route_drop_key(epx_drop_policy_t policy, double weight, double base,
                                      uint32_t priority) {
  if (policy == EPX_DROP_BY_SCORE) return base;
  if (policy == EPX_DROP_BY_RANDOM_PRIORITY) return (double)priority;
  return weight;
}

/* Denominator D of the aux loss, aux = coeff * E * sum_e P_e * F_e / D,
 * P_e = sum over valid tokens of q[t, e], F_e the counts of aux_counts:
 * K * Tv^2 (Switch: f_e = F_e / (Tv K), P_e / Tv), Tv^2 for first choices
 * only (k_factor 1), K * Tv^2 / B for B sequences (the mean over sequences
 * of each sequence's loss, Megatron's S = Tv / B), K * tokens^2 for the
 * global loss (global_tokens > 0). */
EPX_SPEC_FN double epx_route_aux_denominator_of(double k_factor, double valid, int32_t sequences,
                                                double global_tokens) {
  if (global_tokens > 0) return k_factor * global_tokens * global_tokens;
  if (sequences > 1) return k_factor * valid * valid / (double)sequences;
  return k_factor * valid * valid;
}

/* The K factor of D: 1 when only first choices count. */
EPX_SPEC_FN double epx_route_aux_k_factor(const epx_route_config_t *c) {
  return c->aux_counts == EPX_AUX_COUNTS_FIRST_CHOICE ? 1.0 : (double)c->top_k;
}

EPX_SPEC_FN double epx_route_aux_denominator(const epx_route_config_t *c, int64_t valid) {
  return epx_route_aux_denominator_of(epx_route_aux_k_factor(c), (double)valid,
                                      c->aux_loss_sequences,
                                      c->aux_loss_expert_counts ? c->aux_loss_tokens : 0.0);
}

/* Upper bound of the recv rows of one handle: W ranks each sending up to
 * max_tokens tokens, min(K, E_local) rows a token for expert-major (plus each
 * local expert's alignment padding), a row a token for rank-major, E_local *
 * W * C slots for capacity. The API's epx_buffer_max_recv_rows and the CUDA
 * layout's row bound are this function. */
EPX_SPEC_FN int64_t epx_recv_rows_bound(epx_layout_t layout, int64_t ranks, int64_t max_tokens,
                                        int32_t max_top_k, int64_t experts_local,
                                        int32_t alignment, int32_t capacity) {
  switch (layout) {
    case EPX_LAYOUT_EXPERT_MAJOR: {
      const int64_t k = max_top_k < experts_local ? max_top_k : experts_local;
      return ranks * max_tokens * k + experts_local * (alignment - 1);
    }
    case EPX_LAYOUT_RANK_MAJOR: return ranks * max_tokens;
    case EPX_LAYOUT_CAPACITY: return experts_local * ranks * capacity;
  }
  return 0;
}

/* The routing refusals, one text each for every backend (printf formats;
 * the first argument is the public function's name). */
#define EPX_ROUTE_ERR_NONFINITE                                                           \
  "%s: logits of token %lld are not finite (logits[%lld, %d] is %g); fix the logits or "   \
  "set config->nonfinite = EPX_NONFINITE_DROP"
#define EPX_ROUTE_ERR_BIAS "%s: bias[%d] is %g; pass a finite bias"
#define EPX_ROUTE_ERR_MISMATCH                                                            \
  "%s: topk_idx[%lld, %d] is %d but the routing recomputed from logits and bias chose "   \
  "expert %d; pass the forward's topk_idx with its logits, bias and config"
#define EPX_ROUTE_ERR_OOM "%s: out of memory for %lld tokens' routing scratch; free memory " \
  "or route fewer tokens"

#ifndef __CUDACC__
#include "core/error.h"
/* EPX_NONFINITE_ERROR's refusal of token t, whose logits row [E] is in host
 * memory (the CUDA backend copies it back first). */
static inline epx_status_t epx_route_refuse_nonfinite(const char *fn, const float *row, int32_t E,
                                                      int64_t t) {
  int32_t e = 0;
  while (e < E - 1 && isfinite(row[e])) e++;
  return epx_error(EPX_ERROR_INVALID_ARGUMENT, EPX_ROUTE_ERR_NONFINITE, fn, (long long)t,
                   (long long)t, e, (double)row[e]);
}
#endif

#ifdef __cplusplus
}
#endif

#endif
