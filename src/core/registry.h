/* A process-wide set of live library objects. Every public call looks its
 * objects up here before touching them, so a handle used after its release or
 * a buffer after its destroy is refused instead of read from freed memory. */
#ifndef EPX_CORE_REGISTRY_H
#define EPX_CORE_REGISTRY_H

#include "epx.h"

typedef enum epx_object_kind {
  EPX_OBJECT_COMM = 1,
  EPX_OBJECT_LOCAL_WORLD = 2,
  EPX_OBJECT_BUFFER = 3,
  EPX_OBJECT_HANDLE = 4,
  EPX_OBJECT_RECORDER = 5
} epx_object_kind_t;

epx_status_t epx_registry_add(const void *object, epx_object_kind_t kind);
void epx_registry_remove(const void *object);
/* 1 if object is live and of that kind. */
int epx_registry_has(const void *object, epx_object_kind_t kind);

#endif
