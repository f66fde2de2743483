/* Status strings and the thread-local last-error message. */
#include <stdarg.h>
#include <stdio.h>

#include "core/error.h"

static _Thread_local char last_error[1024];

epx_status_t epx_error(epx_status_t status, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(last_error, sizeof last_error, format, args);
  va_end(args);
  return status;
}

void epx_error_clear(void) { last_error[0] = '\0'; }

const char *epx_last_error(void) { return last_error; }

const char *epx_status_string(epx_status_t status) {
  switch (status) {
    case EPX_SUCCESS: return "EPX_SUCCESS";
    case EPX_ERROR_INVALID_ARGUMENT: return "EPX_ERROR_INVALID_ARGUMENT";
    case EPX_ERROR_OUT_OF_MEMORY: return "EPX_ERROR_OUT_OF_MEMORY";
    case EPX_ERROR_UNSUPPORTED: return "EPX_ERROR_UNSUPPORTED";
    case EPX_ERROR_CAPACITY_EXCEEDED: return "EPX_ERROR_CAPACITY_EXCEEDED";
    case EPX_ERROR_SHAPE_MISMATCH: return "EPX_ERROR_SHAPE_MISMATCH";
    case EPX_ERROR_INVALID_HANDLE: return "EPX_ERROR_INVALID_HANDLE";
    case EPX_ERROR_BUSY: return "EPX_ERROR_BUSY";
    case EPX_ERROR_TIMEOUT: return "EPX_ERROR_TIMEOUT";
    case EPX_ERROR_PEER_FAILED: return "EPX_ERROR_PEER_FAILED";
    case EPX_ERROR_TRANSPORT: return "EPX_ERROR_TRANSPORT";
    case EPX_ERROR_REPLAY_MISMATCH: return "EPX_ERROR_REPLAY_MISMATCH";
    case EPX_ERROR_CUDA: return "EPX_ERROR_CUDA";
    case EPX_ERROR_INTERNAL: return "EPX_ERROR_INTERNAL";
  }
  return "EPX_STATUS_UNKNOWN";
}

static const char *weighting_name(int64_t w) {
  return w == EPX_WEIGHTS_IN_COMBINE    ? "EPX_WEIGHTS_IN_COMBINE"
         : w == EPX_WEIGHTS_IN_DISPATCH ? "EPX_WEIGHTS_IN_DISPATCH"
         : w == EPX_WEIGHTS_NONE        ? "EPX_WEIGHTS_NONE"
                                        : "an unknown weighting";
}

epx_status_t epx_weighting_mismatch(const char *fn, int64_t first, int32_t rank, int64_t theirs,
                                    const char *tail) {
  return epx_error(EPX_ERROR_SHAPE_MISMATCH,
                   "%s: rank 0 routes with routing.weighting = %s and rank %d with %s; the weights are "
                   "applied on the side of the exchange the weighting names, for every rank's tokens, so "
                   "pass the same routing.weighting on every rank%s",
                   fn, weighting_name(first), rank, weighting_name(theirs),
                   tail && tail[0] ? tail : "; nothing moved on any rank");
}
