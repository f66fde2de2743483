/* The CPU exchange engine: the layout of a dispatch over W ranks, and the
 * payload moves that replay it (dispatch, combine and both backward passes).
 *
 * Vocabulary (one rank's view):
 *   route    a valid (token, k-slot) of a routing; goes to the rank that holds
 *            its expert (expert / E_local).
 *   item     a row sent in dispatch: one per (token, destination rank) with
 *            the dedup exchange, one per route with the collective exchange.
 *   pair     a (token, destination rank) with at least one route.
 *   arrival  a route as the receiver sees it: (source rank, token, k, expert,
 *            weight, location), ordered by source rank, then token, then k.
 * Rows a rank sends to itself never touch a staging buffer: they are copied
 * straight from x to recv_x (and back in combine). On a transport whose ranks
 * share the address space (the local one) no row is staged at all: a rank
 * reads its peers' rows in place, between a gather of their pointers and a
 * barrier; other transports (MPI) pack, exchange and unpack.
 *
 * Combine numerics (the contract in epx.h): per token, acc = 0; for each rank
 * r holding some of its routes, in ascending r: acc += P(t, r), where
 * P(t, r) = 0 + the token's products on r in k order; all float32, rounded
 * once. The dedup exchange over MPI computes P on the receiver and returns it
 * in float32; otherwise each route's row comes back and the token's rank
 * computes P with the same loop — so every path gives the same bits. */
#include <stdlib.h>
#include <string.h>

#include "core/transport.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cpu/cpu.h"

/* How expert outputs come back to the token's rank. */
typedef enum {
  RETURN_PARTIAL, /* one float32 row per pair: P(t, r) computed by the receiver (dedup) */
  RETURN_ROUTES,  /* one payload row per route (collective; or when the sender needs each row) */
  RETURN_PAIRS    /* one payload row per pair, already reduced by the caller (rank-major) */
} return_mode_t;

typedef struct {
  int32_t src, token, slot, expert, location;
  float weight;
} arrival_t;

struct epx_cpu_scratch {
  void *send;
  size_t send_bytes;
  void *recv;
  size_t recv_bytes;
  float *rows; /* a float32 row of H: the accumulator of a token's sum over ranks */
  size_t rows_bytes;
};

struct epx_cpu_plan {
  int32_t W, rank, K, E_local;
  int64_t T, H;
  size_t row_bytes;
  epx_dtype_t dtype;
  epx_layout_t layout;
  epx_exchange_t exchange;
  epx_weighting_t weighting;
  int32_t *topk_idx; /* [T, K] copy of the routing */
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
  int64_t *ritem_entry;  /* [R + 1] entries of staging row i */
  int64_t *rpair_entry;  /* [P + 1] entries of pair p */
  int64_t *entry_row;    /* [M] layout row of each remote entry */
  float *entry_weight;   /* [M] */
  int32_t *entry_slot;   /* [M] the route's k-slot at its source */
  /* The receive layout: */
  int64_t N;
  int64_t *expert_counts;  /* [E_local] rows before padding */
  int64_t *expert_offsets; /* [E_local + 1] */
  int32_t *row_src_rank, *row_src_token; /* [N], -1 = padding or empty slot */
  int32_t *row_expert;                   /* [N * row_slots] global expert ids, -1 elsewhere */
  float *row_weight;                     /* [N * row_slots] */
  int32_t row_slots;                     /* K for rank-major, else 1 */
  int64_t self_items;                    /* rows this rank sends itself (stats) */
  int64_t bytes;                         /* host bytes held by the plan */
};

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------ */

static void *plan_alloc(struct epx_cpu_plan *p, size_t bytes) {
  p->bytes += (int64_t)bytes;
  return calloc(bytes ? bytes : 1, 1);
}

static epx_status_t ensure(void **buf, size_t *have, size_t need, const char *fn) {
  if (need <= *have) return EPX_SUCCESS;
  void *grown = NULL;
  if (posix_memalign(&grown, 64, need)) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory (%zu bytes of staging)", fn, need);
  free(*buf);
  *buf = grown;
  *have = need;
  return EPX_SUCCESS;
}

