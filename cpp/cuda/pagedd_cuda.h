// Public entry points of pagedd's framework-free CUDA kernels.
//
// Everything here takes raw device pointers, element strides and a cudaStream_t, and returns a
// cudaError_t (cudaErrorInvalidValue for an unsupported size). No torch, no nanobind: the
// validating binding lives in cpp/bindings/cuda_bindings.cpp.
//
// KV-cache layout (pydaemon/layers/attention_metadata.py): kv_cache [num_blocks, num_layers, 2,
// num_kv_heads, block_size, head_dim]. One layer's key_cache / value_cache is the strided view
// [num_blocks, num_kv_heads, block_size, head_dim] whose inner [block_size, head_dim] is
// contiguous; the block and head strides are passed in.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pagedd::cuda {

// The attention kernels take kFloat16 / kBFloat16; the layer kernels (layer_kernels.h) all three.
// kFp8E4M3 is a KV-cache element type only (the attention params' cache_dtype): one byte, e4m3
// (OCP "fn" flavour: no infinities, max 448), stored as x / scale and read back as e4m3 * scale.
enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFp8E4M3 = 3 };

// Tokens per split-KV partition of the decode kernel (a multiple of every block size).
constexpr int kPartitionSize = 256;

inline int num_partitions_for(int max_seq_len) {
  return max_seq_len <= 0 ? 1 : (max_seq_len + kPartitionSize - 1) / kPartitionSize;
}

// Per-layer modifiers of the attention scores, taken by every attention kernel. A call without
// any (mods.any() false) runs the kernels' plain instances, unchanged; with any, instances
// that apply them (a compile-time switch: the plain instances pay nothing).
//   sliding_window: a query at position p sees the keys at (p - sliding_window, p] only, as
//     transformers' sliding-window mask; the kernels start at the first block holding such a
//     key and never read the blocks (nor their block-table entries) wholly before it, so that
//     an allocator may free them: a sequence's keys before its first new token's position -
//     sliding_window + 1 are never read.
//   softcap: each scaled score s becomes softcap * tanh(s / softcap) before the mask (Gemma 2).
//   sinks: a logit per query head, [num_q_heads] of the query's dtype, joining each row's
//     softmax as one more column whose value is dropped: out = sum_j e^{s_j} v_j /
//     (sum_j e^{s_j} + e^{sink}) (gpt-oss).
struct AttentionMods {
  int sliding_window = 0;       // > 0: the window in tokens (the query included); 0: none
  float softcap = 0.f;          // > 0: the cap; 0: none
  const void* sinks = nullptr;  // [num_q_heads] or null
  bool any() const { return sliding_window > 0 || softcap > 0.f || sinks != nullptr; }
};

// Decode with a window starts at the window's first key rounded down to a multiple of
// `align` keys (the CUDA-core kernel: 1; the tensor-core kernel: 16, one sub-tile), so a
// sequence spans at most min(max_seq_len, window + align - 1) keys: what the split-KV
// partitions must cover.
constexpr int kDecodeTcWindowAlign = 16;
inline int decode_span(int max_seq_len, int sliding_window, int align) {
  if (sliding_window <= 0) return max_seq_len;
  const int64_t span = (int64_t)sliding_window + align - 1;
  return span < max_seq_len ? (int)span : max_seq_len;
}

struct PagedDecodeParams {
  void* out;                   // [num_seqs, num_q_heads, head_dim], contiguous
  const void* query;           // [num_seqs, num_q_heads, head_dim], last dim contiguous
  int64_t q_seq_stride;        // elements
  int64_t q_head_stride;       // elements
  const void* key_cache;       // [num_blocks, num_kv_heads, block_size, head_dim]
  const void* value_cache;     // same shape and strides as key_cache
  int64_t kv_block_stride;     // elements between consecutive blocks
  int64_t kv_head_stride;      // elements between consecutive kv heads of one block
  const int32_t* block_tables; // [num_seqs, max_num_blocks_per_seq]
  int64_t block_table_stride;  // elements between rows
  const int32_t* seq_lens;     // [num_seqs], each <= num_partitions * kPartitionSize
  // Split-KV workspaces, used when num_partitions > 1 (may be null when it is 1):
  float* tmp_out;              // [num_seqs, num_q_heads, num_partitions, head_dim]
  float* exp_sums;             // [num_seqs, num_q_heads, num_partitions]
  float* max_logits;           // [num_seqs, num_q_heads, num_partitions]
  int num_partitions;          // num_partitions_for(decode_span(max_seq_len, window, 1))
  int num_seqs;
  int num_q_heads;
  int num_kv_heads;            // num_q_heads % num_kv_heads == 0
  int head_dim;                // 64, 80, 96, 128 or 256
  int block_size;              // 8, 16 or 32
  float scale;                 // softmax scale, usually head_dim ** -0.5
  DType dtype;
  // Cache element type: kFp8E4M3, or anything else for "same as dtype". With fp8, the kernel
  // reads k = e4m3 * k_scale, v = e4m3 * v_scale (k_scale folded into the query, v_scale into
  // the output: no per-element multiply); strides are then in bytes (= elements).
  DType cache_dtype = DType::kFloat16;
  float k_scale = 1.f, v_scale = 1.f;
  AttentionMods mods;          // window, soft-cap, sinks (see AttentionMods)
};

