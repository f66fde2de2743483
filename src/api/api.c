/* The public buffer, handle and exchange calls: argument checks, the
 * recorder, and the backend chosen at buffer creation (core/backend.h). Every
 * check that can be made on the host is made here, before any data moves;
 * the backend agrees each rank's verdict with its peers, so the backends only
 * act on calls valid on every rank. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/backends.h"
#include "api/recorder.h"
#include "comm/comm.h"
#include "core/backend.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/objects.h"
#include "core/registry.h"

#define PAYLOAD_ALIGNMENT 16

static int is_aligned(const void *p, size_t alignment) { return ((uintptr_t)p % alignment) == 0; }

/* The public values callers hold are registry ids (core/registry.h): each
 * check below turns the caller's value into the object in place, or refuses
 * it, so nothing past a check ever sees an id. */
static epx_status_t check_buffer(epx_buffer_t *buffer, const char *caller) {
  if (!*buffer)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: buffer is NULL; pass a buffer from epx_buffer_create", caller);
  epx_buffer_t object = epx_registry_get(*buffer, EPX_OBJECT_BUFFER);
  if (!object)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "%s: buffer is not a live buffer (destroyed, or not from epx_buffer_create)", caller);
  *buffer = object;
  return EPX_SUCCESS;
}

/* A handle the caller holds no reference to any more is refused even while a
 * recorder still keeps it alive: the recorder hands it out again on replay. */
static epx_status_t check_handle(epx_buffer_t buffer, epx_handle_t *handle, const char *caller) {
  if (!*handle)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: handle is NULL; pass the handle from epx_dispatch_layout", caller);
  epx_handle_t object = epx_registry_get(*handle, EPX_OBJECT_HANDLE);
  if (!object || __atomic_load_n(&object->caller_refs, __ATOMIC_SEQ_CST) == 0)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "%s: handle is not live (released, or its buffer was destroyed); keep a "
                     "reference with epx_handle_retain while you still need it", caller);
  *handle = object;
  if (buffer && object->buffer != buffer)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "%s: handle belongs to another buffer; pass the buffer its "
                     "epx_dispatch_layout was called with", caller);
  return EPX_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Buffers                                                                   */
/* ------------------------------------------------------------------------ */

/* The fields every rank must agree on, gathered at buffer creation. */
typedef struct {
  int64_t status;
  int64_t device, dtype, hidden, num_experts, max_top_k, max_tokens_per_rank,
      max_tokens_rounding, exchange, layout, expert_alignment, capacity;
} buffer_shape_t;

static const char *const shape_field_names[] = {
    "status", "device", "dtype", "hidden", "num_experts", "max_top_k", "max_tokens_per_rank",
    "max_tokens_rounding", "exchange", "layout", "expert_alignment", "capacity"};

/* The receive bound of a buffer (epx_buffer_max_recv_rows), every product
 * checked: a dropless rank receives up to min(k, E_local) rows of each of
 * W * max_tokens tokens, plus each expert's alignment padding. */
static epx_status_t recv_rows_bound(const char *fn, const epx_buffer_config_t *c, int64_t W,
                                    int64_t max_tokens, int64_t *rows) {
  const int64_t El = c->num_experts / W;
  const char *tokens = "config.max_tokens_per_rank";
  int64_t k = c->max_top_k < El ? c->max_top_k : El, padding = 0, data = 0;
  epx_status_t status = EPX_SUCCESS;
  switch (c->layout) {
    case EPX_LAYOUT_EXPERT_MAJOR:
      status = EPX_CHECKED_PRODUCT(&data, fn, tokens, "world size * max tokens * top_k (the received rows)",
                                   W, max_tokens, k);
      if (status == EPX_SUCCESS)
        status = EPX_CHECKED_PRODUCT(&padding, fn, "config.expert_alignment",
                                     "experts per rank * (alignment - 1) (the padding rows)", El,
                                     c->expert_alignment - 1);
      if (status == EPX_SUCCESS && epx_add_overflows(data, padding, rows))
        status = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                           "%s: config.expert_alignment is too large: the received rows with their "
                           "padding do not fit in 64 bits; pass a smaller config.expert_alignment", fn);
      return status;
    case EPX_LAYOUT_RANK_MAJOR:
      return EPX_CHECKED_PRODUCT(rows, fn, tokens, "world size * max tokens (the received rows)", W, max_tokens);
    case EPX_LAYOUT_CAPACITY:
      return EPX_CHECKED_PRODUCT(rows, fn, "config.capacity", "num_experts * world size * capacity (the received rows)",
                                 El, W, c->capacity);
  }
  return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: config.layout %d is not an epx_layout_t", fn, (int)c->layout);
}

