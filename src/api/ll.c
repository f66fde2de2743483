/* The low-latency decode calls (epx.h, "Low-latency decode"): their argument
 * checks, the handle each dispatch makes, the order of the two phases, and
 * the rules a low-latency buffer follows in the rest of src/api (api/ll.h).
 * The device's epx_ll_backend_t (core/ll.h) does the exchange. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "api/backends.h"
#include "api/ll.h"
#include "core/backend.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/ll.h"
#include "core/names.h"
#include "core/objects.h"
#include "core/placement.h"
#include "core/registry.h"
#include "core/transport.h"

/* The buffer's table's implementation of the mode (core/backend.h, ll). */
static const epx_ll_backend_t *ll_ops(epx_buffer_t buffer) { return buffer->backend->ll; }

epx_status_t epx_ll_check_config(epx_buffer_config_t *c) {
  const char *fn = "epx_buffer_create";
  if (c->low_latency == 0) return EPX_SUCCESS;
  EPX_REQUIRE(c->low_latency == 1, "%s: config.low_latency is %d; pass 0 (the normal mode) or 1 (low-latency decode)",
              fn, c->low_latency);
  const epx_backend_t *backend = epx_backend_for_device(c->device);
  if (!backend || !backend->ll)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: config.low_latency = 1 needs a CPU buffer or a CUDA build's CUDA buffer; this build "
                     "has no backend for device %d", fn, (int)c->device);
  char layout[24];
  if (c->layout != EPX_LAYOUT_EXPERT_MAJOR && c->layout != EPX_LAYOUT_RANK_MAJOR)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: config.low_latency = 1 with config.layout %s: the low-latency mode has the fixed shapes "
                     "of EPX_LAYOUT_EXPERT_MAJOR ([E_local, W * max_tokens, H]) and EPX_LAYOUT_RANK_MAJOR "
                     "([W, max_tokens, H]); pass one of them", fn,
                     epx_config_value_text("layout", c->layout, layout, sizeof layout));
  EPX_REQUIRE(c->expert_alignment == 1,
              "%s: config.expert_alignment is %d with config.low_latency = 1; every expert has a fixed block of "
              "W * max_tokens rows there, unpadded: pass 1", fn, c->expert_alignment);
  if (c->max_tokens_per_rank == 0) c->max_tokens_per_rank = EPX_LL_DEFAULT_MAX_TOKENS;
  return EPX_SUCCESS;
}

epx_status_t epx_ll_recv_rows_bound(const char *fn, const epx_buffer_config_t *c, int64_t W, int64_t max_tokens,
                                    int64_t *rows) {
  const char *tokens = "config.max_tokens_per_rank";
  int64_t sum = 0;
  epx_status_t status =
      c->layout == EPX_LAYOUT_RANK_MAJOR
          ? EPX_CHECKED_PRODUCT(&sum, fn, tokens, "world size * max tokens (the low-latency receive rows)", W,
                                max_tokens)
          : EPX_CHECKED_PRODUCT(&sum, fn, tokens,
                                "experts per rank * world size * max tokens (the low-latency receive rows)",
                                epx_config_experts_per_rank(c, W), W, max_tokens);
  if (status != EPX_SUCCESS) return status;
  /* The layout's rows are int32 indices. */
  if (sum > INT32_MAX)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: config.max_tokens_per_rank %lld gives %lld low-latency receive rows per rank, above "
                     "2^31 - 1; pass a smaller config.max_tokens_per_rank", fn, (long long)max_tokens,
                     (long long)sum);
  *rows = sum;
  return EPX_SUCCESS;
}

static int is_backward(const char *fn) {
  return !strcmp(fn, "epx_dispatch_backward") || !strcmp(fn, "epx_combine_backward") ||
         !strcmp(fn, "epx_weights_backward");
}

/* The first rank masked out of the buffer's comm, or -1. */
static int32_t first_masked(epx_comm_t comm) {
  for (int32_t r = 0; comm->masked && r < comm->size; r++)
    if (comm->masked[r]) return r;
  return -1;
}

