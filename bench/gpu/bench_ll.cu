/* Low-latency decode on one GPU (issue 25, "Measure"): dispatch and combine
 * of T = 1, 32, 128 and 256 tokens (H = 7168, top-8 of 256 experts, bf16)
 * as CUDA-graph replays, the low-latency calls (config.low_latency = 1)
 * beside the normal path on the same routing (worst_case_sizing: its
 * dispatch includes epx_dispatch_layout, which it needs every step).
 *
 * Before timing, each T is checked: every expert's received rows, counts and
 * the combine (expert_out = recv_x) of the low-latency calls equal the
 * normal path's bit for bit.
 *
 * Timing: REPS bodies captured back to back in one graph (each a whole
 * step: dispatch, or dispatch then combine, and the handle's release), the
 * median of REPLAYS replays divided by REPS: device time per call, no host
 * launch. Combine is (dispatch + combine) - dispatch.
 *
 * Build and run (bench/gpu-check.sh does):
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Iinclude -Isrc bench/gpu/bench_ll.cu \
 *        -o bench_ll -Lbuild -lepx -Xlinker -rpath -Xlinker $PWD/build
 *   ./bench_ll
 * Output: a CHECK line per T, then the table (LL lines). Exit status 0 when
 * every check passed. */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "epx.h"

#include "bench_check.h"

