/* The exchange on one rank against the dense one-hot reference
 * (epx_reference_dense_dispatch / _combine): every layout, dtype, weighting
 * and both exchanges, forward and backward; the capacity layout worked by
 * hand from epx_route; tensor-parallel slicing of the capacity layout; and
 * the edge cases (no tokens, K = E, empty experts, one expert, all dropped,
 * cached dispatch, repeatability).
 *
 * Integers (row counts, counts, offsets, sources, recv routing) are checked
 * exactly. Dispatch rows and combine-backward rows are one product per value
 * in both the sparse and the dense form, so they are checked exactly too;
 * combine and dispatch-backward sum K products in another order than the
 * dense einsum, so they are checked within tu_atol/tu_rtol of the dtype. The
 * weight gradients are float32 dots checked against float64 dots within
 * GW_ATOL + GW_RTOL. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref64.h"
#include "testutil.h"
#include "buffer_config.h"

#define GW_ATOL 1e-5
#define GW_RTOL 1e-4
#define GUARD_ROWS 2

static const char *layout_name(epx_layout_t l, int32_t align) {
  static char name[64];
  if (l == EPX_LAYOUT_EXPERT_MAJOR) snprintf(name, sizeof name, "expert-major/%d", align);
  else snprintf(name, sizeof name, "%s", tu_layout_name(l));
  return name;
}

/* ------------------------------------------------------------------------ */
/* Routings                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct {
  int64_t T;
  int32_t E, K;
  int32_t C;    /* dense capacity: the capacity layout's C, else T */
  int32_t *idx; /* [T, K] */
  float *w;     /* [T, K] */
  int32_t *loc; /* [T, K] dense positions */
} routing_t;

static routing_t routing_alloc(int64_t T, int32_t E, int32_t K) {
  routing_t r = {T, E, K, (int32_t)T, NULL, NULL, NULL};
  size_t n = (size_t)(T * K);
  r.idx = tu_alloc(n * sizeof(int32_t));
  r.w = tu_alloc(n * sizeof(float));
  r.loc = tu_alloc(n * sizeof(int32_t));
  return r;
}

static void routing_free(routing_t *r) {
  tu_free(r->idx);
  tu_free(r->w);
  tu_free(r->loc);
}

/* Dropless positions: loc = rank among the expert's routes, tokens ascending. */
static void routing_locate_dropless(routing_t *r) {
  int64_t *counts = tu_alloc(sizeof(int64_t) * (size_t)r->E);
  r64_queue_locations(r->T, r->E, r->K, r->idx, r->loc, counts);
  r->C = (int32_t)r->T;
  tu_free(counts);
}

/* Capacity positions: routes past C in token order are dropped (-1, their
 * weight left as garbage the library must ignore) and each expert's kept
 * routes get its slots in a random order, so the layout must follow the
 * locations literally. */
static void routing_locate_capacity(tu_rng_t *rng, routing_t *r, int32_t C) {
  int64_t *counts = tu_alloc(sizeof(int64_t) * (size_t)r->E);
  int32_t *perm = tu_alloc(sizeof(int32_t) * (size_t)(C ? C : 1));
  r64_queue_locations(r->T, r->E, r->K, r->idx, r->loc, counts);
  for (int64_t i = 0; i < r->T * r->K; i++)
    if (r->loc[i] >= C) r->idx[i] = r->loc[i] = -1;
  for (int32_t e = 0; e < r->E; e++) {
    for (int32_t c = 0; c < C; c++) perm[c] = c;
    for (int32_t c = C - 1; c > 0; c--) {
      int32_t j = tu_below(rng, c + 1), tmp = perm[c];
      perm[c] = perm[j];
      perm[j] = tmp;
    }
    for (int64_t i = 0; i < r->T * r->K; i++)
      if (r->idx[i] == e) r->loc[i] = perm[r->loc[i]];
  }
  r->C = C;
  tu_free(counts);
  tu_free(perm);
}

/* Random routing: K distinct experts per token (Zipf-skewed when zipf > 0),
 * about 10% of the routes dropped to -1 and token 1 with no route at all. */
static routing_t routing_random(tu_rng_t *rng, int64_t T, int32_t E, int32_t K, double zipf) {
  routing_t r = routing_alloc(T, E, K);
  tu_random_routing(rng, T, E, K, zipf, r.idx, r.w);
  for (int64_t i = 0; i < T * K; i++)
    if (tu_uniform(rng) < 0.1) r.idx[i] = -1;
  if (T > 1)
    for (int32_t k = 0; k < K; k++) r.idx[K + k] = -1;
  return r;
}

/* ------------------------------------------------------------------------ */
/* Payload helpers                                                           */
/* ------------------------------------------------------------------------ */

static void *payload(tu_rng_t *rng, epx_dtype_t dtype, int64_t rows, int64_t H) {
  void *p = tu_alloc((size_t)(rows * H) * epx_dtype_size(dtype));
  tu_fill(rng, dtype, p, rows * H);
  return p;
}

static void *poisoned(size_t bytes) {
  void *p = tu_alloc(bytes);
  tu_poison(p, bytes);
  return p;
}

static int is_zero(const void *p, size_t bytes) {
  const unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++)
    if (b[i]) return 0;
  return 1;
}

static int is_poison(const void *p, size_t bytes) {
  const unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++)
    if (b[i] != 0xA5) return 0;
  return 1;
}

/* got == want value by value (-0 equals +0; NaN never passes). */
static void assert_values_equal(epx_dtype_t dtype, const void *got, const void *want, int64_t n,
                                const char *what, const char *which, int64_t row) {
  for (int64_t i = 0; i < n; i++) {
    float a = epx_load(dtype, got, i), b = epx_load(dtype, want, i);
    if (!(a == b))
      fail_msg("%s: %s: row %lld element %lld is %.9g, expected %.9g", what, which, (long long)row, (long long)i, a, b);
  }
}

static void assert_close(epx_dtype_t dtype, const void *got, const void *want, int64_t n, const char *what,
                         const char *which) {
  double err = tu_max_error(dtype, got, dtype, want, n, tu_atol(dtype), tu_rtol(dtype));
  if (!(err <= 1.0))
    fail_msg("%s: %s: normalised error %.3g > 1 (atol %g, rtol %g)", what, which, err, tu_atol(dtype), tu_rtol(dtype));
}

static epx_buffer_t buffer_make(epx_dtype_t dtype, int64_t H, int32_t E, int32_t K, int64_t max_tokens,
                                epx_exchange_t exchange, epx_layout_t layout, int32_t align, int32_t C) {
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, dtype, H, E, K, max_tokens);
  c.max_tokens_rounding = 8;
  c.exchange = exchange;
  c.layout = layout;
  c.expert_alignment = align;
  c.capacity = layout == EPX_LAYOUT_CAPACITY ? C : 0;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(tu_self_comm, &c, &b));
  return b;
}

/* ------------------------------------------------------------------------ */
/* Sparse against dense                                                      */
/* ------------------------------------------------------------------------ */

typedef struct {
  epx_dtype_t dtype;
  epx_layout_t layout;
  int32_t align;
  epx_weighting_t weighting;
  int pass_w; /* routing.topk_w given (always, unless EPX_WEIGHTS_NONE says otherwise) */
  int64_t H;
} case_t;

