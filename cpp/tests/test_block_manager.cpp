// C++ tests of pagedd::BlockManager, no framework: CHECK prints the failure and counts it.
// Built with -DPAGEDD_BUILD_TESTS=ON; scripts/test_cpp_sanitized.sh runs it under ASan+UBSan.
#include <algorithm>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

#include "block_manager.h"
#include "check.h"

using namespace pagedd;

using Ids = std::vector<BlockId>;

static std::vector<int32_t> tokens(int n, int start = 0) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = start + i;
  return t;
}

static void test_allocate_grow_free() {
  BlockManager bm(4, 8, 4, 0.0);
  CHECK(bm.allocate(1, tokens(6)) == 0);
  CHECK(bm.block_table(1) == (Ids{0, 1}));
  CHECK(bm.free_block_ids(Device::GPU) == (Ids{2, 3, 4, 5, 6, 7}));
  CHECK(!bm.append_slot(1, 6).has_value());
  CHECK(!bm.append_slot(1, 7).has_value());
  CHECK(bm.block_table(1) == (Ids{0, 1}));
  CHECK(!bm.append_slot(1, 8).has_value());  // block 1 full: new block 2
  CHECK(bm.block_table(1) == (Ids{0, 1, 2}));
  CHECK(bm.kv_waste() == 3);
  bm.free(1);  // nothing computed: no cached content, pushed to the head last block first
  CHECK(bm.free_block_ids(Device::GPU) == (Ids{0, 1, 2, 3, 4, 5, 6, 7}));
  CHECK_THROWS(bm.free(1), BlockManagerError);
  CHECK_THROWS(bm.block_table(1), BlockManagerError);
}

static void test_fork_cow_swap() {
  BlockManager bm(4, 8, 8, 0.0);
  bm.allocate(1, tokens(6));
  bm.fork(1, 2);
  CHECK(bm.ref_count(0) == 2 && bm.ref_count(1) == 2);
  CHECK(bm.num_shared_blocks() == 2);
  auto cow = bm.append_slot(2, 99);
  CHECK(cow.has_value() && cow->first == 1 && cow->second == 2);
  CHECK(bm.block_table(2) == (Ids{0, 2}));
  CHECK(bm.ref_count(1) == 1);
  CHECK(bm.can_swap_out({1, 2}));
  auto out = bm.swap_out({1, 2});
  CHECK(out == (std::vector<BlockPair>{{0, 0}, {1, 1}, {2, 2}}));
  CHECK(bm.ref_count(0, Device::CPU) == 2);
  CHECK(bm.num_free_blocks(Device::GPU) == 8);
  CHECK(bm.seq_device(1) == Device::CPU);
  CHECK_THROWS(bm.append_slot(1, 1), BlockManagerError);
  CHECK(bm.can_swap_in({1, 2}) == AllocStatus::OK);
  auto in = bm.swap_in({1, 2});
  CHECK(in.size() == 3);
  CHECK(bm.block_table(1)[0] == bm.block_table(2)[0]);
  CHECK(bm.ref_count(bm.block_table(1)[0]) == 2);
  CHECK(bm.num_free_blocks(Device::CPU) == 8);
  bm.free(1);
  bm.free(2);
  CHECK(bm.num_free_blocks(Device::GPU) == 8);
}

static void test_prefix_cache_and_collision() {
  BlockManager bm(4, 8, 0, 0.0);
  bm.allocate(1, tokens(9));
  bm.mark_blocks_computed(1, 9);
  CHECK(bm.num_cached_blocks() == 2);
  CHECK(bm.allocate(2, tokens(9)) == 8);
  CHECK(bm.block_table(2) == (Ids{0, 1, 3}));
  CHECK(bm.allocate(3, tokens(9), "salt") == 0);
  bm.free(2);
  bm.free(3);
  bm.free(1);
  CHECK(bm.num_free_blocks(Device::GPU) == 8);
  // Collision: every hash equal; the token comparison still tells blocks apart.
  bm.set_hash_mask(0);
  CHECK(bm.lookup_prefix(tokens(8)).num_cached_tokens == 8);
  CHECK(bm.lookup_prefix(tokens(8, 100)).num_cached_tokens == 0);
  CHECK_THROWS(bm.allocate(4, tokens(100)), NoFreeBlocksError);
  CHECK(bm.num_free_blocks(Device::GPU) == 8);
}

// Async scheduling appends the slot of a token still being sampled with a placeholder id and
// sets the real id before the block is marked: the cache then holds the real content only.
static void test_set_last_token_id() {
  BlockManager bm(4, 8, 0, 0.0);
  bm.allocate(1, tokens(7));
  bm.mark_blocks_computed(1, 7);  // block 0 is cached; block 1 holds tokens 4..6
  bm.append_slot(1, -1);          // placeholder for position 7: block 1 is now full
  bm.set_last_token_id(1, 7);
  bm.mark_blocks_computed(1, 8);
  CHECK(bm.num_cached_blocks() == 2);
  CHECK(bm.lookup_prefix(tokens(8)).num_cached_tokens == 8);  // hashed over the real id
  bm.append_slot(1, -1);
  bm.set_last_token_id(1, 8);  // a fresh block: fine
  // The last token of a hashed block can no longer change.
  BlockManager hashed(4, 8, 0, 0.0);
  hashed.allocate(2, tokens(8));
  hashed.mark_blocks_computed(2, 8);
  CHECK_THROWS(hashed.set_last_token_id(2, 99), BlockManagerError);
  CHECK(hashed.lookup_prefix(tokens(8)).num_cached_tokens == 8);
  CHECK_THROWS(hashed.set_last_token_id(3, 1), BlockManagerError);  // unknown sequence
}

