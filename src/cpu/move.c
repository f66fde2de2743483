/* Row movement on a layout: dispatch (x [T, H] -> layout [N, H]), combine and
 * dispatch_backward (layout -> out [T, H]), and both weight-gradient returns.
 *
 * Every call starts with one handshake (epx_comm_handshake) carrying what the
 * rank is doing (call.c). On the local transport the rows move inside that
 * handshake, read where the peers have them: one synchronisation per call.
 * Elsewhere the handshake agrees the call and one alltoallv moves the staged
 * rows.
 *
 * Combine numerics (the contract in epx.h): per token, for each rank r
 * holding some of its routes, in ascending r, the partial
 * P(t, r) = 0 + the token's products on r in k order, in float32; with
 * EPX_COMBINE_PARTIALS_PAYLOAD each P(t, r) is rounded once to the payload
 * dtype; then acc = P(t, r0) + P(t, r1) + ... in float32, rounded once.
 * The dedup exchange over MPI computes P on the receiver and returns it
 * (float32, or already rounded); otherwise each route's row comes back and
 * the token's rank computes P with the same loop and rounds it the same way —
 * so every path gives the same bits. dispatch_backward always sums in
 * float32 (the precision is combine's). */
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/payload.h"
#include "cpu/cpu.h"
#include "cpu/exchange.h"
#include "cpu/hier.h"
#include "cpu/omp.h"

#define OOM(fn) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn)

/* How expert outputs come back to the token's rank. */
typedef enum {
  RETURN_PARTIAL, /* one row per pair: P(t, r) computed by the receiver (dedup) */
  RETURN_ROUTES,  /* one payload row per route (collective; or when the sender needs each row) */
  RETURN_PAIRS    /* one payload row per pair, already reduced by the caller (rank-major) */
} return_mode_t;

/* Whether one rank splits its tokens over the cores: only with enough work
 * to pay for waking them (an OpenMP region costs microseconds when the cores
 * are idle, and up to a scheduler time slice, milliseconds, when they are
 * busy; bench/NOTES.md, v0.4.0-dev, has the measurements). From 1M elements
 * (4 MB of f32 rows) a call takes a millisecond or more alone. */
#ifdef _OPENMP
static int split_tokens(const struct epx_cpu_plan *p) { return p->W == 1 && p->T * p->H >= ((int64_t)1 << 20); }
#endif

/* The hierarchical exchange stages its two hops on every transport: its
 * point is the rows each hop moves. */
static int reads_peers_in_place(const struct epx_cpu_plan *p, epx_comm_t comm) {
  return p->W > 1 && comm->ops->shared_address_space && !p->hier;
}

/* What a rank shows its peers in the handshake on a shared address space. */
static const void *peer_rows(const epx_cpu_call_t *c) { return (const void *)(uintptr_t)c->word[0]; }
static const void *peer_rows2(const epx_cpu_call_t *c) { return (const void *)(uintptr_t)c->word[2]; }
static const struct epx_cpu_plan *peer_plan(const epx_cpu_call_t *c) {
  return (const struct epx_cpu_plan *)(uintptr_t)c->word[1];
}

/* One call's state: its agreement, and the per-call `then` work. */
typedef struct move move_t;
typedef epx_status_t (*move_fn)(move_t *m, const epx_cpu_call_t *peers);
struct move {
  epx_cpu_call_ctx_t call;
  epx_buffer_t b;
  struct epx_cpu_plan *p;
  const char *fn;
  int in_place;
  move_fn work; /* the moves themselves: peers is NULL unless read in place */
  size_t row_bytes; /* forward moves: a row's bytes (the payload's, or an fp8 row's) */
  /* The call's arguments. */
  const void *src;
  void *dst;
  /* forward moves of fp8 rows: the scales, a second plane moved with each
   * row (src2 [T, row_bytes2] -> dst2 [N, row_bytes2]); row_bytes2 0: none */
  const void *src2;
  void *dst2;
  size_t row_bytes2;
  int weighted;
  const void *dot_x;          /* dispatch_backward: x, for grad_w */
  float *grad_w;              /* [T, K] or NULL */
  epx_combine_precision_t precision;
  const void **item_rows;     /* forward: each received item's row (kept for grad_w) */
  const float *back;          /* weight returns: one value per remote entry */
  const float *grad_recv_w;   /* weights_backward's input */
};

static epx_status_t then_move(void *ctx, const void *recv) {
  move_t *m = ctx;
  epx_status_t status = epx_cpu_call_agree(&m->call, recv);
  if (status != EPX_SUCCESS || !m->in_place) return status;
  return m->work(m, recv);
}

/* The handshake, then (staged transports) the moves: one entry for every
 * payload call. */
