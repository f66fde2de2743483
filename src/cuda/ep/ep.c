/* The CUDA backend on W ranks (one process per GPU over an NCCL comm,
 * threads of one process over a local comm, or processes of one host over
 * an shm comm: the device transport of cuda/xport/xport.h moves the rows
 * each way): what
 * every path shares (ep/internal.h says what a path is: host.c, fused.c,
 * hier.c, and ll/ranks.c for the low-latency mode): the buffer and its
 * path, the agreement of every call, the layout's sizing, counts and
 * verdicts, and the handle's queries and statistics. Every payload call,
 * low-latency call and query goes to the handle's path.
 *
 * Host synchronisation: without worst_case_sizing the layout waits once (a
 * polled, bounded wait: the transport's) to read the message sizes, and every
 * collective call first all-gathers what each rank is doing (the call, the
 * buffer, the handle, grad_w and its verdict: one small host all-gather on
 * the control comm) so that a refusal, or ranks in different calls, fail on
 * every rank before anything moves. The layout's headers also carry each
 * rank's top_k and weighting, checked by every rank alike. With
 * worst_case_sizing nothing waits: messages have their per-peer bound as
 * size (Tm rows per peer for pairs, Tm*min(Kb, E_local) for routes), rows
 * land at peer * bound + index, the receive layout's N stays on the device;
 * a host refusal on one rank then reaches its peers only as a timeout of
 * their next bounded wait (documented in epx.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/agree.h"
#include "core/error.h"
#include "core/ll.h"
#include "core/placement.h"
#include "core/route_spec.h"
#include "core/transport.h"
#include "cuda/backend.h"
#include "cuda/common/check.h"
#include "cuda/ep/internal.h"

#if EPX_HAVE_NCCL

/* The paths, in the order a buffer tries them (ep/internal.h): the first
 * whose setup takes the buffer serves it. The host path takes every buffer. */
static const ep_path_t *const ep_paths[] = {
    &epx_cuda_ep_hier_path, /* EPX_EXCHANGE_HIERARCHICAL's buffers only */
    &epx_cuda_ep_ll_path,   /* config.low_latency's buffers only */
#if EPX_HAVE_FUSED
    &epx_cuda_ep_fused_path,
#endif
    &epx_cuda_ep_host_path,
};

enum { EP_PATHS = sizeof ep_paths / sizeof ep_paths[0] };

int epx_cuda_ep_supports(const epx_buffer_config_t *c, const char **why) {
  for (size_t i = 0; i < EP_PATHS; i++)
    if (ep_paths[i]->supports && !ep_paths[i]->supports(c, why)) return 0;
  return 1;
}

/* ------------------------------------------------------------------------ */
/* Buffers                                                                   */
/* ------------------------------------------------------------------------ */

/* Collective, once max_tokens_per_rank is known (at buffer creation, or the
 * first layout that agrees it): the buffer's path, for good. */
static epx_status_t choose_path(epx_buffer_t b, const char *fn) {
  ep_buffer_t *s = b->backend_state;
  if (s->path || b->max_tokens == 0) return EPX_SUCCESS;
  for (size_t i = 0; i < EP_PATHS; i++) {
    int takes = 0;
    const epx_status_t status = ep_paths[i]->setup(b, fn, &takes);
    if (status != EPX_SUCCESS) return status;
    if (takes) {
      s->path = ep_paths[i];
      return EPX_SUCCESS;
    }
  }
  return epx_error(EPX_ERROR_INTERNAL, "%s: no path of the CUDA backend takes the buffer", fn);
}

/* The buffer's path; the host path until one is chosen (or where choosing
 * failed with the comm). */
static const ep_path_t *buffer_path(epx_buffer_t b) {
  const ep_buffer_t *s = b->backend_state;
  return s && s->path ? s->path : &epx_cuda_ep_host_path;
}

