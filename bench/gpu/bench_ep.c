/* The expert-parallel exchange on W GPUs (one process per GPU, under
 * mpirun), side by side with NCCL's all-to-all of the same rows in the same
 * run. Shapes of the issue: T = 8192 and 4096 tokens per rank, H = 7168,
 * 256 experts, top-8, bf16, uniform and skewed routing; every layout and
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
 * Every dedup buffer runs the default EPX_PATH_AUTO (the fused NVLink
 * kernels where every peer is reachable by load/store); the rows named
 * "path=host" force EPX_PATH_HOST, and the fused rank-major rows are swept
 * over config.sm_budget (8/16/24/32 CTAs) beside them: the fused vs host
 * comparison in one run. The path each buffer took is printed (path=...).
 *
 * Usage: mpirun -np 2 bench_ep <workdir>   (RESULT / TARGET / CHECK lines;
 * writes <workdir>/ep_counts.txt for bench_torch_ep.py) */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "epx.h"

enum { H = 7168, E = 256, K = 8, REPS = 20, WARM = 3 };

static int g_rank, g_size, g_bad;
static cudaStream_t g_stream;
static epx_comm_t g_comm;
static FILE *g_counts;
static epx_exchange_path_t g_path = EPX_PATH_AUTO; /* config.exchange_path of run()'s buffers */
static int32_t g_sms;                              /* config.sm_budget (0: the default) */

#define OK(call)                                                                                       \
  do {                                                                                                 \
    epx_status_t s_ = (call);                                                                          \
    if (s_ != EPX_SUCCESS) {                                                                           \
      fprintf(stderr, "rank %d: %s:%d: %s -> %s: %s\n", g_rank, __FILE__, __LINE__, #call,             \
              epx_status_string(s_), epx_last_error());                                                \
      MPI_Abort(MPI_COMM_WORLD, 2);                                                                    \
    }                                                                                                  \
  } while (0)
