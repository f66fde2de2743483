/* What the GPU tests share: device buffers made and filled from the host
 * (a failing CUDA call fails the test: check.h's CUDA_OK), poisoning, and
 * the quick mode (EPX_GPU_TEST_QUICK=1 trims the tests for compute-sanitizer runs). */
#ifndef EPX_GPU_TESTUTIL_H
#define EPX_GPU_TESTUTIL_H

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "testutil.h"

static inline int quick(void) {
  const char *q = getenv("EPX_GPU_TEST_QUICK");
  return q && *q && strcmp(q, "0") != 0;
}

static inline void *dev_alloc(size_t bytes) {
  void *p = NULL;
  CUDA_OK(cudaMalloc(&p, bytes ? bytes : 16));
  return p;
}

static inline void *dev_copy(const void *host, size_t bytes) {
  void *p = dev_alloc(bytes);
  if (bytes) CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  return p;
}

static inline void to_host(void *host, const void *dev, size_t bytes) {
  if (bytes) CUDA_OK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

/* A host copy of device memory (tu_free it). */
static inline void *host_copy(const void *dev, size_t bytes) {
  void *p = tu_alloc(bytes);
  to_host(p, dev, bytes);
  return p;
}

static inline void dev_poison(void *p, size_t bytes) { CUDA_OK(cudaMemset(p, 0xA5, bytes ? bytes : 16)); }

#endif
