/* The main job: a whole layer step on W ranks. Each rank sets up its inputs
 * and routes them, makes one buffer per exchange, then runs the steps (the
 * route, and per exchange the forward and the backward, every phase timed),
 * and finally the ranks time-summarise, report and check together. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

enum phase {
  PH_ROUTE,
  PH_LAYOUT,
  PH_DISPATCH,
  PH_EXPERT_FWD,
  PH_COMBINE,
  PH_COMBINE_BWD,
  PH_EXPERT_BWD,
  PH_GRAD_W_RETURN,
  PH_DISPATCH_BWD,
  PH_ROUTE_BWD,
  NUM_PHASES
};

static const char *const phase_names[NUM_PHASES] = {
    "route", "dispatch_layout", "dispatch", "expert_forward", "combine", "combine_backward",
    "expert_backward", "grad_w_return", "dispatch_backward", "route_backward"};

/* dedup/collective time ratios: one per phase, then the four exchanges and
 * the step without the route. */
enum { RATIO_FOUR = NUM_PHASES, RATIO_STEP, NUM_RATIOS };

/* What one exchange of one rank produced and measured. */
typedef struct exchange_run {
  epx_exchange_t exchange;
  epx_buffer_t buffer;
  void *out, *grad_x;        /* [T, H] dtype */
  float *grad_w;             /* [T, K] */
  float *grad_logits;        /* [T, E] */
  float *dW;                 /* [E_local, 3*H*F] */
  void *d_out, *d_grad_x;    /* their mirrors (--device cuda) */
  float *d_grad_w, *d_grad_logits;
  epx_handle_stats_t stats;  /* of the last step */
  int64_t recv_rows, items;
  double flops_fwd, flops_bwd; /* of the last step */
} exchange_run_t;

/* Payload scratch shared by the exchanges (they run one after the other),
 * grown to each layout's rows; grad_recv_x reuses recv_x: the forward kept
 * what the backward needs. gw_*: rank-major's grad_w return. d_*: their
 * mirrors. */
typedef struct scratch {
  void *recv_x, *expert_out, *grad_expert_out, *gw_rows, *gw_out;
  size_t recv_cap, eo_cap, geo_cap, gw_rows_cap;
  void *d_recv_x, *d_expert_out, *d_grad_expert_out, *d_gw_rows, *d_gw_out;
  size_t d_recv_cap, d_eo_cap, d_geo_cap, d_gw_rows_cap;
} scratch_t;

/* One rank's main job. */
typedef struct rank_job {
  job_t *job;
  const options_t *o;
  const world_t *w;
  int64_t T, H;
  int32_t E, K, W, El;
  epx_dtype_t dtype;
  size_t es;
  epx_layout_t layout;
  int rank_major, n_exch, steps;
  /* this rank's inputs and the mirrors epx reads (the host arrays themselves on the CPU) */
  void *x, *grad_out, *d_x, *d_grad_out;
  float *logits, *d_logits;
  /* the route */
  epx_route_config_t rc;
  epx_route_output_t ro;
  int32_t *topk_idx, *locations, *d_idx, *d_loc;
  float *topk_w, *d_w;
  int32_t capacity;
  exchange_run_t runs[2];
  rank_experts_t re;
  scratch_t s;
  double *times;        /* [2][NUM_PHASES][iters] of this rank, seconds */
  int recompute_failed; /* the recorder's replayed rows differed on this rank */
  progress_t prog;
} rank_job_t;

/* What the ranks report together. */
typedef struct summary {
  double med[2][NUM_PHASES], step_ms[2]; /* ms, slowest rank, median over iterations */
  double ratio[NUM_RATIOS];
  /* totals over ranks: cross-rank rows/bytes, local rows, recv rows, items, recv bytes */
  int64_t tot[2][6];
  double flops[2][2];
} summary_t;

static double *time_at(const rank_job_t *j, int xi, int ph, int it) {
  return &j->times[((size_t)xi * NUM_PHASES + (size_t)ph) * (size_t)j->o->iters + (size_t)it];
}

static void timed_begin(const world_t *w, double *t0) {
  world_barrier(w);
  *t0 = now_s();
}

/* Seconds since t0, once the GPU's work (if any) is done. */
static double timed_end(double t0) {
  dev_sync();
  return now_s() - t0;
}

/* ------------------------------------------------------------------------ */
/* Setup                                                                     */
/* ------------------------------------------------------------------------ */

static void setup_shape(rank_job_t *j, job_t *job, const world_t *w) {
  memset(j, 0, sizeof *j);
  const options_t *o = job->o;
  j->job = job, j->o = o, j->w = w;
  j->T = o->tokens, j->H = o->hidden;
  j->E = o->experts, j->K = o->topk, j->W = w->size, j->El = j->E / j->W;
  j->dtype = (epx_dtype_t)o->dtype;
  j->es = epx_dtype_size(j->dtype);
  j->layout = o->layout;
  j->rank_major = j->layout == EPX_LAYOUT_RANK_MAJOR;
  j->n_exch = o->exchange == CHOOSE_BOTH ? 2 : 1;
  j->steps = o->warmup + o->iters;
  j->prog = (progress_t){now_s(), 0.0};
}

