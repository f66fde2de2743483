/* epx_route / epx_route_backward on the CPU against a float64 reference
 * written here from the routing spec: integers (experts, locations, counts,
 * capacity) must match exactly, floats within stated tolerances; gradients
 * against central differences of the same reference in float64. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/route_spec.h"
#include "testutil.h"

/* Weights and losses: float32 results of float32 scores. */
#define W_ATOL 1e-6
#define W_RTOL 1e-5
/* Gradients: float32 results against float64 central differences. */
#define G_ATOL 1e-6
#define G_RTOL 1e-4

static epx_route_config_t config_make(int32_t E, int32_t K) {
  epx_route_config_t c = EPX_ROUTE_CONFIG_INIT;
  c.num_experts = E;
  c.top_k = K;
  return c;
}

static float *random_logits(tu_rng_t *rng, int64_t T, int32_t E, float scale) {
  float *l = tu_alloc(sizeof(float) * (size_t)(T * E));
  for (int64_t i = 0; i < T * E; i++) l[i] = scale * tu_normal(rng);
  return l;
}

static float *random_bias(tu_rng_t *rng, int32_t E, float scale) {
  float *b = tu_alloc(sizeof(float) * (size_t)E);
  for (int32_t e = 0; e < E; e++) b[e] = scale * (float)(2.0 * tu_uniform(rng) - 1.0);
  return b;
}

/* ------------------------------------------------------------------------ */
/* Outputs, poisoned before every call                                       */
/* ------------------------------------------------------------------------ */

#define CAPACITY_SENTINEL 0x5a5a5a5a
#define NONFINITE_SENTINEL (-777)

typedef struct outs {
  int64_t T;
  int32_t E, K;
  int32_t *idx, *loc, *counts;
  float *w, *aux, *z;
  epx_route_output_t out;
} outs;

static void outs_poison(outs *o) {
  const size_t routes = (size_t)(o->T * o->K) + 1;
  tu_poison(o->idx, sizeof(int32_t) * routes);
  tu_poison(o->loc, sizeof(int32_t) * routes);
  tu_poison(o->w, sizeof(float) * routes);
  tu_poison(o->counts, sizeof(int32_t) * (size_t)o->E);
  tu_poison(o->aux, sizeof(float));
  tu_poison(o->z, sizeof(float));
  o->out.capacity = CAPACITY_SENTINEL;
  o->out.nonfinite_tokens = NONFINITE_SENTINEL;
}

static void outs_alloc(outs *o, int64_t T, int32_t E, int32_t K) {
  const size_t routes = (size_t)(T * K) + 1; /* one spare slot: never written */
  o->T = T;
  o->E = E;
  o->K = K;
  o->idx = tu_alloc(sizeof(int32_t) * routes);
  o->loc = tu_alloc(sizeof(int32_t) * routes);
  o->w = tu_alloc(sizeof(float) * routes);
  o->counts = tu_alloc(sizeof(int32_t) * (size_t)E);
  o->aux = tu_alloc(sizeof(float));
  o->z = tu_alloc(sizeof(float));
  o->out = (epx_route_output_t){o->idx, o->w, o->loc, o->counts, o->aux, o->z, 0, 0};
  outs_poison(o);
}

static void outs_free(outs *o) {
  TU_FREE_ALL(o->idx, o->loc, o->w, o->counts, o->aux, o->z);
}

static int bytes_poisoned(const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != 0xA5) return 0;
  return 1;
}

static void assert_outs_untouched(const outs *o, const char *what) {
  const size_t routes = (size_t)(o->T * o->K) + 1;
  if (!bytes_poisoned(o->idx, sizeof(int32_t) * routes) ||
      !bytes_poisoned(o->loc, sizeof(int32_t) * routes) ||
      !bytes_poisoned(o->w, sizeof(float) * routes) ||
      !bytes_poisoned(o->counts, sizeof(int32_t) * (size_t)o->E) ||
      !bytes_poisoned(o->aux, sizeof(float)) || !bytes_poisoned(o->z, sizeof(float)) ||
      o->out.capacity != CAPACITY_SENTINEL || o->out.nonfinite_tokens != NONFINITE_SENTINEL)
    fail_msg("%s: a refused call wrote to its outputs", what);
}

/* The spare slot past T*K must stay poisoned after a successful call. */
static void assert_spare_untouched(const outs *o, const char *what) {
  const size_t r = (size_t)(o->T * o->K);
  if (!bytes_poisoned(o->idx + r, 4) || !bytes_poisoned(o->loc + r, 4) ||
      !bytes_poisoned(o->w + r, 4))
    fail_msg("%s: wrote past [T, K]", what);
}

/* ------------------------------------------------------------------------ */
/* The float64 reference of the library (epx_reference_route)                */
/* ------------------------------------------------------------------------ */

typedef struct ref_t {
  int32_t *idx, *loc, *counts;
  double *w;
  double aux, z;
  int32_t capacity;
  int64_t nonfinite;
} ref_t;

static void ref_route(const epx_route_config_t *c, int64_t T, const float *logits,
                      const float *bias, ref_t *r) {
  const int64_t routes = T * c->top_k;
  r->idx = tu_alloc(sizeof(int32_t) * (size_t)(routes + 1));
  r->loc = tu_alloc(sizeof(int32_t) * (size_t)(routes + 1));
  r->w = tu_alloc(sizeof(double) * (size_t)(routes + 1));
  r->counts = tu_alloc(sizeof(int32_t) * (size_t)c->num_experts);
  EXPECT_OK(epx_reference_route(c, T, logits, bias, r->idx, r->w, r->loc, r->counts, &r->aux,
                                   &r->z, &r->capacity));
  r->nonfinite = 0;
  for (int64_t t = 0; t < T; t++) {
    int finite = 1;
    for (int32_t e = 0; e < c->num_experts; e++) finite &= isfinite(logits[t * c->num_experts + e]) != 0;
    r->nonfinite += !finite && (!c->token_mask || c->token_mask[t]);
  }
}

static void ref_free(ref_t *r) {
  TU_FREE_ALL(r->idx, r->loc, r->w, r->counts);
}

/* softmax of a row in float64, for the hand-worked checks. */
static void softmax64(const double *row, int32_t E, double *p) {
  double max = row[0], sum = 0;
  for (int32_t e = 1; e < E; e++) max = fmax(max, row[e]);
  for (int32_t e = 0; e < E; e++) sum += exp(row[e] - max);
  for (int32_t e = 0; e < E; e++) p[e] = exp(row[e] - max) / sum;
}

static int close_enough(double got, double want, double atol, double rtol) {
  return fabs(got - want) <= atol + rtol * fabs(want);
}

/* Routes with epx_route and with the reference and compares everything. */
static void check_against_reference(const epx_route_config_t *c, int64_t T, const float *logits,
                                    const float *bias, const char *label) {
  outs o;
  ref_t r;
  outs_alloc(&o, T, c->num_experts, c->top_k);
  EXPECT_OK(epx_route(c, T, logits, bias, &o.out));
  assert_spare_untouched(&o, label);
  ref_route(c, T, logits, bias, &r);
  for (int64_t i = 0; i < T * c->top_k; i++) {
    if (o.idx[i] != r.idx[i] || o.loc[i] != r.loc[i])
      fail_msg("%s: route [%lld, %lld]: expert %d location %d, expected %d and %d", label,
               (long long)(i / c->top_k), (long long)(i % c->top_k), o.idx[i], o.loc[i],
               r.idx[i], r.loc[i]);
    if (!close_enough(o.w[i], r.w[i], W_ATOL, W_RTOL))
      fail_msg("%s: topk_w[%lld] is %.9g, expected %.9g", label, (long long)i, o.w[i], r.w[i]);
  }
  for (int32_t e = 0; e < c->num_experts; e++)
    if (o.counts[e] != r.counts[e])
      fail_msg("%s: expert_counts[%d] is %d, expected %d", label, e, o.counts[e], r.counts[e]);
  if (!close_enough(*o.aux, r.aux, W_ATOL, W_RTOL) || !close_enough(*o.z, r.z, W_ATOL, W_RTOL))
    fail_msg("%s: aux_loss %.9g z_loss %.9g, expected %.9g and %.9g", label, *o.aux, *o.z,
             r.aux, r.z);
  if (o.out.capacity != r.capacity || o.out.nonfinite_tokens != r.nonfinite)
    fail_msg("%s: capacity %d nonfinite %lld, expected %d and %lld", label, o.out.capacity,
             (long long)o.out.nonfinite_tokens, r.capacity, (long long)r.nonfinite);
  ref_free(&r);
  outs_free(&o);
}

/* ------------------------------------------------------------------------ */
/* Forward against the reference                                             */
/* ------------------------------------------------------------------------ */

