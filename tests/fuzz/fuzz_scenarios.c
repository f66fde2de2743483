/* Seeded multi-rank scenarios on the local transport (ranks are threads),
 * built with ASan and UBSan. Each seed picks a world size, a buffer config
 * and a list of steps that every rank runs together; some steps break one
 * rank's call on purpose. What must hold:
 *  - a valid step's results are exact: combine(dispatch(x)) with identity
 *    experts is sum over kept routes of w * x, and the backward pair gives
 *    the same for the gradients;
 *  - a step where one rank's call is invalid (bad expert id, too many
 *    tokens, a short receive buffer, a released handle, a replay whose
 *    routing differs) fails on every rank — that rank with its own error,
 *    the others with EPX_ERROR_PEER_FAILED — and the comm still works;
 *  - a rank that stays away makes the others time out naming it, within the
 *    comm's timeout and a second.
 * With --mismatched, ranks also call different collectives on purpose
 * (rank 0 dispatch, the others combine): every rank must fail, none may
 * succeed or corrupt memory.
 *
 *   fuzz_scenarios [--seconds S] [--seed N] [--count N] [--mismatched]
 *
 * runs scenarios seed, seed + 1, ... until S seconds or N scenarios, prints
 * one line of counts, and exits nonzero at the first finding (with its seed,
 * to re-run it alone with --seed N --count 1). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "epx.h"
#include "../util/clock.h"

enum { MAX_W = 4, MAX_T = 16, MAX_K = 4, MAX_STEPS = 8 };

typedef enum {
  STEP_VALID,       /* layout, dispatch, combine, both backward passes */
  STEP_BAD_EXPERT,  /* one rank routes to expert E */
  STEP_TOO_MANY,    /* one rank has more tokens than max_tokens_per_rank */
  STEP_SHORT_RECV,  /* one rank's recv_x holds one row fewer than N */
  STEP_STALE,       /* one rank combines with a released handle */
  STEP_REPLAY,      /* record, then replay with one rank's routing changed */
  STEP_MISMATCHED,  /* rank 0 dispatches while the others combine (--mismatched) */
  STEP_SILENT,      /* one rank skips a dispatch; the others time out (last step) */
  STEP_KINDS
} step_kind_t;

static const char *const step_names[] = {"valid", "bad expert", "too many tokens", "short recv",
                                         "stale handle", "replay mismatch", "mismatched calls",
                                         "silent rank"};

typedef struct {
  uint64_t seed;
  int32_t W;
  epx_buffer_config_t config;
  double timeout;
  int steps;
  step_kind_t kind[MAX_STEPS];
  int32_t culprit[MAX_STEPS]; /* the rank whose call is broken */
} scenario_t;

typedef struct {
  const scenario_t *sc;
  epx_local_world_t world;
  int32_t rank;
  int64_t calls;
  char finding[512];
} rank_t;

static atomic_llong total_calls;

