/* What the programs that run one rank per GPU under mpirun share (the 2-GPU
 * test tests/gpu/mpi_gpu_exchange.c and bench/gpu/bench_ep.c): a failed epx
 * or CUDA call prints the rank, the place and why, and aborts every rank (an
 * exit of one rank would leave its peers waiting in NCCL); and the
 * splitmix64 step their seeded routings are drawn with. The includer defines
 * `static int g_rank`. */
#ifndef EPX_TESTS_GPU_MPI_GPU_CHECK_H
#define EPX_TESTS_GPU_MPI_GPU_CHECK_H

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "epx.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    epx_status_t s_ = (call);                                                                       \
    if (s_ != EPX_SUCCESS) {                                                                        \
      fprintf(stderr, "rank %d: %s:%d: %s -> %s: %s\n", g_rank, __FILE__, __LINE__, #call,          \
              epx_status_string(s_), epx_last_error());                                             \
      MPI_Abort(MPI_COMM_WORLD, 2);                                                                 \
    }                                                                                               \
  } while (0)

#define CU(call)                                                                                    \
  do {                                                                                              \
    cudaError_t e_ = (call);                                                                        \
    if (e_ != cudaSuccess) {                                                                        \
      fprintf(stderr, "rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      MPI_Abort(MPI_COMM_WORLD, 3);                                                                 \
    }                                                                                               \
  } while (0)

static inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

#endif
