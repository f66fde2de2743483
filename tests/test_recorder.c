/* The activation-checkpoint recorder over W ranks: a forward that records,
 * a recompute that replays (cached dispatch, no count exchange) and a
 * backward give results bit-identical to a run without checkpointing, for
 * two layers with one recorder (one checkpointed block) or two (a block per
 * layer); a replay past the log falls back to a full layout and stays
 * correct; a replay whose routing differs is refused on every rank; the
 * recorder keeps handles and metadata, never received rows. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/dtype.h"
#include "testutil.h"
#include "buffer_config.h"
#include "clock.h"

#define K 2
#define E_PER_RANK 4
#define T_MAX 40

static void *alloc_zero(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64)) return NULL;
  memset(p, 0, bytes ? bytes : 64);
  return p;
}

/* ------------------------------------------------------------------------ */
/* A two-layer MoE model on one rank                                         */
/* ------------------------------------------------------------------------ */

typedef struct {
  int32_t rank, W, E;
  int64_t T, H;
  epx_dtype_t dtype;
  size_t rb;                  /* bytes of a payload row */
  epx_buffer_t buffer[2];     /* one per layer */
  int32_t idx[2][T_MAX * K];  /* routing of each layer (pinned) */
  float w[2][T_MAX * K];
} model_t;

/* What one layer's forward leaves for its backward. */
typedef struct {
  epx_handle_t handle;
  int64_t N;
  void *recv, *expert_out;
  int32_t *expert; /* [N] expert of each received row */
} layer_t;

static void layer_free(layer_t *l) {
  epx_handle_release(l->handle);
  TU_FREE_ALL(l->recv, l->expert_out, l->expert);
  memset(l, 0, sizeof *l);
}

/* The expert: y = a_e * v + c_h (a_e a power-of-two multiple, so the
 * backward is exact in every dtype). */
static float expert_scale(int32_t e) { return 1.0f + 0.25f * (float)(e % 4); }

static int model_init(model_t *m, epx_comm_t comm, int32_t rank, int32_t W, epx_dtype_t dtype, int64_t H) {
  int failures = 0; /* a failing call ends the rank's run (its peers then time out) */
  memset(m, 0, sizeof *m);
  m->rank = rank, m->W = W, m->E = E_PER_RANK * W, m->H = H, m->dtype = dtype;
  m->T = 12 + 7 * rank;
  m->rb = (size_t)H * epx_dtype_size(dtype);
  epx_buffer_config_t bc = tu_config(EPX_DEVICE_CPU, dtype, H, m->E, K, T_MAX);
  for (int l = 0; l < 2; l++) {
    tu_rng_t rng = {1000 + (uint64_t)(rank * 2 + l)};
    tu_random_routing(&rng, m->T, m->E, K, l ? 1.5 : 0.0, m->idx[l], m->w[l]);
    RANK_REQUIRE_OK(epx_buffer_create(comm, &bc, &m->buffer[l]));
  }
done:
  return failures;
}

static void model_fini(model_t *m) {
  for (int l = 0; l < 2; l++) epx_buffer_destroy(m->buffer[l]);
}

static epx_routing_t model_routing(const model_t *m, int l) {
  return (epx_routing_t){m->T, K, m->idx[l], m->w[l], NULL, EPX_WEIGHTS_IN_COMBINE};
}

/* layout (through the recorder, or not), dispatch, expert, combine. */
static int layer_forward(model_t *m, int l, epx_recorder_t recorder, const void *x, void *out, layer_t *st) {
  const int32_t rank = m->rank;
  int failures = 0;
  epx_routing_t routing = model_routing(m, l);
  memset(st, 0, sizeof *st);
  RANK_REQUIRE_OK(epx_dispatch_layout(m->buffer[l], &routing, recorder, &st->handle));
  RANK_REQUIRE_OK(epx_handle_recv_rows(st->handle, &st->N));
  st->recv = alloc_zero((size_t)st->N * m->rb);
  st->expert_out = alloc_zero((size_t)st->N * m->rb);
  st->expert = alloc_zero(sizeof(int32_t) * (size_t)st->N);
  if (!st->recv || !st->expert_out || !st->expert) return 1;
  RANK_REQUIRE_OK(epx_dispatch(m->buffer[l], st->handle, x, st->recv, st->N));
  RANK_REQUIRE_OK(epx_handle_recv_routing(st->handle, st->expert, NULL));
  for (int64_t i = 0; i < st->N; i++) {
    const char *v = (const char *)st->recv + (size_t)i * m->rb;
    char *y = (char *)st->expert_out + (size_t)i * m->rb;
    for (int64_t h = 0; h < m->H; h++)
      epx_store(m->dtype, y, h, expert_scale(st->expert[i]) * epx_load(m->dtype, v, h) + 0.0625f * (float)(h % 5));
  }
  RANK_REQUIRE_OK(epx_combine(m->buffer[l], st->handle, st->expert_out, out));
done:
  return failures;
}

