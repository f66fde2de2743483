/* The low-latency decode mode of CUDA buffers on W ranks over NCCL
 * (src/cuda/ll/ranks.c), one process per GPU under mpirun (any W; run on
 * one GPU through the test hook epx_cuda_ep_at_one_rank, and on 2 GPUs, by
 * bench/gpu-check.sh), on both its paths: EPX_PATH_HOST (a slab per peer
 * over NCCL's host API) and EPX_PATH_FUSED (the fused window's load/store
 * kernels, window.c; required with EPX_GPU_EXPECT_FUSED=1, else the slabs
 * may serve it). Exit status is the verdict.
 *
 * The reference is the normal exchange (epx_dispatch_layout, epx_dispatch,
 * epx_combine) on a normal CUDA buffer of the same config over the same
 * comm, on the same routing: for every local expert the low-latency count
 * equals the normal layout's, and the first count rows of its block equal
 * the normal expert group's rows bit for bit, as do each row's source
 * (rank, token), expert and weight, and the combine (expert outputs coded by
 * the row's expert and source, so both sides compute the same rows). Rows
 * past the counts must say so (-1 sources). Token counts 0, 1, 7, 128 and
 * 256 per rank, different on each rank in each step; top-k 1 to 8, E 4 to
 * 256 per rank, bf16 and f32, float32 and payload partials, weights in
 * combine or none, every token to one expert; a device count below the
 * routing's rows (out's rows past it zero); dispatch_send / complete /
 * combine_send / complete captured once in a CUDA graph (expert = identity:
 * expert_out is recv_x) and replayed with new counts written to device
 * memory, each replay equal to the normal exchange on that count; a step of
 * more rows than max_tokens_per_rank refused on every rank, naming it; and
 * fp8 (MXFP8, quantized on the way or pre-quantized) against the normal fp8
 * dispatch, every row's bytes and scales; the rank-major layout against the
 * normal rank-major exchange. EPX_LL_BENCH=1 also prints a decode step's
 * latency on each path (bench_path). */
#if !defined(EPX_THREAD_RANKS) && !defined(EPX_PROC_RANKS)
#include <mpi.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/common/test_hooks.h"
#include "epx.h"
#define CHECK_FAILURES g_fail
#include "mpi_gpu_check.h"

static EPX_RANK_LOCAL int g_rank, g_fail;
static int g_size;
/* exchange_path of the low-latency buffers: EPX_PATH_HOST (NCCL slabs) or
 * EPX_PATH_FUSED (the fused window's load/store kernels, where the build
 * has them); EPX_GPU_EXPECT_FUSED=1: the fused one is required */
static EPX_RANK_LOCAL epx_exchange_path_t g_path = EPX_PATH_HOST;
static int g_expect_fused;

int tu_message_has(const char *needle) { return !needle || strstr(epx_last_error(), needle) != NULL; }

enum { TM = 256, H = 64, STEPS = 5 };
static const int64_t kCounts[STEPS] = {0, 1, 7, 128, 256};

typedef struct {
  int El, K;
  epx_dtype_t dtype;
  epx_weighting_t weighting;
  epx_combine_precision_t precision;
  int one_expert; /* every route of every token to expert 0 (its first slot; the rest -1) */
  int seed;
} case_t;

/* Multiples of 1/8 in [-3.75, 3.75]: exact in every dtype. */
static float code(int a, int b, int c, int h) {
  return (float)((int)(((unsigned)(a * 37 + b * 101 + c * 13 + h * 7 + 5)) % 61u) - 30) / 8.0f;
}

static size_t dsize(const case_t *c) { return c->dtype == EPX_FLOAT32 ? 4 : 2; }
static size_t rows_bytes(const case_t *c, int64_t rows) { return (size_t)(rows * H) * dsize(c); }

/* The memset and the pageable upload below run on the legacy default
 * stream, which the test's non-blocking stream does not wait for: cudaMemset
 * returns before it ran, and cudaMemcpy from pageable memory may return
 * before its last DMA landed. A low-latency call enqueues its kernels at
 * once (no host agreement first), so without the device wait its combine
 * read a megabyte expert_out still partly zero. */
static void upload(void *dev, const void *host, size_t bytes) {
  if (bytes) FATAL_UNLESS_CUDA_OK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
  FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
}

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  FATAL_UNLESS_CUDA_OK(cudaMalloc(&p, bytes ? bytes : 16));
  FATAL_UNLESS_CUDA_OK(cudaMemset(p, 0, bytes ? bytes : 16));
  FATAL_UNLESS_CUDA_OK(cudaDeviceSynchronize());
  return p;
}

static void *dev_put(const void *host, size_t bytes) {
  void *p = dev_alloc(bytes);
  upload(p, host, bytes);
  return p;
}

static void *host_get(const void *dev, size_t bytes) {
  void *p = calloc(bytes ? bytes : 1, 1);
  if (bytes) FATAL_UNLESS_CUDA_OK(cudaMemcpy(p, dev, bytes, cudaMemcpyDeviceToHost));
  return p;
}

/* TM rows of routing of `rank` in step `step` (valid: no repeated expert, -1
 * holes), and its tokens x [TM, H] on the device. */
typedef struct {
  int32_t idx[TM * 8];
  float w[TM * 8];
  void *x;
} routing_t;

