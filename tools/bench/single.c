/* --single: the one-rank microbenchmark of the data-movement calls against
 * memcpy and the dense one-hot reference. One run measures the copy ceiling,
 * routes and times every call, maps the received rows into the dense
 * [E, C, H] layout, times the dense baselines, reports, and checks every
 * output against the dense results. With --fp8, the buffer has that fp8
 * format and the fp8 dispatches are timed beside the dtype's: the host
 * quantizer, epx_dispatch_fp8 of its rows, epx_dispatch_quantize; their
 * received bytes checked against the quantized source rows. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"

enum single_op { OP_ROUTE, OP_LAYOUT, OP_DISPATCH, OP_COMBINE, OP_COMBINE_BWD, OP_DISPATCH_BWD, OP_ROUTE_BWD, NUM_OPS };
static const char *const op_names[NUM_OPS] = {"route", "dispatch_layout", "dispatch", "combine",
                                              "combine_backward", "dispatch_backward", "route_backward"};

/* Runs fn `warmup + iters` times; returns the median of the timed ones, ms. */
#define TIME_MEDIAN(result_ms, warmup, iters, body)                  \
  do {                                                               \
    double tm_[256];                                                 \
    int n_ = (iters) < 256 ? (iters) : 256;                          \
    for (int r_ = 0; r_ < (warmup) + n_; r_++) {                     \
      double t0_ = now_s();                                          \
      body;                                                          \
      if (r_ >= (warmup)) tm_[r_ - (warmup)] = now_s() - t0_;        \
    }                                                                \
    (result_ms) = 1e3 * median(tm_, n_);                             \
  } while (0)

/* One dtype's run. */
typedef struct single {
  const options_t *o;
  const world_t *w;
  epx_dtype_t dtype;
  int64_t T, H;
  int32_t E, K;
  size_t es;
  /* the copy ceiling: one thread, every core, the better of the two */
  int32_t cores;
  double memcpy_1, memcpy_all, memcpy_gbps;
  /* inputs */
  epx_comm_t comm;
  float *logits;
  void *x, *grad_out;
  /* the route */
  epx_route_config_t rc;
  int32_t *idx, *loc, C;
  float *wt;
  int64_t kept;
  /* the exchange and its outputs */
  epx_buffer_t buf;
  epx_handle_t h;
  int64_t N;
  void *recv_x, *expert_out, *grad_eo, *grad_recv, *out, *grad_x;
  float *grad_w, *grad_logits;
  double ms[NUM_OPS];
  /* where each received row lives in the dense [E, C, H] layout */
  int32_t *src_token, *src_rank, *recv_e;
  int64_t *dense_row, *slot_of, map_bad, mapped;
  int64_t EC;
  size_t rb, dense_bytes;
  /* the dense baselines: one sgemm per einsum, and the library's literal loops */
  void *dense_recv, *dense_eo, *dense_out;
  double dense_ms[2];
  double literal_fma, literal_ms[2];
  void *literal_recv, *literal_out;
  /* --fp8: x quantized on the host, the received rows and scales of
   * epx_dispatch_fp8 [0] and epx_dispatch_quantize [1], and the times of
   * epx_quantize, epx_dispatch_fp8 and epx_dispatch_quantize */
  size_t S; /* scale bytes of a row */
  uint8_t *x_q, *x_s, *fp8_q[2], *fp8_s[2];
  double fp8_ms[3];
} single_t;

/* The ceiling is the better of one thread and every core copying at once:
 * the library may spread a one-rank call over the cores. */
static void single_ceiling(single_t *s) {
  s->cores = (int32_t)sysconf(_SC_NPROCESSORS_ONLN);
  s->memcpy_1 = measure_memcpy(s->w, (size_t)256 << 20, 5);
  s->memcpy_all =
      s->cores > 1 ? measure_memcpy_threads(s->cores, ((size_t)256 << 20) / (size_t)s->cores) : s->memcpy_1;
  s->memcpy_gbps = s->memcpy_all > s->memcpy_1 ? s->memcpy_all : s->memcpy_1;
}

