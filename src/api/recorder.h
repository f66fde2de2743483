/* What epx_dispatch_layout needs of a recorder (src/api/recorder.c). */
#ifndef EPX_CORE_RECORDER_H
#define EPX_CORE_RECORDER_H

#include "epx.h"

int epx_recorder_replaying(epx_recorder_t recorder);
/* Replay: the next record's handle (not yet retained) and its call index, or
 * NULL past the end (the fallback is counted). */
epx_handle_t epx_recorder_next(epx_recorder_t recorder, int64_t *call_index);
int epx_recorder_validates(epx_recorder_t recorder);
/* Record: appends the handle (retaining it). */
epx_status_t epx_recorder_append(epx_recorder_t recorder, epx_handle_t handle);

#endif
