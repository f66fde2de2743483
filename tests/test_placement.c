/* Expert placement and replicas (epx.h, "Expert placement and replicas"):
 * the contiguous map given explicitly is the default bit for bit; a
 * replicated, a permuted and a caller-routed placement move every route to
 * the physical expert the rule names, on its rank, and dispatch, combine and
 * both backward passes equal a plain-C reference exactly (small-integer
 * payloads and dyadic weights make every float32 sum exact) on the dedup,
 * collective and hierarchical exchanges, which are bit-identical with
 * random bf16 payloads too; cached dispatch, recorder replays, the
 * low-latency calls and fp8 dispatch are unchanged by replicas; load
 * counts, the replicas' gradient sum and the weight move are exact;
 * mismatched and bad placements are refused naming the field; the planner
 * balances (skew bound), serves every logical expert and is deterministic.
 *
 * The scene and the rank functions (up to the cmocka part) are shared with
 * mpi_placement.c, which includes this file with PL_SCENE_ONLY defined. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/placement.h"
#include "testutil.h"
#include "buffer_config.h"

#define W_MAX 4
#define E 16
#define K 4
#define H 16
#define T_MAX 40

/* ------------------------------------------------------------------------ */
/* Ranks as threads, posed as nodes of `per_node` ranks                      */
/* ------------------------------------------------------------------------ */

#ifndef PL_SCENE_ONLY
static int run_ranks(int32_t W, int32_t per_node, tu_rank_fn fn, void *arg) {
  return tu_run_nodes(W, per_node, 30.0, fn, arg);
}
#endif

/* ------------------------------------------------------------------------ */
/* The scene: every rank's routing and input, the same on every rank         */
/* ------------------------------------------------------------------------ */

typedef struct {
  int32_t W;
  int64_t T[W_MAX];
  int32_t idx[W_MAX][T_MAX * K]; /* logical ids (or physical ones, caller rule) */
  int32_t phys[W_MAX][T_MAX * K];/* the physical expert of each route */
  float w[W_MAX][T_MAX * K];     /* dyadic */
  _Alignas(64) float x[W_MAX][T_MAX * H]; /* small integers */
  /* the placement under test */
  int32_t P;
  int32_t p2l[64], prank[64];
  int use_prank;
  epx_replica_rule_t rule;
  int null_placement;
  /* what the rank function runs */
  epx_exchange_t exchange;
  epx_layout_t layout;
  epx_dtype_t dtype;
  uint64_t out_hash[3][W_MAX];
  int slot;
} scene_t;

static epx_placement_t placement_of(const scene_t *s) {
  return (epx_placement_t){s->P, s->p2l, s->use_prank ? s->prank : NULL, s->rule};
}

/* Hot experts: expert e's popularity ~ 1/(1+e)^1.2 with a shuffle. */
static void make_routing(scene_t *s, uint64_t seed) {
  tu_rng_t rng = {seed};
  for (int32_t r = 0; r < s->W; r++) {
    s->T[r] = 8 + tu_below(&rng, T_MAX - 8);
    tu_random_routing(&rng, s->T[r], E, K, 1.2, s->idx[r], s->w[r]);
    for (int64_t i = 0; i < s->T[r] * K; i++) {
      if (tu_below(&rng, 10) == 0) s->idx[r][i] = -1;
      s->w[r][i] = (float)(1 + tu_below(&rng, 4)) * 0.25f;
    }
    for (int64_t i = 0; i < s->T[r] * H; i++) s->x[r][i] = (float)(tu_below(&rng, 9) - 4);
  }
}

/* The physical experts the rule picks (or the caller's), from the table. */
static void map_routing(scene_t *s, const epx_placement_table_t *t) {
  for (int32_t r = 0; r < s->W; r++) epx_placement_map_routing(t, r, s->T[r], K, s->idx[r], s->phys[r]);
}

/* A replicated placement of E + 8 physical experts planned from the
 * scene's load. */
static void plan_replicated(scene_t *s) {
  double load[E] = {0};
  for (int32_t r = 0; r < s->W; r++)
    for (int64_t i = 0; i < s->T[r] * K; i++)
      if (s->idx[r][i] >= 0) load[s->idx[r][i]] += 1;
  s->P = E + 8;
  s->use_prank = 0, s->rule = EPX_REPLICA_ROUND_ROBIN, s->null_placement = 0;
  if (epx_placement_plan(load, E, s->P, s->W, 1, 1, s->p2l) != EPX_SUCCESS) {
    fprintf(stderr, "epx_placement_plan: %s\n", epx_last_error());
    abort();
  }
}

/* A permuted placement without replicas, ranks given explicitly: physical
 * p serves logical (5p + 3) mod E and sits on rank (p * 3 + 1) mod W, ... */
static void plan_permuted(scene_t *s) {
  s->P = E, s->use_prank = 1, s->rule = EPX_REPLICA_ROUND_ROBIN, s->null_placement = 0;
  for (int32_t p = 0; p < E; p++) s->p2l[p] = (5 * p + 3) % E, s->prank[p] = p % s->W;
}

static epx_buffer_t make_buffer(epx_comm_t comm, const scene_t *s, const epx_placement_t *pl, int low_latency) {
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, s->dtype, H, E, K, T_MAX);
  c.exchange = s->exchange, c.layout = s->layout, c.placement = pl, c.low_latency = low_latency;
  epx_buffer_t b = NULL;
  if (epx_buffer_create(comm, &c, &b) != EPX_SUCCESS) fprintf(stderr, "epx_buffer_create: %s\n", epx_last_error());
  return b;
}

/* ------------------------------------------------------------------------ */
/* Exact checks against the plain-C reference                                */
/* ------------------------------------------------------------------------ */

/* The expert: row * (1 + the logical expert of its physical one). */
static float expert_scale(const epx_placement_table_t *t, int32_t physical) {
  return (float)(1 + t->logical_of[physical]);
}

