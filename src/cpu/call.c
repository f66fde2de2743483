/* The agreement of collective calls. Every collective call of the CPU backend
 * starts with one handshake (epx_comm_handshake) whose block says what the
 * rank is doing: the call, the buffer and handle (sequence numbers the comm
 * hands out in the same order on every rank), the shape, and the rank's own
 * verdict on its arguments. Every rank receives every rank's block and checks
 * them all the same way (core/agree.h, the rules every backend shares, then
 * this engine's own: weighting and shapes), so a refusal, a rank in another
 * call or on another handle fails on every rank, with the same reasons,
 * before anything moves — and no extra round trip is spent when all is
 * well. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/agree.h"
#include "core/error.h"
#include "cpu/exchange.h"

static const char *const call_names[EPX_CALL_COUNT] = {
    [EPX_CALL_LAYOUT] = "epx_dispatch_layout",
    [EPX_CALL_DISPATCH] = "epx_dispatch",
    [EPX_CALL_COMBINE] = "epx_combine",
    [EPX_CALL_DISPATCH_BACKWARD] = "epx_dispatch_backward",
    [EPX_CALL_COMBINE_BACKWARD] = "epx_combine_backward",
    [EPX_CALL_WEIGHTS_BACKWARD] = "epx_weights_backward",
    [EPX_CALL_REPLAY] = "epx_dispatch_layout (validated replay)",
    [EPX_CALL_DISPATCH_FP8] = "epx_dispatch_fp8",
    [EPX_CALL_DISPATCH_QUANTIZE] = "epx_dispatch_quantize",
};

const char *epx_cpu_call_name(int32_t kind) {
  return kind > 0 && kind < EPX_CALL_COUNT ? call_names[kind] : "an unknown call";
}

static int is_low_latency(const char *fn) { return !strncmp(fn, "epx_ll_", 7); }

/* The public name of a call: a low-latency call's messages (its layout, its
 * rows, its combine) all belong to the epx_ll_* call. */
static const char *call_name(int32_t kind, int32_t flags) {
  if (!(flags & EPX_CALL_LOW_LATENCY)) return epx_cpu_call_name(kind);
  if (kind == EPX_CALL_COMBINE) return "epx_ll_combine";
  if (kind == EPX_CALL_DISPATCH_FP8 || kind == EPX_CALL_DISPATCH_QUANTIZE) return "epx_ll_dispatch_fp8";
  return "epx_ll_dispatch";
}

epx_call_kind_t epx_cpu_call_kind(const char *fn) {
  if (is_low_latency(fn)) return strstr(fn, "combine") ? EPX_CALL_COMBINE : EPX_CALL_LAYOUT;
  for (int32_t k = EPX_CALL_DISPATCH; k < EPX_CALL_COUNT; k++)
    if (k != EPX_CALL_REPLAY && !strcmp(fn, call_names[k])) return (epx_call_kind_t)k;
  return EPX_CALL_REPLAY;
}

void epx_cpu_call_begin(epx_cpu_call_ctx_t *ctx, epx_buffer_t buffer, epx_call_kind_t kind,
                        const char *fn, epx_status_t local, epx_handle_t h) {
  memset(ctx, 0, sizeof *ctx);
  ctx->buffer = buffer;
  ctx->fn = fn;
  /* The transport may set errors of its own before the verdict is reported. */
  if (local != EPX_SUCCESS) snprintf(ctx->message, sizeof ctx->message, "%s", epx_last_error());
  epx_cpu_call_t *m = &ctx->mine;
  m->kind = kind;
  m->verdict = local;
  m->buffer_id = buffer->cpu ? buffer->cpu->buffer_id : 0;
  m->layout_id = h && h->cpu ? h->cpu->layout_id : 0;
  m->tokens = h ? h->num_tokens : 0;
  m->top_k = h ? h->top_k : 0;
  m->rank = buffer->comm->rank;
  m->hidden = buffer->config.hidden;
  m->weighting = h ? (int32_t)h->weighting : 0;
  m->flags = is_low_latency(fn) ? EPX_CALL_LOW_LATENCY : 0;
}

/* Rank s's block as core/agree.h's checks read it: a low-latency call is
 * another call than the normal one of its kind. */
static void call_view(const void *blocks, int32_t s, epx_call_view_t *view) {
  const epx_cpu_call_t *c = (const epx_cpu_call_t *)blocks + s;
  int64_t kind = c->kind + (c->flags & EPX_CALL_LOW_LATENCY ? EPX_CALL_COUNT : 0);
  *view = (epx_call_view_t){kind, call_name(c->kind, c->flags), c->kind == EPX_CALL_LAYOUT,
                            c->kind != EPX_CALL_REPLAY, c->verdict, c->buffer_id, c->layout_id, c->tokens,
                            c->top_k, 1, c->flags & EPX_CALL_GRAD_W ? EPX_AGREE_GRAD_W : 0};
}

