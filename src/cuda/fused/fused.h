/* The fused NVLink exchange: dedup dispatch and combine in kernels that load
 * and store straight into the peers' memory, through NCCL 2.28's device API
 * (a symmetric window from ncclMemAlloc + ncclCommWindowRegister, peer
 * addresses from ncclDevCommCreate / ncclGetLsaPointer). Peers outside this
 * rank's load/store team (NCCL's LSA team: other nodes, PCIe without P2P)
 * are reached through NCCL's host API inside the same launches: grouped
 * ncclSend/ncclRecv on the stream between an op's kernels
 * (fused/relay.cu). Which of the two reaches a peer is chosen per peer at
 * creation (epx_fused_transport_t); epx_fused_peer_transports says it.
 *
 * Plain C declarations: host code never sees ncclDevComm or a kernel. The
 * launchers take device pointers, sizes and a stream, enqueue their work and
 * return the launch's cudaError_t; none synchronises the host. Completion
 * between ranks is by flags in the window with bounded spin waits: a peer
 * that does not answer within the timeout sets the error word (host-mapped,
 * readable at any time with epx_fused_error) naming it, and the waiting
 * kernel returns; the state is then failed (every later launch returns at
 * once) and the comm must be torn down.
 *
 * Semantics (identical to the CPU backend and the host-API exchange):
 *  - dispatch: a row per (token, destination rank) holding at least one of
 *    the token's experts, written by the sender straight into its final row
 *    of the receiver's rank-major layout in the window (rows by source rank,
 *    then source token). The expert-major layout (a row per (token, local
 *    expert), grouped by local expert, inside a group by (source rank, source
 *    token), groups padded with zero rows to the alignment) is expanded by the
 *    receiving CTAs from the window as chunks of rows arrive, or by a kernel
 *    of its own after the exchange (EPX_CUDA_FUSED_EXPAND_APART). The
 *    capacity layout (route (s, t, k) of local expert e at row
 *    e * W * C + s * C + location, every other row zero) is expanded apart
 *    always.
 *  - combine: the expert rank forms P(t, r) = 0 + the token's products on r
 *    in k order (float32, no fused multiply-add), sends it in float32 or
 *    rounded once to the payload dtype into the token's home window; the home
 *    sums its ranks' partials in ascending r in float32 and rounds once.
 *  - the backward passes are the same kernels: dispatch_backward is a combine
 *    of grad_recv_x with float32 partials (weighted with
 *    EPX_WEIGHTS_IN_DISPATCH), combine_backward a dispatch of grad_out
 *    (weighted with EPX_WEIGHTS_IN_COMBINE).
 *  - routing-weight gradients (epx_fused_values_home_launch): a value per
 *    route formed on the expert's rank (epx_weights_backward's grad_recv_w,
 *    combine_backward's dot <grad_out[t], expert_out(t, k)>, or
 *    dispatch_backward's <grad_recv_x(t, k), x[t]> with x dispatched to the
 *    expert's rank first, each dot in the host path's order) goes to grad_w
 *    [T, K] on the token's rank.
 *  - layout: the plan answers a handle's queries (view) and verdicts (every
 *    rank's header, epx_fused_plan_summary) by itself.
 *
 * Call order: every rank makes the same sequence of layout / dispatch-like /
 * combine-like launches on one stream per rank (they are collective). A
 * launch may begin writing a peer's window only once that peer has entered
 * the same launch (a clear-to-send flag), so a window is never overwritten
 * while its owner still reads it. */
#ifndef EPX_CUDA_FUSED_H
#define EPX_CUDA_FUSED_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_FUSED_MAX_RANKS 32 /* ranks of one load/store domain (a bit mask per token) */
#define EPX_FUSED_MAX_TOP_K 32 /* a lane per k-slot */

typedef struct epx_fused epx_fused_t;           /* the window and device comm of one buffer */
typedef struct epx_fused_plan epx_fused_plan_t; /* the layout of one dispatch (a handle's) */

