/* The fused NVLink exchange, part 2: combine (and dispatch_backward, the same
 * kernel). See fused.h for the contract and fused/impl.cuh for the window.
 *
 * The combine kernel (the expert-major layout with EPX_CUDA_FUSED_EXPAND_APART
 * first stages its partials, below stage_partials_kernel, and then runs the
 * rank-major form of it). Sender CTAs walk the rows this rank received, a chunk of 32
 * rank-major rows at a time, round robin over (chunk, source rank), a warp per
 * row: P(t, r) = 0 + the row's expert outputs in k order (times w when
 * weighted; float32, no fused multiply-add) — in the rank-major layout the
 * row itself — stored once into the token's home window in float32 or
 * rounded to the dtype, then the chunk's flag. Reducer CTAs walk this rank's
 * tokens, a warp per token: they wait for the chunks holding the token's
 * partials (one lane per rank, each remembering the last chunk it saw),
 * form this rank's own P(t, self) from expert_out directly (never through the
 * window), and add the partials in ascending rank order in float32:
 * out[t] = round(P(t, r0) + P(t, r1) + ...), zeros for a token with no route.
 * The bits equal the CPU backend's and the host-API exchange's.
 *
 * Bytes per rank (R_in rows received, R_out rows sent home, s dtype size,
 * p partial size): R_in * k_r * H * s read and R_in * H * p written over
 * NVLink by the senders; R_out * H * p + own routes' rows read and T * H * s
 * written by the reducers. */
#include <cuda_runtime.h>

#include "cuda/fused/impl.cuh"

using namespace epx_fused_impl;

