/* The CPU exchange engine's private header: the plan a layout leaves in a
 * handle, the buffer's staging, and the first message every collective call
 * starts with. layout.c builds the plan (the count and metadata exchange),
 * move.c replays it (dispatch, combine, both backward passes), call.c agrees
 * the call across the ranks.
 *
 * Vocabulary (one rank's view):
 *   route    a valid (token, k-slot) of a routing; goes to the rank that holds
 *            its physical expert (core/placement.h: the placement's rank_of;
 *            the plan's topk_idx holds physical ids, the caller's logical
 *            ones mapped by the replica rule).
 *   item     a row sent in dispatch: one per (token, destination rank) with
 *            the dedup exchange, one per route with the collective exchange.
 *   pair     a (token, destination rank) with at least one route.
 *   arrival  a route as the receiver sees it: (source rank, token, k, expert,
 *            weight, location), ordered by source rank, then token, then k.
 *   entry    a remote arrival, in arrival order: where its row lands.
 * Rows a rank sends to itself never touch a staging buffer: they are copied
 * straight from x to recv_x (and back in combine). On a transport whose ranks
 * share the address space (the local one) no row is staged at all: a rank
 * reads its peers' rows in place, inside the call's first message (see
 * epx_comm_handshake); other transports (MPI) pack, exchange and unpack. */
#ifndef EPX_CPU_EXCHANGE_H
#define EPX_CPU_EXCHANGE_H

#include <stddef.h>
#include <stdint.h>

#include "core/transport.h"
#include "core/objects.h"
#include "core/placement.h"
#include "epx.h"

/* The buffer's CPU state: its identity among the comm's buffers, and staging
 * grown on demand (never shrunk; freed with the buffer). */
struct epx_cpu_scratch {
  int64_t buffer_id; /* 1 + the buffers created over the comm before it (equal on every rank) */
  void *send;
  size_t send_bytes;
  void *recv;
  size_t recv_bytes;
  void *fp8;    /* epx_dispatch_quantize: the quantized rows [T, H] and their scales [T, S] */
  size_t fp8_bytes;
};

struct epx_cpu_plan {
  int64_t layout_id; /* the comm's layout sequence number (equal on every rank) */
  int32_t W, rank, K, E_local;
  const epx_placement_table_t *place; /* the buffer's (it outlives its handles) */
  int32_t record_k; /* slots per metadata record: the buffer's max_top_k */
  int64_t T, H;
  size_t row_bytes;
  epx_dtype_t dtype;
  epx_layout_t layout;
  epx_exchange_t exchange; /* DEDUP or COLLECTIVE: how items are formed */
  struct epx_cpu_hier *hier; /* the hierarchical exchange's two hops (hier.c), or NULL */
  epx_weighting_t weighting;
  epx_combine_precision_t precision; /* FLOAT32 whenever the payload is float32 */
  int32_t *topk_idx; /* [T, K] the routing's physical experts (epx_placement_map_routing) */
  float *topk_w;     /* [T, K] copy (zeros when none was given) */
  int32_t *self_row; /* [T, K] layout row of each route to this rank, else -1 */
  /* Sender side, per destination rank r (self excluded): */
  int64_t *item_count, *item_displ;   /* [W] items to r, their first index */
  int64_t *route_count, *route_displ; /* [W] routes to r */
  int64_t *pair_count, *pair_displ;   /* [W] pairs to r */
  int32_t *item_token;                /* [items] */
  /* Receiver side, per source rank s (self excluded): */
  int64_t *ritem_count, *ritem_displ;   /* [W] staging rows from s */
  int64_t *rroute_count, *rroute_displ; /* [W] routes (entries) from s */
  int64_t *rpair_count, *rpair_displ;   /* [W] pairs from s */
  int64_t *ritem_entry; /* [R + 1] entries of staging row i */
  int64_t *rpair_entry; /* [P + 1] entries of pair p */
  int64_t *entry_row;   /* [M] layout row of each remote entry */
  float *entry_weight;  /* [M] */
  int32_t *entry_slot;  /* [M] the route's k-slot at its source */
  /* The receive layout: */
  int64_t N;
  int64_t *expert_counts;                /* [E_local] rows before padding */
  int64_t *expert_offsets;               /* [E_local + 1] */
  int32_t *row_src_rank, *row_src_token; /* [N], -1 = padding or empty slot */
  int32_t *row_expert;                   /* [N * row_slots] global expert ids, -1 elsewhere */
  float *row_weight;                     /* [N * row_slots] */
  int32_t row_slots;                     /* K for rank-major, else 1 */
  int64_t self_items;                    /* rows this rank sends itself (stats) */
  int64_t bytes;                         /* host bytes held by the plan */
  int32_t ll_pending;                    /* low-latency mode: the epx_ll_phase_t awaiting completion (ll.c) */
  int32_t ll_fixed_shape;                /* low-latency mode: rows in the fixed shape, unused ones never written */
  int32_t agreed;                        /* every rank agreed the layout's first message (layout.c) */
};

/* ------------------------------------------------------------------------ */
/* The first message of every collective call (call.c)                       */
/* ------------------------------------------------------------------------ */

