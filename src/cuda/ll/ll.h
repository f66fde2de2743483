/* The low-latency decode mode on CUDA (epx.h, "Low-latency decode";
 * core/ll.h). On W ranks: ranks.c, below ("W ranks"), the low-latency path
 * of the W-rank table (ep/internal.h). On one GPU: a CUDA
 * buffer created with config.low_latency = 1 over a comm of one rank gets
 * epx_cuda_ll_backend as its table (cuda/backend.c) and the epx_ll_* calls
 * reach epx_cuda_ll_ops. The layout is one kernel
 * (layout.cu); the rows move with the one-GPU scatter and gather kernels
 * (launch.h), so the bits are the normal one-GPU path's, which are the CPU
 * backend's. Nothing synchronises the host and nothing is allocated after
 * buffer creation: the calls can be captured in a CUDA graph and replayed
 * with a new token count (a device value). */
#ifndef EPX_CUDA_LL_LL_H
#define EPX_CUDA_LL_LL_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

struct epx_backend;
struct epx_ll_backend;
extern const struct epx_backend epx_cuda_ll_backend;
extern const struct epx_ll_backend epx_cuda_ll_ops;
/* The epx_ll_* table of a CUDA low-latency buffer is its backend table's
 * `ll` (core/backend.h): one GPU's, or W ranks' (ep/ep.c, which calls the
 * low-latency path's, ranks.c). */

/* ------------------------------------------------------------------------ */
/* Slots (slots.c): what one GPU's and W ranks' buffers share                */
/* ------------------------------------------------------------------------ */

/* Live handles of a low-latency buffer: two micro-batches, each with a
 * step in flight and the next one dispatched (DeepEP keeps two buffers per
 * rank). */
#define EPX_CUDA_LL_SLOTS 4

/* A buffer's slots: one device block holding every slot's arrays (the
 * owner carves them) then the device copy of N; which slots hold a live
 * handle, and the send each handle waits to complete. */
typedef struct epx_cuda_ll_slots {
  void *block;
  int64_t *rows; /* device copy of N (epx_handle_recv_rows_device) */
  int64_t N;     /* rows of the fixed shape */
  int32_t in_use[EPX_CUDA_LL_SLOTS];
  int32_t pending[EPX_CUDA_LL_SLOTS]; /* epx_ll_phase_t */
} epx_cuda_ll_slots_t;

/* Bytes of n arrays of sizes[i] bytes, each from a 256-byte boundary; with
 * `at`, *fields[i] set to each array's place from at. */
size_t epx_cuda_ll_carve(char *at, const size_t *sizes, void **const *fields, size_t n);
/* The block for EPX_CUDA_LL_SLOTS slots of slot_bytes each, and rows = N
 * (`what` names the allocation in an error). The owner cudaFrees s->block. */
epx_status_t epx_cuda_ll_slots_alloc(epx_cuda_ll_slots_t *s, size_t slot_bytes, int64_t N, const char *fn,
                                     const char *what);
/* *slot: a slot holding no live handle, or EPX_ERROR_BUSY naming fn. */
epx_status_t epx_cuda_ll_slot_take(epx_cuda_ll_slots_t *s, const char *fn, int *slot);
/* The slot holds h (recv_rows N) with its dispatch pending; or holds nothing. */
void epx_cuda_ll_slot_hold(epx_cuda_ll_slots_t *s, int slot, epx_handle_t h);
void epx_cuda_ll_slot_release(epx_cuda_ll_slots_t *s, int slot);

/* The fixed layout a handle's queries read (its slot's device arrays). */
typedef struct epx_cuda_ll_view {
  const int64_t *counts, *offsets; /* [El], [El + 1] */
  const int32_t *src_rank;         /* [N], or NULL: 0 where src_token >= 0 (one GPU) */
  const int32_t *src_token;        /* [N] */
  const int32_t *row_expert;       /* [routes] */
  const float *row_weight;         /* [routes] */
  int64_t routes;                  /* N, or N * K (rank-major: [N, K]) */
} epx_cuda_ll_view_t;

/* The queries of epx.h on such a handle, enqueued on the buffer's stream. */
epx_status_t epx_cuda_ll_expert_counts(const epx_cuda_ll_view_t *v, epx_handle_t h, int64_t *counts,
                                       int64_t *offsets);
epx_status_t epx_cuda_ll_recv_routing(const epx_cuda_ll_view_t *v, epx_handle_t h, int32_t *recv_expert,
                                      float *recv_w);
epx_status_t epx_cuda_ll_recv_source(const epx_cuda_ll_view_t *v, epx_handle_t h, int32_t *src_rank,
                                     int32_t *src_token);
