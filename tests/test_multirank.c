/* The exchange over W ranks: dedup and collective give bit-identical outputs
 * and gradients (down to the router's, through epx_route_backward); every
 * received row is where the layout says and came from where
 * epx_handle_recv_source says; counts, offsets and stats equal a plain
 * reference built from every rank's routing; results equal a float64
 * reference, the contract's float32 summation order bit for bit, and (capacity
 * layout) the dense one-hot einsums; max_tokens_per_rank is agreed once and
 * oversize batches, mismatched shapes, busy destroys and bad routing are
 * refused on every rank.
 *
 * Every rank regenerates every rank's routing and payload from a shared seed
 * (a "scene"), so each checks its own rows and outputs without a gather.
 * Payload rows are keyed: the row of (source rank, token, expert) is drawn
 * from a generator seeded by that key, so any rank can rebuild it exactly.
 *
 * The scene code (up to the cmocka part) is shared with mpi_exchange.c, which
 * includes this file with MR_SCENE_ONLY defined; it never calls cmocka. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "testutil.h"
#include "buffer_config.h"

#define MR_MAX_W 8
#define MR_MAX_T 64
#define MR_MAX_E 32

typedef enum { KEY_X = 1, KEY_EXPERT_OUT, KEY_GRAD_OUT, KEY_GRAD_RECV, KEY_PAD } mr_key_t;

/* What one run tests, and every rank's routing and input (the same on every
 * rank). */
typedef struct {
  int32_t W, E, K;
  int64_t H;
  epx_dtype_t dtype;
  epx_layout_t layout;
  int32_t alignment;
  int32_t capacity; /* C of the capacity layout, 0 otherwise */
  epx_weighting_t weighting;
  double skew; /* 0: uniform; > 0: expert i ranks like Zipf(skew) around a hot expert */
  uint64_t seed;
  epx_route_config_t route;
  int64_t T[MR_MAX_W];
  float *logits[MR_MAX_W]; /* [T, E] */
  int32_t *idx[MR_MAX_W];  /* [T, K], -1 where dropped */
  float *w[MR_MAX_W];      /* [T, K] */
  int32_t *loc[MR_MAX_W];  /* [T, K] capacity locations */
  void *x[MR_MAX_W];       /* [T, H] */
} mr_scene_t;

static void *mr_alloc(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64)) return NULL;
  memset(p, 0, bytes ? bytes : 64);
  return p;
}

static void mr_describe(const mr_scene_t *s, char *buf, size_t size) {
  int n = snprintf(buf, size, "W=%d E=%d K=%d H=%lld %s %s align=%d C=%d %s skew=%.1f T=[", s->W, s->E, s->K,
                   (long long)s->H, tu_dtype_name(s->dtype), tu_layout_name(s->layout), s->alignment, s->capacity,
                   tu_weighting_name(s->weighting), s->skew);
  for (int32_t r = 0; r < s->W && n > 0 && (size_t)n < size; r++)
    n += snprintf(buf + n, size - (size_t)n, "%s%lld", r ? " " : "", (long long)s->T[r]);
  if (n > 0 && (size_t)n < size) snprintf(buf + n, size - (size_t)n, "]");
}

/* The row of a key: H values in [-1, 1) in the scene's dtype. */
static void mr_keyed_row(const mr_scene_t *s, mr_key_t tag, int64_t a, int64_t b, int64_t c, void *dst) {
  tu_rng_t rng = {s->seed ^ ((uint64_t)tag << 56)};
  rng.state = tu_next(&rng) ^ (uint64_t)(a + 1) * 0x9e3779b97f4a7c15ull;
  rng.state = tu_next(&rng) ^ (uint64_t)(b + 1) * 0xc2b2ae3d27d4eb4full;
  rng.state = tu_next(&rng) ^ (uint64_t)(c + 1) * 0x165667b19e3779f9ull;
  tu_fill(&rng, s->dtype, dst, s->H);
}

static void mr_scene_free(mr_scene_t *s) {
  for (int32_t r = 0; r < MR_MAX_W; r++) {
    free(s->logits[r]);
    free(s->idx[r]);
    free(s->w[r]);
    free(s->loc[r]);
    free(s->x[r]);
    s->logits[r] = NULL, s->idx[r] = NULL, s->w[r] = NULL, s->loc[r] = NULL, s->x[r] = NULL;
  }
}

/* Fills the scene's routing and inputs from its fields (W, E, K, H, dtype,
 * layout, capacity, skew, seed, T). The routing comes from epx_route on
 * random logits (skewed by a per-expert offset); in dropless layouts some
 * tokens lose every route and some their first choice, so tokens with no and
 * with partial routes are covered. Returns 0 on success. */
