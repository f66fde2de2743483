/* FP8 dispatch on one GPU: each token's e4m3 row and its scales into each of
 * its K recv rows (recv_q [rows, H] bytes, recv_scales [rows, S] bytes), or,
 * quantizing on the way, the token's row of the payload dtype quantized
 * once (core/fp8.h's per-block formulas, the CPU's bits) and written to its
 * K rows; plus the zeros of padding and empty rows.
 *
 * A warp per token stages the token's fp8 row and scales once in its
 * shared-memory slot ([H row bytes][S scale bytes]), then fans them out:
 *   - staging, copying: the bulk copy engine loads the row (and the scales
 *     when both scale tensors allow 16-byte bulk copies; else the lanes copy
 *     them in the widest unit both allow);
 *   - staging, quantizing: each lane takes 16 values of the source row (two
 *     16-byte vectors of bf16 or fp16, four of f32), kLoads vectors in
 *     flight per lane, a block's lanes (block / 16: 8 or 2) agree its amax
 *     by butterfly shuffles, and each lane writes its 16 e4m3 bytes (the
 *     hardware's satfinite conversion, which equals core/fp8.h's for every
 *     float32) to the slot; the block's first lane writes the scale;
 *   - fanning out: lane j issues the bulk stores of the token's valid routes
 *     j, j + 32, ... (the row, and the scales when bulk), so a warp has up
 *     to K rows in flight from one slot. Scales that cannot go in bulk are
 *     written by the lanes, every route's at once, in the widest unit the
 *     addresses allow.
 * Before sm_90 (no bulk copy engine) the same slot is filled and emptied by
 * the lanes with 16-byte accesses.
 *
 * Every tensor has a row stride of its own (bytes between rows): the dense
 * tensors of the one-GPU dispatch, or the W-rank paths' packed rows
 * (ep/host.c: a row and its scales in one staging row of
 * epx_payload_fp8_packed_bytes, packed on the way out, unpacked on the way
 * in by the same kernel).
 *
 * Bytes moved (T_r tokens with a route, N recv rows):
 *   copy:      T_r*(H + S) read + N*(H + S) written
 *   quantize:  T*H*s read (s the dtype's size) + N*(H + S) written */
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "cuda/common/bulk.cuh"
#include "cuda/common/device.cuh"
#include "cuda/common/device_cache.h"
#include "cuda/launch.h"

