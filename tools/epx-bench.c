/*
 * epx-bench — the main job of epx.
 *
 * With no arguments it runs a whole Mixture-of-Experts layer step on 4
 * in-process ranks: route (softmax, top-k) -> dispatch_layout + dispatch ->
 * a SwiGLU expert FFN per local expert (OpenBLAS sgemm on the received rows)
 * -> combine, then the backward of all of it (combine_backward with grad_w,
 * the SwiGLU backward, dispatch_backward, route_backward). It times every
 * phase (median over iterations of the slowest rank), reports the rows and
 * bytes that crossed ranks against a memcpy ceiling measured in the same run,
 * runs the dedup and the collective exchange on the same routing, checks that
 * they agree bit for bit, and checks both against a dense reference computed
 * here: each token's output as sum_k w_k * FFN_e(x) and the gradients of x,
 * of the weights and of the logits.
 *
 * --single is the one-rank microbenchmark of the data-movement calls against
 * memcpy and the dense one-hot reference (epx_reference_dense_*).
 *
 * Under mpirun (or --transport mpi) each process is one rank of an MPI comm
 * and rank 0 prints. With --device cuda (under mpirun, one process per GPU)
 * the buffers are CUDA buffers over an NCCL comm made from a unique id shared
 * over MPI (epx_comm_create_nccl_mpi), routing and its backward run on the
 * GPU, and the experts stay on the host: each phase copies its inputs to the
 * GPU and its outputs back outside the timed region, so the same checks
 * apply unchanged and the times are the epx calls (stream synchronised).
 * The last line printed is OK or FAILED; the exit status matches it. Performance targets are reported as met/missed and do not
 * change the verdict, which is about correctness.
 */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

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
/* Failure, allocation, time                                                 */
/* ------------------------------------------------------------------------ */

static pthread_mutex_t g_fatal_lock = PTHREAD_MUTEX_INITIALIZER;
#if EPX_TOOLS_HAVE_MPI
static int g_mpi_active;
#endif
static _Thread_local int32_t t_rank;

/* Any failure of the tool itself (an epx call, an allocation) ends the run:
 * peers blocked in a barrier could not otherwise be released. */
static void fatal(const char *fmt, ...) {
  pthread_mutex_lock(&g_fatal_lock);
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "epx-bench: rank %d: ", (int)t_rank);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  fflush(stderr);
  printf("FAILED\n");
  fflush(stdout);
#if EPX_TOOLS_HAVE_MPI
  if (g_mpi_active) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  _Exit(1);
}

#define TRY(call)                                                                  \
  do {                                                                             \
    epx_status_t try_status_ = (call);                                             \
    if (try_status_ != EPX_SUCCESS)                                                \
      fatal("%s failed: %s: %s", #call, epx_status_string(try_status_), epx_last_error()); \
  } while (0)

/* 64-byte aligned (the payload contract asks for 16), never NULL. Large
 * tensors are 2 MiB aligned and asked to live on huge pages, as a serving or
 * training engine's allocator would: rows are read in scattered order, and
 * with 4 KiB pages nearly every row costs a TLB miss (measured here: f32
 * combine 22 -> 15 ms at T=8192, H=2048, K=3). The memcpy ceiling uses the
 * same allocator, so the ratios compare like with like. */
static void *xalloc(size_t bytes) {
  const size_t huge = (size_t)2 << 20;
  size_t alignment = bytes >= huge ? huge : 64;
  size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  void *p = aligned_alloc(alignment, rounded ? rounded : 64);
  if (!p) fatal("out of memory allocating %zu bytes", bytes);
  if (alignment == huge) madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}

/* Grows a scratch array to at least `need` bytes; the contents are not kept. */
static void *grow(void *p, size_t *cap, size_t need) {
  if (need <= *cap && p) return p;
  free(p);
  *cap = need;
  return xalloc(need);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(const double *v, int n) {
  double *c = xalloc(sizeof(double) * (size_t)n);
  memcpy(c, v, sizeof(double) * (size_t)n);
  qsort(c, (size_t)n, sizeof(double), cmp_double);
  double m = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
  free(c);
  return m;
}

/* ------------------------------------------------------------------------ */
/* Device memory (--device cuda): mirrors of the host arrays epx reads/writes */
/* ------------------------------------------------------------------------ */

/* On the CPU a mirror is the host array itself and every copy is a no-op; on
 * CUDA it is device memory of the same size, filled and read back around the
 * epx calls (outside the timed regions). */
static int g_cuda;
static void *g_stream; /* cudaStream_t of the CUDA buffers and routes */

#if EPX_TOOLS_HAVE_CUDA
#define CUDA_TRY(call)                                                               \
  do {                                                                               \
    cudaError_t cuda_try_ = (call);                                                  \
    if (cuda_try_ != cudaSuccess) fatal("%s failed: %s", #call, cudaGetErrorString(cuda_try_)); \
  } while (0)
#endif

static void *mirror_of(void *host, size_t bytes) {
  if (!g_cuda) return host;
  void *d = NULL;
#if EPX_TOOLS_HAVE_CUDA
  CUDA_TRY(cudaMalloc(&d, bytes ? bytes : 16));
#else
  (void)bytes;
#endif
  return d;
}

static void mirror_free(void *host, void *dev) {
  if (dev == host) return;
#if EPX_TOOLS_HAVE_CUDA
  cudaFree(dev);
#endif
}

/* A device mirror grown with its host array (grow()'s contract). */
static void *mirror_grow(void *host, void *dev, size_t *cap, size_t need) {
  if (!g_cuda) return host;
  if (dev && need <= *cap) return dev;
  mirror_free(NULL, dev);
  *cap = need;
  return mirror_of(NULL, need);
}

static void dev_sync(void) {
#if EPX_TOOLS_HAVE_CUDA
  if (g_cuda) CUDA_TRY(cudaStreamSynchronize((cudaStream_t)g_stream));
#endif
}

/* On the buffers' stream and waited for: a cudaMemcpy from pageable memory
 * may return before its DMA lands, and the buffers' non-blocking stream
 * would not wait for it (the next epx call could read old rows, and its
 * timing would include the copy's tail). */
static void upload(void *dev, const void *host, size_t bytes) {
  if (dev == host || !bytes) return;
#if EPX_TOOLS_HAVE_CUDA
  CUDA_TRY(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, (cudaStream_t)g_stream));
  dev_sync();
#endif
}

/* After epx's work on the buffers' stream (stream order), and waited for. */
static void download(void *host, const void *dev, size_t bytes) {
  if (dev == host || !bytes) return;
#if EPX_TOOLS_HAVE_CUDA
  CUDA_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)g_stream));
#endif
  dev_sync();
}

static void poison(void *host, void *dev, size_t bytes) {
  memset(host, 0xff, bytes);
  if (dev == host) return;
#if EPX_TOOLS_HAVE_CUDA
  CUDA_TRY(cudaMemsetAsync(dev, 0xff, bytes, (cudaStream_t)g_stream));
  dev_sync();
#endif
}

/* ------------------------------------------------------------------------ */
/* Random numbers (splitmix64: reproducible per (seed, stream))              */
/* ------------------------------------------------------------------------ */

typedef struct rng {
  uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static rng_t rng_make(uint64_t seed, uint64_t stream) {
  rng_t r = {seed * 0xd1342543de82ef95ull + stream * 0x9e3779b97f4a7c15ull + 1};
  rng_next(&r);
  return r;
}

/* (0, 1), never 0 or 1 (the Gumbel draw takes two logs). */
static double rng_open01(rng_t *r) { return ((double)(rng_next(r) >> 11) + 0.5) * 0x1.0p-53; }

static void fill_uniform(rng_t *r, float *v, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++) v[i] = scale * (float)(2.0 * rng_open01(r) - 1.0);
}

/* n payload elements of dtype, uniform in (-1, 1). */
static void fill_payload(epx_dtype_t dtype, void *dst, int64_t n, rng_t *r) {
  float tmp[4096];
  size_t es = epx_dtype_size(dtype);
  for (int64_t i = 0; i < n; i += 4096) {
    int64_t m = n - i < 4096 ? n - i : 4096;
    fill_uniform(r, tmp, m, 1.0f);
    TRY(epx_convert(dtype, (char *)dst + (size_t)i * es, EPX_FLOAT32, tmp, m));
  }
}

/* ------------------------------------------------------------------------ */
/* Options                                                                   */
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
} options_t;

static const char *dtype_name(epx_dtype_t d) {
  return d == EPX_BFLOAT16 ? "bf16" : d == EPX_FLOAT16 ? "f16" : "f32";
}
static const char *exchange_name(int x) { return x == EPX_EXCHANGE_DEDUP ? "dedup" : "collective"; }
static const char *layout_name(epx_layout_t l) {
  return l == EPX_LAYOUT_RANK_MAJOR ? "rank" : l == EPX_LAYOUT_CAPACITY ? "capacity" : "expert";
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: epx-bench [options]\n"
          "  With no options: one MoE layer step (route, dispatch, SwiGLU experts on OpenBLAS,\n"
          "  combine, and the backward of all of it) on 4 in-process ranks, both exchanges,\n"
          "  timed per phase and checked against a dense reference. The last line is OK or\n"
          "  FAILED and the exit status matches it.\n"
          "\n"
          "  --tokens T            tokens per rank (2048; --single: 8192)\n"
          "  --hidden H            hidden size, a multiple of 8 (1024; --single: 2048)\n"
          "  --experts E           experts, a multiple of the ranks (64; --single: 16)\n"
          "  --topk K              experts per token (6; --single: 3)\n"
          "  --ffn F               SwiGLU intermediate size (128); 0: a per-expert scale\n"
          "                        instead of the FFN (exchange-bound runs)\n"
          "  --ranks W             in-process ranks of the local transport (4)\n"
          "  --dtype f32|bf16|f16  payload dtype (f32; --single: f32 then bf16)\n"
          "  --exchange dedup|collective|both   (both)\n"
          "  --layout expert|rank|capacity      receive layout (expert)\n"
          "  --transport local|mpi (local; mpi when started by mpirun)\n"
          "  --device cpu|cuda     the buffers' device (cpu); cuda: under mpirun, one process\n"
          "                        per GPU over NCCL, routing on the GPU, experts on the host\n"
          "  --iters N             timed iterations, the median is reported (3; --single: 10)\n"
          "  --warmup N            untimed iterations first (1; --single: 2)\n"
          "  --zipf S              routing skew: expert popularity follows Zipf(S) (0: uniform)\n"
          "  --capacity-factor C   capacity mode with factor C (0: dropless; --single and\n"
          "                        --layout capacity: 1.0)\n"
          "  --seed N              seed of every random input (1)\n"
          "  --single              one-rank microbenchmark of route/dispatch/combine forward\n"
          "                        and backward against memcpy and the dense one-hot reference\n"
          "  --no-check            skip the correctness checks\n"
          "  --csv                 print the timing table as CSV\n"
          "  --help                this text\n");
}

static int parse_dtype(const char *s) {
  if (!strcmp(s, "f32") || !strcmp(s, "float32")) return EPX_FLOAT32;
  if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) return EPX_BFLOAT16;
  if (!strcmp(s, "f16") || !strcmp(s, "float16")) return EPX_FLOAT16;
  return -1;
}

static int64_t parse_int(const char *opt, const char *s, int64_t lo) {
  char *end;
  long long v = strtoll(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < lo) {
    fprintf(stderr, "epx-bench: %s %s: expected an integer >= %lld\n", opt, s, (long long)lo);
    exit(2);
  }
  return (int64_t)v;
}

static double parse_real(const char *opt, const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*s == '\0' || *end != '\0' || !(v >= 0.0)) {
    fprintf(stderr, "epx-bench: %s %s: expected a number >= 0\n", opt, s);
    exit(2);
  }
  return v;
}