static int mr_scene_build(mr_scene_t *s) {
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  rc.num_experts = s->E;
  rc.top_k = s->K;
  rc.renormalize = 1;
  if (s->layout == EPX_LAYOUT_CAPACITY) {
    /* Every rank gets C = min_capacity whatever its T. */
    rc.capacity_mode = 1;
    rc.capacity_factor = 0.001f;
    rc.min_capacity = s->capacity;
  }
  s->route = rc;
  int32_t hot = (int32_t)(s->seed % (uint64_t)s->E);
  for (int32_t r = 0; r < s->W; r++) {
    int64_t T = s->T[r];
    size_t TK = (size_t)(T * s->K);
    s->logits[r] = mr_alloc(sizeof(float) * (size_t)(T * s->E));
    s->idx[r] = mr_alloc(sizeof(int32_t) * TK);
    s->w[r] = mr_alloc(sizeof(float) * TK);
    s->loc[r] = mr_alloc(sizeof(int32_t) * TK);
    s->x[r] = mr_alloc((size_t)(T * s->H) * epx_dtype_size(s->dtype));
    if (!s->logits[r] || !s->idx[r] || !s->w[r] || !s->loc[r] || !s->x[r]) return 1;
    tu_rng_t rng = {s->seed * 31 + (uint64_t)r};
    for (int64_t t = 0; t < T; t++)
      for (int32_t e = 0; e < s->E; e++)
        s->logits[r][t * s->E + e] = tu_normal(&rng) - (float)(s->skew * log(1.0 + (e - hot + s->E) % s->E));
    epx_route_output_t out = {s->idx[r], s->w[r], s->loc[r], NULL, NULL, NULL, 0, 0};
    if (epx_route(&rc, T, s->logits[r], NULL, &out) != EPX_SUCCESS) {
      fprintf(stderr, "epx_route: %s\n", epx_last_error());
      return 1;
    }
    if (s->layout == EPX_LAYOUT_CAPACITY && out.capacity != s->capacity) {
      fprintf(stderr, "epx_route gave capacity %d, expected %d\n", out.capacity, s->capacity);
      return 1;
    }
    if (s->layout != EPX_LAYOUT_CAPACITY)
      for (int64_t t = 0; t < T; t++) {
        int all = t % 11 == 5, first = s->K > 1 && t % 5 == 2;
        for (int32_t k = 0; k < s->K; k++)
          if (all || (first && k == 0)) s->idx[r][t * s->K + k] = -1;
      }
    for (int64_t t = 0; t < T; t++) mr_keyed_row(s, KEY_X, r, t, 0, (char *)s->x[r] + (size_t)(t * s->H) * epx_dtype_size(s->dtype));
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* The layout a rank must receive, computed plainly from every routing        */
/* ------------------------------------------------------------------------ */

typedef struct {
  int64_t N;
  int32_t slots; /* K for rank-major, else 1 */
  int64_t counts[MR_MAX_E], offsets[MR_MAX_E + 1];
  int32_t *src, *tok;   /* [N] */
  int32_t *expert;      /* [N * slots] */
  float *weight;        /* [N * slots] */
  /* handle stats of each exchange: [0] dedup, [1] collective */
  int64_t send_rows[2], recv_rows[2], local_rows[2];
} mr_layout_t;

static void mr_layout_free(mr_layout_t *L) {
  free(L->src);
  free(L->tok);
  free(L->expert);
  free(L->weight);
}

/* Whether token t of rank s routes to an expert on rank q. */
static int mr_token_reaches(const mr_scene_t *s, int32_t src, int64_t t, int32_t q) {
  int32_t El = s->E / s->W;
  for (int32_t k = 0; k < s->K; k++) {
    int32_t e = s->idx[src][t * s->K + k];
    if (e >= 0 && e / El == q) return 1;
  }
  return 0;
}

static int mr_layout_build(const mr_scene_t *s, int32_t rank, mr_layout_t *L) {
  int32_t W = s->W, K = s->K, El = s->E / W, first = rank * El;
  int64_t C = s->capacity;
  memset(L, 0, sizeof *L);
  L->slots = s->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  for (int32_t src = 0; src < W; src++)
    for (int64_t t = 0; t < s->T[src]; t++)
      for (int32_t k = 0; k < K; k++) {
        int32_t e = s->idx[src][t * K + k];
        if (e >= first && e < first + El) L->counts[e - first]++;
      }
  int64_t pairs = 0;
  for (int32_t src = 0; src < W; src++)
    for (int64_t t = 0; t < s->T[src]; t++) pairs += mr_token_reaches(s, src, t, rank);
  if (s->layout == EPX_LAYOUT_EXPERT_MAJOR) {
    for (int32_t e = 0; e < El; e++)
      L->offsets[e + 1] = L->offsets[e] + (L->counts[e] + s->alignment - 1) / s->alignment * s->alignment;
    L->N = L->offsets[El];
  } else if (s->layout == EPX_LAYOUT_CAPACITY) {
    for (int32_t e = 0; e <= El; e++) L->offsets[e] = (int64_t)e * W * C;
    L->N = (int64_t)El * W * C;
  } else {
    L->N = L->offsets[El] = pairs;
  }
  size_t n = (size_t)L->N, ns = n * (size_t)L->slots;
  L->src = malloc(sizeof(int32_t) * (n ? n : 1));
  L->tok = malloc(sizeof(int32_t) * (n ? n : 1));
  L->expert = malloc(sizeof(int32_t) * (ns ? ns : 1));
  L->weight = calloc(ns ? ns : 1, sizeof(float));
  if (!L->src || !L->tok || !L->expert || !L->weight) return 1;
  for (size_t i = 0; i < n; i++) L->src[i] = L->tok[i] = -1;
  for (size_t i = 0; i < ns; i++) L->expert[i] = -1;
  if (s->layout == EPX_LAYOUT_RANK_MAJOR) {
    int64_t row = 0;
    for (int32_t src = 0; src < W; src++)
      for (int64_t t = 0; t < s->T[src]; t++) {
        if (!mr_token_reaches(s, src, t, rank)) continue;
        L->src[row] = src;
        L->tok[row] = (int32_t)t;
        for (int32_t k = 0; k < K; k++) {
          int32_t e = s->idx[src][t * K + k];
          if (e < first || e >= first + El) continue;
          L->expert[row * K + k] = e;
          L->weight[row * K + k] = s->w[src][t * K + k];
        }
        row++;
      }
  } else {
    for (int32_t e = 0; e < El; e++) {
      int64_t fill = 0;
      for (int32_t src = 0; src < W; src++)
        for (int64_t t = 0; t < s->T[src]; t++)
          for (int32_t k = 0; k < K; k++) {
            if (s->idx[src][t * K + k] != first + e) continue;
            int64_t row = s->layout == EPX_LAYOUT_EXPERT_MAJOR ? L->offsets[e] + fill++
                                                               : e * W * C + src * C + s->loc[src][t * K + k];
            L->src[row] = src;
            L->tok[row] = (int32_t)t;
            L->expert[row] = first + e;
            L->weight[row] = s->w[src][t * K + k];
          }
    }
  }
  /* Stats: rows crossing ranks (self excluded) and rows kept local. */
  for (int32_t src = 0; src < W; src++)
    for (int64_t t = 0; t < s->T[src]; t++)
      for (int32_t q = 0; q < W; q++) {
        int64_t routes = 0;
        for (int32_t k = 0; k < K; k++) {
          int32_t e = s->idx[src][t * K + k];
          routes += e >= 0 && e / El == q;
        }
        int64_t items[2] = {routes > 0, routes};
        for (int x = 0; x < 2; x++) {
          if (src == rank && q == rank) L->local_rows[x] += items[x];
          else if (src == rank) L->send_rows[x] += items[x];
          else if (q == rank) L->recv_rows[x] += items[x];
        }
      }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* One rank's run of one exchange                                           */
/* ------------------------------------------------------------------------ */

typedef struct {
  const mr_scene_t *s;
  int32_t rank;
  const char *what;
  int failures;
} mr_ctx_t;

__attribute__((format(printf, 2, 3))) static void mr_fail(mr_ctx_t *c, const char *format, ...) {
  if (c->failures++ >= 6) return;
  char scene[256], msg[512];
  mr_describe(c->s, scene, sizeof scene);
  va_list args;
  va_start(args, format);
  vsnprintf(msg, sizeof msg, format, args);
  va_end(args);
  fprintf(stderr, "FAIL [%s] rank %d %s: %s\n", scene, c->rank, c->what, msg);
}

#define MR_CALL(c, expr)                                                                   \
  do {                                                                                     \
    epx_status_t mr_status_ = (expr);                                                      \
    if (mr_status_ != EPX_SUCCESS) {                                                       \
      mr_fail((c), "%s returned %s: %s", #expr, epx_status_string(mr_status_), epx_last_error()); \
      goto done;                                                                           \
    }                                                                                      \
  } while (0)

/* What one exchange produced on this rank; compared bit for bit across
 * exchanges. */
typedef struct {
  int64_t N, bytes_rows, bytes_tokens, TK;
  void *recv_x, *out, *grad_expert_out, *grad_x;
  float *grad_w_combine, *grad_w_dispatch, *grad_logits;
} mr_result_t;

static void mr_result_free(mr_result_t *r) {
  free(r->recv_x);
  free(r->out);
  free(r->grad_expert_out);
  free(r->grad_x);
  free(r->grad_w_combine);
  free(r->grad_w_dispatch);
  free(r->grad_logits);
  memset(r, 0, sizeof *r);
}

/* The key column of received row i: the expert (rank-major: E + this rank). */
static int64_t mr_row_key(const mr_scene_t *s, int32_t rank, const mr_layout_t *L, int64_t i) {
  return s->layout == EPX_LAYOUT_RANK_MAJOR ? s->E + rank : L->expert[i];
}

/* Fills rows [N, H] keyed by each row's (source, token, key); padding rows get
 * garbage the library must ignore. */
static void mr_fill_rows(const mr_scene_t *s, int32_t rank, const mr_layout_t *L, mr_key_t tag, void *rows) {
  size_t rb = (size_t)s->H * epx_dtype_size(s->dtype);
  for (int64_t i = 0; i < L->N; i++) {
    void *dst = (char *)rows + (size_t)i * rb;
    if (L->src[i] < 0) mr_keyed_row(s, KEY_PAD, rank, i, tag, dst);
    else mr_keyed_row(s, tag, L->src[i], L->tok[i], mr_row_key(s, rank, L, i), dst);
  }
}

static int mr_all_zero(const void *p, size_t bytes) {
  for (size_t i = 0; i < bytes; i++)
    if (((const unsigned char *)p)[i]) return 0;
  return 1;
}

/* Checks each row of a layout tensor against its source row `key_tag` of
 * (source, token) scaled by the route weight when `weighted` (exactly as the
 * library rounds: round(w * v) in float32); padding rows must be zeros. */
static void mr_check_rows(mr_ctx_t *c, const mr_layout_t *L, mr_key_t key_tag, int weighted, const void *rows,
                          const char *name) {
  const mr_scene_t *s = c->s;
  size_t rb = (size_t)s->H * epx_dtype_size(s->dtype);
  void *want = malloc(rb), *src = malloc(rb);
  for (int64_t i = 0; i < L->N && want && src; i++) {
    const char *got = (const char *)rows + (size_t)i * rb;
    if (L->src[i] < 0) {
      if (!mr_all_zero(got, rb)) mr_fail(c, "%s row %lld is padding but not zero", name, (long long)i);
      continue;
    }
    mr_keyed_row(s, key_tag, L->src[i], L->tok[i], 0, src);
    if (weighted)
      for (int64_t h = 0; h < s->H; h++) epx_store(s->dtype, want, h, L->weight[i] * epx_load(s->dtype, src, h));
    else
      memcpy(want, src, rb);
    if (memcmp(want, got, rb))
      mr_fail(c, "%s row %lld (from rank %d token %d expert %d) differs from its source row", name, (long long)i,
              L->src[i], L->tok[i], L->expert[i * L->slots]);
  }
  free(want);
  free(src);
}

/* References for this rank's tokens: float64 sums (any order), and the
 * contract's float32 sums (epx.h, epx_combine: per rank in ascending order
 * P = 0 + the rank's products in k order, acc += P, rounded once), which the
 * library must match bit for bit. */
typedef struct {
  float *out, *grad_x;                     /* [T, H] float64 sums, as float */
  float *grad_w_combine, *grad_w_dispatch; /* [T, K] */
  void *out_exact, *grad_x_exact;          /* [T, H] in the dtype */
} mr_reference_t;

static void mr_reference_free(mr_reference_t *r) {
  free(r->out);
  free(r->grad_x);
  free(r->grad_w_combine);
  free(r->grad_w_dispatch);
  free(r->out_exact);
  free(r->grad_x_exact);
}

static int mr_reference_build(const mr_scene_t *s, int32_t rank, mr_reference_t *ref) {
  int64_t T = s->T[rank], H = s->H;
  int32_t K = s->K, El = s->E / s->W;
  size_t rb = (size_t)H * epx_dtype_size(s->dtype);
  ref->out = calloc((size_t)(T * H) + 1, sizeof(float));
  ref->grad_x = calloc((size_t)(T * H) + 1, sizeof(float));
  ref->grad_w_combine = calloc((size_t)(T * K) + 1, sizeof(float));
  ref->grad_w_dispatch = calloc((size_t)(T * K) + 1, sizeof(float));
  ref->out_exact = mr_alloc((size_t)T * rb);
  ref->grad_x_exact = mr_alloc((size_t)T * rb);
  double *out = calloc((size_t)H, sizeof(double)), *gx = calloc((size_t)H, sizeof(double));
  float *acc_o = calloc((size_t)H, sizeof(float)), *acc_g = calloc((size_t)H, sizeof(float));
  float *p_o = calloc((size_t)H, sizeof(float)), *p_g = calloc((size_t)H, sizeof(float));
  void *eo = malloc(rb), *gr = malloc(rb), *go = malloc(rb);
  int ok = ref->out && ref->grad_x && ref->grad_w_combine && ref->grad_w_dispatch && ref->out_exact &&
           ref->grad_x_exact && out && gx && acc_o && acc_g && p_o && p_g && eo && gr && go;
  for (int64_t t = 0; ok && t < T; t++) {
    memset(out, 0, sizeof(double) * (size_t)H);
    memset(gx, 0, sizeof(double) * (size_t)H);
    memset(acc_o, 0, sizeof(float) * (size_t)H);
    memset(acc_g, 0, sizeof(float) * (size_t)H);
    const void *x = (const char *)s->x[rank] + (size_t)t * rb;
    mr_keyed_row(s, KEY_GRAD_OUT, rank, t, 0, go);
    for (int32_t q = 0; q < s->W; q++) {
      if (!mr_token_reaches(s, rank, t, q)) continue;
      memset(p_o, 0, sizeof(float) * (size_t)H);
      memset(p_g, 0, sizeof(float) * (size_t)H);
      if (s->layout == EPX_LAYOUT_RANK_MAJOR) {
        /* One row per rank, which the expert already reduced. */
        mr_keyed_row(s, KEY_EXPERT_OUT, rank, t, s->E + q, eo);
        mr_keyed_row(s, KEY_GRAD_RECV, rank, t, s->E + q, gr);
        for (int64_t h = 0; h < H; h++) {
          float vo = epx_load(s->dtype, eo, h), vr = epx_load(s->dtype, gr, h);
          out[h] += vo;
          gx[h] += vr;
          p_o[h] += vo;
          p_g[h] += vr;
        }
      }
      for (int32_t k = 0; k < K && s->layout != EPX_LAYOUT_RANK_MAJOR; k++) {
        int32_t e = s->idx[rank][t * K + k];
        if (e < 0 || e / El != q) continue;
        float w = s->w[rank][t * K + k];
        float wc = s->weighting == EPX_WEIGHTS_IN_COMBINE ? w : 1.0f;
        float wd = s->weighting == EPX_WEIGHTS_IN_DISPATCH ? w : 1.0f;
        mr_keyed_row(s, KEY_EXPERT_OUT, rank, t, e, eo);
        mr_keyed_row(s, KEY_GRAD_RECV, rank, t, e, gr);
        double dot_c = 0, dot_d = 0;
        for (int64_t h = 0; h < H; h++) {
          float vo = epx_load(s->dtype, eo, h), vr = epx_load(s->dtype, gr, h);
          out[h] += (double)wc * vo;
          gx[h] += (double)wd * vr;
          p_o[h] += wc * vo;
          p_g[h] += wd * vr;
          dot_c += (double)epx_load(s->dtype, go, h) * vo;
          dot_d += (double)vr * epx_load(s->dtype, x, h);
        }
        ref->grad_w_combine[t * K + k] = (float)dot_c;
        ref->grad_w_dispatch[t * K + k] = (float)dot_d;
      }
      for (int64_t h = 0; h < H; h++) {
        acc_o[h] += p_o[h];
        acc_g[h] += p_g[h];
      }
    }
    for (int64_t h = 0; h < H; h++) {
      ref->out[t * H + h] = (float)out[h];
      ref->grad_x[t * H + h] = (float)gx[h];
      epx_store(s->dtype, (char *)ref->out_exact + (size_t)t * rb, h, acc_o[h]);
      epx_store(s->dtype, (char *)ref->grad_x_exact + (size_t)t * rb, h, acc_g[h]);
    }
  }
  free(out);
  free(gx);
  free(acc_o);
  free(acc_g);
  free(p_o);
  free(p_g);
  free(eo);
  free(gr);
  free(go);
  return ok ? 0 : 1;
}

static void mr_check_close(mr_ctx_t *c, const char *name, epx_dtype_t dtype, const void *got, const float *want,
                           int64_t n, double atol, double rtol) {
  double err = tu_max_error(dtype, got, EPX_FLOAT32, want, n, atol, rtol);
  if (err > 1.0) mr_fail(c, "%s differs from the float64 reference (normalised error %.3g, atol %g rtol %g)", name, err, atol, rtol);
}

/* The capacity layout against the dense one-hot einsums of epx.h: rank q's
 * slot (e, s, l) is the dense dispatch of source s's tokens at [e, l] (bit
 * for bit: one nonzero product per slot), and this rank's combine out is the
 * dense combine of its own routes' expert outputs laid out [E, C, H]. */
static void mr_check_dense(mr_ctx_t *c, const void *recv_x, const void *out) {
  const mr_scene_t *s = c->s;
  int32_t W = s->W, E = s->E, C = s->capacity, K = s->K, El = E / W, rank = c->rank;
  size_t rb = (size_t)s->H * epx_dtype_size(s->dtype), slots = (size_t)E * (size_t)C;
  void *dense = mr_alloc(slots * rb), *eo = mr_alloc(slots * rb), *want = mr_alloc((size_t)s->T[rank] * rb);
  for (int32_t src = 0; src < W && dense; src++) {
    if (epx_reference_dense_dispatch(s->dtype, s->T[src], s->H, E, C, K, s->idx[src], s->w[src], s->loc[src],
                                     s->weighting, s->x[src], dense) != EPX_SUCCESS) {
      mr_fail(c, "epx_reference_dense_dispatch: %s", epx_last_error());
      break;
    }
    for (int32_t e = 0; e < El; e++)
      for (int32_t l = 0; l < C; l++)
        if (memcmp((const char *)recv_x + (size_t)((int64_t)e * W * C + (int64_t)src * C + l) * rb,
                   (const char *)dense + ((size_t)(rank * El + e) * (size_t)C + (size_t)l) * rb, rb))
          mr_fail(c, "recv_x slot (expert %d, source %d, location %d) differs from the dense dispatch", rank * El + e, src, l);
  }
  for (int64_t t = 0; t < s->T[rank] && eo; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = s->idx[rank][t * K + k];
      if (e >= 0) mr_keyed_row(s, KEY_EXPERT_OUT, rank, t, e, (char *)eo + ((size_t)e * (size_t)C + (size_t)s->loc[rank][t * K + k]) * rb);
    }
  if (!dense || !eo || !want) mr_fail(c, "out of memory");
  else if (epx_reference_dense_combine(s->dtype, s->T[rank], s->H, E, C, K, s->idx[rank], s->w[rank], s->loc[rank],
                                       s->weighting, eo, want) != EPX_SUCCESS)
    mr_fail(c, "epx_reference_dense_combine: %s", epx_last_error());
  else if (tu_max_error(s->dtype, out, s->dtype, want, s->T[rank] * s->H, tu_atol(s->dtype), tu_rtol(s->dtype)) > 1.0)
    mr_fail(c, "combine out differs from the dense combine");
  free(dense);
  free(eo);
  free(want);
}

static int64_t mr_round_up(int64_t v, int64_t to) {
  int64_t r = (v + to - 1) / to * to;
  return r ? r : to;
}

/* Weight gradients are float32 dot products over H: |error| grows with H. */
#define MR_DOT_ATOL 1e-4
#define MR_DOT_RTOL 1e-4

/* Runs layout, dispatch (twice: the second is a cached dispatch), combine,
 * combine_backward, dispatch_backward (with and without grad_w) and
 * epx_route_backward with one exchange, checking each against the reference,
 * and keeps the results for the cross-exchange comparison. */
static int mr_run_exchange(epx_comm_t comm, int32_t rank, const mr_scene_t *s, epx_exchange_t exchange,
                           const mr_layout_t *L, const mr_reference_t *ref, mr_result_t *res) {
  mr_ctx_t ctx = {s, rank, exchange == EPX_EXCHANGE_DEDUP ? "dedup" : "collective", 0}, *c = &ctx;
  int x = exchange == EPX_EXCHANGE_DEDUP ? 0 : 1;
  int32_t K = s->K, El = s->E / s->W;
  int64_t T = s->T[rank], H = s->H;
  size_t rb = (size_t)H * epx_dtype_size(s->dtype);
  epx_buffer_t buffer = NULL;
  epx_handle_t handle = NULL;
  int32_t *got_src = NULL, *got_tok = NULL, *got_expert = NULL;
  float *got_w = NULL;
  void *expert_out = NULL, *grad_out = NULL, *grad_recv = NULL, *again = NULL, *grad_x_plain = NULL;
  memset(res, 0, sizeof *res);

  epx_buffer_config_t bc = tu_config(EPX_DEVICE_CPU, s->dtype, H, s->E, K, 0);
  bc.max_tokens_rounding = 8;
  bc.exchange = exchange;
  bc.layout = s->layout;
  bc.expert_alignment = s->alignment;
  bc.capacity = s->capacity;
  MR_CALL(c, epx_buffer_create(comm, &bc, &buffer));
  epx_routing_t routing = {T, K, s->idx[rank], s->w[rank], s->layout == EPX_LAYOUT_CAPACITY ? s->loc[rank] : NULL,
                           s->weighting};
  MR_CALL(c, epx_dispatch_layout(buffer, &routing, NULL, &handle));

  /* max_tokens_per_rank: agreed at this first layout, the same on every rank. */
  int64_t max_T = 0, agreed = -1, bound = -1;
  for (int32_t r = 0; r < s->W; r++) max_T = s->T[r] > max_T ? s->T[r] : max_T;
  MR_CALL(c, epx_buffer_max_tokens(buffer, &agreed));
  if (agreed != mr_round_up(max_T, 8))
    mr_fail(c, "epx_buffer_max_tokens is %lld, expected max T %lld rounded up to 8", (long long)agreed, (long long)max_T);

  /* The layout: row count, counts, offsets, sources, routing, stats. */
  MR_CALL(c, epx_handle_recv_rows(handle, &res->N));
  if (res->N != L->N) {
    mr_fail(c, "recv rows %lld, expected %lld", (long long)res->N, (long long)L->N);
    goto done;
  }
  MR_CALL(c, epx_buffer_max_recv_rows(buffer, &bound));
  if (res->N > bound) mr_fail(c, "recv rows %lld above epx_buffer_max_recv_rows %lld", (long long)res->N, (long long)bound);
  int64_t counts[MR_MAX_E], offsets[MR_MAX_E + 1];
  MR_CALL(c, epx_handle_expert_counts(handle, counts, offsets));
  for (int32_t e = 0; e < El; e++)
    if (counts[e] != L->counts[e]) mr_fail(c, "expert_counts[%d] = %lld, expected %lld", e, (long long)counts[e], (long long)L->counts[e]);
  for (int32_t e = 0; e <= El; e++) {
    int64_t want = s->layout == EPX_LAYOUT_RANK_MAJOR ? (e == El ? L->N : 0) : L->offsets[e];
    if (offsets[e] != want) mr_fail(c, "expert offsets[%d] = %lld, expected %lld", e, (long long)offsets[e], (long long)want);
  }
  size_t n = (size_t)L->N, ns = n * (size_t)L->slots;
  got_src = malloc(sizeof(int32_t) * (n + 1));
  got_tok = malloc(sizeof(int32_t) * (n + 1));
  got_expert = malloc(sizeof(int32_t) * (ns + 1));
  got_w = malloc(sizeof(float) * (ns + 1));
  if (!got_src || !got_tok || !got_expert || !got_w) {
    mr_fail(c, "out of memory");
    goto done;
  }
  tu_poison(got_src, sizeof(int32_t) * n);
  tu_poison(got_tok, sizeof(int32_t) * n);
  tu_poison(got_expert, sizeof(int32_t) * ns);
  tu_poison(got_w, sizeof(float) * ns);
  MR_CALL(c, epx_handle_recv_source(handle, got_src, got_tok));
  MR_CALL(c, epx_handle_recv_routing(handle, got_expert, got_w));
  if (memcmp(got_src, L->src, sizeof(int32_t) * n) || memcmp(got_tok, L->tok, sizeof(int32_t) * n))
    mr_fail(c, "epx_handle_recv_source differs from the reference layout");
  if (memcmp(got_expert, L->expert, sizeof(int32_t) * ns) || memcmp(got_w, L->weight, sizeof(float) * ns))
    mr_fail(c, "epx_handle_recv_routing differs from the reference layout");
  epx_handle_stats_t st;
  MR_CALL(c, epx_handle_stats(handle, &st));
  if (st.send_rows != L->send_rows[x] || st.recv_rows != L->recv_rows[x] || st.local_rows != L->local_rows[x] ||
      st.send_bytes != st.send_rows * (int64_t)rb || st.recv_bytes != st.recv_rows * (int64_t)rb)
    mr_fail(c, "stats send/recv/local rows %lld/%lld/%lld, expected %lld/%lld/%lld", (long long)st.send_rows,
            (long long)st.recv_rows, (long long)st.local_rows, (long long)L->send_rows[x], (long long)L->recv_rows[x],
            (long long)L->local_rows[x]);

  /* Dispatch: every received row is its source's x row (weighted as asked);
   * a second, cached dispatch gives the same bytes. */
  res->bytes_rows = (int64_t)(n * rb);
  res->bytes_tokens = (int64_t)((size_t)T * rb);
  res->TK = T * K;
  res->recv_x = mr_alloc(n * rb);
  again = mr_alloc(n * rb);
  expert_out = mr_alloc(n * rb);
  grad_recv = mr_alloc(n * rb);
  res->grad_expert_out = mr_alloc(n * rb);
  res->out = mr_alloc((size_t)T * rb);
  res->grad_x = mr_alloc((size_t)T * rb);
  grad_x_plain = mr_alloc((size_t)T * rb);
  grad_out = mr_alloc((size_t)T * rb);
  res->grad_w_combine = mr_alloc(sizeof(float) * (size_t)(T * K));
  res->grad_w_dispatch = mr_alloc(sizeof(float) * (size_t)(T * K));
  res->grad_logits = mr_alloc(sizeof(float) * (size_t)(T * s->E));
  if (!res->recv_x || !again || !expert_out || !grad_recv || !res->grad_expert_out || !res->out || !res->grad_x ||
      !grad_x_plain || !grad_out || !res->grad_w_combine || !res->grad_w_dispatch || !res->grad_logits) {
    mr_fail(c, "out of memory");
    goto done;
  }
  tu_poison(res->recv_x, n * rb);
  tu_poison(again, n * rb);
  MR_CALL(c, epx_dispatch(buffer, handle, s->x[rank], res->recv_x, res->N));
  mr_check_rows(c, L, KEY_X, s->weighting == EPX_WEIGHTS_IN_DISPATCH, res->recv_x, "recv_x");
  MR_CALL(c, epx_dispatch(buffer, handle, s->x[rank], again, res->N));
  if (memcmp(again, res->recv_x, n * rb)) mr_fail(c, "a cached dispatch differs from the first");

  /* Combine of keyed expert outputs; padding rows hold garbage. */
  mr_fill_rows(s, rank, L, KEY_EXPERT_OUT, expert_out);
  tu_poison(res->out, (size_t)T * rb);
  MR_CALL(c, epx_combine(buffer, handle, expert_out, res->out));
  mr_check_close(c, "combine out", s->dtype, res->out, ref->out, T * H, tu_atol(s->dtype), tu_rtol(s->dtype));
  if (memcmp(res->out, ref->out_exact, (size_t)T * rb)) mr_fail(c, "combine out is not the contract's float32 sum (ranks ascending, k order) bit for bit");
  if (s->layout == EPX_LAYOUT_CAPACITY) mr_check_dense(c, res->recv_x, res->out);

  /* Combine backward: grad_expert_out rows are grad_out rows (times w in
   * combine), and grad_w the dot with expert_out. */
  for (int64_t t = 0; t < T; t++) mr_keyed_row(s, KEY_GRAD_OUT, rank, t, 0, (char *)grad_out + (size_t)t * rb);
  tu_poison(res->grad_expert_out, n * rb);
  tu_poison(res->grad_w_combine, sizeof(float) * (size_t)(T * K));
  int in_combine = s->weighting == EPX_WEIGHTS_IN_COMBINE;
  MR_CALL(c, epx_combine_backward(buffer, handle, grad_out, in_combine ? expert_out : NULL, res->grad_expert_out,
                                  in_combine ? res->grad_w_combine : NULL));
  mr_check_rows(c, L, KEY_GRAD_OUT, in_combine, res->grad_expert_out, "grad_expert_out");
  if (in_combine) mr_check_close(c, "combine_backward grad_w", EPX_FLOAT32, res->grad_w_combine, ref->grad_w_combine, T * K, MR_DOT_ATOL, MR_DOT_RTOL);

  /* Dispatch backward: grad_x sums the copies (times w in dispatch); grad_w
   * the dot with x. Without grad_w, grad_x is the same bytes. */
  mr_fill_rows(s, rank, L, KEY_GRAD_RECV, grad_recv);
  tu_poison(res->grad_x, (size_t)T * rb);
  tu_poison(grad_x_plain, (size_t)T * rb);
  tu_poison(res->grad_w_dispatch, sizeof(float) * (size_t)(T * K));
  int in_dispatch = s->weighting == EPX_WEIGHTS_IN_DISPATCH;
  MR_CALL(c, epx_dispatch_backward(buffer, handle, grad_recv, res->grad_x, in_dispatch ? s->x[rank] : NULL,
                                   in_dispatch ? res->grad_w_dispatch : NULL));
  mr_check_close(c, "dispatch_backward grad_x", s->dtype, res->grad_x, ref->grad_x, T * H, tu_atol(s->dtype), tu_rtol(s->dtype));
  if (memcmp(res->grad_x, ref->grad_x_exact, (size_t)T * rb)) mr_fail(c, "dispatch_backward grad_x is not the contract's float32 sum bit for bit");
  if (in_dispatch) {
    mr_check_close(c, "dispatch_backward grad_w", EPX_FLOAT32, res->grad_w_dispatch, ref->grad_w_dispatch, T * K, MR_DOT_ATOL, MR_DOT_RTOL);
    MR_CALL(c, epx_dispatch_backward(buffer, handle, grad_recv, grad_x_plain, NULL, NULL));
    if (memcmp(grad_x_plain, res->grad_x, (size_t)T * rb)) mr_fail(c, "dispatch_backward grad_x differs with and without grad_w");
  }

  /* The router's gradient from the weight gradient: equal to the one from the
   * reference weight gradient, and not all zero (the router must learn). */
  if (s->weighting != EPX_WEIGHTS_NONE) {
    const float *gw = in_combine ? res->grad_w_combine : res->grad_w_dispatch;
    const float *gw_ref = in_combine ? ref->grad_w_combine : ref->grad_w_dispatch;
    float *want = mr_alloc(sizeof(float) * (size_t)(T * s->E));
    tu_poison(res->grad_logits, sizeof(float) * (size_t)(T * s->E));
    epx_status_t a = epx_route_backward(&s->route, T, s->logits[rank], NULL, s->idx[rank], gw, 0.0f, 0.0f, res->grad_logits);
    epx_status_t b = a == EPX_SUCCESS ? epx_route_backward(&s->route, T, s->logits[rank], NULL, s->idx[rank], gw_ref, 0.0f, 0.0f, want) : a;
    if (a != EPX_SUCCESS || b != EPX_SUCCESS) {
      mr_fail(c, "epx_route_backward: %s", epx_last_error());
    } else {
      mr_check_close(c, "grad_logits", EPX_FLOAT32, res->grad_logits, want, T * s->E, 1e-4, 1e-3);
      int routed = 0, nonzero = 0;
      for (int64_t i = 0; i < T * K; i++) routed += s->idx[rank][i] >= 0;
      for (int64_t i = 0; i < T * s->E; i++) nonzero += res->grad_logits[i] != 0.0f;
      if (K > 1 && routed && !nonzero) mr_fail(c, "grad_logits is all zero: the router gets no gradient");
    }
    free(want);
  }

done:
  free(got_src);
  free(got_tok);
  free(got_expert);
  free(got_w);
  free(expert_out);
  free(grad_out);
  free(grad_recv);
  free(again);
  free(grad_x_plain);
  if (handle && epx_handle_release(handle) != EPX_SUCCESS) mr_fail(c, "epx_handle_release: %s", epx_last_error());
  if (buffer && epx_buffer_destroy(buffer) != EPX_SUCCESS) mr_fail(c, "epx_buffer_destroy: %s", epx_last_error());
  return ctx.failures;
}

/* A rank's whole check of a scene: both exchanges against the references,
 * then against each other bit for bit. Returns the number of failures. */
static int mr_check_scene_rank(epx_comm_t comm, int32_t rank, const mr_scene_t *s) {
  mr_ctx_t ctx = {s, rank, "dedup vs collective", 0};
  mr_layout_t L;
  mr_reference_t ref = {0};
  mr_result_t res[2] = {{0}, {0}};
  if (mr_layout_build(s, rank, &L) || mr_reference_build(s, rank, &ref)) {
    mr_fail(&ctx, "out of memory building the reference");
    mr_layout_free(&L);
    mr_reference_free(&ref);
    return ctx.failures;
  }
  ctx.failures += mr_run_exchange(comm, rank, s, EPX_EXCHANGE_DEDUP, &L, &ref, &res[0]);
  ctx.failures += mr_run_exchange(comm, rank, s, EPX_EXCHANGE_COLLECTIVE, &L, &ref, &res[1]);
  if (!ctx.failures) {
    const mr_result_t *a = &res[0], *b = &res[1];
    struct { const char *name; const void *x, *y; int64_t bytes; } same[] = {
        {"recv_x", a->recv_x, b->recv_x, a->bytes_rows},
        {"combine out", a->out, b->out, a->bytes_tokens},
        {"grad_expert_out", a->grad_expert_out, b->grad_expert_out, a->bytes_rows},
        {"grad_x", a->grad_x, b->grad_x, a->bytes_tokens},
        {"combine_backward grad_w", a->grad_w_combine, b->grad_w_combine, s->weighting == EPX_WEIGHTS_IN_COMBINE ? a->TK * 4 : 0},
        {"dispatch_backward grad_w", a->grad_w_dispatch, b->grad_w_dispatch, s->weighting == EPX_WEIGHTS_IN_DISPATCH ? a->TK * 4 : 0},
        {"grad_logits", a->grad_logits, b->grad_logits, s->weighting != EPX_WEIGHTS_NONE ? s->T[rank] * s->E * 4 : 0},
    };
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
      if (same[i].bytes && memcmp(same[i].x, same[i].y, (size_t)same[i].bytes))
        mr_fail(&ctx, "%s is not bit-identical between the two exchanges", same[i].name);
  }
  mr_result_free(&res[0]);
  mr_result_free(&res[1]);
  mr_layout_free(&L);
  mr_reference_free(&ref);
  return ctx.failures;
}

/* The combinations every transport is checked over, for one world size. */
typedef struct {
  int32_t K;
  epx_layout_t layout;
  int32_t alignment;
  epx_dtype_t dtype;
  double skew;
  epx_weighting_t weighting;
} mr_case_t;

/* Fills cases (at most 256) and returns how many. */
static int mr_cases(mr_case_t *cases) {
  static const int32_t ks[] = {1, 2, 8};
  static const struct { epx_layout_t layout; int32_t alignment; } layouts[] = {
      {EPX_LAYOUT_EXPERT_MAJOR, 1}, {EPX_LAYOUT_EXPERT_MAJOR, 4}, {EPX_LAYOUT_RANK_MAJOR, 1}, {EPX_LAYOUT_CAPACITY, 1}};
  static const epx_dtype_t dtypes[] = {EPX_FLOAT32, EPX_BFLOAT16, EPX_FLOAT16};
  static const double skews[] = {0.0, 2.5};
  int n = 0;
  for (size_t k = 0; k < 3; k++)
    for (size_t l = 0; l < 4; l++)
      for (size_t d = 0; d < 3; d++)
        for (size_t z = 0; z < 2; z++)
          for (int w = 0; w < 2; w++) {
            epx_weighting_t weighting = layouts[l].layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE
                                        : w ? EPX_WEIGHTS_IN_DISPATCH : EPX_WEIGHTS_IN_COMBINE;
            if (layouts[l].layout == EPX_LAYOUT_RANK_MAJOR && w) continue;
            cases[n++] = (mr_case_t){ks[k], layouts[l].layout, layouts[l].alignment, dtypes[d], skews[z], weighting};
          }
  return n;
}

/* A scene for case i of a world of W ranks: H in {16, 32, 64}, T in [1, 64]
 * per rank with one rank (in turn, or none) at 0 tokens. */
static void mr_scene_init(mr_scene_t *s, const mr_case_t *cs, int i, int32_t W, int32_t E, uint64_t seed) {
  memset(s, 0, sizeof *s);
  s->W = W;
  s->E = E;
  s->K = cs->K;
  s->H = (int64_t)16 << (i % 3);
  s->dtype = cs->dtype;
  s->layout = cs->layout;
  s->alignment = cs->alignment;
  s->weighting = cs->weighting;
  s->skew = cs->skew;
  s->seed = seed * 1000003u + (uint64_t)i;
  s->capacity = cs->layout == EPX_LAYOUT_CAPACITY ? (int32_t)ceil(0.5 * cs->K * MR_MAX_T / E) + 1 : 0;
  tu_rng_t rng = {s->seed};
  int32_t empty = i % (W + 1);
  for (int32_t r = 0; r < W; r++) s->T[r] = r == empty ? 0 : 1 + tu_below(&rng, MR_MAX_T);
}

/* ------------------------------------------------------------------------ */
/* The agreement of calls, per-rank top_k, combine precision (any W >= 2,    */
/* shared with mpi_exchange.c)                                               */
/* ------------------------------------------------------------------------ */

#define AG_H 32
#define AG_T 24
#define AG_EL 4 /* experts per rank */
#define AG_KMAX 4
#define AG_ROWS (8 * AG_T * AG_KMAX + 64)

/* expert_out's keyed value for route (source rank, token, expert), element h:
 * any rank can rebuild it, so the token's rank checks its own outputs. */
static float ag_value(int32_t src, int32_t t, int32_t e, int64_t h) {
  uint64_t k = (((uint64_t)src * 1000003u + (uint64_t)t) * 1000033u + (uint64_t)e) * 131u + (uint64_t)h;
  k ^= k >> 31;
  k *= 0x9e3779b97f4a7c15ull;
  k ^= k >> 29;
  return (float)((double)(k % 4000037u) / 1000000.0 - 2.0);
}

static float ag_round(epx_dtype_t dtype, float v) {
  return dtype == EPX_BFLOAT16 ? epx_bf16_to_f32(epx_f32_to_bf16(v))
         : dtype == EPX_FLOAT16 ? epx_f16_to_f32(epx_f32_to_f16(v))
                                : v;
}

/* The bits of v in the dtype (as the library stores it). */
static uint32_t ag_bits(epx_dtype_t dtype, float v) {
  uint32_t bits;
  if (dtype == EPX_BFLOAT16) return epx_f32_to_bf16(v);
  if (dtype == EPX_FLOAT16) return epx_f32_to_f16(v);
  memcpy(&bits, &v, sizeof bits);
  return bits;
}

static epx_buffer_config_t ag_config(int32_t world, epx_dtype_t dtype, epx_exchange_t exchange, epx_layout_t layout,
                                     epx_combine_precision_t precision) {
  epx_buffer_config_t bc = tu_config(EPX_DEVICE_CPU, dtype, AG_H, AG_EL * world, AG_KMAX, AG_T);
  bc.exchange = exchange;
  bc.layout = layout;
  bc.combine_precision = precision;
  return bc;
}

/* Rank r's routing of T tokens and K slots, with some slots dropped (-1). */
static void ag_routing(int32_t rank, int32_t world, int64_t T, int32_t K, int32_t *idx, float *w) {
  tu_rng_t rng = {0x5eed00u + (uint64_t)rank * 7919u + (uint64_t)K};
  tu_random_routing(&rng, T, AG_EL * world, K, 0.0, idx, w);
  for (int64_t i = 0; i < T * K; i++)
    if (i % 7 == 3) idx[i] = -1;
}

/* expert_out [N, H] of a handle: each received row's keyed value. */
static void ag_expert_out(epx_handle_t h, epx_dtype_t dtype, void *rows) {
  int64_t N = 0;
  epx_handle_recv_rows(h, &N);
  int32_t *src = mr_alloc(sizeof(int32_t) * (size_t)(N + 1)), *tok = mr_alloc(sizeof(int32_t) * (size_t)(N + 1));
  int32_t *ex = mr_alloc(sizeof(int32_t) * (size_t)(N + 1));
  epx_handle_recv_source(h, src, tok);
  epx_handle_recv_routing(h, ex, NULL);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < AG_H; j++)
      epx_store(dtype, rows, i * AG_H + j, src[i] < 0 ? 0.0f : ag_value(src[i], tok[i], ex[i], j));
  free(src), free(tok), free(ex);
}

/* The contract's combine of this rank's token t, element j: P(t, r) = 0 +
 * the products over k in order in float32, rounded to the dtype with payload
 * partials, summed over r ascending in float32 from the first partial,
 * rounded once (0 for a token without routes). */
static float ag_combine_ref(int32_t rank, int32_t world, epx_dtype_t dtype, int payload, const int32_t *idx,
                            const float *w, int32_t K, int64_t t, int64_t j) {
  float acc = 0.0f;
  for (int32_t r = 0, first = 1; r < world; r++) {
    float P = 0.0f;
    int n = 0;
    for (int32_t k = 0; k < K; k++) {
      int32_t e = idx[t * K + k];
      if (e < 0 || e / AG_EL != r) continue;
      P = P + w[t * K + k] * ag_round(dtype, ag_value(rank, (int32_t)t, e, j));
      n++;
    }
    if (!n) continue;
    float partial = payload ? ag_round(dtype, P) : P;
    acc = first ? partial : acc + partial;
    first = 0;
  }
  return ag_round(dtype, acc);
}

typedef struct {
  epx_dtype_t dtype;
  epx_exchange_t exchange;
  epx_combine_precision_t precision;
} ag_precision_case_t;

/* Combine in both precisions against the definition, bit for bit; with a
 * 16-bit payload the two definitions differ somewhere (else the test could
 * not tell them apart). dispatch_backward ignores the precision. */
static int mr_precision_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  const ag_precision_case_t *c = arg;
  int failures = 0;
  size_t esize = c->dtype == EPX_FLOAT32 ? 4 : 2;
  int64_t T = AG_T - rank % 3, K = AG_KMAX;
  int32_t idx[AG_T * AG_KMAX];
  float w[AG_T * AG_KMAX];
  ag_routing(rank, world, T, (int32_t)K, idx, w);
  epx_buffer_config_t bc = ag_config(world, c->dtype, c->exchange, EPX_LAYOUT_EXPERT_MAJOR, c->precision);
  epx_buffer_t buffer = NULL;
  epx_handle_t h = NULL;
  void *rows = mr_alloc(AG_ROWS * AG_H * esize), *out = mr_alloc(AG_T * AG_H * esize);
  void *grad_x = mr_alloc(AG_T * AG_H * esize), *grad_x_f32 = mr_alloc(AG_T * AG_H * esize);
  epx_routing_t routing = {T, (int32_t)K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_STATUS(epx_buffer_create(comm, &bc, &buffer), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h), EPX_SUCCESS, NULL);
  if (!failures) {
    ag_expert_out(h, c->dtype, rows);
    RANK_STATUS(epx_combine(buffer, h, rows, out), EPX_SUCCESS, NULL);
    int64_t wrong = 0, differ = 0;
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < AG_H; j++) {
        float want = ag_combine_ref(rank, world, c->dtype, c->precision == EPX_COMBINE_PARTIALS_PAYLOAD, idx, w,
                                    (int32_t)K, t, j);
        float other = ag_combine_ref(rank, world, c->dtype, c->precision != EPX_COMBINE_PARTIALS_PAYLOAD, idx, w,
                                     (int32_t)K, t, j);
        uint32_t a = ag_bits(c->dtype, want), b = 0;
        if (esize == 4) memcpy(&b, (char *)out + (size_t)(t * AG_H + j) * esize, 4);
        else b = ((const uint16_t *)out)[t * AG_H + j];
        wrong += a != b;
        differ += want != other;
      }
    RANK_EXPECT(wrong == 0, "%s %s %s: %lld of %lld combined values differ from the definition's bits",
                tu_dtype_name(c->dtype), c->exchange == EPX_EXCHANGE_DEDUP ? "dedup" : "collective",
                c->precision == EPX_COMBINE_PARTIALS_PAYLOAD ? "payload partials" : "float32 partials",
                (long long)wrong, (long long)(T * AG_H));
    if (c->dtype != EPX_FLOAT32 && world > 1)
      RANK_EXPECT(differ > 0, "the two precisions' references never differ: the test cannot tell them apart");
    /* dispatch_backward: the same sums as float32 partials. */
    RANK_STATUS(epx_dispatch_backward(buffer, h, rows, grad_x, NULL, NULL), EPX_SUCCESS, NULL);
    int64_t backward_wrong = 0;
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < AG_H; j++) {
        float v = 0.0f;
        for (int32_t r = 0, first = 1; r < world; r++) {
          float P = 0.0f;
          int n = 0;
          for (int32_t k = 0; k < K; k++) {
            int32_t e = idx[t * K + k];
            if (e < 0 || e / AG_EL != r) continue;
            P = P + ag_round(c->dtype, ag_value(rank, (int32_t)t, e, j));
            n++;
          }
          if (n) v = first ? 0.0f + P : v + P, first = 0;
        }
        epx_store(c->dtype, grad_x_f32, t * AG_H + j, v);
      }
    backward_wrong = memcmp(grad_x, grad_x_f32, (size_t)(T * AG_H) * esize) != 0;
    RANK_EXPECT(!backward_wrong, "dispatch_backward is not the float32 sum with combine_precision %d",
                (int)c->precision);
  }
  epx_handle_release(h);
  epx_buffer_destroy(buffer);
  free(rows), free(out), free(grad_x), free(grad_x_f32);
  return failures;
}

