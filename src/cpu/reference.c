/* The dense one-hot reference: the two einsums of a capacity-style MoE layer
 * written out literally, as frameworks did before sparse exchanges.
 *
 *   mask [T, E, C]   mask[t, e, c] = 1 (or w[t,k]) where topk_idx[t,k] = e and
 *                    locations[t,k] = c; 0 everywhere else
 *   dispatch         out[e, c, :] = sum_t mask[t, e, c] * x[t, :]        (sec,sm->ecm)
 *   combine          out[t, :] = sum_{e, c} mask[t, e, c] * expert_out[e, c, :]  (sec,ecm->sm)
 *
 * Every product is computed, zeros included, in float32 with one rounding to
 * the dtype at the end: O(T*E*C*H) work and O(T*E*C) memory. It is the slow
 * oracle of the tests and the dense baseline of the benchmark, so it must stay
 * the honest einsum — no skipping of zero mask entries. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/payload.h"

static int misaligned(const void *p, uintptr_t alignment) { return ((uintptr_t)p % alignment) != 0; }

/* The arguments both einsums share; `in` [in_rows, H] and `out` [out_rows, H]
 * are the payload tensors. */
static epx_status_t check_args(const char *fn, epx_dtype_t dtype, int64_t T, int64_t H, int32_t E,
                               int32_t C, int32_t K, const int32_t *topk_idx, const float *topk_w,
                               const int32_t *locations, epx_weighting_t weighting, const void *in,
                               const char *in_name, int dispatch, const void *out) {
  EPX_REQUIRE(epx_dtype_size(dtype), "%s: dtype %d is not EPX_FLOAT32, EPX_BFLOAT16 or EPX_FLOAT16",
              fn, (int)dtype);
  EPX_REQUIRE(T >= 0, "%s: num_tokens is %lld; pass a count >= 0", fn, (long long)T);
  EPX_REQUIRE(H > 0 && H % 8 == 0, "%s: hidden is %lld; pass a positive multiple of 8", fn,
              (long long)H);
  EPX_REQUIRE(E >= 1, "%s: num_experts is %d; pass at least 1 expert", fn, E);
  EPX_REQUIRE(C >= 0, "%s: capacity is %d; pass a capacity >= 0", fn, C);
  EPX_REQUIRE(K >= 1 && K <= E, "%s: top_k is %d; it must be in [1, num_experts = %d]", fn, K, E);
  EPX_REQUIRE(weighting == EPX_WEIGHTS_IN_COMBINE || weighting == EPX_WEIGHTS_IN_DISPATCH ||
                  weighting == EPX_WEIGHTS_NONE,
              "%s: weighting %d is not an epx_weighting_t", fn, (int)weighting);
  if (T > 0) {
    EPX_REQUIRE(topk_idx, "%s: topk_idx is NULL; pass the [num_tokens, top_k] expert ids", fn);
    EPX_REQUIRE(topk_w || weighting == EPX_WEIGHTS_NONE,
                "%s: topk_w is NULL but weighting is not EPX_WEIGHTS_NONE; pass the [num_tokens, "
                "top_k] weights or say EPX_WEIGHTS_NONE", fn);
    EPX_REQUIRE(locations, "%s: locations is NULL; pass the [num_tokens, top_k] capacity slots", fn);
  }
  EPX_REQUIRE(!misaligned(topk_idx, 4) && !misaligned(topk_w, 4) && !misaligned(locations, 4),
              "%s: topk_idx, topk_w and locations must be 4-byte aligned", fn);
  int64_t slots = (int64_t)E * C, in_rows = dispatch ? T : slots, out_rows = dispatch ? slots : T;
  EPX_REQUIRE(in || in_rows == 0, "%s: %s is NULL; pass a [%s, hidden] tensor", fn, in_name,
              dispatch ? "num_tokens" : "num_experts * capacity");
  EPX_REQUIRE(out || out_rows == 0, "%s: out is NULL; pass a [%s, hidden] tensor", fn,
              dispatch ? "num_experts * capacity" : "num_tokens");
  EPX_REQUIRE(!misaligned(in, 16), "%s: %s is not 16-byte aligned; allocate it with 16-byte "
              "alignment", fn, in_name);
  EPX_REQUIRE(!misaligned(out, 16), "%s: out is not 16-byte aligned; allocate it with 16-byte "
              "alignment", fn);
  return EPX_SUCCESS;
}