static epx_status_t run_call(move_t *m, epx_call_kind_t kind, epx_status_t local, epx_handle_t h) {
  m->p = h->cpu;
  if (m->p->W == 1) return local != EPX_SUCCESS ? local : m->work(m, NULL);
  epx_comm_t comm = m->b->comm;
  m->in_place = reads_peers_in_place(m->p, comm);
  epx_cpu_call_begin(&m->call, m->b, kind, m->fn, local, h);
  if (kind == EPX_CALL_COMBINE_BACKWARD || kind == EPX_CALL_DISPATCH_BACKWARD)
    m->call.mine.flags = m->grad_w ? EPX_CALL_GRAD_W : 0;
  m->call.mine.word[0] = (int64_t)(uintptr_t)m->src;
  m->call.mine.word[1] = (int64_t)(uintptr_t)m->p;
  m->call.mine.word[2] = (int64_t)(uintptr_t)m->src2;
  epx_cpu_call_t *blocks = epx_cpu_call_blocks(&m->call);
  if (!blocks) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", m->fn);
  epx_status_t status = epx_comm_handshake(comm, m->fn, blocks, blocks + comm->size, sizeof *blocks, then_move, m);
  free(blocks);
  if (status != EPX_SUCCESS || m->in_place) return status;
  return m->work(m, NULL);
}

/* ------------------------------------------------------------------------ */
/* Forward moves: x [T, H] -> layout [N, H]                                  */
/* ------------------------------------------------------------------------ */

static void zero_empty_rows(const struct epx_cpu_plan *p, void *rows, size_t row_bytes) {
  if (p->ll_fixed_shape) return; /* the low-latency shape's unused rows are left alone (epx.h) */
  for (int64_t i = 0; i < p->N; i++)
    if (p->row_src_rank[i] < 0) memset((char *)rows + (size_t)i * row_bytes, 0, row_bytes);
}

/* Copies (or scales by the route's weight) one row into layout row `row`,
 * and its second plane's row (src2: its scales) with it. */
static void put_row(const move_t *m, const void *src, const void *src2, float weight, int64_t row) {
  void *dst = (char *)m->dst + (size_t)row * m->row_bytes;
  if (m->weighted) epx_row_scale_stream(m->p->dtype, src, weight, dst, m->p->H);
  else epx_row_copy_stream(dst, src, m->row_bytes);
  if (m->row_bytes2) memcpy((char *)m->dst2 + (size_t)row * m->row_bytes2, src2, m->row_bytes2);
}

/* Staged rows carry both planes in one row: the row, then its second
 * plane's, padded to the payload vector (the row copies read 16-byte
 * vectors; for fp8 rows, epx_payload_fp8_packed_bytes). */
static size_t staged_row_bytes(const move_t *m) {
  const size_t v = EPX_PAYLOAD_VECTOR_BYTES;
  return m->row_bytes2 ? (m->row_bytes + m->row_bytes2 + v - 1) / v * v : m->row_bytes;
}

/* Token t's row (and second-plane row, then zeros to the padded end) at `to`. */
static void stage_row(const move_t *m, int64_t t, char *to) {
  memcpy(to, (const char *)m->src + (size_t)t * m->row_bytes, m->row_bytes);
  if (!m->row_bytes2) return;
  memcpy(to + m->row_bytes, (const char *)m->src2 + (size_t)t * m->row_bytes2, m->row_bytes2);
  memset(to + m->row_bytes + m->row_bytes2, 0, staged_row_bytes(m) - m->row_bytes - m->row_bytes2);
}

/* Where each received item's row (and second-plane row) is: in the peers'
 * src (read in place) or in this rank's staging, after the alltoallv or the
 * hierarchical hops. */
