/* epx_weights_backward: the gradient of weights the expert applied itself
 * comes home to the route's source slot. Each rank writes, for every received
 * (row, slot), a value that encodes the route's source (rank, token, slot);
 * after the call every rank checks that grad_w[t, k] holds its own
 * (rank, t, k) for each route and 0 elsewhere — exactly, without a gather.
 * W = 1 (self comm) and 2, 3, 4 (local transport), every layout, both
 * exchanges; and the end-to-end use it exists for: rank-major rows weighted
 * by the expert, whose weight gradient must reach the router. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "buffer_config.h"

#define E_PER_RANK 3
#define K 2
#define H 16

typedef struct {
  epx_layout_t layout;
  epx_exchange_t exchange;
} scene_t;

/* Every rank's routing comes from one seed, so each can rebuild any other's. */
static int64_t tokens_of(int32_t rank) { return 5 + 3 * rank; }

static void routing_of(int32_t rank, int32_t E, int32_t *idx, float *w, int32_t *loc, int32_t capacity) {
  tu_rng_t rng = {0x77000u + (uint64_t)rank};
  int64_t T = tokens_of(rank);
  tu_random_routing(&rng, T, E, K, 0.0, idx, w);
  /* the last token of rank 0 chooses nothing, one slot of token 1 is dropped */
  if (rank == 0) idx[(T - 1) * K] = idx[(T - 1) * K + 1] = -1;
  idx[1 * K + 1] = -1;
  int32_t *fill = calloc((size_t)E, sizeof *fill);
  for (int64_t i = 0; i < T * K; i++) loc[i] = idx[i] >= 0 ? fill[idx[i]]++ : -1;
  for (int64_t i = 0; i < T * K; i++)
    if (idx[i] >= 0 && loc[i] >= capacity) idx[i] = loc[i] = -1;
  free(fill);
}

static float encode(int32_t rank, int32_t token, int32_t slot) { return (float)(rank * 10000 + token * 10 + slot + 1); }

static int run_scene(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  const scene_t *sc = arg;
  const int32_t E = E_PER_RANK * world, capacity = 6;
  int failures = 0;
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, K, 0);
  c.layout = sc->layout;
  c.exchange = sc->exchange;
  c.capacity = capacity;
  c.expert_alignment = 2;
  int64_t T = tokens_of(rank);
  int32_t idx[64], loc[64];
  float w[64], grad_w[64];
  routing_of(rank, E, idx, w, loc, capacity);
  epx_buffer_t buf = NULL;
  epx_handle_t h = NULL;
  int32_t *src_rank = NULL, *src_token = NULL, *recv_expert = NULL;
  float *grad_recv_w = NULL;
  if (epx_buffer_create(comm, &c, &buf) != EPX_SUCCESS) goto fail;
  epx_routing_t r = {T, K, idx, w, loc, EPX_WEIGHTS_NONE};
  if (epx_dispatch_layout(buf, &r, NULL, &h) != EPX_SUCCESS) goto fail;
  int64_t N = 0;
  if (epx_handle_recv_rows(h, &N) != EPX_SUCCESS) goto fail;
  int32_t slots = sc->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  src_rank = calloc((size_t)N + 1, sizeof(int32_t));
  src_token = calloc((size_t)N + 1, sizeof(int32_t));
  recv_expert = calloc((size_t)(N * slots) + 1, sizeof(int32_t));
  grad_recv_w = calloc((size_t)(N * slots) + 1, sizeof(float));
  if (epx_handle_recv_source(h, src_rank, src_token) != EPX_SUCCESS) goto fail;
  if (epx_handle_recv_routing(h, recv_expert, NULL) != EPX_SUCCESS) goto fail;
  for (int64_t row = 0; row < N; row++)
    for (int32_t s = 0; s < slots; s++) {
      int32_t e = recv_expert[row * slots + s];
      float v = -7.0f; /* must never come home: padding, empty slots, other slots */
      if (e >= 0) {
        /* find the slot of this route at its source */
        int32_t sidx[64], sloc[64];
        float sw[64];
        routing_of(src_rank[row], E, sidx, sw, sloc, capacity);
        int32_t slot = -1;
        for (int32_t k = 0; k < K; k++)
          if (sidx[src_token[row] * K + k] == e) slot = k;
        if (slots > 1 && slot != s) {
          fprintf(stderr, "rank %d: rank-major row %lld slot %d holds expert %d of source slot %d\n", rank,
                  (long long)row, s, e, slot);
          failures++;
        }
        v = encode(src_rank[row], src_token[row], slot);
      }
      grad_recv_w[row * slots + s] = v;
    }
  tu_poison(grad_w, sizeof grad_w);
  if (epx_weights_backward(buf, h, grad_recv_w, grad_w) != EPX_SUCCESS) goto fail;
  for (int64_t t = 0; t < T; t++)
    for (int32_t k = 0; k < K; k++) {
      float want = idx[t * K + k] >= 0 ? encode(rank, (int32_t)t, k) : 0.0f;
      if (grad_w[t * K + k] != want) {
        fprintf(stderr, "rank %d (W=%d layout %d exchange %d): grad_w[%lld][%d] = %g, want %g\n", rank, world,
                (int)sc->layout, (int)sc->exchange, (long long)t, k, grad_w[t * K + k], want);
        failures++;
      }
    }
  goto done;
