/* The CUDA backend's kernels as the host glue (one/one.c) and the
 * benchmarks call them: extern "C" launchers taking plain device pointers,
 * sizes and a stream. Each enqueues its work on the stream and returns the
 * launch's cudaError_t; none synchronises. One rank: every expert is local.
 *
 * The layout of a dispatch lives in device arrays (epx_cuda_layout_t) that
 * epx_cuda_layout_launch fills from the routing; the move kernels then read
 * only those arrays:
 *   scatter: one source row per token, written to each of its rows
 *            (dispatch, combine_backward), padding / empty rows zeroed;
 *   gather:  a token's rows summed in float32 in k-slot order
 *            (combine, dispatch_backward).
 * Both optionally compute grad_w[t, k] = <source row, other row> in float32. */
#ifndef EPX_CUDA_LAUNCH_H
#define EPX_CUDA_LAUNCH_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#include "core/payload.h"
#include "cuda/common/launch_flags.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits of the kernels (shared-memory tables): the layout keeps a counter
 * per expert per warp and a base, total and offset per expert per block, the
 * moves a row, slot, weight and dot per k-slot per warp. */
#define EPX_CUDA_MAX_EXPERTS 8192
#define EPX_CUDA_MAX_TOP_K 256

/* Validation verdict codes, in the low 3 bits of epx_cuda_layout_result_t.error
 * above the route index t * K + k of the first invalid route. */
enum {
  EPX_CUDA_BAD_EXPERT = 1,       /* topk_idx outside [-1, E) */
  EPX_CUDA_DUPLICATE_EXPERT = 2, /* the token named this expert at an earlier slot */
  EPX_CUDA_BAD_LOCATION = 3,     /* capacity location outside [0, C) */
  EPX_CUDA_TAKEN_LOCATION = 4    /* capacity slot already taken by an earlier route */
};
#define EPX_CUDA_NO_ERROR UINT64_MAX

/* What the layout writes for the host; read back with one copy. */
typedef struct epx_cuda_layout_result {
  int64_t rows;   /* N, the rows of the recv layout */
  uint64_t error; /* (route << 3) | code of the first invalid route, or EPX_CUDA_NO_ERROR */
} epx_cuda_layout_result_t;

/* The device arrays of one layout (T tokens, K slots, E experts). Invalid
 * routes are dropped (treated as -1) everywhere below. */
typedef struct epx_cuda_layout {
  int32_t *idx;       /* [T, K] expert of each route, -1 = none or invalid */
  int32_t *route_row; /* [T, K] recv row of each route, -1 = none (expert-major, capacity) */
  int32_t *token_row; /* [T] recv row of each token, -1 = no route (rank-major; else unused) */
  int32_t *row_src;   /* [row_bound] source of each row: route t*K+k (token t for rank-major),
                         -1 = padding or empty slot; rows >= result->rows are not written */
  int64_t *counts;    /* [E] valid routes per expert */
  int64_t *offsets;   /* [E + 1] first row of each expert's group; offsets[E] = N */
  epx_cuda_layout_result_t *result;
} epx_cuda_layout_t;

/* Bytes of the scratch epx_cuda_layout_launch needs for T tokens and E
 * experts (per-chunk counts and errors). Scratch may be reused once the
 * launch's work is done (stream order). */
size_t epx_cuda_layout_scratch_bytes(int64_t num_tokens, int32_t num_experts);

/* Computes the layout of topk_idx [T, K] (and locations [T, K] for the
 * capacity layout, C = capacity) into `out`, validating the routing, and
 * copies topk_w [T, K] into w_copy when topk_w is not NULL. Expert-major
 * groups are padded to `alignment`; rank-major has a row per token with at
 * least one valid route. row_src must hold the layout's rows (at most
 * T*min(K,E) + E*(alignment-1), T, or E*C). Needs T*K < 2^31, rows < 2^31 and
 * E <= EPX_CUDA_MAX_EXPERTS. Work: a memset (capacity only) and two kernels. */