/* x, grad_out [T, H] and logits [T, E]. */
static void single_inputs(single_t *s) {
  const int64_t T = s->T, H = s->H;
  TRY(epx_comm_create_self(&s->comm));
  rng_t rx = rng_make(s->o->seed, 1), rg = rng_make(s->o->seed, 2);
  s->logits = xalloc(sizeof(float) * (size_t)(T * s->E));
  make_logits(s->o, 0, T, s->logits);
  s->x = xalloc(s->es * (size_t)(T * H)), s->grad_out = xalloc(s->es * (size_t)(T * H));
  fill_payload(s->dtype, s->x, T * H, &rx);
  fill_payload(s->dtype, s->grad_out, T * H, &rg);
}

/* The route (capacity mode), timed; C and the routes it kept. */
static void single_route(single_t *s) {
  const int64_t TK = s->T * s->K;
  s->rc = route_config(s->o, 1);
  s->idx = xalloc(sizeof(int32_t) * (size_t)TK), s->loc = xalloc(sizeof(int32_t) * (size_t)TK);
  s->wt = xalloc(sizeof(float) * (size_t)TK);
  epx_route_output_t ro = {s->idx, s->wt, s->loc, NULL, NULL, NULL, 0, 0};
  TIME_MEDIAN(s->ms[OP_ROUTE], s->o->warmup, s->o->iters, TRY(epx_route(&s->rc, s->T, s->logits, NULL, &ro)));
  s->C = ro.capacity;
  s->kept = 0;
  for (int64_t i = 0; i < TK; i++) s->kept += s->idx[i] >= 0;
}

/* The buffer, its layout and every data-movement call, timed; the expert
 * outputs and received gradients are random, the outputs poisoned first. */
static void single_exchange(single_t *s) {
  const options_t *o = s->o;
  const int64_t T = s->T, H = s->H;
  const size_t es = s->es;
  epx_buffer_config_t bc = buffer_config_of(s->dtype, H, s->E, s->K, T, o->layout, s->C);
  bc.fp8_format = o->fp8;
  TRY(epx_buffer_create(s->comm, &bc, &s->buf));
  epx_routing_t routing = {T, s->K, s->idx, s->wt, o->layout == EPX_LAYOUT_CAPACITY ? s->loc : NULL,
                           EPX_WEIGHTS_IN_COMBINE};
  TIME_MEDIAN(s->ms[OP_LAYOUT], o->warmup, o->iters, {
    if (s->h) TRY(epx_handle_release(s->h));
    TRY(epx_dispatch_layout(s->buf, &routing, NULL, &s->h));
  });
  TRY(epx_handle_recv_rows(s->h, &s->N));
  const int64_t N = s->N;
  size_t rows_bytes = es * (size_t)(N + 1) * (size_t)H;
  s->recv_x = xalloc(rows_bytes), s->expert_out = xalloc(rows_bytes), s->grad_eo = xalloc(rows_bytes);
  s->grad_recv = xalloc(rows_bytes), s->out = xalloc(es * (size_t)(T * H)), s->grad_x = xalloc(es * (size_t)(T * H));
  s->grad_w = xalloc(sizeof(float) * (size_t)(T * s->K)), s->grad_logits = xalloc(sizeof(float) * (size_t)(T * s->E));
  rng_t re_ = rng_make(o->seed, 4);
  fill_payload(s->dtype, s->expert_out, N * H, &re_);
  fill_payload(s->dtype, s->grad_recv, N * H, &re_);
  memset(s->recv_x, 0xff, rows_bytes);
  memset(s->out, 0xff, es * (size_t)(T * H));
  memset(s->grad_eo, 0xff, rows_bytes);
  memset(s->grad_x, 0xff, es * (size_t)(T * H));
  memset(s->grad_w, 0xff, sizeof(float) * (size_t)(T * s->K));
  epx_buffer_t buf = s->buf;
  epx_handle_t h = s->h;
  TIME_MEDIAN(s->ms[OP_DISPATCH], o->warmup, o->iters, TRY(epx_dispatch(buf, h, s->x, s->recv_x, N + 1)));
  TIME_MEDIAN(s->ms[OP_COMBINE], o->warmup, o->iters, TRY(epx_combine(buf, h, s->expert_out, s->out)));
  TIME_MEDIAN(s->ms[OP_COMBINE_BWD], o->warmup, o->iters,
              TRY(epx_combine_backward(buf, h, s->grad_out, s->expert_out, s->grad_eo, s->grad_w)));
  TIME_MEDIAN(s->ms[OP_DISPATCH_BWD], o->warmup, o->iters,
              TRY(epx_dispatch_backward(buf, h, s->grad_recv, s->grad_x, NULL, NULL)));
  TIME_MEDIAN(s->ms[OP_ROUTE_BWD], o->warmup, o->iters,
              TRY(epx_route_backward(&s->rc, T, s->logits, NULL, s->idx, s->grad_w, 0.0f, 0.0f, s->grad_logits)));
}

