/* The local transport: W ranks as threads of one process sharing memory.
 *
 * A world has one slot per rank. A collective publishes the rank's send-side
 * pointers in its slot and meets its peers at a "gather" barrier; each rank
 * then copies its own pieces straight out of the peers' send buffers into its
 * receive buffer (no staging copy), and meets them again at a "release"
 * barrier, so that no rank returns (and reuses or frees its send buffer) while
 * a peer may still be reading it.
 *
 * Synchronisation: one mutex and one condition variable per world, and a
 * generation-counted barrier. Everything the barrier compares lives in the
 * slots and the world under the mutex. The published pointers are written
 * under the mutex before the gather barrier completes and are read by peers
 * only between the two barriers, when their owner cannot touch them.
 *
 * A handshake (every collective call's first message) is an alltoall whose
 * caller-given `then` runs between the two barriers, where peers' memory is
 * still theirs to read: the exchange moves its rows there, in one
 * synchronisation.
 *
 * Failure: a wait at a gather barrier is bounded by timeout_seconds. On expiry
 * the ranks still missing are named, the world is marked failed and every
 * waiter is woken; a failed world answers every later call of every rank at
 * once with EPX_ERROR_PEER_FAILED, naming the rank again. A rank that arrives
 * in another collective than the peers already waiting (one destroying its
 * comm while they dispatch, say), or that finds a peer's comm destroyed, fails
 * the world at once. The wait at a release barrier is not bounded: every rank
 * has passed the gather barrier, so all that stands between them and the
 * release is their own memcpy, and returning early would let a sender free a
 * buffer that a peer is still reading. */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "core/error.h"
#include "core/registry.h"

typedef enum local_op {
  LOCAL_OP_CREATE = 0,
  LOCAL_OP_ALLTOALL,
  LOCAL_OP_ALLTOALLV,
  LOCAL_OP_ALLGATHER,
  LOCAL_OP_ALLREDUCE,
  LOCAL_OP_BARRIER,
  LOCAL_OP_HANDSHAKE
} local_op_t;

static const char *const local_op_names[] = {"create",    "alltoall",  "alltoallv", "allgather",
                                             "allreduce", "barrier",   "handshake"};

typedef struct local_slot {
  /* Under the world's mutex. */
  int attached;     /* a comm of this rank is alive */
  uint64_t arrived; /* 1 + the generation of the gather barrier it last reached */
  local_op_t op;    /* the collective it is in, and its size argument (bytes, */
  size_t arg;       /* unit or count), which must be equal on every rank */
  const char *caller;
  int error; /* at a release barrier: this rank failed (inconsistent pieces, or its `then`) */
  /* Published before the gather barrier; peers read them, and the memory they
   * point to, only until the release barrier. */
  const void *send;
  const int64_t *send_counts;
  const int64_t *send_displs;
  const int64_t *values;
  /* Under the world's mutex: the shrink (see local_shrink). */
  int suspect;       /* the world's failure named it missing */
  int shrink_joined; /* it called epx_comm_shrink on this world */
  int masked;        /* out of the collectives (epx_ll_mask_rank) */
  uint32_t failures_seen; /* the world's `failures` when a call of this rank last returned one */
} local_slot_t;

struct epx_local_world {
  int32_t size;
  double timeout_seconds; /* <= 0 or not finite: gather waits are unbounded */
  int32_t ranks_per_node; /* the config's: posed nodes, or 0 (all one node) */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  /* Under lock. */
  uint64_t generation; /* barriers completed */
  int32_t arrived;     /* ranks waiting at the current barrier */
  int32_t live;        /* ranks a barrier waits for: size less the masked */
  int32_t waiting;     /* ranks inside a gather wait (a mask clears a failure once they left) */
  uint32_t failures;   /* how many times it failed (a rank that missed one a mask cleared gets it: local_gather) */
  int32_t attached;    /* live comms */
  int failed;
  uint64_t fail_generation; /* the barrier that failed */
  epx_status_t fail_status; /* what the ranks waiting at that barrier get */
  char fail_caller[64];
  char fail_reason[448];
  /* The shrink, under lock: once done, `shrunk` is the survivors' world (or
   * shrink_status says why there is none). */
  int shrink_done;
  epx_status_t shrink_status;
  char shrink_reason[448];
  epx_local_world_t shrunk;
  /* A world made by a shrink has no id: its comms hold `refs` references
   * (one per survivor), and the last one released frees it. */
  int internal;
  int32_t refs;
  local_slot_t *slots; /* [size] */
};

