/* The layout of a dispatch on one GPU: per-expert counts, padded prefix sums,
 * the recv row of every route (every token for rank-major), and the routing's
 * validation — a chunked counting sort, not a one-hot. Two kernels:
 *
 *   rank:   a block per chunk of consecutive tokens, a warp per run of the
 *           chunk's tokens. Each warp stages its routes in shared memory,
 *           validates them, and walks them in (token, slot) order 32 at a
 *           time; __match_any_sync groups the lanes of one expert, so a
 *           route's rank among its expert's routes in the warp is a running
 *           shared-memory counter plus a popcount. The block then turns the
 *           warps' counters into per-warp bases (a prefix over warps per
 *           expert) and adds them, so each route holds its rank in the chunk.
 *           Writes the sanitised ids, per-chunk counts [chunks, E + 1]
 *           (column E: tokens with a route, for rank-major), the chunk's first
 *           error, and copies the weights. Capacity: claims each route's slot
 *           (atomicMin: the smallest route wins).
 *   assign: a block per chunk sums the counts of the chunks before it (its
 *           base) and of all chunks (the totals), scans the padded totals
 *           into offsets (every block the same; block 0 writes them and N),
 *           and writes row = offset + base + rank and row_src.
 *
 * At most kMaxChunks chunks, and each warp walks at least kWarpRoutes routes
 * in blocks of up to 8 warps (expert-major with EPX_CUDA_LAYOUT_NARROW:
 * kNarrowRoutes in blocks of up to 16, half the rounds per warp).
 * Bytes: the routing read once (4*T*K, + 4*T*K locations, + 8*T*K weights
 * copied), ids and rows written (8*T*K), re-read and rewritten (16*T*K),
 * row_src written (4*N), the counts 4*chunks*(E+1)*(1 + chunks): about 3 MB
 * at T=8192, K=8, E=256 — the cost is the two launches' latency. */
#include <cuda_runtime.h>

#include "core/align.h"
#include "cuda/common/device_cache.h"
#include "cuda/launch.h"
#include "cuda/common/pdl.cuh"

namespace {

constexpr int kMaxRankWarps = 16;  /* warps per rank block (one chunk), at most (narrow) */
constexpr int kWarpRoutes = 128;   /* routes a warp walks, at least (4 rounds) */
constexpr int kNarrowWarps = 16;   /* EPX_CUDA_LAYOUT_NARROW: up to 16 warps of 64 routes */
constexpr int kNarrowRoutes = 64;
constexpr int kStageRoutes = 512;  /* routes staged per warp at a time */
constexpr int kAssignThreads = 512;
constexpr int kThreads = 256;      /* accessor blocks */
constexpr int64_t kMaxChunks = 64;
constexpr int kBatch = 8;          /* routes a thread loads before it stores */
constexpr int kSumBatch = 64;      /* chunk counts a thread loads at a time: all */

/* Scratch: per chunk its first error, then its counts. */
struct scratch_view {
  unsigned long long *chunk_error; /* [chunks] */
  int32_t *chunk_counts;           /* [chunks, E + 1] */
};

scratch_view view_scratch(void *scratch) {
  char *p = static_cast<char *>(scratch);
  return {reinterpret_cast<unsigned long long *>(p),
          reinterpret_cast<int32_t *>(p + epx_round256(8 * (size_t)kMaxChunks))};
}

/* Shared memory of one rank warp: E counters, staged ids, and locations
 * (capacity) or each route's expert and rank in the warp (expert-major). */
size_t rank_warp_bytes(int32_t E, epx_layout_t layout) {
  return 4 * (size_t)E + 4 * (size_t)kStageRoutes * (layout == EPX_LAYOUT_RANK_MAJOR ? 1 : 2);
}

/* Expert-major, a warp whose routes fit one staging: each route's expert
 * and rank in the warp, packed (E <= 8192 fits 13 bits), -1 for none. */
constexpr int kPackShift = 13;

__device__ __forceinline__ unsigned long long warp_min_u64(unsigned long long v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    unsigned long long o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o < v ? o : v;
  }
  return v;
}

