/* The CUDA backend on W ranks over NCCL, one process per GPU, under mpirun
 * (any W; run on 2 GPUs by bench/gpu-check.sh). Exit status is the verdict.
 *
 * Every payload is provenance-coded: a row's values are a function of
 * (its expert, source rank, source token, column) exactly representable in
 * every dtype, so each rank knows what it must receive without gathering
 * anything. Every rank can also make every rank's routing (a function of the
 * rank and the case), which gives two references on each rank:
 *  - the CPU backend: the same calls over the local transport with W
 *    threads, compared bit for bit (payloads, layout, sources, counts) and
 *    grad_w to float32 dot-order tolerance;
 *  - the contract's formula for combine and dispatch_backward (per-rank
 *    partials in k order, rounded to the dtype in payload-precision mode,
 *    summed over ranks in ascending order), bit for bit.
 * Dedup and collective are compared with each other bit for bit, and the
 * dedup buffer's two paths (EPX_PATH_FUSED, which runs the fused NVLink
 * kernels where every peer is reachable by load/store, and EPX_PATH_HOST)
 * bit for bit; epx_buffer_peer_paths says which path each buffer took
 * (EPX_GPU_EXPECT_FUSED=1: the fused path is required). Then:
 * skewed routing, a rank with 0 tokens, a capacity refusal on one rank (all
 * refuse, nothing hangs, the comm stays usable), recorder replay and its
 * validation, and layout + dispatch + combine + both backward passes
 * captured in one CUDA graph (worst_case_sizing) equal to the uncaptured
 * run; and grad_w's dots with inexact payloads (H = 1544), where a change
 * of summation order would show, fused equal to host path bit for bit and
 * both within tolerance of a float64 reference (test_dot_order).
 *
 * With ONE rank (mpirun -np 1, a machine with one GPU) the W-rank backend is
 * forced onto the one-rank NCCL comm (epx_cuda_ep_at_one_rank, a test hook)
 * so that every case still runs ep.c and the fused kernels: the exchanges
 * are then self sends and the window is this rank's own. Only the tests
 * that need a second rank (a peer in another call or with another
 * weighting or config) are skipped, with a note. */
#include <math.h>
#if !defined(EPX_THREAD_RANKS) && !defined(EPX_PROC_RANKS)
#include <mpi.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "core/dtype.h"
#include "cuda/launch.h" /* epx_cuda_set_launch_flags (the fused expansion's two forms), epx_cuda_ep_at_one_rank */
#include "epx.h"
#include "../util/buffer_config.h"
#define CHECK_FAILURES g_fail /* check.h's RANK_EXPECT counts here */
#include "mpi_gpu_check.h"
#include "../util/clock.h"

static EPX_RANK_LOCAL int g_rank, g_fail;
static int g_size;
static int g_quick;
static EPX_RANK_LOCAL epx_exchange_path_t g_path = EPX_PATH_FUSED; /* exchange_path of the CUDA buffers of run_rank */
static int g_expect_fused;                        /* EPX_GPU_EXPECT_FUSED: the fused path is required where asked */
/* 1 while buffers are made with every peer relayed through NCCL's host API
 * (the test flag EPX_CUDA_FUSED_RELAY: the mixed path on GPUs that all
 * have load/store access) */
static EPX_RANK_LOCAL int g_relay;
static EPX_RANK_LOCAL int g_hier_cases; /* cases run on the hierarchical exchange too */
static int32_t g_nodes, g_ranks_per_node; /* the comm's topology (epx_comm_topology) */

enum { H = 64, K = 4, C = 40, ALIGN = 4, TMAX = 96 };
static int E; /* 8 experts per rank */

typedef struct {
  epx_layout_t layout;
  epx_dtype_t dtype;
  epx_weighting_t weighting;
  epx_combine_precision_t precision;
  int worst, skew, zero_rank, seed;
  int place; /* config.placement: PLACE_NONE, or one of g_place (epx.h, "Expert placement and replicas") */
} case_t;

/* The placements of the placement cases, the same on every rank, made once
 * (make_placements): E + 2W physical experts, logical p's (5p + 3) mod E for
 * p < E and the four experts the skewed routing favours twice over
 * (replicas), physical p on rank (p + p / W) mod W (no rank holds its
 * contiguous block); the replica rule's round robin, or the caller's ids
 * (make_routing picks replica (7t + k + rank) mod n). */
enum { PLACE_NONE, PLACE_REPLICAS, PLACE_CALLER, PLACE_KINDS, P_MAX = 128 };
typedef struct {
  int32_t P, p2l[P_MAX], prank[P_MAX];
  int32_t first[P_MAX + 1], replicas[P_MAX]; /* logical e's replicas, ascending */
  epx_placement_t pl;
} placement_case_t;
static placement_case_t g_place[PLACE_KINDS];
static pthread_mutex_t g_place_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_place_size; /* the comm size g_place was made for (ranks as threads: W = 2, 4, 8 in turn) */

static void make_placements(void) {
  pthread_mutex_lock(&g_place_lock);
  if (g_place_size == g_size) {
    pthread_mutex_unlock(&g_place_lock);
    return;
  }
  for (int kind = PLACE_REPLICAS; kind < PLACE_KINDS; kind++) {
    placement_case_t *q = &g_place[kind];
    q->P = E + 2 * g_size;
    for (int32_t p = 0; p < q->P; p++) {
      q->p2l[p] = p < E ? (5 * p + 3) % E : (p - E) % 4;
      q->prank[p] = (p + p / g_size) % g_size;
    }
    int32_t at = 0;
    for (int32_t e = 0; e < E; e++) {
      q->first[e] = at;
      for (int32_t p = 0; p < q->P; p++)
        if (q->p2l[p] == e) q->replicas[at++] = p;
    }
    q->first[E] = at;
    q->pl = (epx_placement_t){q->P, q->p2l, q->prank,
                              kind == PLACE_CALLER ? EPX_REPLICA_CALLER : EPX_REPLICA_ROUND_ROBIN};
  }
  g_place_size = g_size;
  pthread_mutex_unlock(&g_place_lock);
}

/* Experts a rank holds in case c: P / W. */
static int experts_local(const case_t *c) { return (c->place ? g_place[c->place].P : E) / g_size; }

/* The physical expert of route (rank, t, k) to caller id e (>= 0) and its rank. */
static int32_t physical_of(const case_t *c, int rank, int64_t t, int32_t e, int32_t *holder) {
  const placement_case_t *q = &g_place[c->place];
  int32_t p = e;
  if (c->place == PLACE_REPLICAS) {
    const int32_t n = q->first[e + 1] - q->first[e];
    p = q->replicas[q->first[e] + (int32_t)(((uint64_t)t + (uint64_t)rank) % (uint64_t)n)];
  }
  *holder = c->place ? q->prank[p] : p / experts_local(c);
  return p;
}

/* ------------------------------------------------------------------------ */
/* Coded data                                                                */
/* ------------------------------------------------------------------------ */

/* Multiples of 1/8 in [-3.75, 3.75]: exact in every dtype. */
static float code(int a, int b, int c, int h) {
  return (float)((int)(((unsigned)(a * 37 + b * 101 + c * 13 + h * 7 + 5)) % 61u) - 30) / 8.0f;
}
static float x_val(int s, int t, int h) { return code(s + 50, t, 1, h); }
static float eo_val(int e, int s, int t, int h) { return code(e, s, t, h); }         /* expert_out, expert rows */
static float eo_pair_val(int r, int s, int t, int h) { return code(r + 300, s, t, h); } /* rank-major rows */
static float gr_val(int e, int s, int t, int h) { return code(e + 7, s, t, h + 1); }   /* grad_recv_x */
static float gr_pair_val(int r, int s, int t, int h) { return code(r + 400, s, t, h + 3); }
static float go_val(int s, int t, int h) { return code(s + 70, t, 2, h); }
static float gw_val(int e, int s, int t) { return (float)((e * 7 + s * 3 + t) % 17) / 4.0f; }

typedef struct {
  int64_t T;
  int32_t idx[TMAX * K], loc[TMAX * K];
  float w[TMAX * K];
} routing_t;

static int64_t tokens_of(const case_t *c, int rank) {
  if (c->zero_rank && rank == g_size - 1) return 0;
  return 40 + (rank * 17 + c->seed * 5) % 50;
}

/* Rank `rank`'s routing in case c (the same on every process). */
static void make_routing(const case_t *c, int rank, routing_t *r) {
  uint64_t z = mix((uint64_t)c->seed * 1000003u + (uint64_t)rank);
  r->T = tokens_of(c, rank);
  int32_t fill[256] = {0};
  for (int64_t t = 0; t < r->T; t++) {
    for (int k = 0; k < K; k++) {
      int e;
      for (;;) {
        z = mix(z);
        e = c->skew && (z >> 40) % 10 < 7 ? (int)((z >> 8) % (uint64_t)(E / g_size)) : (int)((z >> 8) % (uint64_t)E);
        int dup = 0;
        for (int j = 0; j < k; j++) dup |= r->idx[t * K + j] == e;
        if (!dup) break;
      }
      z = mix(z);
      const int drop = (z >> 50) % 10 == 0;
      r->idx[t * K + k] = drop ? -1 : e;
      r->w[t * K + k] = drop ? 0.0f : (float)((z >> 20) % 1000 + 1) / 1000.0f;
      r->loc[t * K + k] = -1;
      if (!drop && c->layout == EPX_LAYOUT_CAPACITY) {
        if (fill[e] >= C) r->idx[t * K + k] = -1, r->w[t * K + k] = 0.0f;
        else r->loc[t * K + k] = fill[e]++;
      }
    }
  }
  if (c->place != PLACE_CALLER) return;
  const placement_case_t *q = &g_place[PLACE_CALLER];
  for (int64_t t = 0; t < r->T; t++)
    for (int k = 0; k < K; k++) {
      const int32_t e = r->idx[t * K + k], n = e < 0 ? 1 : q->first[e + 1] - q->first[e];
      if (e >= 0) r->idx[t * K + k] = q->replicas[q->first[e] + (int32_t)((7 * t + k + rank) % n)];
    }
}

static void *dev_put(const void *host, size_t bytes) {
  void *p = NULL;
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&p, bytes ? bytes : 16));
  if (bytes) FATAL_UNLESS_CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  return p;
}

static void *host_get(const void *dev, size_t bytes) {
  void *p = calloc(bytes ? bytes : 1, 1);
  if (bytes) FATAL_UNLESS_CUDA_OK(cudaMemcpy(p, dev, bytes, cudaMemcpyDeviceToHost));
  return p;
}

/* float row values -> dtype bytes */
static void *encode(epx_dtype_t dtype, const float *v, int64_t n) {
  void *out = calloc((size_t)(n ? n : 1), epx_dtype_size(dtype));
  FATAL_UNLESS_OK(epx_convert(dtype, out, EPX_FLOAT32, v, n));
  return out;
}

/* ------------------------------------------------------------------------ */
/* One rank's run of every call (GPU or CPU)                                 */
/* ------------------------------------------------------------------------ */

typedef struct {
  int64_t N, T;
  int slots;
  void *recv_x, *out, *grad_x, *grad_eo;           /* host, dtype */
  int32_t *src_rank, *src_token, *recv_expert;     /* host */
  float *recv_w, *gw_d, *gw_c, *gw_w;              /* host */
  int64_t *counts, *offsets;
  epx_handle_stats_t stats;
  epx_handle_traffic_t traffic; /* rows and bytes by link class (epx_handle_traffic) */
  int64_t rows_device; /* epx_handle_recv_rows_device's N (CUDA; the CPU backend: N) */
  int64_t load[64];    /* epx_buffer_expert_load after the layout: routes per logical expert */
  /* the buffer's path (epx_buffer_peer_paths): every peer's, -1 if they
   * differ; under g_relay EPX_PATH_FUSED means this rank's own rows fused
   * and every other peer on the host path, as it must be */
  int32_t path;
  char why[512]; /* epx_last_error after the calls that may set up the fused path: why it was refused */
} result_t;

/* result_t.path of buffer b. */
static int32_t read_paths(epx_buffer_t b) {
  int32_t paths[64];
  FATAL_UNLESS_OK(epx_buffer_peer_paths(b, paths));
  const int32_t self = paths[g_rank];
  const int32_t others = g_relay && self == EPX_PATH_FUSED ? EPX_PATH_HOST : self;
  for (int q = 0; q < g_size && q < 64; q++)
    if (q != g_rank && paths[q] != others) return -1;
  return self;
}

static void result_free(result_t *r) {
  void *p[] = {r->recv_x, r->out, r->grad_x, r->grad_eo, r->src_rank, r->src_token, r->recv_expert,
               r->recv_w, r->gw_d, r->gw_c, r->gw_w, r->counts, r->offsets};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
  memset(r, 0, sizeof *r);
}

/* The layout-dependent inputs of a rank, coded by each row's provenance. */
static void make_row_inputs(const case_t *c, int me, const result_t *r, float *eo, float *gr, float *grw) {
  const int rm = c->layout == EPX_LAYOUT_RANK_MAJOR;
  for (int64_t i = 0; i < r->N; i++) {
    const int s = r->src_rank[i], t = r->src_token[i];
    const int e = rm ? -1 : r->recv_expert[i];
    for (int h = 0; h < H; h++) {
      const int pad = s < 0 || (!rm && e < 0);
      eo[i * H + h] = pad ? 0.0f : rm ? eo_pair_val(me, s, t, h) : eo_val(e, s, t, h);
      gr[i * H + h] = pad ? 0.0f : rm ? gr_pair_val(me, s, t, h) : gr_val(e, s, t, h);
    }
    for (int k = 0; k < r->slots; k++) {
      const int ek = r->recv_expert[i * r->slots + k];
      grw[i * r->slots + k] = ek >= 0 && s >= 0 ? gw_val(ek, s, t) : 0.0f;
    }
  }
}

typedef struct {
  const case_t *c;
  epx_exchange_t exchange;
  epx_comm_t comm;
  int rank;
  epx_device_t device;
  result_t res;
  void *stream;
} run_t;

/* Copies n elements of `bytes` each from where the buffer's tensors live. */
static void *fetch(epx_device_t device, const void *p, size_t bytes) {
  if (device == EPX_DEVICE_CUDA) return host_get(p, bytes);
  void *q = malloc(bytes ? bytes : 1);
  if (bytes) memcpy(q, p, bytes);
  return q;
}

static void *place(epx_device_t device, const void *host, size_t bytes) {
  if (device == EPX_DEVICE_CUDA) return dev_put(host, bytes);
  void *q = NULL;
  if (posix_memalign(&q, 64, bytes ? bytes : 64)) abort();
  if (bytes) memcpy(q, host, bytes);
  return q;
}

/* Case c's routing rt placed on device: *idx, *w, *loc (the caller
 * releases them), and the call's view of them (w and loc where c uses them). */
static epx_routing_t place_routing(const case_t *c, const routing_t *rt, epx_device_t device, int32_t **idx,
                                   float **w, int32_t **loc) {
  const size_t bytes = 4 * (size_t)(rt->T * K);
  *idx = place(device, rt->idx, bytes);
  *w = place(device, rt->w, bytes);
  *loc = place(device, rt->loc, bytes);
  return (epx_routing_t){rt->T, K, *idx, c->weighting == EPX_WEIGHTS_NONE ? NULL : *w,
                         c->layout == EPX_LAYOUT_CAPACITY ? *loc : NULL, c->weighting};
}

static void *zeros(epx_device_t device, size_t bytes) {
  void *host = calloc(1, bytes + 16);
  void *p = place(device, host, bytes);
  free(host);
  return p;
}

static void release(epx_device_t device, void *p) {
  if (device == EPX_DEVICE_CUDA) cudaFree(p);
  else free(p);
}

