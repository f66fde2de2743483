/* tests/gpu/mpi_gpu_exchange.c with its ranks as processes of this host on
 * one GPU (proc_ranks.h: an shm comm, the ipc transport), at W = 2 and 4:
 * the host (every layout, dtype and weighting; both backward passes; cached
 * dispatch and the recorder), hierarchical (nodes posed) and fp8 paths,
 * each against the CPU backend on W threads, bit for bit (the fused path is
 * refused where processes share a GPU, and the host path serves its cases).
 * Exit status is the verdict. */
#include "proc_ranks.h"

#define main rank_main
#include "mpi_gpu_exchange.c"
#undef main

int main(void) { return pr_run(rank_main, "ipc_gpu_exchange"); }
