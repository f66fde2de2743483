/* Row kernels over the payload dtypes. Each loop is a plain loop over
 * contiguous elements so the compiler vectorises it; the float32 cases are
 * separate so they need no per-element dtype switch. */
#include "core/dtype.h"

#include "core/error.h"
#include "core/payload.h"

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define EPX_HAVE_STREAM 1
#else
#define EPX_HAVE_STREAM 0
#endif

size_t epx_dtype_size(epx_dtype_t dtype) { return (size_t)epx_dtype_bytes(dtype); }

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

void epx_row_copy_stream(void *dst, const void *src, size_t bytes) {
#if EPX_HAVE_STREAM
  __m128i *d = dst;
  const __m128i *s = src;
  size_t n = bytes / 16, i = 0;
  for (; i + 4 <= n; i += 4) {
    __m128i a = _mm_load_si128(s + i), b = _mm_load_si128(s + i + 1);
    __m128i c = _mm_load_si128(s + i + 2), e = _mm_load_si128(s + i + 3);
    _mm_stream_si128(d + i, a);
    _mm_stream_si128(d + i + 1, b);
    _mm_stream_si128(d + i + 2, c);
    _mm_stream_si128(d + i + 3, e);
  }
  for (; i < n; i++) _mm_stream_si128(d + i, _mm_load_si128(s + i));
#else
  memcpy(dst, src, bytes);
#endif
}

void epx_stream_fence(void) {
#if EPX_HAVE_STREAM
  _mm_sfence();
#endif
}

/* Work in blocks that stay in L1: the block's inputs stream in together and
 * the result leaves once. */
#define BLOCK 512

void epx_row_from_f32_stream(epx_dtype_t dtype, const float *src, void *dst, int64_t n) {
  if (dtype == EPX_FLOAT32) {
    epx_row_copy_stream(dst, src, (size_t)n * sizeof(float));
    return;
  }
  _Alignas(64) uint16_t block[BLOCK];
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    int64_t m = n - i0 < BLOCK ? n - i0 : BLOCK;
    epx_row_from_f32(dtype, src + i0, block, m);
    epx_row_copy_stream((uint16_t *)dst + i0, block, (size_t)m * 2);
  }
}


/* block[i] = (((start + w0*r0[i]) + w1*r1[i]) + ...) for one to four rows in
 * one pass, start = 0 (from_zero: no zeroing pass, no read of block) or
 * block[i]: the same order and bits as adding one row at a time to a zeroed
 * block. w NULL: plain sums. */
#define LOAD(dtype, row, i)                                                             \
  ((dtype) == EPX_FLOAT32    ? ((const float *)(row))[i]                                \
   : (dtype) == EPX_BFLOAT16 ? epx_bf16_to_f32(((const uint16_t *)(row))[i])            \
                             : epx_f16_to_f32(((const uint16_t *)(row))[i]))
#define START(i) (from_zero ? 0.0f : block[i])
#define TERM(j, i) (w ? w##j * LOAD(dtype, r##j, i) : LOAD(dtype, r##j, i))

static inline void accumulate_rows(epx_dtype_t dtype, const void *const *rows, const float *w,
                                   int32_t n_rows, int from_zero, float *restrict block, int64_t m) {
  const void *r0 = rows[0], *r1 = n_rows > 1 ? rows[1] : r0, *r2 = n_rows > 2 ? rows[2] : r0,
             *r3 = n_rows > 3 ? rows[3] : r0;
  float w0 = w ? w[0] : 1.0f, w1 = w && n_rows > 1 ? w[1] : 1.0f, w2 = w && n_rows > 2 ? w[2] : 1.0f,
        w3 = w && n_rows > 3 ? w[3] : 1.0f;
  switch (n_rows) {
    case 1:
      for (int64_t i = 0; i < m; i++) block[i] = START(i) + TERM(0, i);
      break;
    case 2:
      for (int64_t i = 0; i < m; i++) block[i] = (START(i) + TERM(0, i)) + TERM(1, i);
      break;
    case 3:
      for (int64_t i = 0; i < m; i++) block[i] = ((START(i) + TERM(0, i)) + TERM(1, i)) + TERM(2, i);
      break;
    default:
      for (int64_t i = 0; i < m; i++)
        block[i] = (((START(i) + TERM(0, i)) + TERM(1, i)) + TERM(2, i)) + TERM(3, i);
  }
}

/* One instance per dtype so each inner loop is a straight vector loop; AVX2
 * where the CPU has it (the same per-element operations either way). */
#if defined(__x86_64__) && defined(__GNUC__)
#define EPX_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define EPX_MULTIVERSION
#endif

#define DEFINE_SCALE(name, TYPE, TO_F32, FROM_F32)                                     \
  EPX_MULTIVERSION static void name(const TYPE *s, float w, TYPE *d, int64_t n) {        \
    for (int64_t i = 0; i < n; i++) d[i] = FROM_F32(w * TO_F32(s[i]));                   \
  }
#define IDENTITY(x) (x)
DEFINE_SCALE(scale_f32, float, IDENTITY, IDENTITY)
DEFINE_SCALE(scale_bf16, uint16_t, epx_bf16_to_f32, epx_f32_to_bf16)
DEFINE_SCALE(scale_f16, uint16_t, epx_f16_to_f32, epx_f32_to_f16)