static int exact_rank(epx_comm_t comm, int32_t rank, int32_t W, void *arg) {
  scene_t *s = arg;
  int failures = 0;
  epx_placement_t pl = placement_of(s);
  epx_placement_table_t *t = NULL;
  epx_handle_t h = NULL;
  float *recv = NULL, *eo = NULL, *grad_recv = NULL;
  epx_buffer_t b = make_buffer(comm, s, s->null_placement ? NULL : &pl, 0);
  RANK_REQUIRE(b, "buffer");
  RANK_REQUIRE_OK(epx_placement_table_new("test", "placement", s->null_placement ? NULL : &pl, E, W, &t));
  int64_t T = s->T[rank], N = 0;
  epx_routing_t routing = {T, K, s->idx[rank], s->w[rank], NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_REQUIRE_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  RANK_REQUIRE_OK(epx_handle_recv_rows(h, &N));
  recv = tu_alloc(sizeof(float) * (size_t)(N + 1) * H);
  eo = tu_alloc(sizeof(float) * (size_t)(N + 1) * H);
  grad_recv = tu_alloc(sizeof(float) * (size_t)(N + 1) * H);
  int32_t *rx = tu_alloc(sizeof(int32_t) * (size_t)(N + 1)), *src = tu_alloc(sizeof(int32_t) * (size_t)(N + 1));
  int32_t *tok = tu_alloc(sizeof(int32_t) * (size_t)(N + 1));
  RANK_REQUIRE_OK(epx_dispatch(b, h, s->x[rank], recv, N));
  RANK_REQUIRE_OK(epx_handle_recv_routing(h, rx, NULL));
  RANK_REQUIRE_OK(epx_handle_recv_source(h, src, tok));
  /* Every row: a physical expert of this rank, the one its route picked,
   * carrying its source's token. */
  int64_t rows = 0, expected_rows = 0;
  for (int64_t i = 0; i < N; i++) {
    if (rx[i] < 0) continue;
    rows++;
    RANK_EXPECT(t->rank_of[rx[i]] == rank, "row %lld: physical %d is not on rank %d", (long long)i, rx[i], rank);
    int found = 0;
    for (int32_t k = 0; k < K; k++) found |= s->phys[src[i]][tok[i] * K + k] == rx[i];
    RANK_EXPECT(found, "row %lld: physical %d is not a route of (%d, %d)", (long long)i, rx[i], src[i], tok[i]);
    RANK_EXPECT(!memcmp(recv + i * H, s->x[src[i]] + (size_t)tok[i] * H, sizeof(float) * H), "row %lld payload",
                (long long)i);
    for (int32_t j = 0; j < H; j++) eo[i * H + j] = recv[i * H + j] * expert_scale(t, rx[i]);
  }
  for (int32_t r = 0; r < W; r++)
    for (int64_t i = 0; i < s->T[r] * K; i++) expected_rows += s->phys[r][i] >= 0 && t->rank_of[s->phys[r][i]] == rank;
  RANK_EXPECT(rows == expected_rows, "rows %lld, expected %lld", (long long)rows, (long long)expected_rows);
  /* combine: out[t] = sum_k w * (1 + e_k) * x[t], exact */
  _Alignas(16) float out[T_MAX * H], gx[T_MAX * H], gw[T_MAX * K];
  RANK_REQUIRE_OK(epx_combine(b, h, eo, out));
  for (int64_t i = 0; i < T; i++)
    for (int32_t j = 0; j < H; j++) {
      float want = 0, want_g = 0;
      for (int32_t k = 0; k < K; k++) {
        int32_t p = s->phys[rank][i * K + k];
        if (p < 0) continue;
        want += s->w[rank][i * K + k] * expert_scale(t, p) * s->x[rank][i * H + j];
        want_g += expert_scale(t, p) * s->x[rank][i * H + j];
      }
      RANK_EXPECT(out[i * H + j] == want, "out[%lld][%d] %g, want %g", (long long)i, j, out[i * H + j], want);
      gx[i * H + j] = want_g;
    }
  /* dispatch_backward of grad_recv = expert_out: the copies' sum, exact */
  _Alignas(16) float grad_x[T_MAX * H];
  RANK_REQUIRE_OK(epx_dispatch_backward(b, h, eo, grad_x, NULL, NULL));
  RANK_EXPECT(!memcmp(grad_x, gx, sizeof(float) * (size_t)(T * H)), "dispatch_backward differs from the reference");
  /* combine_backward with grad_out = x: rows w * x, grad_w = <x, (1+e) x> */
  RANK_REQUIRE_OK(epx_combine_backward(b, h, s->x[rank], eo, grad_recv, gw));
  for (int64_t i = 0; i < T; i++)
    for (int32_t k = 0; k < K; k++) {
      int32_t p = s->phys[rank][i * K + k];
      float want = 0;
      for (int32_t j = 0; j < H && p >= 0; j++) want += s->x[rank][i * H + j] * expert_scale(t, p) * s->x[rank][i * H + j];
      RANK_EXPECT(gw[i * K + k] == want, "grad_w[%lld][%d] %g, want %g", (long long)i, k, gw[i * K + k], want);
    }
  for (int64_t i = 0; i < N; i++)
    if (rx[i] >= 0) {
      float wt = 0;
      for (int32_t k = 0; k < K; k++)
        if (s->phys[src[i]][tok[i] * K + k] == rx[i]) wt = s->w[src[i]][tok[i] * K + k];
      for (int32_t j = 0; j < H; j++)
        RANK_EXPECT(grad_recv[i * H + j] == wt * s->x[src[i]][(size_t)tok[i] * H + j], "grad_expert_out row %lld",
                    (long long)i);
    }
  /* the load counts: this rank's routes per logical expert */
  int64_t load[E], want_load[E] = {0};
  for (int64_t i = 0; i < T * K; i++)
    if (s->idx[rank][i] >= 0) want_load[epx_placement_routing_logical(t, s->idx[rank][i])]++;
  RANK_OK(epx_buffer_expert_load(b, load, 1));
  RANK_EXPECT(!memcmp(load, want_load, sizeof load), "expert load counts");
  RANK_OK(epx_buffer_expert_load(b, load, 0));
  for (int32_t e = 0; e < E; e++) RANK_EXPECT(load[e] == 0, "load after reset");
  tu_free(rx), tu_free(src), tu_free(tok);
done:
  if (h) epx_handle_release(h);
  epx_buffer_destroy(b);
  epx_placement_table_free(t);
  tu_free(recv), tu_free(eo), tu_free(grad_recv);
  return failures;
}

/* The physical routing of the scene's placement. */
static void map_scene(scene_t *s) {
  epx_placement_t pl = placement_of(s);
  epx_placement_table_t *t = NULL;
  if (epx_placement_table_new("test", "placement", s->null_placement ? NULL : &pl, E, s->W, &t) != EPX_SUCCESS) abort();
  map_routing(s, t);
  epx_placement_table_free(t);
}

#ifndef PL_SCENE_ONLY
static void run_exact(scene_t *s, const char *what) {
  static const epx_exchange_t exchanges[] = {EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_COLLECTIVE, EPX_EXCHANGE_HIERARCHICAL};
  map_scene(s);
  s->dtype = EPX_FLOAT32, s->layout = EPX_LAYOUT_EXPERT_MAJOR;
  for (int x = 0; x < 3; x++) {
    s->exchange = exchanges[x];
    int failed = run_ranks(s->W, 2, exact_rank, s);
    if (failed) fprintf(stderr, "%s, exchange %d: %d rank(s) failed\n", what, x, failed);
    assert_int_equal(failed, 0);
  }
}

static void test_exact_contiguous(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4;
  make_routing(s, 11);
  s->null_placement = 1, s->P = E;
  run_exact(s, "contiguous");
  free(s);
}

static void test_exact_replicated(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4;
  for (uint64_t seed = 1; seed <= 3; seed++) {
    make_routing(s, seed);
    plan_replicated(s);
    run_exact(s, "replicated");
  }
  free(s);
}

static void test_exact_permuted(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4;
  make_routing(s, 5);
  plan_permuted(s);
  run_exact(s, "permuted");
  free(s);
}

/* Caller-given physical ids: each route names a replica of its expert. */
static void test_exact_caller_ids(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4;
  make_routing(s, 7);
  plan_replicated(s);
  s->rule = EPX_REPLICA_CALLER;
  epx_placement_t pl = placement_of(s);
  epx_placement_table_t *t = NULL;
  assert_int_equal(epx_placement_table_new("test", "placement", &pl, E, s->W, &t), EPX_SUCCESS);
  tu_rng_t rng = {99};
  for (int32_t r = 0; r < s->W; r++)
    for (int64_t i = 0; i < s->T[r] * K; i++) {
      int32_t e = s->idx[r][i];
      if (e < 0) continue;
      int32_t n = t->replica_first[e + 1] - t->replica_first[e];
      s->idx[r][i] = t->replicas[t->replica_first[e] + tu_below(&rng, n)];
    }
  epx_placement_table_free(t);
  run_exact(s, "caller ids");
  free(s);
}

#endif

/* ------------------------------------------------------------------------ */
/* Bit-identical exchanges with random bf16 payloads; the default map        */
/* ------------------------------------------------------------------------ */

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
  return h;
}

