/* Plans of the fused exchange (fused.h: epx_fused_plan_*): a handle's device
 * tables carved for the worst case of max_tokens, what its accessors read
 * (view) and the small tables read back for its verdicts (summary). */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/route_spec.h"
#include "cuda/fused/impl.cuh"

using namespace epx_fused_impl;

extern "C" epx_status_t epx_fused_plan_create(epx_fused_t *f, epx_layout_t layout, int32_t alignment,
                                              int64_t capacity, cudaStream_t stream, epx_fused_plan_t **plan) {
  const char *fn = "epx_fused_plan_create";
  EPX_REQUIRE(f && plan, "%s: fused or plan is NULL", fn);
  EPX_REQUIRE(layout == EPX_LAYOUT_EXPERT_MAJOR || layout == EPX_LAYOUT_RANK_MAJOR || layout == EPX_LAYOUT_CAPACITY,
              "%s: layout %d is not a layout", fn, (int)layout);
  EPX_REQUIRE(alignment >= 1, "%s: expert_alignment %d is below 1", fn, alignment);
  const bool cap = layout == EPX_LAYOUT_CAPACITY;
  const fused_dev &d = f->dev;
  const int64_t W = d.W, T = d.maxT, K = d.Kmax, E = d.E, El = d.El;
  EPX_REQUIRE(!cap || (capacity >= 1 && El * W * capacity < INT32_MAX),
              "%s: capacity %lld is outside [1, 2^31 / (E_local * W))", fn, (long long)capacity);
  const int64_t blocks = (T + kLayoutTokens - 1) / kLayoutTokens;
  const int64_t pairs = W * T;
  const int64_t row_bound = epx_recv_rows_bound(layout, W, T, (int32_t)K, El, alignment, (int32_t)capacity);
  const int64_t claims = cap ? E * capacity : 0;
  const info_index ii = make_info_index((int)W, (int)El);
  /* int32 words of every array, in the order they are carved below */
  const int64_t words[] = {T * K, T * K, T * K, T * W, W * T, blocks * E, blocks * W, 2 * blocks, E,
                           pairs, pairs * K, pairs * K, pairs * K, row_bound, row_bound, row_bound, row_bound,
                           2 * claims};
  size_t bytes = 64 + epx_align_up((size_t)ii.total * 8, 256); /* invalid, then info, as carved below */
  for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) bytes += epx_align_up((size_t)words[i] * 4, 256);
  epx_fused_plan_t *p = static_cast<epx_fused_plan_t *>(calloc(1, sizeof *p));
  if (!p) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  cudaError_t e = cudaMallocAsync(&p->memory, bytes, stream);
  if (e != cudaSuccess) {
    free(p);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: cudaMallocAsync of %zu bytes failed: %s", fn, bytes,
                     cudaGetErrorString(e));
  }
  char *m = static_cast<char *>(p->memory);
  fused_plan_dev &pd = p->dev;
  pd.invalid = reinterpret_cast<unsigned long long *>(m);
  pd.info = reinterpret_cast<int64_t *>(m + 64);
  m += 64 + epx_align_up((size_t)ii.total * 8, 256);
  void **slots[] = {(void **)&pd.idx, (void **)&pd.w, (void **)&pd.pos, (void **)&pd.tok_slot,
                    (void **)&pd.send_token, (void **)&pd.chunk_hist, (void **)&pd.chunk_dcnt,
                    (void **)&pd.chunk_invalid, (void **)&pd.hist, (void **)&pd.pair_token, (void **)&pd.pair_expert,
                    (void **)&pd.pair_w, (void **)&pd.pair_rows, (void **)&pd.row_src_rank,
                    (void **)&pd.row_src_token, (void **)&pd.row_expert, (void **)&pd.row_w, (void **)&pd.claim};
  for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
    *slots[i] = m;
    m += epx_align_up((size_t)words[i] * 4, 256);
  }
  /* every slot unclaimed: a claim carries its layout's op number + 1 (> 0),
   * so a later layout's claims outrank an earlier one's and need no reset */
  if (cap && (e = cudaMemsetAsync(pd.claim, 0, (size_t)claims * 8, stream)) != cudaSuccess) {
    cudaFreeAsync(p->memory, stream);
    free(p);
    return epx_error(EPX_ERROR_CUDA, "%s: cudaMemsetAsync of the slot claims failed: %s", fn, cudaGetErrorString(e));
  }
  pd.row_bound = row_bound;
  pd.C = cap ? capacity : 0;
  pd.expert_major = layout != EPX_LAYOUT_RANK_MAJOR;
  pd.align = alignment;
  pd.K = (int)K;
  pd.T = 0;
  p->fused = f;
  p->layout = layout;
  *plan = p;
  return EPX_SUCCESS;
}

extern "C" void epx_fused_plan_destroy(epx_fused_plan_t *p, cudaStream_t stream) {
  if (!p) return;
  cudaFreeAsync(p->memory, stream);
  free(p);
}

extern "C" void epx_fused_plan_view(const epx_fused_plan_t *p, epx_fused_plan_view_t *v) {
  const fused_plan_dev &pd = p->dev;
  const info_index ii = make_info_index(p->fused->dev.W, p->fused->dev.El);
  v->rows = pd.info + ii.rows;
  v->counts = pd.info + ii.ecount;
  v->offsets = pd.info + ii.eoff;
  v->row_src_rank = pd.row_src_rank;
  v->row_src_token = pd.row_src_token;
  v->row_expert = pd.expert_major ? pd.row_expert : pd.pair_expert;
  v->row_w = pd.expert_major ? pd.row_w : pd.pair_w;
  v->invalid = pd.invalid;
  v->pairs = pd.info + ii.pairs;
  v->pair_rows = pd.pair_rows;
  v->row_bound = pd.row_bound;
  v->top_k = pd.K;
}

/* The readback: the invalid word and the info table's head, contiguous in
 * the plan's memory (invalid at 0, info at 64). */
extern "C" size_t epx_fused_plan_readback_bytes(const epx_fused_plan_t *p) {
  return 64 + 8 * (size_t)make_info_index(p->fused->dev.W, p->fused->dev.El).head;
}

extern "C" cudaError_t epx_fused_plan_readback_launch(const epx_fused_plan_t *p, void *host, cudaStream_t stream) {
  return cudaMemcpyAsync(host, p->memory, epx_fused_plan_readback_bytes(p), cudaMemcpyDeviceToHost, stream);
}

extern "C" void epx_fused_plan_summary(const epx_fused_plan_t *p, const void *host, epx_fused_plan_summary_t *s) {
  const info_index ii = make_info_index(p->fused->dev.W, p->fused->dev.El);
  const int64_t *info = reinterpret_cast<const int64_t *>(static_cast<const char *>(host) + 64);
  s->rows = info[ii.rows];
  s->send_pairs = info + ii.scount;
  s->send_routes = info + ii.sroutes;
  s->recv_pairs = info + ii.rcount;
  s->recv_routes = info + ii.rroutes;
  s->headers = info + ii.hdr;
  s->invalid = *static_cast<const uint64_t *>(host);
}
