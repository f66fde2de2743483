/* The CUDA backend against the CPU engine on a comm of one rank: two buffers
 * (CPU, CUDA) with the same config get the same routing and inputs, and must
 * agree — row counts, counts, offsets, recv_source, recv_routing and every
 * payload (dispatch, combine, both backward passes) bit for bit, as the
 * contract promises; grad_w, a dot product summed in another order, within
 * atol + rtol. Every output is poisoned (0xA5)
 * first, so an unwritten row shows; inputs are fresh random values; combine
 * and dispatch_backward must give the same bits on every run. Also covered:
 * worst_case_sizing (no host synchronisation; N in device memory), dispatch
 * and combine captured in a CUDA graph and replayed on new inputs, an empty
 * batch, and invalid routing refused (and, with worst_case_sizing, dropped
 * and reported by epx_handle_recv_rows).
 *
 * EPX_GPU_TEST_QUICK=1 trims the grid (for compute-sanitizer runs). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/dtype.h"
#include "gpu_testutil.h"
#include "../util/buffer_config.h"

typedef struct gpu_case {
  epx_dtype_t dtype;
  epx_layout_t layout;
  epx_weighting_t weighting;
  int32_t E, K, alignment;
  int64_t T, H;
  int worst_case;
  uint64_t seed;
} gpu_case_t;

/* The routing of a case: random top-K, about 10% of the slots -1 and every
 * 17th token with no route at all; capacity: locations in choice order with
 * C = 0.8 * T*K/E, so about a fifth of the routes drop (idx -1, w 0). */
typedef struct routing {
  int32_t *idx, *loc;
  float *w;
  int32_t capacity;
} routing_t;

static routing_t make_routing(tu_rng_t *rng, const gpu_case_t *c) {
  routing_t r;
  size_t n = (size_t)(c->T * c->K);
  r.idx = tu_alloc(4 * n);
  r.w = tu_alloc(4 * n);
  r.loc = tu_alloc(4 * n);
  r.capacity = 0;
  tu_random_routing(rng, c->T, c->E, c->K, 0.0, r.idx, r.w);
  for (int64_t t = 0; t < c->T; t++)
    for (int32_t k = 0; k < c->K; k++)
      if (t % 17 == 3 || tu_uniform(rng) < 0.1) {
        r.idx[t * c->K + k] = -1;
        r.w[t * c->K + k] = 0.0f;
      }
  if (c->layout == EPX_LAYOUT_CAPACITY) {
    int64_t cap = (int64_t)ceil(0.8 * (double)(c->T * c->K) / c->E);
    r.capacity = (int32_t)(cap < 1 ? 1 : cap);
    int64_t *fill = tu_alloc(8 * (size_t)c->E);
    for (int32_t k = 0; k < c->K; k++)
      for (int64_t t = 0; t < c->T; t++) {
        int64_t i = t * c->K + k;
        r.loc[i] = -1;
        if (r.idx[i] < 0) continue;
        int64_t l = fill[r.idx[i]]++;
        if (l < r.capacity) {
          r.loc[i] = (int32_t)l;
        } else {
          r.idx[i] = -1;
          r.w[i] = 0.0f;
        }
      }
    tu_free(fill);
  }
  return r;
}

static void free_routing(routing_t *r) {
  tu_free(r->idx);
  tu_free(r->w);
  tu_free(r->loc);
}

static epx_buffer_t make_buffer(epx_comm_t comm, const gpu_case_t *c, int32_t capacity,
                                epx_device_t device, cudaStream_t stream) {
  epx_buffer_config_t cfg = tu_config(device, c->dtype, c->H, c->E, c->K, c->T > 0 ? c->T : 1);
  cfg.layout = c->layout;
  cfg.expert_alignment = c->alignment;
  cfg.capacity = capacity;
  if (device == EPX_DEVICE_CUDA) {
    cfg.worst_case_sizing = c->worst_case;
    cfg.stream = stream;
  }
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
  return b;
}

static void expect_close(const char *what, const gpu_case_t *c, epx_dtype_t dtype, const void *gpu,
                         const void *cpu, int64_t n, double atol, double rtol) {
  double err = tu_max_error(dtype, gpu, dtype, cpu, n, atol, rtol);
  if (err <= 1.0) return;
  for (int64_t i = 0; i < n; i++) {
    double a = epx_load(dtype, gpu, i), b = epx_load(dtype, cpu, i);
    if (!(fabs(a - b) <= atol + rtol * fabs(b)))
      fail_msg("%s (%s %s %s K=%d E=%d T=%lld H=%lld align=%d worst=%d): element %lld is %g, CPU %g",
               what, tu_dtype_name(c->dtype), tu_layout_name(c->layout), tu_weighting_name(c->weighting), c->K,
               c->E, (long long)c->T, (long long)c->H, c->alignment, c->worst_case, (long long)i, a, b);
  }
}

