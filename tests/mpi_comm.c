/* The MPI transport under mpiexec (-np 2 and 4): every collective with
 * payloads that encode (source, destination, index), the caller's
 * communicator left untouched, MPI errors returned as a status, counts beyond
 * int refused, and a rank that skips a collective turned into a timeout.
 * Plain checks; the failures of all ranks are summed and the exit status is
 * the verdict. */
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"
#include "comm/comm.h"
#include "core/registry.h"

/* The comm behind a public comm id (core/registry.h): these tests call its
 * transport directly. */
static epx_comm_t comm_object(epx_comm_t id) { return epx_registry_get(id, EPX_OBJECT_COMM); }

/* Under -DEPX_SANITIZE=ON: OpenMPI's own allocations outlive MPI_Finalize
 * and would be reported as leaks; epx's are not suppressed. Its components
 * lack frame pointers, so only the slow unwinder reaches the library frames
 * the suppressions name. */
const char *__asan_default_options(void) { return "fast_unwind_on_malloc=0"; }
const char *__lsan_default_suppressions(void) {
  return "leak:libmpi.so\nleak:libopen-pal.so\nleak:libopen-rte.so\nleak:mca_\n"
         "leak:libhwloc.so\nleak:libevent\nleak:libpmix.so\n";
}

static int rank = -1;
static int errors;

#define CHECK(cond, ...)                                     \
  do {                                                       \
    if (!(cond)) {                                           \
      fprintf(stderr, "rank %d, line %d: ", rank, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                          \
      fprintf(stderr, " [%s]\n", epx_last_error());          \
      errors++;                                              \
    }                                                        \
  } while (0)

static double now_seconds(void) { return MPI_Wtime(); }

static void sleep_seconds(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - floor(seconds)) * 1e9)};
  nanosleep(&ts, NULL);
}

static uint64_t mix(uint64_t a, uint64_t b) {
  tu_rng_t rng = {a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull)};
  return tu_next(&rng);
}

/* Word k of unit i that src sends to dst in round `seed`. */
static uint32_t word_of(uint64_t seed, int32_t src, int32_t dst, int64_t i, size_t k) {
  if (k == 0) return (uint32_t)src << 16 | (uint32_t)(dst & 0xffff);
  if (k == 1) return (uint32_t)i;
  return (uint32_t)mix(mix(mix(seed, (uint64_t)src), (uint64_t)dst * 1000003u + (uint64_t)i), k);
}

static void fill_units(uint32_t *words, size_t unit_words, int64_t units, uint64_t seed,
                       int32_t src, int32_t dst) {
  for (int64_t i = 0; i < units; i++)
    for (size_t k = 0; k < unit_words; k++)
      words[(size_t)i * unit_words + k] = word_of(seed, src, dst, i, k);
}

static int units_match(const uint32_t *recv, size_t unit_words, int64_t count, uint64_t seed,
                       int32_t src, int32_t dst) {
  for (int64_t i = 0; i < count; i++)
    for (size_t k = 0; k < unit_words; k++)
      if (recv[(size_t)i * unit_words + k] != word_of(seed, src, dst, i, k)) return 0;
  return 1;
}

static int64_t pair_count(uint64_t seed, int32_t src, int32_t dst, int64_t max) {
  uint64_t v = mix(mix(seed, (uint64_t)src + 77), (uint64_t)dst + 991);
  return v % 4 == 0 ? 0 : (int64_t)((v >> 8) % (uint64_t)(max + 1));
}

static int is_poisoned(const void *data, size_t bytes) {
  const unsigned char *p = data;
  for (size_t i = 0; i < bytes; i++)
    if (p[i] != 0xA5) return 0;
  return 1;
}

static epx_comm_t create(MPI_Comm mpi_comm, double timeout_seconds) {
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = timeout_seconds;
  epx_comm_t comm = NULL;
  epx_status_t status = epx_comm_create_mpi(&mpi_comm, &config, &comm);
  CHECK(status == EPX_SUCCESS && comm, "epx_comm_create_mpi gave %s", epx_status_string(status));
  return status == EPX_SUCCESS ? comm : NULL;
}

/* One round of every collective; send buffers are overwritten as soon as a
 * call returns. */
