/* FP8 dispatch on one GPU: each token's e4m3 row and its scales into each of
 * its K recv rows (recv_q [rows, H] bytes, recv_scales [rows, S] bytes), or,
 * quantizing on the way, the token's row of the payload dtype quantized
 * once (core/fp8.h's per-block formulas, the CPU's bits) and written to its
 * K rows; plus the zeros of padding and empty rows.
 *
 * A warp per token. Copying, each lane moves 16 bytes of the e4m3 row per
 * step (512 B per warp, coalesced) to every row of the token, then the S
 * scale bytes in the widest unit both scale tensors allow. Quantizing, each
 * lane reads one 16-byte vector of the source row (8 bf16 or 4 f32 values),
 * a block's lanes (block / values per vector: 4 to 32) agree its amax by
 * butterfly shuffles, and each lane writes its 8 or 4 e4m3 bytes to every
 * row of the token; the block's first lane writes the scale.
 *
 * Every tensor has a row stride of its own (bytes between rows): the dense
 * tensors of the one-GPU dispatch, or the W-rank host path's packed rows
 * (ep/host.c: a row and its scales in one staging row of
 * epx_payload_fp8_packed_bytes, packed on the way out, unpacked on the way
 * in by the same kernel).
 *
 * Bytes moved (R routes, T_r tokens with a route, N recv rows):
 *   copy:      T_r*(H + S) read + N*(H + S) written
 *   quantize:  T_r*H*s read (s the dtype's size) + N*(H + S) written */
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "cuda/common/device.cuh"
#include "cuda/launch.h"

namespace {

constexpr int kWarps = 8;

struct fp8_args {
  const void *x;           /* [T, H] e4m3 bytes, or [T, H] of the payload dtype */
  const uint8_t *x_scales; /* [T, S] (copy only) */
  uint8_t *recv_q;         /* [rows, H] */
  uint8_t *recv_s;         /* [rows, S] */
  const int32_t *rows;     /* [T, K] */
  const int32_t *row_src;  /* [row_bound] or NULL: no zeroing */
  const int64_t *rows_valid;
  int64_t row_bound, tokens, hidden, scale_bytes, token_blocks;
  epx_cuda_fp8_strides_t stride; /* bytes between rows of x, x_scales, recv_q, recv_s */
  int k;
  int scale_unit;          /* bytes per scale copy: 16, 4 or 1 */
  epx_fp8_format_t format;
};

/* A row's scales: S bytes in units of `unit` by the warp's lanes. */
__device__ void copy_scales(const uint8_t *src, uint8_t *dst, int64_t bytes, int unit, int lane) {
  if (unit == 16) {
    for (int64_t i = lane; i < bytes / 16; i += 32)
      reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
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
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r0 = (block * kWarps + warp) * 32;
  const int64_t n = min(*a.rows_valid, a.row_bound);
  const int64_t r = r0 + lane;
  unsigned int empty = __ballot_sync(0xffffffffu, r < n && a.row_src[r] < 0);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  while (empty) {
    const int b = __ffs(empty) - 1;
    empty &= empty - 1;
    uint4 *q = reinterpret_cast<uint4 *>(a.recv_q + (r0 + b) * a.stride.recv_q);
    for (int64_t i = lane; i < a.hidden / 16; i += 32) q[i] = zero;
    uint8_t *s = a.recv_s + (r0 + b) * a.stride.recv_scales;
    for (int64_t i = lane; i < a.scale_bytes; i += 32) s[i] = 0;
  }
}

/* The token's valid rows, compacted in k order into s_row; returns how many. */
__device__ int token_rows(const fp8_args &a, int64_t t, int32_t *s_row, int lane) {
  const unsigned int lanes_below = (1u << lane) - 1u;
  int valid = 0;
  for (int k0 = 0; k0 < a.k; k0 += 32) {
    const int k = k0 + lane;
    const int32_t row = k < a.k ? a.rows[t * a.k + k] : -1;
    const unsigned int mask = __ballot_sync(0xffffffffu, row >= 0);
    if (row >= 0) s_row[valid + __popc(mask & lanes_below)] = row;
    valid += __popc(mask);
  }
  __syncwarp();
  return valid;
}

__device__ void copy_token(const fp8_args &a, int64_t t, const int32_t *s_row, int valid, int lane) {
  const uint4 *src = reinterpret_cast<const uint4 *>(static_cast<const uint8_t *>(a.x) + t * a.stride.x);
  for (int64_t i = lane; i < a.hidden / 16; i += 32) {
    const uint4 v = __ldcs(src + i);
    for (int j = 0; j < valid; j++) reinterpret_cast<uint4 *>(a.recv_q + (int64_t)s_row[j] * a.stride.recv_q)[i] = v;
  }
  const uint8_t *s = a.x_scales + t * a.stride.x_scales;
  for (int j = 0; j < valid; j++)
    copy_scales(s, a.recv_s + (int64_t)s_row[j] * a.stride.recv_scales, a.scale_bytes, a.scale_unit, lane);
}

/* max of two partial amaxes: NaN wins for DeepEP's formats (torch.amax),
 * loses for MXFP8 (fmaxf), as core/fp8.c takes it. */
__device__ __forceinline__ float amax_merge(float m, float a, bool skip_nan) {
  if (skip_nan) return fmaxf(m, a);
  return (m != m || a != a) ? __int_as_float(0x7fc00000) : fmaxf(m, a);
}

template <typename T>
__device__ void quantize_token(const fp8_args &a, int64_t t, const int32_t *s_row, int valid, int lane) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n; /* values per 16-byte vector: 8 or 4, so 8 or 4 e4m3 bytes */
  const int block = epx_payload_fp8(a.format, EPX_FLOAT32, 0).scale_block;
  const int group = block / n; /* lanes per block: a power of two up to 32 */
  const bool skip_nan = a.format == EPX_FP8_MXFP8;
  const int entry = a.format == EPX_FP8_E4M3_F32_128 ? 4 : 1;
  const int64_t nvec = a.hidden / n;
  const uint4 *src = reinterpret_cast<const uint4 *>(static_cast<const uint8_t *>(a.x) + t * a.stride.x);
  for (int64_t base = 0; base < nvec; base += 32) {
    const int64_t i = base + lane;
    float f[n];
    vec::unpack(i < nvec ? __ldcs(src + i) : make_uint4(0u, 0u, 0u, 0u), f);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < n; e++) amax = amax_merge(amax, fabsf(f[e]), skip_nan);
    for (int m = 1; m < group; m <<= 1) amax = amax_merge(amax, __shfl_xor_sync(0xffffffffu, amax, m), skip_nan);
    const epx_fp8_block_scale_t s = epx_fp8_block_scale(a.format, amax);
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < n; e++) w[e / 4] |= (uint32_t)epx_f32_to_e4m3(f[e] * s.mult) << (8 * (e % 4));
    if (i >= nvec) continue; /* whole blocks lie past the row: their shuffles are done */
    const int64_t b = i * n / block;
    for (int j = 0; j < valid; j++) {
      uint8_t *q = a.recv_q + (int64_t)s_row[j] * a.stride.recv_q + i * n;
      if (n == 8) *reinterpret_cast<uint2 *>(q) = make_uint2(w[0], w[1]);
      else *reinterpret_cast<uint32_t *>(q) = w[0];
      if ((lane & (group - 1)) == 0) {
        uint8_t *sc = a.recv_s + (int64_t)s_row[j] * a.stride.recv_scales + b * entry;
        if (entry == 4) *reinterpret_cast<uint32_t *>(sc) = s.stored;
        else *sc = (uint8_t)s.stored;
      }
    }
  }
}

