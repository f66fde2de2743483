/* A rank that dies turns into an error on its peer, not a hang: two ranks
 * forked here (no MPI: under mpirun one rank's death takes the job down
 * before the survivor can be watched), one per GPU, an NCCL comm from a
 * unique id shared through a pipe, a CUDA buffer; rank 1 then exits, and
 * rank 0's dispatch layout must fail (EPX_ERROR_TIMEOUT or
 * EPX_ERROR_TRANSPORT) within about the comm's timeout. Two scenarios:
 * "host", the default buffer (expert-major: the host-API path, whose layout
 * agreement meets the dead peer), and "fused", a rank-major buffer with
 * worst_case_sizing on the fused NVLink path where the build has it: the
 * layout only enqueues, its kernel's bounded wait on the dead peer runs out,
 * and the next call that reads the layout (epx_handle_recv_rows) must fail
 * and fail the comm, so that destroying the buffer abandons the window
 * instead of deregistering it with a peer that is gone (with
 * EPX_GPU_EXPECT_FUSED=1 the buffer must be on the fused path, else the
 * scenario would test the host path twice); and "relay", that buffer with
 * its peer relayed through NCCL's host API (the test flag
 * EPX_CUDA_FUSED_RELAY, as a peer without load/store access is): the
 * layout's relay step meets the dead peer, and either it or the next call
 * that reads the layout must fail the comm. Either way, later calls refuse
 * at once and destroy returns. The parent bounds everything
 * with its own deadline; exit status is the verdict. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda/launch.h" /* EPX_CUDA_FUSED_RELAY */
#include "epx.h"
#include "../util/buffer_config.h"
#include "../util/check.h" /* FATAL_UNLESS_OK: a failed setup call ends the child (exit 2) */
#include "../util/clock.h"

enum { SCENARIO_HOST = 0, SCENARIO_FUSED = 1, SCENARIO_RELAY = 2 };

enum { TIMEOUT_S = 10, GUARD_S = 120 };

