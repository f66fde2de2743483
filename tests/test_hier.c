/* The hierarchical exchange against dedup and collective on posed nodes
 * (epx_comm_config_t.ranks_per_node): threads as 2 nodes of 2, 2 x 4, 4 x 2
 * (and the degenerate 1 x 4, 4 x 1); mpi_hier.c runs the same cases over MPI.
 * On every layout, dtype, weighting and combine precision: dispatch (again
 * on the handle, and on a recorder's replayed handle), combine,
 * combine_backward and dispatch_backward with and without grad_w,
 * weights_backward, fp-inexact data so a sum in another order would show —
 * the three exchanges bit for bit. The rows each
 * exchange sends by link class (epx_handle_traffic) against counts made here
 * from every rank's routing, and the topology query. */
#include <pthread.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "testutil.h"
#include "buffer_config.h"

enum { HT_H = 64, HT_T = 40, HT_EXCHANGES = 3 };

typedef struct {
  epx_layout_t layout;
  epx_dtype_t dtype;
  epx_weighting_t weighting;
  epx_combine_precision_t precision;
  int per_rank_k; /* top_k differs between ranks */
} ht_case_t;

static const ht_case_t ht_cases[] = {
    {EPX_LAYOUT_EXPERT_MAJOR, EPX_FLOAT32, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_FLOAT32, 0},
    {EPX_LAYOUT_EXPERT_MAJOR, EPX_BFLOAT16, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_PAYLOAD, 1},
    {EPX_LAYOUT_EXPERT_MAJOR, EPX_BFLOAT16, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_FLOAT32, 0},
    {EPX_LAYOUT_EXPERT_MAJOR, EPX_FLOAT16, EPX_WEIGHTS_IN_DISPATCH, EPX_COMBINE_PARTIALS_PAYLOAD, 0},
    {EPX_LAYOUT_CAPACITY, EPX_FLOAT32, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_FLOAT32, 1},
    {EPX_LAYOUT_CAPACITY, EPX_BFLOAT16, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_PAYLOAD, 0},
    {EPX_LAYOUT_RANK_MAJOR, EPX_BFLOAT16, EPX_WEIGHTS_NONE, EPX_COMBINE_PARTIALS_PAYLOAD, 0},
    {EPX_LAYOUT_EXPERT_MAJOR, EPX_FLOAT32, EPX_WEIGHTS_NONE, EPX_COMBINE_PARTIALS_FLOAT32, 0},
};
enum { HT_CASES = sizeof ht_cases / sizeof ht_cases[0] };

/* One rank's routing, the same wherever it is made (every rank makes every
 * rank's, to count the rows it must forward). */
typedef struct {
  int64_t T;
  int32_t K;
  int32_t *idx, *loc;
  float *w;
} ht_routing_t;

static void ht_routing(ht_routing_t *r, const ht_case_t *c, int32_t rank, int32_t E, uint64_t seed) {
  tu_rng_t rng = {seed * 1000003u + (uint64_t)rank};
  r->T = HT_T + rank;
  r->K = c->per_rank_k ? 3 + rank % 4 : 6;
  if (r->K > E) r->K = E;
  r->idx = tu_alloc(sizeof(int32_t) * (size_t)(r->T * r->K));
  r->loc = tu_alloc(sizeof(int32_t) * (size_t)(r->T * r->K));
  r->w = tu_alloc(sizeof(float) * (size_t)(r->T * r->K));
  tu_random_routing(&rng, r->T, E, r->K, rank % 2 ? 1.1 : 0.0, r->idx, r->w);
  int32_t *fill = tu_alloc(sizeof(int32_t) * (size_t)E);
  for (int64_t i = 0; i < r->T * r->K; i++) {
    if (tu_below(&rng, 9) == 0) r->idx[i] = -1; /* a dropped route */
    r->loc[i] = r->idx[i] >= 0 ? fill[r->idx[i]]++ : -1;
  }
  tu_free(fill);
}

static void ht_routing_free(ht_routing_t *r) { tu_free(r->idx), tu_free(r->loc), tu_free(r->w); }

/* The rows rank `me` must send per link class, from every rank's routing:
 * expected[x][0] same node, [x][1] other nodes, for each exchange x. */
