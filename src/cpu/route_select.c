/* The CPU router's per-token part (spec steps 1-5 of src/core/route_spec.h):
 * scores, group-limited top-k, base weights, aux scores; and the per-call
 * scratch it runs in. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/route_spec.h"
#include "cpu/route_internal.h"

#ifdef _OPENMP
static int route_max_threads(void) { return omp_get_max_threads(); }
#else
static int route_max_threads(void) { return 1; }
#endif

epx_status_t route_check_bias(const char *fn, int32_t num_experts, const float *bias) {
  if (!bias) return EPX_SUCCESS;
  for (int32_t e = 0; e < num_experts; e++)
    EPX_REQUIRE(isfinite(bias[e]), EPX_ROUTE_ERR_BIAS, fn, e, (double)bias[e]);
  return EPX_SUCCESS;
}

/* The all-finite test looks at the exponent bits with no early exit, so it
 * vectorises. */
int32_t route_first_nonfinite(const float *row, int32_t num_experts) {
  uint32_t bad = 0;
  for (int32_t e = 0; e < num_experts; e++) {
    uint32_t bits;
    memcpy(&bits, row + e, sizeof bits);
    bad |= (bits & 0x7f800000u) == 0x7f800000u;
  }
  if (!bad) return -1;
  for (int32_t e = 0; e < num_experts; e++)
    if (!isfinite(row[e])) return e;
  return -1;
}

static void route_state_free(route_state *s) {
  free(s->select);
  free(s->group_score);
  free(s->group_top2);
  free(s->group_topn);
  free(s->group_best);
  free(s->group_kept);
  free(s->top_score);
  free(s->candidate);
  free(s->p);
  free(s->q);
  free(s->grad_p);
  free(s->grad_base);
  free(s->grad_row);
}

static epx_status_t route_state_init(const char *fn, const epx_route_config_t *c,
                                     const float *bias, route_state *s) {
  memset(s, 0, sizeof *s);
  const size_t E = (size_t)c->num_experts;
  s->config = c;
  s->num_experts = c->num_experts;
  s->top_k = c->top_k;
  s->num_groups = c->num_groups > 1 ? c->num_groups : 1;
  s->group_size = c->num_experts / s->num_groups;
  s->topk_groups = c->num_groups > 1 ? c->topk_groups : 1;
  s->group_top = epx_route_group_top(c->group_score_experts, s->group_size);
  s->bias = bias;
  s->select = bias ? malloc(sizeof(float) * E) : NULL;
  s->group_score = malloc(sizeof(float) * (size_t)s->num_groups);
  s->group_top2 = malloc(sizeof(float) * 2 * (size_t)s->num_groups);
  s->group_topn = malloc(sizeof(float) * (size_t)s->group_top);
  s->group_best = malloc(sizeof(int32_t) * (size_t)s->topk_groups);
  s->group_kept = malloc((size_t)s->num_groups);
  s->top_score = malloc(sizeof(float) * (size_t)c->top_k);
  s->candidate = malloc(sizeof(int32_t) * E);
  s->p = malloc(sizeof(float) * E);
  s->q = malloc(sizeof(float) * E);
  s->grad_p = malloc(sizeof(double) * E);
  s->grad_base = malloc(sizeof(double) * (size_t)c->top_k);
  s->grad_row = malloc(sizeof(double) * E);
  if ((bias && !s->select) || !s->group_score || !s->group_top2 || !s->group_topn ||
      !s->group_best || !s->group_kept || !s->top_score || !s->candidate || !s->p || !s->q ||
      !s->grad_p || !s->grad_base || !s->grad_row) {
    route_state_free(s);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d experts' scratch; "
                     "free memory or route fewer experts", fn, c->num_experts);
  }
  return EPX_SUCCESS;
}

void route_states_free(route_state *states, int threads) {
  if (!states) return;
  for (int i = 0; i < threads; i++) route_state_free(&states[i]);
  free(states);
}

epx_status_t route_states_create(const char *fn, const epx_route_config_t *c, const float *bias,
                                 int threads, route_state **out) {
  route_state *states = calloc((size_t)threads, sizeof *states);
  if (!states)
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d threads' scratch; "
                     "free memory", fn, threads);
  for (int i = 0; i < threads; i++) {
    const epx_status_t status = route_state_init(fn, c, bias, &states[i]);
    if (status != EPX_SUCCESS) {
      route_states_free(states, threads);
      return status;
    }
  }
  *out = states;
  return EPX_SUCCESS;
}

/* A parallel region costs more than it saves below 64K logits; at most one
 * thread per block. */
int route_threads(int64_t T, int32_t E) {
  const int64_t blocks = (T + ROUTE_BLOCK - 1) / ROUTE_BLOCK;
  if (T * E < ((int64_t)1 << 16)) return 1;
  const int most = route_max_threads();
  return blocks < most ? (int)blocks : most;
}

/* Max of n >= 1 values in 8 independent lanes, so it vectorises (max is
 * exact, so the lane order does not change the result). */
