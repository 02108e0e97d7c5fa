// The tier-spanning prefix cache (prefix_cache.h): hashing, lookup, entries and their copies.
#include "prefix_cache.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace pagedd {

namespace {
// splitmix64 finalizer: a cheap, well-mixed 64-bit permutation.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}
}  // namespace

uint64_t hash_salt(const std::string& salt) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : salt) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t hash_block(uint64_t parent_hash, const int32_t* token_ids, int block_size,
                    uint64_t salt_hash) {
  uint64_t h = mix64(parent_hash ^ 0x9e3779b97f4a7c15ULL) ^ mix64(salt_hash + 0x632be59bd9b4e019ULL);
  for (int i = 0; i < block_size; ++i) {
    h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(token_ids[i])) +
                   0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(i + 1)));
  }
  return h;
}

PrefixCache::PrefixCache(const std::array<int, kNumTiers>& num_blocks, int block_size)
    : block_size_(block_size) {
  int num_slots = 0;
  for (int t = 0; t < kNumTiers; ++t) {
    entry_of_[t].assign(num_blocks[t], kNoEntry);
    num_slots += num_blocks[t];
  }
  entries_.resize(num_slots);
  token_ids_.assign(static_cast<size_t>(num_slots) * block_size, 0);
  free_entries_.reserve(num_slots);
  for (EntryId e = num_slots - 1; e >= 0; --e) free_entries_.push_back(e);
}

bool PrefixCache::matches(EntryId e, const int32_t* token_ids, const std::string& salt,
                          uint64_t parent_uid) const {
  const Entry& entry = entries_[e];
  if (entry.parent_uid != parent_uid || entry.salt != salt) return false;
  return std::memcmp(this->token_ids(e), token_ids, sizeof(int32_t) * block_size_) == 0;
}

PrefixCache::EntryId PrefixCache::find(uint64_t hash, const int32_t* token_ids,
                                       const std::string& salt, uint64_t parent_uid) const {
  auto range = table_.equal_range(hash & mask_);
  for (auto it = range.first; it != range.second; ++it) {
    if (matches(it->second, token_ids, salt, parent_uid)) return it->second;
  }
  return kNoEntry;
}

PrefixCache::EntryId PrefixCache::insert(uint64_t hash, const int32_t* token_ids,
                                         const std::string& salt, uint64_t parent_uid,
                                         uint64_t uid) {
  // Every live entry holds at least one block, so a slot is always free for a new copy's
  // entry (the caller drops the block's old entry first).
  if (free_entries_.empty()) throw std::logic_error("PrefixCache::insert: no free entry slot");
  const EntryId e = free_entries_.back();
  free_entries_.pop_back();
  Entry& entry = entries_[e];
  entry.uid = uid != 0 ? uid : next_uid_;
  next_uid_ = std::max(next_uid_, entry.uid + 1);
  entry.hash = hash;
  entry.parent_uid = parent_uid;
  entry.salt = salt;
  entry.block = {{-1, -1, -1}};
  std::memcpy(token_ids_.data() + static_cast<size_t>(e) * block_size_, token_ids,
              sizeof(int32_t) * block_size_);
  table_.emplace(hash & mask_, e);
  return e;
}

void PrefixCache::set_location(EntryId e, Device d, BlockId b) {
  const int t = tier_index(d);
  if (entry_of_[t][b] != kNoEntry || entries_[e].block[t] >= 0)
    throw std::logic_error("PrefixCache::set_location: the block or the entry has a copy there");
  entries_[e].block[t] = b;
  entry_of_[t][b] = e;
  ++num_cached_[t];
}

void PrefixCache::drop_location(Device d, BlockId b) {
  const int t = tier_index(d);
  const EntryId e = entry_of_[t][b];
  if (e == kNoEntry) return;
  entry_of_[t][b] = kNoEntry;
  --num_cached_[t];
  Entry& entry = entries_[e];
  entry.block[t] = -1;
  if (entry.block[0] < 0 && entry.block[1] < 0 && entry.block[2] < 0) erase(e);
}

void PrefixCache::erase(EntryId e) {
  Entry& entry = entries_[e];
  auto range = table_.equal_range(entry.hash & mask_);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == e) {
      table_.erase(it);
      break;
    }
  }
  entry.uid = 0;
  entry.salt.clear();
  free_entries_.push_back(e);
}

void PrefixCache::set_hash_mask(uint64_t mask) {
  mask_ = mask;
  std::unordered_multimap<uint64_t, EntryId> rebuilt;
  rebuilt.reserve(table_.size());
  for (const auto& kv : table_) rebuilt.emplace(entries_[kv.second].hash & mask_, kv.second);
  table_.swap(rebuilt);
}

}  // namespace pagedd