/* The contract promises the CPU backend's bits for every payload (dispatch,
 * combine and both backward passes: the same float32 operations in the same
 * k-slot order, rounded once): compared byte for byte, the first differing
 * element named. */
static void expect_same_bits(const char *what, const gpu_case_t *c, epx_dtype_t dtype, const void *gpu,
                             const void *cpu, int64_t n) {
  const size_t size = epx_dtype_size(dtype);
  if (memcmp(gpu, cpu, (size_t)n * size) == 0) return;
  for (int64_t i = 0; i < n; i++)
    if (memcmp((const char *)gpu + (size_t)i * size, (const char *)cpu + (size_t)i * size, size))
      fail_msg("%s (%s %s %s K=%d E=%d T=%lld H=%lld align=%d worst=%d): element %lld is %.9g, CPU %.9g "
               "(the contract promises the same bits)",
               what, tu_dtype_name(c->dtype), tu_layout_name(c->layout), tu_weighting_name(c->weighting), c->K,
               c->E, (long long)c->T, (long long)c->H, c->alignment, c->worst_case, (long long)i,
               epx_load(dtype, gpu, i), epx_load(dtype, cpu, i));
}

static void expect_same_ints(const char *what, const gpu_case_t *c, const void *gpu, const void *cpu,
                             size_t bytes) {
  if (memcmp(gpu, cpu, bytes) == 0) return;
  fail_msg("%s differs from the CPU engine (%s %s %s K=%d E=%d T=%lld)", what, tu_dtype_name(c->dtype),
           tu_layout_name(c->layout), tu_weighting_name(c->weighting), c->K, c->E, (long long)c->T);
}

/* grad_w is a dot product over H in float32: the CPU and the GPU add in
 * different orders (the contract promises no bits for it), so it is compared
 * within atol + rtol. */
static double dot_atol(int64_t H) { return 1e-5 * (double)H + 1e-4; }

/* One case end to end: layout, accessors, dispatch, combine (twice: same
 * bits), combine_backward and dispatch_backward, CPU against CUDA. */
