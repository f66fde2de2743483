/* Helpers shared by the tests: a deterministic random generator, filling,
 * poisoning, tolerant comparison, and running W ranks as threads over the
 * local transport. */
#ifndef EPX_TESTUTIL_H
#define EPX_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "epx.h"

/* splitmix64 */
typedef struct { uint64_t state; } tu_rng_t;
uint64_t tu_next(tu_rng_t *rng);
double tu_uniform(tu_rng_t *rng);          /* [0, 1) */
float tu_normal(tu_rng_t *rng);            /* N(0, 1) */
int32_t tu_below(tu_rng_t *rng, int32_t n); /* [0, n) */

/* n random values in [-1, 1) in dtype. */
void tu_fill(tu_rng_t *rng, epx_dtype_t dtype, void *data, int64_t n);
/* Fills bytes with 0xA5 so unwritten outputs stand out. */
void tu_poison(void *data, size_t bytes);
/* Random routing: each token picks K distinct experts uniformly (or Zipf
 * skewed with exponent > 0), weights random positive, summing to 1. */
void tu_random_routing(tu_rng_t *rng, int64_t T, int32_t E, int32_t K, double zipf,
                       int32_t *topk_idx, float *topk_w);

/* Max normalised error |a-b| / (atol + rtol*|b|) over n elements of two
 * arrays of the given dtypes; <= 1 passes. */
double tu_max_error(epx_dtype_t dtype_a, const void *a, epx_dtype_t dtype_b, const void *b,
                    int64_t n, double atol, double rtol);
/* Tolerances for results rounded to dtype once from float32 sums. */
double tu_atol(epx_dtype_t dtype);
double tu_rtol(epx_dtype_t dtype);

void *tu_alloc(size_t bytes); /* 64-byte aligned, zeroed; fails the test on OOM */
void tu_free(void *p);

/* Runs fn(rank, world, arg) on `world` threads, each with a local comm of its
 * rank (timeout in seconds, <= 0: default). Returns the number of ranks whose
 * fn returned nonzero. fn must not call cmocka asserts (they are not
 * thread-safe): return nonzero and print instead. */
typedef int (*tu_rank_fn)(epx_comm_t comm, int32_t rank, int32_t world, void *arg);
int tu_run_ranks(int32_t world, double timeout_seconds, tu_rank_fn fn, void *arg);

/* The assertion family every test uses. On the test's main thread (cmocka):
 *   TU_OK(call)                        the call succeeded;
 *   TU_ASSERT_STATUS(call, st, needle) it returned st and epx_last_error()
 *                                      contains needle (NULL: any message).
 * On a rank's thread (tu_run_ranks, MPI ranks), where cmocka's asserts are not
 * thread-safe, failures are printed with the rank and line and counted in the
 * caller's `failures` (with `rank` in scope):
 *   RANK_EXPECT(cond, fmt, ...)        the condition holds;
 *   RANK_STATUS(call, st, needle)      as TU_ASSERT_STATUS;
 *   RANK_OK(call)                      the call succeeded;
 *   RANK_REQUIRE(cond, fmt, ...)       as RANK_EXPECT, then `goto done` on failure;
 *   RANK_REQUIRE_OK(call)              as RANK_OK, then `goto done` on failure
 *                                      (for calls the rest of the run needs). */

/* 1 if the last error message contains needle (NULL: any message). A function,
 * so a literal NULL needle never reaches strstr (gcc's -Wnonnull). */
int tu_message_has(const char *needle);

#define TU_ASSERT_STATUS(expr, expected, needle)                                 \
  do {                                                                           \
    epx_status_t tu_status_ = (expr);                                            \
    if (tu_status_ != (expected))                                                \
      fail_msg("%s returned %s, expected %s: %s", #expr,                         \
               epx_status_string(tu_status_), epx_status_string(expected),      \
               epx_last_error());                                                \
    const char *tu_needle_ = (needle);                                           \
    if (!tu_message_has(tu_needle_))                                             \
      fail_msg("%s: message \"%s\" lacks \"%s\"", #expr, epx_last_error(),     \
               tu_needle_);                                                      \
  } while (0)

#define TU_OK(expr)                                                              \
  do {                                                                           \
    epx_status_t tu_status_ = (expr);                                            \
    if (tu_status_ != EPX_SUCCESS)                                               \
      fail_msg("%s returned %s: %s", #expr, epx_status_string(tu_status_),       \
               epx_last_error());                                                \
  } while (0)

#define RANK_EXPECT(cond, ...)                                 \
  do {                                                         \
    if (!(cond)) {                                             \
      fprintf(stderr, "rank %d, line %d: ", rank, __LINE__);   \
      fprintf(stderr, __VA_ARGS__);                            \
      fprintf(stderr, "\n");                                   \
      failures++;                                              \
    }                                                          \
  } while (0)

/* status == want and the message has `needle` (NULL: any). */
#define RANK_STATUS(expr, want, needle)                                                          \
  do {                                                                                           \
    epx_status_t rs_ = (expr);                                                                   \
    const char *rs_needle_ = (needle);                                                           \
    RANK_EXPECT(rs_ == (want) && tu_message_has(rs_needle_),                                     \
                "%s returned %s (want %s): \"%s\" (want \"%s\")", #expr, epx_status_string(rs_), \
                epx_status_string(want), epx_last_error(), rs_needle_ ? rs_needle_ : "");        \
  } while (0)

#define RANK_OK(expr) RANK_STATUS(expr, EPX_SUCCESS, (const char *)NULL)

#define RANK_REQUIRE(cond, ...)                                \
  do {                                                         \
    long long rank_before_ = failures;                               \
    RANK_EXPECT(cond, __VA_ARGS__);                            \
    if (failures != rank_before_) goto done;                   \
  } while (0)

#define RANK_REQUIRE_OK(expr)                                  \
  do {                                                         \
    long long rank_before_ = failures;                               \
    RANK_OK(expr);                                             \
    if (failures != rank_before_) goto done;                   \
  } while (0)

#endif