namespace {

constexpr int kVecs = 4; /* 16-byte vectors per lane per step */

struct combine_shared {
  int64_t rbase[EPX_FUSED_MAX_RANKS + 1], rcount[EPX_FUSED_MAX_RANKS];
  int bad;
};

__device__ int64_t chunks_of(int64_t rows) { return (rows + kChunk - 1) / kChunk; }

/* part = 0 + the sum over the valid k-slots (bits of `valid`, ascending k)
 * of (w_k *) row_k, for the step of vectors at v0, all float32 without FMA;
 * the next row's loads are issued before the current row is added. */
template <typename T>
__device__ __forceinline__ void sum_rows_step(float (&part)[kVecs][epx_vec<T>::n], const uint4 *eo, int64_t nvec,
                                              int64_t v0, unsigned valid, int32_t my_row, float my_w, int weighted,
                                              int lane) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
#pragma unroll
  for (int u = 0; u < kVecs; u++)
#pragma unroll
    for (int e = 0; e < n; e++) part[u][e] = 0.0f;
  if (!valid) return;
  uint4 cur[kVecs], nxt[kVecs];
  unsigned m = valid;
  int k = __ffs(m) - 1;
  m &= m - 1;
  int64_t row = __shfl_sync(0xffffffffu, my_row, k);
  float wk = __shfl_sync(0xffffffffu, my_w, k);
#pragma unroll
  for (int u = 0; u < kVecs; u++) {
    const int64_t i = v0 + u * 32 + lane;
    if (i < nvec) cur[u] = ld_stream(eo + row * nvec + i);
  }
  for (;;) {
    const bool more = m != 0;
    float w_next = 0.0f;
    if (more) {
      k = __ffs(m) - 1;
      m &= m - 1;
      row = __shfl_sync(0xffffffffu, my_row, k);
      w_next = __shfl_sync(0xffffffffu, my_w, k);
#pragma unroll
      for (int u = 0; u < kVecs; u++) {
        const int64_t i = v0 + u * 32 + lane;
        if (i < nvec) nxt[u] = ld_stream(eo + row * nvec + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kVecs; u++) {
      float f[n];
      vec::unpack(cur[u], f);
#pragma unroll
      for (int e = 0; e < n; e++) part[u][e] = __fadd_rn(part[u][e], weighted ? __fmul_rn(wk, f[e]) : f[e]);
    }
    if (!more) break;
#pragma unroll
    for (int u = 0; u < kVecs; u++) cur[u] = nxt[u];
    wk = w_next;
  }
}

/* P of one received row over its k-slots into dst (a row of the home window:
 * float32 when part_f32, else the dtype). */
template <typename T>
__device__ void warp_partial(char *dst, const uint4 *eo, const int32_t *rows, const float *w, int K,
                             int weighted, int part_f32, int64_t nvec, int lane) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  const int32_t my_row = lane < K ? rows[lane] : -1;
  const float my_w = lane < K ? w[lane] : 0.0f;
  const unsigned valid = __ballot_sync(0xffffffffu, my_row >= 0);
  for (int64_t v0 = 0; v0 < nvec; v0 += 32 * kVecs) {
    float acc[kVecs][n];
    sum_rows_step<T>(acc, eo, nvec, v0, valid, my_row, my_w, weighted, lane);
#pragma unroll
    for (int u = 0; u < kVecs; u++) {
      const int64_t i = v0 + u * 32 + lane;
      if (i >= nvec) continue;
      if (part_f32) {
        float4 *q = reinterpret_cast<float4 *>(dst) + i * (n / 4);
#pragma unroll
        for (int h = 0; h < n / 4; h++)
          q[h] = make_float4(acc[u][4 * h], acc[u][4 * h + 1], acc[u][4 * h + 2], acc[u][4 * h + 3]);
      } else {
        reinterpret_cast<uint4 *>(dst)[i] = vec::pack(acc[u]);
      }
    }
  }
}

template <typename T, bool kRank, bool kF32>
__device__ void send_partials(const fused_dev &d, const fused_plan_dev &p, combine_shared &sh, uint32_t seq,
                              const uint4 *eo, int weighted, int part_f32, int ns, char *slots) {
  __shared__ uint64_t bars[kMaxBulkWarps];
  uint32_t phase = 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t pe = part_f32 ? 4 : (int64_t)sizeof(T);
  if (kRank && d.bulk_warps > 0 && lane == 0 && warp < d.bulk_warps) epx_bulk_bar_init(bars + warp);
  if (!await_cts(d, seq, PH_COMBINE_CTS, sh.bad)) return;
  int64_t rounds = 0;
  for (int s = 0; s < d.W; s++)
    if (s != d.rank) rounds = max(rounds, chunks_of(sh.rcount[s]));
  for (int64_t g = blockIdx.x; g < rounds * d.W; g += ns) {
    const int64_t j = g / d.W;
    const int h = (d.rank + 1 + (int)(g % d.W)) % d.W;
    const int64_t n = min((int64_t)kChunk, sh.rcount[h] - j * kChunk);
    if (h == d.rank || n <= 0) continue;
    const int64_t q0 = sh.rbase[h] + j * kChunk;
    /* row q's partial: at its token in the home's window, or, for a
     * relayed home, at the row's index among the rows from it in this
     * rank's outbox to it */
    const bool out = relayed(d, h);
    char *home = out ? d.relay[h] + d.relay_off_rows : d.peer[h] + d.off_part + (int64_t)d.rank * d.maxT * d.H * pe;
    auto part_of = [&](int64_t q) { return home + (out ? q - sh.rbase[h] : (int64_t)p.pair_token[q]) * d.H * pe; };
    if (kRank && kF32) {
      /* staged float32 partials: rows of H floats, moved by the warps (the
       * bulk path's slots hold rows of the dtype) */
      const int64_t nv = epx_payload_partial_row_bytes(d.H) / EPX_PAYLOAD_VECTOR_BYTES;
      for (int64_t i = warp; i < n; i += kWarps)
        warp_copy<false>(reinterpret_cast<uint4 *>(part_of(q0 + i)), eo + (q0 + i) * nv, nv, lane);
    } else if (kRank) {
      /* a rank-major row (or a staged expert-major partial) is its own
       * partial: moved as is */
      send_chunk(
          d, n, [&](int64_t i) { return eo + (q0 + i) * d.nvec; },
          [&](int64_t i) { return reinterpret_cast<uint4 *>(part_of(q0 + i)); }, bars, phase, slots);
    } else {
      for (int64_t i = warp; i < n; i += kWarps) {
        const int64_t q = q0 + i;
        warp_partial<T>(part_of(q), eo, p.pair_rows + q * p.K, p.pair_w + q * p.K, p.K, weighted, part_f32, d.nvec,
                        lane);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0 && !relayed(d, h)) {
      __threadfence_system();
      st_release_sys(flag_at(d.peer[h], d.off_cflag, (int64_t)d.rank * d.max_chunks + j), seq + 1);
    }
  }
}

/* Expert-major: out[t] from this rank's own rows and the peers' partials
 * (see the file comment); has: the token's ranks, q_self: its own rank-major
 * row or -1. */
/* A step of a token's out row, vectors v0 + u * 32 + lane below nvec: the
 * sums acc, or zeros where no row was added (first). */
template <typename vec, int U>
__device__ __forceinline__ void store_sums(uint4 *row, float (&acc)[U][vec::n], bool first, int64_t v0, int64_t nvec,
                                           int lane) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int64_t i = v0 + u * 32 + lane;
    if (i >= nvec) continue;
    if (first)
#pragma unroll
      for (int e = 0; e < vec::n; e++) acc[u][e] = 0.0f;
    row[i] = vec::pack(acc[u]);
  }
}