/* The layout a routing must produce, computed here from the spec. */
typedef struct {
  int64_t N;
  int32_t slots;         /* K for rank-major, else 1 */
  int64_t *counts;       /* [E] valid routes per expert */
  int64_t *offsets;      /* [E + 1] */
  int32_t *row_token;    /* [N] source token, -1 for padding / empty slots */
  int32_t *row_dense;    /* [N * slots] dense index e * C + c, -1 elsewhere */
  int32_t *row_expert;   /* [N * slots] */
  float *row_w;          /* [N * slots] */
  int32_t *token_row;    /* [T] rank-major row of each token, -1 if none */
} expected_t;

static expected_t expected_layout(const routing_t *r, const case_t *c) {
  expected_t x = {0};
  int64_t T = r->T;
  int32_t E = r->E, K = r->K, C = r->C;
  x.counts = tu_alloc(sizeof(int64_t) * (size_t)E);
  x.offsets = tu_alloc(sizeof(int64_t) * (size_t)(E + 1));
  x.token_row = tu_alloc(sizeof(int32_t) * (size_t)(T ? T : 1));
  for (int64_t i = 0; i < T * K; i++)
    if (r->idx[i] >= 0) x.counts[r->idx[i]]++;
  x.slots = c->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  int64_t tokens_routed = 0;
  for (int64_t t = 0; t < T; t++) {
    int any = 0;
    for (int32_t k = 0; k < K; k++) any |= r->idx[t * K + k] >= 0;
    x.token_row[t] = any ? (int32_t)tokens_routed++ : -1;
  }
  if (c->layout == EPX_LAYOUT_EXPERT_MAJOR) {
    r64_expert_offsets(E, x.counts, c->align, x.offsets);
    x.N = x.offsets[E];
  } else if (c->layout == EPX_LAYOUT_CAPACITY) {
    for (int32_t e = 0; e <= E; e++) x.offsets[e] = (int64_t)e * C;
    x.N = (int64_t)E * C;
  } else {
    x.offsets[E] = x.N = tokens_routed;
  }
  size_t cells = (size_t)(x.N * x.slots) + 1;
  x.row_token = tu_alloc(sizeof(int32_t) * (size_t)(x.N + 1));
  x.row_dense = tu_alloc(sizeof(int32_t) * cells);
  x.row_expert = tu_alloc(sizeof(int32_t) * cells);
  x.row_w = tu_alloc(sizeof(float) * cells);
  for (int64_t i = 0; i < x.N; i++) x.row_token[i] = -1;
  for (size_t i = 0; i < cells; i++) x.row_dense[i] = x.row_expert[i] = -1;
  for (int64_t t = 0; t < T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = r->idx[t * K + k];
      if (e < 0) continue;
      int64_t cell;
      if (c->layout == EPX_LAYOUT_RANK_MAJOR) {
        x.row_token[x.token_row[t]] = (int32_t)t;
        cell = (int64_t)x.token_row[t] * K + k;
      } else {
        cell = c->layout == EPX_LAYOUT_EXPERT_MAJOR ? x.offsets[e] + r->loc[t * K + k]
                                                    : (int64_t)e * C + r->loc[t * K + k];
        x.row_token[cell] = (int32_t)t;
      }
      x.row_dense[cell] = e * C + r->loc[t * K + k];
      x.row_expert[cell] = e;
      x.row_w[cell] = c->pass_w ? r->w[t * K + k] : 0.0f;
    }
  return x;
}

static void expected_free(expected_t *x) {
  tu_free(x->counts);
  tu_free(x->offsets);
  tu_free(x->token_row);
  tu_free(x->row_token);
  tu_free(x->row_dense);
  tu_free(x->row_expert);
  tu_free(x->row_w);
}

/* What one exchange produced; compared bit for bit across exchanges. */
typedef struct {
  void *recv_x, *out, *grad_x, *grad_eo;
  float *gw_dispatch, *gw_combine;
} results_t;

static void results_free(results_t *r) {
  tu_free(r->recv_x);
  tu_free(r->out);
  tu_free(r->grad_x);
  tu_free(r->grad_eo);
  tu_free(r->gw_dispatch);
  tu_free(r->gw_combine);
}

/* Runs one routing through one exchange and checks every output against the
 * dense reference. Inputs: x [T, H]; ys / gs [N, H] expert outputs and
 * recv-side gradients in the layout (padding rows hold garbage the library
 * must ignore); yd / gd the same in dense [E, C, H] positions; gout [T, H]. */
typedef struct {
  const void *x, *ys, *gs, *yd, *gd, *gout;
  const void *ref_recv;  /* [E*C, H] dense dispatch of x */
  const void *ref_out;   /* [T, H] dense combine of yd */
  const void *ref_gx;    /* [T, H] dense combine of gd (dispatch's transpose) */
  const void *ref_geo;   /* [E*C, H] dense dispatch of gout (combine's transpose) */
} inputs_t;

