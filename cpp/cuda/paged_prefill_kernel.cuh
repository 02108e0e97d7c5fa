// Paged prefill attention on tensor cores (flash-attention 2 scheme with mma.sync, sm_80+).
//
// Grid (num_kv_heads, row tiles, num_seqs). The rows of a sequence are its query tokens times
// the query heads of one kv head's group, packed token-major (row i = token i / group, head
// i % group), so one thread block reads each K/V tile once for the whole group: GQA costs no
// K/V copies and no re-reads. A block of WARPS warps owns BLOCK_M = 16 * ATOMS * WARPS rows;
// each warp owns ATOMS mma tiles of 16 rows, so every K/V fragment it reads from shared memory
// feeds ATOMS mma. Per K/V tile of BLOCK_N keys (read through the block table by cp.async into
// a two-stage shared-memory ring, so the next tile loads while this one is used):
//   S = Q K^T      ldmatrix + mma.m16n8k16, fp32 accumulators (Q fragments stay in registers
//                  with one atom, are re-read from shared memory with two)
//   causal mask    only on tiles that reach past the block's first token
//   online softmax row max / sum across the 4 lanes sharing a row, exp2 with folded scale;
//                  O is rescaled only when some row's max moved
//   O += P V       P converted in registers to the A fragment, V through ldmatrix.trans
// Heavier (later) row tiles are launched first. Warps whose rows are all padding (decode rows
// of a 128-row tile) only help load.
// An fp8 (e4m3) cache streams raw bytes through the two-stage cp.async ring instead; each
// thread converts the chunks it copied into a single scalar_t K/V tile (exact: e4m3 fits in
// fp16 and bf16), so the mma loop is unchanged; k_scale is folded into the softmax scale and
// v_scale into the final normalisation.
// MODS instances apply the layer's AttentionMods: with a window a block starts at the tile
// holding its first row's first key (tiles before are skipped; keys of that tile before it
// are zero-filled, their block-table entries not read where a whole block lies before it) and
// masks keys before each row's window on the tiles that reach it; the soft-cap bends S before
// the masks (the scale is then applied inside it); a sink joins each row's normalisation.
#pragma once

#include <cmath>

#include "attention_mods.cuh"
#include "dtype_utils.cuh"
#include "mma_utils.cuh"
#include "pagedd_cuda.h"

