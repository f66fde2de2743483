/* Routing on the GPU, host glue: epx_cuda_route and epx_cuda_route_backward
 * plan one scratch block, fill the launchers' arguments (launch.h, Routing)
 * and enqueue the kernels of route/forward.cu / route/backward.cu on
 * config->stream. The only host synchronisation is EPX_NONFINITE_ERROR's
 * read of the non-finite flag (and, on a refusal, of the token's row for the
 * message).
 *
 * Scratch comes from a stream-ordered pool of routing's own per device that
 * keeps up to ROUTE_POOL_KEEP bytes reserved across synchronisations (the
 * default pool returns everything at each one, and EPX_NONFINITE_ERROR
 * synchronises on every call). Created on first use, kept for the process. */
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/align.h"
#include "core/error.h"
#include "core/route_spec.h"
#include "cuda/backend.h"
#include "cuda/common/check.h"
#include "cuda/launch.h"

#define ROUTE_MAX_DEVICES 64
#define ROUTE_POOL_KEEP (64ull << 20)

static pthread_mutex_t route_pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static cudaMemPool_t route_pools[ROUTE_MAX_DEVICES];

/* The device's pool, created on first use (under the lock; once made, read
 * without it: a routing call takes no lock). */
static cudaError_t route_pool(int device, cudaMemPool_t *pool) {
  cudaError_t err = cudaSuccess;
  *pool = __atomic_load_n(&route_pools[device], __ATOMIC_ACQUIRE);
  if (*pool) return cudaSuccess;
  pthread_mutex_lock(&route_pool_mutex);
  if (!route_pools[device]) {
    struct cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t created;
    err = cudaMemPoolCreate(&created, &props);
    if (err == cudaSuccess) {
      uint64_t keep = ROUTE_POOL_KEEP;
      err = cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep);
      if (err == cudaSuccess) __atomic_store_n(&route_pools[device], created, __ATOMIC_RELEASE);
      else cudaMemPoolDestroy(created);
    }
  }
  *pool = route_pools[device];
  pthread_mutex_unlock(&route_pool_mutex);
  return err;
}

static cudaError_t route_scratch_alloc(size_t bytes, cudaStream_t stream, void **ptr) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= ROUTE_MAX_DEVICES) return cudaMallocAsync(ptr, bytes, stream);
  cudaMemPool_t pool;
  err = route_pool(device, &pool);
  return err == cudaSuccess ? cudaMallocFromPoolAsync(ptr, bytes, pool, stream) : err;
}

/* Bump allocator over one scratch block; offsets are 256-byte aligned. */
static size_t carve(size_t *cursor, size_t bytes) {
  const size_t at = *cursor;
  *cursor += epx_round256(bytes);
  return at;
}

static void *at(void *base, size_t offset) { return (char *)base + offset; }

/* The selection arguments of the per-token kernels. */
static void select_args(const epx_route_config_t *c, int T, const float *logits, const float *bias,
                        int need_lse, epx_cuda_select_args_t *s) {
  memset(s, 0, sizeof *s);
  s->logits = logits;
  s->bias = bias;
  s->mask = c->token_mask;
  s->T = T;
  s->E = c->num_experts;
  s->K = c->top_k;
  s->G = c->num_groups > 1 ? c->num_groups : 1;
  s->TG = c->topk_groups;
  s->score_fn = (int)c->score_fn;
  s->need_lse = need_lse;
  s->group_top = epx_route_group_top(c->group_score_experts, s->E / s->G);
  s->glanes = 1;
  while (s->glanes * 2 * s->G <= 32) s->glanes *= 2;
  /* umulhi(e, floor((2^32 - 1) / gs) + 1) == e / gs while e * gs < 2^32,
   * which e < E <= 65536 guarantees. */
  const int gs = s->E / s->G;
  s->gmagic = (gs > 1 && s->E <= 65536) ? 0xffffffffu / (unsigned)gs + 1u : 0u;
  s->seqs = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  s->seq_len = T / s->seqs;
}

/* Per-warp shared-memory layout of the per-token kernels, their block shape
 * and grid (sequence-aligned blocks with B > 1 sequences). */
