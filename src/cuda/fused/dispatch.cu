/* The fused NVLink exchange, part 1: the window and device comm (setup), the
 * layout (counts and routing records exchanged on the GPU), and dispatch.
 * See fused.h for the contract and fused/impl.cuh for the window.
 *
 * Layout, three kernels on the caller's stream (no host wait, no memset):
 *   count     a block per 256 tokens: validates the routing (its first
 *             invalid route per block), each route's position among the
 *             block's routes to its expert (per-warp byte counters, not a
 *             walk over the block's routes per expert), each token's index
 *             among the block's tokens to each rank (ballots), and the counts;
 *             then the last block to finish runs the exchange:
 *   exchange  prefix sums over the blocks, clear-to-send, this rank's row
 *             counts (to every rank), route counts per expert (to the
 *             expert's rank) and header (tokens, oversize, invalid, top_k,
 *             weighting: to every rank) into the windows, then from the
 *             W x W matrix every base: where this rank's rows start in each
 *             receiver's rank-major layout (an exclusive prefix over source
 *             ranks), and the expert-major groups;
 *   records   a warp per token: absolute positions, and the token's routing
 *             record written into each destination's window at its final row;
 *   receive   a warp per received row: the plan's tables (per rank-major row:
 *             token, experts, weights, expert-major rows).
 * Dispatch, one kernel: sender CTAs copy each token's row once per destination
 * rank straight into its final rank-major row in the destination's window,
 * a flag per chunk of 32 rows; receiver CTAs expand chunks into the
 * expert-major layout as they arrive (and this rank's own rows straight from
 * x), or, rank-major, wait for them (and copy them out if asked). */
#include <cuda_runtime.h>
#include <nccl.h>
/* NCCL's device headers have unused parameters; -Wextra -Werror stays on for ours */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <nccl_device.h>
#pragma GCC diagnostic pop
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/error.h"
#include "core/route_spec.h"
#include "core/wait.h"
#include "cuda/fused/impl.cuh"
#include "cuda/common/pdl.cuh"

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
  d.off_cflag = o = align_up(o, 128);
  o += W * (size_t)d.max_chunks * 4;
  d.off_mat = o = align_up(o, 128);
  o += W * W * 4;
  d.off_hist = o = align_up(o, 128);
  o += W * (size_t)d.El * 4;
  d.off_hdr = o = align_up(o, 128);
  o += W * EPX_FUSED_HDR_INTS * 4;
  d.off_back = o = align_up(o, 128);
  o += W * (size_t)d.maxT * (size_t)d.Kmax * 4;
  d.off_meta = o = align_up(o, 256);
  o += W * (size_t)d.maxT * (size_t)d.meta_stride;
  d.off_pay = o = align_up(o, 4096);
  o += W * (size_t)d.maxT * (size_t)d.pay_row_bytes;
  d.off_part = o = align_up(o, 4096);
  o += W * (size_t)d.maxT * (size_t)d.H * (size_t)part_elem;
}

size_t window_bytes(const fused_dev &d, int64_t part_elem) {
  return align_up(d.off_part + (size_t)d.W * (size_t)d.maxT * (size_t)d.H * (size_t)part_elem,
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
  d.pay_row_bytes = c->f32_rows && d.row_bytes < c->hidden * 4 ? c->hidden * 4 : d.row_bytes;
  d.max_chunks = (int)((c->max_tokens + kChunk - 1) / kChunk);
  d.meta_stride = (int64_t)align_up((size_t)(1 + 3 * c->max_top_k) * 4, 16);
  /* the bulk path: as many one-row slots as fit in 200 KB of shared memory */
  const int64_t fit = ((int64_t)200 << 10) / bulk_slot_bytes(d.row_bytes);
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
epx_status_t nccl_settle(ncclComm_t comm, ncclResult_t r, double seconds, const char *fn, const char *what) {
  if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(fn, what, r);
  const double started = epx_now_seconds();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) return nccl_fail(fn, "ncclCommGetAsyncError", q);
    if (state == ncclSuccess) return EPX_SUCCESS;
    if (state != ncclInProgress) return nccl_fail(fn, what, state);
    if (epx_now_seconds() - started > seconds)
      return epx_error(EPX_ERROR_TIMEOUT, "%s: %s did not complete within %.3g s (a peer is not creating the same "
                       "buffer); the comm is unusable: destroy it", fn, what, seconds);
    epx_wait_pause(started);
  }
}

}  // namespace

epx_status_t epx_fused_nccl_settle(void *comm, int result, double seconds, const char *fn, const char *what) {
  return nccl_settle(static_cast<ncclComm_t>(comm), static_cast<ncclResult_t>(result), seconds, fn, what);
}

