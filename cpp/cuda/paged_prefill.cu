// Entry point of the paged prefill kernels: argument checks, backend and head-size dispatch.
#include <atomic>

#include "pagedd_cuda.h"

namespace pagedd::cuda {

template <int HEAD_DIM>
cudaError_t launch_paged_prefill(const PagedPrefillParams& p, cudaStream_t stream);
#if defined(PAGEDD_HAVE_SM90_PREFILL)
template <int HEAD_DIM>
cudaError_t launch_paged_prefill_sm90(const PagedPrefillParams& p, cudaStream_t stream);
#endif

#if defined(PAGEDD_HAVE_SM90_PREFILL)
namespace {

// Whether the current device is compute capability 9.0 (the sm_90a cubin runs there only).
// Cached per device: this runs on every layer's launch.
bool current_device_is_sm90() {
  constexpr int kMaxCached = 64;
  static std::atomic<int> cached[kMaxCached];  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  auto query = [dev] {
    int major = 0, minor = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ==
               cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) ==
               cudaSuccess &&
           major == 9 && minor == 0;
  };
  if (dev < 0 || dev >= kMaxCached) return query();
  int v = cached[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    v = query() ? 2 : 1;
    cached[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

}  // namespace
#endif

const char* prefill_wgmma_unavailable_reason(int head_dim, DType cache_dtype) {
#if defined(PAGEDD_HAVE_SM90_PREFILL)
  if (head_dim != 64 && head_dim != 128)
    return "the wgmma prefill kernel is built for head_dim 64 and 128";
  if (cache_dtype == DType::kFp8E4M3)
    return "the wgmma prefill kernel reads fp16 / bf16 caches, not fp8";
  if (!current_device_is_sm90())
    return "the wgmma prefill kernel needs a compute capability 9.0 GPU";
  return nullptr;
#else
  (void)head_dim, (void)cache_dtype;
  return "this build has no wgmma prefill kernel (its CUDA architectures do not include 90)";
#endif
}

PrefillBackend prefill_backend_for(const PagedPrefillParams& p) {
  if (p.backend != PrefillBackend::kAuto) return p.backend;
  const bool wgmma = p.head_dim == 128 && p.block_m == 0 && p.block_n == 0 &&
                     p.max_query_len >= kPrefillWgmmaMinQueryLen &&
                     prefill_wgmma_unavailable_reason(p.head_dim, p.cache_dtype) == nullptr;
  return wgmma ? PrefillBackend::kWgmma : PrefillBackend::kMma;
}

cudaError_t paged_attention_prefill(const PagedPrefillParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_seqs > 65535 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.max_query_len < 0)
    return cudaErrorInvalidValue;
  if (p.block_size != 8 && p.block_size != 16 && p.block_size != 32) return cudaErrorInvalidValue;
  if (p.num_seqs == 0) return cudaSuccess;
  if (prefill_backend_for(p) == PrefillBackend::kWgmma) {
    if (prefill_wgmma_unavailable_reason(p.head_dim, p.cache_dtype) != nullptr)
      return cudaErrorNotSupported;
#if defined(PAGEDD_HAVE_SM90_PREFILL)
    switch (p.head_dim) {
      case 64: return launch_paged_prefill_sm90<64>(p, stream);
      case 128: return launch_paged_prefill_sm90<128>(p, stream);
    }
#endif
    return cudaErrorNotSupported;
  }
  switch (p.head_dim) {
    case 64: return launch_paged_prefill<64>(p, stream);
    case 80: return launch_paged_prefill<80>(p, stream);
    case 96: return launch_paged_prefill<96>(p, stream);
    case 128: return launch_paged_prefill<128>(p, stream);
    case 256: return launch_paged_prefill<256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedd::cuda
