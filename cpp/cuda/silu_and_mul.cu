// SiLU-and-multiply on the fused gate/up projection (layer_kernels.h): one block per token row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

template <typename T, int VEC>
__global__ void silu_and_mul_kernel(T* out, const T* input, int64_t out_stride,
                                    int64_t input_stride, int d) {
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(input + row * input_stride);
  const V* up = reinterpret_cast<const V*>(input + row * input_stride + d);
  V* o = reinterpret_cast<V*>(out + row * out_stride);
  for (int i = threadIdx.x; i < d / VEC; i += blockDim.x) {
    const V g = gate[i], u = up[i];
    V y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = to_float(g.v[j]);
      // torch: silu(gate) is stored in T, then multiplied by up in float32 and rounded.
      const float silu = round_to<T>(x / (1.0f + expf(-x)));
      y.v[j] = from_float<T>(silu * to_float(u.v[j]));
    }
    o[i] = y;
  }
}

template <typename T>
cudaError_t launch_typed(const SiluAndMulParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  T* out = static_cast<T*>(p.out);
  const T* input = static_cast<const T*>(p.input);
  // The up half starts d elements into the row: d % VEC keeps it aligned too.
  const bool can_vec = p.d % VEC == 0 && p.out_stride % VEC == 0 && p.input_stride % VEC == 0 &&
                       is_aligned16(p.out) && is_aligned16(p.input);
  if (can_vec)
    silu_and_mul_kernel<T, VEC><<<p.num_tokens, threads_for(p.d / VEC), 0, stream>>>(
        out, input, p.out_stride, p.input_stride, p.d);
  else
    silu_and_mul_kernel<T, 1><<<p.num_tokens, threads_for(p.d), 0, stream>>>(
        out, input, p.out_stride, p.input_stride, p.d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream) {
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
