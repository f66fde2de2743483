/* The in-process transport (xport.h): W ranks as threads of one process
 * over a local comm, on one GPU or several with peer access.
 *
 * A group of messages is one handshake of the local comm (its `then` runs
 * while every rank is still inside the call, so peers' lists may be read):
 *   1. each rank records its `ready` event on its stream (its sends' data is
 *      then complete) and publishes the event and its list of sends;
 *   2. inside the handshake each rank, for each peer that sends it
 *      something, makes its stream wait on that peer's `ready` and copies
 *      each message from the peer's buffer into its own (cudaMemcpyAsync on
 *      its own stream: the receiver pulls), then records its `done` event;
 *   3. after the handshake each rank makes its stream wait on the `done` of
 *      every peer it sent to, so nothing later on its stream overwrites a
 *      send buffer before the peer has pulled from it.
 * The two events of a rank are reused call after call: a peer waits on
 * `ready` inside the handshake and on `done` before its next call, and the
 * rank records them again only inside that next call, after every peer has
 * arrived in it. They live per thread and comm (a rank's calls come from
 * its own thread): eight pairs at most per thread, reused; a thread's pairs
 * are not destroyed when it ends (a few events per rank thread).
 *
 * Ranks sharing a GPU: nothing here spins on the GPU (the copies wait on
 * events), so any number of ranks share it; the fused kernels, which do,
 * are the fused module's concern (fused/setup.cu).
 *
 * An all-gather is a group: every rank's block to every rank. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/transport.h"
#include "core/wait.h"
#include "cuda/common/check.h"
#include "cuda/xport/xport.h"

/* ---- the events of this thread's ranks ---------------------------------- */

enum { EVENT_CACHE = 8 };

typedef struct {
  epx_comm_t comm;
  int device;
  cudaEvent_t ready, done;
} rank_events_t;

static _Thread_local rank_events_t g_events[EVENT_CACHE];
static _Thread_local int g_events_next;

static epx_status_t events_of(epx_comm_t comm, rank_events_t **out, const char *fn) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  for (int i = 0; e == cudaSuccess && i < EVENT_CACHE; i++)
    if (g_events[i].comm == comm && g_events[i].device == device) {
      *out = &g_events[i];
      return EPX_SUCCESS;
    }
  rank_events_t *r = &g_events[g_events_next];
  if (e == cudaSuccess && r->comm) {
    cudaEventDestroy(r->ready);
    cudaEventDestroy(r->done);
    r->comm = NULL;
  }
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&r->ready, cudaEventDisableTiming);
  if (e == cudaSuccess) {
    e = cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming);
    if (e != cudaSuccess) cudaEventDestroy(r->ready);
  }
  if (e != cudaSuccess)
    return epx_error(EPX_ERROR_CUDA, "%s: the in-process transport's events: %s", fn, cudaGetErrorString(e));
  r->comm = comm;
  r->device = device;
  g_events_next = (g_events_next + 1) % EVENT_CACHE;
  *out = r;
  return EPX_SUCCESS;
}

/* ---- groups --------------------------------------------------------------- */

/* What a rank publishes in a group's handshake (every peer gets the same). */
typedef struct {
  cudaEvent_t ready, done;
  const epx_cuda_move_t *sends;
  int64_t ns;
} offer_t;

typedef struct {
  epx_comm_t comm;
  const epx_cuda_move_t *recvs;
  int64_t nr;
  cudaStream_t stream;
  cudaEvent_t done;
  const char *fn;
} pull_t;

/* Inside the handshake: this rank's receives, pulled from the peers' sends
 * (the k-th receive from p is p's k-th send to this rank). */
