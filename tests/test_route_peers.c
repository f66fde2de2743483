/* The routing options that reproduce DeepSpeed (deepspeed/moe/sharded_moe.py)
 * and Megatron-core (megatron/core/transformer/moe/router.py, moe_utils.py):
 * each peer behaviour as a case worked by hand from the peer's code (the
 * function is cited at each case), then every option against the library's
 * float64 reference (forward and gradient). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/route_spec.h"
#include "testutil.h"

#define W_ATOL 1e-6
#define W_RTOL 1e-5

typedef struct routed {
  int32_t idx[64], loc[64], counts[16];
  float w[64], aux, z;
  epx_route_output_t out;
} routed;

static epx_route_config_t config_make(int32_t E, int32_t K) {
  epx_route_config_t c = EPX_ROUTE_CONFIG_INIT;
  c.num_experts = E;
  c.top_k = K;
  return c;
}

static void route(const epx_route_config_t *c, int64_t T, const float *logits, routed *r) {
  memset(r, 0xA5, sizeof *r);
  r->out = (epx_route_output_t){r->idx, r->w, r->loc, r->counts, &r->aux, &r->z, 0, 0};
  EXPECT_OK(epx_route(c, T, logits, NULL, &r->out));
}

static void softmax64(const float *row, int32_t E, double *p) {
  double max = row[0], sum = 0;
  for (int32_t e = 1; e < E; e++) max = fmax(max, row[e]);
  for (int32_t e = 0; e < E; e++) sum += exp(row[e] - max);
  for (int32_t e = 0; e < E; e++) p[e] = exp(row[e] - max) / sum;
}

static void expect_w(const char *what, float got, double want) {
  if (!(fabs(got - want) <= W_ATOL + W_RTOL * fabs(want)))
    fail_msg("%s: %.9g, expected %.9g", what, got, want);
}

static void expect_routes(const char *what, const routed *r, const int32_t *idx, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (r->idx[i] != idx[i])
      fail_msg("%s: topk_idx[%lld] is %d, expected %d", what, (long long)i, r->idx[i], idx[i]);
}

/* ------------------------------------------------------------------------ */
/* Capacity                                                                  */
/* ------------------------------------------------------------------------ */

/* DeepSpeed _capacity: torch.ceil((num_tokens / num_experts) * capacity_factor)
 * on a float32 tensor (top2gating/topkgating pass capacity_factor * k);
 * Megatron get_capacity: math.ceil((num_tokens * topk / num_experts) *
 * capacity_factor) on Python floats. The expected values are those
 * expressions evaluated in Python; 'old' epx widened the float factor to
 * double and gave one more whenever T*K/E*factor is whole. */
