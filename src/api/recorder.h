/* What epx_dispatch_layout needs of a recorder (src/api/recorder.c), and the
 * handle references a recorder takes (src/api/handle.c). The recorder here is
 * the object, never the caller's id (core/registry.h). */
#ifndef EPX_API_RECORDER_H
#define EPX_API_RECORDER_H

#include "epx.h"

int epx_recorder_replaying(epx_recorder_t recorder);
/* Replay: the next record's handle (not yet retained) and its call index, or
 * NULL past the end (the fallback is counted). */
epx_handle_t epx_recorder_next(epx_recorder_t recorder, int64_t *call_index);
int epx_recorder_validates(epx_recorder_t recorder);
/* Record: appends the handle, holding a library reference to it. */
epx_status_t epx_recorder_append(epx_recorder_t recorder, epx_handle_t handle);

/* One more reference to a live handle: the caller's (caller = 1: a replay
 * hands the handle out) or the library's (caller = 0: a recorder keeps it). */
void epx_handle_hold(epx_handle_t handle, int caller);
/* Drops a library reference taken with epx_handle_hold(handle, 0); the last
 * reference of either kind frees the handle. */
void epx_handle_drop_library(epx_handle_t handle);

#endif