/* --fp8: the host quantizer, then both fp8 dispatches, timed; outputs
 * poisoned first. */
static void single_fp8(single_t *s) {
  const options_t *o = s->o;
  const int64_t T = s->T, H = s->H, N = s->N;
  if (o->fp8 == EPX_FP8_NONE) return;
  int64_t cols;
  TRY(epx_fp8_scale_shape(o->fp8, H, &cols, &s->S));
  s->S *= (size_t)cols;
  s->x_q = xalloc((size_t)(T * H)), s->x_s = xalloc(s->S * (size_t)T);
  for (int i = 0; i < 2; i++) {
    s->fp8_q[i] = xalloc((size_t)((N + 1) * H)), s->fp8_s[i] = xalloc(s->S * (size_t)(N + 1));
    memset(s->fp8_q[i], 0xa5, (size_t)((N + 1) * H));
    memset(s->fp8_s[i], 0xa5, s->S * (size_t)(N + 1));
  }
  TIME_MEDIAN(s->fp8_ms[0], o->warmup, o->iters, TRY(epx_quantize(o->fp8, s->dtype, T, H, s->x, s->x_q, s->x_s)));
  TIME_MEDIAN(s->fp8_ms[1], o->warmup, o->iters,
              TRY(epx_dispatch_fp8(s->buf, s->h, s->x_q, s->x_s, s->fp8_q[0], s->fp8_s[0], N + 1)));
  TIME_MEDIAN(s->fp8_ms[2], o->warmup, o->iters,
              TRY(epx_dispatch_quantize(s->buf, s->h, s->x, s->fp8_q[1], s->fp8_s[1], N + 1)));
}

/* Where each received row lives in the dense [E, C, H] layout (its route's
 * slot, -1 for padding), and the expert outputs placed there. */
static void single_map_rows(single_t *s) {
  const int64_t T = s->T, N = s->N;
  const int32_t K = s->K;
  s->src_token = xalloc(sizeof(int32_t) * (size_t)(N + 1)), s->src_rank = xalloc(sizeof(int32_t) * (size_t)(N + 1));
  s->recv_e = xalloc(sizeof(int32_t) * (size_t)(N + 1));
  s->dense_row = xalloc(sizeof(int64_t) * (size_t)(N + 1)), s->slot_of = xalloc(sizeof(int64_t) * (size_t)(N + 1));
  TRY(epx_handle_recv_source(s->h, s->src_rank, s->src_token));
  TRY(epx_handle_recv_routing(s->h, s->recv_e, NULL));
  s->map_bad = 0, s->mapped = 0;
  for (int64_t r = 0; r < N; r++) {
    s->dense_row[r] = s->slot_of[r] = -1;
    if (s->recv_e[r] < 0) continue;
    int32_t t = s->src_token[r];
    for (int32_t k = 0; t >= 0 && t < T && k < K; k++)
      if (s->idx[t * K + k] == s->recv_e[r]) {
        s->slot_of[r] = t * K + k;
        s->dense_row[r] = (int64_t)s->recv_e[r] * s->C + s->loc[t * K + k];
      }
    if (s->dense_row[r] < 0) s->map_bad++;
    else s->mapped++;
  }
  s->rb = s->es * (size_t)s->H;
  s->EC = (int64_t)s->E * s->C;
  s->dense_bytes = s->es * (size_t)s->EC * (size_t)s->H;
  s->dense_recv = xalloc(s->dense_bytes), s->dense_eo = xalloc(s->dense_bytes);
  s->dense_out = xalloc(s->es * (size_t)(T * s->H));
  memset(s->dense_eo, 0, s->dense_bytes);
  for (int64_t r = 0; r < N; r++)
    if (s->dense_row[r] >= 0)
      memcpy((char *)s->dense_eo + (size_t)s->dense_row[r] * s->rb, (char *)s->expert_out + (size_t)r * s->rb, s->rb);
}

