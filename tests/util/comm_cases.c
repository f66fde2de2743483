#include "comm_cases.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/transport.h"
#include "testutil.h"
#include "clock.h"

void cc_sleep_seconds(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - floor(seconds)) * 1e9)};
  nanosleep(&ts, NULL);
}

int cc_is_poisoned(const void *data, size_t bytes) {
  const unsigned char *p = data;
  for (size_t i = 0; i < bytes; i++)
    if (p[i] != 0xA5) return 0;
  return 1;
}

static uint64_t mix(uint64_t a, uint64_t b) {
  tu_rng_t rng = {a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull)};
  return tu_next(&rng);
}

/* Word k of unit i that src sends to dst in round `seed`: the first two words
 * say (src, dst) and i, the rest are a hash of all of them. */
static uint32_t word_of(uint64_t seed, int32_t src, int32_t dst, int64_t i, size_t k) {
  if (k == 0) return (uint32_t)src << 16 | (uint32_t)(dst & 0xffff);
  if (k == 1) return (uint32_t)i;
  return (uint32_t)mix(mix(mix(seed, (uint64_t)src), (uint64_t)dst * 1000003u + (uint64_t)i), k);
}

static void fill_units(uint32_t *words, size_t unit_words, int64_t units, uint64_t seed,
                       int32_t src, int32_t dst) {
  for (int64_t i = 0; i < units; i++)
    for (size_t k = 0; k < unit_words; k++)
      words[(size_t)i * unit_words + k] = word_of(seed, src, dst, i, k);
}

/* Checks units [0, count) of recv against word_of(seed, src, dst, .). */
static int units_match(const uint32_t *recv, size_t unit_words, int64_t count, uint64_t seed,
                       int32_t src, int32_t dst) {
  for (int64_t i = 0; i < count; i++)
    for (size_t k = 0; k < unit_words; k++)
      if (recv[(size_t)i * unit_words + k] != word_of(seed, src, dst, i, k)) {
        fprintf(stderr, "  from %d to %d: unit %lld word %zu is %08x, expected %08x\n", src, dst,
                (long long)i, k, recv[(size_t)i * unit_words + k], word_of(seed, src, dst, i, k));
        return 0;
      }
  return 1;
}

/* Counts of (src, dst) every rank can compute; about a quarter are zero. */
static int64_t pair_count(uint64_t seed, int32_t src, int32_t dst, int64_t max) {
  uint64_t v = mix(mix(seed, (uint64_t)src + 77), (uint64_t)dst + 991);
  return v % 4 == 0 ? 0 : (int64_t)((v >> 8) % (uint64_t)(max + 1));
}

static int64_t reduce_value(uint64_t seed, int32_t rank, int32_t i) {
  return (int64_t)mix(mix(seed, (uint64_t)rank + 5), (uint64_t)i);
}

/* alltoall, then allgather: a block of `bytes` per rank; the send buffer is
 * overwritten as soon as each call returns, so a peer still reading it would
 * see it. */
static int blocks_round(epx_comm_t comm, uint64_t seed, size_t block_words) {
  const int32_t rank = COMM(comm)->rank, size = COMM(comm)->size;
  const size_t bytes = block_words * 4;
  int failures = 0;
  uint32_t *send = tu_alloc(bytes * (size_t)size), *recv = tu_alloc(bytes * (size_t)size);
  for (int32_t d = 0; d < size; d++) fill_units(send + d * block_words, block_words, 1, seed, rank, d);
  tu_poison(recv, bytes * (size_t)size);
  RANK_OK(COMM(comm)->ops->alltoall(COMM(comm), "test_alltoall", send, recv, bytes));
  tu_poison(send, bytes * (size_t)size);
  for (int32_t s = 0; s < size; s++)
    RANK_EXPECT(units_match(recv + s * block_words, block_words, 1, seed, s, rank),
                "alltoall block from %d wrong", s);

  fill_units(send, block_words, 1, seed, rank, -1);
  tu_poison(recv, bytes * (size_t)size);
  RANK_OK(COMM(comm)->ops->allgather(COMM(comm), "test_allgather", send, recv, bytes));
  tu_poison(send, bytes);
  for (int32_t s = 0; s < size; s++)
    RANK_EXPECT(units_match(recv + s * block_words, block_words, 1, seed, s, -1),
                "allgather block %d wrong", s);
  tu_free(send);
  tu_free(recv);
  return failures;
}

/* alltoallv: random counts with zeros; one unused unit before every piece on
 * both sides, which must stay untouched. */