// out[s, h] = softmax(scale * q[s, h] . K[s, kv(h)]^T) V[s, kv(h)] over the first seq_lens[s]
// tokens of sequence s (the last sliding_window of them with a window), read through its block
// table. A sequence of length 0 gets zeros; one spanning more than num_partitions *
// kPartitionSize keys gets NaN (the caller's max_seq_len was wrong).
cudaError_t paged_attention_decode(const PagedDecodeParams& p, cudaStream_t stream);

// The tensor-core decode kernel's parameters: the CUDA-core kernel's, with a runtime
// partition size (a multiple of 64) and the caller's max_seq_len. The split-KV workspaces
// have the same layout and meaning; num_partitions = ceil(decode_span(max_seq_len, window,
// kDecodeTcWindowAlign) / partition_size).
struct PagedDecodeTcParams : PagedDecodeParams {
  int partition_size;  // keys per partition, a positive multiple of 64
  int max_seq_len;     // >= every seq_lens entry; a longer sequence gets NaN
};

// Head sizes paged_attention_decode_tc is built for, and the largest GQA group (query heads
// per kv head) it takes: the group is one mma atom of 16 rows.
inline bool decode_tc_is_built(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}
constexpr int kDecodeTcMaxGroup = 16;

// Decode attention on tensor cores for grouped query heads: the same result and conventions
// as paged_attention_decode (zeros for length 0, NaN past max_seq_len), split-KV with
// partition_size keys per partition; the query heads of a kv head (group <= 16) are the rows
// of one mma atom, so K/V are read once per kv head. fp16 / bf16 or fp8 e4m3 cache.
cudaError_t paged_attention_decode_tc(const PagedDecodeTcParams& p, cudaStream_t stream);

// Which prefill kernel runs: kAuto picks (prefill_backend_for), kMma is the mma.sync kernel
// (sm_80+, every head size and cache), kWgmma the Hopper warpgroup-MMA kernel (sm_90a builds,
// compute capability 9.0 devices, head 64 / 128, fp16 / bf16 caches).
enum class PrefillBackend : int { kAuto = 0, kMma = 1, kWgmma = 2 };

struct PagedPrefillParams {
  void* out;                     // [num_tokens, num_q_heads, head_dim], contiguous
  const void* query;             // [num_tokens, num_q_heads, head_dim], last dim contiguous
  int64_t q_token_stride;        // elements
  int64_t q_head_stride;         // elements
  const void* key_cache;         // [num_blocks, num_kv_heads, block_size, head_dim]
  const void* value_cache;       // same shape and strides as key_cache
  int64_t kv_block_stride;       // elements between consecutive blocks
  int64_t kv_head_stride;        // elements between consecutive kv heads of one block
  int64_t num_blocks;            // blocks of the cache (the wgmma kernel's TMA bounds)
  const int32_t* block_tables;   // [num_seqs, max_num_blocks_per_seq]
  int64_t block_table_stride;    // elements between rows
  const int32_t* seq_lens;       // [num_seqs] context length after this step (cached + new)
  const int32_t* query_start_loc;  // [num_seqs + 1] cumulative query lengths
  int num_seqs;
  int num_q_heads;
  int num_kv_heads;              // num_q_heads % num_kv_heads == 0
  int head_dim;                  // 64, 80, 96, 128 or 256
  int block_size;                // 8, 16 or 32
  int max_query_len;             // >= every query length (sizes the grid)
  int block_m;                   // tile rows (tuning): 0 = default for head_dim, 64 or 128
  int block_n;                   // tile keys (tuning): 0 = default for head_dim, 32 or 64
  float scale;                   // softmax scale, usually head_dim ** -0.5
  DType dtype;
  // Cache element type and scales, as in PagedDecodeParams: fp8 K/V tiles are converted to
  // dtype while staged into shared memory; k_scale is folded into the softmax scale and
  // v_scale into the final normalisation.
  DType cache_dtype = DType::kFloat16;
  float k_scale = 1.f, v_scale = 1.f;
  PrefillBackend backend = PrefillBackend::kAuto;
  AttentionMods mods;            // window, soft-cap, sinks (see AttentionMods)
};

// Causal attention of a packed batch of new tokens over their paged K/V (the cached prefix and
// the new tokens themselves, already written by reshape_and_cache). Sequence s owns query rows
// [query_start_loc[s], query_start_loc[s+1]); its query token j sits at position
// seq_lens[s] - query_len + j and attends to positions [0, that] (with a window, the last
// sliding_window of them; tiles of keys wholly before every row's window are skipped, never
// read). Decode rows (query_len 1)
// may be mixed in. Tensor cores (mma.sync on sm_80+, or wgmma on sm_90a: p.backend), online
// softmax, and the query heads of a kv head's group packed into one tile, so K/V are read once
// per kv head, never copied.
// A sequence with query_len > seq_lens, or longer than max_query_len, gets NaN rows.
cudaError_t paged_attention_prefill(const PagedPrefillParams& p, cudaStream_t stream);