static epx_status_t token_layout(const char *fn, int backward, const epx_route_config_t *c,
                                 epx_cuda_select_args_t *s, int *warps, size_t *bytes,
                                 int *blocks) {
  const size_t E = (size_t)c->num_experts, K = (size_t)c->top_k;
  const size_t G = c->num_groups > 1 ? (size_t)c->num_groups : 0;
  const size_t ep = E + (E >> 5) + 1, gp = G ? G + (G >> 5) + 1 : 0;
  const size_t words = 2 * ep + gp + 2 * K;
  if (words > INT_MAX / 4)
    return epx_error(EPX_ERROR_UNSUPPORTED, "%s: num_experts %d is too large for the CUDA "
                     "backend; route on the CPU", fn, c->num_experts);
  s->y = (int)ep;
  s->g = (int)(2 * ep);
  s->ci = (int)(2 * ep + gp);
  s->cp = (int)(2 * ep + gp + K);
  s->words = (int)words;
  const cudaError_t err =
      backward ? epx_cuda_route_backward_plan(words * 4, EPX_CUDA_ROUTE_MAX_TOKEN_WARPS, warps, bytes)
               : epx_cuda_route_smem_plan(EPX_CUDA_ROUTE_TOKENS, words * 4,
                                          EPX_CUDA_ROUTE_MAX_TOKEN_WARPS, warps, bytes);
  if (err == cudaErrorInvalidValue)
    return epx_error(EPX_ERROR_UNSUPPORTED, "%s: num_experts %d with top_k %d needs %zu bytes of "
                     "shared memory per warp, more than this GPU has; route on the CPU", fn,
                     c->num_experts, c->top_k, words * 4);
  if (err != cudaSuccess) return epx_cuda_fail(err, fn, "the routing kernel's shared memory");
  s->seq_blocks = (s->seq_len + *warps - 1) / *warps;
  *blocks = s->seqs > 1 ? s->seqs * s->seq_blocks : (s->T + *warps - 1) / *warps;
  return EPX_SUCCESS;
}

/* Routes are indexed with int32 on the device (positions are int32 anyway). */
static epx_status_t check_shape(const char *fn, const epx_route_config_t *c, int64_t T) {
  if (T > INT_MAX / c->top_k)
    return epx_error(EPX_ERROR_UNSUPPORTED, "%s: num_tokens * top_k = %lld exceeds 2^31 - 1 on "
                     "the CUDA backend; route in smaller batches", fn, (long long)T * c->top_k);
  return EPX_SUCCESS;
}

static int ceil_log2(long long v) {
  int s = 0;
  while ((1LL << s) < v) ++s;
  return s;
}

/* After the stream's work: EPX_NONFINITE_ERROR's verdict (h_bad > 0: token
 * T - h_bad), with the token's row read back for the message. */
static epx_status_t route_verdict(const char *fn, const float *logits, int T, int E, int h_bad,
                                  cudaStream_t stream) {
  epx_status_t status = EPX_SUCCESS;
  float *row = NULL;
  CUDA_CHECK(cudaStreamSynchronize(stream), fn, "cudaStreamSynchronize");
  if (h_bad <= 0) return EPX_SUCCESS;
  const int t = T - h_bad;
  row = malloc(sizeof(float) * (size_t)E);
  if (!row) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  CUDA_CHECK(cudaMemcpy(row, logits + (size_t)t * E, sizeof(float) * (size_t)E,
                        cudaMemcpyDeviceToHost), fn, "cudaMemcpy");
  status = epx_route_refuse_nonfinite(fn, row, E, t);
fail:
  free(row);
  return status;
}

/* Offsets of the forward's scratch block (0 when absent). */
typedef struct route_plan {
  int T, N, E, K, B, C, warps, blocks, awarps, tile_shift, n_tiles;
  size_t smem, asmem, zero_bytes, total, sort_bytes;
  size_t hist, valid, bad, ticket, offsets, auxcnt, qe, qw, qkey, base, counts, colsum, apart,
      zpart, keys, sorted, rq, flag, sort, wbase;
} route_plan;