static void make_routing(const case_t *c, int rank, int step, routing_t *r) {
  const int E = c->El * g_size;
  uint64_t z = mix((uint64_t)c->seed * 7919u + (uint64_t)rank * 131u + (uint64_t)step);
  for (int t = 0; t < TM; t++)
    for (int k = 0; k < c->K; k++) {
      int e;
      for (;;) {
        z = mix(z);
        e = (int)((z >> 8) % (uint64_t)E);
        int dup = 0;
        for (int j = 0; j < k; j++) dup |= r->idx[t * c->K + j] == e;
        if (!dup) break;
      }
      z = mix(z);
      const int drop = c->one_expert ? k > 0 : (z >> 50) % 8 == 0;
      r->idx[t * c->K + k] = drop ? -1 : c->one_expert ? 0 : e;
      r->w[t * c->K + k] = drop ? 0.0f : (float)((z >> 20) % 1000 + 1) / 1000.0f;
    }
  float *v = malloc(sizeof(float) * TM * H);
  for (int t = 0; t < TM; t++)
    for (int h = 0; h < H; h++) v[t * H + h] = code(rank + 50, t, step, h);
  void *enc = calloc(TM * H, dsize(c));
  FATAL_UNLESS_OK(epx_convert(c->dtype, enc, EPX_FLOAT32, v, TM * H));
  r->x = dev_put(enc, rows_bytes(c, TM));
  free(enc);
  free(v);
}

/* One step's results on the host, in the low-latency shape [El, W * TM]
 * (the normal exchange's expert groups placed there for the comparison). */
typedef struct {
  int64_t N; /* El * W * TM */
  int64_t counts[256];
  char *rows;
  int32_t *src_rank, *src_token, *expert;
  float *weight;
  char *out; /* [TM, H] */
} result_t;

static void result_open(const case_t *c, result_t *res) {
  res->N = (int64_t)c->El * g_size * TM;
  const size_t n = (size_t)res->N;
  res->rows = calloc(n, rows_bytes(c, 1));
  res->src_rank = malloc(n * 4), res->src_token = malloc(n * 4), res->expert = malloc(n * 4);
  res->weight = malloc(n * 4);
  for (size_t i = 0; i < n; i++) res->src_rank[i] = res->src_token[i] = res->expert[i] = -1, res->weight[i] = 0;
  res->out = calloc(TM, rows_bytes(c, 1));
}

static void result_close(result_t *res) {
  void *p[] = {res->rows, res->src_rank, res->src_token, res->expert, res->weight, res->out};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

/* The expert: each row's output coded by its expert and source (rows of no
 * source zero), on the host, as [n, H] of the dtype on the device. */
static void *expert_out_of(const case_t *c, const int32_t *expert, const int32_t *src_rank, const int32_t *src_token,
                           int64_t n) {
  float *v = calloc((size_t)(n * H) + 1, sizeof(float));
  for (int64_t i = 0; i < n; i++)
    if (src_token[i] >= 0)
      for (int h = 0; h < H; h++) v[i * H + h] = code(expert[i] + 7, src_rank[i], src_token[i], h);
  void *enc = calloc((size_t)(n * H) + 1, dsize(c));
  FATAL_UNLESS_OK(epx_convert(c->dtype, enc, EPX_FLOAT32, v, n * H));
  void *d = dev_put(enc, rows_bytes(c, n));
  free(enc);
  free(v);
  return d;
}

static epx_buffer_config_t config_of(const case_t *c, int low_latency) {
  epx_buffer_config_t b = EPX_BUFFER_CONFIG_INIT;
  b.device = EPX_DEVICE_CUDA, b.dtype = c->dtype, b.hidden = H, b.num_experts = c->El * g_size;
  b.max_top_k = c->K, b.max_tokens_per_rank = TM, b.combine_precision = c->precision;
  b.low_latency = low_latency;
  if (low_latency) b.exchange_path = g_path;
  return b;
}

/* The normal buffer (nc) and the low-latency one (lc) of a case, on the stream. */
static void create_pair(epx_comm_t comm, cudaStream_t stream, epx_buffer_config_t nc, epx_buffer_config_t lc,
                        epx_buffer_t *nb, epx_buffer_t *lb) {
  nc.stream = lc.stream = stream;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &nc, nb));
  FATAL_UNLESS_OK(epx_buffer_create(comm, &lc, lb));
}

static epx_routing_t routing_of(const case_t *c, int64_t T, int32_t *const *dev) {
  return (epx_routing_t){T, c->K, dev[0], c->weighting == EPX_WEIGHTS_NONE ? NULL : (const float *)dev[1], NULL,
                         c->weighting};
}

/* The normal exchange of T tokens; expert_out coded (identity: NULL code,
 * expert_out = recv_x). */
