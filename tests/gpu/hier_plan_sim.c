/* The CUDA hierarchical path's plan (src/cuda/ep/hier.c), checked on the
 * host for many topologies: W ranks' plans are made from one random
 * gathered routing, then both hops are played with symbolic rows (a
 * group's ncclSend/ncclRecv as per-pair FIFO queues, matched in call order
 * as NCCL matches a group's calls to one peer). Dispatch: every receiver's
 * pair staging must hold, per source rank, that source's tokens with a
 * route to it in token order (the host path's dedup staging, which its
 * expansion reads). Combine: each token's sum must come out in epx.h's
 * two-level order, nodes ascending, inside a node ranks ascending. Nodes
 * of consecutive ranks and interleaved ones (NCCL's host hashes need not
 * give consecutive ranks). No GPU is touched: the path's source is compiled
 * in for its static planners. Exit status is the verdict. */
#define EPX_HAVE_NCCL 1
#include "cuda/ep/hier.c"

#include <stdio.h>

enum { MAXW = 16, TM = 7, KB = 4, K = 3, EL = 2, S = 640 };

/* A row: the text of what it holds ("x2.5": rank 2's token 5; "P2.5@3":
 * its partial on rank 3; "(a+b)": a sum in that order; "0": no rows). */
typedef struct {
  char s[S];
} row_t;

static struct epx_comm comm;
static int32_t node_of[MAXW], local_of[MAXW], node_ranks[MAXW], node_first[MAXW + 1];
static int32_t gidx[MAXW * TM * KB];
static int W, tokens[MAXW], failures;
static ep_handle_t hs[MAXW];
static hier_plan_t ps[MAXW];
static int32_t *tabs[MAXW][4]; /* net_stage, fin, own_fwd, net_fwd */
static row_t *home[MAXW], *relay_in[MAXW], *fwd[MAXW], *pairs[MAXW];

/* Messages in flight per (from, to), received in the order sent. */
typedef struct {
  row_t *rows;
  int64_t n;
} msg_t;
static msg_t queue[MAXW][MAXW][4 * MAXW];
static int sent[MAXW][MAXW], taken[MAXW][MAXW];

static void post(int from, const seg_t *g, int64_t n, row_t *base) {
  for (int64_t i = 0; i < n; i++) queue[from][g[i].peer][sent[from][g[i].peer]++] = (msg_t){base + g[i].at, g[i].rows};
}

static void take(int at, const seg_t *g, int64_t n, row_t *base) {
  for (int64_t i = 0; i < n; i++) {
    const int from = g[i].peer;
    if (taken[from][at] >= sent[from][at]) {
      printf("rank %d waits for a block from rank %d that was not sent\n", at, from), failures++;
      continue;
    }
    const msg_t m = queue[from][at][taken[from][at]++];
    if (m.n != g[i].rows) printf("rank %d<-%d: %lld rows, %lld expected\n", at, from, (long long)m.n,
                                 (long long)g[i].rows), failures++;
    else memcpy(base + g[i].at, m.rows, sizeof(row_t) * (size_t)m.n);
  }
}

static void settle(const char *what) {
  for (int a = 0; a < W; a++)
    for (int b = 0; b < W; b++) {
      if (taken[a][b] != sent[a][b]) printf("%s: a block %d->%d was not received\n", what, a, b), failures++;
      taken[a][b] = sent[a][b] = 0;
    }
}

/* dst[i] = the sum of src's rows table[i, 0..n) in order (hier.c's sum_rows). */
static void sum(row_t *dst, const row_t *src, const int32_t *table, int64_t rows, int n) {
  for (int64_t i = 0; i < rows; i++) {
    char text[S] = "(";
    int any = 0;
    for (int k = 0; k < n; k++) {
      const int32_t r = table[i * n + k];
      if (r < 0) continue;
      if (any) strcat(text, "+");
      strcat(text, src[r].s);
      any = 1;
    }
    strcat(text, ")");
    snprintf(dst[i].s, S, "%s", any ? text : "0");
  }
}

static int routes_to(int s, int t, int r) {
  for (int k = 0; k < KB; k++)
    if (gidx[(s * TM + t) * KB + k] >= 0 && gidx[(s * TM + t) * KB + k] / EL == r) return 1;
  return 0;
}

/* W ranks in nodes of L: consecutive, or rank r on node r % (W / L). */
static void make_topology(int L, int interleaved) {
  const int G = W / L;
  int at = 0;
  for (int r = 0; r < W; r++) node_of[r] = interleaved ? r % G : r / L;
  for (int g = 0; g < G; g++) {
    node_first[g] = at;
    for (int r = 0, l = 0; r < W; r++)
      if (node_of[r] == g) node_ranks[at++] = r, local_of[r] = l++;
  }
  node_first[G] = at;
  comm = (struct epx_comm){.size = W, .num_nodes = G, .ranks_per_node = L, .node_of = node_of,
                           .local_of = local_of, .node_ranks = node_ranks, .node_first = node_first};
}