struct rank_args {
  const int32_t *topk_idx; /* [T, K] the caller's */
  const int32_t *locations;/* [T, K] the caller's (capacity) */
  const float *w_in;       /* [T, K] the caller's weights or NULL */
  float *w_out;            /* [T, K] their copy */
  int64_t T;
  int K, E, layout, C;
  int64_t warp_tokens, chunk_tokens, chunks;
  epx_cuda_layout_t out;
  unsigned long long *chunk_error;
  int32_t *chunk_counts;
  int pdl_early; /* let the next kernel launch once this one runs (pdl.cuh) */
};

/* A warp's segment of n routes from seg into shared memory (ids, and
 * locations for capacity), and the weights' copy: every load of a batch
 * issued before any store, so the segment costs one or two L2 round trips
 * rather than one per 32 routes. */
__device__ __forceinline__ void stage_routes(const rank_args &a, int64_t seg, int n, int lane,
                                             bool capacity, int32_t *s_idx, int32_t *s_loc) {
  for (int j0 = 0; j0 < n; j0 += 32 * kBatch) {
    int iv[kBatch], lv[kBatch];
    float wv[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; u++) {
      const int j = j0 + u * 32 + lane;
      const bool in = j < n;
      iv[u] = in ? a.topk_idx[seg + j] : 0;
      lv[u] = in && capacity ? a.locations[seg + j] : 0;
      wv[u] = in && a.w_in ? a.w_in[seg + j] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; u++) {
      const int j = j0 + u * 32 + lane;
      if (j < n) {
        s_idx[j] = iv[u];
        if (capacity) s_loc[j] = lv[u];
        if (a.w_in) a.w_out[seg + j] = wv[u];
      }
    }
  }
}