static void normal_step(const case_t *c, epx_buffer_t b, const routing_t *r, int32_t *const *dev, int64_t T,
                        int identity, cudaStream_t stream, result_t *res) {
  epx_handle_t h = NULL;
  epx_routing_t rt = routing_of(c, T, dev);
  FATAL_UNLESS_OK(epx_dispatch_layout(b, &rt, NULL, &h));
  int64_t N = 0;
  FATAL_UNLESS_OK(epx_handle_recv_rows(h, &N));
  void *recv = dev_alloc(rows_bytes(c, N)), *out = dev_alloc(rows_bytes(c, TM));
  int32_t *sr = dev_alloc(4 * (size_t)N + 4), *st = dev_alloc(4 * (size_t)N + 4), *ex = dev_alloc(4 * (size_t)N + 4);
  float *wt = dev_alloc(4 * (size_t)N + 4);
  int64_t *counts = dev_alloc(8 * (size_t)c->El), *offsets = dev_alloc(8 * (size_t)(c->El + 1));
  FATAL_UNLESS_OK(epx_dispatch(b, h, r->x, recv, N));
  FATAL_UNLESS_OK(epx_handle_recv_source(h, sr, st));
  FATAL_UNLESS_OK(epx_handle_recv_routing(h, ex, wt));
  FATAL_UNLESS_OK(epx_handle_expert_counts(h, counts, offsets));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  int32_t *hsr = host_get(sr, 4 * (size_t)N), *hst = host_get(st, 4 * (size_t)N), *hex = host_get(ex, 4 * (size_t)N);
  float *hwt = host_get(wt, 4 * (size_t)N);
  int64_t *hc = host_get(counts, 8 * (size_t)c->El), *ho = host_get(offsets, 8 * (size_t)(c->El + 1));
  char *hrecv = host_get(recv, rows_bytes(c, N));
  void *eo = identity ? recv : expert_out_of(c, hex, hsr, hst, N);
  FATAL_UNLESS_OK(epx_combine(b, h, eo, out));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  char *hout = host_get(out, rows_bytes(c, T));
  memcpy(res->out, hout, rows_bytes(c, T));
  const int64_t block = (int64_t)g_size * TM;
  for (int e = 0; e < c->El; e++) {
    res->counts[e] = hc[e];
    for (int64_t i = 0; i < hc[e]; i++) {
      const int64_t from = ho[e] + i, to = e * block + i;
      memcpy(res->rows + rows_bytes(c, to), hrecv + rows_bytes(c, from), rows_bytes(c, 1));
      res->src_rank[to] = hsr[from], res->src_token[to] = hst[from], res->expert[to] = hex[from];
      res->weight[to] = hwt[from];
    }
  }
  void *hp[] = {hsr, hst, hex, hwt, hc, ho, hrecv, hout};
  for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++) free(hp[i]);
  void *dp[] = {recv, out, sr, st, ex, wt, counts, offsets};
  for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(dp[i]));
  if (!identity) FATAL_UNLESS_CUDA_OK(cudaFree(eo));
  FATAL_UNLESS_OK(epx_handle_release(h));
}

/* The low-latency step's tensors on the device. */
typedef struct {
  void *recv, *out;
  int32_t *count, *tokens, *sr, *st, *ex;
  float *wt;
} ll_dev_t;

static void ll_open(const case_t *c, ll_dev_t *d) {
  const int64_t N = (int64_t)c->El * g_size * TM;
  d->recv = dev_alloc(rows_bytes(c, N)), d->out = dev_alloc(rows_bytes(c, TM));
  d->count = dev_alloc(4 * (size_t)c->El), d->tokens = dev_alloc(4);
  d->sr = dev_alloc(4 * (size_t)N), d->st = dev_alloc(4 * (size_t)N), d->ex = dev_alloc(4 * (size_t)N);
  d->wt = dev_alloc(4 * (size_t)N);
}

static void ll_close(ll_dev_t *d) {
  void *p[] = {d->recv, d->out, d->count, d->tokens, d->sr, d->st, d->ex, d->wt};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(p[i]));
}

/* The dispatch's results (after the stream is synchronised) to res. */
static void ll_read(const case_t *c, epx_handle_t h, const ll_dev_t *d, cudaStream_t stream, result_t *res) {
  const size_t N = (size_t)res->N;
  FATAL_UNLESS_OK(epx_handle_recv_source(h, d->sr, d->st));
  FATAL_UNLESS_OK(epx_handle_recv_routing(h, d->ex, d->wt));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  int32_t *count = host_get(d->count, 4 * (size_t)c->El);
  for (int e = 0; e < c->El; e++) res->counts[e] = count[e];
  free(count);
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(res->rows, d->recv, rows_bytes(c, res->N), cudaMemcpyDeviceToHost));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(res->src_rank, d->sr, 4 * N, cudaMemcpyDeviceToHost));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(res->src_token, d->st, 4 * N, cudaMemcpyDeviceToHost));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(res->expert, d->ex, 4 * N, cudaMemcpyDeviceToHost));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(res->weight, d->wt, 4 * N, cudaMemcpyDeviceToHost));
}

/* Low-latency (got) against normal (want) for T tokens of `rows` rows. */
static void compare(const case_t *c, const result_t *want, const result_t *got, int64_t T, int64_t rows,
                    const char *what) {
  const int64_t block = (int64_t)g_size * TM;
  int bad = 0;
  for (int e = 0; e < c->El && bad < 4; e++) {
    if (got->counts[e] != want->counts[e]) {
      RANK_EXPECT(0, "%s (case %d, T %lld): expert %d has %lld rows, the normal exchange %lld", what, c->seed,
                  (long long)T, e, (long long)got->counts[e], (long long)want->counts[e]);
      bad++;
      continue;
    }
    for (int64_t i = 0; i < block; i++) {
      const int64_t r = e * block + i;
      const int in = i < want->counts[e];
      const int same = got->src_rank[r] == want->src_rank[r] && got->src_token[r] == want->src_token[r] &&
                       got->expert[r] == want->expert[r] && (!in || got->weight[r] == want->weight[r]) &&
                       (!in || !memcmp(got->rows + rows_bytes(c, r), want->rows + rows_bytes(c, r), rows_bytes(c, 1)));
      if (!same && bad++ < 4)
        RANK_EXPECT(0, "%s (case %d, T %lld): row %lld of expert %d (source %d/%d, expert %d) differs from the normal "
                    "exchange's (source %d/%d, expert %d)", what, c->seed, (long long)T, (long long)i, e,
                    got->src_rank[r], got->src_token[r], got->expert[r], want->src_rank[r], want->src_token[r],
                    want->expert[r]);
    }
  }
  RANK_EXPECT(!memcmp(got->out, want->out, rows_bytes(c, T)), "%s (case %d, T %lld): combine differs from the normal "
              "exchange's", what, c->seed, (long long)T);
  char *zero = calloc(TM, rows_bytes(c, 1));
  RANK_EXPECT(!memcmp(got->out + rows_bytes(c, T), zero, rows_bytes(c, rows - T)),
              "%s (case %d, T %lld): out's rows past the count are not zero", what, c->seed, (long long)T);
  free(zero);
}

