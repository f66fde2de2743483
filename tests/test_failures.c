/* Failures between ranks never hang: a peer that stops calling turns into
 * EPX_ERROR_TIMEOUT naming it within the comm's timeout, after which every
 * call fails fast with EPX_ERROR_PEER_FAILED; a peer that refuses its input
 * turns into EPX_ERROR_PEER_FAILED naming it on the others, nothing moves,
 * and the comm stays usable. The comm timeout here is 0.3 s. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"
#include "buffer_config.h"
#include "clock.h"

#define TIMEOUT_S 0.3
#define H 16
#define E 12
#define K 2
#define T 10

/* ------------------------------------------------------------------------ */
/* One rank's exchange, step by step                                         */
/* ------------------------------------------------------------------------ */

typedef enum { STEP_LAYOUT, STEP_DISPATCH, STEP_COMBINE, STEP_COMBINE_BACKWARD, STEP_DISPATCH_BACKWARD, STEPS } step_t;

static const char *const step_names[] = {"epx_dispatch_layout", "epx_dispatch", "epx_combine", "epx_combine_backward",
                                         "epx_dispatch_backward"};

/* A rank's buffer, routing and tensors (payload float32 [.., H]). */
typedef struct {
  epx_buffer_t buffer;
  epx_handle_t handle;
  int32_t idx[T * K];
  float w[T * K];
  int64_t N;
  float *x, *recv, *expert_out, *out, *grad_out, *grad_expert_out, *grad_x;
  float grad_w[T * K];
} state_t;

static float *alloc_rows(int64_t rows) {
  void *p = NULL;
  if (posix_memalign(&p, 64, (size_t)(rows ? rows : 1) * H * sizeof(float))) return NULL;
  tu_poison(p, (size_t)(rows ? rows : 1) * H * sizeof(float));
  return p;
}

static int state_init(state_t *s, epx_comm_t comm, int32_t rank) {
  memset(s, 0, sizeof *s);
  epx_buffer_config_t bc = tu_config(EPX_DEVICE_CPU, EPX_FLOAT32, H, E, K, T);
  tu_rng_t rng = {42 + (uint64_t)rank};
  tu_random_routing(&rng, T, E, K, 0.0, s->idx, s->w);
  int64_t max_rows = 4 * T * K; /* W <= 4 ranks, K rows per token each */
  s->x = alloc_rows(T), s->out = alloc_rows(T), s->grad_out = alloc_rows(T), s->grad_x = alloc_rows(T);
  s->recv = alloc_rows(max_rows), s->expert_out = alloc_rows(max_rows), s->grad_expert_out = alloc_rows(max_rows);
  if (!s->x || !s->out || !s->grad_out || !s->grad_x || !s->recv || !s->expert_out || !s->grad_expert_out) return 1;
  tu_fill(&rng, EPX_FLOAT32, s->x, T * H);
  tu_fill(&rng, EPX_FLOAT32, s->expert_out, max_rows * H);
  tu_fill(&rng, EPX_FLOAT32, s->grad_out, T * H);
  if (epx_buffer_create(comm, &bc, &s->buffer) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_buffer_create: %s\n", rank, epx_last_error());
    return 1;
  }
  return 0;
}

static void state_fini(state_t *s) {
  epx_handle_release(s->handle);
  epx_buffer_destroy(s->buffer);
  free(s->x), free(s->out), free(s->grad_out), free(s->grad_x);
  free(s->recv), free(s->expert_out), free(s->grad_expert_out);
}

/* Runs one step with good arguments. */
static epx_status_t run_step(state_t *s, step_t step) {
  epx_routing_t routing = {T, K, s->idx, s->w, NULL, EPX_WEIGHTS_IN_COMBINE};
  switch (step) {
    case STEP_LAYOUT: {
      epx_handle_t h = NULL;
      epx_status_t st = epx_dispatch_layout(s->buffer, &routing, NULL, &h);
      if (st == EPX_SUCCESS) {
        epx_handle_release(s->handle);
        s->handle = h;
        epx_handle_recv_rows(h, &s->N);
      }
      return st;
    }
    case STEP_DISPATCH: return epx_dispatch(s->buffer, s->handle, s->x, s->recv, s->N);
    case STEP_COMBINE: return epx_combine(s->buffer, s->handle, s->expert_out, s->out);
    case STEP_COMBINE_BACKWARD:
      return epx_combine_backward(s->buffer, s->handle, s->grad_out, s->expert_out, s->grad_expert_out, s->grad_w);
    case STEP_DISPATCH_BACKWARD: return epx_dispatch_backward(s->buffer, s->handle, s->grad_expert_out, s->grad_x, NULL, NULL);
    case STEPS: break;
  }
  return EPX_ERROR_INTERNAL;
}