static void ht_expected(const ht_routing_t *all, int32_t me, int32_t W, int32_t L, int32_t El, int64_t expected[3][2]) {
  int32_t node = me / L;
  memset(expected, 0, sizeof(int64_t) * 6);
  const ht_routing_t *mine = &all[me];
  for (int64_t t = 0; t < mine->T; t++) {
    int rank_hit[64] = {0}, node_hit[64] = {0};
    for (int32_t k = 0; k < mine->K; k++) {
      int32_t e = mine->idx[t * mine->K + k];
      if (e < 0 || e / El == me) continue;
      int32_t d = e / El, other = d / L != node;
      expected[1][other]++; /* collective: a row per route */
      if (!rank_hit[d]++) {
        expected[0][other]++; /* dedup: a row per rank */
        if (!other) expected[2][0]++; /* hierarchical: straight to the node's ranks */
      }
      if (other && !node_hit[d / L]++) expected[2][1]++; /* hierarchical: a row per other node */
    }
  }
  /* Hierarchical: the rows this rank forwards, as relay of the sources of
   * other nodes with its local index, to the other ranks of its node. */
  for (int32_t s = 0; s < W; s++) {
    if (s / L == node || s % L != me % L) continue;
    for (int64_t t = 0; t < all[s].T; t++) {
      int rank_hit[64] = {0};
      for (int32_t k = 0; k < all[s].K; k++) {
        int32_t e = all[s].idx[t * all[s].K + k];
        if (e < 0) continue;
        int32_t d = e / El;
        if (d / L == node && d != me && !rank_hit[d]++) expected[2][0]++;
      }
    }
  }
}

/* One exchange's results on one rank. */
typedef struct {
  void *recv, *recv2, *out, *grad_expert_out, *grad_x, *grad_x2;
  float *grad_w_combine, *grad_w_dispatch, *grad_w_weights;
  int64_t N;
  epx_handle_traffic_t traffic;
} ht_result_t;

typedef struct {
  const ht_case_t *c;
  int32_t W, L, E, rank;
  size_t row;
  const ht_routing_t *mine;
  void *x, *expert_out_seed, *grad_out;
} ht_rank_t;