static epx_status_t forward_sources(move_t *m, const epx_cpu_call_t *peers, const void **item_src,
                                    const void **item_src2) {
  struct epx_cpu_plan *p = m->p;
  if (peers) {
    for (int32_t r = 0; r < p->W; r++) {
      if (r == p->rank || !p->ritem_count[r]) continue; /* a masked peer shows no plan (call.c) */
      const struct epx_cpu_plan *q = peer_plan(&peers[r]);
      const int32_t *tokens = q->item_token + q->item_displ[p->rank];
      for (int64_t i = 0; i < p->ritem_count[r]; i++) {
        item_src[p->ritem_displ[r] + i] = (const char *)peer_rows(&peers[r]) + (size_t)tokens[i] * m->row_bytes;
        if (m->row_bytes2)
          item_src2[p->ritem_displ[r] + i] = (const char *)peer_rows2(&peers[r]) + (size_t)tokens[i] * m->row_bytes2;
      }
    }
    return EPX_SUCCESS;
  }
  if (p->W == 1) return EPX_SUCCESS;
  struct epx_cpu_scratch *s = m->b->cpu;
  const size_t staged = staged_row_bytes(m);
  int64_t ritems = epx_cpu_total(p->ritem_count, p->W);
  epx_status_t status = EPX_SUCCESS;
  if (p->hier) {
    /* the hops move rows of one source: both planes staged together first,
     * in the send staging (the hops stage in their own) */
    const void *src = m->src;
    if (m->row_bytes2) {
      status = epx_cpu_ensure(&s->send, &s->send_bytes, (size_t)(p->T + 1) * staged, m->fn);
      if (status != EPX_SUCCESS) return status;
      for (int64_t t = 0; t < p->T; t++) stage_row(m, t, (char *)s->send + (size_t)t * staged);
      src = s->send;
    }
    status = epx_cpu_hier_forward(m->b, p, src, staged, item_src, m->fn);
  } else {
    epx_comm_t comm = m->b->comm;
    int64_t items = epx_cpu_total(p->item_count, p->W);
    status = epx_cpu_ensure(&s->send, &s->send_bytes, (size_t)items * staged, m->fn);
    if (status == EPX_SUCCESS) status = epx_cpu_ensure(&s->recv, &s->recv_bytes, (size_t)ritems * staged, m->fn);
    if (status != EPX_SUCCESS) return status;
    for (int64_t i = 0; i < items; i++) stage_row(m, p->item_token[i], (char *)s->send + (size_t)i * staged);
    status = comm->ops->alltoallv(comm, m->fn, s->send, p->item_count, p->item_displ, s->recv, p->ritem_count,
                                  p->ritem_displ, staged);
    for (int64_t i = 0; i < ritems; i++) item_src[i] = (const char *)s->recv + (size_t)i * staged;
  }
  if (m->row_bytes2)
    for (int64_t i = 0; i < ritems && status == EPX_SUCCESS; i++) item_src2[i] = (const char *)item_src[i] + m->row_bytes;
  return status;
}

/* Sends src's rows to the layout of every rank; weighted: scale each copy by
 * its route's weight. Keeps m->item_rows (caller frees) for grad_w: read in
 * place, they point into the peers' src, valid while the peers are in this
 * same call. */
static epx_status_t forward_work(move_t *m, const epx_cpu_call_t *peers) {
  struct epx_cpu_plan *p = m->p;
  int64_t ritems = epx_cpu_total(p->ritem_count, p->W);
  const size_t slots = (size_t)(ritems ? ritems : 1);
  const void **item_src = malloc(sizeof(void *) * slots * (m->row_bytes2 ? 2 : 1));
  if (!item_src) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", m->fn);
  const void **item_src2 = m->row_bytes2 ? item_src + slots : NULL;
  epx_status_t status = forward_sources(m, peers, item_src, item_src2);
  if (status != EPX_SUCCESS) {
    free(item_src);
    return status;
  }
  zero_empty_rows(p, m->dst, m->row_bytes);
  if (m->row_bytes2) zero_empty_rows(p, m->dst2, m->row_bytes2);
  int rank_major = p->layout == EPX_LAYOUT_RANK_MAJOR;
  /* Tokens are independent; one rank alone may use every core. */
  EPX_OMP(parallel for schedule(static) if (split_tokens(p)))
  for (int64_t t = 0; t < p->T; t++) {
    const char *x = (const char *)m->src + (size_t)t * m->row_bytes;
    const char *x2 = m->row_bytes2 ? (const char *)m->src2 + (size_t)t * m->row_bytes2 : NULL;
    int32_t written = -1;
    for (int32_t k = 0; k < p->K; k++) {
      int32_t row = p->self_row[t * p->K + k];
      if (row < 0 || (rank_major && row == written)) continue;
      put_row(m, x, x2, p->topk_w[t * p->K + k], row);
      written = row;
    }
  }
  for (int64_t i = 0; i < ritems; i++) {
    for (int64_t j = p->ritem_entry[i]; j < p->ritem_entry[i + 1]; j++) {
      if (rank_major && j > p->ritem_entry[i]) break;
      put_row(m, item_src[i], item_src2 ? item_src2[i] : NULL, p->entry_weight[j], p->entry_row[j]);
    }
  }
  epx_stream_fence();
  m->item_rows = item_src;
  return EPX_SUCCESS;
}

epx_status_t epx_cpu_dispatch(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *x, void *recv_x) {
  move_t m = {.b = b, .fn = "epx_dispatch", .work = forward_work, .src = x, .dst = recv_x,
              .row_bytes = h->cpu->row_bytes, .weighted = h->cpu->weighting == EPX_WEIGHTS_IN_DISPATCH};
  epx_status_t status = run_call(&m, EPX_CALL_DISPATCH, local, h);
  free(m.item_rows);
  return status;
}

