// Entry point of the paged prefill kernel: argument checks and head-size dispatch.
#include "pagedd_cuda.h"

namespace pagedd::cuda {

template <int HEAD_DIM>
cudaError_t launch_paged_prefill(const PagedPrefillParams& p, cudaStream_t stream);

cudaError_t paged_attention_prefill(const PagedPrefillParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_seqs > 65535 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.max_query_len < 0)
    return cudaErrorInvalidValue;
  if (p.block_size != 8 && p.block_size != 16 && p.block_size != 32) return cudaErrorInvalidValue;
  if (p.num_seqs == 0) return cudaSuccess;
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
