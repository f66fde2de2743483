/* The low-latency decode mode over the MPI transport (run under mpiexec -np 2
 * and 4): test_ll's cases with ranks as processes — every received row its
 * source token's, in the normal exchange's place and order, counts and
 * sources the normal layout's, combine the normal combine's bits, the two
 * phases and the count by pointer the same — the fp8 dispatch, and the
 * oversize step refused on every rank. Plain checks; the failures of all
 * ranks are summed, rank 0 prints the summary, and the exit status is the
 * verdict. */
#include <mpi.h>

#define LL_SCENE_ONLY
#include "test_ll.c"

#include "mpi_util.h"

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  epx_comm_t comm = NULL;
  long long failures = tu_mpi_comm("mpi_ll", rank, size, LL_MAX_W, 20.0, 0, &comm), all = 0;
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  static ll_case_t cases[64];
  int n = ll_cases(cases), run = 0;
  for (int i = 0; i < n && !all; i++) {
    if (cases[i].E % size) continue;
    long long mine = ll_case_rank(comm, rank, size, &cases[i]), sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (sum && rank == 0) {
      char d[256];
      ll_describe(&cases[i], d, sizeof d);
      fprintf(stderr, "mpi_ll: case %d [%s]: %lld failure(s)\n", i, d, sum);
    }
    failures += mine;
    all = sum; /* a failed case may have failed the comm */
    run++;
  }
  if (!all) {
    long long mine = ll_fp8_rank(comm, rank, size), sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (sum && rank == 0) fprintf(stderr, "mpi_ll: fp8 step: %lld failure(s)\n", sum);
    failures += mine;
    all = sum;
  }
  if (!all) {
    long long mine = ll_oversize_rank(comm, rank, size), sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (sum && rank == 0) fprintf(stderr, "mpi_ll: oversize step: %lld failure(s)\n", sum);
    failures += mine;
  }
  if (comm && epx_comm_destroy(comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_destroy: %s\n", rank, epx_last_error());
    failures++;
  }
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("mpi_ll: %d ranks, %d cases: %s (%lld failures)\n", size, run, all ? "FAILED" : "OK", all);
  MPI_Finalize();
  return all ? 1 : 0;
}
