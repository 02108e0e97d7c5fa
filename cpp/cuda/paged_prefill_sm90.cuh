// Paged prefill attention on Hopper, warp-specialized (flash-attention 3's structure):
// a producer warp loads K/V tiles with TMA, two consumer warpgroups run the wgmma math.
//
// Same parameters, grid and row packing as paged_prefill_kernel.cuh (the mma.sync kernel):
// grid (num_kv_heads, row tiles, num_seqs), the rows of a sequence are its query tokens times
// the query heads of one kv head's group, packed token-major (row i = token i / group, head
// i % group), so K/V are read once per kv head. BLOCK_M = 128 rows, 384 threads:
//   warpgroup 0, the producer: gives up its registers (setmaxnreg) and one warp issues the
//     TMA loads of tile n's K and V pages (one box per 64-dim slab of each page, through the
//     cache's tensor map: tma_utils.cuh) into stage n % STAGES of separate K and V rings
//     (128-byte swizzled, the layout wgmma reads), after the consumers freed the stage.
//   warpgroups 1 and 2, the consumers (64 rows each, registers raised to 232): Q (their rows,
//     cp.async, once), then per tile:
//       S_n = Q K_n^T          wgmma from shared memory, fp32 S in registers
//       O += P_{n-1} V_{n-1}   issued right after (P in registers as the A fragment)
//       softmax of S_n         while that P V runs (intra-warpgroup overlap)
//       O *= alpha, P_n -> registers
//     Ping-pong: the two warpgroups take turns to issue their wgmma (named barriers), so one
//     warpgroup's softmax runs while the other's GEMMs keep the tensor cores busy.
// Stage release: each consumer warp arrives on the stage's empty barrier once its wgmma that
// read it completed (K after S_n, V after P V).
// Every consumer warpgroup walks every tile of the block in order, also the tiles its rows do
// not reach (it then only waits for and releases them, and keeps its turns), so the barrier
// phases and turns of the two stay in step.
// Keys at and past the sequence's end: pages wholly past it are not loaded, and the rows they
// would fill hold whatever the stage held. Their S is masked to -inf (they lie past every
// row's position), and the consumer zeroes those V rows of the last tile before its P V reads
// them, so that 0 * garbage (possibly NaN) never reaches O.
// fp16 and bf16 K/V only: an fp8 cache runs the mma.sync kernel.
// MODS instances apply the layer's AttentionMods: with a window a block starts at the tile
// holding its first row's first key win_start (barrier stages and phases count from that
// tile), the producer loads only the pages holding a key at or after win_start, the consumers
// zero the V rows of the first tile before win_start (as those past the end) and mask each
// row's keys before its window; the soft-cap bends S before the masks; a sink joins each
// row's normalisation.
// On the H200 (bench/results/h200_2026-12-01d_prefill_ws.md) this structure took 4k causal
// prefills from 335 (every thread loading with cp.async, one __syncthreads per tile) to 472
// TFLOP/s.
#pragma once

#include <cmath>

#include "attention_mods.cuh"
#include "dtype_utils.cuh"
#include "mma_utils.cuh"
#include "pagedd_cuda.h"
#include "tma_utils.cuh"
#include "wgmma_utils.cuh"

namespace pagedd::cuda {

template <int HEAD_DIM, int BLOCK_N, int STAGES>
struct PrefillSm90Tile {
  static constexpr int CONSUMERS = 2;                      // warpgroups of 64 rows
  static constexpr int BLOCK_M = 64 * CONSUMERS;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);    // + the producer warpgroup
  static constexpr int CONSUMER_WARPS = 4 * CONSUMERS;     // arrivals on an empty barrier
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static constexpr int CHUNKS = HEAD_DIM / 8;              // 16-byte chunks per row
  static constexpr int SLABS = HEAD_DIM / 64;              // 128-byte swizzle slabs per row
  static constexpr int K_STEPS = HEAD_DIM / 16;            // k steps of S = Q K^T
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;   // [SLABS][BLOCK_M][64]
  static constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2;  // one K or V tile, same layout
  // + 1024: the tiles are aligned to 1024 bytes by hand (the swizzle follows the address).
  static constexpr size_t SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES + 1024;
  static_assert(HEAD_DIM % 64 == 0, "128-byte swizzle slabs of 64 elements");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "wgmma n of S");
  static_assert(STAGES >= 2, "a skipped tile's release relies on two stages (see the kernel)");
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536, "registers");
};