static void run_case(const gpu_case_t *c) {
  tu_rng_t rng = {c->seed};
  const int64_t T = c->T, H = c->H;
  const int32_t K = c->K, E = c->E;
  const size_t es = epx_dtype_size(c->dtype), row_bytes = (size_t)H * es;
  const int rank_major = c->layout == EPX_LAYOUT_RANK_MAJOR;
  const size_t slots = rank_major ? (size_t)K : 1;

  routing_t r = make_routing(&rng, c);
  /* NONE weighting: sometimes no weights at all (recv_w is then 0). */
  const int pass_w = c->weighting != EPX_WEIGHTS_NONE || (c->seed & 1);
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  epx_buffer_t cpu = make_buffer(comm, c, r.capacity, EPX_DEVICE_CPU, NULL);
  epx_buffer_t gpu = make_buffer(comm, c, r.capacity, EPX_DEVICE_CUDA, stream);

  const size_t tk = (size_t)(T * K);
  int32_t *d_idx = dev_copy(r.idx, 4 * tk), *d_loc = dev_copy(r.loc, 4 * tk);
  float *d_w = dev_copy(r.w, 4 * tk);
  const int capacity_layout = c->layout == EPX_LAYOUT_CAPACITY;
  epx_routing_t rc = {T, K, r.idx, pass_w ? r.w : NULL, capacity_layout ? r.loc : NULL, c->weighting};
  epx_routing_t rg = {T, K, d_idx, pass_w ? d_w : NULL, capacity_layout ? d_loc : NULL, c->weighting};
  epx_handle_t hc = NULL, hg = NULL;
  EXPECT_OK(epx_dispatch_layout(cpu, &rc, NULL, &hc));
  EXPECT_OK(epx_dispatch_layout(gpu, &rg, NULL, &hg));

  /* Row counts: with worst_case_sizing the handle reports the bound and the
   * true N is in device memory. */
  int64_t N = -1, Ng = -1, bound = -1, handle_rows = -1;
  EXPECT_OK(epx_handle_recv_rows(hc, &N));
  EXPECT_OK(epx_handle_recv_rows(hg, &Ng));
  assert_int_equal(N, Ng);
  EXPECT_OK(epx_buffer_max_recv_rows(gpu, &bound));
  /* The rows the GPU tensors are allocated with: the buffer's bound with
   * worst_case_sizing (the handle's N then lives on the device), else N. */
  handle_rows = c->worst_case ? bound : Ng;
  if (c->worst_case) {
    const int64_t *d_rows = NULL;
    EXPECT_OK(epx_handle_recv_rows_device(hg, &d_rows));
    int64_t rows_on_device = -1;
    CUDA_OK(cudaMemcpy(&rows_on_device, d_rows, sizeof rows_on_device, cudaMemcpyDeviceToHost));
    assert_int_equal(rows_on_device, N);
  }
  assert_true(N <= bound);
  const int64_t R = handle_rows; /* rows the GPU tensors are allocated with */

  /* Counts, offsets, recv_source, recv_routing: exactly. */
  int64_t *cnt_c = tu_alloc(8 * (size_t)E), *off_c = tu_alloc(8 * ((size_t)E + 1));
  int64_t *d_cnt = dev_alloc(8 * (size_t)E), *d_off = dev_alloc(8 * ((size_t)E + 1));
  dev_poison(d_cnt, 8 * (size_t)E);
  dev_poison(d_off, 8 * ((size_t)E + 1));
  EXPECT_OK(epx_handle_expert_counts(hc, cnt_c, off_c));
  EXPECT_OK(epx_handle_expert_counts(hg, d_cnt, d_off));
  CUDA_OK(cudaStreamSynchronize(stream));
  int64_t *cnt_g = host_copy(d_cnt, 8 * (size_t)E), *off_g = host_copy(d_off, 8 * ((size_t)E + 1));
  expect_same_ints("expert counts", c, cnt_g, cnt_c, 8 * (size_t)E);
  expect_same_ints("expert offsets", c, off_g, off_c, 8 * ((size_t)E + 1));

  const size_t nr = (size_t)(N > 0 ? N : 0);
  int32_t *src_rank_c = tu_alloc(4 * nr), *src_tok_c = tu_alloc(4 * nr);
  int32_t *rexp_c = tu_alloc(4 * nr * slots);
  float *rw_c = tu_alloc(4 * nr * slots);
  EXPECT_OK(epx_handle_recv_source(hc, src_rank_c, src_tok_c));
  EXPECT_OK(epx_handle_recv_routing(hc, rexp_c, rw_c));
  int32_t *d_src_rank = dev_alloc(4 * nr), *d_src_tok = dev_alloc(4 * nr), *d_rexp = dev_alloc(4 * nr * slots);
  float *d_rw = dev_alloc(4 * nr * slots);
  dev_poison(d_src_rank, 4 * nr);
  dev_poison(d_src_tok, 4 * nr);
  dev_poison(d_rexp, 4 * nr * slots);
  dev_poison(d_rw, 4 * nr * slots);
  EXPECT_OK(epx_handle_recv_source(hg, d_src_rank, d_src_tok));
  EXPECT_OK(epx_handle_recv_routing(hg, d_rexp, d_rw));
  CUDA_OK(cudaStreamSynchronize(stream));
  int32_t *src_rank_g = host_copy(d_src_rank, 4 * nr), *src_tok_g = host_copy(d_src_tok, 4 * nr);
  int32_t *rexp_g = host_copy(d_rexp, 4 * nr * slots);
  float *rw_g = host_copy(d_rw, 4 * nr * slots);
  expect_same_ints("recv_source rank", c, src_rank_g, src_rank_c, 4 * nr);
  expect_same_ints("recv_source token", c, src_tok_g, src_tok_c, 4 * nr);
  expect_same_ints("recv_routing expert", c, rexp_g, rexp_c, 4 * nr * slots);
  expect_same_ints("recv_routing weight", c, rw_g, rw_c, 4 * nr * slots);

  /* Dispatch. */
  const size_t tbytes = (size_t)T * row_bytes, nbytes = nr * row_bytes, rbytes = (size_t)R * row_bytes;
  void *x = tu_alloc(tbytes);
  tu_fill(&rng, c->dtype, x, T * H);
  void *d_x = dev_copy(x, tbytes);
  void *recv_c = tu_alloc(nbytes), *d_recv = dev_alloc(rbytes);
  tu_poison(recv_c, nbytes);
  dev_poison(d_recv, rbytes);
  EXPECT_OK(epx_dispatch(cpu, hc, x, recv_c, N));
  EXPECT_OK(epx_dispatch(gpu, hg, d_x, d_recv, R));
  CUDA_OK(cudaStreamSynchronize(stream));
  void *recv_g = host_copy(d_recv, nbytes);
  expect_same_bits("dispatch recv_x", c, c->dtype, recv_g, recv_c, N * H);

  /* Combine, twice: the same bits. */
  void *eo = tu_alloc(nbytes);
  tu_fill(&rng, c->dtype, eo, N * H);
  void *d_eo = dev_alloc(rbytes);
  if (nbytes) CUDA_OK(cudaMemcpy(d_eo, eo, nbytes, cudaMemcpyHostToDevice));
  void *out_c = tu_alloc(tbytes), *d_out = dev_alloc(tbytes), *d_out2 = dev_alloc(tbytes);
  tu_poison(out_c, tbytes);
  dev_poison(d_out, tbytes);
  dev_poison(d_out2, tbytes);
  EXPECT_OK(epx_combine(cpu, hc, eo, out_c));
  EXPECT_OK(epx_combine(gpu, hg, d_eo, d_out));
  EXPECT_OK(epx_combine(gpu, hg, d_eo, d_out2));
  CUDA_OK(cudaStreamSynchronize(stream));
  void *out_g = host_copy(d_out, tbytes), *out_g2 = host_copy(d_out2, tbytes);
  expect_same_bits("combine out", c, c->dtype, out_g, out_c, T * H);
  if (memcmp(out_g, out_g2, tbytes) != 0) fail_msg("combine is not bit-identical run to run");

  /* Combine backward (grad_w with EPX_WEIGHTS_IN_COMBINE). */
  const int wc = c->weighting == EPX_WEIGHTS_IN_COMBINE, wd = c->weighting == EPX_WEIGHTS_IN_DISPATCH;
  void *go = tu_alloc(tbytes);
  tu_fill(&rng, c->dtype, go, T * H);
  void *d_go = dev_copy(go, tbytes);
  void *geo_c = tu_alloc(nbytes), *d_geo = dev_alloc(rbytes);
  float *gw_c = tu_alloc(4 * tk), *d_gw = dev_alloc(4 * tk);
  tu_poison(geo_c, nbytes);
  tu_poison(gw_c, 4 * tk);
  dev_poison(d_geo, rbytes);
  dev_poison(d_gw, 4 * tk);
  EXPECT_OK(epx_combine_backward(cpu, hc, go, wc ? eo : NULL, geo_c, wc ? gw_c : NULL));
  EXPECT_OK(epx_combine_backward(gpu, hg, d_go, wc ? d_eo : NULL, d_geo, wc ? d_gw : NULL));
  CUDA_OK(cudaStreamSynchronize(stream));
  void *geo_g = host_copy(d_geo, nbytes);
  expect_same_bits("combine_backward grad_expert_out", c, c->dtype, geo_g, geo_c, N * H);
  if (wc) {
    float *gw_g = host_copy(d_gw, 4 * tk);
    expect_close("combine_backward grad_w", c, EPX_FLOAT32, gw_g, gw_c, (int64_t)tk, dot_atol(H), 1e-3);
    tu_free(gw_g);
  }

  /* Dispatch backward, twice: the same bits (grad_w with EPX_WEIGHTS_IN_DISPATCH). */
  void *grx = tu_alloc(nbytes);
  tu_fill(&rng, c->dtype, grx, N * H);
  void *d_grx = dev_alloc(rbytes);
  if (nbytes) CUDA_OK(cudaMemcpy(d_grx, grx, nbytes, cudaMemcpyHostToDevice));
  void *gx_c = tu_alloc(tbytes), *d_gx = dev_alloc(tbytes), *d_gx2 = dev_alloc(tbytes);
  tu_poison(gx_c, tbytes);
  tu_poison(gw_c, 4 * tk);
  dev_poison(d_gx, tbytes);
  dev_poison(d_gx2, tbytes);
  dev_poison(d_gw, 4 * tk);
  EXPECT_OK(epx_dispatch_backward(cpu, hc, grx, gx_c, wd ? x : NULL, wd ? gw_c : NULL));
  EXPECT_OK(epx_dispatch_backward(gpu, hg, d_grx, d_gx, wd ? d_x : NULL, wd ? d_gw : NULL));
  EXPECT_OK(epx_dispatch_backward(gpu, hg, d_grx, d_gx2, NULL, NULL));
  CUDA_OK(cudaStreamSynchronize(stream));
  void *gx_g = host_copy(d_gx, tbytes), *gx_g2 = host_copy(d_gx2, tbytes);
  expect_same_bits("dispatch_backward grad_x", c, c->dtype, gx_g, gx_c, T * H);
  if (memcmp(gx_g, gx_g2, tbytes) != 0) fail_msg("dispatch_backward is not bit-identical run to run");
  if (wd) {
    float *gw_g = host_copy(d_gw, 4 * tk);
    expect_close("dispatch_backward grad_w", c, EPX_FLOAT32, gw_g, gw_c, (int64_t)tk, dot_atol(H), 1e-3);
    tu_free(gw_g);
  }

  EXPECT_OK(epx_handle_release(hc));
  EXPECT_OK(epx_handle_release(hg));
  EXPECT_OK(epx_buffer_destroy(cpu));
  EXPECT_OK(epx_buffer_destroy(gpu));
  EXPECT_OK(epx_comm_destroy(comm));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  void *dev[] = {d_idx, d_loc, d_w, d_cnt, d_off, d_src_rank, d_src_tok, d_rexp, d_rw, d_x, d_recv,
                 d_eo, d_out, d_out2, d_go, d_geo, d_gw, d_grx, d_gx, d_gx2};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) CUDA_OK(cudaFree(dev[i]));
  void *host[] = {cnt_c, off_c, cnt_g, off_g, src_rank_c, src_tok_c, rexp_c, rw_c, src_rank_g, src_tok_g,
                  rexp_g, rw_g, x, recv_c, recv_g, eo, out_c, out_g, out_g2, go, geo_c, gw_c, geo_g,
                  grx, gx_c, gx_g, gx_g2};
  for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) tu_free(host[i]);
  free_routing(&r);
}

