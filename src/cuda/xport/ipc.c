/* The ipc transport (xport.h): W ranks as processes of one host over an shm
 * comm (epx_comm_create_shm; torchrun's processes through
 * epx.torch.comm_from_process_group), on one GPU or several. Device memory
 * meets through CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle), the
 * events that order the copies through cudaIpcGetEventHandle /
 * cudaIpcOpenEventHandle, and the handles through the comm's host exchange
 * (an alltoall of fixed blocks, bounded by the comm's timeout and naming a
 * rank that died or stopped: the shm comm's waits).
 *
 * A group of messages (sendrecv; an all-gather is one whose sends every
 * peer takes):
 *   1. the rank's stream waits on every peer's `done` event and on its own
 *      (the staging half about to be written is no longer read: see below),
 *      copies its sends into its staging memory, the messages to each peer
 *      one after another in list order (an all-gather's once, for every
 *      peer), and records its `ready` event; messages to itself are copied
 *      straight into their receive buffers;
 *   2. one host exchange: to each peer, where its messages lie in the
 *      staging (offset, bytes, count), the staging's and the events'
 *      handles, and this rank's verdict (a staging it could not grow);
 *   3. for each peer that sends it something, the stream waits on the
 *      peer's `ready` and copies each message from the peer's mapped staging
 *      into the receive buffer (the k-th receive from p is p's k-th send to
 *      this rank, as NCCL pairs them), then records `done`.
 * Reuse: a rank's staging has two halves, used by calls in turn. The half
 * a call writes was last read by the peers in the call two before, whose
 * `done` each peer recorded before it sent its block of the call one before,
 * which this rank received before it entered this call: the latest record
 * of each peer's `done` that step 1 waits on is at least that one (a wait
 * takes the record current when it is enqueued; a later record is later on
 * the peer's stream, so it is stronger, and no peer records `done` of this
 * call before this rank's block of it has reached it). The same holds for
 * `ready`: a peer that waits on a later record waits for more.
 * Growth: a call whose messages outgrow the half allocates a larger staging
 * (a new sequence number and handle in the blocks); a peer that sees a new
 * handle waits for its stream (bounded), closes its mapping of the old one
 * and opens the new one; the old staging is freed once every peer's blocks
 * say it holds the new one (CUDA forbids freeing exported memory that a
 * peer still has open).
 *
 * Ranks of one process (threads, each with an shm comm) take each other's
 * pointers and events directly: CUDA opens no handle of its own process.
 *
 * The staging, events and mappings live per comm (comm->device_state), made
 * at the first call, released at epx_comm_destroy (ipc_release: mappings
 * closed, a barrier, then this rank's memory freed). Windows (window_open)
 * are exported device memory; their peers' mappings close at window_close.
 *
 * Processes that share a GPU without MPS take turns on it (time slicing),
 * so kernels that wait on each other's flags (the fused path, the
 * low-latency window) need not run at once: co_resident refuses them there
 * unless EPX_IPC_FUSED=try (epx.h), and the buffer takes the host path (the
 * slabs). Nothing here spins on the GPU. Graph capture: refused, as the
 * in-process transport's. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/transport.h"
#include "core/wait.h"
#include "cuda/common/check.h"
#include "cuda/xport/xport.h"

#define IPC_ALIGN ((size_t)256)
/* a staging half's least size, and its rounding (cudaMalloc's granularity
 * for exported memory is 2 MiB) */
#define IPC_MIN_HALF ((size_t)1 << 20)

static size_t aligned(size_t bytes) { return (bytes + IPC_ALIGN - 1) & ~(IPC_ALIGN - 1); }

static epx_status_t cuda_failed(const char *fn, const char *what, cudaError_t e) {
  (void)cudaGetLastError(); /* the failed call's error, not a later call's */
  return epx_cuda_fail(e, fn, what);
}

/* ---- this process --------------------------------------------------------- */

/* A process of this host: its pid and pid namespace (the shm comm's ranks may
 * be containers sharing /dev/shm). */
typedef struct {
  int32_t pid;
  int32_t pad;
  uint64_t pid_ns;
} process_t;

