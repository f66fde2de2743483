/* The transports (self, local, mpi, nccl; src/comm) behind the vtable of
 * core/transport.h: their constructors and the comm config. */
#ifndef EPX_COMM_COMM_H
#define EPX_COMM_COMM_H

#include <time.h>

#include "core/transport.h"
#include "epx.h"

/* A comm allocated, zeroed and registered (timeout set), ready for a
 * transport's init; epx_comm_free unregisters and frees one whose init
 * failed (comm.c). */
epx_status_t epx_comm_new(const char *fn, double timeout_seconds, epx_comm_t *out);
void epx_comm_free(epx_comm_t comm);

/* Transport constructors (fill ops and impl of a zeroed comm). */
epx_status_t epx_comm_init_self(epx_comm_t comm);
epx_status_t epx_comm_init_local(epx_comm_t comm, epx_local_world_t world, int32_t rank);
epx_status_t epx_comm_init_mpi(epx_comm_t comm, const void *mpi_comm);
/* A key equal on the ranks of one node (MPI_Comm_split_type shared): the
 * lowest rank of this rank's node. */
epx_status_t epx_comm_mpi_host_key(epx_comm_t comm, int64_t *key);

/* The text of a timeout of this rank in collective `op` (after `timeout`
 * seconds), from [size] flags: missing[p], no message of the call came from
 * p; waiting[p], a missing p that told this rank it timed out itself in
 * another call waiting for other ranks only (so it is blocked behind them,
 * not the cause); behind, the ranks those waited for; also[p], a p whose
 * message came but which timed out too, waiting for also_behind. The ranks
 * missing and not waiting are the ones that did not arrive. */
void epx_comm_timeout_text(char *out, size_t out_size, int32_t size, const char *op,
                           double timeout, const uint8_t *missing, const uint8_t *waiting,
                           const uint8_t *behind, const uint8_t *also, const uint8_t *also_behind);

/* The barrier worlds of ranks that share memory (local: threads; shm:
 * processes) wait the same way and fail the same way: */
/* the CLOCK_MONOTONIC time `seconds` from now (their conditions' clock); */
struct timespec epx_comm_deadline(double seconds);
/* the error of a rank of a failed world: at the barrier that failed
 * (same_barrier), that failure's status and reason; in a later call,
 * EPX_ERROR_PEER_FAILED naming the call that failed. */
epx_status_t epx_comm_world_failed_error(const char *caller, int same_barrier, epx_status_t status,
                                         const char *fail_caller, const char *fail_reason);
/* the error of a rank of a world that is not failed (any more) but failed
 * since this rank last had a failure as its error: the world counts its
 * failures (`failures`), a rank the count when a call of its returned one
 * (*seen; a mask call does not move it). A failure that an active-rank mask
 * cleared while this rank was outside the barriers is still its own: it
 * fails the step its peers failed, masks, and joins them. *seen catches up;
 * the error is the last failure's. EPX_SUCCESS when none came since. */
epx_status_t epx_comm_world_missed_failure_error(epx_comm_t comm, const char *caller, uint32_t failures,
                                                 uint32_t *seen, epx_status_t fail_status, const char *fail_caller,
                                                 const char *fail_reason);
/* the reason of a timeout at a barrier: the ranks for which arrived(world,
 * p) is 0 (the first 16 named), "did not arrive within `timeout` s". */
void epx_comm_world_timeout_reason(char *out, size_t out_size, int32_t size,
                                   int (*arrived)(const void *world, int32_t rank), const void *world,
                                   double timeout);
/* the error of an alltoallv whose peer `source` sends `count` units where
 * this rank's recv_counts expect `expected` (EPX_ERROR_INTERNAL: the count
 * exchange before it was inconsistent). */
epx_status_t epx_comm_alltoallv_count_error(const char *caller, int32_t source, int64_t count, int32_t rank,
                                            int64_t expected);
/* The shrink of the barrier worlds (local.c, shm.c): a rank's join refused
 * when it already joined this comm's shrink (joined), or when the survivors
 * finished it without this rank (done); EPX_SUCCESS when it may join. */
epx_status_t epx_comm_shrink_join_refusal(epx_comm_t comm, const char *caller, int joined, int done,
                                          double timeout_seconds);

/* *full: the caller's comm config as this build's struct (NULL = defaults;
 * an older caller's struct is read for its size: core/config.h). */
epx_status_t epx_comm_config_full(const char *caller, const epx_comm_config_t *config, epx_comm_config_t *full);
/* Checks a comm config (NULL = defaults) and gives its timeout. */
epx_status_t epx_comm_config_timeout(const char *caller, const epx_comm_config_t *config,
                                     double *timeout_seconds);
/* epx_comm_new with the config's timeout, checked. */
epx_status_t epx_comm_new_configured(const char *fn, const epx_comm_config_t *config, epx_comm_t *out);

/* Processes of one host (the shm transport's peers, an NCCL comm's peers
 * for its shrink). epx_comm_pid_ns: this process's pid namespace (0 when
 * /proc does not say); pids are compared only inside one.
 * epx_comm_process_state: the state letter of /proc/<pid>/stat ('X' when
 * the process is gone, 'Z' a zombie, 'T' stopped), or 0 when this process
 * cannot tell (another namespace, or no /proc). epx_comm_process_gone: 1
 * when it has ended (gone or a zombie). */
uint64_t epx_comm_pid_ns(void);
char epx_comm_process_state(int32_t pid, uint64_t pid_ns, uint64_t own_pid_ns);
int epx_comm_process_gone(int32_t pid, uint64_t pid_ns, uint64_t own_pid_ns);

/* Test support (tests/test_shm.c): takes the shm world's lock and keeps it,
 * so that the process can die holding it. */
void epx_comm_shm_test_hold_lock(epx_comm_t comm);

/* The topology (topology.c). The config's ranks_per_node (0 when NULL),
 * checked. */
epx_status_t epx_comm_config_ranks_per_node(const char *caller, const epx_comm_config_t *config,
                                            int32_t *ranks_per_node);
/* Fills the comm's node arrays once its transport is up: ranks_per_node > 0
 * poses nodes of that many ranks; else, with host_key, the ranks whose keys
 * are equal share a node (one allgather); else all ranks are one node.
 * Collective when it gathers. */
epx_status_t epx_comm_topology_init(epx_comm_t comm, const char *caller, int32_t ranks_per_node,
                                    const int64_t *host_key);
void epx_comm_topology_free(epx_comm_t comm);

#endif
