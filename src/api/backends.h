/* Which backend serves a device: the one place that maps epx_device_t to a
 * backend table (core/backend.h). */
#ifndef EPX_API_BACKENDS_H
#define EPX_API_BACKENDS_H

#include "core/backend.h"

/* The backend of `device`, or NULL when this build has none for it. */
const epx_backend_t *epx_backend_for_device(epx_device_t device);

/* The error for a device this build has no backend for (names the caller and
 * the rebuild that adds it). */
epx_status_t epx_backend_missing(const char *caller, epx_device_t device);

#endif
