/* The live-object set: open addressing on the object's address, one mutex.
 * Lookups happen once per public call, far from any per-row loop. */
#include "core/registry.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/error.h"

typedef struct {
  const void *object; /* NULL = empty; TOMBSTONE = removed */
  epx_object_kind_t kind;
} registry_slot_t;

static const char tombstone_marker;
#define TOMBSTONE ((const void *)&tombstone_marker)

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static registry_slot_t *slots;
static size_t slot_count; /* a power of two */
static size_t used;       /* live + tombstones */

static size_t slot_of(const void *object, size_t mask) {
  uintptr_t h = (uintptr_t)object;
  h ^= h >> 17;
  h *= 0x9e3779b97f4a7c15ull;
  return (size_t)(h >> 7) & mask;
}

static int grow(void) {
  size_t new_count = slot_count ? slot_count * 2 : 256;
  registry_slot_t *new_slots = calloc(new_count, sizeof *new_slots);
  if (!new_slots) return 0;
  size_t live = 0;
  for (size_t i = 0; i < slot_count; i++) {
    if (!slots[i].object || slots[i].object == TOMBSTONE) continue;
    size_t j = slot_of(slots[i].object, new_count - 1);
    while (new_slots[j].object) j = (j + 1) & (new_count - 1);
    new_slots[j] = slots[i];
    live++;
  }
  free(slots);
  slots = new_slots;
  slot_count = new_count;
  used = live;
  return 1;
}

epx_status_t epx_registry_add(const void *object, epx_object_kind_t kind) {
  pthread_mutex_lock(&registry_lock);
  if ((used + 1) * 2 > slot_count && !grow()) {
    pthread_mutex_unlock(&registry_lock);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "epx: out of memory registering an object");
  }
  size_t mask = slot_count - 1;
  size_t i = slot_of(object, mask);
  while (slots[i].object && slots[i].object != TOMBSTONE) i = (i + 1) & mask;
  if (!slots[i].object) used++;
  slots[i].object = object;
  slots[i].kind = kind;
  pthread_mutex_unlock(&registry_lock);
  return EPX_SUCCESS;
}

static registry_slot_t *find(const void *object) {
  if (!slot_count) return NULL;
  size_t mask = slot_count - 1;
  for (size_t i = slot_of(object, mask);; i = (i + 1) & mask) {
    if (!slots[i].object) return NULL;
    if (slots[i].object == object) return &slots[i];
  }
}

void epx_registry_remove(const void *object) {
  pthread_mutex_lock(&registry_lock);
  registry_slot_t *slot = find(object);
  if (slot) slot->object = TOMBSTONE;
  pthread_mutex_unlock(&registry_lock);
}

int epx_registry_has(const void *object, epx_object_kind_t kind) {
  if (!object) return 0;
  pthread_mutex_lock(&registry_lock);
  registry_slot_t *slot = find(object);
  int live = slot && slot->kind == kind;
  pthread_mutex_unlock(&registry_lock);
  return live;
}
