// The tiers' side of a step (block_manager.h, "Tiers"): saves to the CPU tier, the ahead
// saves and disk writes planned when a step's moves are taken, the loads that survived the
// step, pins, and the warm restart of the disk tier.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "block_manager.h"
#include "block_manager_impl.h"

namespace pagedd {

bool BlockManager::Impl::save_to_cpu(PrefixCache::EntryId e, BlockId gpu_block, bool ahead) {
  const BlockId c = alloc_cpu();
  if (c == BlockPool::kNone) return false;  // every CPU block is in use or pinned
  adopt_pin(Device::CPU, c);
  cache.set_location(e, Device::CPU, c);
  (ahead ? moves.blocks_to_save_ahead_to_cpu : moves.blocks_to_save_to_cpu)
      .emplace_back(gpu_block, c);
  saved_cpu_blocks.push_back(c);
  ++stats.num_saved_blocks;
  return true;
}

void BlockManager::Impl::plan_saves_ahead() {
  if (!enable_cpu_tier) return;
  BlockId g = gpu.head();
  for (int i = 0; i < save_ahead_blocks && g != BlockPool::kNone; ++i, g = gpu.next_free(g)) {
    const PrefixCache::EntryId e = cache.entry_at(Device::GPU, g);
    if (e == PrefixCache::kNoEntry || cache.location(e, Device::CPU) >= 0) continue;
    if (!save_to_cpu(e, g, true)) return;
  }
}

void BlockManager::Impl::plan_write_through() {
  size_t kept = 0;  // entries no CPU block was free for: tried again next step
  for (const auto& [e, uid] : written_through) {
    if (!cache.is_alive(e, uid)) continue;
    const BlockId g = cache.location(e, Device::GPU);
    if (g < 0 || cache.location(e, Device::CPU) >= 0 || cache.location(e, Device::DISK) >= 0)
      continue;
    // A computed full block is never written again: its copy runs while the step runs.
    if (kept > 0 || !save_to_cpu(e, g, true)) written_through[kept++] = {e, uid};
  }
  written_through.resize(kept);
}

DiskBlockRecord BlockManager::Impl::disk_record(PrefixCache::EntryId e, BlockId d) const {
  DiskBlockRecord record;
  record.disk_block = d;
  record.uid = cache.uid(e);
  record.parent_uid = cache.parent_uid(e);
  record.hash = cache.hash(e);
  record.salt = cache.salt(e);
  record.token_ids.assign(cache.token_ids(e), cache.token_ids(e) + block_size);
  return record;
}

void BlockManager::Impl::forget_copy(Device d, BlockId b) {
  cache.drop_location(d, b);
  if (pool(d).is_free(b)) {  // no content now: from the LRU end to the head, reused first
    pool(d).inc_ref(b);
    release(d, b);
  }
}

void BlockManager::Impl::plan_disk_writes() {
  if (!has_disk_tier() || stats.are_disk_writes_stopped) {
    saved_cpu_blocks.clear();
    return;
  }
  for (BlockId c : saved_cpu_blocks) {
    const PrefixCache::EntryId e = cache.entry_at(Device::CPU, c);  // pinned: still its entry
    if (e == PrefixCache::kNoEntry || cache.location(e, Device::DISK) >= 0) continue;
    if (cache.salt(e).size() > kMaxDiskSaltBytes) continue;
    const BlockId d = alloc_disk();
    if (d == BlockPool::kNone) break;  // every disk block is pinned
    adopt_pin(Device::DISK, d);
    cache.set_location(e, Device::DISK, d);
    moves.blocks_to_write_to_disk.emplace_back(c, d);
    moves.disk_write_records.push_back(disk_record(e, d));
    ++stats.num_written_blocks;
  }
  saved_cpu_blocks.clear();
}

void BlockManager::Impl::check_loads() {
  std::vector<BlockPair>& loads = moves.blocks_to_load_from_cpu;
  std::unordered_set<BlockId> targets;
  size_t kept = 0;
  for (const BlockPair& load : loads) {
    const PrefixCache::EntryId e = cache.entry_at(Device::GPU, load.second);
    if (e != PrefixCache::kNoEntry && e == cache.entry_at(Device::CPU, load.first)) {
      // The same load twice (its block was let go, evicted and reloaded for the same entry
      // in one step): copied once.
      if (targets.insert(load.second).second) loads[kept++] = load;
    } else {
      ++stats.num_dropped_loads;  // its GPU block was handed to other content
    }
  }
  loads.resize(kept);
  stats.num_loaded_blocks += static_cast<int64_t>(kept);
}

BlockMoves BlockManager::take_block_moves() {
  Impl& m = *impl_;
  m.plan_saves_ahead();
  m.plan_write_through();
  m.plan_disk_writes();
  m.check_loads();
  BlockMoves out = std::move(m.moves);
  m.moves = BlockMoves{};
  m.moves.blocks_to_load_from_cpu = std::move(m.deferred_loads);  // the next step's
  m.deferred_loads.clear();
  for (const auto& [d, b] : m.previous_pins) {
    m.release(d, b);
    --m.num_pinned[tier_index(d)];
  }
  m.previous_pins = std::move(m.pins);
  m.pins.clear();
  ++m.step_index;
  return out;
}

int64_t BlockManager::step_index() const { return impl_->step_index; }

void BlockManager::discard_block_moves(const BlockMoves& moves) {
  Impl& m = *impl_;
  auto drop = [&m](Device d, BlockId b) {
    if (m.pool(d).is_valid(b)) m.cache.drop_location(d, b);
  };
  for (const auto& [g, c] : moves.blocks_to_save_to_cpu) drop(Device::CPU, c);
  for (const auto& [g, c] : moves.blocks_to_save_ahead_to_cpu) drop(Device::CPU, c);
  for (const auto& [c, g] : moves.blocks_to_load_from_cpu) drop(Device::GPU, g);
  for (const auto& [c, d] : moves.blocks_to_write_to_disk) drop(Device::DISK, d);
  for (const auto& [d, c] : moves.blocks_to_read_from_disk) drop(Device::CPU, c);
}

int64_t BlockManager::seq_ready_step(SeqId seq_id) const {
  return impl_->get(seq_id, "seq_ready_step").ready_step;
}

TierStats BlockManager::tier_stats() const { return impl_->stats; }

std::vector<SeqId> BlockManager::forget_failed_disk_reads(
    const std::vector<std::pair<BlockId, uint64_t>>& reads) {
  Impl& m = *impl_;
  std::unordered_set<BlockId> gpu_blocks;  // the dropped entries' GPU copies
  for (const auto& [d, uid] : reads) {
    ++m.stats.num_failed_disk_reads;
    if (!m.disk.is_valid(d)) continue;
    const PrefixCache::EntryId e = m.cache.entry_at(Device::DISK, d);
    if (!m.cache.is_alive(e, uid)) continue;
    const BlockId g = m.cache.location(e, Device::GPU);
    if (g >= 0) gpu_blocks.insert(g);
    const BlockId c = m.cache.location(e, Device::CPU);
    // The last drop erases the entry.
    if (g >= 0) m.forget_copy(Device::GPU, g);
    if (c >= 0) m.forget_copy(Device::CPU, c);
    m.forget_copy(Device::DISK, d);
  }
  std::vector<SeqId> readers;
  if (gpu_blocks.empty()) return readers;
  for (const auto& [id, seq] : m.seqs) {
    if (seq.device != Device::GPU) continue;
    for (BlockId b : seq.block_table) {
      if (b != kNoBlock && gpu_blocks.count(b)) {
        readers.push_back(id);
        break;
      }
    }
  }
  std::sort(readers.begin(), readers.end());
  return readers;
}

void BlockManager::forget_failed_disk_writes(
    const std::vector<std::pair<BlockId, uint64_t>>& writes) {
  Impl& m = *impl_;
  for (const auto& [d, uid] : writes) {
    ++m.stats.num_failed_disk_writes;
    if (!m.disk.is_valid(d)) continue;
    if (!m.cache.is_alive(m.cache.entry_at(Device::DISK, d), uid)) continue;
    m.forget_copy(Device::DISK, d);
  }
}

void BlockManager::stop_disk_writes() { impl_->stats.are_disk_writes_stopped = true; }

int BlockManager::restore_disk_blocks(const std::vector<DiskBlockRecord>& records) {
  Impl& m = *impl_;
  if (!m.has_disk_tier())
    throw BlockManagerError("restore_disk_blocks: the disk tier is off (num_disk_blocks == 0)");
  if (m.cache.num_cached(Device::DISK) > 0 || m.disk.num_free() != m.disk.num_blocks())
    throw BlockManagerError("restore_disk_blocks: the disk tier already holds blocks");
  // Parents before children: a parent's uid is always the smaller one.
  std::vector<const DiskBlockRecord*> order;
  order.reserve(records.size());
  for (const DiskBlockRecord& r : records) order.push_back(&r);
  std::stable_sort(
      order.begin(), order.end(),
      [](const DiskBlockRecord* a, const DiskBlockRecord* b) { return a->uid < b->uid; });
  std::unordered_map<uint64_t, PrefixCache::EntryId> by_uid;
  std::unordered_set<BlockId> taken;
  int num_restored = 0;
  for (const DiskBlockRecord* r : order) {
    if (!m.disk.is_valid(r->disk_block) || taken.count(r->disk_block)) continue;
    if (r->uid == 0 || by_uid.count(r->uid)) continue;
    if (static_cast<int>(r->token_ids.size()) != m.block_size) continue;
    if (r->salt.size() > kMaxDiskSaltBytes) continue;
    uint64_t parent_hash = 0;
    if (r->parent_uid != PrefixCache::kNoParentUid) {
      auto parent = by_uid.find(r->parent_uid);
      if (parent == by_uid.end()) continue;  // orphan: unreachable from a first block
      parent_hash = m.cache.hash(parent->second);
    }
    if (hash_block(parent_hash, r->token_ids.data(), m.block_size, hash_salt(r->salt)) != r->hash)
      continue;
    const PrefixCache::EntryId e =
        m.cache.insert(r->hash, r->token_ids.data(), r->salt, r->parent_uid, r->uid);
    m.cache.set_location(e, Device::DISK, r->disk_block);
    m.disk.inc_ref(r->disk_block);  // off the free list, then back at its tail: the LRU end
    m.release(Device::DISK, r->disk_block);
    by_uid.emplace(r->uid, e);
    taken.insert(r->disk_block);
    ++num_restored;
  }
  return num_restored;
}

}  // namespace pagedd
