/* The kernels of the CUDA backend on W ranks (launch.h, "W ranks"): the
 * send block of a rank's routing, the flags and one scan that place every
 * item in the staging buffers, the tables the moves read, combine's
 * float32-partial and per-rank grouped reductions, and the small per-route
 * value moves of the backward passes.
 *
 * The scan's four segments (ints), G = W * Tm tokens gathered:
 *   hp [W, Tm]      home pair (t, d) has a route to d
 *   hr [W, Tm, Kb]  home route (t, k) goes to d
 *   rp [G]          gathered token g has a route to this rank
 *   rr [G, Kb]      gathered route (g, k) is to this rank
 * plus one 0, so the scan's last value is the last segment's total. An
 * item's index among its peer's items is its scan value minus the scan at
 * the peer's first element; its compact staging row is its scan value minus
 * the segment's start. */
#include <cub/cub.cuh>
#include <cuda_runtime.h>

#include "cuda/ep/ep.h"
#include "cuda/common/device.cuh"
#include "cuda/launch.h"

namespace {

constexpr int kThreads = 256;

struct segs {
  int64_t o1, o2, o3, o4;
};

__host__ __device__ segs segments(const epx_cuda_ep_dims_t &d) {
  const int64_t G = (int64_t)d.W * d.Tm;
  segs s;
  s.o1 = G;                 /* hp is [W, Tm] = G ints */
  s.o2 = s.o1 + G * d.Kb;   /* hr */
  s.o3 = s.o2 + G;          /* rp */
  s.o4 = s.o3 + G * d.Kb;   /* rr */
  return s;
}

unsigned blocks_for(int64_t n) { return (unsigned)((n + kThreads - 1) / kThreads); }

__device__ bool any_oversize(const int32_t *hdr, int W) {
  for (int s = 0; s < W; s++)
    if (hdr[s * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_OVERSIZE]) return true;
  return false;
}

/* The send block's header, but its invalid flag (each stage kernel sets
 * that its own way): this rank's tokens, whether it is oversize, top_k and
 * weighting. */
__device__ __forceinline__ void stage_header(const epx_cuda_ep_dims_t &d, int oversize, int32_t *hdr) {
  hdr[EPX_CUDA_EP_HDR_TOKENS] = (int32_t)d.T;
  hdr[EPX_CUDA_EP_HDR_OVERSIZE] = oversize;
  hdr[EPX_CUDA_EP_HDR_TOPK] = d.K;
  hdr[EPX_CUDA_EP_HDR_WEIGHTING] = d.weighting;
}

__global__ void __launch_bounds__(kThreads)
    stage_kernel(const epx_cuda_ep_dims_t d, const int32_t *own_idx, const float *own_w,
                 const int32_t *locations, const epx_cuda_layout_result_t *own_result, int oversize,
                 int32_t *idx, float *w, int32_t *loc, int32_t *hdr) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i == 0) {
    stage_header(d, oversize, hdr);
    hdr[EPX_CUDA_EP_HDR_INVALID] = own_result && own_result->error != EPX_CUDA_NO_ERROR;
  }
  if (i >= d.Tm * d.Kb) return;
  const int64_t t = i / d.Kb;
  const int k = (int)(i % d.Kb);
  const bool valid = !oversize && t < d.T && k < d.K;
  const int e = valid ? own_idx[t * d.K + k] : -1;
  idx[i] = e;
  w[i] = e >= 0 && own_w ? own_w[t * d.K + k] : 0.0f;
  if (loc) loc[i] = e >= 0 && locations ? locations[t * d.K + k] : -1;
}

/* The stage kernel that also validates (expert-major and rank-major: no
 * capacity slots to claim), in place of the one-rank layout over all E
 * experts: a thread per send slot (t, k) checks route t * K + k as that
 * layout does (an id outside [-1, E), or the token's earlier slot naming the
 * same expert), sends -1 for an invalid route, and records the first one in
 * result->error (EPX_CUDA_NO_ERROR before) and the header's invalid flag (0
 * before). w_copy: this rank's weights [T, K] (the layout's copy). */
