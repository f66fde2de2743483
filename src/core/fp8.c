/* The fp8 quantizers (core/fp8.h). Each step is one float32 operation in the
 * order of the peer's formula, so that the bits match theirs: DeepEP's
 * per_token_cast_to_fp8 as eager PyTorch evaluates it (a scalar divided by a
 * tensor is the tensor's reciprocal times the scalar), DeepGEMM's
 * ceil_to_ue8m0, TransformerEngine's float_to_e8m0 and exp2f_rcp. */
#include "core/fp8.h"

#include <math.h>

#include "core/dtype.h"
#include "core/payload.h"

int32_t epx_fp8_block(epx_fp8_format_t format) { return epx_payload_fp8(format, EPX_FLOAT32, 0).scale_block; }

/* Four UE8M0 bytes share an int32 word, so the words need 4 whole blocks. */
int32_t epx_fp8_hidden_multiple(epx_fp8_format_t format) {
  return format == EPX_FP8_E4M3_UE8M0_128 ? 512 : epx_fp8_block(format);
}

int64_t epx_fp8_scale_row_bytes(epx_fp8_format_t format, int64_t hidden) {
  return epx_payload_fp8(format, EPX_FLOAT32, hidden).scale_bytes;
}

/* The largest |x| of n elements from i0. DeepEP's formula takes it with
 * torch.amax, which propagates NaN; TransformerEngine's kernels with
 * fmaxf, which skips it (skip_nan). */
static float block_amax(epx_dtype_t dtype, const void *x, int64_t i0, int64_t n, int skip_nan) {
  float amax = 0.0f;
  int nan = 0;
  for (int64_t i = i0; i < i0 + n; i++) {
    float a = fabsf(epx_load(dtype, x, i));
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  return nan && !skip_nan ? NAN : amax;
}

static void scale_block(epx_dtype_t dtype, const void *x, int64_t i0, int64_t n, float mult, uint8_t *q) {
  for (int64_t i = i0; i < i0 + n; i++) q[i] = epx_f32_to_e4m3(epx_load(dtype, x, i) * mult);
}

/* amax clamped below at 1e-4 (NaN stays NaN, as torch.clamp keeps it). */
static float deepep_amax(epx_dtype_t dtype, const void *x, int64_t i0) {
  float amax = block_amax(dtype, x, i0, 128, 0);
  return amax < 1e-4f ? 1e-4f : amax;
}

/* 2^ceil(log2(s)) from the bits (DeepGEMM's ceil_to_ue8m0 computes it with
 * log2, which agrees for every amax of bf16 rows). s is a positive normal,
 * an infinity or NaN; the latter two are returned as they are. */
static float ceil_pow2(float s) {
  uint32_t bits;
  memcpy(&bits, &s, sizeof bits);
  if ((bits & 0x7fffffffu) >= 0x7f800000u) return s;
  bits = ((bits >> 23) + ((bits & 0x7fffffu) != 0)) << 23;
  memcpy(&s, &bits, sizeof s);
  return s;
}

/* TransformerEngine's float_to_e8m0 (the pre-Blackwell branch; Blackwell's
 * cvt.rp.satfinite.ue8m0x2 gives the same): the exponent rounded up. */
static uint8_t te_float_to_e8m0(float v) {
  if (v != v) return 0xff;
  if (isinf(v)) return 0xfe;
  if (v == 0.0f) return 0;
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  uint32_t exp = bits >> 23, man = bits & 0x7fffffu;
  if (man > 0 && exp != 0xfe && !(exp == 0 && man <= 0x400000u)) exp++;
  return (uint8_t)exp;
}

static float from_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* 2^(127 - b), TransformerEngine's exp2f_rcp: the multiplier of a block. */
static float te_exp2f_rcp(uint8_t b) {
  if (b == 255) return from_bits(0x7fffffffu);
  if (b == 254) return from_bits(0x00400000u);
  return from_bits((uint32_t)(254 - b) << 23);
}

/* 2^(b - 127), OCP E8M0 (255 is NaN; 0 is 2^-127, a float32 subnormal). */
static float e8m0_to_f32(uint8_t b) {
  if (b == 255) return from_bits(0x7fffffffu);
  if (b == 0) return from_bits(0x00400000u);
  return from_bits((uint32_t)b << 23);
}

void epx_fp8_quantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const void *x, int64_t hidden,
                          uint8_t *q, void *scales) {
  const int32_t block = epx_fp8_block(format);
  uint8_t *bytes = scales;
  for (int64_t b = 0; b < hidden / block; b++) {
    const int64_t i0 = b * block;
    if (format == EPX_FP8_E4M3_F32_128) {
      float amax = deepep_amax(dtype, x, i0);
      scale_block(dtype, x, i0, block, (1.0f / amax) * EPX_E4M3_MAX, q);
      float scale = amax / EPX_E4M3_MAX;
      memcpy(bytes + b * 4, &scale, sizeof scale);
    } else if (format == EPX_FP8_E4M3_UE8M0_128) {
      float scale = ceil_pow2(deepep_amax(dtype, x, i0) / EPX_E4M3_MAX);
      scale_block(dtype, x, i0, block, 1.0f / scale, q);
      uint32_t bits;
      memcpy(&bits, &scale, sizeof bits);
      bytes[b] = isfinite(scale) ? (uint8_t)(bits >> 23) : 0xff;
    } else {
      uint8_t e = te_float_to_e8m0(block_amax(dtype, x, i0, block, 1) * (float)(1.0 / 448.0));
      scale_block(dtype, x, i0, block, te_exp2f_rcp(e), q);
      bytes[b] = e;
    }
  }
}

/* A block's scale as a float32 multiplier of its e4m3 values. */
static float block_scale(epx_fp8_format_t format, const uint8_t *bytes, int64_t b) {
  if (format == EPX_FP8_E4M3_F32_128) {
    float s;
    memcpy(&s, bytes + b * 4, sizeof s);
    return s;
  }
  /* DeepEP's per_token_cast_back shifts the UE8M0 byte into the exponent. */
  return format == EPX_FP8_E4M3_UE8M0_128 ? from_bits((uint32_t)bytes[b] << 23) : e8m0_to_f32(bytes[b]);
}

void epx_fp8_dequantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const uint8_t *q,
                            const void *scales, int64_t hidden, void *x) {
  const int32_t block = epx_fp8_block(format);
  for (int64_t b = 0; b < hidden / block; b++) {
    float s = block_scale(format, scales, b);
    for (int64_t i = b * block; i < (b + 1) * block; i++) epx_store(dtype, x, i, epx_e4m3_to_f32(q[i]) * s);
  }
}
