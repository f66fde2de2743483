/* epx-bench's experts: a SwiGLU FFN per expert on OpenBLAS (or a per-expert
 * scale with --ffn 0), and one rank's expert work on the rows it received,
 * in the handle's layout. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* ------------------------------------------------------------------------ */
/* Experts: SwiGLU FFN on OpenBLAS (or a per-expert scale with --ffn 0)      */
/* ------------------------------------------------------------------------ */

int64_t expert_stride(const experts_t *x) { return 3 * x->H * x->F; }

void experts_make(experts_t *x, const options_t *o) {
  x->H = o->hidden;
  x->F = o->ffn;
  x->E = o->experts;
  x->w = NULL;
  if (x->F == 0) return;
  x->w = xalloc(sizeof(float) * (size_t)(expert_stride(x) * x->E));
  /* gate/up ~ U(-3/sqrt(H), 3/sqrt(H)) keeps x W near unit variance for x ~ U(-1, 1). */
  float a_in = (float)(3.0 / sqrt((double)x->H)), a_out = (float)(1.0 / sqrt((double)x->F));
  for (int32_t e = 0; e < x->E; e++) {
    rng_t r = rng_make(o->seed, 1000003 + (uint64_t)e);
    float *we = x->w + (size_t)(expert_stride(x) * e);
    fill_uniform(&r, we, 2 * x->H * x->F, a_in);
    fill_uniform(&r, we + 2 * x->H * x->F, x->H * x->F, a_out);
  }
}

/* The --ffn 0 expert: y = s_e * x. */
static float expert_scale(int32_t e, int32_t E) { return 0.5f + (float)e / (float)E; }

static float silu_of(float g) { return g / (1.0f + expf(-g)); }

/* Forward of expert e on m rows: X [m, H] -> Y [m, H], keeping G, U, A
 * [m, F] for the backward. */
void ffn_forward(const experts_t *x, int32_t e, int64_t m, const float *X, float *G, float *U,
                        float *A, float *Y) {
  const int64_t H = x->H, F = x->F;
  if (F == 0) {
    float s = expert_scale(e, x->E);
    for (int64_t i = 0; i < m * H; i++) Y[i] = s * X[i];
    return;
  }
  const float *wg = x->w + (size_t)(expert_stride(x) * e), *wu = wg + H * F, *wd = wu + H * F;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)F, (int)H, 1.0f, X, (int)H, wg,
              (int)F, 0.0f, G, (int)F);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)F, (int)H, 1.0f, X, (int)H, wu,
              (int)F, 0.0f, U, (int)F);
  for (int64_t i = 0; i < m * F; i++) A[i] = silu_of(G[i]) * U[i];
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)H, (int)F, 1.0f, A, (int)F, wd,
              (int)H, 0.0f, Y, (int)H);
}

/* Backward of expert e on m rows: dY [m, H] -> dX [m, H] (may alias X), the
 * weight gradients dW [3 * H * F] (NULL to skip), overwriting G, U, A. */
void ffn_backward(const experts_t *x, int32_t e, int64_t m, float *X, float *G, float *U,
                         float *A, const float *dY, float *dX, float *dW) {
  const int64_t H = x->H, F = x->F;
  if (F == 0) {
    float s = expert_scale(e, x->E);
    for (int64_t i = 0; i < m * H; i++) dX[i] = s * dY[i];
    return;
  }
  const float *wg = x->w + (size_t)(expert_stride(x) * e), *wu = wg + H * F, *wd = wu + H * F;
  if (dW)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)F, (int)H, (int)m, 1.0f, A, (int)F, dY,
                (int)H, 0.0f, dW + 2 * H * F, (int)H);
  float *dA = A; /* A is not needed once dWd is formed */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)F, (int)H, 1.0f, dY, (int)H, wd,
              (int)H, 0.0f, dA, (int)F);
  for (int64_t i = 0; i < m * F; i++) {
    float g = G[i], sig = 1.0f / (1.0f + expf(-g));
    float da = dA[i];
    G[i] = da * U[i] * sig * (1.0f + g * (1.0f - sig)); /* dG */
    U[i] = da * g * sig;                                /* dU */
  }
  if (dW) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)H, (int)F, (int)m, 1.0f, X, (int)H, G,
                (int)F, 0.0f, dW, (int)F);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)H, (int)F, (int)m, 1.0f, X, (int)H, U,
                (int)F, 0.0f, dW + H * F, (int)F);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)H, (int)F, 1.0f, G, (int)F, wg,
              (int)F, 0.0f, dX, (int)H);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)H, (int)F, 1.0f, U, (int)F, wu,
              (int)F, 1.0f, dX, (int)H);
}

