/* Gradients of the exchange on one rank against central differences of a
 * float64 reference of the same scalar loss L = <G, output>:
 *   - dispatch: d/dx, and d/dw with EPX_WEIGHTS_IN_DISPATCH;
 *   - combine: d/d expert_out, and d/dw with EPX_WEIGHTS_IN_COMBINE;
 *   - end to end: logits -> epx_route -> dispatch -> a per-expert scale ->
 *     combine -> L, where the weight gradient of the exchange fed to
 *     epx_route_backward must give d/d logits — and it must not be zero.
 * Payloads are float32. The loss is linear (bilinear in x and w) in the
 * exchange tests, so central differences are exact up to float64 rounding;
 * the tolerances below only absorb the library's float32 arithmetic. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref64.h"
#include "testutil.h"
#include "buffer_config.h"

#define FD_STEP 1e-3          /* the exchange losses are (bi)linear */
#define FD_STEP_LOGITS 1e-5   /* the route loss is smooth in the logits */
#define G_ATOL 1e-5
#define G_RTOL 1e-4
#define ROUTE_ATOL 1e-6
#define ROUTE_RTOL 1e-3

static void assert_grad(const float *got, const double *want, int64_t n, double atol, double rtol, const char *what) {
  int64_t at = -1;
  double err = r64_max_error(got, want, n, atol, rtol, &at);
  if (!(err <= 1.0))
    fail_msg("%s: normalised error %.3g > 1 at %lld: got %.9g, finite differences %.9g", what, err, (long long)at,
             got[at], want[at]);
}

static float *random_f32(tu_rng_t *rng, int64_t n) {
  float *p = tu_alloc(sizeof(float) * (size_t)(n ? n : 1));
  tu_fill(rng, EPX_FLOAT32, p, n);
  return p;
}

static double *to_f64(const float *p, int64_t n) {
  double *d = tu_alloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) d[i] = p[i];
  return d;
}

/* ------------------------------------------------------------------------ */
/* A routing and where its routes land                                       */
/* ------------------------------------------------------------------------ */

typedef struct {
  int64_t T, H, N;
  int32_t E, K, C;       /* C: dense capacity (T when dropless) */
  epx_layout_t layout;
  int32_t align;
  int32_t *idx, *loc;    /* [T, K] */
  float *w;              /* [T, K] */
  int64_t *dense_row;    /* [E * C] layout row of each dense slot, -1 if empty */
} setup_t;

/* Random top-K routing with ~15% of the routes -1; positions per layout
 * (capacity: routes past C dropped); the layout rows of each dense slot
 * derived here from the spec, not asked of the library. */
static setup_t setup_make(tu_rng_t *rng, int64_t T, int64_t H, int32_t E, int32_t K, epx_layout_t layout,
                          int32_t align, int32_t C) {
  setup_t s = {T, H, 0, E, K, layout == EPX_LAYOUT_CAPACITY ? C : (int32_t)T, layout, align, NULL, NULL, NULL, NULL};
  s.idx = tu_alloc(sizeof(int32_t) * (size_t)(T * K));
  s.loc = tu_alloc(sizeof(int32_t) * (size_t)(T * K));
  s.w = tu_alloc(sizeof(float) * (size_t)(T * K));
  tu_random_routing(rng, T, E, K, 0.0, s.idx, s.w);
  for (int64_t i = 0; i < T * K; i++)
    if (tu_uniform(rng) < 0.15) s.idx[i] = -1;
  int64_t *counts = tu_alloc(sizeof(int64_t) * (size_t)E), *offsets = tu_alloc(sizeof(int64_t) * (size_t)(E + 1));
  r64_queue_locations(T, E, K, s.idx, s.loc, counts);
  if (layout == EPX_LAYOUT_CAPACITY) {
    for (int64_t i = 0; i < T * K; i++)
      if (s.loc[i] >= C) s.idx[i] = s.loc[i] = -1;
    for (int32_t e = 0; e <= E; e++) offsets[e] = (int64_t)e * C;
  } else {
    r64_expert_offsets(E, counts, align, offsets);
  }
  s.N = offsets[E];
  s.dense_row = tu_alloc(sizeof(int64_t) * (size_t)(E * s.C + 1));
  for (int64_t d = 0; d < (int64_t)E * s.C; d++) s.dense_row[d] = -1;
  for (int64_t i = 0; i < T * K; i++)
    if (s.idx[i] >= 0) s.dense_row[(int64_t)s.idx[i] * s.C + s.loc[i]] = offsets[s.idx[i]] + s.loc[i];
  tu_free(counts);
  tu_free(offsets);
  return s;
}

