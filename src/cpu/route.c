/* Routing forward on the CPU (the public entry points in src/api/route.c
 * have checked the arguments; the spec is src/core/route_spec.h): one pass
 * over the tokens (scores, selection, weights, loss sums; split over OpenMP
 * threads by blocks of tokens, route_select.c), then one pass over the
 * routes in queue order (locations, drops). Results go to scratch first and
 * reach the caller's arrays only once nothing can fail any more. Every
 * result is independent of the thread count. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/route_spec.h"
#include "cpu/cpu.h"
#include "cpu/route_internal.h"

/* One candidate of an over-full expert under a ranked drop policy. */
typedef struct route_candidate {
  float key;         /* the drop key (weight, score or priority); larger stays */
  int64_t queue_pos; /* position in the expert's queue; breaks ties */
  int64_t route;
} route_candidate;

/* Whether a stays before b: a larger key, then earlier in the queue (a total
 * order, since queue positions are unique). */
static inline int route_better(const route_candidate *a, const route_candidate *b) {
  return a->key > b->key || (a->key == b->key && a->queue_pos < b->queue_pos);
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

/* The drop key of route r (spec step 7) as a float: priorities have 24 bits,
 * so they are exact. */
static float route_key(const epx_route_config_t *c, int64_t r, const float *w, const float *base) {
  if (c->drop_policy == EPX_DROP_BY_SCORE) return base[r];
  if (c->drop_policy == EPX_DROP_BY_RANDOM_PRIORITY)
    return (float)epx_route_priority(c->random_seed, r);
  return w[r];
}

/* Ranked drops (spec step 7) of the experts holding more than C routes. */
static epx_status_t route_drop_ranked(const epx_route_config_t *c, int64_t T, int32_t *idx,
                                      const float *w, const float *base, int32_t *loc,
                                      const int32_t *counts, int32_t capacity) {
  epx_status_t status = EPX_SUCCESS;
  const int32_t E = c->num_experts;
  const int64_t routes = T * c->top_k;
  int32_t fullest = 0;
  for (int32_t e = 0; e < E; e++) fullest = counts[e] > fullest ? counts[e] : fullest;
  if (fullest <= capacity) return EPX_SUCCESS;
  /* queue [sum counts]: each expert's routes in queue order, from offsets [E+1]. */
  int64_t *offsets = malloc(sizeof(int64_t) * ((size_t)E + 1));
  int64_t *queue = malloc(sizeof(int64_t) * (size_t)(routes ? routes : 1));
  route_candidate *cand = malloc(sizeof(route_candidate) * (size_t)fullest);
  if (!offsets || !queue || !cand)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, EPX_ROUTE_ERR_OOM, "epx_route", (long long)T);
  offsets[0] = 0;
  for (int32_t e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
  for (int64_t r = 0; r < routes; r++)
    if (idx[r] >= 0) queue[offsets[idx[r]] + loc[r]] = r;
  for (int32_t e = 0; e < E; e++) {
    const int64_t n = counts[e], *mine = queue + offsets[e];
    if (n <= capacity) continue;
    for (int64_t i = 0; i < n; i++)
      cand[i] = (route_candidate){route_key(c, mine[i], w, base), i, mine[i]};
    route_keep_best(cand, n, capacity);
    for (int64_t i = capacity; i < n; i++) loc[cand[i].route] = -1;
    int32_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
      const int64_t r = mine[i];
      if (loc[r] >= 0) loc[r] = kept++;
      else idx[r] = -1;
    }
  }
fail:
  free(offsets);
  free(queue);
  free(cand);
  return status;
}

/* Spec step 8: each token's kept weights renormalised over its kept routes. */
static void route_renormalize_kept(const epx_route_config_t *c, int64_t T, const int32_t *idx,
                                   float *w, const float *base) {
  const int32_t K = c->top_k;
  for (int64_t t = 0; t < T; t++) {
    const float sum = route_weight_sum(base + t * K, idx + t * K, K);
    for (int32_t k = 0; k < K; k++) {
      const int64_t r = t * K + k;
      if (idx[r] >= 0) w[r] = (sum > 0.0f ? base[r] / sum : 0.0f) * c->scaling_factor;
    }
  }
}

