/* The low-latency decode mode (epx.h, "Low-latency decode") on the CPU: for
 * token counts 0, 1, 7, 128 and 256 per rank (uneven across ranks), top-k 1
 * to 8, E 8 to 512, every token on one expert, both layouts, the dedup,
 * collective and hierarchical exchanges, bf16 and f32, over W = 1, 2, 4
 * threads (hierarchical: 4 posing as 2 nodes), and fp8 (quantized on the
 * way or not): every received row is its source token's row, in the normal exchange's row and order (expert-major: the
 * normal expert-major rows of each expert at e * W * max_tokens;
 * rank-major: those of each source rank at s * max_tokens), the counts and
 * sources are the normal layout's, and combine gives the normal combine's
 * bits; the two-phase calls equal the one-call ones, and a count passed by
 * pointer the same as the routing's. Then the refusals: more tokens than
 * max_tokens_per_rank (named, on every rank), backward and the normal calls
 * on a low-latency buffer, the phases out of order, configs the mode does
 * not serve.
 *
 * Every rank regenerates every rank's routing and tokens from the case's
 * seed, so it checks its own rows without a gather. The scene code is shared
 * with mpi_ll.c, which includes this file with LL_SCENE_ONLY defined; it
 * never calls cmocka. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"
#include "buffer_config.h"

#define LL_MAX_W 8

typedef struct {
  int32_t E, K, max_tokens;
  int64_t H;
  epx_dtype_t dtype;
  epx_layout_t layout;
  epx_exchange_t exchange;
  epx_combine_precision_t precision;
  int32_t one_expert;   /* every route of every token to expert 0 (K = 1) */
  int32_t counts[5];    /* rank r has counts[r % 5] tokens */
} ll_case_t;

/* One rank's tokens and routing, the same on every rank that builds it. */
typedef struct {
  int64_t T;
  int32_t *idx; /* [T, K] */
  float *w;     /* [T, K] */
  void *x;      /* [T, H] */
} ll_side_t;

static uint64_t ll_seed(const ll_case_t *c, int32_t rank) {
  return 0x11d3c0de0000ull + (uint64_t)rank * 7919u + (uint64_t)c->E * 131u + (uint64_t)c->K * 17u +
         (uint64_t)c->counts[0] * 3u + (uint64_t)c->layout;
}

static void *ll_alloc(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64)) return NULL;
  memset(p, 0, bytes ? bytes : 64);
  return p;
}

static int ll_side_build(const ll_case_t *c, int32_t rank, ll_side_t *s) {
  tu_rng_t rng = {ll_seed(c, rank)};
  s->T = c->counts[rank % 5];
  size_t TK = (size_t)(s->T * c->K);
  s->idx = ll_alloc(TK * sizeof(int32_t));
  s->w = ll_alloc(TK * sizeof(float));
  s->x = ll_alloc((size_t)(s->T * c->H) * epx_dtype_size(c->dtype));
  if (!s->idx || !s->w || !s->x) return 1;
  tu_random_routing(&rng, s->T, c->E, c->K, 0.0, s->idx, s->w);
  if (c->one_expert)
    for (size_t i = 0; i < TK; i++) s->idx[i] = 0;
  /* A few dropped routes (-1): the mode takes them as the normal path does. */
  for (size_t i = 0; i < TK && !c->one_expert; i += 11) s->idx[i] = -1;
  tu_fill(&rng, c->dtype, s->x, s->T * c->H);
  return 0;
}

static void ll_side_free(ll_side_t *s) {
  TU_FREE_ALL(s->idx, s->w, s->x);
}

static epx_buffer_config_t ll_config(const ll_case_t *c, int32_t low_latency) {
  epx_buffer_config_t b = tu_config(EPX_DEVICE_CPU, c->dtype, c->H, c->E, c->K, c->max_tokens);
  b.exchange = c->exchange;
  b.layout = c->layout;
  b.combine_precision = c->precision;
  b.low_latency = low_latency;
  return b;
}

static epx_routing_t ll_routing(const ll_case_t *c, const ll_side_t *s) {
  epx_weighting_t weighting = c->layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE;
  return (epx_routing_t){s->T, c->K, s->idx, s->w, NULL, weighting};
}

/* The expert: row i times (1 + (i % 5) / 4), in float32, rounded to the
 * dtype. The same rows in the same order give the same outputs, whatever
 * the layout's padding. */
static void ll_expert(const ll_case_t *c, const void *in, void *out, int64_t rows, int64_t first_row) {
  size_t es = epx_dtype_size(c->dtype);
  float *f = malloc(sizeof(float) * (size_t)c->H);
  for (int64_t i = 0; i < rows && f; i++) {
    epx_convert(EPX_FLOAT32, f, c->dtype, (const char *)in + (size_t)(i * c->H) * es, c->H);
    float scale = 1.0f + (float)((first_row + i) % 5) / 4.0f;
    for (int64_t h = 0; h < c->H; h++) f[h] *= scale;
    epx_convert(c->dtype, (char *)out + (size_t)(i * c->H) * es, EPX_FLOAT32, f, c->H);
  }
  free(f);
}

/* Everything one rank checks of one case; failures counted. */
typedef struct {
  const ll_case_t *c;
  int32_t rank, W;
  ll_side_t side[LL_MAX_W];
  int64_t groups, block; /* the fixed shape: groups of block rows */
  size_t row_bytes;
} ll_run_t;

