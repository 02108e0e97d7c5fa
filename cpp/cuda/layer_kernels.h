// Entry points of pagedd's per-token layer kernels: RMSNorm (optionally fused with the residual
// add), SiLU-and-multiply, the rotary embedding (alone or fused with the KV-cache write), the
// batched LoRA shrink / expand (lora_kernels.cu; bound in cpp/bindings/lora_bindings.cpp).
// Framework-free like pagedd_cuda.h: raw device pointers, element strides, a cudaStream_t;
// cudaErrorInvalidValue for a bad size. The validating binding is cpp/bindings/layer_bindings.cpp.
//
// Rounding follows the torch code these kernels replace (pydaemon/layers/rms_norm.py,
// activation.py), so that a half-precision model gives the same numbers either way up to the
// order of the float32 sums: every op computes in float32 and rounds to the tensor dtype where
// torch would round.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pagedd_cuda.h"

namespace pagedd::cuda {

struct RMSNormParams {
  void* out;                // [num_tokens, hidden_size], last dim contiguous; may be input
  const void* input;        // [num_tokens, hidden_size], last dim contiguous
  void* residual;           // [num_tokens, hidden_size] or null (plain RMSNorm); not out
  const void* weight;       // [hidden_size], contiguous
  int64_t out_stride;       // elements between rows
  int64_t input_stride;     // elements between rows
  int64_t residual_stride;  // elements between rows (unused without residual)
  int num_tokens;
  int hidden_size;
  float eps;
  DType dtype;              // of all four tensors: kFloat16, kBFloat16 or kFloat32
  // Optional FP8 output in place of out: the normalised rows quantized per token, bit for bit
  // per_token_fp8_quant of what out would hold. out_fp8: [num_tokens, hidden_size] e4m3 bytes
  // (out_stride then counts its bytes; out is unused); out_scale: [num_tokens] float32.
  void* out_fp8 = nullptr;
  float* out_scale = nullptr;
  // gpt-oss / Gemma: out = round((x * rsqrt(...)) * (weight + weight_offset)) in float32, one
  // rounding (transformers' GptOssRMSNorm: offset 0; Gemma2/3RMSNorm: offset 1).
  bool round_once = false;
  float weight_offset = 0.f;
};

// Without residual:  out = weight * rmsnorm(input).
// With residual:     residual = input + residual (in place, rounded to dtype), then
//                    out = weight * rmsnorm(residual), as vLLM's fused_add_rms_norm.
// rmsnorm(x) = round(x * rsqrt(mean(x^2) + eps)) in float32, then the product with weight is
// rounded again (transformers' LlamaRMSNorm); with round_once as described above. One thread
// block per token row.
cudaError_t rms_norm(const RMSNormParams& p, cudaStream_t stream);

// The gated activation on [gate | up]: kSilu silu(gate) * up; kGeluTanh gelu_tanh(gate) * up
// (Gemma's GeGLU); kSwigluOai (gpt-oss's clamped SwiGLU, vLLM's "swigluoai"): g = min(gate,
// limit), u = clamp(up, -limit, limit), out = (u + 1) * (g * sigmoid(alpha * g)). Each op
// rounded to the dtype where torch's expression rounds.
enum class GatedActivation : int { kSilu = 0, kGeluTanh = 1, kSwigluOai = 2 };

struct SiluAndMulParams {
  void* out;             // [num_tokens, d], last dim contiguous
  const void* input;     // [num_tokens, 2 * d], last dim contiguous: gate = [:, :d], up = [:, d:]
  int64_t out_stride;    // elements between rows
  int64_t input_stride;  // elements between rows
  int num_tokens;
  int d;
  DType dtype;           // of both tensors: kFloat16, kBFloat16 or kFloat32
  // Optional FP8 output in place of out, as RMSNormParams::out_fp8 / out_scale.
  void* out_fp8 = nullptr;
  float* out_scale = nullptr;
  GatedActivation activation = GatedActivation::kSilu;
  float alpha = 1.702f, limit = 7.f;  // kSwigluOai only
};

// out = round(silu(gate)) * up, silu(x) = x / (1 + exp(-x)) in float32 (or the activation
// p.activation names). One block per row.
cudaError_t silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream);

