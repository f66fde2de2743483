/* Shrink and go on (epx.h: epx_comm_shrink, epx_placement_shrink; issue 37
 * item 4): a rank lost mid-step — a thread that stops (local comm) or a
 * process killed with SIGKILL (shm comm) — is named to the survivors within
 * the timeout; they shrink the comm, re-plan the placement over themselves,
 * recreate their buffers, and their next dispatch + expert + combine step
 * equals, bit for bit, a fresh run of as many ranks on the same placement.
 * The time from the loss to the survivors' next completed step is printed
 * ("recovery") and bounded (timeout + slack for a loaded CI machine). Also:
 * the agreement (every survivor the same lost list, also when one survivor
 * was elsewhere when the loss was found; a rank that comes late is
 * refused), the placement shrink's outputs, and the refusals. Every
 * process has a hard bound (alarm). */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <pthread.h>

#include "comm_cases.h"
#include "testutil.h"

#define W0 4      /* ranks before the loss */
#define E 8       /* logical experts */
#define P0 12     /* physical experts before (3 per rank) */
#define P1 12     /* after, over 3 survivors (4 per rank) */
#define K 2
#define H 16
#define T 24
#define TIMEOUT 1.0
#define SLACK 6.0 /* beyond the timeout, for a loaded 2-core CI machine */
#define HARD_BOUND_S 60

/* What the ranks share (a MAP_SHARED page for processes). */
typedef struct {
  int32_t victim;
  int32_t p2l0[P0];               /* the placement before the loss */
  int32_t p2l1[P1];               /* the survivors' plan (from new rank 0) */
  int32_t survivors_p2l[W0 * 3];
  int32_t lost[W0], num_lost[W0]; /* each survivor's view, by old rank */
  int32_t missing[W0];
  uint64_t hash[W0];               /* the step's output, by (new) rank */
  _Atomic int64_t loss_ns;         /* the moment the victim stopped */
  double recovery[W0];             /* loss -> survivor's next completed step */
  double detect[W0];               /* loss -> survivor's error */
  int32_t named[W0];               /* the error named the victim */
  atomic_int survivors_done;
  int32_t late_refused;            /* the victim's own shrink was refused */
  int32_t slow;                    /* a survivor that comes to the step late (-1: none): */
  double slow_s;                   /* it learns of the loss from the failure's record */
} shared_t;

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ULL;
  return h;
}

static double now_ns_to_s(int64_t ns) { return 1e-9 * (double)ns; }

static epx_buffer_t make_buffer(epx_comm_t comm, const epx_placement_t *pl) {
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = EPX_FLOAT32, c.hidden = H, c.num_experts = E, c.max_top_k = K, c.max_tokens_per_rank = T;
  c.placement = pl;
  epx_buffer_t b = NULL;
  if (epx_buffer_create(comm, &c, &b) != EPX_SUCCESS) fprintf(stderr, "epx_buffer_create: %s\n", epx_last_error());
  return b;
}

/* Rank `rank`'s input of step `seed`: a skewed routing and normal rows. */
static void make_input(int32_t rank, uint64_t seed, int32_t *idx, float *w, float *x) {
  tu_rng_t rng = {seed * 1000003ULL + (uint64_t)rank + 1};
  tu_random_routing(&rng, T, E, K, 1.1, idx, w);
  for (int64_t i = 0; i < (int64_t)T * H; i++) x[i] = tu_normal(&rng);
}

/* One step: the layout, dispatch, the expert (row * (1 + logical / 4)),
 * combine; *hash is out's bits. With `stop` the rank stops after the layout
 * (stop(arg) returns once the survivors are done) and returns its status. */
typedef struct {
  epx_handle_t h; /* left for the stopped rank's later call */
} step_left_t;

/* The failed step's epx_last_error (the handle's release clears it). */
static _Thread_local char step_error[1024];

