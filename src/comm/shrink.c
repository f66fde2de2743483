/* epx_comm_shrink (epx.h, "Shrink and go on"): the argument checks and the
 * lost ranks' list around the transport's own shrink (local.c, shm.c,
 * nccl.c), and the named refusal of the transports that cannot shrink. */
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "core/config.h"
#include "core/error.h"
#include "core/registry.h"

/* Why a transport without a shrink cannot: the refusal names it. */
static epx_status_t shrink_unsupported(const char *fn, const epx_comm_t comm) {
  const char *name = comm->ops->name;
  if (!strcmp(name, "mpi"))
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the comm is an MPI comm; MPI cannot leave out a dead rank without "
                     "its fault-tolerance extension (ULFM's MPIX_Comm_shrink: Open MPI 5 built "
                     "with ULFM, or MPICH 4), which this build does not use: restart the job (or "
                     "its survivors) and create a new comm",
                     fn);
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: the comm's transport (%s) cannot shrink; shrink works on local (threads), "
                   "shm (processes) and NCCL comms", fn, name);
}

epx_status_t epx_comm_shrink_join_refusal(epx_comm_t comm, const char *caller, int joined, int done,
                                          double timeout_seconds) {
  if (joined)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: rank %d already shrank this comm; shrink the survivors' comm instead",
                     caller, comm->rank);
  if (done)
    return epx_error(EPX_ERROR_PEER_FAILED,
                     "%s: the survivors shrank this comm without rank %d (the failure named it "
                     "missing, or it did not join within %g s); it is not in their comm: "
                     "destroy this comm", caller, comm->rank, timeout_seconds);
  return EPX_SUCCESS;
}

epx_status_t epx_comm_shrink(epx_comm_t comm, const epx_comm_config_t *config,
                             epx_comm_t *survivor_comm, int32_t *lost_ranks, int32_t *num_lost) {
  const char *fn = "epx_comm_shrink";
  epx_error_clear();
  EPX_REQUIRE(survivor_comm, "%s: survivor_comm is NULL; pass the address of an epx_comm_t", fn);
  EPX_REQUIRE(comm, "%s: comm is NULL; pass the comm that lost a rank", fn);
  epx_comm_t object = epx_registry_get(comm, EPX_OBJECT_COMM);
  if (!object)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "%s: comm is not a live comm (destroyed already?); shrink the failed comm "
                     "before destroying it", fn);
  double timeout_seconds = object->timeout_seconds;
  int32_t ranks_per_node = 0;
  if (config) {
    epx_status_t checked = epx_comm_config_timeout(fn, config, &timeout_seconds);
    if (checked == EPX_SUCCESS) checked = epx_comm_config_ranks_per_node(fn, config, &ranks_per_node);
    if (checked != EPX_SUCCESS) return checked;
  }
  if (!object->ops->shrink) return shrink_unsupported(fn, object);
  uint8_t *lost = calloc((size_t)object->size, 1);
  if (!lost) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  epx_comm_t created = NULL;
  epx_status_t status = object->ops->shrink(object, fn, timeout_seconds, ranks_per_node, lost, &created);
  if (status == EPX_SUCCESS) {
    int32_t count = 0;
    for (int32_t p = 0; p < object->size; p++)
      if (lost[p]) {
        if (lost_ranks) lost_ranks[count] = p;
        count++;
      }
    if (num_lost) *num_lost = count;
    *survivor_comm = created->id;
  }
  free(lost);
  return status;
}
