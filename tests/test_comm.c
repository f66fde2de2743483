/* Communicators: the public comm API, the self transport and the local
 * transport (ranks as threads). The transport cases every transport passes
 * (tests/util/comm_cases.c: every operation with payloads that encode source,
 * destination and index; a skipped collective) run here over self and local,
 * and in tests/mpi_comm.c over MPI. The local transport's own cases follow: a
 * rank destroying its comm mid-collective, mismatched collectives,
 * inconsistent counts, and bad arguments, checked for status, message and
 * untouched outputs. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "comm_cases.h"
#include "core/transport.h"
#include "testutil.h"

static int ops_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  (void)rank, (void)size;
  return cc_ops(comm, 6, p);
}

static void run_local_ops(int32_t world) {
  atomic_int arrivals;
  atomic_init(&arrivals, 0);
  assert_int_equal(tu_run_ranks(world, 30.0, ops_rank, &arrivals), 0);
}

static void test_local_ops_w1(void **state) { (void)state, run_local_ops(1); }
static void test_local_ops_w2(void **state) { (void)state, run_local_ops(2); }
static void test_local_ops_w3(void **state) { (void)state, run_local_ops(3); }
static void test_local_ops_w4(void **state) { (void)state, run_local_ops(4); }
static void test_local_ops_w8(void **state) { (void)state, run_local_ops(8); }

static void test_self_ops(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  assert_string_equal(COMM(comm)->ops->name, "self");
  atomic_int arrivals;
  atomic_init(&arrivals, 0);
  assert_int_equal(cc_ops(comm, 6, &arrivals), 0);
  EXPECT_OK(epx_comm_destroy(comm));
}

static void test_local_timeout_names_rank(void **state) {
  (void)state;
  cc_timeout_t t = {2, 0, 0.3,
                    {"test_timeout: rank 2 did not arrive within 0.3 s (comm timeout_seconds)", NULL},
                    "rank 2 did not arrive", 1, cc_wait_for_timeouts, 0};
  atomic_init(&t.timed_out, 0);
  assert_int_equal(tu_run_ranks(3, t.timeout, cc_timeout_rank, &t), 0);
}

static void test_local_timeout_names_ranks(void **state) {
  (void)state;
  cc_timeout_t t = {2, 0, 0.3, {"test_timeout: ranks 2, 3 did not arrive within 0.3 s", NULL},
                    "ranks 2, 3 did not arrive", 1, cc_wait_for_timeouts, 0};
  atomic_init(&t.timed_out, 0);
  assert_int_equal(tu_run_ranks(4, t.timeout, cc_timeout_rank, &t), 0);
  /* A skipped barrier, as the MPI test skips it. */
  cc_timeout_t b = {1, 1, 0.3, {"test_timeout: rank 1 did not arrive within 0.3 s", NULL},
                    "rank 1 did not arrive", 1, cc_wait_for_timeouts, 0};
  atomic_init(&b.timed_out, 0);
  assert_int_equal(tu_run_ranks(2, b.timeout, cc_timeout_rank, &b), 0);
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
  int failures = 0;
  (void)size;
  if (rank == arg->leaver) {
    cc_sleep_seconds(arg->leave_after);
    return 0;
  }
  uint32_t send[16], recv[16];
  tu_poison(send, sizeof send);
  tu_poison(recv, sizeof recv);
  double t0 = tu_seconds();
  epx_status_t status = COMM(comm)->ops->alltoall(COMM(comm), "test_leave", send, recv, 4);
  double elapsed = tu_seconds() - t0;
  char named[32];
  snprintf(named, sizeof named, "rank %d", arg->leaver);
  RANK_REQUIRE(status == EPX_ERROR_PEER_FAILED, "alltoall gave %s", epx_status_string(status));
  RANK_REQUIRE(strstr(epx_last_error(), named) && strstr(epx_last_error(), "epx_comm_destroy"),
             "message does not name %s in epx_comm_destroy", named);
  RANK_REQUIRE(elapsed < arg->leave_after + 1.5, "took %.3f s to notice", elapsed);
  RANK_REQUIRE(cc_is_poisoned(recv, sizeof recv), "a failed alltoall wrote its output");
  status = COMM(comm)->ops->barrier(COMM(comm), "test_after");
  RANK_REQUIRE(status == EPX_ERROR_PEER_FAILED && strstr(epx_last_error(), named),
             "later barrier gave %s", epx_status_string(status));