static epx_buffer_config_t config_of(const case_t *c, epx_exchange_t exchange, epx_device_t device, void *stream) {
  epx_buffer_config_t cfg = tu_config(device, c->dtype, H, E, K, c->worst ? TMAX : 0);
  cfg.max_tokens_rounding = 32;
  cfg.exchange = exchange;
  cfg.layout = c->layout;
  cfg.expert_alignment = c->layout == EPX_LAYOUT_EXPERT_MAJOR ? ALIGN : 1;
  cfg.capacity = c->layout == EPX_LAYOUT_CAPACITY ? C : 0;
  cfg.worst_case_sizing = device == EPX_DEVICE_CUDA && c->worst;
  cfg.stream = stream;
  cfg.combine_precision = c->precision;
  cfg.exchange_path = device == EPX_DEVICE_CUDA ? g_path : EPX_PATH_AUTO;
  cfg.placement = c->place ? &g_place[c->place].pl : NULL;
  return cfg;
}

static void run_rank(run_t *run) {
  const case_t *c = run->c;
  const epx_device_t dev = run->device;
  const size_t es = epx_dtype_size(c->dtype);
  const int rm = c->layout == EPX_LAYOUT_RANK_MAJOR;
  result_t *r = &run->res;
  routing_t rt;
  make_routing(c, run->rank, &rt);
  const int64_t T = rt.T;
  r->T = T;
  epx_buffer_config_t cfg = config_of(c, run->exchange, dev, run->stream);
  epx_buffer_t buf;
  FATAL_UNLESS_OK(epx_buffer_create(run->comm, &cfg, &buf));
  snprintf(r->why, sizeof r->why, "%s", epx_last_error());
  int32_t *idx, *loc;
  float *w;
  epx_routing_t routing = place_routing(c, &rt, dev, &idx, &w, &loc);
  epx_handle_t h;
  FATAL_UNLESS_OK(epx_dispatch_layout(buf, &routing, NULL, &h));
  if (epx_last_error()[0]) snprintf(r->why, sizeof r->why, "%s", epx_last_error());
  /* After the layout: max_tokens_per_rank is agreed, the fused state made. */
  r->path = read_paths(buf);
  int64_t N, cap;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h, &N));
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(buf, &cap));
  if (cap < N) cap = N;
  r->N = N;
  FATAL_UNLESS_OK(epx_handle_stats(h, &r->stats));
  FATAL_UNLESS_OK(epx_handle_traffic(h, &r->traffic));
  r->rows_device = N;
  if (dev == EPX_DEVICE_CUDA) {
    const int64_t *d_rows = NULL;
    FATAL_UNLESS_OK(epx_handle_recv_rows_device(h, &d_rows));
    FATAL_UNLESS_CUDA_OK(cudaMemcpy(&r->rows_device, d_rows, sizeof r->rows_device, cudaMemcpyDeviceToHost));
  }
  r->slots = rm ? K : 1;
  const int El = experts_local(c);
  if (E <= 64) FATAL_UNLESS_OK(epx_buffer_expert_load(buf, r->load, 0));

  float *xv = calloc((size_t)(T * H + 1), 4);
  for (int64_t t = 0; t < T; t++)
    for (int hh = 0; hh < H; hh++) xv[t * H + hh] = x_val(run->rank, (int)t, hh);
  void *xh = encode(c->dtype, xv, T * H);
  void *x = place(dev, xh, (size_t)(T * H) * es);
  void *recv_x = zeros(dev, (size_t)(cap * H) * es);
  FATAL_UNLESS_OK(epx_dispatch(buf, h, x, recv_x, cap));
  int32_t *srank = zeros(dev, 4 * (size_t)cap);
  int32_t *stok = zeros(dev, 4 * (size_t)cap);
  int32_t *rexp = zeros(dev, 4 * (size_t)(cap * r->slots));
  float *rw = zeros(dev, 4 * (size_t)(cap * r->slots));
  int64_t *cnt = zeros(dev, 8 * (size_t)El);
  int64_t *off = zeros(dev, 8 * (size_t)(El + 1));
  FATAL_UNLESS_OK(epx_handle_recv_source(h, srank, stok));
  FATAL_UNLESS_OK(epx_handle_recv_routing(h, rexp, rw));
  FATAL_UNLESS_OK(epx_handle_expert_counts(h, cnt, off));
  if (dev == EPX_DEVICE_CUDA) FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  r->recv_x = fetch(dev, recv_x, (size_t)(N * H) * es);
  r->src_rank = fetch(dev, srank, 4 * (size_t)N);
  r->src_token = fetch(dev, stok, 4 * (size_t)N);
  r->recv_expert = fetch(dev, rexp, 4 * (size_t)(N * r->slots));
  r->recv_w = fetch(dev, rw, 4 * (size_t)(N * r->slots));
  r->counts = fetch(dev, cnt, 8 * (size_t)El);
  r->offsets = fetch(dev, off, 8 * (size_t)(El + 1));

  /* The backward inputs, from this rank's own layout. */
  float *eo = calloc((size_t)(cap * H + 1), 4), *gr = calloc((size_t)(cap * H + 1), 4);
  float *grw = calloc((size_t)(cap * r->slots + 1), 4), *gov = calloc((size_t)(T * H + 1), 4);
  make_row_inputs(c, run->rank, r, eo, gr, grw);
  for (int64_t t = 0; t < T; t++)
    for (int hh = 0; hh < H; hh++) gov[t * H + hh] = go_val(run->rank, (int)t, hh);
  void *eoh = encode(c->dtype, eo, cap * H), *grh = encode(c->dtype, gr, cap * H), *goh = encode(c->dtype, gov, T * H);
  void *eo_d = place(dev, eoh, (size_t)(cap * H) * es), *gr_d = place(dev, grh, (size_t)(cap * H) * es);
  void *go_d = place(dev, goh, (size_t)(T * H) * es);
  float *grw_d = place(dev, grw, 4 * (size_t)(cap * r->slots));
  void *out = zeros(dev, (size_t)(T * H) * es);
  void *gx = zeros(dev, (size_t)(T * H) * es);
  void *geo = zeros(dev, (size_t)(cap * H) * es);
  float *gwd = zeros(dev, 4 * (size_t)(T * K));
  float *gwc = zeros(dev, 4 * (size_t)(T * K));
  float *gww = zeros(dev, 4 * (size_t)(T * K));
  FATAL_UNLESS_OK(epx_combine(buf, h, eo_d, out));
  const int in_d = c->weighting == EPX_WEIGHTS_IN_DISPATCH, in_c = c->weighting == EPX_WEIGHTS_IN_COMBINE;
  FATAL_UNLESS_OK(epx_dispatch_backward(buf, h, gr_d, gx, in_d ? x : NULL, in_d ? gwd : NULL));
  FATAL_UNLESS_OK(epx_combine_backward(buf, h, go_d, in_c ? eo_d : NULL, geo, in_c ? gwc : NULL));
  if (c->weighting == EPX_WEIGHTS_NONE) FATAL_UNLESS_OK(epx_weights_backward(buf, h, grw_d, gww));
  if (dev == EPX_DEVICE_CUDA) FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  r->out = fetch(dev, out, (size_t)(T * H) * es);
  r->grad_x = fetch(dev, gx, (size_t)(T * H) * es);
  r->grad_eo = fetch(dev, geo, (size_t)(N * H) * es);
  r->gw_d = fetch(dev, gwd, 4 * (size_t)(T * K));
  r->gw_c = fetch(dev, gwc, 4 * (size_t)(T * K));
  r->gw_w = fetch(dev, gww, 4 * (size_t)(T * K));
  FATAL_UNLESS_OK(epx_handle_release(h));
  FATAL_UNLESS_OK(epx_buffer_destroy(buf));
  void *devs[] = {idx, w, loc, x, recv_x, srank, stok, rexp, rw, cnt, off, eo_d, gr_d, go_d, grw_d, out, gx, geo, gwd, gwc, gww};
  for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) release(dev, devs[i]);
  void *hosts[] = {xv, xh, eo, gr, grw, gov, eoh, grh, goh};
  for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++) free(hosts[i]);
}

/* The CPU backend over W threads: a thread per rank q, each running
 * body(args + q * arg_bytes, its local comm); ranks_per_node: 0, one node,
 * else nodes posed as the NCCL comm's. */
typedef void (*cpu_body_fn)(void *arg, epx_comm_t comm);

typedef struct {
  epx_local_world_t world;
  int rank;
  cpu_body_fn body;
  void *arg;
} cpu_thread_t;

static void *cpu_thread(void *p) {
  cpu_thread_t *t = p;
  epx_comm_t comm;
  FATAL_UNLESS_OK(epx_comm_create_local(t->world, t->rank, &comm));
  t->body(t->arg, comm);
  FATAL_UNLESS_OK(epx_comm_destroy(comm));
  return NULL;
}

static void run_cpu_threads(int32_t ranks_per_node, cpu_body_fn body, void *args, size_t arg_bytes) {
  cpu_thread_t *ranks = calloc((size_t)g_size, sizeof *ranks);
  pthread_t *threads = calloc((size_t)g_size, sizeof *threads);
  epx_local_world_t world;
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.ranks_per_node = ranks_per_node;
  FATAL_UNLESS_OK(epx_local_world_create(g_size, ranks_per_node ? &cc : NULL, &world));
  for (int q = 0; q < g_size; q++) {
    ranks[q] = (cpu_thread_t){world, q, body, (char *)args + (size_t)q * arg_bytes};
    pthread_create(&threads[q], NULL, cpu_thread, &ranks[q]);
  }
  for (int q = 0; q < g_size; q++) pthread_join(threads[q], NULL);
  FATAL_UNLESS_OK(epx_local_world_destroy(world));
  free(ranks);
  free(threads);
}

static void run_rank_on(void *arg, epx_comm_t comm) {
  run_t *run = arg;
  run->comm = comm;
  run_rank(run);
}

/* This rank's results of the CPU backend over W threads. */
static void run_cpu_posed(const case_t *c, epx_exchange_t exchange, int32_t ranks_per_node, result_t *mine) {
  run_t *runs = calloc((size_t)g_size, sizeof *runs);
  for (int q = 0; q < g_size; q++) runs[q] = (run_t){c, exchange, NULL, q, EPX_DEVICE_CPU, {0}, NULL};
  run_cpu_threads(ranks_per_node, run_rank_on, runs, sizeof *runs);
  *mine = runs[g_rank].res;
  for (int q = 0; q < g_size; q++)
    if (q != g_rank) result_free(&runs[q].res);
  free(runs);
}

static void run_cpu(const case_t *c, epx_exchange_t exchange, result_t *mine) { run_cpu_posed(c, exchange, 0, mine); }

/* ------------------------------------------------------------------------ */
/* References and comparisons                                                */
/* ------------------------------------------------------------------------ */

static float round_to(epx_dtype_t dtype, float v) {
  switch (dtype) {
    case EPX_BFLOAT16: return epx_bf16_to_f32(epx_f32_to_bf16(v));
    case EPX_FLOAT16: return epx_f16_to_f32(epx_f32_to_f16(v));
    default: return v;
  }
}

/* The contract: out[t] = round(sum over ranks r ascending of P(t, r)), P the
 * token's routes on r in k order (w-weighted if weighted), rounded to the
 * dtype first in payload-precision mode. backward: grad_recv_x's values,
 * dispatch_backward's partials float32 whatever the precision. */
static void reference_sum(const case_t *c, const routing_t *rt, int weighted, int backward, float *out) {
  const int rm = c->layout == EPX_LAYOUT_RANK_MAJOR;
  for (int64_t t = 0; t < rt->T; t++)
    for (int h = 0; h < H; h++) {
      float acc = 0.0f;
      for (int r = 0; r < g_size; r++) {
        float p = 0.0f;
        int any = 0;
        for (int k = 0; k < K; k++) {
          int32_t holder = -1;
          const int e = rt->idx[t * K + k] < 0 ? -1 : physical_of(c, g_rank, t, rt->idx[t * K + k], &holder);
          if (e < 0 || holder != r) continue;
          if (rm) {
            if (!any) p = p + (backward ? gr_pair_val(r, g_rank, (int)t, h) : eo_pair_val(r, g_rank, (int)t, h));
          } else {
            const float v = backward ? gr_val(e, g_rank, (int)t, h) : eo_val(e, g_rank, (int)t, h);
            p = p + (weighted ? rt->w[t * K + k] * v : v);
          }
          any = 1;
        }
        if (!any) continue;
        if (c->precision == EPX_COMBINE_PARTIALS_PAYLOAD && !backward) p = round_to(c->dtype, p);
        acc = acc + p;
      }
      out[t * H + h] = round_to(c->dtype, acc);
    }
}

static int same_bytes(const void *a, const void *b, size_t n) { return n == 0 || memcmp(a, b, n) == 0; }

static int first_diff(epx_dtype_t dtype, const void *a, const void *b, int64_t n) {
  const size_t es = epx_dtype_size(dtype);
  for (int64_t i = 0; i < n; i++)
    if (memcmp((const char *)a + i * es, (const char *)b + i * es, es)) return (int)i;
  return -1;
}

static int close_floats(const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!(fabsf(a[i] - b[i]) <= 1e-4f * (1.0f + fabsf(b[i])))) return 0;
  return 1;
}

static const char *describe(const case_t *c, epx_exchange_t x) {
  static EPX_RANK_LOCAL char text[160];
  const char *lay[] = {"expert-major", "rank-major", "capacity"}, *dt[] = {"f32", "bf16", "f16"},
             *wt[] = {"w-in-combine", "w-in-dispatch", "w-none"};
  const char *xs = x == EPX_EXCHANGE_DEDUP ? "dedup" : x == EPX_EXCHANGE_COLLECTIVE ? "collective" : "hierarchical";
  snprintf(text, sizeof text, "%s %s %s %s %s%s%s%s%s seed %d", xs,
           lay[c->layout], dt[c->dtype], wt[c->weighting],
           c->precision == EPX_COMBINE_PARTIALS_PAYLOAD ? "payload-partials" : "f32-partials",
           c->worst ? " worst-case" : "", c->skew ? " skew" : "", c->zero_rank ? " zero-rank" : "",
           c->place == PLACE_REPLICAS ? " placement-replicas" : c->place == PLACE_CALLER ? " placement-caller-ids" : "",
           c->seed);
  return text;
}

/* GPU against CPU (layout, every payload; the CPU run in the case's
 * combine_precision) and against the formula. */