// Byte offset of 16-byte chunk ch of row r in a 128-byte-swizzled tile of `rows` rows:
// slab ch / 8 (64 elements), row r (128 bytes), chunk (ch % 8) ^ (r % 8).
__device__ __forceinline__ uint32_t swizzled_offset(int r, int ch, int rows) {
  return (uint32_t)((ch >> 3) * rows * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

template <typename scalar_t, int HEAD_DIM, int BLOCK_N, int STAGES, bool MODS>
__global__ void __launch_bounds__(384, 1)
    paged_prefill_sm90_kernel(const __grid_constant__ PagedPrefillParams p,
                                 const __grid_constant__ CUtensorMap k_map,
                                 const __grid_constant__ CUtensorMap v_map, int block_shift) {
#if defined(PAGEDD_WGMMA_DEVICE)
  using T = PrefillSm90Tile<HEAD_DIM, BLOCK_N, STAGES>;
  using MMA = Mma<scalar_t>;
  constexpr int BM = T::BLOCK_M, BN = BLOCK_N, CHUNKS = T::CHUNKS;
  __shared__ __align__(8) uint64_t barriers[4 * STAGES];  // k full, k empty, v full, v empty
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t pad = (1024u - (raw_addr & 1023u)) & 1023u;
  unsigned char* s_q = smem_raw + pad;               // [SLABS][BM][64], swizzled
  unsigned char* s_v = s_q + T::Q_BYTES + STAGES * T::KV_BYTES;
  const uint32_t q_addr = raw_addr + pad;
  const uint32_t k_addr = q_addr + T::Q_BYTES;       // [STAGES][SLABS][BN][64]
  const uint32_t v_addr = k_addr + STAGES * T::KV_BYTES;
  const uint32_t bar0 = smem_addr(barriers);

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
  // Window: keys before win_start reach no row of the block; its tiles start at n_first.
  const int window = MODS ? p.mods.sliding_window : 0;
  const int win_start = MODS ? window_first_key(prefix + m0 / group, window) : 0;
  const int n_first = win_start / BN;
  // Stages and barrier phases count the block's tiles from n_first.
  auto k_full = [&](int n) { return bar0 + 8 * ((n - n_first) % STAGES); };
  auto k_empty = [&](int n) { return bar0 + 8 * (STAGES + (n - n_first) % STAGES); };
  auto v_full = [&](int n) { return bar0 + 8 * (2 * STAGES + (n - n_first) % STAGES); };
  auto v_empty = [&](int n) { return bar0 + 8 * (3 * STAGES + (n - n_first) % STAGES); };
  auto parity = [&](int n) { return (uint32_t)(((n - n_first) / STAGES) & 1); };
  auto stage_of = [&](int n) { return (n - n_first) % STAGES; };

  if (tid == 0) {
    prefetch_tensor_map(&k_map);
    prefetch_tensor_map(&v_map);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(k_full(s), 1);
      mbarrier_init(k_empty(s), T::CONSUMER_WARPS);
      mbarrier_init(v_full(s), 1);
      mbarrier_init(v_empty(s), T::CONSUMER_WARPS);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  const int wg = tid / 128;
  if (wg == 0) {
    // ---- Producer: warp 0 loads; tile n's K, then its V, each after its stage is free.
    warpgroup_reg_dealloc<T::PRODUCER_REGS>();
    if (warp != 0) return;
    const int32_t* block_table = p.block_tables + (int64_t)seq * p.block_table_stride;
    const int block_size = 1 << block_shift;
    const int page_bytes = block_size * HEAD_DIM * 2;  // one kv head's page, all slabs
    for (int n = n_first; n < num_n_tiles; ++n) {
      // Pages of this tile holding keys below n_end (BN is a multiple of the block size), and
      // with a window from the first holding a key at or after win_start.
      const int pages = min(BN >> block_shift, (n_end - n * BN + block_size - 1) >> block_shift);
      const int first_page = MODS && n == n_first ? (win_start - n * BN) >> block_shift : 0;
      const bool loads = lane >= first_page && lane < pages;
      const int block = loads ? block_table[((n * BN) >> block_shift) + lane] : 0;
      auto load = [&](uint32_t full, uint32_t empty, uint32_t dst, const CUtensorMap* map) {
        if (n - n_first >= STAGES) mbarrier_wait(empty, parity(n) ^ 1u);
        if (lane == 0)
          mbarrier_arrive_expect_tx(full, (uint32_t)((pages - first_page) * page_bytes));
        __syncwarp();
        if (loads) {
#pragma unroll
          for (int slab = 0; slab < T::SLABS; ++slab)
            tma_load_4d(dst + slab * BN * 128 + lane * block_size * 128, map, full, slab * 64, 0,
                        kv_head, block);
        }
      };
      load(k_full(n), k_empty(n), k_addr + stage_of(n) * T::KV_BYTES, &k_map);
      load(v_full(n), v_empty(n), v_addr + stage_of(n) * T::KV_BYTES, &v_map);
    }
    return;
  }

  // ---- Consumers.
  warpgroup_reg_alloc<T::CONSUMER_REGS>();
  const int cw = wg - 1;         // rows 64 cw .. 64 cw + 63 of the tile
  const int ltid = tid % 128;    // thread within the warpgroup
  const int wg_bar = 3 + cw;     // named barrier of this warpgroup alone
  // Turns: warpgroup cw issues its wgmma after syncing on barrier 1 + cw, then lets the other
  // go (arrive on 2 - cw). Warpgroup 0 goes first.
  auto turn_sync = [&] { named_barrier_sync(1 + cw, 256); };
  auto turn_pass = [&] { named_barrier_arrive(2 - cw, 256); };
  if (cw == 1) turn_pass();

  // Q rows of this warpgroup -> shared memory (rows past the end zero-filled).
  const scalar_t* query = static_cast<const scalar_t*>(p.query);
#pragma unroll
  for (int it = 0; it < 64 * CHUNKS / 128; ++it) {
    const int x = ltid + it * 128;
    const int r = 64 * cw + x / CHUNKS, ch = x % CHUNKS, i = m0 + r;
    const bool valid = i < num_rows;
    const scalar_t* src = query;
    if (valid)
      src += (int64_t)(q_start + i / group) * p.q_token_stride +
             (int64_t)(kv_head * group + i % group) * p.q_head_stride + ch * 8;
    cp_async16_zfill(s_q + swizzled_offset(r, ch, BM), src, valid);
  }
  cp_async_commit_group();
  cp_async_wait_group<0>();
  fence_proxy_async_shared();  // Q visible to wgmma, for the whole warpgroup:
  named_barrier_sync(wg_bar, 128);

  // Soft-cap: S becomes the capped scaled score, the softmax then only converts to log2.
  const float softcap = MODS ? p.mods.softcap : 0.f;
  const float scale_log2 = (softcap > 0.f ? 1.f : p.scale) * 1.4426950408889634f;
  const int lwarp = ltid / 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const int row0 = 64 * cw + 16 * lwarp + quad_row;  // this lane's rows: row0, row0 + 8
  const int pos[2] = {prefix + (m0 + row0) / group, prefix + (m0 + row0 + 8) / group};
  // Warpgroup-uniform extent: its first token, and the tiles holding keys its rows see.
  const int wg_m0 = m0 + 64 * cw;
  const bool wg_active = wg_m0 < num_rows;
  const int wg_first_pos = prefix + wg_m0 / group;
  const int wg_n_end = prefix + (min(wg_m0 + 64, num_rows) - 1) / group + 1;
  // The tiles this warpgroup computes: [n_first, wg_tiles) (none when inactive).
  const int wg_tiles = wg_active ? (wg_n_end + BN - 1) / BN : n_first;
  const uint32_t sq = q_addr + cw * 64 * 128;  // this warpgroup's 64 rows of every Q slab

  auto release = [&](uint32_t empty) {
    if (lane == 0) mbarrier_arrive(empty);
  };
  // A tile this warpgroup's rows do not reach: wait for it (keeps the phases in order), free it.
  auto skip_k = [&](int n) {
    mbarrier_wait(k_full(n), parity(n));
    release(k_empty(n));
  };
  auto skip_v = [&](int n) {
    mbarrier_wait(v_full(n), parity(n));
    release(v_empty(n));
  };

  float o[HEAD_DIM / 2];  // O accumulator, wgmma D layout (m64 x HEAD_DIM)
#pragma unroll
  for (int d = 0; d < HEAD_DIM / 2; ++d) o[d] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  float s[BN / 2];          // S of tile n, then its P in fp32; wgmma D layout (m64 x BN)
  uint32_t pa[BN / 16][4];  // P of the previous tile as A fragments (k-step kk: keys 16 kk..)

  auto issue_s = [&](int n) {
    const uint32_t sk = k_addr + stage_of(n) * T::KV_BYTES;
#pragma unroll
    for (int ks = 0; ks < T::K_STEPS; ++ks) {
      // k-step ks: slab ks / 4 (64 dims), then 32 bytes (16 elements) per step inside it.
      const uint32_t q_ks = sq + (ks / 4) * BM * 128 + (ks % 4) * 32;
      const uint32_t k_ks = sk + (ks / 4) * BN * 128 + (ks % 4) * 32;
      Wgmma<scalar_t, BN>::ss(s, wgmma_desc_sw128(q_ks, 16, 1024),
                              wgmma_desc_sw128(k_ks, 16, 1024), ks > 0);
    }
    wgmma_commit_group();
  };
  // O += P V: V [key][dim] is the N-major B of this product; k-step kk = keys 16 kk ..
  auto issue_pv = [&](int n) {
    const uint32_t sv = v_addr + stage_of(n) * T::KV_BYTES;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<scalar_t, HEAD_DIM>::rs_tb(o, pa[kk],
                                       wgmma_desc_sw128(sv + kk * 16 * 128, BN * 128, 1024));
    wgmma_commit_group();
  };
  // Causal mask and online softmax of S_n (log2 domain; the 4 lanes of a quad share a row);
  // returns whether O needs rescaling (some row's max moved), with alpha per row.
  auto softmax = [&](int n, float (&alpha)[2]) {
    if (MODS && softcap > 0.f) {
#pragma unroll
      for (int j = 0; j < BN / 2; ++j) s[j] = softcap_score(s[j] * p.scale, softcap);
    }
    // Window: tiles holding a key before the warpgroup's last row's window.
    if (MODS && window > 0 && n * BN <= wg_n_end - 1 - window) {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (n * BN + 8 * j + quad_col + (e & 1) <= pos[e / 2] - window) s[4 * j + e] = -INFINITY;
    }
    if ((n + 1) * BN - 1 > wg_first_pos) {  // only tiles reaching past the first token
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (n * BN + 8 * j + quad_col + (e & 1) > pos[e / 2]) s[4 * j + e] = -INFINITY;
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
        mx = fmaxf(mx, fmaxf(s[4 * j + 2 * rr], s[4 * j + 2 * rr + 1]));
      const float m_use = online_softmax_max(mx, scale_log2, row_max[rr], alpha[rr]);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        s[4 * j + 2 * rr] = fast_exp2(fmaf(s[4 * j + 2 * rr], scale_log2, -m_use));
        s[4 * j + 2 * rr + 1] = fast_exp2(fmaf(s[4 * j + 2 * rr + 1], scale_log2, -m_use));
        sum += s[4 * j + 2 * rr] + s[4 * j + 2 * rr + 1];
      }
      row_sum[rr] = row_sum[rr] * alpha[rr] + sum;
    }
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
    if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {  // warp-uniform
#pragma unroll
      for (int d = 0; d < HEAD_DIM / 8; ++d) {
        o[4 * d] *= alpha[0], o[4 * d + 1] *= alpha[0];
        o[4 * d + 2] *= alpha[1], o[4 * d + 3] *= alpha[1];
      }
    }
  };
  // P_n (the S accumulator columns 16 kk .. 16 kk + 15) as the A fragment of k-step kk.
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int q = 0; q < 4; ++q) pa[kk][q] = MMA::pack(s[8 * kk + 2 * q], s[8 * kk + 2 * q + 1]);
  };

  // Zeroes V rows [first, last) of tile n's stage (every slab, all 128 bytes of each row),
  // for every thread of the warpgroup, before its P V reads them: rows the producer did not
  // load (past the end, before a window) hold whatever the stage held.
  auto zero_v_rows = [&](int n, int first, int last) {
    unsigned char* sv = s_v + stage_of(n) * T::KV_BYTES;
    for (int x = ltid; x < (last - first) * 8 * T::SLABS; x += 128) {
      const int r = first + x / (8 * T::SLABS), c = x % (8 * T::SLABS);
      *reinterpret_cast<uint4*>(sv + (c / 8) * BN * 128 + r * 128 + (c % 8) * 16) =
          make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async_shared();
    named_barrier_sync(wg_bar, 128);
  };

  // Rounds n_first .. num_n_tiles: round n issues S_n (n < wg_tiles) and P_{n-1} V_{n-1}
  // (n > n_first, n - 1 < wg_tiles), each round one turn; the tiles past wg_tiles are skipped
  // in order.
  int n = n_first;
  if (wg_tiles > n_first) {
    // Round n_first: S alone.
    mbarrier_wait(k_full(n_first), parity(n_first));
    turn_sync();
    wgmma_fence_operands(s);
    wgmma_fence();
    issue_s(n_first);
    turn_pass();
    wgmma_wait_group<0>();
    wgmma_fence_operands(s);
    release(k_empty(n_first));
    float alpha[2];
    softmax(n_first, alpha);  // O is still zero: no rescale
    pack_p();
    if (MODS && win_start > n_first * BN) {  // the window starts inside the first tile
      mbarrier_wait(v_full(n_first), parity(n_first));
      zero_v_rows(n_first, 0, win_start - n_first * BN);
    }
    // Then S_n, then P_{n-1} V_{n-1}; the softmax of S_n overlaps P V.
    for (n = n_first + 1; n < wg_tiles; ++n) {
      // V_{n-1} was loaded before K_n; waiting for it between the two wgmma batches would
      // make ptxas serialize every wgmma (C7520: a wait loop is a divergent path).
      mbarrier_wait(k_full(n), parity(n));
      mbarrier_wait(v_full(n - 1), parity(n - 1));
      turn_sync();
      wgmma_fence_operands(s);
      wgmma_fence_operands(o);
      wgmma_fence();  // orders the softmax / rescale / pack register writes before the wgmma
      issue_s(n);
      issue_pv(n - 1);
      turn_pass();
      wgmma_wait_group<1>();  // S_n done (groups complete in order); P V may still run
      wgmma_fence_operands(s);
      release(k_empty(n));
      softmax(n, alpha);
      wgmma_wait_group<0>();  // O = O_{n-1} complete; pa free
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
      release(v_empty(n - 1));
      rescale_o(alpha);
      pack_p();
    }
    // Round wg_tiles: the last P V (and K of a tile past this warpgroup's rows, skipped).
    const int last = wg_tiles - 1;
    mbarrier_wait(v_full(last), parity(last));
    if (last == num_n_tiles - 1 && n_end < num_n_tiles * BN)
      zero_v_rows(last, n_end - last * BN, BN);  // rows past the sequence's end
    turn_sync();
    wgmma_fence_operands(o);
    wgmma_fence();
    issue_pv(last);
    turn_pass();
    wgmma_wait_group<0>();
    wgmma_fence_operands(o);
    wgmma_fence_operands(pa);
    release(v_empty(last));
    if (n < num_n_tiles) skip_k(n);
    ++n;

    // Normalise and store this lane's rows (pairs of elements, 4-byte stores).
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float l = row_sum[rr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int i = m0 + row0 + 8 * rr;
      float factor = 1.f;
      if (MODS && p.mods.sinks != nullptr && i < num_rows) {  // row_max, the sink: log2 domain
        const float sink = sink_logit<scalar_t>(p.mods.sinks, kv_head * group + i % group);
        factor = fold_sink<true>(row_max[rr], l, sink * 1.4426950408889634f);
      }
      const float inv = l > 0.f ? factor / l : 0.f;
      if (i < num_rows) {
        scalar_t* dst = out_row(i) + quad_col;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d)
          *reinterpret_cast<uint32_t*>(dst + d * 8) =
              MMA::pack(o[4 * d + 2 * rr] * inv, o[4 * d + 2 * rr + 1] * inv);
      }
    }
  }
  // The rounds past this warpgroup's tiles: its turns, and the tiles it skips, in order.
  for (; n <= num_n_tiles; ++n) {
    turn_sync();
    turn_pass();
    if (n < num_n_tiles) skip_k(n);
    if (n > n_first) skip_v(n - 1);
  }
#endif  // PAGEDD_WGMMA_DEVICE
}

