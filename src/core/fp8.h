/* FP8 rows: e4m3fn conversions, the scale encodings (float32, DeepEP's
 * UE8M0, OCP's E8M0) and the per-block quantizers of the epx_fp8_format_t
 * formats, bit for bit the peers' formulas (epx.h says which and how they
 * treat NaN and infinities). The scalar steps are inline and usable from
 * CUDA too (EPX_HD), so the GPU's quantizer is this one: each step is one
 * IEEE float32 operation (nvcc's default division is the correctly rounded
 * one, and no step is a multiply-add it could fuse). The row functions
 * (fp8.c) serve the CPU backend and epx_quantize / epx_dequantize. */
#ifndef EPX_CORE_FP8_H
#define EPX_CORE_FP8_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "core/payload.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_E4M3_MAX 448.0f
#define EPX_E4M3_NAN 0x7fu /* the NaN a conversion writes, as CUDA's satfinite cvt */
#define EPX_FP8_SCALE_NAN 0x7fffffffu /* a NaN float32 scale: CUDA's canonical NaN */

/* float32 -> e4m3fn, rounding to nearest even; finite values beyond 448
 * and infinities saturate to +-448 (CUDA's __NV_SATFINITE); NaN -> 0x7f. */
static inline EPX_HD uint8_t epx_f32_to_e4m3(float f) {
  uint32_t bits = epx_f32_bits(f);
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

static inline EPX_HD float epx_e4m3_to_f32(uint8_t q) {
  uint32_t sign = (uint32_t)(q & 0x80u) << 24, exp = (q >> 3) & 0xfu, man = q & 7u;
  if (exp == 0xf && man == 7) return epx_f32_from_bits(sign | 0x7fc00000u);
  if (exp == 0) return epx_f32_from_bits(epx_f32_bits((float)man * 0x1p-9f) | sign);
  return epx_f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

/* A block's quantization from its amax: the multiplier of its values and
 * the scale as stored (float32 bits, or the exponent byte). amax is taken
 * with NaN propagating for DeepEP's formats (torch.amax) and skipping NaN
 * for MXFP8 (TransformerEngine's fmaxf). */
typedef struct {
  float mult;
  uint32_t stored;
} epx_fp8_block_scale_t;

static inline EPX_HD int epx_fp8_nonfinite(float f) { return (epx_f32_bits(f) & 0x7fffffffu) >= 0x7f800000u; }

/* 2^ceil(log2(s)) from the bits (DeepGEMM's ceil_to_ue8m0 computes it with
 * log2, which agrees for every amax of bf16 rows). s is a positive normal,
 * an infinity or NaN; the latter two are returned as they are. */
static inline EPX_HD float epx_fp8_ceil_pow2(float s) {
  uint32_t bits = epx_f32_bits(s);
  if (epx_fp8_nonfinite(s)) return s;
  return epx_f32_from_bits(((bits >> 23) + ((bits & 0x7fffffu) != 0)) << 23);
}

/* TransformerEngine's float_to_e8m0 (the pre-Blackwell branch; Blackwell's
 * cvt.rp.satfinite.ue8m0x2 gives the same): the exponent rounded up. */
static inline EPX_HD uint8_t epx_fp8_te_e8m0(float v) {
  uint32_t bits = epx_f32_bits(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0xff;
  if ((bits & 0x7fffffffu) == 0x7f800000u) return 0xfe;
  if (v == 0.0f) return 0;
  uint32_t exp = bits >> 23, man = bits & 0x7fffffu;
  if (man > 0 && exp != 0xfe && !(exp == 0 && man <= 0x400000u)) exp++;
  return (uint8_t)exp;
}

/* 2^(127 - b), TransformerEngine's exp2f_rcp: the multiplier of a block. */
static inline EPX_HD float epx_fp8_te_exp2f_rcp(uint8_t b) {
  if (b == 255) return epx_f32_from_bits(0x7fffffffu);
  if (b == 254) return epx_f32_from_bits(0x00400000u);
  return epx_f32_from_bits((uint32_t)(254 - b) << 23);
}

static inline EPX_HD epx_fp8_block_scale_t epx_fp8_block_scale(epx_fp8_format_t format, float amax) {
  epx_fp8_block_scale_t s;
  if (format == EPX_FP8_MXFP8) {
    uint8_t e = epx_fp8_te_e8m0(amax * (float)(1.0 / 448.0)); /* TE's max_norm_rcp */
    s.mult = epx_fp8_te_exp2f_rcp(e);
    s.stored = e;
    return s;
  }
  amax = amax < 1e-4f ? 1e-4f : amax; /* DeepEP's clamp (NaN stays NaN, as torch.clamp keeps it) */
  /* amax / 448.0 as torch computes it on CUDA (a division by a CPU scalar
   * is a multiply by its float32 reciprocal there; torch on the CPU divides,
   * which differs in the last bit for about half the values) and as
   * DeepEP's kernels do (amax * kFP8AmaxInv). */
  const float amax_448 = amax * (float)(1.0 / 448.0);
  if (format == EPX_FP8_E4M3_F32_128) {
    s.mult = (1.0f / amax) * EPX_E4M3_MAX; /* eager torch: 448.0 / t is t.reciprocal() * 448 */
    /* A NaN scale as the GPU's arithmetic writes it (the CPU's keeps the
     * operand's payload, 0x7fc00000): the same bits on both backends. */
    s.stored = amax != amax ? EPX_FP8_SCALE_NAN : epx_f32_bits(amax_448);
    return s;
  }
  float scale = epx_fp8_ceil_pow2(amax_448);
  s.mult = 1.0f / scale;
  s.stored = epx_fp8_nonfinite(scale) ? 0xffu : epx_f32_bits(scale) >> 23;
  return s;
}

/* A stored scale as the float32 multiplier of its block's e4m3 values (the
 * peers' dequantizers: DeepEP's per_token_cast_back shifts a UE8M0 byte into
 * the exponent, so 255 is infinity; OCP E8M0 255 is NaN, 0 is 2^-127). */
static inline EPX_HD float epx_fp8_scale_value(epx_fp8_format_t format, uint32_t stored) {
  if (format == EPX_FP8_E4M3_F32_128) return epx_f32_from_bits(stored);
  if (format == EPX_FP8_E4M3_UE8M0_128) return epx_f32_from_bits(stored << 23);
  if (stored == 255) return epx_f32_from_bits(0x7fffffffu);
  return epx_f32_from_bits(stored == 0 ? 0x00400000u : stored << 23);
}

/* The format's block of channels per scale (0: not an fp8 format) and the
 * multiple hidden must be. */
int32_t epx_fp8_block(epx_fp8_format_t format);
int32_t epx_fp8_hidden_multiple(epx_fp8_format_t format);
/* Bytes of a column of the caller's scales tensor (epx_fp8_scale_shape),
 * the alignment that tensor needs: a float32, an int32 word of four UE8M0
 * bytes, or an E8M0 byte. */
int32_t epx_fp8_scale_col_bytes(epx_fp8_format_t format);
/* Bytes of a row's scales (hidden a multiple of the block). */
int64_t epx_fp8_scale_row_bytes(epx_fp8_format_t format, int64_t hidden);

/* q[i] = epx_f32_to_e4m3(v[i]) for i < n, as a loop that vectorizes (at
 * AVX2's width where the processor has it): the CPU quantizer's
 * conversion. */
void epx_fp8_e4m3_row(const float *v, int64_t n, uint8_t *q);

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
