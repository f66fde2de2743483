/* fp8 payloads on the CPU backend.
 *
 * The e4m3 conversion against a brute-force nearest-value search over the
 * 253 finite e4m3 values (round to nearest even, saturating at +-448), the
 * scale encodings on values worked by hand, and the fp8 dispatches (every
 * format x layout x exchange, self and local transports, the hierarchical
 * exchange on threads posed as 2 x 2 and 2 x 4 nodes; tests/mpi_fp8.c runs
 * the same scenes over MPI) against two oracles: every received row
 * and its scales are bit for bit the source token's (found through
 * epx_handle_recv_source; padding zero), and dequantizing what arrived
 * equals epx_dispatch of the dequantized rows (bit for bit, the whole recv
 * tensor). Quantize-on-dispatch, with NaN and infinities among the inputs,
 * must give the bytes of epx_quantize then epx_dispatch_fp8; a cached
 * dispatch repeats them; combine and dispatch_backward run on the fp8
 * buffer in its dtype. The bits against the peers' PyTorch formulas are in
 * tests/python/test_fp8.py. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fp8.h"
#include "testutil.h"
#include "buffer_config.h"

/* ------------------------------------------------------------------------ */
/* Scenes: one dispatch over W ranks, every rank's inputs known to all       */
/* ------------------------------------------------------------------------ */

#define FP8_MAX_W 8

typedef struct {
  epx_fp8_format_t format;
  epx_layout_t layout;
  epx_exchange_t exchange;
  epx_dtype_t dtype;
  int64_t T, H;
  int32_t E, K, W;
  int quantize;  /* epx_dispatch_quantize instead of epx_dispatch_fp8 */
  int nonfinite; /* NaN and infinities among the inputs */
  uint64_t seed;
  /* Built from the seed, per rank: */
  void *x[FP8_MAX_W];        /* [T, H] dtype */
  uint8_t *x_q[FP8_MAX_W];   /* [T, H] */
  void *x_s[FP8_MAX_W];      /* [T, scale bytes] */
  int32_t *idx[FP8_MAX_W];   /* [T, K] */
  float *w[FP8_MAX_W];
  int32_t *loc[FP8_MAX_W];   /* capacity locations */
  int64_t scale_bytes;       /* a row's */
} fp8_scene_t;

static const char *format_name(epx_fp8_format_t f) {
  return f == EPX_FP8_E4M3_F32_128 ? "e4m3/f32x128" : f == EPX_FP8_E4M3_UE8M0_128 ? "e4m3/ue8m0x128" : "mxfp8";
}

static void fp8_describe(const fp8_scene_t *s, char *text, size_t size) {
  snprintf(text, size, "%s %s %s %s W=%d T=%lld H=%lld E=%d K=%d%s%s", format_name(s->format),
           s->layout == EPX_LAYOUT_EXPERT_MAJOR ? "expert-major" : s->layout == EPX_LAYOUT_RANK_MAJOR ? "rank-major" : "capacity",
           s->exchange == EPX_EXCHANGE_DEDUP ? "dedup" : s->exchange == EPX_EXCHANGE_COLLECTIVE ? "collective" : "hierarchical", s->dtype == EPX_BFLOAT16 ? "bf16" : "f32", s->W,
           (long long)s->T, (long long)s->H, s->E, s->K, s->quantize ? " quantize" : "", s->nonfinite ? " nan/inf" : "");
}

/* Rows of mixed magnitudes (so blocks have small and large amax, and some
 * values land on e4m3 subnormals), with NaN / +-Inf sprinkled in. */
static void scene_rows(tu_rng_t *rng, fp8_scene_t *s, void *x) {
  int64_t n = s->T * s->H;
  float *f = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) {
    float scale = (i / 32) % 5 == 0 ? 1e-3f : (i / 32) % 7 == 0 ? 300.0f : 1.0f;
    f[i] = tu_normal(rng) * scale;
    if (s->nonfinite && tu_below(rng, 97) == 0) f[i] = tu_below(rng, 3) == 0 ? NAN : tu_below(rng, 2) ? INFINITY : -INFINITY;
  }
  epx_convert(s->dtype, x, EPX_FLOAT32, f, n);
  free(f);
}

/* Routing: K distinct experts per token, ~10% of the routes dropped;
 * capacity locations are each expert's running count (C = T). */
static void scene_routing(tu_rng_t *rng, fp8_scene_t *s, int32_t r) {
  int64_t n = s->T * s->K;
  s->idx[r] = tu_alloc(sizeof(int32_t) * (size_t)(n + 1));
  s->w[r] = tu_alloc(sizeof(float) * (size_t)(n + 1));
  s->loc[r] = tu_alloc(sizeof(int32_t) * (size_t)(n + 1));
  tu_random_routing(rng, s->T, s->E, s->K, 0.0, s->idx[r], s->w[r]);
  for (int64_t i = 0; i < n; i++)
    if (tu_uniform(rng) < 0.1) s->idx[r][i] = -1;
  int32_t *count = tu_alloc(sizeof(int32_t) * (size_t)s->E);
  for (int64_t i = 0; i < n; i++) s->loc[r][i] = s->idx[r][i] < 0 ? -1 : count[s->idx[r][i]]++;
  tu_free(count);
}

