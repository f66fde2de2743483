/* libFuzzer target for the one-rank API (a self comm): each input is a
 * program of calls — buffers created and destroyed with odd configs, layouts
 * of valid and invalid routings (with and without a recorder), handles
 * retained, released and used after release, payload calls with exact and
 * short outputs, recorders recording and replaying, stale and made-up ids.
 *
 * Besides ASan/UBSan, a model of what the caller holds is the oracle; a
 * finding stops the run (abort) with one line saying what broke:
 *  - a call given a value the caller no longer holds (released handle,
 *    destroyed buffer or recorder) must be refused, never succeed;
 *  - retain/release on a held handle succeed, beyond it they are refused;
 *  - a buffer with handles alive (the caller's or a recorder's) is BUSY;
 *  - a refused payload call changes no byte of its outputs;
 *  - combine(dispatch(x)) of a float32 expert-major buffer equals
 *    sum over kept routes of w * x (identity experts);
 *  - the registry never holds more slots than the objects alive need.
 * Everything is released at the end of each input (leaks are findings too). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/registry.h"
#include "epx.h"

#define MAX_BUFFERS 3
#define MAX_HANDLES 8
#define MAX_RECORDERS 2
#define MAX_STALE 16
#define MAX_T 16
#define MAX_K 4

typedef struct {
  const uint8_t *p;
  size_t n;
} input_t;

static uint8_t take(input_t *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}

static void finding(const char *what, const char *call, epx_status_t status) {
  fprintf(stderr, "fuzz_api finding: %s (%s returned %s: %s)\n", what, call,
          epx_status_string(status), epx_last_error());
  abort();
}

/* What the run did, for its last line. */
static uint64_t programs, operations, round_trips, refusals;

typedef struct {
  epx_buffer_t id; /* NULL: free slot */
  epx_buffer_config_t c;
} fbuffer_t;

typedef struct {
  epx_handle_t id; /* NULL: free slot */
  int buffer;
  int64_t caller_refs, recorder_refs;
  int64_t T, N;
  int32_t K;
  epx_weighting_t weighting;
  int32_t idx[MAX_T * MAX_K];
  float w[MAX_T * MAX_K];
} fhandle_t;

typedef struct {
  epx_recorder_t id;
  int replaying;
  int records[MAX_HANDLES]; /* handle slots it holds, in order */
  int count;
} frecorder_t;

typedef struct {
  epx_comm_t comm;
  fbuffer_t buffers[MAX_BUFFERS];
  fhandle_t handles[MAX_HANDLES];
  frecorder_t recorders[MAX_RECORDERS];
  void *stale[MAX_STALE]; /* ids the caller gave back: must stay refused */
  int stale_count;
} state_t;

static void forget(state_t *s, void *id) { s->stale[s->stale_count++ % MAX_STALE] = id; }

static void *stale_value(state_t *s, input_t *in) {
  if (!s->stale_count) return NULL;
  int n = s->stale_count < MAX_STALE ? s->stale_count : MAX_STALE;
  return s->stale[take(in) % n];
}

/* A value that is no id at all (or, rarely, by luck, a live one). */
static void *made_up_value(input_t *in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = v << 8 | take(in);
  return (void *)(uintptr_t)v;
}

static void handle_drop_if_dead(state_t *s, int h) {
  fhandle_t *m = &s->handles[h];
  if (m->caller_refs == 0 && m->recorder_refs == 0) {
    forget(s, m->id);
    m->id = NULL;
  }
}

static int find_handle(state_t *s, epx_handle_t id) {
  for (int h = 0; h < MAX_HANDLES; h++)
    if (s->handles[h].id && s->handles[h].id == id) return h;
  return -1;
}

static void *alloc_bytes(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 16, bytes ? bytes : 16)) abort();
  memset(p, 0xA5, bytes ? bytes : 16);
  return p;
}

/* ------------------------------------------------------------------------ */
/* Buffers                                                                   */
/* ------------------------------------------------------------------------ */

static const int64_t odd_hidden[] = {0, -8, 12, INT64_MAX - 7, (int64_t)1 << 40, (int64_t)1 << 60};