/* The path the buffer took: the slabs (every peer EPX_PATH_HOST) when
 * asked, the window's (this rank's own rows EPX_PATH_FUSED) when asked and
 * required. */
static void check_path(epx_buffer_t b) {
  int32_t paths[64];
  FATAL_UNLESS_OK(epx_buffer_peer_paths(b, paths));
  if (g_path == EPX_PATH_HOST)
    RANK_EXPECT(paths[g_rank] == EPX_PATH_HOST, "an EPX_PATH_HOST low-latency buffer reports path %d", paths[g_rank]);
  else if (g_expect_fused)
    RANK_EXPECT(paths[g_rank] == EPX_PATH_FUSED, "an EPX_PATH_FUSED low-latency buffer took the NCCL slabs: %s",
                epx_last_error());
}

/* Steps of every count (rank r takes kCounts[(step + r) % 5]); device:
 * the count as device memory below the routing's TM rows. */
static void run_case(const case_t *c, epx_comm_t comm, cudaStream_t stream, int device) {
  epx_buffer_t nb = NULL, lb = NULL;
  create_pair(comm, stream, config_of(c, 0), config_of(c, 1), &nb, &lb);
  check_path(lb);
  ll_dev_t d;
  ll_open(c, &d);
  for (int step = 0; step < STEPS; step++) {
    const int64_t T = kCounts[(step + g_rank) % STEPS];
    routing_t r;
    make_routing(c, g_rank, step, &r);
    int32_t *dev[2] = {dev_put(r.idx, sizeof r.idx), dev_put(r.w, sizeof r.w)};
    result_t want, got;
    result_open(c, &want), result_open(c, &got);
    normal_step(c, nb, &r, dev, T, 0, stream, &want);
    const int32_t t32 = (int32_t)T;
    upload(d.tokens, &t32, 4);
    const int64_t rows = device ? TM : T;
    epx_routing_t rt = routing_of(c, rows, dev);
    epx_handle_t h = NULL;
    RANK_OK(epx_ll_dispatch(lb, &rt, device ? d.tokens : NULL, r.x, d.recv, d.count, &h));
    if (h) {
      ll_read(c, h, &d, stream, &got);
      void *eo = expert_out_of(c, got.expert, got.src_rank, got.src_token, got.N);
      RANK_OK(epx_ll_combine(lb, h, eo, d.out));
      FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
      FATAL_UNLESS_CUDA_OK(cudaMemcpy(got.out, d.out, rows_bytes(c, rows), cudaMemcpyDeviceToHost));
      compare(c, &want, &got, T, rows, device ? "epx_ll_dispatch (device count)" : "epx_ll_dispatch");
      FATAL_UNLESS_CUDA_OK(cudaFree(eo));
      RANK_OK(epx_handle_release(h));
    }
    result_close(&want), result_close(&got);
    FATAL_UNLESS_CUDA_OK(cudaFree(dev[0]));
    FATAL_UNLESS_CUDA_OK(cudaFree(dev[1]));
    FATAL_UNLESS_CUDA_OK(cudaFree(r.x));
  }
  ll_close(&d);
  FATAL_UNLESS_OK(epx_buffer_destroy(lb));
  FATAL_UNLESS_OK(epx_buffer_destroy(nb));
}

/* Both phases captured once (the routing of TM rows, the count on the
 * device, expert_out = recv_x), replayed with every count. */
static void test_graph(const case_t *c, epx_comm_t comm, cudaStream_t stream) {
  epx_buffer_t nb = NULL, lb = NULL;
  create_pair(comm, stream, config_of(c, 0), config_of(c, 1), &nb, &lb);
  ll_dev_t d;
  ll_open(c, &d);
  routing_t r;
  make_routing(c, g_rank, 99, &r);
  int32_t *dev[2] = {dev_put(r.idx, sizeof r.idx), dev_put(r.w, sizeof r.w)};
  epx_routing_t rt = routing_of(c, TM, dev);
  epx_handle_t h = NULL;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FATAL_UNLESS_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  RANK_OK(epx_ll_dispatch_send(lb, &rt, d.tokens, r.x, d.recv, d.count, &h));
  if (h) RANK_OK(epx_ll_complete(lb, h));
  if (h) RANK_OK(epx_ll_combine_send(lb, h, d.recv, d.out));
  if (h) RANK_OK(epx_ll_complete(lb, h));
  FATAL_UNLESS_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  FATAL_UNLESS_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int step = 0; step < STEPS && h; step++) {
    const int64_t T = kCounts[(step * 2 + g_rank) % STEPS];
    const int32_t t32 = (int32_t)T;
    upload(d.tokens, &t32, 4);
    FATAL_UNLESS_CUDA_OK(cudaGraphLaunch(exec, stream));
    FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
    result_t want, got;
    result_open(c, &want), result_open(c, &got);
    normal_step(c, nb, &r, dev, T, 1, stream, &want);
    ll_read(c, h, &d, stream, &got);
    FATAL_UNLESS_CUDA_OK(cudaMemcpy(got.out, d.out, rows_bytes(c, TM), cudaMemcpyDeviceToHost));
    compare(c, &want, &got, T, TM, "graph replay");
    result_close(&want), result_close(&got);
  }
  FATAL_UNLESS_CUDA_OK(cudaGraphExecDestroy(exec));
  FATAL_UNLESS_CUDA_OK(cudaGraphDestroy(graph));
  if (h) RANK_OK(epx_handle_release(h));
  ll_close(&d);
  FATAL_UNLESS_CUDA_OK(cudaFree(dev[0]));
  FATAL_UNLESS_CUDA_OK(cudaFree(dev[1]));
  FATAL_UNLESS_CUDA_OK(cudaFree(r.x));
  FATAL_UNLESS_OK(epx_buffer_destroy(lb));
  FATAL_UNLESS_OK(epx_buffer_destroy(nb));
}