/* Nothing moved between ranks by a layout of its own: every row is "self". */
epx_status_t epx_cuda_ll_stats(epx_handle_t h, epx_handle_stats_t *stats);

/* A handle's layout in device memory: the fixed shape [E, G] rows (G =
 * max_tokens on one GPU). */
typedef struct epx_cuda_ll_layout {
  int32_t *route_row;  /* [T, K] row of each route, -1 for none (what scatter and gather read) */
  int64_t *counts;     /* [E] rows per expert */
  int64_t *offsets;    /* [E + 1] e * G */
  int32_t *src_token;  /* [E * G] the row's token, -1 past the expert's count */
  int32_t *row_expert; /* [E * G] the row's expert, -1 past the count */
  float *row_weight;   /* [E * G] its route's weight, 0 past the count (or without weights) */
} epx_cuda_ll_layout_t;

/* The layout of T = min(*num_tokens, rows) tokens (num_tokens NULL: rows)
 * of topk_idx [rows, K] over E experts in blocks of G rows: expert e's rows
 * are the tokens that chose it, in token order, from e * G. A route to an id
 * outside [0, E), or a token's second route to the same expert, is dropped.
 * recv_count [E] (int32, may be NULL) gets the counts. topk_w may be NULL.
 * route_row must be all -1 on entry (the launcher memsets it first). */
cudaError_t epx_cuda_ll_layout_launch(const int32_t *topk_idx, const float *topk_w,
                                      const int32_t *num_tokens, int64_t rows, int32_t top_k,
                                      int32_t experts, int64_t block, const epx_cuda_ll_layout_t *out,
                                      int32_t *recv_count, cudaStream_t stream);

/* src_rank [n] = 0 where src_token [n] >= 0, else -1 (one GPU: every row is
 * this rank's). */
cudaError_t epx_cuda_ll_source_launch(const int32_t *src_token, int64_t n, int32_t *src_rank,
                                      cudaStream_t stream);

/* ------------------------------------------------------------------------ */
/* W ranks over the device transport (ranks.c, kernels in ranks.cu)          */
/* ------------------------------------------------------------------------ */
/*
 * A dispatch sends every peer p one slab of S rows of the buffer's dtype:
 * max_tokens rows (the tokens of this rank with a route to p's experts, in
 * token order: the normal dedup exchange's pairs) then the header, in the
 * slab's last S - max_tokens rows: int32 count, three pad words, the pairs'
 * tokens [max_tokens], their routes' global expert ids [max_tokens, Kb]
 * (-1 for a route to another rank, an invalid or a repeated one) and
 * weights [max_tokens, Kb]. The counts so travel with the rows, and the
 * receiver lays its rows out from the slabs alone. Combine returns a
 * partial per pair in the same staging rows (row s * S + j of a slot's
 * staging is pair j of peer s both ways). */

enum { EPX_CUDA_LL_HDR_PAD = 4 }; /* ints before the header's arrays */

typedef struct epx_cuda_ll_dims {
  int32_t W, rank, El, Kb, K; /* K: this rank's routing top_k (<= Kb) */
  int64_t Tm, S;              /* max_tokens; rows of a slab */
  int64_t row_bytes;          /* of a dispatch row (the slab's rows) */
} epx_cuda_ll_dims_t;

/* Bytes of a slab's header. */
static inline int64_t epx_cuda_ll_header_bytes(int64_t Tm, int32_t Kb) {
  return 4 * (EPX_CUDA_LL_HDR_PAD + Tm * (1 + 2 * (int64_t)Kb));
}

/* The receiver's layout of a slot (expert-major, N = El * W * Tm rows). */
typedef struct epx_cuda_ll_recv {
  /* [W * S, Kb] layout row of each route of a received pair, -1 none
   * (rank-major: the pair's row at its first route only) */
  int32_t *rp_rows;
  float *rp_w;         /* [W * S, Kb] its weight */
  int64_t *counts;     /* [El] */
  int64_t *offsets;    /* [El + 1] e * W * Tm */
  int32_t *src_rank;   /* [N] -1 past the counts */
  int32_t *src_token;  /* [N] */
  int32_t *row_expert; /* [N] global id (rank-major [N, K]) */
  float *row_weight;   /* [N] (rank-major [N, K]) */
} epx_cuda_ll_recv_t;

/* Home side: the slabs' headers in send (slab p at p * S rows) and
 * pair_stage [rows, W] (p * S + j for the token's pair j of peer p, -1 none)
 * from topk_idx / topk_w [rows, K] (topk_w may be NULL: weights 0), the
 * count min(*num_tokens, rows) (num_tokens NULL: rows). Invalid and repeated
 * routes are dropped as in epx_cuda_ll_layout_launch. */