/* This rank's inputs x, grad_out [T, H] and logits [T, E], and their mirrors. */
static void setup_inputs(rank_job_t *j) {
  const options_t *o = j->o;
  const int64_t T = j->T, H = j->H;
  const size_t th = j->es * (size_t)(T * H), te = sizeof(float) * (size_t)(T * j->E);
  rng_t rx = rng_make(o->seed, 16 * (uint64_t)j->w->rank + 1), rg = rng_make(o->seed, 16 * (uint64_t)j->w->rank + 2);
  j->x = xalloc(th), j->grad_out = xalloc(th);
  fill_payload(j->dtype, j->x, T * H, &rx);
  fill_payload(j->dtype, j->grad_out, T * H, &rg);
  j->logits = xalloc(te);
  make_logits(o, j->w->rank, T, j->logits);
  j->d_x = mirror_of(j->x, th), j->d_grad_out = mirror_of(j->grad_out, th);
  j->d_logits = mirror_of(j->logits, te);
  upload(j->d_x, j->x, th);
  upload(j->d_grad_out, j->grad_out, th);
  upload(j->d_logits, j->logits, te);
}

/* The first route: the buffers' capacity comes from it. */
static void setup_route(rank_job_t *j) {
  const size_t tk4 = 4 * (size_t)(j->T * j->K);
  j->rc = route_config(j->o, j->o->capacity_factor > 0.0);
  if (g_cuda) j->rc.device = EPX_DEVICE_CUDA, j->rc.stream = g_stream;
  j->topk_idx = xalloc(tk4), j->locations = xalloc(tk4);
  j->topk_w = xalloc(tk4);
  j->d_idx = mirror_of(j->topk_idx, tk4), j->d_loc = mirror_of(j->locations, tk4);
  j->d_w = mirror_of(j->topk_w, tk4);
  j->ro = (epx_route_output_t){j->d_idx, j->d_w, j->d_loc, NULL, NULL, NULL, 0, 0};
  TRY(epx_route(&j->rc, j->T, j->d_logits, NULL, &j->ro));
  download(j->topk_idx, j->d_idx, tk4), download(j->topk_w, j->d_w, tk4), download(j->locations, j->d_loc, tk4);
  j->capacity = j->ro.capacity;
}

/* --record-trace: every rank's topk_idx gathered, written by rank 0 in
 * epx-replay's trace format (tools/epx-replay.c: a header, then per step,
 * layer and rank the token count and [T, K] expert ids). */
static void record_trace(const rank_job_t *j) {
  const world_t *w = j->w;
  size_t block = sizeof(int32_t) * (size_t)(j->T * j->K);
  int32_t *all = xalloc(block * (size_t)w->size);
  if (w->comm) TRY(epx_comm_allgather(w->comm, j->topk_idx, all, block));
  else memcpy(all, j->topk_idx, block);
  if (w->rank == 0) {
    FILE *f = fopen(j->o->record_trace, "wb");
    uint32_t head[6] = {1, (uint32_t)w->size, 1, 1, (uint32_t)j->E, (uint32_t)j->K}, T = (uint32_t)j->T;
    uint64_t max_tokens = (uint64_t)j->T;
    int ok = f && fwrite("EPXTRACE", 1, 8, f) == 8 && fwrite(head, sizeof head, 1, f) == 1 &&
             fwrite(&max_tokens, 8, 1, f) == 1;
    for (int32_t r = 0; r < w->size && ok; r++)
      ok = fwrite(&T, 4, 1, f) == 1 && fwrite((char *)all + block * (size_t)r, block, 1, f) == 1;
    if (!f || fclose(f) || !ok) fatal("--record-trace %s: cannot write it", j->o->record_trace);
    printf("routing trace written to %s (%d ranks, T=%lld, E=%d, top-%d)\n", j->o->record_trace, (int)w->size,
           (long long)j->T, (int)j->E, (int)j->K);
  }
  free(all);
}

/* One buffer and one set of outputs per exchange. */
static void setup_runs(rank_job_t *j, epx_comm_t comm) {
  const options_t *o = j->o;
  const int64_t T = j->T, H = j->H;
  const size_t es = j->es;
  for (int xi = 0; xi < j->n_exch; xi++) {
    exchange_run_t *run = &j->runs[xi];
    run->exchange = o->exchange == CHOOSE_BOTH ? (epx_exchange_t)xi : (epx_exchange_t)o->exchange;
    epx_buffer_config_t bc = buffer_config_of(j->dtype, H, j->E, j->K, T, j->layout, j->capacity);
    bc.exchange = run->exchange;
    if (g_cuda) bc.device = EPX_DEVICE_CUDA, bc.stream = g_stream;
    TRY(epx_buffer_create(comm, &bc, &run->buffer));
    run->out = xalloc(es * (size_t)(T * H));
    run->grad_x = xalloc(es * (size_t)(T * H));
    run->grad_w = xalloc(sizeof(float) * (size_t)(T * j->K));
    run->grad_logits = xalloc(sizeof(float) * (size_t)(T * j->E));
    run->d_out = mirror_of(run->out, es * (size_t)(T * H));
    run->d_grad_x = mirror_of(run->grad_x, es * (size_t)(T * H));
    run->d_grad_w = mirror_of(run->grad_w, sizeof(float) * (size_t)(T * j->K));
    run->d_grad_logits = mirror_of(run->grad_logits, sizeof(float) * (size_t)(T * j->E));
    run->dW = o->ffn ? xalloc(sizeof(float) * (size_t)(expert_stride(&j->job->ex) * j->El)) : NULL;
  }
}