static const char *env_nonempty(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

static void parse_options(int argc, char **argv, options_t *o) {
  *o = (options_t){-1, -1, -1, -1, -1, -1, -1, CHOOSE_BOTH, EPX_LAYOUT_EXPERT_MAJOR, 0,
                   -1, -1, 0.0, -1.0, 0, 1, 0, 1, 0};
  o->mpi = env_nonempty("OMPI_COMM_WORLD_SIZE") || env_nonempty("PMI_SIZE") ||
           env_nonempty("PMIX_RANK");
  for (int i = 1; i < argc; i++) {
    char *arg = argv[i];
    const char *val = NULL;
    char name[64];
    char *eq = strchr(arg, '=');
    if (eq && (size_t)(eq - arg) < sizeof name) {
      memcpy(name, arg, (size_t)(eq - arg));
      name[eq - arg] = '\0';
      val = eq + 1;
    } else {
      snprintf(name, sizeof name, "%s", arg);
    }
    int flag = !strcmp(name, "--single") || !strcmp(name, "--no-check") || !strcmp(name, "--csv") ||
               !strcmp(name, "--help") || !strcmp(name, "-h");
    if (!flag && !val) {
      if (i + 1 >= argc) {
        fprintf(stderr, "epx-bench: %s needs a value (see --help)\n", name);
        exit(2);
      }
      val = argv[++i];
    }
    if (!strcmp(name, "--help") || !strcmp(name, "-h")) {
      usage(stdout);
      exit(0);
    } else if (!strcmp(name, "--single")) {
      o->single = 1;
    } else if (!strcmp(name, "--no-check")) {
      o->check = 0;
    } else if (!strcmp(name, "--csv")) {
      o->csv = 1;
    } else if (!strcmp(name, "--tokens")) {
      o->tokens = parse_int(name, val, 0);
    } else if (!strcmp(name, "--hidden")) {
      o->hidden = parse_int(name, val, 8);
    } else if (!strcmp(name, "--experts")) {
      o->experts = (int32_t)parse_int(name, val, 1);
    } else if (!strcmp(name, "--topk")) {
      o->topk = (int32_t)parse_int(name, val, 1);
    } else if (!strcmp(name, "--ffn")) {
      o->ffn = (int32_t)parse_int(name, val, 0);
    } else if (!strcmp(name, "--ranks")) {
      o->ranks = (int32_t)parse_int(name, val, 1);
    } else if (!strcmp(name, "--iters")) {
      o->iters = (int)parse_int(name, val, 1);
    } else if (!strcmp(name, "--warmup")) {
      o->warmup = (int)parse_int(name, val, 0);
    } else if (!strcmp(name, "--seed")) {
      o->seed = (uint64_t)parse_int(name, val, 0);
    } else if (!strcmp(name, "--zipf")) {
      o->zipf = parse_real(name, val);
    } else if (!strcmp(name, "--capacity-factor")) {
      o->capacity_factor = parse_real(name, val);
    } else if (!strcmp(name, "--dtype")) {
      o->dtype = parse_dtype(val);
      if (o->dtype < 0) {
        fprintf(stderr, "epx-bench: --dtype %s: expected f32, bf16 or f16\n", val);
        exit(2);
      }
    } else if (!strcmp(name, "--exchange")) {
      if (!strcmp(val, "dedup")) o->exchange = CHOOSE_DEDUP;
      else if (!strcmp(val, "collective")) o->exchange = CHOOSE_COLLECTIVE;
      else if (!strcmp(val, "both")) o->exchange = CHOOSE_BOTH;
      else {
        fprintf(stderr, "epx-bench: --exchange %s: expected dedup, collective or both\n", val);
        exit(2);
      }
    } else if (!strcmp(name, "--layout")) {
      if (!strcmp(val, "expert")) o->layout = EPX_LAYOUT_EXPERT_MAJOR;
      else if (!strcmp(val, "rank")) o->layout = EPX_LAYOUT_RANK_MAJOR;
      else if (!strcmp(val, "capacity")) o->layout = EPX_LAYOUT_CAPACITY;
      else {
        fprintf(stderr, "epx-bench: --layout %s: expected expert, rank or capacity\n", val);
        exit(2);
      }
    } else if (!strcmp(name, "--device")) {
      if (!strcmp(val, "cuda")) o->cuda = 1;
      else if (!strcmp(val, "cpu")) o->cuda = 0;
      else {
        fprintf(stderr, "epx-bench: --device %s: expected cpu or cuda\n", val);
        exit(2);
      }
    } else if (!strcmp(name, "--transport")) {
      if (!strcmp(val, "mpi")) o->mpi = 1;
      else if (!strcmp(val, "local")) o->mpi = 0;
      else {
        fprintf(stderr, "epx-bench: --transport %s: expected local or mpi\n", val);
        exit(2);
      }
    } else {
      fprintf(stderr, "epx-bench: unknown option %s (see --help)\n", arg);
      exit(2);
    }
  }
  /* The mode's defaults for what was not given. */
  if (o->single) {
    if (o->tokens < 0) o->tokens = 8192;
    if (o->hidden < 0) o->hidden = 2048;
    if (o->experts < 0) o->experts = 16;
    if (o->topk < 0) o->topk = 3;
    if (o->iters < 0) o->iters = 10;
    if (o->warmup < 0) o->warmup = 2;
    if (o->capacity_factor < 0) o->capacity_factor = 1.0;
    o->ranks = 1;
  } else {
    if (o->tokens < 0) o->tokens = 2048;
    if (o->hidden < 0) o->hidden = 1024;
    if (o->experts < 0) o->experts = 64;
    if (o->topk < 0) o->topk = 6;
    if (o->iters < 0) o->iters = 3;
    if (o->warmup < 0) o->warmup = 1;
    if (o->ranks < 0) o->ranks = 4;
    if (o->capacity_factor < 0) o->capacity_factor = o->layout == EPX_LAYOUT_CAPACITY ? 1.0 : 0.0;
    if (o->layout == EPX_LAYOUT_CAPACITY && o->capacity_factor == 0.0) {
      fprintf(stderr, "epx-bench: --layout capacity needs --capacity-factor > 0\n");
      exit(2);
    }
  }
  if (o->ffn < 0) o->ffn = 128;
  if (o->hidden % 8) {
    fprintf(stderr, "epx-bench: --hidden %lld: must be a multiple of 8\n", (long long)o->hidden);
    exit(2);
  }
  if (o->topk > o->experts) {
    fprintf(stderr, "epx-bench: --topk %d > --experts %d\n", (int)o->topk, (int)o->experts);
    exit(2);
  }
  if (o->layout == EPX_LAYOUT_RANK_MAJOR && o->topk > o->hidden) {
    fprintf(stderr, "epx-bench: --layout rank returns grad_w through a combine of [N, H] rows: needs --topk <= --hidden\n");
    exit(2);
  }
  if (o->cuda && (o->single || !o->mpi)) {
    fprintf(stderr, "epx-bench: --device cuda runs the main job under mpirun (one process per GPU)\n");
    exit(2);
  }
  if (o->single && o->layout == EPX_LAYOUT_RANK_MAJOR) {
    fprintf(stderr, "epx-bench: --single compares with the dense [E, C, H] reference: use --layout expert or capacity\n");
    exit(2);
  }
}

/* ------------------------------------------------------------------------ */
/* The world of the ranks: barriers and reductions for timing and checks     */
/* ------------------------------------------------------------------------ */

/* A rank of the bench: its comm (the library's local or MPI transport)
 * carries the bench's own barriers and reductions too; NULL alone. */
typedef struct world {
  int32_t rank, size;
  epx_comm_t comm;
} world_t;

static void world_barrier(const world_t *w) {
  if (w->size > 1) TRY(epx_comm_barrier(w->comm));
}

/* Every rank's n values, [size, n] (free it). */
static void *world_gather(const world_t *w, const void *v, size_t bytes) {
  void *all = xalloc(bytes * (size_t)w->size);
  TRY(epx_comm_allgather(w->comm, v, all, bytes));
  return all;
}

/* v[i] = max over ranks (in place, every rank gets it). */
static void world_max_f64(const world_t *w, double *v, int64_t n) {
  if (w->size == 1) return;
  double *all = world_gather(w, v, sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++)
    for (int32_t r = 0; r < w->size; r++)
      if (all[(size_t)r * (size_t)n + (size_t)i] > v[i]) v[i] = all[(size_t)r * (size_t)n + (size_t)i];
  free(all);
}

/* v[i] = sum over ranks (in place, every rank gets it). */
static void world_sum_i64(const world_t *w, int64_t *v, int64_t n) {
  if (w->size == 1) return;
  int64_t *all = world_gather(w, v, sizeof(int64_t) * (size_t)n);
  for (int64_t i = 0; i < n; i++) {
    int64_t x = 0;
    for (int32_t r = 0; r < w->size; r++) x += all[(size_t)r * (size_t)n + (size_t)i];
    v[i] = x;
  }
  free(all);
}

/* Bandwidth ceiling: every rank copies `bytes` at once, barrier-aligned;
 * returns the aggregate (read + write) GB/s of the median repeat. */
static double measure_memcpy(const world_t *w, size_t bytes, int reps) {
  char *src = xalloc(bytes), *dst = xalloc(bytes);
  memset(src, 1, bytes);
  memset(dst, 0, bytes);
  double t[16];
  if (reps > 16) reps = 16;
  for (int r = 0; r < reps; r++) {
    world_barrier(w);
    double t0 = now_s();
    memcpy(dst, src, bytes);
    t[r] = now_s() - t0;
    src[(size_t)r * 4096 % bytes]++; /* keeps the copies from being merged */
  }
  world_max_f64(w, t, reps);
  free(src);
  free(dst);
  return 2.0 * (double)bytes * w->size / median(t, reps) / 1e9;
}

/* The ceiling on a GPU (--device cuda): a device-to-device copy of `bytes`
 * on every rank's GPU at once; aggregate (read + write) GB/s of the median. */
static double measure_device_copy(const world_t *w, size_t bytes, int reps) {
  double t[16];
  if (reps > 16) reps = 16;
#if EPX_TOOLS_HAVE_CUDA
  void *src = NULL, *dst = NULL;
  CUDA_TRY(cudaMalloc(&src, bytes));
  CUDA_TRY(cudaMalloc(&dst, bytes));
  CUDA_TRY(cudaMemset(src, 1, bytes));
  for (int r = 0; r < reps; r++) {
    CUDA_TRY(cudaDeviceSynchronize());
    world_barrier(w);
    double t0 = now_s();
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)g_stream));
    dev_sync();
    t[r] = now_s() - t0;
  }
  cudaFree(src);
  cudaFree(dst);
#else
  (void)bytes;
  fatal("no CUDA in this build"); /* not reached: g_cuda is set by CUDA builds only */
#endif
  world_max_f64(w, t, reps);
  return 2.0 * (double)bytes * w->size / median(t, reps) / 1e9;
}

typedef struct memcpy_thread_arg {
  epx_local_world_t world;
  int32_t rank, size;
  size_t bytes;
  double gbps;
} memcpy_thread_arg_t;

static void *memcpy_thread(void *p) {
  memcpy_thread_arg_t *a = p;
  world_t w = {a->rank, a->size, NULL};
  TRY(epx_comm_create_local(a->world, a->rank, &w.comm));
  a->gbps = measure_memcpy(&w, a->bytes, 5);
  TRY(epx_comm_destroy(w.comm));
  return NULL;
}

/* The ceiling of n threads copying `bytes` each at once (aggregate GB/s). */
static double measure_memcpy_threads(int32_t n, size_t bytes) {
  epx_local_world_t lw;
  TRY(epx_local_world_create(n, NULL, &lw));
  pthread_t *th = xalloc(sizeof(pthread_t) * (size_t)n);
  memcpy_thread_arg_t *args = xalloc(sizeof(memcpy_thread_arg_t) * (size_t)n);
  for (int32_t r = 0; r < n; r++) {
    args[r] = (memcpy_thread_arg_t){lw, r, n, bytes, 0.0};
    if (pthread_create(&th[r], NULL, memcpy_thread, &args[r])) fatal("pthread_create failed");
  }
  for (int32_t r = 0; r < n; r++) pthread_join(th[r], NULL);
  double gbps = args[0].gbps;
  TRY(epx_local_world_destroy(lw));
  free(th);
  free(args);
  return gbps;
}

/* Progress on stderr for runs longer than a couple of seconds (rank 0). */
typedef struct progress {
  double start, last;
} progress_t;

static void progress_note(const world_t *w, progress_t *p, const char *fmt, ...) {
  double t = now_s();
  if (w->rank != 0 || t - p->start < 2.0 || t - p->last < 1.0) return;
  p->last = t;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "epx-bench: [%6.1f s] ", t - p->start);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

/* ------------------------------------------------------------------------ */
/* Routing inputs and the reference route                                    */
/* ------------------------------------------------------------------------ */

/* logits[t, e] = bias[e] + Gumbel noise. With bias[e] = -S * log(1 + rank of e
 * in a fixed random order), the top-1 choice is drawn from softmax(bias), so
 * expert popularity follows Zipf(S) (Gumbel-max), and top-k is sampling
 * without replacement with the same weights. S = 0 is uniform routing. */
static void make_logits(const options_t *o, int32_t rank, int64_t T, float *logits) {
  int32_t E = o->experts;
  float *bias = xalloc(sizeof(float) * (size_t)E);
  int32_t *perm = xalloc(sizeof(int32_t) * (size_t)E);
  rng_t pr = rng_make(o->seed, 0x5eed);
  for (int32_t e = 0; e < E; e++) perm[e] = e;
  for (int32_t e = E - 1; e > 0; e--) {
    int32_t j = (int32_t)(rng_next(&pr) % (uint64_t)(e + 1));
    int32_t tmp = perm[e];
    perm[e] = perm[j];
    perm[j] = tmp;
  }
  for (int32_t i = 0; i < E; i++) bias[perm[i]] = (float)(-o->zipf * log(1.0 + i));
  rng_t r = rng_make(o->seed, 16 * (uint64_t)rank + 3);
  for (int64_t t = 0; t < T; t++)
    for (int32_t e = 0; e < E; e++)
      logits[t * E + e] = bias[e] + (float)(-log(-log(rng_open01(&r))));
  free(bias);
  free(perm);
}

static epx_route_config_t route_config(const options_t *o, int32_t capacity_mode) {
  epx_route_config_t rc = EPX_ROUTE_CONFIG_INIT;
  rc.num_experts = o->experts;
  rc.top_k = o->topk;
  rc.score_fn = EPX_SCORE_SOFTMAX;
  rc.renormalize = 0;
  rc.capacity_mode = capacity_mode;
  rc.capacity_factor = (float)o->capacity_factor;
  return rc;
}

/* The route the bench expects from epx_route with route_config(): the
 * library's float64 reference (epx_reference_route), weights rounded to
 * float; *capacity gets its C. */
static void ref_route(const options_t *o, int32_t capacity_mode, int64_t T, const float *logits,
                      int32_t *idx, float *w, int32_t *capacity) {
  const epx_route_config_t rc = route_config(o, capacity_mode);
  double *w64 = xalloc(sizeof(double) * (size_t)(T * o->topk + 1));
  TRY(epx_reference_route(&rc, T, logits, NULL, idx, w64, NULL, NULL, NULL, NULL, capacity));
  for (int64_t i = 0; i < T * o->topk; i++) w[i] = (float)w64[i];
  free(w64);
}

/* d loss / d logits from d loss / d w (grad_w [T, K]) by the library's
 * float64 reference (epx_reference_route_backward), rounded to float. */
static void ref_route_backward(const options_t *o, int32_t capacity_mode, int64_t T,
                               const float *logits, const int32_t *idx, const float *grad_w,
                               float *grad_logits) {
  const epx_route_config_t rc = route_config(o, capacity_mode);
  const int64_t n = T * o->experts;
  double *g64 = xalloc(sizeof(double) * (size_t)(n + 1));
  TRY(epx_reference_route_backward(&rc, T, logits, NULL, idx, grad_w, 0.0, 0.0, g64));
  for (int64_t i = 0; i < n; i++) grad_logits[i] = (float)g64[i];
  free(g64);
}

