// Programmatic dependent launch (Hopper, sm_90+): a kernel launched with
// launch_after_primary may start while the kernel before it in the stream (its primary) is
// still running, once every block of the primary has called pdl_launch_dependents (or
// exited). The dependent kernel then does what does not read the primary's output (index
// math, loads of host-written metadata) and calls pdl_wait_primary before the rest:
// griddepcontrol.wait returns when the primary grid has completed and its writes are visible.
// Its launch latency (the gap between two dependent kernels, ~2 us) is hidden behind the
// primary's tail. Without the launch attribute (older GPUs, or a primary that is not a
// kernel), both instructions are no-ops and the launch is an ordinary, serialized one.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

namespace pagedd::cuda {

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether the current device takes programmatic dependent launches (compute capability 9+).
// Cached per device: this runs on every decode step's launch.
inline bool current_device_has_pdl() {
  constexpr int kMaxCached = 64;
  static std::atomic<int> cached[kMaxCached];  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  auto query = [dev] {
    int major = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ==
               cudaSuccess &&
           major >= 9;
  };
  if (dev < 0 || dev >= kMaxCached) return query();
  int v = cached[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    v = query() ? 2 : 1;
    cached[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

// kernel<<<grid, block, smem, stream>>>(args...) as the dependent of the stream's last kernel.
template <typename... Params, typename... Args>
cudaError_t launch_after_primary(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = current_device_has_pdl() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace pagedd::cuda
