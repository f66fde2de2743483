/* epx_placement_shrink (epx.h, "Shrink and go on"): what the survivors of a
 * lost rank hold, the logical experts no survivor holds, and a new plan
 * over the survivors (epx_placement_plan) whose ranks' blocks are given to
 * the survivors that already hold most of them, so that the move to it
 * sends as little as the plan allows. Not collective: the same arguments
 * give the same results on every survivor. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/placement.h"

/* How many of the physical experts of block `block` (per entries of plan)
 * serve a logical expert that survivor `rank` holds (held [W', E] flags). */
static int32_t shrink_overlap(const int32_t *plan, int32_t per, int32_t block, const uint8_t *held_by_rank) {
  int32_t n = 0;
  for (int32_t s = 0; s < per; s++) n += held_by_rank[plan[(int64_t)block * per + s]];
  return n;
}

/* Gives each block of `plan` (W' blocks of per) to a survivor: rank by rank
 * in ascending order, the free block with the most experts it holds (the
 * lowest block on ties), written to out. */
static void shrink_assign_blocks(const int32_t *plan, int32_t W, int32_t per, const uint8_t *held, int32_t E,
                                 uint8_t *taken, int32_t *out) {
  for (int32_t r = 0; r < W; r++) {
    int32_t best = -1, best_n = -1;
    for (int32_t b = 0; b < W; b++) {
      if (taken[b]) continue;
      int32_t n = shrink_overlap(plan, per, b, held + (int64_t)r * E);
      if (n > best_n) best = b, best_n = n;
    }
    taken[best] = 1;
    memcpy(out + (int64_t)r * per, plan + (int64_t)best * per, sizeof(int32_t) * (size_t)per);
  }
}

/* The survivors' side of the old placement: survivors_p2l (may be NULL),
 * held [W', E] (survivor r' holds logical e) and kept [E] (some survivor does). */
static void shrink_survivors(const epx_placement_table_t *t, const uint8_t *lost, int32_t *survivors_p2l,
                             uint8_t *held, uint8_t *kept) {
  int32_t r_new = 0;
  for (int32_t r = 0; r < t->world_size; r++) {
    if (lost[r]) continue;
    for (int32_t s = 0; s < t->per_rank; s++) {
      int32_t e = t->logical_of[t->rank_experts[(int64_t)r * t->per_rank + s]];
      if (survivors_p2l) survivors_p2l[(int64_t)r_new * t->per_rank + s] = e;
      held[(int64_t)r_new * t->num_logical + e] = 1;
      kept[e] = 1;
    }
    r_new++;
  }
}

epx_status_t epx_placement_shrink(const epx_placement_t *placement, int32_t num_experts, int32_t num_ranks,
                                  const int32_t *lost_ranks, int32_t num_lost, const double *load,
                                  int32_t num_physical, int32_t num_groups, int32_t *survivors_physical_to_logical,
                                  int32_t *physical_to_logical, int32_t *missing, int32_t *num_missing) {
  const char *fn = "epx_placement_shrink";
  epx_error_clear();
  EPX_REQUIRE(num_experts >= 1, "%s: num_experts is %d; pass >= 1", fn, num_experts);
  EPX_REQUIRE(num_ranks >= 1, "%s: num_ranks is %d; pass the old comm's size", fn, num_ranks);
  EPX_REQUIRE(num_lost >= 0 && num_lost < num_ranks && (num_lost == 0 || lost_ranks),
              "%s: lost_ranks is %p with num_lost %d; pass epx_comm_shrink's lost ranks (fewer than "
              "num_ranks = %d)", fn, (const void *)lost_ranks, num_lost, num_ranks);
  EPX_REQUIRE(physical_to_logical, "%s: physical_to_logical is NULL; pass an int32_t array of num_physical (%d)",
              fn, num_physical);
  const int32_t W = num_ranks - num_lost;
  epx_status_t status = EPX_SUCCESS;
  epx_placement_table_t *t = NULL;
  uint8_t *lost = calloc((size_t)num_ranks, 1), *kept = calloc((size_t)num_experts, 1);
  uint8_t *held = calloc((size_t)W * (size_t)num_experts, 1), *taken = calloc((size_t)W, 1);
  double *uniform = load ? NULL : malloc(sizeof(double) * (size_t)num_experts);
  int32_t *plan = malloc(sizeof(int32_t) * (size_t)(num_physical > 0 ? num_physical : 1));
  if (!lost || !kept || !held || !taken || !plan || (!load && !uniform))
    EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int32_t i = 0; i < num_lost; i++) {
    int32_t r = lost_ranks[i];
    if (r < 0 || r >= num_ranks || lost[r])
      EPX_FAIL(EPX_ERROR_INVALID_ARGUMENT, "%s: lost_ranks[%d] is %d; pass distinct ranks in [0, %d)", fn, i, r,
               num_ranks);
    lost[r] = 1;
  }
  EPX_CHECK(epx_placement_table_new(fn, "placement", placement, num_experts, num_ranks, &t));
  if (!load)
    for (int32_t e = 0; e < num_experts; e++) uniform[e] = 1.0;
  EPX_CHECK(epx_placement_plan(load ? load : uniform, num_experts, num_physical, W, 1, num_groups, plan));
  shrink_survivors(t, lost, survivors_physical_to_logical, held, kept);
  shrink_assign_blocks(plan, W, num_physical / W, held, num_experts, taken, physical_to_logical);
  int32_t count = 0;
  for (int32_t e = 0; e < num_experts; e++) {
    if (missing) missing[e] = !kept[e];
    count += !kept[e];
  }
  if (num_missing) *num_missing = count;
fail:
  epx_placement_table_free(t);
  free(lost), free(kept), free(held), free(taken), free(uniform), free(plan);
  return status;
}
