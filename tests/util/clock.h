/* Seconds on the monotonic clock: the tests' timings of waits, recoveries
 * and steps. */
#ifndef EPX_TESTS_CLOCK_H
#define EPX_TESTS_CLOCK_H

#include <time.h>

static inline double tu_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif
