// Dynamic per-token FP8 (e4m3) quantization, rounded as pydaemon/quantization/fp8.py's torch
// quantize_per_token: shared by the standalone kernel (fp8_quant.cu) and the kernels that
// quantize their own output (RMSNorm, SiLU-and-multiply: layer_kernels.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "elementwise.cuh"

namespace pagedd::cuda {

constexpr float kFp8Max = 448.0f;
// The smallest amax used: an all-zero row gets a finite scale (torch path: FP8_MAX * 1e-12,
// a Python float rounded once to float32).
constexpr float kMinAmax = 4.48e-10f;

// x * inverse as the torch path rounds it: bf16 rows multiply in bf16 (the inverse rounded
// to bf16, the product rounded to bf16); fp16 and fp32 rows in float32.
template <typename T>
__device__ __forceinline__ float fp8_inverse_as(float inverse) {
  return inverse;
}
template <>
__device__ __forceinline__ float fp8_inverse_as<__nv_bfloat16>(float inverse) {
  return round_to<__nv_bfloat16>(inverse);
}

// The multiplier of a row whose largest |value| is amax. torch evaluates ``448 / amax`` as
// ``amax.reciprocal() * 448`` (Tensor.__rtruediv__): two roundings, reproduced here; a plain
// division would differ in the last bit now and then, and with it the scale and the codes of
// values next to a rounding midpoint. The row's scale is __frcp_rn(inverse) (1.0 / inverse).
template <typename T>
__device__ __forceinline__ float fp8_row_inverse(float amax) {
  return fp8_inverse_as<T>(__fmul_rn(__frcp_rn(fmaxf(amax, kMinAmax)), kFp8Max));
}

// e4m3 code of x (a value of a T row) times the row's inverse. |value| <= 448 up to one
// rounding: saturation never changes a finite result.
template <typename T>
__device__ __forceinline__ uint8_t fp8_code(float x, float inverse) {
  float y = x * inverse;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) y = round_to<__nv_bfloat16>(y);
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
}

// The e4m3 codes of one vector of a T row, two per conversion instruction where VEC allows
// (cvt of an f32 pair: the same rounding as two single conversions, half the instructions on
// a unit that runs at a quarter of the FMA rate).
template <typename T, int VEC>
__device__ __forceinline__ Vec<uint8_t, VEC> fp8_codes(const Vec<T, VEC>& y, float inverse) {
  Vec<uint8_t, VEC> q;
  if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      float a = to_float(y.v[j]) * inverse, b = to_float(y.v[j + 1]) * inverse;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        a = round_to<__nv_bfloat16>(a);
        b = round_to<__nv_bfloat16>(b);
      }
      const uint16_t pair = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
      q.v[j] = pair & 0xff, q.v[j + 1] = pair >> 8;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) q.v[j] = fp8_code<T>(to_float(y.v[j]), inverse);
  }
  return q;
}

// Quantizes one token row of num_vecs vectors, per token: the row's largest |value|, then its
// codes into out_row and 1 / inverse into *scale_out. value(i) returns vector i of the row as a
// Vec<T, VEC>. A thread's first CACHED vectors stay in registers between the two passes (a
// row of up to CACHED * blockDim.x vectors), so value(i) is called once per vector; vectors
// past them are recomputed (read again) in the second pass. Each cached vector costs
// 16 bytes of registers a thread, and these kernels are memory-bound: keep CACHED to the
// vectors a thread of the usual row holds (occupancy falls with every 32 registers).
// Every thread of the block calls it (block_max).
template <typename T, int VEC, int CACHED, typename ValueFn>
__device__ __forceinline__ void quantize_row_fp8(ValueFn value, int num_vecs, uint8_t* out_row,
                                                 float* scale_out) {
  static_assert(CACHED >= 1, "at least one cached vector a thread");
  using V = Vec<T, VEC>;
  V cached[CACHED];
  float amax = 0.0f;
  auto take_max = [&](const V& y) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_float(y.v[j])));
  };
#pragma unroll
  for (int c = 0; c < CACHED; ++c) {
    const int i = threadIdx.x + c * blockDim.x;
    if (i < num_vecs) {
      cached[c] = value(i);
      take_max(cached[c]);
    }
  }
  for (int i = threadIdx.x + CACHED * blockDim.x; i < num_vecs; i += blockDim.x) take_max(value(i));
  const float inverse = fp8_row_inverse<T>(block_max(amax));
  if (threadIdx.x == 0) *scale_out = __frcp_rn(inverse);  // 1.0 / inverse: a reciprocal too
  using O = Vec<uint8_t, VEC>;
  O* o = reinterpret_cast<O*>(out_row);
#pragma unroll
  for (int c = 0; c < CACHED; ++c) {
    const int i = threadIdx.x + c * blockDim.x;
    if (i < num_vecs) o[i] = fp8_codes<T, VEC>(cached[c], inverse);
  }
  for (int i = threadIdx.x + CACHED * blockDim.x; i < num_vecs; i += blockDim.x)
    o[i] = fp8_codes<T, VEC>(value(i), inverse);
}

}  // namespace pagedd::cuda
