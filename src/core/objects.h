/* The library's objects as every backend sees them. `backend` is the
 * operations serving the buffer (core/backend.h), fixed at its creation;
 * `backend_state` is that backend's own per-buffer and per-handle state,
 * which nothing else reads (the CPU engine names it by its type, `cpu`). */
#ifndef EPX_CORE_OBJECTS_H
#define EPX_CORE_OBJECTS_H

#include <stdint.h>

#include "core/payload.h"
#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

struct epx_cpu_plan;
struct epx_cpu_scratch;
struct epx_placement_table;

struct epx_backend;

struct epx_buffer {
  const struct epx_backend *backend;
  epx_comm_t comm;
  epx_buffer_config_t config;
  int32_t world_size;
  int32_t rank;
  int32_t experts_per_rank;    /* E_local: the placement's physical experts per rank */
  struct epx_placement_table *placement; /* where each expert lives (core/placement.h; owned) */
  int64_t *expert_load;        /* [E] routes per logical expert since the last reset (epx_buffer_expert_load;
                                * the CPU backend's: a CUDA buffer counts on the device, place_state) */
  void *place_state;           /* the device's copy of the placement (src/cuda/place/place.h), NULL on the CPU */
  int64_t max_tokens;          /* agreed tokens per rank; 0 until agreed */
  int64_t live_handles;        /* handles not yet released (atomic) */
  union {
    void *backend_state;         /* the backend's: src/cuda/one, src/cuda/ep */
    struct epx_cpu_scratch *cpu; /* the CPU engine's staging buffers, grown on demand */
  };
};

/* A handle's references are counted twice: `caller_refs` are the caller's
 * (the layout call's, epx_handle_retain's, each replay's), `refcount` is
 * those plus the library's own (a recorder's). The caller can release only
 * what it holds, so an extra release is refused instead of taking the
 * recorder's reference; the handle is freed when refcount reaches 0. */
struct epx_handle {
  epx_buffer_t buffer;
  epx_handle_t id;             /* the value the caller holds (core/registry.h) */
  int64_t refcount;            /* atomic: caller_refs + the library's */
  int64_t caller_refs;         /* atomic */
  epx_weighting_t weighting;
  int64_t num_tokens;          /* T of the routing on this rank */
  int32_t top_k;               /* K of the routing */
  int64_t recv_rows;           /* N (CUDA with worst_case_sizing: the bound) */
  int64_t rows_read;           /* N once epx_handle_recv_rows has returned it, else -1: from then on
                                * a receive tensor of N rows is enough, as the backends write and
                                * read only the rows below N */
  uint64_t routing_hash;       /* hash of topk_idx, for recorder validation */
  union {
    void *backend_state;       /* the backend's: src/cuda/one, src/cuda/ep */
    struct epx_cpu_plan *cpu;  /* the CPU engine's layout (src/cpu/exchange.h, built by layout.c) */
  };
};

/* Sets the agreed tokens per rank from the largest batch of the first
 * layout: rounded up to max_tokens_rounding (at least one rounding). Every
 * rank calls it with the same value. */
static inline void epx_buffer_agree_max_tokens(epx_buffer_t buffer, int64_t largest_batch) {
  int64_t rounding = buffer->config.max_tokens_rounding;
  buffer->max_tokens = (largest_batch + rounding - 1) / rounding * rounding;
  if (buffer->max_tokens == 0) buffer->max_tokens = rounding;
}

/* Bytes of one payload row (core/payload.h); it fits (epx_buffer_create
 * checked the config). */
static inline int64_t epx_buffer_row_bytes(epx_buffer_t buffer) {
  return epx_payload_row_bytes(buffer->config.dtype, buffer->config.hidden);
}

/* FNV-1a of the routing's expert ids (a [T, K] int32 array). */
uint64_t epx_hash_topk(const int32_t *topk_idx, int64_t count);

#ifdef __cplusplus
}
#endif

#endif