/* The scratch of a forward: the zeroed region first, then the rest. */
static epx_status_t route_carve(const char *fn, const epx_route_config_t *c, int want_aux,
                                int want_z, int ranked, int own_counts, route_plan *p,
                                cudaStream_t stream) {
  size_t *n = &p->total;
  p->hist = carve(n, sizeof(int) * (size_t)p->E * p->n_tiles);
  p->valid = carve(n, sizeof(int));
  p->bad = carve(n, sizeof(int));
  p->ticket = carve(n, sizeof(unsigned));
  p->offsets = carve(n, sizeof(int) * ((size_t)p->E + 1));
  if (own_counts) p->auxcnt = carve(n, sizeof(int) * (size_t)p->B * p->E);
  p->zero_bytes = *n;
  p->qe = carve(n, sizeof(int) * (size_t)p->N);
  p->qw = carve(n, sizeof(float) * (size_t)p->N);
  if (ranked) p->qkey = carve(n, sizeof(float) * (size_t)p->N);
  if (c->renormalize_after_drop) p->wbase = carve(n, sizeof(float) * (size_t)p->N);
  p->base = carve(n, sizeof(int) * (size_t)p->n_tiles * p->E);
  p->counts = carve(n, sizeof(int) * (size_t)p->E);
  if (want_aux) {
    p->colsum = carve(n, sizeof(double) * (size_t)p->B * p->E);
    p->apart = carve(n, sizeof(double) * (size_t)p->E * p->blocks);
  }
  if (want_z) p->zpart = carve(n, sizeof(double) * (size_t)p->blocks);
  if (!ranked) return EPX_SUCCESS;
  const cudaError_t err = epx_cuda_route_sort_launch(NULL, &p->sort_bytes, NULL, NULL, p->N, p->E,
                                                     NULL, stream);
  if (err != cudaSuccess) return epx_cuda_fail(err, fn, "the ranked drop's sort");
  p->keys = carve(n, sizeof(unsigned long long) * (size_t)p->N);
  p->sorted = carve(n, sizeof(unsigned long long) * (size_t)p->N);
  p->rq = carve(n, sizeof(int) * (size_t)p->N);
  p->flag = carve(n, sizeof(int) * (size_t)p->N);
  p->sort = carve(n, p->sort_bytes);
  return EPX_SUCCESS;
}

/* The forward's token and scan arguments. */
static void forward_args(const epx_route_config_t *c, const route_plan *p, void *scratch,
                         epx_route_output_t *out, epx_cuda_route_fwd_args_t *fa,
                         epx_cuda_route_scan_args_t *sa) {
  const int want_aux = out->aux_loss != NULL, want_z = out->z_loss != NULL;
  const int check = c->nonfinite == EPX_NONFINITE_ERROR;
  fa->select = 1;
  fa->renorm = c->renormalize && !c->renormalize_after_drop;
  fa->scale = c->scaling_factor;
  fa->by_token = c->queue_order == EPX_QUEUE_BY_TOKEN;
  fa->drop_nonfinite = !check;
  fa->drop_policy = (int)c->drop_policy;
  fa->seed = c->random_seed;
  fa->qe = at(scratch, p->qe);
  fa->qw = at(scratch, p->qw);
  fa->qkey = p->qkey ? at(scratch, p->qkey) : NULL;
  fa->base = p->wbase ? at(scratch, p->wbase) : NULL;
  fa->hist = at(scratch, p->hist);
  fa->n_tiles = p->n_tiles;
  fa->tile_shift = p->tile_shift;
  fa->aux_counts = (int)c->aux_counts;
  fa->auxcnt = p->auxcnt ? at(scratch, p->auxcnt) : NULL;
  fa->valid = (want_aux || want_z) ? at(scratch, p->valid) : NULL;
  fa->bad = at(scratch, p->bad);
  fa->apart = want_aux ? at(scratch, p->apart) : NULL;
  fa->zpart = want_z ? at(scratch, p->zpart) : NULL;

  memset(sa, 0, sizeof *sa);
  sa->hist = fa->hist;
  sa->n_tiles = p->n_tiles;
  sa->E = p->E;
  sa->base = at(scratch, p->base);
  sa->counts = at(scratch, p->counts);
  sa->counts_out = out->expert_counts;
  sa->apart = fa->apart;
  sa->n_blk = p->blocks;
  sa->seqs = fa->s.seqs;
  sa->seq_blocks = fa->s.seq_blocks;
  sa->colsum = want_aux ? at(scratch, p->colsum) : NULL;
  sa->bad = check ? fa->bad : NULL;
  sa->ticket = at(scratch, p->ticket);
  sa->finalize = p->qkey || want_aux || want_z;
  sa->offsets = p->qkey ? at(scratch, p->offsets) : NULL;
  sa->valid = fa->valid;
  sa->zpart = fa->zpart;
  sa->auxcnt = fa->auxcnt;
  sa->aux_global = c->aux_loss_expert_counts;
  sa->aux_k = epx_route_aux_k_factor(c);
  sa->aux_tokens = c->aux_loss_expert_counts ? c->aux_loss_tokens : 0.0;
  sa->aux_out = out->aux_loss;
  sa->z_out = out->z_loss;
  sa->aux_coeff = c->aux_loss_coeff;
  sa->z_coeff = c->z_loss_coeff;
}

