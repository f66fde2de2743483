/* fp8 dispatch on the CPU: each token's e4m3 row and its scales are packed
 * into one row (the row's H bytes, then its scales, padded to 16 bytes),
 * moved by the moves of epx_dispatch as opaque rows (so every exchange,
 * layout and transport moves the same bytes), and unpacked into recv_x_q
 * and recv_scales. Quantize-on-dispatch quantizes straight into the packed
 * rows: once per token, however many experts and ranks it goes to. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/fp8.h"
#include "core/payload.h"
#include "cpu/cpu.h"
#include "cpu/exchange.h"
#include "cpu/omp.h"

typedef struct {
  int64_t hidden;       /* H: a row's e4m3 bytes */
  int64_t scale_bytes;  /* a row's scales */
  size_t packed;        /* a packed row: H + scale_bytes, rounded up to 16 */
} packing_t;

static packing_t packing_of(epx_buffer_t b) {
  epx_payload_format_t f = epx_payload_fp8(b->config.fp8_format, b->config.dtype, b->config.hidden);
  packing_t k;
  k.hidden = f.row_bytes;
  k.scale_bytes = f.scale_bytes;
  k.packed = (size_t)(f.row_bytes + f.scale_bytes + EPX_PAYLOAD_VECTOR_BYTES - 1) / EPX_PAYLOAD_VECTOR_BYTES *
             EPX_PAYLOAD_VECTOR_BYTES;
  return k;
}

/* Rows of the packing, 64-byte aligned (aligned_alloc wants a multiple). */
static void *packed_rows(const packing_t *k, int64_t rows) {
  size_t bytes = ((size_t)(rows > 0 ? rows : 1) * k->packed + 63) / 64 * 64;
  return aligned_alloc(64, bytes);
}

/* Quantizing is the costly part: split the tokens over the cores when there
 * are enough of them to pay for waking the cores (as move.c does). */
static void pack(epx_buffer_t b, const packing_t *k, int64_t T, const void *x, const void *x_scales, int quantize,
                 char *send) {
  const epx_fp8_format_t format = b->config.fp8_format;
  const epx_dtype_t dtype = b->config.dtype;
  const size_t x_row = quantize ? (size_t)k->hidden * epx_dtype_size(dtype) : (size_t)k->hidden;
  EPX_OMP(parallel for schedule(static) if (quantize && T * k->hidden >= ((int64_t)1 << 20)))
  for (int64_t t = 0; t < T; t++) {
    char *row = send + (size_t)t * k->packed;
    const char *src = (const char *)x + (size_t)t * x_row;
    if (quantize) {
      epx_fp8_quantize_row(format, dtype, src, k->hidden, (uint8_t *)row, row + k->hidden);
    } else {
      memcpy(row, src, (size_t)k->hidden);
      memcpy(row + k->hidden, (const char *)x_scales + (size_t)t * (size_t)k->scale_bytes, (size_t)k->scale_bytes);
    }
    memset(row + k->hidden + k->scale_bytes, 0, k->packed - (size_t)(k->hidden + k->scale_bytes));
  }
}

static void unpack(const packing_t *k, int64_t N, const char *recv, void *recv_x_q, void *recv_scales) {
  for (int64_t i = 0; i < N; i++) {
    const char *row = recv + (size_t)i * k->packed;
    memcpy((char *)recv_x_q + (size_t)i * (size_t)k->hidden, row, (size_t)k->hidden);
    memcpy((char *)recv_scales + (size_t)i * (size_t)k->scale_bytes, row + k->hidden, (size_t)k->scale_bytes);
  }
}

epx_status_t epx_cpu_dispatch_fp8(epx_buffer_t b, epx_handle_t h, epx_status_t local, const void *x,
                                  const void *x_scales, int quantize, void *recv_x_q, void *recv_scales) {
  const char *fn = quantize ? "epx_dispatch_quantize" : "epx_dispatch_fp8";
  const packing_t k = packing_of(b);
  const int64_t T = h->num_tokens, N = h->recv_rows;
  char *send = NULL, *recv = NULL;
  /* A rank without staging still takes part, refusing, so its peers are
   * not left waiting. */
  if (local == EPX_SUCCESS) {
    send = packed_rows(&k, T);
    recv = packed_rows(&k, N);
    if (!send || !recv) local = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for the packed rows", fn);
  }
  if (local == EPX_SUCCESS) pack(b, &k, T, x, x_scales, quantize, send);
  epx_status_t status = epx_cpu_dispatch_rows(b, h, local, fn,
                                              quantize ? EPX_CALL_DISPATCH_QUANTIZE : EPX_CALL_DISPATCH_FP8,
                                              send, recv, k.packed);
  if (status == EPX_SUCCESS) unpack(&k, N, recv, recv_x_q, recv_scales);
  free(send);
  free(recv);
  return status;
}