typedef struct epx_fused_config {
  epx_dtype_t dtype;       /* payload dtype */
  int64_t hidden;          /* H, a multiple of 8 */
  int32_t num_experts;     /* E, a multiple of the comm's size */
  int32_t max_top_k;       /* 1 <= K <= EPX_FUSED_MAX_TOP_K */
  int64_t max_tokens;      /* tokens per rank per call, equal on every rank */
  double timeout_seconds;  /* bound of every wait on a peer (<= 0: 60 s) */
  /* 1: senders move whole rows with the bulk copy engine (cp.async.bulk
   * through shared memory) instead of 16-byte stores by every thread */
  int32_t bulk_copy;
  /* 1: the payload rows of the window hold float32 rows (H * 4 bytes each,
   * not H * dtype size): room for the expert-major combine to stage float32
   * partials apart (EPX_CUDA_FUSED_EXPAND_APART) as it stages payload ones */
  int32_t f32_rows;
} epx_fused_config_t;

/* The ranks a fused state spans, and how its windows and relay are made:
 * an NCCL comm (nccl_comm, an ncclComm_t: a symmetric window from
 * ncclMemAlloc + ncclCommWindowRegister, peers' addresses through the device
 * API, the relay through NCCL's host API), or, with nccl_comm NULL, the
 * in-process transport over `comm` (ranks as threads of one process: each
 * window the rank's own device memory, peers' addresses gathered on the
 * host, the relay through the transport's groups; cuda/xport/xport.h). */
struct epx_cuda_xport;
typedef struct epx_fused_ranks {
  void *nccl_comm;
  epx_comm_t comm;                     /* the comm (in-process: its own ranks) */
  const struct epx_cuda_xport *xport;  /* comm's transport */
} epx_fused_ranks_t;

/* Collective over the ranks: allocates and registers the
 * window (about W*max_tokens*H*(s + 4) bytes plus metadata, s the dtype's
 * size, or 4 with f32_rows), creates the
 * device comm and resolves the addresses of the peers it reaches by
 * load/store; for each other peer, an outbox and an inbox (about
 * max_tokens*H*(4 + s) bytes). EPX_ERROR_UNSUPPORTED without a symmetric
 * window. Every rank returns the same verdict: the ranks agree (a one-word
 * all-reduce) after each step that may refuse on one rank alone (its own
 * checks and the window's allocation, the registration, the device comm's
 * reach), so a refusing rank's peers refuse with it, naming it, instead of
 * waiting for it in the next collective step. The comm must outlive the
 * result. In-process ranks that share a GPU share its SMs: each launch's
 * CTAs are capped at the SMs / the ranks on the GPU, so that every rank's
 * kernels, which wait on each other, are resident at once. */
epx_status_t epx_fused_create(const epx_fused_ranks_t *ranks, const epx_fused_config_t *config,
                              epx_fused_t **fused);
/* In-process ranks sharing this rank's GPU (1 on NCCL, one rank per GPU),
 * and the SMs each one's launches may take (*share) of the GPU's (*sms). */
int32_t epx_fused_ranks_on_device(const epx_fused_t *fused, int32_t *share, int32_t *sms);
/* What a timed-out wait's error adds where in-process ranks share the GPU
 * (else ""): the kernels of every rank must be resident at once, and what
 * breaks that. */
void epx_fused_co_resident_note(const epx_fused_t *fused, char *out, size_t size);
/* Collective (the window is deregistered). NULL is a no-op. */
epx_status_t epx_fused_destroy(epx_fused_t *fused);
/* After the NCCL comm was aborted (ncclCommAbort freed it and its windows):
 * releases this side's memory without calling NCCL on the comm. NULL is a
 * no-op. */
void epx_fused_abandon(epx_fused_t *fused);

/* How this rank reaches a peer: chosen per peer by epx_fused_create, as
 * NCCL chooses a transport per peer (its canConnect): the first transport
 * of fused/setup.cu's list that can connect to the peer. */