static const char *local_op_name(local_op_t op) { return local_op_names[op]; }

/* Marks the world failed at `generation` and wakes every waiter (under lock). */
static void local_fail_locked(epx_local_world_t world, uint64_t generation, epx_status_t status,
                              const char *caller, const char *format, ...)
    __attribute__((format(printf, 5, 6)));
static void local_fail_locked(epx_local_world_t world, uint64_t generation, epx_status_t status,
                              const char *caller, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(world->fail_reason, sizeof world->fail_reason, format, args);
  va_end(args);
  snprintf(world->fail_caller, sizeof world->fail_caller, "%s", caller);
  world->failed = 1;
  world->failures++;
  world->fail_generation = generation;
  world->fail_status = status;
  pthread_cond_broadcast(&world->cond);
}

/* The error of a rank on a failed world (under lock). `generation` is the
 * barrier the rank was at, or UINT64_MAX if it only just entered the call. */
static epx_status_t local_failed_error_locked(epx_comm_t comm, const char *caller,
                                              uint64_t generation) {
  epx_local_world_t world = comm->impl;
  comm->failed = 1;
  world->slots[comm->rank].failures_seen = world->failures;
  return epx_comm_world_failed_error(caller, generation == world->fail_generation, world->fail_status,
                                     world->fail_caller, world->fail_reason);
}

/* Names the ranks that have not reached the gather barrier of `generation`
 * and fails the world with EPX_ERROR_TIMEOUT (under lock). */
static int local_arrived(const void *world, int32_t rank) {
  const struct epx_local_world *w = world;
  return w->slots[rank].masked || w->slots[rank].arrived == w->generation + 1;
}

static void local_fail_timeout_locked(epx_local_world_t world, uint64_t generation,
                                      const char *caller) {
  char reason[sizeof world->fail_reason];
  epx_comm_world_timeout_reason(reason, sizeof reason, world->size, local_arrived, world,
                                world->timeout_seconds);
  for (int32_t p = 0; p < world->size; p++)
    if (!local_arrived(world, p)) world->slots[p].suspect = 1;
  local_fail_locked(world, generation, EPX_ERROR_TIMEOUT, caller, "%s", reason);
}

/* The error of a masked rank's collective. */
static epx_status_t local_masked_error(epx_comm_t comm, const char *caller) {
  return epx_error(EPX_ERROR_PEER_FAILED,
                   "%s: rank %d is masked out of this comm's collectives (epx_ll_mask_rank on a "
                   "peer); its peers go on without it", caller, comm->rank);
}

/* Completes the current barrier when every live rank is at it (under lock). */
static int local_complete_locked(epx_local_world_t world) {
  if (world->arrived < world->live) return 0;
  world->arrived = 0;
  world->generation++;
  pthread_cond_broadcast(&world->cond);
  return 1;
}

/* Waits (under lock) until the barrier of `generation` completes. A gather
 * wait is bounded by the timeout and ends early when the world fails; a
 * release wait is neither (see the top of the file). */
static epx_status_t local_wait_locked(epx_comm_t comm, const char *caller, uint64_t generation,
                                      int gather) {
  epx_local_world_t world = comm->impl;
  int bounded = gather && world->timeout_seconds > 0 && world->timeout_seconds < 1e9;
  struct timespec deadline = epx_comm_deadline(bounded ? world->timeout_seconds : 0);
  world->waiting += gather;
  while (world->generation == generation && !(gather && (world->failed || world->slots[comm->rank].masked))) {
    if (!bounded) {
      pthread_cond_wait(&world->cond, &world->lock);
      continue;
    }
    int rc = pthread_cond_timedwait(&world->cond, &world->lock, &deadline);
    if (rc == ETIMEDOUT && world->generation == generation && !world->failed)
      local_fail_timeout_locked(world, generation, caller);
  }
  if (gather && --world->waiting == 0) pthread_cond_broadcast(&world->cond);
  if (world->generation != generation) return EPX_SUCCESS;
  if (!world->failed) return local_masked_error(comm, caller);
  return local_failed_error_locked(comm, caller, generation);
}