/* The dense one-hot baseline at the same shape, as a framework runs it: the
 * [T, E*C] mask in float32 and one OpenBLAS sgemm per einsum (sec,sm->ecm and
 * sec,ecm->sm), dtype conversions included, the mask built outside the
 * timer. One timed run each: 2*T*E*C*H flops apiece. */
static void single_dense_baseline(single_t *s) {
  const int64_t T = s->T, H = s->H, EC = s->EC, K = s->K, C = s->C;
  progress_t prog = {now_s(), 0.0};
  progress_note(s->w, &prog, "dense baseline");
  float *mask = xalloc(sizeof(float) * (size_t)T * (size_t)EC);
  float *dense_in_f = xalloc(sizeof(float) * (size_t)EC * (size_t)H), *dense_tok_f = xalloc(sizeof(float) * (size_t)(T * H));
  memset(mask, 0, sizeof(float) * (size_t)T * (size_t)EC);
  for (int64_t i = 0; i < T * K; i++)
    if (s->idx[i] >= 0) mask[(size_t)(i / K) * (size_t)EC + (size_t)s->idx[i] * (size_t)C + (size_t)s->loc[i]] = 1.0f;
  fprintf(stderr, "epx-bench: %s: dense one-hot baseline, 2 sgemm of %.0f GFLOP\n", dtype_name(s->dtype),
          2.0 * (double)T * (double)EC * (double)H / 1e9);
  double t0 = now_s();
  TRY(epx_convert(EPX_FLOAT32, dense_tok_f, s->dtype, s->x, T * H));
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)EC, (int)H, (int)T, 1.0f, mask, (int)EC, dense_tok_f,
              (int)H, 0.0f, dense_in_f, (int)H);
  TRY(epx_convert(s->dtype, s->dense_recv, EPX_FLOAT32, dense_in_f, EC * H));
  s->dense_ms[0] = 1e3 * (now_s() - t0);
  for (int64_t i = 0; i < T * K; i++)
    if (s->idx[i] >= 0) mask[(size_t)(i / K) * (size_t)EC + (size_t)s->idx[i] * (size_t)C + (size_t)s->loc[i]] = s->wt[i];
  t0 = now_s();
  TRY(epx_convert(EPX_FLOAT32, dense_in_f, s->dtype, s->dense_eo, EC * H));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)H, (int)EC, 1.0f, mask, (int)EC, dense_in_f,
              (int)H, 0.0f, dense_tok_f, (int)H);
  TRY(epx_convert(s->dtype, s->dense_out, EPX_FLOAT32, dense_tok_f, T * H));
  s->dense_ms[1] = 1e3 * (now_s() - t0);
  free(mask);
  free(dense_in_f);
  free(dense_tok_f);
}

/* The library's own dense reference (the literal einsum loops, a pass over
 * the input per output slot) where it finishes in seconds. */