/* Every byte count the buffer can reach fits an int64_t: a row, the rows a
 * rank sends (a copy per selected expert at most) and receives. When the
 * tokens per rank are agreed later, the largest value the agreement can give
 * (2^31 - 1 rounded up) is what is checked. */
static epx_status_t check_buffer_sizes(epx_comm_t comm, const epx_buffer_config_t *c) {
  const char *fn = "epx_buffer_create";
  int64_t row_bytes = 0, send_rows = 0, recv_rows = 0, bytes = 0;
  int64_t rounding = c->max_tokens_rounding;
  int64_t max_tokens = c->max_tokens_per_rank ? c->max_tokens_per_rank
                                              : ((int64_t)INT32_MAX + rounding - 1) / rounding * rounding;
  epx_status_t status = EPX_CHECKED_PRODUCT(&row_bytes, fn, "config.hidden", "hidden * dtype size (a row's bytes)",
                                            c->hidden, (int64_t)epx_dtype_size(c->dtype));
  if (status == EPX_SUCCESS)
    status = EPX_CHECKED_PRODUCT(&send_rows, fn, "config.max_tokens_per_rank",
                                 "max tokens * max_top_k (the rows a rank sends)", max_tokens, c->max_top_k);
  if (status == EPX_SUCCESS)
    status = EPX_CHECKED_PRODUCT(&bytes, fn, "config.hidden", "the bytes a rank sends", send_rows, row_bytes);
  if (status == EPX_SUCCESS) status = recv_rows_bound(fn, c, comm->size, max_tokens, &recv_rows);
  if (status == EPX_SUCCESS)
    status = EPX_CHECKED_PRODUCT(&bytes, fn, "config.hidden", "the bytes a rank receives", recv_rows, row_bytes);
  return status;
}

static epx_status_t check_buffer_config(epx_comm_t comm, const epx_buffer_config_t *c) {
  const char *fn = "epx_buffer_create";
  EPX_REQUIRE(c, "%s: config is NULL; pass an epx_buffer_config_t from EPX_BUFFER_CONFIG_INIT", fn);
  EPX_REQUIRE(c->struct_size == sizeof(epx_buffer_config_t) && c->version == EPX_CONFIG_VERSION,
              "%s: config.struct_size/version are %u/%u, expected %zu/%d; initialise it with "
              "EPX_BUFFER_CONFIG_INIT", fn, c->struct_size, c->version, sizeof(epx_buffer_config_t),
              EPX_CONFIG_VERSION);
  if (!epx_backend_for_device(c->device)) return epx_backend_missing(fn, c->device);
  EPX_REQUIRE(epx_dtype_size(c->dtype), "%s: config.dtype %d is not EPX_FLOAT32, EPX_BFLOAT16 or EPX_FLOAT16", fn, (int)c->dtype);
  EPX_REQUIRE(c->hidden > 0 && c->hidden % 8 == 0,
              "%s: config.hidden is %lld; it must be a positive multiple of 8 (rows are moved in 16-byte vectors)",
              fn, (long long)c->hidden);
  EPX_REQUIRE(c->num_experts >= 1 && c->num_experts % comm->size == 0,
              "%s: config.num_experts is %d; it must be a positive multiple of the comm size %d",
              fn, c->num_experts, comm->size);
  EPX_REQUIRE(c->max_top_k >= 1 && c->max_top_k <= c->num_experts,
              "%s: config.max_top_k is %d; it must be in [1, num_experts = %d]", fn, c->max_top_k, c->num_experts);
  EPX_REQUIRE(c->max_tokens_per_rank >= 0 && c->max_tokens_per_rank <= INT32_MAX,
              "%s: config.max_tokens_per_rank is %lld; pass a count in [0, 2^31) (0 agrees it at the first dispatch)",
              fn, (long long)c->max_tokens_per_rank);
  EPX_REQUIRE(c->max_tokens_rounding >= 1, "%s: config.max_tokens_rounding is %d; pass >= 1", fn, c->max_tokens_rounding);
  EPX_REQUIRE(c->exchange == EPX_EXCHANGE_DEDUP || c->exchange == EPX_EXCHANGE_COLLECTIVE,
              "%s: config.exchange %d is not EPX_EXCHANGE_DEDUP or EPX_EXCHANGE_COLLECTIVE", fn, (int)c->exchange);
  EPX_REQUIRE(c->layout == EPX_LAYOUT_EXPERT_MAJOR || c->layout == EPX_LAYOUT_RANK_MAJOR ||
                  c->layout == EPX_LAYOUT_CAPACITY,
              "%s: config.layout %d is not an epx_layout_t", fn, (int)c->layout);
  EPX_REQUIRE(c->expert_alignment >= 1, "%s: config.expert_alignment is %d; pass >= 1 (1 = no padding)", fn, c->expert_alignment);
  EPX_REQUIRE(c->layout != EPX_LAYOUT_CAPACITY || c->capacity >= 1,
              "%s: config.capacity is %d; EPX_LAYOUT_CAPACITY needs the capacity C >= 1 (epx_route_output_t.capacity)",
              fn, c->capacity);
  EPX_REQUIRE(c->capacity >= 0, "%s: config.capacity is %d; pass >= 0", fn, c->capacity);
  return check_buffer_sizes(comm, c);
}

