/* The device transport beneath the W-rank CUDA paths (ep/host.c, ep/hier.c,
 * ep/fused.c, ll/ranks.c, ll/window.c and the fused module's relay), in the
 * shape of NCCL's transport layer: the paths say what moves between the
 * ranks' device buffers on a stream; a transport moves it. Two:
 *   nccl        an NCCL comm (one process per GPU): ncclAllGather and grouped
 *               ncclSend/ncclRecv on the data comm, the bounded
 *               epx_nccl_wait; windows are NCCL's symmetric ones (the fused
 *               module's device API, fused/setup.cu). Today's code, moved.
 *   in-process  a local comm (epx_comm_create_local): the ranks are threads
 *               of this process, on one GPU or several with peer access.
 *               Copies are cudaMemcpyAsync from the sender's device buffer
 *               into the receiver's, on the receiver's stream, ordered by
 *               events (each rank records one on its stream; its peers wait
 *               on it with cudaStreamWaitEvent); the pointers and events meet
 *               through the local comm's host-side exchange. A window is the
 *               rank's own device memory and its peers' pointers are those
 *               addresses (window_open).
 *   ipc         an shm comm (epx_comm_create_shm): the ranks are processes of
 *               one host (torchrun's, several on one GPU where NCCL refuses
 *               them). Each rank stages its sends in device memory of its
 *               own that the peers map through CUDA IPC, and the receivers
 *               copy from there on their streams, ordered by interprocess
 *               events; handles meet through the shm comm's host exchange
 *               (ipc.c says how staging is reused and grown). Windows are
 *               exported device memory mapped by the peers. Processes that
 *               share a GPU take turns on it (no MPS): co_resident refuses
 *               the kernels that wait on each other there.
 * A buffer takes its comm's transport at creation (epx_cuda_xport_of); a
 * comm no transport serves (MPI) gets a CUDA buffer of one rank only.
 *
 * Every call is collective over the comm, in the same order on every rank,
 * and returns once its work is enqueued on `stream` (the in-process and ipc
 * ones after a host rendezvous with their peers, bounded by the comm's
 * timeout). The in-process and ipc moves cannot be captured in a CUDA graph
 * (a rank's graph would wait on its peers' events, recorded outside it):
 * under capture they return EPX_ERROR_UNSUPPORTED; the fused and window
 * paths, whose steps move nothing through the transport, capture as on
 * NCCL. */