/* The normal exchange's received rows, expert outputs and combine. */
typedef struct {
  int64_t N;
  int64_t *counts, *offsets;
  int32_t *src_rank, *src_token;
  void *recv, *expert_out, *out;
} ll_normal_t;

static long long ll_normal(epx_comm_t comm, ll_run_t *r, ll_normal_t *n) {
  const ll_case_t *c = r->c;
  int32_t rank = r->rank;
  long long failures = 0;
  int32_t El = c->E / r->W;
  epx_buffer_config_t cfg = ll_config(c, 0);
  epx_buffer_t buffer = NULL;
  epx_handle_t handle = NULL;
  epx_routing_t routing = ll_routing(c, &r->side[rank]);
  RANK_REQUIRE_OK(epx_buffer_create(comm, &cfg, &buffer));
  RANK_REQUIRE_OK(epx_dispatch_layout(buffer, &routing, NULL, &handle));
  RANK_REQUIRE_OK(epx_handle_recv_rows(handle, &n->N));
  n->counts = ll_alloc(sizeof(int64_t) * (size_t)El);
  n->offsets = ll_alloc(sizeof(int64_t) * (size_t)(El + 1));
  n->src_rank = ll_alloc(sizeof(int32_t) * (size_t)n->N);
  n->src_token = ll_alloc(sizeof(int32_t) * (size_t)n->N);
  n->recv = ll_alloc((size_t)n->N * r->row_bytes);
  n->expert_out = ll_alloc((size_t)n->N * r->row_bytes);
  n->out = ll_alloc((size_t)r->side[rank].T * r->row_bytes);
  RANK_REQUIRE(n->counts && n->offsets && n->src_rank && n->src_token && n->recv && n->expert_out && n->out,
               "out of memory");
  RANK_REQUIRE_OK(epx_handle_expert_counts(handle, n->counts, n->offsets));
  RANK_REQUIRE_OK(epx_handle_recv_source(handle, n->src_rank, n->src_token));
  RANK_REQUIRE_OK(epx_dispatch(buffer, handle, r->side[rank].x, n->recv, n->N));
  ll_expert(c, n->recv, n->expert_out, n->N, 0);
  RANK_REQUIRE_OK(epx_combine(buffer, handle, n->expert_out, n->out));
done:
  epx_handle_release(handle);
  epx_buffer_destroy(buffer);
  return failures;
}

static void ll_normal_free(ll_normal_t *n) {
  TU_FREE_ALL(n->counts, n->offsets, n->src_rank, n->src_token, n->recv, n->expert_out, n->out);
}

/* The normal layout's rows of group g (an expert, or a source rank): first
 * row and count. */
static void ll_normal_group(const ll_run_t *r, const ll_normal_t *n, int64_t g, int64_t *first, int64_t *count) {
  if (r->c->layout == EPX_LAYOUT_EXPERT_MAJOR) {
    *first = n->offsets[g];
    *count = n->counts[g];
    return;
  }
  *first = 0, *count = 0;
  for (int64_t i = 0; i < n->N; i++) {
    if (n->src_rank[i] < g) *first = i + 1;
    if (n->src_rank[i] == g) (*count)++;
  }
}

/* The low-latency results against the normal ones and the sources. */
static long long ll_compare(ll_run_t *r, const ll_normal_t *n, const void *recv, const int32_t *recv_count,
                            const int32_t *src_rank, const int32_t *src_token) {
  int32_t rank = r->rank;
  long long failures = 0;
  for (int64_t g = 0; g < r->groups; g++) {
    int64_t first, count;
    ll_normal_group(r, n, g, &first, &count);
    RANK_EXPECT(recv_count[g] == count, "group %lld: recv_count %d, the normal layout has %lld", (long long)g,
                recv_count[g], (long long)count);
    for (int64_t i = 0; i < r->block && failures < 8; i++) {
      int64_t row = g * r->block + i, normal = first + i;
      if (i >= count) {
        RANK_EXPECT(src_rank[row] == -1 && src_token[row] == -1, "row %lld past the count has a source",
                    (long long)row);
        continue;
      }
      int32_t s = src_rank[row], t = src_token[row];
      RANK_EXPECT(s == n->src_rank[normal] && t == n->src_token[normal],
                  "row %lld: source (%d, %d), the normal row's (%d, %d)", (long long)row, s, t,
                  n->src_rank[normal], n->src_token[normal]);
      RANK_EXPECT(!memcmp((const char *)recv + (size_t)row * r->row_bytes,
                          (const char *)n->recv + (size_t)normal * r->row_bytes, r->row_bytes),
                  "row %lld differs from the normal row %lld", (long long)row, (long long)normal);
      if (s >= 0 && s < r->W && t >= 0 && t < r->side[s].T)
        RANK_EXPECT(!memcmp((const char *)recv + (size_t)row * r->row_bytes,
                            (const char *)r->side[s].x + (size_t)t * r->row_bytes, r->row_bytes),
                    "row %lld is not token %d of rank %d", (long long)row, t, s);
    }
  }
  return failures;
}

/* The expert outputs in the fixed shape: each group's rows numbered as in
 * the normal layout, so the outputs are the same bits. */