/* Everything one layout gives for routing (idx, w) of K slots. */
typedef struct {
  int64_t rows;
  void *recv, *out, *grad_eo, *grad_x;
  int32_t src[AG_ROWS], tok[AG_ROWS], ex[AG_ROWS];
  float grad_w[AG_T * AG_KMAX];
} ag_result_t;

static int ag_run(epx_buffer_t buffer, int32_t rank, int64_t T, int32_t K, const int32_t *idx, const float *w,
                  const void *x, ag_result_t *res) {
  int failures = 0;
  epx_handle_t h = NULL;
  epx_routing_t routing = {T, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h), EPX_SUCCESS, NULL);
  if (failures) return failures;
  void *expert_out = mr_alloc(AG_ROWS * AG_H * 4);
  RANK_STATUS(epx_handle_recv_rows(h, &res->rows), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_handle_recv_source(h, res->src, res->tok), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_handle_recv_routing(h, res->ex, NULL), EPX_SUCCESS, NULL);
  ag_expert_out(h, EPX_FLOAT32, expert_out);
  RANK_STATUS(epx_dispatch(buffer, h, x, res->recv, AG_ROWS), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_combine(buffer, h, expert_out, res->out), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_combine_backward(buffer, h, x, expert_out, res->grad_eo, res->grad_w), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch_backward(buffer, h, res->recv, res->grad_x, NULL, NULL), EPX_SUCCESS, NULL);
  epx_handle_release(h);
  free(expert_out);
  return failures;
}