static process_t this_process(void) {
  struct stat st;
  process_t p = {(int32_t)getpid(), 0, 0};
  if (stat("/proc/self/ns/pid", &st) == 0) p.pid_ns = (uint64_t)st.st_ino;
  return p;
}

static int same_process(process_t a, process_t b) { return a.pid == b.pid && a.pid_ns == b.pid_ns; }

/* ---- the comm's state ------------------------------------------------------ */

typedef struct retired {
  char *base;
  struct retired *next;
} retired_t;

typedef struct {
  uint64_t seq;        /* its staging mapped here (0: none) */
  char *stage;         /* as this process addresses it */
  int stage_opened;    /* through cudaIpcOpenMemHandle (else its own pointer) */
  cudaEvent_t ready, done;
  int events_opened;   /* 1: through cudaIpcOpenEventHandle; 2: its own events */
} peer_t;

typedef struct {
  int device;
  process_t process;
  char *stage;         /* two halves of `half` bytes */
  size_t half;
  uint64_t seq;        /* of stage (0: none yet) */
  cudaIpcMemHandle_t stage_handle;
  retired_t *retired;  /* earlier stagings a peer may still hold */
  cudaEvent_t ready, done;
  cudaIpcEventHandle_t ready_handle, done_handle;
  uint64_t calls;      /* groups so far: the half is calls % 2 */
  int done_recorded;   /* `done` has a record (its own wait in step 1) */
  peer_t *peers;       /* [W] */
} ipc_state_t;

/* What a rank sends each peer in a group's exchange. */
typedef struct {
  int32_t verdict;     /* epx_status_t of this rank's step 1 */
  int32_t count;       /* messages for the receiver */
  process_t process;
  uint64_t offset;     /* where they lie in the sender's staging */
  uint64_t bytes;      /* their aligned sizes, summed */
  uint64_t seq;        /* the sender's staging (0: none) */
  uint64_t holds;      /* the receiver's staging the sender has mapped */
  uint64_t stage_ptr, ready_ptr, done_ptr; /* for a peer of the same process */
  cudaIpcMemHandle_t stage;
  cudaIpcEventHandle_t ready, done;
} block_t;

static void peer_close(peer_t *p) {
  if (p->stage_opened && p->stage) cudaIpcCloseMemHandle(p->stage);
  p->stage = NULL, p->stage_opened = 0, p->seq = 0;
}

/* The done event covers every group of the comm (each waits on the one
 * before): its completion means no copy of this rank reads a peer's
 * staging any more. */
static int own_done_poll(void *ctx, epx_status_t *status) {
  const ipc_state_t *st = ctx;
  *status = EPX_SUCCESS;
  return cudaEventQuery(st->done) != cudaErrorNotReady;
}

static epx_status_t own_done_timed_out(void *ctx) {
  (void)ctx;
  return EPX_ERROR_TIMEOUT;
}

static void ipc_release(epx_comm_t comm) {
  ipc_state_t *st = comm->device_state;
  if (!st) return;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess && device != st->device) cudaSetDevice(st->device);
  /* this rank's copies from the peers' stagings are over before it unmaps
   * them (a failed comm's peer may never record what they wait on: no wait) */
  if (!comm->failed && st->done_recorded)
    (void)epx_wait_bounded(comm->timeout_seconds, own_done_poll, st, own_done_timed_out);
  for (int32_t p = 0; p < comm->size; p++) {
    peer_t *q = &st->peers[p];
    peer_close(q);
    if (q->events_opened == 1) cudaEventDestroy(q->ready), cudaEventDestroy(q->done);
    q->events_opened = 0;
  }
  /* every peer has closed its mappings of this rank's memory and events */
  if (!comm->failed) (void)comm->ops->barrier(comm, "epx_comm_destroy");
  while (st->retired) {
    retired_t *r = st->retired;
    st->retired = r->next;
    cudaFree(r->base);
    free(r);
  }
  if (st->stage) cudaFree(st->stage);
  if (st->ready) cudaEventDestroy(st->ready);
  if (st->done) cudaEventDestroy(st->done);
  (void)cudaGetLastError();
  if (device != st->device) cudaSetDevice(device);
  free(st->peers);
  free(st);
  comm->device_state = NULL;
  comm->device_release = NULL;
}

