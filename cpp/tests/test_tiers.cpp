// C++ tests of the block manager's tiers (block_manager.h, "Tiers"): saves of evicted blocks,
// ahead saves, loads and when they are readable, the disk tier's writes, reads and restore,
// pins, dropped loads, exact block ids and free lists. Built with -DPAGEDD_BUILD_TESTS=ON;
// scripts/test_cpp_sanitized.sh runs it under ASan+UBSan.
#include <algorithm>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

#include "block_manager.h"
#include "check.h"

using namespace pagedd;
using Ids = std::vector<BlockId>;
using Pairs = std::vector<BlockPair>;

static std::vector<int32_t> tokens(int n, int start = 0) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = start + i;
  return t;
}

// Two computed blocks (tokens 0..7) cached on the GPU, the sequence freed: GPU free list
// [2, 3, 1, 0] (the uncached block first, the cached ones at the LRU end).
static void cache_two_blocks(BlockManager& bm) {
  bm.allocate(1, tokens(9));
  bm.mark_blocks_computed(1, 9);
  bm.free(1);
  CHECK(bm.free_block_ids(Device::GPU) == (Ids{2, 3, 1, 0}));
  bm.take_block_moves();
}

static void test_save_load_and_pins() {
  BlockManager bm(4, 4, 4, 0.0, true, true, 0, 0);
  cache_two_blocks(bm);
  // A new prompt takes every GPU block: the cached ones are evicted into CPU blocks 0 and 1.
  CHECK(bm.allocate(2, tokens(16, 100)) == 0);
  CHECK(bm.block_table(2) == (Ids{2, 3, 1, 0}));
  CHECK(bm.num_cached_blocks(Device::GPU) == 0 && bm.num_cached_blocks(Device::CPU) == 2);
  CHECK(bm.num_pinned_blocks(Device::CPU) == 2 && bm.ref_count(0, Device::CPU) == 1);
  BlockMoves m = bm.take_block_moves();
  CHECK(m.blocks_to_save_to_cpu == (Pairs{{1, 0}, {0, 1}}));
  CHECK(m.blocks_to_load_from_cpu.empty() && m.blocks_to_save_ahead_to_cpu.empty());
  CHECK(bm.ref_count(0, Device::CPU) == 1);  // pinned until the next step's moves are taken
  bm.free(2);
  bm.take_block_moves();
  CHECK(bm.num_pinned_blocks(Device::CPU) == 0);
  CHECK(bm.free_block_ids(Device::CPU) == (Ids{2, 3, 0, 1}));  // the tier at the LRU end
  // The prompt comes back: both blocks are loaded from the CPU tier into fresh GPU blocks.
  const int64_t step = bm.step_index();
  CHECK(bm.allocate(3, tokens(9)) == 8);
  CHECK(bm.block_table(3) == (Ids{2, 3, 1}));
  CHECK(bm.seq_ready_step(3) == step + 1);  // readable once the loads of this step ran
  m = bm.take_block_moves();
  CHECK(m.blocks_to_load_from_cpu == (Pairs{{1, 2}, {0, 3}}));
  CHECK(bm.num_cached_blocks(Device::GPU) == 2 && bm.num_cached_blocks(Device::CPU) == 2);
  TierStats s = bm.tier_stats();
  CHECK(s.cpu_hit_tokens == 8 && s.gpu_hit_tokens == 0 && s.num_saved_blocks == 2);
  CHECK(s.num_loaded_blocks == 2 && bm.prefix_cache_hit_tokens() == 8);
  // Both copies stay: evicting the restored blocks again costs no save.
  bm.free(3);
  CHECK(bm.free_block_ids(Device::GPU) == (Ids{1, 0, 3, 2}));
  bm.allocate(4, tokens(16, 200));
  m = bm.take_block_moves();
  CHECK(m.blocks_to_save_to_cpu.empty() && bm.num_cached_blocks(Device::CPU) == 2);
  bm.free(4);
  bm.take_block_moves();
  CHECK(bm.num_free_blocks(Device::GPU) == 4 && bm.num_free_blocks(Device::CPU) == 4);
}

