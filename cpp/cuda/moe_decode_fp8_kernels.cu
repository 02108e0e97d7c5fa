// The MoE decode kernels (moe_decode_kernels.cu) with FP8 e4m3 expert weights and bf16 / fp16
// activations (w8a16): each weight row is read once as 16-byte vectors of 16 e4m3 values,
// widened to float in registers and dotted with the activations in float32; the weights'
// scales, per output channel or per (bn x bk) block of an HF FP8 checkpoint, are applied to
// the float32 sums (per channel: once per row; per block: once per 16-value vector, whose
// values share a block since bk is a multiple of 16). The roundings are the bf16 kernels'
// (g, u and each expert's output rounded to the activation dtype, silu_and_mul's, the combine
// in float32 rounded once).
//
// Why: a decode step of a few tokens reads a few experts, and FP8 halves their bytes; the
// Triton FP8 path (pydaemon/layers/moe/triton_moe_fp8.py) takes 5 launches a layer (align,
// two GEMMs, SiLU-and-mul, the sum) where these take 2, and at one token a MoE model's step is
// dominated by launches (Qwen3-30B-A3B FP8 at batch 1: ~0.8 ms of weights in a 4-6 ms step).
//
// Layout of the work as in moe_decode_kernels.cu: gate_up, a block per (slot, kFp8Cols columns),
// x[t] read from global memory (L1), each warp two columns (their gate and up rows); down_combine,
// a block per (token, kFp8DownTileH outputs), warps taking (expert, two rows) items. Each lane
// keeps kFp8Batch vectors of every row in flight. Graph-capturable, any routing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "moe_kernels.h"

namespace pagedd::cuda {

namespace {

constexpr int kFp8Warps = 4;
constexpr int kFp8ColsPerWarp = 2;
constexpr int kFp8Cols = kFp8Warps * kFp8ColsPerWarp;
constexpr int kFp8Batch = 4;
constexpr int kFp8DownWarps = 8;
constexpr int kFp8DownRowsPerWarp = 2;
constexpr int kFp8DownTileH = 8;
constexpr int kFp8Vec = 16;  // e4m3 values per 16-byte load
static_assert(kFp8DownTileH % kFp8DownRowsPerWarp == 0, "a warp's rows lie in one tile");

// 16 e4m3 values -> float.
__device__ __forceinline__ void e4m3x16_to_float(const uint4& v, float (&f)[16]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * h));
      const __half2 two = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
      const float2 ff = __half22float2(two);
      f[4 * w + 2 * h] = ff.x;
      f[4 * w + 2 * h + 1] = ff.y;
    }
  }
}

// 16 activations (two 16-byte vectors of bf16 / fp16) -> float.
template <typename T>
__device__ __forceinline__ void act16_to_float(const T* p, int i, float (&f)[16]) {
  using V = Vec<T, 8>;
  const V a = reinterpret_cast<const V*>(p)[2 * i];
  const V b = reinterpret_cast<const V*>(p)[2 * i + 1];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    f[j] = to_float(a.v[j]);
    f[8 + j] = to_float(b.v[j]);
  }
}

// The scale of row `row` of expert e at vector i (values 16 i .. 16 i + 15): per channel,
// w_scale[e, row] is applied after the sum instead (returns 1); per block, the block's.
struct Fp8Scales {
  const float* w_scale;
  int rows, cols;        // of one expert's weight
  int block_n, block_k;  // 0, 0: per channel
  __device__ __forceinline__ float channel(int e, int row) const {
    return block_n == 0 ? w_scale[(int64_t)e * rows + row] : 1.0f;
  }
  __device__ __forceinline__ float block(int e, int row, int i) const {
    const int row_blocks = (rows + block_n - 1) / block_n;
    const int col_blocks = (cols + block_k - 1) / block_k;
    return w_scale[((int64_t)e * row_blocks + row / block_n) * col_blocks + i * kFp8Vec / block_k];
  }
};

