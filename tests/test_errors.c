/* Every refusal of DESIGN.md "Errors" that one rank can meet: the status, a
 * piece of the message that names the argument, and — the contract's other
 * half — that nothing the caller owns changed: outputs were poisoned and
 * inputs filled before the call, and both are compared byte for byte after.
 * Each check re-runs the valid call afterwards where it matters, to show the
 * refusal left the objects usable. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/registry.h"
#include "testutil.h"
#include "buffer_config.h"

/* ------------------------------------------------------------------------ */
/* Watched memory: byte copies taken before a refused call                   */
/* ------------------------------------------------------------------------ */

#define MAX_WATCH 24
static struct {
  const void *p;
  void *copy;
  size_t n;
  const char *name;
} g_watch[MAX_WATCH];
static int g_nwatch;

static void watch(const void *p, size_t n, const char *name) {
  if (g_nwatch == MAX_WATCH) fail_msg("too many watched regions");
  g_watch[g_nwatch].p = p;
  g_watch[g_nwatch].n = n;
  g_watch[g_nwatch].name = name;
  g_watch[g_nwatch].copy = malloc(n ? n : 1);
  g_nwatch++;
}

static void snapshot(void) {
  for (int i = 0; i < g_nwatch; i++) memcpy(g_watch[i].copy, g_watch[i].p, g_watch[i].n);
}

static void unchanged(const char *call) {
  for (int i = 0; i < g_nwatch; i++)
    if (memcmp(g_watch[i].copy, g_watch[i].p, g_watch[i].n))
      fail_msg("%s was refused but changed %s", call, g_watch[i].name);
}

static void unwatch_all(void) {
  for (int i = 0; i < g_nwatch; i++) free(g_watch[i].copy);
  g_nwatch = 0;
}

/* The call must fail with `status`, say `needle`, and change no watched byte. */
#define EXPECT_REFUSED(call, status, needle) \
  do {                                       \
    snapshot();                              \
    EXPECT_STATUS(call, status, needle);  \
    unchanged(#call);                        \
  } while (0)

/* ------------------------------------------------------------------------ */
/* A valid setup to break one argument at a time                             */
/* ------------------------------------------------------------------------ */

enum { T = 6, E = 8, K = 2, H = 16, C = 3, MAXT = 8 };

typedef struct {
  epx_comm_t comm;
  epx_buffer_t b;
  epx_handle_t h;
  int64_t N;
  int32_t idx[T * K], loc[T * K];
  float w[T * K];
  /* Payloads [rows + 1, H]: one spare row so that p + 1 float stays inside. */
  float *x, *recv, *y, *out, *gx, *geo;
  float gw[T * K + 4];
} fx_t;

static epx_buffer_t buffer_make(epx_comm_t comm, epx_layout_t layout, int64_t max_tokens) {
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, K, max_tokens);
  c.max_tokens_rounding = 8;
  c.layout = layout;
  c.capacity = layout == EPX_LAYOUT_CAPACITY ? C : 0;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  return b;
}

/* Token t picks experts (t, t + 3) mod E at locations in capacity order. */
static void fx_routing(fx_t *f) {
  int32_t fill[E] = {0};
  for (int32_t t = 0; t < T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = (t + 3 * k) % E;
      f->idx[t * K + k] = e;
      f->loc[t * K + k] = fill[e]++;
      f->w[t * K + k] = 0.25f + 0.125f * (float)(t + k);
    }
}

static float *payload(tu_rng_t *rng, int64_t rows) {
  float *p = tu_alloc(sizeof(float) * (size_t)((rows + 1) * H));
  tu_fill(rng, EPX_FLOAT32, p, (rows + 1) * H);
  return p;
}

static fx_t *fx_make(epx_layout_t layout, epx_weighting_t wt) {
  static tu_rng_t rng = {0xe7707};
  fx_t *f = calloc(1, sizeof *f);
  EXPECT_OK(epx_comm_create_self(&f->comm));
  f->b = buffer_make(f->comm, layout, MAXT);
  fx_routing(f);
  epx_routing_t r = {T, K, f->idx, f->w, layout == EPX_LAYOUT_CAPACITY ? f->loc : NULL, wt};
  EXPECT_OK(epx_dispatch_layout(f->b, &r, NULL, &f->h));
  EXPECT_OK(epx_handle_recv_rows(f->h, &f->N));
  f->x = payload(&rng, T);
  f->y = payload(&rng, f->N);
  f->recv = payload(&rng, f->N);
  f->out = payload(&rng, T);
  f->gx = payload(&rng, T);
  f->geo = payload(&rng, f->N);
  tu_poison(f->recv, sizeof(float) * (size_t)((f->N + 1) * H));
  tu_poison(f->out, sizeof(float) * (size_t)((T + 1) * H));
  tu_poison(f->gx, sizeof(float) * (size_t)((T + 1) * H));
  tu_poison(f->geo, sizeof(float) * (size_t)((f->N + 1) * H));
  tu_poison(f->gw, sizeof f->gw);
  /* Everything the caller owns. */
  watch(f->idx, sizeof f->idx, "topk_idx");
  watch(f->loc, sizeof f->loc, "locations");
  watch(f->w, sizeof f->w, "topk_w");
  watch(f->x, sizeof(float) * (size_t)((T + 1) * H), "x");
  watch(f->y, sizeof(float) * (size_t)((f->N + 1) * H), "expert_out");
  watch(f->recv, sizeof(float) * (size_t)((f->N + 1) * H), "recv_x");
  watch(f->out, sizeof(float) * (size_t)((T + 1) * H), "out");
  watch(f->gx, sizeof(float) * (size_t)((T + 1) * H), "grad_x");
  watch(f->geo, sizeof(float) * (size_t)((f->N + 1) * H), "grad_expert_out");
  watch(f->gw, sizeof f->gw, "grad_w");
  return f;
}

static void fx_free(fx_t *f) {
  unwatch_all();
  EXPECT_OK(epx_handle_release(f->h));
  EXPECT_OK(epx_buffer_destroy(f->b));
  EXPECT_OK(epx_comm_destroy(f->comm));
  float *bufs[] = {f->x, f->recv, f->y, f->out, f->gx, f->geo};
  for (size_t i = 0; i < 6; i++) tu_free(bufs[i]);
  free(f);
}

static epx_routing_t routing_of(fx_t *f, epx_weighting_t wt) {
  return (epx_routing_t){T, K, f->idx, f->w, f->loc, wt};
}

/* epx_dispatch_layout refused: the handle argument keeps its value. */
#define SENTINEL_HANDLE ((epx_handle_t)(uintptr_t)0x5e1f)
#define EXPECT_LAYOUT_REFUSED(f, routing_ptr, status, needle)                    \
  do {                                                                           \
    epx_handle_t h_ = SENTINEL_HANDLE;                                           \
    EXPECT_REFUSED(epx_dispatch_layout((f)->b, (routing_ptr), NULL, &h_), status, needle); \
    assert_ptr_equal(h_, SENTINEL_HANDLE);                                       \
  } while (0)

/* ------------------------------------------------------------------------ */
/* Routing values                                                            */
/* ------------------------------------------------------------------------ */