static void test_capacity_edges(void **state) {
  (void)state;
  const struct { int64_t T; int32_t E, K; double factor; int32_t ds, mg; } cases[] = {
      {80, 8, 1, 1.1, 11, 11},  {80, 8, 1, 0.1, 1, 1},    {80, 8, 1, 0.2, 2, 2},
      {80, 8, 1, 0.3, 3, 3},    {80, 8, 1, 0.6, 6, 6},    {80, 8, 1, 1.2, 12, 12},
      {80, 8, 1, 2.2, 22, 22},  {80, 8, 2, 1.1, 22, 22},  {160, 16, 2, 2.2, 44, 44},
      {40, 8, 1, 2.2, 11, 11},  {100, 8, 4, 0.3, 16, 15}, {100, 8, 4, 0.6, 31, 30},
      {100, 8, 4, 1.1, 55, 56}, {100, 8, 4, 2.2, 110, 111}, {25, 1, 1, 0.6, 16, 15}};
  tu_rng_t rng = {77};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const int64_t T = cases[i].T;
    epx_route_config_t c = config_make(cases[i].E, cases[i].K);
    c.capacity_mode = 1;
    c.capacity_factor = (float)cases[i].factor;
    assert_int_equal(epx_route_capacity(&c, T), cases[i].ds);
    float *l = tu_alloc(sizeof(float) * (size_t)(T * c.num_experts));
    for (int64_t j = 0; j < T * c.num_experts; j++) l[j] = tu_normal(&rng);
    int32_t *idx = tu_alloc(sizeof(int32_t) * (size_t)(T * c.top_k));
    float *w = tu_alloc(sizeof(float) * (size_t)(T * c.top_k));
    epx_route_output_t out = {idx, w, NULL, NULL, NULL, NULL, 0, 0};
    EXPECT_OK(epx_route(&c, T, l, NULL, &out));
    int32_t queried = -1; /* the public query without routing: the same C */
    EXPECT_OK(epx_route_capacity_of(&c, T, &queried));
    if (out.capacity != cases[i].ds || queried != cases[i].ds)
      fail_msg("T %lld E %d K %d factor %g: capacity %d (queried %d), DeepSpeed's %d", (long long)T,
               c.num_experts, c.top_k, cases[i].factor, out.capacity, queried, cases[i].ds);
    c.capacity_arithmetic = EPX_CAPACITY_FLOAT64;
    c.capacity_factor_f64 = cases[i].factor;
    EXPECT_OK(epx_route(&c, T, l, NULL, &out));
    EXPECT_OK(epx_route_capacity_of(&c, T, &queried));
    if (out.capacity != cases[i].mg || queried != cases[i].mg)
      fail_msg("T %lld E %d K %d factor %g: capacity %d (queried %d), Megatron's %d", (long long)T,
               c.num_experts, c.top_k, cases[i].factor, out.capacity, queried, cases[i].mg);
    TU_FREE_ALL(l, idx, w);
  }
  /* dropless: 0; bad arguments refused by name */
  epx_route_config_t c = config_make(8, 2);
  int32_t queried = -1;
  EXPECT_OK(epx_route_capacity_of(&c, 100, &queried));
  assert_int_equal(queried, 0);
  assert_int_equal(epx_route_capacity_of(&c, 100, NULL), EPX_ERROR_INVALID_ARGUMENT);
  assert_non_null(strstr(epx_last_error(), "capacity is NULL"));
  assert_int_equal(epx_route_capacity_of(&c, -1, &queried), EPX_ERROR_INVALID_ARGUMENT);
  assert_non_null(strstr(epx_last_error(), "num_tokens"));
}

/* ------------------------------------------------------------------------ */
/* DeepSpeed top2gating: first choices queue first, renormalise after the   */
/* drop, aux loss over first choices                                         */
/* ------------------------------------------------------------------------ */

/* top2gating(logits, capacity_factor=0.5, min_capacity=0), no 2nd-expert
 * sampling: capacity = ceil(f32(3/3) * f32(0.5 * 2)) = 1. mask1 = argmax:
 * t0 e0, t1 e0, t2 e1; mask2: t0 e1, t1 e2, t2 e0. locations1 = cumsum(mask1)
 * - 1: e0 {t0: 0, t1: 1}, e1 {t2: 0}; locations2 = cumsum(mask2) - 1 +
 * sum(mask1): t0 e1: 1, t1 e2: 0, t2 e0: 2. Kept (< 1): t0 e0, t2 e1, t1 e2.
 * gates1_s / (gates1_s + gates2_s) with the dropped gate 0: each survivor 1.
 * l_aux = mean(me * ce) * E * E, ce = mean(mask1) = [2/3, 1/3, 0]. */
static void test_deepspeed_top2(void **state) {
  (void)state;
  const float l[9] = {2, 1, 0, 2, 0, 1, 1, 2, 0};
  epx_route_config_t c = config_make(3, 2);
  c.capacity_mode = 1;
  c.capacity_factor = 0.5f;
  c.queue_order = EPX_QUEUE_BY_CHOICE;
  c.renormalize = 1;
  c.renormalize_after_drop = 1;
  c.aux_counts = EPX_AUX_COUNTS_FIRST_CHOICE;
  c.aux_loss_coeff = 1.0f;
  routed r;
  route(&c, 3, l, &r);
  assert_int_equal(r.out.capacity, 1);
  const int32_t want[6] = {0, -1, -1, 2, 1, -1};
  expect_routes("top2gating", &r, want, 6);
  const int32_t want_loc[6] = {0, -1, -1, 0, 0, -1};
  for (int i = 0; i < 6; i++) assert_int_equal(r.loc[i], want_loc[i]);
  for (int i = 0; i < 6; i++) expect_w("top2gating weight", r.w[i], want[i] >= 0 ? 1.0 : 0.0);
  double me[3] = {0}, p[3];
  for (int t = 0; t < 3; t++) {
    softmax64(l + 3 * t, 3, p);
    for (int e = 0; e < 3; e++) me[e] += p[e] / 3;
  }
  const double ce[3] = {2.0 / 3, 1.0 / 3, 0.0};
  double laux = 0;
  for (int e = 0; e < 3; e++) laux += me[e] * ce[e];
  laux = laux / 3 * 3 * 3; /* torch.mean over E, times E * E */
  expect_w("top2gating l_aux", r.aux, laux);
  /* Renormalised before the drop instead, the survivors keep p / (p1 + p2). */
  c.renormalize_after_drop = 0;
  route(&c, 3, l, &r);
  softmax64(l, 3, p);
  expect_w("renormalised before the drop", r.w[0], p[0] / (p[0] + p[1]));
}

