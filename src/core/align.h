/* Byte counts rounded up to an alignment: the one formula every layer's
 * carving of a block into parts uses. Usable from C and CUDA host code. */
#ifndef EPX_CORE_ALIGN_H
#define EPX_CORE_ALIGN_H

#include <stddef.h>

/* n rounded up to a multiple of `to` (> 0). */
static inline size_t epx_align_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* n rounded up to 256 bytes: each part of a carved device block starts as
 * aligned as a cudaMalloc allocation of its own would (and as every vector
 * or bulk copy of it needs). */
static inline size_t epx_round256(size_t n) { return epx_align_up(n, 256); }

#endif