static void test_route_matches_reference(void **state) {
  (void)state;
  tu_rng_t rng = {101};
  const int64_t T = 53;
  const int32_t E = 16, K = 3;
  int runs = 0;
  for (int score = 0; score < 2; score++)
    for (int grouped = 0; grouped < 2; grouped++)
      for (int biased = 0; biased < 2; biased++)
        for (int renorm = 0; renorm < 2; renorm++)
          for (int scaled = 0; scaled < 2; scaled++)
            for (int mode = 0; mode < 6; mode++) {
              epx_route_config_t c = config_make(E, K);
              c.score_fn = score ? EPX_SCORE_SIGMOID : EPX_SCORE_SOFTMAX;
              if (grouped) c.num_groups = 4, c.topk_groups = 2;
              c.renormalize = renorm;
              c.scaling_factor = scaled ? 2.5f : 1.0f;
              c.capacity_mode = mode >= 2;
              c.capacity_factor = 0.8f;
              c.queue_order = mode % 2 ? EPX_QUEUE_BY_TOKEN : EPX_QUEUE_BY_CHOICE;
              c.drop_policy = mode >= 4 ? EPX_DROP_BY_PROBABILITY : EPX_DROP_BY_POSITION;
              c.aux_loss_coeff = 0.01f;
              c.z_loss_coeff = 0.001f;
              float *logits = random_logits(&rng, T, E, 1.5f);
              float *bias = biased ? random_bias(&rng, E, score ? 0.5f : 0.1f) : NULL;
              char label[160];
              snprintf(label, sizeof label,
                       "score %d groups %d bias %d renorm %d scale %d capacity %d order %d drop %d",
                       score, grouped, biased, renorm, scaled, c.capacity_mode, c.queue_order,
                       c.drop_policy);
              check_against_reference(&c, T, logits, bias, label);
              tu_free(logits);
              tu_free(bias);
              runs++;
            }
  assert_int_equal(runs, 192);
}

static void test_route_larger_shapes(void **state) {
  (void)state;
  tu_rng_t rng = {202};
  const struct { int64_t T; int32_t E, K, G, GK; } shapes[] = {
      {300, 64, 8, 8, 4}, {257, 128, 6, 1, 0}, {100, 256, 8, 8, 4}, {77, 7, 1, 1, 0},
      {40, 32, 32, 4, 4}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    for (int score = 0; score < 2; score++) {
      epx_route_config_t c = config_make(shapes[i].E, shapes[i].K);
      c.score_fn = score ? EPX_SCORE_SIGMOID : EPX_SCORE_SOFTMAX;
      c.num_groups = shapes[i].G;
      c.topk_groups = shapes[i].GK;
      c.capacity_mode = 1;
      c.capacity_factor = 1.1f;
      c.drop_policy = i % 2 ? EPX_DROP_BY_PROBABILITY : EPX_DROP_BY_POSITION;
      c.aux_loss_coeff = 0.02f;
      c.z_loss_coeff = 0.003f;
      float *logits = random_logits(&rng, shapes[i].T, shapes[i].E, 2.0f);
      float *bias = random_bias(&rng, shapes[i].E, score ? 0.4f : 0.02f);
      char label[96];
      snprintf(label, sizeof label, "T %lld E %d K %d groups %d score %d",
               (long long)shapes[i].T, shapes[i].E, shapes[i].K, shapes[i].G, score);
      check_against_reference(&c, shapes[i].T, logits, bias, label);
      tu_free(logits);
      tu_free(bias);
    }
}

/* A bias moves the choice but the weight stays p of the chosen expert. */
static void test_route_bias_selects_not_weights(void **state) {
  (void)state;
  const float logits[4] = {2.0f, 1.0f, 0.0f, -0.5f};
  const float bias[4] = {0.0f, 1.0f, 0.0f, 0.0f};
  double p[4], sum = 0;
  for (int e = 0; e < 4; e++) sum += exp(logits[e]);
  for (int e = 0; e < 4; e++) p[e] = exp(logits[e]) / sum;
  epx_route_config_t c = config_make(4, 1);
  c.renormalize = 0;
  outs o;
  outs_alloc(&o, 1, 4, 1);
  EXPECT_OK(epx_route(&c, 1, logits, NULL, &o.out));
  assert_int_equal(o.idx[0], 0);
  assert_true(close_enough(o.w[0], p[0], W_ATOL, W_RTOL));
  outs_poison(&o);
  EXPECT_OK(epx_route(&c, 1, logits, bias, &o.out));
  assert_int_equal(o.idx[0], 1);
  assert_true(close_enough(o.w[0], p[1], W_ATOL, W_RTOL));
  /* Renormalised top-2 with the bias: experts 1 then 0, weights p / (p0 + p1). */
  c.top_k = 2;
  c.renormalize = 1;
  c.scaling_factor = 3.0f;
  outs_free(&o);
  outs_alloc(&o, 1, 4, 2);
  EXPECT_OK(epx_route(&c, 1, logits, bias, &o.out));
  assert_int_equal(o.idx[0], 1);
  assert_int_equal(o.idx[1], 0);
  assert_true(close_enough(o.w[0], 3.0 * p[1] / (p[0] + p[1]), W_ATOL, W_RTOL));
  assert_true(close_enough(o.w[1], 3.0 * p[0] / (p[0] + p[1]), W_ATOL, W_RTOL));
  outs_free(&o);
}

static void test_route_group_limited(void **state) {
  (void)state;
  /* Sigmoid scores by group: {.993, .007} = 1.0, {.881, .881} = 1.76, lower. */
  const float logits[8] = {5.0f, -5.0f, 2.0f, 2.0f, -1.0f, -1.0f, -2.0f, -2.0f};
  epx_route_config_t c = config_make(8, 2);
  c.score_fn = EPX_SCORE_SIGMOID;
  outs o;
  outs_alloc(&o, 1, 8, 2);
  EXPECT_OK(epx_route(&c, 1, logits, NULL, &o.out));
  assert_int_equal(o.idx[0], 0);
  assert_int_equal(o.idx[1], 2);
  c.num_groups = 4;
  c.topk_groups = 1;
  outs_poison(&o);
  EXPECT_OK(epx_route(&c, 1, logits, NULL, &o.out));
  assert_int_equal(o.idx[0], 2);
  assert_int_equal(o.idx[1], 3);
  c.topk_groups = 2;
  outs_poison(&o);
  EXPECT_OK(epx_route(&c, 1, logits, NULL, &o.out));
  assert_int_equal(o.idx[0], 0);
  assert_int_equal(o.idx[1], 2);
  outs_free(&o);

  /* Random tokens: every chosen expert lies in one of the best groups. */
  tu_rng_t rng = {303};
  const int64_t T = 200;
  const int32_t E = 32, G = 8, GK = 3, K = 4, size = E / G;
  c = config_make(E, K);
  c.num_groups = G;
  c.topk_groups = GK;
  float *l = random_logits(&rng, T, E, 2.0f);
  float *bias = random_bias(&rng, E, 0.05f);
  outs_alloc(&o, T, E, K);
  EXPECT_OK(epx_route(&c, T, l, bias, &o.out));
  for (int64_t t = 0; t < T; t++) {
    double row[32], p[32], gscore[8];
    for (int32_t e = 0; e < E; e++) row[e] = l[t * E + e];
    softmax64(row, c.num_experts, p);
    for (int32_t g = 0; g < G; g++) {
      double s[4];
      for (int32_t i = 0; i < size; i++) s[i] = p[g * size + i] + bias[g * size + i];
      double best = fmax(fmax(s[0], s[1]), fmax(s[2], s[3])), second = -INFINITY;
      int skipped = 0;
      for (int32_t i = 0; i < size; i++) {
        if (s[i] == best && !skipped) skipped = 1;
        else second = fmax(second, s[i]);
      }
      gscore[g] = best + second;
    }
    for (int32_t k = 0; k < K; k++) {
      const int32_t g = o.idx[t * K + k] / size;
      int better = 0;
      for (int32_t h = 0; h < G; h++) better += gscore[h] > gscore[g];
      if (better >= GK) fail_msg("token %lld chose expert %d of group %d, ranked %d of %d",
                                 (long long)t, o.idx[t * K + k], g, better, G);
    }
  }
  outs_free(&o);
  tu_free(l);
  tu_free(bias);
}

/* Equal scores go to the lower expert, equal groups to the lower group. */
static void test_route_ties(void **state) {
  (void)state;
  float logits[16];
  for (int i = 0; i < 16; i++) logits[i] = 0.25f;
  epx_route_config_t c = config_make(8, 3);
  outs o;
  outs_alloc(&o, 2, 8, 3);
  EXPECT_OK(epx_route(&c, 2, logits, NULL, &o.out));
  for (int t = 0; t < 2; t++)
    for (int k = 0; k < 3; k++) assert_int_equal(o.idx[t * 3 + k], k);
  c.num_groups = 4;
  c.topk_groups = 2;
  const float bias[8] = {0, 0, 0.5f, 0, 0, 0, 0, 0.5f};
  outs_poison(&o);
  EXPECT_OK(epx_route(&c, 2, logits, bias, &o.out));
  /* Groups 1 and 3 tie on score and beat 0 and 2; experts 2 and 7 tie. */
  const int32_t want[3] = {2, 7, 3};
  for (int t = 0; t < 2; t++)
    for (int k = 0; k < 3; k++) assert_int_equal(o.idx[t * 3 + k], want[k]);
  outs_free(&o);
  /* Groups 0 and 1 tie below group 2; keeping two, the tie goes to group 0. */
  {
    const float bias6[6] = {0, 0, 0, 0, 0.5f, 0};
    epx_route_config_t c6 = config_make(6, 2);
    c6.num_groups = 3;
    c6.topk_groups = 2;
    outs_alloc(&o, 2, 6, 2);
    EXPECT_OK(epx_route(&c6, 2, logits, bias6, &o.out));
    for (int t = 0; t < 2; t++) {
      assert_int_equal(o.idx[t * 2], 4);
      assert_int_equal(o.idx[t * 2 + 1], 0);
    }
    outs_free(&o);
  }
  /* Keeping one group: the tie goes to group 1. */
  c.top_k = 2;
  c.topk_groups = 1;
  outs_alloc(&o, 2, 8, 2);
  EXPECT_OK(epx_route(&c, 2, logits, bias, &o.out));
  for (int t = 0; t < 2; t++) {
    assert_int_equal(o.idx[t * 2], 2);
    assert_int_equal(o.idx[t * 2 + 1], 3);
  }
  outs_free(&o);
}

/* bench/gpu/bench_route.cu's inputs (8192 x 256, the same generator): per
 * token a permutation of uneven logit levels scaled by 0.5 + t/T, and a bias
 * in steps of 1e-3. Sigmoid plus bias ties there in float32 but not in
 * float64 (token 7976: experts 26 and 90 both score 1.00171554), which the
 * spec decides in float32, lower expert first; and near-ties one float32
 * step apart (token 2122: experts 63 and 78) that a float32 sigmoid of
 * expf, rounded three times, made ties. The GPU run found 156 routes of
 * 65536 apart from the reference, which then decided in float64. */
enum { BENCH_T = 8192, BENCH_E = 256 };

static void bench_inputs(float *logits, float *bias) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  int perm[BENCH_E];
  for (int64_t t = 0; t < BENCH_T; t++) {
    for (int e = 0; e < BENCH_E; e++) perm[e] = e;
    for (int e = BENCH_E - 1; e > 0; e--) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      const int j = (int)(x % (uint64_t)(e + 1)), keep = perm[e];
      perm[e] = perm[j];
      perm[j] = keep;
    }
    const float scale = 0.5f + (float)t / (float)BENCH_T;
    for (int e = 0; e < BENCH_E; e++)
      logits[t * BENCH_E + e] = scale * (-4.0f + 8.0f * powf((float)perm[e] / BENCH_E, 1.3f));
  }
  for (int e = 0; e < BENCH_E; e++) bias[e] = 1e-3f * (float)((e * 37) % 11);
}