/* Shared by the ranks of one run. */
typedef struct {
  int32_t odd;  /* the rank that stops, or that errs */
  step_t step;  /* at which call */
  int variant;  /* which bad input (erring ranks) */
  int done;     /* ranks that finished their checks (atomic) */
} run_t;

/* The odd rank waits (making no call) until its peers are done, 5 s at most. */
static void wait_for_peers(run_t *run, int32_t world) {
  double deadline = tu_seconds() + 5.0;
  while (__atomic_load_n(&run->done, __ATOMIC_SEQ_CST) < world - 1 && tu_seconds() < deadline) {
    struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
  }
}

/* The steps before `step`, each expected to succeed: a rank's state when it
 * reaches `step`. Returns the failed checks. */
static int steps_before(state_t *s, int32_t rank, step_t step) {
  int failures = 0;
  for (step_t done = STEP_LAYOUT; done < step; done++) RANK_STATUS(run_step(s, done), EPX_SUCCESS, NULL);
  return failures;
}

/* ------------------------------------------------------------------------ */
/* A peer that stops                                                         */
/* ------------------------------------------------------------------------ */

static int stopped_peer_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  run_t *run = arg;
  int failures = 0;
  state_t s;
  if (state_init(&s, comm, rank)) return 1;
  failures += steps_before(&s, rank, run->step);
  char named[32];
  snprintf(named, sizeof named, "rank %d", run->odd);
  if (rank != run->odd) {
    double start = tu_seconds();
    RANK_STATUS(run_step(&s, run->step), EPX_ERROR_TIMEOUT, named);
    double elapsed = tu_seconds() - start;
    RANK_EXPECT(strstr(epx_last_error(), step_names[run->step]), "message does not name %s: %s", step_names[run->step], epx_last_error());
    RANK_EXPECT(elapsed < 3.0, "%s timed out after %.3f s (timeout %.1f s)",
                step_names[run->step], elapsed, TIMEOUT_S);
    /* The comm is failed: every later collective call refuses at once. */
    for (step_t later = STEP_LAYOUT; later < STEPS; later++) {
      if (later != STEP_LAYOUT && !s.handle) continue;
      start = tu_seconds();
      RANK_STATUS(run_step(&s, later), EPX_ERROR_PEER_FAILED, "failed");
      RANK_EXPECT(tu_seconds() - start < 0.1, "%s on a failed comm took %.3f s", step_names[later], tu_seconds() - start);
    }
    __atomic_add_fetch(&run->done, 1, __ATOMIC_SEQ_CST);
  } else {
    wait_for_peers(run, world);
    /* Arriving late, it finds the comm failed. */
    double start = tu_seconds();
    RANK_STATUS(run_step(&s, run->step), EPX_ERROR_PEER_FAILED, NULL);
    RANK_EXPECT(tu_seconds() - start < 0.1, "the late rank's call took %.3f s", tu_seconds() - start);
  }
  /* Handles and buffers are released without the peers (not collective). */
  RANK_STATUS(epx_handle_release(s.handle), EPX_SUCCESS, NULL);
  s.handle = NULL;
  RANK_STATUS(epx_buffer_destroy(s.buffer), EPX_SUCCESS, NULL);
  s.buffer = NULL;
  state_fini(&s);
  return failures;
}

static void test_stopped_peer_times_out(void **state) {
  (void)state;
  for (step_t step = STEP_LAYOUT; step < STEPS; step++) {
    run_t run = {2, step, 0, 0};
    if (tu_run_ranks(3, TIMEOUT_S, stopped_peer_rank, &run))
      fail_msg("3 ranks, rank 2 stops before %s: a rank failed", step_names[step]);
  }
  run_t first = {0, STEP_DISPATCH, 0, 0};
  assert_int_equal(tu_run_ranks(2, TIMEOUT_S, stopped_peer_rank, &first), 0);
}

/* A rank that passes a NULL buffer cannot even reach its comm: it returns at
 * once, and its peers time out naming it (epx.h, "Collective calls"). */