static void test_expert_out_of_range(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_routing_t r = routing_of(f, EPX_WEIGHTS_IN_COMBINE);
  r.locations = NULL;
  f->idx[3] = E;
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.topk_idx[1][1] is 8");
  f->idx[3] = -2;
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.topk_idx[1][1] is -2");
  f->idx[3] = INT32_MIN;
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "outside [-1, num_experts = 8)");
  f->idx[3] = 4;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(f->b, &r, NULL, &h));
  EXPECT_OK(epx_handle_release(h));
  fx_free(f);
}

static void test_duplicate_experts(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_routing_t r = routing_of(f, EPX_WEIGHTS_IN_COMBINE);
  r.locations = NULL;
  f->idx[5 * K + 1] = f->idx[5 * K];
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.topk_idx[5] names expert 5 twice");
  fx_free(f);
}

static void test_capacity_locations(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_CAPACITY, EPX_WEIGHTS_IN_COMBINE);
  epx_routing_t r = routing_of(f, EPX_WEIGHTS_IN_COMBINE);
  int32_t keep = f->loc[4];
  f->loc[4] = C;
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.locations[2][0] is 3, outside the capacity [0, 3)");
  f->loc[4] = -1; /* a kept route needs a slot; -1 is only for dropped routes */
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.locations[2][0] is -1");
  /* Expert 4 holds token 1 (slot 0) and token 4 (slot 1): put both in slot 0. */
  f->loc[4] = keep;
  int32_t e = f->idx[1 * K + 1];  /* expert 4, slot of token 1 */
  int32_t other = -1;
  for (int32_t i = 0; i < T * K; i++)
    if (i != 1 * K + 1 && f->idx[i] == e) other = i;
  assert_true(other >= 0);
  keep = f->loc[other];
  f->loc[other] = f->loc[1 * K + 1];
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "is taken twice for expert 4");
  f->loc[other] = keep;
  /* The locations are not needed elsewhere: a dropped route's is ignored. */
  f->idx[0] = -1;
  f->loc[0] = 1000;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(f->b, &r, NULL, &h));
  EXPECT_OK(epx_handle_release(h));
  fx_free(f);
}

/* ------------------------------------------------------------------------ */
/* Sizes and configs                                                         */
/* ------------------------------------------------------------------------ */

static void test_k_above_e(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, E + 1, 0);
  epx_buffer_t b = (epx_buffer_t)(uintptr_t)0xb0f;
  watch(&c, sizeof c, "config");
  EXPECT_REFUSED(epx_buffer_create(comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, "config.max_top_k is 9; it must be in [1, num_experts = 8]");
  assert_ptr_equal(b, (epx_buffer_t)(uintptr_t)0xb0f);
  unwatch_all();

  /* A buffer for K = E, then a routing with K = E + 1. */
  c.max_top_k = E;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  int32_t idx[2 * (E + 1)];
  float w[2 * (E + 1)];
  for (int32_t i = 0; i < 2 * (E + 1); i++) {
    idx[i] = i % (E + 1) == E ? -1 : i % (E + 1);
    w[i] = 0.1f;
  }
  epx_routing_t r = {2, E + 1, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = SENTINEL_HANDLE;
  watch(idx, sizeof idx, "topk_idx");
  watch(w, sizeof w, "topk_w");
  EXPECT_REFUSED(epx_dispatch_layout(b, &r, NULL, &h), EPX_ERROR_INVALID_ARGUMENT, "top_k cannot exceed num_experts");
  assert_ptr_equal(h, SENTINEL_HANDLE);
  r.top_k = 0;
  EXPECT_REFUSED(epx_dispatch_layout(b, &r, NULL, &h), EPX_ERROR_INVALID_ARGUMENT, "routing.top_k is 0");
  unwatch_all();
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));

  /* The router and the reference refuse K > E too. */
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  rc.num_experts = E;
  rc.top_k = E + 1;
  float logits[E] = {0};
  int32_t out_idx[E + 1];
  float out_w[E + 1];
  tu_poison(out_idx, sizeof out_idx);
  tu_poison(out_w, sizeof out_w);
  epx_route_output_t ro = {out_idx, out_w, NULL, NULL, NULL, NULL, 0, 0};
  watch(out_idx, sizeof out_idx, "topk_idx");
  watch(out_w, sizeof out_w, "topk_w");
  EXPECT_REFUSED(epx_route(&rc, 1, logits, NULL, &ro), EPX_ERROR_INVALID_ARGUMENT, "top_k 9 exceeds num_experts 8");
  unwatch_all();
  _Alignas(16) float x[H] = {0};
  _Alignas(16) float out[E * 1 * H];
  int32_t loc[E + 1] = {0};
  tu_poison(out, sizeof out);
  watch(out, sizeof out, "out");
  EXPECT_REFUSED(epx_reference_dense_dispatch(EPX_FLOAT32, 1, H, E, 1, E + 1, idx, w, loc, EPX_WEIGHTS_NONE, x, out),
                 EPX_ERROR_INVALID_ARGUMENT, "top_k is 9; it must be in [1, num_experts = 8]");
  unwatch_all();
}

static void test_too_many_tokens(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  int32_t idx[(MAXT + 1) * K];
  float w[(MAXT + 1) * K];
  for (int32_t i = 0; i < (MAXT + 1) * K; i++) {
    idx[i] = (i / K + 3 * (i % K)) % E;
    w[i] = 0.5f;
  }
  epx_routing_t r = {MAXT + 1, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  watch(idx, sizeof idx, "big topk_idx");
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_CAPACITY_EXCEEDED, "exceeds the buffer's max_tokens_per_rank 8");
  /* Exactly the maximum is fine. */
  r.num_tokens = MAXT;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(f->b, &r, NULL, &h));
  EXPECT_OK(epx_handle_release(h));
  fx_free(f);

  /* Agreed at the first layout (5 tokens, rounded up to 8), then refused. */
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_t b = buffer_make(comm, EPX_LAYOUT_EXPERT_MAJOR, 0);
  int64_t agreed = -1;
  EXPECT_OK(epx_buffer_max_tokens(b, &agreed));
  assert_int_equal(agreed, 0);
  r.num_tokens = 5;
  EXPECT_OK(epx_dispatch_layout(b, &r, NULL, &h));
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_max_tokens(b, &agreed));
  assert_int_equal(agreed, 8);
  r.num_tokens = 9;
  h = SENTINEL_HANDLE;
  watch(idx, sizeof idx, "big topk_idx");
  EXPECT_REFUSED(epx_dispatch_layout(b, &r, NULL, &h), EPX_ERROR_CAPACITY_EXCEEDED, "max_tokens_per_rank");
  assert_ptr_equal(h, SENTINEL_HANDLE);
  unwatch_all();
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
}