static void setup_free(setup_t *s) {
  tu_free(s->idx);
  tu_free(s->loc);
  tu_free(s->w);
  tu_free(s->dense_row);
}

static epx_buffer_t setup_buffer(const setup_t *s, epx_weighting_t wt, epx_handle_t *h) {
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, s->H, s->E, s->K, s->T);
  c.layout = s->layout;
  c.expert_alignment = s->align;
  c.capacity = s->layout == EPX_LAYOUT_CAPACITY ? s->C : 0;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(tu_self_comm, &c, &b));
  epx_routing_t r = {s->T, s->K, s->idx, s->w, s->layout == EPX_LAYOUT_CAPACITY ? s->loc : NULL, wt};
  EXPECT_OK(epx_dispatch_layout(b, &r, NULL, h));
  int64_t n = -1;
  EXPECT_OK(epx_handle_recv_rows(*h, &n));
  assert_int_equal(n, s->N);
  return b;
}

/* ------------------------------------------------------------------------ */
/* Dispatch: L = <G, recv_x>                                                 */
/* ------------------------------------------------------------------------ */

/* L(x, w) in float64: the dense dispatch, read back through the layout's rows. */
static double dispatch_loss(const setup_t *s, int weighted, const double *x, const double *w, const double *g,
                            double *dense) {
  r64_dense_dispatch(s->T, s->H, s->E, s->C, s->K, s->idx, w, s->loc, weighted, x, dense);
  double L = 0.0;
  for (int64_t d = 0; d < (int64_t)s->E * s->C; d++)
    if (s->dense_row[d] >= 0) L += r64_dot(g + s->dense_row[d] * s->H, dense + d * s->H, s->H);
  return L;
}

