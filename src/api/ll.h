/* The low-latency decode mode's hooks into the rest of src/api (internal):
 * its config rules at buffer creation, its receive bound, and its refusal of
 * the normal calls. The epx_ll_* entry points are in ll.c. */
#ifndef EPX_API_LL_H
#define EPX_API_LL_H

#include <stdint.h>

#include "epx.h"

/* A config with low_latency set: a device that serves the mode, an
 * expert-major or rank-major layout without padding (the backend refuses
 * what it does not serve: cuda/ll/ll.c rank-major on one GPU), and
 * max_tokens_per_rank fixed (0 becomes
 * EPX_LL_DEFAULT_MAX_TOKENS, in *c). Success at once when low_latency is 0. */
epx_status_t epx_ll_check_config(epx_buffer_config_t *c);

/* The fixed receive rows of a low-latency config (E_local * W * max_tokens
 * expert-major, W * max_tokens rank-major), checked to fit the layout's
 * int32 row indices; errors name fn. */
epx_status_t epx_ll_recv_rows_bound(const char *fn, const epx_buffer_config_t *c, int64_t W,
                                    int64_t max_tokens, int64_t *rows);

/* EPX_ERROR_UNSUPPORTED naming the mode when buffer (an object) is a
 * low-latency buffer and fn one of the normal calls, or naming the mask
 * when a rank of a normal buffer's comm is masked; else success. */
epx_status_t epx_ll_refuse(epx_buffer_t buffer, const char *fn);

#endif
