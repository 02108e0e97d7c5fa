// Paged decode attention, split-KV (flash-decoding) and GQA-aware.
//
// Grid (num_kv_heads, num_seqs, num_partitions); one thread block of NUM_WARPS warps handles one
// (sequence, kv head, partition of kPartitionSize tokens) and ALL the query heads of that kv
// head's group (HEADS_PER_PASS of them at a time), so each K/V element is read from HBM once
// when the group has <= 8 heads. Per pass:
//   1. QK: a row of TG lanes owns one token; lane (token, c) loads the 16-byte chunk c of the
//      token's K row (16-byte loads, UNROLL rows in flight per lane), dots it with the scaled
//      queries of the group, and a butterfly reduce-scatter over the TG lanes sums the dots
//      (about UNROLL*HEADS shuffles instead of UNROLL*HEADS*log2(TG)). Logits go to shared mem.
//   2. softmax per head over the partition (max, exp, sum), one warp per head.
//   3. PV: the same lane layout over V; each lane accumulates 8 dims x HEADS in registers; rows
//      are summed by shuffles, warps by shared-memory atomics.
// With one partition the block normalises and writes `out`; otherwise it writes unnormalised
// partial outputs + (max, sum) and paged_decode_reduce_kernel merges the partitions.
// An fp8 (e4m3) cache keeps the same lane layout with 8-byte loads (8 elements); K and V are
// converted to float in registers, k_scale is folded into the query and v_scale into the output.
// MODS instances apply the layer's AttentionMods: with a window the partitions start at the
// window's first key (partition p holds keys [seq_start + p * P, ...), seq_start = seq_len -
// window: no block before it is touched), the soft-cap bends each logit as it is stored, and
// a sink joins the normalisation (here with one partition, else in the reduce kernel).
#pragma once

#include <cfloat>

#include "attention_mods.cuh"
#include "dtype_utils.cuh"
#include "pagedd_cuda.h"
#include "pdl.cuh"

