// Allocation, growth, fork, free, swap and prefix-cache registration. The accounting is in
// accounting.cpp.
#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "block_manager.h"
#include "block_manager_impl.h"

namespace pagedd {

namespace {

std::string seq_str(SeqId id) { return "sequence " + std::to_string(id); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_ctor_args(int block_size, int num_gpu_blocks, int num_cpu_blocks, double watermark) {
  if (block_size <= 0)
    throw std::invalid_argument("BlockManager: block_size must be positive, got " +
                                std::to_string(block_size));
  if (num_gpu_blocks < 1)
    throw std::invalid_argument("BlockManager: num_gpu_blocks must be >= 1, got " +
                                std::to_string(num_gpu_blocks));
  if (num_cpu_blocks < 0)
    throw std::invalid_argument("BlockManager: num_cpu_blocks must be >= 0, got " +
                                std::to_string(num_cpu_blocks));
  if (!(watermark >= 0.0 && watermark < 1.0))
    throw std::invalid_argument("BlockManager: watermark must be in [0, 1), got " +
                                std::to_string(watermark));
}

// Distinct blocks referenced by a group, in first-reference order.
std::vector<BlockId> distinct_blocks(const std::vector<const Sequence*>& group) {
  std::vector<BlockId> out;
  std::unordered_set<BlockId> seen;
  for (const Sequence* s : group)
    for (BlockId b : s->block_table)
      if (seen.insert(b).second) out.push_back(b);
  return out;
}

}  // namespace

// ---- Impl -------------------------------------------------------------------------------

BlockManager::Impl::Impl(int block_size_, int num_gpu_blocks, int num_cpu_blocks,
                         double watermark, bool enable_prefix_caching_)
    : block_size(block_size_),
      watermark_blocks(static_cast<int>(watermark * num_gpu_blocks)),
      enable_prefix_caching(enable_prefix_caching_),
      gpu(num_gpu_blocks),
      cpu(num_cpu_blocks),
      cache(num_gpu_blocks, block_size_) {}

Sequence& BlockManager::Impl::get(SeqId seq_id, const char* op) {
  auto it = seqs.find(seq_id);
  if (it == seqs.end())
    throw BlockManagerError(std::string(op) + ": unknown " + seq_str(seq_id) +
                            " (never allocated or already freed)");
  return it->second;
}

const Sequence& BlockManager::Impl::get(SeqId seq_id, const char* op) const {
  return const_cast<Impl*>(this)->get(seq_id, op);
}

BlockId BlockManager::Impl::alloc_gpu(const char* op) {
  if (gpu.num_free() == 0)
    throw NoFreeBlocksError(std::string(op) + ": no free GPU block (all " +
                            std::to_string(gpu.num_blocks()) + " in use)");
  BlockId b = gpu.pop_free();
  cache.reuse(b);
  return b;
}

void BlockManager::Impl::release(Device d, BlockId b) {
  BlockPool& p = pool(d);
  if (p.dec_ref(b) > 0) return;
  if (d == Device::GPU && cache.is_cached(b))
    p.push_tail(b);  // keeps its content: LRU end
  else
    p.push_head(b);
}

void BlockManager::Impl::compute_hashes(Sequence& seq, int64_t num_blocks) const {
  for (int64_t i = static_cast<int64_t>(seq.block_hashes.size()); i < num_blocks; ++i) {
    uint64_t parent = i == 0 ? 0 : seq.block_hashes[i - 1];
    seq.block_hashes.push_back(
        hash_block(parent, seq.token_ids.data() + i * block_size, block_size, seq.salt_hash));
  }
}

std::vector<BlockId> BlockManager::Impl::lookup(const std::vector<int32_t>& token_ids,
                                                const std::string& salt, int64_t max_blocks,
                                                std::vector<uint64_t>* hashes) const {
  std::vector<BlockId> hits;
  const uint64_t salt_hash = hash_salt(salt);
  uint64_t parent_hash = 0;
  BlockId parent = PrefixCache::kNoParent;
  for (int64_t i = 0; i < max_blocks; ++i) {
    const int32_t* block = token_ids.data() + i * block_size;
    uint64_t h = hash_block(parent_hash, block, block_size, salt_hash);
    BlockId b = cache.find(h, block, salt, parent);
    if (b < 0) break;
    hits.push_back(b);
    if (hashes) hashes->push_back(h);
    parent_hash = h;
    parent = b;
  }
  return hits;
}

// ---- BlockManager -----------------------------------------------------------------------

BlockManager::BlockManager(int block_size, int num_gpu_blocks, int num_cpu_blocks,
                           double watermark, bool enable_prefix_caching) {
  check_ctor_args(block_size, num_gpu_blocks, num_cpu_blocks, watermark);
  impl_ = std::make_unique<Impl>(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                                 enable_prefix_caching);
}

BlockManager::~BlockManager() = default;

AllocStatus BlockManager::can_allocate(const std::vector<int32_t>& token_ids,
                                       const std::string& cache_salt) const {
  const Impl& m = *impl_;
  if (token_ids.empty()) throw BlockManagerError("can_allocate: token_ids is empty");
  const int64_t num_blocks = ceil_div(static_cast<int64_t>(token_ids.size()), m.block_size);
  if (num_blocks > m.gpu.num_blocks() - m.watermark_blocks) return AllocStatus::NEVER;
  int64_t num_in_use_hits = 0;
  if (m.enable_prefix_caching) {
    const int64_t max_blocks = (static_cast<int64_t>(token_ids.size()) - 1) / m.block_size;
    for (BlockId b : m.lookup(token_ids, cache_salt, max_blocks, nullptr))
      if (!m.gpu.is_free(b)) ++num_in_use_hits;
  }
  if (num_blocks - num_in_use_hits <= m.gpu.num_free() - m.watermark_blocks)
    return AllocStatus::OK;
  return AllocStatus::LATER;
}

int64_t BlockManager::allocate(SeqId seq_id, const std::vector<int32_t>& token_ids,
                               const std::string& cache_salt) {
  Impl& m = *impl_;
  if (m.seqs.count(seq_id))
    throw BlockManagerError("allocate: " + seq_str(seq_id) + " already exists");
  if (token_ids.empty())
    throw BlockManagerError("allocate: token_ids of " + seq_str(seq_id) + " is empty");
  const int64_t num_tokens = static_cast<int64_t>(token_ids.size());
  const int64_t num_blocks = ceil_div(num_tokens, m.block_size);

  // Only blocks that end before the last prompt token are looked up: the last token is
  // always computed, so the model produces the logits of the next token.
  const int64_t max_lookup_blocks = m.enable_prefix_caching ? (num_tokens - 1) / m.block_size : 0;
  std::vector<uint64_t> hashes;
  std::vector<BlockId> hits = m.lookup(token_ids, cache_salt, max_lookup_blocks, &hashes);
  int64_t num_free_hits = 0;
  for (BlockId b : hits)
    if (m.gpu.is_free(b)) ++num_free_hits;
  const int64_t num_new = num_blocks - static_cast<int64_t>(hits.size());
  if (num_new > m.gpu.num_free() - num_free_hits)
    throw NoFreeBlocksError("allocate: " + seq_str(seq_id) + " needs " + std::to_string(num_new) +
                            " new GPU blocks, only " +
                            std::to_string(m.gpu.num_free() - num_free_hits) + " free");

  // Commit (nothing below can fail).
  Sequence seq;
  seq.token_ids = token_ids;
  seq.cache_salt = cache_salt;
  seq.salt_hash = hash_salt(cache_salt);
  seq.block_table.reserve(num_blocks);
  for (BlockId b : hits) {
    m.gpu.inc_ref(b);
    seq.block_table.push_back(b);
  }
  for (int64_t i = 0; i < num_new; ++i) seq.block_table.push_back(m.alloc_gpu("allocate"));
  seq.block_hashes = std::move(hashes);
  seq.num_marked_blocks = static_cast<int64_t>(hits.size());
  if (!hits.empty()) {
    seq.chain_parent = hits.back();
    seq.chain_parent_gen = m.cache.generation(hits.back());
  }
  m.prefix_cache_query_tokens += max_lookup_blocks * m.block_size;
  const int64_t num_cached_tokens = static_cast<int64_t>(hits.size()) * m.block_size;
  m.prefix_cache_hit_tokens += num_cached_tokens;
  m.seqs.emplace(seq_id, std::move(seq));
  return num_cached_tokens;
}

bool BlockManager::can_append_slots(const std::vector<SeqId>& seq_ids) const {
  const Impl& m = *impl_;
  int64_t num_needed = 0;
  for (SeqId id : seq_ids) {
    const Sequence& s = m.get(id, "can_append_slots");
    if (s.device != Device::GPU)
      throw BlockManagerError("can_append_slots: " + seq_str(id) + " is swapped out to the CPU");
    const int64_t n = static_cast<int64_t>(s.token_ids.size());
    if (n % m.block_size == 0 || m.gpu.ref_count(s.block_table.back()) > 1) ++num_needed;
  }
  return num_needed <= m.gpu.num_free();
}

std::optional<BlockPair> BlockManager::append_slot(SeqId seq_id, int32_t token_id) {
  Impl& m = *impl_;
  Sequence& s = m.get(seq_id, "append_slot");
  if (s.device != Device::GPU)
    throw BlockManagerError("append_slot: " + seq_str(seq_id) + " is swapped out to the CPU");
  const int64_t n = static_cast<int64_t>(s.token_ids.size());
  std::optional<BlockPair> cow;
  if (n % m.block_size == 0) {
    s.block_table.push_back(m.alloc_gpu("append_slot"));
  } else {
    const BlockId last = s.block_table.back();
    if (m.gpu.ref_count(last) > 1) {
      const BlockId dst = m.alloc_gpu("append_slot (copy-on-write)");
      m.gpu.dec_ref(last);  // still > 0: other tables hold it
      s.block_table.back() = dst;
      cow = BlockPair{last, dst};
    }
  }
  s.token_ids.push_back(token_id);
  return cow;
}

void BlockManager::set_last_token_id(SeqId seq_id, int32_t token_id) {
  Impl& m = *impl_;
  Sequence& s = m.get(seq_id, "set_last_token_id");
  const int64_t last = static_cast<int64_t>(s.token_ids.size()) - 1;
  if (last / m.block_size < static_cast<int64_t>(s.block_hashes.size()))
    throw BlockManagerError("set_last_token_id: the last token of " + seq_str(seq_id) +
                            " is in block " + std::to_string(last / m.block_size) +
                            ", which is already hashed for the prefix cache");
  s.token_ids.back() = token_id;
}

void BlockManager::replace_tail(SeqId seq_id, int64_t start, const std::vector<int32_t>& token_ids) {
  Impl& m = *impl_;
  Sequence& s = m.get(seq_id, "replace_tail");
  const int64_t n = static_cast<int64_t>(s.token_ids.size());
  const int64_t new_n = start + static_cast<int64_t>(token_ids.size());
  if (start < 0 || new_n > n)
    throw BlockManagerError("replace_tail: start=" + std::to_string(start) + " with " +
                            std::to_string(token_ids.size()) + " ids does not fit the " +
                            std::to_string(n) + " slots of " + seq_str(seq_id));
  if (s.device != Device::GPU)
    throw BlockManagerError("replace_tail: " + seq_str(seq_id) + " is swapped out to the CPU");
  if (start < n && start / m.block_size < static_cast<int64_t>(s.block_hashes.size()))
    throw BlockManagerError("replace_tail: token " + std::to_string(start) + " of " +
                            seq_str(seq_id) + " is in block " +
                            std::to_string(start / m.block_size) +
                            ", which is already hashed for the prefix cache");
  std::copy(token_ids.begin(), token_ids.end(), s.token_ids.begin() + start);
  s.token_ids.resize(new_n);
  const size_t num_blocks = static_cast<size_t>(ceil_div(new_n, m.block_size));
  while (s.block_table.size() > num_blocks) {
    m.release(Device::GPU, s.block_table.back());
    s.block_table.pop_back();
  }
}

void BlockManager::fork(SeqId parent_id, SeqId child_id) {
  Impl& m = *impl_;
  const Sequence& parent = m.get(parent_id, "fork");
  if (m.seqs.count(child_id))
    throw BlockManagerError("fork: child " + seq_str(child_id) + " already exists");
  Sequence child = parent;
  BlockPool& p = m.pool(child.device);
  for (BlockId b : child.block_table) p.inc_ref(b);
  m.seqs.emplace(child_id, std::move(child));
}

void BlockManager::free(SeqId seq_id) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq_id);
  if (it == m.seqs.end())
    throw BlockManagerError("free: unknown " + seq_str(seq_id) +
                            " (never allocated or already freed)");
  const Sequence& s = it->second;
  for (auto b = s.block_table.rbegin(); b != s.block_table.rend(); ++b) m.release(s.device, *b);
  m.seqs.erase(it);
}

