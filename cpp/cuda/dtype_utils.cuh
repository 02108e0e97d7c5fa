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

// e4m3 -> fp16 / bf16 / fp32 without the conversion instructions. cvt (F2F) runs at 16
// results per clock per SM, a quarter of the integer / FMA rate: converting an fp8 K/V tile
// with cvt bounds an attention kernel far below memory speed. Instead each byte's exponent and
// mantissa bits are moved into place with a byte permute, a mask and a shift: in fp16 (bias 15
// against e4m3's 7) the bits then read as the value times 2^-8, in bf16 / fp32 (bias 127) as
// the value times 2^-120, and one multiply by the power of two restores it. Exact for every
// code, subnormals included (the multiply is exact and keeps subnormal inputs: no ftz).
// (e4m3fn's NaN, S.1111.111, reads as +-480; a cache holds no NaN.)
//
// e4m3 bytes b0 (low) and b1 of `bits` -> b1 << 24 | b0 << 8: each byte at the top of a
// 16-bit half, sign bit on the half's sign bit.
__device__ __forceinline__ uint32_t fp8x2_spread(uint32_t bits, uint32_t selector) {
  return __byte_perm(bits, 0u, selector);
}
// Spread bytes (as above) -> the 16-bit pair with exponent and mantissa in place for a type
// whose exponent field starts SHIFT bits lower than e4m3's in the byte: 1 (fp16), 4 (bf16).
template <int SHIFT>
__device__ __forceinline__ uint32_t fp8x2_place(uint32_t t) {
  return (t & 0x80008000u) | ((t & 0x7F007F00u) >> SHIFT);
}

// Two e4m3 values (low byte first) -> two floats.
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t bits) {
  const uint32_t r = fp8x2_place<4>(fp8x2_spread(bits, 0x1404u));  // bf16 pair, value * 2^-120
  return make_float2(__uint_as_float(r << 16) * 0x1p120f,
                     __uint_as_float(r & 0xFFFF0000u) * 0x1p120f);
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

// Four e4m3 values (low byte first) -> two 32-bit pairs of scalar_t (fp16 / bf16), as an mma
// fragment holds them: bytes 0, 1 -> lo, bytes 2, 3 -> hi. The selectors pick other byte
// pairs for free (fp8x4_to_even_odd_pairs).
template <typename scalar_t, uint32_t SEL_LO = 0x1404u, uint32_t SEL_HI = 0x3424u>
__device__ __forceinline__ void fp8x4_to_pairs(uint32_t w, uint32_t& lo, uint32_t& hi) {
  constexpr bool HALF = std::is_same_v<scalar_t, __half>;
  constexpr int SHIFT = HALF ? 1 : 4;
  const uint32_t r0 = fp8x2_place<SHIFT>(fp8x2_spread(w, SEL_LO));
  const uint32_t r1 = fp8x2_place<SHIFT>(fp8x2_spread(w, SEL_HI));
  if constexpr (HALF) {
    const __half2 k = __halves2half2(__ushort_as_half(0x5C00), __ushort_as_half(0x5C00));  // 2^8
    const __half2 a = __hmul2(*reinterpret_cast<const __half2*>(&r0), k);
    const __half2 b = __hmul2(*reinterpret_cast<const __half2*>(&r1), k);
    lo = *reinterpret_cast<const uint32_t*>(&a), hi = *reinterpret_cast<const uint32_t*>(&b);
  } else {
    const __nv_bfloat162 k = __halves2bfloat162(__ushort_as_bfloat16(0x7B80),
                                                __ushort_as_bfloat16(0x7B80));  // 2^120
    const __nv_bfloat162 a = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&r0), k);
    const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&r1), k);
    lo = *reinterpret_cast<const uint32_t*>(&a), hi = *reinterpret_cast<const uint32_t*>(&b);
  }
}

// Bytes 0, 2 -> lo and bytes 1, 3 -> hi: what ldmatrix.trans of 16-bit elements leaves in a
// lane from an e4m3 tile of [key][dim] bytes (keys 2c, 2c+1 x dims 2g, 2g+1) becomes the B
// fragments of the even dim 2g (lo) and the odd dim 2g + 1 (hi), keys 2c and 2c+1 each.
template <typename scalar_t>
__device__ __forceinline__ void fp8x4_to_even_odd_pairs(uint32_t w, uint32_t& lo, uint32_t& hi) {
  fp8x4_to_pairs<scalar_t, 0x2404u, 0x3414u>(w, lo, hi);
}

// 16 e4m3 values (one 16-byte chunk) -> 16 scalar_t values (two 16-byte chunks).
template <typename scalar_t>
__device__ __forceinline__ void fp8x16_to_vec(const uint4& in, uint4& lo, uint4& hi) {
  fp8x4_to_pairs<scalar_t>(in.x, lo.x, lo.y);
  fp8x4_to_pairs<scalar_t>(in.y, lo.z, lo.w);
  fp8x4_to_pairs<scalar_t>(in.z, hi.x, hi.y);
  fp8x4_to_pairs<scalar_t>(in.w, hi.z, hi.w);
}

}  // namespace pagedd::cuda