static int null_buffer_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  run_t *run = arg;
  int failures = 0;
  state_t s;
  if (state_init(&s, comm, rank)) return 1;
  RANK_STATUS(run_step(&s, STEP_LAYOUT), EPX_SUCCESS, NULL);
  char named[32];
  snprintf(named, sizeof named, "rank %d", run->odd);
  double start = tu_seconds();
  if (rank == run->odd) {
    RANK_STATUS(epx_dispatch(NULL, s.handle, s.x, s.recv, s.N), EPX_ERROR_INVALID_ARGUMENT, "buffer is NULL");
    RANK_EXPECT(tu_seconds() - start < 0.1, "a NULL buffer took %.3f s to refuse", tu_seconds() - start);
    wait_for_peers(run, world);
  } else {
    RANK_STATUS(epx_dispatch(s.buffer, s.handle, s.x, s.recv, s.N), EPX_ERROR_TIMEOUT, named);
    RANK_EXPECT(tu_seconds() - start < 3.0, "the timeout took %.3f s", tu_seconds() - start);
    __atomic_add_fetch(&run->done, 1, __ATOMIC_SEQ_CST);
  }
  state_fini(&s);
  return failures;
}

static void test_null_buffer_peer_times_out(void **state) {
  (void)state;
  run_t run = {1, STEP_DISPATCH, 0, 0};
  assert_int_equal(tu_run_ranks(3, TIMEOUT_S, null_buffer_rank, &run), 0);
}

/* ------------------------------------------------------------------------ */
/* A peer that refuses its input                                             */
/* ------------------------------------------------------------------------ */

/* Runs `step` with a bad argument; returns the substring its message must
 * have. */
static const char *run_bad_step(state_t *s, step_t step, int variant, epx_status_t *status) {
  epx_routing_t routing = {T, K, s->idx, s->w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  switch (step) {
    case STEP_LAYOUT:
      if (variant) {
        routing.num_tokens = -1;
        *status = epx_dispatch_layout(s->buffer, &routing, NULL, &h);
        return "routing.num_tokens is -1";
      }
      routing.weighting = EPX_WEIGHTS_IN_DISPATCH;
      routing.topk_w = NULL;
      *status = epx_dispatch_layout(s->buffer, &routing, NULL, &h);
      return "routing.topk_w is NULL";
    case STEP_DISPATCH:
      if (variant) {
        *status = epx_dispatch(s->buffer, s->handle, (const char *)s->x + 4, s->recv, s->N);
        return "x is not 16-byte aligned";
      }
      *status = epx_dispatch(s->buffer, s->handle, NULL, s->recv, s->N);
      return "x is NULL";
    case STEP_COMBINE:
      if (variant) {
        *status = epx_combine(s->buffer, s->handle, s->expert_out, s->expert_out);
        return "out aliases expert_out";
      }
      *status = epx_combine(s->buffer, s->handle, s->expert_out, (char *)s->out + 8);
      return "out is not 16-byte aligned";
    case STEP_COMBINE_BACKWARD:
      *status = epx_combine_backward(s->buffer, s->handle, s->grad_out, NULL, s->grad_expert_out, s->grad_w);
      return "expert_out is NULL";
    case STEP_DISPATCH_BACKWARD:
      *status = epx_dispatch_backward(s->buffer, s->handle, s->grad_expert_out, s->grad_x, s->x, NULL);
      return "x is given";
    case STEPS: break;
  }
  *status = EPX_ERROR_INTERNAL;
  return "";
}

/* fn on 3 ranks for every step from `first` on and both variants, the odd
 * rank (step + variant) % 3; a failed run is named (what the odd rank does). */
static void on_three_ranks_every_step(step_t first, tu_rank_fn fn, const char *what) {
  for (step_t step = first; step < STEPS; step++)
    for (int variant = 0; variant < 2; variant++) {
      run_t run = {(int32_t)(step + variant) % 3, step, variant, 0};
      if (tu_run_ranks(3, 10.0, fn, &run))
        fail_msg("rank %d %s in %s (variant %d): a rank failed", run.odd, what, step_names[step], variant);
    }
}

static int erring_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world;
  run_t *run = arg;
  int failures = 0;
  state_t s;
  if (state_init(&s, comm, rank)) return 1;
  failures += steps_before(&s, rank, run->step);
  /* Snapshots of everything a refused call could have written. */
  size_t rows_bytes = (size_t)(4 * T * K) * H * sizeof(float), token_bytes = (size_t)T * H * sizeof(float);
  void *before[4] = {malloc(rows_bytes), malloc(token_bytes), malloc(rows_bytes), malloc(token_bytes)};
  const void *live[4] = {s.recv, s.out, s.grad_expert_out, s.grad_x};
  size_t sizes[4] = {rows_bytes, token_bytes, rows_bytes, token_bytes};
  float grad_w_before[T * K];
  epx_handle_t handle_before = s.handle;
  for (int i = 0; i < 4; i++)
    if (before[i]) memcpy(before[i], live[i], sizes[i]);
  memcpy(grad_w_before, s.grad_w, sizeof grad_w_before);

  char named[32];
  snprintf(named, sizeof named, "rank %d", run->odd);
  double start = tu_seconds();
  if (rank == run->odd) {
    epx_status_t status;
    const char *needle = run_bad_step(&s, run->step, run->variant, &status);
    RANK_EXPECT(status == EPX_ERROR_INVALID_ARGUMENT && strstr(epx_last_error(), needle),
                "bad %s returned %s: \"%s\" (want \"%s\")", step_names[run->step], epx_status_string(status),
                epx_last_error(), needle);
  } else {
    RANK_STATUS(run_step(&s, run->step), EPX_ERROR_PEER_FAILED, named);
  }
  RANK_EXPECT(tu_seconds() - start < 1.0, "the refusal took %.3f s", tu_seconds() - start);
  for (int i = 0; i < 4; i++)
    RANK_EXPECT(before[i] && !memcmp(before[i], live[i], sizes[i]), "output %d was written by a refused %s", i,
                step_names[run->step]);
  RANK_EXPECT(!memcmp(grad_w_before, s.grad_w, sizeof grad_w_before), "grad_w was written by a refused call");
  RANK_EXPECT(s.handle == handle_before, "the handle changed");
  /* A refusal does not fail the comm: the same call with good input works. */
  RANK_STATUS(run_step(&s, run->step), EPX_SUCCESS, NULL);
  for (int i = 0; i < 4; i++) free(before[i]);
  state_fini(&s);
  return failures;
}