static results_t run_exchange(const routing_t *r, const case_t *c, const expected_t *x, const inputs_t *in,
                              epx_exchange_t exchange, const char *what) {
  epx_dtype_t dt = c->dtype;
  int64_t T = r->T, H = c->H, N = x->N;
  int32_t E = r->E, K = r->K;
  size_t row_bytes = (size_t)H * epx_dtype_size(dt);
  epx_buffer_t b = buffer_make(dt, H, E, K, T % 3 == 0 ? 0 : T, exchange, c->layout, c->align, r->C);
  epx_routing_t routing = {T, K, r->idx, c->pass_w ? r->w : NULL,
                           c->layout == EPX_LAYOUT_CAPACITY ? r->loc : NULL, c->weighting};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));

  /* Integers, exactly. */
  int64_t rows = -1;
  EXPECT_OK(epx_handle_recv_rows(h, &rows));
  if (rows != N) fail_msg("%s: recv rows %lld, expected %lld", what, (long long)rows, (long long)N);
  int64_t *counts = poisoned(sizeof(int64_t) * (size_t)E), *offsets = poisoned(sizeof(int64_t) * (size_t)(E + 1));
  EXPECT_OK(epx_handle_expert_counts(h, counts, offsets));
  for (int32_t e = 0; e < E; e++)
    if (counts[e] != x->counts[e]) fail_msg("%s: counts[%d] = %lld, expected %lld", what, e, (long long)counts[e], (long long)x->counts[e]);
  for (int32_t e = 0; e <= E; e++)
    if (offsets[e] != x->offsets[e]) fail_msg("%s: offsets[%d] = %lld, expected %lld", what, e, (long long)offsets[e], (long long)x->offsets[e]);
  size_t cells = (size_t)(N * x->slots);
  int32_t *src_rank = poisoned(sizeof(int32_t) * (size_t)(N + 1)), *src_token = poisoned(sizeof(int32_t) * (size_t)(N + 1));
  int32_t *recv_expert = poisoned(sizeof(int32_t) * (cells + 1));
  float *recv_w = poisoned(sizeof(float) * (cells + 1));
  EXPECT_OK(epx_handle_recv_source(h, src_rank, src_token));
  EXPECT_OK(epx_handle_recv_routing(h, recv_expert, recv_w));
  for (int64_t i = 0; i < N; i++) {
    if (src_token[i] != x->row_token[i] || src_rank[i] != (x->row_token[i] < 0 ? -1 : 0))
      fail_msg("%s: row %lld comes from (rank %d, token %d), expected token %d", what, (long long)i, src_rank[i],
               src_token[i], x->row_token[i]);
  }
  for (size_t i = 0; i < cells; i++) {
    if (recv_expert[i] != x->row_expert[i]) fail_msg("%s: recv_expert[%zu] = %d, expected %d", what, i, recv_expert[i], x->row_expert[i]);
    if (!(recv_w[i] == x->row_w[i])) fail_msg("%s: recv_w[%zu] = %g, expected %g", what, i, recv_w[i], x->row_w[i]);
  }
  if (!is_poison(src_token + N, sizeof(int32_t)) || !is_poison(recv_expert + cells, sizeof(int32_t)))
    fail_msg("%s: the recv accessors wrote past N", what);
  epx_handle_stats_t stats;
  EXPECT_OK(epx_handle_stats(h, &stats));
  int64_t routes = 0, pairs = 0;
  for (int32_t e = 0; e < E; e++) routes += x->counts[e];
  for (int64_t t = 0; t < T; t++) pairs += x->token_row[t] >= 0;
  if (stats.send_rows || stats.recv_rows || stats.local_rows != (exchange == EPX_EXCHANGE_DEDUP ? pairs : routes))
    fail_msg("%s: stats send %lld recv %lld local %lld", what, (long long)stats.send_rows, (long long)stats.recv_rows,
             (long long)stats.local_rows);

  /* Dispatch: every row is x[t] (times w in dispatch), padding zero, nothing past N. */
  results_t res;
  res.recv_x = poisoned((size_t)(N + GUARD_ROWS) * row_bytes);
  EXPECT_OK(epx_dispatch(b, h, in->x, res.recv_x, N + GUARD_ROWS));
  for (int64_t i = 0; i < N; i++) {
    const char *row = (const char *)res.recv_x + (size_t)i * row_bytes;
    if (x->row_token[i] < 0) {
      if (!is_zero(row, row_bytes)) fail_msg("%s: padding row %lld of recv_x is not zero", what, (long long)i);
      continue;
    }
    if (c->layout == EPX_LAYOUT_RANK_MAJOR)
      assert_values_equal(dt, row, (const char *)in->x + (size_t)x->row_token[i] * row_bytes, H, what, "recv_x (rank-major) vs x", i);
    for (int32_t s = 0; s < x->slots; s++) {
      int32_t d = x->row_dense[i * x->slots + s];
      if (d >= 0) assert_values_equal(dt, row, (const char *)in->ref_recv + (size_t)d * row_bytes, H, what, "recv_x vs dense dispatch", i);
    }
  }
  if (!is_poison((char *)res.recv_x + (size_t)N * row_bytes, GUARD_ROWS * row_bytes))
    fail_msg("%s: dispatch wrote past N rows", what);

  /* Combine. */
  res.out = poisoned((size_t)(T ? T : 1) * row_bytes);
  EXPECT_OK(epx_combine(b, h, in->ys, res.out));
  assert_close(dt, res.out, in->ref_out, T * H, what, "combine vs dense combine");
  for (int64_t t = 0; t < T; t++)
    if (x->token_row[t] < 0 && !is_zero((char *)res.out + (size_t)t * row_bytes, row_bytes))
      fail_msg("%s: token %lld has no route but its combine row is not zero", what, (long long)t);

  /* Dispatch backward: the transpose of dispatch, grad_w = <grad_recv, x>. */
  int in_dispatch = c->weighting == EPX_WEIGHTS_IN_DISPATCH, in_combine = c->weighting == EPX_WEIGHTS_IN_COMBINE;
  res.grad_x = poisoned((size_t)(T ? T : 1) * row_bytes);
  res.gw_dispatch = poisoned(sizeof(float) * (size_t)(T * K + 1));
  EXPECT_OK(epx_dispatch_backward(b, h, in->gs, res.grad_x, in_dispatch ? in->x : NULL, in_dispatch ? res.gw_dispatch : NULL));
  if (c->layout == EPX_LAYOUT_RANK_MAJOR) {
    for (int64_t t = 0; t < T; t++) {
      const char *got = (const char *)res.grad_x + (size_t)t * row_bytes;
      if (x->token_row[t] < 0) {
        if (!is_zero(got, row_bytes)) fail_msg("%s: grad_x of unrouted token %lld is not zero", what, (long long)t);
      } else {
        assert_values_equal(dt, got, (const char *)in->gs + (size_t)x->token_row[t] * row_bytes, H, what, "grad_x (rank-major)", t);
      }
    }
  } else {
    assert_close(dt, res.grad_x, in->ref_gx, T * H, what, "dispatch_backward vs dense");
  }
  if (in_dispatch) {
    double *a = tu_alloc(sizeof(double) * (size_t)H), *g = tu_alloc(sizeof(double) * (size_t)H);
    for (int64_t t = 0; t < T; t++)
      for (int32_t k = 0; k < K; k++) {
        float got = res.gw_dispatch[t * K + k];
        int32_t e = r->idx[t * K + k];
        if (e < 0) {
          if (got != 0.0f) fail_msg("%s: dispatch grad_w[%lld][%d] of a -1 slot is %g", what, (long long)t, k, got);
          continue;
        }
        r64_from_payload(dt, (const char *)in->gd + (size_t)(e * r->C + r->loc[t * K + k]) * row_bytes, g, H);
        r64_from_payload(dt, (const char *)in->x + (size_t)t * row_bytes, a, H);
        double want = r64_dot(g, a, H);
        if (!(fabs(got - want) <= GW_ATOL + GW_RTOL * fabs(want)))
          fail_msg("%s: dispatch grad_w[%lld][%d] = %.9g, expected %.9g", what, (long long)t, k, got, want);
      }
    tu_free(a);
    tu_free(g);
  } else if (!is_poison(res.gw_dispatch, sizeof(float))) {
    fail_msg("%s: grad_w written without EPX_WEIGHTS_IN_DISPATCH", what);
  }

  /* Combine backward: the transpose of combine, grad_w = <grad_out, expert_out>. */
  res.grad_eo = poisoned((size_t)(N + GUARD_ROWS) * row_bytes);
  res.gw_combine = poisoned(sizeof(float) * (size_t)(T * K + 1));
  EXPECT_OK(epx_combine_backward(b, h, in->gout, in_combine ? in->ys : NULL, res.grad_eo, in_combine ? res.gw_combine : NULL));
  for (int64_t i = 0; i < N; i++) {
    const char *row = (const char *)res.grad_eo + (size_t)i * row_bytes;
    if (x->row_token[i] < 0) {
      if (!is_zero(row, row_bytes)) fail_msg("%s: padding row %lld of grad_expert_out is not zero", what, (long long)i);
    } else if (c->layout == EPX_LAYOUT_RANK_MAJOR) {
      assert_values_equal(dt, row, (const char *)in->gout + (size_t)x->row_token[i] * row_bytes, H, what, "grad_expert_out (rank-major)", i);
    } else {
      assert_values_equal(dt, row, (const char *)in->ref_geo + (size_t)x->row_dense[i] * row_bytes, H, what, "grad_expert_out vs dense", i);
    }
  }
  if (!is_poison((char *)res.grad_eo + (size_t)N * row_bytes, GUARD_ROWS * row_bytes))
    fail_msg("%s: combine_backward wrote past N rows", what);
  if (in_combine) {
    double *a = tu_alloc(sizeof(double) * (size_t)H), *g = tu_alloc(sizeof(double) * (size_t)H);
    for (int64_t t = 0; t < T; t++)
      for (int32_t k = 0; k < K; k++) {
        float got = res.gw_combine[t * K + k];
        int32_t e = r->idx[t * K + k];
        if (e < 0) {
          if (got != 0.0f) fail_msg("%s: combine grad_w[%lld][%d] of a -1 slot is %g", what, (long long)t, k, got);
          continue;
        }
        r64_from_payload(dt, (const char *)in->yd + (size_t)(e * r->C + r->loc[t * K + k]) * row_bytes, a, H);
        r64_from_payload(dt, (const char *)in->gout + (size_t)t * row_bytes, g, H);
        double want = r64_dot(g, a, H);
        if (!(fabs(got - want) <= GW_ATOL + GW_RTOL * fabs(want)))
          fail_msg("%s: combine grad_w[%lld][%d] = %.9g, expected %.9g", what, (long long)t, k, got, want);
      }
    tu_free(a);
    tu_free(g);
  } else if (!is_poison(res.gw_combine, sizeof(float))) {
    fail_msg("%s: grad_w written without EPX_WEIGHTS_IN_COMBINE", what);
  }

  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  tu_free(counts);
  tu_free(offsets);
  tu_free(src_rank);
  tu_free(src_token);
  tu_free(recv_expert);
  tu_free(recv_w);
  return res;
}