/* ------------------------------------------------------------------------ */
/* Comparisons                                                               */
/* ------------------------------------------------------------------------ */

typedef struct tolerance {
  double atol_frac; /* absolute part, as a fraction of max |ref| */
  double rtol;
} tolerance_t;

/* Tolerances per payload dtype. f32 differs from the reference only by the
 * order of float32 sums; bf16/f16 round expert outputs and gradients once
 * more on the exchange path than in the reference. */
static tolerance_t tolerance_of(epx_dtype_t d) {
  if (d == EPX_BFLOAT16) return (tolerance_t){2e-2, 2e-2};
  if (d == EPX_FLOAT16) return (tolerance_t){4e-3, 4e-3};
  return (tolerance_t){1e-4, 1e-4};
}

typedef struct compare_result {
  int64_t count, bad;
  double max_err, max_ref;
} compare_result_t;

static compare_result_t compare_f32(const float *got, const float *ref, int64_t n, tolerance_t tol) {
  compare_result_t c = {n, 0, 0.0, 0.0};
  for (int64_t i = 0; i < n; i++) c.max_ref = fmax(c.max_ref, fabs((double)ref[i]));
  double atol = tol.atol_frac * (c.max_ref > 0.0 ? c.max_ref : 1.0);
  for (int64_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - (double)ref[i]);
    if (!(err <= atol + tol.rtol * fabs((double)ref[i]))) c.bad++;
    if (!(err <= c.max_err)) c.max_err = err;
  }
  return c;
}

/* got in dtype, ref in float32. */
static compare_result_t compare_payload(epx_dtype_t dtype, const void *got, const float *ref, int64_t n,
                                        tolerance_t tol) {
  float *g = xalloc(sizeof(float) * (size_t)n);
  TRY(epx_convert(EPX_FLOAT32, g, dtype, got, n));
  compare_result_t c = compare_f32(g, ref, n, tol);
  free(g);
  return c;
}

/* Sums a comparison over ranks and prints it on rank 0; returns its verdict. */
static int report_compare(const world_t *w, const char *what, compare_result_t c, tolerance_t tol) {
  int64_t v[2] = {c.count, c.bad};
  double m[2] = {c.max_err, c.max_ref};
  world_sum_i64(w, v, 2);
  world_max_f64(w, m, 2);
  if (w->rank == 0)
    printf("check %-34s max|err| %.3g (max|ref| %.3g, tol %.0e*max|ref| + %.0e*|ref|): %lld of %lld outside: %s\n",
           what, m[0], m[1], tol.atol_frac, tol.rtol, (long long)v[1], (long long)v[0],
           v[1] ? "FAILED" : "ok");
  return v[1] == 0;
}

static int report_count(const world_t *w, const char *what, int64_t bad, int64_t count) {
  int64_t v[2] = {count, bad};
  world_sum_i64(w, v, 2);
  if (w->rank == 0)
    printf("check %-34s %lld of %lld differ: %s\n", what, (long long)v[1], (long long)v[0],
           v[1] ? "FAILED" : "ok");
  return v[1] == 0;
}

static int64_t count_diff_bytes(const void *a, const void *b, int64_t n, size_t es) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad += memcmp((const char *)a + (size_t)i * es, (const char *)b + (size_t)i * es, es) != 0;
  return bad;
}

/* ------------------------------------------------------------------------ */
/* Experts: SwiGLU FFN on OpenBLAS (or a per-expert scale with --ffn 0)      */
/* ------------------------------------------------------------------------ */

/* Weights of every expert, [E][gate [H, F], up [H, F], down [F, H]], float32,
 * the same on every rank (drawn from the seed); rank r uses its E_local. */
typedef struct experts {
  int64_t H;
  int32_t F, E;
  float *w;
} experts_t;

static int64_t expert_stride(const experts_t *x) { return 3 * x->H * x->F; }

static void experts_make(experts_t *x, const options_t *o) {
  x->H = o->hidden;
  x->F = o->ffn;
  x->E = o->experts;
  x->w = NULL;
  if (x->F == 0) return;
  x->w = xalloc(sizeof(float) * (size_t)(expert_stride(x) * x->E));
  /* gate/up ~ U(-3/sqrt(H), 3/sqrt(H)) keeps x W near unit variance for x ~ U(-1, 1). */
  float a_in = (float)(3.0 / sqrt((double)x->H)), a_out = (float)(1.0 / sqrt((double)x->F));
  for (int32_t e = 0; e < x->E; e++) {
    rng_t r = rng_make(o->seed, 1000003 + (uint64_t)e);
    float *we = x->w + (size_t)(expert_stride(x) * e);
    fill_uniform(&r, we, 2 * x->H * x->F, a_in);
    fill_uniform(&r, we + 2 * x->H * x->F, x->H * x->F, a_out);
  }
}

/* The --ffn 0 expert: y = s_e * x. */
static float expert_scale(int32_t e, int32_t E) { return 0.5f + (float)e / (float)E; }

static float silu_of(float g) { return g / (1.0f + expf(-g)); }

/* Forward of expert e on m rows: X [m, H] -> Y [m, H], keeping G, U, A
 * [m, F] for the backward. */
static void ffn_forward(const experts_t *x, int32_t e, int64_t m, const float *X, float *G, float *U,
                        float *A, float *Y) {
  const int64_t H = x->H, F = x->F;
  if (F == 0) {
    float s = expert_scale(e, x->E);
    for (int64_t i = 0; i < m * H; i++) Y[i] = s * X[i];
    return;
  }
  const float *wg = x->w + (size_t)(expert_stride(x) * e), *wu = wg + H * F, *wd = wu + H * F;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)F, (int)H, 1.0f, X, (int)H, wg,
              (int)F, 0.0f, G, (int)F);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)F, (int)H, 1.0f, X, (int)H, wu,
              (int)F, 0.0f, U, (int)F);
  for (int64_t i = 0; i < m * F; i++) A[i] = silu_of(G[i]) * U[i];
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)H, (int)F, 1.0f, A, (int)F, wd,
              (int)H, 0.0f, Y, (int)H);
}

/* Backward of expert e on m rows: dY [m, H] -> dX [m, H] (may alias X), the
 * weight gradients dW [3 * H * F] (NULL to skip), overwriting G, U, A. */
static void ffn_backward(const experts_t *x, int32_t e, int64_t m, float *X, float *G, float *U,
                         float *A, const float *dY, float *dX, float *dW) {
  const int64_t H = x->H, F = x->F;
  if (F == 0) {
    float s = expert_scale(e, x->E);
    for (int64_t i = 0; i < m * H; i++) dX[i] = s * dY[i];
    return;
  }
  const float *wg = x->w + (size_t)(expert_stride(x) * e), *wu = wg + H * F, *wd = wu + H * F;
  if (dW)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)F, (int)H, (int)m, 1.0f, A, (int)F, dY,
                (int)H, 0.0f, dW + 2 * H * F, (int)H);
  float *dA = A; /* A is not needed once dWd is formed */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)F, (int)H, 1.0f, dY, (int)H, wd,
              (int)H, 0.0f, dA, (int)F);
  for (int64_t i = 0; i < m * F; i++) {
    float g = G[i], sig = 1.0f / (1.0f + expf(-g));
    float da = dA[i];
    G[i] = da * U[i] * sig * (1.0f + g * (1.0f - sig)); /* dG */
    U[i] = da * g * sig;                                /* dU */
  }
  if (dW) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)H, (int)F, (int)m, 1.0f, X, (int)H, G,
                (int)F, 0.0f, dW, (int)F);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)H, (int)F, (int)m, 1.0f, X, (int)H, U,
                (int)F, 0.0f, dW + H * F, (int)F);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)H, (int)F, 1.0f, G, (int)F, wg,
              (int)F, 0.0f, dX, (int)H);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)H, (int)F, 1.0f, U, (int)F, wu,
              (int)F, 1.0f, dX, (int)H);
}

/* ------------------------------------------------------------------------ */
/* One rank's expert work on its received rows                               */
/* ------------------------------------------------------------------------ */

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

/* The handle's queries into host arrays (on CUDA they write device memory:
 * through a mirror). */
static void query_layout(rank_experts_t *re, epx_handle_t h, int64_t per_row) {
  const size_t El = (size_t)re->E_local, n = (size_t)(re->N * per_row + 1);
  int64_t *counts = mirror_of(re->counts, 8 * El), *offsets = mirror_of(re->offsets, 8 * (El + 1));
  int32_t *expert = mirror_of(re->recv_expert, 4 * n);
  float *w = mirror_of(re->recv_w, 4 * n);
  TRY(epx_handle_expert_counts(h, counts, offsets));
  TRY(epx_handle_recv_routing(h, expert, w));
  download(re->counts, counts, 8 * El);
  download(re->offsets, offsets, 8 * (El + 1));
  download(re->recv_expert, expert, 4 * n);
  download(re->recv_w, w, 4 * n);
  mirror_free(re->counts, counts), mirror_free(re->offsets, offsets);
  mirror_free(re->recv_expert, expert), mirror_free(re->recv_w, w);
}

static void rank_experts_plan(rank_experts_t *re, epx_handle_t h) {
  const int32_t El = re->E_local, K = re->K;
  TRY(epx_handle_recv_rows(h, &re->N));
  int64_t per_row = re->layout == EPX_LAYOUT_RANK_MAJOR ? K : 1;
  re->recv_expert = grow(re->recv_expert, &re->recv_expert_cap, sizeof(int32_t) * (size_t)(re->N * per_row + 1));
  re->recv_w = grow(re->recv_w, &re->recv_w_cap, sizeof(float) * (size_t)(re->N * per_row + 1));
  query_layout(re, h, per_row);
  int64_t first_expert = (int64_t)re->rank * El;
  for (int32_t e = 0; e <= El; e++) re->first[e] = 0;
  if (re->layout == EPX_LAYOUT_RANK_MAJOR) {
    for (int64_t i = 0; i < re->N * K; i++)
      if (re->recv_expert[i] >= 0) re->first[re->recv_expert[i] - first_expert + 1]++;
  } else {
    for (int32_t e = 0; e < El; e++)
      re->first[e + 1] = re->layout == EPX_LAYOUT_CAPACITY ? re->offsets[e + 1] - re->offsets[e] : re->counts[e];
  }
  for (int32_t e = 0; e < El; e++) re->first[e + 1] += re->first[e];
  re->n_items = re->first[El];
  size_t n = (size_t)re->n_items + 1;
  re->item_row = grow(re->item_row, &re->item_row_cap, sizeof(int64_t) * n);
  re->item_slot = grow(re->item_slot, &re->item_slot_cap, sizeof(int32_t) * n);
  re->item_w = grow(re->item_w, &re->item_w_cap, sizeof(float) * n);
  if (re->layout == EPX_LAYOUT_RANK_MAJOR) {
    int64_t *fill = xalloc(sizeof(int64_t) * (size_t)El);
    memcpy(fill, re->first, sizeof(int64_t) * (size_t)El);
    for (int64_t r = 0; r < re->N; r++)
      for (int32_t k = 0; k < K; k++) {
        int32_t ge = re->recv_expert[r * K + k];
        if (ge < 0) continue;
        int64_t it = fill[ge - first_expert]++;
        re->item_row[it] = r;
        re->item_slot[it] = k;
        re->item_w[it] = re->recv_w[r * K + k];
      }
    free(fill);
  } else {
    for (int32_t e = 0; e < El; e++)
      for (int64_t j = 0; j < re->first[e + 1] - re->first[e]; j++) {
        re->item_row[re->first[e] + j] = re->offsets[e] + j;
        re->item_slot[re->first[e] + j] = -1;
        re->item_w[re->first[e] + j] = 1.0f;
      }
  }
  size_t H = (size_t)re->H, F = (size_t)re->ex->F;
  if (F > 0) {
    re->X = grow(re->X, &re->X_cap, sizeof(float) * n * H);
    re->Y = grow(re->Y, &re->Y_cap, sizeof(float) * n * H);
    re->G = grow(re->G, &re->G_cap, sizeof(float) * n * F);
    re->U = grow(re->U, &re->U_cap, sizeof(float) * n * F);
    re->A = grow(re->A, &re->A_cap, sizeof(float) * n * F);
  } else {
    re->X = grow(re->X, &re->X_cap, sizeof(float) * H);
    re->Y = grow(re->Y, &re->Y_cap, sizeof(float) * H);
  }
  if (re->layout == EPX_LAYOUT_RANK_MAJOR) {
    re->acc = grow(re->acc, &re->acc_cap, sizeof(float) * ((size_t)re->N + 1) * H);
    re->slot_grad_w = grow(re->slot_grad_w, &re->slot_grad_w_cap, sizeof(float) * ((size_t)re->N * K + 1));
  }
}

/* Rows of a payload tensor [rows, H] not covered by items (expert-major
 * alignment padding) are written with zeros. */
static void zero_padding(const rank_experts_t *re, void *t) {
  if (re->layout != EPX_LAYOUT_EXPERT_MAJOR) return;
  size_t row_bytes = (size_t)re->H * epx_dtype_size(re->dtype);
  for (int32_t e = 0; e < re->E_local; e++) {
    int64_t a = re->offsets[e] + re->counts[e], b = re->offsets[e + 1];
    if (b > a) memset((char *)t + (size_t)a * row_bytes, 0, (size_t)(b - a) * row_bytes);
  }
}

/* The --ffn 0 expert (y = s_e * x) row by row, so exchange-bound runs at
 * large shapes need no float copy of the received rows. Forward: in =
 * recv_x, out = expert_out. Backward: in = grad_expert_out, out =
 * grad_recv_x, and rank-major rows also get slot_grad_w = s_e * <g, x> with x
 * from recv_x (still intact: rank-major writes grad_recv_x at the end). */
