/* FP8 rows: e4m3fn conversions, the scale encodings (float32, DeepEP's
 * UE8M0, OCP's E8M0) and the per-block quantizers of the epx_fp8_format_t
 * formats, bit for bit the peers' formulas (epx.h says which and how they
 * treat NaN and infinities). Plain C on the host; the CPU backend, the
 * public epx_quantize / epx_dequantize and the tests' references use them. */
#ifndef EPX_CORE_FP8_H
#define EPX_CORE_FP8_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_E4M3_MAX 448.0f
#define EPX_E4M3_NAN 0x7fu /* the NaN a conversion writes, as CUDA's satfinite cvt */

/* float32 -> e4m3fn, rounding to nearest even; finite values beyond 448
 * and infinities saturate to +-448 (CUDA's __NV_SATFINITE); NaN -> 0x7f. */
static inline uint8_t epx_f32_to_e4m3(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return EPX_E4M3_NAN;
  if (abs >= 0x43e00000u) return sign | 0x7eu; /* >= 448 (infinity included) */
  if (abs >= 0x3c800000u) {                    /* >= 2^-6: normal */
    /* Rebias the exponent (127 -> 7) and round the mantissa's low 20 bits to
     * nearest even; a carry moves into the exponent, as it should. */
    uint32_t odd = (abs >> 20) & 1u;
    return sign | (uint8_t)((abs - (120u << 23) + 0x7ffffu + odd) >> 20);
  }
  /* Subnormal: a multiple of 2^-9, m = round(|f| * 2^9) in 0..8 (8 is the
   * smallest normal, whose encoding is 8 too). */
  uint32_t exp = abs >> 23;
  if (exp < 116) return sign; /* below 2^-11: under half the smallest subnormal */
  uint32_t man = (abs & 0x7fffffu) | 0x800000u;
  uint32_t shift = 141u - exp; /* 21..25 */
  uint32_t m = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (m & 1u))) m++;
  return sign | (uint8_t)m;
}

static inline float epx_e4m3_to_f32(uint8_t q) {
  uint32_t sign = (uint32_t)(q & 0x80u) << 24, exp = (q >> 3) & 0xfu, man = q & 7u, bits;
  if (exp == 0xf && man == 7) {
    bits = sign | 0x7fc00000u;
  } else if (exp == 0) {
    float v = (float)man * 0x1p-9f;
    memcpy(&bits, &v, sizeof bits);
    bits |= sign;
  } else {
    bits = sign | ((exp + 120u) << 23) | (man << 20);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* The format's block of channels per scale (0: not an fp8 format), the
 * multiple hidden must be, and the bytes of one stored scale entry. */
int32_t epx_fp8_block(epx_fp8_format_t format);
int32_t epx_fp8_hidden_multiple(epx_fp8_format_t format);
/* Bytes of a row's scales (hidden a multiple of the block). */
int64_t epx_fp8_scale_row_bytes(epx_fp8_format_t format, int64_t hidden);

/* One row: x [hidden] of dtype -> q [hidden] e4m3 bytes and its scales
 * (epx_fp8_scale_row_bytes bytes, any alignment), and back. */
void epx_fp8_quantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const void *x, int64_t hidden,
                          uint8_t *q, void *scales);
void epx_fp8_dequantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const uint8_t *q,
                            const void *scales, int64_t hidden, void *x);

#ifdef __cplusplus
}
#endif

#endif
