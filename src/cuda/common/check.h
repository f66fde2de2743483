/* The CUDA backend's one check of CUDA runtime calls in host C code: a
 * failed call becomes an epx status (EPX_ERROR_OUT_OF_MEMORY for an
 * allocation, EPX_ERROR_CUDA otherwise) with a message naming the public
 * function and the call, and jumps to the function's `fail` label with
 * `status` set. */
#ifndef EPX_CUDA_CUDA_CHECK_H
#define EPX_CUDA_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "core/error.h"

static inline epx_status_t epx_cuda_fail(cudaError_t err, const char *fn, const char *what) {
  return epx_error(err == cudaErrorMemoryAllocation ? EPX_ERROR_OUT_OF_MEMORY : EPX_ERROR_CUDA,
                   "%s: %s failed with %s (%s); an error of earlier asynchronous work on the "
                   "device can also surface here", fn, what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

/* One call's status, for a function that makes a single call: EPX_SUCCESS
 * or epx_cuda_fail's. */
static inline epx_status_t epx_cuda_status(cudaError_t err, const char *fn, const char *what) {
  return err == cudaSuccess ? EPX_SUCCESS : epx_cuda_fail(err, fn, what);
}

#define CUDA_CHECK(call, fn, what)                                                       \
  do {                                                                                   \
    cudaError_t cuda_err_ = (call);                                                      \
    if (cuda_err_ != cudaSuccess) {                                                      \
      status = epx_cuda_fail(cuda_err_, fn, what);                                       \
      goto fail;                                                                         \
    }                                                                                    \
  } while (0)

#endif
