/* The shm transport: W ranks as processes of one host, meeting in POSIX
 * shared memory (torchrun's or any launcher's processes, no MPI needed).
 *
 * A control segment (shm_open(name), created by rank 0, opened by the others,
 * unlinked once every rank holds it) carries a process-shared robust mutex, a
 * futex word its waiters sleep on, a generation-counted barrier and one slot
 * per rank (with the rank's pid): the
 * same rendezvous as the local transport's threads, without pointers. Each
 * rank also owns a data segment where it stages what it sends; a collective
 * copies the rank's send side in, meets its peers at a "gather" barrier, maps
 * the peers' data segments it has not mapped yet, copies its own pieces out
 * of them, and meets them again at a "release" barrier, so that no rank
 * writes its data segment again while a peer may still read it. A data
 * segment grows by replacement: a new name (rank and sequence number), which
 * the owner unlinks after the release of the collective that published it,
 * when every peer has mapped it; /dev/shm keeps no name once the ranks are
 * past it, and the memory goes when the last process unmaps it.
 *
 * Failure: every wait (both barriers, the lock, and a rank's wait for rank
 * 0's segment at create) is bounded by timeout_seconds. On expiry the ranks
 * still missing are named, the world is marked failed and every waiter is
 * woken; a failed world answers every later call at once with
 * EPX_ERROR_PEER_FAILED. The release wait is bounded too (unlike the local
 * transport's): peers read the staged copy, never the caller's buffer, so a
 * rank may leave a failed collective early (the copy's name stays until it
 * is replaced, and a mask lets the survivors meet again only once none still
 * reads the failed collective's copies: see shm_mask). Nothing shared keeps a waiter's
 * state (a process-shared condition variable did, and a process killed while
 * waiting on it could leave its peers blocked forever): a waiter sleeps on
 * the futex word with a short timeout and, on each wake, checks its barrier,
 * the clock and whether a missing rank's process is gone (its pid, in the
 * same pid namespace), which fails the world naming that rank at once. A
 * process that ends holding the mutex (robust mutex) fails the world naming
 * it; one stopped holding it is a timeout naming it.
 *
 * A segment left by a job whose rank 0 was killed before unlinking it is
 * stale (its creator's process is gone): rank 0 of a new job on the name
 * removes it (and its ranks' data segments) and creates its own; a rank > 0
 * never joins it, and names it if rank 0 does not replace it in time. A
 * segment whose creator is alive is refused by name. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "comm/comm.h"
#include "core/error.h"

/* "epxshm07": the layout below; a rank built from another layout refuses. */
#define SHM_MAGIC 0x65707873686d3037ULL
#define SHM_NAME_MAX 200
/* A comm's own name: the caller's, or a shrink's "<name>.g<N>". */
#define SHM_PATH_MAX (SHM_NAME_MAX + 16)
#define SHM_MIN_DATA ((size_t)1 << 16)
/* The longest a waiter sleeps before it looks at the clock and its peers'
 * processes again: how soon a killed peer is named. */
#define SHM_SLICE_SECONDS 0.05

typedef enum shm_op {
  SHM_OP_CREATE = 0,
  SHM_OP_ALLTOALL,
  SHM_OP_ALLTOALLV,
  SHM_OP_ALLGATHER,
  SHM_OP_ALLREDUCE,
  SHM_OP_BARRIER
} shm_op_t;

static const char *const shm_op_names[] = {"create",    "alltoall",  "alltoallv",
                                           "allgather", "allreduce", "barrier"};

typedef struct shm_slot {
  /* Under the world's mutex. */
  int32_t attached; /* a comm of this rank is alive */
  int32_t op;       /* the collective it is in (shm_op_t) and its size argument, */
  uint64_t arg;     /* which must be equal on every rank */
  uint64_t arrived; /* 1 + the generation of the barrier it last reached */
  /* 1 + the generation of a barrier it reached that ended without completing
   * (a mask cleared its failure, shm_mask): how that barrier ended is decided
   * once, here, for every rank, not by each waiter on waking. */
  uint64_t voided;
  /* From its arrival at a collective's gather to its release: it may read
   * its peers' data segments (a mask's fresh barrier waits for it to leave,
   * so no survivor writes a segment that a peer still reads; shm_mask). */
  int32_t reading;
  int32_t error;    /* at a release barrier: this rank failed */
  char caller[48];
  /* Its data segment: sequence number (0: none yet) and size; read by peers
   * between the gather and the release. */
  uint64_t data_seq;
  uint64_t data_bytes;
  /* Its process (set when it attaches): a waiter names a missing rank whose
   * process is gone. */
  int32_t pid;
  uint64_t pid_ns;
  /* The shrink (see shm_shrink), under the mutex. */
  int32_t suspect;       /* the world's failure named it missing or gone */
  int32_t shrink_joined; /* it called epx_comm_shrink on this world */
  int32_t masked;        /* out of the collectives (epx_ll_mask_rank; see shm_mask) */
} shm_slot_t;

typedef struct shm_world {
  _Atomic uint64_t magic; /* stored last by rank 0, once the rest is ready */
  int32_t size;
  int32_t creator_pid; /* rank 0's process: once it is gone, the name is stale */
  uint64_t creator_pid_ns;
  double timeout_seconds;
  pthread_mutex_t lock; /* robust, process-shared */
  _Atomic int32_t holder; /* the rank that holds lock, -1: none (names one that dies or stops) */
  /* The futex word the waiters sleep on: bumped (under lock) when a barrier
   * completes and when the world fails; the waker makes the wake call only
   * when a waiter sleeps (sleepers counts them in under lock). */
  _Atomic uint32_t wake;
  _Atomic uint32_t sleepers;
  /* Under lock. */
  uint64_t generation;
  int32_t arrived;
  int32_t live;     /* ranks a barrier waits for: size less the masked */
  uint32_t failures; /* how many times it failed (a rank that missed one a mask cleared gets it) */
  int32_t attached;
  int32_t failed;
  int32_t fail_status;
  uint64_t fail_generation;
  char fail_caller[64];
  char fail_reason[448];
  int32_t shrink_done; /* under lock: the survivors are settled (shrink_joined) */
  shm_slot_t slots[]; /* [size] */
} shm_world_t;

/* A data segment mapped into this process. */
typedef struct shm_map {
  uint64_t seq;
  size_t bytes;
  char *base;
} shm_map_t;

/* This process's side of the comm (comm->impl). */
typedef struct shm_state {
  shm_world_t *world;
  size_t world_bytes;
  char name[SHM_PATH_MAX + 2];
  char base[SHM_NAME_MAX + 1]; /* the caller's name, and how many shrinks */
  uint32_t shrinks;            /* made this comm's from it (shm_shrink) */
  shm_map_t *maps; /* [size]; maps[rank] is the own data segment */
  uint8_t *masked; /* [size]: the ranks masked when the last gather completed (their blocks are not read) */
  uint32_t failures_seen; /* the world's `failures` when a call of this rank last returned one */
  int own_linked;  /* the own data segment's name is still in /dev/shm */
  int locked;      /* this process holds the world's lock */
  int32_t locked_as; /* the rank it took the lock as (-1: none yet) */
  uint64_t pid_ns; /* this process's pid namespace (0: unknown) */
} shm_state_t;

