/* Transport cases shared by every transport's test: tests/test_comm.c runs
 * them over the self and local transports (ranks as threads), tests/mpi_comm.c
 * over MPI (ranks as processes). Payloads encode (source, destination, index)
 * so each rank checks exactly where every word came from. A case returns its
 * failed checks (printed with the rank and line), so it runs on a rank's
 * thread as well as in a process. */
#ifndef EPX_TESTS_COMM_CASES_H
#define EPX_TESTS_COMM_CASES_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "clock.h" /* tu_seconds */
#include "core/registry.h"
#include "epx.h"

/* The comm behind a public comm id (core/registry.h): the cases call its
 * transport's operations directly. */
#define COMM(id) ((epx_comm_t)epx_registry_get((id), EPX_OBJECT_COMM))

void cc_sleep_seconds(double seconds);

/* 1 when every byte is the 0xA5 of tu_poison. */
int cc_is_poisoned(const void *data, size_t bytes);

/* Every operation of the transport vtable once, as round `round` (units of 12
 * bytes, or of 4 KiB when `big`), then epx_comm_rank/size/check_alive.
 * The barrier is checked with `arrivals` when the ranks share memory (each
 * rank counts itself in before it; NULL over processes), else by timing a
 * last rank that arrives 0.1 s late. */
int cc_ops_round(epx_comm_t comm, int round, int big, atomic_int *arrivals);
int cc_ops(epx_comm_t comm, int rounds, atomic_int *arrivals);

/* A skipped collective. Ranks >= skip_from skip one operation (an alltoall,
 * or a barrier with `barrier`); the others must get EPX_ERROR_TIMEOUT in
 * about `timeout` seconds with a message holding both `expected` (the
 * second may be NULL), leave their
 * output alone, and then every later call on the comm must fail at once with
 * EPX_ERROR_PEER_FAILED saying where it failed and holding `named`.
 * `side_sync` (the test's own, not epx's) is called by every rank after the
 * timeout: the skippers leave it only after the others timed out. Skippers
 * check the later calls too when `skippers_see_failure` (shared memory). */
typedef struct cc_timeout {
  int32_t skip_from;
  int barrier;
  double timeout;
  const char *expected[2];
  const char *named;
  int skippers_see_failure;
  void (*side_sync)(struct cc_timeout *t, int timed_out);
  atomic_int timed_out; /* free for side_sync's use */
} cc_timeout_t;
int cc_timeout_case(epx_comm_t comm, cc_timeout_t *t);
/* The side_sync of ranks that share memory (threads, or processes with t in
 * a shared page): the skippers wait until the others have timed out (20 s
 * at most), then find the comm failed too. */
void cc_wait_for_timeouts(cc_timeout_t *t, int timed_out);
/* cc_timeout_case(comm, t) as a rank function (tu_rank_fn's shape). */
int cc_timeout_rank(epx_comm_t comm, int32_t rank, int32_t size, void *t);

#endif
