// Private state of BlockManager, shared by block_manager.cpp (allocation, growth, swap, prefix
// cache), tiers.cpp (saves, loads, disk, steps) and accounting.cpp (accounting and
// introspection).
#pragma once

#include <array>
#include <string>
#include <unordered_map>
#include <utility>
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
  // mark_blocks_computed (or were cache hits); chain_parent is the entry a lookup of this
  // prefix reaches for block num_marked_blocks - 1 (kNoEntry before the first), named by
  // slot and uid so that its death is noticed.
  int64_t num_marked_blocks = 0;
  PrefixCache::EntryId chain_parent = PrefixCache::kNoEntry;
  uint64_t chain_parent_uid = PrefixCache::kNoParentUid;
  bool chain_broken = false;  // chain_parent died: register nothing more
  int64_t ready_step = 0;     // the first step that may read its KV (loads in flight)
  int64_t num_released_blocks = 0;  // leading entries released (kNoBlock): a sliding window
};

// A prefix hit: the entry, and the tier its copy is taken from (the highest one holding it).
struct Hit {
  PrefixCache::EntryId entry;
  Device tier;
};

struct BlockManager::Impl {
  Impl(int block_size, int num_gpu_blocks, int num_cpu_blocks, double watermark,
       bool enable_prefix_caching, bool enable_cpu_tier, int num_disk_blocks,
       int save_ahead_blocks);

  int block_size;
  int watermark_blocks;
  bool enable_prefix_caching;
  bool enable_cpu_tier;
  int save_ahead_blocks;
  BlockPool gpu;
  BlockPool cpu;
  BlockPool disk;
  PrefixCache cache;
  std::unordered_map<SeqId, Sequence> seqs;
  int64_t prefix_cache_query_tokens = 0;
  int64_t prefix_cache_hit_tokens = 0;
  TierStats stats;

  // ---- the step's moves (tiers.cpp) ----
  int64_t step_index = 0;                 // the step being scheduled
  BlockMoves moves;                       // this step's, so far
  std::vector<BlockPair> deferred_loads;  // (cpu, gpu) of disk reads: loaded next step
  std::vector<BlockId> saved_cpu_blocks;  // CPU blocks saved into this step (disk writes)
  // With a disk tier: entries registered on the GPU since the last step (slot, uid), saved
  // through the CPU tier to disk at the step's end (write-through).
  std::vector<std::pair<PrefixCache::EntryId, uint64_t>> written_through;
  // Pins (one reference each) taken during this step, and during the step before; the older
  // ones are released when this step's moves are taken.
  std::vector<std::pair<Device, BlockId>> pins, previous_pins;
  std::array<int, kNumTiers> num_pinned{{0, 0, 0}};
  // Per GPU block: the first step that may read it (a load in flight writes it before).
  std::vector<int64_t> gpu_ready_step;
  // Per CPU block: the first step whose copies may read it (a disk read fills it before).
  std::vector<int64_t> cpu_ready_step;

  bool has_disk_tier() const { return disk.num_blocks() > 0; }
  // Block b of tier d drops its entry's copy (it held wrong or no content); a free b moves
  // to the head of its free list.
  void forget_copy(Device d, BlockId b);
  // The record of entry e as its disk block d stores it.
  DiskBlockRecord disk_record(PrefixCache::EntryId e, BlockId d) const;
  BlockPool& pool(Device d) { return d == Device::GPU ? gpu : d == Device::CPU ? cpu : disk; }
  const BlockPool& pool(Device d) const {
    return d == Device::GPU ? gpu : d == Device::CPU ? cpu : disk;
  }
  Sequence& get(SeqId seq_id, const char* op);
  const Sequence& get(SeqId seq_id, const char* op) const;

  // Pop a GPU block for new content. A cached block is evicted: its entry is saved to the
  // CPU tier first when that tier is on and holds no copy yet.
  BlockId alloc_gpu(const char* op);
  // Pop a CPU block for new content (evicting its entry's CPU copy); kNone if none is free.
  BlockId alloc_cpu();
  // Pop a disk block for new content (evicting its entry's disk copy); kNone if none is free.
  BlockId alloc_disk();
  // Drop one reference; at 0 the block goes back to the free list (cached: tail, else head).
  void release(Device d, BlockId b);
  // One more reference on b until the next step's moves are taken.
  void pin(Device d, BlockId b);
  // The same for a block just popped: the reference pop_free gave it is the pin.
  void adopt_pin(Device d, BlockId b);
  // Give entry e a copy in a CPU block and queue the (gpu, cpu) save; false if no CPU block.
  bool save_to_cpu(PrefixCache::EntryId e, BlockId gpu_block, bool ahead);
  // Prefix hits for the first max_blocks full blocks of token_ids, in every tier; hashes get
  // the chain hashes of the hit blocks.
  std::vector<Hit> lookup(const std::vector<int32_t>& token_ids, const std::string& salt,
                          int64_t max_blocks, std::vector<uint64_t>* hashes) const;
  // Per-layer-group tables: the groups' GPU prefix hits, each cut to the shortest (the hit
  // every table can serve); hashes (if given) get each group's hit hashes.
  std::vector<std::vector<Hit>> group_hits(const std::vector<int32_t>& token_ids,
                                           const std::vector<std::string>& salts,
                                           std::vector<std::vector<uint64_t>>* hashes) const;
  void check_group_args(const std::vector<int32_t>& token_ids,
                        const std::vector<std::string>& salts, size_t num_seqs,
                        const char* op) const;
  // The sequences of a swap group, all on device `from`, each listed once.
  std::vector<Sequence*> swap_group(const std::vector<SeqId>& seq_ids, Device from,
                                    const char* op);
  // Moves a group between pools (swap_out / swap_in); returns (src, dst) pairs.
  std::vector<BlockPair> move_group(const std::vector<SeqId>& seq_ids, Device from, Device to,
                                    const char* op);
  // Extend seq.block_hashes to its first num_blocks full blocks.
  void compute_hashes(Sequence& seq, int64_t num_blocks) const;
  // Tiers (tiers.cpp): ahead saves, disk writes, and the loads that survived the step.
  void plan_saves_ahead();
  void plan_write_through();
  void plan_disk_writes();
  void check_loads();
};

}  // namespace pagedd
