/* Routing on the GPU: epx_cuda_route and epx_cuda_route_backward.
 *
 * Forward pipeline, all on config->stream (one scratch block from a
 * stream-ordered pool, one memset, then):
 *   route_tokens_kernel  a warp per token: scores, group-limited top-k,
 *                        weights; writes each route in queue order (qe, qw),
 *                        counts it into hist[expert][tile of the queue] with
 *                        integer atomics, and per-block loss partials.
 *   expert_scan_kernel   a warp per expert: exclusive scan of its tile counts
 *                        in queue order (base), expert_counts, the loss column
 *                        sums; its last block (ticket) computes the expert
 *                        offsets and the losses in a fixed order.
 *   assign_kernel        a warp per tile: each route's position in its
 *                        expert's queue = base + its rank among the tile's
 *                        earlier routes to the same expert (warp match); drops
 *                        by position and writes the outputs.
 * Drop by probability additionally sorts each expert's routes by
 * (weight desc, position asc) with CUB and keeps the first C of each
 * (prob_select_kernel), located in queue order among themselves.
 *
 * Every reduction has a fixed order and every atomic is an integer one, so
 * results are bit-identical run to run. EPX_NONFINITE_ERROR: the kernels that
 * write the caller's outputs first read the device flag of non-finite tokens
 * and write nothing when it is set; the host reads it back once at the end. */
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include <cub/device/device_segmented_radix_sort.cuh>

extern "C" {
#include "core/error.h"
}
#include "cuda/cuda_backend.h"

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxTokenWarps = 16; /* warps (tokens) per block of the per-token kernels */
constexpr int kWarps = 8;          /* warps per block of the per-expert / per-tile kernels */
constexpr int kPrefetch = 8;       /* routes per lane loaded ahead in assign_kernel */
constexpr int kScanAhead = 4;      /* 32-tile chunks loaded ahead in expert_scan_kernel */
constexpr int kMinTileShift = 8;   /* queue tiles of at least 256 routes */
constexpr size_t kDefaultSmem = 48 * 1024; /* static + dynamic, without opting in */
constexpr size_t kStaticSmem = 1024;       /* bound on the token kernels' static shared memory */
static_assert(kMaxTokenWarps * (sizeof(int) + sizeof(double)) <= kStaticSmem,
              "route_tokens_kernel's static shared memory exceeds its reserve");

/* Inputs of the per-token selection, shared by the forward and backward
 * kernels. Each warp owns `words` 4-byte words of dynamic shared memory:
 * X [pad(E)] scores p, Y [pad(E)] selection scores s, Gs [pad(G)] group
 * scores, CI [K] chosen experts, CP [K] their p. */
struct SelectArgs {
  const float *logits; /* [T, E] */
  const float *bias;   /* [E] or NULL */
  int T, E, K, G, TG;
  int sigmoid;  /* score function is EPX_SCORE_SIGMOID */
  int need_lse; /* sigmoid: also compute sum(exp(l - max)) for the z-loss */
  int glanes;   /* lanes that reduce one group's top-2 together (a power of 2, glanes * G <= 32) */
  unsigned gmagic; /* e / (E / G) == umulhi(e, gmagic) when nonzero */
  int words, y, g, ci, cp;
};

struct TokenState {
  float m;      /* max logit */
  float sumexp; /* sum_e exp(l - m) (softmax, or sigmoid with need_lse) */
  float psum;   /* sum_e p (sigmoid) */
  float S;      /* sum of the chosen p in k order */
};

struct ForwardArgs {
  SelectArgs s;
  int select;         /* 0: only check finiteness and count valid tokens */
  int renorm;
  float scale;
  int by_token;       /* queue order (t, k) instead of (k, t) */
  int drop_nonfinite; /* 0: flag the first non-finite token in *bad */
  int *qe;            /* [N] expert of each route in queue order (-1: none), or NULL */
  float *qw;          /* [N] its weight */
  int *hist;          /* [E, n_tiles] routes per (expert, queue tile) */
  int n_tiles, tile_shift;
  int *valid;         /* tokens with finite logits, or NULL */
  int *bad;           /* max over non-finite tokens of T - t (0: none) */
  double *apart;      /* [E, gridDim.x] per-block sums of q over valid tokens, or NULL */
  double *zpart;      /* [gridDim.x] per-block sums of logsumexp^2, or NULL */
};

struct ScanArgs {
  const int *hist;
  int n_tiles, E, K;
  int *base;        /* [n_tiles, E] exclusive scan of hist along the queue */
  int *counts;      /* [E] */
  int *counts_out;  /* the caller's expert_counts or NULL */
  const double *apart;
  int n_blk;
  double *colsum;   /* [E] */
  const int *bad;
  unsigned *ticket;
  int finalize;
  int *offsets;     /* [E + 1] exclusive scan of counts, or NULL */
  const int *valid;
  const double *zpart;
  float *aux_out, *z_out;
  double aux_coeff, z_coeff;
};

struct AssignArgs {
  const int *qe;
  const float *qw;
  const int *base;
  int N, T, K, E, by_token, n_tiles, tile_shift;
  int mode;  /* 0 dropless, 1 drop by position, 2 drop by probability */
  int C;
  int *idx;
  float *w;
  int *loc;
  const int *offsets;
  unsigned long long *keys; /* [N] sort keys at offsets[e] + position */
  int *rq;                  /* [N] queue index at offsets[e] + position */
  const int *bad;
};

