/* epx_route / epx_route_backward on the GPU against the float64 routing
 * reference (epx_reference_route / epx_reference_route_backward).
 *
 * Every case routes fresh random logits and compares: topk_idx, locations,
 * expert_counts and capacity exactly; topk_w, aux_loss and z_loss within
 * atol 1e-6 + rtol 1e-5; grad_logits within atol 1e-5 * grad_scale() + rtol
 * 1e-4 (see grad_scale). A second GPU run of each call must give the same bits. Device
 * outputs are poisoned (0xA5) before every call. The option cases set the
 * DeepSpeed / Megatron routing options (OPTION_CASES).
 *
 * Exact integer agreement needs selections that float rounding cannot flip:
 * CUDA's expf and the CPU's differ in the last bit and the two sum the
 * softmax in different orders, so scores that differ by an ulp may order
 * differently. Cases with group-limited selection or drop by probability use
 * "separated" logits: per token, random group levels and random ranks inside
 * each group, spaced so that every comparison the routing makes (expert vs
 * expert, group vs group) has a gap far above rounding. "Quantized" logits
 * take a few values only, so exact ties are everywhere (equal logits give
 * equal scores on each device) and the tie-breaking rules are what is
 * tested. The others are plain normal logits.
 *
 * The one-kernel forward's cases also run with programmatic dependent
 * launch turned off (epx_cuda_set_launch_flags). Also: NaN/Inf tokens dropped or
 * refused (outputs untouched, message naming the first bad token), an empty
 * batch, grad_logits aliasing logits, and the time of one routing call of
 * 8192 tokens x 256 experts, top-8.
 *
 * EPX_GPU_TEST_QUICK=1 skips the large cases and the timing (for
 * compute-sanitizer runs). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/launch.h"
#include "gpu_testutil.h"

static const double W_ATOL = 1e-6, W_RTOL = 1e-5;
static const double G_ATOL = 1e-5, G_RTOL = 1e-4; /* G_ATOL is relative to grad_scale() */

/* Whether bytes of device memory still hold the poison. */
static int dev_poisoned(const void *dev, size_t bytes) {
  unsigned char *h = tu_alloc(bytes ? bytes : 1);
  to_host(h, dev, bytes);
  int ok = 1;
  for (size_t i = 0; i < bytes; i++) ok &= h[i] == 0xA5;
  tu_free(h);
  return ok;
}

typedef enum { LOGITS_NORMAL, LOGITS_SEPARATED, LOGITS_QUANTIZED } logits_kind_t;

typedef struct route_case {
  const char *name;
  int64_t T;
  int32_t E, K, G, TG;
  epx_score_fn_t score;
  int renorm;
  float scale;
  int capacity;
  float cf;
  int32_t min_cap;
  epx_queue_order_t order;
  epx_drop_policy_t drop;
  int bias;
  float aux, z; /* loss coefficients; 0: the loss outputs are NULL */
  epx_nonfinite_policy_t nonfinite;
  int n_bad;    /* tokens given a NaN/Inf logit (EPX_NONFINITE_DROP) */
  logits_kind_t kind;
  int grad_w;   /* backward gets grad_topk_w (else NULL) */
  float ga, gz; /* backward's grad_aux_loss, grad_z_loss */
  int fast;     /* no locations (the one-kernel forward when the rest allows it) */
} route_case_t;

static void shuffle(tu_rng_t *rng, int32_t *a, int32_t n) {
  for (int32_t i = 0; i < n; i++) a[i] = i;
  for (int32_t i = n - 1; i > 0; i--) {
    int32_t j = tu_below(rng, i + 1), v = a[i];
    a[i] = a[j];
    a[j] = v;
  }
}

/* logits [T, E]; see the file comment for the kinds. Separated: group g of a
 * token sits at level lv[g] (spacing alpha), expert i of a group at rank
 * rk[i] (spacing delta) with noise below 0.4 delta, and a group's span stays
 * below 0.7 alpha, so experts and groups are strictly ordered with gaps of at
 * least 0.6 delta; the whole row spans 6 (sigmoid keeps its slope). */
static void fill_logits(tu_rng_t *rng, logits_kind_t kind, int64_t T, int32_t E, int32_t G,
                        float *logits) {
  const int32_t groups = G > 1 ? G : 1, gs = E / groups;
  const float alpha = 6.0f / (float)groups, delta = 0.7f * alpha / (float)gs;
  int32_t *lv = tu_alloc(sizeof(int32_t) * (size_t)groups), *rk = tu_alloc(sizeof(int32_t) * (size_t)gs);
  for (int64_t t = 0; t < T; t++) {
    float *row = logits + (size_t)t * E;
    if (kind == LOGITS_NORMAL) {
      for (int32_t e = 0; e < E; e++) row[e] = 2.0f * tu_normal(rng);
    } else if (kind == LOGITS_QUANTIZED) {
      for (int32_t e = 0; e < E; e++) row[e] = (float)tu_below(rng, 8) * 0.25f - 1.0f;
    } else {
      shuffle(rng, lv, groups);
      for (int32_t g = 0; g < groups; g++) {
        shuffle(rng, rk, gs);
        for (int32_t i = 0; i < gs; i++)
          row[g * gs + i] = alpha * (float)lv[g] +
                            delta * ((float)rk[i] + 0.4f * (float)tu_uniform(rng)) - 3.0f;
      }
    }
  }
  tu_free(lv);
  tu_free(rk);
}

/* Bias on a coarse grid, so that p + bias rarely lands near another's. */
static void fill_bias(tu_rng_t *rng, epx_score_fn_t score, int32_t E, float *bias) {
  const float q = score == EPX_SCORE_SIGMOID ? 0.05f : 0.01f;
  for (int32_t e = 0; e < E; e++) bias[e] = q * (float)(tu_below(rng, 5) - 2);
}

/* Token i of n_bad gets one NaN, +Inf or -Inf logit. */
static int64_t bad_token(int64_t T, int n_bad, int i) { return (2 * (int64_t)i + 1) * T / (2 * n_bad); }

static void insert_bad(int64_t T, int32_t E, int n_bad, float *logits) {
  for (int i = 0; i < n_bad; i++) {
    const float v = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
    logits[(size_t)bad_token(T, n_bad, i) * E + (size_t)(i * 7) % (size_t)E] = v;
  }
}

