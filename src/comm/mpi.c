/* The MPI transport: the collectives on a duplicate of the caller's
 * communicator.
 *
 * What MPI's own error handling gives, and what this file adds:
 *  - The duplicate has MPI_ERRORS_RETURN, so an MPI call that detects an
 *    error (a bad argument, a truncated message, a failure its transport
 *    notices) returns a code instead of aborting the job. That code becomes
 *    EPX_ERROR_TRANSPORT with MPI_Error_string's text, and the comm is failed.
 *    The caller's communicator keeps its own handler; only MPI_Comm_idup runs
 *    on it.
 *  - A peer process that dies usually takes the job down with it: without
 *    ULFM, OpenMPI's runtime kills every process of the job when one exits
 *    abnormally, so no status comes back at all. Nothing here changes that.
 *  - A peer that is alive but never joins a collective (it failed before it,
 *    or is stuck) is no MPI error: a blocking collective would wait forever.
 *    So every collective here is nonblocking and polled with MPI_Test until
 *    timeout_seconds; on expiry the call returns EPX_ERROR_TIMEOUT. MPI cannot
 *    say which rank is missing, and the message says so. MPI forbids
 *    cancelling or freeing a pending collective, so its request is abandoned:
 *    the buffers it names stay MPI's until it completes, if ever (this file
 *    keeps its own state, count arrays and the duplicate alive for that), and
 *    the comm refuses every later collective with EPX_ERROR_PEER_FAILED. */
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "core/error.h"

typedef struct mpi_state {
  MPI_Comm comm;          /* the duplicate */
  MPI_Datatype unit_type; /* `unit_bytes` contiguous bytes, for alltoallv */
  size_t unit_bytes;      /* 0: unit_type not made yet */
  int *counts;            /* [4, size]: int copies of alltoallv's counts and displacements */
  int abandoned;          /* a request still pending after a timeout uses this state */
  char reason[MPI_MAX_ERROR_STRING + 256]; /* why the comm failed */
  struct mpi_state *next_abandoned;
} mpi_state_t;

/* States with a request abandoned after a timeout: MPI may still write or
 * read them (MPI_Comm_idup's result, alltoallv's count arrays, the duplicate
 * itself), so they stay for the life of the process, reachable from here.
 * OpenMPI's libnbc crashes progressing a collective whose communicator was
 * freed, so the duplicate stays too. */
static pthread_mutex_t abandoned_lock = PTHREAD_MUTEX_INITIALIZER;
static mpi_state_t *abandoned_states;

static void mpi_keep_abandoned(mpi_state_t *state) {
  pthread_mutex_lock(&abandoned_lock);
  state->next_abandoned = abandoned_states;
  abandoned_states = state;
  pthread_mutex_unlock(&abandoned_lock);
}

static double mpi_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static epx_status_t mpi_check_alive(epx_comm_t comm, const char *caller) {
  mpi_state_t *state = comm->impl;
  if (!comm->failed) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_PEER_FAILED,
                   "%s: the comm failed earlier: %s; destroy it and create a new one", caller,
                   state->reason);
}

/* An MPI error code as EPX_ERROR_TRANSPORT; the comm is failed. */
static epx_status_t mpi_fail(epx_comm_t comm, const char *caller, const char *call, int code) {
  mpi_state_t *state = comm->impl;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    snprintf(text, sizeof text, "MPI error code %d", code);
  comm->failed = 1;
  snprintf(state->reason, sizeof state->reason, "%s returned \"%s\"", call, text);
  return epx_error(EPX_ERROR_TRANSPORT,
                   "%s: %s returned \"%s\" (MPI error); the comm is now failed, destroy it", caller,
                   call, text);
}

/* Polls `request` until it completes, bounded by `timeout_seconds` (<= 0:
 * forever). `comm` may still be half built (epx_comm_init_mpi). */
