// Entry points of pagedd's mixture-of-experts kernels: top-k routing, grouping the (token,
// expert) slots by expert, and the weighted un-permute + sum of the experts' outputs
// (moe_kernels.cu); for a few tokens, the whole expert computation in two kernels
// (moe_decode_kernels.cu). Larger steps run the expert GEMMs as torch's grouped GEMMs
// (pydaemon/layers/moe/experts.py).
// Framework-free like layer_kernels.h: raw device pointers, element strides, a cudaStream_t;
// cudaErrorInvalidValue for a bad size. The validating binding is cpp/bindings/moe_bindings.cpp.
// Nothing here reads a value back to the host or allocates: every kernel can be captured in a
// CUDA graph and replayed with any routing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pagedd_cuda.h"

namespace pagedd::cuda {

constexpr int kMoeMaxExperts = 1024;  // moe_align keeps one counter per expert in shared memory
constexpr int kMoeMaxTopK = 32;

struct TopkRouteParams {
  float* topk_weights;    // [num_tokens, top_k] float32, contiguous
  int32_t* topk_ids;      // [num_tokens, top_k] int32, contiguous
  const void* logits;     // [num_tokens, num_experts], last dim contiguous
  int64_t logits_stride;  // elements between rows
  int num_tokens;
  int num_experts;        // <= kMoeMaxExperts
  int top_k;              // in [1, min(num_experts, kMoeMaxTopK)]
  bool softmax;           // scores: softmax over the experts (true) or sigmoid of each logit
  bool renormalize;       // divide the top-k scores by their sum
  DType dtype;            // of logits: kFloat16, kBFloat16 or kFloat32
};

// Per token, in float32: the top_k experts by score (ties to the lower expert id), in
// descending order, and their scores (softmax: exp(l - max) / sum over all experts; sigmoid:
// 1 / (1 + exp(-l))), renormalised to sum 1 when asked. One warp per token.
cudaError_t topk_route(const TopkRouteParams& p, cudaStream_t stream);

struct MoeAlignParams {
  int32_t* sorted_token_ids;  // [num_tokens * top_k]: token of each expert-ordered row
  int32_t* inverse;           // [num_tokens * top_k]: row of slot t * top_k + j
  int32_t* expert_offsets;    // [num_experts]: cumulative end of each expert's rows
  const int32_t* topk_ids;    // [num_tokens * top_k], contiguous, each in [0, num_experts)
  int num_tokens;
  int top_k;
  int num_experts;            // <= kMoeMaxExperts
};

// Groups the slots by expert: expert e's rows are [expert_offsets[e - 1], expert_offsets[e])
// (from 0 for e = 0); the order of the rows within an expert is unspecified. One block.
cudaError_t moe_align(const MoeAlignParams& p, cudaStream_t stream);

struct MoeCombineParams {
  void* out;                    // [num_tokens, hidden], last dim contiguous
  const void* expert_out;       // [num_tokens * top_k, hidden], last dim contiguous
  const int32_t* inverse;       // [num_tokens * top_k]
  const float* topk_weights;    // [num_tokens, top_k] float32, contiguous
  int64_t out_stride;           // elements between rows
  int64_t expert_out_stride;    // elements between rows
  int num_tokens;
  int top_k;
  int hidden;
  DType dtype;                  // of out and expert_out: kFloat16, kBFloat16 or kFloat32
};

// out[t] = round(sum_j topk_weights[t, j] * expert_out[inverse[t * top_k + j]]), the sum in
// float32 over j in order. One block per token.
cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream);

// ---- decode: the experts of a few tokens in two kernels (moe_decode_kernels.cu) ----------
// Slot s = t * top_k + j is token t's j-th expert e = topk_ids[t, j]. An id outside
// [0, num_experts) reads no weights: its act row is zero and it adds nothing to out (ids are
// device data: checking them on the host would cost a sync and break graph capture).
constexpr int kMoeDecodeMaxHidden = 16384;  // gate_up stages x[t] in shared memory (32 KB)
constexpr int kMoeDecodeMaxRows = 65535;    // grid.y: slots (gate_up), tokens (down_combine)

struct MoeDecodeGateUpParams {
  void* act;                  // [num_tokens * top_k, intermediate], contiguous
  const void* x;              // [num_tokens, hidden], last dim contiguous
  const int32_t* topk_ids;    // [num_tokens, top_k] int32, contiguous
  const void* w13;            // [num_experts, 2 * intermediate, hidden], contiguous
  int64_t x_stride;           // elements between rows of x
  int num_tokens;
  int top_k;                  // in [1, kMoeMaxTopK]; num_tokens * top_k <= kMoeDecodeMaxRows
  int num_experts;
  int hidden;                 // <= kMoeDecodeMaxHidden
  int intermediate;
  DType dtype;                // of act, x and w13: kFloat16 or kBFloat16
};

// g = x[t] . w13[e, c], u = x[t] . w13[e, intermediate + c] for c < intermediate (float32
// sums), each rounded to dtype as a grouped GEMM stores them; act[s, c] = silu(g) * u with
// silu_and_mul's roundings (silu_and_mul.cu: silu rounded to dtype, then the product).
cudaError_t moe_decode_gate_up(const MoeDecodeGateUpParams& p, cudaStream_t stream);

struct MoeDecodeDownParams {
  void* out;                  // [num_tokens, hidden], last dim contiguous
  const void* act;            // [num_tokens * top_k, intermediate], contiguous
  const int32_t* topk_ids;    // [num_tokens, top_k] int32, contiguous
  const float* topk_weights;  // [num_tokens, top_k] float32, contiguous
  const void* w2;             // [num_experts, hidden, intermediate], contiguous
  int64_t out_stride;         // elements between rows of out
  int num_tokens;             // <= kMoeDecodeMaxRows
  int top_k;                  // in [1, kMoeMaxTopK]
  int num_experts;
  int hidden;
  int intermediate;
  DType dtype;                // of out, act and w2: kFloat16 or kBFloat16
};

// out[t, h] = round(sum_j topk_weights[t, j] * round(act[s_j] . w2[e_j, h])): each expert's
// output rounded to dtype as a grouped GEMM stores it, then moe_combine's float32 sum over j in
// order, rounded once.
cudaError_t moe_decode_down_combine(const MoeDecodeDownParams& p, cudaStream_t stream);

// ---- decode with FP8 expert weights (moe_decode_fp8_kernels.cu) ------------------------------
// The same two kernels and roundings with w13 / w2 float8 e4m3 (one byte per element; the
// params' w13 / w2 point at them, their dtype is the activations': kFloat16 or kBFloat16) and
// float32 scales: per output channel (block_n = block_k = 0; w_scale [num_experts, rows]) or per
// (block_n x block_k) block of an FP8 checkpoint (w_scale [num_experts, ceil(rows / block_n),
// ceil(cols / block_k)], block_k a multiple of 16), rows x cols = 2 * intermediate x hidden for
// w13 and hidden x intermediate for w2. hidden and intermediate multiples of 16; x, act and the
// weights 16-byte aligned (x's row stride a multiple of 8).
struct MoeDecodeFp8Scales {
  const float* w_scale;
  int block_n = 0;
  int block_k = 0;
};

cudaError_t moe_decode_gate_up_fp8(const MoeDecodeGateUpParams& p, const MoeDecodeFp8Scales& s,
                                   cudaStream_t stream);
cudaError_t moe_decode_down_combine_fp8(const MoeDecodeDownParams& p, const MoeDecodeFp8Scales& s,
                                        cudaStream_t stream);

}  // namespace pagedd::cuda
