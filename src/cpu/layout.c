/* The layout of a dispatch over W ranks: what each rank sends where, the
 * count exchange (which carries the call's agreement, see call.c), the
 * metadata exchange, and the receive layout every later payload call replays.
 * Also the routing's validation and the handle's accessors.
 *
 * Synchronisations: one handshake (the counts, with every rank's verdict,
 * batch size and identity) and one alltoallv (the metadata records). Nothing
 * a peer sends is used as a size or an index before it is checked against
 * the shape that peer declared in the handshake. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "cpu/cpu.h"
#include "cpu/exchange.h"
#include "cpu/hier.h"

typedef struct {
  int32_t src, token, slot, expert, location;
  float weight;
} arrival_t;

/* One layout call's working state. */
typedef struct {
  epx_buffer_t b;
  const epx_routing_t *r;
  struct epx_cpu_plan *p;
  const char *fn;
  size_t rec;                  /* ints per metadata record */
  int32_t *send_records;       /* [items, rec] */
  int32_t *recv_records;       /* [ritems, rec] */
  int64_t *peer_tokens;        /* [W] each rank's T, from the handshake */
  int32_t *peer_topk;          /* [W] each rank's K */
  int64_t largest_batch;       /* max T over the ranks */
  arrival_t *arrivals;         /* [A] */
  int64_t A, pairs;
  epx_cpu_call_ctx_t call;
} layout_t;

/* ------------------------------------------------------------------------ */
/* Shared helpers                                                            */
/* ------------------------------------------------------------------------ */

static void *plan_alloc(struct epx_cpu_plan *p, size_t bytes) {
  p->bytes += (int64_t)bytes;
  return calloc(bytes ? bytes : 1, 1);
}

epx_status_t epx_cpu_ensure(void **buf, size_t *have, size_t need, const char *fn) {
  if (need <= *have) return EPX_SUCCESS;
  void *grown = NULL;
  if (posix_memalign(&grown, 64, need))
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory (%zu bytes of staging)", fn, need);
  free(*buf);
  *buf = grown;
  *have = need;
  return EPX_SUCCESS;
}

void epx_cpu_displs(const int64_t *count, int64_t *displ, int32_t n) {
  int64_t sum = 0;
  for (int32_t i = 0; i < n; i++) {
    displ[i] = sum;
    sum += count[i];
  }
}

int64_t epx_cpu_total(const int64_t *count, int32_t n) {
  int64_t sum = 0;
  for (int32_t i = 0; i < n; i++) sum += count[i];
  return sum;
}

#define OOM(fn) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn)