/* Publishes `pub` (may be NULL) in the rank's slot and waits for every peer to
 * reach the same collective. */
static epx_status_t local_gather(epx_comm_t comm, const char *caller, local_op_t op, size_t arg,
                                 const local_slot_t *pub) {
  epx_local_world_t world = comm->impl;
  int32_t rank = comm->rank;
  local_slot_t *mine = &world->slots[rank];
  epx_status_t status = EPX_SUCCESS;
  pthread_mutex_lock(&world->lock);
  if (world->failed) {
    status = local_failed_error_locked(comm, caller, UINT64_MAX);
    goto done;
  }
  if (mine->masked) {
    status = local_masked_error(comm, caller);
    goto done;
  }
  /* A failure that a mask cleared while this rank was between two calls is
   * still this rank's (see local_mask). */
  status = epx_comm_world_missed_failure_error(comm, caller, world->failures, &mine->failures_seen,
                                               world->fail_status, world->fail_caller, world->fail_reason);
  if (status != EPX_SUCCESS) goto done;
  uint64_t generation = world->generation;
  for (int32_t p = 0; p < world->size; p++) {
    const local_slot_t *peer = &world->slots[p];
    if (p == rank || peer->masked) continue;
    if (op != LOCAL_OP_CREATE && !peer->attached) {
      world->slots[p].suspect = 1;
      local_fail_locked(world, generation, EPX_ERROR_PEER_FAILED, caller,
                        "rank %d destroyed its comm while rank %d is in %s (%s)", p, rank, caller,
                        local_op_name(op));
      status = local_failed_error_locked(comm, caller, generation);
      goto done;
    }
    if (peer->arrived == generation + 1 && (peer->op != op || peer->arg != arg)) {
      local_fail_locked(world, generation, EPX_ERROR_PEER_FAILED, caller,
                        "rank %d is in %s (%s, size %zu) while rank %d is in %s (%s, size %zu); "
                        "every rank must make the same collective calls with the same sizes "
                        "in the same order",
                        rank, caller, local_op_name(op), arg, p, peer->caller,
                        local_op_name(peer->op), peer->arg);
      status = local_failed_error_locked(comm, caller, generation);
      goto done;
    }
  }
  mine->op = op;
  mine->arg = arg;
  mine->caller = caller;
  if (pub) {
    mine->send = pub->send;
    mine->send_counts = pub->send_counts;
    mine->send_displs = pub->send_displs;
    mine->values = pub->values;
  }
  mine->arrived = generation + 1;
  world->arrived++;
  if (local_complete_locked(world)) goto done;
  status = local_wait_locked(comm, caller, generation, 1);
done:
  pthread_mutex_unlock(&world->lock);
  return status;
}

/* Waits until every peer is done with this collective. `status` is the rank's
 * own outcome; a rank that failed makes the others fail naming it. */
static epx_status_t local_release(epx_comm_t comm, const char *caller, local_op_t op,
                                  epx_status_t status) {
  epx_local_world_t world = comm->impl;
  pthread_mutex_lock(&world->lock);
  world->slots[comm->rank].error = status != EPX_SUCCESS;
  uint64_t generation = world->generation;
  world->arrived++;
  if (!local_complete_locked(world)) (void)local_wait_locked(comm, caller, generation, 0);
  for (int32_t p = 0; p < world->size && status == EPX_SUCCESS; p++)
    if (world->slots[p].error && !world->slots[p].masked)
      status = op == LOCAL_OP_HANDSHAKE
                   ? epx_error(EPX_ERROR_PEER_FAILED,
                               "%s: rank %d failed in this call (its own error says why); this "
                               "rank's output is incomplete", caller, p)
                   : epx_error(EPX_ERROR_PEER_FAILED,
                               "%s: rank %d found the pieces of this %s inconsistent (its own "
                               "error says how); this rank's output is incomplete",
                               caller, p, local_op_name(op));
  pthread_mutex_unlock(&world->lock);
  return status;
}

