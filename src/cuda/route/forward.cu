/* The routing forward kernels behind launch.h (see its Routing section for
 * the pipeline; the host glue is route.c). Every reduction has a fixed
 * order and every atomic is an integer one, so results are bit-identical
 * run to run. EPX_NONFINITE_ERROR: the kernels that write the caller's
 * outputs first read the device flag of non-finite tokens and write nothing
 * when it is set. */
#include <cuda_runtime.h>

#include <cub/device/device_segmented_radix_sort.cuh>

#include "cuda/route/common.cuh"

using namespace route_dev;

namespace {

constexpr int kPrefetch = 8;   /* routes per lane loaded ahead in assign_kernel */
constexpr int kScanAhead = 4;  /* 32-tile chunks loaded ahead in expert_scan_kernel */

/* Sort key of a route: its drop key (order-preserving bits) above, then the
 * complement of its position so that earlier routes win ties. */
__device__ __forceinline__ unsigned long long rank_key(float key, int pos) {
  unsigned u = __float_as_uint(key + 0.0f); /* -0 -> +0: they compare equal */
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - (unsigned)pos);
}

__device__ __forceinline__ int key_position(unsigned long long key) {
  return (int)(0xffffffffu - (unsigned)(key & 0xffffffffull));
}

typedef epx_cuda_route_fwd_args_t ForwardArgs;

/* Counts of a plain top-k of q (Y, which it consumes) for
 * EPX_AUX_COUNTS_PLAIN_TOPK. */
__device__ void plain_topk_counts(const ForwardArgs &a, float *Y, int *cnt, int lane) {
  unsigned bk;
  int bi;
  lane_best(Y, a.s.E, lane, bk, bi);
  for (int k = 0; k < a.s.K; ++k) {
    const int e = warp_argmax(bk, bi);
    if (e < 0) break;
    if (lane == 0) atomicAdd(cnt + e, 1);
    if (lane == (e & 31)) {
      Y[pad(e)] = removed();
      lane_best(Y, a.s.E, lane, bk, bi);
    }
  }
  __syncwarp();
}

/* A valid token's routes into the queue (weights, drop keys, base weights,
 * counts) and its aux counts. */
__device__ void emit_routes(const ForwardArgs &a, int t, const int *CI, const float *CP,
                            const TokenState &st, int lane) {
  const SelectArgs &s = a.s;
  int *cnt = a.auxcnt ? a.auxcnt + (size_t)(s.seqs > 1 ? t % s.seqs : 0) * s.E : NULL;
  for (int k = lane; k < s.K; k += 32) {
    const int e = CI[k];
    const float b = CP[k];
    /* Chosen scores that all underflowed to 0 give weight 0, as on the CPU. */
    const float wk = (a.renorm ? (st.S > 0.f ? b / st.S : 0.f) : b) * a.scale;
    const int r = queue_index(a.by_token, t, k, s.T, s.K);
    if (a.qe) {
      a.qe[r] = e;
      a.qw[r] = e >= 0 ? wk : 0.f;
    }
    if (a.qkey)
      a.qkey[r] = a.drop_policy == EPX_DROP_BY_SCORE ? b
                  : a.drop_policy == EPX_DROP_BY_RANDOM_PRIORITY
                      ? (float)epx_route_priority(a.seed, (int64_t)t * s.K + k)
                      : wk;
    if (a.base) a.base[(size_t)t * s.K + k] = b;
    if (e < 0) continue;
    atomicAdd(a.hist + (size_t)e * a.n_tiles + (r >> a.tile_shift), 1);
    if (cnt && (a.aux_counts == EPX_AUX_COUNTS_SELECTED ||
                (a.aux_counts == EPX_AUX_COUNTS_FIRST_CHOICE && k == 0)))
      atomicAdd(cnt + e, 1);
  }
}

/* A token that routes nowhere (masked, or non-finite and dropped). */
__device__ void emit_none(const ForwardArgs &a, int t, int lane) {
  const SelectArgs &s = a.s;
  for (int k = lane; k < s.K; k += 32) {
    const int r = queue_index(a.by_token, t, k, s.T, s.K);
    if (a.qe) {
      a.qe[r] = -1;
      a.qw[r] = 0.f;
    }
    if (a.qkey) a.qkey[r] = 0.f;
    if (a.base) a.base[(size_t)t * s.K + k] = 0.f;
  }
}

/* One token of route_tokens_kernel; returns whether it is valid and its
 * logsumexp^2 in *z. Leaves q in Y when aux partials are wanted. */