static void op_buffer_create(state_t *s, input_t *in) {
  int slot = take(in) % MAX_BUFFERS;
  if (s->buffers[slot].id) return;
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  uint8_t a = take(in), b = take(in), d = take(in);
  c.dtype = (epx_dtype_t)(a % 3);
  c.layout = (epx_layout_t)((a / 3) % 3);
  c.exchange = (a / 9) % 2 ? EPX_EXCHANGE_COLLECTIVE : EPX_EXCHANGE_DEDUP;
  c.hidden = 8 * (1 + b % 4);
  if (b >= 250) c.hidden = odd_hidden[b - 250];
  c.num_experts = 1 << (d % 5);
  c.max_top_k = 1 + (d / 5) % (c.num_experts < MAX_K ? c.num_experts : MAX_K);
  uint8_t e = take(in);
  c.max_tokens_per_rank = e % 3 == 0 ? 0 : 1 + e % MAX_T;
  c.max_tokens_rounding = 1 + (e / 16) % 8;
  c.expert_alignment = 1 + take(in) % 4;
  c.capacity = c.layout == EPX_LAYOUT_CAPACITY ? 1 + take(in) % 6 : 0;
  if (d >= 250) c.max_top_k = c.num_experts + 1; /* refused */
  epx_buffer_t id = (epx_buffer_t)(uintptr_t)0xb0f;
  epx_status_t status = epx_buffer_create(s->comm, &c, &id);
  if (status == EPX_SUCCESS) {
    s->buffers[slot].id = id;
    s->buffers[slot].c = c;
  } else if (id != (epx_buffer_t)(uintptr_t)0xb0f) {
    finding("a refused buffer create wrote its output", "epx_buffer_create", status);
  }
}

static int buffer_busy(state_t *s, int slot) {
  for (int h = 0; h < MAX_HANDLES; h++)
    if (s->handles[h].id && s->handles[h].buffer == slot) return 1;
  return 0;
}

static void op_buffer_destroy(state_t *s, input_t *in) {
  uint8_t how = take(in);
  if (how % 4 == 0) {
    epx_status_t status = epx_buffer_destroy(stale_value(s, in));
    if (status == EPX_SUCCESS && s->stale_count) finding("a stale buffer was destroyed", "epx_buffer_destroy", status);
    return;
  }
  int slot = how % MAX_BUFFERS;
  if (!s->buffers[slot].id) return;
  epx_status_t status = epx_buffer_destroy(s->buffers[slot].id);
  if (buffer_busy(s, slot)) {
    if (status != EPX_ERROR_BUSY) finding("a buffer with live handles was not BUSY", "epx_buffer_destroy", status);
    return;
  }
  if (status != EPX_SUCCESS) finding("an idle buffer did not destroy", "epx_buffer_destroy", status);
  forget(s, s->buffers[slot].id);
  s->buffers[slot].id = NULL;
}

/* ------------------------------------------------------------------------ */
/* Layouts                                                                   */
/* ------------------------------------------------------------------------ */

/* Valid routings most of the time (so the deeper paths run), raw bytes
 * otherwise. locations are capacity slots; a route past the capacity is
 * dropped (-1), as the router would. */
static void make_routing(input_t *in, const epx_buffer_config_t *c, int64_t *T, int32_t *K,
                         int32_t *idx, float *w, int32_t *loc) {
  uint8_t mode = take(in);
  *T = take(in) % (MAX_T + 1);
  *K = 1 + take(in) % c->max_top_k;
  if (mode % 16 == 0) *K = c->max_top_k + 1 <= MAX_K ? c->max_top_k + 1 : *K;
  int32_t fill[16] = {0};
  for (int64_t t = 0; t < *T; t++) {
    uint8_t start = take(in);
    for (int32_t k = 0; k < *K; k++) {
      int64_t i = t * *K + k;
      if (mode % 4 == 0) {
        idx[i] = (int32_t)(take(in) % (c->num_experts + 3)) - 1;
        loc[i] = (int32_t)(take(in) % 8) - 1;
      } else {
        idx[i] = (int32_t)((start + k) % c->num_experts);
        if (take(in) % 8 == 0) idx[i] = -1;
        loc[i] = idx[i] >= 0 ? fill[idx[i]]++ : -1;
        if (c->layout == EPX_LAYOUT_CAPACITY && idx[i] >= 0 && loc[i] >= c->capacity) idx[i] = -1, loc[i] = -1;
      }
      uint8_t v = take(in);
      w[i] = v == 255 ? NAN : (float)v / 64.0f - 0.5f;
    }
  }
}

