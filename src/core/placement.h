/* The placement rule (epx.h, "Expert placement and replicas"): which rank
 * holds each physical expert, its slot there, and which physical experts
 * serve each logical one. The one place the backends learn where an expert
 * lives; what used to be written out as `e / E_local` is
 * epx_placement_rank(table, e).
 *
 * The table is one int32 block (`data`), laid out as
 *   rank_of[P] | slot_of[P] | logical_of[P] | replica_first[E + 1] | replicas[P] | rank_experts[P]
 * so a device backend uploads it with one copy (epx_placement_table_words
 * int32 words) and indexes it as the host does; epx_placement_pick is plain
 * C, usable from device code. */
#ifndef EPX_CORE_PLACEMENT_H
#define EPX_CORE_PLACEMENT_H

#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Inline helpers below are plain C, compiled for the device too by nvcc. */
#if defined(__CUDACC__)
#define EPX_PLACEMENT_HD __host__ __device__
#else
#define EPX_PLACEMENT_HD
#endif

typedef struct epx_placement_table {
  int32_t num_logical;  /* E */
  int32_t num_physical; /* P, a multiple of W */
  int32_t world_size;   /* W */
  int32_t per_rank;     /* P / W: E_local */
  int32_t contiguous;   /* 1: today's map (P == E, expert e on rank e / per_rank, round-robin rule) */
  epx_replica_rule_t rule;
  uint64_t hash;        /* of P, the rule and the maps: what the ranks compare at buffer creation */
  int32_t *data;        /* the block below (owned) */
  int32_t *rank_of;     /* [P] rank holding physical p */
  int32_t *slot_of;     /* [P] p's local expert index on its rank */
  int32_t *logical_of;  /* [P] the logical expert p serves */
  int32_t *replica_first; /* [E + 1] logical e's replicas: replicas[replica_first[e] .. replica_first[e + 1]) */
  int32_t *replicas;    /* [P] physical ids grouped by logical expert, ascending inside a group */
  int32_t *rank_experts;/* [W * per_rank] rank r's physical experts by slot */
  epx_placement_t view; /* the placement as epx.h states it, pointing into data (physical_rank set) */
} epx_placement_table_t;

/* Builds the table of `given` (NULL: the contiguous map) for E logical
 * experts over W ranks, checking every field; errors name fn and `what`
 * (the argument, "config.placement"). *out is the caller's to free. */
epx_status_t epx_placement_table_new(const char *fn, const char *what, const epx_placement_t *given, int32_t E,
                                     int32_t W, epx_placement_table_t **out);
void epx_placement_table_free(epx_placement_table_t *table);

/* Whether a caller's placement (NULL: yes) is the contiguous map of E
 * experts: P == E, identity maps, the round-robin rule, P / W a rank in
 * ascending order (W read from the last rank). For a backend's supports,
 * which sees the config, not the table. */
int epx_placement_is_contiguous(const epx_placement_t *placement, int32_t E);

/* int32 words of the table's block. */
static inline int64_t epx_placement_table_words(const epx_placement_table_t *t) {
  return 5 * (int64_t)t->num_physical + t->num_logical + 1;
}

static inline int32_t epx_placement_rank(const epx_placement_table_t *t, int32_t physical) {
  return t->rank_of[physical];
}

/* The round-robin rule (epx.h): replica (token + src_rank) mod n of logical
 * expert e. */
static inline EPX_PLACEMENT_HD int32_t epx_placement_pick(const int32_t *replica_first, const int32_t *replicas, int32_t logical,
                                         int32_t src_rank, int64_t token) {
  int32_t first = replica_first[logical], n = replica_first[logical + 1] - first;
  if (n == 1) return replicas[first];
  return replicas[first + (int32_t)(((uint64_t)token + (uint64_t)src_rank) % (uint64_t)n)];
}

/* The physical routing of rank src_rank's [T, K] routing `in` (-1 kept):
 * the rule's choice for logical ids, a copy for caller-given physical ids. */
