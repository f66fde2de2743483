/* The fp8 row quantizers (core/fp8.h has the per-block formulas, shared
 * with the GPU): a block's amax, its scale, its values. */
#include "core/fp8.h"

#include "core/dtype.h"
#include "core/payload.h"

int32_t epx_fp8_block(epx_fp8_format_t format) { return epx_payload_fp8(format, EPX_FLOAT32, 0).scale_block; }

int32_t epx_fp8_scale_col_bytes(epx_fp8_format_t format) { return format == EPX_FP8_MXFP8 ? 1 : 4; }

/* A whole number of scale columns: four UE8M0 bytes share an int32 word, so
 * its rows need 4 whole blocks. */
int32_t epx_fp8_hidden_multiple(epx_fp8_format_t format) {
  const int32_t block = epx_fp8_block(format);
  return block ? block * epx_fp8_scale_col_bytes(format) / EPX_FP8_SCALE_ENTRY_BYTES(format) : 0;
}

int64_t epx_fp8_scale_row_bytes(epx_fp8_format_t format, int64_t hidden) {
  return epx_payload_fp8(format, EPX_FLOAT32, hidden).scale_bytes;
}

/* The largest |x| of a block, as bits: |f|'s bits order the non-negative
 * floats and put every NaN above infinity, so an unsigned max propagates
 * NaN as torch.amax does for DeepEP's formats (its payload does not reach
 * the scale or the values: epx_fp8_block_scale writes a NaN scale and every
 * value converts to NaN either way); skip_nan drops NaN first, as
 * TransformerEngine's fmaxf does. The GPU's amax, bit for bit. */
static inline __attribute__((always_inline)) float block_amax(const float *v, int32_t n, int skip_nan) {
  const uint32_t nan_kept = skip_nan ? 0x7f800000u : 0xffffffffu; /* |f| above it counts as 0 */
  uint32_t amax = 0;
  for (int32_t i = 0; i < n; i++) {
    uint32_t a = epx_f32_bits(v[i]) & 0x7fffffffu;
    a &= 0u - (uint32_t)(a <= nan_kept);
    amax = a > amax ? a : amax;
  }
  return epx_f32_from_bits(amax);
}

/* epx_f32_to_e4m3 of v[i] without branches, so the loop vectorizes:
 * every case computed, the right one selected by masks. The
 * subnormal code is rint(|f| * 2^9) (an exact product; adding 2^23 rounds
 * it to the integer, to even, in the current rounding mode: the library
 * never changes it). Equal to epx_f32_to_e4m3 for all 2^32 inputs
 * (bench/NOTES.md, "FP8 on the CPU"; test_fp8 checks a sample). */
static inline __attribute__((always_inline)) void e4m3_loop(const float *v, int64_t n, uint8_t *q) {
  for (int64_t i = 0; i < n; i++) {
    const uint32_t bits = epx_f32_bits(v[i]), abs = bits & 0x7fffffffu, sign = (bits >> 24) & 0x80u;
    const uint32_t normal = (abs - (120u << 23) + 0x7ffffu + ((abs >> 20) & 1u)) >> 20;
    const uint32_t subnormal = epx_f32_bits(epx_f32_from_bits(abs) * 512.0f + 8388608.0f) - 0x4b000000u;
    const uint32_t is_normal = 0u - (uint32_t)(abs >= 0x3c800000u); /* >= 2^-6 */
    const uint32_t saturates = 0u - (uint32_t)(abs >= 0x43e00000u); /* >= 448, infinity included */
    const uint32_t is_nan = 0u - (uint32_t)(abs > 0x7f800000u);
    uint32_t r = (normal & is_normal) | (subnormal & ~is_normal);
    r = ((0x7eu & saturates) | (r & ~saturates)) | sign;
    q[i] = (uint8_t)((EPX_E4M3_NAN & is_nan) | (r & ~is_nan));
  }
}

/* The same loop at AVX2's width where the processor has it (the library is
 * built for the baseline x86-64, whose SSE2 loop is half as wide:
 * bench/NOTES.md, "FP8 on the CPU"). */