cudaError_t epx_cuda_layout_launch(const int32_t *topk_idx, const int32_t *locations,
                                   const float *topk_w, float *w_copy, int64_t num_tokens,
                                   int32_t top_k, int32_t num_experts, epx_layout_t layout,
                                   int32_t alignment, int32_t capacity,
                                   const epx_cuda_layout_t *out, void *scratch,
                                   cudaStream_t stream);

/* Tuning of the move kernels: warps per block (at least 8: a token's slices,
 * up to 8 warps, share one block's dot sums), 16-byte vectors per lane per
 * step, and the most warps per token the automatic choice takes (log2).
 * Measured on an H200 (bench/NOTES-gpu.md): one warp per token is best or
 * equal for bf16 rows of 2048 and 7168, so the automatic choice is 1.
 * Vectors per step: the kernels that form dots (combine_backward's and
 * dispatch_backward's grad_w) take EPX_CUDA_MOVE_VECS, which fixes their
 * summation order (combine_backward's is the fused path's order too, so it
 * is part of the bits; dispatch_backward's keeps its results as they were);
 * the plain moves take fewer, the fastest measured on an H200 (bench_gpu's
 * shapes A-C; bench/NOTES.md, "v0.4 house", has the figures): the scatter 1
 * (512 B of a row per warp per step), the gather 2. */
#ifndef EPX_CUDA_MOVE_WARPS /* may be set at build time for a sweep */
#define EPX_CUDA_MOVE_WARPS 8
#endif
#ifndef EPX_CUDA_MOVE_VECS
#define EPX_CUDA_MOVE_VECS 4
#endif
#ifndef EPX_CUDA_SCATTER_VECS
#define EPX_CUDA_SCATTER_VECS 1
#endif
#ifndef EPX_CUDA_GATHER_VECS
#define EPX_CUDA_GATHER_VECS 2
#endif
#define EPX_CUDA_MOVE_MAX_WPT_SHIFT 0

/* Warps per token of the move kernels: `requested` (1, 2, 4 or 8), or for 0
 * the fewest (at most 2^EPX_CUDA_MOVE_MAX_WPT_SHIFT) that leave each warp one
 * step of the row. Returns log2 of it and sets the vectors of each warp's
 * slice (whole 128-byte lines); -1 for an invalid request. */
static inline int epx_cuda_move_split(int64_t nvec, int32_t requested, int64_t *slice) {
  int shift = 0;
  if (requested) {
    while (shift < 3 && (1 << shift) < requested) shift++;
    if ((1 << shift) != requested) return -1;
  } else {
    while (shift < EPX_CUDA_MOVE_MAX_WPT_SHIFT && ((nvec + (1 << shift) - 1) >> shift) > 32 * EPX_CUDA_MOVE_VECS)
      shift++;
  }
  const int64_t per = (nvec + (1 << shift) - 1) >> shift;
  *slice = (per + 7) / 8 * 8;
  return shift;
}

/* Scatter: dst[rows[t, k]] = src[t] for every k with rows[t, k] >= 0, or
 * round(w[t, k] * src[t]) when w is given; src is read once per token.
 * With grad_w: grad_w[t, k] = <src[t], other[rows[t, k]]> in float32 (0 for
 * slots of -1). With row_src: every row r < min(*rows_valid, row_bound) whose
 * row_src[r] < 0 is written with zeros. src [T, H], dst and other
 * [rows, H] of dtype; 16-byte aligned, H % 8 == 0, K <= EPX_CUDA_MAX_TOP_K.
 * warps_per_token: 0 (automatic) or 1, 2, 4, 8 (for benchmarks). */
cudaError_t epx_cuda_scatter_launch(epx_dtype_t dtype, const void *src, void *dst,
                                    int64_t num_tokens, int64_t hidden, const int32_t *rows,
                                    int32_t top_k, const float *w, const void *other,
                                    float *grad_w, const int32_t *row_src,
                                    const int64_t *rows_valid, int64_t row_bound,
                                    int32_t warps_per_token, cudaStream_t stream);

