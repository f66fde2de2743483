/* The low-latency decode mode on the CPU (epx.h, "Low-latency decode";
 * core/ll.h): the normal layout (layout.c) and row moves (move.c) inside one
 * call, with the layout's rows placed in the mode's fixed shape before any
 * row moves. Expert-major rows of local expert e keep their order and start
 * at e * W * max_tokens; rank-major rows from source rank s start at
 * s * max_tokens. Only the plan's row indices change, so dispatch and combine
 * are the normal path's, bit for bit, on every transport; the rows past the
 * counts are never written (the plan says so to move.c). The CPU has
 * nothing to overlap a send with on the calling thread: the whole exchange
 * runs in the send and completion closes it. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/ll.h"
#include "cpu/cpu.h"
#include "cpu/exchange.h"

/* The fixed shape: groups (local experts, or source ranks) of `rows` each. */
typedef struct {
  int64_t groups, rows;
} fixed_shape_t;

static fixed_shape_t fixed_shape(const struct epx_cpu_plan *p, int64_t max_tokens) {
  if (p->layout == EPX_LAYOUT_RANK_MAJOR) return (fixed_shape_t){p->W, max_tokens};
  return (fixed_shape_t){p->E_local, (int64_t)p->W * max_tokens};
}

/* The group of layout row i: its local expert (an unpadded expert-major
 * layout has no empty rows), or its source rank. */
static int64_t group_of(const struct epx_cpu_plan *p, int64_t i) {
  if (p->layout == EPX_LAYOUT_RANK_MAJOR) return p->row_src_rank[i];
  return p->place->slot_of[p->row_expert[i]];
}

typedef struct {
  int32_t *src_rank, *src_token, *expert;
  float *weight;
} row_arrays_t;

static void row_arrays_free(row_arrays_t *a) {
  free(a->src_rank);
  free(a->src_token);
  free(a->expert);
  free(a->weight);
}

static epx_status_t row_arrays_new(row_arrays_t *a, int64_t N, int32_t slots, const char *fn) {
  size_t n = (size_t)(N ? N : 1), ns = n * (size_t)slots;
  a->src_rank = malloc(n * sizeof(int32_t));
  a->src_token = malloc(n * sizeof(int32_t));
  a->expert = malloc(ns * sizeof(int32_t));
  a->weight = calloc(ns, sizeof(float));
  if (!a->src_rank || !a->src_token || !a->expert || !a->weight) {
    row_arrays_free(a);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory (the low-latency layout's %lld rows)", fn,
                     (long long)N);
  }
  for (size_t i = 0; i < n; i++) a->src_rank[i] = a->src_token[i] = -1;
  for (size_t i = 0; i < ns; i++) a->expert[i] = -1;
  return EPX_SUCCESS;
}

/* Moves every row index of the plan to the fixed shape: map[i] is layout row
 * i's new row (its group's first row plus its place in the group). */
static void remap_rows(struct epx_cpu_plan *p, const int64_t *map, const row_arrays_t *a) {
  size_t slots = (size_t)p->row_slots;
  for (int64_t i = 0; i < p->N; i++) {
    int64_t j = map[i];
    a->src_rank[j] = p->row_src_rank[i];
    a->src_token[j] = p->row_src_token[i];
    memcpy(a->expert + (size_t)j * slots, p->row_expert + (size_t)i * slots, slots * sizeof(int32_t));
    memcpy(a->weight + (size_t)j * slots, p->row_weight + (size_t)i * slots, slots * sizeof(float));
  }
  for (int64_t i = 0; i < p->T * p->K; i++)
    if (p->self_row[i] >= 0) p->self_row[i] = (int32_t)map[p->self_row[i]];
  int64_t entries = epx_cpu_total(p->rroute_count, p->W);
  for (int64_t e = 0; e < entries; e++) p->entry_row[e] = map[p->entry_row[e]];
}