static void ll_expert_fixed(ll_run_t *r, const ll_normal_t *n, const void *recv, void *expert_out) {
  for (int64_t g = 0; g < r->groups; g++) {
    int64_t first, count;
    ll_normal_group(r, n, g, &first, &count);
    size_t at = (size_t)(g * r->block) * r->row_bytes;
    ll_expert(r->c, (const char *)recv + at, (char *)expert_out + at, count, first);
  }
}

/* One low-latency step, in one call or two phases, with the count given
 * directly or by pointer; checked against the normal exchange. */
static long long ll_step(epx_buffer_t buffer, ll_run_t *r, const ll_normal_t *n, int two_phase, int by_pointer) {
  const ll_case_t *c = r->c;
  int32_t rank = r->rank;
  long long failures = 0;
  const ll_side_t *me = &r->side[rank];
  int64_t N = r->groups * r->block;
  void *recv = ll_alloc((size_t)N * r->row_bytes), *expert_out = ll_alloc((size_t)N * r->row_bytes);
  void *out = ll_alloc((size_t)me->T * r->row_bytes);
  int32_t *count = ll_alloc(sizeof(int32_t) * (size_t)r->groups);
  int32_t *src_rank = ll_alloc(sizeof(int32_t) * (size_t)N), *src_token = ll_alloc(sizeof(int32_t) * (size_t)N);
  epx_handle_t handle = NULL;
  ll_side_t padded = {0};
  RANK_REQUIRE(recv && expert_out && out && count && src_rank && src_token, "out of memory");
  epx_routing_t routing = ll_routing(c, me);
  int32_t tokens = (int32_t)me->T;
  /* By pointer: the arrays may hold more rows than the step's count. */
  if (by_pointer) routing.num_tokens = c->max_tokens;
  if (by_pointer) {
    padded.idx = ll_alloc(sizeof(int32_t) * (size_t)(c->max_tokens * c->K));
    padded.w = ll_alloc(sizeof(float) * (size_t)(c->max_tokens * c->K));
    RANK_REQUIRE(padded.idx && padded.w, "out of memory");
    for (int64_t i = 0; i < c->max_tokens * c->K; i++) padded.idx[i] = 12345; /* past the count: never read */
    memcpy(padded.idx, me->idx, sizeof(int32_t) * (size_t)(me->T * c->K));
    memcpy(padded.w, me->w, sizeof(float) * (size_t)(me->T * c->K));
    routing.topk_idx = padded.idx, routing.topk_w = padded.w;
  }
  const int32_t *count_ptr = by_pointer ? &tokens : NULL;
  if (two_phase) {
    RANK_REQUIRE_OK(epx_ll_dispatch_send(buffer, &routing, count_ptr, me->x, recv, count, &handle));
    RANK_REQUIRE_OK(epx_ll_complete(buffer, handle));
  } else {
    RANK_REQUIRE_OK(epx_ll_dispatch(buffer, &routing, count_ptr, me->x, recv, count, &handle));
  }
  int64_t rows = 0;
  RANK_REQUIRE_OK(epx_handle_recv_rows(handle, &rows));
  RANK_REQUIRE(rows == N, "epx_handle_recv_rows %lld, the fixed shape has %lld", (long long)rows, (long long)N);
  RANK_REQUIRE_OK(epx_handle_recv_source(handle, src_rank, src_token));
  failures += ll_compare(r, n, recv, count, src_rank, src_token);
  ll_expert_fixed(r, n, recv, expert_out);
  if (two_phase) {
    RANK_REQUIRE_OK(epx_ll_combine_send(buffer, handle, expert_out, out));
    RANK_REQUIRE_OK(epx_ll_complete(buffer, handle));
  } else {
    RANK_REQUIRE_OK(epx_ll_combine(buffer, handle, expert_out, out));
  }
  RANK_EXPECT(!memcmp(out, n->out, (size_t)me->T * r->row_bytes),
              "combine differs from the normal combine (two_phase %d, by_pointer %d)", two_phase, by_pointer);
done:
  epx_handle_release(handle);
  free(padded.idx);
  free(padded.w);
  TU_FREE_ALL(recv, expert_out, out, count, src_rank, src_token);
  return failures;
}

/* The whole case on one rank: the normal exchange, then three low-latency
 * steps on one buffer (one call; two phases; the count by pointer). */
static long long ll_case_rank(epx_comm_t comm, int32_t rank, int32_t W, const ll_case_t *c) {
  long long failures = 0;
  ll_run_t r = {.c = c, .rank = rank, .W = W};
  ll_normal_t n = {0};
  epx_buffer_t buffer = NULL;
  r.row_bytes = (size_t)c->H * epx_dtype_size(c->dtype);
  r.groups = c->layout == EPX_LAYOUT_RANK_MAJOR ? W : c->E / W;
  r.block = c->layout == EPX_LAYOUT_RANK_MAJOR ? c->max_tokens : (int64_t)W * c->max_tokens;
  for (int32_t s = 0; s < W; s++) RANK_REQUIRE(!ll_side_build(c, s, &r.side[s]), "out of memory");
  failures += ll_normal(comm, &r, &n);
  RANK_REQUIRE(!failures, "the normal exchange failed");
  epx_buffer_config_t cfg = ll_config(c, 1);
  RANK_REQUIRE_OK(epx_buffer_create(comm, &cfg, &buffer));
  for (int variant = 0; variant < 3; variant++) failures += ll_step(buffer, &r, &n, variant == 1, variant == 2);
done:
  epx_buffer_destroy(buffer);
  ll_normal_free(&n);
  for (int32_t s = 0; s < W; s++) ll_side_free(&r.side[s]);
  return failures;
}