/* Random bf16 payloads and weights; the hash of combine's, both backward
 * passes' and a cached dispatch's outputs per rank in s->out_hash[slot]. */
static int bits_rank(epx_comm_t comm, int32_t rank, int32_t W, void *arg) {
  scene_t *s = arg;
  int failures = 0;
  (void)W;
  epx_placement_t pl = placement_of(s);
  epx_buffer_t b = make_buffer(comm, s, s->null_placement ? NULL : &pl, 0);
  epx_handle_t h = NULL;
  epx_recorder_t rec = NULL;
  RANK_REQUIRE(b, "buffer");
  int64_t T = s->T[rank], N, max_rows;
  tu_rng_t rng = {1000 + (uint64_t)rank};
  _Alignas(16) uint16_t x[T_MAX * H], out[T_MAX * H], gx[T_MAX * H];
  float w[T_MAX * K], gw[T_MAX * K];
  tu_fill(&rng, EPX_BFLOAT16, x, T * H);
  for (int64_t i = 0; i < T * K; i++) w[i] = 0.1f + (float)tu_uniform(&rng);
  RANK_REQUIRE_OK(epx_recorder_create(1, &rec));
  epx_routing_t routing = {T, K, s->idx[rank], w, NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_REQUIRE_OK(epx_dispatch_layout(b, &routing, rec, &h));
  RANK_REQUIRE_OK(epx_buffer_max_recv_rows(b, &max_rows));
  RANK_REQUIRE_OK(epx_handle_recv_rows(h, &N));
  uint16_t *recv = tu_alloc(2 * (size_t)(max_rows + 1) * H), *eo = tu_alloc(2 * (size_t)(max_rows + 1) * H);
  uint16_t *grecv = tu_alloc(2 * (size_t)(max_rows + 1) * H), *recv2 = tu_alloc(2 * (size_t)(max_rows + 1) * H);
  RANK_REQUIRE_OK(epx_dispatch(b, h, x, recv, N));
  tu_fill(&rng, EPX_BFLOAT16, eo, N * H);
  RANK_REQUIRE_OK(epx_combine(b, h, eo, out));
  RANK_REQUIRE_OK(epx_dispatch_backward(b, h, eo, gx, NULL, NULL));
  RANK_REQUIRE_OK(epx_combine_backward(b, h, x, eo, grecv, gw));
  /* a recorder's replay and the cached dispatch it gives: the same rows */
  epx_handle_t again = NULL;
  RANK_REQUIRE_OK(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
  RANK_REQUIRE_OK(epx_dispatch_layout(b, &routing, rec, &again));
  RANK_REQUIRE_OK(epx_dispatch(b, again, x, recv2, N));
  RANK_EXPECT(!memcmp(recv, recv2, 2 * (size_t)N * H), "cached dispatch after a replay differs");
  epx_handle_release(again);
  uint64_t hash = fnv(1469598103934665603ull, out, 2 * (size_t)T * H);
  hash = fnv(hash, gx, 2 * (size_t)T * H);
  hash = fnv(hash, gw, sizeof(float) * (size_t)T * K);
  s->out_hash[s->slot][rank] = hash;
  tu_free(recv), tu_free(eo), tu_free(grecv), tu_free(recv2);
done:
  if (h) epx_handle_release(h);
  epx_recorder_destroy(rec);
  epx_buffer_destroy(b);
  return failures;
}

#ifndef PL_SCENE_ONLY
static void test_bits_across_exchanges(void **state) {
  (void)state;
  static const epx_exchange_t exchanges[] = {EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_COLLECTIVE, EPX_EXCHANGE_HIERARCHICAL};
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4, s->dtype = EPX_BFLOAT16, s->layout = EPX_LAYOUT_EXPERT_MAJOR;
  make_routing(s, 21);
  plan_replicated(s);
  for (s->slot = 0; s->slot < 3; s->slot++) {
    s->exchange = exchanges[s->slot];
    assert_int_equal(run_ranks(s->W, 2, bits_rank, s), 0);
  }
  for (int32_t r = 0; r < s->W; r++) {
    assert_true(s->out_hash[0][r] == s->out_hash[1][r]);
    assert_true(s->out_hash[0][r] == s->out_hash[2][r]);
  }
  free(s);
}

/* NULL and the contiguous map given explicitly: the same bits. */
static void test_default_is_contiguous(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4, s->dtype = EPX_BFLOAT16, s->layout = EPX_LAYOUT_EXPERT_MAJOR, s->exchange = EPX_EXCHANGE_DEDUP;
  make_routing(s, 31);
  s->slot = 0, s->null_placement = 1;
  assert_int_equal(run_ranks(s->W, 2, bits_rank, s), 0);
  s->slot = 1, s->null_placement = 0, s->P = E, s->use_prank = 0, s->rule = EPX_REPLICA_ROUND_ROBIN;
  for (int32_t p = 0; p < E; p++) s->p2l[p] = p;
  assert_int_equal(run_ranks(s->W, 2, bits_rank, s), 0);
  for (int32_t r = 0; r < s->W; r++) assert_true(s->out_hash[0][r] == s->out_hash[1][r]);
  free(s);
}

#endif

/* ------------------------------------------------------------------------ */
/* Low-latency and fp8 with replicas                                         */
/* ------------------------------------------------------------------------ */

/* The low-latency dispatch's rows per local expert equal the normal
 * layout's, in order; its combine equals the normal combine; fp8 dispatch
 * carries the normal rows, quantized. */
static int ll_fp8_rank(epx_comm_t comm, int32_t rank, int32_t W, void *arg) {
  scene_t *s = arg;
  int failures = 0;
  (void)W;
  epx_placement_t pl = placement_of(s);
  epx_buffer_t b = make_buffer(comm, s, &pl, 0), ll = make_buffer(comm, s, &pl, 1), fb = NULL;
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_BFLOAT16, 128, E, K, T_MAX);
  c.placement = &pl, c.fp8_format = EPX_FP8_E4M3_F32_128;
  RANK_OK(epx_buffer_create(comm, &c, &fb));
  epx_handle_t h = NULL, hl = NULL, hf = NULL;
  RANK_REQUIRE(b && ll && fb, "buffers");
  int64_t T = s->T[rank], N;
  tu_rng_t rng = {77 + (uint64_t)rank};
  _Alignas(16) uint16_t x[T_MAX * H], out[T_MAX * H], out_ll[T_MAX * H];
  float w[T_MAX * K];
  tu_fill(&rng, EPX_BFLOAT16, x, T * H);
  for (int64_t i = 0; i < T * K; i++) w[i] = 0.1f + (float)tu_uniform(&rng);
  epx_routing_t routing = {T, K, s->idx[rank], w, NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_REQUIRE_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  RANK_REQUIRE_OK(epx_handle_recv_rows(h, &N));
  int32_t El = s->P / s->W;
  int64_t counts[64], offsets[65];
  uint16_t *recv = tu_alloc(2 * (size_t)(N + 1) * H), *eo = tu_alloc(2 * (size_t)(N + 1) * H);
  uint16_t *recv_ll = tu_alloc(2 * (size_t)El * s->W * T_MAX * H), *eo_ll = tu_alloc(2 * (size_t)El * s->W * T_MAX * H);
  int32_t recv_count[64];
  RANK_REQUIRE_OK(epx_dispatch(b, h, x, recv, N));
  RANK_REQUIRE_OK(epx_handle_expert_counts(h, counts, offsets));
  tu_fill(&rng, EPX_BFLOAT16, eo, N * H);
  RANK_REQUIRE_OK(epx_combine(b, h, eo, out));
  int32_t tokens = (int32_t)T;
  RANK_REQUIRE_OK(epx_ll_dispatch(ll, &routing, &tokens, x, recv_ll, recv_count, &hl));
  for (int32_t e = 0; e < El; e++) {
    RANK_EXPECT(recv_count[e] == counts[e], "ll expert %d: %d rows, normal %lld", e, recv_count[e], (long long)counts[e]);
    size_t base = (size_t)e * s->W * T_MAX;
    RANK_EXPECT(!memcmp(recv_ll + base * H, recv + offsets[e] * H, 2 * (size_t)counts[e] * H), "ll expert %d rows", e);
    memcpy(eo_ll + base * H, eo + offsets[e] * H, 2 * (size_t)counts[e] * H);
  }
  RANK_REQUIRE_OK(epx_ll_combine(ll, hl, eo_ll, out_ll));
  RANK_EXPECT(!memcmp(out, out_ll, 2 * (size_t)T * H), "ll combine differs from combine");
  /* fp8: H = 128 rows of the same routing */
  uint16_t *x128 = tu_alloc(2 * (size_t)T_MAX * 128), *r128 = NULL;
  uint8_t *q = NULL, *q_ref = NULL;
  float *sc = NULL, *sc_ref = NULL;
  int64_t Nf;
  tu_fill(&rng, EPX_BFLOAT16, x128, T * 128);
  RANK_REQUIRE_OK(epx_dispatch_layout(fb, &routing, NULL, &hf));
  RANK_REQUIRE_OK(epx_handle_recv_rows(hf, &Nf));
  r128 = tu_alloc(2 * (size_t)(Nf + 1) * 128), q = tu_alloc((size_t)(Nf + 1) * 128), q_ref = tu_alloc((size_t)(Nf + 1) * 128);
  sc = tu_alloc(sizeof(float) * (size_t)(Nf + 1)), sc_ref = tu_alloc(sizeof(float) * (size_t)(Nf + 1));
  RANK_REQUIRE_OK(epx_dispatch(fb, hf, x128, r128, Nf));
  RANK_REQUIRE_OK(epx_dispatch_quantize(fb, hf, x128, q, sc, Nf));
  RANK_REQUIRE_OK(epx_quantize(EPX_FP8_E4M3_F32_128, EPX_BFLOAT16, Nf, 128, r128, q_ref, sc_ref));
  RANK_EXPECT(!memcmp(q, q_ref, (size_t)Nf * 128) && !memcmp(sc, sc_ref, sizeof(float) * (size_t)Nf),
              "fp8 dispatch is not the quantized dispatch");
  tu_free(x128), tu_free(r128), tu_free(q), tu_free(q_ref), tu_free(sc), tu_free(sc_ref);
  tu_free(recv), tu_free(eo), tu_free(recv_ll), tu_free(eo_ll);
done:
  if (h) epx_handle_release(h);
  if (hl) epx_handle_release(hl);
  if (hf) epx_handle_release(hf);
  epx_buffer_destroy(b);
  epx_buffer_destroy(ll);
  epx_buffer_destroy(fb);
  return failures;
}

#ifndef PL_SCENE_ONLY
static void test_ll_and_fp8(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4, s->dtype = EPX_BFLOAT16, s->layout = EPX_LAYOUT_EXPERT_MAJOR, s->exchange = EPX_EXCHANGE_DEDUP;
  make_routing(s, 41);
  plan_replicated(s);
  assert_int_equal(run_ranks(s->W, 2, ll_fp8_rank, s), 0);
  free(s);
}

/* ------------------------------------------------------------------------ */
/* Refusals                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct {
  scene_t *s;
  int odd_rank; /* the rank whose placement differs */
  int how;      /* 0: another map, 1: another num_physical, 2: an unserved expert, 3: routing id out of range */
} refusal_t;

static int refusal_rank(epx_comm_t comm, int32_t rank, int32_t W, void *arg) {
  refusal_t *a = arg;
  scene_t *s = a->s;
  int failures = 0;
  (void)W;
  int32_t p2l[64];
  memcpy(p2l, s->p2l, sizeof p2l);
  epx_placement_t pl = placement_of(s);
  if (rank == a->odd_rank && a->how == 0) {
    int32_t x = p2l[0];
    p2l[0] = p2l[1], p2l[1] = x;
    pl.physical_to_logical = p2l;
  }
  if (rank == a->odd_rank && a->how == 1) {
    pl.num_physical = s->P - s->W;
    for (int32_t p = 0; p < E; p++) p2l[p] = p;
    pl.physical_to_logical = p2l;
  }
  if (rank == a->odd_rank && a->how == 2) {
    for (int32_t p = 0; p < s->P; p++) p2l[p] = p2l[p] == 3 ? 4 : p2l[p];
    pl.physical_to_logical = p2l;
  }
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, K, T_MAX);
  c.placement = &pl;
  epx_buffer_t b = NULL;
  if (a->how == 0) RANK_STATUS(epx_buffer_create(comm, &c, &b), EPX_ERROR_SHAPE_MISMATCH, "config.placement (a hash");
  if (a->how == 1) RANK_STATUS(epx_buffer_create(comm, &c, &b), EPX_ERROR_SHAPE_MISMATCH, "config.placement->num_physical");
  if (a->how == 2)
    RANK_STATUS(epx_buffer_create(comm, &c, &b), rank == a->odd_rank ? EPX_ERROR_INVALID_ARGUMENT : EPX_ERROR_PEER_FAILED,
                rank == a->odd_rank ? "config.placement serves no replica of logical expert 3" : "refused its config");
  if (a->how == 3) {
    pl.replica_rule = EPX_REPLICA_CALLER;
    RANK_REQUIRE_OK(epx_buffer_create(comm, &c, &b));
    int32_t idx[K] = {s->P, -1, -1, -1}, dup[K] = {-1, -1, -1, -1}, none[K] = {-1, -1, -1, -1};
    float w[K] = {1, 1, 1, 1};
    epx_routing_t r = {1, K, rank == 0 ? idx : none, w, NULL, EPX_WEIGHTS_IN_COMBINE};
    epx_handle_t h = NULL;
    RANK_STATUS(epx_dispatch_layout(b, &r, NULL, &h), rank == 0 ? EPX_ERROR_INVALID_ARGUMENT : EPX_ERROR_PEER_FAILED,
                rank == 0 ? "config.placement->num_physical" : NULL);
    /* two replicas of one logical expert in a row */
    epx_placement_table_t *t = NULL;
    RANK_REQUIRE_OK(epx_placement_table_new("test", "p", &pl, E, W, &t));
    for (int32_t e = 0; e < E && dup[1] < 0; e++)
      if (t->replica_first[e + 1] - t->replica_first[e] > 1)
        dup[0] = t->replicas[t->replica_first[e]], dup[1] = t->replicas[t->replica_first[e] + 1];
    epx_placement_table_free(t);
    r.topk_idx = rank == 0 ? dup : none;
    RANK_STATUS(epx_dispatch_layout(b, &r, NULL, &h), rank == 0 ? EPX_ERROR_INVALID_ARGUMENT : EPX_ERROR_PEER_FAILED,
                rank == 0 ? "a replica of logical expert" : NULL);
  }
done:
  epx_buffer_destroy(b);
  return failures;
}