__global__ void __launch_bounds__(kThreads)
    stage_validate_kernel(const epx_cuda_ep_dims_t d, const int32_t *__restrict__ topk_idx,
                          const float *__restrict__ topk_w, int32_t E, float *w_copy,
                          epx_cuda_layout_result_t *result, int32_t *idx, float *w, int32_t *hdr) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i == 0) stage_header(d, 0, hdr); /* the invalid flag: zeroed before, set per route below */
  if (i >= d.Tm * d.Kb) return;
  const int64_t t = i / d.Kb;
  const int k = (int)(i % d.Kb);
  int e = -1;
  float wv = 0.0f;
  if (t < d.T && k < d.K) {
    const int64_t g = t * d.K + k;
    const int raw = topk_idx[g];
    int code = 0;
    if (raw < -1 || raw >= E) {
      code = EPX_CUDA_BAD_EXPERT;
    } else if (raw >= 0) {
      for (int j = 0; j < k; j++)
        if (topk_idx[t * d.K + j] == raw) code = EPX_CUDA_DUPLICATE_EXPERT;
    }
    if (topk_w) {
      wv = topk_w[g];
      if (w_copy) w_copy[g] = wv;
    }
    if (code) {
      atomicMin(reinterpret_cast<unsigned long long *>(&result->error),
                ((unsigned long long)g << 3) | (unsigned long long)code);
      hdr[EPX_CUDA_EP_HDR_INVALID] = 1;
    } else {
      e = raw;
    }
  }
  idx[i] = e;
  w[i] = e >= 0 ? wv : 0.0f;
}

/* dst[r, :] = src[r, :] for rows r < min(*rows, row_bound), `words` 4-byte
 * words per row (a fused plan's per-row tables into the caller's arrays). */
__global__ void __launch_bounds__(kThreads)
    copy_rows_kernel(const uint32_t *__restrict__ src, uint32_t *__restrict__ dst, int32_t words,
                     const int64_t *rows, int64_t row_bound) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i < min(*rows, row_bound) * words) dst[i] = src[i];
}

/* A thread per gathered token g (its Kb slots; home flags too when g is one
 * of this rank's tokens). */
__global__ void __launch_bounds__(kThreads)
    flags_kernel(const epx_cuda_ep_dims_t d, const int32_t *gidx, const int32_t *gloc,
                 const int32_t *ghdr, int32_t *ridx, int32_t *rloc, int32_t *flags) {
  const int64_t G = (int64_t)d.W * d.Tm;
  const int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const segs o = segments(d);
  if (g == 0) flags[o.o4] = 0;
  if (g >= G) return;
  const bool empty = any_oversize(ghdr, d.W);
  const int s = (int)(g / d.Tm);
  const int64_t t = g % d.Tm;
  const int lo = d.rank * d.El, hi = lo + d.El;
  int any = 0;
  for (int k = 0; k < d.Kb; k++) {
    const int64_t i = g * d.Kb + k;
    const int e = empty ? -1 : gidx[i];
    const int local = e >= lo && e < hi;
    ridx[i] = local ? e - lo : -1;
    if (rloc) rloc[i] = local ? s * d.capacity + gloc[i] : -1;
    flags[o.o3 + i] = local;
    any |= local;
  }
  flags[o.o2 + g] = any;
  if (s != d.rank) return;
  for (int p = 0; p < d.W; p++) {
    int has = 0;
    for (int k = 0; k < d.Kb; k++) {
      const int e = empty ? -1 : gidx[g * d.Kb + k];
      const int hit = e >= 0 && e / d.El == p;
      flags[o.o1 + ((int64_t)p * d.Tm + t) * d.Kb + k] = hit;
      has |= hit;
    }
    flags[(int64_t)p * d.Tm + t] = has;
  }
}

