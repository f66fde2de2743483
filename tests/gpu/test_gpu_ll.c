/* The low-latency decode mode on one GPU (epx.h, "Low-latency decode"):
 * for token counts 0, 1, 7, 128 and 256, top-k 1 to 8, E 8 to 256, bf16 and
 * f32, every received row, count, source and routing entry and the combine
 * equal the CPU backend's bit for bit (whose low-latency calls equal its
 * normal exchange, tests/test_ll.c); two phases equal one call; the calls
 * captured once in a CUDA graph replay with new token counts written to
 * device memory, each replay equal to the CPU on that count; oversize steps,
 * backward and a fifth live handle are refused; the fp8 dispatch (quantized
 * on the way or pre-quantized) equals the CPU's, rows and scales. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_testutil.h"

enum { MAXT = 256 };

typedef struct {
  int32_t E, K;
  int64_t H;
  epx_dtype_t dtype;
} shape_t;

/* A step's routing and tokens on the host (T rows of MAXT allocated). */
typedef struct {
  int32_t idx[MAXT * 8];
  float w[MAXT * 8];
  void *x; /* [MAXT, H] */
} step_t;

static void step_fill(step_t *s, const shape_t *c, uint64_t seed) {
  tu_rng_t rng = {seed};
  tu_random_routing(&rng, MAXT, c->E, c->K, 0.0, s->idx, s->w);
  for (int i = 0; i < MAXT * c->K; i += 13) s->idx[i] = -1;
  s->x = tu_alloc((size_t)(MAXT * c->H) * epx_dtype_size(c->dtype));
  tu_fill(&rng, c->dtype, s->x, MAXT * c->H);
}

static epx_buffer_config_t ll_config(const shape_t *c, epx_device_t device) {
  epx_buffer_config_t b = EPX_BUFFER_CONFIG_INIT;
  b.device = device, b.dtype = c->dtype, b.hidden = c->H, b.num_experts = c->E, b.max_top_k = c->K;
  b.low_latency = 1;
  return b;
}

/* One step's results on the host. */
typedef struct {
  void *recv, *out;
  int32_t count[256], src_token[256 * MAXT], expert[256 * MAXT];
  float weight[256 * MAXT];
} result_t;

static size_t rows_bytes(const shape_t *c, int64_t rows) { return (size_t)(rows * c->H) * epx_dtype_size(c->dtype); }

/* The expert: recv rows times 2 (exact), the same in both backends. */
static void expert_host(const shape_t *c, const void *recv, void *out, int64_t rows) {
  float *f = tu_alloc(sizeof(float) * (size_t)c->H);
  for (int64_t r = 0; r < rows; r++) {
    epx_convert(EPX_FLOAT32, f, c->dtype, (const char *)recv + rows_bytes(c, r), c->H);
    for (int64_t h = 0; h < c->H; h++) f[h] *= 2.0f;
    epx_convert(c->dtype, (char *)out + rows_bytes(c, r), EPX_FLOAT32, f, c->H);
  }
  tu_free(f);
}

static void cpu_step(const shape_t *c, const step_t *s, int64_t T, result_t *res) {
  epx_comm_t comm = NULL;
  epx_buffer_t b = NULL;
  epx_handle_t h = NULL;
  const int64_t N = (int64_t)c->E * MAXT;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t cfg = ll_config(c, EPX_DEVICE_CPU);
  EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
  epx_routing_t r = {T, c->K, s->idx, s->w, NULL, EPX_WEIGHTS_IN_COMBINE};
  res->recv = tu_alloc(rows_bytes(c, N));
  res->out = tu_alloc(rows_bytes(c, MAXT));
  EXPECT_OK(epx_ll_dispatch(b, &r, NULL, s->x, res->recv, res->count, &h));
  EXPECT_OK(epx_handle_recv_source(h, NULL, res->src_token));
  EXPECT_OK(epx_handle_recv_routing(h, res->expert, res->weight));
  void *expert_out = tu_alloc(rows_bytes(c, N));
  expert_host(c, res->recv, expert_out, N);
  EXPECT_OK(epx_ll_combine(b, h, expert_out, res->out));
  tu_free(expert_out);
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
}