/* The assign arguments, and the ranked drop's when there is one. */
static void drop_args(const epx_route_config_t *c, const route_plan *p, void *scratch,
                      const epx_cuda_route_fwd_args_t *fa, const epx_cuda_route_scan_args_t *sa,
                      epx_route_output_t *out, epx_cuda_route_assign_args_t *aa,
                      epx_cuda_route_rank_args_t *ra) {
  memset(aa, 0, sizeof *aa);
  aa->qe = fa->qe;
  aa->qw = fa->qw;
  aa->qkey = fa->qkey;
  aa->base = sa->base;
  aa->N = p->N;
  aa->T = p->T;
  aa->K = p->K;
  aa->E = p->E;
  aa->by_token = fa->by_token;
  aa->n_tiles = p->n_tiles;
  aa->tile_shift = p->tile_shift;
  aa->mode = p->qkey ? 2 : (c->capacity_mode ? 1 : 0);
  aa->C = p->C;
  aa->idx = out->topk_idx;
  aa->w = out->topk_w;
  aa->loc = out->locations;
  aa->offsets = sa->offsets;
  aa->keys = p->qkey ? at(scratch, p->keys) : NULL;
  aa->rq = p->qkey ? at(scratch, p->rq) : NULL;
  aa->bad = sa->bad;
  memset(ra, 0, sizeof *ra);
  ra->counts = sa->counts;
  ra->offsets = sa->offsets;
  ra->sorted = p->qkey ? at(scratch, p->sorted) : NULL;
  ra->rq = aa->rq;
  ra->qw = fa->qw;
  ra->flag = p->qkey ? at(scratch, p->flag) : NULL;
  ra->E = p->E;
  ra->T = p->T;
  ra->K = p->K;
  ra->C = p->C;
  ra->by_token = fa->by_token;
  ra->idx = out->topk_idx;
  ra->w = out->topk_w;
  ra->loc = out->locations;
  ra->bad = sa->bad;
}

/* T = 0: zero counts and losses. */
static epx_status_t route_empty(const char *fn, const epx_route_config_t *c,
                                epx_route_output_t *out, cudaStream_t stream) {
  epx_status_t status = EPX_SUCCESS;
  if (out->expert_counts)
    CUDA_CHECK(cudaMemsetAsync(out->expert_counts, 0, sizeof(int) * (size_t)c->num_experts, stream),
               fn, "cudaMemsetAsync");
  if (out->aux_loss) CUDA_CHECK(cudaMemsetAsync(out->aux_loss, 0, sizeof(float), stream), fn, "cudaMemsetAsync");
  if (out->z_loss) CUDA_CHECK(cudaMemsetAsync(out->z_loss, 0, sizeof(float), stream), fn, "cudaMemsetAsync");
  out->capacity = epx_route_capacity(c, 0);
  out->nonfinite_tokens = -1;
fail:
  return status;
}