/* What a rank is doing. Values travel between ranks; only ever add. */
typedef enum {
  EPX_CALL_LAYOUT = 1,
  EPX_CALL_DISPATCH,
  EPX_CALL_COMBINE,
  EPX_CALL_DISPATCH_BACKWARD,
  EPX_CALL_COMBINE_BACKWARD,
  EPX_CALL_WEIGHTS_BACKWARD,
  EPX_CALL_REPLAY, /* a recorder's validated replay of a layout */
  EPX_CALL_DISPATCH_FP8,
  EPX_CALL_DISPATCH_QUANTIZE,
  EPX_CALL_COUNT
} epx_call_kind_t;

/* Arguments that change what the call exchanges: equal on every rank. */
#define EPX_CALL_GRAD_W 1
/* The call is a low-latency one (epx_ll_*, set from its name): a different
 * call from the normal one of the same kind, and named as such. */
#define EPX_CALL_LOW_LATENCY 2

/* One block of the first message (the same header to every peer, with a
 * per-peer word): the call's identity, shape and the rank's verdict. A
 * receiver trusts none of it until epx_cpu_call_agree has checked it. */
typedef struct {
  int32_t kind;      /* epx_call_kind_t */
  int32_t verdict;   /* the rank's epx_status_t for this call */
  int64_t buffer_id; /* struct epx_cpu_scratch.buffer_id; 0 when unknown */
  int64_t layout_id; /* the handle's (layout: the one being made); 0 when unknown */
  int64_t tokens;    /* T of the routing or handle */
  int32_t top_k;     /* K of the routing or handle */
  int32_t rank;      /* the sender */
  int64_t hidden;
  int32_t flags;     /* EPX_CALL_GRAD_W: the call asks for grad_w; EPX_CALL_LOW_LATENCY */
  int32_t weighting; /* the routing's or handle's epx_weighting_t (layout: set by layout.c) */
  int64_t word[3]; /* layout: items to the receiver; local payload calls: rows, plan, second-plane rows */
} epx_cpu_call_t;

/* A call in progress on one rank: its header and the message of a failed
 * verdict (kept across the exchange). */
typedef struct {
  epx_buffer_t buffer;
  const char *fn;
  epx_cpu_call_t mine;
  char message[1024];
} epx_cpu_call_ctx_t;

/* Fills ctx for a call of `kind` with verdict `local` (saving its message)
 * on handle h (NULL: none). */
void epx_cpu_call_begin(epx_cpu_call_ctx_t *ctx, epx_buffer_t buffer, epx_call_kind_t kind,
                        const char *fn, epx_status_t local, epx_handle_t h);
/* Checks every rank's block (the same inputs, so the same verdict on every
 * rank): the same call, buffer and handle everywhere, every verdict success,
 * and sane shapes; otherwise the error that every rank returns. */
epx_status_t epx_cpu_call_agree(const epx_cpu_call_ctx_t *ctx, const epx_cpu_call_t *peers);
/* The handshake's blocks: [W] copies of ctx->mine to send, then [W] to
 * receive into (malloc'd; NULL when out of memory). */
epx_cpu_call_t *epx_cpu_call_blocks(const epx_cpu_call_ctx_t *ctx);
/* The first message with nothing more to move (a refusal, a replay's
 * validation): one handshake of headers, then epx_cpu_call_agree. */
epx_status_t epx_cpu_call_exchange(epx_buffer_t buffer, epx_call_kind_t kind, const char *fn,
                                   epx_status_t local, epx_handle_t h);
/* The call kind of a public function's name (EPX_CALL_REPLAY for the layout's
 * validation, which is the only agreement made outside a move); an epx_ll_*
 * dispatch is a layout (its first message is the layout's), an epx_ll_*
 * combine a combine. */
epx_call_kind_t epx_cpu_call_kind(const char *fn);
const char *epx_cpu_call_name(int32_t kind);

/* The moves of epx_dispatch (move.c) for rows of row_bytes bytes each
 * (16-byte aligned, a multiple of 16), unweighted, as the call `kind` of the
 * public function fn. _planes moves a second plane with them, row for row
 * (rows2 [T, row_bytes2] -> recv_rows2 [N, row_bytes2], any alignment): the
 * fp8 dispatches' scales beside their rows, straight from the caller's
 * tensors to the caller's, staged together only where a transport stages. */
epx_status_t epx_cpu_dispatch_rows(epx_buffer_t b, epx_handle_t h, epx_status_t local, const char *fn,
                                   epx_call_kind_t kind, const void *rows, void *recv_rows, size_t row_bytes);
epx_status_t epx_cpu_dispatch_planes(epx_buffer_t b, epx_handle_t h, epx_status_t local, const char *fn,
                                     epx_call_kind_t kind, const void *rows, const void *rows2, void *recv_rows,
                                     void *recv_rows2, size_t row_bytes, size_t row_bytes2);

/* The layout and combine of the public calls, for another public function
 * fn (its errors name fn): the low-latency mode's (ll.c). */
epx_status_t epx_cpu_layout_as(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t handle,
                               const char *fn);
epx_status_t epx_cpu_combine_as(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *expert_out, void *out,
                                const char *fn);

/* ------------------------------------------------------------------------ */
/* Shared helpers (layout.c)                                                 */
/* ------------------------------------------------------------------------ */

/* Staging of at least `need` bytes in *buf (64-byte aligned). */
epx_status_t epx_cpu_ensure(void **buf, size_t *have, size_t need, const char *fn);
void epx_cpu_displs(const int64_t *count, int64_t *displ, int32_t n);
int64_t epx_cpu_total(const int64_t *count, int32_t n);

#endif