/* The GPU's results against the CPU's for a step of T tokens. */
static void compare(const shape_t *c, const result_t *want, const result_t *got, int64_t T, const char *what) {
  for (int32_t e = 0; e < c->E; e++) {
    if (got->count[e] != want->count[e])
      fail_msg("%s: expert %d has %d rows, the CPU %d (T %lld)", what, e, got->count[e], want->count[e], (long long)T);
    for (int32_t i = 0; i < MAXT; i++) {
      int64_t row = (int64_t)e * MAXT + i;
      if (got->src_token[row] != want->src_token[row] || got->expert[row] != want->expert[row] ||
          (i < want->count[e] && got->weight[row] != want->weight[row]))
        fail_msg("%s: row %lld's source or routing differs from the CPU's (T %lld)", what, (long long)row,
                 (long long)T);
      if (i < want->count[e] &&
          memcmp((const char *)got->recv + rows_bytes(c, row), (const char *)want->recv + rows_bytes(c, row),
                 rows_bytes(c, 1)))
        fail_msg("%s: row %lld differs from the CPU's (T %lld)", what, (long long)row, (long long)T);
    }
  }
  if (memcmp(got->out, want->out, rows_bytes(c, T)))
    fail_msg("%s: combine differs from the CPU's (T %lld)", what, (long long)T);
}

/* Device tensors of one GPU step. */
typedef struct {
  int32_t *idx, *count, *tokens;
  float *w;
  void *x, *recv, *expert_out, *out;
} dev_t_;

static void dev_open(dev_t_ *d, const shape_t *c, const step_t *s) {
  const int64_t N = (int64_t)c->E * MAXT;
  d->idx = dev_copy(s->idx, sizeof(int32_t) * MAXT * (size_t)c->K);
  d->w = dev_copy(s->w, sizeof(float) * MAXT * (size_t)c->K);
  d->x = dev_copy(s->x, rows_bytes(c, MAXT));
  d->recv = dev_alloc(rows_bytes(c, N));
  d->expert_out = dev_alloc(rows_bytes(c, N));
  d->out = dev_alloc(rows_bytes(c, MAXT));
  d->count = dev_alloc(sizeof(int32_t) * (size_t)c->E);
  d->tokens = dev_alloc(sizeof(int32_t));
}

static void dev_close(dev_t_ *d) {
  void *p[] = {d->idx, d->w, d->x, d->recv, d->expert_out, d->out, d->count, d->tokens};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) CUDA_OK(cudaFree(p[i]));
}

/* The GPU step's results to the host; expert_out from the CPU's recv (the
 * same rows). */
static void gpu_results(const shape_t *c, epx_handle_t h, const dev_t_ *d, result_t *res) {
  const int64_t N = (int64_t)c->E * MAXT;
  int32_t *src = dev_alloc(sizeof(int32_t) * (size_t)N), *expert = dev_alloc(sizeof(int32_t) * (size_t)N);
  float *weight = dev_alloc(sizeof(float) * (size_t)N);
  EXPECT_OK(epx_handle_recv_source(h, NULL, src));
  EXPECT_OK(epx_handle_recv_routing(h, expert, weight));
  CUDA_OK(cudaDeviceSynchronize());
  res->recv = host_copy(d->recv, rows_bytes(c, N));
  to_host(res->count, d->count, sizeof(int32_t) * (size_t)c->E);
  to_host(res->src_token, src, sizeof(int32_t) * (size_t)N);
  to_host(res->expert, expert, sizeof(int32_t) * (size_t)N);
  to_host(res->weight, weight, sizeof(float) * (size_t)N);
  CUDA_OK(cudaFree(src));
  CUDA_OK(cudaFree(expert));
  CUDA_OK(cudaFree(weight));
}

