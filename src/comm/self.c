/* The one-rank transport: every collective is a copy of the self block (or
 * nothing at all). It never waits, so it never times out or fails. */
#include <string.h>

#include "comm/comm.h"
#include "core/error.h"

static void self_copy(void *dst, const void *src, size_t bytes) {
  if (bytes && dst != src) memcpy(dst, src, bytes);
}

static epx_status_t self_alltoall(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                  size_t bytes) {
  (void)comm, (void)caller;
  self_copy(recv, send, bytes);
  return EPX_SUCCESS;
}

static epx_status_t self_alltoallv(epx_comm_t comm, const char *caller, const void *send,
                                   const int64_t *send_counts, const int64_t *send_displs,
                                   void *recv, const int64_t *recv_counts,
                                   const int64_t *recv_displs, size_t unit) {
  (void)comm;
  if (send_counts[0] != recv_counts[0] || send_counts[0] < 0)
    return epx_error(EPX_ERROR_INTERNAL,
                     "%s: rank 0 sends %lld units to itself but expects %lld "
                     "(send_counts[0] != recv_counts[0]); the count exchange is inconsistent",
                     caller, (long long)send_counts[0], (long long)recv_counts[0]);
  self_copy((char *)recv + (size_t)recv_displs[0] * unit,
            (const char *)send + (size_t)send_displs[0] * unit, (size_t)send_counts[0] * unit);
  return EPX_SUCCESS;
}

static epx_status_t self_allreduce_max_i64(epx_comm_t comm, const char *caller, int64_t *values,
                                           int32_t count) {
  (void)comm, (void)caller, (void)values, (void)count;
  return EPX_SUCCESS;
}

static epx_status_t self_barrier(epx_comm_t comm, const char *caller) {
  (void)comm, (void)caller;
  return EPX_SUCCESS;
}

static void self_destroy(epx_comm_t comm) { (void)comm; }

static const epx_transport_ops_t self_ops = {
    .name = "self",
    .alltoall = self_alltoall,
    .alltoallv = self_alltoallv,
    .allgather = self_alltoall, /* with one rank, gathering is the same single copy */
    .allreduce_max_i64 = self_allreduce_max_i64,
    .barrier = self_barrier,
    .destroy = self_destroy,
};

epx_status_t epx_comm_init_self(epx_comm_t comm) {
  comm->ops = &self_ops;
  comm->rank = 0;
  comm->size = 1;
  comm->impl = NULL;
  return EPX_SUCCESS;
}
