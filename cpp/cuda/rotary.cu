// Rotary position embedding applied to the query and key heads in place (layer_kernels.h):
// one block per token, one thread per (head, rotated pair) at a time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

// x[i], x[i + half] of one head -> the rotated pair, rounded as transformers' bf16/fp16 code:
// cos and sin are cast to T first; x * cos, rotate_half(x) * sin and their sum are each
// rounded to T (rotate_half(x) = cat(-x[half:], x[:half])).
template <typename T>
__device__ __forceinline__ void rotate_pair(T* x, int i, int half, float cos_lo, float sin_lo,
                                            float cos_hi, float sin_hi) {
  const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
  // __fmul_rn / __fadd_rn: no contraction into an FMA, which would skip torch's rounding of
  // the products (it matters in float32, where round_to is the identity).
  const float lo =
      __fadd_rn(round_to<T>(__fmul_rn(x1, cos_lo)), round_to<T>(__fmul_rn(-x2, sin_lo)));
  const float hi =
      __fadd_rn(round_to<T>(__fmul_rn(x2, cos_hi)), round_to<T>(__fmul_rn(x1, sin_hi)));
  x[i] = from_float<T>(lo);
  x[i + half] = from_float<T>(hi);
}

template <typename T>
__global__ void rotary_kernel(RotaryParams p) {
  const int64_t token = blockIdx.x;
  const int half = p.head_dim / 2;
  const float* cos = p.cos + token * p.cos_sin_stride;
  const float* sin = p.sin + token * p.cos_sin_stride;
  T* query = static_cast<T*>(p.query) + token * p.query_token_stride;
  T* key = static_cast<T*>(p.key) + token * p.key_token_stride;
  const int num_pairs = (p.num_heads + p.num_kv_heads) * half;
  for (int k = threadIdx.x; k < num_pairs; k += blockDim.x) {
    const int head = k / half, i = k % half;
    const float cos_lo = round_to<T>(cos[i]), cos_hi = round_to<T>(cos[i + half]);
    const float sin_lo = round_to<T>(sin[i]), sin_hi = round_to<T>(sin[i + half]);
    T* x = head < p.num_heads ? query + head * p.query_head_stride
                              : key + (head - p.num_heads) * p.key_head_stride;
    rotate_pair(x, i, half, cos_lo, sin_lo, cos_hi, sin_hi);
  }
}

template <typename T>
cudaError_t launch_typed(const RotaryParams& p, cudaStream_t stream) {
  const int num_pairs = (p.num_heads + p.num_kv_heads) * (p.head_dim / 2);
  rotary_kernel<T><<<p.num_tokens, threads_for(num_pairs < 256 ? num_pairs : 256), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rotary_embedding(const RotaryParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.num_heads <= 0 || p.num_kv_heads < 0 || p.head_dim <= 0 ||
      p.head_dim % 2 != 0)
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_typed<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedd::cuda
