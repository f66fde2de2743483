/* The low-latency active-rank mask (epx.h: epx_ll_mask_rank; issue 37 item
 * 4) on thread ranks: 3 ranks run low-latency decode steps; rank 2 stops
 * (it makes no more calls); the survivors' next epx_ll_dispatch times out
 * naming it, they mask it, and their next steps — on the same comm and
 * buffer — complete and equal, bit for bit, a reference in which rank 2's
 * experts are dropped (inputs of small integers and weights of 1/2 and 1/4,
 * so every sum is exact whatever its order). Both layouts, expert-major
 * and rank-major. Also: the query and the clean, the masked rank's own call
 * refused, a normal buffer's call over the masked comm refused, and the
 * refusals (self, range, a normal buffer, a transport without a mask).
 * Then the same over shm (processes of one host): rank 2's process is
 * killed (SIGKILL) at a random point of a decode loop; the survivors' step
 * fails naming it, they mask it, the query says so, and their next steps on
 * the same comm and buffer equal the reference without its experts; the
 * time from the kill to the survivors' next completed step is printed.
 * Every test has a hard bound (alarm). */
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm_cases.h"
#include "testutil.h"
#include "clock.h"

#define W 3
#define E 6 /* 2 experts per rank */
#define K 3
#define H 8
#define T 5
#define VICTIM 2
#define WMAX 4 /* the stress test's world (test_mask_threads_stress) */
#define TIMEOUT 0.5
#define HARD_BOUND_S 60

typedef struct {
  epx_layout_t layout;
  atomic_int survivors_done;
  int32_t named[W];  /* the timeout named the victim */
  int32_t checked[W]; /* steps checked after the mask */
  int32_t refused;   /* the victim's late call was refused */
  double lost_step_s[W]; /* the step that timed out: its call's time */
  double next_step_s[W]; /* its error -> the next step done (mask included) */
} scene_t;

/* Rank `rank`'s input of step `step`: distinct experts per token, weights
 * 1/2 or 1/4, rows of small integers. */
static void make_input_w(int32_t world, int32_t rank, int32_t step, int32_t *idx, float *w, float *x) {
  const int32_t experts = world * (E / W);
  tu_rng_t rng = {(uint64_t)(step * 131 + rank + 7)};
  for (int32_t t = 0; t < T; t++) {
    int32_t first = tu_below(&rng, experts);
    for (int32_t k = 0; k < K; k++) {
      idx[t * K + k] = (first + 2 * k + (t & 1)) % experts;
      w[t * K + k] = (tu_below(&rng, 2) ? 0.5f : 0.25f);
    }
    if (t == T - 1) idx[t * K + K - 1] = -1;
  }
  for (int32_t i = 0; i < T * H; i++) x[i] = (float)(tu_below(&rng, 17) - 8);
}

static void make_input(int32_t rank, int32_t step, int32_t *idx, float *w, float *x) {
  make_input_w(W, rank, step, idx, w, x);
}

/* The expert: row * (1 + e), e the global expert (exact in float32). */
static float expert_scale(int32_t e) { return (float)(1 + e); }

/* The reference out[t] = the sum over the token's experts not on a masked
 * rank of w * (1 + e) * x[t]. */
static void reference(const int32_t *idx, const float *w, const float *x, const int32_t *mask, float *out) {
  for (int32_t t = 0; t < T; t++)
    for (int32_t j = 0; j < H; j++) {
      float sum = 0;
      for (int32_t k = 0; k < K; k++) {
        int32_t e = idx[t * K + k];
        if (e >= 0 && !mask[e / (E / W)]) sum += w[t * K + k] * expert_scale(e) * x[t * H + j];
      }
      out[t * H + j] = sum;
    }
}

/* The stress test's jitter (test_mask_threads_stress): when set, the
 * calling thread pauses a random while between a step's dispatch and its
 * combine, where the expert runs. */
static _Thread_local tu_rng_t *step_jitter;

/* Nothing, a yield, or a sleep of up to `max_us` microseconds. */
static void jitter(tu_rng_t *rng, int32_t max_us) {
  int32_t kind = tu_below(rng, 4);
  if (kind == 1) sched_yield();
  if (kind >= 2) usleep((useconds_t)tu_below(rng, max_us + 1));
}

/* The last step's error (epx_handle_release clears epx_last_error). */
static _Thread_local char step_error[1024];

