/* The hierarchical exchange over MPI (under mpiexec -np 2 and -np 4): the
 * cases of test_hier.c with processes as ranks, posed as nodes of 2 ranks
 * (-np 4: 2 x 2; -np 2: 1 x 2, one node), and the topology MPI finds itself
 * (MPI_Comm_split_type: every process of this host on one node). Every rank
 * makes every rank's routing from the shared seed; the failures of all ranks
 * are summed, rank 0 prints the verdict, and the exit status is it. */
#include <mpi.h>

#define HT_SCENE_ONLY
#include "test_hier.c"

#include "mpi_util.h"

static int found_topology(int rank, int size) {
  int failures = 0;
  MPI_Comm world = MPI_COMM_WORLD;
  epx_comm_t comm = NULL;
  RANK_REQUIRE_OK(epx_comm_create_mpi(&world, NULL, &comm));
  int32_t nodes = 0, per = 0, node = -1, local = -1;
  RANK_OK(epx_comm_topology(comm, &nodes, &per, &node, &local));
  RANK_EXPECT(nodes == 1 && per == size && node == 0 && local == rank,
              "MPI topology: %d nodes of %d, node %d, local %d; expected one node of this host's %d", nodes, per, node,
              local, size);
done:
  if (comm) RANK_OK(epx_comm_destroy(comm));
  return failures;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  long long failures = found_topology(rank, size);
  int32_t L = size >= 2 ? 2 : 1;
  epx_comm_t comm = NULL;
  if (tu_mpi_comm("mpi_hier", rank, size, size, 30.0, L, &comm)) {
    failures++;
  } else {
    failures += ht_topology_rank(comm, rank, size, L);
    for (int i = 0; i < HT_CASES; i++) {
      int f = ht_case_rank(comm, rank, size, L, &ht_cases[i], 0x5eed + (uint64_t)i);
      if (f) fprintf(stderr, "rank %d: case %d (%d ranks as nodes of %d) failed\n", rank, i, size, L);
      failures += f;
    }
    if (epx_comm_destroy(comm) != EPX_SUCCESS) failures++;
  }
  long long all = 0;
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("mpi_hier: %d ranks as nodes of %d: %s\n", size, L, all ? "FAILED" : "OK");
  MPI_Finalize();
  return all ? 1 : 0;
}