static void rank_experts_scale(rank_experts_t *re, const void *in, void *out, const void *recv_x, int backward) {
  const int64_t H = re->H, K = re->K;
  const size_t row_bytes = (size_t)H * epx_dtype_size(re->dtype);
  const int rank_major = re->layout == EPX_LAYOUT_RANK_MAJOR;
  float *v = re->X, *xr = re->Y;
  for (int32_t e = 0; e < re->E_local; e++) {
    float s = expert_scale(re->rank * re->E_local + e, re->ex->E);
    for (int64_t i = re->first[e]; i < re->first[e + 1]; i++) {
      int64_t r = re->item_row[i];
      TRY(epx_convert(EPX_FLOAT32, v, re->dtype, (const char *)in + (size_t)r * row_bytes, H));
      if (!rank_major) {
        for (int64_t j = 0; j < H; j++) v[j] *= s;
        TRY(epx_convert(re->dtype, (char *)out + (size_t)r * row_bytes, EPX_FLOAT32, v, H));
        continue;
      }
      float *acc = re->acc + r * H, ws = re->item_w[i] * s;
      if (backward) {
        TRY(epx_convert(EPX_FLOAT32, xr, re->dtype, (const char *)recv_x + (size_t)r * row_bytes, H));
        double dot = 0.0;
        for (int64_t j = 0; j < H; j++) dot += (double)v[j] * xr[j];
        re->slot_grad_w[r * K + re->item_slot[i]] = (float)(s * dot);
      }
      for (int64_t j = 0; j < H; j++) acc[j] += ws * v[j];
    }
  }
}

/* recv_x [N, H] -> expert_out [N, H] in the handle's layout. */
static void rank_experts_forward(rank_experts_t *re, const void *recv_x, void *expert_out) {
  const int64_t H = re->H, F = re->ex->F;
  const size_t row_bytes = (size_t)H * epx_dtype_size(re->dtype);
  const int rank_major = re->layout == EPX_LAYOUT_RANK_MAJOR;
  if (rank_major) memset(re->acc, 0, sizeof(float) * (size_t)(re->N * H));
  if (F == 0) rank_experts_scale(re, recv_x, expert_out, NULL, 0);
  for (int32_t e = 0; F > 0 && e < re->E_local; e++) {
    int64_t i0 = re->first[e], m = re->first[e + 1] - i0;
    if (m == 0) continue;
    float *X = re->X + i0 * H, *Y = re->Y + i0 * H;
    if (!rank_major) {
      TRY(epx_convert(EPX_FLOAT32, X, re->dtype, (const char *)recv_x + (size_t)re->item_row[i0] * row_bytes, m * H));
    } else {
      for (int64_t j = 0; j < m; j++)
        TRY(epx_convert(EPX_FLOAT32, X + j * H, re->dtype,
                        (const char *)recv_x + (size_t)re->item_row[i0 + j] * row_bytes, H));
    }
    ffn_forward(re->ex, re->rank * re->E_local + e, m, X, re->G + i0 * F, re->U + i0 * F, re->A + i0 * F, Y);
    re->flops_fwd += 6.0 * (double)m * (double)H * (double)F;
    if (!rank_major) {
      TRY(epx_convert(re->dtype, (char *)expert_out + (size_t)re->item_row[i0] * row_bytes, EPX_FLOAT32, Y, m * H));
    } else {
      for (int64_t j = 0; j < m; j++) {
        float *acc = re->acc + re->item_row[i0 + j] * H, w = re->item_w[i0 + j];
        const float *y = Y + j * H;
        for (int64_t i = 0; i < H; i++) acc[i] += w * y[i];
      }
    }
  }
  if (rank_major) TRY(epx_convert(re->dtype, expert_out, EPX_FLOAT32, re->acc, re->N * H));
  zero_padding(re, expert_out);
}

/* grad_expert_out [N, H] -> grad_recv_x [N, H] (may alias recv_x: the
 * forward kept what it needs), dW [E_local, 3*H*F]; rank-major also fills
 * slot_grad_w [N, K] with <grad_expert_out row, y_e(row)>. */
static void rank_experts_backward(rank_experts_t *re, const void *grad_expert_out, const void *recv_x,
                                  void *grad_recv_x, float *dW) {
  const int64_t H = re->H, F = re->ex->F, K = re->K;
  const size_t row_bytes = (size_t)H * epx_dtype_size(re->dtype);
  const int rank_major = re->layout == EPX_LAYOUT_RANK_MAJOR;
  if (rank_major) {
    memset(re->acc, 0, sizeof(float) * (size_t)(re->N * H));
    for (int64_t i = 0; i < re->N * K; i++) re->slot_grad_w[i] = 0.0f;
  }
  if (F == 0) rank_experts_scale(re, grad_expert_out, grad_recv_x, recv_x, 1);
  for (int32_t e = 0; F > 0 && e < re->E_local; e++) {
    int64_t i0 = re->first[e], m = re->first[e + 1] - i0;
    float *dWe = dW ? dW + (size_t)(expert_stride(re->ex) * e) : NULL;
    if (m == 0) {
      if (dWe) memset(dWe, 0, sizeof(float) * (size_t)expert_stride(re->ex));
      continue;
    }
    float *X = re->X + i0 * H, *dY = re->Y + i0 * H;
    if (!rank_major) {
      TRY(epx_convert(EPX_FLOAT32, dY, re->dtype,
                      (const char *)grad_expert_out + (size_t)re->item_row[i0] * row_bytes, m * H));
    } else {
      float *g = xalloc(sizeof(float) * (size_t)H);
      for (int64_t j = 0; j < m; j++) {
        int64_t r = re->item_row[i0 + j];
        TRY(epx_convert(EPX_FLOAT32, g, re->dtype, (const char *)grad_expert_out + (size_t)r * row_bytes, H));
        float *y = dY + j * H, w = re->item_w[i0 + j];
        double dot = 0.0;
        for (int64_t i = 0; i < H; i++) {
          dot += (double)g[i] * y[i];
          y[i] = w * g[i];
        }
        re->slot_grad_w[r * K + re->item_slot[i0 + j]] = (float)dot;
      }
      free(g);
    }
    ffn_backward(re->ex, re->rank * re->E_local + e, m, X, re->G + i0 * F, re->U + i0 * F, re->A + i0 * F,
                 dY, X, dWe);
    re->flops_bwd += 12.0 * (double)m * (double)H * (double)F;
    if (!rank_major) {
      TRY(epx_convert(re->dtype, (char *)grad_recv_x + (size_t)re->item_row[i0] * row_bytes, EPX_FLOAT32, X, m * H));
    } else {
      for (int64_t j = 0; j < m; j++) {
        float *acc = re->acc + re->item_row[i0 + j] * H;
        const float *dx = X + j * H;
        for (int64_t i = 0; i < H; i++) acc[i] += dx[i];
      }
    }
  }
  if (rank_major) TRY(epx_convert(re->dtype, grad_recv_x, EPX_FLOAT32, re->acc, re->N * H));
  zero_padding(re, grad_recv_x);
}

static void rank_experts_free(rank_experts_t *re) {
  free(re->counts);
  free(re->offsets);
  free(re->recv_expert);
  free(re->recv_w);
  free(re->first);
  free(re->item_row);
  free(re->item_slot);
  free(re->item_w);
  free(re->X);
  free(re->Y);
  free(re->G);
  free(re->U);
  free(re->A);
  free(re->acc);
  free(re->slot_grad_w);
}

/* ------------------------------------------------------------------------ */
/* The dense reference of a whole layer for one rank's tokens                */
/* ------------------------------------------------------------------------ */

typedef struct layer_ref {
  float *out;         /* [T, H] */
  float *grad_x;      /* [T, H] */
  float *grad_w;      /* [T, K] */
  float *grad_logits; /* [T, E] */
} layer_ref_t;

/* out[t] = sum_k w_k * FFN_{idx_k}(x[t]) and the gradients of a loss whose
 * gradient with respect to out is grad_out: grad_x, grad_w (the router's
 * signal), grad_logits. Straight from the definition, expert by expert over
 * this rank's own tokens; no exchange involved. */
static void layer_reference(const experts_t *ex, epx_dtype_t dtype, int64_t T, int32_t K, const int32_t *idx,
                            const float *w, const options_t *o, const float *logits, const void *x,
                            const void *grad_out,
                            layer_ref_t *ref) {
  const int64_t H = ex->H, F = ex->F;
  const int32_t E = ex->E;
  float *xf = xalloc(sizeof(float) * (size_t)(T * H)), *gf = xalloc(sizeof(float) * (size_t)(T * H));
  TRY(epx_convert(EPX_FLOAT32, xf, dtype, x, T * H));
  TRY(epx_convert(EPX_FLOAT32, gf, dtype, grad_out, T * H));
  memset(ref->out, 0, sizeof(float) * (size_t)(T * H));
  memset(ref->grad_x, 0, sizeof(float) * (size_t)(T * H));
  for (int64_t i = 0; i < T * K; i++) ref->grad_w[i] = 0.0f;
  int64_t *count = calloc((size_t)E, sizeof(int64_t)), max_m = 0;
  if (!count) fatal("out of memory");
  for (int64_t i = 0; i < T * K; i++)
    if (idx[i] >= 0) count[idx[i]]++;
  for (int32_t e = 0; e < E; e++) max_m = count[e] > max_m ? count[e] : max_m;
  size_t m1 = (size_t)max_m + 1;
  int64_t *slot = xalloc(sizeof(int64_t) * m1);
  float *X = xalloc(sizeof(float) * m1 * (size_t)H), *Y = xalloc(sizeof(float) * m1 * (size_t)H);
  float *G = xalloc(sizeof(float) * (m1 * (size_t)F + 1)), *U = xalloc(sizeof(float) * (m1 * (size_t)F + 1));
  float *A = xalloc(sizeof(float) * (m1 * (size_t)F + 1));
  for (int32_t e = 0; e < E; e++) {
    int64_t m = 0;
    for (int64_t i = 0; i < T * K; i++)
      if (idx[i] == e) slot[m++] = i;
    if (m == 0) continue;
    for (int64_t j = 0; j < m; j++) memcpy(X + j * H, xf + slot[j] / K * H, sizeof(float) * (size_t)H);
    ffn_forward(ex, e, m, X, G, U, A, Y);
    for (int64_t j = 0; j < m; j++) {
      int64_t t = slot[j] / K;
      float wk = w[slot[j]], *o = ref->out + t * H, *dy = Y + j * H;
      const float *g = gf + t * H;
      double dot = 0.0;
      for (int64_t i = 0; i < H; i++) {
        o[i] += wk * dy[i];
        dot += (double)g[i] * dy[i];
        dy[i] = wk * g[i];
      }
      ref->grad_w[slot[j]] = (float)dot;
    }
    ffn_backward(ex, e, m, X, G, U, A, Y, X, NULL);
    for (int64_t j = 0; j < m; j++) {
      float *gx = ref->grad_x + slot[j] / K * H;
      const float *dx = X + j * H;
      for (int64_t i = 0; i < H; i++) gx[i] += dx[i];
    }
  }
  ref_route_backward(o, o->capacity_factor > 0.0, T, logits, idx, ref->grad_w, ref->grad_logits);
  free(count);
  free(slot);
  free(X);
  free(Y);
  free(G);
  free(U);
  free(A);
  free(xf);
  free(gf);
}

/* ------------------------------------------------------------------------ */
/* The main job: a whole layer step on W ranks                               */
/* ------------------------------------------------------------------------ */

enum phase {
  PH_ROUTE,
  PH_LAYOUT,
  PH_DISPATCH,
  PH_EXPERT_FWD,
  PH_COMBINE,
  PH_COMBINE_BWD,
  PH_EXPERT_BWD,
  PH_GRAD_W_RETURN,
  PH_DISPATCH_BWD,
  PH_ROUTE_BWD,
  NUM_PHASES
};

static const char *const phase_names[NUM_PHASES] = {
    "route", "dispatch_layout", "dispatch", "expert_forward", "combine", "combine_backward",
    "expert_backward", "grad_w_return", "dispatch_backward", "route_backward"};

/* What one exchange of one rank produced and measured. */
typedef struct exchange_run {
  epx_exchange_t exchange;
  epx_buffer_t buffer;
  void *out, *grad_x;        /* [T, H] dtype */
  float *grad_w;             /* [T, K] */
  float *grad_logits;        /* [T, E] */
  float *dW;                 /* [E_local, 3*H*F] */
  void *d_out, *d_grad_x;    /* their mirrors (--device cuda) */
  float *d_grad_w, *d_grad_logits;
  epx_handle_stats_t stats;  /* of the last step */
  int64_t recv_rows, items;
  double flops_fwd, flops_bwd; /* of the last step */
} exchange_run_t;

/* Shared by every rank of the process. */
typedef struct job {
  const options_t *o;
  experts_t ex;
  int32_t world_size;
  double memcpy_gbps;
  int ok;
} job_t;

static void timed_begin(const world_t *w, double *t0) {
  world_barrier(w);
  *t0 = now_s();
}

/* Seconds since t0, once the GPU's work (if any) is done. */
static double timed_end(double t0) {
  dev_sync();
  return now_s() - t0;
}

/* Activation-checkpoint recompute, as a checkpointed block does it: the
 * forward's dispatch is recorded, the recompute replays it (no layout, no
 * count exchange: a cached dispatch), and the rows must equal the forward's
 * bit for bit. Prints the best of five of a full layout + dispatch and of a
 * replayed one, and what the recorder keeps against the received rows it
 * lets the block drop. */
