/* The MPI transport: every collective as point-to-point messages, one to and
 * one from each peer, on a duplicate of the caller's communicator.
 *
 * Why messages and not MPI's collectives:
 *  - A timeout can name the ranks. Each receive is its own request, polled
 *    with MPI_Testsome until the comm's timeout; the peers whose message has
 *    not arrived by then are the ranks named (a pending collective says only
 *    that someone is missing).
 *  - Errors stay on the duplicate. Every request here belongs to the
 *    duplicate, which has MPI_ERRORS_RETURN, so an error — a truncated
 *    message, a failure the transport notices — comes back as a code whatever
 *    handler the caller's communicator has. (OpenMPI's nonblocking
 *    collectives raised a peer's truncation on MPI_COMM_WORLD, whose default
 *    handler aborts the job.) Only MPI_Comm_idup runs on the caller's
 *    communicator.
 *  - Nothing received is trusted: each receive is sized for what this rank
 *    expects, a longer message is MPI_ERR_TRUNCATE (caught as above) and a
 *    shorter one is caught by its count; either names the peer and fails the
 *    comm, so ranks in different collectives (or that disagree on a size)
 *    fail instead of reading garbage.
 *  - Messages carry a tag of the collective's sequence number and kind, so
 *    one collective's messages never match another's receives.
 *
 * What MPI's runtime does is beyond this file: without ULFM, OpenMPI's
 * mpirun kills every process of the job when one dies abnormally (kill -9, a
 * crash), so the survivors get no status at all. Under a runtime that lets
 * them live on, a dead peer's receive either fails (EPX_ERROR_TRANSPORT,
 * naming the rank) or never completes (EPX_ERROR_TIMEOUT, naming it).
 *
 * After a timeout or an error the comm is failed: the receives still pending
 * are cancelled, the sends still pending are left to MPI (a peer that wakes up
 * later may still read them), and the state, the duplicate and its datatype
 * are kept for the life of the process rather than freed under MPI (a few
 * hundred bytes per failed comm). */
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "core/error.h"

/* Tags: (sequence mod TAG_SEQUENCES) * OP_KINDS + kind, below 32767, the
 * smallest MPI_TAG_UB MPI allows. Ranks are at most one collective apart
 * (each waits for every peer's message), so the sequence never aliases. */
enum { OP_ALLTOALL, OP_ALLTOALLV, OP_ALLGATHER, OP_ALLREDUCE, OP_BARRIER, OP_KINDS };
#define TAG_SEQUENCES (32767 / OP_KINDS)
static const char *const op_names[OP_KINDS] = {"alltoall", "alltoallv", "allgather", "allreduce",
                                               "barrier"};

typedef struct mpi_state {
  MPI_Comm comm;          /* the duplicate */
  MPI_Datatype unit_type; /* `unit_bytes` contiguous bytes, for alltoallv */
  size_t unit_bytes;      /* 0: unit_type not made yet */
  uint32_t sequence;      /* collectives started on this comm */
  /* Per collective, [size] each: what goes to and comes from each peer. */
  int *send_counts, *recv_counts;
  MPI_Aint *send_offsets, *recv_offsets; /* bytes from the send / recv base */
  MPI_Request *requests;                 /* [2 * size]: receives, then sends */
  MPI_Status *statuses;                  /* [2 * size] */
  int *completed;                        /* [2 * size], for MPI_Testsome */
  int64_t *gathered;                     /* allreduce's [size, count] */
  int32_t gathered_count;
  int abandoned; /* sends still pending after a failure use this state */
  int32_t *notice; /* [size] this rank's timeout notice (NOTICE_TAG), once sent */
  char reason[MPI_MAX_ERROR_STRING + 512]; /* why the comm failed */
  struct mpi_state *next_abandoned;
} mpi_state_t;

/* One collective's description for mpi_exchange: peer p gets send_counts[p]
 * units of `type` from send + send_offsets[p] and this rank expects
 * recv_counts[p] units at recv + recv_offsets[p] (state's arrays). */
