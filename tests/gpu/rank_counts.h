/* What the one-GPU W-rank launchers (thread_ranks.h: ranks as threads,
 * proc_ranks.h: as processes) take alike: the rank counts W of the runs
 * (EPX_GPU_RANKS, e.g. "2,4", or the launcher's default; each in [1, 64]),
 * the comm's timeout (EPX_GPU_TIMEOUT seconds, 30 by default), and the
 * nodes posed for the hierarchical exchange (W / 2 ranks a node from W = 4,
 * one rank a node below). */
#ifndef EPX_TESTS_GPU_RANK_COUNTS_H
#define EPX_TESTS_GPU_RANK_COUNTS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RC_MAX_RUNS = 16 };

/* The runs' rank counts into w [RC_MAX_RUNS]; returns how many. */
static inline int rc_rank_counts(const char *fallback, int *w) {
  const char *list = getenv("EPX_GPU_RANKS");
  char ranks[64];
  snprintf(ranks, sizeof ranks, "%s", list && *list ? list : fallback);
  int n = 0;
  for (char *at = strtok(ranks, ","); at && n < RC_MAX_RUNS; at = strtok(NULL, ",")) {
    const int W = atoi(at);
    if (W >= 1 && W <= 64) w[n++] = W;
  }
  return n;
}

static inline double rc_timeout_seconds(void) {
  const char *timeout = getenv("EPX_GPU_TIMEOUT");
  return timeout && *timeout ? atof(timeout) : 30;
}

static inline int rc_ranks_per_node(int W) { return W >= 4 ? W / 2 : 1; }

#endif