done:
  return failures;
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
  int failures = 0;
  (void)size, (void)p;
  if (rank == 1) return 0;
  RANK_REQUIRE(COMM(comm)->ops->barrier(COMM(comm), "test_barrier") == EPX_SUCCESS, "barrier failed");
  double t0 = tu_seconds();
  epx_status_t status = COMM(comm)->ops->barrier(COMM(comm), "test_next");
  RANK_REQUIRE(status == EPX_ERROR_PEER_FAILED && tu_seconds() - t0 < 1.0, "next barrier gave %s",
             epx_status_string(status));
  RANK_REQUIRE(strstr(epx_last_error(), "rank 1 destroyed its comm"), "message does not name rank 1");
done:
  return failures;
}

static void test_local_destroy_between_calls(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(2, 10.0, barrier_then_leave_rank, NULL), 0);
}

/* Ranks in different collectives, or with different sizes, fail at once. */
static int mismatch_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  int failures = 0;
  const int kind = *(const int *)p;
  uint32_t send[64], recv[64];
  (void)size;
  tu_poison(send, sizeof send);
  tu_poison(recv, sizeof recv);
  epx_status_t status;
  if (kind == 0 || rank == 0)
    status = COMM(comm)->ops->alltoall(COMM(comm), "test_mismatch", send, recv, rank == 1 ? 8 : 4);
  else
    status = COMM(comm)->ops->allgather(COMM(comm), "test_mismatch", send, recv, 4);
  RANK_REQUIRE(status == EPX_ERROR_PEER_FAILED, "gave %s", epx_status_string(status));
  RANK_REQUIRE(strstr(epx_last_error(), "every rank must make the same collective calls"),
             "message does not explain the mismatch");
  RANK_REQUIRE(strstr(epx_last_error(), kind == 0 ? "size 8" : "allgather"),
             "message does not show the difference");
  RANK_REQUIRE(cc_is_poisoned(recv, sizeof recv), "a refused call wrote its output");
done:
  return failures;
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
  int failures = 0;
  (void)p;
  int64_t send_counts[4], displs[4], recv_counts[4];
  uint32_t send[16], recv[16];
  tu_poison(send, sizeof send);
  for (int32_t r = 0; r < size; r++) send_counts[r] = recv_counts[r] = 1, displs[r] = r;
  if (rank == 1) recv_counts[0] = 2;
  epx_status_t status = COMM(comm)->ops->alltoallv(COMM(comm), "test_counts", send, send_counts, displs, recv,
                                             recv_counts, displs, 4);
  if (rank == 1) {
    RANK_REQUIRE(status == EPX_ERROR_INTERNAL, "gave %s", epx_status_string(status));
    RANK_REQUIRE(strstr(epx_last_error(), "rank 0 sends 1 units to rank 1, which expects 2"),
               "message does not name the counts");
  } else {
    RANK_REQUIRE(status == EPX_ERROR_PEER_FAILED, "gave %s", epx_status_string(status));
    RANK_REQUIRE(strstr(epx_last_error(), "rank 1 found the pieces of this alltoallv inconsistent"),
               "message does not name rank 1");
  }
  RANK_REQUIRE(COMM(comm)->ops->barrier(COMM(comm), "test_after") == EPX_SUCCESS, "comm unusable afterwards");
done:
  return failures;
}

static void test_local_inconsistent_counts(void **state) {
  (void)state;
  assert_int_equal(tu_run_ranks(3, 10.0, inconsistent_rank, NULL), 0);
}