static void check_dispatch_gradients(tu_rng_t *rng, epx_layout_t layout, int32_t align, epx_weighting_t wt) {
  setup_t s = setup_make(rng, 11, 16, 6, 3, layout, align, 4);
  int64_t T = s.T, H = s.H, N = s.N, TK = T * s.K;
  int weighted = wt == EPX_WEIGHTS_IN_DISPATCH;
  epx_handle_t h = NULL;
  epx_buffer_t b = setup_buffer(&s, wt, &h);
  float *x = random_f32(rng, T * H), *g = random_f32(rng, N * H); /* padding rows of g too */
  float *recv = tu_alloc(sizeof(float) * (size_t)(N * H + 1));
  float *grad_x = tu_alloc(sizeof(float) * (size_t)(T * H)), *grad_w = tu_alloc(sizeof(float) * (size_t)TK);
  tu_poison(grad_x, sizeof(float) * (size_t)(T * H));
  tu_poison(grad_w, sizeof(float) * (size_t)TK);
  EXPECT_OK(epx_dispatch(b, h, x, recv, N));
  EXPECT_OK(epx_dispatch_backward(b, h, g, grad_x, weighted ? x : NULL, weighted ? grad_w : NULL));

  double *x64 = to_f64(x, T * H), *w64 = to_f64(s.w, TK), *g64 = to_f64(g, N * H);
  double *dense = tu_alloc(sizeof(double) * (size_t)(s.E * s.C * H + 1));
  /* The reference is the library's function: its L equals <G, recv_x>. */
  double L = dispatch_loss(&s, weighted, x64, w64, g64, dense), L_lib = 0.0;
  for (int64_t i = 0; i < N * H; i++) L_lib += g64[i] * recv[i];
  assert_true(fabs(L - L_lib) <= 1e-5 * (1.0 + fabs(L)));

  double *fd = tu_alloc(sizeof(double) * (size_t)(T * H > TK ? T * H : TK));
  for (int64_t i = 0; i < T * H; i++) {
    double v = x64[i];
    x64[i] = v + FD_STEP;
    double up = dispatch_loss(&s, weighted, x64, w64, g64, dense);
    x64[i] = v - FD_STEP;
    double down = dispatch_loss(&s, weighted, x64, w64, g64, dense);
    x64[i] = v;
    fd[i] = (up - down) / (2 * FD_STEP);
  }
  assert_grad(grad_x, fd, T * H, G_ATOL, G_RTOL, "dispatch grad_x");
  if (weighted) {
    for (int64_t i = 0; i < TK; i++) {
      double v = w64[i];
      w64[i] = v + FD_STEP;
      double up = dispatch_loss(&s, weighted, x64, w64, g64, dense);
      w64[i] = v - FD_STEP;
      double down = dispatch_loss(&s, weighted, x64, w64, g64, dense);
      w64[i] = v;
      fd[i] = (up - down) / (2 * FD_STEP);
    }
    assert_grad(grad_w, fd, TK, G_ATOL, G_RTOL, "dispatch grad_w");
    int nonzero = 0;
    for (int64_t i = 0; i < TK; i++) nonzero |= s.idx[i] >= 0 && fabs(fd[i]) > 1e-3;
    assert_true(nonzero);
  }
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  void *bufs[] = {x, g, recv, grad_x, grad_w, x64, w64, g64, dense, fd};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_free(bufs[i]);
  setup_free(&s);
}

static void test_dispatch_gradients(void **state) {
  (void)state;
  tu_rng_t rng = {0xbac0001};
  const epx_weighting_t wts[] = {EPX_WEIGHTS_IN_DISPATCH, EPX_WEIGHTS_IN_COMBINE, EPX_WEIGHTS_NONE};
  for (size_t i = 0; i < 3; i++) {
    check_dispatch_gradients(&rng, EPX_LAYOUT_EXPERT_MAJOR, 1, wts[i]);
    check_dispatch_gradients(&rng, EPX_LAYOUT_EXPERT_MAJOR, 4, wts[i]);
    check_dispatch_gradients(&rng, EPX_LAYOUT_CAPACITY, 1, wts[i]);
  }
}

/* ------------------------------------------------------------------------ */
/* Combine: L = <G, out>                                                     */
/* ------------------------------------------------------------------------ */

/* L(y, w) in float64, y [N, H] in the layout: the dense combine of y's rows
 * in their dense slots (rows outside every slot are padding). */
static double combine_loss(const setup_t *s, int weighted, const double *y, const double *w, const double *g,
                           double *dense, double *out) {
  int64_t H = s->H;
  for (int64_t d = 0; d < (int64_t)s->E * s->C; d++) {
    if (s->dense_row[d] >= 0) memcpy(dense + d * H, y + s->dense_row[d] * H, sizeof(double) * (size_t)H);
    else memset(dense + d * H, 0, sizeof(double) * (size_t)H);
  }
  r64_dense_combine(s->T, H, s->E, s->C, s->K, s->idx, w, s->loc, weighted, dense, out);
  return r64_dot(g, out, s->T * H);
}