/* The cases: token counts per rank uneven across ranks (rank r has
 * counts[r % 5]), top-k 1 to 8, E 8 to 512. */
static int ll_cases(ll_case_t *out) {
  const int64_t H = 32;
  const ll_case_t base = {8, 2, 256, H, EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP,
                          EPX_COMBINE_PARTIALS_FLOAT32, 0, {7, 128, 0, 256, 1}};
  static const int32_t ks[] = {1, 2, 4, 8}, es[] = {8, 32, 512};
  int n = 0;
  for (int e = 0; e < 3; e++)
    for (int k = 0; k < 4; k++) {
      if (ks[k] > es[e]) continue;
      ll_case_t c = base;
      c.E = es[e], c.K = ks[k];
      c.layout = (e + k) % 2 ? EPX_LAYOUT_RANK_MAJOR : EPX_LAYOUT_EXPERT_MAJOR;
      c.exchange = k % 2 ? EPX_EXCHANGE_COLLECTIVE : EPX_EXCHANGE_DEDUP;
      c.precision = e == 1 ? EPX_COMBINE_PARTIALS_PAYLOAD : EPX_COMBINE_PARTIALS_FLOAT32;
      out[n++] = c;
    }
  ll_case_t c = base;
  c.K = 1, c.one_expert = 1; /* every token to expert 0 */
  out[n++] = c;
  c = base;
  c.dtype = EPX_FLOAT32, c.K = 3, c.E = 16, c.max_tokens = 64, c.counts[1] = 64, c.counts[3] = 33;
  out[n++] = c;
  c = base;
  c.counts[0] = c.counts[1] = c.counts[2] = c.counts[3] = c.counts[4] = 0; /* an empty step everywhere */
  out[n++] = c;
  c = base;
  c.counts[0] = 1, c.counts[1] = 1, c.counts[2] = 1, c.counts[3] = 1, c.counts[4] = 1; /* one token each */
  c.K = 8, c.E = 64;
  out[n++] = c;
  return n;
}

static void ll_describe(const ll_case_t *c, char *text, size_t size) {
  snprintf(text, size, "E %d, K %d, max %d, %s, %s, %s, counts %d/%d/%d/%d/%d%s", c->E, c->K, c->max_tokens,
           c->dtype == EPX_BFLOAT16 ? "bf16" : "f32",
           c->layout == EPX_LAYOUT_RANK_MAJOR ? "rank-major" : "expert-major",
           c->exchange == EPX_EXCHANGE_DEDUP ? "dedup" : c->exchange == EPX_EXCHANGE_COLLECTIVE ? "collective"
                                                                                             : "hierarchical",
           c->counts[0], c->counts[1], c->counts[2],
           c->counts[3], c->counts[4], c->one_expert ? ", one expert" : "");
}

/* fp8 (epx_ll_dispatch_fp8): quantized on the way and pre-quantized, each
 * received row and its scales the normal fp8 dispatch's (epx_dispatch_quantize
 * on a buffer of the same format), and combine of the dequantized rows the
 * normal combine's bits. */