/* FP8 scatter (src/cuda/one/fp8.cu): each token's e4m3 row x [T, H] bytes
 * and its scales x_scales [T, S] (S the format's scale bytes per row,
 * core/payload.h's epx_payload_fp8) copied to recv_q [rows, H] and
 * recv_scales [rows, S] at rows[t, k] for every k with rows[t, k] >= 0; with
 * quantize, x is [T, H] of x_dtype, quantized once per token with
 * core/fp8.h's formulas (x_scales unused). Zeroing by row_src as for
 * scatter. x, recv_q 16-byte aligned; H % 32 == 0 and a multiple of the
 * format's block; scale tensors aligned to their entries. */
cudaError_t epx_cuda_fp8_scatter_launch(epx_fp8_format_t format, epx_dtype_t x_dtype, int quantize,
                                        const void *x, const void *x_scales, void *recv_q,
                                        void *recv_scales, int64_t num_tokens, int64_t hidden,
                                        const int32_t *rows, int32_t top_k, const int32_t *row_src,
                                        const int64_t *rows_valid, int64_t row_bound,
                                        cudaStream_t stream);

/* The same over rows `stride` bytes apart in each tensor (the dense tensors
 * above: H of x_dtype or H bytes, the scale bytes S): the W-rank paths pack
 * a row and its scales into one staging row and unpack it on arrival
 * (ep/host.c, ep/fused.c, ll/ranks.c). x and recv_q strides a multiple of
 * 16. rows NULL with top_k 1: token t goes to row t. tokens_valid (NULL:
 * num_tokens): a device count of the tokens to move, the first
 * min(*tokens_valid, num_tokens); the others are not read. */
typedef struct epx_cuda_fp8_strides {
  int64_t x, x_scales, recv_q, recv_scales;
} epx_cuda_fp8_strides_t;
cudaError_t epx_cuda_fp8_scatter_strided_launch(epx_fp8_format_t format, epx_dtype_t x_dtype, int quantize,
                                                const void *x, const void *x_scales, void *recv_q,
                                                void *recv_scales, const epx_cuda_fp8_strides_t *stride,
                                                int64_t num_tokens, int64_t hidden, const int32_t *rows,
                                                int32_t top_k, const int64_t *tokens_valid,
                                                const int32_t *row_src, const int64_t *rows_valid,
                                                int64_t row_bound, cudaStream_t stream);

/* Gather: dst[t] = round(sum over k in order of w[t, k] * src[rows[t, k]])
 * in float32 (w = 1 when NULL; zeros for a token with no rows). With grad_w:
 * grad_w[t, k] = <src[rows[t, k]], other[t]> in float32 (0 for slots of -1).
 * src [rows, H], dst and other [T, H]. warps_per_token as for scatter. */
cudaError_t epx_cuda_gather_launch(epx_dtype_t dtype, const void *src, void *dst,
                                   int64_t num_tokens, int64_t hidden, const int32_t *rows,
                                   int32_t top_k, const float *w, const void *other,
                                   float *grad_w, int32_t warps_per_token, cudaStream_t stream);

/* Accessors over rows r < min(*rows_valid, row_bound). recv_routing writes,
 * per row, the expert and weight of its route ([N]; rank-major: [N, K], one
 * per slot of its token; -1 and 0 for padding and empty slots); w may be NULL
 * (weights 0). recv_source writes the source rank (0) and token (-1, -1 for
 * padding). Either output of each may be NULL. */
cudaError_t epx_cuda_recv_routing_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                         const float *w, int32_t top_k, int64_t row_bound,
                                         int32_t *recv_expert, float *recv_w,
                                         cudaStream_t stream);
cudaError_t epx_cuda_recv_source_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                        int32_t top_k, int64_t row_bound, int32_t *src_rank,
                                        int32_t *src_token, cudaStream_t stream);

/* grad_w [T, K] from grad_recv_w ([N], rank-major [N, K]): each route's value
 * at its recv row, 0 for slots without a route (weights.cu). */
