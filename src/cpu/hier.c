/* The hierarchical exchange's two hops over a dedup plan (cpu/hier.h says
 * what moves where). Vocabulary, one rank's view, beside cpu/exchange.h's:
 *   relay     the rank of a node that a token of another node enters it
 *             through: the one with the sender's local index;
 *   net row   a row of hop 1, one per (token, other node holding any of its
 *             experts), to that node's relay;
 *   fwd row   a row of hop 2, from a relay to a rank of its node: its own
 *             items to the node's other ranks, then the net rows it relays.
 * A hop-2 block (relay q -> rank r) holds the items of every source q relays
 * for r, in ascending source rank, each source's in token order: q itself
 * (when q != r) and the ranks of other nodes with q's local index. Staging
 * lives in the plan (a handle moves one call at a time on its rank). */
#include "cpu/hier.h"

#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/transport.h"
#include "cpu/exchange.h"

struct epx_cpu_hier {
  int32_t W, L, node, local;
  const struct epx_comm *topo;        /* the buffer's comm: its node arrays */
  int64_t *net_count, *net_displ;     /* [W] hop-1 rows to each relay */
  int32_t *net_token;                 /* [net rows] */
  int64_t *rnet_count, *rnet_displ;   /* [W] hop-1 rows from each source */
  uint8_t *rnet_mask;                 /* [rnet rows, L] 1: the node's rank of that local index needs it */
  int64_t *fwd_count, *fwd_displ;     /* [W] hop-2 rows to each rank of the node */
  int64_t *fwd_row;                   /* [fwd rows] >= 0: a received net row; < 0: -1 - own token */
  int64_t *own_pos;                   /* [W] where this rank's own items start in each block to r */
  int64_t *hop_count, *hop_displ;     /* [W] hop-2 rows from each relay of the node */
  int64_t *src_pos;                   /* [W] hop-2 receive row of each source's first item */
  void *stage[3];                     /* hop-1 send, hop-1 receive, hop-2 receive */
  size_t stage_bytes[3];
};

#define OOM(fn) epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn)

static int32_t rank_at(const struct epx_cpu_hier *h, int32_t node, int32_t local) {
  return h->topo->node_ranks[h->topo->node_first[node] + local];
}

void epx_cpu_hier_free(struct epx_cpu_hier *h) {
  if (!h) return;
  void *arrays[] = {h->net_count, h->net_token, h->rnet_mask, h->fwd_row,
                    h->stage[0], h->stage[1], h->stage[2]};
  for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) free(arrays[i]);
  free(h);
}

void epx_cpu_add_partial(epx_dtype_t dtype, const void *row, int rounded, float *acc, int first, int64_t n) {
  if (!rounded) {
    epx_rows_accumulate(EPX_FLOAT32, &row, NULL, 1, acc, first, n);
  } else if (first) {
    epx_row_to_f32(dtype, row, acc, n);
  } else {
    for (int64_t i = 0; i < n; i++) acc[i] += epx_load(dtype, row, i);
  }
}

/* ------------------------------------------------------------------------ */
/* The plan                                                                  */
/* ------------------------------------------------------------------------ */

/* Per token, which ranks (node, local index) hold its experts: flags [G, L]. */
static void token_flags(const struct epx_cpu_plan *p, const struct epx_cpu_hier *h, int64_t t, uint8_t *flags) {
  memset(flags, 0, (size_t)h->topo->num_nodes * (size_t)h->L);
  for (int32_t k = 0; k < p->K; k++) {
    int32_t e = p->topk_idx[t * p->K + k];
    if (e < 0) continue;
    int32_t d = epx_placement_rank(p->place, e);
    flags[(size_t)h->topo->node_of[d] * (size_t)h->L + (size_t)h->topo->local_of[d]] = 1;
  }
}

static int any(const uint8_t *f, int32_t n) {
  for (int32_t i = 0; i < n; i++)
    if (f[i]) return 1;
  return 0;
}

