// The prefix-cache hash table of the GPU pool: which full blocks hold KV that a new sequence
// with the same prefix may reuse.
//
// A block's hash is chained: hash_block(parent block's hash, the block's token ids, salt).
// Several blocks may share a (masked) hash; a lookup accepts a block only if its stored token
// ids, salt and parent (block id and that block's generation at registration) all match, so a
// collision can never serve another prompt's KV. The generation of a block rises every time
// the block is handed out again, which invalidates every child registered under it.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_manager.h"

namespace pagedd {

// FNV-1a over the salt's bytes (stable across platforms and runs).
uint64_t hash_salt(const std::string& salt);
// Chained 64-bit hash of one full block.
uint64_t hash_block(uint64_t parent_hash, const int32_t* token_ids, int block_size,
                    uint64_t salt_hash);

class PrefixCache {
 public:
  static constexpr BlockId kNoParent = -1;

  PrefixCache(int num_blocks, int block_size);

  // The cached block with this hash, token ids, salt and parent (kNoParent for the first
  // block of a prompt), or -1.
  BlockId find(uint64_t hash, const int32_t* token_ids, const std::string& salt,
               BlockId parent) const;
  // Register block b (not yet cached) under hash with its content and parent.
  void insert(BlockId b, uint64_t hash, const int32_t* token_ids, const std::string& salt,
              BlockId parent);
  // Drop b's entry if it has one.
  void erase(BlockId b);
  bool is_cached(BlockId b) const { return is_cached_[b] != 0; }
  uint32_t generation(BlockId b) const { return generation_[b]; }
  // b is handed out for new content: drop its entry and invalidate its children.
  void reuse(BlockId b) {
    erase(b);
    ++generation_[b];
  }
  int num_cached() const { return static_cast<int>(table_.size()); }
  void set_hash_mask(uint64_t mask);

 private:
  bool matches(BlockId b, const int32_t* token_ids, const std::string& salt, BlockId parent) const;

  int block_size_;
  uint64_t mask_ = ~uint64_t{0};
  std::unordered_multimap<uint64_t, BlockId> table_;  // masked hash -> block
  std::vector<uint8_t> is_cached_;
  std::vector<uint64_t> hash_;         // full (unmasked) hash of a cached block
  std::vector<uint32_t> generation_;   // per block, +1 at every reuse
  std::vector<BlockId> parent_;        // parent block at registration (kNoParent: first)
  std::vector<uint32_t> parent_gen_;   // the parent's generation at registration
  std::vector<std::string> salt_;
  std::vector<int32_t> token_ids_;     // [num_blocks, block_size]
};

}  // namespace pagedd
