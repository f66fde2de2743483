/* Device helpers shared by the kernel files (CUDA only): the payload
 * format's device side (payload.cuh), fixed-order warp sums, and the one-GPU
 * move kernels' pieces (a step of a row slice, a token's slot table, the dot
 * sums of its row slices, the zeroing of empty rows). All inline: a kernel compiles as if it wrote
 * them itself. */
#ifndef EPX_CUDA_COMMON_DEVICE_CUH
#define EPX_CUDA_COMMON_DEVICE_CUH

#include <type_traits>

#include "cuda/common/payload.cuh"

/* grad_w [K] of a token whose row the move kernels cut into 2^shift slices,
 * a warp each: the slices' dot sums (s_dot of the token's first warp; each
 * warp's table is 4*K words after the previous one's) added in slice order
 * by the first warp. */
static __device__ __forceinline__ void epx_slices_grad_w(const float *s_dot, int k_count, int shift,
                                                         int lane, float *grad_w) {
  for (int k = lane; k < k_count; k += 32) {
    float sum = s_dot[k];
    for (int p = 1; p < (1 << shift); p++) sum = __fadd_rn(sum, s_dot[(size_t)p * 4 * k_count + k]);
    grad_w[k] = sum;
  }
}

/* Sum over the warp by a fixed butterfly: the same bits on every run. */
static __device__ __forceinline__ float epx_warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

/* Of a warp's 32 rows r0 + lane, those below min(*rows_valid, row_bound)
 * whose row_src is negative (padding and empty rows), found with one
 * ballot: zero(r) for each, called by the whole warp. */
template <typename Z>
__device__ __forceinline__ void epx_zero_empty_rows(const int32_t *row_src, const int64_t *rows_valid,
                                                    int64_t row_bound, int64_t r0, int lane, Z &&zero) {
  const int64_t n = min(*rows_valid, row_bound);
  const int64_t r = r0 + lane;
  unsigned int empty = __ballot_sync(0xffffffffu, r < n && row_src[r] < 0);
  while (empty) {
    const int b = __ffs(empty) - 1;
    empty &= empty - 1;
    zero(r0 + b);
  }
}

/* launch(tag, a, b) with the element type of `dtype` as a tag (see
 * epx_payload_visit) and the two runtime flags as std::integral_constant
 * values: a kernel templated on a type and two flags launched from runtime
 * values (host code). Returns the launch's error. */
template <typename L>
cudaError_t epx_flags_visit(epx_dtype_t dtype, bool a, bool b, L &&launch) {
  return epx_payload_visit(dtype, [&](auto tag) {
    if (a && b) launch(tag, std::true_type{}, std::true_type{});
    else if (a) launch(tag, std::true_type{}, std::false_type{});
    else if (b) launch(tag, std::false_type{}, std::true_type{});
    else launch(tag, std::false_type{}, std::false_type{});
    return cudaGetLastError();
  });
}

/* One step of a row slice: v[u] = row[v0 + u * 32 + lane], zeros from v_end
 * on; streaming loads (each row is read once). */
template <int n>
__device__ __forceinline__ void epx_load_step(const uint4 *row, int v0, int v_end, int lane, uint4 (&v)[n]) {
#pragma unroll
  for (int u = 0; u < n; u++) {
    const int i = v0 + u * 32 + lane;
    v[u] = i < v_end ? __ldcs(row + i) : make_uint4(0u, 0u, 0u, 0u);
  }
}

/* A token's table in the move kernels' shared memory ([4, K] words a warp:
 * s_row, s_slot, s_w, s_dot), filled from token t's routes rows[t, K]: its
 * valid slots compacted in k order (row, slot, and weight w[t, k] when
 * kWeight), a dot accumulator per slot zeroed when kDot, one ballot per 32
 * slots. Returns the valid slots' count; every lane of the warp calls it. */
template <bool kWeight, bool kDot>
__device__ __forceinline__ int epx_slot_table_fill(const int32_t *rows, const float *w, int64_t t, int k_count,
                                                   int lane, int32_t *s_row, int32_t *s_slot, float *s_w,
                                                   float *s_dot) {
  const unsigned int lanes_below = (1u << lane) - 1u;
  int valid = 0;
  for (int k0 = 0; k0 < k_count; k0 += 32) {
    const int k = k0 + lane;
    const int32_t row = k < k_count ? rows[t * k_count + k] : -1;
    const unsigned int mask = __ballot_sync(0xffffffffu, row >= 0);
    if (row >= 0) {
      const int p = valid + __popc(mask & lanes_below);
      s_row[p] = row;
      s_slot[p] = k;
      if (kWeight) s_w[p] = w[t * k_count + k];
    }
    if (kDot && k < k_count) s_dot[k] = 0.0f;
    valid += __popc(mask);
  }
  __syncwarp();
  return valid;
}

#endif