template <typename scalar_t, int HEAD_DIM, int BLOCK_N, int STAGES>
cudaError_t launch_paged_prefill_sm90_tiles(const PagedPrefillParams& p,
                                               cudaStream_t stream) {
  using T = PrefillSm90Tile<HEAD_DIM, BLOCK_N, STAGES>;
  auto kernel = p.mods.any() ? paged_prefill_sm90_kernel<scalar_t, HEAD_DIM, BLOCK_N, STAGES, true>
                             : paged_prefill_sm90_kernel<scalar_t, HEAD_DIM, BLOCK_N, STAGES, false>;
  if (p.num_blocks <= 0 || p.block_size > BLOCK_N) return cudaErrorInvalidValue;
  CUtensorMap k_map, v_map;
  cudaError_t err = encode_kv_cache_tensor_map(&k_map, p.key_cache, p.num_blocks,
                                               p.kv_block_stride, p.kv_head_stride,
                                               p.num_kv_heads, p.block_size, HEAD_DIM);
  if (err != cudaSuccess) return err;
  err = encode_kv_cache_tensor_map(&v_map, p.value_cache, p.num_blocks, p.kv_block_stride,
                                   p.kv_head_stride, p.num_kv_heads, p.block_size, HEAD_DIM);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)T::SMEM_BYTES);
  if (err != cudaSuccess) return err;
  const int64_t rows = (int64_t)p.max_query_len * (p.num_q_heads / p.num_kv_heads);
  const int64_t tiles = rows <= 0 ? 1 : (rows + T::BLOCK_M - 1) / T::BLOCK_M;
  if (tiles > 65535) return cudaErrorInvalidValue;
  int block_shift = 0;
  while ((1 << block_shift) < p.block_size) ++block_shift;
  const dim3 grid(p.num_kv_heads, (unsigned)tiles, p.num_seqs);
  kernel<<<grid, T::THREADS, T::SMEM_BYTES, stream>>>(p, k_map, v_map, block_shift);
  return cudaGetLastError();
}

