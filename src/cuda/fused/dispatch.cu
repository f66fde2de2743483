/* The fused exchange's dispatch (epx_fused_dispatch_launch, and
 * combine_backward, which is a dispatch of grad_out), one kernel: sender CTAs
 * copy each token's row once per destination rank straight into its final
 * rank-major row in the destination's window, a flag per chunk of 32 rows;
 * receiver CTAs expand chunks into the expert-major layout as they arrive
 * (and this rank's own rows straight from x), or, rank-major, wait for them
 * (and copy them out if asked). See fused.h for the contract and
 * fused/impl.cuh for the window. */
#include <cuda_runtime.h>
#include <string.h>

#include "cuda/common/pdl.cuh"
#include "cuda/fused/impl.cuh"

using namespace epx_fused_impl;

namespace {

/* MODE_EXPERT: the receiving CTAs expand rows as they arrive;
 * MODE_EXPERT_APART: the remote rows stay in the window (as MODE_RANK_WINDOW
 * leaves them) and expand_kernel expands every row after the exchange, over
 * every SM (EPX_CUDA_FUSED_EXPAND_APART); MODE_EXPERT_WINDOW: the same
 * without the expansion (an expert-major plan's rows only in the window, for
 * the dots of dispatch_backward's grad_w). The three expert modes leave
 * this rank's own rows in x. MODE_RANK_ENGINE: rank-major into recv_x, this
 * rank's own rows straight there, the others' left in the window for the
 * copy engine (EPX_CUDA_FUSED_COPY_ENGINE). */
enum { MODE_RANK_WINDOW = 0, MODE_RANK_COPY = 1, MODE_EXPERT = 2, MODE_EXPERT_APART = 3, MODE_EXPERT_WINDOW = 4,
       MODE_RANK_ENGINE = 5 };

__device__ __forceinline__ bool remote_rows_only(int mode) {
  return mode == MODE_EXPERT || mode == MODE_EXPERT_APART || mode == MODE_EXPERT_WINDOW;
}
/* the receivers only wait for the rows: they stay in the window */
__host__ __device__ __forceinline__ bool rows_stay(int mode) {
  return mode == MODE_RANK_WINDOW || mode == MODE_EXPERT_APART || mode == MODE_EXPERT_WINDOW ||
         mode == MODE_RANK_ENGINE;
}

struct dispatch_shared {
  int64_t sbase[EPX_FUSED_MAX_RANKS], scount[EPX_FUSED_MAX_RANKS];
  int64_t rbase[EPX_FUSED_MAX_RANKS + 1], rcount[EPX_FUSED_MAX_RANKS];
  int bad;
};

__device__ int64_t chunks_of(int64_t rows) { return (rows + kChunk - 1) / kChunk; }

/* Rows of two planes (epx_fused_dispatch_rows_launch): token t's moved row
 * is x's x_bytes at x + t * x_bytes, then x2's x2_bytes at x2 + t *
 * x2_bytes, the rest of the d.row_bytes unspecified. unit: the widest copy
 * (16, 8, 4 or 1 bytes) that x2's address and rows allow; 16: the bulk
 * copy engine loads x2's rows too. */
struct planes {
  const uint8_t *x2;
  int64_t x_bytes, x2_bytes;
  int unit;
};

/* bytes src -> dst in units of `unit`, units first, first + step, ... */
__device__ __forceinline__ void copy_units(uint8_t *dst, const uint8_t *src, int64_t bytes, int unit, int first,
                                           int step) {
  for (int64_t i = first; i < bytes / unit; i += step) {
    if (unit == 16) reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
    else if (unit == 8) reinterpret_cast<uint2 *>(dst)[i] = reinterpret_cast<const uint2 *>(src)[i];
    else if (unit == 4) reinterpret_cast<uint32_t *>(dst)[i] = reinterpret_cast<const uint32_t *>(src)[i];
    else dst[i] = src[i];
  }
}

/* send_chunk for rows of two planes: row i is token(i)'s, gathered from x
 * and pl.x2 into one row (the slot) on the way, so the rows need no packing
 * pass before the exchange. */
template <typename Token, typename Dst>
__device__ void send_chunk_planes(const fused_dev &d, const planes &pl, int64_t n, const uint8_t *x, Token token,
                                  Dst dst, uint64_t *bars, uint32_t &phase, char *slots) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (d.bulk_warps > 0) {
    if (lane == 0 && warp < d.bulk_warps) {
      char *slot = slots + (int64_t)warp * epx_bulk_slot_bytes(d.row_bytes);
      uint64_t *bar = bars + warp;
      const bool bulk2 = pl.unit == 16;
      for (int64_t i = warp; i < n; i += d.bulk_warps) {
        const int64_t t = token(i);
        const uint8_t *src2 = pl.x2 + t * pl.x2_bytes;
        epx_bulk_wait_read(); /* the last row's store has read the slot */
        epx_bulk_expect(bar, (uint32_t)(pl.x_bytes + (bulk2 ? pl.x2_bytes : 0)));
        epx_bulk_load(slot, x + t * pl.x_bytes, (uint32_t)pl.x_bytes, bar);
        if (bulk2) {
          epx_bulk_load(slot + pl.x_bytes, src2, (uint32_t)pl.x2_bytes, bar);
        } else {
          copy_units(reinterpret_cast<uint8_t *>(slot) + pl.x_bytes, src2, pl.x2_bytes, pl.unit, 0, 1);
          epx_bulk_fence_smem();
        }
        epx_bulk_wait(bar, phase);
        phase ^= 1u;
        epx_bulk_store(dst(i), slot, (uint32_t)d.row_bytes);
        epx_bulk_commit();
      }
      epx_bulk_drain();
    }
    return;
  }
  for (int64_t i = warp; i < n; i += kWarps) {
    const int64_t t = token(i);
    uint8_t *to = reinterpret_cast<uint8_t *>(dst(i));
    warp_copy<false>(reinterpret_cast<uint4 *>(to), reinterpret_cast<const uint4 *>(x + t * pl.x_bytes),
                     pl.x_bytes / 16, lane);
    copy_units(to + pl.x_bytes, pl.x2 + t * pl.x2_bytes, pl.x2_bytes, pl.unit, lane, 32);
  }
}

