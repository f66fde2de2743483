/* The activation-checkpoint recorder: an ordered log of dispatch handles.
 * It keeps handles (layout and routing metadata), never received rows. */
#include <stdlib.h>

#include "api/recorder.h"
#include "core/backend.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/objects.h"
#include "core/registry.h"

struct epx_recorder {
  int32_t validate;
  epx_recorder_mode_t mode;
  epx_handle_t *records;
  int64_t count, capacity;
  int64_t cursor;
  int64_t replays, fallbacks;
};

epx_status_t epx_recorder_create(int32_t validate, epx_recorder_t *recorder) {
  epx_error_clear();
  EPX_REQUIRE(recorder, "epx_recorder_create: recorder is NULL; pass the address of an epx_recorder_t");
  epx_recorder_t r = calloc(1, sizeof *r);
  if (!r) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "epx_recorder_create: out of memory");
  r->validate = validate != 0;
  r->mode = EPX_RECORDER_RECORD;
  void *id = NULL;
  epx_status_t status = epx_registry_add(r, EPX_OBJECT_RECORDER, &id);
  if (status != EPX_SUCCESS) {
    free(r);
    return status;
  }
  *recorder = id;
  return EPX_SUCCESS;
}

/* Turns the caller's recorder id into the object in place, or refuses it. */
static epx_status_t check_recorder(epx_recorder_t *recorder, const char *caller) {
  epx_recorder_t object = epx_registry_get(*recorder, EPX_OBJECT_RECORDER);
  if (!object)
    return epx_error(*recorder ? EPX_ERROR_INVALID_HANDLE : EPX_ERROR_INVALID_ARGUMENT,
                     "%s: recorder is not a live recorder (NULL, destroyed, or not from "
                     "epx_recorder_create)", caller);
  *recorder = object;
  return EPX_SUCCESS;
}

epx_status_t epx_recorder_set_mode(epx_recorder_t recorder, epx_recorder_mode_t mode) {
  epx_error_clear();
  epx_status_t status = check_recorder(&recorder, "epx_recorder_set_mode");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(mode == EPX_RECORDER_RECORD || mode == EPX_RECORDER_REPLAY,
              "epx_recorder_set_mode: mode %d is not EPX_RECORDER_RECORD or EPX_RECORDER_REPLAY", (int)mode);
  recorder->mode = mode;
  recorder->cursor = 0;
  return EPX_SUCCESS;
}

epx_status_t epx_recorder_stats(epx_recorder_t recorder, epx_recorder_stats_t *stats) {
  epx_error_clear();
  epx_status_t status = check_recorder(&recorder, "epx_recorder_stats");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(stats, "epx_recorder_stats: stats is NULL; pass an epx_recorder_stats_t to fill");
  epx_recorder_stats_t s = {recorder->count, recorder->replays, recorder->fallbacks, 0, 0};
  /* Each term fits (the buffer's config was checked against it), but a long
   * log's sum might not: the totals saturate at INT64_MAX rather than wrap. */
  s.bytes_held = (int64_t)(sizeof *recorder + (size_t)recorder->capacity * sizeof(epx_handle_t));
  for (int64_t i = 0; i < recorder->count; i++) {
    epx_handle_t h = recorder->records[i];
    int64_t avoided = INT64_MAX;
    (void)epx_mul_overflows(h->recv_rows, epx_buffer_row_bytes(h->buffer), &avoided);
    if (epx_add_overflows(s.bytes_held, h->buffer->backend->handle_bytes(h), &s.bytes_held))
      s.bytes_held = INT64_MAX;
    if (epx_add_overflows(s.bytes_avoided, avoided, &s.bytes_avoided)) s.bytes_avoided = INT64_MAX;
  }
  *stats = s;
  return EPX_SUCCESS;
}

epx_status_t epx_recorder_destroy(epx_recorder_t recorder) {
  epx_error_clear();
  if (!recorder) return EPX_SUCCESS;
  const epx_recorder_t id = recorder;
  epx_status_t status = check_recorder(&recorder, "epx_recorder_destroy");
  if (status != EPX_SUCCESS) return status;
  for (int64_t i = 0; i < recorder->count; i++) epx_handle_drop_library(recorder->records[i]);
  epx_registry_remove(id);
  free(recorder->records);
  free(recorder);
  return EPX_SUCCESS;
}

int epx_recorder_replaying(epx_recorder_t recorder) { return recorder->mode == EPX_RECORDER_REPLAY; }
int epx_recorder_validates(epx_recorder_t recorder) { return recorder->validate; }

epx_handle_t epx_recorder_next(epx_recorder_t recorder, int64_t *call_index) {
  *call_index = recorder->cursor;
  if (recorder->cursor >= recorder->count) {
    recorder->cursor++;
    recorder->fallbacks++;
    return NULL;
  }
  recorder->replays++;
  return recorder->records[recorder->cursor++];
}

epx_status_t epx_recorder_append(epx_recorder_t recorder, epx_handle_t handle) {
  if (recorder->count == recorder->capacity) {
    int64_t capacity = recorder->capacity ? recorder->capacity * 2 : 16;
    epx_handle_t *records = realloc(recorder->records, (size_t)capacity * sizeof *records);
    if (!records) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "epx_dispatch_layout: out of memory growing the recorder's log");
    recorder->records = records;
    recorder->capacity = capacity;
  }
  epx_handle_hold(handle, 0);
  recorder->records[recorder->count++] = handle;
  return EPX_SUCCESS;
}
