/* Expert placement on a CUDA buffer of one GPU (epx.h, "Expert placement
 * and replicas"; src/cuda/place): the contiguous map given explicitly, a
 * replicated placement under the round-robin rule, a permuted one and the
 * caller's physical ids, on the expert-major, rank-major and capacity
 * layouts: recv rows, expert counts and offsets, recv routing (physical
 * ids), dispatched rows, combine output and the load counts equal to the
 * CPU backend's on the same inputs, bit for bit. A bad route (a logical id
 * at or above num_experts, two replicas of one logical expert) is refused
 * as on the CPU; the low-latency mode refuses a non-contiguous placement
 * naming config.placement, and its load counts by name. Exit status is the
 * verdict. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_testutil.h"
#include "../util/buffer_config.h"

enum { T = 64, E = 16, K = 4, H = 64, C = 40, P_MAX = 24 };
/* the most rows a dispatch receives: T * K routes, or a slot per physical
 * expert and capacity slot in the capacity layout */
enum { ROWS_MAX = T * K > P_MAX * C ? T * K : P_MAX * C };

typedef struct {
  int32_t P, p2l[P_MAX];
  epx_replica_rule_t rule;
  const char *name;
} place_t;

typedef struct {
  int64_t N;
  _Alignas(16) uint16_t recv[ROWS_MAX * H]; /* the CPU run's recv_x and out: rows 16-byte aligned (epx.h) */
  _Alignas(16) uint16_t out[T * H];
  int32_t expert[ROWS_MAX * K];
  float w[ROWS_MAX * K];
  int64_t counts[P_MAX], offsets[P_MAX + 1], load[E];
} result_t;

static epx_buffer_config_t config_of(epx_device_t device, epx_layout_t layout, const epx_placement_t *pl) {
  epx_buffer_config_t c = tu_config(device, EPX_BFLOAT16, H, E, K, T);
  c.layout = layout;
  c.capacity = layout == EPX_LAYOUT_CAPACITY ? C : 0;
  c.expert_alignment = layout == EPX_LAYOUT_EXPERT_MAJOR ? 4 : 1;
  c.placement = pl;
  return c;
}

/* Layout, dispatch, the handle's queries, combine and the load counts on
 * device, read back to the host. */
static void run(epx_comm_t comm, epx_device_t device, epx_layout_t layout, const epx_placement_t *pl,
                const int32_t *idx, const float *w, const int32_t *loc, const uint16_t *x, result_t *res) {
  epx_buffer_config_t c = config_of(device, layout, pl);
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  const int gpu = device == EPX_DEVICE_CUDA, rm = layout == EPX_LAYOUT_RANK_MAJOR;
  const int32_t El = pl ? pl->num_physical : E, slots = rm ? K : 1;
  const size_t tk = sizeof(int32_t) * T * K, row = 2 * H;
  const void *ri = gpu ? dev_copy(idx, tk) : idx, *rw = gpu ? dev_copy(w, tk) : w, *rx = gpu ? dev_copy(x, T * row) : x;
  const void *rl = gpu ? dev_copy(loc, tk) : loc;
  epx_routing_t r = {T, K, ri, rm ? NULL : rw, layout == EPX_LAYOUT_CAPACITY ? rl : NULL,
                     rm ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &r, NULL, &h));
  EXPECT_OK(epx_handle_recv_rows(h, &res->N));
  const int64_t N = res->N;
  assert_true(N <= ROWS_MAX); /* the CPU run's arrays hold that many */
  void *rr = gpu ? dev_alloc((size_t)(N + 1) * row) : res->recv, *ro = gpu ? dev_alloc(T * row) : res->out;
  void *re = gpu ? dev_alloc(4 * (size_t)(N * slots + 1)) : res->expert;
  void *rv = gpu ? dev_alloc(4 * (size_t)(N * slots + 1)) : res->w;
  void *cn = gpu ? dev_alloc(8 * (size_t)El) : res->counts, *of = gpu ? dev_alloc(8 * (size_t)(El + 1)) : res->offsets;
  EXPECT_OK(epx_dispatch(b, h, rx, rr, N));
  EXPECT_OK(epx_handle_recv_routing(h, re, rv));
  EXPECT_OK(epx_handle_expert_counts(h, cn, of));
  /* expert outputs: the dispatched rows themselves */
  EXPECT_OK(epx_combine(b, h, rr, ro));
  EXPECT_OK(epx_buffer_expert_load(b, res->load, 1));
  if (gpu) {
    CUDA_OK(cudaDeviceSynchronize());
    to_host(res->recv, rr, (size_t)N * row);
    to_host(res->out, ro, T * row);
    to_host(res->expert, re, 4 * (size_t)(N * slots));
    to_host(res->w, rv, 4 * (size_t)(N * slots));
    to_host(res->counts, cn, 8 * (size_t)El);
    to_host(res->offsets, of, 8 * (size_t)(El + 1));
    void *device_memory[] = {(void *)ri, (void *)rw, (void *)rx, (void *)rl, rr, ro, re, rv, cn, of};
    for (size_t i = 0; i < sizeof device_memory / sizeof device_memory[0]; i++) CUDA_OK(cudaFree(device_memory[i]));
  }
  int64_t again[E];
  EXPECT_OK(epx_buffer_expert_load(b, again, 0)); /* reset above */
  for (int32_t e = 0; e < E; e++) assert_int_equal(again[e], 0);
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
}