/* Rank r routes with top_k 1 + r % 3 (max_top_k 4): every result equals that
 * of the same routing padded to top_k 4 with -1 (the path all ranks share),
 * bit for bit; the rank-major layout, whose rows have a slot per k, refuses
 * different top_k on every rank, naming them. */
static int mr_topk_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  const epx_exchange_t *exchange = arg;
  int failures = 0;
  int32_t K = 1 + rank % 3;
  int64_t T = AG_T - rank % 2;
  int32_t idx[AG_T * AG_KMAX], padded[AG_T * AG_KMAX];
  float w[AG_T * AG_KMAX], wpad[AG_T * AG_KMAX];
  ag_routing(rank, world, T, K, idx, w);
  for (int64_t t = 0; t < T; t++)
    for (int32_t k = 0; k < AG_KMAX; k++) {
      padded[t * AG_KMAX + k] = k < K ? idx[t * K + k] : -1;
      wpad[t * AG_KMAX + k] = k < K ? w[t * K + k] : 0.0f;
    }
  void *x = mr_alloc(AG_T * AG_H * 4);
  tu_rng_t rng = {99 + (uint64_t)rank};
  tu_fill(&rng, EPX_FLOAT32, x, AG_T * AG_H);
  ag_result_t *a = calloc(2, sizeof *a), *b = a + 1;
  for (ag_result_t *res = a; res <= b; res++) {
    res->recv = mr_alloc(AG_ROWS * AG_H * 4), res->out = mr_alloc(AG_T * AG_H * 4);
    res->grad_eo = mr_alloc(AG_ROWS * AG_H * 4), res->grad_x = mr_alloc(AG_T * AG_H * 4);
  }
  epx_buffer_config_t bc = ag_config(world, EPX_FLOAT32, *exchange, EPX_LAYOUT_EXPERT_MAJOR, 0);
  epx_buffer_t buffer = NULL;
  RANK_STATUS(epx_buffer_create(comm, &bc, &buffer), EPX_SUCCESS, NULL);
  failures += ag_run(buffer, rank, T, K, idx, w, x, a);
  failures += ag_run(buffer, rank, T, AG_KMAX, padded, wpad, x, b);
  size_t N = (size_t)a->rows;
  RANK_EXPECT(a->rows == b->rows, "top_k %d gives %lld rows, padded %lld", K, (long long)a->rows, (long long)b->rows);
  if (a->rows == b->rows) {
    RANK_EXPECT(!memcmp(a->src, b->src, N * 4) && !memcmp(a->tok, b->tok, N * 4) && !memcmp(a->ex, b->ex, N * 4),
                "recv source/routing differ from the padded routing's");
    RANK_EXPECT(!memcmp(a->recv, b->recv, N * AG_H * 4), "recv_x differs from the padded routing's");
    RANK_EXPECT(!memcmp(a->grad_eo, b->grad_eo, N * AG_H * 4), "grad_expert_out differs");
  }
  RANK_EXPECT(!memcmp(a->out, b->out, (size_t)T * AG_H * 4), "combine's out differs from the padded routing's");
  RANK_EXPECT(!memcmp(a->grad_x, b->grad_x, (size_t)T * AG_H * 4), "grad_x differs from the padded routing's");
  int64_t grad_w_wrong = 0;
  for (int64_t t = 0; t < T; t++)
    for (int32_t k = 0; k < K; k++) grad_w_wrong += a->grad_w[t * K + k] != b->grad_w[t * AG_KMAX + k];
  RANK_EXPECT(grad_w_wrong == 0, "%lld grad_w values differ from the padded routing's", (long long)grad_w_wrong);
  epx_buffer_destroy(buffer);

  /* Rank-major: refused on every rank, naming top_k. */
  bc = ag_config(world, EPX_FLOAT32, *exchange, EPX_LAYOUT_RANK_MAJOR, 0);
  RANK_STATUS(epx_buffer_create(comm, &bc, &buffer), EPX_SUCCESS, NULL);
  epx_handle_t poison = (epx_handle_t)(uintptr_t)0xA5A5A5A5u, h = poison;
  epx_routing_t routing = {T, K, idx, w, NULL, EPX_WEIGHTS_NONE};
  if (world > 1) {
    RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h), EPX_ERROR_SHAPE_MISMATCH, "different top_k");
    RANK_EXPECT(tu_message_has("rank 1 in epx_dispatch_layout") && tu_message_has("top_k 2"),
                "the refusal does not name rank 1 and its top_k: %s", epx_last_error());
    RANK_EXPECT(h == poison, "the handle output was written on a refused layout");
  }
  routing = (epx_routing_t){T, AG_KMAX, padded, wpad, NULL, EPX_WEIGHTS_NONE};
  h = NULL;
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h), EPX_SUCCESS, NULL);
  epx_handle_release(h);
  epx_buffer_destroy(buffer);
  for (ag_result_t *res = a; res <= b; res++) free(res->recv), free(res->out), free(res->grad_eo), free(res->grad_x);
  free(a);
  free(x);
  return failures;
}

