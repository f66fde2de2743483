/* Routing: logits [T, E] -> top-k experts, weights, capacity locations, counts
 * and the auxiliary losses, and the gradient back to the logits, on the CPU
 * (the public entry points in src/api/route.c have checked the arguments):
 * one pass over the tokens (scores,
 * selection, weights, loss sums; split over OpenMP threads by blocks of
 * tokens), then one pass over the routes in queue order (locations, drops).
 * Results go to scratch first and reach the caller's arrays only once nothing
 * can fail any more. Every result is independent of the thread count. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "cpu/cpu.h"

#ifdef _OPENMP
#include <omp.h>
/* The token loops: a local `threads` (1: no parallel region) sizes the team. */
#define ROUTE_PARALLEL_FOR                                                              \
  _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")
static int route_thread(void) { return omp_get_thread_num(); }
static int route_max_threads(void) { return omp_get_max_threads(); }
#else
#define ROUTE_PARALLEL_FOR
static int route_thread(void) { return 0; }
static int route_max_threads(void) { return 1; }
#endif

/* Tokens per block of the token loops. Loss sums are taken per block, then
 * over the blocks in order, so they do not depend on the thread count. */
#define ROUTE_BLOCK 128

/* A bias only steers selection, but a NaN in it would make the order of the
 * experts undefined. */
static epx_status_t route_check_bias(const char *fn, int32_t num_experts, const float *bias) {
  if (!bias) return EPX_SUCCESS;
  for (int32_t e = 0; e < num_experts; e++)
    EPX_REQUIRE(isfinite(bias[e]), "%s: bias[%d] is %g; pass a finite bias", fn, e,
                (double)bias[e]);
  return EPX_SUCCESS;
}

/* Index of the first NaN/Inf in row, or -1. The all-finite test looks at the
 * exponent bits with no early exit, so it vectorises. */
static int32_t route_first_nonfinite(const float *row, int32_t num_experts) {
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

/* What one token's routing needs besides its logits: the config's numbers
 * and per-token scratch, allocated once per call and thread. */
typedef struct route_state {
  int32_t num_experts, top_k;
  int32_t num_groups, group_size, topk_groups; /* num_groups 1: no group limit */
  int sigmoid;
  const float *bias;  /* [E] or NULL */
  float *select;      /* [E] p + bias (only with a bias) */
  float *group_score; /* [num_groups] */
  float *group_top;   /* [num_groups, 2] best and second-best score of each group */
  int32_t *group_best;/* [topk_groups] kept groups, best first */
  uint8_t *group_kept;/* [num_groups] */
  float *top_score;   /* [K] selection scores of the chosen, best first */
  int32_t *candidate; /* [E] experts that may be among the K best, ascending */
  float *p;           /* [E] one token's scores */
  double *grad_p;     /* [E] one token's d loss / d p (backward) */
  double *grad_row;   /* [E] one token's d loss / d logits (backward) */
  float *softmax;     /* [E] softmax of one token's logits (sigmoid z loss, backward) */
} route_state;

static void route_state_free(route_state *s) {
  free(s->select);
  free(s->group_score);
  free(s->group_top);
  free(s->group_best);
  free(s->group_kept);
  free(s->top_score);
  free(s->candidate);
  free(s->p);
  free(s->grad_p);
  free(s->grad_row);
  free(s->softmax);
}

static epx_status_t route_state_init(const char *fn, const epx_route_config_t *c,
                                     const float *bias, route_state *s) {
  memset(s, 0, sizeof *s);
  s->num_experts = c->num_experts;
  s->top_k = c->top_k;
  s->num_groups = c->num_groups > 1 ? c->num_groups : 1;
  s->group_size = c->num_experts / s->num_groups;
  s->topk_groups = c->num_groups > 1 ? c->topk_groups : 1;
  s->sigmoid = c->score_fn == EPX_SCORE_SIGMOID;
  s->bias = bias;
  s->select = bias ? malloc(sizeof(float) * (size_t)c->num_experts) : NULL;
  s->group_score = malloc(sizeof(float) * (size_t)s->num_groups);
  s->group_best = malloc(sizeof(int32_t) * (size_t)s->topk_groups);
  s->group_kept = malloc((size_t)s->num_groups);
  s->group_top = malloc(sizeof(float) * 2 * (size_t)s->num_groups);
  s->top_score = malloc(sizeof(float) * (size_t)c->top_k);
  s->candidate = malloc(sizeof(int32_t) * (size_t)c->num_experts);
  s->p = malloc(sizeof(float) * (size_t)c->num_experts);
  s->grad_p = malloc(sizeof(double) * (size_t)c->num_experts);
  s->grad_row = malloc(sizeof(double) * (size_t)c->num_experts);
  s->softmax = malloc(sizeof(float) * (size_t)c->num_experts);
  if ((bias && !s->select) || !s->group_score || !s->group_top || !s->group_best ||
      !s->group_kept || !s->top_score || !s->candidate || !s->p || !s->grad_p ||
      !s->grad_row || !s->softmax) {
    route_state_free(s);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d experts' scratch; "
                     "free memory or route fewer experts", fn, c->num_experts);
  }
  return EPX_SUCCESS;
}