/* More rows than max_tokens_per_rank, on every rank: refused naming it,
 * nothing sent, and the buffer still works (a step after it). */
static void test_oversize(const case_t *c, epx_comm_t comm, cudaStream_t stream) {
  epx_buffer_t lb = NULL;
  epx_buffer_config_t lc = config_of(c, 1);
  lc.stream = stream;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &lc, &lb));
  ll_dev_t d;
  ll_open(c, &d);
  int32_t *idx = dev_alloc(4 * (TM + 1) * (size_t)c->K);
  float *w = dev_alloc(4 * (TM + 1) * (size_t)c->K);
  void *x = dev_alloc(rows_bytes(c, TM + 1));
  epx_routing_t rt = {TM + 1, c->K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  RANK_STATUS(epx_ll_dispatch(lb, &rt, NULL, x, d.recv, d.count, &h), EPX_ERROR_CAPACITY_EXCEEDED,
              "max_tokens_per_rank");
  rt.num_tokens = 1;
  RANK_OK(epx_ll_dispatch(lb, &rt, NULL, x, d.recv, d.count, &h));
  if (h) RANK_OK(epx_ll_combine(lb, h, d.recv, d.out));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  if (h) RANK_OK(epx_handle_release(h));
  ll_close(&d);
  void *p[] = {idx, w, x};
  for (size_t i = 0; i < 3; i++) FATAL_UNLESS_CUDA_OK(cudaFree(p[i]));
  FATAL_UNLESS_OK(epx_buffer_destroy(lb));
}

/* combine of handle h (N rows; low_latency: epx_ll_combine, else
 * epx_combine) with expert outputs coded by each row's expert and source,
 * to the host [T, H]. */
static void *coded_combine(const case_t *c, epx_buffer_t b, epx_handle_t h, int low_latency, int64_t N, int64_t T,
                           cudaStream_t stream) {
  int32_t *sr = dev_alloc(4 * (size_t)N), *st = dev_alloc(4 * (size_t)N), *ex = dev_alloc(4 * (size_t)N);
  void *out = dev_alloc(rows_bytes(c, TM));
  FATAL_UNLESS_OK(epx_handle_recv_source(h, sr, st));
  FATAL_UNLESS_OK(epx_handle_recv_routing(h, ex, NULL));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  int32_t *hsr = host_get(sr, 4 * (size_t)N), *hst = host_get(st, 4 * (size_t)N), *hex = host_get(ex, 4 * (size_t)N);
  void *eo = expert_out_of(c, hex, hsr, hst, N);
  RANK_OK(low_latency ? epx_ll_combine(b, h, eo, out) : epx_combine(b, h, eo, out));
  FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
  void *host = host_get(out, rows_bytes(c, T));
  void *p[] = {sr, st, ex, out, eo};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(p[i]));
  free(hsr), free(hst), free(hex);
  return host;
}

/* fp8 (MXFP8: H = 64 holds two blocks): epx_ll_dispatch_fp8 quantizing on
 * the way, or with pre-quantized rows and scales, against the normal
 * epx_dispatch_quantize / epx_dispatch_fp8 on the same routing: counts,
 * every row's bytes and scales. */