static void check_combine_gradients(tu_rng_t *rng, epx_layout_t layout, int32_t align, epx_weighting_t wt) {
  setup_t s = setup_make(rng, 9, 16, 6, 2, layout, align, 3);
  int64_t T = s.T, H = s.H, N = s.N, TK = T * s.K;
  int weighted = wt == EPX_WEIGHTS_IN_COMBINE;
  epx_handle_t h = NULL;
  epx_buffer_t b = setup_buffer(&s, wt, &h);
  float *y = random_f32(rng, N * H), *g = random_f32(rng, T * H), *out = tu_alloc(sizeof(float) * (size_t)(T * H));
  float *grad_y = tu_alloc(sizeof(float) * (size_t)(N * H + 1)), *grad_w = tu_alloc(sizeof(float) * (size_t)TK);
  tu_poison(grad_y, sizeof(float) * (size_t)(N * H));
  tu_poison(grad_w, sizeof(float) * (size_t)TK);
  EXPECT_OK(epx_combine(b, h, y, out));
  EXPECT_OK(epx_combine_backward(b, h, g, weighted ? y : NULL, grad_y, weighted ? grad_w : NULL));

  double *y64 = to_f64(y, N * H), *w64 = to_f64(s.w, TK), *g64 = to_f64(g, T * H);
  double *dense = tu_alloc(sizeof(double) * (size_t)(s.E * s.C * H + 1)), *out64 = tu_alloc(sizeof(double) * (size_t)(T * H));
  double L = combine_loss(&s, weighted, y64, w64, g64, dense, out64), L_lib = 0.0;
  for (int64_t i = 0; i < T * H; i++) L_lib += g64[i] * out[i];
  assert_true(fabs(L - L_lib) <= 1e-5 * (1.0 + fabs(L)));

  double *fd = tu_alloc(sizeof(double) * (size_t)(N * H > TK ? N * H : TK) + 8);
  /* Every element of expert_out, padding rows included (their gradient is 0). */
  for (int64_t i = 0; i < N * H; i++) {
    double v = y64[i];
    y64[i] = v + FD_STEP;
    double up = combine_loss(&s, weighted, y64, w64, g64, dense, out64);
    y64[i] = v - FD_STEP;
    double down = combine_loss(&s, weighted, y64, w64, g64, dense, out64);
    y64[i] = v;
    fd[i] = (up - down) / (2 * FD_STEP);
  }
  assert_grad(grad_y, fd, N * H, G_ATOL, G_RTOL, "combine grad_expert_out");
  if (weighted) {
    for (int64_t i = 0; i < TK; i++) {
      double v = w64[i];
      w64[i] = v + FD_STEP;
      double up = combine_loss(&s, weighted, y64, w64, g64, dense, out64);
      w64[i] = v - FD_STEP;
      double down = combine_loss(&s, weighted, y64, w64, g64, dense, out64);
      w64[i] = v;
      fd[i] = (up - down) / (2 * FD_STEP);
    }
    assert_grad(grad_w, fd, TK, G_ATOL, G_RTOL, "combine grad_w");
    int nonzero = 0;
    for (int64_t i = 0; i < TK; i++) nonzero |= s.idx[i] >= 0 && fabs(fd[i]) > 1e-3;
    assert_true(nonzero);
  }
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  void *bufs[] = {y, g, out, grad_y, grad_w, y64, w64, g64, dense, out64, fd};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_free(bufs[i]);
  setup_free(&s);
}

static void test_combine_gradients(void **state) {
  (void)state;
  tu_rng_t rng = {0xbac0002};
  const epx_weighting_t wts[] = {EPX_WEIGHTS_IN_COMBINE, EPX_WEIGHTS_IN_DISPATCH, EPX_WEIGHTS_NONE};
  for (size_t i = 0; i < 3; i++) {
    check_combine_gradients(&rng, EPX_LAYOUT_EXPERT_MAJOR, 1, wts[i]);
    check_combine_gradients(&rng, EPX_LAYOUT_EXPERT_MAJOR, 8, wts[i]);
    check_combine_gradients(&rng, EPX_LAYOUT_CAPACITY, 1, wts[i]);
  }
}

/* ------------------------------------------------------------------------ */
/* End to end: logits -> route -> dispatch -> expert -> combine -> L          */
/* ------------------------------------------------------------------------ */