static epx_status_t step(epx_buffer_t b, const int32_t *p2l, int32_t rank, uint64_t seed, uint64_t *hash,
                         void (*stop)(void *), void *arg, step_left_t *left) {
  int32_t idx[T * K];
  float w[T * K];
  _Alignas(64) float x[T * H], out[T * H];
  make_input(rank, seed, idx, w, x);
  epx_routing_t routing = {T, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  int64_t N = 0;
  float *recv = NULL, *eo = NULL;
  int32_t *rx = NULL;
  epx_status_t status = epx_dispatch_layout(b, &routing, NULL, &h);
  if (status != EPX_SUCCESS) {
    snprintf(step_error, sizeof step_error, "%s", epx_last_error());
    return status;
  }
  if (stop) {
    stop(arg);
    left->h = h;
    return EPX_SUCCESS;
  }
  status = epx_handle_recv_rows(h, &N);
  if (status != EPX_SUCCESS) goto done;
  recv = tu_alloc(sizeof(float) * (size_t)(N + 1) * H);
  eo = tu_alloc(sizeof(float) * (size_t)(N + 1) * H);
  rx = tu_alloc(sizeof(int32_t) * (size_t)(N + 1));
  status = epx_dispatch(b, h, x, recv, N);
  if (status == EPX_SUCCESS) status = epx_handle_recv_routing(h, rx, NULL);
  if (status != EPX_SUCCESS) goto done;
  for (int64_t i = 0; i < N; i++)
    for (int32_t j = 0; j < H; j++)
      eo[i * H + j] = rx[i] < 0 ? 0.0f : recv[i * H + j] * (1.0f + 0.25f * (float)p2l[rx[i]]);
  status = epx_combine(b, h, eo, out);
  if (status == EPX_SUCCESS) *hash = fnv(1469598103934665603ULL, out, sizeof out);
done:
  if (status != EPX_SUCCESS) snprintf(step_error, sizeof step_error, "%s", epx_last_error());
  epx_handle_release(h);
  tu_free(recv), tu_free(eo), tu_free(rx);
  return status;
}

/* ------------------------------------------------------------------------ */
/* A rank's life: a step, the loss, the shrink, the next step                */
/* ------------------------------------------------------------------------ */

typedef struct {
  shared_t *sh;
  int process; /* 1: the victim dies of SIGKILL; 0: it stops (a thread) */
} life_t;

static void victim_stop(void *arg) {
  life_t *life = arg;
  atomic_store(&life->sh->loss_ns, (int64_t)(tu_seconds() * 1e9));
  if (life->process) raise(SIGKILL);
  /* A thread that stops: it stays away until the survivors are done. */
  while (atomic_load(&life->sh->survivors_done) < W0 - 1) cc_sleep_seconds(0.005);
}

/* The victim after the survivors went on: its comm is failed, and its own
 * shrink is refused (it is not in the survivors' comm). */
static int victim_after(epx_comm_t comm, epx_buffer_t b, step_left_t *left, shared_t *sh, int32_t rank) {
  int failures = 0;
  _Alignas(64) float x[T * H] = {0};
  float recv[8 * H];
  RANK_EXPECT(epx_dispatch(b, left->h, x, recv, 0) != EPX_SUCCESS, "the victim's dispatch succeeded");
  epx_comm_t next = NULL;
  RANK_STATUS(epx_comm_shrink(comm, NULL, &next, NULL, NULL), EPX_ERROR_PEER_FAILED, "without rank");
  sh->late_refused = next == NULL;
  epx_handle_release(left->h);
  return failures;
}

static int survivor_after(epx_comm_t *comm, epx_buffer_t *b, epx_status_t status, shared_t *sh, int32_t rank) {
  int failures = 0;
  double loss = now_ns_to_s(atomic_load(&sh->loss_ns));
  sh->detect[rank] = tu_seconds() - loss;
  char named[32];
  snprintf(named, sizeof named, "rank %d", sh->victim);
  sh->named[rank] = (status == EPX_ERROR_TIMEOUT || status == EPX_ERROR_PEER_FAILED) && strstr(step_error, named);
  RANK_EXPECT(sh->named[rank], "%s: \"%s\" (want the loss named: %s)", epx_status_string(status), step_error,
              named);
  /* Shrink, re-plan, recreate, step. */
  RANK_OK(epx_buffer_destroy(*b));
  *b = NULL;
  epx_comm_t next = NULL;
  int32_t lost[W0], num_lost = -1, missing[E], num_missing = -1, new_rank = -1, new_size = -1;
  RANK_REQUIRE_OK(epx_comm_shrink(*comm, NULL, &next, lost, &num_lost));
  RANK_OK(epx_comm_destroy(*comm));
  *comm = next;
  RANK_OK(epx_comm_rank(next, &new_rank));
  RANK_OK(epx_comm_size(next, &new_size));
  RANK_EXPECT(new_size == W0 - 1 && new_rank == rank - (rank > sh->victim), "new rank %d of %d", new_rank, new_size);
  RANK_EXPECT(num_lost == 1 && lost[0] == sh->victim, "lost %d ranks (first %d)", num_lost, lost[0]);
  sh->num_lost[rank] = num_lost, sh->lost[rank] = lost[0];
  epx_placement_t old = {P0, sh->p2l0, NULL, EPX_REPLICA_ROUND_ROBIN};
  int32_t plan[P1], survivors[W0 * 3];
  double load[E];
  for (int32_t e = 0; e < E; e++) load[e] = 1.0 + (double)((e * 7) % 5);
  RANK_REQUIRE_OK(epx_placement_shrink(&old, E, W0, lost, num_lost, load, P1, 1, survivors, plan, missing,
                                       &num_missing));
  if (new_rank == 0) {
    memcpy(sh->p2l1, plan, sizeof plan);
    memcpy(sh->survivors_p2l, survivors, sizeof survivors);
  }
  sh->missing[rank] = num_missing;
  epx_placement_t pl = {P1, plan, NULL, EPX_REPLICA_ROUND_ROBIN};
  *b = make_buffer(next, &pl);
  RANK_REQUIRE(*b, "the survivors' buffer");
  uint64_t hash = 0;
  RANK_REQUIRE_OK(step(*b, plan, new_rank, 2, &hash, NULL, NULL, NULL));
  sh->recovery[rank] = tu_seconds() - loss;
  sh->hash[new_rank] = hash;
done:
  return failures;
}

static int life_rank(epx_comm_t *comm, int32_t rank, life_t *life) {
  shared_t *sh = life->sh;
  int failures = 0;
  epx_placement_t pl = {P0, sh->p2l0, NULL, EPX_REPLICA_ROUND_ROBIN};
  epx_buffer_t b = make_buffer(*comm, &pl);
  step_left_t left = {0};
  uint64_t hash = 0;
  RANK_REQUIRE(b, "buffer");
  RANK_REQUIRE_OK(step(b, sh->p2l0, rank, 1, &hash, NULL, NULL, NULL));
  if (rank == sh->victim) {
    RANK_REQUIRE_OK(step(b, sh->p2l0, rank, 2, &hash, victim_stop, life, &left));
    failures += victim_after(*comm, b, &left, sh, rank);
  } else {
    if (rank == sh->slow) cc_sleep_seconds(sh->slow_s);
    epx_status_t status = step(b, sh->p2l0, rank, 2, &hash, NULL, NULL, NULL);
    failures += survivor_after(comm, &b, status, sh, rank);
    atomic_fetch_add(&sh->survivors_done, 1);
  }
done:
  epx_buffer_destroy(b);
  return failures;
}

/* A fresh run of the survivors' size on their placement: its step must
 * hash as the survivors' did. Returns the failed checks. */
static int fresh_rank(epx_comm_t comm, int32_t rank, const shared_t *sh) {
  int failures = 0;
  epx_placement_t pl = {P1, sh->p2l1, NULL, EPX_REPLICA_ROUND_ROBIN};
  epx_buffer_t b = make_buffer(comm, &pl);
  uint64_t hash = 0;
  RANK_EXPECT(b, "fresh buffer");
  if (b) RANK_OK(step(b, sh->p2l1, rank, 2, &hash, NULL, NULL, NULL));
  RANK_EXPECT(hash == sh->hash[rank], "rank %d: the survivors' step differs from a fresh run's", rank);
  epx_buffer_destroy(b);
  return failures;
}

/* ------------------------------------------------------------------------ */
/* Threads (local comm)                                                      */
/* ------------------------------------------------------------------------ */

typedef struct {
  epx_local_world_t world;
  int32_t rank;
  life_t *life;
  int result;
  int fresh; /* a fresh run of the survivors' size on their placement */
} thread_arg_t;

static void *thread_main(void *p) {
  thread_arg_t *a = p;
  epx_comm_t comm = NULL;
  if (epx_comm_create_local(a->world, a->rank, &comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: %s\n", a->rank, epx_last_error());
    a->result = 1;
    return NULL;
  }
  a->result = a->fresh ? fresh_rank(comm, a->rank, a->life->sh) : life_rank(&comm, a->rank, a->life);
  if (epx_comm_destroy(comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_destroy: %s\n", a->rank, epx_last_error());
    a->result++;
  }
  return NULL;
}

static int run_threads(int32_t W, life_t *life, int fresh) {
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = TIMEOUT;
  epx_local_world_t world;
  if (epx_local_world_create(W, &config, &world) != EPX_SUCCESS) return W;
  pthread_t threads[W0];
  thread_arg_t args[W0];
  for (int32_t r = 0; r < W; r++) {
    args[r] = (thread_arg_t){world, r, life, 0, fresh};
    pthread_create(&threads[r], NULL, thread_main, &args[r]);
  }
  int failures = 0;
  for (int32_t r = 0; r < W; r++) {
    pthread_join(threads[r], NULL);
    failures += args[r].result != 0;
  }
  if (epx_local_world_destroy(world) != EPX_SUCCESS) {
    fprintf(stderr, "epx_local_world_destroy: %s\n", epx_last_error());
    failures++;
  }
  return failures;
}

static shared_t *new_shared(int32_t victim) {
  shared_t *sh = mmap(NULL, sizeof(shared_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(sh != MAP_FAILED);
  memset(sh, 0, sizeof *sh);
  sh->victim = victim;
  sh->slow = -1;
  double load[E];
  for (int32_t e = 0; e < E; e++) load[e] = 1.0 + (double)((e * 5) % 7);
  EXPECT_OK(epx_placement_plan(load, E, P0, W0, 1, 1, sh->p2l0));
  return sh;
}

static void report(const char *what, const shared_t *sh) {
  double worst = 0, worst_detect = 0;
  for (int32_t r = 0; r < W0; r++)
    if (r != sh->victim) {
      if (sh->recovery[r] > worst) worst = sh->recovery[r];
      if (sh->detect[r] > worst_detect) worst_detect = sh->detect[r];
    }
  printf("recovery (%s, %d -> %d ranks, timeout %g s): loss named after %.1f ms, next step done %.1f ms after the "
         "loss (shrink, re-plan, new buffer, step: %.1f ms); %d logical expert(s) without a surviving replica\n",
         what, W0, W0 - 1, TIMEOUT, 1e3 * worst_detect, 1e3 * worst, 1e3 * (worst - worst_detect),
         sh->missing[sh->victim == 0 ? 1 : 0]);
  assert_true(worst > 0 && worst < TIMEOUT + SLACK);
}

static void check_agreement(const shared_t *sh) {
  for (int32_t r = 0; r < W0; r++)
    if (r != sh->victim) {
      assert_int_equal(sh->num_lost[r], 1);
      assert_int_equal(sh->lost[r], sh->victim);
      assert_true(sh->named[r]);
    }
  assert_true(sh->late_refused || sh->victim < 0);
}

static void test_local_thread_stops(void **state) {
  (void)state;
  alarm(HARD_BOUND_S);
  shared_t *sh = new_shared(2);
  life_t life = {sh, 0};
  assert_int_equal(run_threads(W0, &life, 0), 0);
  check_agreement(sh);
  report("local, a thread stops", sh);
  assert_int_equal(run_threads(W0 - 1, &life, 1), 0);
  munmap(sh, sizeof *sh);
  alarm(0);
}

/* ------------------------------------------------------------------------ */
/* Processes (shm comm)                                                      */
/* ------------------------------------------------------------------------ */

static pid_t fork_rank(const char *name, int32_t r, int32_t size, life_t *life, int fresh) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  alarm(HARD_BOUND_S);
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = TIMEOUT;
  epx_comm_t comm = NULL;
  if (epx_comm_create_shm(name, r, size, &config, &comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_create_shm: %s\n", r, epx_last_error());
    _exit(1);
  }
  int failures = fresh ? fresh_rank(comm, r, life->sh) : life_rank(&comm, r, life);
  if (epx_comm_destroy(comm) != EPX_SUCCESS) failures++;
  _exit(failures ? 1 : 0);
}

static int run_processes(int32_t size, life_t *life, int fresh, int32_t killed) {
  static int made;
  char name[64];
  snprintf(name, sizeof name, "epx-test-shrink-%d-%d", (int)getpid(), made++);
  pid_t pids[W0];
  for (int32_t r = 0; r < size; r++) pids[r] = fork_rank(name, r, size, life, fresh);
  int failed = 0;
  for (int32_t r = 0; r < size; r++) failed += !tu_reap(pids[r], r, r == killed ? SIGKILL : 0);
  return failed;
}

/* Names of this test's segments still in /dev/shm (the old comm's, the
 * dead rank's, the survivors' "<name>.g1" and theirs: none may be left). */
static int leftover_names(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "epx-test-shrink-%d-", (int)getpid());
  return tu_shm_leftovers(prefix);
}

static void shm_killed(int32_t slow) {
  alarm(HARD_BOUND_S);
  shared_t *sh = new_shared(1);
  sh->slow = slow, sh->slow_s = 0.3;
  life_t life = {sh, 1};
  assert_int_equal(run_processes(W0, &life, 0, 1), 0);
  sh->late_refused = 1; /* the victim is dead: nobody comes late */
  check_agreement(sh);
  if (slow < 0) report("shm, a process killed with SIGKILL", sh);
  assert_int_equal(run_processes(W0 - 1, &life, 1, -1), 0);
  assert_int_equal(leftover_names(), 0);
  munmap(sh, sizeof *sh);
  alarm(0);
}

static void test_shm_process_killed(void **state) { (void)state, shm_killed(-1); }

/* A survivor that is not in the collective when the loss is found: its
 * next call fails from the failure's record, and the others' shrink waits
 * for it (alive, not named missing). */
static void test_shm_process_killed_survivor_elsewhere(void **state) { (void)state, shm_killed(3); }

/* ------------------------------------------------------------------------ */
/* The placement shrink and the refusals                                     */
/* ------------------------------------------------------------------------ */

static void test_placement_shrink(void **state) {
  (void)state;
  /* 4 ranks x 3: logical 0 on ranks 0 and 1 (replicated), 1..9 once. */
  int32_t p2l[12] = {0, 1, 2, 0, 3, 4, 5, 6, 7, 8, 9, 1};
  epx_placement_t old = {12, p2l, NULL, EPX_REPLICA_ROUND_ROBIN};
  int32_t lost[1] = {1}, survivors[9], plan[12], missing[10], num_missing = -1;
  EXPECT_OK(epx_placement_shrink(&old, 10, 4, lost, 1, NULL, 12, 1, survivors, plan, missing, &num_missing));
  const int32_t want_survivors[9] = {0, 1, 2, 5, 6, 7, 8, 9, 1};
  assert_memory_equal(survivors, want_survivors, sizeof survivors);
  /* 3 and 4 were only on rank 1; 0 survives on rank 0. */
  assert_int_equal(num_missing, 2);
  for (int32_t e = 0; e < 10; e++) assert_int_equal(missing[e], e == 3 || e == 4);
  /* The plan serves every logical expert and is the same every time. */
  int32_t seen[10] = {0}, again[12];
  for (int32_t p = 0; p < 12; p++) seen[plan[p]]++;
  for (int32_t e = 0; e < 10; e++) assert_true(seen[e] >= 1);
  EXPECT_OK(epx_placement_shrink(&old, 10, 4, lost, 1, NULL, 12, 1, NULL, again, NULL, NULL));
  assert_memory_equal(plan, again, sizeof plan);
  /* Nothing missing: the survivors' placement is a valid `from`. */
  int32_t lost3[1] = {3};
  EXPECT_OK(epx_placement_shrink(&old, 10, 4, lost3, 1, NULL, 12, 1, survivors, plan, missing, &num_missing));
  assert_int_equal(num_missing, 2); /* 8 and 9 */
  int32_t p2l_r[12] = {0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5};
  epx_placement_t rep = {12, p2l_r, NULL, EPX_REPLICA_ROUND_ROBIN};
  EXPECT_OK(epx_placement_shrink(&rep, 6, 4, lost3, 1, NULL, 6, 1, survivors, plan, missing, &num_missing));
  assert_int_equal(num_missing, 0);
  /* Refusals name the argument. */
  int32_t dup[2] = {1, 1}, bad[1] = {4};
  EXPECT_STATUS(epx_placement_shrink(&old, 10, 4, dup, 2, NULL, 12, 1, NULL, plan, NULL, NULL),
                EPX_ERROR_INVALID_ARGUMENT, "lost_ranks[1]");
  EXPECT_STATUS(epx_placement_shrink(&old, 10, 4, bad, 1, NULL, 12, 1, NULL, plan, NULL, NULL),
                EPX_ERROR_INVALID_ARGUMENT, "lost_ranks[0]");
  EXPECT_STATUS(epx_placement_shrink(&old, 10, 4, lost, 1, NULL, 10, 1, NULL, plan, NULL, NULL),
                EPX_ERROR_INVALID_ARGUMENT, "num_physical");
  EXPECT_STATUS(epx_placement_shrink(&old, 10, 4, lost, 1, NULL, 12, 1, NULL, NULL, NULL, NULL),
                EPX_ERROR_INVALID_ARGUMENT, "physical_to_logical");
}

/* A live comm shrunk by every rank: all kept, renumbered as before. */
static int all_join_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)arg;
  int failures = 0;
  epx_comm_t next = NULL;
  int32_t num_lost = -1, new_rank = -1;
  RANK_REQUIRE_OK(epx_comm_shrink(comm, NULL, &next, NULL, &num_lost));
  RANK_EXPECT(num_lost == 0, "lost %d", num_lost);
  RANK_OK(epx_comm_rank(next, &new_rank));
  RANK_EXPECT(new_rank == rank, "new rank %d", new_rank);
  RANK_OK(epx_comm_barrier(next));
  RANK_STATUS(epx_comm_shrink(comm, NULL, &next, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "already shrank");
  RANK_STATUS(epx_comm_barrier(comm), EPX_ERROR_PEER_FAILED, NULL);
  RANK_OK(epx_comm_destroy(next));
  (void)world;
done:
  return failures;
}

static void test_shrink_live_comm_and_refusals(void **state) {
  (void)state;
  alarm(HARD_BOUND_S);
  assert_int_equal(tu_run_ranks(3, 5.0, all_join_rank, NULL), 0);
  epx_comm_t self = NULL, next = NULL;
  EXPECT_OK(epx_comm_create_self(&self));
  EXPECT_STATUS(epx_comm_shrink(self, NULL, &next, NULL, NULL), EPX_ERROR_UNSUPPORTED, "self");
  EXPECT_STATUS(epx_comm_shrink(self, NULL, NULL, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "survivor_comm");
  EXPECT_OK(epx_comm_destroy(self));
  EXPECT_STATUS(epx_comm_shrink(self, NULL, &next, NULL, NULL), EPX_ERROR_INVALID_HANDLE, "not a live comm");
  EXPECT_STATUS(epx_comm_shrink(NULL, NULL, &next, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT, "comm is NULL");
  alarm(0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_placement_shrink),
      cmocka_unit_test(test_shrink_live_comm_and_refusals),
      cmocka_unit_test(test_local_thread_stops),
      cmocka_unit_test(test_shm_process_killed),
      cmocka_unit_test(test_shm_process_killed_survivor_elsewhere),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