void BlockManager::mark_blocks_computed(SeqId seq_id, int64_t num_computed_tokens) {
  Impl& m = *impl_;
  Sequence& s = m.get(seq_id, "mark_blocks_computed");
  const int64_t n = static_cast<int64_t>(s.token_ids.size());
  if (num_computed_tokens < 0 || num_computed_tokens > n)
    throw BlockManagerError("mark_blocks_computed: num_computed_tokens=" +
                            std::to_string(num_computed_tokens) + " is outside [0, " +
                            std::to_string(n) + "] for " + seq_str(seq_id));
  if (s.device != Device::GPU)
    throw BlockManagerError("mark_blocks_computed: " + seq_str(seq_id) +
                            " is swapped out to the CPU");
  if (!m.enable_prefix_caching || s.chain_broken) return;
  const int64_t num_full = num_computed_tokens / m.block_size;
  if (num_full <= s.num_marked_blocks) return;
  if (s.chain_parent != PrefixCache::kNoParent &&
      m.cache.generation(s.chain_parent) != s.chain_parent_gen) {
    s.chain_broken = true;  // the cached block our chain hangs on was evicted
    return;
  }
  m.compute_hashes(s, num_full);
  for (int64_t i = s.num_marked_blocks; i < num_full; ++i) {
    const BlockId b = s.block_table[i];
    const int32_t* tokens = s.token_ids.data() + i * m.block_size;
    BlockId reach = m.cache.find(s.block_hashes[i], tokens, s.cache_salt, s.chain_parent);
    if (reach < 0) {
      if (m.cache.is_cached(b)) {
        reach = b;  // already registered (shared with a forked sequence under another chain)
      } else {
        m.cache.insert(b, s.block_hashes[i], tokens, s.cache_salt, s.chain_parent);
        reach = b;
      }
    }
    // else: an equal block is already cached; b stays unregistered, the chain goes on
    // through the cached one.
    s.chain_parent = reach;
    s.chain_parent_gen = m.cache.generation(reach);
  }
  s.num_marked_blocks = num_full;
}