/* Checks one routing (its loc already set for the layout) in one case, with
 * both exchanges, which must agree bit for bit. */
static void check_case(tu_rng_t *rng, const routing_t *r, const case_t *c) {
  epx_dtype_t dt = c->dtype;
  int64_t T = r->T, H = c->H;
  int32_t E = r->E, K = r->K, C = r->C;
  size_t row_bytes = (size_t)H * epx_dtype_size(dt);
  char what[256];
  snprintf(what, sizeof what, "T=%lld E=%d K=%d C=%d %s %s %s%s", (long long)T, E, K, C, tu_dtype_name(dt),
           layout_name(c->layout, c->align), tu_weighting_name(c->weighting), c->pass_w ? "" : " (no topk_w)");
  expected_t x = expected_layout(r, c);
  int64_t N = x.N, D = (int64_t)E * C;
  int rank_major = c->layout == EPX_LAYOUT_RANK_MAJOR;

  inputs_t in;
  void *xs = payload(rng, dt, T, H), *yd = payload(rng, dt, D, H), *gd = payload(rng, dt, D, H);
  void *gout = payload(rng, dt, T, H), *ys = payload(rng, dt, N, H), *gs = payload(rng, dt, N, H);
  /* Rows with a dense position take it; rank-major rows are the expert's own
   * weighted sum over the row's experts (weights from recv_routing). */
  float *acc = tu_alloc(sizeof(float) * (size_t)H);
  for (int64_t i = 0; i < N; i++) {
    if (x.row_token[i] < 0) continue;
    if (!rank_major) {
      memcpy((char *)ys + (size_t)i * row_bytes, (char *)yd + (size_t)x.row_dense[i] * row_bytes, row_bytes);
      memcpy((char *)gs + (size_t)i * row_bytes, (char *)gd + (size_t)x.row_dense[i] * row_bytes, row_bytes);
      continue;
    }
    memset(acc, 0, sizeof(float) * (size_t)H);
    for (int32_t k = 0; k < K; k++) {
      int32_t d = x.row_dense[i * K + k];
      if (d < 0) continue;
      float wk = c->pass_w ? x.row_w[i * K + k] : 1.0f;
      for (int64_t h = 0; h < H; h++) acc[h] += wk * epx_load(dt, (char *)yd + (size_t)d * row_bytes, h);
    }
    for (int64_t h = 0; h < H; h++) epx_store(dt, (char *)ys + (size_t)i * row_bytes, h, acc[h]);
  }
  tu_free(acc);

  /* The dense oracle. Rank-major moves unweighted rows and its combine is the
   * weighted einsum the expert completed. */
  epx_weighting_t wt = c->weighting;
  const float *w = c->pass_w ? r->w : NULL;
  size_t dense_bytes = (size_t)(D ? D : 1) * row_bytes, token_bytes = (size_t)(T ? T : 1) * row_bytes;
  void *ref_recv = poisoned(dense_bytes), *ref_geo = poisoned(dense_bytes);
  void *ref_out = poisoned(token_bytes), *ref_gx = poisoned(token_bytes);
  EXPECT_OK(epx_reference_dense_dispatch(dt, T, H, E, C, K, r->idx, w, r->loc, wt, xs, ref_recv));
  EXPECT_OK(epx_reference_dense_combine(dt, T, H, E, C, K, r->idx, w, r->loc,
                                        rank_major && c->pass_w ? EPX_WEIGHTS_IN_COMBINE : wt, yd, ref_out));
  EXPECT_OK(epx_reference_dense_combine(dt, T, H, E, C, K, r->idx, w, r->loc,
                                        wt == EPX_WEIGHTS_IN_DISPATCH ? EPX_WEIGHTS_IN_COMBINE : EPX_WEIGHTS_NONE, gd, ref_gx));
  EXPECT_OK(epx_reference_dense_dispatch(dt, T, H, E, C, K, r->idx, w, r->loc,
                                         wt == EPX_WEIGHTS_IN_COMBINE ? EPX_WEIGHTS_IN_DISPATCH : EPX_WEIGHTS_NONE, gout, ref_geo));
  in = (inputs_t){xs, ys, gs, yd, gd, gout, ref_recv, ref_out, ref_gx, ref_geo};

  char label[300];
  snprintf(label, sizeof label, "%s dedup", what);
  results_t dedup = run_exchange(r, c, &x, &in, EPX_EXCHANGE_DEDUP, label);
  snprintf(label, sizeof label, "%s collective", what);
  results_t coll = run_exchange(r, c, &x, &in, EPX_EXCHANGE_COLLECTIVE, label);
  size_t gw_bytes = sizeof(float) * (size_t)(T * K);
  if (memcmp(dedup.recv_x, coll.recv_x, (size_t)N * row_bytes) || memcmp(dedup.out, coll.out, (size_t)T * row_bytes) ||
      memcmp(dedup.grad_x, coll.grad_x, (size_t)T * row_bytes) || memcmp(dedup.grad_eo, coll.grad_eo, (size_t)N * row_bytes) ||
      (wt == EPX_WEIGHTS_IN_DISPATCH && memcmp(dedup.gw_dispatch, coll.gw_dispatch, gw_bytes)) ||
      (wt == EPX_WEIGHTS_IN_COMBINE && memcmp(dedup.gw_combine, coll.gw_combine, gw_bytes)))
    fail_msg("%s: dedup and collective exchanges are not bit-identical", what);
  results_free(&dedup);
  results_free(&coll);
  void *bufs[] = {xs, yd, gd, gout, ys, gs, ref_recv, ref_geo, ref_out, ref_gx};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_free(bufs[i]);
  expected_free(&x);
}