epx_status_t epx_buffer_create(epx_comm_t comm, const epx_buffer_config_t *config,
                               epx_buffer_t *buffer) {
  const char *fn = "epx_buffer_create";
  epx_error_clear();
  epx_comm_t comm_id = comm;
  comm = epx_registry_get(comm_id, EPX_OBJECT_COMM);
  if (!comm)
    return epx_error(comm_id ? EPX_ERROR_INVALID_HANDLE : EPX_ERROR_INVALID_ARGUMENT,
                     "%s: comm is %s; pass a comm from epx_comm_create_*", fn,
                     comm_id ? "not a live comm (destroyed?)" : "NULL");
  epx_status_t local = buffer ? check_buffer_config(comm, config)
                              : epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: buffer is NULL; pass the address of an epx_buffer_t", fn);

  /* Every rank sends its shape (or its failure) so all refuse together. */
  buffer_shape_t mine = {0};
  mine.status = local;
  if (local == EPX_SUCCESS)
    mine = (buffer_shape_t){0, config->device, config->dtype, config->hidden, config->num_experts,
                            config->max_top_k, config->max_tokens_per_rank, config->max_tokens_rounding,
                            config->exchange, config->layout, config->expert_alignment, config->capacity};
  char message[1024];
  strncpy(message, epx_last_error(), sizeof message - 1);
  message[sizeof message - 1] = '\0';
  buffer_shape_t *all = calloc((size_t)comm->size, sizeof *all);
  if (!all) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  epx_status_t status = epx_comm_check_alive(comm, fn);
  if (status == EPX_SUCCESS) status = comm->ops->allgather(comm, fn, &mine, all, sizeof mine);
  if (status != EPX_SUCCESS) {
    free(all);
    return status;
  }
  if (local != EPX_SUCCESS) {
    free(all);
    return epx_error(local, "%s", message);
  }
  for (int32_t r = 0; r < comm->size; r++) {
    if (all[r].status != EPX_SUCCESS) {
      free(all);
      return epx_error(EPX_ERROR_PEER_FAILED, "%s: rank %d refused its config (its epx_last_error says why)", fn, r);
    }
  }
  /* Name the rank whose value is the odd one out: compare each rank with the
   * value most ranks have. */
  for (size_t f = 0; f < sizeof mine / sizeof(int64_t) - 1; f++) {
    int64_t common = (&all[0].device)[f];
    int32_t best = 0;
    for (int32_t r = 0; r < comm->size; r++) {
      int32_t votes = 0;
      for (int32_t q = 0; q < comm->size; q++) votes += (&all[q].device)[f] == (&all[r].device)[f];
      if (votes > best) best = votes, common = (&all[r].device)[f];
    }
    for (int32_t r = 0; r < comm->size; r++) {
      int64_t theirs = (&all[r].device)[f];
      if (theirs == common) continue;
      status = epx_error(EPX_ERROR_SHAPE_MISMATCH,
                         "%s: rank %d has config.%s = %lld but %d of %d ranks have %lld; every rank "
                         "must create the buffer with the same %s", fn, r, shape_field_names[f + 1],
                         (long long)theirs, best, comm->size, (long long)common, shape_field_names[f + 1]);
      free(all);
      return status;
    }
  }
  free(all);

  epx_buffer_t b = calloc(1, sizeof *b);
  if (!b) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  b->comm = comm;
  b->config = *config;
  b->world_size = comm->size;
  b->rank = comm->rank;
  b->experts_per_rank = config->num_experts / comm->size;
  b->max_tokens = config->max_tokens_per_rank;
  b->backend = epx_backend_for_device(config->device);
  status = b->backend->buffer_init(b);
  if (status != EPX_SUCCESS) {
    free(b);
    return status;
  }
  void *id = NULL;
  status = epx_registry_add(b, EPX_OBJECT_BUFFER, &id);
  if (status != EPX_SUCCESS) {
    b->backend->buffer_fini(b);
    free(b);
    return status;
  }
  __atomic_add_fetch(&comm->live_buffers, 1, __ATOMIC_SEQ_CST);
  *buffer = id;
  return EPX_SUCCESS;
}

