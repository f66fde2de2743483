/* The placement table (core/placement.h): built and checked from a caller's
 * epx_placement_t, or the contiguous map. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/placement.h"

static uint64_t fnv(uint64_t h, const void *bytes, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)bytes)[i]) * 1099511628211ull;
  return h;
}

/* The caller's maps, each entry in range, P / W physical experts a rank and
 * every logical expert served. */
static epx_status_t check_given(const char *fn, const char *what, const epx_placement_t *g, int32_t E, int32_t W) {
  EPX_REQUIRE(g->num_physical >= E && g->num_physical % W == 0,
              "%s: %s->num_physical is %d; it must be >= num_experts (%d) and a multiple of the comm size %d "
              "(P / W physical experts on every rank)", fn, what, g->num_physical, E, W);
  EPX_REQUIRE(g->physical_to_logical, "%s: %s->physical_to_logical is NULL; pass the [num_physical] logical expert "
              "of each physical one", fn, what);
  EPX_REQUIRE(g->replica_rule == EPX_REPLICA_ROUND_ROBIN || g->replica_rule == EPX_REPLICA_CALLER,
              "%s: %s->replica_rule %d is not EPX_REPLICA_ROUND_ROBIN or EPX_REPLICA_CALLER", fn, what,
              (int)g->replica_rule);
  int32_t P = g->num_physical;
  for (int32_t p = 0; p < P; p++) {
    int32_t e = g->physical_to_logical[p];
    EPX_REQUIRE(e >= 0 && e < E, "%s: %s->physical_to_logical[%d] is %d, outside [0, num_experts = %d)", fn, what, p,
                e, E);
    if (g->physical_rank)
      EPX_REQUIRE(g->physical_rank[p] >= 0 && g->physical_rank[p] < W,
                  "%s: %s->physical_rank[%d] is %d, outside [0, comm size = %d)", fn, what, p, g->physical_rank[p], W);
  }
  return EPX_SUCCESS;
}

/* replica_first / replicas from logical_of, rank_experts and slot_of from
 * rank_of; the counts checked (every logical served, P / W a rank). */
static epx_status_t index_table(const char *fn, const char *what, epx_placement_table_t *t) {
  int32_t E = t->num_logical, P = t->num_physical, W = t->world_size;
  memset(t->replica_first, 0, sizeof(int32_t) * (size_t)(E + 1));
  for (int32_t p = 0; p < P; p++) t->replica_first[t->logical_of[p] + 1]++;
  for (int32_t e = 0; e < E; e++) {
    EPX_REQUIRE(t->replica_first[e + 1] > 0,
                "%s: %s serves no replica of logical expert %d; every expert needs at least one physical expert in "
                "physical_to_logical", fn, what, e);
    t->replica_first[e + 1] += t->replica_first[e];
  }
  int32_t *fill = calloc((size_t)(E > W ? E : W), sizeof(int32_t));
  if (!fill) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t p = 0; p < P; p++) t->replicas[t->replica_first[t->logical_of[p]] + fill[t->logical_of[p]]++] = p;
  memset(fill, 0, sizeof(int32_t) * (size_t)(E > W ? E : W));
  epx_status_t status = EPX_SUCCESS;
  for (int32_t p = 0; p < P; p++) {
    int32_t r = t->rank_of[p];
    if (fill[r] == t->per_rank) {
      status = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                         "%s: %s->physical_rank puts more than num_physical / W = %d physical experts on rank %d; "
                         "every rank holds exactly that many", fn, what, t->per_rank, r);
      break;
    }
    t->slot_of[p] = fill[r];
    t->rank_experts[(int64_t)r * t->per_rank + fill[r]++] = p;
  }
  free(fill);
  return status;
}

static int is_contiguous(const epx_placement_table_t *t) {
  if (t->num_physical != t->num_logical || t->rule != EPX_REPLICA_ROUND_ROBIN) return 0;
  for (int32_t p = 0; p < t->num_physical; p++)
    if (t->logical_of[p] != p || t->rank_of[p] != p / t->per_rank) return 0;
  return 1;
}

