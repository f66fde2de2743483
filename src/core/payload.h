/* What a payload row is: the one place every backend, kernel and bound reads
 * it from. A row of `hidden` elements of the element dtype, optionally
 * followed by per-block scales, moved by the kernels as 16-byte vectors;
 * combine (and dispatch_backward) accumulate rows into float32 whatever the
 * element dtype, and round once to the output's dtype.
 *
 * Usable from C (the CPU backend, the API's checks) and from CUDA (host glue
 * and kernels: EPX_HD marks the functions __host__ __device__ there).
 *
 * How a format is added (e.g. fp8 with a float32 scale per 128 elements):
 *  1. the element dtype: its size in epx_dtype_bytes below (epx.h gains the
 *     enum value; epx_dtype_size and every row-byte count follow from here);
 *  2. its scales, if any: a scale kind in epx_scale_kind_t and its block and
 *     scale bytes in epx_payload_format (scale_block, scale_bytes: the bytes
 *     a row carries beside its elements);
 *  3. its combine accumulation dtype in epx_payload_format (float32 for
 *     every format so far);
 *  4. the device side: a specialisation of epx_vec<T> (16-byte vector <->
 *     float32 values) and one case in epx_payload_visit
 *     (src/cuda/common/payload.cuh); the kernels are templates over T and
 *     take it from there;
 *  5. the CPU side: its conversions in src/core/dtype.h (epx_load/epx_store,
 *     the row kernels of dtype.c).
 * Nothing else switches on the element dtype's size.
 *
 * The fp8 formats (epx.h, epx_fp8_format_t) are rows of e4m3 bytes with a
 * scale per block, the scales beside the row: epx_payload_fp8 gives their
 * format (elem_bytes 1, a scale kind, block and scale bytes; `dtype` stays
 * the payload dtype the rows are quantized from and combine returns). They
 * are not an epx_dtype_t: a buffer's dtype is what combine and the backward
 * passes use, and only its dispatch moves fp8 (config.fp8_format). The
 * quantizers and scale encodings are in core/fp8.h. */
#ifndef EPX_CORE_PAYLOAD_H
#define EPX_CORE_PAYLOAD_H

#include <stdint.h>

#include "epx.h"

#ifdef __CUDACC__
#define EPX_HD __host__ __device__
#else
#define EPX_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The kernels move rows as vectors of this many bytes: a row's bytes are a
 * multiple of it (the API requires hidden % 8 == 0 and 16-byte alignment). */
#define EPX_PAYLOAD_VECTOR_BYTES 16

/* How a row's elements are scaled (none for the plain float formats). */
typedef enum epx_scale_kind {
  EPX_SCALES_NONE = 0,
  EPX_SCALES_F32 = 1,   /* a float32 per block (DeepEP's per-128 scales) */
  EPX_SCALES_UE8M0 = 2, /* an exponent byte per block, four to a word (DeepEP's UE8M0: 255 is infinite) */
  EPX_SCALES_E8M0 = 3   /* an OCP E8M0 byte per block (MXFP8: 255 is NaN, 0 is 2^-127) */
} epx_scale_kind_t;

typedef struct epx_payload_format {
  epx_dtype_t dtype;           /* element dtype of the rows */
  int32_t elem_bytes;          /* bytes of one element (0: not a payload dtype) */
  int32_t vec_elems;           /* elements per EPX_PAYLOAD_VECTOR_BYTES vector */
  int64_t hidden;              /* H, elements per row */
  int64_t row_bytes;           /* H * elem_bytes: the bytes of a row's elements */
  epx_scale_kind_t scale_kind; /* EPX_SCALES_NONE: no scales */
  int32_t scale_block;         /* elements per scale (0: no scales) */
  int64_t scale_bytes;         /* bytes of a row's scales (0: no scales) */
  epx_dtype_t combine_dtype;   /* what combine's partials and sums accumulate in */
  epx_fp8_format_t fp8;        /* EPX_FP8_NONE, or the rows are e4m3 bytes of this format */
} epx_payload_format_t;

/* Bytes of one element of a payload dtype, 0 for a value that is not one:
 * the one table of dtype sizes (epx_dtype_size returns it). */
static inline EPX_HD int32_t epx_dtype_bytes(epx_dtype_t dtype) {
  switch (dtype) {
    case EPX_FLOAT32: return 4;
    case EPX_BFLOAT16: return 2;
    case EPX_FLOAT16: return 2;
  }
  return 0;
}