/* Every rank's sanitised routing as the layout gathers it: [W * TM, KB],
 * -1 past the rank's tokens, past top_k and for dropped routes. */
static void make_routing(void) {
  for (int s = 0; s < W; s++) {
    tokens[s] = rand() % (TM + 1);
    for (int t = 0; t < TM; t++)
      for (int k = 0; k < KB; k++) {
        int32_t e = t < tokens[s] && k < K && rand() % 5 ? rand() % (EL * W) : -1;
        for (int j = 0; j < k; j++) e = gidx[(s * TM + t) * KB + j] == e ? -1 : e;
        gidx[(s * TM + t) * KB + k] = e;
      }
  }
}

/* Rank r's handle (the host path's dedup counts) and plan, as hier_laid_out makes them. */
static void make_plan(int r) {
  ep_handle_t *h = &hs[r];
  hier_plan_t *p = &ps[r];
  *h = (ep_handle_t){0};
  h->d.W = W, h->d.rank = r, h->d.El = EL, h->d.Kb = KB, h->d.Tm = TM, h->d.T = tokens[r];
  h->count[RECV_PAIRS] = calloc(2 * (size_t)W, sizeof(int64_t));
  h->displ[RECV_PAIRS] = h->count[RECV_PAIRS] + W;
  for (int s = 0; s < W; s++) {
    for (int t = 0; t < TM; t++) h->count[RECV_PAIRS][s] += routes_to(s, t, r);
    h->displ[RECV_PAIRS][s] = h->total[RECV_PAIRS];
    h->total[RECV_PAIRS] += h->count[RECV_PAIRS][s];
  }
  *p = (hier_plan_t){.G = comm.num_nodes, .L = comm.ranks_per_node, .node = node_of[r], .local = local_of[r]};
  p->net_count = malloc(sizeof(int64_t) * (size_t)(2 * p->G + 2 * W));
  p->net_displ = p->net_count + p->G, p->rnet_count = p->net_displ + p->G, p->rnet_displ = p->rnet_count + W;
  p->fwd = malloc(sizeof(seg_t) * (size_t)(2 * p->L * W + p->G + W));
  p->hop = p->fwd + p->L * W;
  p->home = p->hop + p->L * W, p->relay = p->home + p->G;
  int32_t ranks[2 * KB];
  int64_t scratch[MAXW * MAXW + MAXW];
  plan_relay(&comm, h, p, gidx, NULL, NULL, ranks, NULL);
  tabs[r][0] = malloc(4 * (TM * p->G + 1)), tabs[r][1] = malloc(4 * (TM * p->G + 1));
  tabs[r][2] = malloc(4 * (TM * p->L + 1)), tabs[r][3] = malloc(4 * (size_t)(p->rnet_rows * p->L + 1));
  plan_home(&comm, h, p, gidx, tabs[r][0], tabs[r][1], ranks, scratch);
  plan_relay(&comm, h, p, gidx, tabs[r][2], tabs[r][3], ranks, scratch);
  plan_receive(&comm, h, p);
  plan_segments(&comm, W, p);
  home[r] = calloc((size_t)(p->net_rows + TM + 1), sizeof(row_t));
  relay_in[r] = calloc((size_t)(p->rnet_rows + 1), sizeof(row_t));
  fwd[r] = calloc((size_t)(p->fwd_rows + 1), sizeof(row_t));
  pairs[r] = calloc((size_t)(h->total[RECV_PAIRS] + 1), sizeof(row_t));
}