struct ProbArgs {
  const int *counts, *offsets;
  const unsigned long long *sorted; /* keys, each expert's segment in descending order */
  const int *rq;
  const float *qw;
  int *flag; /* [N] kept marks at offsets[e] + position */
  int E, T, K, C, by_token;
  int *idx;
  float *w;
  int *loc;
  const int *bad;
};

struct BackwardArgs {
  SelectArgs s;
  int renorm;
  float scale;
  const int *topk_idx;  /* the forward's output, or NULL */
  const float *grad_w;  /* [T, K] or NULL */
  const int *counts;    /* [E] pre-drop routes per expert (aux) */
  const int *valid;     /* valid tokens (aux, z) */
  double aux_scale;     /* grad_aux_loss * aux_loss_coeff */
  double z_scale;       /* grad_z_loss * z_loss_coeff */
  float *grad;          /* [T, E] */
  const int *bad;
};

/* One pad word every 32 so that lane-strided and group-strided accesses of
 * a warp's arrays fall in distinct banks. */
__device__ __forceinline__ int pad(int i) { return i + (i >> 5); }

/* Marks an entry as out of the running: NaN never compares greater or equal. */
__device__ __forceinline__ float removed() { return __int_as_float(0x7fffffff); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

/* A 32-bit key that orders like the float (larger value, larger key); 0
 * for removed (NaN) entries, which never win. -0 counts as +0, as it
 * compares equal. */
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned u = __float_as_uint(v + 0.0f);
  return isnan(v) ? 0u : ((u & 0x80000000u) ? ~u : (u | 0x80000000u));
}

/* The best entry among a[lane], a[lane + 32], ... below n: its key and
 * index (0, INT_MAX when there is none). Lower index on ties. */
__device__ void lane_best(const float *a, int n, int lane, unsigned &bk, int &bi) {
  bk = 0u;
  bi = INT_MAX;
  for (int i = lane; i < n; i += 32) {
    const unsigned k = order_key(a[pad(i)]);
    if (k > bk) {
      bk = k;
      bi = i;
    }
  }
}

/* The warp's best entry (larger value, then lower index), the same on every
 * lane; -1 when no lane has one. */
__device__ __forceinline__ int warp_argmax(unsigned key, int index) {
  const unsigned best = __reduce_max_sync(kFull, key);
  const unsigned win = __reduce_min_sync(kFull, key == best ? (unsigned)index : 0xffffffffu);
  return best == 0u ? -1 : (int)win;
}

/* Group of expert e (groups of gs experts). */
__device__ __forceinline__ int group_of(const SelectArgs &a, int e, int gs) {
  return a.gmagic ? (int)__umulhi((unsigned)e, a.gmagic) : (gs == 1 ? e : e / gs);
}

/* Whether every logit of token t is finite (warp-uniform). */
__device__ bool row_finite(const SelectArgs &a, int t, int lane) {
  const float *row = a.logits + (size_t)t * a.E;
  int fin = 1;
  for (int e = lane; e < a.E; e += 32) fin &= isfinite(row[e]) ? 1 : 0;
  return __all_sync(kFull, fin) != 0;
}

/* Scores, group-limited top-k of token t (steps 1-4 of the routing spec).
 * Returns false, with nothing else computed, when a logit is not finite.
 * On return X holds p, CI/CP the K choices best first (CI = -1 only if no
 * expert was left), and st the token's sums. */