static void route_states_free(route_state *states, int threads) {
  if (!states) return;
  for (int i = 0; i < threads; i++) route_state_free(&states[i]);
  free(states);
}

/* One state per thread of the token loops. */
static epx_status_t route_states_create(const char *fn, const epx_route_config_t *c,
                                        const float *bias, int threads, route_state **out) {
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

/* Threads for T tokens of E experts: one below 64K logits, where a parallel
 * region costs more than it saves; at most one per block. */
static int route_threads(int64_t T, int32_t E) {
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

/* softmax(row) [E] into p, float32 as spec item 1 fixes it; returns the row's
 * logsumexp (for the z loss). */
static double route_softmax(const float *row, int32_t n, float *p) {
  const float max = route_max(row, n);
  float sum = 0.0f;
  for (int32_t e = 0; e < n; e++) {
    p[e] = expf(row[e] - max);
    sum += p[e];
  }
  for (int32_t e = 0; e < n; e++) p[e] = p[e] / sum;
  return (double)max + log((double)sum);
}

static double route_logsumexp(const float *row, int32_t n) {
  const float max = route_max(row, n);
  float sum = 0.0f;
  for (int32_t e = 0; e < n; e++) sum += expf(row[e] - max);
  return (double)max + log((double)sum);
}

/* Scores p [E] of one finite row (spec item 1); returns the row's logsumexp
 * for softmax, NAN for sigmoid (which does not need it). */
static double route_scores(const route_state *s, const float *row, float *p) {
  const int32_t n = s->num_experts;
  if (!s->sigmoid) return route_softmax(row, n, p);
  /* expf in its own loop so the rest vectorises. */
  for (int32_t e = 0; e < n; e++) p[e] = expf(-row[e]);
  for (int32_t e = 0; e < n; e++) p[e] = 1.0f / (1.0f + p[e]);
  return NAN;
}

/* Keeps the topk_groups groups with the largest sum of their two best
 * selection scores (ties: lower group), in group_kept. */
static void route_pick_groups(route_state *s, const float *score) {
  const int32_t keep = s->topk_groups;
  int32_t kept = 0;
  for (int32_t g = 0; g < s->num_groups; g++) {
    const float *v = score + (size_t)g * s->group_size;
    float best = -INFINITY, second = -INFINITY;
    for (int32_t i = 0; i < s->group_size; i++) {
      if (v[i] > best) {
        second = best;
        best = v[i];
      } else if (v[i] > second) {
        second = v[i];
      }
    }
    const float gs = s->group_size > 1 ? best + second : best;
    s->group_score[g] = gs;
    s->group_top[2 * g] = best;
    s->group_top[2 * g + 1] = second;
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

/* A lower bound of the K-th best allowed score, so that only the experts at
 * or above it need the (branchy) ordered insertion: K distinct allowed
 * experts each score at least the bound, hence so do the K best. Without
 * groups those K are the maxima of K blocks; with groups, the best two of
 * each kept group (no bound when those are fewer than K). */
static float route_topk_bound(const route_state *s, const float *score) {
  const int32_t K = s->top_k;
  if (s->num_groups <= 1) {
    const int32_t n = s->num_experts, size = n / K;
    float bound = INFINITY;
    for (int32_t b = 0; b < K; b++) {
      const int32_t end = b == K - 1 ? n : (b + 1) * size;
      const float max = route_max(score + b * size, end - b * size);
      bound = max < bound ? max : bound;
    }
    return bound;
  }
  float *largest = s->top_score; /* scratch until route_select fills it */
  int32_t n = 0;
  for (int32_t i = 0; i < s->topk_groups; i++) {
    const int32_t g = s->group_best[i];
    route_keep_largest(s->group_top[2 * g], K, largest, &n);
    if (s->group_size > 1) route_keep_largest(s->group_top[2 * g + 1], K, largest, &n);
  }
  return n == K ? largest[K - 1] : -INFINITY;
}

/* Selects one finite row's K experts (spec items 2-4): chosen [K] best first,
 * ties to the lower expert. p [E] gets the scores; returns route_scores'. */
static double route_select(route_state *s, const float *row, float *p, int32_t *chosen) {
  const int32_t n = s->num_experts, K = s->top_k;
  const double lse = route_scores(s, row, p);
  const float *score = p;
  if (s->bias) {
    for (int32_t e = 0; e < n; e++) s->select[e] = p[e] + s->bias[e];
    score = s->select;
  }
  if (s->num_groups > 1) route_pick_groups(s, score);
  const float bound = route_topk_bound(s, score);
  int32_t *cand = s->candidate, count = 0;
  for (int32_t g = 0; g < s->num_groups; g++) {
    if (s->num_groups > 1 && !s->group_kept[g]) continue;
    const int32_t end = (g + 1) * s->group_size;
    for (int32_t e = g * s->group_size; e < end; e++) {
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
  return lse;
}

/* Sum of the chosen experts' scores in k order, float32 (spec item 5). */
static float route_chosen_sum(const float *p, const int32_t *chosen, int32_t K) {
  float sum = 0.0f;
  for (int32_t k = 0; k < K; k++) sum += p[chosen[k]];
  return sum;
}

/* One candidate of an over-full expert under drop-by-probability. */
typedef struct route_candidate {
  float weight;
  int64_t queue_pos; /* position in the expert's queue; breaks ties */
  int64_t route;
} route_candidate;

/* Whether a stays before b: a larger weight, then earlier in the queue (a
 * total order, since queue positions are unique). */
static inline int route_better(const route_candidate *a, const route_candidate *b) {
  return a->weight > b->weight || (a->weight == b->weight && a->queue_pos < b->queue_pos);
}

/* Restores the heap h [m] (every parent worse than its children) below i. */
static void route_heap_sift(route_candidate *h, int64_t m, int64_t i) {
  for (;;) {
    int64_t child = 2 * i + 1;
    if (child >= m) return;
    if (child + 1 < m && route_better(&h[child], &h[child + 1])) child++;
    if (!route_better(&h[i], &h[child])) return;
    const route_candidate swap = h[i];
    h[i] = h[child];
    h[child] = swap;
    i = child;
  }
}

/* Moves the m best of cand [n] into cand [0, m), in no particular order: a
 * heap of the best so far with the worst of them at the root, O(n log m). */
static void route_keep_best(route_candidate *cand, int64_t n, int64_t m) {
  for (int64_t i = m / 2 - 1; i >= 0; i--) route_heap_sift(cand, m, i);
  for (int64_t j = m; j < n; j++) {
    if (m == 0 || !route_better(&cand[j], &cand[0])) continue;
    const route_candidate swap = cand[0];
    cand[0] = cand[j];
    cand[j] = swap;
    route_heap_sift(cand, m, 0);
  }
}

/* Capacity C (spec item 6), in double as the spec fixes it. */
static int32_t route_capacity(const epx_route_config_t *c, int64_t T) {
  double cap = ceil((double)c->top_k * (double)T / (double)c->num_experts *
                    (double)c->capacity_factor);
  if (cap < (double)c->min_capacity) cap = (double)c->min_capacity;
  return cap > (double)INT32_MAX ? INT32_MAX : (int32_t)cap;
}

/* Locations and drops (spec items 6-7): idx [T, K] (-1 = no route), w [T, K]
 * in, loc [T, K] and counts [E] out; dropped routes get -1 / 0 / -1. */
static epx_status_t route_locate(const epx_route_config_t *c, int64_t T, int32_t *idx, float *w,
                                 int32_t *loc, int32_t *counts, int32_t capacity) {
  epx_status_t status = EPX_SUCCESS;
  const int32_t K = c->top_k, E = c->num_experts;
  const int64_t routes = T * K;
  int64_t *offsets = NULL, *queue = NULL;
  route_candidate *cand = NULL;
  /* Positions: a running count per expert in queue order (spec item 6). */
  memset(counts, 0, sizeof(int32_t) * (size_t)E);
  if (c->queue_order == EPX_QUEUE_BY_TOKEN) {
    for (int64_t r = 0; r < routes; r++) loc[r] = idx[r] < 0 ? -1 : counts[idx[r]]++;
  } else {
    for (int32_t k = 0; k < K; k++)
      for (int64_t r = k; r < routes; r += K) loc[r] = idx[r] < 0 ? -1 : counts[idx[r]]++;
  }
  if (!c->capacity_mode) return EPX_SUCCESS;
  if (c->drop_policy == EPX_DROP_BY_POSITION) {
    for (int64_t r = 0; r < routes; r++) {
      if (loc[r] >= capacity) {
        idx[r] = -1;
        w[r] = 0.0f;
        loc[r] = -1;
      }
    }
    return EPX_SUCCESS;
  }
  int32_t fullest = 0;
  for (int32_t e = 0; e < E; e++) fullest = counts[e] > fullest ? counts[e] : fullest;
  if (fullest <= capacity) return EPX_SUCCESS;
  /* queue [sum counts]: each expert's routes in queue order, from offsets [E+1]. */
  offsets = malloc(sizeof(int64_t) * ((size_t)E + 1));
  queue = malloc(sizeof(int64_t) * (size_t)(routes ? routes : 1));
  cand = malloc(sizeof(route_candidate) * (size_t)fullest);
  if (!offsets || !queue || !cand)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "epx_route: out of memory for the capacity queues of "
             "%lld routes; free memory or route fewer tokens", (long long)routes);
  offsets[0] = 0;
  for (int32_t e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
  for (int64_t r = 0; r < routes; r++)
    if (idx[r] >= 0) queue[offsets[idx[r]] + loc[r]] = r;
  for (int32_t e = 0; e < E; e++) {
    const int64_t n = counts[e], *mine = queue + offsets[e];
    if (n <= capacity) continue;
    for (int64_t i = 0; i < n; i++) cand[i] = (route_candidate){w[mine[i]], i, mine[i]};
    route_keep_best(cand, n, capacity);
    for (int64_t i = capacity; i < n; i++) loc[cand[i].route] = -1;
    int32_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
      const int64_t r = mine[i];
      if (loc[r] >= 0) {
        loc[r] = kept++;
      } else {
        idx[r] = -1;
        w[r] = 0.0f;
      }
    }
  }
fail:
  free(offsets);
  free(queue);
  free(cand);
  return status;
}

/* What a block of tokens hands back to the sequential part of a call. */
typedef struct route_block {
  int64_t fault_token; /* first token the call must refuse, or -1 */
  int32_t fault_slot;  /* -1: that token has a NaN/Inf logit; k: topk_idx[token, k] disagrees */
  int64_t nonfinite;   /* tokens dropped for NaN/Inf logits */
  double z_sum;        /* sum over valid tokens of logsumexp^2 */
} route_block;

/* Routes tokens [begin, end) (spec items 1-5, 9): idx and w [T, K]; the
 * block's sums in blk, and sum over its tokens of q [E] in prob (or NULL). */
static void route_tokens(const epx_route_config_t *c, route_state *st, const float *logits,
                         int64_t begin, int64_t end, int want_z, int32_t *idx, float *w,
                         route_block *blk, double *prob) {
  const int32_t E = c->num_experts, K = c->top_k;
  float *p = st->p;
  *blk = (route_block){-1, -1, 0, 0.0};
  if (prob) memset(prob, 0, sizeof(double) * (size_t)E);
  for (int64_t t = begin; t < end; t++) {
    const float *row = logits + (size_t)t * E;
    int32_t *ti = idx + (size_t)t * K;
    float *tw = w + (size_t)t * K;
    if (route_first_nonfinite(row, E) >= 0) {
      if (c->nonfinite == EPX_NONFINITE_ERROR) {
        blk->fault_token = t;
        return;
      }
      for (int32_t k = 0; k < K; k++) {
        ti[k] = -1;
        tw[k] = 0.0f;
      }
      blk->nonfinite++;
      continue;
    }
    const double lse = route_select(st, row, p, ti);
    const float sum = route_chosen_sum(p, ti, K);
    for (int32_t k = 0; k < K; k++) {
      float v = p[ti[k]];
      /* Chosen scores that all underflowed to 0 (a bias can pick them) give
       * weight 0 rather than 0/0. */
      if (c->renormalize) v = sum > 0.0f ? v / sum : 0.0f;
      tw[k] = v * c->scaling_factor;
    }
    if (prob) {
      if (st->sigmoid) {
        double total = 0.0;
        for (int32_t e = 0; e < E; e++) total += p[e];
        if (total > 0.0)
          for (int32_t e = 0; e < E; e++) prob[e] += p[e] / total;
      } else {
        for (int32_t e = 0; e < E; e++) prob[e] += p[e];
      }
    }
    if (want_z) {
      const double l = st->sigmoid ? route_logsumexp(row, E) : lse;
      blk->z_sum += l * l;
    }
  }
}

epx_status_t epx_cpu_route(const epx_route_config_t *c, int64_t T, const float *logits,
                           const float *bias, epx_route_output_t *out) {
  static const char fn[] = "epx_route";
  epx_status_t status = EPX_SUCCESS;
  const int32_t E = c->num_experts, K = c->top_k;
  const size_t routes = (size_t)T * (size_t)K, slots = routes ? routes : 1;
  const int64_t blocks = (T + ROUTE_BLOCK - 1) / ROUTE_BLOCK;
  const int want_aux = out->aux_loss != NULL, want_z = out->z_loss != NULL;
  const int threads = route_threads(T, E);
  route_state *states = NULL;
  status = route_check_bias(fn, E, bias);
  if (status != EPX_SUCCESS) return status;
  status = route_states_create(fn, c, bias, threads, &states);
  if (status != EPX_SUCCESS) return status;
  /* idx, w, loc [T, K] and counts [E]: the outputs until they are copied out. */
  int32_t *idx = malloc(sizeof(int32_t) * slots);
  float *w = malloc(sizeof(float) * slots);
  int32_t *loc = malloc(sizeof(int32_t) * slots);
  int32_t *counts = malloc(sizeof(int32_t) * (size_t)E);
  route_block *block = malloc(sizeof(route_block) * (size_t)(blocks ? blocks : 1));
  /* [blocks, E] each block's sum of q, for the aux loss. */
  double *prob = want_aux ? malloc(sizeof(double) * (size_t)(blocks ? blocks : 1) * E) : NULL;
  if (!idx || !w || !loc || !counts || !block || (want_aux && !prob))
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %lld tokens' routing scratch; "
             "free memory or route fewer tokens", fn, (long long)T);
  ROUTE_PARALLEL_FOR
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t begin = b * ROUTE_BLOCK, end = begin + ROUTE_BLOCK < T ? begin + ROUTE_BLOCK : T;
    route_tokens(c, &states[route_thread()], logits, begin, end, want_z, idx, w, &block[b],
                 prob ? prob + (size_t)b * E : NULL);
  }
  int64_t nonfinite = 0;
  double z_sum = 0.0;
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t t = block[b].fault_token;
    if (t >= 0) {
      const int32_t e = route_first_nonfinite(logits + (size_t)t * E, E);
      EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
               "%s: logits of token %lld are not finite (logits[%lld, %d] is %g); fix the "
               "logits or set config->nonfinite = EPX_NONFINITE_DROP",
               fn, (long long)t, (long long)t, e, (double)logits[(size_t)t * E + e]);
    }
    nonfinite += block[b].nonfinite;
    z_sum += block[b].z_sum;
  }
  const int32_t capacity = c->capacity_mode ? route_capacity(c, T) : 0;
  EPX_CHECK(route_locate(c, T, idx, w, loc, counts, capacity));

  const int64_t valid = T - nonfinite;
  double aux = 0.0, z = 0.0;
  if (valid > 0) {
    for (int32_t e = 0; e < E && want_aux; e++) {
      double prob_sum = 0.0;
      for (int64_t b = 0; b < blocks; b++) prob_sum += prob[(size_t)b * E + e];
      aux += (double)counts[e] / ((double)valid * K) * (prob_sum / (double)valid);
    }
    aux *= (double)c->aux_loss_coeff * E;
    z = (double)c->z_loss_coeff * z_sum / (double)valid;
  }
  if (routes) {
    memcpy(out->topk_idx, idx, sizeof(int32_t) * routes);
    memcpy(out->topk_w, w, sizeof(float) * routes);
    if (out->locations) memcpy(out->locations, loc, sizeof(int32_t) * routes);
  }
  if (out->expert_counts) memcpy(out->expert_counts, counts, sizeof(int32_t) * (size_t)E);
  if (want_aux) *out->aux_loss = (float)aux;
  if (want_z) *out->z_loss = (float)z;
  out->capacity = capacity;
  out->nonfinite_tokens = nonfinite;
fail:
  route_states_free(states, threads);
  free(idx);
  free(w);
  free(loc);
  free(counts);
  free(block);
  free(prob);
  return status;
}

/* Backward pass 1 over tokens [begin, end): scores p [T, E], the recomputed
 * selection chosen [T, K] and logsumexp [T] of valid tokens, finite [T];
 * stops at the block's first token to refuse (a NaN/Inf logit under
 * EPX_NONFINITE_ERROR, or a topk_idx that is not this routing's). */
static void route_recompute(const epx_route_config_t *c, route_state *st, const float *logits,
                            const int32_t *topk_idx, int64_t begin, int64_t end, float *p,
                            int32_t *chosen, double *lse, uint8_t *finite, route_block *blk) {
  const int32_t E = c->num_experts, K = c->top_k;
  *blk = (route_block){-1, -1, 0, 0.0};
  for (int64_t t = begin; t < end; t++) {
    const float *row = logits + (size_t)t * E;
    finite[t] = route_first_nonfinite(row, E) < 0;
    if (!finite[t]) {
      if (c->nonfinite == EPX_NONFINITE_ERROR) {
        blk->fault_token = t;
        return;
      }
      blk->nonfinite++;
      continue;
    }
    int32_t *ch = chosen + (size_t)t * K;
    lse[t] = route_select(st, row, p + (size_t)t * E, ch);
    for (int32_t k = 0; k < K; k++) {
      const int32_t fwd = topk_idx[(size_t)t * K + k];
      if (fwd != -1 && fwd != ch[k]) {
        blk->fault_token = t;
        blk->fault_slot = k;
        return;
      }
    }
  }
}

/* What backward pass 2 needs besides one token's row. */
typedef struct route_grad_args {
  const float *p;            /* [T, E] */
  const int32_t *chosen;     /* [T, K] */
  const double *lse;         /* [T] */
  const uint8_t *finite;     /* [T] */
  const int32_t *topk_idx;   /* [T, K] the forward's */
  const float *grad_topk_w;  /* [T, K] or NULL */
  const double *aux_grad;    /* [E] d loss / d q[t, e], or NULL */
  double z_grad;             /* 2 * grad_z_loss * z_loss_coeff / T_valid, or 0 */
} route_grad_args;

/* Backward pass 2 over tokens [begin, end) (spec item 10): grad_logits rows. */
static void route_token_grads(const epx_route_config_t *c, route_state *st,
                              const float *logits, const route_grad_args *a, int64_t begin,
                              int64_t end, float *grad_logits) {
  const int32_t E = c->num_experts, K = c->top_k;
  double *grad_p = st->grad_p, *grad_row = st->grad_row;
  for (int64_t t = begin; t < end; t++) {
    float *out = grad_logits + (size_t)t * E;
    if (!a->finite[t]) {
      memset(out, 0, sizeof(float) * (size_t)E);
      continue;
    }
    const float *p = a->p + (size_t)t * E;
    const int32_t *ch = a->chosen + (size_t)t * K;
    for (int32_t e = 0; e < E; e++) grad_p[e] = 0.0;
    if (a->grad_topk_w) {
      const int32_t *fwd = a->topk_idx + (size_t)t * K;
      const float *gw = a->grad_topk_w + (size_t)t * K;
      const double scale = c->scaling_factor;
      if (c->renormalize) {
        /* w_k = s * a_k / S with S over all K chosen, dropped ones included. */
        const double sum = route_chosen_sum(p, ch, K);
        if (sum > 0.0) {
          double dot = 0.0;
          for (int32_t k = 0; k < K; k++) dot += fwd[k] < 0 ? 0.0 : (double)gw[k] * p[ch[k]];
          for (int32_t k = 0; k < K; k++)
            grad_p[ch[k]] += scale * ((fwd[k] < 0 ? 0.0 : gw[k]) / sum - dot / (sum * sum));
        }
      } else {
        for (int32_t k = 0; k < K; k++)
          if (fwd[k] >= 0) grad_p[ch[k]] += scale * gw[k];
      }
    }
    if (a->aux_grad) {
      const double *h = a->aux_grad;
      if (st->sigmoid) {
        /* q = p / sum(p): d/dp_j sum_e h_e q_e = (h_j - sum_e h_e q_e) / sum(p). */
        double total = 0.0, hq = 0.0;
        for (int32_t e = 0; e < E; e++) total += p[e];
        if (total > 0.0) {
          for (int32_t e = 0; e < E; e++) hq += h[e] * p[e];
          hq /= total;
          for (int32_t e = 0; e < E; e++) grad_p[e] += (h[e] - hq) / total;
        }
      } else {
        for (int32_t e = 0; e < E; e++) grad_p[e] += h[e];
      }
    }
    if (st->sigmoid) {
      for (int32_t e = 0; e < E; e++) grad_row[e] = grad_p[e] * p[e] * (1.0 - p[e]);
    } else {
      double dot = 0.0;
      for (int32_t e = 0; e < E; e++) dot += grad_p[e] * p[e];
      for (int32_t e = 0; e < E; e++) grad_row[e] = p[e] * (grad_p[e] - dot);
    }
    if (a->z_grad != 0.0) {
      const float *sm = p;
      double row_lse = a->lse[t];
      if (st->sigmoid) {
        row_lse = route_softmax(logits + (size_t)t * E, E, st->softmax);
        sm = st->softmax;
      }
      const double scale = a->z_grad * row_lse;
      for (int32_t e = 0; e < E; e++) grad_row[e] += scale * sm[e];
    }
    /* Written last: grad_logits may be the logits themselves. */
    for (int32_t e = 0; e < E; e++) out[e] = (float)grad_row[e];
  }
}

/* Gradient (spec item 10). Pass 1 recomputes every token's selection and
 * checks it against the forward's topk_idx; the routes per expert (f_e of the
 * aux loss) need all tokens; pass 2 writes grad_logits, so a refused call
 * leaves it untouched. */
epx_status_t epx_cpu_route_backward(const epx_route_config_t *c, int64_t T,
                                       const float *logits, const float *bias,
                                       const int32_t *topk_idx, const float *grad_topk_w,
                                       float grad_aux_loss, float grad_z_loss,
                                       float *grad_logits) {
  static const char fn[] = "epx_route_backward";
  epx_status_t status = EPX_SUCCESS;
  const int32_t E = c->num_experts, K = c->top_k;
  const size_t rows = (size_t)T ? (size_t)T : 1;
  const int64_t blocks = (T + ROUTE_BLOCK - 1) / ROUTE_BLOCK;
  const int want_aux = grad_aux_loss != 0.0f && c->aux_loss_coeff != 0.0f;
  const int want_z = grad_z_loss != 0.0f && c->z_loss_coeff != 0.0f;
  const int threads = route_threads(T, E);
  route_state *states = NULL;
  status = route_check_bias(fn, E, bias);
  if (status != EPX_SUCCESS) return status;
  status = route_states_create(fn, c, bias, threads, &states);
  if (status != EPX_SUCCESS) return status;
  float *p = malloc(sizeof(float) * rows * (size_t)E);          /* [T, E] scores */
  int32_t *chosen = malloc(sizeof(int32_t) * rows * (size_t)K); /* [T, K] recomputed */
  uint8_t *finite = malloc(rows);                               /* [T] token is valid */
  double *lse = malloc(sizeof(double) * rows);                  /* [T] logsumexp (softmax) */
  int32_t *counts = calloc((size_t)E, sizeof(int32_t));         /* [E] before dropping */
  double *aux_grad = malloc(sizeof(double) * (size_t)E);        /* [E] d loss / d q[t,e] */
  route_block *block = malloc(sizeof(route_block) * (size_t)(blocks ? blocks : 1));
  if (!p || !chosen || !finite || !lse || !counts || !aux_grad || !block)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %lld tokens' scratch; free memory "
             "or route fewer tokens", fn, (long long)T);
  ROUTE_PARALLEL_FOR
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t begin = b * ROUTE_BLOCK, end = begin + ROUTE_BLOCK < T ? begin + ROUTE_BLOCK : T;
    route_recompute(c, &states[route_thread()], logits, topk_idx, begin, end, p, chosen, lse,
                    finite, &block[b]);
  }
  int64_t valid = T;
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t t = block[b].fault_token;
    const int32_t k = block[b].fault_slot;
    if (t >= 0 && k < 0) {
      const int32_t e = route_first_nonfinite(logits + (size_t)t * E, E);
      EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
               "%s: logits of token %lld are not finite (logits[%lld, %d] is %g); fix the "
               "logits or set config->nonfinite = EPX_NONFINITE_DROP",
               fn, (long long)t, (long long)t, e, (double)logits[(size_t)t * E + e]);
    }
    if (t >= 0)
      EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
               "%s: topk_idx[%lld, %d] is %d but the routing recomputed from logits and bias "
               "chose expert %d; pass the forward's topk_idx with its logits, bias and config",
               fn, (long long)t, k, topk_idx[(size_t)t * K + k], chosen[(size_t)t * K + k]);
    valid -= block[b].nonfinite;
  }
  if (want_aux && valid > 0) {
    for (int64_t t = 0; t < T; t++)
      if (finite[t])
        for (int32_t k = 0; k < K; k++) counts[chosen[(size_t)t * K + k]]++;
    for (int32_t e = 0; e < E; e++)
      aux_grad[e] = (double)grad_aux_loss * c->aux_loss_coeff * E * counts[e] /
                    ((double)valid * K) / (double)valid;
  }
  const route_grad_args args = {
      p, chosen, lse, finite, topk_idx, grad_topk_w, want_aux && valid > 0 ? aux_grad : NULL,
      want_z && valid > 0 ? 2.0 * (double)grad_z_loss * c->z_loss_coeff / (double)valid : 0.0};
  ROUTE_PARALLEL_FOR
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t begin = b * ROUTE_BLOCK, end = begin + ROUTE_BLOCK < T ? begin + ROUTE_BLOCK : T;
    route_token_grads(c, &states[route_thread()], logits, &args, begin, end, grad_logits);
  }
fail:
  route_states_free(states, threads);
  free(p);
  free(chosen);
  free(finite);
  free(lse);
  free(counts);
  free(aux_grad);
  free(block);
  return status;
}