static const struct {
  epx_layout_t layout;
  int32_t align;
} layouts[] = {{EPX_LAYOUT_EXPERT_MAJOR, 1}, {EPX_LAYOUT_EXPERT_MAJOR, 8}, {EPX_LAYOUT_RANK_MAJOR, 1}, {EPX_LAYOUT_CAPACITY, 1}};
static const epx_dtype_t dtypes[] = {EPX_FLOAT32, EPX_BFLOAT16, EPX_FLOAT16};
static const epx_weighting_t weightings[] = {EPX_WEIGHTS_IN_COMBINE, EPX_WEIGHTS_IN_DISPATCH, EPX_WEIGHTS_NONE};

/* Every layout, dtype and weighting the layout allows, for the experts and
 * weights of `base`; positions are set here per layout (capacity: C =
 * capacity, routes past it dropped). */
static void check_all(tu_rng_t *rng, const routing_t *base, int32_t capacity) {
  for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
    routing_t r = routing_alloc(base->T, base->E, base->K);
    memcpy(r.idx, base->idx, sizeof(int32_t) * (size_t)(base->T * base->K));
    memcpy(r.w, base->w, sizeof(float) * (size_t)(base->T * base->K));
    if (layouts[l].layout == EPX_LAYOUT_CAPACITY) routing_locate_capacity(rng, &r, capacity);
    else routing_locate_dropless(&r);
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++)
      for (size_t wi = 0; wi < sizeof weightings / sizeof weightings[0]; wi++) {
        if (layouts[l].layout == EPX_LAYOUT_RANK_MAJOR && weightings[wi] != EPX_WEIGHTS_NONE) continue;
        for (int pass_w = 1; pass_w >= (weightings[wi] == EPX_WEIGHTS_NONE ? 0 : 1); pass_w--) {
          case_t c = {dtypes[d], layouts[l].layout, layouts[l].align, weightings[wi], pass_w, 24};
          check_case(rng, &r, &c);
        }
      }
    routing_free(&r);
  }
}

static void test_sparse_equals_dense(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0001};
  const int32_t ks[] = {1, 2, 3, 8};
  for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
    int32_t E = 16, K = ks[i];
    int64_t T = 37;
    routing_t base = routing_random(&rng, T, E, K, 0.0);
    /* Capacity about 1.25 K T / E: some experts overflow. */
    check_all(&rng, &base, (int32_t)((5 * K * T) / (4 * E)) + 1);
    routing_free(&base);
    /* Skewed: a few experts take most routes, some none. */
    base = routing_random(&rng, T, E, K, 1.2);
    check_all(&rng, &base, (int32_t)((K * T) / E) + 1);
    routing_free(&base);
  }
}

/* ------------------------------------------------------------------------ */
/* Edge cases                                                                */
/* ------------------------------------------------------------------------ */

static void test_zero_tokens(void **state) {
  (void)state;
  const int32_t E = 8, K = 2, C = 3;
  const int64_t H = 16;
  for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
    epx_layout_t layout = layouts[l].layout;
    epx_buffer_t b = buffer_make(EPX_BFLOAT16, H, E, K, 0, EPX_EXCHANGE_DEDUP, layout, layouts[l].align, C);
    epx_routing_t routing = {0, K, NULL, NULL, NULL, layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE};
    epx_handle_t h = NULL;
    EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
    int64_t N = -1, max_tokens = -1;
    EXPECT_OK(epx_handle_recv_rows(h, &N));
    int64_t expected_n = layout == EPX_LAYOUT_CAPACITY ? (int64_t)E * C : 0;
    assert_int_equal(N, expected_n);
    EXPECT_OK(epx_buffer_max_tokens(b, &max_tokens));
    assert_int_equal(max_tokens, 8); /* 0 tokens rounded up to max_tokens_rounding */
    int64_t counts[8], offsets[9];
    tu_poison(counts, sizeof counts);
    tu_poison(offsets, sizeof offsets);
    EXPECT_OK(epx_handle_expert_counts(h, counts, offsets));
    for (int32_t e = 0; e < E; e++) assert_int_equal(counts[e], 0);
    for (int32_t e = 0; e <= E; e++) assert_int_equal(offsets[e], layout == EPX_LAYOUT_CAPACITY ? (int64_t)e * C : 0);
    size_t bytes = (size_t)(N ? N : 1) * (size_t)H * 2;
    void *recv = poisoned(bytes), *geo = poisoned(bytes);
    EXPECT_OK(epx_dispatch(b, h, NULL, N ? recv : NULL, N));
    if (N) assert_true(is_zero(recv, bytes));
    EXPECT_OK(epx_combine(b, h, N ? recv : NULL, NULL));
    EXPECT_OK(epx_dispatch_backward(b, h, N ? recv : NULL, NULL, NULL, NULL));
    EXPECT_OK(epx_combine_backward(b, h, NULL, NULL, N ? geo : NULL, NULL));
    if (N) assert_true(is_zero(geo, bytes));
    EXPECT_OK(epx_handle_release(h));
    EXPECT_OK(epx_buffer_destroy(b));
    tu_free(recv);
    tu_free(geo);
  }
  /* The references with no tokens: empty slots are zero rows. */
  void *out = poisoned((size_t)E * C * H * 4);
  EXPECT_OK(epx_reference_dense_dispatch(EPX_FLOAT32, 0, H, E, C, K, NULL, NULL, NULL, EPX_WEIGHTS_NONE, NULL, out));
  assert_true(is_zero(out, (size_t)E * C * H * 4));
  EXPECT_OK(epx_reference_dense_combine(EPX_FLOAT32, 0, H, E, C, K, NULL, NULL, NULL, EPX_WEIGHTS_IN_COMBINE, out, NULL));
  tu_free(out);
}

static void test_k_equals_e(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0002};
  routing_t base = routing_alloc(20, 8, 8);
  tu_random_routing(&rng, 20, 8, 8, 0.0, base.idx, base.w);
  check_all(&rng, &base, 20);
  /* Every expert holds every token: groups of T rows. */
  routing_locate_dropless(&base);
  case_t c = {EPX_FLOAT32, EPX_LAYOUT_EXPERT_MAJOR, 1, EPX_WEIGHTS_IN_COMBINE, 1, 16};
  expected_t x = expected_layout(&base, &c);
  assert_int_equal(x.N, 20 * 8);
  for (int32_t e = 0; e < 8; e++) assert_int_equal(x.counts[e], 20);
  expected_free(&x);
  routing_free(&base);
}