#if defined(__x86_64__) && defined(__GNUC__)
#define EPX_FP8_AVX2 1
__attribute__((target("avx2"))) static void e4m3_loop_avx2(const float *v, int64_t n, uint8_t *q) {
  e4m3_loop(v, n, q);
}
#endif

void epx_fp8_e4m3_row(const float *v, int64_t n, uint8_t *q) {
#ifdef EPX_FP8_AVX2
  if (__builtin_cpu_supports("avx2")) {
    e4m3_loop_avx2(v, n, q);
    return;
  }
#endif
  e4m3_loop(v, n, q);
}

/* A row in chunks of kChunk values (whole blocks: hidden is a multiple of
 * the block, kChunk of both blocks): converted to float32 at once, each
 * block's scale found and its values multiplied, then the chunk converted
 * to e4m3 in one loop (epx_fp8_e4m3_row, the conversion test_fp8 checks). */
enum { kChunk = 512 };

static inline __attribute__((always_inline)) void quantize_row(epx_fp8_format_t format, epx_dtype_t dtype,
                                                               const void *x, int64_t hidden, uint8_t *q,
                                                               void *scales) {
  const int32_t block = epx_fp8_block(format);
  const int64_t entry = epx_fp8_scale_row_bytes(format, block);
  const size_t es = (size_t)epx_dtype_bytes(dtype);
  const int skip_nan = format == EPX_FP8_MXFP8;
  float v[kChunk];
  for (int64_t c0 = 0; c0 < hidden; c0 += kChunk) {
    const int32_t n = (int32_t)(hidden - c0 < kChunk ? hidden - c0 : kChunk);
    epx_row_to_f32(dtype, (const char *)x + (size_t)c0 * es, v, n);
    for (int32_t i0 = 0; i0 < n; i0 += block) {
      const epx_fp8_block_scale_t s = epx_fp8_block_scale(format, block_amax(v + i0, block, skip_nan));
      for (int32_t i = i0; i < i0 + block; i++) v[i] *= s.mult;
      const int64_t b = (c0 + i0) / block;
      if (entry == 4) memcpy((char *)scales + b * 4, &s.stored, 4);
      else ((uint8_t *)scales)[b] = (uint8_t)s.stored;
    }
    epx_fp8_e4m3_row(v, n, q + c0);
  }
}

#ifdef EPX_FP8_AVX2
__attribute__((target("avx2"))) static void quantize_row_avx2(epx_fp8_format_t format, epx_dtype_t dtype,
                                                              const void *x, int64_t hidden, uint8_t *q,
                                                              void *scales) {
  quantize_row(format, dtype, x, hidden, q, scales);
}
#endif

void epx_fp8_quantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const void *x, int64_t hidden,
                          uint8_t *q, void *scales) {
#ifdef EPX_FP8_AVX2
  if (__builtin_cpu_supports("avx2")) {
    quantize_row_avx2(format, dtype, x, hidden, q, scales);
    return;
  }
#endif
  quantize_row(format, dtype, x, hidden, q, scales);
}

void epx_fp8_dequantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const uint8_t *q,
                            const void *scales, int64_t hidden, void *x) {
  const int32_t block = epx_fp8_block(format);
  const int64_t entry = epx_fp8_scale_row_bytes(format, block);
  const size_t es = (size_t)epx_dtype_bytes(dtype);
  float v[128];
  for (int64_t b = 0; b < hidden / block; b++) {
    uint32_t stored = 0;
    if (entry == 4) memcpy(&stored, (const char *)scales + b * 4, 4);
    else stored = ((const uint8_t *)scales)[b];
    const float s = epx_fp8_scale_value(format, stored);
    for (int32_t i = 0; i < block; i++) v[i] = epx_e4m3_to_f32(q[b * block + i]) * s;
    epx_row_from_f32(dtype, v, (char *)x + (size_t)(b * block) * es, block);
  }
}