typedef struct {
  const char *caller;
  int kind;
  MPI_Datatype type;
  size_t unit;
  const char *send;
  char *recv;
} exchange_t;

static pthread_mutex_t abandoned_lock = PTHREAD_MUTEX_INITIALIZER;
static mpi_state_t *abandoned_states;

static void mpi_keep_abandoned(mpi_state_t *state) {
  pthread_mutex_lock(&abandoned_lock);
  state->next_abandoned = abandoned_states;
  abandoned_states = state;
  pthread_mutex_unlock(&abandoned_lock);
}

static double mpi_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static epx_status_t mpi_check_alive(epx_comm_t comm, const char *caller) {
  mpi_state_t *state = comm->impl;
  if (!comm->failed) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_PEER_FAILED,
                   "%s: the comm failed earlier: %s; destroy it and create a new one", caller,
                   state->reason);
}

/* Fails the comm with `status` and the message (also kept as its reason). */
static epx_status_t mpi_fail_with(epx_comm_t comm, epx_status_t status, const char *caller,
                                  const char *text) {
  mpi_state_t *state = comm->impl;
  comm->failed = 1;
  snprintf(state->reason, sizeof state->reason, "%s", text);
  return epx_error(status, "%s: %s; the comm is now failed (later calls return "
                   "EPX_ERROR_PEER_FAILED), destroy it", caller, text);
}

/* An MPI error code as EPX_ERROR_TRANSPORT; the comm is failed. */
static epx_status_t mpi_fail(epx_comm_t comm, const char *caller, const char *call, int code) {
  char text[MPI_MAX_ERROR_STRING], message[MPI_MAX_ERROR_STRING + 128];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    snprintf(text, sizeof text, "MPI error code %d", code);
  snprintf(message, sizeof message, "%s returned \"%s\" (MPI error)", call, text);
  return mpi_fail_with(comm, EPX_ERROR_TRANSPORT, caller, message);
}

/* Lists the ranks p (up to 16) for which pending(state, p) holds. */
static int32_t mpi_list_ranks(const mpi_state_t *state, int32_t size, int sends, char *out,
                              size_t out_size) {
  size_t used = 0;
  int32_t count = 0;
  out[0] = '\0';
  for (int32_t p = 0; p < size; p++) {
    if (state->requests[(sends ? size : 0) + p] == MPI_REQUEST_NULL) continue;
    if (count++ < 16 && used < out_size) {
      int n = snprintf(out + used, out_size - used, "%s%d", count > 1 ? ", " : "", p);
      if (n > 0) used += (size_t)n;
    }
  }
  if (count > 16 && used < out_size) snprintf(out + used, out_size - used, ", ... (%d in all)", count);
  return count;
}

/* Cancels the receives still pending (their buffers are the caller's, so
 * nothing may land there later) and leaves the sends to MPI; the state is
 * kept from then on (see the top of the file). */
static void mpi_abandon(epx_comm_t comm) {
  mpi_state_t *state = comm->impl;
  for (int32_t i = 0; i < 2 * comm->size; i++) {
    if (state->requests[i] == MPI_REQUEST_NULL) continue;
    if (i < comm->size) {
      MPI_Cancel(&state->requests[i]);
      MPI_Wait(&state->requests[i], MPI_STATUS_IGNORE); /* local once cancelled */
    } else {
      MPI_Request_free(&state->requests[i]);
      state->abandoned = 1;
    }
  }
}

/* A rank that times out tells its peers which ranks it was missing: [size]
 * int32 flags under NOTICE_TAG, above every collective's tag. A peer that
 * times out later (one collective further on, say, past a rank that then
 * stopped) can so tell a rank that was only blocked behind another from the
 * one that did not arrive. The buffer lives in the state, which a failed
 * comm keeps; the sends are left to MPI. */
#define NOTICE_TAG 32766