static void require_gpu(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1)
    fail_msg("no CUDA device: these tests need an NVIDIA GPU (run them with bench/gpu-check.sh)");
  assert_true(epx_has_cuda());
}

/* Every layout x weighting x dtype x K in {1, 2, 3, 8}; expert-major with
 * alignment 1 and 16. T = 333 spans several layout chunks, the last partial;
 * H = 136 leaves partial vector steps. */
static void test_grid(void **state) {
  (void)state;
  require_gpu();
  const epx_dtype_t dtypes[] = {EPX_FLOAT32, EPX_BFLOAT16, EPX_FLOAT16};
  const int32_t ks[] = {1, 2, 3, 8};
  struct {
    epx_layout_t layout;
    int32_t alignment;
  } layouts[] = {{EPX_LAYOUT_EXPERT_MAJOR, 1}, {EPX_LAYOUT_EXPERT_MAJOR, 16}, {EPX_LAYOUT_RANK_MAJOR, 1},
                 {EPX_LAYOUT_CAPACITY, 1}};
  const epx_weighting_t weightings[] = {EPX_WEIGHTS_IN_COMBINE, EPX_WEIGHTS_IN_DISPATCH, EPX_WEIGHTS_NONE};
  uint64_t seed = 1000;
  int cases = 0;
  for (size_t d = 0; d < 3; d++) {
    if (quick() && dtypes[d] == EPX_FLOAT16) continue;
    for (size_t l = 0; l < 4; l++)
      for (size_t w = 0; w < 3; w++) {
        if (layouts[l].layout == EPX_LAYOUT_RANK_MAJOR && weightings[w] != EPX_WEIGHTS_NONE) continue;
        for (size_t k = 0; k < 4; k++) {
          if (quick() && ks[k] == 2) continue;
          gpu_case_t c = {dtypes[d], layouts[l].layout, weightings[w], ks[k] == 8 ? 24 : 12, ks[k],
                          layouts[l].alignment, quick() ? 97 : 333, 136, 0, seed++};
          run_case(&c);
          cases++;
        }
      }
  }
  print_message("%d cases\n", cases);
}

