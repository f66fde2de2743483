/* FP8 dispatch beside bf16 on one H200 (one rank), shape C: T=4096 tokens,
 * H=7168, top-8 of 256 experts, expert-major. For each fp8 format: the
 * GPU's received bytes checked against the CPU backend's (pre-quantized and
 * quantized on the way), then timed with CUDA events (median of many calls,
 * inputs and outputs rotated over two sets, beyond the 60 MB L2):
 *   - epx_dispatch of the bf16 rows (the baseline),
 *   - epx_dispatch_fp8 of pre-quantized rows and scales,
 *   - epx_dispatch_quantize of the bf16 rows (quantized on the way),
 * with bytes moved (rows and scales read once per token, written once per
 * recv row) against a device-to-device copy, and GB/s as DeepEP's tests
 * count it (received tokens x their bytes: T_r x (H + scale bytes) here, one
 * rank receiving every routed token once). TARGET lines: fp8 <= 0.56x the
 * bf16 dispatch, >= 80% of copy bandwidth, quantize-on-dispatch within 10%
 * of the pre-quantized dispatch. (PyTorch's quantizer then epx's fp8
 * dispatch back to back is bench/gpu/bench_fp8_torch.py's to time.)
 *
 * First, the hardware's e4m3 conversion (cvt.rn.satfinite.e4m3x2.f32, which
 * the quantizing kernel uses) against core/fp8.h's epx_f32_to_e4m3 (the
 * CPU's) on every float32 bit pattern, both halves of the pair.
 *
 * Usage: bench_fp8   (prints CHECK / RESULT / TARGET lines; exit 1 on a
 * mismatch or a failed call). A format whose bytes differ is not timed,
 * unless EPX_BENCH_TIME_ON_MISMATCH=1 (a diagnosis tree that leaves some
 * bytes out on purpose: timed, and still exit 1). */
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "epx.h"

#include "bench_check.h"
#include "../../tests/util/buffer_config.h"
#include "core/fp8.h"