epx_status_t epx_ll_refuse(epx_buffer_t buffer, const char *fn) {
  int32_t masked = first_masked(buffer->comm);
  if (!buffer->config.low_latency && masked >= 0)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: rank %d of the buffer's comm is masked (epx_ll_mask_rank), which only the low-latency "
                     "calls serve; shrink the comm for the normal calls (epx_comm_shrink)", fn, masked);
  if (!buffer->config.low_latency) return EPX_SUCCESS;
  if (is_backward(fn))
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the buffer is in the low-latency decode mode (config.low_latency = 1), which has no "
                     "backward pass; train on a buffer created with config.low_latency = 0", fn);
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: the buffer is in the low-latency decode mode (config.low_latency = 1), which serves the "
                   "epx_ll_* calls only; use epx_ll_dispatch and epx_ll_combine (or a buffer with "
                   "config.low_latency = 0 for the normal calls)", fn);
}

/* ------------------------------------------------------------------------ */
/* Dispatch                                                                  */
/* ------------------------------------------------------------------------ */

/* The step's routing: *routing, with num_tokens read from *num_tokens on a
 * CPU buffer (host memory); a device count stays on the device, read by the
 * backend's kernels (routing->num_tokens, the arrays' rows, bounds it). */
static epx_status_t step_routing(const char *fn, epx_buffer_t b, const epx_routing_t *routing,
                                 const int32_t *num_tokens, epx_routing_t *step) {
  EPX_REQUIRE(routing, "%s: routing is NULL; pass an epx_routing_t", fn);
  *step = *routing;
  if (!num_tokens || b->config.device != EPX_DEVICE_CPU) return EPX_SUCCESS;
  if (routing->num_tokens > b->max_tokens)
    return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                     "%s: routing.num_tokens %lld (the rows of x and the routing) exceeds the buffer's "
                     "max_tokens_per_rank %lld; create the buffer with a larger config.max_tokens_per_rank", fn,
                     (long long)routing->num_tokens, (long long)b->max_tokens);
  EPX_REQUIRE(epx_is_aligned(num_tokens, 4), "%s: num_tokens is not 4-byte aligned", fn);
  EPX_REQUIRE(*num_tokens >= 0 && *num_tokens <= routing->num_tokens,
              "%s: *num_tokens is %d; pass a count in [0, routing.num_tokens = %lld]", fn, *num_tokens,
              (long long)routing->num_tokens);
  step->num_tokens = *num_tokens;
  return EPX_SUCCESS;
}

/* The fp8 tensors: the buffer's format, scales aligned to their entries. */
static epx_status_t check_fp8_rows(const char *fn, epx_buffer_t b, const epx_ll_rows_t *rows) {
  EPX_REQUIRE(b->config.fp8_format != EPX_FP8_NONE,
              "%s: the buffer's config.fp8_format is EPX_FP8_NONE; create the low-latency buffer with an fp8 "
              "format, or move rows of its dtype with epx_ll_dispatch", fn);
  const size_t align = (size_t)epx_fp8_scale_col_bytes(b->config.fp8_format);
  EPX_REQUIRE(rows->recv_scales, "%s: recv_scales is NULL; pass the [rows of recv_x_q, scale_cols] scales "
              "(epx_fp8_scale_shape)", fn);
  EPX_REQUIRE(epx_is_aligned(rows->recv_scales, align) && epx_is_aligned(rows->x_scales, align),
              "%s: %s is not %zu-byte aligned; align it to its entries", fn,
              epx_is_aligned(rows->recv_scales, align) ? "x_scales" : "recv_scales", align);
  EPX_REQUIRE(rows->recv_scales != rows->recv_x && rows->recv_scales != rows->x_scales,
              "%s: recv_scales aliases another tensor of the call; pass a separate one", fn);
  return EPX_SUCCESS;
}

