/* The MPI transport under mpiexec (-np 2 and 4): the transport cases every
 * transport passes (tests/util/comm_cases.c, also run over self and local by
 * tests/test_comm.c: every collective with payloads that encode source,
 * destination and index; a rank that skips a collective turned into a
 * timeout), then MPI's own: the caller's communicator left untouched, MPI
 * errors returned as a status, counts beyond int refused, sub-communicators.
 * Plain checks; the failures of all ranks are summed and the exit status is
 * the verdict. */
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_cases.h"
#include "core/transport.h"
#include "testutil.h"
#include "mpi_util.h"

static int rank = -1;
static int failures;

static epx_comm_t create(MPI_Comm mpi_comm, double timeout_seconds) {
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = timeout_seconds;
  epx_comm_t comm = NULL;
  epx_status_t status = epx_comm_create_mpi(&mpi_comm, &config, &comm);
  RANK_EXPECT(status == EPX_SUCCESS && comm, "epx_comm_create_mpi gave %s", epx_status_string(status));
  return status == EPX_SUCCESS ? comm : NULL;
}

static void test_ops(int size) {
  MPI_Errhandler before, after;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &before);
  /* A message for the caller's communicator, posted across epx's traffic:
   * it must arrive intact and not be taken for epx's. */
  int token_in = -1, token_out = 4242 + rank;
  MPI_Request recv_request, send_request;
  MPI_Irecv(&token_in, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &recv_request);

  epx_comm_t comm = create(MPI_COMM_WORLD, 30.0);
  if (!comm) return;
  int32_t got = -1;
  RANK_EXPECT(epx_comm_rank(comm, &got) == EPX_SUCCESS && got == rank, "epx_comm_rank gave %d", got);
  RANK_EXPECT(epx_comm_size(comm, &got) == EPX_SUCCESS && got == size, "epx_comm_size gave %d", got);
  RANK_EXPECT(!strcmp(COMM(comm)->ops->name, "mpi"), "transport is %s", COMM(comm)->ops->name);
  failures += cc_ops(comm, 5, NULL);
  RANK_EXPECT(epx_comm_destroy(comm) == EPX_SUCCESS, "epx_comm_destroy failed");

  MPI_Isend(&token_out, 1, MPI_INT, (rank + 1) % size, 7, MPI_COMM_WORLD, &send_request);
  MPI_Status recv_status;
  MPI_Wait(&recv_request, &recv_status);
  MPI_Wait(&send_request, MPI_STATUS_IGNORE);
  RANK_EXPECT(token_in == 4242 + (rank + size - 1) % size && recv_status.MPI_TAG == 7,
        "the caller's message arrived as %d (tag %d)", token_in, recv_status.MPI_TAG);
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &after);
  RANK_EXPECT(before == after && after == MPI_ERRORS_ARE_FATAL,
        "the caller's communicator changed error handler");
  MPI_Errhandler_free(&before);
  MPI_Errhandler_free(&after);
}

/* An MPI error comes back as EPX_ERROR_TRANSPORT (the process lives on) and
 * fails the comm. */
static void test_errors_return(void) {
  epx_comm_t comm = create(MPI_COMM_WORLD, 30.0);
  if (!comm) return;
  int64_t values[2] = {1, 2};
  epx_status_t status = COMM(comm)->ops->allreduce_max_i64(COMM(comm), "test_error", values, -1);
  RANK_EXPECT(status == EPX_ERROR_TRANSPORT, "a negative MPI count gave %s", epx_status_string(status));
  RANK_EXPECT(strstr(epx_last_error(), "test_error: MPI_Irecv returned \""),
        "message lacks MPI's own text");
  RANK_EXPECT(values[0] == 1 && values[1] == 2, "a failed allreduce changed its values");
  double t0 = tu_seconds();
  status = COMM(comm)->ops->barrier(COMM(comm), "test_after");
  RANK_EXPECT(status == EPX_ERROR_PEER_FAILED && tu_seconds() - t0 < 0.5,
        "barrier on a failed comm gave %s", epx_status_string(status));
  RANK_EXPECT(strstr(epx_last_error(), "test_after: the comm failed earlier: MPI_Irecv returned"),
        "later message does not say why the comm failed");
  RANK_EXPECT(epx_comm_check_alive(COMM(comm), "test_alive") == EPX_ERROR_PEER_FAILED,
        "epx_comm_check_alive missed the failure");
  RANK_EXPECT(epx_comm_destroy(comm) == EPX_SUCCESS, "destroying a failed comm failed");
}

