/* The one-GPU fp8 dispatch against the CPU backend: test_fp8.c's scenes at
 * one rank (every format x layout x exchange, pre-quantized and quantized
 * on the way, NaN and infinities among the inputs, hidden 7168, top-22 of
 * 512), the same config on a CPU and a CUDA buffer, the same routing and
 * inputs; the received e4m3 rows and scales must be the same bytes (the
 * GPU quantizer is core/fp8.h's formulas), every output poisoned first so
 * an unwritten row or scale shows. EPX_GPU_TEST_QUICK=1 runs every third
 * scene (compute-sanitizer). */
#include <cuda_runtime_api.h>

#define FP8_SCENE_ONLY
#include "../test_fp8.c"
#include "gpu_testutil.h"

/* The CPU's received bytes of the scene: recv rows and scales, host. */
static void cpu_dispatch(const fp8_scene_t *s, epx_comm_t comm, int64_t *N, uint8_t **q, uint8_t **sc) {
  epx_buffer_t b;
  epx_handle_t h;
  EXPECT_OK(scene_buffer(s, EPX_DEVICE_CPU, comm, &b));
  epx_weighting_t weighting = s->layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE;
  epx_routing_t routing = {s->T, s->K, s->idx[0], s->w[0], s->layout == EPX_LAYOUT_CAPACITY ? s->loc[0] : NULL,
                           weighting};
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  EXPECT_OK(epx_handle_recv_rows(h, N));
  *q = tu_alloc((size_t)((*N + 1) * s->H)), *sc = tu_alloc((size_t)((*N + 1) * s->scale_bytes));
  if (s->quantize) EXPECT_OK(epx_dispatch_quantize(b, h, s->x[0], *q, *sc, *N));
  else EXPECT_OK(epx_dispatch_fp8(b, h, s->x_q[0], s->x_s[0], *q, *sc, *N));
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
}

static void gpu_scene(const fp8_scene_t *s, epx_comm_t comm) {
  int64_t N = 0, n = 0;
  uint8_t *want_q, *want_s;
  cpu_dispatch(s, comm, &N, &want_q, &want_s);
  const size_t tk = (size_t)(s->T * s->K) * 4 + 4, q_bytes = (size_t)((N + 1) * s->H),
               s_bytes = (size_t)((N + 1) * s->scale_bytes);
  const size_t x_bytes = (size_t)(s->T * s->H + 8) * epx_dtype_size(s->dtype);
  void *d_idx = dev_copy(s->idx[0], tk), *d_w = dev_copy(s->w[0], tk), *d_loc = dev_copy(s->loc[0], tk);
  void *d_x = dev_copy(s->x[0], x_bytes), *d_xq = dev_copy(s->x_q[0], (size_t)(s->T * s->H + 16));
  void *d_xs = dev_copy(s->x_s[0], (size_t)(s->T * s->scale_bytes + 16));
  void *d_q = dev_alloc(q_bytes), *d_s = dev_alloc(s_bytes);
  dev_poison(d_q, q_bytes), dev_poison(d_s, s_bytes);
  epx_buffer_t b;
  epx_handle_t h;
  EXPECT_OK(scene_buffer(s, EPX_DEVICE_CUDA, comm, &b));
  epx_weighting_t weighting = s->layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE;
  epx_routing_t routing = {s->T, s->K, d_idx, d_w, s->layout == EPX_LAYOUT_CAPACITY ? d_loc : NULL, weighting};
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  EXPECT_OK(epx_handle_recv_rows(h, &n));
  assert_int_equal(n, N);
  if (s->quantize) EXPECT_OK(epx_dispatch_quantize(b, h, d_x, d_q, d_s, N));
  else EXPECT_OK(epx_dispatch_fp8(b, h, d_xq, d_xs, d_q, d_s, N));
  CUDA_OK(cudaDeviceSynchronize());
  uint8_t *got_q = host_copy(d_q, q_bytes), *got_s = host_copy(d_s, s_bytes);
  char d[256];
  fp8_describe(s, d, sizeof d);
  for (int64_t i = 0; i < N; i++) {
    if (memcmp(got_q + i * s->H, want_q + i * s->H, (size_t)s->H))
      fail_msg("[%s] recv row %lld: the GPU's e4m3 bytes differ from the CPU's", d, (long long)i);
    if (memcmp(got_s + i * s->scale_bytes, want_s + i * s->scale_bytes, (size_t)s->scale_bytes))
      fail_msg("[%s] recv row %lld: the GPU's scales differ from the CPU's", d, (long long)i);
  }
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  void *dev[] = {d_idx, d_w, d_loc, d_x, d_xq, d_xs, d_q, d_s};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) CUDA_OK(cudaFree(dev[i]));
  tu_free(want_q), tu_free(want_s), tu_free(got_q), tu_free(got_s);
}

static void test_gpu_fp8_matches_cpu(void **state) {
  (void)state;
  static fp8_scene_t scenes[64];
  int n = fp8_scenes(scenes, 1);
  epx_comm_t comm;
  EXPECT_OK(epx_comm_create_self(&comm));
  for (int i = 0; i < n; i++) {
    if (quick() && i % 3) continue;
    fp8_scene_t *s = &scenes[i];
    assert_int_equal(fp8_scene_build(s), 0);
    assert_int_equal(fp8_scene_rank(comm, 0, s), 0); /* the CPU side is itself right */
    gpu_scene(s, comm);
    fp8_scene_free(s);
  }
  EXPECT_OK(epx_comm_destroy(comm));
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_gpu_fp8_matches_cpu)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
