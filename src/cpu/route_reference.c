/* The routing reference: src/core/route_spec.h computed in float64 (but the
 * selection's comparisons, which the spec makes in float32) in the
 * plainest way (argmax loops, a queue walked in order), short enough to read
 * in one sitting. It shares nothing with the fast paths but the spec
 * header's formulas (capacity, priority, group size, aux denominator). Host
 * memory only. Behind epx_reference_route / epx_reference_route_backward. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/route_spec.h"
#include "cpu/cpu.h"

/* Per-token scratch [E] and the call's [T, K] arrays. */
typedef struct ref_scratch {
  double *row, *p, *s, *q, *gscore, *grad;
  int *allowed, *mask, *kept;
} ref_scratch;

static void ref_scratch_free(ref_scratch *x) {
  free(x->row);
  free(x->p);
  free(x->s);
  free(x->q);
  free(x->gscore);
  free(x->grad);
  free(x->allowed);
  free(x->mask);
  free(x->kept);
}

static epx_status_t ref_scratch_init(const char *fn, int32_t E, ref_scratch *x) {
  x->row = malloc(sizeof(double) * (size_t)E);
  x->p = malloc(sizeof(double) * (size_t)E);
  x->s = malloc(sizeof(double) * (size_t)E);
  x->q = malloc(sizeof(double) * (size_t)E);
  x->gscore = malloc(sizeof(double) * (size_t)E);
  x->grad = malloc(sizeof(double) * (size_t)E);
  x->allowed = malloc(sizeof(int) * (size_t)E);
  x->mask = malloc(sizeof(int) * (size_t)E);
  x->kept = malloc(sizeof(int) * (size_t)E);
  if (x->row && x->p && x->s && x->q && x->gscore && x->grad && x->allowed && x->mask && x->kept)
    return EPX_SUCCESS;
  ref_scratch_free(x);
  return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d experts", fn, E);
}

