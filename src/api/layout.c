/* epx_dispatch_layout: the routing checks, replay from a recorder, and the
 * backend's layout of a new handle. */
#include <stdint.h>
#include <stdlib.h>

#include "api/api.h"
#include "api/ll.h"
#include "api/recorder.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/objects.h"
#include "core/registry.h"
#include "core/transport.h"

epx_status_t epx_check_routing(epx_buffer_t b, const epx_routing_t *r, const char *fn) {
  const epx_buffer_config_t *c = &b->config;
  EPX_REQUIRE(r, "%s: routing is NULL; pass an epx_routing_t", fn);
  EPX_REQUIRE(r->num_tokens >= 0 && r->num_tokens <= INT32_MAX,
              "%s: routing.num_tokens is %lld; pass a count in [0, 2^31)", fn, (long long)r->num_tokens);
  EPX_REQUIRE(r->top_k >= 1 && r->top_k <= c->max_top_k,
              "%s: routing.top_k is %d; it must be in [1, config.max_top_k = %d]%s", fn, r->top_k,
              c->max_top_k, r->top_k > c->num_experts ? " (and top_k cannot exceed num_experts)" : "");
  EPX_REQUIRE(r->weighting == EPX_WEIGHTS_IN_COMBINE || r->weighting == EPX_WEIGHTS_IN_DISPATCH ||
                  r->weighting == EPX_WEIGHTS_NONE,
              "%s: routing.weighting %d is not an epx_weighting_t", fn, (int)r->weighting);
  if (r->num_tokens > 0) {
    EPX_REQUIRE(r->topk_idx, "%s: routing.topk_idx is NULL; pass the [num_tokens, top_k] expert ids", fn);
    EPX_REQUIRE(epx_is_aligned(r->topk_idx, 4), "%s: routing.topk_idx is not 4-byte aligned", fn);
    EPX_REQUIRE(r->topk_w || r->weighting == EPX_WEIGHTS_NONE,
                "%s: routing.topk_w is NULL but weighting is not EPX_WEIGHTS_NONE; pass the [num_tokens, "
                "top_k] weights or say EPX_WEIGHTS_NONE", fn);
    EPX_REQUIRE(epx_is_aligned(r->topk_w, 4), "%s: routing.topk_w is not 4-byte aligned", fn);
    EPX_REQUIRE(c->layout != EPX_LAYOUT_CAPACITY || r->locations,
                "%s: routing.locations is NULL; EPX_LAYOUT_CAPACITY needs the [num_tokens, top_k] "
                "capacity slots (epx_route_output_t.locations)", fn);
    EPX_REQUIRE(epx_is_aligned(r->locations, 4), "%s: routing.locations is not 4-byte aligned", fn);
  }
  if (c->layout == EPX_LAYOUT_RANK_MAJOR && r->weighting != EPX_WEIGHTS_NONE)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: EPX_LAYOUT_RANK_MAJOR leaves weighting to the expert (a row serves several "
                     "experts); pass routing.weighting = EPX_WEIGHTS_NONE, apply epx_handle_recv_routing's "
                     "weights, and return their gradient with epx_weights_backward", fn);
  if (b->max_tokens > 0 && r->num_tokens > b->max_tokens)
    return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                     "%s: routing.num_tokens %lld exceeds the buffer's max_tokens_per_rank %lld; "
                     "create the buffer with a larger config.max_tokens_per_rank", fn,
                     (long long)r->num_tokens, (long long)b->max_tokens);
  return b->backend->validate_routing ? b->backend->validate_routing(b, r) : EPX_SUCCESS;
}

/* recorder_id is the caller's value, recorder the object it names (or NULL). */
static epx_status_t check_routing(epx_buffer_t b, const epx_routing_t *r, epx_recorder_t recorder_id,
                                  epx_recorder_t recorder, epx_handle_t *handle) {
  const char *fn = "epx_dispatch_layout";
  EPX_REQUIRE(handle, "%s: handle is NULL; pass the address of an epx_handle_t", fn);
  if (recorder_id && !recorder)
    return epx_error(EPX_ERROR_INVALID_HANDLE, "%s: recorder is not a live recorder (destroyed?); pass NULL or a recorder from epx_recorder_create", fn);
  epx_status_t status = epx_ll_refuse(b, fn);
  return status != EPX_SUCCESS ? status : epx_check_routing(b, r, fn);
}

