/* Communicators: the public comm API, the self transport and the local
 * transport (ranks as threads). Payloads encode (source, destination, index)
 * so every rank checks exactly where each word came from; timeouts, a rank
 * destroying its comm mid-collective, mismatched collectives and bad
 * arguments are checked for status, message and untouched outputs. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"
#include "comm/comm.h"

/* TU_OK's NULL needle trips GCC 12's -Wnonnull, so success is asserted here. */
#define COMM_OK(expr)                                                                              \
  do {                                                                                             \
    epx_status_t comm_ok_status_ = (expr);                                                         \
    if (comm_ok_status_ != EPX_SUCCESS)                                                            \
      fail_msg("%s returned %s: %s", #expr, epx_status_string(comm_ok_status_), epx_last_error()); \
  } while (0)

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_seconds(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - floor(seconds)) * 1e9)};
  nanosleep(&ts, NULL);
}

static uint64_t mix(uint64_t a, uint64_t b) {
  tu_rng_t rng = {a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull)};
  return tu_next(&rng);
}

/* Word k of unit i that src sends to dst in round `seed`: the first two words
 * say (src, dst) and i, the rest are a hash of all of them. */
static uint32_t word_of(uint64_t seed, int32_t src, int32_t dst, int64_t i, size_t k) {
  if (k == 0) return (uint32_t)src << 16 | (uint32_t)(dst & 0xffff);
  if (k == 1) return (uint32_t)i;
  return (uint32_t)mix(mix(mix(seed, (uint64_t)src), (uint64_t)dst * 1000003u + (uint64_t)i), k);
}

static void fill_units(uint32_t *words, size_t unit_words, int64_t units, uint64_t seed,
                       int32_t src, int32_t dst) {
  for (int64_t i = 0; i < units; i++)
    for (size_t k = 0; k < unit_words; k++)
      words[(size_t)i * unit_words + k] = word_of(seed, src, dst, i, k);
}

/* Counts of (src, dst) every rank can compute; about a quarter are zero. */
static int64_t pair_count(uint64_t seed, int32_t src, int32_t dst, int64_t max) {
  uint64_t v = mix(mix(seed, (uint64_t)src + 77), (uint64_t)dst + 991);
  return v % 4 == 0 ? 0 : (int64_t)((v >> 8) % (uint64_t)(max + 1));
}

static int64_t reduce_value(uint64_t seed, int32_t rank, int32_t i) {
  return (int64_t)mix(mix(seed, (uint64_t)rank + 5), (uint64_t)i);
}

#define RANK_CHECK(cond, ...)                       \
  do {                                              \
    if (!(cond)) {                                  \
      fprintf(stderr, "rank %d: ", rank);           \
      fprintf(stderr, __VA_ARGS__);                 \
      fprintf(stderr, " [%s]\n", epx_last_error()); \
      errors++;                                     \
      goto done;                                    \
    }                                               \
  } while (0)

/* Checks units [0, count) of recv against word_of(seed, src, dst, .). */
static int units_match(const uint32_t *recv, size_t unit_words, int64_t count, uint64_t seed,
                       int32_t src, int32_t dst) {
  for (int64_t i = 0; i < count; i++)
    for (size_t k = 0; k < unit_words; k++)
      if (recv[(size_t)i * unit_words + k] != word_of(seed, src, dst, i, k)) {
        fprintf(stderr, "  from %d to %d: unit %lld word %zu is %08x, expected %08x\n", src, dst,
                (long long)i, k, recv[(size_t)i * unit_words + k], word_of(seed, src, dst, i, k));
        return 0;
      }
  return 1;
}

static int is_poisoned(const void *data, size_t bytes) {
  const unsigned char *p = data;
  for (size_t i = 0; i < bytes; i++)
    if (p[i] != 0xA5) return 0;
  return 1;
}

typedef struct {
  int rounds;
  atomic_int arrivals; /* barrier check: incremented before each barrier */
} ops_arg_t;

/* One round of every operation; the send buffers are overwritten as soon as
 * each call returns, so a peer still reading them would see it. */
