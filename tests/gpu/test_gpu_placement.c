/* Expert placement on a CUDA buffer (epx.h, "Expert placement and
 * replicas"): the contiguous map given explicitly is accepted and moves
 * the CPU backend's bits (dispatch and combine, one GPU); any other
 * placement (replicas, experts moved, the caller's replica rule) is refused
 * at epx_buffer_create naming config.placement — never a wrong result —
 * and so are the load counts, until the kernels adopt the table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_testutil.h"
#include "../util/buffer_config.h"

enum { T = 64, E = 16, K = 4, H = 64 };

static epx_buffer_t make(epx_comm_t comm, epx_device_t device, const epx_placement_t *pl, epx_status_t want) {
  epx_buffer_config_t c = tu_config(device, EPX_BFLOAT16, H, E, K, T);
  c.placement = pl;
  epx_buffer_t b = NULL;
  if (want == EPX_SUCCESS) EXPECT_OK(epx_buffer_create(comm, &c, &b));
  else EXPECT_STATUS(epx_buffer_create(comm, &c, &b), want, "config.placement");
  return b;
}

/* Dispatch then combine of a fixed routing: recv rows and out, on the host. */
static void run(epx_comm_t comm, epx_device_t device, const epx_placement_t *pl, const int32_t *idx, const float *w,
                const uint16_t *x, uint16_t *recv, int64_t *N, uint16_t *out) {
  epx_buffer_t b = make(comm, device, pl, EPX_SUCCESS);
  int gpu = device == EPX_DEVICE_CUDA;
  size_t tk = sizeof(int32_t) * T * K, row = 2 * H;
  const void *ri = gpu ? dev_copy(idx, tk) : idx, *rw = gpu ? dev_copy(w, tk) : w, *rx = gpu ? dev_copy(x, T * row) : x;
  epx_routing_t r = {T, K, ri, rw, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, &r, NULL, &h));
  EXPECT_OK(epx_handle_recv_rows(h, N));
  void *rr = gpu ? dev_alloc((size_t)(*N + 1) * row) : recv, *ro = gpu ? dev_alloc(T * row) : out;
  EXPECT_OK(epx_dispatch(b, h, rx, rr, *N));
  EXPECT_OK(epx_combine(b, h, rr, ro));
  if (gpu) {
    CUDA_OK(cudaDeviceSynchronize());
    to_host(recv, rr, (size_t)*N * row);
    to_host(out, ro, T * row);
    void *device_memory[] = {(void *)ri, (void *)rw, (void *)rx, rr, ro};
    for (size_t i = 0; i < sizeof device_memory / sizeof device_memory[0]; i++) CUDA_OK(cudaFree(device_memory[i]));
  }
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
}

static void test_gpu_placement(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  tu_rng_t rng = {3};
  static int32_t idx[T * K];
  static float w[T * K];
  static uint16_t x[T * H], recv_cpu[T * K * H], recv_gpu[T * K * H], out_cpu[T * H], out_gpu[T * H];
  tu_random_routing(&rng, T, E, K, 1.0, idx, w);
  tu_fill(&rng, EPX_BFLOAT16, x, T * H);
  int32_t ident[E], p2l[E + 4];
  for (int32_t e = 0; e < E; e++) ident[e] = e, p2l[e] = e;
  for (int32_t i = 0; i < 4; i++) p2l[E + i] = i;
  epx_placement_t contiguous = {E, ident, NULL, EPX_REPLICA_ROUND_ROBIN};
  int64_t n_cpu = 0, n_gpu = 0;
  run(comm, EPX_DEVICE_CPU, &contiguous, idx, w, x, recv_cpu, &n_cpu, out_cpu);
  run(comm, EPX_DEVICE_CUDA, &contiguous, idx, w, x, recv_gpu, &n_gpu, out_gpu);
  assert_int_equal(n_cpu, n_gpu);
  assert_memory_equal(recv_cpu, recv_gpu, (size_t)n_cpu * 2 * H);
  assert_memory_equal(out_cpu, out_gpu, sizeof out_cpu);
  /* refused: replicas, a permutation, the caller's rule */
  epx_placement_t replicated = {E + 4, p2l, NULL, EPX_REPLICA_ROUND_ROBIN};
  make(comm, EPX_DEVICE_CUDA, &replicated, EPX_ERROR_UNSUPPORTED);
  int32_t perm[E];
  for (int32_t e = 0; e < E; e++) perm[e] = (e + 1) % E;
  epx_placement_t permuted = {E, perm, NULL, EPX_REPLICA_ROUND_ROBIN};
  make(comm, EPX_DEVICE_CUDA, &permuted, EPX_ERROR_UNSUPPORTED);
  epx_placement_t caller = {E, ident, NULL, EPX_REPLICA_CALLER};
  make(comm, EPX_DEVICE_CUDA, &caller, EPX_ERROR_UNSUPPORTED);
  epx_buffer_t b = make(comm, EPX_DEVICE_CUDA, NULL, EPX_SUCCESS);
  int64_t load[E];
  EXPECT_STATUS(epx_buffer_expert_load(b, load, 0), EPX_ERROR_UNSUPPORTED, "on the device");
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_gpu_placement)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