static epx_status_t scratch(epx_buffer_t b, const char *fn, struct epx_cpu_scratch **out) {
  if (!b->cpu) {
    b->cpu = calloc(1, sizeof *b->cpu);
    if (!b->cpu) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  *out = b->cpu;
  return ensure((void **)&b->cpu->rows, &b->cpu->rows_bytes, (size_t)b->config.hidden * sizeof(float), fn);
}

static void displs(const int64_t *count, int64_t *displ, int32_t n) {
  int64_t sum = 0;
  for (int32_t i = 0; i < n; i++) {
    displ[i] = sum;
    sum += count[i];
  }
}

static int64_t total(const int64_t *count, int32_t n) {
  int64_t sum = 0;
  for (int32_t i = 0; i < n; i++) sum += count[i];
  return sum;
}

/* The metadata record of an item: token, then K expert ids (-1 for slots not
 * in this item), K weights (as bits), K locations. */
static size_t record_ints(int32_t K) { return 1 + 3 * (size_t)K; }

/* ------------------------------------------------------------------------ */
/* Validation                                                                */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cpu_validate_routing(epx_buffer_t b, const epx_routing_t *r) {
  const char *fn = "epx_dispatch_layout";
  int32_t E = b->config.num_experts, K = r->top_k;
  int capacity_layout = b->config.layout == EPX_LAYOUT_CAPACITY;
  int64_t C = b->config.capacity;
  int64_t *seen = malloc(sizeof(int64_t) * (size_t)E);
  uint8_t *slot_taken = capacity_layout ? calloc((size_t)(E * C + 7) / 8, 1) : NULL;
  epx_status_t status = EPX_SUCCESS;
  if (!seen || (capacity_layout && !slot_taken)) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t e = 0; e < E; e++) seen[e] = -1;
  for (int64_t t = 0; t < r->num_tokens; t++) {
    for (int32_t k = 0; k < K; k++) {
      int32_t e = r->topk_idx[t * K + k];
      if (e == -1) continue;
      if (e < -1 || e >= E)
        EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                 "%s: routing.topk_idx[%lld][%d] is %d, outside [-1, num_experts = %d); use -1 for "
                 "no expert", fn, (long long)t, k, e, E);
      if (seen[e] == t)
        EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                 "%s: routing.topk_idx[%lld] names expert %d twice; a token picks each expert at most once",
                 fn, (long long)t, e);
      seen[e] = t;
      if (capacity_layout) {
        int32_t l = r->locations[t * K + k];
        if (l < 0 || l >= C)
          EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: routing.locations[%lld][%d] is %d, outside the capacity [0, %lld); drop the "
                   "route (topk_idx = -1) or raise config.capacity", fn, (long long)t, k, l, (long long)C);
        int64_t bit = (int64_t)e * C + l;
        if (slot_taken[bit / 8] & (1u << (bit % 8)))
          EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: routing.locations[%lld][%d] = %d is taken twice for expert %d; locations must be "
                   "unique per expert (use epx_route's)", fn, (long long)t, k, l, e);
        slot_taken[bit / 8] |= (uint8_t)(1u << (bit % 8));
      }
    }
  }
fail:
  free(seen);
  free(slot_taken);
  return status;
}

/* ------------------------------------------------------------------------ */
/* Layout                                                                    */
/* ------------------------------------------------------------------------ */

void epx_cpu_handle_fini(epx_handle_t handle) {
  struct epx_cpu_plan *p = handle->cpu;
  if (!p) return;
  void *arrays[] = {p->topk_idx, p->topk_w, p->self_row, p->item_count, p->item_displ,
                    p->route_count, p->route_displ, p->pair_count, p->pair_displ, p->item_token,
                    p->ritem_count, p->ritem_displ, p->rroute_count, p->rroute_displ,
                    p->rpair_count, p->rpair_displ, p->ritem_entry, p->rpair_entry, p->entry_row,
                    p->entry_weight, p->entry_slot, p->expert_counts, p->expert_offsets, p->row_src_rank,
                    p->row_src_token, p->row_expert, p->row_weight};
  for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) free(arrays[i]);
  free(p);
  handle->cpu = NULL;
}

void epx_cpu_buffer_fini(epx_buffer_t buffer) {
  if (!buffer->cpu) return;
  free(buffer->cpu->send);
  free(buffer->cpu->recv);
  free(buffer->cpu->rows);
  free(buffer->cpu);
  buffer->cpu = NULL;
}

int64_t epx_cpu_handle_bytes(epx_handle_t handle) { return handle->cpu ? handle->cpu->bytes : 0; }

