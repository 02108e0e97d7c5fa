// 16-byte vectors of 8 half / bfloat16 values <-> 8 floats.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace pagedd::cuda {

template <typename scalar_t>
struct Convert;

template <>
struct Convert<__half> {
  static __device__ __forceinline__ float2 to_float2(uint32_t bits) {
    __half2 h = *reinterpret_cast<__half2*>(&bits);
    return __half22float2(h);
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float2 to_float2(uint32_t bits) {
    // bf16 -> fp32 is a shift: cheaper than the intrinsic on sm_80.
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

template <typename scalar_t>
__device__ __forceinline__ void vec8_to_float(const uint4& v, float (&f)[8]) {
  const float2 a = Convert<scalar_t>::to_float2(v.x);
  const float2 b = Convert<scalar_t>::to_float2(v.y);
  const float2 c = Convert<scalar_t>::to_float2(v.z);
  const float2 d = Convert<scalar_t>::to_float2(v.w);
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y, f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
}

}  // namespace pagedd::cuda