static void test_fp8(const case_t *c, epx_comm_t comm, cudaStream_t stream, int quantize) {
  const epx_fp8_format_t fmt = EPX_FP8_MXFP8;
  const size_t SB = H / 32; /* scale bytes per row */
  epx_buffer_config_t nc = config_of(c, 0), lc = config_of(c, 1);
  nc.fp8_format = lc.fp8_format = fmt;
  epx_buffer_t nb = NULL, lb = NULL;
  create_pair(comm, stream, nc, lc, &nb, &lb);
  const int64_t block = (int64_t)g_size * TM, N = c->El * block;
  uint8_t *lq = dev_alloc((size_t)(N * H)), *ls = dev_alloc((size_t)N * SB);
  int32_t *count = dev_alloc(4 * (size_t)c->El);
  for (int step = 0; step < STEPS; step++) {
    const int64_t T = kCounts[(step + 3 * g_rank) % STEPS];
    routing_t r;
    make_routing(c, g_rank, step + 20, &r);
    int32_t *dev[2] = {dev_put(r.idx, sizeof r.idx), dev_put(r.w, sizeof r.w)};
    void *xh = host_get(r.x, rows_bytes(c, TM));
    uint8_t *qh = malloc(TM * H), *sh = malloc(TM * SB);
    FATAL_UNLESS_OK(epx_quantize(fmt, c->dtype, TM, H, xh, qh, sh));
    void *xq = dev_put(qh, TM * H), *xs = dev_put(sh, TM * SB);
    epx_routing_t rt = routing_of(c, T, dev);
    epx_handle_t hn = NULL, hl = NULL;
    FATAL_UNLESS_OK(epx_dispatch_layout(nb, &rt, NULL, &hn));
    int64_t Nn = 0;
    FATAL_UNLESS_OK(epx_handle_recv_rows(hn, &Nn));
    uint8_t *nq = dev_alloc((size_t)(Nn * H)), *ns = dev_alloc((size_t)Nn * SB);
    int64_t *counts = dev_alloc(8 * (size_t)c->El), *offsets = dev_alloc(8 * (size_t)(c->El + 1));
    if (quantize) FATAL_UNLESS_OK(epx_dispatch_quantize(nb, hn, r.x, nq, ns, Nn));
    else FATAL_UNLESS_OK(epx_dispatch_fp8(nb, hn, xq, xs, nq, ns, Nn));
    FATAL_UNLESS_OK(epx_handle_expert_counts(hn, counts, offsets));
    RANK_OK(epx_ll_dispatch_fp8(lb, &rt, NULL, quantize ? r.x : xq, quantize ? NULL : xs, lq, ls, count, &hl));
    FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
    int64_t *hc = host_get(counts, 8 * (size_t)c->El), *ho = host_get(offsets, 8 * (size_t)(c->El + 1));
    int32_t *lc_h = host_get(count, 4 * (size_t)c->El);
    uint8_t *nqh = host_get(nq, (size_t)(Nn * H)), *nsh = host_get(ns, (size_t)Nn * SB);
    uint8_t *lqh = host_get(lq, (size_t)(N * H)), *lsh = host_get(ls, (size_t)N * SB);
    for (int e = 0; e < c->El && hl; e++) {
      RANK_EXPECT(lc_h[e] == hc[e], "fp8 (quantize %d, T %lld): expert %d has %d rows, the normal exchange %lld",
                  quantize, (long long)T, e, lc_h[e], (long long)hc[e]);
      for (int64_t i = 0; i < hc[e] && i < lc_h[e]; i++) {
        const int64_t from = ho[e] + i, to = e * block + i;
        RANK_EXPECT(!memcmp(lqh + to * H, nqh + from * H, H) && !memcmp(lsh + to * SB, nsh + from * SB, SB),
                    "fp8 (quantize %d, T %lld): row %lld of expert %d or its scales differ from the normal "
                    "exchange's", quantize, (long long)T, (long long)i, e);
      }
    }
    /* combine after an fp8 dispatch: rows of the dtype, the normal combine's bits */
    if (hl) {
      char *want = coded_combine(c, nb, hn, 0, Nn, T, stream), *got = coded_combine(c, lb, hl, 1, N, T, stream);
      RANK_EXPECT(!memcmp(want, got, rows_bytes(c, T)), "fp8 (quantize %d, T %lld): combine differs from the normal "
                  "exchange's", quantize, (long long)T);
      free(want), free(got);
    }
    void *hp[] = {xh, qh, sh, hc, ho, lc_h, nqh, nsh, lqh, lsh};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++) free(hp[i]);
    void *dp[] = {dev[0], dev[1], r.x, xq, xs, nq, ns, counts, offsets};
    for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(dp[i]));
    FATAL_UNLESS_OK(epx_handle_release(hn));
    if (hl) RANK_OK(epx_handle_release(hl));
  }
  void *dp[] = {lq, ls, count};
  for (size_t i = 0; i < 3; i++) FATAL_UNLESS_CUDA_OK(cudaFree(dp[i]));
  FATAL_UNLESS_OK(epx_buffer_destroy(lb));
  FATAL_UNLESS_OK(epx_buffer_destroy(nb));
}

/* Rank-major (the slabs; weights left to the expert): source s's rows are
 * the first recv_count[s] of block s, the normal rank-major rows from s in
 * order (bytes, source token, the K experts and weights of each), and the
 * combine of expert_out = recv_x the normal one's. */