/* ------------------------------------------------------------------------ */
/* One rank's expert work on its received rows                               */
/* ------------------------------------------------------------------------ */

/* The handle's queries into host arrays (on CUDA they write device memory:
 * through a mirror). */
static void query_layout(rank_experts_t *re, epx_handle_t h, int64_t per_row) {
  const size_t El = (size_t)re->E_local, n = (size_t)(re->N * per_row + 1);
  int64_t *counts = mirror_of(re->counts, 8 * El), *offsets = mirror_of(re->offsets, 8 * (El + 1));
  int32_t *expert = mirror_of(re->recv_expert, 4 * n);
  float *w = mirror_of(re->recv_w, 4 * n);
  TRY(epx_handle_expert_counts(h, counts, offsets));
  TRY(epx_handle_recv_routing(h, expert, w));
  download(re->counts, counts, 8 * El);
  download(re->offsets, offsets, 8 * (El + 1));
  download(re->recv_expert, expert, 4 * n);
  download(re->recv_w, w, 4 * n);
  mirror_free(re->counts, counts), mirror_free(re->offsets, offsets);
  mirror_free(re->recv_expert, expert), mirror_free(re->recv_w, w);
}

void rank_experts_plan(rank_experts_t *re, epx_handle_t h) {
  const int32_t El = re->E_local, K = re->K;
  TRY(epx_handle_recv_rows(h, &re->N));
  int64_t per_row = re->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  re->recv_expert = grow(re->recv_expert, &re->recv_expert_cap, sizeof(int32_t) * (size_t)(re->N * per_row + 1));
  re->recv_w = grow(re->recv_w, &re->recv_w_cap, sizeof(float) * (size_t)(re->N * per_row + 1));
  query_layout(re, h, per_row);
  int64_t first_expert = (int64_t)re->rank * El;
  for (int32_t e = 0; e <= El; e++) re->first[e] = 0;
  if (re->layout == EPX_LAYOUT_RANK_MAJOR) {
    for (int64_t i = 0; i < re->N * K; i++)
      if (re->recv_expert[i] >= 0) re->first[re->recv_expert[i] - first_expert + 1]++;
  } else {
    for (int32_t e = 0; e < El; e++)
      re->first[e + 1] = re->layout == EPX_LAYOUT_CAPACITY ? re->offsets[e + 1] - re->offsets[e] : re->counts[e];
  }
  for (int32_t e = 0; e < El; e++) re->first[e + 1] += re->first[e];
  re->n_items = re->first[El];
  size_t n = (size_t)re->n_items + 1;
  re->item_row = grow(re->item_row, &re->item_row_cap, sizeof(int64_t) * n);
  re->item_slot = grow(re->item_slot, &re->item_slot_cap, sizeof(int32_t) * n);
  re->item_w = grow(re->item_w, &re->item_w_cap, sizeof(float) * n);
  if (re->layout == EPX_LAYOUT_RANK_MAJOR) {
    int64_t *fill = xalloc(sizeof(int64_t) * (size_t)El);
    memcpy(fill, re->first, sizeof(int64_t) * (size_t)El);
    for (int64_t r = 0; r < re->N; r++)
      for (int32_t k = 0; k < K; k++) {
        int32_t ge = re->recv_expert[r * K + k];
        if (ge < 0) continue;
        int64_t it = fill[ge - first_expert]++;
        re->item_row[it] = r;
        re->item_slot[it] = k;
        re->item_w[it] = re->recv_w[r * K + k];
      }
    free(fill);
  } else {
    for (int32_t e = 0; e < El; e++)
      for (int64_t j = 0; j < re->first[e + 1] - re->first[e]; j++) {
        re->item_row[re->first[e] + j] = re->offsets[e] + j;
        re->item_slot[re->first[e] + j] = -1;
        re->item_w[re->first[e] + j] = 1.0f;
      }
  }
  size_t H = (size_t)re->H, F = (size_t)re->ex->F;
  if (F > 0) {
    re->X = grow(re->X, &re->X_cap, sizeof(float) * n * H);
    re->Y = grow(re->Y, &re->Y_cap, sizeof(float) * n * H);
    re->G = grow(re->G, &re->G_cap, sizeof(float) * n * F);
    re->U = grow(re->U, &re->U_cap, sizeof(float) * n * F);
    re->A = grow(re->A, &re->A_cap, sizeof(float) * n * F);
  } else {
    re->X = grow(re->X, &re->X_cap, sizeof(float) * H);
    re->Y = grow(re->Y, &re->Y_cap, sizeof(float) * H);
  }
  if (re->layout == EPX_LAYOUT_RANK_MAJOR) {
    re->acc = grow(re->acc, &re->acc_cap, sizeof(float) * ((size_t)re->N + 1) * H);
    re->slot_grad_w = grow(re->slot_grad_w, &re->slot_grad_w_cap, sizeof(float) * ((size_t)re->N * K + 1));
  }
}