/* Experts 0, 3 and 7 (first, middle, last) are never chosen. */
static void test_unchosen_experts(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0003};
  const int32_t E = 8, K = 2, allowed[] = {1, 2, 4, 5, 6};
  const int64_t T = 19;
  routing_t base = routing_alloc(T, E, K);
  for (int64_t t = 0; t < T; t++) {
    int32_t a = tu_below(&rng, 5), b = (a + 1 + tu_below(&rng, 4)) % 5;
    base.idx[t * K] = allowed[a];
    base.idx[t * K + 1] = allowed[b];
    base.w[t * K] = 0.25f + (float)tu_uniform(&rng);
    base.w[t * K + 1] = 0.25f + (float)tu_uniform(&rng);
  }
  check_all(&rng, &base, 6);
  /* The library's counts and offsets for the padded expert-major layout. */
  epx_buffer_t b = buffer_make(EPX_FLOAT32, 16, E, K, T, EPX_EXCHANGE_DEDUP, EPX_LAYOUT_EXPERT_MAJOR, 4, 0);
  epx_routing_t routing = {T, K, base.idx, base.w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  int64_t counts[8], offsets[9];
  EXPECT_OK(epx_handle_expert_counts(h, counts, offsets));
  assert_int_equal(counts[0], 0);
  assert_int_equal(counts[3], 0);
  assert_int_equal(counts[7], 0);
  assert_int_equal(offsets[0], 0);
  assert_int_equal(offsets[1], 0);      /* expert 0's group is empty */
  assert_int_equal(offsets[4], offsets[3]);
  assert_int_equal(offsets[8], offsets[7]);
  for (int32_t e = 0; e < E; e++) assert_int_equal(offsets[e + 1] - offsets[e], (counts[e] + 3) / 4 * 4);
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  routing_free(&base);
}

static void test_one_expert_takes_all(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0004};
  const int32_t E = 8;
  const int64_t T = 23;
  /* K = 1: every token to expert 5. */
  routing_t one = routing_alloc(T, E, 1);
  for (int64_t t = 0; t < T; t++) {
    one.idx[t] = 5;
    one.w[t] = 0.5f + (float)tu_uniform(&rng);
  }
  check_all(&rng, &one, 10); /* capacity 10 < 23: the rest are dropped */
  routing_free(&one);
  /* K = 3: expert 5 in every row, at a random slot. */
  routing_t three = routing_alloc(T, E, 3);
  tu_random_routing(&rng, T, E, 3, 0.0, three.idx, three.w);
  for (int64_t t = 0; t < T; t++) {
    int has = 0;
    for (int32_t k = 0; k < 3; k++) has |= three.idx[t * 3 + k] == 5;
    if (!has) three.idx[t * 3 + tu_below(&rng, 3)] = 5;
  }
  check_all(&rng, &three, T);
  routing_free(&three);
}

static void test_all_dropped(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0005};
  routing_t r = routing_alloc(13, 8, 2);
  tu_random_routing(&rng, 13, 8, 2, 0.0, r.idx, r.w);
  for (int64_t i = 0; i < 26; i++) r.idx[i] = -1;
  check_all(&rng, &r, 4);
  routing_free(&r);
}

/* Dispatch twice on one handle (the cached path) gives the same rows; combine
 * and both backward passes twice give the same bits. */
static void test_repeatable(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0006};
  const int64_t T = 41, H = 32;
  const int32_t E = 16, K = 4;
  for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++)
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
      epx_dtype_t dt = dtypes[d];
      epx_layout_t layout = layouts[l].layout;
      routing_t r = routing_random(&rng, T, E, K, 0.5);
      if (layout == EPX_LAYOUT_CAPACITY) routing_locate_capacity(&rng, &r, 12);
      epx_weighting_t wt = layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE;
      epx_buffer_t b = buffer_make(dt, H, E, K, T, EPX_EXCHANGE_DEDUP, layout, layouts[l].align, 12);
      epx_routing_t routing = {T, K, r.idx, r.w, layout == EPX_LAYOUT_CAPACITY ? r.loc : NULL, wt};
      epx_handle_t h = NULL;
      EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
      int64_t N = 0;
      EXPECT_OK(epx_handle_recv_rows(h, &N));
      size_t row_bytes = (size_t)H * epx_dtype_size(dt), nb = (size_t)(N ? N : 1) * row_bytes, tb = (size_t)T * row_bytes;
      void *x = payload(&rng, dt, T, H), *y = payload(&rng, dt, N, H), *g = payload(&rng, dt, T, H);
      void *r1 = poisoned(nb), *r2 = poisoned(nb), *o1 = poisoned(tb), *o2 = poisoned(tb);
      void *gx1 = poisoned(tb), *gx2 = poisoned(tb), *ge1 = poisoned(nb), *ge2 = poisoned(nb);
      float *gw1 = poisoned(sizeof(float) * (size_t)(T * K)), *gw2 = poisoned(sizeof(float) * (size_t)(T * K));
      int wc = wt == EPX_WEIGHTS_IN_COMBINE;
      EXPECT_OK(epx_dispatch(b, h, x, r1, N));
      EXPECT_OK(epx_dispatch(b, h, x, r2, N));
      assert_memory_equal(r1, r2, (size_t)N * row_bytes);
      EXPECT_OK(epx_combine(b, h, y, o1));
      EXPECT_OK(epx_combine(b, h, y, o2));
      assert_memory_equal(o1, o2, tb);
      EXPECT_OK(epx_dispatch_backward(b, h, y, gx1, NULL, NULL));
      EXPECT_OK(epx_dispatch_backward(b, h, y, gx2, NULL, NULL));
      assert_memory_equal(gx1, gx2, tb);
      EXPECT_OK(epx_combine_backward(b, h, g, wc ? y : NULL, ge1, wc ? gw1 : NULL));
      EXPECT_OK(epx_combine_backward(b, h, g, wc ? y : NULL, ge2, wc ? gw2 : NULL));
      assert_memory_equal(ge1, ge2, (size_t)N * row_bytes);
      if (wc) assert_memory_equal(gw1, gw2, sizeof(float) * (size_t)(T * K));
      /* A cached dispatch of new inputs moves the new payload. */
      void *x2 = payload(&rng, dt, T, H), *r3 = poisoned(nb);
      EXPECT_OK(epx_dispatch(b, h, x2, r3, N));
      int32_t *tok = tu_alloc(sizeof(int32_t) * (size_t)(N ? N : 1));
      EXPECT_OK(epx_handle_recv_source(h, NULL, tok));
      for (int64_t i = 0; i < N; i++)
        if (tok[i] >= 0)
          assert_memory_equal((char *)r3 + (size_t)i * row_bytes, (char *)x2 + (size_t)tok[i] * row_bytes, row_bytes);
      EXPECT_OK(epx_handle_release(h));
      EXPECT_OK(epx_buffer_destroy(b));
      void *bufs[] = {x, y, g, r1, r2, o1, o2, gx1, gx2, ge1, ge2, gw1, gw2, x2, r3, tok};
      for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_free(bufs[i]);
      routing_free(&r);
    }
}

/* A bigger skewed top-8 case for each dtype: check_case runs both exchanges
 * and requires bit-identical outputs and gradients. */
static void test_dedup_equals_collective(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0007};
  for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++)
    for (size_t wi = 0; wi < 2; wi++) {
      routing_t r = routing_random(&rng, 97, 32, 8, 1.0);
      routing_locate_dropless(&r);
      case_t c = {dtypes[d], EPX_LAYOUT_EXPERT_MAJOR, 8, weightings[wi], 1, 64};
      check_case(&rng, &r, &c);
      routing_free(&r);
    }
}

/* Large enough (T * H >= 1M) that one rank splits its tokens over threads:
 * the same checks, on the parallel path. */