/* The expert work, the payload scratch and the time table. */
static void setup_work(rank_job_t *j) {
  rank_experts_t *re = &j->re;
  re->ex = &j->job->ex;
  re->layout = j->layout;
  re->dtype = j->dtype;
  re->rank = j->w->rank;
  re->E_local = j->El;
  re->K = j->K;
  re->H = j->H;
  re->counts = xalloc(sizeof(int64_t) * (size_t)j->El);
  re->offsets = xalloc(sizeof(int64_t) * (size_t)(j->El + 1));
  re->first = xalloc(sizeof(int64_t) * (size_t)(j->El + 1));
  if (j->rank_major) {
    j->s.gw_out = xalloc(j->es * (size_t)(j->T * j->H));
    j->s.d_gw_out = mirror_of(j->s.gw_out, j->es * (size_t)(j->T * j->H));
  }
  j->times = calloc((size_t)(2 * NUM_PHASES * j->o->iters), sizeof(double));
  if (!j->times) fatal("out of memory");
}

/* ------------------------------------------------------------------------ */
/* One step                                                                  */
/* ------------------------------------------------------------------------ */

/* The scratch grown to N received rows (+1: never empty). */
static void scratch_fit(rank_job_t *j, size_t rows_bytes) {
  scratch_t *s = &j->s;
  s->recv_x = grow(s->recv_x, &s->recv_cap, rows_bytes);
  s->expert_out = grow(s->expert_out, &s->eo_cap, rows_bytes);
  s->grad_expert_out = grow(s->grad_expert_out, &s->geo_cap, rows_bytes);
  if (j->rank_major) s->gw_rows = grow(s->gw_rows, &s->gw_rows_cap, rows_bytes);
  s->d_recv_x = mirror_grow(s->recv_x, s->d_recv_x, &s->d_recv_cap, rows_bytes);
  s->d_expert_out = mirror_grow(s->expert_out, s->d_expert_out, &s->d_eo_cap, rows_bytes);
  s->d_grad_expert_out = mirror_grow(s->grad_expert_out, s->d_grad_expert_out, &s->d_geo_cap, rows_bytes);
  if (j->rank_major) s->d_gw_rows = mirror_grow(s->gw_rows, s->d_gw_rows, &s->d_gw_rows_cap, rows_bytes);
}

/* NaN everywhere, so a row the library forgot to write cannot pass for one
 * the previous exchange wrote. */
static void poison_outputs(rank_job_t *j, exchange_run_t *run, size_t rows_bytes) {
  scratch_t *s = &j->s;
  const size_t th = j->es * (size_t)(j->T * j->H), tk = 4 * (size_t)(j->T * j->K);
  poison(s->recv_x, s->d_recv_x, rows_bytes);
  poison(s->expert_out, s->d_expert_out, rows_bytes);
  poison(s->grad_expert_out, s->d_grad_expert_out, rows_bytes);
  poison(run->out, run->d_out, th);
  poison(run->grad_x, run->d_grad_x, th);
  poison(run->grad_w, run->d_grad_w, tk);
  poison(run->grad_logits, run->d_grad_logits, sizeof(float) * (size_t)(j->T * j->E));
}

/* Activation-checkpoint recompute, as a checkpointed block does it: the
 * forward's dispatch is recorded, the recompute replays it (no layout, no
 * count exchange: a cached dispatch), and the rows must equal the forward's
 * bit for bit. Prints the best of five of a full layout + dispatch and of a
 * replayed one, and what the recorder keeps against the received rows it
 * lets the block drop. */
static int recompute_check(const world_t *w, epx_buffer_t buf, const epx_routing_t *routing, const void *x,
                           const void *recv_x, int64_t N, size_t row_bytes, const char *exchange) {
  enum { REPEATS = 5 };
  epx_recorder_t rec = NULL;
  epx_handle_t h = NULL;
  void *host_rows = xalloc(row_bytes * (size_t)(N + 1));
  memset(host_rows, 0, row_bytes * (size_t)(N + 1)); /* first-touch page faults out of the timing */
  void *rows = mirror_of(host_rows, row_bytes * (size_t)(N + 1));
  upload(rows, host_rows, row_bytes * (size_t)(N + 1));
  double best[2] = {1e30, 1e30}, t0;
  TRY(epx_recorder_create(1, &rec));
  TRY(epx_dispatch_layout(buf, routing, rec, &h)); /* the forward's record */
  TRY(epx_handle_release(h));
  for (int r = 0; r < REPEATS; r++) {
    timed_begin(w, &t0);
    TRY(epx_dispatch_layout(buf, routing, NULL, &h));
    TRY(epx_dispatch(buf, h, x, rows, N + 1));
    best[0] = fmin(best[0], timed_end(t0));
    TRY(epx_handle_release(h));
    TRY(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY)); /* rewinds to the first record */
    timed_begin(w, &t0);
    TRY(epx_dispatch_layout(buf, routing, rec, &h));
    TRY(epx_dispatch(buf, h, x, rows, N + 1));
    best[1] = fmin(best[1], timed_end(t0));
    TRY(epx_handle_release(h));
  }
  download(host_rows, rows, row_bytes * (size_t)N);
  int64_t bad[1] = {memcmp(host_rows, recv_x, row_bytes * (size_t)N) != 0};
  epx_recorder_stats_t st;
  TRY(epx_recorder_stats(rec, &st));
  int64_t bytes[2] = {st.bytes_held, st.bytes_avoided};
  world_max_f64(w, best, 2);
  world_sum_i64(w, bad, 1);
  world_sum_i64(w, bytes, 2);
  if (w->rank == 0)
    printf("recompute %-10s layout+dispatch %.3f ms, replayed from the recorder %.3f ms (%.2fx); recorder "
           "holds %.2f MB, avoids keeping %.1f MB of received rows; rows %s\n",
           exchange, best[0] * 1e3, best[1] * 1e3, best[0] / best[1], bytes[0] / 1e6, bytes[1] / 1e6,
           bad[0] ? "DIFFER" : "bit-identical");
  TRY(epx_recorder_destroy(rec));
  mirror_free(host_rows, rows);
  free(host_rows);
  return bad[0] == 0;
}

