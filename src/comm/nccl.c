/* The NCCL transport: GPU ranks, one process per GPU.
 *
 * The CUDA backend moves rows with NCCL on the buffer's stream (src/cuda);
 * this file makes and destroys the comm and gives the vtable's host
 * collectives (buffer creation's shape agreement, the verdicts of collective
 * calls): each stages its host bytes in device scratch, runs one NCCL
 * operation on the comm's own stream and waits for it, bounded.
 *
 * One NCCL per process: libepx is linked against libnccl.so.2 dynamically
 * (never statically), so in a process where PyTorch has already loaded its
 * NCCL the dynamic loader resolves epx's libnccl.so.2 to that same loaded
 * library (by its soname) and epx, PyTorch and the caller's ncclComm_t share
 * one copy.
 *
 * No hangs: NCCL kernels that wait for a peer never return on their own, so
 * every host wait polls the stream and ncclCommGetAsyncError; an error, or no
 * completion within timeout_seconds, aborts the NCCL comm (ncclCommAbort,
 * which also stops its kernels) and fails the epx comm. NCCL does not say
 * which peer is missing: the message names the comm's size and this rank
 * only.
 *
 * Three NCCL comms per epx comm. The main one (epx's own, created
 * nonblocking so that creation is bounded, or the caller's) serves creation
 * and the fused kernels' windows. Two blocking comms split from it at
 * creation carry the traffic: `data` the host path's payload moves and
 * routing gather, `control` the host collectives (split apart so a verdict's
 * all-reduce is not ordered behind payload kernels queued on `data`). They
 * are blocking because a nonblocking comm launches every NCCL group from a
 * thread of its own (pthread_create per ncclGroupEnd, then polled): about
 * 50-100 us of host time per call on 2 H200, more than a layout's kernels.
 * What blocking costs is the right to block the host while enqueueing; NCCL
 * blocks there only to connect peers (done here at creation, by one warm-up
 * of every operation the comms carry, while every rank is known to be in
 * the same call) or when its work queue is full. Host waits stay polled and
 * bounded (ncclCommAbort works on blocking comms too).
 *
 * Shrink (epx_comm_shrink): a failure revokes epx's own main comm
 * (ncclCommRevoke, NCCL 2.28: its work stops, the handle stays) instead of
 * aborting it, and aborts the splits; the survivors then make their comm
 * with ncclCommShrink (NCCL 2.27; NCCL_SHRINK_ABORT after a failure or a
 * lost rank, NCCL_SHRINK_DEFAULT otherwise; with no rank lost, which
 * ncclCommShrink refuses, ncclCommSplit of one color) and split and warm it
 * as a new comm. Shrink and revoke are looked up in the loaded NCCL at run
 * time, not linked: libepx loads against an older libnccl.so.2 (PyTorch's)
 * as before, and there a failure aborts and a shrink is refused by name.
 * NCCL does not say which rank was lost: the survivors find it themselves,
 * as a peer of this host whose process has ended (each rank's host and pid
 * are gathered at creation), so a failed comm whose peers span hosts is
 * refused. */
#include "core/nccl.h"

#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "core/align.h"
#include "core/error.h"
#include "core/registry.h"
#include "core/wait.h"

#if EPX_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#if EPX_HAVE_MPI
#include <mpi.h>
#endif

int epx_has_nccl(void) { return 1; }

enum { MAIN = 0, DATA = 1, CONTROL = 2, COMMS = 3 };

typedef struct nccl_state {
  /* [MAIN] creation and the fused windows; [DATA] the host path's moves;
   * [CONTROL] the host collectives. A split that failed is the main comm. */
  ncclComm_t comms[COMMS];
  int owned;            /* epx created it (destroy it), else the caller's */
  int aborted;          /* ncclCommAbort ran on the main comm: the handle is gone */
  int revoked;          /* ncclCommRevoke ran on it (the splits are aborted): it serves a shrink and the destroy */
  int shrunk;           /* epx_comm_shrink made the survivors' comm from it: the destroy aborts it */
  int64_t *peers;       /* [size][3]: each rank's host key, pid and pid namespace (the shrink's lost ranks) */
  int device;
  cudaStream_t stream;  /* the host collectives' stream */
  void *scratch;        /* device staging of the host collectives */
  void *mirror;         /* pinned host mirror of scratch (same offsets) */
  size_t scratch_bytes;
  char reason[768];     /* why the comm failed */
} nccl_state_t;

#ifndef NCCL_SHRINK_DEFAULT /* headers older than 2.27: the values are NCCL's */
#define NCCL_SHRINK_DEFAULT 0x00
#define NCCL_SHRINK_ABORT 0x01
#endif
#ifndef NCCL_REVOKE_DEFAULT
#define NCCL_REVOKE_DEFAULT 0x00
#endif

typedef ncclResult_t (*nccl_shrink_fn)(ncclComm_t, int *, int, ncclComm_t *, ncclConfig_t *, int);
typedef ncclResult_t (*nccl_revoke_fn)(ncclComm_t, int);

/* The NCCL version loaded in this process (0 when it does not say). */
static int nccl_loaded_version(void) {
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess ? version : 0;
}

/* `name` in the NCCL library this process loaded, when its version is at
 * least `min_version`; else NULL. */
static void *nccl_symbol(const char *name, int min_version) {
  Dl_info info;
  if (nccl_loaded_version() < min_version || !dladdr((void *)ncclGetVersion, &info) || !info.dli_fname) return NULL;
  void *lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) return NULL;
  void *symbol = dlsym(lib, name);
  dlclose(lib); /* RTLD_NOLOAD took a reference on the loaded library only */
  return symbol;
}