static void test_refusals(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4;
  make_routing(s, 51);
  plan_replicated(s);
  for (int how = 0; how < 4; how++) {
    refusal_t a = {s, 2, how};
    assert_int_equal(run_ranks(s->W, 2, refusal_rank, &a), 0);
  }
  /* a bad map, alone */
  epx_placement_t pl = placement_of(s);
  int32_t bad[64];
  memcpy(bad, s->p2l, sizeof bad);
  bad[1] = E;
  pl.physical_to_logical = bad;
  double rank_load[4], load[E] = {0};
  EXPECT_STATUS(epx_placement_rank_load(&pl, E, 4, load, rank_load), EPX_ERROR_INVALID_ARGUMENT,
                "placement->physical_to_logical[1] is 16");
  pl.num_physical = 22;
  EXPECT_STATUS(epx_placement_rank_load(&pl, E, 4, load, rank_load), EPX_ERROR_INVALID_ARGUMENT,
                "placement->num_physical is 22");
  int32_t ranks[64];
  pl = placement_of(s);
  for (int32_t p = 0; p < s->P; p++) ranks[p] = p < 8 ? 0 : 1 + p % 3;
  pl.physical_rank = ranks;
  EXPECT_STATUS(epx_placement_rank_load(&pl, E, 4, load, rank_load), EPX_ERROR_INVALID_ARGUMENT,
                "puts more than num_physical / W = 6 physical experts on rank 0");
  free(s);
}

