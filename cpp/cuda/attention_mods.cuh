// Device helpers of the attention kernels' score modifiers (AttentionMods, pagedd_cuda.h):
// the window's first key, the soft-cap, and a sink logit folded into a softmax's sum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "pagedd_cuda.h"

namespace pagedd::cuda {

// The first key a query at position pos sees (0 without a window).
__device__ __forceinline__ int window_first_key(int pos, int sliding_window) {
  return sliding_window > 0 ? max(0, pos - sliding_window + 1) : 0;
}

// Whether the block holding key `key` (block_size = 1 << block_shift) holds a key at or after
// `first_key`: blocks wholly before it are never read, not even their block-table entries.
__device__ __forceinline__ bool block_reaches(int key, int block_shift, int first_key) {
  return (key | ((1 << block_shift) - 1)) >= first_key;
}

// softcap * tanh(s / softcap), s the scaled score (tanhf: the accurate one; a few ulp).
__device__ __forceinline__ float softcap_score(float s, float softcap) {
  return softcap * tanhf(s / softcap);
}

// Sink logit of query head h, in float (sinks: [num_q_heads] of the query's dtype).
template <typename scalar_t>
__device__ __forceinline__ float sink_logit(const void* sinks, int h);
template <>
__device__ __forceinline__ float sink_logit<__half>(const void* sinks, int h) {
  return __half2float(static_cast<const __half*>(sinks)[h]);
}
template <>
__device__ __forceinline__ float sink_logit<__nv_bfloat16>(const void* sinks, int h) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(sinks)[h]);
}

// Folds a sink into a softmax row: m, the row's max, and l, its sum of exp(s - m), become the
// max and sum over the scores and the sink; returns exp(m - m_new), the factor the row's
// accumulated output takes. LOG2: m and sink in the log2 domain (exp2), else natural (exp). A
// row without keys (m = -inf, l = 0) gets factor 0 and l = 1: an output of zeros.
template <bool LOG2>
__device__ __forceinline__ float fold_sink(float m, float& l, float sink) {
  const float m_new = fmaxf(m, sink);
  const float factor = LOG2 ? exp2f(m - m_new) : expf(m - m_new);
  l = l * factor + (LOG2 ? exp2f(sink - m_new) : expf(sink - m_new));
  return factor;
}

}  // namespace pagedd::cuda
