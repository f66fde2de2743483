/* The agreement of a collective call (core/agree.h). */
#include "core/agree.h"

#include <stdio.h>

#include "core/error.h"

/* "rank 1 in epx_combine on buffer #1, layout #3 (8 tokens, top_k 2)", for
 * up to 8 ranks. */
static void describe_ranks(const void *blocks, int32_t W, epx_call_view_fn view, char *text, size_t size) {
  size_t used = 0;
  text[0] = '\0';
  for (int32_t s = 0; s < W && used < size; s++) {
    epx_call_view_t c;
    view(blocks, s, &c);
    char shape[64] = "";
    if (c.shape) snprintf(shape, sizeof shape, " (%lld tokens, top_k %d)", (long long)c.tokens, c.top_k);
    int n = s == 8 ? snprintf(text + used, size - used, "; ... (%d ranks)", W)
                   : snprintf(text + used, size - used, "%srank %d in %s on buffer #%lld, layout #%lld%s",
                              s ? "; " : "", s, c.name, (long long)c.buffer_id, (long long)c.layout_id, shape);
    if (n < 0 || s == 8) break;
    used += (size_t)n;
  }
}

epx_status_t epx_agree_mismatch(const char *fn, const void *blocks, int32_t W, epx_call_view_fn view,
                                const char *what) {
  char text[768];
  describe_ranks(blocks, W, view, text, sizeof text);
  return epx_error(EPX_ERROR_SHAPE_MISMATCH,
                   "%s: the ranks are %s: %s; every rank must make the same collective calls, on "
                   "the same buffer and handle, in the same order; nothing moved on any rank",
                   fn, what, text);
}

/* A failed verdict: the rank keeps its own message; the others name the first
 * failing rank (an oversize batch, the layout's most common refusal, by its
 * numbers). */
static epx_status_t refusal(const char *fn, const void *blocks, int32_t W, epx_call_view_fn view,
                            epx_status_t mine, const char *message, int64_t max_tokens) {
  if (mine != EPX_SUCCESS) return epx_error(mine, "%s", message);
  for (int32_t s = 0; s < W; s++) {
    epx_call_view_t c;
    view(blocks, s, &c);
    if (c.is_layout && c.verdict == EPX_ERROR_CAPACITY_EXCEEDED)
      return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                       "%s: rank %d has %lld tokens, above the buffer's max_tokens_per_rank %lld; "
                       "nothing moved on any rank; create the buffer with a larger "
                       "config.max_tokens_per_rank", fn, s, (long long)c.tokens, (long long)max_tokens);
  }
  for (int32_t s = 0; s < W; s++) {
    epx_call_view_t c;
    view(blocks, s, &c);
    if (c.verdict != EPX_SUCCESS)
      return epx_error(EPX_ERROR_PEER_FAILED,
                       "%s: rank %d refused the call (its epx_last_error says why); nothing moved "
                       "on any rank", fn, s);
  }
  return EPX_SUCCESS;
}

epx_status_t epx_agree_calls(const char *fn, const void *blocks, int32_t W, epx_call_view_fn view,
                             epx_status_t mine, const char *message, int64_t max_tokens) {
  epx_call_view_t first, c;
  view(blocks, 0, &first);
  for (int32_t s = 1; s < W; s++) {
    view(blocks, s, &c);
    if (c.kind != first.kind) return epx_agree_mismatch(fn, blocks, W, view, "in different collective calls");
  }
  epx_status_t status = refusal(fn, blocks, W, view, mine, message, max_tokens);
  if (status != EPX_SUCCESS) return status;
  for (int32_t s = 1; s < W; s++) {
    view(blocks, s, &c);
    if (c.buffer_id != first.buffer_id) return epx_agree_mismatch(fn, blocks, W, view, "on different buffers");
    if (first.same_handle && c.layout_id != first.layout_id)
      return epx_agree_mismatch(fn, blocks, W, view,
                                first.is_layout ? "out of step (they have made different numbers of layouts)"
                                                : "on different handles");
  }
  for (int32_t s = 1; s < W; s++) {
    view(blocks, s, &c);
    if (c.flags != first.flags) {
      int32_t odd = c.flags & EPX_AGREE_GRAD_W ? s : 0;
      return epx_error(EPX_ERROR_SHAPE_MISMATCH,
                       "%s: rank %d passes grad_w and rank %d does not; the weight gradient is "
                       "exchanged, so pass grad_w on every rank or on none; nothing moved on any "
                       "rank", fn, odd, odd == s ? 0 : s);
    }
  }
  return EPX_SUCCESS;
}