/* Sender CTAs: (chunk j, destination) pairs round robin, remote ranks first
 * in each round, a warp per row. */
template <bool kPlanes>
__device__ void send_rows(const fused_dev &d, const fused_plan_dev &p, dispatch_shared &sh, uint32_t seq,
                          const uint4 *x, uint4 *recv, int mode, int ns, char *slots, const planes &pl) {
  __shared__ uint64_t bars[kMaxBulkWarps];
  uint32_t phase = 0;
  if (d.bulk_warps > 0 && (threadIdx.x & 31) == 0 && (threadIdx.x >> 5) < d.bulk_warps) epx_bulk_bar_init(bars + (threadIdx.x >> 5));
  if (!await_cts(d, seq, PH_DISPATCH_CTS, sh.bad)) return;
  int64_t rounds = 0;
  for (int r = 0; r < d.W; r++) rounds = max(rounds, chunks_of(sh.scount[r]));
  for (int64_t g = blockIdx.x; g < rounds * d.W; g += ns) {
    const int64_t j = g / d.W;
    const int r = (d.rank + 1 + (int)(g % d.W)) % d.W;
    const int64_t n = min((int64_t)kChunk, sh.scount[r] - j * kChunk);
    if (n <= 0 || (remote_rows_only(mode) && r == d.rank)) continue;
    uint4 *dst = r != d.rank || mode == MODE_RANK_WINDOW ? reinterpret_cast<uint4 *>(d.peer[r] + d.off_pay) : recv;
    const int32_t *tokens = p.send_token + (int64_t)r * d.maxT + j * kChunk;
    /* a relayed peer's rows: this rank's outbox to it, at their indices */
    uint4 *rows = relayed(d, r) ? reinterpret_cast<uint4 *>(d.relay[r] + d.relay_off_rows) + j * kChunk * d.nvec
                                : dst + (sh.sbase[r] + j * kChunk) * d.nvec;
    const auto row_to = [&](int64_t i) { return rows + i * d.nvec; };
    if constexpr (kPlanes)
      send_chunk_planes(
          d, pl, n, reinterpret_cast<const uint8_t *>(x), [&](int64_t i) { return (int64_t)tokens[i]; }, row_to,
          bars, phase, slots);
    else
      send_chunk(d, n, [&](int64_t i) { return x + (int64_t)tokens[i] * d.nvec; }, row_to, bars, phase, slots);
    __syncthreads();
    if (r != d.rank && !relayed(d, r) && threadIdx.x == 0) {
      __threadfence_system();
      st_release_sys(flag_at(d.peer[r], d.off_cflag, (int64_t)d.rank * d.max_chunks + j), seq + 1);
    }
  }
}