/* Locations and drops (spec steps 6-8): idx [T, K] (-1 = no route), w and
 * base [T, K] in, loc [T, K] and counts [E] out; dropped routes get -1 / 0 /
 * -1; with renormalize_after_drop the kept weights are renormalised. */
static epx_status_t route_locate(const epx_route_config_t *c, int64_t T, int32_t *idx, float *w,
                                 const float *base, int32_t *loc, int32_t *counts,
                                 int32_t capacity) {
  const int32_t K = c->top_k, E = c->num_experts;
  const int64_t routes = T * K;
  memset(counts, 0, sizeof(int32_t) * (size_t)E);
  if (c->queue_order == EPX_QUEUE_BY_TOKEN) {
    for (int64_t r = 0; r < routes; r++) loc[r] = idx[r] < 0 ? -1 : counts[idx[r]]++;
  } else {
    for (int32_t k = 0; k < K; k++)
      for (int64_t r = k; r < routes; r += K) loc[r] = idx[r] < 0 ? -1 : counts[idx[r]]++;
  }
  if (c->capacity_mode) {
    if (c->drop_policy == EPX_DROP_BY_POSITION) {
      for (int64_t r = 0; r < routes; r++)
        if (loc[r] >= capacity) idx[r] = -1;
    } else {
      const epx_status_t status = route_drop_ranked(c, T, idx, w, base, loc, counts, capacity);
      if (status != EPX_SUCCESS) return status;
    }
    for (int64_t r = 0; r < routes; r++) {
      if (idx[r] < 0) {
        w[r] = 0.0f;
        loc[r] = -1;
      }
    }
  }
  /* Dropless too: the token pass left the weights unnormalised (spec step
   * 5), so step 8 is what renormalises them; nothing was dropped, so it is
   * over the K chosen. */
  if (c->renormalize_after_drop) route_renormalize_kept(c, T, idx, w, base);
  return EPX_SUCCESS;
}

/* What a block of tokens hands back to the sequential part of a call. */
typedef struct route_block {
  int64_t fault_token; /* first token the call must refuse, or -1 */
  int32_t fault_slot;  /* -1: that token has a NaN/Inf logit; k: topk_idx[token, k] disagrees */
  int64_t nonfinite;   /* tokens dropped for NaN/Inf logits */
  int64_t valid;       /* tokens that count in the losses */
  double z_sum;        /* sum over valid tokens of logsumexp^2 */
} route_block;

/* Per-route arrays of the token pass. */
typedef struct route_arrays {
  int32_t *idx;     /* [T, K] chosen, then kept */
  float *w;         /* [T, K] weights */
  float *base;      /* [T, K] base weights b (spec step 5) */
  int32_t *aux_sel; /* [T, K] plain top-k of q (EPX_AUX_COUNTS_PLAIN_TOPK), or NULL */
  uint8_t *valid;   /* [T] the token counts in losses */
} route_arrays;

/* One finite, real token t (spec steps 1-5): its routes, and its aux scores
 * into prob [B, E] (or NULL); returns its logsumexp^2 when want_z. */
static double route_token(const epx_route_config_t *c, route_state *st, const float *row,
                          int64_t t, int want_z, const route_arrays *a, double *prob) {
  const int32_t E = c->num_experts, K = c->top_k;
  int32_t *ti = a->idx + (size_t)t * K;
  float *tw = a->w + (size_t)t * K, *tb = a->base + (size_t)t * K;
  const double lse = route_select(st, row, st->p, ti);
  route_base_weights(st, st->p, ti, tb);
  const int renorm = c->renormalize && !c->renormalize_after_drop;
  const float sum = renorm ? route_weight_sum(tb, NULL, K) : 1.0f;
  for (int32_t k = 0; k < K; k++) {
    float v = tb[k];
    /* Chosen scores that all underflowed to 0 (a bias can pick them) give
     * weight 0 rather than 0/0. */
    if (renorm) v = sum > 0.0f ? v / sum : 0.0f;
    tw[k] = v * c->scaling_factor;
  }
  if (prob || a->aux_sel) {
    route_aux_scores(st, row, st->p);
    if (a->aux_sel) route_plain_topk(st, st->q, a->aux_sel + (size_t)t * K);
    if (prob) {
      const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
      double *pr = prob + (size_t)(t % B) * (size_t)E;
      for (int32_t e = 0; e < E; e++) pr[e] += st->q[e];
    }
  }
  if (!want_z) return 0.0;
  const double l = c->score_fn == EPX_SCORE_SOFTMAX ? lse : route_logsumexp(row, E);
  return l * l;
}

