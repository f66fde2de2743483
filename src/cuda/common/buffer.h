/* A buffer as the CUDA backend's host glue reads it (one/, ep/, ll/): the
 * stream its work is enqueued on, and whether a reduction's partials
 * travel as float32 rows. */
#ifndef EPX_CUDA_COMMON_BUFFER_H
#define EPX_CUDA_COMMON_BUFFER_H

#include <cuda_runtime_api.h>

#include "core/objects.h"
#include "epx.h"

static inline cudaStream_t stream_of(epx_buffer_t b) { return (cudaStream_t)b->config.stream; }

/* Whether partials of `precision` travel as float32 rows: they differ from
 * the dtype's only for a 16-bit dtype. combine takes the buffer's
 * combine_precision, dispatch_backward float32 always (epx.h). */
static inline int f32_partials(epx_buffer_t b, epx_combine_precision_t precision) {
  return precision == EPX_COMBINE_PARTIALS_FLOAT32 && b->config.dtype != EPX_FLOAT32;
}

#endif