static void ops_round(epx_comm_t comm, int32_t size, int round, int big) {
  const int32_t me = comm_object(comm)->rank; /* of this comm, which may be a sub-communicator */
  const uint64_t seed = 2000 + (uint64_t)round;
  const size_t unit_words = big ? 1024 : 3, unit = unit_words * 4;
  const int64_t max_count = big ? 64 : 9;
  int64_t *counts = calloc(4 * (size_t)size, sizeof(int64_t));
  int64_t *send_counts = counts, *send_displs = counts + size;
  int64_t *recv_counts = counts + 2 * size, *recv_displs = counts + 3 * size;

  /* alltoall */
  const size_t block_words = 2 + (size_t)(round % 3), bytes = block_words * 4;
  uint32_t *send = tu_alloc(bytes * (size_t)size), *recv = tu_alloc(bytes * (size_t)size);
  for (int32_t d = 0; d < size; d++)
    fill_units(send + d * block_words, block_words, 1, seed, me, d);
  tu_poison(recv, bytes * (size_t)size);
  epx_status_t status = comm_object(comm)->ops->alltoall(comm_object(comm), "test_alltoall", send, recv, bytes);
  CHECK(status == EPX_SUCCESS, "alltoall gave %s", epx_status_string(status));
  tu_poison(send, bytes * (size_t)size);
  for (int32_t s = 0; s < size; s++)
    CHECK(units_match(recv + s * block_words, block_words, 1, seed, s, me),
          "alltoall block from %d wrong", s);

  /* allgather */
  fill_units(send, block_words, 1, seed, me, -1);
  tu_poison(recv, bytes * (size_t)size);
  status = comm_object(comm)->ops->allgather(comm_object(comm), "test_allgather", send, recv, bytes);
  CHECK(status == EPX_SUCCESS, "allgather gave %s", epx_status_string(status));
  for (int32_t s = 0; s < size; s++)
    CHECK(units_match(recv + s * block_words, block_words, 1, seed, s, -1),
          "allgather block %d wrong", s);
  tu_free(send), tu_free(recv);

  /* alltoallv with random counts (zeros too) and an untouched unit before
   * every piece. */
  int64_t send_units = 0, recv_units = 0;
  for (int32_t r = 0; r < size; r++) {
    send_counts[r] = pair_count(seed, me, r, max_count);
    send_displs[r] = send_units + 1;
    send_units += send_counts[r] + 1;
    recv_counts[r] = pair_count(seed, r, me, max_count);
    recv_displs[r] = recv_units + 1;
    recv_units += recv_counts[r] + 1;
  }
  send = tu_alloc((size_t)send_units * unit);
  recv = tu_alloc((size_t)recv_units * unit);
  uint32_t *copy = tu_alloc((size_t)send_units * unit);
  for (int32_t d = 0; d < size; d++)
    fill_units(send + (size_t)send_displs[d] * unit_words, unit_words, send_counts[d], seed, me, d);
  memcpy(copy, send, (size_t)send_units * unit);
  tu_poison(recv, (size_t)recv_units * unit);
  status = comm_object(comm)->ops->alltoallv(comm_object(comm), "test_alltoallv", send, send_counts, send_displs, recv,
                                recv_counts, recv_displs, unit);
  CHECK(status == EPX_SUCCESS, "alltoallv gave %s", epx_status_string(status));
  CHECK(!memcmp(copy, send, (size_t)send_units * unit), "alltoallv changed its send buffer");
  for (int32_t s = 0; s < size; s++) {
    CHECK(units_match(recv + (size_t)recv_displs[s] * unit_words, unit_words, recv_counts[s], seed,
                      s, me),
          "alltoallv piece from %d (%lld units of %zu bytes) wrong", s, (long long)recv_counts[s],
          unit);
    CHECK(is_poisoned(recv + (size_t)(recv_displs[s] - 1) * unit_words, unit),
          "alltoallv wrote the gap before the piece from %d", s);
  }
  tu_free(send), tu_free(recv), tu_free(copy);

  /* allreduce max of signed values every rank can compute */
  const int32_t count = 3 + round * 37;
  int64_t *values = calloc((size_t)count, sizeof *values);
  for (int32_t i = 0; i < count; i++) values[i] = (int64_t)mix(seed + (uint64_t)me, (uint64_t)i);
  status = comm_object(comm)->ops->allreduce_max_i64(comm_object(comm), "test_allreduce", values, count);
  CHECK(status == EPX_SUCCESS, "allreduce gave %s", epx_status_string(status));
  for (int32_t i = 0; i < count; i++) {
    int64_t expected = (int64_t)mix(seed, (uint64_t)i);
    for (int32_t r = 1; r < size; r++)
      if ((int64_t)mix(seed + (uint64_t)r, (uint64_t)i) > expected)
        expected = (int64_t)mix(seed + (uint64_t)r, (uint64_t)i);
    CHECK(values[i] == expected, "allreduce value %d is %lld, expected %lld", i,
          (long long)values[i], (long long)expected);
  }
  free(values);
  free(counts);

  /* barrier: nobody leaves before the last rank, which arrives 0.1 s late */
  if (me == size - 1) sleep_seconds(0.1);
  double t0 = now_seconds();
  status = comm_object(comm)->ops->barrier(comm_object(comm), "test_barrier");
  CHECK(status == EPX_SUCCESS, "barrier gave %s", epx_status_string(status));
  if (me != size - 1)
    CHECK(now_seconds() - t0 > 0.05, "barrier returned after %.3f s, before the late rank",
          now_seconds() - t0);
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
  CHECK(epx_comm_rank(comm, &got) == EPX_SUCCESS && got == rank, "epx_comm_rank gave %d", got);
  CHECK(epx_comm_size(comm, &got) == EPX_SUCCESS && got == size, "epx_comm_size gave %d", got);
  CHECK(!strcmp(comm_object(comm)->ops->name, "mpi"), "transport is %s", comm_object(comm)->ops->name);
  for (int round = 0; round < 5; round++) ops_round(comm, size, round, round == 4);
  CHECK(epx_comm_destroy(comm) == EPX_SUCCESS, "epx_comm_destroy failed");

  MPI_Isend(&token_out, 1, MPI_INT, (rank + 1) % size, 7, MPI_COMM_WORLD, &send_request);
  MPI_Status recv_status;
  MPI_Wait(&recv_request, &recv_status);
  MPI_Wait(&send_request, MPI_STATUS_IGNORE);
  CHECK(token_in == 4242 + (rank + size - 1) % size && recv_status.MPI_TAG == 7,
        "the caller's message arrived as %d (tag %d)", token_in, recv_status.MPI_TAG);
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &after);
  CHECK(before == after && after == MPI_ERRORS_ARE_FATAL,
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
  epx_status_t status = comm_object(comm)->ops->allreduce_max_i64(comm_object(comm), "test_error", values, -1);
  CHECK(status == EPX_ERROR_TRANSPORT, "a negative MPI count gave %s", epx_status_string(status));
  CHECK(strstr(epx_last_error(), "test_error: MPI_Irecv returned \""),
        "message lacks MPI's own text");
  CHECK(values[0] == 1 && values[1] == 2, "a failed allreduce changed its values");
  double t0 = now_seconds();
  status = comm_object(comm)->ops->barrier(comm_object(comm), "test_after");
  CHECK(status == EPX_ERROR_PEER_FAILED && now_seconds() - t0 < 0.5,
        "barrier on a failed comm gave %s", epx_status_string(status));
  CHECK(strstr(epx_last_error(), "test_after: the comm failed earlier: MPI_Irecv returned"),
        "later message does not say why the comm failed");
  CHECK(epx_comm_check_alive(comm_object(comm), "test_alive") == EPX_ERROR_PEER_FAILED,
        "epx_comm_check_alive missed the failure");
  CHECK(epx_comm_destroy(comm) == EPX_SUCCESS, "destroying a failed comm failed");
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
  epx_status_t status = comm_object(comm)->ops->alltoallv(comm_object(comm), "test_counts", send, counts, counts + size, recv,
                                             counts + 2 * size, counts + 3 * size, 16);
  CHECK(status == EPX_ERROR_INVALID_ARGUMENT, "a count beyond int gave %s",
        epx_status_string(status));
  CHECK(strstr(epx_last_error(),
               "test_counts: send_counts[0] is 2147483648 units, outside MPI's "
               "int range"),
        "message does not name the count");
  CHECK(is_poisoned(recv, sizeof recv), "a refused alltoallv wrote its output");
  status = comm_object(comm)->ops->alltoallv(comm_object(comm), "test_counts", send, counts + size, counts + size, recv,
                                counts + size, counts + size, (size_t)INT_MAX + 1);
  CHECK(status == EPX_ERROR_INVALID_ARGUMENT && strstr(epx_last_error(), "unit is 2147483648"),
        "a unit beyond int gave %s", epx_status_string(status));
  status = comm_object(comm)->ops->barrier(comm_object(comm), "test_after");
  CHECK(status == EPX_SUCCESS, "the comm did not survive a refusal: %s", epx_status_string(status));
  free(counts);
  CHECK(epx_comm_destroy(comm) == EPX_SUCCESS, "epx_comm_destroy failed");
}