/* The format of rows of `hidden` elements of `dtype`. */
static inline EPX_HD epx_payload_format_t epx_payload_format(epx_dtype_t dtype, int64_t hidden) {
  epx_payload_format_t f;
  f.dtype = dtype;
  f.elem_bytes = epx_dtype_bytes(dtype);
  f.vec_elems = f.elem_bytes ? EPX_PAYLOAD_VECTOR_BYTES / f.elem_bytes : 0;
  f.hidden = hidden;
  f.row_bytes = hidden * (int64_t)f.elem_bytes;
  f.scale_kind = EPX_SCALES_NONE;
  f.scale_block = 0;
  f.scale_bytes = 0;
  f.combine_dtype = EPX_FLOAT32;
  f.fp8 = EPX_FP8_NONE;
  return f;
}

/* An fp8 format's channels per scale and the bytes of one stored scale (a
 * float32, or an exponent byte): macros, so that a CUDA kernel templated on
 * the format has them at compile time. For a valid format only. */
#define EPX_FP8_SCALE_BLOCK(format) ((format) == EPX_FP8_MXFP8 ? 32 : 128)
#define EPX_FP8_SCALE_ENTRY_BYTES(format) ((format) == EPX_FP8_E4M3_F32_128 ? 4 : 1)

/* The fp8 rows of `format` quantized from rows of `dtype` (hidden a
 * multiple of the format's block; see epx_fp8_hidden_multiple): H e4m3
 * bytes, then H / block scales. An unknown format gives no scales and
 * scale_block 0. */
static inline EPX_HD epx_payload_format_t epx_payload_fp8(epx_fp8_format_t format, epx_dtype_t dtype,
                                                          int64_t hidden) {
  epx_payload_format_t f = epx_payload_format(dtype, hidden);
  f.elem_bytes = 1;
  f.vec_elems = EPX_PAYLOAD_VECTOR_BYTES;
  f.row_bytes = hidden;
  f.fp8 = format;
  switch (format) {
    case EPX_FP8_E4M3_F32_128: f.scale_kind = EPX_SCALES_F32; break;
    case EPX_FP8_E4M3_UE8M0_128: f.scale_kind = EPX_SCALES_UE8M0; break;
    case EPX_FP8_MXFP8: f.scale_kind = EPX_SCALES_E8M0; break;
    default: f.scale_kind = EPX_SCALES_NONE; break;
  }
  f.scale_block = f.scale_kind == EPX_SCALES_NONE ? 0 : EPX_FP8_SCALE_BLOCK(format);
  f.scale_bytes = f.scale_block ? hidden / f.scale_block * EPX_FP8_SCALE_ENTRY_BYTES(format) : 0;
  return f;
}

/* Bytes of an fp8 row packed with its scales, as the exchanges move it (one
 * message row: the e4m3 bytes, the scales after them, zero-padded or
 * unused up to a whole number of 16-byte vectors). */
static inline EPX_HD int64_t epx_payload_fp8_packed_bytes(const epx_payload_format_t *f) {
  return (f->row_bytes + f->scale_bytes + EPX_PAYLOAD_VECTOR_BYTES - 1) / EPX_PAYLOAD_VECTOR_BYTES *
         EPX_PAYLOAD_VECTOR_BYTES;
}

/* Bytes of a row's elements: hidden * the dtype's size. */
static inline EPX_HD int64_t epx_payload_row_bytes(epx_dtype_t dtype, int64_t hidden) {
  return hidden * (int64_t)epx_dtype_bytes(dtype);
}

/* 16-byte vectors of a row (row bytes are a multiple of 16). */
static inline EPX_HD int64_t epx_payload_row_vectors(epx_dtype_t dtype, int64_t hidden) {
  return epx_payload_row_bytes(dtype, hidden) / EPX_PAYLOAD_VECTOR_BYTES;
}

/* Bytes of a row of partials in the combine accumulation dtype (float32 for
 * every format): what a float32 partial, staged or sent, takes. */
static inline EPX_HD int64_t epx_payload_partial_row_bytes(int64_t hidden) {
  return epx_payload_row_bytes(EPX_FLOAT32, hidden);
}

#ifdef __cplusplus
}
#endif

#endif
