/* The routing fingerprint the recorder validates a replay with. */
#include "core/objects.h"

uint64_t epx_hash_topk(const int32_t *topk_idx, int64_t count) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (int64_t i = 0; i < count; i++) {
    uint32_t v = (uint32_t)topk_idx[i];
    for (int byte = 0; byte < 4; byte++) {
      hash ^= (v >> (8 * byte)) & 0xffu;
      hash *= 0x100000001b3ull;
    }
  }
  return hash;
}
