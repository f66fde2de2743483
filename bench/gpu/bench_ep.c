/* The expert-parallel exchange on W GPUs (one process per GPU, under
 * mpirun), side by side with NCCL's all-to-all of the same rows in the same
 * run. Shapes of the issue: T = 8192 and 4096 tokens per rank, H = 7168,
 * 256 experts, top-8, bf16, uniform and Zipf-skewed routing; every layout and
 * both exchanges; payload-dtype and float32 combine partials.
 *
 * Before timing, each configuration is checked: x is provenance-coded, so
 * every received row is compared with what its source must have sent, and
 * the combine of the received rows (weights none) must be the token's row
 * times the number of ranks it went to (exact in bf16 at these values).
 *
 * Times are CUDA-event medians over 20 calls after 3 warm-ups, on rank 0
 * (the slowest rank's median is printed beside it). The baseline is a
 * grouped ncclSend/ncclRecv of the same per-peer row counts from contiguous
 * buffers: what torch.distributed.all_to_all_single does on NCCL (its
 * PyTorch timing comes from bench_torch_ep.py, run after this with the
 * counts this writes). "GB/s" counts the bytes a GPU receives, its own rows
 * included (DeepEP's convention).
 *
 * Every dedup buffer runs EPX_PATH_FUSED (the fused NVLink kernels for the
 * peers reachable by load/store, expert-major too; AUTO takes them for
 * rank-major only), and the expert-major dedup rows once more on AUTO
 * (the host path: the default's choice); the sweep's "path=host" rows force
 * EPX_PATH_HOST, and the fused rank-major rows are swept over
 * config.sm_budget (8/16/24/32/48/64/132 CTAs) beside them: the fused vs
 * host comparison in one run. The path each buffer took is printed
 * (path=...). Each row also times the backward passes (no grad_w) and
 * epx_weights_backward (the routing-weight gradients home), the
 * expert-major dedup rows the backward passes with grad_w (GRADW), and sets
 * the exchange beside the NVLink floor (the remote rows at 450 GB/s). The
 * expert-major dedup rows are written to <workdir>/ep_permute.txt, for
 * bench_torch_ep.py's PyTorch permute baseline. Section "relay": the fused
 * path with every peer relayed through NCCL's host API (path=fused+relay,
 * the test flag EPX_CUDA_FUSED_RELAY), what a peer without load/store
 * access costs, beside the host path.
 *
 * The SM-budget sweep of whole steps (section "step"): an expert-major MoE
 * layer on two micro-batches of T tokens per rank, the exchange on the
 * buffer's stream and a grouped expert MLP (cuBLAS strided-batched bf16
 * GEMMs: up [m, H] x [H, 2F], down [m, F] x [F, H] per local expert, F =
 * 2048 as DeepSeek-V3; backward: the two data and two weight gradients) on a
 * second stream, pipelined as DeepEP's users overlap them: micro-batch 1's
 * dispatch runs beside micro-batch 0's GEMMs, and 0's combine beside 1's
 * GEMMs (backward: combine_backward with the router's grad_w, GEMMs,
 * dispatch_backward, the same way). Each budget's step time (forward, backward) is set beside the GEMMs
 * alone and the exchange alone at that budget (STEP lines); the host path
 * is the baseline row. The layout is outside the step (made once: a
 * training step's layout is its own call).
 *
 * Sections (EPX_BENCH_EP_SECTIONS, comma-separated; default all): main
 * (every layout and exchange), layout (the worst-case layout alone: event,
 * host and graph-replay times; main runs it too), expert (the expert-major
 * dedup rows alone: fused, host, float32 partials; main runs them too),
 * sweep (fused vs host, rank-major, per SM budget), fp8 (expert-major
 * dedup dispatches of e4m3 rows with float32 scales per 128 channels,
 * pre-quantized and quantized on the way, beside bf16, on the fused and
 * host paths; main runs it at T = 8192), split (the fused rank-major rows
 * with a quarter and an eighth of the budget receiving, at 8/16/24/32
 * SMs), step (the whole-step sweep).
 *
 * Usage: mpirun -np 2 bench_ep <workdir>   (RESULT / TARGET / CHECK lines;
 * writes <workdir>/ep_counts.txt and ep_permute.txt for bench_torch_ep.py) */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "epx.h"
/* the library's launch flags and one-GPU hook (not in epx.h):
 * epx_cuda_set_launch_flags, EPX_CUDA_FUSED_*, epx_cuda_ep_at_one_rank */
#include "../../src/cuda/launch.h"
#include "../../tests/gpu/mpi_gpu_check.h"
#include "../../tests/util/buffer_config.h"

enum { H = 7168, E = 256, K = 8, REPS = 20, WARM = 3 };
/* config.sm_budget 0 means this (epx.h), for the names of the rows */
enum { DEFAULT_SM_BUDGET = 32 };

static int g_rank, g_size, g_bad;
static cudaStream_t g_stream;
static epx_comm_t g_comm;
static FILE *g_counts;
static FILE *g_permute; /* <workdir>/ep_permute.txt: the expert-major rows for bench_torch_ep.py */
static epx_exchange_path_t g_path = EPX_PATH_FUSED; /* config.exchange_path of run()'s buffers */
static int32_t g_sms;                              /* config.sm_budget (0: the default) */
/* A library built with -DEPX_FUSED_LAYOUT_TRACE has this (the fused
 * layout's stage times); others do not. */
extern int epx_fused_layout_trace(unsigned long long *out) __attribute__((weak));

/* bf16 of small multiples of 1/4 (exact), coded by (rank, token, column). */
static uint16_t x_bits(int s, int t, int h) {
  const float v = (float)((int)((unsigned)(s * 101 + t * 13 + h * 7 + 3) % 29u) - 14) / 4.0f;
  uint32_t b;
  memcpy(&b, &v, 4);
  return (uint16_t)(b >> 16);
}

/* Top-8 of 256 distinct per token; skew: experts drawn from a Zipf(1.2)
 * law (expert e with weight (e + 1)^-1.2: the hottest on rank 0), else
 * uniform. */
enum { ZIPF_S_TENTHS = 12 };
static void make_routing(int T, int skew, int seed, int32_t *idx, float *w) {
  static double cdf[E];
  double total = 0;
  for (int e = 0; e < E; e++) total += pow(e + 1.0, -ZIPF_S_TENTHS / 10.0), cdf[e] = total;
  uint64_t z = mix((uint64_t)seed * 7919u + (uint64_t)g_rank);
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      int e, dup;
      do {
        z = mix(z);
        if (skew) {
          const double u = (double)(z >> 11) * 0x1p-53 * total;
          e = 0;
          while (e < E - 1 && cdf[e] <= u) e++;
        } else {
          e = (int)((z >> 8) % E);
        }
        dup = 0;
        for (int j = 0; j < k; j++) dup |= idx[t * K + j] == e;
      } while (dup);
      idx[t * K + k] = e;
      w[t * K + k] = 1.0f / K;
    }
}

/* Rank g_rank's routing of T tokens (make_routing) on the device, its ids
 * also in idx [T, K] for the checks; the weights are not kept (these rows
 * move unweighted). */
static int32_t *device_routing(int T, int skew, int seed, int32_t *idx) {
  float *w = malloc(4 * (size_t)T * K);
  make_routing(T, skew, seed, idx, w);
  free(w);
  int32_t *d_idx;
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&d_idx, 4 * (size_t)T * K));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(d_idx, idx, 4 * (size_t)T * K, cudaMemcpyHostToDevice));
  return d_idx;
}

/* A buffer config of the bench's shape (bf16, H, E, top-K, T tokens per
 * rank) and layout, on the bench's stream; the callers set the rest. */
static epx_buffer_config_t bench_config(int T, epx_layout_t layout) {
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_BFLOAT16, H, E, K, T);
  cfg.layout = layout;
  cfg.stream = g_stream;
  return cfg;
}

