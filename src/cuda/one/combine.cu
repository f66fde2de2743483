/* Gather on one GPU: each token's rows summed in float32 in k-slot order and
 * rounded once — combine, and dispatch_backward with the routing-weight
 * gradient. The order of the adds is fixed (acc = 0; acc += w_k * row_k for
 * the valid k in order, no fused multiply-add), so the result is the same
 * bits on every run and equals the CPU engine's loop.
 *
 * A warp per token (the launcher can cut a row into 2, 4 or 8 slices of whole
 * 128-byte lines, a warp each; measured slower, so not by default); per step
 * of 1 KB of the output row (32 lanes x 2 x 16 B; 2 KB where it forms dots,
 * see launch.h) a warp reads that step of each of the token's rows, the next
 * row's loads issued before the current row is added.
 *
 * Bytes moved (s = dtype size, R = valid routes, T = tokens):
 *   combine:             R*H*s read + T*H*s written
 *   dispatch_backward:   the same, + T_r*H*s read of x with grad_w
 *   plus 4*T*K route rows (+ 4*T*K weights): under 1%. */
#include <cuda_runtime.h>

#include "cuda/one/move.cuh"

namespace {

constexpr int kWarps = epx_move_warps;

/* src: the routed rows [rows, nvec]; dst: the token rows [T, nvec]; other
 * [T, nvec]. */
using gather_args = epx_move_args;

template <typename T, bool kWeight, bool kDot>
__global__ void __launch_bounds__(kWarps * 32) gather_kernel(const gather_args a) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  /* the dots' order is fixed by EPX_CUDA_MOVE_VECS (see launch.h) */
  constexpr int kVecs = kDot ? EPX_CUDA_MOVE_VECS : EPX_CUDA_GATHER_VECS;
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
    const int valid = epx_slot_table_fill<kWeight, kDot>(a.rows, a.w, t, a.k, lane, s_row, s_slot, s_w, s_dot);

    const int v_begin = part * (int)a.slice, v_end = (int)min(a.nvec, (int64_t)v_begin + a.slice);
    uint4 *dst = a.dst + t * a.nvec;
    for (int v0 = v_begin; v0 < v_end; v0 += 32 * kVecs) {
      float acc[kVecs][n];
#pragma unroll
      for (int u = 0; u < kVecs; u++)
#pragma unroll
        for (int e = 0; e < n; e++) acc[u][e] = 0.0f;
      float of[kVecs][n];
      if (kDot) {
        uint4 ov[kVecs];
        epx_load_step(a.other + t * a.nvec, v0, v_end, lane, ov);
#pragma unroll
        for (int u = 0; u < kVecs; u++) vec::unpack(ov[u], of[u]);
      }
      uint4 cur[kVecs];
      if (valid > 0) epx_load_step(a.src + (int64_t)s_row[0] * a.nvec, v0, v_end, lane, cur);
      for (int j = 0; j < valid; j++) {
        uint4 next[kVecs];
        if (j + 1 < valid) epx_load_step(a.src + (int64_t)s_row[j + 1] * a.nvec, v0, v_end, lane, next);
        const float w = kWeight ? s_w[j] : 1.0f;
        float part_dot = 0.0f;
#pragma unroll
        for (int u = 0; u < kVecs; u++) {
          float f[n];
          vec::unpack(cur[u], f);
#pragma unroll
          for (int e = 0; e < n; e++) {
            acc[u][e] = __fadd_rn(acc[u][e], kWeight ? __fmul_rn(w, f[e]) : f[e]);
            if (kDot) part_dot = __fadd_rn(part_dot, __fmul_rn(f[e], of[u][e]));
          }
        }
        if (kDot) {
          part_dot = epx_warp_sum(part_dot);
          if (lane == 0) s_dot[s_slot[j]] += part_dot;
        }
#pragma unroll
        for (int u = 0; u < kVecs; u++) cur[u] = next[u];
      }
#pragma unroll
      for (int u = 0; u < kVecs; u++) {
        const int i = v0 + u * 32 + lane;
        if (i < v_end) dst[i] = vec::pack(acc[u]);
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

extern "C" cudaError_t epx_cuda_gather_launch(epx_dtype_t dtype, const void *src, void *dst,
                                              int64_t num_tokens, int64_t hidden,
                                              const int32_t *rows, int32_t top_k, const float *w,
                                              const void *other, float *grad_w,
                                              int32_t warps_per_token, cudaStream_t stream) {
  gather_args a;
  const cudaError_t err =
      epx_move_args_fill(a, dtype, src, dst, num_tokens, hidden, rows, top_k, w, other, grad_w, warps_per_token);
  if (err != cudaSuccess) return err;
  const int64_t blocks = epx_move_token_blocks(a);
  if (blocks == 0) return cudaSuccess;
  const size_t shared = epx_move_shared_bytes(top_k);
  return epx_flags_visit(dtype, w != nullptr, grad_w != nullptr, [&](auto tag, auto weight, auto dot) {
    gather_kernel<typename decltype(tag)::type, decltype(weight)::value, decltype(dot)::value>
        <<<(unsigned int)blocks, kWarps * 32, shared, stream>>>(a);
  });
}