template <typename T>
__device__ void reduce_token(const fused_dev &d, const fused_plan_dev &p, const uint4 *eo, uint4 *out, int64_t t,
                             unsigned has, int64_t q_self, int weighted, int part_f32, int lane) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  const int64_t pe = part_f32 ? 4 : (int64_t)sizeof(T);
  const int K = p.K;
  int32_t my_row = -1;
  float my_w = 0.0f;
  if (q_self >= 0 && lane < K) {
    my_row = p.pair_rows[q_self * K + lane];
    my_w = p.pair_w[q_self * K + lane];
  }
  const unsigned valid = __ballot_sync(0xffffffffu, my_row >= 0);
  for (int64_t v0 = 0; v0 < d.nvec; v0 += 32 * kVecs) {
    float acc[kVecs][n];
    bool first = true;
    for (unsigned m = has; m; m &= m - 1) {
      const int r = __ffs(m) - 1;
      float part[kVecs][n];
      if (r == d.rank) {
        /* P(t, self) from expert_out, the senders' loop */
        sum_rows_step<T>(part, eo, d.nvec, v0, valid, my_row, my_w, weighted, lane);
        if (!part_f32)
#pragma unroll
          for (int u = 0; u < kVecs; u++) vec::unpack(vec::pack(part[u]), part[u]);
      } else {
        const char *src = d.local + d.off_part + ((int64_t)r * d.maxT + t) * d.H * pe;
#pragma unroll
        for (int u = 0; u < kVecs; u++) {
          const int64_t i = v0 + u * 32 + lane;
          float f[n];
          if (i < d.nvec) {
            if (part_f32) {
              const float4 *s4 = reinterpret_cast<const float4 *>(src) + i * (n / 4);
#pragma unroll
              for (int h = 0; h < n / 4; h++) {
                const float4 v = __ldcg(s4 + h);
                f[4 * h] = v.x, f[4 * h + 1] = v.y, f[4 * h + 2] = v.z, f[4 * h + 3] = v.w;
              }
            } else {
              vec::unpack(__ldcg(reinterpret_cast<const uint4 *>(src) + i), f);
            }
          } else {
#pragma unroll
            for (int e = 0; e < n; e++) f[e] = 0.0f;
          }
#pragma unroll
          for (int e = 0; e < n; e++) part[u][e] = __fadd_rn(0.0f, f[e]);
        }
      }
#pragma unroll
      for (int u = 0; u < kVecs; u++)
#pragma unroll
        for (int e = 0; e < n; e++) acc[u][e] = first ? part[u][e] : __fadd_rn(acc[u][e], part[u][e]);
      first = false;
    }
    store_sums<vec>(out + t * d.nvec, acc, first, v0, d.nvec, lane);
  }
}

/* Rank-major: each P(t, r) is a row (this rank's in expert_out, the others'
 * in the window); the ranks two at a time, so both rows' loads are in flight
 * before the first add. kF32: the rows are float32 (staged expert-major
 * partials of a 16-bit dtype: two 16-byte vectors per vector of out). */