__global__ void __launch_bounds__(kThreads)
    tables_kernel(const epx_cuda_ep_dims_t d, const epx_cuda_ep_tables_t a, const epx_cuda_layout_t recv) {
  const int64_t G = (int64_t)d.W * d.Tm;
  const int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const segs o = segments(d);
  const int32_t *scan = a.scan;
  const bool rank_major = d.layout == EPX_LAYOUT_RANK_MAJOR;
  if (g < d.W) {
    const int p = (int)g;
    const int64_t W = d.W, TK = d.Tm * d.Kb;
    a.summary[p] = scan[(p + 1) * d.Tm] - scan[p * d.Tm];
    a.summary[W + p] = scan[o.o1 + (p + 1) * TK] - scan[o.o1 + p * TK];
    a.summary[2 * W + p] = scan[o.o2 + (p + 1) * d.Tm] - scan[o.o2 + p * d.Tm];
    a.summary[3 * W + p] = scan[o.o3 + (p + 1) * TK] - scan[o.o3 + p * TK];
    for (int i = 0; i < EPX_CUDA_EP_HDR_INTS; i++)
      a.summary[4 * W + p * EPX_CUDA_EP_HDR_INTS + i] = a.ghdr[p * EPX_CUDA_EP_HDR_INTS + i];
    if (p == 0) {
      a.summary[EPX_CUDA_EP_SUMMARY_ROWS(W)] = recv.result->rows;
      a.summary[EPX_CUDA_EP_SUMMARY_ROWS(W) + 1] = a.own_result ? (int64_t)a.own_result->error : -1;
    }
  }
  if (g >= G) return;
  const int s = (int)(g / d.Tm);
  const int64_t t = g % d.Tm;
  const bool empty = any_oversize(a.ghdr, d.W);

  /* Received: the pair (s, t) and its routes to this rank. */
  if (scan[o.o2 + g + 1] != scan[o.o2 + g]) {
    const int64_t i = scan[o.o2 + g] - scan[o.o2 + (int64_t)s * d.Tm];
    const int64_t pair = d.worst ? s * d.Bp + i : scan[o.o2 + g] - scan[o.o2];
    int first = -1;
    for (int k = 0; k < d.Kb; k++) {
      const int64_t r = g * d.Kb + k;
      if (a.ridx[r] < 0) continue;
      const bool is_first = first < 0;
      if (is_first) first = k;
      const int32_t row = rank_major ? recv.token_row[g] : recv.route_row[r];
      const int32_t own_row = rank_major && !is_first ? -1 : row;
      a.rp_rows[pair * d.Kb + k] = own_row;
      a.rp_w[pair * d.Kb + k] = a.gw[r];
      const int64_t j = scan[o.o3 + r] - scan[o.o3 + (int64_t)s * d.Tm * d.Kb];
      const int64_t route = d.worst ? s * d.Br + j : scan[o.o3 + r] - scan[o.o3];
      a.rr_all[route] = row;
      a.rr_row[route] = own_row;
      a.rr_slot[route] = k;
      a.rr_w[route] = a.gw[r];
      if (!rank_major) a.stage_of_row[row] = (int32_t)route;
    }
    if (rank_major) a.stage_of_row[recv.token_row[g]] = (int32_t)pair;
  }

  /* Home: this rank's token t, its pairs and routes by destination. */
  if (s != d.rank || t >= d.T) return;
  for (int p = 0; p < d.W; p++) {
    const int64_t f = (int64_t)p * d.Tm + t;
    const bool has = scan[f + 1] != scan[f];
    a.pair_stage[t * d.W + p] =
        has ? (int32_t)(d.worst ? p * d.Bp + (scan[f] - scan[(int64_t)p * d.Tm]) : scan[f]) : -1;
  }
  for (int k = 0; k < d.K; k++) {
    const int e = empty ? -1 : a.gidx[g * d.Kb + k];
    int32_t stage = -1, dest = -1;
    if (e >= 0) {
      dest = e / d.El;
      const int64_t base = o.o1 + (int64_t)dest * d.Tm * d.Kb;
      const int64_t f = base + t * d.Kb + k;
      stage = (int32_t)(d.worst ? dest * d.Br + (scan[f] - scan[base]) : scan[f] - scan[o.o1]);
    }
    a.route_stage[t * d.K + k] = stage;
    a.group[t * d.K + k] = dest;
  }
}