static size_t shm_world_bytes(int32_t size) {
  return sizeof(shm_world_t) + sizeof(shm_slot_t) * (size_t)size;
}

static void shm_data_name(char *out, size_t cap, const shm_state_t *st, int32_t rank,
                          uint64_t seq) {
  snprintf(out, cap, "%s.%d.%llu", st->name, rank, (unsigned long long)seq);
}

static char shm_process_state(const shm_state_t *st, int32_t pid, uint64_t pid_ns) {
  return epx_comm_process_state(pid, pid_ns, st->pid_ns);
}

static int shm_process_gone(const shm_state_t *st, int32_t pid, uint64_t pid_ns) {
  return epx_comm_process_gone(pid, pid_ns, st->pid_ns);
}

/* An attached rank other than `self` whose process is stopped (SIGSTOP or a
 * debugger), or -1: the holder of a lock kept past the timeout when the
 * holder word cannot say (it was stopped between taking the lock and
 * writing its rank). */
static int32_t shm_stopped_rank(const shm_state_t *st, int32_t self) {
  const shm_world_t *w = st->world;
  for (int32_t p = 0; p < w->size; p++) {
    const shm_slot_t *slot = &w->slots[p];
    if (p == self || !slot->attached) continue;
    char state = shm_process_state(st, slot->pid, slot->pid_ns);
    if (state == 'T' || state == 't') return p;
  }
  return -1;
}

/* An attached rank (not arrived at the barrier of `generation`, unless
 * `any`) whose process has ended, or -1. */
static int32_t shm_gone_rank(const shm_state_t *st, uint64_t generation, int any) {
  const shm_world_t *w = st->world;
  for (int32_t p = 0; p < w->size; p++) {
    const shm_slot_t *slot = &w->slots[p];
    if (!slot->attached || slot->masked || (!any && slot->arrived == generation + 1)) continue;
    if (shm_process_gone(st, slot->pid, slot->pid_ns)) return p;
  }
  return -1;
}

/* Wakes every waiter of the world (under lock). */
static void shm_wake_all(shm_world_t *w) {
  atomic_fetch_add_explicit(&w->wake, 1, memory_order_seq_cst);
#if defined(__linux__)
  if (atomic_load_explicit(&w->sleepers, memory_order_seq_cst))
    syscall(SYS_futex, (uint32_t *)&w->wake, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#endif
}

/* Sleeps until the futex word moves from `seen` or `seconds` pass. */
static void shm_sleep(shm_world_t *w, uint32_t seen, double seconds) {
  struct timespec pause = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
#if defined(__linux__)
  syscall(SYS_futex, (uint32_t *)&w->wake, FUTEX_WAIT, seen, &pause, NULL, 0);
#else
  (void)w, (void)seen;
  if (pause.tv_sec || pause.tv_nsec > 200000L) pause = (struct timespec){0, 200000L};
  nanosleep(&pause, NULL);
#endif
}

static double shm_now(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

static void shm_fail_locked(shm_world_t *w, uint64_t generation, epx_status_t status,
                            const char *caller, const char *format, ...)
    __attribute__((format(printf, 5, 6)));
static void shm_fail_locked(shm_world_t *w, uint64_t generation, epx_status_t status,
                            const char *caller, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(w->fail_reason, sizeof w->fail_reason, format, args);
  va_end(args);
  snprintf(w->fail_caller, sizeof w->fail_caller, "%s", caller);
  w->failed = 1;
  w->failures++;
  w->fail_generation = generation;
  w->fail_status = status;
  shm_wake_all(w);
}

static int shm_bounded(double timeout_seconds) {
  return timeout_seconds > 0 && timeout_seconds < 1e9;
}

/* Locks the world, waiting up to the timeout (`rank` is the caller's, -1
 * before it has one). A peer process that ended holding the lock fails the
 * world naming it; one that keeps it past the timeout (stopped, or stuck) is
 * a timeout naming it, the lock not taken. */
static epx_status_t shm_lock(shm_state_t *st, int32_t rank, const char *caller) {
  shm_world_t *w = st->world;
  int rc;
  if (shm_bounded(w->timeout_seconds)) {
    struct timespec deadline = epx_comm_deadline(w->timeout_seconds);
    rc = pthread_mutex_clocklock(&w->lock, CLOCK_MONOTONIC, &deadline);
  } else {
    rc = pthread_mutex_lock(&w->lock);
  }
  if (rc == ETIMEDOUT) {
    int32_t holder = atomic_load(&w->holder), stopped = shm_stopped_rank(st, rank);
    if (holder < 0 || holder == rank || stopped >= 0) holder = stopped >= 0 ? stopped : holder;
    if (holder == rank) holder = -1;
    char who[32] = "a rank";
    if (holder >= 0) snprintf(who, sizeof who, "rank %d", holder);
    return epx_error(EPX_ERROR_TIMEOUT,
                     "%s: %s held the shm segment's lock for more than %g s (comm "
                     "timeout_seconds): its process is stopped or stuck. The comm is now failed; "
                     "destroy it",
                     caller, who, w->timeout_seconds);
  }
  if (rc != 0 && rc != EOWNERDEAD)
    return epx_error(EPX_ERROR_INTERNAL, "%s: locking the shm segment failed (%s)", caller,
                     strerror(rc));
  st->locked = 1;
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&w->lock);
    int32_t dead = atomic_load(&w->holder);
    if (dead < 0 || dead == rank) dead = shm_gone_rank(st, 0, 1);
    if (dead >= 0) w->slots[dead].suspect = 1;
    if (!w->failed) {
      if (dead >= 0)
        shm_fail_locked(w, w->generation, EPX_ERROR_PEER_FAILED, caller,
                        "rank %d's process (pid %d) ended holding the shm segment's lock", dead,
                        (int)w->slots[dead].pid);
      else
        shm_fail_locked(w, w->generation, EPX_ERROR_PEER_FAILED, caller,
                        "a rank's process ended holding the shm segment's lock");
    }
  }
  atomic_store(&w->holder, rank);
  st->locked_as = rank;
  return EPX_SUCCESS;
}

/* The holder word is cleared only while it still names this rank, after the
 * unlock: a process stopped between the two leaves its own rank there, never
 * -1 over a lock it still holds. */
static void shm_unlock(shm_state_t *st) {
  if (!st->locked) return;
  st->locked = 0;
  pthread_mutex_unlock(&st->world->lock);
  int32_t mine = st->locked_as;
  atomic_compare_exchange_strong(&st->world->holder, &mine, -1);
}

/* Waits (the lock released) until a wake or min(left, a slice) has passed,
 * then takes the lock back (shm_lock's status). */
static epx_status_t shm_nap_locked(shm_state_t *st, int32_t rank, const char *caller, double left) {
  shm_world_t *w = st->world;
  uint32_t seen = atomic_load_explicit(&w->wake, memory_order_acquire);
  atomic_fetch_add_explicit(&w->sleepers, 1, memory_order_seq_cst);
  shm_unlock(st);
  shm_sleep(w, seen, left < SHM_SLICE_SECONDS ? left : SHM_SLICE_SECONDS);
  atomic_fetch_sub_explicit(&w->sleepers, 1, memory_order_seq_cst);
  return shm_lock(st, rank, caller);
}