constexpr int kRankVecs = 6;
template <typename T, bool kF32>
__device__ void reduce_token_rank(const fused_dev &d, const uint4 *eo, uint4 *out, int64_t t, unsigned has,
                                  int64_t q_self, int lane) {
  using vec = epx_vec<T>;
  /* R row vectors per out vector; the same bytes in flight either way (a
   * float32 row at kRankVecs vectors spilled registers) */
  constexpr int R = kF32 ? 2 : 1, n = vec::n, U = kRankVecs / R;
  static_assert(!kF32 || n == 8, "float32 rows stand for 16-bit dtypes");
  const int64_t row_vecs = d.nvec * R;
  const uint4 *part = reinterpret_cast<const uint4 *>(d.local + d.off_part);
  for (int64_t v0 = 0; v0 < d.nvec; v0 += 32 * U) {
    float acc[U][n];
    bool first = true;
    for (unsigned m = has; m;) {
      const int r0 = __ffs(m) - 1;
      m &= m - 1;
      const int r1 = m ? __ffs(m) - 1 : -1;
      if (m) m &= m - 1;
      const uint4 *s0 = r0 == d.rank ? eo + q_self * row_vecs : part + ((int64_t)r0 * d.maxT + t) * row_vecs;
      const uint4 *s1 = r1 < 0 ? nullptr
                        : r1 == d.rank ? eo + q_self * row_vecs
                                       : part + ((int64_t)r1 * d.maxT + t) * row_vecs;
      uint4 a[U][R], b[U][R];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int64_t i = v0 + u * 32 + lane;
        if (i >= d.nvec) continue;
#pragma unroll
        for (int j = 0; j < R; j++) {
          a[u][j] = r0 == d.rank ? ld_stream(s0 + i * R + j) : __ldcg(s0 + i * R + j);
          if (s1) b[u][j] = r1 == d.rank ? ld_stream(s1 + i * R + j) : __ldcg(s1 + i * R + j);
        }
      }
      /* a row's vector as n floats */
      auto unpack = [](const uint4 (&v)[R], float (&f)[n]) {
        if constexpr (kF32) {
          const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
#pragma unroll
          for (int e = 0; e < 8; e++) f[e] = __uint_as_float(w[e]);
        } else {
          vec::unpack(v[0], f);
        }
      };
#pragma unroll
      for (int u = 0; u < U; u++) {
        float f[n];
        unpack(a[u], f);
#pragma unroll
        for (int e = 0; e < n; e++) {
          const float p = __fadd_rn(0.0f, f[e]);
          acc[u][e] = first ? p : __fadd_rn(acc[u][e], p);
        }
        if (s1) {
          unpack(b[u], f);
#pragma unroll
          for (int e = 0; e < n; e++) acc[u][e] = __fadd_rn(acc[u][e], __fadd_rn(0.0f, f[e]));
        }
      }
      first = false;
    }
    store_sums<vec>(out + t * d.nvec, acc, first, v0, d.nvec, lane);
  }
}

/* Reducer CTAs: chunks of 32 tokens round robin, a warp per token. */
template <typename T, bool kRank, bool kF32>
__device__ void reduce_tokens(const fused_dev &d, const fused_plan_dev &p, combine_shared &sh, uint32_t seq,
                              const uint4 *eo, uint4 *out, int weighted, int part_f32, int ns) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rc = blockIdx.x - ns, nr = gridDim.x - ns;
  int32_t seen = -1; /* lane r: the last chunk from rank r known complete */
  for (int64_t tc = rc; tc < chunks_of(p.T); tc += nr) {
    for (int64_t t = tc * kChunk + warp; t < min(p.T, (tc + 1) * kChunk); t += kWarps) {
      const int32_t slot = lane < d.W ? p.tok_slot[t * d.W + lane] : -1;
      bool bad = false;
      /* (a relayed rank's partials are in the window already: the relay
       * step ran between this op's two launches) */
      if (slot >= 0 && lane != d.rank && !relayed(d, lane) && slot / kChunk > seen) {
        seen = slot / kChunk;
        bad = !wait_flag(d, flag_at(d.local, d.off_cflag, (int64_t)lane * d.max_chunks + seen), seq + 1, lane,
                         PH_COMBINE_ROWS);
      }
      if (__any_sync(0xffffffffu, bad)) return;
      __syncwarp();
      const unsigned has = __ballot_sync(0xffffffffu, slot >= 0);
      const int32_t slot_self = __shfl_sync(0xffffffffu, slot, d.rank);
      const int64_t q_self = slot_self >= 0 ? sh.rbase[d.rank] + slot_self : -1;
      if constexpr (kRank) reduce_token_rank<T, kF32>(d, eo, out, t, has, q_self, lane);
      else reduce_token<T>(d, p, eo, out, t, has, q_self, weighted, part_f32, lane);
    }
  }
}