epx_status_t epx_cpu_dispatch_layout(epx_buffer_t b, const epx_routing_t *r, epx_handle_t handle) {
  const char *fn = "epx_dispatch_layout";
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t comm = b->comm;
  int32_t W = b->world_size, K = r->top_k, El = b->experts_per_rank, self = b->rank;
  int64_t T = r->num_tokens;
  int32_t *send_records = NULL, *recv_records = NULL, *last_token = NULL;
  arrival_t *arrivals = NULL;
  int64_t *fill = NULL;
  struct epx_cpu_plan *p = calloc(1, sizeof *p);
  if (!p) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  handle->cpu = p;
  p->W = W, p->rank = self, p->K = K, p->E_local = El, p->T = T, p->H = b->config.hidden;
  p->dtype = b->config.dtype;
  p->row_bytes = (size_t)p->H * epx_dtype_size(p->dtype);
  p->layout = b->config.layout;
  p->exchange = b->config.exchange;
  p->weighting = r->weighting;
  p->row_slots = p->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;

  size_t TK = (size_t)(T * K), Wn = (size_t)W;
  p->topk_idx = plan_alloc(p, TK * sizeof(int32_t));
  p->topk_w = plan_alloc(p, TK * sizeof(float));
  p->self_row = plan_alloc(p, TK * sizeof(int32_t));
  int64_t **per_rank[] = {&p->item_count, &p->item_displ, &p->route_count, &p->route_displ,
                          &p->pair_count, &p->pair_displ, &p->ritem_count, &p->ritem_displ,
                          &p->rroute_count, &p->rroute_displ, &p->rpair_count, &p->rpair_displ};
  for (size_t i = 0; i < sizeof per_rank / sizeof per_rank[0]; i++) {
    *per_rank[i] = plan_alloc(p, (Wn + 1) * sizeof(int64_t));
    if (!*per_rank[i]) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  last_token = malloc(Wn * sizeof(int32_t));
  if (!p->topk_idx || !p->topk_w || !p->self_row || !last_token)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  if (TK) memcpy(p->topk_idx, r->topk_idx, TK * sizeof(int32_t));
  if (TK && r->topk_w) memcpy(p->topk_w, r->topk_w, TK * sizeof(float));

  /* Count what goes to each rank. */
  for (int32_t d = 0; d < W; d++) last_token[d] = -1;
  for (int64_t t = 0; t < T; t++) {
    for (int32_t k = 0; k < K; k++) {
      int32_t e = p->topk_idx[t * K + k];
      if (e < 0) continue;
      int32_t d = e / El;
      p->route_count[d]++;
      if (last_token[d] != t) {
        last_token[d] = (int32_t)t;
        p->pair_count[d]++;
      }
    }
  }
  p->self_items = p->exchange == EPX_EXCHANGE_DEDUP ? p->pair_count[self] : p->route_count[self];
  p->route_count[self] = p->pair_count[self] = 0;
  for (int32_t d = 0; d < W; d++)
    p->item_count[d] = p->exchange == EPX_EXCHANGE_DEDUP ? p->pair_count[d] : p->route_count[d];
  displs(p->item_count, p->item_displ, W);
  displs(p->route_count, p->route_displ, W);
  displs(p->pair_count, p->pair_displ, W);
  int64_t items = total(p->item_count, W);

  /* Items and their metadata records, per destination in token order. */
  size_t rec = record_ints(K);
  p->item_token = plan_alloc(p, (size_t)items * sizeof(int32_t));
  send_records = malloc((size_t)(items ? items : 1) * rec * sizeof(int32_t));
  fill = calloc(Wn, sizeof(int64_t));
  if (!p->item_token || !send_records || !fill) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t d = 0; d < W; d++) last_token[d] = -1;
  for (int64_t t = 0; t < T; t++) {
    for (int32_t k = 0; k < K; k++) {
      int32_t e = p->topk_idx[t * K + k];
      if (e < 0 || e / El == self) continue;
      int32_t d = e / El;
      int64_t item;
      if (p->exchange == EPX_EXCHANGE_COLLECTIVE || last_token[d] != t) {
        item = p->item_displ[d] + fill[d]++;
        last_token[d] = (int32_t)t;
        p->item_token[item] = (int32_t)t;
        int32_t *record = send_records + (size_t)item * rec;
        record[0] = (int32_t)t;
        for (int32_t j = 0; j < K; j++) record[1 + j] = -1;
      } else {
        item = p->item_displ[d] + fill[d] - 1;
      }
      int32_t *record = send_records + (size_t)item * rec;
      record[1 + k] = e;
      memcpy(&record[1 + K + k], &p->topk_w[t * K + k], sizeof(float));
      record[1 + 2 * K + k] = r->locations ? r->locations[t * K + k] : -1;
    }
  }

  /* The count exchange, then the metadata. */
  EPX_CHECK(comm->ops->alltoall(comm, fn, p->item_count, p->ritem_count, sizeof(int64_t)));
  p->ritem_count[self] = 0;
  displs(p->ritem_count, p->ritem_displ, W);
  int64_t ritems = total(p->ritem_count, W);
  recv_records = malloc((size_t)(ritems ? ritems : 1) * rec * sizeof(int32_t));
  if (!recv_records) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  EPX_CHECK(comm->ops->alltoallv(comm, fn, send_records, p->item_count, p->item_displ, recv_records,
                                 p->ritem_count, p->ritem_displ, rec * sizeof(int32_t)));

  /* Arrivals in (source rank, token, k) order, own routes included. */
  int64_t self_routes = 0;
  for (int64_t i = 0; i < (int64_t)TK; i++)
    self_routes += p->topk_idx[i] >= 0 && p->topk_idx[i] / El == self;
  int64_t remote_routes = 0;
  for (int64_t i = 0; i < ritems; i++)
    for (int32_t k = 0; k < K; k++) remote_routes += recv_records[(size_t)i * rec + 1 + (size_t)k] >= 0;
  int64_t A = self_routes + remote_routes;
  arrivals = malloc((size_t)(A ? A : 1) * sizeof *arrivals);
  p->ritem_entry = plan_alloc(p, (size_t)(ritems + 1) * sizeof(int64_t));
  p->entry_row = plan_alloc(p, (size_t)(remote_routes ? remote_routes : 1) * sizeof(int64_t));
  p->entry_weight = plan_alloc(p, (size_t)(remote_routes ? remote_routes : 1) * sizeof(float));
  p->entry_slot = plan_alloc(p, (size_t)(remote_routes ? remote_routes : 1) * sizeof(int32_t));
  if (!arrivals || !p->ritem_entry || !p->entry_row || !p->entry_weight || !p->entry_slot)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  int64_t a = 0, entry = 0;
  for (int32_t s = 0; s < W; s++) {
    if (s == self) {
      for (int64_t t = 0; t < T; t++)
        for (int32_t k = 0; k < K; k++) {
          int32_t e = p->topk_idx[t * K + k];
          if (e < 0 || e / El != self) continue;
          arrivals[a++] = (arrival_t){s, (int32_t)t, k, e, r->locations ? r->locations[t * K + k] : -1,
                                      p->topk_w[t * K + k]};
        }
      continue;
    }
    for (int64_t i = p->ritem_displ[s]; i < p->ritem_displ[s] + p->ritem_count[s]; i++) {
      const int32_t *record = recv_records + (size_t)i * rec;
      p->ritem_entry[i] = entry;
      for (int32_t k = 0; k < K; k++) {
        if (record[1 + k] < 0) continue;
        float w;
        memcpy(&w, &record[1 + K + k], sizeof w);
        arrivals[a++] = (arrival_t){s, record[0], k, record[1 + k], record[1 + 2 * K + k], w};
        entry++;
      }
    }
  }
  p->ritem_entry[ritems] = entry;

  /* Per-source route and pair counts as the receiver sees them. */
  int64_t pairs = 0;
  for (int64_t i = 0; i < A; i++) {
    const arrival_t *x = &arrivals[i];
    int new_pair = i == 0 || x->src != arrivals[i - 1].src || x->token != arrivals[i - 1].token;
    pairs += new_pair;
    if (x->src == self) continue;
    p->rroute_count[x->src]++;
    p->rpair_count[x->src] += new_pair;
  }
  displs(p->rroute_count, p->rroute_displ, W);
  displs(p->rpair_count, p->rpair_displ, W);
  int64_t rpairs = total(p->rpair_count, W);
  p->rpair_entry = plan_alloc(p, (size_t)(rpairs + 1) * sizeof(int64_t));
  if (!p->rpair_entry) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);

  /* Rows of the receive layout. */
  p->expert_counts = plan_alloc(p, (size_t)El * sizeof(int64_t));
  p->expert_offsets = plan_alloc(p, (size_t)(El + 1) * sizeof(int64_t));
  if (!p->expert_counts || !p->expert_offsets) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  int64_t C = b->config.capacity, first_expert = (int64_t)self * El;
  for (int64_t i = 0; i < A; i++) p->expert_counts[arrivals[i].expert - first_expert]++;
  switch (p->layout) {
    case EPX_LAYOUT_EXPERT_MAJOR: {
      int64_t align = b->config.expert_alignment, sum = 0;
      for (int32_t e = 0; e < El; e++) {
        p->expert_offsets[e] = sum;
        sum += (p->expert_counts[e] + align - 1) / align * align;
      }
      p->N = p->expert_offsets[El] = sum;
      break;
    }
    case EPX_LAYOUT_CAPACITY:
      for (int32_t e = 0; e <= El; e++) p->expert_offsets[e] = (int64_t)e * W * C;
      p->N = (int64_t)El * W * C;
      break;
    case EPX_LAYOUT_RANK_MAJOR:
      p->N = p->expert_offsets[El] = pairs;
      break;
  }
  size_t Nn = (size_t)p->N, slots = (size_t)p->row_slots;
  p->row_src_rank = plan_alloc(p, Nn * sizeof(int32_t));
  p->row_src_token = plan_alloc(p, Nn * sizeof(int32_t));
  p->row_expert = plan_alloc(p, Nn * slots * sizeof(int32_t));
  p->row_weight = plan_alloc(p, Nn * slots * sizeof(float));
  if (!p->row_src_rank || !p->row_src_token || !p->row_expert || !p->row_weight)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (size_t i = 0; i < Nn; i++) p->row_src_rank[i] = p->row_src_token[i] = -1;
  for (size_t i = 0; i < Nn * slots; i++) p->row_expert[i] = -1;
  for (size_t i = 0; i < TK; i++) p->self_row[i] = -1;
  free(fill);
  fill = calloc((size_t)El, sizeof(int64_t));
  if (!fill) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  int64_t pair = -1, rpair = -1;
  entry = 0;
  for (int64_t i = 0; i < A; i++) {
    const arrival_t *x = &arrivals[i];
    int new_pair = i == 0 || x->src != arrivals[i - 1].src || x->token != arrivals[i - 1].token;
    pair += new_pair;
    int32_t e = x->expert - (int32_t)first_expert;
    int64_t row;
    if (p->layout == EPX_LAYOUT_EXPERT_MAJOR) row = p->expert_offsets[e] + fill[e]++;
    else if (p->layout == EPX_LAYOUT_CAPACITY) row = (int64_t)e * W * C + (int64_t)x->src * C + x->location;
    else row = pair;
    p->row_src_rank[row] = x->src;
    p->row_src_token[row] = x->token;
    size_t slot = p->layout == EPX_LAYOUT_RANK_MAJOR ? (size_t)row * slots + (size_t)x->slot : (size_t)row;
    p->row_expert[slot] = x->expert;
    p->row_weight[slot] = x->weight;
    if (x->src == self) {
      p->self_row[(size_t)x->token * (size_t)K + (size_t)x->slot] = (int32_t)row;
    } else {
      if (new_pair) p->rpair_entry[++rpair] = entry;
      p->entry_row[entry] = row;
      p->entry_weight[entry] = x->weight;
      p->entry_slot[entry] = x->slot;
      entry++;
    }
  }
  p->rpair_entry[rpairs] = entry;
  handle->recv_rows = p->N;

