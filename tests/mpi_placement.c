/* Expert placement over MPI (under mpiexec -np 2 and -np 4): the cases of
 * test_placement.c with processes as ranks, posed as nodes of 2 ranks —
 * replicated, permuted and caller-routed placements exact against the
 * plain-C reference on the dedup, collective and hierarchical exchanges,
 * the exchanges bit-identical with bf16 payloads, low-latency and fp8
 * unchanged, the replicas' gradient sum and the weight move. Every rank
 * makes the scene from the shared seed; the failures of all ranks are
 * summed, rank 0 prints the verdict, and the exit status is it. */
#include <mpi.h>

#define PL_SCENE_ONLY
#include "test_placement.c"

#include "mpi_util.h"

static const epx_exchange_t exchanges[] = {EPX_EXCHANGE_DEDUP, EPX_EXCHANGE_COLLECTIVE, EPX_EXCHANGE_HIERARCHICAL};

/* The exact cases of one placement on every exchange. */
static int exact_all(epx_comm_t comm, int rank, int size, scene_t *s, const char *what) {
  int failures = 0;
  map_scene(s);
  s->dtype = EPX_FLOAT32, s->layout = EPX_LAYOUT_EXPERT_MAJOR;
  for (int x = 0; x < 3; x++) {
    s->exchange = exchanges[x];
    int f = exact_rank(comm, rank, size, s);
    if (f) fprintf(stderr, "rank %d: %s, exchange %d failed\n", rank, what, x);
    failures += f;
  }
  return failures;
}

static int all_cases(epx_comm_t comm, int rank, int size) {
  int failures = 0;
  scene_t *s = calloc(1, sizeof *s);
  s->W = size;
  make_routing(s, 1);
  plan_replicated(s);
  failures += exact_all(comm, rank, size, s, "replicated");
  make_routing(s, 5);
  plan_permuted(s);
  failures += exact_all(comm, rank, size, s, "permuted");
  /* caller-given physical ids */
  make_routing(s, 7);
  plan_replicated(s);
  s->rule = EPX_REPLICA_CALLER;
  epx_placement_t pl = placement_of(s);
  epx_placement_table_t *t = NULL;
  if (epx_placement_table_new("test", "placement", &pl, E, s->W, &t) != EPX_SUCCESS) abort();
  tu_rng_t rng = {99};
  for (int32_t r = 0; r < s->W; r++)
    for (int64_t i = 0; i < s->T[r] * K; i++)
      if (s->idx[r][i] >= 0) {
        int32_t e = s->idx[r][i], n = t->replica_first[e + 1] - t->replica_first[e];
        s->idx[r][i] = t->replicas[t->replica_first[e] + tu_below(&rng, n)];
      }
  epx_placement_table_free(t);
  failures += exact_all(comm, rank, size, s, "caller ids");
  /* bf16: the exchanges bit-identical */
  make_routing(s, 21);
  plan_replicated(s);
  s->dtype = EPX_BFLOAT16;
  for (s->slot = 0; s->slot < 3; s->slot++) {
    s->exchange = exchanges[s->slot];
    failures += bits_rank(comm, rank, size, s);
  }
  if (s->out_hash[0][rank] != s->out_hash[1][rank] || s->out_hash[0][rank] != s->out_hash[2][rank]) {
    fprintf(stderr, "rank %d: the exchanges' bf16 outputs differ\n", rank);
    failures++;
  }
  s->exchange = EPX_EXCHANGE_DEDUP;
  failures += ll_fp8_rank(comm, rank, size, s);
  s->dtype = EPX_FLOAT32;
  failures += grad_move_rank(comm, rank, size, s);
  free(s);
  return failures;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  long long failures = 0;
  epx_comm_t comm = NULL;
  if (tu_mpi_comm("mpi_placement", rank, size, W_MAX, 30.0, size >= 2 ? 2 : 1, &comm)) {
    failures++;
  } else {
    failures += all_cases(comm, rank, size);
    if (epx_comm_destroy(comm) != EPX_SUCCESS) failures++;
  }
  long long all = 0;
  MPI_Allreduce(&failures, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("mpi_placement: %d ranks: %s\n", size, all ? "FAILED" : "OK");
  MPI_Finalize();
  return all ? 1 : 0;
}