static void run_shape(const shape_t *c, uint64_t seed) {
  static const int64_t counts[] = {0, 1, 7, 128, 256};
  step_t *s = tu_alloc(sizeof *s);
  step_fill(s, c, seed);
  epx_comm_t comm = NULL;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t cfg = ll_config(c, EPX_DEVICE_CUDA);
  EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
  dev_t_ d;
  dev_open(&d, c, s);
  const int64_t N = (int64_t)c->E * MAXT;
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    const int64_t T = counts[i];
    result_t *want = tu_alloc(sizeof *want), *got = tu_alloc(sizeof *got);
    cpu_step(c, s, T, want);
    for (int two_phase = 0; two_phase < 2; two_phase++) {
      epx_routing_t r = {T, c->K, d.idx, d.w, NULL, EPX_WEIGHTS_IN_COMBINE};
      epx_handle_t h = NULL;
      dev_poison(d.recv, rows_bytes(c, N));
      if (two_phase) {
        EXPECT_OK(epx_ll_dispatch_send(b, &r, NULL, d.x, d.recv, d.count, &h));
        EXPECT_OK(epx_ll_complete(b, h));
      } else {
        EXPECT_OK(epx_ll_dispatch(b, &r, NULL, d.x, d.recv, d.count, &h));
      }
      gpu_results(c, h, &d, got);
      /* The expert's outputs of the CPU's rows (the GPU's equal them where
       * combine reads). */
      void *e_host = tu_alloc(rows_bytes(c, N));
      expert_host(c, want->recv, e_host, N);
      CUDA_OK(cudaMemcpy(d.expert_out, e_host, rows_bytes(c, N), cudaMemcpyHostToDevice));
      tu_free(e_host);
      if (two_phase) {
        EXPECT_OK(epx_ll_combine_send(b, h, d.expert_out, d.out));
        EXPECT_OK(epx_ll_complete(b, h));
      } else {
        EXPECT_OK(epx_ll_combine(b, h, d.expert_out, d.out));
      }
      CUDA_OK(cudaDeviceSynchronize());
      got->out = host_copy(d.out, rows_bytes(c, MAXT));
      compare(c, want, got, T, two_phase ? "two phases" : "one call");
      tu_free(got->recv);
      tu_free(got->out);
      EXPECT_OK(epx_handle_release(h));
    }
    TU_FREE_ALL(want->recv, want->out, want, got);
  }
  dev_close(&d);
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
  tu_free(s->x);
  tu_free(s);
}

static void test_matches_cpu(void **state) {
  (void)state;
  static const shape_t shapes[] = {{8, 1, 64, EPX_BFLOAT16},   {8, 2, 128, EPX_BFLOAT16},
                                   {64, 4, 256, EPX_BFLOAT16}, {256, 8, 128, EPX_BFLOAT16},
                                   {32, 3, 64, EPX_FLOAT32},   {64, 8, 2048, EPX_BFLOAT16}};
  int n = quick() ? 2 : (int)(sizeof shapes / sizeof shapes[0]);
  for (int i = 0; i < n; i++) run_shape(&shapes[i], 0x77aa00u + (uint64_t)i);
}