static epx_status_t shm_failed_error_locked(epx_comm_t comm, const char *caller,
                                            uint64_t generation) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  comm->failed = 1;
  st->failures_seen = w->failures;
  return epx_comm_world_failed_error(caller, generation == w->fail_generation,
                                     (epx_status_t)w->fail_status, w->fail_caller, w->fail_reason);
}

/* The world's failure as this rank's error on entering a barrier (under
 * lock), or success. A failure that a mask cleared while this rank was
 * outside the barriers (between two collectives, or copying between a
 * gather and its release) is still this rank's: it masks too, then goes on,
 * so every survivor fails the same step (see shm_mask). */
static epx_status_t shm_check_failed_locked(epx_comm_t comm, const char *caller) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  if (w->failed) return shm_failed_error_locked(comm, caller, UINT64_MAX);
  return epx_comm_world_missed_failure_error(comm, caller, w->failures, &st->failures_seen,
                                             (epx_status_t)w->fail_status, w->fail_caller, w->fail_reason);
}

static int shm_arrived(const void *world, int32_t rank) {
  const shm_world_t *w = world;
  return w->slots[rank].masked || w->slots[rank].arrived == w->generation + 1;
}

/* The error of a masked rank's collective. */
static epx_status_t shm_masked_error(epx_comm_t comm, const char *caller) {
  return epx_error(EPX_ERROR_PEER_FAILED,
                   "%s: rank %d is masked out of this comm's collectives (epx_ll_mask_rank on a "
                   "peer); its peers go on without it", caller, comm->rank);
}

static void shm_fail_timeout_locked(shm_state_t *st, uint64_t generation, const char *caller) {
  shm_world_t *w = st->world;
  char reason[sizeof w->fail_reason];
  epx_comm_world_timeout_reason(reason, sizeof reason, w->size, shm_arrived, w, w->timeout_seconds);
  /* Of several missing ranks, one stopped (SIGSTOP, a debugger) is the
   * likely cause: the others may wait on it. */
  int32_t stopped = shm_stopped_rank(st, -1);
  if (stopped >= 0 && !shm_arrived(w, stopped)) {
    size_t used = strlen(reason);
    snprintf(reason + used, sizeof reason - used, " (rank %d's process is stopped)", stopped);
  }
  for (int32_t p = 0; p < w->size; p++)
    if (!shm_arrived(w, p)) w->slots[p].suspect = 1;
  shm_fail_locked(w, generation, EPX_ERROR_TIMEOUT, caller, "%s", reason);
}

/* Waits (under lock) until the barrier of `generation` ends (it completes,
 * or a mask voids it), the world fails, this rank is masked, a missing
 * rank's process is found gone, or the timeout passes. A barrier that ended
 * is this rank's success if it completed, even when the world failed and a
 * mask cleared it since (a later barrier's failure: this rank gets it at its
 * next barrier, as its peers did), and its failure if a mask voided it (the
 * slot's `voided`): every rank that reached it returns the same. The lock is
 * let go while it sleeps; if it cannot be taken back in time, the error says
 * who holds it and the lock is not held on return. */
static epx_status_t shm_wait_locked(epx_comm_t comm, const char *caller, uint64_t generation) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  int bounded = shm_bounded(w->timeout_seconds);
  double start = shm_now(), deadline = start + (bounded ? w->timeout_seconds : 0);
  double next_check = start + SHM_SLICE_SECONDS;
  while (w->generation == generation && !w->failed && !w->slots[comm->rank].masked) {
    double now = shm_now(), left = bounded ? deadline - now : SHM_SLICE_SECONDS;
    /* The peers' processes are looked at once a wait has lasted a slice (it
     * costs a read of /proc per missing rank: not on every wake). */
    int32_t gone = -1;
    if (now >= next_check) {
      gone = shm_gone_rank(st, generation, 0);
      next_check = now + SHM_SLICE_SECONDS;
    }
    if (gone >= 0) {
      w->slots[gone].suspect = 1;
      shm_fail_locked(w, generation, EPX_ERROR_PEER_FAILED, caller,
                      "rank %d did not arrive: its process (pid %d) has ended", gone,
                      (int)w->slots[gone].pid);
      break;
    }
    if (left <= 0) {
      shm_fail_timeout_locked(st, generation, caller);
      break;
    }
    epx_status_t locked = shm_nap_locked(st, comm->rank, caller, left);
    if (locked != EPX_SUCCESS) {
      comm->failed = 1;
      return locked;
    }
  }
  if (w->generation != generation && w->slots[comm->rank].voided == generation + 1) {
    /* Its failure came and a mask cleared it while this rank slept. */
    comm->failed = 1;
    st->failures_seen = w->failures;
    return epx_comm_world_failed_error(caller, 1, (epx_status_t)w->fail_status, w->fail_caller,
                                       w->fail_reason);
  }
  if (w->generation != generation) return EPX_SUCCESS;
  if (!w->failed) return shm_masked_error(comm, caller);
  return shm_failed_error_locked(comm, caller, generation);
}

/* Arrives at the current barrier (under lock) and waits for the others. */
static epx_status_t shm_arrive_locked(epx_comm_t comm, const char *caller) {
  shm_world_t *w = ((shm_state_t *)comm->impl)->world;
  uint64_t generation = w->generation;
  w->slots[comm->rank].arrived = generation + 1;
  if (++w->arrived >= w->live) {
    w->arrived = 0;
    w->generation++;
    shm_wake_all(w);
    return EPX_SUCCESS;
  }
  return shm_wait_locked(comm, caller, generation);
}

/* Checks that every peer waiting at this barrier is in the same collective
 * with the same size, and that none has gone (under lock). */
static epx_status_t shm_check_peers_locked(epx_comm_t comm, const char *caller, shm_op_t op,
                                           uint64_t arg) {
  shm_world_t *w = ((shm_state_t *)comm->impl)->world;
  uint64_t generation = w->generation;
  for (int32_t p = 0; p < w->size; p++) {
    const shm_slot_t *peer = &w->slots[p];
    if (p == comm->rank || peer->masked) continue;
    if (op != SHM_OP_CREATE && !peer->attached) {
      shm_fail_locked(w, generation, EPX_ERROR_PEER_FAILED, caller,
                      "rank %d destroyed its comm while rank %d is in %s (%s)", p, comm->rank,
                      caller, shm_op_names[op]);
      return shm_failed_error_locked(comm, caller, generation);
    }
    if (peer->arrived == generation + 1 && (peer->op != (int32_t)op || peer->arg != arg)) {
      shm_fail_locked(w, generation, EPX_ERROR_PEER_FAILED, caller,
                      "rank %d is in %s (%s, size %llu) while rank %d is in %s (%s, size %llu); "
                      "every rank must make the same collective calls with the same sizes in "
                      "the same order",
                      comm->rank, caller, shm_op_names[op], (unsigned long long)arg, p,
                      peer->caller, shm_op_names[peer->op], (unsigned long long)peer->arg);
      return shm_failed_error_locked(comm, caller, generation);
    }
  }
  return EPX_SUCCESS;
}

/* Publishes the rank's data segment and waits for every peer to reach the
 * same collective. */