static void mpi_send_notices(epx_comm_t comm, const uint8_t *missing) {
  mpi_state_t *state = comm->impl;
  state->notice = malloc(sizeof(int32_t) * (size_t)comm->size);
  if (!state->notice) return;
  for (int32_t p = 0; p < comm->size; p++) state->notice[p] = missing[p];
  for (int32_t p = 0; p < comm->size; p++) {
    MPI_Request request;
    if (p != comm->rank && MPI_Isend(state->notice, comm->size, MPI_INT32_T, p, NOTICE_TAG,
                                     state->comm, &request) == MPI_SUCCESS)
      MPI_Request_free(&request);
  }
  state->abandoned = 1;
}

/* What the peers' notices say, into the view of epx_comm_timeout_text:
 * flags [5, size] = missing, waiting, behind, also, also_behind. */
static void mpi_note(int32_t size, int32_t me, int32_t from, const int32_t *notice,
                     uint8_t *flags) {
  uint8_t *missing = flags, *waiting = flags + size, *behind = flags + 2 * size;
  uint8_t *also = flags + 3 * size, *also_behind = flags + 4 * size;
  const int only_others = !notice[me]; /* it was not waiting for this rank */
  if (missing[from]) waiting[from] = (uint8_t)only_others;
  else also[from] = 1;
  for (int32_t q = 0; q < size; q++) {
    if (!notice[q]) continue;
    if (!missing[from]) also_behind[q] = 1;
    else if (only_others) behind[q] = 1;
  }
}

/* Reads the notices that came, and waits up to `grace` seconds for those of
 * the missing ranks not heard from yet (a peer blocked a call earlier times
 * out first, but its notice may trail this rank's deadline by a poll). */
static void mpi_read_notices(epx_comm_t comm, uint8_t *flags, int32_t *notice, double grace) {
  mpi_state_t *state = comm->impl;
  const int32_t size = comm->size;
  uint8_t *heard = flags + 5 * size;
  const double end = mpi_now() + grace;
  for (;;) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, NOTICE_TAG, state->comm, &flag, &status) != MPI_SUCCESS) return;
    if (flag) {
      const int from = status.MPI_SOURCE;
      if (MPI_Recv(notice, size, MPI_INT32_T, from, NOTICE_TAG, state->comm, MPI_STATUS_IGNORE) ==
              MPI_SUCCESS && from >= 0 && from < size) {
        heard[from] = 1;
        mpi_note(size, comm->rank, from, notice, flags);
      }
      continue;
    }
    int unheard = 0;
    for (int32_t p = 0; p < size; p++) unheard += flags[p] && !heard[p];
    if (!unheard || mpi_now() > end) return;
    struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
  }
}

/* Receives the notices left on a comm that did not fail itself (its peers
 * timed out while it was elsewhere), so that none outlives it. */
static void mpi_drain_notices(mpi_state_t *state, int32_t size) {
  int32_t *notice = malloc(sizeof(int32_t) * (size_t)size);
  int flag = 1;
  MPI_Status status;
  while (notice && flag &&
         MPI_Iprobe(MPI_ANY_SOURCE, NOTICE_TAG, state->comm, &flag, &status) == MPI_SUCCESS && flag)
    MPI_Recv(notice, size, MPI_INT32_T, status.MPI_SOURCE, NOTICE_TAG, state->comm,
             MPI_STATUS_IGNORE);
  free(notice);
}

/* The text of a timeout with receives still pending: the missing ranks, told
 * apart by the peers' notices (epx_comm_timeout_text). */