static void compare(const case_t *c, epx_exchange_t x, const result_t *g, const result_t *cpu) {
  const char *what = describe(c, x);
  const size_t es = epx_dtype_size(c->dtype);
  const int64_t T = g->T, N = g->N;
  RANK_EXPECT(g->N == cpu->N, "%s: N %lld, CPU %lld", what, (long long)g->N, (long long)cpu->N);
  RANK_EXPECT(g->rows_device == g->N, "%s: recv_rows_device %lld, recv_rows %lld", what, (long long)g->rows_device,
              (long long)g->N);
  if (g->N != cpu->N) return;
  RANK_EXPECT(same_bytes(g->src_rank, cpu->src_rank, 4 * (size_t)N) && same_bytes(g->src_token, cpu->src_token, 4 * (size_t)N),
              "%s: recv_source differs from the CPU backend", what);
  RANK_EXPECT(same_bytes(g->recv_expert, cpu->recv_expert, 4 * (size_t)(N * g->slots)) &&
                  same_bytes(g->recv_w, cpu->recv_w, 4 * (size_t)(N * g->slots)),
              "%s: recv_routing differs from the CPU backend", what);
  RANK_EXPECT(same_bytes(g->counts, cpu->counts, 8 * (size_t)experts_local(c)) &&
                  same_bytes(g->offsets, cpu->offsets, 8 * (size_t)(experts_local(c) + 1)),
              "%s: expert counts/offsets differ from the CPU backend", what);
  RANK_EXPECT(E > 64 || same_bytes(g->load, cpu->load, 8 * (size_t)E),
              "%s: epx_buffer_expert_load differs from the CPU backend", what);
  RANK_EXPECT(same_bytes(g->recv_x, cpu->recv_x, (size_t)(N * H) * es), "%s: recv_x differs from the CPU backend (element %d)",
              what, first_diff(c->dtype, g->recv_x, cpu->recv_x, N * H));
  RANK_EXPECT(same_bytes(g->grad_eo, cpu->grad_eo, (size_t)(N * H) * es),
              "%s: grad_expert_out differs from the CPU backend (element %d)", what,
              first_diff(c->dtype, g->grad_eo, cpu->grad_eo, N * H));
  RANK_EXPECT(same_bytes(g->out, cpu->out, (size_t)(T * H) * es), "%s: combine differs from the CPU backend (element %d)",
              what, first_diff(c->dtype, g->out, cpu->out, T * H));
  /* float32 partials in every precision (epx.h): the CPU backend's bits */
  RANK_EXPECT(same_bytes(g->grad_x, cpu->grad_x, (size_t)(T * H) * es),
              "%s: dispatch_backward differs from the CPU backend (element %d)", what,
              first_diff(c->dtype, g->grad_x, cpu->grad_x, T * H));
  RANK_EXPECT(close_floats(g->gw_d, cpu->gw_d, T * K), "%s: dispatch_backward grad_w differs from the CPU backend", what);
  RANK_EXPECT(close_floats(g->gw_c, cpu->gw_c, T * K), "%s: combine_backward grad_w differs from the CPU backend", what);
  RANK_EXPECT(same_bytes(g->gw_w, cpu->gw_w, 4 * (size_t)(T * K)), "%s: weights_backward differs from the CPU backend", what);

  /* The formula, bit for bit, and provenance of the received rows. */
  routing_t rt;
  make_routing(c, g_rank, &rt);
  float *ref = calloc((size_t)(T * H + 1), 4);
  reference_sum(c, &rt, c->weighting == EPX_WEIGHTS_IN_COMBINE, 0, ref);
  void *refh = encode(c->dtype, ref, T * H);
  RANK_EXPECT(same_bytes(g->out, refh, (size_t)(T * H) * es), "%s: combine differs from the contract's sum (element %d)",
              what, first_diff(c->dtype, g->out, refh, T * H));
  free(refh);
  reference_sum(c, &rt, c->weighting == EPX_WEIGHTS_IN_DISPATCH, 1, ref);
  refh = encode(c->dtype, ref, T * H);
  RANK_EXPECT(same_bytes(g->grad_x, refh, (size_t)(T * H) * es),
              "%s: dispatch_backward differs from the contract's sum (element %d)", what,
              first_diff(c->dtype, g->grad_x, refh, T * H));
  free(refh);
  free(ref);
  int bad = 0;
  float *row = calloc(H, 4);
  for (int64_t i = 0; i < N && !bad; i++) {
    const int s = g->src_rank[i], t = g->src_token[i];
    if (s < 0) continue;
    const float wt = c->weighting == EPX_WEIGHTS_IN_DISPATCH ? g->recv_w[i * g->slots] : 1.0f;
    for (int h = 0; h < H; h++) row[h] = c->weighting == EPX_WEIGHTS_IN_DISPATCH ? wt * x_val(s, t, h) : x_val(s, t, h);
    void *enc = encode(c->dtype, row, H);
    bad = !same_bytes((const char *)g->recv_x + (size_t)(i * H) * es, enc, (size_t)H * es);
    free(enc);
  }
  free(row);
  RANK_EXPECT(!bad, "%s: a received row is not its source's (provenance)", what);
}

static void compare_exchanges(const case_t *c, const result_t *d, const result_t *x, const char *pair) {
  const char *what = describe(c, EPX_EXCHANGE_DEDUP);
  const size_t es = epx_dtype_size(c->dtype);
  RANK_EXPECT(d->N == x->N, "%s: dedup N %lld, %s %lld", what, (long long)d->N, pair, (long long)x->N);
  if (d->N != x->N) return;
  const int64_t T = d->T, N = d->N;
  RANK_EXPECT(same_bytes(d->recv_x, x->recv_x, (size_t)(N * H) * es) && same_bytes(d->out, x->out, (size_t)(T * H) * es) &&
                  same_bytes(d->grad_x, x->grad_x, (size_t)(T * H) * es) &&
                  same_bytes(d->grad_eo, x->grad_eo, (size_t)(N * H) * es) &&
                  same_bytes(d->gw_d, x->gw_d, 4 * (size_t)(T * K)) && same_bytes(d->gw_c, x->gw_c, 4 * (size_t)(T * K)) &&
                  same_bytes(d->gw_w, x->gw_w, 4 * (size_t)(T * K)),
              "%s: dedup and %s differ", what, pair);
}

/* The same dedup layout on two paths (fused, host, AUTO): every query the
 * same (the fused path answers them from its plan, the host path from its
 * layout), the stats too. */
static void compare_queries(const case_t *c, const result_t *a, const result_t *x, const char *pair) {
  const char *what = describe(c, EPX_EXCHANGE_DEDUP);
  const int El = experts_local(c);
  RANK_EXPECT(a->N == x->N && a->rows_device == x->rows_device, "%s: N %lld / %lld (device), %s %lld / %lld", what,
              (long long)a->N, (long long)a->rows_device, pair, (long long)x->N, (long long)x->rows_device);
  if (a->N != x->N) return;
  const size_t N = (size_t)a->N;
  RANK_EXPECT(same_bytes(a->src_rank, x->src_rank, 4 * N) && same_bytes(a->src_token, x->src_token, 4 * N) &&
                  same_bytes(a->recv_expert, x->recv_expert, 4 * N * (size_t)a->slots) &&
                  same_bytes(a->recv_w, x->recv_w, 4 * N * (size_t)a->slots) &&
                  same_bytes(a->counts, x->counts, 8 * (size_t)El) && same_bytes(a->offsets, x->offsets, 8 * (size_t)(El + 1)),
              "%s: the handle's queries differ from %s", what, pair);
  RANK_EXPECT(!memcmp(&a->stats, &x->stats, sizeof a->stats),
              "%s: stats (send %lld, recv %lld, local %lld) differ from %s (%lld, %lld, %lld)", what,
              (long long)a->stats.send_rows, (long long)a->stats.recv_rows, (long long)a->stats.local_rows, pair,
              (long long)x->stats.send_rows, (long long)x->stats.recv_rows, (long long)x->stats.local_rows);
}

/* Buffers made between the two are relayed (g_relay). */
static void relay_begin(void) {
  rank_sync();
  epx_cuda_set_launch_flags(epx_cuda_launch_flags() | EPX_CUDA_FUSED_RELAY);
  g_relay = 1;
}
static void relay_end(void) {
  rank_sync();
  epx_cuda_set_launch_flags(epx_cuda_launch_flags() & ~EPX_CUDA_FUSED_RELAY);
  g_relay = 0;
}

/* The path a buffer of this case took, made with exchange_path `asked`:
 * fused exactly where the config and build allow it (the same answer for
 * every peer in this version). */
static void check_path(const case_t *c, epx_exchange_t x, epx_exchange_path_t asked, const result_t *g) {
  const int fused_ok = (asked == EPX_PATH_FUSED || (asked == EPX_PATH_AUTO && c->layout == EPX_LAYOUT_RANK_MAJOR)) &&
                       x == EPX_EXCHANGE_DEDUP;
  RANK_EXPECT(g->path == EPX_PATH_FUSED || g->path == EPX_PATH_HOST, "%s: peers on different paths (%d)",
              describe(c, x), g->path);
  if (!fused_ok) RANK_EXPECT(g->path == EPX_PATH_HOST, "%s: path %d, the host path expected", describe(c, x), g->path);
  else if (g_expect_fused)
    RANK_EXPECT(g->path == EPX_PATH_FUSED, "%s: path %d, the fused path expected (EPX_GPU_EXPECT_FUSED): %s",
                describe(c, x), g->path, g->why[0] ? g->why : "no reason given");
}

/* The dedup run of case c on `path` (g_path for its buffers), compared bit
 * for bit with `fused` (the case's dedup run on the fused path); `check`:
 * its path checked against the one asked. `what` names the run. */
static void compare_dedup_run(const case_t *c, epx_comm_t nccl, void *stream, const result_t *fused,
                              epx_exchange_path_t path, int check, const char *what) {
  run_t run = {c, EPX_EXCHANGE_DEDUP, nccl, g_rank, EPX_DEVICE_CUDA, {0}, stream};
  g_path = path;
  run_rank(&run);
  g_path = EPX_PATH_FUSED;
  if (check) check_path(c, EPX_EXCHANGE_DEDUP, path, &run.res);
  compare_exchanges(c, fused, &run.res, what);
  compare_queries(c, fused, &run.res, what);
  result_free(&run.res);
}

/* The dedup run of case c with launch flag `flag` toggled, against `fused`. */
static void compare_flagged(const case_t *c, epx_comm_t nccl, void *stream, const result_t *fused, int flag,
                            const char *what) {
  const int flags = epx_cuda_launch_flags();
  rank_sync();
  epx_cuda_set_launch_flags(flags ^ flag);
  compare_dedup_run(c, nccl, stream, fused, EPX_PATH_FUSED, 0, what);
  rank_sync();
  epx_cuda_set_launch_flags(flags);
}

static void run_case(const case_t *c, epx_comm_t nccl, void *stream) {
  result_t gpu[2], cpu;
  for (int xi = 0; xi < 2; xi++) {
    const epx_exchange_t x = xi ? EPX_EXCHANGE_COLLECTIVE : EPX_EXCHANGE_DEDUP;
    run_t run = {c, x, nccl, g_rank, EPX_DEVICE_CUDA, {0}, stream};
    run_rank(&run);
    gpu[xi] = run.res;
    check_path(c, x, g_path, &gpu[xi]);
    run_cpu(c, x, &cpu);
    compare(c, x, &gpu[xi], &cpu);
    result_free(&cpu);
  }
  compare_exchanges(c, &gpu[0], &gpu[1], "collective");
  if (!c->worst) {
    /* The hierarchical exchange (ep/hier.c; worst_case_sizing is refused,
     * test_hier_refusals): hop 1 to the same local index on each other node
     * of the comm (EPX_GPU_RANKS_PER_NODE poses them), hop 2 inside the
     * node; the same bits as dedup and collective, dedup's items counted. */
    run_t run = {c, EPX_EXCHANGE_HIERARCHICAL, nccl, g_rank, EPX_DEVICE_CUDA, {0}, stream};
    run_rank(&run);
    check_path(c, EPX_EXCHANGE_HIERARCHICAL, g_path, &run.res);
    /* With one node, or one rank per node (what 1 and 2 GPUs pose), the
     * two-level sum is the one-level one and hop 1 carries dedup's
     * cross-node rows, hop 2 its same-node rows. Else (4 GPUs or more posed
     * as nodes of 2 or more) the CUDA dedup and collective exchanges still
     * sum in one level: the reference is the CPU's hierarchical exchange on
     * threads posed alike, and hop 1 carries fewer rows than dedup. */
    const int flat = g_nodes == 1 || g_ranks_per_node == 1;
    if (flat) {
      compare_exchanges(c, &gpu[0], &run.res, "hierarchical");
      compare_exchanges(c, &gpu[1], &run.res, "hierarchical (the left side is the collective run)");
    } else {
      result_t cpu_hier;
      run_cpu_posed(c, EPX_EXCHANGE_HIERARCHICAL, g_ranks_per_node, &cpu_hier);
      const result_t *g = &run.res;
      const size_t es = epx_dtype_size(c->dtype), TH = (size_t)(g->T * H) * es, NH = (size_t)(g->N * H) * es;
      RANK_EXPECT(g->N == cpu_hier.N && same_bytes(g->recv_x, cpu_hier.recv_x, NH) &&
                      same_bytes(g->out, cpu_hier.out, TH) && same_bytes(g->grad_x, cpu_hier.grad_x, TH) &&
                      same_bytes(g->grad_eo, cpu_hier.grad_eo, NH) &&
                      same_bytes(g->gw_w, cpu_hier.gw_w, 4 * (size_t)(g->T * K)) &&
                      close_floats(g->gw_d, cpu_hier.gw_d, g->T * K) && close_floats(g->gw_c, cpu_hier.gw_c, g->T * K),
                  "%s: differs from the CPU's hierarchical exchange on nodes of %d",
                  describe(c, EPX_EXCHANGE_HIERARCHICAL), (int)g_ranks_per_node);
      result_free(&cpu_hier);
    }
    compare_queries(c, &gpu[0], &run.res, "hierarchical");
    const epx_handle_traffic_t *d = &gpu[0].traffic, *x = &run.res.traffic;
    RANK_EXPECT(flat ? !memcmp(d, x, sizeof *d) : x->other_node_rows <= d->other_node_rows,
                "%s: hierarchical sends %lld rows in the node and %lld across, dedup %lld "
                "and %lld", describe(c, EPX_EXCHANGE_HIERARCHICAL), (long long)x->same_node_rows,
                (long long)x->other_node_rows, (long long)d->same_node_rows, (long long)d->other_node_rows);
    result_free(&run.res);
    g_hier_cases++;
  }
  /* Expert-major and capacity: the fused rows expanded into expert order
   * the other way (the receiving CTAs as rows arrive, or a kernel of its
   * own after the exchange; the capacity layout always the latter).
   * Rank-major: the rows copied out by the copy engine (forced at any SM
   * budget; with worst_case_sizing the whole bound). The same bits. */
  if (c->layout != EPX_LAYOUT_RANK_MAJOR)
    compare_flagged(c, nccl, stream, &gpu[0], EPX_CUDA_FUSED_EXPAND_APART,
                    "the other fused expansion (EPX_CUDA_FUSED_EXPAND_APART)");
  else
    compare_flagged(c, nccl, stream, &gpu[0], EPX_CUDA_FUSED_COPY_ENGINE,
                    "the copy-out by the copy engine (EPX_CUDA_FUSED_COPY_ENGINE)");
  /* The mixed path: the fused kernels with every other peer relayed through
   * NCCL's host API, as peers without load/store access are (reported
   * EPX_PATH_HOST per peer): the same bits. */
  relay_begin();
  compare_dedup_run(c, nccl, stream, &gpu[0], EPX_PATH_FUSED, 1, "the relayed peers (EPX_CUDA_FUSED_RELAY)");
  relay_end();
  /* The same dedup buffer forced onto the host path, and the default, AUTO
   * (the fused kernels for rank-major, the host path for expert-major and
   * capacity: epx.h): the same bits. */
  compare_dedup_run(c, nccl, stream, &gpu[0], EPX_PATH_HOST, 1, "the host path (EPX_PATH_HOST)");
  compare_dedup_run(c, nccl, stream, &gpu[0], EPX_PATH_AUTO, 1, "the default path (EPX_PATH_AUTO)");
  result_free(&gpu[0]);
  result_free(&gpu[1]);
}

/* ------------------------------------------------------------------------ */
/* Refusal, recorder, graph                                                  */
/* ------------------------------------------------------------------------ */

/* The config of the refusal and mismatch tests' buffers (bf16, expert-major,
 * the test's shape) on the path main sets. */
static epx_buffer_config_t simple_config(void *stream, int worst) {
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_BFLOAT16, H, E, K, TMAX);
  cfg.worst_case_sizing = worst;
  cfg.stream = stream;
  cfg.exchange_path = g_path; /* main runs these tests on the fused path and on the host path */
  return cfg;
}