/* Ranks in different calls, on different handles or buffers, with grad_w on
 * some ranks only: every rank fails with EPX_ERROR_SHAPE_MISMATCH naming what
 * the ranks called, no output is written, and the comm keeps working. */
static int mr_mismatch_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  const epx_exchange_t *exchange = arg;
  int failures = 0;
  int64_t T = AG_T;
  int32_t idx[AG_T * 2];
  float w[AG_T * 2];
  ag_routing(rank, world, T, 2, idx, w);
  size_t bytes = AG_ROWS * AG_H * 4;
  void *x = mr_alloc(bytes), *rows = mr_alloc(bytes), *out = mr_alloc(bytes), *copy = mr_alloc(bytes);
  float grad_w[AG_T * 2];
  epx_buffer_config_t bc = ag_config(world, EPX_FLOAT32, *exchange, EPX_LAYOUT_EXPERT_MAJOR, 0);
  epx_buffer_t buffer = NULL, other = NULL;
  epx_handle_t h1 = NULL, h2 = NULL, hb = NULL, poison = (epx_handle_t)(uintptr_t)0xA5A5A5A5u, h = poison;
  epx_routing_t routing = {T, 2, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_STATUS(epx_buffer_create(comm, &bc, &buffer), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_buffer_create(comm, &bc, &other), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h1), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h2), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch_layout(other, &routing, NULL, &hb), EPX_SUCCESS, NULL);
  if (failures) return failures;
  tu_poison(rows, bytes);
  tu_poison(out, bytes);
  memcpy(copy, rows, bytes);

  /* Rank 0 dispatches while the others combine, on the same handle. */
  if (rank == 0) RANK_STATUS(epx_dispatch(buffer, h1, x, rows, AG_ROWS), EPX_ERROR_SHAPE_MISMATCH, "different collective calls");
  else RANK_STATUS(epx_combine(buffer, h1, x, out), EPX_ERROR_SHAPE_MISMATCH, "different collective calls");
  RANK_EXPECT(tu_message_has("rank 0 in epx_dispatch on") && tu_message_has("rank 1 in epx_combine on"),
              "the refusal does not say what ranks 0 and 1 called: %s", epx_last_error());
  RANK_EXPECT(!memcmp(rows, copy, bytes) && !memcmp(out, copy, bytes), "an output was written by a refused call");

  /* Rank 0 on another handle of the same buffer. */
  RANK_STATUS(epx_dispatch(buffer, rank == 0 ? h2 : h1, x, rows, AG_ROWS), EPX_ERROR_SHAPE_MISMATCH, "different handles");
  RANK_EXPECT(!memcmp(rows, copy, bytes), "recv_x was written by a refused dispatch");
  /* Rank 0 on a handle of another buffer. */
  RANK_STATUS(epx_dispatch(rank == 0 ? other : buffer, rank == 0 ? hb : h1, x, rows, AG_ROWS), EPX_ERROR_SHAPE_MISMATCH,
              "different buffers");
  RANK_EXPECT(!memcmp(rows, copy, bytes), "recv_x was written by a refused dispatch");
  /* Rank 0 makes a layout while the others combine. */
  if (rank == 0) {
    RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h), EPX_ERROR_SHAPE_MISMATCH, "rank 1 in epx_combine");
    RANK_EXPECT(h == poison, "the handle output was written on a refused layout");
  } else {
    RANK_STATUS(epx_combine(buffer, h1, x, out), EPX_ERROR_SHAPE_MISMATCH, "rank 0 in epx_dispatch_layout");
  }
  /* grad_w on rank 0 only. */
  RANK_STATUS(epx_combine_backward(buffer, h1, x, rank == 0 ? rows : NULL, out, rank == 0 ? grad_w : NULL),
              EPX_ERROR_SHAPE_MISMATCH, "grad_w");
  /* The comm, buffers and handles still work, and layouts stay in step. */
  RANK_STATUS(epx_dispatch(buffer, h1, x, rows, AG_ROWS), EPX_SUCCESS, NULL);
  h = NULL;
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_combine(buffer, h, rows, out), EPX_SUCCESS, NULL);
  epx_handle_release(h);
  epx_handle_release(h1);
  epx_handle_release(h2);
  epx_handle_release(hb);
  epx_buffer_destroy(buffer);
  epx_buffer_destroy(other);
  free(x), free(rows), free(out), free(copy);
  return failures;
}

