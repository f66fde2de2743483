/* The low-latency decode mode's backend interface (epx.h, "Low-latency
 * decode"): what a device implements to serve config.low_latency buffers,
 * beside its epx_backend_t. src/api/ll.c has checked every argument it can
 * on the host and passes the rank's verdict `local`, which the sends agree
 * with the peers like every collective call (core/backend.h). */
#ifndef EPX_CORE_LL_H
#define EPX_CORE_LL_H

#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a dispatch moves: rows of the buffer's dtype, or (fp8) e4m3 rows in
 * the buffer's fp8_format with their scales, quantized from x on the way
 * when x_scales is NULL. */
typedef struct epx_ll_rows {
  const void *x;        /* [T, H] */
  const void *x_scales; /* fp8 with pre-quantized rows: [T, scale_cols]; else NULL */
  void *recv_x;         /* the fixed shape */
  void *recv_scales;    /* fp8: [rows of the fixed shape, scale_cols]; else NULL */
  int32_t fp8;
} epx_ll_rows_t;

/* The send a handle waits to complete. */
typedef enum { EPX_LL_NONE = 0, EPX_LL_DISPATCH = 1, EPX_LL_COMBINE = 2 } epx_ll_phase_t;

typedef struct epx_ll_backend {
  /* Collective: the handle's layout in the fixed shape and the rows of
   * routing, recv_count (may be NULL) filled; leaves EPX_LL_DISPATCH
   * pending. num_tokens: the step's count in device memory (routing's
   * num_tokens is then the rows of its arrays), or NULL when
   * routing->num_tokens is the count (on the CPU the API has read it). */
  epx_status_t (*dispatch_send)(epx_buffer_t buffer, const epx_routing_t *routing, epx_status_t local,
                                epx_handle_t handle, const epx_ll_rows_t *rows, int32_t *recv_count,
                                const int32_t *num_tokens);
  /* Collective: the weighted sums of the step; leaves EPX_LL_COMBINE pending. */
  epx_status_t (*combine_send)(epx_buffer_t buffer, epx_handle_t handle, epx_status_t local,
                               const void *expert_out, void *out);
  epx_ll_phase_t (*pending)(epx_handle_t handle);
  /* Finishes the pending send (the API checked there is one). */
  epx_status_t (*complete)(epx_buffer_t buffer, epx_handle_t handle);
} epx_ll_backend_t;

#ifdef __cplusplus
}
#endif

#endif
