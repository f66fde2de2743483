/* The public handle calls: lifetime (retain, release) and the queries of a
 * handle's layout. */
#include <stdint.h>
#include <stdlib.h>

#include "api/api.h"
#include "api/recorder.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/objects.h"
#include "core/registry.h"

/* A handle the caller holds no reference to any more is refused even while a
 * recorder still keeps it alive: the recorder hands it out again on replay. */
epx_status_t epx_check_handle(epx_buffer_t buffer, epx_handle_t *handle, const char *caller) {
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

epx_status_t epx_handle_new(const char *fn, epx_buffer_t buffer, const epx_routing_t *routing, epx_handle_t *out) {
  epx_handle_t h = calloc(1, sizeof *h);
  if (!h) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  h->buffer = buffer;
  h->refcount = 1;
  h->rows_read = -1;
  h->caller_refs = 1;
  h->weighting = routing->weighting;
  h->num_tokens = routing->num_tokens;
  h->top_k = routing->top_k;
  *out = h;
  return EPX_SUCCESS;
}

void epx_handle_free(epx_handle_t handle) {
  epx_registry_remove(handle->id);
  handle->buffer->backend->handle_fini(handle);
  __atomic_sub_fetch(&handle->buffer->live_handles, 1, __ATOMIC_SEQ_CST);
  free(handle);
}

/* Drops one reference of either kind; the last one frees the handle. */
static void handle_unref(epx_handle_t handle) {
  if (__atomic_sub_fetch(&handle->refcount, 1, __ATOMIC_SEQ_CST) == 0) epx_handle_free(handle);
}

void epx_handle_hold(epx_handle_t handle, int caller) {
  if (caller) __atomic_add_fetch(&handle->caller_refs, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&handle->refcount, 1, __ATOMIC_SEQ_CST);
}

void epx_handle_drop_library(epx_handle_t handle) { handle_unref(handle); }

epx_status_t epx_handle_retain(epx_handle_t handle) {
  epx_error_clear();
  epx_status_t status = epx_check_handle(NULL, &handle, "epx_handle_retain");
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
  epx_status_t status = epx_check_handle(NULL, &handle, "epx_handle_release");
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
  epx_status_t status = epx_check_handle(NULL, &handle, "epx_handle_recv_rows");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(rows, "epx_handle_recv_rows: rows is NULL; pass an int64_t to fill");
  status = backend_of(handle)->recv_rows(handle, rows);
  if (status == EPX_SUCCESS) handle->rows_read = *rows;
  return status;
}

epx_status_t epx_handle_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  epx_error_clear();
  epx_status_t status = epx_check_handle(NULL, &handle, "epx_handle_recv_rows_device");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(rows, "epx_handle_recv_rows_device: rows is NULL; pass a const int64_t * to fill");
  if (!backend_of(handle)->recv_rows_device)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "epx_handle_recv_rows_device: the handle is from a %s buffer, whose row count is on the host; use epx_handle_recv_rows",
                     backend_of(handle)->name);
  return backend_of(handle)->recv_rows_device(handle, rows);
}

epx_status_t epx_handle_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  epx_error_clear();
  epx_status_t status = epx_check_handle(NULL, &handle, "epx_handle_expert_counts");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(counts || offsets, "epx_handle_expert_counts: counts and offsets are both NULL; pass at least one array");
  EPX_REQUIRE(epx_is_aligned(counts, 8) && epx_is_aligned(offsets, 8), "epx_handle_expert_counts: counts/offsets must be 8-byte aligned");
  return backend_of(handle)->expert_counts(handle, counts, offsets);
}

/* The per-row queries' entry: a valid handle and two 4-byte aligned arrays. */
static epx_status_t check_row_query(epx_handle_t *handle, const void *a, const void *b, const char *fn,
                                    const char *names) {
  epx_error_clear();
  epx_status_t status = epx_check_handle(NULL, handle, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(epx_is_aligned(a, 4) && epx_is_aligned(b, 4), "%s: %s must be 4-byte aligned", fn, names);
  return EPX_SUCCESS;
}

epx_status_t epx_handle_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  epx_status_t status = check_row_query(&handle, recv_expert, recv_w, "epx_handle_recv_routing", "recv_expert/recv_w");
  return status != EPX_SUCCESS ? status : backend_of(handle)->recv_routing(handle, recv_expert, recv_w);
}

epx_status_t epx_handle_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  epx_status_t status = check_row_query(&handle, src_rank, src_token, "epx_handle_recv_source", "src_rank/src_token");
  return status != EPX_SUCCESS ? status : backend_of(handle)->recv_source(handle, src_rank, src_token);
}

epx_status_t epx_handle_stats(epx_handle_t handle, epx_handle_stats_t *stats) {
  epx_error_clear();
  epx_status_t status = epx_check_handle(NULL, &handle, "epx_handle_stats");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(stats, "epx_handle_stats: stats is NULL; pass an epx_handle_stats_t to fill");
  return backend_of(handle)->stats(handle, stats);
}

epx_status_t epx_handle_traffic(epx_handle_t handle, epx_handle_traffic_t *traffic) {
  epx_error_clear();
  epx_status_t status = epx_check_handle(NULL, &handle, "epx_handle_traffic");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(traffic, "epx_handle_traffic: traffic is NULL; pass an epx_handle_traffic_t to fill");
  if (!backend_of(handle)->traffic)
    return epx_error(EPX_ERROR_UNSUPPORTED, "epx_handle_traffic: the handle is a %s buffer's; this version counts "
                     "link classes on CPU buffers and CUDA buffers over several ranks only",
                     handle->buffer->backend->name);
  return backend_of(handle)->traffic(handle, traffic);
}
