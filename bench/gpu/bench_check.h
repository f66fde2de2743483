/* The one-process GPU benchmarks' check macros: a failed CUDA or epx call
 * prints where and why, and the benchmark exits 1 (its verdict). */
#ifndef EPX_BENCH_GPU_BENCH_CHECK_H
#define EPX_BENCH_GPU_BENCH_CHECK_H

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "epx.h"

#define CK(call)                                                                                \
  do {                                                                                          \
    cudaError_t e_ = (call);                                                                    \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));     \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)
#define EK(call)                                                                                \
  do {                                                                                          \
    epx_status_t s_ = (call);                                                                   \
    if (s_ != EPX_SUCCESS) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, epx_last_error());           \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

#endif
