/* The one assertion family of the C tests (tests/, tests/gpu; also
 * bench/gpu/bench_ep.c through tests/gpu/mpi_gpu_check.h). A check names
 * what must hold; its prefix says what a failure does, which depends on
 * where the check runs.
 *
 * In a cmocka test, on the test's own thread, a failure fails the test
 * (cmocka's assert_* check plain values):
 *   EXPECT_OK(call)                      an epx call returned EPX_SUCCESS;
 *   EXPECT_STATUS(call, status, needle)  it returned status and
 *                                        epx_last_error() contains needle
 *                                        (NULL: any message);
 *   CUDA_OK(call)                        a CUDA runtime call succeeded.
 *
 * On a rank (a tu_run_ranks thread, where cmocka's asserts are not
 * thread-safe, or an MPI process), a failure is printed with the rank and
 * line and counted; the run goes on, and the count is the rank's verdict:
 *   RANK_EXPECT(cond, fmt, ...)          the condition holds;
 *   RANK_OK(call)                        as EXPECT_OK;
 *   RANK_STATUS(call, status, needle)    as EXPECT_STATUS;
 *   RANK_REQUIRE(cond, fmt, ...)         as RANK_EXPECT, then `goto done`;
 *   RANK_REQUIRE_OK(call)                as RANK_OK, then `goto done` (for
 *                                        calls the rest of the run needs).
 * They count in `failures` and name `rank`, both in scope where they are
 * used; a program that keeps them under other names defines CHECK_FAILURES
 * and CHECK_RANK before including this header.
 *
 * Where a rank cannot go on and must not leave its peers waiting (the setup
 * of the MPI and forked GPU programs), a failure prints the rank, place and
 * why and ends the process at once, under MPI every rank (MPI_Abort):
 *   FATAL_UNLESS_OK(call)                exit status 2;
 *   FATAL_UNLESS_CUDA_OK(call)           exit status 3.
 *
 * The CUDA checks exist where <cuda_runtime_api.h> was included first, the
 * MPI abort where <mpi.h> was. */
#ifndef EPX_TESTS_CHECK_H
#define EPX_TESTS_CHECK_H

#include <stdio.h>
#include <unistd.h>

#include "epx.h"

#ifndef CHECK_RANK
#define CHECK_RANK rank
#endif
#ifndef CHECK_FAILURES
#define CHECK_FAILURES failures
#endif

/* 1 if the last error message contains needle (NULL: any message). A
 * function, so a literal NULL needle never reaches strstr (gcc's -Wnonnull);
 * in tests/util/testutil.c. */
int tu_message_has(const char *needle);

/* In a cmocka test ------------------------------------------------------- */

#define EXPECT_STATUS(expr, expected, needle)                                    \
  do {                                                                           \
    epx_status_t check_status_ = (expr);                                         \
    if (check_status_ != (expected))                                             \
      fail_msg("%s returned %s, expected %s: %s", #expr,                         \
               epx_status_string(check_status_), epx_status_string(expected),   \
               epx_last_error());                                                \
    const char *check_needle_ = (needle);                                        \
    if (!tu_message_has(check_needle_))                                          \
      fail_msg("%s: message \"%s\" lacks \"%s\"", #expr, epx_last_error(),     \
               check_needle_);                                                   \
  } while (0)

#define EXPECT_OK(expr)                                                          \
  do {                                                                           \
    epx_status_t check_status_ = (expr);                                         \
    if (check_status_ != EPX_SUCCESS)                                            \
      fail_msg("%s returned %s: %s", #expr, epx_status_string(check_status_),    \
               epx_last_error());                                                \
  } while (0)

#ifdef CUDART_VERSION
#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    cudaError_t check_cuda_ = (call);                                                          \
    if (check_cuda_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(check_cuda_)); \
  } while (0)
#endif

/* On a rank ------------------------------------------------------------- */

#define RANK_EXPECT(cond, ...)                                          \
  do {                                                                  \
    if (!(cond)) {                                                      \
      fprintf(stderr, "rank %d, line %d: ", (int)(CHECK_RANK), __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                     \
      fprintf(stderr, "\n");                                            \
      CHECK_FAILURES++;                                                 \
    }                                                                   \
  } while (0)

#define RANK_STATUS(expr, want, needle)                                                          \
  do {                                                                                           \
    epx_status_t rs_ = (expr);                                                                   \
    const char *rs_needle_ = (needle);                                                           \
    RANK_EXPECT(rs_ == (want) && tu_message_has(rs_needle_),                                     \
                "%s returned %s (want %s): \"%s\" (want \"%s\")", #expr, epx_status_string(rs_), \
                epx_status_string(want), epx_last_error(), rs_needle_ ? rs_needle_ : "");        \
  } while (0)

#define RANK_OK(expr) RANK_STATUS(expr, EPX_SUCCESS, (const char *)NULL)

#define RANK_REQUIRE(cond, ...)                    \
  do {                                             \
    long long rank_before_ = CHECK_FAILURES;       \
    RANK_EXPECT(cond, __VA_ARGS__);                \
    if (CHECK_FAILURES != rank_before_) goto done; \
  } while (0)

#define RANK_REQUIRE_OK(expr)                      \
  do {                                             \
    long long rank_before_ = CHECK_FAILURES;       \
    RANK_OK(expr);                                 \
    if (CHECK_FAILURES != rank_before_) goto done; \
  } while (0)

/* Ending the process ----------------------------------------------------- */

/* Under MPI every rank goes (one that exits alone leaves its peers waiting
 * in a collective); else this process at once (_exit: a forked child must
 * not flush its copy of its parent's stdio buffers). */
#ifdef MPI_VERSION
#define CHECK_END_PROCESS(code) MPI_Abort(MPI_COMM_WORLD, (code))
#else
#define CHECK_END_PROCESS(code) _exit(code)
#endif

#define FATAL_UNLESS_OK(call)                                                                    \
  do {                                                                                           \
    epx_status_t check_status_ = (call);                                                         \
    if (check_status_ != EPX_SUCCESS) {                                                          \
      fprintf(stderr, "rank %d: %s:%d: %s -> %s: %s\n", (int)(CHECK_RANK), __FILE__, __LINE__, #call, \
              epx_status_string(check_status_), epx_last_error());                               \
      CHECK_END_PROCESS(2);                                                                      \
    }                                                                                            \
  } while (0)

#ifdef CUDART_VERSION
#define FATAL_UNLESS_CUDA_OK(call)                                                               \
  do {                                                                                           \
    cudaError_t check_cuda_ = (call);                                                            \
    if (check_cuda_ != cudaSuccess) {                                                            \
      fprintf(stderr, "rank %d: %s:%d: %s: %s\n", (int)(CHECK_RANK), __FILE__, __LINE__, #call,   \
              cudaGetErrorString(check_cuda_));                                                  \
      CHECK_END_PROCESS(3);                                                                      \
    }                                                                                            \
  } while (0)
#endif

#endif
