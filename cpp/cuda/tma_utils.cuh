// Hopper (sm_90a) asynchronous-copy helpers for warp-specialized kernels: transaction
// barriers (mbarrier), tensor-memory-accelerator loads (cp.async.bulk.tensor), named barriers
// and warpgroup register reallocation (setmaxnreg); and, on the host, the tensor map of a
// paged KV cache that the loads read through.
//
// Protocol of a producer / consumer ring stage (PTX ISA, "mbarrier", "cp.async.bulk.tensor"):
//   full[s]:  one arrival (the producer's arrive.expect_tx of the bytes it is about to load);
//             the TMA loads complete_tx those bytes; the phase completes when both have
//             happened. Consumers wait on it with the parity of the tile's use of the stage.
//   empty[s]: one arrival per consumer warp once its wgmma reads of the stage are done
//             (wgmma.wait_group); the producer waits on it before the stage's next load.
// Tile n of a ring of S stages uses stage n % S in phase n / S: waits take parity (n / S) & 1
// for full, and the previous phase's ((n / S) & 1) ^ 1 for empty (n >= S).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from cudart)
#include <cuda_runtime.h>

#include <cstdint>

namespace pagedd::cuda {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the barrier initialisations visible to the async proxy (TMA's complete_tx) and, after
// a __syncthreads, to the other threads.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Returns once the phase of the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Loads the box at coordinates (c0, c1, c2, c3) of a 4-d tensor map into shared memory at
// dst (the map's swizzle applied), completing its bytes on barrier bar.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Named barriers 1..15 (0 is __syncthreads): sync waits for `threads` arrivals including its
// own warp's; arrive adds its warp's and goes on.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Moves registers between warpgroups (every warp of the warpgroup executes it): the producer
// gives up what it does not need, the consumers take it (multiples of 8, 24 to 256).
template <int REGS>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

#endif  // sm_90a device code

// Host: the 4-d tensor map over one layer's key (or value) cache [num_blocks, num_kv_heads,
// block_size, head_dim] (16-bit elements, strides in elements), read as boxes of 64 elements
// (128 bytes, 128-byte swizzle) x block_size tokens of one (block, kv head): the box at
// (64 j, 0, kv_head, block) is slab j of that page, laid out as the wgmma kernels' shared
// memory expects. cudaErrorInvalidValue when the cache cannot be described (alignment).
cudaError_t encode_kv_cache_tensor_map(CUtensorMap* map, const void* cache, int64_t num_blocks,
                                       int64_t block_stride, int64_t head_stride,
                                       int num_kv_heads, int block_size, int head_dim);

}  // namespace pagedd::cuda