epx_status_t epx_buffer_destroy(epx_buffer_t buffer) {
  epx_error_clear();
  if (!buffer) return EPX_SUCCESS;
  const epx_buffer_t id = buffer;
  epx_status_t status = check_buffer(&buffer, "epx_buffer_destroy");
  if (status != EPX_SUCCESS) return status;
  int64_t live = __atomic_load_n(&buffer->live_handles, __ATOMIC_SEQ_CST);
  if (live > 0)
    return epx_error(EPX_ERROR_BUSY,
                     "epx_buffer_destroy: %lld handle(s) from this buffer are still alive (a backward "
                     "may still need them); release them with epx_handle_release or "
                     "epx_recorder_destroy first", (long long)live);
  epx_registry_remove(id);
  buffer->backend->buffer_fini(buffer);
  __atomic_sub_fetch(&buffer->comm->live_buffers, 1, __ATOMIC_SEQ_CST);
  free(buffer);
  return EPX_SUCCESS;
}

epx_status_t epx_buffer_max_tokens(epx_buffer_t buffer, int64_t *max_tokens_per_rank) {
  epx_error_clear();
  epx_status_t status = check_buffer(&buffer, "epx_buffer_max_tokens");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(max_tokens_per_rank, "epx_buffer_max_tokens: max_tokens_per_rank is NULL; pass an int64_t to fill");
  *max_tokens_per_rank = buffer->max_tokens;
  return EPX_SUCCESS;
}

epx_status_t epx_buffer_max_recv_rows(epx_buffer_t buffer, int64_t *rows) {
  epx_error_clear();
  epx_status_t status = check_buffer(&buffer, "epx_buffer_max_recv_rows");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(rows, "epx_buffer_max_recv_rows: rows is NULL; pass an int64_t to fill");
  if (buffer->max_tokens == 0 && buffer->config.layout != EPX_LAYOUT_CAPACITY)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "epx_buffer_max_recv_rows: max_tokens_per_rank is not agreed yet; set "
                     "config.max_tokens_per_rank or call after the first epx_dispatch_layout");
  return recv_rows_bound("epx_buffer_max_recv_rows", &buffer->config, buffer->world_size,
                         buffer->max_tokens, rows);
}

epx_status_t epx_buffer_set_stream(epx_buffer_t buffer, void *stream) {
  epx_error_clear();
  epx_status_t status = check_buffer(&buffer, "epx_buffer_set_stream");
  if (status != EPX_SUCCESS) return status;
  if (!buffer->backend->set_stream)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "epx_buffer_set_stream: the buffer is a %s buffer; streams are for EPX_DEVICE_CUDA buffers",
                     buffer->backend->name);
  return buffer->backend->set_stream(buffer, stream);
}

/* ------------------------------------------------------------------------ */
/* Handles                                                                   */
/* ------------------------------------------------------------------------ */

static void handle_free(epx_handle_t handle) {
  epx_registry_remove(handle->id);
  handle->buffer->backend->handle_fini(handle);
  __atomic_sub_fetch(&handle->buffer->live_handles, 1, __ATOMIC_SEQ_CST);
  free(handle);
}

/* Drops one reference of either kind; the last one frees the handle. */
static void handle_unref(epx_handle_t handle) {
  if (__atomic_sub_fetch(&handle->refcount, 1, __ATOMIC_SEQ_CST) == 0) handle_free(handle);
}