static epx_status_t check_dispatch(const char *fn, epx_buffer_t b, const epx_routing_t *routing,
                                   const int32_t *num_tokens, const epx_ll_rows_t *rows, const int32_t *recv_count,
                                   epx_handle_t *handle, epx_routing_t *step) {
  const void *x = rows->x, *recv_x = rows->recv_x;
  EPX_REQUIRE(handle, "%s: handle is NULL; pass the address of an epx_handle_t", fn);
  EPX_REQUIRE(b->config.low_latency,
              "%s: the buffer is not a low-latency buffer (config.low_latency = 0); create it with "
              "config.low_latency = 1, or use epx_dispatch_layout and epx_dispatch", fn);
  epx_status_t status = step_routing(fn, b, routing, num_tokens, step);
  if (status != EPX_SUCCESS) return status;
  if (step->weighting == EPX_WEIGHTS_IN_DISPATCH)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: routing.weighting is EPX_WEIGHTS_IN_DISPATCH; the low-latency mode applies the weights "
                     "in combine (EPX_WEIGHTS_IN_COMBINE) or leaves them to the expert (EPX_WEIGHTS_NONE)", fn);
  status = epx_check_routing(b, step, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(x || step->num_tokens == 0, "%s: x is NULL; pass a [num_tokens, hidden] tensor", fn);
  EPX_REQUIRE(recv_x, "%s: recv_x is NULL; pass the %s tensor", fn,
              b->config.layout == EPX_LAYOUT_RANK_MAJOR ? "[W, max_tokens, hidden]" : "[E_local, W * max_tokens, hidden]");
  EPX_REQUIRE(epx_is_aligned(x, EPX_PAYLOAD_ALIGNMENT) && epx_is_aligned(recv_x, EPX_PAYLOAD_ALIGNMENT),
              "%s: %s is not 16-byte aligned; allocate it with 16-byte alignment", fn,
              epx_is_aligned(x, EPX_PAYLOAD_ALIGNMENT) ? "recv_x" : "x");
  EPX_REQUIRE(recv_x != x, "%s: recv_x aliases x; pass a separate receive tensor", fn);
  EPX_REQUIRE(epx_is_aligned(recv_count, 4), "%s: recv_count is not 4-byte aligned", fn);
  return rows->fp8 ? check_fp8_rows(fn, b, rows) : EPX_SUCCESS;
}

/* A handle whose layout failed never reached the registry. */
static void drop_unpublished(epx_handle_t h) {
  if (!h) return;
  h->buffer->backend->handle_fini(h);
  free(h);
}

static epx_status_t ll_dispatch(const char *fn, epx_buffer_t buffer, const epx_routing_t *routing,
                                const int32_t *num_tokens, const epx_ll_rows_t *rows, int32_t *recv_count,
                                epx_handle_t *handle, int complete) {
  epx_error_clear();
  epx_status_t status = epx_check_collective_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_ll_backend_t *ll = ll_ops(buffer);
  epx_routing_t step;
  epx_status_t local = check_dispatch(fn, buffer, routing, num_tokens, rows, recv_count, handle, &step);
  if (!ll) return buffer->backend->agree(buffer, local, fn); /* refused: not a low-latency buffer */
  epx_handle_t h = NULL;
  if (local == EPX_SUCCESS) local = epx_handle_new(fn, buffer, &step, &h);
  const int32_t *device_count = buffer->config.device == EPX_DEVICE_CPU ? NULL : num_tokens;
  status = ll->dispatch_send(buffer, &step, local, h, rows, recv_count, device_count);
  void *id = NULL;
  if (status == EPX_SUCCESS) status = epx_registry_add(h, EPX_OBJECT_HANDLE, &id);
  if (status != EPX_SUCCESS) {
    drop_unpublished(h);
    return status;
  }
  h->id = id;
  __atomic_add_fetch(&buffer->live_handles, 1, __ATOMIC_SEQ_CST);
  *handle = id;
  return complete ? ll->complete(buffer, h) : EPX_SUCCESS;
}

epx_status_t epx_ll_dispatch(epx_buffer_t buffer, const epx_routing_t *routing, const int32_t *num_tokens,
                             const void *x, void *recv_x, int32_t *recv_count, epx_handle_t *handle) {
  const epx_ll_rows_t rows = {x, NULL, recv_x, NULL, 0};
  return ll_dispatch("epx_ll_dispatch", buffer, routing, num_tokens, &rows, recv_count, handle, 1);
}

epx_status_t epx_ll_dispatch_send(epx_buffer_t buffer, const epx_routing_t *routing, const int32_t *num_tokens,
                                  const void *x, void *recv_x, int32_t *recv_count, epx_handle_t *handle) {
  const epx_ll_rows_t rows = {x, NULL, recv_x, NULL, 0};
  return ll_dispatch("epx_ll_dispatch_send", buffer, routing, num_tokens, &rows, recv_count, handle, 0);
}

