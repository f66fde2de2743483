/* What the CPU router's files share (route_select.c: per-token scores and
 * selection; route.c: the forward; route_backward.c: the gradient). The spec
 * they implement is src/core/route_spec.h. */
#ifndef EPX_CPU_ROUTE_INTERNAL_H
#define EPX_CPU_ROUTE_INTERNAL_H

#include <stdint.h>

#include "epx.h"

#ifdef _OPENMP
#include <omp.h>
/* The token loops: a local `threads` (1: no parallel region) sizes the team. */
#define ROUTE_PARALLEL_FOR                                                              \
  _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")
static inline int route_thread(void) { return omp_get_thread_num(); }
#else
#define ROUTE_PARALLEL_FOR
static inline int route_thread(void) { return 0; }
#endif

/* Tokens per block of the token loops. Loss sums are taken per block, then
 * over the blocks in order, so they do not depend on the thread count. */
#define ROUTE_BLOCK 128

/* What one token's routing needs besides its logits: the config's numbers
 * and per-token scratch, allocated once per call and thread. */
typedef struct route_state {
  const epx_route_config_t *config;
  int32_t num_experts, top_k;
  int32_t num_groups, group_size, topk_groups; /* num_groups 1: no group limit */
  int32_t group_top;  /* experts summed into a group's score */
  const float *bias;  /* [E] or NULL */
  float *select;      /* [E] selection scores s (only with a bias) */
  float *group_score; /* [num_groups] */
  float *group_top2;  /* [num_groups, 2] best and second-best s of each group */
  float *group_topn;  /* [group_top] scratch of a group's best scores */
  int32_t *group_best;/* [topk_groups] kept groups, best first */
  uint8_t *group_kept;/* [num_groups] */
  float *top_score;   /* [K] selection scores of the chosen, best first */
  int32_t *candidate; /* [E] experts that may be among the K best, ascending */
  float *p;           /* [E] one token's scores */
  float *q;           /* [E] one token's aux scores */
  double *grad_p;     /* [E] one token's d loss / d p (backward) */
  double *grad_base;  /* [K] one token's d loss / d b (backward) */
  double *grad_row;   /* [E] one token's d loss / d logits (backward) */
} route_state;

/* Per-thread states for a call (route_states_free releases them). */
epx_status_t route_states_create(const char *fn, const epx_route_config_t *c, const float *bias,
                                 int threads, route_state **out);
void route_states_free(route_state *states, int threads);

/* Threads for T tokens of E experts (1 below 64K logits). */
int route_threads(int64_t T, int32_t E);

/* The config's refusal of a non-finite bias, or success. */
epx_status_t route_check_bias(const char *fn, int32_t num_experts, const float *bias);

/* Index of the first NaN/Inf in row, or -1. */
int32_t route_first_nonfinite(const float *row, int32_t num_experts);

/* Whether token t is real (the config's token mask). */
static inline int route_token_real(const epx_route_config_t *c, int64_t t) {
  return !c->token_mask || c->token_mask[t] != 0;
}

/* Scores p [E] of one finite row and the K chosen experts (spec steps 1-4),
 * best first. For softmax after top-k, p holds the logits. Returns the
 * row's logsumexp for softmax, NAN otherwise. */
double route_select(route_state *s, const float *row, float *p, int32_t *chosen);

/* Base weights b [K] of the chosen (spec step 5) from p of route_select. */
void route_base_weights(const route_state *s, const float *p, const int32_t *chosen, float *b);

/* Sum of b [K] in k order over the slots with keep[k] >= 0 (keep NULL:
 * all), float32. */
float route_weight_sum(const float *b, const int32_t *keep, int32_t K);

/* Aux scores q [E] of one finite row (epx.h's q) into s->q. */
void route_aux_scores(route_state *s, const float *row, const float *p);

/* The K best of q [E] (ties to the lower expert) into chosen, for
 * EPX_AUX_COUNTS_PLAIN_TOPK. */
void route_plain_topk(route_state *s, const float *q, int32_t *chosen);

double route_logsumexp(const float *row, int32_t n);
/* softmax(row) into out; returns the logsumexp. */
double route_softmax(const float *row, int32_t n, float *out);

/* F [B, E] of the aux loss (B = max(1, aux_loss_sequences)) from the
 * pre-drop selection sel [T, K] (or the plain top-k, or first choices) of
 * the valid tokens (valid [T] nonzero). */
void route_aux_counts(const epx_route_config_t *c, int64_t T, const int32_t *sel,
                      const uint8_t *valid, double *F);

#endif
