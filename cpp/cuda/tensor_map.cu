// Host side of tma_utils.cuh: the tensor map of a paged KV cache. The encoder is a driver
// function; cudart hands out its entry point, so nothing links libcuda directly.
#include <cudaTypedefs.h>

#include <atomic>

#include "tma_utils.cuh"

namespace pagedd::cuda {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> cached{nullptr};
  PFN_cuTensorMapEncodeTiled_v12000 fn = cached.load(std::memory_order_acquire);
  if (fn != nullptr) return fn;
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                       &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess)
    return nullptr;
  fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  cached.store(fn, std::memory_order_release);
  return fn;
}

}  // namespace

cudaError_t encode_kv_cache_tensor_map(CUtensorMap* map, const void* cache, int64_t num_blocks,
                                       int64_t block_stride, int64_t head_stride,
                                       int num_kv_heads, int block_size, int head_dim) {
  constexpr int64_t kElem = 2;  // fp16 / bf16
  if (num_blocks <= 0 || head_dim % 64 != 0 || (reinterpret_cast<uintptr_t>(cache) & 15) != 0 ||
      (block_stride * kElem) % 16 != 0 || (head_stride * kElem) % 16 != 0)
    return cudaErrorInvalidValue;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[4] = {(cuuint64_t)head_dim, (cuuint64_t)block_size,
                              (cuuint64_t)num_kv_heads, (cuuint64_t)num_blocks};
  // Bytes between consecutive tokens, kv heads and blocks (dimension 0 is contiguous).
  const cuuint64_t strides[3] = {(cuuint64_t)(head_dim * kElem),
                                 (cuuint64_t)(head_stride * kElem),
                                 (cuuint64_t)(block_stride * kElem)};
  const cuuint32_t box[4] = {64, (cuuint32_t)block_size, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  // The element type only sizes the copy (no conversion): 16-bit either way.
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(cache),
                            dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace pagedd::cuda