#define CU(call)                                                                                       \
  do {                                                                                                 \
    cudaError_t e_ = (call);                                                                           \
    if (e_ != cudaSuccess) {                                                                           \
      fprintf(stderr, "rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      MPI_Abort(MPI_COMM_WORLD, 3);                                                                    \
    }                                                                                                  \
  } while (0)

static uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* bf16 of small multiples of 1/4 (exact), coded by (rank, token, column). */
static uint16_t x_bits(int s, int t, int h) {
  const float v = (float)((int)((unsigned)(s * 101 + t * 13 + h * 7 + 3) % 29u) - 14) / 4.0f;
  uint32_t b;
  memcpy(&b, &v, 4);
  return (uint16_t)(b >> 16);
}

/* Top-8 of 256 distinct per token; skew: 60% of picks among the first 32
 * experts (rank 0's hottest), the rest uniform. */
static void make_routing(int T, int skew, int seed, int32_t *idx, float *w) {
  uint64_t z = mix((uint64_t)seed * 7919u + (uint64_t)g_rank);
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      int e, dup;
      do {
        z = mix(z);
        e = skew && (z >> 50) % 10 < 6 ? (int)((z >> 8) % 32) : (int)((z >> 8) % E);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= idx[t * K + j] == e;
      } while (dup);
      idx[t * K + k] = e;
      w[t * K + k] = 1.0f / K;
    }
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
  for (int i = 0; i <= REPS; i++) CU(cudaEventCreate(&ev[i]));
  for (int i = 0; i < WARM; i++) fn(arg);
  CU(cudaStreamSynchronize(g_stream));
  MPI_Barrier(MPI_COMM_WORLD);
  CU(cudaEventRecord(ev[0], g_stream));
  for (int i = 0; i < REPS; i++) {
    fn(arg);
    CU(cudaEventRecord(ev[i + 1], g_stream));
  }
  CU(cudaStreamSynchronize(g_stream));
  float t[REPS];
  for (int i = 0; i < REPS; i++) CU(cudaEventElapsedTime(&t[i], ev[i], ev[i + 1]));
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
  int64_t cap;
  /* baseline */
  ncclComm_t nc;
  void *a2a_send, *a2a_recv;
  int64_t *send_rows, *recv_rows;
} bench_t;

static void op_dispatch(void *p) {
  bench_t *b = p;
  OK(epx_dispatch(b->buf, b->h, b->x, b->recv, b->cap));
}
static void op_combine(void *p) {
  bench_t *b = p;
  OK(epx_combine(b->buf, b->h, b->recv, b->out));
}
static void op_layout(void *p) {
  bench_t *b = p;
  epx_handle_t h;
  OK(epx_dispatch_layout(b->buf, &b->routing, NULL, &h));
  OK(epx_handle_release(h));
}
static void op_full(void *p) {
  bench_t *b = p;
  epx_handle_t h;
  OK(epx_dispatch_layout(b->buf, &b->routing, NULL, &h));
  OK(epx_dispatch(b->buf, h, b->x, b->recv, b->cap));
  OK(epx_handle_release(h));
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
  OK(epx_handle_recv_rows(b->h, &N));
  const size_t rb = 2 * H;
  int32_t *src = NULL, *tok = NULL;
  CU(cudaMalloc((void **)&src, 4 * (size_t)b->cap + 4));
  CU(cudaMalloc((void **)&tok, 4 * (size_t)b->cap + 4));
  OK(epx_handle_recv_source(b->h, src, tok));
  CU(cudaStreamSynchronize(g_stream));
  uint16_t *rows = malloc((size_t)N * rb + 2);
  int32_t *hs = malloc(4 * (size_t)N + 4), *ht = malloc(4 * (size_t)N + 4);
  CU(cudaMemcpy(rows, b->recv, (size_t)N * rb, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(hs, src, 4 * (size_t)N, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(ht, tok, 4 * (size_t)N, cudaMemcpyDeviceToHost));
  int64_t wrong = 0;
  for (int64_t i = 0; i < N; i++) {
    if (hs[i] < 0) continue;
    for (int h = 0; h < H; h += 61) wrong += rows[i * H + h] != x_bits(hs[i], ht[i], h);
  }
  /* combine: out[t] = (number of ranks the token reached) * x[t] */
  OK(epx_combine(b->buf, b->h, b->recv, b->out));
  CU(cudaStreamSynchronize(g_stream)); /* the copy below runs on the legacy stream, which does not wait for it */
  uint16_t *out = malloc((size_t)T * rb + 2);
  CU(cudaMemcpy(out, b->out, (size_t)T * rb, cudaMemcpyDeviceToHost));
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

static void run(int T, int skew, epx_layout_t layout, epx_exchange_t exchange, epx_combine_precision_t precision,
                ncclComm_t nc) {
  char name[200];
  bench_t b = {0};
  b.nc = nc;
  int32_t *idx = malloc(4 * (size_t)T * K);
  float *w = malloc(4 * (size_t)T * K);
  make_routing(T, skew, T + skew, idx, w);
  int32_t *d_idx;
  CU(cudaMalloc((void **)&d_idx, 4 * (size_t)T * K));
  CU(cudaMemcpy(d_idx, idx, 4 * (size_t)T * K, cudaMemcpyHostToDevice));
  b.routing = (epx_routing_t){T, K, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
  cfg.device = EPX_DEVICE_CUDA;
  cfg.dtype = EPX_BFLOAT16;
  cfg.hidden = H;
  cfg.num_experts = E;
  cfg.max_top_k = K;
  cfg.max_tokens_per_rank = T;
  cfg.exchange = exchange;
  cfg.layout = layout;
  cfg.stream = g_stream;
  cfg.combine_precision = precision;
  cfg.exchange_path = g_path;
  cfg.sm_budget = g_sms;
  OK(epx_buffer_create(g_comm, &cfg, &b.buf));
  int32_t paths[64] = {0};
  OK(epx_buffer_peer_paths(b.buf, paths));
  char sms[32] = "";
  if (paths[0] == EPX_PATH_FUSED) snprintf(sms, sizeof sms, " sms=%d", g_sms ? g_sms : 24);
  snprintf(name, sizeof name, "T=%d routing=%s layout=%s exchange=%s partials=%s path=%s%s", T,
           skew ? "skewed" : "uniform", layout == EPX_LAYOUT_RANK_MAJOR ? "rank-major" : "expert-major",
           exchange == EPX_EXCHANGE_DEDUP ? "dedup" : "collective",
           precision == EPX_COMBINE_PARTIALS_PAYLOAD ? "payload" : "float32",
           paths[0] == EPX_PATH_FUSED ? "fused" : "host", sms);
  OK(epx_buffer_max_recv_rows(b.buf, &b.cap));
  const size_t rb = 2 * H;
  uint16_t *xh = malloc((size_t)T * rb);
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++) xh[(size_t)t * H + h] = x_bits(g_rank, t, h);
  CU(cudaMalloc(&b.x, (size_t)T * rb));
  CU(cudaMemcpy(b.x, xh, (size_t)T * rb, cudaMemcpyHostToDevice));
  CU(cudaMalloc(&b.recv, (size_t)b.cap * rb));
  CU(cudaMalloc(&b.out, (size_t)T * rb));
  OK(epx_dispatch_layout(b.buf, &b.routing, NULL, &b.h));
  OK(epx_dispatch(b.buf, b.h, b.x, b.recv, b.cap));
  check(&b, name, layout, T, idx);

  /* the same rows through NCCL alone */
  epx_handle_stats_t st;
  OK(epx_handle_stats(b.h, &st));
  b.send_rows = calloc((size_t)g_size, 8);
  b.recv_rows = calloc((size_t)g_size, 8);
  for (int q = 0; q < g_size; q++) b.send_rows[q] = q == g_rank ? st.local_rows : st.send_rows / (g_size - 1);
  MPI_Alltoall(b.send_rows, 1, MPI_INT64_T, b.recv_rows, 1, MPI_INT64_T, MPI_COMM_WORLD);
  int64_t send_total = 0, recv_total = 0;
  for (int q = 0; q < g_size; q++) send_total += b.send_rows[q], recv_total += b.recv_rows[q];
  CU(cudaMalloc(&b.a2a_send, (size_t)send_total * rb + 16));
  CU(cudaMalloc(&b.a2a_recv, (size_t)recv_total * rb + 16));
  if (g_counts && g_rank == 0) {
    fprintf(g_counts, "%s", name);
    for (int q = 0; q < g_size; q++) fprintf(g_counts, " %lld", (long long)b.send_rows[q]);
    fprintf(g_counts, "\n");
  }

  const timing_t dispatch = time_op(op_dispatch, &b), combine = time_op(op_combine, &b),
                 full = time_op(op_full, &b), layout_t = time_op(op_layout, &b), a2a = time_op(op_a2a, &b);
  const double bytes = (double)recv_total * (double)rb;
  if (g_rank == 0) {
    printf("RESULT %s dispatch_ms=%.4f (slowest %.4f) combine_ms=%.4f full_dispatch_ms=%.4f layout_us=%.1f "
           "nccl_a2a_ms=%.4f rows_in=%lld remote_rows_out=%lld bytes_in=%.0f dispatch_GBps=%.0f combine_GBps=%.0f "
           "dispatch/a2a=%.3f\n",
           name, dispatch.ms, dispatch.worst_ms, combine.ms, full.ms, layout_t.ms * 1e3, a2a.ms, (long long)recv_total,
           (long long)st.send_rows, bytes, bytes / dispatch.ms / 1e6, bytes / combine.ms / 1e6, dispatch.ms / a2a.ms);
    if (layout == EPX_LAYOUT_RANK_MAJOR && exchange == EPX_EXCHANGE_DEDUP && !skew &&
        precision == EPX_COMBINE_PARTIALS_PAYLOAD && g_path == EPX_PATH_AUTO && g_sms == 0) {
      if (T == 8192) {
        printf("TARGET dedup rank-major dispatch / a2a (8192)            %.3f <= 1.15\n", dispatch.ms / a2a.ms);
        printf("TARGET dedup rank-major combine / a2a (8192)             %.3f <= 1.15\n", combine.ms / a2a.ms);
        printf("TARGET dedup rank-major dispatch vs DeepEP 0.658 ms      %.4f ms <= 0.658\n", dispatch.ms);
      }
      if (T == 4096)
        printf("TARGET cached dispatch / full dispatch (4096)            %.3f <= 0.85\n", dispatch.ms / full.ms);
    }
  }
  OK(epx_handle_release(b.h));
  OK(epx_buffer_destroy(b.buf));
  cudaFree(b.x), cudaFree(b.recv), cudaFree(b.out), cudaFree(b.a2a_send), cudaFree(b.a2a_recv), cudaFree(d_idx);
  free(idx), free(w), free(xh), free(b.send_rows), free(b.recv_rows);
}

/* The layout with worst_case_sizing: no host wait, events around it. */
static void run_worst_layout(int T) {
  epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
  cfg.device = EPX_DEVICE_CUDA;
  cfg.dtype = EPX_BFLOAT16;
  cfg.hidden = H;
  cfg.num_experts = E;
  cfg.max_top_k = K;
  cfg.max_tokens_per_rank = T;
  cfg.layout = EPX_LAYOUT_RANK_MAJOR;
  cfg.worst_case_sizing = 1;
  cfg.stream = g_stream;
  bench_t b = {0};
  OK(epx_buffer_create(g_comm, &cfg, &b.buf));
  int32_t *idx = malloc(4 * (size_t)T * K);
  float *w = malloc(4 * (size_t)T * K);
  make_routing(T, 0, T, idx, w);
  int32_t *d_idx;
  CU(cudaMalloc((void **)&d_idx, 4 * (size_t)T * K));
  CU(cudaMemcpy(d_idx, idx, 4 * (size_t)T * K, cudaMemcpyHostToDevice));
  b.routing = (epx_routing_t){T, K, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  const timing_t t = time_op(op_layout, &b);
  /* The host's side: wall time per call of the same loop, enqueueing only
   * (the device time above is this where the host is the bottleneck). */
  CU(cudaStreamSynchronize(g_stream));
  MPI_Barrier(MPI_COMM_WORLD);
  struct timespec a0, a1;
  clock_gettime(CLOCK_MONOTONIC, &a0);
  for (int i = 0; i < REPS; i++) op_layout(&b);
  clock_gettime(CLOCK_MONOTONIC, &a1);
  const double host_us = ((double)(a1.tv_sec - a0.tv_sec) * 1e6 + (double)(a1.tv_nsec - a0.tv_nsec) * 1e-3) / REPS;
  CU(cudaStreamSynchronize(g_stream));
  if (g_rank == 0) {
    printf("RESULT T=%d layout+count exchange (worst_case_sizing, no host wait) us=%.1f (slowest %.1f) "
           "host_us_per_call=%.1f\n", T, t.ms * 1e3, t.worst_ms * 1e3, host_us);
    if (T == 8192) printf("TARGET layout + count exchange (8192, worst case)      %.1f us <= 40\n", t.ms * 1e3);
  }
  OK(epx_buffer_destroy(b.buf));
  cudaFree(d_idx), free(idx), free(w);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int devices = 0;
  CU(cudaGetDeviceCount(&devices));
  CU(cudaSetDevice(g_rank % devices));
  CU(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  MPI_Comm world = MPI_COMM_WORLD;
  OK(epx_comm_create_nccl_mpi(&world, NULL, &g_comm));
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
  }
  if (g_rank == 0) {
    int version = 0;
    ncclGetVersion(&version);
    printf("DEVICE %d ranks, NCCL %d, H=%d E=%d top-%d bf16\n", g_size, version, H, E, K);
  }
  const int tokens[] = {8192, 4096};
  for (int ti = 0; ti < 2; ti++) {
    const int T = tokens[ti];
    run_worst_layout(T);
    for (int skew = 0; skew < 2; skew++) {
      run(T, skew, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      run(T, skew, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
      run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_FLOAT32, nc);
      run(T, skew, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
    }
    /* Fused vs host, rank-major, payload partials (the shape): the
     * host path, then the fused path at each SM budget. */
    g_path = EPX_PATH_HOST;
    run(T, 0, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
    g_path = EPX_PATH_AUTO;
    const int32_t budgets[] = {8, 16, 24, 32};
    for (int si = 0; si < 4; si++) {
      g_sms = budgets[si];
      run(T, 0, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_COMBINE_PARTIALS_PAYLOAD, nc);
    }
    g_sms = 0;
  }
  if (g_counts) fclose(g_counts);
  ncclCommDestroy(nc);
  OK(epx_comm_destroy(g_comm));
  if (g_rank == 0) printf("bench_ep: %s\n", g_bad ? "FAILED" : "OK");
  MPI_Finalize();
  return g_bad ? 1 : 0;
}