epx_status_t epx_cpu_dispatch_rows(epx_buffer_t b, epx_handle_t h, epx_status_t local, const char *fn,
                                   epx_call_kind_t kind, const void *rows, void *recv_rows, size_t row_bytes) {
  return epx_cpu_dispatch_planes(b, h, local, fn, kind, rows, NULL, recv_rows, NULL, row_bytes, 0);
}

epx_status_t epx_cpu_dispatch_planes(epx_buffer_t b, epx_handle_t h, epx_status_t local, const char *fn,
                                     epx_call_kind_t kind, const void *rows, const void *rows2, void *recv_rows,
                                     void *recv_rows2, size_t row_bytes, size_t row_bytes2) {
  move_t m = {.b = b, .fn = fn, .work = forward_work, .src = rows, .dst = recv_rows, .row_bytes = row_bytes,
              .src2 = rows2, .dst2 = recv_rows2, .row_bytes2 = row_bytes2};
  epx_status_t status = run_call(&m, kind, local, h);
  free(m.item_rows);
  return status;
}

/* ------------------------------------------------------------------------ */
/* Backward moves: layout [N, H] -> out [T, H]                               */
/* ------------------------------------------------------------------------ */

/* A thread's rows for one token: the float32 accumulator, a partial and its
 * rounding to the payload dtype, and one P(t, r)'s inputs. */
typedef struct {
  float *acc, *partial, *node_acc; /* node_acc: a node's Q(t, n) (two-level sums) */
  void *rounded;
  const void **rows;
  float *w;
} token_scratch_t;

static void token_scratch_free(token_scratch_t *t) {
  free(t->acc), free(t->partial), free(t->node_acc), free(t->rounded), free(t->rows), free(t->w);
}

static int token_scratch_init(token_scratch_t *t, const struct epx_cpu_plan *p) {
  t->acc = malloc(sizeof(float) * (size_t)p->H);
  t->partial = malloc(sizeof(float) * (size_t)p->H);
  t->node_acc = malloc(sizeof(float) * (size_t)p->H);
  t->rounded = malloc(p->row_bytes);
  /* A pair received from a peer has up to its top_k routes, at most the
   * buffer's max_top_k (record_k), more than this rank's K perhaps. */
  t->rows = malloc(sizeof(void *) * (size_t)p->record_k);
  t->w = malloc(sizeof(float) * (size_t)p->record_k);
  return t->acc && t->partial && t->node_acc && t->rounded && t->rows && t->w;
}

typedef struct {
  const struct epx_cpu_plan *p;
  const void *rows;        /* the layout [N, H] */
  const void *const *home; /* each returned row, per rank from sdispl */
  return_mode_t mode;
  int weighted;
  int round_partials; /* EPX_COMBINE_PARTIALS_PAYLOAD on a 16-bit payload */
  const void *dot_x;  /* [T, H] or NULL */
  float *grad_w;      /* [T, K] or NULL */
  void *out;          /* [T, H] */
  epx_comm_t topo;    /* the comm: the nodes the sum goes by */
} token_pass_t;

/* acc = P' (first) or acc += P' for a partial already rounded to the
 * payload dtype: exactly its value, with no 0 + in front (which would turn a
 * partial rounded to -0 into +0, and a token on one rank would no longer get
 * round(P), the same bits as float32 partials). */
static void add_rounded(epx_dtype_t dtype, const void *row, float *acc, int first, int64_t n) {
  if (first) {
    epx_row_to_f32(dtype, row, acc, n);
    return;
  }
  for (int64_t i = 0; i < n; i++) acc[i] += epx_load(dtype, row, i);
}

/* acc (+)= P(t, r) of one group of rows, rounded first if the partials are. */
static void add_partial(const token_pass_t *c, token_scratch_t *ts, const void **rows, const float *w, int32_t n,
                        float *acc, int first) {
  const struct epx_cpu_plan *p = c->p;
  if (!c->round_partials) {
    epx_rows_accumulate(p->dtype, rows, w, n, acc, first, p->H);
    return;
  }
  epx_rows_accumulate(p->dtype, rows, w, n, ts->partial, 1, p->H);
  epx_row_from_f32(p->dtype, ts->partial, ts->rounded, p->H);
  add_rounded(p->dtype, ts->rounded, acc, first, p->H);
}

/* The rows of P(t, r) (and grad_w's dots); returns how many. */
static int32_t group_of(const token_pass_t *c, int64_t t, int32_t r, int64_t *cursor, token_scratch_t *ts) {
  const struct epx_cpu_plan *p = c->p;
  int32_t K = p->K, n = 0;
  const int32_t *idx = p->topk_idx + t * K;
  const char *x = c->dot_x ? (const char *)c->dot_x + (size_t)t * p->row_bytes : NULL;
  for (int32_t k = 0; k < K; k++) {
    if (idx[k] < 0 || epx_placement_rank(p->place, idx[k]) != r) continue;
    if (r != p->rank && c->mode != RETURN_ROUTES) {
      /* One returned row stands for the pair. */
      if (n == 0) ts->rows[n++] = c->home[cursor[r]++];
      continue;
    }
    if (c->mode == RETURN_PAIRS && n > 0) continue;
    const void *row = r == p->rank ? (const char *)c->rows + (size_t)p->self_row[t * K + k] * p->row_bytes
                                   : c->home[cursor[r]++];
    ts->rows[n] = row;
    ts->w[n++] = p->topk_w[t * K + k];
    if (c->grad_w) c->grad_w[t * K + k] = epx_row_dot(p->dtype, row, x, p->H);
  }
  return n;
}

