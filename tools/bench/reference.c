/* What epx-bench checks against: the routing inputs, the library's float64
 * route reference, the comparisons and their `check` lines, and the dense
 * reference of a whole layer. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* ------------------------------------------------------------------------ */
/* Routing inputs and the reference route                                    */
/* ------------------------------------------------------------------------ */

/* logits[t, e] = bias[e] + Gumbel noise. With bias[e] = -S * log(1 + rank of e
 * in a fixed random order), the top-1 choice is drawn from softmax(bias), so
 * expert popularity follows Zipf(S) (Gumbel-max), and top-k is sampling
 * without replacement with the same weights. S = 0 is uniform routing. */
void make_logits(const options_t *o, int32_t rank, int64_t T, float *logits) {
  int32_t E = o->experts;
  float *bias = xalloc(sizeof(float) * (size_t)E);
  int32_t *perm = xalloc(sizeof(int32_t) * (size_t)E);
  rng_t pr = rng_make(o->seed, 0x5eed);
  for (int32_t e = 0; e < E; e++) perm[e] = e;
  for (int32_t e = E - 1; e > 0; e--) {
    int32_t j = (int32_t)(rng_next(&pr) % (uint64_t)(e + 1));
    int32_t tmp = perm[e];
    perm[e] = perm[j];
    perm[j] = tmp;
  }
  for (int32_t i = 0; i < E; i++) bias[perm[i]] = (float)(-o->zipf * log(1.0 + i));
  rng_t r = rng_make(o->seed, 16 * (uint64_t)rank + 3);
  for (int64_t t = 0; t < T; t++)
    for (int32_t e = 0; e < E; e++)
      logits[t * E + e] = bias[e] + (float)(-log(-log(rng_open01(&r))));
  free(bias);
  free(perm);
}

epx_route_config_t route_config(const options_t *o, int32_t capacity_mode) {
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  rc.num_experts = o->experts;
  rc.top_k = o->topk;
  rc.score_fn = EPX_SCORE_SOFTMAX;
  rc.renormalize = 0;
  rc.capacity_mode = capacity_mode;
  rc.capacity_factor = (float)o->capacity_factor;
  return rc;
}

/* The route the bench expects from epx_route with route_config(): the
 * library's float64 reference (epx_reference_route), weights rounded to
 * float; *capacity gets its C. */
void ref_route(const options_t *o, int32_t capacity_mode, int64_t T, const float *logits,
                      int32_t *idx, float *w, int32_t *capacity) {
  const epx_route_config_t rc = route_config(o, capacity_mode);
  double *w64 = xalloc(sizeof(double) * (size_t)(T * o->topk + 1));
  TRY(epx_reference_route(&rc, T, logits, NULL, idx, w64, NULL, NULL, NULL, NULL, capacity));
  for (int64_t i = 0; i < T * o->topk; i++) w[i] = (float)w64[i];
  free(w64);
}

/* d loss / d logits from d loss / d w (grad_w [T, K]) by the library's
 * float64 reference (epx_reference_route_backward), rounded to float. */
void ref_route_backward(const options_t *o, int32_t capacity_mode, int64_t T,
                               const float *logits, const int32_t *idx, const float *grad_w,
                               float *grad_logits) {
  const epx_route_config_t rc = route_config(o, capacity_mode);
  const int64_t n = T * o->experts;
  double *g64 = xalloc(sizeof(double) * (size_t)(n + 1));
  TRY(epx_reference_route_backward(&rc, T, logits, NULL, idx, grad_w, 0.0, 0.0, g64));
  for (int64_t i = 0; i < n; i++) grad_logits[i] = (float)g64[i];
  free(g64);
}

/* ------------------------------------------------------------------------ */
/* Comparisons                                                               */
/* ------------------------------------------------------------------------ */

/* Tolerances per payload dtype. f32 differs from the reference only by the
 * order of float32 sums; bf16/f16 round expert outputs and gradients once
 * more on the exchange path than in the reference. */
tolerance_t tolerance_of(epx_dtype_t d) {
  if (d == EPX_BFLOAT16) return (tolerance_t){2e-2, 2e-2};
  if (d == EPX_FLOAT16) return (tolerance_t){4e-3, 4e-3};
  return (tolerance_t){1e-4, 1e-4};
}

compare_result_t compare_f32(const float *got, const float *ref, int64_t n, tolerance_t tol) {
  compare_result_t c = {n, 0, 0.0, 0.0};
  for (int64_t i = 0; i < n; i++) c.max_ref = fmax(c.max_ref, fabs((double)ref[i]));
  double atol = tol.atol_frac * (c.max_ref > 0.0 ? c.max_ref : 1.0);
  for (int64_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - (double)ref[i]);
    if (!(err <= atol + tol.rtol * fabs((double)ref[i]))) c.bad++;
    if (!(err <= c.max_err)) c.max_err = err;
  }
  return c;
}

/* got in dtype, ref in float32. */
compare_result_t compare_payload(epx_dtype_t dtype, const void *got, const float *ref, int64_t n,
                                        tolerance_t tol) {
  float *g = xalloc(sizeof(float) * (size_t)n);
  TRY(epx_convert(EPX_FLOAT32, g, dtype, got, n));
  compare_result_t c = compare_f32(g, ref, n, tol);
  free(g);
  return c;
}