#endif

/* ------------------------------------------------------------------------ */
/* Gradient sum and weight move                                              */
/* ------------------------------------------------------------------------ */

#define COUNT 5

static int grad_move_rank(epx_comm_t comm, int32_t rank, int32_t W, void *arg) {
  scene_t *s = arg;
  int failures = 0;
  epx_placement_t pl = placement_of(s);
  epx_placement_table_t *t = NULL;
  epx_buffer_t b = make_buffer(comm, s, &pl, 0);
  RANK_REQUIRE(b, "buffer");
  RANK_REQUIRE_OK(epx_placement_table_new("test", "p", &pl, E, W, &t));
  int32_t El = t->per_rank;
  float g[64 * COUNT];
  /* physical p's gradient: p * 10 + j */
  for (int32_t sl = 0; sl < El; sl++)
    for (int32_t j = 0; j < COUNT; j++) g[sl * COUNT + j] = (float)(t->rank_experts[rank * El + sl] * 10 + j);
  RANK_REQUIRE_OK(epx_replica_grad_sum(b, g, COUNT));
  for (int32_t sl = 0; sl < El; sl++) {
    int32_t e = t->logical_of[t->rank_experts[rank * El + sl]];
    for (int32_t j = 0; j < COUNT; j++) {
      float want = 0;
      for (int32_t i = t->replica_first[e]; i < t->replica_first[e + 1]; i++) want += (float)(t->replicas[i] * 10 + j);
      RANK_EXPECT(g[sl * COUNT + j] == want, "grad slot %d [%d]: %g, want %g", sl, j, g[sl * COUNT + j], want);
    }
  }
  /* move: contiguous -> the placement -> contiguous; a block names its logical expert */
  int32_t src[E], mid[64], back[E];
  for (int32_t sl = 0; sl < E / W; sl++) src[sl] = 1000 + rank * (E / W) + sl;
  RANK_REQUIRE_OK(epx_placement_move(comm, E, NULL, &pl, sizeof(int32_t), src, mid));
  for (int32_t sl = 0; sl < El; sl++)
    RANK_EXPECT(mid[sl] == 1000 + t->logical_of[t->rank_experts[rank * El + sl]], "moved slot %d holds %d", sl, mid[sl]);
  RANK_REQUIRE_OK(epx_placement_move(comm, E, &pl, NULL, sizeof(int32_t), mid, back));
  RANK_EXPECT(!memcmp(back, src, sizeof(int32_t) * (size_t)(E / W)), "move back differs");
  /* a rank that names another target is refused on every rank */
  epx_placement_t other = pl;
  int32_t ident[E];
  for (int32_t e = 0; e < E; e++) ident[e] = e;
  if (rank == 1) other.physical_rank = NULL, other.num_physical = E, other.physical_to_logical = ident;
  RANK_STATUS(epx_placement_move(comm, E, NULL, &other, sizeof(int32_t), src, mid), EPX_ERROR_SHAPE_MISMATCH,
              "to (a hash of its maps)");
done:
  epx_buffer_destroy(b);
  epx_placement_table_free(t);
  return failures;
}