static long long ll_fp8_rank(epx_comm_t comm, int32_t rank, int32_t W) {
  enum { FE = 16, FK = 4, FH = 256, FMAX = 64, SC = FH / 128 };
  long long failures = 0;
  const ll_case_t c = {FE, FK, FMAX, FH, EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP,
                       EPX_COMBINE_PARTIALS_FLOAT32, 0, {7, 64, 0, 33, 1}};
  const int64_t El = FE / W, block = (int64_t)W * FMAX, N_ll = El * block;
  ll_side_t me = {0};
  epx_buffer_t normal = NULL, ll = NULL;
  epx_handle_t hn = NULL, hq = NULL, hp = NULL;
  uint8_t *q = NULL, *rq = NULL, *lq = NULL, *pq = NULL;
  float *qs = NULL, *rs = NULL, *ls = NULL, *ps = NULL;
  void *deq = NULL, *deq_ll = NULL, *out = NULL, *out_ll = NULL;
  int64_t *counts = ll_alloc(sizeof(int64_t) * FE), *offsets = ll_alloc(sizeof(int64_t) * (FE + 1)), N = 0;
  int32_t *count = ll_alloc(sizeof(int32_t) * FE);
  RANK_REQUIRE(!ll_side_build(&c, rank, &me), "out of memory");
  epx_buffer_config_t cfg = ll_config(&c, 0);
  cfg.fp8_format = EPX_FP8_E4M3_F32_128;
  RANK_REQUIRE_OK(epx_buffer_create(comm, &cfg, &normal));
  cfg.low_latency = 1;
  RANK_REQUIRE_OK(epx_buffer_create(comm, &cfg, &ll));
  epx_routing_t routing = ll_routing(&c, &me);
  RANK_REQUIRE_OK(epx_dispatch_layout(normal, &routing, NULL, &hn));
  RANK_REQUIRE_OK(epx_handle_recv_rows(hn, &N));
  RANK_REQUIRE_OK(epx_handle_expert_counts(hn, counts, offsets));
  q = ll_alloc((size_t)(me.T * FH)), qs = ll_alloc(sizeof(float) * (size_t)(me.T * SC));
  rq = ll_alloc((size_t)(N * FH)), rs = ll_alloc(sizeof(float) * (size_t)(N * SC));
  lq = ll_alloc((size_t)(N_ll * FH)), ls = ll_alloc(sizeof(float) * (size_t)(N_ll * SC));
  pq = ll_alloc((size_t)(N_ll * FH)), ps = ll_alloc(sizeof(float) * (size_t)(N_ll * SC));
  deq = ll_alloc((size_t)(N * FH) * 2), deq_ll = ll_alloc((size_t)(N_ll * FH) * 2);
  out = ll_alloc((size_t)(me.T * FH) * 2), out_ll = ll_alloc((size_t)(me.T * FH) * 2);
  RANK_REQUIRE(q && qs && rq && rs && lq && ls && pq && ps && deq && deq_ll && out && out_ll, "out of memory");
  RANK_REQUIRE_OK(epx_dispatch_quantize(normal, hn, me.x, rq, rs, N));
  RANK_REQUIRE_OK(epx_ll_dispatch_fp8(ll, &routing, NULL, me.x, NULL, lq, ls, count, &hq));
  RANK_REQUIRE_OK(epx_quantize(EPX_FP8_E4M3_F32_128, EPX_BFLOAT16, me.T, FH, me.x, q, qs));
  RANK_REQUIRE_OK(epx_ll_dispatch_fp8_send(ll, &routing, NULL, q, qs, pq, ps, NULL, &hp));
  RANK_REQUIRE_OK(epx_ll_complete(ll, hp));
  for (int64_t e = 0; e < El; e++) {
    RANK_EXPECT(count[e] == counts[e], "fp8: expert %lld has %d rows, the normal layout %lld", (long long)e, count[e],
                (long long)counts[e]);
    size_t at = (size_t)(e * block), from = (size_t)offsets[e], n = (size_t)counts[e];
    RANK_EXPECT(!memcmp(lq + at * FH, rq + from * FH, n * FH) && !memcmp(ls + at * SC, rs + from * SC, n * SC * 4),
                "fp8 quantized on the way: expert %lld's rows or scales differ from the normal fp8 dispatch's",
                (long long)e);
    RANK_EXPECT(!memcmp(pq + at * FH, rq + from * FH, n * FH) && !memcmp(ps + at * SC, rs + from * SC, n * SC * 4),
                "fp8 pre-quantized: expert %lld's rows or scales differ from the normal fp8 dispatch's", (long long)e);
    RANK_OK(epx_dequantize(EPX_FP8_E4M3_F32_128, EPX_BFLOAT16, (int64_t)n, FH, lq + at * FH, ls + at * SC,
                           (char *)deq_ll + at * FH * 2));
  }
  RANK_OK(epx_dequantize(EPX_FP8_E4M3_F32_128, EPX_BFLOAT16, N, FH, rq, rs, deq));
  RANK_OK(epx_combine(normal, hn, deq, out));
  RANK_OK(epx_ll_combine(ll, hq, deq_ll, out_ll));
  RANK_EXPECT(!memcmp(out, out_ll, (size_t)(me.T * FH) * 2), "fp8: combine differs from the normal combine");
done:
  epx_handle_release(hn), epx_handle_release(hq), epx_handle_release(hp);
  epx_buffer_destroy(normal), epx_buffer_destroy(ll);
  TU_FREE_ALL(q, qs, rq, rs, lq, ls, pq, ps, deq, deq_ll, out, out_ll, counts, offsets, count);
  ll_side_free(&me);
  return failures;
}

/* More tokens than the maximum on one rank: every rank refuses, the
 * refusing one naming the setting, the others the rank and the setting. */