void epx_handle_hold(epx_handle_t handle, int caller) {
  if (caller) __atomic_add_fetch(&handle->caller_refs, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&handle->refcount, 1, __ATOMIC_SEQ_CST);
}

void epx_handle_drop_library(epx_handle_t handle) { handle_unref(handle); }

epx_status_t epx_handle_retain(epx_handle_t handle) {
  epx_error_clear();
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_retain");
  if (status != EPX_SUCCESS) return status;
  epx_handle_hold(handle, 1);
  return EPX_SUCCESS;
}

/* Takes one of the caller's references and never one of the library's: a
 * release beyond what the caller holds is refused, so a recorder that still
 * logs the handle keeps it (and replays it) whatever the caller does. */
epx_status_t epx_handle_release(epx_handle_t handle) {
  epx_error_clear();
  if (!handle) return EPX_SUCCESS;
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_release");
  if (status != EPX_SUCCESS) return status;
  int64_t held = __atomic_load_n(&handle->caller_refs, __ATOMIC_SEQ_CST);
  do {
    if (held == 0)
      return epx_error(EPX_ERROR_INVALID_HANDLE,
                       "epx_handle_release: the handle has been released as many times as it was "
                       "given out (by epx_dispatch_layout or a replay) and retained; release each "
                       "reference once");
  } while (!__atomic_compare_exchange_n(&handle->caller_refs, &held, held - 1, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST));
  handle_unref(handle);
  return EPX_SUCCESS;
}

static const epx_backend_t *backend_of(epx_handle_t handle) { return handle->buffer->backend; }

epx_status_t epx_handle_recv_rows(epx_handle_t handle, int64_t *rows) {
  epx_error_clear();
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_recv_rows");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(rows, "epx_handle_recv_rows: rows is NULL; pass an int64_t to fill");
  return backend_of(handle)->recv_rows(handle, rows);
}

epx_status_t epx_handle_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  epx_error_clear();
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_recv_rows_device");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(rows, "epx_handle_recv_rows_device: rows is NULL; pass a const int64_t * to fill");
  if (!backend_of(handle)->recv_rows_device)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "epx_handle_recv_rows_device: the handle is from a %s buffer, whose row count is on the host; use epx_handle_recv_rows",
                     backend_of(handle)->name);
  return backend_of(handle)->recv_rows_device(handle, rows);
}

epx_status_t epx_handle_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  epx_error_clear();
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_expert_counts");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(counts || offsets, "epx_handle_expert_counts: counts and offsets are both NULL; pass at least one array");
  EPX_REQUIRE(is_aligned(counts, 8) && is_aligned(offsets, 8), "epx_handle_expert_counts: counts/offsets must be 8-byte aligned");
  return backend_of(handle)->expert_counts(handle, counts, offsets);
}

epx_status_t epx_handle_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  epx_error_clear();
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_recv_routing");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(is_aligned(recv_expert, 4) && is_aligned(recv_w, 4), "epx_handle_recv_routing: recv_expert/recv_w must be 4-byte aligned");
  return backend_of(handle)->recv_routing(handle, recv_expert, recv_w);
}

epx_status_t epx_handle_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  epx_error_clear();
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_recv_source");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(is_aligned(src_rank, 4) && is_aligned(src_token, 4), "epx_handle_recv_source: src_rank/src_token must be 4-byte aligned");
  return backend_of(handle)->recv_source(handle, src_rank, src_token);
}

epx_status_t epx_handle_stats(epx_handle_t handle, epx_handle_stats_t *stats) {
  epx_error_clear();
  epx_status_t status = check_handle(NULL, &handle, "epx_handle_stats");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(stats, "epx_handle_stats: stats is NULL; pass an epx_handle_stats_t to fill");
  return backend_of(handle)->stats(handle, stats);
}

/* ------------------------------------------------------------------------ */
/* Dispatch layout                                                           */
/* ------------------------------------------------------------------------ */

