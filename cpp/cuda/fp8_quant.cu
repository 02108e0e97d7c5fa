// Dynamic per-token FP8 (e4m3) quantization of activations (layer_kernels.h): one block per
// token row, read once into registers (quantize_row_fp8) and written once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "fp8_quant.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

template <typename T, int VEC>
__global__ void per_token_fp8_quant_kernel(uint8_t* out, float* scale, const T* input,
                                           int64_t out_stride, int64_t input_stride, int d) {
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const V* in = reinterpret_cast<const V*>(input + row * input_stride);
  quantize_row_fp8<T, VEC, 1>([&](int i) { return in[i]; }, d / VEC, out + row * out_stride,
                           scale + row);
}

template <typename T>
cudaError_t launch_typed(const PerTokenFp8QuantParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  uint8_t* out = static_cast<uint8_t*>(p.out);
  const T* input = static_cast<const T*>(p.input);
  const bool can_vec = p.d % VEC == 0 && p.out_stride % VEC == 0 && p.input_stride % VEC == 0 &&
                       is_aligned16(p.input) && reinterpret_cast<uintptr_t>(out) % VEC == 0;
  if (can_vec)
    per_token_fp8_quant_kernel<T, VEC><<<p.num_tokens, threads_for(p.d / VEC), 0, stream>>>(
        out, p.scale, input, p.out_stride, p.input_stride, p.d);
  else
    per_token_fp8_quant_kernel<T, 1><<<p.num_tokens, threads_for(p.d), 0, stream>>>(
        out, p.scale, input, p.out_stride, p.input_stride, p.d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t per_token_fp8_quant(const PerTokenFp8QuantParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.d <= 0) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_typed<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedd::cuda