fail:
  free(send_records);
  free(recv_records);
  free(last_token);
  free(arrivals);
  free(fill);
  return status;
}

/* ------------------------------------------------------------------------ */
/* Forward moves: x [T, H] -> layout [N, H]                                  */
/* ------------------------------------------------------------------------ */

static void zero_empty_rows(const struct epx_cpu_plan *p, void *rows) {
  for (int64_t i = 0; i < p->N; i++)
    if (p->row_src_rank[i] < 0) memset((char *)rows + (size_t)i * p->row_bytes, 0, p->row_bytes);
}

/* Copies (or scales by the route's weight) one row into the layout. */
static void put_row(const struct epx_cpu_plan *p, const void *src, float weight, int weighted, void *dst) {
  if (weighted) epx_row_scale_stream(p->dtype, src, weight, dst, p->H);
  else epx_row_copy_stream(dst, src, p->row_bytes);
}

/* Whether one rank splits its tokens over the cores: only with enough work
 * to pay for waking them (an OpenMP region costs microseconds when the cores
 * are idle, and up to a scheduler time slice, milliseconds, when they are
 * busy — measured 25-75 ms per 12-token step, and 20 ms for a 0.1 ms
 * dispatch of 1024 x 256, on a loaded 2-core machine). From 1M elements
 * (4 MB of f32 rows) a call takes a millisecond or more alone. */
static int split_tokens(const struct epx_cpu_plan *p) { return p->W == 1 && p->T * p->H >= ((int64_t)1 << 20); }

