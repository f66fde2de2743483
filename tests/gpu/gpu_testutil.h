/* What the GPU tests share: a failing CUDA call fails the test, device
 * buffers made and filled from the host, poisoning, and the quick mode
 * (EPX_GPU_TEST_QUICK=1 trims the tests for compute-sanitizer runs). */
#ifndef EPX_GPU_TESTUTIL_H
#define EPX_GPU_TESTUTIL_H

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "testutil.h"

#define CU(call)                                                                        \
  do {                                                                                  \
    cudaError_t cu_err_ = (call);                                                       \
    if (cu_err_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(cu_err_)); \
  } while (0)

static inline int quick(void) {
  const char *q = getenv("EPX_GPU_TEST_QUICK");
  return q && *q && strcmp(q, "0") != 0;
}

static inline void *dev_alloc(size_t bytes) {
  void *p = NULL;
  CU(cudaMalloc(&p, bytes ? bytes : 16));
  return p;
}

static inline void *dev_copy(const void *host, size_t bytes) {
  void *p = dev_alloc(bytes);
  if (bytes) CU(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  return p;
}

static inline void to_host(void *host, const void *dev, size_t bytes) {
  if (bytes) CU(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

/* A host copy of device memory (tu_free it). */
static inline void *host_copy(const void *dev, size_t bytes) {
  void *p = tu_alloc(bytes);
  to_host(p, dev, bytes);
  return p;
}

static inline void dev_poison(void *p, size_t bytes) { CU(cudaMemset(p, 0xA5, bytes ? bytes : 16)); }

#endif