/* Hop 1's rows and their records (token, then L mask words) to each relay. */
static epx_status_t net_records(const struct epx_cpu_plan *p, struct epx_cpu_hier *h, int32_t **records,
                                const char *fn) {
  int32_t G = h->topo->num_nodes, L = h->L;
  uint8_t *flags = malloc((size_t)G * (size_t)L);
  if (!flags) return OOM(fn);
  for (int pass = 0; pass < 2; pass++) {
    int64_t *fill = pass ? h->net_count : NULL;
    if (pass) {
      epx_cpu_displs(h->net_count, h->net_displ, h->W);
      int64_t rows = epx_cpu_total(h->net_count, h->W);
      h->net_token = malloc(sizeof(int32_t) * (size_t)(rows + 1));
      *records = malloc(sizeof(int32_t) * (size_t)(rows + 1) * (size_t)(1 + L));
      if (!h->net_token || !*records) {
        free(flags);
        return OOM(fn);
      }
      memset(h->net_count, 0, sizeof(int64_t) * (size_t)h->W);
    }
    for (int64_t t = 0; t < p->T; t++) {
      token_flags(p, h, t, flags);
      for (int32_t g = 0; g < G; g++) {
        if (g == h->node || !any(flags + (size_t)g * L, L)) continue;
        int32_t relay = rank_at(h, g, h->local);
        if (pass) {
          int64_t row = h->net_displ[relay] + fill[relay];
          h->net_token[row] = (int32_t)t;
          int32_t *rec = *records + (size_t)row * (size_t)(1 + L);
          rec[0] = (int32_t)t;
          for (int32_t l = 0; l < L; l++) rec[1 + l] = flags[(size_t)g * L + l];
        }
        h->net_count[relay]++;
      }
    }
  }
  free(flags);
  return EPX_SUCCESS;
}

/* Whether source s's items reach this node through relay q: q itself, or a
 * rank of another node with q's local index. */
static int relays(const struct epx_cpu_hier *h, int32_t q, int32_t s) {
  return s == q || (h->topo->node_of[s] != h->node && h->topo->local_of[s] == h->topo->local_of[q]);
}

/* As relay: each hop-2 block to rank r of the node, source by source. */
static epx_status_t plan_forward(const struct epx_cpu_plan *p, struct epx_cpu_hier *h, const char *fn) {
  const int32_t me = p->rank, L = h->L;
  int64_t total = 0;
  for (int pass = 0; pass < 2; pass++) {
    if (pass && !(h->fwd_row = malloc(sizeof(int64_t) * (size_t)(total + 1)))) return OOM(fn);
    int64_t at = 0;
    for (int32_t l = 0; l < L; l++) {
      int32_t r = rank_at(h, h->node, l);
      h->fwd_displ[r] = at;
      for (int32_t s = 0; s < h->W; s++) {
        if (s == me) {
          h->own_pos[r] = at;
          if (r == me) continue;
          for (int64_t i = 0; i < p->item_count[r]; i++, at++)
            if (pass) h->fwd_row[at] = -1 - (int64_t)p->item_token[p->item_displ[r] + i];
        } else if (relays(h, me, s)) {
          for (int64_t j = h->rnet_displ[s]; j < h->rnet_displ[s] + h->rnet_count[s]; j++) {
            if (!h->rnet_mask[(size_t)j * L + (size_t)l]) continue;
            if (pass) h->fwd_row[at] = j;
            at++;
          }
        }
      }
      h->fwd_count[r] = at - h->fwd_displ[r];
    }
    total = at;
  }
  return EPX_SUCCESS;
}

/* As receiver: where each source's items land in the hop-2 blocks. */
static void plan_receive(const struct epx_cpu_plan *p, struct epx_cpu_hier *h) {
  int64_t at = 0;
  for (int32_t q = 0; q < h->W; q++) {
    h->hop_displ[q] = at;
    if (h->topo->node_of[q] == h->node)
      for (int32_t s = 0; s < h->W; s++)
        if (s != p->rank && relays(h, q, s)) {
          h->src_pos[s] = at;
          at += p->ritem_count[s];
        }
    h->hop_count[q] = at - h->hop_displ[q];
  }
}