epx_status_t epx_ll_dispatch_fp8(epx_buffer_t buffer, const epx_routing_t *routing, const int32_t *num_tokens,
                                 const void *x, const void *x_scales, void *recv_x_q, void *recv_scales,
                                 int32_t *recv_count, epx_handle_t *handle) {
  const epx_ll_rows_t rows = {x, x_scales, recv_x_q, recv_scales, 1};
  return ll_dispatch("epx_ll_dispatch_fp8", buffer, routing, num_tokens, &rows, recv_count, handle, 1);
}

epx_status_t epx_ll_dispatch_fp8_send(epx_buffer_t buffer, const epx_routing_t *routing, const int32_t *num_tokens,
                                      const void *x, const void *x_scales, void *recv_x_q, void *recv_scales,
                                      int32_t *recv_count, epx_handle_t *handle) {
  const epx_ll_rows_t rows = {x, x_scales, recv_x_q, recv_scales, 1};
  return ll_dispatch("epx_ll_dispatch_fp8_send", buffer, routing, num_tokens, &rows, recv_count, handle, 0);
}

/* ------------------------------------------------------------------------ */
/* Combine and completion                                                    */
/* ------------------------------------------------------------------------ */

static const char *phase_name(epx_ll_phase_t phase) {
  return phase == EPX_LL_DISPATCH ? "epx_ll_dispatch_send" : "epx_ll_combine_send";
}

static epx_status_t check_combine(const char *fn, const epx_ll_backend_t *ll, epx_handle_t h, const void *expert_out,
                                  void *out) {
  epx_ll_phase_t pending = ll->pending(h);
  if (pending != EPX_LL_NONE)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: the handle's %s is not completed; call epx_ll_complete on it first", fn,
                     phase_name(pending));
  EPX_REQUIRE(expert_out, "%s: expert_out is NULL; pass the expert outputs in recv_x's shape", fn);
  EPX_REQUIRE(out || h->num_tokens == 0, "%s: out is NULL; pass a [num_tokens, hidden] tensor", fn);
  EPX_REQUIRE(epx_is_aligned(expert_out, EPX_PAYLOAD_ALIGNMENT) && epx_is_aligned(out, EPX_PAYLOAD_ALIGNMENT),
              "%s: %s is not 16-byte aligned; allocate it with 16-byte alignment", fn,
              epx_is_aligned(out, EPX_PAYLOAD_ALIGNMENT) ? "expert_out" : "out");
  EPX_REQUIRE(out != expert_out, "%s: out aliases expert_out; pass a separate [num_tokens, hidden] tensor", fn);
  return EPX_SUCCESS;
}

static epx_status_t ll_combine(const char *fn, epx_buffer_t buffer, epx_handle_t handle, const void *expert_out,
                               void *out, int complete) {
  epx_error_clear();
  epx_status_t status = epx_check_collective_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_ll_backend_t *ll = ll_ops(buffer);
  epx_status_t local = epx_check_handle(buffer, &handle, fn);
  if (local == EPX_SUCCESS && (!ll || !buffer->config.low_latency))
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                      "%s: the buffer is not a low-latency buffer (config.low_latency = 0); its handles are "
                      "combined with epx_combine", fn);
  /* A refusal before the handle is known meets the peers' combine. */
  if (local != EPX_SUCCESS) return buffer->backend->agree(buffer, local, fn);
  local = check_combine(fn, ll, handle, expert_out, out);
  status = ll->combine_send(buffer, handle, local, expert_out, out);
  if (status != EPX_SUCCESS || !complete) return status;
  return ll->complete(buffer, handle);
}

epx_status_t epx_ll_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out, void *out) {
  return ll_combine("epx_ll_combine", buffer, handle, expert_out, out, 1);
}

epx_status_t epx_ll_combine_send(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out, void *out) {
  return ll_combine("epx_ll_combine_send", buffer, handle, expert_out, out, 0);
}