static epx_status_t state_of(epx_comm_t comm, ipc_state_t **out, const char *fn) {
  ipc_state_t *st = comm->device_state;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_failed(fn, "cudaGetDevice", e);
  if (st) {
    if (st->device != device)
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: rank %d's current CUDA device is %d, and its comm's first CUDA call ran on device %d; "
                       "the ipc transport keeps one device a comm: set device %d before the call", fn,
                       (int)comm->rank, device, st->device, st->device);
    *out = st;
    return EPX_SUCCESS;
  }
  st = calloc(1, sizeof *st);
  if (st) st->peers = calloc((size_t)comm->size, sizeof *st->peers);
  if (!st || !st->peers) {
    free(st);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  st->device = device;
  st->process = this_process();
  const unsigned flags = cudaEventInterprocess | cudaEventDisableTiming;
  e = cudaEventCreateWithFlags(&st->ready, flags);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&st->done, flags);
  if (e == cudaSuccess) e = cudaIpcGetEventHandle(&st->ready_handle, st->ready);
  if (e == cudaSuccess) e = cudaIpcGetEventHandle(&st->done_handle, st->done);
  if (e != cudaSuccess) {
    if (st->ready) cudaEventDestroy(st->ready);
    if (st->done) cudaEventDestroy(st->done);
    free(st->peers);
    free(st);
    return cuda_failed(fn, "the ipc transport's interprocess events (cudaEventCreateWithFlags, "
                       "cudaIpcGetEventHandle)", e);
  }
  comm->device_state = st;
  comm->device_release = ipc_release;
  *out = st;
  return EPX_SUCCESS;
}

/* ---- groups ------------------------------------------------------------------ */

typedef struct {
  const epx_cuda_move_t *sends;
  int64_t ns;
  const epx_cuda_move_t *recvs;
  int64_t nr;
  int shared; /* an all-gather: every peer takes every send (their peer unread) */
} group_t;

static int sends_to(const group_t *g, const epx_cuda_move_t *m, int32_t p) {
  return m->bytes && (g->shared || m->peer == p);
}

/* The staging bytes of this rank's messages to its peers. */
static size_t staging_need(const group_t *g, int32_t me) {
  size_t need = 0;
  for (int64_t i = 0; i < g->ns; i++)
    if (g->sends[i].bytes && (g->shared || g->sends[i].peer != me)) need += aligned(g->sends[i].bytes);
  return need;
}

/* A staging of at least `need` bytes a half (the old one retired). */
static epx_status_t grow(ipc_state_t *st, size_t need, const char *fn) {
  size_t half = st->half ? 2 * st->half : IPC_MIN_HALF;
  while (half < need) half *= 2;
  char *base = NULL;
  cudaIpcMemHandle_t handle;
  cudaError_t e = cudaMalloc((void **)&base, 2 * half);
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(&handle, base);
  if (e != cudaSuccess) {
    if (base) cudaFree(base);
    (void)cudaGetLastError();
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: the ipc transport's staging of 2 x %zu bytes (cudaMalloc, "
                     "cudaIpcGetMemHandle): %s", fn, half, cudaGetErrorString(e));
  }
  if (st->stage) {
    retired_t *r = malloc(sizeof *r);
    if (!r) {
      cudaFree(base);
      return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
    }
    *r = (retired_t){st->stage, st->retired};
    st->retired = r;
  }
  st->stage = base;
  st->half = half;
  st->stage_handle = handle;
  st->seq++;
  return EPX_SUCCESS;
}

/* Step 1: the staging written, the messages to itself copied, `ready`
 * recorded. offsets[p], count[p], bytes[p]: the region of peer p. */