/* Builds every rank's inputs (the same on every process); 0 on success. */
static int fp8_scene_build(fp8_scene_t *s) {
  s->scale_bytes = epx_fp8_scale_row_bytes(s->format, s->H);
  for (int32_t r = 0; r < s->W; r++) {
    tu_rng_t rng = {s->seed * 131 + (uint64_t)r};
    s->x[r] = tu_alloc((size_t)(s->T * s->H + 8) * epx_dtype_size(s->dtype));
    s->x_q[r] = tu_alloc((size_t)(s->T * s->H + 16));
    s->x_s[r] = tu_alloc((size_t)(s->T * s->scale_bytes + 16));
    scene_rows(&rng, s, s->x[r]);
    if (epx_quantize(s->format, s->dtype, s->T, s->H, s->x[r], s->x_q[r], s->x_s[r]) != EPX_SUCCESS) {
      fprintf(stderr, "epx_quantize: %s\n", epx_last_error());
      return 1;
    }
    scene_routing(&rng, s, r);
  }
  return 0;
}

static void fp8_scene_free(fp8_scene_t *s) {
  for (int32_t r = 0; r < s->W; r++) {
    tu_free(s->x[r]), tu_free(s->x_q[r]), tu_free(s->x_s[r]);
    tu_free(s->idx[r]), tu_free(s->w[r]), tu_free(s->loc[r]);
  }
}

/* Every received row and its scales are the source token's bytes; padding
 * and empty slots are zero. */
static int check_sources(const fp8_scene_t *s, int32_t rank, epx_handle_t h, int64_t N, const uint8_t *q,
                         const uint8_t *scales) {
  int failures = 0;
  int32_t *src_rank = tu_alloc(sizeof(int32_t) * (size_t)(N + 1)), *src_token = tu_alloc(sizeof(int32_t) * (size_t)(N + 1));
  RANK_OK(epx_handle_recv_source(h, src_rank, src_token));
  for (int64_t i = 0; i < N && failures < 5; i++) {
    const uint8_t *row = q + i * s->H, *sc = scales + i * s->scale_bytes;
    if (src_rank[i] < 0) {
      int zero = 1;
      for (int64_t j = 0; j < s->H; j++) zero &= row[j] == 0;
      for (int64_t j = 0; j < s->scale_bytes; j++) zero &= sc[j] == 0;
      RANK_EXPECT(zero, "padding row %lld is not zero", (long long)i);
      continue;
    }
    int32_t r = src_rank[i];
    int64_t t = src_token[i];
    RANK_EXPECT(!memcmp(row, s->x_q[r] + t * s->H, (size_t)s->H), "row %lld: not rank %d token %lld's e4m3 bytes",
                (long long)i, r, (long long)t);
    RANK_EXPECT(!memcmp(sc, (const uint8_t *)s->x_s[r] + t * s->scale_bytes, (size_t)s->scale_bytes),
                "row %lld: not rank %d token %lld's scales", (long long)i, r, (long long)t);
  }
  tu_free(src_rank);
  tu_free(src_token);
  return failures;
}

/* dequantize(recv) == epx_dispatch(dequantize(x)) over the whole recv
 * tensor, padding included; then combine and dispatch_backward in the
 * buffer's dtype on the same handle. */
static int check_dequantized(const fp8_scene_t *s, int32_t rank, epx_buffer_t b, epx_handle_t h, int64_t N,
                             const uint8_t *q, const uint8_t *scales) {
  int failures = 0;
  size_t es = epx_dtype_size(s->dtype), rows_bytes = (size_t)((N + 1) * s->H) * es;
  void *x_dq = tu_alloc((size_t)((s->T + 1) * s->H) * es), *want = tu_alloc(rows_bytes), *got = tu_alloc(rows_bytes);
  void *out = tu_alloc((size_t)((s->T + 1) * s->H) * es);
  RANK_OK(epx_dequantize(s->format, s->dtype, s->T, s->H, s->x_q[rank], s->x_s[rank], x_dq));
  RANK_OK(epx_dispatch(b, h, x_dq, want, N));
  RANK_OK(epx_dequantize(s->format, s->dtype, N, s->H, q, scales, got));
  RANK_EXPECT(!memcmp(want, got, (size_t)(N * s->H) * es), "dequantized recv rows differ from epx_dispatch of the "
              "dequantized rows");
  RANK_OK(epx_combine(b, h, got, out));
  RANK_OK(epx_dispatch_backward(b, h, got, out, NULL, NULL));
  tu_free(x_dq), tu_free(want), tu_free(got), tu_free(out);
  return failures;
}