static epx_status_t shm_gather(epx_comm_t comm, const char *caller, shm_op_t op, uint64_t arg) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  shm_slot_t *mine = &w->slots[comm->rank];
  epx_status_t status = shm_lock(st, comm->rank, caller);
  if (status != EPX_SUCCESS) {
    comm->failed = 1;
    return status;
  }
  status = shm_check_failed_locked(comm, caller);
  status = status != EPX_SUCCESS ? status
           : mine->masked ? shm_masked_error(comm, caller)
                          : shm_check_peers_locked(comm, caller, op, arg);
  if (status == EPX_SUCCESS) {
    mine->op = (int32_t)op;
    mine->arg = arg;
    snprintf(mine->caller, sizeof mine->caller, "%s", caller);
    mine->data_seq = st->maps[comm->rank].seq;
    mine->data_bytes = st->maps[comm->rank].bytes;
    mine->reading = op != SHM_OP_CREATE && op != SHM_OP_BARRIER; /* a release follows */
    status = shm_arrive_locked(comm, caller);
  }
  /* A failed gather has no release: this rank reads nothing. (On an error
   * taking the lock back the flag stays: a mask waits for it, bounded.) */
  if (st->locked && status != EPX_SUCCESS && mine->reading) {
    mine->reading = 0;
    shm_wake_all(w); /* a mask may wait for it (shm_mask) */
  }
  for (int32_t p = 0; status == EPX_SUCCESS && p < w->size; p++) st->masked[p] = (uint8_t)w->slots[p].masked;
  shm_unlock(st);
  return status;
}

/* Waits until every peer is done reading this collective's data; a rank that
 * failed (`status`) makes the others fail naming it. The own data segment's
 * name goes once every peer has mapped it: after a release that completed
 * (after a failed one a survivor may still be about to map it; the name
 * goes when the segment is replaced, shm_stage, or at destroy). */
static epx_status_t shm_release(epx_comm_t comm, const char *caller, shm_op_t op,
                                epx_status_t status) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  int released = 0;
  epx_status_t locked = shm_lock(st, comm->rank, caller);
  if (locked != EPX_SUCCESS) {
    comm->failed = 1;
    status = locked;
  } else {
    w->slots[comm->rank].error = status != EPX_SUCCESS;
    w->slots[comm->rank].reading = 0;
    if (w->failed) shm_wake_all(w); /* a mask may wait for it (shm_mask) */
    epx_status_t waited = shm_check_failed_locked(comm, caller);
    if (waited == EPX_SUCCESS) waited = shm_arrive_locked(comm, caller);
    /* Every peer reached the release: each has mapped this rank's segment. */
    released = waited == EPX_SUCCESS;
    if (status == EPX_SUCCESS) status = waited;
    for (int32_t p = 0; p < w->size && status == EPX_SUCCESS; p++)
      if (w->slots[p].error && !w->slots[p].masked)
        status = epx_error(EPX_ERROR_PEER_FAILED,
                           "%s: rank %d failed in this %s (its own error says why); this rank's "
                           "output is incomplete",
                           caller, p, shm_op_names[op]);
    shm_unlock(st);
  }
  if (st->own_linked && released) {
    char name[SHM_PATH_MAX + 48];
    shm_data_name(name, sizeof name, st, comm->rank, st->maps[comm->rank].seq);
    shm_unlink(name);
    st->own_linked = 0;
  }
  return status;
}

/* Maps `bytes` of the shared object `name`, creating it (and reserving its
 * memory, so that a full /dev/shm is an error here and not a SIGBUS later)
 * when `create`. */
static epx_status_t shm_map_object(const char *caller, const char *name, size_t bytes, int create,
                                   char **out) {
  int fd = shm_open(name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0)
    return epx_error(EPX_ERROR_TRANSPORT, "%s: shm_open(\"%s\") failed: %s", caller, name,
                     strerror(errno));
  int rc = create ? posix_fallocate(fd, 0, (off_t)bytes) : 0;
  if (rc) {
    close(fd);
    shm_unlink(name);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY,
                     "%s: cannot reserve %zu bytes of shared memory for \"%s\" (%s); /dev/shm is "
                     "too small: enlarge it (docker run --shm-size=...)",
                     caller, bytes, name, strerror(rc));
  }
  void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int mmap_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name);
    return epx_error(EPX_ERROR_TRANSPORT, "%s: mmap of \"%s\" (%zu bytes) failed: %s", caller,
                     name, bytes, strerror(mmap_errno));
  }
  *out = base;
  return EPX_SUCCESS;
}

/* The own data segment, at least `bytes` large (a new, larger one if not);
 * called before the gather, when no peer reads it. */
static epx_status_t shm_stage(epx_comm_t comm, const char *caller, size_t bytes, char **block) {
  shm_state_t *st = comm->impl;
  shm_map_t *own = &st->maps[comm->rank];
  if (own->bytes < bytes) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t want = bytes > 2 * own->bytes ? bytes : 2 * own->bytes;
    if (want < SHM_MIN_DATA) want = SHM_MIN_DATA;
    want = (want + page - 1) / page * page;
    char name[SHM_PATH_MAX + 48], *base = NULL;
    /* The current segment's name, left by a failed release: no peer maps it
     * any more (a mask's fresh barrier waited for the readers, shm_mask). */
    if (st->own_linked) {
      shm_data_name(name, sizeof name, st, comm->rank, own->seq);
      shm_unlink(name);
      st->own_linked = 0;
    }
    shm_data_name(name, sizeof name, st, comm->rank, own->seq + 1);
    /* The name is this rank's in this world: an object there is a leftover
     * of an ended job on the same name. */
    shm_unlink(name);
    epx_status_t status = shm_map_object(caller, name, want, 1, &base);
    if (status != EPX_SUCCESS) return status;
    if (own->base) munmap(own->base, own->bytes);
    own->base = base;
    own->bytes = want;
    own->seq++;
    st->own_linked = 1;
  }
  *block = own->base;
  return EPX_SUCCESS;
}

/* Maps every peer's current data segment (after the gather). */
static epx_status_t shm_map_peers(epx_comm_t comm, const char *caller) {
  shm_state_t *st = comm->impl;
  for (int32_t p = 0; p < comm->size; p++) {
    const shm_slot_t *slot = &st->world->slots[p];
    shm_map_t *map = &st->maps[p];
    if (p == comm->rank || st->masked[p] || slot->data_seq == map->seq) continue;
    char name[SHM_PATH_MAX + 48], *base = NULL;
    shm_data_name(name, sizeof name, st, p, slot->data_seq);
    epx_status_t status = shm_map_object(caller, name, (size_t)slot->data_bytes, 0, &base);
    if (status != EPX_SUCCESS) return status;
    if (map->base) munmap(map->base, map->bytes);
    map->base = base;
    map->bytes = (size_t)slot->data_bytes;
    map->seq = slot->data_seq;
  }
  return EPX_SUCCESS;
}

/* Stages `bytes` from `send` (may be NULL: the caller fills the block after)
 * and meets the peers; on success every peer's block is mapped. */
