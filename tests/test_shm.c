/* The shm transport: ranks as forked processes of this test meeting in POSIX
 * shared memory. The transport cases every transport passes
 * (tests/util/comm_cases.c: every collective with payloads that encode
 * source, destination and index, the big round growing each rank's data
 * segment; a skipped collective turned into a timeout naming the rank), then
 * shm's own: a rank killed with SIGKILL is named, a wrong size or a missing
 * rank 0 is refused, and no name is left in /dev/shm; then issue 38's: ranks
 * killed (SIGKILL) or stopped (SIGSTOP) inside a loop of collectives, and
 * killed holding the segment's lock, are named within the timeout, and a
 * segment left by a killed job is reclaimed or refused by name on every
 * rank. Every rank process has a hard bound (alarm) so that a hang fails. Each rank
 * is a process: its failed checks are its exit status. */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm_cases.h"
#include "core/transport.h"
#include "testutil.h"

typedef int (*rank_fn)(epx_comm_t comm, int32_t rank, int32_t size, void *shared);

static int comms_made;

/* The ranks_per_node each rank's comm config poses (0: none). */
static int32_t posed_ranks_per_node[16];

static void comm_name(char *out, size_t cap) {
  snprintf(out, cap, "epx-test-shm-%d-%d", (int)getpid(), comms_made++);
}

/* A hard bound on every rank process: a regression that hangs fails the
 * test (SIGALRM) instead of hanging CI. */
#define RANK_HARD_BOUND_S 30

/* Forks rank `r` of `size` on `name`: after `delay` seconds it makes the comm
 * and runs fn; its exit status is its failed checks (0: passed). */
static pid_t fork_rank(const char *name, int32_t r, int32_t size, double timeout, rank_fn fn,
                       void *shared, double delay) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  alarm(RANK_HARD_BOUND_S);
  if (delay > 0) cc_sleep_seconds(delay);
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = timeout;
  config.ranks_per_node = posed_ranks_per_node[r];
  epx_comm_t comm = NULL;
  epx_status_t status = epx_comm_create_shm(name, r, size, &config, &comm);
  if (status != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_create_shm: %s\n", r, epx_last_error());
    _exit(1);
  }
  int failures = fn ? fn(comm, r, size, shared) : 0;
  if (epx_comm_destroy(comm) != EPX_SUCCESS) failures++;
  _exit(failures ? 1 : 0);
}

/* Forks `size` ranks; each makes the comm and runs fn. Returns the number of
 * ranks that failed; `killed` ranks must die of SIGKILL instead. */
static int run_processes(int32_t size, double timeout, rank_fn fn, void *shared, int32_t killed) {
  char name[64];
  comm_name(name, sizeof name);
  pid_t pids[16];
  for (int32_t r = 0; r < size; r++) pids[r] = fork_rank(name, r, size, timeout, fn, shared, 0);
  int failed = 0;
  for (int32_t r = 0; r < size; r++) failed += !tu_reap(pids[r], r, r == killed ? SIGKILL : 0);
  return failed;
}

/* Names of this test's segments still in /dev/shm. */
static int leftover_names(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "epx-test-shm-%d-", (int)getpid());
  return tu_shm_leftovers(prefix);
}

static void *shared_page(void) {
  void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(p != MAP_FAILED);
  memset(p, 0, 4096);
  return p;
}

static int ops_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  (void)rank, (void)shared;
  int failures = 0;
  RANK_EXPECT(COMM(comm)->size == size && !strcmp(COMM(comm)->ops->name, "shm"),
              "comm is a %s comm of %d ranks", COMM(comm)->ops->name, COMM(comm)->size);
  return failures + cc_ops(comm, 5, NULL);
}

static void run_ops(int32_t size) {
  assert_int_equal(run_processes(size, 30.0, ops_rank, NULL, -1), 0);
  assert_int_equal(leftover_names(), 0);
}

static void test_shm_ops_w1(void **state) { (void)state, run_ops(1); }
static void test_shm_ops_w2(void **state) { (void)state, run_ops(2); }
static void test_shm_ops_w4(void **state) { (void)state, run_ops(4); }

static void test_shm_timeout_names_rank(void **state) {
  (void)state;
  cc_timeout_t *t = shared_page();
  *t = (cc_timeout_t){2, 0, 0.3, {"test_timeout: rank 2 did not arrive within 0.3 s", NULL},
                      "did not arrive within 0.3 s", 1, cc_wait_for_timeouts, 0};
  atomic_init(&t->timed_out, 0);
  assert_int_equal(run_processes(3, t->timeout, cc_timeout_rank, t, -1), 0);
  munmap(t, 4096);
  assert_int_equal(leftover_names(), 0);
}