static void test_route_float32_ties_of_bench(void **state) {
  (void)state;
  float *logits = tu_alloc(sizeof(float) * BENCH_T * BENCH_E), bias[BENCH_E];
  bench_inputs(logits, bias);
  const float *row = logits + 7976 * BENCH_E;
  /* The inputs still hold the tie this test is about. */
  assert_true(epx_route_sigmoid_f32(row[26]) + bias[26] == epx_route_sigmoid_f32(row[90]) + bias[90]);
  assert_true(1.0 / (1.0 + exp(-(double)row[26])) + bias[26] !=
              1.0 / (1.0 + exp(-(double)row[90])) + bias[90]);
  epx_route_config_t c = config_make(BENCH_E, 8);
  c.score_fn = EPX_SCORE_SIGMOID;
  c.num_groups = 8;
  c.topk_groups = 4;
  c.scaling_factor = 2.5f;
  c.aux_loss_coeff = 1e-3f;
  c.z_loss_coeff = 1e-4f;
  check_against_reference(&c, BENCH_T, logits, bias, "bench DeepSeek-V3");
  c.group_score_experts = 4;
  check_against_reference(&c, BENCH_T, logits, bias, "bench group score of 4");
  c.group_score_experts = 0;
  c.aux_counts = EPX_AUX_COUNTS_PLAIN_TOPK;
  c.aux_loss_sequences = 4;
  check_against_reference(&c, BENCH_T, logits, bias, "bench plain top-k aux, 4 sequences");
  /* The tie itself: lower expert first. */
  outs o;
  outs_alloc(&o, 1, BENCH_E, 8);
  c = config_make(BENCH_E, 8);
  c.score_fn = EPX_SCORE_SIGMOID;
  c.num_groups = 8;
  c.topk_groups = 4;
  EXPECT_OK(epx_route(&c, 1, row, bias, &o.out));
  assert_int_equal(o.idx[5], 26);
  assert_int_equal(o.idx[6], 90);
  outs_free(&o);
  tu_free(logits);
}

/* ------------------------------------------------------------------------ */
/* Capacity, worked by hand                                                  */
/* ------------------------------------------------------------------------ */

/* 4 tokens, 4 experts, top-2, capacity factor 1: C = ceil(2*4/4) = 2.
 * Softmax scores and choices (best first):
 *   t0 [.454 .501 .023 .023] -> 1, 0
 *   t1 [.682 .034 .251 .034] -> 0, 2
 *   t2 [.399 .361 .120 .120] -> 0, 1
 *   t3 [.421 .057 .465 .057] -> 2, 0
 * Expert 0 is asked by t0k1 .454, t1k0 .682, t2k0 .399, t3k1 .421; expert 1
 * by t0k0, t2k1; expert 2 by t1k1, t3k0; expert 3 by nobody. */
static const float capacity_logits[16] = {1.0f, 1.1f, -2.0f, -2.0f, 1.0f, -2.0f, 0.0f, -2.0f,
                                          0.2f, 0.1f, -1.0f, -1.0f, 0.0f, -2.0f, 0.1f, -2.0f};

static void check_capacity_case(epx_queue_order_t order, epx_drop_policy_t drop,
                                const int32_t want_idx[8], const int32_t want_loc[8]) {
  epx_route_config_t c = config_make(4, 2);
  c.renormalize = 0;
  c.capacity_mode = 1;
  c.capacity_factor = 1.0f;
  c.queue_order = order;
  c.drop_policy = drop;
  outs o;
  outs_alloc(&o, 4, 4, 2);
  EXPECT_OK(epx_route(&c, 4, capacity_logits, NULL, &o.out));
  assert_int_equal(o.out.capacity, 2);
  assert_int_equal(o.out.nonfinite_tokens, 0);
  const int32_t want_counts[4] = {4, 2, 2, 0}; /* before dropping */
  for (int e = 0; e < 4; e++) assert_int_equal(o.counts[e], want_counts[e]);
  for (int i = 0; i < 8; i++) {
    if (o.idx[i] != want_idx[i] || o.loc[i] != want_loc[i])
      fail_msg("order %d drop %d: route [%d, %d] is expert %d location %d, expected %d and %d",
               order, drop, i / 2, i % 2, o.idx[i], o.loc[i], want_idx[i], want_loc[i]);
    double row[4], p[4];
    for (int e = 0; e < 4; e++) row[e] = capacity_logits[(i / 2) * 4 + e];
    softmax64(row, c.num_experts, p);
    const double w = want_idx[i] < 0 ? 0.0 : p[want_idx[i]];
    if (!close_enough(o.w[i], w, W_ATOL, W_RTOL))
      fail_msg("order %d drop %d: topk_w[%d] is %g, expected %g", order, drop, i, o.w[i], w);
  }
  outs_free(&o);
}

static void test_route_capacity_by_hand(void **state) {
  (void)state;
  /* By choice: queue t0e1 t1e0 t2e0 t3e2 | t0e0 t1e2 t2e1 t3e0, so expert 0
   * fills with t1, t2 and drops t0k1 (position 2) and t3k1 (3). */
  const int32_t choice_position_idx[8] = {1, -1, 0, 2, 0, 1, 2, -1};
  const int32_t choice_position_loc[8] = {0, -1, 0, 1, 1, 1, 0, -1};
  check_capacity_case(EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, choice_position_idx,
                      choice_position_loc);
  /* By probability expert 0 keeps t1k0 .682 and t0k1 .454, located in choice
   * order: t1k0 (first choices) then t0k1. */
  const int32_t choice_prob_idx[8] = {1, 0, 0, 2, -1, 1, 2, -1};
  const int32_t choice_prob_loc[8] = {0, 1, 0, 1, -1, 1, 0, -1};
  check_capacity_case(EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_PROBABILITY, choice_prob_idx,
                      choice_prob_loc);
  /* By token: queue t0e1 t0e0 t1e0 t1e2 t2e0 t2e1 t3e2 t3e0; expert 0 fills
   * with t0k1, t1k0 and drops t2k0 and t3k1; expert 2 takes t1 first. */
  const int32_t token_position_idx[8] = {1, 0, 0, 2, -1, 1, 2, -1};
  const int32_t token_position_loc[8] = {0, 0, 1, 0, -1, 1, 1, -1};
  check_capacity_case(EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, token_position_idx,
                      token_position_loc);
  /* Same kept routes by probability, located in token order: t0k1 then t1k0. */
  check_capacity_case(EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_PROBABILITY, token_position_idx,
                      token_position_loc);
}

