// The KV-cache block manager: every decision about which KV block holds which token, and in
// which tier it is kept once no sequence uses it.
//
// Host-only C++17: no CUDA, no Python headers. pydaemon._core binds it (cpp/bindings/).
//
// Vocabulary (the same names in Python):
//   block_id       index of a block inside one pool (GPU pool, CPU pool or disk pool).
//   ref_count      number of references to a block: block-table entries (over all
//                  sequences) plus the pins of the block moves in flight (see "Tiers").
//   block_table    per sequence, the list of block ids holding its tokens, in order.
//                  Append-only while the sequence lives on one device, except that
//                  release_blocks_before() replaces leading entries with kNoBlock (-1):
//                  blocks a sliding window will never read again.
//   slot           block_id * block_size + offset: the flat index of one token's K/V.
//   step           one scheduler output: take_block_moves() ends it (step_index() counts them).
//
// Invariants (checked by tests/test_block_manager_props.py and test_kv_tiers_props.py after
// every operation):
//   - ref_count[b] == block-table entries referring to b + pins of b (per pool).
//   - a block is on its pool's free list  <=>  ref_count == 0.
//   - num_free + num_used == num_total, per pool.
//   - a sequence needs a new block only when its last block is full, so KV waste is at most
//     one partly filled block per sequence.
//   - a block holds at most one prefix-cache entry; an entry has at most one copy per tier
//     (prefix_cache.h).
//
// Free list: an intrusive doubly-linked list over the pool's blocks, O(1) push/pop/remove.
// Allocation pops the head. Freed blocks that hold no cached content go to the head (reused
// first); freed blocks that hold cached prefix content go to the tail, so the list is also the
// LRU of cached-but-free blocks: the head-most cached block is evicted first. A freed sequence
// releases its blocks last-to-first, so the later blocks of a prefix are evicted before the
// earlier ones. The initial free list is 0..N-1.
//
// Prefix caching: each full block of a sequence has a hash chained over
// (parent block hash, the block's token ids, cache_salt). Only blocks whose KV has been
// computed (mark_blocks_computed) are entered in the cache. A hit is accepted only if the
// entry's stored token ids equal the looked-up ones, its stored salt equals the salt, and its
// parent is the entry hit just before it, so a hash collision can never serve another
// prompt's KV.
//
// Tiers (enable_cpu_tier, num_disk_blocks): the CPU pool is one host pool with one free list
// for both uses: swap space of preempted sequences (blocks with ref_count > 0 and no entry)
// and the CPU tier of the prefix cache (free blocks holding an entry, LRU like the GPU's).
//   - Save: a cached GPU block that is evicted (popped for new content) keeps its entry in a
//     CPU block (popped from the CPU free list, evicting that block's own entry) and the copy
//     (gpu, cpu) goes in blocks_to_save_to_cpu: the runner copies it before the step's K/V
//     writes. At the end of each step up to save_ahead_blocks cached blocks at the head of
//     the GPU free list (the next to be evicted) are saved early (blocks_to_save_ahead_to_cpu,
//     copied while the step runs), so that their eviction later costs no copy. A GPU block
//     whose entry already has a CPU copy is evicted without one.
//   - Load: a prefix hit on an entry without a GPU copy allocates a GPU block and copies
//     (cpu, gpu) in blocks_to_load_from_cpu while the step runs; the sequence may be scheduled
//     from the next step on (seq_ready_step). The GPU block and the CPU block then both hold
//     the entry (the CPU copy stays, so a later eviction costs no copy).
//   - Disk (behind the CPU tier): the disk tier is written through. Every block entered in
//     the GPU prefix cache is saved to the CPU tier at the end of the step (with the ahead
//     saves: a computed full block is never written again), and every block saved into the
//     CPU tier is written to a disk block (blocks_to_write_to_disk, with its record) if its
//     entry has no disk copy, so the disk holds whole chains from their first block, the
//     hottest ones included (a restart finds them). A hit on an entry held only on disk reads
//     it into a CPU block (blocks_to_read_from_disk) in one step and loads it to the GPU in
//     the next (the sequence runs the step after). restore_disk_blocks() enters the blocks a
//     previous run left on disk (warm restart).
//   - Pins: every CPU and disk block that a step's copies read or write is pinned (one
//     reference) until the next step's moves are taken, so no later step's copy overwrites it
//     out of order; the runner orders each step's copies after the previous step's.
//   - A step's loads are checked when the moves are taken: one whose GPU block was handed to
//     other content meanwhile (its sequence was freed and the block reused) is dropped.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pagedd {

enum class Device : uint8_t { GPU = 0, CPU = 1, DISK = 2 };

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
constexpr BlockId kNoBlock = -1;  // a released leading entry of a block table

// Disk records carry the salt: a longer one is not written to disk (it stays in the other
// tiers).
constexpr size_t kMaxDiskSaltBytes = 2048;