// ---- swap -------------------------------------------------------------------------------

std::vector<Sequence*> BlockManager::Impl::swap_group(const std::vector<SeqId>& seq_ids,
                                                      Device from, const char* op) {
  Impl& m = *this;
  std::vector<Sequence*> group;
  std::unordered_set<SeqId> seen;
  for (SeqId id : seq_ids) {
    if (!seen.insert(id).second)
      throw BlockManagerError(std::string(op) + ": " + seq_str(id) + " is listed twice");
    Sequence& s = m.get(id, op);
    if (s.device != from)
      throw BlockManagerError(std::string(op) + ": " + seq_str(id) + " is on the " +
                              (s.device == Device::GPU ? "GPU" : "CPU") + " already");
    group.push_back(&s);
  }
  return group;
}

bool BlockManager::can_swap_out(const std::vector<SeqId>& seq_ids) const {
  Impl& m = *impl_;
  auto group = m.swap_group(seq_ids, Device::GPU, "can_swap_out");
  const std::vector<const Sequence*> cgroup(group.begin(), group.end());
  return static_cast<int>(distinct_blocks(cgroup).size()) <= m.cpu.num_free();
}

AllocStatus BlockManager::can_swap_in(const std::vector<SeqId>& seq_ids) const {
  Impl& m = *impl_;
  auto group = m.swap_group(seq_ids, Device::CPU, "can_swap_in");
  const std::vector<const Sequence*> cgroup(group.begin(), group.end());
  // One more block per sequence so that each can grow after it is back.
  const int64_t num_needed =
      static_cast<int64_t>(distinct_blocks(cgroup).size()) + static_cast<int64_t>(group.size());
  if (num_needed > m.gpu.num_blocks() - m.watermark_blocks) return AllocStatus::NEVER;
  if (num_needed <= m.gpu.num_free() - m.watermark_blocks) return AllocStatus::OK;
  return AllocStatus::LATER;
}