/* Dropless: every route stays, located by its rank in the expert's queue. */
static void test_route_dropless(void **state) {
  (void)state;
  epx_route_config_t c = config_make(4, 2);
  c.renormalize = 0;
  outs o;
  outs_alloc(&o, 4, 4, 2);
  const int32_t idx[8] = {1, 0, 0, 2, 0, 1, 2, 0};
  const int32_t choice_loc[8] = {0, 2, 0, 1, 1, 1, 0, 3};
  const int32_t token_loc[8] = {0, 0, 1, 0, 2, 1, 1, 3};
  for (int order = 0; order < 2; order++) {
    c.queue_order = order ? EPX_QUEUE_BY_TOKEN : EPX_QUEUE_BY_CHOICE;
    outs_poison(&o);
    EXPECT_OK(epx_route(&c, 4, capacity_logits, NULL, &o.out));
    assert_int_equal(o.out.capacity, 0);
    for (int i = 0; i < 8; i++) {
      assert_int_equal(o.idx[i], idx[i]);
      assert_int_equal(o.loc[i], order ? token_loc[i] : choice_loc[i]);
      assert_true(o.w[i] > 0.0f);
    }
    assert_int_equal(o.counts[0], 4);
    assert_int_equal(o.counts[3], 0);
  }
  outs_free(&o);

  /* Larger: dropless keeps all T*K routes and locations cover 0..count-1. */
  tu_rng_t rng = {404};
  const int64_t T = 500;
  const int32_t E = 8, K = 2;
  float *l = random_logits(&rng, T, E, 3.0f);
  c = config_make(E, K);
  outs_alloc(&o, T, E, K);
  EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
  int64_t total = 0;
  for (int32_t e = 0; e < E; e++) {
    total += o.counts[e];
    int32_t seen = 0;
    for (int64_t i = 0; i < T * K; i++) seen += o.idx[i] == e;
    assert_int_equal(seen, o.counts[e]);
  }
  assert_int_equal(total, T * K);
  for (int64_t i = 0; i < T * K; i++) {
    assert_true(o.idx[i] >= 0 && o.loc[i] >= 0 && o.loc[i] < o.counts[o.idx[i]]);
    for (int64_t j = 0; j < i; j++)
      if (o.idx[j] == o.idx[i] && o.loc[j] == o.loc[i]) fail_msg("routes %lld and %lld share a "
                                                                 "location", (long long)i,
                                                                 (long long)j);
  }
  outs_free(&o);
  tu_free(l);
}

static void test_route_capacity_formula(void **state) {
  (void)state;
  tu_rng_t rng = {505};
  const struct { int64_t T; int32_t E, K; float factor; int32_t min, want; } cases[] = {
      {4, 4, 2, 1.0f, 0, 2},   {4, 4, 2, 1.3f, 0, 3},  {4, 4, 2, 0.1f, 2, 2},
      {4, 4, 2, 0.1f, 0, 1},   {0, 4, 2, 1.0f, 3, 3},  {0, 4, 2, 1.0f, 0, 0},
      {5, 3, 2, 1.0f, 0, 4},   {10, 4, 1, 2.0f, 4, 5}, {1, 64, 8, 1.25f, 0, 1},
      {8192, 256, 8, 1.25f, 4, 320}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    epx_route_config_t c = config_make(cases[i].E, cases[i].K);
    c.capacity_mode = 1;
    c.capacity_factor = cases[i].factor;
    c.min_capacity = cases[i].min;
    float *l = random_logits(&rng, cases[i].T > 0 ? cases[i].T : 1, cases[i].E, 1.0f);
    outs o;
    outs_alloc(&o, cases[i].T, cases[i].E, cases[i].K);
    EXPECT_OK(epx_route(&c, cases[i].T, l, NULL, &o.out));
    if (o.out.capacity != cases[i].want)
      fail_msg("case %zu: capacity %d, expected %d", i, o.out.capacity, cases[i].want);
    int32_t fullest = 0;
    for (int64_t r = 0; r < cases[i].T * cases[i].K; r++)
      fullest = o.loc[r] + 1 > fullest ? o.loc[r] + 1 : fullest;
    assert_true(fullest <= cases[i].want);
    c.capacity_mode = 0;
    outs_poison(&o);
    EXPECT_OK(epx_route(&c, cases[i].T, l, NULL, &o.out));
    assert_int_equal(o.out.capacity, 0);
    outs_free(&o);
    tu_free(l);
  }
}

/* ------------------------------------------------------------------------ */
/* Edge cases                                                                */
/* ------------------------------------------------------------------------ */

static void test_route_no_tokens(void **state) {
  (void)state;
  epx_route_config_t c = config_make(8, 2);
  c.capacity_mode = 1;
  c.min_capacity = 3;
  c.aux_loss_coeff = 0.01f;
  c.z_loss_coeff = 0.01f;
  outs o;
  outs_alloc(&o, 0, 8, 2);
  EXPECT_OK(epx_route(&c, 0, NULL, NULL, &o.out));
  for (int e = 0; e < 8; e++) assert_int_equal(o.counts[e], 0);
  assert_true(*o.aux == 0.0f && *o.z == 0.0f);
  assert_int_equal(o.out.capacity, 3);
  assert_int_equal(o.out.nonfinite_tokens, 0);
  assert_spare_untouched(&o, "T = 0");
  epx_route_output_t bare = {NULL, NULL, NULL, NULL, NULL, NULL, 0, 0};
  EXPECT_OK(epx_route(&c, 0, NULL, NULL, &bare));
  EXPECT_OK(epx_route_backward(&c, 0, NULL, NULL, NULL, NULL, 1.0f, 1.0f, NULL));
  outs_free(&o);
}

static void test_route_all_experts(void **state) {
  (void)state;
  tu_rng_t rng = {606};
  const int64_t T = 20;
  const int32_t E = 6;
  float *l = random_logits(&rng, T, E, 1.0f);
  for (int score = 0; score < 2; score++) {
    epx_route_config_t c = config_make(E, E);
    c.score_fn = score ? EPX_SCORE_SIGMOID : EPX_SCORE_SOFTMAX;
    c.scaling_factor = 2.0f;
    check_against_reference(&c, T, l, NULL, "K = E");
    outs o;
    outs_alloc(&o, T, E, E);
    EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
    for (int64_t t = 0; t < T; t++) {
      double sum = 0;
      int seen[6] = {0};
      for (int32_t k = 0; k < E; k++) {
        seen[o.idx[t * E + k]]++;
        sum += o.w[t * E + k];
        if (k > 0) assert_true(o.w[t * E + k] <= o.w[t * E + k - 1]);
      }
      for (int32_t e = 0; e < E; e++) assert_int_equal(seen[e], 1);
      assert_true(close_enough(sum, 2.0, W_ATOL, W_RTOL));
    }
    for (int32_t e = 0; e < E; e++) assert_int_equal(o.counts[e], T);
    outs_free(&o);
  }
  tu_free(l);
}

static void test_route_unchosen_and_one_expert(void **state) {
  (void)state;
  tu_rng_t rng = {707};
  const int64_t T = 10;
  const int32_t E = 4;
  float *l = random_logits(&rng, T, E, 0.5f);
  for (int64_t t = 0; t < T; t++) l[t * E + 3] = -6.0f;
  epx_route_config_t c = config_make(E, 1);
  c.aux_loss_coeff = 1.0f;
  check_against_reference(&c, T, l, NULL, "expert 3 unchosen");
  outs o;
  outs_alloc(&o, T, E, 1);
  EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
  assert_int_equal(o.counts[3], 0);
  assert_int_equal(o.counts[0] + o.counts[1] + o.counts[2], T);

  /* Every token wants expert 0: C = ceil(10/4) = 3 of them stay. */
  for (int64_t t = 0; t < T; t++) l[t * E] = 6.0f + 0.1f * tu_normal(&rng);
  c.capacity_mode = 1;
  for (int drop = 0; drop < 2; drop++)
    for (int order = 0; order < 2; order++) {
      c.drop_policy = drop ? EPX_DROP_BY_PROBABILITY : EPX_DROP_BY_POSITION;
      c.queue_order = order ? EPX_QUEUE_BY_TOKEN : EPX_QUEUE_BY_CHOICE;
      check_against_reference(&c, T, l, NULL, "all to expert 0");
      outs_poison(&o);
      EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
      assert_int_equal(o.out.capacity, 3);
      assert_int_equal(o.counts[0], T);
      int kept = 0;
      for (int64_t t = 0; t < T; t++) {
        if (o.idx[t] == 0) {
          assert_int_equal(o.loc[t], kept);
          kept++;
          if (!drop) assert_true(t < 3);
        } else {
          assert_int_equal(o.idx[t], -1);
          assert_int_equal(o.loc[t], -1);
          assert_true(o.w[t] == 0.0f);
        }
      }
      assert_int_equal(kept, 3);
    }
  outs_free(&o);
  tu_free(l);
}