static void test_rank_major(epx_comm_t comm, cudaStream_t stream) {
  const case_t cc = {8, 4, EPX_BFLOAT16, EPX_WEIGHTS_NONE, EPX_COMBINE_PARTIALS_FLOAT32, 0, 7}, *c = &cc;
  const int K = c->K;
  epx_buffer_config_t nc = config_of(c, 0), lc = config_of(c, 1);
  nc.layout = lc.layout = EPX_LAYOUT_RANK_MAJOR;
  epx_buffer_t nb = NULL, lb = NULL;
  create_pair(comm, stream, nc, lc, &nb, &lb);
  const int64_t N = (int64_t)g_size * TM;
  void *recv = dev_alloc(rows_bytes(c, N)), *out = dev_alloc(rows_bytes(c, TM));
  int32_t *count = dev_alloc(4 * (size_t)g_size), *sr = dev_alloc(4 * (size_t)N), *st = dev_alloc(4 * (size_t)N);
  int32_t *ex = dev_alloc(4 * (size_t)(N * K));
  float *wt = dev_alloc(4 * (size_t)(N * K));
  for (int step = 0; step < STEPS; step++) {
    const int64_t T = kCounts[(step + 2 * g_rank) % STEPS];
    routing_t r;
    make_routing(c, g_rank, step + 40, &r);
    int32_t *dev[2] = {dev_put(r.idx, sizeof r.idx), dev_put(r.w, sizeof r.w)};
    epx_routing_t rt = routing_of(c, T, dev);
    epx_handle_t hn = NULL, hl = NULL;
    FATAL_UNLESS_OK(epx_dispatch_layout(nb, &rt, NULL, &hn));
    int64_t Nn = 0;
    FATAL_UNLESS_OK(epx_handle_recv_rows(hn, &Nn));
    void *nrecv = dev_alloc(rows_bytes(c, Nn)), *nout = dev_alloc(rows_bytes(c, TM));
    int32_t *nsr = dev_alloc(4 * (size_t)Nn), *nst = dev_alloc(4 * (size_t)Nn), *nex = dev_alloc(4 * (size_t)(Nn * K));
    float *nwt = dev_alloc(4 * (size_t)(Nn * K));
    FATAL_UNLESS_OK(epx_dispatch(nb, hn, r.x, nrecv, Nn));
    FATAL_UNLESS_OK(epx_handle_recv_source(hn, nsr, nst));
    FATAL_UNLESS_OK(epx_handle_recv_routing(hn, nex, nwt));
    FATAL_UNLESS_OK(epx_combine(nb, hn, nrecv, nout));
    RANK_OK(epx_ll_dispatch(lb, &rt, NULL, r.x, recv, count, &hl));
    if (hl) RANK_OK(epx_handle_recv_source(hl, sr, st));
    if (hl) RANK_OK(epx_handle_recv_routing(hl, ex, wt));
    if (hl) RANK_OK(epx_ll_combine(lb, hl, recv, out));
    FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
    char *a_rows = host_get(nrecv, rows_bytes(c, Nn)), *b_rows = host_get(recv, rows_bytes(c, N));
    char *a_out = host_get(nout, rows_bytes(c, T)), *b_out = host_get(out, rows_bytes(c, T));
    int32_t *a_sr = host_get(nsr, 4 * (size_t)Nn), *a_st = host_get(nst, 4 * (size_t)Nn);
    int32_t *a_ex = host_get(nex, 4 * (size_t)(Nn * K)), *b_ex = host_get(ex, 4 * (size_t)(N * K));
    float *a_wt = host_get(nwt, 4 * (size_t)(Nn * K)), *b_wt = host_get(wt, 4 * (size_t)(N * K));
    int32_t *b_sr = host_get(sr, 4 * (size_t)N), *b_st = host_get(st, 4 * (size_t)N);
    int32_t *b_count = host_get(count, 4 * (size_t)g_size);
    int64_t from = 0;
    for (int src = 0; src < g_size && hl; src++) {
      int64_t n = 0;
      while (from + n < Nn && a_sr[from + n] == src) n++;
      RANK_EXPECT(b_count[src] == n, "rank-major (T %lld): %d rows from rank %d, the normal exchange %lld",
                  (long long)T, b_count[src], src, (long long)n);
      for (int64_t i = 0; i < TM; i++) {
        const int64_t a = from + i, b = (int64_t)src * TM + i;
        const int same = i < n ? b_sr[b] == src && b_st[b] == a_st[a] &&
                                     !memcmp(b_ex + b * K, a_ex + a * K, 4 * (size_t)K) &&
                                     !memcmp(b_wt + b * K, a_wt + a * K, 4 * (size_t)K) &&
                                     !memcmp(b_rows + rows_bytes(c, b), a_rows + rows_bytes(c, a), rows_bytes(c, 1))
                               : b_sr[b] == -1 && b_st[b] == -1;
        RANK_EXPECT(same, "rank-major (T %lld): row %lld from rank %d differs from the normal exchange's",
                    (long long)T, (long long)i, src);
        if (!same) break;
      }
      from += n;
    }
    RANK_EXPECT(!memcmp(a_out, b_out, rows_bytes(c, T)), "rank-major (T %lld): combine differs from the normal "
                "exchange's", (long long)T);
    void *hp[] = {a_rows, b_rows, a_out, b_out, a_sr, a_st, a_ex, b_ex, a_wt, b_wt, b_sr, b_st, b_count};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++) free(hp[i]);
    void *dp[] = {dev[0], dev[1], r.x, nrecv, nout, nsr, nst, nex, nwt};
    for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(dp[i]));
    FATAL_UNLESS_OK(epx_handle_release(hn));
    if (hl) RANK_OK(epx_handle_release(hl));
  }
  void *dp[] = {recv, out, count, sr, st, ex, wt};
  for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(dp[i]));
  FATAL_UNLESS_OK(epx_buffer_destroy(lb));
  FATAL_UNLESS_OK(epx_buffer_destroy(nb));
}

/* EPX_LL_BENCH=1: the latency of a decode step on each path (issue 25's
 * shape: 128 tokens per rank, hidden 7168, top-8 of 256 experts, bf16),
 * dispatch and combine each captured in a CUDA graph and replayed; a
 * RESULT line per rank (figures: bench/NOTES-gpu.md). */
