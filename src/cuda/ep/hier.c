/* The hierarchical path of the W-rank backend (ep/internal.h): the buffers
 * of EPX_EXCHANGE_HIERARCHICAL. The layout is the host path's (the same
 * tables, counts and queries); on top of it each rank plans two hops from
 * the gathered routing, read back with the summary (so no more waits):
 *   hop 1 (network)  a row per (token, other node holding any of its
 *                    experts), to the rank of that node with the sender's
 *                    local index (its relay there);
 *   hop 2 (node)     from each relay to the ranks of its node: its own
 *                    tokens' pairs and the pairs of the hop-1 rows it
 *                    received, in ascending source rank, each source's in
 *                    token order.
 * Both hops are groups of the buffer's transport (xport.h) on its stream, the pack
 * and sum steps the one-rank kernels (launch.h) over tables planned on the
 * host. Hop 2 lands each source's pairs where the host path's dedup receive
 * staging has them, so the expansion is the host path's and the received
 * rows are dedup's bits. Combine mirrors it: each receiver forms the
 * partial P'(t, r) of every pair as the dedup exchange does and sends it
 * back to the relay; the relay sums its node's partials in ascending rank
 * order into Q'(t, n) (rounded as P' is) and sends one row home per node;
 * the token's rank sums its own node's partials the same way, then the Q'
 * over the nodes in ascending order (src/cpu/hier.c, epx.h's order). On one
 * node, or one rank per node, that is dedup's sum.
 *
 * The passes that return one value or row per route (grad_w,
 * weights_backward) go through the host path's flat exchange, as on the CPU
 * (epx.h; dispatch_backward's grad_x then moves again over the two hops
 * where the flat sum is not the two-level one); so do the queries.
 * Rank-major rows are pairs: combine forms P(t, r) = 0 + the row, the
 * CPU's. worst_case_sizing and
 * fp8 buffers are refused at epx_buffer_create (the plan needs the routing
 * on the host; the fp8 rows travel on the flat exchanges only). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/payload.h"
#include "core/transport.h"
#include "cuda/backend.h"
#include "cuda/common/check.h"
#include "cuda/ep/internal.h"

#if EPX_HAVE_NCCL
#define OOM(fn) epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn)

/* A block of rows to or from one peer inside a staging buffer. */
typedef struct {
  int32_t peer;
  int64_t at, rows;
} seg_t;

/* handle->path_state: the two hops' plan. */
typedef struct hier_plan {
  int32_t G, L, node, local;
  int64_t net_rows, rnet_rows, fwd_rows;
  int64_t *net_count, *net_displ;   /* [G] hop-1 rows to each node's relay */
  int64_t *rnet_count, *rnet_displ; /* [W] hop-1 rows from each source */
  seg_t *fwd;                       /* hop-2 blocks this rank sends as relay (staging: fwd rows) */
  seg_t *hop;                       /* hop-2 blocks it receives (staging: the host path's pair rows) */
  seg_t *home;                      /* [G] hop-1 blocks to each other node's relay (staging: net rows) */
  seg_t *relay;                     /* [W] hop-1 blocks from each source relayed here (rnet rows) */
  int64_t nfwd, nhop, nhome, nrelay;
  void *block;         /* device: the tables below */
  int32_t *net_stage;  /* [T, G] hop-1 row of (t, node), -1 none */
  int32_t *fin;        /* [T, G] home row of Q'(t, node): hop-1 rows, then the own node's at net_rows + t */
  int32_t *own_fwd;    /* [T, L] hop-2 row of this rank's (t, local rank l) */
  int32_t *net_fwd;    /* [rnet rows, L] hop-2 row of a relayed row to local rank l */
} hier_plan_t;

/* buffer->path_state: staging of the two hops (grown at the layout). */
typedef struct {
  /* hop 1 at home (+ the own node's sums), hop 1 at the relay, hop 2 at the
   * relay, the receiver's partials (at the host path's pair staging rows) */
  void *stage[4];
  size_t bytes[4];
} hier_buffer_t;

