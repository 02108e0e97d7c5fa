// Dynamic per-token FP8 (e4m3) quantization, rounded as pydaemon/quantization/fp8.py's torch
// quantize_per_token: shared by the standalone kernel (fp8_quant.cu) and the kernels that
// quantize their own output (RMSNorm, SiLU-and-multiply: layer_kernels.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

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

}  // namespace pagedd::cuda
