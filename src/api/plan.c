/* The placement planner (epx_placement_plan) and the expected rank loads of
 * a placement (epx_placement_rank_load). The planner follows DeepSeek's
 * published EPLB scheme (github.com/deepseek-ai/EPLB, eplb.py), written
 * anew in C:
 *   1. expert groups packed onto nodes by load (balanced packing: heaviest
 *      first, each to the lightest node with room);
 *   2. each node's redundant experts given one at a time to the expert with
 *      the largest load per replica;
 *   3. each node's physical experts packed onto its ranks the same way,
 *      a replica kept off a rank that already serves its expert where a
 *      rank with room allows it;
 * then (ours) a refinement: while swapping a physical expert of the
 * heaviest rank with one of a lighter rank of its node lowers the heaviest
 * load, make the best such swap. Every tie goes to the lower index, so the
 * plan is a function of its inputs alone. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/placement.h"

typedef struct {
  int32_t n;            /* items */
  const double *weight; /* [n] */
  const int32_t *tag;   /* [n] the logical expert of an item (kept apart on a pack where room allows), or NULL */
} items_t;

/* Items in descending weight, ties by index. */
static int32_t *by_weight(const items_t *it) {
  int32_t *order = malloc(sizeof(int32_t) * (size_t)(it->n ? it->n : 1));
  if (!order) return NULL;
  for (int32_t i = 0; i < it->n; i++) order[i] = i;
  for (int32_t i = 1; i < it->n; i++) { /* insertion sort: stable, n is small (experts) */
    int32_t x = order[i], j = i;
    while (j > 0 && it->weight[order[j - 1]] < it->weight[x]) order[j] = order[j - 1], j--;
    order[j] = x;
  }
  return order;
}

/* 1 when pack p already holds an item tagged `tag`. */
static int pack_has(const int32_t *pack_of, const items_t *it, int32_t upto_item_count, const int32_t *order,
                    int32_t p, int32_t tag) {
  for (int32_t j = 0; j < upto_item_count; j++)
    if (pack_of[order[j]] == p && it->tag[order[j]] == tag) return 1;
  return 0;
}

/* Balanced packing of n items into packs of n / packs each: pack_of [n],
 * rank_in [n] (the item's index inside its pack). */
static epx_status_t pack(const items_t *it, int32_t packs, int32_t *pack_of, int32_t *rank_in) {
  int32_t per = it->n / packs;
  int32_t *order = by_weight(it), *count = calloc((size_t)packs, sizeof(int32_t));
  double *load = calloc((size_t)packs, sizeof(double));
  if (!order || !count || !load) {
    free(order), free(count), free(load);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "epx_placement_plan: out of memory");
  }
  for (int32_t j = 0; j < it->n; j++) {
    int32_t i = order[j], best = -1, best_free = -1;
    for (int32_t p = 0; p < packs; p++) {
      if (count[p] == per) continue;
      if (best_free < 0 || load[p] < load[best_free]) best_free = p;
      if (it->tag && pack_has(pack_of, it, j, order, p, it->tag[i])) continue;
      if (best < 0 || load[p] < load[best]) best = p;
    }
    if (best < 0) best = best_free;
    pack_of[i] = best;
    rank_in[i] = count[best]++;
    load[best] += it->weight[i];
  }
  free(order), free(count), free(load);
  return EPX_SUCCESS;
}

/* Replicates n logical experts (load [n]) into m physical ones: phys [m] the
 * logical expert of each (the n first once each, in order, then the
 * replicas), count [n] each one's replicas. */
static void replicate(const double *load, int32_t n, int32_t m, int32_t *phys, int32_t *count) {
  for (int32_t e = 0; e < n; e++) phys[e] = e, count[e] = 1;
  for (int32_t i = n; i < m; i++) {
    int32_t best = 0;
    for (int32_t e = 1; e < n; e++)
      if (load[e] * count[best] > load[best] * count[e]) best = e;
    phys[i] = best;
    count[best]++;
  }
}

/* The refinement inside one node: ranks [0, R) of `per` slots each, slot
 * (r, s) holding logical slot_log[r * per + s] of weight slot_w[...]. */