__device__ bool token_select(const SelectArgs &a, int t, float *X, float *Y, float *Gs, int *CI,
                             float *CP, int lane, TokenState &st) {
  const float *row = a.logits + (size_t)t * a.E;
  const int E = a.E;
  float m = -INFINITY;
  int fin = 1;
#pragma unroll 4
  for (int e = lane; e < E; e += 32) {
    float l = row[e];
    fin &= isfinite(l) ? 1 : 0;
    m = fmaxf(m, l);
    X[pad(e)] = l;
  }
  if (!__all_sync(kFull, fin)) return false;
  m = warp_max(m);

  float sumexp = 0.f, psum = 0.f;
  if (!a.sigmoid) {
    for (int e = lane; e < E; e += 32) {
      float ex = expf(X[pad(e)] - m);
      X[pad(e)] = ex;
      sumexp += ex;
    }
    sumexp = warp_sum(sumexp);
    for (int e = lane; e < E; e += 32) {
      float p = X[pad(e)] / sumexp;
      X[pad(e)] = p;
      Y[pad(e)] = a.bias ? p + a.bias[e] : p;
    }
  } else {
    for (int e = lane; e < E; e += 32) {
      float l = X[pad(e)];
      if (a.need_lse) sumexp += expf(l - m);
      float p = 1.0f / (1.0f + expf(-l));
      X[pad(e)] = p;
      psum += p;
      Y[pad(e)] = a.bias ? p + a.bias[e] : p;
    }
    if (a.need_lse) sumexp = warp_sum(sumexp);
    psum = warp_sum(psum);
  }
  __syncwarp();

  if (a.G > 1) {
    /* Group score: the sum of its two best s (its best for one expert). The
     * glanes lanes of a group each take every glanes-th expert, then merge
     * their top-2 pairs. */
    const int gs = E / a.G, L = a.glanes, sub = lane & (L - 1);
    for (int g0 = 0; g0 < a.G; g0 += 32 / L) {
      const int g = g0 + lane / L;
      float b1 = -INFINITY, b2 = -INFINITY;
      if (g < a.G) {
        for (int i = sub; i < gs; i += L) {
          const float v = Y[pad(g * gs + i)];
          if (v > b1) {
            b2 = b1;
            b1 = v;
          } else if (v > b2) {
            b2 = v;
          }
        }
      }
      for (int o = L >> 1; o > 0; o >>= 1) {
        const float c1 = __shfl_xor_sync(kFull, b1, o), c2 = __shfl_xor_sync(kFull, b2, o);
        const float hi = fmaxf(b1, c1), lo = fmaxf(fminf(b1, c1), fmaxf(b2, c2));
        b1 = hi;
        b2 = lo;
      }
      if (g < a.G && sub == 0) Gs[pad(g)] = gs == 1 ? b1 : b1 + b2;
    }
    __syncwarp();
    /* The topk_groups best groups: a bit each in `kept` (G <= 32), or
     * marked removed() in Gs; the other groups' experts are excluded. */
    unsigned gk, kept = 0u;
    int gi;
    lane_best(Gs, a.G, lane, gk, gi);
    for (int r = 0; r < a.TG; ++r) {
      const int g = warp_argmax(gk, gi);
      if (g < 0) break;
      if (a.G <= 32) kept |= 1u << g;
      if (lane == (g & 31)) {
        Gs[pad(g)] = removed();
        lane_best(Gs, a.G, lane, gk, gi);
      }
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32) {
      const int g = group_of(a, e, gs);
      const bool keep = a.G <= 32 ? ((kept >> g) & 1u) != 0u : isnan(Gs[pad(g)]);
      if (!keep) Y[pad(e)] = removed();
    }
    __syncwarp();
  }

  /* K rounds of warp arg-max; a lane rescans only when it loses its best. */
  unsigned bk;
  int bi;
  lane_best(Y, E, lane, bk, bi);
  float S = 0.f;
  for (int k = 0; k < a.K; ++k) {
    const int e = warp_argmax(bk, bi);
    const float pw = e >= 0 ? X[pad(e)] : 0.f;
    S += pw;
    if (lane == 0) {
      CI[k] = e;
      CP[k] = pw;
    }
    if (e >= 0 && lane == (e & 31)) {
      Y[pad(e)] = removed();
      lane_best(Y, E, lane, bk, bi);
    }
  }
  __syncwarp();
  st.m = m;
  st.sumexp = sumexp;
  st.psum = psum;
  st.S = S;
  return true;
}

__device__ __forceinline__ int queue_index(int by_token, int t, int k, int T, int K) {
  return by_token ? t * K + k : k * T + t;
}

__device__ __forceinline__ size_t output_index(int by_token, int r, int T, int K) {
  int t, k;
  if (by_token) {
    t = r / K;
    k = r - t * K;
  } else {
    k = r / T;
    t = r - k * T;
  }
  return (size_t)t * K + k;
}

/* Sort key of a route: weight (order-preserving bits) above, then the
 * complement of its position so that earlier routes win ties. */
__device__ __forceinline__ unsigned long long prob_key(float w, int pos) {
  unsigned u = __float_as_uint(w + 0.0f); /* -0 -> +0: they compare equal */
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - (unsigned)pos);
}

__device__ __forceinline__ int key_position(unsigned long long key) {
  return (int)(0xffffffffu - (unsigned)(key & 0xffffffffull));
}

}  // namespace