typedef struct {
  float ms, worst_ms; /* rank 0's median, the slowest rank's */
} timing_t;

static int cmp_float(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

/* Median event time of fn over REPS calls, after WARM. */
typedef void (*op_fn)(void *);
static timing_t time_op(op_fn fn, void *arg) {
  cudaEvent_t ev[REPS + 1];
  for (int i = 0; i <= REPS; i++) FATAL_UNLESS_CUDA_OK(cudaEventCreate(&ev[i]));
  for (int i = 0; i < WARM; i++) fn(arg);
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream));
  MPI_Barrier(MPI_COMM_WORLD);
  FATAL_UNLESS_CUDA_OK(cudaEventRecord(ev[0], g_stream));
  for (int i = 0; i < REPS; i++) {
    fn(arg);
    FATAL_UNLESS_CUDA_OK(cudaEventRecord(ev[i + 1], g_stream));
  }
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream));
  float t[REPS];
  for (int i = 0; i < REPS; i++) FATAL_UNLESS_CUDA_OK(cudaEventElapsedTime(&t[i], ev[i], ev[i + 1]));
  for (int i = 0; i <= REPS; i++) cudaEventDestroy(ev[i]);
  qsort(t, REPS, sizeof t[0], cmp_float);
  timing_t r = {t[REPS / 2], 0};
  MPI_Allreduce(&r.ms, &r.worst_ms, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Bcast(&r.ms, 1, MPI_FLOAT, 0, MPI_COMM_WORLD);
  return r;
}

typedef struct {
  epx_buffer_t buf;
  epx_handle_t h;
  epx_routing_t routing;
  void *x, *recv, *out;
  void *grad_recv, *grad_x; /* the backward passes' outputs */
  float *grad_recv_w, *grad_w; /* epx_weights_backward's input [cap, K] and output [T, K] */
  int64_t cap;
  /* baseline */
  ncclComm_t nc;
  void *a2a_send, *a2a_recv;
  int64_t *send_rows, *recv_rows;
} bench_t;

static void op_dispatch(void *p) {
  bench_t *b = p;
  FATAL_UNLESS_OK(epx_dispatch(b->buf, b->h, b->x, b->recv, b->cap));
}
static void op_combine(void *p) {
  bench_t *b = p;
  FATAL_UNLESS_OK(epx_combine(b->buf, b->h, b->recv, b->out));
}
/* The backward passes (no grad_w): dispatch_backward is the fused combine's
 * kernels, combine_backward the fused dispatch's (fused.h). */
static void op_dispatch_backward(void *p) {
  bench_t *b = p;
  FATAL_UNLESS_OK(epx_dispatch_backward(b->buf, b->h, b->recv, b->grad_x, NULL, NULL));
}
static void op_combine_backward(void *p) {
  bench_t *b = p;
  FATAL_UNLESS_OK(epx_combine_backward(b->buf, b->h, b->out, NULL, b->grad_recv, NULL));
}
/* With the routing-weight gradients (a handle weighted in dispatch or in
 * combine): dispatch_backward's dots need x, combine_backward's expert_out. */
static void op_dispatch_backward_grad_w(void *p) {
  bench_t *b = p;
  FATAL_UNLESS_OK(epx_dispatch_backward(b->buf, b->h, b->recv, b->grad_x, b->x, b->grad_w));
}
static void op_combine_backward_grad_w(void *p) {
  bench_t *b = p;
  FATAL_UNLESS_OK(epx_combine_backward(b->buf, b->h, b->out, b->recv, b->grad_recv, b->grad_w));
}
static void op_weights_backward(void *p) {
  bench_t *b = p;
  FATAL_UNLESS_OK(epx_weights_backward(b->buf, b->h, b->grad_recv_w, b->grad_w));
}
static void op_layout(void *p) {
  bench_t *b = p;
  epx_handle_t h;
  FATAL_UNLESS_OK(epx_dispatch_layout(b->buf, &b->routing, NULL, &h));
  FATAL_UNLESS_OK(epx_handle_release(h));
}
static void op_full(void *p) {
  bench_t *b = p;
  epx_handle_t h;
  FATAL_UNLESS_OK(epx_dispatch_layout(b->buf, &b->routing, NULL, &h));
  FATAL_UNLESS_OK(epx_dispatch(b->buf, h, b->x, b->recv, b->cap));
  FATAL_UNLESS_OK(epx_handle_release(h));
}
static void op_a2a(void *p) {
  bench_t *b = p;
  const size_t rb = 2 * H;
  int64_t so = 0, ro = 0;
  ncclGroupStart();
  for (int q = 0; q < g_size; q++) {
    ncclSend((char *)b->a2a_send + so * rb, (size_t)b->send_rows[q] * rb, ncclUint8, q, b->nc, g_stream);
    ncclRecv((char *)b->a2a_recv + ro * rb, (size_t)b->recv_rows[q] * rb, ncclUint8, q, b->nc, g_stream);
    so += b->send_rows[q], ro += b->recv_rows[q];
  }
  ncclGroupEnd();
}

/* Every received row against its source's coded row; combine (weights
 * none, expert_out = recv_x) against the token's row times its ranks. */
static void check(bench_t *b, const char *name, epx_layout_t layout, int T, const int32_t *idx) {
  int64_t N;
  FATAL_UNLESS_OK(epx_handle_recv_rows(b->h, &N));
  const size_t rb = 2 * H;
  int32_t *src = NULL, *tok = NULL;
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&src, 4 * (size_t)b->cap + 4));
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&tok, 4 * (size_t)b->cap + 4));
  FATAL_UNLESS_OK(epx_handle_recv_source(b->h, src, tok));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream));
  uint16_t *rows = malloc((size_t)N * rb + 2);
  int32_t *hs = malloc(4 * (size_t)N + 4), *ht = malloc(4 * (size_t)N + 4);
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(rows, b->recv, (size_t)N * rb, cudaMemcpyDeviceToHost));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(hs, src, 4 * (size_t)N, cudaMemcpyDeviceToHost));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(ht, tok, 4 * (size_t)N, cudaMemcpyDeviceToHost));
  int64_t wrong = 0;
  for (int64_t i = 0; i < N; i++) {
    if (hs[i] < 0) continue;
    for (int h = 0; h < H; h += 61) wrong += rows[i * H + h] != x_bits(hs[i], ht[i], h);
  }
  /* combine: out[t] = (number of ranks the token reached) * x[t] */
  FATAL_UNLESS_OK(epx_combine(b->buf, b->h, b->recv, b->out));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream)); /* the copy below runs on the legacy stream, which does not wait for it */
  uint16_t *out = malloc((size_t)T * rb + 2);
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(out, b->out, (size_t)T * rb, cudaMemcpyDeviceToHost));
  const int El = E / g_size;
  for (int t = 0; t < T; t++) {
    int ranks = 0, reach[64] = {0};
    for (int k = 0; k < K; k++) reach[idx[t * K + k] / El] = 1;
    for (int q = 0; q < g_size && q < 64; q++) ranks += reach[q];
    const int copies = layout == EPX_LAYOUT_RANK_MAJOR ? ranks : K;
    for (int h = 0; h < H; h += 61) {
      uint32_t xb = (uint32_t)x_bits(g_rank, t, h) << 16, ob = (uint32_t)out[t * H + h] << 16;
      float xv, ov;
      memcpy(&xv, &xb, 4), memcpy(&ov, &ob, 4);
      wrong += ov != (float)copies * xv;
    }
  }
  int64_t all = 0;
  MPI_Allreduce(&wrong, &all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) printf("CHECK %s: %lld wrong values (sampled every 61st column): %s\n", name, (long long)all, all ? "FAILED" : "OK");
  g_bad += all != 0;
  free(rows), free(hs), free(ht), free(out);
  cudaFree(src), cudaFree(tok);
}