cudaError_t epx_cuda_ll_pack_launch(const epx_cuda_ll_dims_t *d, const int32_t *topk_idx, const float *topk_w,
                                    const int32_t *num_tokens, int64_t rows, void *send, int32_t *pair_stage,
                                    cudaStream_t stream);

/* Receiver side: the layout of the slabs in recv (as the home sent them)
 * into out (rp_rows set to -1 first), recv_count [El] (may be NULL). */
cudaError_t epx_cuda_ll_place_launch(const epx_cuda_ll_dims_t *d, const void *recv, const epx_cuda_ll_recv_t *out,
                                     int32_t *recv_count, cudaStream_t stream);

/* The same in the rank-major layout (N = W * Tm): pair j of source s is row
 * s * Tm + j; row_expert / row_weight are [N, K] (K the dims' top_k, every
 * rank's), counts the routes per local expert, offsets 0 but offsets[El] =
 * N, recv_count [W] the rows per source. */
cudaError_t epx_cuda_ll_place_ranks_launch(const epx_cuda_ll_dims_t *d, const void *recv,
                                           const epx_cuda_ll_recv_t *out, int32_t *recv_count, cudaStream_t stream);

/* The load/store variant (window.c: the fused module's window and kernels,
 * src/cuda/fused) keeps its rows in a fused plan's compact expert-major
 * layout; remap.cu moves them to and from the fixed shape. */
typedef struct epx_cuda_ll_remap {
  const int64_t *counts, *offsets; /* the plan's: [El] rows per expert, [El + 1] compact group starts */
  const void *src;                 /* rows of row_bytes: compact -> fixed, or fixed -> compact */
  void *dst;
  int64_t row_bytes;
  /* to the fixed shape only: the plan's per-row metadata [compact rows] and
   * the fixed layout's arrays (sources, routing, counts, offsets) and
   * recv_count [El] (may be NULL) */
  const int32_t *src_rank, *src_token, *row_expert;
  const float *row_w;
  epx_cuda_ll_recv_t out;
  int32_t *recv_count;
} epx_cuda_ll_remap_t;

/* to_fixed: expert e's compact rows [offsets[e], offsets[e] + counts[e]) to
 * rows e * W * Tm + i of the fixed shape, with their metadata (-1 / 0 past
 * the counts); else the fixed rows back to the compact ones (combine's
 * expert_out). */
cudaError_t epx_cuda_ll_remap_launch(const epx_cuda_ll_dims_t *d, int to_fixed, const epx_cuda_ll_remap_t *m,
                                     cudaStream_t stream);

/* out [rows, K] = topk_idx with the rows from min(*num_tokens, rows) on set
 * to -1 (num_tokens NULL: a copy). */
cudaError_t epx_cuda_ll_clip_launch(const int32_t *topk_idx, const int32_t *num_tokens, int64_t rows, int32_t top_k,
                                    int32_t *out, cudaStream_t stream);

/* The load/store variant's state of a W-rank buffer (window.c), or NULL
 * where the NCCL slabs serve it (EPX_PATH_HOST, a build or config the fused
 * module cannot serve, or a refusal on any rank). */
typedef struct epx_cuda_ll_window epx_cuda_ll_window_t;
/* Collective (at buffer creation): every rank gets a window or none. */
epx_status_t epx_cuda_ll_window_create(epx_buffer_t b, epx_cuda_ll_window_t **window);
void epx_cuda_ll_window_destroy(epx_buffer_t b, epx_cuda_ll_window_t *window);
/* The whole dispatch of a step into slot `slot`: rows in recv_x, the fixed
 * layout in out, recv_count (may be NULL). */
epx_status_t epx_cuda_ll_window_dispatch(epx_buffer_t b, epx_cuda_ll_window_t *window, int slot,
                                         const epx_routing_t *routing, const int32_t *num_tokens, const void *x,
                                         void *recv_x, const epx_cuda_ll_dims_t *d, const epx_cuda_ll_recv_t *out,
                                         int32_t *recv_count);
/* The whole combine of the step in slot `slot`. */
epx_status_t epx_cuda_ll_window_combine(epx_buffer_t b, epx_cuda_ll_window_t *window, int slot,
                                        const epx_cuda_ll_dims_t *d, const void *expert_out, void *out,
                                        int weighted);
/* paths[W]: EPX_PATH_FUSED for the peers reached by load/store, EPX_PATH_HOST for the relayed. */
void epx_cuda_ll_window_paths(const epx_cuda_ll_window_t *window, int32_t world_size, int32_t *paths);

#ifdef __cplusplus
}
#endif
#endif