/* Index of the largest v[i] with mask[i] (the first on ties), or -1. */
static int32_t ref_argmax(const double *v, const int *mask, int32_t n) {
  int32_t best = -1;
  for (int32_t i = 0; i < n; i++)
    if (mask[i] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

static double ref_softmax(const double *row, int32_t E, double *out) {
  double max = row[0], sum = 0.0;
  for (int32_t e = 1; e < E; e++) max = fmax(max, row[e]);
  for (int32_t e = 0; e < E; e++) sum += exp(row[e] - max);
  for (int32_t e = 0; e < E; e++) out[e] = exp(row[e] - max) / sum;
  return max + log(sum);
}

/* Step 1: p [E]; the logits themselves for softmax after top-k. */
static void ref_scores(const epx_route_config_t *c, const double *row, double *p) {
  const int32_t E = c->num_experts;
  for (int32_t e = 0; e < E; e++) {
    const double l = row[e];
    switch (c->score_fn) {
      case EPX_SCORE_SIGMOID: p[e] = 1.0 / (1.0 + exp(-l)); break;
      case EPX_SCORE_SQRT_SOFTPLUS: p[e] = sqrt(l > EPX_SOFTPLUS_THRESHOLD ? l : log1p(exp(l))); break;
      case EPX_SCORE_SOFTMAX_AFTER_TOPK: p[e] = l; break;
      case EPX_SCORE_SOFTMAX: break;
    }
  }
  if (c->score_fn == EPX_SCORE_SOFTMAX) ref_softmax(row, E, p);
}

/* Steps 2-4: chosen [K] from the selection scores x->s. */
static void ref_select(const epx_route_config_t *c, ref_scratch *x, int32_t *chosen) {
  const int32_t E = c->num_experts, K = c->top_k;
  for (int32_t e = 0; e < E; e++) x->allowed[e] = 1;
  if (c->num_groups > 1) {
    const int32_t G = c->num_groups, size = E / G;
    const int32_t n = epx_route_group_top(c->group_score_experts, size);
    for (int32_t g = 0; g < G; g++) {
      float sum = 0.0f; /* spec step 3: a float32 sum, best first */
      for (int32_t i = 0; i < size; i++) x->mask[i] = 1; /* the group's members, by offset */
      for (int32_t j = 0; j < n; j++) {
        const int32_t best = ref_argmax(x->s + (size_t)g * size, x->mask, size);
        x->mask[best] = 0;
        sum += (float)x->s[(size_t)g * size + best];
      }
      x->gscore[g] = sum;
    }
    for (int32_t g = 0; g < G; g++) x->mask[g] = 1, x->kept[g] = 0;
    for (int32_t i = 0; i < c->topk_groups; i++) {
      const int32_t g = ref_argmax(x->gscore, x->mask, G);
      x->kept[g] = 1;
      x->mask[g] = 0;
    }
    for (int32_t e = 0; e < E; e++) x->allowed[e] = x->kept[e / size];
  }
  for (int32_t k = 0; k < K; k++) {
    chosen[k] = ref_argmax(x->s, x->allowed, E);
    x->allowed[chosen[k]] = 0;
  }
}

/* Step 5's base weights b [K]. */
static void ref_base(const epx_route_config_t *c, const double *p, const int32_t *chosen,
                     double *b) {
  const int32_t K = c->top_k;
  double max = -INFINITY, sum = 0.0;
  for (int32_t k = 0; k < K; k++) b[k] = p[chosen[k]];
  if (c->score_fn != EPX_SCORE_SOFTMAX_AFTER_TOPK) return;
  for (int32_t k = 0; k < K; k++) max = fmax(max, b[k]);
  for (int32_t k = 0; k < K; k++) sum += exp(b[k] - max);
  for (int32_t k = 0; k < K; k++) b[k] = exp(b[k] - max) / sum;
}

/* epx.h's q [E]. */
static void ref_aux_q(const epx_route_config_t *c, const double *row, const double *p, double *q) {
  const int32_t E = c->num_experts;
  double total = 0.0;
  if (c->score_fn == EPX_SCORE_SOFTMAX) memcpy(q, p, sizeof(double) * (size_t)E);
  if (c->score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK) ref_softmax(row, E, q);
  if (c->score_fn != EPX_SCORE_SIGMOID && c->score_fn != EPX_SCORE_SQRT_SOFTPLUS) return;
  for (int32_t e = 0; e < E; e++) total += p[e];
  for (int32_t e = 0; e < E; e++) q[e] = total > 0 ? p[e] / total : 0.0;
}

/* A token routes when real and finite. */
static int ref_token_valid(const epx_route_config_t *c, const float *logits, int64_t t) {
  if (c->token_mask && !c->token_mask[t]) return 0;
  for (int32_t e = 0; e < c->num_experts; e++)
    if (!isfinite(logits[t * c->num_experts + e])) return 0;
  return 1;
}

/* What the token pass gives the queue and loss passes. */
typedef struct ref_tokens {
  int32_t *chosen, *plain; /* [T, K] pre-drop selection, plain top-k of q */
  double *w, *base;        /* [T, K] */
  double *qsum;            /* [B, E] */
  uint8_t *valid;          /* [T] */
  int64_t nvalid;
  double zsum;
} ref_tokens;

static void ref_tokens_free(ref_tokens *r) {
  free(r->chosen);
  free(r->plain);
  free(r->w);
  free(r->base);
  free(r->qsum);
  free(r->valid);
}

/* Steps 1-5 for every token, and the loss sums. */
static epx_status_t ref_route_tokens(const char *fn, const epx_route_config_t *c, int64_t T,
                                     const float *logits, const float *bias, ref_scratch *x,
                                     ref_tokens *r) {
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  const size_t slots = (size_t)T * K + 1;
  memset(r, 0, sizeof *r);
  r->chosen = malloc(sizeof(int32_t) * slots);
  r->plain = malloc(sizeof(int32_t) * slots);
  r->w = malloc(sizeof(double) * slots);
  r->base = malloc(sizeof(double) * slots);
  r->qsum = calloc((size_t)B * E, sizeof(double));
  r->valid = malloc((size_t)T + 1);
  if (!r->chosen || !r->plain || !r->w || !r->base || !r->qsum || !r->valid) {
    ref_tokens_free(r);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, EPX_ROUTE_ERR_OOM, fn, (long long)T);
  }
  for (int64_t t = 0; t < T; t++) {
    int32_t *ch = r->chosen + t * K, *pl = r->plain + t * K;
    double *w = r->w + t * K, *b = r->base + t * K;
    r->valid[t] = (uint8_t)ref_token_valid(c, logits, t);
    if (!r->valid[t]) {
      if ((!c->token_mask || c->token_mask[t]) && c->nonfinite == EPX_NONFINITE_ERROR) {
        ref_tokens_free(r);
        return epx_route_refuse_nonfinite(fn, logits + t * E, E, t);
      }
      for (int32_t k = 0; k < K; k++) ch[k] = pl[k] = -1, w[k] = b[k] = 0.0;
      continue;
    }
    r->nvalid++;
    for (int32_t e = 0; e < E; e++) x->row[e] = logits[t * E + e];
    ref_scores(c, x->row, x->p);
    /* Spec step 2: selection compares float32 scores plus the bias, added
     * in float32. */
    for (int32_t e = 0; e < E; e++) x->s[e] = (double)((float)x->p[e] + (bias ? bias[e] : 0.0f));
    ref_select(c, x, ch);
    ref_base(c, x->p, ch, b);
    double sum = 0.0;
    for (int32_t k = 0; k < K; k++) sum += b[k];
    const int renorm = c->renormalize && !c->renormalize_after_drop;
    for (int32_t k = 0; k < K; k++)
      w[k] = (renorm ? (sum > 0 ? b[k] / sum : 0.0) : b[k]) * c->scaling_factor;
    ref_aux_q(c, x->row, x->p, x->q);
    for (int32_t e = 0; e < E; e++) r->qsum[(size_t)(t % B) * E + e] += x->q[e], x->allowed[e] = 1;
    for (int32_t k = 0; k < K; k++) {
      pl[k] = ref_argmax(x->q, x->allowed, E);
      x->allowed[pl[k]] = 0;
    }
    double lse = ref_softmax(x->row, E, x->grad);
    r->zsum += lse * lse;
  }
  return EPX_SUCCESS;
}

/* The key by which route r stays (step 7). */
static double ref_key(const epx_route_config_t *c, const ref_tokens *r, int64_t route) {
  return epx_route_drop_key(c->drop_policy, r->w[route], r->base[route],
                            epx_route_priority(c->random_seed, route));
}

/* Steps 6-8: queue, locations, drops, renormalisation after the drop. */
static epx_status_t ref_queue(const char *fn, const epx_route_config_t *c, int64_t T,
                              ref_tokens *r, int32_t capacity, int32_t *idx, int32_t *loc,
                              int32_t *counts) {
  const int32_t E = c->num_experts, K = c->top_k;
  const int64_t routes = T * K;
  int64_t *queue = malloc(sizeof(int64_t) * ((size_t)routes + 1)), n = 0;
  int64_t *mine = malloc(sizeof(int64_t) * ((size_t)routes + 1));
  int *keep = malloc(sizeof(int) * ((size_t)routes + 1));
  if (!queue || !mine || !keep) {
    free(queue), free(mine), free(keep);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, EPX_ROUTE_ERR_OOM, fn, (long long)T);
  }
  if (c->queue_order == EPX_QUEUE_BY_CHOICE) {
    for (int32_t k = 0; k < K; k++)
      for (int64_t t = 0; t < T; t++) queue[n++] = t * K + k;
  } else {
    for (int64_t i = 0; i < routes; i++) queue[n++] = i;
  }
  for (int32_t e = 0; e < E; e++) {
    int64_t m = 0;
    for (int64_t i = 0; i < routes; i++)
      if (r->chosen[queue[i]] == e) mine[m++] = queue[i];
    counts[e] = (int32_t)m;
    for (int64_t i = 0; i < m; i++) keep[i] = !c->capacity_mode || m <= capacity;
    if (c->capacity_mode && m > capacity) {
      for (int64_t j = 0; j < capacity; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < m; i++) {
          if (keep[i]) continue;
          if (c->drop_policy == EPX_DROP_BY_POSITION) { best = i; break; }
          if (best < 0 || ref_key(c, r, mine[i]) > ref_key(c, r, mine[best])) best = i;
        }
        keep[best] = 1;
      }
    }
    int32_t slot = 0;
    for (int64_t i = 0; i < m; i++) {
      idx[mine[i]] = keep[i] ? e : -1;
      loc[mine[i]] = keep[i] ? slot++ : -1;
      if (!keep[i]) r->w[mine[i]] = 0.0;
    }
  }
  for (int64_t i = 0; i < routes; i++)
    if (r->chosen[i] < 0) idx[i] = loc[i] = -1;
  free(queue), free(mine), free(keep);
  if (!c->renormalize_after_drop) return EPX_SUCCESS;
  for (int64_t t = 0; t < T; t++) {
    double sum = 0.0;
    for (int32_t k = 0; k < K; k++) sum += idx[t * K + k] >= 0 ? r->base[t * K + k] : 0.0;
    for (int32_t k = 0; k < K; k++)
      if (idx[t * K + k] >= 0)
        r->w[t * K + k] = (sum > 0 ? r->base[t * K + k] / sum : 0.0) * c->scaling_factor;
  }
  return EPX_SUCCESS;
}

