// Paged decode attention on tensor cores, split-KV, for grouped query heads (GQA).
//
// Grid (num_kv_heads, num_partitions, num_seqs); one thread block of WARPS warps handles one
// (sequence, kv head, partition of partition_size keys). Its rows are the `group` query heads
// of the kv head, padded with zeros to one mma atom of 16 rows (padding rows are computed and
// never stored), so each K/V element is read from HBM once for the whole group.
//
// The warps work independently: warp w takes the 16-key sub-tiles w, w + WARPS, ... of the
// partition and streams them through its OWN cp.async ring of STAGES sub-tiles (block-table
// entries fetched 32 sub-tiles at a time, a batch ahead), so the main loop has no block-wide
// barrier and STAGES - 1 sub-tiles per warp are in flight while it computes. Per sub-tile,
// exactly the prefill kernel's math (paged_prefill_kernel.cuh) on one atom:
//   S = Q K^T      Q fragments in registers (loaded once), K through ldmatrix, mma.m16n8k16
//   mask           keys past the partition / sequence end -> -inf
//   online softmax per row in the log2 domain, exp2 with the scale folded in
//   O += P V       the 16 x 16 P is exactly one A fragment; V through ldmatrix.trans
// At the end the warps' (max, sum, O) are merged through shared memory (reusing the ring).
// With one partition the block normalises and writes `out`; otherwise it writes the split-KV
// workspace of the CUDA-core decode kernel (natural-log max, exp sum, O unnormalised) and
// paged_decode_reduce_kernel (paged_attention_kernel.cuh) merges the partitions.
//
// An fp8 (e4m3) cache streams its raw bytes through the ring (half the bytes of bf16) and
// ldmatrix reads them as if they were 16-bit elements, each register holding four e4m3 values
// that become two 16-bit pairs in registers (exact: e4m3 fits fp16 and bf16); no converted copy
// goes through shared memory, which leaves room for 3 blocks per SM.
//   K (ldmatrix): a lane gets dims 4c..4c+3 of key g of a 16-dim step. The dot product does
//     not care in which order the dims are summed, so mma k 2c, 2c+1 are taken as dims 4c,
//     4c+1 and k 2c+8, 2c+9 as dims 4c+2, 4c+3: the four bytes are the whole B fragment, and
//     Q's A fragment is loaded in the same order (two 8-byte loads per row instead of ldmatrix).
//   V (ldmatrix.trans): a lane gets keys 2c, 2c+1 x dims 2g, 2g+1 of a 16-dim segment: the even
//     dims' bytes are the B fragment of an n tile of the segment's 8 even dims, the odd ones of
//     its 8 odd dims. O's n tiles are thus (segment, parity) pairs, unscrambled at the merge.
// k_scale is folded into the softmax scale, v_scale into the final normalisation.
// MODS instances apply the layer's AttentionMods: with a window the partitions start at the
// window's first key rounded down to a multiple of 16 (kDecodeTcWindowAlign, a sub-tile), the
// keys of that first sub-tile before the window are zero-filled and masked, and no block
// wholly before the window is read (nor its block-table entry); the soft-cap bends S before
// the mask (the scale is then applied inside it); a sink joins the normalisation (here with
// one partition, else in the reduce kernel).
#pragma once

#include <cmath>

#include "attention_mods.cuh"
#include "dtype_utils.cuh"
#include "mma_utils.cuh"
#include "paged_attention_kernel.cuh"  // paged_decode_reduce_kernel, launch_paged_decode_reduce
#include "pagedd_cuda.h"