/* Builds mask [T, E, C] after checking the routing's values, so a refused
 * call writes nothing. The mask is weighted by topk_w when `weighted`. */
static epx_status_t build_mask(const char *fn, int64_t T, int32_t E, int32_t C, int32_t K,
                               const int32_t *topk_idx, const float *topk_w,
                               const int32_t *locations, int weighted, float **mask_out) {
  size_t slots = (size_t)E * (size_t)C, cells = (size_t)T * slots;
  float *mask = calloc(cells ? cells : 1, sizeof(float));
  int64_t *owner = malloc((slots ? slots : 1) * sizeof(int64_t)); /* [E, C] token in the slot */
  epx_status_t status = EPX_SUCCESS;
  if (!mask || !owner)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for the [%lld, %d, %d] mask; the dense "
             "reference needs num_tokens * num_experts * capacity floats", fn, (long long)T, E, C);
  for (size_t i = 0; i < slots; i++) owner[i] = -1;
  for (int64_t t = 0; t < T; t++) {
    for (int32_t k = 0; k < K; k++) {
      int32_t e = topk_idx[t * K + k];
      if (e == -1) continue;
      if (e < -1 || e >= E)
        EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                 "%s: topk_idx[%lld][%d] is %d, outside [-1, num_experts = %d); use -1 for no expert",
                 fn, (long long)t, k, e, E);
      for (int32_t j = 0; j < k; j++)
        if (topk_idx[t * K + j] == e)
          EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: topk_idx[%lld] names expert %d twice; a token picks each expert at most once",
                   fn, (long long)t, e);
      int32_t c = locations[t * K + k];
      if (c < 0 || c >= C)
        EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                 "%s: locations[%lld][%d] is %d, outside the capacity [0, %d); drop the route "
                 "(topk_idx = -1) or raise the capacity", fn, (long long)t, k, c, C);
      /* A slot holds one token: the einsum would silently sum two. */
      size_t slot = (size_t)e * C + (size_t)c;
      if (owner[slot] >= 0)
        EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                 "%s: locations[%lld][%d] = %d is taken twice for expert %d (token %lld has it "
                 "too); locations must be unique per expert", fn, (long long)t, k, c, e,
                 (long long)owner[slot]);
      owner[slot] = t;
      mask[(size_t)t * slots + slot] = weighted ? topk_w[t * K + k] : 1.0f;
    }
  }
  free(owner);
  *mask_out = mask;
  return EPX_SUCCESS;
fail:
  free(mask);
  free(owner);
  return status;
}

/* rows [n, H] of dtype as float32 [n, H] (a fresh array). */
static epx_status_t to_f32(const char *fn, epx_dtype_t dtype, const void *rows, int64_t n, int64_t H,
                           float **out) {
  size_t count = (size_t)n * (size_t)H;
  float *f = malloc((count ? count : 1) * sizeof(float));
  if (!f) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %lld rows", fn, (long long)n);
  size_t row_bytes = (size_t)epx_payload_row_bytes(dtype, H);
  for (int64_t i = 0; i < n; i++)
    epx_row_to_f32(dtype, (const char *)rows + (size_t)i * row_bytes, f + (size_t)i * H, H);
  *out = f;
  return EPX_SUCCESS;
}

/* Either einsum (`dispatch` or combine): the checked routing's mask
 * [T, E, C] (weighted by topk_w when the weights are applied in this
 * einsum) times `in`, in float32, each output row rounded once. */
