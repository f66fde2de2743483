/* Test hooks of the CUDA backend: switches with which the GPU tests and
 * benchmarks reach, on the machine at hand, paths a production run picks by
 * itself. They are in the library only when it is built with
 * -DEPX_TEST_HOOKS=ON (the GPU test build: bench/gpu-check.sh, .ci/run's
 * CUDA build); a production build neither has epx_cuda_ep_at_one_rank nor
 * honours the test-only launch bits. Not in epx.h. */
#ifndef EPX_CUDA_COMMON_TEST_HOOKS_H
#define EPX_CUDA_COMMON_TEST_HOOKS_H

#ifdef __cplusplus
extern "C" {
#endif

/* Launch bits (common/launch_flags.h) for the sweep of the fused kernels'
 * split: a quarter or an eighth of the SM budget receives (dispatch: waits
 * for and copies or expands the rows; combine: sums the partials), the rest
 * sends; else half. */
#define EPX_CUDA_FUSED_RECV_QUARTER 64
#define EPX_CUDA_FUSED_RECV_EIGHTH 128

/* On: a CUDA buffer created later over a one-rank comm is served by the
 * W-rank backend (ep/: an NCCL comm, the host-API exchange, the fused
 * kernels; a low-latency buffer: ll/ranks.c) instead of the one-GPU backend, so that backend's paths can be
 * checked and timed where no second GPU is at hand. Process-wide; buffers
 * keep the backend they were created with (backend.c). */
void epx_cuda_ep_at_one_rank(int on);

#ifdef __cplusplus
}
#endif

/* The receiving CTAs of a fused kernel's budget of n (before the floor of
 * one): half; a test build honours the sweep's bits. */
static inline int epx_cuda_receiver_share(int n, int launch_flags) {
#if defined(EPX_TEST_HOOKS) && EPX_TEST_HOOKS
  if (launch_flags & EPX_CUDA_FUSED_RECV_EIGHTH) return n / 8;
  if (launch_flags & EPX_CUDA_FUSED_RECV_QUARTER) return n / 4;
#else
  (void)launch_flags;
#endif
  return n / 2;
}

#endif