static void test_saves_ahead() {
  BlockManager bm(4, 4, 4, 0.0, true, true, 0, 4);
  bm.allocate(1, tokens(9));
  bm.mark_blocks_computed(1, 9);
  bm.free(1);
  // The step's end saves the cached blocks at the head of the GPU free list early.
  BlockMoves m = bm.take_block_moves();
  CHECK(m.blocks_to_save_ahead_to_cpu == (Pairs{{1, 0}, {0, 1}}));
  CHECK(m.blocks_to_save_to_cpu.empty());
  CHECK(bm.num_cached_blocks(Device::GPU) == 2 && bm.num_cached_blocks(Device::CPU) == 2);
  // Their eviction then needs no copy, and the next step saves nothing more.
  bm.allocate(2, tokens(16, 100));
  m = bm.take_block_moves();
  CHECK(m.blocks_to_save_to_cpu.empty() && m.blocks_to_save_ahead_to_cpu.empty());
  CHECK(bm.num_cached_blocks(Device::CPU) == 2);
  bm.free(2);
}

static void test_disk_write_read_and_restore() {
  BlockManager bm(4, 4, 2, 0.0, true, true, 4, 0);
  bm.allocate(1, tokens(9));
  bm.mark_blocks_computed(1, 9);
  bm.free(1);
  // Written through: the computed blocks go to the CPU tier while the step runs, then to disk.
  BlockMoves m = bm.take_block_moves();
  CHECK(m.blocks_to_save_ahead_to_cpu == (Pairs{{0, 0}, {1, 1}}));
  CHECK(m.blocks_to_save_to_cpu.empty());
  CHECK(m.blocks_to_write_to_disk == (Pairs{{0, 0}, {1, 1}}));
  CHECK(m.disk_write_records.size() == 2);
  const DiskBlockRecord root = m.disk_write_records[0], child = m.disk_write_records[1];
  CHECK(root.uid == 1 && root.parent_uid == 0 && child.uid == 2 && child.parent_uid == 1);
  CHECK(child.token_ids == tokens(4, 4) && child.disk_block == 1 && root.disk_block == 0);
  // Evicted from the GPU later: no copy, the CPU tier holds them already.
  bm.allocate(2, tokens(16, 100));
  CHECK(bm.take_block_moves().blocks_to_save_to_cpu.empty());
  bm.free(2);
  // Two other blocks push the first two out of the 2-block CPU tier: they stay on disk.
  bm.allocate(3, tokens(9, 50));
  bm.mark_blocks_computed(3, 9);
  bm.free(3);
  m = bm.take_block_moves();
  CHECK(m.blocks_to_save_ahead_to_cpu.size() == 2 && m.blocks_to_write_to_disk.size() == 2);
  CHECK(bm.num_cached_blocks(Device::DISK) == 4 && bm.num_cached_blocks(Device::CPU) == 2);
  bm.take_block_moves();  // the pins of those copies go
  // The first prompt again: read from disk into CPU blocks in this step, loaded in the next,
  // readable in the one after.
  const int64_t step = bm.step_index();
  CHECK(bm.allocate(5, tokens(9)) == 8);
  CHECK(bm.seq_ready_step(5) == step + 2);
  const Ids table = bm.block_table(5);
  m = bm.take_block_moves();
  CHECK(m.blocks_to_read_from_disk.size() == 2 && m.blocks_to_load_from_cpu.empty());
  CHECK(m.blocks_to_read_from_disk[0].first == 0 && m.blocks_to_read_from_disk[1].first == 1);
  const BlockId c0 = m.blocks_to_read_from_disk[0].second;
  const BlockId c1 = m.blocks_to_read_from_disk[1].second;
  m = bm.take_block_moves();
  CHECK(m.blocks_to_load_from_cpu == (Pairs{{c0, table[0]}, {c1, table[1]}}));
  CHECK(bm.tier_stats().disk_hit_tokens == 8 && bm.tier_stats().num_read_blocks == 2);
  bm.free(5);
  bm.take_block_moves();
  bm.take_block_moves();
  CHECK(bm.num_free_blocks(Device::DISK) == 4 && bm.num_pinned_blocks(Device::DISK) == 0);

  // A restart: the records of a previous run, back in the disk tier.
  BlockManager fresh(4, 4, 2, 0.0, true, true, 4, 0);
  DiskBlockRecord orphan = child;  // its parent is not on disk: unreachable, skipped
  orphan.disk_block = 2;
  orphan.uid = 9;
  orphan.parent_uid = 7;
  DiskBlockRecord bad_hash = root;  // its hash does not chain: skipped
  bad_hash.disk_block = 3;
  bad_hash.uid = 8;
  bad_hash.hash ^= 1;
  CHECK(fresh.restore_disk_blocks({child, root, orphan, bad_hash}) == 2);
  CHECK(fresh.num_cached_blocks(Device::DISK) == 2);
  CHECK(fresh.allocate(1, tokens(9)) == 8);
  CHECK(fresh.take_block_moves().blocks_to_read_from_disk == (Pairs{{0, 0}, {1, 1}}));
  CHECK_THROWS(fresh.restore_disk_blocks({}), BlockManagerError);  // not fresh any more
  BlockManager no_disk(4, 4, 2, 0.0, true, true, 0, 0);
  CHECK_THROWS(no_disk.restore_disk_blocks({root}), BlockManagerError);
}

