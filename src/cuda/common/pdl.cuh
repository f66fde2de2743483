/* Programmatic dependent launch (sm_90+) for the short kernels of the
 * routing and the layout: each such kernel is launched so that it may start
 * before the kernel ahead of it in the stream has finished, and waits for
 * that kernel (its completion and its memory) before its first global
 * memory access: the order of the stream is kept, and what is overlapped is
 * the launch of the next grid (its blocks are resident and waiting when the
 * last block of the one ahead ends; bench/NOTES-gpu.md has what it saves).
 * A kernel that lets the next one
 * launch once it runs (pdl_begin's early) has all its blocks running by
 * then, so the next one's blocks only take the slots its last wave leaves
 * free. Included by .cu files only. */
#ifndef EPX_CUDA_PDL_CUH
#define EPX_CUDA_PDL_CUH

#include <cuda_runtime.h>

#include <utility>

#include "cuda/common/device_cache.h"
#include "cuda/launch.h"

/* First thing in a kernel launched by launch_pdl: wait for the grid ahead
 * (a no-op when it was launched without the attribute or has none), then,
 * with early, allow the next one to launch (else it may when this one
 * ends). Nothing before it may touch global memory. */
__device__ __forceinline__ void pdl_begin(bool early) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
  (void)early;
#endif
}

/* Whether the current device takes programmatic dependent launch (compute
 * capability 9.0 or later) and the launch flags ask for it (launch.h);
 * otherwise the kernels launch as <<<>>> does. */
inline bool pdl_supported() {
  int dev = 0;
  epx_cuda_device_info_t info; /* cached per device: one cudaGetDevice per launch */
  if (!(epx_cuda_launch_flags() & EPX_CUDA_PDL_LAUNCH)) return false;
  if (epx_cuda_device_info(&dev, &info) != cudaSuccess) {
    cudaGetLastError(); /* not this launch's error */
    return false;
  }
  return info.cc_major >= 9;
}

/* kernel<<<grid, block, smem, stream>>>(args...), allowed to start early
 * (the kernel must begin with pdl_begin). */
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args &&...args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_supported() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

#endif
