/* A process that dies or stops in the middle of a call over the ipc
 * transport (ranks as processes of one host on one GPU, an shm comm: what
 * torchrun --nproc_per_node W starts there) turns into a named error on its
 * peers, not a hang. W processes forked here share the first visible GPU;
 * each makes an shm comm (timeout TIMEOUT_S) and a CUDA buffer (the host
 * path: the fused one is refused where processes share a GPU), and runs
 * rounds of layout, dispatch and combine checked against the contract
 * (combine's sum of each token's routes). In round 2 every rank waits for
 * its dispatch and meets the others (a comm barrier), then the victim
 * (rank W - 1) ends itself before its combine: SIGKILL ("killed") or SIGSTOP ("stopped", the
 * parent kills it once the survivors are done). The survivors' combine (or
 * the wait after it) must fail within about the comm's timeout with
 * EPX_ERROR_TIMEOUT (or EPX_ERROR_PEER_FAILED) whose message names the
 * victim; later calls refuse at once; destroying the buffer and the comm
 * returns; and no /dev/shm name of the job is left once the parent has
 * reaped the victim. Scenarios: killed at W = 2 and 4, stopped at W = 2.
 * The parent bounds everything with its own deadline; exit status is the
 * verdict. */
#include <dirent.h>
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

enum { TIMEOUT_S = 10, GUARD_S = 150, T = 16, H = 64, EL = 2, KK = 2 };

static float bf16_to_float(uint16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* The epx_last_error() of round_trip's failing call (the releases after it
 * succeed, and a success clears it). */
static char g_why[1024];

/* One round: layout, dispatch, combine (weights none: out = the sum of the
 * routes' rows, each row the token's). Returns the first failing status,
 * its message in g_why; *bad counts wrong values. */
static epx_status_t round_trip(epx_comm_t comm, epx_buffer_t buf, cudaStream_t stream, int rank, int W,
                               int victim_dies, int kill_signal, int *bad) {
  const int E = EL * W;
  int32_t idx[T * KK];
  for (int t = 0; t < T; t++) idx[KK * t] = (t + rank) % E, idx[KK * t + 1] = (t + rank + 1 + t % 3) % E;
  uint16_t x[T * H];
  for (int t = 0; t < T; t++)
    for (int c = 0; c < H; c++) {
      const float v = (float)(rank * 32 + t) / 8.0f; /* exact in bfloat16 */
      uint32_t u;
      memcpy(&u, &v, sizeof u);
      x[t * H + c] = (uint16_t)(u >> 16);
    }
  int32_t *d_idx = NULL;
  uint16_t *d_x = NULL, *d_recv = NULL, *d_out = NULL;
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&d_idx, sizeof idx));
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&d_x, sizeof x));
  FATAL_UNLESS_CUDA_OK(cudaMalloc((void **)&d_out, sizeof x));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(d_idx, idx, sizeof idx, cudaMemcpyHostToDevice));
  FATAL_UNLESS_CUDA_OK(cudaMemcpy(d_x, x, sizeof x, cudaMemcpyHostToDevice));
  epx_routing_t r = {T, KK, d_idx, NULL, NULL, EPX_WEIGHTS_NONE};
  epx_handle_t h = NULL;
  int64_t N = 0;
  epx_status_t s = epx_dispatch_layout(buf, &r, NULL, &h);
  if (s == EPX_SUCCESS) s = epx_handle_recv_rows(h, &N);
  if (s == EPX_SUCCESS) s = cudaMalloc((void **)&d_recv, (size_t)(N + 1) * H * 2) == cudaSuccess ? EPX_SUCCESS
                                                                                          : EPX_ERROR_CUDA;
  if (s == EPX_SUCCESS) s = epx_dispatch(buf, h, d_x, d_recv, N);
  if (s == EPX_SUCCESS && victim_dies) {
    /* every rank's copies out of the victim's staging are over first (what
     * a process that dies while a peer's copy reads its exported memory
     * does to that peer is the driver's, not epx's, to say) */
    cudaStreamSynchronize(stream);
    s = epx_comm_barrier(comm);
    fflush(stdout);
    if (rank == W - 1) raise(kill_signal); /* before its combine: its peers are in theirs */
  }
  if (s == EPX_SUCCESS) s = epx_combine(buf, h, d_recv, d_out);
  if (s == EPX_SUCCESS) s = cudaStreamSynchronize(stream) == cudaSuccess ? EPX_SUCCESS : EPX_ERROR_CUDA;
  if (s == EPX_SUCCESS) {
    uint16_t out[T * H];
    FATAL_UNLESS_CUDA_OK(cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost));
    for (int t = 0; t < T; t++)
      for (int c = 0; c < H; c++)
        *bad += bf16_to_float(out[t * H + c]) != 2.0f * bf16_to_float(x[t * H + c]);
  }
  snprintf(g_why, sizeof g_why, "%s", s == EPX_SUCCESS ? "" : epx_last_error());
  if (h) epx_handle_release(h);
  cudaFree(d_idx), cudaFree(d_x), cudaFree(d_out);
  if (d_recv) cudaFree(d_recv);
  return s;
}