/* The last rank dies (SIGKILL) after the create; the others' next barrier
 * fails naming it (a peer failure once its process is seen gone, a timeout
 * where that cannot be seen), and they destroy their comms. */
static int killed_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  (void)shared;
  int failures = 0;
  if (rank == size - 1) raise(SIGKILL);
  char expected[96];
  snprintf(expected, sizeof expected, "rank %d did not arrive", size - 1);
  epx_status_t status = COMM(comm)->ops->barrier(COMM(comm), "test_killed");
  RANK_EXPECT((status == EPX_ERROR_PEER_FAILED || status == EPX_ERROR_TIMEOUT) &&
                  tu_message_has(expected),
              "%s: \"%s\" (want a peer failure or timeout saying \"%s\")",
              epx_status_string(status), epx_last_error(), expected);
  return failures;
}

static void test_shm_killed_rank_is_named(void **state) {
  (void)state;
  assert_int_equal(run_processes(3, 0.5, killed_rank, NULL, 2), 0);
  assert_int_equal(leftover_names(), 0);
}

/* One round of a loop of small collectives. */
static epx_status_t loop_round(epx_comm_t id, int32_t rank, int32_t size) {
  epx_comm_t comm = COMM(id);
  int64_t values[2] = {rank, -rank};
  int32_t send[16], recv[16];
  for (int32_t p = 0; p < size; p++) send[p] = rank * 100 + p;
  epx_status_t status = comm->ops->barrier(comm, "test_loop");
  if (status == EPX_SUCCESS) status = comm->ops->allreduce_max_i64(comm, "test_loop", values, 2);
  if (status == EPX_SUCCESS)
    status = comm->ops->alltoall(comm, "test_loop", send, recv, sizeof(int32_t));
  return status;
}

/* A rank killed (SIGKILL) or stopped (SIGSTOP) in the middle of a loop of
 * collectives (issue 38: survivors blocked forever in the segment's shared
 * condition variable). */
typedef struct victim_case {
  double timeout;
  int32_t victim;
  atomic_int started;      /* ranks through their first round */
  atomic_int reported;     /* survivors that have their error */
  _Atomic int64_t signal_ns; /* CLOCK_MONOTONIC ns when the victim was signalled (0: not yet) */
} victim_case_t;

/* Loops until a call fails: a survivor's error names the victim, as a
 * timeout or a peer failure, within timeout + slack of the signal. */
static int victim_loop_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  victim_case_t *v = shared;
  int failures = 0;
  for (int round = 0;; round++) {
    epx_status_t status = loop_round(comm, rank, size);
    if (status == EPX_SUCCESS) {
      if (round == 0) atomic_fetch_add(&v->started, 1);
      continue;
    }
    if (rank == v->victim) return 0; /* continued after SIGSTOP: the comm has failed */
    double after = tu_seconds() - 1e-9 * (double)atomic_load(&v->signal_ns);
    char named[32];
    snprintf(named, sizeof named, "rank %d", v->victim);
    RANK_EXPECT((status == EPX_ERROR_TIMEOUT || status == EPX_ERROR_PEER_FAILED) &&
                    tu_message_has(named),
                "round %d: %s: \"%s\" (want a timeout or peer failure naming %s)", round,
                epx_status_string(status), epx_last_error(), named);
    RANK_EXPECT(atomic_load(&v->signal_ns) != 0 && after < v->timeout + 3.0,
                "round %d: the error came %.2f s after the signal (timeout %g s + 3 s slack)",
                round, after, v->timeout);
    /* The comm is destroyed on return: a survivor still waiting would read
     * that destroy as its cause, so each waits for the others' errors. */
    atomic_fetch_add(&v->reported, 1);
    double give_up = tu_seconds() + v->timeout + 10.0;
    while (atomic_load(&v->reported) < size - 1 && tu_seconds() < give_up) cc_sleep_seconds(0.001);
    return failures;
  }
}

/* Runs 3 ranks looping; once all loop, `sig` goes to the victim after
 * `delay`; a stopped victim is continued once the survivors are done. */
