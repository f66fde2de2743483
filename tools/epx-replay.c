/*
 * epx-replay — routing traces through any exchange, rows counted by link.
 *
 * It replays a routing trace (per step, per layer, each rank's topk_idx)
 * through the dedup, collective and hierarchical exchanges (--exchange) on W
 * ranks (threads of this process, posed as nodes of --ranks-per-node ranks;
 * or, under mpirun, one MPI process per rank), moving rows of --hidden
 * channels: per step it reports the time of every layer's layout, dispatch
 * and combine (the slowest rank's), the dispatch rows' bytes by link class
 * (inside a node, across nodes; summed over ranks; combine sends as many
 * back) and the skew (the most rows any rank received over the mean). Each
 * exchange's outputs are compared bit for bit with the first's; the last
 * line is OK or FAILED and the exit status matches.
 *
 * --redundant R1,R2,... replays the trace on planned placements too (epx.h,
 * "Expert placement and replicas"): per layer, epx_placement_plan from the
 * layer's load over the whole trace (routes per logical expert), node-aware
 * over the --ranks-per-node nodes (8 expert groups for dsv3, else 1), with
 * R redundant experts and the round-robin replica rule. For the contiguous
 * map and each R it reports the rank-load skew (max over mean of routes
 * per rank): expected (the planner's model) and measured (the trace's
 * routes through the rule), and the replay's times per step.
 *
 * Without --trace it makes one (--gen): uniform, zipf (expert popularity
 * 1/i^s, shuffled per layer), hot (--hot experts take --hot-share of the
 * picks) or dsv3 (the DeepSeek-V3 router through epx_route: 256 experts,
 * sigmoid scores, 8 groups, the best 4 by their top-2 sum, top-8, over
 * normal logits with a per-layer expert bias). --record FILE writes the trace
 * it replays.
 *
 * The trace file (little-endian):
 *   char magic[8] = "EPXTRACE"; uint32 version = 1;
 *   uint32 ranks, layers, steps, experts, top_k; uint64 max_tokens;
 *   then for each step, each layer, each rank r:
 *     uint32 T_r (<= max_tokens), int32 topk_idx[T_r][top_k] (-1: no expert).
 * Any program that routes can write it (each rank's topk_idx per layer and
 * step, gathered in rank order); epx-bench --record-trace FILE writes its
 * run's routing (one layer, one step).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <epx.h>
#if EPX_TOOLS_HAVE_MPI
#include <mpi.h>
#endif

/* ------------------------------------------------------------------------ */
/* Options and the trace                                                     */
/* ------------------------------------------------------------------------ */

typedef struct {
  const char *trace, *record, *gen;
  int32_t ranks, ranks_per_node, layers, steps, experts, topk, hot, iters, mpi;
  int64_t tokens, hidden;
  double zipf, hot_share;
  epx_dtype_t dtype;
  int exchanges[3], n_exchanges;
  int32_t redundant[8], n_redundant; /* --redundant: placements to plan */
  uint64_t seed;
} options_t;

typedef struct {
  int32_t W, layers, steps, E, K;
  int64_t T;
  uint32_t *tokens; /* [steps, layers, W] */
  int32_t *idx;     /* [steps, layers, W, T, K] */
} trace_t;

static void fatal(const char *fmt, const char *arg) {
  fprintf(stderr, "epx-replay: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\n");
  exit(2);
}

static void *xalloc(size_t bytes) {
  void *p = calloc(bytes ? bytes : 1, 1);
  if (!p) fatal("out of memory%s", "");
  return p;
}

static int32_t *trace_row(const trace_t *t, int32_t step, int32_t layer, int32_t rank) {
  return t->idx + ((((size_t)step * t->layers + layer) * t->W + rank) * (size_t)t->T * t->K);
}
static uint32_t *trace_count(const trace_t *t, int32_t step, int32_t layer, int32_t rank) {
  return t->tokens + ((size_t)step * t->layers + layer) * t->W + rank;
}

static void trace_alloc(trace_t *t) {
  t->tokens = xalloc(sizeof(uint32_t) * (size_t)t->steps * t->layers * t->W);
  t->idx = xalloc(sizeof(int32_t) * (size_t)t->steps * t->layers * t->W * (size_t)t->T * t->K);
}