__global__ void __launch_bounds__(kMaxRankWarps * 32) layout_rank_kernel(const rank_args a) {
  extern __shared__ int32_t s_mem[]; /* [warps][E] counters, then [warps] staging */
  __shared__ int32_t s_active[kMaxRankWarps];
  __shared__ unsigned long long s_error[kMaxRankWarps];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool capacity = a.layout == EPX_LAYOUT_CAPACITY, rank_major = a.layout == EPX_LAYOUT_RANK_MAJOR;
  const int K = a.K, E = a.E;
  pdl_begin(a.pdl_early);
  /* the assign kernel accumulates counts and errors into these */
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) a.out.counts[e] = 0;
    if (threadIdx.x == 0) a.out.result->error = EPX_CUDA_NO_ERROR;
  }
  const int64_t chunk = blockIdx.x;
  if (chunk >= a.chunks) return;
  int32_t *count = s_mem + (size_t)warp * E;
  int32_t *s_idx = s_mem + (size_t)warps * E + (size_t)warp * kStageRoutes * (rank_major ? 1 : 2);
  int32_t *s_loc = s_idx + kStageRoutes; /* capacity: locations; expert-major: packed ranks */
  for (int e = lane; e < E; e += 32) count[e] = 0;

  const unsigned int lanes_below = (1u << lane) - 1u;
  const int64_t tw0 = chunk * a.chunk_tokens + warp * a.warp_tokens;
  const int64_t tw1 = min(a.T, tw0 + a.warp_tokens);
  const int64_t seg_routes = (int64_t)(kStageRoutes / K) * K; /* segments start at tokens */
  /* One segment: the ranks stay in shared memory until the warps' bases are
   * known (no global write and re-read of route_row). */
  const bool packed = !capacity && !rank_major && (tw1 - tw0) * K <= seg_routes;
  unsigned long long error = EPX_CUDA_NO_ERROR;
  for (int64_t seg = tw0 * K; seg < tw1 * K; seg += seg_routes) {
    const int n = (int)min(seg_routes, tw1 * K - seg);
    __syncwarp();
    stage_routes(a, seg, n, lane, capacity, s_idx, s_loc);
    __syncwarp();
    for (int base = 0; base < n; base += 32) {
      const int j = base + lane;
      const int64_t g = seg + j;
      int e = -1, slot = -1;
      if (j < n) {
        const int raw = s_idx[j];
        int code = 0;
        if (raw < -1 || raw >= E) {
          code = EPX_CUDA_BAD_EXPERT;
        } else if (raw >= 0) {
          const int k = j % K; /* segments start at tokens */
          for (int i = 1; i <= k; i++)
            if (s_idx[j - i] == raw) code = EPX_CUDA_DUPLICATE_EXPERT;
          if (!code && capacity) {
            const int l = s_loc[j];
            if (l < 0 || l >= a.C) {
              code = EPX_CUDA_BAD_LOCATION;
            } else {
              slot = raw * a.C + l;
              atomicMin(reinterpret_cast<unsigned int *>(&a.out.row_src[slot]), (unsigned int)g);
            }
          }
        }
        if (code) {
          const unsigned long long mine = ((unsigned long long)g << 3) | (unsigned long long)code;
          error = mine < error ? mine : error;
        } else {
          e = raw;
        }
        a.out.idx[g] = e;
      }
      /* Lanes are routes in (token, slot) order and a token names an expert
       * at most once, so the rank among the expert's lanes is token order. */
      const unsigned int peers = __match_any_sync(0xffffffffu, e);
      const int before = e >= 0 ? count[e] : 0;
      __syncwarp();
      if (e >= 0 && lane == 31 - __clz(peers)) count[e] = before + __popc(peers);
      const int rank = before + __popc(peers & lanes_below);
      if (j < n && packed)
        s_loc[j] = e < 0 ? -1 : (rank << kPackShift) | e;
      else if (j < n && !rank_major)
        a.out.route_row[g] = e < 0 ? -1 : capacity ? slot : rank;
      __syncwarp();
    }
  }

  int active = 0;
  if (rank_major) {
    /* A row per token with a valid route: rank among such tokens of the warp. */
    for (int64_t tb = tw0; tb < tw1; tb += 32) {
      const int64_t t = tb + lane;
      bool any = false;
      if (t < tw1)
        for (int k = 0; k < K; k++) any |= a.out.idx[t * K + k] >= 0;
      const unsigned int mask = __ballot_sync(0xffffffffu, any);
      if (t < tw1) a.out.token_row[t] = any ? active + __popc(mask & lanes_below) : -1;
      active += __popc(mask);
    }
  }
  error = warp_min_u64(error);
  if (lane == 0) {
    s_active[warp] = active;
    s_error[warp] = error;
  }
  __syncthreads();

  /* Per-warp bases: an exclusive prefix over the warps, per expert; the
   * totals are the chunk's counts. */
  int32_t *out = a.chunk_counts + chunk * (E + 1);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int v[kMaxRankWarps]; /* every load before the stores (one shared-memory round trip) */
#pragma unroll
    for (int w = 0; w < kMaxRankWarps; w++) v[w] = w < warps ? s_mem[(size_t)w * E + e] : 0;
    int run = 0;