static int recompute_check(const world_t *w, epx_buffer_t buf, const epx_routing_t *routing, const void *x,
                           const void *recv_x, int64_t N, size_t row_bytes, const char *exchange) {
  enum { REPEATS = 5 };
  epx_recorder_t rec = NULL;
  epx_handle_t h = NULL;
  void *host_rows = xalloc(row_bytes * (size_t)(N + 1));
  memset(host_rows, 0, row_bytes * (size_t)(N + 1)); /* first-touch page faults out of the timing */
  void *rows = mirror_of(host_rows, row_bytes * (size_t)(N + 1));
  upload(rows, host_rows, row_bytes * (size_t)(N + 1));
  double best[2] = {1e30, 1e30}, t0;
  TRY(epx_recorder_create(1, &rec));
  TRY(epx_dispatch_layout(buf, routing, rec, &h)); /* the forward's record */
  TRY(epx_handle_release(h));
  for (int r = 0; r < REPEATS; r++) {
    timed_begin(w, &t0);
    TRY(epx_dispatch_layout(buf, routing, NULL, &h));
    TRY(epx_dispatch(buf, h, x, rows, N + 1));
    best[0] = fmin(best[0], timed_end(t0));
    TRY(epx_handle_release(h));
    TRY(epx_recorder_set_mode(rec, EPX_RECORDER_REPLAY)); /* rewinds to the first record */
    timed_begin(w, &t0);
    TRY(epx_dispatch_layout(buf, routing, rec, &h));
    TRY(epx_dispatch(buf, h, x, rows, N + 1));
    best[1] = fmin(best[1], timed_end(t0));
    TRY(epx_handle_release(h));
  }
  download(host_rows, rows, row_bytes * (size_t)N);
  int64_t bad[1] = {memcmp(host_rows, recv_x, row_bytes * (size_t)N) != 0};
  epx_recorder_stats_t st;
  TRY(epx_recorder_stats(rec, &st));
  int64_t bytes[2] = {st.bytes_held, st.bytes_avoided};
  world_max_f64(w, best, 2);
  world_sum_i64(w, bad, 1);
  world_sum_i64(w, bytes, 2);
  if (w->rank == 0)
    printf("recompute %-10s layout+dispatch %.3f ms, replayed from the recorder %.3f ms (%.2fx); recorder "
           "holds %.2f MB, avoids keeping %.1f MB of received rows; rows %s\n",
           exchange, best[0] * 1e3, best[1] * 1e3, best[0] / best[1], bytes[0] / 1e6, bytes[1] / 1e6,
           bad[0] ? "DIFFER" : "bit-identical");
  TRY(epx_recorder_destroy(rec));
  mirror_free(host_rows, rows);
  free(host_rows);
  return bad[0] == 0;
}