static long long ll_oversize_rank(epx_comm_t comm, int32_t rank, int32_t W) {
  long long failures = 0;
  ll_case_t c = {8, 1, 4, 16, EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP,
                 EPX_COMBINE_PARTIALS_FLOAT32, 0, {4, 4, 4, 4, 4}};
  epx_buffer_config_t cfg = ll_config(&c, 1);
  epx_buffer_t buffer = NULL;
  epx_handle_t handle = NULL;
  static int32_t idx[LL_MAX_W][5];
  static float w[LL_MAX_W][5];
  _Alignas(16) static uint16_t x[LL_MAX_W][5 * 16], recv[LL_MAX_W][2 * LL_MAX_W * 4 * 16];
  int64_t T = rank == W - 1 ? 5 : 4;
  for (int t = 0; t < 5; t++) idx[rank][t] = t % 8, w[rank][t] = 1.0f;
  epx_routing_t routing = {T, 1, idx[rank], w[rank], NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_REQUIRE_OK(epx_buffer_create(comm, &cfg, &buffer));
  RANK_STATUS(epx_ll_dispatch(buffer, &routing, NULL, x[rank], recv[rank], NULL, &handle),
              EPX_ERROR_CAPACITY_EXCEEDED, "max_tokens_per_rank");
  /* The comm stays usable: a step within the maximum goes through. */
  routing.num_tokens = 4;
  RANK_OK(epx_ll_dispatch(buffer, &routing, NULL, x[rank], recv[rank], NULL, &handle));
  epx_handle_release(handle);
done:
  epx_buffer_destroy(buffer);
  return failures;
}

#ifndef LL_SCENE_ONLY
#include <pthread.h>
#include "clock.h"

/* A refused call on a low-latency buffer meets the peer's epx_ll_* call
 * (issue 38: rank 0 waited the whole timeout, "rank 1 did not arrive", and
 * the comm was dead for both): both fail at once, the messages name the ll
 * calls, and the comm stays usable. 2 ranks, comm timeout 5 s. */
static int refused_meets_ll_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world, (void)arg;
  int failures = 0;
  ll_case_t c = {8, 1, 4, 16, EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP,
                 EPX_COMBINE_PARTIALS_FLOAT32, 0, {4, 4, 4, 4, 4}};
  epx_buffer_config_t cfg = ll_config(&c, 1);
  epx_buffer_t buffer = NULL;
  epx_handle_t h = NULL, h2 = NULL, h3 = NULL;
  static int32_t idx[2][4];
  static float w[2][4];
  _Alignas(16) static uint16_t x[2][4 * 16], recv[2][8 * 4 * 16], out[2][4 * 16];
  for (int t = 0; t < 4; t++) idx[rank][t] = (t + rank) % 8, w[rank][t] = 1.0f;
  epx_routing_t routing = {4, 1, idx[rank], w[rank], NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_REQUIRE_OK(epx_buffer_create(comm, &cfg, &buffer));

  /* Rank 1 in epx_dispatch_layout (refused: the buffer serves epx_ll_*). */
  double t0 = tu_seconds();
  epx_status_t status = rank == 0
                            ? epx_ll_dispatch(buffer, &routing, NULL, x[rank], recv[rank], NULL, &h)
                            : epx_dispatch_layout(buffer, &routing, NULL, &h);
  double took = tu_seconds() - t0;
  RANK_EXPECT(status != EPX_SUCCESS && status != EPX_ERROR_TIMEOUT && took < 2.0,
              "layout vs ll_dispatch: %s after %.2f s: %s", epx_status_string(status), took,
              epx_last_error());
  if (rank == 0)
    RANK_EXPECT(tu_message_has("rank 0 in epx_ll_dispatch") &&
                    tu_message_has("rank 1 in epx_dispatch_layout"),
                "rank 0's message names the calls wrongly: %s", epx_last_error());
  /* The comm stays usable. */
  RANK_OK(epx_ll_dispatch(buffer, &routing, NULL, x[rank], recv[rank], NULL, &h));

  /* Rank 1 in epx_ll_combine with a bad argument while rank 0 dispatches. */
  t0 = tu_seconds();
  status = rank == 0 ? epx_ll_dispatch(buffer, &routing, NULL, x[rank], recv[rank], NULL, &h2)
                     : epx_ll_combine(buffer, h, NULL, out[rank]);
  took = tu_seconds() - t0;
  RANK_EXPECT(status != EPX_SUCCESS && status != EPX_ERROR_TIMEOUT && took < 2.0,
              "ll_combine vs ll_dispatch: %s after %.2f s: %s", epx_status_string(status), took,
              epx_last_error());
  RANK_EXPECT(tu_message_has("rank 0 in epx_ll_dispatch") &&
                  tu_message_has("rank 1 in epx_ll_combine") && !tu_message_has("epx_combine"),
              "the message names the calls wrongly: %s", epx_last_error());
  /* Still usable: the combine of the first step, then a new step. */
  RANK_OK(epx_ll_combine(buffer, h, recv[rank], out[rank]));
  RANK_OK(epx_ll_dispatch(buffer, &routing, NULL, x[rank], recv[rank], NULL, &h3));
  RANK_OK(epx_ll_combine(buffer, h3, recv[rank], out[rank]));
done:
  epx_handle_release(h), epx_handle_release(h2), epx_handle_release(h3);
  epx_buffer_destroy(buffer);
  return failures ? 1 : 0;
}

static void test_refused_call_meets_ll_threads(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(2, 5.0, refused_meets_ll_rank_main, NULL), 0);
}

static int case_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  return ll_case_rank(comm, rank, world, arg) ? 1 : 0;
}

static void test_parity_threads(void **state) {
  (void)state;
  static ll_case_t cases[64];
  int n = ll_cases(cases);
  static const int32_t worlds[] = {1, 2, 4};
  for (int wi = 0; wi < 3; wi++)
    for (int i = 0; i < n; i++) {
      if (cases[i].E % worlds[wi]) continue;
      int failed = tu_run_ranks(worlds[wi], 20.0, case_rank_main, &cases[i]);
      if (failed) {
        char d[256];
        ll_describe(&cases[i], d, sizeof d);
        fail_msg("W=%d case %d [%s]: %d rank(s) failed", worlds[wi], i, d, failed);
      }
    }
}

/* The hierarchical exchange: 4 thread ranks posing as 2 nodes of 2. */
typedef struct {
  epx_local_world_t world;
  const ll_case_t *c;
  long long failures[4];
} hier_run_t;

static hier_run_t g_hier;

static void *hier_rank_main(void *arg) {
  int32_t rank = (int32_t)(intptr_t)arg;
  epx_comm_t comm = NULL;
  if (epx_comm_create_local(g_hier.world, rank, &comm) != EPX_SUCCESS) {
    g_hier.failures[rank] = 1;
    return NULL;
  }
  g_hier.failures[rank] = ll_case_rank(comm, rank, 4, g_hier.c);
  if (epx_comm_destroy(comm) != EPX_SUCCESS) g_hier.failures[rank]++;
  return NULL;
}