cudaError_t epx_cuda_weights_back_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                         int64_t num_tokens, int32_t top_k, const float *grad_recv_w,
                                         float *grad_w, cudaStream_t stream);

/* ------------------------------------------------------------------------ */
/* Routing (route/forward.cu, route/backward.cu; host glue in route.c)       */
/* ------------------------------------------------------------------------ */
/* Forward: route_tokens (a warp per token: scores, selection, weights, the
 * queue entries of its routes, counts per (expert, queue tile), aux and z
 * partials), expert_scan (a warp per expert: the tiles' exclusive scan,
 * counts, the losses in its last block), assign (a warp per queue tile:
 * positions, drops by position), and for a ranked drop a segmented sort of
 * (key, position) per expert and rank_select (keeps the C best of each
 * expert); renorm renormalises over the surviving routes. Every reduction
 * has a fixed order and every atomic is an integer one. */

/* What the per-token kernels share. Each warp owns `words` 4-byte words of
 * dynamic shared memory: X [pad(E)] scores p (the logits for softmax after
 * top-k), Y [pad(E)] selection scores, Gs [pad(G)] group scores, CI [K]
 * chosen experts, CP [K] their base weights. */
typedef struct epx_cuda_select_args {
  const float *logits;  /* [T, E] */
  const float *bias;    /* [E] or NULL */
  const uint8_t *mask;  /* [T] token mask or NULL */
  int T, E, K, G, TG;
  int score_fn;         /* epx_score_fn_t */
  int need_lse;         /* also compute sum(exp(l - max)) (z loss, aux of softmax after top-k) */
  int group_top;        /* experts summed into a group's score */
  int glanes;           /* lanes that reduce one group's top-2 together (a power of 2, glanes * G <= 32) */
  unsigned gmagic;      /* e / (E / G) == umulhi(e, gmagic) when nonzero */
  int words, y, g, ci, cp;
  /* Sequence-aligned blocks (B > 1 sequences of S tokens, token t in
   * sequence t % B): block j of sequence b holds positions [j W, j W + W). */
  int seqs, seq_len, seq_blocks;
} epx_cuda_select_args_t;

typedef struct epx_cuda_route_fwd_args {
  epx_cuda_select_args_t s;
  int select;         /* 0: only check finiteness and count valid tokens */
  int renorm;         /* renormalise over the K chosen (before the drop) */
  float scale;
  int by_token;       /* queue order (t, k) instead of (k, t) */
  int drop_nonfinite; /* 0: flag the first non-finite token in *bad */
  int drop_policy;    /* epx_drop_policy_t of qkey */
  unsigned long long seed;
  int *qe;            /* [N] expert of each route in queue order (-1: none), or NULL */
  float *qw;          /* [N] its weight before the drop */
  float *qkey;        /* [N] its drop key, or NULL */
  float *base;        /* [T, K] base weights (renormalisation after the drop), or NULL */
  int *hist;          /* [E, n_tiles] routes per (expert, queue tile) */
  int n_tiles, tile_shift;
  int aux_counts;     /* epx_aux_counts_t */
  int *auxcnt;        /* [B, E] F of the aux loss when not hist's counts, or NULL */
  int *valid;         /* tokens that count in the losses, or NULL */
  int *bad;           /* max over non-finite tokens of T - t (0: none) */
  double *apart;      /* [E, gridDim.x] per-block sums of q over valid tokens, or NULL */
  double *zpart;      /* [gridDim.x] per-block sums of logsumexp^2, or NULL */
} epx_cuda_route_fwd_args_t;