/* The backward passes with grad_w (expert-major and capacity layouts: the
 * weightings in dispatch and in combine need rows per route), on handles of
 * the same routing weighted 1/8 each way: a GRADW line beside the RESULT
 * line's passes without grad_w. */
static void time_grad_w(const bench_t *b, const char *name, int T) {
  float *w = NULL;
  float *wh = malloc(4 * (size_t)T * K);
  for (int i = 0; i < T * K; i++) wh[i] = 0.125f;
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&w, 4 * (size_t)T * K));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(w, wh, 4 * (size_t)T * K, cudaMemcpyHostToDevice));
  timing_t t[2];
  const epx_weighting_t weightings[2] = {EPX_WEIGHTS_IN_DISPATCH, EPX_WEIGHTS_IN_COMBINE};
  for (int i = 0; i < 2; i++) {
    bench_t g = *b;
    g.routing.topk_w = w;
    g.routing.weighting = weightings[i];
    FATAL_UNLESS_OK(epx_dispatch_layout(g.buf, &g.routing, NULL, &g.h));
    FATAL_UNLESS_OK(epx_dispatch(g.buf, g.h, g.x, g.recv, g.cap));
    t[i] = time_op(i == 0 ? op_dispatch_backward_grad_w : op_combine_backward_grad_w, &g);
    FATAL_UNLESS_OK(epx_handle_release(g.h));
  }
  if (g_rank == 0)
    printf("GRADW %s dispatch_backward_grad_w_ms=%.4f (slowest %.4f) combine_backward_grad_w_ms=%.4f (slowest %.4f)\n",
           name, t[0].ms, t[0].worst_ms, t[1].ms, t[1].worst_ms);
  cudaFree(w);
  free(wh);
}

/* What run() measured, for the skew comparison: rank 0's medians and the
 * most bytes any rank received. */
typedef struct {
  double dispatch_ms, combine_ms, max_bytes_in;
} run_result_t;

static run_result_t run(int T, int skew, epx_layout_t layout, epx_exchange_t exchange,
                        epx_combine_precision_t precision, ncclComm_t nc) {
  char name[200];
  bench_t b = {0};
  b.nc = nc;
  int32_t *idx = malloc(4 * (size_t)T * K);
  int32_t *d_idx = device_routing(T, skew, T + skew, idx);
  b.routing = (epx_routing_t){T, K, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  epx_buffer_config_t cfg = bench_config(T, layout);
  cfg.exchange = exchange;
  cfg.combine_precision = precision;
  cfg.exchange_path = g_path;
  cfg.sm_budget = g_sms;
  FATAL_UNLESS_OK(epx_buffer_create(g_comm, &cfg, &b.buf));
  int32_t paths[64] = {0};
  FATAL_UNLESS_OK(epx_buffer_peer_paths(b.buf, paths));
  /* this rank's own path, and whether some peer is relayed through the
   * host API (EPX_CUDA_FUSED_RELAY: every other peer) */
  const int fused = paths[g_rank] == EPX_PATH_FUSED;
  int relayed = 0;
  for (int q = 0; q < g_size && q < 64; q++) relayed |= fused && paths[q] == EPX_PATH_HOST;
  char sms[48] = "";
  if (fused) {
    const int f = epx_cuda_launch_flags();
    snprintf(sms, sizeof sms, " sms=%d%s", g_sms ? g_sms : DEFAULT_SM_BUDGET,
             f & EPX_CUDA_FUSED_COPY_ENGINE    ? " copy-out=engine"
             : f & EPX_CUDA_FUSED_RECV_EIGHTH  ? " receivers=1/8"
             : f & EPX_CUDA_FUSED_RECV_QUARTER ? " receivers=1/4"
                                               : "");
  }
  if (fused && layout == EPX_LAYOUT_EXPERT_MAJOR)
    snprintf(sms + strlen(sms), sizeof sms - strlen(sms), " expand=%s",
             epx_cuda_launch_flags() & EPX_CUDA_FUSED_EXPAND_APART ? "apart" : "arrival");
  snprintf(name, sizeof name, "T=%d routing=%s layout=%s exchange=%s partials=%s path=%s%s", T,
           skew ? "zipf1.2" : "uniform", layout == EPX_LAYOUT_RANK_MAJOR ? "rank-major" : "expert-major",
           exchange == EPX_EXCHANGE_DEDUP ? "dedup" : "collective",
           precision == EPX_COMBINE_PARTIALS_PAYLOAD ? "payload" : "float32",
           relayed ? "fused+relay" : fused ? "fused" : "host", sms);
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(b.buf, &b.cap));
  const size_t rb = 2 * H;
  uint16_t *xh = malloc((size_t)T * rb);
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++) xh[(size_t)t * H + h] = x_bits(g_rank, t, h);
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.x, (size_t)T * rb));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(b.x, xh, (size_t)T * rb, cudaMemcpyHostToDevice));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.recv, (size_t)b.cap * rb));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.out, (size_t)T * rb));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.grad_recv, (size_t)b.cap * rb));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.grad_x, (size_t)T * rb));
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&b.grad_recv_w, 4 * (size_t)b.cap * K));
  FATAL_UNLESS_CUDA_OK(cudaMemset(b.grad_recv_w, 0, 4 * (size_t)b.cap * K));
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&b.grad_w, 4 * (size_t)T * K));
  FATAL_UNLESS_OK(epx_dispatch_layout(b.buf, &b.routing, NULL, &b.h));
  FATAL_UNLESS_OK(epx_dispatch(b.buf, b.h, b.x, b.recv, b.cap));
  check(&b, name, layout, T, idx);

  /* the same rows through NCCL alone */
  epx_handle_stats_t st;
  FATAL_UNLESS_OK(epx_handle_stats(b.h, &st));
  b.send_rows = calloc((size_t)g_size, 8);
  b.recv_rows = calloc((size_t)g_size, 8);
  for (int q = 0; q < g_size; q++) b.send_rows[q] = q == g_rank ? st.local_rows : st.send_rows / (g_size - 1);
  MPI_Alltoall(b.send_rows, 1, MPI_INT64_T, b.recv_rows, 1, MPI_INT64_T, MPI_COMM_WORLD);
  int64_t send_total = 0, recv_total = 0;
  for (int q = 0; q < g_size; q++) send_total += b.send_rows[q], recv_total += b.recv_rows[q];
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.a2a_send, (size_t)send_total * rb + 16));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.a2a_recv, (size_t)recv_total * rb + 16));
  if (g_counts && g_rank == 0) {
    fprintf(g_counts, "%s", name);
    for (int q = 0; q < g_size; q++) fprintf(g_counts, " %lld", (long long)b.send_rows[q]);
    fprintf(g_counts, "\n");
  }

  const timing_t dispatch = time_op(op_dispatch, &b), combine = time_op(op_combine, &b),
                 full = time_op(op_full, &b), layout_t = time_op(op_layout, &b), a2a = time_op(op_a2a, &b),
                 dispatch_bwd = time_op(op_dispatch_backward, &b), combine_bwd = time_op(op_combine_backward, &b),
                 weights_bwd = time_op(op_weights_backward, &b);
  const double bytes = (double)recv_total * (double)rb;
  run_result_t result = {dispatch.ms, combine.ms, 0};
  MPI_Allreduce(&bytes, &result.max_bytes_in, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  /* The NVLink floor: the remote rows at 450 GB/s, one direction of the
   * H200's 18 links (shared/PERFORMANCE.md). */
  const double floor_ms = (double)st.send_bytes / 450e9 * 1e3;
  if (g_rank == 0) {
    printf("RESULT %s dispatch_ms=%.4f (slowest %.4f) combine_ms=%.4f full_dispatch_ms=%.4f layout_us=%.1f "
           "nccl_a2a_ms=%.4f rows_in=%lld remote_rows_out=%lld bytes_in=%.0f dispatch_GBps=%.0f combine_GBps=%.0f "
           "dispatch/a2a=%.3f dispatch_backward_ms=%.4f combine_backward_ms=%.4f nvlink_floor_ms=%.4f "
           "dispatch/floor=%.2f combine/floor=%.2f weights_backward_us=%.1f\n",
           name, dispatch.ms, dispatch.worst_ms, combine.ms, full.ms, layout_t.ms * 1e3, a2a.ms, (long long)recv_total,
           (long long)st.send_rows, bytes, bytes / dispatch.ms / 1e6, bytes / combine.ms / 1e6, dispatch.ms / a2a.ms,
           dispatch_bwd.ms, combine_bwd.ms, floor_ms, dispatch.ms / floor_ms, combine.ms / floor_ms,
           weights_bwd.ms * 1e3);
    /* the expert-major dispatch against a rank-major exchange plus a
     * PyTorch permute of the same rows (bench_torch_ep.py times it) */
    if (g_permute && layout == EPX_LAYOUT_EXPERT_MAJOR && exchange == EPX_EXCHANGE_DEDUP &&
        precision == EPX_COMBINE_PARTIALS_PAYLOAD && !relayed) {
      int64_t N = 0;
      FATAL_UNLESS_OK(epx_handle_recv_rows(b.h, &N));
      fprintf(g_permute, "%s rows_in=%lld expanded_rows=%lld dispatch_ms=%.4f T=%d\n", name, (long long)recv_total,
              (long long)N, dispatch.ms, T);
    }
    if (layout == EPX_LAYOUT_RANK_MAJOR && exchange == EPX_EXCHANGE_DEDUP && !skew &&
        precision == EPX_COMBINE_PARTIALS_PAYLOAD && g_path == EPX_PATH_FUSED && g_sms == 0 && !relayed) {
      if (T == 8192) {
        printf("TARGET dedup rank-major dispatch / a2a (8192)            %.3f <= 1.15\n", dispatch.ms / a2a.ms);
        printf("TARGET dedup rank-major combine / a2a (8192)             %.3f <= 1.15\n", combine.ms / a2a.ms);
        printf("TARGET dedup rank-major dispatch vs DeepEP 0.658 ms      %.4f ms <= 0.658\n", dispatch.ms);
      }
      if (T == 4096)
        printf("TARGET cached dispatch / full dispatch (4096)            %.3f <= 0.85\n", dispatch.ms / full.ms);
      printf("TARGET backward within 10%%: dispatch_backward / combine (%d) %.3f <= 1.10\n", T,
             dispatch_bwd.ms / combine.ms);
      printf("TARGET backward within 10%%: combine_backward / dispatch (%d) %.3f <= 1.10\n", T,
             combine_bwd.ms / dispatch.ms);
    }
  }
  if (layout != EPX_LAYOUT_RANK_MAJOR && exchange == EPX_EXCHANGE_DEDUP && precision == EPX_COMBINE_PARTIALS_PAYLOAD &&
      !skew)
    time_grad_w(&b, name, T);
  FATAL_UNLESS_OK(epx_handle_release(b.h));
  FATAL_UNLESS_OK(epx_buffer_destroy(b.buf));
  cudaFree(b.x), cudaFree(b.recv), cudaFree(b.out), cudaFree(b.a2a_send), cudaFree(b.a2a_recv), cudaFree(d_idx);
  cudaFree(b.grad_recv), cudaFree(b.grad_x), cudaFree(b.grad_recv_w), cudaFree(b.grad_w);
  free(idx), free(xh), free(b.send_rows), free(b.recv_rows);
  return result;
}