static int32_t rank_at(epx_comm_t comm, int32_t node, int32_t local) {
  return comm->node_ranks[comm->node_first[node] + local];
}

/* ------------------------------------------------------------------------ */
/* The plan                                                                  */
/* ------------------------------------------------------------------------ */

/* The ranks gathered token g routes to (distinct, at most Kb); returns how many. */
static int32_t token_ranks(const ep_handle_t *h, const int32_t *gidx, int64_t g, int32_t *ranks) {
  int32_t n = 0;
  for (int32_t k = 0; k < h->d.Kb; k++) {
    const int32_t e = gidx[g * h->d.Kb + k];
    if (e < 0) continue;
    const int32_t r = e / h->d.El;
    int seen = 0;
    for (int32_t i = 0; i < n; i++) seen |= ranks[i] == r;
    if (!seen) ranks[n++] = r;
  }
  return n;
}

static int on_node(epx_comm_t comm, const int32_t *ranks, int32_t n, int32_t node) {
  for (int32_t i = 0; i < n; i++)
    if (comm->node_of[ranks[i]] == node) return 1;
  return 0;
}

/* Whether relay q of this node carries source s's rows: its own, or those
 * of a rank of another node with q's local index. */
static int relays(epx_comm_t comm, int32_t q, int32_t s) {
  return s == q || (comm->node_of[s] != comm->node_of[q] && comm->local_of[s] == comm->local_of[q]);
}

/* The nodes of `ranks` (distinct, in order of first appearance); returns how many. */
static int32_t token_nodes(epx_comm_t comm, const int32_t *ranks, int32_t n, int32_t *nodes) {
  int32_t m = 0;
  for (int32_t i = 0; i < n; i++) {
    const int32_t g = comm->node_of[ranks[i]];
    int seen = 0;
    for (int32_t j = 0; j < m; j++) seen |= nodes[j] == g;
    if (!seen) nodes[m++] = g;
  }
  return m;
}

/* Home side: hop-1 rows of this rank's tokens, per node in token order,
 * and where each token's Q'(t, node) will be. Scratch: ranks [2 * Kb],
 * cursor [G]. */
static void plan_home(epx_comm_t comm, const ep_handle_t *h, hier_plan_t *p, const int32_t *gidx, int32_t *net_stage,
                      int32_t *fin, int32_t *ranks, int64_t *cursor) {
  const int64_t T = h->d.T, base = (int64_t)h->d.rank * h->d.Tm;
  int32_t *nodes = ranks + h->d.Kb;
  for (int32_t g = 0; g < p->G; g++) p->net_count[g] = 0;
  for (int64_t t = 0; t < T; t++) {
    const int32_t m = token_nodes(comm, ranks, token_ranks(h, gidx, base + t, ranks), nodes);
    for (int32_t i = 0; i < m; i++) p->net_count[nodes[i]] += nodes[i] != p->node;
  }
  p->net_rows = 0;
  for (int32_t g = 0; g < p->G; g++) cursor[g] = p->net_displ[g] = p->net_rows, p->net_rows += p->net_count[g];
  for (int64_t t = 0; t < T; t++) {
    for (int32_t g = 0; g < p->G; g++) net_stage[t * p->G + g] = fin[t * p->G + g] = -1;
    const int32_t m = token_nodes(comm, ranks, token_ranks(h, gidx, base + t, ranks), nodes);
    for (int32_t i = 0; i < m; i++) {
      const int32_t g = nodes[i];
      if (g != p->node) net_stage[t * p->G + g] = fin[t * p->G + g] = (int32_t)cursor[g]++;
      else fin[t * p->G + g] = (int32_t)(p->net_rows + t);
    }
  }
}

/* Relay side: the hop-1 rows it receives (per source, in token order) and,
 * with tables, its hop-2 blocks (per rank of its node, source by source,
 * each in token order). at: scratch [L, W]. */