static void test_large_batch(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed000a};
  const int64_t T = 260, H = 4096;
  const int32_t E = 8, K = 2;
  routing_t r = routing_random(&rng, T, E, K, 0.7);
  routing_locate_dropless(&r);
  case_t em = {EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, 8, EPX_WEIGHTS_IN_COMBINE, 1, H};
  check_case(&rng, &r, &em);
  case_t rm = {EPX_FLOAT16, EPX_LAYOUT_RANK_MAJOR, 1, EPX_WEIGHTS_NONE, 1, H};
  check_case(&rng, &r, &rm);
  routing_locate_capacity(&rng, &r, 50);
  case_t cap = {EPX_FLOAT32, EPX_LAYOUT_CAPACITY, 1, EPX_WEIGHTS_IN_DISPATCH, 1, H};
  check_case(&rng, &r, &cap);
  routing_free(&r);
}

/* ------------------------------------------------------------------------ */
/* Capacity mode by hand                                                     */
/* ------------------------------------------------------------------------ */

/* 4 tokens, 4 experts, top-2, capacity ceil(2*4/4 * 1.0) = 2, softmax weights
 * without renormalisation. The logits give these choices (first, second) and
 * probabilities:
 *   token 0 [0.2, 0.0, -0.1, -0.2]  -> 0 (.310), 1 (.254)
 *   token 1 [2.9, 3.0, -2.0, -2.0]  -> 1 (.521), 0 (.472)
 *   token 2 [2.0, -1.0, 0.0, -2.0]  -> 0 (.831), 2 (.113)
 *   token 3 [0.3, 0.2, 0.0, -0.1]   -> 0 (.302), 1 (.273)
 * Expert 0 is chosen 4 times, expert 1 three times, expert 2 once, expert 3
 * never. Queues (route = token.slot):
 *   by choice: e0: 0.0 2.0 3.0 1.1   e1: 1.0 0.1 3.1   e2: 2.1
 *   by token:  e0: 0.0 1.1 2.0 3.0   e1: 0.1 1.0 3.1   e2: 2.1
 * By position the first two of each queue stay. By probability the two
 * heaviest stay (e0: 2.0 and 1.1; e1: 1.0 and 3.1) and take slots in queue
 * order among themselves. */
static void test_capacity_by_hand(void **state) {
  (void)state;
  static const float logits[16] = {0.2f, 0.0f, -0.1f, -0.2f, 2.9f, 3.0f, -2.0f, -2.0f,
                                   2.0f, -1.0f, 0.0f, -2.0f, 0.3f, 0.2f, 0.0f, -0.1f};
  static const struct {
    epx_drop_policy_t drop;
    epx_queue_order_t order;
    int32_t idx[8], loc[8];
    int32_t occupancy[4][2]; /* [expert][slot] = token, -1 empty */
  } cases[] = {
      {EPX_DROP_BY_POSITION, EPX_QUEUE_BY_CHOICE,
       {0, 1, 1, -1, 0, 2, -1, -1}, {0, 1, 0, -1, 1, 0, -1, -1},
       {{0, 2}, {1, 0}, {2, -1}, {-1, -1}}},
      {EPX_DROP_BY_POSITION, EPX_QUEUE_BY_TOKEN,
       {0, 1, 1, 0, -1, 2, -1, -1}, {0, 0, 1, 1, -1, 0, -1, -1},
       {{0, 1}, {0, 1}, {2, -1}, {-1, -1}}},
      {EPX_DROP_BY_PROBABILITY, EPX_QUEUE_BY_CHOICE,
       {-1, -1, 1, 0, 0, 2, -1, 1}, {-1, -1, 0, 1, 0, 0, -1, 1},
       {{2, 1}, {1, 3}, {2, -1}, {-1, -1}}},
      {EPX_DROP_BY_PROBABILITY, EPX_QUEUE_BY_TOKEN,
       {-1, -1, 1, 0, 0, 2, -1, 1}, {-1, -1, 0, 0, 1, 0, -1, 1},
       {{1, 2}, {1, 3}, {2, -1}, {-1, -1}}},
  };
  tu_rng_t rng = {0x5eed0008};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
    rc.num_experts = 4;
    rc.top_k = 2;
    rc.renormalize = 0;
    rc.capacity_mode = 1;
    rc.capacity_factor = 1.0f;
    rc.queue_order = cases[i].order;
    rc.drop_policy = cases[i].drop;
    int32_t idx[8], loc[8], counts[4];
    float w[8];
    epx_route_output_t out = {idx, w, loc, counts, NULL, NULL, 0, 0};
    EXPECT_OK(epx_route(&rc, 4, logits, NULL, &out));
    assert_int_equal(out.capacity, 2);
    assert_memory_equal(idx, cases[i].idx, sizeof idx);
    assert_memory_equal(loc, cases[i].loc, sizeof loc);
    const int32_t before_drop[4] = {4, 3, 1, 0};
    assert_memory_equal(counts, before_drop, sizeof counts);
    for (int32_t j = 0; j < 8; j++) assert_true(idx[j] < 0 ? w[j] == 0.0f : w[j] > 0.1f);

    /* The capacity layout [E, C, H] holds exactly the occupancy above. */
    epx_buffer_t b = buffer_make(EPX_FLOAT32, 8, 4, 2, 4, EPX_EXCHANGE_DEDUP, EPX_LAYOUT_CAPACITY, 1, out.capacity);
    epx_routing_t routing = {4, 2, idx, w, loc, EPX_WEIGHTS_IN_COMBINE};
    epx_handle_t h = NULL;
    EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
    int64_t N = 0;
    EXPECT_OK(epx_handle_recv_rows(h, &N));
    assert_int_equal(N, 8);
    int32_t src_token[8], src_rank[8], recv_expert[8];
    float recv_w[8];
    EXPECT_OK(epx_handle_recv_source(h, src_rank, src_token));
    EXPECT_OK(epx_handle_recv_routing(h, recv_expert, recv_w));
    assert_memory_equal(src_token, cases[i].occupancy, sizeof src_token);
    for (int32_t s = 0; s < 8; s++) {
      assert_int_equal(recv_expert[s], src_token[s] < 0 ? -1 : s / 2);
      assert_int_equal(src_rank[s], src_token[s] < 0 ? -1 : 0);
    }
    int64_t ecounts[4], offsets[5];
    EXPECT_OK(epx_handle_expert_counts(h, ecounts, offsets));
    for (int32_t e = 0; e < 4; e++) {
      int64_t filled = (cases[i].occupancy[e][0] >= 0) + (cases[i].occupancy[e][1] >= 0);
      assert_int_equal(ecounts[e], filled);
      assert_int_equal(offsets[e], 2 * e);
    }
    assert_int_equal(offsets[4], 8);
    float *x = payload(&rng, EPX_FLOAT32, 4, 8), *recv = poisoned(8 * 8 * sizeof(float));
    EXPECT_OK(epx_dispatch(b, h, x, recv, 8));
    for (int32_t s = 0; s < 8; s++) {
      int32_t t = cases[i].occupancy[s / 2][s % 2];
      if (t < 0) assert_true(is_zero(recv + s * 8, 8 * sizeof(float)));
      else assert_memory_equal(recv + s * 8, x + t * 8, 8 * sizeof(float));
    }
    EXPECT_OK(epx_handle_release(h));
    EXPECT_OK(epx_buffer_destroy(b));
    tu_free(x);
    tu_free(recv);
  }
}