/* The scene's buffer on `device` (test_gpu_fp8 compares the two). */
static epx_status_t scene_buffer(const fp8_scene_t *s, epx_device_t device, epx_comm_t comm, epx_buffer_t *b) {
  epx_buffer_config_t c = tu_config(device, s->dtype, s->H, s->E, s->K, s->T);
  c.exchange = s->exchange;
  c.layout = s->layout;
  c.expert_alignment = s->layout == EPX_LAYOUT_EXPERT_MAJOR ? 4 : 1;
  c.capacity = s->layout == EPX_LAYOUT_CAPACITY ? (int32_t)s->T : 0;
  c.fp8_format = s->format;
  return epx_buffer_create(comm, &c, b);
}

/* One rank of a scene; returns its failed checks. */
static int fp8_scene_rank(epx_comm_t comm, int32_t rank, const fp8_scene_t *s) {
  int failures = 0;
  epx_buffer_t b = NULL;
  epx_handle_t h = NULL;
  uint8_t *q = NULL, *scales = NULL, *q2 = NULL, *scales2 = NULL;
  int64_t N = 0;
  RANK_REQUIRE_OK(scene_buffer(s, EPX_DEVICE_CPU, comm, &b));
  epx_weighting_t weighting = s->layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE;
  epx_routing_t routing = {s->T, s->K, s->idx[rank], s->w[rank], s->layout == EPX_LAYOUT_CAPACITY ? s->loc[rank] : NULL,
                           weighting};
  RANK_REQUIRE_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  RANK_REQUIRE_OK(epx_handle_recv_rows(h, &N));
  size_t q_bytes = (size_t)((N + 1) * s->H), s_bytes = (size_t)((N + 1) * s->scale_bytes);
  q = tu_alloc(q_bytes), scales = tu_alloc(s_bytes), q2 = tu_alloc(q_bytes), scales2 = tu_alloc(s_bytes);
  tu_poison(q, q_bytes), tu_poison(scales, s_bytes);
  if (s->quantize) RANK_REQUIRE_OK(epx_dispatch_quantize(b, h, s->x[rank], q, scales, N));
  else RANK_REQUIRE_OK(epx_dispatch_fp8(b, h, s->x_q[rank], s->x_s[rank], q, scales, N));
  failures += check_sources(s, rank, h, N, q, scales);
  /* Cached dispatch: the same bytes again. */
  RANK_OK(epx_dispatch_fp8(b, h, s->x_q[rank], s->x_s[rank], q2, scales2, N));
  RANK_EXPECT(!memcmp(q, q2, (size_t)(N * s->H)) && !memcmp(scales, scales2, (size_t)(N * s->scale_bytes)),
              "a cached dispatch moved other bytes");
  failures += check_dequantized(s, rank, b, h, N, q, scales);
done:
  tu_free(q), tu_free(scales), tu_free(q2), tu_free(scales2);
  if (h) RANK_OK(epx_handle_release(h));
  if (b) RANK_OK(epx_buffer_destroy(b));
  return failures;
}

/* The scenes: every format x layout x exchange x dispatch kind at small
 * shapes, then the odd ones (hidden 7168, top-k 22 of 512, top-1, a rank
 * count that does not divide 2, rows ending mid-step). */
