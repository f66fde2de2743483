/* The fused exchange's layout (epx_fused_layout_launch): counts and routing
 * records exchanged on the GPU, three kernels on the caller's stream (no
 * host wait, no memset):
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
 * See fused.h for the contract and fused/impl.cuh for the window. */
#include <cuda_runtime.h>

#include "cuda/common/pdl.cuh"
#include "cuda/fused/impl.cuh"

using namespace epx_fused_impl;

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
 * by __match_any_sync, their writes of pos coalesced: the last count block
 * starts earlier than with 32 steps of a lane per slot k)
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
 * runs of experts (serial walks over the E_local experts were a measurable
 * part of the layout: bench/NOTES-gpu.md). */
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
   * one ahead ends and wait for its memory, not after it (the receive kernel
   * begins sooner). Only the records kernel lets the next
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