// sums[r] = sum_k w[row_r, k] * v[k] over n values (n % 16 == 0, rows and v 16-byte aligned),
// the block scales folded in per vector when BLOCK (the channel scales are the caller's);
// every lane gets the sums.
template <typename T, int R, bool BLOCK>
__device__ __forceinline__ void warp_dots_fp8(const uint8_t* const (&rows)[R],
                                              const int (&row_ids)[R], int e, const Fp8Scales& s,
                                              const T* v, int n, float (&sums)[R]) {
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const int num_vecs = n / kFp8Vec;
  for (int i0 = threadIdx.x % 32; i0 < num_vecs; i0 += 32 * kFp8Batch) {
    uint4 w[kFp8Batch][R];
#pragma unroll
    for (int b = 0; b < kFp8Batch; ++b) {
      const int i = i0 + 32 * b;
#pragma unroll
      for (int r = 0; r < R; ++r)
        w[b][r] =
            i < num_vecs ? reinterpret_cast<const uint4*>(rows[r])[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < kFp8Batch; ++b) {
      const int i = i0 + 32 * b;
      if (i >= num_vecs) break;  // the zeros loaded past the end add nothing anyway
      float a[16];
      act16_to_float(v, i, a);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[16];
        e4m3x16_to_float(w[b][r], wf);
        float part = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) part = fmaf(a[j], wf[j], part);
        acc[r] = BLOCK ? fmaf(part, s.block(e, row_ids[r], i), acc[r]) : acc[r] + part;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) sums[r] = warp_sum(acc[r]);
}

__device__ __forceinline__ bool is_expert(int e, int num_experts) {
  return e >= 0 && e < num_experts;
}

// grid (ceil(intermediate / kFp8Cols), num_tokens * top_k). x[t] is read from global memory
// by every warp (8 KB at H 4096: L1 serves the block's other warps), not staged in shared
// memory: no barrier stands between a block's start and its first weight loads.
template <typename T, bool BLOCK>
__global__ void __launch_bounds__(kFp8Warps * 32)
    moe_decode_gate_up_fp8_kernel(MoeDecodeGateUpParams p, Fp8Scales s) {
  const int slot = blockIdx.y, t = slot / p.top_k;
  const int H = p.hidden, I = p.intermediate;
  const int e = p.topk_ids[slot];
  const int c0 = blockIdx.x * kFp8Cols;
  T* act = static_cast<T*>(p.act) + (int64_t)slot * I;
  if (!is_expert(e, p.num_experts)) {  // uniform over the block: reads no weights
    const int c = c0 + threadIdx.x;
    if (threadIdx.x < kFp8Cols && c < I) act[c] = from_float<T>(0.0f);
    return;
  }
  const T* x = static_cast<const T*>(p.x) + (int64_t)t * p.x_stride;
  const int c_first = c0 + (threadIdx.x / 32) * kFp8ColsPerWarp;
  if (c_first >= I) return;  // uniform over the warp
  const uint8_t* w13 = static_cast<const uint8_t*>(p.w13) + (int64_t)e * 2 * I * H;
  constexpr int R = 2 * kFp8ColsPerWarp;
  const uint8_t* rows[R];
  int row_ids[R];
#pragma unroll
  for (int cc = 0; cc < kFp8ColsPerWarp; ++cc) {
    const int c = min(c_first + cc, I - 1);  // past the end: a valid row, its result dropped
    row_ids[2 * cc] = c;
    row_ids[2 * cc + 1] = I + c;
    rows[2 * cc] = w13 + (int64_t)c * H;
    rows[2 * cc + 1] = w13 + (int64_t)(I + c) * H;
  }
  float sums[R];
  warp_dots_fp8<T, R, BLOCK>(rows, row_ids, e, s, x, H, sums);
  if (threadIdx.x % 32 != 0) return;
#pragma unroll
  for (int cc = 0; cc < kFp8ColsPerWarp; ++cc) {
    if (c_first + cc >= I) break;
    const float g = round_to<T>(sums[2 * cc] * s.channel(e, row_ids[2 * cc]));
    const float u = round_to<T>(sums[2 * cc + 1] * s.channel(e, row_ids[2 * cc + 1]));
    const float silu = round_to<T>(g / (1.0f + expf(-g)));
    act[c_first + cc] = from_float<T>(silu * u);
  }
}

// grid (ceil(hidden / kFp8DownTileH), num_tokens).
template <typename T, bool BLOCK>
__global__ void __launch_bounds__(kFp8DownWarps * 32)
    moe_decode_down_combine_fp8_kernel(MoeDecodeDownParams p, Fp8Scales s) {
  __shared__ float y[kMoeMaxTopK][kFp8DownTileH];  // expert outputs of the tile, rounded to T
  constexpr int kItemsPerExpert = kFp8DownTileH / kFp8DownRowsPerWarp;
  const int t = blockIdx.y, K = p.top_k;
  const int H = p.hidden, I = p.intermediate;
  const int h0 = blockIdx.x * kFp8DownTileH;
  const T* act = static_cast<const T*>(p.act);
  const uint8_t* w2 = static_cast<const uint8_t*>(p.w2);
  for (int item = threadIdx.x / 32; item < K * kItemsPerExpert; item += kFp8DownWarps) {
    const int j = item / kItemsPerExpert, hh = (item % kItemsPerExpert) * kFp8DownRowsPerWarp;
    const int slot = t * K + j;
    const int e = p.topk_ids[slot];
    float sums[kFp8DownRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kFp8DownRowsPerWarp; ++r) sums[r] = 0.0f;
    int row_ids[kFp8DownRowsPerWarp];
    if (is_expert(e, p.num_experts)) {  // uniform over the warp; else the slot adds zero
      const uint8_t* rows[kFp8DownRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kFp8DownRowsPerWarp; ++r) {
        row_ids[r] = min(h0 + hh + r, H - 1);  // past the end: a valid row, never summed
        rows[r] = w2 + ((int64_t)e * H + row_ids[r]) * I;
      }
      warp_dots_fp8<T, kFp8DownRowsPerWarp, BLOCK>(rows, row_ids, e, s, act + (int64_t)slot * I, I,
                                                   sums);
#pragma unroll
      for (int r = 0; r < kFp8DownRowsPerWarp; ++r) sums[r] *= s.channel(e, row_ids[r]);
    }
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int r = 0; r < kFp8DownRowsPerWarp; ++r) y[j][hh + r] = round_to<T>(sums[r]);
    }
  }
  __syncthreads();
  const int h = h0 + threadIdx.x;
  if (threadIdx.x >= kFp8DownTileH || h >= H) return;
  const float* w = p.topk_weights + (int64_t)t * K;
  float acc = 0.0f;
  for (int j = 0; j < K; ++j) acc += w[j] * y[j][threadIdx.x];  // moe_combine's sum, j in order
  static_cast<T*>(p.out)[(int64_t)t * p.out_stride + h] = from_float<T>(acc);
}