typedef struct epx_cuda_route_scan_args {
  const int *hist;
  int n_tiles, E;
  int *base;          /* [n_tiles, E] exclusive scan of hist along the queue */
  int *counts;        /* [E] */
  int *counts_out;    /* the caller's expert_counts or NULL */
  const double *apart;
  int n_blk, seqs, seq_blocks;
  double *colsum;     /* [B, E] */
  const int *bad;
  unsigned *ticket;
  int finalize;
  int *offsets;       /* [E + 1] exclusive scan of counts, or NULL */
  const int *valid;
  const double *zpart;
  const int *auxcnt;         /* [B, E] F, or NULL: counts */
  const float *aux_global;   /* [E] F of the global aux loss, or NULL */
  double aux_k, aux_tokens;  /* D's K factor and the global tokens (0: not global) */
  float *aux_out, *z_out;
  double aux_coeff, z_coeff;
} epx_cuda_route_scan_args_t;

typedef struct epx_cuda_route_assign_args {
  const int *qe;
  const float *qw, *qkey;
  const int *base;
  int N, T, K, E, by_token, n_tiles, tile_shift;
  int mode;  /* 0 dropless, 1 drop by position, 2 ranked drop */
  int C;
  int *idx;
  float *w;
  int *loc;
  const int *offsets;
  unsigned long long *keys; /* [N] sort keys at offsets[e] + position */
  int *rq;                  /* [N] queue index at offsets[e] + position */
  const int *bad;
} epx_cuda_route_assign_args_t;

typedef struct epx_cuda_route_rank_args {
  const int *counts, *offsets;
  const unsigned long long *sorted; /* keys, each expert's segment in descending order */
  const int *rq;
  const float *qw;
  int *flag; /* [N] kept marks at offsets[e] + position */
  int E, T, K, C, by_token;
  int *idx;
  float *w;
  int *loc;
  const int *bad;
} epx_cuda_route_rank_args_t;

typedef struct epx_cuda_route_bwd_args {
  epx_cuda_select_args_t s;
  int renorm, renorm_after;
  float scale;
  const int *topk_idx;  /* the forward's output, or NULL */
  const float *grad_w;  /* [T, K] or NULL */
  const int *counts;    /* [B, E] F of the aux loss */
  const float *aux_global; /* [E] F of the global aux loss, or NULL */
  double aux_k, aux_tokens;
  const int *valid;     /* valid tokens (aux, z) */
  double aux_scale;     /* grad_aux_loss * aux_loss_coeff */
  double z_scale;       /* grad_z_loss * z_loss_coeff */
  float *grad;          /* [T, E] */
  const int *bad;
} epx_cuda_route_bwd_args_t;

/* The one-kernel forward (route/fast.cu), for a dropless routing without
 * locations or losses whose non-finite tokens are dropped, E in {32, 64,
 * 128, 256, 512}, K <= 32, and G = 1 or a power of two <= 32 with a group
 * score of at most 2 experts; logits and bias aligned to 4 * min(E / 32, 4)
 * bytes. A warp per token, everything in registers; writes idx, w and (when
 * not NULL) adds each route to counts, which the caller zeroes. */
typedef struct epx_cuda_route_fast_args {
  const float *logits;  /* [T, E] */
  const float *bias;    /* [E] or NULL */
  const uint8_t *mask;  /* [T] or NULL */
  int T, E, K, G, TG;
  int group_top;        /* experts summed into a group's score: 1 or 2 */
  int score_fn;         /* epx_score_fn_t */
  int renorm;
  float scale;
  int32_t *idx;         /* [T, K] */
  float *w;             /* [T, K] */
  int32_t *counts;      /* [E] or NULL */
} epx_cuda_route_fast_args_t;

cudaError_t epx_cuda_route_fast_launch(const epx_cuda_route_fast_args_t *a, cudaStream_t stream);

/* Kinds of per-token kernel for epx_cuda_route_token_plan. */
enum { EPX_CUDA_ROUTE_TOKENS = 0, EPX_CUDA_ROUTE_BACKWARD = 1 };
#define EPX_CUDA_ROUTE_MAX_TOKEN_WARPS 16 /* warps (tokens) per block of the per-token kernels */
#define EPX_CUDA_ROUTE_WARPS 8            /* warps per block of the per-expert / per-tile kernels */
#define EPX_CUDA_ROUTE_MIN_TILE_SHIFT 8   /* queue tiles of at least 256 routes */

