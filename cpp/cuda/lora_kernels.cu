// Batched LoRA (layer_kernels.h): Punica's BGMV "shrink" (x @ A[slot].T) and "expand"
// (y += xa @ B[slot]), each token reading its own adapter slot on the device.
//
// Decode reads a few adapters' weights for a handful of tokens: the kernels are latency-bound,
// so both spread one token's loads over many threads (each with a few 16-byte loads in flight
// at once) rather than looping in few threads. Above a few hundred tokens the dense GEMM path
// of pydaemon/layers/lora/punica_torch.py reads each slot once and wins; the caller chooses.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "elementwise.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

// Shrink: 16-byte vectors of in_features each thread loads (all in flight together), and the
// most threads of one (token, output) block. in_features 4096 (bf16): 128 threads; 14336: 448.
constexpr int kShrinkVecsPerThread = 4;
constexpr int kShrinkMaxThreads = 512;
// Expand: threads of a block, each owning 8 columns (16 bytes) of y. Small blocks spread a
// decode token's few hundred threads over more SMs (o_proj at 4096 columns: 8 blocks).
constexpr int kExpandThreads = 64;
constexpr int kMaxGridY = 65535;

struct PartStarts {  // passed by value: the kernel reads it from its parameter space
  int v[kMaxLoRAParts + 1];
};

// Slots outside [0, num_slots) (-1: no adapter) read nothing: a bad index cannot read out of
// bounds, and tokens of the base model cost no weight reads.
__device__ __forceinline__ bool has_adapter(int64_t slot, int num_slots) {
  return slot >= 0 && slot < num_slots;
}