static int ops_round(epx_comm_t comm, int32_t rank, int32_t size, int round, ops_arg_t *arg) {
  int errors = 0;
  const uint64_t seed = 1000 + (uint64_t)round;
  /* Units of 12 bytes in most rounds (not a power of two), 4 KiB rows in the
   * last, with up to 64 rows per pair (256 KiB blocks). */
  const int big = round == arg->rounds - 1;
  const size_t unit_words = big ? 1024 : 3, unit = unit_words * 4;
  const int64_t max_count = big ? 64 : 9;
  int64_t *counts = calloc(4 * (size_t)size, sizeof(int64_t));
  int64_t *send_counts = counts, *send_displs = counts + size;
  int64_t *recv_counts = counts + 2 * size, *recv_displs = counts + 3 * size;
  uint32_t *send = NULL, *recv = NULL, *copy = NULL;
  int64_t *values = NULL;

  /* alltoall: a block of `bytes` per rank pair. */
  const size_t block_words = 2 + (size_t)(round % 3), bytes = block_words * 4;
  send = tu_alloc(bytes * (size_t)size);
  recv = tu_alloc(bytes * (size_t)size);
  for (int32_t d = 0; d < size; d++)
    fill_units(send + d * block_words, block_words, 1, seed, rank, d);
  tu_poison(recv, bytes * (size_t)size);
  RANK_CHECK(comm->ops->alltoall(comm, "test_alltoall", send, recv, bytes) == EPX_SUCCESS,
             "alltoall failed");
  tu_poison(send, bytes * (size_t)size);
  for (int32_t s = 0; s < size; s++)
    RANK_CHECK(units_match(recv + s * block_words, block_words, 1, seed, s, rank),
               "alltoall block from %d wrong", s);
  tu_free(send), tu_free(recv);
  send = recv = NULL;

  /* alltoallv: random counts with zeros; one unused unit before every piece
   * on both sides, which must stay untouched. */
  int64_t send_units = 0, recv_units = 0;
  for (int32_t r = 0; r < size; r++) {
    send_counts[r] = pair_count(seed, rank, r, max_count);
    send_displs[r] = send_units + 1;
    send_units += send_counts[r] + 1;
    recv_counts[r] = pair_count(seed, r, rank, max_count);
    recv_displs[r] = recv_units + 1;
    recv_units += recv_counts[r] + 1;
  }
  send = tu_alloc((size_t)send_units * unit);
  copy = tu_alloc((size_t)send_units * unit);
  recv = tu_alloc((size_t)recv_units * unit);
  for (int32_t d = 0; d < size; d++)
    fill_units(send + (size_t)send_displs[d] * unit_words, unit_words, send_counts[d], seed, rank,
               d);
  memcpy(copy, send, (size_t)send_units * unit);
  tu_poison(recv, (size_t)recv_units * unit);
  RANK_CHECK(comm->ops->alltoallv(comm, "test_alltoallv", send, send_counts, send_displs, recv,
                                  recv_counts, recv_displs, unit) == EPX_SUCCESS,
             "alltoallv failed");
  RANK_CHECK(!memcmp(copy, send, (size_t)send_units * unit), "alltoallv changed its send buffer");
  tu_poison(send, (size_t)send_units * unit);
  for (int32_t s = 0; s < size; s++) {
    RANK_CHECK(units_match(recv + (size_t)recv_displs[s] * unit_words, unit_words, recv_counts[s],
                           seed, s, rank),
               "alltoallv piece from %d (%lld units) wrong", s, (long long)recv_counts[s]);
    RANK_CHECK(is_poisoned(recv + (size_t)(recv_displs[s] - 1) * unit_words, unit),
               "alltoallv wrote the gap before the piece from %d", s);
  }
  tu_free(send), tu_free(recv), tu_free(copy);
  send = recv = copy = NULL;

  /* allgather: block s is rank s's. */
  send = tu_alloc(bytes);
  recv = tu_alloc(bytes * (size_t)size);
  fill_units(send, block_words, 1, seed, rank, -1);
  tu_poison(recv, bytes * (size_t)size);
  RANK_CHECK(comm->ops->allgather(comm, "test_allgather", send, recv, bytes) == EPX_SUCCESS,
             "allgather failed");
  tu_poison(send, bytes);
  for (int32_t s = 0; s < size; s++)
    RANK_CHECK(units_match(recv + s * block_words, block_words, 1, seed, s, -1),
               "allgather block %d wrong", s);

  /* allreduce max over signed values; every rank knows every input. */
  const int32_t count = 3 + round * 37;
  values = calloc((size_t)count, sizeof *values);
  for (int32_t i = 0; i < count; i++) values[i] = reduce_value(seed, rank, i);
  RANK_CHECK(comm->ops->allreduce_max_i64(comm, "test_allreduce", values, count) == EPX_SUCCESS,
             "allreduce failed");
  for (int32_t i = 0; i < count; i++) {
    int64_t expected = reduce_value(seed, 0, i);
    for (int32_t r = 1; r < size; r++)
      if (reduce_value(seed, r, i) > expected) expected = reduce_value(seed, r, i);
    RANK_CHECK(values[i] == expected, "allreduce value %d is %lld, expected %lld", i,
               (long long)values[i], (long long)expected);
  }

  /* barrier: every rank's arrival of this round is visible after it. */
  atomic_fetch_add(&arg->arrivals, 1);
  RANK_CHECK(comm->ops->barrier(comm, "test_barrier") == EPX_SUCCESS, "barrier failed");
  RANK_CHECK(atomic_load(&arg->arrivals) >= size * (round + 1),
             "barrier returned after %d arrivals, expected >= %d", atomic_load(&arg->arrivals),
             size * (round + 1));
done:
  tu_free(send), tu_free(recv), tu_free(copy);
  free(values);
  free(counts);
  return errors;
}

