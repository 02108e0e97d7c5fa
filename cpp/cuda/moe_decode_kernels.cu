// The experts of a mixture-of-experts layer for a few tokens, in two kernels (moe_kernels.h):
//
//   moe_decode_gate_up:      act[s, c] = silu(round(x[t] . w13[e, c])) * round(x[t] . w13[e, I+c])
//   moe_decode_down_combine: out[t, h] = round(sum_j w[t, j] * round(act[s_j] . w2[e_j, h]))
//
// At one decode token the unfused path is align, a gather, two grouped GEMMs over every expert
// group (all but top_k of them empty), SiLU-and-mul and the combine: ~79 us a layer on an H200
// for the Qwen3-30B-A3B shape, where reading the 8 experts' 75 MB takes ~16 us. Here each slot
// reads its expert's rows once, 16 bytes a load, float32 sums; the roundings are the unfused
// path's (bf16 / fp16 GEMM outputs, silu_and_mul's, moe_combine's), so the two agree up to
// summation order.
//
// Decode is latency-bound: the kernels spread the rows over many warps, and each warp reads
// several rows against one activation vector with all their loads of an iteration in flight.
// Nothing is read back to the host and nothing is allocated: graph-capturable, any routing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "moe_kernels.h"

namespace pagedd::cuda {

namespace {

// gate_up: a block is one slot's kGateUpCols columns c; each warp reads the gate and up rows
// of kGateUpColsPerWarp columns (4 rows) together. Qwen3-30B-A3B at one token: 8 slots x 96
// blocks of 4 warps. Each lane has 4 x 4 16-byte weight loads in flight (kGateUpBatch):
// H 2048 is 8 loads a row per lane, two batches.
constexpr int kGateUpWarps = 4;
constexpr int kGateUpColsPerWarp = 2;
constexpr int kGateUpCols = kGateUpWarps * kGateUpColsPerWarp;
constexpr int kGateUpBatch = 4;
// down_combine: a block is one token's kDownTileH outputs h; its warps take the (expert j,
// kDownRowsPerWarp consecutive rows h) items in turn, each item's rows against act[s_j].
// Qwen3-30B-A3B at one token: 256 blocks of 8 warps, 4 items a warp; I 768 is 3 loads a row
// per lane, one batch of kDownBatch.
constexpr int kDownWarps = 8;
constexpr int kDownRowsPerWarp = 2;
constexpr int kDownTileH = 8;
constexpr int kDownBatch = 4;
static_assert(kDownTileH % kDownRowsPerWarp == 0, "a warp's rows lie in one tile");

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* p, int i) {
  return reinterpret_cast<const Vec<T, VEC>*>(p)[i];
}

// sums[r] = rows[r][0:n] . v[0:n], float32, for R rows; the n elements are split over the
// warp's lanes VEC at a time (VEC > 1: n % VEC == 0 and every row and v 16-byte aligned), and
// every lane gets the sums. A lane loads BATCH vectors of every row (and of v) before it
// multiplies any: R * BATCH 16-byte loads in flight per lane, whatever the compiler schedules.
template <typename T, int VEC, int R, int BATCH>
__device__ __forceinline__ void warp_dots(const T* const (&rows)[R], const T* v, int n,
                                          float (&sums)[R]) {
  using V = Vec<T, VEC>;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const int num_vecs = n / VEC;
  for (int i0 = threadIdx.x % 32; i0 < num_vecs; i0 += 32 * BATCH) {
    V w[BATCH][R], a[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = i0 + 32 * b;
      if (i < num_vecs) {
#pragma unroll
        for (int r = 0; r < R; ++r) w[b][r] = load_vec<T, VEC>(rows[r], i);
        a[b] = load_vec<T, VEC>(v, i);
      } else {  // past the end: zeros add nothing
#pragma unroll
        for (int j = 0; j < VEC; ++j) a[b].v[j] = from_float<T>(0.0f);
#pragma unroll
        for (int r = 0; r < R; ++r) w[b][r] = a[b];
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          acc[r] = fmaf(to_float(a[b].v[j]), to_float(w[b][r].v[j]), acc[r]);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) sums[r] = warp_sum(acc[r]);
}

__device__ __forceinline__ bool is_expert(int e, int num_experts) {
  return e >= 0 && e < num_experts;
}

// grid (ceil(intermediate / kGateUpCols), num_tokens * top_k); dynamic shared memory: hidden
// elements (x[t], read by every warp of the block).
template <typename T, int VEC>
__global__ void __launch_bounds__(kGateUpWarps * 32)
    moe_decode_gate_up_kernel(MoeDecodeGateUpParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);
  const int s = blockIdx.y, t = s / p.top_k;
  const int H = p.hidden, I = p.intermediate;
  const int e = p.topk_ids[s];
  const int c0 = blockIdx.x * kGateUpCols;
  T* act = static_cast<T*>(p.act) + (int64_t)s * I;
  if (!is_expert(e, p.num_experts)) {  // uniform over the block: reads no weights
    const int c = c0 + threadIdx.x;
    if (threadIdx.x < kGateUpCols && c < I) act[c] = from_float<T>(0.0f);
    return;
  }
  const T* x = static_cast<const T*>(p.x) + (int64_t)t * p.x_stride;
  for (int i = threadIdx.x; i < H / VEC; i += blockDim.x)
    reinterpret_cast<Vec<T, VEC>*>(xs)[i] = load_vec<T, VEC>(x, i);
  __syncthreads();
  const int c_first = c0 + (threadIdx.x / 32) * kGateUpColsPerWarp;
  if (c_first >= I) return;  // uniform over the warp, after the block's only barrier
  const T* w13 = static_cast<const T*>(p.w13) + (int64_t)e * 2 * I * H;
  constexpr int R = 2 * kGateUpColsPerWarp;
  const T* rows[R];
#pragma unroll
  for (int cc = 0; cc < kGateUpColsPerWarp; ++cc) {
    const int c = min(c_first + cc, I - 1);  // past the end: a valid row, its result dropped
    rows[2 * cc] = w13 + (int64_t)c * H;
    rows[2 * cc + 1] = w13 + (int64_t)(I + c) * H;
  }
  float sums[R];
  warp_dots<T, VEC, R, kGateUpBatch>(rows, xs, H, sums);
  if (threadIdx.x % 32 != 0) return;
#pragma unroll
  for (int cc = 0; cc < kGateUpColsPerWarp; ++cc) {
    if (c_first + cc >= I) break;
    // gate and up as the grouped GEMM stores them, then silu_and_mul.cu's product exactly:
    // silu(gate) rounded to T, times up in float32, rounded.
    const float g = round_to<T>(sums[2 * cc]), u = round_to<T>(sums[2 * cc + 1]);
    const float silu = round_to<T>(g / (1.0f + expf(-g)));
    act[c_first + cc] = from_float<T>(silu * u);
  }
}

// grid (ceil(hidden / kDownTileH), num_tokens).
template <typename T, int VEC>
__global__ void __launch_bounds__(kDownWarps * 32)
    moe_decode_down_combine_kernel(MoeDecodeDownParams p) {
  __shared__ float y[kMoeMaxTopK][kDownTileH];  // expert outputs of the tile, rounded to T
  constexpr int kItemsPerExpert = kDownTileH / kDownRowsPerWarp;
  const int t = blockIdx.y, K = p.top_k;
  const int H = p.hidden, I = p.intermediate;
  const int h0 = blockIdx.x * kDownTileH;
  const T* act = static_cast<const T*>(p.act);
  const T* w2 = static_cast<const T*>(p.w2);
  for (int item = threadIdx.x / 32; item < K * kItemsPerExpert; item += kDownWarps) {
    const int j = item / kItemsPerExpert, hh = (item % kItemsPerExpert) * kDownRowsPerWarp;
    const int s = t * K + j;
    const int e = p.topk_ids[s];
    float sums[kDownRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kDownRowsPerWarp; ++r) sums[r] = 0.0f;
    if (is_expert(e, p.num_experts)) {  // uniform over the warp; else the slot adds zero
      const T* rows[kDownRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kDownRowsPerWarp; ++r) {
        const int h = min(h0 + hh + r, H - 1);  // past the end: a valid row, never summed
        rows[r] = w2 + ((int64_t)e * H + h) * I;
      }
      warp_dots<T, VEC, kDownRowsPerWarp, kDownBatch>(rows, act + (int64_t)s * I, I, sums);
    }
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int r = 0; r < kDownRowsPerWarp; ++r) y[j][hh + r] = round_to<T>(sums[r]);
    }
  }
  __syncthreads();
  const int h = h0 + threadIdx.x;
  if (threadIdx.x >= kDownTileH || h >= H) return;
  const float* w = p.topk_weights + (int64_t)t * K;
  float acc = 0.0f;
  for (int j = 0; j < K; ++j) acc += w[j] * y[j][threadIdx.x];  // moe_combine's sum, j in order
  static_cast<T*>(p.out)[(int64_t)t * p.out_stride + h] = from_float<T>(acc);
}