/* ------------------------------------------------------------------------ */
/* fp8 dispatch beside bf16                                                  */
/* ------------------------------------------------------------------------ */

/* One buffer of the fp8 section: an expert-major dedup buffer with
 * fp8_format EPX_FP8_E4M3_F32_128 (DeepEP's e4m3 with a float32 scale per
 * 128 channels) on one path, its handle, and the tensors of its three
 * dispatches: base's x [T, H] bf16 and recv [cap, H] (op_dispatch's), and
 * the fp8 ones. */
typedef struct {
  bench_t base;
  const void *xq, *xs; /* [T, H] e4m3 and [T, H / 128] float32 (epx_quantize of base.x) */
  void *rq, *rs;       /* [cap, H] e4m3 and [cap, H / 128] float32 */
} fp8_bench_t;

static void op_fp8_prequantized(void *p) {
  fp8_bench_t *b = p;
  FATAL_UNLESS_OK(epx_dispatch_fp8(b->base.buf, b->base.h, b->xq, b->xs, b->rq, b->rs, b->base.cap));
}
static void op_fp8_quantize(void *p) {
  fp8_bench_t *b = p;
  FATAL_UNLESS_OK(epx_dispatch_quantize(b->base.buf, b->base.h, b->base.x, b->rq, b->rs, b->base.cap));
}

/* The received e4m3 rows and scales [N, H] and [N, S] on the host. */
static void fp8_fetch(const fp8_bench_t *b, int64_t N, size_t S, uint8_t **q, uint8_t **s) {
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream));
  *q = malloc((size_t)N * H + 1), *s = malloc((size_t)N * S + 1);
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(*q, b->rq, (size_t)N * H, cudaMemcpyDeviceToHost));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(*s, b->rs, (size_t)N * S, cudaMemcpyDeviceToHost));
}

/* The fp8 dispatches of T tokens (uniform routing, expert-major, dedup)
 * beside bf16 on the same buffer, on the fused path and on the host path:
 * a RESULT line per path with the three dispatch times (bf16 epx_dispatch,
 * epx_dispatch_fp8 of pre-quantized rows, epx_dispatch_quantize from bf16)
 * and GB/s of the rows received, each rank-major row once, its own
 * included (DeepEP's count: H * 2 bytes a bf16 row, H + H / 32 an fp8 row
 * and its scales). Checked first: every path's and dispatch's received
 * bytes equal the fused path's epx_dispatch_fp8 (the pre-quantized rows are
 * epx_quantize of x: the same bytes). */