/* Where a value passed as a handle came from. */
enum { FROM_SLOT, FROM_STALE, FROM_MADE_UP };

/* A handle value to pass: a model slot's (*slot >= 0; its id may be NULL),
 * a stale id, or a made-up value. */
static epx_handle_t handle_value(state_t *s, input_t *in, int *slot, int *from) {
  uint8_t how = take(in);
  *slot = -1;
  *from = how % 8 == 0 ? FROM_STALE : how % 8 == 1 ? FROM_MADE_UP : FROM_SLOT;
  if (*from == FROM_STALE) return stale_value(s, in);
  if (*from == FROM_MADE_UP) return made_up_value(in);
  *slot = (how / 8) % MAX_HANDLES;
  return s->handles[*slot].id;
}

/* The verdict on a call given a handle value: refusals of values the caller
 * does not hold are required; 1 when the call's model effects apply. */
static int judge_handle(state_t *s, int slot, int from, epx_handle_t id, epx_status_t status, const char *call) {
  if (from == FROM_MADE_UP) return 0;
  int held = from == FROM_SLOT && id && s->handles[slot].caller_refs > 0;
  if (!held && id && status == EPX_SUCCESS) finding("a value the caller does not hold was accepted", call, status);
  return held && status == EPX_SUCCESS;
}

static void op_layout(state_t *s, input_t *in) {
  int b = take(in) % MAX_BUFFERS, hslot = -1;
  for (int h = 0; h < MAX_HANDLES && hslot < 0; h++)
    if (!s->handles[h].id) hslot = h;
  if (!s->buffers[b].id || hslot < 0) return;
  const epx_buffer_config_t *c = &s->buffers[b].c;
  fhandle_t m = {0};
  int32_t loc[MAX_T * MAX_K];
  int32_t K = 1;
  make_routing(in, c, &m.T, &K, m.idx, m.w, loc);
  m.K = K;
  m.weighting = c->layout == EPX_LAYOUT_RANK_MAJOR ? EPX_WEIGHTS_NONE : (epx_weighting_t)(take(in) % 3);
  uint8_t r = take(in);
  frecorder_t *rec = r % 3 < MAX_RECORDERS && s->recorders[r % 3].id ? &s->recorders[r % 3] : NULL;
  epx_routing_t routing = {m.T, m.K, m.idx, m.weighting == EPX_WEIGHTS_NONE && r % 2 ? NULL : m.w,
                           c->layout == EPX_LAYOUT_CAPACITY ? loc : NULL, m.weighting};
  epx_handle_t id = NULL;
  epx_status_t status = epx_dispatch_layout(s->buffers[b].id, &routing, rec ? rec->id : NULL, &id);
  if (status != EPX_SUCCESS) return;
  int old = find_handle(s, id);
  if (old >= 0) {
    /* A replay: the handle must be one this recorder holds. */
    int held = 0;
    for (int i = 0; rec && i < rec->count; i++) held |= rec->records[i] == old;
    if (!held || !rec->replaying) finding("a layout returned a live handle its recorder does not hold", "epx_dispatch_layout", status);
    s->handles[old].caller_refs++;
    return;
  }
  m.id = id;
  m.buffer = b;
  m.caller_refs = 1;
  if (epx_handle_recv_rows(id, &m.N) != EPX_SUCCESS) finding("a new handle has no row count", "epx_handle_recv_rows", status);
  /* A recorder holds at most MAX_HANDLES live handles: each needs a slot. */
  if (rec && !rec->replaying) {
    m.recorder_refs = 1;
    rec->records[rec->count++] = hslot;
  }
  s->handles[hslot] = m;
}