static epx_status_t shm_publish(epx_comm_t comm, const char *caller, shm_op_t op, uint64_t arg,
                                const void *send, size_t bytes, char **block) {
  char *own = NULL;
  epx_status_t status = shm_stage(comm, caller, bytes, &own);
  if (status != EPX_SUCCESS) return status;
  if (send && bytes) memcpy(own, send, bytes);
  if (block) *block = own;
  return shm_gather(comm, caller, op, arg);
}

static epx_status_t shm_alltoall(epx_comm_t comm, const char *caller, const void *send,
                                 void *recv, size_t bytes) {
  size_t total = bytes * (size_t)comm->size;
  epx_status_t status = shm_publish(comm, caller, SHM_OP_ALLTOALL, bytes, send, total, NULL);
  if (status != EPX_SUCCESS) return status;
  shm_state_t *st = comm->impl;
  status = shm_map_peers(comm, caller);
  for (int32_t i = 0; i < comm->size && bytes && status == EPX_SUCCESS; i++) {
    int32_t s = (comm->rank + i) % comm->size;
    if (st->masked[s])
      memset((char *)recv + (size_t)s * bytes, 0, bytes);
    else
      memcpy((char *)recv + (size_t)s * bytes, st->maps[s].base + (size_t)comm->rank * bytes,
             bytes);
  }
  return shm_release(comm, caller, SHM_OP_ALLTOALL, status);
}

/* The alltoallv block: counts[size] and byte offsets[size] (int64), then each
 * destination's units packed in rank order. */
static epx_status_t shm_alltoallv(epx_comm_t comm, const char *caller, const void *send,
                                  const int64_t *send_counts, const int64_t *send_displs,
                                  void *recv, const int64_t *recv_counts,
                                  const int64_t *recv_displs, size_t unit) {
  const int32_t size = comm->size, rank = comm->rank;
  size_t head = sizeof(int64_t) * 2 * (size_t)size, total = head;
  for (int32_t r = 0; r < size; r++) total += (size_t)send_counts[r] * unit;
  char *block = NULL;
  epx_status_t status = shm_stage(comm, caller, total, &block);
  if (status != EPX_SUCCESS) return status;
  int64_t *counts = (int64_t *)block, *offsets = counts + size;
  size_t at = head;
  for (int32_t r = 0; r < size; r++) {
    size_t piece = (size_t)send_counts[r] * unit;
    counts[r] = send_counts[r];
    offsets[r] = (int64_t)at;
    if (piece) memcpy(block + at, (const char *)send + (size_t)send_displs[r] * unit, piece);
    at += piece;
  }
  status = shm_gather(comm, caller, SHM_OP_ALLTOALLV, unit);
  if (status != EPX_SUCCESS) return status;
  shm_state_t *st = comm->impl;
  status = shm_map_peers(comm, caller);
  for (int32_t i = 0; i < size && status == EPX_SUCCESS; i++) {
    int32_t s = (rank + i) % size;
    if (st->masked[s]) continue; /* the caller expects nothing from it (cpu/call.c) */
    const int64_t *peer = (const int64_t *)st->maps[s].base;
    int64_t count = peer[rank];
    if (count != recv_counts[s] || count < 0) {
      status = epx_comm_alltoallv_count_error(caller, s, count, rank, recv_counts[s]);
      break;
    }
    if (count)
      memcpy((char *)recv + (size_t)recv_displs[s] * unit, st->maps[s].base + peer[size + rank],
             (size_t)count * unit);
  }
  return shm_release(comm, caller, SHM_OP_ALLTOALLV, status);
}

static epx_status_t shm_allgather(epx_comm_t comm, const char *caller, const void *send,
                                  void *recv, size_t bytes) {
  epx_status_t status = shm_publish(comm, caller, SHM_OP_ALLGATHER, bytes, send, bytes, NULL);
  if (status != EPX_SUCCESS) return status;
  shm_state_t *st = comm->impl;
  status = shm_map_peers(comm, caller);
  for (int32_t s = 0; s < comm->size && bytes && status == EPX_SUCCESS; s++)
    if (st->masked[s])
      memset((char *)recv + (size_t)s * bytes, 0, bytes);
    else
      memcpy((char *)recv + (size_t)s * bytes, st->maps[s].base, bytes);
  return shm_release(comm, caller, SHM_OP_ALLGATHER, status);
}

static epx_status_t shm_allreduce_max_i64(epx_comm_t comm, const char *caller, int64_t *values,
                                          int32_t count) {
  size_t bytes = sizeof(int64_t) * (size_t)count;
  epx_status_t status =
      shm_publish(comm, caller, SHM_OP_ALLREDUCE, (uint64_t)count, values, bytes, NULL);
  if (status != EPX_SUCCESS) return status;
  shm_state_t *st = comm->impl;
  status = shm_map_peers(comm, caller);
  for (int32_t s = 0; s < comm->size && status == EPX_SUCCESS; s++) {
    if (st->masked[s]) continue;
    const int64_t *peer = (const int64_t *)st->maps[s].base;
    for (int32_t i = 0; i < count; i++)
      if (peer[i] > values[i]) values[i] = peer[i];
  }
  return shm_release(comm, caller, SHM_OP_ALLREDUCE, status);
}

static epx_status_t shm_barrier(epx_comm_t comm, const char *caller) {
  return shm_gather(comm, caller, SHM_OP_BARRIER, 0);
}

static void shm_close(shm_state_t *st, int32_t size) {
  for (int32_t p = 0; p < size && st->maps; p++)
    if (st->maps[p].base) munmap(st->maps[p].base, st->maps[p].bytes);
  if (st->world) munmap(st->world, st->world_bytes);
  free(st->maps);
  free(st->masked);
  free(st);
}

/* Removes the names of rank p's data segments `seq` and the next (which it
 * may have made and not published yet). */
static void shm_unlink_data(const shm_state_t *st, int32_t p, uint64_t seq) {
  char name[SHM_PATH_MAX + 48];
  for (uint64_t s = seq ? seq : 1; s <= seq + 1; s++) {
    shm_data_name(name, sizeof name, st, p, s);
    shm_unlink(name);
  }
}

static void shm_destroy(epx_comm_t comm) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  /* A peer stopped holding the lock: the world is left as it is. */
  if (shm_lock(st, comm->rank, "epx_comm_destroy") != EPX_SUCCESS) {
    shm_close(st, comm->size);
    comm->impl = NULL;
    return;
  }
  /* A peer whose process ended cannot remove its data segments' names. */
  for (int32_t p = 0; p < w->size; p++)
    if (p != comm->rank && w->slots[p].attached &&
        shm_process_gone(st, w->slots[p].pid, w->slots[p].pid_ns))
      shm_unlink_data(st, p, w->slots[p].data_seq);
  w->slots[comm->rank].attached = 0;
  w->attached--;
  /* A peer that already waits in its next collective would wait in vain. */
  for (int32_t p = 0; p < w->size && !w->failed && !w->slots[comm->rank].masked; p++) {
    const shm_slot_t *peer = &w->slots[p];
    if (peer->attached && !peer->masked && peer->arrived == w->generation + 1 &&
        peer->op != SHM_OP_CREATE) {
      w->slots[comm->rank].suspect = 1; /* the failure names it: masking it clears it */
      shm_fail_locked(w, w->generation, EPX_ERROR_PEER_FAILED, peer->caller,
                      "rank %d destroyed its comm while rank %d is in %s (%s)", comm->rank, p,
                      peer->caller, shm_op_names[peer->op]);
    }
  }
  shm_unlock(st);
  if (st->own_linked) {
    char name[SHM_PATH_MAX + 48];
    shm_data_name(name, sizeof name, st, comm->rank, st->maps[comm->rank].seq);
    shm_unlink(name);
  }
  shm_close(st, comm->size);
  comm->impl = NULL;
}

