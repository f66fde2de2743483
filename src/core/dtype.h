/* Conversions between the payload dtypes and float32, and the row kernels the
 * CPU paths are built from. Rounding is to nearest even; NaN stays NaN. */
#ifndef EPX_CORE_DTYPE_H
#define EPX_CORE_DTYPE_H

#include <stdint.h>
#include <string.h>

#include "core/payload.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A float32's bits, and the float32 of bits (host and device; memcpy is
 * the aliasing-safe cast, compiled to a register move). */
static inline EPX_HD uint32_t epx_f32_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return bits;
}

static inline EPX_HD float epx_f32_from_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline float epx_bf16_to_f32(uint16_t h) { return epx_f32_from_bits((uint32_t)h << 16); }

/* Branch-free so that row loops vectorise. */
static inline uint16_t epx_f32_to_bf16(float f) {
  const uint32_t bits = epx_f32_bits(f);
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline float epx_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else { /* subnormal: normalise */
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        exp--;
      }
      man &= 0x3ffu;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
  }
  return epx_f32_from_bits(bits);
}

static inline uint16_t epx_f32_to_f16(float f) {
  const uint32_t bits = epx_f32_bits(f);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);      /* NaN */
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);     /* overflow to Inf */
  if (abs < 0x38800000u) {                                       /* subnormal or zero */
    if (abs < 0x33000000u) return (uint16_t)sign;                /* below half the smallest */
    uint32_t exp = abs >> 23;
    uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp; /* 14..24 */
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

/* Element i of a payload row as float32. */
static inline float epx_load(epx_dtype_t dtype, const void *row, int64_t i) {
  switch (dtype) {
    case EPX_BFLOAT16: return epx_bf16_to_f32(((const uint16_t *)row)[i]);
    case EPX_FLOAT16: return epx_f16_to_f32(((const uint16_t *)row)[i]);
    default: return ((const float *)row)[i];
  }
}

static inline void epx_store(epx_dtype_t dtype, void *row, int64_t i, float v) {
  switch (dtype) {
    case EPX_BFLOAT16: ((uint16_t *)row)[i] = epx_f32_to_bf16(v); break;
    case EPX_FLOAT16: ((uint16_t *)row)[i] = epx_f32_to_f16(v); break;
    default: ((float *)row)[i] = v; break;
  }
}

/* Row kernels (src/core/dtype.c); n elements each. */
void epx_row_to_f32(epx_dtype_t dtype, const void *src, float *dst, int64_t n);
void epx_row_from_f32(epx_dtype_t dtype, const float *src, void *dst, int64_t n);
/* Copies a row with stores that bypass the cache where the CPU has them
 * (x86-64 SSE2): the destination is not read first, which halves the memory
 * traffic of scattered row writes. dst and src 16-byte aligned, bytes a
 * multiple of 16. Call epx_stream_fence() before another thread may read. */
void epx_row_copy_stream(void *dst, const void *src, size_t bytes);
void epx_stream_fence(void);
/* dst = round(w * src) with streaming stores (dst must not overlap src). */
void epx_row_scale_stream(epx_dtype_t dtype, const void *src, float w, void *dst, int64_t n);
/* dst = round(src) for a float32 row, with streaming stores. */
void epx_row_from_f32_stream(epx_dtype_t dtype, const float *src, void *dst, int64_t n);
/* P = 0 + sum_j w[j] * rows[j] (w NULL: plain sum), in j order, float32, in
 * one pass over the n_rows inputs (they stream together). first: P is
 * written to acc; else acc += P. */
void epx_rows_accumulate(epx_dtype_t dtype, const void *const *rows, const float *w, int32_t n_rows,
                         float *acc, int first, int64_t n);
/* out = round(0 + sum_j w[j] * rows[j]) in the dtype, streaming stores: the
 * same value epx_rows_accumulate then epx_row_from_f32 give, in one pass. */
void epx_rows_sum_store(epx_dtype_t dtype, const void *const *rows, const float *w, int32_t n_rows,
                        void *out, int64_t n);
/* <a, b> in float32, in a fixed order (same result wherever it runs) */
float epx_row_dot(epx_dtype_t dtype, const void *a, const void *b, int64_t n);

#ifdef __cplusplus
}
#endif

#endif