static int fp8_scenes(fp8_scene_t *out, int32_t W) {
  int n = 0;
  const epx_fp8_format_t formats[] = {EPX_FP8_E4M3_F32_128, EPX_FP8_E4M3_UE8M0_128, EPX_FP8_MXFP8};
  const epx_layout_t layouts[] = {EPX_LAYOUT_EXPERT_MAJOR, EPX_LAYOUT_RANK_MAJOR, EPX_LAYOUT_CAPACITY};
  for (int f = 0; f < 3; f++)
    for (int l = 0; l < 3; l++)
      for (int x = 0; x < 2; x++)
        for (int qz = 0; qz < 2; qz++)
          out[n++] = (fp8_scene_t){.format = formats[f], .layout = layouts[l], .exchange = (epx_exchange_t)x,
                                   .dtype = (f + l + qz) % 2 ? EPX_BFLOAT16 : EPX_FLOAT32, .T = 13, .H = 1024,
                                   .E = 4 * W, .K = 3, .W = W, .quantize = qz, .nonfinite = qz, .seed = (uint64_t)n + 1};
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_UE8M0_128, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_BFLOAT16,
                           .T = 9, .H = 7168, .E = 256, .K = 8, .W = W, .quantize = 1, .nonfinite = 1, .seed = 101};
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_F32_128, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_BFLOAT16,
                           .T = 7, .H = 7168, .E = 256, .K = 8, .W = W, .seed = 102};
  out[n++] = (fp8_scene_t){EPX_FP8_MXFP8, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_FLOAT32,
                           .T = 11, .H = 96, .E = 512, .K = 22, .W = W, .quantize = 1, .seed = 103};
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_F32_128, EPX_LAYOUT_CAPACITY, EPX_EXCHANGE_COLLECTIVE, EPX_FLOAT32,
                           .T = 17, .H = 640, .E = 512, .K = 22, .W = W, .seed = 104};
  out[n++] = (fp8_scene_t){EPX_FP8_MXFP8, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_BFLOAT16,
                           .T = 21, .H = 1024, .E = 2 * W, .K = 1, .W = W, .quantize = 1, .nonfinite = 1, .seed = 105};
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_UE8M0_128, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_FLOAT32,
                           .T = 0, .H = 512, .E = W, .K = 1, .W = W, .seed = 106};
  /* Rows that end inside a warp's first step. */
  out[n++] = (fp8_scene_t){EPX_FP8_MXFP8, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_BFLOAT16,
                           .T = 10, .H = 1056, .E = 8, .K = 3, .W = W, .quantize = 1, .nonfinite = 1, .seed = 107};
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_F32_128, EPX_LAYOUT_RANK_MAJOR, EPX_EXCHANGE_DEDUP, EPX_BFLOAT16,
                           .T = 12, .H = 640, .E = 8, .K = 2, .W = W, .quantize = 1, .nonfinite = 1, .seed = 108};
  /* Rows that end inside a warp's step of the GPU kernel (a quantizing step
   * takes 32 lanes x 16 values x 7 chunks of 16-bit rows, x 3 of float32
   * ones), past one step and inside the next; top-k past a warp's 32 lanes
   * (the GPU's fan-out takes routes j, j + 32, ... per lane), with scales
   * that go in bulk (f32) and that do not (UE8M0's 4-byte rows of 8). */
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_F32_128, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_BFLOAT16,
                           .T = 5, .H = 4608, .E = 16, .K = 4, .W = W, .quantize = 1, .nonfinite = 1, .seed = 109};
  out[n++] = (fp8_scene_t){EPX_FP8_MXFP8, EPX_LAYOUT_CAPACITY, EPX_EXCHANGE_DEDUP, EPX_FLOAT32,
                           .T = 7, .H = 1664, .E = 8, .K = 2, .W = W, .quantize = 1, .nonfinite = 1, .seed = 110};
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_F32_128, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_COLLECTIVE, EPX_BFLOAT16,
                           .T = 6, .H = 256, .E = 64, .K = 40, .W = W, .quantize = 1, .seed = 111};
  out[n++] = (fp8_scene_t){EPX_FP8_E4M3_UE8M0_128, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_BFLOAT16,
                           .T = 6, .H = 1024, .E = 64, .K = 36, .W = W, .seed = 112};
  for (int i = 0; i < n; i++) out[i].E = (out[i].E + W - 1) / W * W; /* E a multiple of the ranks */
  return n;
}

#ifndef FP8_SCENE_ONLY

/* ------------------------------------------------------------------------ */
/* Conversions                                                               */
/* ------------------------------------------------------------------------ */

/* The nearest finite e4m3 by search, ties to the even encoding, beyond 448
 * saturated: the definition epx_f32_to_e4m3 must meet. */
static uint8_t e4m3_by_search(float f) {
  if (isnan(f)) return EPX_E4M3_NAN;
  uint8_t sign = signbit(f) ? 0x80 : 0;
  double a = fabs((double)f);
  if (a >= 448.0) return sign | 0x7e;
  uint8_t best = 0;
  double best_d = INFINITY;
  for (uint8_t c = 0; c <= 0x7e; c++) {
    double d = fabs((double)epx_e4m3_to_f32(c) - a);
    if (d < best_d || (d == best_d && !(c & 1))) best = c, best_d = d;
  }
  return sign | best;
}

static void test_e4m3_decode(void **state) {
  (void)state;
  for (int c = 0; c < 256; c++) {
    float f = epx_e4m3_to_f32((uint8_t)c);
    if ((c & 0x7f) == 0x7f) {
      assert_true(isnan(f));
      continue;
    }
    assert_int_equal(epx_f32_to_e4m3(f), c); /* every value round-trips, -0 included */
  }
  assert_true(epx_e4m3_to_f32(0x7e) == 448.0f);
  assert_true(epx_e4m3_to_f32(0x01) == 0x1p-9f); /* the smallest subnormal */
  assert_true(epx_e4m3_to_f32(0x08) == 0x1p-6f); /* the smallest normal */
}