/* Warps per block (at most max_warps) of a routing kernel whose warps each
 * need per_warp bytes of dynamic shared memory, and the block's bytes;
 * raises the kernel's limit past the default 48 KB when one warp needs it.
 * cudaErrorInvalidValue when even one warp does not fit the device. kind:
 * EPX_CUDA_ROUTE_TOKENS or EPX_CUDA_ROUTE_ASSIGN (route/forward.cu), or the
 * backward kernel (epx_cuda_route_backward_plan, route/backward.cu). */
enum { EPX_CUDA_ROUTE_ASSIGN = 2 };
cudaError_t epx_cuda_route_smem_plan(int kind, size_t per_warp, int max_warps, int *warps,
                                     size_t *bytes);
cudaError_t epx_cuda_route_backward_plan(size_t per_warp, int max_warps, int *warps, size_t *bytes);

cudaError_t epx_cuda_route_tokens_launch(const epx_cuda_route_fwd_args_t *a, int blocks, int warps,
                                         size_t smem, cudaStream_t stream);
cudaError_t epx_cuda_route_scan_launch(const epx_cuda_route_scan_args_t *a, cudaStream_t stream);
cudaError_t epx_cuda_route_assign_launch(const epx_cuda_route_assign_args_t *a, int warps,
                                         size_t smem, cudaStream_t stream);
/* The segmented descending sort of the ranked drop; with temp NULL, sets
 * *temp_bytes only. */
cudaError_t epx_cuda_route_sort_launch(void *temp, size_t *temp_bytes,
                                       const unsigned long long *keys,
                                       unsigned long long *sorted, int n, int E,
                                       const int *offsets, cudaStream_t stream);
cudaError_t epx_cuda_route_rank_launch(const epx_cuda_route_rank_args_t *a, cudaStream_t stream);
/* w[t, k] = scale * base[t, k] / (sum of base over t's kept slots in k
 * order) for kept slots (renormalisation after the drop). */
cudaError_t epx_cuda_route_renorm_launch(const int *idx, const float *base, float *w, int T, int K,
                                         float scale, const int *bad, cudaStream_t stream);
cudaError_t epx_cuda_route_backward_launch(const epx_cuda_route_bwd_args_t *a, int blocks,
                                           int warps, size_t smem, cudaStream_t stream);

/* The accessors above over a layout of several ranks' tokens: the layout's
 * ids are local (expert_base is added), its routes have K_src slots and its
 * token g is token g % block_tokens of rank g / block_tokens (ep.c). */
cudaError_t epx_cuda_recv_routing_ranks_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                               const float *w, int32_t K, int32_t K_src,
                                               int32_t expert_base, int64_t row_bound,
                                               int32_t *recv_expert, float *recv_w,
                                               cudaStream_t stream);
cudaError_t epx_cuda_recv_source_ranks_launch(epx_layout_t layout, const epx_cuda_layout_t *lay,
                                              int32_t K, int64_t block_tokens, int64_t row_bound,
                                              int32_t *src_rank, int32_t *src_token,
                                              cudaStream_t stream);

/* ------------------------------------------------------------------------ */
/* W ranks (ep/tables.cu): the tables of a dispatch over NCCL                       */
/* ------------------------------------------------------------------------ */
/*
 * Every rank gathers every rank's sanitised routing as [W * Tm, Kb] (Tm the
 * agreed tokens per rank, Kb the buffer's max_top_k; token g = s * Tm + t of
 * rank s, slots and tokens past a rank's own -1). From it each rank computes,
 * with one scan over four flag segments, where every row it sends and
 * receives sits in the staging buffers:
 *   home (the token's rank), per destination d in rank order:
 *     pair  (t, d): a row per token with a route to d        (dedup)
 *     route (t, k): a row per route to d, in (t, k) order    (collective)
 *   receiver, per source s in rank order: the same items of s, in s's order.
 * Staging row of an item: compact (prefix over the peers before it) or, with
 * worst_case_sizing, peer * per-peer bound + index (static message sizes).
 * The receive layout itself is the one-rank layout of the gathered routing
 * restricted to this rank's experts (locations s * C + l for capacity). */

