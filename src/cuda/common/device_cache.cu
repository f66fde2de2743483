/* The per-device cache of device_cache.h. */
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>

#include "cuda/common/device_cache.h"

namespace {

constexpr int kCachedDevices = 64; /* device ids past it are served uncached */
/* kernels whose limit is raised (22 today: the routing and layout kernels,
 * the fused ones, the fp8 scatter's ten); more: uncached */
constexpr int kCachedKernels = 24;

/* A device's attributes: state 0 unset, 1 being filled by the thread that
 * claimed it, 2 ready (info is then read-only). A thread that finds it
 * unset or being filled queries for itself: nobody waits. */
struct device_slot {
  std::atomic<int> state{0};
  epx_cuda_device_info_t info;
};
device_slot g_devices[kCachedDevices];

/* Kernels by address (set once, under g_smem_mutex) and the dynamic
 * shared-memory limit each has on each device (0: the default). */
std::atomic<const void *> g_smem_kernels[kCachedKernels];
std::atomic<size_t> g_smem_limit[kCachedKernels][kCachedDevices];
std::mutex g_smem_mutex;

cudaError_t query_device(int device, epx_cuda_device_info_t *info) {
  cudaError_t err = cudaDeviceGetAttribute(&info->sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&info->smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&info->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&info->cc_major, cudaDevAttrComputeCapabilityMajor, device);
  return err;
}

/* kernel's slot, or -1; `add`: claims a free one (the caller holds the lock). */
int smem_slot(const void *kernel, bool add) {
  for (int i = 0; i < kCachedKernels; i++) {
    const void *k = g_smem_kernels[i].load(std::memory_order_acquire);
    if (k == kernel) return i;
    if (!k) {
      if (!add) return -1;
      g_smem_kernels[i].store(kernel, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

cudaError_t set_smem(const void *kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

}  // namespace

extern "C" cudaError_t epx_cuda_device_info(int *device, epx_cuda_device_info_t *info) {
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return err;
  const int d = *device;
  if (d < 0 || d >= kCachedDevices) return query_device(d, info);
  device_slot &slot = g_devices[d];
  if (slot.state.load(std::memory_order_acquire) == 2) {
    *info = slot.info;
    return cudaSuccess;
  }
  err = query_device(d, info);
  if (err != cudaSuccess) return err;
  int unset = 0;
  if (slot.state.compare_exchange_strong(unset, 1, std::memory_order_acq_rel)) {
    slot.info = *info;
    slot.state.store(2, std::memory_order_release);
  }
  return cudaSuccess;
}

extern "C" cudaError_t epx_cuda_kernel_smem(const void *kernel, int device, size_t bytes) {
  if (device < 0 || device >= kCachedDevices) return set_smem(kernel, bytes);
  int slot = smem_slot(kernel, false);
  if (slot >= 0 && g_smem_limit[slot][device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  /* Raised under the lock: two threads raising to different sizes could
   * otherwise leave the smaller set and the larger recorded. */
  std::lock_guard<std::mutex> lock(g_smem_mutex);
  slot = smem_slot(kernel, true);
  if (slot < 0) return set_smem(kernel, bytes); /* the table is full: as before the cache */
  if (g_smem_limit[slot][device].load(std::memory_order_relaxed) >= bytes) return cudaSuccess;
  const cudaError_t err = set_smem(kernel, bytes);
  if (err == cudaSuccess) g_smem_limit[slot][device].store(bytes, std::memory_order_release);
  return err;
}

extern "C" cudaError_t epx_cuda_kernel_smem_here(const void *kernel, size_t bytes) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err != cudaSuccess ? err : epx_cuda_kernel_smem(kernel, device, bytes);
}