static epx_status_t local_alltoall(epx_comm_t comm, const char *caller, const void *send,
                                   void *recv, size_t bytes) {
  local_slot_t pub = {.send = send};
  epx_status_t status = local_gather(comm, caller, LOCAL_OP_ALLTOALL, bytes, &pub);
  if (status != EPX_SUCCESS) return status;
  const epx_local_world_t world = comm->impl;
  const int32_t size = comm->size, rank = comm->rank;
  /* Each rank starts at a different peer so the readers spread over sources. */
  for (int32_t i = 0; i < size && bytes; i++) {
    int32_t s = (rank + i) % size;
    if (world->slots[s].masked)
      memset((char *)recv + (size_t)s * bytes, 0, bytes);
    else
      memcpy((char *)recv + (size_t)s * bytes,
             (const char *)world->slots[s].send + (size_t)rank * bytes, bytes);
  }
  return local_release(comm, caller, LOCAL_OP_ALLTOALL, EPX_SUCCESS);
}

static epx_status_t local_alltoallv(epx_comm_t comm, const char *caller, const void *send,
                                    const int64_t *send_counts, const int64_t *send_displs,
                                    void *recv, const int64_t *recv_counts,
                                    const int64_t *recv_displs, size_t unit) {
  local_slot_t pub = {.send = send, .send_counts = send_counts, .send_displs = send_displs};
  epx_status_t status = local_gather(comm, caller, LOCAL_OP_ALLTOALLV, unit, &pub);
  if (status != EPX_SUCCESS) return status;
  const epx_local_world_t world = comm->impl;
  const int32_t size = comm->size, rank = comm->rank;
  for (int32_t i = 0; i < size; i++) {
    int32_t s = (rank + i) % size;
    const local_slot_t *peer = &world->slots[s];
    if (peer->masked) continue; /* the caller expects nothing from it (cpu/call.c) */
    int64_t count = peer->send_counts[rank];
    if (count != recv_counts[s] || count < 0) {
      status = epx_comm_alltoallv_count_error(caller, s, count, rank, recv_counts[s]);
      break;
    }
    if (count)
      memcpy((char *)recv + (size_t)recv_displs[s] * unit,
             (const char *)peer->send + (size_t)peer->send_displs[rank] * unit,
             (size_t)count * unit);
  }
  return local_release(comm, caller, LOCAL_OP_ALLTOALLV, status);
}

static epx_status_t local_allgather(epx_comm_t comm, const char *caller, const void *send,
                                    void *recv, size_t bytes) {
  local_slot_t pub = {.send = send};
  epx_status_t status = local_gather(comm, caller, LOCAL_OP_ALLGATHER, bytes, &pub);
  if (status != EPX_SUCCESS) return status;
  const epx_local_world_t world = comm->impl;
  const int32_t size = comm->size, rank = comm->rank;
  for (int32_t i = 0; i < size && bytes; i++) {
    int32_t s = (rank + i) % size;
    if (world->slots[s].masked)
      memset((char *)recv + (size_t)s * bytes, 0, bytes);
    else
      memcpy((char *)recv + (size_t)s * bytes, world->slots[s].send, bytes);
  }
  return local_release(comm, caller, LOCAL_OP_ALLGATHER, EPX_SUCCESS);
}

static epx_status_t local_allreduce_max_i64(epx_comm_t comm, const char *caller, int64_t *values,
                                            int32_t count) {
  EPX_REQUIRE(count >= 0, "%s: allreduce count is %d; pass a count >= 0", caller, count);
  local_slot_t pub = {.values = values};
  epx_status_t status = local_gather(comm, caller, LOCAL_OP_ALLREDUCE, (size_t)count, &pub);
  if (status != EPX_SUCCESS) return status;
  const epx_local_world_t world = comm->impl;
  /* The peers read `values` until the release, so the maxima wait aside. */
  int64_t small[64];
  int64_t *result = count <= 64 ? small : malloc(sizeof(int64_t) * (size_t)count);
  if (!result) {
    status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for an allreduce of %d values",
                       caller, count);
  } else {
    for (int32_t i = 0; i < count; i++) {
      int64_t max = values[i];
      for (int32_t s = 0; s < comm->size; s++)
        if (!world->slots[s].masked && world->slots[s].values[i] > max) max = world->slots[s].values[i];
      result[i] = max;
    }
  }
  status = local_release(comm, caller, LOCAL_OP_ALLREDUCE, status);
  if (status == EPX_SUCCESS && count) memcpy(values, result, sizeof(int64_t) * (size_t)count);
  if (result != small) free(result);
  return status;
}

