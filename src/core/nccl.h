/* What the CUDA backend needs of the NCCL transport: the ncclComm_t behind
 * an epx comm, and the one bounded wait every host synchronisation on an
 * NCCL comm goes through. Declared here, in core, and implemented by
 * src/comm/nccl.c, as core/transport.h is by every transport: the backend
 * includes core only. Plain C: NCCL and CUDA
 * types travel as void * so this header needs neither. */
#ifndef EPX_CORE_NCCL_H
#define EPX_CORE_NCCL_H

#include "core/error.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when comm is an NCCL comm (its ops are the nccl transport's). */
int epx_comm_is_nccl(epx_comm_t comm);
/* The comm's ncclComm_t (an NCCL comm only): epx's own or the caller's; the
 * fused kernels' windows live on it. */
void *epx_nccl_comm(epx_comm_t comm);
/* The blocking comm split from it for the host path's moves (nccl.c says
 * why blocking). */
void *epx_nccl_data_comm(epx_comm_t comm);
/* The CUDA device the comm was created on. */
int epx_nccl_device(epx_comm_t comm);

/* Waits until the work enqueued on `stream` (a cudaStream_t) so far is done,
 * polling the stream and ncclCommGetAsyncError. An NCCL error, or no
 * completion within comm->timeout_seconds, aborts the NCCL comm
 * (ncclCommAbort frees the GPU of its kernels), fails the epx comm and
 * returns EPX_ERROR_TRANSPORT or EPX_ERROR_TIMEOUT. */
epx_status_t epx_nccl_wait(epx_comm_t comm, void *stream, const char *caller);

/* Turns the ncclResult_t of an NCCL call into a status: ncclInProgress (a
 * nonblocking comm still enqueuing) is polled to completion under the same
 * bound; an error fails the comm with NCCL's own message. */
epx_status_t epx_nccl_result(epx_comm_t comm, int result, const char *caller, const char *what);
/* The same as a check that jumps to `fail` with `status` set (core/error.h's
 * EPX_CHECK), for a function with its epx comm in `comm`. */
#define NCCL_CHECK(call, fn, what) EPX_CHECK(epx_nccl_result(comm, (int)(call), fn, what))

/* Whether an NCCL call inside a group went through (ncclSuccess, or
 * ncclInProgress on a nonblocking comm): the group goes on. */
int epx_nccl_went(int result);

/* Ends a group of NCCL calls (the caller's ncclGroupStart succeeded):
 * `first` is the first failed call's result (or the last call's where none
 * failed), `what` names that call. The group is ended before a failure
 * fails the comm: epx_nccl_result aborts the NCCL comm, and a group ended
 * after that would touch the freed comm, one never ended would hold this
 * thread's later NCCL calls (any library's) in it. */
epx_status_t epx_nccl_group_end(epx_comm_t comm, int first, const char *caller, const char *what);

/* A wait that epx bounds itself (a fused kernel's on a peer's flag) ran out:
 * aborts the NCCL comm (its windows go with it; no collective teardown is
 * then attempted), fails the epx comm and returns EPX_ERROR_TIMEOUT naming
 * `what`, as a timed-out epx_nccl_wait does. */
epx_status_t epx_nccl_fail_timeout(epx_comm_t comm, const char *caller, const char *what);

#ifdef __cplusplus
}
#endif
#endif
