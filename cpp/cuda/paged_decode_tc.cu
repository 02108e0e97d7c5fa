// Entry point of the tensor-core decode kernel: argument checks and head-size dispatch.
#include "pagedd_cuda.h"

namespace pagedd::cuda {

template <int HEAD_DIM>
cudaError_t launch_paged_decode_tc(const PagedDecodeTcParams& p, cudaStream_t stream);

cudaError_t paged_attention_decode_tc(const PagedDecodeTcParams& p, cudaStream_t stream) {
  if (p.num_seqs <= 0 || p.num_seqs > 65535 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.num_q_heads / p.num_kv_heads > kDecodeTcMaxGroup ||
      p.num_kv_heads > 65535 || p.num_partitions <= 0 || p.num_partitions > 65535 ||
      p.partition_size <= 0 || p.partition_size % 64 != 0)
    return cudaErrorInvalidValue;
  if (p.block_size != 8 && p.block_size != 16 && p.block_size != 32) return cudaErrorInvalidValue;
  // Every sequence within max_seq_len must fit the partitions (from its window's first key).
  const int span = decode_span(p.max_seq_len, p.mods.sliding_window, kDecodeTcWindowAlign);
  if ((int64_t)p.num_partitions * p.partition_size < span) return cudaErrorInvalidValue;
  if (p.mods.sliding_window < 0 || p.mods.softcap < 0.f) return cudaErrorInvalidValue;
  if (p.num_partitions > 1 && (!p.tmp_out || !p.exp_sums || !p.max_logits))
    return cudaErrorInvalidValue;
  switch (p.head_dim) {
    case 64: return launch_paged_decode_tc<64>(p, stream);
    case 80: return launch_paged_decode_tc<80>(p, stream);
    case 96: return launch_paged_decode_tc<96>(p, stream);
    case 128: return launch_paged_decode_tc<128>(p, stream);
    case 256: return launch_paged_decode_tc<256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedd::cuda