/* The alltoall of the blocks, then `then` while every rank is still inside
 * the call: peers' memory named in the blocks stays valid until the release. */
static epx_status_t local_handshake(epx_comm_t comm, const char *caller, const void *send,
                                    void *recv, size_t bytes, epx_comm_then_fn then, void *ctx) {
  local_slot_t pub = {.send = send};
  epx_status_t status = local_gather(comm, caller, LOCAL_OP_HANDSHAKE, bytes, &pub);
  if (status != EPX_SUCCESS) return status;
  const epx_local_world_t world = comm->impl;
  for (int32_t s = 0; s < comm->size && bytes; s++)
    if (world->slots[s].masked)
      memset((char *)recv + (size_t)s * bytes, 0, bytes);
    else
      memcpy((char *)recv + (size_t)s * bytes,
             (const char *)world->slots[s].send + (size_t)comm->rank * bytes, bytes);
  return local_release(comm, caller, LOCAL_OP_HANDSHAKE, then(ctx, recv));
}

static epx_status_t local_barrier(epx_comm_t comm, const char *caller) {
  return local_gather(comm, caller, LOCAL_OP_BARRIER, 0, NULL);
}

static void local_world_free(epx_local_world_t world);

static void local_destroy(epx_comm_t comm) {
  epx_local_world_t world = comm->impl;
  pthread_mutex_lock(&world->lock);
  world->slots[comm->rank].attached = 0;
  world->attached--;
  world->slots[comm->rank].suspect |= world->slots[comm->rank].masked;
  int last = world->internal && --world->refs == 0;
  /* Survivors waiting in a shrink no longer wait for this rank. */
  pthread_cond_broadcast(&world->cond);
  /* A peer that already waits in its next collective would wait in vain. */
  for (int32_t p = 0; p < world->size && !world->failed; p++) {
    const local_slot_t *peer = &world->slots[p];
    if (peer->attached && !peer->masked && !world->slots[comm->rank].masked &&
        peer->arrived == world->generation + 1 && peer->op != LOCAL_OP_CREATE) {
      world->slots[comm->rank].suspect = 1; /* the failure names it: masking it clears it */
      local_fail_locked(world, world->generation, EPX_ERROR_PEER_FAILED, peer->caller,
                        "rank %d destroyed its comm while rank %d is in %s (%s)", comm->rank, p,
                        peer->caller, local_op_name(peer->op));
    }
  }
  pthread_mutex_unlock(&world->lock);
  comm->impl = NULL;
  if (last) local_world_free(world);
}

static epx_status_t local_shrink(epx_comm_t comm, const char *caller, double timeout_seconds,
                                 int32_t ranks_per_node, uint8_t *lost, epx_comm_t *survivor);

static epx_status_t local_mask(epx_comm_t comm, const char *caller, int32_t rank, int masked);

static const epx_transport_ops_t local_ops = {
    .name = "local",
    .alltoall = local_alltoall,
    .alltoallv = local_alltoallv,
    .allgather = local_allgather,
    .allreduce_max_i64 = local_allreduce_max_i64,
    .barrier = local_barrier,
    .handshake = local_handshake,
    .shrink = local_shrink,
    .mask = local_mask,
    .destroy = local_destroy,
    .shared_address_space = 1,
};

epx_status_t epx_comm_init_local(epx_comm_t comm, epx_local_world_t world, int32_t rank) {
  EPX_REQUIRE(rank >= 0 && rank < world->size,
              "epx_comm_create_local: rank is %d; pass 0 <= rank < %d (the world's size)", rank,
              world->size);
  epx_status_t status = EPX_SUCCESS;
  pthread_mutex_lock(&world->lock);
  if (world->failed)
    status = epx_error(EPX_ERROR_PEER_FAILED,
                       "epx_comm_create_local: the world failed earlier, in %s: %s; destroy "
                       "its comms and the world, and create a new one",
                       world->fail_caller, world->fail_reason);
  else if (world->slots[rank].attached)
    status = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "epx_comm_create_local: rank %d already has a live comm on this world; "
                       "create one comm per rank (destroy the old one first)",
                       rank);
  if (status == EPX_SUCCESS) {
    world->slots[rank].attached = 1;
    world->slots[rank].failures_seen = world->failures;
    world->attached++;
  }
  pthread_mutex_unlock(&world->lock);
  if (status != EPX_SUCCESS) return status;
  comm->ops = &local_ops;
  comm->rank = rank;
  comm->size = world->size;
  comm->timeout_seconds = world->timeout_seconds;
  comm->impl = world;
  status = local_gather(comm, "epx_comm_create_local", LOCAL_OP_CREATE, 0, NULL);
  if (status == EPX_SUCCESS) status = epx_comm_topology_init(comm, "epx_comm_create_local", world->ranks_per_node, NULL);
  if (status != EPX_SUCCESS) local_destroy(comm);
  return status;
}

