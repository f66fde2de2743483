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
  int rank = 0, size = 1;
  tu_mpi_init(&argc, &argv, &rank, &size);
  epx_comm_t comm = NULL;
  long long failures = tu_mpi_comm("mpi_ll", rank, size, LL_MAX_W, 20.0, 0, &comm);
  long long all = tu_mpi_sum(failures);
  static ll_case_t cases[64];
  int n = ll_cases(cases), run = 0;
  for (int i = 0; i < n && !all; i++) {
    if (cases[i].E % size) continue;
    char d[256], what[300];
    ll_describe(&cases[i], d, sizeof d);
    snprintf(what, sizeof what, "case %d [%s]", i, d);
    /* A failed case may have failed the comm. */
    all = tu_mpi_step("mpi_ll", what, rank, ll_case_rank(comm, rank, size, &cases[i]), &failures);
    run++;
  }
  if (!all) all = tu_mpi_step("mpi_ll", "fp8 step", rank, ll_fp8_rank(comm, rank, size), &failures);
  if (!all) tu_mpi_step("mpi_ll", "oversize step", rank, ll_oversize_rank(comm, rank, size), &failures);
  failures += tu_mpi_comm_destroy(rank, comm);
  all = tu_mpi_sum(failures);
  if (rank == 0) printf("mpi_ll: %d ranks, %d cases: %s (%lld failures)\n", size, run, all ? "FAILED" : "OK", all);
  return tu_mpi_exit(all);
}
