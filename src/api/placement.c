/* The placement calls on buffers and comms (epx.h, "Expert placement and
 * replicas"): the load counts, the replicas' gradient sum and the move of
 * expert weights to a new placement. The two collectives agree their
 * arguments first (one allgather: every rank's verdict and what it was
 * given), then move blocks with one alltoallv; the block lists are computed
 * from the placement tables alone, so sender and receiver agree on them
 * without exchanging them. */
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/objects.h"
#include "core/placement.h"
#include "core/transport.h"

epx_status_t epx_buffer_expert_load(epx_buffer_t buffer, int64_t *load, int32_t reset) {
  const char *fn = "epx_buffer_expert_load";
  epx_error_clear();
  epx_status_t status = epx_check_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(load, "%s: load is NULL; pass an int64_t array of num_experts (%d)", fn, buffer->config.num_experts);
  if (!buffer->backend->expert_load)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: this %s buffer does not count its routes in this version (a low-latency CUDA buffer); "
                     "count them from the routing, or use a buffer without config.low_latency", fn,
                     buffer->backend->name);
  return buffer->backend->expert_load(buffer, load, reset);
}

/* ------------------------------------------------------------------------ */
/* Agreement                                                                 */
/* ------------------------------------------------------------------------ */

/* What a rank says before a block exchange: its verdict and its arguments. */
typedef struct {
  int64_t status;
  int64_t value[4];
} block_args_t;

/* Every rank's verdict and arguments (names[i] says what value[i] is);
 * a refusal or a difference fails every rank, naming the rank. */
static epx_status_t agree_args(epx_comm_t comm, const char *fn, epx_status_t local, const int64_t *values,
                               const char *const *names, int32_t count) {
  block_args_t mine = {local, {0}}, *all = calloc((size_t)comm->size, sizeof *all);
  if (!all) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  char message[1024];
  strncpy(message, epx_last_error(), sizeof message - 1);
  message[sizeof message - 1] = '\0';
  if (local == EPX_SUCCESS) memcpy(mine.value, values, sizeof(int64_t) * (size_t)count);
  epx_status_t status = epx_comm_check_alive(comm, fn);
  if (status == EPX_SUCCESS) status = comm->ops->allgather(comm, fn, &mine, all, sizeof mine);
  if (status == EPX_SUCCESS && local != EPX_SUCCESS) status = epx_error(local, "%s", message);
  for (int32_t r = 0; status == EPX_SUCCESS && r < comm->size; r++) {
    if (all[r].status != EPX_SUCCESS) {
      status = epx_error(EPX_ERROR_PEER_FAILED, "%s: rank %d refused its arguments (its epx_last_error says why)", fn, r);
      break;
    }
    for (int32_t i = 0; i < count; i++)
      if (all[r].value[i] != all[0].value[i]) {
        status = epx_error(EPX_ERROR_SHAPE_MISMATCH, "%s: rank %d has %s = %lld but rank 0 has %lld; every rank "
                           "passes the same %s", fn, r, names[i], (long long)all[r].value[i],
                           (long long)all[0].value[i], names[i]);
        break;
      }
  }
  free(all);
  return status;
}

/* The blocks of one exchange: count and first block per rank, both ways. */
typedef struct {
  int64_t *send_count, *send_displ, *recv_count, *recv_displ; /* [W] each */
  char *send, *recv;
} blocks_t;

static void blocks_free(blocks_t *b) {
  free(b->send_count), free(b->send_displ), free(b->recv_count), free(b->recv_displ);
  free(b->send), free(b->recv);
}