/* out[t] = round(sum over ranks in order of P(t, r)); on a comm of several
 * nodes of more than one rank, the sum over the nodes in order of each
 * node's sum Q(t, n) (epx.h; the hierarchical exchange forms the same). */
static void combine_token(const token_pass_t *c, int64_t t, int64_t *cursor, token_scratch_t *ts) {
  const struct epx_cpu_plan *p = c->p;
  int32_t K = p->K;
  const int32_t *idx = p->topk_idx + t * K;
  void *out_row = (char *)c->out + (size_t)t * p->row_bytes;
  int first = 1;
  if (c->grad_w)
    for (int32_t k = 0; k < K; k++) c->grad_w[t * K + k] = 0.0f;
  /* A token whose routes all sit on one rank (always, with one rank) is one
   * group: out = round(0 + P) in a single pass. */
  int32_t only_rank = -1;
  for (int32_t k = 0; k < K; k++) {
    if (idx[k] < 0) continue;
    int32_t r = epx_placement_rank(p->place, idx[k]);
    only_rank = only_rank == -1 || only_rank == r ? r : -2;
  }
  const struct epx_comm *topo = c->topo;
  int two_level = topo->num_nodes > 1 && topo->num_nodes < p->W;
  float *sum = two_level ? ts->node_acc : ts->acc;
  for (int32_t g = 0; g < topo->num_nodes; g++) {
    int node_first = 1;
    for (int32_t i = topo->node_first[g]; i < topo->node_first[g + 1]; i++) {
      int32_t r = topo->node_ranks[i];
      int32_t n = group_of(c, t, r, cursor, ts);
      if (n == 0) continue;
      int into_first = two_level ? node_first : first;
      const float *weights = c->weighted && c->mode != RETURN_PAIRS ? ts->w : NULL;
      if (r != p->rank && c->mode == RETURN_PARTIAL) {
        /* The receiver's P(t, r), float32 or already rounded. */
        epx_cpu_add_partial(p->dtype, ts->rows[0], c->round_partials, sum, into_first, p->H);
      } else if (only_rank == r) {
        /* round(round(P)) = round(P): the same in both precisions. */
        epx_rows_sum_store(p->dtype, ts->rows, weights, n, out_row, p->H);
        return;
      } else if (c->mode == RETURN_PAIRS) {
        /* P(t, r) = 0 + the pair's row, which rounding leaves as it is. */
        epx_rows_accumulate(p->dtype, ts->rows, NULL, n, sum, into_first, p->H);
      } else {
        add_partial(c, ts, ts->rows, weights, n, sum, into_first);
      }
      node_first = 0;
      if (!two_level) first = 0;
    }
    if (two_level && !node_first) {
      /* Q'(t, n) into the sum, as the hierarchical exchange's relay sends it. */
      if (c->round_partials) epx_row_from_f32(p->dtype, sum, ts->rounded, p->H);
      epx_cpu_add_partial(p->dtype, c->round_partials ? ts->rounded : (const void *)sum, c->round_partials, ts->acc,
                          first, p->H);
      first = 0;
    }
  }
  if (first) memset(ts->acc, 0, (size_t)p->H * sizeof(float));
  epx_row_from_f32_stream(p->dtype, ts->acc, out_row, p->H);
}

/* The tokens' side. With one rank every row is local and tokens are
 * independent, so they are split over the cores; otherwise the returned rows
 * are consumed in token order through the per-rank cursors. */
static epx_status_t token_pass(const token_pass_t *c, const int64_t *sdispl, const char *fn) {
  const struct epx_cpu_plan *p = c->p;
  int64_t cursor_stack[64];
  int64_t *cursor = p->W > 64 ? malloc(sizeof(int64_t) * (size_t)p->W) : cursor_stack;
  if (!cursor) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t r = 0; r < p->W; r++) cursor[r] = sdispl[r];
  int failed = 0;
  EPX_OMP(parallel reduction(| : failed) if (split_tokens(p)))
  {
    token_scratch_t ts = {0};
    failed = !token_scratch_init(&ts, p);
    /* Every thread must reach the worksharing loop (a thread that skips it
     * leaves the others at its barrier); one without scratch idles. */
    EPX_OMP(for schedule(static))
    for (int64_t t = 0; t < p->T; t++)
      if (!failed) combine_token(c, t, cursor, &ts);
    token_scratch_free(&ts);
  }
  epx_stream_fence();
  if (cursor != cursor_stack) free(cursor);
  return failed ? epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn) : EPX_SUCCESS;
}