// One block of the disk tier as its file slot describes it: what a write must store beside
// the bytes, and what a warm restart reads back (restore_disk_blocks).
struct DiskBlockRecord {
  BlockId disk_block = -1;
  uint64_t uid = 0;         // the entry's uid (never 0)
  uint64_t parent_uid = 0;  // 0: the first block of a prompt
  uint64_t hash = 0;        // chained hash (hash_block over the parent's hash)
  std::string salt;
  std::vector<int32_t> token_ids;  // block_size ids
};

// The block copies of one step (take_block_moves), each a (src, dst) pair.
struct BlockMoves {
  std::vector<BlockPair> blocks_to_save_to_cpu;        // (gpu, cpu): before the step's writes
  std::vector<BlockPair> blocks_to_save_ahead_to_cpu;  // (gpu, cpu): while the step runs
  std::vector<BlockPair> blocks_to_load_from_cpu;      // (cpu, gpu): while the step runs
  std::vector<BlockPair> blocks_to_write_to_disk;      // (cpu, disk), after the saves
  std::vector<DiskBlockRecord> disk_write_records;     // one per blocks_to_write_to_disk
  std::vector<BlockPair> blocks_to_read_from_disk;     // (disk, cpu)
  std::vector<DiskBlockRecord> disk_read_records;      // one per blocks_to_read_from_disk:
                                                       // the block the slot must hold
};

// Counters of the tiers since construction.
struct TierStats {
  int64_t gpu_hit_tokens = 0;      // prefix-cache hits served by GPU blocks (allocate)
  int64_t cpu_hit_tokens = 0;      // ... loaded from the CPU tier
  int64_t disk_hit_tokens = 0;     // ... read from disk, then loaded
  int64_t num_saved_blocks = 0;    // GPU -> CPU copies (evictions and ahead)
  int64_t num_loaded_blocks = 0;   // CPU -> GPU copies
  int64_t num_written_blocks = 0;  // CPU -> disk copies
  int64_t num_read_blocks = 0;     // disk -> CPU copies
  int64_t num_dropped_loads = 0;   // loads dropped because their GPU block was reused
  // Disk reads whose slot did not hold the block and writes that did not land, as the
  // runner reported them; whether a write error stopped the writes (stop_disk_writes).
  int64_t num_failed_disk_reads = 0;
  int64_t num_failed_disk_writes = 0;
  bool are_disk_writes_stopped = false;
};

struct PrefixMatch {
  std::vector<BlockId> block_ids;  // GPU blocks holding the cached prefix, in order
  int64_t num_cached_tokens = 0;   // block_ids.size() * block_size
};

class BlockManager {
 public:
  // watermark: fraction of GPU blocks kept free at admission (can_allocate / can_swap_in),
  // so that running sequences can still grow. enable_cpu_tier: evicted GPU prefix blocks are
  // kept in the CPU pool (needs prefix caching and num_cpu_blocks >= 1). num_disk_blocks: the
  // disk tier behind it (needs the CPU tier). save_ahead_blocks: how many cached blocks at the
  // head of the GPU free list each step saves early (0: saves happen at eviction only).
  BlockManager(int block_size, int num_gpu_blocks, int num_cpu_blocks, double watermark = 0.01,
               bool enable_prefix_caching = true, bool enable_cpu_tier = false,
               int num_disk_blocks = 0, int save_ahead_blocks = 0);

  // ---- admission -------------------------------------------------------------------------
  // Can a new sequence with these prompt tokens get its blocks? Counts cached prefix blocks
  // that are in use (ref_count > 0) as free of charge. NEVER if ceil(len / block_size) >
  // num_gpu_blocks - watermark_blocks (watermark_blocks = int(watermark * num_gpu_blocks)); OK
  // if the blocks still needed fit in num_free - watermark_blocks; else LATER. Throws
  // BlockManagerError if token_ids is empty.
  AllocStatus can_allocate(const std::vector<int32_t>& token_ids,
                           const std::string& cache_salt = "") const;

  // Create seq_id with blocks for every token of token_ids, reusing cached prefix blocks.
  // Returns the number of leading tokens whose KV is already in the cache, in any tier (a
  // multiple of block_size, counted as prefix-cache hits). Only the full blocks that end before
  // the last prompt token are looked up, so the result is < len(token_ids): the last token is
  // always computed and the model has logits for the next one. Hits in the CPU or disk tier
  // are loaded: the sequence's KV is readable from seq_ready_step(seq_id) on. A disk hit
  // needs a CPU block to stage it; the hits stop at the first disk hit that finds none free.
  // Throws NoFreeBlocksError if it does not fit (nothing is changed then), BlockManagerError
  // if seq_id exists or token_ids is empty.
  int64_t allocate(SeqId seq_id, const std::vector<int32_t>& token_ids,
                   const std::string& cache_salt = "");

