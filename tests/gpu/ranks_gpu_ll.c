/* tests/gpu/mpi_gpu_ll.c with its ranks as threads of this process on one
 * GPU (thread_ranks.h: a local comm, the in-process transport), at W = 2, 4
 * and 8: the low-latency slabs and window, device counts, graph replay (the
 * window), fp8 and rank-major, each against the normal W-rank exchange on
 * the same comm (itself checked against the CPU backend by
 * ranks_gpu_exchange). Exit status is the verdict. */
#include "thread_ranks.h"

#define main rank_main
#include "mpi_gpu_ll.c"
#undef main

int main(void) { return tr_run(rank_main, "ranks_gpu_ll"); }
