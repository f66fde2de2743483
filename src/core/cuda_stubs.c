/* The CUDA backend's entry points in a build without CUDA: each refuses with
 * EPX_ERROR_UNSUPPORTED so a CUDA config fails clearly instead of linking
 * errors or silent CPU fallbacks. */
#include "core/error.h"
#include "cuda/cuda_backend.h"

#define EPX_NO_CUDA(fn)                                                                  \
  epx_error(EPX_ERROR_UNSUPPORTED, fn ": this build of epx has no CUDA backend; rebuild " \
                                      "with -DEPX_BUILD_CUDA=ON or use EPX_DEVICE_CPU")

int epx_has_cuda(void) { return 0; }

epx_status_t epx_cuda_route(const epx_route_config_t *c, int64_t t, const float *l,
                            const float *b, epx_route_output_t *o) {
  (void)c, (void)t, (void)l, (void)b, (void)o;
  return EPX_NO_CUDA("epx_route");
}
epx_status_t epx_cuda_route_backward(const epx_route_config_t *c, int64_t t, const float *l,
                                     const float *b, const int32_t *i, const float *g, float ga,
                                     float gz, float *gl) {
  (void)c, (void)t, (void)l, (void)b, (void)i, (void)g, (void)ga, (void)gz, (void)gl;
  return EPX_NO_CUDA("epx_route_backward");
}
epx_status_t epx_cuda_buffer_init(epx_buffer_t b) {
  (void)b;
  return EPX_NO_CUDA("epx_buffer_create");
}
void epx_cuda_buffer_fini(epx_buffer_t b) { (void)b; }
epx_status_t epx_cuda_dispatch_layout(epx_buffer_t b, const epx_routing_t *r, epx_handle_t h) {
  (void)b, (void)r, (void)h;
  return EPX_NO_CUDA("epx_dispatch_layout");
}
void epx_cuda_handle_fini(epx_handle_t h) { (void)h; }
epx_status_t epx_cuda_dispatch(epx_buffer_t b, epx_handle_t h, const void *x, void *r) {
  (void)b, (void)h, (void)x, (void)r;
  return EPX_NO_CUDA("epx_dispatch");
}
epx_status_t epx_cuda_combine(epx_buffer_t b, epx_handle_t h, const void *e, void *o) {
  (void)b, (void)h, (void)e, (void)o;
  return EPX_NO_CUDA("epx_combine");
}
epx_status_t epx_cuda_dispatch_backward(epx_buffer_t b, epx_handle_t h, const void *g, void *gx,
                                        const void *x, float *gw) {
  (void)b, (void)h, (void)g, (void)gx, (void)x, (void)gw;
  return EPX_NO_CUDA("epx_dispatch_backward");
}
epx_status_t epx_cuda_combine_backward(epx_buffer_t b, epx_handle_t h, const void *g,
                                       const void *e, void *ge, float *gw) {
  (void)b, (void)h, (void)g, (void)e, (void)ge, (void)gw;
  return EPX_NO_CUDA("epx_combine_backward");
}
epx_status_t epx_cuda_weights_backward(epx_buffer_t b, epx_handle_t h, const float *g, float *gw) {
  (void)b, (void)h, (void)g, (void)gw;
  return EPX_NO_CUDA("epx_weights_backward");
}
epx_status_t epx_cuda_handle_recv_rows(epx_handle_t h, int64_t *r) {
  (void)h, (void)r;
  return EPX_NO_CUDA("epx_handle_recv_rows");
}
epx_status_t epx_cuda_handle_recv_rows_device(epx_handle_t h, const int64_t **r) {
  (void)h, (void)r;
  return EPX_NO_CUDA("epx_handle_recv_rows_device");
}
epx_status_t epx_cuda_handle_expert_counts(epx_handle_t h, int64_t *c, int64_t *o) {
  (void)h, (void)c, (void)o;
  return EPX_NO_CUDA("epx_handle_expert_counts");
}
epx_status_t epx_cuda_handle_recv_routing(epx_handle_t h, int32_t *e, float *w) {
  (void)h, (void)e, (void)w;
  return EPX_NO_CUDA("epx_handle_recv_routing");
}
epx_status_t epx_cuda_handle_recv_source(epx_handle_t h, int32_t *r, int32_t *t) {
  (void)h, (void)r, (void)t;
  return EPX_NO_CUDA("epx_handle_recv_source");
}
