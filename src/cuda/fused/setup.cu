/* The fused NVLink exchange's setup (fused.h: epx_fused_create, destroy,
 * abandon, error, recv_window): the window's regions and bytes, its
 * allocation and registration, the device comm, the peers' load/store
 * addresses and which peers the relay reaches instead (NCCL's host API:
 * relay.cu), each step that may refuse on one rank followed by the ranks'
 * one-word agreement. See fused/impl.cuh for the window. */
#include <cuda_runtime.h>
#include <nccl.h>
/* NCCL's device headers have unused parameters; -Wextra -Werror stays on for ours */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <nccl_device.h>
#pragma GCC diagnostic pop
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/transport.h"
#include "core/wait.h"
#include "cuda/fused/impl.cuh"

using namespace epx_fused_impl;

namespace {

/* ---- setup ---------------------------------------------------------------- */

__global__ void resolve_peers_kernel(ncclWindow_t win, const int *lsa_of, int W, char **out) {
  const int r = threadIdx.x;
  if (r < W) out[r] = lsa_of[r] >= 0 ? static_cast<char *>(ncclGetLsaPointer(win, 0, lsa_of[r])) : nullptr;
}

/* Offsets of the window's regions (fused/impl.cuh). */
void window_offsets(fused_dev &d, int64_t part_elem) {
  const size_t W = (size_t)d.W;
  size_t o = 0;
  d.off_cts = o;
  o += W * 4;
  d.off_lflag = o;
  o += W * 4;
  d.off_mflag = o;
  o += W * 4;
  d.off_vflag = o;
  o += W * 4;
  d.off_cflag = o = epx_align_up(o, 128);
  o += W * (size_t)d.max_chunks * 4;
  d.off_mat = o = epx_align_up(o, 128);
  o += W * W * 4;
  d.off_hist = o = epx_align_up(o, 128);
  o += W * (size_t)d.El * 4;
  d.off_hdr = o = epx_align_up(o, 128);
  o += W * EPX_FUSED_HDR_INTS * 4;
  d.off_back = o = epx_align_up(o, 128);
  o += W * (size_t)d.maxT * (size_t)d.Kmax * 4;
  d.off_meta = o = epx_align_up(o, 256);
  o += W * (size_t)d.maxT * (size_t)d.meta_stride;
  d.off_pay = o = epx_align_up(o, 4096);
  o += W * (size_t)d.maxT * (size_t)d.pay_row_bytes;
  d.off_part = o = epx_align_up(o, 4096);
  o += W * (size_t)d.maxT * (size_t)d.H * (size_t)part_elem;
}

size_t window_bytes(const fused_dev &d, int64_t part_elem) {
  return epx_align_up(d.off_part + (size_t)d.W * (size_t)d.maxT * (size_t)d.H * (size_t)part_elem,
                  (size_t)1 << 21);
}

epx_status_t nccl_fail(const char *fn, const char *what, ncclResult_t r) {
  return epx_error(EPX_ERROR_TRANSPORT, "%s: %s failed: %s (%s)", fn, what, ncclGetErrorString(r),
                   ncclGetLastError(NULL));
}
epx_status_t cuda_fail(const char *fn, const char *what, cudaError_t e) {
  return epx_error(EPX_ERROR_CUDA, "%s: %s failed: %s", fn, what, cudaGetErrorString(e));
}

#define FUSED_NCCL(call, what)                                   \
  do {                                                           \
    ncclResult_t r_ = (call);                                    \
    if (r_ != ncclSuccess) {                                     \
      status = nccl_fail(fn, what, r_);                          \
      goto fail;                                                 \
    }                                                            \
  } while (0)
#define FUSED_CUDA(call, what)                                   \
  do {                                                           \
    cudaError_t e_ = (call);                                     \
    if (e_ != cudaSuccess) {                                     \
      status = cuda_fail(fn, what, e_);                          \
      goto fail;                                                 \
    }                                                            \
  } while (0)

epx_status_t check_config(const epx_fused_config_t *c, int W, const char *fn) {
  EPX_REQUIRE(c, "%s: config is NULL", fn);
  EPX_REQUIRE(epx_dtype_bytes(c->dtype) != 0, "%s: config.dtype %d is not a dtype", fn, (int)c->dtype);
  EPX_REQUIRE(c->hidden > 0 && c->hidden % 8 == 0, "%s: config.hidden %lld is not a positive multiple of 8",
              fn, (long long)c->hidden);
  EPX_REQUIRE(c->num_experts > 0 && c->num_experts % W == 0,
              "%s: config.num_experts %d is not a positive multiple of the %d ranks", fn, c->num_experts, W);
  EPX_REQUIRE(c->num_experts <= EPX_CUDA_MAX_EXPERTS, "%s: config.num_experts %d is over %d", fn,
              c->num_experts, EPX_CUDA_MAX_EXPERTS);
  EPX_REQUIRE(c->max_top_k >= 1 && c->max_top_k <= EPX_FUSED_MAX_TOP_K && c->max_top_k <= c->num_experts,
              "%s: config.max_top_k %d is outside [1, min(%d, num_experts)]", fn, c->max_top_k,
              EPX_FUSED_MAX_TOP_K);
  EPX_REQUIRE(c->max_tokens > 0 && c->max_tokens * W < ((int64_t)1 << 31) / EPX_FUSED_MAX_TOP_K,
              "%s: config.max_tokens %lld is outside [1, 2^31 / (32 W))", fn, (long long)c->max_tokens);
  return EPX_SUCCESS;
}

/* The device state of `f` from its config, comm size and rank. */
void init_dev(epx_fused_t *f, int W, int rank) {
  const epx_fused_config_t *c = &f->config;
  fused_dev &d = f->dev;
  d.W = W;
  d.rank = rank;
  d.E = c->num_experts;
  d.El = c->num_experts / W;
  d.Kmax = c->max_top_k;
  d.maxT = c->max_tokens;
  d.H = c->hidden;
  d.row_bytes = epx_payload_row_bytes(c->dtype, c->hidden);
  d.nvec = d.row_bytes / 16;
  const int64_t partial = epx_payload_partial_row_bytes(c->hidden);
  d.pay_row_bytes = c->f32_rows && d.row_bytes < partial ? partial : d.row_bytes;
  d.max_chunks = (int)((c->max_tokens + kChunk - 1) / kChunk);
  d.meta_stride = (int64_t)epx_align_up((size_t)(1 + 3 * c->max_top_k) * 4, 16);
  /* the bulk path: as many one-row slots as fit in 200 KB of shared memory */
  const int64_t fit = ((int64_t)200 << 10) / epx_bulk_slot_bytes(d.row_bytes);
  d.bulk_warps = c->bulk_copy ? (int)(fit < kMaxBulkWarps ? fit : kMaxBulkWarps) : 0;
  const double seconds = epx_wait_bound(c->timeout_seconds);
  d.timeout_ns = (unsigned long long)(seconds * 1e9);
}

/* The result of an NCCL call, waited out where the comm is nonblocking:
 * epx makes its comms with config.blocking = 0, and there NCCL finishes a
 * group (ncclCommWindowRegister, ncclDevCommCreate, a collective) on a thread
 * of its own after the call returns — ncclSuccess or ncclInProgress — and
 * writes the outputs (the window, the device comm) only then. Polls
 * ncclCommGetAsyncError until the comm leaves ncclInProgress, at most
 * `seconds`: EPX_ERROR_TIMEOUT after that (the outputs may still be written
 * later, so the caller must not free them). */
/* A setup wait (core/wait.h's loop): on the comm or on a stream. */
struct setup_wait {
  ncclComm_t comm;
  cudaStream_t stream;
  double seconds;
  const char *fn, *what;
};

epx_status_t setup_timed_out(void *ctx) {
  const setup_wait &w = *static_cast<const setup_wait *>(ctx);
  return epx_error(EPX_ERROR_TIMEOUT, "%s: %s did not complete within %.3g s (a peer is not creating the same "
                   "buffer); the comm is unusable: destroy it", w.fn, w.what, w.seconds);
}

/* Over once the comm leaves ncclInProgress. */
int comm_poll(void *ctx, epx_status_t *status) {
  const setup_wait &w = *static_cast<const setup_wait *>(ctx);
  ncclResult_t state = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(w.comm, &state);
  *status = EPX_SUCCESS;
  if (q != ncclSuccess) *status = nccl_fail(w.fn, "ncclCommGetAsyncError", q);
  else if (state == ncclInProgress) return 0;
  else if (state != ncclSuccess) *status = nccl_fail(w.fn, w.what, state);
  return 1;
}

epx_status_t nccl_settle(ncclComm_t comm, ncclResult_t r, double seconds, const char *fn, const char *what) {
  if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(fn, what, r);
  setup_wait w = {comm, NULL, seconds, fn, what};
  return epx_wait_bounded(seconds, comm_poll, &w, setup_timed_out);
}

}  // namespace

