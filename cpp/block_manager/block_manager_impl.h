// Private state of BlockManager, shared by block_manager.cpp (allocation, growth, swap, prefix
// cache) and accounting.cpp (accounting and introspection).
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "block_manager.h"
#include "block_pool.h"
#include "prefix_cache.h"

namespace pagedd {

struct Sequence {
  std::vector<BlockId> block_table;    // blocks in seq_device's pool
  std::vector<int32_t> token_ids;      // every token the sequence holds KV slots for
  std::vector<uint64_t> block_hashes;  // chained hashes of the first full blocks (lazy)
  std::string cache_salt;
  uint64_t salt_hash = 0;
  Device device = Device::GPU;
  // Prefix-cache registration cursor: blocks [0, num_marked_blocks) were handled by
  // mark_blocks_computed (or were cache hits); chain_parent is the cached block a lookup of
  // this prefix reaches for block num_marked_blocks - 1 (kNoParent before the first).
  int64_t num_marked_blocks = 0;
  BlockId chain_parent = PrefixCache::kNoParent;
  uint32_t chain_parent_gen = 0;
  bool chain_broken = false;  // chain_parent was evicted: register nothing more
};

struct BlockManager::Impl {
  Impl(int block_size, int num_gpu_blocks, int num_cpu_blocks, double watermark,
       bool enable_prefix_caching);

  int block_size;
  int watermark_blocks;
  bool enable_prefix_caching;
  BlockPool gpu;
  BlockPool cpu;
  PrefixCache cache;  // GPU pool only
  std::unordered_map<SeqId, Sequence> seqs;
  int64_t prefix_cache_query_tokens = 0;
  int64_t prefix_cache_hit_tokens = 0;

  BlockPool& pool(Device d) { return d == Device::GPU ? gpu : cpu; }
  const BlockPool& pool(Device d) const { return d == Device::GPU ? gpu : cpu; }
  Sequence& get(SeqId seq_id, const char* op);
  const Sequence& get(SeqId seq_id, const char* op) const;

  // Pop a GPU block for new content (drops its cached hash, bumps its generation).
  BlockId alloc_gpu(const char* op);
  // Drop one reference; at 0 the block goes back to the free list (cached: tail, else head).
  void release(Device d, BlockId b);
  // Cache hits for the first max_blocks full blocks of token_ids; hashes get the chain hashes
  // of the hit blocks.
  std::vector<BlockId> lookup(const std::vector<int32_t>& token_ids, const std::string& salt,
                              int64_t max_blocks, std::vector<uint64_t>* hashes) const;
  // The sequences of a swap group, all on device `from`, each listed once.
  std::vector<Sequence*> swap_group(const std::vector<SeqId>& seq_ids, Device from,
                                    const char* op);
  // Moves a group between pools (swap_out / swap_in); returns (src, dst) pairs.
  std::vector<BlockPair> move_group(const std::vector<SeqId>& seq_ids, Device from, Device to,
                                    const char* op);
  // Extend seq.block_hashes to its first num_blocks full blocks.
  void compute_hashes(Sequence& seq, int64_t num_blocks) const;
};

}  // namespace pagedd