/* The caller's collectives (epx_comm_barrier, epx_comm_allgather): each rank
 * gathers every rank's block, and the barrier holds every rank until the
 * last arrives. */
static int caller_collectives_rank(epx_comm_t comm, int32_t rank, int32_t size, void *p) {
  atomic_int *arrivals = p;
  int failures = 0;
  int64_t mine[3] = {rank, 100 + rank, -rank}, all[8 * 3];
  tu_poison(all, sizeof all);
  RANK_OK(epx_comm_allgather(comm, mine, all, sizeof mine));
  for (int32_t r = 0; r < size; r++)
    RANK_EXPECT(all[3 * r] == r && all[3 * r + 1] == 100 + r && all[3 * r + 2] == -r,
                "block of rank %d is {%lld, %lld, %lld}", r, (long long)all[3 * r],
                (long long)all[3 * r + 1], (long long)all[3 * r + 2]);
  RANK_EXPECT(cc_is_poisoned(all + 3 * size, sizeof all - sizeof mine * (size_t)size),
              "allgather wrote past the size x bytes of recv");
  RANK_STATUS(epx_comm_allgather(comm, NULL, all, 8), EPX_ERROR_INVALID_ARGUMENT,
              "epx_comm_allgather: send is NULL");
  RANK_STATUS(epx_comm_allgather(comm, all, all, 8), EPX_ERROR_INVALID_ARGUMENT, "recv aliases send");
  if (rank == size - 1) cc_sleep_seconds(0.05);
  atomic_fetch_add(arrivals, 1);
  RANK_OK(epx_comm_barrier(comm));
  RANK_EXPECT(atomic_load(arrivals) == size, "left the barrier after %d of %d arrivals",
              atomic_load(arrivals), size);
  RANK_OK(epx_comm_barrier(comm)); /* nobody adds to arrivals before all have read it */
  return failures;
}

static void test_caller_collectives(void **state) {
  (void)state;
  for (int32_t world = 1; world <= 4; world += 3) {
    atomic_int arrivals;
    atomic_init(&arrivals, 0);
    assert_int_equal(tu_run_ranks(world, 10.0, caller_collectives_rank, &arrivals), 0);
  }
  EXPECT_STATUS(epx_comm_barrier(NULL), EPX_ERROR_INVALID_ARGUMENT, "epx_comm_barrier: comm is NULL");
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  EXPECT_OK(epx_comm_destroy(comm));
  EXPECT_STATUS(epx_comm_allgather(comm, NULL, NULL, 0), EPX_ERROR_INVALID_HANDLE,
                "epx_comm_allgather: comm is not a live comm");
}

