/* How the CUDA kernels are launched, for the whole process:
 * EPX_CUDA_LAUNCH_DEFAULT unless epx_cuda_set_launch_flags (the routing
 * bench compares the choices, the tests run without programmatic dependent
 * launch too). Every choice gives the same results. Bits:
 *   EPX_CUDA_PDL_LAUNCH: programmatic dependent launch on sm_90+
 *     (src/cuda/common/pdl.cuh: a kernel may start before the one ahead of
 *     it in the stream ends, and waits for it before touching memory);
 *   EPX_CUDA_PDL_ROUTE_EARLY, EPX_CUDA_PDL_LAYOUT_EARLY: the routing's /
 *     layout's kernels let the next kernel launch as soon as they run (else
 *     when they end);
 *   EPX_CUDA_RANK_ALONE: one layout rank block per SM (shared memory);
 *   EPX_CUDA_LAYOUT_NARROW: expert-major rank blocks of up to 16 warps of
 *     64 routes (else 8 of 128);
 *   EPX_CUDA_FUSED_EXPAND_APART: the fused expert-major dispatch (and
 *     combine_backward) leaves the remote rows in the window, all of the SM
 *     budget sending, and expands every row in a kernel of its own over every
 *     SM (a local copy, as the host path's expansion is); the fused
 *     expert-major combine (and dispatch_backward) forms every received
 *     row's partial in such a kernel first (float32 partials where the
 *     window has room for them: fused/fused.h, f32_rows), and the budget's
 *     CTAs only move and sum them; else the budget's CTAs expand rows as
 *     they arrive and form partials as they send;
 *   EPX_CUDA_FUSED_RELAY (a test hook, off by default): a fused state
 *     created while it is set reaches every other rank through NCCL's
 *     host API (fused/relay.cu), as peers without load/store access are,
 *     so the mixed path runs on GPUs that all have it;
 *   EPX_CUDA_FUSED_COPY_ENGINE: the fused rank-major dispatch into a
 *     buffer of the caller's leaves the peers' rows in the window (the whole
 *     SM budget sending) and the copy engine copies them out, instead of the
 *     budget's receiving CTAs, at any budget (without it: at budgets of up
 *     to 24 CTAs, where the counts are known on the host).
 * Bits 64 and 128 are test-only (common/test_hooks.h). The default is the
 * fastest measured at 8192 tokens x 256 experts top-8 on an H200; early
 * routing kernels gained nothing there, and without EPX_CUDA_RANK_ALONE
 * rank blocks piled onto the first SMs to empty; the expansion apart is
 * the faster form of the fused expert-major dispatch (bench/NOTES-gpu.md
 * has the figures). */
#ifndef EPX_CUDA_COMMON_LAUNCH_FLAGS_H
#define EPX_CUDA_COMMON_LAUNCH_FLAGS_H

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_CUDA_PDL_LAUNCH 1
#define EPX_CUDA_PDL_ROUTE_EARLY 2
#define EPX_CUDA_PDL_LAYOUT_EARLY 4
#define EPX_CUDA_RANK_ALONE 8
#define EPX_CUDA_LAYOUT_NARROW 16
#define EPX_CUDA_FUSED_EXPAND_APART 32
#define EPX_CUDA_FUSED_RELAY 256
#define EPX_CUDA_FUSED_COPY_ENGINE 512
#define EPX_CUDA_LAUNCH_DEFAULT                                                                  \
  (EPX_CUDA_PDL_LAUNCH | EPX_CUDA_PDL_LAYOUT_EARLY | EPX_CUDA_RANK_ALONE | EPX_CUDA_LAYOUT_NARROW | \
   EPX_CUDA_FUSED_EXPAND_APART)
void epx_cuda_set_launch_flags(int flags);
int epx_cuda_launch_flags(void);

#ifdef __cplusplus
}
#endif

#include "cuda/common/test_hooks.h"

#endif
