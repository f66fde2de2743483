/* tests/gpu/mpi_gpu_exchange.c with its ranks as threads of this process on
 * one GPU (thread_ranks.h: a local comm, the in-process transport), at W =
 * 2, 4 and 8: the host, fused (rank-major, expert-major, capacity; every
 * weighting; both backward passes; cached dispatch and the recorder; relayed
 * peers), hierarchical (nodes posed) and fp8 paths, each against the CPU
 * backend on W threads, bit for bit. Exit status is the verdict. */
#include "thread_ranks.h"

#define main rank_main
#include "mpi_gpu_exchange.c"
#undef main

int main(void) { return tr_run(rank_main, "ranks_gpu_exchange"); }
