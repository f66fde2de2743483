/* The fp8 dispatch scenes of test_fp8.c over the MPI transport (run under
 * mpiexec -np 2 and 4; at 4 ranks once more as 2 nodes of 2 with the
 * hierarchical exchange): every rank builds every rank's inputs from the
 * scene's seed and checks its received rows and scales against their
 * sources. The failures of all ranks are summed, rank 0 prints the summary,
 * and the exit status is the verdict. */
#include <mpi.h>

#define FP8_SCENE_ONLY
#include "test_fp8.c"

#include "mpi_util.h"

/* Every scene over a comm of `ranks_per_node` (0: as MPI finds it); with
 * posed nodes, each scene with the hierarchical exchange. Returns this
 * rank's failures. */
static long long run_pass(int rank, int size, int32_t ranks_per_node) {
  epx_comm_t comm = NULL;
  long long failures = tu_mpi_comm("mpi_fp8", rank, size, FP8_MAX_W, 20.0, ranks_per_node, &comm), failed_scenes = 0;
  long long all = 0;
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  static fp8_scene_t scenes[64];
  int n = all ? 0 : fp8_scenes(scenes, size);
  for (int i = 0; i < n && !failed_scenes; i++) {
    fp8_scene_t *s = &scenes[i];
    if (ranks_per_node) s->exchange = EPX_EXCHANGE_HIERARCHICAL;
    long long mine = fp8_scene_build(s) ? 1 : 0, scene_failures = 0;
    if (!mine) mine = fp8_scene_rank(comm, rank, s);
    MPI_Allreduce(&mine, &scene_failures, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (scene_failures && rank == 0) {
      char d[256];
      fp8_describe(s, d, sizeof d);
      fprintf(stderr, "mpi_fp8: scene %d [%s]: %lld failure(s)\n", i, d, scene_failures);
    }
    failures += mine;
    /* A failed scene may have failed the comm; later ones would repeat it. */
    failed_scenes += scene_failures > 0;
    fp8_scene_free(s);
  }
  if (comm && epx_comm_destroy(comm) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: epx_comm_destroy: %s\n", rank, epx_last_error());
    failures++;
  }
  if (rank == 0) printf("mpi_fp8: %d ranks%s, %d scenes\n", size, ranks_per_node ? " as 2-rank nodes" : "", n);
  return failures;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  long long failures = run_pass(rank, size, 0), all = 0;
  if (size == 4) failures += run_pass(rank, size, 2);
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("mpi_fp8: %s\n", all ? "FAILED" : "OK");
  MPI_Finalize();
  return all ? 1 : 0;
}