namespace {

/* Warps per CTA (fewer when H is so large that 8 slots do not fit). */
constexpr int kWarps = 8;
/* 16-byte loads a quantizing lane has in flight before it converts: a
 * row's latency is paid once per 32 * kLoads vectors. */
constexpr int kLoads = 14;
/* Copying CTAs per SM: each warp then stages a few tokens in turn, its
 * stores of one overlapping the load of the next (fewer resident warps with
 * more tokens each write faster: bench/NOTES.md, "The fp8 dispatch kernel"). */
constexpr int kCopyCtasPerSm = 2;

struct fp8_args {
  const void *x;           /* [T, H] e4m3 bytes, or [T, H] of the payload dtype */
  const uint8_t *x_scales; /* [T, S] (copy only) */
  uint8_t *recv_q;         /* [rows, H] */
  uint8_t *recv_s;         /* [rows, S] */
  const int32_t *rows;     /* [T, K], or NULL: token t's one route is row t */
  const int64_t *tokens_valid; /* NULL, or the tokens to move on the device (at most `tokens`) */
  const int32_t *row_src;  /* [row_bound] or NULL: no zeroing */
  const int64_t *rows_valid;
  int64_t row_bound, tokens, hidden, scale_bytes, token_ctas, slot;
  epx_cuda_fp8_strides_t stride; /* bytes between rows of x, x_scales, recv_q, recv_s */
  int k;
  int scale_unit;          /* bytes per scale copy: 16 (bulk), 8, 4 or 1 */
};

/* S scale bytes src -> dst in units of `unit` (16, 8, 4 or 1) by the warp's lanes. */
__device__ void copy_scales(const uint8_t *src, uint8_t *dst, int64_t bytes, int unit, int lane) {
  if (unit == 16) {
    for (int64_t i = lane; i < bytes / 16; i += 32)
      reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
  } else if (unit == 8) {
    for (int64_t i = lane; i < bytes / 8; i += 32)
      reinterpret_cast<uint2 *>(dst)[i] = reinterpret_cast<const uint2 *>(src)[i];
  } else if (unit == 4) {
    for (int64_t i = lane; i < bytes / 4; i += 32)
      reinterpret_cast<uint32_t *>(dst)[i] = reinterpret_cast<const uint32_t *>(src)[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

/* Zeroes the rows r < min(*rows_valid, row_bound) with row_src[r] < 0, rows
 * and scales: a warp per 32 rows finds them with one ballot. */
__device__ void zero_rows(const fp8_args &a, int64_t block) {
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  epx_zero_empty_rows(a.row_src, a.rows_valid, a.row_bound, (block * warps + warp) * 32, lane, [&](int64_t r) {
    uint4 *q = reinterpret_cast<uint4 *>(a.recv_q + r * a.stride.recv_q);
    for (int64_t i = lane; i < a.hidden / 16; i += 32) q[i] = zero;
    uint8_t *s = a.recv_s + r * a.stride.recv_scales;
    for (int64_t i = lane; i < a.scale_bytes; i += 32) s[i] = 0;
  });
}

/* |f| as bits, whose unsigned order is the float order of non-negative
 * values (zeros, subnormals, infinity) and puts every NaN above infinity:
 * an unsigned max propagates NaN as torch.amax does for DeepEP's formats
 * (the NaN's payload is lost in the scale either way, core/fp8.h); MXFP8
 * drops NaN first, as fmaxf does. core/fp8.c's amax, bit for bit. */
__device__ __forceinline__ uint32_t abs_bits(float f, bool skip_nan) {
  const uint32_t a = __float_as_uint(f) & 0x7fffffffu;
  return skip_nan && a > 0x7f800000u ? 0u : a;
}

/* Four values to e4m3 bytes (the first in the low byte): the hardware's
 * round-to-nearest-even satfinite conversion from sm_89, which is
 * epx_f32_to_e4m3's for every float32 (NaN to 0x7f, the infinities to
 * +-448; checked on all 2^32 inputs: bench/NOTES.md, "The fp8 dispatch kernel"), or that
 * function itself before sm_89. */
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
#else
  return (uint32_t)epx_f32_to_e4m3(a) | (uint32_t)epx_f32_to_e4m3(b) << 8 | (uint32_t)epx_f32_to_e4m3(c) << 16 |
         (uint32_t)epx_f32_to_e4m3(d) << 24;
#endif
}

/* One lane's 16 values: their block's amax agreed over the block's lanes,
 * the 16 e4m3 bytes and the block's scale as stored. */
struct chunk_q {
  uint4 q;
  uint32_t stored;
};

template <typename T, epx_fp8_format_t format>
__device__ __forceinline__ chunk_q quantize_chunk(const uint4 *raw) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  constexpr bool skip_nan = format == EPX_FP8_MXFP8;
  constexpr int group = EPX_FP8_SCALE_BLOCK(format) / 16; /* lanes per block: 2 or 8 */
  float f[16];
#pragma unroll
  for (int l = 0; l < 16 / n; l++) vec::unpack(raw[l], f + l * n);
  uint32_t amax = 0u;
#pragma unroll
  for (int e = 0; e < 16; e++) amax = max(amax, abs_bits(f[e], skip_nan));
#pragma unroll
  for (int m = 1; m < group; m <<= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const epx_fp8_block_scale_t s = epx_fp8_block_scale(format, __uint_as_float(amax));
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; k++)
    w[k] = e4m3x4(f[4 * k] * s.mult, f[4 * k + 1] * s.mult, f[4 * k + 2] * s.mult, f[4 * k + 3] * s.mult);
  return {make_uint4(w[0], w[1], w[2], w[3]), s.stored};
}

/* The slot's H row bytes to each of the token's valid rows (rows[t, k] >=
 * 0; `row` is this lane's, k = lane). With the bulk copy engine, lane j
 * stores routes j, j + 32, ..., one bulk group per call; the lanes' writes
 * to the slot are ordered before it here. When the lanes write the scales
 * (rows of a size that is not whole 16-byte units, so each ends or starts
 * in a 32-byte sector another row's scales complete), the rows are stored
 * evict-first: the part-written sectors then stay in L2 until completed
 * instead of going to memory twice (UE8M0's 56-byte scale rows; marking
 * every format's rows measured slower: bench/NOTES.md, "UE8M0's copy
 * fraction"). */
__device__ void fan_out_row(const fp8_args &a, const int32_t *rows, int32_t row, const uint8_t *slot, int lane) {
#if EPX_BULK_ARCH
  epx_bulk_fence_smem();
  __syncwarp();
  for (int k = lane; k < a.k; k += 32) {
    const int64_t r = k == lane ? row : rows[k];
    if (r < 0) continue;
    if (a.scale_unit == 16) epx_bulk_store(a.recv_q + r * a.stride.recv_q, slot, (uint32_t)a.hidden);
    else epx_bulk_store_evict_first(a.recv_q + r * a.stride.recv_q, slot, (uint32_t)a.hidden);
    epx_bulk_commit();
  }
#else
  __syncwarp();
  for (int k = 0; k < a.k; k++) {
    const int64_t r = k < 32 ? __shfl_sync(0xffffffffu, row, k) : rows[k]; /* warp-uniform */
    if (r < 0) continue;
    uint4 *q = reinterpret_cast<uint4 *>(a.recv_q + r * a.stride.recv_q);
    for (int64_t i = lane; i < a.hidden / 16; i += 32) q[i] = reinterpret_cast<const uint4 *>(slot)[i];
  }
#endif
}

/* The slot's scales (after its H row bytes) to each of the token's valid
 * rows: in bulk where both scale tensors allow it, else by the lanes. */
__device__ void fan_out_scales(const fp8_args &a, const int32_t *rows, int32_t row, const uint8_t *slot, int lane) {
  const uint8_t *slot_s = slot + a.hidden;
#if EPX_BULK_ARCH
  if (a.scale_unit == 16) {
    epx_bulk_fence_smem();
    __syncwarp();
    for (int k = lane; k < a.k; k += 32) {
      const int64_t r = k == lane ? row : rows[k];
      if (r < 0) continue;
      epx_bulk_store(a.recv_s + r * a.stride.recv_scales, slot_s, (uint32_t)a.scale_bytes);
      epx_bulk_commit();
    }
    return;
  }
#endif
  __syncwarp();
  /* every route's scales at once (one row after another measured slower:
   * bench/NOTES.md, "UE8M0's copy fraction"): piece i of the K rows' scales
   * is unit i % per_row of route i / per_row */
  const int unit = a.scale_unit, per_row = (int)(a.scale_bytes / unit);
  for (int i0 = 0; i0 < a.k * per_row; i0 += 32) {
    const int i = i0 + lane, k = i / per_row, p = i - k * per_row;
    const int32_t r_lane = __shfl_sync(0xffffffffu, row, k & 31);
    if (i >= a.k * per_row) continue;
    const int64_t r = k < 32 ? r_lane : rows[k];
    if (r < 0) continue;
    uint8_t *d = a.recv_s + r * a.stride.recv_scales + p * unit;
    const uint8_t *s = slot_s + p * unit;
    if (unit == 16) *reinterpret_cast<uint4 *>(d) = *reinterpret_cast<const uint4 *>(s);
    else if (unit == 8) *reinterpret_cast<uint2 *>(d) = *reinterpret_cast<const uint2 *>(s);
    else if (unit == 4) *reinterpret_cast<uint32_t *>(d) = *reinterpret_cast<const uint32_t *>(s);
    else *d = *s;
  }
}

/* Quantizing: the token's row of T into the slot's e4m3 bytes and scales,
 * then out (fanning each step's bytes out as soon as they were in the slot
 * measured slower: bench/NOTES.md, "The fp8 dispatch kernel"). */
template <typename T, epx_fp8_format_t format>
__device__ void quantize_token(const fp8_args &a, int64_t t, const int32_t *rows, int32_t row, uint8_t *slot,
                               int lane) {
  constexpr int loads = 16 / epx_vec<T>::n; /* 16-byte loads per lane per chunk of 16 values */
  constexpr int kChunks = kLoads / loads;
  constexpr int block = EPX_FP8_SCALE_BLOCK(format);
  constexpr int group = block / 16;
  constexpr int entry = EPX_FP8_SCALE_ENTRY_BYTES(format);
  const int64_t nchunk = a.hidden / 16; /* a multiple of group: hidden is one of block */
  const uint4 *src = reinterpret_cast<const uint4 *>(static_cast<const uint8_t *>(a.x) + t * a.stride.x);
  uint8_t *slot_s = slot + a.hidden;
  for (int64_t base = 0; base < nchunk; base += 32 * kChunks) {
    uint4 raw[kChunks][loads];
#pragma unroll
    for (int c = 0; c < kChunks; c++) {
      const int64_t i = base + c * 32 + lane;
#pragma unroll
      for (int l = 0; l < loads; l++) raw[c][l] = i < nchunk ? __ldcs(src + i * loads + l) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int c = 0; c < kChunks; c++) {
      if (base + c * 32 >= nchunk) break; /* warp-uniform: the row ended */
      const int64_t i = base + c * 32 + lane;
      /* every lane shuffles; lanes past the row hold whole blocks of zeros */
      const chunk_q r = quantize_chunk<T, format>(raw[c]);
      if (i >= nchunk) continue;
      reinterpret_cast<uint4 *>(slot)[i] = r.q;
      if ((lane & (group - 1)) == 0) {
        uint8_t *sc = slot_s + i * 16 / block * entry;
        if (entry == 4) *reinterpret_cast<uint32_t *>(sc) = r.stored;
        else *sc = (uint8_t)r.stored;
      }
    }
  }
  fan_out_row(a, rows, row, slot, lane);
  fan_out_scales(a, rows, row, slot, lane);
}

/* Copying: the token's row and scales into the slot ([H][S]), then out.
 * `phase` is the warp's barrier phase, kept by every lane. */
__device__ void copy_token(const fp8_args &a, int64_t t, const int32_t *rows, int32_t row, uint8_t *slot,
                           uint64_t *bar, uint32_t &phase, int lane) {
  const uint8_t *src = static_cast<const uint8_t *>(a.x) + t * a.stride.x;
  const uint8_t *src_s = a.x_scales + t * a.stride.x_scales;
  const bool scale_bulk = a.scale_unit == 16;
#if EPX_BULK_ARCH
  if (lane == 0) {
    epx_bulk_expect(bar, (uint32_t)(a.hidden + (scale_bulk ? a.scale_bytes : 0)));
    epx_bulk_load(slot, src, (uint32_t)a.hidden, bar);
    if (scale_bulk) epx_bulk_load(slot + a.hidden, src_s, (uint32_t)a.scale_bytes, bar);
  }
  if (!scale_bulk) copy_scales(src_s, slot + a.hidden, a.scale_bytes, a.scale_unit, lane);
  epx_bulk_wait(bar, phase);
  phase ^= 1u;
#else
  (void)bar;
  (void)phase;
  (void)scale_bulk;
  for (int64_t i = lane; i < a.hidden / 16; i += 32)
    reinterpret_cast<uint4 *>(slot)[i] = __ldcs(reinterpret_cast<const uint4 *>(src) + i);
  copy_scales(src_s, slot + a.hidden, a.scale_bytes, a.scale_unit, lane);
#endif
  fan_out_row(a, rows, row, slot, lane);
  fan_out_scales(a, rows, row, slot, lane);
}

template <typename T, bool kQuantize, epx_fp8_format_t kFormat>
__global__ void __launch_bounds__(kWarps * 32) fp8_scatter_kernel(const fp8_args a) {
  if (blockIdx.x >= a.token_ctas) {
    zero_rows(a, (int64_t)blockIdx.x - a.token_ctas);
    return;
  }
  extern __shared__ __align__(128) uint8_t smem[];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t *slot = smem + (int64_t)warp * a.slot;
  uint64_t *bar = reinterpret_cast<uint64_t *>(smem + (int64_t)warps * a.slot) + warp;
  uint32_t phase = 0;
#if EPX_BULK_ARCH
  if (!kQuantize && lane == 0) epx_bulk_bar_init(bar);
  __syncwarp();
#endif
  const int64_t tokens = a.tokens_valid ? min(*a.tokens_valid, a.tokens) : a.tokens;
  for (int64_t t = (int64_t)blockIdx.x * warps + warp; t < tokens; t += a.token_ctas * warps) {
    /* routes past the 32nd are read from rows[k] (never with rows NULL: K is 1) */
    const int32_t *rows = a.rows ? a.rows + t * a.k : nullptr;
    const int32_t row = lane >= a.k ? -1 : rows ? rows[lane] : (int32_t)t;
    if constexpr (!kQuantize) {
      /* copying, a token with no valid route is skipped, its row unread;
       * quantizing, its row's loads go out before its routes are read, and
       * a token with none is quantized and not written */
      bool any = __any_sync(0xffffffffu, row >= 0);
      for (int k0 = 32; k0 < a.k && !any; k0 += 32)
        any = __any_sync(0xffffffffu, k0 + lane < a.k && rows[k0 + lane] >= 0);
      if (!any) continue;
    }
#if EPX_BULK_ARCH
    epx_bulk_wait_read(); /* this lane's stores of the last token have read the slot */
    __syncwarp();
#endif
    if constexpr (kQuantize) quantize_token<T, kFormat>(a, t, rows, row, slot, lane);
    else copy_token(a, t, rows, row, slot, bar, phase, lane);
  }
#if EPX_BULK_ARCH
  epx_bulk_drain();
#endif
}

/* The widest unit (16, 8, 4 or 1 bytes) that `bytes` and every address and
 * stride OR-ed into `bits` are multiples of. */
int widest_unit(uintptr_t bits, int64_t bytes) {
  if (bytes % 16 == 0 && bits % 16 == 0) return 16;
  if (bytes % 8 == 0 && bits % 8 == 0) return 8;
  if (bytes % 4 == 0 && bits % 4 == 0) return 4;
  return 1;
}

template <typename T, bool kQuantize, epx_fp8_format_t kFormat>
cudaError_t launch(fp8_args &a, int device, const epx_cuda_device_info_t &info, cudaStream_t stream) {
  const auto kernel = fp8_scatter_kernel<T, kQuantize, kFormat>;
  /* slots of [H][S] bytes and a barrier each */
  const int64_t per_warp = a.slot + (int64_t)sizeof(uint64_t);
  int warps = kWarps;
  while (warps > 1 && (int64_t)warps * per_warp > info.smem_optin) warps--;
  if ((int64_t)warps * per_warp > info.smem_optin) return cudaErrorInvalidValue; /* a row past shared memory */
  const size_t smem = (size_t)(warps * per_warp);
  cudaError_t err = epx_cuda_kernel_smem(reinterpret_cast<const void *>(kernel), device, smem);
  if (err != cudaSuccess) return err;
  const int64_t token_ctas = (a.tokens + warps - 1) / warps;
  a.token_ctas = kQuantize ? token_ctas : min(token_ctas, (int64_t)kCopyCtasPerSm * info.sms);
  const int64_t zero_ctas = (a.row_bound + 32 * warps - 1) / (32 * warps);
  const int64_t ctas = a.token_ctas + zero_ctas;
  if (ctas == 0) return cudaSuccess;
  kernel<<<(unsigned int)ctas, warps * 32, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t epx_cuda_fp8_scatter_strided_launch(epx_fp8_format_t format, epx_dtype_t x_dtype,
                                                           int quantize, const void *x, const void *x_scales,
                                                           void *recv_q, void *recv_scales,
                                                           const epx_cuda_fp8_strides_t *stride, int64_t num_tokens,
                                                           int64_t hidden, const int32_t *rows, int32_t top_k,
                                                           const int64_t *tokens_valid, const int32_t *row_src,
                                                           const int64_t *rows_valid, int64_t row_bound,
                                                           cudaStream_t stream) {
  const epx_payload_format_t f = epx_payload_fp8(format, x_dtype, hidden);
  /* rows may be NULL where there is no token (a rank's empty batch) */
  if (top_k < 1 || top_k > EPX_CUDA_MAX_TOP_K || (!rows && top_k != 1 && num_tokens > 0) || f.scale_block == 0 ||
      hidden % 32 != 0 || (stride->x | stride->recv_q) % EPX_PAYLOAD_VECTOR_BYTES != 0)
    return cudaErrorInvalidValue;
  fp8_args a;
  a.x = x;
  a.x_scales = static_cast<const uint8_t *>(x_scales);
  a.recv_q = static_cast<uint8_t *>(recv_q);
  a.recv_s = static_cast<uint8_t *>(recv_scales);
  a.rows = rows;
  a.tokens_valid = tokens_valid;
  a.row_src = row_src;
  a.rows_valid = rows_valid;
  a.row_bound = row_src ? row_bound : 0;
  a.tokens = num_tokens;
  a.hidden = hidden;
  a.scale_bytes = f.scale_bytes;
  a.stride = *stride;
  a.k = top_k;
  /* scales are written to recv_scales, and read from x_scales when copying
   * (quantizing, from the slot: 16-byte aligned) */
  const uintptr_t scale_bits = (uintptr_t)recv_scales | (uintptr_t)stride->recv_scales |
                               (quantize ? 0 : (uintptr_t)x_scales | (uintptr_t)stride->x_scales);
  a.scale_unit = widest_unit(scale_bits, f.scale_bytes);
  a.slot = epx_bulk_slot_bytes(hidden + f.scale_bytes);
  int device;
  epx_cuda_device_info_t info;
  cudaError_t err = epx_cuda_device_info(&device, &info);
  if (err != cudaSuccess) return err;
  if (!quantize) return launch<uint8_t, false, EPX_FP8_NONE>(a, device, info, stream);
  return epx_payload_visit(x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (format) {
      case EPX_FP8_E4M3_F32_128: return launch<T, true, EPX_FP8_E4M3_F32_128>(a, device, info, stream);
      case EPX_FP8_E4M3_UE8M0_128: return launch<T, true, EPX_FP8_E4M3_UE8M0_128>(a, device, info, stream);
      case EPX_FP8_MXFP8: return launch<T, true, EPX_FP8_MXFP8>(a, device, info, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

extern "C" cudaError_t epx_cuda_fp8_scatter_launch(epx_fp8_format_t format, epx_dtype_t x_dtype, int quantize,
                                                   const void *x, const void *x_scales, void *recv_q,
                                                   void *recv_scales, int64_t num_tokens, int64_t hidden,
                                                   const int32_t *rows, int32_t top_k, const int32_t *row_src,
                                                   const int64_t *rows_valid, int64_t row_bound,
                                                   cudaStream_t stream) {
  const epx_payload_format_t f = epx_payload_fp8(format, x_dtype, hidden);
  const epx_cuda_fp8_strides_t dense = {quantize ? epx_payload_row_bytes(x_dtype, hidden) : hidden, f.scale_bytes,
                                        hidden, f.scale_bytes};
  return epx_cuda_fp8_scatter_strided_launch(format, x_dtype, quantize, x, x_scales, recv_q, recv_scales, &dense,
                                             num_tokens, hidden, rows, top_k, NULL, row_src, rows_valid, row_bound,
                                             stream);
}