/* Softmax is shift-invariant: logits far from 0 (E not a multiple of 8, so
 * the maximum can sit in any lane) route like the reference, with finite
 * weights and losses. */
static void test_route_large_logits(void **state) {
  (void)state;
  tu_rng_t rng = {1414};
  const int64_t T = 30;
  const int32_t E = 13, K = 3;
  float *l = random_logits(&rng, T, E, 3.0f);
  for (int shift = -1; shift <= 1; shift += 2) {
    float *moved = tu_alloc(sizeof(float) * (size_t)(T * E));
    for (int64_t i = 0; i < T * E; i++) moved[i] = l[i] + 200.0f * shift;
    /* The largest logit of each row last, where the vector lanes end. */
    for (int64_t t = 0; t < T; t++) moved[t * E + E - 1] += 30.0f;
    epx_route_config_t c = config_make(E, K);
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.001f;
    check_against_reference(&c, T, moved, NULL, "shifted logits");
    tu_free(moved);
  }
  /* One logit 100 above the rest, at every position: exp(100) overflows
   * float32 unless the row's true maximum is subtracted. */
  {
    float spikes[13 * 13] = {0};
    for (int t = 0; t < E; t++) spikes[t * E + t] = 100.0f;
    epx_route_config_t c1 = config_make(E, 1);
    c1.z_loss_coeff = 1.0f;
    outs o1;
    outs_alloc(&o1, E, E, 1);
    EXPECT_OK(epx_route(&c1, E, spikes, NULL, &o1.out));
    for (int t = 0; t < E; t++) {
      assert_int_equal(o1.idx[t], t);
      assert_true(o1.w[t] == 1.0f);
    }
    assert_true(close_enough(*o1.z, 10000.0, W_ATOL, W_RTOL));
    outs_free(&o1);
  }
  /* Sigmoid scores that all underflow to 0: renormalised weights are 0, not NaN. */
  for (int64_t i = 0; i < T * E; i++) l[i] = -150.0f + l[i];
  epx_route_config_t c = config_make(E, K);
  c.score_fn = EPX_SCORE_SIGMOID;
  outs o;
  outs_alloc(&o, T, E, K);
  EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
  for (int64_t i = 0; i < T * K; i++) {
    assert_true(o.idx[i] >= 0 && o.idx[i] < E);
    assert_true(o.w[i] == 0.0f);
  }
  float *grad = tu_alloc(sizeof(float) * (size_t)(T * E));
  float *gw = random_logits(&rng, T, K, 1.0f);
  EXPECT_OK(epx_route_backward(&c, T, l, NULL, o.idx, gw, 0.0f, 0.0f, grad));
  for (int64_t i = 0; i < T * E; i++) assert_true(grad[i] == 0.0f);
  outs_free(&o);
  TU_FREE_ALL(grad, gw, l);
}

/* ------------------------------------------------------------------------ */
/* Gradients against central differences                                     */
/* ------------------------------------------------------------------------ */

/* The reference's loss L = sum_t,k gw[t,k] w[t,k] + ga aux + gz z (float64),
 * the selection recomputed from the perturbed logits; NAN when the step
 * changed a discrete result (an expert, location or count), where L has no
 * derivative. */
static double ref_loss(const epx_route_config_t *c, int64_t T, const float *logits,
                       const float *bias, const float *gw, double ga, double gz,
                       const ref_t *base) {
  ref_t r;
  ref_route(c, T, logits, bias, &r);
  double loss = ga * r.aux + gz * r.z;
  int same = 1;
  for (int64_t i = 0; i < T * c->top_k; i++) {
    if (gw) loss += gw[i] * r.w[i];
    same &= r.idx[i] == base->idx[i] && r.loc[i] == base->loc[i];
  }
  for (int32_t e = 0; e < c->num_experts; e++) same &= r.counts[e] == base->counts[e];
  ref_free(&r);
  return same ? loss : NAN;
}

/* Runs forward and backward: grad_logits against the reference's gradient,
 * and the reference's gradient against central differences of its own
 * forward (float64 logits steps through a float copy, so the step is
 * float-exact); returns max |grad_logits|. */
static double check_gradient(const epx_route_config_t *c, int64_t T, const float *logits,
                             const float *bias, const float *gw, float ga, float gz,
                             const char *label) {
  const int32_t E = c->num_experts;
  outs o;
  outs_alloc(&o, T, E, c->top_k);
  EXPECT_OK(epx_route(c, T, logits, bias, &o.out));
  float *grad = tu_alloc(sizeof(float) * (size_t)(T * E));
  double *want = tu_alloc(sizeof(double) * (size_t)(T * E));
  float *moved = tu_alloc(sizeof(float) * (size_t)(T * E));
  memcpy(moved, logits, sizeof(float) * (size_t)(T * E));
  tu_poison(grad, sizeof(float) * (size_t)(T * E));
  EXPECT_OK(epx_route_backward(c, T, logits, bias, o.idx, gw, ga, gz, grad));
  EXPECT_OK(epx_reference_route_backward(c, T, logits, bias, o.idx, gw, ga, gz, want));
  double largest = 0;
  for (int64_t i = 0; i < T * E; i++) {
    largest = fmax(largest, fabs(grad[i]));
    if (!close_enough(grad[i], want[i], G_ATOL, G_RTOL))
      fail_msg("%s: grad_logits[%lld] is %.9g, the reference %.9g", label, (long long)i, grad[i],
               want[i]);
  }
  const float step = 1.0f / 1024; /* exact in float around |l| < 8 */
  ref_t base;
  ref_route(c, T, logits, bias, &base);
  int64_t skipped = 0;
  /* The reference is checked on small batches (a forward per step). */
  const int64_t checked = T * E <= 1024 ? T * E : 0;
  for (int64_t i = 0; i < checked; i++) {
    const float keep = moved[i];
    moved[i] = keep + step;
    const double up = ref_loss(c, T, moved, bias, gw, ga, gz, &base);
    moved[i] = keep - step;
    const double down = ref_loss(c, T, moved, bias, gw, ga, gz, &base);
    moved[i] = keep;
    const double fd = (up - down) / (2.0 * (double)step);
    if (isnan(fd)) {
      skipped++;
      continue;
    }
    /* second-order error of a 1/1024 step: allow 1e-5 absolute. */
    if (!(fabs(fd - want[i]) <= 1e-5 + 1e-3 * fabs(want[i])))
      fail_msg("%s: reference gradient [%lld] is %.9g, central difference %.9g", label,
               (long long)i, want[i], fd);
  }
  /* The steps that crossed a selection or drop boundary are few. */
  if (skipped * 20 > checked) fail_msg("%s: %lld of %lld steps changed the routing", label,
                                     (long long)skipped, (long long)(T * E));
  ref_free(&base);
  TU_FREE_ALL(grad, want, moved);
  outs_free(&o);
  return largest;
}

static void test_route_gradients(void **state) {
  (void)state;
  tu_rng_t rng = {909};
  const int64_t T = 24;
  const int32_t E = 8, K = 3;
  for (int score = 0; score < 2; score++)
    for (int renorm = 0; renorm < 2; renorm++)
      for (int scaled = 0; scaled < 2; scaled++)
        for (int part = 0; part < 4; part++) {
          epx_route_config_t c = config_make(E, K);
          c.score_fn = score ? EPX_SCORE_SIGMOID : EPX_SCORE_SOFTMAX;
          c.renormalize = renorm;
          c.scaling_factor = scaled ? 2.5f : 1.0f;
          c.aux_loss_coeff = 0.5f;
          c.z_loss_coeff = 0.2f;
          /* part 3: everything at once, with capacity drops, groups and a bias. */
          if (part == 3) {
            c.capacity_mode = 1;
            c.capacity_factor = 0.7f;
            c.num_groups = 4;
            c.topk_groups = 3;
          }
          float *l = random_logits(&rng, T, E, 1.5f);
          float *gw = random_logits(&rng, T, K, 1.0f);
          float *bias = part == 3 ? random_bias(&rng, E, 0.1f) : NULL;
          const float ga = part == 1 || part == 3 ? 0.7f : 0.0f;
          const float gz = part == 2 || part == 3 ? -0.9f : 0.0f;
          char label[96];
          snprintf(label, sizeof label, "score %d renorm %d scale %d part %d", score, renorm,
                   scaled, part);
          const double largest =
              check_gradient(&c, T, l, bias, part == 0 || part == 3 ? gw : NULL, ga, gz, label);
          /* The weights' gradient (and each loss's) must reach the logits. */
          if (!(largest > (part == 0 || part == 3 ? 1e-3 : 1e-5))) fail_msg("%s: gradient vanished (max %g)", label, largest);
          TU_FREE_ALL(l, gw, bias);
        }
}

