/* The transports' common code (core/transport.h): the agreement of a
 * verdict and the handshake, over any transport's comm->ops. */
#include "core/transport.h"

#include <stdint.h>
#include <string.h>

#include "core/error.h"

epx_status_t epx_comm_check_alive(epx_comm_t comm, const char *caller) {
  if (!comm->failed) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_PEER_FAILED,
                   "%s: the comm failed in an earlier collective (a peer timed out or reported "
                   "an error, named then); destroy the comm and create a new one",
                   caller);
}

epx_status_t epx_comm_agree(epx_comm_t comm, epx_status_t local, const char *caller) {
  if (comm->size == 1) return local;
  epx_status_t alive = epx_comm_check_alive(comm, caller);
  if (alive != EPX_SUCCESS) return alive;
  char message[1024];
  strncpy(message, epx_last_error(), sizeof message - 1);
  message[sizeof message - 1] = '\0';
  int64_t failed_rank = local != EPX_SUCCESS ? comm->rank + 1 : 0;
  epx_status_t status = comm->ops->allreduce_max_i64(comm, caller, &failed_rank, 1);
  if (status != EPX_SUCCESS) return status;
  if (local != EPX_SUCCESS) return epx_error(local, "%s", message);
  if (failed_rank)
    return epx_error(EPX_ERROR_PEER_FAILED,
                     "%s: rank %lld refused the call (its epx_last_error says why); nothing was "
                     "moved on any rank", caller, (long long)(failed_rank - 1));
  return EPX_SUCCESS;
}

epx_status_t epx_comm_handshake(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                size_t bytes, epx_comm_then_fn then, void *ctx) {
  epx_status_t status = epx_comm_check_alive(comm, caller);
  if (status != EPX_SUCCESS) return status;
  if (comm->ops->handshake) return comm->ops->handshake(comm, caller, send, recv, bytes, then, ctx);
  status = comm->ops->alltoall(comm, caller, send, recv, bytes);
  return status != EPX_SUCCESS ? status : then(ctx, recv);
}