static epx_route_config_t case_config(const route_case_t *c, epx_device_t device, void *stream) {
  epx_route_config_t cfg = EPX_ROUTE_CONFIG_INIT;
  cfg.num_experts = c->E;
  cfg.top_k = c->K;
  cfg.score_fn = c->score;
  cfg.num_groups = c->G;
  cfg.topk_groups = c->TG;
  cfg.renormalize = c->renorm;
  cfg.scaling_factor = c->scale;
  cfg.capacity_mode = c->capacity;
  cfg.capacity_factor = c->cf;
  cfg.min_capacity = c->min_cap;
  cfg.queue_order = c->order;
  cfg.drop_policy = c->drop;
  cfg.aux_loss_coeff = c->aux;
  cfg.z_loss_coeff = c->z;
  cfg.nonfinite = c->nonfinite;
  cfg.device = device;
  cfg.stream = stream;
  return cfg;
}

/* One routing's outputs (host copies, or device arrays). */
typedef struct route_out {
  int32_t *idx, *loc, *counts;
  float *w, *aux, *z;
  int32_t capacity;
  int64_t nonfinite;
} route_out_t;

static route_out_t host_out(int64_t T, int32_t E, int32_t K) {
  route_out_t o;
  const size_t routes = (size_t)T * (size_t)K;
  o.idx = tu_alloc(4 * (routes ? routes : 1));
  o.loc = tu_alloc(4 * (routes ? routes : 1));
  o.w = tu_alloc(4 * (routes ? routes : 1));
  o.counts = tu_alloc(4 * (size_t)E);
  o.aux = tu_alloc(4);
  o.z = tu_alloc(4);
  tu_poison(o.idx, 4 * routes);
  tu_poison(o.loc, 4 * routes);
  tu_poison(o.w, 4 * routes);
  tu_poison(o.counts, 4 * (size_t)E);
  tu_poison(o.aux, 4);
  tu_poison(o.z, 4);
  o.capacity = -7;
  o.nonfinite = -7;
  return o;
}

static route_out_t dev_out(int64_t T, int32_t E, int32_t K) {
  route_out_t o;
  const size_t routes = (size_t)T * (size_t)K;
  o.idx = dev_alloc(4 * routes);
  o.loc = dev_alloc(4 * routes);
  o.w = dev_alloc(4 * routes);
  o.counts = dev_alloc(4 * (size_t)E);
  o.aux = dev_alloc(4);
  o.z = dev_alloc(4);
  o.capacity = -7;
  o.nonfinite = -7;
  return o;
}

static void dev_out_poison(route_out_t *o, int64_t T, int32_t E, int32_t K) {
  const size_t routes = (size_t)T * (size_t)K;
  dev_poison(o->idx, 4 * routes);
  dev_poison(o->loc, 4 * routes);
  dev_poison(o->w, 4 * routes);
  dev_poison(o->counts, 4 * (size_t)E);
  dev_poison(o->aux, 4);
  dev_poison(o->z, 4);
  o->capacity = -7;
  o->nonfinite = -7;
}

static void dev_out_fetch(const route_out_t *d, route_out_t *h, int64_t T, int32_t E, int32_t K) {
  const size_t routes = (size_t)T * (size_t)K;
  to_host(h->idx, d->idx, 4 * routes);
  to_host(h->loc, d->loc, 4 * routes);
  to_host(h->w, d->w, 4 * routes);
  to_host(h->counts, d->counts, 4 * (size_t)E);
  to_host(h->aux, d->aux, 4);
  to_host(h->z, d->z, 4);
  h->capacity = d->capacity;
  h->nonfinite = d->nonfinite;
}

static void out_free(route_out_t *o, int device) {
  void *p[6] = {o->idx, o->loc, o->w, o->counts, o->aux, o->z};
  for (int i = 0; i < 6; i++) {
    if (device)
      CUDA_OK(cudaFree(p[i]));
    else
      tu_free(p[i]);
  }
}

/* epx_route_output_t over o; the loss pointers only when the case has them. */
static epx_route_output_t as_output(const route_case_t *c, route_out_t *o) {
  epx_route_output_t out = {o->idx, o->w, c->fast ? NULL : o->loc, o->counts,
                            c->aux != 0.0f ? o->aux : NULL,
                            c->z != 0.0f ? o->z : NULL, -7, -7};
  return out;
}

static void expect_same_i32(const char *name, const char *what, const int32_t *gpu,
                            const int32_t *cpu, int64_t n, int32_t K) {
  for (int64_t i = 0; i < n; i++)
    if (gpu[i] != cpu[i])
      fail_msg("%s: %s[%lld] (token %lld, slot %lld) is %d on the GPU, %d in the reference", name, what,
               (long long)i, (long long)(i / K), (long long)(i % K), gpu[i], cpu[i]);
}

static void expect_close(const char *name, const char *what, const float *gpu, const float *cpu,
                         int64_t n, double atol, double rtol) {
  const double err = tu_max_error(EPX_FLOAT32, gpu, EPX_FLOAT32, cpu, n, atol, rtol);
  if (!(err <= 1.0)) {
    for (int64_t i = 0; i < n; i++)
      if (!(fabs((double)gpu[i] - cpu[i]) <= atol + rtol * fabs((double)cpu[i])))
        fail_msg("%s: %s[%lld] is %.9g on the GPU, %.9g in the reference (normalised error %.3g)", name,
                 what, (long long)i, (double)gpu[i], (double)cpu[i], err);
  }
}

static void expect_bits(const char *name, const char *what, const void *a, const void *b,
                        size_t bytes) {
  if (bytes && memcmp(a, b, bytes) != 0) fail_msg("%s: %s differs between two GPU runs", name, what);
}

static double max_abs(const float *a, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; i++) m = fabs((double)a[i]) > m ? fabs((double)a[i]) : m;
  return m;
}

/* The magnitude the gradient tolerance's absolute part scales with: the
 * larger of max|reference grad| and the terms that make it up, scale *
 * max|grad_topk_w|. Terms cancel: with K = 1 and renormalisation the weight
 * is 1 whatever the logits, so its gradient g / S - g b / S^2 is 0 exactly,
 * and float32 leaves noise of a few eps32 (6e-8) times g there while the
 * net gradient (the aux loss's alone) is ~1e-8 to 1e-7: "by-probability all
 * weights tie (K=1)" and "top1gating use_rts" gave 1e-7 and 2e-9 against
 * 6e-8 and 5e-9. Float32 arithmetic errs by a few eps32 of the largest term
 * summed, never of the net result; 1e-5 of the largest term is ~100 times
 * that and still far below any real error (a wrong route's whole term). */