static int run_victim(int32_t victim, int sig, double delay) {
  const int32_t size = 3;
  victim_case_t *v = shared_page();
  v->timeout = 2.0;
  v->victim = victim;
  atomic_init(&v->started, 0);
  atomic_init(&v->reported, 0);
  atomic_init(&v->signal_ns, 0);
  char name[64];
  comm_name(name, sizeof name);
  pid_t pids[3];
  for (int32_t r = 0; r < size; r++)
    pids[r] = fork_rank(name, r, size, v->timeout, victim_loop_rank, v, 0);
  double give_up = tu_seconds() + 30.0;
  while (atomic_load(&v->started) < size && tu_seconds() < give_up) cc_sleep_seconds(0.001);
  if (delay > 0) cc_sleep_seconds(delay);
  atomic_store(&v->signal_ns, (int64_t)(tu_seconds() * 1e9));
  kill(pids[victim], sig);
  int failed = 0;
  if (sig == SIGKILL) failed += !tu_reap(pids[victim], victim, SIGKILL);
  for (int32_t r = 0; r < size; r++)
    if (r != victim) failed += !tu_reap(pids[r], r, 0);
  if (sig == SIGSTOP) {
    kill(pids[victim], SIGCONT);
    failed += !tu_reap(pids[victim], victim, 0);
  }
  munmap(v, 4096);
  return failed;
}

/* Names of a killed rank's data segments may be left: its survivors remove
 * those of ranks whose process is gone. */
static void test_shm_sigkill_in_a_loop(void **state) {
  (void)state;
  const double delays[] = {0.0, 0.003, 0.011, 0.029, 0.047, 0.1};
  for (int i = 0; i < 6; i++) assert_int_equal(run_victim(i % 3, SIGKILL, delays[i]), 0);
  assert_int_equal(leftover_names(), 0);
}

static void test_shm_sigstop_in_a_loop(void **state) {
  (void)state;
  const double delays[] = {0.0, 0.017, 0.05};
  for (int i = 0; i < 3; i++) assert_int_equal(run_victim((i + 1) % 3, SIGSTOP, delays[i]), 0);
  assert_int_equal(leftover_names(), 0);
}

/* Rank 1 dies holding the segment's lock (2 ranks): rank 0's error names
 * it. */
static int lock_holder_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  (void)size, (void)shared;
  int failures = 0;
  if (rank == 1) {
    epx_comm_shm_test_hold_lock(COMM(comm));
    raise(SIGKILL);
  }
  RANK_STATUS(COMM(comm)->ops->barrier(COMM(comm), "test_lock"), EPX_ERROR_PEER_FAILED, "rank 1");
  return failures;
}

static void test_shm_killed_holding_the_lock(void **state) {
  (void)state;
  assert_int_equal(run_processes(2, 2.0, lock_holder_rank, NULL, 1), 0);
  assert_int_equal(leftover_names(), 0);
}

static int exists_in_dev_shm(const char *name) {
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/%s", name);
  return access(path, F_OK) == 0;
}

/* Rank 0 alone on `name` (a world of `size`), waiting in the create for
 * ranks that never come; returns once its segment is there. */
static pid_t lone_rank0(const char *name, int32_t size, double timeout) {
  pid_t pid = fork_rank(name, 0, size, timeout, NULL, NULL, 0);
  double give_up = tu_seconds() + 20.0;
  while (!exists_in_dev_shm(name) && tu_seconds() < give_up) cc_sleep_seconds(0.001);
  cc_sleep_seconds(0.2); /* its init done */
  return pid;
}

static int ops_round_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  (void)rank, (void)size, (void)shared;
  return cc_ops(comm, 1, NULL);
}

/* A job whose rank 0 was killed waiting in the create leaves its segment
 * (issue 38: the next job's rank 0 failed with "File exists", its ranks 1
 * and 2 hung). A rank > 0 alone refuses it by name; a new job of 3 ranks
 * whose ranks 1 and 2 start first runs: rank 0 reclaims it. */
static void test_shm_stale_segment(void **state) {
  (void)state;
  char name[64];
  comm_name(name, sizeof name);
  pid_t old = lone_rank0(name, 3, 30.0);
  kill(old, SIGKILL);
  assert_true(tu_reap(old, 0, SIGKILL));
  assert_true(exists_in_dev_shm(name));

  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = 0.5;
  epx_comm_t comm = NULL;
  EXPECT_STATUS(epx_comm_create_shm(name, 1, 3, &config, &comm), EPX_ERROR_TIMEOUT,
                "left by an earlier job whose rank 0");
  assert_true(tu_message_has(name));

  pid_t pids[3];
  for (int32_t r = 0; r < 3; r++)
    pids[r] = fork_rank(name, r, 3, 10.0, ops_round_rank, NULL, r == 0 ? 0.3 : 0);
  for (int32_t r = 0; r < 3; r++) assert_true(tu_reap(pids[r], r, 0));
  assert_int_equal(leftover_names(), 0);
}

