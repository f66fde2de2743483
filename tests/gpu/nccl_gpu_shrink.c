/* epx_comm_shrink on NCCL comms (ncclCommShrink; issue 37), ranks forked
 * here, one per GPU, an NCCL comm from a unique id shared through a pipe
 * (no MPI: under mpirun one rank's death takes the job down). Scenarios:
 * "lost" (2 GPUs): rank 1 exits after the buffer is made; rank 0's
 * dispatch layout fails within about the timeout (the comm revoked, not
 * aborted), its epx_comm_shrink names rank 1 lost (NCCL_SHRINK_ABORT) and
 * gives a comm of 1 rank, on which a new buffer's dispatch and combine
 * return what the CPU reference says; the time from the error to that step
 * is printed. "healthy" (2 GPUs): both ranks shrink a live comm
 * (NCCL_SHRINK_DEFAULT): nothing lost, a comm of 2 ranks, and a step on it
 * checks. "single" (1 GPU): the same on a comm of 1 rank. An NCCL older
 * than 2.27 (no ncclCommShrink) must refuse by name instead. The parent
 * bounds everything with its own deadline; exit status is the verdict. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "epx.h"
#include "../util/buffer_config.h"
#include "../util/check.h" /* FATAL_UNLESS_OK: a failed setup call ends the child (exit 2) */
#include "../util/clock.h"

enum { SCENARIO_LOST = 0, SCENARIO_HEALTHY = 1, SCENARIO_SINGLE = 2 };
enum { TIMEOUT_S = 5, GUARD_S = 120, T = 16, K = 2, E = 8, H = 64 };

/* 1 when the loaded NCCL refused the shrink for want of ncclCommShrink (then the scenario is skipped). */
static int no_shrink(epx_status_t s) {
  return s == EPX_ERROR_UNSUPPORTED && strstr(epx_last_error(), "has no ncclCommShrink");
}

/* A dispatch and combine on `comm` with the identity expert: out must be K
 * times x (every token goes to K distinct experts; small integers, exact).
 * 0 when it checks. */
static int step(epx_comm_t comm, int rank, const char *what) {
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_FLOAT32, H, E, K, T);
  epx_buffer_t buf = NULL;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &buf));
  int32_t idx[T * K];
  float x[T * H], out[T * H];
  for (int t = 0; t < T; t++) idx[K * t] = (t + rank) % E, idx[K * t + 1] = (t + rank + 3) % E;
  for (int i = 0; i < T * H; i++) x[i] = (float)((rank * 7 + i) % 13 - 6);
  int32_t *d_idx = NULL;
  float *d_x = NULL, *d_out = NULL, *d_recv = NULL;
  cudaMalloc((void **)&d_idx, sizeof idx);
  cudaMalloc((void **)&d_x, sizeof x);
  cudaMalloc((void **)&d_out, sizeof out);
  cudaMemcpy(d_idx, idx, sizeof idx, cudaMemcpyHostToDevice);
  cudaMemcpy(d_x, x, sizeof x, cudaMemcpyHostToDevice);
  epx_routing_t r = {T, K, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  epx_handle_t h = NULL;
  int64_t rows = 0;
  epx_status_t s = epx_dispatch_layout(buf, &r, NULL, &h);
  if (s == EPX_SUCCESS) s = epx_handle_recv_rows(h, &rows);
  if (s == EPX_SUCCESS && cudaMalloc((void **)&d_recv, sizeof(float) * (size_t)(rows > 0 ? rows : 1) * H) != cudaSuccess)
    s = EPX_ERROR_CUDA;
  if (s == EPX_SUCCESS) s = epx_dispatch(buf, h, d_x, d_recv, rows);
  if (s == EPX_SUCCESS) s = epx_combine(buf, h, d_recv, d_out);
  if (s == EPX_SUCCESS && cudaDeviceSynchronize() != cudaSuccess) s = EPX_ERROR_CUDA;
  int wrong = 0;
  if (s == EPX_SUCCESS) {
    cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost);
    for (int i = 0; i < T * H; i++) wrong += out[i] != (float)K * x[i];
  }
  printf("rank %d (%s): a step on the survivors' comm: %s, %d of %d values wrong\n", rank, what,
         epx_status_string(s), wrong, T * H);
  if (s != EPX_SUCCESS) printf("rank %d: %s\n", rank, epx_last_error());
  epx_handle_release(h);
  cudaFree(d_idx), cudaFree(d_x), cudaFree(d_out), cudaFree(d_recv);
  int failed = s != EPX_SUCCESS || wrong || epx_buffer_destroy(buf) != EPX_SUCCESS;
  return failed;
}

/* Shrinks `comm`; *next the survivors' comm. 0 when the lost ranks and the
 * new comm's rank and size are as expected; 77 when NCCL has no shrink. */
static int shrink(epx_comm_t comm, int rank, int want_lost, int want_size, epx_comm_t *next, const char *what) {
  int32_t lost[2] = {-1, -1}, num_lost = -1, new_rank = -1, new_size = -1;
  epx_status_t s = epx_comm_shrink(comm, NULL, next, lost, &num_lost);
  printf("rank %d (%s): epx_comm_shrink: %s, %d lost%s: %s\n", rank, what, epx_status_string(s), num_lost,
         num_lost == 1 && lost[0] == 1 ? " (rank 1)" : "", epx_last_error());
  if (no_shrink(s)) return 77;
  if (s != EPX_SUCCESS) return 1;
  epx_comm_rank(*next, &new_rank);
  epx_comm_size(*next, &new_size);
  return num_lost != want_lost || (want_lost && lost[0] != 1) || new_size != want_size || new_rank != rank;
}