static void run_fp8(int T) {
  const epx_fp8_format_t format = EPX_FP8_E4M3_F32_128;
  const size_t S = (size_t)H / 128 * 4;
  int32_t *idx = malloc(4 * (size_t)T * K);
  int32_t *d_idx = device_routing(T, 0, T, idx);
  const epx_routing_t routing = {T, K, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  uint16_t *xh = malloc((size_t)T * H * 2);
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++) xh[(size_t)t * H + h] = x_bits(g_rank, t, h);
  uint8_t *xqh = malloc((size_t)T * H), *xsh = malloc((size_t)T * S);
  FATAL_UNLESS_OK(epx_quantize(format, EPX_BFLOAT16, T, H, xh, xqh, xsh));
  void *x, *xq, *xs;
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&x, (size_t)T * H * 2));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&xq, (size_t)T * H));
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&xs, (size_t)T * S));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(x, xh, (size_t)T * H * 2, cudaMemcpyHostToDevice));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(xq, xqh, (size_t)T * H, cudaMemcpyHostToDevice));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(xs, xsh, (size_t)T * S, cudaMemcpyHostToDevice));
  uint8_t *ref_q = NULL, *ref_s = NULL; /* the fused path's epx_dispatch_fp8 */
  int64_t ref_n = -1;
  double fused_ms[3] = {0, 0, 0};
  const epx_exchange_path_t paths[2] = {EPX_PATH_FUSED, EPX_PATH_HOST};
  for (int pi = 0; pi < 2; pi++) {
    epx_buffer_config_t cfg = bench_config(T, EPX_LAYOUT_EXPERT_MAJOR);
    cfg.exchange = EPX_EXCHANGE_DEDUP;
    cfg.exchange_path = paths[pi];
    cfg.fp8_format = format;
    fp8_bench_t b = {0};
    bench_t *d = &b.base;
    d->x = x, b.xq = xq, b.xs = xs;
    FATAL_UNLESS_OK(epx_buffer_create(g_comm, &cfg, &d->buf));
    int32_t peer_paths[64] = {0};
    FATAL_UNLESS_OK(epx_buffer_peer_paths(d->buf, peer_paths));
    const char *path = peer_paths[g_rank] == EPX_PATH_FUSED ? "fused" : "host";
    FATAL_UNLESS_OK(epx_dispatch_layout(d->buf, &routing, NULL, &d->h));
    FATAL_UNLESS_OK(epx_buffer_max_recv_rows(d->buf, &d->cap));
    FATAL_UNLESS_CUDA_OK(cudaMalloc(&d->recv, (size_t)d->cap * H * 2));
    FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.rq, (size_t)d->cap * H));
    FATAL_UNLESS_CUDA_OK(cudaMalloc(&b.rs, (size_t)d->cap * S));
    int64_t N = 0;
    FATAL_UNLESS_OK(epx_handle_recv_rows(d->h, &N));
    /* the check: both fp8 dispatches against the fused path's epx_dispatch_fp8 */
    int64_t wrong = 0;
    for (int d = 0; d < 2; d++) {
      (d ? op_fp8_quantize : op_fp8_prequantized)(&b);
      uint8_t *q, *s;
      fp8_fetch(&b, N, S, &q, &s);
      if (!ref_q) {
        ref_q = q, ref_s = s, ref_n = N;
        continue;
      }
      wrong += N != ref_n || memcmp(q, ref_q, (size_t)N * H) || memcmp(s, ref_s, (size_t)N * S);
      free(q), free(s);
    }
    int64_t all = 0;
    MPI_Allreduce(&wrong, &all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    char name[160];
    snprintf(name, sizeof name, "fp8 T=%d layout=expert-major exchange=dedup format=e4m3-f32-128 path=%s", T, path);
    if (g_rank == 0)
      printf("CHECK %s: %lld dispatches whose rows differ from the fused path's epx_dispatch_fp8: %s\n", name,
             (long long)all, all ? "FAILED" : "OK");
    g_bad += all != 0;
    epx_handle_stats_t st;
    FATAL_UNLESS_OK(epx_handle_stats(d->h, &st));
    const timing_t bf16 = time_op(op_dispatch, d), pre = time_op(op_fp8_prequantized, &b),
                   quant = time_op(op_fp8_quantize, &b);
    const double rows_in = (double)(st.local_rows + st.recv_rows);
    if (g_rank == 0) {
      printf("RESULT %s bf16_dispatch_ms=%.4f (slowest %.4f) fp8_dispatch_ms=%.4f (slowest %.4f) "
             "quantize_dispatch_ms=%.4f (slowest %.4f) fp8/bf16=%.3f quantize/fp8=%.3f rows_in=%.0f "
             "bf16_GBps=%.0f fp8_GBps=%.0f quantize_GBps=%.0f\n",
             name, bf16.ms, bf16.worst_ms, pre.ms, pre.worst_ms, quant.ms, quant.worst_ms, pre.ms / bf16.ms,
             quant.ms / pre.ms, rows_in, rows_in * H * 2 / bf16.ms / 1e6, rows_in * (H + (double)S) / pre.ms / 1e6,
             rows_in * (H + (double)S) / quant.ms / 1e6);
      if (pi == 0) {
        fused_ms[0] = bf16.ms, fused_ms[1] = pre.ms, fused_ms[2] = quant.ms;
        printf("TARGET fp8 dispatch / bf16 dispatch (fused, %d)          %.3f <= 0.56\n", T, pre.ms / bf16.ms);
        printf("TARGET quantize dispatch / fp8 dispatch (fused, %d)      %.3f <= 1.10\n", T, quant.ms / pre.ms);
      } else {
        printf("RESULT fp8 T=%d fused/host: bf16 dispatch %.3f fp8 dispatch %.3f quantize dispatch %.3f\n", T,
               fused_ms[0] / bf16.ms, fused_ms[1] / pre.ms, fused_ms[2] / quant.ms);
      }
    }
    FATAL_UNLESS_OK(epx_handle_release(d->h));
    FATAL_UNLESS_OK(epx_buffer_destroy(d->buf));
    cudaFree(d->recv), cudaFree(b.rq), cudaFree(b.rs);
  }
  free(ref_q), free(ref_s), free(idx), free(xh), free(xqh), free(xsh);
  cudaFree(x), cudaFree(xq), cudaFree(xs), cudaFree(d_idx);
}

/* The stages of the fused layouts just run (a trace build): per stage the
 * median over the traced layouts of its time since the layout began. */
static void print_layout_trace(int T) {
  static const char *const stages[] = {"count-start", "count-block0-done", "exchange-start", "header", "prefix",
                                       "cts-in", "counts-written", "counts-in", "bases", "records-start",
                                       "records-last", "receive-start", "meta-in", "receive-end",
                                       "count-b0-loaded", "count-b0-deduped"};
  unsigned long long tr[64][16];
  if (epx_fused_layout_trace(&tr[0][0]) != 0) return;
  for (int st = 0; st < 16; st++) {
    float v[64];
    int n = 0;
    for (int i = 0; i < 64; i++)
      if (tr[i][0] && tr[i][13] > tr[i][0] && tr[i][st] >= tr[i][0]) v[n++] = (float)(tr[i][st] - tr[i][0]) * 1e-3f;
    qsort(v, (size_t)n, sizeof v[0], cmp_float);
    if (n) printf("TRACE T=%d %-18s median %7.2f us (n=%d)\n", T, stages[st], v[n / 2], n);
  }
}

/* The layout with worst_case_sizing: no host wait, events around it. */
static void run_worst_layout(int T) {
  epx_buffer_config_t cfg = bench_config(T, EPX_LAYOUT_RANK_MAJOR);
  cfg.worst_case_sizing = 1;
  bench_t b = {0};
  FATAL_UNLESS_OK(epx_buffer_create(g_comm, &cfg, &b.buf));
  int32_t *idx = malloc(4 * (size_t)T * K);
  int32_t *d_idx = device_routing(T, 0, T, idx);
  b.routing = (epx_routing_t){T, K, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  const timing_t t = time_op(op_layout, &b);
  /* The host's side: wall time per call of the same loop, enqueueing only
   * (the device time above is this where the host is the bottleneck). */
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream));
  MPI_Barrier(MPI_COMM_WORLD);
  struct timespec a0, a1;
  clock_gettime(CLOCK_MONOTONIC, &a0);
  for (int i = 0; i < REPS; i++) op_layout(&b);
  clock_gettime(CLOCK_MONOTONIC, &a1);
  const double host_us = ((double)(a1.tv_sec - a0.tv_sec) * 1e6 + (double)(a1.tv_nsec - a0.tv_nsec) * 1e-3) / REPS;
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream));
  if (epx_fused_layout_trace && g_rank == 0) print_layout_trace(T);
  /* The device's side alone: REPS layouts captured in one graph and
   * replayed (no host work between them); the event time above is the
   * larger of this and the host's. */
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FATAL_UNLESS_CUDA_OK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < REPS; i++) op_layout(&b);
  FATAL_UNLESS_CUDA_OK(cudaStreamEndCapture(g_stream, &graph));
  FATAL_UNLESS_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  timing_t g = {0, 0};
  {
    cudaEvent_t e0, e1;
    FATAL_UNLESS_CUDA_OK(cudaEventCreate(&e0));
    FATAL_UNLESS_CUDA_OK(cudaEventCreate(&e1));
    float best = 0;
    for (int i = 0; i < 4; i++) {
      MPI_Barrier(MPI_COMM_WORLD);
      FATAL_UNLESS_CUDA_OK(cudaEventRecord(e0, g_stream));
      FATAL_UNLESS_CUDA_OK(cudaGraphLaunch(exec, g_stream));
      FATAL_UNLESS_CUDA_OK(cudaEventRecord(e1, g_stream));
      FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(g_stream));
      float ms;
      FATAL_UNLESS_CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
      if (i > 0 && (best == 0 || ms < best)) best = ms; /* the first replay warms up */
    }
    g.ms = best / REPS;
    MPI_Allreduce(&g.ms, &g.worst_ms, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
  }
  FATAL_UNLESS_CUDA_OK(cudaGraphExecDestroy(exec));
  FATAL_UNLESS_CUDA_OK(cudaGraphDestroy(graph));
  if (g_rank == 0) {
    printf("RESULT T=%d layout+count exchange (worst_case_sizing, no host wait) us=%.1f (slowest %.1f) "
           "host_us_per_call=%.1f graph_replay_us=%.1f (slowest %.1f)\n", T, t.ms * 1e3, t.worst_ms * 1e3,
           host_us, g.ms * 1e3, g.worst_ms * 1e3);
    if (T == 8192) printf("TARGET layout + count exchange (8192, worst case)      %.1f us <= 40\n", t.ms * 1e3);
  }
  FATAL_UNLESS_OK(epx_buffer_destroy(b.buf));
  cudaFree(d_idx), free(idx);
}

