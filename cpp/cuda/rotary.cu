// Rotary position embedding applied to the query and key heads in place (layer_kernels.h):
// one block per token, one thread per (head, rotated pair) at a time. And the same rotation
// fused with the KV-cache write (rotary_embedding_and_cache): the rotated key and the value go
// straight into the paged cache, as reshape_and_cache would store them. A partial rotary
// embedding (rotary_dim < head_dim) rotates the first rotary_dim dims of each head; the key's
// other dims go to the cache as they are.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dtype_utils.cuh"
#include "elementwise.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

// The rotated pair (x1, x2) = (x[i], x[i + half]) of one head, rounded as transformers' bf16/fp16
// code: cos and sin arrive already cast to T, and x * cos, rotate_half(x) * sin and their sum
// are each rounded to T (rotate_half(x) = cat(-x[half:], x[:half])).
template <typename T>
__device__ __forceinline__ void rotate(float x1, float x2, float cos_lo, float sin_lo,
                                       float cos_hi, float sin_hi, T& lo, T& hi) {
  // __fmul_rn / __fadd_rn: no contraction into an FMA, which would skip torch's rounding of
  // the products (it matters in float32, where round_to is the identity).
  lo = from_float<T>(
      __fadd_rn(round_to<T>(__fmul_rn(x1, cos_lo)), round_to<T>(__fmul_rn(-x2, sin_lo))));
  hi = from_float<T>(
      __fadd_rn(round_to<T>(__fmul_rn(x2, cos_hi)), round_to<T>(__fmul_rn(x1, sin_hi))));
}

template <typename T>
__device__ __forceinline__ void rotate_pair(T* x, int i, int half, float cos_lo, float sin_lo,
                                            float cos_hi, float sin_hi) {
  rotate(to_float(x[i]), to_float(x[i + half]), cos_lo, sin_lo, cos_hi, sin_hi, x[i],
         x[i + half]);
}

template <typename T>
__global__ void rotary_kernel(RotaryParams p) {
  const int64_t token = blockIdx.x;
  const int half = p.rotary_dim / 2;
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
  const int num_pairs = (p.num_heads + p.num_kv_heads) * (p.rotary_dim / 2);
  rotary_kernel<T><<<p.num_tokens, threads_for(num_pairs < 256 ? num_pairs : 256), 0, stream>>>(p);
  return cudaGetLastError();
}


// ---- rotary embedding fused with the KV-cache write ------------------------------------------

// N elements of T converted to the cache type and stored: copied as they are (cache of T), or
// saturate(x * inv_scale) as e4m3 (fp8 cache), the numbers reshape_and_cache stores.
template <typename T, bool FP8, int N>
__device__ __forceinline__ void store_cache(void* cache, int64_t offset, const Vec<T, N>& x,
                                            float inv_scale) {
  if constexpr (!FP8) {
    *reinterpret_cast<Vec<T, N>*>(static_cast<T*>(cache) + offset) = x;
  } else if constexpr (N == 1) {
    static_cast<uint8_t*>(cache)[offset] = static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(to_float(x.v[0]) * inv_scale, __NV_SATFINITE, __NV_E4M3));
  } else {
    static_assert(N % 4 == 0, "fp8 stores go by 4 bytes");
    Vec<uint32_t, N / 4> q;
#pragma unroll
    for (int w = 0; w < N / 4; ++w)
      q.v[w] = float4_to_fp8x4(to_float(x.v[4 * w]) * inv_scale,
                               to_float(x.v[4 * w + 1]) * inv_scale,
                               to_float(x.v[4 * w + 2]) * inv_scale,
                               to_float(x.v[4 * w + 3]) * inv_scale);
    *reinterpret_cast<Vec<uint32_t, N / 4>*>(static_cast<uint8_t*>(cache) + offset) = q;
  }
}

// N floats from shared memory, by 16-byte loads where N allows (src is then 16-byte aligned:
// a multiple of N floats from the 16-byte aligned start); fewer bank conflicts than N loads.
template <int N>
__device__ __forceinline__ void load_shared(const float* src, float (&dst)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int w = 0; w < N / 4; ++w) {
      const float4 f = reinterpret_cast<const float4*>(src)[w];
      dst[4 * w] = f.x, dst[4 * w + 1] = f.y, dst[4 * w + 2] = f.z, dst[4 * w + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) dst[e] = src[e];
  }
}