/* dispatch, the experts' forward, combine; on the last step also the
 * recompute check. */
static void step_forward(rank_job_t *j, exchange_run_t *run, epx_handle_t h, const epx_routing_t *routing,
                         int64_t N, int last, double *ph) {
  scratch_t *s = &j->s;
  epx_buffer_t buf = run->buffer;
  const size_t n_bytes = j->es * (size_t)(N * j->H), th = j->es * (size_t)(j->T * j->H);
  double t0;
  timed_begin(j->w, &t0);
  TRY(epx_dispatch(buf, h, j->d_x, s->d_recv_x, N + 1));
  ph[PH_DISPATCH] = timed_end(t0);
  download(s->recv_x, s->d_recv_x, n_bytes);

  if (last && !recompute_check(j->w, buf, routing, j->d_x, s->recv_x, N, j->es * (size_t)j->H,
                               exchange_name(run->exchange)))
    j->recompute_failed = 1;

  j->re.flops_fwd = j->re.flops_bwd = 0.0;
  timed_begin(j->w, &t0);
  rank_experts_plan(&j->re, h);
  rank_experts_forward(&j->re, s->recv_x, s->expert_out);
  ph[PH_EXPERT_FWD] = now_s() - t0;
  upload(s->d_expert_out, s->expert_out, n_bytes);

  timed_begin(j->w, &t0);
  TRY(epx_combine(buf, h, s->d_expert_out, run->d_out));
  ph[PH_COMBINE] = timed_end(t0);
  download(run->out, run->d_out, th);
}

/* Rank-major rows carry no weights through the exchange, so grad_w comes
 * home in a combine: row r's column k holds the gradient of its slot k; each
 * slot lives on one rank, so the sum over ranks is it. */
static void grad_w_return(rank_job_t *j, exchange_run_t *run, epx_handle_t h, int64_t N) {
  scratch_t *s = &j->s;
  const int64_t T = j->T, H = j->H, K = j->K;
  const size_t es = j->es;
  memset(s->gw_rows, 0, es * (size_t)(N * H));
  for (int64_t r = 0; r < N; r++)
    TRY(epx_convert(j->dtype, (char *)s->gw_rows + (size_t)(r * H) * es, EPX_FLOAT32, j->re.slot_grad_w + r * K, K));
  upload(s->d_gw_rows, s->gw_rows, es * (size_t)(N * H));
  TRY(epx_combine(run->buffer, h, s->d_gw_rows, s->d_gw_out));
  download(s->gw_out, s->d_gw_out, es * (size_t)(T * H));
  for (int64_t t = 0; t < T; t++)
    TRY(epx_convert(EPX_FLOAT32, run->grad_w + t * K, j->dtype, (char *)s->gw_out + (size_t)(t * H) * es, K));
}

/* combine_backward, the experts' backward, rank-major's grad_w return,
 * dispatch_backward, route_backward. */
static void step_backward(rank_job_t *j, exchange_run_t *run, epx_handle_t h, int64_t N, double *ph) {
  scratch_t *s = &j->s;
  epx_buffer_t buf = run->buffer;
  const size_t n_bytes = j->es * (size_t)(N * j->H), th = j->es * (size_t)(j->T * j->H),
               tk = 4 * (size_t)(j->T * j->K);
  double t0;
  timed_begin(j->w, &t0);
  if (j->rank_major) TRY(epx_combine_backward(buf, h, j->d_grad_out, NULL, s->d_grad_expert_out, NULL));
  else TRY(epx_combine_backward(buf, h, j->d_grad_out, s->d_expert_out, s->d_grad_expert_out, run->d_grad_w));
  ph[PH_COMBINE_BWD] = timed_end(t0);
  download(s->grad_expert_out, s->d_grad_expert_out, n_bytes);
  if (!j->rank_major) download(run->grad_w, run->d_grad_w, tk);

  timed_begin(j->w, &t0);
  rank_experts_backward(&j->re, s->grad_expert_out, s->recv_x, s->recv_x, run->dW);
  ph[PH_EXPERT_BWD] = now_s() - t0;
  upload(s->d_recv_x, s->recv_x, n_bytes);

  if (j->rank_major) {
    timed_begin(j->w, &t0);
    grad_w_return(j, run, h, N);
    ph[PH_GRAD_W_RETURN] = now_s() - t0;
  }

  timed_begin(j->w, &t0);
  TRY(epx_dispatch_backward(buf, h, s->d_recv_x, run->d_grad_x, NULL, NULL));
  ph[PH_DISPATCH_BWD] = timed_end(t0);
  download(run->grad_x, run->d_grad_x, th);

  if (j->rank_major) upload(run->d_grad_w, run->grad_w, tk); /* computed here, on the host */
  timed_begin(j->w, &t0);
  TRY(epx_route_backward(&j->rc, j->T, j->d_logits, NULL, j->d_idx, run->d_grad_w, 0.0f, 0.0f, run->d_grad_logits));
  ph[PH_ROUTE_BWD] = timed_end(t0);
  download(run->grad_logits, run->d_grad_logits, sizeof(float) * (size_t)(j->T * j->E));
}