/* The relayed rows' records: tokens of their source, masks of 0 and 1. */
static epx_status_t check_net_records(const struct epx_cpu_hier *h, const int32_t *rec, int64_t rows, const char *fn) {
  for (int64_t j = 0; j < rows; j++) {
    const int32_t *r = rec + (size_t)j * (size_t)(1 + h->L);
    int ok = r[0] >= 0;
    for (int32_t l = 0; l < h->L; l++) ok &= r[1 + l] == 0 || r[1 + l] == 1;
    if (!ok)
      return epx_error(EPX_ERROR_TRANSPORT, "%s: relayed record %lld is corrupt (nothing was used)", fn, (long long)j);
  }
  return EPX_SUCCESS;
}

/* Hop 1's counts and records, then the forward plan and its counts checked
 * against what each receiver expects from the flat layout. */
static epx_status_t exchange_plan(epx_buffer_t b, const struct epx_cpu_plan *p, struct epx_cpu_hier *h,
                                  const char *fn) {
  epx_comm_t comm = b->comm;
  int32_t W = h->W, L = h->L, *send = NULL, *recv = NULL;
  int64_t *announced = malloc(sizeof(int64_t) * (size_t)W);
  epx_status_t status = announced ? net_records(p, h, &send, fn) : OOM(fn);
  if (status == EPX_SUCCESS) status = comm->ops->alltoall(comm, fn, h->net_count, h->rnet_count, sizeof(int64_t));
  int64_t rows = 0;
  if (status == EPX_SUCCESS) {
    epx_cpu_displs(h->rnet_count, h->rnet_displ, W);
    rows = epx_cpu_total(h->rnet_count, W);
    recv = malloc(sizeof(int32_t) * (size_t)(rows + 1) * (size_t)(1 + L));
    h->rnet_mask = malloc((size_t)(rows + 1) * (size_t)L);
    if (!recv || !h->rnet_mask) status = OOM(fn);
  }
  if (status == EPX_SUCCESS)
    status = comm->ops->alltoallv(comm, fn, send, h->net_count, h->net_displ, recv, h->rnet_count, h->rnet_displ,
                                  sizeof(int32_t) * (size_t)(1 + L));
  if (status == EPX_SUCCESS) status = check_net_records(h, recv, rows, fn);
  for (int64_t j = 0; status == EPX_SUCCESS && j < rows; j++)
    for (int32_t l = 0; l < L; l++) h->rnet_mask[(size_t)j * L + l] = (uint8_t)recv[(size_t)j * (1 + L) + 1 + l];
  if (status == EPX_SUCCESS) status = plan_forward(p, h, fn);
  if (status == EPX_SUCCESS) status = comm->ops->alltoall(comm, fn, h->fwd_count, announced, sizeof(int64_t));
  if (status == EPX_SUCCESS) plan_receive(p, h);
  for (int32_t q = 0; q < W && status == EPX_SUCCESS; q++)
    if (announced[q] != h->hop_count[q])
      status = epx_error(EPX_ERROR_TRANSPORT,
                         "%s: rank %d forwards %lld rows to rank %d, which expects %lld from it; its "
                         "layout is corrupt", fn, q, (long long)announced[q], p->rank, (long long)h->hop_count[q]);
  free(announced);
  free(send);
  free(recv);
  return status;
}

epx_status_t epx_cpu_hier_layout(epx_buffer_t b, struct epx_cpu_plan *p, const char *fn) {
  epx_comm_t comm = b->comm;
  struct epx_cpu_hier *h = calloc(1, sizeof *h);
  if (!h) return OOM(fn);
  p->hier = h;
  h->W = comm->size, h->L = comm->ranks_per_node, h->topo = comm;
  h->node = comm->node_of[comm->rank], h->local = comm->local_of[comm->rank];
  size_t Wn = (size_t)h->W;
  /* The per-rank arrays in one block, freed with net_count. */
  int64_t **arrays[] = {&h->net_count, &h->net_displ, &h->rnet_count, &h->rnet_displ, &h->own_pos,
                        &h->hop_count, &h->hop_displ, &h->src_pos, &h->fwd_count, &h->fwd_displ};
  size_t n = sizeof arrays / sizeof arrays[0];
  int64_t *block = calloc(n * Wn, sizeof(int64_t));
  if (!block) return OOM(fn);
  for (size_t i = 0; i < n; i++) *arrays[i] = block + i * Wn;
  return exchange_plan(b, p, h, fn);
}

/* ------------------------------------------------------------------------ */
/* Dispatch                                                                  */
/* ------------------------------------------------------------------------ */