#ifndef PL_SCENE_ONLY
static void test_grad_sum_and_move(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4, s->dtype = EPX_FLOAT32, s->layout = EPX_LAYOUT_EXPERT_MAJOR, s->exchange = EPX_EXCHANGE_DEDUP;
  make_routing(s, 61);
  plan_replicated(s);
  assert_int_equal(run_ranks(s->W, 2, grad_move_rank, s), 0);
  plan_permuted(s);
  assert_int_equal(run_ranks(s->W, 2, grad_move_rank, s), 0);
  free(s);
}

/* ------------------------------------------------------------------------ */
/* The device's copy (core/placement.h: what a CUDA buffer uploads)          */
/* ------------------------------------------------------------------------ */

/* One placement's device block and rank-ordered routing against the
 * table: the block is the table then pos_of; rank_experts[rank order] is
 * the physical expert epx_placement_map_routing picks; logical[] counts
 * the routes CPU load counting counts; bad routes read as the layout
 * kernels refuse them. */
static void check_device_block(const scene_t *s, int32_t W) {
  epx_placement_t pl = placement_of(s);
  epx_placement_table_t *t = NULL;
  assert_int_equal(epx_placement_table_new("test", "placement", s->null_placement ? NULL : &pl, E, W, &t),
                   EPX_SUCCESS);
  const int64_t words = epx_placement_device_words(t);
  assert_int_equal(words, 6 * (int64_t)t->num_physical + E + 1);
  int32_t *block = malloc(sizeof(int32_t) * (size_t)words);
  epx_placement_pack_device(t, block);
  assert_memory_equal(block, t->data, sizeof(int32_t) * (size_t)epx_placement_table_words(t));
  const int32_t *pos_of = block + epx_placement_table_words(t), *rank_experts = pos_of - t->num_physical;
  for (int32_t p = 0; p < t->num_physical; p++) {
    assert_int_equal(pos_of[p] / t->per_rank, t->rank_of[p]);
    assert_int_equal(pos_of[p] % t->per_rank, t->slot_of[p]);
    assert_int_equal(rank_experts[pos_of[p]], p);
    if (t->contiguous) assert_int_equal(pos_of[p], p);
  }
  assert_int_equal(epx_placement_is_contiguous(s->null_placement ? NULL : &pl, E), t->contiguous);
  const int caller = t->rule == EPX_REPLICA_CALLER;
  for (int32_t r = 0; r < s->W; r++) {
    int32_t phys[T_MAX * K], out[K], logical[K];
    epx_placement_map_routing(t, r, s->T[r], K, s->idx[r], phys);
    for (int64_t i = 0; i < s->T[r]; i++) {
      epx_placement_rank_token(block, E, t->num_physical, caller, r, i, K, s->idx[r] + i * K, out, logical);
      for (int32_t k = 0; k < K; k++) {
        int32_t e = s->idx[r][i * K + k];
        assert_int_equal(out[k] < 0 ? out[k] : rank_experts[out[k]], phys[i * K + k]);
        assert_int_equal(logical[k], e < 0 ? -1 : epx_placement_routing_logical(t, e));
      }
    }
  }
  /* refusals: out of range reads -2; a second route to a logical expert
   * repeats the first route's id */
  int32_t bad[K] = {-1, epx_placement_routing_ids(t), -7, 0}, out[K], logical[K];
  epx_placement_rank_token(block, E, t->num_physical, caller, 1, 5, K, bad, out, logical);
  assert_int_equal(out[0], -1);
  assert_int_equal(out[1], -2);
  assert_int_equal(out[2], -2);
  assert_true(out[3] >= 0);
  assert_int_equal(logical[1], -1);
  int32_t twice[K] = {3, -1, 3, -1};
  if (caller) /* another replica of the logical expert of physical 3, if any */
    for (int32_t p = 0; p < t->num_physical; p++)
      if (p != 3 && t->logical_of[p] == t->logical_of[3]) twice[2] = p;
  epx_placement_rank_token(block, E, t->num_physical, caller, 0, 2, K, twice, out, logical);
  assert_int_equal(out[2], out[0]);
  assert_int_equal(logical[2], -1);
  free(block);
  epx_placement_table_free(t);
}