/* Routes tokens [begin, end): a->idx, w, base, aux_sel, valid; the block's
 * sums in blk, and its sums of q [B, E] in prob (or NULL). */
static void route_tokens(const epx_route_config_t *c, route_state *st, const float *logits,
                         int64_t begin, int64_t end, int want_z, const route_arrays *a,
                         route_block *blk, double *prob) {
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  *blk = (route_block){-1, -1, 0, 0, 0.0};
  if (prob) memset(prob, 0, sizeof(double) * (size_t)B * (size_t)E);
  for (int64_t t = begin; t < end; t++) {
    const float *row = logits + (size_t)t * E;
    const int real = route_token_real(c, t);
    a->valid[t] = 0;
    if (real && route_first_nonfinite(row, E) >= 0) {
      if (c->nonfinite == EPX_NONFINITE_ERROR) {
        blk->fault_token = t;
        return;
      }
      blk->nonfinite++;
    } else if (real) {
      a->valid[t] = 1;
      blk->valid++;
      blk->z_sum += route_token(c, st, row, t, want_z, a, prob);
      continue;
    }
    for (int32_t k = 0; k < K; k++) {
      a->idx[(size_t)t * K + k] = -1;
      a->w[(size_t)t * K + k] = 0.0f;
      a->base[(size_t)t * K + k] = 0.0f;
      if (a->aux_sel) a->aux_sel[(size_t)t * K + k] = -1;
    }
  }
}

/* The aux loss (epx.h): coeff * E * sum_{b,e} P[b,e] F[b,e] / D, with P
 * summed over the blocks in order. */
static double route_aux_loss(const epx_route_config_t *c, int64_t T, int64_t blocks,
                             int64_t valid, const double *prob, const int32_t *sel,
                             const uint8_t *valid_tokens, double *F) {
  const int32_t E = c->num_experts;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  const size_t BE = (size_t)B * (size_t)E;
  route_aux_counts(c, T, sel, valid_tokens, F);
  double aux = 0.0;
  for (size_t i = 0; i < BE; i++) {
    double p = 0.0;
    for (int64_t b = 0; b < blocks; b++) p += prob[(size_t)b * BE + i];
    aux += p * F[c->aux_loss_expert_counts ? i % (size_t)E : i];
  }
  return (double)c->aux_loss_coeff * E * aux / epx_route_aux_denominator(c, valid);
}

/* The first refusal of the token pass, if any; sums the blocks otherwise. */
static epx_status_t route_blocks_verdict(const char *fn, const float *logits, int32_t E,
                                         const route_block *block, int64_t blocks,
                                         int64_t *nonfinite, int64_t *valid, double *z_sum) {
  *nonfinite = *valid = 0;
  *z_sum = 0.0;
  for (int64_t b = 0; b < blocks; b++) {
    if (block[b].fault_token >= 0)
      return epx_route_refuse_nonfinite(fn, logits + (size_t)block[b].fault_token * E, E,
                                        block[b].fault_token);
    *nonfinite += block[b].nonfinite;
    *valid += block[b].valid;
    *z_sum += block[b].z_sum;
  }
  return EPX_SUCCESS;
}