/* hier.c's move_forward with its kernels as loops; then each pair row checked. */
static void play_dispatch(const char *what) {
  for (int r = 0; r < W; r++) {
    const hier_plan_t *p = &ps[r];
    for (int t = 0; t < tokens[r]; t++)
      for (int g = 0; g < p->G; g++)
        if (tabs[r][0][t * p->G + g] >= 0) snprintf(home[r][tabs[r][0][t * p->G + g]].s, S, "x%d.%d", r, t);
    post(r, p->home, p->nhome, home[r]);
  }
  for (int r = 0; r < W; r++) take(r, ps[r].relay, ps[r].nrelay, relay_in[r]);
  settle(what);
  for (int r = 0; r < W; r++) {
    const hier_plan_t *p = &ps[r];
    for (int t = 0; t < tokens[r]; t++)
      for (int l = 0; l < p->L; l++)
        if (tabs[r][2][t * p->L + l] >= 0) snprintf(fwd[r][tabs[r][2][t * p->L + l]].s, S, "x%d.%d", r, t);
    for (int64_t j = 0; j < p->rnet_rows; j++)
      for (int l = 0; l < p->L; l++)
        if (tabs[r][3][j * p->L + l] >= 0) fwd[r][tabs[r][3][j * p->L + l]] = relay_in[r][j];
    post(r, p->fwd, p->nfwd, fwd[r]);
  }
  for (int r = 0; r < W; r++) take(r, ps[r].hop, ps[r].nhop, pairs[r]);
  settle(what);
  for (int r = 0; r < W; r++)
    for (int s = 0, i = 0; s < W; s++)
      for (int t = 0; t < TM; t++) {
        if (!routes_to(s, t, r)) continue;
        char want[S];
        snprintf(want, S, "x%d.%d", s, t);
        if (strcmp(pairs[r][i].s, want))
          printf("%s: rank %d's pair row %d holds %s, %s expected\n", what, r, i, pairs[r][i].s, want), failures++;
        snprintf(pairs[r][i++].s, S, "P%d.%d@%d", s, t, r); /* the partial combine sends back */
      }
}

/* Token t of rank r's sum in epx.h's two-level order. */
static void expected_sum(int r, int t, char *want) {
  strcpy(want, "(");
  int nodes = 0;
  for (int g = 0; g < comm.num_nodes; g++) {
    char node[S] = "(";
    int ranks = 0;
    for (int i = node_first[g]; i < node_first[g + 1]; i++) {
      if (!routes_to(r, t, node_ranks[i])) continue;
      char part[64];
      snprintf(part, sizeof part, "%sP%d.%d@%d", ranks++ ? "+" : "", r, t, node_ranks[i]);
      strcat(node, part);
    }
    if (!ranks) continue;
    strcat(strcat(want, nodes++ ? "+" : ""), strcat(node, ")"));
  }
  strcat(want, ")");
  if (!nodes) strcpy(want, "0");
}

/* hier.c's move_backward with its kernels as loops; then each token's sum checked. */
static void play_combine(const char *what) {
  for (int r = 0; r < W; r++) post(r, ps[r].hop, ps[r].nhop, pairs[r]);
  for (int r = 0; r < W; r++) take(r, ps[r].fwd, ps[r].nfwd, fwd[r]);
  settle(what);
  for (int r = 0; r < W; r++) {
    const hier_plan_t *p = &ps[r];
    sum(relay_in[r], fwd[r], tabs[r][3], p->rnet_rows, p->L);
    sum(home[r] + p->net_rows, fwd[r], tabs[r][2], tokens[r], p->L);
    post(r, p->relay, p->nrelay, relay_in[r]);
  }
  for (int r = 0; r < W; r++) take(r, ps[r].home, ps[r].nhome, home[r]);
  settle(what);
  for (int r = 0; r < W; r++) {
    row_t out[TM];
    sum(out, home[r], tabs[r][1], tokens[r], ps[r].G);
    for (int t = 0; t < tokens[r]; t++) {
      char want[S];
      expected_sum(r, t, want);
      if (strcmp(out[t].s, want))
        printf("%s: rank %d token %d sums %s, %s expected\n", what, r, t, out[t].s, want), failures++;
    }
  }
}

static void release(void) {
  for (int r = 0; r < W; r++) {
    for (int i = 0; i < 4; i++) free(tabs[r][i]);
    free(home[r]), free(relay_in[r]), free(fwd[r]), free(pairs[r]);
    free(ps[r].net_count), free(ps[r].fwd), free(hs[r].count[RECV_PAIRS]);
  }
}

int main(void) {
  const int shapes[][2] = {{1, 1}, {2, 1}, {2, 2}, {4, 1}, {4, 2}, {4, 4}, {6, 2}, {6, 3},
                           {8, 2}, {8, 4}, {12, 3}, {16, 4}, {16, 8}};
  int runs = 0;
  for (unsigned seed = 1; seed <= 40; seed++)
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
      for (int interleaved = 0; interleaved < 2; interleaved++, runs++) {
        char what[96];
        W = shapes[i][0];
        snprintf(what, sizeof what, "W %d, %d per node%s, seed %u", W, shapes[i][1],
                 interleaved ? " (interleaved)" : "", seed);
        srand(seed * 31 + (unsigned)i);
        make_topology(shapes[i][1], interleaved);
        make_routing();
        for (int r = 0; r < W; r++) make_plan(r);
        play_dispatch(what);
        play_combine(what);
        release();
      }
  printf("hier_plan_sim: %d topologies x routings, %d failures: %s\n", runs, failures, failures ? "FAILED" : "OK");
  return failures != 0;
}
