// Paged prefill attention on Hopper warpgroup MMA (wgmma.mma_async, sm_90a only).
//
// Same parameters, grid and row packing as paged_prefill_kernel.cuh (the mma.sync kernel):
// grid (num_kv_heads, row tiles, num_seqs), the rows of a sequence are its query tokens times
// the query heads of one kv head's group, packed token-major (row i = token i / group, head
// i % group), so K/V are read once per kv head. A thread block is two warpgroups (256 threads)
// of 64 rows each: BLOCK_M = 128 rows. Every thread also loads: K/V tiles of BLOCK_N keys go
// by cp.async through the block table into a three-stage ring of 128-byte-swizzled shared
// memory (the layout wgmma_utils.cuh describes). Iteration n, per warpgroup:
//   S_n = Q K_n^T      wgmma m64 x BLOCK_N x 16, Q and K from shared memory (K-major), fp32 S
//                      in registers (HEAD_DIM / 16 wgmma, one commit group)
//   O += P_{n-1} V_{n-1}  issued right after (P of the previous tile in registers as wgmma's
//                      A fragment: the accumulator layout lines up, see wgmma_utils.cuh; V
//                      from shared memory N-major, trans-b), fp32 O in registers
//   softmax of S_n     while that P V runs (flash-attention 3's intra-warpgroup overlap):
//                      causal mask only on tiles reaching past the warpgroup's first token,
//                      row max / sum across the 4 lanes sharing a row, exp2 with folded scale
//   O *= alpha         after the P V completes, only when some row's max moved (per warp)
//   P_n -> registers   as the next iteration's A fragments
// Tile n - 1 (its V) and tile n (its K) are in use while tile n + 1 loads: three stages, one
// __syncthreads per tile. No producer warp and no ping-pong between the warpgroups (both are
// in flash-attention 3): they meet at that barrier once per tile.
// A warpgroup whose rows are all padding, or whose keys end before this tile, skips the math
// (the condition is warpgroup-uniform, as wgmma requires) but still loads.
// fp16 and bf16 K/V only: an fp8 cache runs the mma.sync kernel.
#pragma once

#include <cmath>

#include "dtype_utils.cuh"
#include "mma_utils.cuh"
#include "pagedd_cuda.h"
#include "wgmma_utils.cuh"

namespace pagedd::cuda {

template <int HEAD_DIM, int BLOCK_N, int STAGES>
struct PrefillSm90Tile {
  static constexpr int WARPGROUPS = 2;
  static constexpr int BLOCK_M = 64 * WARPGROUPS;
  static constexpr int THREADS = 128 * WARPGROUPS;
  static constexpr int CHUNKS = HEAD_DIM / 8;                 // 16-byte chunks per row
  static constexpr int K_STEPS = HEAD_DIM / 16;               // k steps of S = Q K^T
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;      // [HEAD_DIM / 64][BLOCK_M][64]
  static constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2;     // one K or V tile, same layout
  // + 1024: the tiles are aligned to 1024 bytes by hand (the swizzle follows the address).
  static constexpr size_t SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES + 1024;
  static_assert(HEAD_DIM % 64 == 0, "128-byte swizzle slabs of 64 elements");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "wgmma n of S");
  static_assert((BLOCK_N * CHUNKS) % THREADS == 0 && (BLOCK_M * CHUNKS) % THREADS == 0,
                "whole chunks per thread");
};