/* One decode step; 0 when out equals the reference under mask. */
static int ll_step_w(epx_buffer_t b, int32_t world, int32_t rank, int32_t step, const int32_t *mask,
                     epx_layout_t layout, epx_status_t *status) {
  int32_t idx[T * K], recv_count[WMAX * WMAX * (E / W)];
  float w[T * K];
  _Alignas(64) float x[T * H], out[T * H], want[T * H];
  make_input_w(world, rank, step, idx, w, x);
  epx_routing_t routing = {T, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  int64_t rows = (layout == EPX_LAYOUT_RANK_MAJOR ? 1 : E / W) * (int64_t)world * T; /* the fixed shape */
  float *recv = tu_alloc(sizeof(float) * (size_t)rows * H);
  int32_t *rx = tu_alloc(sizeof(int32_t) * (size_t)rows * K);
  float *rw = tu_alloc(sizeof(float) * (size_t)rows * K);
  epx_handle_t h = NULL;
  int bad = 0;
  if (layout == EPX_LAYOUT_RANK_MAJOR) routing.weighting = EPX_WEIGHTS_NONE;
  *status = epx_ll_dispatch(b, &routing, NULL, x, recv, recv_count, &h);
  if (*status == EPX_SUCCESS) *status = epx_handle_recv_routing(h, rx, rw);
  if (*status == EPX_SUCCESS) {
    /* The expert: expert-major rows scaled by their expert; a rank-major
     * row (a token's local experts, weighted by the expert: WEIGHTS_NONE)
     * by the weighted sum of its slots' scales. */
    int32_t slots = layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
    int32_t groups = layout == EPX_LAYOUT_RANK_MAJOR ? world : E / W;
    for (int32_t g = 0; g < groups; g++)
      for (int32_t i = 0; i < recv_count[g]; i++) {
        int64_t row = (int64_t)g * (rows / groups) + i;
        float factor = 0;
        for (int32_t s = 0; s < slots; s++) {
          int32_t e = rx[row * slots + s];
          if (e < 0) continue;
          if (mask[e / (E / W)]) bad = 1; /* a row for a masked rank's expert */
          factor += (slots > 1 ? rw[row * slots + s] : 1.0f) * expert_scale(e);
        }
        for (int32_t j = 0; j < H; j++) recv[row * H + j] *= factor;
      }
    if (step_jitter) jitter(step_jitter, 300);
    *status = epx_ll_combine(b, h, recv, out);
  }
  if (*status == EPX_SUCCESS) {
    reference(idx, w, x, mask, want);
    bad |= memcmp(out, want, sizeof out) != 0;
    if (bad) snprintf(step_error, sizeof step_error, "out differs from the reference");
  } else {
    snprintf(step_error, sizeof step_error, "%s", epx_last_error());
  }
  epx_handle_release(h); /* clears epx_last_error: step_error keeps it */
  tu_free(recv);
  tu_free(rx);
  tu_free(rw);
  return bad;
}

static int ll_step(epx_buffer_t b, int32_t rank, int32_t step, const int32_t *mask, epx_layout_t layout,
                   epx_status_t *status) {
  return ll_step_w(b, W, rank, step, mask, layout, status);
}

static int victim_main(epx_buffer_t b, scene_t *sc) {
  /* It stops: no call until the survivors are done with it. */
  while (!atomic_load(&sc->survivors_done)) usleep(1000);
  int32_t idx[T * K];
  float w[T * K];
  _Alignas(64) float x[T * H], recv[(E / W) * W * T * H];
  make_input(VICTIM, 99, idx, w, x);
  epx_routing_t routing = {T, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  if (sc->layout == EPX_LAYOUT_RANK_MAJOR) routing.weighting = EPX_WEIGHTS_NONE;
  epx_handle_t h = NULL;
  epx_status_t status = epx_ll_dispatch(b, &routing, NULL, x, recv, NULL, &h);
  sc->refused = status == EPX_ERROR_PEER_FAILED && strstr(epx_last_error(), "masked");
  if (!sc->refused) fprintf(stderr, "victim's late call: %s: %s\n", epx_status_string(status), epx_last_error());
  return 0;
}

/* A normal buffer's call over a comm with a masked rank: refused naming it. */
static int normal_refused(epx_buffer_t normal) {
  int32_t idx[K] = {0, 2, 4};
  float w[K] = {1, 1, 1};
  epx_routing_t routing = {1, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  int ok = epx_dispatch_layout(normal, &routing, NULL, &h) == EPX_ERROR_UNSUPPORTED &&
           strstr(epx_last_error(), "rank 2 of the buffer's comm is masked");
  if (!ok) fprintf(stderr, "the normal buffer's layout: %s\n", epx_last_error());
  return ok;
}

static int survivor_main(epx_buffer_t b, epx_buffer_t normal, int32_t rank, scene_t *sc) {
  int32_t none[W] = {0}, mask[W] = {0}, got[W];
  epx_status_t status;
  /* The lost step: rank 2 does not come. */
  double started = tu_seconds();
  (void)ll_step(b, rank, 3, none, sc->layout, &status);
  double failed_at = tu_seconds();
  sc->lost_step_s[rank] = failed_at - started;
  sc->named[rank] = status == EPX_ERROR_TIMEOUT && strstr(step_error, "rank 2") != NULL;
  if (!sc->named[rank]) fprintf(stderr, "rank %d: %s: %s\n", rank, epx_status_string(status), step_error);
  if (epx_ll_mask_rank(b, VICTIM, 1) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_ll_mask_rank: %s\n", rank, epx_last_error());
    return 1;
  }
  if (epx_ll_query_mask(b, got) != EPX_SUCCESS || got[0] || got[1] || got[2] != 1) return 1;
  if (!normal_refused(normal)) return 1;
  mask[VICTIM] = 1;
  for (int32_t step = 4; step < 7; step++) {
    if (ll_step(b, rank, step, mask, sc->layout, &status) || status != EPX_SUCCESS) {
      fprintf(stderr, "rank %d step %d: %s: %s\n", rank, step, epx_status_string(status), step_error);
      return 1;
    }
    if (!sc->checked[rank]++) sc->next_step_s[rank] = tu_seconds() - failed_at;
  }
  /* Refusals: the calling rank itself, a rank out of range. */
  if (epx_ll_mask_rank(b, rank, 1) != EPX_ERROR_INVALID_ARGUMENT) return 1;
  return epx_ll_mask_rank(b, W, 1) != EPX_ERROR_INVALID_ARGUMENT;
}

static int mask_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  scene_t *sc = arg;
  (void)world;
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = EPX_FLOAT32, c.hidden = H, c.num_experts = E, c.max_top_k = K, c.max_tokens_per_rank = T;
  c.low_latency = 1, c.layout = sc->layout;
  epx_buffer_t b = NULL, normal = NULL;
  if (epx_buffer_create(comm, &c, &b) != EPX_SUCCESS) {
    fprintf(stderr, "epx_buffer_create: %s\n", epx_last_error());
    return 1;
  }
  c.low_latency = 0, c.layout = EPX_LAYOUT_EXPERT_MAJOR;
  if (epx_buffer_create(comm, &c, &normal) != EPX_SUCCESS) {
    fprintf(stderr, "epx_buffer_create: %s\n", epx_last_error());
    return 1;
  }
  int32_t none[W] = {0};
  int failed = 0;
  epx_status_t status;
  for (int32_t step = 0; step < 3 && !failed; step++) {
    failed = ll_step(b, rank, step, none, sc->layout, &status) || status != EPX_SUCCESS;
    if (failed) fprintf(stderr, "rank %d step %d: %s\n", rank, step, step_error);
  }
  if (!failed) {
    if (rank == VICTIM) {
      failed = victim_main(b, sc);
    } else {
      failed = survivor_main(b, normal, rank, sc);
      atomic_fetch_add(&sc->survivors_done, 1);
      /* The buffer's destroy below synchronises the unmasked ranks only. */
    }
  }
  if (rank == VICTIM) atomic_store(&sc->survivors_done, W); /* on failure, release the others' waits */
  epx_buffer_destroy(normal);
  epx_buffer_destroy(b);
  return failed;
}

static void test_mask_threads(void **state) {
  (void)state;
  alarm(HARD_BOUND_S);
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_RANK_MAJOR};
  for (int i = 0; i < 2; i++) {
    scene_t sc = {.layout = layouts[i]};
    assert_int_equal(tu_run_ranks(W, TIMEOUT, mask_rank_main, &sc), 0);
    assert_true(sc.named[0] && sc.named[1]);
    assert_int_equal(sc.checked[0], 3);
    assert_int_equal(sc.checked[1], 3);
    assert_true(sc.refused);
    printf("ll mask (%s): the survivors timed out naming rank 2 (the lost step took %.1f / %.1f ms, "
           "timeout %.0f ms), masked it, and 3 steps equal the reference without its experts; the error "
           "-> the next step done: %.2f / %.2f ms: OK\n", tu_layout_name(layouts[i]), 1e3 * sc.lost_step_s[0],
           1e3 * sc.lost_step_s[1], 1e3 * TIMEOUT, 1e3 * sc.next_step_s[0], 1e3 * sc.next_step_s[1]);
  }
  alarm(0);
}

/* Query and clean with nothing lost: the survivors mask a live peer for a
 * step (it waits meanwhile: a masked rank's calls are refused), clean, and
 * the step after, every rank together again, equals the unmasked
 * reference. */
static atomic_int g_cleaned;

static int clean_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world, (void)arg;
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = EPX_FLOAT32, c.hidden = H, c.num_experts = E, c.max_top_k = K, c.max_tokens_per_rank = T;
  c.low_latency = 1;
  epx_buffer_t b = NULL;
  if (epx_buffer_create(comm, &c, &b) != EPX_SUCCESS) return 1;
  int32_t mask[W] = {0}, got[W] = {1, 1, 1};
  int failed = epx_ll_query_mask(b, got) != EPX_SUCCESS || got[0] || got[1] || got[2];
  epx_status_t status;
  if (rank != VICTIM) {
    /* The survivors mask rank 2 for a step, then clean. */
    mask[VICTIM] = 1;
    failed |= epx_ll_mask_rank(b, VICTIM, 1) != EPX_SUCCESS;
    failed |= ll_step(b, rank, 1, mask, EPX_LAYOUT_EXPERT_MAJOR, &status) || status != EPX_SUCCESS;
    failed |= epx_ll_clean_mask(b) != EPX_SUCCESS;
    failed |= epx_ll_query_mask(b, got) != EPX_SUCCESS || got[VICTIM];
    mask[VICTIM] = 0;
    atomic_fetch_add(&g_cleaned, 1);
  } else {
    while (atomic_load(&g_cleaned) < W - 1) usleep(1000);
  }
  /* Every rank together again. */
  failed |= ll_step(b, rank, 2, mask, EPX_LAYOUT_EXPERT_MAJOR, &status) || status != EPX_SUCCESS;
  if (failed) fprintf(stderr, "rank %d: %s\n", rank, step_error);
  failed |= epx_buffer_destroy(b) != EPX_SUCCESS;
  return failed;
}

