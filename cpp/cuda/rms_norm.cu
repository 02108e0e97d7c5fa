// RMSNorm and residual-add + RMSNorm (layer_kernels.h): one thread block per token row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "fp8_quant.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

// Pass 1 reads the row (adding and storing the residual), pass 2 normalises it. Each thread
// touches the same vectors in both passes, so out may alias input: a row is fully read before
// the block_sum barrier, and each element is written only by the thread that read it.
// QUANT: the normalised row (rounded to T as above) is not stored but quantized per token to
// e4m3 (out_fp8, out_scale) exactly as per_token_fp8_quant would quantize it
// (quantize_row_fp8: the normalised values stay in registers between finding the row's largest
// |value| and storing the codes). out_stride then counts bytes of out_fp8.
// ROUND_ONCE: (x * inv_rms) * (weight + weight_offset) in float32, rounded once (gpt-oss, Gemma).
template <typename T, int VEC, bool HAS_RESIDUAL, bool QUANT, bool ROUND_ONCE>
__global__ void rms_norm_kernel(T* out, uint8_t* out_fp8, float* out_scale, const T* input,
                                T* residual, const T* weight, int64_t out_stride,
                                int64_t input_stride, int64_t residual_stride, int hidden_size,
                                float eps, float weight_offset) {
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const int num_vecs = hidden_size / VEC;
  const V* in = reinterpret_cast<const V*>(input + row * input_stride);
  V* res = HAS_RESIDUAL ? reinterpret_cast<V*>(residual + row * residual_stride) : nullptr;

  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    V x = in[i];
    if constexpr (HAS_RESIDUAL) {
      const V r = res[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) x.v[j] = from_float<T>(to_float(x.v[j]) + to_float(r.v[j]));
      res[i] = x;  // the sum, rounded to T, is also what gets normalised (as in torch)
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(x.v[j]);
      sum_sq += f * f;
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden_size + eps);

  const V* src = HAS_RESIDUAL ? res : in;
  const V* w = reinterpret_cast<const V*>(weight);
  auto normalised = [&](int i) {  // vector i of the output row, as T
    const V x = src[i], wv = w[i];
    V y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (ROUND_ONCE)
        y.v[j] = from_float<T>(to_float(x.v[j]) * inv_rms * (to_float(wv.v[j]) + weight_offset));
      else
        y.v[j] = from_float<T>(to_float(wv.v[j]) * round_to<T>(to_float(x.v[j]) * inv_rms));
    }
    return y;
  };
  if constexpr (!QUANT) {
    V* o = reinterpret_cast<V*>(out + row * out_stride);
    for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) o[i] = normalised(i);
  } else {
    quantize_row_fp8<T, VEC, 1>(normalised, num_vecs, out_fp8 + row * out_stride, out_scale + row);
  }
}

template <typename T, int VEC, bool QUANT, bool ROUND_ONCE>
void launch(const RMSNormParams& p, cudaStream_t stream) {
  const int threads = threads_for(p.hidden_size / VEC);
  T* out = static_cast<T*>(p.out);
  uint8_t* out_fp8 = static_cast<uint8_t*>(p.out_fp8);
  const T* input = static_cast<const T*>(p.input);
  T* residual = static_cast<T*>(p.residual);
  const T* weight = static_cast<const T*>(p.weight);
  if (residual != nullptr)
    rms_norm_kernel<T, VEC, true, QUANT, ROUND_ONCE><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, residual, weight, p.out_stride, p.input_stride,
        p.residual_stride, p.hidden_size, p.eps, p.weight_offset);
  else
    rms_norm_kernel<T, VEC, false, QUANT, ROUND_ONCE><<<p.num_tokens, threads, 0, stream>>>(
        out, out_fp8, p.out_scale, input, nullptr, weight, p.out_stride, p.input_stride, 0,
        p.hidden_size, p.eps, p.weight_offset);
}

template <typename T, int VEC>
void launch(const RMSNormParams& p, cudaStream_t stream) {
  if (p.out_fp8 != nullptr)
    p.round_once ? launch<T, VEC, true, true>(p, stream) : launch<T, VEC, true, false>(p, stream);
  else
    p.round_once ? launch<T, VEC, false, true>(p, stream)
                 : launch<T, VEC, false, false>(p, stream);
}

template <typename T>
cudaError_t launch_typed(const RMSNormParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const bool has_residual = p.residual != nullptr;
  const bool quant = p.out_fp8 != nullptr;
  const bool can_vec =
      p.hidden_size % VEC == 0 && p.out_stride % VEC == 0 && p.input_stride % VEC == 0 &&
      (!has_residual || p.residual_stride % VEC == 0) &&
      (quant ? reinterpret_cast<uintptr_t>(p.out_fp8) % VEC == 0 : is_aligned16(p.out)) &&
      is_aligned16(p.input) && (!has_residual || is_aligned16(p.residual)) &&
      is_aligned16(p.weight);
  if (can_vec)
    launch<T, VEC>(p, stream);
  else
    launch<T, 1>(p, stream);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(const RMSNormParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.hidden_size <= 0 || !(p.eps >= 0.0f)) return cudaErrorInvalidValue;
  if (p.weight_offset != 0.f && !p.round_once) return cudaErrorInvalidValue;
  if (p.residual != nullptr && p.residual == p.out) return cudaErrorInvalidValue;
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