static void plan_relay(epx_comm_t comm, const ep_handle_t *h, hier_plan_t *p, const int32_t *gidx, int32_t *own_fwd,
                       int32_t *net_fwd, int32_t *ranks, int64_t *at) {
  const int32_t W = h->d.W, me = h->d.rank, L = p->L;
  const int64_t Tm = h->d.Tm;
  int64_t rows = 0;
  for (int32_t s = 0; s < W; s++) {
    p->rnet_displ[s] = rows;
    if (s != me && relays(comm, me, s))
      for (int64_t t = 0; t < Tm; t++) rows += on_node(comm, ranks, token_ranks(h, gidx, s * Tm + t, ranks), p->node);
    p->rnet_count[s] = rows - p->rnet_displ[s];
  }
  p->rnet_rows = rows;
  if (!own_fwd) return; /* the first call sizes the tables */
  for (int64_t i = 0; i < (int64_t)L * W; i++) at[i] = 0;
  for (int32_t s = 0; s < W; s++)
    for (int64_t t = 0; relays(comm, me, s) && t < Tm; t++) {
      const int32_t n = token_ranks(h, gidx, s * Tm + t, ranks);
      for (int32_t i = 0; i < n; i++)
        if (comm->node_of[ranks[i]] == p->node) at[(int64_t)comm->local_of[ranks[i]] * W + s]++;
    }
  rows = 0;
  p->nfwd = 0;
  for (int32_t l = 0; l < L; l++)
    for (int32_t s = 0; s < W; s++) {
      const int64_t n = at[(int64_t)l * W + s];
      at[(int64_t)l * W + s] = rows;
      if (n) p->fwd[p->nfwd++] = (seg_t){rank_at(comm, p->node, l), rows, n};
      rows += n;
    }
  p->fwd_rows = rows;
  for (int64_t i = 0; i < h->d.T * L; i++) own_fwd[i] = -1;
  for (int64_t i = 0; i < p->rnet_rows * L; i++) net_fwd[i] = -1;
  for (int32_t s = 0; s < W; s++) {
    int64_t j = p->rnet_displ[s]; /* the relayed row of the source's next token that has one */
    for (int64_t t = 0; relays(comm, me, s) && t < Tm; t++) {
      const int32_t n = token_ranks(h, gidx, s * Tm + t, ranks);
      int32_t *row = s == me ? own_fwd + t * L : on_node(comm, ranks, n, p->node) ? net_fwd + j++ * L : NULL;
      for (int32_t i = 0; row && i < n; i++)
        if (comm->node_of[ranks[i]] == p->node) {
          const int32_t l = comm->local_of[ranks[i]];
          row[l] = (int32_t)at[(int64_t)l * W + s]++;
        }
    }
  }
}

/* Receiver side: from each relay of its node, source by source, the
 * source's pairs to where the host path's pair staging has them. */
static void plan_receive(epx_comm_t comm, const ep_handle_t *h, hier_plan_t *p) {
  p->nhop = 0;
  for (int32_t l = 0; l < p->L; l++) {
    const int32_t q = rank_at(comm, p->node, l);
    for (int32_t s = 0; s < h->d.W; s++)
      if (relays(comm, q, s) && h->count[RECV_PAIRS][s])
        p->hop[p->nhop++] = (seg_t){q, h->displ[RECV_PAIRS][s], h->count[RECV_PAIRS][s]};
  }
}

/* Hop 1's blocks as segments: to each other node's relay (home side) and
 * from each source relayed here (relay side). */
static void plan_segments(epx_comm_t comm, int32_t W, hier_plan_t *p) {
  p->nhome = p->nrelay = 0;
  for (int32_t g = 0; g < p->G; g++)
    if (p->net_count[g]) p->home[p->nhome++] = (seg_t){rank_at(comm, g, p->local), p->net_displ[g], p->net_count[g]};
  for (int32_t s = 0; s < W; s++)
    if (p->rnet_count[s]) p->relay[p->nrelay++] = (seg_t){s, p->rnet_displ[s], p->rnet_count[s]};
}

static void plan_free(hier_plan_t *p, cudaStream_t stream) {
  if (!p) return;
  if (p->block) cudaFreeAsync(p->block, stream);
  free(p->net_count);
  free(p->fwd);
  free(p);
}