static void test_query_clean_threads(void **state) {
  (void)state;
  alarm(HARD_BOUND_S);
  assert_int_equal(tu_run_ranks(W, 5.0, clean_rank_main, NULL), 0);
  alarm(0);
}

/* ------------------------------------------------------------------------ */
/* Thread ranks under jitter: a second rank leaves after the first failure   */
/* ------------------------------------------------------------------------ */

/* 4 thread ranks. Rank 3 stops calling at a random point (after a random
 * number of steps, or after the next step's dispatch): the others' step
 * times out naming it. Rank 2 takes that failure and leaves (it destroys its
 * buffer and returns: its comm is destroyed without a barrier, its comm
 * being failed). Ranks 0 and 1 mask rank 3; their next step fails naming
 * rank 2 (whichever way each learns of it: found destroyed on entering a
 * collective, destroyed while it waits, or the failure a peer's mask cleared
 * while it was between two calls); they mask rank 2 and 3 steps equal the
 * reference without ranks 2 and 3. Every rank pauses at random (nothing, a
 * yield, a sleep) between its calls, between a step's dispatch and combine,
 * between the error and the mask, and after the mask, so that a survivor is
 * often outside the barriers while its peer masks and goes on. Both
 * survivors must fail the same two steps. */
#define S_LOST 3
#define S_LEAVER 2
#define STRESS_TIMEOUT 0.25
#define STRESS_CASES 32