static void mpi_missing_text(epx_comm_t comm, const exchange_t *x, char *text, size_t size) {
  mpi_state_t *state = comm->impl;
  const int32_t W = comm->size;
  uint8_t *flags = calloc(6 * (size_t)W, 1);
  int32_t *notice = malloc(sizeof(int32_t) * (size_t)W);
  if (flags && notice) {
    for (int32_t p = 0; p < W; p++) flags[p] = state->requests[p] != MPI_REQUEST_NULL;
    mpi_send_notices(comm, flags);
    const double grace = comm->timeout_seconds / 4 < 0.25 ? comm->timeout_seconds / 4 : 0.25;
    mpi_read_notices(comm, flags, notice, grace);
    epx_comm_timeout_text(text, size, W, op_names[x->kind], comm->timeout_seconds, flags,
                          flags + W, flags + 2 * W, flags + 3 * W, flags + 4 * W);
  } else {
    char ranks[256];
    int32_t missing = mpi_list_ranks(state, W, 0, ranks, sizeof ranks);
    snprintf(text, size, "rank%s %s did not arrive within %g s (comm timeout_seconds)",
             missing > 1 ? "s" : "", ranks, comm->timeout_seconds);
  }
  free(flags);
  free(notice);
}

/* The comm's timeout expired: names the ranks whose message did not come
 * (or, when all came, the ranks that did not take this rank's). */
static epx_status_t mpi_timeout(epx_comm_t comm, const exchange_t *x) {
  mpi_state_t *state = comm->impl;
  char ranks[256], text[sizeof state->reason];
  int missing = 0;
  for (int32_t p = 0; p < comm->size; p++) missing |= state->requests[p] != MPI_REQUEST_NULL;
  if (missing)
    mpi_missing_text(comm, x, text, sizeof text);
  else
    snprintf(text, sizeof text, "rank%s %s did not take this rank's %s message within %g s "
             "(comm timeout_seconds)", mpi_list_ranks(state, comm->size, 1, ranks, sizeof ranks) > 1 ? "s" : "",
             ranks, op_names[x->kind], comm->timeout_seconds);
  mpi_abandon(comm);
  return mpi_fail_with(comm, EPX_ERROR_TIMEOUT, x->caller, text);
}

/* Checks the requests MPI_Testsome just completed: an error names its peer,
 * and each receive must have brought exactly the units this rank expects. */
static epx_status_t mpi_check_completed(epx_comm_t comm, const exchange_t *x, int outcount, int code) {
  mpi_state_t *state = comm->impl;
  for (int j = 0; j < outcount; j++) {
    int i = state->completed[j], peer = i % comm->size, is_recv = i < comm->size;
    MPI_Status *st = &state->statuses[j];
    int error = code == MPI_ERR_IN_STATUS ? st->MPI_ERROR : MPI_SUCCESS;
    char call[96];
    if (error != MPI_SUCCESS) {
      snprintf(call, sizeof call, "the %s of this %s %s rank %d", is_recv ? "receive" : "send",
               op_names[x->kind], is_recv ? "from" : "to", peer);
      epx_status_t status = mpi_fail(comm, x->caller, call, error);
      mpi_abandon(comm);
      return status;
    }
    int got = 0, bytes = 0;
    if (is_recv && (MPI_Get_count(st, x->type, &got) != MPI_SUCCESS || got != state->recv_counts[peer])) {
      char text[256];
      MPI_Get_count(st, MPI_BYTE, &bytes);
      snprintf(text, sizeof text, "rank %d sent %d bytes in this %s, where this rank expected %d units "
               "of %zu bytes: the ranks are not in the same collective call, or disagree on its sizes",
               peer, bytes, op_names[x->kind], state->recv_counts[peer], x->unit);
      mpi_abandon(comm);
      return mpi_fail_with(comm, EPX_ERROR_TRANSPORT, x->caller, text);
    }
  }
  return EPX_SUCCESS;
}

/* Polls the requests until all complete, an error, or the timeout (<= 0:
 * none). Spins briefly for latency, then lets peers on the same cores run. */