static void trace_write(const trace_t *t, const char *path) {
  FILE *f = fopen(path, "wb");
  if (!f) fatal("cannot write %s", path);
  uint32_t head[6] = {1, (uint32_t)t->W, (uint32_t)t->layers, (uint32_t)t->steps, (uint32_t)t->E, (uint32_t)t->K};
  uint64_t T = (uint64_t)t->T;
  int ok = fwrite("EPXTRACE", 1, 8, f) == 8 && fwrite(head, sizeof head, 1, f) == 1 && fwrite(&T, 8, 1, f) == 1;
  for (int32_t s = 0; s < t->steps && ok; s++)
    for (int32_t l = 0; l < t->layers && ok; l++)
      for (int32_t r = 0; r < t->W && ok; r++) {
        uint32_t n = *trace_count(t, s, l, r);
        ok = fwrite(&n, 4, 1, f) == 1 && fwrite(trace_row(t, s, l, r), sizeof(int32_t) * t->K, n, f) == n;
      }
  if (fclose(f) || !ok) fatal("writing %s failed", path);
}

static void trace_read(trace_t *t, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) fatal("cannot read %s", path);
  char magic[8];
  uint32_t head[6];
  uint64_t T;
  if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "EPXTRACE", 8) || fread(head, sizeof head, 1, f) != 1 ||
      fread(&T, 8, 1, f) != 1 || head[0] != 1)
    fatal("%s is not an epx trace (version 1)", path);
  *t = (trace_t){(int32_t)head[1], (int32_t)head[2], (int32_t)head[3], (int32_t)head[4], (int32_t)head[5], (int64_t)T, NULL, NULL};
  if (t->W < 1 || t->layers < 1 || t->steps < 1 || t->K < 1 || t->K > t->E || T > (1u << 24))
    fatal("%s: a header out of range", path);
  trace_alloc(t);
  for (int32_t s = 0; s < t->steps; s++)
    for (int32_t l = 0; l < t->layers; l++)
      for (int32_t r = 0; r < t->W; r++) {
        uint32_t *n = trace_count(t, s, l, r);
        if (fread(n, 4, 1, f) != 1 || *n > T || fread(trace_row(t, s, l, r), sizeof(int32_t) * t->K, *n, f) != *n)
          fatal("%s is truncated or corrupt", path);
        for (size_t i = 0; i < (size_t)*n * t->K; i++)
          if (trace_row(t, s, l, r)[i] < -1 || trace_row(t, s, l, r)[i] >= t->E) fatal("%s: an expert id out of range", path);
      }
  fclose(f);
}

/* ------------------------------------------------------------------------ */
/* Generators                                                                */
/* ------------------------------------------------------------------------ */