void epx_placement_map_routing(const epx_placement_table_t *t, int32_t src_rank, int64_t T, int32_t K,
                               const int32_t *in, int32_t *out);

/* The device's copy of the table (a CUDA buffer uploads it once, at
 * creation): the block above followed by pos_of[P], p's place in rank
 * order (rank_of[p] * per_rank + slot_of[p]). The device routes in these
 * rank-ordered ids: under them `id / per_rank` is the table's rank and
 * `id % per_rank` its slot, so the exchange's kernels keep their contiguous
 * arithmetic and the table is read once per route, at the layout's entry
 * (epx_placement_rank_token), and once per id handed back
 * (rank_experts[id]). The contiguous map's rank order is its numbering. */
static inline int64_t epx_placement_device_words(const epx_placement_table_t *t) {
  return epx_placement_table_words(t) + t->num_physical;
}
/* Fills out [epx_placement_device_words] (core/placement.c). */
void epx_placement_pack_device(const epx_placement_table_t *t, int32_t *out);

/* The rank-ordered routing of token t of rank src_rank (K routes of `in`,
 * its caller's ids) from the device block `tab` (epx_placement_pack_device)
 * of E logical, P physical experts; caller != 0 for EPX_REPLICA_CALLER.
 * -1 stays -1. So that the layout kernels refuse a bad route where it is,
 * with their own checks: an id outside [0, routing ids) becomes -2 (below
 * -1), and a route to a logical expert the token already chose takes the
 * earlier route's id (a repeated id). logical[k] gets each valid route's
 * logical expert, -1 for the others (the load counts). Plain C, the same
 * code on the host (the test oracle) and the device. */
static inline EPX_PLACEMENT_HD void epx_placement_rank_token(const int32_t *tab, int32_t E, int32_t P, int32_t caller,
                                                              int32_t src_rank, int64_t t, int32_t K,
                                                              const int32_t *in, int32_t *out, int32_t *logical) {
  const int32_t *logical_of = tab + 2 * (int64_t)P, *replica_first = tab + 3 * (int64_t)P;
  const int32_t *replicas = replica_first + E + 1, *pos_of = replicas + 2 * (int64_t)P;
  const int32_t ids = caller ? P : E;
  for (int32_t k = 0; k < K; k++) {
    const int32_t e = in[k];
    logical[k] = -1;
    if (e == -1) {
      out[k] = -1;
      continue;
    }
    if (e < -1 || e >= ids) {
      out[k] = -2;
      continue;
    }
    const int32_t l = caller ? logical_of[e] : e;
    int32_t twice = -1;
    for (int32_t j = 0; j < k; j++)
      if (logical[j] == l) twice = j;
    if (twice >= 0) {
      out[k] = out[twice];
      continue;
    }
    logical[k] = l;
    const int32_t p = caller ? e : epx_placement_pick(replica_first, replicas, e, src_rank, t);
    out[k] = pos_of[p];
  }
}

/* Ids a routing may hold under the table: E for the round-robin rule, P for
 * caller-given physical ids. */
static inline int32_t epx_placement_routing_ids(const epx_placement_table_t *t) {
  return t->rule == EPX_REPLICA_CALLER ? t->num_physical : t->num_logical;
}

/* The logical expert a routing id names. */
static inline int32_t epx_placement_routing_logical(const epx_placement_table_t *t, int32_t id) {
  return t->rule == EPX_REPLICA_CALLER ? t->logical_of[id] : id;
}

/* E_local of a buffer config as given to epx_buffer_create (its placement,
 * if any, not yet checked but its num_physical read): P / W. */
static inline int64_t epx_config_experts_per_rank(const epx_buffer_config_t *c, int64_t W) {
  int64_t P = c->placement && c->placement->num_physical > 0 ? c->placement->num_physical : c->num_experts;
  return P / W;
}

#ifdef __cplusplus
}
#endif

#endif