// Speculative decoding: draft slots appended with placeholder ids; the accepted ones get their
// ids, the rejected ones and the blocks only they used are released, and only accepted ids
// are ever hashed.
static void test_replace_tail() {
  BlockManager bm(4, 8, 0, 0.0);
  bm.allocate(1, tokens(6));  // blocks 0 (0..3), 1 (4..5)
  for (int i = 0; i < 6; ++i) bm.append_slot(1, -1);  // slots 6..11: blocks 1, 2
  CHECK(bm.num_free_blocks(Device::GPU) == 5);
  bm.replace_tail(1, 6, {6, 7});  // two accepted drafts: 8 slots, two blocks
  CHECK(bm.num_tokens(1) == 8);
  CHECK(bm.block_table(1).size() == 2);
  CHECK(bm.num_free_blocks(Device::GPU) == 6);
  bm.mark_blocks_computed(1, 8);
  CHECK(bm.lookup_prefix(tokens(9)).num_cached_tokens == 8);  // over the accepted ids
  // Slots in a hashed block never change; nor past the slots held.
  CHECK_THROWS(bm.replace_tail(1, 7, {}), BlockManagerError);
  CHECK_THROWS(bm.replace_tail(1, 8, {1}), BlockManagerError);
  bm.replace_tail(1, 8, {});  // nothing to drop: fine
  bm.free(1);
  CHECK(bm.num_free_blocks(Device::GPU) == 8);
}

static void test_bad_args() {
  CHECK_THROWS(BlockManager(0, 8, 0), std::invalid_argument);
  CHECK_THROWS(BlockManager(4, 0, 0), std::invalid_argument);
  CHECK_THROWS(BlockManager(4, 8, -1), std::invalid_argument);
  CHECK_THROWS(BlockManager(4, 8, 0, 1.0), std::invalid_argument);
  BlockManager bm(4, 8, 0, 0.0);
  bm.allocate(7, tokens(5));
  CHECK_THROWS(bm.allocate(7, tokens(5)), BlockManagerError);
}

// Random operations; the invariants are checked through the public API.
static void test_random_ops() {
  std::mt19937 rng(1234);
  BlockManager bm(4, 32, 16, 0.0);
  std::vector<SeqId> live;
  SeqId next_id = 0;
  for (int step = 0; step < 3000; ++step) {
    int op = rng() % 6;
    try {
      if (op == 0 || live.empty()) {
        bm.allocate(next_id, tokens(1 + rng() % 12, rng() % 3 * 4));
        live.push_back(next_id++);
      } else {
        SeqId id = live[rng() % live.size()];
        bool on_gpu = bm.seq_device(id) == Device::GPU;
        if (op == 1 && on_gpu) bm.append_slot(id, rng() % 5);
        if (op == 2) {
          bm.fork(id, next_id);
          live.push_back(next_id++);
        }
        if (op == 3) {
          bm.free(id);
          live.erase(std::find(live.begin(), live.end(), id));
        }
        if (op == 4 && on_gpu) bm.mark_blocks_computed(id, bm.num_tokens(id));
        if (op == 5) {
          if (on_gpu && bm.can_swap_out({id})) bm.swap_out({id});
          else if (!on_gpu && bm.can_swap_in({id}) == AllocStatus::OK) bm.swap_in({id});
        }
      }
    } catch (const NoFreeBlocksError&) {
    }
    for (Device d : {Device::GPU, Device::CPU}) {
      std::vector<int> refs(bm.num_total_blocks(d), 0);
      for (SeqId id : bm.seq_ids())
        if (bm.seq_device(id) == d)
          for (BlockId b : bm.block_table(id)) ++refs[b];
      for (BlockId b = 0; b < bm.num_total_blocks(d); ++b) CHECK(bm.ref_count(b, d) == refs[b]);
      for (BlockId b : bm.free_block_ids(d)) CHECK(refs[b] == 0);
      CHECK(bm.num_free_blocks(d) + bm.num_used_blocks(d) == bm.num_total_blocks(d));
      CHECK(static_cast<int>(bm.free_block_ids(d).size()) == bm.num_free_blocks(d));
    }
    if (g_failures) return;
  }
  for (SeqId id : live) bm.free(id);
  CHECK(bm.num_free_blocks(Device::GPU) == 32 && bm.num_free_blocks(Device::CPU) == 16);
}

int main() {
  test_allocate_grow_free();
  test_fork_cow_swap();
  test_prefix_cache_and_collision();
  test_set_last_token_id();
  test_replace_tail();
  test_bad_args();
  test_random_ops();
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("test_block_manager: all checks passed\n");
  return 0;
}