static epx_status_t mpi_complete(epx_comm_t comm, const exchange_t *x) {
  mpi_state_t *state = comm->impl;
  const double timeout = comm->timeout_seconds;
  const double deadline = timeout > 0 ? mpi_now() + timeout : 0;
  for (long polls = 0;; polls++) {
    int outcount = 0;
    int code = MPI_Testsome(2 * comm->size, state->requests, &outcount, state->completed,
                            state->statuses);
    if (code != MPI_SUCCESS && code != MPI_ERR_IN_STATUS) {
      epx_status_t status = mpi_fail(comm, x->caller, "MPI_Testsome", code);
      mpi_abandon(comm);
      return status;
    }
    if (outcount == MPI_UNDEFINED) return EPX_SUCCESS; /* nothing left pending */
    epx_status_t status = mpi_check_completed(comm, x, outcount, code);
    if (status != EPX_SUCCESS) return status;
    if (timeout > 0 && (polls & 63) == 0 && mpi_now() > deadline) return mpi_timeout(comm, x);
    if (polls > 2000) {
      struct timespec pause = {0, 20000};
      nanosleep(&pause, NULL);
    }
  }
}

/* base + offset, leaving a NULL base (an empty message's) alone. */
static char *at(const char *base, MPI_Aint offset) { return base ? (char *)base + offset : NULL; }

/* Posts one receive from and one send to every peer, copies this rank's own
 * block, and waits for all of them (state's counts and offsets). */
static epx_status_t mpi_exchange(epx_comm_t comm, const exchange_t *x) {
  mpi_state_t *state = comm->impl;
  const int32_t size = comm->size, me = comm->rank;
  const int tag = (int)(state->sequence++ % TAG_SEQUENCES) * OP_KINDS + x->kind;
  for (int32_t i = 0; i < 2 * size; i++) state->requests[i] = MPI_REQUEST_NULL;
  for (int32_t p = 0; p < size; p++) {
    if (p == me) continue;
    const char *call = "MPI_Irecv";
    int code = MPI_Irecv(at(x->recv, state->recv_offsets[p]), state->recv_counts[p], x->type, p, tag,
                         state->comm, &state->requests[p]);
    if (code == MPI_SUCCESS) {
      call = "MPI_Isend";
      code = MPI_Isend(at(x->send, state->send_offsets[p]), state->send_counts[p], x->type, p, tag,
                       state->comm, &state->requests[size + p]);
    }
    if (code != MPI_SUCCESS) {
      epx_status_t status = mpi_fail(comm, x->caller, call, code);
      mpi_abandon(comm);
      return status;
    }
  }
  if (state->send_counts[me] != state->recv_counts[me]) {
    mpi_abandon(comm);
    return mpi_fail_with(comm, EPX_ERROR_INTERNAL, x->caller, "this rank's own block differs in size "
                         "between what it sends and what it receives");
  }
  char *own = at(x->recv, state->recv_offsets[me]);
  if (state->send_counts[me] > 0 && own != at(x->send, state->send_offsets[me]))
    memmove(own, at(x->send, state->send_offsets[me]), (size_t)state->send_counts[me] * x->unit);
  return mpi_complete(comm, x);
}

/* ------------------------------------------------------------------------ */
/* The transport's operations                                                */
/* ------------------------------------------------------------------------ */

static epx_status_t mpi_check_int(const char *caller, const char *what, int32_t index,
                                  int64_t value) {
  if (value >= 0 && value <= INT_MAX) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: %s[%d] is %lld units, outside MPI's int range [0, %d]; move fewer rows "
                   "per call (nothing was sent)",
                   caller, what, index, (long long)value, INT_MAX);
}

static epx_status_t mpi_check_bytes(const char *caller, const char *op, size_t bytes) {
  if (bytes <= (size_t)INT_MAX) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                   "%s: %s block of %zu bytes exceeds MPI's int count (%d); move less per call "
                   "(nothing was sent)",
                   caller, op, bytes, INT_MAX);
}

/* Blocks of `bytes`: to peer p from send + p * send_stride, from peer p to
 * recv + p * bytes (alltoall: send_stride = bytes; allgather: 0). */
