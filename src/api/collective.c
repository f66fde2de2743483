/* The caller's own collectives on a comm (a barrier, an all-gather): what a
 * program around the exchange needs to align ranks for timing and to gather
 * its results, over the comm's transport, so it needs no second rank layer
 * (epx-bench uses them). */
#include <stddef.h>

#include "api/api.h"
#include "core/error.h"
#include "core/transport.h"

/* Turns the caller's comm id into the comm in place (core/registry.h), or
 * refuses it. */
static epx_status_t check_comm(epx_comm_t *comm, const char *fn) {
  epx_status_t status = epx_check_comm(comm, fn);
  return status == EPX_SUCCESS ? epx_comm_check_alive(*comm, fn) : status;
}

epx_status_t epx_comm_barrier(epx_comm_t comm) {
  const char *fn = "epx_comm_barrier";
  epx_error_clear();
  epx_status_t status = check_comm(&comm, fn);
  if (status != EPX_SUCCESS) return status;
  return comm->ops->barrier(comm, fn);
}

epx_status_t epx_comm_allgather(epx_comm_t comm, const void *send, void *recv, size_t bytes) {
  const char *fn = "epx_comm_allgather";
  epx_error_clear();
  epx_status_t status = check_comm(&comm, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(send || !bytes, "%s: send is NULL; pass the `bytes` bytes this rank contributes", fn);
  EPX_REQUIRE(recv || !bytes, "%s: recv is NULL; pass room for comm size x `bytes` bytes", fn);
  EPX_REQUIRE(send != recv || !bytes, "%s: recv aliases send; pass separate buffers", fn);
  return comm->ops->allgather(comm, fn, send, recv, bytes);
}