static double grad_scale(double gmax, const float *gw, size_t routes, float scaling) {
  const double terms = gw ? fabs((double)scaling) * max_abs(gw, (int64_t)routes) : 0.0;
  return gmax > terms ? gmax : terms;
}

/* The float64 reference's forward into a host route_out_t (weights and
 * losses rounded to float for the comparisons). */
static void reference_route(const epx_route_config_t *cfg, int64_t T, const float *logits,
                            const float *bias, route_out_t *r) {
  const size_t routes = (size_t)T * (size_t)cfg->top_k;
  double *w = tu_alloc(8 * (routes ? routes : 1)), aux = 0, z = 0;
  EXPECT_OK(epx_reference_route(cfg, T, logits, bias, r->idx, w, r->loc, r->counts, &aux, &z,
                                &r->capacity));
  for (size_t i = 0; i < routes; i++) r->w[i] = (float)w[i];
  *r->aux = (float)aux;
  *r->z = (float)z;
  tu_free(w);
}

/* The routing options of a case (host pointers), and the GPU config's copy
 * with its mask and global counts in device memory. */
typedef void (*route_options_fn)(epx_route_config_t *cfg, int64_t T);

static void options_to_device(epx_route_config_t *gpu, int64_t T, void **d_mask, void **d_counts) {
  *d_mask = gpu->token_mask ? dev_copy(gpu->token_mask, (size_t)T) : NULL;
  *d_counts = gpu->aux_loss_expert_counts
                  ? dev_copy(gpu->aux_loss_expert_counts, 4 * (size_t)gpu->num_experts)
                  : NULL;
  gpu->token_mask = *d_mask;
  gpu->aux_loss_expert_counts = *d_counts;
}

/* Forward and backward of one case on the GPU, against the reference. */
static void run_case_with(const route_case_t *c, route_options_fn options, uint64_t seed,
                          cudaStream_t stream) {
  tu_rng_t rng = {seed};
  const int64_t T = c->T;
  const int32_t E = c->E, K = c->K;
  const size_t routes = (size_t)T * (size_t)K, cells = (size_t)T * (size_t)E;
  float *logits = tu_alloc(4 * (cells ? cells : 1));
  float *bias = c->bias ? tu_alloc(4 * (size_t)E) : NULL;
  fill_logits(&rng, c->kind, T, E, c->G, logits);
  if (bias) fill_bias(&rng, c->score, E, bias);
  insert_bad(T, E, c->n_bad, logits);

  /* The float64 reference; the CPU fast path for the count of dropped
   * non-finite tokens (the GPU does not report it). */
  epx_route_config_t cpu_cfg = case_config(c, EPX_DEVICE_CPU, NULL);
  if (options) options(&cpu_cfg, T);
  route_out_t ref = host_out(T, E, K), cpu = host_out(T, E, K);
  epx_route_output_t ref_out = as_output(c, &cpu);
  EXPECT_OK(epx_route(&cpu_cfg, T, logits, bias, &ref_out));
  reference_route(&cpu_cfg, T, logits, bias, &ref);
  ref_out.capacity = ref.capacity;

  /* GPU, twice. */
  epx_route_config_t gpu_cfg = cpu_cfg;
  void *d_mask, *d_counts;
  gpu_cfg.device = EPX_DEVICE_CUDA;
  gpu_cfg.stream = stream;
  options_to_device(&gpu_cfg, T, &d_mask, &d_counts);
  float *d_logits = dev_copy(logits, 4 * cells);
  float *d_bias = bias ? dev_copy(bias, 4 * (size_t)E) : NULL;
  route_out_t dev = dev_out(T, E, K);
  route_out_t got[2];
  for (int run = 0; run < 2; run++) {
    got[run] = host_out(T, E, K);
    dev_out_poison(&dev, T, E, K);
    epx_route_output_t out = as_output(c, &dev);
    EXPECT_OK(epx_route(&gpu_cfg, T, d_logits, d_bias, &out));
    CUDA_OK(cudaStreamSynchronize(stream));
    dev.capacity = out.capacity;
    dev.nonfinite = out.nonfinite_tokens;
    dev_out_fetch(&dev, &got[run], T, E, K);
  }

  const route_out_t *g = &got[0];
  expect_same_i32(c->name, "topk_idx", g->idx, ref.idx, (int64_t)routes, K);
  if (!c->fast) expect_same_i32(c->name, "locations", g->loc, ref.loc, (int64_t)routes, K);
  expect_same_i32(c->name, "expert_counts", g->counts, ref.counts, E, 1);
  if (g->capacity != ref_out.capacity)
    fail_msg("%s: capacity %d on the GPU, %d in the reference", c->name, g->capacity, ref_out.capacity);
  if (g->nonfinite != -1) fail_msg("%s: nonfinite_tokens is %lld on the GPU, expected -1", c->name, (long long)g->nonfinite);
  if (ref_out.nonfinite_tokens != c->n_bad)
    fail_msg("%s: the CPU dropped %lld non-finite tokens, expected %d", c->name,
             (long long)ref_out.nonfinite_tokens, c->n_bad);
  expect_close(c->name, "topk_w", g->w, ref.w, (int64_t)routes, W_ATOL, W_RTOL);
  if (c->aux != 0.0f) expect_close(c->name, "aux_loss", g->aux, ref.aux, 1, W_ATOL, W_RTOL);
  if (c->z != 0.0f) expect_close(c->name, "z_loss", g->z, ref.z, 1, W_ATOL, W_RTOL);
  expect_bits(c->name, "topk_idx", got[0].idx, got[1].idx, 4 * routes);
  expect_bits(c->name, "topk_w", got[0].w, got[1].w, 4 * routes);
  if (!c->fast) expect_bits(c->name, "locations", got[0].loc, got[1].loc, 4 * routes);
  expect_bits(c->name, "expert_counts", got[0].counts, got[1].counts, 4 * (size_t)E);
  expect_bits(c->name, "aux_loss", got[0].aux, got[1].aux, c->aux != 0.0f ? 4 : 0);
  expect_bits(c->name, "z_loss", got[0].z, got[1].z, c->z != 0.0f ? 4 : 0);
  int64_t dropped = 0;
  for (size_t i = 0; i < routes; i++) dropped += ref.idx[i] < 0;

  /* Backward: the same routing, gradients from the weights and both losses. */
  float *gw = c->grad_w ? tu_alloc(4 * (routes ? routes : 1)) : NULL;
  if (gw)
    for (size_t i = 0; i < routes; i++) gw[i] = tu_normal(&rng);
  float *ref_grad = tu_alloc(4 * (cells ? cells : 1));
  double *ref_grad64 = tu_alloc(8 * (cells ? cells : 1));
  EXPECT_OK(epx_reference_route_backward(&cpu_cfg, T, logits, bias, ref.idx, gw, c->ga, c->gz,
                                         ref_grad64));
  for (size_t i = 0; i < cells; i++) ref_grad[i] = (float)ref_grad64[i];
  tu_free(ref_grad64);
  float *d_gw = gw ? dev_copy(gw, 4 * routes) : NULL;
  float *d_grad = dev_alloc(4 * cells);
  float *grad[2];
  for (int run = 0; run < 2; run++) {
    grad[run] = tu_alloc(4 * (cells ? cells : 1));
    dev_poison(d_grad, 4 * cells);
    EXPECT_OK(epx_route_backward(&gpu_cfg, T, d_logits, d_bias, dev.idx, d_gw, c->ga, c->gz, d_grad));
    CUDA_OK(cudaStreamSynchronize(stream));
    to_host(grad[run], d_grad, 4 * cells);
  }
  const double gmax = max_abs(ref_grad, (int64_t)cells);
  if (gw && c->n_bad < T && !(gmax > 0.0))
    fail_msg("%s: the reference's grad_logits is all zero", c->name);
  expect_close(c->name, "grad_logits", grad[0], ref_grad, (int64_t)cells,
               G_ATOL * grad_scale(gmax, gw, routes, c->scale) + 1e-30, G_RTOL);
  expect_bits(c->name, "grad_logits", grad[0], grad[1], 4 * cells);
  print_message("%-34s T=%-5lld E=%-4d K=%-2d ok (%lld of %zu routes dropped, max|grad| %.3g)\n",
                c->name, (long long)T, E, K, (long long)dropped, routes, gmax);

  for (int run = 0; run < 2; run++) {
    out_free(&got[run], 0);
    tu_free(grad[run]);
  }
  out_free(&ref, 0);
  out_free(&cpu, 0);
  out_free(&dev, 1);
  if (d_mask) CUDA_OK(cudaFree(d_mask));
  if (d_counts) CUDA_OK(cudaFree(d_counts));
  CUDA_OK(cudaFree(d_logits));
  CUDA_OK(cudaFree(d_grad));
  if (d_bias) CUDA_OK(cudaFree(d_bias));
  if (d_gw) CUDA_OK(cudaFree(d_gw));
  tu_free(logits);
  tu_free(bias);
  tu_free(gw);
  tu_free(ref_grad);
}

