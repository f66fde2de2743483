/* The layout of a dispatch on one GPU: per-expert counts, padded prefix sums,
 * the recv row of every route (every token for rank-major), and the routing's
 * validation — a chunked counting sort, not a one-hot.
 *
 * Tokens are cut into chunks of chunk_tokens consecutive tokens, one warp per
 * chunk. Three kernels:
 *   rank:   each warp walks its chunk's routes in (token, slot) order, 32 at a
 *           time; __match_any_sync groups the lanes of one expert, so a
 *           route's rank among its expert's routes in the chunk is a running
 *           shared-memory counter plus a popcount. Writes per-chunk counts
 *           [chunks, E + 1] (column E: tokens with a route, for rank-major),
 *           the chunk's first error, and validates each route.
 *   scan:   per expert column, exclusive prefix over chunks in place; the
 *           last block to finish computes counts, padded offsets and N.
 *   assign: row = offsets[e] + chunk base + rank; writes row_src.
 * Bytes: the routing is read about twice (4*T*K*2), route rows written twice
 * and read once (4*T*K*3), per-chunk counts 4*chunks*(E+1)*3; a few hundred
 * KB at T=8192, K=8 — the cost is the three launches' latency. */
#include <cuda_runtime.h>

#include "cuda/launch.h"

namespace {

constexpr int kRankWarps = 4;   /* chunks per block of the rank kernel */
constexpr int kScanWarps = 8;   /* chunk ranges per column block of the scan */
constexpr int kThreads = 256;   /* assign / accessor blocks */
constexpr int64_t kTargetChunks = 256;

/* Scratch: the scan's block counter, the rank-major total, then per chunk its
 * first error and its counts. */
struct scratch_view {
  unsigned int *ticket;           /* zero between layouts */
  long long *active_total;        /* tokens with a route (rank-major N) */
  unsigned long long *chunk_error; /* [chunks] */
  int32_t *chunk_counts;          /* [chunks, E + 1]; after the scan: chunk bases */
};

int64_t chunk_tokens_for(int64_t T) {
  int64_t per = (T + kTargetChunks - 1) / kTargetChunks;
  per = (per + 31) / 32 * 32;
  return per < 32 ? 32 : per;
}

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

scratch_view view_scratch(void *scratch, int64_t chunks) {
  char *p = static_cast<char *>(scratch);
  scratch_view v;
  v.ticket = reinterpret_cast<unsigned int *>(p);
  v.active_total = reinterpret_cast<long long *>(p + 8);
  v.chunk_error = reinterpret_cast<unsigned long long *>(p + 16);
  v.chunk_counts = reinterpret_cast<int32_t *>(p + align_up(16 + 8 * (size_t)chunks));
  return v;
}

__device__ __forceinline__ unsigned long long warp_min_u64(unsigned long long v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    unsigned long long o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o < v ? o : v;
  }
  return v;
}

/* One warp per chunk: validate, rank each route among its expert's routes in
 * the chunk, count. Capacity: claim the route's slot (smallest route wins). */