/* Counts given, allocates the displacements and the staging. */
static epx_status_t blocks_alloc(blocks_t *b, int32_t W, size_t block_bytes, const char *fn) {
  int64_t sends = 0, recvs = 0;
  for (int32_t r = 0; r < W; r++) {
    b->send_displ[r] = sends, sends += b->send_count[r];
    b->recv_displ[r] = recvs, recvs += b->recv_count[r];
  }
  b->send = malloc((size_t)(sends ? sends : 1) * block_bytes);
  b->recv = malloc((size_t)(recvs ? recvs : 1) * block_bytes);
  if (!b->send || !b->recv) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory (%lld blocks of %zu bytes)", fn,
                                             (long long)(sends + recvs), block_bytes);
  return EPX_SUCCESS;
}

static epx_status_t blocks_counts(blocks_t *b, int32_t W, const char *fn) {
  b->send_count = calloc((size_t)W, sizeof(int64_t));
  b->send_displ = calloc((size_t)W, sizeof(int64_t));
  b->recv_count = calloc((size_t)W, sizeof(int64_t));
  b->recv_displ = calloc((size_t)W, sizeof(int64_t));
  if (!b->send_count || !b->send_displ || !b->recv_count || !b->recv_displ)
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  return EPX_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* The replicas' gradient sum                                                */
/* ------------------------------------------------------------------------ */

/* 1 when rank r holds a replica of logical expert e. */
static int holds(const epx_placement_table_t *t, int32_t r, int32_t e) {
  for (int32_t i = t->replica_first[e]; i < t->replica_first[e + 1]; i++)
    if (t->rank_of[t->replicas[i]] == r) return 1;
  return 0;
}

static int replicated(const epx_placement_table_t *t, int32_t e) {
  return t->replica_first[e + 1] - t->replica_first[e] > 1;
}

/* Rank `from` sends rank `to` each of its replicated physical experts (slot
 * order) whose logical expert `to` also holds. */
static int64_t grad_blocks(const epx_placement_table_t *t, int32_t from, int32_t to, const float *grads, size_t bytes,
                           char *dst) {
  int64_t n = 0;
  for (int32_t s = 0; s < t->per_rank; s++) {
    int32_t p = t->rank_experts[(int64_t)from * t->per_rank + s], e = t->logical_of[p];
    if (!replicated(t, e) || !holds(t, to, e)) continue;
    if (dst) memcpy(dst + (size_t)n * bytes, (const char *)grads + (size_t)s * bytes, bytes);
    n++;
  }
  return n;
}

/* grads' replicated slots summed over the replicas, ascending physical id,
 * into sum [per_rank, count] from the original values, then copied back. */
static void grad_sums(const epx_placement_table_t *t, int32_t self, float *grads, int64_t count, const char *recv,
                      const int64_t *recv_index, float *sum) {
  size_t bytes = sizeof(float) * (size_t)count;
  for (int32_t s = 0; s < t->per_rank; s++) {
    int32_t e = t->logical_of[t->rank_experts[(int64_t)self * t->per_rank + s]];
    if (!replicated(t, e)) continue;
    float *acc = sum + (size_t)s * (size_t)count;
    for (int32_t i = t->replica_first[e]; i < t->replica_first[e + 1]; i++) {
      int32_t q = t->replicas[i];
      const float *g = t->rank_of[q] == self ? grads + (size_t)t->slot_of[q] * (size_t)count
                                             : (const float *)(recv + (size_t)recv_index[q] * bytes);
      if (i == t->replica_first[e]) memcpy(acc, g, bytes);
      else for (int64_t j = 0; j < count; j++) acc[j] += g[j];
    }
  }
  for (int32_t s = 0; s < t->per_rank; s++) {
    int32_t e = t->logical_of[t->rank_experts[(int64_t)self * t->per_rank + s]];
    if (replicated(t, e)) memcpy(grads + (size_t)s * (size_t)count, sum + (size_t)s * (size_t)count, bytes);
  }
}

/* The exchange of replica gradients: counts, blocks packed by sender, the
 * received blocks' index by physical id. */
static epx_status_t grad_exchange(epx_comm_t comm, const epx_placement_table_t *t, float *grads, int64_t count,
                                  const char *fn) {
  int32_t W = comm->size, self = comm->rank;
  size_t bytes = sizeof(float) * (size_t)count;
  blocks_t b = {0};
  int64_t *recv_index = malloc(sizeof(int64_t) * (size_t)t->num_physical);
  float *sum = malloc((size_t)t->per_rank * bytes + 1);
  epx_status_t status = blocks_counts(&b, W, fn);
  if (status == EPX_SUCCESS && (!recv_index || !sum))
    status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  if (status != EPX_SUCCESS) goto fail;
  for (int32_t r = 0; r < W; r++) {
    if (r == self) continue;
    b.send_count[r] = grad_blocks(t, self, r, NULL, bytes, NULL);
    b.recv_count[r] = grad_blocks(t, r, self, NULL, bytes, NULL);
  }
  EPX_CHECK(blocks_alloc(&b, W, bytes, fn));
  for (int32_t r = 0; r < W; r++)
    if (r != self) grad_blocks(t, self, r, grads, bytes, b.send + (size_t)b.send_displ[r] * bytes);
  EPX_CHECK(comm->ops->alltoallv(comm, fn, b.send, b.send_count, b.send_displ, b.recv, b.recv_count, b.recv_displ,
                                 bytes));
  for (int32_t r = 0; r < W; r++) {
    if (r == self) continue;
    int64_t n = b.recv_displ[r];
    for (int32_t s = 0; s < t->per_rank; s++) {
      int32_t p = t->rank_experts[(int64_t)r * t->per_rank + s], e = t->logical_of[p];
      if (replicated(t, e) && holds(t, self, e)) recv_index[p] = n++;
    }
  }
  grad_sums(t, self, grads, count, b.recv, recv_index, sum);
fail:
  blocks_free(&b);
  free(recv_index), free(sum);
  return status;
}

epx_status_t epx_replica_grad_sum(epx_buffer_t buffer, float *grads, int64_t count) {
  const char *fn = "epx_replica_grad_sum";
  epx_error_clear();
  epx_status_t status = epx_check_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  epx_comm_t comm = buffer->comm;
  epx_status_t local = EPX_SUCCESS;
  if (buffer->config.device != EPX_DEVICE_CPU)
    local = epx_error(EPX_ERROR_UNSUPPORTED, "%s: the buffer is a %s buffer; this version sums host gradients over a "
                      "CPU buffer's comm", fn, buffer->backend->name);
  else if (count < 0 || (count > 0 && !grads) || count > INT64_MAX / 4 / (buffer->experts_per_rank + 1))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: grads is %p with count %lld; pass the [E_local = %d, count] "
                      "float32 gradients, count >= 0", fn, (void *)grads, (long long)count, buffer->experts_per_rank);
  int64_t values[1] = {count};
  static const char *const names[] = {"count"};
  status = agree_args(comm, fn, local, values, names, 1);
  if (status != EPX_SUCCESS || count == 0) return status;
  return grad_exchange(comm, buffer->placement, grads, count, fn);
}