/* One exchange's layout, forward and backward; ph gets its phases' times. */
static void step_exchange(rank_job_t *j, exchange_run_t *run, int last, double *ph) {
  epx_routing_t routing = {j->T, j->K, j->d_idx, j->d_w, j->layout == EPX_LAYOUT_CAPACITY ? j->d_loc : NULL,
                           j->rank_major ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  double t0;
  timed_begin(j->w, &t0);
  TRY(epx_dispatch_layout(run->buffer, &routing, NULL, &h));
  ph[PH_LAYOUT] = timed_end(t0);

  int64_t N;
  TRY(epx_handle_recv_rows(h, &N));
  const size_t rows_bytes = j->es * (size_t)(N + 1) * (size_t)j->H;
  scratch_fit(j, rows_bytes);
  if (last && j->o->check) poison_outputs(j, run, rows_bytes);

  step_forward(j, run, h, &routing, N, last, ph);
  step_backward(j, run, h, N, ph);

  TRY(epx_handle_stats(h, &run->stats));
  run->recv_rows = N;
  run->items = j->re.n_items;
  run->flops_fwd = j->re.flops_fwd;
  run->flops_bwd = j->re.flops_bwd;
  TRY(epx_handle_release(h));
}

/* The route, then every exchange; times kept after the warm-up. */
static void run_step(rank_job_t *j, int step) {
  const options_t *o = j->o;
  const int it = step - o->warmup, last = step == j->steps - 1;
  double t0;
  progress_note(j->w, &j->prog, "step %d of %d%s", step + 1, j->steps, step < o->warmup ? " (warm-up)" : "");
  timed_begin(j->w, &t0);
  TRY(epx_route(&j->rc, j->T, j->d_logits, NULL, &j->ro));
  if (it >= 0) *time_at(j, 0, PH_ROUTE, it) = timed_end(t0);

  /* With both exchanges, alternate which goes first, so neither always
   * runs right after the route or on the other's warm caches. */
  for (int k = 0; k < j->n_exch; k++) {
    const int xi = j->n_exch == 2 && step % 2 ? 1 - k : k;
    double ph[NUM_PHASES] = {0};
    step_exchange(j, &j->runs[xi], last, ph);
    if (it >= 0)
      for (int p = PH_LAYOUT; p < NUM_PHASES; p++) *time_at(j, xi, p, it) = ph[p];
  }
}

/* ------------------------------------------------------------------------ */
/* Timing and report                                                         */
/* ------------------------------------------------------------------------ */

/* Slowest rank per phase and iteration, then the median over iterations. */
static void summarize_times(rank_job_t *j, summary_t *s) {
  const int iters = j->o->iters;
  world_max_f64(j->w, j->times, 2 * NUM_PHASES * iters);
  for (int xi = 0; xi < j->n_exch; xi++) {
    double *st = xalloc(sizeof(double) * (size_t)iters);
    for (int it = 0; it < iters; it++) {
      st[it] = *time_at(j, 0, PH_ROUTE, it);
      for (int p = PH_LAYOUT; p < NUM_PHASES; p++) st[it] += *time_at(j, xi, p, it);
    }
    s->step_ms[xi] = 1e3 * median(st, iters);
    free(st);
    for (int p = 0; p < NUM_PHASES; p++) s->med[xi][p] = 1e3 * median(time_at(j, p == PH_ROUTE ? 0 : xi, p, 0), iters);
  }
}

/* dedup/collective time ratios, paired within an iteration (both ran back to
 * back on the same routing) and then the median: steadier than a ratio of
 * medians on a machine whose load changes from second to second. */
static void summarize_ratios(const rank_job_t *j, summary_t *s) {
  const int iters = j->o->iters;
  memset(s->ratio, 0, sizeof s->ratio);
  if (j->n_exch != 2) return;
  double *r = xalloc(sizeof(double) * (size_t)iters);
  for (int q = PH_LAYOUT; q < NUM_RATIOS; q++) {
    for (int it = 0; it < iters; it++) {
      double a = 0.0, b = 0.0;
      for (int p = PH_LAYOUT; p < NUM_PHASES; p++) {
        int in = q == p || q == RATIO_STEP ||
                 (q == RATIO_FOUR && (p == PH_DISPATCH || p == PH_COMBINE || p == PH_COMBINE_BWD || p == PH_DISPATCH_BWD));
        if (!in) continue;
        a += *time_at(j, 0, p, it);
        b += *time_at(j, 1, p, it);
      }
      r[it] = b > 0.0 ? a / b : 0.0;
    }
    s->ratio[q] = median(r, iters);
  }
  free(r);
}

/* Totals over ranks: cross-rank rows/bytes, local rows, recv rows, items. */
static void summarize_totals(const rank_job_t *j, summary_t *s) {
  for (int xi = 0; xi < j->n_exch; xi++) {
    const exchange_run_t *run = &j->runs[xi];
    int64_t v[6] = {run->stats.send_rows, run->stats.send_bytes, run->stats.local_rows, run->recv_rows,
                    run->items, run->stats.recv_bytes};
    world_sum_i64(j->w, v, 6);
    memcpy(s->tot[xi], v, sizeof v);
    /* flops as integers (exact for any realistic size) to reuse the sum */
    int64_t f[2] = {(int64_t)run->flops_fwd, (int64_t)run->flops_bwd};
    world_sum_i64(j->w, f, 2);
    s->flops[xi][0] = (double)f[0];
    s->flops[xi][1] = (double)f[1];
  }
}

/* Bytes a phase must move over all ranks (0: not an exchange) and the
 * flops it computes (0: not an expert phase). */
static void phase_work(const rank_job_t *j, const summary_t *s, int xi, int p, double *traffic, double *fl) {
  const double TW = (double)j->T * j->W, hb = (double)j->H * (double)j->es, Nsum = (double)s->tot[xi][3];
  const int32_t E = j->E, K = j->K;
  *traffic = 0.0, *fl = 0.0;
  switch (p) {
    case PH_ROUTE: *traffic = TW * (E * 4.0 + K * 12.0); break;
    case PH_DISPATCH: *traffic = (TW + Nsum) * hb; break;
    case PH_COMBINE:
    case PH_DISPATCH_BWD:
    case PH_GRAD_W_RETURN: *traffic = (Nsum + TW) * hb; break;
    case PH_COMBINE_BWD: *traffic = (TW + (j->rank_major ? 1.0 : 2.0) * Nsum) * hb; break;
    case PH_ROUTE_BWD: *traffic = TW * (E * 8.0 + K * 8.0); break;
    case PH_EXPERT_FWD: *fl = s->flops[xi][0]; break;
    case PH_EXPERT_BWD: *fl = s->flops[xi][1]; break;
    default: break;
  }
}

/* One phase's row of the table (rank 0). */
static void report_phase(const rank_job_t *j, const summary_t *s, int xi, int p) {
  const double memcpy_gbps = j->job->memcpy_gbps;
  double ms = s->med[xi][p], traffic, fl;
  phase_work(j, s, xi, p, &traffic, &fl);
  int moves = p == PH_DISPATCH || p == PH_COMBINE || p == PH_COMBINE_BWD || p == PH_DISPATCH_BWD ||
              p == PH_GRAD_W_RETURN;
  double gbps = traffic > 0 ? traffic / (ms * 1e-3) / 1e9 : 0.0;
  const char *xn = p == PH_ROUTE ? "-" : exchange_name(j->runs[xi].exchange);
  if (j->o->csv) {
    printf("%s,%s,%.4f,%lld,%lld,%.0f,%.3f,%.4f,%.3f\n", phase_names[p], xn, ms,
           moves ? (long long)s->tot[xi][0] : 0LL, moves ? (long long)s->tot[xi][1] : 0LL, traffic, gbps,
           traffic > 0 ? gbps / memcpy_gbps : 0.0, fl > 0 ? fl / (ms * 1e-3) / 1e9 : 0.0);
    return;
  }
  char rows_s[32] = "-", mb_s[32] = "-", tr_s[32] = "-", gb_s[32] = "-", of_s[32] = "-", fl_s[32] = "-";
  if (moves) {
    snprintf(rows_s, sizeof rows_s, "%lld", (long long)s->tot[xi][0]);
    snprintf(mb_s, sizeof mb_s, "%.1f", (double)s->tot[xi][1] / 1e6);
  }
  if (traffic > 0) {
    snprintf(tr_s, sizeof tr_s, "%.1f", traffic / 1e6);
    snprintf(gb_s, sizeof gb_s, "%.2f", gbps);
    snprintf(of_s, sizeof of_s, "%.2f", gbps / memcpy_gbps);
  }
  if (fl > 0) snprintf(fl_s, sizeof fl_s, "%.1f", fl / (ms * 1e-3) / 1e9);
  printf("%-18s %-10s %10.3f %11s %10s %11s %8s %9s %8s\n", phase_names[p], xn, ms, rows_s, mb_s, tr_s, gb_s,
         of_s, fl_s);
}

/* The timing table, the steps and the dedup/collective ratios (rank 0). */
static void report_table(const rank_job_t *j, const summary_t *s) {
  const options_t *o = j->o;
  if (o->csv)
    printf("phase,exchange,time_ms,xrank_rows,xrank_bytes,traffic_bytes,gbps,of_memcpy,gflops\n");
  else
    printf("%-18s %-10s %10s %11s %10s %11s %8s %9s %8s\n", "phase", "exchange", "time_ms", "xrank_rows",
           "xrank_MB", "traffic_MB", "GB/s", "of_memcpy", "GFLOP/s");
  for (int xi = 0; xi < j->n_exch; xi++) {
    for (int p = 0; p < NUM_PHASES; p++) {
      if (p == PH_ROUTE && xi > 0) continue;
      if (p == PH_GRAD_W_RETURN && !j->rank_major) continue;
      report_phase(j, s, xi, p);
    }
    if (o->csv)
      printf("step,%s,%.4f,,,,,,\n", exchange_name(j->runs[xi].exchange), s->step_ms[xi]);
    else
      printf("%-18s %-10s %10.3f\n", "step", exchange_name(j->runs[xi].exchange), s->step_ms[xi]);
  }
  if (j->n_exch == 2)
    printf("dedup/collective: cross-rank rows %.3f, bytes %.3f; time (median of per-iteration ratios): "
           "dispatch_layout %.3f, dispatch %.3f, combine %.3f, combine_backward %.3f, dispatch_backward %.3f, "
           "the four exchanges %.3f, step without route %.3f\n",
           (double)s->tot[0][0] / (double)(s->tot[1][0] ? s->tot[1][0] : 1),
           (double)s->tot[0][1] / (double)(s->tot[1][1] ? s->tot[1][1] : 1), s->ratio[PH_LAYOUT],
           s->ratio[PH_DISPATCH], s->ratio[PH_COMBINE], s->ratio[PH_COMBINE_BWD], s->ratio[PH_DISPATCH_BWD],
           s->ratio[RATIO_FOUR], s->ratio[RATIO_STEP]);
  fflush(stdout);
}

/* ------------------------------------------------------------------------ */
/* Checking                                                                  */
/* ------------------------------------------------------------------------ */

/* epx_route against the library's float64 reference route (ridx, rw). */
static int check_route(const rank_job_t *j, const int32_t *ridx, const float *rw, int32_t C) {
  const int64_t TK = j->T * j->K;
  int ok = 1;
  if (j->w->rank == 0)
    printf("check %-34s epx %d, expected %d: %s\n", "route capacity", (int)j->capacity, (int)C,
           j->capacity == C ? "ok" : "FAILED");
  ok &= j->capacity == C;
  int64_t idx_bad = 0;
  for (int64_t i = 0; i < TK; i++) idx_bad += ridx[i] != j->topk_idx[i];
  ok &= report_count(j->w, "route topk_idx", idx_bad, TK);
  ok &= report_compare(j->w, "route topk_w", compare_f32(j->topk_w, rw, TK, tolerance_of(EPX_FLOAT32)),
                       tolerance_of(EPX_FLOAT32));
  return ok;
}

/* One exchange's outputs against the dense reference of the layer. */
static int check_run(const rank_job_t *j, const exchange_run_t *run, const layer_ref_t *ref) {
  const int64_t T = j->T, H = j->H, K = j->K, E = j->E;
  const tolerance_t tol = tolerance_of(j->dtype);
  const char *xn = exchange_name(run->exchange);
  char what[64];
  int ok = 1;
  snprintf(what, sizeof what, "out (%s)", xn);
  ok &= report_compare(j->w, what, compare_payload(j->dtype, run->out, ref->out, T * H, tol), tol);
  snprintf(what, sizeof what, "grad_x (%s)", xn);
  ok &= report_compare(j->w, what, compare_payload(j->dtype, run->grad_x, ref->grad_x, T * H, tol), tol);
  snprintf(what, sizeof what, "grad_w (%s)", xn);
  ok &= report_compare(j->w, what, compare_f32(run->grad_w, ref->grad_w, T * K, tol), tol);
  snprintf(what, sizeof what, "grad_logits (%s)", xn);
  ok &= report_compare(j->w, what, compare_f32(run->grad_logits, ref->grad_logits, T * E, tol), tol);
  /* A router that learns nothing passes every other check. */
  int64_t nonzero[2] = {0, T * E};
  for (int64_t i = 0; i < T * E; i++) nonzero[0] += run->grad_logits[i] != 0.0f;
  world_sum_i64(j->w, nonzero, 2);
  snprintf(what, sizeof what, "router gradient (%s)", xn);
  if (j->w->rank == 0)
    printf("check %-34s %lld of %lld grad_logits nonzero: %s\n", what, (long long)nonzero[0],
           (long long)nonzero[1], nonzero[0] ? "ok" : "FAILED");
  ok &= nonzero[0] > 0;
  return ok;
}

/* Both exchanges: the same results bit for bit, dedup moving no more rows. */
static int check_parity(const rank_job_t *j, const summary_t *s) {
  const int64_t T = j->T, H = j->H, K = j->K, E = j->E;
  const exchange_run_t *a = &j->runs[0], *b = &j->runs[1];
  int64_t bad = count_diff_bytes(a->out, b->out, T * H, j->es) + count_diff_bytes(a->grad_x, b->grad_x, T * H, j->es) +
                count_diff_bytes(a->grad_w, b->grad_w, T * K, 4) +
                count_diff_bytes(a->grad_logits, b->grad_logits, T * E, 4);
  int64_t count = 2 * T * H + T * K + T * E;
  if (j->o->ffn) {
    bad += count_diff_bytes(a->dW, b->dW, expert_stride(&j->job->ex) * j->El, 4);
    count += expert_stride(&j->job->ex) * j->El;
  }
  int ok = report_count(j->w, "dedup == collective, bit for bit", bad, count);
  if (j->w->rank == 0)
    printf("check %-34s dedup %lld, collective %lld: %s\n", "cross-rank rows, dedup <= coll.",
           (long long)s->tot[0][0], (long long)s->tot[1][0], s->tot[0][0] <= s->tot[1][0] ? "ok" : "FAILED");
  ok &= s->tot[0][0] <= s->tot[1][0];
  return ok;
}

/* Everything against the dense reference computed here; returns the verdict. */
static int check_layer(rank_job_t *j, const summary_t *s) {
  const options_t *o = j->o;
  const int64_t T = j->T, H = j->H, K = j->K, E = j->E;
  progress_note(j->w, &j->prog, "checking against the dense reference");
  double t_ref = now_s();
  int32_t C = 0;
  int32_t *ridx = xalloc(sizeof(int32_t) * (size_t)(T * K));
  float *rw = xalloc(sizeof(float) * (size_t)(T * K));
  ref_route(o, o->capacity_factor > 0.0, T, j->logits, ridx, rw, &C);
  int ok = check_route(j, ridx, rw, C);

  layer_ref_t ref = {xalloc(sizeof(float) * (size_t)(T * H)), xalloc(sizeof(float) * (size_t)(T * H)),
                     xalloc(sizeof(float) * (size_t)(T * K)), xalloc(sizeof(float) * (size_t)(T * E))};
  layer_reference(&j->job->ex, j->dtype, T, (int32_t)K, ridx, rw, o, j->logits, j->x, j->grad_out, &ref);
  for (int xi = 0; xi < j->n_exch; xi++) ok &= check_run(j, &j->runs[xi], &ref);
  if (j->n_exch == 2) ok &= check_parity(j, s);
  double ref_s[1] = {now_s() - t_ref};
  world_max_f64(j->w, ref_s, 1);
  if (j->w->rank == 0) printf("check took %.2f s\n", ref_s[0]);
  free(ridx);
  free(rw);
  free(ref.out);
  free(ref.grad_x);
  free(ref.grad_w);
  free(ref.grad_logits);
  return ok;
}

/* ------------------------------------------------------------------------ */
/* The rank's whole job                                                      */
/* ------------------------------------------------------------------------ */

static void rank_job_free(rank_job_t *j) {
  for (int xi = 0; xi < j->n_exch; xi++) {
    exchange_run_t *run = &j->runs[xi];
    TRY(epx_buffer_destroy(run->buffer));
    mirror_free(run->out, run->d_out), mirror_free(run->grad_x, run->d_grad_x);
    mirror_free(run->grad_w, run->d_grad_w), mirror_free(run->grad_logits, run->d_grad_logits);
    free(run->out);
    free(run->grad_x);
    free(run->grad_w);
    free(run->grad_logits);
    free(run->dW);
  }
  rank_experts_free(&j->re);
  scratch_t *s = &j->s;
  mirror_free(s->recv_x, s->d_recv_x), mirror_free(s->expert_out, s->d_expert_out);
  mirror_free(s->grad_expert_out, s->d_grad_expert_out), mirror_free(s->gw_rows, s->d_gw_rows);
  mirror_free(s->gw_out, s->d_gw_out);
  mirror_free(j->x, j->d_x), mirror_free(j->grad_out, j->d_grad_out), mirror_free(j->logits, j->d_logits);
  mirror_free(j->topk_idx, j->d_idx), mirror_free(j->topk_w, j->d_w), mirror_free(j->locations, j->d_loc);
  free(j->times);
  free(s->recv_x);
  free(s->expert_out);
  free(s->grad_expert_out);
  free(s->gw_rows);
  free(s->gw_out);
  free(j->x);
  free(j->grad_out);
  free(j->logits);
  free(j->topk_idx);
  free(j->topk_w);
  free(j->locations);
}

void main_job_rank(job_t *job, const world_t *w, epx_comm_t comm) {
  rank_job_t j;
  setup_shape(&j, job, w);
  double memcpy_gbps = g_cuda ? measure_device_copy(w, (size_t)256 << 20, 5) : measure_memcpy(w, (size_t)64 << 20, 5);
  if (w->rank == 0) job->memcpy_gbps = memcpy_gbps;
  setup_inputs(&j);
  setup_route(&j);
  if (j.o->record_trace) record_trace(&j);
  setup_runs(&j, comm);
  setup_work(&j);
  int32_t nodes = 0, per_node = 0;
  if (epx_comm_topology(comm, &nodes, &per_node, NULL, NULL) == EPX_SUCCESS && w->rank == 0)
    printf("topology: %d node%s of %d rank%s (epx_comm_topology)\n", (int)nodes, nodes == 1 ? "" : "s", (int)per_node,
           per_node == 1 ? "" : "s");

  for (int step = 0; step < j.steps; step++) run_step(&j, step);

  summary_t s;
  summarize_times(&j, &s);
  summarize_ratios(&j, &s);
  summarize_totals(&j, &s);
  if (w->rank == 0) report_table(&j, &s);

  int ok = j.o->check ? check_layer(&j, &s) : 1;
  ok &= !j.recompute_failed;
  if (w->rank == 0) job->ok = ok;
  rank_job_free(&j);
}