fail:
  fprintf(stderr, "rank %d: %s\n", rank, epx_last_error());
  failures++;
done:
  epx_handle_release(h);
  epx_buffer_destroy(buf);
  free(src_rank);
  free(src_token);
  free(recv_expert);
  free(grad_recv_w);
  return failures;
}

static void test_provenance(void **state) {
  (void)state;
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_RANK_MAJOR, EPX_LAYOUT_CAPACITY};
  for (int l = 0; l < 3; l++)
    for (int x = 0; x < 2; x++) {
      scene_t sc = {layouts[l], x ? EPX_EXCHANGE_COLLECTIVE : EPX_EXCHANGE_DEDUP};
      epx_comm_t self = NULL;
      EXPECT_OK(epx_comm_create_self(&self));
      assert_int_equal(run_scene(self, 0, 1, &sc), 0);
      EXPECT_OK(epx_comm_destroy(self));
      for (int32_t W = 2; W <= 4; W++) assert_int_equal(tu_run_ranks(W, 10.0, run_scene, &sc), 0);
    }
}

/* Rank-major, weights applied by the expert: out = sum over the token's
 * slots of w * x (the expert is the identity, weighted by recv_w). The weight
 * gradient of L = <G, out> is <G[t], x[t]>; it must come home through
 * epx_weights_backward, equal to the direct formula. */
static void test_rank_major_router_gradient(void **state) {
  (void)state;
  const int64_t T = 12;
  const int32_t E = 6;
  tu_rng_t rng = {0x1234};
  int32_t idx[12 * K];
  float w[12 * K], x[12 * H], G[12 * H], grad_w[12 * K];
  tu_random_routing(&rng, T, E, K, 0.0, idx, w);
  tu_fill(&rng, EPX_FLOAT32, x, T * H);
  tu_fill(&rng, EPX_FLOAT32, G, T * H);
  epx_comm_t comm = NULL;
  epx_buffer_t buf = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, K, 0);
  c.layout = EPX_LAYOUT_RANK_MAJOR;
  EXPECT_OK(epx_buffer_create(comm, &c, &buf));
  epx_routing_t r = {T, K, idx, w, NULL, EPX_WEIGHTS_NONE};
  EXPECT_OK(epx_dispatch_layout(buf, &r, NULL, &h));
  int64_t N;
  EXPECT_OK(epx_handle_recv_rows(h, &N));
  float *recv_x = tu_alloc(sizeof(float) * (size_t)(N * H)), *grad_recv = tu_alloc(sizeof(float) * (size_t)(N * H));
  float *recv_w = tu_alloc(sizeof(float) * (size_t)(N * K)), *grad_recv_w = tu_alloc(sizeof(float) * (size_t)(N * K));
  EXPECT_OK(epx_dispatch(buf, h, x, recv_x, N));
  EXPECT_OK(epx_handle_recv_routing(h, NULL, recv_w));
  /* the expert's weight gradient per (row, slot): <grad of its output, input> */
  EXPECT_OK(epx_combine_backward(buf, h, G, NULL, grad_recv, NULL));
  for (int64_t row = 0; row < N; row++)
    for (int32_t k = 0; k < K; k++) {
      float dot = 0.0f;
      for (int32_t i = 0; i < H; i++) dot += grad_recv[row * H + i] * recv_x[row * H + i];
      grad_recv_w[row * K + k] = recv_w[row * K + k] != 0.0f ? dot : 0.0f;
    }
  EXPECT_OK(epx_weights_backward(buf, h, grad_recv_w, grad_w));
  int nonzero = 0;
  for (int64_t t = 0; t < T; t++) {
    float dot = 0.0f;
    for (int32_t i = 0; i < H; i++) dot += G[t * H + i] * x[t * H + i];
    for (int32_t k = 0; k < K; k++) {
      assert_float_equal(grad_w[t * K + k], dot, 1e-5);
      nonzero += grad_w[t * K + k] != 0.0f;
    }
  }
  assert_true(nonzero > 0);
  /* bad arguments: NULL outputs are refused and name the argument */
  EXPECT_STATUS(epx_weights_backward(buf, h, NULL, grad_w), EPX_ERROR_INVALID_ARGUMENT, "grad_recv_w");
  EXPECT_STATUS(epx_weights_backward(buf, h, grad_recv_w, NULL), EPX_ERROR_INVALID_ARGUMENT, "grad_w");
  EXPECT_OK(epx_handle_release(h));
  EXPECT_STATUS(epx_weights_backward(buf, h, grad_recv_w, grad_w), EPX_ERROR_INVALID_HANDLE, "handle");
  EXPECT_OK(epx_buffer_destroy(buf));
  EXPECT_OK(epx_comm_destroy(comm));
  tu_free(recv_x);
  tu_free(grad_recv);
  tu_free(recv_w);
  tu_free(grad_recv_w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_provenance),
      cmocka_unit_test(test_rank_major_router_gradient),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