typedef struct {
  const char *name;
  epx_score_fn_t score;
  int32_t renormalize;
  float scaling;
  int32_t capacity_mode; /* 1: the capacity layout, routes past C dropped */
  epx_weighting_t weighting;
} route_case_t;

/* The expert: a fixed scale per expert, y = scale(e) * x. */
static double expert_scale(int32_t e) { return 0.5 + 0.25 * e; }

/* L(logits, x) in float64 with the selection held fixed: chosen [T, K] are
 * the top-K experts of the unperturbed logits (dropped ones included, as
 * renormalisation counts them), kept [T, K] whether the forward kept them. */
static double route_loss(const route_case_t *rc, int64_t T, int32_t E, int32_t K, int64_t H, const double *logits,
                         const double *x, const int32_t *chosen, const int32_t *kept_idx, const double *g) {
  double L = 0.0, p[64];
  for (int64_t t = 0; t < T; t++) {
    const double *l = logits + t * E;
    double max = l[0], sum = 0.0;
    for (int32_t e = 1; e < E; e++) max = l[e] > max ? l[e] : max;
    for (int32_t e = 0; e < E; e++) {
      p[e] = rc->score == EPX_SCORE_SOFTMAX ? exp(l[e] - max) : 1.0 / (1.0 + exp(-l[e]));
      sum += p[e];
    }
    if (rc->score == EPX_SCORE_SOFTMAX)
      for (int32_t e = 0; e < E; e++) p[e] /= sum;
    double chosen_sum = 0.0;
    for (int32_t k = 0; k < K; k++) chosen_sum += p[chosen[t * K + k]];
    double gx = r64_dot(g + t * H, x + t * H, H);
    for (int32_t k = 0; k < K; k++) {
      if (kept_idx[t * K + k] < 0) continue;
      int32_t e = chosen[t * K + k];
      double w = p[e] * (rc->renormalize ? 1.0 / chosen_sum : 1.0) * rc->scaling;
      L += w * expert_scale(e) * gx;
    }
  }
  return L;
}