/* Captured once with the count in device memory, replayed with new counts. */
static void test_graph_replay(void **state) {
  (void)state;
  const shape_t c = {64, 8, 256, EPX_BFLOAT16};
  step_t *s = tu_alloc(sizeof *s);
  step_fill(s, &c, 0x9a9a);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  epx_comm_t comm = NULL;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t cfg = ll_config(&c, EPX_DEVICE_CUDA);
  cfg.stream = stream;
  EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
  dev_t_ d;
  dev_open(&d, &c, s);
  const int64_t N = (int64_t)c.E * MAXT;
  /* No expert between the calls: combine reads recv_x itself (the CPU step
   * it is compared with does the same). */
  epx_routing_t r = {MAXT, c.K, d.idx, d.w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_OK(epx_ll_dispatch_send(b, &r, d.tokens, d.x, d.recv, d.count, &h));
  EXPECT_OK(epx_ll_complete(b, h));
  EXPECT_OK(epx_ll_combine_send(b, h, d.recv, d.out));
  EXPECT_OK(epx_ll_complete(b, h));
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  static const int32_t counts[] = {5, 256, 0, 1, 77};
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    CUDA_OK(cudaMemcpyAsync(d.tokens, &counts[i], sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemsetAsync(d.out, 0xA5, rows_bytes(&c, MAXT), stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    /* The CPU on that count, with expert_out = recv_x. */
    epx_comm_t cc = NULL;
    epx_buffer_t cb = NULL;
    epx_handle_t ch = NULL;
    EXPECT_OK(epx_comm_create_self(&cc));
    epx_buffer_config_t ccfg = ll_config(&c, EPX_DEVICE_CPU);
    EXPECT_OK(epx_buffer_create(cc, &ccfg, &cb));
    epx_routing_t cr = {counts[i], c.K, s->idx, s->w, NULL, EPX_WEIGHTS_IN_COMBINE};
    void *recv = tu_alloc(rows_bytes(&c, N)), *out = tu_alloc(rows_bytes(&c, MAXT));
    int32_t want_count[64], got_count[64];
    EXPECT_OK(epx_ll_dispatch(cb, &cr, NULL, s->x, recv, want_count, &ch));
    EXPECT_OK(epx_ll_combine(cb, ch, recv, out));
    to_host(got_count, d.count, sizeof got_count);
    assert_memory_equal(got_count, want_count, sizeof got_count);
    void *got_out = host_copy(d.out, rows_bytes(&c, MAXT));
    assert_memory_equal(got_out, out, rows_bytes(&c, counts[i]));
    /* Rows past the count: zeros (the handle's T is the arrays' rows). */
    for (size_t j = rows_bytes(&c, counts[i]); j < rows_bytes(&c, MAXT); j++) assert_int_equal(((char *)got_out)[j], 0);
    TU_FREE_ALL(got_out, recv, out);
    EXPECT_OK(epx_handle_release(ch));
    EXPECT_OK(epx_buffer_destroy(cb));
    EXPECT_OK(epx_comm_destroy(cc));
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  EXPECT_OK(epx_handle_release(h));
  dev_close(&d);
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
  CUDA_OK(cudaStreamDestroy(stream));
  tu_free(s->x);
  tu_free(s);
}

/* One fp8 dispatch (quantize: x of the dtype, else pre-quantized) of T
 * tokens on `device`: the rows, scales and counts on the host. */
static void fp8_step(const shape_t *c, epx_device_t device, const step_t *s, const void *xq, const void *xs,
                     int quantize, int64_t T, uint8_t *q, uint8_t *sc, int32_t *count, size_t SB) {
  const int64_t N = (int64_t)c->E * MAXT;
  const int cuda = device == EPX_DEVICE_CUDA;
  epx_comm_t comm = NULL;
  epx_buffer_t b = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t cfg = ll_config(c, device);
  cfg.fp8_format = EPX_FP8_E4M3_F32_128;
  EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
  const size_t xb = rows_bytes(c, MAXT);
  void *x = quantize ? (cuda ? dev_copy(s->x, xb) : s->x) : (cuda ? dev_copy(xq, (size_t)(MAXT * c->H)) : (void *)xq);
  void *xsc = quantize ? NULL : cuda ? dev_copy(xs, MAXT * SB) : (void *)xs;
  int32_t *idx = cuda ? dev_copy(s->idx, sizeof s->idx) : (int32_t *)s->idx;
  float *w = cuda ? dev_copy(s->w, sizeof s->w) : (float *)s->w;
  uint8_t *rq = cuda ? dev_alloc((size_t)(N * c->H)) : q, *rs = cuda ? dev_alloc((size_t)N * SB) : sc;
  int32_t *rc = cuda ? dev_alloc(sizeof(int32_t) * (size_t)c->E) : count;
  epx_routing_t r = {T, c->K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  EXPECT_OK(epx_ll_dispatch_fp8(b, &r, NULL, x, xsc, rq, rs, rc, &h));
  if (cuda) {
    CUDA_OK(cudaDeviceSynchronize());
    to_host(q, rq, (size_t)(N * c->H));
    to_host(sc, rs, (size_t)N * SB);
    to_host(count, rc, sizeof(int32_t) * (size_t)c->E);
    void *p[] = {rq, rs, rc, idx, w, x, xsc};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
      if (p[i]) CUDA_OK(cudaFree(p[i]));
  }
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
}

/* epx_ll_dispatch_fp8 on one GPU (quantized on the way and pre-quantized)
 * against the CPU's: counts, and every row's e4m3 bytes and scales. */
static void test_fp8_matches_cpu(void **state) {
  (void)state;
  const shape_t c = {16, 4, 256, EPX_BFLOAT16};
  step_t *s = tu_alloc(sizeof *s);
  step_fill(s, &c, 0xf8f8);
  int64_t cols = 0;
  size_t entry = 0;
  EXPECT_OK(epx_fp8_scale_shape(EPX_FP8_E4M3_F32_128, c.H, &cols, &entry));
  const size_t SB = (size_t)cols * entry;
  const int64_t N = (int64_t)c.E * MAXT;
  uint8_t *xq = tu_alloc((size_t)(MAXT * c.H)), *xs = tu_alloc(MAXT * SB);
  EXPECT_OK(epx_quantize(EPX_FP8_E4M3_F32_128, c.dtype, MAXT, c.H, s->x, xq, xs));
  static const int64_t counts[] = {0, 1, 7, 256};
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
    for (int quantize = 0; quantize < 2; quantize++) {
      uint8_t *q[2], *sc[2];
      int32_t count[2][16];
      for (int g = 0; g < 2; g++) {
        q[g] = tu_alloc((size_t)(N * c.H)), sc[g] = tu_alloc((size_t)N * SB);
        fp8_step(&c, g ? EPX_DEVICE_CUDA : EPX_DEVICE_CPU, s, xq, xs, quantize, counts[i], q[g], sc[g], count[g], SB);
      }
      assert_memory_equal(count[1], count[0], sizeof count[0]);
      for (int32_t e = 0; e < c.E; e++)
        for (int32_t j = 0; j < count[0][e]; j++) {
          const int64_t row = (int64_t)e * MAXT + j;
          if (memcmp(q[1] + row * c.H, q[0] + row * c.H, (size_t)c.H) || memcmp(sc[1] + row * SB, sc[0] + row * SB, SB))
            fail_msg("fp8 (quantize %d, T %lld): row %lld or its scales differ from the CPU's", quantize,
                     (long long)counts[i], (long long)row);
        }
      for (int g = 0; g < 2; g++) tu_free(q[g]), tu_free(sc[g]);
    }
  TU_FREE_ALL(xq, xs, s->x, s);
}

static void test_refusals(void **state) {
  (void)state;
  const shape_t c = {8, 2, 64, EPX_BFLOAT16};
  step_t *s = tu_alloc(sizeof *s);
  step_fill(s, &c, 0x5151);
  epx_comm_t comm = NULL;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t cfg = ll_config(&c, EPX_DEVICE_CUDA);
  EXPECT_OK(epx_buffer_create(comm, &cfg, &b));
  dev_t_ d;
  dev_open(&d, &c, s);
  epx_routing_t r = {MAXT + 1, c.K, d.idx, d.w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h[5] = {0};
  EXPECT_STATUS(epx_ll_dispatch(b, &r, NULL, d.x, d.recv, d.count, &h[0]), EPX_ERROR_CAPACITY_EXCEEDED,
                "max_tokens_per_rank 256");
  r.num_tokens = 16;
  for (int i = 0; i < 4; i++) EXPECT_OK(epx_ll_dispatch(b, &r, NULL, d.x, d.recv, d.count, &h[i]));
  EXPECT_STATUS(epx_ll_dispatch(b, &r, NULL, d.x, d.recv, d.count, &h[4]), EPX_ERROR_BUSY, "release one");
  EXPECT_STATUS(epx_combine_backward(b, h[0], d.out, d.recv, d.recv, NULL), EPX_ERROR_UNSUPPORTED, "no backward");
  EXPECT_STATUS(epx_dispatch_backward(b, h[0], d.recv, d.out, NULL, NULL), EPX_ERROR_UNSUPPORTED, "no backward");
  EXPECT_STATUS(epx_combine(b, h[0], d.recv, d.out), EPX_ERROR_UNSUPPORTED, "epx_ll_combine");
  for (int i = 0; i < 4; i++) EXPECT_OK(epx_handle_release(h[i]));
  EXPECT_OK(epx_ll_dispatch(b, &r, NULL, d.x, d.recv, d.count, &h[4]));
  EXPECT_OK(epx_handle_release(h[4]));
  dev_close(&d);
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
  tu_free(s->x);
  tu_free(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_matches_cpu),
      cmocka_unit_test(test_graph_replay),
      cmocka_unit_test(test_fp8_matches_cpu),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