/* ------------------------------------------------------------------------ */
/* The move to a new placement                                               */
/* ------------------------------------------------------------------------ */

/* The physical expert of `from` whose block physical expert p of `to`
 * takes (epx.h): a replica of its logical expert on p's rank, the lowest
 * one, else the lowest-numbered replica. */
static int32_t move_source(const epx_placement_table_t *from, const epx_placement_table_t *to, int32_t p) {
  int32_t e = to->logical_of[p], r = to->rank_of[p];
  for (int32_t i = from->replica_first[e]; i < from->replica_first[e + 1]; i++)
    if (from->rank_of[from->replicas[i]] == r) return from->replicas[i];
  return from->replicas[from->replica_first[e]];
}

/* Rank `src_rank` sends rank `dst_rank` the blocks of dst_rank's new
 * physical experts (slot order) that it is the source of. */
static int64_t move_blocks(const epx_placement_table_t *from, const epx_placement_table_t *to, int32_t src_rank,
                           int32_t dst_rank, const char *src, size_t bytes, char *dst) {
  int64_t n = 0;
  for (int32_t s = 0; s < to->per_rank; s++) {
    int32_t q = move_source(from, to, to->rank_experts[(int64_t)dst_rank * to->per_rank + s]);
    if (from->rank_of[q] != src_rank) continue;
    if (dst) memcpy(dst + (size_t)n * bytes, src + (size_t)from->slot_of[q] * bytes, bytes);
    n++;
  }
  return n;
}

