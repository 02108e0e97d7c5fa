// One head size per translation unit, so the template instances compile in parallel.
#include "paged_decode_tc_kernel.cuh"

namespace pagedd::cuda {
template cudaError_t launch_paged_decode_tc<80>(const PagedDecodeTcParams&, cudaStream_t);
}  // namespace pagedd::cuda