namespace pagedd::cuda {

constexpr int kDecodeWarps = 4;

// 16- or 8-byte global -> shared copy that bypasses registers (zero-fills when !valid);
// .cg (L2 only) exists for 16 bytes, 8-byte copies go through .ca.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(valid ? 16 : 0));
  } else {
    static_assert(BYTES == 8, "cp.async of 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(valid ? 8 : 0));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename scalar_t, int HEAD_DIM>
struct DecodeLayout {
  static constexpr int VEC = 8;                  // elements per load (16 bytes; 8 with fp8)
  static constexpr int NUM_VECS = HEAD_DIM / VEC;  // 16-byte chunks per row
  // Lanes per token row: a power of two >= NUM_VECS (80 and 96 leave some lanes idle).
  static constexpr int TG = NUM_VECS <= 8 ? 8 : (NUM_VECS <= 16 ? 16 : 32);
  static constexpr int ROWS = 32 / TG;  // token rows per warp-wide load
  static_assert(HEAD_DIM % VEC == 0 && NUM_VECS <= 32, "unsupported head_dim");
};

// Butterfly reduce-scatter over the lanes whose index differs in bits [0, log2(O*2)): v holds
// N partial sums per lane; afterwards v[0, max(N/(2*O), 1)) holds complete sums, and v[i] is the
// original entry base + i. Indices are compile-time, so v stays in registers.
template <int N, int O>
struct Butterfly {
  static __device__ __forceinline__ void run(float* v, int lane, int& base) {
    if constexpr (N > 1) {
      constexpr int HALF = N / 2;
      const bool upper = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < HALF; ++i) {
        const float send = upper ? v[i] : v[i + HALF];
        const float keep = upper ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      base += upper ? HALF : 0;
      if constexpr (O > 1) Butterfly<HALF, O / 2>::run(v, lane, base);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
      if constexpr (O > 1) Butterfly<1, O / 2>::run(v, lane, base);
    }
  }
};

// Blocks per SM the register budget must allow (the compiler otherwise trades occupancy
// for ILP, which loses on this latency-bound loop).
template <int HEADS>
constexpr int decode_min_blocks() {
  return HEADS >= 8 ? 3 : (HEADS >= 2 ? 5 : 8);
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, int BLOCK_SIZE, int HEADS,
          bool MODS>
__global__ void __launch_bounds__(kDecodeWarps * 32, decode_min_blocks<HEADS>())
    paged_decode_kernel(const PagedDecodeParams p) {
  using L = DecodeLayout<scalar_t, HEAD_DIM>;
  using vec_t = typename KVVec<cache_t>::type;  // 8 cache elements
  constexpr bool FP8 = is_fp8_v<cache_t>;
  constexpr int TG = L::TG, ROWS = L::ROWS, P = kPartitionSize;
  constexpr int UNROLL = HEADS >= 8 ? 4 : 8;
  constexpr int TOKENS_PER_ITER = ROWS * UNROLL;  // per warp
  constexpr int N = UNROLL * HEADS;               // partial dots per lane per iteration
  constexpr int N_OUT = N / TG > 0 ? N / TG : 1;  // complete dots per lane after the butterfly
  static_assert(P % BLOCK_SIZE == 0, "partition must be whole blocks");
  // Grouped heads do more math per byte: stream K/V through a per-lane cp.async ring of two
  // stages in shared memory, so the next tile's loads are in flight while this one is used
  // (and need no registers). One head per kv head keeps plain register loads (more blocks/SM).
  constexpr bool PIPELINED = HEADS >= 2;
  constexpr int STAGES = PIPELINED ? 2 : 1, STAGE_ROWS = PIPELINED ? UNROLL : 1;
  __shared__ vec_t s_stage[STAGES][STAGE_ROWS][kDecodeWarps * 32];

  // A window's partitions start anywhere inside a block: one more block may be touched.
  __shared__ int s_block_ids[P / BLOCK_SIZE + (MODS ? 1 : 0)];
  __shared__ float s_logits[HEADS][P];
  __shared__ float s_out[HEADS][HEAD_DIM];
  __shared__ float s_max[HEADS], s_sum[HEADS];

  const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = p.num_q_heads / p.num_kv_heads;
  pdl_launch_dependents();  // the reduce kernel (if any) may be scheduled now
  const int seq_len = p.seq_lens[seq];
  // The first key of the window (0 without one): partitions count from it.
  const int seq_start = MODS ? window_first_key(seq_len - 1, p.mods.sliding_window) : 0;
  const int start = seq_start + part * P;
  const bool single = p.num_partitions == 1;
  scalar_t* out = static_cast<scalar_t*>(p.out);

  if (start >= seq_len || (single && seq_len - seq_start > P)) {
    // Nothing to attend to. Only the single-partition path owns `out` here (zeros for length
    // 0, NaN for a sequence longer than the workspace); with partitions, the reduce kernel
    // ignores partitions past the sequence end.
    if (single && part == 0) {
      for (int i = tid; i < group * HEAD_DIM; i += blockDim.x) {
        const int qh = kv_head * group + i / HEAD_DIM;
        out[((int64_t)seq * p.num_q_heads + qh) * HEAD_DIM + i % HEAD_DIM] =
            Convert<scalar_t>::from_float(seq_len == 0 ? 0.f : __int_as_float(0x7fc00000));
      }
    }
    return;
  }
  const int num_tokens = min(P, seq_len - start);
  const int first_block = start / BLOCK_SIZE;
  const int num_blocks = (start + num_tokens - 1) / BLOCK_SIZE - first_block + 1;
  for (int i = tid; i < num_blocks; i += blockDim.x)
    s_block_ids[i] = p.block_tables[(int64_t)seq * p.block_table_stride + first_block + i];

  const int chunk = lane % TG;  // which 16-byte chunk of a row this lane loads
  const int row = lane / TG;
  const bool lane_active = chunk < L::NUM_VECS;
  const cache_t* k_base = static_cast<const cache_t*>(p.key_cache) +
                          (int64_t)kv_head * p.kv_head_stride + chunk * L::VEC;
  const cache_t* v_base = static_cast<const cache_t*>(p.value_cache) +
                          (int64_t)kv_head * p.kv_head_stride + chunk * L::VEC;
  // fp8: K = e4m3 * k_scale folds into the query, V = e4m3 * v_scale into the output.
  const float q_scale = FP8 ? p.scale * p.k_scale : p.scale;
  const float out_scale = FP8 ? p.v_scale : 1.f;
  const float softcap = MODS ? p.mods.softcap : 0.f;

  // Address of token t (partition-relative) in this lane's chunk, from the staged block table.
  auto token_offset = [&](int t) -> int64_t {
    const int tok = start + t;
    return (int64_t)s_block_ids[tok / BLOCK_SIZE - first_block] * p.kv_block_stride +
           (tok % BLOCK_SIZE) * HEAD_DIM;
  };
  // Calls compute(row_of, t0) for each of this warp's tiles of TOKENS_PER_ITER tokens;
  // row_of(u) is this lane's chunk of token t0 + u * ROWS + row (zeros past the end / on idle lanes).
  constexpr int TILE_STRIDE = kDecodeWarps * TOKENS_PER_ITER;
  auto for_each_tile = [&](const cache_t* base, auto&& compute) {
    int t0 = warp * TOKENS_PER_ITER;
    if constexpr (PIPELINED) {
      auto issue = [&](int stage, int t_first) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int t = t_first + u * ROWS + row;
          const bool valid = t < num_tokens && lane_active;
          cp_async<sizeof(vec_t)>(&s_stage[stage][u][tid], valid ? base + token_offset(t) : base,
                                  valid);
        }
        cp_async_commit();
      };
      issue(0, t0);
      for (int it = 0; t0 < num_tokens; ++it, t0 += TILE_STRIDE) {
        issue((it + 1) & 1, t0 + TILE_STRIDE);  // prefetch; zero-fills past the end
        cp_async_wait<1>();                     // this lane's copies of tile `it` landed
        const int st = it & 1;
        // Read each row from shared memory only where it is used: no register copy of the tile.
        compute([&](int u) { return s_stage[st][u][tid]; }, t0);
      }
      cp_async_wait<0>();  // drain the last prefetch before the ring is reused
    } else {
      for (; t0 < num_tokens; t0 += TILE_STRIDE) {
        vec_t vals[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int t = t0 + u * ROWS + row;
          vals[u] = (t < num_tokens && lane_active)
                        ? *reinterpret_cast<const vec_t*>(base + token_offset(t))
                        : vec_t{};
        }
        compute([&](int u) { return vals[u]; }, t0);
      }
    }
  };

  for (int h0 = 0; h0 < group; h0 += HEADS) {
    // Scaled queries of this pass's heads, this lane's 8 dims (0 for padding heads / lanes).
    float q[HEADS][8];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      if (h0 + h < group && lane_active) {
        const int qh = kv_head * group + h0 + h;
        const uint4 raw = *reinterpret_cast<const uint4*>(
            static_cast<const scalar_t*>(p.query) + (int64_t)seq * p.q_seq_stride +
            (int64_t)qh * p.q_head_stride + chunk * L::VEC);
        vec8_to_float<scalar_t>(raw, q[h]);
#pragma unroll
        for (int e = 0; e < 8; ++e) q[h][e] *= q_scale;
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) q[h][e] = 0.f;
      }
    }
    __syncthreads();  // s_block_ids staged; previous pass done with s_logits / s_out
    for (int i = tid; i < HEADS * HEAD_DIM; i += blockDim.x) (&s_out[0][0])[i] = 0.f;

    // 1. QK
    for_each_tile(k_base, [&](auto&& kv, int t0) {
      float dots[N];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float k[8];
        vec8_to_float<cache_t>(kv(u), k);
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
          float d = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) d = fmaf(q[h][e], k[e], d);
          dots[u * HEADS + h] = d;
        }
      }
      int base = 0;
      Butterfly<N, TG / 2>::run(dots, lane, base);
