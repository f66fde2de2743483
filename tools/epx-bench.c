/*
 * epx-bench — the main job of epx.
 *
 * With no arguments it runs a whole Mixture-of-Experts layer step on 4
 * in-process ranks: route (softmax, top-k) -> dispatch_layout + dispatch ->
 * a SwiGLU expert FFN per local expert (OpenBLAS sgemm on the received rows)
 * -> combine, then the backward of all of it (combine_backward with grad_w,
 * the SwiGLU backward, dispatch_backward, route_backward). It times every
 * phase (median over iterations of the slowest rank), reports the rows and
 * bytes that crossed ranks against a memcpy ceiling measured in the same run,
 * runs the dedup and the collective exchange on the same routing, checks that
 * they agree bit for bit, and checks both against a dense reference computed
 * here: each token's output as sum_k w_k * FFN_e(x) and the gradients of x,
 * of the weights and of the logits.
 *
 * --single is the one-rank microbenchmark of the data-movement calls against
 * memcpy and the dense one-hot reference (epx_reference_dense_*).
 *
 * Under mpirun (or --transport mpi) each process is one rank of an MPI comm
 * and rank 0 prints. With --device cuda (under mpirun, one process per GPU)
 * the buffers are CUDA buffers over an NCCL comm made from a unique id shared
 * over MPI (epx_comm_create_nccl_mpi), routing and its backward run on the
 * GPU, and the experts stay on the host: each phase copies its inputs to the
 * GPU and its outputs back outside the timed region, so the same checks
 * apply unchanged and the times are the epx calls (stream synchronised).
 * The last line printed is OK or FAILED; the exit status matches it.
 * Performance targets are reported as met/missed and do not change the
 * verdict, which is about correctness.
 *
 * This file is the entry (the ranks as threads or MPI processes, and the
 * run's header line); the parts are in tools/bench/ (bench.h lists them).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench.h"

/* ------------------------------------------------------------------------ */
/* Ranks: threads of the local transport, or MPI processes                   */
/* ------------------------------------------------------------------------ */

typedef struct rank_thread_arg {
  job_t *job;
  epx_local_world_t world;
  int32_t rank, size;
} rank_thread_arg_t;

static void *rank_thread(void *p) {
  rank_thread_arg_t *a = p;
  t_rank = a->rank;
  world_t w = {a->rank, a->size, NULL};
  TRY(epx_comm_create_local(a->world, a->rank, &w.comm));
  main_job_rank(a->job, &w, w.comm);
  TRY(epx_comm_destroy(w.comm));
  return NULL;
}

#if EPX_TOOLS_HAVE_MPI
/* --device cuda: this process's GPU (its local rank's, among the visible
 * ones), the stream of its buffers and routes, and the NCCL comm, made from
 * a unique id that rank 0 shares over MPI. */
static epx_comm_t cuda_comm(int rank, MPI_Comm *world_comm) {
#if EPX_TOOLS_HAVE_CUDA
  if (!epx_has_nccl()) fatal("this libepx was built without NCCL: --device cuda needs the nccl transport");
  const char *local = env_nonempty("OMPI_COMM_WORLD_LOCAL_RANK");
  if (!local) local = env_nonempty("MPI_LOCALRANKID");
  int devices = 0;
  CUDA_TRY(cudaGetDeviceCount(&devices));
  if (devices < 1) fatal("--device cuda: no CUDA device");
  CUDA_TRY(cudaSetDevice((local ? atoi(local) : rank) % devices));
  cudaStream_t stream;
  CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  g_stream = stream;
  g_cuda = 1;
  epx_comm_t comm = NULL;
  TRY(epx_comm_create_nccl_mpi(world_comm, NULL, &comm));
  return comm;
#else
  (void)rank, (void)world_comm;
  fatal("epx-bench was built without CUDA (configure with -DEPX_BUILD_CUDA=ON)");
  return NULL;
#endif
}
#endif

static void print_header(const options_t *o, int32_t W) {
  printf("epx-bench %d.%d.%d: MoE layer step on %d ranks (%s): T=%lld tokens per rank, H=%lld, "
         "E=%d, top-%d, ",
         EPX_VERSION_MAJOR, EPX_VERSION_MINOR, EPX_VERSION_PATCH, (int)W,
         o->cuda ? "CUDA buffers over NCCL, one GPU per MPI process" : o->mpi ? "mpi transport" : "local transport",
         (long long)o->tokens, (long long)o->hidden, (int)o->experts, (int)o->topk);
  if (o->ffn) printf("SwiGLU FFN %d on OpenBLAS, ", (int)o->ffn);
  else printf("per-expert scale (no FFN), ");
  printf("%s, layout %s, ", dtype_name((epx_dtype_t)o->dtype), layout_name(o->layout));
  if (o->capacity_factor > 0) printf("capacity factor %.2f, ", o->capacity_factor);
  else printf("dropless, ");
  printf("zipf %.2f, %d iterations after %d warm-up\n", o->zipf, o->iters, o->warmup);
}