/* Larger shapes: many chunks, E above the 256 threads of a block, rows of
 * several 2 KB steps, layout warps with several staged segments. */
static void test_large(void **state) {
  (void)state;
  require_gpu();
  gpu_case_t cases[] = {
      {EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 300, 8, 16, 4096, 1032, 0, 7},
      {EPX_BFLOAT16, EPX_LAYOUT_CAPACITY, EPX_WEIGHTS_IN_DISPATCH, 64, 3, 1, 5000, 520, 0, 8},
      {EPX_FLOAT32, EPX_LAYOUT_RANK_MAJOR, EPX_WEIGHTS_NONE, 40, 8, 1, 3000, 264, 0, 9},
      {EPX_FLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_DISPATCH, 256, 8, 1, 2500, 2048, 0, 10},
      /* past 32K tokens a layout warp walks its routes in several staged segments */
      {EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 64, 8, 8, 40000, 8, 0, 11},
      {EPX_FLOAT32, EPX_LAYOUT_CAPACITY, EPX_WEIGHTS_IN_COMBINE, 64, 8, 1, 40000, 8, 0, 12},
      {EPX_FLOAT32, EPX_LAYOUT_RANK_MAJOR, EPX_WEIGHTS_NONE, 64, 8, 1, 40000, 8, 1, 13},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    if (quick()) {
      cases[i].T /= 8;
      cases[i].H = cases[i].H < 136 ? cases[i].H : 136;
    }
    run_case(&cases[i]);
  }
}

/* worst_case_sizing: the handle reports the bound, the true N is on the
 * device, rows past N are never written; every layout. */
