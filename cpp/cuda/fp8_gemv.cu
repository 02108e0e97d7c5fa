// FP8 (e4m3) scaled matrix product for a few rows (decode: 1 to 16 tokens), on FP8 tensor
// cores: out[m, n] = bf16(sum_k xq[m, k] * wq[n, k] * x_scale[m] * w_scale[n]) (layer_kernels.h).
//
// At a few tokens the product is a pass over the weights (N * K bytes); cuBLASLt's scaled GEMM
// tiles M by 64 or more and reaches a fraction of the memory bandwidth there. Here one warp
// owns 8 weight rows (an n8 tile of mma.m16n8k32.e4m3, the tokens padded to m16) and a quarter
// of K; the four warps of a block add their partial sums in shared memory.
//
// Each lane loads 16 consecutive bytes of its weight row and of its token rows per step and
// feeds them to two mma's. The mma's k positions of lane (group g, thread t) are t*4 + j and
// 16 + t*4 + j; the bytes a lane loads are real k's kb + t*16 + [0, 16): every lane with the
// same t maps positions to real k's the same way, for A (tokens) and B (weights) alike, so the
// products pair the same k's and the sum over k is the dot product (a permutation of k).
// FP8 x FP8 products are exact in float32; the sums are float32 (in another order than
// cuBLASLt's); the scales multiply the sum as the emulated path does ((acc * x_scale) *
// w_scale), then one rounding to bf16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "elementwise.cuh"
#include "layer_kernels.h"

namespace pagedd::cuda {

namespace {

constexpr int kWarps = 4;   // split-K ways, one warp each
constexpr int kTileN = 8;   // weight rows per block (mma n8)
constexpr int kStepK = 64;  // bytes of K per warp step: 4 lanes x 16 bytes
constexpr int kUnroll = 4;  // steps whose loads are issued before their mma's (bytes in flight)

// acc += A (16 x 32, e4m3) x B (32 x 8, e4m3). The mma starts from zero and its float32
// result is added on the CUDA cores: the tensor cores' own accumulation keeps fewer bits than
// float32 (as DeepSeek-V3 found for Hopper's FP8 GEMMs), so it only ever sums 32 products.
__device__ __forceinline__ void mma_e4m3(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  float d[4];
  const float zero = 0.f;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(zero));
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] += d[i];
#else
  __trap();  // FP8 tensor cores: compute capability 8.9+ (the launcher checks)
#endif
}

__device__ __forceinline__ uint4 load16(const uint8_t* ptr, bool valid) {
  return valid ? __ldg(reinterpret_cast<const uint4*>(ptr)) : make_uint4(0, 0, 0, 0);
}

__global__ void __launch_bounds__(kWarps * 32)
    fp8_gemv_kernel(__nv_bfloat16* __restrict__ out, const uint8_t* __restrict__ xq,
                    const float* __restrict__ x_scale, const uint8_t* __restrict__ wq,
                    const float* __restrict__ w_scale, int64_t out_stride, int64_t x_stride,
                    int m_rows, int n, int k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * kTileN;
  const bool w_ok = n0 + g < n;
  const bool x_lo = g < m_rows, x_hi = g + 8 < m_rows;
  const uint8_t* w_row = wq + (int64_t)(w_ok ? n0 + g : 0) * k;
  const uint8_t* x_lo_row = xq + (int64_t)(x_lo ? g : 0) * x_stride;
  const uint8_t* x_hi_row = xq + (int64_t)(x_hi ? g + 8 : 0) * x_stride;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const int num_steps = (k + kStepK - 1) / kStepK;
  // Warp w takes steps w, w + 4, ...: the four warps stream interleaved stretches of K.
  for (int step = warp; step < num_steps; step += kWarps * kUnroll) {
    uint4 w[kUnroll], lo[kUnroll], hi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = step + u * kWarps;
      const int kb = s * kStepK + t * 16;
      const bool in_k = s < num_steps && kb < k;  // k % 16 == 0: a chunk is all in or out
      w[u] = load16(w_row + kb, in_k && w_ok);
      lo[u] = load16(x_lo_row + kb, in_k && x_lo);
      hi[u] = load16(x_hi_row + kb, in_k && x_hi);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      mma_e4m3(c, lo[u].x, hi[u].x, lo[u].y, hi[u].y, w[u].x, w[u].y);
      mma_e4m3(c, lo[u].z, hi[u].z, lo[u].w, hi[u].w, w[u].z, w[u].w);
    }
  }
  // c[0], c[1]: token g, weight rows n0 + t*2 + {0, 1}; c[2], c[3]: token g + 8.
  __shared__ float partial[kWarps - 1][32][4];
  if (warp > 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp - 1][lane][i] = c[i];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w2 = 0; w2 < kWarps - 1; ++w2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] += partial[w2][lane][i];
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0);
    const int col = n0 + t * 2 + (i & 1);
    if (row < m_rows && col < n) {
      const float y = __fmul_rn(__fmul_rn(c[i], x_scale[row]), w_scale[col]);
      out[row * out_stride + col] = __float2bfloat16_rn(y);
    }
  }
}

}  // namespace

cudaError_t fp8_gemv(const Fp8GemvParams& p, cudaStream_t stream) {
  if (p.m <= 0 || p.m > kFp8GemvMaxRows || p.n <= 0 || p.k <= 0 || p.k % 16 ||
      p.x_stride % 16 || !is_aligned16(p.xq) || !is_aligned16(p.wq))
    return cudaErrorInvalidValue;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static int capability[64] = {};  // per device, asked once (a benign race at worst)
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  if (capability[device] == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    capability[device] = major * 10 + minor;
  }
  if (capability[device] < 89) return cudaErrorNotSupported;
  const int blocks = (p.n + kTileN - 1) / kTileN;
  fp8_gemv_kernel<<<blocks, kWarps * 32, 0, stream>>>(
      static_cast<__nv_bfloat16*>(p.out), static_cast<const uint8_t*>(p.xq), p.x_scale,
      static_cast<const uint8_t*>(p.wq), p.w_scale, p.out_stride, p.x_stride, p.m, p.n, p.k);
  return cudaGetLastError();
}

}  // namespace pagedd::cuda
