// wgmma prefill instance for head 128 (compiled for sm_90a only: cpp/cuda/CMakeLists.txt).
#include "paged_prefill_sm90.cuh"

namespace pagedd::cuda {
template cudaError_t launch_paged_prefill_sm90<128>(const PagedPrefillParams&, cudaStream_t);
}  // namespace pagedd::cuda