__global__ void __launch_bounds__(kRankWarps * 32)
    layout_rank_kernel(const int32_t *__restrict__ topk_idx, const int32_t *__restrict__ locations,
                       int64_t T, int K, int E, int layout, int C, int64_t chunk_tokens,
                       int64_t chunks, int32_t *idx, int32_t *route_row, int32_t *token_row,
                       unsigned int *slot_owner, unsigned long long *chunk_error,
                       int32_t *chunk_counts) {
  extern __shared__ int32_t s_count[]; /* [warps of the block][E] */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t chunk = (int64_t)blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= chunks) return;
  int32_t *count = s_count + (size_t)warp * E;
  for (int e = lane; e < E; e += 32) count[e] = 0;
  __syncwarp();

  const unsigned int lanes_below = (1u << lane) - 1u;
  const int64_t t0 = chunk * chunk_tokens, t1 = min(T, t0 + chunk_tokens);
  const int64_t g1 = t1 * K;
  unsigned long long error = EPX_CUDA_NO_ERROR;
  for (int64_t base = t0 * K; base < g1; base += 32) {
    const int64_t g = base + lane;
    int e = -1, slot = -1;
    if (g < g1) {
      const int raw = topk_idx[g];
      int code = 0;
      if (raw < -1 || raw >= E) {
        code = EPX_CUDA_BAD_EXPERT;
      } else if (raw >= 0) {
        const int64_t t = g / K;
        const int k = (int)(g - t * K);
        for (int j = 0; j < k; j++)
          if (topk_idx[t * K + j] == raw) code = EPX_CUDA_DUPLICATE_EXPERT;
        if (!code && layout == EPX_LAYOUT_CAPACITY) {
          const int l = locations[g];
          if (l < 0 || l >= C) {
            code = EPX_CUDA_BAD_LOCATION;
          } else {
            slot = raw * C + l;
            atomicMin(&slot_owner[slot], (unsigned int)g);
          }
        }
      }
      if (code) {
        const unsigned long long mine = ((unsigned long long)g << 3) | (unsigned long long)code;
        error = mine < error ? mine : error;
      } else {
        e = raw;
      }
      idx[g] = e;
    }
    /* Lanes are routes in (token, slot) order and a token names an expert at
     * most once, so the rank among the expert's lanes is token order. */
    const unsigned int peers = __match_any_sync(0xffffffffu, e);
    const int before = e >= 0 ? count[e] : 0;
    __syncwarp();
    if (e >= 0) {
      const int mates = __popc(peers);
      if (lane == 31 - __clz(peers)) count[e] = before + mates;
    }
    if (g < g1 && layout != EPX_LAYOUT_RANK_MAJOR)
      route_row[g] = e < 0 ? -1 : layout == EPX_LAYOUT_CAPACITY ? slot : before + __popc(peers & lanes_below);
    __syncwarp();
  }

  int active = 0;
  if (layout == EPX_LAYOUT_RANK_MAJOR) {
    /* A row per token with a valid route: rank among such tokens of the chunk. */
    for (int64_t tb = t0; tb < t1; tb += 32) {
      const int64_t t = tb + lane;
      bool any = false;
      if (t < t1)
        for (int k = 0; k < K; k++) any |= idx[t * K + k] >= 0;
      const unsigned int mask = __ballot_sync(0xffffffffu, any);
      if (t < t1) token_row[t] = any ? active + __popc(mask & lanes_below) : -1;
      active += __popc(mask);
    }
  }

  int32_t *out = chunk_counts + chunk * (E + 1);
  for (int e = lane; e < E; e += 32) out[e] = count[e];
  if (lane == 0) out[E] = active;
  error = warp_min_u64(error);
  if (lane == 0) chunk_error[chunk] = error;
}

/* Exclusive scan of a block's values (one per thread, blockDim == kThreads). */
__device__ long long block_exclusive_scan(long long v, long long *total) {
  __shared__ long long s_warp[kThreads / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  long long inclusive = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    long long o = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += o;
  }
  if (lane == 31) s_warp[warp] = inclusive;
  __syncthreads();
  long long before = 0, all = 0;
  for (int w = 0; w < kThreads / 32; w++) {
    if (w < warp) before += s_warp[w];
    all += s_warp[w];
  }
  *total = all;
  return before + inclusive - v;
}

/* Block b scans columns [32b, 32b + 32) of the chunk counts: lane = column,
 * warp = a range of chunks. The last block to finish writes the offsets. */
__global__ void __launch_bounds__(kScanWarps * 32)
    layout_scan_kernel(int64_t chunks, int E, int layout, int alignment, int C,
                       int32_t *chunk_counts, const unsigned long long *chunk_error,
                       unsigned int *ticket, long long *active_total, int64_t *counts,
                       int64_t *offsets, epx_cuda_layout_result_t *result) {
  __shared__ int s_part[kScanWarps][32];
  __shared__ bool s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col = blockIdx.x * 32 + lane;
  const bool valid = col <= E;
  const int64_t per = (chunks + kScanWarps - 1) / kScanWarps;
  const int64_t c0 = warp * per, c1 = min(chunks, c0 + per);
  int sum = 0;
  if (valid)
    for (int64_t c = c0; c < c1; c++) sum += chunk_counts[c * (E + 1) + col];
  s_part[warp][lane] = sum;
  __syncthreads();
  int run = 0, total = 0;
  for (int w = 0; w < kScanWarps; w++) {
    if (w < warp) run += s_part[w][lane];
    total += s_part[w][lane];
  }
  if (valid) {
    for (int64_t c = c0; c < c1; c++) {
      int32_t *p = &chunk_counts[c * (E + 1) + col];
      const int v = *p;
      *p = run;
      run += v;
    }
    if (warp == 0) {
      if (col < E) counts[col] = total;
      else *active_total = total;
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  /* Last block (blockDim == kThreads): the first error, offsets and N. */
  __shared__ unsigned long long s_error[kScanWarps];
  unsigned long long error = EPX_CUDA_NO_ERROR;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    const unsigned long long v = __ldcg(&chunk_error[c]);
    error = v < error ? v : error;
  }
  error = warp_min_u64(error);
  if (lane == 0) s_error[warp] = error;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kScanWarps; w++) error = s_error[w] < error ? s_error[w] : error;
    result->error = error;
  }

  long long rows = 0;
  if (layout == EPX_LAYOUT_EXPERT_MAJOR) {
    /* Each thread a contiguous run of experts; padded counts scanned. */
    const int seg = (E + kThreads - 1) / kThreads;
    const int e0 = min(E, (int)threadIdx.x * seg), e1 = min(E, e0 + seg);
    long long local = 0;
    for (int e = e0; e < e1; e++) {
      const long long n = __ldcg(&counts[e]);
      local += (n + alignment - 1) / alignment * alignment;
    }
    long long offset = block_exclusive_scan(local, &rows);
    for (int e = e0; e < e1; e++) {
      offsets[e] = offset;
      const long long n = __ldcg(&counts[e]);
      offset += (n + alignment - 1) / alignment * alignment;
    }
  } else if (layout == EPX_LAYOUT_CAPACITY) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) offsets[e] = (int64_t)e * C;
    rows = (long long)E * C;
  } else {
    for (int e = threadIdx.x; e < E; e += blockDim.x) offsets[e] = 0;
    rows = __ldcg(active_total);
  }
  if (threadIdx.x == 0) {
    offsets[E] = rows;
    result->rows = rows;
    *ticket = 0;
  }
}