/* ------------------------------------------------------------------------ */
/* Drop by probability: DeepSpeed ranks raw gates, Megatron its probs        */
/* ------------------------------------------------------------------------ */

/* Two tokens, E = 4, top-2, capacity = ceil(f32(2/4) * f32(0.5 * 2)) = 1.
 * p(t0) = [.5, .3, .1, .1], p(t1) = [.02, .35, .6, .03]: both send a second
 * choice to e1, the only expert over capacity. DeepSpeed topkgating
 * (drop_policy="probs") ranks top_gate = the raw p: t1 (.35) stays, then
 * renormalises over the survivors: t0 [e0 1.0], t1 [e2 .6/.95, e1 .35/.95].
 * Megatron apply_router_token_dropping ranks routing_probs, which with the
 * softmax after top-k are p renormalised over the two chosen: t0's .3/.8 =
 * .375 beats t1's .35/.95 = .368, so t0 stays and no renormalisation
 * follows: t0 [e0 .625, e1 .375], t1 [e2 .6/.95, dropped]. */
static void test_drop_by_score_and_probability(void **state) {
  (void)state;
  const double p0[4] = {.5, .3, .1, .1}, p1[4] = {.02, .35, .6, .03};
  float l[8];
  for (int e = 0; e < 4; e++) l[e] = (float)log(p0[e]), l[4 + e] = (float)log(p1[e]);
  epx_route_config_t c = config_make(4, 2);
  c.capacity_mode = 1;
  c.capacity_factor = 0.5f;
  c.queue_order = EPX_QUEUE_BY_TOKEN;
  c.drop_policy = EPX_DROP_BY_SCORE;
  c.renormalize = 1;
  c.renormalize_after_drop = 1;
  routed r;
  route(&c, 2, l, &r);
  const int32_t ds[4] = {0, -1, 2, 1};
  expect_routes("topkgating probs", &r, ds, 4);
  expect_w("topkgating t0", r.w[0], 1.0);
  expect_w("topkgating t1 e2", r.w[2], .6 / .95);
  expect_w("topkgating t1 e1", r.w[3], .35 / .95);
  assert_int_equal(r.loc[3], 0);

  epx_route_config_t m = config_make(4, 2);
  m.score_fn = EPX_SCORE_SOFTMAX_AFTER_TOPK;
  m.renormalize = 0;
  m.capacity_mode = 1;
  m.capacity_arithmetic = EPX_CAPACITY_FLOAT64;
  m.capacity_factor_f64 = 0.5;
  m.drop_policy = EPX_DROP_BY_PROBABILITY;
  route(&m, 2, l, &r);
  const int32_t mg[4] = {0, 1, 2, -1};
  expect_routes("Megatron probs", &r, mg, 4);
  expect_w("Megatron t0 e0", r.w[0], .5 / .8);
  expect_w("Megatron t0 e1", r.w[1], .3 / .8);
  expect_w("Megatron t1 e2", r.w[2], .6 / .95);
  expect_w("Megatron t1 dropped", r.w[3], 0.0);
}

/* ------------------------------------------------------------------------ */
/* Group-limited selection (Megatron group_limited_topk)                     */
/* ------------------------------------------------------------------------ */