// One block per (token t, output k): the block's threads split in_features, VEC elements a
// load, and block_sum adds their float32 partial dot products.
template <typename T, int VEC>
__global__ void __launch_bounds__(kShrinkMaxThreads)
    lora_shrink_kernel(float* __restrict__ xa, const T* __restrict__ x,
                       const T* __restrict__ lora_a, const int64_t* __restrict__ token_slots,
                       int64_t x_stride, int num_outputs, int in_features, int num_slots) {
  using V = Vec<T, VEC>;
  const int t = blockIdx.x, k = blockIdx.y;
  const int64_t slot = token_slots[t];
  float* out = xa + (int64_t)t * num_outputs + k;
  if (!has_adapter(slot, num_slots)) {  // uniform over the block: no thread reaches block_sum
    if (threadIdx.x == 0) *out = 0.0f;
    return;
  }
  const V* xv = reinterpret_cast<const V*>(x + t * x_stride);
  const V* av = reinterpret_cast<const V*>(lora_a + (slot * num_outputs + k) * in_features);
  const int num_vecs = in_features / VEC;
  float acc = 0.0f;
#pragma unroll 4
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    const V a = av[i], b = xv[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc = fmaf(to_float(b.v[j]), to_float(a.v[j]), acc);
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

// One thread per VEC consecutive columns c of token t's row (all in one part: the launcher
// takes VEC > 1 only when every part start is a multiple of VEC); B's rows are read
// coalesced, VEC elements a load, and y is rounded once after the float32 sum is added.
template <typename T, int VEC>
__global__ void __launch_bounds__(kExpandThreads)
    lora_expand_kernel(T* __restrict__ y, const float* __restrict__ xa,
                       const T* __restrict__ lora_b, const int64_t* __restrict__ token_slots,
                       int64_t y_stride, PartStarts part_starts, int num_parts, int rank,
                       int out_features, int num_slots) {
  using V = Vec<T, VEC>;
  const int t = blockIdx.x;
  const int64_t slot = token_slots[t];
  if (!has_adapter(slot, num_slots)) return;
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  if (c >= out_features) return;
  int part = 0;
#pragma unroll
  for (int j = 1; j < kMaxLoRAParts; ++j)
    if (j < num_parts && c >= part_starts.v[j]) part = j;
  const float* w = xa + ((int64_t)t * num_parts + part) * rank;  // this part's R values
  const T* b = lora_b + slot * rank * out_features + c;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
#pragma unroll 8
  for (int r = 0; r < rank; ++r) {
    const V bv = *reinterpret_cast<const V*>(b + (int64_t)r * out_features);
    const float wr = w[r];  // one address for the whole warp: a broadcast
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = fmaf(wr, to_float(bv.v[j]), acc[j]);
  }
  V* yp = reinterpret_cast<V*>(y + t * y_stride + c);
  V yv = *yp;
#pragma unroll
  for (int j = 0; j < VEC; ++j) yv.v[j] = from_float<T>(to_float(yv.v[j]) + acc[j]);
  *yp = yv;
}

int shrink_threads(int num_vecs) {
  const int per_warp = 32 * kShrinkVecsPerThread;
  const int warps = (num_vecs + per_warp - 1) / per_warp;
  return 32 * std::clamp(warps, 1, kShrinkMaxThreads / 32);
}

template <typename T>
cudaError_t launch_shrink(const LoRAShrinkParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  float* xa = p.xa;
  const T* x = static_cast<const T*>(p.x);
  const T* lora_a = static_cast<const T*>(p.lora_a);
  // Every row of x and of A starts 16-byte aligned when in_features and x's row stride are
  // multiples of VEC and the base addresses are aligned.
  const bool can_vec = p.in_features % VEC == 0 && p.x_stride % VEC == 0 && is_aligned16(x) &&
                       is_aligned16(lora_a);
  const int threads = shrink_threads(can_vec ? p.in_features / VEC : p.in_features);
  const dim3 grid(p.num_tokens, p.num_outputs);
  if (can_vec)
    lora_shrink_kernel<T, VEC><<<grid, threads, 0, stream>>>(
        xa, x, lora_a, p.token_slots, p.x_stride, p.num_outputs, p.in_features, p.num_slots);
  else
    lora_shrink_kernel<T, 1><<<grid, threads, 0, stream>>>(
        xa, x, lora_a, p.token_slots, p.x_stride, p.num_outputs, p.in_features, p.num_slots);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_expand(const LoRAExpandParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  T* y = static_cast<T*>(p.y);
  const T* lora_b = static_cast<const T*>(p.lora_b);
  PartStarts starts{};
  bool can_vec = p.out_features % VEC == 0 && p.y_stride % VEC == 0 && is_aligned16(y) &&
                 is_aligned16(lora_b);
  for (int j = 0; j <= p.num_parts; ++j) {
    starts.v[j] = p.part_starts[j];
    can_vec = can_vec && p.part_starts[j] % VEC == 0;  // a thread's VEC columns in one part
  }
  const int num_threads = can_vec ? p.out_features / VEC : p.out_features;
  const int threads = std::min(kExpandThreads, 32 * ((num_threads + 31) / 32));
  const int blocks_y = (num_threads + threads - 1) / threads;
  if (blocks_y > kMaxGridY) return cudaErrorInvalidValue;
  const dim3 grid(p.num_tokens, blocks_y);
  if (can_vec)
    lora_expand_kernel<T, VEC><<<grid, threads, 0, stream>>>(
        y, p.xa, lora_b, p.token_slots, p.y_stride, starts, p.num_parts, p.rank,
        p.out_features, p.num_slots);
  else
    lora_expand_kernel<T, 1><<<grid, threads, 0, stream>>>(
        y, p.xa, lora_b, p.token_slots, p.y_stride, starts, p.num_parts, p.rank,
        p.out_features, p.num_slots);
  return cudaGetLastError();
}

}  // namespace

cudaError_t lora_shrink(const LoRAShrinkParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.num_outputs <= 0 || p.num_outputs > kMaxGridY ||
      p.in_features <= 0 || p.num_slots <= 0 ||
      (p.num_tokens > 1 && p.x_stride < p.in_features))
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;  // a grid of 0 blocks is a launch error
  switch (p.dtype) {
    case DType::kFloat16: return launch_shrink<__half>(p, stream);
    case DType::kBFloat16: return launch_shrink<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t lora_expand(const LoRAExpandParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.out_features <= 0 || p.rank <= 0 || p.num_slots <= 0 ||
      p.num_parts < 1 || p.num_parts > kMaxLoRAParts ||
      (p.num_tokens > 1 && p.y_stride < p.out_features))
    return cudaErrorInvalidValue;
  if (p.part_starts[0] != 0 || p.part_starts[p.num_parts] != p.out_features)
    return cudaErrorInvalidValue;
  for (int j = 0; j < p.num_parts; ++j)
    if (p.part_starts[j + 1] <= p.part_starts[j]) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_expand<__half>(p, stream);
    case DType::kBFloat16: return launch_expand<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedd::cuda