/* The forward's plan: shapes, block shapes, scratch offsets. */
static epx_status_t route_forward_plan(const char *fn, const epx_route_config_t *c, int64_t T,
                                       const float *logits, const float *bias,
                                       const epx_route_output_t *out, route_plan *p,
                                       epx_cuda_route_fwd_args_t *fa, cudaStream_t stream) {
  const int want_aux = out->aux_loss != NULL, want_z = out->z_loss != NULL;
  const int after = c->score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK;
  memset(p, 0, sizeof *p);
  memset(fa, 0, sizeof *fa);
  p->T = (int)T;
  p->E = c->num_experts;
  p->K = c->top_k;
  p->N = p->T * p->K;
  p->C = epx_route_capacity(c, T);
  p->B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  select_args(c, p->T, logits, bias, want_z || (after && want_aux), &fa->s);
  epx_status_t status = token_layout(fn, 0, c, &fa->s, &p->warps, &p->smem, &p->blocks);
  if (status != EPX_SUCCESS) return status;
  const cudaError_t err = epx_cuda_route_smem_plan(EPX_CUDA_ROUTE_ASSIGN, sizeof(int) * (size_t)p->E,
                                                   EPX_CUDA_ROUTE_WARPS, &p->awarps, &p->asmem);
  if (err != cudaSuccess) return epx_cuda_fail(err, fn, "the assign kernel's shared memory");
  p->tile_shift = ceil_log2(p->E);
  if (p->tile_shift < EPX_CUDA_ROUTE_MIN_TILE_SHIFT) p->tile_shift = EPX_CUDA_ROUTE_MIN_TILE_SHIFT;
  p->n_tiles = (int)(((long long)p->N + (1LL << p->tile_shift) - 1) >> p->tile_shift);
  const int ranked = c->capacity_mode && c->drop_policy != EPX_DROP_BY_POSITION;
  const int own_counts = want_aux && !c->aux_loss_expert_counts &&
                         (c->aux_counts != EPX_AUX_COUNTS_SELECTED || p->B > 1);
  return route_carve(fn, c, want_aux, want_z, ranked, own_counts, p, stream);
}

/* Whether the one-kernel forward (launch.h) computes this routing: it
 * writes only idx, w and counts, so no capacity, locations or losses; it
 * writes the routes without waiting for the other tokens, so non-finite
 * tokens must be dropped rather than refused. */
static int fast_route(const epx_route_config_t *c, const float *logits, const float *bias,
                      const epx_route_output_t *out) {
  const int E = c->num_experts, G = c->num_groups > 1 ? c->num_groups : 1;
  if (c->capacity_mode || out->locations || out->aux_loss || out->z_loss ||
      c->nonfinite != EPX_NONFINITE_DROP || c->top_k > 32)
    return 0;
  if (E != 32 && E != 64 && E != 128 && E != 256 && E != 512) return 0;
  if (G > 32 || (G & (G - 1)) != 0) return 0;
  if (G > 1 && epx_route_group_top(c->group_score_experts, E / G) > 2) return 0;
  const uintptr_t align = 4u * (uintptr_t)(E / 32 < 4 ? E / 32 : 4);
  return (uintptr_t)logits % align == 0 && (uintptr_t)bias % align == 0;
}

/* The one-kernel forward: zeroed counts, then the kernel. */
static epx_status_t route_fast(const char *fn, const epx_route_config_t *c, int T,
                               const float *logits, const float *bias, epx_route_output_t *out,
                               cudaStream_t stream) {
  epx_status_t status = EPX_SUCCESS;
  epx_cuda_route_fast_args_t a;
  memset(&a, 0, sizeof a);
  a.logits = logits;
  a.bias = bias;
  a.mask = c->token_mask;
  a.T = T;
  a.E = c->num_experts;
  a.K = c->top_k;
  a.G = c->num_groups > 1 ? c->num_groups : 1;
  a.TG = c->topk_groups;
  a.group_top = a.G > 1 ? epx_route_group_top(c->group_score_experts, a.E / a.G) : 1;
  a.score_fn = (int)c->score_fn;
  a.renorm = c->renormalize != 0;
  a.scale = c->scaling_factor;
  a.idx = out->topk_idx;
  a.w = out->topk_w;
  a.counts = out->expert_counts;
  if (a.counts)
    CUDA_CHECK(cudaMemsetAsync(a.counts, 0, sizeof(int32_t) * (size_t)a.E, stream), fn,
               "cudaMemsetAsync");
  CUDA_CHECK(epx_cuda_route_fast_launch(&a, stream), fn, "route_fast");
  out->capacity = epx_route_capacity(c, T);
  out->nonfinite_tokens = -1;
fail:
  return status;
}