/* E = 8 in 2 groups of 4, top-3, one group kept. Megatron scores a group by
 * scores.view(T, G, -1).topk(topk // group_topk).sum(): the best 3 here.
 * Logits g0 = [3, 0, 0, 0], g1 = [1.4, 1.4, 1.4, 0]: the best two sum to 3.0
 * and 2.8 (g0 wins: DeepSeek-V3, epx's default), the best three to 3.0 and
 * 4.2 (g1 wins). With the softmax after top-k (moe_router_pre_softmax=False)
 * compute_topk gets the logits, so g1's three tie at weight 1/3 each. */
static void test_group_score_experts(void **state) {
  (void)state;
  const float l[8] = {3, 0, 0, 0, 1.4f, 1.4f, 1.4f, 0};
  epx_route_config_t c = config_make(8, 3);
  c.score_fn = EPX_SCORE_SOFTMAX_AFTER_TOPK;
  c.renormalize = 0;
  c.num_groups = 2;
  c.topk_groups = 1;
  routed r;
  route(&c, 1, l, &r);
  const int32_t top2[3] = {0, 1, 2};
  expect_routes("group score of the best 2", &r, top2, 3);
  c.group_score_experts = 3;
  route(&c, 1, l, &r);
  const int32_t top3[3] = {4, 5, 6};
  expect_routes("group score of the best 3", &r, top3, 3);
  for (int k = 0; k < 3; k++) expect_w("softmax after top-k", r.w[k], 1.0 / 3);
}

/* Groups rank on the logits when the softmax comes after top-k and on p
 * before: g0 = [2, -5] sums to -3 in logits, g1 = [.5, .4] to .9, but in
 * softmax scores g0 leads (e^2 + e^-5 > e^.5 + e^.4). */
static void test_groups_rank_on_logits(void **state) {
  (void)state;
  const float l[4] = {2.0f, -5.0f, 0.5f, 0.4f};
  epx_route_config_t c = config_make(4, 2);
  c.num_groups = 2;
  c.topk_groups = 1;
  routed r;
  route(&c, 1, l, &r);
  const int32_t pre[2] = {0, 1};
  expect_routes("softmax before top-k", &r, pre, 2);
  c.score_fn = EPX_SCORE_SOFTMAX_AFTER_TOPK;
  route(&c, 1, l, &r);
  const int32_t post[2] = {2, 3};
  expect_routes("softmax after top-k", &r, post, 2);
}

/* ------------------------------------------------------------------------ */
/* Aux-loss counts from a plain top-k (Megatron)                             */
/* ------------------------------------------------------------------------ */

/* compute_routing_scores_for_aux_loss: scores = softmax(logits) over all E,
 * routing_map = topk(scores, k) with no groups and no bias;
 * switch_load_balancing_loss_func: sum(probs.sum(0) * tokens_per_expert) *
 * E * coeff / (topk * T * T). The case above routes t0 into g1 (group of the
 * best 3), but its plain top-3 is e0 and two of g1's. */
static void test_aux_counts_plain_topk(void **state) {
  (void)state;
  const float l[16] = {3, 0, 0, 0, 1.4f, 1.4f, 1.4f, 0, 0, 0, 0, 2, 1, 0, 0.5f, 0};
  epx_route_config_t c = config_make(8, 3);
  c.score_fn = EPX_SCORE_SOFTMAX_AFTER_TOPK;
  c.renormalize = 0;
  c.num_groups = 2;
  c.topk_groups = 1;
  c.group_score_experts = 3;
  c.aux_counts = EPX_AUX_COUNTS_PLAIN_TOPK;
  c.aux_loss_coeff = 0.01f;
  routed r;
  route(&c, 2, l, &r);
  /* plain top-3 of softmax: t0 {0, 4, 5} (ties to the lower), t1 {3, 4, 6}. */
  double counts[8] = {1, 0, 0, 1, 2, 1, 1, 0}, probs[8] = {0}, p[8];
  for (int t = 0; t < 2; t++) {
    softmax64(l + 8 * t, 8, p);
    for (int e = 0; e < 8; e++) probs[e] += p[e];
  }
  double sum = 0;
  for (int e = 0; e < 8; e++) sum += probs[e] * counts[e];
  expect_w("Megatron aux loss", r.aux, sum * 8 * 0.01 / (3.0 * 2 * 2));
  /* The selection's own counts give another loss. */
  c.aux_counts = EPX_AUX_COUNTS_SELECTED;
  routed s;
  route(&c, 2, l, &s);
  assert_true(fabs(s.aux - r.aux) > 1e-6);
}