/* combine_backward (with the router's grad_w), expert backward,
 * dispatch_backward. */
static int layer_backward(model_t *m, int l, const layer_t *st, const void *grad_out, void *grad_x, float *grad_w) {
  void *grad_eo = alloc_zero((size_t)st->N * m->rb);
  if (!grad_eo) return 1;
  int bad = 0;
  epx_status_t s = epx_combine_backward(m->buffer[l], st->handle, grad_out, st->expert_out, grad_eo, grad_w);
  if (s == EPX_SUCCESS) {
    for (int64_t i = 0; i < st->N; i++) {
      char *g = (char *)grad_eo + (size_t)i * m->rb;
      for (int64_t h = 0; h < m->H; h++) epx_store(m->dtype, g, h, expert_scale(st->expert[i]) * epx_load(m->dtype, g, h));
    }
    s = epx_dispatch_backward(m->buffer[l], st->handle, grad_eo, grad_x, NULL, NULL);
  }
  if (s != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: layer %d backward: %s: %s\n", m->rank, l, epx_status_string(s), epx_last_error());
    bad = 1;
  }
  free(grad_eo);
  return bad;
}

/* Everything a training step produces that the comparison looks at. */
typedef struct {
  void *x0, *out[2], *grad_out1, *grad_x[2];
  float grad_w[2][T_MAX * K];
} step_t;

static int step_alloc(const model_t *m, step_t *s) {
  memset(s, 0, sizeof *s);
  size_t bytes = (size_t)m->T * m->rb;
  s->x0 = alloc_zero(bytes), s->out[0] = alloc_zero(bytes), s->out[1] = alloc_zero(bytes);
  s->grad_out1 = alloc_zero(bytes), s->grad_x[0] = alloc_zero(bytes), s->grad_x[1] = alloc_zero(bytes);
  if (!s->x0 || !s->out[0] || !s->out[1] || !s->grad_out1 || !s->grad_x[0] || !s->grad_x[1]) return 1;
  tu_rng_t rng = {77 + (uint64_t)m->rank};
  tu_fill(&rng, m->dtype, s->x0, m->T * m->H);
  tu_fill(&rng, m->dtype, s->grad_out1, m->T * m->H);
  tu_poison(s->out[0], bytes), tu_poison(s->out[1], bytes);
  tu_poison(s->grad_x[0], bytes), tu_poison(s->grad_x[1], bytes);
  tu_poison(s->grad_w, sizeof s->grad_w);
  return 0;
}

static void step_free(step_t *s) {
  free(s->x0), free(s->out[0]), free(s->out[1]), free(s->grad_out1), free(s->grad_x[0]), free(s->grad_x[1]);
}

/* The plain step: forward keeps every layer's state, backward uses it. */
static int step_plain(model_t *m, step_t *s) {
  layer_t st[2] = {{0}, {0}};
  int bad = layer_forward(m, 0, NULL, s->x0, s->out[0], &st[0]) || layer_forward(m, 1, NULL, s->out[0], s->out[1], &st[1]) ||
            layer_backward(m, 1, &st[1], s->grad_out1, s->grad_x[1], s->grad_w[1]) ||
            layer_backward(m, 0, &st[0], s->grad_x[1], s->grad_x[0], s->grad_w[0]);
  layer_free(&st[0]);
  layer_free(&st[1]);
  return bad;
}

typedef struct {
  int32_t W;
  int two_recorders; /* a checkpointed block per layer, else one block of both */
  int fallback;      /* layer 1's layout is not recorded: its replay falls back */
  epx_dtype_t dtype;
} rec_case_t;