static epx_buffer_t simple_buffer(epx_comm_t comm, void *stream, int worst) {
  const epx_buffer_config_t cfg = simple_config(stream, worst);
  epx_buffer_t b;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &b));
  return b;
}

/* A CUDA buffer's hierarchical exchange plans its hops from the routing read
 * back at the layout: with worst_case_sizing (no wait there) it is refused
 * by name at epx_buffer_create, where EPX_EXCHANGE_AUTO makes the buffer. */
static void test_hier_refusals(epx_comm_t comm, void *stream) {
  epx_buffer_config_t cfg = simple_config(stream, 1);
  cfg.exchange = EPX_EXCHANGE_HIERARCHICAL;
  epx_buffer_t b = NULL;
  const epx_status_t s = epx_buffer_create(comm, &cfg, &b);
  RANK_EXPECT(s == EPX_ERROR_UNSUPPORTED && strstr(epx_last_error(), "worst_case_sizing"),
              "hierarchical with worst_case_sizing: status %d (%s), EPX_ERROR_UNSUPPORTED naming it expected", (int)s,
              epx_last_error());
  if (s == EPX_SUCCESS) epx_buffer_destroy(b);
  cfg.exchange = EPX_EXCHANGE_AUTO;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &b));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
}

/* This rank's seeded routing for the tests below, on the device: the host
 * copy, its ids, weights and locations, and the epx_routing_t over them (no
 * weights with EPX_WEIGHTS_NONE, locations with the capacity layout only). */
typedef struct {
  routing_t rt;
  int32_t *idx, *loc;
  float *w;
  epx_routing_t r;
} test_routing_t;

static void test_routing(epx_layout_t layout, epx_weighting_t weighting, int skew, int seed, test_routing_t *t) {
  const case_t c = {layout, EPX_BFLOAT16, weighting, 0, 0, skew, 0, seed, PLACE_NONE};
  make_routing(&c, g_rank, &t->rt);
  t->idx = dev_put(t->rt.idx, sizeof t->rt.idx);
  t->loc = dev_put(t->rt.loc, sizeof t->rt.loc);
  t->w = dev_put(t->rt.w, sizeof t->rt.w);
  t->r = (epx_routing_t){t->rt.T, K, t->idx, weighting == EPX_WEIGHTS_NONE ? NULL : t->w,
                         layout == EPX_LAYOUT_CAPACITY ? t->loc : NULL, weighting};
}

static void test_routing_free(test_routing_t *t) {
  cudaFree(t->idx);
  cudaFree(t->loc);
  cudaFree(t->w);
}

/* The last rank's batch is over max_tokens_per_rank. Default sizing: every
 * rank refuses the layout, no handle. worst_case_sizing: the last rank
 * refuses, its peers get a handle that moved nothing (recv_rows_device 0)
 * and whose recv_rows names the rank. The comm keeps working either way. */
static void test_capacity_refusal(epx_comm_t comm, void *stream, int worst) {
  epx_buffer_t b = simple_buffer(comm, stream, worst);
  test_routing_t tr;
  test_routing(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 0, 11, &tr);
  /* the last rank is over the agreed TMAX */
  epx_routing_t r = tr.r;
  if (g_rank == g_size - 1) r.num_tokens = TMAX + 1;
  int32_t *big = NULL;
  if (g_rank == g_size - 1) {
    FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&big, 4 * (TMAX + 1) * K));
    FATAL_UNLESS_CUDA_OK(cudaMemset(big, 0xff, 4 * (TMAX + 1) * K));
    r.topk_idx = big;
    r.topk_w = NULL;
    r.weighting = EPX_WEIGHTS_NONE;
  }
  epx_handle_t h = NULL;
  epx_status_t s = epx_dispatch_layout(b, &r, NULL, &h);
  if (worst && g_rank != g_size - 1) {
    RANK_EXPECT(s == EPX_SUCCESS && h, "capacity refusal (worst case): rank %d got %s (%s)", g_rank, epx_status_string(s),
                epx_last_error());
    if (h) {
      const int64_t *d_rows = NULL;
      int64_t rows = -1;
      FATAL_UNLESS_OK(epx_handle_recv_rows_device(h, &d_rows));
      /* the layout did not wait (worst_case_sizing), and the buffer's stream
       * does not synchronise with cudaMemcpy's */
      FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
      FATAL_UNLESS_CUDA_OK(cudaMemcpy(&rows, d_rows, sizeof rows, cudaMemcpyDeviceToHost));
      RANK_EXPECT(rows == 0, "capacity refusal (worst case): rank %d laid out %lld rows", g_rank, (long long)rows);
      char named[32];
      snprintf(named, sizeof named, "rank %d", g_size - 1);
      s = epx_handle_recv_rows(h, &rows);
      RANK_EXPECT(s == EPX_ERROR_CAPACITY_EXCEEDED && strstr(epx_last_error(), named),
                  "capacity refusal (worst case): recv_rows on rank %d got %s (%s)", g_rank, epx_status_string(s),
                  epx_last_error());
      FATAL_UNLESS_OK(epx_handle_release(h));
      h = NULL;
    }
  } else {
    RANK_EXPECT(s == EPX_ERROR_CAPACITY_EXCEEDED, "capacity refusal (worst %d): rank %d got %s (%s)", worst, g_rank,
                epx_status_string(s), epx_last_error());
    RANK_EXPECT(h == NULL, "capacity refusal: a handle came back");
  }
  /* the comm still works */
  FATAL_UNLESS_OK(epx_dispatch_layout(b, &tr.r, NULL, &h));
  FATAL_UNLESS_OK(epx_handle_release(h));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  test_routing_free(&tr);
  cudaFree(big);
}

/* After a refused layout the buffer and comm keep working: an agreeing
 * layout on every rank, its row count read (the wait of worst_case_sizing). */
static void layout_still_works(epx_buffer_t b, const epx_routing_t *r) {
  epx_handle_t h = NULL;
  int64_t rows = 0;
  FATAL_UNLESS_OK(epx_dispatch_layout(b, r, NULL, &h));
  FATAL_UNLESS_OK(epx_handle_recv_rows(h, &rows));
  FATAL_UNLESS_OK(epx_handle_release(h));
}

/* The layout of a routing some rank refuses: with default sizing no handle
 * comes back and the layout's status is the verdict; with worst_case_sizing
 * the layout succeeds and epx_handle_recv_rows gives it. Returns the verdict
 * and copies its message to why (read before the handle is released). */
static epx_status_t refused_layout(epx_buffer_t b, const epx_routing_t *r, int worst, const char *what, char *why,
                                   size_t why_size) {
  epx_handle_t h = NULL;
  epx_status_t s = epx_dispatch_layout(b, r, NULL, &h);
  if (worst) {
    RANK_EXPECT(s == EPX_SUCCESS && h, "%s (worst case): the layout returned %s (%s)", what, epx_status_string(s),
                epx_last_error());
    int64_t rows = 0;
    s = h ? epx_handle_recv_rows(h, &rows) : EPX_ERROR_INTERNAL;
  } else {
    RANK_EXPECT(h == NULL, "%s: a handle came back", what);
  }
  snprintf(why, why_size, "%s", epx_last_error());
  if (h) FATAL_UNLESS_OK(epx_handle_release(h));
  return s;
}

/* Rank `bad` refused its own routing (EPX_ERROR_INVALID_ARGUMENT, the
 * message holding `route` and, where given, `reason`), its peers because of
 * it (EPX_ERROR_PEER_FAILED naming the rank). */
static void check_one_rank_refused(epx_status_t s, const char *why, int bad, const char *route, const char *reason,
                                   const char *what) {
  char named[48];
  snprintf(named, sizeof named, "rank %d", bad);
  if (g_rank == bad)
    RANK_EXPECT(s == EPX_ERROR_INVALID_ARGUMENT && strstr(why, route) && (!reason || strstr(why, reason)),
                "%s: rank %d got %s (%s)", what, g_rank, epx_status_string(s), why);
  else
    RANK_EXPECT(s == EPX_ERROR_PEER_FAILED && strstr(why, named), "%s: rank %d got %s (%s)", what, g_rank,
                epx_status_string(s), why);
}

/* The last rank routes with another weighting: refused on every rank with
 * EPX_ERROR_SHAPE_MISMATCH naming rank 0's weighting and the last rank's.
 * Default sizing: at the layout, before anything moves, no handle; with
 * worst_case_sizing the layout does not wait, so epx_handle_recv_rows
 * reports it on every rank. The buffer keeps working either way. */
static void test_weighting_mismatch(epx_comm_t comm, void *stream, int worst) {
  epx_buffer_t b = simple_buffer(comm, stream, worst);
  test_routing_t tr;
  test_routing(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 0, 13, &tr);
  epx_routing_t r = tr.r;
  if (g_rank == g_size - 1) r.weighting = EPX_WEIGHTS_IN_DISPATCH;
  char named[64];
  snprintf(named, sizeof named, "rank %d with EPX_WEIGHTS_IN_DISPATCH", g_size - 1);
  char why[1024];
  const epx_status_t s = refused_layout(b, &r, worst, "weighting mismatch", why, sizeof why);
  RANK_EXPECT(s == EPX_ERROR_SHAPE_MISMATCH && strstr(why, named) && strstr(why, "routing.weighting"),
              "weighting mismatch (worst %d): rank %d got %s (%s)", worst, g_rank, epx_status_string(s), why);
  layout_still_works(b, &tr.r);
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  test_routing_free(&tr);
}

/* An invalid route on one rank (an expert id out of range on the last rank,
 * or a duplicate on rank 0): that rank gets EPX_ERROR_INVALID_ARGUMENT naming
 * the route, the others EPX_ERROR_PEER_FAILED naming the rank; no handle at
 * the layout with default sizing, the same errors from epx_handle_recv_rows
 * with worst_case_sizing. The buffer keeps working. */
static void test_invalid_routing(epx_comm_t comm, void *stream, int worst, int duplicate) {
  epx_buffer_t b = simple_buffer(comm, stream, worst);
  test_routing_t tr;
  test_routing(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 0, 19, &tr);
  const int bad = duplicate ? 0 : g_size - 1;
  routing_t wrong = tr.rt;
  if (g_rank == bad && tr.rt.T > 5) {
    if (duplicate) wrong.idx[5 * K + 0] = 3, wrong.idx[5 * K + 2] = 3;
    else wrong.idx[3 * K + 1] = E + 5;
  }
  int32_t *idx = dev_put(wrong.idx, sizeof wrong.idx);
  epx_routing_t r = tr.r;
  r.topk_idx = idx;
  char why[1024], what[64];
  snprintf(what, sizeof what, "invalid routing (worst %d, duplicate %d)", worst, duplicate);
  const epx_status_t s = refused_layout(b, &r, worst, what, why, sizeof why);
  check_one_rank_refused(s, why, bad, duplicate ? "routing.topk_idx[5] names" : "routing.topk_idx[3][1]", NULL,
                         what);
  layout_still_works(b, &tr.r);
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  test_routing_free(&tr);
  cudaFree(idx);
}

/* Capacity slots (the capacity layout): on the last rank, a route's location
 * outside [0, C) (bad_location) or a slot an earlier route of the same
 * expert took: that rank gets EPX_ERROR_INVALID_ARGUMENT naming the
 * route's routing.locations entry, the others EPX_ERROR_PEER_FAILED naming
 * the rank, as for an invalid expert (test_invalid_routing); the earlier
 * route keeps its slot. The buffer keeps working. */
static void test_capacity_slots(epx_comm_t comm, void *stream, int worst, int bad_location) {
  epx_buffer_config_t cfg = simple_config(stream, worst);
  cfg.layout = EPX_LAYOUT_CAPACITY;
  cfg.capacity = C;
  epx_buffer_t b;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &b));
  test_routing_t tr;
  test_routing(EPX_LAYOUT_CAPACITY, EPX_WEIGHTS_IN_COMBINE, 0, 23, &tr);
  const routing_t rt = tr.rt;
  const int bad = g_size - 1;
  routing_t wrong = rt;
  /* the first route of the last rank's token 4 or later whose expert an
   * earlier route of this rank also fills (that route took location 0) */
  int64_t at = -1;
  for (int64_t i = 4 * K; i < rt.T * K && at < 0 && g_rank == bad; i++)
    if (rt.idx[i] >= 0 && rt.loc[i] > 0) at = i;
  if (at >= 0) wrong.loc[at] = bad_location ? C + 2 : 0;
  int32_t *loc = dev_put(wrong.loc, sizeof wrong.loc);
  epx_routing_t r = tr.r;
  r.locations = loc;
  char why[1024], what[64], entry[64];
  snprintf(what, sizeof what, "capacity slots (worst %d, bad location %d)", worst, bad_location);
  const epx_status_t s = refused_layout(b, &r, worst, what, why, sizeof why);
  /* the bad rank found a route to spoil (else the test would test nothing) */
  RANK_EXPECT(g_rank != bad || at >= 0, "%s: rank %d has no route of a filled expert to spoil", what, g_rank);
  snprintf(entry, sizeof entry, "routing.locations[%lld][%d]", (long long)(at / K), (int)(at % K));
  check_one_rank_refused(s, why, bad, entry, bad_location ? "outside the capacity" : "taken twice", what);
  layout_still_works(b, &tr.r);
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  test_routing_free(&tr);
  cudaFree(loc);
}

/* The last rank calls epx_combine where the others call epx_dispatch (same
 * handle): every rank gets EPX_ERROR_SHAPE_MISMATCH naming both calls and
 * nothing moves; then a buffer whose combine_precision differs on the last
 * rank is refused at creation on every rank, naming it. The comm keeps
 * working. */
static void test_call_mismatch(epx_comm_t comm, void *stream) {
  epx_buffer_t b = simple_buffer(comm, stream, 0);
  test_routing_t tr;
  test_routing(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 0, 17, &tr);
  epx_handle_t h = NULL;
  FATAL_UNLESS_OK(epx_dispatch_layout(b, &tr.r, NULL, &h));
  int64_t rows = 0, cap = 0;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h, &rows));
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(b, &cap));
  void *x = zeros(EPX_DEVICE_CUDA, 2 * (size_t)TMAX * H), *recv = zeros(EPX_DEVICE_CUDA, 2 * (size_t)cap * H + 16);
  epx_status_t s = g_rank == g_size - 1 ? epx_combine(b, h, recv, x) : epx_dispatch(b, h, x, recv, cap);
  RANK_EXPECT(s == EPX_ERROR_SHAPE_MISMATCH && strstr(epx_last_error(), "different collective calls") &&
                  strstr(epx_last_error(), "epx_combine") && strstr(epx_last_error(), "epx_dispatch"),
              "call mismatch: rank %d got %s (%s)", g_rank, epx_status_string(s), epx_last_error());
  FATAL_UNLESS_OK(epx_dispatch(b, h, x, recv, cap)); /* in step again */
  FATAL_UNLESS_OK(epx_handle_release(h));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  epx_buffer_config_t cfg = simple_config(stream, 0);
  cfg.exchange_path = EPX_PATH_AUTO;
  cfg.combine_precision = g_rank == g_size - 1 ? EPX_COMBINE_PARTIALS_PAYLOAD : EPX_COMBINE_PARTIALS_FLOAT32;
  epx_buffer_t odd = NULL;
  char named[32];
  snprintf(named, sizeof named, "rank %d", g_size - 1);
  s = epx_buffer_create(comm, &cfg, &odd);
  RANK_EXPECT(s == EPX_ERROR_SHAPE_MISMATCH && odd == NULL && strstr(epx_last_error(), named) &&
                  strstr(epx_last_error(), "combine_precision"),
              "config mismatch: rank %d got %s (%s)", g_rank, epx_status_string(s), epx_last_error());
  test_routing_free(&tr);
  cudaFree(x), cudaFree(recv);
}