/* Segment offsets of the flag/scan array (ints). */
typedef struct epx_cuda_ep_dims {
  int32_t W, rank, El, Kb, K; /* K: this rank's top_k (<= Kb) */
  int64_t Tm, T;              /* agreed tokens per rank; this rank's tokens */
  int32_t layout, capacity, worst;
  int64_t Bp, Br;             /* per-peer staging rows with worst_case_sizing */
  int32_t weighting;          /* this rank's routing.weighting (its header carries it) */
} epx_cuda_ep_dims_t;

/* Ints of the flag array (one past the four segments, for the totals). */
int64_t epx_cuda_ep_flag_count(const epx_cuda_ep_dims_t *d);
/* Bytes of the scan's temporary storage for that many flags. */
size_t epx_cuda_ep_scan_bytes(int64_t flags);

/* Header of a rank's gathered routing. */
enum { EPX_CUDA_EP_HDR_TOKENS = 0, EPX_CUDA_EP_HDR_OVERSIZE = 1, EPX_CUDA_EP_HDR_INVALID = 2,
       EPX_CUDA_EP_HDR_TOPK = 3, EPX_CUDA_EP_HDR_WEIGHTING = 4, EPX_CUDA_EP_HDR_INTS = 5 };
/* The summary's N: after the 4W counts and the W headers. */
#define EPX_CUDA_EP_SUMMARY_ROWS(W) ((4 + EPX_CUDA_EP_HDR_INTS) * (int64_t)(W))

/* Own routing [T, K] (sanitised ids, weights or NULL, locations or NULL) ->
 * the send block: idx/w/loc [Tm, Kb] and the header {T, oversize, invalid
 * (own_result's error), K, weighting}. oversize: send no routes. */
cudaError_t epx_cuda_ep_stage_launch(const epx_cuda_ep_dims_t *d, const int32_t *own_idx,
                                     const float *own_w, const int32_t *locations,
                                     const epx_cuda_layout_result_t *own_result, int oversize,
                                     int32_t *idx, float *w, int32_t *loc, int32_t *hdr,
                                     cudaStream_t stream);

/* The stage launch for the expert-major and rank-major layouts, validating
 * the raw routing itself (as the one-rank layout would: bad ids, duplicates
 * within a token; invalid routes sent as -1, the first in result->error, the
 * header's invalid flag set) and copying topk_w [T, K] to w_copy (either
 * may be NULL): two small memsets and one kernel in place of that layout's
 * two kernels over all E experts. */
cudaError_t epx_cuda_ep_stage_validate_launch(const epx_cuda_ep_dims_t *d, const int32_t *topk_idx,
                                              const float *topk_w, int32_t num_experts, float *w_copy,
                                              epx_cuda_layout_result_t *result, int32_t *idx, float *w,
                                              int32_t *hdr, cudaStream_t stream);

/* Gathered idx/loc [W*Tm, Kb] and headers [W, 4] -> the receive layout's
 * routing (local ids, -1 elsewhere; locations s*C + l) and the flags. Any
 * rank's oversize header empties everything (nothing moves). */
cudaError_t epx_cuda_ep_flags_launch(const epx_cuda_ep_dims_t *d, const int32_t *gidx,
                                     const int32_t *gloc, const int32_t *ghdr, int32_t *ridx,
                                     int32_t *rloc, int32_t *flags, cudaStream_t stream);

/* Exclusive prefix sum of `count` ints (cub). */
cudaError_t epx_cuda_ep_scan_launch(const int32_t *flags, int32_t *scan, int64_t count, void *temp,
                                    size_t temp_bytes, cudaStream_t stream);

/* The tables (see ep.c for each array's shape). rp_rows, rr_row, rr_all and
 * stage_of_row must be -1 (0xff bytes) before. summary [4W + W*HDR_INTS + 2] int64:
 * send pairs, send routes, recv pairs, recv routes per peer, the headers,
 * the layout's N, and the first invalid route of this rank (uint64). */