/* What a CUDA buffer relies on (src/cuda/place): a buffer of the contiguous
 * map over P experts, fed the rank-ordered routing (epx_placement_rank_token),
 * moves the same rows to the same places as a buffer of the placement fed the
 * caller's routing — counts, offsets, sources, rows and combine's bits — and
 * its ids are the placement's physical ones through rank_experts. */
typedef struct {
  scene_t *s;
  epx_layout_t layout;
} order_arg_t;

typedef struct {
  int64_t N;
  float *recv, *out;
  int32_t *expert, *src, *tok;
  int64_t counts[64], offsets[65];
} order_run_t;

static int order_run(epx_comm_t comm, const order_arg_t *a, int32_t rank, int32_t num_experts,
                     const epx_placement_t *pl, const int32_t *idx, const int32_t *rank_experts, order_run_t *o) {
  int failures = 0;
  const scene_t *s = a->s;
  const int32_t slots = a->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, num_experts, K, T_MAX);
  c.exchange = s->exchange, c.layout = a->layout, c.placement = pl;
  c.expert_alignment = a->layout == EPX_LAYOUT_EXPERT_MAJOR ? 4 : 1;
  epx_buffer_t b = NULL;
  epx_handle_t h = NULL;
  RANK_REQUIRE_OK(epx_buffer_create(comm, &c, &b));
  epx_routing_t routing = {s->T[rank], K, idx, a->layout == EPX_LAYOUT_RANK_MAJOR ? NULL : s->w[rank], NULL,
                           a->layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE};
  RANK_REQUIRE_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  RANK_REQUIRE_OK(epx_handle_recv_rows(h, &o->N));
  const int64_t N = o->N;
  o->recv = tu_alloc(sizeof(float) * (size_t)(N + 1) * H), o->out = tu_alloc(sizeof(float) * T_MAX * H);
  o->expert = tu_alloc(sizeof(int32_t) * (size_t)(N + 1) * K);
  o->src = tu_alloc(sizeof(int32_t) * (size_t)(N + 1)), o->tok = tu_alloc(sizeof(int32_t) * (size_t)(N + 1));
  float *eo = tu_alloc(sizeof(float) * (size_t)(N + 1) * H);
  RANK_REQUIRE_OK(epx_dispatch(b, h, s->x[rank], o->recv, N));
  RANK_REQUIRE_OK(epx_handle_recv_routing(h, o->expert, NULL));
  RANK_REQUIRE_OK(epx_handle_recv_source(h, o->src, o->tok));
  RANK_REQUIRE_OK(epx_handle_expert_counts(h, o->counts, o->offsets));
  if (rank_experts)
    for (int64_t i = 0; i < N * slots; i++) o->expert[i] = o->expert[i] < 0 ? -1 : rank_experts[o->expert[i]];
  /* an expert's output: its row times (1 + its physical id mod 5) */
  for (int64_t i = 0; i < N; i++)
    for (int32_t j = 0; j < H; j++)
      eo[i * H + j] = o->recv[i * H + j] * (float)(1 + (o->expert[i * slots] < 0 ? 0 : o->expert[i * slots] % 5));
  RANK_REQUIRE_OK(epx_combine(b, h, eo, o->out));
  tu_free(eo);
done:
  if (h) epx_handle_release(h);
  epx_buffer_destroy(b);
  return failures;
}

static int rank_order_rank(epx_comm_t comm, int32_t rank, int32_t W, void *arg) {
  const order_arg_t *a = arg;
  const scene_t *s = a->s;
  int failures = 0;
  epx_placement_t pl = placement_of(s);
  epx_placement_table_t *t = NULL;
  int32_t *block = NULL, ranked[T_MAX * K], logical[K];
  order_run_t x = {0}, y = {0};
  RANK_REQUIRE_OK(epx_placement_table_new("test", "placement", &pl, E, W, &t));
  block = tu_alloc(sizeof(int32_t) * (size_t)epx_placement_device_words(t));
  epx_placement_pack_device(t, block);
  for (int64_t i = 0; i < s->T[rank]; i++)
    epx_placement_rank_token(block, E, t->num_physical, t->rule == EPX_REPLICA_CALLER, rank, i, K,
                             s->idx[rank] + i * K, ranked + i * K, logical);
  failures += order_run(comm, a, rank, E, &pl, s->idx[rank], NULL, &x);
  failures += order_run(comm, a, rank, t->num_physical, NULL, ranked,
                        block + epx_placement_table_words(t) - t->num_physical, &y);
  const int32_t slots = a->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1, El = t->per_rank;
  RANK_EXPECT(x.N == y.N, "N %lld, in rank order %lld", (long long)x.N, (long long)y.N);
  if (x.N == y.N && x.recv && y.recv) {
    const size_t N = (size_t)x.N;
    RANK_EXPECT(!memcmp(x.recv, y.recv, sizeof(float) * N * H), "recv rows differ in rank order");
    RANK_EXPECT(!memcmp(x.expert, y.expert, sizeof(int32_t) * N * (size_t)slots), "recv ids differ in rank order");
    RANK_EXPECT(!memcmp(x.src, y.src, sizeof(int32_t) * N) && !memcmp(x.tok, y.tok, sizeof(int32_t) * N),
                "recv sources differ in rank order");
    RANK_EXPECT(!memcmp(x.counts, y.counts, sizeof(int64_t) * (size_t)El) &&
                    !memcmp(x.offsets, y.offsets, sizeof(int64_t) * (size_t)(El + 1)),
                "expert counts differ in rank order");
    RANK_EXPECT(!memcmp(x.out, y.out, sizeof(float) * (size_t)s->T[rank] * H), "combine differs in rank order");
  }
done:
  for (order_run_t *o = &x; o; o = o == &x ? &y : NULL)
    tu_free(o->recv), tu_free(o->out), tu_free(o->expert), tu_free(o->src), tu_free(o->tok);
  tu_free(block);
  epx_placement_table_free(t);
  return failures;
}

static void test_rank_order(void **state) {
  (void)state;
  static const epx_exchange_t exchanges[] = {EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_COLLECTIVE, EPX_EXCHANGE_HIERARCHICAL};
  scene_t *s = calloc(1, sizeof *s);
  s->W = 4;
  make_routing(s, 91);
  for (int kind = 0; kind < 2; kind++) {
    if (kind == 0) plan_replicated(s);
    else plan_permuted(s);
    for (int x = 0; x < 3; x++)
      for (int l = 0; l < 2; l++) {
        s->exchange = exchanges[x];
        order_arg_t a = {s, l ? EPX_LAYOUT_RANK_MAJOR : EPX_LAYOUT_EXPERT_MAJOR};
        int failed = run_ranks(s->W, 2, rank_order_rank, &a);
        if (failed) fprintf(stderr, "rank order: placement %d, exchange %d, layout %d: %d rank(s) failed\n", kind, x, l,
                            failed);
        assert_int_equal(failed, 0);
      }
  }
  free(s);
}