/* The tables on the host, then one copy into the plan's device block. */
static epx_status_t plan_tables(epx_buffer_t b, const ep_handle_t *h, hier_plan_t *p, const int32_t *gidx,
                                const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t comm = b->comm;
  const int64_t T = h->d.T;
  int32_t *ranks = malloc(sizeof(int32_t) * 2 * (size_t)h->d.Kb + 1);
  int64_t *at = malloc(sizeof(int64_t) * ((size_t)p->L * (size_t)h->d.W + (size_t)p->G));
  if (!ranks || !at) {
    free(ranks), free(at);
    return OOM(fn);
  }
  plan_relay(comm, h, p, gidx, NULL, NULL, ranks, NULL);
  const size_t parts[4] = {4 * (size_t)(T * p->G), 4 * (size_t)(T * p->G), 4 * (size_t)(T * p->L),
                           4 * (size_t)(p->rnet_rows * p->L)};
  size_t bytes = 0;
  for (int i = 0; i < 4; i++) bytes += epx_round256(parts[i]);
  char *host = malloc(bytes + 1);
  if (!host) {
    free(ranks), free(at);
    return OOM(fn);
  }
  int32_t *tab[4];
  for (size_t i = 0, off = 0; i < 4; off += epx_round256(parts[i]), i++) tab[i] = (int32_t *)(host + off);
  plan_home(comm, h, p, gidx, tab[0], tab[1], ranks, at);
  plan_relay(comm, h, p, gidx, tab[2], tab[3], ranks, at);
  free(ranks), free(at);
  plan_receive(comm, h, p);
  plan_segments(comm, h->d.W, p);
  cudaStream_t stream = stream_of(b);
  CUDA_CHECK(cudaMallocAsync(&p->block, bytes + 256, stream), fn, "cudaMallocAsync of the hierarchical plan");
  /* pageable memory: the copy has read it when the call returns */
  CUDA_CHECK(cudaMemcpyAsync(p->block, host, bytes, cudaMemcpyHostToDevice, stream), fn,
             "cudaMemcpyAsync of the hierarchical plan");
  int32_t **dev[4] = {&p->net_stage, &p->fin, &p->own_fwd, &p->net_fwd};
  for (size_t i = 0, off = 0; i < 4; off += epx_round256(parts[i]), i++) *dev[i] = (int32_t *)((char *)p->block + off);
fail:
  free(host);
  return status;
}

/* Staging slot i of at least `bytes` (stream-ordered, as the host path's). */
static epx_status_t ensure(epx_buffer_t b, int i, size_t bytes, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  hier_buffer_t *s = ((ep_buffer_t *)b->backend_state)->path_state;
  if (bytes <= s->bytes[i]) return EPX_SUCCESS;
  if (s->stage[i]) CUDA_CHECK(cudaFreeAsync(s->stage[i], stream_of(b)), fn, "cudaFreeAsync of the staging");
  s->stage[i] = NULL;
  s->bytes[i] = 0;
  CUDA_CHECK(cudaMallocAsync(&s->stage[i], bytes, stream_of(b)), fn, "cudaMallocAsync of the hierarchical staging");
  s->bytes[i] = bytes;
fail:
  return status;
}

/* The widest row either hop carries: a payload row or a float32 partial. */
static size_t unit_bytes(epx_buffer_t b) {
  const size_t rb = (size_t)epx_buffer_row_bytes(b), pb = (size_t)epx_payload_partial_row_bytes(b->config.hidden);
  return rb > pb ? rb : pb;
}

/* ------------------------------------------------------------------------ */
/* Path functions                                                            */
/* ------------------------------------------------------------------------ */

/* The hierarchical plan reads the routing back at the layout and moves rows
 * of the dtype on the normal mode only. */
static int hier_supports(const epx_buffer_config_t *c, const char **why) {
  const char *no = NULL;
  if (c->exchange != EPX_EXCHANGE_HIERARCHICAL) return 1;
  if (c->worst_case_sizing) no = "config.worst_case_sizing (its plan reads the routing back at the layout)";
  else if (c->fp8_format != EPX_FP8_NONE) no = "config.fp8_format (fp8 rows move on the flat exchanges only)";
  if (no && why) *why = no;
  return no == NULL;
}

