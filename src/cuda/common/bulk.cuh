/* Whole rows through shared memory by the bulk copy engine (sm_90's
 * cp.async.bulk): a row loaded into a shared-memory slot completes on an
 * mbarrier; stores from the slot to global memory go in bulk groups of the
 * issuing thread. Sizes and addresses are multiples of 16 bytes. Included
 * by .cu files only; every function here is sm_90 code (callers test
 * EPX_BULK_ARCH and keep a generic path for older targets). */
#ifndef EPX_CUDA_COMMON_BULK_CUH
#define EPX_CUDA_COMMON_BULK_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define EPX_BULK_ARCH 1
#else
#define EPX_BULK_ARCH 0
#endif

/* A slot's bytes for `bytes` of row: whole 128-byte lines. */
static inline __host__ __device__ int64_t epx_bulk_slot_bytes(int64_t bytes) { return (bytes + 127) / 128 * 128; }

__device__ __forceinline__ uint32_t epx_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* One thread: an mbarrier expecting one arrival per phase, visible to the
 * copy engine. */
__device__ __forceinline__ void epx_bulk_bar_init(uint64_t *bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(epx_smem_u32(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* One thread: the barrier's phase completes when `bytes` have landed (the
 * arrival of this thread plus the loads' transaction count). */
__device__ __forceinline__ void epx_bulk_expect(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(epx_smem_u32(bar)), "r"(bytes)
               : "memory");
}

/* global src -> shared dst, counted on bar. */
__device__ __forceinline__ void epx_bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   epx_smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(epx_smem_u32(bar))
               : "memory");
}

/* Any thread: until bar's phase `phase` has completed (its loads landed and
 * visible to this thread). */
__device__ __forceinline__ void epx_bulk_wait(uint64_t *bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(epx_smem_u32(bar)), "r"(phase)
        : "memory");
}

/* shared src -> global dst, in this thread's open bulk group. */
__device__ __forceinline__ void epx_bulk_store(void *dst, const void *src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(epx_smem_u32(src)),
               "r"(bytes)
               : "memory");
}
/* The same, the stored lines marked first to leave L2: for rows that pass
 * through (a scatter's destination rows, read by a later kernel) while
 * other lines the kernel writes in part must stay until completed. */
__device__ __forceinline__ void epx_bulk_store_evict_first(void *dst, const void *src, uint32_t bytes) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(dst),
               "r"(epx_smem_u32(src)), "r"(bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void epx_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/* This thread's stores have read their slots (which may then be refilled). */
__device__ __forceinline__ void epx_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

/* Shared memory written by ordinary stores is ordered before the copy
 * engine's reads of it: each writing thread, before the barrier that the
 * storing thread passes. */
__device__ __forceinline__ void epx_bulk_fence_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/* This thread's stores complete and ordered before its later (generic)
 * accesses. */
__device__ __forceinline__ void epx_bulk_drain() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

#endif
