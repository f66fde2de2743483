/* The exchange over the MPI transport (run under mpiexec -np 2 and 4): the
 * checks of test_multirank's parity cases — dedup and collective bit-identical,
 * every received row checked against its source, counts, offsets and stats
 * against a plain reference, results against the float64 and the contract's
 * float32 references, the capacity layout against the dense einsums; and its
 * agreement cases (mismatched calls, per-rank top_k, combine precision) — with
 * ranks as processes. Every rank regenerates every rank's routing from the
 * shared seed. Plain checks; the failures of all ranks are summed, rank 0
 * prints the summary, and the exit status is the verdict. */
#include <mpi.h>

#define MR_SCENE_ONLY
#include "test_multirank.c"

#include "mpi_util.h"

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  double start = MPI_Wtime();
  long long failures = 0, failed_cases = 0;
  int cases_run = 0;
  epx_comm_t comm = NULL;
  failures = tu_mpi_comm("mpi_exchange", rank, size, MR_MAX_W, 20.0, 0, &comm);
  long long all = 0;
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);

  /* E: 16 experts, or the next multiple of the world size. */
  int32_t E = (16 + size - 1) / size * size;
  static mr_case_t cases[256];
  int n = mr_cases(cases);
  for (int i = 0; i < n && !all; i++) {
    mr_scene_t s;
    mr_scene_init(&s, &cases[i], i, size, E, 0x3c0ffee0u + (uint64_t)size);
    long long mine = mr_scene_build(&s) ? 1 : 0;
    if (!mine) mine = mr_check_scene_rank(comm, rank, &s);
    long long case_failures = 0;
    MPI_Allreduce(&mine, &case_failures, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (case_failures && rank == 0) {
      char d[256];
      mr_describe(&s, d, sizeof d);
      fprintf(stderr, "mpi_exchange: case %d [%s]: %lld failure(s)\n", i, d, case_failures);
    }
    failures += mine;
    failed_cases += case_failures > 0;
    cases_run++;
    mr_scene_free(&s);
    /* A failed case may have failed the comm (a rank left a collective
     * early); later cases would only repeat it. */
    all = failed_cases;
  }
  /* Mismatched calls refused on every rank, per-rank top_k, combine
   * precision against its definition. */
  if (!all) {
    long long mine = mr_agreement_cases_rank(comm, rank, size, NULL), agreement = 0;
    MPI_Allreduce(&mine, &agreement, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (agreement && rank == 0) fprintf(stderr, "mpi_exchange: agreement cases: %lld failure(s)\n", agreement);
    failures += mine;
  }
  if (comm && epx_comm_destroy(comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_destroy: %s\n", rank, epx_last_error());
    failures++;
  }
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0)
    printf("mpi_exchange: %d ranks, %d of %d cases, %lld failure(s), %.1f s: %s\n", size, cases_run, n, all,
           MPI_Wtime() - start, all ? "FAILED" : "OK");
  MPI_Finalize();
  return all ? 1 : 0;
}