static void test_negative_and_bad_sizes(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_routing_t r = routing_of(f, EPX_WEIGHTS_IN_COMBINE);
  r.num_tokens = -1;
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.num_tokens is -1");
  r.num_tokens = T;
  r.top_k = -2;
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.top_k is -2");

  /* Buffer configs, one bad field at a time. */
  static const struct {
    int field;
    int64_t value;
    const char *needle;
  } bad[] = {
      {0, -8, "config.hidden is -8"},           {0, 12, "config.hidden is 12"},
      {1, -1, "config.num_experts is -1"},      {1, 0, "config.num_experts is 0"},
      {2, -1, "config.max_tokens_per_rank is -1"}, {3, 0, "config.expert_alignment is 0"},
      {4, -1, "config.capacity is -1"},         {5, 0, "EPX_LAYOUT_CAPACITY needs the capacity C >= 1"},
      {6, 0, "config.max_tokens_rounding is 0"}, {7, 0, "config.max_top_k is 0"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, K, 0);
    switch (bad[i].field) {
      case 0: c.hidden = bad[i].value; break;
      case 1: c.num_experts = (int32_t)bad[i].value; break;
      case 2: c.max_tokens_per_rank = bad[i].value; break;
      case 3: c.expert_alignment = (int32_t)bad[i].value; break;
      case 4: c.capacity = (int32_t)bad[i].value; break;
      case 5: c.layout = EPX_LAYOUT_CAPACITY, c.capacity = (int32_t)bad[i].value; break;
      case 6: c.max_tokens_rounding = (int32_t)bad[i].value; break;
      case 7: c.max_top_k = (int32_t)bad[i].value; break;
    }
    epx_buffer_t b = (epx_buffer_t)(uintptr_t)0xb0f;
    watch(&c, sizeof c, "config");
    EXPECT_REFUSED(epx_buffer_create(f->comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, bad[i].needle);
    assert_ptr_equal(b, (epx_buffer_t)(uintptr_t)0xb0f);
    unwatch_all();
  }

  /* The references. */
  _Alignas(16) float out[E * C * H];
  tu_poison(out, sizeof out);
  watch(out, sizeof out, "out");
  watch(f->x, sizeof(float) * T * H, "x");
  EXPECT_REFUSED(epx_reference_dense_dispatch(EPX_FLOAT32, -1, H, E, C, K, f->idx, f->w, f->loc, EPX_WEIGHTS_NONE, f->x, out),
                 EPX_ERROR_INVALID_ARGUMENT, "num_tokens is -1");
  EXPECT_REFUSED(epx_reference_dense_dispatch(EPX_FLOAT32, T, -8, E, C, K, f->idx, f->w, f->loc, EPX_WEIGHTS_NONE, f->x, out),
                 EPX_ERROR_INVALID_ARGUMENT, "hidden is -8");
  EXPECT_REFUSED(epx_reference_dense_dispatch(EPX_FLOAT32, T, H, E, -1, K, f->idx, f->w, f->loc, EPX_WEIGHTS_NONE, f->x, out),
                 EPX_ERROR_INVALID_ARGUMENT, "capacity is -1");
  EXPECT_REFUSED(epx_reference_dense_combine(EPX_FLOAT32, T, H, 0, C, K, f->idx, f->w, f->loc, EPX_WEIGHTS_NONE, f->y, out),
                 EPX_ERROR_INVALID_ARGUMENT, "num_experts is 0");
  unwatch_all();
  /* The router. */
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  rc.num_experts = E;
  rc.top_k = K;
  int32_t ri[K];
  float rw[K], logits[E] = {0};
  epx_route_output_t ro = {ri, rw, NULL, NULL, NULL, NULL, 0, 0};
  EXPECT_STATUS(epx_route(&rc, -1, logits, NULL, &ro), EPX_ERROR_INVALID_ARGUMENT, "num_tokens is -1");
  fx_free(f);
}

/* ------------------------------------------------------------------------ */
/* Dtypes, weightings and layouts                                            */
/* ------------------------------------------------------------------------ */

static void test_unsupported_dtype_and_weighting(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, (epx_dtype_t)3, H, E, K, 0);
  epx_buffer_t b = (epx_buffer_t)(uintptr_t)0xb0f;
  EXPECT_REFUSED(epx_buffer_create(f->comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, "config.dtype 3 is not");
  if (!epx_has_cuda()) {
    c.dtype = EPX_FLOAT32;
    c.device = EPX_DEVICE_CUDA;
    EXPECT_REFUSED(epx_buffer_create(f->comm, &c, &b), EPX_ERROR_UNSUPPORTED, "no CUDA backend");
  }
  assert_ptr_equal(b, (epx_buffer_t)(uintptr_t)0xb0f);

  /* Rank-major leaves the weights to the expert: any other weighting is refused. */
  epx_buffer_t rm = buffer_make(f->comm, EPX_LAYOUT_RANK_MAJOR, MAXT);
  epx_routing_t r = routing_of(f, EPX_WEIGHTS_IN_COMBINE);
  r.locations = NULL;
  epx_handle_t h = SENTINEL_HANDLE;
  EXPECT_REFUSED(epx_dispatch_layout(rm, &r, NULL, &h), EPX_ERROR_UNSUPPORTED, "pass routing.weighting = EPX_WEIGHTS_NONE");
  r.weighting = EPX_WEIGHTS_IN_DISPATCH;
  EXPECT_REFUSED(epx_dispatch_layout(rm, &r, NULL, &h), EPX_ERROR_UNSUPPORTED, "EPX_LAYOUT_RANK_MAJOR");
  assert_ptr_equal(h, SENTINEL_HANDLE);
  r.weighting = EPX_WEIGHTS_NONE;
  EXPECT_OK(epx_dispatch_layout(rm, &r, NULL, &h));
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(rm));

  /* Not an epx_weighting_t at all. */
  r.weighting = (epx_weighting_t)7;
  EXPECT_LAYOUT_REFUSED(f, &r, EPX_ERROR_INVALID_ARGUMENT, "routing.weighting 7 is not an epx_weighting_t");

  /* The references check dtype and weighting the same way. */
  _Alignas(16) float out[E * C * H];
  tu_poison(out, sizeof out);
  watch(out, sizeof out, "reference out");
  EXPECT_REFUSED(epx_reference_dense_dispatch((epx_dtype_t)9, T, H, E, C, K, f->idx, f->w, f->loc, EPX_WEIGHTS_NONE, f->x, out),
                 EPX_ERROR_INVALID_ARGUMENT, "dtype 9 is not");
  EXPECT_REFUSED(epx_reference_dense_combine(EPX_FLOAT32, T, H, E, C, K, f->idx, f->w, f->loc, (epx_weighting_t)5, f->y, out),
                 EPX_ERROR_INVALID_ARGUMENT, "weighting 5 is not");
  fx_free(f);
}

/* ------------------------------------------------------------------------ */
/* Pointers                                                                  */
/* ------------------------------------------------------------------------ */