static void op_retain_release(state_t *s, input_t *in) {
  int slot, from;
  uint8_t which = take(in);
  epx_handle_t id = handle_value(s, in, &slot, &from);
  epx_status_t status = which % 2 ? epx_handle_release(id) : epx_handle_retain(id);
  const char *call = which % 2 ? "epx_handle_release" : "epx_handle_retain";
  if (!judge_handle(s, slot, from, id, status, call)) {
    if (from != FROM_MADE_UP && id && status != EPX_ERROR_INVALID_HANDLE)
      finding("a handle the caller does not hold was not refused as EPX_ERROR_INVALID_HANDLE", call, status);
    if (from == FROM_SLOT && id && s->handles[slot].caller_refs > 0)
      finding("a held handle was refused", call, status);
    return;
  }
  fhandle_t *m = &s->handles[slot];
  m->caller_refs += which % 2 ? -1 : 1;
  handle_drop_if_dead(s, slot);
}

/* ------------------------------------------------------------------------ */
/* Payload calls                                                             */
/* ------------------------------------------------------------------------ */

/* The arrays of one payload call, each of exactly its rows' bytes (so ASan
 * sees any write past them), and copies of the outputs to compare. */
typedef struct {
  void *in[3];
  size_t in_bytes[3];
  void *out[2];
  size_t out_bytes[2];
  void *copy[2];
} arrays_t;

static void *array_in(arrays_t *a, int i, size_t bytes, uint8_t fill) {
  a->in[i] = alloc_bytes(bytes);
  a->in_bytes[i] = bytes;
  for (size_t j = 0; j < bytes; j++) ((uint8_t *)a->in[i])[j] = (uint8_t)(fill + j * 7);
  return a->in[i];
}

static void *array_out(arrays_t *a, int i, size_t bytes) {
  a->out[i] = alloc_bytes(bytes);
  a->out_bytes[i] = bytes;
  a->copy[i] = alloc_bytes(bytes);
  memcpy(a->copy[i], a->out[i], bytes);
  return a->out[i];
}

static void arrays_check_unchanged(arrays_t *a, const char *call, epx_status_t status) {
  refusals++;
  for (int i = 0; i < 2; i++)
    if (a->out[i] && memcmp(a->out[i], a->copy[i], a->out_bytes[i]))
      finding("a refused call changed its output", call, status);
}

static void arrays_free(arrays_t *a) {
  for (int i = 0; i < 3; i++) free(a->in[i]);
  for (int i = 0; i < 2; i++) free(a->out[i]), free(a->copy[i]);
}

/* float32 bit patterns of inputs must be finite for the combine oracle:
 * x is filled with small exact values. */
static void fill_x(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = (float)((i * 37) % 17 - 8) / 8.0f;
}

/* combine(dispatch(x)) with identity experts: out[t] = sum over the kept
 * routes of w (1 for weights not applied in combine or dispatch) times x[t]. */
static void check_round_trip(state_t *s, int slot, const float *x, const void *recv) {
  round_trips++;
  fhandle_t *m = &s->handles[slot];
  fbuffer_t *b = &s->buffers[m->buffer];
  int64_t H = b->c.hidden;
  float *out = alloc_bytes((size_t)(m->T * H) * sizeof(float));
  epx_status_t status = epx_combine(b->id, m->id, recv, out);
  if (status != EPX_SUCCESS) finding("combine after a successful dispatch failed", "epx_combine", status);
  for (int64_t t = 0; t < m->T; t++) {
    double scale = 0, mag = 0;
    for (int32_t k = 0; k < m->K; k++) {
      if (m->idx[t * m->K + k] < 0) continue;
      double w = m->weighting == EPX_WEIGHTS_NONE ? 1.0 : (double)m->w[t * m->K + k];
      scale += w;
      mag += fabs(w);
    }
    for (int64_t j = 0; j < H; j++) {
      double want = scale * x[t * H + j], got = out[t * H + j];
      if (fabs(got - want) > 1e-5 * (1.0 + mag))
        finding("combine(dispatch(x)) differs from sum_k w * x", "epx_combine", status);
    }
  }
  free(out);
}

