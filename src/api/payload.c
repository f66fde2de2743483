/* The public payload calls on a handle: dispatch, combine and their
 * backward passes. Every check that can be made on the host is made here,
 * before any data moves; the backend agrees each rank's verdict with its
 * peers, so the backends only act on calls valid on every rank. */
#include <stdint.h>

#include "api/api.h"
#include "api/ll.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/objects.h"
#include "core/transport.h"

/* A payload tensor argument: NULL allowed only when it has no rows. */
static epx_status_t check_payload(const void *p, int64_t rows, const char *fn, const char *name,
                                  const char *shape) {
  if (rows > 0 && !p)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: %s is NULL; pass a %s tensor", fn, name, shape);
  if (!epx_is_aligned(p, EPX_PAYLOAD_ALIGNMENT))
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: %s is not 16-byte aligned; allocate it with 16-byte alignment", fn, name);
  return EPX_SUCCESS;
}

/* An output that is the very pointer of one of the call's inputs: the overlap
 * a caller makes by mistake (epx.h, "Aliasing"). NULL (no rows) aliases
 * nothing. */
static epx_status_t check_alias(const void *out, const void *in, const char *fn, const char *out_name,
                                const char *in_name, const char *shape) {
  if (out && out == in)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: %s aliases %s; pass a separate %s tensor", fn,
                     out_name, in_name, shape);
  return EPX_SUCCESS;
}

/* recv tensors that hold the handle's rows: its bound, or N once
 * epx_handle_recv_rows has read N (an exact-size receive tensor). */
static epx_status_t check_recv_capacity(epx_handle_t handle, int64_t recv_rows_capacity, const char *fn,
                                        const char *names) {
  const int64_t needed = handle->rows_read >= 0 ? handle->rows_read : handle->recv_rows;
  if (recv_rows_capacity >= needed) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                   "%s: recv_rows_capacity %lld is below the handle's %lld rows; size %s with "
                   "epx_handle_recv_rows (or epx_buffer_max_recv_rows)", fn, (long long)recv_rows_capacity,
                   (long long)needed, names);
}

/* The checks every payload call starts with; they turn the caller's buffer
 * and handle values into the objects. A NULL or dead buffer returns at
 * once (there is no comm to agree with); a bad handle on a live CPU buffer is
 * agreed here, meeting the peers' agree() of the same call, so they refuse it
 * too instead of pairing their call with this rank's next one; so is any
 * payload call on a low-latency buffer (it serves the epx_ll_* calls). */
static epx_status_t begin_payload(epx_buffer_t *buffer, epx_handle_t *handle, const char *fn) {
  epx_error_clear();
  epx_status_t status = epx_check_buffer(buffer, fn);
  if (status != EPX_SUCCESS) return status;
  status = epx_comm_check_alive((*buffer)->comm, fn);
  if (status != EPX_SUCCESS) return status;
  status = epx_check_handle(*buffer, handle, fn);
  if (status == EPX_SUCCESS) status = epx_ll_refuse(*buffer, fn);
  if (status != EPX_SUCCESS) return (*buffer)->backend->agree(*buffer, status, fn);
  return status;
}

epx_status_t epx_dispatch(epx_buffer_t buffer, epx_handle_t handle, const void *x, void *recv_x,
                          int64_t recv_rows_capacity) {
  const char *fn = "epx_dispatch";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(x, handle->num_tokens, fn, "x", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS) local = check_payload(recv_x, handle->recv_rows, fn, "recv_x", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS) local = check_alias(recv_x, x, fn, "recv_x", "x", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS) local = check_recv_capacity(handle, recv_rows_capacity, fn, "recv_x");
  return buffer->backend->dispatch(buffer, handle, local, x, recv_x);
}

/* A scales tensor of the buffer's fp8 format: NULL only without rows,
 * aligned to its entries (float32 and packed UE8M0 words: 4 bytes). */
static epx_status_t check_scales(epx_buffer_t buffer, const void *p, int64_t rows, const char *fn, const char *name) {
  size_t align = (size_t)epx_fp8_scale_col_bytes(buffer->config.fp8_format);
  if (rows > 0 && !p)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: %s is NULL; pass a [rows, scale_cols] tensor "
                     "(epx_fp8_scale_shape)", fn, name);
  if (!epx_is_aligned(p, align))
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: %s is not %zu-byte aligned; align it to its entries",
                     fn, name, align);
  return EPX_SUCCESS;
}