static int child(int rank, int scenario, int size, int fd_read, int fd_write) {
  epx_nccl_unique_id_t id;
  if (rank == 0) {
    FATAL_UNLESS_OK(epx_nccl_get_unique_id(&id));
    for (int p = 1; p < size; p++)
      if (write(fd_write, &id, sizeof id) != (ssize_t)sizeof id) return 11;
  } else if (read(fd_read, &id, sizeof id) != (ssize_t)sizeof id) {
    return 12;
  }
  cudaSetDevice(rank);
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = TIMEOUT_S;
  epx_comm_t comm = NULL, next = NULL;
  FATAL_UNLESS_OK(epx_comm_create_nccl_id(&id, rank, size, &cc, &comm));
  const char *what = scenario == SCENARIO_LOST ? "lost" : scenario == SCENARIO_HEALTHY ? "healthy" : "single";
  int failed = 0;
  if (scenario == SCENARIO_LOST) {
    epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_FLOAT32, H, E, K, T);
    epx_buffer_t buf = NULL;
    FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &buf));
    if (rank == 1) _exit(0); /* dies without a word */
    int32_t idx[T * K];
    for (int t = 0; t < T; t++) idx[K * t] = t % E, idx[K * t + 1] = (t + 3) % E;
    int32_t *d_idx = NULL;
    cudaMalloc((void **)&d_idx, sizeof idx);
    cudaMemcpy(d_idx, idx, sizeof idx, cudaMemcpyHostToDevice);
    epx_routing_t r = {T, K, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
    epx_handle_t h = NULL;
    const double t0 = tu_seconds();
    epx_status_t s = epx_dispatch_layout(buf, &r, NULL, &h);
    const double failed_at = tu_seconds();
    printf("rank 0 (lost): dispatch_layout with its peer dead: %s after %.1f s: %s\n", epx_status_string(s),
           failed_at - t0, epx_last_error());
    failed |= s == EPX_SUCCESS || failed_at - t0 > 3 * TIMEOUT_S;
    epx_handle_release(h);
    cudaFree(d_idx);
    if (!failed) failed = shrink(comm, rank, 1, 1, &next, what);
    failed |= epx_buffer_destroy(buf) != EPX_SUCCESS;
    failed |= epx_comm_destroy(comm) != EPX_SUCCESS;
    if (!failed) {
      failed = step(next, 0, what);
      printf("rank 0 (lost): the error -> the survivors' first step done: %.2f s (timeout %d s)\n",
             tu_seconds() - failed_at, TIMEOUT_S);
    }
  } else {
    failed = shrink(comm, rank, 0, size, &next, what);
    failed |= epx_comm_destroy(comm) != EPX_SUCCESS;
    if (!failed) failed = step(next, rank, what);
  }
  if (next) failed |= epx_comm_destroy(next) != EPX_SUCCESS;
  fflush(stdout);
  return failed == 77 ? 77 : failed ? 20 : 0;
}

static const char *const scenario_names[] = {"lost", "healthy", "single"};

/* One scenario: its ranks forked, watched under the guard. 1: passed,
 * 0: failed, -1: skipped (no ncclCommShrink). */
static int scenario(int which, int size) {
  int fds[2];
  if (pipe(fds)) return 0;
  pid_t pids[2];
  for (int rank = 0; rank < size; rank++) {
    pids[rank] = fork();
    if (pids[rank] == 0) _exit(child(rank, which, size, fds[0], fds[1]));
  }
  close(fds[0]);
  close(fds[1]);
  const double deadline = tu_seconds() + GUARD_S;
  int done[2] = {0, 0}, codes[2] = {-1, -1};
  while ((!done[0] || (size > 1 && !done[1])) && tu_seconds() < deadline) {
    for (int r = 0; r < size; r++) {
      int st;
      if (!done[r] && waitpid(pids[r], &st, WNOHANG) == pids[r]) done[r] = 1, codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    }
    usleep(20000);
  }
  for (int r = 0; r < size; r++)
    if (!done[r]) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], NULL, 0);
    }
  if (codes[0] == 77) {
    printf("nccl_gpu_shrink (%s): SKIPPED: the loaded NCCL has no ncclCommShrink (2.27+), refused by name\n",
           scenario_names[which]);
    return -1;
  }
  int pass = done[0] && codes[0] == 0;
  for (int r = 1; r < size; r++) pass = pass && done[r] && codes[r] == 0;
  printf("nccl_gpu_shrink (%s, %d rank(s)): rank 0 %s (exit %d): %s\n", scenario_names[which], size,
         done[0] ? "returned" : "HUNG (killed after the guard)", codes[0], pass ? "OK" : "FAILED");
  fflush(stdout);
  return pass;
}

/* The GPUs, counted in a child: CUDA started in this process would not
 * work in the ranks forked from it (cudaErrorInitializationError). */
static int count_devices(void) {
  const pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    _exit(cudaGetDeviceCount(&n) == cudaSuccess ? (n > 100 ? 100 : n) : 0);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

int main(void) {
  const int devices = count_devices();
  if (devices < 1) {
    printf("nccl_gpu_shrink: no GPU: SKIPPED\n");
    return 0;
  }
  int failed = scenario(SCENARIO_SINGLE, 1) == 0;
  if (devices >= 2) {
    failed += scenario(SCENARIO_HEALTHY, 2) == 0;
    failed += scenario(SCENARIO_LOST, 2) == 0;
  } else {
    printf("nccl_gpu_shrink: 1 GPU: the 2-rank scenarios (healthy, lost) need 2: SKIPPED\n");
  }
  printf("nccl_gpu_shrink: %s\n", failed ? "FAILED" : "OK");
  return failed ? 1 : 0;
}