template <typename T, bool kQuantize>
__global__ void __launch_bounds__(kWarps * 32) fp8_scatter_kernel(const fp8_args a) {
  if (blockIdx.x >= a.token_blocks) {
    zero_rows(a, (int64_t)blockIdx.x - a.token_blocks);
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * kWarps + warp;
  if (t >= a.tokens) return;
  extern __shared__ int32_t s_table[];
  int32_t *s_row = s_table + (size_t)warp * a.k;
  const int valid = token_rows(a, t, s_row, lane);
  if (valid == 0) return;
  if constexpr (kQuantize) quantize_token<T>(a, t, s_row, valid, lane);
  else copy_token(a, t, s_row, valid, lane);
}

/* The widest unit that every scale row of both tensors is aligned to. */
int widest_unit(const void *p, const void *q, int64_t bytes, const epx_cuda_fp8_strides_t &s) {
  const uintptr_t both = (uintptr_t)p | (uintptr_t)q | (uintptr_t)s.x_scales | (uintptr_t)s.recv_scales;
  if (bytes % 16 == 0 && both % 16 == 0) return 16;
  if (bytes % 4 == 0 && both % 4 == 0) return 4;
  return 1;
}

}  // namespace

extern "C" cudaError_t epx_cuda_fp8_scatter_strided_launch(epx_fp8_format_t format, epx_dtype_t x_dtype,
                                                           int quantize, const void *x, const void *x_scales,
                                                           void *recv_q, void *recv_scales,
                                                           const epx_cuda_fp8_strides_t *stride, int64_t num_tokens,
                                                           int64_t hidden, const int32_t *rows, int32_t top_k,
                                                           const int32_t *row_src, const int64_t *rows_valid,
                                                           int64_t row_bound, cudaStream_t stream) {
  const epx_payload_format_t f = epx_payload_fp8(format, x_dtype, hidden);
  if (top_k < 1 || top_k > EPX_CUDA_MAX_TOP_K || f.scale_block == 0 || hidden % 32 != 0 ||
      (stride->x | stride->recv_q) % EPX_PAYLOAD_VECTOR_BYTES != 0)
    return cudaErrorInvalidValue;
  fp8_args a;
  a.x = x;
  a.x_scales = static_cast<const uint8_t *>(x_scales);
  a.recv_q = static_cast<uint8_t *>(recv_q);
  a.recv_s = static_cast<uint8_t *>(recv_scales);
  a.rows = rows;
  a.row_src = row_src;
  a.rows_valid = rows_valid;
  a.row_bound = row_src ? row_bound : 0;
  a.tokens = num_tokens;
  a.hidden = hidden;
  a.scale_bytes = f.scale_bytes;
  a.stride = *stride;
  a.k = top_k;
  a.scale_unit = widest_unit(x_scales, recv_scales, f.scale_bytes, *stride);
  a.format = format;
  a.token_blocks = (num_tokens + kWarps - 1) / kWarps;
  const int64_t zero_blocks = (a.row_bound + 32 * kWarps - 1) / (32 * kWarps);
  const int64_t blocks = a.token_blocks + zero_blocks;
  if (blocks == 0) return cudaSuccess;
  const size_t shared = (size_t)kWarps * sizeof(int32_t) * (size_t)top_k;
  if (!quantize) {
    fp8_scatter_kernel<uint8_t, false><<<(unsigned int)blocks, kWarps * 32, shared, stream>>>(a);
    return cudaGetLastError();
  }
  return epx_payload_visit(x_dtype, [&](auto tag) {
    fp8_scatter_kernel<typename decltype(tag)::type, true><<<(unsigned int)blocks, kWarps * 32, shared, stream>>>(a);
    return cudaGetLastError();
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
                                             num_tokens, hidden, rows, top_k, row_src, rows_valid, row_bound, stream);
}