/* What a rank shows its peers on a shared-address-space transport. */
typedef struct {
  const void *rows;                /* the rows peers read from */
  const struct epx_cpu_plan *plan; /* its layout, to find where each row is */
} published_t;

static int reads_peers_in_place(const struct epx_cpu_plan *p, epx_comm_t comm) {
  return p->W > 1 && comm->ops->shared_address_space;
}

/* Sends src's rows to the layout of every rank; weighted: scale each copy by
 * its route's weight. item_rows (optional, caller frees): where each staged
 * item's row is — in this rank's staging, or, read in place, in the
 * source's src (valid until the source's call returns). */
static epx_status_t move_forward(epx_buffer_t b, struct epx_cpu_plan *p, const void *src, void *dst,
                                 int weighted, const char *fn, const void ***item_rows) {
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t comm = b->comm;
  struct epx_cpu_scratch *s = NULL;
  published_t *peers = NULL;
  int64_t items = total(p->item_count, p->W), ritems = total(p->ritem_count, p->W);
  int in_place = reads_peers_in_place(p, comm);
  const void **item_src = malloc(sizeof(void *) * (size_t)(ritems ? ritems : 1));
  if (!item_src) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  EPX_CHECK(scratch(b, fn, &s));
  if (in_place) {
    peers = malloc(sizeof *peers * (size_t)p->W);
    if (!peers) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
    published_t mine = {src, p};
    EPX_CHECK(comm->ops->allgather(comm, fn, &mine, peers, sizeof mine));
    for (int32_t r = 0; r < p->W; r++) {
      if (r == p->rank) continue;
      const struct epx_cpu_plan *q = peers[r].plan;
      const int32_t *tokens = q->item_token + q->item_displ[p->rank];
      for (int64_t i = 0; i < p->ritem_count[r]; i++)
        item_src[p->ritem_displ[r] + i] = (const char *)peers[r].rows + (size_t)tokens[i] * p->row_bytes;
    }
  } else if (p->W > 1) {
    EPX_CHECK(ensure(&s->send, &s->send_bytes, (size_t)items * p->row_bytes, fn));
    EPX_CHECK(ensure(&s->recv, &s->recv_bytes, (size_t)ritems * p->row_bytes, fn));
    for (int64_t i = 0; i < items; i++)
      memcpy((char *)s->send + (size_t)i * p->row_bytes,
             (const char *)src + (size_t)p->item_token[i] * p->row_bytes, p->row_bytes);
    EPX_CHECK(comm->ops->alltoallv(comm, fn, s->send, p->item_count, p->item_displ, s->recv,
                                   p->ritem_count, p->ritem_displ, p->row_bytes));
    for (int64_t i = 0; i < ritems; i++) item_src[i] = (const char *)s->recv + (size_t)i * p->row_bytes;
  }
  zero_empty_rows(p, dst);
  int rank_major = p->layout == EPX_LAYOUT_RANK_MAJOR;
  /* Tokens are independent; one rank alone may use every core. */
#pragma omp parallel for schedule(static) if (split_tokens(p))
  for (int64_t t = 0; t < p->T; t++) {
    const char *x = (const char *)src + (size_t)t * p->row_bytes;
    int32_t written = -1;
    for (int32_t k = 0; k < p->K; k++) {
      int32_t row = p->self_row[t * p->K + k];
      if (row < 0 || (rank_major && row == written)) continue;
      put_row(p, x, p->topk_w[t * p->K + k], weighted, (char *)dst + (size_t)row * p->row_bytes);
      written = row;
    }
  }
  for (int64_t i = 0; i < ritems; i++) {
    for (int64_t j = p->ritem_entry[i]; j < p->ritem_entry[i + 1]; j++) {
      if (rank_major && j > p->ritem_entry[i]) break;
      put_row(p, item_src[i], p->entry_weight[j], weighted, (char *)dst + (size_t)p->entry_row[j] * p->row_bytes);
    }
  }
  epx_stream_fence();
  /* Peers may reuse their src once every rank has read it. */
  if (in_place) EPX_CHECK(comm->ops->barrier(comm, fn));
  if (item_rows) {
    *item_rows = item_src;
    item_src = NULL;
  }
fail:
  free(item_src);
  free(peers);
  return status;
}

epx_status_t epx_cpu_dispatch(epx_buffer_t b, epx_handle_t h, const void *x, void *recv_x) {
  struct epx_cpu_plan *p = h->cpu;
  return move_forward(b, p, x, recv_x, p->weighting == EPX_WEIGHTS_IN_DISPATCH, "epx_dispatch", NULL);
}

/* ------------------------------------------------------------------------ */
/* Backward moves: layout [N, H] -> out [T, H]                               */
/* ------------------------------------------------------------------------ */

typedef struct {
  const struct epx_cpu_plan *p;
  const void *rows;         /* the layout [N, H] */
  const void *const *home;  /* each returned row, per rank from sdispl */
  return_mode_t mode;
  int weighted;
  const void *dot_x; /* [T, H] or NULL */
  float *grad_w;     /* [T, K] or NULL */
  void *out;         /* [T, H] */
} token_pass_t;