static epx_status_t hier_setup(epx_buffer_t b, const char *fn, int *takes) {
  *takes = b->config.exchange == EPX_EXCHANGE_HIERARCHICAL;
  if (!*takes) return EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  if (!(s->path_state = calloc(1, sizeof(hier_buffer_t)))) return OOM(fn);
  return EPX_SUCCESS;
}

static void hier_buffer_fini(epx_buffer_t b) {
  ep_buffer_t *s = b->backend_state;
  hier_buffer_t *hb = s->path_state;
  for (int i = 0; hb && i < 4; i++)
    if (hb->stage[i]) cudaFreeAsync(hb->stage[i], stream_of(b));
  free(hb);
  s->path_state = NULL;
  epx_cuda_ep_host_path.buffer_fini(b);
}

/* The gathered routing [W * Tm, Kb] follows the summary. */
static size_t hier_readback_bytes(const ep_handle_t *h) {
  return 4 * (size_t)h->d.W * (size_t)h->d.Tm * (size_t)h->d.Kb;
}

static epx_status_t hier_readback(epx_buffer_t b, const ep_handle_t *h, int64_t *host, size_t summary_bytes,
                                  const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  EPX_CHECK(epx_cuda_ep_host_path.readback(b, h, host, summary_bytes, fn));
  CUDA_CHECK(cudaMemcpyAsync((char *)host + summary_bytes, h->gidx, hier_readback_bytes(h), cudaMemcpyDeviceToHost,
                             stream_of(b)),
             fn, "cudaMemcpyAsync of the gathered routing");
fail:
  return status;
}

static epx_status_t hier_laid_out(epx_buffer_t b, ep_handle_t *h, const int64_t *summary, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t comm = b->comm;
  EPX_CHECK(epx_cuda_ep_host_path.laid_out(b, h, summary, fn));
  if (!summary || comm->ranks_per_node <= 0)
    return epx_error(EPX_ERROR_INTERNAL, "%s: the hierarchical path needs the read-back routing and nodes of equal "
                     "size (epx_buffer_create checks both)", fn);
  const int32_t W = h->d.W;
  hier_plan_t *p = calloc(1, sizeof *p);
  if (!p) return OOM(fn);
  h->path_state = p;
  p->G = comm->num_nodes, p->L = comm->ranks_per_node;
  p->node = comm->node_of[h->d.rank], p->local = comm->local_of[h->d.rank];
  p->net_count = malloc(sizeof(int64_t) * (size_t)(2 * p->G + 2 * W));
  p->fwd = malloc(sizeof(seg_t) * (size_t)(2 * p->L * W + p->G + W));
  if (!p->net_count || !p->fwd) return OOM(fn);
  p->net_displ = p->net_count + p->G, p->rnet_count = p->net_displ + p->G, p->rnet_displ = p->rnet_count + W;
  p->hop = p->fwd + (size_t)p->L * W;
  p->home = p->hop + (size_t)p->L * W, p->relay = p->home + p->G;
  const int32_t *gidx = (const int32_t *)((const char *)summary + 8 * (size_t)(EPX_CUDA_EP_SUMMARY_ROWS(W) + 2));
  EPX_CHECK(plan_tables(b, h, p, gidx, fn));
  const size_t unit = unit_bytes(b);
  EPX_CHECK(ensure(b, 0, (size_t)(p->net_rows + h->d.T + 1) * unit, fn));
  EPX_CHECK(ensure(b, 1, (size_t)(p->rnet_rows + 1) * unit, fn));
  EPX_CHECK(ensure(b, 2, (size_t)(p->fwd_rows + 1) * unit, fn));
  EPX_CHECK(ensure(b, 3, (size_t)(kind_rows(h, RECV_PAIRS) + 1) * unit, fn));
fail:
  return status;
}

static void hier_handle_fini(epx_buffer_t b, ep_handle_t *h) {
  plan_free(h->path_state, stream_of(b));
  h->path_state = NULL;
  epx_cuda_ep_host_path.handle_fini(b, h);
}