/* The dedup exchange's receiver side: P(t, r) of each pair received, summed
 * here (rounded to the payload dtype if the partials are), into s->send. */
static epx_status_t receiver_partials(move_t *m, const token_pass_t *c, size_t unit) {
  struct epx_cpu_plan *p = m->p;
  struct epx_cpu_scratch *s = m->b->cpu;
  int64_t rpairs = epx_cpu_total(p->rpair_count, p->W);
  epx_status_t status = epx_cpu_ensure(&s->send, &s->send_bytes, (size_t)rpairs * unit, m->fn);
  token_scratch_t ts = {0};
  if (status == EPX_SUCCESS && !token_scratch_init(&ts, p)) status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", m->fn);
  for (int64_t q = 0; q < rpairs && status == EPX_SUCCESS; q++) {
    int32_t n = 0;
    for (int64_t j = p->rpair_entry[q]; j < p->rpair_entry[q + 1]; j++) {
      ts.rows[n] = (const char *)m->src + (size_t)p->entry_row[j] * p->row_bytes;
      ts.w[n++] = p->entry_weight[j];
    }
    void *to = (char *)s->send + (size_t)q * unit;
    epx_rows_accumulate(p->dtype, ts.rows, c->weighted ? ts.w : NULL, n, c->round_partials ? ts.partial : to, 1, p->H);
    if (c->round_partials) epx_row_from_f32(p->dtype, ts.partial, to, p->H);
  }
  token_scratch_free(&ts);
  return status;
}

/* Where each row coming home is: read in place in the peers' layouts, or
 * staged and exchanged (the receiver's partials, or the routes' rows). */
static epx_status_t home_rows(move_t *m, const token_pass_t *c, const epx_cpu_call_t *peers, const void **home) {
  struct epx_cpu_plan *p = m->p;
  return_mode_t mode = c->mode;
  int32_t W = p->W;
  const int64_t *scount = mode == RETURN_ROUTES ? p->route_count : p->pair_count;
  const int64_t *sdispl = mode == RETURN_ROUTES ? p->route_displ : p->pair_displ;
  if (peers) {
    for (int32_t r = 0; r < W; r++) {
      if (r == p->rank || !scount[r]) continue; /* a masked peer shows no plan (call.c) */
      const struct epx_cpu_plan *q = peer_plan(&peers[r]);
      const char *their_rows = peer_rows(&peers[r]);
      for (int64_t j = 0; j < scount[r]; j++) {
        int64_t entry = mode == RETURN_ROUTES ? q->rroute_displ[p->rank] + j : q->rpair_entry[q->rpair_displ[p->rank] + j];
        home[sdispl[r] + j] = their_rows + (size_t)q->entry_row[entry] * p->row_bytes;
      }
    }
    return EPX_SUCCESS;
  }
  struct epx_cpu_scratch *s = m->b->cpu;
  size_t unit = mode == RETURN_PARTIAL && !c->round_partials ? (size_t)p->H * sizeof(float) : p->row_bytes;
  const int64_t *rcount = mode == RETURN_ROUTES ? p->rroute_count : p->rpair_count;
  const int64_t *rdispl = mode == RETURN_ROUTES ? p->rroute_displ : p->rpair_displ;
  int64_t back_rows = epx_cpu_total(rcount, W), home_count = epx_cpu_total(scount, W);
  epx_status_t status = epx_cpu_ensure(&s->recv, &s->recv_bytes, (size_t)home_count * unit, m->fn);
  if (status == EPX_SUCCESS && mode == RETURN_PARTIAL) status = receiver_partials(m, c, unit);
  if (status == EPX_SUCCESS && mode != RETURN_PARTIAL) {
    status = epx_cpu_ensure(&s->send, &s->send_bytes, (size_t)back_rows * unit, m->fn);
    for (int64_t j = 0; j < back_rows && status == EPX_SUCCESS; j++) {
      int64_t entry = mode == RETURN_ROUTES ? j : p->rpair_entry[j];
      memcpy((char *)s->send + (size_t)j * unit, (const char *)m->src + (size_t)p->entry_row[entry] * p->row_bytes, unit);
    }
  }
  if (status == EPX_SUCCESS)
    status = m->b->comm->ops->alltoallv(m->b->comm, m->fn, s->send, rcount, rdispl, s->recv, scount, sdispl, unit);
  for (int64_t j = 0; j < home_count; j++) home[j] = (const char *)s->recv + (size_t)j * unit;
  return status;
}