/* The options of the peers: the fast gradient against the reference's, and
 * the reference's against central differences of its own forward. */
static void test_route_option_gradients(void **state) {
  (void)state;
  tu_rng_t rng = {4242};
  const int64_t T = 12;
  const int32_t E = 6, K = 2;
  uint8_t mask[12];
  for (int64_t t = 0; t < T; t++) mask[t] = (uint8_t)(t != 5);
  const float global[6] = {3, 5, 1, 4, 2, 9};
  for (int score = 0; score < 4; score++)
    for (int variant = 0; variant < 5; variant++) {
      epx_route_config_t c = config_make(E, K);
      c.score_fn = (epx_score_fn_t)score;
      c.renormalize = variant != 4;
      c.renormalize_after_drop = variant == 1 || variant == 3;
      c.capacity_mode = variant == 1 || variant == 3;
      c.capacity_factor = 0.75f;
      c.drop_policy = variant == 3 ? EPX_DROP_BY_SCORE : EPX_DROP_BY_POSITION;
      c.aux_counts = (epx_aux_counts_t)(variant % 3);
      c.aux_loss_sequences = variant == 2 ? 3 : 0;
      c.aux_loss_expert_counts = variant == 4 ? global : NULL;
      c.aux_loss_tokens = 24;
      c.token_mask = variant == 3 ? mask : NULL;
      c.num_groups = variant == 4 ? 3 : 0;
      c.topk_groups = 2;
      c.group_score_experts = 1;
      c.aux_loss_coeff = 0.5f;
      c.z_loss_coeff = 0.2f;
      c.scaling_factor = 1.5f;
      float *l = random_logits(&rng, T, E, 1.5f);
      float *gw = random_logits(&rng, T, K, 1.0f);
      char label[96];
      snprintf(label, sizeof label, "option score %d variant %d", score, variant);
      const double largest = check_gradient(&c, T, l, NULL, gw, 0.7f, -0.9f, label);
      if (!(largest > 1e-3)) fail_msg("%s: gradient vanished (max %g)", label, largest);
      tu_free(l);
      tu_free(gw);
    }
}

/* renormalize_after_drop in dropless mode (DeepSpeed drop_tokens=False):
 * nothing is dropped, so the weights are renormalised over the K chosen, as
 * the reference and the backward have it (the forward once returned them
 * unnormalised, and its backward differentiated the normalised ones). */
static void test_route_renormalize_after_drop_dropless(void **state) {
  (void)state;
  tu_rng_t rng = {11020};
  const int64_t T = 16;
  const int32_t E = 4, K = 2;
  for (int score = 0; score < 4; score++)
    for (int order = 0; order < 2; order++) {
      epx_route_config_t c = config_make(E, K);
      c.score_fn = (epx_score_fn_t)score;
      c.queue_order = order ? EPX_QUEUE_BY_TOKEN : EPX_QUEUE_BY_CHOICE;
      c.renormalize_after_drop = 1;
      c.scaling_factor = score == 1 ? 2.5f : 1.0f;
      float *l = random_logits(&rng, T, E, 1.0f);
      float *gw = random_logits(&rng, T, K, 1.0f);
      char label[64];
      snprintf(label, sizeof label, "dropless renorm-after-drop score %d order %d", score, order);
      check_against_reference(&c, T, l, NULL, label);
      outs o;
      outs_alloc(&o, T, E, K);
      EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
      for (int64_t t = 0; t < T; t++) {
        assert_true(o.idx[t * K] >= 0 && o.idx[t * K + 1] >= 0);
        if (!close_enough((double)o.w[t * K] + o.w[t * K + 1], c.scaling_factor, W_ATOL, W_RTOL))
          fail_msg("%s: token %lld weights %.9g + %.9g, expected a sum of %g", label,
                   (long long)t, o.w[t * K], o.w[t * K + 1], (double)c.scaling_factor);
      }
      check_gradient(&c, T, l, NULL, gw, 0.0f, 0.0f, label);
      outs_free(&o);
      tu_free(l);
      tu_free(gw);
    }
}

/* Dropped slots carry no gradient; a NULL grad_topk_w is zeros. */
static void test_route_gradient_drops(void **state) {
  (void)state;
  tu_rng_t rng = {1010};
  const int64_t T = 16;
  const int32_t E = 4, K = 2;
  float *l = random_logits(&rng, T, E, 1.0f);
  float *gw = random_logits(&rng, T, K, 1.0f);
  epx_route_config_t c = config_make(E, K);
  c.renormalize = 0;
  c.capacity_mode = 1;
  c.capacity_factor = 0.5f;
  outs o;
  outs_alloc(&o, T, E, K);
  EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
  int dropped = 0;
  for (int64_t i = 0; i < T * K; i++) dropped += o.idx[i] < 0;
  assert_true(dropped > 0);
  check_gradient(&c, T, l, NULL, gw, 0.0f, 0.0f, "drops");
  /* A token with every slot dropped and no renormalisation gets zero gradient. */
  float *grad = tu_alloc(sizeof(float) * (size_t)(T * E));
  tu_poison(grad, sizeof(float) * (size_t)(T * E));
  EXPECT_OK(epx_route_backward(&c, T, l, NULL, o.idx, gw, 0.0f, 0.0f, grad));
  for (int64_t t = 0; t < T; t++)
    if (o.idx[t * K] < 0 && o.idx[t * K + 1] < 0)
      for (int32_t e = 0; e < E; e++) assert_true(grad[t * E + e] == 0.0f);
  tu_poison(grad, sizeof(float) * (size_t)(T * E));
  EXPECT_OK(epx_route_backward(&c, T, l, NULL, o.idx, NULL, 0.0f, 0.0f, grad));
  for (int64_t i = 0; i < T * E; i++) assert_true(grad[i] == 0.0f);
  TU_FREE_ALL(grad, l, gw);
  outs_free(&o);
}

/* ------------------------------------------------------------------------ */
/* Non-finite logits                                                         */
/* ------------------------------------------------------------------------ */