/* recorder_id is the caller's value, recorder the object it names (or NULL). */
static epx_status_t check_routing(epx_buffer_t b, const epx_routing_t *r, epx_recorder_t recorder_id,
                                  epx_recorder_t recorder, epx_handle_t *handle) {
  const char *fn = "epx_dispatch_layout";
  const epx_buffer_config_t *c = &b->config;
  EPX_REQUIRE(handle, "%s: handle is NULL; pass the address of an epx_handle_t", fn);
  EPX_REQUIRE(r, "%s: routing is NULL; pass an epx_routing_t", fn);
  if (recorder_id && !recorder)
    return epx_error(EPX_ERROR_INVALID_HANDLE, "%s: recorder is not a live recorder (destroyed?); pass NULL or a recorder from epx_recorder_create", fn);
  EPX_REQUIRE(r->num_tokens >= 0 && r->num_tokens <= INT32_MAX,
              "%s: routing.num_tokens is %lld; pass a count in [0, 2^31)", fn, (long long)r->num_tokens);
  EPX_REQUIRE(r->top_k >= 1 && r->top_k <= c->max_top_k,
              "%s: routing.top_k is %d; it must be in [1, config.max_top_k = %d]%s", fn, r->top_k,
              c->max_top_k, r->top_k > c->num_experts ? " (and top_k cannot exceed num_experts)" : "");
  EPX_REQUIRE(r->weighting == EPX_WEIGHTS_IN_COMBINE || r->weighting == EPX_WEIGHTS_IN_DISPATCH ||
                  r->weighting == EPX_WEIGHTS_NONE,
              "%s: routing.weighting %d is not an epx_weighting_t", fn, (int)r->weighting);
  if (r->num_tokens > 0) {
    EPX_REQUIRE(r->topk_idx, "%s: routing.topk_idx is NULL; pass the [num_tokens, top_k] expert ids", fn);
    EPX_REQUIRE(is_aligned(r->topk_idx, 4), "%s: routing.topk_idx is not 4-byte aligned", fn);
    EPX_REQUIRE(r->topk_w || r->weighting == EPX_WEIGHTS_NONE,
                "%s: routing.topk_w is NULL but weighting is not EPX_WEIGHTS_NONE; pass the [num_tokens, "
                "top_k] weights or say EPX_WEIGHTS_NONE", fn);
    EPX_REQUIRE(is_aligned(r->topk_w, 4), "%s: routing.topk_w is not 4-byte aligned", fn);
    EPX_REQUIRE(c->layout != EPX_LAYOUT_CAPACITY || r->locations,
                "%s: routing.locations is NULL; EPX_LAYOUT_CAPACITY needs the [num_tokens, top_k] "
                "capacity slots (epx_route_output_t.locations)", fn);
    EPX_REQUIRE(is_aligned(r->locations, 4), "%s: routing.locations is not 4-byte aligned", fn);
  }
  if (c->layout == EPX_LAYOUT_RANK_MAJOR && r->weighting != EPX_WEIGHTS_NONE)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: EPX_LAYOUT_RANK_MAJOR leaves weighting to the expert (a row serves several "
                     "experts); pass routing.weighting = EPX_WEIGHTS_NONE, apply epx_handle_recv_routing's "
                     "weights, and return their gradient with epx_weights_backward", fn);
  if (b->max_tokens > 0 && r->num_tokens > b->max_tokens)
    return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                     "%s: routing.num_tokens %lld exceeds the buffer's max_tokens_per_rank %lld; "
                     "create the buffer with a larger config.max_tokens_per_rank", fn,
                     (long long)r->num_tokens, (long long)b->max_tokens);
  return b->backend->validate_routing ? b->backend->validate_routing(b, r) : EPX_SUCCESS;
}

static epx_status_t new_handle(epx_buffer_t buffer, const epx_routing_t *routing, epx_handle_t *out) {
  epx_handle_t h = calloc(1, sizeof *h);
  if (!h) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "epx_dispatch_layout: out of memory");
  h->buffer = buffer;
  h->refcount = 1;
  h->caller_refs = 1;
  h->weighting = routing->weighting;
  h->num_tokens = routing->num_tokens;
  h->top_k = routing->top_k;
  *out = h;
  return EPX_SUCCESS;
}