/* ------------------------------------------------------------------------ */
/* Whole steps: the SM-budget sweep                                          */
/* ------------------------------------------------------------------------ */

enum { FFN = 2048, MB = 2 }; /* the expert MLP's intermediate size; micro-batches per step */

#define CUBLAS(call)                                                                                   \
  do {                                                                                                 \
    cublasStatus_t s_ = (call);                                                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                 \
      fprintf(stderr, "rank %d: %s:%d: %s: cuBLAS status %d\n", g_rank, __FILE__, __LINE__, #call, (int)s_); \
      MPI_Abort(MPI_COMM_WORLD, 5);                                                                    \
    }                                                                                                  \
  } while (0)

/* The expert weights and their gradients, shared by the micro-batches. */
typedef struct {
  cublasHandle_t blas;
  cudaStream_t gemm;  /* the GEMMs' stream */
  int El;
  void *w1, *w2, *dw1, *dw2; /* [El, H, 2F], [El, F, H] bf16 */
} experts_t;

/* One micro-batch: its handle and activations ([rows, *] bf16, rows = the
 * buffer's recv bound + El so the uniform expert slices fit). */
typedef struct {
  epx_handle_t h;
  int64_t m; /* rows per expert slice: ceil(N / El) */
  void *x, *out, *gout, *gx;           /* [T, H] */
  void *recv, *eo, *geo, *grecv;       /* [rows, H] */
  void *h1, *gh1;                      /* [rows, 2F] */
  float *gw;                           /* [T, K] the routing weights' gradient */
  cudaEvent_t ex_done, gemm_done;
} micro_t;

typedef struct {
  epx_buffer_t buf;
  experts_t *ex;
  micro_t mb[MB];
  int64_t cap;
  int backward;
} step_t;

/* Row-major C[M x N] = op(A) op(B) for every local expert (strided batches);
 * lda/ldb/ldc are row strides as stored, sa/sb/sc the experts' strides. */
static void rm_gemm(experts_t *ex, int ta, int tb, int64_t M, int64_t N, int64_t Kd, const void *A, int64_t lda,
                    int64_t sa, const void *B, int64_t ldb, int64_t sb, void *C, int64_t ldc, int64_t sc) {
  const float one = 1.0f, zero = 0.0f;
  /* column-major: C^T = op(B)^T op(A)^T, the transposes carried over */
  CUBLAS(cublasGemmStridedBatchedEx(ex->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    (int)N, (int)M, (int)Kd, &one, B, CUDA_R_16BF, (int)ldb, sb, A, CUDA_R_16BF,
                                    (int)lda, sa, &zero, C, CUDA_R_16BF, (int)ldc, sc, ex->El, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

/* The expert MLP of one micro-batch on the GEMM stream: forward h1 = recv W1,
 * eo = h1[:, :F] W2; backward gh1[:, :F] = geo W2^T, dW2 = h1[:, :F]^T geo,
 * grecv = gh1 W1^T, dW1 = recv^T gh1. */
static void expert_mlp(experts_t *ex, const micro_t *u, int backward) {
  const int64_t m = u->m, F2 = 2 * FFN;
  if (!backward) {
    rm_gemm(ex, 0, 0, m, F2, H, u->recv, H, m * H, ex->w1, F2, (int64_t)H * F2, u->h1, F2, m * F2);
    rm_gemm(ex, 0, 0, m, H, FFN, u->h1, F2, m * F2, ex->w2, H, (int64_t)FFN * H, u->eo, H, m * H);
    return;
  }
  rm_gemm(ex, 0, 1, m, FFN, H, u->geo, H, m * H, ex->w2, H, (int64_t)FFN * H, u->gh1, F2, m * F2);
  rm_gemm(ex, 1, 0, FFN, H, m, u->h1, F2, m * F2, u->geo, H, m * H, ex->dw2, H, (int64_t)FFN * H);
  rm_gemm(ex, 0, 1, m, H, F2, u->gh1, F2, m * F2, ex->w1, F2, (int64_t)H * F2, u->grecv, H, m * H);
  rm_gemm(ex, 1, 0, H, F2, m, u->recv, H, m * H, u->gh1, F2, m * F2, ex->dw1, F2, (int64_t)H * F2);
}

/* The exchange into the GEMMs (dispatch, or combine_backward) and out of
 * them (combine, or dispatch_backward) of micro-batch i. */
static void exchange_in(step_t *s, int i) {
  micro_t *u = &s->mb[i];
  if (!s->backward) FATAL_UNLESS_OK(epx_dispatch(s->buf, u->h, u->x, u->recv, s->cap));
  else FATAL_UNLESS_OK(epx_combine_backward(s->buf, u->h, u->gout, u->eo, u->geo, u->gw)); /* the router's gradient too */
}
static void exchange_out(step_t *s, int i) {
  micro_t *u = &s->mb[i];
  if (!s->backward) FATAL_UNLESS_OK(epx_combine(s->buf, u->h, u->eo, u->out));
  else FATAL_UNLESS_OK(epx_dispatch_backward(s->buf, u->h, u->grecv, u->gx, NULL, NULL));
}

/* One pipelined step: every exchange on g_stream, every GEMM on ex->gemm;
 * micro-batch i+1's exchange in overlaps i's GEMMs, i's exchange out
 * overlaps i+1's GEMMs. Ends on g_stream. */
static void op_step(void *p) {
  step_t *s = p;
  for (int i = 0; i < MB; i++) {
    exchange_in(s, i);
    FATAL_UNLESS_CUDA_OK(cudaEventRecord(s->mb[i].ex_done, g_stream));
    FATAL_UNLESS_CUDA_OK(cudaStreamWaitEvent(s->ex->gemm, s->mb[i].ex_done, 0));
    expert_mlp(s->ex, &s->mb[i], s->backward);
    FATAL_UNLESS_CUDA_OK(cudaEventRecord(s->mb[i].gemm_done, s->ex->gemm));
  }
  for (int i = 0; i < MB; i++) {
    FATAL_UNLESS_CUDA_OK(cudaStreamWaitEvent(g_stream, s->mb[i].gemm_done, 0));
    exchange_out(s, i);
  }
}

/* The GEMMs alone (the same work, no exchange), timed on g_stream. */
static void op_gemms(void *p) {
  step_t *s = p;
  FATAL_UNLESS_CUDA_OK(cudaEventRecord(s->mb[0].ex_done, g_stream));
  FATAL_UNLESS_CUDA_OK(cudaStreamWaitEvent(s->ex->gemm, s->mb[0].ex_done, 0));
  for (int i = 0; i < MB; i++) expert_mlp(s->ex, &s->mb[i], s->backward);
  FATAL_UNLESS_CUDA_OK(cudaEventRecord(s->mb[0].gemm_done, s->ex->gemm));
  FATAL_UNLESS_CUDA_OK(cudaStreamWaitEvent(g_stream, s->mb[0].gemm_done, 0));
}

/* The exchanges alone: every micro-batch's in, then out. */
static void op_exchanges(void *p) {
  step_t *s = p;
  for (int i = 0; i < MB; i++) exchange_in(s, i);
  for (int i = 0; i < MB; i++) exchange_out(s, i);
}

static void *dev_fill(size_t bytes) {
  void *p = NULL;
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&p, bytes));
  FATAL_UNLESS_CUDA_OK(cudaMemset(p, 0x3c, bytes)); /* bf16 0x3c3c = 0.0115: finite sums in every GEMM */
  return p;
}

static void experts_init(experts_t *ex) {
  ex->El = E / g_size;
  const size_t w1 = (size_t)ex->El * H * 2 * FFN * 2, w2 = (size_t)ex->El * FFN * H * 2;
  ex->w1 = dev_fill(w1), ex->dw1 = dev_fill(w1);
  ex->w2 = dev_fill(w2), ex->dw2 = dev_fill(w2);
  FATAL_UNLESS_CUDA_OK(cudaStreamCreateWithFlags(&ex->gemm, cudaStreamNonBlocking));
  CUBLAS(cublasCreate(&ex->blas));
  CUBLAS(cublasSetStream(ex->blas, ex->gemm));
}

static void experts_fini(experts_t *ex) {
  cublasDestroy(ex->blas);
  cudaStreamDestroy(ex->gemm);
  cudaFree(ex->w1), cudaFree(ex->w2), cudaFree(ex->dw1), cudaFree(ex->dw2);
}

/* Micro-batch i of a step buffer: routing (seeded by i), layout, buffers. */
static void micro_init(step_t *s, int i, int T, int32_t *d_idx, float *d_w) {
  micro_t *u = &s->mb[i];
  int32_t *idx = malloc(4 * (size_t)T * K);
  float *w = malloc(4 * (size_t)T * K);
  make_routing(T, 0, 1000 + i, idx, w);
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(d_idx, idx, 4 * (size_t)T * K, cudaMemcpyHostToDevice));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(d_w, w, 4 * (size_t)T * K, cudaMemcpyHostToDevice));
  const epx_routing_t r = {T, K, d_idx, d_w, NULL, EPX_WEIGHTS_IN_COMBINE};
  FATAL_UNLESS_OK(epx_dispatch_layout(s->buf, &r, NULL, &u->h));
  int64_t N;
  FATAL_UNLESS_OK(epx_handle_recv_rows(u->h, &N));
  const int El = s->ex->El;
  u->m = (N + El - 1) / El;
  const size_t rows = (size_t)(s->cap + El), tb = (size_t)T * H * 2;
  void **tok[] = {&u->x, &u->out, &u->gout, &u->gx}, **row[] = {&u->recv, &u->eo, &u->geo, &u->grecv};
  for (int j = 0; j < 4; j++) *tok[j] = dev_fill(tb), *row[j] = dev_fill(rows * H * 2);
  u->h1 = dev_fill(rows * 2 * FFN * 2), u->gh1 = dev_fill(rows * 2 * FFN * 2);
  u->gw = dev_fill(4 * (size_t)T * K);
  FATAL_UNLESS_CUDA_OK(cudaEventCreateWithFlags(&u->ex_done, cudaEventDisableTiming));
  FATAL_UNLESS_CUDA_OK(cudaEventCreateWithFlags(&u->gemm_done, cudaEventDisableTiming));
  free(idx), free(w);
}