static epx_status_t stage(epx_comm_t comm, ipc_state_t *st, const group_t *g, cudaStream_t stream, uint64_t *offset,
                          int32_t *count, uint64_t *bytes, const char *fn) {
  const int32_t W = comm->size, me = comm->rank;
  const size_t need = staging_need(g, me);
  epx_status_t status = need > st->half ? grow(st, need, fn) : EPX_SUCCESS;
  if (status != EPX_SUCCESS) return status;
  cudaError_t e = cudaSuccess;
  for (int32_t p = 0; p < W && e == cudaSuccess; p++)
    if (p != me && st->peers[p].events_opened) e = cudaStreamWaitEvent(stream, st->peers[p].done, 0);
  if (e == cudaSuccess && st->done_recorded) e = cudaStreamWaitEvent(stream, st->done, 0);
  char *half = st->stage ? st->stage + (st->calls % 2) * st->half : NULL;
  size_t at = 0;
  for (int32_t p = 0; p < W && e == cudaSuccess; p++) {
    if (p == me) continue;
    const size_t first = g->shared ? 0 : at;
    offset[p] = (uint64_t)((half ? (size_t)(half - st->stage) : 0) + first), count[p] = 0, bytes[p] = 0;
    for (int64_t i = 0; i < g->ns && e == cudaSuccess; i++) {
      const epx_cuda_move_t *m = &g->sends[i];
      if (!sends_to(g, m, p)) continue;
      if (!g->shared || p == (me ? 0 : 1)) /* an all-gather's sends are staged once */
        e = cudaMemcpyAsync(half + first + bytes[p], m->ptr, m->bytes, cudaMemcpyDefault, stream);
      count[p]++, bytes[p] += aligned(m->bytes);
    }
    if (!g->shared) at += bytes[p];
  }
  /* the messages to itself: the k-th receive from this rank takes its k-th send to itself */
  for (int64_t i = 0, j = 0; j < g->nr && e == cudaSuccess; j++) {
    const epx_cuda_move_t *r = &g->recvs[j];
    if (r->peer != me || !r->bytes) continue;
    while (i < g->ns && !sends_to(g, &g->sends[i], me)) i++;
    if (i == g->ns || g->sends[i].bytes != r->bytes)
      return epx_error(EPX_ERROR_INTERNAL, "%s: rank %d receives %zu bytes from itself, which sends itself %zu in "
                       "that place of the group (the ipc transport pairs them in order)", fn, (int)me, r->bytes,
                       i == g->ns ? (size_t)0 : g->sends[i].bytes);
    e = cudaMemcpyAsync(r->ptr, g->sends[i++].ptr, r->bytes, cudaMemcpyDefault, stream);
  }
  if (e == cudaSuccess) e = cudaEventRecord(st->ready, stream);
  return e == cudaSuccess ? EPX_SUCCESS : cuda_failed(fn, "staging the ipc transport's sends", e);
}

/* The peer's events, opened once (their handles never change). */
static epx_status_t peer_events(const ipc_state_t *st, peer_t *q, const block_t *b, int32_t p, const char *fn) {
  if (q->events_opened) return EPX_SUCCESS;
  if (same_process(st->process, b->process)) {
    q->ready = (cudaEvent_t)(uintptr_t)b->ready_ptr, q->done = (cudaEvent_t)(uintptr_t)b->done_ptr;
    q->events_opened = 2;
    return EPX_SUCCESS;
  }
  cudaError_t e = cudaIpcOpenEventHandle(&q->ready, b->ready);
  if (e == cudaSuccess) {
    e = cudaIpcOpenEventHandle(&q->done, b->done);
    if (e != cudaSuccess) cudaEventDestroy(q->ready);
  }
  if (e != cudaSuccess) {
    char what[96];
    snprintf(what, sizeof what, "opening rank %d's interprocess events (cudaIpcOpenEventHandle)", (int)p);
    return cuda_failed(fn, what, e);
  }
  q->events_opened = 1;
  return EPX_SUCCESS;
}

typedef struct {
  epx_comm_t comm;
  cudaStream_t stream;
  const ipc_state_t *st;
  const char *fn;
} stream_wait_t;

static int stream_poll(void *ctx, epx_status_t *status) {
  const stream_wait_t *w = ctx;
  return epx_cuda_xport_stream_poll(w->stream, w->fn, status);
}

/* The peers whose last `ready` or `done` has not completed: those this
 * rank's stream waits for. */
static void stuck_peers(const ipc_state_t *st, int32_t W, int32_t me, char *out, size_t size) {
  size_t at = 0;
  out[0] = 0;
  for (int32_t p = 0; st && p < W && at + 16 < size; p++) {
    const peer_t *q = &st->peers[p];
    if (p == me || !q->events_opened) continue;
    if (cudaEventQuery(q->ready) == cudaErrorNotReady || cudaEventQuery(q->done) == cudaErrorNotReady)
      at += (size_t)snprintf(out + at, size - at, "%s%d", at ? ", " : "", (int)p);
  }
  (void)cudaGetLastError();
}

