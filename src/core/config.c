/* The versioned configs: their defaults (the *_config_init calls, which the
 * Python binding uses too), reading a caller's possibly older struct, and
 * the library's version. */
#include <string.h>

#include "core/config.h"
#include "core/error.h"

/* The library's version must be the header's it was built with and the
 * project's (CMakeLists.txt passes the project version). */
_Static_assert(EPX_VERSION_MAJOR == EPX_PROJECT_VERSION_MAJOR &&
                   EPX_VERSION_MINOR == EPX_PROJECT_VERSION_MINOR &&
                   EPX_VERSION_PATCH == EPX_PROJECT_VERSION_PATCH,
               "include/epx.h's EPX_VERSION_* differ from project(epx VERSION) in CMakeLists.txt");

int32_t epx_version(void) { return EPX_VERSION_CODE; }

epx_status_t epx_config_check_size(const char *caller, const char *type, size_t struct_size,
                                   size_t full_size) {
  if (struct_size < sizeof(epx_config_header_t))
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: config->struct_size is %zu, too small to hold struct_size and version "
                     "(%zu bytes); set it to sizeof(%s), as the *_config_init calls do",
                     caller, struct_size, sizeof(epx_config_header_t), type);
  if (struct_size > full_size)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: config->struct_size is %zu but this library's %s has %zu bytes: the "
                     "program was built against a newer epx.h than the library (epx_version() "
                     "is %d); use the library that matches the header", caller, struct_size, type,
                     full_size, (int)epx_version());
  return EPX_SUCCESS;
}

epx_status_t epx_config_read(const char *caller, const char *type, const void *given, void *full,
                             size_t full_size) {
  epx_config_header_t header;
  memcpy(&header, given, sizeof header);
  epx_status_t status = epx_config_check_size(caller, type, header.struct_size, full_size);
  if (status != EPX_SUCCESS) return status;
  if (header.version < 1 || header.version > EPX_CONFIG_VERSION)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: config->version is %u; this library reads versions 1 to %d; fill the "
                     "config with its *_config_init call or EPX_*_CONFIG_INIT",
                     caller, (unsigned)header.version, EPX_CONFIG_VERSION);
  memcpy(full, given, header.struct_size);
  epx_config_header_t mine = {(uint32_t)full_size, EPX_CONFIG_VERSION};
  memcpy(full, &mine, sizeof mine);
  return EPX_SUCCESS;
}

/* Writes the first struct_size bytes of `defaults` (so an older caller's
 * smaller struct is never written past its end) and sets struct_size. */
static epx_status_t config_init(const char *caller, const char *type, void *config,
                                size_t struct_size, const void *defaults, size_t full_size) {
  if (!config)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: config is NULL; pass the %s to fill", caller,
                     type);
  epx_status_t status = epx_config_check_size(caller, type, struct_size, full_size);
  if (status != EPX_SUCCESS) return status;
  memcpy(config, defaults, struct_size);
  ((epx_config_header_t *)config)->struct_size = (uint32_t)struct_size;
  return EPX_SUCCESS;
}

epx_status_t epx_route_config_init(epx_route_config_t *config, size_t struct_size) {
  static const epx_route_config_t defaults = EPX_ROUTE_CONFIG_INIT;
  epx_error_clear();
  return config_init("epx_route_config_init", "epx_route_config_t", config, struct_size, &defaults,
                     sizeof defaults);
}

epx_status_t epx_comm_config_init(epx_comm_config_t *config, size_t struct_size) {
  static const epx_comm_config_t defaults = EPX_COMM_CONFIG_INIT;
  epx_error_clear();
  return config_init("epx_comm_config_init", "epx_comm_config_t", config, struct_size, &defaults,
                     sizeof defaults);
}

epx_status_t epx_buffer_config_init(epx_buffer_config_t *config, size_t struct_size) {
  static const epx_buffer_config_t defaults = EPX_BUFFER_CONFIG_INIT;
  epx_error_clear();
  return config_init("epx_buffer_config_init", "epx_buffer_config_t", config, struct_size,
                     &defaults, sizeof defaults);
}