epx_status_t epx_fused_nccl_settle(void *comm, int result, double seconds, const char *fn, const char *what) {
  return nccl_settle(static_cast<ncclComm_t>(comm), static_cast<ncclResult_t>(result), seconds, fn, what);
}

namespace {

/* Waits for the work on `stream`, at most `seconds`. */
/* Over once the stream is done (or failed). */
int stream_poll(void *ctx, epx_status_t *status) {
  const setup_wait &w = *static_cast<const setup_wait *>(ctx);
  const cudaError_t e = cudaStreamQuery(w.stream);
  *status = EPX_SUCCESS;
  if (e == cudaErrorNotReady) return 0;
  if (e != cudaSuccess) *status = cuda_fail(w.fn, w.what, e);
  return 1;
}

epx_status_t stream_settle(cudaStream_t stream, double seconds, const char *fn, const char *what) {
  setup_wait w = {NULL, stream, seconds, fn, what};
  return epx_wait_bounded(seconds, stream_poll, &w, setup_timed_out);
}

/* The ranks' agreement at a step of the creation, which is also its
 * barrier: a one-word max all-reduce of `mine` (this rank + 1 where it
 * refuses, else 0), waited for (bounded); *top gets the largest (0: every
 * rank goes on). Every rank reaches each agreement whatever its own
 * verdict, so a rank that refuses (no memory for the window, no symmetric
 * window, a peer out of its load/store reach) makes its peers refuse with
 * it there, instead of leaving them waiting in the next collective step. */
epx_status_t rank_agree(ncclComm_t comm, cudaStream_t stream, double seconds, const char *fn, int mine, int *top) {
  epx_status_t status = EPX_SUCCESS;
  int *word = NULL;
  int value = mine;
  FUSED_CUDA(cudaMallocAsync(reinterpret_cast<void **>(&word), sizeof(int), stream), "cudaMallocAsync");
  FUSED_CUDA(cudaMemcpyAsync(word, &value, sizeof(int), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  EPX_CHECK(nccl_settle(comm, ncclAllReduce(word, word, 1, ncclInt32, ncclMax, comm, stream), seconds, fn,
                        "ncclAllReduce (the creation's agreement)"));
  EPX_CHECK(stream_settle(stream, seconds, fn, "the creation's agreement"));
  /* the stream is idle: this copy from pageable memory does not wait */
  FUSED_CUDA(cudaMemcpyAsync(&value, word, sizeof(int), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  EPX_CHECK(stream_settle(stream, seconds, fn, "the creation's agreement"));
  *top = value;
fail:
  if (word) cudaFreeAsync(word, stream);
  return status;
}

/* One agreement of create_steps: `local` is this rank's verdict on the step
 * (its error message is the last error). Every rank returns the same way:
 * on, or refused (this rank's own error where it refused, else one naming
 * the refusing rank). A timed-out agreement leaves `f` to NCCL (*keep). */
epx_status_t agree_step(ncclComm_t comm, cudaStream_t stream, double seconds, int rank, epx_status_t local,
                        const char *step, int *keep, const char *fn) {
  char message[1024] = "";
  if (local != EPX_SUCCESS) snprintf(message, sizeof message, "%s", epx_last_error());
  int top = 0;
  const epx_status_t agreed = rank_agree(comm, stream, seconds, fn, local != EPX_SUCCESS ? rank + 1 : 0, &top);
  if (agreed != EPX_SUCCESS) {
    *keep = agreed == EPX_ERROR_TIMEOUT;
    return agreed;
  }
  if (!top) return EPX_SUCCESS;
  if (local != EPX_SUCCESS) return epx_error(local, "%s", message);
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: rank %d refused the fused path %s (its epx_last_error says why); every rank refuses it", fn,
                   top - 1, step);
}

/* The creation's steps of this rank alone (nothing waits on a peer): the
 * device's SM count, the window's memory, the control words, the error
 * word. */
epx_status_t local_steps(epx_fused_t *f, cudaStream_t stream, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  int device = 0;
  FUSED_CUDA(cudaGetDevice(&device), "cudaGetDevice");
  FUSED_CUDA(cudaDeviceGetAttribute(&f->num_sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  f->sms = f->num_sms;
  FUSED_NCCL(ncclMemAlloc(&f->base, f->bytes), "ncclMemAlloc of the window");
  FUSED_CUDA(cudaMalloc(&f->dev.ctl, CTL_WORDS * sizeof(uint32_t)), "cudaMalloc");
  FUSED_CUDA(cudaMemsetAsync(f->dev.ctl, 0, CTL_WORDS * sizeof(uint32_t), stream), "cudaMemsetAsync");
  FUSED_CUDA(cudaHostAlloc(&f->err_host, sizeof(uint32_t), cudaHostAllocMapped), "cudaHostAlloc");
  *f->err_host = 0;
  FUSED_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void **>(&f->dev.err), f->err_host, 0),
             "cudaHostGetDevicePointer");
fail:
  if (status != EPX_SUCCESS && f->base && ncclMemFree(f->base) == ncclSuccess) f->base = NULL;
  return status;
}

/* The peers' window addresses, resolved on the device once (NULL for a
 * relayed peer). */
epx_status_t resolve_peers(epx_fused_t *f, ncclComm_t comm, cudaStream_t stream, double seconds, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const int W = f->dev.W;
  int lsa_of[EPX_FUSED_MAX_RANKS];
  int *d_lsa = NULL;
  char **d_ptrs = NULL;
  const ncclTeam_t world = ncclTeamWorld(comm);
  for (int r = 0; r < W; r++) lsa_of[r] = relayed(f->dev, r) ? -1 : ncclTeamRankToLsa(comm, world, r);
  FUSED_CUDA(cudaMalloc(&d_lsa, sizeof lsa_of), "cudaMalloc");
  FUSED_CUDA(cudaMalloc(&d_ptrs, sizeof(char *) * EPX_FUSED_MAX_RANKS), "cudaMalloc");
  FUSED_CUDA(cudaMemcpyAsync(d_lsa, lsa_of, sizeof(int) * (size_t)W, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  resolve_peers_kernel<<<1, 32, 0, stream>>>(static_cast<ncclWindow_t>(f->win), d_lsa, W, d_ptrs);
  FUSED_CUDA(cudaGetLastError(), "the peer-address kernel");
  FUSED_CUDA(cudaMemcpyAsync(f->dev.peer, d_ptrs, sizeof(char *) * (size_t)W, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync");
  EPX_CHECK(stream_settle(stream, seconds, fn, "the peer-address kernel"));
fail:
  cudaFree(d_lsa);
  cudaFree(d_ptrs);
  return status;
}

/* How a peer is reached (fused.h, epx_fused_transport_t), as NCCL picks a
 * transport per peer: the first of kTransports whose can_connect takes it.
 * Load/store where the peer is in this rank's load/store team (NCCL's LSA
 * team; the relation is symmetric: a team is a clique) and the test flag
 * EPX_CUDA_FUSED_RELAY is off; the relay through NCCL's host API for any
 * other peer. A network transport would be one more entry, before the
 * relay, and its kind. */
struct peer_query {
  ncclTeam_t team, world;
  bool relay_all; /* EPX_CUDA_FUSED_RELAY at creation */
};
struct peer_transport {
  epx_fused_transport_t kind;
  bool (*can_connect)(const peer_query &q, int r);
};
bool loadstore_can_connect(const peer_query &q, int r) {
  return !q.relay_all && ncclTeamRankIsMember(q.team, q.world, r);
}
bool relay_can_connect(const peer_query &, int) { return true; }
const peer_transport kTransports[] = {{EPX_FUSED_PEER_LOADSTORE, loadstore_can_connect},
                                      {EPX_FUSED_PEER_RELAY, relay_can_connect}};

epx_fused_transport_t connect_peer(const peer_query &q, int r) {
  for (const peer_transport &t : kTransports)
    if (t.can_connect(q, r)) return t.kind;
  return EPX_FUSED_PEER_RELAY;
}

/* The creation: this rank's checks and allocations (`local` is its verdict
 * on what the caller checked; f is NULL where that failed), then the
 * window's registration, the device comm, the peers' addresses, zeroed flags
 * and a barrier, in that order, with an agreement of every rank after each
 * step that may refuse on one rank alone (agree_step). Every NCCL step is
 * waited out (nccl_settle): on a nonblocking comm NCCL writes the window and
 * the device comm from its own thread after the call returns. A step that
 * times out leaves `f` to NCCL (*keep = 1): it may still write into it. */
epx_status_t create_steps(epx_fused_t *f, epx_status_t local, ncclComm_t comm, cudaStream_t stream, int W,
                          int rank, double seconds, int *keep, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  if (local == EPX_SUCCESS) local = local_steps(f, stream, fn);
  EPX_CHECK(agree_step(comm, stream, seconds, rank, local, "while allocating its window", keep, fn));
  status = nccl_settle(comm, ncclCommWindowRegister(comm, f->base, f->bytes, reinterpret_cast<ncclWindow_t *>(&f->win),
                                                    NCCL_WIN_COLL_SYMMETRIC),
                       seconds, fn, "ncclCommWindowRegister");
  if (status != EPX_SUCCESS) {
    *keep = status == EPX_ERROR_TIMEOUT;
    return status;
  }
  local = f->win ? EPX_SUCCESS
                 : epx_error(EPX_ERROR_UNSUPPORTED, "%s: NCCL registered no symmetric window (this comm has no "
                             "symmetric memory support: NCCL_WIN_ENABLE=0, no CUDA VMM, or a peer without CUDA P2P); "
                             "use the host-API exchange", fn);
  /* Refused here, a rank that has a window leaves it registered and
   * allocated: its deregistration is collective and some rank has none.
   * The comm's destruction ends the registration; the memory stays until
   * the process ends (one window, in a case no NCCL release is known to
   * produce: registration succeeds or fails on every rank alike). */
  if (local == EPX_SUCCESS) {
    status = agree_step(comm, stream, seconds, rank, local, "at the window's registration", keep, fn);
    if (status != EPX_SUCCESS) f->win = NULL, f->base = NULL;
    EPX_CHECK(status);
  } else {
    EPX_CHECK(agree_step(comm, stream, seconds, rank, local, "at the window's registration", keep, fn));
  }
  {
    ncclDevComm *dc = static_cast<ncclDevComm *>(calloc(1, sizeof *dc));
    if (!dc) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
    ncclDevCommRequirements reqs;
    memset(&reqs, 0, sizeof reqs);
    reqs.lsaBarrierCount = 1;
    status = nccl_settle(comm, ncclDevCommCreate(comm, &reqs, dc), seconds, fn,
                         "ncclDevCommCreate (NCCL 2.28 or later with symmetric memory support is needed)");
    if (status != EPX_SUCCESS) {
      *keep = status == EPX_ERROR_TIMEOUT;
      if (!*keep) free(dc);
      return status;
    }
    f->devcomm = dc;
    /* Each peer's transport; the relay's peers as the kernels' mask. */
    const peer_query q = {ncclTeamLsa(*dc), ncclTeamWorld(comm),
                          (epx_cuda_launch_flags() & EPX_CUDA_FUSED_RELAY) != 0};
    uint32_t mask = 0;
    for (int r = 0; r < W; r++) {
      f->transport[r] = r == rank ? EPX_FUSED_PEER_SELF : connect_peer(q, r);
      if (f->transport[r] == EPX_FUSED_PEER_RELAY) mask |= 1u << r;
    }
    local = epx_fused_relay_create(f, mask, fn);
    /* every rank has its window and device comm: a refusal here tears both
     * down collectively (epx_fused_destroy) */
    EPX_CHECK(agree_step(comm, stream, seconds, rank, local, "at the relay's memory (peers without load/store "
                         "access)", keep, fn));
  }
  EPX_CHECK(resolve_peers(f, comm, stream, seconds, fn));
  f->dev.local = f->dev.peer[rank];
  FUSED_CUDA(cudaMemsetAsync(f->base, 0, f->dev.off_meta, stream), "cudaMemsetAsync of the window's flags");
  /* the barrier: every rank past this point before any writes a peer's flags */
  {
    int top = 0;
    status = rank_agree(comm, stream, seconds, fn, 0, &top);
    if (status == EPX_ERROR_TIMEOUT) *keep = 1;
  }
fail:
  return status;
}

}  // namespace

namespace {

/* agree_step over the in-process transport: every rank's verdict on one
 * creation step, refused on every rank where one refused. */
epx_status_t agree_in_process(const epx_fused_ranks_t &q, int rank, epx_status_t local, const char *step,
                              const char *fn) {
  char message[1024] = "";
  if (local != EPX_SUCCESS) snprintf(message, sizeof message, "%s", epx_last_error());
  int64_t top = 0;
  const epx_status_t agreed = q.xport->agree_max(q.comm, local != EPX_SUCCESS ? rank + 1 : 0, &top, fn);
  if (agreed != EPX_SUCCESS) return agreed;
  if (!top) return EPX_SUCCESS;
  if (local != EPX_SUCCESS) return epx_error(local, "%s", message);
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: rank %lld refused the fused path %s (its epx_last_error says why); every rank refuses it",
                   fn, (long long)(top - 1), step);
}

/* The in-process creation's steps (nccl_comm NULL): as create_steps, with
 * the transport's agreement and window (plain device memory of each rank,
 * peers' addresses gathered on the host). */
epx_status_t in_process_steps(epx_fused_t *f, epx_status_t local, cudaStream_t stream, int W, int rank,
                              const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_fused_ranks_t &q = f->ranks;
  int64_t top = 0;
  if (local == EPX_SUCCESS) {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f->sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) e = cudaMalloc(&f->dev.ctl, CTL_WORDS * sizeof(uint32_t));
    if (e == cudaSuccess) e = cudaMemsetAsync(f->dev.ctl, 0, CTL_WORDS * sizeof(uint32_t), stream);
    if (e == cudaSuccess) e = cudaHostAlloc(&f->err_host, sizeof(uint32_t), cudaHostAllocMapped);
    if (e == cudaSuccess) *f->err_host = 0, e = cudaHostGetDevicePointer(reinterpret_cast<void **>(&f->dev.err), f->err_host, 0);
    if (e != cudaSuccess) local = cuda_fail(fn, "the fused state's memory", e);
  }
  EPX_CHECK(agree_in_process(q, rank, local, "at its memory", fn));
  EPX_CHECK(q.xport->window_open(q.comm, f->bytes, &f->window, fn));
  /* Ranks sharing a GPU wait on each other's kernels; a kernel loaded
   * lazily (CUDA's default module loading) at its first launch may wait for
   * the GPU to idle, which a peer's kernel waiting for this rank never does
   * (CUDA's Lazy Loading guide, "concurrent execution"): eager loading only. */
  {
    const char *loading = getenv("CUDA_MODULE_LOADING");
    local = f->window.ranks_on_device > 1 && !(loading && !strcmp(loading, "EAGER"))
                ? epx_error(EPX_ERROR_UNSUPPORTED,
                            "%s: %d in-process ranks share this GPU, whose fused kernels wait on each other; that "
                            "needs CUDA_MODULE_LOADING=EAGER in the environment before CUDA starts (a kernel loaded "
                            "lazily at its first launch may wait for the GPU to idle while a peer's kernel waits "
                            "for it)", fn, (int)f->window.ranks_on_device)
                : EPX_SUCCESS;
    EPX_CHECK(agree_in_process(q, rank, local, "for its module loading", fn));
  }
  {
    const bool relay_all = (epx_cuda_launch_flags() & EPX_CUDA_FUSED_RELAY) != 0;
    uint32_t mask = 0;
    for (int r = 0; r < W; r++) {
      const bool loadstore = !relay_all && f->window.peer[r];
      f->transport[r] = r == rank ? EPX_FUSED_PEER_SELF : loadstore ? EPX_FUSED_PEER_LOADSTORE : EPX_FUSED_PEER_RELAY;
      f->dev.peer[r] = r == rank || loadstore ? f->window.peer[r] : nullptr;
      if (f->transport[r] == EPX_FUSED_PEER_RELAY) mask |= 1u << r;
    }
    f->base = f->window.base;
    f->dev.local = static_cast<char *>(f->window.base);
    /* the ranks on this GPU share its SMs: each rank's launches take a
     * share, so that kernels that wait on each other are resident at once */
    const int on = f->window.ranks_on_device > 1 ? f->window.ranks_on_device : 1;
    f->num_sms = f->sms / on > 2 ? f->sms / on : 2;
    EPX_CHECK(agree_in_process(q, rank, epx_fused_relay_create(f, mask, fn), "at the relay's memory", fn));
  }
  FUSED_CUDA(cudaMemsetAsync(f->base, 0, f->dev.off_meta, stream), "cudaMemsetAsync of the window's flags");
  FUSED_CUDA(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  /* the barrier: every rank past this point before any writes a peer's flags */
  EPX_CHECK(q.xport->agree_max(q.comm, 0, &top, fn));
fail:
  return status;
}

epx_status_t create_in_process(const epx_fused_ranks_t *ranks, const epx_fused_config_t *config,
                               epx_fused_t **fused, const char *fn) {
  EPX_REQUIRE(ranks->comm && ranks->xport && ranks->xport->window_open,
              "%s: ranks has neither an NCCL comm nor an in-process transport", fn);
  /* processes that take turns on a GPU cannot run kernels that wait on
   * each other (the ipc transport says so on every rank alike) */
  if (ranks->xport->co_resident) {
    const epx_status_t refused = ranks->xport->co_resident(ranks->comm, fn);
    if (refused != EPX_SUCCESS) return refused;
  }
  const int W = ranks->comm->size, rank = ranks->comm->rank;
  epx_status_t local = W > EPX_FUSED_MAX_RANKS
                           ? epx_error(EPX_ERROR_UNSUPPORTED, "%s: %d ranks, over the fused path's %d; use the "
                                       "host-API exchange", fn, W, EPX_FUSED_MAX_RANKS)
                           : check_config(config, W, fn);
  epx_fused_t *f = static_cast<epx_fused_t *>(calloc(1, sizeof *f));
  if (!f) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  f->ranks = *ranks;
  if (local == EPX_SUCCESS) {
    f->config = *config;
    init_dev(f, W, rank);
    window_offsets(f->dev, 4);
    f->bytes = window_bytes(f->dev, 4);
  }
  cudaStream_t stream = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess && local == EPX_SUCCESS) local = cuda_fail(fn, "cudaStreamCreateWithFlags", e);
  epx_status_t status = in_process_steps(f, local, stream, W, rank, fn);
  if (stream) cudaStreamSynchronize(stream), cudaStreamDestroy(stream);
  if (status == EPX_SUCCESS) {
    *fused = f;
    return EPX_SUCCESS;
  }
  char message[1024];
  snprintf(message, sizeof message, "%s", epx_last_error());
  epx_fused_abandon(f);
  return epx_error(status, "%s", message);
}

}  // namespace

extern "C" epx_status_t epx_fused_create(const epx_fused_ranks_t *ranks, const epx_fused_config_t *config,
                                         epx_fused_t **fused) {
  const char *fn = "epx_fused_create";
  EPX_REQUIRE(fused, "%s: fused is NULL", fn);
  *fused = NULL;
  EPX_REQUIRE(ranks, "%s: ranks is NULL", fn);
  if (!ranks->nccl_comm) return create_in_process(ranks, config, fused, fn);
  void *nccl_comm = ranks->nccl_comm;
  ncclComm_t comm = static_cast<ncclComm_t>(nccl_comm);
  /* The device API's structs (ncclDevComm, its requirements, the window)
   * change between NCCL releases, patch releases included (2.28.3 -> 2.28.9):
   * the NCCL loaded must be the one whose headers this was compiled with. */
  int version = 0;
  const int same_nccl = ncclGetVersion(&version) == ncclSuccess && version == NCCL_VERSION_CODE;
  int W = 0, rank = 0;
  epx_status_t local = EPX_SUCCESS; /* this rank's own checks: the ranks agree on them below */
  /* a nonblocking comm must have finished its previous operation (NCCL
   * refuses every call until then) */
  epx_status_t status = nccl_settle(comm, ncclSuccess, epx_wait_bound(config ? config->timeout_seconds : 0),
                                    fn, "the comm's previous operation");
  if (status != EPX_SUCCESS) return status;
  ncclResult_t r = ncclCommCount(comm, &W);
  if (r == ncclSuccess) r = ncclCommUserRank(comm, &rank);
  if (r != ncclSuccess)
    return epx_error(EPX_ERROR_TRANSPORT, "%s: nccl_comm is not a usable ncclComm_t (%s: %s)", fn,
                     ncclGetErrorString(r), ncclGetLastError(comm));
  /* The host API (the agreements) works whatever the NCCL release; the
   * device API's structs do not. */
  if (!same_nccl)
    local = epx_error(EPX_ERROR_UNSUPPORTED,
                      "%s: the NCCL loaded is version %d, the fused module was compiled against NCCL %d's device "
                      "API; load that NCCL (LD_LIBRARY_PATH) or rebuild epx against this one (EPX_NCCL_ROOT)",
                      fn, version, NCCL_VERSION_CODE);
  else if (W > EPX_FUSED_MAX_RANKS)
    local = epx_error(EPX_ERROR_UNSUPPORTED, "%s: %d ranks, over the fused path's %d; use the host-API exchange",
                      fn, W, EPX_FUSED_MAX_RANKS);
  else
    local = check_config(config, W, fn);
  epx_fused_t *f = NULL;
  if (local == EPX_SUCCESS) {
    f = static_cast<epx_fused_t *>(calloc(1, sizeof *f));
    if (!f) local = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  if (f) {
    f->config = *config;
    f->comm = nccl_comm;
    init_dev(f, W, rank);
    const int64_t part_elem = 4; /* float32 partials fit every precision */
    window_offsets(f->dev, part_elem);
    f->bytes = window_bytes(f->dev, part_elem);
  }
  const double seconds = epx_wait_bound(config ? config->timeout_seconds : 0);
  int keep = 0;
  cudaStream_t stream = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  /* without a stream this rank cannot take part in the agreements: its
   * peers' first one times out */
  status = e == cudaSuccess ? create_steps(f, local, comm, stream, W, rank, seconds, &keep, fn)
                            : cuda_fail(fn, "cudaStreamCreateWithFlags", e);
  if (stream) {
    if (!keep) cudaStreamSynchronize(stream); /* settled already: nothing left but frees */
    cudaStreamDestroy(stream);
  }
  if (status == EPX_SUCCESS) {
    *fused = f;
    return EPX_SUCCESS;
  }
  if (!keep) {
    const epx_status_t kept = status; /* destroy may set its own error; the first one is the answer */
    char message[1024];
    snprintf(message, sizeof message, "%s", epx_last_error());
    epx_fused_destroy(f);
    status = epx_error(kept, "%s", message);
  }
  return status;
}

/* In-process: the window closes collectively (a barrier, then its memory). */
static void free_in_process(epx_fused_t *f, int collective) {
  if (f->window.base) {
    if (collective) f->ranks.xport->window_close(f->ranks.comm, &f->window);
    else f->ranks.xport->window_drop(f->ranks.comm, &f->window);
  }
  epx_fused_relay_free(f);
  cudaFree(f->dev.ctl);
  if (f->err_host) cudaFreeHost(f->err_host);
  free(f);
}

extern "C" epx_status_t epx_fused_destroy(epx_fused_t *f) {
  if (!f) return EPX_SUCCESS;
  ncclComm_t comm = static_cast<ncclComm_t>(f->comm);
  epx_status_t status = EPX_SUCCESS;
  cudaDeviceSynchronize();
  if (!comm) {
    free_in_process(f, 1);
    return EPX_SUCCESS;
  }
  if (f->devcomm) {
    if (ncclDevCommDestroy(comm, static_cast<ncclDevComm *>(f->devcomm)) != ncclSuccess)
      status = epx_error(EPX_ERROR_TRANSPORT, "epx_fused_destroy: ncclDevCommDestroy failed");
    free(f->devcomm);
  }
  if (f->win && ncclCommWindowDeregister(comm, static_cast<ncclWindow_t>(f->win)) != ncclSuccess)
    status = epx_error(EPX_ERROR_TRANSPORT, "epx_fused_destroy: ncclCommWindowDeregister failed");
  if (f->base) ncclMemFree(f->base);
  epx_fused_relay_free(f);
  cudaFree(f->dev.ctl);
  if (f->err_host) cudaFreeHost(f->err_host);
  free(f);
  return status;
}

extern "C" void epx_fused_abandon(epx_fused_t *f) {
  if (!f) return;
  cudaDeviceSynchronize(); /* every wait of a fused kernel is bounded */
  if (!f->comm) {
    free_in_process(f, 0);
    return;
  }
  free(f->devcomm);        /* the host copy; the device side went with the comm */
  if (f->base) ncclMemFree(f->base);
  epx_fused_relay_free(f);
  cudaFree(f->dev.ctl);
  if (f->err_host) cudaFreeHost(f->err_host);
  free(f);
}

extern "C" int epx_fused_error(const epx_fused_t *f, int32_t *peer, const char **phase) {
  static const char *const names[] = {"?", "layout clear-to-send", "layout counts", "layout routing records",
                                      "dispatch clear-to-send", "dispatch rows", "combine clear-to-send",
                                      "combine partials", "weight gradients clear-to-send",
                                      "weight gradients", "host-API relay (ncclSend/ncclRecv)"};
  const uint32_t w = *reinterpret_cast<volatile uint32_t *>(f->err_host);
  if (!w) return 0;
  const uint32_t ph = (w >> 8) & 0xffu;
  if (peer) *peer = (int32_t)(w >> 16) - 1;
  if (phase) *phase = names[ph < sizeof names / sizeof names[0] ? ph : 0];
  return 1;
}

extern "C" int32_t epx_fused_ctas(const epx_fused_t *f, int32_t sm_budget) {
  const int32_t ctas = sm_budget > 0 ? sm_budget : EPX_FUSED_DEFAULT_CTAS;
  return ctas < f->num_sms ? ctas : f->num_sms;
}

extern "C" void *epx_fused_recv_window(epx_fused_t *f) { return f->dev.local + f->dev.off_pay; }

extern "C" int32_t epx_fused_ranks_on_device(const epx_fused_t *f, int32_t *share, int32_t *sms) {
  if (share) *share = f->num_sms;
  if (sms) *sms = f->sms;
  return f->comm || f->window.ranks_on_device < 1 ? 1 : f->window.ranks_on_device;
}

extern "C" void epx_fused_co_resident_note(const epx_fused_t *f, char *out, size_t size) {
  int32_t share = 0, sms = 0;
  const int32_t on = epx_fused_ranks_on_device(f, &share, &sms);
  if (on <= 1) {
    if (size) out[0] = 0;
    return;
  }
  snprintf(out, size,
           " (%d in-process ranks share this GPU: their fused kernels wait on each other, so all must be "
           "co-resident; each rank's launches take at most %d of the %d SMs, but kernels that could not start "
           "beside the others -- other work holding the SMs, a host call that waits for the whole GPU "
           "(cudaDeviceSynchronize, cudaFree) on a rank before its launch, a serialising tool such as "
           "compute-sanitizer or CUDA_LAUNCH_BLOCKING=1, or fewer hardware queues than ranks (set "
           "CUDA_DEVICE_MAX_CONNECTIONS to at least the ranks before CUDA starts) -- were not co-resident)", (int)on, (int)share, (int)sms);
}