/* out[t] = round(sum over ranks in order of P(t, r)). */
static void combine_token(const token_pass_t *c, int64_t t, int64_t *cursor, float *acc,
                          const void **group_rows, float *group_w) {
  const struct epx_cpu_plan *p = c->p;
  int32_t K = p->K, self = p->rank;
  int64_t H = p->H;
  const int32_t *idx = p->topk_idx + t * K;
  const float *w = p->topk_w + t * K;
  const char *x = c->dot_x ? (const char *)c->dot_x + (size_t)t * p->row_bytes : NULL;
  int first = 1;
  if (c->grad_w)
    for (int32_t k = 0; k < K; k++) c->grad_w[t * K + k] = 0.0f;
  /* A token whose routes all sit on one rank (always, with one rank) is one
   * group: out = round(0 + P) in a single pass. */
  int32_t only_rank = -1;
  for (int32_t k = 0; k < K; k++) {
    if (idx[k] < 0) continue;
    int32_t r = idx[k] / p->E_local;
    only_rank = only_rank == -1 || only_rank == r ? r : -2;
  }
  for (int32_t r = 0; r < p->W; r++) {
    int32_t n = 0;
    for (int32_t k = 0; k < K; k++) {
      if (idx[k] < 0 || idx[k] / p->E_local != r) continue;
      if (r != self && c->mode != RETURN_ROUTES) {
        /* One returned row stands for the pair. */
        if (n == 0) group_rows[n++] = c->home[cursor[r]++];
        continue;
      }
      if (c->mode == RETURN_PAIRS && n > 0) continue;
      const void *row = r == self ? (const char *)c->rows + (size_t)p->self_row[t * K + k] * p->row_bytes
                                  : c->home[cursor[r]++];
      group_rows[n] = row;
      group_w[n++] = w[k];
      if (c->grad_w) c->grad_w[t * K + k] = epx_row_dot(p->dtype, row, x, H);
    }
    if (n == 0) continue;
    const float *weights = c->weighted && c->mode != RETURN_PAIRS ? group_w : NULL;
    void *out_row = (char *)c->out + (size_t)t * p->row_bytes;
    if (r != self && c->mode == RETURN_PARTIAL) {
      epx_rows_accumulate(EPX_FLOAT32, group_rows, NULL, 1, acc, first, H);
    } else if (only_rank == r) {
      epx_rows_sum_store(p->dtype, group_rows, weights, n, out_row, H);
      return;
    } else {
      epx_rows_accumulate(p->dtype, group_rows, weights, n, acc, first, H);
    }
    first = 0;
  }
  if (first) memset(acc, 0, (size_t)H * sizeof(float));
  epx_row_from_f32_stream(p->dtype, acc, (char *)c->out + (size_t)t * p->row_bytes, H);
}

/* rows from layout, combined per token in the canonical order. weighted:
 * multiply each route's row by its weight. dot_x / grad_w: also give
 * grad_w[t,k] = <row(t,k), dot_x[t]> (needs RETURN_ROUTES). */
static epx_status_t move_backward(epx_buffer_t b, struct epx_cpu_plan *p, const void *rows, void *out,
                                  int weighted, const void *dot_x, float *grad_w, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t comm = b->comm;
  struct epx_cpu_scratch *s = NULL;
  int64_t cursor_stack[64];
  int64_t *cursor = cursor_stack;
  const void **group_rows = NULL; /* the rows of one P(t, r) */
  float *group_w = NULL;
  const void **home = NULL;       /* where each row coming home is */
  published_t *peers = NULL;
  int in_place = reads_peers_in_place(p, comm);
  EPX_CHECK(scratch(b, fn, &s));
  int32_t W = p->W, K = p->K;
  int64_t H = p->H;
  /* Reading peers in place, summing a pair on its receiver first would only
   * add a pass: the token's rank reads the rows themselves (same sums). */
  return_mode_t mode = p->layout == EPX_LAYOUT_RANK_MAJOR ? RETURN_PAIRS
                       : (p->exchange == EPX_EXCHANGE_COLLECTIVE || grad_w || in_place) ? RETURN_ROUTES
                                                                                        : RETURN_PARTIAL;
  size_t unit = mode == RETURN_PARTIAL ? (size_t)H * sizeof(float) : p->row_bytes;
  const int64_t *rcount = mode == RETURN_ROUTES ? p->rroute_count : p->rpair_count;
  const int64_t *rdispl = mode == RETURN_ROUTES ? p->rroute_displ : p->rpair_displ;
  const int64_t *scount = mode == RETURN_ROUTES ? p->route_count : p->pair_count;
  const int64_t *sdispl = mode == RETURN_ROUTES ? p->route_displ : p->pair_displ;
  int64_t back_rows = total(rcount, W), home_rows = total(scount, W);
  if (W > 64) cursor = malloc(sizeof(int64_t) * (size_t)W);
  group_rows = malloc(sizeof(void *) * (size_t)K);
  group_w = malloc(sizeof(float) * (size_t)K);
  if (!cursor || !group_rows || !group_w) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);

  home = malloc(sizeof(void *) * (size_t)(home_rows ? home_rows : 1));
  if (!home) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  if (W > 1) {
    /* The receiver's side: the dedup exchange sums each pair here. */
    int64_t rpairs = total(p->rpair_count, W);
    if (mode == RETURN_PARTIAL) {
      EPX_CHECK(ensure(&s->send, &s->send_bytes, (size_t)back_rows * unit, fn));
      for (int64_t q = 0; q < rpairs; q++) {
        int32_t n = 0;
        for (int64_t j = p->rpair_entry[q]; j < p->rpair_entry[q + 1]; j++) {
          group_rows[n] = (const char *)rows + (size_t)p->entry_row[j] * p->row_bytes;
          group_w[n++] = p->entry_weight[j];
        }
        epx_rows_accumulate(p->dtype, group_rows, weighted ? group_w : NULL, n,
                            (float *)((char *)s->send + (size_t)q * unit), 1, H);
      }
    }
    if (in_place) {
      /* Each returned row read where the peer has it, in its layout (the
       * mode is never RETURN_PARTIAL here). */
      peers = malloc(sizeof *peers * (size_t)W);
      if (!peers) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
      published_t mine = {rows, p};
      EPX_CHECK(comm->ops->allgather(comm, fn, &mine, peers, sizeof mine));
      for (int32_t r = 0; r < W; r++) {
        if (r == p->rank) continue;
        const struct epx_cpu_plan *q = peers[r].plan;
        const char *their_rows = peers[r].rows;
        for (int64_t j = 0; j < scount[r]; j++) {
          int64_t entry = mode == RETURN_ROUTES ? q->rroute_displ[p->rank] + j
                                                : q->rpair_entry[q->rpair_displ[p->rank] + j];
          home[sdispl[r] + j] = their_rows + (size_t)q->entry_row[entry] * p->row_bytes;
        }
      }
    } else {
      EPX_CHECK(ensure(&s->recv, &s->recv_bytes, (size_t)home_rows * unit, fn));
      if (mode != RETURN_PARTIAL) {
        EPX_CHECK(ensure(&s->send, &s->send_bytes, (size_t)back_rows * unit, fn));
        for (int64_t j = 0; j < back_rows; j++) {
          int64_t entry = mode == RETURN_ROUTES ? j : p->rpair_entry[j];
          memcpy((char *)s->send + (size_t)j * unit, (const char *)rows + (size_t)p->entry_row[entry] * p->row_bytes, unit);
        }
      }
      EPX_CHECK(comm->ops->alltoallv(comm, fn, s->send, rcount, rdispl, s->recv, scount, sdispl, unit));
      for (int64_t j = 0; j < home_rows; j++) home[j] = (const char *)s->recv + (size_t)j * unit;
    }
  }

  /* The token's side. With one rank every row is local and tokens are
   * independent, so they are split over the cores; otherwise the returned
   * rows are consumed in token order through the per-rank cursors. */
  for (int32_t r = 0; r < W; r++) cursor[r] = sdispl[r];
  token_pass_t pass = {p, rows, home, mode, weighted, dot_x, grad_w, out};
  if (split_tokens(p)) {
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
      float *acc = malloc(sizeof(float) * (size_t)H);
      const void **rows_of = malloc(sizeof(void *) * (size_t)K);
      float *w_of = malloc(sizeof(float) * (size_t)K);
      failed = !acc || !rows_of || !w_of;
      /* Every thread must reach the worksharing loop (a thread that skips
       * it leaves the others at its barrier); one without scratch idles. */
#pragma omp for schedule(static)
      for (int64_t t = 0; t < p->T; t++)
        if (!failed) combine_token(&pass, t, cursor, acc, rows_of, w_of);
      free(acc);
      free(rows_of);
      free(w_of);
    }
    if (failed) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  } else {
    for (int64_t t = 0; t < p->T; t++) combine_token(&pass, t, cursor, s->rows, group_rows, group_w);
  }
  epx_stream_fence();
  /* Peers may reuse their rows once every rank has read them. */
  if (in_place) EPX_CHECK(comm->ops->barrier(comm, fn));