static int child(const char *name, int rank, int W, int kill_signal) {
  alarm(GUARD_S + 30);
  epx_comm_config_t cc = EPX_COMM_CONFIG_INIT;
  cc.timeout_seconds = TIMEOUT_S;
  epx_comm_t comm;
  FATAL_UNLESS_OK(epx_comm_create_shm(name, rank, W, &cc, &comm));
  cudaStream_t stream;
  FATAL_UNLESS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_BFLOAT16, H, EL * W, KK, T);
  cfg.stream = stream;
  epx_buffer_t buf;
  FATAL_UNLESS_OK(epx_buffer_create(comm, &cfg, &buf));
  int32_t paths[64];
  FATAL_UNLESS_OK(epx_buffer_peer_paths(buf, paths));
  int bad = 0;
  FATAL_UNLESS_OK(round_trip(comm, buf, stream, rank, W, 0, kill_signal, &bad));
  const double t0 = tu_seconds();
  const epx_status_t s = round_trip(comm, buf, stream, rank, W, 1, kill_signal, &bad);
  const double took = tu_seconds() - t0;
  char message[1024];
  snprintf(message, sizeof message, "%s", g_why);
  char victim[32];
  snprintf(victim, sizeof victim, "rank %d", W - 1);
  int ok = (s == EPX_ERROR_TIMEOUT || s == EPX_ERROR_PEER_FAILED) && strstr(message, victim) &&
           took < 2.5 * TIMEOUT_S && !bad && paths[(rank + 1) % W] == EPX_PATH_HOST;
  printf("rank %d of %d (peer %d on the %s path): a round with rank %d %s: %s after %.1f s: %s\n", rank, W,
         (rank + 1) % W, paths[(rank + 1) % W] == EPX_PATH_HOST ? "host" : "fused", W - 1,
         kill_signal == SIGKILL ? "killed" : "stopped", epx_status_string(s), took, message);
  /* the comm is failed now: later calls refuse at once, destroy releases */
  int bad2 = 0;
  const double t1 = tu_seconds();
  ok = ok && round_trip(comm, buf, stream, rank, W, 0, kill_signal, &bad2) != EPX_SUCCESS && tu_seconds() - t1 < 2.0;
  ok = ok && epx_buffer_destroy(buf) == EPX_SUCCESS && epx_comm_destroy(comm) == EPX_SUCCESS;
  printf("rank %d: buffer and comm destroyed %.1f s after the refusal%s\n", rank, tu_seconds() - t1,
         ok ? "" : " (FAILED)");
  fflush(stdout);
  cudaStreamDestroy(stream);
  return ok ? 0 : 20;
}

static int shm_left(const char *prefix) {
  DIR *d = opendir("/dev/shm");
  int left = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    if (!strncmp(e->d_name, prefix, strlen(prefix))) printf("left in /dev/shm: %s\n", e->d_name), left++;
  if (d) closedir(d);
  return left;
}

/* One scenario: W processes forked, watched under the guard. */
static int scenario(int W, int kill_signal) {
  char name[64];
  snprintf(name, sizeof name, "epx-ipc-kill-%d-%d-%d", (int)getpid(), W, kill_signal);
  pid_t pids[16];
  fflush(stdout);
  for (int rank = 0; rank < W; rank++)
    if ((pids[rank] = fork()) == 0) _exit(child(name, rank, W, kill_signal));
  const double deadline = tu_seconds() + GUARD_S;
  int done[16] = {0}, codes[16], signals[16] = {0}, survivors = 0;
  while (survivors < W - 1 && tu_seconds() < deadline) {
    for (int r = 0; r < W - 1; r++) {
      int st;
      if (!done[r] && waitpid(pids[r], &st, WNOHANG) == pids[r])
        done[r] = 1, survivors++, codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    usleep(100000);
  }
  int pass = survivors == W - 1, named = 0;
  for (int r = 0; r < W; r++) {
    if (r < W - 1 && done[r]) {
      named += codes[r] == 0;
      pass = pass && codes[r] == 0;
      continue;
    }
    kill(pids[r], SIGKILL); /* the stopped victim, or a hung survivor */
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (r == W - 1) signals[r] = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
  }
  pass = pass && signals[W - 1] == SIGKILL;
  const int left = shm_left(name);
  pass = pass && !left;
  printf("ipc_gpu_kill: W = %d, rank %d %s mid-call: %d of %d survivors returned, %d with the named error and a "
         "clean destroy%s: %s\n", W, W - 1, kill_signal == SIGKILL ? "killed" : "stopped", survivors, W - 1, named,
         left ? ", names left in /dev/shm" : "", pass ? "OK" : "FAILED");
  fflush(stdout);
  return pass;
}

int main(void) {
  /* every process on the first visible GPU, before CUDA starts */
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  char first[64] = "0";
  if (visible && *visible) snprintf(first, sizeof first, "%s", visible), first[strcspn(first, ",")] = 0;
  setenv("CUDA_VISIBLE_DEVICES", first, 1);
  const int a = scenario(2, SIGKILL), b = scenario(4, SIGKILL), c = scenario(2, SIGSTOP);
  printf("ipc_gpu_kill: %s\n", a && b && c ? "OK" : "FAILED");
  return a && b && c ? 0 : 1;
}