epx_status_t epx_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                 epx_recorder_t recorder, epx_handle_t *handle) {
  const char *fn = "epx_dispatch_layout";
  epx_error_clear();
  epx_status_t status = check_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  epx_comm_t comm = buffer->comm;
  status = epx_comm_check_alive(comm, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_recorder_t recorder_id = recorder;
  recorder = epx_registry_get(recorder_id, EPX_OBJECT_RECORDER);
  epx_status_t local = check_routing(buffer, routing, recorder_id, recorder, handle);

  /* Replay: the recorded handle, no exchange. Validation agrees the verdict
   * across ranks; without it replay is rank-local, and so is a refusal (the
   * peers are in no collective to be told). */
  if (recorder && epx_recorder_replaying(recorder)) {
    int64_t call;
    epx_handle_t recorded = epx_recorder_next(recorder, &call);
    if (recorded) {
      if (epx_recorder_validates(recorder)) {
        uint64_t hash = 0;
        if (local == EPX_SUCCESS) local = buffer->backend->routing_hash(buffer, routing, &hash);
        if (local == EPX_SUCCESS &&
            (recorded->buffer != buffer || recorded->num_tokens != routing->num_tokens ||
             recorded->top_k != routing->top_k || recorded->routing_hash != hash ||
             recorded->weighting != routing->weighting))
          local = epx_error(EPX_ERROR_REPLAY_MISMATCH,
                            "%s: replay of call %lld differs from its record (recorded %lld tokens x %d, "
                            "hash %016llx; now %lld x %d, hash %016llx%s); the recomputed routing must equal "
                            "the original — pin the router's outputs or re-record", fn, (long long)call,
                            (long long)recorded->num_tokens, recorded->top_k,
                            (unsigned long long)recorded->routing_hash, (long long)routing->num_tokens,
                            routing->top_k, (unsigned long long)hash,
                            recorded->buffer != buffer ? ", and another buffer" : "");
        status = buffer->backend->agree(buffer, local, fn);
        if (status != EPX_SUCCESS) return status;
      } else if (local != EPX_SUCCESS) {
        return local;
      }
      epx_handle_hold(recorded, 1);
      *handle = recorded->id;
      return EPX_SUCCESS;
    }
  }

  epx_handle_t h = NULL;
  if (local == EPX_SUCCESS) local = new_handle(buffer, routing, &h);
  status = buffer->backend->dispatch_layout(buffer, routing, local, h);
  if (status != EPX_SUCCESS) goto fail;
  void *id = NULL;
  EPX_CHECK(epx_registry_add(h, EPX_OBJECT_HANDLE, &id));
  h->id = id;
  __atomic_add_fetch(&buffer->live_handles, 1, __ATOMIC_SEQ_CST);
  if (recorder && !epx_recorder_replaying(recorder)) {
    status = epx_recorder_append(recorder, h);
    if (status != EPX_SUCCESS) {
      handle_free(h);
      return status;
    }
  }
  *handle = h->id;
  return EPX_SUCCESS;
fail:
  if (h) {
    buffer->backend->handle_fini(h);
    free(h);
  }
  return status;
}

uint64_t epx_hash_topk(const int32_t *topk_idx, int64_t count) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (int64_t i = 0; i < count; i++) {
    uint32_t v = (uint32_t)topk_idx[i];
    for (int byte = 0; byte < 4; byte++) {
      hash ^= (v >> (8 * byte)) & 0xffu;
      hash *= 0x100000001b3ull;
    }
  }
  return hash;
}

/* ------------------------------------------------------------------------ */
/* Payload calls                                                             */
/* ------------------------------------------------------------------------ */

/* A payload tensor argument: NULL allowed only when it has no rows. */
static epx_status_t check_payload(const void *p, int64_t rows, const char *fn, const char *name,
                                  const char *shape) {
  if (rows > 0 && !p)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: %s is NULL; pass a %s tensor", fn, name, shape);
  if (!is_aligned(p, PAYLOAD_ALIGNMENT))
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: %s is not 16-byte aligned; allocate it with 16-byte alignment", fn, name);
  return EPX_SUCCESS;
}

/* The checks every payload call starts with; they turn the caller's buffer
 * and handle values into the objects. A NULL or dead buffer returns at
 * once (there is no comm to agree with); a bad handle on a live CPU buffer is
 * agreed here, meeting the peers' agree() of the same call, so they refuse it
 * too instead of pairing their call with this rank's next one. */
static epx_status_t begin_payload(epx_buffer_t *buffer, epx_handle_t *handle, const char *fn) {
  epx_error_clear();
  epx_status_t status = check_buffer(buffer, fn);
  if (status != EPX_SUCCESS) return status;
  status = epx_comm_check_alive((*buffer)->comm, fn);
  if (status != EPX_SUCCESS) return status;
  status = check_handle(*buffer, handle, fn);
  if (status != EPX_SUCCESS) return (*buffer)->backend->agree(*buffer, status, fn);
  return status;
}

