/* The fused NVLink exchange (src/cuda/fused_*.cu) on its own, under
 * `mpirun -np W` (one GPU per rank): every op checked against a plain host
 * reference, then timed beside NCCL's grouped ncclSend/ncclRecv of the same
 * rows, in one run.
 *
 * Checks (provenance-coded payloads: x[s][t][h] and each expert output are
 * functions of source rank, token, expert and h, exact in every dtype, so a
 * rank checks what it received without gathering anything): the plan's
 * tables (row count, every row's source rank / token / experts / weights,
 * expert counts and offsets) against a layout computed on the host from all
 * ranks' routing (each rank regenerates every rank's routing from its seed);
 * every received row (poisoned before), rank-major in the window and copied
 * out, expert-major with and without weights; every element of combine's
 * output (poisoned before) bit for bit against the host's float32 loop of the
 * contract, in both partial precisions, weighted and not. Shapes: bf16
 * H=7168, E=256, K=8 at T=8192 and 4096 (uniform and Zipf-skewed routing),
 * plus small float32 and float16 shapes with uneven T (one rank with 0
 * tokens), odd hidden sizes and dropped routes.
 *
 * Timing: CUDA events around each of 20 back-to-back ops after 3 warm-ups,
 * median, the slowest rank's; dispatch and combine at 8, 16, 24 and 32 CTAs
 * (one per SM), float32 partials, the expert-major layout, the backward
 * passes, the layout, and NCCL's all-to-all of the same per-rank rows.
 * GB/s per GPU counts as DeepEP does: the bytes a GPU receives (its own rows
 * included) over the time. Last line: OK (every check passed) or FAILED;
 * the targets of issue 11 are reported as MET / MISSED above it. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define OMPI_SKIP_MPICXX 1 /* the C API only */
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/fused.h"

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "rank %d: %s:%d %s: %s\n", g_rank, __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      report_fused_error();                                                                        \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                                \
    }                                                                                              \
  } while (0)
#define NK(call)                                                                                   \
  do {                                                                                             \
    ncclResult_t r_ = (call);                                                                      \
    if (r_ != ncclSuccess) {                                                                       \
      fprintf(stderr, "rank %d: %s:%d %s: %s\n", g_rank, __FILE__, __LINE__, #call, ncclGetErrorString(r_)); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                                \
    }                                                                                              \
  } while (0)
#define EK(call)                                                                                   \
  do {                                                                                             \
    epx_status_t s_ = (call);                                                                      \
    if (s_ != EPX_SUCCESS) {                                                                       \
      fprintf(stderr, "rank %d: %s:%d %s: %s\n", g_rank, __FILE__, __LINE__, #call, epx_last_error()); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                                \
    }                                                                                              \
  } while (0)

static int g_rank = 0, g_W = 1;
static epx_fused_t *g_fused = nullptr;

static void report_fused_error() {
  int32_t peer = -1;
  const char *phase = "";
  if (g_fused && epx_fused_error(g_fused, &peer, &phase))
    fprintf(stderr, "rank %d: fused exchange timed out waiting for rank %d (%s)\n", g_rank, peer, phase);
}

namespace {

/* ---- values ------------------------------------------------------------------ */

__host__ __device__ float x_val(int s, int64_t t, int64_t h) {
  return (float)((s * 37 + t * 11 + h * 7) % 199 - 99) / 64.0f;
}
__host__ __device__ float eo_val(int s, int64_t t, int e, int64_t h) {
  return (float)((s * 13 + t * 5 + (int64_t)e * 3 + h) % 211 - 105) / 128.0f;
}

template <typename T> __device__ T from_f(float v);
template <> __device__ float from_f<float>(float v) { return v; }
template <> __device__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __half from_f<__half>(float v) { return __float2half_rn(v); }

/* Host rounding, bit patterns of the dtype. */
uint32_t host_round(float v, epx_dtype_t dt) {
  uint32_t b;
  memcpy(&b, &v, 4);
  if (dt == EPX_FLOAT32) return b;
  if (dt == EPX_BFLOAT16) return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const __half_raw r = __float2half_rn(v);
  return r.x;
}
float host_value(uint32_t bits, epx_dtype_t dt) {
  float f;
  if (dt == EPX_FLOAT32) {
    memcpy(&f, &bits, 4);
  } else if (dt == EPX_BFLOAT16) {
    const uint32_t b = bits << 16;
    memcpy(&f, &b, 4);
  } else {
    __half_raw r;
    r.x = (uint16_t)bits;
    f = __half2float(__half(r));
  }
  return f;
}
size_t dsize(epx_dtype_t dt) { return dt == EPX_FLOAT32 ? 4 : 2; }

/* ---- device helpers of the checks ----------------------------------------------- */

template <typename T>
__global__ void fill_x_kernel(T *x, int64_t T_, int64_t H, int rank) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T_ * H; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = from_f<T>(x_val(rank, i / H, i % H));
}

/* expert_out rows from the reference tables: e_of NULL (rank-major) uses the
 * marker 1000 + rank. */
template <typename T>
__global__ void fill_eo_kernel(T *eo, int64_t N, int64_t H, const int32_t *src, const int32_t *tok,
                               const int32_t *e_of, int rank) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * H; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / H;
    eo[i] = src[r] < 0 ? from_f<T>(0.0f) : from_f<T>(eo_val(src[r], tok[r], e_of ? e_of[r] : 1000 + rank, i % H));
  }
}