namespace {

constexpr int64_t T = 4096, H = 7168;
constexpr int32_t E = 256, K = 8;

/* Bits i and i with the sign flipped, as the pair (x, y) of one conversion. */
__global__ void cvt_compare(uint32_t high_byte, unsigned long long *mismatches, uint32_t *first) {
  const uint32_t i = (high_byte << 24) | (blockIdx.x * blockDim.x + threadIdx.x);
  const float a = __uint_as_float(i), b = __uint_as_float(i ^ 0x80000000u);
  const __nv_fp8x2_storage_t hw = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  if ((uint8_t)(hw & 0xffu) != epx_f32_to_e4m3(a) || (uint8_t)(hw >> 8) != epx_f32_to_e4m3(b))
    if (atomicAdd(mismatches, 1ull) == 0) first[0] = i;
}

/* Every float32 once: i below 2^31 and its negation. */
int check_conversion(cudaStream_t s) {
  unsigned long long *d_bad, bad = 0;
  uint32_t *d_first, first = 0;
  CK(cudaMalloc(&d_bad, sizeof bad));
  CK(cudaMalloc(&d_first, sizeof first));
  CK(cudaMemsetAsync(d_bad, 0, sizeof bad, s));
  for (uint32_t hi = 0; hi < 128; hi++) cvt_compare<<<(1u << 24) / 256, 256, 0, s>>>(hi, d_bad, d_first);
  CK(cudaGetLastError());
  CK(cudaMemcpyAsync(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpyAsync(&first, d_first, sizeof first, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaFree(d_bad));
  CK(cudaFree(d_first));
  printf("CHECK e4m3 conversion: hardware satfinite vs core/fp8.h on all 2^32 float32: mismatches=%llu", bad);
  if (bad) printf(" (first 0x%08x)", first);
  printf("\n");
  return bad != 0;
}

void *dev(size_t bytes) {
  void *p;
  CK(cudaMalloc(&p, bytes ? bytes : 16));
  return p;
}

void *dev_copy(const void *h, size_t bytes) {
  void *p = dev(bytes);
  CK(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice));
  return p;
}

double copy_gbps(cudaStream_t s) {
  double ms;
  const double gbps = bench_copy_gbps(s, &ms);
  printf("RESULT shape=- op=d2d_copy ms=%.4f GBps=%.0f (1 GiB, read + write)\n", ms, gbps);
  return gbps;
}

void target(const char *name, double value, double limit, bool at_least) {
  const bool met = at_least ? value >= limit : value <= limit;
  printf("TARGET %-52s %8.4f %s %.4f %s\n", name, value, at_least ? ">=" : "<=", limit, met ? "MET" : "MISSED");
}

const char *format_name(epx_fp8_format_t f) {
  return f == EPX_FP8_E4M3_F32_128 ? "e4m3_f32x128" : f == EPX_FP8_E4M3_UE8M0_128 ? "e4m3_ue8m0x128" : "mxfp8";
}

struct inputs_t {
  std::vector<int32_t> idx;
  std::vector<float> w;
  std::vector<uint16_t> x; /* bf16 bits */
  int64_t routed = 0;       /* tokens with a route */
};

inputs_t make_inputs() {
  inputs_t in;
  rng_t r{2024};
  in.idx.resize((size_t)(T * K));
  in.w.resize((size_t)(T * K));
  for (int64_t t = 0; t < T; t++) {
    for (int k = 0; k < K; k++) {
      int32_t e;
      bool dup;
      do {
        e = (int32_t)(r.next() % E);
        dup = false;
        for (int j = 0; j < k; j++) dup |= in.idx[(size_t)(t * K + j)] == e;
      } while (dup);
      in.idx[(size_t)(t * K + k)] = e;
      in.w[(size_t)(t * K + k)] = 1.0f / K;
    }
  }
  in.routed = T;
  in.x.resize((size_t)(T * H));
  for (auto &v : in.x) {
    float f = (float)(r.uniform() * 2.0 - 1.0) * ((r.next() & 15) == 0 ? 40.0f : 1.0f);
    uint32_t b;
    memcpy(&b, &f, 4);
    v = (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
  return in;
}

epx_buffer_config_t config_of(epx_device_t device, epx_fp8_format_t format) {
  epx_buffer_config_t c = tu_config(device, EPX_BFLOAT16, H, E, K, T);
  c.exchange = EPX_EXCHANGE_DEDUP;
  c.layout = EPX_LAYOUT_EXPERT_MAJOR;
  c.fp8_format = format;
  return c;
}

/* The CPU backend's received bytes (the oracle). */
void cpu_reference(epx_comm_t comm, epx_fp8_format_t format, const inputs_t &in, const std::vector<uint8_t> &xq,
                   const std::vector<uint8_t> &xs, std::vector<uint8_t> &q, std::vector<uint8_t> &s, int64_t *n) {
  epx_buffer_config_t c = config_of(EPX_DEVICE_CPU, format);
  epx_buffer_t b;
  epx_handle_t h;
  EK(epx_buffer_create(comm, &c, &b));
  epx_routing_t routing = {T, K, in.idx.data(), in.w.data(), nullptr, EPX_WEIGHTS_IN_COMBINE};
  EK(epx_dispatch_layout(b, &routing, nullptr, &h));
  EK(epx_handle_recv_rows(h, n));
  q.assign((size_t)(*n * H), 0);
  s.assign((size_t)(*n * (int64_t)xs.size() / T), 0);
  EK(epx_dispatch_fp8(b, h, xq.data(), xs.data(), q.data(), s.data(), *n));
  EK(epx_handle_release(h));
  EK(epx_buffer_destroy(b));
}

int bench_format(epx_comm_t comm, epx_fp8_format_t format, const inputs_t &in, double copy, cudaStream_t st) {
  const char *name = format_name(format);
  int64_t cols = 0;
  size_t entry = 0;
  EK(epx_fp8_scale_shape(format, H, &cols, &entry));
  const int64_t S = cols * (int64_t)entry;
  std::vector<uint8_t> xq((size_t)(T * H)), xs((size_t)(T * S)), want_q, want_s;
  EK(epx_quantize(format, EPX_BFLOAT16, T, H, in.x.data(), xq.data(), xs.data()));
  int64_t N = 0;
  cpu_reference(comm, format, in, xq, xs, want_q, want_s, &N);

  epx_buffer_config_t c = config_of(EPX_DEVICE_CUDA, format);
  c.stream = st;
  epx_buffer_t b;
  epx_handle_t h;
  EK(epx_buffer_create(comm, &c, &b));
  void *d_idx = dev_copy(in.idx.data(), in.idx.size() * 4), *d_w = dev_copy(in.w.data(), in.w.size() * 4);
  epx_routing_t routing = {T, K, static_cast<const int32_t *>(d_idx), static_cast<const float *>(d_w), nullptr,
                           EPX_WEIGHTS_IN_COMBINE};
  EK(epx_dispatch_layout(b, &routing, nullptr, &h));
  int64_t n = 0;
  EK(epx_handle_recv_rows(h, &n));
  /* Two sets of every tensor, rotated, so no call finds its inputs in L2. */
  void *x[2], *q_in[2], *s_in[2], *rx[2], *rq[2], *rs[2];
  for (int i = 0; i < 2; i++) {
    x[i] = dev_copy(in.x.data(), in.x.size() * 2);
    q_in[i] = dev_copy(xq.data(), xq.size());
    s_in[i] = dev_copy(xs.data(), xs.size());
    rx[i] = dev((size_t)(N * H * 2));
    rq[i] = dev((size_t)(N * H));
    rs[i] = dev((size_t)(N * S));
  }
  /* Checks: both fp8 dispatches give the CPU's bytes. */
  int failures = n != N;
  for (int quantize = 0; quantize < 2 && !failures; quantize++) {
    CK(cudaMemsetAsync(rq[0], 0xA5, (size_t)(N * H), st));
    CK(cudaMemsetAsync(rs[0], 0xA5, (size_t)(N * S), st));
    if (quantize) EK(epx_dispatch_quantize(b, h, x[0], rq[0], rs[0], N));
    else EK(epx_dispatch_fp8(b, h, q_in[0], s_in[0], rq[0], rs[0], N));
    std::vector<uint8_t> got_q((size_t)(N * H)), got_s((size_t)(N * S));
    CK(cudaMemcpyAsync(got_q.data(), rq[0], got_q.size(), cudaMemcpyDeviceToHost, st));
    CK(cudaMemcpyAsync(got_s.data(), rs[0], got_s.size(), cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
    int64_t bad = 0;
    for (int64_t r = 0; r < N; r++)
      bad += memcmp(&got_q[(size_t)(r * H)], &want_q[(size_t)(r * H)], (size_t)H) != 0 ||
             memcmp(&got_s[(size_t)(r * S)], &want_s[(size_t)(r * S)], (size_t)S) != 0;
    printf("CHECK format=%s %s rows=%lld rows_differing_from_cpu=%lld\n", name,
           quantize ? "quantize_on_dispatch" : "pre_quantized", (long long)N, (long long)bad);
    failures += bad != 0;
  }
  if (failures && !getenv("EPX_BENCH_TIME_ON_MISMATCH")) return failures;

  const int warm = 5, reps = 51;
  const double ms_bf16 = median_ms(st, warm, reps, [&](int i) { EK(epx_dispatch(b, h, x[i & 1], rx[i & 1], N)); });
  const double ms_fp8 = median_ms(st, warm, reps, [&](int i) {
    EK(epx_dispatch_fp8(b, h, q_in[i & 1], s_in[i & 1], rq[i & 1], rs[i & 1], N));
  });
  const double ms_quant = median_ms(st, warm, reps, [&](int i) {
    EK(epx_dispatch_quantize(b, h, x[i & 1], rq[i & 1], rs[i & 1], N));
  });
  const double bytes_bf16 = (double)(in.routed + N) * H * 2;
  const double bytes_fp8 = (double)(in.routed + N) * (H + S);
  const double bytes_quant = (double)in.routed * H * 2 + (double)N * (H + S);
  const double deepep_fp8 = (double)in.routed * (H + S), deepep_bf16 = (double)in.routed * H * 2;
  auto line = [&](const char *op, double ms, double bytes, double deepep) {
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    printf("RESULT shape=C format=%s op=%s ms=%.4f bytes=%.0f GBps=%.0f copy_fraction=%.3f deepep_GBps=%.0f\n", name,
           op, ms, bytes, gbps, gbps / copy, deepep / (ms * 1e-3) / 1e9);
  };
  line("dispatch_bf16", ms_bf16, bytes_bf16, deepep_bf16);
  line("dispatch_fp8", ms_fp8, bytes_fp8, deepep_fp8);
  line("dispatch_quantize", ms_quant, bytes_quant, deepep_fp8);
  char t[128];
  snprintf(t, sizeof t, "%s fp8 / bf16 dispatch time", name);
  target(t, ms_fp8 / ms_bf16, 0.56, false);
  snprintf(t, sizeof t, "%s fp8 dispatch copy fraction", name);
  target(t, bytes_fp8 / (ms_fp8 * 1e-3) / 1e9 / copy, 0.80, true);
  snprintf(t, sizeof t, "%s quantize-on-dispatch / pre-quantized time", name);
  target(t, ms_quant / ms_fp8, 1.10, false);

  for (int i = 0; i < 2; i++)
    for (void *p : {x[i], q_in[i], s_in[i], rx[i], rq[i], rs[i]}) CK(cudaFree(p));
  CK(cudaFree(d_idx));
  CK(cudaFree(d_w));
  EK(epx_handle_release(h));
  EK(epx_buffer_destroy(b));
  return failures;
}

}  // namespace

int main() {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int failures = check_conversion(st);
  const double copy = copy_gbps(st);
  const inputs_t in = make_inputs();
  epx_comm_t comm;
  EK(epx_comm_create_self(&comm));
  for (epx_fp8_format_t f : {EPX_FP8_E4M3_F32_128, EPX_FP8_E4M3_UE8M0_128, EPX_FP8_MXFP8})
    failures += bench_format(comm, f, in, copy, st);
  EK(epx_comm_destroy(comm));
  CK(cudaStreamDestroy(st));
  printf("bench_fp8: %s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