static int alltoallv_round(epx_comm_t comm, uint64_t seed, size_t unit_words, int64_t max_count) {
  const int32_t rank = COMM(comm)->rank, size = COMM(comm)->size;
  const size_t unit = unit_words * 4;
  int failures = 0;
  int64_t *counts = calloc(4 * (size_t)size, sizeof(int64_t));
  int64_t *send_counts = counts, *send_displs = counts + size;
  int64_t *recv_counts = counts + 2 * size, *recv_displs = counts + 3 * size;
  int64_t send_units = 0, recv_units = 0;
  for (int32_t r = 0; r < size; r++) {
    send_counts[r] = pair_count(seed, rank, r, max_count);
    send_displs[r] = send_units + 1;
    send_units += send_counts[r] + 1;
    recv_counts[r] = pair_count(seed, r, rank, max_count);
    recv_displs[r] = recv_units + 1;
    recv_units += recv_counts[r] + 1;
  }
  uint32_t *send = tu_alloc((size_t)send_units * unit), *copy = tu_alloc((size_t)send_units * unit);
  uint32_t *recv = tu_alloc((size_t)recv_units * unit);
  for (int32_t d = 0; d < size; d++)
    fill_units(send + (size_t)send_displs[d] * unit_words, unit_words, send_counts[d], seed, rank, d);
  memcpy(copy, send, (size_t)send_units * unit);
  tu_poison(recv, (size_t)recv_units * unit);
  RANK_OK(COMM(comm)->ops->alltoallv(COMM(comm), "test_alltoallv", send, send_counts, send_displs, recv,
                               recv_counts, recv_displs, unit));
  RANK_EXPECT(!memcmp(copy, send, (size_t)send_units * unit), "alltoallv changed its send buffer");
  tu_poison(send, (size_t)send_units * unit);
  for (int32_t s = 0; s < size; s++) {
    RANK_EXPECT(units_match(recv + (size_t)recv_displs[s] * unit_words, unit_words, recv_counts[s],
                            seed, s, rank),
                "alltoallv piece from %d (%lld units of %zu bytes) wrong", s,
                (long long)recv_counts[s], unit);
    RANK_EXPECT(cc_is_poisoned(recv + (size_t)(recv_displs[s] - 1) * unit_words, unit),
                "alltoallv wrote the gap before the piece from %d", s);
  }
  tu_free(send), tu_free(recv), tu_free(copy);
  free(counts);
  return failures;
}

/* allreduce max over signed values every rank can compute. */
static int allreduce_round(epx_comm_t comm, uint64_t seed, int32_t count) {
  const int32_t rank = COMM(comm)->rank, size = COMM(comm)->size;
  int failures = 0;
  int64_t *values = calloc((size_t)count, sizeof *values);
  for (int32_t i = 0; i < count; i++) values[i] = reduce_value(seed, rank, i);
  RANK_OK(COMM(comm)->ops->allreduce_max_i64(COMM(comm), "test_allreduce", values, count));
  for (int32_t i = 0; i < count; i++) {
    int64_t expected = reduce_value(seed, 0, i);
    for (int32_t r = 1; r < size; r++)
      if (reduce_value(seed, r, i) > expected) expected = reduce_value(seed, r, i);
    RANK_EXPECT(values[i] == expected, "allreduce value %d is %lld, expected %lld", i,
                (long long)values[i], (long long)expected);
  }
  free(values);
  return failures;
}

static int barrier_round(epx_comm_t comm, int round, atomic_int *arrivals) {
  const int32_t rank = COMM(comm)->rank, size = COMM(comm)->size;
  int failures = 0;
  if (arrivals) { /* every rank's arrival of this round is visible after it */
    atomic_fetch_add(arrivals, 1);
    RANK_OK(COMM(comm)->ops->barrier(COMM(comm), "test_barrier"));
    RANK_EXPECT(atomic_load(arrivals) >= size * (round + 1),
                "barrier returned after %d arrivals, expected >= %d", atomic_load(arrivals),
                size * (round + 1));
    return failures;
  }
  /* nobody leaves before the last rank, which arrives 0.1 s late */
  if (rank == size - 1) cc_sleep_seconds(0.1);
  double t0 = tu_seconds();
  RANK_OK(COMM(comm)->ops->barrier(COMM(comm), "test_barrier"));
  if (rank != size - 1)
    RANK_EXPECT(tu_seconds() - t0 > 0.05, "barrier returned after %.3f s, before the late rank",
                tu_seconds() - t0);
  return failures;
}