static void micro_fini(micro_t *u) {
  FATAL_UNLESS_OK(epx_handle_release(u->h));
  void *p[] = {u->x, u->out, u->gout, u->gx, u->recv, u->eo, u->geo, u->grecv, u->h1, u->gh1, u->gw};
  for (size_t j = 0; j < sizeof p / sizeof p[0]; j++) cudaFree(p[j]);
  cudaEventDestroy(u->ex_done), cudaEventDestroy(u->gemm_done);
}

typedef struct {
  float fwd, bwd;
} step_times_t;

/* The step sweep's row for one path and budget: the step forward and
 * backward, the GEMMs alone, the exchanges alone (medians, ms). */
static step_times_t run_step(experts_t *ex, int T, epx_exchange_path_t path, int32_t sms) {
  epx_buffer_config_t cfg = bench_config(T, EPX_LAYOUT_EXPERT_MAJOR);
  cfg.combine_precision = EPX_COMBINE_PARTIALS_PAYLOAD;
  cfg.exchange_path = path;
  cfg.sm_budget = sms;
  step_t s = {0};
  s.ex = ex;
  FATAL_UNLESS_OK(epx_buffer_create(g_comm, &cfg, &s.buf));
  int32_t paths[64] = {0};
  FATAL_UNLESS_OK(epx_buffer_peer_paths(s.buf, paths));
  FATAL_UNLESS_OK(epx_buffer_max_recv_rows(s.buf, &s.cap));
  int32_t *d_idx;
  float *d_w;
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&d_idx, 4 * (size_t)T * K));
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&d_w, 4 * (size_t)T * K));
  for (int i = 0; i < MB; i++) micro_init(&s, i, T, d_idx, d_w);
  timing_t t[6];
  for (int b = 0; b < 2; b++) {
    s.backward = b;
    t[b] = time_op(op_step, &s);
    t[2 + b] = time_op(op_gemms, &s);
    t[4 + b] = time_op(op_exchanges, &s);
  }
  double flops = 0;
  for (int i = 0; i < MB; i++) flops += 2.0 * (double)s.mb[i].m * ex->El * (double)H * 3 * FFN;
  if (g_rank == 0)
    printf("STEP T=%dx%d layout=expert-major partials=payload path=%s sms=%d fwd_ms=%.3f bwd_ms=%.3f "
           "gemm_fwd_ms=%.3f gemm_bwd_ms=%.3f exchange_fwd_ms=%.3f exchange_bwd_ms=%.3f exposed_fwd_ms=%.3f "
           "exposed_bwd_ms=%.3f gemm_TFLOPs=%.0f (slowest rank fwd %.3f bwd %.3f)\n",
           MB, T, paths[0] == EPX_PATH_FUSED ? "fused" : "host", paths[0] == EPX_PATH_FUSED ? (sms ? sms : DEFAULT_SM_BUDGET) : 0,
           t[0].ms, t[1].ms, t[2].ms, t[3].ms, t[4].ms, t[5].ms, t[0].ms - t[2].ms, t[1].ms - t[3].ms,
           flops / t[2].ms / 1e9, t[0].worst_ms, t[1].worst_ms);
  for (int i = 0; i < MB; i++) micro_fini(&s.mb[i]);
  FATAL_UNLESS_OK(epx_buffer_destroy(s.buf));
  cudaFree(d_idx), cudaFree(d_w);
  return (step_times_t){t[0].worst_ms, t[1].worst_ms};
}

/* The sweep: the host path, then the fused path at each budget; the budget
 * of the fastest step (forward + backward, slowest rank) is printed. */