/* A thread per route (expert-major, capacity) or token (rank-major); the
 * first E threads also mark their expert's padding rows (expert-major). */
__global__ void __launch_bounds__(kThreads)
    layout_assign_kernel(int64_t T, int K, int E, int layout, int64_t chunk_tokens,
                         const int32_t *__restrict__ chunk_base, const int64_t *offsets,
                         int64_t *counts, int32_t *idx, int32_t *route_row, int32_t *token_row,
                         int32_t *row_src, epx_cuda_layout_result_t *result) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (layout == EPX_LAYOUT_EXPERT_MAJOR) {
    if (i < T * K) {
      const int e = idx[i];
      if (e >= 0) {
        const int64_t chunk = i / K / chunk_tokens;
        const int64_t row = offsets[e] + chunk_base[chunk * (E + 1) + e] + route_row[i];
        route_row[i] = (int32_t)row;
        row_src[row] = (int32_t)i;
      }
    }
    if (i < E)
      for (int64_t r = offsets[i] + counts[i]; r < offsets[i + 1]; r++) row_src[r] = -1;
  } else if (layout == EPX_LAYOUT_CAPACITY) {
    if (i < T * K) {
      const int e = idx[i];
      /* slot_owner (row_src) holds the smallest route that claimed the slot */
      if (e >= 0 && row_src[route_row[i]] != (int32_t)i) {
        idx[i] = -1;
        route_row[i] = -1;
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[e]), ~0ull);
        atomicMin(reinterpret_cast<unsigned long long *>(&result->error),
                  ((unsigned long long)i << 3) | EPX_CUDA_TAKEN_LOCATION);
      }
    }
  } else if (i < T) {
    const int r = token_row[i];
    if (r >= 0) {
      const int64_t row = chunk_base[(i / chunk_tokens) * (E + 1) + E] + r;
      token_row[i] = (int32_t)row;
      row_src[row] = (int32_t)i;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    recv_routing_kernel(int layout, const int32_t *__restrict__ row_src,
                        const int32_t *__restrict__ idx, const float *__restrict__ w, int K,
                        const int64_t *rows_valid, int64_t row_bound, int32_t *recv_expert,
                        float *recv_w) {
  const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= min(*rows_valid, row_bound)) return;
  const int32_t src = row_src[r];
  if (layout == EPX_LAYOUT_RANK_MAJOR) {
    for (int k = 0; k < K; k++) {
      const int e = src >= 0 ? idx[(int64_t)src * K + k] : -1;
      if (recv_expert) recv_expert[r * K + k] = e;
      if (recv_w) recv_w[r * K + k] = e >= 0 && w ? w[(int64_t)src * K + k] : 0.0f;
    }
  } else {
    const int e = src >= 0 ? idx[src] : -1;
    if (recv_expert) recv_expert[r] = e;
    if (recv_w) recv_w[r] = e >= 0 && w ? w[src] : 0.0f;
  }
}

__global__ void __launch_bounds__(kThreads)
    recv_source_kernel(int layout, const int32_t *__restrict__ row_src, int K,
                       const int64_t *rows_valid, int64_t row_bound, int32_t *src_rank,
                       int32_t *src_token) {
  const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= min(*rows_valid, row_bound)) return;
  const int32_t src = row_src[r];
  if (src_rank) src_rank[r] = src >= 0 ? 0 : -1;
  if (src_token) src_token[r] = src < 0 ? -1 : layout == EPX_LAYOUT_RANK_MAJOR ? src : src / K;
}

}  // namespace