static uint64_t next(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double uniform(uint64_t *s) { return (double)(next(s) >> 11) * 0x1.0p-53; }
static float normal(uint64_t *s) {
  double u = uniform(s) + 1e-12, v = uniform(s);
  return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* K distinct experts drawn from the popularity weights p [E] (cumulative). */
static void draw_token(const double *cdf, int32_t E, int32_t K, uint64_t *s, int32_t *out) {
  for (int32_t k = 0; k < K; k++) {
    for (;;) {
      double u = uniform(s) * cdf[E - 1];
      int32_t lo = 0, hi = E - 1;
      while (lo < hi) {
        int32_t mid = (lo + hi) / 2;
        if (cdf[mid] > u) hi = mid;
        else lo = mid + 1;
      }
      int dup = 0;
      for (int32_t j = 0; j < k; j++) dup |= out[j] == lo;
      if (!dup) {
        out[k] = lo;
        break;
      }
    }
  }
}

/* The popularity of each expert in one layer, as a cumulative sum. */
static void layer_cdf(const options_t *o, uint64_t *s, double *cdf) {
  int32_t E = o->experts;
  int32_t *perm = xalloc(sizeof(int32_t) * (size_t)E);
  for (int32_t e = 0; e < E; e++) perm[e] = e;
  for (int32_t e = E - 1; e > 0; e--) {
    int32_t j = (int32_t)(next(s) % (uint64_t)(e + 1)), x = perm[e];
    perm[e] = perm[j], perm[j] = x;
  }
  double sum = 0, hot_w = o->hot_share / (o->hot > 0 ? o->hot : 1), cold_w = (1 - o->hot_share) / (E - o->hot > 0 ? E - o->hot : 1);
  for (int32_t e = 0; e < E; e++) {
    int32_t i = perm[e];
    double w = 1.0;
    if (!strcmp(o->gen, "zipf")) w = pow(1.0 + i, -o->zipf);
    else if (!strcmp(o->gen, "hot")) w = i < o->hot ? hot_w : cold_w;
    cdf[e] = sum += w;
  }
  free(perm);
}

/* The DeepSeek-V3 router on normal logits plus a per-layer expert bias. */
static void dsv3_layer(uint64_t *s, trace_t *t, int32_t step, int32_t layer, const float *bias) {
  epx_route_config_t c = EPX_ROUTE_CONFIG_INIT;
  c.num_experts = 256, c.top_k = 8, c.score_fn = EPX_SCORE_SIGMOID;
  c.num_groups = 8, c.topk_groups = 4, c.renormalize = 1;
  float *logits = xalloc(sizeof(float) * (size_t)t->T * 256), *w = xalloc(sizeof(float) * (size_t)t->T * 8);
  for (int32_t r = 0; r < t->W; r++) {
    for (int64_t i = 0; i < t->T * 256; i++) logits[i] = normal(s) + bias[i % 256];
    epx_route_output_t out = {0};
    out.topk_idx = trace_row(t, step, layer, r);
    out.topk_w = w;
    if (epx_route(&c, t->T, logits, NULL, &out) != EPX_SUCCESS) fatal("epx_route: %s", epx_last_error());
    *trace_count(t, step, layer, r) = (uint32_t)t->T;
  }
  free(logits), free(w);
}

static void generate(const options_t *o, trace_t *t) {
  int dsv3 = !strcmp(o->gen, "dsv3");
  *t = (trace_t){o->ranks, o->layers, o->steps, dsv3 ? 256 : o->experts, dsv3 ? 8 : o->topk, o->tokens, NULL, NULL};
  trace_alloc(t);
  uint64_t s = o->seed;
  double *cdf = xalloc(sizeof(double) * (size_t)t->E);
  float *bias = xalloc(sizeof(float) * 256);
  for (int32_t l = 0; l < t->layers; l++) {
    /* A layer keeps its popularity over the steps, as a trained router does. */
    uint64_t layer_seed = o->seed * 7919u + (uint64_t)l;
    if (dsv3) for (int32_t e = 0; e < 256; e++) bias[e] = 0.5f * normal(&layer_seed);
    else layer_cdf(o, &layer_seed, cdf);
    for (int32_t st = 0; st < t->steps; st++) {
      if (dsv3) {
        dsv3_layer(&s, t, st, l, bias);
        continue;
      }
      for (int32_t r = 0; r < t->W; r++) {
        *trace_count(t, st, l, r) = (uint32_t)t->T;
        for (int64_t i = 0; i < t->T; i++) draw_token(cdf, t->E, t->K, &s, trace_row(t, st, l, r) + i * t->K);
      }
    }
  }
  free(cdf), free(bias);
}

/* ------------------------------------------------------------------------ */
/* Replay                                                                    */
/* ------------------------------------------------------------------------ */

static const char *const exchange_names[] = {"dedup", "collective", "hierarchical"};

/* What a rank reports per step of one exchange. */
typedef struct {
  double seconds, dispatch_seconds;
  double same_bytes, other_bytes, recv_rows;
  uint64_t hash;
} step_report_t;

/* The placements replayed: the contiguous map, then one per --redundant. */
typedef struct {
  int32_t redundant; /* -1: the contiguous map */
  int32_t P;
  int32_t *p2l;      /* [layers, P] (NULL for the contiguous map) */
} placement_plan_t;

typedef struct {
  const options_t *o;
  const trace_t *t;
  int32_t n_place;
  placement_plan_t *place;
  step_report_t *reports; /* [placements, exchanges, steps, W] (threads: shared) */
  int failed;
} job_t;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
  return h;
}

#define TRY(call)                                                                        \
  do {                                                                                   \
    if ((call) != EPX_SUCCESS) {                                                         \
      fprintf(stderr, "epx-replay: %s: %s\n", #call, epx_last_error());                  \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

/* One step of every layer on one rank: layout, dispatch, the identity expert,
 * combine; its report (time from a barrier, bytes, rows, the outputs' hash). */
static step_report_t rank_step(epx_comm_t comm, epx_buffer_t *buffers, const trace_t *t, int32_t step, int32_t rank,
                               const void *x, void *recv, void *out, float *w, size_t row) {
  step_report_t rep = {0};
  rep.hash = 1469598103934665603ull;
  TRY(epx_comm_barrier(comm));
  double start = now();
  for (int32_t l = 0; l < t->layers; l++) {
    epx_buffer_t b = buffers[l];
    int64_t T = *trace_count(t, step, l, rank);
    epx_routing_t routing = {T, t->K, trace_row(t, step, l, rank), w, NULL, EPX_WEIGHTS_IN_COMBINE};
    epx_handle_t h;
    int64_t n;
    epx_handle_traffic_t traffic;
    TRY(epx_dispatch_layout(b, &routing, NULL, &h));
    TRY(epx_handle_recv_rows(h, &n));
    double dispatch_start = now();
    TRY(epx_dispatch(b, h, x, recv, n));
    rep.dispatch_seconds += now() - dispatch_start;
    TRY(epx_combine(b, h, recv, out));
    TRY(epx_handle_traffic(h, &traffic));
    TRY(epx_handle_release(h));
    rep.same_bytes += (double)traffic.same_node_bytes;
    rep.other_bytes += (double)traffic.other_node_bytes;
    rep.recv_rows += (double)n;
    rep.hash = hash_bytes(rep.hash, out, (size_t)T * row);
  }
  rep.seconds = now() - start;
  return rep;
}

static void rank_main(job_t *job, epx_comm_t comm, int32_t rank) {
  const options_t *o = job->o;
  const trace_t *t = job->t;
  size_t row = (size_t)o->hidden * (o->dtype == EPX_FLOAT32 ? 4 : 2);
  int64_t max_recv = t->T * t->W * t->K;
  epx_buffer_t *buffers = xalloc(sizeof(epx_buffer_t) * (size_t)t->layers);
  void *x = xalloc((size_t)t->T * row), *recv = xalloc((size_t)(max_recv + 1) * row), *out = xalloc((size_t)t->T * row);
  float *w = xalloc(sizeof(float) * (size_t)t->T * t->K);
  uint64_t s = o->seed + 1000u * (uint64_t)rank;
  for (int64_t i = 0; i < t->T * o->hidden; i++) {
    float v = normal(&s);
    if (o->dtype == EPX_FLOAT32) ((float *)x)[i] = v;
    else {
      uint32_t bits;
      memcpy(&bits, &v, 4);
      ((uint16_t *)x)[i] = (uint16_t)(bits >> 16);
    }
  }
  for (int64_t i = 0; i < t->T * t->K; i++) w[i] = 0.25f + 0.5f * (float)uniform(&s);
  for (int32_t pi = 0; pi < job->n_place; pi++)
    for (int xi = 0; xi < o->n_exchanges; xi++) {
      const placement_plan_t *pp = &job->place[pi];
      for (int32_t l = 0; l < t->layers; l++) {
        epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
        c.dtype = o->dtype, c.hidden = o->hidden, c.num_experts = t->E, c.max_top_k = t->K;
        c.max_tokens_per_rank = t->T, c.exchange = (epx_exchange_t)o->exchanges[xi];
        c.combine_precision = EPX_COMBINE_PARTIALS_PAYLOAD; /* a partial costs one row, as DeepEP's */
        epx_placement_t placement = {pp->P, pp->p2l ? pp->p2l + (size_t)l * pp->P : NULL, NULL,
                                     EPX_REPLICA_ROUND_ROBIN};
        c.placement = pp->p2l ? &placement : NULL;
        TRY(epx_buffer_create(comm, &c, &buffers[l]));
      }
      for (int32_t st = 0; st < t->steps; st++) {
        step_report_t best = {0};
        for (int32_t it = 0; it < o->iters; it++) {
          step_report_t r = rank_step(comm, buffers, t, st, rank, x, recv, out, w, row);
          if (it == 0 || r.seconds < best.seconds) best = r;
        }
        step_report_t *all = job->reports + (((size_t)pi * o->n_exchanges + xi) * t->steps + st) * t->W;
        TRY(epx_comm_allgather(comm, &best, all, sizeof best));
      }
      for (int32_t l = 0; l < t->layers; l++) TRY(epx_buffer_destroy(buffers[l]));
    }
  free(x), free(recv), free(out), free(w), free(buffers);
}

/* ------------------------------------------------------------------------ */
/* Placements: planned per layer from the trace's load, and their skew       */
/* ------------------------------------------------------------------------ */

/* Routes per logical expert of one layer over the whole trace. */
static void layer_load(const trace_t *t, int32_t layer, double *load) {
  for (int32_t e = 0; e < t->E; e++) load[e] = 0;
  for (int32_t st = 0; st < t->steps; st++)
    for (int32_t r = 0; r < t->W; r++) {
      const int32_t *idx = trace_row(t, st, layer, r);
      for (size_t i = 0; i < (size_t)*trace_count(t, st, layer, r) * t->K; i++)
        if (idx[i] >= 0) load[idx[i]] += 1;
    }
}

static void plan_placements(job_t *job) {
  const options_t *o = job->o;
  const trace_t *t = job->t;
  job->n_place = 1 + o->n_redundant;
  job->place = xalloc(sizeof(placement_plan_t) * (size_t)job->n_place);
  job->place[0] = (placement_plan_t){-1, t->E, NULL};
  double *load = xalloc(sizeof(double) * (size_t)t->E);
  int32_t groups = t->E == 256 && t->K == 8 ? 8 : 1;
  for (int32_t i = 0; i < o->n_redundant; i++) {
    placement_plan_t *pp = &job->place[1 + i];
    *pp = (placement_plan_t){o->redundant[i], t->E + o->redundant[i], NULL};
    pp->p2l = xalloc(sizeof(int32_t) * (size_t)t->layers * pp->P);
    for (int32_t l = 0; l < t->layers; l++) {
      layer_load(t, l, load);
      TRY(epx_placement_plan(load, t->E, pp->P, t->W, t->W / o->ranks_per_node, groups, pp->p2l + (size_t)l * pp->P));
    }
  }
  free(load);
}

/* Skews of a placement, averaged over the layers (expected) and over the
 * layers and steps (measured: each route through the round-robin rule). */
static void placement_skew(const job_t *job, const placement_plan_t *pp, double *expected, double *measured) {
  const trace_t *t = job->t;
  double *load = xalloc(sizeof(double) * (size_t)t->E), *rank_load = xalloc(sizeof(double) * (size_t)t->W);
  *expected = *measured = 0;
  for (int32_t l = 0; l < t->layers; l++) {
    epx_placement_t placement = {pp->P, pp->p2l ? pp->p2l + (size_t)l * pp->P : NULL, NULL, EPX_REPLICA_ROUND_ROBIN};
    const epx_placement_t *pl = pp->p2l ? &placement : NULL;
    layer_load(t, l, load);
    TRY(epx_placement_rank_load(pl, t->E, t->W, load, rank_load));
    double most = 0, sum = 0;
    for (int32_t r = 0; r < t->W; r++) most = rank_load[r] > most ? rank_load[r] : most, sum += rank_load[r];
    *expected += sum > 0 ? most * t->W / sum / t->layers : 1.0 / t->layers;
    /* the rule, route by route: replica (token + source rank) mod n */
    int32_t P = pp->P, *rank_of = xalloc(sizeof(int32_t) * (size_t)P), *first = xalloc(sizeof(int32_t) * (size_t)(t->E + 1));
    int32_t *replicas = xalloc(sizeof(int32_t) * (size_t)P), *fill = xalloc(sizeof(int32_t) * (size_t)t->E);
    for (int32_t p = 0; p < P; p++) rank_of[p] = p / (P / t->W), first[(pl ? pl->physical_to_logical[p] : p) + 1]++;
    for (int32_t e = 0; e < t->E; e++) first[e + 1] += first[e];
    for (int32_t p = 0; p < P; p++) {
      int32_t e = pl ? pl->physical_to_logical[p] : p;
      replicas[first[e] + fill[e]++] = p;
    }
    for (int32_t st = 0; st < t->steps; st++) {
      for (int32_t r = 0; r < t->W; r++) rank_load[r] = 0;
      for (int32_t r = 0; r < t->W; r++) {
        const int32_t *idx = trace_row(t, st, l, r);
        for (int64_t i = 0; i < (int64_t)*trace_count(t, st, l, r); i++)
          for (int32_t k = 0; k < t->K; k++) {
            int32_t e = idx[i * t->K + k];
            if (e < 0) continue;
            int32_t n = first[e + 1] - first[e];
            rank_load[rank_of[replicas[first[e] + (int32_t)(((uint64_t)i + (uint64_t)r) % (uint64_t)n)]]] += 1;
          }
      }
      double m = 0, total = 0;
      for (int32_t r = 0; r < t->W; r++) m = rank_load[r] > m ? rank_load[r] : m, total += rank_load[r];
      *measured += (total > 0 ? m * t->W / total : 1.0) / (t->layers * t->steps);
    }
    free(rank_of), free(first), free(replicas), free(fill);
  }
  free(load), free(rank_load);
}

/* ------------------------------------------------------------------------ */
/* Report                                                                    */
/* ------------------------------------------------------------------------ */

static const char *placement_name(const placement_plan_t *pp, char *buf, size_t n) {
  if (pp->redundant < 0) snprintf(buf, n, "contiguous");
  else snprintf(buf, n, "planned R=%d", pp->redundant);
  return buf;
}

/* One placement's lines: a line per exchange and step, a summary per
 * exchange; each exchange's outputs against the first's. */
static int report_placement(const job_t *job, int32_t pi, double *step_ms, double *dispatch_ms) {
  const options_t *o = job->o;
  const trace_t *t = job->t;
  int ok = 1;
  double other_total[3] = {0};
  for (int xi = 0; xi < o->n_exchanges; xi++) {
    const char *name = exchange_names[o->exchanges[xi]];
    double time_sum = 0, dispatch_sum = 0, same_sum = 0, other_sum = 0;
    for (int32_t st = 0; st < t->steps; st++) {
      const step_report_t *all = job->reports + (((size_t)pi * o->n_exchanges + xi) * t->steps + st) * t->W;
      const step_report_t *first = job->reports + (((size_t)pi * o->n_exchanges) * t->steps + st) * t->W;
      double slowest = 0, slowest_dispatch = 0, same = 0, other = 0, most = 0, rows = 0;
      for (int32_t r = 0; r < t->W; r++) {
        slowest = all[r].seconds > slowest ? all[r].seconds : slowest;
        slowest_dispatch = all[r].dispatch_seconds > slowest_dispatch ? all[r].dispatch_seconds : slowest_dispatch;
        same += all[r].same_bytes, other += all[r].other_bytes, rows += all[r].recv_rows;
        most = all[r].recv_rows > most ? all[r].recv_rows : most;
        if (all[r].hash != first[r].hash) {
          printf("%s: step %d rank %d: outputs differ from %s's\n", name, st, r, exchange_names[o->exchanges[0]]);
          ok = 0;
        }
      }
      printf("%-12s step %3d: %9.3f ms (dispatch %8.3f)  same-node %10.3f MB  other-node %10.3f MB  skew %.3f\n",
             name, st, 1e3 * slowest, 1e3 * slowest_dispatch, same / 1e6, other / 1e6,
             rows > 0 ? most * t->W / rows : 1.0);
      time_sum += slowest, dispatch_sum += slowest_dispatch, same_sum += same, other_sum += other;
    }
    other_total[o->exchanges[xi]] = other_sum;
    printf("%-12s total:    %9.3f ms per step (dispatch %.3f), same-node %.3f MB, other-node %.3f MB per step "
           "(dispatch; combine returns as many)\n", name, 1e3 * time_sum / t->steps, 1e3 * dispatch_sum / t->steps,
           same_sum / 1e6 / t->steps, other_sum / 1e6 / t->steps);
    if (xi == 0) *step_ms = 1e3 * time_sum / t->steps, *dispatch_ms = 1e3 * dispatch_sum / t->steps;
  }
  if (o->n_exchanges == 3 && other_total[1] > 0)
    printf("other-node bytes against collective: dedup %.3f, hierarchical %.3f\n", other_total[0] / other_total[1],
           other_total[2] / other_total[1]);
  return ok;
}

/* Rank 0's report: each placement's lines, then the placements side by side. */
static int report(const job_t *job) {
  int ok = 1;
  char name[64];
  double *step_ms = xalloc(sizeof(double) * (size_t)job->n_place), *dispatch_ms = xalloc(sizeof(double) * (size_t)job->n_place);
  for (int32_t pi = 0; pi < job->n_place; pi++) {
    if (job->n_place > 1) printf("-- placement: %s\n", placement_name(&job->place[pi], name, sizeof name));
    ok &= report_placement(job, pi, &step_ms[pi], &dispatch_ms[pi]);
  }
  if (job->n_place > 1) {
    printf("placement       physical  skew expected  skew measured  ms/step (%s)  dispatch ms/step\n",
           exchange_names[job->o->exchanges[0]]);
    for (int32_t pi = 0; pi < job->n_place; pi++) {
      double expected, measured;
      placement_skew(job, &job->place[pi], &expected, &measured);
      printf("%-14s  %8d  %13.3f  %13.3f  %12.3f  %16.3f\n", placement_name(&job->place[pi], name, sizeof name),
             job->place[pi].P, expected, measured, step_ms[pi], dispatch_ms[pi]);
    }
  }
  free(step_ms), free(dispatch_ms);
  return ok;
}

/* ------------------------------------------------------------------------ */
/* Ranks and main                                                            */
/* ------------------------------------------------------------------------ */

typedef struct {
  job_t *job;
  epx_local_world_t world;
  int32_t rank;
} thread_arg_t;

static void *rank_thread(void *p) {
  thread_arg_t *a = p;
  epx_comm_t comm;
  TRY(epx_comm_create_local(a->world, a->rank, &comm));
  rank_main(a->job, comm, a->rank);
  TRY(epx_comm_destroy(comm));
  return NULL;
}

static void usage(void) {
  printf("epx-replay [--trace FILE | --gen uniform|zipf|hot|dsv3] [--record FILE]\n"
         "  --ranks W (4) --ranks-per-node L (2) --layers N (2) --steps N (3) --tokens T (256)\n"
         "  --experts E (64) --topk K (6) --zipf S (1.2) --hot N (4) --hot-share F (0.5)\n"
         "  --hidden H (256) --dtype f32|bf16 --exchange dedup|collective|hierarchical|all (all)\n"
         "  --iters N (2: the fastest of N runs of each step) --seed N --mpi (one rank per MPI process)\n"
         "  --redundant R1,R2,... (also replay placements planned with R redundant experts each)\n");
}

static void parse(int argc, char **argv, options_t *o) {
  *o = (options_t){.gen = "uniform", .ranks = 4, .ranks_per_node = 2, .layers = 2, .steps = 3, .experts = 64,
                   .topk = 6, .hot = 4, .iters = 2, .tokens = 256, .hidden = 256, .zipf = 1.2, .hot_share = 0.5,
                   .dtype = EPX_BFLOAT16, .exchanges = {0, 1, 2}, .n_exchanges = 3, .seed = 42};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help")) usage(), exit(0);
    if (!strcmp(a, "--mpi")) {
      o->mpi = 1;
      continue;
    }
    if (!v) fatal("%s needs a value (--help)", a);
    i++;
    if (!strcmp(a, "--trace")) o->trace = v;
    else if (!strcmp(a, "--record")) o->record = v;
    else if (!strcmp(a, "--gen")) o->gen = v;
    else if (!strcmp(a, "--ranks")) o->ranks = atoi(v);
    else if (!strcmp(a, "--ranks-per-node")) o->ranks_per_node = atoi(v);
    else if (!strcmp(a, "--layers")) o->layers = atoi(v);
    else if (!strcmp(a, "--steps")) o->steps = atoi(v);
    else if (!strcmp(a, "--tokens")) o->tokens = atoll(v);
    else if (!strcmp(a, "--experts")) o->experts = atoi(v);
    else if (!strcmp(a, "--topk")) o->topk = atoi(v);
    else if (!strcmp(a, "--zipf")) o->zipf = atof(v);
    else if (!strcmp(a, "--hot")) o->hot = atoi(v);
    else if (!strcmp(a, "--hot-share")) o->hot_share = atof(v);
    else if (!strcmp(a, "--hidden")) o->hidden = atoll(v);
    else if (!strcmp(a, "--iters")) o->iters = atoi(v);
    else if (!strcmp(a, "--seed")) o->seed = (uint64_t)atoll(v);
    else if (!strcmp(a, "--redundant")) {
      for (char *end = (char *)v; *v && o->n_redundant < 8; v = *end ? end + 1 : end) {
        o->redundant[o->n_redundant++] = (int32_t)strtol(v, &end, 10);
        if (end == v || o->redundant[o->n_redundant - 1] < 0) fatal("--redundant %s: counts like 0,16,32", v);
      }
    }
    else if (!strcmp(a, "--dtype")) o->dtype = !strcmp(v, "f32") ? EPX_FLOAT32 : !strcmp(v, "bf16") ? EPX_BFLOAT16 : (fatal("--dtype %s: f32 or bf16", v), EPX_FLOAT32);
    else if (!strcmp(a, "--exchange")) {
      o->n_exchanges = 0;
      for (int x = 0; x < 3; x++)
        if (!strcmp(v, "all") || !strcmp(v, exchange_names[x])) o->exchanges[o->n_exchanges++] = x;
      if (!o->n_exchanges) fatal("--exchange %s: dedup, collective, hierarchical or all", v);
    } else fatal("unknown option %s (--help)", a);
  }
  if (strcmp(o->gen, "uniform") && strcmp(o->gen, "zipf") && strcmp(o->gen, "hot") && strcmp(o->gen, "dsv3"))
    fatal("--gen %s: uniform, zipf, hot or dsv3", o->gen);
  if (o->ranks < 1 || o->ranks_per_node < 1 || o->ranks % o->ranks_per_node || o->layers < 1 || o->steps < 1 ||
      o->tokens < 1 || o->hidden < 8 || o->hidden % 8 || o->iters < 1 || o->topk < 1 || o->topk > o->experts)
    fatal("options out of range%s (--help)", "");
}

int main(int argc, char **argv) {
  options_t o;
  parse(argc, argv, &o);
  int rank = 0;
#if EPX_TOOLS_HAVE_MPI
  if (o.mpi) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &o.ranks);
  }
#else
  if (o.mpi) fatal("--mpi: this epx-replay was built without MPI%s", "");
#endif
  trace_t t;
  if (o.trace) trace_read(&t, o.trace);
  else generate(&o, &t);
  if (t.W != o.ranks) fatal("the trace has another number of ranks than --ranks (or the MPI size)%s", "");
  if (t.E % t.W) fatal("the trace's experts are not a multiple of the ranks%s", "");
  for (int32_t i = 0; i < o.n_redundant; i++)
    if ((t.E + o.redundant[i]) % t.W) fatal("--redundant: experts + each count must be a multiple of the ranks%s", "");
  if (o.record && rank == 0) trace_write(&t, o.record);
  job_t job = {&o, &t, 0, NULL, NULL, 0};
  plan_placements(&job);
  job.reports = xalloc(sizeof(step_report_t) * (size_t)job.n_place * o.n_exchanges * t.steps * t.W);
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.ranks_per_node = o.ranks_per_node;
  if (rank == 0)
    printf("epx-replay: %d ranks as %d nodes of %d (%s), %s, %d layers x %d steps, T=%lld per rank, E=%d, top-%d, "
           "H=%lld %s\n", t.W, t.W / o.ranks_per_node, o.ranks_per_node, o.mpi ? "MPI processes" : "threads",
           o.trace ? o.trace : o.gen, t.layers, t.steps, (long long)t.T, t.E, t.K, (long long)o.hidden,
           o.dtype == EPX_FLOAT32 ? "f32" : "bf16");
  if (o.mpi) {
#if EPX_TOOLS_HAVE_MPI
    MPI_Comm world = MPI_COMM_WORLD;
    epx_comm_t comm;
    TRY(epx_comm_create_mpi(&world, &config, &comm));
    rank_main(&job, comm, rank);
    TRY(epx_comm_destroy(comm));
#endif
  } else {
    epx_local_world_t world;
    TRY(epx_local_world_create(t.W, &config, &world));
    pthread_t *threads = xalloc(sizeof(pthread_t) * (size_t)t.W);
    thread_arg_t *args = xalloc(sizeof(thread_arg_t) * (size_t)t.W);
    for (int32_t r = 0; r < t.W; r++) {
      args[r] = (thread_arg_t){&job, world, r};
      if (pthread_create(&threads[r], NULL, rank_thread, &args[r])) fatal("pthread_create failed%s", "");
    }
    for (int32_t r = 0; r < t.W; r++) pthread_join(threads[r], NULL);
    TRY(epx_local_world_destroy(world));
    free(threads), free(args);
  }
  int ok = rank == 0 ? report(&job) : 1;
#if EPX_TOOLS_HAVE_MPI
  if (o.mpi) {
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Finalize();
  }
#endif
  if (rank == 0) printf("%s\n", ok ? "OK" : "FAILED");
  for (int32_t pi = 0; pi < job.n_place; pi++) free(job.place[pi].p2l);
  free(job.place), free(job.reports), free(t.tokens), free(t.idx);
  return ok ? 0 : 1;
}