static epx_status_t pull(void *ctx, const void *recv) {
  const pull_t *q = ctx;
  const offer_t *offers = recv;
  const int32_t W = q->comm->size, me = q->comm->rank;
  int64_t *taken = calloc((size_t)W, sizeof *taken); /* sends of each peer matched so far */
  uint8_t *waited = calloc((size_t)W, 1);
  epx_status_t status = EPX_SUCCESS;
  if (!taken || !waited) {
    status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", q->fn);
    goto done;
  }
  for (int64_t j = 0; j < q->nr && status == EPX_SUCCESS; j++) {
    const epx_cuda_move_t *r = &q->recvs[j];
    if (!r->bytes) continue;
    const offer_t *o = &offers[r->peer];
    const epx_cuda_move_t *s = NULL;
    while (taken[r->peer] < o->ns && !s) {
      const epx_cuda_move_t *c = &o->sends[taken[r->peer]++];
      if (c->peer == me && c->bytes) s = c;
    }
    if (!s || s->bytes != r->bytes) {
      status = epx_error(EPX_ERROR_INTERNAL,
                         "%s: rank %d receives %zu bytes from rank %d, which sends it %zu in that place of the "
                         "group (the in-process transport pairs them in order)", q->fn, me, r->bytes, r->peer,
                         s ? s->bytes : (size_t)0);
      break;
    }
    cudaError_t e = cudaSuccess;
    if (!waited[r->peer]) e = cudaStreamWaitEvent(q->stream, o->ready, 0), waited[r->peer] = 1;
    if (e == cudaSuccess) e = cudaMemcpyAsync(r->ptr, s->ptr, r->bytes, cudaMemcpyDefault, q->stream);
    if (e != cudaSuccess) status = epx_cuda_fail(e, q->fn, "the in-process copy (cudaMemcpyAsync)");
  }
  if (status == EPX_SUCCESS) {
    const cudaError_t e = cudaEventRecord(q->done, q->stream);
    if (e != cudaSuccess) status = epx_cuda_fail(e, q->fn, "cudaEventRecord");
  }
done:
  free(taken);
  free(waited);
  return status;
}

static epx_status_t capturable(cudaStream_t stream, const char *fn) {
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone)
    return EPX_SUCCESS;
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: the in-process transport (ranks as threads of one process) cannot move rows inside a CUDA "
                   "graph capture: each rank's graph would wait on events its peers record outside it; capture "
                   "the fused path (exchange_path EPX_PATH_FUSED) or the low-latency window instead", fn);
}

static epx_status_t in_process_sendrecv(epx_comm_t comm, const epx_cuda_move_t *sends, int64_t ns,
                                        const epx_cuda_move_t *recvs, int64_t nr, cudaStream_t stream,
                                        const char *fn) {
  epx_status_t status = capturable(stream, fn);
  if (status != EPX_SUCCESS) return status;
  rank_events_t *ev = NULL;
  status = events_of(comm, &ev, fn);
  if (status != EPX_SUCCESS) return status;
  const cudaError_t e = cudaEventRecord(ev->ready, stream);
  if (e != cudaSuccess) return epx_cuda_fail(e, fn, "cudaEventRecord");
  const int32_t W = comm->size;
  offer_t *blocks = malloc(2 * sizeof(offer_t) * (size_t)W);
  if (!blocks) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t p = 0; p < W; p++) blocks[p] = (offer_t){ev->ready, ev->done, sends, ns};
  pull_t q = {comm, recvs, nr, stream, ev->done, fn};
  status = epx_comm_handshake(comm, fn, blocks, blocks + W, sizeof(offer_t), pull, &q);
  /* the peers this rank sent to have pulled before anything later here */
  uint8_t *sent = calloc((size_t)W, 1);
  for (int64_t i = 0; status == EPX_SUCCESS && sent && i < ns; i++)
    if (sends[i].bytes && !sent[sends[i].peer]) {
      sent[sends[i].peer] = 1;
      const cudaError_t w = cudaStreamWaitEvent(stream, blocks[W + sends[i].peer].done, 0);
      if (w != cudaSuccess) status = epx_cuda_fail(w, fn, "cudaStreamWaitEvent");
    }
  if (!sent && status == EPX_SUCCESS) status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  free(sent);
  free(blocks);
  return status;
}

static epx_status_t in_process_allgather(epx_comm_t comm, const void *const *send, void *const *recv,
                                         const size_t *bytes, int n, cudaStream_t stream, const char *fn) {
  const int32_t W = comm->size;
  const size_t moves = (size_t)n * (size_t)W;
  epx_cuda_move_t *m = malloc(2 * moves * sizeof *m);
  if (!m) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int i = 0; i < n; i++)
    for (int32_t p = 0; p < W; p++) {
      m[(size_t)i * W + p] = (epx_cuda_move_t){p, (void *)send[i], bytes[i]};
      m[moves + (size_t)i * W + p] = (epx_cuda_move_t){p, (char *)recv[i] + (size_t)p * bytes[i], bytes[i]};
    }
  const epx_status_t status = in_process_sendrecv(comm, m, (int64_t)moves, m + moves, (int64_t)moves, stream, fn);
  free(m);
  return status;
}

