/* A process-wide table of live library objects, and the values callers hold.
 *
 * A public handle (epx_comm_t, epx_buffer_t, epx_handle_t, epx_recorder_t,
 * epx_local_world_t) is not the object's address: it encodes a slot of this
 * table and the slot's generation, and the library never dereferences it.
 * Every public call turns it back into the object with epx_registry_get,
 * which refuses a value whose slot has since been freed or reused (its
 * generation moved on) or that holds another kind of object. A stale value
 * therefore stays refused even when a new object lands at the old address,
 * and the table's size follows the most objects alive at once, never how
 * many addresses the allocator handed out. */
#ifndef EPX_CORE_REGISTRY_H
#define EPX_CORE_REGISTRY_H

#include <stddef.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum epx_object_kind {
  EPX_OBJECT_COMM = 1,
  EPX_OBJECT_LOCAL_WORLD = 2,
  EPX_OBJECT_BUFFER = 3,
  EPX_OBJECT_HANDLE = 4,
  EPX_OBJECT_RECORDER = 5
} epx_object_kind_t;

/* Registers object; *id is the value to give the caller (never NULL). */
epx_status_t epx_registry_add(void *object, epx_object_kind_t kind, void **id);
/* The object registered under id with that kind; NULL when id is NULL, was
 * never given out, has been removed, or names another kind. */
void *epx_registry_get(const void *id, epx_object_kind_t kind);
/* Retires id: it and every copy of it are refused from now on. */
void epx_registry_remove(const void *id);
/* Slots the table holds (live or free): bounded by the most objects alive at
 * once. For tests. */
size_t epx_registry_capacity(void);

#ifdef __cplusplus
}
#endif

#endif