static int ops_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  ops_arg_t *arg = p;
  int errors = 0;
  int32_t got_rank = -1, got_size = -1;
  RANK_CHECK(epx_comm_rank(comm, &got_rank) == EPX_SUCCESS && got_rank == rank,
             "epx_comm_rank gave %d", got_rank);
  RANK_CHECK(epx_comm_size(comm, &got_size) == EPX_SUCCESS && got_size == size,
             "epx_comm_size gave %d", got_size);
  RANK_CHECK(epx_comm_check_alive(comm, "test") == EPX_SUCCESS, "fresh comm not alive");
  for (int round = 0; round < arg->rounds && !errors; round++)
    errors += ops_round(comm, rank, size, round, arg);
done:
  return errors;
}

static void run_local_ops(int32_t world) {
  ops_arg_t arg = {.rounds = 6};
  atomic_init(&arg.arrivals, 0);
  assert_int_equal(tu_run_ranks(world, 30.0, ops_rank, &arg), 0);
}

static void test_local_ops_w1(void **state) { (void)state, run_local_ops(1); }
static void test_local_ops_w2(void **state) { (void)state, run_local_ops(2); }
static void test_local_ops_w3(void **state) { (void)state, run_local_ops(3); }
static void test_local_ops_w4(void **state) { (void)state, run_local_ops(4); }
static void test_local_ops_w8(void **state) { (void)state, run_local_ops(8); }

static void test_self_ops(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  COMM_OK(epx_comm_create_self(&comm));
  assert_string_equal(comm->ops->name, "self");
  ops_arg_t arg = {.rounds = 6};
  atomic_init(&arg.arrivals, 0);
  assert_int_equal(ops_rank(comm, 0, 1, &arg), 0);
  COMM_OK(epx_comm_destroy(comm));
}

/* Ranks >= skip_from skip one alltoall; the others must time out naming them
 * and every later call of every rank must fail at once. */
typedef struct {
  int32_t skip_from;
  double timeout;
  const char *expected; /* the timeout message */
  const char *named;    /* what later PEER_FAILED messages must contain */
  atomic_int timed_out;
} timeout_arg_t;