/* ------------------------------------------------------------------------ */
/* The moves                                                                 */
/* ------------------------------------------------------------------------ */

/* One group of the buffer's transport: blocks of `unit`-byte rows, out of
 * send to the peers of `to` and into recv from the peers of `from`. */
static epx_status_t exchange(epx_buffer_t b, const seg_t *to, int64_t nto, const void *send, const seg_t *from,
                             int64_t nfrom, void *recv, size_t unit, const char *fn) {
  const ep_buffer_t *s = b->backend_state;
  epx_cuda_move_t *m = malloc(sizeof *m * (size_t)(nto + nfrom + 1));
  if (!m) return OOM(fn);
  for (int64_t i = 0; i < nto; i++)
    m[i] = (epx_cuda_move_t){to[i].peer, (char *)send + (size_t)to[i].at * unit, (size_t)to[i].rows * unit};
  for (int64_t i = 0; i < nfrom; i++)
    m[nto + i] = (epx_cuda_move_t){from[i].peer, (char *)recv + (size_t)from[i].at * unit, (size_t)from[i].rows * unit};
  const epx_status_t status = s->xport->sendrecv(b->comm, m, nto, m + nto, nfrom, stream_of(b), fn);
  free(m);
  return status;
}

/* Forward direction, src [T, H] -> dst [N, H] in the layout (dispatch,
 * combine_backward without grad_w): hop 1, hop 2 into the host path's pair
 * staging, then the host path's expansion. */
static epx_status_t move_forward(epx_buffer_t b, epx_handle_t handle, const void *src, void *dst, int weighted,
                                 const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const ep_handle_t *h = handle->backend_state;
  const hier_plan_t *p = h->path_state;
  const ep_buffer_t *s = b->backend_state;
  const hier_buffer_t *hb = s->path_state;
  cudaStream_t stream = stream_of(b);
  const size_t rb = (size_t)epx_buffer_row_bytes(b);
  CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, src, hb->stage[0], h->d.T, c->hidden, p->net_stage, p->G, NULL, NULL,
                                     NULL, NULL, NULL, 0, 0, stream),
             fn, "the hop-1 pack kernel");
  EPX_CHECK(exchange(b, p->home, p->nhome, hb->stage[0], p->relay, p->nrelay, hb->stage[1], rb, fn));
  CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, src, hb->stage[2], h->d.T, c->hidden, p->own_fwd, p->L, NULL, NULL,
                                     NULL, NULL, NULL, 0, 0, stream),
             fn, "the hop-2 pack kernel");
  CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, hb->stage[1], hb->stage[2], p->rnet_rows, c->hidden, p->net_fwd, p->L,
                                     NULL, NULL, NULL, NULL, NULL, 0, 0, stream),
             fn, "the hop-2 forward kernel");
  EPX_CHECK(exchange(b, p->fwd, p->nfwd, hb->stage[2], p->hop, p->nhop, s->recv, rb, fn));
  CUDA_CHECK(epx_cuda_scatter_launch(c->dtype, s->recv, dst, kind_rows(h, RECV_PAIRS), c->hidden, h->tab.rp_rows,
                                     h->d.Kb, weighted ? h->tab.rp_w : NULL, NULL, NULL, h->recv.row_src,
                                     &h->recv.result->rows, h->row_bound, 0, stream),
             fn, "the expand kernel");
fail:
  return status;
}

/* dst[i] = the sum of src's rows table[i, 0..n) in order: float32 partials
 * to float32 (f32) or to the payload dtype (out), else payload rows summed
 * in float32 and rounded once (gather). */
static epx_status_t sum_rows(epx_buffer_t b, int f32, epx_dtype_t out, const void *src, void *dst, int64_t rows,
                             const int32_t *table, int32_t n, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  if (rows == 0) return EPX_SUCCESS;
  if (f32) {
    const epx_cuda_reduce_t red = {EPX_FLOAT32, out, src, dst, rows, c->hidden, table, NULL, n, NULL, NULL, NULL, 0};
    CUDA_CHECK(epx_cuda_reduce_launch(&red, stream_of(b)), fn, "the node sum kernel");
  } else {
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, src, dst, rows, c->hidden, table, n, NULL, NULL, NULL, 0,
                                      stream_of(b)),
               fn, "the node sum kernel");
  }
