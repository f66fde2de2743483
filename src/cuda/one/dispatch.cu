/* Scatter on one GPU: a source row per token copied (or scaled by its route's
 * weight) into each of its K recv rows — dispatch, and combine_backward with
 * the routing-weight gradient — plus the zeros of padding and empty rows.
 *
 * A warp per token (the launcher can cut a row into 2, 4 or 8 slices of whole
 * 128-byte lines, a warp each; measured no faster, so not by default) reads
 * its row once, 512 B per step (32 lanes x 16 B, coalesced; 2 KB where it
 * forms dots, see launch.h) — the first step's loads issued before the
 * token's rows are known — and writes each step to each of the token's rows.
 * Extra blocks after the token blocks zero the rows whose row_src is -1.
 *
 * Bytes moved (s = dtype size, T_r = tokens with a route, R = valid routes,
 * N = recv rows, Z = padding/empty rows among them):
 *   dispatch:                 T_r*H*s read + (R + Z)*H*s = N*H*s written
 *   combine_backward:         the same, + R*H*s read of expert_out with grad_w
 *   plus 4*T*K route rows (+ 4*T*K weights) and 4*N row_src: under 1%. */
#include <cuda_runtime.h>

#include "cuda/one/move.cuh"

namespace {

constexpr int kWarps = epx_move_warps;

/* src: the token rows [T, nvec]; dst: the routed rows [rows, nvec]; other
 * [rows, nvec]; w scales. */
struct scatter_args : epx_move_args {
  const int32_t *row_src; /* [row_bound] or NULL: no zeroing */
  const int64_t *rows_valid;
  int64_t row_bound;
  int64_t token_blocks;
};

/* Zeroes the rows r < min(*rows_valid, row_bound) with row_src[r] < 0: a warp
 * per 32 rows finds them with one ballot, then writes each with the warp. */
__device__ void zero_rows(const scatter_args &a, int64_t block) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  epx_zero_empty_rows(a.row_src, a.rows_valid, a.row_bound, (block * kWarps + warp) * 32, lane, [&](int64_t r) {
    uint4 *d = a.dst + r * a.nvec;
    for (int i = lane; i < a.nvec; i += 32) d[i] = zero;
  });
}

template <typename T, bool kScale, bool kDot>
__global__ void __launch_bounds__(kWarps * 32) scatter_kernel(const scatter_args a) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  /* the dots' order is fixed by EPX_CUDA_MOVE_VECS (see launch.h) */
  constexpr int kVecs = kDot ? EPX_CUDA_MOVE_VECS : EPX_CUDA_SCATTER_VECS;
  if (blockIdx.x >= a.token_blocks) {
    zero_rows(a, (int64_t)blockIdx.x - a.token_blocks);
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t gw = (int64_t)blockIdx.x * kWarps + warp;
  const int64_t t = gw >> a.wpt_shift;
  const int part = (int)(gw & ((1 << a.wpt_shift) - 1));
  const bool active = t < a.tokens;
  if (!kDot && !active) return;

  /* The token's valid slots, compacted in k order: row, slot, weight; and a
   * dot accumulator per slot (this warp's slice). */
  extern __shared__ int32_t s_table[];
  int32_t *s_row = s_table + (size_t)warp * 4 * a.k;
  int32_t *s_slot = s_row + a.k;
  float *s_w = reinterpret_cast<float *>(s_slot + a.k);
  float *s_dot = s_w + a.k;
  if (active) {
    /* The first step of the source row does not depend on the routing: its
     * loads go out before the token's rows are read. */
    const int v_begin = part * (int)a.slice, v_end = (int)min(a.nvec, (int64_t)v_begin + a.slice);
    const uint4 *src = a.src + t * a.nvec;
    uint4 x[kVecs];
    epx_load_step(src, v_begin, v_end, lane, x);
    const int valid = epx_slot_table_fill<kScale, kDot>(a.rows, a.w, t, a.k, lane, s_row, s_slot, s_w, s_dot);

    for (int v0 = valid > 0 ? v_begin : v_end; v0 < v_end; v0 += 32 * kVecs) {
      if (v0 != v_begin) epx_load_step(src, v0, v_end, lane, x);
      for (int j = 0; j < valid; j++) {
        const int64_t row = s_row[j];
        uint4 *dst = a.dst + row * a.nvec;
        if (kScale) {
          const float w = s_w[j];
#pragma unroll
          for (int u = 0; u < kVecs; u++) {
            const int i = v0 + u * 32 + lane;
            float y[n];
            vec::unpack(x[u], y);
#pragma unroll
            for (int e = 0; e < n; e++) y[e] = __fmul_rn(w, y[e]);
            if (i < v_end) dst[i] = vec::pack(y);
          }
        } else {
#pragma unroll
          for (int u = 0; u < kVecs; u++) {
            const int i = v0 + u * 32 + lane;
            if (i < v_end) dst[i] = x[u];
          }
        }
        if (kDot) {
          const uint4 *o = a.other + row * a.nvec;
          uint4 ov[kVecs];
          epx_load_step(o, v0, v_end, lane, ov);
          float part_dot = 0.0f;
#pragma unroll
          for (int u = 0; u < kVecs; u++) {
            float xf[n], of[n];
            vec::unpack(x[u], xf);
            vec::unpack(ov[u], of);
#pragma unroll
            for (int e = 0; e < n; e++) part_dot = __fadd_rn(part_dot, __fmul_rn(xf[e], of[e]));
          }
          part_dot = epx_warp_sum(part_dot);
          if (lane == 0) s_dot[s_slot[j]] += part_dot;
        }
      }
    }
  }
  if (kDot) {
    /* grad_w: the slices' sums added in slice order by the token's first warp */
    __syncthreads();
    if (active && part == 0) epx_slices_grad_w(s_dot, a.k, a.wpt_shift, lane, a.grad_w + t * a.k);
  }
}

}  // namespace

extern "C" cudaError_t epx_cuda_scatter_launch(epx_dtype_t dtype, const void *src, void *dst,
                                               int64_t num_tokens, int64_t hidden,
                                               const int32_t *rows, int32_t top_k, const float *w,
                                               const void *other, float *grad_w,
                                               const int32_t *row_src, const int64_t *rows_valid,
                                               int64_t row_bound, int32_t warps_per_token,
                                               cudaStream_t stream) {
  scatter_args a;
  const cudaError_t err =
      epx_move_args_fill(a, dtype, src, dst, num_tokens, hidden, rows, top_k, w, other, grad_w, warps_per_token);
  if (err != cudaSuccess) return err;
  a.row_src = row_src;
  a.rows_valid = rows_valid;
  a.row_bound = row_src ? row_bound : 0;
  a.token_blocks = epx_move_token_blocks(a);
  const int64_t zero_blocks = (a.row_bound + 32 * kWarps - 1) / (32 * kWarps);
  const int64_t blocks = a.token_blocks + zero_blocks;
  if (blocks == 0) return cudaSuccess;
  const size_t shared = epx_move_shared_bytes(top_k);
  return epx_flags_visit(dtype, w != nullptr, grad_w != nullptr, [&](auto tag, auto scale, auto dot) {
    scatter_kernel<typename decltype(tag)::type, decltype(scale)::value, decltype(dot)::value>
        <<<(unsigned int)blocks, kWarps * 32, shared, stream>>>(a);
  });
}
