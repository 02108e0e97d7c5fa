// The KV-cache block manager: every decision about which KV block holds which token.
//
// Host-only C++17: no CUDA, no Python headers. pydaemon._core binds it (cpp/bindings/).
//
// Vocabulary (the same names in Python):
//   block_id       index of a block inside one pool (GPU pool or CPU swap pool).
//   ref_count      number of block-table entries (over all sequences) that point at a block.
//   block_table    per sequence, the list of block ids holding its tokens, in order.
//                  Append-only while the sequence lives on one device.
//   slot           block_id * block_size + offset: the flat index of one token's K/V.
//
// Invariants (checked by tests/test_block_manager_props.py after every operation):
//   - ref_count[b] == number of block-table entries referring to b (per pool).
//   - a block is on its pool's free list  <=>  ref_count == 0.
//   - num_free + num_used == num_total, per pool.
//   - a sequence needs a new block only when its last block is full, so KV waste is at most
//     one partly filled block per sequence.
//
// Free list: an intrusive doubly-linked list over the pool's blocks, O(1) push/pop/remove.
// Allocation pops the head. Freed blocks that hold no cached content go to the head (reused
// first); freed blocks that hold cached prefix content go to the tail, so the list is also the
// LRU of cached-but-free blocks: the head-most cached block is evicted first (its hash entry is
// dropped when it is popped). A freed sequence releases its blocks last-to-first, so the later
// blocks of a prefix are evicted before the earlier ones. The initial free list is 0..N-1.
//
// Prefix caching: each full block of a sequence has a hash chained over
// (parent block hash, the block's token ids, cache_salt). Only blocks whose KV has been
// computed (mark_blocks_computed) are entered in the cache. A hit is accepted only if the
// block's stored token ids equal the looked-up ones, its stored salt equals the salt, and its
// stored parent is the block hit just before it (block id and reuse generation), so a hash
// collision can never serve another prompt's KV.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pagedd {

enum class Device : uint8_t { GPU = 0, CPU = 1 };

// Answer of an admission check.
//   OK:    enough free blocks now (after the watermark).
//   LATER: not now, but it would fit in an empty pool.
//   NEVER: it can never fit in this pool (reject the request).
enum class AllocStatus : uint8_t { OK = 0, LATER = 1, NEVER = 2 };

// Misuse: unknown / duplicate sequence, double free, wrong device, bad sizes.
class BlockManagerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A pool has no free block for an operation the caller did not check first.
class NoFreeBlocksError : public BlockManagerError {
 public:
  using BlockManagerError::BlockManagerError;
};

using SeqId = int64_t;
using BlockId = int32_t;
using BlockPair = std::pair<BlockId, BlockId>;  // (src, dst)

struct PrefixMatch {
  std::vector<BlockId> block_ids;  // GPU blocks holding the cached prefix, in order
  int64_t num_cached_tokens = 0;   // block_ids.size() * block_size
};

class BlockManager {
 public:
  // watermark: fraction of GPU blocks kept free at admission (can_allocate / can_swap_in),
  // so that running sequences can still grow.
  BlockManager(int block_size, int num_gpu_blocks, int num_cpu_blocks, double watermark = 0.01,
               bool enable_prefix_caching = true);

  // ---- admission -------------------------------------------------------------------------
  // Can a new sequence with these prompt tokens get its blocks? Counts cached prefix blocks
  // that are in use (ref_count > 0) as free of charge. NEVER if ceil(len / block_size) >
  // num_gpu_blocks - watermark_blocks (watermark_blocks = int(watermark * num_gpu_blocks)); OK
  // if the blocks still needed fit in num_free - watermark_blocks; else LATER. Throws
  // BlockManagerError if token_ids is empty.
  AllocStatus can_allocate(const std::vector<int32_t>& token_ids,
                           const std::string& cache_salt = "") const;

  // Create seq_id with blocks for every token of token_ids, reusing cached prefix blocks.
  // Returns the number of leading tokens whose KV is already in the cache (a multiple of
  // block_size, counted as prefix-cache hits). Only the full blocks that end before the last
  // prompt token are looked up, so the result is < len(token_ids): the last token is always
  // computed and the model has logits for the next one. Throws NoFreeBlocksError if it does not fit
  // (nothing is changed then), BlockManagerError if seq_id exists or token_ids is empty.
  int64_t allocate(SeqId seq_id, const std::vector<int32_t>& token_ids,
                   const std::string& cache_salt = "");

  // ---- growth ----------------------------------------------------------------------------
  // True if every listed sequence can take one more token now (counts one block for each
  // sequence whose last block is full or shared).
  bool can_append_slots(const std::vector<SeqId>& seq_ids) const;