static void test_layout_pointers(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_CAPACITY, EPX_WEIGHTS_IN_COMBINE);
  epx_routing_t r = routing_of(f, EPX_WEIGHTS_IN_COMBINE);
  epx_handle_t h = SENTINEL_HANDLE;
  EXPECT_REFUSED(epx_dispatch_layout(f->b, NULL, NULL, &h), EPX_ERROR_INVALID_ARGUMENT, "routing is NULL");
  EXPECT_REFUSED(epx_dispatch_layout(f->b, &r, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "handle is NULL");
  EXPECT_REFUSED(epx_dispatch_layout(NULL, &r, NULL, &h), EPX_ERROR_INVALID_ARGUMENT, "buffer is NULL");
  epx_routing_t bad = r;
  bad.topk_idx = NULL;
  EXPECT_LAYOUT_REFUSED(f, &bad, EPX_ERROR_INVALID_ARGUMENT, "routing.topk_idx is NULL");
  bad.topk_idx = (const int32_t *)((const char *)f->idx + 2);
  EXPECT_LAYOUT_REFUSED(f, &bad, EPX_ERROR_INVALID_ARGUMENT, "routing.topk_idx is not 4-byte aligned");
  bad = r;
  bad.topk_w = NULL;
  EXPECT_LAYOUT_REFUSED(f, &bad, EPX_ERROR_INVALID_ARGUMENT, "routing.topk_w is NULL but weighting is not EPX_WEIGHTS_NONE");
  bad.topk_w = (const float *)((const char *)f->w + 1);
  EXPECT_LAYOUT_REFUSED(f, &bad, EPX_ERROR_INVALID_ARGUMENT, "routing.topk_w is not 4-byte aligned");
  bad = r;
  bad.locations = NULL;
  EXPECT_LAYOUT_REFUSED(f, &bad, EPX_ERROR_INVALID_ARGUMENT, "routing.locations is NULL");
  bad.locations = (const int32_t *)((const char *)f->loc + 3);
  EXPECT_LAYOUT_REFUSED(f, &bad, EPX_ERROR_INVALID_ARGUMENT, "routing.locations is not 4-byte aligned");
  fx_free(f);
}