static epx_status_t stage(struct epx_cpu_hier *h, int i, int64_t rows, size_t unit, const char *fn) {
  return epx_cpu_ensure(&h->stage[i], &h->stage_bytes[i], (size_t)(rows + 1) * unit, fn);
}

static const char *row_of(const void *base, int64_t i, size_t unit) { return (const char *)base + (size_t)i * unit; }

epx_status_t epx_cpu_hier_forward(epx_buffer_t b, struct epx_cpu_plan *p, const void *src, size_t row_bytes,
                                  const void **item_src, const char *fn) {
  struct epx_cpu_hier *h = p->hier;
  epx_comm_t comm = b->comm;
  int32_t W = h->W;
  int64_t net = epx_cpu_total(h->net_count, W), rnet = epx_cpu_total(h->rnet_count, W);
  int64_t fwd = epx_cpu_total(h->fwd_count, W), hop = epx_cpu_total(h->hop_count, W);
  epx_status_t status = stage(h, 0, net > fwd ? net : fwd, row_bytes, fn);
  if (status == EPX_SUCCESS) status = stage(h, 1, rnet, row_bytes, fn);
  if (status == EPX_SUCCESS) status = stage(h, 2, hop, row_bytes, fn);
  if (status != EPX_SUCCESS) return status;
  for (int64_t i = 0; i < net; i++) memcpy((char *)h->stage[0] + (size_t)i * row_bytes, row_of(src, h->net_token[i], row_bytes), row_bytes);
  status = comm->ops->alltoallv(comm, fn, h->stage[0], h->net_count, h->net_displ, h->stage[1], h->rnet_count,
                                h->rnet_displ, row_bytes);
  if (status != EPX_SUCCESS) return status;
  for (int64_t i = 0; i < fwd; i++) {
    int64_t j = h->fwd_row[i];
    memcpy((char *)h->stage[0] + (size_t)i * row_bytes, j >= 0 ? row_of(h->stage[1], j, row_bytes) : row_of(src, -1 - j, row_bytes),
           row_bytes);
  }
  status = comm->ops->alltoallv(comm, fn, h->stage[0], h->fwd_count, h->fwd_displ, h->stage[2], h->hop_count,
                                h->hop_displ, row_bytes);
  for (int32_t s = 0; s < W; s++)
    if (s != p->rank)
      for (int64_t i = 0; i < p->ritem_count[s]; i++)
        item_src[p->ritem_displ[s] + i] = row_of(h->stage[2], h->src_pos[s] + i, row_bytes);
  return status;
}

/* ------------------------------------------------------------------------ */
/* Combine                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct {
  epx_dtype_t dtype;
  int64_t H;
  int rounded;
  size_t unit;      /* a partial's bytes: float32, or a payload row */
  float *acc, *node_acc, *partial;
  void *rounded_row; /* a partial as it travels: [unit] */
  const void **rows;
  float *w;
} fold_t;

/* A partial P (float32 in f, or rounded into `to`). */
static void partial_out(fold_t *f, const void **rows, const float *w, int32_t n, void *to) {
  epx_rows_accumulate(f->dtype, rows, w, n, f->rounded ? f->partial : to, 1, f->H);
  if (f->rounded) epx_row_from_f32(f->dtype, f->partial, to, f->H);
}

/* A sum of partials made a partial again (rounded when partials are). */
static void fold_out(fold_t *f, float *sum, void *to) {
  if (f->rounded) epx_row_from_f32(f->dtype, sum, to, f->H);
  else memcpy(to, sum, sizeof(float) * (size_t)f->H);
}

/* Receiver: P(t, r) of every pair received, at its hop-2 place. */
static void receiver_partials(const struct epx_cpu_plan *p, const struct epx_cpu_hier *h, fold_t *f, const void *rows,
                              int weighted, void *out) {
  for (int32_t s = 0; s < h->W; s++) {
    if (s == p->rank) continue;
    for (int64_t i = 0; i < p->rpair_count[s]; i++) {
      int64_t q = p->rpair_displ[s] + i;
      int32_t n = 0;
      for (int64_t j = p->rpair_entry[q]; j < p->rpair_entry[q + 1]; j++) {
        f->rows[n] = row_of(rows, p->entry_row[j], p->row_bytes);
        f->w[n++] = p->entry_weight[j];
      }
      partial_out(f, f->rows, weighted ? f->w : NULL, n, (char *)out + (size_t)(h->src_pos[s] + i) * f->unit);
    }
  }
}