epx_status_t epx_placement_table_new(const char *fn, const char *what, const epx_placement_t *given, int32_t E,
                                     int32_t W, epx_placement_table_t **out) {
  *out = NULL;
  if (given) {
    epx_status_t status = check_given(fn, what, given, E, W);
    if (status != EPX_SUCCESS) return status;
  } else {
    EPX_REQUIRE(E % W == 0, "%s: num_experts is %d, not a multiple of the comm size %d; pass a %s with num_physical "
                "a multiple of it", fn, E, W, what);
  }
  int32_t P = given ? given->num_physical : E;
  epx_placement_table_t *t = calloc(1, sizeof *t);
  if (t) t->data = malloc(sizeof(int32_t) * (size_t)(5 * (int64_t)P + E + 1));
  if (!t || !t->data) {
    free(t);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory (the placement of %d experts)", fn, P);
  }
  t->num_logical = E, t->num_physical = P, t->world_size = W, t->per_rank = P / W;
  t->rule = given ? given->replica_rule : EPX_REPLICA_ROUND_ROBIN;
  t->rank_of = t->data;
  t->slot_of = t->rank_of + P;
  t->logical_of = t->slot_of + P;
  t->replica_first = t->logical_of + P;
  t->replicas = t->replica_first + E + 1;
  t->rank_experts = t->replicas + P;
  for (int32_t p = 0; p < P; p++) {
    t->logical_of[p] = given ? given->physical_to_logical[p] : p;
    t->rank_of[p] = given && given->physical_rank ? given->physical_rank[p] : p / t->per_rank;
  }
  epx_status_t status = index_table(fn, what, t);
  if (status != EPX_SUCCESS) {
    epx_placement_table_free(t);
    return status;
  }
  t->contiguous = is_contiguous(t);
  uint64_t h = 1469598103934665603ull;
  int32_t head[3] = {E, P, (int32_t)t->rule};
  h = fnv(h, head, sizeof head);
  h = fnv(h, t->logical_of, sizeof(int32_t) * (size_t)P);
  t->hash = fnv(h, t->rank_of, sizeof(int32_t) * (size_t)P);
  t->view = (epx_placement_t){P, t->logical_of, t->rank_of, t->rule};
  *out = t;
  return EPX_SUCCESS;
}

void epx_placement_table_free(epx_placement_table_t *table) {
  if (!table) return;
  free(table->data);
  free(table);
}

void epx_placement_map_routing(const epx_placement_table_t *t, int32_t src_rank, int64_t T, int32_t K,
                               const int32_t *in, int32_t *out) {
  if (t->contiguous || t->rule == EPX_REPLICA_CALLER) {
    if (T > 0 && K > 0) memcpy(out, in, sizeof(int32_t) * (size_t)(T * K));
    return;
  }
  for (int64_t i = 0; i < T; i++)
    for (int32_t k = 0; k < K; k++) {
      int32_t e = in[i * K + k];
      out[i * K + k] = e < 0 ? e : epx_placement_pick(t->replica_first, t->replicas, e, src_rank, i);
    }
}

int epx_placement_is_contiguous(const epx_placement_t *g, int32_t E) {
  if (!g) return 1;
  if (g->num_physical != E || E < 1 || g->replica_rule != EPX_REPLICA_ROUND_ROBIN || !g->physical_to_logical) return 0;
  for (int32_t p = 0; p < E; p++)
    if (g->physical_to_logical[p] != p) return 0;
  if (!g->physical_rank) return 1;
  int32_t W = g->physical_rank[E - 1] + 1;
  if (W < 1 || E % W) return 0;
  for (int32_t p = 0; p < E; p++)
    if (g->physical_rank[p] != p / (E / W)) return 0;
  return 1;
}

void epx_placement_pack_device(const epx_placement_table_t *t, int32_t *out) {
  const int64_t words = epx_placement_table_words(t);
  memcpy(out, t->data, sizeof(int32_t) * (size_t)words);
  for (int32_t p = 0; p < t->num_physical; p++) out[words + p] = t->rank_of[p] * t->per_rank + t->slot_of[p];
}