static epx_status_t stream_timed_out(void *ctx) {
  const stream_wait_t *w = ctx;
  char stuck[256];
  stuck_peers(w->st, w->comm->size, w->comm->rank, stuck, sizeof stuck);
  w->comm->failed = 1;
  return epx_error(EPX_ERROR_TIMEOUT,
                   "%s: the work on rank %d's stream did not complete within %.3g s: it waits for the work of "
                   "rank(s) %s (a process that died, stopped, or did not reach the same call); the comm is "
                   "unusable: destroy it", w->fn, (int)w->comm->rank, w->comm->timeout_seconds,
                   stuck[0] ? stuck : "(none named: the GPU itself is slow or stuck)");
}

static epx_status_t stream_wait(epx_comm_t comm, const ipc_state_t *st, cudaStream_t stream, const char *fn) {
  stream_wait_t w = {comm, stream, st, fn};
  return epx_wait_bounded(comm->timeout_seconds, stream_poll, &w, stream_timed_out);
}

/* After the exchange: the peer's staging as its block names it (a new one
 * replaces the mapping of the old, once this rank's copies from it are
 * over). */
static epx_status_t peer_staging(epx_comm_t comm, ipc_state_t *st, cudaStream_t stream, int32_t p, const block_t *b,
                                 const char *fn) {
  peer_t *q = &st->peers[p];
  if (b->seq == q->seq) return EPX_SUCCESS;
  if (q->stage_opened) {
    epx_status_t status = stream_wait(comm, st, stream, fn);
    if (status != EPX_SUCCESS) return status;
  }
  peer_close(q);
  if (!b->seq) return EPX_SUCCESS;
  if (same_process(st->process, b->process)) {
    q->stage = (char *)(uintptr_t)b->stage_ptr;
  } else {
    const cudaError_t e = cudaIpcOpenMemHandle((void **)&q->stage, b->stage, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      q->stage = NULL;
      char what[96];
      snprintf(what, sizeof what, "opening rank %d's staging (cudaIpcOpenMemHandle)", (int)p);
      return cuda_failed(fn, what, e);
    }
    q->stage_opened = 1;
  }
  q->seq = b->seq;
  return EPX_SUCCESS;
}

/* Step 3 for peer p: its messages pulled from its staging. */
static epx_status_t pull(epx_comm_t comm, ipc_state_t *st, const group_t *g, cudaStream_t stream, int32_t p,
                         const block_t *b, const char *fn) {
  const peer_t *q = &st->peers[p];
  uint64_t at = b->offset, taken = 0;
  int32_t count = 0;
  cudaError_t e = cudaSuccess;
  for (int64_t j = 0; j < g->nr && e == cudaSuccess; j++) {
    const epx_cuda_move_t *r = &g->recvs[j];
    if (r->peer != p || !r->bytes) continue;
    if (count++ == b->count || taken + aligned(r->bytes) > b->bytes) break;
    if (count == 1) e = cudaStreamWaitEvent(stream, q->ready, 0);
    if (e == cudaSuccess) e = cudaMemcpyAsync(r->ptr, q->stage + at, r->bytes, cudaMemcpyDefault, stream);
    at += aligned(r->bytes), taken += aligned(r->bytes);
  }
  if (e != cudaSuccess) return cuda_failed(fn, "the ipc transport's copy (cudaMemcpyAsync)", e);
  if (count != b->count || taken != b->bytes)
    return epx_error(EPX_ERROR_INTERNAL,
                     "%s: rank %d receives %d message(s) from rank %d (%llu bytes aligned), which sends it %d "
                     "(%llu) in this group (the ipc transport pairs them in order)", fn, (int)comm->rank, count,
                     (int)p, (unsigned long long)taken, (int)b->count, (unsigned long long)b->bytes);
  return EPX_SUCCESS;
}

