// Allocation, growth, fork, free, swap and prefix-cache registration. The tiers' step
// (saves ahead, disk writes, restores) is in tiers.cpp, the accounting in accounting.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "block_manager.h"
#include "block_manager_impl.h"

namespace pagedd {

namespace {

std::string seq_str(SeqId id) { return "sequence " + std::to_string(id); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_ctor_args(int block_size, int num_gpu_blocks, int num_cpu_blocks, double watermark,
                     bool enable_prefix_caching, bool enable_cpu_tier, int num_disk_blocks,
                     int save_ahead_blocks) {
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
  if (enable_cpu_tier && !enable_prefix_caching)
    throw std::invalid_argument(
        "BlockManager: the CPU tier keeps evicted prefix-cache blocks: it needs "
        "enable_prefix_caching");
  if (enable_cpu_tier && num_cpu_blocks < 1)
    throw std::invalid_argument("BlockManager: the CPU tier needs num_cpu_blocks >= 1, got " +
                                std::to_string(num_cpu_blocks));
  if (num_disk_blocks < 0)
    throw std::invalid_argument("BlockManager: num_disk_blocks must be >= 0, got " +
                                std::to_string(num_disk_blocks));
  if (num_disk_blocks > 0 && !enable_cpu_tier)
    throw std::invalid_argument(
        "BlockManager: the disk tier sits behind the CPU tier: num_disk_blocks > 0 needs "
        "enable_cpu_tier");
  if (save_ahead_blocks < 0)
    throw std::invalid_argument("BlockManager: save_ahead_blocks must be >= 0, got " +
                                std::to_string(save_ahead_blocks));
}

// Distinct blocks referenced by a group, in first-reference order.
std::vector<BlockId> distinct_blocks(const std::vector<const Sequence*>& group) {
  std::vector<BlockId> out;
  std::unordered_set<BlockId> seen;
  for (const Sequence* s : group)
    for (BlockId b : s->block_table)
      if (b != kNoBlock && seen.insert(b).second) out.push_back(b);
  return out;
}

}  // namespace

// ---- Impl -------------------------------------------------------------------------------

BlockManager::Impl::Impl(int block_size_, int num_gpu_blocks, int num_cpu_blocks, double watermark,
                         bool enable_prefix_caching_, bool enable_cpu_tier_, int num_disk_blocks,
                         int save_ahead_blocks_)
    : block_size(block_size_),
      watermark_blocks(static_cast<int>(watermark * num_gpu_blocks)),
      enable_prefix_caching(enable_prefix_caching_),
      enable_cpu_tier(enable_cpu_tier_),
      save_ahead_blocks(save_ahead_blocks_),
      gpu(num_gpu_blocks),
      cpu(num_cpu_blocks),
      disk(num_disk_blocks),
      cache({num_gpu_blocks, num_cpu_blocks, num_disk_blocks}, block_size_),
      gpu_ready_step(num_gpu_blocks, 0),
      cpu_ready_step(num_cpu_blocks, 0) {}

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
  const BlockId b = gpu.pop_free();
  const PrefixCache::EntryId e = cache.entry_at(Device::GPU, b);
  if (e != PrefixCache::kNoEntry) {
    // Evicted: the entry lives on in the CPU tier if it has (or gets) a copy there. A block
    // still loading has its CPU source pinned, so it never needs a save.
    if (enable_cpu_tier && cache.location(e, Device::CPU) < 0) save_to_cpu(e, b, false);
    cache.drop_location(Device::GPU, b);
  }
  gpu_ready_step[b] = 0;
  return b;
}

BlockId BlockManager::Impl::alloc_cpu() {
  if (cpu.num_free() == 0) return BlockPool::kNone;
  const BlockId c = cpu.pop_free();
  cache.drop_location(Device::CPU, c);  // evicted from the CPU tier (a disk copy may remain)
  cpu_ready_step[c] = 0;
  return c;
}

BlockId BlockManager::Impl::alloc_disk() {
  if (disk.num_free() == 0) return BlockPool::kNone;
  const BlockId d = disk.pop_free();
  cache.drop_location(Device::DISK, d);
  return d;
}

void BlockManager::Impl::release(Device d, BlockId b) {
  BlockPool& p = pool(d);
  if (p.dec_ref(b) > 0) return;
  if (cache.is_cached(d, b))
    p.push_tail(b);  // keeps its content: LRU end
  else
    p.push_head(b);
}

void BlockManager::Impl::pin(Device d, BlockId b) {
  pool(d).inc_ref(b);
  adopt_pin(d, b);
}

void BlockManager::Impl::adopt_pin(Device d, BlockId b) {
  pins.emplace_back(d, b);
  ++num_pinned[tier_index(d)];
}

void BlockManager::Impl::compute_hashes(Sequence& seq, int64_t num_blocks) const {
  for (int64_t i = static_cast<int64_t>(seq.block_hashes.size()); i < num_blocks; ++i) {
    uint64_t parent = i == 0 ? 0 : seq.block_hashes[i - 1];
    seq.block_hashes.push_back(
        hash_block(parent, seq.token_ids.data() + i * block_size, block_size, seq.salt_hash));
  }
}

std::vector<Hit> BlockManager::Impl::lookup(const std::vector<int32_t>& token_ids,
                                            const std::string& salt, int64_t max_blocks,
                                            std::vector<uint64_t>* hashes) const {
  std::vector<Hit> hits;
  const uint64_t salt_hash = hash_salt(salt);
  uint64_t parent_hash = 0;
  uint64_t parent_uid = PrefixCache::kNoParentUid;
  for (int64_t i = 0; i < max_blocks; ++i) {
    const int32_t* block = token_ids.data() + i * block_size;
    const uint64_t h = hash_block(parent_hash, block, block_size, salt_hash);
    const PrefixCache::EntryId e = cache.find(h, block, salt, parent_uid);
    if (e == PrefixCache::kNoEntry) break;
    const Device tier = cache.location(e, Device::GPU) >= 0   ? Device::GPU
                        : cache.location(e, Device::CPU) >= 0 ? Device::CPU
                                                              : Device::DISK;
    hits.push_back(Hit{e, tier});
    if (hashes) hashes->push_back(h);
    parent_hash = h;
    parent_uid = cache.uid(e);
  }
  return hits;
}

// ---- BlockManager -----------------------------------------------------------------------

BlockManager::BlockManager(int block_size, int num_gpu_blocks, int num_cpu_blocks, double watermark,
                           bool enable_prefix_caching, bool enable_cpu_tier, int num_disk_blocks,
                           int save_ahead_blocks) {
  check_ctor_args(block_size, num_gpu_blocks, num_cpu_blocks, watermark, enable_prefix_caching,
                  enable_cpu_tier, num_disk_blocks, save_ahead_blocks);
  impl_ = std::make_unique<Impl>(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                                 enable_prefix_caching, enable_cpu_tier, num_disk_blocks,
                                 save_ahead_blocks);
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
    for (const Hit& hit : m.lookup(token_ids, cache_salt, max_blocks, nullptr))
      if (hit.tier == Device::GPU && !m.gpu.is_free(m.cache.location(hit.entry, Device::GPU)))
        ++num_in_use_hits;
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
  std::vector<Hit> hits = m.lookup(token_ids, cache_salt, max_lookup_blocks, &hashes);
  // A disk hit is staged in a CPU block: the hits stop where no CPU block is left for one.
  int64_t num_cpu_free = m.cpu.num_free();
  for (const Hit& hit : hits)
    if (hit.tier == Device::CPU && m.cpu.is_free(m.cache.location(hit.entry, Device::CPU)))
      --num_cpu_free;
  for (size_t i = 0; i < hits.size(); ++i) {
    if (hits[i].tier != Device::DISK) continue;
    if (num_cpu_free == 0) {
      hits.resize(i);
      hashes.resize(i);
      break;
    }
    --num_cpu_free;
  }
  int64_t num_gpu_hits = 0, num_free_gpu_hits = 0;
  for (const Hit& hit : hits) {
    if (hit.tier != Device::GPU) continue;
    ++num_gpu_hits;
    if (m.gpu.is_free(m.cache.location(hit.entry, Device::GPU))) ++num_free_gpu_hits;
  }
  const int64_t num_new = num_blocks - num_gpu_hits;
  if (num_new > m.gpu.num_free() - num_free_gpu_hits)
    throw NoFreeBlocksError("allocate: " + seq_str(seq_id) + " needs " + std::to_string(num_new) +
                            " new GPU blocks, only " +
                            std::to_string(m.gpu.num_free() - num_free_gpu_hits) + " free");

  // Commit (nothing below can fail). Every hit's block is held before any block is popped, so
  // that no allocation below evicts one (a disk hit's staging block must not be a later CPU
  // hit's, nor a GPU block a GPU hit's).
  Sequence seq;
  seq.token_ids = token_ids;
  seq.cache_salt = cache_salt;
  seq.salt_hash = hash_salt(cache_salt);
  seq.block_table.assign(num_blocks, BlockPool::kNone);
  std::vector<BlockId> sources(hits.size(), BlockPool::kNone);  // CPU block to load from
  for (size_t i = 0; i < hits.size(); ++i) {
    const Hit& hit = hits[i];
    if (hit.tier == Device::GPU) {
      const BlockId g = m.cache.location(hit.entry, Device::GPU);
      m.gpu.inc_ref(g);
      seq.block_table[i] = g;
      seq.ready_step = std::max(seq.ready_step, m.gpu_ready_step[g]);
    } else if (hit.tier == Device::CPU) {
      sources[i] = m.cache.location(hit.entry, Device::CPU);
      m.pin(Device::CPU, sources[i]);
    } else {
      m.pin(Device::DISK, m.cache.location(hit.entry, Device::DISK));
    }
  }
  for (size_t i = 0; i < hits.size(); ++i) {
    if (hits[i].tier != Device::DISK) continue;
    const BlockId c = m.alloc_cpu();  // counted above: one is free
    m.adopt_pin(Device::CPU, c);
    m.cache.set_location(hits[i].entry, Device::CPU, c);
    m.cpu_ready_step[c] = m.step_index + 1;  // filled by the read, after this step's copies
    const BlockId d = m.cache.location(hits[i].entry, Device::DISK);
    m.moves.blocks_to_read_from_disk.emplace_back(d, c);
    m.moves.disk_read_records.push_back(m.disk_record(hits[i].entry, d));
    ++m.stats.num_read_blocks;
    sources[i] = c;
  }
  for (int64_t i = 0; i < num_blocks; ++i) {
    if (seq.block_table[i] != BlockPool::kNone) continue;
    const BlockId g = m.alloc_gpu("allocate");
    seq.block_table[i] = g;
    if (i >= static_cast<int64_t>(hits.size())) continue;
    // A hit restored from the CPU tier: loaded while this step runs (or the next one, after a
    // disk read), read from the step after.
    const BlockId c = sources[i];
    m.cache.set_location(hits[i].entry, Device::GPU, g);
    const int64_t load_step = std::max(m.step_index, m.cpu_ready_step[c]);
    (load_step == m.step_index ? m.moves.blocks_to_load_from_cpu : m.deferred_loads)
        .emplace_back(c, g);
    m.gpu_ready_step[g] = load_step + 1;
    seq.ready_step = std::max(seq.ready_step, load_step + 1);
  }
  seq.block_hashes = std::move(hashes);
  seq.num_marked_blocks = static_cast<int64_t>(hits.size());
  if (!hits.empty()) {
    seq.chain_parent = hits.back().entry;
    seq.chain_parent_uid = m.cache.uid(hits.back().entry);
  }
  m.prefix_cache_query_tokens += max_lookup_blocks * m.block_size;
  const int64_t num_cached_tokens = static_cast<int64_t>(hits.size()) * m.block_size;
  m.prefix_cache_hit_tokens += num_cached_tokens;
  for (const Hit& hit : hits) {
    int64_t& counter = hit.tier == Device::GPU   ? m.stats.gpu_hit_tokens
                       : hit.tier == Device::CPU ? m.stats.cpu_hit_tokens
                                                 : m.stats.disk_hit_tokens;
    counter += m.block_size;
  }
  m.seqs.emplace(seq_id, std::move(seq));
  return num_cached_tokens;
}

// ---- per-layer-group tables ----------------------------------------------------------------

std::vector<std::vector<Hit>> BlockManager::Impl::group_hits(
    const std::vector<int32_t>& token_ids, const std::vector<std::string>& salts,
    std::vector<std::vector<uint64_t>>* hashes) const {
  const Impl& m = *this;
  std::vector<std::vector<Hit>> hits(salts.size());
  if (hashes) hashes->assign(salts.size(), {});
  if (!m.enable_prefix_caching) return hits;
  const int64_t max_blocks = (static_cast<int64_t>(token_ids.size()) - 1) / m.block_size;
  size_t n = SIZE_MAX;
  for (size_t g = 0; g < salts.size(); ++g) {
    hits[g] = m.lookup(token_ids, salts[g], max_blocks, hashes ? &(*hashes)[g] : nullptr);
    size_t gpu = 0;  // leading GPU hits (no tier is on here)
    while (gpu < hits[g].size() && hits[g][gpu].tier == Device::GPU) ++gpu;
    n = std::min(n, gpu);
  }
  for (size_t g = 0; g < salts.size(); ++g) {
    hits[g].resize(n);
    if (hashes) (*hashes)[g].resize(n);
  }
  return hits;
}

void BlockManager::Impl::check_group_args(const std::vector<int32_t>& token_ids,
                                          const std::vector<std::string>& salts,
                                          size_t num_seqs, const char* op) const {
  const Impl& m = *this;
  if (token_ids.empty()) throw BlockManagerError(std::string(op) + ": token_ids is empty");
  if (salts.empty() || salts.size() != num_seqs)
    throw BlockManagerError(std::string(op) + ": " + std::to_string(num_seqs) + " seq_ids and " +
                            std::to_string(salts.size()) + " salts (one per group, >= 1)");
  if (m.enable_cpu_tier)
    throw BlockManagerError(std::string(op) +
                            ": per-layer-group tables do not support the CPU tier");
}

AllocStatus BlockManager::can_allocate_group(const std::vector<int32_t>& token_ids,
                                             const std::vector<std::string>& salts) const {
  const Impl& m = *impl_;
  m.check_group_args(token_ids, salts, salts.size(), "can_allocate_group");
  const int64_t num_groups = static_cast<int64_t>(salts.size());
  const int64_t num_blocks =
      num_groups * ceil_div(static_cast<int64_t>(token_ids.size()), m.block_size);
  if (num_blocks > m.gpu.num_blocks() - m.watermark_blocks) return AllocStatus::NEVER;
  int64_t num_in_use_hits = 0;
  for (const auto& hits : m.group_hits(token_ids, salts, nullptr))
    for (const Hit& hit : hits)
      if (!m.gpu.is_free(m.cache.location(hit.entry, Device::GPU))) ++num_in_use_hits;
  if (num_blocks - num_in_use_hits <= m.gpu.num_free() - m.watermark_blocks)
    return AllocStatus::OK;
  return AllocStatus::LATER;
}

int64_t BlockManager::allocate_group(const std::vector<SeqId>& seq_ids,
                                     const std::vector<int32_t>& token_ids,
                                     const std::vector<std::string>& salts) {
  Impl& m = *impl_;
  m.check_group_args(token_ids, salts, seq_ids.size(), "allocate_group");
  for (size_t g = 0; g < seq_ids.size(); ++g) {
    if (m.seqs.count(seq_ids[g]))
      throw BlockManagerError("allocate_group: " + seq_str(seq_ids[g]) + " already exists");
    for (size_t h = 0; h < g; ++h)
      if (seq_ids[h] == seq_ids[g])
        throw BlockManagerError("allocate_group: " + seq_str(seq_ids[g]) + " listed twice");
  }
  const int64_t num_tokens = static_cast<int64_t>(token_ids.size());
  const int64_t num_blocks = ceil_div(num_tokens, m.block_size);
  std::vector<std::vector<uint64_t>> hashes;
  std::vector<std::vector<Hit>> hits = m.group_hits(token_ids, salts, &hashes);
  const int64_t num_hits = hits.empty() ? 0 : static_cast<int64_t>(hits[0].size());
  int64_t num_free_hits = 0;
  for (const auto& group : hits)
    for (const Hit& hit : group)
      if (m.gpu.is_free(m.cache.location(hit.entry, Device::GPU))) ++num_free_hits;
  const int64_t num_new = static_cast<int64_t>(seq_ids.size()) * (num_blocks - num_hits);
  if (num_new > m.gpu.num_free() - num_free_hits)
    throw NoFreeBlocksError("allocate_group: " + seq_str(seq_ids[0]) + " and its groups need " +
                            std::to_string(num_new) + " new GPU blocks, only " +
                            std::to_string(m.gpu.num_free() - num_free_hits) + " free");
  // Commit: every group's hits are held before any block is popped.
  std::vector<Sequence> seqs(seq_ids.size());
  for (size_t g = 0; g < seq_ids.size(); ++g) {
    Sequence& seq = seqs[g];
    seq.token_ids = token_ids;
    seq.cache_salt = salts[g];
    seq.salt_hash = hash_salt(salts[g]);
    seq.block_table.assign(num_blocks, BlockPool::kNone);
    for (int64_t i = 0; i < num_hits; ++i) {
      const BlockId b = m.cache.location(hits[g][i].entry, Device::GPU);
      m.gpu.inc_ref(b);
      seq.block_table[i] = b;
      seq.ready_step = std::max(seq.ready_step, m.gpu_ready_step[b]);
    }
  }
  for (size_t g = 0; g < seq_ids.size(); ++g) {
    Sequence& seq = seqs[g];
    for (int64_t i = num_hits; i < num_blocks; ++i) seq.block_table[i] = m.alloc_gpu("allocate");
    seq.block_hashes = std::move(hashes[g]);
    seq.num_marked_blocks = num_hits;
    if (num_hits > 0) {
      seq.chain_parent = hits[g].back().entry;
      seq.chain_parent_uid = m.cache.uid(hits[g].back().entry);
    }
    m.seqs.emplace(seq_ids[g], std::move(seq));
  }
  // Counted once, as one sequence: the groups' tables hold the same tokens.
  if (m.enable_prefix_caching) {
    m.prefix_cache_query_tokens += (num_tokens - 1) / m.block_size * m.block_size;
    m.prefix_cache_hit_tokens += num_hits * m.block_size;
    m.stats.gpu_hit_tokens += num_hits * m.block_size;
  }
  return num_hits * m.block_size;
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
    if (s.block_table.back() != kNoBlock) m.release(Device::GPU, s.block_table.back());
    s.block_table.pop_back();
  }
  s.num_released_blocks = std::min<int64_t>(s.num_released_blocks, num_blocks);
}