/* One row to each of its expert-major rows (round(w * row) when weighted). */
template <typename T, bool kWindow>
__device__ void warp_expand(uint4 *recv, const uint4 *src, const int32_t *rows, const float *w, int K,
                            int weighted, int64_t nvec, int lane) {
  constexpr int U = 8; /* 4 KB of the row in flight per warp */
  const int32_t my_row = lane < K ? rows[lane] : -1;
  const float my_w = lane < K ? w[lane] : 0.0f;
  const unsigned valid = __ballot_sync(0xffffffffu, my_row >= 0);
  for (int64_t v0 = 0; v0 < nvec; v0 += 32 * U) {
    uint4 v[U];
    ld_step<kWindow>(src, v0, nvec, lane, v);
    for (unsigned m = valid; m; m &= m - 1) {
      const int k = __ffs(m) - 1;
      const int64_t row = __shfl_sync(0xffffffffu, my_row, k);
      const float wk = __shfl_sync(0xffffffffu, my_w, k);
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int64_t i = v0 + u * 32 + lane;
        if (i < nvec) recv[row * nvec + i] = weighted ? scale_vec<T>(v[u], wk) : v[u];
      }
    }
  }
}

/* Received row q (from source s) into its expert-major rows: this rank's
 * own rows from x (they never go through the window), the others' from it. */
template <typename T>
__device__ __forceinline__ void expand_pair(const fused_dev &d, const fused_plan_dev &p, const uint4 *x, uint4 *recv,
                                            int64_t q, int s, int weighted, int lane) {
  const int32_t *rows = p.pair_rows + q * p.K;
  const float *w = p.pair_w + q * p.K;
  if (s == d.rank)
    warp_expand<T, false>(recv, x + (int64_t)p.pair_token[q] * d.nvec, rows, w, p.K, weighted, d.nvec, lane);
  else
    warp_expand<T, true>(recv, reinterpret_cast<const uint4 *>(d.local + d.off_pay) + q * d.nvec, rows, w, p.K,
                         weighted, d.nvec, lane);
}

/* Receiver CTAs: (chunk j, source) pairs round robin; each waits for the
 * chunk's flag, then expands it (expert-major) or copies it out. */
template <typename T>
__device__ void receive_rows(const fused_dev &d, const fused_plan_dev &p, dispatch_shared &sh, uint32_t seq,
                             const uint4 *x, uint4 *recv, int mode, int weighted, int ns) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rc = blockIdx.x - ns, nr = gridDim.x - ns;
  const info_index ii = make_info_index(d.W, d.El);
  const uint4 *pay = reinterpret_cast<const uint4 *>(d.local + d.off_pay);
  if (mode == MODE_EXPERT) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int e = rc; e < d.El; e += nr)
      for (int64_t r = p.info[ii.eoff + e] + p.info[ii.ecount + e] + warp; r < p.info[ii.eoff + e + 1]; r += kWarps)
        for (int64_t i = lane; i < d.nvec; i += 32) recv[r * d.nvec + i] = zero;
  }
  int64_t rounds = 0;
  for (int s = 0; s < d.W; s++) rounds = max(rounds, chunks_of(sh.rcount[s]));
  if (rows_stay(mode)) {
    /* nothing to move: every thread waits for chunks of its own, so the
     * flags' round trips overlap */
    for (int64_t g = rc + (int64_t)nr * threadIdx.x; g < rounds * d.W; g += (int64_t)nr * blockDim.x) {
      const int64_t j = g / d.W;
      const int s = (int)(g % d.W);
      if (s == d.rank || relayed(d, s) || j * kChunk >= sh.rcount[s]) continue;
      if (!wait_flag(d, flag_at(d.local, d.off_cflag, (int64_t)s * d.max_chunks + j), seq + 1, s, PH_DISPATCH_ROWS))
        break;
    }
    return;
  }
  for (int64_t g = rc; g < rounds * d.W; g += nr) {
    const int64_t j = g / d.W;
    const int s = (d.rank + 1 + (int)(g % d.W)) % d.W;
    const int64_t n = min((int64_t)kChunk, sh.rcount[s] - j * kChunk);
    /* (a relayed source's rows come after the kernel: relay_rows_in) */
    if (n <= 0 || (s == d.rank && mode != MODE_EXPERT) || relayed(d, s)) continue;
    if (s != d.rank && threadIdx.x == 0 &&
        !wait_flag(d, flag_at(d.local, d.off_cflag, (int64_t)s * d.max_chunks + j), seq + 1, s, PH_DISPATCH_ROWS))
      sh.bad = 1;
    __syncthreads();
    if (sh.bad) return;
    for (int64_t i = warp; i < n; i += kWarps) {
      const int64_t q = sh.rbase[s] + j * kChunk + i;
      if (mode == MODE_RANK_COPY) warp_copy<true>(recv + q * d.nvec, pay + q * d.nvec, d.nvec, lane);
      else expand_pair<T>(d, p, x, recv, q, s, weighted, lane);
    }
  }
}