#pragma unroll
      for (int i = 0; i < N_OUT; ++i) {
        const int j = base + i, u = j / HEADS, h = j % HEADS;
        const int t = t0 + u * ROWS + row;
        if (t < num_tokens)
          s_logits[h][t] = MODS && softcap > 0.f ? softcap_score(dots[i], softcap) : dots[i];
      }
    });
    __syncthreads();

    // 2. softmax over the partition, one warp per head.
    for (int h = warp; h < HEADS; h += kDecodeWarps) {
      float m = -FLT_MAX;
      for (int t = lane; t < num_tokens; t += 32) m = fmaxf(m, s_logits[h][t]);
#pragma unroll
      for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float s = 0.f;
      for (int t = lane; t < num_tokens; t += 32) {
        const float e = __expf(s_logits[h][t] - m);
        s_logits[h][t] = e;
        s += e;
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) s_max[h] = m, s_sum[h] = s;
    }
    __syncthreads();

    // 3. PV
    float acc[HEADS][8];
#pragma unroll
    for (int h = 0; h < HEADS; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
    for_each_tile(v_base, [&](auto&& vv, int t0) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int t = t0 + u * ROWS + row;
        float v[8];
        vec8_to_float<cache_t>(vv(u), v);
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
          const float w = t < num_tokens ? s_logits[h][t] : 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(w, v[e], acc[h][e]);
        }
      }
    });