namespace {

/* Waits for the work on `stream`, at most `seconds`. */
epx_status_t stream_settle(cudaStream_t stream, double seconds, const char *fn, const char *what) {
  const double started = epx_now_seconds();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return EPX_SUCCESS;
    if (e != cudaErrorNotReady) return cuda_fail(fn, what, e);
    if (epx_now_seconds() - started > seconds)
      return epx_error(EPX_ERROR_TIMEOUT, "%s: %s did not complete within %.3g s (a peer is not creating the same "
                       "buffer); the comm is unusable: destroy it", fn, what, seconds);
    epx_wait_pause(started);
  }
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
    /* The peers outside this rank's load/store team (or every peer, under
     * the test flag EPX_CUDA_FUSED_RELAY) are reached through the relay
     * (fused/relay.cu). The relation is symmetric: a team is a clique. */
    const ncclTeam_t team = ncclTeamLsa(*dc), world = ncclTeamWorld(comm);
    const bool relay_all = (epx_cuda_launch_flags() & EPX_CUDA_FUSED_RELAY) != 0;
    uint32_t mask = 0;
    for (int r = 0; r < W; r++)
      if (r != rank && (relay_all || !ncclTeamRankIsMember(team, world, r))) mask |= 1u << r;
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

extern "C" epx_status_t epx_fused_create(void *nccl_comm, const epx_fused_config_t *config,
                                         epx_fused_t **fused) {
  const char *fn = "epx_fused_create";
  EPX_REQUIRE(fused, "%s: fused is NULL", fn);
  *fused = NULL;
  EPX_REQUIRE(nccl_comm, "%s: nccl_comm is NULL; pass an ncclComm_t", fn);
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

extern "C" epx_status_t epx_fused_destroy(epx_fused_t *f) {
  if (!f) return EPX_SUCCESS;
  ncclComm_t comm = static_cast<ncclComm_t>(f->comm);
  epx_status_t status = EPX_SUCCESS;
  cudaDeviceSynchronize();
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

extern "C" void *epx_fused_recv_window(epx_fused_t *f) { return f->dev.local + f->dev.off_pay; }

/* ---- plans ------------------------------------------------------------------ */

extern "C" epx_status_t epx_fused_plan_create(epx_fused_t *f, epx_layout_t layout, int32_t alignment,
                                              int64_t capacity, cudaStream_t stream, epx_fused_plan_t **plan) {
  const char *fn = "epx_fused_plan_create";
  EPX_REQUIRE(f && plan, "%s: fused or plan is NULL", fn);
  EPX_REQUIRE(layout == EPX_LAYOUT_EXPERT_MAJOR || layout == EPX_LAYOUT_RANK_MAJOR || layout == EPX_LAYOUT_CAPACITY,
              "%s: layout %d is not a layout", fn, (int)layout);
  EPX_REQUIRE(alignment >= 1, "%s: expert_alignment %d is below 1", fn, alignment);
  const bool cap = layout == EPX_LAYOUT_CAPACITY;
  const fused_dev &d = f->dev;
  const int64_t W = d.W, T = d.maxT, K = d.Kmax, E = d.E, El = d.El;
  EPX_REQUIRE(!cap || (capacity >= 1 && El * W * capacity < INT32_MAX),
              "%s: capacity %lld is outside [1, 2^31 / (E_local * W))", fn, (long long)capacity);
  const int64_t blocks = (T + kLayoutTokens - 1) / kLayoutTokens;
  const int64_t pairs = W * T;
  const int64_t row_bound = epx_recv_rows_bound(layout, W, T, (int32_t)K, El, alignment, (int32_t)capacity);
  const int64_t claims = cap ? E * capacity : 0;
  const info_index ii = make_info_index((int)W, (int)El);
  /* int32 words of every array, in the order they are carved below */
  const int64_t words[] = {T * K, T * K, T * K, T * W, W * T, blocks * E, blocks * W, 2 * blocks, E,
                           pairs, pairs * K, pairs * K, pairs * K, row_bound, row_bound, row_bound, row_bound,
                           2 * claims};
  size_t bytes = 64 + align_up((size_t)ii.total * 8, 256); /* invalid, then info, as carved below */
  for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) bytes += align_up((size_t)words[i] * 4, 256);
  epx_fused_plan_t *p = static_cast<epx_fused_plan_t *>(calloc(1, sizeof *p));
  if (!p) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  cudaError_t e = cudaMallocAsync(&p->memory, bytes, stream);
  if (e != cudaSuccess) {
    free(p);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: cudaMallocAsync of %zu bytes failed: %s", fn, bytes,
                     cudaGetErrorString(e));
  }
  char *m = static_cast<char *>(p->memory);
  fused_plan_dev &pd = p->dev;
  pd.invalid = reinterpret_cast<unsigned long long *>(m);
  pd.info = reinterpret_cast<int64_t *>(m + 64);
  m += 64 + align_up((size_t)ii.total * 8, 256);
  void **slots[] = {(void **)&pd.idx, (void **)&pd.w, (void **)&pd.pos, (void **)&pd.tok_slot,
                    (void **)&pd.send_token, (void **)&pd.chunk_hist, (void **)&pd.chunk_dcnt,
                    (void **)&pd.chunk_invalid, (void **)&pd.hist, (void **)&pd.pair_token, (void **)&pd.pair_expert,
                    (void **)&pd.pair_w, (void **)&pd.pair_rows, (void **)&pd.row_src_rank,
                    (void **)&pd.row_src_token, (void **)&pd.row_expert, (void **)&pd.row_w, (void **)&pd.claim};
  for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
    *slots[i] = m;
    m += align_up((size_t)words[i] * 4, 256);
  }
  /* every slot unclaimed: a claim carries its layout's op number + 1 (> 0),
   * so a later layout's claims outrank an earlier one's and need no reset */
  if (cap && (e = cudaMemsetAsync(pd.claim, 0, (size_t)claims * 8, stream)) != cudaSuccess) {
    cudaFreeAsync(p->memory, stream);
    free(p);
    return epx_error(EPX_ERROR_CUDA, "%s: cudaMemsetAsync of the slot claims failed: %s", fn, cudaGetErrorString(e));
  }
  pd.row_bound = row_bound;
  pd.C = cap ? capacity : 0;
  pd.expert_major = layout != EPX_LAYOUT_RANK_MAJOR;
  pd.align = alignment;
  pd.K = (int)K;
  pd.T = 0;
  p->fused = f;
  p->layout = layout;
  *plan = p;
  return EPX_SUCCESS;
}

extern "C" void epx_fused_plan_destroy(epx_fused_plan_t *p, cudaStream_t stream) {
  if (!p) return;
  cudaFreeAsync(p->memory, stream);
  free(p);
}

extern "C" void epx_fused_plan_view(const epx_fused_plan_t *p, epx_fused_plan_view_t *v) {
  const fused_plan_dev &pd = p->dev;
  const info_index ii = make_info_index(p->fused->dev.W, p->fused->dev.El);
  v->rows = pd.info + ii.rows;
  v->counts = pd.info + ii.ecount;
  v->offsets = pd.info + ii.eoff;
  v->row_src_rank = pd.row_src_rank;
  v->row_src_token = pd.row_src_token;
  v->row_expert = pd.expert_major ? pd.row_expert : pd.pair_expert;
  v->row_w = pd.expert_major ? pd.row_w : pd.pair_w;
  v->invalid = pd.invalid;
  v->row_bound = pd.row_bound;
  v->top_k = pd.K;
}

/* The readback: the invalid word and the info table's head, contiguous in
 * the plan's memory (invalid at 0, info at 64). */
extern "C" size_t epx_fused_plan_readback_bytes(const epx_fused_plan_t *p) {
  return 64 + 8 * (size_t)make_info_index(p->fused->dev.W, p->fused->dev.El).head;
}

extern "C" cudaError_t epx_fused_plan_readback_launch(const epx_fused_plan_t *p, void *host, cudaStream_t stream) {
  return cudaMemcpyAsync(host, p->memory, epx_fused_plan_readback_bytes(p), cudaMemcpyDeviceToHost, stream);
}

extern "C" void epx_fused_plan_summary(const epx_fused_plan_t *p, const void *host, epx_fused_plan_summary_t *s) {
  const info_index ii = make_info_index(p->fused->dev.W, p->fused->dev.El);
  const int64_t *info = reinterpret_cast<const int64_t *>(static_cast<const char *>(host) + 64);
  s->rows = info[ii.rows];
  s->send_pairs = info + ii.scount;
  s->send_routes = info + ii.sroutes;
  s->recv_pairs = info + ii.rcount;
  s->recv_routes = info + ii.rroutes;
  s->headers = info + ii.hdr;
  s->invalid = *static_cast<const uint64_t *>(host);
}

/* ---- layout kernels --------------------------------------------------------- */

namespace {

constexpr int kLayoutWarps = kLayoutTokens / 32;

/* A diagnostic build (-DEPX_FUSED_LAYOUT_TRACE) keeps the global timer at
 * the layout's stages (thread 0 of the CTA that passes; the last 64 layouts
 * by op number), read by epx_fused_layout_trace, to place its time. */
#ifdef EPX_FUSED_LAYOUT_TRACE
__device__ unsigned long long g_layout_trace[64][16];
#define LAYOUT_TRACE(stage)                                                                           \
  do {                                                                                                \
    if (threadIdx.x == 0)                                                                             \
      g_layout_trace[*reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ) & 63][stage] = global_ns(); \
  } while (0)
#else
#define LAYOUT_TRACE(stage) \
  do {                      \
  } while (0)
#endif

__device__ void layout_exchange(const fused_dev &d, const fused_plan_dev &p, int64_t blocks);

/* The first invalid route of the block (the smaller key wins). */
__device__ __forceinline__ void note_invalid(unsigned long long *first, int64_t route, int code) {
  atomicMin(first, (unsigned long long)route << 3 | (unsigned long long)code);
}

/* A capacity slot's claim by route g in op seq: a later op's claims outrank
 * an earlier one's, and within an op the smaller route wins (atomicMax). */
__device__ __forceinline__ unsigned long long claim_tag(uint32_t seq, int64_t g) {
  return (unsigned long long)(seq + 1u) << 32 | (0xffffffffu - (uint32_t)g);
}

/* Capacity: a thread per route claims its slot (expert, location), so the
 * count kernel can tell each slot's owner, the smallest route of this rank
 * naming it (the one-GPU layout's rule). Routes the count kernel drops for
 * another reason (an expert out of range, a duplicate, a location outside
 * [0, C)) claim nothing. */