static void test_route_nonfinite(void **state) {
  (void)state;
  tu_rng_t rng = {808};
  const int64_t T = 12;
  const int32_t E = 8, K = 2;
  float *l = random_logits(&rng, T, E, 1.0f);
  l[2 * E + 3] = NAN;
  l[5 * E + 0] = -INFINITY;
  l[9 * E + 7] = INFINITY;
  epx_route_config_t c = config_make(E, K);
  c.aux_loss_coeff = 0.1f;
  c.z_loss_coeff = 0.01f;
  outs o;
  outs_alloc(&o, T, E, K);
  EXPECT_STATUS(epx_route(&c, T, l, NULL, &o.out), EPX_ERROR_INVALID_ARGUMENT, "token 2");
  assert_outs_untouched(&o, "nonfinite ERROR");

  float *grad = tu_alloc(sizeof(float) * (size_t)(T * E));
  int32_t *idx = tu_alloc(sizeof(int32_t) * (size_t)(T * K));
  float *gw = random_logits(&rng, T, K, 1.0f);
  for (int64_t i = 0; i < T * K; i++) idx[i] = -1;
  tu_poison(grad, sizeof(float) * (size_t)(T * E));
  EXPECT_STATUS(epx_route_backward(&c, T, l, NULL, idx, gw, 1.0f, 1.0f, grad),
                EPX_ERROR_INVALID_ARGUMENT, "token 2");
  assert_true(bytes_poisoned(grad, sizeof(float) * (size_t)(T * E)));

  c.nonfinite = EPX_NONFINITE_DROP;
  for (int mode = 0; mode < 2; mode++) {
    c.capacity_mode = mode;
    c.capacity_factor = 1.0f;
    check_against_reference(&c, T, l, NULL, "nonfinite DROP");
    outs_poison(&o);
    EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
    assert_int_equal(o.out.nonfinite_tokens, 3);
    int64_t total = 0;
    for (int32_t e = 0; e < E; e++) total += o.counts[e];
    assert_int_equal(total, (T - 3) * K);
    for (int t = 0; t < T; t++)
      for (int k = 0; k < K; k++)
        if (t == 2 || t == 5 || t == 9) {
          assert_int_equal(o.idx[t * K + k], -1);
          assert_int_equal(o.loc[t * K + k], -1);
          assert_true(o.w[t * K + k] == 0.0f);
        }
  }
  /* The losses are those of the valid tokens alone. */
  float *kept = tu_alloc(sizeof(float) * (size_t)(T * E));
  int64_t n = 0;
  for (int64_t t = 0; t < T; t++)
    if (t != 2 && t != 5 && t != 9) memcpy(kept + n++ * E, l + t * E, sizeof(float) * E);
  outs only;
  outs_alloc(&only, n, E, K);
  c.capacity_mode = 0;
  outs_poison(&o);
  EXPECT_OK(epx_route(&c, T, l, NULL, &o.out));
  EXPECT_OK(epx_route(&c, n, kept, NULL, &only.out));
  assert_true(close_enough(*o.aux, *only.aux, W_ATOL, W_RTOL));
  assert_true(close_enough(*o.z, *only.z, W_ATOL, W_RTOL));
  for (int32_t e = 0; e < E; e++) assert_int_equal(o.counts[e], only.counts[e]);
  outs_free(&only);

  /* Gradients over the valid tokens alone (T_valid in the aux and z terms). */
  check_gradient(&c, T, l, NULL, gw, 0.8f, 0.6f, "nonfinite DROP gradient");
  /* Backward: dropped rows get zero gradient. */
  tu_poison(grad, sizeof(float) * (size_t)(T * E));
  EXPECT_OK(epx_route_backward(&c, T, l, NULL, o.idx, gw, 1.0f, 1.0f, grad));
  for (int t = 0; t < T; t++)
    for (int e = 0; e < E; e++)
      if (t == 2 || t == 5 || t == 9) assert_true(grad[t * E + e] == 0.0f);
      else assert_true(isfinite(grad[t * E + e]));
  outs_free(&o);
  TU_FREE_ALL(kept, grad, idx, gw, l);
}

/* Batches of >= 64K logits are split over threads by blocks of tokens: the
 * same answers as the reference, each token routed as in a small batch, and
 * refusals name the first bad token of the whole batch. */
static void test_route_threaded_batches(void **state) {
  (void)state;
  tu_rng_t rng = {1515};
  const int64_t T = 2000;
  const int32_t E = 64, K = 6;
  float *l = random_logits(&rng, T, E, 2.0f);
  float *bias = random_bias(&rng, E, 0.02f);
  for (int mode = 0; mode < 3; mode++) {
    epx_route_config_t c = config_make(E, K);
    c.capacity_mode = mode > 0;
    c.capacity_factor = 1.0f;
    c.drop_policy = mode == 2 ? EPX_DROP_BY_PROBABILITY : EPX_DROP_BY_POSITION;
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.001f;
    check_against_reference(&c, T, l, bias, "threaded batch");
  }
  epx_route_config_t c = config_make(E, K);
  c.score_fn = EPX_SCORE_SIGMOID;
  outs whole, part;
  outs_alloc(&whole, T, E, K);
  outs_alloc(&part, 200, E, K);
  EXPECT_OK(epx_route(&c, T, l, bias, &whole.out));
  for (int64_t first = 0; first < T; first += 200) {
    outs_poison(&part);
    EXPECT_OK(epx_route(&c, 200, l + first * E, bias, &part.out));
    assert_memory_equal(part.idx, whole.idx + first * K, sizeof(int32_t) * 200 * K);
    assert_memory_equal(part.w, whole.w + first * K, sizeof(float) * 200 * K);
  }
  outs_free(&part);

  /* Gradients of a threaded batch against central differences. */
  c = config_make(E, K);
  c.aux_loss_coeff = 0.3f;
  c.z_loss_coeff = 0.1f;
  c.capacity_mode = 1;
  c.capacity_factor = 0.9f;
  float *gw = random_logits(&rng, T, K, 1.0f);
  check_gradient(&c, 1100, l, bias, gw, 0.5f, 0.5f, "threaded gradient");

  /* The first bad token is named, not the first one a thread met. */
  float *grad = tu_alloc(sizeof(float) * (size_t)(T * E));
  l[1500 * E + 9] = NAN;
  l[700 * E + 3] = INFINITY;
  outs_poison(&whole);
  EXPECT_STATUS(epx_route(&c, T, l, bias, &whole.out), EPX_ERROR_INVALID_ARGUMENT,
                "token 700");
  assert_outs_untouched(&whole, "threaded nonfinite");
  l[700 * E + 3] = 0.5f;
  l[1500 * E + 9] = 0.5f;
  c.capacity_mode = 0; /* no -1 slots: every change below is a mismatch */
  EXPECT_OK(epx_route(&c, T, l, bias, &whole.out));
  whole.idx[1900 * K + 2] = (whole.idx[1900 * K + 2] + 1) % E;
  whole.idx[1200 * K + 1] = (whole.idx[1200 * K + 1] + 1) % E;
  tu_poison(grad, sizeof(float) * (size_t)(T * E));
  EXPECT_STATUS(epx_route_backward(&c, T, l, bias, whole.idx, gw, 0, 0, grad),
                EPX_ERROR_INVALID_ARGUMENT, "topk_idx[1200, 1]");
  assert_true(bytes_poisoned(grad, sizeof(float) * (size_t)(T * E)));
  outs_free(&whole);
  TU_FREE_ALL(grad, gw, bias, l);
}

/* ------------------------------------------------------------------------ */
/* Bad arguments                                                             */
/* ------------------------------------------------------------------------ */

enum { BAD_T = 4, BAD_E = 8, BAD_K = 2 };

static void expect_refused(const epx_route_config_t *c, int64_t T, const float *logits,
                           const float *bias, outs *o, epx_route_output_t *out,
                           epx_status_t status, const char *needle) {
  outs_poison(o);
  EXPECT_STATUS(epx_route(c, T, logits, bias, out), status, needle);
  assert_outs_untouched(o, needle);
}