epx_status_t epx_cuda_ep_buffer_init(epx_buffer_t b) {
  const char *fn = "epx_buffer_create";
  const epx_cuda_xport_t *xport = epx_cuda_xport_of(b->comm);
  if (!xport)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: a CUDA buffer over %d ranks needs an NCCL comm (epx_comm_create_nccl, "
                     "epx_comm_create_nccl_id or epx_comm_create_nccl_mpi), a local one (epx_comm_create_local: "
                     "ranks as threads of this process) or an shm one (epx_comm_create_shm: processes of one "
                     "host, through CUDA IPC); this comm is %s", fn, b->world_size, b->comm->ops->name);
  if (b->world_size > EPX_CUDA_MAX_EXPERTS)
    return epx_error(EPX_ERROR_UNSUPPORTED, "%s: %d ranks; the CUDA backend takes at most %d", fn,
                     b->world_size, EPX_CUDA_MAX_EXPERTS);
  /* The device is checked here: the in-process transport makes nothing on
   * it until a call needs it, and a machine without a usable GPU must be
   * refused at creation, as a one-rank CUDA buffer is. */
  cudaError_t device = cudaFree(NULL);
  if (device != cudaSuccess) return epx_cuda_fail(device, fn, "starting the CUDA context (cudaFree(NULL))");
  ep_buffer_t *s = calloc(1, sizeof *s);
  if (!s) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  b->backend_state = s;
  s->xport = xport;
  s->id = ++b->comm->buffers_made;
  epx_status_t status = choose_path(b, fn);
  if (status != EPX_SUCCESS) {
    free(s);
    b->backend_state = NULL;
  }
  return status;
}

void epx_cuda_ep_buffer_fini(epx_buffer_t b) {
  ep_buffer_t *s = b->backend_state;
  if (!s) return;
  /* With worst_case_sizing a host refusal on one rank reaches its peers only
   * as a timeout of their next bounded wait; a peer that destroys the buffer
   * instead could leave a transfer on the stream that no rank will match,
   * and NCCL's blocking finalize at epx_comm_destroy would wait for it for
   * ever. A bounded wait here turns that into EPX_ERROR_TIMEOUT, which
   * aborts the comm (its kernels too). */
  if (b->config.worst_case_sizing && !b->comm->failed) (void)s->xport->wait(b->comm, stream_of(b), "epx_buffer_destroy");
  buffer_path(b)->buffer_fini(b);
  if (s->readback) cudaFreeHost(s->readback);
  free(s);
  b->backend_state = NULL;
}

/* paths[W]: the buffer's path says how each peer is reached. */
void epx_cuda_ep_peer_paths(epx_buffer_t b, int32_t *paths) { buffer_path(b)->peer_paths(b, paths); }

/* ------------------------------------------------------------------------ */
/* Handles                                                                   */
/* ------------------------------------------------------------------------ */

void epx_cuda_ep_handle_fini(epx_handle_t handle) {
  ep_handle_t *h = handle->backend_state;
  if (!h) return;
  if (h->path) h->path->handle_fini(handle->buffer, h);
  if (h->block) cudaFreeAsync(h->block, stream_of(handle->buffer));
  free(h->count[0]);
  free(h);
  handle->backend_state = NULL;
}

int64_t epx_cuda_ep_handle_bytes(epx_handle_t handle) {
  const ep_handle_t *h = handle->backend_state;
  return h ? (int64_t)(h->block_bytes + sizeof *h) : 0;
}

/* ------------------------------------------------------------------------ */
/* The agreement of a call (default sizing)                                  */
/* ------------------------------------------------------------------------ */

/* What a rank is doing, all-gathered before anything moves (one small host
 * all-gather on the control comm, the same for the layout and the payload
 * calls, so a rank in another call meets a block it can read rather than
 * another collective). Every rank checks every block the same way. */
typedef struct {
  int64_t verdict; /* epx_status_t */
  int64_t call;    /* index in call_names */
  int64_t buffer;  /* ep_buffer_t.id */
  int64_t handle;  /* ep_handle_t.seq (a layout: the one being made); 0: none */
  int64_t tokens;  /* the layout's routing.num_tokens */
  int64_t grad_w;  /* the call asks for grad_w */
} ep_call_t;

