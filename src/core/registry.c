/* The live-object table: a growable array of slots, a free list, one mutex.
 * A public id is (generation << SLOT_BITS) | (slot + 1); removing an object
 * bumps its slot's generation, so every id given out for the slot before is
 * refused from then on. Lookups happen once per public call, far from any
 * per-row loop. */
#include "core/registry.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/error.h"

_Static_assert(sizeof(void *) == 8, "public ids pack a slot and a generation in 64 bits");

#define SLOT_BITS 24
#define MAX_SLOTS ((1u << SLOT_BITS) - 1)               /* slot + 1 must fit SLOT_BITS */
#define MAX_GENERATION ((UINT64_C(1) << (64 - SLOT_BITS)) - 1)
#define NO_SLOT UINT32_MAX

typedef struct {
  void *object;        /* NULL: free (on the free list) or retired */
  uint64_t generation; /* of the current object, or of the next one when free */
  uint32_t next_free;
  epx_object_kind_t kind;
} registry_slot_t;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static registry_slot_t *slots;
static uint32_t slot_count;
static uint32_t free_head = NO_SLOT;

static void *encode(uint32_t slot, uint64_t generation) {
  return (void *)(uintptr_t)((generation << SLOT_BITS) | (uint64_t)(slot + 1));
}

/* The slot an id names if its generation is current, else NULL. Lock held. */
static registry_slot_t *decode(const void *id) {
  uint64_t value = (uint64_t)(uintptr_t)id;
  uint64_t slot = (value & MAX_SLOTS) - 1; /* wraps to huge for slot bits 0 */
  if (slot >= slot_count) return NULL;
  registry_slot_t *s = &slots[slot];
  if (!s->object || s->generation != value >> SLOT_BITS) return NULL;
  return s;
}

/* Doubles the table and threads the new slots onto the free list. */
static int grow(void) {
  uint32_t new_count = slot_count ? slot_count * 2 : 64;
  if (new_count > MAX_SLOTS) new_count = MAX_SLOTS;
  if (new_count <= slot_count) return 0;
  registry_slot_t *grown = realloc(slots, (size_t)new_count * sizeof *grown);
  if (!grown) return 0;
  for (uint32_t i = slot_count; i < new_count; i++)
    grown[i] = (registry_slot_t){NULL, 1, i + 1 < new_count ? i + 1 : free_head, 0};
  free_head = slot_count;
  slots = grown;
  slot_count = new_count;
  return 1;
}

epx_status_t epx_registry_add(void *object, epx_object_kind_t kind, void **id) {
  pthread_mutex_lock(&registry_lock);
  if (free_head == NO_SLOT && !grow()) {
    pthread_mutex_unlock(&registry_lock);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY,
                     "epx: out of memory registering an object (%u objects alive)", slot_count);
  }
  uint32_t slot = free_head;
  registry_slot_t *s = &slots[slot];
  free_head = s->next_free;
  s->object = object;
  s->kind = kind;
  *id = encode(slot, s->generation);
  pthread_mutex_unlock(&registry_lock);
  return EPX_SUCCESS;
}

void *epx_registry_get(const void *id, epx_object_kind_t kind) {
  if (!id) return NULL;
  pthread_mutex_lock(&registry_lock);
  registry_slot_t *s = decode(id);
  void *object = s && s->kind == kind ? s->object : NULL;
  pthread_mutex_unlock(&registry_lock);
  return object;
}

void epx_registry_remove(const void *id) {
  if (!id) return;
  pthread_mutex_lock(&registry_lock);
  registry_slot_t *s = decode(id);
  if (s) {
    s->object = NULL;
    /* A slot whose generations are spent is retired rather than let an old
     * id come back to life: one slot lost per 2^40 reuses. */
    if (++s->generation <= MAX_GENERATION) {
      s->next_free = free_head;
      free_head = (uint32_t)(s - slots);
    }
  }
  pthread_mutex_unlock(&registry_lock);
}

size_t epx_registry_capacity(void) {
  pthread_mutex_lock(&registry_lock);
  size_t count = slot_count;
  pthread_mutex_unlock(&registry_lock);
  return count;
}
