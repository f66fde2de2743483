/* fp8 dispatch on the CPU: the moves of epx_dispatch with two planes, each
 * token's e4m3 row (H bytes) and its scales moved together row for row
 * (move.c, epx_cpu_dispatch_planes), straight from x_q and x_scales to
 * recv_x_q and recv_scales: one rank and the local transport read the
 * sources where they are; a staging transport (MPI, the hierarchical hops)
 * sends a row and its scales as one. Every exchange, layout and transport
 * moves the same bytes. Quantize-on-dispatch quantizes each token once into
 * the buffer's staging, then moves it the same way. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/fp8.h"
#include "core/payload.h"
#include "cpu/cpu.h"
#include "cpu/exchange.h"
#include "cpu/omp.h"

/* x [T, H] of the buffer's dtype -> q [T, H] and scales [T, S]. Quantizing
 * is the costly part: the tokens are split over the cores when there are
 * enough of them to pay for waking the cores (as move.c does). */
static void quantize_rows(epx_buffer_t b, int64_t T, const void *x, uint8_t *q, uint8_t *scales, int64_t S) {
  const epx_fp8_format_t format = b->config.fp8_format;
  const epx_dtype_t dtype = b->config.dtype;
  const int64_t H = b->config.hidden;
  const size_t x_row = (size_t)H * (size_t)epx_dtype_bytes(dtype);
  EPX_OMP(parallel for schedule(static) if (T * H >= ((int64_t)1 << 20)))
  for (int64_t t = 0; t < T; t++)
    epx_fp8_quantize_row(format, dtype, (const char *)x + (size_t)t * x_row, H, q + (size_t)(t * H),
                         scales + (size_t)(t * S));
}

epx_status_t epx_cpu_dispatch_fp8(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *x,
                                  const void *x_scales, int quantize, void *recv_x_q, void *recv_scales) {
  const char *fn = quantize ? "epx_dispatch_quantize" : "epx_dispatch_fp8";
  const epx_payload_format_t f = epx_payload_fp8(b->config.fp8_format, b->config.dtype, b->config.hidden);
  const int64_t T = h->num_tokens, H = f.row_bytes, S = f.scale_bytes;
  const void *rows = x, *scales = x_scales;
  if (quantize && local == EPX_SUCCESS) {
    /* the rows first (each 16-byte aligned, as the moves read them: H is a
     * multiple of 32), their scales after; a rank without staging still
     * takes part, refusing, so its peers are not left waiting */
    struct epx_cpu_scratch *s = b->cpu;
    local = epx_cpu_ensure(&s->fp8, &s->fp8_bytes, (size_t)(T * (H + S)), fn);
    if (local == EPX_SUCCESS) {
      uint8_t *q = s->fp8, *sc = q + (size_t)(T * H);
      quantize_rows(b, T, x, q, sc, S);
      rows = q, scales = sc;
    }
  }
  return epx_cpu_dispatch_planes(b, h, local, fn, quantize ? EPX_CALL_DISPATCH_QUANTIZE : EPX_CALL_DISPATCH_FP8,
                                 rows, scales, recv_x_q, recv_scales, (size_t)H, (size_t)S);
}