static epx_status_t mpi_wait(epx_comm_t comm, const char *caller, const char *call,
                             MPI_Request *request) {
  mpi_state_t *state = comm->impl;
  const double timeout = comm->timeout_seconds;
  const double deadline = timeout > 0 ? mpi_now() + timeout : 0;
  for (long polls = 0;; polls++) {
    int done = 0;
    int code = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return mpi_fail(comm, caller, call, code);
    if (done) return EPX_SUCCESS;
    if (timeout > 0 && (polls & 63) == 0 && mpi_now() > deadline) {
      comm->failed = 1;
      state->abandoned = 1;
      snprintf(state->reason, sizeof state->reason,
               "%s in %s did not complete within %g s (comm timeout_seconds)", call, caller,
               timeout);
      return epx_error(EPX_ERROR_TIMEOUT,
                       "%s: %s did not complete within %g s (comm timeout_seconds): some rank "
                       "has not joined it, and MPI cannot say which; it failed before this "
                       "collective or is stuck. The comm is now failed (later calls return "
                       "EPX_ERROR_PEER_FAILED); destroy it",
                       caller, call, timeout);
    }
    /* Spin briefly for low latency, then let the peers (often processes on
     * the same cores) run. */
    if (polls > 2000) {
      struct timespec pause = {0, 20000};
      nanosleep(&pause, NULL);
    }
  }
}

static epx_status_t mpi_check_int(const char *caller, const char *what, int32_t index,
                                  int64_t value) {
  if (value >= 0 && value <= INT_MAX) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: %s[%d] is %lld units, outside MPI's int range [0, %d]; move fewer rows "
                   "per call (nothing was sent)",
                   caller, what, index, (long long)value, INT_MAX);
}

static epx_status_t mpi_check_bytes(const char *caller, const char *op, size_t bytes) {
  if (bytes <= (size_t)INT_MAX) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: %s block of %zu bytes exceeds MPI's int count (%d); move less per call "
                   "(nothing was sent)",
                   caller, op, bytes, INT_MAX);
}

static epx_status_t mpi_alltoall(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                 size_t bytes) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status == EPX_SUCCESS) status = mpi_check_bytes(caller, "alltoall", bytes);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  MPI_Request request;
  int code =
      MPI_Ialltoall(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, state->comm, &request);
  if (code != MPI_SUCCESS) return mpi_fail(comm, caller, "MPI_Ialltoall", code);
  return mpi_wait(comm, caller, "MPI_Ialltoall", &request);
}

/* Counts stay int by counting in a contiguous datatype of `unit` bytes. */
static epx_status_t mpi_alltoallv(epx_comm_t comm, const char *caller, const void *send,
                                  const int64_t *send_counts, const int64_t *send_displs,
                                  void *recv, const int64_t *recv_counts,
                                  const int64_t *recv_displs, size_t unit) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  if (unit == 0 || unit > (size_t)INT_MAX)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: alltoallv unit is %zu bytes; pass 1 <= unit <= %d (nothing was sent)",
                     caller, unit, INT_MAX);
  const int32_t size = comm->size;
  for (int32_t r = 0; r < size; r++) {
    if ((status = mpi_check_int(caller, "send_counts", r, send_counts[r])) ||
        (status = mpi_check_int(caller, "send_displs", r, send_displs[r])) ||
        (status = mpi_check_int(caller, "recv_counts", r, recv_counts[r])) ||
        (status = mpi_check_int(caller, "recv_displs", r, recv_displs[r])))
      return status;
  }
  if (state->unit_bytes != unit) {
    MPI_Datatype type;
    int code = MPI_Type_contiguous((int)unit, MPI_BYTE, &type);
    if (code == MPI_SUCCESS) code = MPI_Type_commit(&type);
    if (code != MPI_SUCCESS) return mpi_fail(comm, caller, "MPI_Type_contiguous", code);
    /* A pending collective keeps a freed type alive until it completes. */
    if (state->unit_bytes) MPI_Type_free(&state->unit_type);
    state->unit_type = type;
    state->unit_bytes = unit;
  }
  int *scounts = state->counts, *sdispls = scounts + size;
  int *rcounts = sdispls + size, *rdispls = rcounts + size;
  for (int32_t r = 0; r < size; r++) {
    scounts[r] = (int)send_counts[r];
    sdispls[r] = (int)send_displs[r];
    rcounts[r] = (int)recv_counts[r];
    rdispls[r] = (int)recv_displs[r];
  }
  MPI_Request request;
  int code = MPI_Ialltoallv(send, scounts, sdispls, state->unit_type, recv, rcounts, rdispls,
                            state->unit_type, state->comm, &request);
  if (code != MPI_SUCCESS) return mpi_fail(comm, caller, "MPI_Ialltoallv", code);
  return mpi_wait(comm, caller, "MPI_Ialltoallv", &request);
}