static void check_route_end_to_end(tu_rng_t *rng, const route_case_t *rc) {
  const int64_t T = 10, H = 16;
  const int32_t E = 8, K = 2;
  /* Logits whose K-th and (K+1)-th best differ by at least 0.05, so the
   * selection cannot flip inside a finite-difference step. */
  float *logits = tu_alloc(sizeof(float) * (size_t)(T * E));
  int32_t *chosen = tu_alloc(sizeof(int32_t) * (size_t)(T * K));
  for (int64_t t = 0; t < T; t++) {
    for (;;) {
      float *l = logits + t * E;
      for (int32_t e = 0; e < E; e++) l[e] = 1.5f * tu_normal(rng);
      int32_t order[8];
      for (int32_t e = 0; e < E; e++) order[e] = e;
      for (int32_t i = 1; i < E; i++)
        for (int32_t j = i; j > 0 && l[order[j]] > l[order[j - 1]]; j--) {
          int32_t tmp = order[j];
          order[j] = order[j - 1];
          order[j - 1] = tmp;
        }
      int separated = 1;
      for (int32_t i = 0; i < K; i++) separated &= l[order[i]] - l[order[i + 1]] >= 0.05f;
      if (!separated) continue;
      for (int32_t k = 0; k < K; k++) chosen[t * K + k] = order[k];
      break;
    }
  }
  epx_route_config_t cfg = EPX_ROUTE_CONFIG_INIT;
  cfg.num_experts = E;
  cfg.top_k = K;
  cfg.score_fn = rc->score;
  cfg.renormalize = rc->renormalize;
  cfg.scaling_factor = rc->scaling;
  cfg.capacity_mode = rc->capacity_mode;
  cfg.capacity_factor = 0.5f; /* C = ceil(2 * 10 / 8 * 0.5) = 2: 16 slots for 20 routes */
  int32_t *idx = tu_alloc(sizeof(int32_t) * (size_t)(T * K)), *loc = tu_alloc(sizeof(int32_t) * (size_t)(T * K));
  float *w = tu_alloc(sizeof(float) * (size_t)(T * K));
  epx_route_output_t ro = {idx, w, loc, NULL, NULL, NULL, 0, 0};
  EXPECT_OK(epx_route(&cfg, T, logits, NULL, &ro));
  int dropped = 0;
  for (int64_t i = 0; i < T * K; i++) {
    if (idx[i] >= 0) assert_int_equal(idx[i], chosen[i]);
    dropped += idx[i] < 0;
  }
  if (rc->capacity_mode) assert_true(dropped > 0);

  epx_buffer_config_t bc = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, K, 0);
  bc.layout = rc->capacity_mode ? EPX_LAYOUT_CAPACITY : EPX_LAYOUT_EXPERT_MAJOR;
  bc.expert_alignment = 4;
  bc.capacity = ro.capacity;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(tu_self_comm, &bc, &b));
  epx_routing_t routing = {T, K, idx, w, rc->capacity_mode ? loc : NULL, rc->weighting};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  int64_t N = 0;
  EXPECT_OK(epx_handle_recv_rows(h, &N));
  int32_t *recv_expert = tu_alloc(sizeof(int32_t) * (size_t)(N + 1));
  EXPECT_OK(epx_handle_recv_routing(h, recv_expert, NULL));

  /* Forward. */
  int in_dispatch = rc->weighting == EPX_WEIGHTS_IN_DISPATCH;
  float *x = random_f32(rng, T * H), *g = random_f32(rng, T * H);
  float *recv = tu_alloc(sizeof(float) * (size_t)(N * H + 1)), *y = tu_alloc(sizeof(float) * (size_t)(N * H + 1));
  float *out = tu_alloc(sizeof(float) * (size_t)(T * H));
  EXPECT_OK(epx_dispatch(b, h, x, recv, N));
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < H; j++)
      y[i * H + j] = recv_expert[i] < 0 ? 0.0f : (float)expert_scale(recv_expert[i]) * recv[i * H + j];
  EXPECT_OK(epx_combine(b, h, y, out));

  /* Backward: combine, the expert, dispatch, then the route. */
  float *grad_y = tu_alloc(sizeof(float) * (size_t)(N * H + 1)), *grad_recv = tu_alloc(sizeof(float) * (size_t)(N * H + 1));
  float *grad_x = tu_alloc(sizeof(float) * (size_t)(T * H)), *grad_w = tu_alloc(sizeof(float) * (size_t)(T * K));
  float *grad_logits = tu_alloc(sizeof(float) * (size_t)(T * E));
  tu_poison(grad_w, sizeof(float) * (size_t)(T * K));
  tu_poison(grad_logits, sizeof(float) * (size_t)(T * E));
  EXPECT_OK(epx_combine_backward(b, h, g, in_dispatch ? NULL : y, grad_y, in_dispatch ? NULL : grad_w));
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < H; j++)
      grad_recv[i * H + j] = recv_expert[i] < 0 ? 0.0f : (float)expert_scale(recv_expert[i]) * grad_y[i * H + j];
  EXPECT_OK(epx_dispatch_backward(b, h, grad_recv, grad_x, in_dispatch ? x : NULL, in_dispatch ? grad_w : NULL));
  EXPECT_OK(epx_route_backward(&cfg, T, logits, NULL, idx, grad_w, 0.0f, 0.0f, grad_logits));

  /* The float64 loss and its central differences. */
  double *l64 = to_f64(logits, T * E), *x64 = to_f64(x, T * H), *g64 = to_f64(g, T * H);
  double L = route_loss(rc, T, E, K, H, l64, x64, chosen, idx, g64), L_lib = 0.0;
  for (int64_t i = 0; i < T * H; i++) L_lib += g64[i] * out[i];
  if (!(fabs(L - L_lib) <= 1e-5 * (1.0 + fabs(L)))) fail_msg("%s: L = %.9g but the library's is %.9g", rc->name, L, L_lib);
  double *fd = tu_alloc(sizeof(double) * (size_t)(T * (H > E ? H : E)));
  for (int64_t i = 0; i < T * E; i++) {
    double v = l64[i];
    l64[i] = v + FD_STEP_LOGITS;
    double up = route_loss(rc, T, E, K, H, l64, x64, chosen, idx, g64);
    l64[i] = v - FD_STEP_LOGITS;
    double down = route_loss(rc, T, E, K, H, l64, x64, chosen, idx, g64);
    l64[i] = v;
    fd[i] = (up - down) / (2 * FD_STEP_LOGITS);
  }
  char what[128];
  snprintf(what, sizeof what, "%s: grad_logits", rc->name);
  assert_grad(grad_logits, fd, T * E, ROUTE_ATOL, ROUTE_RTOL, what);
  /* The router learns: a weight applied but not differentiated would leave
   * grad_logits at zero while the finite differences are not. */
  double largest = 0.0;
  for (int64_t i = 0; i < T * E; i++) largest = fabs(grad_logits[i]) > largest ? fabs(grad_logits[i]) : largest;
  if (!(largest > 1e-2)) fail_msg("%s: grad_logits is (nearly) zero: max |g| = %g", rc->name, largest);
  for (int64_t i = 0; i < T * H; i++) {
    double v = x64[i];
    x64[i] = v + FD_STEP;
    double up = route_loss(rc, T, E, K, H, l64, x64, chosen, idx, g64);
    x64[i] = v - FD_STEP;
    double down = route_loss(rc, T, E, K, H, l64, x64, chosen, idx, g64);
    x64[i] = v;
    fd[i] = (up - down) / (2 * FD_STEP);
  }
  snprintf(what, sizeof what, "%s: grad_x", rc->name);
  assert_grad(grad_x, fd, T * H, G_ATOL, G_RTOL, what);

  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  void *bufs[] = {logits, chosen, idx, loc, w, recv_expert, x, g, recv, y, out, grad_y, grad_recv, grad_x,
                  grad_w, grad_logits, l64, x64, g64, fd};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_free(bufs[i]);
}