/* Every agreement case on one comm; the failures of this rank. */
static int mr_agreement_cases_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)arg;
  int failures = 0;
  epx_exchange_t exchanges[] = {EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_COLLECTIVE};
  for (int i = 0; i < 2; i++) {
    if (world > 1) failures += mr_mismatch_rank(comm, rank, world, &exchanges[i]);
    failures += mr_topk_rank(comm, rank, world, &exchanges[i]);
    for (int d = 0; d < 3; d++)
      for (int p = 0; p < 2; p++) {
        ag_precision_case_t c = {d == 0 ? EPX_FLOAT32 : d == 1 ? EPX_BFLOAT16 : EPX_FLOAT16, exchanges[i],
                                 (epx_combine_precision_t)p};
        failures += mr_precision_rank(comm, rank, world, &c);
      }
  }
  return failures;
}

#ifndef MR_SCENE_ONLY

/* ------------------------------------------------------------------------ */
/* Parity over the local transport                                          */
/* ------------------------------------------------------------------------ */

static int parity_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world;
  return mr_check_scene_rank(comm, rank, arg);
}

static void check_parity(int32_t W) {
  static mr_case_t cases[256];
  int n = mr_cases(cases), failed = 0;
  int32_t E = W == 3 ? 12 : 16;
  for (int i = 0; i < n; i++) {
    mr_scene_t s;
    mr_scene_init(&s, &cases[i], i, W, E, 0x5eed0000u + (uint64_t)W);
    if (mr_scene_build(&s)) fail_msg("could not build scene %d", i);
    int bad;
    if (W == 1) {
      /* One rank runs on the self comm, on this thread, as a one-rank job does. */
      epx_comm_t comm = NULL;
      assert_int_equal(epx_comm_create_self(&comm), EPX_SUCCESS);
      bad = mr_check_scene_rank(comm, 0, &s) != 0;
      assert_int_equal(epx_comm_destroy(comm), EPX_SUCCESS);
    } else {
      bad = tu_run_ranks(W, 10.0, parity_rank, &s);
    }
    if (bad) {
      char d[256];
      mr_describe(&s, d, sizeof d);
      print_error("case %d [%s]: %d rank(s) failed\n", i, d, bad);
      failed++;
    }
    mr_scene_free(&s);
  }
  assert_int_equal(failed, 0);
}

