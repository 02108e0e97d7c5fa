// The prefix cache: which full blocks hold KV that a new sequence with the same prefix may
// reuse, in every tier (the GPU pool, the CPU pool, the disk pool).
//
// An entry is one block's content: its chained hash, token ids, salt and parent entry, and
// where copies of it live, at most one block per tier. A block is chained by hash:
// hash_block(parent block's hash, the block's token ids, salt). Several entries may share a
// (masked) hash; a lookup accepts an entry only if its stored token ids, salt and parent all
// match, so a collision can never serve another prompt's KV.
//
// Parents are named by uid: every entry gets a uid when it is created, never reused (a
// restored disk tier keeps its uids, and new ones start above them). A copy moving between
// tiers keeps its entry, hence its uid, so a chain may span tiers (block 0 on the GPU, block 1
// in the CPU tier, block 2 on disk). An entry dies when its last copy is dropped; a lookup
// walks from the first block, so the children of a dead entry are unreachable from then on
// (they are never served, and their blocks are reused in LRU order like any other).
//
// Invariants: entry_at(d, b) == e  <=>  location(e, d) == b; every live entry has at least
// one location; uids of live entries are distinct and below next_uid().
#pragma once

#include <array>
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

constexpr int kNumTiers = 3;  // Device::GPU, Device::CPU, Device::DISK
inline int tier_index(Device d) { return static_cast<int>(d); }

class PrefixCache {
 public:
  using EntryId = int32_t;  // index of an entry slot
  static constexpr EntryId kNoEntry = -1;
  static constexpr uint64_t kNoParentUid = 0;  // parent of a prompt's first block

  // num_blocks: the size of each tier's pool (GPU, CPU, disk).
  PrefixCache(const std::array<int, kNumTiers>& num_blocks, int block_size);

  // The live entry with this hash, token ids, salt and parent uid, or kNoEntry.
  EntryId find(uint64_t hash, const int32_t* token_ids, const std::string& salt,
               uint64_t parent_uid) const;
  // A new entry without copies yet (give it one with set_location before anything else).
  // uid 0 takes the next uid; a given uid (a restored disk block) must be unused.
  EntryId insert(uint64_t hash, const int32_t* token_ids, const std::string& salt,
                 uint64_t parent_uid, uint64_t uid = 0);
  // Block b of tier d now holds a copy of e (b holds no entry, e has no copy in d).
  void set_location(EntryId e, Device d, BlockId b);
  // Block b of tier d no longer holds its entry's copy (no-op if it holds none). The entry
  // dies with its last copy.
  void drop_location(Device d, BlockId b);

  EntryId entry_at(Device d, BlockId b) const { return entry_of_[tier_index(d)][b]; }
  bool is_cached(Device d, BlockId b) const { return entry_at(d, b) != kNoEntry; }
  BlockId location(EntryId e, Device d) const { return entries_[e].block[tier_index(d)]; }
  uint64_t uid(EntryId e) const { return entries_[e].uid; }
  uint64_t hash(EntryId e) const { return entries_[e].hash; }
  uint64_t parent_uid(EntryId e) const { return entries_[e].parent_uid; }
  const std::string& salt(EntryId e) const { return entries_[e].salt; }
  const int32_t* token_ids(EntryId e) const {
    return token_ids_.data() + static_cast<size_t>(e) * block_size_;
  }
  // Whether slot e still holds the entry that had this uid (0 never matches).
  bool is_alive(EntryId e, uint64_t uid) const {
    return e != kNoEntry && uid != 0 && entries_[e].uid == uid;
  }

  int num_cached(Device d) const { return num_cached_[tier_index(d)]; }
  int num_entries() const { return static_cast<int>(table_.size()); }
  uint64_t next_uid() const { return next_uid_; }
  void set_hash_mask(uint64_t mask);

 private:
  struct Entry {
    uint64_t uid = 0;  // 0: slot free
    uint64_t hash = 0;
    uint64_t parent_uid = kNoParentUid;
    std::string salt;
    std::array<BlockId, kNumTiers> block{{-1, -1, -1}};
  };

  bool matches(EntryId e, const int32_t* token_ids, const std::string& salt,
               uint64_t parent_uid) const;
  void erase(EntryId e);

  int block_size_;
  uint64_t mask_ = ~uint64_t{0};
  uint64_t next_uid_ = 1;
  std::unordered_multimap<uint64_t, EntryId> table_;      // masked hash -> live entry
  std::vector<Entry> entries_;                            // one slot per block of every tier
  std::vector<EntryId> free_entries_;                     // free slots (a stack)
  std::vector<int32_t> token_ids_;                        // [num_slots, block_size]
  std::array<std::vector<EntryId>, kNumTiers> entry_of_;  // per tier: block -> entry
  std::array<int, kNumTiers> num_cached_{{0, 0, 0}};
};

}  // namespace pagedd
