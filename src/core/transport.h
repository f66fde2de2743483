/* The transport interface: the small vtable every transport (src/comm:
 * self, local, mpi, nccl) implements, and the comm object the backends
 * exchange over. It lives in core, beside the backend interface
 * (core/backend.h), so that a backend stands on core alone; the transports
 * and the public epx_comm_* calls are in src/comm.
 *
 * All operations are collective over the comm: every rank calls them in the
 * same order. Every wait on a peer is bounded by comm->timeout_seconds; a
 * timeout sets an error naming the rank(s) that did not arrive, marks the
 * comm failed, and returns EPX_ERROR_TIMEOUT. A failed comm answers every
 * later operation with EPX_ERROR_PEER_FAILED. Error messages name the public
 * function passed in `caller`. */
#ifndef EPX_CORE_TRANSPORT_H
#define EPX_CORE_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

/* What runs inside a handshake once every rank's block is in (see
 * epx_comm_handshake). */
typedef epx_status_t (*epx_comm_then_fn)(void *ctx, const void *recv);

typedef struct epx_transport_ops {
  const char *name; /* "self", "local", "mpi", "nccl" */
  /* send holds size blocks of `bytes`, block r for rank r; recv gets block
   * s from rank s (its own block too). */
  epx_status_t (*alltoall)(epx_comm_t comm, const char *caller, const void *send, void *recv,
                           size_t bytes);
  /* Variable all-to-all in units of `unit` bytes: send_counts[r] units from
   * send + send_displs[r]*unit go to rank r, landing at recv + recv_displs[s]*unit
   * of rank s... i.e. rank r receives recv_counts[s] units from s. Counts and
   * displacements are in units. The self block is copied too. */
  epx_status_t (*alltoallv)(epx_comm_t comm, const char *caller, const void *send,
                            const int64_t *send_counts, const int64_t *send_displs, void *recv,
                            const int64_t *recv_counts, const int64_t *recv_displs, size_t unit);
  /* recv gets size blocks of `bytes`, block s from rank s. */
  epx_status_t (*allgather)(epx_comm_t comm, const char *caller, const void *send, void *recv,
                            size_t bytes);
  /* values[i] = max over ranks, in place. */
  epx_status_t (*allreduce_max_i64)(epx_comm_t comm, const char *caller, int64_t *values,
                                    int32_t count);
  epx_status_t (*barrier)(epx_comm_t comm, const char *caller);
  /* The transport's own epx_comm_handshake (NULL: the generic one, an
   * alltoall then `then`). A transport whose ranks share the address space
   * runs `then` before any rank leaves the call, so that memory named in the
   * blocks may be read in it. */
  epx_status_t (*handshake)(epx_comm_t comm, const char *caller, const void *send, void *recv,
                            size_t bytes, epx_comm_then_fn then, void *ctx);
  /* The survivors' comm (epx_comm_shrink, src/comm/shrink.c): agrees the
   * ranks left out (lost [size] gets 1 for each) and makes *survivor, a comm
   * allocated, registered and ready (its topology too), of the others
   * renumbered in ascending rank order, with the timeout and posed nodes
   * given. NULL: the transport cannot shrink (EPX_ERROR_UNSUPPORTED). */
  epx_status_t (*shrink)(epx_comm_t comm, const char *caller, double timeout_seconds,
                         int32_t ranks_per_node, uint8_t *lost, epx_comm_t *survivor);
  /* The low-latency active-rank mask (epx_ll_mask_rank, api/ll.c): rank
   * leaves (masked 1) or rejoins (0) every later collective of the comm's
   * transport; a failure that named only masked ranks is cleared, so the
   * survivors go on (comm->masked is kept by the caller). NULL: the
   * transport has none (EPX_ERROR_UNSUPPORTED). */
  epx_status_t (*mask)(epx_comm_t comm, const char *caller, int32_t rank, int masked);
  /* Releases the transport's state (after a barrier the caller made). */
  void (*destroy)(epx_comm_t comm);
  /* 1 when every rank lives in this address space (threads of one process):
   * a pointer gathered from a peer may be read directly, between the gather
   * and a later barrier. The exchange then reads peers' rows in place
   * instead of staging them (one copy instead of three). */
  int shared_address_space;
  /* 1 when every rank is a process of this host (shm): device memory is
   * shared between them through CUDA IPC (the ipc device transport,
   * src/cuda/xport/ipc.c). */
  int one_host;
} epx_transport_ops_t;

struct epx_comm {
  epx_comm_t id;         /* the value the caller holds (core/registry.h) */
  const epx_transport_ops_t *ops;
  int32_t rank;
  int32_t size;
  double timeout_seconds;
  int failed;            /* set after a timeout or transport error */
  /* [size], 1 for a rank masked out of the collectives (epx_ll_mask_rank);
   * NULL until the first mask. Its peers' blocks are not exchanged. */
  uint8_t *masked;
  int64_t live_buffers;  /* buffers created over this comm and not destroyed */
  /* Sequence numbers of the collective objects made over the comm, equal on
   * every rank (each is made by a collective call): they name a buffer and a
   * layout in the first message of every call. */
  int64_t buffers_made;
  int64_t layouts_made;
  /* The nodes (src/comm/topology.c, equal on every rank): node_of[r] is rank
   * r's node, numbered by each node's lowest rank; node_ranks lists the ranks
   * node by node, ascending inside a node, node n's from node_first[n];
   * local_of[r] is r's index inside its node. ranks_per_node is 0 when nodes
   * differ in size. */
  int32_t num_nodes, ranks_per_node;
  int32_t *node_of, *local_of, *node_ranks, *node_first; /* [size] x3, [num_nodes + 1] */
  void *impl;            /* the transport's own state */
  /* The device transport's state for this comm (src/cuda/xport/ipc.c: its
   * staging memory, events and the peers' mappings), made at its first use;
   * device_release(comm) releases it at epx_comm_destroy, after the
   * destroy's barrier and before the transport's destroy (collective unless
   * the comm failed). NULL both: none. */
  void *device_state;
  void (*device_release)(epx_comm_t comm);
};

/* The helpers below are the transports' common code (core/transport.c). */

/* Agrees a rank-local verdict across the comm (one all-reduce) so that a
 * refusal on one rank is a refusal on every rank before anything moves. The
 * failing rank keeps its own message; the others name it. */
epx_status_t epx_comm_agree(epx_comm_t comm, epx_status_t local, const char *caller);

/* Every collective call's first message: an all-to-all of `bytes` blocks
 * (send block r goes to rank r; recv block s comes from rank s), after which
 * then(ctx, recv) runs on every rank with all blocks and its status is the
 * call's. The blocks carry what each rank is doing (call, handle, shape, its
 * verdict), so `then` can check, identically on every rank, that they agree
 * before anything else moves. On the local transport `then` runs before any
 * rank leaves the handshake: it may read peers' memory that their blocks
 * name, until it returns, and a rank whose `then` fails makes the others'
 * handshake fail naming it. Elsewhere a `then` that fails on one rank only
 * must be agreed by the caller's next message. One synchronisation. */
epx_status_t epx_comm_handshake(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                size_t bytes, epx_comm_then_fn then, void *ctx);

/* Returns EPX_ERROR_PEER_FAILED with a message if the comm has failed. */
epx_status_t epx_comm_check_alive(epx_comm_t comm, const char *caller);

#endif