static void compare(const result_t *g, const result_t *c, epx_layout_t layout, int32_t El, const char *what) {
  const int slots = layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  if (g->N != c->N) fprintf(stderr, "%s: N %lld, CPU %lld\n", what, (long long)g->N, (long long)c->N);
  assert_int_equal(g->N, c->N);
  assert_memory_equal(g->recv, c->recv, (size_t)c->N * 2 * H);
  assert_memory_equal(g->out, c->out, sizeof c->out);
  assert_memory_equal(g->expert, c->expert, 4 * (size_t)(c->N * slots));
  assert_memory_equal(g->w, c->w, 4 * (size_t)(c->N * slots));
  assert_memory_equal(g->counts, c->counts, 8 * (size_t)El);
  assert_memory_equal(g->offsets, c->offsets, 8 * (size_t)(El + 1));
  assert_memory_equal(g->load, c->load, sizeof c->load);
}

/* Routing of logical ids (-1 for some), dyadic weights, capacity
 * locations per logical expert; caller: each route's physical replica. */
static void make_routing(const place_t *q, int32_t *idx, float *w, int32_t *loc) {
  tu_rng_t rng = {11};
  tu_random_routing(&rng, T, E, K, 1.2, idx, w);
  int32_t fill[E] = {0};
  for (int32_t i = 0; i < T * K; i++) {
    if (tu_below(&rng, 9) == 0) idx[i] = -1;
    w[i] = (float)(1 + tu_below(&rng, 4)) * 0.25f;
    loc[i] = idx[i] >= 0 && fill[idx[i]] < C ? fill[idx[i]]++ : -1;
    if (loc[i] < 0) idx[i] = -1;
  }
  if (!q || q->rule != EPX_REPLICA_CALLER) return;
  for (int32_t i = 0; i < T * K; i++) {
    if (idx[i] < 0) continue;
    int32_t n = 0, pick[P_MAX];
    for (int32_t p = 0; p < q->P; p++)
      if (q->p2l[p] == idx[i]) pick[n++] = p;
    idx[i] = pick[(i / K * 3 + i % K) % n];
  }
}