  // Per-layer-group KV (models that mix windowed and full-attention layers): one sequence of
  // the model is one table per layer group, seq_ids[g] with salts[g] (distinct salts, so that
  // no group is served another's blocks). can_allocate_group / allocate_group do for the
  // tables together what can_allocate / allocate do for one: the prefix hit is the same for
  // every table (the shortest of the groups' hits), every table's hits are held before any
  // block is popped (no table's allocation evicts another's hit), and nothing is changed when
  // they do not all fit. Returns the cached tokens, as allocate. Throws BlockManagerError with
  // the CPU tier on (its loads are per table; not supported for groups), empty token_ids,
  // sizes that differ, or an existing seq_id.
  AllocStatus can_allocate_group(const std::vector<int32_t>& token_ids,
                                 const std::vector<std::string>& salts) const;
  int64_t allocate_group(const std::vector<SeqId>& seq_ids, const std::vector<int32_t>& token_ids,
                         const std::vector<std::string>& salts);

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

  // Sliding windows: release every block that lies wholly before token num_tokens (the
  // blocks [0, num_tokens / block_size)): its table entry becomes kNoBlock and its reference
  // goes (a cached block stays in the prefix cache, free and evictable). Returns how many it
  // released now (idempotent). The caller keeps num_tokens at or below the first key any
  // later query of the sequence reads. Throws BlockManagerError if the sequence is swapped
  // out or num_tokens is outside [0, num_tokens(seq_id)].
  int release_blocks_before(SeqId seq_id, int64_t num_tokens);
  // Blocks released so far by release_blocks_before (the leading kNoBlock entries).
  int64_t num_released_blocks(SeqId seq_id) const;

  // The child gets the parent's block table and tokens; every block's ref_count rises by one.
  void fork(SeqId parent_id, SeqId child_id);

  // Release every block of the sequence (on whatever device it is) and forget it.
  void free(SeqId seq_id);

  // The first step whose output may read the sequence's KV: after step_index() while blocks
  // of its prefix are loading, else at most step_index().
  int64_t seq_ready_step(SeqId seq_id) const;

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

  // ---- tiers -----------------------------------------------------------------------------
  // Ends the step: plans the ahead saves and the disk writes, drops loads whose GPU block was
  // reused, releases the pins of the step before, and returns this step's copies. Call once
  // per scheduler output, after everything that step allocates.
  BlockMoves take_block_moves();
  // The index of the step being scheduled (the number of take_block_moves calls so far).
  int64_t step_index() const;
  // The step whose moves these are never ran (its runner failed): every copy they were to
  // make is forgotten (the destination block drops its entry), so that no content that was
  // never copied is served. Deferred loads out of blocks it read are dropped at the next take.
  void discard_block_moves(const BlockMoves& moves);
  // Warm restart, before anything else is allocated: enter the disk blocks a previous run
  // wrote (same model and settings), in any order (by uid: the oldest first at the LRU end,
  // evicted first). A record is skipped when its block id is
  // out of range or taken, its uid is 0 or taken, its token ids are not block_size long, its
  // salt is too long, its hash is not the chained hash of its parent's, or its parent is not
  // among the entered records (a chain must be whole from its first block). Returns the
  // number entered. Throws BlockManagerError if the disk tier is off or blocks are in use.
  int restore_disk_blocks(const std::vector<DiskBlockRecord>& records);
  // A disk read (disk_block, uid) did not deliver its block (the slot changed underneath, a
  // short read, a write that never landed): the entry of that uid is dropped from every tier
  // (its CPU staging copy and its GPU copy hold what the read delivered), so that no lookup
  // finds it again and the step's pending load of it is dropped. Returns the sequences on
  // the GPU whose block table holds the dropped GPU copy: their KV from that block on must be
  // computed again before any step reads it (the scheduler preempts them by recompute). The
  // runner reports a step's failed reads before that step's readers run (seq_ready_step).
  // A pair whose disk block no longer holds that uid is skipped.
  std::vector<SeqId> forget_failed_disk_reads(
      const std::vector<std::pair<BlockId, uint64_t>>& reads);
  // Disk writes (disk_block, uid) that did not land: the disk copy is dropped (the entry's
  // other copies are whole). A pair whose disk block no longer holds that uid is skipped.
  void forget_failed_disk_writes(const std::vector<std::pair<BlockId, uint64_t>>& writes);
  // No more disk writes are planned (the disk is full or failing); reads of the blocks
  // already there go on.
  void stop_disk_writes();
  TierStats tier_stats() const;

  // ---- prefix cache ----------------------------------------------------------------------
  // Read-only lookup of the longest prefix of token_ids cached on the GPU (every full block,
  // including one that ends at the last token: unlike allocate(), no block is held back).
  PrefixMatch lookup_prefix(const std::vector<int32_t>& token_ids,
                            const std::string& cache_salt = "") const;
  // Drop the entries of every cached-but-free block, in every tier (blocks in use and pinned
  // blocks keep theirs). Files of the disk tier are not touched: a restart finds them again.
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
  int num_cached_blocks(Device device = Device::GPU) const;  // blocks holding an entry
  int num_pinned_blocks(Device device) const;  // blocks pinned by the moves of the last steps

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