static epx_status_t to_fixed_shape(epx_buffer_t b, epx_handle_t h, const char *fn) {
  struct epx_cpu_plan *p = h->cpu;
  fixed_shape_t shape = fixed_shape(p, b->max_tokens);
  int64_t N = shape.groups * shape.rows;
  int64_t *map = malloc(sizeof(int64_t) * (size_t)(p->N ? p->N : 1));
  int64_t *fill = calloc((size_t)shape.groups, sizeof(int64_t));
  row_arrays_t a = {0};
  epx_status_t status = map && fill ? row_arrays_new(&a, N, p->row_slots, fn)
                                    : epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  if (status == EPX_SUCCESS) {
    for (int64_t i = 0; i < p->N; i++) {
      int64_t g = group_of(p, i);
      map[i] = g * shape.rows + fill[g]++;
    }
    remap_rows(p, map, &a);
    row_arrays_t old = {p->row_src_rank, p->row_src_token, p->row_expert, p->row_weight};
    row_arrays_free(&old);
    p->row_src_rank = a.src_rank, p->row_src_token = a.src_token, p->row_expert = a.expert, p->row_weight = a.weight;
    if (p->layout == EPX_LAYOUT_EXPERT_MAJOR)
      for (int32_t e = 0; e <= p->E_local; e++) p->expert_offsets[e] = e * shape.rows;
    else
      p->expert_offsets[p->E_local] = N;
    p->bytes += (N - p->N) * (int64_t)(2 * sizeof(int32_t) + (size_t)p->row_slots * (sizeof(int32_t) + sizeof(float)));
    h->recv_rows = p->N = N;
    p->ll_fixed_shape = 1;
  }
  free(map);
  free(fill);
  return status;
}

/* recv_count: rows per local expert, or per source rank. */
static void write_counts(const struct epx_cpu_plan *p, int32_t *recv_count) {
  if (p->layout == EPX_LAYOUT_EXPERT_MAJOR) {
    for (int32_t e = 0; e < p->E_local; e++) recv_count[e] = (int32_t)p->expert_counts[e];
    return;
  }
  memset(recv_count, 0, sizeof(int32_t) * (size_t)p->W);
  for (int64_t i = 0; i < p->N; i++)
    if (p->row_src_rank[i] >= 0) recv_count[p->row_src_rank[i]]++;
}

/* The rows' call kind (the fp8 dispatches move a row and its scales together, cpu/fp8.c). */
static epx_call_kind_t rows_kind(const epx_ll_rows_t *rows) {
  if (!rows->fp8) return EPX_CALL_DISPATCH;
  return rows->x_scales ? EPX_CALL_DISPATCH_FP8 : EPX_CALL_DISPATCH_QUANTIZE;
}

static epx_status_t cpu_ll_dispatch_send(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t h,
                                         const epx_ll_rows_t *rows, int32_t *recv_count, const int32_t *num_tokens) {
  const char *fn = rows->fp8 ? "epx_ll_dispatch_fp8" : "epx_ll_dispatch";
  (void)num_tokens; /* read by the API: r->num_tokens is the count */
  epx_status_t status = epx_cpu_layout_as(b, r, local, h, fn);
  if (status == EPX_SUCCESS) status = to_fixed_shape(b, h, fn);
  /* After a layout every rank agreed, the rows' message follows on every
   * rank, carrying a later refusal (one rank out of memory) to its peers. A
   * layout whose first message failed failed on every rank alike (a rank
   * refused, or a peer is in another call): no message follows, so the
   * ranks stay in step; nor does one on a comm that failed. */
  if (status != EPX_SUCCESS) {
    if (h && h->cpu && h->cpu->agreed && !b->comm->failed)
      epx_cpu_call_exchange(b, rows_kind(rows), fn, status, NULL);
    return status;
  }
  status = rows->fp8 ? epx_cpu_dispatch_fp8(b, h, EPX_SUCCESS, rows->x, rows->x_scales, !rows->x_scales,
                                            rows->recv_x, rows->recv_scales)
                     : epx_cpu_dispatch_rows(b, h, EPX_SUCCESS, fn, EPX_CALL_DISPATCH, rows->x, rows->recv_x,
                                             h->cpu->row_bytes);
  if (status != EPX_SUCCESS) return status;
  if (recv_count) write_counts(h->cpu, recv_count);
  h->cpu->ll_pending = EPX_LL_DISPATCH;
  return EPX_SUCCESS;
}

static epx_status_t cpu_ll_combine_send(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *expert_out,
                                        void *out) {
  epx_status_t status = epx_cpu_combine_as(b, h, local, expert_out, out, "epx_ll_combine");
  if (status == EPX_SUCCESS) h->cpu->ll_pending = EPX_LL_COMBINE;
  return status;
}

static epx_ll_phase_t cpu_ll_pending(epx_handle_t h) { return (epx_ll_phase_t)h->cpu->ll_pending; }

static epx_status_t cpu_ll_complete(epx_buffer_t b, epx_handle_t h) {
  (void)b;
  h->cpu->ll_pending = EPX_LL_NONE;
  return EPX_SUCCESS;
}

const epx_ll_backend_t epx_cpu_ll_backend = {
    .dispatch_send = cpu_ll_dispatch_send,
    .combine_send = cpu_ll_combine_send,
    .pending = cpu_ll_pending,
    .complete = cpu_ll_complete,
};