// A disk read that did not deliver its block (reported after the step that read it, and
// after the next step's moves were taken, as under async scheduling): the entry leaves every
// tier, the readers are returned, their blocks go to the head of the free lists. A failed
// write drops its disk copy; stop_disk_writes plans no more writes.
static void test_failed_disk_reads_and_writes() {
  BlockManager bm(4, 4, 2, 0.0, true, true, 4, 0);
  bm.allocate(1, tokens(9));
  bm.mark_blocks_computed(1, 9);
  bm.free(1);
  bm.take_block_moves();            // written through to CPU 0, 1 and disk 0, 1
  bm.allocate(2, tokens(16, 100));  // the GPU copies go
  bm.take_block_moves();
  bm.free(2);
  bm.allocate(3, tokens(9, 50));  // two other blocks push them out of the CPU tier
  bm.mark_blocks_computed(3, 9);
  bm.free(3);
  bm.take_block_moves();
  bm.take_block_moves();
  CHECK(bm.num_cached_blocks(Device::DISK) == 4);
  // Two readers of the first prompt: the disk reads, then the shared GPU blocks.
  CHECK(bm.allocate(5, tokens(9)) == 8);
  BlockMoves m = bm.take_block_moves();
  CHECK(m.blocks_to_read_from_disk.size() == 2 && m.disk_read_records.size() == 2);
  const DiskBlockRecord first = m.disk_read_records[0], second = m.disk_read_records[1];
  CHECK(first.disk_block == m.blocks_to_read_from_disk[0].first && first.parent_uid == 0);
  CHECK(second.parent_uid == first.uid && second.token_ids == tokens(4, 4));
  CHECK(bm.allocate(6, tokens(9)) == 8);  // a GPU hit on the blocks still loading
  const Ids table = bm.block_table(5);
  CHECK(bm.block_table(6)[1] == table[1]);
  m = bm.take_block_moves();  // the next step: the loads are planned ...
  CHECK(m.blocks_to_load_from_cpu.size() == 2);
  // ... and only then the report comes: the second block's read failed.
  const std::vector<SeqId> readers = bm.forget_failed_disk_reads({{second.disk_block, second.uid}});
  CHECK(readers == (std::vector<SeqId>{5, 6}));
  CHECK(bm.tier_stats().num_failed_disk_reads == 1);
  CHECK(bm.num_cached_blocks(Device::DISK) == 3 && bm.num_cached_blocks(Device::CPU) == 1);
  CHECK(bm.free_block_ids(Device::DISK).front() == second.disk_block);  // reused first
  // The scheduler preempts both; their prefix again finds the first block only.
  bm.free(5);
  bm.free(6);
  CHECK(bm.free_block_ids(Device::GPU).front() == table[1]);  // no content: reused first
  CHECK(bm.allocate(7, tokens(9)) == 4);
  bm.free(7);
  // A stale report (the slot holds another block now) changes nothing.
  bm.forget_failed_disk_reads({{second.disk_block, second.uid}, {first.disk_block, 999}});
  CHECK(bm.num_cached_blocks(Device::DISK) == 3);
  // A failed write: the disk copy goes; then no more writes.
  bm.take_block_moves();
  bm.take_block_moves();
  bm.allocate(8, tokens(5, 300));
  bm.mark_blocks_computed(8, 5);
  bm.free(8);
  m = bm.take_block_moves();
  CHECK(m.blocks_to_write_to_disk.size() == 1);
  const DiskBlockRecord written = m.disk_write_records[0];
  bm.forget_failed_disk_writes({{written.disk_block, written.uid}});
  bm.stop_disk_writes();
  CHECK(bm.tier_stats().num_failed_disk_writes == 1 && bm.tier_stats().are_disk_writes_stopped);
  CHECK(bm.num_cached_blocks(Device::DISK) == 3);
  bm.allocate(9, tokens(5, 400));
  bm.mark_blocks_computed(9, 5);
  bm.free(9);
  m = bm.take_block_moves();
  CHECK(m.blocks_to_save_ahead_to_cpu.size() == 1 && m.blocks_to_write_to_disk.empty());
}

