// Gated activations on the fused gate/up projection (layer_kernels.h: SiLU-and-multiply,
// Gemma's GeGLU with tanh GeLU, gpt-oss's clamped SwiGLU): one block per token row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "fp8_quant.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

// QUANT: the product (rounded to T) is not stored but quantized per token to e4m3 (out_fp8,
// out_scale) exactly as per_token_fp8_quant would quantize it (quantize_row_fp8: a thread's
// first 2 product vectors stay in registers between finding the row's largest |value| and
// storing the codes: Llama-3-8B's 14,336-wide rows whole); out_stride then counts bytes of
// out_fp8. Two blocks of 1024 threads per SM (32 registers; a few bytes spill): on the H200 a
// 4,096 x 14,336 call takes 127 us, as long as the bf16 kernel (124 us); recomputing the row
// took 240 us, one block per SM (49 registers) 158 us.
// One element of the activation, rounded to T where torch's expression rounds.
template <GatedActivation ACT, typename T>
__device__ __forceinline__ float gated(float x, float up, float alpha, float limit) {
  if constexpr (ACT == GatedActivation::kSilu) {
    // torch: silu(gate) is stored in T, then multiplied by up in float32 and rounded.
    return round_to<T>(x / (1.0f + expf(-x))) * up;
  } else if constexpr (ACT == GatedActivation::kGeluTanh) {
    // torch's gelu(approximate="tanh") in float32, rounded to T; then the product.
    constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi)
    const float inner = kBeta * (x + kKappa * x * x * x);
    return round_to<T>(0.5f * x * (1.f + tanhf(inner))) * up;
  } else {
    // transformers' GptOssExperts._apply_gate, op by op in T.
    const float g = fminf(x, limit);
    const float sig = round_to<T>(1.f / (1.f + expf(-round_to<T>(g * alpha))));
    const float glu = round_to<T>(g * sig);
    return round_to<T>(fminf(fmaxf(up, -limit), limit) + 1.f) * glu;
  }
}

template <typename T, int VEC, bool QUANT, GatedActivation ACT>
__global__ void __launch_bounds__(1024, 2)
    silu_and_mul_kernel(T* out, uint8_t* out_fp8, float* out_scale, const T* input,
                        int64_t out_stride, int64_t input_stride, int d, float alpha,
                        float limit) {
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(input + row * input_stride);
  const V* up = reinterpret_cast<const V*>(input + row * input_stride + d);
  auto product = [&](int i) {  // vector i of the output row, as T
    const V g = gate[i], u = up[i];
    V y;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      y.v[j] = from_float<T>(gated<ACT, T>(to_float(g.v[j]), to_float(u.v[j]), alpha, limit));
    return y;
  };
  if constexpr (!QUANT) {
    V* o = reinterpret_cast<V*>(out + row * out_stride);
    for (int i = threadIdx.x; i < d / VEC; i += blockDim.x) o[i] = product(i);
  } else {
    quantize_row_fp8<T, VEC, 2>(product, d / VEC, out_fp8 + row * out_stride, out_scale + row);
  }
}

template <typename T, GatedActivation ACT>
cudaError_t launch_typed(const SiluAndMulParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  T* out = static_cast<T*>(p.out);
  uint8_t* out_fp8 = static_cast<uint8_t*>(p.out_fp8);
  const T* input = static_cast<const T*>(p.input);
  const bool quant = out_fp8 != nullptr;
  // The up half starts d elements into the row: d % VEC keeps it aligned too.
  const bool can_vec = p.d % VEC == 0 && p.out_stride % VEC == 0 && p.input_stride % VEC == 0 &&
                       (quant ? reinterpret_cast<uintptr_t>(out_fp8) % VEC == 0
                              : is_aligned16(p.out)) &&
                       is_aligned16(p.input);
  const int threads = threads_for(can_vec ? p.d / VEC : p.d);
  if (can_vec && quant)
    silu_and_mul_kernel<T, VEC, true, ACT><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d, p.alpha, p.limit);
  else if (can_vec)
    silu_and_mul_kernel<T, VEC, false, ACT><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d, p.alpha, p.limit);
  else if (quant)
    silu_and_mul_kernel<T, 1, true, ACT><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d, p.alpha, p.limit);
  else
    silu_and_mul_kernel<T, 1, false, ACT><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d, p.alpha, p.limit);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_act(const SiluAndMulParams& p, cudaStream_t stream) {
  switch (p.activation) {
    case GatedActivation::kSilu: return launch_typed<T, GatedActivation::kSilu>(p, stream);
    case GatedActivation::kGeluTanh: return launch_typed<T, GatedActivation::kGeluTanh>(p, stream);
    case GatedActivation::kSwigluOai:
      return launch_typed<T, GatedActivation::kSwigluOai>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.d <= 0) return cudaErrorInvalidValue;
  if ((p.out_fp8 == nullptr) != (p.out_scale == nullptr)) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_act<__half>(p, stream);
    case DType::kBFloat16: return launch_act<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_act<float>(p, stream);
    default: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedd::cuda