/* The checkpointed step: the forward records and keeps only the layer
 * outputs; the backward recomputes each block's forward by replay, then runs
 * its backward. */
static int step_checkpointed(model_t *m, const rec_case_t *rc, epx_recorder_t rec[2], step_t *s, void *recomputed[2]) {
  const int32_t rank = m->rank;
  int failures = 0;
  layer_t st[2] = {{0}, {0}};
  epx_recorder_t for_layer[2] = {rec[0], rc->two_recorders ? rec[1] : rec[0]};
  int bad = layer_forward(m, 0, for_layer[0], s->x0, s->out[0], &st[0]);
  layer_free(&st[0]);
  bad = bad || layer_forward(m, 1, rc->fallback ? NULL : for_layer[1], s->out[0], s->out[1], &st[1]);
  layer_free(&st[1]);
  if (bad) return 1;
  for (int r = 0; r < (rc->two_recorders ? 2 : 1); r++)
    RANK_REQUIRE_OK(epx_recorder_set_mode(rec[r], EPX_RECORDER_REPLAY));
  if (rc->two_recorders) {
    bad = layer_forward(m, 1, for_layer[1], s->out[0], recomputed[1], &st[1]) ||
          layer_backward(m, 1, &st[1], s->grad_out1, s->grad_x[1], s->grad_w[1]) ||
          layer_forward(m, 0, for_layer[0], s->x0, recomputed[0], &st[0]) ||
          layer_backward(m, 0, &st[0], s->grad_x[1], s->grad_x[0], s->grad_w[0]);
  } else {
    bad = layer_forward(m, 0, for_layer[0], s->x0, recomputed[0], &st[0]) ||
          layer_forward(m, 1, for_layer[1], recomputed[0], recomputed[1], &st[1]) ||
          layer_backward(m, 1, &st[1], s->grad_out1, s->grad_x[1], s->grad_w[1]) ||
          layer_backward(m, 0, &st[0], s->grad_x[1], s->grad_x[0], s->grad_w[0]);
  }
  layer_free(&st[0]);
  layer_free(&st[1]);
  return bad;
done:
  return failures;
}

/* Shared between the ranks of a run: how many have finished their collective
 * part (the rank-local replay check waits for it). */
typedef struct {
  rec_case_t c;
  int done;
} rec_run_t;

static int checkpoint_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  rec_run_t *run = arg;
  const rec_case_t *rc = &run->c;
  int failures = 0;
  model_t model, *m = &model;
  step_t plain, ckpt;
  epx_recorder_t rec[2] = {NULL, NULL};
  void *recomputed[2] = {NULL, NULL};
  if (model_init(m, comm, rank, world, rc->dtype, 32) || step_alloc(m, &plain) || step_alloc(m, &ckpt)) return 1;
  for (int r = 0; r < 2; r++) {
    recomputed[r] = alloc_zero((size_t)m->T * m->rb);
    if (epx_recorder_create(0, &rec[r]) != EPX_SUCCESS || !recomputed[r]) return 1;
  }
  if (step_plain(m, &plain) || step_checkpointed(m, rc, rec, &ckpt, recomputed)) {
    failures++;
    goto done;
  }
  size_t bytes = (size_t)m->T * m->rb;
  for (int l = 0; l < 2; l++) {
    RANK_EXPECT(!memcmp(plain.out[l], ckpt.out[l], bytes), "layer %d out differs with a recorder", l);
    RANK_EXPECT(!memcmp(plain.out[l], recomputed[l], bytes), "layer %d recomputed out differs from the original", l);
    RANK_EXPECT(!memcmp(plain.grad_x[l], ckpt.grad_x[l], bytes), "layer %d grad_x differs after a replayed recompute", l);
    RANK_EXPECT(!memcmp(plain.grad_w[l], ckpt.grad_w[l], sizeof(float) * (size_t)(m->T * K)),
                "layer %d grad_w differs after a replayed recompute", l);
  }
  int nonzero = 0;
  for (int64_t i = 0; i < m->T * K; i++) nonzero += plain.grad_w[0][i] != 0.0f;
  RANK_EXPECT(nonzero > 0, "grad_w of layer 0 is all zero");

  /* Stats: every recorded layout was replayed, none recomputed, except the
   * unrecorded one, which fell back. */
  epx_recorder_stats_t total = {0}, st;
  for (int r = 0; r < (rc->two_recorders ? 2 : 1); r++) {
    RANK_STATUS(epx_recorder_stats(rec[r], &st), EPX_SUCCESS, NULL);
    total.records += st.records, total.replays += st.replays, total.fallbacks += st.fallbacks;
  }
  int64_t want_records = rc->fallback ? 1 : 2;
  RANK_EXPECT(total.records == want_records && total.replays == want_records && total.fallbacks == 2 - want_records,
              "records/replays/fallbacks %lld/%lld/%lld, want %lld/%lld/%lld", (long long)total.records,
              (long long)total.replays, (long long)total.fallbacks, (long long)want_records, (long long)want_records,
              (long long)(2 - want_records));

  /* Replay without validation is rank-local: rank 0 replays layer 0's
   * layout again while the other ranks make no call; it returns at once
   * with the recorded handle. */
  __atomic_add_fetch(&run->done, 1, __ATOMIC_SEQ_CST);
  while (__atomic_load_n(&run->done, __ATOMIC_SEQ_CST) < world) {
    struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
  }
  if (rank == 0) {
    epx_routing_t routing = model_routing(m, 0);
    epx_handle_t again = NULL;
    RANK_STATUS(epx_recorder_set_mode(rec[0], EPX_RECORDER_REPLAY), EPX_SUCCESS, NULL);
    double start = tu_seconds();
    RANK_STATUS(epx_dispatch_layout(m->buffer[0], &routing, rec[0], &again), EPX_SUCCESS, NULL);
    RANK_EXPECT(tu_seconds() - start < 0.5, "a replay took %.3f s: it waited for peers", tu_seconds() - start);
    epx_handle_release(again);
  }

  /* The recorder holds its handles: the buffer cannot go before it. */
  RANK_STATUS(epx_buffer_destroy(m->buffer[0]), EPX_ERROR_BUSY, "handle");
