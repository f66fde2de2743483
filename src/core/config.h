/* Reading a caller's versioned config (epx_route_config_t, epx_comm_config_t,
 * epx_buffer_config_t): the one place their struct_size and version are
 * judged, used by every config check (src/api/buffer.c, src/api/route.c,
 * src/comm/comm.c). */
#ifndef EPX_CORE_CONFIG_H
#define EPX_CORE_CONFIG_H

#include <stddef.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every config struct starts with these two fields. */
typedef struct epx_config_header {
  uint32_t struct_size;
  uint32_t version;
} epx_config_header_t;

/* Copies `given` (a caller's config, not NULL) over `full`, which holds this
 * library's defaults (its *_config_init) and is `full_size` bytes: only the
 * given struct_size bytes, so a program built against an older, smaller
 * struct keeps working and the fields it does not know keep their defaults,
 * as ncclCommInitRankConfig does. Refuses a struct_size that cannot hold
 * struct_size and version, one larger than this library's struct (a newer
 * header than the library), and a version outside [1, EPX_CONFIG_VERSION].
 * On success full's struct_size and version are this library's. `type` names
 * the struct in the error ("epx_buffer_config_t"). */
epx_status_t epx_config_read(const char *caller, const char *type, const void *given, void *full,
                             size_t full_size);

/* The checks epx_config_read makes of a struct_size (also used by the
 * *_config_init functions, which write only struct_size bytes). */
epx_status_t epx_config_check_size(const char *caller, const char *type, size_t struct_size,
                                   size_t full_size);

#ifdef __cplusplus
}
#endif

#endif