static epx_status_t mpi_blocks(epx_comm_t comm, const char *caller, int kind, const void *send,
                               size_t send_stride, void *recv, size_t bytes) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status == EPX_SUCCESS) status = mpi_check_bytes(caller, op_names[kind], bytes);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  for (int32_t p = 0; p < comm->size; p++) {
    state->send_counts[p] = state->recv_counts[p] = (int)bytes;
    state->send_offsets[p] = (MPI_Aint)(p * send_stride);
    state->recv_offsets[p] = (MPI_Aint)(p * bytes);
  }
  exchange_t x = {caller, kind, MPI_BYTE, 1, send, recv};
  return mpi_exchange(comm, &x);
}

static epx_status_t mpi_alltoall(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                 size_t bytes) {
  return mpi_blocks(comm, caller, OP_ALLTOALL, send, bytes, recv, bytes);
}

static epx_status_t mpi_allgather(epx_comm_t comm, const char *caller, const void *send, void *recv,
                                  size_t bytes) {
  return mpi_blocks(comm, caller, OP_ALLGATHER, send, 0, recv, bytes);
}

/* Counts stay int by counting in a contiguous datatype of `unit` bytes. */
static epx_status_t mpi_alltoallv(epx_comm_t comm, const char *caller, const void *send,
                                  const int64_t *send_counts, const int64_t *send_displs,
                                  void *recv, const int64_t *recv_counts,
                                  const int64_t *recv_displs, size_t unit) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  if (unit == 0 || unit > (size_t)INT_MAX)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: alltoallv unit is %zu bytes; pass 1 <= unit <= %d (nothing was sent)",
                     caller, unit, INT_MAX);
  for (int32_t r = 0; r < comm->size; r++) {
    if ((status = mpi_check_int(caller, "send_counts", r, send_counts[r])) ||
        (status = mpi_check_int(caller, "send_displs", r, send_displs[r])) ||
        (status = mpi_check_int(caller, "recv_counts", r, recv_counts[r])) ||
        (status = mpi_check_int(caller, "recv_displs", r, recv_displs[r])))
      return status;
  }
  if (state->unit_bytes != unit) {
    MPI_Datatype type;
    int code = MPI_Type_contiguous((int)unit, MPI_BYTE, &type);
    if (code == MPI_SUCCESS) code = MPI_Type_commit(&type);
    if (code != MPI_SUCCESS) return mpi_fail(comm, caller, "MPI_Type_contiguous", code);
    if (state->unit_bytes) MPI_Type_free(&state->unit_type); /* pending sends keep it alive */
    state->unit_type = type;
    state->unit_bytes = unit;
  }
  for (int32_t p = 0; p < comm->size; p++) {
    state->send_counts[p] = (int)send_counts[p];
    state->recv_counts[p] = (int)recv_counts[p];
    state->send_offsets[p] = (MPI_Aint)((size_t)send_displs[p] * unit);
    state->recv_offsets[p] = (MPI_Aint)((size_t)recv_displs[p] * unit);
  }
  exchange_t x = {caller, OP_ALLTOALLV, state->unit_type, unit, send, recv};
  return mpi_exchange(comm, &x);
}

/* Gathers every rank's values and takes the maximum here. A negative count
 * goes to MPI as it is (MPI refuses it: EPX_ERROR_TRANSPORT). */
static epx_status_t mpi_allreduce_max_i64(epx_comm_t comm, const char *caller, int64_t *values,
                                          int32_t count) {
  epx_status_t status = mpi_check_alive(comm, caller);
  if (status != EPX_SUCCESS) return status;
  mpi_state_t *state = comm->impl;
  if (count > state->gathered_count) {
    int64_t *grown = realloc(state->gathered, (size_t)comm->size * (size_t)count * sizeof(int64_t));
    if (!grown) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for an all-reduce", caller);
    state->gathered = grown;
    state->gathered_count = count;
  }
  const size_t stride = count > 0 ? (size_t)count * sizeof(int64_t) : 0;
  for (int32_t p = 0; p < comm->size; p++) {
    state->send_counts[p] = state->recv_counts[p] = count;
    state->send_offsets[p] = 0;
    state->recv_offsets[p] = (MPI_Aint)(p * stride);
  }
  exchange_t x = {caller, OP_ALLREDUCE, MPI_INT64_T, sizeof(int64_t), (const char *)values,
                  (char *)state->gathered};
  status = mpi_exchange(comm, &x);
  if (status != EPX_SUCCESS) return status;
  for (int32_t p = 0; p < comm->size; p++)
    for (int32_t i = 0; i < count; i++)
      if (state->gathered[(size_t)p * (size_t)count + (size_t)i] > values[i])
        values[i] = state->gathered[(size_t)p * (size_t)count + (size_t)i];
  return EPX_SUCCESS;
}

