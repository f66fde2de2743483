#include "testutil.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"

uint64_t tu_next(tu_rng_t *rng) {
  uint64_t z = (rng->state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double tu_uniform(tu_rng_t *rng) { return (double)(tu_next(rng) >> 11) * (1.0 / 9007199254740992.0); }

float tu_normal(tu_rng_t *rng) {
  double u1 = tu_uniform(rng) + 1e-300, u2 = tu_uniform(rng);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

int32_t tu_below(tu_rng_t *rng, int32_t n) { return (int32_t)(tu_uniform(rng) * n); }

void tu_fill(tu_rng_t *rng, epx_dtype_t dtype, void *data, int64_t n) {
  for (int64_t i = 0; i < n; i++) epx_store(dtype, data, i, (float)(2.0 * tu_uniform(rng) - 1.0));
}

void tu_poison(void *data, size_t bytes) { memset(data, 0xA5, bytes); }

void tu_random_routing(tu_rng_t *rng, int64_t T, int32_t E, int32_t K, double zipf,
                       int32_t *topk_idx, float *topk_w) {
  double *cdf = malloc(sizeof(double) * (size_t)E);
  double total = 0;
  for (int32_t e = 0; e < E; e++) {
    total += zipf > 0 ? 1.0 / pow(e + 1, zipf) : 1.0;
    cdf[e] = total;
  }
  for (int64_t t = 0; t < T; t++) {
    float sum = 0;
    for (int32_t k = 0; k < K; k++) {
      int32_t e;
      int duplicate;
      do {
        double u = tu_uniform(rng) * total;
        e = 0;
        while (e < E - 1 && cdf[e] <= u) e++;
        duplicate = 0;
        for (int32_t j = 0; j < k; j++) duplicate |= topk_idx[t * K + j] == e;
      } while (duplicate);
      topk_idx[t * K + k] = e;
      topk_w[t * K + k] = (float)(0.1 + tu_uniform(rng));
      sum += topk_w[t * K + k];
    }
    for (int32_t k = 0; k < K; k++) topk_w[t * K + k] /= sum;
  }
  free(cdf);
}

double tu_max_error(epx_dtype_t dtype_a, const void *a, epx_dtype_t dtype_b, const void *b,
                    int64_t n, double atol, double rtol) {
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double x = epx_load(dtype_a, a, i), y = epx_load(dtype_b, b, i);
    double err = fabs(x - y) / (atol + rtol * fabs(y));
    if (!(err <= worst)) worst = isnan(err) ? INFINITY : err;
  }
  return worst;
}

double tu_atol(epx_dtype_t dtype) { return dtype == EPX_FLOAT32 ? 1e-5 : dtype == EPX_BFLOAT16 ? 1e-2 : 2e-3; }
double tu_rtol(epx_dtype_t dtype) { return dtype == EPX_FLOAT32 ? 1e-5 : dtype == EPX_BFLOAT16 ? 1.6e-2 : 2e-3; }

void *tu_alloc(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64)) fail_msg("out of memory (%zu bytes)", bytes);
  memset(p, 0, bytes);
  return p;
}

void tu_free(void *p) { free(p); }

typedef struct {
  epx_local_world_t world;
  int32_t rank, size;
  tu_rank_fn fn;
  void *arg;
  int result;
} rank_args_t;

static void *rank_main(void *p) {
  rank_args_t *a = p;
  epx_comm_t comm = NULL;
  if (epx_comm_create_local(a->world, a->rank, &comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_create_local: %s\n", a->rank, epx_last_error());
    a->result = 1;
    return NULL;
  }
  a->result = a->fn(comm, a->rank, a->size, a->arg);
  epx_status_t st = epx_comm_destroy(comm);
  if (st != EPX_SUCCESS && !a->result) {
    fprintf(stderr, "rank %d: epx_comm_destroy: %s\n", a->rank, epx_last_error());
    a->result = 1;
  }
  return NULL;
}

int tu_run_ranks(int32_t world, double timeout_seconds, tu_rank_fn fn, void *arg) {
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  if (timeout_seconds > 0) config.timeout_seconds = timeout_seconds;
  epx_local_world_t local = NULL;
  if (epx_local_world_create(world, &config, &local) != EPX_SUCCESS) {
    fprintf(stderr, "epx_local_world_create: %s\n", epx_last_error());
    return world;
  }
  pthread_t *threads = calloc((size_t)world, sizeof *threads);
  rank_args_t *args = calloc((size_t)world, sizeof *args);
  for (int32_t r = 0; r < world; r++) {
    args[r] = (rank_args_t){local, r, world, fn, arg, 0};
    pthread_create(&threads[r], NULL, rank_main, &args[r]);
  }
  int failures = 0;
  for (int32_t r = 0; r < world; r++) {
    pthread_join(threads[r], NULL);
    failures += args[r].result != 0;
  }
  if (epx_local_world_destroy(local) != EPX_SUCCESS) {
    fprintf(stderr, "epx_local_world_destroy: %s\n", epx_last_error());
    failures++;
  }
  free(threads);
  free(args);
  return failures;
}

int tu_message_has(const char *needle) { return !needle || strstr(epx_last_error(), needle) != NULL; }

epx_comm_t tu_self_comm;

int tu_self_setup(void **state) {
  (void)state;
  return epx_comm_create_self(&tu_self_comm) == EPX_SUCCESS ? 0 : -1;
}

int tu_self_teardown(void **state) {
  (void)state;
  return epx_comm_destroy(tu_self_comm) == EPX_SUCCESS ? 0 : -1;
}

const char *tu_dtype_name(epx_dtype_t dtype) {
  return dtype == EPX_FLOAT32 ? "f32" : dtype == EPX_BFLOAT16 ? "bf16" : "f16";
}

const char *tu_layout_name(epx_layout_t layout) {
  return layout == EPX_LAYOUT_EXPERT_MAJOR ? "expert-major"
         : layout == EPX_LAYOUT_RANK_MAJOR ? "rank-major"
                                           : "capacity";
}

const char *tu_weighting_name(epx_weighting_t weighting) {
  return weighting == EPX_WEIGHTS_IN_COMBINE    ? "in-combine"
         : weighting == EPX_WEIGHTS_IN_DISPATCH ? "in-dispatch"
                                                : "none";
}