static void op_payload(state_t *s, input_t *in) {
  int slot, from;
  uint8_t which = take(in) % 5, flags = take(in);
  epx_handle_t id = handle_value(s, in, &slot, &from);
  int b = from == FROM_SLOT && id ? s->handles[slot].buffer : take(in) % MAX_BUFFERS;
  if (flags % 8 == 0) b = (b + 1) % MAX_BUFFERS; /* another buffer's handle */
  if (!s->buffers[b].id) return;
  const epx_buffer_config_t *c = &s->buffers[b].c;
  const fhandle_t *m = from == FROM_SLOT && id ? &s->handles[slot] : NULL;
  int64_t T = m ? m->T : 1, N = m ? m->N : 1, K = m ? m->K : 1, H = c->hidden;
  int short_out = flags % 16 == 1 && N > 0, dropped_in = flags % 32 == 2;
  size_t row = (size_t)H * epx_dtype_size(c->dtype);
  /* Buffers with a huge (valid) hidden are for the size checks; their rows
   * are not allocated here. */
  if (H > 4096) return;
  arrays_t a = {0};
  epx_buffer_t bid = flags % 64 == 3 ? stale_value(s, in) : s->buffers[b].id;
  epx_status_t status = EPX_SUCCESS;
  const char *call = "";
  switch (which) {
    case 0: {
      call = "epx_dispatch";
      void *x = array_in(&a, 0, T * row, flags);
      if (c->dtype == EPX_FLOAT32) fill_x(x, T * H);
      void *recv = array_out(&a, 0, (short_out ? N - 1 : N) * row);
      status = epx_dispatch(bid, id, dropped_in ? NULL : x, recv, short_out ? N - 1 : N);
      if (status == EPX_SUCCESS && m && bid == s->buffers[m->buffer].id && m->caller_refs > 0 &&
          c->dtype == EPX_FLOAT32 && c->layout == EPX_LAYOUT_EXPERT_MAJOR)
        check_round_trip(s, slot, x, recv);
      break;
    }
    case 1:
      call = "epx_combine";
      status = epx_combine(bid, id, array_in(&a, 0, N * row, flags), array_out(&a, 0, T * row));
      break;
    case 2: {
      call = "epx_dispatch_backward";
      int with_w = m && m->weighting == EPX_WEIGHTS_IN_DISPATCH && flags % 2;
      status = epx_dispatch_backward(bid, id, array_in(&a, 0, N * row, flags), array_out(&a, 0, T * row),
                                     with_w ? array_in(&a, 1, T * row, flags) : NULL,
                                     with_w ? array_out(&a, 1, T * K * sizeof(float)) : NULL);
      break;
    }
    case 3: {
      call = "epx_combine_backward";
      int with_w = m && m->weighting == EPX_WEIGHTS_IN_COMBINE && flags % 2;
      status = epx_combine_backward(bid, id, array_in(&a, 0, T * row, flags),
                                    with_w ? array_in(&a, 1, N * row, flags) : NULL, array_out(&a, 0, N * row),
                                    with_w ? array_out(&a, 1, T * K * sizeof(float)) : NULL);
      break;
    }
    default: {
      call = "epx_weights_backward";
      int64_t per_row = c->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
      status = epx_weights_backward(bid, id, array_in(&a, 0, N * per_row * sizeof(float), 0),
                                    array_out(&a, 0, T * K * sizeof(float)));
      break;
    }
  }
  if (bid == s->buffers[b].id) (void)judge_handle(s, slot, from, id, status, call);
  if (status != EPX_SUCCESS) arrays_check_unchanged(&a, call, status);
  arrays_free(&a);
}

/* ------------------------------------------------------------------------ */
/* Handle queries, recorders, the router                                     */
/* ------------------------------------------------------------------------ */