/* Aborts the split comms (epx's own, distinct from the main one). */
static void abort_splits(nccl_state_t *s) {
  for (int i = CONTROL; i >= DATA; i--) {
    ncclComm_t c = s->comms[i];
    s->comms[i] = NULL;
    if (c && c != s->comms[MAIN] && (i == DATA || c != s->comms[DATA])) ncclCommAbort(c);
  }
}

/* Fails the comm once: stops its NCCL work so its kernels end (the splits
 * aborted; epx's own main comm revoked where NCCL has ncclCommRevoke, kept
 * for epx_comm_shrink, else aborted with a caller's), and keeps the reason
 * for later calls. */
static epx_status_t fail_comm(epx_comm_t comm, epx_status_t code, const char *caller, const char *what) {
  nccl_state_t *s = comm->impl;
  if (!s->aborted && !s->revoked) {
    abort_splits(s);
    nccl_revoke_fn revoke = s->owned ? (nccl_revoke_fn)nccl_symbol("ncclCommRevoke", 22800) : NULL;
    ncclResult_t r = revoke ? revoke(s->comms[MAIN], NCCL_REVOKE_DEFAULT) : ncclInvalidUsage;
    if (r == ncclSuccess || r == ncclInProgress) {
      s->revoked = 1;
    } else {
      ncclCommAbort(s->comms[MAIN]);
      s->aborted = 1;
    }
  }
  comm->failed = 1;
  snprintf(s->reason, sizeof s->reason, "%s", what);
  if (s->revoked)
    return epx_error(code,
                     "%s: %s; the NCCL comm's work was stopped (ncclCommRevoke): the survivors go on "
                     "with epx_comm_shrink, or destroy the epx comm and create a new one", caller, what);
  return epx_error(code,
                   "%s: %s; the NCCL comm was aborted (a caller's ncclComm_t too: do not use or "
                   "destroy it); destroy the epx comm and create a new one", caller, what);
}

static epx_status_t check_alive(epx_comm_t comm, const char *caller) {
  nccl_state_t *s = comm->impl;
  if (!comm->failed) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_PEER_FAILED, "%s: the NCCL comm failed earlier: %s; destroy it and create a new one",
                   caller, s->reason);
}

static epx_status_t nccl_error(epx_comm_t comm, ncclResult_t r, const char *caller, const char *what) {
  nccl_state_t *s = comm->impl;
  char text[640];
  snprintf(text, sizeof text, "%s failed on rank %d of %d: %s (%s)", what, comm->rank, comm->size,
           ncclGetErrorString(r), s->aborted || s->revoked ? "" : ncclGetLastError(s->comms[MAIN]));
  return fail_comm(comm, EPX_ERROR_TRANSPORT, caller, text);
}

static epx_status_t timed_out(epx_comm_t comm, const char *caller, const char *what) {
  char text[512];
  snprintf(text, sizeof text,
           "%s did not complete within %.3g s on rank %d of %d (a peer stopped, died, or is in "
           "another call; NCCL does not say which rank)", what, comm->timeout_seconds, comm->rank,
           comm->size);
  return fail_comm(comm, EPX_ERROR_TIMEOUT, caller, text);
}

/* Reads the async state of each distinct comm: an error fails the epx comm
 * (returned); *busy says whether any is still ncclInProgress. */
static epx_status_t poll_comms(epx_comm_t comm, const char *caller, const char *what, int *busy) {
  nccl_state_t *s = comm->impl;
  *busy = 0;
  for (int i = 0; i < COMMS; i++) {
    ncclComm_t c = s->comms[i];
    if (!c || (i != MAIN && c == s->comms[MAIN]) || (i == CONTROL && c == s->comms[DATA])) continue;
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c, &state);
    if (r != ncclSuccess) return nccl_error(comm, r, caller, "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress) return nccl_error(comm, state, caller, what);
    *busy |= state == ncclInProgress;
  }
  return EPX_SUCCESS;
}

/* A wait on the comms of one epx comm: what the polls report and the
 * timeout names. */
typedef struct {
  epx_comm_t comm;
  const char *caller, *what;
  cudaStream_t stream; /* epx_nccl_wait's */
} comm_wait_t;

static epx_status_t comm_timed_out(void *ctx) {
  const comm_wait_t *w = ctx;
  return timed_out(w->comm, w->caller, w->what);
}

/* Over once no comm is ncclInProgress (or one failed). */
static int settle_poll(void *ctx, epx_status_t *status) {
  const comm_wait_t *w = ctx;
  int busy = 0;
  *status = poll_comms(w->comm, w->caller, w->what, &busy);
  return *status != EPX_SUCCESS || !busy;
}

/* Polls the comms' asynchronous state until none is ncclInProgress. */
static epx_status_t settle(epx_comm_t comm, const char *caller, const char *what) {
  comm_wait_t w = {comm, caller, what, NULL};
  return epx_wait_bounded(comm->timeout_seconds, settle_poll, &w, comm_timed_out);
}

int epx_nccl_went(int result) { return result == ncclSuccess || result == ncclInProgress; }

epx_status_t epx_nccl_group_end(epx_comm_t comm, int first, const char *caller, const char *what) {
  const ncclResult_t ended = ncclGroupEnd();
  if (!epx_nccl_went(first)) return epx_nccl_result(comm, first, caller, what);
  return epx_nccl_result(comm, ended, caller, "ncclGroupEnd");
}

epx_status_t epx_nccl_fail_timeout(epx_comm_t comm, const char *caller, const char *what) {
  if (comm->failed) return check_alive(comm, caller);
  return fail_comm(comm, EPX_ERROR_TIMEOUT, caller, what);
}

epx_status_t epx_nccl_result(epx_comm_t comm, int result, const char *caller, const char *what) {
  if (result == ncclSuccess) return EPX_SUCCESS;
  if (result == ncclInProgress) return settle(comm, caller, what);
  return nccl_error(comm, (ncclResult_t)result, caller, what);
}