epx_status_t epx_ll_complete(epx_buffer_t buffer, epx_handle_t handle) {
  const char *fn = "epx_ll_complete";
  epx_error_clear();
  epx_status_t status = epx_check_buffer(&buffer, fn);
  if (status == EPX_SUCCESS) status = epx_check_handle(buffer, &handle, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_ll_backend_t *ll = ll_ops(buffer);
  EPX_REQUIRE(ll && buffer->config.low_latency,
              "%s: the buffer is not a low-latency buffer (config.low_latency = 0); nothing to complete", fn);
  EPX_REQUIRE(ll->pending(handle) != EPX_LL_NONE,
              "%s: nothing is pending on the handle; epx_ll_complete follows epx_ll_dispatch_send or "
              "epx_ll_combine_send, once", fn);
  return ll->complete(buffer, handle);
}

/* ------------------------------------------------------------------------ */
/* The active-rank mask                                                      */
/* ------------------------------------------------------------------------ */

/* A low-latency buffer (every mask call's first check). */
static epx_status_t check_ll_buffer(epx_buffer_t *buffer, const char *fn) {
  epx_status_t status = epx_check_buffer(buffer, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE((*buffer)->config.low_latency,
              "%s: the buffer is not a low-latency buffer (config.low_latency = 0); the active-rank mask "
              "is the low-latency mode's (after a lost rank, a normal buffer's comm shrinks: epx_comm_shrink)", fn);
  return EPX_SUCCESS;
}

/* A CPU buffer over a comm whose transport keeps a mask. */
static epx_status_t check_mask_transport(epx_buffer_t b, const char *fn) {
  if (b->config.device != EPX_DEVICE_CPU)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the buffer is a CUDA buffer; the active-rank mask serves CPU buffers over a local "
                     "or shm comm in this version (shrink the comm: epx_comm_shrink)", fn);
  if (!b->comm->ops->mask)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: the buffer's comm is a %s comm, whose transport keeps no active-rank mask in this "
                     "version (the local and shm transports do); shrink the comm instead (epx_comm_shrink)", fn,
                     b->comm->ops->name);
  return EPX_SUCCESS;
}

/* The mask's change on a checked buffer (errors name fn). Unmasking a rank
 * that is not masked does nothing, on every transport. */
static epx_status_t mask_rank(epx_buffer_t b, int32_t rank, int32_t masked, const char *fn) {
  epx_comm_t comm = b->comm;
  EPX_REQUIRE(rank >= 0 && rank < comm->size, "%s: rank is %d; pass a rank of the comm, in [0, %d)", fn, rank,
              comm->size);
  EPX_REQUIRE(masked == 0 || masked == 1, "%s: masked is %d; pass 1 (mask the rank) or 0 (unmask it)", fn, masked);
  if (!masked && (!comm->masked || !comm->masked[rank])) return EPX_SUCCESS;
  epx_status_t status = check_mask_transport(b, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(rank != comm->rank, "%s: rank %d is the calling rank; a rank masks its peers, not itself", fn, rank);
  if (!comm->masked) {
    comm->masked = calloc((size_t)comm->size, 1);
    if (!comm->masked) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  status = comm->ops->mask(comm, fn, rank, masked);
  if (status == EPX_SUCCESS) comm->masked[rank] = (uint8_t)masked;
  return status;
}

epx_status_t epx_ll_mask_rank(epx_buffer_t buffer, int32_t rank, int32_t masked) {
  const char *fn = "epx_ll_mask_rank";
  epx_error_clear();
  epx_status_t status = check_ll_buffer(&buffer, fn);
  return status != EPX_SUCCESS ? status : mask_rank(buffer, rank, masked, fn);
}

epx_status_t epx_ll_query_mask(epx_buffer_t buffer, int32_t *mask) {
  const char *fn = "epx_ll_query_mask";
  epx_error_clear();
  epx_status_t status = check_ll_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(mask, "%s: mask is NULL; pass an int32 array of the comm's size", fn);
  const epx_comm_t comm = buffer->comm;
  for (int32_t r = 0; r < comm->size; r++) mask[r] = comm->masked ? comm->masked[r] : 0;
  return EPX_SUCCESS;
}

epx_status_t epx_ll_clean_mask(epx_buffer_t buffer) {
  const char *fn = "epx_ll_clean_mask";
  epx_error_clear();
  epx_status_t status = check_ll_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_comm_t comm = buffer->comm;
  for (int32_t r = 0; r < comm->size && status == EPX_SUCCESS && comm->masked; r++)
    if (comm->masked[r]) status = mask_rank(buffer, r, 0, fn);
  return status;
}