static epx_status_t mpi_barrier(epx_comm_t comm, const char *caller) {
  return mpi_blocks(comm, caller, OP_BARRIER, NULL, 0, NULL, 0);
}

static void mpi_state_free(mpi_state_t *state) {
  free(state->send_counts);
  free(state->send_offsets);
  free(state->requests);
  free(state->statuses);
  free(state->completed);
  free(state->gathered);
  free(state->notice);
  free(state);
}

/* A failed comm keeps its duplicate: its peers may still send to it (their
 * part of the collective that failed here, or of their destroy's barrier),
 * and OpenMPI crashes when a message reaches a freed communicator whose
 * context id a new communicator has taken. */
static void mpi_destroy(epx_comm_t comm) {
  mpi_state_t *state = comm->impl;
  comm->impl = NULL;
  if (state->abandoned || comm->failed) {
    mpi_keep_abandoned(state);
    return;
  }
  mpi_drain_notices(state, comm->size);
  if (state->unit_bytes) MPI_Type_free(&state->unit_type);
  MPI_Comm_free(&state->comm);
  mpi_state_free(state);
}

static const epx_transport_ops_t mpi_ops = {
    .name = "mpi",
    .alltoall = mpi_alltoall,
    .alltoallv = mpi_alltoallv,
    .allgather = mpi_allgather,
    .allreduce_max_i64 = mpi_allreduce_max_i64,
    .barrier = mpi_barrier,
    .destroy = mpi_destroy,
};

/* The per-peer arrays of a comm of `size` ranks; 0 when out of memory. */
static int mpi_state_arrays(mpi_state_t *state, int size) {
  state->send_counts = malloc(2 * (size_t)size * sizeof(int));
  state->send_offsets = malloc(2 * (size_t)size * sizeof(MPI_Aint));
  state->requests = malloc(2 * (size_t)size * sizeof(MPI_Request));
  state->statuses = malloc(2 * (size_t)size * sizeof(MPI_Status));
  state->completed = malloc(2 * (size_t)size * sizeof(int));
  if (!state->send_counts || !state->send_offsets || !state->requests || !state->statuses ||
      !state->completed)
    return 0;
  state->recv_counts = state->send_counts + size;
  state->recv_offsets = state->send_offsets + size;
  for (int i = 0; i < 2 * size; i++) state->requests[i] = MPI_REQUEST_NULL;
  return 1;
}

/* Polls MPI_Comm_idup's request, bounded by the comm's timeout (the one
 * step that cannot name ranks: it runs on the caller's communicator). */
static epx_status_t mpi_wait_idup(epx_comm_t comm, const char *fn, MPI_Request *request) {
  const double timeout = comm->timeout_seconds;
  const double deadline = timeout > 0 ? mpi_now() + timeout : 0;
  for (long polls = 0;; polls++) {
    int done = 0;
    int code = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return mpi_fail(comm, fn, "MPI_Comm_idup", code);
    if (done) return EPX_SUCCESS;
    if (timeout > 0 && (polls & 63) == 0 && mpi_now() > deadline) {
      ((mpi_state_t *)comm->impl)->abandoned = 1;
      return mpi_fail_with(comm, EPX_ERROR_TIMEOUT, fn, "MPI_Comm_idup did not complete within the "
                           "comm's timeout_seconds: some rank of the caller's communicator has not "
                           "called epx_comm_create_mpi (MPI cannot say which)");
    }
    if (polls > 2000) {
      struct timespec pause = {0, 20000};
      nanosleep(&pause, NULL);
    }
  }
}

