/* What the one-process GPU benchmarks share: the check macros (a failed
 * CUDA or epx call prints where and why, and the benchmark exits 1, its
 * verdict), a seeded generator, the median of per-call device times and
 * the device's copy bandwidth. */
#ifndef EPX_BENCH_GPU_BENCH_CHECK_H
#define EPX_BENCH_GPU_BENCH_CHECK_H

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

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

/* splitmix64 */
struct rng_t {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
};

/* Median of per-call device times (ms): f(i) for i < warm, then an event
 * before each of `reps` calls and after the last; calls back to back on the
 * stream. */
template <class F>
double median_ms(cudaStream_t s, int warm, int reps, F &&f) {
  for (int i = 0; i < warm; i++) f(i);
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  CK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < reps; i++) {
    f(i);
    CK(cudaEventRecord(ev[i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<float> t(reps);
  for (int i = 0; i < reps; i++) CK(cudaEventElapsedTime(&t[i], ev[i], ev[i + 1]));
  for (auto &e : ev) CK(cudaEventDestroy(e));
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

/* The device's copy bandwidth (GB/s, read + write): a 1 GiB device-to-device
 * copy, median of 21; *ms its time. */
inline double bench_copy_gbps(cudaStream_t s, double *ms) {
  const size_t bytes = (size_t)1 << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  *ms = median_ms(s, 3, 21, [&](int i) {
    CK(cudaMemcpyAsync(i & 1 ? a : b, i & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice, s));
  });
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (*ms * 1e-3) / 1e9;
}

#endif
