// One head size per translation unit, so the template instances compile in parallel.
#include "paged_attention_kernel.cuh"

namespace pagedd::cuda {
template cudaError_t launch_paged_decode<80>(const PagedDecodeParams&, cudaStream_t);
}  // namespace pagedd::cuda