// The prefill tile (block_m rows x block_n keys) a call runs: block_m / block_n of 0 pick
// the default, measured on the H200 (bench/results/prefill_h200.md): 128 x 32 below 2048
// new tokens per sequence, 128 x 64 from there (longer tiles pay off with more keys per
// row); 64 x 64 is the decode-step shape; head_dim 256 has 64 x 32 only (registers).
inline void prefill_tile_shape(int head_dim, int max_query_len, int& block_m, int& block_n) {
  if (block_m == 0) block_m = head_dim == 256 ? 64 : 128;
  if (block_n == 0)
    block_n = head_dim == 256 ? 32 : (block_m == 64 || max_query_len >= 2048 ? 64 : 32);
}
inline bool prefill_tile_is_built(int head_dim, int block_m, int block_n) {
  if (head_dim == 256) return block_m == 64 && block_n == 32;
  return (block_m == 128 && (block_n == 32 || block_n == 64)) || (block_m == 64 && block_n == 64);
}

// Why the wgmma prefill kernel cannot run a call of this head size and cache type on the
// current device (this build lacks it, the device is not compute capability 9.0, the head size
// or the cache type is not built), or nullptr when it can. The device query is cached.
const char* prefill_wgmma_unavailable_reason(int head_dim, DType cache_dtype);

// The backend a call runs. kAuto takes wgmma where it is available, at head 128 (the size
// measured against mma.sync), with the default tile (block_m = block_n = 0: an explicit tile is
// mma.sync tuning) and max_query_len >= kPrefillWgmmaMinQueryLen. Measured on the H200
// (bench/results/h200_2026-12-01d_prefill_ws.md, GQA 32/8, bf16, TFLOP/s): the warp-specialized
// wgmma kernel with 128-key tiles against mma.sync's default 128x32 tile is 215 vs 197 at 512
// new tokens (378 vs 259 after a 512-token prefix), 322 vs 242 at 1024; at 256 it wins only
// after a cached prefix (277 vs 225; 129 vs 146 without), and below that mma.sync wins (its
// 128-row tile wastes less on short sequences). Decode steps and short chunks keep mma.sync.
constexpr int kPrefillWgmmaMinQueryLen = 512;
PrefillBackend prefill_backend_for(const PagedPrefillParams& p);

// The wgmma kernel's tile: 128 rows (two warpgroups of 64) x block_n keys, block_n 64 or 128
// (block_m 0 or 128). block_n 0 picks 128: measured on the H200 it is as fast as 64 at 512 new
// tokens without a prefix and 5-13 % faster elsewhere from 512 (the wider tile halves the
// per-tile overhead).
inline int prefill_wgmma_block_n(int max_query_len, int block_n) {
  (void)max_query_len;
  return block_n != 0 ? block_n : 128;
}
inline bool prefill_wgmma_tile_is_built(int block_m, int block_n) {
  return (block_m == 0 || block_m == 128) && (block_n == 0 || block_n == 64 || block_n == 128);
}

struct ReshapeAndCacheParams {
  const void* key;             // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  const void* value;           // same shape
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
  void* key_cache;             // [num_blocks, num_kv_heads, block_size, head_dim]
  void* value_cache;           // same shape and strides
  int64_t cache_block_stride, cache_head_stride;
  const int64_t* slot_mapping; // [num_tokens]; slot = block_id * block_size + offset, < 0: skip
  int num_tokens, num_kv_heads, head_dim, block_size;
  int elem_size;               // bytes per element of key / value (2 for fp16 / bf16, 4 for fp32)
  // fp8 cache: key / value are dtype (kFloat16 or kBFloat16) and the cache stores
  // saturate(x / k_scale) (resp. v_scale) as e4m3; its strides are in bytes. Otherwise the
  // cache has key's dtype and elements are copied as they are.
  bool cache_fp8 = false;
  DType dtype = DType::kFloat16;
  float k_scale = 1.f, v_scale = 1.f;
};

cudaError_t reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream);

// Copy whole blocks inside one buffer: for each pair i, block block_mapping[2i+1] :=
// block block_mapping[2i]. base is kv_cache (all layers of a block are one chunk of
// block_bytes). block_mapping is a device array [num_pairs, 2] of int64.
cudaError_t copy_blocks(void* base, int64_t block_bytes, const int64_t* block_mapping,
                        int64_t num_pairs, cudaStream_t stream);

// Copy whole blocks between two buffers of the same block layout, device <-> pinned host (or
// device <-> device): dst block m[2i+1] := src block m[2i]. block_mapping lives in host memory
// and may be freed once this returns. Batched into one cudaMemcpyBatchAsync where the runtime
// and stream allow it, else one cudaMemcpyAsync per run of consecutive blocks.
cudaError_t swap_blocks(void* dst, const void* src, int64_t block_bytes,
                        const int64_t* block_mapping_host, int64_t num_pairs,
                        cudaStream_t stream);

}  // namespace pagedd::cuda
