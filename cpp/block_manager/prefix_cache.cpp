#include "prefix_cache.h"

#include <algorithm>
#include <cstring>

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

PrefixCache::PrefixCache(int num_blocks, int block_size)
    : block_size_(block_size),
      is_cached_(num_blocks, 0),
      hash_(num_blocks, 0),
      generation_(num_blocks, 0),
      parent_(num_blocks, kNoParent),
      parent_gen_(num_blocks, 0),
      salt_(num_blocks),
      token_ids_(static_cast<size_t>(num_blocks) * block_size, 0) {}

bool PrefixCache::matches(BlockId b, const int32_t* token_ids, const std::string& salt,
                          BlockId parent) const {
  if (parent_[b] != parent) return false;
  if (parent != kNoParent && parent_gen_[b] != generation_[parent]) return false;
  if (salt_[b] != salt) return false;
  const int32_t* stored = token_ids_.data() + static_cast<size_t>(b) * block_size_;
  return std::memcmp(stored, token_ids, sizeof(int32_t) * block_size_) == 0;
}

BlockId PrefixCache::find(uint64_t hash, const int32_t* token_ids, const std::string& salt,
                          BlockId parent) const {
  auto range = table_.equal_range(hash & mask_);
  for (auto it = range.first; it != range.second; ++it) {
    if (matches(it->second, token_ids, salt, parent)) return it->second;
  }
  return -1;
}

void PrefixCache::insert(BlockId b, uint64_t hash, const int32_t* token_ids,
                         const std::string& salt, BlockId parent) {
  is_cached_[b] = 1;
  hash_[b] = hash;
  parent_[b] = parent;
  parent_gen_[b] = parent == kNoParent ? 0 : generation_[parent];
  salt_[b] = salt;
  std::memcpy(token_ids_.data() + static_cast<size_t>(b) * block_size_, token_ids,
              sizeof(int32_t) * block_size_);
  table_.emplace(hash & mask_, b);
}

void PrefixCache::erase(BlockId b) {
  if (!is_cached_[b]) return;
  auto range = table_.equal_range(hash_[b] & mask_);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == b) {
      table_.erase(it);
      break;
    }
  }
  is_cached_[b] = 0;
  salt_[b].clear();
}

void PrefixCache::set_hash_mask(uint64_t mask) {
  mask_ = mask;
  std::unordered_multimap<uint64_t, BlockId> rebuilt;
  rebuilt.reserve(table_.size());
  for (const auto& kv : table_) rebuilt.emplace(hash_[kv.second] & mask_, kv.second);
  table_.swap(rebuilt);
}

}  // namespace pagedd