static void test_device_block(void **state) {
  (void)state;
  scene_t *s = calloc(1, sizeof *s);
  for (int32_t W = 1; W <= 4; W *= 2) {
    s->W = W;
    make_routing(s, 70 + (uint64_t)W);
    s->null_placement = 1, s->P = E;
    check_device_block(s, W);
    plan_replicated(s);
    check_device_block(s, W);
    plan_permuted(s);
    check_device_block(s, W);
    /* the caller's ids: the replicated plan, each route to replica (t mod n) */
    plan_replicated(s);
    s->rule = EPX_REPLICA_CALLER;
    epx_placement_t pl = placement_of(s);
    epx_placement_table_t *t = NULL;
    assert_int_equal(epx_placement_table_new("test", "placement", &pl, E, W, &t), EPX_SUCCESS);
    for (int32_t r = 0; r < W; r++)
      for (int64_t i = 0; i < s->T[r] * K; i++) {
        int32_t e = s->idx[r][i], f = e < 0 ? 0 : t->replica_first[e], n = e < 0 ? 1 : t->replica_first[e + 1] - f;
        if (e >= 0) s->idx[r][i] = t->replicas[f + (int32_t)((i / K) % n)];
      }
    epx_placement_table_free(t);
    check_device_block(s, W);
  }
  /* the contiguous map given explicitly, by the view alone */
  int32_t ident[E], ranks[E];
  for (int32_t p = 0; p < E; p++) ident[p] = p, ranks[p] = p / (E / 4);
  epx_placement_t given = {E, ident, ranks, EPX_REPLICA_ROUND_ROBIN};
  assert_true(epx_placement_is_contiguous(&given, E));
  ranks[0] = 1, ranks[E / 4] = 0;
  assert_false(epx_placement_is_contiguous(&given, E));
  free(s);
}

/* ------------------------------------------------------------------------ */
/* The planner                                                               */
/* ------------------------------------------------------------------------ */

static double skew_of(const epx_placement_t *pl, int32_t En, int32_t W, const double *load) {
  double rank_load[64], most = 0, sum = 0;
  assert_int_equal(epx_placement_rank_load(pl, En, W, load, rank_load), EPX_SUCCESS);
  for (int32_t r = 0; r < W; r++) most = rank_load[r] > most ? rank_load[r] : most, sum += rank_load[r];
  return most * W / sum;
}

static void test_planner(void **state) {
  (void)state;
  enum { EN = 256, W = 16 };
  static double load[EN];
  tu_rng_t rng = {5};
  /* a skewed load: exp(normal), a few experts several ranks' worth */
  for (int32_t e = 0; e < EN; e++) load[e] = 1000.0 * exp(1.0 * tu_normal(&rng));
  double before = skew_of(NULL, EN, W, load);
  static int32_t p2l[EN + 64], again[EN + 64];
  double first[3] = {0}; /* per node mode: R = 0's skew */
  for (int32_t R = 0; R <= 64; R += 16) {
    for (int32_t nodes = 1; nodes <= 2; nodes++) {
      int32_t P = EN + R;
      assert_int_equal(epx_placement_plan(load, EN, P, W, nodes, 8, p2l), EPX_SUCCESS);
      assert_int_equal(epx_placement_plan(load, EN, P, W, nodes, 8, again), EPX_SUCCESS);
      assert_memory_equal(p2l, again, sizeof(int32_t) * (size_t)P);
      int served[EN] = {0};
      for (int32_t p = 0; p < P; p++) served[p2l[p]]++;
      for (int32_t e = 0; e < EN; e++) assert_true(served[e] >= 1);
      /* no rank serves one expert twice, where its node has enough ranks */
      for (int32_t p = 0; p < P; p++)
        for (int32_t q = p + 1; q < P && q / (P / W) == p / (P / W); q++)
          if (served[p2l[p]] <= W / nodes) assert_true(p2l[p] != p2l[q]);
      /* node-aware: every replica of an expert on one node */
      if (nodes == 2)
        for (int32_t p = 0; p < P; p++)
          for (int32_t q = 0; q < P; q++)
            if (p2l[p] == p2l[q]) assert_int_equal(p / (P / 2), q / (P / 2));
      epx_placement_t pl = {P, p2l, NULL, EPX_REPLICA_ROUND_ROBIN};
      double skew = skew_of(&pl, EN, W, load);
      fprintf(stderr, "planner: R=%d nodes=%d skew %.3f (contiguous %.3f)\n", R, nodes, skew, before);
      assert_true(skew <= before + 1e-12);
      if (R == 0) first[nodes] = skew;
      assert_true(skew <= first[nodes] + 1e-9);
      if (R >= 32) assert_true(skew <= 1.10);
    }
  }
  EXPECT_STATUS(epx_placement_plan(load, EN, EN + 3, W, 1, 1, p2l), EPX_ERROR_INVALID_ARGUMENT, "num_physical is 259");
  EXPECT_STATUS(epx_placement_plan(load, EN, EN, W, 3, 1, p2l), EPX_ERROR_INVALID_ARGUMENT, "num_nodes 3");
  EXPECT_STATUS(epx_placement_plan(load, EN, EN, W, 1, 7, p2l), EPX_ERROR_INVALID_ARGUMENT, "num_groups is 7");
  load[3] = -1;
  EXPECT_STATUS(epx_placement_plan(load, EN, EN, W, 1, 1, p2l), EPX_ERROR_INVALID_ARGUMENT, "load[3]");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_exact_contiguous),
      cmocka_unit_test(test_exact_replicated),
      cmocka_unit_test(test_exact_permuted),
      cmocka_unit_test(test_exact_caller_ids),
      cmocka_unit_test(test_bits_across_exchanges),
      cmocka_unit_test(test_default_is_contiguous),
      cmocka_unit_test(test_ll_and_fp8),
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_grad_sum_and_move),
      cmocka_unit_test(test_planner),
      cmocka_unit_test(test_device_block),
      cmocka_unit_test(test_rank_order),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
#endif