typedef enum epx_fused_transport {
  EPX_FUSED_PEER_SELF = 0,      /* this rank */
  EPX_FUSED_PEER_LOADSTORE = 1, /* loads and stores into its window (NCCL's LSA team: NVLink, PCIe P2P) */
  EPX_FUSED_PEER_RELAY = 2      /* NCCL's host API between the kernels (fused/relay.cu): no load/store
                                   access, or the test flag EPX_CUDA_FUSED_RELAY at creation */
} epx_fused_transport_t;
/* transports[W]: the transport of each rank (epx_fused_transport_t). */
void epx_fused_peer_transports(const epx_fused_t *fused, int32_t *transports);

/* The error word: 0 while no wait timed out; else 1 and the peer that did not
 * answer and the phase ("layout counts", "dispatch rows", ...). Host-mapped:
 * no synchronisation. */
int epx_fused_error(const epx_fused_t *fused, int32_t *peer, const char **phase);

/* The CTAs of a buffer's fused launches: its sm_budget, or where that is 0
 * the default (the whole-step sweep's fastest: bench/NOTES-gpu.md, "the SM
 * budget"), at most the device's SMs. */
#define EPX_FUSED_DEFAULT_CTAS 32
int32_t epx_fused_ctas(const epx_fused_t *fused, int32_t sm_budget);

/* The rank-major receive rows in this rank's window ([W * max_tokens, H] of
 * the dtype; a plan's first N rows are valid after its dispatch). A dispatch
 * into this address moves each row once; they stay valid until the next
 * dispatch-like launch. */
void *epx_fused_recv_window(epx_fused_t *fused);

/* A plan (device arrays for the worst case of max_tokens, K = max_top_k),
 * for any layout: expert_alignment for EXPERT_MAJOR, capacity (C, slots per
 * expert and source rank) for CAPACITY. Not collective. Its memory is
 * stream-ordered on `stream` (cudaMallocAsync and, for CAPACITY, a memset of
 * its slot claims: allowed inside a CUDA graph capture of any mode), freed
 * by destroy on the stream it is given. */
epx_status_t epx_fused_plan_create(epx_fused_t *fused, epx_layout_t layout, int32_t expert_alignment,
                                   int64_t capacity, cudaStream_t stream, epx_fused_plan_t **plan);
void epx_fused_plan_destroy(epx_fused_plan_t *plan, cudaStream_t stream);

/* What a plan holds for the handle's accessors (device memory, valid after the
 * layout launch, until the plan is destroyed). */
typedef struct epx_fused_plan_view {
  const int64_t *rows;      /* [1] N, the rows of the recv layout */
  const int64_t *counts;    /* [E_local] rows per local expert before padding */
  const int64_t *offsets;   /* [E_local + 1] first row of each group (expert-major) */
  const int32_t *row_src_rank, *row_src_token; /* [row_bound], -1 for padding */
  const int32_t *row_expert; /* expert-major [row_bound]; rank-major [row_bound, K] (-1 elsewhere) */
  const float *row_w;        /* as row_expert, 0 where -1 */
  const unsigned long long *invalid; /* (route << 3) | code of the first invalid route dropped, or ~0 */
  const int64_t *pairs;      /* [1] the rank-major rows received (rank-major: N) */
  /* [W * max_tokens, top_k]: the expert-major (capacity) row of each
   * received rank-major row's k-slots, -1 (rank-major: -1 everywhere);
   * valid in the first *pairs rows only */
  const int32_t *pair_rows;
  int64_t row_bound;
  int32_t top_k;             /* the routing's K (of rank-major's row_expert / row_w rows, and of pair_rows) */
} epx_fused_plan_view_t;
void epx_fused_plan_view(const epx_fused_plan_t *plan, epx_fused_plan_view_t *view);

/* A rank's header, exchanged by the layout with the counts (every rank's
 * reaches every plan): its tokens, whether its batch was refused as oversize
 * (then every rank's layout is empty: nothing moves), whether it dropped an
 * invalid route, its top_k and its weighting. */
enum { EPX_FUSED_HDR_TOKENS = 0, EPX_FUSED_HDR_OVERSIZE = 1, EPX_FUSED_HDR_INVALID = 2, EPX_FUSED_HDR_TOPK = 3,
       EPX_FUSED_HDR_WEIGHTING = 4, EPX_FUSED_HDR_INTS = 5 };

