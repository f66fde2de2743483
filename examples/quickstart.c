/*
 * quickstart.c — one MoE layer, forward and backward, on 2 ranks.
 *
 * The ranks are threads of this process (the local transport); with MPI each
 * would be a process and the comm would come from epx_comm_create_mpi. Each
 * rank routes its tokens, sends them to the experts' ranks, runs its experts
 * on the rows it received (expert e multiplies by e + 1, standing in for an
 * FFN), combines the outputs back as a weighted sum, and runs the backward
 * down to the router's logits. It prints OK when every value is what the
 * definition says, and exits 1 otherwise.
 */
#include <epx.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { RANKS = 2, TOKENS = 64, HIDDEN = 32, EXPERTS = 8, TOP_K = 2, LOCAL_EXPERTS = EXPERTS / RANKS };

#define CHECK(call)                                                          \
  do {                                                                       \
    epx_status_t status_ = (call);                                           \
    if (status_ != EPX_SUCCESS) {                                            \
      fprintf(stderr, "%s: %s\n", epx_status_string(status_), epx_last_error()); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

static epx_local_world_t world;
static int failures[RANKS];

/* Payload tensors must be 16-byte aligned; rows is never 0 here. */
static float *rows_of(int64_t rows) {
  float *p = aligned_alloc(64, (size_t)(rows + 1) * HIDDEN * sizeof(float));
  if (!p) exit(1);
  return p;
}

static void *rank_main(void *arg) {
  const int32_t rank = (int32_t)(intptr_t)arg;
  epx_comm_t comm;
  CHECK(epx_comm_create_local(world, rank, &comm));

  /* This rank's tokens x [T, H] and router logits [T, E]. */
  float *x = rows_of(TOKENS), *logits = malloc(sizeof(float) * TOKENS * EXPERTS);
  for (int t = 0; t < TOKENS; t++) {
    for (int h = 0; h < HIDDEN; h++) x[t * HIDDEN + h] = sinf(0.1f * (float)(rank * 1000 + t * HIDDEN + h));
    for (int e = 0; e < EXPERTS; e++) logits[t * EXPERTS + e] = cosf((float)(rank * 77 + t * EXPERTS + e));
  }

  /* 1. Route: softmax over the experts, the top-k of each token. */
  epx_route_config_t route = EPX_ROUTE_CONFIG_INIT;
  route.num_experts = EXPERTS;
  route.top_k = TOP_K;
  int32_t topk_idx[TOKENS * TOP_K];
  float topk_w[TOKENS * TOP_K];
  epx_route_output_t routed = {0};
  routed.topk_idx = topk_idx;
  routed.topk_w = topk_w;
  CHECK(epx_route(&route, TOKENS, logits, NULL, &routed));

  /* 2. The layer's exchange buffer (collective: every rank creates it). */
  epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
  config.dtype = EPX_FLOAT32;
  config.hidden = HIDDEN;
  config.num_experts = EXPERTS;
  config.max_top_k = TOP_K;
  config.max_tokens_per_rank = TOKENS;
  config.exchange = EPX_EXCHANGE_DEDUP; /* a token crosses to a rank once, however many of its experts live there */
  epx_buffer_t buffer;
  CHECK(epx_buffer_create(comm, &config, &buffer));

  /* 3. Dispatch: the layout (who sends what to whom) once, then the rows. */
  epx_routing_t routing = {TOKENS, TOP_K, topk_idx, topk_w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t handle;
  CHECK(epx_dispatch_layout(buffer, &routing, NULL, &handle));
  int64_t n;
  CHECK(epx_handle_recv_rows(handle, &n));
  float *recv_x = rows_of(n), *expert_out = rows_of(n);
  CHECK(epx_dispatch(buffer, handle, x, recv_x, n));

  /* 4. The experts: received rows come grouped by local expert. */
  int64_t counts[LOCAL_EXPERTS], offsets[LOCAL_EXPERTS + 1];
  CHECK(epx_handle_expert_counts(handle, counts, offsets));
  for (int e = 0; e < LOCAL_EXPERTS; e++) {
    float scale = (float)(rank * LOCAL_EXPERTS + e + 1);
    for (int64_t r = offsets[e]; r < offsets[e] + counts[e]; r++)
      for (int h = 0; h < HIDDEN; h++) expert_out[r * HIDDEN + h] = scale * recv_x[r * HIDDEN + h];
  }

  /* 5. Combine: out[t] = sum_k w[t,k] * expert_out(t,k), back on the token's rank. */
  float *out = rows_of(TOKENS);
  CHECK(epx_combine(buffer, handle, expert_out, out));

  /* 6. Backward of loss = sum(out): the same handle drives every pass. */
  float *grad_out = rows_of(TOKENS), *grad_expert_out = rows_of(n), *grad_recv_x = rows_of(n);
  float *grad_x = rows_of(TOKENS), grad_w[TOKENS * TOP_K], *grad_logits = malloc(sizeof(float) * TOKENS * EXPERTS);
  for (int i = 0; i < TOKENS * HIDDEN; i++) grad_out[i] = 1.0f;
  /* grad_w[t,k] = <grad_out[t], expert_out(t,k)>: what the router learns from */
  CHECK(epx_combine_backward(buffer, handle, grad_out, expert_out, grad_expert_out, grad_w));
  for (int e = 0; e < LOCAL_EXPERTS; e++) {
    float scale = (float)(rank * LOCAL_EXPERTS + e + 1);
    for (int64_t r = offsets[e]; r < offsets[e] + counts[e]; r++)
      for (int h = 0; h < HIDDEN; h++) grad_recv_x[r * HIDDEN + h] = scale * grad_expert_out[r * HIDDEN + h];
  }
  CHECK(epx_dispatch_backward(buffer, handle, grad_recv_x, grad_x, NULL, NULL));
  CHECK(epx_route_backward(&route, TOKENS, logits, NULL, topk_idx, grad_w, 0.0f, 0.0f, grad_logits));

  /* Every value against the definition (expert e multiplies by e + 1). */
  for (int t = 0; t < TOKENS; t++) {
    float gain = 0.0f, sum_x = 0.0f;
    for (int h = 0; h < HIDDEN; h++) sum_x += x[t * HIDDEN + h];
    for (int k = 0; k < TOP_K; k++) {
      float scale = (float)(topk_idx[t * TOP_K + k] + 1);
      gain += topk_w[t * TOP_K + k] * scale;
      failures[rank] += fabsf(grad_w[t * TOP_K + k] - scale * sum_x) > 1e-3f * (1.0f + fabsf(scale * sum_x));
    }
    for (int h = 0; h < HIDDEN; h++) {
      failures[rank] += fabsf(out[t * HIDDEN + h] - gain * x[t * HIDDEN + h]) > 1e-5f * (1.0f + gain);
      failures[rank] += fabsf(grad_x[t * HIDDEN + h] - gain) > 1e-5f * (1.0f + gain);
    }
  }

  CHECK(epx_handle_release(handle));
  CHECK(epx_buffer_destroy(buffer));
  CHECK(epx_comm_destroy(comm));
  free(x);
  free(logits);
  free(recv_x);
  free(expert_out);
  free(out);
  free(grad_out);
  free(grad_expert_out);
  free(grad_recv_x);
  free(grad_x);
  free(grad_logits);
  return NULL;
}

int main(void) {
  CHECK(epx_local_world_create(RANKS, NULL, &world));
  pthread_t threads[RANKS];
  for (intptr_t r = 0; r < RANKS; r++)
    if (pthread_create(&threads[r], NULL, rank_main, (void *)r)) return 1;
  for (int r = 0; r < RANKS; r++) pthread_join(threads[r], NULL);
  CHECK(epx_local_world_destroy(world));
  int total = 0;
  for (int r = 0; r < RANKS; r++) total += failures[r];
  printf("%s\n", total ? "FAILED" : "OK");
  return total ? 1 : 0;
}