static __global__ void __launch_bounds__(kMaxTokenWarps * 32) route_tokens_kernel(ForwardArgs a) {
  extern __shared__ float smem[];
  __shared__ int s_valid[kMaxTokenWarps];
  __shared__ double s_z[kMaxTokenWarps];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
  const SelectArgs &s = a.s;
  float *X = smem + (size_t)w * s.words;
  float *Y = X + s.y, *Gs = X + s.g, *CP = X + s.cp;
  int *CI = reinterpret_cast<int *>(X + s.ci);
  const long long tl = (long long)blockIdx.x * W + w;
  int valid = 0;
  double z = 0.0;

  if (tl < s.T) {
    const int t = (int)tl;
    TokenState st;
    const bool finite = a.select ? token_select(s, t, X, Y, Gs, CI, CP, lane, st)
                                 : row_finite(s, t, lane);
    if (finite) {
      valid = 1;
      if (a.select) {
        for (int k = lane; k < s.K; k += 32) {
          const int e = CI[k];
          float wk = CP[k];
          /* Chosen scores that all underflowed to 0 give weight 0, as on the CPU. */
          if (a.renorm) wk = st.S > 0.f ? wk / st.S : 0.f;
          wk = wk * a.scale;
          const int r = queue_index(a.by_token, t, k, s.T, s.K);
          if (a.qe) {
            a.qe[r] = e;
            a.qw[r] = e >= 0 ? wk : 0.f;
          }
          if (e >= 0) atomicAdd(a.hist + (size_t)e * a.n_tiles + (r >> a.tile_shift), 1);
        }
        if (a.apart) {
          /* q of the aux loss into Y (the selection is done with it). */
          for (int e = lane; e < s.E; e += 32)
            Y[pad(e)] = !s.sigmoid ? X[pad(e)] : (st.psum > 0.f ? X[pad(e)] / st.psum : 0.f);
        }
        if (a.zpart) {
          const double lse = (double)st.m + log((double)st.sumexp);
          z = lse * lse;
        }
      }
    } else {
      if (!a.drop_nonfinite && lane == 0) atomicMax(a.bad, s.T - t);
      if (a.qe) {
        for (int k = lane; k < s.K; k += 32) {
          const int r = queue_index(a.by_token, t, k, s.T, s.K);
          a.qe[r] = -1;
          a.qw[r] = 0.f;
        }
      }
    }
  }

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

static __global__ void __launch_bounds__(kWarps * 32) expert_scan_kernel(ScanArgs a) {
  if (a.bad && *a.bad) return;
  __shared__ int s_last;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int e = blockIdx.x * kWarps + w;
  if (e < a.E) {
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
    if (lane == 0) {
      a.counts[e] = carry;
      if (a.counts_out) a.counts_out[e] = carry;
    }
    if (a.apart) {
      const double *p = a.apart + (size_t)e * a.n_blk;
      double acc = 0.0;
#pragma unroll 4
      for (int b = lane; b < a.n_blk; b += 32) acc += p[b];
      acc = warp_sum(acc);
      if (lane == 0) a.colsum[e] = acc;
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
  const int tv = a.valid ? __ldcg(a.valid) : 0;
  if (a.aux_out) {
    double acc = 0.0;
    for (int i = lane; i < a.E; i += 32) acc += (double)__ldcg(a.counts + i) * __ldcg(a.colsum + i);
    acc = warp_sum(acc);
    if (lane == 0)
      *a.aux_out = tv > 0 ? (float)(a.aux_coeff * a.E * acc / ((double)tv * tv * a.K)) : 0.f;
  }
  if (a.z_out) {
    double acc = 0.0;
    for (int b = lane; b < a.n_blk; b += 32) acc += __ldcg(a.zpart + b);
    acc = warp_sum(acc);
    if (lane == 0) *a.z_out = tv > 0 ? (float)(a.z_coeff * acc / tv) : 0.f;
  }
}

static __device__ void assign_emit(const AssignArgs &a, int r, int e, float w, int pos) {
  const size_t o = output_index(a.by_token, r, a.T, a.K);
  if (a.mode == 2 && e >= 0) {
    const int i = a.offsets[e] + pos;
    a.keys[i] = prob_key(w, pos);
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

static __global__ void __launch_bounds__(kWarps * 32) prob_select_kernel(ProbArgs a) {
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

static __device__ __forceinline__ float backward_grad_w(const BackwardArgs &a, int t, int k) {
  const size_t i = (size_t)t * a.s.K + k;
  if (!a.grad_w || (a.topk_idx && a.topk_idx[i] < 0)) return 0.f;
  return a.grad_w[i];
}

static __global__ void __launch_bounds__(kMaxTokenWarps * 32) route_backward_kernel(BackwardArgs a) {
  if (a.bad && *a.bad) return;
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, W = blockDim.x >> 5;
  const SelectArgs &s = a.s;
  const long long tl = (long long)blockIdx.x * W + w;
  if (tl >= s.T) return;
  const int t = (int)tl, E = s.E, K = s.K;
  float *X = smem + (size_t)w * s.words;
  float *Y = X + s.y, *Gs = X + s.g, *CP = X + s.cp;
  int *CI = reinterpret_cast<int *>(X + s.ci);
  float *grow = a.grad + (size_t)t * E;
  TokenState st;
  if (!token_select(s, t, X, Y, Gs, CI, CP, lane, st)) {
    for (int e = lane; e < E; e += 32) grow[e] = 0.f;
    return;
  }

  /* d w_k / d p through renormalisation and scaling:
   * gp_j = scale * (g_j - sum_k g_k p_k / S) / S, or scale * g_j. */
  const bool wgrad = !a.renorm || st.S > 0.f; /* weights were 0 when S underflowed */
  float dot = 0.f;
  if (a.renorm && wgrad) {
    for (int k = lane; k < K; k += 32) dot += backward_grad_w(a, t, k) * (CP[k] / st.S);
    dot = warp_sum(dot);
  }
  for (int e = lane; e < E; e += 32) Y[pad(e)] = 0.f;
  __syncwarp();
  float sig = 0.f;
  for (int k = lane; k < K; k += 32) {
    const int e = CI[k];
    if (e < 0 || !wgrad) continue;
    const float g = backward_grad_w(a, t, k);
    const float gp = a.renorm ? a.scale * (g - dot) / st.S : a.scale * g;
    Y[pad(e)] = gp;
    sig += CP[k] * gp;
  }
  sig = warp_sum(sig);
  __syncwarp();

  const int tv = (a.aux_scale != 0.0 || a.z_scale != 0.0) ? *a.valid : 0;
  const bool aux = a.aux_scale != 0.0 && tv > 0;
  const bool zl = a.z_scale != 0.0 && tv > 0;
  /* aux: d/dq[t,e] = A_e = aux_scale * E * counts[e] / (Tv^2 K). */
  float ca = 0.f, beta = 0.f;
  if (aux) {
    ca = (float)(a.aux_scale * E / ((double)tv * tv * K));
    float part = 0.f;
    for (int e = lane; e < E; e += 32) part += X[pad(e)] * (ca * (float)a.counts[e]);
    beta = warp_sum(part);
    if (s.sigmoid) beta = st.psum > 0.f ? beta / st.psum : 0.f;
  }
  /* z: d/dl[t,e] = z_scale * 2 lse softmax(l)_e / Tv. */
  float cz = 0.f;
  if (zl) cz = (float)(2.0 * a.z_scale * ((double)st.m + log((double)st.sumexp)) / tv);
  const float *row = s.logits + (size_t)t * E;
  for (int e = lane; e < E; e += 32) {
    const float p = X[pad(e)], gp = Y[pad(e)];
    const float dp = s.sigmoid ? p * (1.f - p) : 0.f;
    float gl = s.sigmoid ? gp * dp : p * (gp - sig);
    if (aux) {
      const float A = ca * (float)a.counts[e];
      if (!s.sigmoid) gl += p * (A - beta);
      else if (st.psum > 0.f) gl += (A - beta) / st.psum * dp;
    }
    if (zl) gl += cz * (s.sigmoid ? expf(row[e] - st.m) / st.sumexp : p);
    grow[e] = gl;
  }
}

namespace {

epx_status_t cuda_failed(const char *fn, cudaError_t err) {
  return epx_error(err == cudaErrorMemoryAllocation ? EPX_ERROR_OUT_OF_MEMORY : EPX_ERROR_CUDA,
                   "%s: CUDA error: %s", fn, cudaGetErrorString(err));
}

#define ROUTE_CUDA(call)                                                       \
  do {                                                                         \
    cudaError_t err_ = (call);                                                 \
    if (err_ != cudaSuccess) {                                                 \
      status = cuda_failed(fn, err_);                                          \
      goto fail;                                                               \
    }                                                                          \
  } while (0)

/* Routing's scratch comes from a stream-ordered pool of its own per device
 * that keeps up to kPoolKeep bytes reserved across synchronisations (the
 * default pool returns everything at each one, and EPX_NONFINITE_ERROR
 * synchronises on every call). Created on first use, kept for the process. */
constexpr int kMaxDevices = 64;
constexpr uint64_t kPoolKeep = 64ull << 20;
std::mutex pool_mutex;
cudaMemPool_t pools[kMaxDevices];

epx_status_t scratch_alloc(const char *fn, size_t bytes, cudaStream_t stream, void **ptr) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cuda_failed(fn, err);
  if (device < 0 || device >= kMaxDevices) {
    err = cudaMallocAsync(ptr, bytes, stream);
    return err == cudaSuccess ? EPX_SUCCESS : cuda_failed(fn, err);
  }
  cudaMemPool_t pool;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    if (!pools[device]) {
      cudaMemPoolProps props = {};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      cudaMemPool_t created;
      err = cudaMemPoolCreate(&created, &props);
      if (err != cudaSuccess) return cuda_failed(fn, err);
      uint64_t keep = kPoolKeep;
      err = cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep);
      if (err != cudaSuccess) {
        cudaMemPoolDestroy(created);
        return cuda_failed(fn, err);
      }
      pools[device] = created;
    }
    pool = pools[device];
  }
  err = cudaMallocFromPoolAsync(ptr, bytes, pool, stream);
  return err == cudaSuccess ? EPX_SUCCESS : cuda_failed(fn, err);
}

/* Bump allocator over one scratch block; offsets are 256-byte aligned. */
size_t carve(size_t *cursor, size_t bytes) {
  const size_t at = *cursor;
  *cursor += (bytes + 255) & ~(size_t)255;
  return at;
}

template <typename P>
P *at(void *base, size_t offset) {
  return reinterpret_cast<P *>(static_cast<char *>(base) + offset);
}

/* Warps per block of a kernel whose warps each need per_warp bytes of
 * dynamic shared memory (at most max_warps), and the block's bytes. Raises
 * the kernel's dynamic limit when one warp needs more than the default. */
epx_status_t smem_plan(const char *fn, const void *kernel, size_t per_warp, int max_warps,
                       const epx_route_config_t *config, int *warps, size_t *bytes) {
  size_t w = (kDefaultSmem - kStaticSmem) / per_warp;
  if (w > (size_t)max_warps) w = (size_t)max_warps;
  if (w >= 1) {
    *warps = (int)w;
    *bytes = w * per_warp;
    return EPX_SUCCESS;
  }
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return cuda_failed(fn, err);
  if (per_warp + kStaticSmem > (size_t)optin)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: num_experts %d with top_k %d needs %zu bytes of shared memory per "
                     "warp, more than this GPU's %d; route on the CPU",
                     fn, config->num_experts, config->top_k, per_warp + kStaticSmem, optin);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)per_warp);
  if (err != cudaSuccess) return cuda_failed(fn, err);
  *warps = 1;
  *bytes = per_warp;
  return EPX_SUCCESS;
}

/* Per-warp shared-memory layout of the per-token kernels and their block
 * shape. */
epx_status_t token_layout(const char *fn, const void *kernel, const epx_route_config_t *config,
                          SelectArgs *s, int *warps, size_t *bytes) {
  const size_t E = (size_t)config->num_experts, K = (size_t)config->top_k;
  const size_t G = config->num_groups > 1 ? (size_t)config->num_groups : 0;
  const size_t ep = E + (E >> 5) + 1, gp = G ? G + (G >> 5) + 1 : 0;
  const size_t words = 2 * ep + gp + 2 * K;
  if (words > INT_MAX / 4)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: num_experts %d is too large for the CUDA backend; route on the CPU",
                     fn, config->num_experts);
  s->y = (int)ep;
  s->g = (int)(2 * ep);
  s->ci = (int)(2 * ep + gp);
  s->cp = (int)(2 * ep + gp + K);
  s->words = (int)words;
  return smem_plan(fn, kernel, words * 4, kMaxTokenWarps, config, warps, bytes);
}