static float route_max(const float *v, int32_t n) {
  float lane[8];
  for (int32_t i = 0; i < 8; i++) lane[i] = v[0];
  int32_t e = 0;
  for (; e + 8 <= n; e += 8)
    for (int32_t i = 0; i < 8; i++) lane[i] = v[e + i] > lane[i] ? v[e + i] : lane[i];
  for (; e < n; e++) lane[0] = v[e] > lane[0] ? v[e] : lane[0];
  float max = lane[0];
  for (int32_t i = 1; i < 8; i++) max = lane[i] > max ? lane[i] : max;
  return max;
}

double route_softmax(const float *row, int32_t n, float *out) {
  const float max = route_max(row, n);
  float sum = 0.0f;
  for (int32_t e = 0; e < n; e++) {
    out[e] = expf(row[e] - max);
    sum += out[e];
  }
  for (int32_t e = 0; e < n; e++) out[e] = out[e] / sum;
  return (double)max + log((double)sum);
}

double route_logsumexp(const float *row, int32_t n) {
  const float max = route_max(row, n);
  float sum = 0.0f;
  for (int32_t e = 0; e < n; e++) sum += expf(row[e] - max);
  return (double)max + log((double)sum);
}

/* Scores p [E] of one finite row (spec step 1). */
static double route_scores(const route_state *s, const float *row, float *p) {
  const int32_t n = s->num_experts;
  switch (s->config->score_fn) {
    case EPX_SCORE_SOFTMAX: return route_softmax(row, n, p);
    case EPX_SCORE_SIGMOID:
      /* expf in its own loop so the rest vectorises. */
      for (int32_t e = 0; e < n; e++) p[e] = expf(-row[e]);
      for (int32_t e = 0; e < n; e++) p[e] = 1.0f / (1.0f + p[e]);
      return NAN;
    case EPX_SCORE_SQRT_SOFTPLUS:
      for (int32_t e = 0; e < n; e++)
        p[e] = sqrtf(row[e] > EPX_SOFTPLUS_THRESHOLD ? row[e] : log1pf(expf(row[e])));
      return NAN;
    case EPX_SCORE_SOFTMAX_AFTER_TOPK: memcpy(p, row, sizeof(float) * (size_t)n); return NAN;
  }
  return NAN;
}

/* Inserts v into the best-first list top [n of K], keeping the K largest. */
static void route_keep_largest(float v, int32_t K, float *top, int32_t *n) {
  if (*n == K && !(v > top[K - 1])) return;
  int32_t at = *n < K ? (*n)++ : K - 1;
  while (at > 0 && v > top[at - 1]) {
    top[at] = top[at - 1];
    at--;
  }
  top[at] = v;
}

/* Group g's score: the sum of its group_top best s, in best-first order
 * (float32); keeps its best two in group_top2 for route_topk_bound. */
static float route_group_score(route_state *s, const float *v, int32_t g) {
  float best = -INFINITY, second = -INFINITY;
  for (int32_t i = 0; i < s->group_size; i++) {
    if (v[i] > best) {
      second = best;
      best = v[i];
    } else if (v[i] > second) {
      second = v[i];
    }
  }
  s->group_top2[2 * g] = best;
  s->group_top2[2 * g + 1] = second;
  if (s->group_top == 1) return best;
  if (s->group_top == 2) return best + second;
  int32_t n = 0;
  for (int32_t i = 0; i < s->group_size; i++) route_keep_largest(v[i], s->group_top, s->group_topn, &n);
  float sum = 0.0f;
  for (int32_t i = 0; i < n; i++) sum += s->group_topn[i];
  return sum;
}

/* Keeps the topk_groups best groups (ties: lower group) in group_kept. */
static void route_pick_groups(route_state *s, const float *score) {
  const int32_t keep = s->topk_groups;
  int32_t kept = 0;
  for (int32_t g = 0; g < s->num_groups; g++) {
    const float gs = route_group_score(s, score + (size_t)g * s->group_size, g);
    s->group_score[g] = gs;
    s->group_kept[g] = 0;
    /* Insertion into the best-first list; strict > keeps the lower group on ties. */
    if (kept == keep && !(gs > s->group_score[s->group_best[keep - 1]])) continue;
    int32_t at = kept < keep ? kept++ : keep - 1;
    while (at > 0 && gs > s->group_score[s->group_best[at - 1]]) {
      s->group_best[at] = s->group_best[at - 1];
      at--;
    }
    s->group_best[at] = g;
  }
  for (int32_t i = 0; i < kept; i++) s->group_kept[s->group_best[i]] = 1;
}

/* A lower bound of the K-th best allowed score, so that only the experts at
 * or above it need the (branchy) ordered insertion: K distinct allowed
 * experts each score at least the bound, hence so do the K best. Without
 * groups those K are the maxima of K blocks; with groups, the best two of
 * each kept group (no bound when those are fewer than K). */