done:
  for (int r = 0; r < 2; r++) {
    RANK_STATUS(epx_recorder_destroy(rec[r]), EPX_SUCCESS, NULL);
    free(recomputed[r]);
  }
  for (int l = 0; l < 2; l++) {
    RANK_STATUS(epx_buffer_destroy(m->buffer[l]), EPX_SUCCESS, NULL);
    m->buffer[l] = NULL;
  }
  step_free(&plain);
  step_free(&ckpt);
  return failures;
}

static void test_replay_is_bit_identical(void **state) {
  (void)state;
  static const int32_t worlds[] = {1, 2, 4};
  static const epx_dtype_t dtypes[] = {EPX_FLOAT32, EPX_BFLOAT16};
  for (size_t w = 0; w < 3; w++)
    for (int two = 0; two < 2; two++)
      for (int fallback = 0; fallback < 2; fallback++)
        for (size_t d = 0; d < 2; d++) {
          rec_run_t run = {{worlds[w], two, fallback, dtypes[d]}, 0};
          int bad = tu_run_ranks(worlds[w], 10.0, checkpoint_rank, &run);
          if (bad) fail_msg("W=%d %s recorder(s)%s %s: %d rank(s) failed", worlds[w], two ? "two" : "one",
                            fallback ? " with a fallback" : "", dtypes[d] == EPX_FLOAT32 ? "f32" : "bf16", bad);
        }
}

/* ------------------------------------------------------------------------ */
/* Validation: a replay whose routing differs is refused on every rank       */
/* ------------------------------------------------------------------------ */

/* The validation cases' start: a rank's model and step, both layers'
 * forward recorded by a new recorder (validate), set to replay. Returns the
 * failed checks; r->rec is NULL when nothing was made (no replay_end then). */
typedef struct {
  model_t model;
  step_t step;
  epx_recorder_t rec;
} replay_t;

static int replay_begin(replay_t *r, epx_comm_t comm, int32_t rank, int32_t world, int validate) {
  int failures = 0;
  model_t *m = &r->model;
  step_t *s = &r->step;
  r->rec = NULL;
  if (model_init(m, comm, rank, world, EPX_FLOAT32, 32) || step_alloc(m, s)) return 1;
  if (epx_recorder_create(validate, &r->rec) != EPX_SUCCESS) return 1;
  layer_t st[2] = {{0}, {0}};
  failures += layer_forward(m, 0, r->rec, s->x0, s->out[0], &st[0]) ||
              layer_forward(m, 1, r->rec, s->out[0], s->out[1], &st[1]);
  layer_free(&st[0]);
  layer_free(&st[1]);
  if (!failures) RANK_STATUS(epx_recorder_set_mode(r->rec, EPX_RECORDER_REPLAY), EPX_SUCCESS, NULL);
  return failures;
}