/* name, T, E, K, G, TG, score, renorm, scale, capacity, cf, min_cap, order, drop, bias, aux,
 * z, nonfinite, n_bad, kind, grad_w, ga, gz */
static const route_case_t CASES[] = {
    {"softmax dropless by-choice", 1000, 64, 4, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f, 0,
     EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_NORMAL, 1, 0.7f, 1.3f, 0},
    {"softmax no-renorm bias by-token", 777, 48, 3, 0, 0, EPX_SCORE_SOFTMAX, 0, 1.5f, 0, 1.0f, 0,
     EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 1, 0.02f, 0.0f, EPX_NONFINITE_DROP, 3,
     LOGITS_NORMAL, 1, 1.1f, 0.0f, 0},
    {"sigmoid groups bias (DeepSeek-V3)", 256, 256, 8, 8, 4, EPX_SCORE_SIGMOID, 1, 2.5f, 0, 1.0f,
     0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.001f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_SEPARATED, 1, 0.9f, 0.4f, 0},
    {"capacity by-position by-choice", 2000, 32, 2, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 1.0f, 4,
     EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.0f, EPX_NONFINITE_ERROR, 0,
     LOGITS_NORMAL, 1, 1.0f, 0.0f, 0},
    {"capacity by-position by-token drop", 1500, 16, 4, 0, 0, EPX_SCORE_SIGMOID, 1, 1.0f, 1, 0.9f,
     0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_DROP, 5,
     LOGITS_SEPARATED, 1, 0.6f, 0.8f, 0},
    {"capacity by-probability by-choice", 1024, 32, 4, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 0.8f,
     0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_PROBABILITY, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0},
    {"capacity by-probability by-token groups", 1024, 64, 6, 8, 3, EPX_SCORE_SOFTMAX, 0, 1.0f, 1,
     0.7f, 0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_PROBABILITY, 0, 0.0f, 0.0f, EPX_NONFINITE_DROP, 4,
     LOGITS_SEPARATED, 1, 0.0f, 0.0f, 0},
    {"by-probability all weights tie (K=1)", 900, 16, 1, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1,
     0.6f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_PROBABILITY, 0, 0.01f, 0.0f, EPX_NONFINITE_ERROR,
     0, LOGITS_NORMAL, 1, 0.5f, 0.0f, 0},
    {"min_capacity dominates", 300, 8, 2, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 0.1f, 50,
     EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.0f, 0.01f, EPX_NONFINITE_ERROR, 0,
     LOGITS_NORMAL, 1, 0.0f, 0.5f, 0},
    {"quantized ties groups", 600, 64, 6, 8, 3, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f, 0,
     EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_QUANTIZED, 1, 1.0f, 1.0f, 0},
    {"quantized ties capacity by-position", 600, 24, 3, 0, 0, EPX_SCORE_SIGMOID, 1, 1.0f, 1, 1.0f,
     0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.01f, 0.0f, EPX_NONFINITE_ERROR, 0,
     LOGITS_QUANTIZED, 1, 1.0f, 0.0f, 0},
    {"groups of one expert", 400, 16, 4, 16, 8, EPX_SCORE_SIGMOID, 1, 1.0f, 0, 1.0f, 0,
     EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0},
    {"more than 32 groups", 256, 512, 8, 64, 8, EPX_SCORE_SIGMOID, 1, 1.0f, 0, 1.0f, 0,
     EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.0f, EPX_NONFINITE_ERROR, 0,
     LOGITS_SEPARATED, 1, 1.0f, 0.0f, 0},
    {"E not a multiple of 32, groups, bias", 333, 40, 6, 5, 2, EPX_SCORE_SOFTMAX, 1, 1.0f, 0,
     1.0f, 0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 1, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0},
    {"E = 2000 (shared memory per token)", 300, 2000, 5, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 0,
     1.0f, 0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_NORMAL, 1, 1.0f, 1.0f, 0},
    {"E = 8000 (opted-in shared memory)", 64, 8000, 4, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 1.0f,
     0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_NORMAL, 1, 1.0f, 1.0f, 0},
    {"K = 40 > 32, capacity by-position", 256, 96, 40, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 1.0f,
     0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0},
    {"K = E", 200, 8, 8, 0, 0, EPX_SCORE_SIGMOID, 1, 1.0f, 0, 1.0f, 0, EPX_QUEUE_BY_CHOICE,
     EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0, LOGITS_NORMAL, 1, 1.0f,
     1.0f, 0},
    {"every token non-finite", 6, 8, 2, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 1.0f, 0,
     EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_DROP, 6,
     LOGITS_NORMAL, 1, 1.0f, 1.0f, 0},
    {"losses only in backward", 500, 32, 2, 0, 0, EPX_SCORE_SIGMOID, 0, 1.0f, 0, 1.0f, 0,
     EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.01f, EPX_NONFINITE_DROP, 2,
     LOGITS_NORMAL, 0, 1.0f, 1.0f, 0},
    {"8192 x 256 top-8 groups 8/4", 8192, 256, 8, 8, 4, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f, 0,
     EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.001f, 0.001f, EPX_NONFINITE_ERROR, 0,
     LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0},
};