/* Over once the stream is done (or it or a comm failed). */
static int stream_poll(void *ctx, epx_status_t *status) {
  const comm_wait_t *w = ctx;
  cudaError_t e = cudaStreamQuery(w->stream);
  *status = EPX_SUCCESS;
  if (e == cudaSuccess) return 1;
  if (e != cudaErrorNotReady) {
    *status = epx_error(EPX_ERROR_CUDA, "%s: waiting for the stream failed with %s (%s)", w->caller,
                        cudaGetErrorName(e), cudaGetErrorString(e));
    return 1;
  }
  int busy = 0;
  *status = poll_comms(w->comm, w->caller, "an NCCL operation of this comm", &busy);
  return *status != EPX_SUCCESS;
}

epx_status_t epx_nccl_wait(epx_comm_t comm, void *stream, const char *caller) {
  comm_wait_t w = {comm, caller, "the NCCL work on the stream", (cudaStream_t)stream};
  return epx_wait_bounded(comm->timeout_seconds, stream_poll, &w, comm_timed_out);
}

void *epx_nccl_comm(epx_comm_t comm) { return ((nccl_state_t *)comm->impl)->comms[MAIN]; }
void *epx_nccl_data_comm(epx_comm_t comm) { return ((nccl_state_t *)comm->impl)->comms[DATA]; }
int epx_nccl_device(epx_comm_t comm) { return ((nccl_state_t *)comm->impl)->device; }

/* ------------------------------------------------------------------------ */
/* Host collectives                                                          */
/* ------------------------------------------------------------------------ */

/* Device scratch and its pinned host mirror of `bytes`. Host bytes travel
 * through the mirror: a copy from pageable memory would block the host
 * until the stream drains, which is no wait epx could bound. */
static epx_status_t begin(epx_comm_t comm, const char *caller, size_t bytes) {
  nccl_state_t *s = comm->impl;
  epx_status_t status = check_alive(comm, caller);
  if (status != EPX_SUCCESS) return status;
  cudaError_t e = cudaSetDevice(s->device);
  if (e == cudaSuccess && bytes > s->scratch_bytes) {
    if (s->scratch) cudaFree(s->scratch);
    if (s->mirror) cudaFreeHost(s->mirror);
    s->scratch = s->mirror = NULL;
    s->scratch_bytes = 0;
    e = cudaMalloc(&s->scratch, bytes);
    if (e == cudaSuccess) e = cudaMallocHost(&s->mirror, bytes);
    if (e == cudaSuccess) s->scratch_bytes = bytes;
  }
  if (e != cudaSuccess)
    return epx_error(e == cudaErrorMemoryAllocation ? EPX_ERROR_OUT_OF_MEMORY : EPX_ERROR_CUDA,
                     "%s: allocating the NCCL transport's staging (%zu bytes) failed: %s", caller, bytes,
                     cudaGetErrorString(e));
  return EPX_SUCCESS;
}

static char *mirror_of(const nccl_state_t *s, const void *dev) {
  return (char *)s->mirror + ((const char *)dev - (const char *)s->scratch);
}

/* Host bytes -> their mirror -> device scratch at dev (enqueued). */
static epx_status_t copy_in(epx_comm_t comm, const char *caller, void *dev, const void *host, size_t bytes) {
  nccl_state_t *s = comm->impl;
  if (!bytes) return EPX_SUCCESS;
  memcpy(mirror_of(s, dev), host, bytes);
  cudaError_t e = cudaMemcpyAsync(dev, mirror_of(s, dev), bytes, cudaMemcpyHostToDevice, s->stream);
  if (e != cudaSuccess)
    return epx_error(EPX_ERROR_CUDA, "%s: cudaMemcpyAsync of the NCCL transport failed: %s", caller,
                     cudaGetErrorString(e));
  return EPX_SUCCESS;
}

/* Device scratch at dev -> its mirror (enqueued; read after the wait). */
static epx_status_t copy_out(epx_comm_t comm, const char *caller, const void *dev, size_t bytes) {
  nccl_state_t *s = comm->impl;
  if (!bytes) return EPX_SUCCESS;
  cudaError_t e = cudaMemcpyAsync(mirror_of(s, dev), dev, bytes, cudaMemcpyDeviceToHost, s->stream);
  if (e != cudaSuccess)
    return epx_error(EPX_ERROR_CUDA, "%s: cudaMemcpyAsync of the NCCL transport failed: %s", caller,
                     cudaGetErrorString(e));
  return EPX_SUCCESS;
}

/* Runs send/recv pairs: to rank r send_bytes[r] from send + send_off[r],
 * from rank r recv_bytes[r] into recv + recv_off[r] (device pointers). */
static epx_status_t exchange(epx_comm_t comm, const char *caller, const char *send, const size_t *send_off,
                             const size_t *send_bytes, char *recv, const size_t *recv_off,
                             const size_t *recv_bytes) {
  nccl_state_t *s = comm->impl;
  ncclComm_t c = s->comms[CONTROL];
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return epx_nccl_result(comm, r, caller, "ncclGroupStart");
  const char *what = "ncclGroupStart";
  for (int32_t p = 0; epx_nccl_went(r) && p < comm->size; p++) {
    if (send_bytes[p]) what = "ncclSend", r = ncclSend(send + send_off[p], send_bytes[p], ncclUint8, p, c, s->stream);
    if (epx_nccl_went(r) && recv_bytes[p])
      what = "ncclRecv", r = ncclRecv(recv + recv_off[p], recv_bytes[p], ncclUint8, p, c, s->stream);
  }
  return epx_nccl_group_end(comm, r, caller, what);
}