/* Sums a comparison over ranks and prints it on rank 0; returns its verdict. */
int report_compare(const world_t *w, const char *what, compare_result_t c, tolerance_t tol) {
  int64_t v[2] = {c.count, c.bad};
  double m[2] = {c.max_err, c.max_ref};
  world_sum_i64(w, v, 2);
  world_max_f64(w, m, 2);
  if (w->rank == 0)
    printf("check %-34s max|err| %.3g (max|ref| %.3g, tol %.0e*max|ref| + %.0e*|ref|): %lld of %lld outside: %s\n",
           what, m[0], m[1], tol.atol_frac, tol.rtol, (long long)v[1], (long long)v[0],
           v[1] ? "FAILED" : "ok");
  return v[1] == 0;
}

int report_count(const world_t *w, const char *what, int64_t bad, int64_t count) {
  int64_t v[2] = {count, bad};
  world_sum_i64(w, v, 2);
  if (w->rank == 0)
    printf("check %-34s %lld of %lld differ: %s\n", what, (long long)v[1], (long long)v[0],
           v[1] ? "FAILED" : "ok");
  return v[1] == 0;
}

int64_t count_diff_bytes(const void *a, const void *b, int64_t n, size_t es) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad += memcmp((const char *)a + (size_t)i * es, (const char *)b + (size_t)i * es, es) != 0;
  return bad;
}

/* ------------------------------------------------------------------------ */
/* The dense reference of a whole layer for one rank's tokens                */
/* ------------------------------------------------------------------------ */

/* out[t] = sum_k w_k * FFN_{idx_k}(x[t]) and the gradients of a loss whose
 * gradient with respect to out is grad_out: grad_x, grad_w (the router's
 * signal), grad_logits. Straight from the definition, expert by expert over
 * this rank's own tokens; no exchange involved. */
void layer_reference(const experts_t *ex, epx_dtype_t dtype, int64_t T, int32_t K, const int32_t *idx,
                            const float *w, const options_t *o, const float *logits, const void *x,
                            const void *grad_out,
                            layer_ref_t *ref) {
  const int64_t H = ex->H, F = ex->F;
  const int32_t E = ex->E;
  float *xf = xalloc(sizeof(float) * (size_t)(T * H)), *gf = xalloc(sizeof(float) * (size_t)(T * H));
  TRY(epx_convert(EPX_FLOAT32, xf, dtype, x, T * H));
  TRY(epx_convert(EPX_FLOAT32, gf, dtype, grad_out, T * H));
  memset(ref->out, 0, sizeof(float) * (size_t)(T * H));
  memset(ref->grad_x, 0, sizeof(float) * (size_t)(T * H));
  for (int64_t i = 0; i < T * K; i++) ref->grad_w[i] = 0.0f;
  int64_t *count = calloc((size_t)E, sizeof(int64_t)), max_m = 0;
  if (!count) fatal("out of memory");
  for (int64_t i = 0; i < T * K; i++)
    if (idx[i] >= 0) count[idx[i]]++;
  for (int32_t e = 0; e < E; e++) max_m = count[e] > max_m ? count[e] : max_m;
  size_t m1 = (size_t)max_m + 1;
  int64_t *slot = xalloc(sizeof(int64_t) * m1);
  float *X = xalloc(sizeof(float) * m1 * (size_t)H), *Y = xalloc(sizeof(float) * m1 * (size_t)H);
  float *G = xalloc(sizeof(float) * (m1 * (size_t)F + 1)), *U = xalloc(sizeof(float) * (m1 * (size_t)F + 1));
  float *A = xalloc(sizeof(float) * (m1 * (size_t)F + 1));
  for (int32_t e = 0; e < E; e++) {
    int64_t m = 0;
    for (int64_t i = 0; i < T * K; i++)
      if (idx[i] == e) slot[m++] = i;
    if (m == 0) continue;
    for (int64_t j = 0; j < m; j++) memcpy(X + j * H, xf + slot[j] / K * H, sizeof(float) * (size_t)H);
    ffn_forward(ex, e, m, X, G, U, A, Y);
    for (int64_t j = 0; j < m; j++) {
      int64_t t = slot[j] / K;
      float wk = w[slot[j]], *o = ref->out + t * H, *dy = Y + j * H;
      const float *g = gf + t * H;
      double dot = 0.0;
      for (int64_t i = 0; i < H; i++) {
        o[i] += wk * dy[i];
        dot += (double)g[i] * dy[i];
        dy[i] = wk * g[i];
      }
      ref->grad_w[slot[j]] = (float)dot;
    }
    ffn_backward(ex, e, m, X, G, U, A, Y, X, NULL);
    for (int64_t j = 0; j < m; j++) {
      float *gx = ref->grad_x + slot[j] / K * H;
      const float *dx = X + j * H;
      for (int64_t i = 0; i < H; i++) gx[i] += dx[i];
    }
  }
  ref_route_backward(o, o->capacity_factor > 0.0, T, logits, idx, ref->grad_w, ref->grad_logits);
  free(count);
  free(slot);
  free(X);
  free(Y);
  free(G);
  free(U);
  free(A);
  free(xf);
  free(gf);
}