struct RotaryParams {
  void* query;                 // [num_tokens, num_heads, head_dim], last dim contiguous
  void* key;                   // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  const float* cos;            // [num_tokens, rotary_dim] float32, last dim contiguous
  const float* sin;            // [num_tokens, rotary_dim] float32, same strides as cos
  int64_t query_token_stride;  // elements
  int64_t query_head_stride;
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t cos_sin_stride;      // elements between rows of cos and of sin
  int num_tokens;
  int num_heads;
  int num_kv_heads;
  int head_dim;                // even
  DType dtype;                 // of query and key: kFloat16, kBFloat16 or kFloat32
  // Dims rotated, from the start of each head (even, <= head_dim; 0: head_dim): a partial
  // rotary embedding passes the others through.
  int rotary_dim = 0;
};

// In place, for every head h of query and of key (the rotate_half convention on x =
// head[:rotary_dim], half = rotary_dim / 2; head[rotary_dim:] unchanged):
//   x[:half], x[half:] = x[:half] * cos[:half] - x[half:] * sin[:half],
//                        x[half:] * cos[half:] + x[:half] * sin[half:]
// with cos and sin rounded to dtype first and every product and the sum rounded to dtype, as
// transformers' apply_rotary_pos_emb computes it. One block per token.
cudaError_t rotary_embedding(const RotaryParams& p, cudaStream_t stream);

struct RotaryCacheParams {
  RotaryParams rotary;           // query and key (rotated in place), cos, sin, sizes, dtype
  const void* value;             // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  int64_t value_token_stride;    // elements
  int64_t value_head_stride;
  void* key_cache;               // [num_blocks, num_kv_heads, block_size, head_dim]
  void* value_cache;             // same shape and strides
  int64_t cache_block_stride;    // elements (bytes for fp8)
  int64_t cache_head_stride;     // elements (bytes for fp8)
  const int64_t* slot_mapping;   // [num_tokens]; slot = block_id * block_size + offset
  int block_size;
  // fp8 cache (query / key / value fp16 or bf16): stores saturate(x / k_scale) (resp.
  // v_scale) as e4m3, as reshape_and_cache does. Otherwise the cache has the query's dtype.
  bool cache_fp8 = false;
  float k_scale = 1.f, v_scale = 1.f;
};

// The fused kernel stages a token's cos and sin in shared memory (2 * rotary_dim floats).
constexpr int kMaxRotaryCacheHeadDim = 4096;

// rotary_embedding, then reshape_and_cache of the rotated key and the value, in one launch:
// bit for bit the two kernels run one after the other. A token with slot < 0 (padding) is
// rotated but not stored. One block per token; k is read once and written twice (in place
// and into the cache).
cudaError_t rotary_embedding_and_cache(const RotaryCacheParams& p, cudaStream_t stream);

struct PerTokenFp8QuantParams {
  void* out;             // [num_tokens, d] float8_e4m3fn (as bytes), last dim contiguous
  float* scale;          // [num_tokens], contiguous
  const void* input;     // [num_tokens, d], last dim contiguous
  int64_t out_stride;    // elements between rows
  int64_t input_stride;  // elements between rows
  int num_tokens;
  int d;
  DType dtype;           // of input: kFloat16, kBFloat16 or kFloat32
};

// Dynamic per-token FP8: inverse = 448 / max(max_k |input[t, k]|, 448e-12) (rounded to bf16
// for bf16 input), out[t, k] = e4m3(input[t, k] * inverse) (the product rounded to bf16 first
// for bf16 input), scale[t] = 1 / inverse: bit for bit pydaemon/quantization/fp8.py's
// quantize_per_token. One block per row.
cudaError_t per_token_fp8_quant(const PerTokenFp8QuantParams& p, cudaStream_t stream);

