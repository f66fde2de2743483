/* Which device transport serves a comm (xport.h): NCCL's comms the NCCL
 * transport, a comm whose ranks share this address space (the local
 * transport's threads) the in-process one, a comm of processes of one host
 * (the shm transport's) the ipc one. */
#include "core/error.h"
#include "core/nccl.h"
#include "core/transport.h"
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