__device__ bool route_token(const ForwardArgs &a, int t, float *X, float *Y, float *Gs, int *CI,
                            float *CP, int lane, double *z) {
  const SelectArgs &s = a.s;
  TokenState st;
  bool real = true;
  const bool valid = a.select ? ((!s.mask || s.mask[t]) && token_select(s, t, X, Y, Gs, CI, CP, lane, st))
                              : row_valid(s, t, lane, &real);
  if (a.select) real = !s.mask || s.mask[t];
  if (!valid) {
    if (real && !a.drop_nonfinite && lane == 0) atomicMax(a.bad, s.T - t);
    emit_none(a, t, lane);
    return false;
  }
  if (!a.select) return true;
  emit_routes(a, t, CI, CP, st, lane);
  if (a.apart || (a.auxcnt && a.aux_counts == EPX_AUX_COUNTS_PLAIN_TOPK)) aux_scores(s, X, Y, st, lane);
  if (a.auxcnt && a.aux_counts == EPX_AUX_COUNTS_PLAIN_TOPK) {
    plain_topk_counts(a, Y, a.auxcnt + (size_t)(s.seqs > 1 ? t % s.seqs : 0) * s.E, lane);
    if (a.apart) aux_scores(s, X, Y, st, lane); /* the top-k consumed Y */
  }
  if (a.zpart) {
    const double lse = (double)st.m + log((double)st.sumexp);
    *z = lse * lse;
  }
  return true;
}

}  // namespace

static __global__ void __launch_bounds__(kTokenWarps * 32) route_tokens_kernel(ForwardArgs a) {
  extern __shared__ float smem[];
  __shared__ int s_valid[kTokenWarps];
  __shared__ double s_z[kTokenWarps];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
  const SelectArgs &s = a.s;
  float *X = smem + (size_t)w * s.words;
  float *Y = X + s.y, *Gs = X + s.g, *CP = X + s.cp;
  int *CI = reinterpret_cast<int *>(X + s.ci);
  const long long tl = token_of(s, w, W);
  int valid = 0;
  double z = 0.0;
  if (tl >= 0) valid = route_token(a, (int)tl, X, Y, Gs, CI, CP, lane, &z) ? 1 : 0;

  if (a.valid || a.apart || a.zpart) {
    if (lane == 0) {
      s_valid[w] = valid;
      s_z[w] = z;
    }
    __syncthreads();
    if (a.apart) {
      for (int e = threadIdx.x; e < s.E; e += blockDim.x) {
        double acc = 0.0;
        for (int v = 0; v < W; ++v)
          if (s_valid[v]) acc += (double)smem[(size_t)v * s.words + s.y + pad(e)];
        a.apart[(size_t)e * gridDim.x + blockIdx.x] = acc;
      }
    }
    if (threadIdx.x == 0) {
      int n = 0;
      double zs = 0.0;
      for (int v = 0; v < W; ++v) {
        if (s_valid[v]) {
          ++n;
          zs += s_z[v];
        }
      }
      if (a.zpart) a.zpart[blockIdx.x] = zs;
      if (a.valid && n > 0) atomicAdd(a.valid, n);
    }
  }
}

typedef epx_cuda_route_scan_args_t ScanArgs;

