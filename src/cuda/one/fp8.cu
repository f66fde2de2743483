/* FP8 dispatch on one GPU: each token's e4m3 row and its scales into each of
 * its K recv rows (recv_q [rows, H] bytes, recv_scales [rows, S] bytes), or,
 * quantizing on the way, the token's row of the payload dtype quantized
 * once (core/fp8.h's per-block formulas, the CPU's bits) and written to its
 * K rows; plus the zeros of padding and empty rows.
 *
 * A warp per token. Copying, each lane moves 16 bytes of the e4m3 row per
 * step (512 B per warp, coalesced) to every row of the token, then the S
 * scale bytes in the widest unit both scale tensors allow. Quantizing, each
 * lane takes 16 values of the source row (two 16-byte vectors of bf16 or
 * fp16, four of f32), a block's lanes (block / 16: 8 or 2) agree its amax by
 * butterfly shuffles, and each lane writes its 16 e4m3 bytes to every row of
 * the token with one 16-byte store; the block's first lane writes the scale.
 * Both load kInFlight vectors per lane before writing any.
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
/* 16-byte loads a lane has in flight before it writes: a row's latency is
 * paid once per 32 * kInFlight vectors, not per vector. */
constexpr int kInFlight = 4;
/* CTAs an SM keeps (64 registers a thread at most): 4096 tokens, a warp
 * each, fit the H200's SMs in one wave. */
constexpr int kMinBlocks = 4;

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
  const int64_t nvec = a.hidden / 16;
  for (int64_t base = 0; base < nvec; base += 32 * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; u++) {
      const int64_t i = base + u * 32 + lane;
      v[u] = i < nvec ? __ldcs(src + i) : make_uint4(0u, 0u, 0u, 0u);
    }
    for (int j = 0; j < valid; j++) {
      uint4 *dst = reinterpret_cast<uint4 *>(a.recv_q + (int64_t)s_row[j] * a.stride.recv_q);
#pragma unroll
      for (int u = 0; u < kInFlight; u++) {
        const int64_t i = base + u * 32 + lane;
        if (i < nvec) dst[i] = v[u];
      }
    }
  }
  const uint8_t *s = a.x_scales + t * a.stride.x_scales;
  for (int j = 0; j < valid; j++)
    copy_scales(s, a.recv_s + (int64_t)s_row[j] * a.stride.recv_scales, a.scale_bytes, a.scale_unit, lane);
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

/* One lane's 16 values: their block's amax agreed over the block's lanes,
 * the 16 e4m3 bytes (one 16-byte store per row) and the block's scale. */
struct chunk_q {
  uint4 q;
  uint32_t stored;
};

template <typename T>
__device__ __forceinline__ chunk_q quantize_chunk(const uint4 *raw, epx_fp8_format_t format, int group) {
  using vec = epx_vec<T>;
  constexpr int n = vec::n;
  const bool skip_nan = format == EPX_FP8_MXFP8;
  float f[16];
#pragma unroll
  for (int l = 0; l < 16 / n; l++) vec::unpack(raw[l], f + l * n);
  uint32_t amax = 0u;
#pragma unroll
  for (int e = 0; e < 16; e++) amax = max(amax, abs_bits(f[e], skip_nan));
  for (int m = 1; m < group; m <<= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const epx_fp8_block_scale_t s = epx_fp8_block_scale(format, __uint_as_float(amax));
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; k++) {
    w[k] = 0u;
#pragma unroll
    for (int e = 0; e < 4; e++) w[k] |= (uint32_t)epx_f32_to_e4m3(f[4 * k + e] * s.mult) << (8 * e);
  }
  return {make_uint4(w[0], w[1], w[2], w[3]), s.stored};
}

template <typename T>
__device__ void quantize_token(const fp8_args &a, int64_t t, const int32_t *s_row, int valid, int lane) {
  constexpr int loads = 16 / epx_vec<T>::n; /* 16-byte loads per lane per chunk of 16 values */
  constexpr int kChunks = kInFlight / loads;
  const int block = epx_payload_fp8(a.format, EPX_FLOAT32, 0).scale_block;
  const int group = block / 16; /* lanes per block: 2 or 8 */
  const int entry = a.format == EPX_FP8_E4M3_F32_128 ? 4 : 1;
  const int64_t nchunk = a.hidden / 16; /* a multiple of group: hidden is one of block */
  const uint4 *src = reinterpret_cast<const uint4 *>(static_cast<const uint8_t *>(a.x) + t * a.stride.x);
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
      const chunk_q r = quantize_chunk<T>(raw[c], a.format, group);
      if (i >= nchunk) continue;
      const int64_t b = i * 16 / block;
      for (int j = 0; j < valid; j++) {
        *reinterpret_cast<uint4 *>(a.recv_q + (int64_t)s_row[j] * a.stride.recv_q + i * 16) = r.q;
        if ((lane & (group - 1)) == 0) {
          uint8_t *sc = a.recv_s + (int64_t)s_row[j] * a.stride.recv_scales + b * entry;
          if (entry == 4) *reinterpret_cast<uint32_t *>(sc) = r.stored;
          else *sc = (uint8_t)r.stored;
        }
      }
    }
  }
}

template <typename T, bool kQuantize>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) fp8_scatter_kernel(const fp8_args a) {
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