static const char *const call_names[] = {"epx_dispatch_layout", "epx_dispatch", "epx_combine",
                                         "epx_dispatch_backward", "epx_combine_backward",
                                         "epx_weights_backward", "epx_dispatch_fp8", "epx_dispatch_quantize"};
enum { CALL_LAYOUT = 0, CALLS = sizeof call_names / sizeof call_names[0] };

static int64_t call_of(const char *caller) {
  for (int64_t i = 0; i < CALLS; i++)
    if (!strcmp(caller, call_names[i])) return i;
  return CALLS; /* not reached: every caller is one of them */
}

/* Rank p's block as core/agree.h's checks read it. */
static void call_view(const void *blocks, int32_t p, epx_call_view_t *view) {
  const ep_call_t *c = (const ep_call_t *)blocks + p;
  *view = (epx_call_view_t){c->call, c->call < CALLS ? call_names[c->call] : "another call", c->call == CALL_LAYOUT,
                            1, (int32_t)c->verdict, c->buffer, c->handle, c->tokens, 0, 0,
                            c->grad_w ? EPX_AGREE_GRAD_W : 0};
}

/* Gathers `mine` from every rank and checks the blocks. *largest (layout,
 * may be NULL): the largest batch of the ranks. */
static epx_status_t agree_call(epx_buffer_t b, ep_call_t mine, const char *fn, int64_t *largest) {
  epx_comm_t comm = b->comm;
  epx_status_t status = epx_comm_check_alive(comm, fn);
  if (status != EPX_SUCCESS) return status;
  const epx_status_t local = (epx_status_t)mine.verdict;
  char message[1024];
  snprintf(message, sizeof message, "%s", local != EPX_SUCCESS ? epx_last_error() : "");
  ep_call_t *all = calloc((size_t)b->world_size, sizeof *all);
  if (!all) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  status = comm->ops->allgather(comm, fn, &mine, all, sizeof mine);
  if (status == EPX_SUCCESS && mine.call == CALL_LAYOUT) {
    /* Ranks out of step fail this layout (epx_agree_calls) and make the next
     * one in step: every rank in a layout takes the largest number, as the
     * CPU layouts do. */
    int all_layouts = 1;
    int64_t top = 0;
    for (int32_t p = 0; p < b->world_size; p++) all_layouts &= all[p].call == CALL_LAYOUT, top = max64(top, all[p].handle);
    if (all_layouts && top > comm->layouts_made) comm->layouts_made = top;
  }
  if (status == EPX_SUCCESS) status = epx_agree_calls(fn, all, b->world_size, call_view, local, message, b->max_tokens);
  for (int32_t p = 0; status == EPX_SUCCESS && largest && p < b->world_size; p++)
    if (all[p].tokens > *largest) *largest = all[p].tokens;
  free(all);
  return status;
}

/* Whether the calls agree on the host before anything moves: not with
 * worst_case_sizing (see the top of this file), nor on a low-latency buffer,
 * whose calls never wait on the host (ll/ranks.c) and whose normal calls
 * the API refuses on every rank alike (epx_ll_refuse). */
static int agrees_on_host(epx_buffer_t b) { return !b->config.worst_case_sizing && !b->config.low_latency; }

/* The layout's agreement: the verdict, and on the first call
 * max_tokens_per_rank (the largest batch). */
static epx_status_t agree_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, int64_t seq) {
  const ep_buffer_t *s = b->backend_state;
  const ep_call_t mine = {local, CALL_LAYOUT, s->id, seq, r ? r->num_tokens : 0, 0};
  int64_t largest = 0;
  epx_status_t status = agree_call(b, mine, "epx_dispatch_layout", &largest);
  if (status == EPX_SUCCESS && b->max_tokens == 0) epx_buffer_agree_max_tokens(b, largest);
  return status;
}

/* Host counts per peer: read back (default) or the bounds (worst case). */
static void set_counts(ep_handle_t *h, const int64_t *summary) {
  const int32_t W = h->d.W;
  for (int kind = 0; kind < KINDS; kind++) {
    int64_t sum = 0;
    for (int32_t p = 0; p < W; p++) {
      const int64_t n = summary ? summary[kind * W + p] : kind_bound(&h->d, kind);
      h->count[kind][p] = n;
      h->displ[kind][p] = sum;
      sum += n;
    }
    h->total[kind] = sum;
  }
}