fail:
  return status;
}

/* Backward direction, rows [N, H] in the layout -> out [T, H] (combine,
 * dispatch_backward without grad_w; not rank-major): the receivers'
 * partials back over hop 2, the relays' node sums back over hop 1, the
 * token's rank's sum over the nodes. */
static epx_status_t move_backward(epx_buffer_t b, epx_handle_t handle, const void *rows, void *out, int weighted,
                                  epx_combine_precision_t precision, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const ep_handle_t *h = handle->backend_state;
  const hier_plan_t *p = h->path_state;
  const hier_buffer_t *hb = ((const ep_buffer_t *)b->backend_state)->path_state;
  cudaStream_t stream = stream_of(b);
  const int f32 = f32_partials(b, precision);
  const size_t unit = f32 ? (size_t)epx_payload_partial_row_bytes(c->hidden) : (size_t)epx_buffer_row_bytes(b);
  const float *w = weighted ? h->tab.rp_w : NULL;
  /* P'(t, r) of every received pair, at its pair staging row (dedup's). */
  const int64_t items = kind_rows(h, RECV_PAIRS);
  if (f32) {
    const epx_cuda_reduce_t red = {c->dtype, EPX_FLOAT32, rows, hb->stage[3], items, c->hidden, h->tab.rp_rows,
                                   NULL, h->d.Kb, w, NULL, NULL, 0};
    CUDA_CHECK(epx_cuda_reduce_launch(&red, stream), fn, "the partial sum kernel");
  } else {
    CUDA_CHECK(epx_cuda_gather_launch(c->dtype, rows, hb->stage[3], items, c->hidden, h->tab.rp_rows, h->d.Kb, w,
                                      NULL, NULL, 0, stream),
               fn, "the partial sum kernel");
  }
  EPX_CHECK(exchange(b, p->hop, p->nhop, hb->stage[3], p->fwd, p->nfwd, hb->stage[2], unit, fn));
  /* Q'(t, n): the relayed rows' and this rank's own tokens'. */
  const epx_dtype_t partial = f32 ? EPX_FLOAT32 : c->dtype;
  EPX_CHECK(sum_rows(b, f32, partial, hb->stage[2], hb->stage[1], p->rnet_rows, p->net_fwd, p->L, fn));
  EPX_CHECK(sum_rows(b, f32, partial, hb->stage[2], (char *)hb->stage[0] + (size_t)p->net_rows * unit, h->d.T,
                     p->own_fwd, p->L, fn));
  EPX_CHECK(exchange(b, p->relay, p->nrelay, hb->stage[1], p->home, p->nhome, hb->stage[0], unit, fn));
  EPX_CHECK(sum_rows(b, f32, c->dtype, hb->stage[0], out, h->d.T, p->fin, p->G, fn));
fail:
  return status;
}

static epx_status_t hier_dispatch(epx_buffer_t b, epx_handle_t handle, const void *x, void *recv_x) {
  return move_forward(b, handle, x, recv_x, handle->weighting == EPX_WEIGHTS_IN_DISPATCH, "epx_dispatch");
}

/* Rank-major rows are pairs: P(t, r) = 0 + the row, as the CPU forms it. */
static epx_status_t hier_combine(epx_buffer_t b, epx_handle_t handle, const void *expert_out, void *out) {
  return move_backward(b, handle, expert_out, out, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                       b->config.combine_precision, "epx_combine");
}

/* With grad_w the routes' rows go home on the host path (the dots need
 * them there); its grad_x sums in one level, which is the two-level sum
 * only on one node or with one rank per node, so elsewhere grad_x moves
 * again over the two hops. */
