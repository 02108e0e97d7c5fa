// Accounting and introspection: block counts, KV waste, sharing and prefix-cache counters.
#include <algorithm>
#include <cstring>
#include <string>

#include "block_manager.h"
#include "block_manager_impl.h"

namespace pagedd {

namespace {
const char* device_name(Device d) {
  return d == Device::GPU ? "GPU" : d == Device::CPU ? "CPU" : "disk";
}
}  // namespace

// ---- accounting and introspection -------------------------------------------------------

int BlockManager::block_size() const { return impl_->block_size; }
int BlockManager::num_total_blocks(Device device) const {
  return impl_->pool(device).num_blocks();
}
int BlockManager::num_free_blocks(Device device) const { return impl_->pool(device).num_free(); }
int BlockManager::num_used_blocks(Device device) const { return impl_->pool(device).num_used(); }

int64_t BlockManager::kv_waste() const {
  const Impl& m = *impl_;
  // Filled slots of a block = the most any sequence referencing it has written into it.
  std::vector<int32_t> filled(m.gpu.num_blocks(), 0);
  for (const auto& kv : m.seqs) {
    const Sequence& s = kv.second;
    if (s.device != Device::GPU) continue;
    const int64_t n = static_cast<int64_t>(s.token_ids.size());
    for (size_t j = 0; j < s.block_table.size(); ++j) {
      if (s.block_table[j] == kNoBlock) continue;
      const int64_t f = std::min<int64_t>(m.block_size, n - static_cast<int64_t>(j) * m.block_size);
      int32_t& cur = filled[s.block_table[j]];
      cur = std::max<int32_t>(cur, static_cast<int32_t>(f));
    }
  }
  int64_t waste = 0;
  for (BlockId b = 0; b < m.gpu.num_blocks(); ++b)
    if (!m.gpu.is_free(b)) waste += m.block_size - filled[b];
  return waste;
}

int BlockManager::num_shared_blocks() const {
  const BlockPool& p = impl_->gpu;
  int n = 0;
  for (BlockId b = 0; b < p.num_blocks(); ++b) n += p.ref_count(b) > 1;
  return n;
}

int64_t BlockManager::num_blocks_saved_by_sharing() const {
  const BlockPool& p = impl_->gpu;
  int64_t n = 0;
  for (BlockId b = 0; b < p.num_blocks(); ++b)
    if (p.ref_count(b) > 1) n += p.ref_count(b) - 1;
  return n;
}

int64_t BlockManager::prefix_cache_query_tokens() const { return impl_->prefix_cache_query_tokens; }
int64_t BlockManager::prefix_cache_hit_tokens() const { return impl_->prefix_cache_hit_tokens; }
int BlockManager::num_cached_blocks(Device device) const { return impl_->cache.num_cached(device); }
int BlockManager::num_pinned_blocks(Device device) const {
  return impl_->num_pinned[tier_index(device)];
}

bool BlockManager::has_seq(SeqId seq_id) const { return impl_->seqs.count(seq_id) != 0; }
Device BlockManager::seq_device(SeqId seq_id) const {
  return impl_->get(seq_id, "seq_device").device;
}
int64_t BlockManager::num_tokens(SeqId seq_id) const {
  return static_cast<int64_t>(impl_->get(seq_id, "num_tokens").token_ids.size());
}
std::vector<BlockId> BlockManager::block_table(SeqId seq_id) const {
  return impl_->get(seq_id, "block_table").block_table;
}

int BlockManager::ref_count(BlockId block_id, Device device) const {
  const BlockPool& p = impl_->pool(device);
  if (!p.is_valid(block_id))
    throw BlockManagerError("ref_count: block_id " + std::to_string(block_id) + " is outside the " +
                            device_name(device) + " pool [0, " + std::to_string(p.num_blocks()) +
                            ")");
  return p.ref_count(block_id);
}

std::vector<BlockId> BlockManager::free_block_ids(Device device) const {
  return impl_->pool(device).free_block_ids();
}

std::vector<SeqId> BlockManager::seq_ids() const {
  std::vector<SeqId> out;
  out.reserve(impl_->seqs.size());
  for (const auto& kv : impl_->seqs) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace pagedd