/* Every rank's routing.weighting must be rank 0's: the receiver applies the
 * weights of its peers' routes by its own handle's weighting. */
static epx_status_t weighting_verdict(const int64_t *hdr, int32_t W, const char *fn, const char *note) {
  const int64_t first = hdr[EPX_CUDA_EP_HDR_WEIGHTING];
  for (int32_t p = 1; p < W; p++) {
    const int64_t theirs = hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_WEIGHTING];
    if (theirs != first) return epx_weighting_mismatch(fn, first, p, theirs, note);
  }
  return EPX_SUCCESS;
}

/* The verdicts in the read-back headers, the same on every rank. */
static epx_status_t header_verdict(epx_buffer_t b, const ep_handle_t *h, const int64_t *summary, const char *fn,
                                   const char *note) {
  const int32_t W = h->d.W;
  const int64_t *hdr = summary + 4 * W;
  for (int32_t p = 0; p < W; p++)
    if (hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_OVERSIZE])
      return epx_error(EPX_ERROR_CAPACITY_EXCEEDED,
                       "%s: rank %d had more tokens than the buffer's max_tokens_per_rank %lld, so no row moved "
                       "on any rank%s", fn, p, (long long)b->max_tokens, note);
  for (int32_t p = 0; p < W; p++) {
    if (!hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_INVALID]) continue;
    if (p == b->rank)
      return epx_cuda_routing_error(fn, (uint64_t)summary[EPX_CUDA_EP_SUMMARY_ROWS(W) + 1], h->d.K,
                                    epx_placement_routing_ids(b->placement),
                                    b->config.capacity, NULL, NULL, note);
    return epx_error(EPX_ERROR_PEER_FAILED, "%s: rank %d has an invalid route (its epx_last_error names it)%s", fn,
                     p, note);
  }
  for (int32_t p = 0; p < W; p++)
    if (hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_TOPK] != h->d.K)
      return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                       "%s: rank %d routes with top_k %lld and this rank with %d; a CUDA buffer over several "
                       "ranks needs the same routing.top_k on every rank", fn, p,
                       (long long)hdr[p * EPX_CUDA_EP_HDR_INTS + EPX_CUDA_EP_HDR_TOPK], h->d.K);
  return weighting_verdict(hdr, W, fn, note);
}

/* Copies the summary to the host and waits for it (bounded): the tables
 * kernel's, or the path's own read-back formed into it. */
static epx_status_t read_summary(epx_buffer_t b, ep_handle_t *h, const char *fn, const int64_t **out) {
  epx_status_t status = EPX_SUCCESS;
  ep_buffer_t *s = b->backend_state;
  const size_t bytes = 8 * (size_t)(EPX_CUDA_EP_SUMMARY_ROWS(h->d.W) + 2);
  const size_t raw = h->path->readback_bytes(h); /* the path's read-back, after the summary */
  if (bytes + raw > s->readback_bytes) {
    if (s->readback) cudaFreeHost(s->readback);
    s->readback = NULL;
    s->readback_bytes = 0;
    CUDA_CHECK(cudaMallocHost((void **)&s->readback, bytes + raw), fn, "cudaMallocHost");
    s->readback_bytes = bytes + raw;
  }
  EPX_CHECK(h->path->readback(b, h, s->readback, bytes, fn));
  EPX_CHECK(s->xport->wait(b->comm, stream_of(b), fn));
  if (h->path->summary) EPX_CHECK(h->path->summary(b, h, s->readback, bytes, fn));
  *out = s->readback;
fail:
  return status;
}