/* The retired stagings, freed once every peer holds the current one. */
static void free_retired(epx_comm_t comm, ipc_state_t *st, const block_t *blocks) {
  for (int32_t p = 0; p < comm->size; p++)
    if (p != comm->rank && blocks[p].holds != st->seq) return;
  while (st->retired) {
    retired_t *r = st->retired;
    st->retired = r->next;
    cudaFree(r->base);
    free(r);
  }
}

static epx_status_t capturable(cudaStream_t stream, const char *fn) {
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone)
    return EPX_SUCCESS;
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: the ipc transport (ranks as processes of one host) cannot move rows inside a CUDA graph "
                   "capture: each rank's graph would wait on events its peers record outside it; capture the "
                   "low-latency window instead, or run the call outside the capture", fn);
}

static epx_status_t ipc_group(epx_comm_t comm, const group_t *g, cudaStream_t stream, const char *fn) {
  /* a failed comm's peer may be gone: nothing is enqueued that waits on it */
  epx_status_t status = epx_comm_check_alive(comm, fn);
  if (status == EPX_SUCCESS) status = capturable(stream, fn);
  if (status != EPX_SUCCESS) return status;
  ipc_state_t *st = NULL;
  status = state_of(comm, &st, fn);
  if (status != EPX_SUCCESS) return status;
  const int32_t W = comm->size, me = comm->rank;
  block_t *blocks = calloc(2 * (size_t)W, sizeof *blocks);
  uint64_t *offset = calloc((size_t)W, sizeof *offset), *bytes = calloc((size_t)W, sizeof *bytes);
  int32_t *count = calloc((size_t)W, sizeof *count);
  if (!blocks || !offset || !bytes || !count) {
    status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
    goto done;
  }
  /* a rank that fails here still takes part in the exchange, so that its
   * peers refuse the call too instead of waiting for it */
  const epx_status_t local = stage(comm, st, g, stream, offset, count, bytes, fn);
  char message[1024] = "";
  if (local != EPX_SUCCESS) snprintf(message, sizeof message, "%s", epx_last_error());
  for (int32_t p = 0; p < W; p++)
    blocks[p] = (block_t){local, count[p], st->process, offset[p], bytes[p], st->seq, st->peers[p].seq,
                          (uint64_t)(uintptr_t)st->stage, (uint64_t)(uintptr_t)st->ready,
                          (uint64_t)(uintptr_t)st->done, st->stage_handle, st->ready_handle, st->done_handle};
  status = comm->ops->alltoall(comm, fn, blocks, blocks + W, sizeof *blocks);
  if (status != EPX_SUCCESS) goto done;
  st->calls++;
  const block_t *got = blocks + W;
  for (int32_t p = 0; p < W; p++)
    if (got[p].verdict != EPX_SUCCESS) {
      status = p == me ? epx_error(local, "%s", message)
                       : epx_error(EPX_ERROR_UNSUPPORTED, "%s: rank %d could not stage its messages (its "
                                   "epx_last_error says why); every rank refuses the call", fn, (int)p);
      goto done;
    }
  free_retired(comm, st, got);
  for (int32_t p = 0; p < W && status == EPX_SUCCESS; p++) {
    if (p == me) continue;
    status = peer_events(st, &st->peers[p], &got[p], p, fn);
    if (status == EPX_SUCCESS) status = peer_staging(comm, st, stream, p, &got[p], fn);
    if (status == EPX_SUCCESS && got[p].count) status = pull(comm, st, g, stream, p, &got[p], fn);
  }
  if (status == EPX_SUCCESS) {
    const cudaError_t e = cudaEventRecord(st->done, stream);
    if (e != cudaSuccess) status = cuda_failed(fn, "cudaEventRecord", e);
    else st->done_recorded = 1;
  }
done:
  free(blocks);
  free(offset);
  free(bytes);
  free(count);
  return status;
}

static epx_status_t ipc_sendrecv(epx_comm_t comm, const epx_cuda_move_t *sends, int64_t ns,
                                 const epx_cuda_move_t *recvs, int64_t nr, cudaStream_t stream, const char *fn) {
  const group_t g = {sends, ns, recvs, nr, 0};
  return ipc_group(comm, &g, stream, fn);
}