/* The plan's small tables on the host, for the handle's verdicts and counts:
 * epx_fused_plan_readback_launch copies `readback_bytes` to host memory on
 * `stream` (no wait: the caller waits for the stream), then
 * epx_fused_plan_summary reads that copy (pointers into it). */
typedef struct epx_fused_plan_summary {
  int64_t rows;                 /* N */
  const int64_t *send_pairs;    /* [W] rows this rank sends to each rank */
  const int64_t *send_routes;   /* [W] its routes to each rank's experts */
  const int64_t *recv_pairs;    /* [W] rows each rank sends here */
  const int64_t *recv_routes;   /* [W] routes of each rank to this rank's experts */
  const int64_t *headers;       /* [W][EPX_FUSED_HDR_INTS] */
  uint64_t invalid;             /* this rank's first invalid route, as view.invalid */
} epx_fused_plan_summary_t;
size_t epx_fused_plan_readback_bytes(const epx_fused_plan_t *plan);
/* The rows this rank sends to and receives from each peer, read from the
 * summary after the plan's layout: the relay's messages to peers without
 * load/store access then have these sizes instead of their bound. Every
 * rank must say it of the same layouts (the sizes of a message must match on
 * both sides): ep.c does so at every layout with default sizing, never with
 * worst_case_sizing. The next layout launch on the plan forgets them. */
void epx_fused_plan_host_counts(epx_fused_plan_t *plan, const int64_t *send_pairs, const int64_t *recv_pairs);
cudaError_t epx_fused_plan_readback_launch(const epx_fused_plan_t *plan, void *host, cudaStream_t stream);
void epx_fused_plan_summary(const epx_fused_plan_t *plan, const void *host, epx_fused_plan_summary_t *summary);

/* Layout (collective): validates topk_idx [T, K] (an out-of-range or
 * duplicate expert is dropped and recorded in view.invalid; in the capacity
 * layout also a location outside [0, C) and a slot (expert, location) that a
 * smaller route index of this rank claimed, as the one-GPU layout does:
 * locations [T, K] is then required), exchanges the
 * per-(source, destination) row counts, per-(source, expert) route counts and
 * the ranks' headers on the GPU, and the routing of every row (token, its
 * experts on the receiver, weights, position inside each expert's group) into
 * the receivers' windows, so the plan knows its whole recv layout. topk_w may
 * be NULL (weights 0). T <= max_tokens, K <= max_top_k. oversize: this rank's
 * batch was refused (pass T = 0): every rank's layout comes out empty.
 * weighting: this rank's routing.weighting, carried in its header. */
cudaError_t epx_fused_layout_launch(epx_fused_t *fused, epx_fused_plan_t *plan,
                                    const int32_t *topk_idx, const float *topk_w,
                                    const int32_t *locations, int64_t num_tokens, int32_t top_k,
                                    int32_t oversize, int32_t weighting, cudaStream_t stream);

/* Dispatch (collective), x [T, H] -> recv_x. recv_x: NULL or
 * epx_fused_recv_window() for the rank-major rows in place; another [N, H]
 * buffer gets them copied out (rank-major) or expanded (expert-major, which
 * needs one). An expert-major or capacity plan given the window moves the
 * other ranks' rows into it, unweighted, and expands nothing (this rank's
 * own rows stay in x): the home rows of EPX_FUSED_VALUES_DISPATCH_DOTS.
 * weighted: expert-major rows get round(w * x). num_ctas: the SM
 * budget (CTAs of 512 threads, at most the SM count); recv_ctas of them
 * receive (0: automatic). */
cudaError_t epx_fused_dispatch_launch(epx_fused_t *fused, const epx_fused_plan_t *plan,
                                      const void *x, void *recv_x, int weighted,
                                      int32_t num_ctas, int32_t recv_ctas, cudaStream_t stream);