static int ht_run(epx_comm_t comm, const ht_rank_t *R, epx_exchange_t exchange, ht_result_t *res) {
  int failures = 0, rank = R->rank;
  const ht_case_t *c = R->c;
  epx_buffer_config_t config = tu_config(EPX_DEVICE_CPU, c->dtype, HT_H, R->E, 6, HT_T + R->W);
  config.exchange = exchange;
  config.layout = c->layout;
  config.capacity = HT_T + R->W;
  config.combine_precision = c->precision;
  epx_buffer_t b = NULL;
  epx_handle_t h = NULL;
  RANK_REQUIRE_OK(epx_buffer_create(comm, &config, &b));
  epx_routing_t routing = {R->mine->T, R->mine->K, R->mine->idx, R->mine->w, R->mine->loc, c->weighting};
  RANK_REQUIRE_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  RANK_REQUIRE_OK(epx_handle_recv_rows(h, &res->N));
  int64_t N = res->N, slots = c->layout == EPX_LAYOUT_RANK_MAJOR ? 6 : 1, T = R->mine->T;
  size_t rows_bytes = (size_t)(N + 1) * R->row, out_bytes = (size_t)T * R->row;
  res->recv = tu_alloc(rows_bytes), res->recv2 = tu_alloc(rows_bytes), res->grad_expert_out = tu_alloc(rows_bytes);
  res->out = tu_alloc(out_bytes), res->grad_x = tu_alloc(out_bytes), res->grad_x2 = tu_alloc(out_bytes);
  size_t wb = sizeof(float) * (size_t)(T * R->mine->K + 1);
  res->grad_w_combine = tu_alloc(wb), res->grad_w_dispatch = tu_alloc(wb), res->grad_w_weights = tu_alloc(wb);
  RANK_OK(epx_handle_traffic(h, &res->traffic));
  RANK_OK(epx_dispatch(b, h, R->x, res->recv, N));
  RANK_OK(epx_dispatch(b, h, R->x, res->recv, N)); /* cached: the payload only */
  /* A recorder's replay of the layout (no exchange) moves the same rows. */
  epx_recorder_t recorder = NULL;
  epx_handle_t recorded = NULL, replayed = NULL;
  RANK_OK(epx_recorder_create(1, &recorder));
  RANK_OK(epx_dispatch_layout(b, &routing, recorder, &recorded));
  RANK_OK(epx_recorder_set_mode(recorder, EPX_RECORDER_REPLAY));
  RANK_OK(epx_dispatch_layout(b, &routing, recorder, &replayed));
  if (replayed) RANK_OK(epx_dispatch(b, replayed, R->x, res->recv2, N));
  if (recorded) RANK_OK(epx_handle_release(recorded));
  if (replayed) RANK_OK(epx_handle_release(replayed));
  RANK_OK(epx_recorder_destroy(recorder));
  /* The experts' outputs: a function of the row received (so equal rows on
   * every exchange), inexact. */
  void *expert_out = tu_alloc(rows_bytes);
  for (int64_t i = 0; i < N * HT_H; i++) {
    float v = epx_load(c->dtype, res->recv, i) * 1.37f + epx_load(c->dtype, R->expert_out_seed, i % (HT_H * 7));
    epx_store(c->dtype, expert_out, i, v);
  }
  RANK_OK(epx_combine(b, h, expert_out, res->out));
  int in_combine = c->weighting == EPX_WEIGHTS_IN_COMBINE, in_dispatch = c->weighting == EPX_WEIGHTS_IN_DISPATCH;
  RANK_OK(epx_combine_backward(b, h, R->grad_out, in_combine ? expert_out : NULL, res->grad_expert_out,
                               in_combine ? res->grad_w_combine : NULL));
  RANK_OK(epx_dispatch_backward(b, h, expert_out, res->grad_x, NULL, NULL));
  RANK_OK(epx_dispatch_backward(b, h, expert_out, res->grad_x2, in_dispatch ? R->x : NULL,
                                in_dispatch ? res->grad_w_dispatch : NULL));
  if (c->weighting == EPX_WEIGHTS_NONE) {
    float *grad_recv_w = tu_alloc(sizeof(float) * (size_t)(N * slots + 1));
    int32_t *src_token = tu_alloc(sizeof(int32_t) * (size_t)(N + 1));
    RANK_OK(epx_handle_recv_source(h, NULL, src_token));
    for (int64_t i = 0; i < N * slots; i++) grad_recv_w[i] = 0.25f * (float)src_token[i / slots] + (float)(i % slots);
    RANK_OK(epx_weights_backward(b, h, grad_recv_w, res->grad_w_weights));
    tu_free(grad_recv_w);
    tu_free(src_token);
  }
  tu_free(expert_out);
done:
  if (h) RANK_OK(epx_handle_release(h));
  if (b) RANK_OK(epx_buffer_destroy(b));
  return failures;
}

static void ht_result_free(ht_result_t *r) {
  void *all[] = {r->recv, r->recv2, r->out, r->grad_expert_out, r->grad_x, r->grad_x2,
                 r->grad_w_combine, r->grad_w_dispatch, r->grad_w_weights};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tu_free(all[i]);
}

static int ht_same(const void *a, const void *b, size_t bytes) { return bytes == 0 || memcmp(a, b, bytes) == 0; }

/* Every exchange against dedup (index 0), and the traffic counts. */
static int ht_compare(const ht_rank_t *R, ht_result_t *res, const char *const *names, int64_t expected[3][2]) {
  int failures = 0, rank = R->rank;
  size_t rows = (size_t)res[0].N * R->row, out = (size_t)R->mine->T * R->row;
  size_t wb = sizeof(float) * (size_t)(R->mine->T * R->mine->K);
  for (int x = 0; x < HT_EXCHANGES; x++) {
    ht_result_t *a = &res[x], *d = &res[0];
    RANK_EXPECT(a->N == d->N, "%s: %lld rows received, dedup %lld", names[x], (long long)a->N, (long long)d->N);
    if (a->N != d->N) continue;
    RANK_EXPECT(ht_same(a->recv, d->recv, rows) && ht_same(a->recv2, d->recv, rows), "%s: recv_x differs", names[x]);
    RANK_EXPECT(ht_same(a->out, d->out, out), "%s: combine's out differs from dedup's", names[x]);
    RANK_EXPECT(ht_same(a->grad_expert_out, d->grad_expert_out, rows), "%s: grad_expert_out differs", names[x]);
    RANK_EXPECT(ht_same(a->grad_x, d->grad_x, out) && ht_same(a->grad_x2, d->grad_x, out), "%s: grad_x differs",
                names[x]);
    RANK_EXPECT(ht_same(a->grad_w_combine, d->grad_w_combine, wb) && ht_same(a->grad_w_dispatch, d->grad_w_dispatch, wb) &&
                    ht_same(a->grad_w_weights, d->grad_w_weights, wb),
                "%s: grad_w differs", names[x]);
    int64_t same = a->traffic.same_node_rows, other = a->traffic.other_node_rows;
    RANK_EXPECT(same == expected[x][0] && other == expected[x][1],
                "%s: sends %lld rows inside its node and %lld across, expected %lld and %lld", names[x],
                (long long)same, (long long)other, (long long)expected[x][0], (long long)expected[x][1]);
    RANK_EXPECT(a->traffic.other_node_bytes == other * (int64_t)R->row, "%s: other_node_bytes", names[x]);
  }
  return failures;
}