static int timeout_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  timeout_arg_t *arg = p;
  int errors = 0;
  (void)size;
  uint32_t send[16], recv[16];
  double t0, elapsed;
  tu_poison(send, sizeof send);
  if (rank >= arg->skip_from) {
    /* Wait until the others have timed out, then find the comm failed. */
    double give_up = now_seconds() + 20.0;
    while (atomic_load(&arg->timed_out) < arg->skip_from && now_seconds() < give_up)
      sleep_seconds(0.001);
    RANK_CHECK(atomic_load(&arg->timed_out) == arg->skip_from, "the others never timed out");
  } else {
    tu_poison(recv, sizeof recv);
    t0 = now_seconds();
    epx_status_t status = comm->ops->alltoall(comm, "test_timeout", send, recv, 4);
    elapsed = now_seconds() - t0;
    RANK_CHECK(status == EPX_ERROR_TIMEOUT, "alltoall gave %s", epx_status_string(status));
    RANK_CHECK(strstr(epx_last_error(), arg->expected), "message lacks \"%s\"", arg->expected);
    RANK_CHECK(elapsed >= 0.5 * arg->timeout && elapsed < arg->timeout + 2.0,
               "timed out after %.3f s with a timeout of %.3f s", elapsed, arg->timeout);
    RANK_CHECK(is_poisoned(recv, sizeof recv), "a timed-out alltoall wrote its output");
    atomic_fetch_add(&arg->timed_out, 1);
  }
  t0 = now_seconds();
  epx_status_t status = comm->ops->barrier(comm, "test_after");
  elapsed = now_seconds() - t0;
  RANK_CHECK(status == EPX_ERROR_PEER_FAILED, "later barrier gave %s", epx_status_string(status));
  RANK_CHECK(strstr(epx_last_error(), "test_after: the comm failed earlier, in test_timeout"),
             "later message does not say where the comm failed");
  RANK_CHECK(strstr(epx_last_error(), arg->named), "later message lacks \"%s\"", arg->named);
  RANK_CHECK(elapsed < 0.25 * arg->timeout, "later barrier took %.3f s", elapsed);
  int64_t values[2] = {1, 2};
  t0 = now_seconds();
  status = comm->ops->allreduce_max_i64(comm, "test_after", values, 2);
  RANK_CHECK(status == EPX_ERROR_PEER_FAILED && now_seconds() - t0 < 0.25 * arg->timeout,
             "later allreduce gave %s", epx_status_string(status));
  RANK_CHECK(epx_comm_check_alive(comm, "test_alive") == EPX_ERROR_PEER_FAILED &&
                 strstr(epx_last_error(), "test_alive:"),
             "epx_comm_check_alive did not see the failure");
done:
  return errors;
}

static void test_local_timeout_names_rank(void **state) {
  (void)state;
  timeout_arg_t arg = {2, 0.3,
                       "test_timeout: rank 2 did not arrive within 0.3 s (comm timeout_seconds)",
                       "rank 2 did not arrive", 0};
  atomic_init(&arg.timed_out, 0);
  assert_int_equal(tu_run_ranks(3, arg.timeout, timeout_rank, &arg), 0);
}

static void test_local_timeout_names_ranks(void **state) {
  (void)state;
  timeout_arg_t arg = {2, 0.3, "test_timeout: ranks 2, 3 did not arrive within 0.3 s",
                       "ranks 2, 3 did not arrive", 0};
  atomic_init(&arg.timed_out, 0);
  assert_int_equal(tu_run_ranks(4, arg.timeout, timeout_rank, &arg), 0);
}

/* Rank `leaver` returns at once (tu_run_ranks then destroys its comm) while
 * the others start an alltoall: they must fail long before the timeout,
 * naming it. */
typedef struct {
  int32_t leaver;
  double leave_after; /* seconds the leaver waits before destroying */
} leave_arg_t;

static int leave_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  leave_arg_t *arg = p;
  int errors = 0;
  (void)size;
  if (rank == arg->leaver) {
    sleep_seconds(arg->leave_after);
    return 0;
  }
  uint32_t send[16], recv[16];
  tu_poison(send, sizeof send);
  tu_poison(recv, sizeof recv);
  double t0 = now_seconds();
  epx_status_t status = comm->ops->alltoall(comm, "test_leave", send, recv, 4);
  double elapsed = now_seconds() - t0;
  char named[32];
  snprintf(named, sizeof named, "rank %d", arg->leaver);
  RANK_CHECK(status == EPX_ERROR_PEER_FAILED, "alltoall gave %s", epx_status_string(status));
  RANK_CHECK(strstr(epx_last_error(), named) && strstr(epx_last_error(), "epx_comm_destroy"),
             "message does not name %s in epx_comm_destroy", named);
  RANK_CHECK(elapsed < arg->leave_after + 1.5, "took %.3f s to notice", elapsed);
  RANK_CHECK(is_poisoned(recv, sizeof recv), "a failed alltoall wrote its output");
  status = comm->ops->barrier(comm, "test_after");
  RANK_CHECK(status == EPX_ERROR_PEER_FAILED && strstr(epx_last_error(), named),
             "later barrier gave %s", epx_status_string(status));