/* Rows of any bytes (collective, a dispatch-like launch): token t's row,
 * x's x_bytes at x + t * x_bytes followed, where x2 is given, by x2's
 * x2_bytes at x2 + t * x2_bytes (ep/fused.c: fp8 rows and their scales,
 * gathered on the way; or rows already packed, x2 NULL and x_bytes ==
 * row_bytes), moved once per destination rank, unweighted, into every
 * receiver's window as its rank-major rows, this rank's own rows included,
 * whatever the plan's layout: the first *view.pairs rows of
 * epx_fused_recv_window(), row_bytes apart (by source rank, then source
 * token; bytes past x_bytes + x2_bytes unspecified), valid until the next
 * dispatch-like launch. row_bytes: a multiple of 16, at most the payload
 * dtype's row; x_bytes a multiple of 16. The dispatch kernels with rows of
 * row_bytes in place of the dtype's (relayed peers' rows too). num_ctas as
 * for dispatch. */
cudaError_t epx_fused_dispatch_rows_launch(epx_fused_t *fused, const epx_fused_plan_t *plan, const void *x,
                                           int64_t x_bytes, const void *x2, int64_t x2_bytes, int64_t row_bytes,
                                           int32_t num_ctas, cudaStream_t stream);

/* Combine (collective), expert_out [N, H] in the plan's layout -> out [T, H].
 * weighted: P(t, r) multiplies by w (EPX_WEIGHTS_IN_COMBINE, expert-major).
 * num_ctas / reduce_ctas as for dispatch. */
cudaError_t epx_fused_combine_launch(epx_fused_t *fused, const epx_fused_plan_t *plan,
                                     const void *expert_out, void *out, int weighted,
                                     epx_combine_precision_t precision, int32_t num_ctas,
                                     int32_t reduce_ctas, cudaStream_t stream);

/* The backward passes on a forward plan: the same kernels (see above). */
cudaError_t epx_fused_dispatch_backward_launch(epx_fused_t *fused, const epx_fused_plan_t *plan,
                                               const void *grad_recv_x, void *grad_x,
                                               int weighted, epx_combine_precision_t precision,
                                               int32_t num_ctas, cudaStream_t stream);
cudaError_t epx_fused_combine_backward_launch(epx_fused_t *fused, const epx_fused_plan_t *plan,
                                              const void *grad_out, void *grad_expert_out,
                                              int weighted, int32_t num_ctas, cudaStream_t stream);

/* What the values of epx_fused_values_home_launch are. */
enum {
  EPX_FUSED_VALUES_PER_SLOT = 0, /* rank-major: values [N, K], a value per recv row and k-slot */
  EPX_FUSED_VALUES_PER_ROW = 1,  /* expert-major: values [N], a value per recv row */
  /* expert-major: the dot <home_rows[t], values(t, k)> (values: rows [N, H]
   * in the plan's layout; home_rows [T, H] this rank's), formed from the
   * home rows that the dispatch-like launch just before it on this plan
   * left in the window: no other dispatch-like launch of this fused state
   * may come between them. COMBINE_DOTS: combine_backward's
   * <grad_out[t], expert_out(t, k)> after epx_fused_combine_backward_launch
   * of grad_out, summed in the order of the host path's expand kernel;
   * DISPATCH_DOTS: dispatch_backward's <grad_recv_x(t, k), x[t]> after
   * epx_fused_dispatch_launch of x into the window, in the order of the
   * host path's sum kernel */
  EPX_FUSED_VALUES_COMBINE_DOTS = 2,
  EPX_FUSED_VALUES_DISPATCH_DOTS = 3
};
/* Routing-weight gradients home (collective, a combine-like launch): each
 * route's value, on its expert's rank, to grad_w [T, K] on its token's
 * rank; 0 for slots without a route (-1, invalid, or an empty layout).
 * Values are moved, not summed (a route lives on one rank): the bits are
 * the host path's. It runs on every SM, briefly, as the expansion apart
 * does (the SM budget bounds the exchanges that overlap the GEMMs). */
cudaError_t epx_fused_values_home_launch(epx_fused_t *fused, const epx_fused_plan_t *plan, int mode,
                                         const void *values, const void *home_rows, float *grad_w,
                                         cudaStream_t stream);
#ifdef __cplusplus
}
#endif
#endif