static void test_cases(void **state) {
  (void)state;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t n = sizeof CASES / sizeof CASES[0];
  for (size_t i = 0; i < n; i++)
    if (!quick() || CASES[i].T * CASES[i].E <= (int64_t)1 << 20)
      run_case_with(&CASES[i], NULL, 0x5eed0000u + i, i % 2 ? stream : NULL);
  CUDA_OK(cudaStreamDestroy(stream));
}

/* ------------------------------------------------------------------------ */
/* The DeepSpeed / Megatron options (tests/test_route_peers.c has each one   */
/* worked by hand on the CPU)                                                */
/* ------------------------------------------------------------------------ */

static uint8_t option_mask[8192];
static float option_counts[512];

/* DeepSpeed top2gating: renormalise after the drop, first choices in f_e. */
static void opt_top2gating(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->renormalize_after_drop = 1;
  c->aux_counts = EPX_AUX_COUNTS_FIRST_CHOICE;
}
/* DeepSpeed topkgating drop_policy="probs": raw gates rank, renormalise after. */
static void opt_topkgating(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->drop_policy = EPX_DROP_BY_SCORE;
  c->renormalize_after_drop = 1;
}
/* DeepSpeed top1gating use_rts. */
static void opt_random_tokens(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->drop_policy = EPX_DROP_BY_RANDOM_PRIORITY;
  c->random_seed = 0x1234abcdull;
}
/* Megatron: softmax after top-k, group score of top_k / topk_groups, aux
 * counts from a plain top-k, capacity in Python floats. */
static void opt_megatron_groups(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->score_fn = EPX_SCORE_SOFTMAX_AFTER_TOPK;
  c->renormalize = 0;
  c->group_score_experts = c->top_k / c->topk_groups;
  c->aux_counts = EPX_AUX_COUNTS_PLAIN_TOPK;
  c->capacity_arithmetic = EPX_CAPACITY_FLOAT64;
  c->capacity_factor_f64 = c->capacity_factor;
}
static void opt_sqrt_softplus(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->score_fn = EPX_SCORE_SQRT_SOFTPLUS;
}
/* Megatron seq_aux_loss over 8 sequences. */
static void opt_sequences(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->aux_loss_sequences = 8;
  c->aux_counts = EPX_AUX_COUNTS_PLAIN_TOPK;
}
/* Megatron global_aux_loss with given global counts. */
static void opt_global(epx_route_config_t *c, int64_t T) {
  for (int32_t e = 0; e < c->num_experts; e++) option_counts[e] = (float)((e * 37) % 23 + 1);
  c->aux_loss_expert_counts = option_counts;
  c->aux_loss_tokens = 4.0 * (double)T;
}
/* Every fifth token padding (none of the case's non-finite tokens, which
 * are at t % 5 == 2, so the CPU's count of dropped ones stays n_bad). */
static void opt_mask(epx_route_config_t *c, int64_t T) {
  for (int64_t t = 0; t < T; t++) option_mask[t] = (uint8_t)(t % 5 != 4);
  c->token_mask = option_mask;
  c->renormalize_after_drop = c->renormalize;
}
/* DeepSpeed drop_tokens=False: dropless, renormalised after the (empty) drop. */
static void opt_dropless_renormalized(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->renormalize_after_drop = 1;
}
/* DeepSpeed topkgating's factor, a Python float: T=30, E=4, K=3, 1.2 gives
 * C = 27 (the float32 field alone 28). */
static void opt_factor_double(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->capacity_factor_f64 = 1.2;
  c->renormalize_after_drop = 1;
}

typedef struct option_case {
  route_case_t c;
  route_options_fn options;
} option_case_t;

