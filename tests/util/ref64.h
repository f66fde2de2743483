/* Float64 references for the tests: the dense one-hot dispatch and combine in
 * double, dense positions for dropless routings, payload <-> double
 * conversion, and a gradient comparison. Header-only; every function is
 * static inline so a test uses what it needs.
 *
 * Dense positions: a routing's route (t, k) sits at (e, c) = (topk_idx[t,k],
 * locations[t,k]) of a dense [E, C, H] tensor. A dropless routing gets
 * locations from r64_queue_locations (the route's rank among the routes of
 * its expert, tokens ascending), so C = T always fits and the expert-major
 * layout's row of (e, c) is offsets[e] + c. */
#ifndef EPX_TESTS_REF64_H
#define EPX_TESTS_REF64_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "epx.h"

/* n payload elements of dtype -> double. */
static inline void r64_from_payload(epx_dtype_t dtype, const void *src, double *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = epx_load(dtype, src, i);
}

/* locations [T, K]: rank of each valid route among its expert's routes in
 * token order (-1 for -1 routes); counts [E] gets the routes per expert. */
static inline void r64_queue_locations(int64_t T, int32_t E, int32_t K, const int32_t *topk_idx,
                                       int32_t *locations, int64_t *counts) {
  for (int32_t e = 0; e < E; e++) counts[e] = 0;
  for (int64_t i = 0; i < T * K; i++)
    locations[i] = topk_idx[i] < 0 ? -1 : (int32_t)counts[topk_idx[i]]++;
}

/* Expert-major offsets [E + 1] from unpadded counts [E]: each group padded up
 * to a multiple of alignment. */
static inline void r64_expert_offsets(int32_t E, const int64_t *counts, int32_t alignment,
                                      int64_t *offsets) {
  offsets[0] = 0;
  for (int32_t e = 0; e < E; e++)
    offsets[e + 1] = offsets[e] + (counts[e] + alignment - 1) / alignment * alignment;
}

/* Dense dispatch in double: out [E, C, H] = sum_t mask[t,e,c] * x[t]; mask is
 * w[t,k] when weighted, else 1. */
static inline void r64_dense_dispatch(int64_t T, int64_t H, int32_t E, int32_t C, int32_t K,
                                      const int32_t *topk_idx, const double *topk_w,
                                      const int32_t *locations, int weighted, const double *x,
                                      double *out) {
  memset(out, 0, sizeof(double) * (size_t)E * (size_t)C * (size_t)H);
  for (int64_t t = 0; t < T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = topk_idx[t * K + k];
      if (e < 0) continue;
      double m = weighted ? topk_w[t * K + k] : 1.0;
      double *row = out + ((size_t)e * C + (size_t)locations[t * K + k]) * (size_t)H;
      for (int64_t h = 0; h < H; h++) row[h] += m * x[t * H + h];
    }
}

/* Dense combine in double: out [T, H] = sum_{e,c} mask[t,e,c] * y[e,c]. */
static inline void r64_dense_combine(int64_t T, int64_t H, int32_t E, int32_t C, int32_t K,
                                     const int32_t *topk_idx, const double *topk_w,
                                     const int32_t *locations, int weighted, const double *y,
                                     double *out) {
  (void)E;
  memset(out, 0, sizeof(double) * (size_t)T * (size_t)H);
  for (int64_t t = 0; t < T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = topk_idx[t * K + k];
      if (e < 0) continue;
      double m = weighted ? topk_w[t * K + k] : 1.0;
      const double *row = y + ((size_t)e * C + (size_t)locations[t * K + k]) * (size_t)H;
      for (int64_t h = 0; h < H; h++) out[t * H + h] += m * row[h];
    }
}

static inline double r64_dot(const double *a, const double *b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

/* Largest |got - want| / (atol + rtol * |want|) over n values; <= 1 passes.
 * NaN counts as infinitely wrong. */
static inline double r64_max_error(const float *got, const double *want, int64_t n, double atol,
                                   double rtol, int64_t *worst_index) {
  double worst = 0.0;
  if (worst_index) *worst_index = -1;
  for (int64_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - want[i]) / (atol + rtol * fabs(want[i]));
    if (isnan(err)) err = INFINITY;
    if (err > worst) {
      worst = err;
      if (worst_index) *worst_index = i;
    }
  }
  return worst;
}

#endif