// Byte offset of 16-byte chunk ch of row r in a 128-byte-swizzled tile of `rows` rows:
// slab ch / 8 (64 elements), row r (128 bytes), chunk (ch % 8) ^ (r % 8).
__device__ __forceinline__ uint32_t swizzled_offset(int r, int ch, int rows) {
  return (uint32_t)((ch >> 3) * rows * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

template <typename scalar_t, int HEAD_DIM, int BLOCK_N, int STAGES>
__global__ void __launch_bounds__(256, 1)
    paged_prefill_sm90_kernel(const PagedPrefillParams p, int block_shift) {
#if defined(PAGEDD_WGMMA_DEVICE)
  using T = PrefillSm90Tile<HEAD_DIM, BLOCK_N, STAGES>;
  using MMA = Mma<scalar_t>;
  constexpr int BM = T::BLOCK_M, BN = BLOCK_N, CHUNKS = T::CHUNKS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t pad = (1024u - (raw_addr & 1023u)) & 1023u;
  unsigned char* s_q = smem_raw + pad;               // [HEAD_DIM / 64][BM][64], swizzled
  unsigned char* s_k = s_q + T::Q_BYTES;             // [STAGES][HEAD_DIM / 64][BN][64]
  unsigned char* s_v = s_k + STAGES * T::KV_BYTES;   // same
  const uint32_t q_addr = raw_addr + pad;
  const uint32_t k_addr = q_addr + T::Q_BYTES;
  const uint32_t v_addr = k_addr + STAGES * T::KV_BYTES;

  const int kv_head = blockIdx.x, seq = blockIdx.z;
  const int tile = gridDim.y - 1 - blockIdx.y;  // causal: later tiles have more keys
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int ctx = p.seq_lens[seq];
  const int num_rows = q_len * group;
  scalar_t* out = static_cast<scalar_t*>(p.out);
  auto out_row = [&](int i) -> scalar_t* {
    const int64_t q_head = kv_head * group + i % group;
    return out + ((int64_t)(q_start + i / group) * p.num_q_heads + q_head) * HEAD_DIM;
  };
  auto fill_nan = [&](int from, int to) {
    for (int x = tid; x < (to - from) * HEAD_DIM; x += blockDim.x)
      out_row(from + x / HEAD_DIM)[x % HEAD_DIM] =
          Convert<scalar_t>::from_float(__int_as_float(0x7fc00000));
  };
  // Rows past the grid (max_query_len understated) get NaN, loudly, rather than nothing.
  if (tile == (int)gridDim.y - 1 && num_rows > (int)gridDim.y * BM)
    fill_nan(gridDim.y * BM, num_rows);
  const int m0 = tile * BM;
  if (m0 >= num_rows) return;
  const int m_end = min(m0 + BM, num_rows);
  if (q_len > ctx) {  // inconsistent metadata: the new tokens cannot outnumber the context
    fill_nan(m0, m_end);
    return;
  }
  const int prefix = ctx - q_len;                      // cached tokens before the new ones
  const int n_end = prefix + (m_end - 1) / group + 1;  // keys [0, n_end) reach some row
  const int num_n_tiles = (n_end + BN - 1) / BN;

  // Q tile -> shared memory (rows past the end zero-filled).
  const scalar_t* query = static_cast<const scalar_t*>(p.query);
#pragma unroll
  for (int it = 0; it < BM * CHUNKS / T::THREADS; ++it) {
    const int x = tid + it * T::THREADS;
    const int r = x / CHUNKS, ch = x % CHUNKS, i = m0 + r;
    const bool valid = i < num_rows;
    const scalar_t* src = query;
    if (valid)
      src += (int64_t)(q_start + i / group) * p.q_token_stride +
             (int64_t)(kv_head * group + i % group) * p.q_head_stride + ch * 8;
    cp_async16_zfill(s_q + swizzled_offset(r, ch, BM), src, valid);
  }

  const int32_t* block_table = p.block_tables + (int64_t)seq * p.block_table_stride;
  const scalar_t* k_base =
      static_cast<const scalar_t*>(p.key_cache) + (int64_t)kv_head * p.kv_head_stride;
  const scalar_t* v_base =
      static_cast<const scalar_t*>(p.value_cache) + (int64_t)kv_head * p.kv_head_stride;
  const int offset_mask = (1 << block_shift) - 1;
  auto load_kv = [&](int n, int stage) {
    unsigned char* dk = s_k + stage * T::KV_BYTES;
    unsigned char* dv = s_v + stage * T::KV_BYTES;
#pragma unroll
    for (int it = 0; it < BN * CHUNKS / T::THREADS; ++it) {
      const int x = tid + it * T::THREADS;
      const int r = x / CHUNKS, ch = x % CHUNKS, key = n * BN + r;
      const bool valid = key < n_end;  // zero-filled past the end: 0 * garbage is never NaN
      int64_t off = 0;
      if (valid)
        off = (int64_t)block_table[key >> block_shift] * p.kv_block_stride +
              (key & offset_mask) * HEAD_DIM + ch * 8;
      const uint32_t dst = swizzled_offset(r, ch, BN);
      cp_async16_zfill(dk + dst, k_base + off, valid);
      cp_async16_zfill(dv + dst, v_base + off, valid);
    }
  };
  load_kv(0, 0);
  cp_async_commit_group();  // the only group in flight: Q and tile 0

  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int wg = warp / 4;                 // warpgroup: rows 64 wg .. 64 wg + 63 of the tile
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const int row0 = 64 * wg + 16 * (warp % 4) + quad_row;  // this lane's rows: row0, row0 + 8
  const int pos[2] = {prefix + (m0 + row0) / group, prefix + (m0 + row0 + 8) / group};
  // Warpgroup-uniform extent: its first token, and the tiles holding keys its rows see.
  const int wg_m0 = m0 + 64 * wg;
  const bool wg_active = wg_m0 < num_rows;
  const int wg_first_pos = prefix + wg_m0 / group;
  const int wg_n_end = prefix + (min(wg_m0 + 64, num_rows) - 1) / group + 1;
  const int wg_num_tiles = wg_active ? (wg_n_end + BN - 1) / BN : 0;
  const uint32_t sq = q_addr + wg * 64 * 128;  // this warpgroup's 64 rows of every Q slab

  float o[HEAD_DIM / 2];  // O accumulator, wgmma D layout (m64 x HEAD_DIM)
#pragma unroll
  for (int d = 0; d < HEAD_DIM / 2; ++d) o[d] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  float s[BN / 2];           // S of tile n, then its P in fp32; wgmma D layout (m64 x BN)
  uint32_t pa[BN / 16][4];   // P of the previous tile as A fragments (k-step kk: keys 16 kk..)
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
  // Iteration 0 has no previous tile: it multiplies P = 0 by a zeroed V stage (the last one,
  // which tile 2 fills only after that), so that every iteration issues the same wgmma
  // sequence: wgmma under diverging branches makes ptxas serialize all of them.
  for (int x = tid; x < T::KV_BYTES / 16; x += T::THREADS)
    reinterpret_cast<uint4*>(s_v + (STAGES - 1) * T::KV_BYTES)[x] = make_uint4(0, 0, 0, 0);

  // Iteration n issues S_n = Q K_n^T and O += P_{n-1} V_{n-1} back to back, then runs the
  // softmax of S_n while P_{n-1} V_{n-1} is still on the tensor cores (flash-attention 3's
  // intra-warpgroup overlap). So tile n - 1 (its V) and tile n (its K) are both in use while
  // tile n + 1 loads: three stages. One extra iteration drains the last P V.
  static_assert(STAGES == 3, "stages n - 1, n in use, n + 1 loading");
  for (int n = 0; n <= num_n_tiles; ++n) {
    if (n < num_n_tiles) cp_async_wait_group<0>();  // tile n (and Q) landed for this thread,
    fence_proxy_async_shared();  // is visible to wgmma's async proxy (as the zeroed stage) ...
    // ... and for every thread; every thread is also past iteration n - 1, whose last wgmma
    // (P_{n-2} V_{n-2}) it waited for, so stage (n + 1) % 3 = (n - 2) % 3 is free.
    __syncthreads();
    // Tile n + 1 -> stage (n + 1) % 3: issued after this iteration's wgmma where there are
    // some, so that the block-table reads and address math overlap the tensor cores.
    auto load_next = [&] {
      if (n + 1 < num_n_tiles) load_kv(n + 1, (n + 1) % STAGES);
      cp_async_commit_group();
    };
    // V of tile n - 1 (for n = 0 the zeroed stage).
    const uint32_t sv = v_addr + ((n + STAGES - 1) % STAGES) * T::KV_BYTES;
    if (n < wg_num_tiles) {  // warpgroup-uniform
      const uint32_t sk = k_addr + (n % STAGES) * T::KV_BYTES;
      wgmma_fence_operands(s);
      wgmma_fence_operands(o);
      wgmma_fence();  // orders the softmax / rescale / pack register writes before the wgmma
#pragma unroll
      for (int ks = 0; ks < T::K_STEPS; ++ks) {
        // k-step ks: slab ks / 4 (64 dims), then 32 bytes (16 elements) per step inside it.
        const uint32_t q_ks = sq + (ks / 4) * BM * 128 + (ks % 4) * 32;
        const uint32_t k_ks = sk + (ks / 4) * BN * 128 + (ks % 4) * 32;
        Wgmma<scalar_t, BN>::ss(s, wgmma_desc_sw128(q_ks, 16, 1024),
                                wgmma_desc_sw128(k_ks, 16, 1024), ks > 0);
      }
      wgmma_commit_group();
      // O += P V: V [key][dim] is the N-major B of this product; k-step kk = keys 16 kk ..
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<scalar_t, HEAD_DIM>::rs_tb(o, pa[kk],
                                         wgmma_desc_sw128(sv + kk * 16 * 128, BN * 128, 1024));
      wgmma_commit_group();
      load_next();
      wgmma_wait_group<1>();  // S_n done (groups complete in order); P V may still run
      wgmma_fence_operands(s);

      // Causal mask, only on tiles reaching past the warpgroup's first token.
      if ((n + 1) * BN - 1 > wg_first_pos) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (n * BN + 8 * j + quad_col + (e & 1) > pos[e / 2]) s[4 * j + e] = -INFINITY;
      }
      // Online softmax in the log2 domain; the 4 lanes of a quad share a row.
      float alpha[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          mx = fmaxf(mx, fmaxf(s[4 * j + 2 * rr], s[4 * j + 2 * rr + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_max[rr], mx * scale_log2);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet
        alpha[rr] = fast_exp2(row_max[rr] - m_use);
        row_max[rr] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          s[4 * j + 2 * rr] = fast_exp2(fmaf(s[4 * j + 2 * rr], scale_log2, -m_use));
          s[4 * j + 2 * rr + 1] = fast_exp2(fmaf(s[4 * j + 2 * rr + 1], scale_log2, -m_use));
          sum += s[4 * j + 2 * rr] + s[4 * j + 2 * rr + 1];
        }
        row_sum[rr] = row_sum[rr] * alpha[rr] + sum;
      }
      wgmma_wait_group<0>();  // O = O_{n-1} complete; pa free
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
      // Rescale O to this tile's max only when some row's max moved (warp-uniform branch).
      if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d) {
          o[4 * d] *= alpha[0], o[4 * d + 1] *= alpha[0];
          o[4 * d + 2] *= alpha[1], o[4 * d + 3] *= alpha[1];
        }
      }
      // P_n (the S accumulator columns 16 kk .. 16 kk + 15) as the A fragment of k-step kk.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int q = 0; q < 4; ++q)
          pa[kk][q] = MMA::pack(s[8 * kk + 2 * q], s[8 * kk + 2 * q + 1]);
    } else {
      load_next();
    }
    if (n == wg_num_tiles && n > 0) {  // drain: this warpgroup's last P V
      wgmma_fence_operands(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<scalar_t, HEAD_DIM>::rs_tb(o, pa[kk],
                                         wgmma_desc_sw128(sv + kk * 16 * 128, BN * 128, 1024));
      wgmma_commit_group();
      wgmma_wait_group<0>();
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
    }
  }

  // Normalise and store this lane's rows (pairs of elements, 4-byte stores).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l = row_sum[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int i = m0 + row0 + 8 * rr;
    if (i < num_rows) {
      scalar_t* dst = out_row(i) + quad_col;
#pragma unroll
      for (int d = 0; d < HEAD_DIM / 8; ++d)
        *reinterpret_cast<uint32_t*>(dst + d * 8) =
            MMA::pack(o[4 * d + 2 * rr] * inv, o[4 * d + 2 * rr + 1] * inv);
    }
  }
#endif  // PAGEDD_WGMMA_DEVICE
}