static epx_status_t ipc_allgather(epx_comm_t comm, const void *const *send, void *const *recv, const size_t *bytes,
                                  int n, cudaStream_t stream, const char *fn) {
  const int32_t W = comm->size;
  epx_cuda_move_t *items = malloc((size_t)n * sizeof *items);
  epx_cuda_move_t *recvs = malloc((size_t)n * (size_t)W * sizeof *recvs);
  epx_status_t status = EPX_SUCCESS;
  if (!items || !recvs) {
    status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  } else {
    /* receives in the order of each peer's sends: its items in order */
    for (int i = 0; i < n; i++) items[i] = (epx_cuda_move_t){comm->rank, (void *)send[i], bytes[i]};
    for (int32_t p = 0; p < W; p++)
      for (int i = 0; i < n; i++)
        recvs[(size_t)p * n + i] = (epx_cuda_move_t){p, (char *)recv[i] + (size_t)p * bytes[i], bytes[i]};
    const group_t g = {items, n, recvs, (int64_t)n * W, 1};
    status = ipc_group(comm, &g, stream, fn);
  }
  free(items);
  free(recvs);
  return status;
}

/* ---- waits and agreements --------------------------------------------------- */

static epx_status_t ipc_wait(epx_comm_t comm, cudaStream_t stream, const char *fn) {
  return stream_wait(comm, comm->device_state, stream, fn);
}

/* ---- devices ------------------------------------------------------------------ */

/* A rank's GPU and process, gathered. */
typedef struct {
  process_t process;
  uint8_t uuid[16];
  int32_t failed; /* 1: this rank could not name its GPU */
  int32_t pad;
} device_block_t;

static epx_status_t device_block(device_block_t *b, const char *fn) {
  memset(b, 0, sizeof *b);
  b->process = this_process();
  int device = 0;
  struct cudaDeviceProp prop;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    b->failed = 1;
    return cuda_failed(fn, "naming this rank's GPU (cudaGetDeviceProperties)", e);
  }
  memcpy(b->uuid, prop.uuid.bytes, sizeof b->uuid);
  return EPX_SUCCESS;
}

/* Gathers every rank's device block; a rank that could not name its GPU
 * fails the call on every rank. */
static epx_status_t gather_devices(epx_comm_t comm, device_block_t *all, const char *fn) {
  device_block_t mine;
  const epx_status_t local = device_block(&mine, fn);
  char message[512] = "";
  if (local != EPX_SUCCESS) snprintf(message, sizeof message, "%s", epx_last_error());
  epx_status_t status = comm->ops->allgather(comm, fn, &mine, all, sizeof mine);
  for (int32_t p = 0; status == EPX_SUCCESS && p < comm->size; p++)
    if (all[p].failed)
      status = p == comm->rank ? epx_error(local, "%s", message)
                               : epx_error(EPX_ERROR_CUDA, "%s: rank %d could not name its GPU (its "
                                           "epx_last_error says why)", fn, (int)p);
  return status;
}

/* Kernels that wait on each other's flags run at once only where no two
 * processes share a GPU (they take turns on it without MPS), or where
 * EPX_IPC_FUSED=try says the processes run concurrently (MPS). */
static epx_status_t ipc_co_resident(epx_comm_t comm, const char *fn) {
  const int32_t W = comm->size;
  device_block_t *all = calloc((size_t)W, sizeof *all);
  if (!all) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  epx_status_t status = gather_devices(comm, all, fn);
  int32_t a = -1, b = -1;
  for (int32_t p = 0; status == EPX_SUCCESS && p < W && a < 0; p++)
    for (int32_t r = p + 1; r < W && a < 0; r++)
      if (!memcmp(all[p].uuid, all[r].uuid, sizeof all[p].uuid) && !same_process(all[p].process, all[r].process))
        a = p, b = r;
  const char *env = getenv("EPX_IPC_FUSED");
  const int try_it = env && !strcmp(env, "try");
  int64_t refuse = status == EPX_SUCCESS && a >= 0 && !try_it ? comm->rank + 1 : 0, top = 0;
  if (status == EPX_SUCCESS) status = epx_cuda_xport_host_agree_max(comm, refuse, &top, fn);
  if (status == EPX_SUCCESS && top)
    status = epx_error(EPX_ERROR_UNSUPPORTED,
                       "%s: ranks %d and %d are processes sharing one GPU (the ipc transport): without MPS the "
                       "GPU runs their kernels in turns, so kernels that wait on each other's flags (the fused "
                       "path, the low-latency window) cannot finish; the host path (the low-latency slabs) "
                       "serves the buffer. Under MPS set EPX_IPC_FUSED=try on every rank to try them", fn,
                       (int)(a >= 0 ? a : (int)top - 1), (int)(b >= 0 ? b : comm->rank));
  free(all);
  return status;
}