// Moves a group between pools: each distinct source block gets one destination block whose
// ref_count is the group's number of references; the source blocks lose those references.
std::vector<BlockPair> BlockManager::Impl::move_group(const std::vector<SeqId>& seq_ids,
                                                      Device from, Device to, const char* op) {
  Impl& m = *this;
  auto group = swap_group(seq_ids, from, op);
  const std::vector<const Sequence*> cgroup(group.begin(), group.end());
  const std::vector<BlockId> blocks = distinct_blocks(cgroup);
  BlockPool& dst_pool = m.pool(to);
  if (static_cast<int>(blocks.size()) > dst_pool.num_free())
    throw NoFreeBlocksError(std::string(op) + ": the group needs " +
                            std::to_string(blocks.size()) + " free " +
                            (to == Device::GPU ? "GPU" : "CPU") + " blocks, only " +
                            std::to_string(dst_pool.num_free()) + " free");
  std::unordered_map<BlockId, BlockId> mapping;
  std::vector<BlockPair> pairs;
  pairs.reserve(blocks.size());
  for (BlockId src : blocks) {
    const BlockId dst = to == Device::GPU ? m.alloc_gpu(op) : dst_pool.pop_free();
    mapping.emplace(src, dst);  // dst holds one reference now: the first table entry's
    pairs.emplace_back(src, dst);
  }
  std::unordered_set<BlockId> first_seen;
  for (Sequence* s : group) {
    for (BlockId b : s->block_table)
      if (!first_seen.insert(b).second) dst_pool.inc_ref(mapping[b]);
    // Release the source references last block first (the free-list order of free()).
    for (auto b = s->block_table.rbegin(); b != s->block_table.rend(); ++b) m.release(from, *b);
    for (BlockId& b : s->block_table) b = mapping[b];
    s->device = to;
    if (to == Device::GPU) {  // fresh blocks: nothing of them is registered yet
      s->num_marked_blocks = 0;
      s->chain_parent = PrefixCache::kNoParent;
      s->chain_parent_gen = 0;
      s->chain_broken = false;
    }
  }
  return pairs;
}