/* Rows of a payload tensor [rows, H] not covered by items (expert-major
 * alignment padding) are written with zeros. */
static void zero_padding(const rank_experts_t *re, void *t) {
  if (re->layout != EPX_LAYOUT_EXPERT_MAJOR) return;
  size_t row_bytes = (size_t)re->H * epx_dtype_size(re->dtype);
  for (int32_t e = 0; e < re->E_local; e++) {
    int64_t a = re->offsets[e] + re->counts[e], b = re->offsets[e + 1];
    if (b > a) memset((char *)t + (size_t)a * row_bytes, 0, (size_t)(b - a) * row_bytes);
  }
}

/* The --ffn 0 expert (y = s_e * x) row by row, so exchange-bound runs at
 * large shapes need no float copy of the received rows. Forward: in =
 * recv_x, out = expert_out. Backward: in = grad_expert_out, out =
 * grad_recv_x, and rank-major rows also get slot_grad_w = s_e * <g, x> with x
 * from recv_x (still intact: rank-major writes grad_recv_x at the end). */
static void rank_experts_scale(rank_experts_t *re, const void *in, void *out, const void *recv_x, int backward) {
  const int64_t H = re->H, K = re->K;
  const size_t row_bytes = (size_t)H * epx_dtype_size(re->dtype);
  const int rank_major = re->layout == EPX_LAYOUT_RANK_MAJOR;
  float *v = re->X, *xr = re->Y;
  for (int32_t e = 0; e < re->E_local; e++) {
    float s = expert_scale(re->rank * re->E_local + e, re->ex->E);
    for (int64_t i = re->first[e]; i < re->first[e + 1]; i++) {
      int64_t r = re->item_row[i];
      TRY(epx_convert(EPX_FLOAT32, v, re->dtype, (const char *)in + (size_t)r * row_bytes, H));
      if (!rank_major) {
        for (int64_t j = 0; j < H; j++) v[j] *= s;
        TRY(epx_convert(re->dtype, (char *)out + (size_t)r * row_bytes, EPX_FLOAT32, v, H));
        continue;
      }
      float *acc = re->acc + r * H, ws = re->item_w[i] * s;
      if (backward) {
        TRY(epx_convert(EPX_FLOAT32, xr, re->dtype, (const char *)recv_x + (size_t)r * row_bytes, H));
        double dot = 0.0;
        for (int64_t j = 0; j < H; j++) dot += (double)v[j] * xr[j];
        re->slot_grad_w[r * K + re->item_slot[i]] = (float)(s * dot);
      }
      for (int64_t j = 0; j < H; j++) acc[j] += ws * v[j];
    }
  }
}

/* recv_x [N, H] -> expert_out [N, H] in the handle's layout. */
void rank_experts_forward(rank_experts_t *re, const void *recv_x, void *expert_out) {
  const int64_t H = re->H, F = re->ex->F;
  const size_t row_bytes = (size_t)H * epx_dtype_size(re->dtype);
  const int rank_major = re->layout == EPX_LAYOUT_RANK_MAJOR;
  if (rank_major) memset(re->acc, 0, sizeof(float) * (size_t)(re->N * H));
  if (F == 0) rank_experts_scale(re, recv_x, expert_out, NULL, 0);
  for (int32_t e = 0; F > 0 && e < re->E_local; e++) {
    int64_t i0 = re->first[e], m = re->first[e + 1] - i0;
    if (m == 0) continue;
    float *X = re->X + i0 * H, *Y = re->Y + i0 * H;
    if (!rank_major) {
      TRY(epx_convert(EPX_FLOAT32, X, re->dtype, (const char *)recv_x + (size_t)re->item_row[i0] * row_bytes, m * H));
    } else {
      for (int64_t j = 0; j < m; j++)
        TRY(epx_convert(EPX_FLOAT32, X + j * H, re->dtype,
                        (const char *)recv_x + (size_t)re->item_row[i0 + j] * row_bytes, H));
    }
    ffn_forward(re->ex, re->rank * re->E_local + e, m, X, re->G + i0 * F, re->U + i0 * F, re->A + i0 * F, Y);
    re->flops_fwd += 6.0 * (double)m * (double)H * (double)F;
    if (!rank_major) {
      TRY(epx_convert(re->dtype, (char *)expert_out + (size_t)re->item_row[i0] * row_bytes, EPX_FLOAT32, Y, m * H));
    } else {
      for (int64_t j = 0; j < m; j++) {
        float *acc = re->acc + re->item_row[i0 + j] * H, w = re->item_w[i0 + j];
        const float *y = Y + j * H;
        for (int64_t i = 0; i < H; i++) acc[i] += w * y[i];
      }
    }
  }
  if (rank_major) TRY(epx_convert(re->dtype, expert_out, EPX_FLOAT32, re->acc, re->N * H));
  zero_padding(re, expert_out);
}

