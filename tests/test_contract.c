/* The contract's versioning (epx.h, "Versioned configs"): epx_version, the
 * *_config_init calls against the EPX_*_CONFIG_INIT macros, configs from an
 * older (smaller) header accepted with the defaults behind them, and configs
 * from a newer header or with a bad version refused. The older configs are
 * allocated at exactly their size, so a read past them is an AddressSanitizer
 * error under `make sanitize`. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static void test_version(void **state) {
  (void)state;
  assert_int_equal(epx_version(), EPX_VERSION_CODE);
  assert_int_equal(EPX_VERSION_CODE,
                   EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 + EPX_VERSION_PATCH);
}

static void expect_route_equal(const epx_route_config_t *a, const epx_route_config_t *b) {
  assert_int_equal(a->struct_size, b->struct_size);
  assert_int_equal(a->version, b->version);
  assert_int_equal(a->num_experts, b->num_experts);
  assert_int_equal(a->top_k, b->top_k);
  assert_int_equal(a->score_fn, b->score_fn);
  assert_int_equal(a->num_groups, b->num_groups);
  assert_int_equal(a->topk_groups, b->topk_groups);
  assert_int_equal(a->renormalize, b->renormalize);
  assert_true(a->scaling_factor == b->scaling_factor);
  assert_int_equal(a->capacity_mode, b->capacity_mode);
  assert_true(a->capacity_factor == b->capacity_factor);
  assert_int_equal(a->min_capacity, b->min_capacity);
  assert_int_equal(a->queue_order, b->queue_order);
  assert_int_equal(a->drop_policy, b->drop_policy);
  assert_true(a->aux_loss_coeff == b->aux_loss_coeff);
  assert_true(a->z_loss_coeff == b->z_loss_coeff);
  assert_int_equal(a->nonfinite, b->nonfinite);
  assert_int_equal(a->device, b->device);
  assert_ptr_equal(a->stream, b->stream);
}

static void expect_buffer_equal(const epx_buffer_config_t *a, const epx_buffer_config_t *b) {
  assert_int_equal(a->struct_size, b->struct_size);
  assert_int_equal(a->version, b->version);
  assert_int_equal(a->device, b->device);
  assert_int_equal(a->dtype, b->dtype);
  assert_int_equal(a->hidden, b->hidden);
  assert_int_equal(a->num_experts, b->num_experts);
  assert_int_equal(a->max_top_k, b->max_top_k);
  assert_int_equal(a->max_tokens_per_rank, b->max_tokens_per_rank);
  assert_int_equal(a->max_tokens_rounding, b->max_tokens_rounding);
  assert_int_equal(a->exchange, b->exchange);
  assert_int_equal(a->layout, b->layout);
  assert_int_equal(a->expert_alignment, b->expert_alignment);
  assert_int_equal(a->capacity, b->capacity);
  assert_int_equal(a->worst_case_sizing, b->worst_case_sizing);
  assert_ptr_equal(a->stream, b->stream);
  assert_int_equal(a->combine_precision, b->combine_precision);
  assert_int_equal(a->exchange_path, b->exchange_path);
  assert_int_equal(a->sm_budget, b->sm_budget);
  assert_int_equal(a->low_latency, b->low_latency);
}

/* The init calls give the macros' defaults. */
static void test_config_init_matches_macros(void **state) {
  (void)state;
  const epx_route_config_t route_macro = EPX_ROUTE_CONFIG_INIT;
  epx_route_config_t route;
  tu_poison(&route, sizeof route);
  EXPECT_OK(epx_route_config_init(&route, sizeof route));
  expect_route_equal(&route, &route_macro);

  const epx_comm_config_t comm_macro = EPX_COMM_CONFIG_INIT;
  epx_comm_config_t comm;
  tu_poison(&comm, sizeof comm);
  EXPECT_OK(epx_comm_config_init(&comm, sizeof comm));
  assert_int_equal(comm.struct_size, comm_macro.struct_size);
  assert_int_equal(comm.version, comm_macro.version);
  assert_true(comm.timeout_seconds == comm_macro.timeout_seconds);

  const epx_buffer_config_t buffer_macro = EPX_BUFFER_CONFIG_INIT;
  epx_buffer_config_t buffer;
  tu_poison(&buffer, sizeof buffer);
  EXPECT_OK(epx_buffer_config_init(&buffer, sizeof buffer));
  expect_buffer_equal(&buffer, &buffer_macro);
}