epx_status_t epx_cuda_ep_dispatch_layout(epx_buffer_t b, const epx_routing_t *r, epx_status_t local,
                                         epx_handle_t handle) {
  const char *fn = "epx_dispatch_layout";
  epx_status_t status = EPX_SUCCESS;
  const epx_buffer_config_t *c = &b->config;
  const int worst = c->worst_case_sizing != 0;
  const int64_t seq = ++b->comm->layouts_made; /* every rank calls, refused or not */
  if (agrees_on_host(b) || b->max_tokens == 0) {
    EPX_CHECK(agree_layout(b, r, local, seq));
    EPX_CHECK(choose_path(b, fn)); /* max_tokens_per_rank may have been agreed just now */
  } else if (local != EPX_SUCCESS) {
    /* only an oversize batch joins (its routing is valid); any other refusal
     * may come with no routing at all */
    if (local == EPX_ERROR_CAPACITY_EXCEEDED && r) {
      epx_cuda_ep_dims_t d = {b->world_size, b->rank, b->experts_per_rank, c->max_top_k, r->top_k,
                              b->max_tokens, 0, c->layout, c->capacity, 1, 0, 0, (int32_t)r->weighting};
      char message[1024];
      snprintf(message, sizeof message, "%s", epx_last_error());
      status = buffer_path(b)->join_oversize(b, &d, fn);
      if (status == EPX_SUCCESS) status = epx_error(local, "%s", message);
      return status;
    }
    return local;
  }
  const int64_t W = b->world_size, Tm = b->max_tokens, Kb = c->max_top_k, El = b->experts_per_rank;
  const int64_t G = W * Tm, kk = min64(Kb, El);
  if (G * Kb >= INT32_MAX / 4)
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: %lld ranks x %lld tokens x top-%lld; the CUDA backend indexes the gathered routes with "
                     "int32; lower max_tokens_per_rank", fn, (long long)W, (long long)Tm, (long long)Kb);
  ep_handle_t *h = calloc(1, sizeof *h);
  if (!h) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  handle->backend_state = h;
  h->path = buffer_path(b);
  h->rows = -1;
  h->seq = seq;
  h->count[0] = malloc(sizeof(int64_t) * 2 * KINDS * (size_t)W);
  if (!h->count[0]) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int kind = 0; kind < KINDS; kind++)
    h->count[kind] = h->count[0] + kind * W, h->displ[kind] = h->count[0] + (KINDS + kind) * W;
  h->d = (epx_cuda_ep_dims_t){(int32_t)W, b->rank, (int32_t)El, (int32_t)Kb, r->top_k, Tm, r->num_tokens,
                              c->layout, c->capacity, worst, Tm, Tm * kk, (int32_t)r->weighting};
  h->row_bound = epx_recv_rows_bound(c->layout, W, Tm, (int32_t)Kb, El, c->expert_alignment, c->capacity);
  h->pair_rows = W * h->d.Bp;
  h->route_rows = W * h->d.Br;
  h->has_w = r->topk_w != NULL;
  EPX_CHECK(h->path->layout(b, r, h, fn));
  const int64_t *summary = NULL; /* worst_case_sizing: not read here */
  if (worst) {
    set_counts(h, NULL);
    handle->recv_rows = h->row_bound;
  } else {
    EPX_CHECK(read_summary(b, h, fn, &summary));
    EPX_CHECK(header_verdict(b, h, summary, fn, ""));
    set_counts(h, summary);
    h->rows = summary[EPX_CUDA_EP_SUMMARY_ROWS(W)];
    handle->recv_rows = h->rows;
  }
  EPX_CHECK(h->path->laid_out(b, h, summary, fn));
fail:
  return status;
}

/* ------------------------------------------------------------------------ */
/* Payload calls: agreed (ep/ops.c), then the handle's path                  */
/* ------------------------------------------------------------------------ */

epx_status_t epx_cuda_ep_agree_call(epx_buffer_t b, epx_handle_t handle, int grad_w, epx_status_t local,
                                    const char *caller) {
  if (!agrees_on_host(b)) return local;
  const ep_handle_t *h = handle ? handle->backend_state : NULL;
  const ep_call_t mine = {local, call_of(caller), ((const ep_buffer_t *)b->backend_state)->id, h ? h->seq : 0, 0, grad_w != 0};
  return agree_call(b, mine, caller, NULL);
}

epx_status_t epx_cuda_ep_agree(epx_buffer_t b, epx_status_t local, const char *caller) {
  return epx_cuda_ep_agree_call(b, NULL, 0, local, caller);
}