/* Eight elements of a row as float32 (one 16-byte vector of a 16-bit dtype,
 * two of float32), and back. */
template <typename T>
__device__ __forceinline__ void load8(const void *row, int64_t c, float *f) {
  const uint4 *v = static_cast<const uint4 *>(row);
  if (epx_vec<T>::n == 8) {
    epx_vec<T>::unpack(__ldcs(v + c), f);
  } else {
    epx_vec<T>::unpack(__ldcs(v + 2 * c), f);
    epx_vec<T>::unpack(__ldcs(v + 2 * c + 1), f + 4);
  }
}

template <typename T>
__device__ __forceinline__ void store8(void *row, int64_t c, const float *f) {
  uint4 *v = static_cast<uint4 *>(row);
  if (epx_vec<T>::n == 8) {
    v[c] = epx_vec<T>::pack(f);
  } else {
    v[2 * c] = epx_vec<T>::pack(f);
    v[2 * c + 1] = epx_vec<T>::pack(f + 4);
  }
}

/* x rounded to T and back (the value a T partial carries). */
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  float f[8] = {x, x, x, x, x, x, x, x}, g[8];
  const uint4 p = epx_vec<T>::pack(f);
  epx_vec<T>::unpack(p, g);
  return g[0];
}

constexpr int kReduceWarps = 8;
constexpr int kChunks = 2; /* 8-element chunks per lane per step */