static void test_parity_w1(void **state) { (void)state; check_parity(1); }
static void test_parity_w2(void **state) { (void)state; check_parity(2); }
static void test_parity_w3(void **state) { (void)state; check_parity(3); }
static void test_parity_w4(void **state) { (void)state; check_parity(4); }
static void test_parity_w8(void **state) { (void)state; check_parity(8); }

/* ------------------------------------------------------------------------ */
/* Agreement and refusals                                                   */
/* ------------------------------------------------------------------------ */

static epx_buffer_config_t small_config(void) {
  epx_buffer_config_t bc = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, 16, 12, 2, 0);
  bc.max_tokens_rounding = 16;
  return bc;
}

/* Rank r's routing of T tokens (K = 2, experts from the seed). */
static void small_routing(int32_t rank, int64_t T, int32_t E, int32_t *idx, float *w) {
  tu_rng_t rng = {0xabcd + (uint64_t)rank};
  tu_random_routing(&rng, T, E, 2, 0.0, idx, w);
}

/* T per rank {5, 20, 0} agrees 32 (rounding 16); a later batch of 33 tokens
 * on rank 1 is refused on all three ranks before anything moves; a dispatch
 * whose recv_x is too small on one rank is refused on all, recv_x untouched;
 * the buffer keeps working afterwards. */
static int max_tokens_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world, (void)arg;
  int failures = 0;
  epx_buffer_config_t bc = small_config();
  epx_buffer_t buffer = NULL;
  epx_handle_t handle = NULL, poison = (epx_handle_t)(uintptr_t)0xA5A5A5A5u, untouched = poison;
  int32_t idx[2 * 40];
  float w[2 * 40];
  void *x = mr_alloc(40 * 16 * 4), *recv = mr_alloc(4096 * 16 * 4), *copy = mr_alloc(4096 * 16 * 4);
  tu_rng_t rng = {77 + (uint64_t)rank};
  tu_fill(&rng, EPX_FLOAT32, x, 40 * 16);
  int64_t T0[] = {5, 20, 0};
  small_routing(rank, 40, 12, idx, w);
  epx_routing_t routing = {T0[rank], 2, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  int64_t agreed = -1, rows = 0;
  if (epx_buffer_create(comm, &bc, &buffer) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_buffer_create: %s\n", rank, epx_last_error());
    return 1;
  }
  RANK_STATUS(epx_buffer_max_tokens(buffer, &agreed), EPX_SUCCESS, NULL);
  RANK_EXPECT(agreed == 0, "max tokens %lld before the first layout, want 0", (long long)agreed);
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_buffer_max_tokens(buffer, &agreed), EPX_SUCCESS, NULL);
  RANK_EXPECT(agreed == 32, "agreed max tokens %lld, want 32 (max 20 rounded up to 16)", (long long)agreed);
  epx_handle_release(handle);

  /* Oversize on rank 1 only. */
  routing.num_tokens = rank == 1 ? 33 : 32;
  handle = poison;
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_ERROR_CAPACITY_EXCEEDED, "max_tokens_per_rank");
  if (rank != 1) RANK_EXPECT(strstr(epx_last_error(), "rank 1"), "message does not name rank 1: %s", epx_last_error());
  RANK_EXPECT(handle == untouched, "the handle output was written on a refused call");
  RANK_STATUS(epx_buffer_max_tokens(buffer, &agreed), EPX_SUCCESS, NULL);
  RANK_EXPECT(agreed == 32, "max tokens changed to %lld by a refused batch", (long long)agreed);

  /* Exactly max_tokens works; then a too-small recv_x on rank 2. */
  routing.num_tokens = 32;
  handle = NULL;
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_SUCCESS, NULL);
  if (handle) {
    RANK_STATUS(epx_handle_recv_rows(handle, &rows), EPX_SUCCESS, NULL);
    tu_poison(recv, 4096 * 16 * 4);
    memcpy(copy, recv, 4096 * 16 * 4);
    int64_t capacity = rank == 2 ? rows - 1 : rows;
    RANK_STATUS(epx_dispatch(buffer, handle, x, recv, capacity),
                rank == 2 ? EPX_ERROR_CAPACITY_EXCEEDED : EPX_ERROR_PEER_FAILED,
                rank == 2 ? "recv_rows_capacity" : "rank 2");
    RANK_EXPECT(!memcmp(copy, recv, 4096 * 16 * 4), "recv_x was written by a refused dispatch");
    RANK_STATUS(epx_dispatch(buffer, handle, x, recv, rows), EPX_SUCCESS, NULL);
    epx_handle_release(handle);
  }
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_SUCCESS, NULL);
  free(x);
  free(recv);
  free(copy);
  return failures;
}

static void test_max_tokens_agreed_and_oversize_refused(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(3, 10.0, max_tokens_rank, NULL), 0);
}

/* One rank (the last) creates its buffer with a different field: every rank
 * gets EPX_ERROR_SHAPE_MISMATCH naming that rank, the field and its value
 * (an enum's by name: `theirs`, and the other ranks' `common`), and no
 * buffer. */
typedef struct {
  const char *field;
  int64_t value;
  const char *theirs, *common;
} shape_case_t;