/* ------------------------------------------------------------------------ */
/* Tensor-parallel slicing of the capacity layout                            */
/* ------------------------------------------------------------------------ */

/* The "expert": y = M_e x with a per-expert [H, H] matrix, on rows of
 * [experts, slots, H] whose first row belongs to expert first_expert. It
 * knows a row's expert only from the row's place in the tensor — as a real
 * TP rank does — so it needs whole rows in [expert, slot] order. */
static void run_expert(const float *m, int32_t first_expert, int32_t experts, int32_t slots, int64_t H, const float *in,
                       float *out) {
  for (int32_t e = 0; e < experts; e++)
    for (int32_t c = 0; c < slots; c++) {
      const float *x = in + ((size_t)e * slots + c) * H;
      float *y = out + ((size_t)e * slots + c) * H;
      const float *me = m + (size_t)(first_expert + e) * H * H;
      for (int64_t i = 0; i < H; i++) {
        float s = 0.0f;
        for (int64_t j = 0; j < H; j++) s += me[i * H + j] * x[j];
        y[i] = s;
      }
    }
}

/* Part p of `parts` along dim 1 of a [d0, d1, d2] tensor: [d0, d1/parts, d2]. */
static void slice_dim1(const float *src, int64_t d0, int64_t d1, int64_t d2, int32_t parts, int32_t p, float *dst) {
  int64_t n = d1 / parts;
  for (int64_t i = 0; i < d0; i++)
    memcpy(dst + (size_t)(i * n * d2), src + (size_t)((i * d1 + p * n) * d2), sizeof(float) * (size_t)(n * d2));
}

static void unslice_dim1(const float *part, int64_t d0, int64_t d1, int64_t d2, int32_t parts, int32_t p, float *dst) {
  int64_t n = d1 / parts;
  for (int64_t i = 0; i < d0; i++)
    memcpy(dst + (size_t)((i * d1 + p * n) * d2), part + (size_t)(i * n * d2), sizeof(float) * (size_t)(n * d2));
}

static void test_tensor_parallel_slicing(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed0009};
  const int32_t E = 4, C = 8, K = 2;
  const int64_t T = 16, H = 16, rows = (int64_t)E * C;
  routing_t r = routing_random(&rng, T, E, K, 0.0);
  routing_locate_capacity(&rng, &r, C);
  float *m = tu_alloc(sizeof(float) * (size_t)(E * H * H));
  tu_fill(&rng, EPX_FLOAT32, m, E * H * H);
  epx_buffer_t b = buffer_make(EPX_FLOAT32, H, E, K, T, EPX_EXCHANGE_DEDUP, EPX_LAYOUT_CAPACITY, 1, C);
  epx_routing_t routing = {T, K, r.idx, r.w, r.loc, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  size_t bytes = sizeof(float) * (size_t)(rows * H);
  float *x = payload(&rng, EPX_FLOAT32, T, H), *recv = poisoned(bytes), *full = poisoned(bytes);
  EXPECT_OK(epx_dispatch(b, h, x, recv, rows));
  run_expert(m, 0, E, C, H, recv, full);
  float *out_full = poisoned(sizeof(float) * (size_t)(T * H)), *out_tp = poisoned(sizeof(float) * (size_t)(T * H));
  EXPECT_OK(epx_combine(b, h, full, out_full));
  int32_t recv_expert[32];
  EXPECT_OK(epx_handle_recv_routing(h, recv_expert, NULL));

  const int32_t tps[] = {2, 4};
  for (size_t i = 0; i < 2; i++) {
    int32_t tp = tps[i], Cp = C / tp;
    float *part = tu_alloc(bytes / (size_t)tp), *part_out = tu_alloc(bytes / (size_t)tp);
    float *joined = poisoned(bytes);
    /* Right: [E, C, H] along C. Each part is [E, C/tp, H] with every expert
     * present, so the rank runs expert e on the rows of expert e. */
    for (int32_t p = 0; p < tp; p++) {
      slice_dim1(recv, E, C, H, tp, p, part);
      run_expert(m, 0, E, Cp, H, part, part_out);
      unslice_dim1(part_out, E, C, H, tp, p, joined);
    }
    assert_memory_equal(joined, full, bytes);
    EXPECT_OK(epx_combine(b, h, joined, out_tp));
    assert_memory_equal(out_tp, out_full, sizeof(float) * (size_t)(T * H));

    /* Wrong: the flat [E*C, H] buffer cut into tp row chunks. Chunk p holds
     * E/tp whole experts, so a rank that reads its part as [E, C/tp, H]
     * applies expert j / (C/tp) to row j — expert 1 to the second half of
     * expert 0's slots and so on: the chunk mixes experts the rank cannot
     * tell apart, and the result differs without any error. */
    int mixed = 0;
    for (int32_t p = 0; p < tp; p++) {
      memcpy(part, recv + (size_t)(p * (rows / tp) * H), bytes / (size_t)tp);
      run_expert(m, 0, E, Cp, H, part, part_out);
      memcpy(joined + (size_t)(p * (rows / tp) * H), part_out, bytes / (size_t)tp);
      for (int64_t j = 0; j < rows / tp; j++) {
        int32_t e = recv_expert[p * (rows / tp) + j];
        mixed |= e >= 0 && e != j / Cp; /* a filled row the rank runs through the wrong expert */
      }
    }
    assert_true(mixed);
    assert_true(memcmp(joined, full, bytes) != 0);
    EXPECT_OK(epx_combine(b, h, joined, out_tp));
    assert_true(memcmp(out_tp, out_full, sizeof(float) * (size_t)(T * H)) != 0);

    /* Wrong: "slice along dim 1" of the flat [E*C, H] view cuts H, not C.
     * Each part has the same element count as [E, C/tp, H], so nothing
     * complains, but its rows are halves (quarters) of tokens. */
    for (int32_t p = 0; p < tp; p++) {
      slice_dim1(recv, rows, H, 1, tp, p, part);
      run_expert(m, 0, E, Cp, H, part, part_out);
      unslice_dim1(part_out, rows, H, 1, tp, p, joined);
    }
    assert_true(memcmp(joined, full, bytes) != 0);
    tu_free(part);
    tu_free(part_out);
    tu_free(joined);
  }
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  void *bufs[] = {m, x, recv, full, out_full, out_tp};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_free(bufs[i]);
  routing_free(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sparse_equals_dense),
      cmocka_unit_test(test_zero_tokens),
      cmocka_unit_test(test_k_equals_e),
      cmocka_unit_test(test_unchosen_experts),
      cmocka_unit_test(test_one_expert_takes_all),
      cmocka_unit_test(test_all_dropped),
      cmocka_unit_test(test_repeatable),
      cmocka_unit_test(test_dedup_equals_collective),
      cmocka_unit_test(test_large_batch),
      cmocka_unit_test(test_capacity_by_hand),
      cmocka_unit_test(test_tensor_parallel_slicing),
  };
  return cmocka_run_group_tests(tests, tu_self_setup, tu_self_teardown);
}