template <typename T, bool kPlanes>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const fused_dev d, const fused_plan_dev p,
                                                               const uint4 *x, uint4 *recv, int mode,
                                                               int weighted, int ns, const planes pl) {
  __shared__ dispatch_shared sh;
  extern __shared__ __align__(128) char slots[]; /* bulk path: a row per copying warp */
  if (failed(d)) return;
  const uint32_t seq = *reinterpret_cast<volatile uint32_t *>(d.ctl + CTL_SEQ);
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x < d.W) {
    sh.sbase[threadIdx.x] = p.info[ii.sbase + threadIdx.x];
    sh.scount[threadIdx.x] = p.info[ii.scount + threadIdx.x];
    sh.rcount[threadIdx.x] = p.info[ii.rcount + threadIdx.x];
  }
  if (threadIdx.x <= d.W) sh.rbase[threadIdx.x] = p.info[ii.rbase + threadIdx.x];
  if (threadIdx.x == 0) sh.bad = 0;
  send_cts(d, seq);
  __syncthreads();
  if ((int)blockIdx.x < ns) send_rows<kPlanes>(d, p, sh, seq, x, recv, mode, ns, slots, pl);
  else receive_rows<T>(d, p, sh, seq, x, recv, mode, weighted, ns);
  end_op(d, seq);
}

/* MODE_EXPERT_APART, after the exchange (every row has arrived: the
 * dispatch kernel's receiver waited for each chunk): the padding rows
 * zeroed, then a warp per rank-major row expands it into its expert-major
 * rows, this rank's own rows from x. The window's rows stay valid until this
 * rank's next dispatch-like launch (peers write them only after its
 * clear-to-send). */