  // Give the sequence a slot for one more token (token_id). Allocates a block only when the
  // last block is full. If the last block is partly filled and shared (ref_count > 1), copies
  // on write: a new block replaces it in this table and (src, dst) is returned; the caller
  // copies src's KV to dst before writing. Throws NoFreeBlocksError if no block is free.
  std::optional<BlockPair> append_slot(SeqId seq_id, int32_t token_id);

  // Replace the token id of the sequence's last slot (a token appended with a placeholder id
  // before its value was known: async scheduling appends the slot of a token the GPU is still
  // sampling). Throws BlockManagerError if the last token's block already has a prefix-cache
  // hash (mark_blocks_computed covered it, or it was a cache hit): a hash must never be
  // computed over a placeholder, so the id may only change before its block is marked.
  void set_last_token_id(SeqId seq_id, int32_t token_id);

  // Speculative decoding: keep the first `start` token slots, give the next ones the ids
  // token_ids (at most the slots held after start) and drop every slot past them, releasing
  // the blocks only they used (a verify step's rejected drafts). Throws BlockManagerError if a
  // changed or dropped slot lies in a block that already has a prefix-cache hash (only
  // accepted ids may ever be hashed) or the sequence is swapped out.
  void replace_tail(SeqId seq_id, int64_t start, const std::vector<int32_t>& token_ids);

  // The child gets the parent's block table and tokens; every block's ref_count rises by one.
  void fork(SeqId parent_id, SeqId child_id);

  // Release every block of the sequence (on whatever device it is) and forget it.
  void free(SeqId seq_id);

  // Enter the full blocks among the first num_computed_tokens tokens into the prefix cache
  // (their KV is now written). Idempotent; no-op when prefix caching is off. Throws
  // BlockManagerError if num_computed_tokens is outside [0, num_tokens] or the sequence is
  // swapped out. A block equal to one already cached (same tokens, salt and parent) is not
  // registered again.
  void mark_blocks_computed(SeqId seq_id, int64_t num_computed_tokens);

  // ---- swap ------------------------------------------------------------------------------
  // A group (a request's sequences) moves together; a block shared inside the group moves
  // once and stays shared. Returned pairs are (gpu_block, cpu_block) for swap_out and
  // (cpu_block, gpu_block) for swap_in: copy src -> dst. A GPU block also referenced outside
  // the group stays on the GPU (it is copied, not moved).
  bool can_swap_out(const std::vector<SeqId>& seq_ids) const;
  std::vector<BlockPair> swap_out(const std::vector<SeqId>& seq_ids);
  AllocStatus can_swap_in(const std::vector<SeqId>& seq_ids) const;
  std::vector<BlockPair> swap_in(const std::vector<SeqId>& seq_ids);

  // ---- prefix cache ----------------------------------------------------------------------
  // Read-only lookup of the longest cached prefix of token_ids (every full block, including
  // one that ends at the last token: unlike allocate(), no block is held back).
  PrefixMatch lookup_prefix(const std::vector<int32_t>& token_ids,
                            const std::string& cache_salt = "") const;
  // Drop every cached-but-free block's hash (blocks in use keep theirs).
  void reset_prefix_cache();
  // Test hook: hashes are ANDed with mask (mask 0 makes every block collide).
  void set_hash_mask(uint64_t mask);

  // ---- accounting and introspection ------------------------------------------------------
  int block_size() const;
  int num_total_blocks(Device device) const;
  int num_free_blocks(Device device) const;
  int num_used_blocks(Device device) const;
  // Allocated GPU slots minus filled GPU slots, over distinct blocks in use.
  int64_t kv_waste() const;
  // GPU blocks with ref_count > 1, and the references they save (sum of ref_count - 1).
  int num_shared_blocks() const;
  int64_t num_blocks_saved_by_sharing() const;
  // Over every successful allocate(): query = tokens of the full blocks looked up
  // ((len - 1) / block_size * block_size), hit = the cached tokens it returned.
  int64_t prefix_cache_query_tokens() const;  // tokens looked up by allocate()
  int64_t prefix_cache_hit_tokens() const;    // tokens served from the cache by allocate()
  int num_cached_blocks() const;              // blocks currently in the prefix hash table

  bool has_seq(SeqId seq_id) const;
  Device seq_device(SeqId seq_id) const;
  int64_t num_tokens(SeqId seq_id) const;
  std::vector<BlockId> block_table(SeqId seq_id) const;
  int ref_count(BlockId block_id, Device device = Device::GPU) const;
  std::vector<BlockId> free_block_ids(Device device) const;  // free-list order, head first
  std::vector<SeqId> seq_ids() const;

 private:
  // Implementation detail: see block_manager_impl.h (block_pool.h, prefix_cache.h).
  struct Impl;
  std::unique_ptr<Impl> impl_;

 public:
  ~BlockManager();
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;
};

}  // namespace pagedd