template <typename scalar_t, int HEAD_DIM, int BLOCK_N, int STAGES>
cudaError_t launch_paged_prefill_sm90_tiles(const PagedPrefillParams& p, cudaStream_t stream) {
  using T = PrefillSm90Tile<HEAD_DIM, BLOCK_N, STAGES>;
  auto kernel = paged_prefill_sm90_kernel<scalar_t, HEAD_DIM, BLOCK_N, STAGES>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)T::SMEM_BYTES);
  if (err != cudaSuccess) return err;
  const int64_t rows = (int64_t)p.max_query_len * (p.num_q_heads / p.num_kv_heads);
  const int64_t tiles = rows <= 0 ? 1 : (rows + T::BLOCK_M - 1) / T::BLOCK_M;
  if (tiles > 65535) return cudaErrorInvalidValue;
  int block_shift = 0;
  while ((1 << block_shift) < p.block_size) ++block_shift;
  const dim3 grid(p.num_kv_heads, (unsigned)tiles, p.num_seqs);
  kernel<<<grid, T::THREADS, T::SMEM_BYTES, stream>>>(p, block_shift);
  return cudaGetLastError();
}

// 128 rows x 64 or 128 keys (prefill_wgmma_block_n), three stages (225 KiB of shared memory
// at head 128 with 128 keys).
template <typename scalar_t, int HEAD_DIM>
cudaError_t launch_paged_prefill_sm90_typed(const PagedPrefillParams& p, cudaStream_t stream) {
  if (!prefill_wgmma_tile_is_built(p.block_m, p.block_n)) return cudaErrorInvalidValue;
  if (prefill_wgmma_block_n(p.max_query_len, p.block_n) == 64)
    return launch_paged_prefill_sm90_tiles<scalar_t, HEAD_DIM, 64, 3>(p, stream);
  return launch_paged_prefill_sm90_tiles<scalar_t, HEAD_DIM, 128, 3>(p, stream);
}

template <int HEAD_DIM>
cudaError_t launch_paged_prefill_sm90(const PagedPrefillParams& p, cudaStream_t stream) {
  if (p.cache_dtype == DType::kFp8E4M3) return cudaErrorInvalidValue;
  return p.dtype == DType::kFloat16
             ? launch_paged_prefill_sm90_typed<__half, HEAD_DIM>(p, stream)
             : launch_paged_prefill_sm90_typed<__nv_bfloat16, HEAD_DIM>(p, stream);
}

}  // namespace pagedd::cuda