#pragma unroll
    for (int o = TG; o < 32; o *= 2)
#pragma unroll
      for (int h = 0; h < HEADS; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], o);
    if (row == 0 && lane_active) {
#pragma unroll
      for (int h = 0; h < HEADS; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) atomicAdd(&s_out[h][chunk * L::VEC + e], acc[h][e]);
    }
    __syncthreads();

    // 4. write this pass's heads
    const int heads_here = min(HEADS, group - h0);
    for (int i = tid; i < heads_here * HEAD_DIM; i += blockDim.x) {
      const int h = i / HEAD_DIM, d = i % HEAD_DIM;
      const int64_t row_idx = (int64_t)seq * p.num_q_heads + kv_head * group + h0 + h;
      if (single) {
        float l = s_sum[h], factor = 1.f;
        if (MODS && p.mods.sinks != nullptr)
          factor = fold_sink<false>(s_max[h], l,
                                    sink_logit<scalar_t>(p.mods.sinks, kv_head * group + h0 + h));
        out[row_idx * HEAD_DIM + d] =
            Convert<scalar_t>::from_float(s_out[h][d] * out_scale * factor / l);
      } else {
        p.tmp_out[(row_idx * p.num_partitions + part) * HEAD_DIM + d] = s_out[h][d] * out_scale;
      }
    }
    if (!single && tid < heads_here) {
      const int64_t row_idx = (int64_t)seq * p.num_q_heads + kv_head * group + h0 + tid;
      p.exp_sums[row_idx * p.num_partitions + part] = s_sum[tid];
      p.max_logits[row_idx * p.num_partitions + part] = s_max[tid];
    }
  }
}