static void test_payload_pointers(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_buffer_t b = f->b;
  epx_handle_t h = f->h;
  int64_t N = f->N;
  /* dispatch */
  EXPECT_REFUSED(epx_dispatch(b, h, NULL, f->recv, N), EPX_ERROR_INVALID_ARGUMENT, "epx_dispatch: x is NULL");
  EXPECT_REFUSED(epx_dispatch(b, h, f->x + 1, f->recv, N), EPX_ERROR_INVALID_ARGUMENT, "x is not 16-byte aligned");
  EXPECT_REFUSED(epx_dispatch(b, h, f->x, NULL, N), EPX_ERROR_INVALID_ARGUMENT, "recv_x is NULL");
  EXPECT_REFUSED(epx_dispatch(b, h, f->x, f->recv + 2, N), EPX_ERROR_INVALID_ARGUMENT, "recv_x is not 16-byte aligned");
  EXPECT_REFUSED(epx_dispatch(NULL, h, f->x, f->recv, N), EPX_ERROR_INVALID_ARGUMENT, "buffer is NULL");
  EXPECT_REFUSED(epx_dispatch(b, NULL, f->x, f->recv, N), EPX_ERROR_INVALID_ARGUMENT, "handle is NULL");
  /* combine */
  EXPECT_REFUSED(epx_combine(b, h, NULL, f->out), EPX_ERROR_INVALID_ARGUMENT, "expert_out is NULL");
  EXPECT_REFUSED(epx_combine(b, h, f->y + 3, f->out), EPX_ERROR_INVALID_ARGUMENT, "expert_out is not 16-byte aligned");
  EXPECT_REFUSED(epx_combine(b, h, f->y, NULL), EPX_ERROR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_REFUSED(epx_combine(b, h, f->y, f->out + 1), EPX_ERROR_INVALID_ARGUMENT, "out is not 16-byte aligned");
  EXPECT_REFUSED(epx_combine(b, h, f->y, f->y), EPX_ERROR_INVALID_ARGUMENT, "out aliases expert_out");
  /* dispatch_backward */
  EXPECT_REFUSED(epx_dispatch_backward(b, h, NULL, f->gx, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "grad_recv_x is NULL");
  EXPECT_REFUSED(epx_dispatch_backward(b, h, f->recv, NULL, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "grad_x is NULL");
  EXPECT_REFUSED(epx_dispatch_backward(b, h, f->y, f->gx + 2, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "grad_x is not 16-byte aligned");
  /* combine_backward */
  EXPECT_REFUSED(epx_combine_backward(b, h, NULL, f->y, f->geo, f->gw), EPX_ERROR_INVALID_ARGUMENT, "grad_out is NULL");
  EXPECT_REFUSED(epx_combine_backward(b, h, f->out, f->y, NULL, f->gw), EPX_ERROR_INVALID_ARGUMENT, "grad_expert_out is NULL");
  EXPECT_REFUSED(epx_combine_backward(b, h, f->x, NULL, f->geo, f->gw), EPX_ERROR_INVALID_ARGUMENT, "expert_out is NULL");
  EXPECT_REFUSED(epx_combine_backward(b, h, f->x, f->y, f->geo, (float *)((char *)f->gw + 2)), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_w is not 4-byte aligned");
  fx_free(f);
}

static void test_recv_capacity_too_small(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  char needle[128];
  snprintf(needle, sizeof needle, "recv_rows_capacity %lld is below the handle's %lld rows", (long long)(f->N - 1), (long long)f->N);
  EXPECT_REFUSED(epx_dispatch(f->b, f->h, f->x, f->recv, f->N - 1), EPX_ERROR_CAPACITY_EXCEEDED, needle);
  EXPECT_REFUSED(epx_dispatch(f->b, f->h, f->x, f->recv, -1), EPX_ERROR_CAPACITY_EXCEEDED, "recv_rows_capacity -1");
  EXPECT_OK(epx_dispatch(f->b, f->h, f->x, f->recv, f->N));
  fx_free(f);
}

/* ------------------------------------------------------------------------ */
/* Object lifetimes                                                          */
/* ------------------------------------------------------------------------ */

static void test_handle_of_another_buffer(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_buffer_t other = buffer_make(f->comm, EPX_LAYOUT_EXPERT_MAJOR, MAXT);
  EXPECT_REFUSED(epx_dispatch(other, f->h, f->x, f->recv, f->N), EPX_ERROR_INVALID_HANDLE, "handle belongs to another buffer");
  EXPECT_REFUSED(epx_combine(other, f->h, f->y, f->out), EPX_ERROR_INVALID_HANDLE, "handle belongs to another buffer");
  EXPECT_REFUSED(epx_dispatch_backward(other, f->h, f->y, f->gx, NULL, NULL), EPX_ERROR_INVALID_HANDLE, "another buffer");
  EXPECT_REFUSED(epx_combine_backward(other, f->h, f->x, f->y, f->geo, f->gw), EPX_ERROR_INVALID_HANDLE, "another buffer");
  EXPECT_OK(epx_buffer_destroy(other));
  fx_free(f);
}

static void test_handle_after_release(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  /* A retained handle survives one release. */
  EXPECT_OK(epx_handle_retain(f->h));
  EXPECT_OK(epx_handle_release(f->h));
  EXPECT_OK(epx_dispatch(f->b, f->h, f->x, f->recv, f->N));
  tu_poison(f->recv, sizeof(float) * (size_t)((f->N + 1) * H));
  epx_handle_t dead = f->h;
  EXPECT_OK(epx_handle_release(dead));
  EXPECT_REFUSED(epx_dispatch(f->b, dead, f->x, f->recv, f->N), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  EXPECT_REFUSED(epx_combine(f->b, dead, f->y, f->out), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  EXPECT_REFUSED(epx_dispatch_backward(f->b, dead, f->y, f->gx, NULL, NULL), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  EXPECT_REFUSED(epx_combine_backward(f->b, dead, f->x, f->y, f->geo, f->gw), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  int64_t rows = -7;
  EXPECT_REFUSED(epx_handle_recv_rows(dead, &rows), EPX_ERROR_INVALID_HANDLE, "not live");
  assert_int_equal(rows, -7);
  EXPECT_REFUSED(epx_handle_retain(dead), EPX_ERROR_INVALID_HANDLE, "not live");
  EXPECT_REFUSED(epx_handle_release(dead), EPX_ERROR_INVALID_HANDLE, "not live");
  /* The buffer has no live handle left. */
  EXPECT_OK(epx_dispatch_layout(f->b, &(epx_routing_t){T, K, f->idx, f->w, NULL, EPX_WEIGHTS_IN_COMBINE}, NULL, &f->h));
  fx_free(f);
}

static void test_buffer_lifetime(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  /* Busy while a handle lives, and still whole afterwards. */
  EXPECT_REFUSED(epx_buffer_destroy(f->b), EPX_ERROR_BUSY, "1 handle(s) from this buffer are still alive");
  EXPECT_OK(epx_dispatch(f->b, f->h, f->x, f->recv, f->N));
  tu_poison(f->recv, sizeof(float) * (size_t)((f->N + 1) * H));
  epx_handle_t extra = NULL;
  epx_routing_t r = {T, K, f->idx, f->w, NULL, EPX_WEIGHTS_IN_COMBINE};
  EXPECT_OK(epx_dispatch_layout(f->b, &r, NULL, &extra));
  EXPECT_REFUSED(epx_buffer_destroy(f->b), EPX_ERROR_BUSY, "2 handle(s)");
  EXPECT_OK(epx_handle_release(extra));
  EXPECT_OK(epx_handle_release(f->h));
  /* Destroyed: every use is refused. */
  epx_buffer_t dead = f->b;
  EXPECT_OK(epx_buffer_destroy(dead));
  epx_handle_t h = SENTINEL_HANDLE;
  EXPECT_REFUSED(epx_dispatch_layout(dead, &r, NULL, &h), EPX_ERROR_INVALID_HANDLE, "buffer is not a live buffer");
  assert_ptr_equal(h, SENTINEL_HANDLE);
  EXPECT_REFUSED(epx_dispatch(dead, extra, f->x, f->recv, f->N), EPX_ERROR_INVALID_HANDLE, "buffer is not a live buffer");
  int64_t m = -7;
  EXPECT_REFUSED(epx_buffer_max_tokens(dead, &m), EPX_ERROR_INVALID_HANDLE, "not a live buffer");
  assert_int_equal(m, -7);
  EXPECT_REFUSED(epx_buffer_destroy(dead), EPX_ERROR_INVALID_HANDLE, "not a live buffer");
  /* fx_free expects a live buffer and handle. */
  f->b = buffer_make(f->comm, EPX_LAYOUT_EXPERT_MAJOR, MAXT);
  EXPECT_OK(epx_dispatch_layout(f->b, &r, NULL, &f->h));
  fx_free(f);
}

/* ------------------------------------------------------------------------ */
/* The weight gradient on the wrong backward                                 */
/* ------------------------------------------------------------------------ */

static void test_grad_w_on_wrong_backward(void **state) {
  (void)state;
  /* Weights in combine: dispatch_backward has no weight gradient. */
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  EXPECT_REFUSED(epx_dispatch_backward(f->b, f->h, f->y, f->gx, f->x, f->gw), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_w is given but the handle's weights were not applied in dispatch");
  EXPECT_REFUSED(epx_dispatch_backward(f->b, f->h, f->y, f->gx, f->x, NULL), EPX_ERROR_INVALID_ARGUMENT,
                 "x is given but the handle's weights were not applied in dispatch");
  fx_free(f);
  /* Weights in dispatch: combine_backward has none. */
  f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_DISPATCH);
  EXPECT_REFUSED(epx_combine_backward(f->b, f->h, f->x, f->y, f->geo, f->gw), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_w is given but the handle's weights were not applied in combine");
  EXPECT_REFUSED(epx_combine_backward(f->b, f->h, f->x, f->y, f->geo, NULL), EPX_ERROR_INVALID_ARGUMENT,
                 "expert_out is given");
  /* ... and dispatch_backward needs x for it. */
  EXPECT_REFUSED(epx_dispatch_backward(f->b, f->h, f->y, f->gx, NULL, f->gw), EPX_ERROR_INVALID_ARGUMENT, "x is NULL");
  EXPECT_REFUSED(epx_dispatch_backward(f->b, f->h, f->y, f->gx, f->x, (float *)((char *)f->gw + 1)),
                 EPX_ERROR_INVALID_ARGUMENT, "grad_w is not 4-byte aligned");
  fx_free(f);
  /* No weights: neither backward gives one. */
  f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_NONE);
  EXPECT_REFUSED(epx_dispatch_backward(f->b, f->h, f->y, f->gx, f->x, f->gw), EPX_ERROR_INVALID_ARGUMENT, "grad_w is given");
  EXPECT_REFUSED(epx_combine_backward(f->b, f->h, f->x, f->y, f->geo, f->gw), EPX_ERROR_INVALID_ARGUMENT, "grad_w is given");
  fx_free(f);
}

/* An output passed as the very pointer of an input of the same call (epx.h,
 * "Aliasing") is refused before anything moves. */
static void test_payload_aliases(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  EXPECT_REFUSED(epx_dispatch(f->b, f->h, f->x, f->x, f->N), EPX_ERROR_INVALID_ARGUMENT, "recv_x aliases x");
  EXPECT_REFUSED(epx_combine(f->b, f->h, f->y, f->y), EPX_ERROR_INVALID_ARGUMENT, "out aliases expert_out");
  EXPECT_REFUSED(epx_dispatch_backward(f->b, f->h, f->y, f->y, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_x aliases grad_recv_x");
  EXPECT_REFUSED(epx_combine_backward(f->b, f->h, f->out, f->y, f->out, f->gw), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_expert_out aliases grad_out");
  EXPECT_REFUSED(epx_combine_backward(f->b, f->h, f->x, f->y, f->y, f->gw), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_expert_out aliases expert_out");
  EXPECT_OK(epx_combine_backward(f->b, f->h, f->x, f->y, f->geo, f->gw));
  fx_free(f);
  f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_DISPATCH);
  EXPECT_REFUSED(epx_dispatch_backward(f->b, f->h, f->y, f->x, f->x, f->gw), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_x aliases x");
  EXPECT_OK(epx_dispatch_backward(f->b, f->h, f->y, f->gx, f->x, f->gw));
  fx_free(f);
  f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_NONE);
  EXPECT_REFUSED(epx_weights_backward(f->b, f->h, f->gw, f->gw), EPX_ERROR_INVALID_ARGUMENT,
                 "grad_w aliases grad_recv_w");
  fx_free(f);
}

/* ------------------------------------------------------------------------ */
/* The dense reference's own checks                                          */
/* ------------------------------------------------------------------------ */

static void test_reference_arguments(void **state) {
  (void)state;
  tu_rng_t rng = {0xe7708};
  int32_t idx[T * K], loc[T * K];
  float w[T * K];
  fx_t dummy;
  memset(&dummy, 0, sizeof dummy);
  fx_routing(&dummy);
  memcpy(idx, dummy.idx, sizeof idx);
  memcpy(loc, dummy.loc, sizeof loc);
  memcpy(w, dummy.w, sizeof w);
  float *x = payload(&rng, T), *y = payload(&rng, E * C), *out = tu_alloc(sizeof(float) * (E * C + 1) * H);
  tu_poison(out, sizeof(float) * (E * C + 1) * H);
  watch(idx, sizeof idx, "topk_idx");
  watch(loc, sizeof loc, "locations");
  watch(w, sizeof w, "topk_w");
  watch(x, sizeof(float) * (T + 1) * H, "x");
  watch(y, sizeof(float) * (E * C + 1) * H, "expert_out");
  watch(out, sizeof(float) * (E * C + 1) * H, "out");
  const epx_dtype_t f32 = EPX_FLOAT32;
#define DD(i, ww, l, wt, in, o) epx_reference_dense_dispatch(f32, T, H, E, C, K, i, ww, l, wt, in, o)
#define DC(i, ww, l, wt, in, o) epx_reference_dense_combine(f32, T, H, E, C, K, i, ww, l, wt, in, o)
  EXPECT_REFUSED(DD(NULL, w, loc, EPX_WEIGHTS_NONE, x, out), EPX_ERROR_INVALID_ARGUMENT, "topk_idx is NULL");
  EXPECT_REFUSED(DD(idx, NULL, loc, EPX_WEIGHTS_IN_DISPATCH, x, out), EPX_ERROR_INVALID_ARGUMENT, "topk_w is NULL");
  EXPECT_REFUSED(DD(idx, w, NULL, EPX_WEIGHTS_NONE, x, out), EPX_ERROR_INVALID_ARGUMENT, "locations is NULL");
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, NULL, out), EPX_ERROR_INVALID_ARGUMENT, "x is NULL");
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, x, NULL), EPX_ERROR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, x + 1, out), EPX_ERROR_INVALID_ARGUMENT, "x is not 16-byte aligned");
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, x, out + 2), EPX_ERROR_INVALID_ARGUMENT, "out is not 16-byte aligned");
  EXPECT_REFUSED(DD((const int32_t *)((const char *)idx + 1), w, loc, EPX_WEIGHTS_NONE, x, out), EPX_ERROR_INVALID_ARGUMENT,
                 "4-byte aligned");
  EXPECT_REFUSED(DC(idx, w, loc, EPX_WEIGHTS_NONE, NULL, out), EPX_ERROR_INVALID_ARGUMENT, "expert_out is NULL");
  EXPECT_REFUSED(DC(idx, w, loc, EPX_WEIGHTS_NONE, y + 1, out), EPX_ERROR_INVALID_ARGUMENT, "expert_out is not 16-byte aligned");
  /* Routing values: checked before anything is written. */
  idx[7] = E;
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, x, out), EPX_ERROR_INVALID_ARGUMENT, "topk_idx[3][1] is 8");
  idx[7] = -3;
  EXPECT_REFUSED(DC(idx, w, loc, EPX_WEIGHTS_NONE, y, out), EPX_ERROR_INVALID_ARGUMENT, "topk_idx[3][1] is -3");
  idx[7] = idx[6];
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, x, out), EPX_ERROR_INVALID_ARGUMENT, "topk_idx[3] names expert 3 twice");
  idx[7] = dummy.idx[7];
  loc[7] = C;
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, x, out), EPX_ERROR_INVALID_ARGUMENT, "locations[3][1] is 3, outside the capacity [0, 3)");
  /* Expert 3 holds token 0 (its second pick, slot 0) and token 3 (its first,
   * slot 1): put both in slot 0. */
  loc[7] = dummy.loc[7];
  loc[6] = loc[1];
  EXPECT_REFUSED(DD(idx, w, loc, EPX_WEIGHTS_NONE, x, out), EPX_ERROR_INVALID_ARGUMENT, "is taken twice for expert 3");
  loc[6] = dummy.loc[6];
  EXPECT_OK(DD(idx, w, loc, EPX_WEIGHTS_NONE, x, out));