template <typename T>
cudaError_t launch_gate_up(const MoeDecodeGateUpParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  // Every row of x and of w13 starts 16-byte aligned when hidden and x's row stride are
  // multiples of VEC and the base addresses are aligned.
  const bool can_vec = p.hidden % VEC == 0 && p.x_stride % VEC == 0 && is_aligned16(p.x) &&
                       is_aligned16(p.w13);
  const dim3 grid((p.intermediate + kGateUpCols - 1) / kGateUpCols, p.num_tokens * p.top_k);
  const size_t smem = (size_t)p.hidden * sizeof(T);
  if (can_vec)
    moe_decode_gate_up_kernel<T, VEC><<<grid, kGateUpWarps * 32, smem, stream>>>(p);
  else
    moe_decode_gate_up_kernel<T, 1><<<grid, kGateUpWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_down(const MoeDecodeDownParams& p, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const bool can_vec =
      p.intermediate % VEC == 0 && is_aligned16(p.act) && is_aligned16(p.w2);
  const dim3 grid((p.hidden + kDownTileH - 1) / kDownTileH, p.num_tokens);
  if (can_vec)
    moe_decode_down_combine_kernel<T, VEC><<<grid, kDownWarps * 32, 0, stream>>>(p);
  else
    moe_decode_down_combine_kernel<T, 1><<<grid, kDownWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

bool valid_sizes(int num_tokens, int top_k, int num_experts, int hidden, int intermediate) {
  return num_tokens >= 0 && top_k >= 1 && top_k <= kMoeMaxTopK && num_experts >= 1 &&
         hidden >= 1 && intermediate >= 1;
}

}  // namespace

cudaError_t moe_decode_gate_up(const MoeDecodeGateUpParams& p, cudaStream_t stream) {
  if (!valid_sizes(p.num_tokens, p.top_k, p.num_experts, p.hidden, p.intermediate) ||
      p.hidden > kMoeDecodeMaxHidden || (int64_t)p.num_tokens * p.top_k > kMoeDecodeMaxRows ||
      (p.num_tokens > 1 && p.x_stride < p.hidden))
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;  // a grid of 0 blocks is a launch error
  switch (p.dtype) {
    case DType::kFloat16: return launch_gate_up<__half>(p, stream);
    case DType::kBFloat16: return launch_gate_up<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t moe_decode_down_combine(const MoeDecodeDownParams& p, cudaStream_t stream) {
  if (!valid_sizes(p.num_tokens, p.top_k, p.num_experts, p.hidden, p.intermediate) ||
      p.num_tokens > kMoeDecodeMaxRows || (p.num_tokens > 1 && p.out_stride < p.hidden))
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_down<__half>(p, stream);
    case DType::kBFloat16: return launch_down<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedd::cuda