static epx_status_t shm_shrink(epx_comm_t comm, const char *caller, double timeout_seconds,
                               int32_t ranks_per_node, uint8_t *lost, epx_comm_t *survivor);

static epx_status_t shm_mask(epx_comm_t comm, const char *caller, int32_t rank, int masked);

static const epx_transport_ops_t shm_ops = {
    .name = "shm",
    .alltoall = shm_alltoall,
    .alltoallv = shm_alltoallv,
    .allgather = shm_allgather,
    .allreduce_max_i64 = shm_allreduce_max_i64,
    .barrier = shm_barrier,
    .shrink = shm_shrink,
    .mask = shm_mask,
    .destroy = shm_destroy,
    .one_host = 1,
};

/* The control segment now at the name, mapped whole (*bytes), once its
 * creator has finished its init; NULL when there is none (*exists 0) or it is
 * not complete or not of this layout (*exists 1). */
static shm_world_t *shm_world_map(const shm_state_t *st, size_t *bytes, int *exists) {
  *exists = 0;
  int fd = shm_open(st->name, O_RDWR, 0600);
  if (fd < 0) return NULL;
  *exists = 1;
  struct stat info;
  void *base = MAP_FAILED;
  if (fstat(fd, &info) == 0 && (size_t)info.st_size >= sizeof(shm_world_t))
    base = mmap(NULL, (size_t)info.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return NULL;
  shm_world_t *w = base;
  if (atomic_load_explicit(&w->magic, memory_order_acquire) == SHM_MAGIC && w->size >= 1 &&
      shm_world_bytes(w->size) <= (size_t)info.st_size) {
    *bytes = (size_t)info.st_size;
    return w;
  }
  munmap(base, (size_t)info.st_size);
  return NULL;
}

/* Rank 0, before it creates the name: a segment left there by a job whose
 * rank 0 has ended is removed, with its ranks' data segments; one whose
 * rank 0 lives, or one that is not a complete epx segment, is refused. */
static epx_status_t shm_reclaim(const shm_state_t *st, const char *fn) {
  size_t bytes = 0;
  int exists = 0;
  shm_world_t *old = shm_world_map(st, &bytes, &exists);
  if (!exists) return EPX_SUCCESS;
  if (!old)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: name \"%s\" is taken by a shared memory object that is not a complete "
                     "epx segment of this version (another program's, another epx version's, or "
                     "one whose rank 0 is creating it now); pass another name, or remove "
                     "/dev/shm/%s if no job uses it",
                     fn, st->name + 1, st->name + 1);
  int32_t creator = old->creator_pid;
  int gone = shm_process_gone(st, creator, old->creator_pid_ns);
  if (gone) {
    for (int32_t p = 0; p < old->size; p++) shm_unlink_data(st, p, old->slots[p].data_seq);
    shm_unlink(st->name);
  }
  munmap(old, bytes);
  if (gone) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: name \"%s\" is in use by a live job (its rank 0 is pid %d); pass a name "
                   "that is new for every comm, or remove /dev/shm/%s if no job uses it",
                   fn, st->name + 1, (int)creator, st->name + 1);
}

/* Rank 0: the control segment, its robust lock shared between processes,
 * its creator's pid, the magic stored last. */
static epx_status_t shm_world_init(shm_state_t *st, int32_t size, double timeout_seconds) {
  const char *fn = "epx_comm_create_shm";
  char *base = NULL;
  epx_status_t status = shm_reclaim(st, fn);
  if (status == EPX_SUCCESS) status = shm_map_object(fn, st->name, st->world_bytes, 1, &base);
  if (status != EPX_SUCCESS) return status;
  shm_world_t *w = (shm_world_t *)base;
  w->size = size;
  w->creator_pid = (int32_t)getpid();
  w->creator_pid_ns = st->pid_ns;
  w->timeout_seconds = timeout_seconds;
  w->live = size;
  atomic_init(&w->holder, -1);
  atomic_init(&w->wake, 0);
  atomic_init(&w->sleepers, 0);
  pthread_mutexattr_t mattr;
  int rc = pthread_mutexattr_init(&mattr);
  if (!rc) rc = pthread_mutexattr_setpshared(&mattr, PTHREAD_PROCESS_SHARED);
  if (!rc) rc = pthread_mutexattr_setrobust(&mattr, PTHREAD_MUTEX_ROBUST);
  if (!rc) rc = pthread_mutex_init(&w->lock, &mattr);
  pthread_mutexattr_destroy(&mattr);
  st->world = w;
  if (rc) {
    shm_unlink(st->name);
    return epx_error(EPX_ERROR_INTERNAL, "%s: process-shared robust mutex init failed (%s)", fn,
                     strerror(rc));
  }
  atomic_store_explicit(&w->magic, SHM_MAGIC, memory_order_release);
  return EPX_SUCCESS;
}

/* Ranks > 0: opens rank 0's control segment, waiting for it to appear and be
 * initialised, up to the timeout. A stale segment (its creator gone) is not
 * this job's: they wait for rank 0 to replace it, and name it if it does
 * not. */
static epx_status_t shm_world_open(shm_state_t *st, int32_t size, double timeout_seconds) {
  const char *fn = "epx_comm_create_shm";
  int bounded = shm_bounded(timeout_seconds);
  double deadline = shm_now() + (bounded ? timeout_seconds : 0);
  const struct timespec pause = {0, 1000000L};
  int32_t stale_creator = 0;
  for (;;) {
    size_t bytes = 0;
    int exists = 0;
    shm_world_t *w = shm_world_map(st, &bytes, &exists);
    if (w && shm_process_gone(st, w->creator_pid, w->creator_pid_ns)) {
      stale_creator = w->creator_pid;
      munmap(w, bytes);
      w = NULL;
    }
    if (w) {
      st->world = w;
      st->world_bytes = bytes;
      break;
    }
    if (bounded && shm_now() >= deadline) {
      if (stale_creator)
        return epx_error(EPX_ERROR_TIMEOUT,
                         "%s: \"%s\" holds only a segment left by an earlier job whose rank 0 "
                         "(pid %d) has ended, and rank 0 of this job did not replace it within "
                         "%g s (comm timeout_seconds); start rank 0 (it removes the stale "
                         "segment), or remove /dev/shm/%s",
                         fn, st->name + 1, (int)stale_creator, timeout_seconds, st->name + 1);
      return epx_error(EPX_ERROR_TIMEOUT,
                       "%s: rank 0 did not create the shared segment \"%s\" of a %d-rank world "
                       "within %g s (comm timeout_seconds); is rank 0 running, with the same "
                       "name and size?",
                       fn, st->name, size, timeout_seconds);
    }
    nanosleep(&pause, NULL);
  }
  if (st->world->size != size)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: size is %d but rank 0 created \"%s\" for %d ranks; pass the same size "
                     "on every rank",
                     fn, size, st->name, st->world->size);
  return EPX_SUCCESS;
}

