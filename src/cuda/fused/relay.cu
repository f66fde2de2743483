/* The fused exchange, part 4: peers without load/store access (another node,
 * PCIe without P2P), reached through NCCL's host API on the buffer's stream.
 *
 * The fused kernels write what a relayed peer r would get into this rank's
 * outbox to r (fused_dev.relay[r]), never raise r's flags nor wait for them.
 * Between an op's kernels a relay step (one ncclGroupStart/End of
 * ncclSend/ncclRecv, every relayed peer at once) moves each outbox to its
 * peer, and the kernel after it reads what came, ordered by the stream:
 *
 *   layout    count kernel | RELAY_COUNTS: this rank's row-count row and
 *             header (its own rows of the window's matrix and headers) and
 *             its route counts to r's experts, into r's window | the bases
 *             (layout_bases_kernel) | records kernel | RELAY_RECORDS: the
 *             records of this rank's rows to r, by index, into r's inbox |
 *             receive kernel (reads a relayed source's records there)
 *   dispatch  dispatch kernel | RELAY_ROWS: this rank's rows to r straight
 *             into their rank-major rows on r (the window's, or recv_x's when
 *             copied out), or into r's inbox and relay_rows_in_kernel copies
 *             them there | the expansion apart (expert-major: always apart
 *             with relayed peers)
 *   combine   combine kernel, senders only | RELAY_PARTIALS: the partials of
 *             the rows from r, by row, into r's inbox, and
 *             relay_partials_in_kernel puts each at its token in the window |
 *             combine kernel, reducers
 *   values    send kernel | RELAY_VALUES: values by r's token into r's
 *             window (back) | home kernel
 *
 * Sizes: rows and partials move as many as there are where the plan's
 * counts are known on the host (default sizing reads them at the layout:
 * epx_fused_plan_host_counts; the rows then land in place, no inbox), else
 * their per-peer bound, max_tokens (worst_case_sizing: nothing waits on the
 * host, as the host-API exchange's messages have their bound then). The
 * layout's counts, headers and records, and the values (4 bytes per route),
 * always move their fixed size or bound. The bits are the load/store
 * path's: the same kernels form the same rows, partials and values, and the
 * reducers add the ranks in the same order. */
#include <cuda_runtime.h>
#include <nccl.h>

#include "core/error.h"
#include "core/wait.h"
#include "cuda/fused/impl.cuh"

using namespace epx_fused_impl;

namespace {

/* The offsets of one relayed peer's outbox and inbox (fused_dev); *outbox
 * gets the outbox's bytes (the inbox follows it), the result both's. */
size_t relay_layout(fused_dev &d, size_t *outbox) {
  const size_t T = (size_t)d.maxT;
  const int64_t partial = epx_payload_partial_row_bytes(d.H);
  const size_t row = (size_t)(d.row_bytes > partial ? d.row_bytes : partial);
  d.relay_off_rows = epx_align_up(T * (size_t)d.meta_stride, 4096);
  d.relay_off_back = d.relay_off_rows + T * row;
  *outbox = epx_align_up(d.relay_off_back + T * (size_t)d.Kmax * 4, 4096);
  return *outbox + epx_align_up(d.relay_off_rows + T * row, 4096);
}

/* A warp per row: each relayed source's rows [0, rcount) from its inbox to
 * dst's rows rbase + i. */
__global__ void __launch_bounds__(kThreads) relay_rows_in_kernel(const fused_dev d, const fused_plan_dev p,
                                                                 uint4 *dst) {
  if (failed(d)) return;
  const info_index ii = make_info_index(d.W, d.El);
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * kWarps, gw = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  for (int s = 0; s < d.W; s++) {
    if (!relayed(d, s)) continue;
    const int64_t n = p.info[ii.rcount + s], base = p.info[ii.rbase + s];
    const uint4 *in = reinterpret_cast<const uint4 *>(d.inbox[s] + d.relay_off_rows);
    for (int64_t i = gw; i < n; i += warps) warp_copy<false>(dst + (base + i) * d.nvec, in + i * d.nvec, d.nvec, lane);
  }
}

/* A warp per row: each relayed peer s's partials of this rank's rows to
 * it, [0, scount) from the inbox, to the window's partials from s at the
 * row's token. */
__global__ void __launch_bounds__(kThreads) relay_partials_in_kernel(const fused_dev d, const fused_plan_dev p,
                                                                     int64_t pe) {
  if (failed(d)) return;
  const info_index ii = make_info_index(d.W, d.El);
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * kWarps, gw = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int64_t nvec = d.H * pe / 16;
  uint4 *part = reinterpret_cast<uint4 *>(d.local + d.off_part);
  for (int s = 0; s < d.W; s++) {
    if (!relayed(d, s)) continue;
    const int64_t n = p.info[ii.scount + s];
    const uint4 *in = reinterpret_cast<const uint4 *>(d.inbox[s] + d.relay_off_rows);
    const int32_t *tokens = p.send_token + (int64_t)s * d.maxT;
    for (int64_t i = gw; i < n; i += warps)
      warp_copy<false>(part + ((int64_t)s * d.maxT + tokens[i]) * nvec, in + i * nvec, nvec, lane);
  }
}

/* The state fails as a timed-out wait fails it: the error word names the
 * peer and the relay, every later kernel returns at once. */
cudaError_t relay_failed(epx_fused_t *f, int peer, cudaStream_t stream) {
  uint32_t expected = 0;
  __atomic_compare_exchange_n(f->err_host, &expected, 1u | (uint32_t)PH_RELAY << 8 | (uint32_t)(peer + 1) << 16,
                              false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  (void)cudaMemsetAsync(f->dev.ctl + CTL_ABORT, 1, sizeof(uint32_t), stream);
  return cudaErrorUnknown;
}

}  // namespace

epx_status_t epx_fused_relay_create(epx_fused_t *f, uint32_t mask, const char *fn) {
  fused_dev &d = f->dev;
  d.relay_mask = mask;
  if (!mask) return EPX_SUCCESS;
  size_t outbox = 0;
  const size_t each = relay_layout(d, &outbox);
  const int peers = __builtin_popcount(mask);
  const cudaError_t e = cudaMalloc(&f->relay_memory, each * (size_t)peers);
  if (e != cudaSuccess) {
    f->relay_memory = NULL;
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: cudaMalloc of %zu bytes for the %d peers reached through the "
                     "host API (their outboxes and inboxes) failed: %s", fn, each * (size_t)peers, peers,
                     cudaGetErrorString(e));
  }
  char *m = static_cast<char *>(f->relay_memory);
  for (int r = 0; r < d.W; r++) {
    if (!relayed(d, r)) continue;
    d.relay[r] = m;
    d.inbox[r] = m + outbox;
    m += each;
  }
  return EPX_SUCCESS;
}