__global__ void __launch_bounds__(256) layout_claim_kernel(const fused_dev d, const fused_plan_dev p,
                                                           const int32_t *topk_idx, const int32_t *locations) {
  if (failed(d)) return;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.T * p.K) return;
  const int K = p.K;
  const int64_t t = g / K;
  const int k = (int)(g % K);
  const int32_t e = topk_idx[g];
  if (e < 0 || e >= d.E) return;
  for (int j = 0; j < k; j++)
    if (topk_idx[t * K + j] == e) return;
  const int32_t l = locations[g];
  if (l < 0 || l >= p.C) return;
  atomicMax(p.claim + (int64_t)e * p.C + l, claim_tag(seq, g));
}

/* A block per kLayoutTokens tokens, a thread per token (see the file
 * comment). A route's position among the block's routes to its expert, in
 * (token, k) order, is its rank among its warp's routes to that expert (the
 * warp walks its 32 tokens' routes 32 at a time, the lanes of an expert found
 * by __match_any_sync, their writes of pos coalesced: against 32 steps of a
 * lane per slot k, the last count block started 6 us earlier at one rank)
 * plus the counts of the warps before; a token's slot among the block's
 * tokens to a rank is a ballot's prefix plus the warps before. Shared: the
 * ids [kLayoutTokens, K], then a byte counter per (warp, expert) (a warp has
 * at most 32 routes to an expert). */
__global__ void __launch_bounds__(kLayoutTokens) layout_count_kernel(const fused_dev d, const fused_plan_dev p,
                                                                     const int32_t *topk_idx,
                                                                     const float *topk_w,
                                                                     const int32_t *locations, int early) {
  extern __shared__ int32_t s_idx[];
  __shared__ int32_t s_dcnt[kLayoutWarps][EPX_FUSED_MAX_RANKS];
  __shared__ unsigned long long s_invalid;
  pdl_begin(early);
  const int K = p.K, E = d.E, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t *s_cnt = reinterpret_cast<uint8_t *>(s_idx + kLayoutTokens * K);
  if (blockIdx.x == 0) LAYOUT_TRACE(0);
  const int64_t t0 = (int64_t)blockIdx.x * kLayoutTokens;
  const int n = (int)min((int64_t)kLayoutTokens, p.T - t0);
  if (threadIdx.x == 0) s_invalid = ~0ull;
  for (int i = threadIdx.x; i < kLayoutWarps * E; i += blockDim.x) s_cnt[i] = 0;
  __syncthreads();
  /* The block's routes (and the copy of their weights), kU loads in flight
   * per thread: one at a time, each waited for before the next, they were
   * most of the block's time. */
  constexpr int kU = 8;
  for (int i0 = threadIdx.x; i0 < kLayoutTokens * K; i0 += kU * kLayoutTokens) {
    int32_t v[kU];
    float wv[kU];
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const int i = i0 + u * kLayoutTokens;
      const bool in = i < n * K;
      v[u] = in ? __ldg(topk_idx + t0 * K + i) : -1;
      wv[u] = in && topk_w ? __ldg(topk_w + t0 * K + i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const int i = i0 + u * kLayoutTokens;
      if (i >= kLayoutTokens * K) break;
      int32_t e = v[u];
      if (i < n * K) {
        if (e < -1 || e >= E) {
          note_invalid(&s_invalid, t0 * K + i, EPX_CUDA_BAD_EXPERT);
          e = -1;
        }
        p.w[t0 * K + i] = wv[u];
      }
      s_idx[i] = e;
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) LAYOUT_TRACE(14);
  const int tl = threadIdx.x;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  uint32_t mask = 0;
  if (tl < n) {
    for (int k = 0; k < K; k++) {
      int32_t e = s_idx[tl * K + k];
      for (int k2 = 0; k2 < k && e >= 0; k2++)
        if (s_idx[tl * K + k2] == e) {
          note_invalid(&s_invalid, (t0 + tl) * K + k, EPX_CUDA_DUPLICATE_EXPERT);
          e = s_idx[tl * K + k] = -1;
        }
      if (p.C && e >= 0) {
        /* capacity: the location in range, and the slot this route's (the
         * claim kernel's verdict); the position is the location */
        const int64_t g = (t0 + tl) * K + k;
        const int32_t l = locations[g];
        const int code = l < 0 || l >= p.C                                      ? EPX_CUDA_BAD_LOCATION
                         : p.claim[(int64_t)e * p.C + l] != claim_tag(seq, g) ? EPX_CUDA_TAKEN_LOCATION
                                                                                : 0;
        if (code) {
          note_invalid(&s_invalid, g, code);
          e = s_idx[tl * K + k] = -1;
        } else {
          p.pos[g] = l;
        }
      }
      p.idx[(t0 + tl) * K + k] = e;
      if (e >= 0) mask |= 1u << (e / d.El);
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) LAYOUT_TRACE(15);
  for (int r = 0; r < d.W; r++) {
    const unsigned has = __ballot_sync(0xffffffffu, mask >> r & 1u);
    if (lane == 0) s_dcnt[warp][r] = __popc(has);
  }
  /* The warp's 32 * K routes in (token, k) order, 32 at a time (lane l:
   * route c * 32 + l of the warp): the lanes naming the same expert are
   * found by one match; the first of them reads and advances the warp's
   * counter for it, the others count the lanes below. (Tokens past n have
   * only -1 in s_idx.) */
  int32_t rank_in_warp[32];
  const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int c = 0; c < 32; c++) {
    if (c >= K) break;
    const int32_t e = s_idx[warp * 32 * K + c * 32 + lane];
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int first = __ffs(same) - 1;
    int32_t base = 0;
    if (e >= 0 && lane == first) {
      base = s_cnt[warp * E + e];
      s_cnt[warp * E + e] = (uint8_t)(base + __popc(same));
    }
    base = __shfl_sync(0xffffffffu, base, first);
    rank_in_warp[c] = e >= 0 ? base + __popc(same & lanes_below) : -1;
    __syncwarp(); /* the counter's write seen by the next step's reader */
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
    for (int w = 0; w < kLayoutWarps; w++) c += s_cnt[w * E + e];
    p.chunk_hist[(int64_t)blockIdx.x * E + e] = c;
  }
  if (threadIdx.x < d.W) {
    int32_t c = 0;
    for (int w = 0; w < kLayoutWarps; w++) c += s_dcnt[w][threadIdx.x];
    p.chunk_dcnt[(int64_t)blockIdx.x * d.W + threadIdx.x] = c;
  }
#pragma unroll
  for (int c = 0; c < 32; c++) {
    if (c >= K) break;
    if (rank_in_warp[c] < 0 || p.C) continue; /* capacity: the position is the location */
    const int i = warp * 32 * K + c * 32 + lane;
    const int32_t e = s_idx[i];
    int32_t base = 0;
    for (int w = 0; w < warp; w++) base += s_cnt[w * E + e];
    p.pos[t0 * K + i] = rank_in_warp[c] + base;
  }
  for (int r = 0; r < d.W; r++) {
    const unsigned has = __ballot_sync(0xffffffffu, mask >> r & 1u);
    int32_t base = 0;
    for (int w = 0; w < warp; w++) base += s_dcnt[w][r];
    if (tl < n)
      p.tok_slot[(t0 + tl) * d.W + r] = (has >> lane & 1u) ? base + __popc(has & ((1u << lane) - 1u)) : -1;
  }
  if (threadIdx.x == 0) p.chunk_invalid[blockIdx.x] = s_invalid;
  if (blockIdx.x == 0) LAYOUT_TRACE(1);
  /* The last block to finish (every block's counts visible to it) runs the
   * exchange: one launch fewer than a kernel of its own. */
  if (last_cta(d, false)) layout_exchange(d, p, gridDim.x); /* (its writes were this GPU's) */
}

/* Exclusive prefix over the blocks of each column of a [blocks, n] table, in
 * place; the totals go to total[n] (may be NULL). */
__device__ void block_prefix(int32_t *table, int64_t blocks, int n, int32_t *total) {
  constexpr int kBatch = 32; /* independent loads in flight per thread (T = 8192: one batch) */
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    int32_t run = 0;
    for (int64_t b0 = 0; b0 < blocks; b0 += kBatch) {
      int32_t v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; u++) v[u] = b0 + u < blocks ? __ldcg(table + (b0 + u) * n + c) : 0;
#pragma unroll
      for (int u = 0; u < kBatch; u++)
        if (b0 + u < blocks) {
          table[(b0 + u) * n + c] = run;
          run += v[u];
        }
    }
    if (total) total[c] = run;
  }
}

