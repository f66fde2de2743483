/* The agreement of a collective call, one set of rules and messages for
 * every backend. Each collective call first lets every rank see what every
 * rank is doing (its call, buffer, handle, whether it asks for grad_w, its
 * verdict on its own arguments); every rank checks the same blocks the same
 * way, so a refusal, or ranks in different calls or on different handles,
 * fail on every rank with the same reasons before anything moves. A backend
 * keeps its own block (the CPU's travels in its transport's first message,
 * src/cpu/call.c; the CUDA W-rank backend all-gathers its own,
 * src/cuda/ep/ep.c) and shows each rank's block to these checks as a view. */
#ifndef EPX_CORE_AGREE_H
#define EPX_CORE_AGREE_H

#include <stdint.h>

#include "epx.h"

/* A rank's block as the checks read it. */
typedef struct epx_call_view {
  int64_t kind;        /* the call: equal on every rank that makes the same call */
  const char *name;    /* the call's public name, for the messages */
  int32_t is_layout;   /* epx_dispatch_layout: an oversize batch is named, ranks may be out of step */
  int32_t same_handle; /* the handles must match (0: a recorder's validated replay) */
  int32_t verdict;     /* the rank's epx_status_t on its own arguments */
  int64_t buffer_id;   /* the buffer's number, equal on every rank (0: unknown) */
  int64_t layout_id;   /* the handle's (a layout: the one being made) */
  int64_t tokens;      /* T of the routing or handle */
  int32_t top_k;       /* K of the routing or handle */
  int32_t shape;       /* 1: the messages name tokens and top_k */
  int32_t flags;       /* EPX_AGREE_GRAD_W: the call asks for grad_w */
} epx_call_view_t;

#define EPX_AGREE_GRAD_W 1

/* Rank s's view of `blocks` (a backend's array of W blocks). */
typedef void (*epx_call_view_fn)(const void *blocks, int32_t s, epx_call_view_t *view);

/* The checks every backend makes, in order: the same call everywhere; every
 * verdict a success (this rank's own failure keeps `message`, its text;
 * else an oversize layout batch by its numbers against max_tokens, else the
 * first refusing rank); the same buffer and handle; the same flags. Returns
 * the error every rank returns alike, or EPX_SUCCESS. */
epx_status_t epx_agree_calls(const char *fn, const void *blocks, int32_t W, epx_call_view_fn view,
                             epx_status_t mine, const char *message, int64_t max_tokens);

/* EPX_ERROR_SHAPE_MISMATCH: "the ranks are <what>: <each rank's call>",
 * for a backend's own checks after epx_agree_calls. */
epx_status_t epx_agree_mismatch(const char *fn, const void *blocks, int32_t W, epx_call_view_fn view,
                                const char *what);

#endif