/* ------------------------------------------------------------------------ */
/* Score functions                                                           */
/* ------------------------------------------------------------------------ */

/* Megatron topk_routing_with_score_function("sqrtsoftplus"): scores =
 * softplus(logits).sqrt() (torch softplus: x above 20), top-k, then probs =
 * scores / (scores.sum() + 1e-20) for topk > 1. */
static void test_sqrt_softplus(void **state) {
  (void)state;
  const float l[4] = {1.0f, 0.0f, -1.0f, 25.0f};
  epx_route_config_t c = config_make(4, 2);
  c.score_fn = EPX_SCORE_SQRT_SOFTPLUS;
  routed r;
  route(&c, 1, l, &r);
  const int32_t want[2] = {3, 0};
  expect_routes("sqrt-softplus", &r, want, 2);
  const double s3 = 5.0, s0 = sqrt(log1p(exp(1.0)));
  expect_w("sqrt-softplus w0", r.w[0], s3 / (s3 + s0));
  expect_w("sqrt-softplus w1", r.w[1], s0 / (s3 + s0));
}

/* ------------------------------------------------------------------------ */
/* Sequence-level and global aux losses (Megatron)                           */
/* ------------------------------------------------------------------------ */

/* _apply_seq_aux_loss: scores reshaped [seq_length, bsz * E], so each
 * sequence b has its own tokens_per_expert and probs sums;
 * switch_load_balancing_loss_func with total_num_tokens = seq_length, then
 * divided by bsz. Tokens are [seq, batch]: token t is in sequence t % bsz. */
static void test_sequence_aux_loss(void **state) {
  (void)state;
  const float l[12] = {2, 0, 1, 0, 2, 1, 1, 1, 3, 0, 0, 2};
  epx_route_config_t c = config_make(3, 1);
  c.aux_loss_coeff = 0.1f;
  c.aux_loss_sequences = 2;
  routed r;
  route(&c, 4, l, &r);
  double loss = 0, p[3];
  for (int b = 0; b < 2; b++) {
    double probs[3] = {0}, counts[3] = {0};
    for (int s = 0; s < 2; s++) {
      const int t = s * 2 + b;
      softmax64(l + 3 * t, 3, p);
      for (int e = 0; e < 3; e++) probs[e] += p[e];
      counts[r.idx[t]] += 1;
    }
    double sum = 0;
    for (int e = 0; e < 3; e++) sum += probs[e] * counts[e];
    loss += sum * 3 * 0.1 / (1.0 * 2 * 2) / 2;
  }
  expect_w("seq_aux_loss", r.aux, loss);
  c.aux_loss_sequences = 3;
  epx_route_output_t out = r.out;
  EXPECT_STATUS(epx_route(&c, 4, l, NULL, &out), EPX_ERROR_INVALID_ARGUMENT,
                "not a multiple of aux_loss_sequences");
}

/* _apply_global_aux_loss: tokens_per_expert of the global batch (here given),
 * total_num_tokens the global count, probs this rank's. */
static void test_global_aux_loss(void **state) {
  (void)state;
  const float l[6] = {2, 0, 1, 0, 2, 1};
  const float global[3] = {10, 4, 6};
  epx_route_config_t c = config_make(3, 1);
  c.aux_loss_coeff = 0.1f;
  c.aux_loss_expert_counts = global;
  c.aux_loss_tokens = 20;
  routed r;
  route(&c, 2, l, &r);
  double probs[3] = {0}, p[3], sum = 0;
  for (int t = 0; t < 2; t++) {
    softmax64(l + 3 * t, 3, p);
    for (int e = 0; e < 3; e++) probs[e] += p[e];
  }
  for (int e = 0; e < 3; e++) sum += probs[e] * global[e];
  expect_w("global_aux_loss", r.aux, sum * 3 * 0.1 / (1.0 * 20 * 20));
}

