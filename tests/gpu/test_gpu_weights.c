/* epx_weights_backward on the CUDA backend against the CPU engine: the same
 * routing and the same per-(row, slot) gradients (each encoding its route's
 * source token and slot) on a CPU buffer and a CUDA buffer must bring back
 * the same grad_w, exactly, in every layout — with dropped routes and a token
 * without any. grad_w is poisoned first, so an unwritten slot shows. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_testutil.h"
#include "../util/buffer_config.h"

/* grad_w of one buffer: recv_routing and recv_source read back from the
 * handle, the gradient of each received (row, slot) set to an encoding of its
 * source token and expert, then epx_weights_backward. */
static void weights_back(epx_device_t device, epx_layout_t layout, int64_t T, int32_t E, int32_t K,
                         const int32_t *idx, const float *w, const int32_t *loc, int32_t capacity, float *grad_w) {
  const int64_t H = 16;
  epx_comm_t comm = NULL;
  epx_buffer_t buf = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t c = tu_config(device, EPX_FLOAT32, H, E, K, 0);
  c.layout = layout;
  c.capacity = capacity;
  c.expert_alignment = 4;
  EXPECT_OK(epx_buffer_create(comm, &c, &buf));
  size_t tk = sizeof(int32_t) * (size_t)(T * K);
  const int on_gpu = device == EPX_DEVICE_CUDA;
  const int32_t *r_idx = on_gpu ? dev_copy(idx, tk) : idx;
  const float *r_w = on_gpu ? dev_copy(w, tk) : w;
  const int32_t *r_loc = on_gpu ? dev_copy(loc, tk) : loc;
  epx_routing_t r = {T, K, r_idx, r_w, layout == EPX_LAYOUT_CAPACITY ? r_loc : NULL, EPX_WEIGHTS_NONE};
  EXPECT_OK(epx_dispatch_layout(buf, &r, NULL, &h));
  int64_t N = 0;
  EXPECT_OK(epx_handle_recv_rows(h, &N));
  const int32_t slots = layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  size_t n_rs = (size_t)(N * slots) + 1;
  int32_t *src_token = calloc((size_t)N + 1, sizeof(int32_t)), *recv_expert = calloc(n_rs, sizeof(int32_t));
  float *grad_recv_w = calloc(n_rs, sizeof(float));
  if (on_gpu) {
    int32_t *d_tok = NULL, *d_exp = NULL;
    CUDA_OK(cudaMalloc((void **)&d_tok, sizeof(int32_t) * ((size_t)N + 1)));
    CUDA_OK(cudaMalloc((void **)&d_exp, sizeof(int32_t) * n_rs));
    EXPECT_OK(epx_handle_recv_source(h, NULL, d_tok));
    EXPECT_OK(epx_handle_recv_routing(h, d_exp, NULL));
    CUDA_OK(cudaMemcpy(src_token, d_tok, sizeof(int32_t) * (size_t)N, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(recv_expert, d_exp, sizeof(int32_t) * (size_t)(N * slots), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(d_tok));
    CUDA_OK(cudaFree(d_exp));
  } else {
    EXPECT_OK(epx_handle_recv_source(h, NULL, src_token));
    EXPECT_OK(epx_handle_recv_routing(h, recv_expert, NULL));
  }
  for (int64_t i = 0; i < N * slots; i++) {
    int32_t e = recv_expert[i];
    grad_recv_w[i] = e >= 0 ? (float)(src_token[i / slots] * 1000 + e + 1) : -7.0f;
  }
  size_t gw_bytes = sizeof(float) * (size_t)(T * K);
  if (on_gpu) {
    float *d_grad_recv_w = dev_copy(grad_recv_w, sizeof(float) * n_rs), *d_grad_w = NULL;
    CUDA_OK(cudaMalloc((void **)&d_grad_w, gw_bytes + 16));
    CUDA_OK(cudaMemset(d_grad_w, 0xA5, gw_bytes + 16));
    EXPECT_OK(epx_weights_backward(buf, h, d_grad_recv_w, d_grad_w));
    CUDA_OK(cudaMemcpy(grad_w, d_grad_w, gw_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(d_grad_recv_w));
    CUDA_OK(cudaFree(d_grad_w));
    CUDA_OK(cudaFree((void *)r_idx));
    CUDA_OK(cudaFree((void *)r_w));
    CUDA_OK(cudaFree((void *)r_loc));
  } else {
    tu_poison(grad_w, gw_bytes);
    EXPECT_OK(epx_weights_backward(buf, h, grad_recv_w, grad_w));
  }
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(buf));
  EXPECT_OK(epx_comm_destroy(comm));
  free(src_token);
  free(recv_expert);
  free(grad_recv_w);
}

static void test_cuda_equals_cpu(void **state) {
  (void)state;
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_RANK_MAJOR, EPX_LAYOUT_CAPACITY};
  const int32_t ks[] = {1, 3, 8};
  for (int li = 0; li < 3; li++)
    for (int ki = 0; ki < 3; ki++) {
      const int64_t T = 333;
      const int32_t E = 16, K = ks[ki], capacity = 40;
      tu_rng_t rng = {0xabc00u + (uint64_t)(li * 3 + ki)};
      int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T * K)), *loc = malloc(sizeof(int32_t) * (size_t)(T * K));
      float *w = malloc(sizeof(float) * (size_t)(T * K));
      float *cpu = malloc(sizeof(float) * (size_t)(T * K)), *gpu = malloc(sizeof(float) * (size_t)(T * K));
      tu_random_routing(&rng, T, E, K, 1.0, idx, w);
      for (int32_t k = 0; k < K; k++) idx[(T - 1) * K + k] = -1; /* a token without routes */
      int32_t fill[16] = {0};
      for (int64_t i = 0; i < T * K; i++) {
        loc[i] = idx[i] >= 0 ? fill[idx[i]]++ : -1;
        if (loc[i] >= capacity) idx[i] = loc[i] = -1; /* dropped */
      }
      weights_back(EPX_DEVICE_CPU, layouts[li], T, E, K, idx, w, loc, capacity, cpu);
      weights_back(EPX_DEVICE_CUDA, layouts[li], T, E, K, idx, w, loc, capacity, gpu);
      int64_t differ = 0;
      for (int64_t i = 0; i < T * K; i++) differ += memcmp(&cpu[i], &gpu[i], sizeof(float)) != 0;
      if (differ) fail_msg("layout %d, K=%d: %lld of %lld grad_w differ", (int)layouts[li], K, (long long)differ,
                           (long long)(T * K));
      free(idx);
      free(loc);
      free(w);
      free(cpu);
      free(gpu);
    }
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_cuda_equals_cpu)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