static void main_job_rank(job_t *job, const world_t *w, epx_comm_t comm) {
  const options_t *o = job->o;
  const int64_t T = o->tokens, H = o->hidden;
  const int32_t E = o->experts, K = o->topk, W = w->size, El = E / W;
  const epx_dtype_t dtype = (epx_dtype_t)o->dtype;
  const size_t es = epx_dtype_size(dtype);
  const epx_layout_t layout = o->layout;
  const int rank_major = layout == EPX_LAYOUT_RANK_MAJOR;
  const int n_exch = o->exchange == CHOOSE_BOTH ? 2 : 1;
  const int steps = o->warmup + o->iters;
  int recompute_failed = 0; /* the recorder's replayed rows differed on this rank */
  progress_t prog = {now_s(), 0.0};

  double memcpy_gbps = g_cuda ? measure_device_copy(w, (size_t)256 << 20, 5) : measure_memcpy(w, (size_t)64 << 20, 5);
  if (w->rank == 0) job->memcpy_gbps = memcpy_gbps;

  /* This rank's inputs. */
  rng_t rx = rng_make(o->seed, 16 * (uint64_t)w->rank + 1), rg = rng_make(o->seed, 16 * (uint64_t)w->rank + 2);
  void *x = xalloc(es * (size_t)(T * H)), *grad_out = xalloc(es * (size_t)(T * H));
  fill_payload(dtype, x, T * H, &rx);
  fill_payload(dtype, grad_out, T * H, &rg);
  float *logits = xalloc(sizeof(float) * (size_t)(T * E));
  make_logits(o, w->rank, T, logits);
  /* The mirrors epx reads (the host arrays themselves on the CPU). */
  void *d_x = mirror_of(x, es * (size_t)(T * H)), *d_grad_out = mirror_of(grad_out, es * (size_t)(T * H));
  float *d_logits = mirror_of(logits, sizeof(float) * (size_t)(T * E));
  upload(d_x, x, es * (size_t)(T * H));
  upload(d_grad_out, grad_out, es * (size_t)(T * H));
  upload(d_logits, logits, sizeof(float) * (size_t)(T * E));

  epx_route_config_t rc = route_config(o, o->capacity_factor > 0.0);
  if (g_cuda) rc.device = EPX_DEVICE_CUDA, rc.stream = g_stream;
  const size_t tk4 = 4 * (size_t)(T * K);
  int32_t *topk_idx = xalloc(tk4), *locations = xalloc(tk4);
  float *topk_w = xalloc(tk4);
  int32_t *d_idx = mirror_of(topk_idx, tk4), *d_loc = mirror_of(locations, tk4);
  float *d_w = mirror_of(topk_w, tk4);
  epx_route_output_t ro = {d_idx, d_w, d_loc, NULL, NULL, NULL, 0, 0};
  TRY(epx_route(&rc, T, d_logits, NULL, &ro));
  download(topk_idx, d_idx, tk4), download(topk_w, d_w, tk4), download(locations, d_loc, tk4);
  const int32_t capacity = ro.capacity;

  exchange_run_t runs[2];
  memset(runs, 0, sizeof runs);
  for (int xi = 0; xi < n_exch; xi++) {
    exchange_run_t *run = &runs[xi];
    run->exchange = o->exchange == CHOOSE_BOTH ? (epx_exchange_t)xi : (epx_exchange_t)o->exchange;
    epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
    bc.dtype = dtype;
    bc.hidden = H;
    bc.num_experts = E;
    bc.max_top_k = K;
    bc.max_tokens_per_rank = T;
    bc.exchange = run->exchange;
    bc.layout = layout;
    bc.capacity = layout == EPX_LAYOUT_CAPACITY ? capacity : 0;
    if (g_cuda) bc.device = EPX_DEVICE_CUDA, bc.stream = g_stream;
    TRY(epx_buffer_create(comm, &bc, &run->buffer));
    run->out = xalloc(es * (size_t)(T * H));
    run->grad_x = xalloc(es * (size_t)(T * H));
    run->grad_w = xalloc(sizeof(float) * (size_t)(T * K));
    run->grad_logits = xalloc(sizeof(float) * (size_t)(T * E));
    run->d_out = mirror_of(run->out, es * (size_t)(T * H));
    run->d_grad_x = mirror_of(run->grad_x, es * (size_t)(T * H));
    run->d_grad_w = mirror_of(run->grad_w, sizeof(float) * (size_t)(T * K));
    run->d_grad_logits = mirror_of(run->grad_logits, sizeof(float) * (size_t)(T * E));
    run->dW = o->ffn ? xalloc(sizeof(float) * (size_t)(expert_stride(&job->ex) * El)) : NULL;
  }

  rank_experts_t re;
  memset(&re, 0, sizeof re);
  re.ex = &job->ex;
  re.layout = layout;
  re.dtype = dtype;
  re.rank = w->rank;
  re.E_local = El;
  re.K = K;
  re.H = H;
  re.counts = xalloc(sizeof(int64_t) * (size_t)El);
  re.offsets = xalloc(sizeof(int64_t) * (size_t)(El + 1));
  re.first = xalloc(sizeof(int64_t) * (size_t)(El + 1));

  /* Payload scratch shared by the exchanges (they run one after the other);
   * grad_recv_x reuses recv_x: the forward kept what the backward needs. */
  void *recv_x = NULL, *expert_out = NULL, *grad_expert_out = NULL, *gw_rows = NULL, *gw_out = NULL;
  size_t recv_cap = 0, eo_cap = 0, geo_cap = 0, gw_rows_cap = 0;
  if (rank_major) gw_out = xalloc(es * (size_t)(T * H));
  /* and their mirrors */
  void *d_recv_x = NULL, *d_expert_out = NULL, *d_grad_expert_out = NULL, *d_gw_rows = NULL;
  void *d_gw_out = rank_major ? mirror_of(gw_out, es * (size_t)(T * H)) : NULL;
  size_t d_recv_cap = 0, d_eo_cap = 0, d_geo_cap = 0, d_gw_rows_cap = 0;

  /* times[xi][phase][iteration] of this rank, seconds */
  double *times = calloc((size_t)(2 * NUM_PHASES * o->iters), sizeof(double));
  if (!times) fatal("out of memory");
#define TIME_AT(xi, ph, it) times[((size_t)(xi) * NUM_PHASES + (ph)) * (size_t)o->iters + (size_t)(it)]

  for (int step = 0; step < steps; step++) {
    const int it = step - o->warmup, last = step == steps - 1;
    double t0;
    progress_note(w, &prog, "step %d of %d%s", step + 1, steps, step < o->warmup ? " (warm-up)" : "");
    timed_begin(w, &t0);
    TRY(epx_route(&rc, T, d_logits, NULL, &ro));
    if (it >= 0) TIME_AT(0, PH_ROUTE, it) = timed_end(t0);

    /* With both exchanges, alternate which goes first, so neither always
     * runs right after the route or on the other's warm caches. */
    for (int j = 0; j < n_exch; j++) {
      const int xi = n_exch == 2 && step % 2 ? 1 - j : j;
      exchange_run_t *run = &runs[xi];
      epx_buffer_t buf = run->buffer;
      epx_routing_t routing = {T, K, d_idx, d_w, layout == EPX_LAYOUT_CAPACITY ? d_loc : NULL,
                               rank_major ? EPX_WEIGHTS_NONE : EPX_WEIGHTS_IN_COMBINE};
      epx_handle_t h = NULL;
      double ph[NUM_PHASES] = {0};

      timed_begin(w, &t0);
      TRY(epx_dispatch_layout(buf, &routing, NULL, &h));
      ph[PH_LAYOUT] = timed_end(t0);

      int64_t N;
      TRY(epx_handle_recv_rows(h, &N));
      size_t rows_bytes = es * (size_t)(N + 1) * (size_t)H;
      recv_x = grow(recv_x, &recv_cap, rows_bytes);
      expert_out = grow(expert_out, &eo_cap, rows_bytes);
      grad_expert_out = grow(grad_expert_out, &geo_cap, rows_bytes);
      if (rank_major) gw_rows = grow(gw_rows, &gw_rows_cap, rows_bytes);
      d_recv_x = mirror_grow(recv_x, d_recv_x, &d_recv_cap, rows_bytes);
      d_expert_out = mirror_grow(expert_out, d_expert_out, &d_eo_cap, rows_bytes);
      d_grad_expert_out = mirror_grow(grad_expert_out, d_grad_expert_out, &d_geo_cap, rows_bytes);
      if (rank_major) d_gw_rows = mirror_grow(gw_rows, d_gw_rows, &d_gw_rows_cap, rows_bytes);
      const size_t n_bytes = es * (size_t)(N * H), th = es * (size_t)(T * H), tk = 4 * (size_t)(T * K);
      if (last && o->check) {
        /* NaN everywhere, so a row the library forgot to write cannot pass
         * for one the previous exchange wrote. */
        poison(recv_x, d_recv_x, rows_bytes);
        poison(expert_out, d_expert_out, rows_bytes);
        poison(grad_expert_out, d_grad_expert_out, rows_bytes);
        poison(run->out, run->d_out, th);
        poison(run->grad_x, run->d_grad_x, th);
        poison(run->grad_w, run->d_grad_w, tk);
        poison(run->grad_logits, run->d_grad_logits, sizeof(float) * (size_t)(T * E));
      }

      timed_begin(w, &t0);
      TRY(epx_dispatch(buf, h, d_x, d_recv_x, N + 1));
      ph[PH_DISPATCH] = timed_end(t0);
      download(recv_x, d_recv_x, n_bytes);

      if (last && !recompute_check(w, buf, &routing, d_x, recv_x, N, es * (size_t)H, exchange_name(run->exchange)))
        recompute_failed = 1;

      re.flops_fwd = re.flops_bwd = 0.0;
      timed_begin(w, &t0);
      rank_experts_plan(&re, h);
      rank_experts_forward(&re, recv_x, expert_out);
      ph[PH_EXPERT_FWD] = now_s() - t0;
      upload(d_expert_out, expert_out, n_bytes);

      timed_begin(w, &t0);
      TRY(epx_combine(buf, h, d_expert_out, run->d_out));
      ph[PH_COMBINE] = timed_end(t0);
      download(run->out, run->d_out, th);

      timed_begin(w, &t0);
      if (rank_major) TRY(epx_combine_backward(buf, h, d_grad_out, NULL, d_grad_expert_out, NULL));
      else TRY(epx_combine_backward(buf, h, d_grad_out, d_expert_out, d_grad_expert_out, run->d_grad_w));
      ph[PH_COMBINE_BWD] = timed_end(t0);
      download(grad_expert_out, d_grad_expert_out, n_bytes);
      if (!rank_major) download(run->grad_w, run->d_grad_w, tk);

      timed_begin(w, &t0);
      rank_experts_backward(&re, grad_expert_out, recv_x, recv_x, run->dW);
      ph[PH_EXPERT_BWD] = now_s() - t0;
      upload(d_recv_x, recv_x, n_bytes);

      if (rank_major) {
        /* Rank-major rows carry no weights through the exchange, so grad_w
         * comes home in a combine: row r's column k holds the gradient of its
         * slot k; each slot lives on one rank, so the sum over ranks is it. */
        timed_begin(w, &t0);
        memset(gw_rows, 0, es * (size_t)(N * H));
        for (int64_t r = 0; r < N; r++)
          TRY(epx_convert(dtype, (char *)gw_rows + (size_t)(r * H) * es, EPX_FLOAT32, re.slot_grad_w + r * K, K));
        upload(d_gw_rows, gw_rows, n_bytes);
        TRY(epx_combine(buf, h, d_gw_rows, d_gw_out));
        download(gw_out, d_gw_out, th);
        for (int64_t t = 0; t < T; t++)
          TRY(epx_convert(EPX_FLOAT32, run->grad_w + t * K, dtype, (char *)gw_out + (size_t)(t * H) * es, K));
        ph[PH_GRAD_W_RETURN] = now_s() - t0;
      }

      timed_begin(w, &t0);
      TRY(epx_dispatch_backward(buf, h, d_recv_x, run->d_grad_x, NULL, NULL));
      ph[PH_DISPATCH_BWD] = timed_end(t0);
      download(run->grad_x, run->d_grad_x, th);

      if (rank_major) upload(run->d_grad_w, run->grad_w, tk); /* computed here, on the host */
      timed_begin(w, &t0);
      TRY(epx_route_backward(&rc, T, d_logits, NULL, d_idx, run->d_grad_w, 0.0f, 0.0f, run->d_grad_logits));
      ph[PH_ROUTE_BWD] = timed_end(t0);
      download(run->grad_logits, run->d_grad_logits, sizeof(float) * (size_t)(T * E));

      TRY(epx_handle_stats(h, &run->stats));
      run->recv_rows = N;
      run->items = re.n_items;
      run->flops_fwd = re.flops_fwd;
      run->flops_bwd = re.flops_bwd;
      TRY(epx_handle_release(h));
      if (it >= 0)
        for (int p = PH_LAYOUT; p < NUM_PHASES; p++) TIME_AT(xi, p, it) = ph[p];
    }
  }

  /* Slowest rank per phase and iteration, then the median over iterations. */
  world_max_f64(w, times, 2 * NUM_PHASES * o->iters);
  double med[2][NUM_PHASES], step_ms[2];
  for (int xi = 0; xi < n_exch; xi++) {
    double *st = xalloc(sizeof(double) * (size_t)o->iters);
    for (int it = 0; it < o->iters; it++) {
      st[it] = TIME_AT(0, PH_ROUTE, it);
      for (int p = PH_LAYOUT; p < NUM_PHASES; p++) st[it] += TIME_AT(xi, p, it);
    }
    step_ms[xi] = 1e3 * median(st, o->iters);
    free(st);
    for (int p = 0; p < NUM_PHASES; p++) med[xi][p] = 1e3 * median(&TIME_AT(p == PH_ROUTE ? 0 : xi, p, 0), o->iters);
  }
  /* dedup/collective time ratios, paired within an iteration (both ran
   * back to back on the same routing) and then the median: steadier than a
   * ratio of medians on a machine whose load changes from second to second. */
  enum { RATIO_FOUR = NUM_PHASES, RATIO_STEP, NUM_RATIOS };
  double ratio[NUM_RATIOS] = {0};
  if (n_exch == 2) {
    double *r = xalloc(sizeof(double) * (size_t)o->iters);
    for (int q = PH_LAYOUT; q < NUM_RATIOS; q++) {
      for (int it = 0; it < o->iters; it++) {
        double a = 0.0, b = 0.0;
        for (int p = PH_LAYOUT; p < NUM_PHASES; p++) {
          int in = q == p || q == RATIO_STEP ||
                   (q == RATIO_FOUR && (p == PH_DISPATCH || p == PH_COMBINE || p == PH_COMBINE_BWD || p == PH_DISPATCH_BWD));
          if (!in) continue;
          a += TIME_AT(0, p, it);
          b += TIME_AT(1, p, it);
        }
        r[it] = b > 0.0 ? a / b : 0.0;
      }
      ratio[q] = median(r, o->iters);
    }
    free(r);
  }
#undef TIME_AT

  /* Totals over ranks: cross-rank rows/bytes, local rows, recv rows, items. */
  int64_t tot[2][6];
  double flops[2][2];
  for (int xi = 0; xi < n_exch; xi++) {
    exchange_run_t *run = &runs[xi];
    int64_t v[6] = {run->stats.send_rows, run->stats.send_bytes, run->stats.local_rows, run->recv_rows,
                    run->items, run->stats.recv_bytes};
    world_sum_i64(w, v, 6);
    memcpy(tot[xi], v, sizeof v);
    /* flops as integers (exact for any realistic size) to reuse the sum */
    int64_t f[2] = {(int64_t)run->flops_fwd, (int64_t)run->flops_bwd};
    world_sum_i64(w, f, 2);
    flops[xi][0] = (double)f[0];
    flops[xi][1] = (double)f[1];
  }

  if (w->rank == 0) {
    const double TW = (double)T * W, hb = (double)H * (double)es;
    if (o->csv)
      printf("phase,exchange,time_ms,xrank_rows,xrank_bytes,traffic_bytes,gbps,of_memcpy,gflops\n");
    else
      printf("%-18s %-10s %10s %11s %10s %11s %8s %9s %8s\n", "phase", "exchange", "time_ms", "xrank_rows",
             "xrank_MB", "traffic_MB", "GB/s", "of_memcpy", "GFLOP/s");
    for (int xi = 0; xi < n_exch; xi++) {
      const double Nsum = (double)tot[xi][3];
      for (int p = 0; p < NUM_PHASES; p++) {
        if (p == PH_ROUTE && xi > 0) continue;
        if (p == PH_GRAD_W_RETURN && !rank_major) continue;
        double ms = med[xi][p], traffic = 0.0, fl = 0.0;
        int moves = p == PH_DISPATCH || p == PH_COMBINE || p == PH_COMBINE_BWD || p == PH_DISPATCH_BWD ||
                    p == PH_GRAD_W_RETURN;
        switch (p) {
          case PH_ROUTE: traffic = TW * (E * 4.0 + K * 12.0); break;
          case PH_DISPATCH: traffic = (TW + Nsum) * hb; break;
          case PH_COMBINE:
          case PH_DISPATCH_BWD:
          case PH_GRAD_W_RETURN: traffic = (Nsum + TW) * hb; break;
          case PH_COMBINE_BWD: traffic = (TW + (rank_major ? 1.0 : 2.0) * Nsum) * hb; break;
          case PH_ROUTE_BWD: traffic = TW * (E * 8.0 + K * 8.0); break;
          case PH_EXPERT_FWD: fl = flops[xi][0]; break;
          case PH_EXPERT_BWD: fl = flops[xi][1]; break;
          default: break;
        }
        double gbps = traffic > 0 ? traffic / (ms * 1e-3) / 1e9 : 0.0;
        const char *xn = p == PH_ROUTE ? "-" : exchange_name(runs[xi].exchange);
        if (o->csv) {
          printf("%s,%s,%.4f,%lld,%lld,%.0f,%.3f,%.4f,%.3f\n", phase_names[p], xn, ms,
                 moves ? (long long)tot[xi][0] : 0LL, moves ? (long long)tot[xi][1] : 0LL, traffic, gbps,
                 traffic > 0 ? gbps / job->memcpy_gbps : 0.0, fl > 0 ? fl / (ms * 1e-3) / 1e9 : 0.0);
          continue;
        }
        char rows_s[32] = "-", mb_s[32] = "-", tr_s[32] = "-", gb_s[32] = "-", of_s[32] = "-", fl_s[32] = "-";
        if (moves) {
          snprintf(rows_s, sizeof rows_s, "%lld", (long long)tot[xi][0]);
          snprintf(mb_s, sizeof mb_s, "%.1f", (double)tot[xi][1] / 1e6);
        }
        if (traffic > 0) {
          snprintf(tr_s, sizeof tr_s, "%.1f", traffic / 1e6);
          snprintf(gb_s, sizeof gb_s, "%.2f", gbps);
          snprintf(of_s, sizeof of_s, "%.2f", gbps / job->memcpy_gbps);
        }
        if (fl > 0) snprintf(fl_s, sizeof fl_s, "%.1f", fl / (ms * 1e-3) / 1e9);
        printf("%-18s %-10s %10.3f %11s %10s %11s %8s %9s %8s\n", phase_names[p], xn, ms, rows_s, mb_s, tr_s,
               gb_s, of_s, fl_s);
      }
      if (o->csv)
        printf("step,%s,%.4f,,,,,,\n", exchange_name(runs[xi].exchange), step_ms[xi]);
      else
        printf("%-18s %-10s %10.3f\n", "step", exchange_name(runs[xi].exchange), step_ms[xi]);
    }
    if (n_exch == 2)
      printf("dedup/collective: cross-rank rows %.3f, bytes %.3f; time (median of per-iteration ratios): "
             "dispatch_layout %.3f, dispatch %.3f, combine %.3f, combine_backward %.3f, dispatch_backward %.3f, "
             "the four exchanges %.3f, step without route %.3f\n",
             (double)tot[0][0] / (double)(tot[1][0] ? tot[1][0] : 1),
             (double)tot[0][1] / (double)(tot[1][1] ? tot[1][1] : 1), ratio[PH_LAYOUT], ratio[PH_DISPATCH],
             ratio[PH_COMBINE], ratio[PH_COMBINE_BWD], ratio[PH_DISPATCH_BWD], ratio[RATIO_FOUR], ratio[RATIO_STEP]);
    fflush(stdout);
  }

  int ok = 1;
  if (o->check) {
    progress_note(w, &prog, "checking against the dense reference");
    double t_ref = now_s();
    tolerance_t tol = tolerance_of(dtype);
    int32_t C = 0;
    int32_t *ridx = xalloc(sizeof(int32_t) * (size_t)(T * K));
    float *rw = xalloc(sizeof(float) * (size_t)(T * K));
    ref_route(o, o->capacity_factor > 0.0, T, logits, ridx, rw, &C);
    if (w->rank == 0)
      printf("check %-34s epx %d, expected %d: %s\n", "route capacity", (int)capacity, (int)C,
             capacity == C ? "ok" : "FAILED");
    ok &= capacity == C;
    int64_t idx_bad = 0;
    for (int64_t i = 0; i < T * K; i++) idx_bad += ridx[i] != topk_idx[i];
    ok &= report_count(w, "route topk_idx", idx_bad, T * K);
    ok &= report_compare(w, "route topk_w", compare_f32(topk_w, rw, T * K, tolerance_of(EPX_FLOAT32)),
                         tolerance_of(EPX_FLOAT32));

    layer_ref_t ref = {xalloc(sizeof(float) * (size_t)(T * H)), xalloc(sizeof(float) * (size_t)(T * H)),
                       xalloc(sizeof(float) * (size_t)(T * K)), xalloc(sizeof(float) * (size_t)(T * E))};
    layer_reference(&job->ex, dtype, T, K, ridx, rw, o, logits, x, grad_out, &ref);
    for (int xi = 0; xi < n_exch; xi++) {
      exchange_run_t *run = &runs[xi];
      char what[64];
      snprintf(what, sizeof what, "out (%s)", exchange_name(run->exchange));
      ok &= report_compare(w, what, compare_payload(dtype, run->out, ref.out, T * H, tol), tol);
      snprintf(what, sizeof what, "grad_x (%s)", exchange_name(run->exchange));
      ok &= report_compare(w, what, compare_payload(dtype, run->grad_x, ref.grad_x, T * H, tol), tol);
      snprintf(what, sizeof what, "grad_w (%s)", exchange_name(run->exchange));
      ok &= report_compare(w, what, compare_f32(run->grad_w, ref.grad_w, T * K, tol), tol);
      snprintf(what, sizeof what, "grad_logits (%s)", exchange_name(run->exchange));
      ok &= report_compare(w, what, compare_f32(run->grad_logits, ref.grad_logits, T * E, tol), tol);
      /* A router that learns nothing passes every other check. */
      int64_t nonzero[2] = {0, T * E};
      for (int64_t i = 0; i < T * E; i++) nonzero[0] += run->grad_logits[i] != 0.0f;
      world_sum_i64(w, nonzero, 2);
      snprintf(what, sizeof what, "router gradient (%s)", exchange_name(run->exchange));
      if (w->rank == 0)
        printf("check %-34s %lld of %lld grad_logits nonzero: %s\n", what, (long long)nonzero[0],
               (long long)nonzero[1], nonzero[0] ? "ok" : "FAILED");
      ok &= nonzero[0] > 0;
    }
    if (n_exch == 2) {
      int64_t bad = count_diff_bytes(runs[0].out, runs[1].out, T * H, es) +
                    count_diff_bytes(runs[0].grad_x, runs[1].grad_x, T * H, es) +
                    count_diff_bytes(runs[0].grad_w, runs[1].grad_w, T * K, 4) +
                    count_diff_bytes(runs[0].grad_logits, runs[1].grad_logits, T * E, 4);
      int64_t count = 2 * T * H + T * K + T * E;
      if (o->ffn) {
        bad += count_diff_bytes(runs[0].dW, runs[1].dW, expert_stride(&job->ex) * El, 4);
        count += expert_stride(&job->ex) * El;
      }
      ok &= report_count(w, "dedup == collective, bit for bit", bad, count);
      if (w->rank == 0)
        printf("check %-34s dedup %lld, collective %lld: %s\n", "cross-rank rows, dedup <= coll.",
               (long long)tot[0][0], (long long)tot[1][0], tot[0][0] <= tot[1][0] ? "ok" : "FAILED");
      ok &= tot[0][0] <= tot[1][0];
    }
    double ref_s[1] = {now_s() - t_ref};
    world_max_f64(w, ref_s, 1);
    if (w->rank == 0) printf("check took %.2f s\n", ref_s[0]);
    free(ridx);
    free(rw);
    free(ref.out);
    free(ref.grad_x);
    free(ref.grad_w);
    free(ref.grad_logits);
  }
  ok &= !recompute_failed;
  if (w->rank == 0) job->ok = ok;

  for (int xi = 0; xi < n_exch; xi++) {
    TRY(epx_buffer_destroy(runs[xi].buffer));
    mirror_free(runs[xi].out, runs[xi].d_out), mirror_free(runs[xi].grad_x, runs[xi].d_grad_x);
    mirror_free(runs[xi].grad_w, runs[xi].d_grad_w), mirror_free(runs[xi].grad_logits, runs[xi].d_grad_logits);
    free(runs[xi].out);
    free(runs[xi].grad_x);
    free(runs[xi].grad_w);
    free(runs[xi].grad_logits);
    free(runs[xi].dW);
  }
  rank_experts_free(&re);
  mirror_free(recv_x, d_recv_x), mirror_free(expert_out, d_expert_out);
  mirror_free(grad_expert_out, d_grad_expert_out), mirror_free(gw_rows, d_gw_rows), mirror_free(gw_out, d_gw_out);
  mirror_free(x, d_x), mirror_free(grad_out, d_grad_out), mirror_free(logits, d_logits);
  mirror_free(topk_idx, d_idx), mirror_free(topk_w, d_w), mirror_free(locations, d_loc);
  free(times);
  free(recv_x);
  free(expert_out);
  free(grad_expert_out);
  free(gw_rows);
  free(gw_out);
  free(x);
  free(grad_out);
  free(logits);
  free(topk_idx);
  free(topk_w);
  free(locations);
}