/* The last rank skips a barrier: the others time out in about the timeout,
 * then fail at once. */
static void test_timeout(int size) {
  const double timeout = 0.3;
  epx_comm_t comm = create(MPI_COMM_WORLD, timeout);
  if (!comm) return;
  if (rank != size - 1) {
    double t0 = now_seconds();
    epx_status_t status = comm_object(comm)->ops->barrier(comm_object(comm), "test_timeout");
    double elapsed = now_seconds() - t0;
    CHECK(status == EPX_ERROR_TIMEOUT, "a skipped barrier gave %s", epx_status_string(status));
    char needle[96];
    snprintf(needle, sizeof needle, "test_timeout: rank %d did not arrive within 0.3 s "
             "(comm timeout_seconds)", size - 1);
    CHECK(strstr(epx_last_error(), needle), "timeout message does not name the silent rank");
    CHECK(elapsed >= 0.25 && elapsed < timeout + 3.0, "timed out after %.3f s", elapsed);
  }
  /* The skipper waits here until the others have timed out. */
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank != size - 1) {
    double t0 = now_seconds();
    epx_status_t status = comm_object(comm)->ops->alltoall(comm_object(comm), "test_after", NULL, NULL, 0);
    CHECK(status == EPX_ERROR_PEER_FAILED && now_seconds() - t0 < 0.1,
          "a call on the timed-out comm gave %s", epx_status_string(status));
    CHECK(strstr(epx_last_error(), "test_after: the comm failed earlier: rank ") &&
              strstr(epx_last_error(), "did not arrive within 0.3 s"),
          "later message does not say why");
  }
  CHECK(epx_comm_destroy(comm) == EPX_SUCCESS, "epx_comm_destroy failed");
}