typedef struct {
  epx_layout_t layout;
  uint64_t seed;
  int32_t lost_after; /* full steps rank 3 makes */
  int32_t lost_mid;   /* 1: it also makes the next step's dispatch */
  atomic_int done;    /* survivors done (rank 3 then returns) */
  int32_t first_fail[WMAX], second_fail[WMAX];
} stress_t;

/* A rank's steps from `step` with `mask` until one fails: its number, or -1
 * when `limit` steps passed; `status` and step_error say how it failed. */
static int32_t stress_steps_until_failure(epx_buffer_t b, int32_t rank, int32_t step, int32_t limit, const int32_t *mask,
                                          stress_t *sc, tu_rng_t *rng, epx_status_t *status) {
  for (int32_t end = step + limit; step < end; step++) {
    jitter(rng, 300);
    int bad = ll_step_w(b, WMAX, rank, step, mask, sc->layout, status);
    if (*status != EPX_SUCCESS) return step;
    if (bad) {
      fprintf(stderr, "stress seed %llu rank %d step %d: %s\n", (unsigned long long)sc->seed, rank, step, step_error);
      *status = EPX_ERROR_INTERNAL;
      return step;
    }
  }
  return -1;
}

/* 1 when the step failed as expected: a timeout or a peer failure naming `named`. */
static int stress_failed_naming(stress_t *sc, int32_t rank, int32_t step, epx_status_t status, int32_t named,
                                const char *what) {
  char want[16];
  snprintf(want, sizeof want, "rank %d", named);
  if (step >= 0 && (status == EPX_ERROR_TIMEOUT || status == EPX_ERROR_PEER_FAILED) && strstr(step_error, want))
    return 1;
  fprintf(stderr, "stress seed %llu (%s, rank 3 stops after %d steps%s) rank %d: %s: step %d: %s: %s\n",
          (unsigned long long)sc->seed, tu_layout_name(sc->layout), sc->lost_after,
          sc->lost_mid ? " and a dispatch" : "", rank, what, step, epx_status_string(status),
          step >= 0 ? step_error : "no step failed");
  return 0;
}

