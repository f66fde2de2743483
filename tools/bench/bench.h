/* What the parts of epx-bench share (tools/epx-bench.c is the entry; the
 * parts live beside this header):
 *   common.c     failure, allocation, time, device mirrors, random numbers
 *   options.c    the command line
 *   world.c      the ranks' barriers and reductions, the memcpy ceilings,
 *                progress notes
 *   reference.c  routing inputs, the reference route, comparisons and their
 *                report lines, the dense reference of a whole layer
 *   experts.c    the SwiGLU experts and one rank's expert work on its rows
 *   main_job.c   the main job: a whole layer step on W ranks
 *   single.c     --single: the one-rank microbenchmark */
#ifndef EPX_TOOLS_BENCH_H
#define EPX_TOOLS_BENCH_H

#include <cblas.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "epx.h"

#if EPX_TOOLS_HAVE_MPI
#include <mpi.h>
#endif
#ifndef EPX_TOOLS_HAVE_CUDA
#define EPX_TOOLS_HAVE_CUDA 0
#endif
#if EPX_TOOLS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* ------------------------------------------------------------------------ */
/* Failure, allocation, time (common.c)                                      */
/* ------------------------------------------------------------------------ */

#if EPX_TOOLS_HAVE_MPI
extern int g_mpi_active; /* MPI_Init done: a failure aborts every process */
#endif
extern _Thread_local int32_t t_rank; /* the rank a failure message names */

/* Any failure of the tool itself (an epx call, an allocation) ends the run:
 * peers blocked in a barrier could not otherwise be released. */
__attribute__((format(printf, 1, 2), noreturn)) void fatal(const char *fmt, ...);