extern "C" size_t epx_cuda_layout_scratch_bytes(int64_t num_tokens, int32_t num_experts) {
  const int64_t chunks = (num_tokens + chunk_tokens_for(num_tokens) - 1) / chunk_tokens_for(num_tokens);
  return align_up(16 + 8 * (size_t)chunks) + 4 * (size_t)(chunks > 0 ? chunks : 1) * ((size_t)num_experts + 1);
}

extern "C" cudaError_t epx_cuda_layout_launch(const int32_t *topk_idx, const int32_t *locations,
                                              int64_t T, int32_t K, int32_t E, epx_layout_t layout,
                                              int32_t alignment, int32_t capacity,
                                              const epx_cuda_layout_t *out, void *scratch,
                                              cudaStream_t stream) {
  if (E > EPX_CUDA_MAX_EXPERTS || T * K >= INT32_MAX) return cudaErrorInvalidValue;
  const int64_t chunk_tokens = chunk_tokens_for(T);
  const int64_t chunks = (T + chunk_tokens - 1) / chunk_tokens;
  const scratch_view s = view_scratch(scratch, chunks);
  cudaError_t err;

  /* Capacity: every slot unclaimed (0xffffffff = -1 = empty) before the rank
   * kernel claims them. */
  if (layout == EPX_LAYOUT_CAPACITY) {
    err = cudaMemsetAsync(out->row_src, 0xff, sizeof(int32_t) * (size_t)E * (size_t)capacity, stream);
    if (err != cudaSuccess) return err;
  }
  if (chunks > 0) {
    /* A counter table of E ints per warp; large E gets one warp per block
     * and the opt-in shared memory. */
    const int warps = sizeof(int32_t) * (size_t)E * kRankWarps > 48 * 1024 ? 1 : kRankWarps;
    const size_t shared = sizeof(int32_t) * (size_t)E * warps;
    if (shared > 48 * 1024) {
      err = cudaFuncSetAttribute(layout_rank_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)shared);
      if (err != cudaSuccess) return err;
    }
    layout_rank_kernel<<<(unsigned)((chunks + warps - 1) / warps), warps * 32, shared, stream>>>(
        topk_idx, locations, T, K, E, layout, capacity, chunk_tokens, chunks, out->idx,
        out->route_row, out->token_row, reinterpret_cast<unsigned int *>(out->row_src),
        s.chunk_error, s.chunk_counts);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  layout_scan_kernel<<<(unsigned)((E + 1 + 31) / 32), kScanWarps * 32, 0, stream>>>(
      chunks, E, layout, alignment, capacity, s.chunk_counts, s.chunk_error, s.ticket,
      s.active_total, out->counts, out->offsets, out->result);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  int64_t threads = layout == EPX_LAYOUT_RANK_MAJOR ? T : T * K;
  if (layout == EPX_LAYOUT_EXPERT_MAJOR && threads < E) threads = E;
  if (threads > 0) {
    layout_assign_kernel<<<(unsigned)((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        T, K, E, layout, chunk_tokens, s.chunk_counts, out->offsets, out->counts, out->idx,
        out->route_row, out->token_row, out->row_src, out->result);
    err = cudaGetLastError();
  }
  return err;
}

extern "C" cudaError_t epx_cuda_recv_routing_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                                    const float *w, int32_t K, int64_t row_bound,
                                                    int32_t *recv_expert, float *recv_w,
                                                    cudaStream_t stream) {
  if (row_bound <= 0 || (!recv_expert && !recv_w)) return cudaSuccess;
  recv_routing_kernel<<<(unsigned)((row_bound + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      layout, lay->row_src, lay->idx, w, K, &lay->result->rows, row_bound, recv_expert, recv_w);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_recv_source_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                                   int32_t K, int64_t row_bound, int32_t *src_rank,
                                                   int32_t *src_token, cudaStream_t stream) {
  if (row_bound <= 0 || (!src_rank && !src_token)) return cudaSuccess;
  recv_source_kernel<<<(unsigned)((row_bound + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      layout, lay->row_src, K, &lay->result->rows, row_bound, src_rank, src_token);
  return cudaGetLastError();
}