static void run_step_sweep(int T) {
  experts_t ex;
  experts_init(&ex);
  run_step(&ex, T, EPX_PATH_HOST, 0);
  const int32_t budgets[] = {8, 16, 24, 32};
  int32_t best = 0;
  float best_ms = 0;
  for (size_t i = 0; i < sizeof budgets / sizeof budgets[0]; i++) {
    const step_times_t st = run_step(&ex, T, EPX_PATH_FUSED, budgets[i]);
    if (!best || st.fwd + st.bwd < best_ms) best = budgets[i], best_ms = st.fwd + st.bwd;
  }
  if (g_rank == 0)
    printf("STEP T=%dx%d fastest step (forward + backward, slowest rank) at sm_budget=%d: %.3f ms\n", MB, T, best,
           best_ms);
  experts_fini(&ex);
}

/* Whether section `name` is asked for (EPX_BENCH_EP_SECTIONS, default all). */
static int section(const char *name) {
  const char *s = getenv("EPX_BENCH_EP_SECTIONS");
  if (!s || !*s || !strcmp(s, "all")) return 1;
  const size_t n = strlen(name);
  for (const char *p = s; (p = strstr(p, name)) != NULL; p += n)
    if ((p == s || p[-1] == ',') && (p[n] == '\0' || p[n] == ',')) return 1;
  return 0;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  setvbuf(stdout, NULL, _IOLBF, 0); /* every line out at once: a run cut by its time limit keeps what it measured */
  if (g_size == 1) epx_cuda_ep_at_one_rank(1);
  int devices = 0;
  FATAL_UNLESS_CUDA_OK(cudaGetDeviceCount(&devices));
  FATAL_UNLESS_CUDA_OK(cudaSetDevice(g_rank % devices));
  FATAL_UNLESS_CUDA_OK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  MPI_Comm world = MPI_COMM_WORLD;
  FATAL_UNLESS_OK(epx_comm_create_nccl_mpi(&world, NULL, &g_comm));
  /* the baseline's own NCCL comm (the same library, the same GPUs) */
  ncclUniqueId id;
  if (g_rank == 0) ncclGetUniqueId(&id);
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t nc;
  if (ncclCommInitRank(&nc, g_size, id, g_rank) != ncclSuccess) MPI_Abort(MPI_COMM_WORLD, 4);
  if (argc > 1 && g_rank == 0) {
    char path[512];
    snprintf(path, sizeof path, "%s/ep_counts.txt", argv[1]);
    g_counts = fopen(path, "w");
    snprintf(path, sizeof path, "%s/ep_permute.txt", argv[1]);
    g_permute = fopen(path, "w");
  }
  if (g_rank == 0) {
    int version = 0;
    ncclGetVersion(&version);
    printf("DEVICE %d ranks, NCCL %d, H=%d E=%d top-%d bf16\n", g_size, version, H, E, K);
  }
  const int tokens[] = {8192, 4096};
  for (int ti = 0; ti < 2; ti++) {
    const int T = tokens[ti];
    if (section("main") || section("layout")) run_worst_layout(T);
    if (section("main")) {
      run_result_t dedup[2];
      for (int skew = 0; skew < 2; skew++) {
        dedup[skew] = run(T, skew, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        run(T, skew, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        /* the other expansion of the fused expert-major rows */
        const int flags = epx_cuda_launch_flags();
        epx_cuda_set_launch_flags(flags ^ EPX_CUDA_FUSED_EXPAND_APART);
        run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        epx_cuda_set_launch_flags(flags);
        run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_FLOAT32, nc);
        /* the default's choice for expert-major (AUTO: the host path) */
        g_path = EPX_PATH_AUTO;
        run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        g_path = EPX_PATH_FUSED;
        run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      }
      /* Zipf skew: time may grow by no more than the busiest rank's bytes */
      const double grow = dedup[1].max_bytes_in / dedup[0].max_bytes_in;
      if (g_rank == 0) {
        printf("TARGET skewed / uniform dispatch time (%d) vs bytes      %.3f <= %.3f\n", T,
               dedup[1].dispatch_ms / dedup[0].dispatch_ms, grow);
        printf("TARGET skewed / uniform combine time (%d) vs bytes       %.3f <= %.3f\n", T,
               dedup[1].combine_ms / dedup[0].combine_ms, grow);
      }
    }
    /* fp8 beside bf16 (main runs it at 8192 tokens) */
    if (section("fp8") || (section("main") && T == 8192)) run_fp8(T);
    if (section("relay") && g_size > 1) {
      /* The mixed path: the fused kernels with every peer relayed through
       * NCCL's host API (EPX_CUDA_FUSED_RELAY, as peers without load/store
       * access are: path=fused+relay), beside the host path (uniform
       * routing, payload partials; the fused rows are the main section's). */
      const int flags = epx_cuda_launch_flags();
      const epx_layout_t layouts[] = {EPX_LAYOUT_RANK_MAJOR, EPX_LAYOUT_EXPERT_MAJOR};
      for (int li = 0; li < 2; li++) {
        g_path = EPX_PATH_HOST;
        if (!section("main")) run(T, 0, layouts[li], EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        g_path = EPX_PATH_FUSED;
        epx_cuda_set_launch_flags(flags | EPX_CUDA_FUSED_RELAY);
        run(T, 0, layouts[li], EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        epx_cuda_set_launch_flags(flags);
      }
    }
    if (section("expert") && !section("main")) {
      /* The expert-major dedup rows alone (uniform routing): fused, host,
       * fused with float32 partials. */
      run(T, 0, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      g_path = EPX_PATH_HOST;
      run(T, 0, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      g_path = EPX_PATH_FUSED;
      run(T, 0, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_FLOAT32, nc);
    }
    if (section("sweep")) {
      /* Fused vs host, rank-major, payload partials (the shape):
       * the host path, then the fused path at each SM budget (0: the
       * default, which also prints the TARGET lines). */
      g_path = EPX_PATH_HOST;
      run(T, 0, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      g_path = EPX_PATH_FUSED;
      /* 0: the default (DEFAULT_SM_BUDGET), run by the main section if
       * asked; 48 / 64 / 132 (every SM of an H200): what the targets need */
      const int32_t budgets[] = {8, 16, 24, 0, 48, 64, 132};
      for (int si = 0; si < 7; si++) {
        if (budgets[si] == 0 && section("main")) continue;
        g_sms = budgets[si];
        run(T, 0, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      }
      g_sms = 0;
    }
    if (section("engine")) {
      /* The rank-major copy-out by the copy engine
       * (EPX_CUDA_FUSED_COPY_ENGINE) at the budgets the targets name. */
      const int32_t budgets[] = {16, 24, 32};
      const int flags = epx_cuda_launch_flags();
      epx_cuda_set_launch_flags(flags | EPX_CUDA_FUSED_COPY_ENGINE);
      for (int si = 0; si < 3; si++) {
        g_sms = budgets[si];
        run(T, 0, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      }
      epx_cuda_set_launch_flags(flags);
      g_sms = 0;
    }
    if (section("split")) {
      /* The budget's split between sending and receiving CTAs (half
       * receives by default; a quarter, an eighth): rank-major, payload
       * partials, at the budgets the targets name. */
      const int32_t budgets[] = {8, 16, 24, 32};
      const int shares[] = {EPX_CUDA_FUSED_RECV_QUARTER, EPX_CUDA_FUSED_RECV_EIGHTH};
      const int flags = epx_cuda_launch_flags();
      for (int si = 0; si < 4; si++)
        for (int hi = 0; hi < 2; hi++) {
          epx_cuda_set_launch_flags(flags | shares[hi]);
          g_sms = budgets[si];
          run(T, 0, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
        }
      epx_cuda_set_launch_flags(flags);
      g_sms = 0;
    }
  }
  if (section("step")) run_step_sweep(4096);
  if (g_counts) fclose(g_counts);
  if (g_permute) fclose(g_permute);
  ncclCommDestroy(nc);
  FATAL_UNLESS_OK(epx_comm_destroy(g_comm));
  if (g_rank == 0) printf("bench_ep: %s\n", g_bad ? "FAILED" : "OK");
  MPI_Finalize();
  return g_bad ? 1 : 0;
}