void epx_fused_relay_free(epx_fused_t *f) {
  cudaFree(f->relay_memory);
  f->relay_memory = NULL;
}

namespace {

/* One relay step; rows_dst: RELAY_ROWS's destination where the counts are
 * known (the rank-major rows), else unused. d: f->dev, or a copy whose rows
 * are d.row_bytes wide (epx_fused_relay_rows_in). */
cudaError_t relay_step(epx_fused_t *f, const fused_dev &d, const epx_fused_plan_t *plan, relay_kind kind,
                       int64_t part_elem, char *rows_dst, cudaStream_t stream) {
  if (!d.relay_mask) return cudaSuccess;
  const size_t T = (size_t)d.maxT, W = (size_t)d.W, El = (size_t)d.El;
  const bool known = plan->counts_known != 0;
  char *local = d.local;
  /* where each source's rows start in the rank-major layout (known counts) */
  size_t rbase[EPX_FUSED_MAX_RANKS + 1] = {0};
  for (int s = 0; known && s < d.W; s++) rbase[s + 1] = rbase[s] + (size_t)plan->recv_pairs[s];
  /* up to three messages each way per relayed peer, in order */
  epx_cuda_move_t sends[3 * EPX_FUSED_MAX_RANKS], recvs[3 * EPX_FUSED_MAX_RANKS];
  int64_t ns = 0, nr = 0;
  int peer = -1;
  for (int p = 0; p < d.W; p++) {
    if (!relayed(d, p)) continue;
    peer = p;
    const size_t P = (size_t)p, me = (size_t)d.rank;
    /* (send from, recv into, bytes) of up to three messages each way */
    const void *src[3] = {NULL, NULL, NULL};
    void *dst[3] = {NULL, NULL, NULL};
    size_t sbytes[3] = {0, 0, 0}, rbytes[3] = {0, 0, 0};
    switch (kind) {
      case RELAY_COUNTS:
        src[0] = local + d.off_mat + me * W * 4, dst[0] = local + d.off_mat + P * W * 4;
        sbytes[0] = rbytes[0] = W * 4;
        src[1] = local + d.off_hdr + me * EPX_FUSED_HDR_INTS * 4;
        dst[1] = local + d.off_hdr + P * EPX_FUSED_HDR_INTS * 4;
        sbytes[1] = rbytes[1] = EPX_FUSED_HDR_INTS * 4;
        src[2] = plan->dev.hist + P * El, dst[2] = local + d.off_hist + P * El * 4;
        sbytes[2] = rbytes[2] = El * 4;
        break;
      case RELAY_RECORDS:
        src[0] = d.relay[p], dst[0] = d.inbox[p];
        sbytes[0] = rbytes[0] = T * (size_t)d.meta_stride;
        break;
      case RELAY_ROWS:
        src[0] = d.relay[p] + d.relay_off_rows;
        dst[0] = known ? rows_dst + rbase[p] * (size_t)d.row_bytes : d.inbox[p] + d.relay_off_rows;
        sbytes[0] = (known ? (size_t)plan->send_pairs[p] : T) * (size_t)d.row_bytes;
        rbytes[0] = (known ? (size_t)plan->recv_pairs[p] : T) * (size_t)d.row_bytes;
        break;
      case RELAY_PARTIALS: /* the partials of the rows from p, for the rows to p */
        src[0] = d.relay[p] + d.relay_off_rows, dst[0] = d.inbox[p] + d.relay_off_rows;
        sbytes[0] = (known ? (size_t)plan->recv_pairs[p] : T) * (size_t)d.H * (size_t)part_elem;
        rbytes[0] = (known ? (size_t)plan->send_pairs[p] : T) * (size_t)d.H * (size_t)part_elem;
        break;
      case RELAY_VALUES:
        src[0] = d.relay[p] + d.relay_off_back, dst[0] = local + d.off_back + P * T * (size_t)d.Kmax * 4;
        sbytes[0] = rbytes[0] = T * (size_t)d.Kmax * 4;
        break;
    }
    for (int m = 0; m < 3; m++) {
      if (sbytes[m]) sends[ns++] = epx_cuda_move_t{p, const_cast<void *>(src[m]), sbytes[m]};
      if (rbytes[m]) recvs[nr++] = epx_cuda_move_t{p, dst[m], rbytes[m]};
    }
  }
  if (!f->comm) { /* in-process: one group of the transport */
    const epx_fused_ranks_t &q = f->ranks;
    if (q.xport->sendrecv(q.comm, sends, ns, recvs, nr, stream, "the fused exchange's relay") != EPX_SUCCESS)
      return relay_failed(f, peer, stream);
    return cudaSuccess;
  }
  /* NCCL's host API on the comm the window lives on (a group: the order of
   * the sends and receives matters only per peer) */
  ncclComm_t comm = static_cast<ncclComm_t>(f->comm);
  ncclResult_t r = ncclGroupStart();
  for (int64_t i = 0; i < ns && (r == ncclSuccess || r == ncclInProgress); i++)
    r = ncclSend(sends[i].ptr, sends[i].bytes, ncclUint8, sends[i].peer, comm, stream);
  for (int64_t i = 0; i < nr && (r == ncclSuccess || r == ncclInProgress); i++)
    r = ncclRecv(recvs[i].ptr, recvs[i].bytes, ncclUint8, recvs[i].peer, comm, stream);
  const ncclResult_t ended = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = ended;
  const double seconds = epx_wait_bound(f->config.timeout_seconds);
  if (epx_fused_nccl_settle(f->comm, r, seconds, "the fused exchange's relay", "ncclSend/ncclRecv") != EPX_SUCCESS)
    return relay_failed(f, peer, stream);
  return cudaSuccess;
}

}  // namespace