// One block per token. The token's cos and sin, rounded to T, are staged in shared memory
// once (every head uses them). A thread rotates N consecutive pairs (x[i..i+N),
// x[half+i..half+i+N)) of one query or key head in place, loading and storing each side as
// one vector, and stores a key's rotated values straight into the cache; then the block
// copies the token's value heads. k never goes back to memory between rotation and cache write.
template <typename T, bool FP8, int N>
__global__ void rotary_cache_kernel(const RotaryCacheParams p) {
  extern __shared__ float4 cos_sin_smem[];  // [2 * rotary_dim] floats: cos, sin, rounded to T
  const RotaryParams& r = p.rotary;
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  const int half = r.rotary_dim / 2, vecs_per_half = half / N;
  float* cos = reinterpret_cast<float*>(cos_sin_smem);
  float* sin = cos + r.rotary_dim;
  for (int j = threadIdx.x; j < r.rotary_dim; j += blockDim.x) {
    cos[j] = round_to<T>(r.cos[token * r.cos_sin_stride + j]);
    sin[j] = round_to<T>(r.sin[token * r.cos_sin_stride + j]);
  }
  __syncthreads();
  T* query = static_cast<T*>(r.query) + token * r.query_token_stride;
  T* key = static_cast<T*>(r.key) + token * r.key_token_stride;
  // This token's row in the cache (elements; bytes for fp8); unused when slot < 0 (padding).
  const int64_t cache_row = slot < 0 ? 0
                                     : (slot / p.block_size) * p.cache_block_stride +
                                           (slot % p.block_size) * r.head_dim;
  // As reshape_and_cache: x * (1 / scale), the reciprocal rounded once.
  const float inv_k = 1.f / p.k_scale, inv_v = 1.f / p.v_scale;
  const int num_rotations = (r.num_heads + r.num_kv_heads) * vecs_per_half;
  for (int u = threadIdx.x; u < num_rotations; u += blockDim.x) {
    const int head = u / vecs_per_half, i = (u % vecs_per_half) * N;
    const bool is_key = head >= r.num_heads;
    const int kv_head = head - r.num_heads;
    T* x = is_key ? key + kv_head * r.key_head_stride : query + head * r.query_head_stride;
    Vec<T, N> lo = *reinterpret_cast<const Vec<T, N>*>(x + i);
    Vec<T, N> hi = *reinterpret_cast<const Vec<T, N>*>(x + i + half);
    float cos_lo[N], cos_hi[N], sin_lo[N], sin_hi[N];
    load_shared<N>(cos + i, cos_lo);
    load_shared<N>(cos + i + half, cos_hi);
    load_shared<N>(sin + i, sin_lo);
    load_shared<N>(sin + i + half, sin_hi);
#pragma unroll
    for (int e = 0; e < N; ++e)
      rotate(to_float(lo.v[e]), to_float(hi.v[e]), cos_lo[e], sin_lo[e], cos_hi[e], sin_hi[e],
             lo.v[e], hi.v[e]);
    *reinterpret_cast<Vec<T, N>*>(x + i) = lo;
    *reinterpret_cast<Vec<T, N>*>(x + i + half) = hi;
    if (is_key && slot >= 0) {
      const int64_t dst = cache_row + kv_head * p.cache_head_stride + i;
      store_cache<T, FP8, N>(p.key_cache, dst, lo, inv_k);
      store_cache<T, FP8, N>(p.key_cache, dst + half, hi, inv_k);
    }
  }
  if (slot < 0) return;  // padding token: rotated, nothing to store
  // Partial rotary: the key's dims past rotary_dim, as they are.
  const int pass_vecs = (r.head_dim - r.rotary_dim) / N;
  for (int u = threadIdx.x; u < r.num_kv_heads * pass_vecs; u += blockDim.x) {
    const int h = u / pass_vecs, c = r.rotary_dim + (u % pass_vecs) * N;
    const Vec<T, N> k = *reinterpret_cast<const Vec<T, N>*>(key + h * r.key_head_stride + c);
    store_cache<T, FP8, N>(p.key_cache, cache_row + h * p.cache_head_stride + c, k, inv_k);
  }
  const T* value = static_cast<const T*>(p.value) + token * p.value_token_stride;
  const int vecs_per_head = r.head_dim / N;
  for (int u = threadIdx.x; u < r.num_kv_heads * vecs_per_head; u += blockDim.x) {
    const int h = u / vecs_per_head, c = (u % vecs_per_head) * N;
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(value + h * p.value_head_stride + c);
    store_cache<T, FP8, N>(p.value_cache, cache_row + h * p.cache_head_stride + c, v, inv_v);
  }
}