namespace pagedd::cuda {

template <int HEAD_DIM, int WARPS, int STAGES, bool FP8>
struct DecodeTcTile {
  static constexpr int SUB = 16;                 // keys per warp step (one A fragment of P)
  static constexpr int THREADS = 32 * WARPS;
  // Rows padded by 16 bytes: the 8 row addresses of an ldmatrix fall in distinct bank groups.
  static constexpr int ROW = HEAD_DIM + 8;
  static constexpr int CHUNKS = HEAD_DIM / 8;      // 16-byte chunks of a 16-bit row
  static constexpr int RAW_CHUNKS = HEAD_DIM / 16;  // 16-byte chunks of an fp8 row
  // An fp8 row in the ring: swizzled like the 16-bit rows below when it has a multiple of 8
  // chunks (head 128, 256); else an odd number of 16-byte chunks, so the 8 rows of an
  // ldmatrix fall in distinct bank groups (head 80: 5 chunks as is; 64, 96: one more).
  static constexpr bool RAW_SWIZZLE = RAW_CHUNKS % 8 == 0;
  static constexpr int RAW_ROW =
      HEAD_DIM + (RAW_SWIZZLE || RAW_CHUNKS % 2 == 1 ? 0 : 16);
  // A 16-bit K or V row in the ring: HEAD_DIM elements, its 16-byte chunk c stored at chunk
  // c ^ (row % 8) when the row has a multiple of 8 chunks (head 64, 128, 256), else padded
  // like Q (head 80, 96). Both keep the 8 rows of an ldmatrix in distinct bank groups; the
  // swizzle also lets every 8 lanes of a cp.async fill one 128-byte line of shared memory from
  // one 128-byte line of the cache. The padded rows did not: a warp's copy of 512 contiguous
  // bytes reached L2 as 2.6 times the requests and 1.5 times the sectors (ncu, H200).
  static constexpr bool SWIZZLE = CHUNKS % 8 == 0;
  static constexpr int KV_ROW = SWIZZLE ? HEAD_DIM : ROW;
  static constexpr int K_STEPS = HEAD_DIM / 16;    // k steps of S = Q K^T (16-dim segments)
  static constexpr int D_TILES = HEAD_DIM / 8;     // n tiles of O
  // Q fragments stay in registers up to head 128 (K_STEPS * 4 registers); head 256 re-reads
  // them from shared memory to leave room for its 128 accumulators.
  static constexpr bool Q_IN_REGS = HEAD_DIM <= 128;
  static constexpr size_t Q_BYTES = sizeof(uint16_t) * 16 * ROW;
  // One 16-bit K + V sub-tile ([SUB][KV_ROW] each).
  static constexpr size_t TILE_BYTES = sizeof(uint16_t) * 2 * SUB * KV_ROW;
  // One raw fp8 K + V sub-tile ([SUB][RAW_ROW] bytes each).
  static constexpr size_t RAW_BYTES = 2 * SUB * RAW_ROW;
  // Per warp: STAGES sub-tiles, 16-bit or raw fp8.
  static constexpr size_t WARP_BYTES = STAGES * (FP8 ? RAW_BYTES : TILE_BYTES);
  // The merge of the warps' results: O [WARPS][16][HEAD_DIM] fp32, then max and sum [WARPS][16].
  static constexpr size_t MERGE_BYTES = sizeof(float) * WARPS * 16 * (HEAD_DIM + 2);
  static constexpr size_t RING_BYTES = WARPS * WARP_BYTES;
  static constexpr size_t SMEM_BYTES = Q_BYTES + (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES);
  static_assert(HEAD_DIM % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(RAW_BYTES % 16 == 0 && TILE_BYTES % 16 == 0 && Q_BYTES % 16 == 0, "alignment");
  static_assert(!SWIZZLE || (Q_BYTES % 128 == 0 && TILE_BYTES % 128 == 0),
                "swizzled rows start at 128-byte boundaries (the bank pattern)");
  static_assert(!RAW_SWIZZLE || (Q_BYTES % 128 == 0 && RAW_BYTES % 128 == 0),
                "swizzled rows start at 128-byte boundaries (the bank pattern)");
};

// fp8: calls step(seg, keys0_7, keys8_15) for each 16-dim segment of a raw K (ldmatrix) or V
// (TRANS: ldmatrix.trans) sub-tile, with this lane's register of keys 0-7 and of keys 8-15.
// chunk(c): the address of 16-byte chunk c (segment c) of this lane's row of the x4 matrices
// (keys 0-7, segment 2j), (keys 8-15, 2j), (keys 0-7, 2j+1), (keys 8-15, 2j+1), which read
// chunk 2j + half (half = lane / 16); an odd last segment takes an x2.
template <int SEGS, bool TRANS, typename ChunkFn, typename StepFn>
__device__ __forceinline__ void for_each_fp8_segment(ChunkFn&& chunk, int half, StepFn&& step) {
#pragma unroll
  for (int j = 0; j < SEGS / 2; ++j) {
    uint32_t r[4];
    if constexpr (TRANS)
      ldmatrix_x4_trans(r, chunk(2 * j + half));
    else
      ldmatrix_x4(r, chunk(2 * j + half));
    step(2 * j, r[0], r[1]);
    step(2 * j + 1, r[2], r[3]);
  }
  if constexpr (SEGS % 2 == 1) {
    uint32_t r[2];
    if constexpr (TRANS)
      ldmatrix_x2_trans(r, chunk(SEGS - 1));
    else
      ldmatrix_x2(r, chunk(SEGS - 1));
    step(SEGS - 1, r[0], r[1]);
  }
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, int WARPS, int STAGES, int MIN_BLOCKS,
          bool MODS>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
    paged_decode_tc_kernel(const PagedDecodeTcParams p, int block_shift) {
  constexpr bool FP8 = is_fp8_v<cache_t>;
  using T = DecodeTcTile<HEAD_DIM, WARPS, STAGES, FP8>;
  using MMA = Mma<scalar_t>;
  constexpr int ROW = T::ROW, SUB = T::SUB, CHUNKS = T::CHUNKS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  scalar_t* s_q = reinterpret_cast<scalar_t*>(smem_raw);  // [16][ROW]
  unsigned char* s_ring = smem_raw + T::Q_BYTES;           // [WARPS][WARP_BYTES]

  const int kv_head = blockIdx.x, part = blockIdx.y, seq = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = p.num_q_heads / p.num_kv_heads;
  pdl_launch_dependents();  // the reduce kernel (if any) may be scheduled now
  const int seq_len = p.seq_lens[seq];
  // With a window: its first key, and the first key of the partitions (16-aligned, <= it).
  const int window_start = MODS ? window_first_key(seq_len - 1, p.mods.sliding_window) : 0;
  const int kv_start = window_start & ~(kDecodeTcWindowAlign - 1);
  const int start = kv_start + part * p.partition_size;
  const bool single = p.num_partitions == 1;
  scalar_t* out = static_cast<scalar_t*>(p.out);

  const int32_t* block_table = p.block_tables + (int64_t)seq * p.block_table_stride;
  const int fetch_end = min(p.max_seq_len, start + p.partition_size);  // >= end below
  const int fetch_subs = max(0, ((fetch_end - start + SUB - 1) / SUB - warp + WARPS - 1) / WARPS);
  // First key of this warp's i-th sub-tile. A sub-tile starts at a multiple of 16 and block
  // sizes are powers of two >= 8, so its keys lie in the blocks of keys 0 and 8 of it.
  auto sub_start = [&](int i) { return start + (warp + i * WARPS) * SUB; };
  struct Blocks {
    int b0, b1;
  };
  auto fetch_blocks = [&](int i) -> Blocks {
    Blocks b{0, 0};
    if (i < fetch_subs) {
      const int k0 = sub_start(i);
      // A block wholly before the window is never read (it may be freed).
      if (!MODS || block_reaches(k0, block_shift, window_start))
        b.b0 = block_table[k0 >> block_shift];
      if (k0 + 8 < fetch_end && (!MODS || block_reaches(k0 + 8, block_shift, window_start)))
        b.b1 = block_table[(k0 + 8) >> block_shift];
    }
    return b;
  };
  // Block-table entries, 32 sub-tiles at a time: lane j of `cur` holds those of this warp's
  // sub-tile 32 * c + j (c = the batch of the sub-tile being loaded), `nxt` those of batch
  // c + 1, fetched a whole batch ahead. A block-table read per sub-tile, even one sub-tile
  // ahead, put a dependent global load (~1-2 us under load) into every iteration and bounded
  // the loop at one sub-tile per load latency, whatever the dtype. The first two batches are
  // read before seq_len is known (its load and theirs overlap): up to max_seq_len, which the
  // block table row covers (keys past seq_len are masked, their entries never used).
  // (A window's partitions start from seq_len, which these reads then wait for.)
  Blocks cur = fetch_blocks(lane), nxt = fetch_blocks(32 + lane);

  if (start >= seq_len || seq_len > p.max_seq_len) {
    // Nothing to attend to. Only the single-partition path owns `out` here (zeros for length
    // 0, NaN for a sequence longer than max_seq_len); with partitions, the reduce kernel
    // writes those rows and ignores partitions past the sequence end.
    if (single) {
      for (int i = tid; i < group * HEAD_DIM; i += blockDim.x) {
        const int qh = kv_head * group + i / HEAD_DIM;
        out[((int64_t)seq * p.num_q_heads + qh) * HEAD_DIM + i % HEAD_DIM] =
            Convert<scalar_t>::from_float(seq_len == 0 ? 0.f : __int_as_float(0x7fc00000));
      }
    }
    return;
  }
  const int end = min(seq_len, start + p.partition_size);  // keys [start, end)
  const int num_sub = (end - start + SUB - 1) / SUB;
  const int my_subs = num_sub > warp ? (num_sub - warp + WARPS - 1) / WARPS : 0;

  // Q -> shared memory, rows >= group zero-filled (they join the first cp.async group).
  const scalar_t* query = static_cast<const scalar_t*>(p.query);
  for (int x = tid; x < 16 * CHUNKS; x += T::THREADS) {
    const int r = x / CHUNKS, ch = x % CHUNKS;
    const bool valid = r < group;
    const scalar_t* src = query;
    if (valid)
      src += (int64_t)seq * p.q_seq_stride + (int64_t)(kv_head * group + r) * p.q_head_stride +
             ch * 8;
    cp_async16_zfill(s_q + r * ROW + ch * 8, src, valid);
  }

  const cache_t* k_base =
      static_cast<const cache_t*>(p.key_cache) + (int64_t)kv_head * p.kv_head_stride;
  const cache_t* v_base =
      static_cast<const cache_t*>(p.value_cache) + (int64_t)kv_head * p.kv_head_stride;
  const int offset_mask = (1 << block_shift) - 1;
  unsigned char* warp_ring = s_ring + warp * T::WARP_BYTES;
  // Ring stage `stage`: K [SUB][KV_ROW] then V of a 16-bit cache, K [SUB][RAW_ROW] then V
  // bytes of an fp8 cache.
  auto tile_k = [&](int stage) { return warp_ring + stage * T::TILE_BYTES; };
  constexpr int V_OFFSET = SUB * T::KV_ROW * 2;  // bytes from a 16-bit K sub-tile to its V
  // Byte offset of 16-byte chunk c of row r in a 16-bit K or V sub-tile (see KV_ROW).
  auto kv_offset = [](int r, int c) {
    return r * T::KV_ROW * 2 + (T::SWIZZLE ? c ^ (r & 7) : c) * 16;
  };
  // The same for an fp8 row (see RAW_ROW).
  auto raw_offset = [](int r, int c) {
    return r * T::RAW_ROW + (T::RAW_SWIZZLE ? c ^ (r & 7) : c) * 16;
  };
  auto raw_k = [&](int stage) { return warp_ring + stage * T::RAW_BYTES; };

  // Copies this lane's chunks of sub-tile i into ring stage `stage` (keys past `end`
  // zero-filled: 0 * garbage is never NaN). Sub-tiles past this warp's last copy nothing.
  auto load_sub = [&](int i, Blocks b, int stage) {
    if (i >= my_subs) return;
    const int k0 = sub_start(i);
    constexpr int CH = FP8 ? T::RAW_CHUNKS : CHUNKS;  // 16-byte chunks per key row
    constexpr int ELEMS = FP8 ? 16 : 8;              // cache elements per chunk
    constexpr int PER_LANE = (SUB * CH + 31) / 32;
#pragma unroll
    for (int it = 0; it < PER_LANE; ++it) {
      const int x = lane + it * 32;
      if ((SUB * CH) % 32 != 0 && x >= SUB * CH) break;
      const int r = x / CH, ch = x % CH, key = k0 + r;
      const bool valid = key < end && (!MODS || key >= window_start);
      int64_t off = 0;
      if (valid)
        off = (int64_t)(r < 8 ? b.b0 : b.b1) * p.kv_block_stride + (key & offset_mask) * HEAD_DIM +
              ch * ELEMS;
      if constexpr (FP8) {
        unsigned char* dst = raw_k(stage) + raw_offset(r, ch);
        cp_async16_zfill(dst, k_base + off, valid);
        cp_async16_zfill(dst + SUB * T::RAW_ROW, v_base + off, valid);
      } else {
        unsigned char* dst = tile_k(stage) + kv_offset(r, ch);
        cp_async16_zfill(dst, k_base + off, valid);
        cp_async16_zfill(dst + V_OFFSET, v_base + off, valid);
      }
    }
  };
  auto blocks_of = [&](int j) -> Blocks {  // j: a sub-tile of batch c; warp-uniform
    if (j > 0 && j % 32 == 0) {  // entering batch c + 1
      cur = nxt;
      nxt = fetch_blocks(j + 32 + lane);
    }
    return Blocks{__shfl_sync(0xffffffffu, cur.b0, j % 32),
                  __shfl_sync(0xffffffffu, cur.b1, j % 32)};
  };

  // Prologue: sub-tiles 0 .. STAGES-2 in flight (Q joins the first group).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    load_sub(s, blocks_of(s), s);
    cp_async_commit_group();
  }
  cp_async_wait_group<STAGES - 2>();  // this thread's Q chunks landed ...
  __syncthreads();                     // ... and every thread's

  const float qk_scale = p.scale * (FP8 ? p.k_scale : 1.f);
  // Soft-cap: S becomes the capped scaled score, the softmax then only converts to log2.
  const float softcap = MODS ? p.mods.softcap : 0.f;
  const float scale_log2 = (softcap > 0.f ? 1.f : qk_scale) * 1.4426950408889634f;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const scalar_t* q_lane = s_q + (lane % 16) * ROW + (lane / 16) * 8;
  // Q's A fragment of k step ks: through ldmatrix, or for an fp8 cache in the dim order of
  // its K fragments (a0, a2 = dims 16 ks + 4c .. 4c+3 of row g; a1, a3 the same of row g+8).
  auto q_fragment = [&](int ks, uint32_t(&qa)[4]) {
    if constexpr (FP8) {
      const scalar_t* q = s_q + quad_row * ROW + ks * 16 + 2 * quad_col;
      const uint2 lo = *reinterpret_cast<const uint2*>(q);
      const uint2 hi = *reinterpret_cast<const uint2*>(q + 8 * ROW);
      qa[0] = lo.x, qa[1] = hi.x, qa[2] = lo.y, qa[3] = hi.y;
    } else {
      ldmatrix_x4(qa, q_lane + ks * 16);
    }
  };
  uint32_t q_frag[T::Q_IN_REGS ? T::K_STEPS : 1][4];
  if constexpr (T::Q_IN_REGS) {
#pragma unroll
    for (int ks = 0; ks < T::K_STEPS; ++ks) q_fragment(ks, q_frag[ks]);
  }
  // fp8: this lane's row address in the x4 matrices of a raw K or V sub-tile
  // (for_each_fp8_segment).
  const int raw_row = lane % 8 + 8 * ((lane / 8) % 2), raw_half = lane / 16;
  float o[T::D_TILES][4];
#pragma unroll
  for (int d = 0; d < T::D_TILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  for (int i = 0; i < my_subs; ++i) {
    // Refill the stage sub-tile i-1 used (every lane finished it: __syncwarp below).
    load_sub(i + STAGES - 1, blocks_of(i + STAGES - 1), (i + STAGES - 1) % STAGES);
    cp_async_commit_group();
    cp_async_wait_group<STAGES - 1>();  // this lane's copies of sub-tile i landed
    const int stage = i % STAGES;
    __syncwarp();  // ... and every lane's chunks are visible to the warp
    const int k0 = sub_start(i);
    auto q_at = [&](int ks, uint32_t(&qa)[4]) {  // from registers, or loaded again (head 256)
      if constexpr (T::Q_IN_REGS) {
#pragma unroll
        for (int j = 0; j < 4; ++j) qa[j] = q_frag[ks][j];
      } else {
        q_fragment(ks, qa);
      }
    };

    // S = Q K^T: 16 rows x 16 keys (two n tiles of 8 keys).
    float s[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
    if constexpr (FP8) {
      // One register = the whole B fragment (b0, b1) of one 8-key tile and k step.
      for_each_fp8_segment<T::K_STEPS, false>(
          [&](int c) { return raw_k(stage) + raw_offset(raw_row, c); }, raw_half,
          [&](int ks, uint32_t keys0_7, uint32_t keys8_15) {
            uint32_t qa[4], b0, b1;
            q_at(ks, qa);
            fp8x4_to_pairs<scalar_t>(keys0_7, b0, b1);
            MMA::m16n8k16(s[0], qa, b0, b1);
            fp8x4_to_pairs<scalar_t>(keys8_15, b0, b1);
            MMA::m16n8k16(s[1], qa, b0, b1);
          });
    } else {
      // This lane's row of the x4 matrices (keys 0-7 / 8-15) and chunk (dims 0-7 / 8-15 of
      // the k step).
      const int k_row = lane % 8 + (lane / 16) * 8, k_chunk = (lane / 8) % 2;
#pragma unroll
      for (int ks = 0; ks < T::K_STEPS; ++ks) {
        uint32_t qa[4], b[4];
        q_at(ks, qa);
        ldmatrix_x4(b, tile_k(stage) + kv_offset(k_row, 2 * ks + k_chunk));
        MMA::m16n8k16(s[0], qa, b[0], b[1]);
        MMA::m16n8k16(s[1], qa, b[2], b[3]);
      }
    }
    if (MODS && softcap > 0.f) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[t][e] = softcap_score(s[t][e] * qk_scale, softcap);
    }
    // Keys past the end of the partition (or sequence), and before the window.
    if (k0 + SUB > end || (MODS && k0 < window_start)) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + t * 8 + quad_col + (e & 1);
          if (key >= end || (MODS && key < window_start)) s[t][e] = -INFINITY;
        }
    }
    // Online softmax (log2 domain, scale folded in); the 4 lanes of a quad share a row.
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = fmaxf(fmaxf(s[0][2 * rr], s[0][2 * rr + 1]), fmaxf(s[1][2 * rr], s[1][2 * rr + 1]));
      const float m_use = online_softmax_max(mx, scale_log2, row_max[rr], alpha[rr]);
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        s[t][2 * rr] = fast_exp2(fmaf(s[t][2 * rr], scale_log2, -m_use));
        s[t][2 * rr + 1] = fast_exp2(fmaf(s[t][2 * rr + 1], scale_log2, -m_use));
        sum += s[t][2 * rr] + s[t][2 * rr + 1];
      }
      row_sum[rr] = row_sum[rr] * alpha[rr] + sum;
    }
    if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
      for (int d = 0; d < T::D_TILES; ++d) {
        o[d][0] *= alpha[0], o[d][1] *= alpha[0];
        o[d][2] *= alpha[1], o[d][3] *= alpha[1];
      }
    }
    // O += P V: the two S tiles of 8 keys are one A fragment of 16 keys.
    uint32_t pa[4];
    pa[0] = MMA::pack(s[0][0], s[0][1]);
    pa[1] = MMA::pack(s[0][2], s[0][3]);
    pa[2] = MMA::pack(s[1][0], s[1][1]);
    pa[3] = MMA::pack(s[1][2], s[1][3]);
    if constexpr (FP8) {
      // n tiles 2 seg (the segment's even dims) and 2 seg + 1 (its odd dims).
      for_each_fp8_segment<T::K_STEPS, true>(
          [&](int c) { return raw_k(stage) + SUB * T::RAW_ROW + raw_offset(raw_row, c); },
          raw_half,
          [&](int seg, uint32_t keys0_7, uint32_t keys8_15) {
            uint32_t even0, odd0, even1, odd1;
            fp8x4_to_even_odd_pairs<scalar_t>(keys0_7, even0, odd0);
            fp8x4_to_even_odd_pairs<scalar_t>(keys8_15, even1, odd1);
            MMA::m16n8k16(o[2 * seg], pa, even0, even1);
            MMA::m16n8k16(o[2 * seg + 1], pa, odd0, odd1);
          });
    } else {
      const int v_row = lane % 8 + ((lane / 8) % 2) * 8, v_chunk = lane / 16;
#pragma unroll
      for (int dp = 0; dp < T::D_TILES / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, tile_k(stage) + V_OFFSET + kv_offset(v_row, 2 * dp + v_chunk));
        MMA::m16n8k16(o[2 * dp], pa, b[0], b[1]);
        MMA::m16n8k16(o[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }

  // Merge the warps: (max, sum, O) of each through shared memory, reusing the ring.
  cp_async_wait_group<0>();  // no copy (not even a zero-fill) may land after this point
  __syncthreads();
  float* m_o = reinterpret_cast<float*>(s_ring);      // [WARPS][16][HEAD_DIM]
  float* m_max = m_o + WARPS * 16 * HEAD_DIM;          // [WARPS][16]
  float* m_sum = m_max + WARPS * 16;                   // [WARPS][16]
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l = row_sum[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = quad_row + 8 * rr;
    if (lane % 4 == 0) m_max[warp * 16 + r] = row_max[rr], m_sum[warp * 16 + r] = l;
    float* dst = m_o + (warp * 16 + r) * HEAD_DIM;
    if constexpr (FP8) {
      // n tiles (seg, parity): column j of tile 2 seg + p is dim 16 seg + 2 j + p, so this
      // lane's columns 2c, 2c+1 of the two tiles are dims 16 seg + 4c .. 4c+3.
#pragma unroll
      for (int seg = 0; seg < T::K_STEPS; ++seg)
        *reinterpret_cast<float4*>(dst + seg * 16 + 2 * quad_col) =
            make_float4(o[2 * seg][2 * rr], o[2 * seg + 1][2 * rr], o[2 * seg][2 * rr + 1],
                        o[2 * seg + 1][2 * rr + 1]);
    } else {
#pragma unroll
      for (int d = 0; d < T::D_TILES; ++d)
        *reinterpret_cast<float2*>(dst + quad_col + d * 8) =
            make_float2(o[d][2 * rr], o[d][2 * rr + 1]);
    }
  }
  __syncthreads();

  const float out_scale = FP8 ? p.v_scale : 1.f;
  for (int x = tid; x < group * HEAD_DIM; x += T::THREADS) {
    const int r = x / HEAD_DIM, d = x % HEAD_DIM;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, m_max[w * 16 + r]);
    // m is finite: the partition has a key, so some warp saw one.
    float l = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = exp2f(m_max[w * 16 + r] - m);  // 0 for a warp without keys
      l = fmaf(wt, m_sum[w * 16 + r], l);
      acc = fmaf(wt, m_o[(w * 16 + r) * HEAD_DIM + d], acc);
    }
    const int64_t row_idx = (int64_t)seq * p.num_q_heads + kv_head * group + r;
    if (single) {
      if (MODS && p.mods.sinks != nullptr) {  // m, the sink: log2 domain
        const float sink = sink_logit<scalar_t>(p.mods.sinks, kv_head * group + r);
        acc *= fold_sink<true>(m, l, sink * 1.4426950408889634f);
      }
      out[row_idx * HEAD_DIM + d] = Convert<scalar_t>::from_float(acc * out_scale / l);
    } else {
      p.tmp_out[(row_idx * p.num_partitions + part) * HEAD_DIM + d] = acc * out_scale;
      if (d == 0) {
        p.exp_sums[row_idx * p.num_partitions + part] = l;
        p.max_logits[row_idx * p.num_partitions + part] = m * 0.6931471805599453f;  // natural log
      }
    }
  }
}