static epx_status_t mismatch(const epx_cpu_call_ctx_t *ctx, const epx_cpu_call_t *peers, const char *what) {
  return epx_agree_mismatch(ctx->fn, peers, ctx->buffer->comm->size, call_view, what);
}

/* A peer's shape the exchange can serve: in range of the buffer's limits
 * (it is used to size and check what that peer sends). */
static epx_status_t check_shapes(const epx_cpu_call_ctx_t *ctx, const epx_cpu_call_t *peers) {
  const epx_buffer_config_t *c = &ctx->buffer->config;
  int32_t W = ctx->buffer->comm->size;
  for (int32_t s = 0; s < W; s++) {
    const epx_cpu_call_t *p = &peers[s];
    if (p->rank != s || p->hidden != c->hidden || p->tokens < 0 || p->tokens > INT32_MAX ||
        (p->kind != EPX_CALL_REPLAY && (p->top_k < 1 || p->top_k > c->max_top_k)))
      return mismatch(ctx, peers, "in calls of shapes this buffer cannot serve (a rank's hidden, "
                                  "tokens or top_k is not the buffer's)");
  }
  /* The rank-major layout has a slot per k of the receiver's routing: a
   * peer's k-slot must be one of them. */
  if (peers[0].kind == EPX_CALL_LAYOUT && c->layout == EPX_LAYOUT_RANK_MAJOR)
    for (int32_t s = 1; s < W; s++)
      if (peers[s].top_k != peers[0].top_k)
        return mismatch(ctx, peers, "in a rank-major layout with different top_k (its rows have a "
                                    "slot per k, the same on every rank; pass the same top_k, "
                                    "with -1 for unused slots)");
  return EPX_SUCCESS;
}

/* Every rank's routing.weighting must be rank 0's (epx_weighting_mismatch). */
static epx_status_t check_weighting(const epx_cpu_call_ctx_t *ctx, const epx_cpu_call_t *peers) {
  int32_t W = ctx->buffer->comm->size;
  for (int32_t s = 1; s < W; s++)
    if (peers[s].weighting != peers[0].weighting)
      return epx_weighting_mismatch(ctx->fn, peers[0].weighting, s, peers[s].weighting, "");
  return EPX_SUCCESS;
}

/* A rank masked out of the comm (epx_ll_mask_rank) sends no block (the
 * transport left zeros): it stands in as this rank's call with no tokens
 * and nothing to send, so the agreement and the counts pass over it. The
 * blocks are the caller's receive half of epx_cpu_call_blocks. */
static void fill_masked(const epx_cpu_call_ctx_t *ctx, const epx_cpu_call_t *peers) {
  const epx_comm_t comm = ctx->buffer->comm;
  if (!comm->masked) return;
  epx_cpu_call_t *blocks = (epx_cpu_call_t *)(uintptr_t)peers;
  for (int32_t s = 0; s < comm->size; s++) {
    if (!comm->masked[s]) continue;
    blocks[s] = ctx->mine;
    blocks[s].rank = s;
    blocks[s].tokens = 0;
    memset(blocks[s].word, 0, sizeof blocks[s].word);
  }
}

epx_status_t epx_cpu_call_agree(const epx_cpu_call_ctx_t *ctx, const epx_cpu_call_t *peers) {
  fill_masked(ctx, peers);
  epx_status_t status = epx_agree_calls(ctx->fn, peers, ctx->buffer->comm->size, call_view, ctx->mine.verdict,
                                        ctx->message, ctx->buffer->max_tokens);
  if (status == EPX_SUCCESS) status = check_weighting(ctx, peers);
  return status != EPX_SUCCESS ? status : check_shapes(ctx, peers);
}

epx_cpu_call_t *epx_cpu_call_blocks(const epx_cpu_call_ctx_t *ctx) {
  int32_t W = ctx->buffer->comm->size;
  epx_cpu_call_t *blocks = malloc(sizeof *blocks * 2 * (size_t)W);
  if (!blocks) return NULL;
  for (int32_t r = 0; r < W; r++) blocks[r] = ctx->mine;
  return blocks;
}

static epx_status_t then_agree(void *ctx, const void *recv) { return epx_cpu_call_agree(ctx, recv); }

epx_status_t epx_cpu_call_exchange(epx_buffer_t buffer, epx_call_kind_t kind, const char *fn,
                                   epx_status_t local, epx_handle_t h) {
  epx_comm_t comm = buffer->comm;
  if (comm->size == 1) return local;
  epx_cpu_call_ctx_t ctx;
  epx_cpu_call_begin(&ctx, buffer, kind, fn, local, h);
  epx_cpu_call_t *blocks = epx_cpu_call_blocks(&ctx);
  if (!blocks) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  epx_status_t status =
      epx_comm_handshake(comm, fn, blocks, blocks + comm->size, sizeof *blocks, then_agree, &ctx);
  free(blocks);
  return status;
}

epx_status_t epx_cpu_agree(epx_buffer_t buffer, epx_status_t local, const char *caller) {
  return epx_cpu_call_exchange(buffer, epx_cpu_call_kind(caller), caller, local, NULL);
}