// Merge the partitions of one (sequence, query head): grid (num_q_heads, num_seqs).
// Partitions hold partition_size keys each from the sequence's first key, or with a window
// from its first key rounded down to a multiple of start_align (the decode kernel's choice);
// a sequence longer than max_len, or spanning more than max_span keys (num_partitions *
// partition_size), gets NaN. A sink (p.mods.sinks) joins the sum here. The tensor-core decode
// kernel (paged_decode_tc_kernel.cuh) writes the same workspace with its own partition size.
template <typename scalar_t, int HEAD_DIM>
__global__ void __launch_bounds__(128)
    paged_decode_reduce_kernel(const PagedDecodeParams p, int partition_size, int max_len,
                               int max_span, int start_align) {
  extern __shared__ float s_weights[];  // [num_partitions]
  __shared__ float s_red[32];
  const int qh = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x;
  const int seq_len = p.seq_lens[seq];  // host-written metadata: safe before the wait
  pdl_wait_primary();  // launched as the decode kernel's dependent (launch_paged_decode_reduce)
  const int64_t row_idx = (int64_t)seq * p.num_q_heads + qh;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row_idx * HEAD_DIM;
  const int seq_start =
      window_first_key(seq_len - 1, p.mods.sliding_window) / start_align * start_align;
  if (seq_len <= 0 || seq_len > max_len || seq_len - seq_start > max_span) {
    // Length 0: zeros. Too long for the workspace: NaN, loudly, rather than a truncated answer.
    const float fill = seq_len <= 0 ? 0.f : __int_as_float(0x7fc00000);
    for (int d = tid; d < HEAD_DIM; d += blockDim.x) out[d] = Convert<scalar_t>::from_float(fill);
    return;
  }
  const int num_parts = (seq_len - seq_start + partition_size - 1) / partition_size;
  const float* max_logits = p.max_logits + row_idx * p.num_partitions;
  const float* exp_sums = p.exp_sums + row_idx * p.num_partitions;

  auto block_reduce = [&](float x, bool is_max) -> float {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const float y = __shfl_xor_sync(0xffffffffu, x, o);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    __syncthreads();
    if (tid % 32 == 0) s_red[tid / 32] = x;
    __syncthreads();
    x = is_max ? -FLT_MAX : 0.f;
    for (int w = 0; w < (int)blockDim.x / 32; ++w) x = is_max ? fmaxf(x, s_red[w]) : x + s_red[w];
    return x;
  };

  float m = -FLT_MAX;
  for (int i = tid; i < num_parts; i += blockDim.x) m = fmaxf(m, max_logits[i]);
  m = block_reduce(m, true);
  float s = 0.f;
  for (int i = tid; i < num_parts; i += blockDim.x) {
    const float w = __expf(max_logits[i] - m);
    s_weights[i] = w;
    s += w * exp_sums[i];
  }
  s = block_reduce(s, false);  // its barriers also publish s_weights
  // With a sink: the partials' weights are relative to m, the factor moves them to the max
  // over the scores and the sink.
  const float factor = p.mods.sinks != nullptr
                           ? fold_sink<false>(m, s, sink_logit<scalar_t>(p.mods.sinks, qh))
                           : 1.f;
  const float inv = factor / s;
  const float* tmp = p.tmp_out + row_idx * p.num_partitions * HEAD_DIM;
  for (int d = tid; d < HEAD_DIM; d += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < num_parts; ++i) acc = fmaf(s_weights[i], tmp[i * HEAD_DIM + d], acc);
    out[d] = Convert<scalar_t>::from_float(acc * inv);
  }
}

#define PAGEDD_DISPATCH_BLOCK_SIZE(bs, BLOCK_SIZE, ...)  \
  switch (bs) {                                          \
    case 8: {                                            \
      constexpr int BLOCK_SIZE = 8;                      \
      __VA_ARGS__;                                       \
    } break;                                             \
    case 16: {                                           \
      constexpr int BLOCK_SIZE = 16;                     \
      __VA_ARGS__;                                       \
    } break;                                             \
    case 32: {                                           \
      constexpr int BLOCK_SIZE = 32;                     \
      __VA_ARGS__;                                       \
    } break;                                             \
    default:                                             \
      return cudaErrorInvalidValue;                      \
  }

// Query heads per pass: the group size rounded up to 1, 2, 4 or 8 (groups > 8 take passes).
#define PAGEDD_DISPATCH_HEADS(group, HEADS, ...) \
  if ((group) <= 1) {                            \
    constexpr int HEADS = 1;                     \
    __VA_ARGS__;                                 \
  } else if ((group) <= 2) {                     \
    constexpr int HEADS = 2;                     \
    __VA_ARGS__;                                 \
  } else if ((group) <= 4) {                     \
    constexpr int HEADS = 4;                     \
    __VA_ARGS__;                                 \
  } else {                                       \
    constexpr int HEADS = 8;                     \
    __VA_ARGS__;                                 \
  }