/* --single: f32 then bf16 unless --dtype says which; returns the verdict. */
static int run_single(const options_t *o) {
  openblas_set_num_threads((int)sysconf(_SC_NPROCESSORS_ONLN));
  world_t w = {0, 1, NULL};
  int ok = 1;
  if (o->dtype >= 0) {
    ok &= single_run(o, (epx_dtype_t)o->dtype, &w);
  } else {
    ok &= single_run(o, EPX_FLOAT32, &w);
    ok &= single_run(o, EPX_BFLOAT16, &w);
  }
  printf("%s\n", ok ? "OK" : "FAILED");
  return ok;
}

/* The main job with one rank per MPI process; returns the verdict (rank 0's,
 * broadcast). */
static int run_mpi(job_t *job, options_t *o, int *argc, char ***argv) {
#if EPX_TOOLS_HAVE_MPI
  if (!epx_has_mpi()) fatal("this libepx was built without MPI (EPX_BUILD_MPI, libopenmpi-dev)");
  MPI_Init(argc, argv);
  g_mpi_active = 1;
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  t_rank = rank;
  if (o->experts % size) fatal("--experts %d is not a multiple of the %d MPI ranks", (int)o->experts, size);
  o->ranks = size;
  openblas_set_num_threads(size > 1 ? 1 : (int)sysconf(_SC_NPROCESSORS_ONLN));
  experts_make(&job->ex, o);
  if (rank == 0) {
    print_header(o, size);
    fflush(stdout);
  }
  MPI_Comm world_comm = MPI_COMM_WORLD;
  world_t w = {rank, size, NULL};
  TRY(epx_comm_create_mpi(&world_comm, NULL, &w.comm));
  /* The bench's own barriers and sums stay on MPI; the buffers use NCCL. */
  epx_comm_t comm = o->cuda ? cuda_comm(rank, &world_comm) : w.comm;
  main_job_rank(job, &w, comm);
  if (comm != w.comm) TRY(epx_comm_destroy(comm));
  TRY(epx_comm_destroy(w.comm));
  int verdict = rank == 0 ? job->ok : 1;
  MPI_Bcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (rank == 0) printf("%s\n", verdict ? "OK" : "FAILED");
  fflush(stdout);
  MPI_Finalize();
  return verdict;
#else
  (void)job, (void)o, (void)argc, (void)argv;
  fatal("epx-bench was built without MPI (install libopenmpi-dev and rebuild)");
#endif
}

/* The main job with the ranks as threads of the local transport; returns
 * the verdict. */
static int run_local(job_t *job, const options_t *o) {
  const int32_t W = o->ranks;
  if (o->experts % W) fatal("--experts %d is not a multiple of --ranks %d", (int)o->experts, (int)W);
  /* The ranks are the parallelism: one BLAS thread each, unless alone. */
  openblas_set_num_threads(W > 1 ? 1 : (int)sysconf(_SC_NPROCESSORS_ONLN));
  experts_make(&job->ex, o);
  print_header(o, W);
  fflush(stdout);

  epx_local_world_t lw;
  TRY(epx_local_world_create(W, NULL, &lw));
  pthread_t *threads = xalloc(sizeof(pthread_t) * (size_t)W);
  rank_thread_arg_t *args = xalloc(sizeof(rank_thread_arg_t) * (size_t)W);
  for (int32_t r = 0; r < W; r++) {
    args[r] = (rank_thread_arg_t){job, lw, r, W};
    if (pthread_create(&threads[r], NULL, rank_thread, &args[r])) fatal("pthread_create failed");
  }
  for (int32_t r = 0; r < W; r++) pthread_join(threads[r], NULL);
  TRY(epx_local_world_destroy(lw));
  printf("%s\n", job->ok ? "OK" : "FAILED");
  free(threads);
  free(args);
  return job->ok;
}

int main(int argc, char **argv) {
  options_t o;
  parse_options(argc, argv, &o);
  if (o.single) return run_single(&o) ? 0 : 1;
  if (o.dtype < 0) o.dtype = EPX_FLOAT32;

  job_t job;
  memset(&job, 0, sizeof job);
  job.o = &o;
  int ok = o.mpi ? run_mpi(&job, &o, &argc, &argv) : run_local(&job, &o);
  free(job.ex.w);
  return ok ? 0 : 1;
}