void BlockManager::fork(SeqId parent_id, SeqId child_id) {
  Impl& m = *impl_;
  const Sequence& parent = m.get(parent_id, "fork");
  if (m.seqs.count(child_id))
    throw BlockManagerError("fork: child " + seq_str(child_id) + " already exists");
  Sequence child = parent;
  BlockPool& p = m.pool(child.device);
  for (BlockId b : child.block_table)
    if (b != kNoBlock) p.inc_ref(b);
  m.seqs.emplace(child_id, std::move(child));
}

void BlockManager::free(SeqId seq_id) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq_id);
  if (it == m.seqs.end())
    throw BlockManagerError("free: unknown " + seq_str(seq_id) +
                            " (never allocated or already freed)");
  const Sequence& s = it->second;
  for (auto b = s.block_table.rbegin(); b != s.block_table.rend(); ++b)
    if (*b != kNoBlock) m.release(s.device, *b);
  m.seqs.erase(it);
}

int BlockManager::release_blocks_before(SeqId seq_id, int64_t num_tokens) {
  Impl& m = *impl_;
  Sequence& s = m.get(seq_id, "release_blocks_before");
  if (num_tokens < 0 || num_tokens > static_cast<int64_t>(s.token_ids.size()))
    throw BlockManagerError("release_blocks_before: num_tokens=" + std::to_string(num_tokens) +
                            " is outside [0, " + std::to_string(s.token_ids.size()) +
                            "] for " + seq_str(seq_id));
  if (s.device != Device::GPU)
    throw BlockManagerError("release_blocks_before: " + seq_str(seq_id) +
                            " is swapped out to the CPU");
  const int64_t upto = num_tokens / m.block_size;
  if (upto <= s.num_released_blocks) return 0;
  // Last first, as free() releases: the earlier blocks of a prefix are evicted later.
  for (int64_t i = upto - 1; i >= s.num_released_blocks; --i) {
    m.release(Device::GPU, s.block_table[i]);
    s.block_table[i] = kNoBlock;
  }
  const int released = static_cast<int>(upto - s.num_released_blocks);
  s.num_released_blocks = upto;
  return released;
}