/* F [B, E] of the aux loss. */
static void ref_aux_counts(const epx_route_config_t *c, int64_t T, const ref_tokens *r, double *F) {
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  memset(F, 0, sizeof(double) * (size_t)B * E);
  if (c->aux_loss_expert_counts) {
    for (int32_t e = 0; e < E; e++) F[e] = c->aux_loss_expert_counts[e];
    return;
  }
  const int32_t *sel = c->aux_counts == EPX_AUX_COUNTS_PLAIN_TOPK ? r->plain : r->chosen;
  const int32_t slots = c->aux_counts == EPX_AUX_COUNTS_FIRST_CHOICE ? 1 : K;
  for (int64_t t = 0; t < T; t++)
    for (int32_t k = 0; r->valid[t] && k < slots; k++) F[(t % B) * E + sel[t * K + k]] += 1.0;
}

/* The scratch of E experts and steps 1-5 of every token; on failure
 * nothing is left allocated. */
static epx_status_t ref_begin(const char *fn, const epx_route_config_t *c, int64_t T, const float *logits,
                              const float *bias, ref_scratch *x, ref_tokens *r) {
  epx_status_t status = ref_scratch_init(fn, c->num_experts, x);
  if (status != EPX_SUCCESS) return status;
  status = ref_route_tokens(fn, c, T, logits, bias, x, r);
  if (status != EPX_SUCCESS) ref_scratch_free(x);
  return status;
}

