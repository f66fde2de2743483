/* A buffer config as the tests and the GPU benchmarks start it:
 * EPX_BUFFER_CONFIG_INIT with the device, the dtype, the shape and
 * max_tokens_per_rank (0: agreed by the first dispatch) set; the caller sets
 * the rest. Header-only, so the benchmarks built without the test library
 * use it too. */
#ifndef EPX_TEST_BUFFER_CONFIG_H
#define EPX_TEST_BUFFER_CONFIG_H

#include <stdint.h>

#include "epx.h"

static inline epx_buffer_config_t tu_config(epx_device_t device, epx_dtype_t dtype, int64_t hidden,
                                            int32_t num_experts, int32_t max_top_k, int64_t max_tokens) {
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.device = device;
  c.dtype = dtype;
  c.hidden = hidden;
  c.num_experts = num_experts;
  c.max_top_k = max_top_k;
  c.max_tokens_per_rank = max_tokens;
  return c;
}

#endif