template <typename Tin, typename Tout, bool kWeight, bool kDot, bool kGroup>
__global__ void __launch_bounds__(kReduceWarps * 32) reduce_kernel(const epx_cuda_reduce_t a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * kReduceWarps + warp;
  if (t >= a.tokens) return;
  const int K = a.top_k;
  extern __shared__ int32_t s_table[];
  int32_t *s_row = s_table + (size_t)warp * 5 * K;
  int32_t *s_slot = s_row + K;
  int32_t *s_grp = s_slot + K;
  float *s_w = reinterpret_cast<float *>(s_grp + K);
  float *s_dot = s_w + K;
  const unsigned int lanes_below = (1u << lane) - 1u;
  int valid = 0;
  for (int k0 = 0; k0 < K; k0 += 32) {
    const int k = k0 + lane;
    const int32_t row = k < K ? a.rows[t * K + k] : -1;
    const unsigned int mask = __ballot_sync(0xffffffffu, row >= 0);
    if (row >= 0) {
      const int p = valid + __popc(mask & lanes_below);
      s_row[p] = row;
      s_slot[p] = k;
      s_grp[p] = kGroup ? a.group[t * K + k] : 0;
      s_w[p] = kWeight ? a.w[t * K + k] : 1.0f;
    }
    if (kDot && k < K) s_dot[k] = 0.0f;
    valid += __popc(mask);
  }
  __syncwarp();
  if (kGroup && lane == 0) {
    /* stable insertion sort by group: k order inside a group stays */
    for (int i = 1; i < valid; i++) {
      const int32_t r = s_row[i], sl = s_slot[i], gr = s_grp[i];
      const float wv = s_w[i];
      int j = i - 1;
      while (j >= 0 && s_grp[j] > gr) {
        s_row[j + 1] = s_row[j], s_slot[j + 1] = s_slot[j], s_grp[j + 1] = s_grp[j], s_w[j + 1] = s_w[j];
        j--;
      }
      s_row[j + 1] = r, s_slot[j + 1] = sl, s_grp[j + 1] = gr, s_w[j + 1] = wv;
    }
  }
  __syncwarp();

  const int64_t chunks = a.hidden / 8;
  const size_t in_row = (size_t)a.hidden * sizeof(Tin), out_row = (size_t)a.hidden * sizeof(Tout);
  const char *src = static_cast<const char *>(a.src);
  /* Every lane walks the same steps (the dot's warp sums need all 32). */
  for (int64_t step = 0; step < chunks; step += 32 * kChunks) {
    const int64_t c0 = step + lane;
    float acc[kChunks][8], part[kChunks][8], oth[kChunks][8];
#pragma unroll
    for (int u = 0; u < kChunks; u++)
#pragma unroll
      for (int e = 0; e < 8; e++) acc[u][e] = 0.0f, part[u][e] = 0.0f;
    if (kDot) {
#pragma unroll
      for (int u = 0; u < kChunks; u++)
        if (c0 + u * 32 < chunks) load8<Tin>(static_cast<const char *>(a.other) + t * in_row, c0 + u * 32, oth[u]);
    }
    for (int j = 0; j < valid; j++) {
      if (kGroup && j > 0 && s_grp[j] != s_grp[j - 1]) {
#pragma unroll
        for (int u = 0; u < kChunks; u++)
#pragma unroll
          for (int e = 0; e < 8; e++) {
            acc[u][e] = __fadd_rn(acc[u][e], a.round_groups ? round_to<Tin>(part[u][e]) : part[u][e]);
            part[u][e] = 0.0f;
          }
      }
      const float w = s_w[j];
      float dot = 0.0f;
#pragma unroll
      for (int u = 0; u < kChunks; u++) {
        if (c0 + u * 32 >= chunks) continue;
        float f[8];
        load8<Tin>(src + (int64_t)s_row[j] * in_row, c0 + u * 32, f);
#pragma unroll
        for (int e = 0; e < 8; e++) {
          part[u][e] = __fadd_rn(part[u][e], kWeight ? __fmul_rn(w, f[e]) : f[e]);
          if (kDot) dot = __fadd_rn(dot, __fmul_rn(f[e], oth[u][e]));
        }
      }
      if (kDot) {
        dot = epx_warp_sum(dot);
        if (lane == 0) s_dot[s_slot[j]] += dot;
      }
    }
#pragma unroll
    for (int u = 0; u < kChunks; u++) {
      if (c0 + u * 32 >= chunks) continue;
#pragma unroll
      for (int e = 0; e < 8; e++)
        acc[u][e] = __fadd_rn(acc[u][e], kGroup && a.round_groups ? round_to<Tin>(part[u][e]) : part[u][e]);
      store8<Tout>(static_cast<char *>(a.dst) + t * out_row, c0 + u * 32, acc[u]);
    }
  }
  if (kDot) {
    __syncwarp();
    for (int k = lane; k < K; k += 32) a.grad_w[t * K + k] = s_dot[k];
  }
}

template <typename Tin, typename Tout>
cudaError_t reduce_typed(const epx_cuda_reduce_t &a, cudaStream_t stream) {
  const unsigned blocks = (unsigned)((a.tokens + kReduceWarps - 1) / kReduceWarps);
  const size_t shared = (size_t)kReduceWarps * 5 * sizeof(int32_t) * (size_t)a.top_k;
  const bool w = a.w != nullptr, dot = a.grad_w != nullptr, grp = a.group != nullptr;
  constexpr int kT = kReduceWarps * 32;
  if (grp) {
    if (w && dot) reduce_kernel<Tin, Tout, true, true, true><<<blocks, kT, shared, stream>>>(a);
    else if (w) reduce_kernel<Tin, Tout, true, false, true><<<blocks, kT, shared, stream>>>(a);
    else if (dot) reduce_kernel<Tin, Tout, false, true, true><<<blocks, kT, shared, stream>>>(a);
    else reduce_kernel<Tin, Tout, false, false, true><<<blocks, kT, shared, stream>>>(a);
  } else {
    if (w) reduce_kernel<Tin, Tout, true, false, false><<<blocks, kT, shared, stream>>>(a);
    else reduce_kernel<Tin, Tout, false, false, false><<<blocks, kT, shared, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename Tout>
cudaError_t reduce_from_f32(const epx_cuda_reduce_t &a, cudaStream_t stream) {
  if (a.group || a.grad_w) return cudaErrorInvalidValue;
  return reduce_typed<float, Tout>(a, stream);
}

__global__ void __launch_bounds__(kThreads)
    home_values_kernel(const epx_cuda_ep_dims_t d, int pairs, const int32_t *pair_stage,
                       const int32_t *route_stage, const int32_t *group, const float *back, float *grad_w) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i >= d.T * d.K) return;
  const int64_t t = i / d.K;
  const int k = (int)(i % d.K);
  float v = 0.0f;
  if (pairs) {
    const int p = group[i];
    if (p >= 0) v = back[(int64_t)pair_stage[t * d.W + p] * d.Kb + k];
  } else {
    const int32_t r = route_stage[i];
    if (r >= 0) v = back[r];
  }
  grad_w[i] = v;
}