static const ep_path_t *path_of(epx_handle_t handle) { return ((const ep_handle_t *)handle->backend_state)->path; }

epx_status_t epx_cuda_ep_dispatch(epx_buffer_t b, epx_handle_t handle, const void *x, void *recv_x) {
  return path_of(handle)->dispatch(b, handle, x, recv_x);
}

epx_status_t epx_cuda_ep_dispatch_fp8(epx_buffer_t b, epx_handle_t handle, const void *x, const void *x_scales,
                                      int quantize, void *recv_x_q, void *recv_scales) {
  return path_of(handle)->dispatch_fp8(b, handle, x, x_scales, quantize, recv_x_q, recv_scales);
}

epx_status_t epx_cuda_ep_combine(epx_buffer_t b, epx_handle_t handle, const void *expert_out, void *out) {
  return path_of(handle)->combine(b, handle, expert_out, out);
}

epx_status_t epx_cuda_ep_dispatch_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_recv_x,
                                           void *grad_x, const void *x, float *grad_w) {
  return path_of(handle)->dispatch_backward(b, handle, grad_recv_x, grad_x, x, grad_w);
}

epx_status_t epx_cuda_ep_combine_backward(epx_buffer_t b, epx_handle_t handle, const void *grad_out,
                                          const void *expert_out, void *grad_expert_out, float *grad_w) {
  return path_of(handle)->combine_backward(b, handle, grad_out, expert_out, grad_expert_out, grad_w);
}

epx_status_t epx_cuda_ep_weights_backward(epx_buffer_t b, epx_handle_t handle, const float *grad_recv_w,
                                          float *grad_w) {
  return path_of(handle)->weights_backward(b, handle, grad_recv_w, grad_w);
}

/* ------------------------------------------------------------------------ */
/* Queries                                                                   */
/* ------------------------------------------------------------------------ */

/* worst_case_sizing: the counts, N and the verdicts, read once. */
static epx_status_t settle_handle(epx_handle_t handle, const char *fn) {
  epx_status_t status = EPX_SUCCESS;
  ep_handle_t *h = handle->backend_state;
  if (h->rows >= 0) return EPX_SUCCESS;
  const int64_t *summary = NULL;
  EPX_CHECK(read_summary(handle->buffer, h, fn, &summary));
  EPX_CHECK(header_verdict(handle->buffer, h, summary, fn,
                           " (with worst_case_sizing epx_dispatch_layout does not wait for the verdict: invalid "
                           "routes were dropped, treated as -1; an oversize batch moved nothing)"));
  h->rows = summary[EPX_CUDA_EP_SUMMARY_ROWS(h->d.W)];
fail:
  return status;
}

epx_status_t epx_cuda_ep_recv_rows(epx_handle_t handle, int64_t *rows) {
  epx_status_t status = settle_handle(handle, "epx_handle_recv_rows");
  if (status == EPX_SUCCESS) *rows = ((ep_handle_t *)handle->backend_state)->rows;
  return status;
}

epx_status_t epx_cuda_ep_recv_rows_device(epx_handle_t handle, const int64_t **rows) {
  return path_of(handle)->recv_rows_device(handle, rows);
}

epx_status_t epx_cuda_ep_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets) {
  return path_of(handle)->expert_counts(handle, counts, offsets);
}

epx_status_t epx_cuda_ep_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w) {
  return path_of(handle)->recv_routing(handle, recv_expert, recv_w);
}

epx_status_t epx_cuda_ep_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token) {
  return path_of(handle)->recv_source(handle, src_rank, src_token);
}