#pragma unroll
    for (int w = 0; w < kMaxRankWarps; w++) {
      if (w < warps) s_mem[(size_t)w * E + e] = run;
      run += v[w];
    }
    out[e] = run;
  }
  if (threadIdx.x == blockDim.x - 1) {
    int v[kMaxRankWarps];
    unsigned long long first = EPX_CUDA_NO_ERROR;
#pragma unroll
    for (int w = 0; w < kMaxRankWarps; w++) {
      v[w] = w < warps ? s_active[w] : 0;
      const unsigned long long ew = w < warps ? s_error[w] : EPX_CUDA_NO_ERROR;
      first = ew < first ? ew : first;
    }
    int run = 0;
#pragma unroll
    for (int w = 0; w < kMaxRankWarps; w++) {
      if (w < warps) s_active[w] = run;
      run += v[w];
    }
    out[E] = run;
    a.chunk_error[chunk] = first;
  }
  __syncthreads();

  /* Ranks in the warp -> ranks in the chunk (capacity slots are final). */
  if (rank_major) {
    for (int64_t t = tw0 + lane; t < tw1; t += 32) {
      const int r = a.out.token_row[t];
      if (r >= 0) a.out.token_row[t] = r + s_active[warp];
    }
  } else if (packed) {
    for (int64_t j = lane; j < (tw1 - tw0) * K; j += 32) {
      const int v = s_loc[j];
      a.out.route_row[tw0 * K + j] = v < 0 ? -1 : (v >> kPackShift) + count[v & ((1 << kPackShift) - 1)];
    }
  } else if (!capacity) {
    /* All of a batch's loads before any store (the stores could alias the
     * loads, so a plain loop waits one L2 round trip per iteration). */
    for (int64_t g0 = tw0 * K; g0 < tw1 * K; g0 += 32 * kBatch) {
      int ev[kBatch], rv[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; u++) {
        const int64_t g = g0 + u * 32 + lane;
        ev[u] = g < tw1 * K ? a.out.idx[g] : -1;
        rv[u] = g < tw1 * K ? a.out.route_row[g] : 0;
      }
#pragma unroll
      for (int u = 0; u < kBatch; u++)
        if (ev[u] >= 0) a.out.route_row[g0 + u * 32 + lane] = rv[u] + count[ev[u]];
    }
  }
}

struct assign_args {
  int64_t T;
  int K, E, layout, alignment, C;
  int64_t chunk_tokens, chunks;
  epx_cuda_layout_t out;
  const unsigned long long *chunk_error;
  const int32_t *chunk_counts;
  int pdl_early;
};

/* A thread's batch of routes (expert-major or capacity): route g0 + u *
 * blockDim.x + threadIdx.x in slot u. Loaded before it is used (the first
 * batch before the column sums, so that its round trip overlaps theirs). */
struct route_batch {
  int e[kBatch], row[kBatch];
};

__device__ __forceinline__ void load_batch(const assign_args &a, int64_t g0, int64_t g_end,
                                           route_batch &b) {
#pragma unroll
  for (int u = 0; u < kBatch; u++) {
    const int64_t g = g0 + (int64_t)u * blockDim.x + threadIdx.x;
    b.e[u] = g < g_end ? a.out.idx[g] : -1;
    b.row[u] = g < g_end ? a.out.route_row[g] : -1;
  }
}

/* A loaded batch's rows (expert-major) or slot verdicts (capacity); every
 * load before any store. Returns the batch's first capacity loser. */
__device__ __forceinline__ unsigned long long finish_batch(const assign_args &a, int64_t g0,
                                                           const route_batch &b,
                                                           const int32_t *s_off,
                                                           const int32_t *s_base) {
  const bool expert_major = a.layout == EPX_LAYOUT_EXPERT_MAJOR;
  unsigned long long error = EPX_CUDA_NO_ERROR;
  int owner[kBatch];
  if (!expert_major) {
    /* capacity: each valid route's slot owner (the smallest claimant) */
#pragma unroll
    for (int u = 0; u < kBatch; u++) owner[u] = b.e[u] >= 0 ? a.out.row_src[b.row[u]] : 0;
  }
#pragma unroll
  for (int u = 0; u < kBatch; u++) {
    const int64_t g = g0 + (int64_t)u * blockDim.x + threadIdx.x;
    const int e = b.e[u];
    if (e < 0) continue;
    if (expert_major) {
      const int row = s_off[e] + s_base[e] + b.row[u];
      a.out.route_row[g] = row;
      a.out.row_src[row] = (int32_t)g;
    } else if (owner[u] != (int32_t)g) {
      /* capacity: the slot went to a smaller route */
      a.out.idx[g] = -1;
      a.out.route_row[g] = -1;
      atomicAdd(reinterpret_cast<unsigned long long *>(&a.out.counts[e]), ~0ull);
      const unsigned long long mine = ((unsigned long long)g << 3) | EPX_CUDA_TAKEN_LOCATION;
      error = mine < error ? mine : error;
    }
  }
  return error;
}