static void test_arguments(void) {
  epx_comm_t comm = (epx_comm_t)(uintptr_t)0xA5A5A5A5;
  const epx_comm_t poisoned = comm;
  MPI_Comm null_comm = MPI_COMM_NULL;
  epx_status_t status = epx_comm_create_mpi(NULL, NULL, &comm);
  CHECK(status == EPX_ERROR_INVALID_ARGUMENT && strstr(epx_last_error(), "mpi_comm is NULL"),
        "NULL mpi_comm gave %s", epx_status_string(status));
  status = epx_comm_create_mpi(&null_comm, NULL, &comm);
  CHECK(status == EPX_ERROR_INVALID_ARGUMENT && strstr(epx_last_error(), "MPI_COMM_NULL"),
        "MPI_COMM_NULL gave %s", epx_status_string(status));
  CHECK(comm == poisoned, "a refused create wrote its output");
  CHECK(epx_has_mpi() == 1, "epx_has_mpi() is %d in an MPI build", epx_has_mpi());
  /* A comm over a sub-communicator: ranks of it, not of the world. */
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half);
  epx_comm_t sub = create(half, 30.0);
  if (sub) {
    int half_size = 0, half_rank = 0;
    MPI_Comm_size(half, &half_size);
    MPI_Comm_rank(half, &half_rank);
    CHECK(comm_object(sub)->size == half_size && comm_object(sub)->rank == half_rank,
          "sub comm is rank %d of %d", comm_object(sub)->rank, comm_object(sub)->size);
    ops_round(sub, half_size, 1, 0);
    CHECK(epx_comm_destroy(sub) == EPX_SUCCESS, "epx_comm_destroy failed");
  }
  MPI_Comm_free(&half);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  test_ops(size);
  test_errors_return();
  test_int_counts(size);
  test_timeout(size);
  test_arguments();
  int total = 0;
  MPI_Allreduce(&errors, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0)
    printf("mpi_comm on %d ranks: %s (%d failed checks)\n", size, total ? "FAILED" : "OK", total);
  MPI_Finalize();
  return total ? 1 : 0;
}