static void test_recorder(epx_comm_t comm, void *stream) {
  epx_buffer_t b = simple_buffer(comm, stream, 0);
  test_routing_t tr;
  test_routing(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 1, 12, &tr);
  routing_t rt = tr.rt;
  int32_t *idx = tr.idx;
  const epx_routing_t r = tr.r;
  epx_recorder_t rec;
  FATAL_UNLESS_OK(epx_recorder_create(1, &rec));
  epx_recorder_stats_t before, held;
  FATAL_UNLESS_OK(epx_recorder_stats(rec, &before));
  epx_handle_t h1, h2, h3 = NULL;
  FATAL_UNLESS_OK(epx_dispatch_layout(b, &r, rec, &h1));
  /* A recorded handle of the W-rank backend holds its layout (the one-GPU
   * backend's reports none): proof that the W-rank code ran, one rank
   * included (epx_cuda_ep_at_one_rank). */
  FATAL_UNLESS_OK(epx_recorder_stats(rec, &held));
  RANK_EXPECT(held.bytes_held > before.bytes_held, "recorder: the handle holds no W-rank layout (%lld bytes, %lld before)",
              (long long)held.bytes_held, (long long)before.bytes_held);
  int64_t N, cap;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h1, &N));
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(b, &cap));
  const size_t rb = 2 * H;
  float *xv = calloc((size_t)(TMAX * H), 4);
  for (int64_t i = 0; i < rt.T * H; i++) xv[i] = x_val(g_rank, (int)(i / H), (int)(i % H));
  void *xh = encode(EPX_BFLOAT16, xv, rt.T * H);
  void *x = dev_put(xh, (size_t)rt.T * rb), *y1, *y2;
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&y1, (size_t)cap * rb + 16));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&y2, (size_t)cap * rb + 16));
  FATAL_UNLESS_CUDA_OK(cudaMemset(y2, 0x5a, (size_t)cap * rb));
  FATAL_UNLESS_OK(epx_dispatch(b, h1, x, y1, cap));
  FATAL_UNLESS_OK(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
  FATAL_UNLESS_OK(epx_dispatch_layout(b, &r, rec, &h2));
  RANK_EXPECT(h2 == h1, "recorder: the replay did not return the recorded handle");
  FATAL_UNLESS_OK(epx_dispatch(b, h2, x, y2, cap)); /* cached dispatch */
  FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  void *a = host_get(y1, (size_t)N * rb), *bb = host_get(y2, (size_t)N * rb);
  RANK_EXPECT(same_bytes(a, bb, (size_t)N * rb), "recorder: the cached dispatch differs from the original");
  free(a), free(bb);
  /* a second replay past the log falls back; a different routing on rank 0 is refused everywhere */
  FATAL_UNLESS_OK(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
  if (g_rank == 0 && rt.T > 0) {
    rt.idx[0] = rt.idx[0] == 0 ? 1 : 0;
    rt.idx[1] = -1, rt.idx[2] = -1, rt.idx[3] = -1;
    FATAL_UNLESS_CUDA_OK(cudaMemcpy(idx, rt.idx, sizeof rt.idx, cudaMemcpyHostToDevice));
  }
  epx_status_t s = epx_dispatch_layout(b, &r, rec, &h3);
  RANK_EXPECT(s == (g_rank == 0 ? EPX_ERROR_REPLAY_MISMATCH : EPX_ERROR_PEER_FAILED),
              "recorder: a changed routing replayed with %s on rank %d (%s)", epx_status_string(s), g_rank, epx_last_error());
  epx_recorder_stats_t st;
  FATAL_UNLESS_OK(epx_recorder_stats(rec, &st));
  RANK_EXPECT(st.records == 1 && st.replays >= 1, "recorder: %lld records, %lld replays", (long long)st.records,
              (long long)st.replays);
  FATAL_UNLESS_OK(epx_handle_release(h2));
  FATAL_UNLESS_OK(epx_handle_release(h1));
  FATAL_UNLESS_OK(epx_recorder_destroy(rec));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  test_routing_free(&tr);
  cudaFree(x), cudaFree(y1), cudaFree(y2);
  free(xv), free(xh);
}

/* The whole step once outside and once inside a CUDA graph. */
typedef struct {
  void *x, *recv, *eo, *out, *go, *geo, *gx;
  float *gw;
  int64_t cap;
} step_t;

static epx_handle_t step(epx_buffer_t b, const epx_routing_t *r, const step_t *s) {
  epx_handle_t h;
  FATAL_UNLESS_OK(epx_dispatch_layout(b, r, NULL, &h));
  FATAL_UNLESS_OK(epx_dispatch(b, h, s->x, s->recv, s->cap));
  FATAL_UNLESS_OK(epx_combine(b, h, s->eo, s->out));
  FATAL_UNLESS_OK(epx_dispatch_backward(b, h, s->eo, s->gx, NULL, NULL));
  FATAL_UNLESS_OK(epx_combine_backward(b, h, s->go, s->eo, s->geo, s->gw));
  return h;
}

static void test_graph(epx_comm_t comm, cudaStream_t stream) {
  epx_buffer_t b = simple_buffer(comm, stream, 1);
  test_routing_t tr;
  test_routing(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 0, 13, &tr);
  const routing_t rt = tr.rt;
  const epx_routing_t r = tr.r;
  int64_t cap;
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(b, &cap));
  const size_t rb = 2 * H;
  step_t s[2];
  float *v = calloc((size_t)(cap > TMAX ? cap : TMAX) * H, 4);
  for (int64_t i = 0; i < cap * H; i++) v[i] = code((int)(i % 13), g_rank, (int)(i / H), (int)(i % H));
  void *vh = encode(EPX_BFLOAT16, v, cap * H);
  for (int i = 0; i < 2; i++) {
    s[i].cap = cap;
    s[i].x = dev_put(vh, (size_t)TMAX * rb);
    s[i].go = dev_put(vh, (size_t)TMAX * rb);
    s[i].eo = dev_put(vh, (size_t)cap * rb);
    void **outs[] = {&s[i].recv, &s[i].out, &s[i].geo, &s[i].gx};
    const size_t rows[] = {(size_t)cap, TMAX, (size_t)cap, TMAX};
    for (int j = 0; j < 4; j++) {
      FATAL_UNLESS_CUDA_OK(cudaMalloc(outs[j], rows[j] * rb));
      FATAL_UNLESS_CUDA_OK(cudaMemset(*outs[j], 0x33 * (i + 1), rows[j] * rb));
    }
    FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&s[i].gw, 4 * TMAX * K));
  }
  epx_handle_t h0 = step(b, &r, &s[0]); /* outside: also sizes the staging */
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FATAL_UNLESS_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  epx_handle_t h1 = step(b, &r, &s[1]);
  FATAL_UNLESS_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  FATAL_UNLESS_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  FATAL_UNLESS_CUDA_OK(cudaGraphLaunch(exec, stream));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  int64_t n0, n1;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h0, &n0));
  FATAL_UNLESS_OK(epx_handle_recv_rows(h1, &n1));
  RANK_EXPECT(n0 == n1, "graph: %lld rows captured, %lld outside", (long long)n1, (long long)n0);
  const size_t sizes[] = {(size_t)n0 * rb, (size_t)rt.T * rb, (size_t)n0 * rb, (size_t)rt.T * rb, 4 * (size_t)rt.T * K};
  for (int j = 0; j < 5; j++) {
    void *p0[] = {s[0].recv, s[0].out, s[0].geo, s[0].gx, s[0].gw}, *p1[] = {s[1].recv, s[1].out, s[1].geo, s[1].gx, s[1].gw};
    void *a = host_get(p0[j], sizes[j]), *bb = host_get(p1[j], sizes[j]);
    RANK_EXPECT(same_bytes(a, bb, sizes[j]), "graph: output %d of the captured step differs from the uncaptured one", j);
    free(a), free(bb);
  }
  FATAL_UNLESS_OK(epx_handle_release(h0));
  FATAL_UNLESS_OK(epx_handle_release(h1));
  FATAL_UNLESS_CUDA_OK(cudaGraphExecDestroy(exec));
  FATAL_UNLESS_CUDA_OK(cudaGraphDestroy(graph));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  for (int i = 0; i < 2; i++) {
    void *p[] = {s[i].x, s[i].go, s[i].eo, s[i].recv, s[i].out, s[i].geo, s[i].gx, s[i].gw};
    for (int j = 0; j < 8; j++) cudaFree(p[j]);
  }
  test_routing_free(&tr);
  free(v), free(vh);
}

/* The fused path refused on one rank only (the last has no memory for its
 * window): every rank agrees at creation and takes the host path (epx.h,
 * EPX_PATH_AUTO), instead of its peers waiting for it in the window's
 * registration until the comm times out. The buffer is created on every
 * rank and works; the last rank's reason names the allocation, its peers'
 * name the rank. With the fused module only (EPX_GPU_EXPECT_FUSED). */
static void test_fused_refused_on_one_rank(epx_comm_t comm, void *stream) {
  enum { BIG_H = 7168, BIG_T = 4096 }; /* a window of about W * 4096 * 7168 * 6 bytes: 352 MB on 2 ranks */
  const int last = g_rank == g_size - 1;
  void *hog = NULL;
  if (last) {
    /* all but 128 MB of the GPU: less than the window, enough for the rest */
    size_t free_bytes = 0, total = 0, step = (size_t)64 << 20, spare = (size_t)128 << 20;
    FATAL_UNLESS_CUDA_OK(cudaMemGetInfo(&free_bytes, &total));
    for (size_t take = free_bytes > spare ? free_bytes - spare : 0; take > step && !hog; take -= step)
      if (cudaMalloc(&hog, take) != cudaSuccess) hog = NULL, (void)cudaGetLastError();
    RANK_EXPECT(hog != NULL, "fused refusal: rank %d could not take the GPU's memory", g_rank);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  epx_buffer_config_t cfg = simple_config(stream, 0);
  cfg.hidden = BIG_H;
  cfg.max_tokens_per_rank = BIG_T;
  cfg.layout = EPX_LAYOUT_RANK_MAJOR;
  cfg.exchange_path = EPX_PATH_AUTO;
  epx_buffer_t b = NULL;
  const epx_status_t s = epx_buffer_create(comm, &cfg, &b);
  char why[1024];
  snprintf(why, sizeof why, "%s", epx_last_error());
  RANK_EXPECT(s == EPX_SUCCESS, "fused refusal: epx_buffer_create on rank %d got %s (%s)", g_rank, epx_status_string(s),
              why);
  if (s == EPX_SUCCESS) {
    int32_t paths[64] = {0};
    FATAL_UNLESS_OK(epx_buffer_peer_paths(b, paths));
    for (int p = 0; p < g_size && p < 64; p++)
      RANK_EXPECT(paths[p] == EPX_PATH_HOST, "fused refusal: rank %d's path to %d is %d, not the host path", g_rank, p,
                  (int)paths[p]);
    char named[32];
    snprintf(named, sizeof named, "rank %d", g_size - 1);
    RANK_EXPECT(strstr(why, "refused") && strstr(why, last ? "ncclMemAlloc" : named),
                "fused refusal: rank %d's reason does not say who or why: %s", g_rank, why);
    test_routing_t tr;
    test_routing(EPX_LAYOUT_RANK_MAJOR, EPX_WEIGHTS_NONE, 0, 17, &tr);
    layout_still_works(b, &tr.r);
    FATAL_UNLESS_OK(epx_buffer_destroy(b));
    test_routing_free(&tr);
  }
  if (hog) cudaFree(hog);
  MPI_Barrier(MPI_COMM_WORLD);
}

/* ------------------------------------------------------------------------ */
/* The summation order of grad_w's dots                                      */
/* ------------------------------------------------------------------------ */

/* The coded payloads above make every dot of grad_w exact whatever its
 * order, so they cannot tell a fused kernel that sums a dot in another order
 * than the host path. Here the payloads are inexact: pseudo-random values in
 * [-1, 1) rounded to the dtype, each row still a pure function of its
 * provenance (salt, expert or rank, source rank, source token), so every rank
 * forms the reference of its own tokens' dots without communication. H =
 * 1544: 193 chunks of 8, more than one 512-element step and a partial last
 * one. */
enum { DOT_H = 1544, DOT_X = 1, DOT_GO = 2, DOT_EO = 3, DOT_GR = 4 };

static uint64_t dot_row_key(int salt, int a, int b, int c) {
  return mix(mix(mix((uint64_t)salt) ^ (uint64_t)(uint32_t)a) ^ ((uint64_t)(uint32_t)b << 32 | (uint32_t)c));
}

/* 24 bits of the row's hash at column h, mapped exactly to [-1, 1) in
 * float32, then rounded to the dtype. */
static float dot_val(epx_dtype_t dtype, uint64_t row, int h) {
  const uint32_t bits = (uint32_t)(mix(row + (uint64_t)h) >> 40);
  return round_to(dtype, (float)bits / 8388608.0f - 1.0f);
}

/* Per-token rows [T, DOT_H] of this rank (x or grad_out), as floats. */
static float *dot_token_rows(epx_dtype_t dtype, int salt, int64_t T) {
  float *v = calloc((size_t)(T * DOT_H + 1), 4);
  for (int64_t t = 0; t < T; t++) {
    const uint64_t row = dot_row_key(salt, g_rank, (int)t, 0);
    for (int h = 0; h < DOT_H; h++) v[t * DOT_H + h] = dot_val(dtype, row, h);
  }
  return v;
}

/* Per-recv-row inputs [N, DOT_H] (expert_out or grad_recv_x), on the device
 * in the dtype: row i is a function of (its expert, source rank, source
 * token); padding rows and empty slots are zeros. */
static void *dot_recv_rows(epx_dtype_t dtype, int salt, int64_t N, const int32_t *src_rank, const int32_t *src_token,
                           const int32_t *recv_expert) {
  float *v = calloc((size_t)(N * DOT_H + 1), 4);
  for (int64_t i = 0; i < N; i++) {
    if (src_rank[i] < 0 || recv_expert[i] < 0) continue;
    const uint64_t row = dot_row_key(salt, recv_expert[i], src_rank[i], src_token[i]);
    for (int h = 0; h < DOT_H; h++) v[i * DOT_H + h] = dot_val(dtype, row, h);
  }
  void *enc = encode(dtype, v, N * DOT_H);
  void *d = dev_put(enc, (size_t)(N * DOT_H) * epx_dtype_size(dtype));
  free(enc);
  free(v);
  return d;
}

static void *dev_alloc_poisoned(size_t bytes) {
  void *p = NULL;
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&p, bytes ? bytes : 16));
  FATAL_UNLESS_CUDA_OK(cudaMemset(p, 0xA5, bytes ? bytes : 16));
  return p;
}

/* What one dedup buffer gave (host copies; recv rows N). */
typedef struct {
  int64_t N;
  int32_t path; /* its path to every peer, -1 if they differ */
  int32_t *src_rank, *src_token, *recv_expert; /* [N] */
  void *recv_x, *out, *grad_x, *grad_eo;       /* dtype: [N, H], [T, H], [T, H], [N, H] */
  float *gw;                                   /* [T, K]: the weighting's backward pass */
} dot_run_t;

static void dot_run_free(dot_run_t *r) {
  void *p[] = {r->src_rank, r->src_token, r->recv_expert, r->recv_x, r->out, r->grad_x, r->grad_eo, r->gw};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
  memset(r, 0, sizeof *r);
}

/* combine, then both backward passes, grad_w from the weighting's one (the
 * other gets NULL x / expert_out and grad_w, as the contract requires);
 * x_d and go_d are [T, DOT_H] on the device. */