#undef DD
#undef DC
  unwatch_all();
  tu_free(x);
  tu_free(y);
  tu_free(out);
}

/* ------------------------------------------------------------------------ */
/* NaN / Inf logits                                                          */
/* ------------------------------------------------------------------------ */

static void test_nonfinite_logits(void **state) {
  (void)state;
  tu_rng_t rng = {0xe7709};
  enum { RT = 7 };
  float logits[RT * E];
  for (int32_t i = 0; i < RT * E; i++) logits[i] = tu_normal(&rng);
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  rc.num_experts = E;
  rc.top_k = K;
  int32_t idx[RT * K], loc[RT * K], counts[E];
  float w[RT * K], aux = 0.0f, grad[RT * E];
  tu_poison(idx, sizeof idx);
  tu_poison(loc, sizeof loc);
  tu_poison(counts, sizeof counts);
  tu_poison(w, sizeof w);
  tu_poison(grad, sizeof grad);
  epx_route_output_t ro = {idx, w, loc, counts, &aux, NULL, 0, 0};
  watch(logits, sizeof logits, "logits");
  watch(idx, sizeof idx, "topk_idx");
  watch(loc, sizeof loc, "locations");
  watch(counts, sizeof counts, "expert_counts");
  watch(w, sizeof w, "topk_w");
  watch(&aux, sizeof aux, "aux_loss");
  watch(grad, sizeof grad, "grad_logits");

  /* EPX_NONFINITE_ERROR (the default): refused, naming the first bad token. */
  logits[2 * E + 5] = NAN;
  logits[4 * E + 1] = INFINITY;
  EXPECT_REFUSED(epx_route(&rc, RT, logits, NULL, &ro), EPX_ERROR_INVALID_ARGUMENT, "logits of token 2 are not finite");
  logits[2 * E + 5] = 0.5f;
  EXPECT_REFUSED(epx_route(&rc, RT, logits, NULL, &ro), EPX_ERROR_INVALID_ARGUMENT, "logits of token 4 are not finite");
  logits[4 * E + 1] = -INFINITY;
  EXPECT_REFUSED(epx_route(&rc, RT, logits, NULL, &ro), EPX_ERROR_INVALID_ARGUMENT, "logits[4, 1] is -inf");
  int32_t fwd_idx[RT * K];
  for (int32_t i = 0; i < RT * K; i++) fwd_idx[i] = -1;
  EXPECT_REFUSED(epx_route_backward(&rc, RT, logits, NULL, fwd_idx, NULL, 0.0f, 0.0f, grad), EPX_ERROR_INVALID_ARGUMENT,
                 "logits of token 4 are not finite");
  unwatch_all();

  /* EPX_NONFINITE_DROP: tokens 1 (NaN) and 4 (-Inf) get no experts; the rest
   * route exactly as the finite tokens alone would. */
  logits[1 * E + 0] = NAN;
  rc.nonfinite = EPX_NONFINITE_DROP;
  EXPECT_OK(epx_route(&rc, RT, logits, NULL, &ro));
  assert_int_equal(ro.nonfinite_tokens, 2);
  float finite_logits[(RT - 2) * E];
  int32_t fi[(RT - 2) * K], fl[(RT - 2) * K], fc[E];
  float fw[(RT - 2) * K], faux = 0.0f;
  for (int32_t t = 0, j = 0; t < RT; t++)
    if (t != 1 && t != 4) memcpy(finite_logits + (j++) * E, logits + t * E, sizeof(float) * E);
  epx_route_output_t fo = {fi, fw, fl, fc, &faux, NULL, 0, 0};
  EXPECT_OK(epx_route(&rc, RT - 2, finite_logits, NULL, &fo));
  assert_int_equal(fo.nonfinite_tokens, 0);
  for (int32_t t = 0, j = 0; t < RT; t++) {
    for (int32_t k = 0; k < K; k++) {
      if (t == 1 || t == 4) {
        assert_int_equal(idx[t * K + k], -1);
        assert_int_equal(loc[t * K + k], -1);
        assert_true(w[t * K + k] == 0.0f);
      } else {
        assert_int_equal(idx[t * K + k], fi[j * K + k]);
        assert_int_equal(loc[t * K + k], fl[j * K + k]);
        assert_true(w[t * K + k] == fw[j * K + k]);
      }
    }
    j += t != 1 && t != 4;
  }
  assert_memory_equal(counts, fc, sizeof counts);
  assert_true(aux == faux);
  /* Backward: the dropped tokens get zero gradient rows. */
  float gw[RT * K];
  for (int32_t i = 0; i < RT * K; i++) gw[i] = 0.5f;
  EXPECT_OK(epx_route_backward(&rc, RT, logits, NULL, idx, gw, 0.0f, 0.0f, grad));
  for (int32_t e = 0; e < E; e++) {
    assert_true(grad[1 * E + e] == 0.0f);
    assert_true(grad[4 * E + e] == 0.0f);
  }
  /* A dropped token moves nothing through the exchange. */
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_t b = buffer_make(comm, EPX_LAYOUT_EXPERT_MAJOR, 0);
  epx_routing_t r = {RT, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &r, NULL, &h));
  int64_t N = 0;
  EXPECT_OK(epx_handle_recv_rows(h, &N));
  assert_int_equal(N, (RT - 2) * K);
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
}

