#include "api/backends.h"

#include "core/error.h"
#include "cpu/cpu.h"
#if EPX_HAVE_CUDA
#include "cuda/backend.h"
#endif

const epx_backend_t *epx_backend_for_device(epx_device_t device) {
  switch (device) {
    case EPX_DEVICE_CPU: return &epx_cpu_backend;
#if EPX_HAVE_CUDA
    case EPX_DEVICE_CUDA: return &epx_cuda_backend;
#else
    case EPX_DEVICE_CUDA: return NULL;
#endif
  }
  return NULL;
}

epx_status_t epx_backend_missing(const char *caller, epx_device_t device) {
  if (device == EPX_DEVICE_CUDA)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: this build of epx has no CUDA backend; rebuild with -DEPX_BUILD_CUDA=ON "
                     "or use EPX_DEVICE_CPU", caller);
  return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: device %d is not EPX_DEVICE_CPU or EPX_DEVICE_CUDA", caller, (int)device);
}

int epx_has_cuda(void) { return EPX_HAVE_CUDA; }