/* Relay: Q(t, node) of each relayed net row from the node's partials (block
 * from r at cursor[r], in ascending rank), into the hop-1 return rows. */
static void relay_sums(const struct epx_cpu_plan *p, const struct epx_cpu_hier *h, fold_t *f, const void *back,
                       void *home, int64_t *cursor) {
  int32_t L = h->L;
  for (int32_t l = 0; l < L; l++) cursor[l] = h->fwd_displ[rank_at(h, h->node, l)];
  for (int32_t s = 0; s < h->W; s++) {
    if (s == p->rank) {
      for (int32_t l = 0; l < L; l++) {
        int32_t r = rank_at(h, h->node, l);
        if (r != p->rank) cursor[l] += p->item_count[r];
      }
      continue;
    }
    if (!relays(h, p->rank, s)) continue;
    for (int64_t j = h->rnet_displ[s]; j < h->rnet_displ[s] + h->rnet_count[s]; j++) {
      int first = 1;
      for (int32_t l = 0; l < L; l++) {
        if (!h->rnet_mask[(size_t)j * L + l]) continue;
        epx_cpu_add_partial(f->dtype, row_of(back, cursor[l]++, f->unit), f->rounded, f->node_acc, first, f->H);
        first = 0;
      }
      fold_out(f, f->node_acc, (char *)home + (size_t)j * f->unit);
    }
  }
}

/* The token's rank: out[t] from its node's partials and the other nodes' Q. */
static void token_sums(const struct epx_cpu_plan *p, const struct epx_cpu_hier *h, fold_t *f, const void *rows,
                       const void *node_back, const void *net_back, int weighted, void *out, int64_t *cursor) {
  const struct epx_comm *topo = h->topo;
  int32_t G = topo->num_nodes, L = h->L, K = p->K;
  for (int32_t l = 0; l < L; l++) cursor[l] = h->own_pos[rank_at(h, h->node, l)];
  for (int32_t g = 0; g < G; g++) cursor[L + g] = g == h->node ? 0 : h->net_displ[rank_at(h, g, h->local)];
  for (int64_t t = 0; t < p->T; t++) {
    int first = 1;
    const int32_t *idx = p->topk_idx + t * K;
    for (int32_t g = 0; g < G; g++) {
      int has = 0, node_first = 1;
      for (int32_t k = 0; k < K; k++) has |= idx[k] >= 0 && topo->node_of[epx_placement_rank(p->place, idx[k])] == g;
      if (!has) continue;
      if (g != h->node) {
        epx_cpu_add_partial(f->dtype, row_of(net_back, cursor[L + g]++, f->unit), f->rounded, f->acc, first, f->H);
        first = 0;
        continue;
      }
      for (int32_t l = 0; l < L; l++) {
        int32_t r = rank_at(h, g, l), n = 0;
        for (int32_t k = 0; k < K; k++) {
          if (idx[k] < 0 || epx_placement_rank(p->place, idx[k]) != r) continue;
          if (r == p->rank) {
            f->rows[n] = row_of(rows, p->self_row[t * K + k], p->row_bytes);
            f->w[n] = p->topk_w[t * K + k];
          }
          n++;
        }
        if (n == 0) continue;
        if (r == p->rank) {
          /* P(t, self), made as every receiver makes its own. */
          partial_out(f, f->rows, weighted ? f->w : NULL, n, f->rounded ? f->rounded_row : (void *)f->partial);
          epx_cpu_add_partial(f->dtype, f->rounded ? f->rounded_row : (void *)f->partial, f->rounded, f->node_acc,
                              node_first, f->H);
        } else {
          epx_cpu_add_partial(f->dtype, row_of(node_back, cursor[l]++, f->unit), f->rounded, f->node_acc, node_first, f->H);
        }
        node_first = 0;
      }
      fold_out(f, f->node_acc, f->rounded_row);
      epx_cpu_add_partial(f->dtype, f->rounded_row, f->rounded, f->acc, first, f->H);
      first = 0;
    }
    if (first) memset(f->acc, 0, sizeof(float) * (size_t)f->H);
    epx_row_from_f32_stream(p->dtype, f->acc, (char *)out + (size_t)t * p->row_bytes, f->H);
  }
  epx_stream_fence();
}