static epx_status_t nccl_alltoallv(epx_comm_t comm, const char *caller, const void *send,
                                   const int64_t *send_counts, const int64_t *send_displs, void *recv,
                                   const int64_t *recv_counts, const int64_t *recv_displs, size_t unit) {
  nccl_state_t *s = comm->impl;
  size_t W = (size_t)comm->size, send_total = 0, recv_total = 0;
  size_t *sizes = malloc(6 * W * sizeof(size_t));
  if (!sizes) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", caller);
  size_t *soff = sizes, *sbytes = sizes + W, *roff = sizes + 2 * W, *rbytes = sizes + 3 * W;
  size_t *hsoff = sizes + 4 * W, *hroff = sizes + 5 * W;
  for (size_t r = 0; r < W; r++) {
    soff[r] = send_total, sbytes[r] = (size_t)send_counts[r] * unit, hsoff[r] = (size_t)send_displs[r] * unit;
    roff[r] = recv_total, rbytes[r] = (size_t)recv_counts[r] * unit, hroff[r] = (size_t)recv_displs[r] * unit;
    send_total += sbytes[r], recv_total += rbytes[r];
  }
  epx_status_t status = begin(comm, caller, send_total + recv_total);
  char *dsend = s->scratch, *drecv = (char *)s->scratch + send_total;
  for (size_t r = 0; status == EPX_SUCCESS && r < W; r++)
    status = copy_in(comm, caller, dsend + soff[r], (const char *)send + hsoff[r], sbytes[r]);
  if (status == EPX_SUCCESS) status = exchange(comm, caller, dsend, soff, sbytes, drecv, roff, rbytes);
  if (status == EPX_SUCCESS) status = copy_out(comm, caller, drecv, recv_total);
  if (status == EPX_SUCCESS) status = epx_nccl_wait(comm, s->stream, caller);
  for (size_t r = 0; status == EPX_SUCCESS && r < W; r++)
    if (rbytes[r]) memcpy((char *)recv + hroff[r], mirror_of(s, drecv + roff[r]), rbytes[r]);
  free(sizes);
  return status;
}

static epx_status_t nccl_alltoall(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                  size_t bytes) {
  int64_t *counts = malloc(2 * (size_t)comm->size * sizeof(int64_t));
  if (!counts) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", caller);
  for (int32_t r = 0; r < comm->size; r++) counts[r] = 1, counts[comm->size + r] = r;
  epx_status_t status =
      nccl_alltoallv(comm, caller, send, counts, counts + comm->size, recv, counts, counts + comm->size, bytes);
  free(counts);
  return status;
}

static epx_status_t nccl_allgather(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                   size_t bytes) {
  nccl_state_t *s = comm->impl;
  size_t total = bytes * (size_t)comm->size;
  epx_status_t status = begin(comm, caller, bytes + total);
  char *dsend = s->scratch, *drecv = (char *)s->scratch + bytes;
  if (status == EPX_SUCCESS) status = copy_in(comm, caller, dsend, send, bytes);
  if (status == EPX_SUCCESS)
    status = epx_nccl_result(comm, ncclAllGather(dsend, drecv, bytes, ncclUint8, s->comms[CONTROL], s->stream), caller,
                             "ncclAllGather");
  if (status == EPX_SUCCESS) status = copy_out(comm, caller, drecv, total);
  if (status == EPX_SUCCESS) status = epx_nccl_wait(comm, s->stream, caller);
  if (status == EPX_SUCCESS) memcpy(recv, mirror_of(s, drecv), total);
  return status;
}

static epx_status_t nccl_allreduce_max_i64(epx_comm_t comm, const char *caller, int64_t *values, int32_t count) {
  nccl_state_t *s = comm->impl;
  size_t bytes = (size_t)count * sizeof(int64_t);
  epx_status_t status = begin(comm, caller, bytes);
  if (status == EPX_SUCCESS) status = copy_in(comm, caller, s->scratch, values, bytes);
  if (status == EPX_SUCCESS)
    status = epx_nccl_result(comm, ncclAllReduce(s->scratch, s->scratch, (size_t)count, ncclInt64, ncclMax, s->comms[CONTROL],
                                                 s->stream), caller, "ncclAllReduce");
  if (status == EPX_SUCCESS) status = copy_out(comm, caller, s->scratch, bytes);
  if (status == EPX_SUCCESS) status = epx_nccl_wait(comm, s->stream, caller);
  if (status == EPX_SUCCESS) memcpy(values, s->mirror, bytes);
  return status;
}

static epx_status_t nccl_barrier(epx_comm_t comm, const char *caller) {
  int64_t one = 1;
  return nccl_allreduce_max_i64(comm, caller, &one, 1);
}

/* The splits are always epx's own, the caller's comm or not. Blocking:
 * finalize returns once their work is done, which it will be, the peers
 * being alive and in destroy too (epx_comm_destroy's barrier passed). */
static void destroy_splits(nccl_state_t *s) {
  for (int i = CONTROL; i >= DATA; i--) {
    ncclComm_t c = s->comms[i];
    s->comms[i] = NULL;
    if (!c || c == s->comms[MAIN] || s->aborted) continue;
    if (ncclCommFinalize(c) == ncclSuccess) ncclCommDestroy(c);
    else ncclCommAbort(c);
  }
}

static void nccl_destroy(epx_comm_t comm) {
  nccl_state_t *s = comm->impl;
  if (!s) return;
  cudaSetDevice(s->device);
  if (s->revoked || s->shrunk) {
    /* Revoked (finalize is invalid then) or left for the survivors' comm,
     * whose peers do not finalize this one with it. */
    abort_splits(s);
    if (s->owned && !s->aborted) ncclCommAbort(s->comms[MAIN]);
    s->aborted = 1;
  }
  destroy_splits(s);
  if (s->owned && !s->aborted) {
    /* A failed comm was aborted already; a live one is finished cleanly,
     * bounded (settle aborts a finalize that does not complete). */
    ncclResult_t r = ncclCommFinalize(s->comms[MAIN]);
    if (r == ncclSuccess || r == ncclInProgress) {
      if (settle(comm, "epx_comm_destroy", "ncclCommFinalize") == EPX_SUCCESS) ncclCommDestroy(s->comms[MAIN]);
    } else {
      ncclCommAbort(s->comms[MAIN]);
    }
  }
  if (s->scratch) cudaFree(s->scratch);
  if (s->mirror) cudaFreeHost(s->mirror);
  if (s->stream) cudaStreamDestroy(s->stream);
  free(s->peers);
  free(s);
  comm->impl = NULL;
}