static int stress_survivor(epx_buffer_t b, int32_t rank, stress_t *sc, tu_rng_t *rng) {
  int32_t mask[WMAX] = {0}, got[WMAX] = {0};
  epx_status_t status;
  int32_t first = stress_steps_until_failure(b, rank, 0, sc->lost_after + 2, mask, sc, rng, &status);
  sc->first_fail[rank] = first;
  if (!stress_failed_naming(sc, rank, first, status, S_LOST, "the first failure")) return 1;
  jitter(rng, 500);
  if (epx_ll_mask_rank(b, S_LOST, 1) != EPX_SUCCESS) return 1;
  mask[S_LOST] = 1;
  jitter(rng, tu_below(rng, 2) ? 2000 : 200);
  int32_t second = stress_steps_until_failure(b, rank, first + 1, 2, mask, sc, rng, &status);
  sc->second_fail[rank] = second;
  if (!stress_failed_naming(sc, rank, second, status, S_LEAVER, "the second failure")) return 1;
  jitter(rng, 500);
  if (epx_ll_mask_rank(b, S_LEAVER, 1) != EPX_SUCCESS) return 1;
  mask[S_LEAVER] = 1;
  if (epx_ll_query_mask(b, got) != EPX_SUCCESS || got[0] || got[1] || !got[S_LEAVER] || !got[S_LOST]) {
    fprintf(stderr, "stress seed %llu rank %d: the query gave {%d, %d, %d, %d}\n", (unsigned long long)sc->seed,
            rank, got[0], got[1], got[2], got[3]);
    return 1;
  }
  int32_t after = stress_steps_until_failure(b, rank, second + 1, 3, mask, sc, rng, &status);
  if (after < 0) return 0;
  fprintf(stderr, "stress seed %llu rank %d step %d (ranks 2 and 3 masked): %s: %s\n", (unsigned long long)sc->seed,
          rank, after, epx_status_string(status), step_error);
  return 1;
}