static void refine(int32_t R, int32_t per, int32_t *slot_log, double *slot_w) {
  double *load = calloc((size_t)R, sizeof(double));
  if (!load) return; /* the unrefined plan stands */
  for (int32_t i = 0; i < R * per; i++) load[i / per] += slot_w[i];
  for (int32_t round = 0; round < 4 * R * per; round++) {
    int32_t h = 0;
    for (int32_t r = 1; r < R; r++)
      if (load[r] > load[h]) h = r;
    double best = load[h];
    int32_t ba = -1, bb = -1;
    for (int32_t a = h * per; a < (h + 1) * per; a++)
      for (int32_t b = 0; b < R * per; b++) {
        int32_t r = b / per;
        if (r == h || slot_w[b] >= slot_w[a]) continue;
        double nh = load[h] - slot_w[a] + slot_w[b], nr = load[r] - slot_w[b] + slot_w[a];
        double worst = nh > nr ? nh : nr;
        if (worst >= best) continue;
        /* No rank serves one expert twice. */
        int dup = 0;
        for (int32_t s = 0; s < per && !dup; s++)
          dup = (h * per + s != a && slot_log[h * per + s] == slot_log[b]) ||
                (r * per + s != b && slot_log[r * per + s] == slot_log[a]);
        if (dup) continue;
        best = worst, ba = a, bb = b;
      }
    if (ba < 0) break;
    int32_t r = bb / per, tl = slot_log[ba];
    double tw = slot_w[ba];
    load[h] += slot_w[bb] - tw, load[r] += tw - slot_w[bb];
    slot_log[ba] = slot_log[bb], slot_w[ba] = slot_w[bb];
    slot_log[bb] = tl, slot_w[bb] = tw;
  }
  free(load);
}

/* One node's plan: its logical experts `logical` [n] (global ids) of load
 * `load` [n] onto R ranks of `per` physical slots; writes the node's
 * physical_to_logical [R * per]. */
static epx_status_t plan_node(const int32_t *logical, const double *load, int32_t n, int32_t R, int32_t per,
                              int32_t *out) {
  int32_t m = R * per;
  int32_t *phys = malloc(sizeof(int32_t) * (size_t)m), *count = malloc(sizeof(int32_t) * (size_t)n);
  int32_t *pack_of = malloc(sizeof(int32_t) * (size_t)m), *rank_in = malloc(sizeof(int32_t) * (size_t)m);
  int32_t *tag = malloc(sizeof(int32_t) * (size_t)m);
  double *w = malloc(sizeof(double) * (size_t)m), *slot_w = malloc(sizeof(double) * (size_t)m);
  epx_status_t status = EPX_SUCCESS;
  if (!phys || !count || !pack_of || !rank_in || !tag || !w || !slot_w)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "epx_placement_plan: out of memory");
  replicate(load, n, m, phys, count);
  for (int32_t i = 0; i < m; i++) w[i] = load[phys[i]] / count[phys[i]], tag[i] = phys[i];
  items_t it = {m, w, tag};
  EPX_CHECK(pack(&it, R, pack_of, rank_in));
  for (int32_t i = 0; i < m; i++) {
    int32_t slot = pack_of[i] * per + rank_in[i];
    out[slot] = phys[i];
    slot_w[slot] = w[i];
  }
  refine(R, per, out, slot_w);
  for (int32_t i = 0; i < m; i++) out[i] = logical[out[i]];
fail:
  free(phys), free(count), free(pack_of), free(rank_in), free(tag), free(w), free(slot_w);
  return status;
}