/* ------------------------------------------------------------------------ */
/* Random token selection, padding mask, agreed dropless capacity            */
/* ------------------------------------------------------------------------ */

/* DeepSpeed top1gating use_rts: top_idx = topk(mask1 * uniform, capacity,
 * dim=0) keeps each expert's C tokens of the largest random draw, located
 * by cumsum in token order. epx draws epx_route_priority(seed, t * K + k). */
static void test_random_priority(void **state) {
  (void)state;
  tu_rng_t rng = {5150};
  const int64_t T = 48;
  float l[48 * 4];
  for (int i = 0; i < 48 * 4; i++) l[i] = tu_normal(&rng);
  epx_route_config_t c = config_make(4, 1);
  c.capacity_mode = 1;
  c.capacity_factor = 0.5f;
  c.drop_policy = EPX_DROP_BY_RANDOM_PRIORITY;
  c.random_seed = 42;
  int32_t idx[48], idx2[48], loc[48];
  float w[48];
  epx_route_output_t out = {idx, w, loc, NULL, NULL, NULL, 0, 0};
  EXPECT_OK(epx_route(&c, T, l, NULL, &out));
  const int32_t C = out.capacity;
  assert_int_equal(C, 6);
  c.capacity_mode = 0;
  epx_route_output_t all = {idx2, w, NULL, NULL, NULL, NULL, 0, 0};
  EXPECT_OK(epx_route(&c, T, l, NULL, &all));
  for (int32_t e = 0; e < 4; e++) {
    /* The kept are the C of the largest priority among e's tokens. */
    int32_t kept = 0, slot = 0;
    for (int64_t t = 0; t < T; t++) {
      if (idx2[t] != e) continue;
      int32_t better = 0;
      const uint32_t mine = epx_route_priority(42, t);
      for (int64_t u = 0; u < T; u++)
        better += idx2[u] == e && (epx_route_priority(42, u) > mine ||
                                   (epx_route_priority(42, u) == mine && u < t));
      const int stays = better < C;
      assert_int_equal(idx[t], stays ? e : -1);
      if (stays) assert_int_equal(loc[t], slot++);
      kept += stays;
    }
    assert_true(kept <= C);
  }
  /* Another seed drops other tokens. */
  c.capacity_mode = 1;
  c.random_seed = 43;
  EXPECT_OK(epx_route(&c, T, l, NULL, &all));
  int differ = 0;
  for (int64_t t = 0; t < T; t++) differ += idx2[t] != idx[t];
  assert_true(differ > 0);
}

/* A masked token routes nowhere and counts in no loss: the unmasked tokens
 * route (dropless) exactly as they do alone, with the same losses. */
static void test_padding_mask(void **state) {
  (void)state;
  tu_rng_t rng = {616};
  const int64_t T = 12;
  float l[12 * 5], sub[12 * 5];
  uint8_t mask[12];
  int64_t n = 0;
  for (int i = 0; i < 12 * 5; i++) l[i] = tu_normal(&rng);
  l[3 * 5 + 1] = NAN; /* masked tokens may hold anything */
  for (int64_t t = 0; t < T; t++) {
    mask[t] = (uint8_t)(t % 3 != 0);
    if (mask[t]) memcpy(sub + 5 * n++, l + 5 * t, sizeof(float) * 5);
  }
  epx_route_config_t c = config_make(5, 2);
  c.aux_loss_coeff = 0.3f;
  c.z_loss_coeff = 0.2f;
  c.score_fn = EPX_SCORE_SIGMOID;
  routed alone, masked;
  route(&c, n, sub, &alone);
  c.token_mask = mask;
  route(&c, T, l, &masked);
  for (int64_t t = 0, j = 0; t < T; t++) {
    for (int k = 0; k < 2; k++) {
      if (!mask[t]) {
        assert_int_equal(masked.idx[t * 2 + k], -1);
        assert_true(masked.w[t * 2 + k] == 0.0f);
        continue;
      }
      assert_int_equal(masked.idx[t * 2 + k], alone.idx[j * 2 + k]);
      assert_true(masked.w[t * 2 + k] == alone.w[j * 2 + k]);
    }
    j += mask[t];
  }
  for (int e = 0; e < 5; e++) assert_int_equal(masked.counts[e], alone.counts[e]);
  expect_w("masked aux", masked.aux, alone.aux);
  expect_w("masked z", masked.z, alone.z);
  float grad[60];
  const float gw[24] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_OK(epx_route_backward(&c, T, l, NULL, masked.idx, gw, 0.5f, 0.5f, grad));
  for (int64_t t = 0; t < T; t++)
    for (int e = 0; !mask[t] && e < 5; e++) assert_true(grad[t * 5 + e] == 0.0f);
}