namespace pagedd::cuda {

template <int HEAD_DIM, int WARPS, int ATOMS, int BLOCK_N>
struct PrefillTile {
  static constexpr int WARP_M = 16 * ATOMS;  // rows per warp: ATOMS mma tiles of 16 rows
  static constexpr int BLOCK_M = WARP_M * WARPS;
  static constexpr int THREADS = 32 * WARPS;
  // Rows padded by 16 bytes: the 8 row addresses of an ldmatrix fall in distinct bank groups.
  static constexpr int ROW = HEAD_DIM + 8;
  static constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
  static constexpr int K_STEPS = HEAD_DIM / 16;  // k steps of S = Q K^T
  static constexpr int D_TILES = HEAD_DIM / 8;   // n tiles of O
  static constexpr int N_TILES = BLOCK_N / 8;    // n tiles of S
  // One atom of Q fits in registers up to head 128; two atoms re-read Q from shared memory
  // (as flash-attention 2 does) to leave room for twice the accumulators.
  static constexpr bool Q_IN_REGS = ATOMS == 1 && HEAD_DIM <= 128;
  static constexpr size_t SMEM_BYTES = sizeof(uint16_t) * (BLOCK_M + 4 * BLOCK_N) * ROW;
  // fp8: Q, one converted K/V tile, and the raw two-stage ring of 1-byte K/V (rows unpadded).
  static constexpr int RAW_CHUNKS = HEAD_DIM / 16;  // 16-byte chunks of an fp8 row
  static constexpr size_t SMEM_BYTES_FP8 =
      sizeof(uint16_t) * (BLOCK_M + 2 * BLOCK_N) * ROW + 4 * BLOCK_N * HEAD_DIM;
  static_assert(HEAD_DIM % 16 == 0 && BLOCK_N % 16 == 0, "tile shape");
};

template <typename scalar_t, typename cache_t, int HEAD_DIM, int WARPS, int ATOMS, int BLOCK_N,
          bool MODS>
__global__ void __launch_bounds__(32 * WARPS)
    paged_prefill_kernel(const PagedPrefillParams p, int block_shift) {
  using T = PrefillTile<HEAD_DIM, WARPS, ATOMS, BLOCK_N>;
  using MMA = Mma<scalar_t>;
  constexpr bool FP8 = is_fp8_v<cache_t>;
  constexpr int BM = T::BLOCK_M, BN = BLOCK_N, ROW = T::ROW, CHUNKS = T::CHUNKS;
  constexpr int KV_STAGES = FP8 ? 1 : 2;  // scalar_t K/V tiles (fp8 double-buffers raw bytes)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  scalar_t* s_q = reinterpret_cast<scalar_t*>(smem_raw);  // [BM][ROW]
  scalar_t* s_k = s_q + BM * ROW;                          // [KV_STAGES][BN][ROW]
  scalar_t* s_v = s_k + KV_STAGES * BN * ROW;              // [KV_STAGES][BN][ROW]
  // fp8 only: raw K and V tiles, [2][BN][HEAD_DIM] bytes each.
  unsigned char* r_k = reinterpret_cast<unsigned char*>(s_v + KV_STAGES * BN * ROW);
  unsigned char* r_v = r_k + 2 * BN * HEAD_DIM;

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
  const int first_pos = prefix + m0 / group;           // position of the block's first token
  const int n_end = prefix + (m_end - 1) / group + 1;  // keys [0, n_end) reach some row
  const int num_n_tiles = (n_end + BN - 1) / BN;
  // Window: keys before win_start reach no row of the block; its tiles start at n_first.
  const int window = MODS ? p.mods.sliding_window : 0;
  const int win_start = MODS ? window_first_key(first_pos, window) : 0;
  const int n_first = win_start / BN;

  // Q tile -> shared memory (rows past the end zero-filled).
  const scalar_t* query = static_cast<const scalar_t*>(p.query);
#pragma unroll
  for (int it = 0; it < BM * CHUNKS / T::THREADS; ++it) {  // exact: BM * CHUNKS = THREADS * D/16
    const int x = tid + it * T::THREADS;
    const int r = x / CHUNKS, ch = x % CHUNKS, i = m0 + r;
    const bool valid = i < num_rows;
    const scalar_t* src = query;
    if (valid)
      src += (int64_t)(q_start + i / group) * p.q_token_stride +
             (int64_t)(kv_head * group + i % group) * p.q_head_stride + ch * 8;
    cp_async16_zfill(s_q + r * ROW + ch * 8, src, valid);
  }

  const int32_t* block_table = p.block_tables + (int64_t)seq * p.block_table_stride;
  const cache_t* k_base =
      static_cast<const cache_t*>(p.key_cache) + (int64_t)kv_head * p.kv_head_stride;
  const cache_t* v_base =
      static_cast<const cache_t*>(p.value_cache) + (int64_t)kv_head * p.kv_head_stride;
  const int offset_mask = (1 << block_shift) - 1;
  // This thread's K/V chunks of a tile (the same for every tile): chunk x = tid + it * THREADS
  // is key row x / CH and 16-byte column x % CH, CH chunks per row (8 elements of a 16-bit
  // cache, 16 of an fp8 one).
  constexpr int CH = FP8 ? T::RAW_CHUNKS : CHUNKS;
  constexpr int PER_THREAD = (BN * CH + T::THREADS - 1) / T::THREADS;
  // The block-table entries of those chunks' keys are read one tile ahead of the copies that
  // use them: a table read at the copy would put a dependent global load at the top of every
  // iteration, exposed before the thread's cp.async issue.
  auto fetch_blocks = [&](int n, int (&blk)[PER_THREAD]) {
#pragma unroll
    for (int it = 0; it < PER_THREAD; ++it) {
      const int x = tid + it * T::THREADS, key = n * BN + x / CH;
      // A block wholly before the window is never read (it may be freed).
      const bool reached = !MODS || block_reaches(key, block_shift, win_start);
      blk[it] = (x < BN * CH && key < n_end && reached) ? block_table[key >> block_shift] : 0;
    }
  };
  auto load_kv = [&](int n, int stage, const int (&blk)[PER_THREAD]) {
#pragma unroll
    for (int it = 0; it < PER_THREAD; ++it) {
      const int x = tid + it * T::THREADS;
      if ((BN * CH) % T::THREADS != 0 && x >= BN * CH) break;
      const int r = x / CH, ch = x % CH, key = n * BN + r;
      // Zero-filled past the end and before the window: 0 * garbage is never NaN.
      const bool valid = key < n_end && (!MODS || key >= win_start);
      int64_t off = 0;
      if (valid)
        off = (int64_t)blk[it] * p.kv_block_stride + (key & offset_mask) * HEAD_DIM +
              ch * (16 / (int)sizeof(cache_t));
      if constexpr (FP8) {  // raw bytes, two-stage ring [2][BN][HEAD_DIM]
        const int dst = (stage * BN + r) * HEAD_DIM + ch * 16;
        cp_async16_zfill(r_k + dst, k_base + off, valid);
        cp_async16_zfill(r_v + dst, v_base + off, valid);
      } else {
        scalar_t* dk = s_k + stage * BN * ROW;
        scalar_t* dv = s_v + stage * BN * ROW;
        cp_async16_zfill(dk + r * ROW + ch * 8, k_base + off, valid);
        cp_async16_zfill(dv + r * ROW + ch * 8, v_base + off, valid);
      }
    }
  };
  // fp8: this thread's chunks of raw stage -> s_k / s_v (the chunks it copied itself).
  auto convert_raw = [&](int stage) {
#pragma unroll
    for (int it = 0; it < PER_THREAD; ++it) {
      const int x = tid + it * T::THREADS;
      if ((BN * CH) % T::THREADS != 0 && x >= BN * CH) break;
      const int r = x / CH, ch = x % CH;
      const int src = (stage * BN + r) * HEAD_DIM + ch * 16;
      uint4* dk = reinterpret_cast<uint4*>(s_k + r * ROW + ch * 16);
      uint4* dv = reinterpret_cast<uint4*>(s_v + r * ROW + ch * 16);
      fp8x16_to_vec<scalar_t>(*reinterpret_cast<const uint4*>(r_k + src), dk[0], dk[1]);
      fp8x16_to_vec<scalar_t>(*reinterpret_cast<const uint4*>(r_v + src), dv[0], dv[1]);
    }
  };
  int blk[PER_THREAD];
  fetch_blocks(n_first, blk);
  load_kv(n_first, 0, blk);
  cp_async_commit_group();  // group 0: Q and the first K/V tile
  if (num_n_tiles > n_first + 1) fetch_blocks(n_first + 1, blk);

  const float qk_scale = p.scale * (FP8 ? p.k_scale : 1.f);
  // Soft-cap: S becomes the capped scaled score, the softmax then only converts to log2.
  const float softcap = MODS ? p.mods.softcap : 0.f;
  const float scale_log2 = (softcap > 0.f ? 1.f : qk_scale) * 1.4426950408889634f;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const int warp_row = warp * T::WARP_M;  // first row of this warp; atom a adds 16 * a
  int pos[ATOMS][2];  // positions of this lane's rows warp_row + 16a + quad_row (+ 8)
#pragma unroll
  for (int a = 0; a < ATOMS; ++a)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
      pos[a][rr] = prefix + (m0 + warp_row + 16 * a + quad_row + 8 * rr) / group;
  float o[ATOMS][T::D_TILES][4];
  float row_max[ATOMS][2], row_sum[ATOMS][2];
#pragma unroll
  for (int a = 0; a < ATOMS; ++a) {
#pragma unroll
    for (int d = 0; d < T::D_TILES; ++d) o[a][d][0] = o[a][d][1] = o[a][d][2] = o[a][d][3] = 0.f;
    row_max[a][0] = row_max[a][1] = -INFINITY;
    row_sum[a][0] = row_sum[a][1] = 0.f;
  }
  uint32_t q_frag[T::Q_IN_REGS ? T::K_STEPS : 1][4];
  const scalar_t* q_lane = s_q + (warp_row + lane % 16) * ROW + (lane / 16) * 8;
  // A warp whose rows are all padding (short tiles: decode rows, sequence tails) only helps
  // load K/V. The condition is warp-uniform, so the shuffles it guards stay legal.
  const bool warp_active = m0 + warp_row < num_rows;

  for (int n = n_first; n < num_n_tiles; ++n) {
    const int stage = (n - n_first) & 1;
    if (n + 1 < num_n_tiles) {
      load_kv(n + 1, stage ^ 1, blk);
      if (n + 2 < num_n_tiles) fetch_blocks(n + 2, blk);  // used next iteration
    }
    cp_async_commit_group();
    cp_async_wait_group<1>();  // tile n (and Q) landed for this thread ...
    if constexpr (FP8) convert_raw(stage);  // (only this thread's own chunks: no barrier yet)
    __syncthreads();           // ... and for every thread
    if (warp_active) {
      if constexpr (T::Q_IN_REGS) {
        if (n == n_first) {
#pragma unroll
          for (int ks = 0; ks < T::K_STEPS; ++ks) ldmatrix_x4(q_frag[ks], q_lane + ks * 16);
        }
      }
      const scalar_t* sk = s_k + (FP8 ? 0 : stage) * BN * ROW;
      const scalar_t* sv = s_v + (FP8 ? 0 : stage) * BN * ROW;

      // S = Q K^T for this warp's rows x BN keys; each K fragment serves every atom.
      float s[ATOMS][T::N_TILES][4];
#pragma unroll
      for (int a = 0; a < ATOMS; ++a)
#pragma unroll
        for (int t = 0; t < T::N_TILES; ++t)
          s[a][t][0] = s[a][t][1] = s[a][t][2] = s[a][t][3] = 0.f;
      const scalar_t* k_lane = sk + (lane % 8 + (lane / 16) * 8) * ROW + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int ks = 0; ks < T::K_STEPS; ++ks) {
        uint32_t qa[ATOMS][4];
#pragma unroll
        for (int a = 0; a < ATOMS; ++a) {
          if constexpr (T::Q_IN_REGS) {
#pragma unroll
            for (int j = 0; j < 4; ++j) qa[a][j] = q_frag[ks][j];
          } else {
            ldmatrix_x4(qa[a], q_lane + 16 * a * ROW + ks * 16);
          }
        }
#pragma unroll
        for (int np = 0; np < T::N_TILES / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, k_lane + np * 16 * ROW + ks * 16);
#pragma unroll
          for (int a = 0; a < ATOMS; ++a) {
            MMA::m16n8k16(s[a][2 * np], qa[a], b[0], b[1]);
            MMA::m16n8k16(s[a][2 * np + 1], qa[a], b[2], b[3]);
          }
        }
      }

      if (MODS && softcap > 0.f) {
#pragma unroll
        for (int a = 0; a < ATOMS; ++a)
#pragma unroll
          for (int t = 0; t < T::N_TILES; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[a][t][e] = softcap_score(s[a][t][e] * qk_scale, softcap);
      }
      // Window mask, only on tiles holding a key before the last row's window (the keys
      // before win_start among them: zero-filled, masked here for every row).
      if (MODS && window > 0 && n * BN <= n_end - 1 - window) {
#pragma unroll
        for (int a = 0; a < ATOMS; ++a)
#pragma unroll
          for (int t = 0; t < T::N_TILES; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (n * BN + t * 8 + quad_col + (e & 1) <= pos[a][e / 2] - window)
                s[a][t][e] = -INFINITY;
      }
      // Causal mask, only on tiles reaching past the block's first token.
      if ((n + 1) * BN - 1 > first_pos) {
#pragma unroll
        for (int a = 0; a < ATOMS; ++a)
#pragma unroll
          for (int t = 0; t < T::N_TILES; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (n * BN + t * 8 + quad_col + (e & 1) > pos[a][e / 2]) s[a][t][e] = -INFINITY;
      }
      // Online softmax in the log2 domain (the scale folded into one FFMA per score, as the
      // max of raw scores scales with them); the 4 lanes of a quad share a row.
      float alpha[ATOMS][2];
#pragma unroll
      for (int a = 0; a < ATOMS; ++a) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          float mx = -INFINITY;
#pragma unroll
          for (int t = 0; t < T::N_TILES; ++t)
            mx = fmaxf(mx, fmaxf(s[a][t][2 * rr], s[a][t][2 * rr + 1]));
          const float m_use = online_softmax_max(mx, scale_log2, row_max[a][rr], alpha[a][rr]);
          float sum = 0.f;
#pragma unroll
          for (int t = 0; t < T::N_TILES; ++t) {
            s[a][t][2 * rr] = fast_exp2(fmaf(s[a][t][2 * rr], scale_log2, -m_use));
            s[a][t][2 * rr + 1] = fast_exp2(fmaf(s[a][t][2 * rr + 1], scale_log2, -m_use));
            sum += s[a][t][2 * rr] + s[a][t][2 * rr + 1];
          }
          row_sum[a][rr] = row_sum[a][rr] * alpha[a][rr] + sum;
        }
      }
      // Rescale O only when some row's max moved (after the first tiles it rarely does):
      // the multiplies cost as many issue slots as this tile's mma.
      bool unchanged = true;
#pragma unroll
      for (int a = 0; a < ATOMS; ++a) unchanged &= alpha[a][0] == 1.f && alpha[a][1] == 1.f;
      if (!__all_sync(0xffffffffu, unchanged)) {
#pragma unroll
        for (int a = 0; a < ATOMS; ++a)
#pragma unroll
          for (int d = 0; d < T::D_TILES; ++d) {
            o[a][d][0] *= alpha[a][0], o[a][d][1] *= alpha[a][0];
            o[a][d][2] *= alpha[a][1], o[a][d][3] *= alpha[a][1];
          }
      }

      // O += P V: two S tiles of 8 keys make one A fragment of 16 keys; each V fragment
      // serves every atom.
      const scalar_t* v_lane = sv + (lane % 8 + ((lane / 8) % 2) * 8) * ROW + (lane / 16) * 8;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t pa[ATOMS][4];
#pragma unroll
        for (int a = 0; a < ATOMS; ++a) {
          pa[a][0] = MMA::pack(s[a][2 * kk][0], s[a][2 * kk][1]);
          pa[a][1] = MMA::pack(s[a][2 * kk][2], s[a][2 * kk][3]);
          pa[a][2] = MMA::pack(s[a][2 * kk + 1][0], s[a][2 * kk + 1][1]);
          pa[a][3] = MMA::pack(s[a][2 * kk + 1][2], s[a][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < T::D_TILES / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_lane + kk * 16 * ROW + dp * 16);
#pragma unroll
          for (int a = 0; a < ATOMS; ++a) {
            MMA::m16n8k16(o[a][2 * dp], pa[a], b[0], b[1]);
            MMA::m16n8k16(o[a][2 * dp + 1], pa[a], b[2], b[3]);
          }
        }
      }
    }  // warp_active
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  // Normalise and store this lane's rows (pairs of elements, 4-byte stores).
#pragma unroll
  for (int a = 0; a < ATOMS; ++a)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float l = row_sum[a][rr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int i = m0 + warp_row + 16 * a + quad_row + 8 * rr;
      float factor = 1.f;
      if (MODS && p.mods.sinks != nullptr && i < num_rows) {  // row_max, the sink: log2 domain
        const float sink = sink_logit<scalar_t>(p.mods.sinks, kv_head * group + i % group);
        factor = fold_sink<true>(row_max[a][rr], l, sink * 1.4426950408889634f);
      }
      const float inv = l > 0.f ? factor * (FP8 ? p.v_scale : 1.f) / l : 0.f;
      if (i < num_rows) {
        scalar_t* dst = out_row(i) + quad_col;
#pragma unroll
        for (int d = 0; d < T::D_TILES; ++d)
          *reinterpret_cast<uint32_t*>(dst + d * 8) =
              MMA::pack(o[a][d][2 * rr] * inv, o[a][d][2 * rr + 1] * inv);
      }
    }
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, int WARPS, int ATOMS, int BLOCK_N>
cudaError_t launch_paged_prefill_tiles(const PagedPrefillParams& p, cudaStream_t stream) {
  using T = PrefillTile<HEAD_DIM, WARPS, ATOMS, BLOCK_N>;
  auto kernel = p.mods.any()
                    ? paged_prefill_kernel<scalar_t, cache_t, HEAD_DIM, WARPS, ATOMS, BLOCK_N, true>
                    : paged_prefill_kernel<scalar_t, cache_t, HEAD_DIM, WARPS, ATOMS, BLOCK_N, false>;
  constexpr size_t smem = is_fp8_v<cache_t> ? T::SMEM_BYTES_FP8 : T::SMEM_BYTES;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  const int64_t rows = (int64_t)p.max_query_len * (p.num_q_heads / p.num_kv_heads);
  const int64_t tiles = rows <= 0 ? 1 : (rows + T::BLOCK_M - 1) / T::BLOCK_M;
  if (tiles > 65535) return cudaErrorInvalidValue;
  int block_shift = 0;
  while ((1 << block_shift) < p.block_size) ++block_shift;
  const dim3 grid(p.num_kv_heads, (unsigned)tiles, p.num_seqs);
  kernel<<<grid, T::THREADS, smem, stream>>>(p, block_shift);
  return cudaGetLastError();
}

// Tile shapes: prefill_tile_shape / prefill_tile_is_built (pagedd_cuda.h). Two atoms per warp
// (128 rows) let each K/V fragment read from shared memory feed two mma.
template <typename scalar_t, typename cache_t, int HEAD_DIM>
cudaError_t launch_paged_prefill_typed(const PagedPrefillParams& p, cudaStream_t stream) {
  int block_m = p.block_m, block_n = p.block_n;
  prefill_tile_shape(HEAD_DIM, p.max_query_len, block_m, block_n);
  if constexpr (HEAD_DIM == 256) {
    if (block_m == 64 && block_n == 32)
      return launch_paged_prefill_tiles<scalar_t, cache_t, HEAD_DIM, 4, 1, 32>(p, stream);
  } else {
    if (block_m == 128 && block_n == 64)
      return launch_paged_prefill_tiles<scalar_t, cache_t, HEAD_DIM, 4, 2, 64>(p, stream);
    if (block_m == 128 && block_n == 32)
      return launch_paged_prefill_tiles<scalar_t, cache_t, HEAD_DIM, 4, 2, 32>(p, stream);
    if (block_m == 64 && block_n == 64)
      return launch_paged_prefill_tiles<scalar_t, cache_t, HEAD_DIM, 4, 1, 64>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <int HEAD_DIM>
cudaError_t launch_paged_prefill(const PagedPrefillParams& p, cudaStream_t stream) {
  if (p.cache_dtype == DType::kFp8E4M3)
    return p.dtype == DType::kFloat16
               ? launch_paged_prefill_typed<__half, fp8_e4m3, HEAD_DIM>(p, stream)
               : launch_paged_prefill_typed<__nv_bfloat16, fp8_e4m3, HEAD_DIM>(p, stream);
  return p.dtype == DType::kFloat16
             ? launch_paged_prefill_typed<__half, __half, HEAD_DIM>(p, stream)
             : launch_paged_prefill_typed<__nv_bfloat16, __nv_bfloat16, HEAD_DIM>(p, stream);
}

}  // namespace pagedd::cuda
