/* The block-wide prefix sum the low-latency layouts number their rows with
 * (layout.cu on one GPU, ranks.cu on W ranks): a block of kThreads walks
 * items in order, a chunk at a time, so the rows come out in item order with
 * no atomics and the same result on every run. */
#ifndef EPX_CUDA_LL_SCAN_CUH
#define EPX_CUDA_LL_SCAN_CUH

namespace epx_ll {

constexpr int kThreads = 256;

/* Exclusive prefix sum of flag over the block, and the block's total. */
__device__ __forceinline__ int block_scan(int flag, int *s_warp, int *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned int ballot = __ballot_sync(0xffffffffu, flag);
  const int below = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) s_warp[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, sum = 0;
  for (int i = 0; i < kThreads / 32; i++) {
    before += i < warp ? s_warp[i] : 0;
    sum += s_warp[i];
  }
  __syncthreads(); /* s_warp is reused by the next chunk */
  *total = sum;
  return before + below;
}

}  // namespace epx_ll

#endif