namespace {

constexpr int kE = 256, kK = 8, kMaxT = 256, kReps = 20, kReplays = 30;
constexpr int64_t kH = 7168;

struct step {
  epx_buffer_t ll, normal;
  epx_routing_t routing;
  void *x, *recv, *recv_n, *out;
  int32_t *count;
  int64_t cap_n;
  bool combine;
};

cudaStream_t g_stream;

void body_ll(step &s) {
  epx_handle_t h;
  EK(epx_ll_dispatch(s.ll, &s.routing, NULL, s.x, s.recv, s.count, &h));
  if (s.combine) EK(epx_ll_combine(s.ll, h, s.recv, s.out));
  EK(epx_handle_release(h));
}

void body_normal(step &s) {
  epx_handle_t h;
  EK(epx_dispatch_layout(s.normal, &s.routing, NULL, &h));
  EK(epx_dispatch(s.normal, h, s.x, s.recv_n, s.cap_n));
  if (s.combine) EK(epx_combine(s.normal, h, s.recv_n, s.out));
  EK(epx_handle_release(h));
}

/* Device microseconds per body: REPS bodies in one graph, median replay. */
double time_graph(void (*body)(step &), step &s) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kReps; i++) body(s);
  CK(cudaStreamEndCapture(g_stream, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i <= kReplays; i++) {
    CK(cudaEventRecord(e0, g_stream));
    CK(cudaGraphLaunch(exec, g_stream));
    CK(cudaEventRecord(e1, g_stream));
    CK(cudaStreamSynchronize(g_stream));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (i > 0) ms.push_back(t); /* the first replay warms up */
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return ms[ms.size() / 2] * 1e3 / kReps;
}

/* The low-latency rows and combine against the normal path's; 0 when equal. */
int check(step &s, int T) {
  const size_t row = (size_t)kH * 2;
  epx_handle_t hl, hn;
  s.routing.num_tokens = T;
  EK(epx_ll_dispatch(s.ll, &s.routing, NULL, s.x, s.recv, s.count, &hl));
  EK(epx_ll_combine(s.ll, hl, s.recv, s.out));
  EK(epx_dispatch_layout(s.normal, &s.routing, NULL, &hn));
  EK(epx_dispatch(s.normal, hn, s.x, s.recv_n, s.cap_n));
  int64_t *d_counts, *d_offsets;
  CK(cudaMalloc(&d_counts, sizeof(int64_t) * kE));
  CK(cudaMalloc(&d_offsets, sizeof(int64_t) * (kE + 1)));
  EK(epx_handle_expert_counts(hn, d_counts, d_offsets));
  void *out_n;
  CK(cudaMalloc(&out_n, row * kMaxT));
  EK(epx_combine(s.normal, hn, s.recv_n, out_n));
  CK(cudaStreamSynchronize(g_stream));
  std::vector<int64_t> counts(kE), offsets(kE + 1);
  std::vector<int32_t> count(kE);
  std::vector<char> recv(row * kE * kMaxT), recv_n(row * s.cap_n), out(row * T), outn(row * T);
  CK(cudaMemcpy(counts.data(), d_counts, sizeof(int64_t) * kE, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(offsets.data(), d_offsets, sizeof(int64_t) * (kE + 1), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(count.data(), s.count, sizeof(int32_t) * kE, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(recv.data(), s.recv, recv.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(recv_n.data(), s.recv_n, recv_n.size(), cudaMemcpyDeviceToHost));
  if (T) CK(cudaMemcpy(out.data(), s.out, out.size(), cudaMemcpyDeviceToHost));
  if (T) CK(cudaMemcpy(outn.data(), out_n, outn.size(), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int e = 0; e < kE && !bad; e++) {
    bad = count[e] != counts[e];
    for (int64_t i = 0; i < counts[e] && !bad; i++)
      bad = memcmp(&recv[row * ((size_t)e * kMaxT + i)], &recv_n[row * (size_t)(offsets[e] + i)], row) != 0;
  }
  if (!bad) bad = memcmp(out.data(), outn.data(), out.size()) != 0;
  printf("CHECK T=%d low-latency rows, counts and combine == the normal path's: %s\n", T, bad ? "FAILED" : "OK");
  EK(epx_handle_release(hl));
  EK(epx_handle_release(hn));
  cudaFree(d_counts), cudaFree(d_offsets), cudaFree(out_n);
  return bad;
}

}  // namespace

int main() {
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  epx_comm_t comm;
  EK(epx_comm_create_self(&comm));
  epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
  c.device = EPX_DEVICE_CUDA, c.dtype = EPX_BFLOAT16, c.hidden = kH, c.num_experts = kE, c.max_top_k = kK;
  c.max_tokens_per_rank = kMaxT, c.stream = g_stream, c.exchange = EPX_EXCHANGE_DEDUP;
  step s = {};
  c.worst_case_sizing = 1;
  EK(epx_buffer_create(comm, &c, &s.normal));
  EK(epx_buffer_max_recv_rows(s.normal, &s.cap_n));
  c.worst_case_sizing = 0, c.low_latency = 1;
  EK(epx_buffer_create(comm, &c, &s.ll));

  /* Routing: top-8 of 256 distinct experts per token, weights summing to 1. */
  std::vector<int32_t> idx(kMaxT * kK);
  std::vector<float> w(kMaxT * kK);
  uint64_t rng = 0x2545F4914F6CDD1Dull;
  auto next = [&rng]() { rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; return rng; };
  for (int t = 0; t < kMaxT; t++) {
    std::vector<int32_t> perm(kE);
    for (int e = 0; e < kE; e++) perm[e] = e;
    for (int k = 0; k < kK; k++) std::swap(perm[k], perm[k + next() % (kE - k)]);
    for (int k = 0; k < kK; k++) idx[t * kK + k] = perm[k], w[t * kK + k] = 1.0f / kK;
  }
  std::vector<uint16_t> x(kMaxT * kH);
  for (auto &v : x) v = (uint16_t)(0x3c00 + next() % 0x0400); /* bf16 in [0.0078, 0.0156) */
  int32_t *d_idx;
  float *d_w;
  CK(cudaMalloc(&d_idx, idx.size() * 4));
  CK(cudaMalloc(&d_w, w.size() * 4));
  CK(cudaMemcpy(d_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&s.x, x.size() * 2));
  CK(cudaMemcpy(s.x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&s.recv, (size_t)kE * kMaxT * kH * 2));
  CK(cudaMalloc(&s.recv_n, (size_t)s.cap_n * kH * 2));
  CK(cudaMalloc(&s.out, (size_t)kMaxT * kH * 2));
  CK(cudaMalloc(&s.count, sizeof(int32_t) * kE));
  s.routing = epx_routing_t{kMaxT, kK, d_idx, d_w, NULL, EPX_WEIGHTS_IN_COMBINE};

  int bad = 0;
  printf("LL one H200-class GPU, H=%lld, top-%d of %d, bf16; us per call (CUDA-graph replay)\n", (long long)kH, kK,
         kE);
  printf("LL %5s %12s %12s %18s %16s\n", "T", "ll_dispatch", "ll_combine", "normal_dispatch*", "normal_combine");
  for (int T : {1, 32, 128, 256}) {
    bad |= check(s, T);
    s.routing.num_tokens = T;
    s.combine = false;
    const double ld = time_graph(body_ll, s), nd = time_graph(body_normal, s);
    s.combine = true;
    const double ldc = time_graph(body_ll, s), ndc = time_graph(body_normal, s);
    printf("LL %5d %12.1f %12.1f %18.1f %16.1f\n", T, ld, ldc - ld, nd, ndc - nd);
  }
  printf("LL (* the normal dispatch includes its epx_dispatch_layout)\n");
  EK(epx_buffer_destroy(s.ll));
  EK(epx_buffer_destroy(s.normal));
  EK(epx_comm_destroy(comm));
  printf("%s\n", bad ? "FAILED" : "OK");
  return bad;
}
