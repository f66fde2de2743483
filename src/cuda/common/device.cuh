/* Device helpers shared by the kernel files (CUDA only): the payload
 * format's device side (payload.cuh), fixed-order warp sums and the dot
 * sums of the move kernels' row slices. */
#ifndef EPX_CUDA_COMMON_DEVICE_CUH
#define EPX_CUDA_COMMON_DEVICE_CUH

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

#endif