#define TRY(call)                                                                  \
  do {                                                                             \
    epx_status_t try_status_ = (call);                                             \
    if (try_status_ != EPX_SUCCESS)                                                \
      fatal("%s failed: %s: %s", #call, epx_status_string(try_status_), epx_last_error()); \
  } while (0)

#if EPX_TOOLS_HAVE_CUDA
#define CUDA_TRY(call)                                                               \
  do {                                                                               \
    cudaError_t cuda_try_ = (call);                                                  \
    if (cuda_try_ != cudaSuccess) fatal("%s failed: %s", #call, cudaGetErrorString(cuda_try_)); \
  } while (0)
#endif

void *xalloc(size_t bytes);                   /* 64-byte aligned, never NULL */
void *grow(void *p, size_t *cap, size_t need); /* at least need bytes, contents not kept */
double now_s(void);
double median(const double *v, int n);

/* A run's buffer config: the dtype and shape, T tokens a rank, the layout
 * (capacity only for the capacity layout); the caller sets the rest. */
epx_buffer_config_t buffer_config_of(epx_dtype_t dtype, int64_t H, int32_t E, int32_t K, int64_t T,
                                     epx_layout_t layout, int32_t capacity);

/* ------------------------------------------------------------------------ */
/* Device memory (--device cuda): mirrors of the host arrays (common.c)      */
/* ------------------------------------------------------------------------ */

/* On the CPU a mirror is the host array itself and every copy is a no-op; on
 * CUDA it is device memory of the same size, filled and read back around the
 * epx calls (outside the timed regions). */
extern int g_cuda;
extern void *g_stream; /* cudaStream_t of the CUDA buffers and routes */

void *mirror_of(void *host, size_t bytes);
void mirror_free(void *host, void *dev);
void *mirror_grow(void *host, void *dev, size_t *cap, size_t need);
void dev_sync(void);
void upload(void *dev, const void *host, size_t bytes);
void download(void *host, const void *dev, size_t bytes);
void poison(void *host, void *dev, size_t bytes);

/* ------------------------------------------------------------------------ */
/* Random numbers (splitmix64: reproducible per (seed, stream)) (common.c)   */
/* ------------------------------------------------------------------------ */

typedef struct rng {
  uint64_t s;
} rng_t;

uint64_t rng_next(rng_t *r);
rng_t rng_make(uint64_t seed, uint64_t stream);
double rng_open01(rng_t *r); /* (0, 1), never 0 or 1 */
void fill_uniform(rng_t *r, float *v, int64_t n, float scale);
void fill_payload(epx_dtype_t dtype, void *dst, int64_t n, rng_t *r); /* uniform in (-1, 1) */

/* ------------------------------------------------------------------------ */
/* Options (options.c)                                                       */
/* ------------------------------------------------------------------------ */

typedef enum exchange_choice { CHOOSE_DEDUP = 0, CHOOSE_COLLECTIVE = 1, CHOOSE_BOTH = 2 } exchange_choice_t;

typedef struct options {
  int64_t tokens, hidden;
  int32_t experts, topk, ffn, ranks;
  int32_t dtype; /* -1: the mode's default */
  exchange_choice_t exchange;
  epx_layout_t layout;
  int mpi;
  int iters, warmup;
  double zipf;
  double capacity_factor; /* 0: dropless; < 0: the mode's default */
  int single, check, csv;
  uint64_t seed;
  int cuda; /* --device cuda */
  const char *record_trace; /* --record-trace: the routing to epx-replay's file format, or NULL */
  epx_fp8_format_t fp8;     /* --fp8 (--single): the fp8 dispatches timed too; EPX_FP8_NONE: not */
} options_t;

/* Fills o from the command line and the mode's defaults; a bad option
 * prints why and exits 2, --help prints the usage and exits 0. */
void parse_options(int argc, char **argv, options_t *o);
const char *env_nonempty(const char *name);
const char *dtype_name(epx_dtype_t d);
const char *exchange_name(int x);
const char *layout_name(epx_layout_t l);
const char *fp8_name(epx_fp8_format_t f);

/* ------------------------------------------------------------------------ */
/* The world of the ranks (world.c)                                          */
/* ------------------------------------------------------------------------ */

/* A rank of the bench: its comm (the library's local or MPI transport)
 * carries the bench's own barriers and reductions too; NULL alone. */
typedef struct world {
  int32_t rank, size;
  epx_comm_t comm;
} world_t;

void world_barrier(const world_t *w);
void world_max_f64(const world_t *w, double *v, int64_t n); /* in place, every rank gets it */
void world_sum_i64(const world_t *w, int64_t *v, int64_t n); /* in place, every rank gets it */
/* Copy ceilings, aggregate (read + write) GB/s of the median repeat: every
 * rank's memcpy at once; every rank's GPU device-to-device copy at once; n
 * threads copying `bytes` each at once. */
double measure_memcpy(const world_t *w, size_t bytes, int reps);
double measure_device_copy(const world_t *w, size_t bytes, int reps);
double measure_memcpy_threads(int32_t n, size_t bytes);

/* Progress on stderr for runs longer than a couple of seconds (rank 0). */
typedef struct progress {
  double start, last;
} progress_t;

__attribute__((format(printf, 3, 4))) void progress_note(const world_t *w, progress_t *p, const char *fmt, ...);

/* ------------------------------------------------------------------------ */
/* Routing inputs, references, comparisons (reference.c)                     */
/* ------------------------------------------------------------------------ */

/* Rank `rank`'s logits [T, E]: expert popularity Zipf(--zipf) by Gumbel-max. */
void make_logits(const options_t *o, int32_t rank, int64_t T, float *logits);
epx_route_config_t route_config(const options_t *o, int32_t capacity_mode);
void ref_route(const options_t *o, int32_t capacity_mode, int64_t T, const float *logits, int32_t *idx, float *w,
               int32_t *capacity);
void ref_route_backward(const options_t *o, int32_t capacity_mode, int64_t T, const float *logits,
                        const int32_t *idx, const float *grad_w, float *grad_logits);

typedef struct tolerance {
  double atol_frac; /* absolute part, as a fraction of max |ref| */
  double rtol;
} tolerance_t;

tolerance_t tolerance_of(epx_dtype_t d);

typedef struct compare_result {
  int64_t count, bad;
  double max_err, max_ref;
} compare_result_t;

compare_result_t compare_f32(const float *got, const float *ref, int64_t n, tolerance_t tol);
compare_result_t compare_payload(epx_dtype_t dtype, const void *got, const float *ref, int64_t n, tolerance_t tol);
/* Sum a comparison (a count of differing values) over ranks, print its
 * `check` line on rank 0 and return its verdict. */
int report_compare(const world_t *w, const char *what, compare_result_t c, tolerance_t tol);
int report_count(const world_t *w, const char *what, int64_t bad, int64_t count);
int64_t count_diff_bytes(const void *a, const void *b, int64_t n, size_t es);

/* ------------------------------------------------------------------------ */
/* Experts (experts.c)                                                       */
/* ------------------------------------------------------------------------ */

/* Weights of every expert, [E][gate [H, F], up [H, F], down [F, H]], float32,
 * the same on every rank (drawn from the seed); rank r uses its E_local. */
typedef struct experts {
  int64_t H;
  int32_t F, E;
  float *w;
} experts_t;

int64_t expert_stride(const experts_t *x);
void experts_make(experts_t *x, const options_t *o);
void ffn_forward(const experts_t *x, int32_t e, int64_t m, const float *X, float *G, float *U, float *A, float *Y);
void ffn_backward(const experts_t *x, int32_t e, int64_t m, float *X, float *G, float *U, float *A,
                  const float *dY, float *dX, float *dW);

/* An item is one (received row, local expert) pair the expert computes. In
 * the expert-major and capacity layouts the items of expert e are its rows
 * (capacity: the whole [W*C] block, empty slots included, as a capacity
 * GEMM does); in the rank-major layout a row holds one item per local expert
 * in its routing, and the expert applies the weight itself. */
typedef struct rank_experts {
  const experts_t *ex;
  epx_layout_t layout;
  epx_dtype_t dtype;
  int32_t rank, E_local, K;
  int64_t H;
  /* the handle's layout */
  int64_t N;
  int64_t *counts, *offsets;   /* [E_local], [E_local + 1] */
  int32_t *recv_expert;        /* [N] or [N, K] */
  float *recv_w;               /* [N, K] (rank-major) */
  size_t recv_expert_cap, recv_w_cap;
  /* items grouped by local expert */
  int64_t n_items;
  int64_t *first;              /* [E_local + 1] */
  int64_t *item_row;
  int32_t *item_slot;          /* rank-major column k, else -1 */
  float *item_w;
  size_t item_row_cap, item_slot_cap, item_w_cap;
  /* activations kept from forward to backward (SwiGLU) */
  float *X, *Y, *G, *U, *A, *acc;
  size_t X_cap, Y_cap, G_cap, U_cap, A_cap, acc_cap;
  /* rank-major: grad_w of each (row, k), returned through a combine */
  float *slot_grad_w;          /* [N, K] */
  size_t slot_grad_w_cap;
  double flops_fwd, flops_bwd;
} rank_experts_t;

void rank_experts_plan(rank_experts_t *re, epx_handle_t h);
void rank_experts_forward(rank_experts_t *re, const void *recv_x, void *expert_out);
void rank_experts_backward(rank_experts_t *re, const void *grad_expert_out, const void *recv_x, void *grad_recv_x,
                           float *dW);
void rank_experts_free(rank_experts_t *re);

/* The dense reference of a whole layer for one rank's tokens (reference.c). */
typedef struct layer_ref {
  float *out;         /* [T, H] */
  float *grad_x;      /* [T, H] */
  float *grad_w;      /* [T, K] */
  float *grad_logits; /* [T, E] */
} layer_ref_t;

void layer_reference(const experts_t *ex, epx_dtype_t dtype, int64_t T, int32_t K, const int32_t *idx,
                     const float *w, const options_t *o, const float *logits, const void *x, const void *grad_out,
                     layer_ref_t *ref);

/* ------------------------------------------------------------------------ */
/* The two modes                                                             */
/* ------------------------------------------------------------------------ */

/* Shared by every rank of the process (main_job.c). */
typedef struct job {
  const options_t *o;
  experts_t ex;
  double memcpy_gbps; /* rank 0's copy ceiling */
  int ok;
} job_t;

/* One rank's whole main job over comm (w carries the bench's own barriers
 * and sums); rank 0 prints and sets job->ok. */
void main_job_rank(job_t *job, const world_t *w, epx_comm_t comm);

/* --single in one dtype; returns its verdict (single.c). */
int single_run(const options_t *o, epx_dtype_t dtype, const world_t *w);

#endif