typedef struct epx_cuda_ep_tables {
  const int32_t *scan, *gidx, *ridx, *ghdr;
  const float *gw;
  const epx_cuda_layout_t *recv;      /* the receive layout (device arrays) */
  const epx_cuda_layout_result_t *own_result;
  int32_t *pair_stage;  /* [T, W] home staging row of pair (t, d), -1 none */
  int32_t *route_stage; /* [T, K] home staging row of route (t, k), -1 none */
  int32_t *group;       /* [T, K] destination rank of route (t, k), -1 none */
  int32_t *rp_rows;     /* [pair staging rows, Kb] layout row of each slot of a received pair */
  float *rp_w;          /* [pair staging rows, Kb] its weight */
  int32_t *rr_row;      /* [route staging rows] layout row a received route writes (rank-major: the
                           pair's first local route only) */
  int32_t *rr_all;      /* [route staging rows] layout row of the route (rank-major: its pair's) */
  int32_t *rr_slot;     /* [route staging rows] the route's k */
  float *rr_w;          /* [route staging rows] its weight */
  int32_t *stage_of_row;/* [row bound] staging row of each layout row: its route (expert-major,
                           capacity) or its pair (rank-major) */
  int64_t *summary;
} epx_cuda_ep_tables_t;
cudaError_t epx_cuda_ep_tables_launch(const epx_cuda_ep_dims_t *d, const epx_cuda_ep_tables_t *t,
                                      cudaStream_t stream);

/* Combine's reductions that the one-rank gather does not do: per token,
 * acc = 0; over its slots sorted by (group, k) (group NULL: one group, k
 * order): part = 0 + (w *) src[row]; at each group's end acc += part, part
 * rounded to src_dtype first when round_groups; dst[t] = acc in dst_dtype.
 * src_dtype != dst_dtype only without grad_w (float32 partials out or in).
 * With grad_w: grad_w[t, k] = <src[row(t, k)], other[t]> (0 for -1 slots). */
typedef struct epx_cuda_reduce {
  epx_dtype_t src_dtype, dst_dtype;
  const void *src;
  void *dst;
  int64_t tokens, hidden;
  const int32_t *rows; /* [T, K] */
  const int32_t *group;/* [T, K] or NULL */
  int32_t top_k;
  const float *w;      /* [T, K] or NULL */
  const void *other;   /* [T, H] with grad_w */
  float *grad_w;       /* [T, K] or NULL */
  int round_groups;
} epx_cuda_reduce_t;
cudaError_t epx_cuda_reduce_launch(const epx_cuda_reduce_t *r, cudaStream_t stream);

/* Home side of a returned value per slot: grad_w[t, k] = back[pair_stage[t,
 * group[t,k]] * Kb + k] (pairs, dedup) or back[route_stage[t, k]] (routes),
 * 0 where there is no route. */
cudaError_t epx_cuda_ep_home_values_launch(const epx_cuda_ep_dims_t *d, int pairs, const int32_t *pair_stage,
                                           const int32_t *route_stage, const int32_t *group,
                                           const float *back, float *grad_w, cudaStream_t stream);

/* Receiver side of epx_weights_backward: back[j] = grad_recv_w[rr_all[j] *
 * slots + (slots > 1 ? rr_slot[j] : 0)] for each route staging row j (0 for
 * rows of no route). */
cudaError_t epx_cuda_ep_route_values_launch(int64_t rows, const int32_t *rr_all, const int32_t *rr_slot,
                                            int32_t slots, const float *grad_recv_w, float *back,
                                            cudaStream_t stream);

/* A hash of topk_idx [T, K] on the device (order-sensitive, deterministic):
 * sum over i of mix(i, topk_idx[i]) mod 2^64, written to *hash. */
cudaError_t epx_cuda_hash_launch(const int32_t *topk_idx, int64_t count, uint64_t *hash, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