/* DeepSpeed drop_tokens=False: new_capacity = max(exp_counts), all-reduced
 * MAX over the expert-parallel group. */
typedef struct agree_arg {
  int32_t counts[2][4];
  int32_t got[2];
} agree_arg;

static int agree_rank(epx_comm_t comm, int32_t rank, int32_t world, void *p) {
  (void)world;
  agree_arg *a = p;
  float sum[4];
  if (epx_route_agree_capacity(comm, 4, a->counts[rank], &a->got[rank]) != EPX_SUCCESS) return 1;
  if (epx_route_sum_counts(comm, 4, a->counts[rank], sum) != EPX_SUCCESS) return 1;
  for (int e = 0; e < 4; e++)
    if (sum[e] != (float)(a->counts[0][e] + a->counts[1][e])) return 1;
  return 0;
}

static void test_agree_capacity(void **state) {
  (void)state;
  agree_arg a = {{{3, 9, 0, 1}, {4, 2, 11, 0}}, {0, 0}};
  assert_int_equal(tu_run_ranks(2, 10.0, agree_rank, &a), 0);
  assert_int_equal(a.got[0], 11);
  assert_int_equal(a.got[1], 11);
  int32_t C;
  EXPECT_STATUS(epx_route_agree_capacity(NULL, 4, a.counts[0], &C), EPX_ERROR_INVALID_ARGUMENT,
                "comm is NULL");
}

/* ------------------------------------------------------------------------ */
/* Every option against the float64 reference, forward and gradient         */
/* ------------------------------------------------------------------------ */

static int close_enough(double got, double want, double atol, double rtol) {
  return fabs(got - want) <= atol + rtol * fabs(want);
}

static void check_option(const epx_route_config_t *c, int64_t T, const float *l, const float *bias,
                         const char *label) {
  const int32_t E = c->num_experts, K = c->top_k;
  int32_t *idx = tu_alloc(sizeof(int32_t) * (size_t)(T * K)), *loc = tu_alloc(sizeof(int32_t) * (size_t)(T * K));
  int32_t *ridx = tu_alloc(sizeof(int32_t) * (size_t)(T * K)), *rloc = tu_alloc(sizeof(int32_t) * (size_t)(T * K));
  int32_t counts[64], rcounts[64], rC;
  float *w = tu_alloc(sizeof(float) * (size_t)(T * K)), *gw = tu_alloc(sizeof(float) * (size_t)(T * K));
  double *rw = tu_alloc(sizeof(double) * (size_t)(T * K)), raux, rz;
  float *grad = tu_alloc(sizeof(float) * (size_t)(T * E)), aux, z;
  double *rgrad = tu_alloc(sizeof(double) * (size_t)(T * E));
  epx_route_output_t out = {idx, w, loc, counts, &aux, &z, 0, 0};
  EXPECT_OK(epx_route(c, T, l, bias, &out));
  EXPECT_OK(epx_reference_route(c, T, l, bias, ridx, rw, rloc, rcounts, &raux, &rz, &rC));
  assert_int_equal(out.capacity, rC);
  for (int64_t i = 0; i < T * K; i++) {
    if (idx[i] != ridx[i] || loc[i] != rloc[i])
      fail_msg("%s: route %lld: expert %d location %d, reference %d %d", label, (long long)i,
               idx[i], loc[i], ridx[i], rloc[i]);
    if (!close_enough(w[i], rw[i], W_ATOL, W_RTOL))
      fail_msg("%s: topk_w[%lld] %.9g, reference %.9g", label, (long long)i, w[i], rw[i]);
    gw[i] = (float)((i * 7919) % 13) / 13.0f - 0.5f;
  }
  for (int32_t e = 0; e < E; e++) assert_int_equal(counts[e], rcounts[e]);
  if (!close_enough(aux, raux, W_ATOL, W_RTOL) || !close_enough(z, rz, W_ATOL, W_RTOL))
    fail_msg("%s: aux %.9g z %.9g, reference %.9g %.9g", label, aux, z, raux, rz);
  EXPECT_OK(epx_route_backward(c, T, l, bias, idx, gw, 0.7f, 0.3f, grad));
  EXPECT_OK(epx_reference_route_backward(c, T, l, bias, idx, gw, 0.7, 0.3, rgrad));
  double largest = 0;
  for (int64_t i = 0; i < T * E; i++) largest = fmax(largest, fabs(rgrad[i]));
  for (int64_t i = 0; i < T * E; i++)
    if (!close_enough(grad[i], rgrad[i], 1e-6 * largest + 1e-7, 1e-4))
      fail_msg("%s: grad_logits[%lld] %.9g, reference %.9g", label, (long long)i, grad[i], rgrad[i]);
  assert_true(largest > 0);
  tu_free(idx), tu_free(loc), tu_free(ridx), tu_free(rloc), tu_free(w), tu_free(gw);
  tu_free(rw), tu_free(grad), tu_free(rgrad);
}