__device__ uint32_t bits_of(float v) { return __float_as_uint(v); }
__device__ uint32_t bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ uint32_t bits_of(__half v) { return __half_as_ushort(v); }

/* Counts rows' elements that differ from the expected (zeros for padding,
 * x of the source, or round(w * x)). */
template <typename T>
__global__ void check_rows_kernel(const T *rows, int64_t N, int64_t H, const int32_t *src, const int32_t *tok,
                                  const float *w, unsigned long long *bad) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * H; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / H;
    T want = from_f<T>(0.0f);
    if (src[r] >= 0) {
      const float v = x_val(src[r], tok[r], i % H);
      want = from_f<T>(w ? __fmul_rn(w[r], v) : v);
    }
    local += bits_of(rows[i]) != bits_of(want);
  }
  if (local) atomicAdd(bad, local);
}

template <typename T>
void launch_fill_x(void *x, int64_t T_, int64_t H, int rank) {
  fill_x_kernel<T><<<1024, 256>>>(static_cast<T *>(x), T_, H, rank);
}

/* ---- routing --------------------------------------------------------------------- */

struct rng_t {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
};

struct routing_t {
  int64_t T;
  std::vector<int32_t> idx;
  std::vector<float> w;
};

/* Rank r's routing: K distinct experts per token, uniform or Zipf (exponent
 * 1.2 over an expert order shared by all ranks); about 1% of slots dropped
 * (-1) and, with `empty`, every 97th token without any route. */
routing_t make_routing(int r, int64_t T, int E, int K, bool zipf, bool empty, uint64_t seed) {
  routing_t x;
  x.T = T;
  x.idx.assign((size_t)(T * K), -1);
  x.w.assign((size_t)(T * K), 0.0f);
  rng_t order_rng{seed * 7 + 1};
  std::vector<int> order(E);
  for (int e = 0; e < E; e++) order[e] = e;
  for (int e = E - 1; e > 0; e--) std::swap(order[e], order[order_rng.next() % (uint64_t)(e + 1)]);
  std::vector<double> cdf(E);
  double sum = 0;
  for (int i = 0; i < E; i++) cdf[i] = sum += zipf ? 1.0 / pow(i + 1.0, 1.2) : 1.0;
  rng_t rng{seed * 1000003 + (uint64_t)r * 7919 + 17};
  std::vector<char> used(E);
  for (int64_t t = 0; t < T; t++) {
    std::fill(used.begin(), used.end(), 0);
    for (int k = 0; k < K; k++) {
      int e;
      do {
        const double u = rng.uniform() * sum;
        e = order[std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin()];
      } while (used[e]);
      used[e] = 1;
      const bool drop = rng.next() % 100 == 0 || (empty && t % 97 == 5);
      x.idx[t * K + k] = drop ? -1 : e;
      x.w[t * K + k] = (float)(0.05 + 0.95 * rng.uniform());
    }
  }
  return x;
}

/* ---- the host reference layout ------------------------------------------------------ */

struct ref_layout_t {
  int64_t N = 0, pairs = 0;
  std::vector<int32_t> src, tok, expert; /* [N]; rank-major expert is [N, K] */
  std::vector<float> w;                  /* as expert */
  std::vector<int64_t> counts, offsets;
  std::vector<int64_t> recv_from;        /* rank-major rows from each source */
};