/* grad_expert_out [N, H] -> grad_recv_x [N, H] (may alias recv_x: the
 * forward kept what it needs), dW [E_local, 3*H*F]; rank-major also fills
 * slot_grad_w [N, K] with <grad_expert_out row, y_e(row)>. */
void rank_experts_backward(rank_experts_t *re, const void *grad_expert_out, const void *recv_x,
                                  void *grad_recv_x, float *dW) {
  const int64_t H = re->H, F = re->ex->F, K = re->K;
  const size_t row_bytes = (size_t)H * epx_dtype_size(re->dtype);
  const int rank_major = re->layout == EPX_LAYOUT_RANK_MAJOR;
  if (rank_major) {
    memset(re->acc, 0, sizeof(float) * (size_t)(re->N * H));
    for (int64_t i = 0; i < re->N * K; i++) re->slot_grad_w[i] = 0.0f;
  }
  if (F == 0) rank_experts_scale(re, grad_expert_out, grad_recv_x, recv_x, 1);
  for (int32_t e = 0; F > 0 && e < re->E_local; e++) {
    int64_t i0 = re->first[e], m = re->first[e + 1] - i0;
    float *dWe = dW ? dW + (size_t)(expert_stride(re->ex) * e) : NULL;
    if (m == 0) {
      if (dWe) memset(dWe, 0, sizeof(float) * (size_t)expert_stride(re->ex));
      continue;
    }
    float *X = re->X + i0 * H, *dY = re->Y + i0 * H;
    if (!rank_major) {
      TRY(epx_convert(EPX_FLOAT32, dY, re->dtype,
                      (const char *)grad_expert_out + (size_t)re->item_row[i0] * row_bytes, m * H));
    } else {
      float *g = xalloc(sizeof(float) * (size_t)H);
      for (int64_t j = 0; j < m; j++) {
        int64_t r = re->item_row[i0 + j];
        TRY(epx_convert(EPX_FLOAT32, g, re->dtype, (const char *)grad_expert_out + (size_t)r * row_bytes, H));
        float *y = dY + j * H, w = re->item_w[i0 + j];
        double dot = 0.0;
        for (int64_t i = 0; i < H; i++) {
          dot += (double)g[i] * y[i];
          y[i] = w * g[i];
        }
        re->slot_grad_w[r * K + re->item_slot[i0 + j]] = (float)dot;
      }
      free(g);
    }
    ffn_backward(re->ex, re->rank * re->E_local + e, m, X, re->G + i0 * F, re->U + i0 * F, re->A + i0 * F,
                 dY, X, dWe);
    re->flops_bwd += 12.0 * (double)m * (double)H * (double)F;
    if (!rank_major) {
      TRY(epx_convert(re->dtype, (char *)grad_recv_x + (size_t)re->item_row[i0] * row_bytes, EPX_FLOAT32, X, m * H));
    } else {
      for (int64_t j = 0; j < m; j++) {
        float *acc = re->acc + re->item_row[i0 + j] * H;
        const float *dx = X + j * H;
        for (int64_t i = 0; i < H; i++) acc[i] += dx[i];
      }
    }
  }
  if (rank_major) TRY(epx_convert(re->dtype, grad_recv_x, EPX_FLOAT32, re->acc, re->N * H));
  zero_padding(re, grad_recv_x);
}

void rank_experts_free(rank_experts_t *re) {
  free(re->counts);
  free(re->offsets);
  free(re->recv_expert);
  free(re->recv_w);
  free(re->first);
  free(re->item_row);
  free(re->item_slot);
  free(re->item_w);
  free(re->X);
  free(re->Y);
  free(re->G);
  free(re->U);
  free(re->A);
  free(re->acc);
  free(re->slot_grad_w);
}