/* An exclusive scan of one value per thread over the block (blockDim.x a
 * multiple of 32); *total gets the sum. Every thread must call it. */
__device__ int64_t block_scan(int64_t v, int64_t *total) {
  __shared__ int64_t s_warp[32];
  __shared__ int64_t s_total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  if (lane == 31) s_warp[warp] = inc;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
      const int64_t t = s_warp[w];
      s_warp[w] = run;
      run += t;
    }
    s_total = run;
  }
  __syncthreads();
  *total = s_total;
  return s_warp[warp] + inc - v;
}

/* Rows of a local expert's group with c routes: c padded to the alignment
 * (expert-major), W * C (capacity), none (rank-major: rows are pairs). */
__device__ __forceinline__ int64_t group_rows(const fused_plan_dev &p, int W, int64_t c) {
  if (p.C) return (int64_t)W * p.C;
  return p.expert_major ? (c + p.align - 1) / p.align * p.align : 0;
}

/* Bases of the layout from the count matrix, route counts and headers in
 * this rank's window (all complete). A rank's oversize header empties the
 * layout on every rank (nothing moves, as on the host path). No thread walks
 * a chain of dependent global loads: per-rank values by a thread per rank,
 * sums by shared atomics, the expert groups' offsets by a block scan over
 * runs of experts (serial walks over the E_local experts took ~6 us of the
 * layout at T = 8192 on 2 H200: 77.6 -> 71.5 us). */
__device__ void layout_bases(const fused_dev &d, const fused_plan_dev &p) {
  __shared__ int s_empty;
  __shared__ int32_t s_in[EPX_FUSED_MAX_RANKS], s_routes_out[EPX_FUSED_MAX_RANKS], s_routes_in[EPX_FUSED_MAX_RANKS];
  const info_index ii = make_info_index(d.W, d.El);
  /* written by the peers during this op: volatile, never a stale L1 line */
  const volatile int32_t *mat = reinterpret_cast<const volatile int32_t *>(d.local + d.off_mat);
  const volatile int32_t *hist = reinterpret_cast<const volatile int32_t *>(d.local + d.off_hist);
  const volatile int32_t *hdr = reinterpret_cast<const volatile int32_t *>(d.local + d.off_hdr);
  int64_t *info = p.info;
  const int W = d.W, El = d.El, t = threadIdx.x;
  if (t == 0) {
    int empty = 0;
    for (int s = 0; s < W; s++) empty |= hdr[s * EPX_FUSED_HDR_INTS + EPX_FUSED_HDR_OVERSIZE] != 0;
    s_empty = empty;
    info[ii.empty] = empty;
  }
  for (int i = t; i < W * EPX_FUSED_HDR_INTS; i += blockDim.x) info[ii.hdr + i] = hdr[i];
  if (t < W) s_routes_out[t] = s_routes_in[t] = 0;
  __syncthreads();
  const int keep = !s_empty; /* 0: every count is 0 */
  if (t < W) {
    int64_t base = 0;
    for (int s = 0; s < d.rank; s++) base += mat[s * W + t];
    info[ii.sbase + t] = keep * base;
    info[ii.scount + t] = keep * mat[d.rank * W + t];
    s_in[t] = keep * mat[t * W + d.rank];
    info[ii.rcount + t] = s_in[t];
  }
  for (int i = t; i < W * El; i += blockDim.x) {
    atomicAdd(&s_routes_out[i / El], p.hist[i]);
    atomicAdd(&s_routes_in[i / El], hist[i]);
  }
  /* a run of experts per thread: counts, then the padded groups' offsets
   * (capacity: W * C rows per expert, whatever its count) */
  const int per = (El + (int)blockDim.x - 1) / (int)blockDim.x;
  const int e0 = min(El, t * per), e1 = min(El, e0 + per);
  int64_t mine = 0;
  for (int e = e0; e < e1; e++) {
    int64_t c = 0;
    for (int s = 0; s < W; s++) c += keep * hist[s * El + e];
    info[ii.ecount + e] = c;
    mine += group_rows(p, W, c);
  }
  __syncthreads();
  int64_t pairs = 0;
  for (int s = 0; s < W; s++) pairs += s_in[s];
  if (t == 0) {
    int64_t run = 0;
    for (int s = 0; s < W; s++) {
      info[ii.rbase + s] = run;
      run += s_in[s];
    }
    info[ii.rbase + W] = pairs;
    info[ii.pairs] = pairs;
  }
  if (t < W) {
    info[ii.sroutes + t] = keep * s_routes_out[t];
    info[ii.rroutes + t] = keep * s_routes_in[t];
  }
  int64_t total = 0;
  int64_t run = block_scan(mine, &total);
  for (int e = e0; e < e1; e++) {
    info[ii.eoff + e] = run;
    run += group_rows(p, W, info[ii.ecount + e]);
  }
  if (t == 0) {
    info[ii.eoff + El] = p.expert_major ? total : pairs;
    info[ii.rows] = p.expert_major ? total : pairs;
  }
  __syncthreads();
  for (int e = t; e < El; e += blockDim.x) {
    int64_t at = p.expert_major ? info[ii.eoff + e] : 0;
    for (int s = 0; s < W; s++) {
      info[ii.ebase + s * El + e] = at;
      at += p.C ? p.C : keep * hist[s * El + e]; /* capacity: row e*W*C + s*C + location */
    }
  }
}

/* This rank's header; its first invalid route is the blocks' minimum (warp 0). */
__device__ void layout_header(const fused_plan_dev &p, int64_t blocks, int32_t *s_hdr) {
  if (threadIdx.x >= 32) return;
  unsigned long long first = ~0ull;
  for (int64_t b = threadIdx.x; b < blocks; b += 32) first = min(first, __ldcg(p.chunk_invalid + b));
  for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
  if (threadIdx.x != 0) return;
  *p.invalid = first;
  s_hdr[EPX_FUSED_HDR_TOKENS] = (int32_t)p.T;
  s_hdr[EPX_FUSED_HDR_OVERSIZE] = p.oversize;
  s_hdr[EPX_FUSED_HDR_INVALID] = first != ~0ull;
  s_hdr[EPX_FUSED_HDR_TOPK] = p.K;
  s_hdr[EPX_FUSED_HDR_WEIGHTING] = p.weighting;
}