void select_args(const epx_route_config_t *config, int T, const float *logits, const float *bias,
                 int need_lse, SelectArgs *s) {
  s->logits = logits;
  s->bias = bias;
  s->T = T;
  s->E = config->num_experts;
  s->K = config->top_k;
  s->G = config->num_groups > 1 ? config->num_groups : 1;
  s->TG = config->topk_groups;
  s->sigmoid = config->score_fn == EPX_SCORE_SIGMOID;
  s->need_lse = need_lse;
  s->glanes = 1;
  while (s->glanes * 2 * s->G <= 32) s->glanes *= 2;
  /* umulhi(e, floor((2^32 - 1) / gs) + 1) == e / gs while e * gs < 2^32,
   * which e < E <= 65536 guarantees. */
  const int gs = s->E / s->G;
  s->gmagic = (gs > 1 && s->E <= 65536) ? 0xffffffffu / (unsigned)gs + 1u : 0u;
}

/* Routes are indexed with int32 on the device (positions are int32 anyway). */
epx_status_t check_shape(const char *fn, const epx_route_config_t *config, int64_t T) {
  const int K = config->top_k;
  if (T > INT_MAX / K)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: num_tokens * top_k = %lld exceeds 2^31 - 1 on the CUDA backend; "
                     "route in smaller batches",
                     fn, (long long)T * K);
  return EPX_SUCCESS;
}

