/* Helpers shared by the tests: a deterministic random generator, filling,
 * poisoning, tolerant comparison, and running W ranks as threads over the
 * local transport; with check.h, the assertion family every test uses. */
#ifndef EPX_TESTUTIL_H
#define EPX_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "check.h"
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

/* Short names of a case's settings, for failure messages. */
const char *tu_dtype_name(epx_dtype_t dtype);
const char *tu_layout_name(epx_layout_t layout);
const char *tu_weighting_name(epx_weighting_t weighting);

void *tu_alloc(size_t bytes); /* 64-byte aligned, zeroed; fails the test on OOM */
void tu_free(void *p);

/* A cmocka group's comm of one rank (epx_comm_create_self), in
 * tu_self_comm between tu_self_setup and tu_self_teardown (the group's
 * setup and teardown). */
extern epx_comm_t tu_self_comm;
int tu_self_setup(void **state);
int tu_self_teardown(void **state);

/* Runs fn(rank, world, arg) on `world` threads, each with a local comm of its
 * rank (timeout in seconds, <= 0: default). Returns the number of ranks whose
 * fn returned nonzero. fn must not call cmocka asserts (they are not
 * thread-safe): it checks with check.h's RANK_ family and returns its count. */
typedef int (*tu_rank_fn)(epx_comm_t comm, int32_t rank, int32_t world, void *arg);
int tu_run_ranks(int32_t world, double timeout_seconds, tu_rank_fn fn, void *arg);

#endif
