/* Internals of the fused NVLink exchange shared by fused/dispatch.cu and
 * fused/combine.cu: the window's regions, the kernels' argument structs, the
 * flags with bounded waits, and the warp-wide row moves. Not for host C code
 * (fused.h is its interface).
 *
 * The window (symmetric: every rank's has the same offsets), in this order:
 *   cts   [W] u32        clear-to-send: rank s stores seq+1 here when it
 *                        enters op seq, so peers may write its other regions
 *   lflag [W] u32        layout counts from s have arrived (seq+1)
 *   mflag [W] u32        layout routing records from s have arrived (seq+1)
 *   vflag [W] u32        routing-weight gradients from s have arrived (seq+1)
 *   cflag [W][chunks] u32  chunk j of rows (or partials) from s has arrived
 *   mat   [W][W] i32     row counts: mat[s][d] = rows s sends to d
 *   hist  [W][E_local] i32  routes from s to each local expert
 *   hdr   [W][EPX_FUSED_HDR_INTS] i32  rank s's header (tokens, oversize,
 *                        invalid, top_k, weighting), sent with the counts
 *   back  [W][maxT][Kmax] f32  routing-weight gradients from s, per token of
 *                        this rank and k-slot (fused/values.cu)
 *   meta  [W*maxT] records of the rank-major rows: token, then per k-slot
 *                        the expert (-1 unless on this rank), weight, and the
 *                        route's position among the source's routes to it
 *   pay   [W*maxT, H]    rank-major rows (dispatch-like ops)
 *   part  [W][maxT, H]   partial sums P(t, r) from rank r for token t
 *                        (combine-like ops; float32 or the dtype)
 * Peers without load/store access (fused/relay.cu): the kernels write what
 * such a peer r would get into this rank's relay block for r (relay[r];
 * rows and records at the row's index among this rank's rows to r,
 * partials and values at r's token), never raise its flags nor wait for
 * them; between the op's kernels a grouped ncclSend/ncclRecv on the stream
 * moves each relay block to its peer (into the window, or into this rank's
 * inbox for r where the place depends on counts the host does not know),
 * and the kernel after it reads what came (stream order, no flag).
 * Ops (layout, dispatch-like, combine-like) are numbered by a device counter
 * `seq`, equal on every rank since every rank makes the same calls; a flag
 * holds the number of the op (plus one) that last set it, so flags never need
 * resetting and a CUDA graph replays them correctly. */
#ifndef EPX_CUDA_FUSED_IMPL_CUH
#define EPX_CUDA_FUSED_IMPL_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/align.h"
#include "cuda/common/bulk.cuh"
#include "cuda/common/device.cuh"
#include "cuda/common/device_cache.h"
#include "cuda/fused/fused.h"
#include "cuda/launch.h"
#include "cuda/xport/xport.h"