static void dot_backward(epx_buffer_t b, epx_handle_t h, const case_t *c, int64_t T, const void *x_d,
                         const void *go_d, dot_run_t *r) {
  const size_t es = epx_dtype_size(c->dtype), tb = (size_t)(T * DOT_H) * es, nb = (size_t)(r->N * DOT_H) * es;
  void *eo = dot_recv_rows(c->dtype, DOT_EO, r->N, r->src_rank, r->src_token, r->recv_expert);
  void *gr = dot_recv_rows(c->dtype, DOT_GR, r->N, r->src_rank, r->src_token, r->recv_expert);
  void *out = zeros(EPX_DEVICE_CUDA, tb), *gx = zeros(EPX_DEVICE_CUDA, tb), *geo = zeros(EPX_DEVICE_CUDA, nb);
  float *gw = dev_alloc_poisoned(4 * (size_t)(T * K)); /* slots without a route must be written with 0 */
  FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize()); /* the inputs were put through the legacy stream; the buffer's does not wait for it */
  const int in_d = c->weighting == EPX_WEIGHTS_IN_DISPATCH, in_c = c->weighting == EPX_WEIGHTS_IN_COMBINE;
  FATAL_UNLESS_OK(epx_combine(b, h, eo, out));
  FATAL_UNLESS_OK(epx_dispatch_backward(b, h, gr, gx, in_d ? x_d : NULL, in_d ? gw : NULL));
  FATAL_UNLESS_OK(epx_combine_backward(b, h, go_d, in_c ? eo : NULL, geo, in_c ? gw : NULL));
  FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  r->out = host_get(out, tb);
  r->grad_x = host_get(gx, tb);
  r->grad_eo = host_get(geo, nb);
  r->gw = host_get(gw, 4 * (size_t)(T * K));
  void *devs[] = {eo, gr, out, gx, geo, gw};
  for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) cudaFree(devs[i]);
}

/* One dedup buffer on `path` (made, used, destroyed): layout, dispatch, the
 * handle's queries, then dot_backward. */
static void dot_run(epx_comm_t comm, void *stream, const case_t *c, epx_exchange_path_t path, const epx_routing_t *rt,
                    const void *x_d, const void *go_d, dot_run_t *r) {
  epx_buffer_config_t cfg = simple_config(stream, 0);
  cfg.dtype = c->dtype;
  cfg.hidden = DOT_H;
  cfg.layout = c->layout;
  cfg.expert_alignment = c->layout == EPX_LAYOUT_EXPERT_MAJOR ? ALIGN : 1;
  cfg.capacity = c->layout == EPX_LAYOUT_CAPACITY ? C : 0;
  cfg.exchange_path = path;
  epx_buffer_t b;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &b));
  epx_handle_t h;
  FATAL_UNLESS_OK(epx_dispatch_layout(b, rt, NULL, &h));
  r->path = read_paths(b);
  int64_t cap;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h, &r->N));
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(b, &cap));
  if (cap < r->N) cap = r->N;
  const size_t es = epx_dtype_size(c->dtype);
  void *recv = zeros(EPX_DEVICE_CUDA, (size_t)(cap * DOT_H) * es);
  int32_t *srank = zeros(EPX_DEVICE_CUDA, 4 * (size_t)cap), *stok = zeros(EPX_DEVICE_CUDA, 4 * (size_t)cap);
  int32_t *rexp = zeros(EPX_DEVICE_CUDA, 4 * (size_t)cap);
  FATAL_UNLESS_OK(epx_dispatch(b, h, x_d, recv, cap));
  FATAL_UNLESS_OK(epx_handle_recv_source(h, srank, stok));
  FATAL_UNLESS_OK(epx_handle_recv_routing(h, rexp, NULL));
  FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  r->recv_x = host_get(recv, (size_t)(r->N * DOT_H) * es);
  r->src_rank = host_get(srank, 4 * (size_t)r->N);
  r->src_token = host_get(stok, 4 * (size_t)r->N);
  r->recv_expert = host_get(rexp, 4 * (size_t)r->N);
  dot_backward(b, h, c, rt->num_tokens, x_d, go_d, r);
  FATAL_UNLESS_OK(epx_handle_release(h));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  cudaFree(recv), cudaFree(srank), cudaFree(stok), cudaFree(rexp);
}

/* The fused buffer's results against the host path's, bit for bit. */
static void dot_compare_paths(const case_t *c, int64_t T, const dot_run_t *f, const dot_run_t *hp) {
  const char *what = describe(c, EPX_EXCHANGE_DEDUP);
  RANK_EXPECT(f->N == hp->N, "dot order %s: N %lld fused, %lld host path", what, (long long)f->N, (long long)hp->N);
  if (f->N != hp->N) return;
  const int64_t N = f->N;
  const int32_t *qf[] = {f->src_rank, f->src_token, f->recv_expert};
  const int32_t *qh[] = {hp->src_rank, hp->src_token, hp->recv_expert};
  for (int q = 0; q < 3; q++)
    RANK_EXPECT(same_bytes(qf[q], qh[q], 4 * (size_t)N), "dot order %s: recv_%s differs between the paths (row %d)", what,
                q == 0 ? "source's src_rank" : q == 1 ? "source's src_token" : "routing's expert",
                first_diff(EPX_FLOAT32, qf[q], qh[q], N));
  const struct {
    const char *name;
    const void *a, *b;
    epx_dtype_t dt;
    int64_t n;
  } outs[] = {{"recv_x", f->recv_x, hp->recv_x, c->dtype, N * DOT_H},
              {"combine's out", f->out, hp->out, c->dtype, T * DOT_H},
              {"grad_x", f->grad_x, hp->grad_x, c->dtype, T * DOT_H},
              {"grad_expert_out", f->grad_eo, hp->grad_eo, c->dtype, N * DOT_H},
              {"grad_w", f->gw, hp->gw, EPX_FLOAT32, T * K}};
  for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++)
    RANK_EXPECT(same_bytes(outs[i].a, outs[i].b, (size_t)outs[i].n * epx_dtype_size(outs[i].dt)),
                "dot order %s: %s differs between the fused and the host path (element %d)", what, outs[i].name,
                first_diff(outs[i].dt, outs[i].a, outs[i].b, outs[i].n));
}

static float dot_pairwise(const float *p, int n) {
  return n == 1 ? p[0] : dot_pairwise(p, n / 2) + dot_pairwise(p + n / 2, n - n / 2);
}

/* grad_w against the float64 dot of the same rounded inputs: route (t, k)
 * to expert e pairs this rank's token row `tok` (x or grad_out) with the
 * recv row (salt, e, this rank, t). The tolerance is relative to
 * sum |a_h b_h|, so any order passes and only wrong values fail. Slots
 * without a route are exactly 0. For the first routes, the dot in float32
 * sequentially and pairwise: counted in *reordered where they differ (the
 * inputs are inexact enough that an order change would show). */
static void dot_check_reference(const case_t *c, const routing_t *rt, int salt, const float *tok, const float *gw,
                                int *reordered) {
  const char *what = describe(c, EPX_EXCHANGE_DEDUP);
  int64_t bad = -1;
  double bad_ref = 0.0;
  float prod[DOT_H];
  for (int64_t i = 0; i < rt->T * K && bad < 0; i++) {
    const int e = rt->idx[i], t = (int)(i / K);
    if (e < 0) {
      if (gw[i] != 0.0f) bad = i;
      continue;
    }
    const uint64_t row = dot_row_key(salt, e, g_rank, t);
    double ref = 0.0, mag = 0.0;
    float seq = 0.0f;
    for (int h = 0; h < DOT_H; h++) {
      const float a = dot_val(c->dtype, row, h), x = tok[(int64_t)t * DOT_H + h];
      ref += (double)a * x;
      mag += fabs((double)a * x);
      prod[h] = a * x;
      seq += prod[h];
    }
    if (i < 8 * K && seq != dot_pairwise(prod, DOT_H)) (*reordered)++;
    if (!(fabs(gw[i] - ref) <= 1e-3 * (1.0 + mag))) bad = i, bad_ref = ref;
  }
  RANK_EXPECT(bad < 0, "dot order %s: grad_w[%lld][%lld] = %.9g, the float64 reference %.9g (slot expert %d)", what,
              (long long)(bad / K), (long long)(bad % K), bad >= 0 ? gw[bad] : 0.0, bad_ref, bad >= 0 ? rt->idx[bad] : 0);
}

/* One case of test_dot_order: the same routing and inputs on a fused and a
 * host-path buffer. */
static void dot_case(epx_comm_t comm, void *stream, const case_t *c, int *reordered) {
  const char *what = describe(c, EPX_EXCHANGE_DEDUP);
  test_routing_t tr;
  test_routing(c->layout, c->weighting, 0, c->seed, &tr);
  const int64_t T = tr.rt.T;
  const size_t tb = (size_t)(T * DOT_H) * epx_dtype_size(c->dtype);
  float *xv = dot_token_rows(c->dtype, DOT_X, T), *gov = dot_token_rows(c->dtype, DOT_GO, T);
  void *xh = encode(c->dtype, xv, T * DOT_H), *goh = encode(c->dtype, gov, T * DOT_H);
  void *x_d = dev_put(xh, tb), *go_d = dev_put(goh, tb);
  FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize()); /* before the buffers' non-blocking stream reads them */
  dot_run_t fused = {0}, host = {0}, mixed = {0};
  dot_run(comm, stream, c, EPX_PATH_FUSED, &tr.r, x_d, go_d, &fused);
  dot_run(comm, stream, c, EPX_PATH_HOST, &tr.r, x_d, go_d, &host);
  relay_begin();
  dot_run(comm, stream, c, EPX_PATH_FUSED, &tr.r, x_d, go_d, &mixed);
  relay_end();
  RANK_EXPECT(fused.path == EPX_PATH_FUSED || fused.path == EPX_PATH_HOST, "dot order %s: peers on different paths (%d)",
              what, fused.path);
  if (g_expect_fused)
    RANK_EXPECT(fused.path == EPX_PATH_FUSED, "dot order %s: path %d, the fused path expected (EPX_GPU_EXPECT_FUSED)", what,
                fused.path);
  RANK_EXPECT(host.path == EPX_PATH_HOST, "dot order %s: EPX_PATH_HOST took path %d", what, host.path);
  dot_compare_paths(c, T, &fused, &host);
  RANK_EXPECT(mixed.path == fused.path, "dot order %s: with every peer relayed, path %d against %d", what, mixed.path,
              fused.path);
  dot_compare_paths(c, T, &mixed, &host);
  const int in_d = c->weighting == EPX_WEIGHTS_IN_DISPATCH;
  /* dispatch_backward: <grad_recv_x(t,k), x[t]>; combine_backward: <grad_out[t], expert_out(t,k)> */
  dot_check_reference(c, &tr.rt, in_d ? DOT_GR : DOT_EO, in_d ? xv : gov, fused.gw, reordered);
  dot_check_reference(c, &tr.rt, in_d ? DOT_GR : DOT_EO, in_d ? xv : gov, host.gw, reordered);
  dot_run_free(&fused);
  dot_run_free(&host);
  dot_run_free(&mixed);
  cudaFree(x_d), cudaFree(go_d);
  free(xv), free(gov), free(xh), free(goh);
  test_routing_free(&tr);
}

/* grad_w's dots with inexact payloads (above): the fused path (where it is
 * taken; compared all the same where it is not and not required) equal to
 * the host path bit for bit, and both within the float64 reference's
 * tolerance, for the expert-major and capacity layouts, both weightings
 * with a grad_w and each dtype (float16 not in quick mode). */
static void test_dot_order(epx_comm_t comm, void *stream) {
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_CAPACITY};
  const epx_weighting_t weightings[] = {EPX_WEIGHTS_IN_DISPATCH, EPX_WEIGHTS_IN_COMBINE};
  const epx_dtype_t dtypes[] = {EPX_FLOAT32, EPX_BFLOAT16, EPX_FLOAT16};
  int reordered = 0, seed = 40;
  for (int li = 0; li < 2; li++)
    for (int wi = 0; wi < 2; wi++)
      for (int di = 0; di < (g_quick ? 2 : 3); di++) {
        const case_t c = {layouts[li], dtypes[di], weightings[wi], EPX_COMBINE_PARTIALS_FLOAT32, 0, 0, 0, seed++,
                          PLACE_NONE};
        dot_case(comm, stream, &c, &reordered);
      }
  RANK_EXPECT(reordered > 0, "dot order: no dot of the test changes in float32 from sequential to pairwise order, so the "
              "test could not see a fused kernel summing in another order");
}

/* ------------------------------------------------------------------------ */
/* FP8 dispatch                                                              */
/* ------------------------------------------------------------------------ */

/* fp8 rows on the W-rank backend, on both its paths (the host path; the
 * fused kernels, required with EPX_GPU_EXPECT_FUSED): every format x layout
 * x exchange x sizing, pre-quantized rows + scales (epx_dispatch_fp8) and
 * bf16 quantized on the way (epx_dispatch_quantize, the handle's second
 * dispatch: a cached one), each received row's bytes and scales against
 * the CPU backend's (W threads, the same routing) and against its source
 * token's quantized row (epx_quantize on the host), padding rows and
 * unfilled slots zero; then the buffer's dtype on the same handle
 * (epx_dispatch, epx_combine, both backward passes) against the CPU
 * backend's bytes; the fused path equal to the host path and dedup equal
 * to collective, bit for bit; a recorder's replayed handle moves the same
 * bytes, and so does epx_dispatch_quantize captured in a CUDA graph
 * (worst_case_sizing), after the dtype's calls on the handle. HF = 512
 * channels: a multiple of every format's block (UE8M0: 512). */
enum { HF = 512 };

typedef struct {
  epx_layout_t layout;
  epx_fp8_format_t format;
  int worst, seed;
} fp8_case_t;

/* Token t of rank s: the coded values scaled per token and per 32-channel
 * block (blocks get different scales; every value exact in bf16). */
static float fp8_x(int s, int t, int h) {
  return x_val(s, t, h) * (float)(1 + t % 5) * ldexpf(1.0f, (h / 32) % 7 - 3);
}

/* The routing case of an fp8 case (weights in combine; none for rank-major). */
static case_t fp8_routing_case(const fp8_case_t *f) {
  const epx_weighting_t wt = f->layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE;
  return (case_t){f->layout, EPX_BFLOAT16, wt, EPX_COMBINE_PARTIALS_FLOAT32, f->worst, f->seed % 3 == 0,
                  g_size > 1 && f->seed % 4 == 1, f->seed, PLACE_NONE};
}

/* What a run is, for the messages: case, exchange and the path asked for. */
static const char *fp8_describe(const fp8_case_t *f, epx_exchange_t x, epx_exchange_path_t path) {
  static EPX_RANK_LOCAL char text[160];
  const char *lay[] = {"expert-major", "rank-major", "capacity"}, *fmt[] = {"none", "e4m3-f32", "e4m3-ue8m0", "mxfp8"};
  const char *paths[] = {"auto", "host", "fused"};
  snprintf(text, sizeof text, "fp8 %s (%s path) %s %s%s seed %d", x == EPX_EXCHANGE_DEDUP ? "dedup" : "collective",
           paths[path], lay[f->layout], fmt[f->format], f->worst ? " worst-case" : "", f->seed);
  return text;
}

static int64_t fp8_scale_bytes(epx_fp8_format_t format) {
  int64_t cols = 0;
  size_t bytes = 0;
  FATAL_UNLESS_OK(epx_fp8_scale_shape(format, HF, &cols, &bytes));
  return cols * (int64_t)bytes;
}

