/* The device attributes and kernel limits the routing and layout launches
 * need, cached per device (device_cache.cu): a launch then costs one
 * cudaGetDevice on the host instead of three or four attribute queries and
 * a cudaFuncSetAttribute. Thread-safe (a process may drive several devices
 * from several threads); a device id past the table is served uncached. */
#ifndef EPX_CUDA_DEVICE_CACHE_H
#define EPX_CUDA_DEVICE_CACHE_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epx_cuda_device_info {
  int sms;         /* cudaDevAttrMultiProcessorCount */
  int smem_per_sm; /* cudaDevAttrMaxSharedMemoryPerMultiprocessor */
  int smem_optin;  /* cudaDevAttrMaxSharedMemoryPerBlockOptin */
  int cc_major;    /* cudaDevAttrComputeCapabilityMajor */
} epx_cuda_device_info_t;

/* The current device (cudaGetDevice) and its attributes, queried once per
 * device and process. */
cudaError_t epx_cuda_device_info(int *device, epx_cuda_device_info_t *info);

/* kernel's dynamic shared-memory limit (cudaFuncAttributeMaxDynamicSharedMemorySize)
 * at least `bytes` on `device` (the current device): set once per kernel,
 * device and larger size. The limit only rises (a launch needing less is
 * unaffected: it is a bound, not a reservation), and every raise is made
 * under a lock so the recorded limit is always the one set. */
cudaError_t epx_cuda_kernel_smem(const void *kernel, int device, size_t bytes);
/* The same on the current device. */
cudaError_t epx_cuda_kernel_smem_here(const void *kernel, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