/* Per column of the chunk counts [chunks, cols] (a thread each): base,
 * the sum over the chunks before chunk `me`; total, over all; own, chunk
 * me's (0 past the last chunk). kSumBatch loads in flight at a time. The
 * indices are 32-bit (chunks * cols < 2^31, asserted below): with 64-bit
 * ones the index arithmetic was most of the assign kernel's instructions. */
__device__ __forceinline__ void column_sums(const int32_t *__restrict__ counts, int chunks,
                                            int cols, int me, int tid, int threads,
                                            int32_t *s_base, int32_t *s_total, int32_t *s_own) {
  for (int col = tid; col < cols; col += threads) {
    const int32_t *row = counts + col; /* chunk c0's count of col */
    const int own = me < chunks ? row[(unsigned)(me * cols)] : 0;
    int base = 0, total = 0;
    for (int c0 = 0; c0 < chunks; c0 += kSumBatch) {
      const int n = min(kSumBatch, chunks - c0), below = me - c0;
      int v[kSumBatch];
#pragma unroll
      for (int u = 0; u < kSumBatch; u++) {
        v[u] = u < n ? row[0] : 0;
        row += u < n ? cols : 0; /* never past the last chunk */
      }
#pragma unroll
      for (int u = 0; u < kSumBatch; u++) {
        total += v[u];
        if (u < below) base += v[u];
      }
    }
    s_base[col] = base;
    s_total[col] = total;
    s_own[col] = own;
  }
}
static_assert(kMaxChunks * (EPX_CUDA_MAX_EXPERTS + 1) < 2147483647LL,
              "column_sums' 32-bit indices overflow");

/* Block b: chunk b (a block past the last chunk only writes the offsets when
 * there are no tokens). Shared: base, total, offset per column. */