static void bench_path(epx_comm_t comm, cudaStream_t stream) {
  enum { BT = 128, BH = 7168, BK = 8, BE = 256, REPS = 50 };
  epx_buffer_config_t cfg = EPX_BUFFER_CONFIG_INIT;
  cfg.device = EPX_DEVICE_CUDA, cfg.dtype = EPX_BFLOAT16, cfg.hidden = BH, cfg.num_experts = BE;
  cfg.max_top_k = BK, cfg.max_tokens_per_rank = BT, cfg.low_latency = 1, cfg.exchange_path = g_path;
  cfg.stream = stream;
  epx_buffer_t b = NULL;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &b));
  int32_t paths[64];
  FATAL_UNLESS_OK(epx_buffer_peer_paths(b, paths));
  int32_t idx[BT * BK];
  float w[BT * BK];
  uint64_t z = mix(1234u + (uint64_t)g_rank);
  for (int t = 0; t < BT; t++)
    for (int k = 0; k < BK; k++) {
      int e, dup;
      do {
        z = mix(z);
        e = (int)(z % BE);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= idx[t * BK + j] == e;
      } while (dup);
      idx[t * BK + k] = e, w[t * BK + k] = 1.0f / BK;
    }
  const int64_t N = (int64_t)BE / g_size * g_size * BT;
  int32_t *didx = dev_put(idx, sizeof idx), *count = dev_alloc(4 * BE), *tokens = dev_put(&(int32_t){BT}, 4);
  float *dw = dev_put(w, sizeof w);
  void *x = dev_alloc((size_t)BT * BH * 2), *recv = dev_alloc((size_t)N * BH * 2), *out = dev_alloc((size_t)BT * BH * 2);
  epx_routing_t rt = {BT, BK, didx, dw, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  cudaGraph_t g[2];
  cudaGraphExec_t ge[2];
  FATAL_UNLESS_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  FATAL_UNLESS_OK(epx_ll_dispatch(b, &rt, tokens, x, recv, count, &h));
  FATAL_UNLESS_CUDA_OK(cudaStreamEndCapture(stream, &g[0]));
  FATAL_UNLESS_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  FATAL_UNLESS_OK(epx_ll_combine(b, h, recv, out));
  FATAL_UNLESS_CUDA_OK(cudaStreamEndCapture(stream, &g[1]));
  cudaEvent_t ev[3];
  float us[2] = {0, 0};
  for (int i = 0; i < 2; i++) FATAL_UNLESS_CUDA_OK(cudaGraphInstantiate(&ge[i], g[i], 0));
  for (int i = 0; i < 3; i++) FATAL_UNLESS_CUDA_OK(cudaEventCreate(&ev[i]));
  for (int rep = 0; rep < REPS + 5; rep++) {
    MPI_Barrier(MPI_COMM_WORLD);
    FATAL_UNLESS_CUDA_OK(cudaEventRecord(ev[0], stream));
    FATAL_UNLESS_CUDA_OK(cudaGraphLaunch(ge[0], stream));
    FATAL_UNLESS_CUDA_OK(cudaEventRecord(ev[1], stream));
    FATAL_UNLESS_CUDA_OK(cudaGraphLaunch(ge[1], stream));
    FATAL_UNLESS_CUDA_OK(cudaEventRecord(ev[2], stream));
    FATAL_UNLESS_CUDA_OK(cudaStreamSynchronize(stream));
    for (int i = 0; i < 2 && rep >= 5; i++) {
      float ms = 0;
      FATAL_UNLESS_CUDA_OK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
      us[i] += ms * 1000.0f / REPS;
    }
  }
  printf("RESULT ll rank %d of %d path %s T %d H %d top-%d of %d bf16: dispatch %.1f us, combine %.1f us\n", g_rank,
         g_size, paths[g_rank] == EPX_PATH_FUSED ? "fused-window" : "nccl-slabs", BT, BH, BK, BE, us[0], us[1]);
  for (int i = 0; i < 2; i++) {
    FATAL_UNLESS_CUDA_OK(cudaGraphExecDestroy(ge[i]));
    FATAL_UNLESS_CUDA_OK(cudaGraphDestroy(g[i]));
  }
  for (int i = 0; i < 3; i++) FATAL_UNLESS_CUDA_OK(cudaEventDestroy(ev[i]));
  FATAL_UNLESS_OK(epx_handle_release(h));
  void *dp[] = {didx, count, tokens, dw, x, recv, out};
  for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) FATAL_UNLESS_CUDA_OK(cudaFree(dp[i]));
  FATAL_UNLESS_OK(epx_buffer_destroy(b));
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  /* One rank (one GPU): the W-rank low-latency backend all the same (and
   * the normal W-rank backend as its reference), NCCL self sends. */
  if (g_size == 1) epx_cuda_ep_at_one_rank(1);
  const char *xf = getenv("EPX_GPU_EXPECT_FUSED");
  g_expect_fused = xf && *xf && strcmp(xf, "0");
  cudaStream_t stream = mpi_gpu_rank_stream(g_rank);
  MPI_Comm world = MPI_COMM_WORLD;
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = 60;
  epx_comm_t comm;
  FATAL_UNLESS_OK(epx_comm_create_nccl_mpi(&world, &cc, &comm));
  const case_t cases[] = {
      {8, 4, EPX_BFLOAT16, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_FLOAT32, 0, 1},
      {8, 4, EPX_BFLOAT16, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_PAYLOAD, 0, 2},
      {4, 1, EPX_FLOAT32, EPX_WEIGHTS_NONE, EPX_COMBINE_PARTIALS_FLOAT32, 0, 3},
      {256 / g_size, 8, EPX_BFLOAT16, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_FLOAT32, 0, 4},
      {8, 2, EPX_BFLOAT16, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_FLOAT32, 1, 5},
      {16, 8, EPX_FLOAT32, EPX_WEIGHTS_IN_COMBINE, EPX_COMBINE_PARTIALS_PAYLOAD, 0, 6},
  };
  const int n = (int)(sizeof cases / sizeof cases[0]);
  const epx_exchange_path_t paths[] = {EPX_PATH_HOST, EPX_PATH_FUSED};
  for (int p = 0; p < 2; p++) {
    g_path = paths[p];
    for (int i = 0; i < n; i++) run_case(&cases[i], comm, stream, 0);
    run_case(&cases[0], comm, stream, 1);
    run_case(&cases[3], comm, stream, 1);
    /* in-process and ipc slabs are not capturable; over ipc on a shared GPU the window is refused too */
    if (RANKS_GRAPHS == 2 || (RANKS_GRAPHS == 1 && g_path == EPX_PATH_FUSED)) {
      test_graph(&cases[0], comm, stream);
      test_graph(&cases[1], comm, stream);
    }
    test_oversize(&cases[0], comm, stream);
  }
  const char *bench = getenv("EPX_LL_BENCH");
  for (int p = 0; p < 2 && bench && *bench && strcmp(bench, "0"); p++) {
    g_path = paths[p];
    bench_path(comm, stream);
  }
  /* fp8 and rank-major move on the slabs (the window serves neither) */
  g_path = EPX_PATH_HOST;
  test_rank_major(comm, stream);
  for (int quantize = 0; quantize < 2; quantize++) {
    test_fp8(&cases[0], comm, stream, quantize);
    test_fp8(&cases[5], comm, stream, quantize);
  }
  FATAL_UNLESS_OK(epx_comm_destroy(comm));
  int total = 0;
  MPI_Allreduce(&g_fail, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0)
    printf("mpi_gpu_ll: %d ranks, %d cases on each path (and device counts, graphs, oversize): %s (%d failures)\n",
           g_size, n,
           total ? "FAIL" : "OK", total);
  MPI_Finalize();
  return total ? 1 : 0;
}