template <typename T>
__global__ void __launch_bounds__(kThreads) expand_kernel(const fused_dev d, const fused_plan_dev p, const uint4 *x,
                                                          uint4 *recv, int weighted) {
  __shared__ int64_t s_rbase[EPX_FUSED_MAX_RANKS + 1];
  if (failed(d)) return; /* a wait ran out: rows are missing, the error word says which */
  const info_index ii = make_info_index(d.W, d.El);
  if (threadIdx.x <= d.W) s_rbase[threadIdx.x] = p.info[ii.rbase + threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * kWarps, gw = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  if (p.C) {
    /* capacity: every slot no route claimed (scattered over the groups) */
    for (int64_t r = gw; r < p.row_bound; r += warps)
      if (p.row_src_rank[r] < 0)
        for (int64_t i = lane; i < d.nvec; i += 32) recv[r * d.nvec + i] = zero;
  } else {
    for (int e = 0; e < d.El; e++)
      for (int64_t r = p.info[ii.eoff + e] + p.info[ii.ecount + e] + gw; r < p.info[ii.eoff + e + 1]; r += warps)
        for (int64_t i = lane; i < d.nvec; i += 32) recv[r * d.nvec + i] = zero;
  }
  for (int64_t q = gw; q < s_rbase[d.W]; q += warps) {
    const int s = source_of_row(s_rbase, d.W, q);
    expand_pair<T>(d, p, x, recv, q, s, weighted, lane);
  }
}

/* d: f->dev, or a copy whose rows are d.row_bytes wide
 * (epx_fused_dispatch_rows_launch; kPlanes: rows of two planes, pl). */
template <typename T, bool kPlanes = false>
cudaError_t launch_dispatch(epx_fused_t *f, const fused_dev &d, const epx_fused_plan_t *plan, const uint4 *x,
                            uint4 *recv, int mode, int weighted, int n, int ns, int expand_ctas, size_t smem,
                            cudaStream_t stream, const planes &pl = planes{}) {
  const fused_plan_dev &p = plan->dev;
  if (smem > 0) {
    /* set once per device */
    const cudaError_t e = epx_cuda_kernel_smem_here((const void *)dispatch_kernel<T, kPlanes>, smem);
    if (e != cudaSuccess) return e;
  }
  dispatch_kernel<T, kPlanes><<<n, kThreads, smem, stream>>>(d, p, x, recv, mode, weighted, ns, pl);
  if (d.relay_mask) {
    /* the relayed sources' rows: into recv_x (copied out) or the window's rows */
    const bool to_recv = mode == MODE_RANK_COPY || mode == MODE_RANK_ENGINE;
    const cudaError_t e = epx_fused_relay_rows_in(f, plan, to_recv ? (void *)recv : (void *)(d.local + d.off_pay),
                                                  d.row_bytes, stream);
    if (e != cudaSuccess) return e;
  }
  if (mode == MODE_EXPERT_APART) expand_kernel<T><<<expand_ctas, kThreads, 0, stream>>>(d, p, x, recv, weighted);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t epx_fused_dispatch_launch(epx_fused_t *f, const epx_fused_plan_t *plan, const void *x,
                                                 void *recv_x, int weighted, int32_t num_ctas, int32_t recv_ctas,
                                                 cudaStream_t stream) {
  const fused_dev &d = f->dev;
  void *window = epx_fused_recv_window(f);
  const bool expert = plan->dev.expert_major != 0;
  const bool in_window = !recv_x || recv_x == window;
  if ((expert && (!recv_x || (in_window && weighted))) || (!x && plan->dev.T > 0) || (!expert && weighted))
    return cudaErrorInvalidValue;
  /* capacity rows are always expanded apart (its empty slots are zeroed
   * there), and so are rows of relayed sources (they come after the kernel) */
  const bool apart =
      expert && (plan->dev.C || d.relay_mask || (epx_cuda_launch_flags() & EPX_CUDA_FUSED_EXPAND_APART));
  const int n = epx_fused_launch_ctas(f, num_ctas);
  /* Rank-major rows copied out by the copy engine: where the counts are
   * known on the host, the kernel writes this rank's own rows into recv_x
   * and leaves the peers' in the window, then a device-to-device copy per
   * run of peers; else (only under EPX_CUDA_FUSED_COPY_ENGINE) it leaves
   * every row in the window and the copy takes the bound's W * max_tokens
   * rows. Taken at budgets of up to kEngineCtas, where the receiving CTAs'
   * copy-out is what bounds the dispatch (bench/NOTES-gpu.md). */
  constexpr int kEngineCtas = 24;
  const bool engine = !expert && !in_window &&
                      ((epx_cuda_launch_flags() & EPX_CUDA_FUSED_COPY_ENGINE) ||
                       (n <= kEngineCtas && plan->counts_known));
  const bool known = engine && plan->counts_known;
  const int mode = expert      ? (in_window ? MODE_EXPERT_WINDOW : apart ? MODE_EXPERT_APART : MODE_EXPERT)
                   : in_window ? MODE_RANK_WINDOW
                   : known     ? MODE_RANK_ENGINE
                   : engine    ? MODE_RANK_WINDOW
                               : MODE_RANK_COPY;
  int nr = recv_ctas > 0 ? recv_ctas : rows_stay(mode) ? 1 : epx_fused_receivers(n);
  if (nr > n - 1) nr = n - 1;
  /* every peer relayed: every CTA sends (into the outboxes, and this
   * rank's own rows) */
  if (every_peer_relayed(d)) nr = 0;
  const uint4 *xs = static_cast<const uint4 *>(x);
  uint4 *rs = static_cast<uint4 *>(in_window || (engine && !known) ? window : recv_x);
  const size_t smem = (size_t)d.bulk_warps * (size_t)epx_bulk_slot_bytes(d.row_bytes);
  const int ex = 2 * f->num_sms; /* the expansion apart: two CTAs of 16 warps per SM */
  cudaError_t e = epx_payload_visit(f->config.dtype, [&](auto tag) {
    return launch_dispatch<typename decltype(tag)::type>(f, d, plan, xs, rs, mode, weighted, n, n - nr, ex, smem,
                                                         stream);
  });
  if (e != cudaSuccess || !engine) return e;
  char *to = static_cast<char *>(recv_x);
  const char *from = static_cast<const char *>(window);
  const size_t rb = (size_t)d.row_bytes;
  if (!known) return cudaMemcpyAsync(to, from, (size_t)d.W * (size_t)d.maxT * rb, cudaMemcpyDeviceToDevice, stream);
  /* each run of consecutive sources whose rows came through the window */
  size_t at = 0, run = 0, len = 0;
  for (int s = 0; s <= d.W && e == cudaSuccess; s++) {
    const bool through = s < d.W && s != d.rank && !relayed(d, s);
    if (through) {
      if (!len) run = at;
      len += (size_t)plan->recv_pairs[s];
    } else if (len) {
      e = cudaMemcpyAsync(to + run * rb, from + run * rb, len * rb, cudaMemcpyDeviceToDevice, stream);
      len = 0;
    }
    if (s < d.W) at += (size_t)plan->recv_pairs[s];
  }
  return e;
}

extern "C" cudaError_t epx_fused_dispatch_rows_launch(epx_fused_t *f, const epx_fused_plan_t *plan, const void *x,
                                                      int64_t x_bytes, const void *x2, int64_t x2_bytes,
                                                      int64_t row_bytes, int32_t num_ctas, cudaStream_t stream) {
  const bool two = x2 != NULL;
  if (row_bytes <= 0 || row_bytes % 16 != 0 || row_bytes > f->dev.row_bytes || (!x && plan->dev.T > 0) ||
      x_bytes <= 0 || x_bytes % 16 != 0 || (two ? x_bytes + x2_bytes > row_bytes || x2_bytes <= 0
                                                : x_bytes != row_bytes || x2_bytes != 0))
    return cudaErrorInvalidValue;
  /* the window's rows and the relay's, row_bytes apart (both hold rows of
   * the dtype: wider) */
  const fused_dev d = with_row_bytes(f->dev, row_bytes);
  const int n = epx_fused_launch_ctas(f, num_ctas);
  /* the receivers only wait for the rows (MODE_RANK_WINDOW): one CTA, none
   * where every peer is relayed */
  const int nr = every_peer_relayed(d) ? 0 : 1;
  const size_t smem = (size_t)d.bulk_warps * (size_t)epx_bulk_slot_bytes(row_bytes);
  const uint4 *xs = static_cast<const uint4 *>(x);
  uint4 *window = static_cast<uint4 *>(epx_fused_recv_window(f));
  if (!two)
    return epx_payload_visit(f->config.dtype, [&](auto tag) {
      return launch_dispatch<typename decltype(tag)::type>(f, d, plan, xs, window, MODE_RANK_WINDOW, 0, n, n - nr,
                                                           0, smem, stream);
    });
  /* rows of two planes move as bytes (MODE_RANK_WINDOW reads no element
   * type): one instantiation serves every dtype */
  const uintptr_t bits2 = (uintptr_t)x2 | (uintptr_t)x2_bytes;
  const planes pl = {static_cast<const uint8_t *>(x2), x_bytes, x2_bytes,
                     bits2 % 16 == 0 ? 16 : bits2 % 8 == 0 ? 8 : bits2 % 4 == 0 ? 4 : 1};
  return launch_dispatch<__nv_bfloat16, true>(f, d, plan, xs, window, MODE_RANK_WINDOW, 0, n, n - nr, 0, smem,
                                              stream, pl);
}

extern "C" cudaError_t epx_fused_combine_backward_launch(epx_fused_t *f, const epx_fused_plan_t *plan,
                                                         const void *grad_out, void *grad_expert_out, int weighted,
                                                         int32_t num_ctas, cudaStream_t stream) {
  return epx_fused_dispatch_launch(f, plan, grad_out, grad_expert_out, weighted, num_ctas, 0, stream);
}