epx_status_t epx_cuda_route(const epx_route_config_t *c, int64_t num_tokens, const float *logits,
                            const float *bias, epx_route_output_t *out) {
  static const char fn[] = "epx_route";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = (cudaStream_t)c->stream;
  void *scratch = NULL;
  int h_bad = 0;
  route_plan p;
  epx_cuda_route_fwd_args_t fa;
  epx_cuda_route_scan_args_t sa;
  epx_cuda_route_assign_args_t aa;
  epx_cuda_route_rank_args_t ra;
  if ((status = check_shape(fn, c, num_tokens)) != EPX_SUCCESS) return status;
  if (num_tokens == 0) return route_empty(fn, c, out, stream);
  if (fast_route(c, logits, bias, out))
    return route_fast(fn, c, (int)num_tokens, logits, bias, out, stream);
  EPX_CHECK(route_forward_plan(fn, c, num_tokens, logits, bias, out, &p, &fa, stream));
  CUDA_CHECK(route_scratch_alloc(p.total, stream, &scratch), fn, "the routing scratch");
  CUDA_CHECK(cudaMemsetAsync(scratch, 0, p.zero_bytes, stream), fn, "cudaMemsetAsync");
  forward_args(c, &p, scratch, out, &fa, &sa);
  drop_args(c, &p, scratch, &fa, &sa, out, &aa, &ra);
  CUDA_CHECK(epx_cuda_route_tokens_launch(&fa, p.blocks, p.warps, p.smem, stream), fn, "route_tokens");
  CUDA_CHECK(epx_cuda_route_scan_launch(&sa, stream), fn, "expert_scan");
  CUDA_CHECK(epx_cuda_route_assign_launch(&aa, p.awarps, p.asmem, stream), fn, "assign");
  if (p.qkey) {
    /* Offsets stay zero (empty segments) when a non-finite token stopped the
     * scan, so the sort then does nothing. */
    CUDA_CHECK(epx_cuda_route_sort_launch(at(scratch, p.sort), &p.sort_bytes, aa.keys, at(scratch, p.sorted),
                                          p.N, p.E, sa.offsets, stream), fn, "the ranked drop's sort");
    CUDA_CHECK(epx_cuda_route_rank_launch(&ra, stream), fn, "rank_select");
  }
  if (fa.base)
    CUDA_CHECK(epx_cuda_route_renorm_launch(out->topk_idx, fa.base, out->topk_w, p.T, p.K,
                                            c->scaling_factor, sa.bad, stream), fn, "renorm");
  if (c->nonfinite == EPX_NONFINITE_ERROR)
    CUDA_CHECK(cudaMemcpyAsync(&h_bad, fa.bad, sizeof(int), cudaMemcpyDeviceToHost, stream), fn,
               "cudaMemcpyAsync");
  CUDA_CHECK(cudaFreeAsync(scratch, stream), fn, "cudaFreeAsync");
  scratch = NULL;
  if (c->nonfinite == EPX_NONFINITE_ERROR)
    EPX_CHECK(route_verdict(fn, logits, p.T, p.E, h_bad, stream));
  out->capacity = p.C;
  out->nonfinite_tokens = -1;
  return EPX_SUCCESS;
fail:
  if (scratch) cudaFreeAsync(scratch, stream);
  return status;
}

/* Backward pass 1 (a forward-kernel pass writing no outputs): F of the aux
 * loss [B, E], the valid tokens and the non-finite check, before any
 * gradient row is written. */
static epx_status_t backward_counts(const char *fn, const epx_route_config_t *c, int T,
                                    const float *logits, const float *bias, int need_counts,
                                    int need_valid, cudaStream_t stream, void **scratch,
                                    epx_cuda_route_bwd_args_t *ba) {
  epx_status_t status = EPX_SUCCESS;
  const int B = c->aux_loss_sequences > 1 ? c->aux_loss_sequences : 1;
  const int check = c->nonfinite == EPX_NONFINITE_ERROR;
  epx_cuda_route_fwd_args_t fa;
  int warps = 0, blocks = 0;
  size_t smem = 0, total = 0;
  memset(&fa, 0, sizeof fa);
  /* The plain top-k of softmax-after-top-k's q needs the logits' sumexp. */
  select_args(c, T, logits, bias,
              c->score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK && c->aux_counts == EPX_AUX_COUNTS_PLAIN_TOPK,
              &fa.s);
  EPX_CHECK(token_layout(fn, 0, c, &fa.s, &warps, &smem, &blocks));
  /* hist [E] with every route in tile 0 is the selected routes' count per
   * expert, F itself for one sequence; otherwise F is auxcnt [B, E]. */
  const int own = c->aux_counts != EPX_AUX_COUNTS_SELECTED || B > 1;
  const size_t o_hist = carve(&total, sizeof(int) * (size_t)c->num_experts);
  const size_t o_counts = own ? carve(&total, sizeof(int) * (size_t)B * c->num_experts) : o_hist;
  const size_t o_valid = carve(&total, sizeof(int));
  const size_t o_bad = carve(&total, sizeof(int));
  CUDA_CHECK(route_scratch_alloc(total, stream, scratch), fn, "the routing scratch");
  CUDA_CHECK(cudaMemsetAsync(*scratch, 0, total, stream), fn, "cudaMemsetAsync");
  fa.select = need_counts;
  fa.scale = c->scaling_factor;
  fa.drop_nonfinite = !check;
  fa.aux_counts = (int)c->aux_counts;
  fa.hist = at(*scratch, o_hist);
  fa.auxcnt = own ? at(*scratch, o_counts) : NULL;
  fa.n_tiles = 1;
  fa.tile_shift = 31;
  fa.valid = need_valid ? at(*scratch, o_valid) : NULL;
  fa.bad = at(*scratch, o_bad);
  CUDA_CHECK(epx_cuda_route_tokens_launch(&fa, blocks, warps, smem, stream), fn, "route_tokens");
  ba->counts = at(*scratch, o_counts);
  ba->valid = fa.valid;
  ba->bad = check ? fa.bad : NULL;
fail:
  return status;
}

