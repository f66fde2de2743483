/* Which device transport serves a comm (xport.h): NCCL's comms the NCCL
 * transport, a comm whose ranks share this address space (the local
 * transport's threads) the in-process one, a comm of processes of one host
 * (the shm transport's) the ipc one. */
#include <stdint.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/nccl.h"
#include "core/transport.h"
#include "cuda/common/check.h"
#include "cuda/xport/xport.h"

const epx_cuda_xport_t *epx_cuda_xport_of(epx_comm_t comm) {
#if EPX_HAVE_NCCL
  if (epx_comm_is_nccl(comm)) return &epx_cuda_xport_nccl;
#endif
  if (comm->ops->shared_address_space) return &epx_cuda_xport_in_process;
  if (comm->ops->one_host) return &epx_cuda_xport_ipc;
  return NULL;
}

epx_status_t epx_cuda_xport_host_fail_timeout(epx_comm_t comm, const char *fn, const char *what) {
  comm->failed = 1;
  return epx_error(EPX_ERROR_TIMEOUT, "%s: %s; the comm is unusable: destroy it", fn, what);
}

epx_status_t epx_cuda_xport_host_agree_max(epx_comm_t comm, int64_t mine, int64_t *top, const char *fn) {
  *top = mine;
  return comm->ops->allreduce_max_i64(comm, fn, top, 1);
}

int epx_cuda_xport_stream_poll(cudaStream_t stream, const char *fn, epx_status_t *status) {
  const cudaError_t e = cudaStreamQuery(stream);
  *status = EPX_SUCCESS;
  if (e == cudaErrorNotReady) return 0;
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* reported here, not by a later call */
    *status = epx_cuda_fail(e, fn, "waiting for the stream");
  }
  return 1;
}

epx_status_t epx_cuda_xport_window_start(epx_comm_t comm, epx_cuda_window_t *window, const char *kind,
                                         const char *fn) {
  memset(window, 0, sizeof *window);
  if (comm->size > EPX_CUDA_WINDOW_MAX_RANKS)
    return epx_error(EPX_ERROR_UNSUPPORTED, "%s: %d ranks, over the %s windows' %d", fn, (int)comm->size, kind,
                     EPX_CUDA_WINDOW_MAX_RANKS);
  return EPX_SUCCESS;
}

epx_status_t epx_cuda_xport_window_gather(epx_comm_t comm, const void *mine, void *all, size_t block,
                                          size_t refused_at, const char *kind, const char *reason, const char *fn) {
  epx_status_t status = comm->ops->allgather(comm, fn, mine, all, block);
  int32_t refused = -1;
  for (int32_t p = 0; status == EPX_SUCCESS && p < comm->size; p++) {
    int32_t flag;
    memcpy(&flag, (const char *)all + (size_t)p * block + refused_at, sizeof flag);
    if (flag) refused = p;
  }
  if (status != EPX_SUCCESS || refused < 0) return status;
  return refused == comm->rank
             ? epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: the %s window: %s", fn, kind, reason)
             : epx_error(EPX_ERROR_UNSUPPORTED, "%s: rank %d has no %s window (its epx_last_error says why); "
                         "every rank refuses it", fn, (int)refused, kind);
}

void epx_cuda_xport_window_free(epx_comm_t comm, epx_cuda_window_t *window, int collective) {
  if (collective && !comm->failed) (void)comm->ops->barrier(comm, "epx_buffer_destroy");
  if (window->base) cudaFree(window->base);
  window->base = NULL;
}