static int stress_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  stress_t *sc = arg;
  (void)world;
  tu_rng_t rng = {sc->seed * 8 + (uint64_t)rank + 1};
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = EPX_FLOAT32, c.hidden = H, c.num_experts = WMAX * (E / W), c.max_top_k = K, c.max_tokens_per_rank = T;
  c.low_latency = 1, c.layout = sc->layout;
  epx_buffer_t b = NULL;
  int failed = epx_buffer_create(comm, &c, &b) != EPX_SUCCESS;
  if (failed) fprintf(stderr, "rank %d: epx_buffer_create: %s\n", rank, epx_last_error());
  step_jitter = &rng;
  int32_t none[WMAX] = {0};
  epx_status_t status;
  if (!failed && rank == S_LOST) {
    failed = stress_steps_until_failure(b, rank, 0, sc->lost_after, none, sc, &rng, &status) >= 0;
    if (!failed && sc->lost_mid) {
      /* The next step's dispatch only: the others fail in its combine. */
      int32_t idx[T * K];
      float w[T * K];
      _Alignas(64) float x[T * H], recv[(E / W) * WMAX * T * H];
      make_input_w(WMAX, rank, sc->lost_after, idx, w, x);
      epx_routing_t routing = {T, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
      if (sc->layout == EPX_LAYOUT_RANK_MAJOR) routing.weighting = EPX_WEIGHTS_NONE;
      epx_handle_t h = NULL;
      failed = epx_ll_dispatch(b, &routing, NULL, x, recv, NULL, &h) != EPX_SUCCESS;
      epx_handle_release(h);
    }
    if (failed) fprintf(stderr, "stress seed %llu rank 3 before it stops: %s\n", (unsigned long long)sc->seed, step_error);
    while (atomic_load(&sc->done) < 2) usleep(200);
  } else if (!failed && rank == S_LEAVER) {
    int32_t first = stress_steps_until_failure(b, rank, 0, sc->lost_after + 2, none, sc, &rng, &status);
    sc->first_fail[rank] = first;
    failed = !stress_failed_naming(sc, rank, first, status, S_LOST, "the first failure");
    jitter(&rng, 500);
  } else if (!failed) {
    failed = stress_survivor(b, rank, sc, &rng);
  }
  if (rank < S_LEAVER) atomic_fetch_add(&sc->done, 1);
  step_jitter = NULL;
  failed |= epx_buffer_destroy(b) != EPX_SUCCESS;
  return failed;
}

static void test_mask_threads_stress(void **state) {
  (void)state;
  alarm(4 * HARD_BOUND_S);
  const char *env = getenv("EPX_TEST_SEED");
  uint64_t base = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL) * 1000 + (uint64_t)getpid() % 1000;
  double started = tu_seconds();
  for (int32_t i = 0; i < STRESS_CASES; i++) {
    stress_t sc = {.layout = i & 1 ? EPX_LAYOUT_RANK_MAJOR : EPX_LAYOUT_EXPERT_MAJOR, .seed = base + (uint64_t)i};
    tu_rng_t rng = {sc.seed};
    sc.lost_after = 1 + tu_below(&rng, 3);
    sc.lost_mid = tu_below(&rng, 2);
    int failures = tu_run_ranks(WMAX, STRESS_TIMEOUT, stress_rank_main, &sc);
    if (!failures && (sc.first_fail[0] != sc.first_fail[1] || sc.first_fail[0] != sc.first_fail[S_LEAVER] ||
                      sc.second_fail[0] != sc.second_fail[1] || sc.second_fail[0] != sc.first_fail[0] + 1)) {
      fprintf(stderr, "stress seed %llu: the first failures at steps %d, %d, %d; the second at %d, %d\n",
              (unsigned long long)sc.seed, sc.first_fail[0], sc.first_fail[1], sc.first_fail[S_LEAVER],
              sc.second_fail[0], sc.second_fail[1]);
      failures = 1;
    }
    if (failures) fprintf(stderr, "stress: rerun with EPX_TEST_SEED=%llu (case %d)\n", (unsigned long long)base, i);
    assert_int_equal(failures, 0);
  }
  printf("ll mask under jitter (threads, seeds %llu + [0, %d)): rank 3 lost, rank 2 gone after the failure; both "
         "survivors failed the same two steps, masked, and 3 steps equal the reference: OK (%.1f s)\n",
         (unsigned long long)base, STRESS_CASES, tu_seconds() - started);
  alarm(0);
}

/* ------------------------------------------------------------------------ */
/* Over shm: processes, one killed with SIGKILL mid-decode                   */
/* ------------------------------------------------------------------------ */

#define SHM_TIMEOUT 2.0
#define SHM_RANK_BOUND_S 30

/* In a shared page: what the parent and the rank processes tell each other. */
typedef struct shm_scene {
  epx_layout_t layout;
  atomic_int looping;        /* ranks through their first step */
  _Atomic int64_t killed_ns; /* CLOCK_MONOTONIC ns of the SIGKILL (0: not yet) */
  int32_t failed_step[W];    /* the step that failed on each survivor */
  double recover_s[W];       /* the kill -> the first step done after the mask */
  double error_s[W];         /* the kill -> the failed step's error */
} shm_scene_t;