static void op_query(state_t *s, input_t *in) {
  int slot, from;
  uint8_t which = take(in) % 5;
  epx_handle_t id = handle_value(s, in, &slot, &from);
  const fhandle_t *m = from == FROM_SLOT && id ? &s->handles[slot] : NULL;
  int64_t N = m ? m->N : 1, K = m ? m->K : 1, El = 1;
  if (m) El = s->buffers[m->buffer].c.num_experts;
  arrays_t a = {0};
  epx_status_t status;
  const char *call;
  switch (which) {
    case 0: {
      call = "epx_handle_recv_rows";
      int64_t *rows = array_out(&a, 0, sizeof(int64_t));
      status = epx_handle_recv_rows(id, rows);
      if (status == EPX_SUCCESS && m && *rows != m->N) finding("the row count changed", call, status);
      break;
    }
    case 1:
      call = "epx_handle_expert_counts";
      status = epx_handle_expert_counts(id, array_out(&a, 0, El * sizeof(int64_t)), array_out(&a, 1, (El + 1) * sizeof(int64_t)));
      break;
    case 2:
      call = "epx_handle_recv_routing";
      status = epx_handle_recv_routing(id, array_out(&a, 0, N * K * sizeof(int32_t)), array_out(&a, 1, N * K * sizeof(float)));
      break;
    case 3:
      call = "epx_handle_recv_source";
      status = epx_handle_recv_source(id, array_out(&a, 0, N * sizeof(int32_t)), array_out(&a, 1, N * sizeof(int32_t)));
      break;
    default:
      call = "epx_handle_stats";
      status = epx_handle_stats(id, array_out(&a, 0, sizeof(epx_handle_stats_t)));
      break;
  }
  (void)judge_handle(s, slot, from, id, status, call);
  if (status != EPX_SUCCESS) arrays_check_unchanged(&a, call, status);
  arrays_free(&a);
}

static void recorder_destroyed(state_t *s, frecorder_t *r) {
  for (int i = 0; i < r->count; i++) {
    s->handles[r->records[i]].recorder_refs--;
    handle_drop_if_dead(s, r->records[i]);
  }
  forget(s, r->id);
  memset(r, 0, sizeof *r);
}

static void op_recorder(state_t *s, input_t *in) {
  uint8_t which = take(in);
  frecorder_t *r = &s->recorders[(which / 4) % MAX_RECORDERS];
  epx_status_t status;
  switch (which % 4) {
    case 0:
      if (r->id) return;
      status = epx_recorder_create(take(in) % 2, &r->id);
      if (status != EPX_SUCCESS) finding("a recorder was not created", "epx_recorder_create", status);
      return;
    case 1:
      if (!r->id) {
        status = epx_recorder_destroy(stale_value(s, in));
        if (status == EPX_SUCCESS && s->stale_count) finding("a stale recorder was destroyed", "epx_recorder_destroy", status);
        return;
      }
      status = epx_recorder_destroy(r->id);
      if (status != EPX_SUCCESS) finding("a live recorder was not destroyed", "epx_recorder_destroy", status);
      recorder_destroyed(s, r);
      return;
    case 2:
      if (!r->id) return;
      r->replaying = take(in) % 2;
      status = epx_recorder_set_mode(r->id, r->replaying ? EPX_RECORDER_REPLAY : EPX_RECORDER_RECORD);
      if (status != EPX_SUCCESS) finding("set_mode failed", "epx_recorder_set_mode", status);
      return;
    default: {
      epx_recorder_stats_t stats;
      status = epx_recorder_stats(r->id ? r->id : stale_value(s, in), &stats);
      if (r->id && status != EPX_SUCCESS) finding("stats of a live recorder failed", "epx_recorder_stats", status);
      if (r->id && (stats.records < r->count || stats.bytes_held < 0 || stats.bytes_avoided < 0))
        finding("recorder stats are wrong", "epx_recorder_stats", status);
      return;
    }
  }
}