done:
  return errors;
}

static void test_local_destroy_while_waiting(void **state) {
  (void)state;
  /* The leaver arrives first (likely) or last (after 0.2 s): both orders. */
  leave_arg_t first = {1, 0.0}, last = {1, 0.2}, w2 = {0, 0.1};
  assert_int_equal(tu_run_ranks(3, 10.0, leave_rank, &first), 0);
  assert_int_equal(tu_run_ranks(3, 10.0, leave_rank, &last), 0);
  assert_int_equal(tu_run_ranks(2, 10.0, leave_rank, &w2), 0);
}

/* A barrier meeting a peer's destroy completes (both are barriers); the next
 * call finds the peer's comm gone at once. */
static int barrier_then_leave_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  int errors = 0;
  (void)size, (void)p;
  if (rank == 1) return 0;
  RANK_CHECK(comm->ops->barrier(comm, "test_barrier") == EPX_SUCCESS, "barrier failed");
  double t0 = now_seconds();
  epx_status_t status = comm->ops->barrier(comm, "test_next");
  RANK_CHECK(status == EPX_ERROR_PEER_FAILED && now_seconds() - t0 < 1.0, "next barrier gave %s",
             epx_status_string(status));
  RANK_CHECK(strstr(epx_last_error(), "rank 1 destroyed its comm"), "message does not name rank 1");
done:
  return errors;
}

static void test_local_destroy_between_calls(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(2, 10.0, barrier_then_leave_rank, NULL), 0);
}

/* Ranks in different collectives, or with different sizes, fail at once. */
static int mismatch_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  int errors = 0;
  const int kind = *(const int *)p;
  uint32_t send[64], recv[64];
  (void)size;
  tu_poison(send, sizeof send);
  tu_poison(recv, sizeof recv);
  epx_status_t status;
  if (kind == 0 || rank == 0)
    status = comm->ops->alltoall(comm, "test_mismatch", send, recv, rank == 1 ? 8 : 4);
  else
    status = comm->ops->allgather(comm, "test_mismatch", send, recv, 4);
  RANK_CHECK(status == EPX_ERROR_PEER_FAILED, "gave %s", epx_status_string(status));
  RANK_CHECK(strstr(epx_last_error(), "every rank must make the same collective calls"),
             "message does not explain the mismatch");
  RANK_CHECK(strstr(epx_last_error(), kind == 0 ? "size 8" : "allgather"),
             "message does not show the difference");
  RANK_CHECK(is_poisoned(recv, sizeof recv), "a refused call wrote its output");
done:
  return errors;
}

static void test_local_mismatched_calls(void **state) {
  (void)state;
  int sizes = 0, kinds = 1;
  assert_int_equal(tu_run_ranks(2, 10.0, mismatch_rank, &sizes), 0);
  assert_int_equal(tu_run_ranks(3, 10.0, mismatch_rank, &kinds), 0);
}

/* Rank 1 expects one unit more from rank 0 than rank 0 sends: rank 1 reports
 * it, the others name rank 1, and the comm stays usable. */
static int inconsistent_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  int errors = 0;
  (void)p;
  int64_t send_counts[4], displs[4], recv_counts[4];
  uint32_t send[16], recv[16];
  tu_poison(send, sizeof send);
  for (int32_t r = 0; r < size; r++) send_counts[r] = recv_counts[r] = 1, displs[r] = r;
  if (rank == 1) recv_counts[0] = 2;
  epx_status_t status = comm->ops->alltoallv(comm, "test_counts", send, send_counts, displs, recv,
                                             recv_counts, displs, 4);
  if (rank == 1) {
    RANK_CHECK(status == EPX_ERROR_INTERNAL, "gave %s", epx_status_string(status));
    RANK_CHECK(strstr(epx_last_error(), "rank 0 sends 1 units to rank 1, which expects 2"),
               "message does not name the counts");
  } else {
    RANK_CHECK(status == EPX_ERROR_PEER_FAILED, "gave %s", epx_status_string(status));
    RANK_CHECK(strstr(epx_last_error(), "rank 1 found the pieces of this alltoallv inconsistent"),
               "message does not name rank 1");
  }
  RANK_CHECK(comm->ops->barrier(comm, "test_after") == EPX_SUCCESS, "comm unusable afterwards");