fail:
  if (cursor != cursor_stack) free(cursor);
  free(group_rows);
  free(group_w);
  free(home);
  free(peers);
  return status;
}

epx_status_t epx_cpu_combine(epx_buffer_t b, epx_handle_t h, const void *expert_out, void *out) {
  struct epx_cpu_plan *p = h->cpu;
  return move_backward(b, p, expert_out, out, p->weighting == EPX_WEIGHTS_IN_COMBINE, NULL, NULL, "epx_combine");
}

epx_status_t epx_cpu_dispatch_backward(epx_buffer_t b, epx_handle_t h, const void *grad_recv_x,
                                       void *grad_x, const void *x, float *grad_w) {
  struct epx_cpu_plan *p = h->cpu;
  return move_backward(b, p, grad_recv_x, grad_x, p->weighting == EPX_WEIGHTS_IN_DISPATCH, x, grad_w,
                       "epx_dispatch_backward");
}

/* Sends one float per remote route back to the route's source (back[j] for
 * this rank's remote entry j) and stores each at grad_w[t, k] of the
 * source's routes on other ranks, in token order. Local routes' values are
 * the caller's. */
static epx_status_t return_route_values(epx_buffer_t b, const struct epx_cpu_plan *p, const float *back,
                                        float *grad_w, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  int32_t W = p->W, K = p->K;
  if (W == 1) return EPX_SUCCESS;
  int64_t home_count = total(p->route_count, W);
  float *home = malloc(sizeof(float) * (size_t)(home_count ? home_count : 1));
  int64_t cursor_stack[64];
  int64_t *cursor = W > 64 ? malloc(sizeof(int64_t) * (size_t)W) : cursor_stack;
  if (!home || !cursor) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  EPX_CHECK(b->comm->ops->alltoallv(b->comm, fn, back, p->rroute_count, p->rroute_displ, home, p->route_count,
                                    p->route_displ, sizeof(float)));
  for (int32_t r = 0; r < W; r++) cursor[r] = p->route_displ[r];
  for (int64_t t = 0; t < p->T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = p->topk_idx[t * K + k];
      if (e >= 0 && e / p->E_local != p->rank) grad_w[t * K + k] = home[cursor[e / p->E_local]++];
    }
fail:
  if (cursor != cursor_stack) free(cursor);
  free(home);
  return status;
}

/* grad_expert_out(t,k) = w * grad_out[t] (a dispatch of grad_out), and the
 * weight gradient <grad_out[t], expert_out(t,k)> computed where expert_out
 * lives, then returned one float per route. */
