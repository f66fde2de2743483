/* Products of shape arguments, checked. A caller's huge hidden,
 * max_tokens_per_rank or capacity must be refused by name, not wrap into a
 * small (or negative) byte count that a later allocation or loop trusts. */
#ifndef EPX_CORE_CHECKED_H
#define EPX_CORE_CHECKED_H

#include <stdint.h>

#include "core/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when a * b does not fit an int64_t; *product is set only when it fits. */
static inline int epx_mul_overflows(int64_t a, int64_t b, int64_t *product) {
  int64_t p;
  if (__builtin_mul_overflow(a, b, &p)) return 1;
  *product = p;
  return 0;
}

/* 1 when a + b does not fit an int64_t; *sum is set only when it fits. */
static inline int epx_add_overflows(int64_t a, int64_t b, int64_t *sum) {
  int64_t s;
  if (__builtin_add_overflow(a, b, &s)) return 1;
  *sum = s;
  return 0;
}

/* *product = factors[0] * ... * factors[count - 1] (non-negative factors),
 * or EPX_ERROR_INVALID_ARGUMENT naming `argument` ("fn: argument makes
 * `what` overflow 64 bits ..."), *product untouched. */
static inline epx_status_t epx_checked_product(const char *fn, const char *argument, const char *what,
                                               const int64_t *factors, int count, int64_t *product) {
  int64_t p = 1;
  for (int i = 0; i < count; i++) {
    if (epx_mul_overflows(p, factors[i], &p))
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: %s is too large: %s does not fit in 64 bits; pass a smaller %s", fn,
                       argument, what, argument);
  }
  *product = p;
  return EPX_SUCCESS;
}

/* EPX_CHECKED_PRODUCT(&bytes, fn, "config.hidden", "hidden * dtype size", a, b, ...):
 * the factors are converted to int64_t before they are multiplied. */
#define EPX_CHECKED_PRODUCT(product, fn, argument, what, ...)                                 \
  epx_checked_product((fn), (argument), (what), (const int64_t[]){__VA_ARGS__},              \
                      (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (product))

#ifdef __cplusplus
}
#endif

#endif