/* A name a live job is creating is refused by name at once. */
static void test_shm_live_segment_is_refused(void **state) {
  (void)state;
  char name[64];
  comm_name(name, sizeof name);
  pid_t live = lone_rank0(name, 2, 30.0);
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = 0.5;
  epx_comm_t comm = NULL;
  double t0 = tu_seconds();
  EXPECT_STATUS(epx_comm_create_shm(name, 0, 2, &config, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "is in use by a live job");
  assert_true(tu_message_has(name));
  assert_true(tu_seconds() - t0 < 0.4);
  kill(live, SIGKILL);
  assert_true(tu_reap(live, 0, SIGKILL));
  char object[72];
  snprintf(object, sizeof object, "/%s", name);
  shm_unlink(object);
  assert_int_equal(leftover_names(), 0);
}

/* Ranks whose comms pose different nodes (ranks_per_node 2 and 1) and ask
 * for EPX_EXCHANGE_HIERARCHICAL by name: refused at buffer creation, naming
 * ranks_per_node, on both ranks (issue 38: an alltoallv size mismatch at the
 * first layout, the comm lost); the comm stays usable. */
static int hier_disagree_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  (void)size, (void)shared;
  int failures = 0;
  epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
  cfg.dtype = EPX_FLOAT32, cfg.hidden = 16, cfg.num_experts = 4, cfg.max_top_k = 2;
  cfg.max_tokens_per_rank = 8, cfg.exchange = EPX_EXCHANGE_HIERARCHICAL;
  epx_buffer_t buffer = NULL;
  const char *expected = rank == 1 ? "rank 1's comm has ranks_per_node 1" : "ranks_per_node";
  RANK_STATUS(epx_buffer_create(comm, &cfg, &buffer), EPX_ERROR_SHAPE_MISMATCH, expected);
  cfg.exchange = EPX_EXCHANGE_DEDUP;
  RANK_OK(epx_buffer_create(comm, &cfg, &buffer));
  RANK_OK(epx_buffer_destroy(buffer));
  return failures;
}

static void test_shm_hier_ranks_per_node_disagree(void **state) {
  (void)state;
  posed_ranks_per_node[0] = 2, posed_ranks_per_node[1] = 1;
  int failed = run_processes(2, 10.0, hier_disagree_rank, NULL, -1);
  posed_ranks_per_node[0] = posed_ranks_per_node[1] = 0;
  assert_int_equal(failed, 0);
  assert_int_equal(leftover_names(), 0);
}

static void test_shm_arguments(void **state) {
  (void)state;
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = 0.2;
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  EXPECT_STATUS(epx_comm_create_shm(NULL, 0, 1, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "epx_comm_create_shm: name is NULL");
  EXPECT_STATUS(epx_comm_create_shm("a/b", 0, 1, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "[A-Za-z0-9._-]");
  EXPECT_STATUS(epx_comm_create_shm("epx-x", 2, 2, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "rank is 2; pass 0 <= rank < 2");
  EXPECT_STATUS(epx_comm_create_shm("epx-x", 0, 0, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT,
                "size is 0");
  char name[64];
  comm_name(name, sizeof name);
  EXPECT_STATUS(epx_comm_create_shm(name, 1, 2, &config, &comm), EPX_ERROR_TIMEOUT,
                "rank 0 did not create the shared segment");
  assert_true(comm == poisoned);
  assert_int_equal(leftover_names(), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shm_ops_w1),
      cmocka_unit_test(test_shm_ops_w2),
      cmocka_unit_test(test_shm_ops_w4),
      cmocka_unit_test(test_shm_timeout_names_rank),
      cmocka_unit_test(test_shm_killed_rank_is_named),
      cmocka_unit_test(test_shm_arguments),
      cmocka_unit_test(test_shm_killed_holding_the_lock),
      cmocka_unit_test(test_shm_hier_ranks_per_node_disagree),
      cmocka_unit_test(test_shm_live_segment_is_refused),
      cmocka_unit_test(test_shm_stale_segment),
      cmocka_unit_test(test_shm_sigkill_in_a_loop),
      cmocka_unit_test(test_shm_sigstop_in_a_loop),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