static void fold_free(fold_t *f) {
  free(f->acc), free(f->node_acc), free(f->partial), free(f->rounded_row), free(f->rows), free(f->w);
}

static int fold_init(fold_t *f, const struct epx_cpu_plan *p, int rounded) {
  *f = (fold_t){.dtype = p->dtype, .H = p->H, .rounded = rounded};
  f->unit = rounded ? p->row_bytes : sizeof(float) * (size_t)p->H;
  size_t row = sizeof(float) * (size_t)p->H;
  f->acc = malloc(row), f->node_acc = malloc(row), f->partial = malloc(row), f->rounded_row = malloc(row);
  f->rows = malloc(sizeof(void *) * (size_t)p->record_k);
  f->w = malloc(sizeof(float) * (size_t)p->record_k);
  return f->acc && f->node_acc && f->partial && f->rounded_row && f->rows && f->w;
}

/* Receivers' partials to the relays (hop 2 backwards), the relays' node sums
 * home (hop 1 backwards), then each token's sum. */
epx_status_t epx_cpu_hier_combine(epx_buffer_t b, struct epx_cpu_plan *p, const void *rows, void *out,
                                  int weighted, int round_partials, const char *fn) {
  struct epx_cpu_hier *h = p->hier;
  epx_comm_t comm = b->comm;
  int32_t W = h->W;
  int64_t net = epx_cpu_total(h->net_count, W), rnet = epx_cpu_total(h->rnet_count, W);
  int64_t fwd = epx_cpu_total(h->fwd_count, W), hop = epx_cpu_total(h->hop_count, W);
  fold_t f;
  int64_t *cursor = malloc(sizeof(int64_t) * (size_t)(h->L + comm->num_nodes));
  epx_status_t status = fold_init(&f, p, round_partials) && cursor ? EPX_SUCCESS : OOM(fn);
  /* stage 2: receivers' partials; 0: what the relay receives, then sends;
   * 1: the node sums coming home. */
  if (status == EPX_SUCCESS) status = stage(h, 2, hop, f.unit, fn);
  if (status == EPX_SUCCESS) status = stage(h, 0, fwd + rnet, f.unit, fn);
  if (status == EPX_SUCCESS) status = stage(h, 1, net, f.unit, fn);
  if (status == EPX_SUCCESS) {
    receiver_partials(p, h, &f, rows, weighted, h->stage[2]);
    status = comm->ops->alltoallv(comm, fn, h->stage[2], h->hop_count, h->hop_displ, h->stage[0], h->fwd_count,
                                  h->fwd_displ, f.unit);
  }
  char *relay_out = (char *)h->stage[0] + (size_t)fwd * f.unit;
  if (status == EPX_SUCCESS) {
    relay_sums(p, h, &f, h->stage[0], relay_out, cursor);
    status = comm->ops->alltoallv(comm, fn, relay_out, h->rnet_count, h->rnet_displ, h->stage[1], h->net_count,
                                  h->net_displ, f.unit);
  }
  if (status == EPX_SUCCESS) token_sums(p, h, &f, rows, h->stage[0], h->stage[1], weighted, out, cursor);
  fold_free(&f);
  free(cursor);
  return status;
}

void epx_cpu_traffic(const struct epx_cpu_plan *p, epx_comm_t comm, epx_handle_traffic_t *t) {
  const struct epx_cpu_hier *h = p->hier;
  int32_t node = comm->node_of[p->rank];
  *t = (epx_handle_traffic_t){0};
  for (int32_t r = 0; r < p->W; r++) {
    if (r == p->rank) continue;
    int same = comm->node_of[r] == node;
    int64_t rows = h ? (same ? h->fwd_count[r] : h->net_count[r]) : p->item_count[r];
    if (same) t->same_node_rows += rows;
    else t->other_node_rows += rows;
  }
  t->same_node_bytes = t->same_node_rows * (int64_t)p->row_bytes;
  t->other_node_bytes = t->other_node_rows * (int64_t)p->row_bytes;
}