epx_status_t epx_cpu_combine_backward(epx_buffer_t b, epx_handle_t h, const void *grad_out,
                                      const void *expert_out, void *grad_expert_out, float *grad_w) {
  const char *fn = "epx_combine_backward";
  struct epx_cpu_plan *p = h->cpu;
  epx_status_t status = EPX_SUCCESS;
  float *back = NULL;
  const void **staged = NULL; /* each received grad_out row (peers' rows stay valid: they
                                 are in this same call until the exchange below) */
  EPX_CHECK(move_forward(b, p, grad_out, grad_expert_out, p->weighting == EPX_WEIGHTS_IN_COMBINE, fn,
                         grad_w ? &staged : NULL));
  if (!grad_w) return EPX_SUCCESS;
  int32_t K = p->K;
  int64_t back_count = total(p->rroute_count, p->W);
  back = malloc(sizeof(float) * (size_t)(back_count ? back_count : 1));
  if (!back) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  int64_t ritems = total(p->ritem_count, p->W);
  for (int64_t i = 0; i < ritems; i++) {
    const void *g = staged[i];
    for (int64_t j = p->ritem_entry[i]; j < p->ritem_entry[i + 1]; j++)
      back[j] = epx_row_dot(p->dtype, g, (const char *)expert_out + (size_t)p->entry_row[j] * p->row_bytes, p->H);
  }
  /* Local routes' dots (independent per token), then the returned ones. */
#pragma omp parallel for schedule(static) if (split_tokens(p))
  for (int64_t t = 0; t < p->T; t++) {
    const char *g = (const char *)grad_out + (size_t)t * p->row_bytes;
    for (int32_t k = 0; k < K; k++) {
      int32_t row = p->self_row[t * K + k];
      grad_w[t * K + k] =
          row >= 0 ? epx_row_dot(p->dtype, g, (const char *)expert_out + (size_t)row * p->row_bytes, p->H) : 0.0f;
    }
  }
  EPX_CHECK(return_route_values(b, p, back, grad_w, fn));
fail:
  free(back);
  free(staged);
  return status;
}

/* The gradient of weights the expert applied itself: each route's value
 * where its row lives ([N] or, rank-major, [N, K] by source slot), returned
 * to grad_w[t, k] of its source. */
epx_status_t epx_cpu_weights_backward(epx_buffer_t b, epx_handle_t h, const float *grad_recv_w, float *grad_w) {
  const char *fn = "epx_weights_backward";
  struct epx_cpu_plan *p = h->cpu;
  epx_status_t status = EPX_SUCCESS;
  int32_t K = p->K, slots = p->row_slots;
  int64_t back_count = total(p->rroute_count, p->W);
  float *back = malloc(sizeof(float) * (size_t)(back_count ? back_count : 1));
  if (!back) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int64_t j = 0; j < back_count; j++)
    back[j] = grad_recv_w[p->entry_row[j] * slots + (slots > 1 ? p->entry_slot[j] : 0)];
  for (int64_t t = 0; t < p->T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t row = p->self_row[t * K + k];
      grad_w[t * K + k] = row >= 0 ? grad_recv_w[(int64_t)row * slots + (slots > 1 ? k : 0)] : 0.0f;
    }
  EPX_CHECK(return_route_values(b, p, back, grad_w, fn));
fail:
  free(back);
  return status;
}

/* ------------------------------------------------------------------------ */
/* Accessors                                                                 */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cpu_handle_expert_counts(epx_handle_t h, int64_t *counts, int64_t *offsets) {
  struct epx_cpu_plan *p = h->cpu;
  if (counts) memcpy(counts, p->expert_counts, sizeof(int64_t) * (size_t)p->E_local);
  if (offsets) {
    if (p->layout == EPX_LAYOUT_RANK_MAJOR) {
      memset(offsets, 0, sizeof(int64_t) * (size_t)p->E_local);
      offsets[p->E_local] = p->N;
    } else {
      memcpy(offsets, p->expert_offsets, sizeof(int64_t) * (size_t)(p->E_local + 1));
    }
  }
  return EPX_SUCCESS;
}

epx_status_t epx_cpu_handle_recv_routing(epx_handle_t h, int32_t *recv_expert, float *recv_w) {
  struct epx_cpu_plan *p = h->cpu;
  size_t n = (size_t)p->N * (size_t)p->row_slots;
  if (recv_expert) memcpy(recv_expert, p->row_expert, n * sizeof(int32_t));
  if (recv_w)
    for (size_t i = 0; i < n; i++) recv_w[i] = p->row_expert[i] >= 0 ? p->row_weight[i] : 0.0f;
  return EPX_SUCCESS;
}

epx_status_t epx_cpu_handle_recv_source(epx_handle_t h, int32_t *src_rank, int32_t *src_token) {
  struct epx_cpu_plan *p = h->cpu;
  if (src_rank) memcpy(src_rank, p->row_src_rank, sizeof(int32_t) * (size_t)p->N);
  if (src_token) memcpy(src_token, p->row_src_token, sizeof(int32_t) * (size_t)p->N);
  return EPX_SUCCESS;
}

epx_status_t epx_cpu_handle_stats(epx_handle_t h, epx_handle_stats_t *stats) {
  struct epx_cpu_plan *p = h->cpu;
  stats->send_rows = total(p->item_count, p->W);
  stats->recv_rows = total(p->ritem_count, p->W);
  stats->send_bytes = stats->send_rows * (int64_t)p->row_bytes;
  stats->recv_bytes = stats->recv_rows * (int64_t)p->row_bytes;
  stats->local_rows = p->self_items;
  return EPX_SUCCESS;
}