epx_status_t epx_cuda_ep_stats(epx_handle_t handle, epx_handle_stats_t *stats) {
  ep_handle_t *h = handle->backend_state;
  epx_buffer_t b = handle->buffer;
  if (h->path->stats) return h->path->stats(handle, stats);
  const int dedup = b->config.exchange != EPX_EXCHANGE_COLLECTIVE; /* hierarchical: dedup's items */
  const int hk = dedup ? HOME_PAIRS : HOME_ROUTES, rk = dedup ? RECV_PAIRS : RECV_ROUTES;
  const int64_t *counts = NULL; /* worst_case_sizing: the true counts, read back */
  if (h->d.worst) {
    epx_status_t status = read_summary(b, h, "epx_handle_stats", &counts);
    if (status != EPX_SUCCESS) return status;
  }
  int64_t send = 0, recv = 0, self = 0;
  for (int32_t p = 0; p < h->d.W; p++) {
    const int64_t out = counts ? counts[hk * h->d.W + p] : h->count[hk][p];
    const int64_t in = counts ? counts[rk * h->d.W + p] : h->count[rk][p];
    if (p == b->rank) self = out;
    else send += out, recv += in;
  }
  const int64_t rb = epx_buffer_row_bytes(b);
  *stats = (epx_handle_stats_t){send, recv, send * rb, recv * rb, self};
  return EPX_SUCCESS;
}

/* The path's count, or the flat exchange's items per peer by the peer's
 * node (worst_case_sizing: the true counts, read back). */
epx_status_t epx_cuda_ep_traffic(epx_handle_t handle, epx_handle_traffic_t *traffic) {
  ep_handle_t *h = handle->backend_state;
  epx_buffer_t b = handle->buffer;
  const epx_comm_t comm = b->comm;
  int64_t same = 0, other = 0;
  if (h->path->traffic) {
    epx_status_t status = h->path->traffic(handle, &same, &other);
    if (status != EPX_SUCCESS) return status;
  } else {
    const int kind = b->config.exchange == EPX_EXCHANGE_COLLECTIVE ? HOME_ROUTES : HOME_PAIRS;
    const int64_t *counts = NULL;
    if (h->d.worst) {
      epx_status_t status = read_summary(b, h, "epx_handle_traffic", &counts);
      if (status != EPX_SUCCESS) return status;
    }
    for (int32_t p = 0; p < h->d.W; p++) {
      const int64_t n = counts ? counts[kind * h->d.W + p] : h->count[kind][p];
      if (p == b->rank) continue;
      if (comm->node_of[p] == comm->node_of[b->rank]) same += n;
      else other += n;
    }
  }
  const int64_t rb = epx_buffer_row_bytes(b);
  *traffic = (epx_handle_traffic_t){same, same * rb, other, other * rb};
  return EPX_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* The low-latency calls (core/ll.h): the buffer's path                      */
/* ------------------------------------------------------------------------ */

/* A buffer of a path without them (config.low_latency = 0) gets here only
 * with the API's refusal, agreed as every refused call is (on the CPU too). */
static epx_status_t ll_dispatch_send(epx_buffer_t b, const epx_routing_t *r, epx_status_t local, epx_handle_t handle,
                                     const epx_ll_rows_t *rows, int32_t *recv_count, const int32_t *num_tokens) {
  const char *fn = rows->fp8 ? "epx_ll_dispatch_fp8" : "epx_ll_dispatch";
  const ep_path_t *path = buffer_path(b);
  if (!path->ll) return epx_cuda_ep_agree(b, local, fn);
  if (local == EPX_SUCCESS) {
    ep_handle_t *h = calloc(1, sizeof *h);
    if (!h) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
    h->path = path;
    h->rows = -1;
    handle->backend_state = h;
  }
  return path->ll->dispatch_send(b, r, local, handle, rows, recv_count, num_tokens);
}

static epx_status_t ll_combine_send(epx_buffer_t b, epx_handle_t handle, epx_status_t local, const void *expert_out,
                                    void *out) {
  return path_of(handle)->ll->combine_send(b, handle, local, expert_out, out);
}

static epx_ll_phase_t ll_pending(epx_handle_t handle) { return path_of(handle)->ll->pending(handle); }

static epx_status_t ll_complete(epx_buffer_t b, epx_handle_t handle) {
  return path_of(handle)->ll->complete(b, handle);
}

const epx_ll_backend_t epx_cuda_ep_ll_ops = {
    .dispatch_send = ll_dispatch_send,
    .combine_send = ll_combine_send,
    .pending = ll_pending,
    .complete = ll_complete,
};

#endif