static void test_route_bad_arguments(void **state) {
  (void)state;
  tu_rng_t rng = {1111};
  float *l = random_logits(&rng, BAD_T, BAD_E, 1.0f);
  float *bias = random_bias(&rng, BAD_E, 0.1f);
  float *l_copy = tu_alloc(sizeof(float) * BAD_T * BAD_E);
  memcpy(l_copy, l, sizeof(float) * BAD_T * BAD_E);
  outs o;
  outs_alloc(&o, BAD_T, BAD_E, BAD_K);
  const epx_route_config_t good = config_make(BAD_E, BAD_K);
  epx_route_config_t c = good;
  EXPECT_OK(epx_route(&c, BAD_T, l, bias, &o.out));

  expect_refused(NULL, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "config is NULL");
  c = good, c.struct_size = 4;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "struct_size");
  c = good, c.version = 99;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "version");
  c = good, c.num_experts = 0;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "num_experts");
  c = good, c.top_k = 0;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "top_k is 0");
  c = good, c.top_k = 9;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT,
                 "top_k 9 exceeds num_experts 8");
  c = good;
  expect_refused(&c, -1, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "num_tokens is -1");
  expect_refused(&c, (int64_t)1 << 40, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT,
                 "num_tokens");
  expect_refused(&c, BAD_T, NULL, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT,
                 "logits is NULL");
  expect_refused(&c, BAD_T, (const float *)((const char *)l + 2), bias, &o, &o.out,
                 EPX_ERROR_INVALID_ARGUMENT, "logits");
  expect_refused(&c, BAD_T, l, (const float *)((const char *)bias + 1), &o, &o.out,
                 EPX_ERROR_INVALID_ARGUMENT, "bias");
  outs_poison(&o);
  EXPECT_STATUS(epx_route(&c, BAD_T, l, bias, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "output is NULL");
  assert_outs_untouched(&o, "output NULL");

  /* Output arrays: NULL where required, and misaligned. */
  struct {
    int which;
    int misalign;
    const char *needle;
  } arrays[] = {{0, 0, "topk_idx is NULL"}, {1, 0, "topk_w is NULL"},
                {0, 1, "topk_idx"},         {1, 1, "topk_w"},
                {2, 1, "locations"},        {3, 1, "expert_counts"},
                {4, 1, "aux_loss"},         {5, 1, "z_loss"}};
  for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) {
    epx_route_output_t bad = o.out;
    bad.capacity = CAPACITY_SENTINEL;
    bad.nonfinite_tokens = NONFINITE_SENTINEL;
    void **slot[6] = {(void **)&bad.topk_idx, (void **)&bad.topk_w, (void **)&bad.locations,
                      (void **)&bad.expert_counts, (void **)&bad.aux_loss, (void **)&bad.z_loss};
    *slot[arrays[i].which] = arrays[i].misalign ? (char *)*slot[arrays[i].which] + 2 : NULL;
    expect_refused(&c, BAD_T, l, bias, &o, &bad, EPX_ERROR_INVALID_ARGUMENT, arrays[i].needle);
    assert_int_equal(bad.capacity, CAPACITY_SENTINEL);
    assert_int_equal(bad.nonfinite_tokens, NONFINITE_SENTINEL);
  }

  c = good, c.score_fn = (epx_score_fn_t)7;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "score_fn is 7");
  c = good, c.queue_order = (epx_queue_order_t)5;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "queue_order");
  c = good, c.drop_policy = (epx_drop_policy_t)-1;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "drop_policy");
  c = good, c.nonfinite = (epx_nonfinite_policy_t)3;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "nonfinite");
  c = good, c.device = (epx_device_t)4;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "device");
  c = good, c.num_groups = 3, c.topk_groups = 1;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "num_groups 3");
  c = good, c.num_groups = 4, c.topk_groups = 0;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "topk_groups");
  c = good, c.num_groups = 4, c.topk_groups = 5;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "topk_groups");
  c = good, c.num_groups = 8, c.topk_groups = 1;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "top_k 2");
  c = good, c.renormalize = 2;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "renormalize");
  c = good, c.capacity_mode = -1;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "capacity_mode");
  c = good, c.scaling_factor = NAN;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "scaling_factor");
  c = good, c.aux_loss_coeff = INFINITY;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "aux_loss_coeff");
  c = good, c.z_loss_coeff = NAN;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "z_loss_coeff");
  const float factors[3] = {0.0f, -1.0f, NAN};
  for (int i = 0; i < 3; i++) {
    c = good, c.capacity_mode = 1, c.capacity_factor = factors[i];
    expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT,
                   "capacity_factor");
  }
  c = good, c.capacity_mode = 1, c.min_capacity = -1;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "min_capacity");
  /* Capacity settings are ignored in dropless mode. */
  c = good, c.capacity_factor = 0.0f, c.min_capacity = -1;
  outs_poison(&o);
  EXPECT_OK(epx_route(&c, BAD_T, l, bias, &o.out));
  c = good;
  bias[1] = NAN;
  expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "bias[1]");
  bias[1] = 0.0f;
  if (!epx_has_cuda()) {
    c = good, c.device = EPX_DEVICE_CUDA;
    expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_UNSUPPORTED, "CUDA");
    /* Host-side checks come first. */
    c.top_k = 9;
    expect_refused(&c, BAD_T, l, bias, &o, &o.out, EPX_ERROR_INVALID_ARGUMENT, "top_k 9");
  }
  /* Inputs are never written. */
  assert_memory_equal(l, l_copy, sizeof(float) * BAD_T * BAD_E);
  outs_free(&o);
  TU_FREE_ALL(l, l_copy, bias);
}

static void test_route_backward_bad_arguments(void **state) {
  (void)state;
  tu_rng_t rng = {1212};
  float *l = random_logits(&rng, BAD_T, BAD_E, 1.0f);
  float *gw = random_logits(&rng, BAD_T, BAD_K, 1.0f);
  float *grad = tu_alloc(sizeof(float) * BAD_T * BAD_E);
  outs o;
  outs_alloc(&o, BAD_T, BAD_E, BAD_K);
  const epx_route_config_t good = config_make(BAD_E, BAD_K);
  epx_route_config_t c = good;
  EXPECT_OK(epx_route(&c, BAD_T, l, NULL, &o.out));
  EXPECT_OK(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, 0.0f, 0.0f, grad));
  const size_t bytes = sizeof(float) * BAD_T * BAD_E;
#define EXPECT_BACKWARD_REFUSED(call, code, needle)                                             \
  do {                                                                                          \
    tu_poison(grad, bytes);                                                                     \
    EXPECT_STATUS(call, code, needle);                                                       \
    if (!bytes_poisoned(grad, bytes)) fail_msg("%s: grad_logits was written", needle);          \
  } while (0)
  EXPECT_BACKWARD_REFUSED(epx_route_backward(NULL, BAD_T, l, NULL, o.idx, gw, 0, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "config is NULL");
  c = good, c.top_k = 9;
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, 0, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "top_k 9 exceeds num_experts 8");
  c = good;
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, -3, l, NULL, o.idx, gw, 0, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "num_tokens is -3");
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, NULL, NULL, o.idx, gw, 0, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "logits is NULL");
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, l, NULL, NULL, gw, 0, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "topk_idx is NULL");
  EXPECT_STATUS(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, 0, 0, NULL),
                EPX_ERROR_INVALID_ARGUMENT, "grad_logits is NULL");
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, l, NULL, o.idx,
                                             (const float *)((const char *)gw + 1), 0, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "grad_topk_w");
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, NAN, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "grad_aux_loss");
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, 0, INFINITY, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "grad_z_loss");
  tu_poison(grad, bytes);
  EXPECT_STATUS(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, 0, 0,
                                   (float *)((char *)grad + 2)),
                EPX_ERROR_INVALID_ARGUMENT, "grad_logits");
  assert_true(bytes_poisoned(grad, bytes));
  /* A topk_idx that is not this routing's. */
  const int32_t keep = o.idx[3];
  o.idx[3] = (keep + 1) % BAD_E;
  EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, 0, 0, grad),
                          EPX_ERROR_INVALID_ARGUMENT, "topk_idx[1, 1]");
  o.idx[3] = keep;
  if (!epx_has_cuda()) {
    c = good, c.device = EPX_DEVICE_CUDA;
    EXPECT_BACKWARD_REFUSED(epx_route_backward(&c, BAD_T, l, NULL, o.idx, gw, 0, 0, grad),
                            EPX_ERROR_UNSUPPORTED, "CUDA");
  }
#undef EXPECT_BACKWARD_REFUSED
  outs_free(&o);
  TU_FREE_ALL(l, gw, grad);
}

/* The same inputs give the same bits, and grad_logits may be the logits. */
static void test_route_deterministic_and_in_place(void **state) {
  (void)state;
  tu_rng_t rng = {1313};
  const int64_t T = 64;
  const int32_t E = 16, K = 4;
  float *l = random_logits(&rng, T, E, 1.0f);
  float *gw = random_logits(&rng, T, K, 1.0f);
  epx_route_config_t c = config_make(E, K);
  c.score_fn = EPX_SCORE_SIGMOID;
  c.aux_loss_coeff = 0.1f;
  c.z_loss_coeff = 0.1f;
  outs a, b;
  outs_alloc(&a, T, E, K);
  outs_alloc(&b, T, E, K);
  EXPECT_OK(epx_route(&c, T, l, NULL, &a.out));
  EXPECT_OK(epx_route(&c, T, l, NULL, &b.out));
  assert_memory_equal(a.idx, b.idx, sizeof(int32_t) * (size_t)(T * K));
  assert_memory_equal(a.w, b.w, sizeof(float) * (size_t)(T * K));
  assert_memory_equal(a.aux, b.aux, sizeof(float));
  float *grad = tu_alloc(sizeof(float) * (size_t)(T * E));
  EXPECT_OK(epx_route_backward(&c, T, l, NULL, a.idx, gw, 0.5f, 0.5f, grad));
  EXPECT_OK(epx_route_backward(&c, T, l, NULL, a.idx, gw, 0.5f, 0.5f, l));
  assert_memory_equal(grad, l, sizeof(float) * (size_t)(T * E));
  outs_free(&a);
  outs_free(&b);
  TU_FREE_ALL(grad, gw, l);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_route_matches_reference),
      cmocka_unit_test(test_route_larger_shapes),
      cmocka_unit_test(test_route_bias_selects_not_weights),
      cmocka_unit_test(test_route_group_limited),
      cmocka_unit_test(test_route_ties),
      cmocka_unit_test(test_route_float32_ties_of_bench),
      cmocka_unit_test(test_route_capacity_by_hand),
      cmocka_unit_test(test_route_dropless),
      cmocka_unit_test(test_route_capacity_formula),
      cmocka_unit_test(test_route_no_tokens),
      cmocka_unit_test(test_route_all_experts),
      cmocka_unit_test(test_route_unchosen_and_one_expert),
      cmocka_unit_test(test_route_large_logits),
      cmocka_unit_test(test_route_nonfinite),
      cmocka_unit_test(test_route_gradients),
      cmocka_unit_test(test_route_option_gradients),
      cmocka_unit_test(test_route_gradient_drops),
      cmocka_unit_test(test_route_renormalize_after_drop_dropless),
      cmocka_unit_test(test_route_threaded_batches),
      cmocka_unit_test(test_route_bad_arguments),
      cmocka_unit_test(test_route_backward_bad_arguments),
      cmocka_unit_test(test_route_deterministic_and_in_place),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