bool valid_fp8_sizes(int num_tokens, int top_k, int num_experts, int hidden, int intermediate,
                     const MoeDecodeFp8Scales& s) {
  const bool block_ok = (s.block_n == 0 && s.block_k == 0) ||
                        (s.block_n > 0 && s.block_k > 0 && s.block_k % kFp8Vec == 0);
  return num_tokens >= 0 && top_k >= 1 && top_k <= kMoeMaxTopK && num_experts >= 1 && hidden >= 1 &&
         intermediate >= 1 && hidden % kFp8Vec == 0 && intermediate % kFp8Vec == 0 && block_ok &&
         s.w_scale != nullptr;
}

template <typename T>
cudaError_t launch_gate_up_fp8(const MoeDecodeGateUpParams& p, const Fp8Scales& s,
                               cudaStream_t stream) {
  const dim3 grid((p.intermediate + kFp8Cols - 1) / kFp8Cols, p.num_tokens * p.top_k);
  if (s.block_n > 0)
    moe_decode_gate_up_fp8_kernel<T, true><<<grid, kFp8Warps * 32, 0, stream>>>(p, s);
  else
    moe_decode_gate_up_fp8_kernel<T, false><<<grid, kFp8Warps * 32, 0, stream>>>(p, s);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_down_fp8(const MoeDecodeDownParams& p, const Fp8Scales& s, cudaStream_t stream) {
  const dim3 grid((p.hidden + kFp8DownTileH - 1) / kFp8DownTileH, p.num_tokens);
  if (s.block_n > 0)
    moe_decode_down_combine_fp8_kernel<T, true><<<grid, kFp8DownWarps * 32, 0, stream>>>(p, s);
  else
    moe_decode_down_combine_fp8_kernel<T, false><<<grid, kFp8DownWarps * 32, 0, stream>>>(p, s);
  return cudaGetLastError();
}

}  // namespace

cudaError_t moe_decode_gate_up_fp8(const MoeDecodeGateUpParams& p, const MoeDecodeFp8Scales& s,
                                   cudaStream_t stream) {
  if (!valid_fp8_sizes(p.num_tokens, p.top_k, p.num_experts, p.hidden, p.intermediate, s) ||
      p.hidden > kMoeDecodeMaxHidden || (int64_t)p.num_tokens * p.top_k > kMoeDecodeMaxRows ||
      (p.num_tokens > 1 && (p.x_stride < p.hidden || p.x_stride % 8 != 0)) || !is_aligned16(p.x) ||
      !is_aligned16(p.w13))
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;  // a grid of 0 blocks is a launch error
  const Fp8Scales scales{s.w_scale, 2 * p.intermediate, p.hidden, s.block_n, s.block_k};
  switch (p.dtype) {
    case DType::kFloat16:
      return launch_gate_up_fp8<__half>(p, scales, stream);
    case DType::kBFloat16:
      return launch_gate_up_fp8<__nv_bfloat16>(p, scales, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t moe_decode_down_combine_fp8(const MoeDecodeDownParams& p, const MoeDecodeFp8Scales& s,
                                        cudaStream_t stream) {
  if (!valid_fp8_sizes(p.num_tokens, p.top_k, p.num_experts, p.hidden, p.intermediate, s) ||
      p.num_tokens > kMoeDecodeMaxRows || (p.num_tokens > 1 && p.out_stride < p.hidden) ||
      !is_aligned16(p.act) || !is_aligned16(p.w2))
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  const Fp8Scales scales{s.w_scale, p.hidden, p.intermediate, s.block_n, s.block_k};
  switch (p.dtype) {
    case DType::kFloat16:
      return launch_down_fp8<__half>(p, scales, stream);
    case DType::kBFloat16:
      return launch_down_fp8<__nv_bfloat16>(p, scales, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace pagedd::cuda