/* ------------------------------------------------------------------------ */
/* --single: the one-rank microbenchmark                                     */
/* ------------------------------------------------------------------------ */

enum single_op { OP_ROUTE, OP_LAYOUT, OP_DISPATCH, OP_COMBINE, OP_COMBINE_BWD, OP_DISPATCH_BWD, OP_ROUTE_BWD, NUM_OPS };
static const char *const op_names[NUM_OPS] = {"route", "dispatch_layout", "dispatch", "combine",
                                              "combine_backward", "dispatch_backward", "route_backward"};

/* Runs fn `warmup + iters` times; returns the median of the timed ones, ms. */
#define TIME_MEDIAN(result_ms, warmup, iters, body)                  \
  do {                                                               \
    double tm_[256];                                                 \
    int n_ = (iters) < 256 ? (iters) : 256;                          \
    for (int r_ = 0; r_ < (warmup) + n_; r_++) {                     \
      double t0_ = now_s();                                          \
      body;                                                          \
      if (r_ >= (warmup)) tm_[r_ - (warmup)] = now_s() - t0_;        \
    }                                                                \
    (result_ms) = 1e3 * median(tm_, n_);                             \
  } while (0)

static int single_run(const options_t *o, epx_dtype_t dtype, const world_t *w) {
  const int64_t T = o->tokens, H = o->hidden;
  const int32_t E = o->experts, K = o->topk;
  const size_t es = epx_dtype_size(dtype);
  const tolerance_t tol = tolerance_of(dtype);
  int ok = 1;

  /* The ceiling is the better of one thread and every core copying at once:
   * the library may spread a one-rank call over the cores. */
  const int32_t cores = (int32_t)sysconf(_SC_NPROCESSORS_ONLN);
  double memcpy_1 = measure_memcpy(w, (size_t)256 << 20, 5);
  double memcpy_all = cores > 1 ? measure_memcpy_threads(cores, ((size_t)256 << 20) / (size_t)cores) : memcpy_1;
  double memcpy_gbps = memcpy_all > memcpy_1 ? memcpy_all : memcpy_1;

  epx_comm_t comm;
  TRY(epx_comm_create_self(&comm));
  rng_t rx = rng_make(o->seed, 1), rg = rng_make(o->seed, 2), re_ = rng_make(o->seed, 4);
  float *logits = xalloc(sizeof(float) * (size_t)(T * E));
  make_logits(o, 0, T, logits);
  void *x = xalloc(es * (size_t)(T * H)), *grad_out = xalloc(es * (size_t)(T * H));
  fill_payload(dtype, x, T * H, &rx);
  fill_payload(dtype, grad_out, T * H, &rg);

  epx_route_config_t rc = route_config(o, 1);
  int32_t *idx = xalloc(sizeof(int32_t) * (size_t)(T * K)), *loc = xalloc(sizeof(int32_t) * (size_t)(T * K));
  float *wt = xalloc(sizeof(float) * (size_t)(T * K));
  epx_route_output_t ro = {idx, wt, loc, NULL, NULL, NULL, 0, 0};
  double ms[NUM_OPS], dense_ms[2];
  TIME_MEDIAN(ms[OP_ROUTE], o->warmup, o->iters, TRY(epx_route(&rc, T, logits, NULL, &ro)));
  const int32_t C = ro.capacity;
  int64_t kept = 0;
  for (int64_t i = 0; i < T * K; i++) kept += idx[i] >= 0;

  epx_buffer_config_t bc = EPX_BUFFER_CONFIG_INIT;
  bc.dtype = dtype;
  bc.hidden = H;
  bc.num_experts = E;
  bc.max_top_k = K;
  bc.max_tokens_per_rank = T;
  bc.layout = o->layout;
  bc.capacity = o->layout == EPX_LAYOUT_CAPACITY ? C : 0;
  epx_buffer_t buf;
  TRY(epx_buffer_create(comm, &bc, &buf));
  epx_routing_t routing = {T, K, idx, wt, o->layout == EPX_LAYOUT_CAPACITY ? loc : NULL, EPX_WEIGHTS_IN_COMBINE};
  epx_handle_t h = NULL;
  TIME_MEDIAN(ms[OP_LAYOUT], o->warmup, o->iters, {
    if (h) TRY(epx_handle_release(h));
    TRY(epx_dispatch_layout(buf, &routing, NULL, &h));
  });
  int64_t N;
  TRY(epx_handle_recv_rows(h, &N));
  size_t rows_bytes = es * (size_t)(N + 1) * (size_t)H;
  void *recv_x = xalloc(rows_bytes), *expert_out = xalloc(rows_bytes), *grad_eo = xalloc(rows_bytes);
  void *grad_recv = xalloc(rows_bytes), *out = xalloc(es * (size_t)(T * H)), *grad_x = xalloc(es * (size_t)(T * H));
  float *grad_w = xalloc(sizeof(float) * (size_t)(T * K)), *grad_logits = xalloc(sizeof(float) * (size_t)(T * E));
  fill_payload(dtype, expert_out, N * H, &re_);
  fill_payload(dtype, grad_recv, N * H, &re_);
  memset(recv_x, 0xff, rows_bytes);
  memset(out, 0xff, es * (size_t)(T * H));
  memset(grad_eo, 0xff, rows_bytes);
  memset(grad_x, 0xff, es * (size_t)(T * H));
  memset(grad_w, 0xff, sizeof(float) * (size_t)(T * K));
  TIME_MEDIAN(ms[OP_DISPATCH], o->warmup, o->iters, TRY(epx_dispatch(buf, h, x, recv_x, N + 1)));
  TIME_MEDIAN(ms[OP_COMBINE], o->warmup, o->iters, TRY(epx_combine(buf, h, expert_out, out)));
  TIME_MEDIAN(ms[OP_COMBINE_BWD], o->warmup, o->iters,
              TRY(epx_combine_backward(buf, h, grad_out, expert_out, grad_eo, grad_w)));
  TIME_MEDIAN(ms[OP_DISPATCH_BWD], o->warmup, o->iters, TRY(epx_dispatch_backward(buf, h, grad_recv, grad_x, NULL, NULL)));
  TIME_MEDIAN(ms[OP_ROUTE_BWD], o->warmup, o->iters,
              TRY(epx_route_backward(&rc, T, logits, NULL, idx, grad_w, 0.0f, 0.0f, grad_logits)));

  /* Where each received row lives in the dense [E, C, H] layout. */
  int32_t *src_token = xalloc(sizeof(int32_t) * (size_t)(N + 1)), *src_rank = xalloc(sizeof(int32_t) * (size_t)(N + 1));
  int32_t *recv_e = xalloc(sizeof(int32_t) * (size_t)(N + 1));
  int64_t *dense_row = xalloc(sizeof(int64_t) * (size_t)(N + 1)), *slot_of = xalloc(sizeof(int64_t) * (size_t)(N + 1));
  TRY(epx_handle_recv_source(h, src_rank, src_token));
  TRY(epx_handle_recv_routing(h, recv_e, NULL));
  int64_t map_bad = 0, mapped = 0;
  for (int64_t r = 0; r < N; r++) {
    dense_row[r] = slot_of[r] = -1;
    if (recv_e[r] < 0) continue;
    int32_t t = src_token[r];
    for (int32_t k = 0; t >= 0 && t < T && k < K; k++)
      if (idx[t * K + k] == recv_e[r]) {
        slot_of[r] = t * K + k;
        dense_row[r] = (int64_t)recv_e[r] * C + loc[t * K + k];
      }
    if (dense_row[r] < 0) map_bad++;
    else mapped++;
  }
  const size_t rb = es * (size_t)H;
  const int64_t EC = (int64_t)E * C;
  size_t dense_bytes = es * (size_t)EC * (size_t)H;
  void *dense_recv = xalloc(dense_bytes), *dense_eo = xalloc(dense_bytes), *dense_out = xalloc(es * (size_t)(T * H));
  memset(dense_eo, 0, dense_bytes);
  for (int64_t r = 0; r < N; r++)
    if (dense_row[r] >= 0) memcpy((char *)dense_eo + (size_t)dense_row[r] * rb, (char *)expert_out + (size_t)r * rb, rb);

  /* The dense one-hot baseline at the same shape, as a framework runs it:
   * the [T, E*C] mask in float32 and one OpenBLAS sgemm per einsum
   * (sec,sm->ecm and sec,ecm->sm), dtype conversions included, the mask
   * built outside the timer. One timed run each: 2*T*E*C*H flops apiece. */
  progress_t prog = {now_s(), 0.0};
  progress_note(w, &prog, "dense baseline");
  float *mask = xalloc(sizeof(float) * (size_t)T * (size_t)EC);
  float *dense_in_f = xalloc(sizeof(float) * (size_t)EC * (size_t)H), *dense_tok_f = xalloc(sizeof(float) * (size_t)(T * H));
  memset(mask, 0, sizeof(float) * (size_t)T * (size_t)EC);
  for (int64_t i = 0; i < T * K; i++)
    if (idx[i] >= 0) mask[(size_t)(i / K) * (size_t)EC + (size_t)idx[i] * (size_t)C + (size_t)loc[i]] = 1.0f;
  fprintf(stderr, "epx-bench: %s: dense one-hot baseline, 2 sgemm of %.0f GFLOP\n", dtype_name(dtype),
          2.0 * (double)T * (double)EC * (double)H / 1e9);
  double t0 = now_s();
  TRY(epx_convert(EPX_FLOAT32, dense_tok_f, dtype, x, T * H));
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)EC, (int)H, (int)T, 1.0f, mask, (int)EC, dense_tok_f,
              (int)H, 0.0f, dense_in_f, (int)H);
  TRY(epx_convert(dtype, dense_recv, EPX_FLOAT32, dense_in_f, EC * H));
  dense_ms[0] = 1e3 * (now_s() - t0);
  for (int64_t i = 0; i < T * K; i++)
    if (idx[i] >= 0) mask[(size_t)(i / K) * (size_t)EC + (size_t)idx[i] * (size_t)C + (size_t)loc[i]] = wt[i];
  t0 = now_s();
  TRY(epx_convert(EPX_FLOAT32, dense_in_f, dtype, dense_eo, EC * H));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)H, (int)EC, 1.0f, mask, (int)EC, dense_in_f,
              (int)H, 0.0f, dense_tok_f, (int)H);
  TRY(epx_convert(dtype, dense_out, EPX_FLOAT32, dense_tok_f, T * H));
  dense_ms[1] = 1e3 * (now_s() - t0);
  free(mask);
  free(dense_in_f);
  free(dense_tok_f);

  /* The library's own dense reference (the literal einsum loops, a pass over
   * the input per output slot) where it finishes in seconds. */
  const double literal_fma = (double)T * (double)EC * (double)H;
  double literal_ms[2] = {0.0, 0.0};
  void *literal_recv = NULL, *literal_out = NULL;
  if (literal_fma <= 2e9) {
    literal_recv = xalloc(dense_bytes);
    literal_out = xalloc(es * (size_t)(T * H));
    t0 = now_s();
    TRY(epx_reference_dense_dispatch(dtype, T, H, E, C, K, idx, wt, loc, EPX_WEIGHTS_IN_COMBINE, x, literal_recv));
    literal_ms[0] = 1e3 * (now_s() - t0);
    t0 = now_s();
    TRY(epx_reference_dense_combine(dtype, T, H, E, C, K, idx, wt, loc, EPX_WEIGHTS_IN_COMBINE, dense_eo,
                                    literal_out));
    literal_ms[1] = 1e3 * (now_s() - t0);
  }

  /* Bytes each op must move: every input read once, every output written once. */
  const double hb = (double)H * (double)es, Td = (double)T, Nd = (double)N;
  double bytes[NUM_OPS] = {Td * (E * 4.0 + K * 12.0), Td * K * 8.0, (Td + Nd) * hb, (Nd + Td) * hb,
                           (Td + 2.0 * Nd) * hb, (Nd + Td) * hb, Td * (E * 8.0 + K * 8.0)};

  printf("single rank, %s: T=%lld H=%lld E=%d top-%d capacity %d (factor %.2f, %lld of %lld routes kept), layout %s, "
         "%lld recv rows; memcpy ceiling %.2f GB/s (read+write; 1 thread %.2f, %d threads %.2f)\n",
         dtype_name(dtype), (long long)T, (long long)H, (int)E, (int)K, (int)C, o->capacity_factor, (long long)kept,
         (long long)(T * K), layout_name(o->layout), (long long)N, memcpy_gbps, memcpy_1, (int)cores, memcpy_all);
  if (o->csv) printf("op,dtype,time_ms,bytes,gbps,of_memcpy,dense_ms,speedup\n");
  else
    printf("%-18s %10s %10s %8s %9s %10s %8s\n", "op", "time_ms", "MB", "GB/s", "of_memcpy", "dense_ms", "speedup");
  for (int op = 0; op < NUM_OPS; op++) {
    double gbps = bytes[op] / (ms[op] * 1e-3) / 1e9;
    double dms = op == OP_DISPATCH ? dense_ms[0] : op == OP_COMBINE ? dense_ms[1] : 0.0;
    if (o->csv) {
      printf("%s,%s,%.4f,%.0f,%.3f,%.4f,%.3f,%.2f\n", op_names[op], dtype_name(dtype), ms[op], bytes[op], gbps,
             gbps / memcpy_gbps, dms, dms > 0 ? dms / ms[op] : 0.0);
      continue;
    }
    char d_s[32] = "-", s_s[32] = "-";
    if (dms > 0) {
      snprintf(d_s, sizeof d_s, "%.2f", dms);
      snprintf(s_s, sizeof s_s, "%.1fx", dms / ms[op]);
    }
    printf("%-18s %10.3f %10.1f %8.2f %9.2f %10s %8s\n", op_names[op], ms[op], bytes[op] / 1e6, gbps,
           gbps / memcpy_gbps, d_s, s_s);
  }
  for (int op = OP_DISPATCH; op <= OP_DISPATCH_BWD; op++) {
    double frac = bytes[op] / (ms[op] * 1e-3) / 1e9 / memcpy_gbps;
    printf("target %-18s >= 60%% of memcpy: %3.0f%%: %s", op_names[op], 100.0 * frac, frac >= 0.6 ? "met" : "missed");
    if (op == OP_DISPATCH || op == OP_COMBINE) {
      double sp = (op == OP_DISPATCH ? dense_ms[0] : dense_ms[1]) / ms[op];
      printf("; >= 20x dense: %.1fx: %s", sp, sp >= 20.0 ? "met" : "missed");
    }
    printf("\n");
  }
  printf("dense one-hot baseline: [T, E*C] float32 mask, one OpenBLAS sgemm per einsum (%d threads), "
         "conversions included: dispatch %.1f ms, combine %.1f ms\n",
         openblas_get_num_threads(), dense_ms[0], dense_ms[1]);
  if (literal_recv)
    printf("epx_reference_dense_dispatch/combine (the literal loops): dispatch %.1f ms (%.1fx epx), combine %.1f ms "
           "(%.1fx epx)\n",
           literal_ms[0], literal_ms[0] / ms[OP_DISPATCH], literal_ms[1], literal_ms[1] / ms[OP_COMBINE]);
  else
    printf("epx_reference_dense_dispatch/combine (the literal loops): not run, T*E*C*H = %.2g multiply-adds with a "
           "pass over the input per slot is hours at this shape\n",
           literal_fma);

  if (o->check) {
    /* route against the bench's own softmax/top-k/capacity */
    int32_t *ridx = xalloc(sizeof(int32_t) * (size_t)(T * K));
    float *rw = xalloc(sizeof(float) * (size_t)(T * K)), *rgl = xalloc(sizeof(float) * (size_t)(T * E));
    int32_t rC = 0;
    ref_route(o, 1, T, logits, ridx, rw, &rC);
    ok &= report_count(w, "route capacity", rC != C, 1);
    int64_t bad = 0;
    for (int64_t i = 0; i < T * K; i++) bad += ridx[i] != idx[i];
    ok &= report_count(w, "route topk_idx", bad, T * K);
    ok &= report_compare(w, "route topk_w", compare_f32(wt, rw, T * K, tolerance_of(EPX_FLOAT32)), tolerance_of(EPX_FLOAT32));
    ok &= report_count(w, "recv rows map to kept routes", map_bad + (mapped != kept), N + 1);
    /* dispatch: every received row is its token's x, as in the dense layout */
    int64_t rows_bad = 0;
    for (int64_t r = 0; r < N; r++)
      if (dense_row[r] >= 0)
        rows_bad += memcmp((char *)recv_x + (size_t)r * rb, (char *)x + (size_t)src_token[r] * rb, rb) != 0 ||
                    memcmp((char *)recv_x + (size_t)r * rb, (char *)dense_recv + (size_t)dense_row[r] * rb, rb) != 0;
    ok &= report_count(w, "dispatch rows == x == dense", rows_bad, N);
    if (literal_recv)
      ok &= report_count(w, "dense sgemm == epx_reference_dense", count_diff_bytes(dense_recv, literal_recv, EC * H, es),
                         EC * H);
    /* combine against the dense combines */
    float *dof = xalloc(sizeof(float) * (size_t)(T * H));
    TRY(epx_convert(EPX_FLOAT32, dof, dtype, dense_out, T * H));
    ok &= report_compare(w, "combine == dense sgemm", compare_payload(dtype, out, dof, T * H, tol), tol);
    if (literal_out) {
      TRY(epx_convert(EPX_FLOAT32, dof, dtype, literal_out, T * H));
      ok &= report_compare(w, "combine == epx_reference_dense", compare_payload(dtype, out, dof, T * H, tol), tol);
    }
    /* combine_backward: row (t,k) = w * grad_out[t]; grad_w = <grad_out[t], expert_out(t,k)> */
    float *gf = xalloc(sizeof(float) * (size_t)(T * H)), *row = xalloc(sizeof(float) * (size_t)H);
    float *exp_geo = xalloc(sizeof(float) * (size_t)(N + 1) * (size_t)H), *exp_gw = xalloc(sizeof(float) * (size_t)(T * K));
    TRY(epx_convert(EPX_FLOAT32, gf, dtype, grad_out, T * H));
    for (int64_t i = 0; i < T * K; i++) exp_gw[i] = 0.0f;
    for (int64_t r = 0; r < N; r++) {
      float *eg = exp_geo + r * H;
      if (slot_of[r] < 0) {
        memset(eg, 0, sizeof(float) * (size_t)H);
        continue;
      }
      const float *g = gf + slot_of[r] / K * H;
      TRY(epx_convert(EPX_FLOAT32, row, dtype, (char *)expert_out + (size_t)r * rb, H));
      double dot = 0.0;
      for (int64_t i = 0; i < H; i++) {
        eg[i] = wt[slot_of[r]] * g[i];
        dot += (double)g[i] * row[i];
      }
      exp_gw[slot_of[r]] = (float)dot;
    }
    ok &= report_compare(w, "combine_backward grad_expert_out", compare_payload(dtype, grad_eo, exp_geo, N * H, tol), tol);
    ok &= report_compare(w, "combine_backward grad_w", compare_f32(grad_w, exp_gw, T * K, tol), tol);
    /* dispatch_backward: grad_x[t] = sum of its rows' gradients */
    memset(dof, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t r = 0; r < N; r++) {
      if (slot_of[r] < 0) continue;
      TRY(epx_convert(EPX_FLOAT32, row, dtype, (char *)grad_recv + (size_t)r * rb, H));
      float *gx = dof + slot_of[r] / K * H;
      for (int64_t i = 0; i < H; i++) gx[i] += row[i];
    }
    ok &= report_compare(w, "dispatch_backward grad_x", compare_payload(dtype, grad_x, dof, T * H, tol), tol);
    ref_route_backward(o, 1, T, logits, idx, grad_w, rgl);
    ok &= report_compare(w, "route_backward grad_logits", compare_f32(grad_logits, rgl, T * E, tol), tol);
    free(ridx);
    free(rw);
    free(rgl);
    free(dof);
    free(gf);
    free(row);
    free(exp_geo);
    free(exp_gw);
  }
  fflush(stdout);

  TRY(epx_handle_release(h));
  TRY(epx_buffer_destroy(buf));
  TRY(epx_comm_destroy(comm));
  free(logits);
  free(x);
  free(grad_out);
  free(idx);
  free(loc);
  free(wt);
  free(recv_x);
  free(expert_out);
  free(grad_eo);
  free(grad_recv);
  free(out);
  free(grad_x);
  free(grad_w);
  free(grad_logits);
  free(dense_recv);
  free(dense_eo);
  free(dense_out);
  free(literal_recv);
  free(literal_out);
  free(src_token);
  free(src_rank);
  free(recv_e);
  free(dense_row);
  free(slot_of);
  return ok;
}