std::vector<BlockPair> BlockManager::swap_out(const std::vector<SeqId>& seq_ids) {
  return impl_->move_group(seq_ids, Device::GPU, Device::CPU, "swap_out");
}

std::vector<BlockPair> BlockManager::swap_in(const std::vector<SeqId>& seq_ids) {
  return impl_->move_group(seq_ids, Device::CPU, Device::GPU, "swap_in");
}

// ---- prefix cache -----------------------------------------------------------------------

PrefixMatch BlockManager::lookup_prefix(const std::vector<int32_t>& token_ids,
                                        const std::string& cache_salt) const {
  const Impl& m = *impl_;
  PrefixMatch match;
  if (!m.enable_prefix_caching) return match;
  const int64_t max_blocks = static_cast<int64_t>(token_ids.size()) / m.block_size;
  match.block_ids = m.lookup(token_ids, cache_salt, max_blocks, nullptr);
  match.num_cached_tokens = static_cast<int64_t>(match.block_ids.size()) * m.block_size;
  return match;
}

void BlockManager::reset_prefix_cache() {
  Impl& m = *impl_;
  for (BlockId b : m.gpu.free_block_ids())
    if (m.cache.is_cached(b)) m.cache.reuse(b);  // children registered under b die with it
}

void BlockManager::set_hash_mask(uint64_t mask) { impl_->cache.set_hash_mask(mask); }

}  // namespace pagedd