/* Ends what replay_begin made; returns the failed checks. */
static int replay_end(replay_t *r, int32_t rank) {
  int failures = 0;
  RANK_STATUS(epx_recorder_destroy(r->rec), EPX_SUCCESS, NULL);
  model_fini(&r->model);
  step_free(&r->step);
  return failures;
}

static int mismatch_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  int32_t odd = *(const int32_t *)arg; /* the rank whose recompute routes differently */
  replay_t r;
  int failures = replay_begin(&r, comm, rank, world, 1);
  if (!r.rec) return failures;
  if (failures) goto done;
  model_t *m = &r.model;
  epx_recorder_t rec = r.rec;

  /* Call 0 replays as recorded (validation agrees, so it is collective). */
  epx_routing_t routing = model_routing(m, 0);
  epx_handle_t h = NULL;
  RANK_STATUS(epx_dispatch_layout(m->buffer[0], &routing, rec, &h), EPX_SUCCESS, NULL);
  epx_handle_release(h);

  /* Call 1: one expert id changes on rank `odd` (to an expert the token did
   * not pick). */
  if (rank == odd) {
    int32_t *row = m->idx[1] + 3 * K, e = (row[0] + 1) % m->E;
    while (e == row[0] || e == row[1]) e = (e + 1) % m->E;
    row[1] = e;
  }
  routing = model_routing(m, 1);
  epx_handle_t poison = (epx_handle_t)(uintptr_t)0xA5A5A5A5u;
  h = poison;
  char named[32];
  snprintf(named, sizeof named, "rank %d", odd);
  double start = tu_seconds();
  if (rank == odd) RANK_STATUS(epx_dispatch_layout(m->buffer[1], &routing, rec, &h), EPX_ERROR_REPLAY_MISMATCH, "call 1");
  else RANK_STATUS(epx_dispatch_layout(m->buffer[1], &routing, rec, &h), EPX_ERROR_PEER_FAILED, named);
  RANK_EXPECT(tu_seconds() - start < 2.0, "the refusal took %.2f s", tu_seconds() - start);
  RANK_EXPECT(h == poison, "the handle output was written on a refused replay");
done:
  return failures + replay_end(&r, rank);
}

static void test_replay_mismatch_refused_on_every_rank(void **state) {
  (void)state;
  int32_t odd = 0;
  assert_int_equal(tu_run_ranks(1, 10.0, mismatch_rank, &odd), 0);
  odd = 1;
  assert_int_equal(tu_run_ranks(2, 10.0, mismatch_rank, &odd), 0);
  odd = 2;
  assert_int_equal(tu_run_ranks(4, 10.0, mismatch_rank, &odd), 0);
}

/* A replay whose routing is invalid (an expert out of range on one rank):
 * with validation every rank refuses together (that rank with its own
 * message, the others naming it); without it, replay is rank-local, so only
 * that rank refuses, at once. Either way no rank waits for a timeout and the
 * comm stays usable. */
typedef struct {
  int32_t odd;
  int validate;
} bad_replay_t;