/* m->src from the layout, combined per token in the canonical order. */
static epx_status_t backward_work(move_t *m, const epx_cpu_call_t *peers) {
  struct epx_cpu_plan *p = m->p;
  /* Reading peers in place, summing a pair on its receiver first would only
   * add a pass: the token's rank reads the rows themselves (same sums). */
  return_mode_t mode = p->layout == EPX_LAYOUT_RANK_MAJOR ? RETURN_PAIRS
                       : (p->exchange == EPX_EXCHANGE_COLLECTIVE || m->grad_w || m->in_place) ? RETURN_ROUTES
                                                                                                : RETURN_PARTIAL;
  token_pass_t c = {p, m->src, NULL, mode, m->weighted,
                    m->precision == EPX_COMBINE_PARTIALS_PAYLOAD && p->dtype != EPX_FLOAT32, m->dot_x, m->grad_w,
                    m->dst, m->b->comm};
  if (p->hier && mode == RETURN_PARTIAL)
    return epx_cpu_hier_combine(m->b, p, m->src, m->dst, m->weighted, c.round_partials, m->fn);
  const int64_t *scount = mode == RETURN_ROUTES ? p->route_count : p->pair_count;
  const int64_t *sdispl = mode == RETURN_ROUTES ? p->route_displ : p->pair_displ;
  int64_t home_count = epx_cpu_total(scount, p->W);
  const void **home = malloc(sizeof(void *) * (size_t)(home_count ? home_count : 1));
  if (!home) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", m->fn);
  epx_status_t status = p->W > 1 ? home_rows(m, &c, peers, home) : EPX_SUCCESS;
  c.home = home;
  if (status == EPX_SUCCESS) status = token_pass(&c, sdispl, m->fn);
  free(home);
  return status;
}

epx_status_t epx_cpu_combine(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *expert_out, void *out) {
  return epx_cpu_combine_as(b, h, local, expert_out, out, "epx_combine");
}

epx_status_t epx_cpu_combine_as(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *expert_out, void *out,
                                const char *fn) {
  move_t m = {.b = b, .fn = fn, .work = backward_work, .src = expert_out, .dst = out,
              .weighted = h->cpu->weighting == EPX_WEIGHTS_IN_COMBINE, .precision = h->cpu->precision};
  return run_call(&m, EPX_CALL_COMBINE, local, h);
}

epx_status_t epx_cpu_dispatch_backward(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *grad_recv_x,
                                       void *grad_x, const void *x, float *grad_w) {
  move_t m = {.b = b, .fn = "epx_dispatch_backward", .work = backward_work, .src = grad_recv_x, .dst = grad_x,
              .weighted = h->cpu->weighting == EPX_WEIGHTS_IN_DISPATCH, .dot_x = x, .grad_w = grad_w,
              .precision = EPX_COMBINE_PARTIALS_FLOAT32};
  return run_call(&m, EPX_CALL_DISPATCH_BACKWARD, local, h);
}

/* ------------------------------------------------------------------------ */
/* Weight gradients: one float per remote route back to its source           */
/* ------------------------------------------------------------------------ */

/* Each remote route's value (back[j] for this rank's remote entry j, or, read
 * in place, a peer's) stored at grad_w[t, k] of this rank's routes on other
 * ranks, in token order. Local routes' values are the caller's. */
static epx_status_t return_route_values(move_t *m, const epx_cpu_call_t *peers) {
  const struct epx_cpu_plan *p = m->p;
  int32_t W = p->W, K = p->K;
  if (W == 1) return EPX_SUCCESS;
  epx_status_t status = EPX_SUCCESS;
  int64_t home_count = epx_cpu_total(p->route_count, W);
  float *home = malloc(sizeof(float) * (size_t)(home_count ? home_count : 1));
  int64_t cursor_stack[64];
  int64_t *cursor = W > 64 ? malloc(sizeof(int64_t) * (size_t)W) : cursor_stack;
  if (!home || !cursor) OOM(m->fn);
  if (peers) {
    for (int32_t r = 0; r < W; r++) {
      if (r == p->rank || !p->route_count[r]) continue; /* a masked peer shows no plan (call.c) */
      const struct epx_cpu_plan *q = peer_plan(&peers[r]);
      const float *theirs = (const float *)peer_rows(&peers[r]) + q->rroute_displ[p->rank];
      if (p->route_count[r]) memcpy(home + p->route_displ[r], theirs, sizeof(float) * (size_t)p->route_count[r]);
    }
  } else {
    EPX_CHECK(m->b->comm->ops->alltoallv(m->b->comm, m->fn, m->back, p->rroute_count, p->rroute_displ, home,
                                         p->route_count, p->route_displ, sizeof(float)));
  }
  for (int32_t r = 0; r < W; r++) cursor[r] = p->route_displ[r];
  for (int64_t t = 0; t < p->T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = p->topk_idx[t * K + k];
      if (e >= 0 && epx_placement_rank(p->place, e) != p->rank)
        m->grad_w[t * K + k] = home[cursor[epx_placement_rank(p->place, e)]++];
    }
fail:
  if (cursor != cursor_stack) free(cursor);
  free(home);
  return status;
}