/* Replay: the recorded handle, no exchange. Validation agrees the verdict
 * across ranks; without it replay is rank-local, and so is a refusal (the
 * peers are in no collective to be told). Returns 1 with *status set when the
 * call was served from the record, 0 when it must run a full layout (no
 * recorder, not replaying, or the log ran out). */
static int replay(epx_buffer_t buffer, const epx_routing_t *routing, epx_recorder_t recorder,
                  epx_status_t local, epx_handle_t *handle, epx_status_t *status) {
  const char *fn = "epx_dispatch_layout";
  if (!recorder || !epx_recorder_replaying(recorder)) return 0;
  int64_t call;
  epx_handle_t recorded = epx_recorder_next(recorder, &call);
  if (!recorded) return 0;
  if (epx_recorder_validates(recorder)) {
    uint64_t hash = 0;
    if (local == EPX_SUCCESS) local = buffer->backend->routing_hash(buffer, routing, &hash);
    if (local == EPX_SUCCESS &&
        (recorded->buffer != buffer || recorded->num_tokens != routing->num_tokens ||
         recorded->top_k != routing->top_k || recorded->routing_hash != hash ||
         recorded->weighting != routing->weighting))
      local = epx_error(EPX_ERROR_REPLAY_MISMATCH,
                        "%s: replay of call %lld differs from its record (recorded %lld tokens x %d, "
                        "hash %016llx; now %lld x %d, hash %016llx%s); the recomputed routing must equal "
                        "the original — pin the router's outputs or re-record", fn, (long long)call,
                        (long long)recorded->num_tokens, recorded->top_k,
                        (unsigned long long)recorded->routing_hash, (long long)routing->num_tokens,
                        routing->top_k, (unsigned long long)hash,
                        recorded->buffer != buffer ? ", and another buffer" : "");
    *status = buffer->backend->agree(buffer, local, fn);
  } else {
    *status = local;
  }
  if (*status != EPX_SUCCESS) return 1;
  epx_handle_hold(recorded, 1);
  *handle = recorded->id;
  return 1;
}

epx_status_t epx_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                 epx_recorder_t recorder, epx_handle_t *handle) {
  const char *fn = "epx_dispatch_layout";
  epx_error_clear();
  epx_status_t status = epx_check_collective_buffer(&buffer, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_recorder_t recorder_id = recorder;
  recorder = epx_registry_get(recorder_id, EPX_OBJECT_RECORDER);
  epx_status_t local = check_routing(buffer, routing, recorder_id, recorder, handle);
  if (replay(buffer, routing, recorder, local, handle, &status)) return status;

  epx_handle_t h = NULL;
  if (local == EPX_SUCCESS) local = epx_handle_new("epx_dispatch_layout", buffer, routing, &h);
  status = buffer->backend->dispatch_layout(buffer, routing, local, h);
  if (status != EPX_SUCCESS) goto fail;
  void *id = NULL;
  EPX_CHECK(epx_registry_add(h, EPX_OBJECT_HANDLE, &id));
  h->id = id;
  __atomic_add_fetch(&buffer->live_handles, 1, __ATOMIC_SEQ_CST);
  if (recorder && !epx_recorder_replaying(recorder)) {
    /* A validating recorder keeps the routing's hash (CUDA computes it on
     * the device and reads it back: only when recording with validation). */
    status = epx_recorder_validates(recorder) && !h->routing_hash && routing->num_tokens
                 ? buffer->backend->routing_hash(buffer, routing, &h->routing_hash)
                 : EPX_SUCCESS;
    if (status == EPX_SUCCESS) status = epx_recorder_append(recorder, h);
    if (status != EPX_SUCCESS) {
      epx_handle_free(h);
      return status;
    }
  }
  *handle = h->id;
  return EPX_SUCCESS;
fail:
  if (h) {
    buffer->backend->handle_fini(h);
    free(h);
  }
  return status;
}
