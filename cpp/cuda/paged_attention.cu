// Entry point of the decode kernel: argument checks and head-size dispatch.
#include "pagedd_cuda.h"

namespace pagedd::cuda {

template <int HEAD_DIM>
cudaError_t launch_paged_decode(const PagedDecodeParams& p, cudaStream_t stream);

cudaError_t paged_attention_decode(const PagedDecodeParams& p, cudaStream_t stream) {
  if (p.num_seqs <= 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.num_partitions <= 0 || p.num_seqs > 65535 || p.num_partitions > 65535)
    return cudaErrorInvalidValue;
  if (p.num_partitions > 1 && (!p.tmp_out || !p.exp_sums || !p.max_logits))
    return cudaErrorInvalidValue;
  if (p.mods.sliding_window < 0 || p.mods.softcap < 0.f) return cudaErrorInvalidValue;
  switch (p.head_dim) {
    case 64: return launch_paged_decode<64>(p, stream);
    case 80: return launch_paged_decode<80>(p, stream);
    case 96: return launch_paged_decode<96>(p, stream);
    case 128: return launch_paged_decode<128>(p, stream);
    case 256: return launch_paged_decode<256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedd::cuda