/* A world of `size` ranks, its lock and condition ready (no id yet). */
static epx_status_t local_world_new(const char *fn, int32_t size, double timeout_seconds,
                                    int32_t ranks_per_node, epx_local_world_t *out) {
  epx_status_t status = EPX_SUCCESS;
  int lock_ready = 0;
  pthread_condattr_t attr;
  epx_local_world_t created = calloc(1, sizeof *created);
  if (!created) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  created->size = size;
  created->timeout_seconds = timeout_seconds;
  created->ranks_per_node = ranks_per_node;
  created->live = size;
  created->slots = calloc((size_t)size, sizeof *created->slots);
  if (!created->slots) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d ranks", fn, size);
  if (pthread_mutex_init(&created->lock, NULL)) EPX_FAIL(EPX_ERROR_INTERNAL, "%s: pthread_mutex_init failed", fn);
  lock_ready = 1;
  /* A monotonic clock, so that setting the wall clock cannot stretch a timeout. */
  if (pthread_condattr_init(&attr)) EPX_FAIL(EPX_ERROR_INTERNAL, "%s: pthread_condattr_init failed", fn);
  int rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  if (!rc) rc = pthread_cond_init(&created->cond, &attr);
  pthread_condattr_destroy(&attr);
  if (rc) EPX_FAIL(EPX_ERROR_INTERNAL, "%s: pthread_cond_init failed", fn);
  *out = created;
  return EPX_SUCCESS;
fail:
  if (lock_ready) pthread_mutex_destroy(&created->lock);
  if (created) free(created->slots);
  free(created);
  return status;
}

static void local_world_free(epx_local_world_t world) {
  pthread_cond_destroy(&world->cond);
  pthread_mutex_destroy(&world->lock);
  free(world->slots);
  free(world);
}

epx_status_t epx_local_world_create(int32_t world_size, const epx_comm_config_t *config,
                                    epx_local_world_t *world) {
  epx_error_clear();
  EPX_REQUIRE(world,
              "epx_local_world_create: world is NULL; pass the address of an "
              "epx_local_world_t");
  EPX_REQUIRE(world_size >= 1,
              "epx_local_world_create: world_size is %d; pass the number of ranks (>= 1)",
              world_size);
  double timeout_seconds;
  epx_status_t status = epx_comm_config_timeout("epx_local_world_create", config, &timeout_seconds);
  int32_t ranks_per_node = 0;
  if (status == EPX_SUCCESS) status = epx_comm_config_ranks_per_node("epx_local_world_create", config, &ranks_per_node);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(ranks_per_node == 0 || world_size % ranks_per_node == 0,
              "epx_local_world_create: config->ranks_per_node is %d, which does not divide world_size "
              "%d; pass a divisor of it, or 0", ranks_per_node, world_size);
  epx_local_world_t created = NULL;
  status = local_world_new("epx_local_world_create", world_size, timeout_seconds, ranks_per_node, &created);
  if (status != EPX_SUCCESS) return status;
  void *id = NULL;
  status = epx_registry_add(created, EPX_OBJECT_LOCAL_WORLD, &id);
  if (status != EPX_SUCCESS) {
    local_world_free(created);
    return status;
  }
  *world = id;
  return EPX_SUCCESS;
}