static void single_literal(single_t *s) {
  const int64_t T = s->T, H = s->H;
  s->literal_fma = (double)T * (double)s->EC * (double)H;
  if (s->literal_fma > 2e9) return;
  s->literal_recv = xalloc(s->dense_bytes);
  s->literal_out = xalloc(s->es * (size_t)(T * H));
  double t0 = now_s();
  TRY(epx_reference_dense_dispatch(s->dtype, T, H, s->E, s->C, s->K, s->idx, s->wt, s->loc, EPX_WEIGHTS_IN_COMBINE,
                                   s->x, s->literal_recv));
  s->literal_ms[0] = 1e3 * (now_s() - t0);
  t0 = now_s();
  TRY(epx_reference_dense_combine(s->dtype, T, H, s->E, s->C, s->K, s->idx, s->wt, s->loc, EPX_WEIGHTS_IN_COMBINE,
                                  s->dense_eo, s->literal_out));
  s->literal_ms[1] = 1e3 * (now_s() - t0);
}

/* The table, the targets and the baselines. */
static void single_report(const single_t *s) {
  const options_t *o = s->o;
  const int64_t T = s->T, H = s->H, N = s->N;
  const int32_t E = s->E, K = s->K;
  const double *ms = s->ms, memcpy_gbps = s->memcpy_gbps;
  /* Bytes each op must move: every input read once, every output written once. */
  const double hb = (double)H * (double)s->es, Td = (double)T, Nd = (double)N;
  double bytes[NUM_OPS] = {Td * (E * 4.0 + K * 12.0), Td * K * 8.0, (Td + Nd) * hb, (Nd + Td) * hb,
                           (Td + 2.0 * Nd) * hb, (Nd + Td) * hb, Td * (E * 8.0 + K * 8.0)};

  printf("single rank, %s: T=%lld H=%lld E=%d top-%d capacity %d (factor %.2f, %lld of %lld routes kept), layout %s, "
         "%lld recv rows; memcpy ceiling %.2f GB/s (read+write; 1 thread %.2f, %d threads %.2f)\n",
         dtype_name(s->dtype), (long long)T, (long long)H, (int)E, (int)K, (int)s->C, o->capacity_factor,
         (long long)s->kept, (long long)(T * K), layout_name(o->layout), (long long)N, memcpy_gbps, s->memcpy_1,
         (int)s->cores, s->memcpy_all);
  if (o->csv) printf("op,dtype,time_ms,bytes,gbps,of_memcpy,dense_ms,speedup\n");
  else
    printf("%-18s %10s %10s %8s %9s %10s %8s\n", "op", "time_ms", "MB", "GB/s", "of_memcpy", "dense_ms", "speedup");
  for (int op = 0; op < NUM_OPS; op++) {
    double gbps = bytes[op] / (ms[op] * 1e-3) / 1e9;
    double dms = op == OP_DISPATCH ? s->dense_ms[0] : op == OP_COMBINE ? s->dense_ms[1] : 0.0;
    if (o->csv) {
      printf("%s,%s,%.4f,%.0f,%.3f,%.4f,%.3f,%.2f\n", op_names[op], dtype_name(s->dtype), ms[op], bytes[op], gbps,
             gbps / memcpy_gbps, dms, dms > 0 ? dms / ms[op] : 0.0);
      continue;
    }
    char d_s[32] = "-", s_s[32] = "-";
    if (dms > 0) {
      snprintf(d_s, sizeof d_s, "%.2f", dms);
      snprintf(s_s, sizeof s_s, "%.1fx", dms / ms[op]);
    }
    printf("%-18s %10.3f %10.1f %8.2f %9.2f %10s %8s\n", op_names[op], ms[op], bytes[op] / 1e6, gbps,
           gbps / memcpy_gbps, d_s, s_s);
  }
  for (int op = OP_DISPATCH; op <= OP_DISPATCH_BWD; op++) {
    double frac = bytes[op] / (ms[op] * 1e-3) / 1e9 / memcpy_gbps;
    printf("target %-18s >= 60%% of memcpy: %3.0f%%: %s", op_names[op], 100.0 * frac, frac >= 0.6 ? "met" : "missed");
    if (op == OP_DISPATCH || op == OP_COMBINE) {
      double sp = (op == OP_DISPATCH ? s->dense_ms[0] : s->dense_ms[1]) / ms[op];
      printf("; >= 20x dense: %.1fx: %s", sp, sp >= 20.0 ? "met" : "missed");
    }
    printf("\n");
  }
  if (o->fp8 != EPX_FP8_NONE) {
    /* bytes: x read once (T rows of the dtype, or of fp8 and scales) and N
     * rows of fp8 and scales written; the host quantizer T rows each way */
    const double fb = (double)H + (double)s->S;
    const double fbytes[3] = {Td * hb + Td * fb, (Td + Nd) * fb, Td * hb + Nd * fb};
    const char *names[3] = {"fp8 quantize(host)", "dispatch_fp8", "dispatch_quantize"};
    printf("fp8 %s (rows of H bytes and %zu scale bytes each; against the %s dispatch above):\n",
           fp8_name(o->fp8), s->S, dtype_name(s->dtype));
    for (int i = 0; i < 3; i++) {
      const double gbps = fbytes[i] / (s->fp8_ms[i] * 1e-3) / 1e9;
      if (o->csv) printf("%s,%s,%.4f,%.0f,%.3f,%.4f,0,0\n", names[i], dtype_name(s->dtype), s->fp8_ms[i], fbytes[i],
                         gbps, gbps / memcpy_gbps);
      else printf("%-18s %10.3f %10.1f %8.2f %9.2f %10s %8s\n", names[i], s->fp8_ms[i], fbytes[i] / 1e6, gbps,
                  gbps / memcpy_gbps, "-", "-");
    }
    printf("fp8 %s: dispatch_fp8 / %s dispatch time %.3f (bytes %.3f); dispatch_quantize / (epx_quantize + "
           "dispatch_fp8) %.3f\n",
           fp8_name(o->fp8), dtype_name(s->dtype), s->fp8_ms[1] / ms[OP_DISPATCH], (Td + Nd) * fb / bytes[OP_DISPATCH],
           s->fp8_ms[2] / (s->fp8_ms[0] + s->fp8_ms[1]));
  }
  printf("dense one-hot baseline: [T, E*C] float32 mask, one OpenBLAS sgemm per einsum (%d threads), "
         "conversions included: dispatch %.1f ms, combine %.1f ms\n",
         openblas_get_num_threads(), s->dense_ms[0], s->dense_ms[1]);
  if (s->literal_recv)
    printf("epx_reference_dense_dispatch/combine (the literal loops): dispatch %.1f ms (%.1fx epx), combine %.1f ms "
           "(%.1fx epx)\n",
           s->literal_ms[0], s->literal_ms[0] / ms[OP_DISPATCH], s->literal_ms[1], s->literal_ms[1] / ms[OP_COMBINE]);
  else
    printf("epx_reference_dense_dispatch/combine (the literal loops): not run, T*E*C*H = %.2g multiply-adds with a "
           "pass over the input per slot is hours at this shape\n",
           s->literal_fma);
}