__global__ void __launch_bounds__(kThreads)
    route_values_kernel(int64_t rows, const int32_t *rr_all, const int32_t *rr_slot, int32_t slots,
                        const float *grad_recv_w, float *back) {
  const int64_t j = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (j >= rows) return;
  const int32_t row = rr_all[j];
  back[j] = row >= 0 ? grad_recv_w[(int64_t)row * slots + (slots > 1 ? rr_slot[j] : 0)] : 0.0f;
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void __launch_bounds__(kThreads) hash_kernel(const int32_t *idx, int64_t count, unsigned long long *hash) {
  unsigned long long sum = 0;
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < count; i += (int64_t)gridDim.x * kThreads)
    sum += mix64(((unsigned long long)i << 32) ^ (unsigned int)idx[i]);
  for (int m = 16; m >= 1; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if ((threadIdx.x & 31) == 0 && sum) atomicAdd(hash, sum);
}

}  // namespace

extern "C" int64_t epx_cuda_ep_flag_count(const epx_cuda_ep_dims_t *d) { return segments(*d).o4 + 1; }

extern "C" size_t epx_cuda_ep_scan_bytes(int64_t flags) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, (const int32_t *)nullptr, (int32_t *)nullptr, flags);
  return bytes;
}

extern "C" cudaError_t epx_cuda_ep_scan_launch(const int32_t *flags, int32_t *scan, int64_t count, void *temp,
                                               size_t temp_bytes, cudaStream_t stream) {
  return cub::DeviceScan::ExclusiveSum(temp, temp_bytes, flags, scan, count, stream);
}