// A chain whose first block is on disk only and whose second is in the CPU tier: the disk
// hit's staging CPU block is never the CPU hit's own block (every hit is held first).
static void test_disk_hit_before_cpu_hit() {
  BlockManager bm(4, 4, 2, 0.0, true, true, 8, 0);
  bm.allocate(1, tokens(9));
  bm.mark_blocks_computed(1, 9);
  bm.free(1);
  bm.take_block_moves();  // both blocks written through to CPU 0, 1 and disk 0, 1
  bm.take_block_moves();
  CHECK(bm.free_block_ids(Device::CPU) == (Ids{0, 1}));  // block 0's copy evicted first
  bm.allocate(2, tokens(16, 100));  // their GPU copies go (no save: the CPU holds them)
  bm.free(2);
  bm.take_block_moves();
  bm.allocate(3, tokens(5, 200));
  bm.mark_blocks_computed(3, 5);  // one more block, written through into CPU 0
  bm.free(3);
  bm.take_block_moves();
  bm.take_block_moves();
  CHECK(bm.free_block_ids(Device::CPU) == (Ids{1, 0}));  // CPU 1: the chain's block 1
  const int64_t step = bm.step_index();
  CHECK(bm.allocate(4, tokens(9)) == 8);
  CHECK(bm.seq_ready_step(4) == step + 2);
  const Ids table = bm.block_table(4);
  BlockMoves m = bm.take_block_moves();
  CHECK(m.blocks_to_read_from_disk == (Pairs{{0, 0}}));  // staged in CPU 0, not CPU 1
  CHECK(m.blocks_to_load_from_cpu == (Pairs{{1, table[1]}}));
  m = bm.take_block_moves();
  CHECK(m.blocks_to_load_from_cpu == (Pairs{{0, table[0]}}));
  bm.free(4);
  bm.take_block_moves();
  bm.take_block_moves();
  CHECK(bm.num_free_blocks(Device::CPU) == 2 && bm.num_free_blocks(Device::GPU) == 4);
}

// A sequence freed before its load ran, its GPU block reused in the same step: the load is
// dropped (it would overwrite the new content).
static void test_dropped_load() {
  BlockManager bm(4, 4, 4, 0.0, true, true, 0, 0);
  cache_two_blocks(bm);
  bm.allocate(2, tokens(16, 100));
  bm.take_block_moves();
  bm.free(2);
  bm.take_block_moves();
  CHECK(bm.allocate(3, tokens(9)) == 8);
  bm.free(3);                       // aborted in the step that loads it
  bm.allocate(4, tokens(16, 200));  // takes every GPU block, the loading ones included
  BlockMoves m = bm.take_block_moves();
  CHECK(m.blocks_to_load_from_cpu.empty());
  CHECK(bm.tier_stats().num_dropped_loads == 2 && bm.tier_stats().num_loaded_blocks == 0);
  bm.free(4);
  bm.take_block_moves();
  bm.take_block_moves();
  CHECK(bm.num_free_blocks(Device::GPU) == 4 && bm.num_free_blocks(Device::CPU) == 4);
}

// Swap space and the CPU tier are one pool: a swap-out takes the tier's blocks, LRU first.
static void test_swap_shares_the_pool() {
  BlockManager bm(4, 4, 2, 0.0, true, true, 0, 0);
  cache_two_blocks(bm);
  bm.allocate(2, tokens(16, 100));
  bm.take_block_moves();
  bm.take_block_moves();
  CHECK(bm.num_cached_blocks(Device::CPU) == 2 && bm.num_free_blocks(Device::CPU) == 2);
  CHECK(bm.can_swap_out({2}) == false);  // 4 blocks, 2 in the pool
  bm.replace_tail(2, 8, {});             // two blocks left
  CHECK(bm.can_swap_out({2}));
  CHECK(bm.swap_out({2}) == (Pairs{{2, 0}, {3, 1}}));
  CHECK(bm.num_cached_blocks(Device::CPU) == 0);  // the tier gave way to swap
  CHECK(bm.swap_in({2}).size() == 2);
  CHECK(bm.num_pinned_blocks(Device::CPU) == 2);  // the swap-in's sources, until next step
  bm.free(2);
  bm.take_block_moves();
  bm.take_block_moves();
  CHECK(bm.num_free_blocks(Device::CPU) == 2 && bm.num_free_blocks(Device::GPU) == 4);
}