/* Rows [rows, HF] of fp8_x for rank s, tokens t0.. as bf16, quantized. */
static void fp8_quantized(epx_fp8_format_t format, int s, int64_t t0, int64_t rows, uint8_t *q, uint8_t *sc) {
  float *v = calloc((size_t)(rows * HF + 1), 4);
  for (int64_t t = 0; t < rows; t++)
    for (int h = 0; h < HF; h++) v[t * HF + h] = fp8_x(s, (int)(t0 + t), h);
  void *xh = encode(EPX_BFLOAT16, v, rows * HF);
  if (rows > 0) FATAL_UNLESS_OK(epx_quantize(format, EPX_BFLOAT16, rows, HF, xh, q, sc));
  free(v), free(xh);
}

typedef struct {
  int64_t N, T;
  uint8_t *q[2], *s[2];         /* host [N, HF] and [N, S]: epx_dispatch_fp8's, epx_dispatch_quantize's */
  /* host, bf16: the buffer's dtype on the same handle: epx_dispatch's rows
   * [N, HF], epx_combine's out [T, HF] (of those rows), epx_dispatch_backward's
   * grad_x [T, HF] (of those rows), epx_combine_backward's [N, HF] (of out) */
  void *rows, *out, *grad_x, *grad_eo;
  /* the handle's rows moved again, or NULL: epx_dispatch_fp8 on the
   * recorder's replayed handle (again 0), epx_dispatch_quantize in a CUDA
   * graph (again 1, worst_case_sizing) */
  uint8_t *again_q, *again_s;
  int again;
  int32_t *src_rank, *src_token;
  int32_t path;
  char why[512];
} fp8_result_t;

typedef struct {
  const fp8_case_t *c;
  epx_exchange_t exchange;
  epx_exchange_path_t path; /* CUDA buffers' exchange_path */
  epx_comm_t comm;
  int rank;
  epx_device_t device;
  void *stream;
  int record; /* lay out under a recorder, replay it and dispatch again (CUDA, default sizing) */
  fp8_result_t res;
} fp8_run_t;

static void fp8_result_free(fp8_result_t *r) {
  void *p[] = {r->q[0], r->q[1], r->s[0], r->s[1], r->again_q, r->again_s, r->src_rank, r->src_token,
               r->rows, r->out, r->grad_x, r->grad_eo};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
  memset(r, 0, sizeof *r);
}

/* Receive tensors filled with 0x5a, so unwritten padding shows. */
static void *poisoned(epx_device_t device, size_t bytes) {
  void *host = malloc(bytes + 16);
  memset(host, 0x5a, bytes + 16);
  void *p = place(device, host, bytes);
  free(host);
  return p;
}

/* The recorded handle replayed: the same handle, whose fp8 dispatch moves
 * the recorded layout's rows again. */
static void fp8_replay(fp8_run_t *run, epx_buffer_t buf, epx_recorder_t rec, const epx_routing_t *routing,
                       epx_handle_t h, const void *xq, const void *xs, int64_t cap, int64_t S) {
  fp8_result_t *r = &run->res;
  FATAL_UNLESS_OK(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
  epx_handle_t h2 = NULL;
  FATAL_UNLESS_OK(epx_dispatch_layout(buf, routing, rec, &h2));
  RANK_EXPECT(h2 == h, "%s: the replay did not return the recorded handle",
              fp8_describe(run->c, run->exchange, run->path));
  void *rq = poisoned(run->device, (size_t)(cap * HF)), *rs = poisoned(run->device, (size_t)(cap * S));
  FATAL_UNLESS_OK(epx_dispatch_fp8(buf, h2, xq, xs, rq, rs, cap));
  if (run->device == EPX_DEVICE_CUDA) FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  r->again_q = fetch(run->device, rq, (size_t)(r->N * HF));
  r->again_s = fetch(run->device, rs, (size_t)(r->N * S));
  r->again = 0;
  release(run->device, rq), release(run->device, rs);
  FATAL_UNLESS_OK(epx_handle_release(h2));
}

/* worst_case_sizing: epx_dispatch_quantize captured in a CUDA graph and
 * launched (nothing in it waits for the host). */
static void fp8_graph(fp8_run_t *run, epx_buffer_t buf, epx_handle_t h, const void *x, int64_t cap, int64_t S) {
  fp8_result_t *r = &run->res;
  cudaStream_t stream = run->stream;
  void *rq = poisoned(EPX_DEVICE_CUDA, (size_t)(cap * HF)), *rs = poisoned(EPX_DEVICE_CUDA, (size_t)(cap * S));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FATAL_UNLESS_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  const epx_status_t s = epx_dispatch_quantize(buf, h, x, rq, rs, cap);
  FATAL_UNLESS_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  FATAL_UNLESS_OK(s);
  FATAL_UNLESS_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  FATAL_UNLESS_CUDA_OK(cudaGraphLaunch(exec, stream));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  r->again_q = host_get(rq, (size_t)(r->N * HF));
  r->again_s = host_get(rs, (size_t)(r->N * S));
  r->again = 1;
  FATAL_UNLESS_CUDA_OK(cudaGraphExecDestroy(exec));
  FATAL_UNLESS_CUDA_OK(cudaGraphDestroy(graph));
  cudaFree(rq), cudaFree(rs);
}

/* The buffer's dtype on an fp8 buffer's handle (after its fp8 dispatches):
 * epx_dispatch of x, epx_combine of its rows, epx_dispatch_backward of
 * them, epx_combine_backward of combine's out; the results to the host. */
static void fp8_dtype_calls(fp8_run_t *run, epx_buffer_t buf, epx_handle_t h, const void *x, int64_t cap) {
  fp8_result_t *r = &run->res;
  const epx_device_t dev = run->device;
  const size_t rb = 2 * HF; /* bf16 */
  void *rows = zeros(dev, (size_t)cap * rb), *out = zeros(dev, (size_t)r->T * rb);
  void *gx = zeros(dev, (size_t)r->T * rb), *geo = zeros(dev, (size_t)cap * rb);
  FATAL_UNLESS_OK(epx_dispatch(buf, h, x, rows, cap));
  FATAL_UNLESS_OK(epx_combine(buf, h, rows, out));
  FATAL_UNLESS_OK(epx_dispatch_backward(buf, h, rows, gx, NULL, NULL));
  FATAL_UNLESS_OK(epx_combine_backward(buf, h, out, NULL, geo, NULL));
  if (dev == EPX_DEVICE_CUDA) FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  r->rows = fetch(dev, rows, (size_t)r->N * rb);
  r->out = fetch(dev, out, (size_t)r->T * rb);
  r->grad_x = fetch(dev, gx, (size_t)r->T * rb);
  r->grad_eo = fetch(dev, geo, (size_t)r->N * rb);
  release(dev, rows), release(dev, out), release(dev, gx), release(dev, geo);
}

/* One rank's fp8 dispatches of case c (GPU or CPU). */
static void fp8_rank(fp8_run_t *run) {
  const fp8_case_t *f = run->c;
  const epx_device_t dev = run->device;
  const case_t c = fp8_routing_case(f);
  fp8_result_t *r = &run->res;
  routing_t rt;
  make_routing(&c, run->rank, &rt);
  const int64_t T = rt.T, S = fp8_scale_bytes(f->format);
  epx_buffer_config_t cfg = config_of(&c, run->exchange, dev, run->stream);
  cfg.hidden = HF;
  cfg.fp8_format = f->format;
  cfg.exchange_path = dev == EPX_DEVICE_CUDA ? run->path : EPX_PATH_AUTO;
  epx_buffer_t buf;
  FATAL_UNLESS_OK(epx_buffer_create(run->comm, &cfg, &buf));
  snprintf(r->why, sizeof r->why, "%s", epx_last_error());
  int32_t *idx, *loc;
  float *w;
  const epx_routing_t routing = place_routing(&c, &rt, dev, &idx, &w, &loc);
  epx_recorder_t rec = NULL;
  if (run->record) FATAL_UNLESS_OK(epx_recorder_create(1, &rec));
  epx_handle_t h;
  FATAL_UNLESS_OK(epx_dispatch_layout(buf, &routing, rec, &h));
  if (epx_last_error()[0]) snprintf(r->why, sizeof r->why, "%s", epx_last_error());
  r->path = dev == EPX_DEVICE_CUDA ? read_paths(buf) : EPX_PATH_HOST;
  int64_t N, cap;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h, &N));
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(buf, &cap));
  if (cap < N) cap = N;
  r->N = N;
  r->T = T;

  float *xv = calloc((size_t)(T * HF + 1), 4);
  for (int64_t t = 0; t < T; t++)
    for (int hh = 0; hh < HF; hh++) xv[t * HF + hh] = fp8_x(run->rank, (int)t, hh);
  void *xh = encode(EPX_BFLOAT16, xv, T * HF);
  uint8_t *xqh = calloc((size_t)(T * HF + 1), 1), *xsh = calloc((size_t)(T * S + 1), 1);
  fp8_quantized(f->format, run->rank, 0, T, xqh, xsh);
  void *x = place(dev, xh, (size_t)(T * HF) * 2), *xq = place(dev, xqh, (size_t)(T * HF));
  void *xs = place(dev, xsh, (size_t)(T * S));
  void *rq[2], *rs[2];
  for (int i = 0; i < 2; i++) rq[i] = poisoned(dev, (size_t)(cap * HF)), rs[i] = poisoned(dev, (size_t)(cap * S));
  int32_t *srank = zeros(dev, 4 * (size_t)cap), *stok = zeros(dev, 4 * (size_t)cap);
  FATAL_UNLESS_OK(epx_dispatch_fp8(buf, h, xq, xs, rq[0], rs[0], cap));
  FATAL_UNLESS_OK(epx_dispatch_quantize(buf, h, x, rq[1], rs[1], cap)); /* the handle's second dispatch */
  FATAL_UNLESS_OK(epx_handle_recv_source(h, srank, stok));
  if (dev == EPX_DEVICE_CUDA) FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  for (int i = 0; i < 2; i++)
    r->q[i] = fetch(dev, rq[i], (size_t)(N * HF)), r->s[i] = fetch(dev, rs[i], (size_t)(N * S));
  r->src_rank = fetch(dev, srank, 4 * (size_t)N);
  r->src_token = fetch(dev, stok, 4 * (size_t)N);
  fp8_dtype_calls(run, buf, h, x, cap);
  if (rec) fp8_replay(run, buf, rec, &routing, h, xq, xs, cap, S);
  else if (dev == EPX_DEVICE_CUDA && f->worst && (RANKS_GRAPHS == 2 || (RANKS_GRAPHS == 1 && r->path == EPX_PATH_FUSED)))
    fp8_graph(run, buf, h, x, cap, S);
  FATAL_UNLESS_OK(epx_handle_release(h));
  if (rec) FATAL_UNLESS_OK(epx_recorder_destroy(rec));
  FATAL_UNLESS_OK(epx_buffer_destroy(buf));
  void *devs[] = {idx, w, loc, x, xq, xs, rq[0], rq[1], rs[0], rs[1], srank, stok};
  for (size_t i = 0; i < sizeof devs / sizeof devs[0]; i++) release(dev, devs[i]);
  free(xv), free(xh), free(xqh), free(xsh);
}

static void fp8_rank_on(void *arg, epx_comm_t comm) {
  fp8_run_t *run = arg;
  run->comm = comm;
  fp8_rank(run);
}

/* The CPU backend over W threads: this rank's fp8 results. */
static void fp8_cpu(const fp8_case_t *c, epx_exchange_t exchange, fp8_result_t *mine) {
  fp8_run_t *runs = calloc((size_t)g_size, sizeof *runs);
  for (int q = 0; q < g_size; q++) runs[q] = (fp8_run_t){c, exchange, EPX_PATH_AUTO, NULL, q, EPX_DEVICE_CPU, NULL, 0, {0}};
  run_cpu_threads(0, fp8_rank_on, runs, sizeof *runs);
  *mine = runs[g_rank].res;
  for (int q = 0; q < g_size; q++)
    if (q != g_rank) fp8_result_free(&runs[q].res);
  free(runs);
}

/* The first row of n rows of `bytes` each where a and b differ, or -1. */
static int64_t first_row_diff(const uint8_t *a, const uint8_t *b, int64_t n, int64_t bytes) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp(a + i * bytes, b + i * bytes, (size_t)bytes)) return i;
  return -1;
}

/* Every received row against its source token's quantized row (a padding
 * row or unfilled slot: zeros), both dispatches. */
static void fp8_check_sources(const fp8_case_t *f, const char *what, const fp8_result_t *g) {
  const int64_t S = fp8_scale_bytes(f->format);
  uint8_t *q = calloc(HF, 1), *sc = calloc((size_t)S, 1);
  int64_t bad = -1;
  for (int64_t i = 0; i < g->N && bad < 0; i++) {
    if (g->src_rank[i] >= 0) fp8_quantized(f->format, g->src_rank[i], g->src_token[i], 1, q, sc);
    else memset(q, 0, HF), memset(sc, 0, (size_t)S);
    for (int d = 0; d < 2; d++)
      if (memcmp(g->q[d] + i * HF, q, HF) || memcmp(g->s[d] + i * S, sc, (size_t)S)) bad = i;
  }
  RANK_EXPECT(bad < 0, "%s: received row %lld (from rank %d token %d) is not its source's quantized row and scales",
              what, (long long)bad, bad < 0 ? 0 : g->src_rank[bad], bad < 0 ? 0 : g->src_token[bad]);
  free(q), free(sc);
}

/* GPU against another run (the CPU backend, the other path or exchange):
 * N, sources, both dispatches' bytes, and the dtype's calls' bytes. */
static void fp8_compare(const fp8_case_t *f, const char *what, const fp8_result_t *g, const fp8_result_t *o,
                        const char *other) {
  const int64_t S = fp8_scale_bytes(f->format);
  RANK_EXPECT(g->N == o->N, "%s: N %lld, %s %lld", what, (long long)g->N, other, (long long)o->N);
  if (g->N != o->N) return;
  const int64_t N = g->N;
  RANK_EXPECT(same_bytes(g->src_rank, o->src_rank, 4 * (size_t)N) && same_bytes(g->src_token, o->src_token, 4 * (size_t)N),
              "%s: recv_source differs from %s", what, other);
  for (int d = 0; d < 2; d++) {
    const char *call = d ? "epx_dispatch_quantize" : "epx_dispatch_fp8";
    const int64_t rq = first_row_diff(g->q[d], o->q[d], N, HF), rs = first_row_diff(g->s[d], o->s[d], N, S);
    RANK_EXPECT(rq < 0 && rs < 0, "%s: %s's rows differ from %s's (row %lld, scales of row %lld)", what, call, other,
                (long long)rq, (long long)rs);
  }
  const size_t rb = 2 * HF;
  const struct {
    const char *name;
    const void *a, *b;
    int64_t rows;
  } dtype_outs[] = {{"epx_dispatch", g->rows, o->rows, N},
                    {"epx_combine", g->out, o->out, g->T},
                    {"epx_dispatch_backward", g->grad_x, o->grad_x, g->T},
                    {"epx_combine_backward", g->grad_eo, o->grad_eo, N}};
  for (size_t i = 0; i < sizeof dtype_outs / sizeof dtype_outs[0]; i++) {
    const int64_t row = first_row_diff(dtype_outs[i].a, dtype_outs[i].b, dtype_outs[i].rows, (int64_t)rb);
    RANK_EXPECT(row < 0, "%s: %s (bf16, after the fp8 dispatches) differs from %s's (row %lld)", what,
                dtype_outs[i].name, other, (long long)row);
  }
}

/* One fp8 case: dedup on the host path (EPX_PATH_HOST) and on the fused
 * kernels (EPX_PATH_FUSED: required with EPX_GPU_EXPECT_FUSED, else the
 * host path where the build or NCCL has none), and collective (AUTO: the
 * host path, the fused kernels being dedup only), each against the CPU
 * backend of its exchange and the sources; then the fused path against the
 * host path and dedup against collective, bit for bit. The dedup runs with
 * default sizing under a recorder, every run with worst_case_sizing once
 * more in a CUDA graph. */