static int child(int rank, int scenario, int fd_read, int fd_write) {
  const int fused = scenario != SCENARIO_HOST;
  if (scenario == SCENARIO_RELAY) epx_cuda_set_launch_flags(epx_cuda_launch_flags() | EPX_CUDA_FUSED_RELAY);
  epx_nccl_unique_id_t id;
  if (rank == 0) {
    FATAL_UNLESS_OK(epx_nccl_get_unique_id(&id));
    if (write(fd_write, &id, sizeof id) != (ssize_t)sizeof id) return 11;
  } else if (read(fd_read, &id, sizeof id) != (ssize_t)sizeof id) {
    return 12;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) return 13;
  cudaSetDevice(rank);
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = TIMEOUT_S;
  epx_comm_t comm;
  FATAL_UNLESS_OK(epx_comm_create_nccl_id(&id, rank, 2, &cc, &comm));
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_BFLOAT16, 64, 8, 2, 16);
  if (fused) {
    cfg.layout = EPX_LAYOUT_RANK_MAJOR;
    cfg.worst_case_sizing = 1;
  }
  epx_buffer_t buf;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &buf));
  int32_t paths[2] = {0, 0};
  FATAL_UNLESS_OK(epx_buffer_peer_paths(buf, paths));
  if (rank == 1) _exit(0); /* dies without a word */
  int32_t idx[16 * 2];
  for (int t = 0; t < 16; t++) idx[2 * t] = t % 8, idx[2 * t + 1] = (t + 3) % 8;
  int32_t *d_idx = NULL;
  cudaMalloc((void **)&d_idx, sizeof idx);
  cudaMemcpy(d_idx, idx, sizeof idx, cudaMemcpyHostToDevice);
  epx_routing_t r = {16, 2, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  epx_handle_t h = NULL;
  const double t0 = tu_seconds();
  epx_status_t s = epx_dispatch_layout(buf, &r, NULL, &h);
  if (s == EPX_SUCCESS && fused) {
    /* worst_case_sizing: enqueued only; reading the layout meets the timeout */
    int64_t rows = 0;
    s = epx_handle_recv_rows(h, &rows);
  }
  const double took = tu_seconds() - t0;
  printf("rank 0 (%s, peer 1 on the %s path): dispatch_layout with its peer dead: %s after %.1f s: %s\n",
         fused ? "rank-major, worst_case_sizing" : "default buffer",
         scenario == SCENARIO_RELAY ? "relayed host-API" : paths[1] == EPX_PATH_FUSED ? "fused" : "host",
         epx_status_string(s), took, epx_last_error());
  int ok = (s == EPX_ERROR_TIMEOUT || s == EPX_ERROR_TRANSPORT || s == EPX_ERROR_PEER_FAILED) && took < 3 * TIMEOUT_S;
  const char *expect = getenv("EPX_GPU_EXPECT_FUSED");
  /* the fused path: peer 1 fused, or relayed (this rank's own rows fused) */
  const int on_path = scenario == SCENARIO_RELAY ? paths[0] == EPX_PATH_FUSED && paths[1] == EPX_PATH_HOST
                                                 : paths[1] == EPX_PATH_FUSED;
  if (fused && expect && strcmp(expect, "0") && *expect && !on_path) {
    printf("rank 0: the %s scenario's buffer is not on its path (EPX_GPU_EXPECT_FUSED)\n",
           scenario == SCENARIO_RELAY ? "relay" : "fused");
    ok = 0;
  }
  /* the comm is failed now: later calls refuse at once, destroy releases */
  epx_handle_t h2 = NULL;
  epx_status_t again = epx_dispatch_layout(buf, &r, NULL, &h2);
  ok = ok && again != EPX_SUCCESS;
  if (h) ok = ok && epx_handle_release(h) == EPX_SUCCESS;
  const double t1 = tu_seconds();
  ok = ok && epx_buffer_destroy(buf) == EPX_SUCCESS && epx_comm_destroy(comm) == EPX_SUCCESS;
  printf("rank 0: buffer and comm destroyed in %.1f s\n", tu_seconds() - t1);
  fflush(stdout);
  _exit(ok ? 0 : 20);
}

static const char *const scenario_names[] = {"host", "fused", "relay"};

/* One scenario: both ranks forked, watched under the guard. */
static int scenario(int which) {
  int fds[2];
  if (pipe(fds)) return 0;
  pid_t pids[2];
  for (int rank = 0; rank < 2; rank++) {
    pids[rank] = fork();
    if (pids[rank] == 0) _exit(child(rank, which, fds[0], fds[1]));
  }
  close(fds[0]);
  close(fds[1]);
  int status0 = -1;
  const double deadline = tu_seconds() + GUARD_S;
  int done[2] = {0, 0}, codes[2] = {-1, -1};
  while ((!done[0] || !done[1]) && tu_seconds() < deadline) {
    for (int r = 0; r < 2; r++) {
      if (done[r]) continue;
      int st;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) done[r] = 1, codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    }
    usleep(100000);
  }
  for (int r = 0; r < 2; r++)
    if (!done[r]) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], NULL, 0);
    }
  status0 = codes[0];
  const int pass = done[0] && status0 == 0 && done[1] && codes[1] == 0;
  printf("nccl_gpu_kill (%s): survivor %s (exit %d), dead rank exit %d: %s\n", scenario_names[which],
         done[0] ? "returned" : "HUNG (killed after the guard)", status0, codes[1], pass ? "OK" : "FAILED");
  fflush(stdout);
  return pass;
}

int main(void) {
  const int host = scenario(SCENARIO_HOST), fused = scenario(SCENARIO_FUSED), relay = scenario(SCENARIO_RELAY);
  printf("nccl_gpu_kill: %s\n", host && fused && relay ? "OK" : "FAILED");
  return host && fused && relay ? 0 : 1;
}
