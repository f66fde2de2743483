/* The W-rank GPU programs (tests/gpu/mpi_gpu_*.c) with their ranks as
 * threads of one process on one GPU: the few MPI calls they make, played by
 * threads, and their NCCL comm replaced by a local one (epx_comm_create_local),
 * so every W-rank CUDA path runs over the in-process transport
 * (src/cuda/xport/xport.h). A tests/gpu/ranks_gpu_*.c includes this, then the
 * program with its main renamed, and runs it at W = 2, 4 and 8
 * (EPX_GPU_RANKS="2,4" chooses others; EPX_GPU_TIMEOUT the comm's timeout in
 * seconds, 30 by default). Nodes are posed (ranks_per_node: W / 2 ranks, one
 * for W = 2) so the hierarchical exchange has two nodes. The programs' rank
 * globals are thread-local (EPX_RANK_LOCAL). CUDA_DEVICE_MAX_CONNECTIONS=32
 * and CUDA_MODULE_LOADING=EAGER are set before CUDA starts. Exit status is
 * the verdict. */
#ifndef EPX_TESTS_GPU_THREAD_RANKS_H
#define EPX_TESTS_GPU_THREAD_RANKS_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "epx.h"
#include "rank_counts.h"

#define EPX_THREAD_RANKS 1
#define EPX_RANK_LOCAL _Thread_local
#define MPI_VERSION 3 /* tests/util/check.h: a fatal check ends every rank (MPI_Abort) */

typedef int MPI_Comm;
typedef int MPI_Datatype;
typedef int MPI_Op;
#define MPI_COMM_WORLD 0
#define MPI_INT 1
#define MPI_SUM 1

static _Thread_local int tr_rank;
static int tr_size;
static epx_local_world_t tr_world;
static pthread_barrier_t tr_barrier;
static pthread_mutex_t tr_lock = PTHREAD_MUTEX_INITIALIZER;
static long tr_sum;

static inline int MPI_Init(int *argc, char ***argv) { (void)argc, (void)argv; return 0; }
static inline int MPI_Finalize(void) { return 0; }
static inline int MPI_Comm_rank(MPI_Comm c, int *rank) { (void)c, *rank = tr_rank; return 0; }
static inline int MPI_Comm_size(MPI_Comm c, int *size) { (void)c, *size = tr_size; return 0; }
static inline int MPI_Barrier(MPI_Comm c) { (void)c, pthread_barrier_wait(&tr_barrier); return 0; }
static inline int MPI_Abort(MPI_Comm c, int code) {
  (void)c;
  fflush(stdout), fflush(stderr);
  _exit(code);
}
/* The sum of one int over the ranks (the programs' failure count). */
static inline int MPI_Allreduce(const void *send, void *recv, int count, MPI_Datatype t, MPI_Op op, MPI_Comm c) {
  (void)count, (void)t, (void)op, (void)c;
  pthread_barrier_wait(&tr_barrier);
  if (tr_rank == 0) tr_sum = 0;
  pthread_barrier_wait(&tr_barrier);
  pthread_mutex_lock(&tr_lock);
  tr_sum += *(const int *)send;
  pthread_mutex_unlock(&tr_lock);
  pthread_barrier_wait(&tr_barrier);
  *(int *)recv = (int)tr_sum;
  pthread_barrier_wait(&tr_barrier);
  return 0;
}
/* A rank's device-wide waits become waits for its own stream (the first it
 * creates) and the legacy stream: a device-wide wait would also wait for
 * the peers' fused kernels, which wait for this rank's next launch. */
static _Thread_local cudaStream_t tr_stream;
static inline cudaError_t tr_stream_create(cudaStream_t *stream, unsigned int flags) {
  const cudaError_t e = cudaStreamCreateWithFlags(stream, flags);
  if (e == cudaSuccess && !tr_stream) tr_stream = *stream;
  return e;
}
static inline cudaError_t tr_device_sync(void) {
  cudaError_t e = cudaStreamSynchronize(0);
  if (e == cudaSuccess && tr_stream) e = cudaStreamSynchronize(tr_stream);
  return e;
}
/* A rank's allocations are stream-ordered on its own stream: cudaFree waits
 * for the whole GPU, the peers' fused kernels too, which may be waiting for
 * this rank's next launch (a wait that ends only at the comm's timeout). */
static inline cudaStream_t tr_alloc_stream(void) {
  if (!tr_stream) (void)tr_stream_create(&tr_stream, cudaStreamNonBlocking);
  return tr_stream;
}
static inline cudaError_t tr_malloc(void **p, size_t bytes) {
  const cudaStream_t s = tr_alloc_stream();
  cudaError_t e = cudaMallocAsync(p, bytes, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  return e;
}
static inline cudaError_t tr_free(void *p) { return p ? cudaFreeAsync(p, tr_alloc_stream()) : cudaSuccess; }
#define cudaStreamCreateWithFlags tr_stream_create
#define cudaDeviceSynchronize tr_device_sync
#define cudaMalloc tr_malloc
#define cudaFree tr_free

/* The programs' NCCL comm: this thread's rank of the local world. */
static inline epx_status_t tr_comm_create(const void *mpi_comm, const epx_comm_config_t *config, epx_comm_t *comm) {
  (void)mpi_comm, (void)config;
  return epx_comm_create_local(tr_world, tr_rank, comm);
}
#define epx_comm_create_nccl_mpi tr_comm_create

typedef struct {
  int rank;
  int (*rank_main)(int, char **);
  int status;
} tr_thread_t;

static void *tr_thread(void *arg) {
  tr_thread_t *t = arg;
  tr_rank = t->rank;
  char name[] = "rank";
  char *argv[] = {name, NULL};
  t->status = t->rank_main(1, argv);
  return NULL;
}

/* Runs rank_main on W threads for each W; 0 when every run passed. */
static inline int tr_run(int (*rank_main)(int, char **), const char *program) {
  /* W streams, each waiting on the others' kernels, need W hardware queues
   * (8 by default): set before CUDA starts */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  /* kernels loaded at start, not at a first launch that may wait for the
   * GPU to idle (src/cuda/fused/setup.cu refuses the fused path without) */
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  int counts[RC_MAX_RUNS];
  const int runs = rc_rank_counts("2,4,8", counts);
  int failed = 0;
  for (int run = 0; run < runs; run++) {
    const int W = counts[run];
    tr_size = W;
    epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
    cc.timeout_seconds = rc_timeout_seconds();
    cc.ranks_per_node = rc_ranks_per_node(W);
    if (epx_local_world_create(W, &cc, &tr_world) != EPX_SUCCESS) {
      fprintf(stderr, "%s: W = %d: epx_local_world_create: %s\n", program, W, epx_last_error());
      return 2;
    }
    pthread_barrier_init(&tr_barrier, NULL, (unsigned)W);
    tr_thread_t *t = calloc((size_t)W, sizeof *t);
    pthread_t *th = calloc((size_t)W, sizeof *th);
    for (int r = 0; r < W; r++) {
      t[r] = (tr_thread_t){r, rank_main, 0};
      pthread_create(&th[r], NULL, tr_thread, &t[r]);
    }
    int bad = 0;
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL), bad |= t[r].status != 0;
    pthread_barrier_destroy(&tr_barrier);
    (void)epx_local_world_destroy(tr_world);
    printf("%s: W = %d ranks as threads on one GPU (in-process transport, nodes of %d): %s\n", program, W,
           (int)cc.ranks_per_node, bad ? "FAILED" : "OK");
    fflush(stdout);
    failed |= bad;
    free(t), free(th);
  }
  return failed;
}

#endif