template <typename T, bool FP8>
cudaError_t launch_rotary_cache(const RotaryCacheParams& p, cudaStream_t stream) {
  const RotaryParams& r = p.rotary;
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte access
  // 16-byte accesses need every row, head and block start of query / key / value and the
  // cache on a vector boundary (an fp8 cache takes 8-byte stores of 8 elements).
  const int64_t strides[] = {r.query_token_stride, r.query_head_stride,  r.key_token_stride,
                             r.key_head_stride,    p.value_token_stride, p.value_head_stride,
                             p.cache_block_stride, p.cache_head_stride};
  bool vec = (r.rotary_dim / 2) % kVec == 0 && (r.head_dim - r.rotary_dim) % kVec == 0 &&
             is_aligned16(r.query) && is_aligned16(r.key) && is_aligned16(p.value);
  for (int64_t s : strides) vec = vec && s % kVec == 0;
  if constexpr (FP8)
    vec = vec && reinterpret_cast<uintptr_t>(p.key_cache) % kVec == 0 &&
          reinterpret_cast<uintptr_t>(p.value_cache) % kVec == 0;
  else
    vec = vec && is_aligned16(p.key_cache) && is_aligned16(p.value_cache);
  const int n = vec ? kVec : 1;
  const int num_rotations = (r.num_heads + r.num_kv_heads) * (r.rotary_dim / 2 / n);
  const int num_copies = r.num_kv_heads * (r.head_dim / n);
  const int units = num_rotations > num_copies ? num_rotations : num_copies;
  const int threads = threads_for(units < 256 ? units : 256);
  const size_t smem = 2 * r.rotary_dim * sizeof(float);
  if (vec)
    rotary_cache_kernel<T, FP8, kVec><<<r.num_tokens, threads, smem, stream>>>(p);
  else
    rotary_cache_kernel<T, FP8, 1><<<r.num_tokens, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

namespace {
// rotary_dim 0 means head_dim; else even and at most head_dim.
bool resolve_rotary_dim(RotaryParams& r) {
  if (r.rotary_dim == 0) r.rotary_dim = r.head_dim;
  return r.rotary_dim > 0 && r.rotary_dim % 2 == 0 && r.rotary_dim <= r.head_dim;
}
}  // namespace

cudaError_t rotary_embedding(const RotaryParams& params, cudaStream_t stream) {
  RotaryParams p = params;
  if (p.num_tokens < 0 || p.num_heads <= 0 || p.num_kv_heads < 0 || p.head_dim <= 0 ||
      p.head_dim % 2 != 0 || !resolve_rotary_dim(p))
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_typed<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t rotary_embedding_and_cache(const RotaryCacheParams& params, cudaStream_t stream) {
  RotaryCacheParams p = params;
  const RotaryParams& r = p.rotary;
  if (r.num_tokens < 0 || r.num_heads <= 0 || r.num_kv_heads <= 0 || r.head_dim <= 0 ||
      r.head_dim % 2 != 0 || r.head_dim > kMaxRotaryCacheHeadDim || p.block_size <= 0 ||
      !resolve_rotary_dim(p.rotary))
    return cudaErrorInvalidValue;
  if (p.cache_fp8 && (r.dtype == DType::kFloat32 || !(p.k_scale > 0.f) || !(p.v_scale > 0.f)))
    return cudaErrorInvalidValue;
  if (r.num_tokens == 0) return cudaSuccess;
  switch (r.dtype) {
    case DType::kFloat16:
      return p.cache_fp8 ? launch_rotary_cache<__half, true>(p, stream)
                         : launch_rotary_cache<__half, false>(p, stream);
    case DType::kBFloat16:
      return p.cache_fp8 ? launch_rotary_cache<__nv_bfloat16, true>(p, stream)
                         : launch_rotary_cache<__nv_bfloat16, false>(p, stream);
    case DType::kFloat32:
      return launch_rotary_cache<float, false>(p, stream);
    default: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedd::cuda