/* An init call for an older, smaller struct writes only its bytes. */
static void test_config_init_older_struct(void **state) {
  (void)state;
  const size_t old_size = offsetof(epx_buffer_config_t, combine_precision);
  unsigned char bytes[sizeof(epx_buffer_config_t) + 16];
  tu_poison(bytes, sizeof bytes);
  EXPECT_OK(epx_buffer_config_init((epx_buffer_config_t *)(void *)bytes, old_size));
  const epx_buffer_config_t *c = (const epx_buffer_config_t *)(const void *)bytes;
  assert_int_equal(c->struct_size, old_size);
  assert_int_equal(c->version, EPX_CONFIG_VERSION);
  assert_int_equal(c->max_tokens_rounding, 256);
  for (size_t i = old_size; i < sizeof bytes; i++) assert_int_equal(bytes[i], 0xA5);
}

static void test_config_init_refusals(void **state) {
  (void)state;
  epx_route_config_t route;
  EXPECT_STATUS(epx_route_config_init(NULL, sizeof route), EPX_ERROR_INVALID_ARGUMENT,
                "epx_route_config_init: config is NULL");
  EXPECT_STATUS(epx_route_config_init(&route, 4), EPX_ERROR_INVALID_ARGUMENT,
                "struct_size is 4, too small to hold struct_size and version");
  epx_comm_config_t comm;
  EXPECT_STATUS(epx_comm_config_init(&comm, sizeof comm + 8), EPX_ERROR_INVALID_ARGUMENT,
                "newer epx.h than the library");
  epx_buffer_config_t buffer;
  EXPECT_STATUS(epx_buffer_config_init(&buffer, 0), EPX_ERROR_INVALID_ARGUMENT,
                "epx_buffer_config_init: config->struct_size is 0");
}

/* The buffer config as a program built before combine_precision declared it
 * (its epx.h). */
typedef struct {
  uint32_t struct_size, version;
  epx_device_t device;
  epx_dtype_t dtype;
  int64_t hidden;
  int32_t num_experts, max_top_k;
  int64_t max_tokens_per_rank;
  int32_t max_tokens_rounding;
  epx_exchange_t exchange;
  epx_layout_t layout;
  int32_t expert_alignment, capacity, worst_case_sizing;
  void *stream;
} older_buffer_config_t;
_Static_assert(sizeof(older_buffer_config_t) == offsetof(epx_buffer_config_t, combine_precision),
               "older_buffer_config_t is epx_buffer_config_t without its last field");

/* The route config as a program built before `device` and `stream`. */
typedef struct {
  uint32_t struct_size, version;
  int32_t num_experts, top_k;
  epx_score_fn_t score_fn;
  int32_t num_groups, topk_groups, renormalize;
  float scaling_factor;
  int32_t capacity_mode;
  float capacity_factor;
  int32_t min_capacity;
  epx_queue_order_t queue_order;
  epx_drop_policy_t drop_policy;
  float aux_loss_coeff, z_loss_coeff;
  epx_nonfinite_policy_t nonfinite;
} older_route_config_t;
_Static_assert(sizeof(older_route_config_t) == offsetof(epx_route_config_t, device),
               "older_route_config_t is epx_route_config_t without device and stream");

