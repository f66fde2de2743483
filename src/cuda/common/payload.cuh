/* The payload format on the device (core/payload.h is the host side): the
 * element type of each payload dtype, its 16-byte vector as float32 values
 * and back (round to nearest even), and the one switch from a dtype to its
 * element type. A launcher that runs a kernel template over the element type
 * calls epx_payload_visit instead of switching itself, so a new format is a
 * new epx_vec specialisation and a new case here. */
#ifndef EPX_CUDA_COMMON_PAYLOAD_CUH
#define EPX_CUDA_COMMON_PAYLOAD_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/payload.h"

template <typename T>
struct epx_vec;

template <>
struct epx_vec<float> {
  static constexpr int n = 4;
  static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ uint4 pack(const float *f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

template <>
struct epx_vec<__nv_bfloat16> {
  static constexpr int n = 8;
  static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      /* bf16 -> f32 is a shift: exact */
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ uint4 pack(const float *f) {
    unsigned int w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<unsigned int *>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct epx_vec<__half> {
  static constexpr int n = 8;
  static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      __half2 h = *reinterpret_cast<const __half2 *>(&w[i]);
      float2 p = __half22float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float *f) {
    unsigned int w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<unsigned int *>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

/* A dtype's element type as a value: f(epx_payload_type<T>{}) names T as
 * typename decltype(tag)::type. */
template <typename T>
struct epx_payload_type {
  using type = T;
};

/* f(epx_payload_type<T>{}) for the element type T of `dtype` (its result),
 * cudaErrorInvalidValue for a value that is not a payload dtype. */
template <typename F>
static inline cudaError_t epx_payload_visit(epx_dtype_t dtype, F &&f) {
  switch (dtype) {
    case EPX_FLOAT32: return f(epx_payload_type<float>{});
    case EPX_BFLOAT16: return f(epx_payload_type<__nv_bfloat16>{});
    case EPX_FLOAT16: return f(epx_payload_type<__half>{});
  }
  return cudaErrorInvalidValue;
}

#endif