/* Counts beyond int are refused before anything is sent; the comm lives on. */
static void test_int_counts(int size) {
  epx_comm_t comm = create(MPI_COMM_WORLD, 30.0);
  if (!comm) return;
  int64_t *counts = calloc(4 * (size_t)size, sizeof(int64_t));
  counts[0] = (int64_t)INT_MAX + 1;
  uint32_t send[4], recv[4];
  tu_poison(send, sizeof send);
  tu_poison(recv, sizeof recv);
  epx_status_t status = COMM(comm)->ops->alltoallv(COMM(comm), "test_counts", send, counts, counts + size, recv,
                                             counts + 2 * size, counts + 3 * size, 16);
  RANK_EXPECT(status == EPX_ERROR_INVALID_ARGUMENT, "a count beyond int gave %s",
        epx_status_string(status));
  RANK_EXPECT(strstr(epx_last_error(),
               "test_counts: send_counts[0] is 2147483648 units, outside MPI's "
               "int range"),
        "message does not name the count");
  RANK_EXPECT(cc_is_poisoned(recv, sizeof recv), "a refused alltoallv wrote its output");
  status = COMM(comm)->ops->alltoallv(COMM(comm), "test_counts", send, counts + size, counts + size, recv,
                                counts + size, counts + size, (size_t)INT_MAX + 1);
  RANK_EXPECT(status == EPX_ERROR_INVALID_ARGUMENT && strstr(epx_last_error(), "unit is 2147483648"),
        "a unit beyond int gave %s", epx_status_string(status));
  status = COMM(comm)->ops->barrier(COMM(comm), "test_after");
  RANK_EXPECT(status == EPX_SUCCESS, "the comm did not survive a refusal: %s", epx_status_string(status));
  free(counts);
  RANK_EXPECT(epx_comm_destroy(comm) == EPX_SUCCESS, "epx_comm_destroy failed");
}

/* The skipper waits here until the others have timed out. */
static void mpi_side_sync(cc_timeout_t *t, int timed_out) {
  (void)t, (void)timed_out;
  MPI_Barrier(MPI_COMM_WORLD);
}

/* The last rank skips a barrier (the shared case): the others time out in
 * about the timeout naming it (each peer's message is its own request), then
 * fail at once. The skipper's comm has not failed. */
static void test_timeout(int size) {
  static char expected[128];
  snprintf(expected, sizeof expected, "test_timeout: rank %d did not arrive within 0.3 s (comm timeout_seconds)",
           size - 1);
  cc_timeout_t t = {size - 1, 1, 0.3, {expected, NULL}, "did not arrive within 0.3 s", 0, mpi_side_sync, 0};
  atomic_init(&t.timed_out, 0);
  epx_comm_t comm = create(MPI_COMM_WORLD, t.timeout);
  if (!comm) return;
  failures += cc_timeout_case(comm, &t);
  RANK_OK(epx_comm_destroy(comm));
}

static void test_arguments(void) {
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  MPI_Comm null_comm = MPI_COMM_NULL;
  epx_status_t status = epx_comm_create_mpi(NULL, NULL, &comm);
  RANK_EXPECT(status == EPX_ERROR_INVALID_ARGUMENT && strstr(epx_last_error(), "mpi_comm is NULL"),
        "NULL mpi_comm gave %s", epx_status_string(status));
  status = epx_comm_create_mpi(&null_comm, NULL, &comm);
  RANK_EXPECT(status == EPX_ERROR_INVALID_ARGUMENT && strstr(epx_last_error(), "MPI_COMM_NULL"),
        "MPI_COMM_NULL gave %s", epx_status_string(status));
  RANK_EXPECT(comm == poisoned, "a refused create wrote its output");
  RANK_EXPECT(epx_has_mpi() == 1, "epx_has_mpi() is %d in an MPI build", epx_has_mpi());
  /* A comm over a sub-communicator: ranks of it, not of the world. */
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half);
  epx_comm_t sub = create(half, 30.0);
  if (sub) {
    int half_size = 0, half_rank = 0;
    MPI_Comm_size(half, &half_size);
    MPI_Comm_rank(half, &half_rank);
    RANK_EXPECT(COMM(sub)->size == half_size && COMM(sub)->rank == half_rank, "sub comm is rank %d of %d", COMM(sub)->rank,
          COMM(sub)->size);
    failures += cc_ops_round(sub, 1, 0, NULL);
    RANK_EXPECT(epx_comm_destroy(sub) == EPX_SUCCESS, "epx_comm_destroy failed");
  }
  MPI_Comm_free(&half);
}

int main(int argc, char **argv) {
  int size = 0;
  tu_mpi_init(&argc, &argv, &rank, &size);
  test_ops(size);
  test_errors_return();
  test_int_counts(size);
  test_timeout(size);
  test_arguments();
  long long total = tu_mpi_sum(failures);
  if (rank == 0)
    printf("mpi_comm on %d ranks: %s (%lld failed checks)\n", size, total ? "FAILED" : "OK", total);
  return tu_mpi_exit(total);
}