static int shape_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  const shape_case_t *sc = arg;
  int failures = 0;
  epx_buffer_config_t bc = small_config();
  if (rank == world - 1) {
    if (!strcmp(sc->field, "hidden")) bc.hidden = sc->value;
    if (!strcmp(sc->field, "num_experts")) bc.num_experts = (int32_t)sc->value;
    if (!strcmp(sc->field, "dtype")) bc.dtype = (epx_dtype_t)sc->value;
    if (!strcmp(sc->field, "max_tokens_per_rank")) bc.max_tokens_per_rank = sc->value;
    if (!strcmp(sc->field, "exchange")) bc.exchange = (epx_exchange_t)sc->value;
    if (!strcmp(sc->field, "layout")) bc.layout = (epx_layout_t)sc->value;
    if (!strcmp(sc->field, "combine_precision")) bc.combine_precision = (epx_combine_precision_t)sc->value;
  }
  epx_buffer_t poison = (epx_buffer_t)(uintptr_t)0xA5A5A5A5u, buffer = poison;
  char rank_name[32], field_value[64];
  snprintf(rank_name, sizeof rank_name, "rank %d", world - 1);
  snprintf(field_value, sizeof field_value, "config.%s = %s but", sc->field, sc->theirs);
  RANK_STATUS(epx_buffer_create(comm, &bc, &buffer), EPX_ERROR_SHAPE_MISMATCH, rank_name);
  RANK_EXPECT(strstr(epx_last_error(), field_value), "message lacks \"%s\": %s", field_value, epx_last_error());
  snprintf(field_value, sizeof field_value, "ranks have %s;", sc->common);
  RANK_EXPECT(strstr(epx_last_error(), field_value), "message lacks \"%s\": %s", field_value, epx_last_error());
  RANK_EXPECT(buffer == poison, "the buffer output was written on a refused create");
  /* The comm is still usable: a matching create works. */
  bc = small_config();
  buffer = NULL;
  RANK_STATUS(epx_buffer_create(comm, &bc, &buffer), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_SUCCESS, NULL);
  return failures;
}

static void test_shape_mismatch_refused_on_every_rank(void **state) {
  (void)state;
  shape_case_t cases[] = {
      {"hidden", 24, "24", "16"},
      {"num_experts", 24, "24", "12"},
      {"dtype", EPX_BFLOAT16, "EPX_BFLOAT16", "EPX_FLOAT32"},
      {"max_tokens_per_rank", 64, "64", "0"},
      {"exchange", EPX_EXCHANGE_COLLECTIVE, "EPX_EXCHANGE_COLLECTIVE", "EPX_EXCHANGE_DEDUP"},
      {"layout", EPX_LAYOUT_RANK_MAJOR, "EPX_LAYOUT_RANK_MAJOR", "EPX_LAYOUT_EXPERT_MAJOR"},
      {"combine_precision", EPX_COMBINE_PARTIALS_PAYLOAD, "EPX_COMBINE_PARTIALS_PAYLOAD",
       "EPX_COMBINE_PARTIALS_FLOAT32"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    assert_int_equal(tu_run_ranks(3, 10.0, shape_rank, &cases[i]), 0);
    assert_int_equal(tu_run_ranks(2, 10.0, shape_rank, &cases[i]), 0);
  }
}

/* One rank (`odd`) routes with another weighting: every rank refuses the
 * layout with EPX_ERROR_SHAPE_MISMATCH naming rank 0's weighting and the odd
 * rank's, no handle is written, and the next (agreeing) layout works. */
typedef struct {
  int32_t odd;
  epx_weighting_t common, theirs;
} weighting_case_t;

static int weighting_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world;
  const weighting_case_t *wc = arg;
  int failures = 0;
  epx_buffer_config_t bc = small_config();
  epx_buffer_t buffer = NULL;
  epx_handle_t poison = (epx_handle_t)(uintptr_t)0xA5A5A5A5u, handle = poison;
  int32_t idx[2 * 8];
  float w[2 * 8];
  small_routing(rank, 8, 12, idx, w);
  if (epx_buffer_create(comm, &bc, &buffer) != EPX_SUCCESS) return 1;
  epx_routing_t routing = {8, 2, idx, w, NULL, rank == wc->odd ? wc->theirs : wc->common};
  /* The message compares rank 0 with the first rank that differs from it. */
  const epx_weighting_t named_w = wc->odd == 0 ? wc->common : wc->theirs;
  char named[64];
  snprintf(named, sizeof named, "rank %d with %s", wc->odd == 0 ? 1 : wc->odd,
           named_w == EPX_WEIGHTS_NONE ? "EPX_WEIGHTS_NONE"
           : named_w == EPX_WEIGHTS_IN_DISPATCH ? "EPX_WEIGHTS_IN_DISPATCH" : "EPX_WEIGHTS_IN_COMBINE");
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_ERROR_SHAPE_MISMATCH, named);
  RANK_EXPECT(tu_message_has("routing.weighting"), "the refusal does not name the field: %s", epx_last_error());
  RANK_EXPECT(handle == poison, "the handle output was written on a refused layout");
  routing.weighting = wc->common;
  handle = NULL;
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_SUCCESS, NULL);
  epx_handle_release(handle);
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_SUCCESS, NULL);
  return failures;
}

static void test_weighting_mismatch_refused_on_every_rank(void **state) {
  (void)state;
  weighting_case_t cases[] = {{1, EPX_WEIGHTS_IN_COMBINE, EPX_WEIGHTS_IN_DISPATCH},
                              {2, EPX_WEIGHTS_IN_DISPATCH, EPX_WEIGHTS_NONE},
                              {0, EPX_WEIGHTS_IN_COMBINE, EPX_WEIGHTS_NONE}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    assert_int_equal(tu_run_ranks(3, 10.0, weighting_rank, &cases[i]), 0);
    if (cases[i].odd < 2) assert_int_equal(tu_run_ranks(2, 10.0, weighting_rank, &cases[i]), 0);
  }
}

/* A buffer with a live handle refuses to be destroyed (and stays usable: a
 * backward still runs on the handle); after the release it goes. */
static int busy_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world, (void)arg;
  int failures = 0;
  epx_buffer_config_t bc = small_config();
  epx_buffer_t buffer = NULL;
  epx_handle_t h1 = NULL, h2 = NULL;
  int32_t idx[2 * 8];
  float w[2 * 8];
  small_routing(rank, 8, 12, idx, w);
  epx_routing_t routing = {8, 2, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  void *x = mr_alloc(8 * 16 * 4), *grad = mr_alloc(8 * 16 * 4), *rows = mr_alloc(2 * 8 * 2 * 16 * 4);
  tu_rng_t rng = {5 + (uint64_t)rank};
  tu_fill(&rng, EPX_FLOAT32, x, 8 * 16);
  if (epx_buffer_create(comm, &bc, &buffer) != EPX_SUCCESS) return 1;
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h1), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &h2), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_ERROR_BUSY, "2 handle(s)");
  RANK_STATUS(epx_handle_release(h1), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_ERROR_BUSY, "1 handle(s)");
  int64_t n = 0;
  RANK_STATUS(epx_handle_recv_rows(h2, &n), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch(buffer, h2, x, rows, n), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_dispatch_backward(buffer, h2, rows, grad, NULL, NULL), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_handle_release(h2), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_handle_release(h2), EPX_ERROR_INVALID_HANDLE, "handle");
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_ERROR_INVALID_HANDLE, "buffer");
  free(x);
  free(grad);
  free(rows);
  return failures;
}

static void test_destroy_with_live_handles_is_busy(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(2, 10.0, busy_rank, NULL), 0);
}

/* Rank `bad` names an expert out of range (or twice in a row): it gets
 * EPX_ERROR_INVALID_ARGUMENT with its own message, every other rank
 * EPX_ERROR_PEER_FAILED naming it; no handle is written; the buffer keeps
 * working for the next (good) routing. */
typedef struct {
  int32_t bad;
  int duplicate;
} bad_routing_t;

static int bad_routing_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world;
  const bad_routing_t *b = arg;
  int failures = 0;
  epx_buffer_config_t bc = small_config();
  epx_buffer_t buffer = NULL;
  epx_handle_t poison = (epx_handle_t)(uintptr_t)0xA5A5A5A5u, handle = poison;
  int32_t idx[2 * 8];
  float w[2 * 8];
  small_routing(rank, 8, 12, idx, w);
  if (epx_buffer_create(comm, &bc, &buffer) != EPX_SUCCESS) return 1;
  if (rank == b->bad) {
    if (b->duplicate) idx[3 * 2 + 1] = idx[3 * 2];
    else idx[3 * 2 + 1] = 12;
  }
  epx_routing_t routing = {8, 2, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  char named[32];
  snprintf(named, sizeof named, "rank %d", b->bad);
  if (rank == b->bad)
    RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_ERROR_INVALID_ARGUMENT,
                b->duplicate ? "twice" : "routing.topk_idx[3][1] is 12");
  else
    RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_ERROR_PEER_FAILED, named);
  RANK_EXPECT(handle == poison, "the handle output was written on a refused layout");
  small_routing(rank, 8, 12, idx, w);
  handle = NULL;
  RANK_STATUS(epx_dispatch_layout(buffer, &routing, NULL, &handle), EPX_SUCCESS, NULL);
  epx_handle_release(handle);
  RANK_STATUS(epx_buffer_destroy(buffer), EPX_SUCCESS, NULL);
  return failures;
}

/* Mismatched calls refused on every rank, per-rank top_k, and combine
 * precision (each against its definition), at W = 1, 2, 3 and 4. */
static void test_agreement_topk_and_precision(void **state) {
  (void)state;
  for (int32_t W = 1; W <= 4; W++) assert_int_equal(tu_run_ranks(W, 20.0, mr_agreement_cases_rank, NULL), 0);
}

static void test_bad_routing_refused_on_every_rank(void **state) {
  (void)state;
  bad_routing_t cases[] = {{2, 0}, {0, 1}, {3, 1}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    assert_int_equal(tu_run_ranks(4, 10.0, bad_routing_rank, &cases[i]), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parity_w1),
      cmocka_unit_test(test_parity_w2),
      cmocka_unit_test(test_parity_w3),
      cmocka_unit_test(test_parity_w4),
      cmocka_unit_test(test_parity_w8),
      cmocka_unit_test(test_max_tokens_agreed_and_oversize_refused),
      cmocka_unit_test(test_shape_mismatch_refused_on_every_rank),
      cmocka_unit_test(test_weighting_mismatch_refused_on_every_rank),
      cmocka_unit_test(test_destroy_with_live_handles_is_busy),
      cmocka_unit_test(test_bad_routing_refused_on_every_rank),
      cmocka_unit_test(test_agreement_topk_and_precision),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif /* MR_SCENE_ONLY */