/* The checks of both fp8 dispatches; x_scales is NULL when quantizing. */
static epx_status_t check_fp8_dispatch(epx_buffer_t buffer, epx_handle_t handle, const char *fn, const void *x,
                                       const void *x_scales, int quantize, void *recv_x_q, void *recv_scales,
                                       int64_t recv_rows_capacity) {
  const int64_t T = handle->num_tokens, N = handle->recv_rows;
  if (buffer->config.fp8_format == EPX_FP8_NONE)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: the buffer's config.fp8_format is EPX_FP8_NONE; create "
                     "the buffer with an fp8 format, or move rows of its dtype with epx_dispatch", fn);
  if (handle->weighting == EPX_WEIGHTS_IN_DISPATCH)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: the handle's weighting is EPX_WEIGHTS_IN_DISPATCH, but "
                     "fp8 rows are moved unscaled; lay out with EPX_WEIGHTS_IN_COMBINE or EPX_WEIGHTS_NONE", fn);
  epx_status_t status = quantize ? check_payload(x, T, fn, "x", "[num_tokens, hidden] (the buffer's dtype)")
                                 : check_payload(x, T, fn, "x_q", "[num_tokens, hidden] e4m3");
  if (status == EPX_SUCCESS && !quantize) status = check_scales(buffer, x_scales, T, fn, "x_scales");
  if (status == EPX_SUCCESS) status = check_payload(recv_x_q, N, fn, "recv_x_q", "[recv_rows, hidden] e4m3");
  if (status == EPX_SUCCESS) status = check_scales(buffer, recv_scales, N, fn, "recv_scales");
  if (status == EPX_SUCCESS) status = check_alias(recv_x_q, x, fn, "recv_x_q", quantize ? "x" : "x_q", "[recv_rows, hidden]");
  if (status == EPX_SUCCESS) status = check_alias(recv_scales, x_scales, fn, "recv_scales", "x_scales", "[recv_rows, scale_cols]");
  if (status == EPX_SUCCESS) status = check_alias(recv_scales, recv_x_q, fn, "recv_scales", "recv_x_q", "[recv_rows, scale_cols]");
  if (status == EPX_SUCCESS) status = check_recv_capacity(handle, recv_rows_capacity, fn, "recv_x_q and recv_scales");
  return status;
}

/* The verdict on a path without fp8 dispatch (buffers with an fp8 format
 * are refused where it is missing; a test hook can still route one there). */
static epx_status_t no_fp8_path(epx_status_t local, const char *fn) {
  if (local != EPX_SUCCESS) return local;
  return epx_error(EPX_ERROR_UNSUPPORTED, "%s: this buffer's path has no fp8 dispatch in this version; use "
                   "epx_dispatch", fn);
}

/* Both fp8 dispatches: x is e4m3 rows with x_scales, or (quantize) rows of
 * the buffer's dtype quantized on the way (x_scales NULL). */
static epx_status_t fp8_dispatch(epx_buffer_t buffer, epx_handle_t handle, const char *fn, const void *x,
                                 const void *x_scales, int quantize, void *recv_x_q, void *recv_scales,
                                 int64_t recv_rows_capacity) {
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_fp8_dispatch(buffer, handle, fn, x, x_scales, quantize, recv_x_q, recv_scales,
                                          recv_rows_capacity);
  if (!buffer->backend->dispatch_fp8) return buffer->backend->agree(buffer, no_fp8_path(local, fn), fn);
  return buffer->backend->dispatch_fp8(buffer, handle, local, x, x_scales, quantize, recv_x_q, recv_scales);
}

epx_status_t epx_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, const void *x_q, const void *x_scales,
                              void *recv_x_q, void *recv_scales, int64_t recv_rows_capacity) {
  return fp8_dispatch(buffer, handle, "epx_dispatch_fp8", x_q, x_scales, 0, recv_x_q, recv_scales,
                      recv_rows_capacity);
}

epx_status_t epx_dispatch_quantize(epx_buffer_t buffer, epx_handle_t handle, const void *x, void *recv_x_q,
                                   void *recv_scales, int64_t recv_rows_capacity) {
  return fp8_dispatch(buffer, handle, "epx_dispatch_quantize", x, NULL, 1, recv_x_q, recv_scales,
                      recv_rows_capacity);
}

epx_status_t epx_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out, void *out) {
  const char *fn = "epx_combine";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(expert_out, handle->recv_rows, fn, "expert_out", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS) local = check_payload(out, handle->num_tokens, fn, "out", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS) local = check_alias(out, expert_out, fn, "out", "expert_out", "[num_tokens, hidden]");
  return buffer->backend->combine(buffer, handle, local, expert_out, out);
}