static void test_gpu_placement(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  static place_t places[4];
  places[0] = (place_t){E, {0}, EPX_REPLICA_ROUND_ROBIN, "the contiguous map given"};
  places[1] = (place_t){E + 8, {0}, EPX_REPLICA_ROUND_ROBIN, "replicas (round robin)"};
  places[2] = (place_t){E, {0}, EPX_REPLICA_ROUND_ROBIN, "permuted"};
  places[3] = (place_t){E + 8, {0}, EPX_REPLICA_CALLER, "replicas (the caller's ids)"};
  for (int32_t p = 0; p < E + 8; p++) {
    places[0].p2l[p] = p;
    places[1].p2l[p] = places[3].p2l[p] = p < E ? (p * 5 + 3) % E : (p - E) % 3; /* the hot experts twice or more */
    places[2].p2l[p] = (p * 7 + 1) % E;
  }
  static result_t cpu, gpu;
  static int32_t idx[T * K], loc[T * K];
  static float w[T * K];
  static uint16_t x[T * H];
  tu_rng_t rng = {3};
  tu_fill(&rng, EPX_BFLOAT16, x, T * H);
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_RANK_MAJOR, EPX_LAYOUT_CAPACITY};
  int cases = 0;
  for (int pi = -1; pi < 4; pi++) {
    const place_t *q = pi < 0 ? NULL : &places[pi];
    epx_placement_t pl = q ? (epx_placement_t){q->P, q->p2l, NULL, q->rule} : (epx_placement_t){0};
    for (int li = 0; li < 3; li++) {
      char what[128];
      snprintf(what, sizeof what, "%s, layout %d", q ? q->name : "no placement", (int)layouts[li]);
      make_routing(q, idx, w, loc);
      memset(&cpu, 0, sizeof cpu), memset(&gpu, 0, sizeof gpu);
      run(comm, EPX_DEVICE_CPU, layouts[li], q ? &pl : NULL, idx, w, loc, x, &cpu);
      run(comm, EPX_DEVICE_CUDA, layouts[li], q ? &pl : NULL, idx, w, loc, x, &gpu);
      compare(&gpu, &cpu, layouts[li], q ? q->P : E, what);
      cases++;
    }
  }
  printf("test_gpu_placement: %d placement x layout cases equal to the CPU backend\n", cases);

  /* Refusals, as on the CPU: a logical id at num_experts (below P), two
   * replicas of one logical expert in a row (the caller's ids). */
  for (int pi = 1; pi < 4; pi += 2) {
    const place_t *q = &places[pi];
    epx_placement_t pl = {q->P, q->p2l, NULL, q->rule};
    make_routing(q, idx, w, loc);
    if (q->rule == EPX_REPLICA_ROUND_ROBIN) idx[5] = E;
    else idx[4] = 9, idx[5] = E; /* physical 9 and E both serve logical 0 */
    for (int d = 0; d < 2; d++) {
      epx_buffer_config_t c = config_of(d ? EPX_DEVICE_CUDA : EPX_DEVICE_CPU, EPX_LAYOUT_EXPERT_MAJOR, &pl);
      epx_buffer_t b = NULL;
      EXPECT_OK(epx_buffer_create(comm, &c, &b));
      const void *ri = d ? dev_copy(idx, sizeof idx) : idx, *rw = d ? dev_copy(w, sizeof w) : w;
      epx_routing_t r = {T, K, ri, rw, NULL, EPX_WEIGHTS_IN_COMBINE};
      epx_handle_t h = NULL;
      EXPECT_STATUS(epx_dispatch_layout(b, &r, NULL, &h), EPX_ERROR_INVALID_ARGUMENT,
                    q->rule == EPX_REPLICA_ROUND_ROBIN ? "routing.topk_idx[1][1]" : "twice");
      if (d) {
        CUDA_OK(cudaFree((void *)ri));
        CUDA_OK(cudaFree((void *)rw));
      }
      EXPECT_OK(epx_buffer_destroy(b));
    }
  }

  /* The low-latency mode: the contiguous map only, and no load counts. */
  epx_placement_t replicated = {places[1].P, places[1].p2l, NULL, EPX_REPLICA_ROUND_ROBIN};
  epx_buffer_config_t c = config_of(EPX_DEVICE_CUDA, EPX_LAYOUT_EXPERT_MAJOR, &replicated);
  c.low_latency = 1;
  epx_buffer_t b = NULL;
  EXPECT_STATUS(epx_buffer_create(comm, &c, &b), EPX_ERROR_UNSUPPORTED, "config.low_latency");
  c.placement = NULL, c.expert_alignment = 1;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  int64_t load[E];
  EXPECT_STATUS(epx_buffer_expert_load(b, load, 0), EPX_ERROR_UNSUPPORTED, "low-latency");
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_gpu_placement)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