/* An older program's buffer config, allocated at exactly its size. */
static void test_buffer_config_older_struct(void **state) {
  (void)state;
  older_buffer_config_t *old = malloc(sizeof *old);
  assert_non_null(old);
  EXPECT_OK(epx_buffer_config_init((epx_buffer_config_t *)(void *)old, sizeof *old));
  assert_int_equal(old->max_tokens_rounding, 256);
  old->hidden = 16;
  old->num_experts = 4;
  old->max_top_k = 2;
  old->max_tokens_per_rank = 8;
  epx_comm_t comm;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_t buffer = NULL;
  EXPECT_OK(epx_buffer_create(comm, (const epx_buffer_config_t *)(const void *)old, &buffer));
  int64_t rows = 0;
  EXPECT_OK(epx_buffer_max_recv_rows(buffer, &rows));
  assert_int_equal(rows, 8 * 2);
  /* A CPU buffer moves every row on the host; the query says so. */
  int32_t paths[1] = {-1};
  EXPECT_OK(epx_buffer_peer_paths(buffer, paths));
  assert_int_equal(paths[0], EPX_PATH_HOST);
  EXPECT_STATUS(epx_buffer_peer_paths(buffer, NULL), EPX_ERROR_INVALID_ARGUMENT, "paths is NULL");
  EXPECT_OK(epx_buffer_destroy(buffer));
  EXPECT_OK(epx_comm_destroy(comm));
  free(old);
}

/* An older program's route config routes on the CPU exactly as the full
 * config does. */
static void test_route_config_older_struct(void **state) {
  (void)state;
  enum { T = 5, E = 8, K = 2 };
  older_route_config_t *old = malloc(sizeof *old);
  assert_non_null(old);
  EXPECT_OK(epx_route_config_init((epx_route_config_t *)(void *)old, sizeof *old));
  old->num_experts = E;
  old->top_k = K;
  old->capacity_mode = 1;
  epx_route_config_t full = EPX_ROUTE_CONFIG_INIT;
  full.num_experts = E;
  full.top_k = K;
  full.capacity_mode = 1;
  float logits[T * E];
  tu_rng_t rng = {7};
  tu_fill(&rng, EPX_FLOAT32, logits, T * E);
  int32_t idx_old[T * K], idx_full[T * K];
  float w_old[T * K], w_full[T * K];
  epx_route_output_t out_old = {idx_old, w_old, NULL, NULL, NULL, NULL, 0, 0};
  epx_route_output_t out_full = {idx_full, w_full, NULL, NULL, NULL, NULL, 0, 0};
  EXPECT_OK(epx_route((const epx_route_config_t *)(const void *)old, T, logits, NULL, &out_old));
  EXPECT_OK(epx_route(&full, T, logits, NULL, &out_full));
  assert_memory_equal(idx_old, idx_full, sizeof idx_old);
  assert_memory_equal(w_old, w_full, sizeof w_old);
  assert_int_equal(out_old.capacity, out_full.capacity);
  free(old);
}

/* A comm config that holds only struct_size and version: every default. */
static void test_comm_config_older_struct(void **state) {
  (void)state;
  struct {
    uint32_t struct_size, version;
  } *old = malloc(8);
  assert_non_null(old);
  EXPECT_OK(epx_comm_config_init((epx_comm_config_t *)(void *)old, 8));
  epx_local_world_t world = NULL;
  EXPECT_OK(epx_local_world_create(2, (const epx_comm_config_t *)(const void *)old, &world));
  EXPECT_OK(epx_local_world_destroy(world));
  free(old);
}