static void test_e4m3_encode(void **state) {
  (void)state;
  tu_rng_t rng = {7};
  /* Random bit patterns over the whole float32 range, then every value
   * within a few ulps of each e4m3 value and each midpoint. */
  for (int i = 0; i < 200000; i++) {
    uint32_t bits = (uint32_t)tu_next(&rng);
    if (i % 2) bits = (bits & 0x807fffffu) | ((uint32_t)(110 + tu_below(&rng, 30)) << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    uint8_t got = epx_f32_to_e4m3(f), want = e4m3_by_search(f);
    if (got != want) fail_msg("e4m3(%a) = 0x%02x, want 0x%02x", (double)f, got, want);
  }
  for (int c = 0; c < 0x7e; c++) {
    float lo = epx_e4m3_to_f32((uint8_t)c), hi = epx_e4m3_to_f32((uint8_t)(c + 1)), mid = (lo + hi) / 2;
    for (int d = -3; d <= 3; d++)
      for (int s = 0; s < 2; s++) {
        float f = nextafterf(mid, d < 0 ? 0.0f : INFINITY);
        for (int j = 1; j < abs(d); j++) f = nextafterf(f, d < 0 ? 0.0f : INFINITY);
        if (d == 0) f = mid;
        if (s) f = -f;
        if (epx_f32_to_e4m3(f) != e4m3_by_search(f)) fail_msg("e4m3(%a) = 0x%02x, want 0x%02x", (double)f,
                                                              epx_f32_to_e4m3(f), e4m3_by_search(f));
      }
  }
  assert_int_equal(epx_f32_to_e4m3(464.0f), 0x7e);  /* the tie above 448 */
  assert_int_equal(epx_f32_to_e4m3(1e30f), 0x7e);   /* saturates */
  assert_int_equal(epx_f32_to_e4m3(-INFINITY), 0xfe);
  assert_int_equal(epx_f32_to_e4m3(NAN), 0x7f);
  assert_int_equal(epx_f32_to_e4m3(0x1p-10f), 0x00); /* half the smallest subnormal: to even */
  assert_int_equal(epx_f32_to_e4m3(0x1.8p-9f), 0x02); /* 1.5 subnormal steps: to even */
}

/* The CPU quantizer's vectorized conversion (epx_fp8_e4m3_row) against
 * the definition: every 4093rd float32 bit pattern (about a million,
 * strided over every exponent), then the neighbourhood of every e4m3 value
 * and midpoint, scaled by multipliers that are not powers of two (as the
 * quantizer scales a block before converting it). */
static void test_e4m3_rows(void **state) {
  (void)state;
  enum { n = 4096 };
  static float v[n];
  static uint8_t q[n];
  for (uint64_t base = 0; base < ((uint64_t)1 << 32); base += (uint64_t)n * 4093) {
    for (int i = 0; i < n; i++) {
      const uint32_t bits = (uint32_t)(base + (uint64_t)i * 4093);
      memcpy(&v[i], &bits, sizeof bits);
    }
    epx_fp8_e4m3_row(v, n, q);
    for (int i = 0; i < n; i++)
      if (q[i] != epx_f32_to_e4m3(v[i])) fail_msg("e4m3 rows(%a) = 0x%02x, want 0x%02x", (double)v[i], q[i],
                                                  epx_f32_to_e4m3(v[i]));
  }
  const float mults[] = {1.0f, 448.0f / 3.0f, 0.7f, 1.0f / 448.0f};
  for (size_t m = 0; m < sizeof mults / sizeof mults[0]; m++) {
    int count = 0;
    for (int c = 0; c < 0x7f; c++) {
      float x = epx_e4m3_to_f32((uint8_t)c) / mults[m];
      for (int d = -4; d <= 4; d++, count++) {
        float f = x;
        for (int j = 0; j < (d < 0 ? -d : d); j++) f = nextafterf(f, d < 0 ? 0.0f : INFINITY);
        v[count] = (count % 2 ? -f : f) * mults[m];
      }
    }
    epx_fp8_e4m3_row(v, count, q);
    for (int i = 0; i < count; i++) assert_int_equal(q[i], epx_f32_to_e4m3(v[i]));
  }
}

/* ------------------------------------------------------------------------ */
/* Scales worked by hand                                                     */
/* ------------------------------------------------------------------------ */

static void quantize_f32(epx_fp8_format_t format, const float *x, int64_t H, uint8_t *q, uint8_t *scales) {
  EXPECT_OK(epx_quantize(format, EPX_FLOAT32, 1, H, x, q, scales));
}

static void test_scales_by_hand(void **state) {
  (void)state;
  float x[512] = {0};
  uint8_t q[512], sc[16];
  float f;
  /* A zero block: amax clamped to 1e-4, zeros stay zero. */
  quantize_f32(EPX_FP8_E4M3_F32_128, x, 128, q, sc);
  memcpy(&f, sc, 4);
  assert_true(f == 1e-4f * (float)(1.0 / 448.0));
  assert_int_equal(q[0], 0);
  /* amax 448: scale 1, 448 -> 0x7e, 1 -> 0x38. */
  x[0] = 448.0f, x[1] = 1.0f, x[2] = -3.0f;
  quantize_f32(EPX_FP8_E4M3_F32_128, x, 128, q, sc);
  memcpy(&f, sc, 4);
  assert_true(f == 1.0f);
  assert_int_equal(q[0], 0x7e), assert_int_equal(q[1], 0x38), assert_int_equal(q[2], 0xc4);
  /* UE8M0: amax 500 -> 500/448 = 1.116 -> scale 2 (byte 128); 500/2 = 250. */
  x[0] = 500.0f;
  quantize_f32(EPX_FP8_E4M3_UE8M0_128, x, 512, q, sc);
  assert_int_equal(sc[0], 128);
  assert_true(epx_e4m3_to_f32(q[0]) == 240.0f || epx_e4m3_to_f32(q[0]) == 256.0f);
  assert_int_equal(sc[1], 127 - 22); /* a zero block: ceil(log2(1e-4 / 448)) = -22 */
  /* MXFP8: amax 500 -> byte 128 as well; a zero block -> byte 0. */
  quantize_f32(EPX_FP8_MXFP8, x, 64, q, sc);
  assert_int_equal(sc[0], 128), assert_int_equal(sc[1], 0);
  /* A NaN of either sign: the scale is the GPU's canonical NaN on every
   * backend (the CPU's arithmetic would keep 0x7fc00000); an infinity the
   * infinite scale. */
  uint32_t bits;
  x[1] = -NAN;
  quantize_f32(EPX_FP8_E4M3_F32_128, x, 128, q, sc);
  memcpy(&bits, sc, 4);
  assert_int_equal(bits, 0x7fffffffu), assert_int_equal(q[0], 0x7f), assert_int_equal(q[1], 0x7f);
  x[1] = -INFINITY;
  quantize_f32(EPX_FP8_E4M3_F32_128, x, 128, q, sc);
  memcpy(&bits, sc, 4);
  assert_int_equal(bits, 0x7f800000u);
  x[1] = 1.0f;
  /* Dequantizing a UE8M0 byte of 255 gives infinity (DeepEP), MXFP8's NaN. */
  uint8_t q1[32] = {0x38};
  uint8_t s255[4] = {255, 255, 255, 255};
  float out[512];
  EXPECT_OK(epx_dequantize(EPX_FP8_MXFP8, EPX_FLOAT32, 1, 32, q1, s255, out));
  assert_true(isnan(out[0]));
  uint8_t q4[512] = {0x38};
  EXPECT_OK(epx_dequantize(EPX_FP8_E4M3_UE8M0_128, EPX_FLOAT32, 1, 512, q4, s255, out));
  assert_true(isinf(out[0]));
}

/* ------------------------------------------------------------------------ */
/* Refusals                                                                  */
/* ------------------------------------------------------------------------ */

static void test_refusals(void **state) {
  (void)state;
  epx_comm_t comm;
  EXPECT_OK(epx_comm_create_self(&comm));
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.dtype = EPX_BFLOAT16, c.hidden = 1024 + 256, c.num_experts = 4, c.max_top_k = 2, c.max_tokens_per_rank = 8;
  c.fp8_format = EPX_FP8_E4M3_UE8M0_128;
  epx_buffer_t b = NULL;
  EXPECT_STATUS(epx_buffer_create(comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, "not a multiple of 512");
  c.fp8_format = EPX_FP8_MXFP8, c.hidden = 104;
  EXPECT_STATUS(epx_buffer_create(comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, "not a multiple of 32");
  c.hidden = 128, c.dtype = EPX_FLOAT16;
  EXPECT_STATUS(epx_buffer_create(comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, "config.dtype EPX_FLOAT16 with an fp8 format");
  c.dtype = EPX_BFLOAT16, c.fp8_format = (epx_fp8_format_t)9;
  EXPECT_STATUS(epx_buffer_create(comm, &c, &b), EPX_ERROR_INVALID_ARGUMENT, "not an epx_fp8_format_t");
  int64_t cols = 0;
  size_t bytes = 0;
  EXPECT_OK(epx_fp8_scale_shape(EPX_FP8_E4M3_UE8M0_128, 7168, &cols, &bytes));
  assert_int_equal(cols, 14), assert_int_equal(bytes, 4);
  EXPECT_OK(epx_fp8_scale_shape(EPX_FP8_E4M3_F32_128, 7168, &cols, &bytes));
  assert_int_equal(cols, 56), assert_int_equal(bytes, 4);
  EXPECT_OK(epx_fp8_scale_shape(EPX_FP8_MXFP8, 7168, &cols, &bytes));
  assert_int_equal(cols, 224), assert_int_equal(bytes, 1);
  EXPECT_STATUS(epx_fp8_scale_shape(EPX_FP8_NONE, 7168, &cols, &bytes), EPX_ERROR_INVALID_ARGUMENT, "not an fp8 format");

  /* On a buffer without a format, and with weights applied in dispatch. */
  c.fp8_format = EPX_FP8_NONE, c.dtype = EPX_FLOAT32, c.hidden = 128;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  int32_t idx[2] = {0, 1};
  float w[2] = {0.5f, 0.5f};
  epx_routing_t routing = {1, 2, idx, w, NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h;
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  float *x = tu_alloc(128 * 4 * 4);
  uint8_t *xq = tu_alloc(128 * 4), *rq = tu_alloc(128 * 4);
  float *xs = tu_alloc(64), *rs = tu_alloc(64);
  EXPECT_STATUS(epx_dispatch_fp8(b, h, xq, xs, rq, rs, 2), EPX_ERROR_INVALID_ARGUMENT, "EPX_FP8_NONE");
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  c.fp8_format = EPX_FP8_E4M3_F32_128;
  EXPECT_OK(epx_buffer_create(comm, &c, &b));
  routing.weighting = EPX_WEIGHTS_IN_DISPATCH;
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  EXPECT_STATUS(epx_dispatch_quantize(b, h, x, rq, rs, 2), EPX_ERROR_INVALID_ARGUMENT, "EPX_WEIGHTS_IN_DISPATCH");
  EXPECT_OK(epx_handle_release(h));
  routing.weighting = EPX_WEIGHTS_IN_COMBINE;
  EXPECT_OK(epx_dispatch_layout(b, &routing, NULL, &h));
  EXPECT_STATUS(epx_dispatch_fp8(b, h, xq, NULL, rq, rs, 2), EPX_ERROR_INVALID_ARGUMENT, "x_scales is NULL");
  EXPECT_STATUS(epx_dispatch_fp8(b, h, xq, xs, rq, rs, 1), EPX_ERROR_CAPACITY_EXCEEDED, "recv_rows_capacity");
  EXPECT_STATUS(epx_dispatch_fp8(b, h, xq, (char *)xs + 1, rq, rs, 2), EPX_ERROR_INVALID_ARGUMENT, "4-byte aligned");
  EXPECT_STATUS(epx_dispatch_fp8(b, h, xq, xs, rq, rq, 2), EPX_ERROR_INVALID_ARGUMENT, "aliases");
  EXPECT_OK(epx_dispatch_fp8(b, h, xq, xs, rq, rs, 2));
  EXPECT_OK(epx_handle_release(h));
  EXPECT_OK(epx_buffer_destroy(b));
  tu_free(x), tu_free(xq), tu_free(rq), tu_free(xs), tu_free(rs);
  EXPECT_OK(epx_comm_destroy(comm));
}

/* Shapes whose byte counts do not fit 64 bits are refused by name before a
 * byte is read (issue 38: rows 2^62 - 1, hidden 2^49 read past the arrays). */
static void test_quantize_size_overflow(void **state) {
  (void)state;
  float x[256] = {0};
  uint8_t q[256] = {0};
  float s[8] = {0};
  const int64_t huge_hidden = (int64_t)1 << 49;
  EXPECT_STATUS(epx_quantize(EPX_FP8_E4M3_F32_128, EPX_FLOAT32, ((int64_t)1 << 62) - 1, huge_hidden,
                             x, q, s),
                EPX_ERROR_INVALID_ARGUMENT, "epx_quantize: rows (or hidden) is too large");
  EXPECT_STATUS(epx_dequantize(EPX_FP8_E4M3_F32_128, EPX_FLOAT32, ((int64_t)1 << 62) - 1,
                               huge_hidden, q, s, x),
                EPX_ERROR_INVALID_ARGUMENT, "epx_dequantize: rows (or hidden) is too large");
  /* rows * hidden fits (2^61) but its float32 bytes do not. */
  EXPECT_STATUS(epx_quantize(EPX_FP8_E4M3_F32_128, EPX_FLOAT32, (int64_t)1 << 12, huge_hidden, x, q,
                             s),
                EPX_ERROR_INVALID_ARGUMENT, "rows * hidden * dtype size");
  /* One row whose bytes do not fit either. */
  EXPECT_STATUS(epx_dequantize(EPX_FP8_MXFP8, EPX_BFLOAT16, 1, (int64_t)1 << 62, q, s, x),
                EPX_ERROR_INVALID_ARGUMENT, "epx_dequantize: rows (or hidden) is too large");
  EXPECT_OK(epx_quantize(EPX_FP8_E4M3_F32_128, EPX_FLOAT32, 2, 128, x, q, s));
  EXPECT_OK(epx_dequantize(EPX_FP8_E4M3_F32_128, EPX_FLOAT32, 2, 128, q, s, x));
}

/* A recorder's replayed handle moves the recorded dispatch's bytes (the
 * layout is not made again). */
static void test_recorder_replay(void **state) {
  (void)state;
  fp8_scene_t s = {EPX_FP8_MXFP8, EPX_LAYOUT_EXPERT_MAJOR, EPX_EXCHANGE_DEDUP, EPX_BFLOAT16, .T = 10, .H = 256,
                   .E = 8, .K = 2, .W = 1, .quantize = 1, .seed = 77};
  assert_int_equal(fp8_scene_build(&s), 0);
  epx_comm_t comm;
  epx_buffer_t b;
  epx_recorder_t rec;
  epx_handle_t h[2];
  EXPECT_OK(epx_comm_create_self(&comm));
  EXPECT_OK(scene_buffer(&s, EPX_DEVICE_CPU, comm, &b));
  EXPECT_OK(epx_recorder_create(1, &rec));
  epx_routing_t routing = {s.T, s.K, s.idx[0], s.w[0], NULL, EPX_WEIGHTS_IN_COMBINE};
  uint8_t *q[2], *sc[2];
  int64_t N = 0;
  for (int pass = 0; pass < 2; pass++) {
    if (pass) EXPECT_OK(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY));
    EXPECT_OK(epx_dispatch_layout(b, &routing, rec, &h[pass]));
    EXPECT_OK(epx_handle_recv_rows(h[pass], &N));
    q[pass] = tu_alloc((size_t)((N + 1) * s.H)), sc[pass] = tu_alloc((size_t)((N + 1) * s.scale_bytes));
    EXPECT_OK(epx_dispatch_quantize(b, h[pass], s.x[0], q[pass], sc[pass], N));
  }
  assert_memory_equal(q[0], q[1], (size_t)(N * s.H));
  assert_memory_equal(sc[0], sc[1], (size_t)(N * s.scale_bytes));
  epx_recorder_stats_t stats;
  EXPECT_OK(epx_recorder_stats(rec, &stats));
  assert_int_equal(stats.replays, 1);
  for (int pass = 0; pass < 2; pass++) {
    EXPECT_OK(epx_handle_release(h[pass]));
    tu_free(q[pass]), tu_free(sc[pass]);
  }
  EXPECT_OK(epx_recorder_destroy(rec));
  EXPECT_OK(epx_buffer_destroy(b));
  EXPECT_OK(epx_comm_destroy(comm));
  fp8_scene_free(&s);
}

/* ------------------------------------------------------------------------ */
/* Dispatch scenes over the self and local transports                        */
/* ------------------------------------------------------------------------ */

static int scene_rank_main(epx_comm_t comm, int32_t rank, int32_t world, void *arg) {
  (void)world;
  return fp8_scene_rank(comm, rank, arg);
}

/* W threads posed as nodes of L ranks (epx_comm_config_t.ranks_per_node),
 * for the hierarchical exchange. */
typedef struct {
  epx_local_world_t world;
  int32_t rank;
  const fp8_scene_t *scene;
  int failures;
} node_thread_t;

static void *node_thread(void *arg) {
  node_thread_t *a = arg;
  epx_comm_t comm = NULL;
  int failures = 0, rank = a->rank;
  RANK_REQUIRE_OK(epx_comm_create_local(a->world, a->rank, &comm));
  failures += fp8_scene_rank(comm, a->rank, a->scene);
done:
  if (comm) RANK_OK(epx_comm_destroy(comm));
  a->failures = failures;
  return NULL;
}

static int run_on_nodes(const fp8_scene_t *s, int32_t L) {
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = 20.0;
  config.ranks_per_node = L;
  epx_local_world_t world = NULL;
  if (epx_local_world_create(s->W, &config, &world) != EPX_SUCCESS) return 1;
  pthread_t threads[FP8_MAX_W];
  node_thread_t args[FP8_MAX_W];
  for (int32_t r = 0; r < s->W; r++) {
    args[r] = (node_thread_t){world, r, s, 0};
    pthread_create(&threads[r], NULL, node_thread, &args[r]);
  }
  int failures = 0;
  for (int32_t r = 0; r < s->W; r++) {
    pthread_join(threads[r], NULL);
    failures += args[r].failures;
  }
  return failures + (epx_local_world_destroy(world) != EPX_SUCCESS);
}

/* Every scene on W ranks; L > 0: as nodes of L ranks, each scene with the
 * hierarchical exchange. */
static void run_scenes(int32_t W, int32_t L) {
  static fp8_scene_t scenes[64];
  int n = fp8_scenes(scenes, W), failed = 0;
  for (int i = 0; i < n; i++) {
    fp8_scene_t *s = &scenes[i];
    if (L) s->exchange = EPX_EXCHANGE_HIERARCHICAL;
    assert_int_equal(fp8_scene_build(s), 0);
    int failures;
    if (L) {
      failures = run_on_nodes(s, L);
    } else if (W == 1) {
      epx_comm_t comm;
      EXPECT_OK(epx_comm_create_self(&comm));
      failures = fp8_scene_rank(comm, 0, s);
      EXPECT_OK(epx_comm_destroy(comm));
    } else {
      failures = tu_run_ranks(W, 20.0, scene_rank_main, s);
    }
    if (failures) {
      char d[256];
      fp8_describe(s, d, sizeof d);
      fprintf(stderr, "scene %d [%s]: %d failure(s)\n", i, d, failures);
      failed++;
    }
    fp8_scene_free(s);
  }
  assert_int_equal(failed, 0);
}

static void test_dispatch_self(void **state) {
  (void)state;
  run_scenes(1, 0);
}

static void test_dispatch_local(void **state) {
  (void)state;
  run_scenes(2, 0);
  run_scenes(3, 0);
  run_scenes(4, 0);
}

static void test_dispatch_hierarchical(void **state) {
  (void)state;
  run_scenes(4, 2);
  run_scenes(8, 4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_e4m3_decode),   cmocka_unit_test(test_e4m3_encode),
      cmocka_unit_test(test_e4m3_rows),
      cmocka_unit_test(test_scales_by_hand), cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_quantize_size_overflow),
      cmocka_unit_test(test_dispatch_self), cmocka_unit_test(test_dispatch_local),
      cmocka_unit_test(test_dispatch_hierarchical), cmocka_unit_test(test_recorder_replay),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