/* ------------------------------------------------------------------------ */
/* Validation                                                                */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cpu_validate_routing(epx_buffer_t b, const epx_routing_t *r) {
  const char *fn = "epx_dispatch_layout";
  /* Ids are logical experts, or physical ones with caller-given replicas
   * (core/placement.h); a duplicate is two routes to one logical expert. */
  const epx_placement_table_t *place = b->placement;
  int32_t E = epx_placement_routing_ids(place), K = r->top_k;
  int caller_ids = place->rule == EPX_REPLICA_CALLER;
  int capacity_layout = b->config.layout == EPX_LAYOUT_CAPACITY;
  int64_t C = b->config.capacity;
  int64_t *seen = malloc(sizeof(int64_t) * (size_t)place->num_logical);
  uint8_t *slot_taken = capacity_layout ? calloc((size_t)(E * C + 7) / 8, 1) : NULL;
  epx_status_t status = EPX_SUCCESS;
  if (!seen || (capacity_layout && !slot_taken)) OOM(fn);
  for (int32_t e = 0; e < place->num_logical; e++) seen[e] = -1;
  for (int64_t t = 0; t < r->num_tokens; t++) {
    for (int32_t k = 0; k < K; k++) {
      int32_t e = r->topk_idx[t * K + k];
      if (e == -1) continue;
      if (e < -1 || e >= E)
        EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                 "%s: routing.topk_idx[%lld][%d] is %d, outside [-1, %s = %d); use -1 for "
                 "no expert", fn, (long long)t, k, e, caller_ids ? "config.placement->num_physical" : "num_experts", E);
      int32_t logical = epx_placement_routing_logical(place, e);
      if (seen[logical] == t)
        EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT,
                 "%s: routing.topk_idx[%lld] names %s %d twice; a token picks each expert at most once",
                 fn, (long long)t, caller_ids ? "a replica of logical expert" : "expert", logical);
      seen[logical] = t;
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
/* The sender's side                                                         */
/* ------------------------------------------------------------------------ */

/* Routes to the experts of a rank masked out of the comm (epx_ll_mask_rank)
 * are dropped, as DeepEP's masked low-latency kernels drop them: the
 * expert's output is missing from combine's sum (its weight is not
 * renormalised). */
static void drop_masked_routes(struct epx_cpu_plan *p, const uint8_t *masked) {
  if (!masked) return;
  for (int64_t i = 0; i < p->T * p->K; i++)
    if (p->topk_idx[i] >= 0 && masked[epx_placement_rank(p->place, p->topk_idx[i])]) p->topk_idx[i] = -1;
}

/* The plan's fixed part, the routing's copy and the per-rank count arrays. */
static epx_status_t plan_new(layout_t *L, epx_handle_t handle) {
  epx_buffer_t b = L->b;
  const epx_routing_t *r = L->r;
  struct epx_cpu_plan *p = calloc(1, sizeof *p);
  if (!p) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  handle->cpu = L->p = p;
  p->layout_id = b->comm->layouts_made + 1;
  p->W = b->world_size, p->rank = b->rank, p->K = r->top_k, p->E_local = b->experts_per_rank;
  p->place = b->placement;
  p->record_k = b->config.max_top_k;
  p->T = r->num_tokens, p->H = b->config.hidden;
  p->dtype = b->config.dtype;
  p->row_bytes = (size_t)epx_buffer_row_bytes(b);
  p->layout = b->config.layout;
  /* The hierarchical exchange's items are dedup's; hier.c moves them. */
  p->exchange = b->config.exchange == EPX_EXCHANGE_COLLECTIVE ? EPX_EXCHANGE_COLLECTIVE : EPX_EXCHANGE_DEDUP;
  p->weighting = r->weighting;
  p->precision = p->dtype == EPX_FLOAT32 ? EPX_COMBINE_PARTIALS_FLOAT32 : b->config.combine_precision;
  p->row_slots = p->layout == EPX_LAYOUT_RANK_MAJOR ? p->K : 1;
  size_t TK = (size_t)(p->T * p->K), Wn = (size_t)p->W;
  p->topk_idx = plan_alloc(p, TK * sizeof(int32_t));
  p->topk_w = plan_alloc(p, TK * sizeof(float));
  p->self_row = plan_alloc(p, TK * sizeof(int32_t));
  if (!p->topk_idx || !p->topk_w || !p->self_row) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  int64_t **per_rank[] = {&p->item_count, &p->item_displ, &p->route_count, &p->route_displ,
                          &p->pair_count, &p->pair_displ, &p->ritem_count, &p->ritem_displ,
                          &p->rroute_count, &p->rroute_displ, &p->rpair_count, &p->rpair_displ};
  for (size_t i = 0; i < sizeof per_rank / sizeof per_rank[0]; i++) {
    *per_rank[i] = plan_alloc(p, (Wn + 1) * sizeof(int64_t));
    if (!*per_rank[i]) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  }
  epx_placement_map_routing(p->place, p->rank, p->T, p->K, r->topk_idx, p->topk_idx);
  drop_masked_routes(p, b->comm->masked);
  if (TK && r->topk_w) memcpy(p->topk_w, r->topk_w, TK * sizeof(float));
  return EPX_SUCCESS;
}

/* Routes, pairs and items to each rank (self excluded). */
static void count_routes(struct epx_cpu_plan *p, int32_t *last_token) {
  int32_t W = p->W, K = p->K, self = p->rank;
  for (int32_t d = 0; d < W; d++) last_token[d] = -1;
  for (int64_t t = 0; t < p->T; t++) {
    for (int32_t k = 0; k < K; k++) {
      int32_t e = p->topk_idx[t * K + k];
      if (e < 0) continue;
      int32_t d = epx_placement_rank(p->place, e);
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
  epx_cpu_displs(p->item_count, p->item_displ, W);
  epx_cpu_displs(p->route_count, p->route_displ, W);
  epx_cpu_displs(p->pair_count, p->pair_displ, W);
}

/* The metadata record of an item: token, then record_k expert ids (-1 for
 * slots not in this item), record_k weights (as bits), record_k locations.
 * record_k is the buffer's max_top_k, equal on every rank, so ranks whose
 * top_k differ exchange records of one size. */
static epx_status_t build_records(layout_t *L) {
  struct epx_cpu_plan *p = L->p;
  int32_t W = p->W, K = p->K, RK = p->record_k, self = p->rank;
  epx_status_t status = EPX_SUCCESS;
  int64_t *fill = calloc((size_t)W, sizeof(int64_t));
  int32_t *last_token = malloc(sizeof(int32_t) * (size_t)W);
  if (!fill || !last_token) OOM(L->fn);
  count_routes(p, last_token);
  int64_t items = epx_cpu_total(p->item_count, W);
  p->item_token = plan_alloc(p, (size_t)items * sizeof(int32_t));
  L->send_records = malloc((size_t)(items ? items : 1) * L->rec * sizeof(int32_t));
  if (!p->item_token || !L->send_records) OOM(L->fn);
  for (int32_t d = 0; d < W; d++) last_token[d] = -1;
  for (int64_t t = 0; t < p->T; t++) {
    for (int32_t k = 0; k < K; k++) {
      int32_t e = p->topk_idx[t * K + k];
      if (e < 0 || epx_placement_rank(p->place, e) == self) continue;
      int32_t d = epx_placement_rank(p->place, e);
      int64_t item;
      if (p->exchange == EPX_EXCHANGE_COLLECTIVE || last_token[d] != t) {
        item = p->item_displ[d] + fill[d]++;
        last_token[d] = (int32_t)t;
        p->item_token[item] = (int32_t)t;
        int32_t *record = L->send_records + (size_t)item * L->rec;
        record[0] = (int32_t)t;
        for (int32_t j = 0; j < RK; j++) record[1 + j] = record[1 + 2 * RK + j] = -1;
        memset(&record[1 + RK], 0, sizeof(float) * (size_t)RK);
      } else {
        item = p->item_displ[d] + fill[d] - 1;
      }
      int32_t *record = L->send_records + (size_t)item * L->rec;
      record[1 + k] = e;
      memcpy(&record[1 + RK + k], &p->topk_w[t * K + k], sizeof(float));
      record[1 + 2 * RK + k] = L->r->locations ? L->r->locations[t * K + k] : -1;
    }
  }
fail:
  free(fill);
  free(last_token);
  return status;
}

/* ------------------------------------------------------------------------ */
/* The count exchange: one handshake                                         */
/* ------------------------------------------------------------------------ */

/* Runs on every rank with every rank's block: agree the call, then take the
 * counts this rank receives, each checked against its sender's shape. */
static epx_status_t then_counts(void *ctx, const void *recv) {
  layout_t *L = ctx;
  const epx_cpu_call_t *peers = recv;
  epx_comm_t comm = L->b->comm;
  /* Every rank in this layout counts it (the same number everywhere); a
   * rank alone in it, its peers in other calls, does not. */
  int all_layout = 1;
  for (int32_t s = 0; s < comm->size; s++) all_layout &= peers[s].kind == EPX_CALL_LAYOUT;
  for (int32_t s = 0; s < comm->size && all_layout; s++)
    if (peers[s].layout_id > comm->layouts_made) comm->layouts_made = peers[s].layout_id;
  epx_status_t status = epx_cpu_call_agree(&L->call, peers);
  if (status != EPX_SUCCESS) return status;
  struct epx_cpu_plan *p = L->p;
  p->agreed = 1;
  L->largest_batch = 0;
  for (int32_t s = 0; s < comm->size; s++) {
    int64_t T = peers[s].tokens, K = peers[s].top_k;
    int64_t bound = p->exchange == EPX_EXCHANGE_DEDUP ? T : T * K;
    int64_t count = s == p->rank ? 0 : peers[s].word[0];
    if (count < 0 || count > bound)
      return epx_error(EPX_ERROR_TRANSPORT,
                       "%s: rank %d announces %lld rows for rank %d, outside [0, %lld] for its %lld "
                       "tokens of top_k %lld; its message is corrupt (nothing was used)",
                       L->fn, s, (long long)count, p->rank, (long long)bound, (long long)T, (long long)K);
    p->ritem_count[s] = count;
    L->peer_tokens[s] = T;
    L->peer_topk[s] = (int32_t)K;
    if (T > L->largest_batch) L->largest_batch = T;
  }
  return EPX_SUCCESS;
}

static epx_status_t exchange_counts(layout_t *L, epx_status_t local, epx_handle_t handle) {
  epx_comm_t comm = L->b->comm;
  int32_t W = comm->size;
  epx_cpu_call_begin(&L->call, L->b, EPX_CALL_LAYOUT, L->fn, local, NULL);
  L->call.mine.layout_id = comm->layouts_made + 1;
  L->call.mine.tokens = L->r ? L->r->num_tokens : 0;
  L->call.mine.top_k = L->r ? L->r->top_k : 0;
  L->call.mine.weighting = L->r ? (int32_t)L->r->weighting : 0;
  if (W == 1) {
    comm->layouts_made++;
    L->largest_batch = L->call.mine.tokens;
    return local;
  }
  epx_cpu_call_t *blocks = epx_cpu_call_blocks(&L->call);
  L->peer_tokens = malloc(sizeof(int64_t) * (size_t)W);
  L->peer_topk = malloc(sizeof(int32_t) * (size_t)W);
  epx_status_t status = EPX_SUCCESS;
  if (!blocks || !L->peer_tokens || !L->peer_topk) OOM(L->fn);
  for (int32_t r = 0; r < W; r++) blocks[r].word[0] = local == EPX_SUCCESS ? L->p->item_count[r] : 0;
  /* A rank without a plan (refused, or out of memory before it) still
   * answers its peers, and with its verdict. */
  status = epx_comm_handshake(comm, L->fn, blocks, blocks + W, sizeof *blocks, then_counts, L);
  (void)handle;
fail:
  free(blocks);
  return status;
}

/* ------------------------------------------------------------------------ */
/* The receiver's side                                                       */
/* ------------------------------------------------------------------------ */

/* Checks the records from source s (its own shape from the handshake) and
 * counts the routes in them: a token of that source, in order, and experts
 * of this rank in its top_k slots; capacity locations inside C. */
static epx_status_t check_records(const layout_t *L, int32_t s, int64_t *routes) {
  const struct epx_cpu_plan *p = L->p;
  int32_t RK = p->record_k, P = p->place->num_physical;
  int64_t C = L->b->config.capacity, previous = -1;
  for (int64_t i = p->ritem_displ[s]; i < p->ritem_displ[s] + p->ritem_count[s]; i++) {
    const int32_t *record = L->recv_records + (size_t)i * L->rec;
    int64_t t = record[0];
    int ordered = p->exchange == EPX_EXCHANGE_DEDUP ? t > previous : t >= previous;
    int ok = t >= 0 && t < L->peer_tokens[s] && ordered;
    for (int32_t k = 0; k < RK && ok; k++) {
      int32_t e = record[1 + k], l = record[1 + 2 * RK + k];
      if (e == -1) continue;
      ok = k < L->peer_topk[s] && e >= 0 && e < P && epx_placement_rank(p->place, e) == p->rank &&
           (p->layout != EPX_LAYOUT_CAPACITY || (l >= 0 && l < C));
      *routes += ok;
    }
    if (!ok)
      return epx_error(EPX_ERROR_TRANSPORT,
                       "%s: rank %d's metadata record %lld (token %lld) is not a route of its %lld "
                       "tokens to this rank's experts; its message is corrupt (nothing was used)", L->fn, s,
                       (long long)(i - p->ritem_displ[s]), (long long)t, (long long)L->peer_tokens[s]);
    previous = t;
  }
  return EPX_SUCCESS;
}

/* The arrivals in (source rank, token, k) order, own routes included; the
 * entries of each staging row. */
static epx_status_t gather_arrivals(layout_t *L) {
  struct epx_cpu_plan *p = L->p;
  int32_t W = p->W, K = p->K, RK = p->record_k, self = p->rank;
  int64_t ritems = epx_cpu_total(p->ritem_count, W), self_routes = 0, remote_routes = 0;
  for (int64_t i = 0; i < p->T * K; i++)
    self_routes += p->topk_idx[i] >= 0 && epx_placement_rank(p->place, p->topk_idx[i]) == self;
  for (int32_t s = 0; s < W; s++) {
    epx_status_t status = check_records(L, s, &remote_routes);
    if (status != EPX_SUCCESS) return status;
  }
  L->A = self_routes + remote_routes;
  size_t M = (size_t)(remote_routes ? remote_routes : 1);
  L->arrivals = malloc((size_t)(L->A ? L->A : 1) * sizeof *L->arrivals);
  p->ritem_entry = plan_alloc(p, (size_t)(ritems + 1) * sizeof(int64_t));
  p->entry_row = plan_alloc(p, M * sizeof(int64_t));
  p->entry_weight = plan_alloc(p, M * sizeof(float));
  p->entry_slot = plan_alloc(p, M * sizeof(int32_t));
  if (!L->arrivals || !p->ritem_entry || !p->entry_row || !p->entry_weight || !p->entry_slot)
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  const int32_t *loc = L->r->locations;
  int64_t a = 0, entry = 0;
  for (int32_t s = 0; s < W; s++) {
    if (s == self) {
      for (int64_t t = 0; t < p->T; t++)
        for (int32_t k = 0; k < K; k++) {
          int32_t e = p->topk_idx[t * K + k];
          if (e < 0 || epx_placement_rank(p->place, e) != self) continue;
          L->arrivals[a++] = (arrival_t){s, (int32_t)t, k, e, loc ? loc[t * K + k] : -1, p->topk_w[t * K + k]};
        }
      continue;
    }
    for (int64_t i = p->ritem_displ[s]; i < p->ritem_displ[s] + p->ritem_count[s]; i++) {
      const int32_t *record = L->recv_records + (size_t)i * L->rec;
      p->ritem_entry[i] = entry;
      for (int32_t k = 0; k < RK; k++) {
        if (record[1 + k] < 0) continue;
        float w;
        memcpy(&w, &record[1 + RK + k], sizeof w);
        L->arrivals[a++] = (arrival_t){s, record[0], k, record[1 + k], record[1 + 2 * RK + k], w};
        entry++;
      }
    }
  }
  p->ritem_entry[ritems] = entry;
  return EPX_SUCCESS;
}

/* Per-source route and pair counts as the receiver sees them, and the
 * layout's size. */
static epx_status_t size_layout(layout_t *L) {
  struct epx_cpu_plan *p = L->p;
  int32_t W = p->W, El = p->E_local;
  L->pairs = 0;
  for (int64_t i = 0; i < L->A; i++) {
    const arrival_t *x = &L->arrivals[i];
    int new_pair = i == 0 || x->src != L->arrivals[i - 1].src || x->token != L->arrivals[i - 1].token;
    L->pairs += new_pair;
    if (x->src == p->rank) continue;
    p->rroute_count[x->src]++;
    p->rpair_count[x->src] += new_pair;
  }
  epx_cpu_displs(p->rroute_count, p->rroute_displ, W);
  epx_cpu_displs(p->rpair_count, p->rpair_displ, W);
  p->rpair_entry = plan_alloc(p, (size_t)(epx_cpu_total(p->rpair_count, W) + 1) * sizeof(int64_t));
  p->expert_counts = plan_alloc(p, (size_t)El * sizeof(int64_t));
  p->expert_offsets = plan_alloc(p, (size_t)(El + 1) * sizeof(int64_t));
  if (!p->rpair_entry || !p->expert_counts || !p->expert_offsets)
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  int64_t C = L->b->config.capacity;
  for (int64_t i = 0; i < L->A; i++) p->expert_counts[p->place->slot_of[L->arrivals[i].expert]]++;
  switch (p->layout) {
    case EPX_LAYOUT_EXPERT_MAJOR: {
      int64_t align = L->b->config.expert_alignment, sum = 0;
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
      p->N = p->expert_offsets[El] = L->pairs;
      break;
  }
  size_t Nn = (size_t)p->N, slots = (size_t)p->row_slots;
  p->row_src_rank = plan_alloc(p, Nn * sizeof(int32_t));
  p->row_src_token = plan_alloc(p, Nn * sizeof(int32_t));
  p->row_expert = plan_alloc(p, Nn * slots * sizeof(int32_t));
  p->row_weight = plan_alloc(p, Nn * slots * sizeof(float));
  if (!p->row_src_rank || !p->row_src_token || !p->row_expert || !p->row_weight)
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  for (size_t i = 0; i < Nn; i++) p->row_src_rank[i] = p->row_src_token[i] = -1;
  for (size_t i = 0; i < Nn * slots; i++) p->row_expert[i] = -1;
  for (int64_t i = 0; i < p->T * p->K; i++) p->self_row[i] = -1;
  return EPX_SUCCESS;
}

/* Each arrival's row in the receive layout. */
static epx_status_t place_rows(layout_t *L) {
  struct epx_cpu_plan *p = L->p;
  int32_t W = p->W, El = p->E_local;
  int64_t C = L->b->config.capacity;
  size_t slots = (size_t)p->row_slots;
  int64_t *fill = calloc((size_t)El, sizeof(int64_t));
  if (!fill) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  int64_t pair = -1, rpair = -1, entry = 0;
  for (int64_t i = 0; i < L->A; i++) {
    const arrival_t *x = &L->arrivals[i];
    int new_pair = i == 0 || x->src != L->arrivals[i - 1].src || x->token != L->arrivals[i - 1].token;
    pair += new_pair;
    int32_t e = p->place->slot_of[x->expert];
    int64_t row;
    if (p->layout == EPX_LAYOUT_EXPERT_MAJOR) row = p->expert_offsets[e] + fill[e]++;
    else if (p->layout == EPX_LAYOUT_CAPACITY) row = (int64_t)e * W * C + (int64_t)x->src * C + x->location;
    else row = pair;
    if (p->layout == EPX_LAYOUT_CAPACITY && p->row_src_rank[row] >= 0) {
      free(fill);
      return epx_error(EPX_ERROR_TRANSPORT,
                       "%s: rank %d sent two routes to capacity slot %d of expert %d; its message is "
                       "corrupt", L->fn, x->src, x->location, x->expert);
    }
    p->row_src_rank[row] = x->src;
    p->row_src_token[row] = x->token;
    size_t slot = p->layout == EPX_LAYOUT_RANK_MAJOR ? (size_t)row * slots + (size_t)x->slot : (size_t)row;
    p->row_expert[slot] = x->expert;
    p->row_weight[slot] = x->weight;
    if (x->src == p->rank) {
      p->self_row[(size_t)x->token * (size_t)p->K + (size_t)x->slot] = (int32_t)row;
    } else {
      if (new_pair) p->rpair_entry[++rpair] = entry;
      p->entry_row[entry] = row;
      p->entry_weight[entry] = x->weight;
      p->entry_slot[entry] = x->slot;
      entry++;
    }
  }
  p->rpair_entry[rpair + 1] = entry;
  free(fill);
  return EPX_SUCCESS;
}

/* The metadata exchange and the receive layout. */
static epx_status_t receive_layout(layout_t *L) {
  struct epx_cpu_plan *p = L->p;
  epx_comm_t comm = L->b->comm;
  epx_cpu_displs(p->ritem_count, p->ritem_displ, p->W);
  int64_t ritems = epx_cpu_total(p->ritem_count, p->W);
  L->recv_records = malloc((size_t)(ritems ? ritems : 1) * L->rec * sizeof(int32_t));
  if (!L->recv_records) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", L->fn);
  if (p->W > 1) {
    epx_status_t status = comm->ops->alltoallv(comm, L->fn, L->send_records, p->item_count, p->item_displ,
                                               L->recv_records, p->ritem_count, p->ritem_displ,
                                               L->rec * sizeof(int32_t));
    if (status != EPX_SUCCESS) return status;
  }
  epx_status_t status = gather_arrivals(L);
  if (status == EPX_SUCCESS) status = size_layout(L);
  if (status == EPX_SUCCESS) status = place_rows(L);
  return status;
}

/* Each route's logical expert into the buffer's load counts
 * (epx_buffer_expert_load). */
static void count_load(epx_buffer_t b, const epx_routing_t *r) {
  const epx_placement_table_t *place = b->placement;
  for (int64_t i = 0; i < r->num_tokens * r->top_k; i++)
    if (r->topk_idx[i] >= 0) b->expert_load[epx_placement_routing_logical(place, r->topk_idx[i])]++;
}

epx_status_t epx_cpu_dispatch_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t local,
                                     epx_handle_t handle) {
  return epx_cpu_layout_as(b, r, local, handle, "epx_dispatch_layout");
}

epx_status_t epx_cpu_layout_as(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t handle,
                               const char *fn) {
  layout_t L = {.b = b, .r = r, .fn = fn, .rec = 1 + 3 * (size_t)b->config.max_top_k};
  if (local == EPX_SUCCESS) local = plan_new(&L, handle);
  if (local == EPX_SUCCESS) local = build_records(&L);
  epx_status_t status = exchange_counts(&L, local, handle);
  if (status == EPX_SUCCESS && b->max_tokens == 0) epx_buffer_agree_max_tokens(b, L.largest_batch);
  if (status == EPX_SUCCESS) status = receive_layout(&L);
  if (status == EPX_SUCCESS && b->config.exchange == EPX_EXCHANGE_HIERARCHICAL && b->world_size > 1)
    status = epx_cpu_hier_layout(b, L.p, L.fn);
  if (status == EPX_SUCCESS) {
    handle->recv_rows = L.p->N;
    count_load(b, r);
  }
  free(L.send_records);
  free(L.recv_records);
  free(L.peer_tokens);
  free(L.peer_topk);
  free(L.arrivals);
  return status;
}

/* ------------------------------------------------------------------------ */
/* Lifetimes and accessors                                                   */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cpu_buffer_init(epx_buffer_t buffer) {
  buffer->cpu = calloc(1, sizeof *buffer->cpu);
  if (!buffer->cpu) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "epx_buffer_create: out of memory");
  /* Every rank creates the comm's buffers in the same order. */
  buffer->cpu->buffer_id = ++buffer->comm->buffers_made;
  return EPX_SUCCESS;
}

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
  epx_cpu_hier_free(p->hier);
  free(p);
  handle->cpu = NULL;
}

void epx_cpu_buffer_fini(epx_buffer_t buffer) {
  if (!buffer->cpu) return;
  free(buffer->cpu->send);
  free(buffer->cpu->recv);
  free(buffer->cpu->fp8);
  free(buffer->cpu);
  buffer->cpu = NULL;
}

int64_t epx_cpu_handle_bytes(epx_handle_t handle) { return handle->cpu ? handle->cpu->bytes : 0; }

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
  stats->send_rows = epx_cpu_total(p->item_count, p->W);
  stats->recv_rows = epx_cpu_total(p->ritem_count, p->W);
  stats->send_bytes = stats->send_rows * (int64_t)p->row_bytes;
  stats->recv_bytes = stats->recv_rows * (int64_t)p->row_bytes;
  stats->local_rows = p->self_items;
  return EPX_SUCCESS;
}