epx_status_t epx_cpu_route(const epx_route_config_t *c, int64_t T, const float *logits,
                           const float *bias, epx_route_output_t *out) {
  static const char fn[] = "epx_route";
  epx_status_t status = EPX_SUCCESS;
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  const size_t routes = (size_t)T * (size_t)K, slots = routes ? routes : 1;
  const int64_t blocks = (T + ROUTE_BLOCK - 1) / ROUTE_BLOCK, nb = blocks ? blocks : 1;
  const int want_aux = out->aux_loss != NULL, want_z = out->z_loss != NULL;
  const int plain = want_aux && c->aux_counts == EPX_AUX_COUNTS_PLAIN_TOPK && !c->aux_loss_expert_counts;
  const int threads = route_threads(T, E);
  route_state *states = NULL;
  if ((status = route_check_bias(fn, E, bias)) != EPX_SUCCESS) return status;
  if ((status = route_states_create(fn, c, bias, threads, &states)) != EPX_SUCCESS) return status;
  route_arrays a = {malloc(sizeof(int32_t) * slots), malloc(sizeof(float) * slots),
                    malloc(sizeof(float) * slots), plain ? malloc(sizeof(int32_t) * slots) : NULL,
                    malloc((size_t)(T ? T : 1))};
  int32_t *loc = malloc(sizeof(int32_t) * slots);
  int32_t *sel = want_aux && !plain ? malloc(sizeof(int32_t) * slots) : NULL; /* pre-drop idx */
  int32_t *counts = malloc(sizeof(int32_t) * (size_t)E);
  route_block *block = malloc(sizeof(route_block) * (size_t)nb);
  /* [blocks, B, E] each block's sums of q, and F [B, E], for the aux loss. */
  double *prob = want_aux ? malloc(sizeof(double) * (size_t)nb * B * E) : NULL;
  double *F = want_aux ? malloc(sizeof(double) * (size_t)B * E) : NULL;
  if (!a.idx || !a.w || !a.base || (plain && !a.aux_sel) || !a.valid || !loc ||
      (want_aux && (!sel && !plain)) || !counts || !block || (want_aux && (!prob || !F)))
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, EPX_ROUTE_ERR_OOM, fn, (long long)T);
  ROUTE_PARALLEL_FOR
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t begin = b * ROUTE_BLOCK, end = begin + ROUTE_BLOCK < T ? begin + ROUTE_BLOCK : T;
    route_tokens(c, &states[route_thread()], logits, begin, end, want_z, &a, &block[b],
                 prob ? prob + (size_t)b * B * E : NULL);
  }
  int64_t nonfinite, valid;
  double z_sum;
  EPX_CHECK(route_blocks_verdict(fn, logits, E, block, blocks, &nonfinite, &valid, &z_sum));
  if (sel && routes) memcpy(sel, a.idx, sizeof(int32_t) * routes);
  const int32_t capacity = epx_route_capacity(c, T);
  EPX_CHECK(route_locate(c, T, a.idx, a.w, a.base, loc, counts, capacity));
  double aux = 0.0, z = 0.0;
  if (valid > 0) {
    if (want_aux) aux = route_aux_loss(c, T, blocks, valid, prob, plain ? a.aux_sel : sel, a.valid, F);
    z = (double)c->z_loss_coeff * z_sum / (double)valid;
  }
  if (routes) {
    memcpy(out->topk_idx, a.idx, sizeof(int32_t) * routes);
    memcpy(out->topk_w, a.w, sizeof(float) * routes);
    if (out->locations) memcpy(out->locations, loc, sizeof(int32_t) * routes);
  }
  if (out->expert_counts) memcpy(out->expert_counts, counts, sizeof(int32_t) * (size_t)E);
  if (want_aux) *out->aux_loss = (float)aux;
  if (want_z) *out->z_loss = (float)z;
  out->capacity = capacity;
  out->nonfinite_tokens = nonfinite;
fail:
  route_states_free(states, threads);
  free(a.idx);
  free(a.w);
  free(a.base);
  free(a.aux_sel);
  free(a.valid);
  free(loc);
  free(sel);
  free(counts);
  free(block);
  free(prob);
  free(F);
  return status;
}