extern "C" cudaError_t epx_cuda_ep_stage_launch(const epx_cuda_ep_dims_t *d, const int32_t *own_idx,
                                                const float *own_w, const int32_t *locations,
                                                const epx_cuda_layout_result_t *own_result, int oversize,
                                                int32_t *idx, float *w, int32_t *loc, int32_t *hdr,
                                                cudaStream_t stream) {
  const int64_t n = d->Tm * d->Kb;
  stage_kernel<<<blocks_for(n > 0 ? n : 1), kThreads, 0, stream>>>(*d, own_idx, own_w, locations, own_result,
                                                                   oversize, idx, w, loc, hdr);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ep_stage_validate_launch(const epx_cuda_ep_dims_t *d, const int32_t *topk_idx,
                                                         const float *topk_w, int32_t num_experts, float *w_copy,
                                                         epx_cuda_layout_result_t *result, int32_t *idx, float *w,
                                                         int32_t *hdr, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(result, 0xff, sizeof *result, stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(hdr + EPX_CUDA_EP_HDR_INVALID, 0, sizeof *hdr, stream);
  if (e != cudaSuccess) return e;
  const int64_t n = d->Tm * d->Kb;
  stage_validate_kernel<<<blocks_for(n > 0 ? n : 1), kThreads, 0, stream>>>(*d, topk_idx, topk_w, num_experts, w_copy,
                                                                            result, idx, w, hdr);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ep_copy_rows_launch(const void *src, void *dst, int32_t words, const int64_t *rows,
                                                    int64_t row_bound, cudaStream_t stream) {
  if (!dst || row_bound <= 0 || words <= 0) return cudaSuccess;
  copy_rows_kernel<<<blocks_for(row_bound * words), kThreads, 0, stream>>>(
      static_cast<const uint32_t *>(src), static_cast<uint32_t *>(dst), words, rows, row_bound);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ep_flags_launch(const epx_cuda_ep_dims_t *d, const int32_t *gidx,
                                                const int32_t *gloc, const int32_t *ghdr, int32_t *ridx,
                                                int32_t *rloc, int32_t *flags, cudaStream_t stream) {
  flags_kernel<<<blocks_for((int64_t)d->W * d->Tm), kThreads, 0, stream>>>(*d, gidx, gloc, ghdr, ridx, rloc, flags);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ep_tables_launch(const epx_cuda_ep_dims_t *d, const epx_cuda_ep_tables_t *t,
                                                 cudaStream_t stream) {
  tables_kernel<<<blocks_for((int64_t)d->W * d->Tm), kThreads, 0, stream>>>(*d, *t, *t->recv);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_reduce_launch(const epx_cuda_reduce_t *r, cudaStream_t stream) {
  const epx_cuda_reduce_t &a = *r;
  if (a.tokens <= 0) return cudaSuccess;
  if (a.top_k < 1 || a.top_k > EPX_CUDA_MAX_TOP_K || a.hidden % 8 || (a.grad_w && !a.other)) return cudaErrorInvalidValue;
  if (a.src_dtype == a.dst_dtype) {
    switch (a.src_dtype) {
      case EPX_FLOAT32: return reduce_typed<float, float>(a, stream);
      case EPX_BFLOAT16: return reduce_typed<__nv_bfloat16, __nv_bfloat16>(a, stream);
      case EPX_FLOAT16: return reduce_typed<__half, __half>(a, stream);
    }
  } else if (a.dst_dtype == EPX_FLOAT32 && !a.group && !a.grad_w) {
    if (a.src_dtype == EPX_BFLOAT16) return reduce_typed<__nv_bfloat16, float>(a, stream);
    if (a.src_dtype == EPX_FLOAT16) return reduce_typed<__half, float>(a, stream);
  } else if (a.src_dtype == EPX_FLOAT32) {
    if (a.dst_dtype == EPX_BFLOAT16) return reduce_from_f32<__nv_bfloat16>(a, stream);
    if (a.dst_dtype == EPX_FLOAT16) return reduce_from_f32<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

extern "C" cudaError_t epx_cuda_ep_home_values_launch(const epx_cuda_ep_dims_t *d, int pairs,
                                                      const int32_t *pair_stage, const int32_t *route_stage,
                                                      const int32_t *group, const float *back, float *grad_w,
                                                      cudaStream_t stream) {
  const int64_t n = d->T * d->K;
  if (n == 0) return cudaSuccess;
  home_values_kernel<<<blocks_for(n), kThreads, 0, stream>>>(*d, pairs, pair_stage, route_stage, group, back, grad_w);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_ep_route_values_launch(int64_t rows, const int32_t *rr_all, const int32_t *rr_slot,
                                                       int32_t slots, const float *grad_recv_w, float *back,
                                                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  route_values_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(rows, rr_all, rr_slot, slots, grad_recv_w, back);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_hash_launch(const int32_t *topk_idx, int64_t count, uint64_t *hash,
                                            cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(hash, 0, sizeof *hash, stream);
  if (err != cudaSuccess || count == 0) return err;
  int64_t blocks = (count + kThreads - 1) / kThreads;
  if (blocks > 1024) blocks = 1024;
  hash_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(topk_idx, count, reinterpret_cast<unsigned long long *>(hash));
  return cudaGetLastError();
}
