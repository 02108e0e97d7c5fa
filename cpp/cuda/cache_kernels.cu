// KV-cache writes and block moves: reshape_and_cache, copy_blocks, swap_blocks.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "dtype_utils.cuh"
#include "pagedd_cuda.h"

namespace pagedd::cuda {

namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// One thread block per new token; threads stride over its num_kv_heads * head_dim elements in
// units of vec_t (16 bytes when every stride and pointer allows it).
template <typename vec_t>
__global__ void reshape_and_cache_kernel(const ReshapeAndCacheParams p, int vecs_per_head) {
  const int token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // padding token: nothing to store
  const int64_t block_id = slot / p.block_size, offset = slot % p.block_size;
  // Strides arrive in elements; convert them to vec_t units (the host checked divisibility).
  const int per = sizeof(vec_t) / p.elem_size;
  const vec_t* key = static_cast<const vec_t*>(p.key);
  const vec_t* value = static_cast<const vec_t*>(p.value);
  vec_t* key_cache = static_cast<vec_t*>(p.key_cache);
  vec_t* value_cache = static_cast<vec_t*>(p.value_cache);
  const int64_t cache_base = block_id * (p.cache_block_stride / per) + offset * vecs_per_head;
  for (int i = threadIdx.x; i < p.num_kv_heads * vecs_per_head; i += blockDim.x) {
    const int h = i / vecs_per_head, c = i % vecs_per_head;
    const int64_t dst = cache_base + h * (p.cache_head_stride / per) + c;
    key_cache[dst] = key[token * (p.key_token_stride / per) + h * (p.key_head_stride / per) + c];
    value_cache[dst] =
        value[token * (p.value_token_stride / per) + h * (p.value_head_stride / per) + c];
  }
}

// fp8 cache: one thread block per new token; a thread converts 8 elements at a time:
// saturate(x / scale) as e4m3, one 8-byte store. VEC: 16-byte loads of key / value (the host
// checked alignment), else element loads.
template <typename scalar_t, bool VEC>
__global__ void reshape_and_cache_fp8_kernel(const ReshapeAndCacheParams p) {
  const int token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // padding token: nothing to store
  const int64_t block_id = slot / p.block_size, offset = slot % p.block_size;
  const int vecs_per_head = p.head_dim / 8;
  const float inv_k = 1.f / p.k_scale, inv_v = 1.f / p.v_scale;
  const scalar_t* key = static_cast<const scalar_t*>(p.key);
  const scalar_t* value = static_cast<const scalar_t*>(p.value);
  uint8_t* key_cache = static_cast<uint8_t*>(p.key_cache);
  uint8_t* value_cache = static_cast<uint8_t*>(p.value_cache);
  auto load8 = [&](const scalar_t* src, float (&f)[8]) {
    if constexpr (VEC) {
      vec8_to_float<scalar_t>(*reinterpret_cast<const uint4*>(src), f);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = static_cast<float>(src[e]);
    }
  };
  auto store8 = [&](uint8_t* dst, const float (&f)[8], float inv) {
    uint2 q;
    q.x = float4_to_fp8x4(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv);
    q.y = float4_to_fp8x4(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv);
    *reinterpret_cast<uint2*>(dst) = q;
  };
  for (int i = threadIdx.x; i < p.num_kv_heads * vecs_per_head; i += blockDim.x) {
    const int h = i / vecs_per_head, c = (i % vecs_per_head) * 8;
    const int64_t dst =
        block_id * p.cache_block_stride + h * p.cache_head_stride + offset * p.head_dim + c;
    float f[8];
    load8(key + token * p.key_token_stride + h * p.key_head_stride + c, f);
    store8(key_cache + dst, f, inv_k);
    load8(value + token * p.value_token_stride + h * p.value_head_stride + c, f);
    store8(value_cache + dst, f, inv_v);
  }
}

template <typename scalar_t>
cudaError_t launch_reshape_and_cache_fp8(const ReshapeAndCacheParams& p, bool vec,
                                         cudaStream_t stream) {
  if (vec)
    reshape_and_cache_fp8_kernel<scalar_t, true><<<p.num_tokens, 128, 0, stream>>>(p);
  else
    reshape_and_cache_fp8_kernel<scalar_t, false><<<p.num_tokens, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename vec_t>
__global__ void copy_blocks_kernel(char* base, int64_t block_bytes,
                                   const int64_t* block_mapping) {
  const int64_t src = block_mapping[2 * blockIdx.x], dst = block_mapping[2 * blockIdx.x + 1];
  const vec_t* from = reinterpret_cast<const vec_t*>(base + src * block_bytes);
  vec_t* to = reinterpret_cast<vec_t*>(base + dst * block_bytes);
  const int64_t n = block_bytes / sizeof(vec_t);
  for (int64_t i = blockIdx.y * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.y * blockDim.x)
    to[i] = from[i];
}

}  // namespace

cudaError_t reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.elem_size <= 0 || p.block_size <= 0 || p.num_kv_heads <= 0)
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.cache_fp8) {
    // 8-byte stores into the cache; 16-byte loads of key / value where they line up.
    if (p.elem_size != 2 || p.head_dim % 8 != 0 || p.cache_block_stride % 8 != 0 ||
        p.cache_head_stride % 8 != 0 || reinterpret_cast<uintptr_t>(p.key_cache) % 8 != 0 ||
        reinterpret_cast<uintptr_t>(p.value_cache) % 8 != 0 || !(p.k_scale > 0.f) ||
        !(p.v_scale > 0.f))
      return cudaErrorInvalidValue;
    const bool vec = p.key_token_stride % 8 == 0 && p.key_head_stride % 8 == 0 &&
                     p.value_token_stride % 8 == 0 && p.value_head_stride % 8 == 0 &&
                     aligned16(p.key) && aligned16(p.value);
    if (p.dtype == DType::kFloat16) return launch_reshape_and_cache_fp8<__half>(p, vec, stream);
    if (p.dtype == DType::kBFloat16)
      return launch_reshape_and_cache_fp8<__nv_bfloat16>(p, vec, stream);
    return cudaErrorInvalidValue;
  }
  const int per16 = 16 / p.elem_size;
  const bool can_vec =
      16 % p.elem_size == 0 && p.head_dim % per16 == 0 && p.key_token_stride % per16 == 0 &&
      p.key_head_stride % per16 == 0 && p.value_token_stride % per16 == 0 &&
      p.value_head_stride % per16 == 0 && p.cache_block_stride % per16 == 0 &&
      p.cache_head_stride % per16 == 0 && aligned16(p.key) && aligned16(p.value) &&
      aligned16(p.key_cache) && aligned16(p.value_cache);
  if (can_vec) {
    reshape_and_cache_kernel<uint4><<<p.num_tokens, 128, 0, stream>>>(p, p.head_dim / per16);
  } else if (p.elem_size == 2) {
    reshape_and_cache_kernel<uint16_t><<<p.num_tokens, 128, 0, stream>>>(p, p.head_dim);
  } else if (p.elem_size == 4) {
    reshape_and_cache_kernel<uint32_t><<<p.num_tokens, 128, 0, stream>>>(p, p.head_dim);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(void* base, int64_t block_bytes, const int64_t* block_mapping,
                        int64_t num_pairs, cudaStream_t stream) {
  if (num_pairs < 0 || block_bytes <= 0 || num_pairs > 2147483647) return cudaErrorInvalidValue;
  if (num_pairs == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  char* b = static_cast<char*>(base);
  if (block_bytes % 16 == 0 && aligned16(base)) {
    const int64_t n = block_bytes / 16;
    const int chunks = (int)std::min<int64_t>((n + kThreads * 4 - 1) / (kThreads * 4), 1024);
    copy_blocks_kernel<uint4>
        <<<dim3((unsigned)num_pairs, chunks), kThreads, 0, stream>>>(b, block_bytes, block_mapping);
  } else {
    const int chunks = (int)std::min<int64_t>((block_bytes + kThreads * 4 - 1) / (kThreads * 4), 1024);
    copy_blocks_kernel<unsigned char>
        <<<dim3((unsigned)num_pairs, chunks), kThreads, 0, stream>>>(b, block_bytes, block_mapping);
  }
  return cudaGetLastError();
}

cudaError_t swap_blocks(void* dst, const void* src, int64_t block_bytes,
                        const int64_t* block_mapping_host, int64_t num_pairs,
                        cudaStream_t stream) {
  if (num_pairs < 0 || block_bytes <= 0) return cudaErrorInvalidValue;
  if (num_pairs == 0) return cudaSuccess;
  // Merge runs of consecutive (src, dst) pairs into one copy each.
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (int64_t i = 0; i < num_pairs;) {
    const int64_t s = block_mapping_host[2 * i], d = block_mapping_host[2 * i + 1];
    int64_t run = 1;
    while (i + run < num_pairs && block_mapping_host[2 * (i + run)] == s + run &&
           block_mapping_host[2 * (i + run) + 1] == d + run)
      ++run;
    dsts.push_back(static_cast<char*>(dst) + d * block_bytes);
    srcs.push_back(static_cast<const char*>(src) + s * block_bytes);
    sizes.push_back(static_cast<size_t>(run * block_bytes));
    i += run;
  }
#if CUDART_VERSION >= 13000  // 12.8 had a different signature (failIdx)
  // One batched call; it is not allowed on the legacy default stream.
  if (stream != nullptr && stream != cudaStreamLegacy && dsts.size() > 1) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
    cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(),
                                           &attr, &attr_idx, 1, stream);
    if (err == cudaSuccess) return cudaSuccess;
    (void)cudaGetLastError();  // unsupported here: clear it and fall back to single copies
  }
#endif
  for (size_t i = 0; i < dsts.size(); ++i) {
    const cudaError_t err =
        cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace pagedd::cuda