/* route against the library's float64 reference route. */
static int single_check_route(const single_t *s) {
  const int64_t T = s->T, TK = s->T * s->K;
  int32_t *ridx = xalloc(sizeof(int32_t) * (size_t)TK);
  float *rw = xalloc(sizeof(float) * (size_t)TK);
  int32_t rC = 0;
  ref_route(s->o, 1, T, s->logits, ridx, rw, &rC);
  int ok = report_count(s->w, "route capacity", rC != s->C, 1);
  int64_t bad = 0;
  for (int64_t i = 0; i < TK; i++) bad += ridx[i] != s->idx[i];
  ok &= report_count(s->w, "route topk_idx", bad, TK);
  ok &= report_compare(s->w, "route topk_w", compare_f32(s->wt, rw, TK, tolerance_of(EPX_FLOAT32)),
                       tolerance_of(EPX_FLOAT32));
  free(ridx);
  free(rw);
  return ok;
}

/* dispatch: every received row is its token's x, as in the dense layout;
 * combine against the dense combines (dof: [T, H] float scratch). */
static int single_check_forward(const single_t *s, float *dof) {
  const int64_t T = s->T, H = s->H, N = s->N, EC = s->EC;
  const size_t rb = s->rb;
  const tolerance_t tol = tolerance_of(s->dtype);
  int ok = report_count(s->w, "recv rows map to kept routes", s->map_bad + (s->mapped != s->kept), N + 1);
  int64_t rows_bad = 0;
  for (int64_t r = 0; r < N; r++)
    if (s->dense_row[r] >= 0)
      rows_bad += memcmp((char *)s->recv_x + (size_t)r * rb, (char *)s->x + (size_t)s->src_token[r] * rb, rb) != 0 ||
                  memcmp((char *)s->recv_x + (size_t)r * rb, (char *)s->dense_recv + (size_t)s->dense_row[r] * rb, rb) != 0;
  ok &= report_count(s->w, "dispatch rows == x == dense", rows_bad, N);
  if (s->literal_recv)
    ok &= report_count(s->w, "dense sgemm == epx_reference_dense",
                       count_diff_bytes(s->dense_recv, s->literal_recv, EC * H, s->es), EC * H);
  TRY(epx_convert(EPX_FLOAT32, dof, s->dtype, s->dense_out, T * H));
  ok &= report_compare(s->w, "combine == dense sgemm", compare_payload(s->dtype, s->out, dof, T * H, tol), tol);
  if (s->literal_out) {
    TRY(epx_convert(EPX_FLOAT32, dof, s->dtype, s->literal_out, T * H));
    ok &= report_compare(s->w, "combine == epx_reference_dense", compare_payload(s->dtype, s->out, dof, T * H, tol),
                         tol);
  }
  return ok;
}

