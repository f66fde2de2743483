/* The world of epx-bench's ranks: barriers and reductions over the ranks'
 * comm for timing and checks, the copy ceilings the exchange is compared
 * with, and progress notes. */
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* ------------------------------------------------------------------------ */
/* The world of the ranks: barriers and reductions for timing and checks     */
/* ------------------------------------------------------------------------ */

void world_barrier(const world_t *w) {
  if (w->size > 1) TRY(epx_comm_barrier(w->comm));
}

/* Every rank's n values, [size, n] (free it). */
static void *world_gather(const world_t *w, const void *v, size_t bytes) {
  void *all = xalloc(bytes * (size_t)w->size);
  TRY(epx_comm_allgather(w->comm, v, all, bytes));
  return all;
}

/* v[i] = max over ranks (in place, every rank gets it). */
void world_max_f64(const world_t *w, double *v, int64_t n) {
  if (w->size == 1) return;
  double *all = world_gather(w, v, sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++)
    for (int32_t r = 0; r < w->size; r++)
      if (all[(size_t)r * (size_t)n + (size_t)i] > v[i]) v[i] = all[(size_t)r * (size_t)n + (size_t)i];
  free(all);
}

/* v[i] = sum over ranks (in place, every rank gets it). */
void world_sum_i64(const world_t *w, int64_t *v, int64_t n) {
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
double measure_memcpy(const world_t *w, size_t bytes, int reps) {
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
double measure_device_copy(const world_t *w, size_t bytes, int reps) {
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
double measure_memcpy_threads(int32_t n, size_t bytes) {
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

void progress_note(const world_t *w, progress_t *p, const char *fmt, ...) {
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
