/* Routing backward on the CPU (spec: src/core/route_spec.h; the gradient of
 * every weight and loss formula of epx.h, in float64 on the float32 scores).
 * Pass 1 recomputes every token's selection and checks it against the
 * forward's topk_idx, and the aux counts F need all tokens; pass 2 writes
 * grad_logits, so a refused call leaves it untouched. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/route_spec.h"
#include "cpu/cpu.h"
#include "cpu/route_internal.h"

/* What a block of pass 1 hands back. */
typedef struct route_check {
  int64_t fault_token; /* first token to refuse, or -1 */
  int32_t fault_slot;  /* -1: a NaN/Inf logit; k: topk_idx[token, k] disagrees */
  int64_t valid;
} route_check;

/* Pass 1 over tokens [begin, end): scores p [T, E], the recomputed selection
 * chosen [T, K] (and the plain top-k aux_sel [T, K] when not NULL), valid
 * [T]; stops at the block's first token to refuse. */
static void route_recompute(const epx_route_config_t *c, route_state *st, const float *logits,
                            const int32_t *topk_idx, int64_t begin, int64_t end, float *p,
                            int32_t *chosen, int32_t *aux_sel, double *lse, uint8_t *valid,
                            route_check *blk) {
  const int32_t E = c->num_experts, K = c->top_k;
  *blk = (route_check){-1, -1, 0};
  for (int64_t t = begin; t < end; t++) {
    const float *row = logits + (size_t)t * E;
    valid[t] = route_token_real(c, t) && route_first_nonfinite(row, E) < 0;
    if (!valid[t]) {
      if (route_token_real(c, t) && c->nonfinite == EPX_NONFINITE_ERROR) {
        blk->fault_token = t;
        return;
      }
      continue;
    }
    blk->valid++;
    int32_t *ch = chosen + (size_t)t * K;
    lse[t] = route_select(st, row, p + (size_t)t * E, ch);
    if (aux_sel) {
      route_aux_scores(st, row, p + (size_t)t * E);
      route_plain_topk(st, st->q, aux_sel + (size_t)t * K);
    }
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

/* What pass 2 needs besides one token's row. */
typedef struct route_grad_args {
  const float *p;            /* [T, E] */
  const int32_t *chosen;     /* [T, K] */
  const double *lse;         /* [T] logsumexp of softmax scores (NAN for the others) */
  const uint8_t *valid;      /* [T] */
  const int32_t *topk_idx;   /* [T, K] the forward's */
  const float *grad_topk_w;  /* [T, K] or NULL */
  const double *aux_grad;    /* [B, E] d loss / d q[t, e] of sequence b, or NULL */
  double z_grad;             /* 2 * grad_z_loss * z_loss_coeff / T_valid, or 0 */
} route_grad_args;

/* d loss / d b [K] of one token through scaling and renormalisation (spec
 * steps 5 and 8); dropped slots carry none. */
static void route_grad_base(const epx_route_config_t *c, const float *b, const int32_t *fwd,
                            const float *gw, double *gb) {
  const int32_t K = c->top_k;
  const double scale = c->scaling_factor;
  for (int32_t k = 0; k < K; k++) gb[k] = 0.0;
  if (!gw) return;
  if (!c->renormalize) {
    for (int32_t k = 0; k < K; k++)
      if (fwd[k] >= 0) gb[k] = scale * gw[k];
    return;
  }
  /* w_k = s * b_k / S; S over all K chosen (dropped ones included), or over
   * the kept ones after the drop. */
  const double sum = route_weight_sum(b, c->renormalize_after_drop ? fwd : NULL, K);
  if (!(sum > 0.0)) return;
  double dot = 0.0;
  for (int32_t k = 0; k < K; k++) dot += fwd[k] < 0 ? 0.0 : (double)gw[k] * b[k];
  for (int32_t k = 0; k < K; k++) {
    const int in_sum = !c->renormalize_after_drop || fwd[k] >= 0;
    gb[k] = in_sum ? scale * ((fwd[k] < 0 ? 0.0 : gw[k]) / sum - dot / (sum * sum)) : 0.0;
  }
}

/* d loss / d q [E] (h) into grad_p, or straight into grad_row for the
 * softmax scores of softmax-after-top-k (q = softmax(l)). */
static void route_grad_aux(const route_state *st, const float *row, const float *p,
                           const double *h, double *grad_p, double *grad_row) {
  const int32_t E = st->num_experts;
  switch (st->config->score_fn) {
    case EPX_SCORE_SOFTMAX:
      for (int32_t e = 0; e < E; e++) grad_p[e] += h[e];
      return;
    case EPX_SCORE_SOFTMAX_AFTER_TOPK: {
      route_softmax(row, E, st->q);
      double hq = 0.0;
      for (int32_t e = 0; e < E; e++) hq += h[e] * st->q[e];
      for (int32_t e = 0; e < E; e++) grad_row[e] += st->q[e] * (h[e] - hq);
      return;
    }
    case EPX_SCORE_SIGMOID:
    case EPX_SCORE_SQRT_SOFTPLUS: {
      /* q = p / sum(p): d/dp_j sum_e h_e q_e = (h_j - sum_e h_e q_e) / sum(p). */
      double total = 0.0, hq = 0.0;
      for (int32_t e = 0; e < E; e++) total += p[e];
      if (!(total > 0.0)) return;
      for (int32_t e = 0; e < E; e++) hq += h[e] * p[e];
      hq /= total;
      for (int32_t e = 0; e < E; e++) grad_p[e] += (h[e] - hq) / total;
      return;
    }
  }
}

/* grad_row += d p / d l applied to grad_p (spec step 1's derivative). */
static void route_grad_scores(const route_state *st, const float *row, const float *p,
                              const double *grad_p, double *grad_row) {
  const int32_t E = st->num_experts;
  switch (st->config->score_fn) {
    case EPX_SCORE_SOFTMAX: {
      double dot = 0.0;
      for (int32_t e = 0; e < E; e++) dot += grad_p[e] * p[e];
      for (int32_t e = 0; e < E; e++) grad_row[e] += p[e] * (grad_p[e] - dot);
      return;
    }
    case EPX_SCORE_SIGMOID:
      for (int32_t e = 0; e < E; e++) grad_row[e] += grad_p[e] * p[e] * (1.0 - p[e]);
      return;
    case EPX_SCORE_SQRT_SOFTPLUS:
      /* p = sqrt(sp(l)): dp/dl = sp'(l) / (2 p), sp' = sigmoid (1 above the threshold). */
      for (int32_t e = 0; e < E; e++) {
        if (grad_p[e] == 0.0 || !(p[e] > 0.0f)) continue;
        const double d = row[e] > EPX_SOFTPLUS_THRESHOLD ? 1.0 : 1.0 / (1.0 + exp(-(double)row[e]));
        grad_row[e] += grad_p[e] * d / (2.0 * p[e]);
      }
      return;
    case EPX_SCORE_SOFTMAX_AFTER_TOPK: return; /* p are the logits: grad_p is grad_row's */
  }
}

/* One valid token's grad_logits row (in grad_row, double). */
static void route_token_grad(const epx_route_config_t *c, route_state *st, const float *row,
                             const route_grad_args *a, int64_t t) {
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  const float *p = a->p + (size_t)t * E;
  const int32_t *ch = a->chosen + (size_t)t * K;
  double *grad_p = st->grad_p, *grad_row = st->grad_row, *gb = st->grad_base;
  float *b = st->top_score; /* the selection's scratch, free in pass 2 */
  for (int32_t e = 0; e < E; e++) grad_p[e] = grad_row[e] = 0.0;
  route_base_weights(st, p, ch, b);
  route_grad_base(c, b, a->topk_idx + (size_t)t * K, a->grad_topk_w ? a->grad_topk_w + (size_t)t * K : NULL, gb);
  if (c->score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK) {
    /* b = softmax of the chosen logits: d/dl_j = b_j (gb_j - sum_k gb_k b_k). */
    double dot = 0.0;
    for (int32_t k = 0; k < K; k++) dot += gb[k] * b[k];
    for (int32_t k = 0; k < K; k++) grad_row[ch[k]] += b[k] * (gb[k] - dot);
  } else {
    for (int32_t k = 0; k < K; k++) grad_p[ch[k]] += gb[k];
  }
  if (a->aux_grad) route_grad_aux(st, row, p, a->aux_grad + (size_t)(t % B) * E, grad_p, grad_row);
  route_grad_scores(st, row, p, grad_p, grad_row);
  if (a->z_grad != 0.0) {
    /* softmax(row) and its logsumexp: the scores themselves for softmax. */
    const int own = c->score_fn == EPX_SCORE_SOFTMAX;
    const double lse = own ? a->lse[t] : route_softmax(row, E, st->q);
    const float *sm = own ? p : st->q;
    for (int32_t e = 0; e < E; e++) grad_row[e] += a->z_grad * lse * sm[e];
  }
}

/* Pass 2 over tokens [begin, end): grad_logits rows (zeros for tokens that
 * are not valid). */
static void route_token_grads(const epx_route_config_t *c, route_state *st, const float *logits,
                              const route_grad_args *a, int64_t begin, int64_t end,
                              float *grad_logits) {
  const int32_t E = c->num_experts;
  for (int64_t t = begin; t < end; t++) {
    float *out = grad_logits + (size_t)t * E;
    if (!a->valid[t]) {
      memset(out, 0, sizeof(float) * (size_t)E);
      continue;
    }
    route_token_grad(c, st, logits + (size_t)t * E, a, t);
    /* Written last: grad_logits may be the logits themselves. */
    for (int32_t e = 0; e < E; e++) out[e] = (float)st->grad_row[e];
  }
}

/* The first refusal of pass 1, if any; the valid tokens otherwise. */
static epx_status_t route_check_verdict(const char *fn, const epx_route_config_t *c,
                                        const float *logits, const route_check *block, int64_t blocks,
                                        const int32_t *topk_idx, const int32_t *chosen,
                                        int64_t *valid) {
  const int32_t K = c->top_k;
  *valid = 0;
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t t = block[b].fault_token;
    const int32_t k = block[b].fault_slot;
    if (t >= 0 && k < 0)
      return epx_route_refuse_nonfinite(fn, logits + (size_t)t * c->num_experts, c->num_experts, t);
    if (t >= 0)
      return epx_error(EPX_ERROR_INVALID_ARGUMENT, EPX_ROUTE_ERR_MISMATCH, fn, (long long)t, k,
                       topk_idx[(size_t)t * K + k], chosen[(size_t)t * K + k]);
    *valid += block[b].valid;
  }
  return EPX_SUCCESS;
}

epx_status_t epx_cpu_route_backward(const epx_route_config_t *c, int64_t T, const float *logits,
                                    const float *bias, const int32_t *topk_idx,
                                    const float *grad_topk_w, float grad_aux_loss,
                                    float grad_z_loss, float *grad_logits) {
  static const char fn[] = "epx_route_backward";
  epx_status_t status = EPX_SUCCESS;
  const int32_t E = c->num_experts, K = c->top_k;
  const int32_t B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  const size_t rows = (size_t)T ? (size_t)T : 1;
  const int64_t blocks = (T + ROUTE_BLOCK - 1) / ROUTE_BLOCK;
  const int want_aux = grad_aux_loss != 0.0f && c->aux_loss_coeff != 0.0f;
  const int want_z = grad_z_loss != 0.0f && c->z_loss_coeff != 0.0f;
  const int plain = want_aux && c->aux_counts == EPX_AUX_COUNTS_PLAIN_TOPK && !c->aux_loss_expert_counts;
  const int threads = route_threads(T, E);
  route_state *states = NULL;
  if ((status = route_check_bias(fn, E, bias)) != EPX_SUCCESS) return status;
  if ((status = route_states_create(fn, c, bias, threads, &states)) != EPX_SUCCESS) return status;
  float *p = malloc(sizeof(float) * rows * (size_t)E);          /* [T, E] scores */
  int32_t *chosen = malloc(sizeof(int32_t) * rows * (size_t)K); /* [T, K] recomputed */
  int32_t *aux_sel = plain ? malloc(sizeof(int32_t) * rows * (size_t)K) : NULL;
  uint8_t *valid = malloc(rows);                                /* [T] token counts */
  double *lse = malloc(sizeof(double) * rows);                  /* [T] softmax logsumexp */
  double *aux_grad = malloc(sizeof(double) * (size_t)B * E);   /* [B, E] d loss / d q */
  route_check *block = malloc(sizeof(route_check) * (size_t)(blocks ? blocks : 1));
  if (!p || !chosen || (plain && !aux_sel) || !valid || !lse || !aux_grad || !block)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, EPX_ROUTE_ERR_OOM, fn, (long long)T);
  ROUTE_PARALLEL_FOR
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t begin = b * ROUTE_BLOCK, end = begin + ROUTE_BLOCK < T ? begin + ROUTE_BLOCK : T;
    route_recompute(c, &states[route_thread()], logits, topk_idx, begin, end, p, chosen, aux_sel,
                    lse, valid, &block[b]);
  }
  int64_t nvalid;
  EPX_CHECK(route_check_verdict(fn, c, logits, block, blocks, topk_idx, chosen, &nvalid));
  if (want_aux && nvalid > 0) {
    /* d aux / d q[t, e] = coeff * E * F[b(t), e] / D (F has no gradient). */
    route_aux_counts(c, T, plain ? aux_sel : chosen, valid, aux_grad);
    const double scale = (double)grad_aux_loss * c->aux_loss_coeff * E /
                         epx_route_aux_denominator(c, nvalid);
    for (size_t i = 0; i < (size_t)B * E; i++) aux_grad[i] *= scale;
  }
  const route_grad_args args = {
      p, chosen, lse, valid, topk_idx, grad_topk_w, want_aux && nvalid > 0 ? aux_grad : NULL,
      want_z && nvalid > 0 ? 2.0 * (double)grad_z_loss * c->z_loss_coeff / (double)nvalid : 0.0};
  ROUTE_PARALLEL_FOR
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t begin = b * ROUTE_BLOCK, end = begin + ROUTE_BLOCK < T ? begin + ROUTE_BLOCK : T;
    route_token_grads(c, &states[route_thread()], logits, &args, begin, end, grad_logits);
  }
fail:
  route_states_free(states, threads);
  free(p);
  free(chosen);
  free(aux_sel);
  free(valid);
  free(lse);
  free(aux_grad);
  free(block);
  return status;
}