namespace {

/* Expert e's exclusive scan of its tile counts in queue order (base), and
 * its total. */
__device__ int scan_expert(const ScanArgs &a, int e, int lane) {
  const int *h = a.hist + (size_t)e * a.n_tiles;
  int carry = 0;
  for (int c0 = 0; c0 < a.n_tiles; c0 += 32 * kScanAhead) {
    int v[kScanAhead];
#pragma unroll
    for (int u = 0; u < kScanAhead; ++u) {
      const int i = c0 + 32 * u + lane;
      v[u] = i < a.n_tiles ? h[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < kScanAhead; ++u) {
      const int i = c0 + 32 * u + lane;
      const int incl = warp_inclusive_scan(v[u], lane);
      if (i < a.n_tiles) a.base[(size_t)i * a.E + e] = carry + incl - v[u];
      carry += __shfl_sync(kFull, incl, 31);
    }
  }
  return carry;
}

/* The losses, by the last block's first warp (fixed order). */
__device__ void finalize_losses(const ScanArgs &a, int lane) {
  const int tv = a.valid ? __ldcg(a.valid) : 0;
  const int B = a.seqs > 1 ? a.seqs : 1;
  if (a.aux_out) {
    double acc = 0.0;
    for (int i = lane; i < B * a.E; i += 32) {
      const double F = a.aux_global ? (double)a.aux_global[i]
                       : a.auxcnt   ? (double)__ldcg(a.auxcnt + i)
                                    : (double)__ldcg(a.counts + i);
      acc += F * __ldcg(a.colsum + i);
    }
    acc = warp_sum(acc);
    const double D = epx_route_aux_denominator_of(a.aux_k, (double)tv, a.seqs, a.aux_tokens);
    if (lane == 0) *a.aux_out = tv > 0 ? (float)(a.aux_coeff * a.E * acc / D) : 0.f;
  }
  if (a.z_out) {
    double acc = 0.0;
    for (int b = lane; b < a.n_blk; b += 32) acc += __ldcg(a.zpart + b);
    acc = warp_sum(acc);
    if (lane == 0) *a.z_out = tv > 0 ? (float)(a.z_coeff * acc / tv) : 0.f;
  }
}

}  // namespace

static __global__ void __launch_bounds__(kWarps * 32) expert_scan_kernel(ScanArgs a) {
  if (a.bad && *a.bad) return;
  __shared__ int s_last;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int e = blockIdx.x * kWarps + w;
  if (e < a.E) {
    const int carry = scan_expert(a, e, lane);
    if (lane == 0) {
      a.counts[e] = carry;
      if (a.counts_out) a.counts_out[e] = carry;
    }
    if (a.apart) {
      /* Column sums per sequence (its blocks are consecutive). */
      const int B = a.seqs > 1 ? a.seqs : 1, per = a.seqs > 1 ? a.seq_blocks : a.n_blk;
      for (int b = 0; b < B; ++b) {
        const double *p = a.apart + (size_t)e * a.n_blk + (size_t)b * per;
        double acc = 0.0;
#pragma unroll 4
        for (int j = lane; j < per; j += 32) acc += p[j];
        acc = warp_sum(acc);
        if (lane == 0) a.colsum[(size_t)b * a.E + e] = acc;
      }
    }
  }
  if (!a.finalize) return;

  /* The last block to finish sees every block's counts and column sums. */
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last || w != 0) return;
  __threadfence();

  if (a.offsets) {
    int carry = 0;
    for (int c0 = 0; c0 < a.E; c0 += 32) {
      const int i = c0 + lane;
      const int v = i < a.E ? __ldcg(a.counts + i) : 0;
      const int incl = warp_inclusive_scan(v, lane);
      if (i < a.E) a.offsets[i] = carry + incl - v;
      carry += __shfl_sync(kFull, incl, 31);
    }
    if (lane == 0) a.offsets[a.E] = carry;
  }
  finalize_losses(a, lane);
}

typedef epx_cuda_route_assign_args_t AssignArgs;

static __device__ void assign_emit(const AssignArgs &a, int r, int e, float w, int pos) {
  const size_t o = output_index(a.by_token, r, a.T, a.K);
  if (a.mode == 2 && e >= 0) {
    const int i = a.offsets[e] + pos;
    a.keys[i] = rank_key(a.qkey[r], pos);
    a.rq[i] = r;
    return;
  }
  const bool keep = e >= 0 && (a.mode == 0 || pos < a.C);
  a.idx[o] = keep ? e : -1;
  a.w[o] = keep ? w : 0.f;
  if (a.loc) a.loc[o] = keep ? pos : -1;
}