__global__ void __launch_bounds__(kAssignThreads) layout_assign_kernel(const assign_args a) {
  extern __shared__ int32_t s_mem[];
  const int E = a.E, cols = a.E + 1;
  int32_t *s_base = s_mem, *s_total = s_mem + cols, *s_off = s_mem + 2 * cols, *s_own = s_mem + 3 * cols;
  __shared__ int32_t s_scan[kAssignThreads / 32];
  __shared__ unsigned long long s_error[kAssignThreads / 32];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  pdl_begin(a.pdl_early);
  const int64_t chunk = blockIdx.x;
  const bool routes = chunk < a.chunks && a.layout != EPX_LAYOUT_RANK_MAJOR;
  const int64_t g_begin = chunk * a.chunk_tokens * a.K;
  const int64_t g_end = min(a.T, (chunk + 1) * a.chunk_tokens) * a.K;
  route_batch first;
  if (routes) load_batch(a, g_begin, g_end, first);
  column_sums(a.chunk_counts, (int)a.chunks, cols, (int)chunk, tid, blockDim.x, s_base, s_total,
              s_own);
  __syncthreads();

  /* Offsets: expert-major scans the padded totals (a thread per run of
   * experts, then the block); capacity e*C; rank-major all 0 but the last. */
  const int seg = (E + kAssignThreads - 1) / kAssignThreads;
  const int e0 = min(E, tid * seg), e1 = min(E, e0 + seg);
  int local = 0;
  if (a.layout == EPX_LAYOUT_EXPERT_MAJOR)
    for (int e = e0; e < e1; e++) local += (s_total[e] + a.alignment - 1) / a.alignment * a.alignment;
  int inclusive = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += o;
  }
  if (lane == 31) s_scan[warp] = inclusive;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kAssignThreads / 32; w++) {
    if (w < warp) before += s_scan[w];
    all += s_scan[w];
  }
  int offset = before + inclusive - local;
  for (int e = e0; e < e1; e++) {
    if (a.layout == EPX_LAYOUT_EXPERT_MAJOR) {
      s_off[e] = offset;
      offset += (s_total[e] + a.alignment - 1) / a.alignment * a.alignment;
    } else {
      s_off[e] = a.layout == EPX_LAYOUT_CAPACITY ? e * a.C : 0;
    }
  }
  const int rows = a.layout == EPX_LAYOUT_EXPERT_MAJOR ? all : a.layout == EPX_LAYOUT_CAPACITY ? E * a.C : s_total[E];
  if (tid == 0) s_off[E] = rows;
  __syncthreads();
  if (chunk == 0) {
    for (int e = tid; e <= E; e += blockDim.x) a.out.offsets[e] = s_off[e];
    if (tid == 0) a.out.result->rows = rows;
  }

  unsigned long long error = EPX_CUDA_NO_ERROR;
  if (chunk < a.chunks) {
    const int64_t t0 = chunk * a.chunk_tokens, t1 = min(a.T, t0 + a.chunk_tokens);
    if (a.layout == EPX_LAYOUT_RANK_MAJOR) {
      for (int64_t t = t0 + tid; t < t1; t += blockDim.x) {
        const int r = a.out.token_row[t];
        if (r >= 0) {
          const int row = s_base[E] + r;
          a.out.token_row[t] = row;
          a.out.row_src[row] = (int32_t)t;
        }
      }
    } else {
      error = finish_batch(a, g_begin, first, s_off, s_base);
      for (int64_t g0 = g_begin + (int64_t)blockDim.x * kBatch; g0 < g_end; g0 += (int64_t)blockDim.x * kBatch) {
        route_batch b;
        load_batch(a, g0, g_end, b);
        const unsigned long long more = finish_batch(a, g0, b, s_off, s_base);
        error = more < error ? more : error;
      }
    }
    /* this chunk's routes per expert (capacity losers subtracted above) */
    for (int e = tid; e < E; e += blockDim.x) {
      const int v = s_own[e];
      if (v) atomicAdd(reinterpret_cast<unsigned long long *>(&a.out.counts[e]), (unsigned long long)v);
    }
    if (tid == 0) error = a.chunk_error[chunk] < error ? a.chunk_error[chunk] : error;
  }
  /* expert-major padding rows of the experts of this block */
  if (a.layout == EPX_LAYOUT_EXPERT_MAJOR)
    for (int e = (int)chunk; e < E; e += gridDim.x)
      for (int r = s_off[e] + s_total[e] + tid; r < s_off[e + 1]; r += blockDim.x) a.out.row_src[r] = -1;

  error = warp_min_u64(error);
  if (lane == 0) s_error[warp] = error;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kAssignThreads / 32; w++) error = s_error[w] < error ? s_error[w] : error;
    error = s_error[0] < error ? s_error[0] : error;
    if (error != EPX_CUDA_NO_ERROR)
      atomicMin(reinterpret_cast<unsigned long long *>(&a.out.result->error), error);
  }
}

__global__ void __launch_bounds__(kThreads)
    recv_routing_kernel(int layout, const int32_t *__restrict__ row_src,
                        const int32_t *__restrict__ idx, const float *__restrict__ w, int K,
                        int K_src, int expert_base, const int64_t *rows_valid, int64_t row_bound,
                        int32_t *recv_expert, float *recv_w) {
  const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= min(*rows_valid, row_bound)) return;
  const int32_t src = row_src[r];
  if (layout == EPX_LAYOUT_RANK_MAJOR) {
    for (int k = 0; k < K; k++) {
      const int e = src >= 0 ? idx[(int64_t)src * K_src + k] : -1;
      if (recv_expert) recv_expert[r * K + k] = e >= 0 ? e + expert_base : -1;
      if (recv_w) recv_w[r * K + k] = e >= 0 && w ? w[(int64_t)src * K_src + k] : 0.0f;
    }
  } else {
    const int e = src >= 0 ? idx[src] : -1;
    if (recv_expert) recv_expert[r] = e >= 0 ? e + expert_base : -1;
    if (recv_w) recv_w[r] = e >= 0 && w ? w[src] : 0.0f;
  }
}

/* block_tokens: tokens per source rank in the layout's token numbering
 * (token g of the layout is token g % block_tokens of rank g / block_tokens). */
