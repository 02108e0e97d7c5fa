// Mixture-of-experts kernels: top-k routing, moe_align, weighted combine (moe_kernels.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>

#include <cfloat>
#include <cstdint>

#include "dtype_utils.cuh"
#include "moe_kernels.h"

namespace pagedd::cuda {
namespace {

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else if constexpr (std::is_same_v<T, __half>)
    return __half2float(x);
  else
    return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return Convert<T>::from_float(x);
}

// ---- top-k routing: one warp per token --------------------------------------------------
constexpr int kRouteWarps = 4;

// (value, index) a beats (value, index) b: larger value, or equal value and lower index.
__device__ __forceinline__ bool beats(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

template <typename T>
__global__ void topk_route_kernel(TopkRouteParams p) {
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x * kRouteWarps + threadIdx.x / 32;
  if (token >= p.num_tokens) return;
  const T* logits = static_cast<const T*>(p.logits) + token * p.logits_stride;
  const int E = p.num_experts, K = p.top_k;

  float row_max = -FLT_MAX;
  for (int e = lane; e < E; e += 32) row_max = fmaxf(row_max, to_float(logits[e]));
  for (int o = 16; o > 0; o /= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, o));
  float denom = 1.f;
  if (p.softmax && !p.renormalize) {
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) sum += expf(to_float(logits[e]) - row_max);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    denom = sum;
  }

  int chosen[kMoeMaxTopK];
  float score[kMoeMaxTopK];
  float chosen_sum = 0.f;
  for (int j = 0; j < K; ++j) {
    // Sentinel (-inf, E): every expert beats it, so a valid id comes out even for -inf or
    // NaN logits (a NaN counts as -inf).
    float best_v = -INFINITY;
    int best_i = E;
    for (int e = lane; e < E; e += 32) {
      bool taken = false;
      for (int c = 0; c < j; ++c) taken |= chosen[c] == e;
      float v = to_float(logits[e]);
      if (isnan(v)) v = -INFINITY;
      if (!taken && beats(v, e, best_v, best_i)) best_v = v, best_i = e;
    }
    for (int o = 16; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (beats(ov, oi, best_v, best_i)) best_v = ov, best_i = oi;
    }
    chosen[j] = best_i;
    // Scores are monotonic in the logit: the top-k logits are the top-k scores.
    const float s = p.softmax ? expf(best_v - row_max) : 1.f / (1.f + expf(-best_v));
    score[j] = s;
    chosen_sum += s;
  }
  if (lane == 0) {
    const float norm = p.renormalize ? chosen_sum : denom;
    for (int j = 0; j < K; ++j) {
      p.topk_ids[(int64_t)token * K + j] = chosen[j];
      p.topk_weights[(int64_t)token * K + j] = score[j] / norm;
    }
  }
}

// ---- moe_align: one block ---------------------------------------------------------------
constexpr int kAlignThreads = 1024;

__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(MoeAlignParams p) {
  using BlockScan = cub::BlockScan<int, kAlignThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int count[kMoeMaxExperts];
  const int tid = threadIdx.x;
  const int num_slots = p.num_tokens * p.top_k;
  for (int e = tid; e < p.num_experts; e += kAlignThreads) count[e] = 0;
  __syncthreads();
  // Ids are in [0, num_experts) (the router's); clamped so that a bad one cannot write
  // outside the counters.
  const int last = p.num_experts - 1;
  for (int s = tid; s < num_slots; s += kAlignThreads)
    atomicAdd(&count[min(max(p.topk_ids[s], 0), last)], 1);
  __syncthreads();
  // kMoeMaxExperts == kAlignThreads: one expert per thread.
  const int c = tid < p.num_experts ? count[tid] : 0;
  int start;
  BlockScan(scan_storage).ExclusiveSum(c, start);
  __syncthreads();
  if (tid < p.num_experts) {
    p.expert_offsets[tid] = start + c;
    count[tid] = start;  // now the next free row of the expert
  }
  __syncthreads();
  for (int s = tid; s < num_slots; s += kAlignThreads) {
    const int row = atomicAdd(&count[min(max(p.topk_ids[s], 0), last)], 1);
    p.sorted_token_ids[row] = s / p.top_k;
    p.inverse[s] = row;
  }
}
static_assert(kMoeMaxExperts == kAlignThreads, "moe_align scans one expert per thread");