static epx_status_t hier_dispatch_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_recv_x,
                                           void *grad_x, const void *x, float *grad_w) {
  const char *fn = "epx_dispatch_backward";
  const int weighted = handle->weighting == EPX_WEIGHTS_IN_DISPATCH;
  if (!grad_w) return move_backward(b, handle, grad_recv_x, grad_x, weighted, EPX_COMBINE_PARTIALS_FLOAT32, fn);
  epx_status_t status = epx_cuda_ep_host_path.dispatch_backward(b, handle, grad_recv_x, grad_x, x, grad_w);
  const int one_level = b->comm->num_nodes == 1 || b->comm->ranks_per_node == 1;
  if (status != EPX_SUCCESS || one_level) return status;
  return move_backward(b, handle, grad_recv_x, grad_x, weighted, EPX_COMBINE_PARTIALS_FLOAT32, fn);
}

static epx_status_t hier_combine_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_out,
                                          const void *expert_out, void *grad_expert_out, float *grad_w) {
  if (grad_w)
    return epx_cuda_ep_host_path.combine_backward(b, handle, grad_out, expert_out, grad_expert_out, grad_w);
  return move_forward(b, handle, grad_out, grad_expert_out, handle->weighting == EPX_WEIGHTS_IN_COMBINE,
                      "epx_combine_backward");
}

/* The host path's, on the same layout (ep/internal.h's members are not
 * constant expressions, so each is called through). */
static epx_status_t hier_layout(epx_buffer_t b, const epx_routing_t *r, ep_handle_t *h, const char *fn) {
  return epx_cuda_ep_host_path.layout(b, r, h, fn);
}

static epx_status_t hier_join_oversize(epx_buffer_t b, const epx_cuda_ep_dims_t *d, const char *fn) {
  return epx_cuda_ep_host_path.join_oversize(b, d, fn);
}

static epx_status_t hier_weights_backward(epx_buffer_t b, epx_handle_t handle, const float *grad_recv_w,
                                          float *grad_w) {
  return epx_cuda_ep_host_path.weights_backward(b, handle, grad_recv_w, grad_w);
}

static epx_status_t hier_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  return epx_cuda_ep_host_path.recv_rows_device(handle, rows);
}

static epx_status_t hier_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  return epx_cuda_ep_host_path.expert_counts(handle, counts, offsets);
}

static epx_status_t hier_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  return epx_cuda_ep_host_path.recv_routing(handle, recv_expert, recv_w);
}

static epx_status_t hier_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  return epx_cuda_ep_host_path.recv_source(handle, src_rank, src_token);
}

static void hier_peer_paths(epx_buffer_t b, int32_t *paths) { epx_cuda_ep_host_path.peer_paths(b, paths); }

/* Hop 1's rows cross nodes; hop 2's to the node's other ranks stay inside. */
static epx_status_t hier_traffic(epx_handle_t handle, int64_t *same_node_rows, int64_t *other_node_rows) {
  const ep_handle_t *h = handle->backend_state;
  const hier_plan_t *p = h->path_state;
  *other_node_rows = p->net_rows;
  *same_node_rows = 0;
  for (int64_t i = 0; i < p->nfwd; i++)
    if (p->fwd[i].peer != h->d.rank) *same_node_rows += p->fwd[i].rows;
  return EPX_SUCCESS;
}

const ep_path_t epx_cuda_ep_hier_path = {
    .name = "hierarchical",
    .supports = hier_supports,
    .setup = hier_setup,
    .buffer_fini = hier_buffer_fini,
    .layout = hier_layout,
    .join_oversize = hier_join_oversize,
    .readback_bytes = hier_readback_bytes,
    .readback = hier_readback,
    .summary = NULL,
    .laid_out = hier_laid_out,
    .handle_fini = hier_handle_fini,
    .dispatch = hier_dispatch,
    .combine = hier_combine,
    .dispatch_backward = hier_dispatch_backward,
    .combine_backward = hier_combine_backward,
    .weights_backward = hier_weights_backward,
    .recv_rows_device = hier_recv_rows_device,
    .expert_counts = hier_expert_counts,
    .recv_routing = hier_recv_routing,
    .recv_source = hier_recv_source,
    .peer_paths = hier_peer_paths,
    .traffic = hier_traffic,
};

#endif