__global__ void __launch_bounds__(kThreads)
    recv_source_kernel(int layout, const int32_t *__restrict__ row_src, int K, int64_t block_tokens,
                       const int64_t *rows_valid, int64_t row_bound, int32_t *src_rank,
                       int32_t *src_token) {
  const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= min(*rows_valid, row_bound)) return;
  const int32_t src = row_src[r];
  const int64_t g = src < 0 ? -1 : layout == EPX_LAYOUT_RANK_MAJOR ? src : src / K;
  if (src_rank) src_rank[r] = g < 0 ? -1 : (int32_t)(g / block_tokens);
  if (src_token) src_token[r] = g < 0 ? -1 : (int32_t)(g % block_tokens);
}

}  // namespace

extern "C" size_t epx_cuda_layout_scratch_bytes(int64_t num_tokens, int32_t num_experts) {
  (void)num_tokens; /* at most kMaxChunks chunks whatever T */
  return epx_round256(8 * (size_t)kMaxChunks) + 4 * (size_t)kMaxChunks * ((size_t)num_experts + 1);
}

extern "C" cudaError_t epx_cuda_layout_launch(const int32_t *topk_idx, const int32_t *locations,
                                              const float *topk_w, float *w_copy, int64_t T,
                                              int32_t K, int32_t E, epx_layout_t layout,
                                              int32_t alignment, int32_t capacity,
                                              const epx_cuda_layout_t *out, void *scratch,
                                              cudaStream_t stream) {
  if (E < 1 || E > EPX_CUDA_MAX_EXPERTS || K < 1 || T * K >= INT32_MAX) return cudaErrorInvalidValue;
  const bool cap = layout == EPX_LAYOUT_CAPACITY;
  const scratch_view s = view_scratch(scratch);
  cudaError_t err;

  /* Chunks: a block of `warps` warps each, a warp at least kWarpRoutes
   * routes (kNarrowRoutes with EPX_CUDA_LAYOUT_NARROW), at most kMaxChunks
   * chunks. */
  const int flags = epx_cuda_launch_flags();
  const bool narrow = (flags & EPX_CUDA_LAYOUT_NARROW) != 0 && layout == EPX_LAYOUT_EXPERT_MAJOR;
  int dev = 0;
  epx_cuda_device_info_t info;
  err = epx_cuda_device_info(&dev, &info);
  if (err != cudaSuccess) return err;
  const int smem_sm = info.smem_per_sm, smem_optin = info.smem_optin, sms = info.sms;
  const size_t warp_bytes = rank_warp_bytes(E, layout);
  const size_t budget = narrow ? (size_t)smem_optin - 1024 : 47 * 1024; /* 1 KB for the static shared memory */
  int warps = (int)(budget / warp_bytes);
  const int max_warps = narrow ? kNarrowWarps : 8;
  warps = warps < 1 ? 1 : warps > max_warps ? max_warps : warps;
  int64_t warp_tokens = ((narrow ? kNarrowRoutes : kWarpRoutes) + K - 1) / K;
  const int64_t spread = (T + (int64_t)warps * kMaxChunks - 1) / ((int64_t)warps * kMaxChunks);
  if (spread > warp_tokens) warp_tokens = spread;
  const int64_t chunk_tokens = warp_tokens * warps;
  const int64_t chunks = (T + chunk_tokens - 1) / chunk_tokens;

  /* Capacity: every slot unclaimed (0xffffffff = -1 = empty) before the rank
   * kernel claims them. */
  if (cap) {
    err = cudaMemsetAsync(out->row_src, 0xff, sizeof(int32_t) * (size_t)E * (size_t)capacity, stream);
    if (err != cudaSuccess) return err;
  }
  rank_args ra;
  ra.topk_idx = topk_idx;
  ra.locations = locations;
  ra.w_in = topk_w;
  ra.w_out = w_copy;
  ra.T = T;
  ra.K = K;
  ra.E = E;
  ra.layout = layout;
  ra.C = capacity;
  ra.warp_tokens = warp_tokens;
  ra.chunk_tokens = chunk_tokens;
  ra.chunks = chunks;
  ra.out = *out;
  ra.chunk_error = s.chunk_error;
  ra.chunk_counts = s.chunk_counts;
  ra.pdl_early = (flags & EPX_CUDA_PDL_LAYOUT_EARLY) != 0;
  /* EPX_CUDA_RANK_ALONE: half an SM's shared memory, so that two rank
   * blocks never share an SM (launched early, next to the last blocks of a
   * routing kernel, they would pile onto the SMs that empty first); only
   * where every chunk still has an SM of its own. */
  size_t rank_bytes = warp_bytes * warps;
  if ((flags & EPX_CUDA_RANK_ALONE) && chunks <= sms && (size_t)smem_sm / 2 > rank_bytes &&
      (size_t)smem_sm / 2 <= (size_t)smem_optin)
    rank_bytes = (size_t)smem_sm / 2;
  if (rank_bytes > 48 * 1024) {
    err = epx_cuda_kernel_smem((const void *)layout_rank_kernel, dev, rank_bytes);
    if (err != cudaSuccess) return err;
  }
  err = launch_pdl(layout_rank_kernel, (unsigned)(chunks > 0 ? chunks : 1), warps * 32, rank_bytes,
                   stream, ra);
  if (err != cudaSuccess) return err;

  assign_args aa;
  aa.T = T;
  aa.K = K;
  aa.E = E;
  aa.layout = layout;
  aa.alignment = alignment;
  aa.C = capacity;
  aa.chunk_tokens = chunk_tokens;
  aa.chunks = chunks;
  aa.out = *out;
  aa.chunk_error = s.chunk_error;
  aa.chunk_counts = s.chunk_counts;
  aa.pdl_early = (flags & EPX_CUDA_PDL_LAYOUT_EARLY) != 0;
  const size_t assign_bytes = 4 * sizeof(int32_t) * ((size_t)E + 1);
  if (assign_bytes > 48 * 1024) {
    /* large expert counts need the opt-in shared memory */
    err = epx_cuda_kernel_smem((const void *)layout_assign_kernel, dev, assign_bytes);
    if (err != cudaSuccess) return err;
  }
  return launch_pdl(layout_assign_kernel, (unsigned)(chunks > 0 ? chunks : 1), kAssignThreads,
                    assign_bytes, stream, aa);
}