/* One case on one rank: the three exchanges on the same data. */
static int ht_case_rank(epx_comm_t comm, int32_t rank, int32_t W, int32_t L, const ht_case_t *c, uint64_t seed) {
  int failures = 0;
  int32_t E = 4 * W;
  ht_routing_t *all = tu_alloc(sizeof(ht_routing_t) * (size_t)W);
  for (int32_t r = 0; r < W; r++) ht_routing(&all[r], c, r, E, seed);
  ht_rank_t R = {c, W, L, E, rank, (size_t)HT_H * epx_dtype_size(c->dtype), &all[rank], NULL, NULL, NULL};
  tu_rng_t rng = {seed + 77u * (uint64_t)rank};
  R.x = tu_alloc((size_t)all[rank].T * R.row);
  R.grad_out = tu_alloc((size_t)all[rank].T * R.row);
  R.expert_out_seed = tu_alloc(7 * R.row);
  tu_fill(&rng, c->dtype, R.x, all[rank].T * HT_H);
  tu_fill(&rng, c->dtype, R.grad_out, all[rank].T * HT_H);
  tu_fill(&rng, c->dtype, R.expert_out_seed, 7 * HT_H);
  static const epx_exchange_t exchanges[HT_EXCHANGES] = {EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_COLLECTIVE,
                                                         EPX_EXCHANGE_HIERARCHICAL};
  static const char *const names[HT_EXCHANGES] = {"dedup", "collective", "hierarchical"};
  ht_result_t res[HT_EXCHANGES];
  memset(res, 0, sizeof res);
  for (int x = 0; x < HT_EXCHANGES; x++) failures += ht_run(comm, &R, exchanges[x], &res[x]);
  int64_t expected[3][2];
  ht_expected(all, rank, W, L, E / W, expected);
  if (!failures) failures += ht_compare(&R, res, names, expected);
  for (int x = 0; x < HT_EXCHANGES; x++) ht_result_free(&res[x]);
  for (int32_t r = 0; r < W; r++) ht_routing_free(&all[r]);
  tu_free(all), tu_free(R.x), tu_free(R.grad_out), tu_free(R.expert_out_seed);
  return failures;
}