int64_t BlockManager::num_released_blocks(SeqId seq_id) const {
  return impl_->get(seq_id, "num_released_blocks").num_released_blocks;
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
  if (s.chain_parent != PrefixCache::kNoEntry &&
      !m.cache.is_alive(s.chain_parent, s.chain_parent_uid)) {
    s.chain_broken = true;  // the entry our chain hangs on died
    return;
  }
  m.compute_hashes(s, num_full);
  for (int64_t i = s.num_marked_blocks; i < num_full; ++i) {
    const BlockId b = s.block_table[i];
    if (b == kNoBlock) {  // released before it was registered: the chain cannot go on
      s.chain_broken = true;
      break;
    }
    const int32_t* tokens = s.token_ids.data() + i * m.block_size;
    PrefixCache::EntryId reach =
        m.cache.find(s.block_hashes[i], tokens, s.cache_salt, s.chain_parent_uid);
    if (reach == PrefixCache::kNoEntry) {
      reach = m.cache.entry_at(Device::GPU, b);
      if (reach == PrefixCache::kNoEntry) {
        reach = m.cache.insert(s.block_hashes[i], tokens, s.cache_salt, s.chain_parent_uid);
        m.cache.set_location(reach, Device::GPU, b);
        if (m.has_disk_tier()) m.written_through.emplace_back(reach, m.cache.uid(reach));
      }
      // else: already registered (shared with a forked sequence under another chain)
    } else if (m.cache.location(reach, Device::GPU) < 0 && !m.cache.is_cached(Device::GPU, b)) {
      // The same content is kept in a lower tier only: b becomes its GPU copy (its later
      // eviction then costs no save).
      m.cache.set_location(reach, Device::GPU, b);
    }
    // else: an equal block is already on the GPU; b stays unregistered, the chain goes on
    // through the cached one.
    s.chain_parent = reach;
    s.chain_parent_uid = m.cache.uid(reach);
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
    const BlockId dst = to == Device::GPU ? m.alloc_gpu(op) : m.alloc_cpu();
    mapping.emplace(src, dst);  // dst holds one reference now: the first table entry's
    pairs.emplace_back(src, dst);
    // With the CPU tier, a swapped-in CPU block stays off the free list until the next step:
    // its copy to the GPU must not be overtaken by a save into it later in this step.
    if (to == Device::GPU && m.enable_cpu_tier) m.pin(Device::CPU, src);
  }
  std::unordered_set<BlockId> first_seen;
  for (Sequence* s : group) {
    for (BlockId b : s->block_table)
      if (b != kNoBlock && !first_seen.insert(b).second) dst_pool.inc_ref(mapping[b]);
    // Release the source references last block first (the free-list order of free()).
    for (auto b = s->block_table.rbegin(); b != s->block_table.rend(); ++b)
      if (*b != kNoBlock) m.release(from, *b);
    for (BlockId& b : s->block_table)
      if (b != kNoBlock) b = mapping[b];
    s->device = to;
    if (to == Device::GPU) {  // fresh blocks: nothing of them is registered yet
      s->num_marked_blocks = 0;
      s->chain_parent = PrefixCache::kNoEntry;
      s->chain_parent_uid = PrefixCache::kNoParentUid;
      s->chain_broken = false;
      s->ready_step = 0;  // swapped in before this step's writes
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
  for (const Hit& hit : m.lookup(token_ids, cache_salt, max_blocks, nullptr)) {
    if (hit.tier != Device::GPU) break;
    match.block_ids.push_back(m.cache.location(hit.entry, Device::GPU));
  }
  match.num_cached_tokens = static_cast<int64_t>(match.block_ids.size()) * m.block_size;
  return match;
}

void BlockManager::reset_prefix_cache() {
  Impl& m = *impl_;
  for (Device d : {Device::GPU, Device::CPU, Device::DISK})
    for (BlockId b : m.pool(d).free_block_ids()) m.cache.drop_location(d, b);
}

void BlockManager::set_hash_mask(uint64_t mask) { impl_->cache.set_hash_mask(mask); }

}  // namespace pagedd