/* grad_expert_out(t,k) = w * grad_out[t] (a dispatch of grad_out), and the
 * weight gradient <grad_out[t], expert_out(t,k)> computed where expert_out
 * lives, then returned one float per route (a second synchronisation: the
 * values exist only once the rows have moved). */
epx_status_t epx_cpu_combine_backward(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *grad_out,
                                      const void *expert_out, void *grad_expert_out, float *grad_w) {
  move_t m = {.b = b, .fn = "epx_combine_backward", .work = forward_work, .src = grad_out, .dst = grad_expert_out,
              .row_bytes = h->cpu->row_bytes, .weighted = h->cpu->weighting == EPX_WEIGHTS_IN_COMBINE, .grad_w = grad_w};
  float *back = NULL;
  epx_status_t status = run_call(&m, EPX_CALL_COMBINE_BACKWARD, local, h);
  if (status != EPX_SUCCESS || !grad_w) goto fail;
  struct epx_cpu_plan *p = h->cpu;
  int32_t K = p->K;
  back = malloc(sizeof(float) * (size_t)(epx_cpu_total(p->rroute_count, p->W) + 1));
  if (!back) OOM(m.fn);
  /* Received rows' dots (their rows stay valid: the peers are in this same
   * call until the exchange below). */
  int64_t ritems = epx_cpu_total(p->ritem_count, p->W);
  for (int64_t i = 0; i < ritems; i++)
    for (int64_t j = p->ritem_entry[i]; j < p->ritem_entry[i + 1]; j++)
      back[j] = epx_row_dot(p->dtype, m.item_rows[i], (const char *)expert_out + (size_t)p->entry_row[j] * p->row_bytes, p->H);
  /* Local routes' dots (independent per token), then the returned ones. */
  EPX_OMP(parallel for schedule(static) if (split_tokens(p)))
  for (int64_t t = 0; t < p->T; t++) {
    const char *g = (const char *)grad_out + (size_t)t * p->row_bytes;
    for (int32_t k = 0; k < K; k++) {
      int32_t row = p->self_row[t * K + k];
      grad_w[t * K + k] = row >= 0 ? epx_row_dot(p->dtype, g, (const char *)expert_out + (size_t)row * p->row_bytes, p->H) : 0.0f;
    }
  }
  m.back = back;
  status = return_route_values(&m, NULL);
fail:
  free(back);
  free(m.item_rows);
  return status;
}

/* The gradient of weights the expert applied itself: each route's value
 * where its row lives ([N] or, rank-major, [N, K] by source slot), returned
 * to grad_w[t, k] of its source — inside the handshake on the local
 * transport (each rank's values are ready before it), after it elsewhere. */
static epx_status_t weights_work(move_t *m, const epx_cpu_call_t *peers) {
  const struct epx_cpu_plan *p = m->p;
  int32_t K = p->K, slots = p->row_slots;
  for (int64_t t = 0; t < p->T; t++)
    for (int32_t k = 0; k < K; k++) {
      int32_t row = p->self_row[t * K + k];
      m->grad_w[t * K + k] = row >= 0 ? m->grad_recv_w[(int64_t)row * slots + (slots > 1 ? k : 0)] : 0.0f;
    }
  return return_route_values(m, peers);
}

epx_status_t epx_cpu_weights_backward(epx_buffer_t b, epx_handle_t h, epx_status_t local, const float *grad_recv_w,
                                      float *grad_w) {
  const char *fn = "epx_weights_backward";
  struct epx_cpu_plan *p = h->cpu;
  int32_t slots = p->row_slots;
  int64_t back_count = epx_cpu_total(p->rroute_count, p->W);
  /* The values peers take home, ready before the handshake (private until
   * the call is agreed). */
  float *back = malloc(sizeof(float) * (size_t)(back_count ? back_count : 1));
  if (!back && local == EPX_SUCCESS) local = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  if (local == EPX_SUCCESS)
    for (int64_t j = 0; j < back_count; j++)
      back[j] = grad_recv_w[p->entry_row[j] * slots + (slots > 1 ? p->entry_slot[j] : 0)];
  move_t m = {.b = b, .fn = fn, .work = weights_work, .src = back, .back = back, .grad_recv_w = grad_recv_w,
              .grad_w = grad_w};
  epx_status_t status = run_call(&m, EPX_CALL_WEIGHTS_BACKWARD, local, h);
  free(back);
  return status;
}