/* splitmix64 */
static uint64_t next(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int32_t below(uint64_t *state, int32_t n) { return (int32_t)(next(state) % (uint64_t)n); }

static void scenario_make(uint64_t seed, int mismatched, scenario_t *sc) {
  uint64_t rng = seed * 0x2545f4914f6cdd1dull + 1;
  memset(sc, 0, sizeof *sc);
  sc->seed = seed;
  sc->W = 1 + below(&rng, MAX_W);
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = (epx_dtype_t)below(&rng, 3);
  c.hidden = 8 * (1 + below(&rng, 4));
  c.num_experts = sc->W * (1 + below(&rng, 4));
  c.max_top_k = 1 + below(&rng, c.num_experts < MAX_K ? c.num_experts : MAX_K);
  c.max_tokens_per_rank = below(&rng, 2) ? MAX_T : 0;
  c.max_tokens_rounding = MAX_T; /* an agreed size is MAX_T too */
  c.exchange = below(&rng, 2) ? EPX_EXCHANGE_COLLECTIVE : EPX_EXCHANGE_DEDUP;
  c.expert_alignment = 1 + below(&rng, 4);
  sc->config = c;
  sc->timeout = 20.0;
  sc->steps = 1 + below(&rng, MAX_STEPS - 1);
  for (int s = 0; s < sc->steps; s++) {
    step_kind_t k = (step_kind_t)below(&rng, STEP_MISMATCHED + 1);
    if (k == STEP_MISMATCHED && (!mismatched || sc->W == 1)) k = STEP_VALID;
    if (sc->W == 1 && k == STEP_STALE) k = STEP_VALID;
    /* Too many tokens needs the size agreed (given, or by a successful layout
     * before: 16 after rounding). */
    int agreed = c.max_tokens_per_rank > 0;
    for (int p = 0; p < s; p++) agreed |= sc->kind[p] != STEP_BAD_EXPERT && sc->kind[p] != STEP_TOO_MANY;
    if (k == STEP_TOO_MANY && !agreed) k = STEP_VALID;
    sc->kind[s] = k;
    sc->culprit[s] = below(&rng, sc->W);
  }
  /* One scenario in 16 ends with a silent rank, on a short timeout. */
  if (sc->W > 1 && below(&rng, 16) == 0) {
    sc->kind[sc->steps] = STEP_SILENT;
    sc->culprit[sc->steps] = below(&rng, sc->W);
    sc->steps++;
    sc->timeout = 0.5;
  }
}

/* ------------------------------------------------------------------------ */
/* One rank                                                                  */
/* ------------------------------------------------------------------------ */

#define FIND(r, ...)                                                          \
  do {                                                                        \
    if (!(r)->finding[0]) snprintf((r)->finding, sizeof (r)->finding, __VA_ARGS__); \
  } while (0)

/* This rank's routing of step s: T tokens, K distinct experts each (a few
 * routes dropped), weights that are small exact binary fractions. */
typedef struct {
  int64_t T;
  int32_t K;
  int32_t idx[(MAX_T + 1) * MAX_K];
  float w[(MAX_T + 1) * MAX_K];
  epx_weighting_t weighting;
} routing_t;

static void routing_make(const scenario_t *sc, int step, int32_t rank, routing_t *r) {
  uint64_t rng = sc->seed * 1000003u + (uint64_t)step * 101u + (uint64_t)rank;
  const epx_buffer_config_t *c = &sc->config;
  r->T = below(&rng, MAX_T + 1);
  r->K = c->max_top_k; /* the same K on every rank (per-rank K: issue 8 item 2) */
  /* The same weighting on every rank: a step's, not a rank's. */
  uint64_t step_rng = sc->seed * 7919u + (uint64_t)step;
  r->weighting = (epx_weighting_t)below(&step_rng, 3);
  for (int64_t t = 0; t < MAX_T + 1; t++) { /* every row, so a step may add tokens */
    int32_t start = below(&rng, c->num_experts);
    for (int32_t k = 0; k < r->K; k++) {
      int64_t i = t * r->K + k;
      r->idx[i] = below(&rng, 8) == 0 ? -1 : (start + k) % c->num_experts;
      r->w[i] = (float)(1 + below(&rng, 8)) / 8.0f;
    }
  }
}

static epx_routing_t routing_of(routing_t *r) {
  return (epx_routing_t){r->T, r->K, r->idx, r->w, NULL, r->weighting};
}

/* This rank's routing of a step: *rt made, and the call's view of it. */
static epx_routing_t step_routing(const rank_t *r, int step, routing_t *rt) {
  routing_make(r->sc, step, r->rank, rt);
  return routing_of(rt);
}

/* Small exact values, so that sums of w * x are exact in every dtype. */
static void *payload(const epx_buffer_config_t *c, int64_t rows, int32_t rank, int salt) {
  size_t n = (size_t)(rows * c->hidden);
  float *f = malloc((n ? n : 1) * sizeof(float));
  for (size_t i = 0; i < n; i++) f[i] = (float)((int)((i * 7 + (size_t)rank * 3 + (size_t)salt) % 9) - 4) / 4.0f;
  void *p = NULL;
  size_t bytes = n * epx_dtype_size(c->dtype);
  if (posix_memalign(&p, 16, bytes ? bytes : 16)) abort();
  if (n) epx_convert(c->dtype, p, EPX_FLOAT32, f, (int64_t)n);
  free(f);
  return p;
}

static float *as_float(const epx_buffer_config_t *c, const void *p, int64_t rows) {
  size_t n = (size_t)(rows * c->hidden);
  float *f = malloc((n ? n : 1) * sizeof(float));
  if (n) epx_convert(EPX_FLOAT32, f, c->dtype, p, (int64_t)n);
  return f;
}

/* out[t] == (sum of the kept routes' w, or their count) * in[t], exactly. */
static int check_sum(rank_t *r, const routing_t *rt, const float *in, const float *out, int64_t H,
                     const char *what, int step) {
  for (int64_t t = 0; t < rt->T; t++) {
    double scale = 0;
    for (int32_t k = 0; k < rt->K; k++)
      if (rt->idx[t * rt->K + k] >= 0) scale += rt->weighting == EPX_WEIGHTS_NONE ? 1.0 : rt->w[t * rt->K + k];
    for (int64_t j = 0; j < H; j++) {
      double want = scale * in[t * H + j];
      if (fabs(out[t * H + j] - want) > 1e-6 * (1 + fabs(want))) {
        FIND(r, "step %d (valid): %s[%lld][%lld] is %g, expected %g (weighting %d, T %lld)", step, what,
             (long long)t, (long long)j, out[t * H + j], want, (int)rt->weighting, (long long)rt->T);
        return 1;
      }
    }
  }
  return 0;
}

/* Every rank fails a broken step: the culprit with `own`, the others with
 * EPX_ERROR_PEER_FAILED (or their own refusal when theirs was bad too). */
static int expect_refused(rank_t *r, int step, int32_t culprit, epx_status_t status, epx_status_t own,
                          const char *call) {
  epx_status_t want = r->rank == culprit ? own : EPX_ERROR_PEER_FAILED;
  if (r->sc->W == 1) want = own;
  if (status == want) return 0;
  /* A peer may also report the culprit's own status if it names the rank
   * (a count agreed across ranks: "rank 2 has 17 tokens, above ..."). */
  char needle[32];
  snprintf(needle, sizeof needle, "rank %d", culprit);
  if (r->rank != culprit && status == own && strstr(epx_last_error(), needle)) return 0;
  FIND(r, "step %d (%s, culprit rank %d): %s returned %s on rank %d, expected %s: %s", step,
       step_names[r->sc->kind[step]], culprit, call, epx_status_string(status), r->rank,
       epx_status_string(want), epx_last_error());
  return 1;
}

#define CALL(r, expr) ((r)->calls++, (expr))

/* The step's routing (rt) laid out on b: the handle, and its rows when N
 * is given. */
static epx_status_t step_layout(rank_t *r, epx_buffer_t b, int step, epx_recorder_t rec, routing_t *rt,
                                epx_handle_t *h, int64_t *N) {
  epx_routing_t routing = step_routing(r, step, rt);
  epx_status_t status = CALL(r, epx_dispatch_layout(b, &routing, rec, h));
  if (status == EPX_SUCCESS && N) status = CALL(r, epx_handle_recv_rows(*h, N));
  return status;
}

/* A valid step: every call succeeds and every result is exact. */
static int step_valid(rank_t *r, epx_comm_t comm, epx_buffer_t b, int step, epx_recorder_t rec) {
  (void)comm;
  const epx_buffer_config_t *c = &r->sc->config;
  routing_t rt;
  epx_handle_t h = NULL;
  int64_t N = 0;
  epx_status_t status = step_layout(r, b, step, rec, &rt, &h, &N);
  if (status != EPX_SUCCESS) {
    FIND(r, "step %d (valid): layout on rank %d returned %s: %s", step, r->rank, epx_status_string(status), epx_last_error());
    return 1;
  }
  void *x = payload(c, rt.T, r->rank, step), *recv = payload(c, N, r->rank, 1), *out = payload(c, rt.T, r->rank, 2);
  void *grad_expert = payload(c, N, r->rank, 3), *grad_x = payload(c, rt.T, r->rank, 4);
  int bad = 0;
  status = CALL(r, epx_dispatch(b, h, x, recv, N));
  if (status == EPX_SUCCESS) status = CALL(r, epx_combine(b, h, recv, out));
  /* The backward pair on grad_out = x: combine_backward weights each copy
   * (IN_COMBINE), dispatch_backward sums them (and weights IN_DISPATCH). */
  if (status == EPX_SUCCESS) status = CALL(r, epx_combine_backward(b, h, x, NULL, grad_expert, NULL));
  if (status == EPX_SUCCESS) status = CALL(r, epx_dispatch_backward(b, h, grad_expert, grad_x, NULL, NULL));
  if (status != EPX_SUCCESS) {
    FIND(r, "step %d (valid): a payload call on rank %d returned %s: %s", step, r->rank, epx_status_string(status), epx_last_error());
    bad = 1;
  } else {
    float *fx = as_float(c, x, rt.T), *fout = as_float(c, out, rt.T), *fgrad = as_float(c, grad_x, rt.T);
    bad = check_sum(r, &rt, fx, fout, c->hidden, "out", step) || check_sum(r, &rt, fx, fgrad, c->hidden, "grad_x", step);
    free(fx), free(fout), free(fgrad);
  }
  free(x), free(recv), free(out), free(grad_expert), free(grad_x);
  if (CALL(r, epx_handle_release(h)) != EPX_SUCCESS) {
    FIND(r, "step %d: release on rank %d failed: %s", step, r->rank, epx_last_error());
    bad = 1;
  }
  return bad;
}

/* A layout where the culprit's routing is invalid. */
static int step_bad_layout(rank_t *r, epx_buffer_t b, int step) {
  const epx_buffer_config_t *c = &r->sc->config;
  int32_t culprit = r->sc->culprit[step];
  routing_t rt;
  routing_make(r->sc, step, r->rank, &rt);
  const int bad_expert = r->sc->kind[step] == STEP_BAD_EXPERT;
  epx_status_t own = bad_expert ? EPX_ERROR_INVALID_ARGUMENT : EPX_ERROR_CAPACITY_EXCEEDED;
  if (r->rank == culprit && bad_expert) {
    if (rt.T == 0) rt.T = 1;
    rt.idx[0] = c->num_experts;
  } else if (r->rank == culprit) {
    rt.T = MAX_T + 1;
  }
  epx_routing_t routing = routing_of(&rt);
  epx_handle_t h = (epx_handle_t)(uintptr_t)0x5e1f;
  epx_status_t status = CALL(r, epx_dispatch_layout(b, &routing, NULL, &h));
  int bad = expect_refused(r, step, culprit, status, own, "epx_dispatch_layout");
  if (h != (epx_handle_t)(uintptr_t)0x5e1f) {
    FIND(r, "step %d: a refused layout wrote its handle on rank %d", step, r->rank);
    bad = 1;
  }
  return bad;
}

/* A payload call where the culprit's part is invalid: a short recv_x, or a
 * handle released before the call. Nothing may change on any rank. */
static int step_bad_payload(rank_t *r, epx_buffer_t b, int step) {
  const epx_buffer_config_t *c = &r->sc->config;
  int32_t culprit = r->sc->culprit[step];
  routing_t rt;
  epx_handle_t h = NULL;
  int64_t N = 0;
  if (step_layout(r, b, step, NULL, &rt, &h, &N) != EPX_SUCCESS) {
    FIND(r, "step %d: layout on rank %d failed: %s", step, r->rank, epx_last_error());
    return 1;
  }
  size_t row = (size_t)c->hidden * epx_dtype_size(c->dtype);
  void *x = payload(c, rt.T, r->rank, 5), *recv = payload(c, N, r->rank, 6);
  void *copy = malloc(N * row + 1);
  memcpy(copy, recv, N * row);
  int stale = r->sc->kind[step] == STEP_STALE && r->rank == culprit;
  epx_handle_t used = h;
  epx_status_t own = EPX_ERROR_CAPACITY_EXCEEDED, status;
  int bad = 0;
  if (stale) {
    CALL(r, epx_handle_release(h));
    own = EPX_ERROR_INVALID_HANDLE;
    status = CALL(r, epx_combine(b, used, recv, x));
  } else if (r->sc->kind[step] == STEP_STALE) {
    status = CALL(r, epx_combine(b, used, recv, x));
  } else {
    int64_t capacity = r->rank == culprit ? N - 1 : N;
    status = CALL(r, epx_dispatch(b, used, x, recv, capacity));
    if (r->rank == culprit && N == 0) own = EPX_ERROR_CAPACITY_EXCEEDED; /* -1 rows is short too */
  }
  bad = expect_refused(r, step, culprit, status, own, stale || r->sc->kind[step] == STEP_STALE ? "epx_combine" : "epx_dispatch");
  if (memcmp(copy, recv, N * row)) {
    FIND(r, "step %d: a refused call changed recv_x on rank %d", step, r->rank);
    bad = 1;
  }
  if (!stale && CALL(r, epx_handle_release(h)) != EPX_SUCCESS) bad = 1;
  free(x), free(recv), free(copy);
  return bad;
}

/* Record a valid step, replay it: identical routing replays (the same
 * handle), then the culprit's routing changes and every rank refuses. */
static int step_replay(rank_t *r, epx_comm_t comm, epx_buffer_t b, int step) {
  int32_t culprit = r->sc->culprit[step];
  epx_recorder_t rec = NULL;
  if (CALL(r, epx_recorder_create(1, &rec)) != EPX_SUCCESS) return 1;
  int bad = step_valid(r, comm, b, step, rec);
  routing_t rt;
  epx_routing_t routing = step_routing(r, step, &rt);
  epx_handle_t h = NULL;
  epx_status_t status = CALL(r, epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
  if (status == EPX_SUCCESS) status = CALL(r, epx_dispatch_layout(b, &routing, rec, &h));
  if (status != EPX_SUCCESS) {
    FIND(r, "step %d (replay): an identical replay returned %s on rank %d: %s", step, epx_status_string(status), r->rank, epx_last_error());
    bad = 1;
  } else {
    CALL(r, epx_handle_release(h));
  }
  CALL(r, epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
  if (r->rank == culprit) {
    if (rt.T == 0) rt.T = 1, rt.idx[0] = 0, rt.w[0] = 1;
    rt.idx[0] = rt.idx[0] >= 0 ? -1 : 0;
    for (int32_t k = 1; k < rt.K; k++) if (rt.idx[k] == 0) rt.idx[k] = -1; /* no duplicate of the new id */
  }
  routing = routing_of(&rt);
  h = (epx_handle_t)(uintptr_t)0x5e1f;
  status = CALL(r, epx_dispatch_layout(b, &routing, rec, &h));
  bad |= expect_refused(r, step, culprit, status, EPX_ERROR_REPLAY_MISMATCH, "epx_dispatch_layout (replay)");
  if (CALL(r, epx_recorder_destroy(rec)) != EPX_SUCCESS) bad = 1;
  return bad;
}

/* Rank 0 dispatches while the others combine, on the same handle: nobody
 * may succeed (issue 8 item 2). */
static int step_mismatched(rank_t *r, epx_buffer_t b, int step) {
  const epx_buffer_config_t *c = &r->sc->config;
  routing_t rt;
  epx_handle_t h = NULL;
  int64_t N = 0;
  if (step_layout(r, b, step, NULL, &rt, &h, &N) != EPX_SUCCESS) return 1;
  void *x = payload(c, rt.T, r->rank, 7), *recv = payload(c, N, r->rank, 8);
  epx_status_t status = r->rank == 0 ? CALL(r, epx_dispatch(b, h, x, recv, N)) : CALL(r, epx_combine(b, h, recv, x));
  int bad = 0;
  if (status == EPX_SUCCESS) {
    FIND(r, "step %d (mismatched calls): rank %d's %s succeeded while its peers were in another call", step, r->rank,
         r->rank == 0 ? "epx_dispatch" : "epx_combine");
    bad = 1;
  }
  CALL(r, epx_handle_release(h));
  free(x), free(recv);
  return bad;
}

/* The culprit returns without the dispatch; the others must time out naming
 * it, within the timeout and a second. The comm is failed afterwards. */
static int step_silent(rank_t *r, epx_buffer_t b, int step) {
  const epx_buffer_config_t *c = &r->sc->config;
  int32_t culprit = r->sc->culprit[step];
  routing_t rt;
  epx_handle_t h = NULL;
  if (step_layout(r, b, step, NULL, &rt, &h, NULL) != EPX_SUCCESS) return 1;
  int bad = 0;
  if (r->rank != culprit) {
    int64_t N = 0;
    CALL(r, epx_handle_recv_rows(h, &N));
    void *x = payload(c, rt.T, r->rank, 9), *recv = payload(c, N, r->rank, 10);
    double start = tu_seconds();
    epx_status_t status = CALL(r, epx_dispatch(b, h, x, recv, N));
    double waited = tu_seconds() - start;
    char needle[32];
    snprintf(needle, sizeof needle, "rank %d", culprit);
    if (status != EPX_ERROR_TIMEOUT || !strstr(epx_last_error(), needle) || waited > r->sc->timeout + 1.0) {
      FIND(r, "step %d (silent rank %d): rank %d got %s after %.3f s (timeout %.1f s): %s", step, culprit, r->rank,
           epx_status_string(status), waited, r->sc->timeout, epx_last_error());
      bad = 1;
    }
    free(x), free(recv);
  } else {
    /* Silent, not gone: a rank that moved on to another collective would be
     * named at once as in the wrong call instead. */
    struct timespec pause = {(time_t)(r->sc->timeout + 1.0), 0};
    nanosleep(&pause, NULL);
  }
  CALL(r, epx_handle_release(h));
  return bad;
}

static void *rank_main(void *arg) {
  rank_t *r = arg;
  const scenario_t *sc = r->sc;
  epx_comm_t comm = NULL;
  epx_buffer_t b = NULL;
  if (CALL(r, epx_comm_create_local(r->world, r->rank, &comm)) != EPX_SUCCESS) {
    FIND(r, "rank %d: comm create failed: %s", r->rank, epx_last_error());
    return NULL;
  }
  if (CALL(r, epx_buffer_create(comm, &sc->config, &b)) != EPX_SUCCESS) {
    FIND(r, "rank %d: buffer create failed: %s", r->rank, epx_last_error());
    CALL(r, epx_comm_destroy(comm));
    return NULL;
  }
  for (int s = 0; s < sc->steps && !r->finding[0]; s++) {
    switch (sc->kind[s]) {
      case STEP_VALID: step_valid(r, comm, b, s, NULL); break;
      case STEP_BAD_EXPERT: case STEP_TOO_MANY: step_bad_layout(r, b, s); break;
      case STEP_SHORT_RECV: case STEP_STALE: step_bad_payload(r, b, s); break;
      case STEP_REPLAY: step_replay(r, comm, b, s); break;
      case STEP_MISMATCHED: step_mismatched(r, b, s); s = sc->steps; break; /* the comm may be failed */
      case STEP_SILENT: step_silent(r, b, s); break;
      default: break;
    }
  }
  if (CALL(r, epx_buffer_destroy(b)) != EPX_SUCCESS) FIND(r, "rank %d: buffer destroy failed: %s", r->rank, epx_last_error());
  CALL(r, epx_comm_destroy(comm));
  return NULL;
}

/* Runs one scenario; 0 when it held, else prints the finding. */
static int scenario_run(const scenario_t *sc) {
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = sc->timeout;
  epx_local_world_t world = NULL;
  if (epx_local_world_create(sc->W, &cc, &world) != EPX_SUCCESS) {
    fprintf(stderr, "seed %llu: world create failed: %s\n", (unsigned long long)sc->seed, epx_last_error());
    return 1;
  }
  rank_t ranks[MAX_W];
  pthread_t threads[MAX_W];
  for (int32_t q = 0; q < sc->W; q++) {
    ranks[q] = (rank_t){sc, world, q, 0, {0}};
    pthread_create(&threads[q], NULL, rank_main, &ranks[q]);
  }
  int failed = 0;
  for (int32_t q = 0; q < sc->W; q++) {
    pthread_join(threads[q], NULL);
    atomic_fetch_add(&total_calls, ranks[q].calls);
    if (ranks[q].finding[0] && ++failed)
      fprintf(stderr, "fuzz_scenarios finding, seed %llu (W=%d, dtype %d, H=%lld, E=%d, K=%d, %s, alignment %d): %s\n",
              (unsigned long long)sc->seed, sc->W, (int)sc->config.dtype, (long long)sc->config.hidden,
              sc->config.num_experts, sc->config.max_top_k,
              sc->config.exchange == EPX_EXCHANGE_DEDUP ? "dedup" : "collective", sc->config.expert_alignment,
              ranks[q].finding);
  }
  if (epx_local_world_destroy(world) != EPX_SUCCESS && !failed++)
    fprintf(stderr, "seed %llu: world destroy failed: %s\n", (unsigned long long)sc->seed, epx_last_error());
  return failed;
}

int main(int argc, char **argv) {
  double seconds = 30;
  uint64_t seed = 1, count = UINT64_MAX;
  int mismatched = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--count") && i + 1 < argc) count = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--mismatched")) mismatched = 1;
    else {
      fprintf(stderr, "usage: %s [--seconds S] [--seed N] [--count N] [--mismatched]\n", argv[0]);
      return 2;
    }
  }
  const double end = tu_seconds() + seconds;
  uint64_t scenarios = 0, steps[STEP_KINDS] = {0};
  int findings = 0;
  for (uint64_t s = seed; scenarios < count && tu_seconds() < end; s++, scenarios++) {
    scenario_t sc;
    scenario_make(s, mismatched, &sc);
    for (int k = 0; k < sc.steps; k++) steps[sc.kind[k]]++;
    if (scenario_run(&sc)) {
      findings = 1;
      scenarios++;
      break;
    }
  }
  printf("fuzz_scenarios: %llu scenarios from seed %llu, %lld calls; steps:", (unsigned long long)scenarios,
         (unsigned long long)seed, (long long)atomic_load(&total_calls));
  for (int k = 0; k < STEP_KINDS; k++) printf(" %s %llu%s", step_names[k], (unsigned long long)steps[k], k + 1 < STEP_KINDS ? "," : "");
  printf("; %d findings\n", findings);
  return findings;
}