int cc_ops_round(epx_comm_t comm, int round, int big, atomic_int *arrivals) {
  const uint64_t seed = 1000 + (uint64_t)round;
  int failures = blocks_round(comm, seed, 2 + (size_t)(round % 3));
  if (!failures) failures += alltoallv_round(comm, seed, big ? 1024 : 3, big ? 64 : 9);
  if (!failures) failures += allreduce_round(comm, seed, 3 + round * 37);
  if (!failures) failures += barrier_round(comm, round, arrivals);
  return failures;
}

int cc_ops(epx_comm_t comm, int rounds, atomic_int *arrivals) {
  int32_t rank = COMM(comm)->rank, got_rank = -1, got_size = -1;
  int failures = 0;
  RANK_EXPECT(epx_comm_rank(comm, &got_rank) == EPX_SUCCESS && got_rank == rank,
              "epx_comm_rank gave %d", got_rank);
  RANK_EXPECT(epx_comm_size(comm, &got_size) == EPX_SUCCESS && got_size == COMM(comm)->size,
              "epx_comm_size gave %d", got_size);
  RANK_OK(epx_comm_check_alive(COMM(comm), "test"));
  /* 12-byte units in most rounds (not a power of two), 4 KiB rows with up to
   * 64 per pair (256 KiB blocks) in the last. */
  for (int round = 0; round < rounds && !failures; round++)
    failures += cc_ops_round(comm, round, round == rounds - 1, arrivals);
  return failures;
}

/* The later calls on a comm that failed: at once, saying where. */
static int after_failure(epx_comm_t comm, const cc_timeout_t *t) {
  const int32_t rank = COMM(comm)->rank;
  int failures = 0;
  double t0 = tu_seconds();
  RANK_STATUS(COMM(comm)->ops->barrier(COMM(comm), "test_after"), EPX_ERROR_PEER_FAILED,
              "test_after: the comm failed earlier");
  RANK_EXPECT(tu_message_has(t->named), "later message lacks \"%s\"", t->named);
  RANK_EXPECT(tu_seconds() - t0 < 0.25 * t->timeout + 0.1, "later barrier took %.3f s",
              tu_seconds() - t0);
  int64_t values[2] = {1, 2};
  t0 = tu_seconds();
  RANK_STATUS(COMM(comm)->ops->allreduce_max_i64(COMM(comm), "test_after", values, 2), EPX_ERROR_PEER_FAILED,
              "test_after:");
  RANK_EXPECT(tu_seconds() - t0 < 0.25 * t->timeout + 0.1, "later allreduce took %.3f s",
              tu_seconds() - t0);
  RANK_EXPECT(values[0] == 1 && values[1] == 2, "a refused allreduce changed its values");
  RANK_STATUS(epx_comm_check_alive(COMM(comm), "test_alive"), EPX_ERROR_PEER_FAILED, "test_alive:");
  return failures;
}

int cc_timeout_case(epx_comm_t comm, cc_timeout_t *t) {
  const int32_t rank = COMM(comm)->rank;
  int failures = 0;
  const int skipper = rank >= t->skip_from;
  if (!skipper) {
    uint32_t send[16], recv[16];
    tu_poison(send, sizeof send);
    tu_poison(recv, sizeof recv);
    double t0 = tu_seconds();
    epx_status_t status = t->barrier ? COMM(comm)->ops->barrier(COMM(comm), "test_timeout")
                                     : COMM(comm)->ops->alltoall(COMM(comm), "test_timeout", send, recv, 4);
    double elapsed = tu_seconds() - t0;
    RANK_STATUS(status, EPX_ERROR_TIMEOUT, t->expected[0]);
    RANK_EXPECT(tu_message_has(t->expected[1]), "timeout message lacks \"%s\"", t->expected[1]);
    RANK_EXPECT(elapsed >= 0.5 * t->timeout && elapsed < t->timeout + 3.0,
                "timed out after %.3f s with a timeout of %.3f s", elapsed, t->timeout);
    RANK_EXPECT(cc_is_poisoned(recv, sizeof recv), "a timed-out call wrote its output");
  }
  t->side_sync(t, !skipper);
  if (!skipper || t->skippers_see_failure) failures += after_failure(comm, t);
  return failures;
}

void cc_wait_for_timeouts(cc_timeout_t *t, int timed_out) {
  if (timed_out) {
    atomic_fetch_add(&t->timed_out, 1);
    return;
  }
  double give_up = tu_seconds() + 20.0;
  while (atomic_load(&t->timed_out) < t->skip_from && tu_seconds() < give_up)
    cc_sleep_seconds(0.001);
}

int cc_timeout_rank(epx_comm_t comm, int32_t rank, int32_t size, void *t) {
  (void)rank, (void)size;
  return cc_timeout_case(comm, t);
}