epx_status_t epx_dispatch(epx_buffer_t buffer, epx_handle_t handle, const void *x, void *recv_x,
                          int64_t recv_rows_capacity) {
  const char *fn = "epx_dispatch";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(x, handle->num_tokens, fn, "x", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS) local = check_payload(recv_x, handle->recv_rows, fn, "recv_x", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS && recv_rows_capacity < handle->recv_rows)
    local = epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                      "%s: recv_rows_capacity %lld is below the handle's %lld rows; size recv_x with "
                      "epx_handle_recv_rows (or epx_buffer_max_recv_rows)", fn,
                      (long long)recv_rows_capacity, (long long)handle->recv_rows);
  return buffer->backend->dispatch(buffer, handle, local, x, recv_x);
}

epx_status_t epx_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out, void *out) {
  const char *fn = "epx_combine";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(expert_out, handle->recv_rows, fn, "expert_out", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS) local = check_payload(out, handle->num_tokens, fn, "out", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS && out && out == expert_out)
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: out aliases expert_out; pass a separate [num_tokens, hidden] tensor", fn);
  return buffer->backend->combine(buffer, handle, local, expert_out, out);
}

epx_status_t epx_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, const void *grad_recv_x,
                                   void *grad_x, const void *x, float *grad_w) {
  const char *fn = "epx_dispatch_backward";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(grad_recv_x, handle->recv_rows, fn, "grad_recv_x", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS) local = check_payload(grad_x, handle->num_tokens, fn, "grad_x", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS && handle->weighting != EPX_WEIGHTS_IN_DISPATCH && (x || grad_w))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                      "%s: %s is given but the handle's weights were not applied in dispatch; pass NULL "
                      "(with EPX_WEIGHTS_IN_COMBINE the weight gradient comes from epx_combine_backward)",
                      fn, grad_w ? "grad_w" : "x");
  if (local == EPX_SUCCESS && grad_w) {
    local = check_payload(x, handle->num_tokens, fn, "x", "[num_tokens, hidden] (the forward's input, needed for grad_w)");
    if (local == EPX_SUCCESS && !is_aligned(grad_w, 4))
      local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: grad_w is not 4-byte aligned", fn);
  }
  return buffer->backend->dispatch_backward(buffer, handle, local, grad_recv_x, grad_x, x, grad_w);
}

epx_status_t epx_combine_backward(epx_buffer_t buffer, epx_handle_t handle, const void *grad_out,
                                  const void *expert_out, void *grad_expert_out, float *grad_w) {
  const char *fn = "epx_combine_backward";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(grad_out, handle->num_tokens, fn, "grad_out", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS)
    local = check_payload(grad_expert_out, handle->recv_rows, fn, "grad_expert_out", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS && handle->weighting != EPX_WEIGHTS_IN_COMBINE && (expert_out || grad_w))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                      "%s: %s is given but the handle's weights were not applied in combine; pass NULL "
                      "(with EPX_WEIGHTS_IN_DISPATCH the weight gradient comes from epx_dispatch_backward)",
                      fn, grad_w ? "grad_w" : "expert_out");
  if (local == EPX_SUCCESS && grad_w) {
    local = check_payload(expert_out, handle->recv_rows, fn, "expert_out",
                          "[recv_rows, hidden] (the forward's input, needed for grad_w)");
    if (local == EPX_SUCCESS && !is_aligned(grad_w, 4))
      local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: grad_w is not 4-byte aligned", fn);
  }
  return buffer->backend->combine_backward(buffer, handle, local, grad_out, expert_out, grad_expert_out, grad_w);
}

epx_status_t epx_weights_backward(epx_buffer_t buffer, epx_handle_t handle, const float *grad_recv_w,
                                  float *grad_w) {
  const char *fn = "epx_weights_backward";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = EPX_SUCCESS;
  if (handle->recv_rows > 0 && !grad_recv_w)
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                      "%s: grad_recv_w is NULL; pass the gradient of epx_handle_recv_routing's recv_w "
                      "([recv_rows], or [recv_rows, top_k] for the rank-major layout)", fn);
  else if (handle->num_tokens > 0 && !grad_w)
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: grad_w is NULL; pass a [num_tokens, top_k] float array", fn);
  else if (!is_aligned(grad_recv_w, 4) || !is_aligned(grad_w, 4))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: %s is not 4-byte aligned", fn,
                      is_aligned(grad_w, 4) ? "grad_recv_w" : "grad_w");
  return buffer->backend->weights_backward(buffer, handle, local, grad_recv_w, grad_w);
}