/* The last count block (see the file comment). */
__device__ void layout_exchange(const fused_dev &d, const fused_plan_dev &p, int64_t blocks) {
  __shared__ int s_bad;
  __shared__ int32_t s_cnt[EPX_FUSED_MAX_RANKS];
  __shared__ int32_t s_hdr[EPX_FUSED_HDR_INTS];
  if (failed(d)) return;
  LAYOUT_TRACE(2);
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  if (threadIdx.x == 0) s_bad = 0;
  send_cts(d, seq);
  layout_header(p, blocks, s_hdr);
  LAYOUT_TRACE(3);
  block_prefix(p.chunk_hist, blocks, d.E, p.hist);
  block_prefix(p.chunk_dcnt, blocks, d.W, s_cnt);
  __syncthreads();
  LAYOUT_TRACE(4);
  if (threadIdx.x < d.W && threadIdx.x != d.rank && !relayed(d, threadIdx.x) &&
      !wait_flag(d, flag_at(d.local, d.off_cts, threadIdx.x), seq + 1, threadIdx.x, PH_LAYOUT_CTS))
    s_bad = 1;
  __syncthreads();
  LAYOUT_TRACE(5);
  if (s_bad) return;
  /* This rank's row counts to every rank's matrix, its route counts to each
   * expert's rank, its header to every rank (a relayed peer gets them by
   * the relay step after this kernel: this rank's own rows of the three). */
  const int per = d.W + d.El + EPX_FUSED_HDR_INTS;
  for (int i = threadIdx.x; i < d.W * per; i += blockDim.x) {
    const int r = i / per, j = i % per;
    if (relayed(d, r)) continue;
    if (j < d.W)
      reinterpret_cast<int32_t *>(d.peer[r] + d.off_mat)[d.rank * d.W + j] = s_cnt[j];
    else if (j < d.W + d.El)
      reinterpret_cast<int32_t *>(d.peer[r] + d.off_hist)[d.rank * d.El + (j - d.W)] = p.hist[r * d.El + (j - d.W)];
    else
      reinterpret_cast<int32_t *>(d.peer[r] + d.off_hdr)[d.rank * EPX_FUSED_HDR_INTS + (j - d.W - d.El)] =
          s_hdr[j - d.W - d.El];
  }
  __threadfence_system();
  __syncthreads();
  LAYOUT_TRACE(6);
  if (threadIdx.x < d.W && !relayed(d, threadIdx.x)) {
    st_release_sys(flag_at(d.peer[threadIdx.x], d.off_lflag, d.rank), seq + 1);
    if (!wait_flag(d, flag_at(d.local, d.off_lflag, threadIdx.x), seq + 1, threadIdx.x, PH_LAYOUT_COUNTS)) s_bad = 1;
  }
  __syncthreads();
  LAYOUT_TRACE(7);
  if (s_bad) return;
  /* with relayed peers the bases wait for their counts: layout_bases_kernel */
  if (!d.relay_mask) layout_bases(d, p);
  LAYOUT_TRACE(8);
}

/* Record of a rank-major row in the window. */
struct meta_ref {
  int32_t *token, *expert, *pos;
  float *w;
};
__device__ __forceinline__ meta_ref meta_row(const fused_dev &d, char *records, int64_t row) {
  char *base = records + row * d.meta_stride;
  meta_ref m;
  m.token = reinterpret_cast<int32_t *>(base);
  m.expert = m.token + 1;
  m.w = reinterpret_cast<float *>(m.expert + d.Kmax);
  m.pos = reinterpret_cast<int32_t *>(m.w + d.Kmax);
  return m;
}
__device__ __forceinline__ meta_ref meta_at(const fused_dev &d, char *window, int64_t row) {
  return meta_row(d, window + d.off_meta, row);
}

/* With relayed peers: the bases once their counts came (the relay step). */
__global__ void __launch_bounds__(kLayoutTokens) layout_bases_kernel(const fused_dev d, const fused_plan_dev p) {
  if (!failed(d)) layout_bases(d, p);
}

/* A warp per token: absolute positions and slots, and the token's record
 * into each destination's window; the last CTA raises the records' flags. */
__global__ void __launch_bounds__(256) layout_records_kernel(const fused_dev d, const fused_plan_dev p, int early) {
  pdl_begin(early);
  if (failed(d)) return;
  if (blockIdx.x == 0) LAYOUT_TRACE(9);
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const info_index ii = make_info_index(d.W, d.El);
  const int lane = threadIdx.x & 31, K = p.K;
  /* capacity: every slot's row empty before the receive kernel fills the
   * claimed ones (they are scattered, not a prefix of each group) */
  if (p.C)
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < p.row_bound;
         r += (int64_t)gridDim.x * blockDim.x) {
      p.row_src_rank[r] = p.row_src_token[r] = p.row_expert[r] = -1;
      p.row_w[r] = 0.0f;
    }
  const int64_t t = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (t < p.T) {
    const int64_t b = t / kLayoutTokens;
    int32_t e = -1, pos = -1;
    float w = 0.0f;
    if (lane < K) {
      e = p.idx[t * K + lane];
      w = p.w[t * K + lane];
      if (e >= 0 && p.C) {
        pos = p.pos[t * K + lane]; /* capacity: the location */
      } else if (e >= 0) {
        pos = p.pos[t * K + lane] + p.chunk_hist[b * d.E + e];
        p.pos[t * K + lane] = pos;
      }
    }
    int32_t slot = -1;
    if (lane < d.W) {
      /* an empty layout (a rank was oversize): no token goes anywhere */
      slot = p.info[ii.empty] ? -1 : p.tok_slot[t * d.W + lane];
      if (slot < 0) {
        p.tok_slot[t * d.W + lane] = -1;
      } else {
        slot += p.chunk_dcnt[b * d.W + lane];
        p.tok_slot[t * d.W + lane] = slot;
        p.send_token[(int64_t)lane * d.maxT + slot] = (int32_t)t;
      }
    }
    for (int r = 0; r < d.W; r++) {
      const int32_t s = __shfl_sync(0xffffffffu, slot, r);
      if (s < 0) continue;
      /* a relayed peer's record: this rank's outbox to it, at the row's index */
      const meta_ref m = relayed(d, r) ? meta_row(d, d.relay[r], s) : meta_at(d, d.peer[r], p.info[ii.sbase + r] + s);
      if (lane == 0) *m.token = (int32_t)t;
      if (lane < K) {
        const bool mine = e >= 0 && e / d.El == r;
        m.expert[lane] = mine ? e : -1;
        m.w[lane] = w;
        m.pos[lane] = mine ? pos : -1;
      }
    }
  }
  if (last_cta(d, true)) { /* the records went to the peers' windows */
    LAYOUT_TRACE(10);
    if (threadIdx.x < d.W && !relayed(d, threadIdx.x))
      st_release_sys(flag_at(d.peer[threadIdx.x], d.off_mflag, d.rank), seq + 1);
  }
}

/* A warp per received row: the plan's tables; then the padding rows. */
__global__ void __launch_bounds__(256) layout_receive_kernel(const fused_dev d, const fused_plan_dev p, int early) {
  __shared__ int s_bad;
  __shared__ int64_t s_rbase[EPX_FUSED_MAX_RANKS + 1];
  pdl_begin(early);
  if (failed(d)) return;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x == 0) s_bad = 0;
  if (threadIdx.x <= d.W) s_rbase[threadIdx.x] = p.info[ii.rbase + threadIdx.x];
  if (blockIdx.x == 0) LAYOUT_TRACE(11);
  __syncthreads();
  if (threadIdx.x < d.W && !relayed(d, threadIdx.x) &&
      !wait_flag(d, flag_at(d.local, d.off_mflag, threadIdx.x), seq + 1, threadIdx.x, PH_LAYOUT_META))
    s_bad = 1;
  __syncthreads();
  if (blockIdx.x == 0) LAYOUT_TRACE(12);
  if (!s_bad) {
    const int lane = threadIdx.x & 31, K = p.K;
    const int64_t pairs = s_rbase[d.W];
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t q = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < pairs; q += warps) {
      const int s = source_of_row(s_rbase, d.W, q);
      /* a relayed source's records came to its inbox (the relay step) */
      const meta_ref m = relayed(d, s) ? meta_row(d, d.inbox[s], q - s_rbase[s]) : meta_at(d, d.local, q);
      const int32_t t = __ldcg(m.token);
      if (lane == 0) {
        p.pair_token[q] = t;
        if (!p.expert_major) {
          p.row_src_rank[q] = s;
          p.row_src_token[q] = t;
        }
      }
      if (lane < K) {
        const int32_t e = __ldcg(m.expert + lane);
        const float w = e >= 0 ? __ldcg(m.w + lane) : 0.0f;
        int32_t row = -1;
        p.pair_expert[q * K + lane] = e;
        p.pair_w[q * K + lane] = w;
        if (p.expert_major && e >= 0) {
          const int le = e - d.rank * d.El;
          row = (int32_t)(p.info[ii.ebase + s * d.El + le] + __ldcg(m.pos + lane));
          p.row_src_rank[row] = s;
          p.row_src_token[row] = t;
          p.row_expert[row] = e;
          p.row_w[row] = w;
        }
        p.pair_rows[q * K + lane] = row;
      }
    }
    if (p.expert_major && !p.C) /* (capacity: emptied by the records kernel) */
      for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < d.El; e += (int64_t)gridDim.x * blockDim.x)
        for (int64_t r = p.info[ii.eoff + e] + p.info[ii.ecount + e]; r < p.info[ii.eoff + e + 1]; r++) {
          p.row_src_rank[r] = p.row_src_token[r] = p.row_expert[r] = -1;
          p.row_w[r] = 0.0f;
        }
  }
  if (blockIdx.x == 0) LAYOUT_TRACE(13);
  end_op(d, seq);
}

}  // namespace