cudaError_t epx_fused_relay_step(epx_fused_t *f, const epx_fused_plan_t *plan, relay_kind kind, int64_t part_elem,
                                 cudaStream_t stream) {
  return relay_step(f, f->dev, plan, kind, part_elem, NULL, stream);
}

cudaError_t epx_fused_relay_rows_in(epx_fused_t *f, const epx_fused_plan_t *plan, void *dst, int64_t row_bytes,
                                    cudaStream_t stream) {
  const fused_dev d = with_row_bytes(f->dev, row_bytes);
  const cudaError_t e = relay_step(f, d, plan, RELAY_ROWS, 0, static_cast<char *>(dst), stream);
  if (e != cudaSuccess || plan->counts_known) return e;
  relay_rows_in_kernel<<<2 * f->num_sms, kThreads, 0, stream>>>(d, plan->dev, static_cast<uint4 *>(dst));
  return cudaGetLastError();
}

cudaError_t epx_fused_relay_partials_in(epx_fused_t *f, const epx_fused_plan_t *plan, int64_t pe,
                                        cudaStream_t stream) {
  const cudaError_t e = relay_step(f, f->dev, plan, RELAY_PARTIALS, pe, NULL, stream);
  if (e != cudaSuccess) return e;
  relay_partials_in_kernel<<<2 * f->num_sms, kThreads, 0, stream>>>(f->dev, plan->dev, pe);
  return cudaGetLastError();
}

extern "C" void epx_fused_plan_host_counts(epx_fused_plan_t *plan, const int64_t *send_pairs,
                                           const int64_t *recv_pairs) {
  const int W = plan->fused->dev.W;
  for (int r = 0; r < W; r++) plan->send_pairs[r] = send_pairs[r], plan->recv_pairs[r] = recv_pairs[r];
  plan->counts_known = 1;
}

extern "C" void epx_fused_peer_transports(const epx_fused_t *f, int32_t *transports) {
  for (int r = 0; r < f->dev.W; r++) transports[r] = f->transport[r];
}