static void test_bad_tier_args() {
  CHECK_THROWS(BlockManager(4, 8, 4, 0.0, false, true), std::invalid_argument);
  CHECK_THROWS(BlockManager(4, 8, 0, 0.0, true, true), std::invalid_argument);
  CHECK_THROWS(BlockManager(4, 8, 4, 0.0, true, false, 4), std::invalid_argument);
  CHECK_THROWS(BlockManager(4, 8, 4, 0.0, true, true, -1), std::invalid_argument);
  CHECK_THROWS(BlockManager(4, 8, 4, 0.0, true, true, 0, -1), std::invalid_argument);
}

// Random operations and steps over tiny pools of every tier, under the sanitizers: every
// block's ref_count is its table references plus its pins, the free lists hold exactly the
// unreferenced blocks, and at the end every block of every tier is free.
static void test_random_steps() {
  std::mt19937 rng(42);
  BlockManager bm(4, 12, 6, 0.0, true, true, 8, 2);
  std::vector<SeqId> live;
  std::vector<std::vector<int32_t>> prompts;
  SeqId next_id = 0;
  const Device devices[] = {Device::GPU, Device::CPU, Device::DISK};
  for (int op_index = 0; op_index < 20000; ++op_index) {
    const int op = rng() % 8;
    try {
      if (op == 0 || live.empty()) {
        std::vector<int32_t> t;
        if (!prompts.empty() && rng() % 2) {
          t = prompts[rng() % prompts.size()];
        } else {
          t = tokens(1 + rng() % 16, (rng() % 3) * 4);
          prompts.push_back(t);
        }
        bm.allocate(next_id, t);
        live.push_back(next_id++);
      } else if (op == 7) {
        bm.take_block_moves();
      } else {
        const SeqId id = live[rng() % live.size()];
        const bool on_gpu = bm.seq_device(id) == Device::GPU;
        if (op == 1 && on_gpu) bm.append_slot(id, rng() % 5);
        if (op == 2 && on_gpu) {
          bm.fork(id, next_id);
          live.push_back(next_id++);
        }
        if (op == 3 || op == 6) {
          bm.free(id);
          live.erase(std::find(live.begin(), live.end(), id));
        }
        if (op == 4 && on_gpu) bm.mark_blocks_computed(id, bm.num_tokens(id));
        if (op == 5) {
          if (on_gpu && bm.can_swap_out({id}))
            bm.swap_out({id});
          else if (!on_gpu && bm.can_swap_in({id}) == AllocStatus::OK)
            bm.swap_in({id});
        }
      }
    } catch (const NoFreeBlocksError&) {
    }
    for (Device d : devices) {
      std::vector<int> refs(bm.num_total_blocks(d), 0);
      for (SeqId id : bm.seq_ids())
        if (bm.seq_device(id) == d)
          for (BlockId b : bm.block_table(id)) ++refs[b];
      int pins = 0;
      for (BlockId b = 0; b < bm.num_total_blocks(d); ++b) {
        CHECK(bm.ref_count(b, d) >= refs[b]);
        pins += bm.ref_count(b, d) - refs[b];
      }
      CHECK(pins == bm.num_pinned_blocks(d));
      for (BlockId b : bm.free_block_ids(d)) CHECK(bm.ref_count(b, d) == 0);
      CHECK(bm.num_free_blocks(d) + bm.num_used_blocks(d) == bm.num_total_blocks(d));
      CHECK(bm.num_cached_blocks(d) <= bm.num_total_blocks(d));
    }
    if (g_failures) return;
  }
  for (SeqId id : live) bm.free(id);
  bm.take_block_moves();
  bm.take_block_moves();
  for (Device d : devices) CHECK(bm.num_free_blocks(d) == bm.num_total_blocks(d));
  const TierStats s = bm.tier_stats();
  CHECK(s.cpu_hit_tokens > 0 && s.disk_hit_tokens > 0 && s.num_loaded_blocks > 0);
}

int main() {
  test_save_load_and_pins();
  test_saves_ahead();
  test_disk_write_read_and_restore();
  test_failed_disk_reads_and_writes();
  test_disk_hit_before_cpu_hit();
  test_dropped_load();
  test_swap_shares_the_pool();
  test_bad_tier_args();
  test_random_steps();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("test_tiers: all checks passed\n");
  return 0;
}
