/* tests/gpu/mpi_gpu_ll.c with its ranks as processes of this host on one
 * GPU (proc_ranks.h: an shm comm, the ipc transport), at W = 2 and 4: the
 * low-latency slabs (the window is refused where processes share a GPU),
 * device counts, fp8 and rank-major, each against the normal W-rank
 * exchange on the same comm (itself checked against the CPU backend by
 * ipc_gpu_exchange). Exit status is the verdict. */
#include "proc_ranks.h"

#define main rank_main
#include "mpi_gpu_ll.c"
#undef main

int main(void) { return pr_run(rank_main, "ipc_gpu_ll"); }