/* ---- windows -------------------------------------------------------------------- */

typedef struct {
  device_block_t device;
  uint64_t base;
  cudaIpcMemHandle_t handle;
  int32_t refused; /* 1: this rank has no window */
  int32_t pad;
} window_block_t;

static void close_opened(epx_cuda_window_t *window) {
  for (int32_t p = 0; p < EPX_CUDA_WINDOW_MAX_RANKS; p++)
    if (window->opened >> p & 1u) cudaIpcCloseMemHandle(window->peer[p]), window->peer[p] = NULL;
  window->opened = 0;
}

static epx_status_t ipc_window_open(epx_comm_t comm, size_t bytes, epx_cuda_window_t *window, const char *fn) {
  const int32_t W = comm->size, me = comm->rank;
  epx_status_t status = epx_cuda_xport_window_start(comm, window, "ipc", fn);
  if (status != EPX_SUCCESS) return status;
  window_block_t mine;
  memset(&mine, 0, sizeof mine);
  char reason[512] = "";
  void *base = NULL;
  mine.refused = 1;
  if (device_block(&mine.device, fn) != EPX_SUCCESS) {
    snprintf(reason, sizeof reason, "%s", epx_last_error());
  } else {
    cudaError_t e = cudaMalloc(&base, bytes);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&mine.handle, base);
    if (e == cudaSuccess) mine.refused = 0, mine.base = (uint64_t)(uintptr_t)base;
    else snprintf(reason, sizeof reason, "cudaMalloc and cudaIpcGetMemHandle of %zu bytes: %s", bytes,
                  cudaGetErrorString(e)), (void)cudaGetLastError();
  }
  window_block_t *all = calloc((size_t)W, sizeof *all);
  if (!all) {
    if (base) cudaFree(base);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  status = epx_cuda_xport_window_gather(comm, &mine, all, sizeof mine, offsetof(window_block_t, refused), "ipc",
                                        reason, fn);
  for (int32_t p = 0; status == EPX_SUCCESS && p < W; p++) {
    const int on_device = !memcmp(all[p].device.uuid, mine.device.uuid, sizeof mine.device.uuid);
    window->ranks_on_device += on_device;
    if (p == me || same_process(all[p].device.process, mine.device.process)) {
      window->peer[p] = (char *)(uintptr_t)all[p].base;
      continue;
    }
    void *mapped = NULL;
    /* a peer on a GPU this one cannot reach stays out of load/store reach */
    if (cudaIpcOpenMemHandle(&mapped, all[p].handle, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess)
      window->peer[p] = mapped, window->opened |= 1u << p;
    else (void)cudaGetLastError();
  }
  if (status == EPX_SUCCESS) {
    window->base = base;
  } else {
    close_opened(window);
    if (base) cudaFree(base);
  }
  free(all);
  return status;
}

static void ipc_window_close(epx_comm_t comm, epx_cuda_window_t *window) {
  close_opened(window);
  /* every peer has unmapped this rank's window before its memory goes */
  epx_cuda_xport_window_free(comm, window, 1);
}

static void ipc_window_drop(epx_comm_t comm, epx_cuda_window_t *window) {
  close_opened(window);
  epx_cuda_xport_window_free(comm, window, 0);
}

const epx_cuda_xport_t epx_cuda_xport_ipc = {
    .name = "ipc",
    .allgather = ipc_allgather,
    .sendrecv = ipc_sendrecv,
    .wait = ipc_wait,
    .fail_timeout = epx_cuda_xport_host_fail_timeout,
    .agree_max = epx_cuda_xport_host_agree_max,
    .window_open = ipc_window_open,
    .window_close = ipc_window_close,
    .window_drop = ipc_window_drop,
    .co_resident = ipc_co_resident,
};
