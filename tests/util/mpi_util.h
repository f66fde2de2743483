/* What every MPI test (tests/mpi_*.c, one translation unit each) shares:
 * the sanitizers' view of OpenMPI, and an epx comm over MPI_COMM_WORLD. */
#ifndef EPX_TEST_MPI_UTIL_H
#define EPX_TEST_MPI_UTIL_H

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>

#include "epx.h"

/* Under -DEPX_SANITIZE=ON: OpenMPI's own allocations outlive MPI_Finalize
 * and would be reported as leaks; epx's are not suppressed. Its components
 * lack frame pointers, so only the slow unwinder reaches the library frames
 * the suppressions name. */
const char *__asan_default_options(void) { return "fast_unwind_on_malloc=0"; }
const char *__lsan_default_suppressions(void) {
  return "leak:libmpi.so\nleak:libopen-pal.so\nleak:libopen-rte.so\nleak:mca_\n"
         "leak:libhwloc.so\nleak:libevent\nleak:libpmix.so\n";
}

/* *comm over MPI_COMM_WORLD (timeout_seconds; ranks_per_node 0: as MPI
 * finds the nodes) for a test of at most max_ranks ranks. Returns 0, or 1
 * after saying why there is none (*comm stays NULL). */
static inline int tu_mpi_comm(const char *test, int rank, int size, int max_ranks, double timeout_seconds,
                              int32_t ranks_per_node, epx_comm_t *comm) {
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = timeout_seconds;
  config.ranks_per_node = ranks_per_node;
  MPI_Comm world = MPI_COMM_WORLD;
  *comm = NULL;
  if (size > max_ranks) {
    if (rank == 0) fprintf(stderr, "%s: at most %d ranks\n", test, max_ranks);
    return 1;
  }
  if (epx_comm_create_mpi(&world, &config, comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_create_mpi: %s\n", rank, epx_last_error());
    return 1;
  }
  return 0;
}

#endif