/* ---- waits ---------------------------------------------------------------- */

typedef struct {
  epx_comm_t comm;
  cudaStream_t stream;
  const char *fn;
} stream_wait_t;

static int stream_poll(void *ctx, epx_status_t *status) {
  const stream_wait_t *w = ctx;
  return epx_cuda_xport_stream_poll(w->stream, w->fn, status);
}

static epx_status_t stream_timed_out(void *ctx) {
  const stream_wait_t *w = ctx;
  w->comm->failed = 1;
  return epx_error(EPX_ERROR_TIMEOUT,
                   "%s: the work on rank %d's stream did not complete within %.3g s (a peer did not reach the same "
                   "call: its copies, which this rank's stream waits for, were never enqueued); the comm is "
                   "unusable: destroy it", w->fn, (int)w->comm->rank, w->comm->timeout_seconds);
}

static epx_status_t in_process_wait(epx_comm_t comm, cudaStream_t stream, const char *fn) {
  stream_wait_t w = {comm, stream, fn};
  return epx_wait_bounded(comm->timeout_seconds, stream_poll, &w, stream_timed_out);
}

/* ---- windows -------------------------------------------------------------- */

typedef struct {
  void *base;
  int32_t device;
  int32_t refused; /* 1: this rank has no window */
} window_block_t;

static epx_status_t in_process_window_open(epx_comm_t comm, size_t bytes, epx_cuda_window_t *window,
                                           const char *fn) {
  const int32_t W = comm->size;
  epx_status_t status = epx_cuda_xport_window_start(comm, window, "in-process", fn);
  if (status != EPX_SUCCESS) return status;
  int device = 0;
  window_block_t mine = {NULL, 0, 1};
  char reason[512] = "";
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaMalloc(&mine.base, bytes);
  if (e == cudaSuccess) mine.refused = 0, mine.device = device;
  else mine.base = NULL, (void)cudaGetLastError(), snprintf(reason, sizeof reason, "cudaMalloc of %zu bytes: %s",
                                                            bytes, cudaGetErrorString(e));
  window_block_t *all = calloc((size_t)W, sizeof *all);
  if (!all) {
    if (mine.base) cudaFree(mine.base);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  status = epx_cuda_xport_window_gather(comm, &mine, all, sizeof mine, offsetof(window_block_t, refused),
                                        "in-process", reason, fn);
  for (int32_t p = 0; status == EPX_SUCCESS && p < W; p++) {
    const int other = all[p].device;
    int reach = other == mine.device;
    if (!reach && cudaDeviceCanAccessPeer(&reach, mine.device, other) == cudaSuccess && reach) {
      const cudaError_t pe = cudaDeviceEnablePeerAccess(other, 0);
      if (pe == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
      else if (pe != cudaSuccess) reach = 0, (void)cudaGetLastError();
    }
    window->peer[p] = reach ? all[p].base : NULL;
    window->ranks_on_device += other == mine.device;
  }
  if (status == EPX_SUCCESS) window->base = mine.base;
  else if (mine.base) cudaFree(mine.base);
  free(all);
  return status;
}

static void in_process_window_close(epx_comm_t comm, epx_cuda_window_t *window) {
  /* no peer writes into it any more (each synchronised its device first) */
  epx_cuda_xport_window_free(comm, window, 1);
}

static void in_process_window_drop(epx_comm_t comm, epx_cuda_window_t *window) {
  epx_cuda_xport_window_free(comm, window, 0);
}

const epx_cuda_xport_t epx_cuda_xport_in_process = {
    .name = "in-process",
    .allgather = in_process_allgather,
    .sendrecv = in_process_sendrecv,
    .wait = in_process_wait,
    .fail_timeout = epx_cuda_xport_host_fail_timeout,
    .agree_max = epx_cuda_xport_host_agree_max,
    .window_open = in_process_window_open,
    .window_close = in_process_window_close,
    .window_drop = in_process_window_drop,
};
