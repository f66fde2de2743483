/* The fp8 row quantizers (core/fp8.h has the per-block formulas, shared
 * with the GPU): a block's amax, its scale, its values. */
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

void epx_fp8_quantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const void *x, int64_t hidden,
                          uint8_t *q, void *scales) {
  const int32_t block = epx_fp8_block(format);
  const int64_t entry = epx_fp8_scale_row_bytes(format, block);
  for (int64_t b = 0; b < hidden / block; b++) {
    const int64_t i0 = b * block;
    epx_fp8_block_scale_t s = epx_fp8_block_scale(format, block_amax(dtype, x, i0, block, format == EPX_FP8_MXFP8));
    scale_block(dtype, x, i0, block, s.mult, q);
    if (entry == 4) memcpy((char *)scales + b * 4, &s.stored, 4);
    else ((uint8_t *)scales)[b] = (uint8_t)s.stored;
  }
}

void epx_fp8_dequantize_row(epx_fp8_format_t format, epx_dtype_t dtype, const uint8_t *q,
                            const void *scales, int64_t hidden, void *x) {
  const int32_t block = epx_fp8_block(format);
  const int64_t entry = epx_fp8_scale_row_bytes(format, block);
  for (int64_t b = 0; b < hidden / block; b++) {
    uint32_t stored = 0;
    if (entry == 4) memcpy(&stored, (const char *)scales + b * 4, 4);
    else stored = ((const uint8_t *)scales)[b];
    float s = epx_fp8_scale_value(format, stored);
    for (int64_t i = b * block; i < (b + 1) * block; i++) epx_store(dtype, x, i, epx_e4m3_to_f32(q[i]) * s);
  }
}