extern "C" cudaError_t epx_cuda_recv_routing_ranks_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                                          const float *w, int32_t K, int32_t K_src,
                                                          int32_t expert_base, int64_t row_bound,
                                                          int32_t *recv_expert, float *recv_w,
                                                          cudaStream_t stream) {
  if (row_bound <= 0 || (!recv_expert && !recv_w)) return cudaSuccess;
  recv_routing_kernel<<<(unsigned)((row_bound + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      layout, lay->row_src, lay->idx, w, K, K_src, expert_base, &lay->result->rows, row_bound, recv_expert,
      recv_w);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_recv_routing_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                                    const float *w, int32_t K, int64_t row_bound,
                                                    int32_t *recv_expert, float *recv_w,
                                                    cudaStream_t stream) {
  return epx_cuda_recv_routing_ranks_launch(layout, lay, w, K, K, 0, row_bound, recv_expert, recv_w, stream);
}

extern "C" cudaError_t epx_cuda_recv_source_ranks_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                                         int32_t K, int64_t block_tokens, int64_t row_bound,
                                                         int32_t *src_rank, int32_t *src_token,
                                                         cudaStream_t stream) {
  if (row_bound <= 0 || (!src_rank && !src_token)) return cudaSuccess;
  recv_source_kernel<<<(unsigned)((row_bound + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      layout, lay->row_src, K, block_tokens, &lay->result->rows, row_bound, src_rank, src_token);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_recv_source_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                                   int32_t K, int64_t row_bound, int32_t *src_rank,
                                                   int32_t *src_token, cudaStream_t stream) {
  return epx_cuda_recv_source_ranks_launch(layout, lay, K, INT64_MAX, row_bound, src_rank, src_token, stream);
}