// 128 rows x 64 or 128 keys (prefill_wgmma_block_n), two stages of K and of V (160 KiB of
// shared memory at head 128 with 128 keys; three stages measured no faster on the H200).
template <typename scalar_t, int HEAD_DIM>
cudaError_t launch_paged_prefill_sm90_typed(const PagedPrefillParams& p, cudaStream_t stream) {
  if (!prefill_wgmma_tile_is_built(p.block_m, p.block_n)) return cudaErrorInvalidValue;
  if (prefill_wgmma_block_n(p.max_query_len, p.block_n) == 64)
    return launch_paged_prefill_sm90_tiles<scalar_t, HEAD_DIM, 64, 2>(p, stream);
  return launch_paged_prefill_sm90_tiles<scalar_t, HEAD_DIM, 128, 2>(p, stream);
}

template <int HEAD_DIM>
cudaError_t launch_paged_prefill_sm90(const PagedPrefillParams& p, cudaStream_t stream) {
  if (p.cache_dtype == DType::kFp8E4M3) return cudaErrorInvalidValue;
  return p.dtype == DType::kFloat16
             ? launch_paged_prefill_sm90_typed<__half, HEAD_DIM>(p, stream)
             : launch_paged_prefill_sm90_typed<__nv_bfloat16, HEAD_DIM>(p, stream);
}

}  // namespace pagedd::cuda