epx_status_t epx_local_world_destroy(epx_local_world_t world) {
  epx_error_clear();
  if (!world) return EPX_SUCCESS;
  const epx_local_world_t id = world;
  world = epx_registry_get(id, EPX_OBJECT_LOCAL_WORLD);
  if (!world)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "epx_local_world_destroy: world is not a live local world (destroyed "
                     "already?); pass one from epx_local_world_create");
  pthread_mutex_lock(&world->lock);
  int32_t attached = world->attached, first = -1;
  for (int32_t p = 0; p < world->size && first < 0; p++)
    if (world->slots[p].attached) first = p;
  pthread_mutex_unlock(&world->lock);
  if (attached)
    return epx_error(EPX_ERROR_BUSY,
                     "epx_local_world_destroy: %d comm(s) of this world are alive (rank %d "
                     "first); destroy them with epx_comm_destroy first",
                     attached, first);
  epx_registry_remove(id);
  local_world_free(world);
  return EPX_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Shrink (epx_comm_shrink)                                                  */
/* ------------------------------------------------------------------------ */

/* The survivors of a world agree on the lost ranks in the world itself,
 * under its lock: a rank joins the shrink by calling it, and the shrink is
 * settled (once, by whichever survivor sees it first) when every rank has
 * joined except those not waited for — a rank whose comm is destroyed, and
 * a rank the world's failure named missing (suspect) — or when a joined
 * survivor has waited the world's timeout. The ranks that joined by then
 * are the survivors; everyone reads the same record, so they agree. The
 * settler makes the survivors' world; each survivor then creates its comm
 * on it (a create collective, bounded as every create is). A rank that
 * comes after the settling is refused: it is not in the survivors' comm. */

/* 1 when no rank is left to wait for (under lock). */
static int local_shrink_settled_locked(epx_local_world_t world) {
  for (int32_t p = 0; p < world->size; p++) {
    const local_slot_t *slot = &world->slots[p];
    if (!slot->shrink_joined && slot->attached && !slot->suspect && !slot->masked) return 0;
  }
  return 1;
}

/* Settles the shrink: the survivors' world, or why there is none (under lock). */
static void local_shrink_settle_locked(epx_local_world_t world, const char *caller,
                                       double timeout_seconds, int32_t ranks_per_node) {
  int32_t survivors = 0;
  for (int32_t p = 0; p < world->size; p++) survivors += world->slots[p].shrink_joined;
  epx_status_t status = EPX_SUCCESS;
  if (ranks_per_node > 0 && survivors % ranks_per_node != 0)
    status = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: config->ranks_per_node is %d, which does not divide the %d survivors; "
                       "pass a divisor of it, or 0", caller, ranks_per_node, survivors);
  else
    status = local_world_new(caller, survivors, timeout_seconds, ranks_per_node, &world->shrunk);
  if (status == EPX_SUCCESS) {
    world->shrunk->internal = 1;
    world->shrunk->refs = survivors;
  } else {
    world->shrink_status = status;
    snprintf(world->shrink_reason, sizeof world->shrink_reason, "%s", epx_last_error());
  }
  world->shrink_done = 1;
  pthread_cond_broadcast(&world->cond);
}

/* Joins the shrink and waits for it to settle (under lock). */
static epx_status_t local_shrink_join_locked(epx_comm_t comm, const char *caller,
                                             double timeout_seconds, int32_t ranks_per_node) {
  epx_local_world_t world = comm->impl;
  local_slot_t *mine = &world->slots[comm->rank];
  epx_status_t refused = epx_comm_shrink_join_refusal(comm, caller, mine->shrink_joined, world->shrink_done,
                                                      world->timeout_seconds);
  if (refused != EPX_SUCCESS) return refused;
  mine->shrink_joined = 1;
  /* Ranks still in a collective of the old comm leave it and come here. */
  if (!world->failed)
    local_fail_locked(world, world->generation, EPX_ERROR_PEER_FAILED, caller,
                      "rank %d shrank the comm", comm->rank);
  pthread_cond_broadcast(&world->cond);
  int bounded = world->timeout_seconds > 0 && world->timeout_seconds < 1e9;
  struct timespec deadline = epx_comm_deadline(bounded ? world->timeout_seconds : 0);
  while (!world->shrink_done) {
    int late = 0;
    if (!local_shrink_settled_locked(world)) {
      if (!bounded) {
        pthread_cond_wait(&world->cond, &world->lock);
        continue;
      }
      late = pthread_cond_timedwait(&world->cond, &world->lock, &deadline) == ETIMEDOUT;
      if (!late && !local_shrink_settled_locked(world)) continue;
    }
    if (!world->shrink_done) local_shrink_settle_locked(world, caller, timeout_seconds, ranks_per_node);
  }
  if (world->shrink_status != EPX_SUCCESS)
    return epx_error(world->shrink_status, "%s", world->shrink_reason);
  return EPX_SUCCESS;
}