/* Which part of the op a launch of combine_kernel runs: both (ns senders,
 * the rest reducing), or, with relayed peers, the senders (every CTA; the
 * op goes on) and then, after the relay step, the reducers (every CTA). */
enum { PHASE_BOTH = 0, PHASE_SEND = 1, PHASE_REDUCE = 2 };

template <typename T, bool kRank, bool kF32>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const fused_dev d, const fused_plan_dev p,
                                                              const uint4 *eo, uint4 *out, int weighted,
                                                              int part_f32, int ns, int phase) {
  __shared__ combine_shared sh;
  extern __shared__ __align__(128) char slots[]; /* bulk path: a row per copying warp */
  if (failed(d)) return;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x < d.W) sh.rcount[threadIdx.x] = p.info[ii.rcount + threadIdx.x];
  if (threadIdx.x <= d.W) sh.rbase[threadIdx.x] = p.info[ii.rbase + threadIdx.x];
  if (threadIdx.x == 0) sh.bad = 0;
  send_cts(d, seq);
  __syncthreads();
  if (phase == PHASE_SEND) ns = gridDim.x;
  if (phase == PHASE_REDUCE) ns = 0;
  if ((int)blockIdx.x < ns) send_partials<T, kRank, kF32>(d, p, sh, seq, eo, weighted, part_f32, ns, slots);
  else reduce_tokens<T, kRank, kF32>(d, p, sh, seq, eo, out, weighted, part_f32, ns);
  if (phase != PHASE_SEND) end_op(d, seq);
}

/* The combine kernel's launch: one, or with relayed peers its senders, the
 * relay step of the partials (element size pe) and its reducers. */
template <typename T, bool kRank, bool kF32>
cudaError_t launch_combine(epx_fused_t *f, const epx_fused_plan_t *plan, const uint4 *eo, uint4 *out, int weighted,
                           int part_f32, int n, int ns, size_t smem, int64_t pe, cudaStream_t stream) {
  if (!f->dev.relay_mask) {
    combine_kernel<T, kRank, kF32><<<n, kThreads, smem, stream>>>(f->dev, plan->dev, eo, out, weighted, part_f32, ns,
                                                                  PHASE_BOTH);
    return cudaGetLastError();
  }
  combine_kernel<T, kRank, kF32><<<n, kThreads, smem, stream>>>(f->dev, plan->dev, eo, out, weighted, part_f32, ns,
                                                                PHASE_SEND);
  const cudaError_t e = epx_fused_relay_partials_in(f, plan, pe, stream);
  if (e != cudaSuccess) return e;
  combine_kernel<T, kRank, kF32><<<n, kThreads, smem, stream>>>(f->dev, plan->dev, eo, out, weighted, part_f32, ns,
                                                                PHASE_REDUCE);
  return cudaGetLastError();
}

/* Expert-major, reduced apart (EPX_CUDA_FUSED_EXPAND_APART; float32
 * partials where the window's payload rows are float32 rows, config
 * f32_rows): before the combine kernel, every SM forms each received row's
 * P(t, r), rounded to the dtype or in float32 (warp_partial: the senders'
 * own loop, so the same bits), into this rank's window rows, which no peer
 * writes before this rank's next dispatch-like launch (its clear-to-send).
 * Those rows are a rank-major layout's rows (a row per received pair, its
 * own partial), so the rank-major combine kernel moves and sums them as they
 * are: its senders and its reducers, which load two ranks' rows at a time
 * (the expert-major reducer, one rank at a time, made the apart combine
 * slower than the host path's: bench/NOTES.md, "v0.4 house"). */