#ifndef EPX_CUDA_XPORT_H
#define EPX_CUDA_XPORT_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "core/objects.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One message of a group: `bytes` at `ptr` (device memory) to or from
 * `peer`. A send to p and p's receive from this rank pair up in the order
 * of their lists (NCCL's order per pair of ranks) and must have the same
 * bytes. */
typedef struct epx_cuda_move {
  int32_t peer;
  void *ptr;
  size_t bytes;
} epx_cuda_move_t;

/* A window: this rank's `bytes` of device memory at base, and where every
 * rank's window is as this GPU addresses it (peer[r], NULL where rank r is
 * out of load/store reach: another GPU without peer access). */
#define EPX_CUDA_WINDOW_MAX_RANKS 32 /* the fused module's EPX_FUSED_MAX_RANKS */
typedef struct epx_cuda_window {
  void *base;
  char *peer[EPX_CUDA_WINDOW_MAX_RANKS];
  /* ranks whose windows are on this rank's GPU (this rank included): they
   * share its SMs, so kernels that wait on each other get a share each */
  int32_t ranks_on_device;
  /* the peers whose peer[] this rank mapped (the ipc transport's
   * cudaIpcOpenMemHandle; unmapped by window_close and window_drop) */
  uint32_t opened;
} epx_cuda_window_t;

typedef struct epx_cuda_xport {
  const char *name; /* "nccl", "in-process", "ipc" */
  /* n all-gathers in one group: recv[i] ([W][bytes[i]]) gets every rank's
   * send[i] ([bytes[i]]) at its rank's block. */
  epx_status_t (*allgather)(epx_comm_t comm, const void *const *send, void *const *recv, const size_t *bytes,
                            int n, cudaStream_t stream, const char *fn);
  /* One group of messages: sends[ns] and recvs[nr] (empty ones skipped). */
  epx_status_t (*sendrecv)(epx_comm_t comm, const epx_cuda_move_t *sends, int64_t ns, const epx_cuda_move_t *recvs,
                           int64_t nr, cudaStream_t stream, const char *fn);
  /* Waits (bounded by the comm's timeout) until the work on stream is done;
   * a timeout or transport error fails the comm. */
  epx_status_t (*wait)(epx_comm_t comm, cudaStream_t stream, const char *fn);
  /* A wait that epx bounds itself (a kernel's on a peer's flag) ran out:
   * fails the comm and returns EPX_ERROR_TIMEOUT naming `what`. */
  epx_status_t (*fail_timeout)(epx_comm_t comm, const char *fn, const char *what);
  /* Collective: *top = the largest `mine` of the ranks (also a barrier). */
  epx_status_t (*agree_max)(epx_comm_t comm, int64_t mine, int64_t *top, const char *fn);
  /* Windows of the in-process and ipc transports (NULL for NCCL, whose windows the
   * fused module registers through NCCL's device API): `bytes` of device
   * memory on this rank's GPU, every rank's address gathered, peer access
   * enabled where the GPUs differ and allow it. Collective; every rank
   * returns the same verdict. */
  epx_status_t (*window_open)(epx_comm_t comm, size_t bytes, epx_cuda_window_t *window, const char *fn);
  /* After the ranks' last use (collective unless the comm failed: the
   * peers' mappings closed, a barrier, then this rank's memory freed). */
  void (*window_close)(epx_comm_t comm, epx_cuda_window_t *window);
  /* This rank's side released alone (a failed comm, or a creation every
   * rank abandons): its mappings of the peers' windows and its memory. */
  void (*window_drop)(epx_comm_t comm, epx_cuda_window_t *window);
  /* Whether kernels that wait on their peers' flags in memory (the fused
   * path, the low-latency window) can run at once on the ranks' GPUs:
   * EPX_SUCCESS, or EPX_ERROR_UNSUPPORTED with the reason (the buffer then
   * takes the host path, or the slabs). Collective; the same verdict on
   * every rank. NULL: they can (co-residency on a shared GPU is then the
   * fused module's to arrange). */
  epx_status_t (*co_resident)(epx_comm_t comm, const char *fn);
} epx_cuda_xport_t;

/* The transport that serves comm, or NULL. */
const epx_cuda_xport_t *epx_cuda_xport_of(epx_comm_t comm);

/* fail_timeout and agree_max of the transports whose comm is epx's own host
 * comm (in-process, ipc): the comm marked failed; the comm's MAX all-reduce. */
epx_status_t epx_cuda_xport_host_fail_timeout(epx_comm_t comm, const char *fn, const char *what);
epx_status_t epx_cuda_xport_host_agree_max(epx_comm_t comm, int64_t mine, int64_t *top, const char *fn);

/* epx_wait_bounded's poll of a stream on those transports: 1 once the
 * stream's work completed (*status its CUDA error, if any), 0 while it runs. */
int epx_cuda_xport_stream_poll(cudaStream_t stream, const char *fn, epx_status_t *status);

/* The windows of those transports, the steps both take alike:
 * window_start clears *window and refuses more ranks than a window holds;
 * window_gather gathers every rank's block (`block` bytes, the int32 at
 * refused_at 1 where that rank has no window) into all [W] and agrees the
 * verdict (a refusal anywhere refuses everywhere, the refusing rank with
 * `reason`; kind names the window in the messages); window_free frees this
 * rank's memory, after a barrier (every peer done with it) where
 * `collective` and the comm has not failed. */
epx_status_t epx_cuda_xport_window_start(epx_comm_t comm, epx_cuda_window_t *window, const char *kind,
                                         const char *fn);
epx_status_t epx_cuda_xport_window_gather(epx_comm_t comm, const void *mine, void *all, size_t block,
                                          size_t refused_at, const char *kind, const char *reason, const char *fn);
void epx_cuda_xport_window_free(epx_comm_t comm, epx_cuda_window_t *window, int collective);

extern const epx_cuda_xport_t epx_cuda_xport_nccl;       /* xport/nccl.c (NCCL builds) */
extern const epx_cuda_xport_t epx_cuda_xport_in_process; /* xport/in_process.c */
extern const epx_cuda_xport_t epx_cuda_xport_ipc;        /* xport/ipc.c */

#ifdef __cplusplus
}
#endif
#endif