static void test_erring_peer_is_named_everywhere(void **state) {
  (void)state;
  on_three_ranks_every_step(STEP_LAYOUT, erring_rank, "errs");
  run_t four = {3, STEP_COMBINE, 0, 0};
  assert_int_equal(tu_run_ranks(4, 10.0, erring_rank, &four), 0);
}

/* A rank that passes a dead handle, or one from another buffer, to a call on
 * a live buffer: the comm is known, so the refusal is agreed like any bad
 * argument (epx.h: only a failure before the buffer or comm can be
 * identified leaves the peers to time out). */
static int bad_handle_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world;
  run_t *run = arg;
  int failures = 0;
  state_t s, other;
  if (state_init(&s, comm, rank) || state_init(&other, comm, rank)) return 1;
  RANK_STATUS(run_step(&s, STEP_LAYOUT), EPX_SUCCESS, NULL);
  RANK_STATUS(run_step(&other, STEP_LAYOUT), EPX_SUCCESS, NULL);
  epx_handle_t dead = NULL;
  epx_routing_t routing = {T, K, s.idx, s.w, NULL, EPX_WEIGHTS_IN_COMBINE};
  RANK_STATUS(epx_dispatch_layout(s.buffer, &routing, NULL, &dead), EPX_SUCCESS, NULL);
  RANK_STATUS(epx_handle_release(dead), EPX_SUCCESS, NULL);
  epx_handle_t bad = run->variant ? other.handle : dead, good = s.handle;
  char named[32];
  snprintf(named, sizeof named, "rank %d", run->odd);
  double start = tu_seconds();
  if (rank == run->odd) s.handle = bad;
  epx_status_t status = run_step(&s, run->step);
  s.handle = good;
  if (rank == run->odd)
    RANK_EXPECT(status == EPX_ERROR_INVALID_HANDLE && strstr(epx_last_error(), run->variant ? "another buffer" : "not live"),
                "a %s handle in %s returned %s: %s", run->variant ? "foreign" : "dead", step_names[run->step],
                epx_status_string(status), epx_last_error());
  else
    RANK_EXPECT(status == EPX_ERROR_PEER_FAILED && strstr(epx_last_error(), named), "%s returned %s: %s (want %s named)",
                step_names[run->step], epx_status_string(status), epx_last_error(), named);
  RANK_EXPECT(tu_seconds() - start < 1.0, "the refusal took %.3f s", tu_seconds() - start);
  /* The comm still works. */
  RANK_STATUS(run_step(&s, run->step), EPX_SUCCESS, NULL);
  state_fini(&other);
  state_fini(&s);
  return failures;
}

static void test_bad_handle_peer_is_named_everywhere(void **state) {
  (void)state;
  on_three_ranks_every_step(STEP_DISPATCH, bad_handle_rank, "passes a bad handle (variant 0: dead, 1: foreign)");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stopped_peer_times_out),
      cmocka_unit_test(test_null_buffer_peer_times_out),
      cmocka_unit_test(test_erring_peer_is_named_everywhere),
      cmocka_unit_test(test_bad_handle_peer_is_named_everywhere),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