namespace epx_fused_impl {

constexpr int kThreads = 512;       /* threads of the exchange CTAs (16 warps) */
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 32;          /* rows per arrival flag */
constexpr int kLayoutTokens = 256;  /* tokens per block of the layout count */

/* Phases named by the error word. */
enum { PH_LAYOUT_CTS = 1, PH_LAYOUT_COUNTS, PH_LAYOUT_META, PH_DISPATCH_CTS, PH_DISPATCH_ROWS,
       PH_COMBINE_CTS, PH_COMBINE_ROWS, PH_VALUES_CTS, PH_VALUES, PH_RELAY };

/* ctl words (device memory of this rank). */
enum { CTL_SEQ = 0, CTL_DONE = 1, CTL_ABORT = 2, CTL_WORDS = 4 };

struct fused_dev {
  char *peer[EPX_FUSED_MAX_RANKS]; /* every rank's window base, as this GPU addresses it */
  char *local;                     /* this rank's window base */
  uint32_t *ctl;                   /* [CTL_WORDS] */
  uint32_t *err;                   /* host-mapped error word */
  unsigned long long timeout_ns;
  int W, rank, E, El, Kmax, max_chunks;
  int bulk_warps;                  /* > 0: senders move whole rows with the bulk copy engine */
  int64_t maxT, H, nvec, row_bytes, meta_stride;
  int64_t pay_row_bytes; /* the window's payload rows: row_bytes, or H * 4 (config f32_rows) */
  size_t off_cts, off_lflag, off_mflag, off_vflag, off_cflag, off_mat, off_hist, off_hdr, off_back, off_meta,
      off_pay, off_part;
  /* bit r: peer r's transport is the relay (epx_fused_transport_t, chosen
   * at setup: no load/store access, or the test flag EPX_CUDA_FUSED_RELAY);
   * peer[r] is then NULL. The kernels' per-peer plan: every other peer but
   * this rank is reached by load/store. */
  uint32_t relay_mask;
  /* per relayed peer r, this rank's outbox to r: records [maxT] (meta_stride
   * each) at 0, rows at relay_off_rows ([maxT] of max(row_bytes, H * 4):
   * dispatch rows and partials, each at its row's index among the rows
   * between the two ranks), values at relay_off_back ([maxT][Kmax] f32, by
   * r's token); and its inbox from r, records at 0 and rows at
   * relay_off_rows, as the outbox */
  char *relay[EPX_FUSED_MAX_RANKS], *inbox[EPX_FUSED_MAX_RANKS];
  size_t relay_off_rows, relay_off_back;
};

__host__ __device__ __forceinline__ bool relayed(const fused_dev &d, int r) { return (d.relay_mask >> r) & 1u; }

/* d with rows of row_bytes (a multiple of 16, at most the dtype's) in
 * place of the dtype's: the window's and the relay's rows as
 * epx_fused_dispatch_rows_launch moves them. */
inline fused_dev with_row_bytes(fused_dev d, int64_t row_bytes) {
  d.row_bytes = row_bytes;
  d.nvec = row_bytes / 16;
  return d;
}

/* Every peer relayed through NCCL's host API: no row comes through the
 * window (a dispatch's receiving CTAs have nothing to wait for). */
inline bool every_peer_relayed(const fused_dev &d) {
  const uint32_t others = (uint32_t)(((uint64_t)1 << d.W) - 1) & ~(1u << d.rank);
  return d.W > 1 && d.relay_mask == others;
}

/* Index of the small int64 table of a plan (device), from W and E_local.
 * Everything the host reads back (epx_fused_plan_summary) sits in its first
 * `head` words; the per-(source, expert) bases follow. */
struct info_index {
  int sbase, scount, rbase, rcount, sroutes, rroutes, hdr, ecount, eoff, rows, pairs, empty, head, ebase, total;
};
static inline __host__ __device__ info_index make_info_index(int W, int El) {
  info_index i;
  i.sbase = 0;
  i.scount = W;
  i.rbase = 2 * W;        /* [W + 1] */
  i.rcount = 3 * W + 1;
  i.sroutes = 4 * W + 1;  /* [W] routes this rank sends to each rank's experts */
  i.rroutes = 5 * W + 1;  /* [W] routes each rank sends to this rank's experts */
  i.hdr = 6 * W + 1;      /* [W][EPX_FUSED_HDR_INTS] every rank's header */
  i.ecount = i.hdr + W * EPX_FUSED_HDR_INTS;
  i.eoff = i.ecount + El; /* [El + 1] */
  i.rows = i.eoff + El + 1;
  i.pairs = i.rows + 1;
  i.empty = i.pairs + 1;  /* 1: some rank was oversize, the layout is empty */
  i.head = i.empty + 1;
  i.ebase = i.head;       /* [W * El]: first row of (source s, local expert e) */
  i.total = i.ebase + W * El;
  return i;
}

struct fused_plan_dev {
  int32_t *idx;        /* [maxT, K] validated routing */
  float *w;            /* [maxT, K] */
  int32_t *pos;        /* [maxT, K] position of the route among this rank's routes to its expert
                          (capacity: its location) */
  int32_t *tok_slot;   /* [maxT, W] the token's index among this rank's tokens to d, -1 */
  int32_t *send_token; /* [W, maxT] token of each slot */
  int32_t *chunk_hist; /* [blocks, E] per-block route counts, then their exclusive prefix */
  int32_t *chunk_dcnt; /* [blocks, W] per-block row counts, then their exclusive prefix */
  unsigned long long *chunk_invalid; /* [blocks] each block's first invalid route, or ~0 */
  int32_t *hist;       /* [E] routes per expert from this rank */
  int64_t *info;       /* info_index */
  int32_t *pair_token; /* [W*maxT] per rank-major row p: source token */
  int32_t *pair_expert;/* [W*maxT, K] global expert of slot k on this rank, -1 */
  float *pair_w;       /* [W*maxT, K] its weight, 0 */
  int32_t *pair_rows;  /* [W*maxT, K] expert-major row of slot k, -1 */
  int32_t *row_src_rank, *row_src_token, *row_expert; /* [row_bound] */
  float *row_w;
  unsigned long long *invalid;
  unsigned long long *claim; /* capacity: [E, C] each slot's claim, (seq + 1) << 32 | ~route (atomicMax) */
  int64_t row_bound;
  int64_t C;           /* capacity: slots per (local expert, source rank); 0 otherwise */
  int expert_major, align, K; /* expert_major: also 1 in the capacity layout (rows per route) */
  int64_t T;
  int32_t oversize, weighting; /* this rank's header words of the current layout */
};

/* ---- flags ---------------------------------------------------------------- */

__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
/* The source rank of received rank-major row q: the s with rbase[s] <= q <
 * rbase[s + 1] (rbase: the plan's W + 1 row bases, in shared memory). */
__device__ __forceinline__ int source_of_row(const int64_t *rbase, int W, int64_t q) {
  int s = 0;
  while (s + 1 < W && rbase[s + 1] <= q) s++;
  return s;
}

__device__ __forceinline__ uint32_t *flag_at(char *base, size_t off, int64_t i) {
  return reinterpret_cast<uint32_t *>(base + off) + i;
}
__device__ __forceinline__ bool failed(const fused_dev &d) {
  return *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_ABORT) != 0;
}