/* ------------------------------------------------------------------------ */
/* Lifetimes a stale value cannot fool (issue 8 findings 1, 2 and 6)          */
/* ------------------------------------------------------------------------ */

/* Finding 2: a released handle whose storage a new, larger handle reuses
 * was taken for it, and epx_combine wrote the new handle's rows past the old
 * one's 1-row `out`. The old value must stay refused, whatever the new
 * object's address. */
static void test_released_handle_at_reused_slot(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_handle_t small = NULL;
  EXPECT_OK(epx_dispatch_layout(f->b, &(epx_routing_t){1, K, f->idx, f->w, NULL, EPX_WEIGHTS_IN_COMBINE}, NULL, &small));
  assert_non_null(epx_registry_get(small, EPX_OBJECT_HANDLE));
  EXPECT_OK(epx_handle_release(small));
  assert_null(epx_registry_get(small, EPX_OBJECT_HANDLE));
  /* The next objects take the freed slot (and, with glibc, often the freed
   * memory): neither makes the old value live. */
  epx_handle_t big = NULL;
  EXPECT_OK(epx_dispatch_layout(f->b, &(epx_routing_t){T, K, f->idx, f->w, NULL, EPX_WEIGHTS_IN_COMBINE}, NULL, &big));
  assert_true(big != small);
  _Alignas(16) float one_row[2 * H];
  tu_poison(one_row, sizeof one_row);
  watch(one_row, sizeof one_row, "the 1-row out");
  EXPECT_REFUSED(epx_combine(f->b, small, f->y, one_row), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  EXPECT_REFUSED(epx_dispatch(f->b, small, f->x, f->recv, f->N), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  EXPECT_REFUSED(epx_handle_retain(small), EPX_ERROR_INVALID_HANDLE, "not live");
  EXPECT_REFUSED(epx_handle_release(small), EPX_ERROR_INVALID_HANDLE, "not live");
  EXPECT_OK(epx_combine(f->b, big, f->y, f->out));
  EXPECT_OK(epx_handle_release(big));

  /* The same for buffers, recorders and comms: destroyed, replaced, refused. */
  epx_buffer_t old_buffer = buffer_make(f->comm, EPX_LAYOUT_EXPERT_MAJOR, MAXT);
  EXPECT_OK(epx_buffer_destroy(old_buffer));
  epx_buffer_t new_buffer = buffer_make(f->comm, EPX_LAYOUT_EXPERT_MAJOR, MAXT);
  assert_true(new_buffer != old_buffer);
  int64_t m = -7;
  EXPECT_REFUSED(epx_buffer_max_tokens(old_buffer, &m), EPX_ERROR_INVALID_HANDLE, "not a live buffer");
  EXPECT_REFUSED(epx_buffer_destroy(old_buffer), EPX_ERROR_INVALID_HANDLE, "not a live buffer");
  EXPECT_OK(epx_buffer_max_tokens(new_buffer, &m));
  assert_int_equal(m, MAXT);
  EXPECT_OK(epx_buffer_destroy(new_buffer));
  epx_recorder_t old_recorder = NULL, new_recorder = NULL;
  EXPECT_OK(epx_recorder_create(1, &old_recorder));
  EXPECT_OK(epx_recorder_destroy(old_recorder));
  EXPECT_OK(epx_recorder_create(1, &new_recorder));
  epx_recorder_stats_t stats;
  EXPECT_REFUSED(epx_recorder_stats(old_recorder, &stats), EPX_ERROR_INVALID_HANDLE, "not a live recorder");
  EXPECT_REFUSED(epx_recorder_destroy(old_recorder), EPX_ERROR_INVALID_HANDLE, "not a live recorder");
  EXPECT_OK(epx_recorder_destroy(new_recorder));
  epx_comm_t old_comm = NULL, new_comm = NULL;
  EXPECT_OK(epx_comm_create_self(&old_comm));
  EXPECT_OK(epx_comm_destroy(old_comm));
  EXPECT_OK(epx_comm_create_self(&new_comm));
  int32_t rank = -7;
  EXPECT_REFUSED(epx_comm_rank(old_comm, &rank), EPX_ERROR_INVALID_HANDLE, "not a live comm");
  assert_int_equal(rank, -7);
  EXPECT_REFUSED(epx_comm_destroy(old_comm), EPX_ERROR_INVALID_HANDLE, "not a live comm");
  EXPECT_OK(epx_comm_destroy(new_comm));
  /* One kind's value is not another's. */
  EXPECT_REFUSED(epx_buffer_max_tokens((epx_buffer_t)f->h, &m), EPX_ERROR_INVALID_HANDLE, "not a live buffer");
  EXPECT_REFUSED(epx_handle_retain((epx_handle_t)f->b), EPX_ERROR_INVALID_HANDLE, "not live");
  fx_free(f);
}

/* Finding 1: releasing a handle twice while a recorder holds it freed the
 * recorder's reference; epx_recorder_stats and a validating replay then read
 * freed memory. The caller can release only the references it holds. */
static void test_over_release_keeps_the_recorders_reference(void **state) {
  (void)state;
  fx_t *f = fx_make(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE);
  epx_recorder_t rec = NULL;
  EXPECT_OK(epx_recorder_create(1, &rec));
  epx_routing_t r = {T, K, f->idx, f->w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(f->b, &r, rec, &h));
  EXPECT_OK(epx_handle_release(h));
  EXPECT_REFUSED(epx_handle_release(h), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  EXPECT_REFUSED(epx_handle_retain(h), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  EXPECT_REFUSED(epx_combine(f->b, h, f->y, f->out), EPX_ERROR_INVALID_HANDLE, "handle is not live");
  epx_recorder_stats_t stats;
  EXPECT_OK(epx_recorder_stats(rec, &stats));
  assert_int_equal(stats.records, 1);
  assert_int_equal(stats.bytes_avoided, f->N * H * (int64_t)sizeof(float));
  EXPECT_REFUSED(epx_buffer_destroy(f->b), EPX_ERROR_BUSY, "2 handle(s)");
  /* The validating replay hands the recorded handle out again, usable. */
  EXPECT_OK(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
  epx_handle_t replayed = NULL;
  EXPECT_OK(epx_dispatch_layout(f->b, &r, rec, &replayed));
  assert_ptr_equal(replayed, h);
  EXPECT_OK(epx_combine(f->b, replayed, f->y, f->out));
  EXPECT_OK(epx_handle_retain(replayed));
  EXPECT_OK(epx_handle_release(replayed));
  EXPECT_OK(epx_handle_release(replayed));
  EXPECT_REFUSED(epx_handle_release(replayed), EPX_ERROR_INVALID_HANDLE, "not live");
  /* The recorder's destroy drops the last reference; the value dies. */
  EXPECT_OK(epx_recorder_destroy(rec));
  assert_null(epx_registry_get(h, EPX_OBJECT_HANDLE));
  EXPECT_REFUSED(epx_handle_release(h), EPX_ERROR_INVALID_HANDLE, "not live");
  fx_free(f);
}

/* Finding 6: the old registry never reclaimed removed entries (20 million
 * distinct addresses, 8 objects alive at a time, grew it by 262 MB). The
 * table now follows the most objects alive at once, whatever the
 * addresses; two million create/destroy pairs must not grow it. */
static void test_registry_bounded_by_live_objects(void **state) {
  (void)state;
  epx_recorder_t alive[8];
  for (int i = 0; i < 8; i++) EXPECT_OK(epx_recorder_create(0, &alive[i]));
  const size_t before = epx_registry_capacity();
  for (int i = 0; i < 2000000; i++) {
    int slot = i % 8;
    EXPECT_OK(epx_recorder_destroy(alive[slot]));
    EXPECT_OK(epx_recorder_create(0, &alive[slot]));
  }
  assert_int_equal(epx_registry_capacity(), before);
  for (int i = 0; i < 8; i++) EXPECT_OK(epx_recorder_destroy(alive[i]));
}

/* Finding 3: hidden = INT64_MAX - 7 was accepted, and epx_recorder_stats then
 * overflowed a signed product. Every product of shape arguments is checked
 * and the argument named. */
static void test_size_products_overflow(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  static const struct {
    int64_t hidden, max_tokens;
    int32_t num_experts, capacity;
    epx_layout_t layout;
    const char *needle;
  } bad[] = {
      {INT64_MAX - 7, 8, E, 0, EPX_LAYOUT_EXPERT_MAJOR, "config.hidden is too large: hidden * dtype size"},
      {INT64_MAX / 4 + 1 - ((INT64_MAX / 4 + 1) % 8), 8, E, 0, EPX_LAYOUT_EXPERT_MAJOR, "config.hidden is too large"},
      {(int64_t)1 << 40, (int64_t)1 << 30, E, 0, EPX_LAYOUT_EXPERT_MAJOR, "config.hidden is too large: the bytes a rank sends"},
      {(int64_t)1 << 40, 0, E, 0, EPX_LAYOUT_RANK_MAJOR, "config.hidden is too large"},
      {(int64_t)1 << 32, 8, 1 << 20, INT32_MAX, EPX_LAYOUT_CAPACITY, "config.hidden is too large: the bytes a rank receives"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    epx_buffer_config_t c =
        tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, bad[i].hidden, bad[i].num_experts, K, bad[i].max_tokens);
    c.layout = bad[i].layout;
    c.capacity = bad[i].capacity;
    epx_buffer_t b = (epx_buffer_t)(uintptr_t)0xb0f;
    watch(&c, sizeof c, "config");
    EXPECT_REFUSED(epx_buffer_create(comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, bad[i].needle);
    assert_ptr_equal(b, (epx_buffer_t)(uintptr_t)0xb0f);
    unwatch_all();
  }
  /* The largest hidden that fits is accepted, and the recorder's byte counts
   * of its handles are exact (no payload moves, so nothing is allocated). */
  epx_buffer_config_t c = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, (int64_t)1 << 40, E, K, MAXT);
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  int64_t rows = 0;
  EXPECT_OK(epx_buffer_max_recv_rows(b, &rows));
  assert_int_equal(rows, MAXT * K);
  epx_recorder_t rec = NULL;
  EXPECT_OK(epx_recorder_create(0, &rec));
  int32_t idx[T * K];
  float w[T * K];
  for (int i = 0; i < T * K; i++) idx[i] = (i / K + 3 * (i % K)) % E, w[i] = 0.5f;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &(epx_routing_t){T, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE}, rec, &h));
  int64_t n = 0;
  EXPECT_OK(epx_handle_recv_rows(h, &n));
  epx_recorder_stats_t stats;
  EXPECT_OK(epx_recorder_stats(rec, &stats));
  assert_int_equal(stats.bytes_avoided, n * ((int64_t)4 << 40));
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_recorder_destroy(rec));
  EXPECT_OK(epx_buffer_destroy(b));
  /* The router: the logits' bytes. */
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  rc.num_experts = INT32_MAX;
  rc.top_k = 1;
  int32_t ri[1];
  float rw[1], logits[1] = {0};
  epx_route_output_t ro = {ri, rw, NULL, NULL, NULL, NULL, 0, 0};
  EXPECT_STATUS(epx_route(&rc, INT32_MAX, logits, NULL, &ro), EPX_ERROR_INVALID_ARGUMENT,
                "num_tokens is too large: num_tokens * num_experts * 4");
  EXPECT_OK(epx_comm_destroy(comm));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_expert_out_of_range),
      cmocka_unit_test(test_duplicate_experts),
      cmocka_unit_test(test_capacity_locations),
      cmocka_unit_test(test_k_above_e),
      cmocka_unit_test(test_too_many_tokens),
      cmocka_unit_test(test_negative_and_bad_sizes),
      cmocka_unit_test(test_unsupported_dtype_and_weighting),
      cmocka_unit_test(test_layout_pointers),
      cmocka_unit_test(test_payload_pointers),
      cmocka_unit_test(test_recv_capacity_too_small),
      cmocka_unit_test(test_handle_of_another_buffer),
      cmocka_unit_test(test_handle_after_release),
      cmocka_unit_test(test_buffer_lifetime),
      cmocka_unit_test(test_grad_w_on_wrong_backward),
      cmocka_unit_test(test_payload_aliases),
      cmocka_unit_test(test_reference_arguments),
      cmocka_unit_test(test_nonfinite_logits),
      cmocka_unit_test(test_released_handle_at_reused_slot),
      cmocka_unit_test(test_over_release_keeps_the_recorders_reference),
      cmocka_unit_test(test_registry_bounded_by_live_objects),
      cmocka_unit_test(test_size_products_overflow),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
