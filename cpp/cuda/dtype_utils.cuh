// 16-byte vectors of 8 half / bfloat16 values <-> 8 floats; fp8 (e4m3) KV-cache conversions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

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

// ---- fp8 (e4m3) KV cache ----------------------------------------------------------------
// Every e4m3 value is exactly representable in fp16 and in bf16, so converting the cache to the
// compute dtype loses nothing; the per-layer scale is applied outside the inner loops.
using fp8_e4m3 = __nv_fp8_e4m3;

template <typename cache_t>
inline constexpr bool is_fp8_v = std::is_same_v<cache_t, fp8_e4m3>;

// The load unit of 8 cache elements: 16 bytes of fp16 / bf16, 8 bytes of fp8.
template <typename cache_t>
struct KVVec {
  using type = uint4;
};
template <>
struct KVVec<fp8_e4m3> {
  using type = uint2;
};

// Two e4m3 values (low byte first) -> two floats (one cvt.f16x2.e4m3x2 on sm_89+).
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t bits) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(bits, __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

template <typename scalar_t>
__device__ __forceinline__ void vec8_to_float(const uint2& v, float (&f)[8]) {
  static_assert(is_fp8_v<scalar_t>, "an 8-byte vector of 8 elements is fp8");
  const float2 a = fp8x2_to_float2(v.x & 0xffffu), b = fp8x2_to_float2(v.x >> 16);
  const float2 c = fp8x2_to_float2(v.y & 0xffffu), d = fp8x2_to_float2(v.y >> 16);
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y, f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
}

// Four floats -> four e4m3 bytes, round to nearest even, saturating to +-448 (NaN stays NaN).
__device__ __forceinline__ uint32_t float4_to_fp8x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// Two e4m3 values -> the 32-bit pair of scalar_t (fp16 / bf16) an mma fragment holds.
template <typename scalar_t>
__device__ __forceinline__ uint32_t fp8x2_to_pair(uint16_t bits) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(bits, __NV_E4M3);
  if constexpr (std::is_same_v<scalar_t, __half>) {
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  } else {
    const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(*reinterpret_cast<const __half2*>(&h)));
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// 16 e4m3 values (one 16-byte chunk) -> 16 scalar_t values (two 16-byte chunks).
template <typename scalar_t>
__device__ __forceinline__ void fp8x16_to_vec(const uint4& in, uint4& lo, uint4& hi) {
  lo.x = fp8x2_to_pair<scalar_t>(in.x & 0xffffu), lo.y = fp8x2_to_pair<scalar_t>(in.x >> 16);
  lo.z = fp8x2_to_pair<scalar_t>(in.y & 0xffffu), lo.w = fp8x2_to_pair<scalar_t>(in.y >> 16);
  hi.x = fp8x2_to_pair<scalar_t>(in.z & 0xffffu), hi.y = fp8x2_to_pair<scalar_t>(in.z >> 16);
  hi.z = fp8x2_to_pair<scalar_t>(in.w & 0xffffu), hi.w = fp8x2_to_pair<scalar_t>(in.w >> 16);
}

}  // namespace pagedd::cuda
