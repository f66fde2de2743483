/* What the public entry points in src/api share (internal to src/api): the
 * checks that an argument is a live object of the library, and the one place
 * a handle's memory is freed. Each src/api file holds one concern: buffer.c
 * (buffers), handle.c (handle lifetime and queries), layout.c
 * (epx_dispatch_layout and replay), payload.c (dispatch, combine and their
 * backward passes), recorder.c, route.c, backends.c (device -> backend). */
#ifndef EPX_API_API_H
#define EPX_API_API_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

/* Payload tensors are moved in 16-byte vectors. */
#define EPX_PAYLOAD_ALIGNMENT 16

static inline int epx_is_aligned(const void *p, size_t alignment) {
  return ((uintptr_t)p % alignment) == 0;
}

/* The values callers hold are registry ids (core/registry.h): each check
 * turns the caller's value into the object in place, or refuses it, so
 * nothing past a check ever sees an id. */

/* *comm is a live comm (not NULL, not destroyed); the error names caller. */
epx_status_t epx_check_comm(epx_comm_t *comm, const char *caller);

/* *buffer is a live buffer (not NULL, not destroyed); the error names caller. */
epx_status_t epx_check_buffer(epx_buffer_t *buffer, const char *caller);

/* As epx_check_buffer, and the buffer's comm not failed: a collective
 * call's first check (a refusal here returns at once: no comm to agree on). */
epx_status_t epx_check_collective_buffer(epx_buffer_t *buffer, const char *caller);

/* *handle is a live handle the caller holds, and (when buffer, an object, is
 * not NULL) one of buffer's. */
epx_status_t epx_check_handle(epx_buffer_t buffer, epx_handle_t *handle, const char *caller);

/* The routing of a layout on buffer b (shape, pointers, the batch against
 * max_tokens_per_rank, the backend's value checks); errors name fn. */
epx_status_t epx_check_routing(epx_buffer_t b, const epx_routing_t *r, const char *fn);

/* *out: a new handle of buffer for routing, the caller's one reference
 * (the layout and the backend's part still to fill); the error names fn.
 * The normal and the low-latency layouts both make theirs here. */
epx_status_t epx_handle_new(const char *fn, epx_buffer_t buffer, const epx_routing_t *routing, epx_handle_t *out);

/* Frees a handle whose last reference is gone (the caller's and the
 * recorders'): retires its id, releases the backend's layout and the
 * buffer's count of live handles. */
void epx_handle_free(epx_handle_t handle);

#endif