/* A survivor's steps: the loop until a step fails (it must name rank 2,
 * within the timeout), the mask and its query, then 3 steps that must equal
 * the reference without rank 2's experts. A rank's failures are its exit
 * status. */
static int shm_survivor(epx_buffer_t b, int32_t rank, shm_scene_t *sc) {
  int32_t none[W] = {0}, mask[W] = {0}, got[W] = {0};
  epx_status_t status = EPX_SUCCESS;
  int32_t step = 0;
  for (;; step++) {
    if (ll_step(b, rank, step, none, sc->layout, &status) && status == EPX_SUCCESS) {
      fprintf(stderr, "rank %d step %d (every rank): %s\n", rank, step, step_error);
      return 1;
    }
    if (status != EPX_SUCCESS) break;
    if (step == 0) atomic_fetch_add(&sc->looping, 1);
  }
  double failed_at = tu_seconds();
  sc->failed_step[rank] = step;
  sc->error_s[rank] = failed_at - 1e-9 * (double)atomic_load(&sc->killed_ns);
  if (!atomic_load(&sc->killed_ns) || !strstr(step_error, "rank 2") ||
      (status != EPX_ERROR_PEER_FAILED && status != EPX_ERROR_TIMEOUT)) {
    fprintf(stderr, "rank %d step %d: %s: %s (want a failure naming rank 2, after its kill)\n", rank, step,
            epx_status_string(status), step_error);
    return 1;
  }
  if (epx_ll_mask_rank(b, VICTIM, 1) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_ll_mask_rank: %s\n", rank, epx_last_error());
    return 1;
  }
  if (epx_ll_query_mask(b, got) != EPX_SUCCESS || got[0] || got[1] || got[VICTIM] != 1) {
    fprintf(stderr, "rank %d: the query gave {%d, %d, %d}\n", rank, got[0], got[1], got[2]);
    return 1;
  }
  mask[VICTIM] = 1;
  for (int32_t i = 1; i <= 3; i++) {
    if (ll_step(b, rank, step + i, mask, sc->layout, &status) || status != EPX_SUCCESS) {
      fprintf(stderr, "rank %d step %d (rank 2 masked): %s: %s\n", rank, step + i, epx_status_string(status),
              step_error);
      return 1;
    }
    if (i == 1) sc->recover_s[rank] = tu_seconds() - 1e-9 * (double)atomic_load(&sc->killed_ns);
  }
  return 0;
}

/* One rank process: the comm, a low-latency buffer, then decode steps; rank
 * 2 loops until it is killed. */