/* Drops one survivor's reference on a shrunk world that its comm never took. */
static void local_world_unref(epx_local_world_t world) {
  pthread_mutex_lock(&world->lock);
  int last = --world->refs == 0;
  pthread_mutex_unlock(&world->lock);
  if (last) local_world_free(world);
}

static epx_status_t local_shrink(epx_comm_t comm, const char *caller, double timeout_seconds,
                                 int32_t ranks_per_node, uint8_t *lost, epx_comm_t *survivor) {
  epx_local_world_t world = comm->impl;
  comm->failed = 1;
  pthread_mutex_lock(&world->lock);
  epx_status_t status = local_shrink_join_locked(comm, caller, timeout_seconds, ranks_per_node);
  int32_t rank = 0;
  epx_local_world_t next = world->shrunk;
  for (int32_t p = 0; status == EPX_SUCCESS && p < world->size; p++) {
    lost[p] = !world->slots[p].shrink_joined;
    rank += p < comm->rank && !lost[p];
  }
  pthread_mutex_unlock(&world->lock);
  if (status != EPX_SUCCESS) return status;
  epx_comm_t created = NULL;
  status = epx_comm_new(caller, timeout_seconds, &created);
  if (status != EPX_SUCCESS) {
    local_world_unref(next);
    return status;
  }
  status = epx_comm_init_local(created, next, rank);
  if (status != EPX_SUCCESS) {
    if (!created->ops) local_world_unref(next); /* refused before it attached */
    epx_comm_free(created);
    return status;
  }
  *survivor = created;
  return EPX_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* The active-rank mask (epx_ll_mask_rank)                                   */
/* ------------------------------------------------------------------------ */

/* 1 when the world's failure named ranks and every one of them is masked
 * (under lock): the failure was theirs alone. */
static int local_failure_masked_locked(epx_local_world_t world) {
  int named = 0;
  for (int32_t p = 0; p < world->size; p++) {
    if (!world->slots[p].suspect) continue;
    if (!world->slots[p].masked) return 0;
    named = 1;
  }
  return named;
}

static epx_status_t local_mask(epx_comm_t comm, const char *caller, int32_t rank, int masked) {
  (void)caller; /* nothing here can fail */
  epx_local_world_t world = comm->impl;
  pthread_mutex_lock(&world->lock);
  local_slot_t *slot = &world->slots[rank];
  if (slot->masked != masked) {
    slot->masked = masked;
    world->live += masked ? -1 : 1;
    /* A masked rank waiting at the current gather leaves it (local_wait_locked). */
    if (masked && slot->arrived == world->generation + 1 && world->arrived > 0) {
      slot->arrived = 0;
      world->arrived--;
    }
    if (!masked) slot->suspect = 0;
    pthread_cond_broadcast(&world->cond);
  }
  /* The failed barrier's waiters leave it before the survivors meet again
   * (they are awake: a failure wakes them), so none mistakes the fresh
   * barrier's start for its own completion. */
  while (world->failed && world->waiting > 0) pthread_cond_wait(&world->cond, &world->lock);
  if (world->failed && local_failure_masked_locked(world)) {
    /* The survivors meet at a fresh barrier: the failed one's arrivals are
     * void. A survivor that was between two calls did not see the failure:
     * its next call gets it (local_gather: `failures` moved). */
    world->failed = 0;
    world->arrived = 0;
    world->generation++;
    pthread_cond_broadcast(&world->cond);
  } else if (!world->failed && world->arrived > 0) {
    (void)local_complete_locked(world);
  }
  /* The next call tells the world as it is: on, or still failed (a failure
   * naming a rank not masked yet, or one that came since), naming why. */
  comm->failed = 0;
  pthread_mutex_unlock(&world->lock);
  return EPX_SUCCESS;
}