done:
  return errors;
}

static void test_local_inconsistent_counts(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(3, 10.0, inconsistent_rank, NULL), 0);
}

static void test_world_create_arguments(void **state) {
  (void)state;
  epx_local_world_t world = (epx_local_world_t)(uintptr_t)0xA5A5A5A5;
  const epx_local_world_t poisoned = world;
  TU_ASSERT_STATUS(epx_local_world_create(2, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_local_world_create: world is NULL");
  TU_ASSERT_STATUS(epx_local_world_create(0, NULL, &world), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_local_world_create: world_size is 0; pass the number of ranks (>= 1)");
  TU_ASSERT_STATUS(epx_local_world_create(-3, NULL, &world), EPX_ERROR_INVALID_ARGUMENT,
                   "world_size is -3");
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.struct_size = 4;
  TU_ASSERT_STATUS(epx_local_world_create(2, &config, &world), EPX_ERROR_INVALID_ARGUMENT,
                   "config->struct_size is 4, too small");
  config = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
  config.version = 99;
  TU_ASSERT_STATUS(epx_local_world_create(2, &config, &world), EPX_ERROR_INVALID_ARGUMENT,
                   "config->version is 99");
  config = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = NAN;
  TU_ASSERT_STATUS(epx_local_world_create(2, &config, &world), EPX_ERROR_INVALID_ARGUMENT,
                   "timeout_seconds is NaN");
  assert_ptr_equal(world, poisoned);
  COMM_OK(epx_local_world_destroy(NULL));
  COMM_OK(epx_comm_destroy(NULL));
}

static void test_create_local_arguments(void **state) {
  (void)state;
  epx_local_world_t world = NULL;
  COMM_OK(epx_local_world_create(1, NULL, &world));
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  TU_ASSERT_STATUS(epx_comm_create_local(world, 0, NULL), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_create_local: comm is NULL");
  TU_ASSERT_STATUS(epx_comm_create_local(NULL, 0, &comm), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_create_local: world is NULL; create one with epx_local_world_create");
  TU_ASSERT_STATUS(epx_comm_create_local(world, 1, &comm), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_create_local: rank is 1; pass 0 <= rank < 1");
  TU_ASSERT_STATUS(epx_comm_create_local(world, -1, &comm), EPX_ERROR_INVALID_ARGUMENT,
                   "rank is -1");
  assert_ptr_equal(comm, poisoned);

  /* The same rank twice. */
  epx_comm_t first = NULL;
  COMM_OK(epx_comm_create_local(world, 0, &first));
  TU_ASSERT_STATUS(epx_comm_create_local(world, 0, &comm), EPX_ERROR_INVALID_ARGUMENT,
                   "rank 0 already has a live comm on this world");
  assert_ptr_equal(comm, poisoned);

  /* Outputs of rank and size. */
  int32_t value = -7;
  TU_ASSERT_STATUS(epx_comm_rank(first, NULL), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_rank: rank is NULL");
  TU_ASSERT_STATUS(epx_comm_size(first, NULL), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_size: size is NULL");
  TU_ASSERT_STATUS(epx_comm_rank(NULL, &value), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_rank: comm is NULL");
  assert_int_equal(value, -7);

  /* A world with a live comm cannot go; a comm with live buffers cannot go. */
  TU_ASSERT_STATUS(epx_local_world_destroy(world), EPX_ERROR_BUSY,
                   "epx_local_world_destroy: 1 comm(s) of this world are alive (rank 0 first)");
  first->live_buffers = 2;
  TU_ASSERT_STATUS(epx_comm_destroy(first), EPX_ERROR_BUSY,
                   "epx_comm_destroy: 2 buffer(s) created over this comm are alive");
  first->live_buffers = 0;
  COMM_OK(epx_comm_rank(first, &value));
  assert_int_equal(value, 0);
  COMM_OK(epx_comm_destroy(first));

  /* Use after destroy. */
  TU_ASSERT_STATUS(epx_comm_rank(first, &value), EPX_ERROR_INVALID_HANDLE,
                   "epx_comm_rank: comm is not a live comm");
  TU_ASSERT_STATUS(epx_comm_size(first, &value), EPX_ERROR_INVALID_HANDLE,
                   "epx_comm_size: comm is not a live comm");
  TU_ASSERT_STATUS(epx_comm_destroy(first), EPX_ERROR_INVALID_HANDLE,
                   "epx_comm_destroy: comm is not a live comm");

  /* The world can be used again once its comms are gone. */
  COMM_OK(epx_comm_create_local(world, 0, &first));
  COMM_OK(epx_comm_destroy(first));
  COMM_OK(epx_local_world_destroy(world));
  TU_ASSERT_STATUS(epx_comm_create_local(world, 0, &comm), EPX_ERROR_INVALID_HANDLE,
                   "epx_comm_create_local: world is not a live local world");
  TU_ASSERT_STATUS(epx_local_world_destroy(world), EPX_ERROR_INVALID_HANDLE,
                   "epx_local_world_destroy: world is not a live local world");
  assert_ptr_equal(comm, poisoned);
}

/* Only rank 0 of two creates its comm: the create times out naming rank 1,
 * leaves the output alone, and the world can still be destroyed. */
static void test_create_local_timeout(void **state) {
  (void)state;
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = 0.2;
  epx_local_world_t world = NULL;
  COMM_OK(epx_local_world_create(2, &config, &world));
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  double t0 = now_seconds();
  TU_ASSERT_STATUS(epx_comm_create_local(world, 0, &comm), EPX_ERROR_TIMEOUT,
                   "epx_comm_create_local: rank 1 did not arrive within 0.2 s");
  assert_true(now_seconds() - t0 < 2.0);
  assert_ptr_equal(comm, poisoned);
  TU_ASSERT_STATUS(epx_comm_create_local(world, 1, &comm), EPX_ERROR_PEER_FAILED,
                   "epx_comm_create_local: the world failed earlier");
  assert_ptr_equal(comm, poisoned);
  COMM_OK(epx_local_world_destroy(world));
}

static void test_create_mpi_arguments(void **state) {
  (void)state;
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  int64_t fake_mpi_comm = 0;
  TU_ASSERT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_create_mpi: comm is NULL");
  TU_ASSERT_STATUS(epx_comm_create_mpi(NULL, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_create_mpi: mpi_comm is NULL");
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.version = 0;
  TU_ASSERT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, &config, &comm), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_create_mpi: config->version is 0");
  if (epx_has_mpi()) /* This process never called MPI_Init. */
    TU_ASSERT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                     "epx_comm_create_mpi: MPI is not initialised");
  else
    TU_ASSERT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, NULL, &comm), EPX_ERROR_UNSUPPORTED,
                     "epx_comm_create_mpi: this build of epx has no MPI transport");
  assert_ptr_equal(comm, poisoned);
  COMM_OK(epx_comm_create_self(&comm));
  COMM_OK(epx_comm_destroy(comm));
  TU_ASSERT_STATUS(epx_comm_create_self(NULL), EPX_ERROR_INVALID_ARGUMENT,
                   "epx_comm_create_self: comm is NULL");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_self_ops),
      cmocka_unit_test(test_local_ops_w1),
      cmocka_unit_test(test_local_ops_w2),
      cmocka_unit_test(test_local_ops_w3),
      cmocka_unit_test(test_local_ops_w4),
      cmocka_unit_test(test_local_ops_w8),
      cmocka_unit_test(test_local_timeout_names_rank),
      cmocka_unit_test(test_local_timeout_names_ranks),
      cmocka_unit_test(test_local_destroy_while_waiting),
      cmocka_unit_test(test_local_destroy_between_calls),
      cmocka_unit_test(test_local_mismatched_calls),
      cmocka_unit_test(test_local_inconsistent_counts),
      cmocka_unit_test(test_world_create_arguments),
      cmocka_unit_test(test_create_local_arguments),
      cmocka_unit_test(test_create_local_timeout),
      cmocka_unit_test(test_create_mpi_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