static epx_status_t nccl_shrink(epx_comm_t comm, const char *caller, double timeout_seconds,
                                int32_t ranks_per_node, uint8_t *lost, epx_comm_t *survivor);

static const epx_transport_ops_t nccl_ops = {
    .name = "nccl",
    .shrink = nccl_shrink,
    .alltoall = nccl_alltoall,
    .alltoallv = nccl_alltoallv,
    .allgather = nccl_allgather,
    .allreduce_max_i64 = nccl_allreduce_max_i64,
    .barrier = nccl_barrier,
    .destroy = nccl_destroy,
};

int epx_comm_is_nccl(epx_comm_t comm) { return comm && comm->ops == &nccl_ops; }

/* ------------------------------------------------------------------------ */
/* Creation                                                                  */
/* ------------------------------------------------------------------------ */

/* A blocking comm split from the main one into *child. NCCL runs a split
 * in the parent's mode: from a nonblocking parent it returns ncclInProgress
 * and writes *child when done (so child is the state's, not a local); the
 * caller settles, then falls back to the main comm where no child came. */
static void split_blocking(ncclComm_t parent, int rank, ncclComm_t *child) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  *child = NULL;
  ncclResult_t r = ncclCommSplit(parent, 0, rank, child, &config);
  if (r != ncclSuccess && r != ncclInProgress) *child = NULL;
}

/* One of each operation the split comms carry (grouped send/recv with every
 * rank, the all-gathers, the all-reduce), so that NCCL connects their peers
 * now, while every rank is in this call, rather than in a later enqueue a
 * blocking comm could not leave. */
static epx_status_t warm_up(epx_comm_t comm, const char *fn) {
  nccl_state_t *s = comm->impl;
  const size_t W = (size_t)comm->size, gathered = epx_round256(2 * W), reduced = gathered + epx_round256(4 * W);
  char *d = s->scratch; /* [W] bytes to send, [W] to receive, then [W] int32 gathered, one int64 */
  epx_status_t status = EPX_SUCCESS;
  for (int i = DATA; i <= CONTROL && status == EPX_SUCCESS; i++) {
    ncclComm_t c = s->comms[i];
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return epx_nccl_result(comm, r, fn, "ncclGroupStart");
    const char *what = "ncclGroupStart";
    for (int32_t p = 0; epx_nccl_went(r) && p < comm->size; p++) {
      what = "ncclSend (warm-up)", r = ncclSend(d + p, 1, ncclUint8, p, c, s->stream);
      if (epx_nccl_went(r)) what = "ncclRecv (warm-up)", r = ncclRecv(d + W + p, 1, ncclUint8, p, c, s->stream);
    }
    status = epx_nccl_group_end(comm, r, fn, what);
    if (status == EPX_SUCCESS)
      status = epx_nccl_result(comm, ncclAllGather(d, d + gathered, 1, ncclInt32, c, s->stream), fn,
                               "ncclAllGather (warm-up)");
    if (status == EPX_SUCCESS)
      status = epx_nccl_result(comm, ncclAllReduce(d + reduced, d + reduced, 1, ncclInt64, ncclMax, c, s->stream), fn,
                               "ncclAllReduce (warm-up)");
  }
  if (status == EPX_SUCCESS) status = epx_nccl_wait(comm, s->stream, fn);
  return status;
}

/* Fills a registered comm around an ncclComm_t (made here or the caller's):
 * waits for a nonblocking creation to finish, reads rank, size and device
 * from it, splits the blocking data and control comms and warms them up. */
static epx_status_t init_state(epx_comm_t comm, ncclComm_t nc, int owned, const char *fn) {
  nccl_state_t *s = calloc(1, sizeof *s);
  if (!s) {
    if (owned) ncclCommAbort(nc);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  s->comms[MAIN] = nc;
  s->owned = owned;
  comm->impl = s;
  comm->ops = &nccl_ops;
  int rank = 0, size = 0, device = 0;
  epx_status_t status = settle(comm, fn, owned ? "ncclCommInitRankConfig" : "the caller's ncclComm_t");
  if (status == EPX_SUCCESS) status = epx_nccl_result(comm, ncclCommUserRank(nc, &rank), fn, "ncclCommUserRank");
  if (status == EPX_SUCCESS) status = epx_nccl_result(comm, ncclCommCount(nc, &size), fn, "ncclCommCount");
  if (status == EPX_SUCCESS) status = epx_nccl_result(comm, ncclCommCuDevice(nc, &device), fn, "ncclCommCuDevice");
  if (status != EPX_SUCCESS) return status;
  comm->rank = rank;
  comm->size = size;
  s->device = device;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess)
    return epx_error(EPX_ERROR_CUDA, "%s: cudaStreamCreate on device %d failed: %s", fn, device, cudaGetErrorString(e));
  for (int i = DATA; i <= CONTROL && status == EPX_SUCCESS; i++) {
    split_blocking(nc, rank, &s->comms[i]);
    status = settle(comm, fn, i == DATA ? "ncclCommSplit (the data comm)" : "ncclCommSplit (the control comm)");
    if (!s->comms[i]) s->comms[i] = nc;
  }
  /* Staging for the small collectives up front: growing it later frees
   * device memory, which waits for the whole device (no bounded wait). */
  const size_t warm_bytes = epx_round256(2 * (size_t)size) + epx_round256(4 * (size_t)size) + 8;
  if (status == EPX_SUCCESS) status = begin(comm, fn, warm_bytes > 64 * 1024 ? warm_bytes : 64 * 1024);
  if (status == EPX_SUCCESS) status = warm_up(comm, fn);
  return status;
}