static epx_status_t check_plan_args(const double *load, int32_t E, int32_t P, int32_t W, int32_t N, int32_t G,
                                    const int32_t *out) {
  const char *fn = "epx_placement_plan";
  EPX_REQUIRE(load && out, "%s: load (%p) and physical_to_logical (%p) must be host arrays", fn, (const void *)load,
              (const void *)out);
  EPX_REQUIRE(E >= 1 && W >= 1 && N >= 1, "%s: num_experts %d, num_ranks %d and num_nodes %d must be >= 1", fn, E, W,
              N);
  EPX_REQUIRE(P >= E && P % W == 0, "%s: num_physical is %d; pass >= num_experts (%d) and a multiple of num_ranks (%d)",
              fn, P, E, W);
  EPX_REQUIRE(W % N == 0, "%s: num_ranks %d is not a multiple of num_nodes %d", fn, W, N);
  EPX_REQUIRE(G >= 1 && E % G == 0, "%s: num_groups is %d; pass a divisor of num_experts (%d), 1 for none", fn, G, E);
  for (int32_t e = 0; e < E; e++)
    EPX_REQUIRE(load[e] >= 0 && load[e] < 1e300, "%s: load[%d] is %g; loads are finite and >= 0", fn, e, load[e]);
  return EPX_SUCCESS;
}

epx_status_t epx_placement_plan(const double *load, int32_t num_experts, int32_t num_physical, int32_t num_ranks,
                                int32_t num_nodes, int32_t num_groups, int32_t *physical_to_logical) {
  epx_error_clear();
  epx_status_t status =
      check_plan_args(load, num_experts, num_physical, num_ranks, num_nodes, num_groups, physical_to_logical);
  if (status != EPX_SUCCESS) return status;
  int32_t E = num_experts, P = num_physical, W = num_ranks, N = num_nodes, G = num_groups;
  /* Node-aware only where whole groups fit the nodes evenly (EPLB's rule). */
  if (G % N != 0) N = 1, G = 1;
  int32_t group_size = E / G, per_node = G / N, log_per_node = E / N;
  int32_t *group_node = malloc(sizeof(int32_t) * (size_t)G), *group_rank = malloc(sizeof(int32_t) * (size_t)G);
  int32_t *logical = malloc(sizeof(int32_t) * (size_t)E);
  double *group_load = calloc((size_t)G, sizeof(double)), *node_load = malloc(sizeof(double) * (size_t)E);
  if (!group_node || !group_rank || !logical || !group_load || !node_load)
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "epx_placement_plan: out of memory");
  for (int32_t e = 0; e < E; e++) group_load[e / group_size] += load[e];
  items_t groups = {G, group_load, NULL};
  EPX_CHECK(pack(&groups, N, group_node, group_rank));
  /* Node n's logical experts: its groups in packing order, each in order. */
  for (int32_t g = 0; g < G; g++)
    for (int32_t i = 0; i < group_size; i++)
      logical[(group_node[g] * per_node + group_rank[g]) * group_size + i] = g * group_size + i;
  for (int32_t n = 0; n < N; n++) {
    const int32_t *mine = logical + (size_t)n * log_per_node;
    for (int32_t i = 0; i < log_per_node; i++) node_load[i] = load[mine[i]];
    EPX_CHECK(plan_node(mine, node_load, log_per_node, W / N, P / W, physical_to_logical + (size_t)n * (P / N)));
  }
fail:
  free(group_node), free(group_rank), free(logical), free(group_load), free(node_load);
  return status;
}

epx_status_t epx_placement_rank_load(const epx_placement_t *placement, int32_t num_experts, int32_t num_ranks,
                                     const double *load, double *rank_load) {
  const char *fn = "epx_placement_rank_load";
  epx_error_clear();
  EPX_REQUIRE(load && rank_load, "%s: load and rank_load must be host arrays", fn);
  EPX_REQUIRE(num_experts >= 1 && num_ranks >= 1, "%s: num_experts %d and num_ranks %d must be >= 1", fn, num_experts,
              num_ranks);
  epx_placement_table_t *t = NULL;
  epx_status_t status = epx_placement_table_new(fn, "placement", placement, num_experts, num_ranks, &t);
  if (status != EPX_SUCCESS) return status;
  for (int32_t r = 0; r < num_ranks; r++) rank_load[r] = 0;
  for (int32_t p = 0; p < t->num_physical; p++) {
    int32_t e = t->logical_of[p];
    rank_load[t->rank_of[p]] += load[e] / (t->replica_first[e + 1] - t->replica_first[e]);
  }
  epx_placement_table_free(t);
  return EPX_SUCCESS;
}