epx_status_t epx_cuda_route_backward(const epx_route_config_t *c, int64_t num_tokens,
                                     const float *logits, const float *bias,
                                     const int32_t *topk_idx, const float *grad_topk_w,
                                     float grad_aux_loss, float grad_z_loss, float *grad_logits) {
  static const char fn[] = "epx_route_backward";
  epx_status_t status = EPX_SUCCESS;
  cudaStream_t stream = (cudaStream_t)c->stream;
  void *scratch = NULL;
  const int check = c->nonfinite == EPX_NONFINITE_ERROR;
  const double aux_scale = (double)grad_aux_loss * (double)c->aux_loss_coeff;
  const double z_scale = (double)grad_z_loss * (double)c->z_loss_coeff;
  const int need_counts = aux_scale != 0.0 && !c->aux_loss_expert_counts;
  const int need_valid = aux_scale != 0.0 || z_scale != 0.0;
  const int after = c->score_fn == EPX_SCORE_SOFTMAX_AFTER_TOPK;
  int T = 0, warps = 0, blocks = 0, h_bad = 0;
  size_t smem = 0;
  epx_cuda_route_bwd_args_t ba;
  if ((status = check_shape(fn, c, num_tokens)) != EPX_SUCCESS) return status;
  if (num_tokens == 0) return EPX_SUCCESS;
  T = (int)num_tokens;
  memset(&ba, 0, sizeof ba);
  select_args(c, T, logits, bias, z_scale != 0.0 || (after && aux_scale != 0.0), &ba.s);
  EPX_CHECK(token_layout(fn, 1, c, &ba.s, &warps, &smem, &blocks));
  if (need_valid || check)
    EPX_CHECK(backward_counts(fn, c, T, logits, bias, need_counts, need_valid, stream, &scratch,
                              &ba));
  ba.renorm = c->renormalize != 0;
  ba.renorm_after = c->renormalize_after_drop != 0;
  ba.scale = c->scaling_factor;
  ba.topk_idx = topk_idx;
  ba.grad_w = grad_topk_w;
  ba.aux_global = c->aux_loss_expert_counts;
  ba.aux_k = epx_route_aux_k_factor(c);
  ba.aux_tokens = c->aux_loss_expert_counts ? c->aux_loss_tokens : 0.0;
  ba.aux_scale = aux_scale;
  ba.z_scale = z_scale;
  ba.grad = grad_logits;
  CUDA_CHECK(epx_cuda_route_backward_launch(&ba, blocks, warps, smem, stream), fn, "route_backward");
  if (scratch) {
    if (check)
      CUDA_CHECK(cudaMemcpyAsync(&h_bad, ba.bad, sizeof(int), cudaMemcpyDeviceToHost, stream), fn,
                 "cudaMemcpyAsync");
    CUDA_CHECK(cudaFreeAsync(scratch, stream), fn, "cudaFreeAsync");
    scratch = NULL;
  }
  if (check) EPX_CHECK(route_verdict(fn, logits, T, c->num_experts, h_bad, stream));
  return EPX_SUCCESS;
fail:
  if (scratch) cudaFreeAsync(scratch, stream);
  return status;
}