// ---- combine: one block per token -------------------------------------------------------
constexpr int kCombineThreads = 256;

template <typename T>
__global__ void moe_combine_kernel(MoeCombineParams p) {
  const int t = blockIdx.x;
  const T* y = static_cast<const T*>(p.expert_out);
  T* out = static_cast<T*>(p.out) + (int64_t)t * p.out_stride;
  const int K = p.top_k;
  const float* w = p.topk_weights + (int64_t)t * K;
  const int32_t* rows = p.inverse + (int64_t)t * K;
  constexpr bool kVec = !std::is_same_v<T, float>;
  const bool vec = kVec && p.hidden % 8 == 0 && p.expert_out_stride % 8 == 0 &&
                   p.out_stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(p.expert_out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  if constexpr (kVec) {
    if (vec) {
      for (int h = threadIdx.x * 8; h < p.hidden; h += kCombineThreads * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < K; ++j) {
          const uint4 v =
              *reinterpret_cast<const uint4*>(y + (int64_t)rows[j] * p.expert_out_stride + h);
          float f[8];
          vec8_to_float<T>(v, f);
          const float wj = w[j];
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += wj * f[i];
        }
        alignas(16) T o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = from_float<T>(acc[i]);
        *reinterpret_cast<uint4*>(out + h) = *reinterpret_cast<const uint4*>(o);
      }
      return;
    }
  }
  for (int h = threadIdx.x; h < p.hidden; h += kCombineThreads) {
    float acc = 0.f;
    for (int j = 0; j < K; ++j) acc += w[j] * to_float(y[(int64_t)rows[j] * p.expert_out_stride + h]);
    out[h] = from_float<T>(acc);
  }
}

template <template <typename> class Launch, typename... Args>
cudaError_t dispatch(DType dtype, Args&&... args) {
  switch (dtype) {
    case DType::kFloat16: return Launch<__half>::run(args...);
    case DType::kBFloat16: return Launch<__nv_bfloat16>::run(args...);
    case DType::kFloat32: return Launch<float>::run(args...);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
struct RouteLaunch {
  static cudaError_t run(const TopkRouteParams& p, cudaStream_t stream) {
    const int blocks = (p.num_tokens + kRouteWarps - 1) / kRouteWarps;
    topk_route_kernel<T><<<blocks, kRouteWarps * 32, 0, stream>>>(p);
    return cudaGetLastError();
  }
};

template <typename T>
struct CombineLaunch {
  static cudaError_t run(const MoeCombineParams& p, cudaStream_t stream) {
    moe_combine_kernel<T><<<p.num_tokens, kCombineThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t topk_route(const TopkRouteParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.num_experts < 1 || p.num_experts > kMoeMaxExperts || p.top_k < 1 ||
      p.top_k > kMoeMaxTopK || p.top_k > p.num_experts)
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  return dispatch<RouteLaunch>(p.dtype, p, stream);
}

cudaError_t moe_align(const MoeAlignParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.top_k < 1 || p.num_experts < 1 || p.num_experts > kMoeMaxExperts ||
      (int64_t)p.num_tokens * p.top_k > INT32_MAX)
    return cudaErrorInvalidValue;
  moe_align_kernel<<<1, kAlignThreads, 0, stream>>>(p);  // also for 0 tokens: zero offsets
  return cudaGetLastError();
}

cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.top_k < 1 || p.hidden < 1) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  return dispatch<CombineLaunch>(p.dtype, p, stream);
}

}  // namespace pagedd::cuda