/* Spins until *flag >= target (wrapping compare); false on timeout (the
 * error word then names the peer and phase) or when another wait failed.
 * Out of line, with scalars only, so the kernels keep their arguments in
 * constant memory. */
static __device__ __noinline__ bool wait_flag_impl(uint32_t *ctl, uint32_t *err, unsigned long long timeout_ns,
                                            const uint32_t *flag, uint32_t target, int peer, int phase) {
  if ((int32_t)(ld_acquire_sys(flag) - target) >= 0) return true;
  const unsigned long long t0 = global_ns();
  for (uint32_t spin = 1;; spin++) {
    if ((int32_t)(ld_acquire_sys(flag) - target) >= 0) return true;
    if ((spin & 255u) == 0) {
      if (*reinterpret_cast<volatile uint32_t *>(ctl + CTL_ABORT) != 0) return false;
      if (global_ns() - t0 > timeout_ns) {
        atomicExch(ctl + CTL_ABORT, 1u);
        atomicCAS(err, 0u, 1u | (uint32_t)phase << 8 | (uint32_t)(peer + 1) << 16);
        __threadfence_system();
        return false;
      }
    }
  }
}
__device__ __forceinline__ bool wait_flag(const fused_dev &d, const uint32_t *flag, uint32_t target, int peer,
                                          int phase) {
  return wait_flag_impl(d.ctl, d.err, d.timeout_ns, flag, target, peer, phase);
}

/* Every CTA calls it once at its end; the last CTA to arrive gets true (with
 * the others' writes visible to it) and resets the counter. system: the CTAs
 * wrote to peers' windows and the last CTA then raises a flag there, so
 * every thread fences at system scope first; else (writes to this GPU's
 * memory only) one GPU-scope fence per CTA, by thread 0 after the CTA's
 * barrier, which orders the CTA's writes before it (fences are cumulative). */
__device__ __forceinline__ bool last_cta(const fused_dev &d, bool system) {
  __shared__ int s_last;
  if (system) __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (!system) __threadfence();
    const uint32_t old = atomicAdd(d.ctl + CTL_DONE, 1u);
    s_last = old == gridDim.x - 1;
    if (s_last) {
      __threadfence();
      d.ctl[CTL_DONE] = 0;
    }
  }
  __syncthreads();
  return s_last != 0;
}

/* Ends an op: the last CTA advances the op counter (the next kernel reads
 * it; what peers may see of this op was flagged to them already). */
__device__ __forceinline__ void end_op(const fused_dev &d, uint32_t seq) {
  if (last_cta(d, false) && threadIdx.x == 0) {
    *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ) = seq + 1;
    __threadfence();
  }
}

/* Tells every rank this one entered op seq (each CTA may: the same value). */
__device__ __forceinline__ void send_cts(const fused_dev &d, uint32_t seq) {
  for (int r = threadIdx.x; r < d.W; r += blockDim.x)
    if (!relayed(d, r)) st_release_sys(flag_at(d.peer[r], d.off_cts, d.rank), seq + 1);
}

