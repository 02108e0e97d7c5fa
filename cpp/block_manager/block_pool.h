// One pool of KV blocks (the GPU cache, the CPU pool or the disk tier): per-block ref_count and an
// O(1) intrusive doubly-linked free list over the block ids (prev/next index arrays).
//
// A block is on the free list exactly when its ref_count is 0. The list order is the reuse
// order: pop_free() takes the head. push_head() is for blocks with nothing worth keeping,
// push_tail() for blocks that still hold cached prefix content (LRU: the head-most cached
// block is reused first). The initial list is 0..N-1.
#pragma once

#include <cstdint>
#include <vector>

#include "block_manager.h"

namespace pagedd {

class BlockPool {
 public:
  static constexpr BlockId kNone = -1;

  explicit BlockPool(int num_blocks)
      : ref_count_(num_blocks, 0), prev_(num_blocks), next_(num_blocks), num_free_(num_blocks) {
    for (int b = 0; b < num_blocks; ++b) {
      prev_[b] = b - 1;
      next_[b] = b + 1 < num_blocks ? b + 1 : kNone;
    }
    head_ = num_blocks > 0 ? 0 : kNone;
    tail_ = num_blocks > 0 ? num_blocks - 1 : kNone;
  }

  int num_blocks() const { return static_cast<int>(ref_count_.size()); }
  int num_free() const { return num_free_; }
  int num_used() const { return num_blocks() - num_free_; }
  bool is_valid(BlockId b) const { return b >= 0 && b < num_blocks(); }
  int ref_count(BlockId b) const { return ref_count_[b]; }
  bool is_free(BlockId b) const { return ref_count_[b] == 0; }
  BlockId head() const { return head_; }
  // The block after b on the free list (kNone at the tail); b must be free.
  BlockId next_free(BlockId b) const { return next_[b]; }

  // Take the head of the free list and give it one reference. Caller checks num_free() > 0.
  BlockId pop_free() {
    BlockId b = head_;
    unlink(b);
    ref_count_[b] = 1;
    return b;
  }

  // Add a reference; a free block (a prefix-cache hit) leaves the free list.
  void inc_ref(BlockId b) {
    if (ref_count_[b] == 0) unlink(b);
    ++ref_count_[b];
  }

  // Drop a reference; returns the new ref_count. At 0 the caller pushes the block back with
  // push_head() or push_tail().
  int dec_ref(BlockId b) { return --ref_count_[b]; }

  void push_head(BlockId b) {
    prev_[b] = kNone;
    next_[b] = head_;
    if (head_ != kNone) prev_[head_] = b; else tail_ = b;
    head_ = b;
    ++num_free_;
  }

  void push_tail(BlockId b) {
    next_[b] = kNone;
    prev_[b] = tail_;
    if (tail_ != kNone) next_[tail_] = b; else head_ = b;
    tail_ = b;
    ++num_free_;
  }

  // Free-list order, head first (tests and introspection; O(num_free)).
  std::vector<BlockId> free_block_ids() const {
    std::vector<BlockId> out;
    out.reserve(num_free_);
    for (BlockId b = head_; b != kNone; b = next_[b]) out.push_back(b);
    return out;
  }

 private:
  void unlink(BlockId b) {
    if (prev_[b] != kNone) next_[prev_[b]] = next_[b]; else head_ = next_[b];
    if (next_[b] != kNone) prev_[next_[b]] = prev_[b]; else tail_ = prev_[b];
    --num_free_;
  }

  std::vector<int32_t> ref_count_;
  std::vector<BlockId> prev_, next_;
  BlockId head_ = kNone, tail_ = kNone;
  int num_free_ = 0;
};

}  // namespace pagedd
