/* What the programs that run one rank per GPU under mpirun share (the 2-GPU
 * test tests/gpu/mpi_gpu_exchange.c and bench/gpu/bench_ep.c): check.h's
 * checks, naming the includer's `static int g_rank` (a failed epx or CUDA
 * call, FATAL_UNLESS_OK / FATAL_UNLESS_CUDA_OK, aborts every rank: an exit
 * of one rank would leave its peers waiting in NCCL); the splitmix64
 * step their seeded routings are drawn with; and a rank's GPU and stream. */
#ifndef EPX_TESTS_GPU_MPI_GPU_CHECK_H
#define EPX_TESTS_GPU_MPI_GPU_CHECK_H

#if !defined(EPX_THREAD_RANKS) && !defined(EPX_PROC_RANKS) /* thread_ranks.h, proc_ranks.h play MPI */
#include <mpi.h>
#endif
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "epx.h"

/* A rank's globals: per process under MPI, per thread under thread_ranks.h. */
#ifndef EPX_RANK_LOCAL
#define EPX_RANK_LOCAL
#endif

/* Ranks as threads of one process (thread_ranks.h): what they share (the
 * launch flags, process-wide) changes only between two barriers of every
 * rank; and the in-process transport's moves are not captured in CUDA
 * graphs (src/cuda/xport/xport.h), so graphs run on the fused paths only.
 * Ranks as processes sharing one GPU (proc_ranks.h): the ipc transport's
 * moves are not captured either, and the fused paths are refused (the
 * processes take turns on the GPU), so nothing runs in a graph.
 * RANKS_GRAPHS: 2, graphs on every path; 1, on the fused paths; 0, none. */
#ifdef EPX_THREAD_RANKS
#define RANKS_IN_PROCESS 1
#define RANKS_GRAPHS 1
static inline void rank_sync(void) { MPI_Barrier(MPI_COMM_WORLD); }
#elif defined(EPX_PROC_RANKS)
#define RANKS_IN_PROCESS 0
#define RANKS_GRAPHS 0
static inline void rank_sync(void) {}
#else
#define RANKS_IN_PROCESS 0
#define RANKS_GRAPHS 2
static inline void rank_sync(void) {}
#endif

#ifndef CHECK_RANK
#define CHECK_RANK g_rank
#endif
#include "../util/check.h"

static inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The rank's GPU (rank modulo the GPUs this host has) made current, and a
 * non-blocking stream on it (the parameter is check.h's CHECK_RANK). */
static inline cudaStream_t mpi_gpu_rank_stream(int g_rank) {
  int devices = 0;
  FATAL_UNLESS_CUDA_OK(cudaGetDeviceCount(&devices));
  FATAL_UNLESS_CUDA_OK(cudaSetDevice(g_rank % devices));
  cudaStream_t stream;
  FATAL_UNLESS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

#endif