static const option_case_t OPTION_CASES[] = {
    {{"DeepSpeed top2gating", 1000, 16, 2, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 1.0f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
      LOGITS_NORMAL, 1, 0.7f, 1.3f, 0}, opt_top2gating},
    {{"DeepSpeed topkgating probs", 1024, 32, 4, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 0.8f, 0,
      EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.01f, 0.0f, EPX_NONFINITE_ERROR, 0,
      LOGITS_SEPARATED, 1, 0.5f, 0.0f, 0}, opt_topkgating},
    {{"DeepSpeed top1gating use_rts", 2048, 16, 1, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 0.5f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.0f, EPX_NONFINITE_DROP, 3,
      LOGITS_NORMAL, 1, 1.0f, 0.0f, 0}, opt_random_tokens},
    {{"Megatron groups softmax after top-k", 512, 64, 6, 8, 2, EPX_SCORE_SOFTMAX, 1, 2.0f, 1,
      0.9f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_PROBABILITY, 1, 0.01f, 0.001f,
      EPX_NONFINITE_ERROR, 0, LOGITS_SEPARATED, 1, 0.8f, 0.6f, 0}, opt_megatron_groups},
    {{"Megatron sqrt-softplus bias", 700, 64, 4, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.01f, 0.001f, EPX_NONFINITE_ERROR, 0,
      LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0}, opt_sqrt_softplus},
    {{"Megatron seq_aux_loss", 1024, 32, 2, 0, 0, EPX_SCORE_SIGMOID, 1, 1.0f, 0, 1.0f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.0f, EPX_NONFINITE_ERROR, 0,
      LOGITS_NORMAL, 1, 1.0f, 0.0f, 0}, opt_sequences},
    {{"Megatron global_aux_loss", 600, 32, 4, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.0f, EPX_NONFINITE_ERROR, 0,
      LOGITS_NORMAL, 1, 1.0f, 0.0f, 0}, opt_global},
    {{"padding mask, capacity, renormalised after", 900, 16, 2, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f,
      1, 1.0f, 0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f, EPX_NONFINITE_DROP,
      4, LOGITS_NORMAL, 1, 1.0f, 1.0f, 0}, opt_mask},
    {{"DeepSpeed drop_tokens=False renormalised", 16, 4, 2, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 0,
      1.0f, 0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_ERROR, 0,
      LOGITS_NORMAL, 1, 0.0f, 0.0f, 0}, opt_dropless_renormalized},
    {{"DeepSpeed topkgating factor 1.2 K=3", 30, 4, 3, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 1.2f,
      0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_ERROR, 0,
      LOGITS_NORMAL, 1, 0.0f, 0.0f, 0}, opt_factor_double},
};

static void test_option_cases(void **state) {
  (void)state;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t n = sizeof OPTION_CASES / sizeof OPTION_CASES[0];
  for (size_t i = 0; i < n; i++)
    run_case_with(&OPTION_CASES[i].c, OPTION_CASES[i].options, 0x0971000u + i,
                  i % 2 ? stream : NULL);
  CUDA_OK(cudaStreamDestroy(stream));
}

/* ------------------------------------------------------------------------ */
/* The one-kernel forward (src/cuda/route/fast.cu): dropless, no locations,  */
/* no losses, non-finite tokens dropped; E = 32 V, groups of whole lanes     */
/* ------------------------------------------------------------------------ */

/* Every seventh token padding. */
static void opt_mask_only(epx_route_config_t *c, int64_t T) {
  for (int64_t t = 0; t < T; t++) option_mask[t] = (uint8_t)(t % 7 != 3);
  c->token_mask = option_mask;
}

static void opt_group_score_one(epx_route_config_t *c, int64_t T) {
  (void)T;
  c->group_score_experts = 1;
}

static const option_case_t FAST_CASES[] = {
    {{"fast: DeepSeek-V3 sigmoid groups 8/4 bias", 4096, 256, 8, 8, 4, EPX_SCORE_SIGMOID, 1, 2.5f,
      0, 1.0f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.0f, 0.0f, EPX_NONFINITE_DROP, 3,
      LOGITS_SEPARATED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: softmax E=64 quantized ties", 900, 64, 6, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f,
      0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_DROP, 2,
      LOGITS_QUANTIZED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: quantized ties groups 8/3", 600, 64, 6, 8, 3, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_DROP, 0,
      LOGITS_QUANTIZED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: sigmoid quantized ties groups 8/4", 700, 256, 8, 8, 4, EPX_SCORE_SIGMOID, 1, 1.0f, 0,
      1.0f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_DROP, 0,
      LOGITS_QUANTIZED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: softmax after top-k groups 8/2", 800, 128, 4, 8, 2, EPX_SCORE_SOFTMAX_AFTER_TOPK, 0,
      1.0f, 0, 1.0f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.0f, 0.0f,
      EPX_NONFINITE_DROP, 2, LOGITS_SEPARATED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: sqrt-softplus E=32 bias", 500, 32, 4, 0, 0, EPX_SCORE_SQRT_SOFTPLUS, 1, 1.0f, 0,
      1.0f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.0f, 0.0f, EPX_NONFINITE_DROP, 1,
      LOGITS_SEPARATED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: sigmoid E=512 groups 16/4 no renorm", 300, 512, 8, 16, 4, EPX_SCORE_SIGMOID, 0, 1.5f,
      0, 1.0f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.0f, 0.0f, EPX_NONFINITE_DROP, 0,
      LOGITS_SEPARATED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: groups of one expert (E=32, 32/8)", 400, 32, 4, 32, 8, EPX_SCORE_SIGMOID, 1, 1.0f, 0,
      1.0f, 0, EPX_QUEUE_BY_TOKEN, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_DROP, 0,
      LOGITS_SEPARATED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: group score of 1, K=32", 300, 128, 32, 4, 2, EPX_SCORE_SIGMOID, 1, 1.0f, 0, 1.0f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_DROP, 0,
      LOGITS_SEPARATED, 1, 0.0f, 0.0f, 1}, opt_group_score_one},
    /* A lane holds 16 experts on 8 logit levels: it wins many rounds on tied
     * keys, so its top-2 cache runs out and rescans (route_fast's
     * fast_lane_top2 past the entries it gave out). */
    {{"fast: sigmoid E=512 K=32 quantized ties bias", 400, 512, 32, 0, 0, EPX_SCORE_SIGMOID, 1,
      1.0f, 0, 1.0f, 0, EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.0f, 0.0f,
      EPX_NONFINITE_DROP, 1, LOGITS_QUANTIZED, 1, 0.0f, 0.0f, 1}, NULL},
    {{"fast: padding mask, K=1", 1000, 128, 1, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 0, 1.0f, 0,
      EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.0f, 0.0f, EPX_NONFINITE_DROP, 2,
      LOGITS_NORMAL, 1, 0.0f, 0.0f, 1}, opt_mask_only},
};

static void test_fast_cases(void **state) {
  (void)state;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t n = sizeof FAST_CASES / sizeof FAST_CASES[0];
  for (size_t i = 0; i < n; i++)
    if (!quick() || FAST_CASES[i].c.T * FAST_CASES[i].c.E <= (int64_t)1 << 20)
      run_case_with(&FAST_CASES[i].c, FAST_CASES[i].options, 0xfa57000u + i, i % 2 ? stream : NULL);
  CUDA_OK(cudaStreamDestroy(stream));
}