ref_layout_t ref_layout(const std::vector<routing_t> &all, int me, int El, int K, bool expert_major, int align) {
  ref_layout_t L;
  const int W = (int)all.size();
  L.recv_from.assign(W, 0);
  L.counts.assign(El, 0);
  L.offsets.assign(El + 1, 0);
  for (int s = 0; s < W; s++)
    for (int64_t t = 0; t < all[s].T; t++) {
      bool any = false;
      for (int k = 0; k < K; k++) {
        const int e = all[s].idx[t * K + k];
        if (e >= 0 && e / El == me) {
          any = true;
          L.counts[e - me * El]++;
        }
      }
      if (any) L.recv_from[s]++, L.pairs++;
    }
  if (!expert_major) {
    L.N = L.pairs;
    for (int s = 0; s < W; s++)
      for (int64_t t = 0; t < all[s].T; t++) {
        std::vector<int32_t> ex(K, -1);
        std::vector<float> ww(K, 0.0f);
        bool any = false;
        for (int k = 0; k < K; k++) {
          const int e = all[s].idx[t * K + k];
          if (e >= 0 && e / El == me) ex[k] = e, ww[k] = all[s].w[t * K + k], any = true;
        }
        if (!any) continue;
        L.src.push_back(s), L.tok.push_back((int32_t)t);
        L.expert.insert(L.expert.end(), ex.begin(), ex.end());
        L.w.insert(L.w.end(), ww.begin(), ww.end());
      }
    for (int e = 0; e < El; e++) L.offsets[e] = 0;
    L.offsets[El] = L.N;
    return L;
  }
  for (int e = 0; e < El; e++) {
    L.offsets[e] = L.N;
    for (int s = 0; s < W; s++)
      for (int64_t t = 0; t < all[s].T; t++)
        for (int k = 0; k < K; k++)
          if (all[s].idx[t * K + k] == me * El + e) {
            L.src.push_back(s), L.tok.push_back((int32_t)t), L.expert.push_back(me * El + e);
            L.w.push_back(all[s].w[t * K + k]);
          }
    const int64_t n = L.counts[e], padded = (n + align - 1) / align * align;
    for (int64_t i = n; i < padded; i++) L.src.push_back(-1), L.tok.push_back(-1), L.expert.push_back(-1), L.w.push_back(0.0f);
    L.N += padded;
  }
  L.offsets[El] = L.N;
  return L;
}

/* out[t] of this rank by the contract's loop, as dtype bits. */
std::vector<uint32_t> ref_combine(const routing_t &mine, int me, int W, int El, int K, int64_t H, bool rank_major,
                                  bool weighted, bool payload_partials, epx_dtype_t dt) {
  std::vector<uint32_t> out((size_t)(mine.T * H));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < mine.T; t++) {
    std::vector<float> acc((size_t)H), part((size_t)H);
    bool first = true;
    for (int r = 0; r < W; r++) {
      bool any = false;
      std::fill(part.begin(), part.end(), 0.0f);
      for (int k = 0; k < K; k++) {
        const int e = mine.idx[t * K + k];
        if (e < 0 || e / El != r) continue;
        if (rank_major) {
          if (!any)
            for (int64_t h = 0; h < H; h++) part[h] = part[h] + host_value(host_round(eo_val(me, t, 1000 + r, h), dt), dt);
        } else {
          const float wk = mine.w[t * K + k];
          for (int64_t h = 0; h < H; h++) {
            const float v = host_value(host_round(eo_val(me, t, e, h), dt), dt);
            const float term = weighted ? wk * v : v;
            part[h] = part[h] + term;
          }
        }
        any = true;
      }
      if (!any) continue;
      if (payload_partials && !rank_major)
        for (int64_t h = 0; h < H; h++) part[h] = host_value(host_round(part[h], dt), dt);
      for (int64_t h = 0; h < H; h++) acc[h] = first ? part[h] : acc[h] + part[h];
      first = false;
    }
    for (int64_t h = 0; h < H; h++) out[(size_t)(t * H + h)] = host_round(first ? 0.0f : acc[h], dt);
  }
  return out;
}

/* ---- results -------------------------------------------------------------------------- */

struct verdict_t {
  std::string what;
  bool pass;
};
std::vector<verdict_t> g_verdicts;
std::vector<std::string> g_timings;

