/* Row kernels over the payload dtypes. Each loop is a plain loop over
 * contiguous elements so the compiler vectorises it; the float32 cases are
 * separate so they need no per-element dtype switch. */
#include "core/dtype.h"

#include "core/error.h"

size_t epx_dtype_size(epx_dtype_t dtype) {
  switch (dtype) {
    case EPX_FLOAT32: return 4;
    case EPX_BFLOAT16: return 2;
    case EPX_FLOAT16: return 2;
  }
  return 0;
}

void epx_row_to_f32(epx_dtype_t dtype, const void *src, float *dst, int64_t n) {
  if (dtype == EPX_FLOAT32) {
    memcpy(dst, src, (size_t)n * sizeof(float));
  } else if (dtype == EPX_BFLOAT16) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = epx_bf16_to_f32(s[i]);
  } else {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = epx_f16_to_f32(s[i]);
  }
}

void epx_row_from_f32(epx_dtype_t dtype, const float *src, void *dst, int64_t n) {
  if (dtype == EPX_FLOAT32) {
    memcpy(dst, src, (size_t)n * sizeof(float));
  } else if (dtype == EPX_BFLOAT16) {
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = epx_f32_to_bf16(src[i]);
  } else {
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = epx_f32_to_f16(src[i]);
  }
}

void epx_row_axpy(epx_dtype_t dtype, const void *src, float w, float *acc, int64_t n) {
  if (dtype == EPX_FLOAT32) {
    const float *s = src;
    for (int64_t i = 0; i < n; i++) acc[i] += w * s[i];
  } else if (dtype == EPX_BFLOAT16) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) acc[i] += w * epx_bf16_to_f32(s[i]);
  } else {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) acc[i] += w * epx_f16_to_f32(s[i]);
  }
}

void epx_row_add(epx_dtype_t dtype, const void *src, float *acc, int64_t n) {
  if (dtype == EPX_FLOAT32) {
    const float *s = src;
    for (int64_t i = 0; i < n; i++) acc[i] += s[i];
  } else if (dtype == EPX_BFLOAT16) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) acc[i] += epx_bf16_to_f32(s[i]);
  } else {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) acc[i] += epx_f16_to_f32(s[i]);
  }
}

void epx_row_scale(epx_dtype_t dtype, const void *src, float w, void *dst, int64_t n) {
  if (dtype == EPX_FLOAT32) {
    const float *s = src;
    float *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = w * s[i];
  } else if (dtype == EPX_BFLOAT16) {
    const uint16_t *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = epx_f32_to_bf16(w * epx_bf16_to_f32(s[i]));
  } else {
    const uint16_t *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = epx_f32_to_f16(w * epx_f16_to_f32(s[i]));
  }
}

/* Eight interleaved partial sums, added pairwise at the end: vectorisable and
 * the same order on every call. */
float epx_row_dot(epx_dtype_t dtype, const void *a, const void *b, int64_t n) {
  float lane[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) lane[j] += epx_load(dtype, a, i + j) * epx_load(dtype, b, i + j);
  for (; i < n; i++) lane[i & 7] += epx_load(dtype, a, i) * epx_load(dtype, b, i);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

epx_status_t epx_convert(epx_dtype_t dst_dtype, void *dst, epx_dtype_t src_dtype,
                         const void *src, int64_t n) {
  epx_error_clear();
  EPX_REQUIRE(epx_dtype_size(dst_dtype), "epx_convert: dst_dtype %d is not an epx_dtype_t; use EPX_FLOAT32, EPX_BFLOAT16 or EPX_FLOAT16", (int)dst_dtype);
  EPX_REQUIRE(epx_dtype_size(src_dtype), "epx_convert: src_dtype %d is not an epx_dtype_t; use EPX_FLOAT32, EPX_BFLOAT16 or EPX_FLOAT16", (int)src_dtype);
  EPX_REQUIRE(n >= 0, "epx_convert: n is %lld; pass a count >= 0", (long long)n);
  if (n == 0) return EPX_SUCCESS;
  EPX_REQUIRE(dst && src, "epx_convert: %s is NULL; pass an array of n elements", dst ? "src" : "dst");
  if (src_dtype == dst_dtype) {
    if (dst != src) memmove(dst, src, (size_t)n * epx_dtype_size(src_dtype));
    return EPX_SUCCESS;
  }
  for (int64_t i = 0; i < n; i++) epx_store(dst_dtype, dst, i, epx_load(src_dtype, src, i));
  return EPX_SUCCESS;
}