/* The senders' start: thread r < W waits for peer r's clear-to-send of op
 * seq (itself and relayed peers excepted); false on every thread of the
 * block when one timed out (bad set: the block returns). */
__device__ __forceinline__ bool await_cts(const fused_dev &d, uint32_t seq, int phase, int &bad) {
  if (threadIdx.x < d.W && threadIdx.x != d.rank && !relayed(d, threadIdx.x) &&
      !wait_flag(d, flag_at(d.local, d.off_cts, threadIdx.x), seq + 1, threadIdx.x, phase))
    bad = 1;
  __syncthreads();
  return !bad;
}

/* ---- warp-wide row moves -------------------------------------------------- */

/* 16-byte vectors per lane in flight per step. */
constexpr int kCopyVecs = 8;

__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

/* Loads of memory that peers write during the kernel (the window) bypass
 * L1 and the read-only path: after the flag's acquire they read L2. */
template <bool kWindow>
__device__ __forceinline__ uint4 ld_row(const uint4 *p) {
  return kWindow ? __ldcg(p) : ld_stream(p);
}

/* One step of a warp's row: v[u] = src[v0 + u * 32 + lane] where below nvec
 * (the others unset). */
template <bool kWindow, int U>
__device__ __forceinline__ void ld_step(const uint4 *src, int64_t v0, int64_t nvec, int lane, uint4 (&v)[U]) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int64_t i = v0 + u * 32 + lane;
    if (i < nvec) v[u] = ld_row<kWindow>(src + i);
  }
}

/* dst[0, nvec) = src[0, nvec), by one warp, kCopyVecs loads in flight per lane. */
template <bool kWindow>
__device__ __forceinline__ void warp_copy(uint4 *dst, const uint4 *src, int64_t nvec, int lane) {
  for (int64_t v0 = 0; v0 < nvec; v0 += 32 * kCopyVecs) {
    uint4 r[kCopyVecs];
    ld_step<kWindow>(src, v0, nvec, lane, r);
#pragma unroll
    for (int u = 0; u < kCopyVecs; u++) {
      const int64_t i = v0 + u * 32 + lane;
      if (i < nvec) dst[i] = r[u];
    }
  }
}

/* ---- whole rows by the bulk copy engine (TMA) ----------------------------- */

/* Shared memory of the bulk path: a slot of one row per copying warp
 * (epx_bulk_slot_bytes of the row). */
constexpr int kMaxBulkWarps = 12;

/* One row src -> dst through `slot` (one thread): waits until the previous
 * store has read the slot, loads the row (completing on bar), stores it. */
__device__ __forceinline__ void bulk_row(uint64_t *bar, uint32_t &phase, char *slot, const void *src, void *dst,
                                         uint32_t bytes) {
  epx_bulk_wait_read();
  epx_bulk_expect(bar, bytes);
  epx_bulk_load(slot, src, bytes, bar);
  epx_bulk_wait(bar, phase);
  phase ^= 1u;
  epx_bulk_store(dst, slot, bytes);
  epx_bulk_commit();
}

/* A CTA's senders move rows [0, n) of a chunk: row i from src(i) to dst(i).
 * The bulk path uses lane 0 of the first d.bulk_warps warps; otherwise a
 * warp per row. Ends with every row written (the caller then syncs). */
template <typename Src, typename Dst>
__device__ __forceinline__ void send_chunk(const fused_dev &d, int64_t n, Src src, Dst dst, uint64_t *bars,
                                           uint32_t &phase, char *slots) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (d.bulk_warps > 0) {
    if (lane == 0 && warp < d.bulk_warps) {
      char *slot = slots + (int64_t)warp * epx_bulk_slot_bytes(d.row_bytes);
      for (int64_t i = warp; i < n; i += d.bulk_warps)
        bulk_row(bars + warp, phase, slot, src(i), dst(i), (uint32_t)d.row_bytes);
      epx_bulk_drain();
    }
    return;
  }
  for (int64_t i = warp; i < n; i += kWarps) warp_copy<false>(dst(i), src(i), d.nvec, lane);
}

/* round(w * v) element-wise in the dtype (float32 product, no FMA). */
template <typename T>
__device__ __forceinline__ uint4 scale_vec(const uint4 &v, float w) {
  using vec = epx_vec<T>;
  float f[vec::n];
  vec::unpack(v, f);
#pragma unroll
  for (int e = 0; e < vec::n; e++) f[e] = __fmul_rn(w, f[e]);
  return vec::pack(f);
}

