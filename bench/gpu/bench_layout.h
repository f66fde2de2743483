/* The device arrays of a one-GPU layout computed with the launcher
 * (cuda/launch.h), shared by the one-process GPU benchmarks: one block for
 * the layout's arrays and the weights' copy, and the launcher's scratch. */
#ifndef EPX_BENCH_GPU_BENCH_LAYOUT_H
#define EPX_BENCH_GPU_BENCH_LAYOUT_H

#include <algorithm>
#include <cstdint>

#include "bench_check.h"
#include "cuda/launch.h"

struct own_layout {
  epx_cuda_layout_t lay;
  void *block, *scratch;
  float *w_copy;
  int64_t bound; /* rows of the layout at most: E * C with capacity C > 0, else T * min(K, E) */
};

inline own_layout make_own_layout(int64_t T, int32_t K, int32_t E, int32_t C) {
  own_layout o;
  const size_t tk = (size_t)(T * K);
  o.bound = C > 0 ? (int64_t)E * C : T * std::min(K, E);
  CK(cudaMalloc(&o.block, 16 * tk + 4 * (size_t)o.bound + 16 * ((size_t)E + 1) + 256));
  CK(cudaMalloc(&o.scratch, epx_cuda_layout_scratch_bytes(T, E)));
  char *p = (char *)o.block;
  o.lay.result = (epx_cuda_layout_result_t *)p;
  p += 256;
  o.lay.idx = (int32_t *)p;
  p += 4 * tk;
  o.lay.route_row = (int32_t *)p;
  p += 4 * tk;
  o.lay.token_row = (int32_t *)p;
  p += 4 * tk;
  o.w_copy = (float *)p;
  p += 4 * tk;
  o.lay.counts = (int64_t *)p;
  p += 8 * (size_t)E;
  o.lay.offsets = (int64_t *)p;
  p += 8 * ((size_t)E + 1);
  o.lay.row_src = (int32_t *)p;
  return o;
}

inline void free_own_layout(own_layout &o) {
  CK(cudaFree(o.block));
  CK(cudaFree(o.scratch));
}

#endif
