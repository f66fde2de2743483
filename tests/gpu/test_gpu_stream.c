/* epx_buffer_set_stream with a live handle (epx.h, "Streams"): work enqueued
 * on the new stream, the release of the handle's device memory included, runs
 * after what was already enqueued on the old one.
 *
 * Stream A is held shut by a host function that waits for a gate a helper
 * thread opens after GATE_MS; behind the gate A has a dispatch into a
 * poisoned recv_x. The buffer then moves to stream B, which gets a combine of
 * that recv_x and the handle's release. Ordered correctly, B waits for the
 * gate (it stays busy while A is shut) and the combine reads the dispatched
 * rows, so out has the CPU backend's bits exactly; unordered, B runs at once
 * on poison and the handle's memory is freed under A's pending dispatch. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "gpu_testutil.h"
#include "../util/buffer_config.h"

enum { T = 96, E = 8, K = 2, H = 64, GATE_MS = 400 };

static atomic_int gate_open;

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void *open_gate_later(void *arg) {
  (void)arg;
  sleep_ms(GATE_MS);
  atomic_store(&gate_open, 1);
  return NULL;
}

/* Runs on the CUDA callback thread and holds stream A until the gate opens. */
static void CUDART_CB wait_for_gate(void *arg) {
  (void)arg;
  while (!atomic_load(&gate_open)) sleep_ms(1);
}

static epx_buffer_t make_buffer(epx_comm_t comm, epx_device_t device, void *stream) {
  epx_buffer_config_t c = tu_config(device, EPX_FLOAT32, H, E, K, 0);
  c.stream = stream;
  epx_buffer_t b = NULL;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  return b;
}

/* The CPU backend's out = combine(dispatch(x)), expert_out = recv_x. */
static void cpu_round_trip(const epx_routing_t *r, const float *x, float *out) {
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_t b = make_buffer(comm, EPX_DEVICE_CPU, NULL);
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(b, r, NULL, &h));
  int64_t N = 0;
  EXPECT_OK(epx_handle_recv_rows(h, &N));
  float *recv = tu_alloc(sizeof(float) * (size_t)(N * H + 1));
  EXPECT_OK(epx_dispatch(b, h, x, recv, N));
  EXPECT_OK(epx_combine(b, h, recv, out));
  tu_free(recv);
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
}

static void test_set_stream_orders_after_old_stream(void **state) {
  (void)state;
  tu_rng_t rng = {0x5eed};
  int32_t idx[T * K];
  float w[T * K];
  tu_random_routing(&rng, T, E, K, 0.0, idx, w);
  float *x = tu_alloc(sizeof(float) * T * H);
  tu_fill(&rng, EPX_FLOAT32, x, T * H);
  epx_routing_t host_routing = {T, K, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  float *want = tu_alloc(sizeof(float) * T * H);
  cpu_round_trip(&host_routing, x, want);

  cudaStream_t a, b;
  CUDA_OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_t buf = make_buffer(comm, EPX_DEVICE_CUDA, a);
  int32_t *d_idx = dev_copy(idx, sizeof idx);
  float *d_w = dev_copy(w, sizeof w), *d_x = dev_copy(x, sizeof(float) * T * H);
  epx_routing_t r = {T, K, d_idx, d_w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  EXPECT_OK(epx_dispatch_layout(buf, &r, NULL, &h)); /* synchronises A: N is on the host */
  int64_t N = 0;
  EXPECT_OK(epx_handle_recv_rows(h, &N));
  float *d_recv = dev_alloc(sizeof(float) * (size_t)(N * H));
  float *d_out = dev_alloc(sizeof(float) * T * H);
  dev_poison(d_recv, sizeof(float) * (size_t)(N * H));
  dev_poison(d_out, sizeof(float) * T * H);
  CUDA_OK(cudaDeviceSynchronize());

  atomic_store(&gate_open, 0);
  pthread_t opener;
  assert_int_equal(pthread_create(&opener, NULL, open_gate_later, NULL), 0);
  CUDA_OK(cudaLaunchHostFunc(a, wait_for_gate, NULL));
  EXPECT_OK(epx_dispatch(buf, h, d_x, d_recv, N));
  EXPECT_OK(epx_buffer_set_stream(buf, b));
  EXPECT_OK(epx_combine(buf, h, d_recv, d_out));
  EXPECT_OK(epx_handle_release(h)); /* frees the layout on B, behind A's dispatch */
  /* While A is shut, B must not finish. */
  int b_finished_early = 0;
  for (int i = 0; i < 50 && !atomic_load(&gate_open); i++) {
    cudaError_t q = cudaStreamQuery(b);
    if (q == cudaSuccess && !atomic_load(&gate_open)) b_finished_early = 1;
    else if (q != cudaErrorNotReady && q != cudaSuccess) CUDA_OK(q);
    sleep_ms(2);
  }
  CUDA_OK(cudaStreamSynchronize(b));
  assert_int_equal(pthread_join(opener, NULL), 0);
  if (b_finished_early) fail_msg("stream B finished while stream A was still shut: set_stream did not order B after A");
  float *got = host_copy(d_out, sizeof(float) * T * H);
  assert_memory_equal(got, want, sizeof(float) * T * H);

  /* Setting the stream it already has, and back to A, are fine. */
  EXPECT_OK(epx_buffer_set_stream(buf, b));
  EXPECT_OK(epx_buffer_set_stream(buf, a));
  EXPECT_OK(epx_buffer_destroy(buf));
  EXPECT_OK(epx_comm_destroy(comm));
  CUDA_OK(cudaStreamSynchronize(a));
  CUDA_OK(cudaStreamDestroy(a));
  CUDA_OK(cudaStreamDestroy(b));
  CUDA_OK(cudaFree(d_idx));
  CUDA_OK(cudaFree(d_w));
  CUDA_OK(cudaFree(d_x));
  CUDA_OK(cudaFree(d_recv));
  CUDA_OK(cudaFree(d_out));
  tu_free(got);
  tu_free(want);
  tu_free(x);
}

/* A CPU buffer has no stream to set. */
static void test_set_stream_on_cpu_buffer(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_t buf = make_buffer(comm, EPX_DEVICE_CPU, NULL);
  EXPECT_STATUS(epx_buffer_set_stream(buf, NULL), EPX_ERROR_INVALID_ARGUMENT,
                "streams are for EPX_DEVICE_CUDA buffers");
  EXPECT_OK(epx_buffer_destroy(buf));
  EXPECT_OK(epx_comm_destroy(comm));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_set_stream_orders_after_old_stream),
      cmocka_unit_test(test_set_stream_on_cpu_buffer),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