static void test_worst_case(void **state) {
  (void)state;
  require_gpu();
  gpu_case_t cases[] = {
      {EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 16, 3, 16, 777, 264, 1, 21},
      {EPX_FLOAT32, EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_DISPATCH, 24, 8, 1, 500, 136, 1, 22},
      {EPX_FLOAT16, EPX_LAYOUT_RANK_MAJOR, EPX_WEIGHTS_NONE, 24, 8, 1, 500, 136, 1, 23},
      {EPX_BFLOAT16, EPX_LAYOUT_CAPACITY, EPX_WEIGHTS_IN_COMBINE, 16, 2, 1, 640, 136, 1, 24},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
}

/* An empty batch: nothing to move; the capacity layout's rows are all zero. */
static void test_empty_batch(void **state) {
  (void)state;
  require_gpu();
  gpu_case_t cases[] = {
      {EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 16, 2, 16, 0, 136, 0, 31},
      {EPX_FLOAT32, EPX_LAYOUT_RANK_MAJOR, EPX_WEIGHTS_NONE, 16, 2, 1, 0, 136, 1, 32},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);

  /* Capacity, T = 0: E*C rows, all written with zeros. */
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  gpu_case_t c = {EPX_BFLOAT16, EPX_LAYOUT_CAPACITY, EPX_WEIGHTS_IN_COMBINE, 8, 2, 1, 0, 64, 0, 33};
  epx_buffer_t gpu = make_buffer(comm, &c, 5, EPX_DEVICE_CUDA, NULL);
  epx_routing_t rg = {0, 2, NULL, NULL, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t hg = NULL;
  EXPECT_OK(epx_dispatch_layout(gpu, &rg, NULL, &hg));
  int64_t N = -1;
  EXPECT_OK(epx_handle_recv_rows(hg, &N));
  assert_int_equal(N, 40);
  size_t bytes = (size_t)N * 64 * 2;
  void *d_recv = dev_alloc(bytes);
  dev_poison(d_recv, bytes);
  EXPECT_OK(epx_dispatch(gpu, hg, NULL, d_recv, N));
  CUDA_OK(cudaDeviceSynchronize());
  unsigned char *h = host_copy(d_recv, bytes);
  for (size_t i = 0; i < bytes; i++)
    if (h[i]) fail_msg("capacity slot byte %zu is %u, not zero", i, h[i]);
  tu_free(h);
  CUDA_OK(cudaFree(d_recv));
  EXPECT_OK(epx_handle_release(hg));
  EXPECT_OK(epx_buffer_destroy(gpu));
  EXPECT_OK(epx_comm_destroy(comm));
}

/* Dispatch and combine captured in a CUDA graph and replayed on new inputs
 * (same pointers): the results follow the inputs. With and without
 * worst_case_sizing. */
static void test_graph_capture(void **state) {
  (void)state;
  require_gpu();
  for (int worst = 1; worst >= 0; worst--) {
    gpu_case_t c = {EPX_BFLOAT16, EPX_LAYOUT_EXPERT_MAJOR, EPX_WEIGHTS_IN_COMBINE, 16, 3, 16,
                    quick() ? 200 : 1000, 264, worst, 41};
    tu_rng_t rng = {c.seed};
    routing_t r = make_routing(&rng, &c);
    epx_comm_t comm = NULL;
    EXPECT_OK(epx_comm_create_self(&comm));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    epx_buffer_t cpu = make_buffer(comm, &c, 0, EPX_DEVICE_CPU, NULL);
    epx_buffer_t gpu = make_buffer(comm, &c, 0, EPX_DEVICE_CUDA, stream);
    const size_t tk = (size_t)(c.T * c.K);
    int32_t *d_idx = dev_copy(r.idx, 4 * tk);
    float *d_w = dev_copy(r.w, 4 * tk);
    epx_routing_t rc = {c.T, c.K, r.idx, r.w, NULL, c.weighting};
    epx_routing_t rg = {c.T, c.K, d_idx, d_w, NULL, c.weighting};
    epx_handle_t hc = NULL, hg = NULL;
    EXPECT_OK(epx_dispatch_layout(cpu, &rc, NULL, &hc));
    EXPECT_OK(epx_dispatch_layout(gpu, &rg, NULL, &hg));
    int64_t N = 0;
    EXPECT_OK(epx_handle_recv_rows(hc, &N));
    int64_t R = N; /* the GPU handle's rows: the buffer's bound with worst_case_sizing */
    if (worst) EXPECT_OK(epx_buffer_max_recv_rows(gpu, &R));
    const size_t row_bytes = (size_t)c.H * 2, tbytes = (size_t)c.T * row_bytes;
    const size_t nbytes = (size_t)N * row_bytes, rbytes = (size_t)R * row_bytes;
    void *d_x = dev_alloc(tbytes), *d_recv = dev_alloc(rbytes), *d_eo = dev_alloc(rbytes), *d_out = dev_alloc(tbytes);

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    EXPECT_OK(epx_dispatch(gpu, hg, d_x, d_recv, R));
    EXPECT_OK(epx_combine(gpu, hg, d_eo, d_out));
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    void *x = tu_alloc(tbytes), *eo = tu_alloc(nbytes), *recv_c = tu_alloc(nbytes), *out_c = tu_alloc(tbytes);
    for (int rep = 0; rep < 3; rep++) {
      tu_fill(&rng, c.dtype, x, c.T * c.H);
      tu_fill(&rng, c.dtype, eo, N * c.H);
      CUDA_OK(cudaMemcpy(d_x, x, tbytes, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_eo, eo, nbytes, cudaMemcpyHostToDevice));
      dev_poison(d_recv, rbytes);
      dev_poison(d_out, tbytes);
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      tu_poison(recv_c, nbytes);
      tu_poison(out_c, tbytes);
      EXPECT_OK(epx_dispatch(cpu, hc, x, recv_c, N));
      EXPECT_OK(epx_combine(cpu, hc, eo, out_c));
      void *recv_g = host_copy(d_recv, nbytes), *out_g = host_copy(d_out, tbytes);
      expect_same_bits("graph dispatch recv_x", &c, c.dtype, recv_g, recv_c, N * c.H);
      expect_same_bits("graph combine out", &c, c.dtype, out_g, out_c, c.T * c.H);
      tu_free(recv_g);
      tu_free(out_g);
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    EXPECT_OK(epx_handle_release(hc));
    EXPECT_OK(epx_handle_release(hg));
    EXPECT_OK(epx_buffer_destroy(cpu));
    EXPECT_OK(epx_buffer_destroy(gpu));
    EXPECT_OK(epx_comm_destroy(comm));
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamDestroy(stream));
    void *dev[] = {d_idx, d_w, d_x, d_recv, d_eo, d_out};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) CUDA_OK(cudaFree(dev[i]));
    tu_free(x);
    tu_free(eo);
    tu_free(recv_c);
    tu_free(out_c);
    free_routing(&r);
  }
}

/* A bad routing: the CUDA layout refuses it with the CPU engine's message
 * and leaves the handle untouched; with worst_case_sizing it drops the bad
 * route instead (the same rows as the CPU engine on the routing with that
 * slot -1) and epx_handle_recv_rows reports it. */
typedef enum { BAD_EXPERT, NEGATIVE_EXPERT, DUPLICATE, BAD_LOCATION, TAKEN_LOCATION, TWO_ERRORS } bad_kind_t;

static void check_bad_routing(bad_kind_t kind) {
  const int capacity_layout = kind == BAD_LOCATION || kind == TAKEN_LOCATION;
  gpu_case_t c = {EPX_FLOAT32, capacity_layout ? EPX_LAYOUT_CAPACITY : EPX_LAYOUT_EXPERT_MAJOR,
                  EPX_WEIGHTS_IN_COMBINE, 8, 3, 4, 64, 64, 0, 50 + (uint64_t)kind};
  tu_rng_t rng = {c.seed};
  routing_t r = make_routing(&rng, &c);
  const int32_t K = c.K;
  int64_t bad = -1; /* the route the message must name, dropped with worst_case_sizing */
  switch (kind) {
    case BAD_EXPERT: bad = 5 * K + 1; r.idx[bad] = c.E; break;
    case NEGATIVE_EXPERT: bad = 6 * K + 2; r.idx[bad] = -2; break;
    case DUPLICATE:
      bad = 7 * K + 2;
      r.idx[7 * K] = r.idx[bad] >= 0 ? r.idx[bad] : 1;
      r.idx[bad] = r.idx[7 * K];
      break;
    case BAD_LOCATION:
      for (bad = 9 * K; r.idx[bad] < 0; bad++) continue;
      r.loc[bad] = r.capacity;
      break;
    case TAKEN_LOCATION: {
      /* a later route of the same expert takes an earlier route's slot */
      int64_t first = 0;
      while (r.idx[first] < 0) first++;
      for (bad = first + 1; r.idx[bad] != r.idx[first] || bad / K == first / K; bad++) continue;
      r.loc[bad] = r.loc[first];
      break;
    }
    case TWO_ERRORS:
      bad = 3 * K;
      r.idx[bad] = 99;
      r.idx[10 * K + 1] = -7;
      break;
  }
  char wanted[64];
  snprintf(wanted, sizeof wanted, "routing.%s[%lld]", capacity_layout ? "locations" : "topk_idx",
           (long long)(bad / K));

  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  const size_t tk = (size_t)(c.T * K);
  int32_t *d_idx = dev_copy(r.idx, 4 * tk), *d_loc = dev_copy(r.loc, 4 * tk);
  float *d_w = dev_copy(r.w, 4 * tk);
  epx_routing_t rc = {c.T, K, r.idx, r.w, capacity_layout ? r.loc : NULL, c.weighting};
  epx_routing_t rg = {c.T, K, d_idx, d_w, capacity_layout ? d_loc : NULL, c.weighting};

  /* Refused, with the CPU engine's words. */
  epx_buffer_t cpu = make_buffer(comm, &c, r.capacity, EPX_DEVICE_CPU, NULL);
  epx_buffer_t gpu = make_buffer(comm, &c, r.capacity, EPX_DEVICE_CUDA, NULL);
  epx_handle_t sentinel = (epx_handle_t)(uintptr_t)0x5a5a5a50u, hc = sentinel, hg = sentinel;
  EXPECT_STATUS(epx_dispatch_layout(cpu, &rc, NULL, &hc), EPX_ERROR_INVALID_ARGUMENT, wanted);
  char cpu_message[512];
  snprintf(cpu_message, sizeof cpu_message, "%s", epx_last_error());
  EXPECT_STATUS(epx_dispatch_layout(gpu, &rg, NULL, &hg), EPX_ERROR_INVALID_ARGUMENT, wanted);
  assert_string_equal(epx_last_error(), cpu_message);
  assert_ptr_equal(hc, sentinel);
  assert_ptr_equal(hg, sentinel);
  EXPECT_OK(epx_buffer_destroy(gpu));

  /* worst_case_sizing: accepted, the route dropped, reported later. */
  c.worst_case = 1;
  gpu = make_buffer(comm, &c, r.capacity, EPX_DEVICE_CUDA, NULL);
  hg = NULL;
  EXPECT_OK(epx_dispatch_layout(gpu, &rg, NULL, &hg));
  int64_t rows = -12345;
  EXPECT_STATUS(epx_handle_recv_rows(hg, &rows), EPX_ERROR_INVALID_ARGUMENT, "worst_case_sizing");
  assert_int_equal(rows, -12345);
  assert_non_null(strstr(epx_last_error(), wanted));

  int32_t *clean = tu_alloc(4 * tk);
  memcpy(clean, r.idx, 4 * tk);
  clean[bad] = -1;
  if (kind == TWO_ERRORS) clean[10 * K + 1] = -1;
  epx_routing_t rclean = {c.T, K, clean, r.w, capacity_layout ? r.loc : NULL, c.weighting};
  hc = NULL;
  EXPECT_OK(epx_dispatch_layout(cpu, &rclean, NULL, &hc));
  int64_t N = 0, Ng = -1;
  EXPECT_OK(epx_handle_recv_rows(hc, &N));
  const int64_t *d_rows = NULL;
  EXPECT_OK(epx_handle_recv_rows_device(hg, &d_rows));
  CUDA_OK(cudaMemcpy(&Ng, d_rows, sizeof Ng, cudaMemcpyDeviceToHost));
  assert_int_equal(Ng, N);
  const size_t row_bytes = (size_t)c.H * 4, tbytes = (size_t)c.T * row_bytes, nbytes = (size_t)N * row_bytes;
  int64_t R = 0; /* worst_case_sizing: the GPU handle's rows are the buffer's bound */
  EXPECT_OK(epx_buffer_max_recv_rows(gpu, &R));
  void *x = tu_alloc(tbytes), *recv_c = tu_alloc(nbytes);
  tu_fill(&rng, c.dtype, x, c.T * c.H);
  tu_poison(recv_c, nbytes);
  void *d_x = dev_copy(x, tbytes), *d_recv = dev_alloc((size_t)R * row_bytes);
  dev_poison(d_recv, (size_t)R * row_bytes);
  EXPECT_OK(epx_dispatch(cpu, hc, x, recv_c, N));
  EXPECT_OK(epx_dispatch(gpu, hg, d_x, d_recv, R));
  CUDA_OK(cudaDeviceSynchronize());
  void *recv_g = host_copy(d_recv, nbytes);
  expect_same_bits("dispatch of a dropped bad route", &c, c.dtype, recv_g, recv_c, N * c.H);

  EXPECT_OK(epx_handle_release(hc));
  EXPECT_OK(epx_handle_release(hg));
  EXPECT_OK(epx_buffer_destroy(cpu));
  EXPECT_OK(epx_buffer_destroy(gpu));
  EXPECT_OK(epx_comm_destroy(comm));
  void *dev[] = {d_idx, d_loc, d_w, d_x, d_recv};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) CUDA_OK(cudaFree(dev[i]));
  tu_free(clean);
  tu_free(x);
  tu_free(recv_c);
  tu_free(recv_g);
  free_routing(&r);
}

static void test_invalid_routing(void **state) {
  (void)state;
  require_gpu();
  for (int kind = BAD_EXPERT; kind <= TWO_ERRORS; kind++) check_bad_routing((bad_kind_t)kind);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grid),          cmocka_unit_test(test_large),
      cmocka_unit_test(test_worst_case),    cmocka_unit_test(test_empty_batch),
      cmocka_unit_test(test_graph_capture), cmocka_unit_test(test_invalid_routing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