/* Takes the rank's slot (a second live comm of the same rank is refused). */
static epx_status_t shm_attach(epx_comm_t comm) {
  shm_world_t *w = ((shm_state_t *)comm->impl)->world;
  const char *fn = "epx_comm_create_shm";
  shm_state_t *st = comm->impl;
  epx_status_t status = shm_lock(st, comm->rank, fn);
  if (status != EPX_SUCCESS) return status;
  if (w->failed)
    status = epx_error(EPX_ERROR_PEER_FAILED, "%s: the world failed earlier, in %s: %s", fn,
                       w->fail_caller, w->fail_reason);
  else if (w->slots[comm->rank].attached)
    status = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: rank %d already has a live comm on \"%s\"; every rank passes its "
                       "own rank (and a new name for each new comm)",
                       fn, comm->rank, ((shm_state_t *)comm->impl)->name);
  if (status == EPX_SUCCESS) {
    w->slots[comm->rank].attached = 1;
    w->slots[comm->rank].pid = (int32_t)getpid();
    w->slots[comm->rank].pid_ns = st->pid_ns;
    w->attached++;
  }
  shm_unlock(st);
  return status;
}

static int shm_name_ok(const char *name) {
  size_t n = strlen(name);
  if (n == 0 || n > SHM_NAME_MAX) return 0;
  for (size_t i = 0; i < n; i++) {
    char c = name[i];
    int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
             c == '-' || c == '_' || c == '.';
    if (!ok) return 0;
  }
  return 1;
}

/* A comm of rank `rank` of `size` on the segment "<base>" (shrinks 0) or
 * "<base>.g<shrinks>", its arguments checked; *out is the comm object. */
static epx_status_t shm_create(const char *fn, const char *base, uint32_t shrinks, int32_t rank,
                               int32_t size, double timeout_seconds, int32_t ranks_per_node,
                               epx_comm_t *out) {
  epx_status_t status = EPX_SUCCESS;
  epx_comm_t created = NULL;
  shm_state_t *st = calloc(1, sizeof *st);
  if (st) st->maps = calloc((size_t)size, sizeof *st->maps);
  if (st) st->masked = calloc((size_t)size, 1);
  if (!st || !st->maps || !st->masked) {
    if (st) free(st->maps), free(st->masked), free(st);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d ranks", fn, size);
  }
  snprintf(st->base, sizeof st->base, "%s", base);
  st->shrinks = shrinks;
  if (shrinks) snprintf(st->name, sizeof st->name, "/%s.g%u", base, shrinks);
  else snprintf(st->name, sizeof st->name, "/%s", base);
  st->pid_ns = epx_comm_pid_ns();
  st->locked_as = -1;
  st->world_bytes = shm_world_bytes(size);
  EPX_CHECK(rank == 0 ? shm_world_init(st, size, timeout_seconds)
                      : shm_world_open(st, size, timeout_seconds));
  EPX_CHECK(epx_comm_new(fn, timeout_seconds, &created));
  created->ops = &shm_ops;
  created->rank = rank;
  created->size = size;
  created->impl = st;
  EPX_CHECK(shm_attach(created));
  status = shm_gather(created, fn, SHM_OP_CREATE, 0);
  /* Every rank holds the control segment now (or gave up): its name can go. */
  if (rank == 0) shm_unlink(st->name);
  if (status == EPX_SUCCESS) status = epx_comm_topology_init(created, fn, ranks_per_node, NULL);
  if (status != EPX_SUCCESS) {
    shm_destroy(created);
    epx_comm_free(created);
    return status;
  }
  *out = created;
  return EPX_SUCCESS;
fail:
  if (rank == 0 && st->world) shm_unlink(st->name);
  shm_close(st, size);
  if (created) epx_comm_free(created);
  return status;
}

epx_status_t epx_comm_create_shm(const char *name, int32_t rank, int32_t size,
                                 const epx_comm_config_t *config, epx_comm_t *comm) {
  const char *fn = "epx_comm_create_shm";
  epx_error_clear();
  EPX_REQUIRE(comm, "%s: comm is NULL; pass the address of an epx_comm_t", fn);
  EPX_REQUIRE(name && shm_name_ok(name),
              "%s: name is %s; pass the job's name for the comm, 1 to %d characters of "
              "[A-Za-z0-9._-], the same on every rank and new for every comm",
              fn, name ? "not such a name" : "NULL", SHM_NAME_MAX);
  EPX_REQUIRE(size >= 1, "%s: size is %d; pass the number of ranks (>= 1)", fn, size);
  EPX_REQUIRE(rank >= 0 && rank < size, "%s: rank is %d; pass 0 <= rank < %d (size)", fn, rank,
              size);
  double timeout_seconds;
  epx_status_t status = epx_comm_config_timeout(fn, config, &timeout_seconds);
  int32_t ranks_per_node = 0;
  if (status == EPX_SUCCESS) status = epx_comm_config_ranks_per_node(fn, config, &ranks_per_node);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(ranks_per_node == 0 || size % ranks_per_node == 0,
              "%s: config->ranks_per_node is %d, which does not divide size %d; pass a divisor of "
              "it, or 0", fn, ranks_per_node, size);
  epx_comm_t created = NULL;
  status = shm_create(fn, name, 0, rank, size, timeout_seconds, ranks_per_node, &created);
  if (status == EPX_SUCCESS) *comm = created->id;
  return status;
}

/* ------------------------------------------------------------------------ */
/* Shrink (epx_comm_shrink)                                                  */
/* ------------------------------------------------------------------------ */

/* The survivors agree on the lost ranks in the old control segment, which
 * every one of them still maps (its name is gone): a rank joins by calling
 * the shrink; it is settled once (by whichever survivor sees it first)
 * when every rank has joined except those not waited for — a rank whose
 * comm is destroyed, whose process has ended, or that the world's failure
 * named missing (suspect) — or when a joined survivor has waited the
 * timeout. A dead process cannot block it: its lock is robust, and a
 * process that ended is never waited for. The survivors then create a new
 * segment, "<name>.g<N>", whose rank 0 is the lowest survivor: nothing of
 * the old world is used again. */

/* 1 when no rank is left to wait for (under lock). */
static int shm_shrink_settled_locked(const shm_state_t *st) {
  const shm_world_t *w = st->world;
  for (int32_t p = 0; p < w->size; p++) {
    const shm_slot_t *slot = &w->slots[p];
    if (slot->shrink_joined || !slot->attached || slot->suspect || slot->masked) continue;
    if (!shm_process_gone(st, slot->pid, slot->pid_ns)) return 0;
  }
  return 1;
}

/* Joins the shrink and waits for it to settle (under lock; on an error
 * taking the lock back, the lock is not held). */