/* The topology query, and AUTO's choice. */
static int ht_topology_rank(epx_comm_t comm, int32_t rank, int32_t W, int32_t L) {
  int failures = 0;
  int32_t nodes = -1, per = -1, node = -1, local = -1;
  RANK_OK(epx_comm_topology(comm, &nodes, &per, &node, &local));
  RANK_EXPECT(nodes == W / L && per == L && node == rank / L && local == rank % L,
              "topology %d nodes of %d, node %d local %d; expected %d of %d, %d, %d", nodes, per, node, local, W / L, L,
              rank / L, rank % L);
  epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
  config.hidden = HT_H, config.num_experts = 4 * W, config.max_top_k = 2, config.max_tokens_per_rank = 8;
  epx_buffer_t b = NULL;
  RANK_OK(epx_buffer_create(comm, &config, &b));
  epx_routing_t routing = {0, 2, NULL, NULL, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  int32_t idx[2] = {0, 4 * W - 1};
  float w[2] = {0.5f, 0.5f};
  routing.num_tokens = 1, routing.topk_idx = idx, routing.topk_w = w;
  RANK_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  epx_handle_traffic_t traffic;
  RANK_OK(epx_handle_traffic(h, &traffic));
  /* AUTO is hierarchical across nodes of several ranks: one row per other node. */
  int hier = W / L > 1 && L > 1;
  int32_t first = 0, last = W - 1;
  int64_t other = (first / L != rank / L) + (last / L != rank / L && (!hier || last / L != first / L));
  RANK_EXPECT(traffic.other_node_rows == other, "AUTO sends %lld rows across nodes, expected %lld",
              (long long)traffic.other_node_rows, (long long)other);
  if (h) RANK_OK(epx_handle_release(h));
  if (b) RANK_OK(epx_buffer_destroy(b));
  return failures;
}

#ifndef HT_SCENE_ONLY

typedef struct {
  epx_local_world_t world;
  int32_t rank, W, L;
  int failures;
} ht_thread_t;

static void *ht_thread(void *arg) {
  ht_thread_t *a = arg;
  epx_comm_t comm = NULL;
  int failures = 0, rank = a->rank;
  RANK_REQUIRE_OK(epx_comm_create_local(a->world, a->rank, &comm));
  failures += ht_topology_rank(comm, a->rank, a->W, a->L);
  for (int i = 0; i < HT_CASES; i++) {
    int f = ht_case_rank(comm, a->rank, a->W, a->L, &ht_cases[i], 0x5eed + (uint64_t)i);
    if (f) fprintf(stderr, "rank %d: case %d (W=%d as %d x %d) failed\n", a->rank, i, a->W, a->W / a->L, a->L);
    failures += f;
  }
done:
  if (comm) RANK_OK(epx_comm_destroy(comm));
  a->failures = failures;
  return NULL;
}

static int ht_world(int32_t W, int32_t L) {
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = 30.0;
  config.ranks_per_node = L;
  epx_local_world_t world = NULL;
  if (epx_local_world_create(W, &config, &world) != EPX_SUCCESS) return 1;
  pthread_t threads[16];
  ht_thread_t args[16];
  for (int32_t r = 0; r < W; r++) {
    args[r] = (ht_thread_t){world, r, W, L, 0};
    pthread_create(&threads[r], NULL, ht_thread, &args[r]);
  }
  int failures = 0;
  for (int32_t r = 0; r < W; r++) {
    pthread_join(threads[r], NULL);
    failures += args[r].failures;
  }
  return failures + (epx_local_world_destroy(world) != EPX_SUCCESS);
}

static void test_two_nodes_of_two(void **state) { (void)state, assert_int_equal(ht_world(4, 2), 0); }
static void test_two_nodes_of_four(void **state) { (void)state, assert_int_equal(ht_world(8, 4), 0); }
static void test_four_nodes_of_two(void **state) { (void)state, assert_int_equal(ht_world(8, 2), 0); }
static void test_one_node(void **state) { (void)state, assert_int_equal(ht_world(4, 4), 0); }
static void test_one_rank_per_node(void **state) { (void)state, assert_int_equal(ht_world(4, 1), 0); }

static void test_refusals(void **state) {
  (void)state;
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  epx_local_world_t world = NULL;
  config.ranks_per_node = 3;
  EXPECT_STATUS(epx_local_world_create(4, &config, &world), EPX_ERROR_INVALID_ARGUMENT, "ranks_per_node is 3");
  config.ranks_per_node = -1;
  EXPECT_STATUS(epx_local_world_create(4, &config, &world), EPX_ERROR_INVALID_ARGUMENT, "ranks_per_node is -1");
  epx_comm_t self = NULL;
  EXPECT_OK(epx_comm_create_self(&self));
  int32_t nodes = 0, per = 0;
  EXPECT_OK(epx_comm_topology(self, &nodes, &per, NULL, NULL));
  assert_int_equal(nodes, 1);
  assert_int_equal(per, 1);
  EXPECT_STATUS(epx_comm_topology(NULL, &nodes, NULL, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "comm is NULL");
  EXPECT_OK(epx_comm_destroy(self));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_nodes_of_two), cmocka_unit_test(test_two_nodes_of_four),
      cmocka_unit_test(test_four_nodes_of_two), cmocka_unit_test(test_one_node),
      cmocka_unit_test(test_one_rank_per_node), cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