static void row_scale(epx_dtype_t dtype, const void *src, float w, void *dst, int64_t n) {
  switch (dtype) {
    case EPX_BFLOAT16: scale_bf16(src, w, dst, n); break;
    case EPX_FLOAT16: scale_f16(src, w, dst, n); break;
    default: scale_f32(src, w, dst, n); break;
  }
}

void epx_row_scale_stream(epx_dtype_t dtype, const void *src, float w, void *dst, int64_t n) {
  size_t esize = epx_dtype_size(dtype);
  _Alignas(64) float block[BLOCK];
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    int64_t m = n - i0 < BLOCK ? n - i0 : BLOCK;
    row_scale(dtype, (const char *)src + (size_t)i0 * esize, w, block, m);
    epx_row_copy_stream((char *)dst + (size_t)i0 * esize, block, (size_t)m * esize);
  }
}

/* acc = P (first), acc += P, or — with store — store = round(0 + P) in the
 * dtype with streaming stores, block by block (with up to four rows, one
 * pass over them and nothing else written). n_rows >= 1. */
#define DEFINE_ACCUMULATE(name, DTYPE)                                                        \
  EPX_MULTIVERSION static void name(const void *const *rows, const float *w, int32_t n_rows,  \
                                    float *acc, int first, void *store, int64_t n) {          \
    _Alignas(64) float block[BLOCK];                                                          \
    _Alignas(64) uint16_t half[BLOCK];                                                        \
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {                                               \
      int64_t m = n - i0 < BLOCK ? n - i0 : BLOCK;                                            \
      const void *shifted[4];                                                                 \
      for (int32_t j0 = 0; j0 < n_rows; j0 += 4) {                                            \
        int32_t count = n_rows - j0 < 4 ? n_rows - j0 : 4;                                    \
        for (int32_t j = 0; j < count; j++)                                                   \
          shifted[j] = (const char *)rows[j0 + j] + (size_t)i0 * epx_dtype_size(DTYPE);       \
        accumulate_rows(DTYPE, shifted, w ? w + j0 : NULL, count, j0 == 0, block, m);         \
      }                                                                                       \
      if (store) {                                                                            \
        if (DTYPE == EPX_FLOAT32) {                                                           \
          epx_row_copy_stream((float *)store + i0, block, (size_t)m * sizeof(float));         \
        } else {                                                                              \
          for (int64_t i = 0; i < m; i++)                                                     \
            half[i] = DTYPE == EPX_BFLOAT16 ? epx_f32_to_bf16(block[i]) : epx_f32_to_f16(block[i]); \
          epx_row_copy_stream((uint16_t *)store + i0, half, (size_t)m * 2);                   \
        }                                                                                     \
      } else if (first) {                                                                     \
        for (int64_t i = 0; i < m; i++) acc[i0 + i] = block[i];                               \
      } else {                                                                                \
        for (int64_t i = 0; i < m; i++) acc[i0 + i] += block[i];                              \
      }                                                                                       \
    }                                                                                         \
  }

DEFINE_ACCUMULATE(accumulate_f32, EPX_FLOAT32)
DEFINE_ACCUMULATE(accumulate_bf16, EPX_BFLOAT16)
DEFINE_ACCUMULATE(accumulate_f16, EPX_FLOAT16)

void epx_rows_accumulate(epx_dtype_t dtype, const void *const *rows, const float *w, int32_t n_rows,
                         float *acc, int first, int64_t n) {
  switch (dtype) {
    case EPX_FLOAT32: accumulate_f32(rows, w, n_rows, acc, first, NULL, n); break;
    case EPX_BFLOAT16: accumulate_bf16(rows, w, n_rows, acc, first, NULL, n); break;
    case EPX_FLOAT16: accumulate_f16(rows, w, n_rows, acc, first, NULL, n); break;
  }
}

void epx_rows_sum_store(epx_dtype_t dtype, const void *const *rows, const float *w, int32_t n_rows,
                        void *out, int64_t n) {
  switch (dtype) {
    case EPX_FLOAT32: accumulate_f32(rows, w, n_rows, NULL, 1, out, n); break;
    case EPX_BFLOAT16: accumulate_bf16(rows, w, n_rows, NULL, 1, out, n); break;
    case EPX_FLOAT16: accumulate_f16(rows, w, n_rows, NULL, 1, out, n); break;
  }
}

/* Eight interleaved partial sums, added pairwise at the end: vectorisable and
 * the same order on every call and every CPU. */
#define DEFINE_DOT(name, DTYPE)                                                          \
  EPX_MULTIVERSION static float name(const void *a, const void *b, int64_t n) {          \
    float lane[8] = {0};                                                                 \
    int64_t i = 0;                                                                       \
    for (; i + 8 <= n; i += 8)                                                           \
      for (int j = 0; j < 8; j++) lane[j] += LOAD(DTYPE, a, i + j) * LOAD(DTYPE, b, i + j); \
    for (; i < n; i++) lane[i & 7] += LOAD(DTYPE, a, i) * LOAD(DTYPE, b, i);             \
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7])); \
  }

DEFINE_DOT(dot_f32, EPX_FLOAT32)
DEFINE_DOT(dot_bf16, EPX_BFLOAT16)
DEFINE_DOT(dot_f16, EPX_FLOAT16)

float epx_row_dot(epx_dtype_t dtype, const void *a, const void *b, int64_t n) {
  switch (dtype) {
    case EPX_BFLOAT16: return dot_bf16(a, b, n);
    case EPX_FLOAT16: return dot_f16(a, b, n);
    default: return dot_f32(a, b, n);
  }
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