/* The host's key: a hash of its name (FNV-1a), as NCCL's own host hash
 * tells nodes apart. */
static int64_t host_key(void) {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  uint64_t h = 1469598103934665603ull;
  for (const char *c = name; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
  return (int64_t)(h >> 1);
}

/* Each rank's host key, pid and pid namespace, for a shrink (one allgather). */
static epx_status_t gather_peers(epx_comm_t comm, const char *fn) {
  nccl_state_t *s = comm->impl;
  s->peers = malloc(sizeof(int64_t) * 3 * (size_t)comm->size);
  if (!s->peers) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  const int64_t mine[3] = {host_key(), (int64_t)getpid(), (int64_t)epx_comm_pid_ns()};
  return nccl_allgather(comm, fn, mine, s->peers, sizeof mine);
}

/* The comm around nc, split, warmed and its topology known; on failure
 * nothing of it is left (nc aborted when owned). */
static epx_status_t init_comm(epx_comm_t created, ncclComm_t nc, int owned, const char *fn, int32_t ranks_per_node) {
  int64_t key = host_key();
  epx_status_t status = init_state(created, nc, owned, fn);
  if (status == EPX_SUCCESS) status = epx_comm_topology_init(created, fn, ranks_per_node, &key);
  if (status == EPX_SUCCESS) status = gather_peers(created, fn);
  if (status != EPX_SUCCESS) {
    if (created->impl) nccl_destroy(created);
    epx_comm_free(created);
  }
  return status;
}

static epx_status_t finish_create(epx_comm_t created, ncclComm_t nc, int owned, const char *fn,
                                  const epx_comm_config_t *config, epx_comm_t *comm) {
  int32_t ranks_per_node = 0;
  epx_status_t status = epx_comm_config_ranks_per_node(fn, config, &ranks_per_node);
  if (status != EPX_SUCCESS) {
    if (owned) ncclCommAbort(nc);
    epx_comm_free(created);
    return status;
  }
  status = init_comm(created, nc, owned, fn, ranks_per_node);
  if (status == EPX_SUCCESS) *comm = created->id;
  return status;
}

epx_status_t epx_nccl_get_unique_id(epx_nccl_unique_id_t *id) {
  epx_error_clear();
  EPX_REQUIRE(id, "epx_nccl_get_unique_id: id is NULL; pass the address of an epx_nccl_unique_id_t");
  ncclUniqueId nid;
  ncclResult_t r = ncclGetUniqueId(&nid);
  if (r != ncclSuccess)
    return epx_error(EPX_ERROR_TRANSPORT, "epx_nccl_get_unique_id: ncclGetUniqueId failed: %s (%s)",
                     ncclGetErrorString(r), ncclGetLastError(NULL));
  _Static_assert(sizeof nid <= sizeof id->bytes, "an ncclUniqueId fits an epx_nccl_unique_id_t");
  memset(id, 0, sizeof *id);
  memcpy(id->bytes, &nid, sizeof nid);
  return EPX_SUCCESS;
}

epx_status_t epx_comm_create_nccl_id(const epx_nccl_unique_id_t *id, int32_t rank, int32_t size,
                                     const epx_comm_config_t *config, epx_comm_t *comm) {
  const char *fn = "epx_comm_create_nccl_id";
  epx_error_clear();
  EPX_REQUIRE(comm, "%s: comm is NULL; pass the address of an epx_comm_t", fn);
  EPX_REQUIRE(id, "%s: id is NULL; pass the id from epx_nccl_get_unique_id (made on one rank, shared)", fn);
  EPX_REQUIRE(size >= 1 && rank >= 0 && rank < size, "%s: rank %d and size %d; pass 0 <= rank < size", fn, rank,
              size);
  epx_comm_t created = NULL;
  epx_status_t status = epx_comm_new_configured(fn, config, &created);
  if (status != EPX_SUCCESS) return status;
  ncclUniqueId nid;
  memcpy(&nid, id->bytes, sizeof nid);
  ncclConfig_t nconfig = NCCL_CONFIG_INITIALIZER;
  nconfig.blocking = 0; /* creation and enqueueing return at once; every wait is polled here */
  ncclComm_t nc = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&nc, size, nid, rank, &nconfig);
  if (r != ncclSuccess && r != ncclInProgress) {
    status = epx_error(EPX_ERROR_TRANSPORT, "%s: ncclCommInitRankConfig (rank %d of %d) failed: %s (%s)", fn, rank,
                       size, ncclGetErrorString(r), ncclGetLastError(NULL));
    epx_comm_free(created);
    return status;
  }
  return finish_create(created, nc, 1, fn, config, comm);
}

epx_status_t epx_comm_create_nccl(void *nccl_comm, const epx_comm_config_t *config, epx_comm_t *comm) {
  const char *fn = "epx_comm_create_nccl";
  epx_error_clear();
  EPX_REQUIRE(comm, "%s: comm is NULL; pass the address of an epx_comm_t", fn);
  EPX_REQUIRE(nccl_comm, "%s: nccl_comm is NULL; pass your ncclComm_t (as void *)", fn);
  epx_comm_t created = NULL;
  epx_status_t status = epx_comm_new_configured(fn, config, &created);
  if (status != EPX_SUCCESS) return status;
  return finish_create(created, (ncclComm_t)nccl_comm, 0, fn, config, comm);
}