static void fp8_case(const fp8_case_t *f, epx_comm_t nccl, void *stream) {
  enum { RUNS = 3 };
  const epx_exchange_t exchanges[RUNS] = {EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_COLLECTIVE};
  const epx_exchange_path_t asked[RUNS] = {EPX_PATH_HOST, EPX_PATH_FUSED, EPX_PATH_AUTO};
  fp8_result_t gpu[RUNS], cpu[2];
  fp8_cpu(f, EPX_EXCHANGE_DEDUP, &cpu[0]);
  fp8_cpu(f, EPX_EXCHANGE_COLLECTIVE, &cpu[1]);
  char what[RUNS][160];
  for (int i = 0; i < RUNS; i++) {
    const epx_exchange_t x = exchanges[i];
    snprintf(what[i], sizeof what[i], "%s", fp8_describe(f, x, asked[i]));
    fp8_run_t run = {f, x, asked[i], nccl, g_rank, EPX_DEVICE_CUDA, stream, x == EPX_EXCHANGE_DEDUP && !f->worst,
                     {0}};
    fp8_rank(&run);
    gpu[i] = run.res;
    const fp8_result_t *g = &gpu[i];
    const int fused = asked[i] == EPX_PATH_FUSED;
    if (!fused || g_expect_fused)
      RANK_EXPECT(g->path == (fused ? EPX_PATH_FUSED : EPX_PATH_HOST), "%s: path %d, the %s path expected (%s)",
                  what[i], g->path, fused ? "fused" : "host", g->why);
    fp8_compare(f, what[i], g, &cpu[x == EPX_EXCHANGE_COLLECTIVE], "the CPU backend");
    fp8_check_sources(f, what[i], g);
    if (g->again_q)
      RANK_EXPECT(same_bytes(g->again_q, g->q[g->again], (size_t)(g->N * HF)) &&
                      same_bytes(g->again_s, g->s[g->again], (size_t)(g->N * fp8_scale_bytes(f->format))),
                  "%s: %s moved other bytes", what[i],
                  g->again ? "epx_dispatch_quantize in a CUDA graph" : "the recorder's replayed handle");
  }
  fp8_compare(f, what[1], &gpu[1], &gpu[0], "the host path");
  fp8_compare(f, what[0], &gpu[0], &gpu[2], "the collective exchange");
  for (int i = 0; i < RUNS; i++) fp8_result_free(&gpu[i]);
  fp8_result_free(&cpu[0]);
  fp8_result_free(&cpu[1]);
}

/* Every format x layout x sizing; returns the number of cases. */
static int fp8_cases(epx_comm_t comm, void *stream) {
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_RANK_MAJOR, EPX_LAYOUT_CAPACITY};
  const epx_fp8_format_t formats[] = {EPX_FP8_E4M3_F32_128, EPX_FP8_E4M3_UE8M0_128, EPX_FP8_MXFP8};
  int cases = 0, seed = 101;
  for (int li = 0; li < 3; li++)
    for (int fi = 0; fi < 3; fi++)
      for (int worst = 0; worst < (g_quick ? 1 : 2); worst++) {
        const fp8_case_t f = {layouts[li], formats[fi], worst, seed++};
        fp8_case(&f, comm, stream);
        cases++;
      }
  return cases;
}

/* The last rank quantizes where the others move pre-quantized rows (same
 * handle): every rank gets EPX_ERROR_SHAPE_MISMATCH naming both calls; then
 * in step again. */
static void test_fp8_call_mismatch(epx_comm_t comm, void *stream) {
  epx_buffer_config_t cfg = simple_config(stream, 0);
  cfg.hidden = HF;
  cfg.fp8_format = EPX_FP8_E4M3_F32_128;
  epx_buffer_t b;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &b));
  test_routing_t tr;
  test_routing(EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 0, 23, &tr);
  epx_handle_t h = NULL;
  FATAL_UNLESS_OK(epx_dispatch_layout(b, &tr.r, NULL, &h));
  int64_t cap = 0;
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(b, &cap));
  const size_t S = (size_t)fp8_scale_bytes(cfg.fp8_format);
  void *x = zeros(EPX_DEVICE_CUDA, 2 * (size_t)TMAX * HF), *xs = zeros(EPX_DEVICE_CUDA, (size_t)TMAX * S);
  void *rq = zeros(EPX_DEVICE_CUDA, (size_t)cap * HF + 16), *rs = zeros(EPX_DEVICE_CUDA, (size_t)cap * S + 16);
  epx_status_t s = g_rank == g_size - 1 ? epx_dispatch_quantize(b, h, x, rq, rs, cap)
                                        : epx_dispatch_fp8(b, h, x, xs, rq, rs, cap);
  RANK_EXPECT(s == EPX_ERROR_SHAPE_MISMATCH && strstr(epx_last_error(), "epx_dispatch_quantize") &&
                  strstr(epx_last_error(), "epx_dispatch_fp8"),
              "fp8 call mismatch: rank %d got %s (%s)", g_rank, epx_status_string(s), epx_last_error());
  FATAL_UNLESS_OK(epx_dispatch_fp8(b, h, x, xs, rq, rs, cap)); /* in step again */
  FATAL_UNLESS_OK(epx_handle_release(h));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  test_routing_free(&tr);
  cudaFree(x), cudaFree(xs), cudaFree(rq), cudaFree(rs);
}

/* EPX_EP_BENCH=1: the time of a dispatch and a combine on the host path
 * (dedup, expert-major, bf16; T 512 tokens a rank, H 2048, top-4 of 8 experts
 * a rank), each from a barrier of every rank to its stream's completion,
 * after the layout; a RESULT line per rank naming the device transport (the
 * in-process and ipc transports against each other at the same shape:
 * bench/gpu-check.sh's "ipc" section). */
static void bench_host_path(epx_comm_t comm, cudaStream_t stream, const char *transport) {
  enum { BT = 512, BH = 2048, BK = 4, REPS = 20 };
  const int BE = 8 * g_size;
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_BFLOAT16, BH, BE, BK, BT);
  cfg.exchange_path = EPX_PATH_HOST, cfg.stream = stream;
  epx_buffer_t b = NULL;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &b));
  int32_t *idx = malloc(sizeof(int32_t) * BT * BK);
  float *w = malloc(sizeof(float) * BT * BK);
  uint64_t z = mix(4321u + (uint64_t)g_rank);
  for (int t = 0; t < BT; t++)
    for (int k = 0; k < BK; k++) {
      int e, dup;
      do {
        z = mix(z);
        e = (int)(z % (uint64_t)BE);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= idx[t * BK + j] == e;
      } while (dup);
      idx[t * BK + k] = e, w[t * BK + k] = 1.0f / BK;
    }
  int32_t *didx = dev_put(idx, sizeof(int32_t) * BT * BK);
  float *dw = dev_put(w, sizeof(float) * BT * BK);
  epx_routing_t rt = {BT, BK, didx, dw, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  FATAL_UNLESS_OK(epx_dispatch_layout(b, &rt, NULL, &h));
  int64_t N = 0;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h, &N));
  void *x = zeros(EPX_DEVICE_CUDA, (size_t)BT * BH * 2), *recv = zeros(EPX_DEVICE_CUDA, (size_t)(N + 1) * BH * 2);
  void *out = zeros(EPX_DEVICE_CUDA, (size_t)BT * BH * 2);
  double us[2] = {0, 0};
  for (int rep = 0; rep < REPS + 3; rep++)
    for (int i = 0; i < 2; i++) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = tu_seconds();
      FATAL_UNLESS_OK(i == 0 ? epx_dispatch(b, h, x, recv, N) : epx_combine(b, h, recv, out));
      FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
      if (rep >= 3) us[i] += (tu_seconds() - t0) * 1e6 / REPS;
    }
  printf("RESULT ep rank %d of %d transport %s path host T %d H %d top-%d of %d bf16: dispatch %.1f us, combine "
         "%.1f us\n", g_rank, g_size, transport, BT, BH, BK, BE, us[0], us[1]);
  fflush(stdout);
  FATAL_UNLESS_OK(epx_handle_release(h));
  void *dp[] = {didx, dw, x, recv, out};
  for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(dp[i]));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
  free(idx), free(w);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  const char *q = getenv("EPX_GPU_TEST_QUICK");
  g_quick = q && *q && strcmp(q, "0");
  const char *xf = getenv("EPX_GPU_EXPECT_FUSED");
  g_expect_fused = xf && *xf && strcmp(xf, "0");
  E = 8 * g_size;
  /* One rank (one GPU): the W-rank backend all the same (NCCL, the fused
   * kernels), so its paths are checked where no second GPU is at hand; the
   * tests of one rank against another are left out. */
  if (g_size == 1) epx_cuda_ep_at_one_rank(1);
  cudaStream_t stream = mpi_gpu_rank_stream(g_rank);
  MPI_Comm world = MPI_COMM_WORLD;
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = 60;
  /* EPX_GPU_RANKS_PER_NODE=1 at -np 2 poses two nodes (with NCCL_P2P_DISABLE=1
   * NCCL_SHM_DISABLE=1 NCCL's network transport carries hop 1). */
  const char *rpn = getenv("EPX_GPU_RANKS_PER_NODE");
  cc.ranks_per_node = rpn ? atoi(rpn) : 0;
  epx_comm_t comm;
  FATAL_UNLESS_OK(epx_comm_create_nccl_mpi(&world, &cc, &comm));
  int32_t rank, size;
  FATAL_UNLESS_OK(epx_comm_rank(comm, &rank));
  FATAL_UNLESS_OK(epx_comm_size(comm, &size));
  RANK_EXPECT(rank == g_rank && size == g_size, "the NCCL comm is rank %d of %d", rank, size);
  int32_t node, local;
  FATAL_UNLESS_OK(epx_comm_topology(comm, &g_nodes, &g_ranks_per_node, &node, &local));
  const int one = g_size == 1; /* the W-rank backend all the same (above) */

  const char *bench = getenv("EPX_EP_BENCH");
  if (bench && *bench && strcmp(bench, "0") && !one) {
    /* the timing alone: the cases are the other runs' */
    bench_host_path(comm, stream, RANKS_IN_PROCESS ? "in-process" : RANKS_GRAPHS == 0 ? "ipc" : "nccl");
    FATAL_UNLESS_OK(epx_comm_destroy(comm));
    cudaStreamDestroy(stream);
    MPI_Finalize();
    return 0;
  }
  int cases = 0, seed = 1;
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_RANK_MAJOR, EPX_LAYOUT_CAPACITY};
  const epx_dtype_t dtypes[] = {EPX_BFLOAT16, EPX_FLOAT32, EPX_FLOAT16};
  for (int li = 0; li < 3; li++)
    for (int di = 0; di < (g_quick ? 1 : 3); di++)
      for (int wi = 0; wi < 3; wi++)
        for (int pi = 0; pi < 2; pi++)
          for (int worst = 0; worst < 2; worst++) {
            const epx_weighting_t wt = (epx_weighting_t)wi;
            if ((layouts[li] == EPX_LAYOUT_RANK_MAJOR) != (wt == EPX_WEIGHTS_NONE)) continue;
            if (di > 0 && (pi || worst)) continue; /* f32, f16: the default precision, sizing */
            case_t c = {layouts[li], dtypes[di], wt, pi ? EPX_COMBINE_PARTIALS_PAYLOAD : EPX_COMBINE_PARTIALS_FLOAT32,
                        worst, seed % 3 == 0, seed % 4 == 1, seed, PLACE_NONE};
            seed++;
            run_case(&c, comm, stream);
            cases++;
          }
  RANK_EXPECT(g_hier_cases > 0, "no case ran on the hierarchical exchange");
  /* Placements (issue 37): replicas by the round-robin rule and the caller's
   * physical ids, experts moved off their contiguous ranks, every layout and
   * every path run_case runs; the load counts too (every case compares them). */
  make_placements();
  int place_cases = 0;
  for (int kind = PLACE_REPLICAS; kind < PLACE_KINDS; kind++)
    for (int li = 0; li < 3; li++)
      for (int worst = 0; worst < 2; worst++) {
        if (g_quick && (li > 0 || worst)) continue;
        const epx_weighting_t wt = layouts[li] == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE;
        case_t c = {layouts[li], EPX_BFLOAT16, wt, EPX_COMBINE_PARTIALS_FLOAT32, worst, seed % 2, 0, seed, kind};
        seed++;
        run_case(&c, comm, stream);
        place_cases++;
      }
  test_hier_refusals(comm, stream);
  /* The refusals, the recorder and the graph on both paths, and on the
   * fused path with every peer relayed (expert-major: AUTO would take the
   * host path). */
  const epx_exchange_path_t paths[] = {EPX_PATH_FUSED, EPX_PATH_HOST, EPX_PATH_FUSED};
  for (int pi = 0; pi < 3; pi++) {
    g_path = paths[pi];
    if (pi == 2) relay_begin();
    for (int worst = 0; worst < 2; worst++) {
      test_capacity_refusal(comm, stream, worst);
      if (!one) test_weighting_mismatch(comm, stream, worst);
      for (int dup = 0; dup < 2; dup++) test_invalid_routing(comm, stream, worst, dup);
      for (int bad_location = 0; bad_location < 2; bad_location++)
        test_capacity_slots(comm, stream, worst, bad_location);
    }
    if (!one) test_call_mismatch(comm, stream);
    test_recorder(comm, stream);
    if (RANKS_GRAPHS == 2 || (RANKS_GRAPHS == 1 && pi == 0)) test_graph(comm, stream);
    if (pi == 2) relay_end();
  }
  g_path = EPX_PATH_FUSED;
  test_dot_order(comm, stream);
  const int fp8 = fp8_cases(comm, stream);
  if (!one) test_fp8_call_mismatch(comm, stream);
  /* One rank: the refusing rank's own side (it takes the host path and
   * works); its peers' side needs a second rank. */
  if (g_expect_fused && !RANKS_IN_PROCESS) test_fused_refused_on_one_rank(comm, stream); /* one GPU's memory */
  if (RANKS_IN_PROCESS && g_rank == 0)
    printf("mpi_gpu_exchange: ranks as threads (in-process transport): CUDA graphs on the fused path only (the "
           "host path's and the relay's in-process moves are not capturable); no fused refusal on one rank\n");
  if (RANKS_GRAPHS == 0 && g_rank == 0)
    printf("mpi_gpu_exchange: ranks as processes sharing one GPU (ipc transport): no CUDA graphs (the ipc moves "
           "are not capturable and the fused path is refused: the processes take turns on the GPU), every buffer "
           "on the host path; no fused refusal on one rank\n");
  if (one)
    printf("mpi_gpu_exchange: one rank (the W-rank backend forced on by epx_cuda_ep_at_one_rank): skipped, as they "
           "need a second rank: the weighting mismatch (2 sizings x 2 paths), the call and config mismatch (2 "
           "paths), the fp8 call mismatch, and the fused refusal's peer side\n");

  int failures = 0;
  MPI_Allreduce(&g_fail, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  FATAL_UNLESS_OK(epx_comm_destroy(comm));
  if (g_rank == 0)
    printf("mpi_gpu_exchange: %d rank%s%s, %d cases (%d with a placement) x 2 exchanges (+ the host path of dedup), "
           "refusals, recorder, "
           "graph (fused path %s), %d fp8 cases x 3 runs (dedup on the host and fused paths, collective) x 2 "
           "dispatches + the dtype's calls: %d failures: %s\n", g_size,
           one ? "" : "s", one ? " (W-rank backend)" : "", cases + place_cases, place_cases, g_expect_fused ? "required" : "where available", fp8,
           failures, failures ? "FAILED" : "OK");
  cudaStreamDestroy(stream);
  MPI_Finalize();
  return failures ? 1 : 0;
}