static void op_route(input_t *in) {
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  uint8_t a = take(in), b = take(in);
  rc.num_experts = 1 + a % 16;
  rc.top_k = 1 + b % rc.num_experts;
  rc.score_fn = (epx_score_fn_t)((b / 16) % 2);
  rc.renormalize = (a / 16) % 2;
  rc.capacity_mode = (a / 32) % 2;
  rc.capacity_factor = 1.0f;
  if (a >= 250) rc.num_experts = INT32_MAX;
  int64_t T = take(in) % 9;
  float *logits = alloc_bytes((size_t)(T * (rc.num_experts < 64 ? rc.num_experts : 1)) * sizeof(float));
  for (int64_t i = 0; i < T * (rc.num_experts < 64 ? rc.num_experts : 1); i++) {
    uint8_t v = take(in);
    logits[i] = v == 255 ? INFINITY : (float)v / 16.0f - 8.0f;
  }
  int32_t *idx = alloc_bytes((size_t)(T * rc.top_k) * sizeof(int32_t) + 4);
  float *w = alloc_bytes((size_t)(T * rc.top_k) * sizeof(float) + 4);
  int32_t *loc = alloc_bytes((size_t)(T * rc.top_k) * sizeof(int32_t) + 4);
  epx_route_output_t out = {idx, w, rc.capacity_mode ? loc : NULL, NULL, NULL, NULL, 0, 0};
  if (rc.num_experts < 64) (void)epx_route(&rc, T, logits, NULL, &out);
  else (void)epx_route(&rc, INT32_MAX, logits, NULL, &out); /* refused: the logits' bytes overflow */
  free(logits), free(idx), free(w), free(loc);
}

/* ------------------------------------------------------------------------ */
/* The program                                                               */
/* ------------------------------------------------------------------------ */

static void teardown(state_t *s) {
  for (int h = 0; h < MAX_HANDLES; h++)
    while (s->handles[h].id && s->handles[h].caller_refs > 0) {
      epx_status_t status = epx_handle_release(s->handles[h].id);
      if (status != EPX_SUCCESS) finding("a held handle did not release", "epx_handle_release", status);
      s->handles[h].caller_refs--;
    }
  for (int r = 0; r < MAX_RECORDERS; r++)
    if (s->recorders[r].id) {
      epx_status_t status = epx_recorder_destroy(s->recorders[r].id);
      if (status != EPX_SUCCESS) finding("a recorder did not destroy", "epx_recorder_destroy", status);
    }
  for (int b = 0; b < MAX_BUFFERS; b++)
    if (s->buffers[b].id) {
      epx_status_t status = epx_buffer_destroy(s->buffers[b].id);
      if (status != EPX_SUCCESS) finding("a buffer with no handles left did not destroy", "epx_buffer_destroy", status);
    }
  epx_status_t status = epx_comm_destroy(s->comm);
  if (status != EPX_SUCCESS) finding("the comm did not destroy", "epx_comm_destroy", status);
  /* 1 comm + 3 buffers + 8 handles + 2 recorders never need more than the
   * table's first 64 slots. */
  if (epx_registry_capacity() > 64) finding("the registry grew past the live objects", "teardown", EPX_SUCCESS);
}

/* Counts for the report, printed when the run ends (a finding aborts
 * before, so reaching here means none). */
static void print_counts(void) {
  fprintf(stderr, "fuzz_api: %llu programs, %llu operations (%llu refused payload/query calls "
          "checked unchanged, %llu combine(dispatch(x)) round trips checked), 0 findings\n",
          (unsigned long long)programs, (unsigned long long)operations,
          (unsigned long long)refusals, (unsigned long long)round_trips);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!programs++) atexit(print_counts);
  input_t in = {data, size};
  state_t s;
  memset(&s, 0, sizeof s);
  if (epx_comm_create_self(&s.comm) != EPX_SUCCESS) abort();
  for (int calls = 0; in.n && calls < 256; calls++, operations++) {
    switch (take(&in) % 10) {
      case 0: op_buffer_create(&s, &in); break;
      case 1: op_buffer_destroy(&s, &in); break;
      case 2: case 3: op_layout(&s, &in); break;
      case 4: op_retain_release(&s, &in); break;
      case 5: case 6: op_payload(&s, &in); break;
      case 7: op_query(&s, &in); break;
      case 8: op_recorder(&s, &in); break;
      default: op_route(&in); break;
    }
  }
  teardown(&s);
  return 0;
}