#ifdef EPX_FUSED_LAYOUT_TRACE
/* The diagnostic build's stage times: out [64][16] (ns of the global timer,
 * by op number mod 64, stage: see the LAYOUT_TRACE calls). */
extern "C" cudaError_t epx_fused_layout_trace(unsigned long long *out) {
  return cudaMemcpyFromSymbol(out, g_layout_trace, sizeof g_layout_trace);
}
#endif

extern "C" cudaError_t epx_fused_layout_launch(epx_fused_t *f, epx_fused_plan_t *plan, const int32_t *topk_idx,
                                               const float *topk_w, const int32_t *locations, int64_t num_tokens,
                                               int32_t top_k, int32_t oversize, int32_t weighting,
                                               cudaStream_t stream) {
  const fused_dev &d = f->dev;
  if (num_tokens < 0 || num_tokens > d.maxT || top_k < 1 || top_k > d.Kmax || (num_tokens > 0 && !topk_idx) ||
      (oversize && num_tokens > 0) || (plan->dev.C && num_tokens > 0 && !locations))
    return cudaErrorInvalidValue;
  fused_plan_dev &p = plan->dev;
  plan->counts_known = 0;
  p.T = num_tokens;
  p.K = top_k;
  p.oversize = oversize != 0;
  p.weighting = weighting;
  /* at least one block: the last one runs the exchange (no tokens: an empty block) */
  const int64_t blocks = num_tokens > 0 ? (num_tokens + kLayoutTokens - 1) / kLayoutTokens : 1;
  const size_t smem = (size_t)kLayoutTokens * (size_t)top_k * 4 + (size_t)kLayoutWarps * (size_t)d.E;
  if (smem > 48 * 1024) {
    /* set once per device */
    const cudaError_t e = epx_cuda_kernel_smem_here((const void *)layout_count_kernel, smem);
    if (e != cudaSuccess) return e;
  }
  /* Programmatic dependent launch (pdl.cuh): a kernel's blocks launch as the
   * one ahead ends and wait for its memory, not after it (one rank: the
   * receive kernel began 1 us sooner). Only the records kernel lets the next
   * launch early: the count kernel's last block may wait long for the
   * peers' counts, and early blocks waiting behind it would hold every SM
   * from the caller's other streams meanwhile. */
  const int early = (epx_cuda_launch_flags() & EPX_CUDA_PDL_LAYOUT_EARLY) != 0;
  if (p.C && num_tokens > 0)
    layout_claim_kernel<<<(unsigned)((num_tokens * top_k + 255) / 256), 256, 0, stream>>>(d, p, topk_idx, locations);
  cudaError_t e = launch_pdl(layout_count_kernel, (unsigned)blocks, kLayoutTokens, smem, stream, d, p, topk_idx, topk_w,
                 locations, 0);
  if (e != cudaSuccess) return e;
  if (d.relay_mask) {
    e = epx_fused_relay_step(f, plan, RELAY_COUNTS, 0, stream);
    if (e != cudaSuccess) return e;
    layout_bases_kernel<<<1, kLayoutTokens, 0, stream>>>(d, p);
  }
  const int64_t record_blocks = num_tokens > 0 ? (num_tokens * 32 + 255) / 256 : 1;
  e = launch_pdl(layout_records_kernel, (unsigned)record_blocks, 256, 0, stream, d, p, early);
  if (e != cudaSuccess) return e;
  if (d.relay_mask) {
    e = epx_fused_relay_step(f, plan, RELAY_RECORDS, 0, stream);
    if (e != cudaSuccess) return e;
  }
  e = launch_pdl(layout_receive_kernel, (unsigned)f->num_sms, 256, 0, stream, d, p, 0);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

/* ---- dispatch ------------------------------------------------------------- */

namespace {

/* MODE_EXPERT: the receiving CTAs expand rows as they arrive;
 * MODE_EXPERT_APART: the remote rows stay in the window (as MODE_RANK_WINDOW
 * leaves them) and expand_kernel expands every row after the exchange, over
 * every SM (EPX_CUDA_FUSED_EXPAND_APART); MODE_EXPERT_WINDOW: the same
 * without the expansion (an expert-major plan's rows only in the window, for
 * the dots of dispatch_backward's grad_w). The three expert modes leave
 * this rank's own rows in x. MODE_RANK_ENGINE: rank-major into recv_x, this
 * rank's own rows straight there, the others' left in the window for the
 * copy engine (EPX_CUDA_FUSED_COPY_ENGINE). */
enum { MODE_RANK_WINDOW = 0, MODE_RANK_COPY = 1, MODE_EXPERT = 2, MODE_EXPERT_APART = 3, MODE_EXPERT_WINDOW = 4,
       MODE_RANK_ENGINE = 5 };

__device__ __forceinline__ bool remote_rows_only(int mode) {
  return mode == MODE_EXPERT || mode == MODE_EXPERT_APART || mode == MODE_EXPERT_WINDOW;
}
/* the receivers only wait for the rows: they stay in the window */
__host__ __device__ __forceinline__ bool rows_stay(int mode) {
  return mode == MODE_RANK_WINDOW || mode == MODE_EXPERT_APART || mode == MODE_EXPERT_WINDOW ||
         mode == MODE_RANK_ENGINE;
}

struct dispatch_shared {
  int64_t sbase[EPX_FUSED_MAX_RANKS], scount[EPX_FUSED_MAX_RANKS];
  int64_t rbase[EPX_FUSED_MAX_RANKS + 1], rcount[EPX_FUSED_MAX_RANKS];
  int bad;
};

__device__ int64_t chunks_of(int64_t rows) { return (rows + kChunk - 1) / kChunk; }

/* Sender CTAs: (chunk j, destination) pairs round robin, remote ranks first
 * in each round, a warp per row. */
__device__ void send_rows(const fused_dev &d, const fused_plan_dev &p, dispatch_shared &sh, uint32_t seq,
                          const uint4 *x, uint4 *recv, int mode, int ns, char *slots) {
  __shared__ uint64_t bars[kMaxBulkWarps];
  uint32_t phase = 0;
  if (d.bulk_warps > 0 && (threadIdx.x & 31) == 0 && (threadIdx.x >> 5) < d.bulk_warps) bulk_init(bars + (threadIdx.x >> 5));
  if (threadIdx.x < d.W && threadIdx.x != d.rank && !relayed(d, threadIdx.x) &&
      !wait_flag(d, flag_at(d.local, d.off_cts, threadIdx.x), seq + 1, threadIdx.x, PH_DISPATCH_CTS))
    sh.bad = 1;
  __syncthreads();
  if (sh.bad) return;
  int64_t rounds = 0;
  for (int r = 0; r < d.W; r++) rounds = max(rounds, chunks_of(sh.scount[r]));
  for (int64_t g = blockIdx.x; g < rounds * d.W; g += ns) {
    const int64_t j = g / d.W;
    const int r = (d.rank + 1 + (int)(g % d.W)) % d.W;
    const int64_t n = min((int64_t)kChunk, sh.scount[r] - j * kChunk);
    if (n <= 0 || (remote_rows_only(mode) && r == d.rank)) continue;
    uint4 *dst = r != d.rank || mode == MODE_RANK_WINDOW ? reinterpret_cast<uint4 *>(d.peer[r] + d.off_pay) : recv;
    const int32_t *tokens = p.send_token + (int64_t)r * d.maxT + j * kChunk;
    /* a relayed peer's rows: this rank's outbox to it, at their indices */
    uint4 *rows = relayed(d, r) ? reinterpret_cast<uint4 *>(d.relay[r] + d.relay_off_rows) + j * kChunk * d.nvec
                                : dst + (sh.sbase[r] + j * kChunk) * d.nvec;
    send_chunk(
        d, n, [&](int64_t i) { return x + (int64_t)tokens[i] * d.nvec; }, [&](int64_t i) { return rows + i * d.nvec; },
        bars, phase, slots);
    __syncthreads();
    if (r != d.rank && !relayed(d, r) && threadIdx.x == 0) {
      __threadfence_system();
      st_release_sys(flag_at(d.peer[r], d.off_cflag, (int64_t)d.rank * d.max_chunks + j), seq + 1);
    }
  }
}

/* One row to each of its expert-major rows (round(w * row) when weighted). */
template <typename T, bool kWindow>
__device__ void warp_expand(uint4 *recv, const uint4 *src, const int32_t *rows, const float *w, int K,
                            int weighted, int64_t nvec, int lane) {
  constexpr int U = 8; /* 4 KB of the row in flight per warp */
  const int32_t my_row = lane < K ? rows[lane] : -1;
  const float my_w = lane < K ? w[lane] : 0.0f;
  const unsigned valid = __ballot_sync(0xffffffffu, my_row >= 0);
  for (int64_t v0 = 0; v0 < nvec; v0 += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int64_t i = v0 + u * 32 + lane;
      if (i < nvec) v[u] = ld_row<kWindow>(src + i);
    }
    for (unsigned m = valid; m; m &= m - 1) {
      const int k = __ffs(m) - 1;
      const int64_t row = __shfl_sync(0xffffffffu, my_row, k);
      const float wk = __shfl_sync(0xffffffffu, my_w, k);
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int64_t i = v0 + u * 32 + lane;
        if (i < nvec) recv[row * nvec + i] = weighted ? scale_vec<T>(v[u], wk) : v[u];
      }
    }
  }
}