static void test_hierarchical_threads(void **state) {
  (void)state;
  static ll_case_t cases[64];
  int n = ll_cases(cases);
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = 20.0, cc.ranks_per_node = 2;
  for (int i = 0; i < n; i++) {
    ll_case_t c = cases[i];
    c.exchange = EPX_EXCHANGE_HIERARCHICAL;
    g_hier.c = &c;
    EXPECT_OK(epx_local_world_create(4, &cc, &g_hier.world));
    pthread_t threads[4];
    for (intptr_t r = 0; r < 4; r++) assert_int_equal(pthread_create(&threads[r], NULL, hier_rank_main, (void *)r), 0);
    for (int r = 0; r < 4; r++) pthread_join(threads[r], NULL);
    EXPECT_OK(epx_local_world_destroy(g_hier.world));
    long long failed = g_hier.failures[0] + g_hier.failures[1] + g_hier.failures[2] + g_hier.failures[3];
    if (failed) {
      char d[256];
      ll_describe(&c, d, sizeof d);
      fail_msg("case %d [%s]: %lld failure(s)", i, d, failed);
    }
  }
}

static int oversize_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)arg;
  return ll_oversize_rank(comm, rank, world) ? 1 : 0;
}

static int fp8_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)arg;
  return ll_fp8_rank(comm, rank, world) ? 1 : 0;
}

static void test_fp8_threads(void **state) {
  (void)state;
  for (int32_t W = 1; W <= 4; W *= 2) assert_int_equal(tu_run_ranks(W, 20.0, fp8_rank_main, NULL), 0);
}

static void test_oversize_threads(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(1, 20.0, oversize_rank_main, NULL), 0);
  assert_int_equal(tu_run_ranks(2, 20.0, oversize_rank_main, NULL), 0);
  assert_int_equal(tu_run_ranks(4, 20.0, oversize_rank_main, NULL), 0);
}

/* A self buffer of the mode and a step of T tokens on it (E 8, K 2, H 16). */
typedef struct {
  epx_comm_t comm;
  epx_buffer_t buffer;
  int32_t idx[300 * 2];
  float w[300 * 2];
  _Alignas(16) uint16_t x[300 * 16], recv[8 * 256 * 16], out[300 * 16];
} self_t;

static void self_open(self_t *s, epx_layout_t layout) {
  memset(s, 0, sizeof *s);
  EXPECT_OK(epx_comm_create_self(&s->comm));
  epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
  cfg.dtype = EPX_BFLOAT16, cfg.hidden = 16, cfg.num_experts = 8, cfg.max_top_k = 2, cfg.layout = layout;
  cfg.low_latency = 1;
  EXPECT_OK(epx_buffer_create(s->comm, &cfg, &s->buffer));
  for (int t = 0; t < 300; t++) s->idx[2 * t] = t % 8, s->idx[2 * t + 1] = (t + 3) % 8, s->w[2 * t] = s->w[2 * t + 1] = 0.5f;
}

static void self_close(self_t *s) {
  EXPECT_OK(epx_buffer_destroy(s->buffer));
  EXPECT_OK(epx_comm_destroy(s->comm));
}

