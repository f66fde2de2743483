/* The W-rank GPU programs (tests/gpu/mpi_gpu_*.c) with their ranks as
 * processes of this host on one GPU, as torchrun --nproc_per_node W starts
 * them where NCCL refuses two ranks on one GPU: the few MPI calls they make
 * played by a control shm comm, and their NCCL comm replaced by an shm comm
 * (epx_comm_create_shm), so every W-rank CUDA path runs over the ipc
 * transport (src/cuda/xport/ipc.c). A tests/gpu/ipc_gpu_*.c includes this,
 * then the program with its main renamed, and runs it at W = 2 and 4
 * (EPX_GPU_RANKS="2,4,8" chooses others; EPX_GPU_TIMEOUT the comm's timeout
 * in seconds, 30 by default): W processes forked before CUDA starts, every
 * one on the first visible GPU (CUDA_VISIBLE_DEVICES narrowed to it).
 * Nodes are posed as thread_ranks.h poses them (W / 2 ranks, one for W = 2)
 * so the hierarchical exchange has two nodes. The processes take turns on
 * the GPU (no MPS), so the fused path and the low-latency window are
 * refused and the host path and the slabs serve every buffer
 * (RANKS_GRAPHS 0: nothing is captured in a CUDA graph). After each W no
 * /dev/shm name of the job may be left. Exit status is the verdict. */
#ifndef EPX_TESTS_GPU_PROC_RANKS_H
#define EPX_TESTS_GPU_PROC_RANKS_H

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epx.h"
#include "rank_counts.h"

#define EPX_PROC_RANKS 1
#define EPX_RANK_LOCAL
#define MPI_VERSION 3 /* tests/util/check.h: a fatal check ends the process (MPI_Abort); its peers time out */

typedef int MPI_Comm;
typedef int MPI_Datatype;
typedef int MPI_Op;
#define MPI_COMM_WORLD 0
#define MPI_INT 1
#define MPI_SUM 1

static int pr_rank, pr_size;
static epx_comm_t pr_ctl;        /* the control comm: the programs' MPI calls */
static char pr_name[64];         /* the job's names: <pr_name>-ctl, <pr_name>-<n> */
static int pr_comms;             /* shm comms the program made so far */
static int32_t pr_ranks_per_node;
static double pr_timeout;

static inline int MPI_Init(int *argc, char ***argv) { (void)argc, (void)argv; return 0; }
static inline int MPI_Finalize(void) { return 0; }
static inline int MPI_Comm_rank(MPI_Comm c, int *rank) { (void)c, *rank = pr_rank; return 0; }
static inline int MPI_Comm_size(MPI_Comm c, int *size) { (void)c, *size = pr_size; return 0; }
static inline int MPI_Abort(MPI_Comm c, int code) {
  (void)c;
  fflush(stdout), fflush(stderr);
  _exit(code ? code : 1);
}
static inline int MPI_Barrier(MPI_Comm c) {
  (void)c;
  if (epx_comm_barrier(pr_ctl) != EPX_SUCCESS) MPI_Abort(c, 3);
  return 0;
}
/* The sum of one int over the ranks (the programs' failure count). */
static inline int MPI_Allreduce(const void *send, void *recv, int count, MPI_Datatype t, MPI_Op op, MPI_Comm c) {
  (void)count, (void)t, (void)op;
  int all[64] = {0};
  if (epx_comm_allgather(pr_ctl, send, all, sizeof(int)) != EPX_SUCCESS) MPI_Abort(c, 3);
  int sum = 0;
  for (int r = 0; r < pr_size; r++) sum += all[r];
  *(int *)recv = sum;
  return 0;
}

/* The programs' NCCL comm: an shm comm of the job's processes. */
static inline epx_status_t pr_comm_create(const void *mpi_comm, const epx_comm_config_t *config, epx_comm_t *comm) {
  (void)mpi_comm, (void)config;
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = pr_timeout;
  cc.ranks_per_node = pr_ranks_per_node;
  char name[96];
  snprintf(name, sizeof name, "%s-%d", pr_name, pr_comms++);
  return epx_comm_create_shm(name, pr_rank, pr_size, &cc, comm);
}
#define epx_comm_create_nccl_mpi pr_comm_create

/* The /dev/shm names starting with prefix. */
static inline int pr_shm_left(const char *prefix) {
  DIR *d = opendir("/dev/shm");
  int left = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    if (!strncmp(e->d_name, prefix, strlen(prefix))) {
      fprintf(stderr, "left in /dev/shm: %s\n", e->d_name);
      left++;
    }
  if (d) closedir(d);
  return left;
}

/* The first visible GPU alone (every process on it). */
static inline void pr_one_gpu(void) {
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  char first[64] = "0";
  if (visible && *visible) {
    snprintf(first, sizeof first, "%s", visible);
    first[strcspn(first, ",")] = 0;
  }
  setenv("CUDA_VISIBLE_DEVICES", first, 1);
}

static inline int pr_child(int (*rank_main)(int, char **), int rank) {
  pr_rank = rank;
  alarm(3000); /* a hard bound past every bounded wait */
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = pr_timeout;
  char name[96];
  snprintf(name, sizeof name, "%s-ctl", pr_name);
  if (epx_comm_create_shm(name, pr_rank, pr_size, &cc, &pr_ctl) != EPX_SUCCESS) {
    fprintf(stderr, "rank %d: the control comm: %s\n", rank, epx_last_error());
    return 2;
  }
  char arg0[] = "rank";
  char *argv[] = {arg0, NULL};
  const int status = rank_main(1, argv);
  if (epx_comm_destroy(pr_ctl) != EPX_SUCCESS) return 4;
  return status;
}

/* Runs rank_main on W processes for each W; 0 when every run passed. */
static inline int pr_run(int (*rank_main)(int, char **), const char *program) {
  pr_one_gpu();
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  pr_timeout = rc_timeout_seconds();
  int counts[RC_MAX_RUNS];
  const int runs = rc_rank_counts("2,4", counts);
  int failed = 0;
  for (int run = 0; run < runs; run++) {
    const int W = counts[run];
    pr_size = W;
    pr_ranks_per_node = rc_ranks_per_node(W);
    snprintf(pr_name, sizeof pr_name, "epx-%s-%d-%d", program, (int)getpid(), W);
    fflush(stdout), fflush(stderr);
    pid_t pids[64];
    for (int r = 0; r < W; r++)
      if ((pids[r] = fork()) == 0) _exit(pr_child(rank_main, r));
    int bad = 0;
    for (int r = 0; r < W; r++) {
      int st = 0;
      if (waitpid(pids[r], &st, 0) != pids[r] || !WIFEXITED(st) || WEXITSTATUS(st)) {
        fprintf(stderr, "%s: W = %d: rank %d %s %d\n", program, W, r,
                WIFSIGNALED(st) ? "ended by signal" : "exited with", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
        bad = 1;
      }
    }
    const int left = pr_shm_left(pr_name);
    printf("%s: W = %d ranks as processes on one GPU (ipc transport, nodes of %d): %s%s\n", program, W,
           (int)pr_ranks_per_node, bad || left ? "FAILED" : "OK", left ? " (names left in /dev/shm)" : "");
    fflush(stdout);
    failed |= bad || left;
  }
  return failed;
}

#endif