static void test_route_end_to_end(void **state) {
  (void)state;
  tu_rng_t rng = {0xbac0003};
  const route_case_t cases[] = {
      {"softmax, renormalised, weights in combine", EPX_SCORE_SOFTMAX, 1, 1.0f, 0, EPX_WEIGHTS_IN_COMBINE},
      {"softmax, renormalised, weights in dispatch", EPX_SCORE_SOFTMAX, 1, 1.0f, 0, EPX_WEIGHTS_IN_DISPATCH},
      {"sigmoid, scaled 2.5, weights in combine", EPX_SCORE_SIGMOID, 0, 2.5f, 0, EPX_WEIGHTS_IN_COMBINE},
      {"sigmoid, renormalised, scaled 1.5, weights in dispatch", EPX_SCORE_SIGMOID, 1, 1.5f, 0, EPX_WEIGHTS_IN_DISPATCH},
      {"softmax, capacity layout with drops, weights in combine", EPX_SCORE_SOFTMAX, 0, 1.0f, 1, EPX_WEIGHTS_IN_COMBINE},
      {"softmax, renormalised, capacity layout with drops, weights in dispatch", EPX_SCORE_SOFTMAX, 1, 1.0f, 1,
       EPX_WEIGHTS_IN_DISPATCH},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_route_end_to_end(&rng, &cases[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dispatch_gradients),
      cmocka_unit_test(test_combine_gradients),
      cmocka_unit_test(test_route_end_to_end),
  };
  return cmocka_run_group_tests(tests, tu_self_setup, tu_self_teardown);
}