static epx_status_t mpi_allgather(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                  size_t bytes) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status == EPX_SUCCESS) status = mpi_check_bytes(caller, "allgather", bytes);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  MPI_Request request;
  int code =
      MPI_Iallgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, state->comm, &request);
  if (code != MPI_SUCCESS) return mpi_fail(comm, caller, "MPI_Iallgather", code);
  return mpi_wait(comm, caller, "MPI_Iallgather", &request);
}

static epx_status_t mpi_allreduce_max_i64(epx_comm_t comm, const char *caller, int64_t *values,
                                          int32_t count) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  MPI_Request request;
  int code =
      MPI_Iallreduce(MPI_IN_PLACE, values, count, MPI_INT64_T, MPI_MAX, state->comm, &request);
  if (code != MPI_SUCCESS) return mpi_fail(comm, caller, "MPI_Iallreduce", code);
  return mpi_wait(comm, caller, "MPI_Iallreduce", &request);
}

static epx_status_t mpi_barrier(epx_comm_t comm, const char *caller) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  MPI_Request request;
  int code = MPI_Ibarrier(state->comm, &request);
  if (code != MPI_SUCCESS) return mpi_fail(comm, caller, "MPI_Ibarrier", code);
  return mpi_wait(comm, caller, "MPI_Ibarrier", &request);
}

static void mpi_destroy(epx_comm_t comm) {
  mpi_state_t *state = comm->impl;
  comm->impl = NULL;
  if (state->unit_bytes) MPI_Type_free(&state->unit_type);
  state->unit_bytes = 0;
  if (state->abandoned) {
    mpi_keep_abandoned(state);
    return;
  }
  MPI_Comm_free(&state->comm);
  free(state->counts);
  free(state);
}

static const epx_transport_ops_t mpi_ops = {
    .name = "mpi",
    .alltoall = mpi_alltoall,
    .alltoallv = mpi_alltoallv,
    .allgather = mpi_allgather,
    .allreduce_max_i64 = mpi_allreduce_max_i64,
    .barrier = mpi_barrier,
    .destroy = mpi_destroy,
};

epx_status_t epx_comm_init_mpi(epx_comm_t comm, const void *mpi_comm) {
  const char *fn = "epx_comm_create_mpi";
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  EPX_REQUIRE(initialized && !finalized,
              "%s: MPI is not initialised (or already finalised); call MPI_Init before "
              "creating the comm and MPI_Finalize after destroying it",
              fn);
  MPI_Comm user = *(const MPI_Comm *)mpi_comm;
  EPX_REQUIRE(user != MPI_COMM_NULL,
              "%s: *mpi_comm is MPI_COMM_NULL; pass a valid communicator (MPI_COMM_WORLD)", fn);
  mpi_state_t *state = calloc(1, sizeof *state);
  if (!state) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  comm->impl = state;
  epx_status_t status = EPX_SUCCESS;
  int duplicated = 0, size = 0, rank = 0;
  /* Nonblocking, so a rank that never joins cannot hang the others here. */
  MPI_Request request;
  int code = MPI_Comm_idup(user, &state->comm, &request);
  if (code != MPI_SUCCESS) EPX_CHECK(mpi_fail(comm, fn, "MPI_Comm_idup", code));
  EPX_CHECK(mpi_wait(comm, fn, "MPI_Comm_idup", &request));
  duplicated = 1;
  code = MPI_Comm_set_errhandler(state->comm, MPI_ERRORS_RETURN);
  if (code != MPI_SUCCESS) EPX_CHECK(mpi_fail(comm, fn, "MPI_Comm_set_errhandler", code));
  code = MPI_Comm_rank(state->comm, &rank);
  if (code == MPI_SUCCESS) code = MPI_Comm_size(state->comm, &size);
  if (code != MPI_SUCCESS) EPX_CHECK(mpi_fail(comm, fn, "MPI_Comm_size", code));
  state->counts = malloc(sizeof(int) * 4 * (size_t)size);
  if (!state->counts) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d ranks", fn, size);
  comm->ops = &mpi_ops;
  comm->rank = rank;
  comm->size = size;
  return EPX_SUCCESS;
fail:
  if (duplicated) MPI_Comm_free(&state->comm);
  if (state->abandoned)
    mpi_keep_abandoned(state);
  else
    free(state);
  comm->impl = NULL;
  comm->failed = 0;
  return status;
}