/* combine_backward: row (t,k) = w * grad_out[t]; grad_w = <grad_out[t],
 * expert_out(t,k)>. dispatch_backward: grad_x[t] = sum of its rows'
 * gradients. route_backward against the reference. */
static int single_check_backward(const single_t *s, float *dof) {
  const int64_t T = s->T, H = s->H, N = s->N, K = s->K, E = s->E;
  const size_t rb = s->rb;
  const epx_dtype_t dtype = s->dtype;
  const tolerance_t tol = tolerance_of(dtype);
  float *gf = xalloc(sizeof(float) * (size_t)(T * H)), *row = xalloc(sizeof(float) * (size_t)H);
  float *exp_geo = xalloc(sizeof(float) * (size_t)(N + 1) * (size_t)H), *exp_gw = xalloc(sizeof(float) * (size_t)(T * K));
  float *rgl = xalloc(sizeof(float) * (size_t)(T * E));
  TRY(epx_convert(EPX_FLOAT32, gf, dtype, s->grad_out, T * H));
  for (int64_t i = 0; i < T * K; i++) exp_gw[i] = 0.0f;
  for (int64_t r = 0; r < N; r++) {
    float *eg = exp_geo + r * H;
    if (s->slot_of[r] < 0) {
      memset(eg, 0, sizeof(float) * (size_t)H);
      continue;
    }
    const float *g = gf + s->slot_of[r] / K * H;
    TRY(epx_convert(EPX_FLOAT32, row, dtype, (char *)s->expert_out + (size_t)r * rb, H));
    double dot = 0.0;
    for (int64_t i = 0; i < H; i++) {
      eg[i] = s->wt[s->slot_of[r]] * g[i];
      dot += (double)g[i] * row[i];
    }
    exp_gw[s->slot_of[r]] = (float)dot;
  }
  int ok = report_compare(s->w, "combine_backward grad_expert_out",
                          compare_payload(dtype, s->grad_eo, exp_geo, N * H, tol), tol);
  ok &= report_compare(s->w, "combine_backward grad_w", compare_f32(s->grad_w, exp_gw, T * K, tol), tol);
  memset(dof, 0, sizeof(float) * (size_t)(T * H));
  for (int64_t r = 0; r < N; r++) {
    if (s->slot_of[r] < 0) continue;
    TRY(epx_convert(EPX_FLOAT32, row, dtype, (char *)s->grad_recv + (size_t)r * rb, H));
    float *gx = dof + s->slot_of[r] / K * H;
    for (int64_t i = 0; i < H; i++) gx[i] += row[i];
  }
  ok &= report_compare(s->w, "dispatch_backward grad_x", compare_payload(dtype, s->grad_x, dof, T * H, tol), tol);
  ref_route_backward(s->o, 1, T, s->logits, s->idx, s->grad_w, rgl);
  ok &= report_compare(s->w, "route_backward grad_logits", compare_f32(s->grad_logits, rgl, T * E, tol), tol);
  free(gf);
  free(row);
  free(exp_geo);
  free(exp_gw);
  free(rgl);
  return ok;
}

