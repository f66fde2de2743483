/* Every bounded host wait on NCCL work (src/comm/nccl.c's settle and
 * stream waits, the fused module's setup): the one polling loop, its clock,
 * the pause between two polls, and the bound a fused state takes when none
 * is given. Host code only (C or CUDA host functions). */
#ifndef EPX_CORE_WAIT_H
#define EPX_CORE_WAIT_H

#include <sched.h>
#include <time.h>

#include "epx.h"

/* The bound of a wait whose caller gave none (timeout_seconds <= 0). */
#define EPX_WAIT_DEFAULT_SECONDS 60.0

static inline double epx_wait_bound(double timeout_seconds) {
  return timeout_seconds > 0 ? timeout_seconds : EPX_WAIT_DEFAULT_SECONDS;
}

/* Seconds since an arbitrary start (monotonic). */
static inline double epx_now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Between the polls of a wait that began at `started`. For its first 2 ms
 * a wait yields the core, then it sleeps. Neither a sleep (the timer slack,
 * about 50 us, on every short wait) nor a spin: a nonblocking NCCL comm
 * launches each call from a thread of its own, and where the launcher binds
 * each rank to one core (mpirun does for 2 ranks) that thread shares the
 * waiting thread's core, so a spin starves the very work it waits for
 * (bench/NOTES-gpu.md has the measurement). sched_yield
 * hands the core to that thread, and returns at once where none is ready. */
static inline void epx_wait_pause(double started) {
  if (epx_now_seconds() - started < 2e-3) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, 20000};
  nanosleep(&ts, NULL);
}

/* One poll of a wait: 1 when it is over (*status its result), 0 to poll
 * again. */
typedef int (*epx_wait_poll_fn)(void *ctx, epx_status_t *status);

/* Polls until `poll` says the wait is over, at most `seconds` (<= 0: no
 * bound), pausing between polls; past the bound, timed_out(ctx) is the
 * result. */
static inline epx_status_t epx_wait_bounded(double seconds, epx_wait_poll_fn poll, void *ctx,
                                            epx_status_t (*timed_out)(void *ctx)) {
  const double started = epx_now_seconds();
  for (;;) {
    epx_status_t status = EPX_SUCCESS;
    if (poll(ctx, &status)) return status;
    if (seconds > 0 && epx_now_seconds() - started > seconds) return timed_out(ctx);
    epx_wait_pause(started);
  }
}

#endif
