/* The NCCL transport (xport.h): ncclAllGather and grouped ncclSend/ncclRecv
 * on the comm's data comm (nccl.c says why a blocking split), each group
 * ended before a failure fails the comm (epx_nccl_group_end); the bounded
 * wait and the timeout of src/comm/nccl.c. Windows are the fused module's
 * (NCCL's symmetric windows through its device API): window_open is NULL. */
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/nccl.h"
#include "core/transport.h"
#include "cuda/xport/xport.h"

#if EPX_HAVE_NCCL
#include <nccl.h>

static epx_status_t nccl_allgather(epx_comm_t comm, const void *const *send, void *const *recv, const size_t *bytes,
                                   int n, cudaStream_t stream, const char *fn) {
  ncclComm_t nc = epx_nccl_data_comm(comm);
  ncclResult_t r = ncclGroupStart();
  epx_status_t status = epx_nccl_result(comm, (int)r, fn, "ncclGroupStart");
  if (status != EPX_SUCCESS) return status;
  const char *what = "ncclAllGather";
  for (int i = 0; i < n && epx_nccl_went(r); i++) r = ncclAllGather(send[i], recv[i], bytes[i], ncclUint8, nc, stream);
  /* a failed call still ends the group first */
  return epx_nccl_group_end(comm, r, fn, what);
}

static epx_status_t nccl_sendrecv(epx_comm_t comm, const epx_cuda_move_t *sends, int64_t ns,
                                  const epx_cuda_move_t *recvs, int64_t nr, cudaStream_t stream, const char *fn) {
  ncclComm_t nc = epx_nccl_data_comm(comm);
  ncclResult_t r = ncclGroupStart();
  epx_status_t status = epx_nccl_result(comm, (int)r, fn, "ncclGroupStart");
  if (status != EPX_SUCCESS) return status;
  const char *what = "ncclGroupStart";
  /* per peer, its send then its receive: the order the paths used */
  for (int64_t i = 0, j = 0; (i < ns || j < nr) && epx_nccl_went(r);) {
    const int take_send = i < ns && (j >= nr || sends[i].peer <= recvs[j].peer);
    const epx_cuda_move_t *m = take_send ? &sends[i++] : &recvs[j++];
    if (!m->bytes) continue;
    if (take_send) what = "ncclSend", r = ncclSend(m->ptr, m->bytes, ncclUint8, m->peer, nc, stream);
    else what = "ncclRecv", r = ncclRecv(m->ptr, m->bytes, ncclUint8, m->peer, nc, stream);
  }
  return epx_nccl_group_end(comm, r, fn, what);
}

static epx_status_t nccl_wait(epx_comm_t comm, cudaStream_t stream, const char *fn) {
  return epx_nccl_wait(comm, stream, fn);
}

static epx_status_t nccl_agree_max(epx_comm_t comm, int64_t mine, int64_t *top, const char *fn) {
  *top = mine;
  return comm->ops->allreduce_max_i64(comm, fn, top, 1);
}

const epx_cuda_xport_t epx_cuda_xport_nccl = {
    .name = "nccl",
    .allgather = nccl_allgather,
    .sendrecv = nccl_sendrecv,
    .wait = nccl_wait,
    .fail_timeout = epx_nccl_fail_timeout,
    .agree_max = nccl_agree_max,
    .window_open = NULL,
    .window_close = NULL,
};

#endif