epx_status_t epx_comm_create_nccl_mpi(const void *mpi_comm, const epx_comm_config_t *config, epx_comm_t *comm) {
  const char *fn = "epx_comm_create_nccl_mpi";
  epx_error_clear();
  EPX_REQUIRE(comm, "%s: comm is NULL; pass the address of an epx_comm_t", fn);
  EPX_REQUIRE(mpi_comm, "%s: mpi_comm is NULL; pass the address of an MPI_Comm (MPI_COMM_WORLD, say)", fn);
#if EPX_HAVE_MPI
  MPI_Comm mc = *(const MPI_Comm *)mpi_comm;
  int rank = 0, size = 0;
  if (MPI_Comm_rank(mc, &rank) != MPI_SUCCESS || MPI_Comm_size(mc, &size) != MPI_SUCCESS)
    return epx_error(EPX_ERROR_TRANSPORT, "%s: MPI_Comm_rank/MPI_Comm_size failed; is MPI initialised?", fn);
  /* Rank 0's id, or its failure (all-zero bytes), reaches every rank. */
  epx_nccl_unique_id_t id;
  memset(&id, 0, sizeof id);
  epx_status_t made = rank == 0 ? epx_nccl_get_unique_id(&id) : EPX_SUCCESS;
  if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, mc) != MPI_SUCCESS)
    return epx_error(EPX_ERROR_TRANSPORT, "%s: MPI_Bcast of the NCCL unique id failed", fn);
  if (made != EPX_SUCCESS) return made;
  static const epx_nccl_unique_id_t none;
  if (!memcmp(&id, &none, sizeof id))
    return epx_error(EPX_ERROR_PEER_FAILED, "%s: rank 0 could not make the NCCL unique id (its epx_last_error says why)",
                     fn);
  return epx_comm_create_nccl_id(&id, rank, size, config, comm);
#else
  (void)config;
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: this build of epx has no MPI; share the id of epx_nccl_get_unique_id yourself and call "
                   "epx_comm_create_nccl_id, or rebuild with MPI", fn);
#endif
}

/* ------------------------------------------------------------------------ */
/* Shrink (epx_comm_shrink)                                                  */
/* ------------------------------------------------------------------------ */

/* The lost ranks (lost[p] = 1, *count of them): the peers of this host
 * whose process has ended. A failed comm with a peer on another host is
 * refused: NCCL does not say which rank was lost, and this rank cannot see
 * that host's processes. */
static epx_status_t find_lost(epx_comm_t comm, const char *caller, uint8_t *lost, int *count) {
  const nccl_state_t *s = comm->impl;
  const int64_t *mine = s->peers + 3 * (size_t)comm->rank;
  *count = 0;
  for (int32_t p = 0; p < comm->size; p++) {
    const int64_t *peer = s->peers + 3 * (size_t)p;
    lost[p] = 0;
    if (p == comm->rank) continue;
    if (peer[0] != mine[0] || peer[2] != mine[2]) {
      if (comm->failed)
        return epx_error(EPX_ERROR_UNSUPPORTED,
                         "%s: the NCCL comm failed and rank %d is on another host (or pid namespace): NCCL does "
                         "not say which rank was lost, and epx finds it only among this host's processes; "
                         "create a new comm among the survivors (epx_nccl_get_unique_id on one of them, then "
                         "epx_comm_create_nccl_id)", caller, p);
      continue;
    }
    lost[p] = (uint8_t)epx_comm_process_gone((int32_t)peer[1], (uint64_t)peer[2], (uint64_t)mine[2]);
    *count += lost[p];
  }
  return EPX_SUCCESS;
}

/* Over once the revoked main comm is quiescent (its state leaves ncclInProgress). */
static int revoked_poll(void *ctx, epx_status_t *status) {
  const comm_wait_t *w = ctx;
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(((nccl_state_t *)w->comm->impl)->comms[MAIN], &state);
  *status = EPX_SUCCESS;
  if (r != ncclSuccess) *status = epx_error(EPX_ERROR_TRANSPORT, "%s: ncclCommGetAsyncError after ncclCommRevoke: %s",
                                            w->caller, ncclGetErrorString(r));
  return r != ncclSuccess || state != ncclInProgress;
}

static epx_status_t revoked_timed_out(void *ctx) {
  const comm_wait_t *w = ctx;
  return epx_error(EPX_ERROR_TIMEOUT,
                   "%s: the revoked NCCL comm did not quiesce within %.3g s on rank %d (its work did not "
                   "stop); destroy the comm and create a new one among the survivors", w->caller,
                   w->comm->timeout_seconds, w->comm->rank);
}

/* Why this comm cannot shrink (or success). */
static epx_status_t shrink_refusal(epx_comm_t comm, const char *caller, nccl_shrink_fn shrink) {
  const nccl_state_t *s = comm->impl;
  if (!shrink)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the NCCL loaded in this process (version code %d) has no ncclCommShrink, which "
                     "NCCL 2.27 added; load a newer libnccl.so.2 (2.28 also stops a failed comm's work "
                     "without aborting it, which a shrink after a failure needs), or create a new comm "
                     "among the survivors", caller, nccl_loaded_version());
  if (s->shrunk) return epx_comm_shrink_join_refusal(comm, caller, 1, 0, comm->timeout_seconds);
  if (s->aborted)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the NCCL comm was aborted when its failure was found (%s), so ncclCommShrink has "
                     "no parent: %s; create a new comm among the survivors", caller, s->reason,
                     s->owned ? "this NCCL has no ncclCommRevoke (2.28) to stop it without aborting"
                              : "epx aborts a caller's ncclComm_t (epx_comm_create_nccl); shrink it yourself "
                                "with ncclCommShrink and wrap the result");
  return EPX_SUCCESS;
}