static float route_topk_bound(const route_state *s, const float *score, int grouped) {
  const int32_t K = s->top_k;
  if (!grouped) {
    const int32_t n = s->num_experts, size = n / K;
    float bound = INFINITY;
    for (int32_t b = 0; b < K; b++) {
      const int32_t end = b == K - 1 ? n : (b + 1) * size;
      const float max = route_max(score + b * size, end - b * size);
      bound = max < bound ? max : bound;
    }
    return bound;
  }
  float *largest = s->top_score; /* scratch until the selection fills it */
  int32_t n = 0;
  for (int32_t i = 0; i < s->topk_groups; i++) {
    const int32_t g = s->group_best[i];
    route_keep_largest(s->group_top2[2 * g], K, largest, &n);
    if (s->group_size > 1) route_keep_largest(s->group_top2[2 * g + 1], K, largest, &n);
  }
  return n == K ? largest[K - 1] : -INFINITY;
}

/* The K best of score [E] (ties to the lower expert) among the kept groups
 * (grouped) or all experts, best first, into chosen. */
static void route_topk(route_state *s, const float *score, int grouped, int32_t *chosen) {
  const int32_t K = s->top_k, G = grouped ? s->num_groups : 1;
  const int32_t size = grouped ? s->group_size : s->num_experts;
  const float bound = route_topk_bound(s, score, grouped);
  int32_t *cand = s->candidate, count = 0;
  for (int32_t g = 0; g < G; g++) {
    if (grouped && !s->group_kept[g]) continue;
    const int32_t end = (g + 1) * size;
    for (int32_t e = g * size; e < end; e++) {
      cand[count] = e;
      count += score[e] >= bound;
    }
  }
  float *top = s->top_score;
  int32_t found = 0;
  for (int32_t i = 0; i < count; i++) {
    const int32_t e = cand[i];
    const float v = score[e];
    /* Candidates arrive in ascending order, so strict > puts ties after. */
    if (found == K && !(v > top[K - 1])) continue;
    int32_t at = found < K ? found++ : K - 1;
    while (at > 0 && v > top[at - 1]) {
      top[at] = top[at - 1];
      chosen[at] = chosen[at - 1];
      at--;
    }
    top[at] = v;
    chosen[at] = e;
  }
}

double route_select(route_state *s, const float *row, float *p, int32_t *chosen) {
  const int32_t n = s->num_experts;
  const double lse = route_scores(s, row, p);
  const float *score = p;
  if (s->bias) {
    for (int32_t e = 0; e < n; e++) s->select[e] = p[e] + s->bias[e];
    score = s->select;
  }
  if (s->num_groups > 1) route_pick_groups(s, score);
  route_topk(s, score, s->num_groups > 1, chosen);
  return lse;
}

void route_plain_topk(route_state *s, const float *q, int32_t *chosen) {
  route_topk(s, q, 0, chosen);
}

void route_base_weights(const route_state *s, const float *p, const int32_t *chosen, float *b) {
  const int32_t K = s->top_k;
  for (int32_t k = 0; k < K; k++) b[k] = p[chosen[k]];
  if (s->config->score_fn != EPX_SCORE_SOFTMAX_AFTER_TOPK) return;
  /* p holds the logits: the softmax of the K chosen ones. */
  float max = b[0];
  for (int32_t k = 1; k < K; k++) max = b[k] > max ? b[k] : max;
  float sum = 0.0f;
  for (int32_t k = 0; k < K; k++) {
    b[k] = expf(b[k] - max);
    sum += b[k];
  }
  for (int32_t k = 0; k < K; k++) b[k] = b[k] / sum;
}

float route_weight_sum(const float *b, const int32_t *keep, int32_t K) {
  float sum = 0.0f;
  for (int32_t k = 0; k < K; k++)
    if (!keep || keep[k] >= 0) sum += b[k];
  return sum;
}

void route_aux_scores(route_state *s, const float *row, const float *p) {
  const int32_t E = s->num_experts;
  float *q = s->q;
  switch (s->config->score_fn) {
    case EPX_SCORE_SOFTMAX: memcpy(q, p, sizeof(float) * (size_t)E); return;
    case EPX_SCORE_SOFTMAX_AFTER_TOPK: route_softmax(row, E, q); return;
    case EPX_SCORE_SIGMOID:
    case EPX_SCORE_SQRT_SOFTPLUS: {
      float total = 0.0f;
      for (int32_t e = 0; e < E; e++) total += p[e];
      for (int32_t e = 0; e < E; e++) q[e] = total > 0.0f ? p[e] / total : 0.0f;
      return;
    }
  }
}

void route_aux_counts(const epx_route_config_t *c, int64_t T, const int32_t *sel,
                      const uint8_t *valid, double *F) {
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  if (c->aux_loss_expert_counts) {
    for (int32_t e = 0; e < E; e++) F[e] = c->aux_loss_expert_counts[e];
    return;
  }
  memset(F, 0, sizeof(double) * (size_t)B * (size_t)E);
  const int32_t slots = c->aux_counts == EPX_AUX_COUNTS_FIRST_CHOICE ? 1 : K;
  for (int64_t t = 0; t < T; t++) {
    if (!valid[t]) continue;
    double *f = F + (size_t)(t % B) * (size_t)E;
    for (int32_t k = 0; k < slots; k++) f[sel[(size_t)t * K + k]] += 1.0;
  }
}