/* --fp8: each received row of both fp8 dispatches is its source token's
 * quantized row and scales (epx_quantize's bytes), padding rows zero, and
 * the two dispatches agree byte for byte. */
static int single_check_fp8(const single_t *s) {
  const int64_t H = s->H, N = s->N;
  const size_t S = s->S, Hz = (size_t)H;
  int64_t bad[2] = {0, 0}, padding_bad = 0;
  for (int i = 0; i < 2; i++)
    for (int64_t r = 0; r < N; r++) {
      const uint8_t *q = s->fp8_q[i] + (size_t)r * Hz, *sc = s->fp8_s[i] + (size_t)r * S;
      if (s->dense_row[r] >= 0) {
        const int64_t t = s->src_token[r];
        bad[i] += memcmp(q, s->x_q + (size_t)t * Hz, Hz) != 0 || memcmp(sc, s->x_s + (size_t)t * S, S) != 0;
      } else {
        int nonzero = 0;
        for (size_t j = 0; j < Hz; j++) nonzero |= q[j];
        for (size_t j = 0; j < S; j++) nonzero |= sc[j];
        padding_bad += nonzero != 0;
      }
    }
  int ok = report_count(s->w, "dispatch_fp8 rows == epx_quantize(x) of their token", bad[0], N);
  ok &= report_count(s->w, "dispatch_quantize rows == epx_quantize(x) of their token", bad[1], N);
  ok &= report_count(s->w, "fp8 padding rows zero", padding_bad, 2 * N);
  return ok;
}

static int single_check(const single_t *s) {
  int ok = single_check_route(s);
  if (s->o->fp8 != EPX_FP8_NONE) ok &= single_check_fp8(s);
  float *dof = xalloc(sizeof(float) * (size_t)(s->T * s->H));
  ok &= single_check_forward(s, dof);
  ok &= single_check_backward(s, dof);
  free(dof);
  return ok;
}

static void single_free(single_t *s) {
  TRY(epx_handle_release(s->h));
  TRY(epx_buffer_destroy(s->buf));
  TRY(epx_comm_destroy(s->comm));
  void *arrays[] = {s->logits,     s->x,           s->grad_out,  s->idx,          s->loc,          s->wt,
                    s->recv_x,     s->expert_out,  s->grad_eo,   s->grad_recv,    s->out,          s->grad_x,
                    s->grad_w,     s->grad_logits, s->dense_recv, s->dense_eo,    s->dense_out,    s->literal_recv,
                    s->literal_out, s->src_token,  s->src_rank,  s->recv_e,       s->dense_row,    s->slot_of,
                    s->x_q,         s->x_s,         s->fp8_q[0],  s->fp8_s[0],     s->fp8_q[1],     s->fp8_s[1]};
  for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) free(arrays[i]);
}

int single_run(const options_t *o, epx_dtype_t dtype, const world_t *w) {
  single_t s;
  memset(&s, 0, sizeof s);
  s.o = o, s.w = w, s.dtype = dtype;
  s.T = o->tokens, s.H = o->hidden, s.E = o->experts, s.K = o->topk;
  s.es = epx_dtype_size(dtype);
  single_ceiling(&s);
  single_inputs(&s);
  single_route(&s);
  single_exchange(&s);
  single_fp8(&s);
  single_map_rows(&s);
  single_dense_baseline(&s);
  single_literal(&s);
  single_report(&s);
  int ok = o->check ? single_check(&s) : 1;
  fflush(stdout);
  single_free(&s);
  return ok;
}