/* The receiving (dispatch) or reducing (combine) CTAs of a budget of n:
 * half (a test build sweeps other splits: common/test_hooks.h), at least
 * one. */
static inline int epx_fused_receivers(int n) {
  const int share = epx_cuda_receiver_share(n, epx_cuda_launch_flags());
  return share > 1 ? share : 1;
}

/* ---- the relay (fused/relay.cu) ------------------------------------------- */

/* What a relay step moves to and from every relayed peer r. */
enum relay_kind {
  RELAY_COUNTS,   /* this rank's row counts, header and route counts to r -> r's window */
  RELAY_RECORDS,  /* the records of this rank's rows to r -> r's inbox */
  RELAY_ROWS,     /* this rank's rows to r -> r's inbox, or its rows where counts are known */
  RELAY_PARTIALS, /* partials of the rows from r -> r's inbox */
  RELAY_VALUES    /* values for r's tokens -> r's window (back) */
};

}  // namespace epx_fused_impl

struct epx_fused;
struct epx_fused_plan;
/* One relay step on the stream (a group of ncclSend/ncclRecv, nothing where
 * no peer is relayed); part_elem: the partials' element size. On an NCCL
 * error the state fails (error word and abort) and cudaErrorUnknown comes
 * back. */
cudaError_t epx_fused_relay_step(epx_fused *f, const epx_fused_plan *plan, epx_fused_impl::relay_kind kind,
                                 int64_t part_elem, cudaStream_t stream);
/* RELAY_ROWS into dst's rank-major rows (the window's or recv_x): straight
 * there where the plan's counts are known on the host, else through the
 * inbox and a copy. Rows of row_bytes: the dtype's, or
 * epx_fused_dispatch_rows_launch's. */
cudaError_t epx_fused_relay_rows_in(epx_fused *f, const epx_fused_plan *plan, void *dst, int64_t row_bytes,
                                    cudaStream_t stream);
/* RELAY_PARTIALS (element size pe), then each into the window's partials
 * at its token. */
cudaError_t epx_fused_relay_partials_in(epx_fused *f, const epx_fused_plan *plan, int64_t pe, cudaStream_t stream);
/* At creation: the peers of `mask` are relayed; their outboxes and inboxes
 * (about max_tokens * H * 4 bytes and max_tokens * H * s each). */
epx_status_t epx_fused_relay_create(epx_fused *f, uint32_t mask, const char *fn);
void epx_fused_relay_free(epx_fused *f);
/* An NCCL call's result waited out on a nonblocking comm (an ncclComm_t),
 * at most `seconds` (fused/dispatch.cu). */
epx_status_t epx_fused_nccl_settle(void *comm, int result, double seconds, const char *fn, const char *what);

/* The host-side state; the device state is `dev`, passed to every kernel. */
struct epx_fused {
  void *comm;  /* ncclComm_t, or NULL: in-process (ranks) */
  epx_fused_ranks_t ranks;    /* in-process: the comm and its transport */
  epx_cuda_window_t window;   /* in-process: this rank's window and its peers' */
  int sms;                    /* the GPU's SMs (num_sms: this rank's share of them) */
  void *win;   /* ncclWindow_t */
  void *devcomm; /* ncclDevComm (heap copy) */
  void *base;
  size_t bytes;
  epx_fused_config_t config;
  uint32_t *err_host; /* mapped */
  int num_sms;
  void *relay_memory; /* the relay blocks and inboxes (fused/relay.cu), or NULL */
  int32_t transport[EPX_FUSED_MAX_RANKS]; /* epx_fused_transport_t of each rank (setup.cu) */
  epx_fused_impl::fused_dev dev;
};

/* A launch's CTAs: num_ctas within [2, the SMs]. */
inline int epx_fused_launch_ctas(const epx_fused_t *f, int32_t num_ctas) {
  return num_ctas < 2 ? 2 : num_ctas > f->num_sms ? f->num_sms : num_ctas;
}

struct epx_fused_plan {
  epx_fused_t *fused;
  void *memory;
  epx_layout_t layout;
  /* 1: the rows between this rank and each peer are known on the host
   * (epx_fused_plan_host_counts), the relay's messages have their sizes */
  int counts_known;
  int64_t send_pairs[EPX_FUSED_MAX_RANKS], recv_pairs[EPX_FUSED_MAX_RANKS];
  epx_fused_impl::fused_plan_dev dev;
};

#endif