template <typename T>
__global__ void __launch_bounds__(kThreads) stage_partials_kernel(const fused_dev d, const fused_plan_dev p,
                                                                  const uint4 *eo, int weighted, int part_f32) {
  __shared__ int64_t s_pairs;
  if (failed(d)) return;
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x == 0) s_pairs = p.info[ii.rbase + d.W];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  char *pay = d.local + d.off_pay;
  const int64_t stride = part_f32 ? epx_payload_partial_row_bytes(d.H) : d.row_bytes;
  for (int64_t q = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); q < s_pairs; q += (int64_t)gridDim.x * kWarps)
    warp_partial<T>(pay + q * stride, eo, p.pair_rows + q * p.K, p.pair_w + q * p.K, p.K, weighted, part_f32,
                    d.nvec, lane);
}

template <typename T>
cudaError_t launch_typed(epx_fused_t *f, const epx_fused_plan_t *plan, const uint4 *eo, uint4 *out, int weighted,
                         int part_f32, int n, int ns, cudaStream_t stream) {
  if (plan->dev.expert_major) {
    /* float32 partials are staged where the window's payload rows are
     * float32 rows (epx_fused_config_t.f32_rows) */
    const bool stage = (epx_cuda_launch_flags() & EPX_CUDA_FUSED_EXPAND_APART) &&
                       (!part_f32 || f->dev.pay_row_bytes >= epx_payload_partial_row_bytes(f->dev.H));
    if (!stage)
      return launch_combine<T, false, false>(f, plan, eo, out, weighted, part_f32, n, ns, 0,
                                             part_f32 ? 4 : (int64_t)sizeof(T), stream);
    stage_partials_kernel<T><<<2 * f->num_sms, kThreads, 0, stream>>>(f->dev, plan->dev, eo, weighted, part_f32);
    /* from here the partials are the expert_out of a rank-major combine */
    eo = reinterpret_cast<const uint4 *>(f->dev.local + f->dev.off_pay);
    weighted = 0;
    if constexpr (sizeof(T) == 2) { /* float32 partials differ from the dtype's only for 16-bit dtypes */
      if (part_f32) return launch_combine<T, true, true>(f, plan, eo, out, 0, 1, n, ns, 0, 4, stream);
    }
  }
  /* the bulk path's slots (rank-major senders) */
  const size_t smem = (size_t)f->dev.bulk_warps * (size_t)epx_bulk_slot_bytes(f->dev.row_bytes);
  if (smem > 0) {
    /* set once per device */
    const cudaError_t e = epx_cuda_kernel_smem_here((const void *)combine_kernel<T, true, false>, smem);
    if (e != cudaSuccess) return e;
  }
  return launch_combine<T, true, false>(f, plan, eo, out, weighted, part_f32, n, ns, smem,
                                        part_f32 ? 4 : (int64_t)sizeof(T), stream);
}

}  // namespace

extern "C" cudaError_t epx_fused_combine_launch(epx_fused_t *f, const epx_fused_plan_t *plan,
                                                const void *expert_out, void *out, int weighted,
                                                epx_combine_precision_t precision, int32_t num_ctas,
                                                int32_t reduce_ctas, cudaStream_t stream) {
  const bool expert = plan->dev.expert_major != 0;
  if ((!out && plan->dev.T > 0) || (!expert && weighted)) return cudaErrorInvalidValue;
  const int n = epx_fused_launch_ctas(f, num_ctas);
  int nr = reduce_ctas > 0 ? reduce_ctas : epx_fused_receivers(n);
  if (nr > n - 1) nr = n - 1;
  /* float32 partials differ from the dtype's only for 16-bit payloads in the
   * expert-major layout (a rank-major row is its own partial) */
  const int part_f32 = expert && precision == EPX_COMBINE_PARTIALS_FLOAT32 && f->config.dtype != EPX_FLOAT32;
  const uint4 *eo = static_cast<const uint4 *>(expert_out);
  uint4 *o = static_cast<uint4 *>(out);
  return epx_payload_visit(f->config.dtype, [&](auto tag) {
    return launch_typed<typename decltype(tag)::type>(f, plan, eo, o, weighted, part_f32, n, n - nr, stream);
  });
}

extern "C" cudaError_t epx_fused_dispatch_backward_launch(epx_fused_t *f, const epx_fused_plan_t *plan,
                                                          const void *grad_recv_x, void *grad_x, int weighted,
                                                          epx_combine_precision_t precision, int32_t num_ctas,
                                                          cudaStream_t stream) {
  return epx_fused_combine_launch(f, plan, grad_recv_x, grad_x, weighted, precision, num_ctas, 0, stream);
}