static void shm_rank(const char *name, int32_t rank, shm_scene_t *sc) {
  alarm(SHM_RANK_BOUND_S);
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = SHM_TIMEOUT;
  epx_comm_t comm = NULL;
  epx_buffer_t b = NULL;
  if (epx_comm_create_shm(name, rank, W, &cc, &comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_create_shm: %s\n", rank, epx_last_error());
    _exit(1);
  }
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = EPX_FLOAT32, c.hidden = H, c.num_experts = E, c.max_top_k = K, c.max_tokens_per_rank = T;
  c.low_latency = 1, c.layout = sc->layout;
  if (epx_buffer_create(comm, &c, &b) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_buffer_create: %s\n", rank, epx_last_error());
    _exit(1);
  }
  int failed = 0;
  if (rank == VICTIM) {
    int32_t none[W] = {0};
    epx_status_t status;
    for (int32_t step = 0;; step++) {
      if (ll_step(b, rank, step, none, sc->layout, &status) || status != EPX_SUCCESS) {
        fprintf(stderr, "rank 2 step %d (before its kill): %s\n", step, step_error);
        _exit(1);
      }
      if (step == 0) atomic_fetch_add(&sc->looping, 1);
    }
  }
  failed = shm_survivor(b, rank, sc);
  failed |= epx_buffer_destroy(b) != EPX_SUCCESS;
  failed |= epx_comm_destroy(comm) != EPX_SUCCESS;
  if (failed) fprintf(stderr, "rank %d: %s\n", rank, epx_last_error());
  _exit(failed);
}

/* Forks the 3 ranks; once all loop, rank 2 is killed after `delay`. */
static int shm_kill_case(epx_layout_t layout, double delay, int index) {
  shm_scene_t *sc = mmap(NULL, sizeof *sc, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sc == MAP_FAILED) return 1;
  memset(sc, 0, sizeof *sc);
  sc->layout = layout;
  char name[64];
  snprintf(name, sizeof name, "epx-test-llmask-%d-%d", (int)getpid(), index);
  pid_t pids[W];
  for (int32_t r = 0; r < W; r++) {
    pids[r] = fork();
    if (pids[r] == 0) shm_rank(name, r, sc);
  }
  double give_up = tu_seconds() + 20.0;
  while (atomic_load(&sc->looping) < W && tu_seconds() < give_up) cc_sleep_seconds(0.001);
  cc_sleep_seconds(delay);
  atomic_store(&sc->killed_ns, (int64_t)(tu_seconds() * 1e9));
  kill(pids[VICTIM], SIGKILL);
  int failed = !tu_reap(pids[VICTIM], VICTIM, SIGKILL);
  for (int32_t r = 0; r < W; r++)
    if (r != VICTIM) failed += !tu_reap(pids[r], r, 0);
  if (!failed && sc->failed_step[0] != sc->failed_step[1]) {
    fprintf(stderr, "the survivors failed at steps %d and %d\n", sc->failed_step[0], sc->failed_step[1]);
    failed = 1;
  }
  if (!failed)
    printf("ll mask over shm (%s, kill after %.0f ms, step %d): the error %.1f / %.1f ms after the SIGKILL; "
           "rank 2 masked, the next step done %.1f / %.1f ms after it (timeout %.0f ms); 3 steps equal the "
           "reference: OK\n", tu_layout_name(layout), 1e3 * delay, sc->failed_step[0], 1e3 * sc->error_s[0],
           1e3 * sc->error_s[1], 1e3 * sc->recover_s[0], 1e3 * sc->recover_s[1], 1e3 * SHM_TIMEOUT);
  munmap(sc, sizeof *sc);
  return failed;
}

static void test_mask_shm_sigkill(void **state) {
  (void)state;
  alarm(HARD_BOUND_S);
  const double delays[] = {0.0, 0.002, 0.013, 0.031};
  for (int i = 0; i < 8; i++)
    assert_int_equal(shm_kill_case(i & 1 ? EPX_LAYOUT_RANK_MAJOR : EPX_LAYOUT_EXPERT_MAJOR, delays[i / 2], i), 0);
  char prefix[64];
  snprintf(prefix, sizeof prefix, "epx-test-llmask-%d-", (int)getpid());
  assert_int_equal(tu_shm_leftovers(prefix), 0);
  alarm(0);
}

/* The refusals: a normal buffer, a comm whose transport keeps no mask. */
static void test_refusals(void **state) {
  (void)state;
  epx_comm_t self = NULL;
  assert_int_equal(epx_comm_create_self(&self), EPX_SUCCESS);
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = EPX_FLOAT32, c.hidden = H, c.num_experts = E, c.max_top_k = K, c.max_tokens_per_rank = T;
  epx_buffer_t normal = NULL, ll = NULL;
  assert_int_equal(epx_buffer_create(self, &c, &normal), EPX_SUCCESS);
  c.low_latency = 1;
  assert_int_equal(epx_buffer_create(self, &c, &ll), EPX_SUCCESS);
  int32_t got[1] = {7};
  assert_int_equal(epx_ll_mask_rank(normal, 0, 1), EPX_ERROR_INVALID_ARGUMENT);
  assert_non_null(strstr(epx_last_error(), "not a low-latency buffer"));
  assert_int_equal(epx_ll_mask_rank(ll, 0, 1), EPX_ERROR_UNSUPPORTED);
  assert_non_null(strstr(epx_last_error(), "self comm"));
  assert_int_equal(epx_ll_query_mask(ll, got), EPX_SUCCESS);
  assert_int_equal(got[0], 0);
  assert_int_equal(epx_ll_query_mask(ll, NULL), EPX_ERROR_INVALID_ARGUMENT);
  assert_int_equal(epx_ll_clean_mask(ll), EPX_SUCCESS);
  assert_int_equal(epx_ll_clean_mask(normal), EPX_ERROR_INVALID_ARGUMENT);
  assert_int_equal(epx_buffer_destroy(normal), EPX_SUCCESS);
  assert_int_equal(epx_buffer_destroy(ll), EPX_SUCCESS);
  assert_int_equal(epx_comm_destroy(self), EPX_SUCCESS);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_query_clean_threads),
      cmocka_unit_test(test_mask_threads),
      cmocka_unit_test(test_mask_threads_stress),
      cmocka_unit_test(test_mask_shm_sigkill),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