epx_status_t epx_comm_init_mpi(epx_comm_t comm, const void *mpi_comm) {
  const char *fn = "epx_comm_create_mpi";
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  EPX_REQUIRE(initialized && !finalized,
              "%s: MPI is not initialised (or already finalised); call MPI_Init before "
              "creating the comm and MPI_Finalize after destroying it",
              fn);
  MPI_Comm user = *(const MPI_Comm *)mpi_comm;
  EPX_REQUIRE(user != MPI_COMM_NULL,
              "%s: *mpi_comm is MPI_COMM_NULL; pass a valid communicator (MPI_COMM_WORLD)", fn);
  mpi_state_t *state = calloc(1, sizeof *state);
  if (!state) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  comm->impl = state;
  epx_status_t status = EPX_SUCCESS;
  int duplicated = 0, size = 0, rank = 0;
  /* Nonblocking, so a rank that never joins cannot hang the others here. */
  MPI_Request request;
  int code = MPI_Comm_idup(user, &state->comm, &request);
  if (code != MPI_SUCCESS) EPX_CHECK(mpi_fail(comm, fn, "MPI_Comm_idup", code));
  EPX_CHECK(mpi_wait_idup(comm, fn, &request));
  duplicated = 1;
  code = MPI_Comm_set_errhandler(state->comm, MPI_ERRORS_RETURN);
  if (code != MPI_SUCCESS) EPX_CHECK(mpi_fail(comm, fn, "MPI_Comm_set_errhandler", code));
  code = MPI_Comm_rank(state->comm, &rank);
  if (code == MPI_SUCCESS) code = MPI_Comm_size(state->comm, &size);
  if (code != MPI_SUCCESS) EPX_CHECK(mpi_fail(comm, fn, "MPI_Comm_size", code));
  if (!mpi_state_arrays(state, size)) EPX_FAIL(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d ranks", fn, size);
  comm->ops = &mpi_ops;
  comm->rank = rank;
  comm->size = size;
  return EPX_SUCCESS;
fail:
  if (duplicated) MPI_Comm_free(&state->comm);
  if (state->abandoned)
    mpi_keep_abandoned(state);
  else
    mpi_state_free(state);
  comm->impl = NULL;
  comm->failed = 0;
  return status;
}

/* MPI_Comm_split_type runs once, at creation, right after the duplicate
 * completed on every rank (so no rank is missing from it); the node's lowest
 * rank is read from the groups, with no further message. */
epx_status_t epx_comm_mpi_host_key(epx_comm_t comm, int64_t *key) {
  const char *fn = "epx_comm_create_mpi";
  mpi_state_t *state = comm->impl;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Group node_group = MPI_GROUP_NULL, all_group = MPI_GROUP_NULL;
  int leader = 0, lowest = 0;
  int code = MPI_Comm_split_type(state->comm, MPI_COMM_TYPE_SHARED, comm->rank, MPI_INFO_NULL, &node);
  if (code == MPI_SUCCESS) code = MPI_Comm_group(node, &node_group);
  if (code == MPI_SUCCESS) code = MPI_Comm_group(state->comm, &all_group);
  if (code == MPI_SUCCESS) code = MPI_Group_translate_ranks(node_group, 1, &leader, all_group, &lowest);
  if (node_group != MPI_GROUP_NULL) MPI_Group_free(&node_group);
  if (all_group != MPI_GROUP_NULL) MPI_Group_free(&all_group);
  if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
  if (code != MPI_SUCCESS) return mpi_fail(comm, fn, "MPI_Comm_split_type", code);
  *key = lowest;
  return EPX_SUCCESS;
}
