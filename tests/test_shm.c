/* The shm transport: ranks as forked processes of this test meeting in POSIX
 * shared memory. The transport cases every transport passes
 * (tests/util/comm_cases.c: every collective with payloads that encode
 * source, destination and index, the big round growing each rank's data
 * segment; a skipped collective turned into a timeout naming the rank), then
 * shm's own: a rank killed with SIGKILL is a timeout naming it, a wrong size
 * or a missing rank 0 is refused, and no name is left in /dev/shm. Each rank
 * is a process: its failed checks are its exit status. */
#include <dirent.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm_cases.h"
#include "core/transport.h"
#include "testutil.h"

typedef int (*rank_fn)(epx_comm_t comm, int32_t rank, int32_t size, void *shared);

static int comms_made;

static void comm_name(char *out, size_t cap) {
  snprintf(out, cap, "epx-test-shm-%d-%d", (int)getpid(), comms_made++);
}

/* Forks `size` ranks; each makes the comm and runs fn. Returns the number of
 * ranks that failed; `killed` ranks must die of SIGKILL instead. */
static int run_processes(int32_t size, double timeout, rank_fn fn, void *shared, int32_t killed) {
  char name[64];
  comm_name(name, sizeof name);
  pid_t pids[16];
  for (int32_t r = 0; r < size; r++) {
    pids[r] = fork();
    if (pids[r] != 0) continue;
    epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
    config.timeout_seconds = timeout;
    epx_comm_t comm = NULL;
    epx_status_t status = epx_comm_create_shm(name, r, size, &config, &comm);
    if (status != EPX_SUCCESS) {
      fprintf(stderr, "rank %d: epx_comm_create_shm: %s\n", r, epx_last_error());
      _exit(1);
    }
    int failures = fn(comm, r, size, shared);
    if (epx_comm_destroy(comm) != EPX_SUCCESS) failures++;
    _exit(failures ? 1 : 0);
  }
  int failed = 0;
  for (int32_t r = 0; r < size; r++) {
    int wstatus = 0;
    waitpid(pids[r], &wstatus, 0);
    int ok = r == killed ? WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL
                         : WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0;
    if (!ok) {
      fprintf(stderr, "rank %d of %d ended with status 0x%x\n", r, size, wstatus);
      failed++;
    }
  }
  return failed;
}

/* Names of this test's segments still in /dev/shm. */
static int leftover_names(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "epx-test-shm-%d-", (int)getpid());
  DIR *dir = opendir("/dev/shm");
  if (!dir) return 0;
  int found = 0;
  for (struct dirent *e; (e = readdir(dir));)
    if (!strncmp(e->d_name, prefix, strlen(prefix))) {
      fprintf(stderr, "left in /dev/shm: %s\n", e->d_name);
      found++;
    }
  closedir(dir);
  return found;
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

/* The skippers wait until the others have timed out (t lives in memory the
 * processes share), then find the comm failed too. */
static void wait_for_timeouts(cc_timeout_t *t, int timed_out) {
  if (timed_out) {
    atomic_fetch_add(&t->timed_out, 1);
    return;
  }
  double give_up = cc_now_seconds() + 20.0;
  while (atomic_load(&t->timed_out) < t->skip_from && cc_now_seconds() < give_up)
    cc_sleep_seconds(0.001);
}

static int timeout_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  (void)rank, (void)size;
  return cc_timeout_case(comm, shared);
}

static void test_shm_timeout_names_rank(void **state) {
  (void)state;
  cc_timeout_t *t = shared_page();
  *t = (cc_timeout_t){2, 0, 0.3, {"test_timeout: rank 2 did not arrive within 0.3 s", NULL},
                      "did not arrive within 0.3 s", 1, wait_for_timeouts, 0};
  atomic_init(&t->timed_out, 0);
  assert_int_equal(run_processes(3, t->timeout, timeout_rank, t, -1), 0);
  munmap(t, 4096);
  assert_int_equal(leftover_names(), 0);
}

/* The last rank dies (SIGKILL) after the create; the others' next barrier
 * times out naming it, and they destroy their comms. */
static int killed_rank(epx_comm_t comm, int32_t rank, int32_t size, void *shared) {
  (void)shared;
  int failures = 0;
  if (rank == size - 1) raise(SIGKILL);
  char expected[96];
  snprintf(expected, sizeof expected, "rank %d did not arrive within 0.5 s", size - 1);
  RANK_STATUS(COMM(comm)->ops->barrier(COMM(comm), "test_killed"), EPX_ERROR_TIMEOUT, expected);
  return failures;
}

static void test_shm_killed_rank_is_a_timeout_naming_it(void **state) {
  (void)state;
  assert_int_equal(run_processes(3, 0.5, killed_rank, NULL, 2), 0);
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
      cmocka_unit_test(test_shm_killed_rank_is_a_timeout_naming_it),
      cmocka_unit_test(test_shm_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