static int bad_replay_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  const bad_replay_t *b = arg;
  replay_t r;
  int failures = replay_begin(&r, comm, rank, world, b->validate);
  if (!r.rec) return failures;
  if (failures) goto done;
  model_t *m = &r.model;
  epx_recorder_t rec = r.rec;
  int32_t saved = m->idx[0][2 * K];
  if (rank == b->odd) m->idx[0][2 * K] = m->E;
  epx_routing_t routing = model_routing(m, 0);
  epx_handle_t poison = (epx_handle_t)(uintptr_t)0xA5A5A5A5u, h = poison;
  char named[32];
  snprintf(named, sizeof named, "rank %d", b->odd);
  double start = tu_seconds();
  if (rank == b->odd)
    RANK_STATUS(epx_dispatch_layout(m->buffer[0], &routing, rec, &h), EPX_ERROR_INVALID_ARGUMENT, "outside");
  else if (b->validate)
    RANK_STATUS(epx_dispatch_layout(m->buffer[0], &routing, rec, &h), EPX_ERROR_PEER_FAILED, named);
  else
    RANK_STATUS(epx_dispatch_layout(m->buffer[0], &routing, rec, &h), EPX_SUCCESS, NULL);
  RANK_EXPECT(tu_seconds() - start < 2.0, "the replay took %.2f s", tu_seconds() - start);
  RANK_EXPECT(rank != b->odd || h == poison, "the handle output was written on a refused replay");
  if (h != poison) epx_handle_release(h);
  /* The comm still works: a collective layout with good routing. */
  m->idx[0][2 * K] = saved;
  routing = model_routing(m, 0);
  h = NULL;
  RANK_STATUS(epx_dispatch_layout(m->buffer[0], &routing, NULL, &h), EPX_SUCCESS, NULL);
  epx_handle_release(h);
done:
  return failures + replay_end(&r, rank);
}

static void test_bad_routing_in_replay(void **state) {
  (void)state;
  for (int validate = 0; validate < 2; validate++) {
    bad_replay_t b = {1, validate};
    assert_int_equal(tu_run_ranks(3, 5.0, bad_replay_rank, &b), 0);
  }
}

/* ------------------------------------------------------------------------ */
/* Memory: handles and metadata are kept, received rows are not              */
/* ------------------------------------------------------------------------ */

typedef struct {
  epx_recorder_stats_t stats[2]; /* per rank, at H = 64 and at H = 2048 */
  int64_t rows_bytes[2];         /* sum of N * H * dtype size at each H */
} bytes_run_t;

static int bytes_rank(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  bytes_run_t *out = (bytes_run_t *)arg + rank;
  static const int64_t hidden[2] = {64, 2048};
  int failures = 0;
  for (int i = 0; i < 2; i++) {
    model_t model, *m = &model;
    step_t s;
    epx_recorder_t rec = NULL;
    if (model_init(m, comm, rank, world, EPX_BFLOAT16, hidden[i]) || step_alloc(m, &s)) return 1;
    if (epx_recorder_create(0, &rec) != EPX_SUCCESS) return 1;
    layer_t st[2] = {{0}, {0}};
    if (layer_forward(m, 0, rec, s.x0, s.out[0], &st[0]) || layer_forward(m, 1, rec, s.out[0], s.out[1], &st[1])) return 1;
    out->rows_bytes[i] = (st[0].N + st[1].N) * hidden[i] * 2;
    layer_free(&st[0]);
    layer_free(&st[1]);
    RANK_STATUS(epx_recorder_stats(rec, &out->stats[i]), EPX_SUCCESS, NULL);
    RANK_STATUS(epx_recorder_destroy(rec), EPX_SUCCESS, NULL);
    model_fini(m);
    step_free(&s);
  }
  return failures;
}

static void test_recorder_keeps_metadata_not_rows(void **state) {
  (void)state;
  bytes_run_t runs[2];
  memset(runs, 0, sizeof runs);
  assert_int_equal(tu_run_ranks(2, 10.0, bytes_rank, runs), 0);
  for (int r = 0; r < 2; r++) {
    const epx_recorder_stats_t *small = &runs[r].stats[0], *large = &runs[r].stats[1];
    print_message("rank %d: bytes_held %lld / bytes_avoided %lld at H=64; %lld / %lld at H=2048\n", r,
                  (long long)small->bytes_held, (long long)small->bytes_avoided, (long long)large->bytes_held,
                  (long long)large->bytes_avoided);
    assert_int_equal(small->records, 2);
    assert_int_equal(small->bytes_avoided, runs[r].rows_bytes[0]);
    assert_int_equal(large->bytes_avoided, runs[r].rows_bytes[1]);
    assert_true(small->bytes_held > 0);
    /* The same routing at 32x the hidden size holds the same bytes. */
    assert_int_equal(large->bytes_held, small->bytes_held);
    assert_true(large->bytes_held < large->bytes_avoided);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_replay_is_bit_identical),
      cmocka_unit_test(test_replay_mismatch_refused_on_every_rank),
      cmocka_unit_test(test_bad_routing_in_replay),
      cmocka_unit_test(test_recorder_keeps_metadata_not_rows),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