void verdict(const std::string &what, bool local_pass) {
  int pass = local_pass, all = 0;
  MPI_Allreduce(&pass, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  g_verdicts.push_back({what, all != 0});
  if (!all && g_rank == 0) printf("CHECK FAILED: %s\n", what.c_str());
  fflush(stdout);
}

/* Waits for the device and every rank; a timed-out wait on any rank ends
 * the run (the fused state is failed, every later op would wait too). */
void sync_all() {
  CK(cudaDeviceSynchronize());
  int mine = g_fused && epx_fused_error(g_fused, nullptr, nullptr), any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any) {
    report_fused_error();
    if (g_rank == 0) printf("a fused wait timed out: stopping\nFAILED\n");
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
}

/* Median ms of `reps` back-to-back calls, the slowest rank's. */
double time_op(const std::function<void()> &op, int reps = 20) {
  for (int i = 0; i < 3; i++) op();
  sync_all();
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  CK(cudaEventRecord(ev[0]));
  for (int i = 0; i < reps; i++) {
    op();
    CK(cudaEventRecord(ev[i + 1]));
  }
  sync_all();
  CK(cudaGetLastError());
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; i++) CK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
  for (auto &e : ev) CK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  double med = ms[reps / 2], worst = 0;
  MPI_Allreduce(&med, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

/* ---- one shape ------------------------------------------------------------------------- */

struct shape_t {
  std::string name;
  epx_dtype_t dtype;
  int64_t H, maxT;
  int E, K;
  std::vector<int64_t> T; /* per rank */
  bool zipf, empty, timing;
  int align;
  bool bulk = false; /* senders through the bulk copy engine; rank-major only */
};

struct ctx_t {
  const shape_t *sh;
  epx_fused_t *f;
  ncclComm_t comm;
  int El;
  size_t row_bytes;
  std::vector<routing_t> all;
  int32_t *d_idx;
  float *d_w;
  void *x, *recv, *eo, *out;
  size_t recv_bytes, out_bytes;
};

template <typename F>
void by_dtype(epx_dtype_t dt, F f) {
  if (dt == EPX_FLOAT32) f(float());
  else if (dt == EPX_BFLOAT16) f(__nv_bfloat16());
  else f(__half());
}

struct dev_ref_t {
  int32_t *src = nullptr, *tok = nullptr, *expert = nullptr;
  float *w = nullptr;
  void upload(const ref_layout_t &L, bool expert_major) {
    const size_t n = L.src.size();
    CK(cudaMalloc(&src, n * 4 + 4));
    CK(cudaMalloc(&tok, n * 4 + 4));
    CK(cudaMalloc(&w, n * 4 + 4));
    CK(cudaMemcpy(src, L.src.data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(tok, L.tok.data(), n * 4, cudaMemcpyHostToDevice));
    if (expert_major) {
      CK(cudaMalloc(&expert, n * 4 + 4));
      CK(cudaMemcpy(expert, L.expert.data(), n * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(w, L.w.data(), n * 4, cudaMemcpyHostToDevice));
    }
  }
  ~dev_ref_t() {
    cudaFree(src);
    cudaFree(tok);
    cudaFree(expert);
    cudaFree(w);
  }
};

/* The plan's tables against the reference. */
bool check_tables(ctx_t &c, epx_fused_plan_t *plan, const ref_layout_t &L, bool expert_major) {
  epx_fused_plan_view_t v;
  epx_fused_plan_view(plan, &v);
  int64_t rows = -1;
  CK(cudaMemcpy(&rows, v.rows, 8, cudaMemcpyDeviceToHost));
  unsigned long long invalid = 0;
  CK(cudaMemcpy(&invalid, v.invalid, 8, cudaMemcpyDeviceToHost));
  if (rows != L.N || invalid != ~0ull) {
    fprintf(stderr, "rank %d: rows %lld (want %lld), invalid %llx\n", g_rank, (long long)rows, (long long)L.N, invalid);
    return false;
  }
  const size_t per = expert_major ? 1 : (size_t)c.sh->K;
  std::vector<int32_t> src(L.N), tok(L.N), ex(L.N * per);
  std::vector<float> w(L.N * per);
  CK(cudaMemcpy(src.data(), v.row_src_rank, L.N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(tok.data(), v.row_src_token, L.N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(ex.data(), v.row_expert, L.N * per * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(w.data(), v.row_w, L.N * per * 4, cudaMemcpyDeviceToHost));
  bool ok = src == L.src && tok == L.tok && ex == L.expert && memcmp(w.data(), L.w.data(), w.size() * 4) == 0;
  if (expert_major) {
    std::vector<int64_t> counts(c.El), offsets(c.El + 1);
    CK(cudaMemcpy(counts.data(), v.counts, c.El * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(offsets.data(), v.offsets, (c.El + 1) * 8, cudaMemcpyDeviceToHost));
    ok = ok && counts == L.counts && offsets == L.offsets;
  }
  if (!ok) fprintf(stderr, "rank %d: plan tables differ from the reference\n", g_rank);
  return ok;
}

bool check_recv(ctx_t &c, const void *rows, const ref_layout_t &L, const dev_ref_t &R, bool weighted) {
  unsigned long long *bad, h = 0;
  CK(cudaMalloc(&bad, 8));
  CK(cudaMemset(bad, 0, 8));
  by_dtype(c.sh->dtype, [&](auto tag) {
    using T = decltype(tag);
    check_rows_kernel<T><<<1024, 256>>>(static_cast<const T *>(rows), L.N, c.sh->H, R.src, R.tok,
                                        weighted ? R.w : nullptr, bad);
  });
  CK(cudaMemcpy(&h, bad, 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(bad));
  if (h) fprintf(stderr, "rank %d: %llu received elements wrong\n", g_rank, h);
  return h == 0;
}

bool check_out(ctx_t &c, bool rank_major, bool weighted, bool payload) {
  const int64_t T = c.sh->T[g_rank], H = c.sh->H;
  std::vector<uint32_t> want = ref_combine(c.all[g_rank], g_rank, g_W, c.El, c.sh->K, H, rank_major, weighted,
                                           payload, c.sh->dtype);
  std::vector<char> got((size_t)(T * H) * dsize(c.sh->dtype) + 1);
  CK(cudaMemcpy(got.data(), c.out, (size_t)(T * H) * dsize(c.sh->dtype), cudaMemcpyDeviceToHost));
  int64_t wrong = 0;
  for (int64_t i = 0; i < T * H; i++) {
    uint32_t b = 0;
    memcpy(&b, got.data() + (size_t)i * dsize(c.sh->dtype), dsize(c.sh->dtype));
    if (b != want[(size_t)i] && wrong++ < 3)
      fprintf(stderr, "rank %d: out[%lld][%lld] = %08x, want %08x\n", g_rank, (long long)(i / H), (long long)(i % H), b,
              want[(size_t)i]);
  }
  if (wrong) fprintf(stderr, "rank %d: %lld combine elements wrong\n", g_rank, (long long)wrong);
  return wrong == 0;
}



/* Expert outputs [N, H] from the reference tables. */
void fill_eo(ctx_t &c, const ref_layout_t &L, const dev_ref_t &R, bool expert_major) {
  by_dtype(c.sh->dtype, [&](auto tag) {
    using T = decltype(tag);
    fill_eo_kernel<T><<<1024, 256>>>(static_cast<T *>(c.eo), L.N, c.sh->H, R.src, R.tok,
                                     expert_major ? R.expert : nullptr, g_rank);
  });
  CK(cudaGetLastError());
}

void timing_line(const std::string &s) {
  g_timings.push_back(s);
  if (g_rank == 0) printf("%s\n", s.c_str());
  fflush(stdout);
}

/* Rank-major: tables, dispatch in place and copied out, combine in both
 * precisions; then the timings. */
void run_rank_major(ctx_t &c, const std::string &tag) {
  const shape_t &sh = *c.sh;
  epx_fused_plan_t *plan;
  EK(epx_fused_plan_create(c.f, EPX_LAYOUT_RANK_MAJOR, 1, 0, &plan));
  const ref_layout_t L = ref_layout(c.all, g_rank, c.El, sh.K, false, 1);
  dev_ref_t R;
  R.upload(L, false);
  void *window = epx_fused_recv_window(c.f);
  CK(epx_fused_layout_launch(c.f, plan, c.d_idx, c.d_w, sh.T[g_rank], sh.K, 0));
  sync_all();
  verdict(tag + " rank-major layout tables", check_tables(c, plan, L, false));
  CK(cudaMemset(window, 0xff, (size_t)L.N * c.row_bytes));
  sync_all();
  CK(epx_fused_dispatch_launch(c.f, plan, c.x, nullptr, 0, 24, 0, 0));
  sync_all();
  verdict(tag + " rank-major dispatch rows (window)", check_recv(c, window, L, R, false));
  CK(cudaMemset(c.recv, 0xff, (size_t)L.N * c.row_bytes));
  sync_all();
  CK(epx_fused_dispatch_launch(c.f, plan, c.x, c.recv, 0, 16, 0, 0));
  sync_all();
  verdict(tag + " rank-major dispatch rows (copied out)", check_recv(c, c.recv, L, R, false));
  fill_eo(c, L, R, false);
  for (int prec = 0; prec < 2; prec++) {
    CK(cudaMemset(c.out, 0xff, (size_t)sh.T[g_rank] * c.row_bytes));
    sync_all();
    CK(epx_fused_combine_launch(c.f, plan, c.eo, c.out, 0, (epx_combine_precision_t)prec, 24, 0, 0));
    sync_all();
    verdict(tag + " rank-major combine " + (prec ? "payload" : "float32") + " partials", check_out(c, true, false, prec == 1));
  }
  if (sh.timing) {
    double bytes = (double)L.N * (double)c.row_bytes, all_bytes = 0;
    MPI_Allreduce(&bytes, &all_bytes, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double per_gpu = all_bytes / g_W;
    const double remote = (double)(L.N - L.recv_from[g_rank]) * (double)c.row_bytes;
    char line[512];
    /* 64 and 132 (every SM) show the ceiling beside the budgets */
    for (int n : {8, 16, 24, 32, 64, 132}) {
      const double td = time_op([&] { CK(epx_fused_dispatch_launch(c.f, plan, c.x, nullptr, 0, n, 0, 0)); });
      const double tc = time_op([&] {
        CK(epx_fused_combine_launch(c.f, plan, c.eo, c.out, 0, EPX_COMBINE_PARTIALS_PAYLOAD, n, 0, 0));
      });
      snprintf(line, sizeof line, "TIME %s rank-major SMs=%2d dispatch %.3f ms (%.0f GB/s)  combine %.3f ms (%.0f GB/s)  floor %.3f ms",
               tag.c_str(), n, td, per_gpu / td / 1e6, tc, per_gpu / tc / 1e6, remote / 450e9 * 1e3);
      timing_line(line);
    }
    const double tcopy = time_op([&] { CK(epx_fused_dispatch_launch(c.f, plan, c.x, c.recv, 0, 24, 0, 0)); });
    const double tl = time_op([&] { CK(epx_fused_layout_launch(c.f, plan, c.d_idx, c.d_w, sh.T[g_rank], sh.K, 0)); });
    snprintf(line, sizeof line, "TIME %s rank-major SMs=24 dispatch copied out %.3f ms; layout (counts + records) %.1f us",
             tag.c_str(), tcopy, tl * 1e3);
    timing_line(line);
    for (int nr : {6, 8, 10, 12, 16})
      for (int n : {24, 32}) {
        const double tc = time_op([&] {
          CK(epx_fused_combine_launch(c.f, plan, c.eo, c.out, 0, EPX_COMBINE_PARTIALS_PAYLOAD, n, nr, 0));
        });
        snprintf(line, sizeof line, "TIME %s rank-major combine SMs=%d reducers=%d %.3f ms", tag.c_str(), n, nr, tc);
        timing_line(line);
      }
  }
  epx_fused_plan_destroy(plan, 0);
}

/* Expert-major: tables, dispatch weighted (in dispatch) and not, combine
 * weighted (in combine) and not, both precisions; then the timings. */
void run_expert_major(ctx_t &c, const std::string &tag) {
  const shape_t &sh = *c.sh;
  epx_fused_plan_t *plan;
  EK(epx_fused_plan_create(c.f, EPX_LAYOUT_EXPERT_MAJOR, sh.align, 0, &plan));
  const ref_layout_t L = ref_layout(c.all, g_rank, c.El, sh.K, true, sh.align);
  dev_ref_t R;
  R.upload(L, true);
  CK(epx_fused_layout_launch(c.f, plan, c.d_idx, c.d_w, sh.T[g_rank], sh.K, 0));
  sync_all();
  verdict(tag + " expert-major layout tables", check_tables(c, plan, L, true));
  for (int weighted = 0; weighted < 2; weighted++) {
    CK(cudaMemset(c.recv, 0xff, (size_t)L.N * c.row_bytes));
    sync_all();
    CK(epx_fused_dispatch_launch(c.f, plan, c.x, c.recv, weighted, 24, 0, 0));
    sync_all();
    verdict(tag + " expert-major dispatch rows" + (weighted ? " weighted" : ""), check_recv(c, c.recv, L, R, weighted));
  }
  fill_eo(c, L, R, true);
  for (int weighted = 0; weighted < 2; weighted++)
    for (int prec = 0; prec < 2; prec++) {
      CK(cudaMemset(c.out, 0xff, (size_t)sh.T[g_rank] * c.row_bytes));
      sync_all();
      CK(epx_fused_combine_launch(c.f, plan, c.eo, c.out, weighted, (epx_combine_precision_t)prec, 24, 0, 0));
      sync_all();
      verdict(tag + " expert-major combine " + (weighted ? "weighted " : "") + (prec ? "payload" : "float32") +
                  " partials", check_out(c, false, weighted == 1, prec == 1));
    }
  if (sh.timing) {
    char line[512];
    for (int n : {24, 32}) {
      const double td = time_op([&] { CK(epx_fused_dispatch_launch(c.f, plan, c.x, c.recv, 0, n, 0, 0)); });
      const double tc = time_op([&] {
        CK(epx_fused_combine_launch(c.f, plan, c.eo, c.out, 1, EPX_COMBINE_PARTIALS_PAYLOAD, n, 0, 0));
      });
      const double tc32 = time_op([&] {
        CK(epx_fused_combine_launch(c.f, plan, c.eo, c.out, 1, EPX_COMBINE_PARTIALS_FLOAT32, n, 0, 0));
      });
      const double tbd = time_op([&] {
        CK(epx_fused_dispatch_backward_launch(c.f, plan, c.eo, c.out, 0, EPX_COMBINE_PARTIALS_FLOAT32, n, 0));
      });
      const double tbc = time_op([&] { CK(epx_fused_combine_backward_launch(c.f, plan, c.x, c.recv, 1, n, 0)); });
      snprintf(line, sizeof line,
               "TIME %s expert-major SMs=%d dispatch %.3f ms  combine %.3f ms (float32 partials %.3f)  "
               "dispatch_backward %.3f  combine_backward %.3f  (N=%lld rows)",
               tag.c_str(), n, td, tc, tc32, tbd, tbc, (long long)L.N);
      timing_line(line);
    }
  }
  epx_fused_plan_destroy(plan, 0);
}

/* NCCL's grouped send/recv of the same per-rank rows (own rows included),
 * sent from a staging buffer as a host-API exchange would (eo is large
 * enough; its contents do not matter here). */
void run_nccl_baseline(ctx_t &c, const std::string &tag) {
  const ref_layout_t L = ref_layout(c.all, g_rank, c.El, c.sh->K, false, 1);
  std::vector<int64_t> send(g_W, 0);
  for (int d = 0; d < g_W; d++) send[d] = ref_layout(c.all, d, c.El, c.sh->K, false, 1).recv_from[g_rank];
  const double t = time_op([&] {
    NK(ncclGroupStart());
    int64_t so = 0, ro = 0;
    for (int d = 0; d < g_W; d++) {
      NK(ncclSend(static_cast<char *>(c.eo) + so * c.row_bytes, send[d] * c.row_bytes, ncclUint8, d, c.comm, 0));
      NK(ncclRecv(static_cast<char *>(c.recv) + ro * c.row_bytes, L.recv_from[d] * c.row_bytes, ncclUint8, d, c.comm, 0));
      so += send[d];
      ro += L.recv_from[d];
    }
    NK(ncclGroupEnd());
  });
  double bytes = (double)L.N * (double)c.row_bytes, all_bytes = 0;
  MPI_Allreduce(&bytes, &all_bytes, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  char line[256];
  snprintf(line, sizeof line, "TIME %s NCCL send/recv of the rank-major rows %.3f ms (%.0f GB/s)", tag.c_str(), t,
           all_bytes / g_W / t / 1e6);
  timing_line(line);
}

void run_shape(const shape_t &sh, ncclComm_t comm) {
  ctx_t c;
  c.sh = &sh;
  c.comm = comm;
  c.El = sh.E / g_W;
  c.row_bytes = (size_t)sh.H * dsize(sh.dtype);
  epx_fused_config_t cfg = {sh.dtype, sh.H, sh.E, sh.K, sh.maxT, 10.0, sh.bulk ? 1 : 0};
  EK(epx_fused_create(comm, &cfg, &c.f));
  g_fused = c.f;
  for (int r = 0; r < g_W; r++) c.all.push_back(make_routing(r, sh.T[r], sh.E, sh.K, sh.zipf, sh.empty, 1234 + sh.T[r]));
  const routing_t &mine = c.all[g_rank];
  const int64_t T = sh.T[g_rank], TK = std::max<int64_t>(T * sh.K, 1);
  CK(cudaMalloc(&c.d_idx, TK * 4));
  CK(cudaMalloc(&c.d_w, TK * 4));
  if (T) {
    CK(cudaMemcpy(c.d_idx, mine.idx.data(), T * sh.K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(c.d_w, mine.w.data(), T * sh.K * 4, cudaMemcpyHostToDevice));
  }
  const int64_t bound = g_W * sh.maxT * std::min(sh.K, c.El) + (int64_t)c.El * sh.align;
  c.recv_bytes = (size_t)bound * c.row_bytes;
  c.out_bytes = (size_t)std::max<int64_t>(sh.maxT, 1) * c.row_bytes;
  CK(cudaMalloc(&c.x, c.out_bytes));
  CK(cudaMalloc(&c.recv, c.recv_bytes));
  CK(cudaMalloc(&c.eo, c.recv_bytes));
  CK(cudaMalloc(&c.out, c.out_bytes));
  by_dtype(sh.dtype, [&](auto tag) { launch_fill_x<decltype(tag)>(c.x, T, sh.H, g_rank); });
  sync_all();
  run_rank_major(c, sh.name);
  if (!sh.bulk) run_expert_major(c, sh.name);
  if (sh.timing && !sh.bulk) run_nccl_baseline(c, sh.name);
  sync_all();
  int32_t peer;
  const char *phase;
  verdict(sh.name + " no wait timed out", !epx_fused_error(c.f, &peer, &phase));
  cudaFree(c.d_idx);
  cudaFree(c.d_w);
  cudaFree(c.x);
  cudaFree(c.recv);
  cudaFree(c.eo);
  cudaFree(c.out);
  g_fused = nullptr;
  EK(epx_fused_destroy(c.f));
}

/* The targets of issue 11 from the timing lines (rank-major, payload
 * partials, the best at <= 24 SMs). */
void print_targets() {
  if (g_rank != 0) return;
  struct target_t {
    const char *shape;
    double dispatch, combine;
  } targets[] = {{"bf16-T8192-uniform", 0.35, 0.40}, {"bf16-T4096-uniform", 0.19, 0.22}};
  for (const target_t &t : targets) {
    double bd = 1e9, bc = 1e9;
    const std::string bulk = std::string(t.shape) + "-bulk";
    for (const std::string &s : g_timings) {
      int n;
      double td, gd, tc, gc;
      char shape[64];
      if (sscanf(s.c_str(), "TIME %63s rank-major SMs=%d dispatch %lf ms (%lf GB/s)  combine %lf ms (%lf", shape, &n, &td,
                 &gd, &tc, &gc) == 6 &&
          (std::string(shape) == t.shape || shape == bulk) && n <= 24)
        bd = std::min(bd, td), bc = std::min(bc, tc);
    }
    printf("%-58s %s (%.3f ms, target %.2f)\n", (std::string("target dispatch ") + t.shape).c_str(),
           bd <= t.dispatch ? "MET" : "MISSED", bd, t.dispatch);
    printf("%-58s %s (%.3f ms, target %.2f)\n", (std::string("target combine ") + t.shape).c_str(),
           bc <= t.combine ? "MET" : "MISSED", bc, t.combine);
  }
}

}  // namespace

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_W);
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  CK(cudaSetDevice(g_rank % ndev));
  ncclUniqueId id;
  if (g_rank == 0) NK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t comm;
  NK(ncclCommInitRank(&comm, g_W, id, g_rank));
  const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  std::vector<shape_t> shapes;
  std::vector<int64_t> uneven(g_W, 1000), empty_rank(g_W, 600);
  uneven[0] = 777;
  empty_rank[g_W - 1] = 0;
  shapes.push_back({"f32-H520-E64-K6", EPX_FLOAT32, 520, 1000, 64, 6, uneven, false, true, false, 8});
  shapes.push_back({"f16-H264-E32-K4", EPX_FLOAT16, 264, 600, 32, 4, empty_rank, true, false, false, 4});
  if (!quick)
    for (int64_t T : {8192, 4096})
      for (bool zipf : {false, true})
        shapes.push_back({std::string("bf16-T") + std::to_string(T) + (zipf ? "-zipf" : "-uniform"), EPX_BFLOAT16,
                          7168, 8192, 256, 8, std::vector<int64_t>(g_W, T), zipf, false, true, 128});
  /* The bulk-copy senders last: an experiment that must not cost the rest. */
  if (!quick)
    for (int64_t T : {8192, 4096}) {
      shape_t sh = {std::string("bf16-T") + std::to_string(T) + "-uniform-bulk", EPX_BFLOAT16, 7168, 8192, 256, 8,
                    std::vector<int64_t>(g_W, T), false, false, true, 128};
      sh.bulk = true;
      shapes.push_back(sh);
    }
  size_t printed = 0;
  for (const shape_t &sh : shapes) {
    if (sh.bulk && printed == 0) {
      /* the table so far, in case the experiment ends the run */
      if (g_rank == 0)
        for (const verdict_t &v : g_verdicts) printf("%-58s %s\n", v.what.c_str(), v.pass ? "PASS" : "FAIL");
      printed = g_verdicts.size();
    }
    if (g_rank == 0) printf("== %s\n", sh.name.c_str());
    fflush(stdout);
    run_shape(sh, comm);
  }
  bool ok = true;
  if (g_rank == 0) {
    printf("\n%-58s %s\n", "check", "verdict");
    for (const verdict_t &v : g_verdicts) printf("%-58s %s\n", v.what.c_str(), v.pass ? "PASS" : "FAIL");
  }
  for (const verdict_t &v : g_verdicts) ok = ok && v.pass;
  print_targets();
  if (g_rank == 0) printf("%s\n", ok ? "OK" : "FAILED");
  NK(ncclCommDestroy(comm));
  MPI_Finalize();
  return ok ? 0 : 1;
}