epx_status_t epx_cpu_reference_route(const epx_route_config_t *c, int64_t T, const float *logits,
                                     const float *bias, int32_t *topk_idx, double *topk_w,
                                     int32_t *locations, int32_t *expert_counts, double *aux_loss,
                                     double *z_loss, int32_t *capacity) {
  static const char fn[] = "epx_reference_route";
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  ref_scratch x;
  ref_tokens r;
  epx_status_t status = ref_begin(fn, c, T, logits, bias, &x, &r);
  if (status != EPX_SUCCESS) return status;
  const int32_t C = epx_route_capacity(c, T);
  int32_t *loc = malloc(sizeof(int32_t) * ((size_t)T * K + 1));
  int32_t *counts = malloc(sizeof(int32_t) * (size_t)E);
  double *F = malloc(sizeof(double) * (size_t)B * E);
  if (!loc || !counts || !F)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, EPX_ROUTE_ERR_OOM, fn, (long long)T);
  EPX_CHECK(ref_queue(fn, c, T, &r, C, topk_idx, loc, counts));
  for (int64_t i = 0; i < T * K; i++) topk_w[i] = r.w[i];
  if (locations) memcpy(locations, loc, sizeof(int32_t) * (size_t)(T * K));
  if (expert_counts) memcpy(expert_counts, counts, sizeof(int32_t) * (size_t)E);
  if (capacity) *capacity = C;
  if (aux_loss) {
    double sum = 0.0;
    ref_aux_counts(c, T, &r, F);
    for (int64_t i = 0; i < (int64_t)B * E; i++) sum += r.qsum[i] * F[i];
    *aux_loss = r.nvalid ? c->aux_loss_coeff * E * sum / epx_route_aux_denominator(c, r.nvalid) : 0.0;
  }
  if (z_loss) *z_loss = r.nvalid ? c->z_loss_coeff * r.zsum / (double)r.nvalid : 0.0;
fail:
  free(loc);
  free(counts);
  free(F);
  ref_tokens_free(&r);
  ref_scratch_free(&x);
  return status;
}

/* One valid token's gradient row into x->grad: through the weights (steps 5
 * and 8), the aux scores (h [E] = d loss / d q) and the z loss (zg = d loss
 * / d lse^2). */