int ceil_log2(long long v) {
  int s = 0;
  while ((1LL << s) < v) ++s;
  return s;
}

}  // namespace

/* EPX_NONFINITE_ERROR's refusal, naming the first token with a NaN/Inf logit. */
static epx_status_t refuse_nonfinite(const char *fn, int token) {
  return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: logits of token %d are not finite (NaN or Inf); fix the logits or set "
                   "config->nonfinite = EPX_NONFINITE_DROP", fn, token);
}

extern "C" epx_status_t epx_cuda_route(const epx_route_config_t *config, int64_t num_tokens,
                                       const float *logits, const float *bias,
                                       epx_route_output_t *output) {
  static const char fn[] = "epx_route";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = static_cast<cudaStream_t>(config->stream);
  void *scratch = NULL;
  const int E = config->num_experts, K = config->top_k;
  const bool capacity = config->capacity_mode != 0;
  const bool by_prob = capacity && config->drop_policy == EPX_DROP_BY_PROBABILITY;
  const bool check = config->nonfinite == EPX_NONFINITE_ERROR;
  const bool want_aux = output->aux_loss != NULL, want_z = output->z_loss != NULL;
  int C = 0, T = 0, N = 0, warps = 0, awarps = 0, tile_shift = 0, n_tiles = 0, n_blk = 0;
  int h_bad = 0;
  size_t smem = 0, asmem = 0, zero_bytes = 0, total = 0, sort_bytes = 0;
  size_t o_hist = 0, o_valid = 0, o_bad = 0, o_ticket = 0, o_offsets = 0, o_qe = 0, o_qw = 0;
  size_t o_base = 0, o_counts = 0, o_colsum = 0, o_apart = 0, o_zpart = 0, o_keys = 0;
  size_t o_sorted = 0, o_rq = 0, o_flag = 0, o_sort = 0;
  ForwardArgs fa;
  ScanArgs sa;
  AssignArgs aa;
  ProbArgs pa;

  status = check_shape(fn, config, num_tokens);
  if (status != EPX_SUCCESS) return status;
  {
    double c = ceil((double)K * (double)num_tokens / (double)E * (double)config->capacity_factor);
    if (c < (double)config->min_capacity) c = (double)config->min_capacity;
    if (c > (double)INT_MAX) c = (double)INT_MAX;
    C = (int)c;
  }

  if (num_tokens == 0) {
    if (output->expert_counts)
      ROUTE_CUDA(cudaMemsetAsync(output->expert_counts, 0, sizeof(int) * (size_t)E, stream));
    if (want_aux) ROUTE_CUDA(cudaMemsetAsync(output->aux_loss, 0, sizeof(float), stream));
    if (want_z) ROUTE_CUDA(cudaMemsetAsync(output->z_loss, 0, sizeof(float), stream));
    output->capacity = capacity ? C : 0;
    output->nonfinite_tokens = -1;
    return EPX_SUCCESS;
  }

  T = (int)num_tokens;
  N = T * K;
  fa = ForwardArgs();
  select_args(config, T, logits, bias, want_z, &fa.s);
  status = token_layout(fn, reinterpret_cast<const void *>(route_tokens_kernel), config, &fa.s,
                        &warps, &smem);
  if (status != EPX_SUCCESS) return status;
  status = smem_plan(fn, reinterpret_cast<const void *>(assign_kernel), sizeof(int) * (size_t)E,
                     kWarps, config, &awarps, &asmem);
  if (status != EPX_SUCCESS) return status;
  tile_shift = ceil_log2(E);
  if (tile_shift < kMinTileShift) tile_shift = kMinTileShift;
  n_tiles = (int)(((long long)N + (1LL << tile_shift) - 1) >> tile_shift);
  n_blk = (T + warps - 1) / warps;

  /* Scratch: the zeroed region first, then the rest. */
  o_hist = carve(&total, sizeof(int) * (size_t)E * n_tiles);
  o_valid = carve(&total, sizeof(int));
  o_bad = carve(&total, sizeof(int));
  o_ticket = carve(&total, sizeof(unsigned));
  o_offsets = carve(&total, sizeof(int) * ((size_t)E + 1));
  zero_bytes = total;
  o_qe = carve(&total, sizeof(int) * (size_t)N);
  o_qw = carve(&total, sizeof(float) * (size_t)N);
  o_base = carve(&total, sizeof(int) * (size_t)n_tiles * E);
  o_counts = carve(&total, sizeof(int) * (size_t)E);
  if (want_aux) {
    o_colsum = carve(&total, sizeof(double) * (size_t)E);
    o_apart = carve(&total, sizeof(double) * (size_t)E * n_blk);
  }
  if (want_z) o_zpart = carve(&total, sizeof(double) * (size_t)n_blk);
  if (by_prob) {
    ROUTE_CUDA(cub::DeviceSegmentedRadixSort::SortKeysDescending(
        NULL, sort_bytes, static_cast<const unsigned long long *>(NULL),
        static_cast<unsigned long long *>(NULL), N, E, static_cast<const int *>(NULL),
        static_cast<const int *>(NULL), 0, 64, stream));
    o_keys = carve(&total, sizeof(unsigned long long) * (size_t)N);
    o_sorted = carve(&total, sizeof(unsigned long long) * (size_t)N);
    o_rq = carve(&total, sizeof(int) * (size_t)N);
    o_flag = carve(&total, sizeof(int) * (size_t)N);
    o_sort = carve(&total, sort_bytes);
  }

  EPX_CHECK(scratch_alloc(fn, total, stream, &scratch));
  ROUTE_CUDA(cudaMemsetAsync(scratch, 0, zero_bytes, stream));

  fa.select = 1;
  fa.renorm = config->renormalize != 0;
  fa.scale = config->scaling_factor;
  fa.by_token = config->queue_order == EPX_QUEUE_BY_TOKEN;
  fa.drop_nonfinite = !check;
  fa.qe = at<int>(scratch, o_qe);
  fa.qw = at<float>(scratch, o_qw);
  fa.hist = at<int>(scratch, o_hist);
  fa.n_tiles = n_tiles;
  fa.tile_shift = tile_shift;
  fa.valid = (want_aux || want_z) ? at<int>(scratch, o_valid) : NULL;
  fa.bad = at<int>(scratch, o_bad);
  fa.apart = want_aux ? at<double>(scratch, o_apart) : NULL;
  fa.zpart = want_z ? at<double>(scratch, o_zpart) : NULL;
  route_tokens_kernel<<<n_blk, warps * 32, smem, stream>>>(fa);
  ROUTE_CUDA(cudaGetLastError());

  sa = ScanArgs();
  sa.hist = fa.hist;
  sa.n_tiles = n_tiles;
  sa.E = E;
  sa.K = K;
  sa.base = at<int>(scratch, o_base);
  sa.counts = at<int>(scratch, o_counts);
  sa.counts_out = output->expert_counts;
  sa.apart = fa.apart;
  sa.n_blk = n_blk;
  sa.colsum = want_aux ? at<double>(scratch, o_colsum) : NULL;
  sa.bad = check ? fa.bad : NULL;
  sa.ticket = at<unsigned>(scratch, o_ticket);
  sa.finalize = by_prob || want_aux || want_z;
  sa.offsets = by_prob ? at<int>(scratch, o_offsets) : NULL;
  sa.valid = fa.valid;
  sa.zpart = fa.zpart;
  sa.aux_out = output->aux_loss;
  sa.z_out = output->z_loss;
  sa.aux_coeff = config->aux_loss_coeff;
  sa.z_coeff = config->z_loss_coeff;
  expert_scan_kernel<<<(E + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(sa);
  ROUTE_CUDA(cudaGetLastError());

  aa = AssignArgs();
  aa.qe = fa.qe;
  aa.qw = fa.qw;
  aa.base = sa.base;
  aa.N = N;
  aa.T = T;
  aa.K = K;
  aa.E = E;
  aa.by_token = fa.by_token;
  aa.n_tiles = n_tiles;
  aa.tile_shift = tile_shift;
  aa.mode = by_prob ? 2 : (capacity ? 1 : 0);
  aa.C = C;
  aa.idx = output->topk_idx;
  aa.w = output->topk_w;
  aa.loc = output->locations;
  aa.offsets = sa.offsets;
  aa.keys = by_prob ? at<unsigned long long>(scratch, o_keys) : NULL;
  aa.rq = by_prob ? at<int>(scratch, o_rq) : NULL;
  aa.bad = sa.bad;
  assign_kernel<<<(n_tiles + awarps - 1) / awarps, awarps * 32, asmem, stream>>>(aa);
  ROUTE_CUDA(cudaGetLastError());

  if (by_prob) {
    /* Offsets stay zero (empty segments) when a non-finite token stopped the
     * scan, so the sort then does nothing. */
    ROUTE_CUDA(cub::DeviceSegmentedRadixSort::SortKeysDescending(
        at<void>(scratch, o_sort), sort_bytes,
        static_cast<const unsigned long long *>(aa.keys),
        at<unsigned long long>(scratch, o_sorted), N, E, static_cast<const int *>(sa.offsets),
        static_cast<const int *>(sa.offsets + 1), 0, 64, stream));
    pa = ProbArgs();
    pa.counts = sa.counts;
    pa.offsets = sa.offsets;
    pa.sorted = at<unsigned long long>(scratch, o_sorted);
    pa.rq = aa.rq;
    pa.qw = fa.qw;
    pa.flag = at<int>(scratch, o_flag);
    pa.E = E;
    pa.T = T;
    pa.K = K;
    pa.C = C;
    pa.by_token = fa.by_token;
    pa.idx = output->topk_idx;
    pa.w = output->topk_w;
    pa.loc = output->locations;
    pa.bad = sa.bad;
    prob_select_kernel<<<(E + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(pa);
    ROUTE_CUDA(cudaGetLastError());
  }

  if (check)
    ROUTE_CUDA(cudaMemcpyAsync(&h_bad, fa.bad, sizeof(int), cudaMemcpyDeviceToHost, stream));
  ROUTE_CUDA(cudaFreeAsync(scratch, stream));
  scratch = NULL;
  if (check) {
    ROUTE_CUDA(cudaStreamSynchronize(stream));
    if (h_bad > 0) return refuse_nonfinite(fn, T - h_bad);
  }
  output->capacity = capacity ? C : 0;
  output->nonfinite_tokens = -1;
  return EPX_SUCCESS;

fail:
  if (scratch) cudaFreeAsync(scratch, stream);
  return status;
}

extern "C" epx_status_t epx_cuda_route_backward(const epx_route_config_t *config,
                                                int64_t num_tokens, const float *logits,
                                                const float *bias, const int32_t *topk_idx,
                                                const float *grad_topk_w, float grad_aux_loss,
                                                float grad_z_loss, float *grad_logits) {
  static const char fn[] = "epx_route_backward";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = static_cast<cudaStream_t>(config->stream);
  void *scratch = NULL;
  const int E = config->num_experts;
  const bool check = config->nonfinite == EPX_NONFINITE_ERROR;
  const double aux_scale = (double)grad_aux_loss * (double)config->aux_loss_coeff;
  const double z_scale = (double)grad_z_loss * (double)config->z_loss_coeff;
  const bool need_counts = aux_scale != 0.0;
  const bool need_valid = need_counts || z_scale != 0.0;
  int T = 0, warps = 0, fwarps = 0, h_bad = 0;
  size_t smem = 0, fsmem = 0, total = 0, o_counts = 0, o_valid = 0, o_bad = 0;
  ForwardArgs fa;
  BackwardArgs ba;

  status = check_shape(fn, config, num_tokens);
  if (status != EPX_SUCCESS) return status;
  if (num_tokens == 0) return EPX_SUCCESS;
  T = (int)num_tokens;

  ba = BackwardArgs();
  select_args(config, T, logits, bias, z_scale != 0.0, &ba.s);
  status = token_layout(fn, reinterpret_cast<const void *>(route_backward_kernel), config, &ba.s,
                        &warps, &smem);
  if (status != EPX_SUCCESS) return status;

  if (need_valid || check) {
    /* Pass 1: pre-drop counts (f_e of the aux loss), valid tokens, and the
     * non-finite check, before any gradient row is written. */
    fa = ForwardArgs();
    select_args(config, T, logits, bias, 0, &fa.s);
    status = token_layout(fn, reinterpret_cast<const void *>(route_tokens_kernel), config, &fa.s,
                          &fwarps, &fsmem);
    if (status != EPX_SUCCESS) return status;
    o_counts = carve(&total, sizeof(int) * (size_t)E);
    o_valid = carve(&total, sizeof(int));
    o_bad = carve(&total, sizeof(int));
    EPX_CHECK(scratch_alloc(fn, total, stream, &scratch));
    ROUTE_CUDA(cudaMemsetAsync(scratch, 0, total, stream));
    fa.select = need_counts;
    fa.renorm = config->renormalize != 0;
    fa.scale = config->scaling_factor;
    fa.drop_nonfinite = !check;
    fa.hist = at<int>(scratch, o_counts);
    fa.n_tiles = 1;
    fa.tile_shift = 31; /* every route in tile 0: hist is the per-expert count */
    fa.valid = need_valid ? at<int>(scratch, o_valid) : NULL;
    fa.bad = at<int>(scratch, o_bad);
    route_tokens_kernel<<<(T + fwarps - 1) / fwarps, fwarps * 32, fsmem, stream>>>(fa);
    ROUTE_CUDA(cudaGetLastError());
    ba.counts = fa.hist;
    ba.valid = fa.valid;
    ba.bad = check ? fa.bad : NULL;
  }

  ba.renorm = config->renormalize != 0;
  ba.scale = config->scaling_factor;
  ba.topk_idx = topk_idx;
  ba.grad_w = grad_topk_w;
  ba.aux_scale = aux_scale;
  ba.z_scale = z_scale;
  ba.grad = grad_logits;
  route_backward_kernel<<<(T + warps - 1) / warps, warps * 32, smem, stream>>>(ba);
  ROUTE_CUDA(cudaGetLastError());

  if (scratch) {
    if (check)
      ROUTE_CUDA(cudaMemcpyAsync(&h_bad, ba.bad, sizeof(int), cudaMemcpyDeviceToHost, stream));
    ROUTE_CUDA(cudaFreeAsync(scratch, stream));
    scratch = NULL;
  }
  if (check) {
    ROUTE_CUDA(cudaStreamSynchronize(stream));
    if (h_bad > 0) return refuse_nonfinite(fn, T - h_bad);
  }
  return EPX_SUCCESS;

fail:
  if (scratch) cudaFreeAsync(scratch, stream);
  return status;
}
