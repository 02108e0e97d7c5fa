// Building blocks of the per-token layer kernels: float32 <-> storage type, 16-byte vectors,
// block-wide sum and max, and the choice between the vector path and the scalar path.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pagedd::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Rounds a float32 value to T and back: the rounding torch applies when it stores a result.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// N consecutive elements loaded or stored as one access (16 bytes when N = 16 / sizeof(T)).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// op-reduction of v over the block; every thread gets it. ``identity`` fills the lanes of
// warps that do not exist. blockDim.x must be a multiple of 32 (at most 1024) and every
// thread of the block must call it, once per kernel.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, Op op, float identity) {
  __shared__ float warp_results[32];
  __shared__ float total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_reduce(v, op);
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float r = lane < (int)(blockDim.x / 32) ? warp_results[lane] : identity;
    r = warp_reduce(r, op);
    if (lane == 0) total = r;
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp{}); }
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, SumOp{}, 0.0f); }
// For values >= 0 (absolute values): absent lanes count as 0.
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, MaxOp{}, 0.0f); }

inline bool is_aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Threads for one row of num_vecs vectors: one vector each up to 1024 threads, a multiple of 32.
inline int threads_for(int num_vecs) {
  const int warps = (num_vecs + 31) / 32;
  return 32 * (warps < 1 ? 1 : warps > 32 ? 32 : warps);
}

}  // namespace pagedd::cuda
