// One head size per translation unit, so the template instances compile in parallel.
#include "paged_prefill_kernel.cuh"

namespace pagedd::cuda {
template cudaError_t launch_paged_prefill<256>(const PagedPrefillParams&, cudaStream_t);
}  // namespace pagedd::cuda