static epx_status_t move_exchange(epx_comm_t comm, const epx_placement_table_t *from, const epx_placement_table_t *to,
                                  size_t bytes, const char *src, char *dst, const char *fn) {
  int32_t W = comm->size, self = comm->rank;
  blocks_t b = {0};
  epx_status_t status = blocks_counts(&b, W, fn);
  if (status != EPX_SUCCESS) goto fail;
  for (int32_t r = 0; r < W; r++) {
    if (r == self) continue;
    b.send_count[r] = move_blocks(from, to, self, r, NULL, bytes, NULL);
    b.recv_count[r] = move_blocks(from, to, r, self, NULL, bytes, NULL);
  }
  EPX_CHECK(blocks_alloc(&b, W, bytes, fn));
  for (int32_t r = 0; r < W; r++)
    if (r != self) move_blocks(from, to, self, r, src, bytes, b.send + (size_t)b.send_displ[r] * bytes);
  EPX_CHECK(comm->ops->alltoallv(comm, fn, b.send, b.send_count, b.send_displ, b.recv, b.recv_count, b.recv_displ,
                                 bytes));
  int64_t *next = b.recv_displ; /* each source's next block, in the receiver's slot order */
  for (int32_t s = 0; s < to->per_rank; s++) {
    int32_t q = move_source(from, to, to->rank_experts[(int64_t)self * to->per_rank + s]), r = from->rank_of[q];
    const char *block = r == self ? src + (size_t)from->slot_of[q] * bytes : b.recv + (size_t)next[r]++ * bytes;
    memcpy(dst + (size_t)s * bytes, block, bytes);
  }
fail:
  blocks_free(&b);
  return status;
}

epx_status_t epx_placement_move(epx_comm_t comm, int32_t num_experts, const epx_placement_t *from,
                                const epx_placement_t *to, size_t block_bytes, const void *src, void *dst) {
  const char *fn = "epx_placement_move";
  epx_error_clear();
  epx_status_t checked = epx_check_comm(&comm, fn);
  if (checked != EPX_SUCCESS) return checked;
  epx_placement_table_t *a = NULL, *b = NULL;
  epx_status_t local = EPX_SUCCESS;
  if (num_experts < 1) local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: num_experts is %d; pass >= 1", fn, num_experts);
  if (local == EPX_SUCCESS) local = epx_placement_table_new(fn, "from", from, num_experts, comm->size, &a);
  if (local == EPX_SUCCESS) local = epx_placement_table_new(fn, "to", to, num_experts, comm->size, &b);
  if (local == EPX_SUCCESS && block_bytes > 0 && (!src || !dst))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: src (%p) and dst (%p) must be host memory of the "
                      "[P / W, block_bytes] blocks", fn, src, dst);
  int64_t values[4] = {num_experts, (int64_t)block_bytes, a ? (int64_t)a->hash : 0, b ? (int64_t)b->hash : 0};
  static const char *const names[] = {"num_experts", "block_bytes", "from (a hash of its maps)",
                                      "to (a hash of its maps)"};
  epx_status_t status = agree_args(comm, fn, local, values, names, 4);
  if (status == EPX_SUCCESS && block_bytes > 0) status = move_exchange(comm, a, b, block_bytes, src, dst, fn);
  epx_placement_table_free(a);
  epx_placement_table_free(b);
  return status;
}