/* The one-kernel cases again with the kernel launched plainly rather than
 * by programmatic dependent launch (src/cuda/common/pdl.cuh): the same results. */
static void test_fast_cases_without_pdl(void **state) {
  (void)state;
  epx_cuda_set_launch_flags(0);
  const size_t n = sizeof FAST_CASES / sizeof FAST_CASES[0];
  for (size_t i = 0; i < n; i++)
    if (FAST_CASES[i].c.T * FAST_CASES[i].c.E <= (int64_t)1 << 20)
      run_case_with(&FAST_CASES[i].c, FAST_CASES[i].options, 0xfa58000u + i, NULL);
  epx_cuda_set_launch_flags(EPX_CUDA_LAUNCH_DEFAULT);
}

/* A NaN/Inf logit under EPX_NONFINITE_ERROR: refused, naming the first bad
 * token, with every output (device arrays and host fields) untouched. */
static void test_nonfinite_error(void **state) {
  (void)state;
  const int64_t T = 64;
  const int32_t E = 32, K = 4;
  for (int mode = 0; mode < 3; mode++) {
    route_case_t c = {"nonfinite error", T, E, K, 4, 2, EPX_SCORE_SOFTMAX, 1, 1.0f, mode > 0,
                      0.5f, 0, EPX_QUEUE_BY_CHOICE,
                      mode == 2 ? EPX_DROP_BY_PROBABILITY : EPX_DROP_BY_POSITION, 0, 0.01f,
                      0.001f, EPX_NONFINITE_ERROR, 0, LOGITS_NORMAL, 1, 1.0f, 1.0f, 0};
    tu_rng_t rng = {0xbad0u + (uint64_t)mode};
    float *logits = tu_alloc(4 * (size_t)(T * E));
    fill_logits(&rng, LOGITS_NORMAL, T, E, 0, logits);
    logits[20 * E + 3] = INFINITY;
    logits[7 * E + 30] = NAN;
    float *d_logits = dev_copy(logits, 4 * (size_t)(T * E));
    epx_route_config_t cfg = case_config(&c, EPX_DEVICE_CUDA, NULL);
    route_out_t dev = dev_out(T, E, K);
    dev_out_poison(&dev, T, E, K);
    epx_route_output_t out = as_output(&c, &dev);
    EXPECT_STATUS(epx_route(&cfg, T, d_logits, NULL, &out), EPX_ERROR_INVALID_ARGUMENT, "token 7 ");
    CUDA_OK(cudaDeviceSynchronize());
    if (out.capacity != -7 || out.nonfinite_tokens != -7)
      fail_msg("mode %d: a refused epx_route changed output->capacity or nonfinite_tokens", mode);
    const size_t routes = (size_t)(T * K);
    if (!dev_poisoned(dev.idx, 4 * routes) || !dev_poisoned(dev.w, 4 * routes) ||
        !dev_poisoned(dev.loc, 4 * routes) || !dev_poisoned(dev.counts, 4 * (size_t)E) ||
        !dev_poisoned(dev.aux, 4) || !dev_poisoned(dev.z, 4))
      fail_msg("mode %d: a refused epx_route wrote its outputs", mode);

    /* Backward: with and without loss gradients (the check pass differs). */
    int32_t *idx = tu_alloc(4 * routes);
    for (size_t i = 0; i < routes; i++) idx[i] = (int32_t)(i % (size_t)K);
    int32_t *d_idx = dev_copy(idx, 4 * routes);
    float *d_grad = dev_alloc(4 * (size_t)(T * E));
    for (int losses = 0; losses < 2; losses++) {
      dev_poison(d_grad, 4 * (size_t)(T * E));
      EXPECT_STATUS(epx_route_backward(&cfg, T, d_logits, NULL, d_idx, NULL, losses ? 1.0f : 0.0f,
                                 losses ? 1.0f : 0.0f, d_grad),
              EPX_ERROR_INVALID_ARGUMENT, "token 7 ");
      if (!dev_poisoned(d_grad, 4 * (size_t)(T * E)))
        fail_msg("mode %d: a refused epx_route_backward wrote grad_logits", mode);
    }
    out_free(&dev, 1);
    CUDA_OK(cudaFree(d_logits));
    CUDA_OK(cudaFree(d_idx));
    CUDA_OK(cudaFree(d_grad));
    tu_free(logits);
    tu_free(idx);
  }
}

/* T = 0: counts and losses zero, capacity min_capacity, routes untouched. */
static void test_empty(void **state) {
  (void)state;
  const int32_t E = 16, K = 2;
  route_case_t c = {"empty", 0, E, K, 0, 0, EPX_SCORE_SOFTMAX, 1, 1.0f, 1, 1.0f, 3,
                    EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f,
                    EPX_NONFINITE_ERROR, 0, LOGITS_NORMAL, 1, 1.0f, 1.0f, 0};
  epx_route_config_t cfg = case_config(&c, EPX_DEVICE_CUDA, NULL);
  route_out_t dev = dev_out(1, E, K);
  dev_out_poison(&dev, 1, E, K);
  epx_route_output_t out = as_output(&c, &dev);
  EXPECT_OK(epx_route(&cfg, 0, NULL, NULL, &out));
  CUDA_OK(cudaDeviceSynchronize());
  if (out.capacity != 3 || out.nonfinite_tokens != -1)
    fail_msg("empty batch: capacity %d (expected 3), nonfinite_tokens %lld (expected -1)",
             out.capacity, (long long)out.nonfinite_tokens);
  int32_t counts[16];
  float aux = 1.0f, z = 1.0f;
  to_host(counts, dev.counts, sizeof counts);
  to_host(&aux, dev.aux, 4);
  to_host(&z, dev.z, 4);
  for (int32_t e = 0; e < E; e++)
    if (counts[e] != 0) fail_msg("empty batch: expert_counts[%d] is %d", e, counts[e]);
  if (aux != 0.0f || z != 0.0f) fail_msg("empty batch: losses %g, %g", (double)aux, (double)z);
  if (!dev_poisoned(dev.idx, 4 * (size_t)K) || !dev_poisoned(dev.w, 4 * (size_t)K) ||
      !dev_poisoned(dev.loc, 4 * (size_t)K))
    fail_msg("empty batch: routes were written");
  c.capacity = 0;
  cfg = case_config(&c, EPX_DEVICE_CUDA, NULL);
  EXPECT_OK(epx_route(&cfg, 0, NULL, NULL, &out));
  if (out.capacity != 0) fail_msg("empty dropless batch: capacity %d", out.capacity);
  EXPECT_OK(epx_route_backward(&cfg, 0, NULL, NULL, dev.idx, NULL, 1.0f, 1.0f, dev.w));
  CUDA_OK(cudaDeviceSynchronize());
  out_free(&dev, 1);
}