// ---- FP8 scaled product for a few rows (decode) -------------------------------------------
constexpr int kFp8GemvMaxRows = 16;  // one m16 tile of the FP8 mma

struct Fp8GemvParams {
  void* out;             // [m, n] bfloat16, last dim contiguous
  const void* xq;        // [m, k] float8_e4m3fn (as bytes), rows 16-byte aligned
  const float* x_scale;  // [m], contiguous
  const void* wq;        // [n, k] float8_e4m3fn (as bytes), contiguous, 16-byte aligned
  const float* w_scale;  // [n], contiguous
  int64_t out_stride;    // elements between rows of out
  int64_t x_stride;      // bytes between rows of xq, a multiple of 16
  int m;                 // 1 .. kFp8GemvMaxRows
  int n;
  int k;                 // a multiple of 16
};

// out[m, n] = bf16((sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]), float32 sums of
// exact FP8 products (fp8_gemv.cu): torch._scaled_mm's row-wise scaled product for m <= 16,
// a pass over the weights on FP8 tensor cores. Compute capability 8.9+ (cudaErrorNotSupported
// below); cudaErrorInvalidValue for sizes or alignments outside the above.
cudaError_t fp8_gemv(const Fp8GemvParams& p, cudaStream_t stream);

// ---- batched LoRA (Punica's BGMV: every token its own adapter slot) -----------------------
// Both kernels read each token's slot on the device (no host read, no allocation: they can be
// captured in a CUDA graph and replayed after token_slots or the slots' contents change in
// place). A slot outside [0, num_slots) means "no adapter": the token's adapter weights are
// not read.

struct LoRAShrinkParams {
  float* xa;                   // [num_tokens, num_outputs] float32, contiguous (written)
  const void* x;               // [num_tokens, in_features], last dim contiguous
  const void* lora_a;          // [num_slots, num_outputs, in_features], contiguous
  const int64_t* token_slots;  // [num_tokens]
  int64_t x_stride;            // elements between rows of x
  int num_tokens;
  int num_outputs;             // rows of each slot's A: num_parts * rank
  int in_features;
  int num_slots;               // including the zero slot the layers keep last
  DType dtype;                 // of x and lora_a: kFloat16 or kBFloat16
};

// xa[t, k] = sum_i x[t, i] * lora_a[token_slots[t], k, i], float32 products and sums; a token
// without an adapter gets xa[t, :] = 0. One warp per (token, k): 16-byte loads over in_features
// (when sizes and addresses allow), a warp-shuffle sum.
cudaError_t lora_shrink(const LoRAShrinkParams& p, cudaStream_t stream);

constexpr int kMaxLoRAParts = 4;  // qkv (3) and gate/up (2) fit

struct LoRAExpandParams {
  void* y;                     // [num_tokens, out_features], last dim contiguous (+= in place)
  const float* xa;             // [num_tokens, num_parts * rank] float32, contiguous
  const void* lora_b;          // [num_slots, rank, out_features], contiguous
  const int64_t* token_slots;  // [num_tokens]
  int64_t y_stride;            // elements between rows of y
  // Part j owns the columns [part_starts[j], part_starts[j + 1]): part_starts[0] = 0,
  // part_starts[num_parts] = out_features, increasing.
  int part_starts[kMaxLoRAParts + 1];
  int num_parts;               // 1 .. kMaxLoRAParts
  int rank;
  int num_tokens;
  int out_features;
  int num_slots;
  DType dtype;                 // of y and lora_b: kFloat16 or kBFloat16
};

// y[t, c] = round(y[t, c] + sum_r xa[t, j * rank + r] * lora_b[token_slots[t], r, c]) for the
// part j holding column c: float32 products and sums, one rounding to y's dtype. A token
// without an adapter leaves its row of y untouched. Each thread owns 8 consecutive columns
// (16-byte loads of B's rows, coalesced) when the sizes, part starts and addresses allow, else
// one column; blocks own disjoint columns (no atomics).
cudaError_t lora_expand(const LoRAExpandParams& p, cudaStream_t stream);

}  // namespace pagedd::cuda