static epx_status_t shm_shrink_join_locked(epx_comm_t comm, const char *caller) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  shm_slot_t *mine = &w->slots[comm->rank];
  epx_status_t refused = epx_comm_shrink_join_refusal(comm, caller, mine->shrink_joined, w->shrink_done,
                                                      w->timeout_seconds);
  if (refused != EPX_SUCCESS) return refused;
  mine->shrink_joined = 1;
  /* Ranks still in a collective of the old comm leave it and come here. */
  if (!w->failed)
    shm_fail_locked(w, w->generation, EPX_ERROR_PEER_FAILED, caller, "rank %d shrank the comm",
                    comm->rank);
  shm_wake_all(w);
  int bounded = shm_bounded(w->timeout_seconds);
  double deadline = shm_now() + (bounded ? w->timeout_seconds : 0);
  while (!w->shrink_done) {
    double now = shm_now();
    if (shm_shrink_settled_locked(st) || (bounded && now >= deadline)) {
      w->shrink_done = 1;
      shm_wake_all(w);
      break;
    }
    double left = bounded ? deadline - now : SHM_SLICE_SECONDS;
    epx_status_t locked = shm_nap_locked(st, comm->rank, caller, left);
    if (locked != EPX_SUCCESS) return locked;
  }
  return EPX_SUCCESS;
}

static epx_status_t shm_shrink(epx_comm_t comm, const char *caller, double timeout_seconds,
                               int32_t ranks_per_node, uint8_t *lost, epx_comm_t *survivor) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  comm->failed = 1;
  epx_status_t status = shm_lock(st, comm->rank, caller);
  if (status == EPX_SUCCESS) status = shm_shrink_join_locked(comm, caller);
  int32_t rank = 0, size = 0;
  for (int32_t p = 0; status == EPX_SUCCESS && p < w->size; p++) {
    lost[p] = !w->slots[p].shrink_joined;
    size += !lost[p];
    rank += p < comm->rank && !lost[p];
  }
  shm_unlock(st);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(ranks_per_node == 0 || size % ranks_per_node == 0,
              "%s: config->ranks_per_node is %d, which does not divide the %d survivors; pass a "
              "divisor of it, or 0", caller, ranks_per_node, size);
  return shm_create(caller, st->base, st->shrinks + 1, rank, size, timeout_seconds,
                    ranks_per_node, survivor);
}

void epx_comm_shm_test_hold_lock(epx_comm_t comm) {
  shm_lock(comm->impl, comm->rank, "epx_comm_shm_test_hold_lock");
}

/* ------------------------------------------------------------------------ */
/* The active-rank mask (epx_ll_mask_rank)                                   */
/* ------------------------------------------------------------------------ */

/* As the local transport's (comm/local.c), in the control segment: a masked
 * slot is neither waited for (live counts the others) nor read, and its
 * process ending is not a failure. Each survivor masks; the first to find
 * the world's failure naming only masked ranks clears it and starts a fresh
 * barrier. A survivor still asleep in the failed barrier is not waited for
 * (a killed one never wakes): the failed barrier is marked voided in the
 * slot of every rank that reached it, and on waking such a survivor returns
 * the failure, not the fresh barrier's start (shm_wait_locked), while one
 * still asleep in a barrier that completed before the failure returns that
 * success and gets the failure at its next barrier; a survivor
 * that was outside the barriers when the failure came and went gets it at
 * its next barrier (shm_check_failed_locked), so every survivor fails the
 * same step and masks before the next. */

/* 1 when the world's failure named ranks and every one of them is masked,
 * `also` (-1: none) counted as masked (under lock): the failure was theirs
 * alone. */
static int shm_failure_masked_locked(const shm_world_t *w, int32_t also) {
  int named = 0;
  for (int32_t p = 0; p < w->size; p++) {
    if (!w->slots[p].suspect) continue;
    if (!w->slots[p].masked && p != also) return 0;
    named = 1;
  }
  return named;
}

/* A survivor other than `self` and `skip` (attached, not masked, its
 * process alive) that passed a gather and has not reached its release, so may still read
 * its peers' data segments, or -1 (under lock). One waiting at the current
 * (failed) barrier reads nothing: that barrier is voided for it. */
static int32_t shm_reader_locked(const shm_state_t *st, int32_t self, int32_t skip) {
  const shm_world_t *w = st->world;
  for (int32_t p = 0; p < w->size; p++) {
    const shm_slot_t *slot = &w->slots[p];
    if (p == self || p == skip || !slot->attached || slot->masked || !slot->reading ||
        slot->arrived == w->generation + 1)
      continue;
    if (!shm_process_gone(st, slot->pid, slot->pid_ns)) return p;
  }
  return -1;
}

static epx_status_t shm_mask(epx_comm_t comm, const char *caller, int32_t rank, int masked) {
  shm_state_t *st = comm->impl;
  shm_world_t *w = st->world;
  epx_status_t status = shm_lock(st, comm->rank, caller);
  if (status != EPX_SUCCESS) return status;
  /* Before the survivors meet again, every survivor still reading the
   * failed collective's data reaches its release (and gets the failure
   * there): a fresh collective rewrites the data segments. Waited for
   * before the mask is applied: on a timeout nothing changed. */
  int bounded = shm_bounded(w->timeout_seconds);
  double deadline = shm_now() + (bounded ? w->timeout_seconds : 0);
  int32_t reader, masking = masked ? rank : -1;
  while (w->failed && shm_failure_masked_locked(w, masking) &&
         (reader = shm_reader_locked(st, comm->rank, masking)) >= 0) {
    double left = bounded ? deadline - shm_now() : SHM_SLICE_SECONDS;
    if (left <= 0) {
      shm_unlock(st);
      return epx_error(EPX_ERROR_TIMEOUT,
                       "%s: rank %d did not leave the failed collective (%s) within %g s (comm "
                       "timeout_seconds): its process is stopped or stuck; the survivors cannot "
                       "meet again",
                       caller, reader, shm_op_names[w->slots[reader].op], w->timeout_seconds);
    }
    status = shm_nap_locked(st, comm->rank, caller, left);
    if (status != EPX_SUCCESS) return status;
  }
  shm_slot_t *slot = &w->slots[rank];
  if (slot->masked != masked) {
    slot->masked = masked;
    w->live += masked ? -1 : 1;
    /* A masked rank waiting at the current barrier leaves it. */
    if (masked && slot->arrived == w->generation + 1 && w->arrived > 0) {
      slot->arrived = 0;
      w->arrived--;
    }
    if (!masked) slot->suspect = 0;
    shm_wake_all(w);
  }
  if (w->failed && shm_failure_masked_locked(w, -1)) {
    /* The survivors meet at a fresh barrier: the failed one's arrivals are
     * void, and so is the barrier for each rank that reached it. */
    for (int32_t p = 0; p < w->size; p++)
      if (w->slots[p].arrived == w->generation + 1) w->slots[p].voided = w->generation + 1;
    w->failed = 0;
    w->arrived = 0;
    w->generation++;
    shm_wake_all(w);
  } else if (!w->failed && w->arrived > 0 && w->arrived >= w->live) {
    /* The ranks already waiting were waiting only for the one now masked. */
    w->arrived = 0;
    w->generation++;
    shm_wake_all(w);
  }
  /* The next call tells the world as it is: on, or still failed (a failure
   * naming a rank not masked yet, or one that came since), naming why. */
  comm->failed = 0;
  shm_unlock(st);
  return EPX_SUCCESS;
}