/* grad_logits may be the logits array itself (as on the CPU). */
static void test_backward_in_place(void **state) {
  (void)state;
  const int64_t T = 300;
  const int32_t E = 64, K = 6;
  route_case_t c = {"in place", T, E, K, 8, 4, EPX_SCORE_SIGMOID, 1, 2.0f, 0, 1.0f, 0,
                    EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 0, 0.01f, 0.001f,
                    EPX_NONFINITE_ERROR, 0, LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0};
  tu_rng_t rng = {0x1a9e};
  const size_t cells = (size_t)(T * E), routes = (size_t)(T * K);
  float *logits = tu_alloc(4 * cells), *gw = tu_alloc(4 * routes), *ref = tu_alloc(4 * cells);
  float *got = tu_alloc(4 * cells);
  fill_logits(&rng, LOGITS_SEPARATED, T, E, c.G, logits);
  for (size_t i = 0; i < routes; i++) gw[i] = tu_normal(&rng);
  epx_route_config_t cpu_cfg = case_config(&c, EPX_DEVICE_CPU, NULL);
  route_out_t h = host_out(T, E, K);
  epx_route_output_t out = as_output(&c, &h);
  EXPECT_OK(epx_route(&cpu_cfg, T, logits, NULL, &out));
  EXPECT_OK(epx_route_backward(&cpu_cfg, T, logits, NULL, h.idx, gw, 0.5f, 0.5f, ref));
  epx_route_config_t cfg = case_config(&c, EPX_DEVICE_CUDA, NULL);
  float *d_logits = dev_copy(logits, 4 * cells), *d_gw = dev_copy(gw, 4 * routes);
  int32_t *d_idx = dev_copy(h.idx, 4 * routes);
  EXPECT_OK(epx_route_backward(&cfg, T, d_logits, NULL, d_idx, d_gw, 0.5f, 0.5f, d_logits));
  to_host(got, d_logits, 4 * cells);
  expect_close("in place", "grad_logits", got, ref, (int64_t)cells,
               G_ATOL * grad_scale(max_abs(ref, (int64_t)cells), gw, routes, c.scale) + 1e-30,
               G_RTOL);
  out_free(&h, 0);
  CUDA_OK(cudaFree(d_logits));
  CUDA_OK(cudaFree(d_gw));
  CUDA_OK(cudaFree(d_idx));
  tu_free(logits);
  tu_free(gw);
  tu_free(ref);
  tu_free(got);
}

/* Time of one routing call (forward, every output and both losses) of the
 * DeepSeek-like shape, CUDA events over 200 calls; printed, not judged. */
static void test_time(void **state) {
  (void)state;
  if (quick()) skip();
  const int64_t T = 8192;
  const int32_t E = 256, K = 8;
  route_case_t c = {"time", T, E, K, 8, 4, EPX_SCORE_SIGMOID, 1, 2.5f, 0, 1.0f, 0,
                    EPX_QUEUE_BY_CHOICE, EPX_DROP_BY_POSITION, 1, 0.001f, 0.001f,
                    EPX_NONFINITE_DROP, 0, LOGITS_SEPARATED, 1, 1.0f, 1.0f, 0};
  tu_rng_t rng = {0x7173};
  float *logits = tu_alloc(4 * (size_t)(T * E)), *bias = tu_alloc(4 * (size_t)E);
  fill_logits(&rng, LOGITS_SEPARATED, T, E, c.G, logits);
  fill_bias(&rng, c.score, E, bias);
  float *d_logits = dev_copy(logits, 4 * (size_t)(T * E)), *d_bias = dev_copy(bias, 4 * (size_t)E);
  route_out_t dev = dev_out(T, E, K);
  cudaStream_t stream;
  cudaEvent_t start, stop;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (int variant = 0; variant < 3; variant++) {
    c.nonfinite = variant == 1 ? EPX_NONFINITE_ERROR : EPX_NONFINITE_DROP;
    c.capacity = variant == 2;
    c.cf = 1.25f;
    epx_route_config_t cfg = case_config(&c, EPX_DEVICE_CUDA, stream);
    epx_route_output_t out = as_output(&c, &dev);
    const int reps = 200;
    for (int i = 0; i < 10; i++) EXPECT_OK(epx_route(&cfg, T, d_logits, d_bias, &out));
    CUDA_OK(cudaEventRecord(start, stream));
    for (int i = 0; i < reps; i++) EXPECT_OK(epx_route(&cfg, T, d_logits, d_bias, &out));
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    const char *what[3] = {"dropless, nonfinite DROP", "dropless, nonfinite ERROR (host sync)",
                           "capacity 1.25 by position, DROP"};
    print_message("route 8192 x 256 top-8 (sigmoid, groups 8/4, bias, losses), %s: %.1f us/call\n",
                  what[variant], 1000.0 * ms / reps);
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  CUDA_OK(cudaStreamDestroy(stream));
  out_free(&dev, 1);
  CUDA_OK(cudaFree(d_logits));
  CUDA_OK(cudaFree(d_bias));
  tu_free(logits);
  tu_free(bias);
}

static int have_gpu(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

int main(void) {
  if (!have_gpu()) {
    fprintf(stderr, "test_gpu_route: no CUDA device; run it on a GPU machine (ctest -L gpu)\n");
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cases),
      cmocka_unit_test(test_option_cases),
      cmocka_unit_test(test_fast_cases),
      cmocka_unit_test(test_fast_cases_without_pdl),
      cmocka_unit_test(test_nonfinite_error),
      cmocka_unit_test(test_empty),
      cmocka_unit_test(test_backward_in_place),
      cmocka_unit_test(test_time),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
