// SiLU-and-multiply on the fused gate/up projection (layer_kernels.h): one block per token row.
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
template <typename T, int VEC, bool QUANT>
__global__ void __launch_bounds__(1024, 2)
    silu_and_mul_kernel(T* out, uint8_t* out_fp8, float* out_scale, const T* input,
                        int64_t out_stride, int64_t input_stride, int d) {
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(input + row * input_stride);
  const V* up = reinterpret_cast<const V*>(input + row * input_stride + d);
  auto product = [&](int i) {  // vector i of the output row, as T
    const V g = gate[i], u = up[i];
    V y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = to_float(g.v[j]);
      // torch: silu(gate) is stored in T, then multiplied by up in float32 and rounded.
      const float silu = round_to<T>(x / (1.0f + expf(-x)));
      y.v[j] = from_float<T>(silu * to_float(u.v[j]));
    }
    return y;
  };
  if constexpr (!QUANT) {
    V* o = reinterpret_cast<V*>(out + row * out_stride);
    for (int i = threadIdx.x; i < d / VEC; i += blockDim.x) o[i] = product(i);
  } else {
    quantize_row_fp8<T, VEC, 2>(product, d / VEC, out_fp8 + row * out_stride, out_scale + row);
  }
}

template <typename T>
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
    silu_and_mul_kernel<T, VEC, true><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d);
  else if (can_vec)
    silu_and_mul_kernel<T, VEC, false><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d);
  else if (quant)
    silu_and_mul_kernel<T, 1, true><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d);
  else
    silu_and_mul_kernel<T, 1, false><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, p.out_stride, p.input_stride, p.d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.d <= 0) return cudaErrorInvalidValue;
  if ((p.out_fp8 == nullptr) != (p.out_scale == nullptr)) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_typed<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedd::cuda