static void test_default_shape(void **state) {
  (void)state;
  self_t *s = tu_alloc(sizeof *s);
  self_open(s, EPX_LAYOUT_EXPERT_MAJOR);
  int64_t max_tokens = 0, rows = 0;
  EXPECT_OK(epx_buffer_max_tokens(s->buffer, &max_tokens));
  assert_int_equal(max_tokens, EPX_LL_DEFAULT_MAX_TOKENS);
  EXPECT_OK(epx_buffer_max_recv_rows(s->buffer, &rows));
  assert_int_equal(rows, 8 * 256); /* E_local * W * max_tokens */
  epx_routing_t routing = {257, 2, s->idx, s->w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_STATUS(epx_ll_dispatch(s->buffer, &routing, NULL, s->x, s->recv, NULL, &h), EPX_ERROR_CAPACITY_EXCEEDED,
                "max_tokens_per_rank 256");
  int32_t count = 257;
  routing.num_tokens = 256;
  EXPECT_STATUS(epx_ll_dispatch(s->buffer, &routing, &count, s->x, s->recv, NULL, &h), EPX_ERROR_INVALID_ARGUMENT,
                "*num_tokens is 257");
  routing.num_tokens = 300;
  count = 10;
  EXPECT_STATUS(epx_ll_dispatch(s->buffer, &routing, &count, s->x, s->recv, NULL, &h), EPX_ERROR_CAPACITY_EXCEEDED,
                "max_tokens_per_rank 256");
  self_close(s);
  tu_free(s);
}

static void test_refusals(void **state) {
  (void)state;
  self_t *s = tu_alloc(sizeof *s);
  self_open(s, EPX_LAYOUT_EXPERT_MAJOR);
  epx_routing_t routing = {7, 2, s->idx, s->w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL, normal = NULL;
  _Alignas(16) uint16_t grad[7 * 16] = {0};
  float grad_w[7 * 2];
  /* The normal calls and every backward pass: unsupported, naming the mode. */
  EXPECT_STATUS(epx_dispatch_layout(s->buffer, &routing, NULL, &normal), EPX_ERROR_UNSUPPORTED, "low_latency");
  EXPECT_OK(epx_ll_dispatch_send(s->buffer, &routing, NULL, s->x, s->recv, NULL, &h));
  EXPECT_STATUS(epx_ll_combine(s->buffer, h, s->recv, s->out), EPX_ERROR_INVALID_ARGUMENT,
                "epx_ll_dispatch_send is not completed");
  EXPECT_OK(epx_ll_complete(s->buffer, h));
  EXPECT_STATUS(epx_ll_complete(s->buffer, h), EPX_ERROR_INVALID_ARGUMENT, "nothing is pending");
  EXPECT_STATUS(epx_combine_backward(s->buffer, h, grad, s->recv, s->recv, grad_w), EPX_ERROR_UNSUPPORTED,
                "no backward pass");
  EXPECT_STATUS(epx_dispatch_backward(s->buffer, h, s->recv, grad, NULL, NULL), EPX_ERROR_UNSUPPORTED,
                "low-latency decode mode");
  EXPECT_STATUS(epx_weights_backward(s->buffer, h, grad_w, grad_w), EPX_ERROR_UNSUPPORTED, "no backward pass");
  EXPECT_STATUS(epx_combine(s->buffer, h, s->recv, s->out), EPX_ERROR_UNSUPPORTED, "epx_ll_combine");
  EXPECT_STATUS(epx_dispatch(s->buffer, h, s->x, s->recv, 8 * 256), EPX_ERROR_UNSUPPORTED, "epx_ll_dispatch");
  EXPECT_OK(epx_ll_combine_send(s->buffer, h, s->recv, s->out));
  EXPECT_STATUS(epx_ll_combine_send(s->buffer, h, s->recv, s->out), EPX_ERROR_INVALID_ARGUMENT,
                "epx_ll_combine_send is not completed");
  EXPECT_OK(epx_ll_complete(s->buffer, h));
  EXPECT_STATUS(epx_ll_combine(s->buffer, h, s->out, s->out), EPX_ERROR_INVALID_ARGUMENT, "aliases");
  routing.weighting = EPX_WEIGHTS_IN_DISPATCH;
  epx_handle_t other = NULL;
  EXPECT_STATUS(epx_ll_dispatch(s->buffer, &routing, NULL, s->x, s->recv, NULL, &other), EPX_ERROR_UNSUPPORTED,
                "EPX_WEIGHTS_IN_DISPATCH");
  routing.weighting = EPX_WEIGHTS_IN_COMBINE;
  EXPECT_STATUS(epx_ll_dispatch(s->buffer, &routing, NULL, s->x, s->x, NULL, &other), EPX_ERROR_INVALID_ARGUMENT,
                "recv_x aliases x");
  EXPECT_OK(epx_handle_release(h));
  self_close(s);
  tu_free(s);
}

/* Configs the mode does not serve, and the normal buffer refusing the
 * mode's calls. */
static void test_configs(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  epx_buffer_t buffer = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
  cfg.dtype = EPX_BFLOAT16, cfg.hidden = 16, cfg.num_experts = 8, cfg.max_top_k = 2, cfg.low_latency = 1;
  cfg.layout = EPX_LAYOUT_CAPACITY, cfg.capacity = 4;
  EXPECT_STATUS(epx_buffer_create(comm, &cfg, &buffer), EPX_ERROR_UNSUPPORTED, "EPX_LAYOUT_EXPERT_MAJOR");
  cfg.layout = EPX_LAYOUT_EXPERT_MAJOR, cfg.capacity = 0, cfg.expert_alignment = 4;
  EXPECT_STATUS(epx_buffer_create(comm, &cfg, &buffer), EPX_ERROR_INVALID_ARGUMENT, "config.expert_alignment is 4");
  cfg.expert_alignment = 1, cfg.low_latency = 2;
  EXPECT_STATUS(epx_buffer_create(comm, &cfg, &buffer), EPX_ERROR_INVALID_ARGUMENT, "config.low_latency is 2");
  /* CUDA: expert-major in this version (a build without CUDA refuses the
   * device itself). */
  cfg.low_latency = 1, cfg.device = EPX_DEVICE_CUDA, cfg.layout = EPX_LAYOUT_RANK_MAJOR;
  EXPECT_STATUS(epx_buffer_create(comm, &cfg, &buffer), EPX_ERROR_UNSUPPORTED, NULL);
  cfg.device = EPX_DEVICE_CPU, cfg.layout = EPX_LAYOUT_EXPERT_MAJOR, cfg.max_tokens_per_rank = (int64_t)1 << 30;
  EXPECT_STATUS(epx_buffer_create(comm, &cfg, &buffer), EPX_ERROR_INVALID_ARGUMENT, "2^31 - 1");
  cfg.max_tokens_per_rank = 16, cfg.low_latency = 0;
  EXPECT_OK(epx_buffer_create(comm, &cfg, &buffer));
  int32_t idx[2] = {0, 1};
  float w[2] = {1, 1};
  _Alignas(16) uint16_t x[16], recv[8 * 16 * 16];
  epx_routing_t routing = {1, 2, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_STATUS(epx_ll_dispatch(buffer, &routing, NULL, x, recv, NULL, &h), EPX_ERROR_INVALID_ARGUMENT,
                "not a low-latency buffer");
  EXPECT_OK(epx_buffer_destroy(buffer));
  EXPECT_OK(epx_comm_destroy(comm));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_default_shape), cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_configs),       cmocka_unit_test(test_oversize_threads),
      cmocka_unit_test(test_parity_threads), cmocka_unit_test(test_hierarchical_threads),
      cmocka_unit_test(test_fp8_threads), cmocka_unit_test(test_refused_call_meets_ll_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