// The reduce launch of a split-KV decode (num_partitions > 1).
template <typename scalar_t, int HEAD_DIM>
cudaError_t launch_paged_decode_reduce(const PagedDecodeParams& p, int partition_size,
                                       int max_len, int max_span, int start_align,
                                       cudaStream_t stream) {
  // Padded by 4 floats: ptxas merges the guarded tail reads of s_weights into one wider
  // load (compute-sanitizer memcheck flagged a 12-byte read past the end).
  const size_t smem = sizeof(float) * (p.num_partitions + 4);
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(paged_decode_reduce_kernel<scalar_t, HEAD_DIM>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
  }
  // Launched while the decode kernel's last blocks run (programmatic dependent launch): the
  // reduce blocks wait in pdl_wait_primary for its partials, and the launch gap is hidden.
  return launch_after_primary(paged_decode_reduce_kernel<scalar_t, HEAD_DIM>,
                              dim3(p.num_q_heads, p.num_seqs), dim3(128), smem, stream, p,
                              partition_size, max_len, max_span, start_align);
}

template <typename scalar_t, typename cache_t, int HEAD_DIM, bool MODS>
cudaError_t launch_paged_decode_typed(const PagedDecodeParams& p, cudaStream_t stream) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const dim3 grid(p.num_kv_heads, p.num_seqs, p.num_partitions);
  if constexpr (MODS) {
    // Layers with modifiers reach this kernel only above 16 query heads per kv head (the
    // tensor-core kernel takes the others): passes of 8 heads serve every group, and one
    // head count keeps the instances (and the build) small.
    PAGEDD_DISPATCH_BLOCK_SIZE(p.block_size, BLOCK_SIZE, {
      paged_decode_kernel<scalar_t, cache_t, HEAD_DIM, BLOCK_SIZE, 8, true>
          <<<grid, kDecodeWarps * 32, 0, stream>>>(p);
    });
  } else {
    PAGEDD_DISPATCH_BLOCK_SIZE(p.block_size, BLOCK_SIZE, PAGEDD_DISPATCH_HEADS(group, HEADS, {
      paged_decode_kernel<scalar_t, cache_t, HEAD_DIM, BLOCK_SIZE, HEADS, false>
          <<<grid, kDecodeWarps * 32, 0, stream>>>(p);
    }));
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_partitions == 1) return err;
  constexpr int kAnyLength = 0x7fffffff;  // the bound is on the span
  return launch_paged_decode_reduce<scalar_t, HEAD_DIM>(
      p, kPartitionSize, kAnyLength, p.num_partitions * kPartitionSize, 1, stream);
}

template <typename scalar_t, typename cache_t, int HEAD_DIM>
cudaError_t launch_paged_decode_mods(const PagedDecodeParams& p, cudaStream_t stream) {
  return p.mods.any() ? launch_paged_decode_typed<scalar_t, cache_t, HEAD_DIM, true>(p, stream)
                      : launch_paged_decode_typed<scalar_t, cache_t, HEAD_DIM, false>(p, stream);
}

template <int HEAD_DIM>
cudaError_t launch_paged_decode(const PagedDecodeParams& p, cudaStream_t stream) {
  if (p.cache_dtype == DType::kFp8E4M3)
    return p.dtype == DType::kFloat16
               ? launch_paged_decode_mods<__half, fp8_e4m3, HEAD_DIM>(p, stream)
               : launch_paged_decode_mods<__nv_bfloat16, fp8_e4m3, HEAD_DIM>(p, stream);
  return p.dtype == DType::kFloat16
             ? launch_paged_decode_mods<__half, __half, HEAD_DIM>(p, stream)
             : launch_paged_decode_mods<__nv_bfloat16, __nv_bfloat16, HEAD_DIM>(p, stream);
}

}  // namespace pagedd::cuda