static void test_world_create_arguments(void **state) {
  (void)state;
  epx_local_world_t world = (epx_local_world_t)(uintptr_t)0xA5A5A5A5;
  const epx_local_world_t poisoned = world;
  EXPECT_STATUS(epx_local_world_create(2, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "epx_local_world_create: world is NULL");
  EXPECT_STATUS(epx_local_world_create(0, NULL, &world), EPX_ERROR_INVALID_ARGUMENT,
                "epx_local_world_create: world_size is 0; pass the number of ranks (>= 1)");
  EXPECT_STATUS(epx_local_world_create(-3, NULL, &world), EPX_ERROR_INVALID_ARGUMENT,
                "world_size is -3");
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.struct_size = 4;
  EXPECT_STATUS(epx_local_world_create(2, &config, &world), EPX_ERROR_INVALID_ARGUMENT,
                "config->struct_size is 4, too small");
  config = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
  config.version = 99;
  EXPECT_STATUS(epx_local_world_create(2, &config, &world), EPX_ERROR_INVALID_ARGUMENT,
                "config->version is 99");
  config = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = NAN;
  EXPECT_STATUS(epx_local_world_create(2, &config, &world), EPX_ERROR_INVALID_ARGUMENT,
                "timeout_seconds is NaN");
  assert_ptr_equal(world, poisoned);
  EXPECT_OK(epx_local_world_destroy(NULL));
  EXPECT_OK(epx_comm_destroy(NULL));
}

static void test_create_local_arguments(void **state) {
  (void)state;
  epx_local_world_t world = NULL;
  EXPECT_OK(epx_local_world_create(1, NULL, &world));
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  EXPECT_STATUS(epx_comm_create_local(world, 0, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_local: comm is NULL");
  EXPECT_STATUS(epx_comm_create_local(NULL, 0, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_local: world is NULL; create one with epx_local_world_create");
  EXPECT_STATUS(epx_comm_create_local(world, 1, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_local: rank is 1; pass 0 <= rank < 1");
  EXPECT_STATUS(epx_comm_create_local(world, -1, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "rank is -1");
  assert_ptr_equal(comm, poisoned);

  /* The same rank twice. */
  epx_comm_t first = NULL;
  EXPECT_OK(epx_comm_create_local(world, 0, &first));
  EXPECT_STATUS(epx_comm_create_local(world, 0, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "rank 0 already has a live comm on this world");
  assert_ptr_equal(comm, poisoned);

  /* Outputs of rank and size. */
  int32_t value = -7;
  EXPECT_STATUS(epx_comm_rank(first, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_rank: rank is NULL");
  EXPECT_STATUS(epx_comm_size(first, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_size: size is NULL");
  EXPECT_STATUS(epx_comm_rank(NULL, &value), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_rank: comm is NULL");
  assert_int_equal(value, -7);

  /* A world with a live comm cannot go; a comm with live buffers cannot go. */
  EXPECT_STATUS(epx_local_world_destroy(world), EPX_ERROR_BUSY,
                "epx_local_world_destroy: 1 comm(s) of this world are alive (rank 0 first)");
  COMM(first)->live_buffers = 2;
  EXPECT_STATUS(epx_comm_destroy(first), EPX_ERROR_BUSY,
                "epx_comm_destroy: 2 buffer(s) created over this comm are alive");
  COMM(first)->live_buffers = 0;
  EXPECT_OK(epx_comm_rank(first, &value));
  assert_int_equal(value, 0);
  EXPECT_OK(epx_comm_destroy(first));

  /* Use after destroy. */
  EXPECT_STATUS(epx_comm_rank(first, &value), EPX_ERROR_INVALID_HANDLE,
                "epx_comm_rank: comm is not a live comm");
  EXPECT_STATUS(epx_comm_size(first, &value), EPX_ERROR_INVALID_HANDLE,
                "epx_comm_size: comm is not a live comm");
  EXPECT_STATUS(epx_comm_destroy(first), EPX_ERROR_INVALID_HANDLE,
                "epx_comm_destroy: comm is not a live comm");

  /* The world can be used again once its comms are gone. */
  EXPECT_OK(epx_comm_create_local(world, 0, &first));
  EXPECT_OK(epx_comm_destroy(first));
  EXPECT_OK(epx_local_world_destroy(world));
  EXPECT_STATUS(epx_comm_create_local(world, 0, &comm), EPX_ERROR_INVALID_HANDLE,
                "epx_comm_create_local: world is not a live local world");
  EXPECT_STATUS(epx_local_world_destroy(world), EPX_ERROR_INVALID_HANDLE,
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
  EXPECT_OK(epx_local_world_create(2, &config, &world));
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  double t0 = tu_seconds();
  EXPECT_STATUS(epx_comm_create_local(world, 0, &comm), EPX_ERROR_TIMEOUT,
                "epx_comm_create_local: rank 1 did not arrive within 0.2 s");
  assert_true(tu_seconds() - t0 < 2.0);
  assert_ptr_equal(comm, poisoned);
  EXPECT_STATUS(epx_comm_create_local(world, 1, &comm), EPX_ERROR_PEER_FAILED,
                "epx_comm_create_local: the world failed earlier");
  assert_ptr_equal(comm, poisoned);
  EXPECT_OK(epx_local_world_destroy(world));
}

static void test_create_mpi_arguments(void **state) {
  (void)state;
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  int64_t fake_mpi_comm = 0;
  EXPECT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_mpi: comm is NULL");
  EXPECT_STATUS(epx_comm_create_mpi(NULL, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_mpi: mpi_comm is NULL");
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.version = 0;
  EXPECT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, &config, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_mpi: config->version is 0");
  if (epx_has_mpi()) /* This process never called MPI_Init. */
    EXPECT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                  "epx_comm_create_mpi: MPI is not initialised");
  else
    EXPECT_STATUS(epx_comm_create_mpi(&fake_mpi_comm, NULL, &comm), EPX_ERROR_UNSUPPORTED,
                  "epx_comm_create_mpi: this build of epx has no MPI transport");
  assert_ptr_equal(comm, poisoned);
  EXPECT_OK(epx_comm_create_self(&comm));
  EXPECT_OK(epx_comm_destroy(comm));
  EXPECT_STATUS(epx_comm_create_self(NULL), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_self: comm is NULL");
}

/* A timeout's text tells the rank that did not arrive from the ranks only
 * blocked behind it (their notices say whom they waited for; MPI): 4 ranks,
 * rank 3 stopped, ranks 1 and 2 a call behind waiting for it, rank 0 a call
 * on. */
static void test_timeout_text_names_the_cause(void **state) {
  (void)state;
  char text[768];
  const uint8_t missing[4] = {0, 1, 1, 1}, waiting[4] = {0, 1, 1, 0}, behind[4] = {0, 0, 0, 1};
  const uint8_t none[4] = {0};
  epx_comm_timeout_text(text, sizeof text, 4, "barrier", 2.0, missing, waiting, behind, none,
                        none);
  assert_string_equal(text, "rank 3 did not arrive within 2 s (comm timeout_seconds): no message "
                      "of this barrier came from it (failed before it, stuck, or in another "
                      "call); ranks 1, 2 did not arrive either, but only waiting: blocked in "
                      "another call, they timed out waiting for rank 3");
  /* No notices: every missing rank is named as not arriving, as before. */
  epx_comm_timeout_text(text, sizeof text, 4, "barrier", 2.0, missing, none, none, none, none);
  assert_string_equal(text, "ranks 1, 2, 3 did not arrive within 2 s (comm timeout_seconds): no "
                      "message of this barrier came from them (failed before it, stuck, or in "
                      "another call)");
  /* Ranks whose message came but which timed out too say whom they missed. */
  const uint8_t three[4] = {0, 0, 0, 1}, also[4] = {0, 1, 1, 0};
  epx_comm_timeout_text(text, sizeof text, 4, "alltoall", 0.5, three, none, none, also, three);
  assert_string_equal(text, "rank 3 did not arrive within 0.5 s (comm timeout_seconds): no "
                      "message of this alltoall came from it (failed before it, stuck, or in "
                      "another call); ranks 1, 2 timed out waiting for rank 3 too");
  /* Every missing rank only waiting. */
  const uint8_t one[4] = {0, 1, 0, 0};
  epx_comm_timeout_text(text, sizeof text, 4, "barrier", 1.0, one, one, three, none, none);
  assert_string_equal(text, "rank 1 did not arrive within the timeout, but only waiting: blocked "
                      "in another call, it timed out waiting for rank 3");
  /* A small buffer is cut, not overrun. */
  char small[24];
  epx_comm_timeout_text(small, sizeof small, 4, "barrier", 2.0, missing, waiting, behind, none,
                        none);
  assert_int_equal(strlen(small), sizeof small - 1);
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
      cmocka_unit_test(test_caller_collectives),
      cmocka_unit_test(test_world_create_arguments),
      cmocka_unit_test(test_create_local_arguments),
      cmocka_unit_test(test_create_local_timeout),
      cmocka_unit_test(test_create_mpi_arguments),
      cmocka_unit_test(test_timeout_text_names_the_cause),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
