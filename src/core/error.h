/* Status, the thread-local last-error message, and the checking macros every
 * source file uses. Errors are set where they are detected, with the public
 * function's name, the argument and the fix; callers only propagate. */
#ifndef EPX_CORE_ERROR_H
#define EPX_CORE_ERROR_H

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Formats the thread-local message and returns status (so a check reads
 * `return epx_error(EPX_ERROR_INVALID_ARGUMENT, "epx_route: ...")`). */
epx_status_t epx_error(epx_status_t status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

/* Clears the thread-local message (successful public calls start with it). */
void epx_error_clear(void);

/* The refusal of ranks whose routing.weighting differs (every backend's
 * layout agreement): EPX_ERROR_SHAPE_MISMATCH naming rank 0's weighting and
 * rank `rank`'s. The weighting says on which side of the exchange a route's
 * weight is applied, for every rank's tokens: ranks that disagree would
 * weight some routes twice and others never. `tail` ends the message ("",
 * "; nothing moved on any rank" by default). */
epx_status_t epx_weighting_mismatch(const char *fn, int64_t first, int32_t rank, int64_t theirs,
                                    const char *tail);

/* Runs a call returning epx_status_t; on failure jumps to the function's
 * single cleanup label `fail` with `status` set. */
#define EPX_CHECK(call)                                                        \
  do {                                                                         \
    status = (call);                                                           \
    if (status != EPX_SUCCESS) goto fail;                                      \
  } while (0)

/* Sets an error and jumps to `fail`. */
#define EPX_FAIL(code, ...)                                                    \
  do {                                                                         \
    status = epx_error((code), __VA_ARGS__);                                   \
    goto fail;                                                                 \
  } while (0)

/* Argument check returning at once (for checks before anything is acquired). */
#define EPX_REQUIRE(cond, ...)                                                 \
  do {                                                                         \
    if (!(cond)) return epx_error(EPX_ERROR_INVALID_ARGUMENT, __VA_ARGS__);    \
  } while (0)

#ifdef __cplusplus
}
#endif

#endif