static void test_options_against_reference(void **state) {
  (void)state;
  tu_rng_t rng = {2718};
  const int64_t T = 96;
  const int32_t E = 16, K = 4;
  float *l = tu_alloc(sizeof(float) * (size_t)(T * E)), bias[16];
  uint8_t mask[96];
  for (int64_t i = 0; i < T * E; i++) l[i] = 1.5f * tu_normal(&rng);
  for (int e = 0; e < E; e++) bias[e] = 0.1f * tu_normal(&rng);
  for (int64_t t = 0; t < T; t++) mask[t] = (uint8_t)(t % 7 != 3);
  int n = 0;
  for (int score = 0; score < 4; score++)
    for (int drop = 0; drop < 4; drop++)
      for (int variant = 0; variant < 4; variant++) {
        epx_route_config_t c = config_make(E, K);
        c.score_fn = (epx_score_fn_t)score;
        c.drop_policy = (epx_drop_policy_t)drop;
        c.capacity_mode = 1;
        c.capacity_factor = 0.8f;
        c.random_seed = 1234 + (uint64_t)n;
        c.aux_loss_coeff = 0.05f;
        c.z_loss_coeff = 0.01f;
        c.renormalize = score != EPX_SCORE_SOFTMAX_AFTER_TOPK;
        c.renormalize_after_drop = c.renormalize && (variant & 1);
        c.queue_order = variant & 2 ? EPX_QUEUE_BY_TOKEN : EPX_QUEUE_BY_CHOICE;
        c.aux_counts = (epx_aux_counts_t)((n / 3) % 3);
        c.scaling_factor = variant == 3 ? 2.5f : 1.0f;
        if (variant >= 2) {
          c.num_groups = 4;
          c.topk_groups = 2;
          c.group_score_experts = variant == 3 ? 3 : 0;
        }
        c.aux_loss_sequences = variant == 1 ? 4 : 0;
        c.token_mask = variant == 2 ? mask : NULL;
        char label[128];
        snprintf(label, sizeof label, "score %d drop %d variant %d aux_counts %d", score, drop,
                 variant, (int)c.aux_counts);
        check_option(&c, T, l, score == EPX_SCORE_SIGMOID || variant >= 2 ? bias : NULL, label);
        n++;
      }
  tu_free(l);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_capacity_edges),
      cmocka_unit_test(test_deepspeed_top2),
      cmocka_unit_test(test_drop_by_score_and_probability),
      cmocka_unit_test(test_group_score_experts),
      cmocka_unit_test(test_groups_rank_on_logits),
      cmocka_unit_test(test_aux_counts_plain_topk),
      cmocka_unit_test(test_sqrt_softplus),
      cmocka_unit_test(test_sequence_aux_loss),
      cmocka_unit_test(test_global_aux_loss),
      cmocka_unit_test(test_random_priority),
      cmocka_unit_test(test_padding_mask),
      cmocka_unit_test(test_agree_capacity),
      cmocka_unit_test(test_options_against_reference),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