epx_status_t epx_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle, const void *grad_recv_x,
                                   void *grad_x, const void *x, float *grad_w) {
  const char *fn = "epx_dispatch_backward";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(grad_recv_x, handle->recv_rows, fn, "grad_recv_x", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS) local = check_payload(grad_x, handle->num_tokens, fn, "grad_x", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS && handle->weighting != EPX_WEIGHTS_IN_DISPATCH && (x || grad_w))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                      "%s: %s is given but the handle's weights were not applied in dispatch; pass NULL "
                      "(with EPX_WEIGHTS_IN_COMBINE the weight gradient comes from epx_combine_backward)",
                      fn, grad_w ? "grad_w" : "x");
  if (local == EPX_SUCCESS && grad_w) {
    local = check_payload(x, handle->num_tokens, fn, "x", "[num_tokens, hidden] (the forward's input, needed for grad_w)");
    if (local == EPX_SUCCESS && !epx_is_aligned(grad_w, 4))
      local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: grad_w is not 4-byte aligned", fn);
  }
  if (local == EPX_SUCCESS)
    local = check_alias(grad_x, grad_recv_x, fn, "grad_x", "grad_recv_x", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS) local = check_alias(grad_x, x, fn, "grad_x", "x", "[num_tokens, hidden]");
  return buffer->backend->dispatch_backward(buffer, handle, local, grad_recv_x, grad_x, x, grad_w);
}

epx_status_t epx_combine_backward(epx_buffer_t buffer, epx_handle_t handle, const void *grad_out,
                                  const void *expert_out, void *grad_expert_out, float *grad_w) {
  const char *fn = "epx_combine_backward";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = check_payload(grad_out, handle->num_tokens, fn, "grad_out", "[num_tokens, hidden]");
  if (local == EPX_SUCCESS)
    local = check_payload(grad_expert_out, handle->recv_rows, fn, "grad_expert_out", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS && handle->weighting != EPX_WEIGHTS_IN_COMBINE && (expert_out || grad_w))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                      "%s: %s is given but the handle's weights were not applied in combine; pass NULL "
                      "(with EPX_WEIGHTS_IN_DISPATCH the weight gradient comes from epx_dispatch_backward)",
                      fn, grad_w ? "grad_w" : "expert_out");
  if (local == EPX_SUCCESS && grad_w) {
    local = check_payload(expert_out, handle->recv_rows, fn, "expert_out",
                          "[recv_rows, hidden] (the forward's input, needed for grad_w)");
    if (local == EPX_SUCCESS && !epx_is_aligned(grad_w, 4))
      local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: grad_w is not 4-byte aligned", fn);
  }
  if (local == EPX_SUCCESS)
    local = check_alias(grad_expert_out, grad_out, fn, "grad_expert_out", "grad_out", "[recv_rows, hidden]");
  if (local == EPX_SUCCESS)
    local = check_alias(grad_expert_out, expert_out, fn, "grad_expert_out", "expert_out", "[recv_rows, hidden]");
  return buffer->backend->combine_backward(buffer, handle, local, grad_out, expert_out, grad_expert_out, grad_w);
}

epx_status_t epx_weights_backward(epx_buffer_t buffer, epx_handle_t handle, const float *grad_recv_w,
                                  float *grad_w) {
  const char *fn = "epx_weights_backward";
  epx_status_t status = begin_payload(&buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = EPX_SUCCESS;
  if (handle->recv_rows > 0 && !grad_recv_w)
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                      "%s: grad_recv_w is NULL; pass the gradient of epx_handle_recv_routing's recv_w "
                      "([recv_rows], or [recv_rows, top_k] for the rank-major layout)", fn);
  else if (handle->num_tokens > 0 && !grad_w)
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: grad_w is NULL; pass a [num_tokens, top_k] float array", fn);
  else if (!epx_is_aligned(grad_recv_w, 4) || !epx_is_aligned(grad_w, 4))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: %s is not 4-byte aligned", fn,
                      epx_is_aligned(grad_w, 4) ? "grad_recv_w" : "grad_w");
  else
    local = check_alias(grad_w, grad_recv_w, fn, "grad_w", "grad_recv_w", "[num_tokens, top_k] float");
  return buffer->backend->weights_backward(buffer, handle, local, grad_recv_w, grad_w);
}
