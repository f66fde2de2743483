/* The public host calls of the fp8 formats: their scale shapes and the
 * quantizer and dequantizer (core/fp8.h holds the formulas). The fp8
 * dispatches are with the other payload calls, in payload.c. */
#include <stdint.h>

#include "core/checked.h"
#include "core/error.h"
#include "core/fp8.h"

/* A format and hidden size the calls can serve. */
static epx_status_t check_format(const char *fn, epx_fp8_format_t format, int64_t hidden) {
  int32_t multiple = epx_fp8_hidden_multiple(format);
  EPX_REQUIRE(multiple, "%s: format %d is not an fp8 format; pass EPX_FP8_E4M3_F32_128, "
              "EPX_FP8_E4M3_UE8M0_128 or EPX_FP8_MXFP8", fn, (int)format);
  EPX_REQUIRE(hidden > 0 && hidden % multiple == 0,
              "%s: hidden is %lld; the format needs a positive multiple of %d", fn, (long long)hidden, multiple);
  return EPX_SUCCESS;
}

epx_status_t epx_fp8_scale_shape(epx_fp8_format_t format, int64_t hidden, int64_t *scale_cols,
                                 size_t *scale_bytes) {
  const char *fn = "epx_fp8_scale_shape";
  epx_error_clear();
  epx_status_t status = check_format(fn, format, hidden);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(scale_cols && scale_bytes, "%s: %s is NULL; pass where to write it", fn,
              scale_cols ? "scale_bytes" : "scale_cols");
  *scale_bytes = (size_t)epx_fp8_scale_col_bytes(format);
  *scale_cols = epx_fp8_scale_row_bytes(format, hidden) / (int64_t)*scale_bytes;
  return EPX_SUCCESS;
}

/* The arguments of a quantizer call, and the byte counts of its three
 * arrays (x, x_q, x_scales), each checked to fit 64 bits (a wrapped count
 * would let the row loop run past the caller's arrays). */
static epx_status_t check_rows(const char *fn, epx_fp8_format_t format, epx_dtype_t dtype, int64_t rows,
                               int64_t hidden, const void *a, const void *b, const void *c) {
  epx_status_t status = check_format(fn, format, hidden);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(dtype == EPX_FLOAT32 || dtype == EPX_BFLOAT16 || dtype == EPX_FLOAT16,
              "%s: dtype %d is not EPX_FLOAT32, EPX_BFLOAT16 or EPX_FLOAT16", fn, (int)dtype);
  EPX_REQUIRE(rows >= 0, "%s: rows is %lld; pass a count >= 0", fn, (long long)rows);
  int64_t x_bytes, q_bytes, s_bytes;
  const char *arg = "rows (or hidden)";
  if (EPX_CHECKED_PRODUCT(&x_bytes, fn, arg, "rows * hidden * dtype size (the bytes of x)", rows,
                          hidden, (int64_t)epx_dtype_size(dtype)) != EPX_SUCCESS ||
      EPX_CHECKED_PRODUCT(&q_bytes, fn, arg, "rows * hidden (the bytes of x_q)", rows, hidden) !=
          EPX_SUCCESS ||
      EPX_CHECKED_PRODUCT(&s_bytes, fn, arg, "rows * scale bytes per row (the bytes of x_scales)",
                          rows, epx_fp8_scale_row_bytes(format, hidden)) != EPX_SUCCESS)
    return EPX_ERROR_INVALID_ARGUMENT;
  EPX_REQUIRE(rows == 0 || (a && b && c), "%s: a tensor is NULL; pass x, x_q and x_scales of %lld rows", fn,
              (long long)rows);
  return EPX_SUCCESS;
}

/* A quantizer call's entry: its arguments checked (check_rows), and the
 * bytes of a row of x and of its scales. */
static epx_status_t begin_rows(const char *fn, epx_fp8_format_t format, epx_dtype_t dtype, int64_t rows,
                               int64_t hidden, const void *x, const void *x_q, const void *x_scales, size_t *x_row,
                               size_t *s_row) {
  epx_error_clear();
  epx_status_t status = check_rows(fn, format, dtype, rows, hidden, x, x_q, x_scales);
  if (status != EPX_SUCCESS) return status;
  *x_row = (size_t)hidden * epx_dtype_size(dtype);
  *s_row = (size_t)epx_fp8_scale_row_bytes(format, hidden);
  return EPX_SUCCESS;
}

epx_status_t epx_quantize(epx_fp8_format_t format, epx_dtype_t dtype, int64_t rows, int64_t hidden,
                          const void *x, void *x_q, void *x_scales) {
  size_t x_row, s_row;
  epx_status_t status = begin_rows("epx_quantize", format, dtype, rows, hidden, x, x_q, x_scales, &x_row, &s_row);
  if (status != EPX_SUCCESS) return status;
  for (int64_t r = 0; r < rows; r++)
    epx_fp8_quantize_row(format, dtype, (const char *)x + (size_t)r * x_row, hidden,
                         (uint8_t *)x_q + (size_t)r * (size_t)hidden, (char *)x_scales + (size_t)r * s_row);
  return EPX_SUCCESS;
}

epx_status_t epx_dequantize(epx_fp8_format_t format, epx_dtype_t dtype, int64_t rows, int64_t hidden,
                            const void *x_q, const void *x_scales, void *x) {
  size_t x_row, s_row;
  epx_status_t status =
      begin_rows("epx_dequantize", format, dtype, rows, hidden, x, x_q, x_scales, &x_row, &s_row);
  if (status != EPX_SUCCESS) return status;
  for (int64_t r = 0; r < rows; r++)
    epx_fp8_dequantize_row(format, dtype, (const uint8_t *)x_q + (size_t)r * (size_t)hidden,
                           (const char *)x_scales + (size_t)r * s_row, hidden, (char *)x + (size_t)r * x_row);
  return EPX_SUCCESS;
}