static epx_status_t nccl_shrink(epx_comm_t comm, const char *caller, double timeout_seconds,
                                int32_t ranks_per_node, uint8_t *lost, epx_comm_t *survivor) {
  nccl_state_t *s = comm->impl;
  nccl_shrink_fn shrink = (nccl_shrink_fn)nccl_symbol("ncclCommShrink", 22700);
  epx_status_t status = shrink_refusal(comm, caller, shrink);
  int count = 0;
  if (status == EPX_SUCCESS) status = find_lost(comm, caller, lost, &count);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(ranks_per_node == 0 || (comm->size - count) % ranks_per_node == 0,
              "%s: config->ranks_per_node is %d, which does not divide the %d survivors; pass a divisor of it, "
              "or 0", caller, ranks_per_node, comm->size - count);
  const int flags = comm->failed || count ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT;
  cudaSetDevice(s->device);
  if (s->revoked) {
    comm_wait_t w = {comm, caller, "ncclCommRevoke", NULL};
    status = epx_wait_bounded(comm->timeout_seconds, revoked_poll, &w, revoked_timed_out);
    if (status != EPX_SUCCESS) return status;
  }
  int exclude[count > 0 ? count : 1], n = 0;
  for (int32_t p = 0; p < comm->size; p++)
    if (lost[p]) exclude[n++] = p;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0; /* bounded as a creation is: init_state settles it */
#if NCCL_VERSION_CODE >= 22700
  config.shrinkShare = 0; /* nothing of the parent, which its destroy aborts */
#endif
  ncclComm_t nc = NULL;
  /* ncclCommShrink refuses an empty exclude list: with no rank lost the
   * survivors are every rank, a split of one color (nothing shared with
   * the parent either) */
  config.splitShare = 0;
  ncclResult_t r = count ? shrink(s->comms[MAIN], exclude, count, &nc, &config, flags)
                         : ncclCommSplit(s->comms[MAIN], 0, comm->rank, &nc, &config);
  /* The old comm is the survivors' no longer, whatever came of it: its
   * later calls refuse, and its destroy aborts it. */
  if (!s->revoked) abort_splits(s);
  s->shrunk = 1;
  if (!comm->failed) snprintf(s->reason, sizeof s->reason, "rank %d shrank the comm (epx_comm_shrink)", comm->rank);
  comm->failed = 1;
  if (r != ncclSuccess && r != ncclInProgress)
    return epx_error(EPX_ERROR_TRANSPORT, "%s: %s (rank %d of %d, %d lost, %s) failed: %s (%s); destroy "
                     "the comm and create a new one among the survivors", caller,
                     count ? "ncclCommShrink" : "ncclCommSplit", comm->rank, comm->size, count,
                     flags == NCCL_SHRINK_ABORT ? "NCCL_SHRINK_ABORT" : "NCCL_SHRINK_DEFAULT", ncclGetErrorString(r),
                     ncclGetLastError(s->comms[MAIN]));
  epx_comm_t created = NULL;
  status = epx_comm_new(caller, timeout_seconds, &created);
  if (status != EPX_SUCCESS) {
    ncclCommAbort(nc);
    return status;
  }
  status = init_comm(created, nc, 1, caller, ranks_per_node);
  if (status == EPX_SUCCESS) *survivor = created;
  return status;
}

#else /* no NCCL in this build */

#define EPX_NO_NCCL(fn)                                                                          \
  epx_error(EPX_ERROR_UNSUPPORTED, fn ": this build of epx has no NCCL transport (it needs "      \
                                      "-DEPX_BUILD_CUDA=ON and NCCL, found under the CUDA toolkit " \
                                      "or Python's nvidia-nccl package, or given by -DEPX_NCCL_ROOT)")

int epx_has_nccl(void) { return 0; }
int epx_comm_is_nccl(epx_comm_t comm) { (void)comm; return 0; }
void *epx_nccl_comm(epx_comm_t comm) { (void)comm; return NULL; }
void *epx_nccl_data_comm(epx_comm_t comm) { (void)comm; return NULL; }
int epx_nccl_device(epx_comm_t comm) { (void)comm; return -1; }
epx_status_t epx_nccl_wait(epx_comm_t comm, void *stream, const char *caller) {
  (void)comm, (void)stream, (void)caller;
  return EPX_SUCCESS;
}
epx_status_t epx_nccl_result(epx_comm_t comm, int result, const char *caller, const char *what) {
  (void)comm, (void)result, (void)caller, (void)what;
  return EPX_SUCCESS;
}
epx_status_t epx_nccl_fail_timeout(epx_comm_t comm, const char *caller, const char *what) {
  (void)comm, (void)what;
  return epx_error(EPX_ERROR_INTERNAL, "%s: no NCCL transport in this build", caller);
}
epx_status_t epx_nccl_get_unique_id(epx_nccl_unique_id_t *id) {
  (void)id;
  epx_error_clear();
  return EPX_NO_NCCL("epx_nccl_get_unique_id");
}
epx_status_t epx_comm_create_nccl_id(const epx_nccl_unique_id_t *id, int32_t rank, int32_t size,
                                     const epx_comm_config_t *config, epx_comm_t *comm) {
  (void)id, (void)rank, (void)size, (void)config, (void)comm;
  epx_error_clear();
  return EPX_NO_NCCL("epx_comm_create_nccl_id");
}
epx_status_t epx_comm_create_nccl(void *nccl_comm, const epx_comm_config_t *config, epx_comm_t *comm) {
  (void)nccl_comm, (void)config, (void)comm;
  epx_error_clear();
  return EPX_NO_NCCL("epx_comm_create_nccl");
}
epx_status_t epx_comm_create_nccl_mpi(const void *mpi_comm, const epx_comm_config_t *config, epx_comm_t *comm) {
  (void)mpi_comm, (void)config, (void)comm;
  epx_error_clear();
  return EPX_NO_NCCL("epx_comm_create_nccl_mpi");
}
#endif
