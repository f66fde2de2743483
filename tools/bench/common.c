/* epx-bench's plumbing: failure, allocation, time, the device mirrors of
 * host arrays (--device cuda) and the seeded random numbers. */
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "../../tests/util/buffer_config.h"
#include "bench.h"

/* ------------------------------------------------------------------------ */
/* Failure, allocation, time                                                 */
/* ------------------------------------------------------------------------ */

static pthread_mutex_t g_fatal_lock = PTHREAD_MUTEX_INITIALIZER;
#if EPX_TOOLS_HAVE_MPI
int g_mpi_active;
#endif
_Thread_local int32_t t_rank;

void fatal(const char *fmt, ...) {
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

/* 64-byte aligned (the payload contract asks for 16), never NULL. Large
 * tensors are 2 MiB aligned and asked to live on huge pages, as a serving or
 * training engine's allocator would: rows are read in scattered order, and
 * with 4 KiB pages nearly every row costs a TLB miss (measured here: f32
 * combine 22 -> 15 ms at T=8192, H=2048, K=3). The memcpy ceiling uses the
 * same allocator, so the ratios compare like with like. */
epx_buffer_config_t buffer_config_of(epx_dtype_t dtype, int64_t H, int32_t E, int32_t K, int64_t T,
                                     epx_layout_t layout, int32_t capacity) {
  epx_buffer_config_t bc = tu_config(EPX_DEVICE_CPU, dtype, H, E, K, T);
  bc.layout = layout;
  bc.capacity = layout == EPX_LAYOUT_CAPACITY ? capacity : 0;
  return bc;
}

void *xalloc(size_t bytes) {
  const size_t huge = (size_t)2 << 20;
  size_t alignment = bytes >= huge ? huge : 64;
  size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  void *p = aligned_alloc(alignment, rounded ? rounded : 64);
  if (!p) fatal("out of memory allocating %zu bytes", bytes);
  if (alignment == huge) madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}

/* Grows a scratch array to at least `need` bytes; the contents are not kept. */
void *grow(void *p, size_t *cap, size_t need) {
  if (need <= *cap && p) return p;
  free(p);
  *cap = need;
  return xalloc(need);
}

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double median(const double *v, int n) {
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

int g_cuda;
void *g_stream;

void *mirror_of(void *host, size_t bytes) {
  if (!g_cuda) return host;
  void *d = NULL;
#if EPX_TOOLS_HAVE_CUDA
  CUDA_TRY(cudaMalloc(&d, bytes ? bytes : 16));
#else
  (void)bytes;
#endif
  return d;
}

void mirror_free(void *host, void *dev) {
  if (dev == host) return;
#if EPX_TOOLS_HAVE_CUDA
  cudaFree(dev);
#endif
}

/* A device mirror grown with its host array (grow()'s contract). */
void *mirror_grow(void *host, void *dev, size_t *cap, size_t need) {
  if (!g_cuda) return host;
  if (dev && need <= *cap) return dev;
  mirror_free(NULL, dev);
  *cap = need;
  return mirror_of(NULL, need);
}

void dev_sync(void) {
#if EPX_TOOLS_HAVE_CUDA
  if (g_cuda) CUDA_TRY(cudaStreamSynchronize((cudaStream_t)g_stream));
#endif
}

/* On the buffers' stream and waited for: a cudaMemcpy from pageable memory
 * may return before its DMA lands, and the buffers' non-blocking stream
 * would not wait for it (the next epx call could read old rows, and its
 * timing would include the copy's tail). */
void upload(void *dev, const void *host, size_t bytes) {
  if (dev == host || !bytes) return;
#if EPX_TOOLS_HAVE_CUDA
  CUDA_TRY(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, (cudaStream_t)g_stream));
  dev_sync();
#endif
}

/* After epx's work on the buffers' stream (stream order), and waited for. */
void download(void *host, const void *dev, size_t bytes) {
  if (dev == host || !bytes) return;
#if EPX_TOOLS_HAVE_CUDA
  CUDA_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)g_stream));
#endif
  dev_sync();
}

void poison(void *host, void *dev, size_t bytes) {
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

uint64_t rng_next(rng_t *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

rng_t rng_make(uint64_t seed, uint64_t stream) {
  rng_t r = {seed * 0xd1342543de82ef95ull + stream * 0x9e3779b97f4a7c15ull + 1};
  rng_next(&r);
  return r;
}

/* (0, 1), never 0 or 1 (the Gumbel draw takes two logs). */
double rng_open01(rng_t *r) { return ((double)(rng_next(r) >> 11) + 0.5) * 0x1.0p-53; }

void fill_uniform(rng_t *r, float *v, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++) v[i] = scale * (float)(2.0 * rng_open01(r) - 1.0);
}

/* n payload elements of dtype, uniform in (-1, 1). */
void fill_payload(epx_dtype_t dtype, void *dst, int64_t n, rng_t *r) {
  float tmp[4096];
  size_t es = epx_dtype_size(dtype);
  for (int64_t i = 0; i < n; i += 4096) {
    int64_t m = n - i < 4096 ? n - i : 4096;
    fill_uniform(r, tmp, m, 1.0f);
    TRY(epx_convert(dtype, (char *)dst + (size_t)i * es, EPX_FLOAT32, tmp, m));
  }
}