/* Received row q (from source s) into its expert-major rows: this rank's
 * own rows from x (they never go through the window), the others' from it. */
template <typename T>
__device__ __forceinline__ void expand_pair(const fused_dev &d, const fused_plan_dev &p, const uint4 *x, uint4 *recv,
                                            int64_t q, int s, int weighted, int lane) {
  const int32_t *rows = p.pair_rows + q * p.K;
  const float *w = p.pair_w + q * p.K;
  if (s == d.rank)
    warp_expand<T, false>(recv, x + (int64_t)p.pair_token[q] * d.nvec, rows, w, p.K, weighted, d.nvec, lane);
  else
    warp_expand<T, true>(recv, reinterpret_cast<const uint4 *>(d.local + d.off_pay) + q * d.nvec, rows, w, p.K,
                         weighted, d.nvec, lane);
}

/* Receiver CTAs: (chunk j, source) pairs round robin; each waits for the
 * chunk's flag, then expands it (expert-major) or copies it out. */
template <typename T>
__device__ void receive_rows(const fused_dev &d, const fused_plan_dev &p, dispatch_shared &sh, uint32_t seq,
                             const uint4 *x, uint4 *recv, int mode, int weighted, int ns) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rc = blockIdx.x - ns, nr = gridDim.x - ns;
  const info_index ii = make_info_index(d.W, d.El);
  const uint4 *pay = reinterpret_cast<const uint4 *>(d.local + d.off_pay);
  if (mode == MODE_EXPERT) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int e = rc; e < d.El; e += nr)
      for (int64_t r = p.info[ii.eoff + e] + p.info[ii.ecount + e] + warp; r < p.info[ii.eoff + e + 1]; r += kWarps)
        for (int64_t i = lane; i < d.nvec; i += 32) recv[r * d.nvec + i] = zero;
  }
  int64_t rounds = 0;
  for (int s = 0; s < d.W; s++) rounds = max(rounds, chunks_of(sh.rcount[s]));
  if (rows_stay(mode)) {
    /* nothing to move: every thread waits for chunks of its own, so the
     * flags' round trips overlap */
    for (int64_t g = rc + (int64_t)nr * threadIdx.x; g < rounds * d.W; g += (int64_t)nr * blockDim.x) {
      const int64_t j = g / d.W;
      const int s = (int)(g % d.W);
      if (s == d.rank || relayed(d, s) || j * kChunk >= sh.rcount[s]) continue;
      if (!wait_flag(d, flag_at(d.local, d.off_cflag, (int64_t)s * d.max_chunks + j), seq + 1, s, PH_DISPATCH_ROWS))
        break;
    }
    return;
  }
  for (int64_t g = rc; g < rounds * d.W; g += nr) {
    const int64_t j = g / d.W;
    const int s = (d.rank + 1 + (int)(g % d.W)) % d.W;
    const int64_t n = min((int64_t)kChunk, sh.rcount[s] - j * kChunk);
    /* (a relayed source's rows come after the kernel: relay_rows_in) */
    if (n <= 0 || (s == d.rank && mode != MODE_EXPERT) || relayed(d, s)) continue;
    if (s != d.rank && threadIdx.x == 0 &&
        !wait_flag(d, flag_at(d.local, d.off_cflag, (int64_t)s * d.max_chunks + j), seq + 1, s, PH_DISPATCH_ROWS))
      sh.bad = 1;
    __syncthreads();
    if (sh.bad) return;
    for (int64_t i = warp; i < n; i += kWarps) {
      const int64_t q = sh.rbase[s] + j * kChunk + i;
      if (mode == MODE_RANK_COPY) warp_copy<true>(recv + q * d.nvec, pay + q * d.nvec, d.nvec, lane);
      else expand_pair<T>(d, p, x, recv, q, s, weighted, lane);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const fused_dev d, const fused_plan_dev p,
                                                               const uint4 *x, uint4 *recv, int mode,
                                                               int weighted, int ns) {
  __shared__ dispatch_shared sh;
  extern __shared__ __align__(128) char slots[]; /* bulk path: a row per copying warp */
  if (failed(d)) return;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x < d.W) {
    sh.sbase[threadIdx.x] = p.info[ii.sbase + threadIdx.x];
    sh.scount[threadIdx.x] = p.info[ii.scount + threadIdx.x];
    sh.rcount[threadIdx.x] = p.info[ii.rcount + threadIdx.x];
  }
  if (threadIdx.x <= d.W) sh.rbase[threadIdx.x] = p.info[ii.rbase + threadIdx.x];
  if (threadIdx.x == 0) sh.bad = 0;
  send_cts(d, seq);
  __syncthreads();
  if ((int)blockIdx.x < ns) send_rows(d, p, sh, seq, x, recv, mode, ns, slots);
  else receive_rows<T>(d, p, sh, seq, x, recv, mode, weighted, ns);
  end_op(d, seq);
}