/* ------------------------------------------------------------------------ */
/* Ranks: threads of the local transport, or MPI processes                   */
/* ------------------------------------------------------------------------ */

typedef struct rank_thread_arg {
  job_t *job;
  epx_local_world_t world;
  int32_t rank, size;
} rank_thread_arg_t;

static void *rank_thread(void *p) {
  rank_thread_arg_t *a = p;
  t_rank = a->rank;
  world_t w = {a->rank, a->size, NULL};
  TRY(epx_comm_create_local(a->world, a->rank, &w.comm));
  main_job_rank(a->job, &w, w.comm);
  TRY(epx_comm_destroy(w.comm));
  return NULL;
}

#if EPX_TOOLS_HAVE_MPI
/* --device cuda: this process's GPU (its local rank's, among the visible
 * ones), the stream of its buffers and routes, and the NCCL comm, made from
 * a unique id that rank 0 shares over MPI. */
static epx_comm_t cuda_comm(int rank, MPI_Comm *world_comm) {
#if EPX_TOOLS_HAVE_CUDA
  if (!epx_has_nccl()) fatal("this libepx was built without NCCL: --device cuda needs the nccl transport");
  const char *local = env_nonempty("OMPI_COMM_WORLD_LOCAL_RANK");
  if (!local) local = env_nonempty("MPI_LOCALRANKID");
  int devices = 0;
  CUDA_TRY(cudaGetDeviceCount(&devices));
  if (devices < 1) fatal("--device cuda: no CUDA device");
  CUDA_TRY(cudaSetDevice((local ? atoi(local) : rank) % devices));
  cudaStream_t stream;
  CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  g_stream = stream;
  g_cuda = 1;
  epx_comm_t comm = NULL;
  TRY(epx_comm_create_nccl_mpi(world_comm, NULL, &comm));
  return comm;
#else
  (void)rank, (void)world_comm;
  fatal("epx-bench was built without CUDA (configure with -DEPX_BUILD_CUDA=ON)");
  return NULL;
#endif
}
#endif

static void print_header(const options_t *o, int32_t W) {
  printf("epx-bench %d.%d.%d: MoE layer step on %d ranks (%s): T=%lld tokens per rank, H=%lld, "
         "E=%d, top-%d, ",
         EPX_VERSION_MAJOR, EPX_VERSION_MINOR, EPX_VERSION_PATCH, (int)W,
         o->cuda ? "CUDA buffers over NCCL, one GPU per MPI process" : o->mpi ? "mpi transport" : "local transport",
         (long long)o->tokens, (long long)o->hidden, (int)o->experts, (int)o->topk);
  if (o->ffn) printf("SwiGLU FFN %d on OpenBLAS, ", (int)o->ffn);
  else printf("per-expert scale (no FFN), ");
  printf("%s, layout %s, ", dtype_name((epx_dtype_t)o->dtype), layout_name(o->layout));
  if (o->capacity_factor > 0) printf("capacity factor %.2f, ", o->capacity_factor);
  else printf("dropless, ");
  printf("zipf %.2f, %d iterations after %d warm-up\n", o->zipf, o->iters, o->warmup);
}

int main(int argc, char **argv) {
  options_t o;
  parse_options(argc, argv, &o);
  int ok = 1;

  if (o.single) {
    openblas_set_num_threads((int)sysconf(_SC_NPROCESSORS_ONLN));
    world_t w = {0, 1, NULL};
    if (o.dtype >= 0) {
      ok &= single_run(&o, (epx_dtype_t)o.dtype, &w);
    } else {
      ok &= single_run(&o, EPX_FLOAT32, &w);
      ok &= single_run(&o, EPX_BFLOAT16, &w);
    }
    printf("%s\n", ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
  }
  if (o.dtype < 0) o.dtype = EPX_FLOAT32;

  job_t job;
  memset(&job, 0, sizeof job);
  job.o = &o;

  if (o.mpi) {
#if EPX_TOOLS_HAVE_MPI
    if (!epx_has_mpi()) fatal("this libepx was built without MPI (EPX_BUILD_MPI, libopenmpi-dev)");
    MPI_Init(&argc, &argv);
    g_mpi_active = 1;
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    t_rank = rank;
    if (o.experts % size) fatal("--experts %d is not a multiple of the %d MPI ranks", (int)o.experts, size);
    o.ranks = size;
    openblas_set_num_threads(size > 1 ? 1 : (int)sysconf(_SC_NPROCESSORS_ONLN));
    experts_make(&job.ex, &o);
    if (rank == 0) {
      print_header(&o, size);
      fflush(stdout);
    }
    MPI_Comm world_comm = MPI_COMM_WORLD;
    world_t w = {rank, size, NULL};
    TRY(epx_comm_create_mpi(&world_comm, NULL, &w.comm));
    /* The bench's own barriers and sums stay on MPI; the buffers use NCCL. */
    epx_comm_t comm = o.cuda ? cuda_comm(rank, &world_comm) : w.comm;
    main_job_rank(&job, &w, comm);
    if (comm != w.comm) TRY(epx_comm_destroy(comm));
    TRY(epx_comm_destroy(w.comm));
    int verdict = rank == 0 ? job.ok : 1;
    MPI_Bcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD);
    ok = verdict;
    if (rank == 0) printf("%s\n", ok ? "OK" : "FAILED");
    fflush(stdout);
    MPI_Finalize();
    free(job.ex.w);
    return ok ? 0 : 1;
#else
    fatal("epx-bench was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  }

  const int32_t W = o.ranks;
  if (o.experts % W) fatal("--experts %d is not a multiple of --ranks %d", (int)o.experts, (int)W);
  /* The ranks are the parallelism: one BLAS thread each, unless alone. */
  openblas_set_num_threads(W > 1 ? 1 : (int)sysconf(_SC_NPROCESSORS_ONLN));
  experts_make(&job.ex, &o);
  print_header(&o, W);
  fflush(stdout);

  epx_local_world_t lw;
  TRY(epx_local_world_create(W, NULL, &lw));
  pthread_t *threads = xalloc(sizeof(pthread_t) * (size_t)W);
  rank_thread_arg_t *args = xalloc(sizeof(rank_thread_arg_t) * (size_t)W);
  for (int32_t r = 0; r < W; r++) {
    args[r] = (rank_thread_arg_t){&job, lw, r, W};
    if (pthread_create(&threads[r], NULL, rank_thread, &args[r])) fatal("pthread_create failed");
  }
  for (int32_t r = 0; r < W; r++) pthread_join(threads[r], NULL);
  TRY(epx_local_world_destroy(lw));
  ok = job.ok;
  printf("%s\n", ok ? "OK" : "FAILED");
  free(threads);
  free(args);
  free(job.ex.w);
  return ok ? 0 : 1;
}