static __global__ void __launch_bounds__(kWarps * 32) assign_kernel(AssignArgs a) {
  if (a.bad && *a.bad) return;
  extern __shared__ int srun[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int tile = blockIdx.x * W + w;
  if (tile >= a.n_tiles) return;
  const int rounds = 1 << (a.tile_shift - 5);
  const long long r0 = (long long)tile << a.tile_shift;
  /* run [E]: the next position of each expert in this tile. */
  int *run = srun + (size_t)w * a.E;
  const int *base = a.base + (size_t)tile * a.E;
  for (int e = lane; e < a.E; e += 32) run[e] = base[e];
  __syncwarp();
  const unsigned lower = (1u << lane) - 1u;
  for (int g0 = 0; g0 < rounds; g0 += kPrefetch) {
    int ev[kPrefetch];
    float wv[kPrefetch];
#pragma unroll
    for (int j = 0; j < kPrefetch; ++j) {
      const long long r = r0 + (long long)(g0 + j) * 32 + lane;
      ev[j] = r < a.N ? a.qe[r] : -1;
      wv[j] = r < a.N ? a.qw[r] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kPrefetch; ++j) {
      const long long r = r0 + (long long)(g0 + j) * 32 + lane;
      const int e = ev[j];
      const unsigned peers = __match_any_sync(kFull, e);
      const int rank = __popc(peers & lower);
      const int pos = e >= 0 ? run[e] + rank : -1;
      __syncwarp();
      if (e >= 0 && rank == 0) run[e] += __popc(peers);
      __syncwarp();
      if (r < a.N) assign_emit(a, (int)r, e, wv[j], pos);
    }
  }
}

typedef epx_cuda_route_rank_args_t RankArgs;

static __global__ void __launch_bounds__(kWarps * 32) rank_select_kernel(RankArgs a) {
  if (a.bad && *a.bad) return;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int e = blockIdx.x * kWarps + w;
  if (e >= a.E) return;
  const int n = a.counts[e], o = a.offsets[e];
  const bool overflow = n > a.C;
  if (overflow) {
    for (int p = lane; p < n; p += 32) a.flag[o + p] = 0;
    __syncwarp();
    for (int j = lane; j < a.C; j += 32) a.flag[o + key_position(a.sorted[o + j])] = 1;
    __syncwarp();
  }
  int carry = 0;
  for (int c0 = 0; c0 < n; c0 += 32) {
    const int p = c0 + lane;
    const int f = p < n ? (overflow ? a.flag[o + p] : 1) : 0;
    const int incl = warp_inclusive_scan(f, lane);
    if (p < n) {
      const int r = a.rq[o + p];
      const size_t out = output_index(a.by_token, r, a.T, a.K);
      a.idx[out] = f ? e : -1;
      a.w[out] = f ? a.qw[r] : 0.f;
      if (a.loc) a.loc[out] = f ? carry + incl - 1 : -1;
    }
    carry += __shfl_sync(kFull, incl, 31);
  }
}

/* A thread per token: the kept slots' weights renormalised in k order. */
static __global__ void renorm_kernel(const int *idx, const float *base, float *w, int T, int K,
                                     float scale, const int *bad) {
  if (bad && *bad) return;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int *ti = idx + (size_t)t * K;
  const float *tb = base + (size_t)t * K;
  float sum = 0.f;
  for (int k = 0; k < K; ++k)
    if (ti[k] >= 0) sum += tb[k];
  for (int k = 0; k < K; ++k)
    if (ti[k] >= 0) w[(size_t)t * K + k] = (sum > 0.f ? tb[k] / sum : 0.f) * scale;
}

extern "C" cudaError_t epx_cuda_route_smem_plan(int kind, size_t per_warp, int max_warps,
                                                int *warps, size_t *bytes) {
  const void *kernel = kind == EPX_CUDA_ROUTE_TOKENS ? (const void *)route_tokens_kernel
                                                     : (const void *)assign_kernel;
  return smem_fit(kernel, per_warp, max_warps, warps, bytes);
}

extern "C" cudaError_t epx_cuda_route_tokens_launch(const epx_cuda_route_fwd_args_t *a, int blocks,
                                                    int warps, size_t smem, cudaStream_t stream) {
  route_tokens_kernel<<<blocks, warps * 32, smem, stream>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_route_scan_launch(const epx_cuda_route_scan_args_t *a,
                                                  cudaStream_t stream) {
  expert_scan_kernel<<<(a->E + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_route_assign_launch(const epx_cuda_route_assign_args_t *a, int warps,
                                                    size_t smem, cudaStream_t stream) {
  assign_kernel<<<(a->n_tiles + warps - 1) / warps, warps * 32, smem, stream>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_route_sort_launch(void *temp, size_t *temp_bytes,
                                                  const unsigned long long *keys,
                                                  unsigned long long *sorted, int n, int E,
                                                  const int *offsets, cudaStream_t stream) {
  /* The size query (temp NULL) passes no offsets. */
  return cub::DeviceSegmentedRadixSort::SortKeysDescending(temp, *temp_bytes, keys, sorted, n, E,
                                                           offsets, offsets ? offsets + 1 : nullptr,
                                                           0, 64, stream);
}

extern "C" cudaError_t epx_cuda_route_rank_launch(const epx_cuda_route_rank_args_t *a,
                                                  cudaStream_t stream) {
  rank_select_kernel<<<(a->E + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(*a);
  return cudaGetLastError();
}

extern "C" cudaError_t epx_cuda_route_renorm_launch(const int *idx, const float *base, float *w,
                                                    int T, int K, float scale, const int *bad,
                                                    cudaStream_t stream) {
  renorm_kernel<<<(T + 255) / 256, 256, 0, stream>>>(idx, base, w, T, K, scale, bad);
  return cudaGetLastError();
}