/* Newer headers and unknown versions are refused by every config check. */
static void test_config_newer_or_bad_version(void **state) {
  (void)state;
  epx_comm_t comm;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t b = EPX_BUFFER_CONFIG_INIT;
  b.hidden = 16, b.num_experts = 4, b.max_top_k = 2;
  epx_buffer_t buffer = NULL;
  b.struct_size = sizeof b + 8;
  EXPECT_STATUS(epx_buffer_create(comm, &b, &buffer), EPX_ERROR_INVALID_ARGUMENT,
                "epx_buffer_create: config->struct_size is");
  assert_true(tu_message_has("newer epx.h than the library"));
  b.struct_size = sizeof b, b.version = EPX_CONFIG_VERSION + 1;
  EXPECT_STATUS(epx_buffer_create(comm, &b, &buffer), EPX_ERROR_INVALID_ARGUMENT,
                "config->version is 2; this library reads versions 1 to 1");
  b.version = 0;
  EXPECT_STATUS(epx_buffer_create(comm, &b, &buffer), EPX_ERROR_INVALID_ARGUMENT, "config->version is 0");
  b.version = EPX_CONFIG_VERSION, b.combine_precision = (epx_combine_precision_t)7;
  EXPECT_STATUS(epx_buffer_create(comm, &b, &buffer), EPX_ERROR_INVALID_ARGUMENT,
                "config.combine_precision 7 is not");
  assert_null(buffer);
  b.combine_precision = EPX_COMBINE_PARTIALS_FLOAT32, b.exchange_path = (epx_exchange_path_t)5;
  EXPECT_STATUS(epx_buffer_create(comm, &b, &buffer), EPX_ERROR_INVALID_ARGUMENT,
                "config.exchange_path 5 is not EPX_PATH_AUTO, EPX_PATH_HOST or EPX_PATH_FUSED");
  /* FUSED asks for the fused kernels where they can serve; a CPU buffer has
   * none, so it is made and reports the host path. */
  b.exchange_path = EPX_PATH_FUSED;
  EXPECT_OK(epx_buffer_create(comm, &b, &buffer));
  int32_t path = -1; /* one rank: a self comm */
  EXPECT_OK(epx_buffer_peer_paths(buffer, &path));
  assert_int_equal(path, EPX_PATH_HOST);
  EXPECT_OK(epx_buffer_destroy(buffer));
  buffer = NULL;
  b.exchange_path = EPX_PATH_AUTO, b.sm_budget = -1;
  EXPECT_STATUS(epx_buffer_create(comm, &b, &buffer), EPX_ERROR_INVALID_ARGUMENT, "config.sm_budget is -1");
  assert_null(buffer);
  b.sm_budget = 0;
  EXPECT_OK(epx_comm_destroy(comm));

  epx_route_config_t r = EPX_ROUTE_CONFIG_INIT;
  r.num_experts = 4, r.top_k = 2;
  r.struct_size = sizeof r + 4;
  float logits[4] = {0};
  int32_t idx[2];
  float w[2];
  epx_route_output_t out = {idx, w, NULL, NULL, NULL, NULL, 0, 0};
  EXPECT_STATUS(epx_route(&r, 1, logits, NULL, &out), EPX_ERROR_INVALID_ARGUMENT,
                "epx_route: config->struct_size is");
  r.struct_size = 7;
  EXPECT_STATUS(epx_route(&r, 1, logits, NULL, &out), EPX_ERROR_INVALID_ARGUMENT, "too small");

  epx_comm_config_t c = EPX_COMM_CONFIG_INIT;
  c.struct_size = sizeof c + 8;
  epx_local_world_t world = NULL;
  EXPECT_STATUS(epx_local_world_create(2, &c, &world), EPX_ERROR_INVALID_ARGUMENT,
                "newer epx.h than the library");
  assert_null(world);
}

/* A CPU buffer has no stream (epx.h, "Streams"); the refusal names the
 * device, and the buffer stays usable. */
static void test_set_stream_on_cpu_buffer(void **state) {
  (void)state;
  epx_comm_t comm;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.hidden = 16, c.num_experts = 4, c.max_top_k = 2, c.max_tokens_per_rank = 8;
  epx_buffer_t buffer = NULL;
  EXPECT_OK(epx_buffer_create(comm, &c, &buffer));
  EXPECT_STATUS(epx_buffer_set_stream(buffer, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "epx_buffer_set_stream: the buffer is a cpu buffer; streams are for EPX_DEVICE_CUDA buffers");
  int64_t rows = 0;
  EXPECT_OK(epx_buffer_max_recv_rows(buffer, &rows));
  EXPECT_OK(epx_buffer_destroy(buffer));
  EXPECT_OK(epx_comm_destroy(comm));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_version),
      cmocka_unit_test(test_config_init_matches_macros),
      cmocka_unit_test(test_config_init_older_struct),
      cmocka_unit_test(test_config_init_refusals),
      cmocka_unit_test(test_buffer_config_older_struct),
      cmocka_unit_test(test_route_config_older_struct),
      cmocka_unit_test(test_comm_config_older_struct),
      cmocka_unit_test(test_config_newer_or_bad_version),
      cmocka_unit_test(test_set_stream_on_cpu_buffer),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