/* MODE_EXPERT_APART, after the exchange (every row has arrived: the
 * dispatch kernel's receiver waited for each chunk): the padding rows
 * zeroed, then a warp per rank-major row expands it into its expert-major
 * rows, this rank's own rows from x. The window's rows stay valid until this
 * rank's next dispatch-like launch (peers write them only after its
 * clear-to-send). */
template <typename T>
__global__ void __launch_bounds__(kThreads) expand_kernel(const fused_dev d, const fused_plan_dev p, const uint4 *x,
                                                          uint4 *recv, int weighted) {
  __shared__ int64_t s_rbase[EPX_FUSED_MAX_RANKS + 1];
  if (failed(d)) return; /* a wait ran out: rows are missing, the error word says which */
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x <= d.W) s_rbase[threadIdx.x] = p.info[ii.rbase + threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * kWarps, gw = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  if (p.C) {
    /* capacity: every slot no route claimed (scattered over the groups) */
    for (int64_t r = gw; r < p.row_bound; r += warps)
      if (p.row_src_rank[r] < 0)
        for (int64_t i = lane; i < d.nvec; i += 32) recv[r * d.nvec + i] = zero;
  } else {
    for (int e = 0; e < d.El; e++)
      for (int64_t r = p.info[ii.eoff + e] + p.info[ii.ecount + e] + gw; r < p.info[ii.eoff + e + 1]; r += warps)
        for (int64_t i = lane; i < d.nvec; i += 32) recv[r * d.nvec + i] = zero;
  }
  for (int64_t q = gw; q < s_rbase[d.W]; q += warps) {
    const int s = source_of_row(s_rbase, d.W, q);
    expand_pair<T>(d, p, x, recv, q, s, weighted, lane);
  }
}

template <typename T>
cudaError_t launch_dispatch(epx_fused_t *f, const epx_fused_plan_t *plan, const uint4 *x, uint4 *recv, int mode,
                            int weighted, int n, int ns, int expand_ctas, size_t smem, cudaStream_t stream) {
  const fused_dev &d = f->dev;
  const fused_plan_dev &p = plan->dev;
  if (smem > 0) {
    /* set once per device */
    const cudaError_t e = epx_cuda_kernel_smem_here((const void *)dispatch_kernel<T>, smem);
    if (e != cudaSuccess) return e;
  }
  dispatch_kernel<T><<<n, kThreads, smem, stream>>>(d, p, x, recv, mode, weighted, ns);
  if (d.relay_mask) {
    /* the relayed sources' rows: into recv_x (copied out) or the window's rows */
    const bool to_recv = mode == MODE_RANK_COPY || mode == MODE_RANK_ENGINE;
    const cudaError_t e =
        epx_fused_relay_rows_in(f, plan, to_recv ? (void *)recv : (void *)(d.local + d.off_pay), stream);
    if (e != cudaSuccess) return e;
  }
  if (mode == MODE_EXPERT_APART) expand_kernel<T><<<expand_ctas, kThreads, 0, stream>>>(d, p, x, recv, weighted);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t epx_fused_dispatch_launch(epx_fused_t *f, const epx_fused_plan_t *plan, const void *x,
                                                 void *recv_x, int weighted, int32_t num_ctas, int32_t recv_ctas,
                                                 cudaStream_t stream) {
  const fused_dev &d = f->dev;
  void *window = epx_fused_recv_window(f);
  const bool expert = plan->dev.expert_major != 0;
  const bool in_window = !recv_x || recv_x == window;
  if ((expert && (!recv_x || (in_window && weighted))) || (!x && plan->dev.T > 0) || (!expert && weighted))
    return cudaErrorInvalidValue;
  /* capacity rows are always expanded apart (its empty slots are zeroed
   * there), and so are rows of relayed sources (they come after the kernel) */
  const bool apart =
      expert && (plan->dev.C || d.relay_mask || (epx_cuda_launch_flags() & EPX_CUDA_FUSED_EXPAND_APART));
  int n = num_ctas < 2 ? 2 : num_ctas > f->num_sms ? f->num_sms : num_ctas;
  /* Rank-major rows copied out by the copy engine: where the counts are
   * known on the host, the kernel writes this rank's own rows into recv_x
   * and leaves the peers' in the window, then a device-to-device copy per
   * run of peers; else (only under EPX_CUDA_FUSED_COPY_ENGINE) it leaves
   * every row in the window and the copy takes the bound's W * max_tokens
   * rows. Taken at budgets of up to kEngineCtas, where the receiving CTAs'
   * copy-out is what bounds the dispatch: at T=8192 on 2 H200, 0.46 ms at
   * 16, 24 and 32 CTAs against 0.81, 0.56 and 0.43 (bench/NOTES-gpu.md). */
  constexpr int kEngineCtas = 24;
  const bool engine = !expert && !in_window &&
                      ((epx_cuda_launch_flags() & EPX_CUDA_FUSED_COPY_ENGINE) ||
                       (n <= kEngineCtas && plan->counts_known));
  const bool known = engine && plan->counts_known;
  const int mode = expert      ? (in_window ? MODE_EXPERT_WINDOW : apart ? MODE_EXPERT_APART : MODE_EXPERT)
                   : in_window ? MODE_RANK_WINDOW
                   : known     ? MODE_RANK_ENGINE
                   : engine    ? MODE_RANK_WINDOW
                               : MODE_RANK_COPY;
  int nr = recv_ctas > 0 ? recv_ctas : rows_stay(mode) ? 1 : epx_fused_receivers(n);
  if (nr > n - 1) nr = n - 1;
  /* every peer relayed: no row comes through the window, every CTA sends
   * (into the outboxes, and this rank's own rows) */
  const uint32_t others = (uint32_t)(((uint64_t)1 << d.W) - 1) & ~(1u << d.rank);
  if (d.W > 1 && d.relay_mask == others) nr = 0;
  const uint4 *xs = static_cast<const uint4 *>(x);
  uint4 *rs = static_cast<uint4 *>(in_window || (engine && !known) ? window : recv_x);
  const size_t smem = (size_t)d.bulk_warps * (size_t)bulk_slot_bytes(d.row_bytes);
  const int ex = 2 * f->num_sms; /* the expansion apart: two CTAs of 16 warps per SM */
  cudaError_t e = epx_payload_visit(f->config.dtype, [&](auto tag) {
    return launch_dispatch<typename decltype(tag)::type>(f, plan, xs, rs, mode, weighted, n, n - nr, ex, smem, stream);
  });
  if (e != cudaSuccess || !engine) return e;
  char *to = static_cast<char *>(recv_x);
  const char *from = static_cast<const char *>(window);
  const size_t rb = (size_t)d.row_bytes;
  if (!known) return cudaMemcpyAsync(to, from, (size_t)d.W * (size_t)d.maxT * rb, cudaMemcpyDeviceToDevice, stream);
  /* each run of consecutive sources whose rows came through the window */
  size_t at = 0, run = 0, len = 0;
  for (int s = 0; s <= d.W && e == cudaSuccess; s++) {
    const bool through = s < d.W && s != d.rank && !relayed(d, s);
    if (through) {
      if (!len) run = at;
      len += (size_t)plan->recv_pairs[s];
    } else if (len) {
      e = cudaMemcpyAsync(to + run * rb, from + run * rb, len * rb, cudaMemcpyDeviceToDevice, stream);
      len = 0;
    }
    if (s < d.W) at += (size_t)plan->recv_pairs[s];
  }
  return e;
}

extern "C" cudaError_t epx_fused_combine_backward_launch(epx_fused_t *f, const epx_fused_plan_t *plan,
                                                         const void *grad_out, void *grad_expert_out, int weighted,
                                                         int32_t num_ctas, cudaStream_t stream) {
  return epx_fused_dispatch_launch(f, plan, grad_out, grad_expert_out, weighted, num_ctas, 0, stream);
}