static epx_status_t dense_einsum(const char *fn, epx_dtype_t dtype, int64_t T, int64_t H, int32_t num_experts,
                                 int32_t capacity, int32_t K, const int32_t *topk_idx, const float *topk_w,
                                 const int32_t *locations, epx_weighting_t weighting, const void *in,
                                 const char *in_name, int dispatch, void *out) {
  epx_error_clear();
  epx_status_t status = check_args(fn, dtype, T, H, num_experts, capacity, K, topk_idx, topk_w, locations,
                                   weighting, in, in_name, dispatch, out);
  if (status != EPX_SUCCESS) return status;
  int64_t E = num_experts, C = capacity;
  float *mask = NULL, *inf = NULL, *acc = NULL;
  const epx_weighting_t here = dispatch ? EPX_WEIGHTS_IN_DISPATCH : EPX_WEIGHTS_IN_COMBINE;
  EPX_CHECK(build_mask(fn, T, num_experts, capacity, K, topk_idx, topk_w, locations, weighting == here, &mask));
  EPX_CHECK(to_f32(fn, dtype, in, dispatch ? T : E * C, H, &inf));
  acc = malloc((size_t)H * sizeof(float));
  if (!acc) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  size_t row_bytes = (size_t)epx_payload_row_bytes(dtype, H);
  if (dispatch) {
    /* out[e, c, :] = sum_t mask[t, e, c] * x[t, :] */
    for (int64_t e = 0; e < E; e++) {
      for (int64_t c = 0; c < C; c++) {
        for (int64_t h = 0; h < H; h++) acc[h] = 0.0f;
        for (int64_t t = 0; t < T; t++) {
          float m = mask[((size_t)t * E + (size_t)e) * C + (size_t)c];
          const float *xt = inf + (size_t)t * H;
          for (int64_t h = 0; h < H; h++) acc[h] += m * xt[h];
        }
        epx_row_from_f32(dtype, acc, (char *)out + (size_t)(e * C + c) * row_bytes, H);
      }
    }
  } else {
    /* out[t, :] = sum_{e, c} mask[t, e, c] * expert_out[e, c, :] */
    for (int64_t t = 0; t < T; t++) {
      for (int64_t h = 0; h < H; h++) acc[h] = 0.0f;
      for (int64_t e = 0; e < E; e++) {
        for (int64_t c = 0; c < C; c++) {
          float m = mask[((size_t)t * E + (size_t)e) * C + (size_t)c];
          const float *y = inf + (size_t)(e * C + c) * H;
          for (int64_t h = 0; h < H; h++) acc[h] += m * y[h];
        }
      }
      epx_row_from_f32(dtype, acc, (char *)out + (size_t)t * row_bytes, H);
    }
  }
fail:
  free(mask);
  free(inf);
  free(acc);
  return status;
}

epx_status_t epx_reference_dense_dispatch(epx_dtype_t dtype, int64_t num_tokens, int64_t hidden,
                                          int32_t num_experts, int32_t capacity, int32_t top_k,
                                          const int32_t *topk_idx, const float *topk_w,
                                          const int32_t *locations, epx_weighting_t weighting,
                                          const void *x, void *out) {
  return dense_einsum("epx_reference_dense_dispatch", dtype, num_tokens, hidden, num_experts, capacity, top_k,
                      topk_idx, topk_w, locations, weighting, x, "x", 1, out);
}

epx_status_t epx_reference_dense_combine(epx_dtype_t dtype, int64_t num_tokens, int64_t hidden,
                                         int32_t num_experts, int32_t capacity, int32_t top_k,
                                         const int32_t *topk_idx, const float *topk_w,
                                         const int32_t *locations, epx_weighting_t weighting,
                                         const void *expert_out, void *out) {
  return dense_einsum("epx_reference_dense_combine", dtype, num_tokens, hidden, num_experts, capacity, top_k,
                      topk_idx, topk_w, locations, weighting, expert_out, "expert_out", 0, out);
}