// Ring stages per warp and blocks per SM: 3 x 16-bit sub-tiles (2 in flight while one is used)
// at 2 blocks per SM, 3 x fp8 (half the bytes each) at 3 blocks per SM up to head 128 (12
// warps to hide the conversion); head 256 takes 2 stages of 16-bit or 3 of fp8, 2 blocks.
template <int HEAD_DIM, bool FP8>
constexpr int decode_tc_stages() {
  return HEAD_DIM <= 128 ? 3 : (FP8 ? 3 : 2);
}
template <int HEAD_DIM, bool FP8>
constexpr int decode_tc_min_blocks() {
  return FP8 && HEAD_DIM <= 128 ? 3 : 2;
}
// 16-bit caches at head 128 switch to 2 stages at 3 blocks per SM (168 registers, no spills)
// when there are many blocks, each with a long context: one partition, max_seq_len at least
// 2,048 keys and at least 1,024 (sequence, kv head) pairs. On the H200 (GQA 32/8, bf16) this read batch
// 256 x 16k in 3,712 us against 3,810 (SDPA 3,732) and 256 x 4k in 945 against 963; with fewer
// or shorter blocks it was no faster, and at batch 8 and 64 x 1k it was 8-20 % slower.
inline bool decode_tc_three_blocks(const PagedDecodeTcParams& p) {
  return p.num_partitions == 1 && p.max_seq_len >= 2048 &&
         (int64_t)p.num_seqs * p.num_kv_heads >= 1024;
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, int STAGES, int MIN_BLOCKS,
          bool MODS>
cudaError_t launch_paged_decode_tc_config(const PagedDecodeTcParams& p, cudaStream_t stream) {
  constexpr int WARPS = 4;
  using T = DecodeTcTile<HEAD_DIM, WARPS, STAGES, is_fp8_v<cache_t>>;
  auto kernel =
      paged_decode_tc_kernel<scalar_t, cache_t, HEAD_DIM, WARPS, STAGES, MIN_BLOCKS, MODS>;
  constexpr size_t smem = T::SMEM_BYTES;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  int block_shift = 0;
  while ((1 << block_shift) < p.block_size) ++block_shift;
  const dim3 grid(p.num_kv_heads, p.num_partitions, p.num_seqs);
  kernel<<<grid, T::THREADS, smem, stream>>>(p, block_shift);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_partitions == 1) return err;
  return launch_paged_decode_reduce<scalar_t, HEAD_DIM>(
      p, p.partition_size, p.max_seq_len, p.num_partitions * p.partition_size,
      MODS ? kDecodeTcWindowAlign : 1, stream);
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, bool MODS>
cudaError_t launch_paged_decode_tc_typed(const PagedDecodeTcParams& p, cudaStream_t stream) {
  constexpr bool FP8 = is_fp8_v<cache_t>;
  if constexpr (!FP8 && HEAD_DIM == 128 && !MODS) {
    if (decode_tc_three_blocks(p))
      return launch_paged_decode_tc_config<scalar_t, cache_t, 128, 2, 3, false>(p, stream);
  }
  return launch_paged_decode_tc_config<scalar_t, cache_t, HEAD_DIM,
                                       decode_tc_stages<HEAD_DIM, FP8>(),
                                       decode_tc_min_blocks<HEAD_DIM, FP8>(), MODS>(p, stream);
}

template <typename scalar_t, typename cache_t, int HEAD_DIM>
cudaError_t launch_paged_decode_tc_mods(const PagedDecodeTcParams& p, cudaStream_t stream) {
  return p.mods.any()
             ? launch_paged_decode_tc_typed<scalar_t, cache_t, HEAD_DIM, true>(p, stream)
             : launch_paged_decode_tc_typed<scalar_t, cache_t, HEAD_DIM, false>(p, stream);
}

template <int HEAD_DIM>
cudaError_t launch_paged_decode_tc(const PagedDecodeTcParams& p, cudaStream_t stream) {
  if (p.cache_dtype == DType::kFp8E4M3)
    return p.dtype == DType::kFloat16
               ? launch_paged_decode_tc_mods<__half, fp8_e4m3, HEAD_DIM>(p, stream)
               : launch_paged_decode_tc_mods<__nv_bfloat16, fp8_e4m3, HEAD_DIM>(p, stream);
  return p.dtype == DType::kFloat16
             ? launch_paged_decode_tc_mods<__half, __half, HEAD_DIM>(p, stream)
             : launch_paged_decode_tc_mods<__nv_bfloat16, __nv_bfloat16, HEAD_DIM>(p, stream);
}

}  // namespace pagedd::cuda