static void ref_token_grad(const epx_route_config_t *c, const int32_t *chosen, const int32_t *fwd,
                           const float *gw, const double *h, double zg, ref_scratch *x) {
  const int32_t E = c->num_experts, K = c->top_k;
  double *gp = x->s, *grad = x->grad, b[4096], gb[4096], sum = 0.0, dot = 0.0;
  ref_scores(c, x->row, x->p);
  ref_base(c, x->p, chosen, b);
  for (int32_t e = 0; e < E; e++) gp[e] = grad[e] = 0.0;
  for (int32_t k = 0; k < K; k++) {
    gb[k] = 0.0;
    if (!c->renormalize_after_drop || fwd[k] >= 0) sum += b[k];
    if (gw && fwd[k] >= 0) dot += gw[k] * b[k];
  }
  for (int32_t k = 0; gw && k < K; k++) {
    const double g = fwd[k] >= 0 ? gw[k] : 0.0;
    if (!c->renormalize) gb[k] = c->scaling_factor * g;
    else if (sum > 0 && (!c->renormalize_after_drop || fwd[k] >= 0))
      gb[k] = c->scaling_factor * (g / sum - dot / (sum * sum));
  }
  if (c->score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK) {
    double bg = 0.0;
    for (int32_t k = 0; k < K; k++) bg += gb[k] * b[k];
    for (int32_t k = 0; k < K; k++) grad[chosen[k]] += b[k] * (gb[k] - bg);
  } else {
    for (int32_t k = 0; k < K; k++) gp[chosen[k]] += gb[k];
  }
  if (h) {
    double total = 0.0, hq = 0.0;
    ref_aux_q(c, x->row, x->p, x->q);
    for (int32_t e = 0; e < E; e++) total += x->p[e], hq += h[e] * x->q[e];
    for (int32_t e = 0; e < E; e++) {
      if (c->score_fn == EPX_SCORE_SOFTMAX) gp[e] += h[e];
      else if (c->score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK) grad[e] += x->q[e] * (h[e] - hq);
      else if (total > 0) gp[e] += (h[e] - hq) / total;
    }
  }
  double pg = 0.0;
  for (int32_t e = 0; e < E; e++) pg += gp[e] * x->p[e];
  for (int32_t e = 0; e < E; e++) {
    const double p = x->p[e], l = x->row[e];
    switch (c->score_fn) {
      case EPX_SCORE_SOFTMAX: grad[e] += p * (gp[e] - pg); break;
      case EPX_SCORE_SIGMOID: grad[e] += gp[e] * p * (1.0 - p); break;
      case EPX_SCORE_SQRT_SOFTPLUS:
        if (p > 0) grad[e] += gp[e] * (l > EPX_SOFTPLUS_THRESHOLD ? 1.0 : 1.0 / (1.0 + exp(-l))) / (2.0 * p);
        break;
      case EPX_SCORE_SOFTMAX_AFTER_TOPK: break;
    }
  }
  const double lse = ref_softmax(x->row, E, x->q);
  for (int32_t e = 0; e < E; e++) grad[e] += 2.0 * zg * lse * x->q[e];
}

epx_status_t epx_cpu_reference_route_backward(const epx_route_config_t *c, int64_t T,
                                              const float *logits, const float *bias,
                                              const int32_t *topk_idx, const float *grad_topk_w,
                                              double grad_aux_loss, double grad_z_loss,
                                              double *grad_logits) {
  static const char fn[] = "epx_reference_route_backward";
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  EPX_REQUIRE(K <= 4096, "%s: top_k %d is above the reference's 4096", fn, K);
  ref_scratch x;
  ref_tokens r;
  epx_status_t status = ref_begin(fn, c, T, logits, bias, &x, &r);
  if (status != EPX_SUCCESS) return status;
  double *h = malloc(sizeof(double) * (size_t)B * E);
  if (!h) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, EPX_ROUTE_ERR_OOM, fn, (long long)T);
  ref_aux_counts(c, T, &r, h);
  const double aux_scale = r.nvalid ? grad_aux_loss * c->aux_loss_coeff * E /
                                          epx_route_aux_denominator(c, r.nvalid) : 0.0;
  for (int64_t i = 0; i < (int64_t)B * E; i++) h[i] *= aux_scale;
  const double zg = r.nvalid ? grad_z_loss * c->z_loss_coeff / (double)r.nvalid : 0.0;
  for (int64_t i = 0; i < T * K; i++) {
    const int32_t fwd = topk_idx[i];
    if (r.valid[i / K] && fwd != -1 && fwd != r.chosen[i])
      EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT, EPX_ROUTE_ERR_MISMATCH, fn, (long long)(i / K),
               (int)(i % K), fwd, r.chosen[i]);
  }
  for (int64_t t = 0; t < T; t++) {
    double *out = grad_logits + t * E;
    if (!r.valid[t]) {
      for (int32_t e = 0; e < E; e++) out[e] = 0.0;
      continue;
    }
    for (int32_t e = 0; e < E; e++) x.row[e] = logits[t * E + e];
    ref_token_grad(c, r.chosen + t * K, topk_idx + t * K, grad_topk_w ? grad_topk_w + t * K : NULL,
                   aux_scale != 0.0 ? h + (t % B) * E : NULL, zg, &x);
    for (int32_t e = 0; e < E; e++) out[e] = x.grad[e];
  }
fail:
  free(h);
  ref_tokens_free(&r);
  ref_scratch_free(&x);
  return status;
}
