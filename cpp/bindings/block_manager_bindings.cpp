// Python binding of pagedd::BlockManager (pydaemon._core.BlockManager).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>

#include "block_manager.h"

namespace nb = nanobind;
using namespace nb::literals;
using pagedd::AllocStatus;
using pagedd::BlockManager;
using pagedd::BlockMoves;
using pagedd::Device;
using pagedd::DiskBlockRecord;
using pagedd::TierStats;

void bind_block_manager(nb::module_& m) {
  nb::enum_<Device>(m, "Device", "Which pool a block or sequence lives in.")
      .value("GPU", Device::GPU)
      .value("CPU", Device::CPU)
      .value("DISK", Device::DISK);
  nb::enum_<AllocStatus>(m, "AllocStatus",
                         "OK: fits now; LATER: fits in an emptier pool; NEVER: never fits.")
      .value("OK", AllocStatus::OK)
      .value("LATER", AllocStatus::LATER)
      .value("NEVER", AllocStatus::NEVER);

  auto base = nb::exception<pagedd::BlockManagerError>(m, "BlockManagerError", PyExc_RuntimeError);
  nb::exception<pagedd::NoFreeBlocksError>(m, "NoFreeBlocksError", base);

  m.attr("MAX_DISK_SALT_BYTES") = pagedd::kMaxDiskSaltBytes;

  nb::class_<DiskBlockRecord>(m, "DiskBlockRecord",
                              "One disk-tier block as its file slot describes it.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](DiskBlockRecord* r, int disk_block, uint64_t uid, uint64_t parent_uid, uint64_t hash,
             std::string salt, std::vector<int32_t> token_ids) {
            new (r) DiskBlockRecord();
            r->disk_block = disk_block;
            r->uid = uid;
            r->parent_uid = parent_uid;
            r->hash = hash;
            r->salt = std::move(salt);
            r->token_ids = std::move(token_ids);
          },
          "disk_block"_a, "uid"_a, "parent_uid"_a, "hash"_a, "salt"_a, "token_ids"_a)
      .def_rw("disk_block", &DiskBlockRecord::disk_block)
      .def_rw("uid", &DiskBlockRecord::uid)
      .def_rw("parent_uid", &DiskBlockRecord::parent_uid)
      .def_rw("hash", &DiskBlockRecord::hash)
      .def_rw("salt", &DiskBlockRecord::salt)
      .def_rw("token_ids", &DiskBlockRecord::token_ids);

  nb::class_<BlockMoves>(m, "BlockMoves", "The block copies of one step, (src, dst) pairs.")
      .def_ro("blocks_to_save_to_cpu", &BlockMoves::blocks_to_save_to_cpu)
      .def_ro("blocks_to_save_ahead_to_cpu", &BlockMoves::blocks_to_save_ahead_to_cpu)
      .def_ro("blocks_to_load_from_cpu", &BlockMoves::blocks_to_load_from_cpu)
      .def_ro("blocks_to_write_to_disk", &BlockMoves::blocks_to_write_to_disk)
      .def_ro("disk_write_records", &BlockMoves::disk_write_records)
      .def_ro("blocks_to_read_from_disk", &BlockMoves::blocks_to_read_from_disk)
      .def_ro("disk_read_records", &BlockMoves::disk_read_records);
  m.def(
      "block_moves",
      [](std::vector<pagedd::BlockPair> save, std::vector<pagedd::BlockPair> save_ahead,
         std::vector<pagedd::BlockPair> load, std::vector<pagedd::BlockPair> write,
         std::vector<pagedd::BlockPair> read) {
        BlockMoves moves;
        moves.blocks_to_save_to_cpu = std::move(save);
        moves.blocks_to_save_ahead_to_cpu = std::move(save_ahead);
        moves.blocks_to_load_from_cpu = std::move(load);
        moves.blocks_to_write_to_disk = std::move(write);
        moves.blocks_to_read_from_disk = std::move(read);
        return moves;
      },
      "blocks_to_save_to_cpu"_a, "blocks_to_save_ahead_to_cpu"_a, "blocks_to_load_from_cpu"_a,
      "blocks_to_write_to_disk"_a, "blocks_to_read_from_disk"_a,
      "A BlockMoves from plain lists (discard_block_moves of a step that never ran).");

  nb::class_<TierStats>(m, "TierStats", "Counters of the tiers since construction.")
      .def_ro("gpu_hit_tokens", &TierStats::gpu_hit_tokens)
      .def_ro("cpu_hit_tokens", &TierStats::cpu_hit_tokens)
      .def_ro("disk_hit_tokens", &TierStats::disk_hit_tokens)
      .def_ro("num_saved_blocks", &TierStats::num_saved_blocks)
      .def_ro("num_loaded_blocks", &TierStats::num_loaded_blocks)
      .def_ro("num_written_blocks", &TierStats::num_written_blocks)
      .def_ro("num_read_blocks", &TierStats::num_read_blocks)
      .def_ro("num_dropped_loads", &TierStats::num_dropped_loads)
      .def_ro("num_failed_disk_reads", &TierStats::num_failed_disk_reads)
      .def_ro("num_failed_disk_writes", &TierStats::num_failed_disk_writes)
      .def_ro("are_disk_writes_stopped", &TierStats::are_disk_writes_stopped);

  nb::class_<BlockManager>(m, "BlockManager",
                           "KV-cache block manager: block pools, block tables, copy-on-write, "
                           "swap and prefix caching (see block_manager.h).")
      .def(nb::init<int, int, int, double, bool, bool, int, int>(), "block_size"_a,
           "num_gpu_blocks"_a, "num_cpu_blocks"_a, "watermark"_a = 0.01,
           "enable_prefix_caching"_a = true, "enable_cpu_tier"_a = false, "num_disk_blocks"_a = 0,
           "save_ahead_blocks"_a = 0)
      .def("can_allocate", &BlockManager::can_allocate, "token_ids"_a, "cache_salt"_a = "")
      .def("allocate", &BlockManager::allocate, "seq_id"_a, "token_ids"_a, "cache_salt"_a = "",
           "Create seq_id with blocks for every token; returns the number of cached tokens.")
      .def("can_allocate_group", &BlockManager::can_allocate_group, "token_ids"_a, "salts"_a,
           "can_allocate for one table per layer group (salts: one per group).")
      .def("allocate_group", &BlockManager::allocate_group, "seq_ids"_a, "token_ids"_a,
           "salts"_a,
           "allocate for one table per layer group, the same prefix hit in each; returns the "
           "number of cached tokens.")
      .def("can_append_slots", &BlockManager::can_append_slots, "seq_ids"_a)
      .def("append_slot", &BlockManager::append_slot, "seq_id"_a, "token_id"_a,
           "One more token; returns (src, dst) to copy on write, else None.")
      .def("set_last_token_id", &BlockManager::set_last_token_id, "seq_id"_a, "token_id"_a,
           "Replace the last token's (placeholder) id before its block is marked computed.")
      .def("replace_tail", &BlockManager::replace_tail, "seq_id"_a, "start"_a, "token_ids"_a,
           "Keep start slots, give the next ones token_ids, drop the rest (rejected drafts).")
      .def("release_blocks_before", &BlockManager::release_blocks_before, "seq_id"_a,
           "num_tokens"_a,
           "Sliding windows: release the blocks wholly before token num_tokens (their entries "
           "become -1); returns how many now.")
      .def("num_released_blocks", &BlockManager::num_released_blocks, "seq_id"_a)
      .def("fork", &BlockManager::fork, "parent_id"_a, "child_id"_a)
      .def("free", &BlockManager::free, "seq_id"_a)
      .def("mark_blocks_computed", &BlockManager::mark_blocks_computed, "seq_id"_a,
           "num_computed_tokens"_a)
      .def("can_swap_out", &BlockManager::can_swap_out, "seq_ids"_a)
      .def("swap_out", &BlockManager::swap_out, "seq_ids"_a,
           "Returns blocks_to_swap_out: [(gpu_block, cpu_block)].")
      .def("can_swap_in", &BlockManager::can_swap_in, "seq_ids"_a)
      .def("swap_in", &BlockManager::swap_in, "seq_ids"_a,
           "Returns blocks_to_swap_in: [(cpu_block, gpu_block)].")
      .def(
          "lookup_prefix",
          [](const BlockManager& bm, const std::vector<int32_t>& token_ids,
             const std::string& cache_salt) {
            pagedd::PrefixMatch match = bm.lookup_prefix(token_ids, cache_salt);
            return std::make_pair(match.block_ids, match.num_cached_tokens);
          },
          "token_ids"_a, "cache_salt"_a = "",
          "(block_ids, num_cached_tokens) of the longest cached prefix (full blocks).")
      .def("seq_ready_step", &BlockManager::seq_ready_step, "seq_id"_a,
           "The first step whose output may read the sequence's KV (loads in flight).")
      .def("take_block_moves", &BlockManager::take_block_moves,
           "Ends the step: its BlockMoves (saves, loads, disk writes and reads).")
      .def("step_index", &BlockManager::step_index)
      .def("discard_block_moves", &BlockManager::discard_block_moves, "moves"_a,
           "A step that never ran: forget the copies it was to make.")
      .def("restore_disk_blocks", &BlockManager::restore_disk_blocks, "records"_a,
           "Warm restart: enter the disk blocks of a previous run; returns how many.")
      .def("forget_failed_disk_reads", &BlockManager::forget_failed_disk_reads, "reads"_a,
           "Disk reads (disk_block, uid) that did not deliver their block: the entries leave "
           "every tier; returns the GPU sequences holding one (they must recompute it).")
      .def("forget_failed_disk_writes", &BlockManager::forget_failed_disk_writes, "writes"_a,
           "Disk writes (disk_block, uid) that did not land: their disk copies are dropped.")
      .def("stop_disk_writes", &BlockManager::stop_disk_writes,
           "No more disk writes are planned (reads go on).")
      .def("tier_stats", &BlockManager::tier_stats)
      .def("reset_prefix_cache", &BlockManager::reset_prefix_cache)
      .def("set_hash_mask", &BlockManager::set_hash_mask, "mask"_a,
           "Test hook: hashes are ANDed with mask (0 makes every block collide).")
      .def("block_size", &BlockManager::block_size)
      .def("num_total_blocks", &BlockManager::num_total_blocks, "device"_a = Device::GPU)
      .def("num_free_blocks", &BlockManager::num_free_blocks, "device"_a = Device::GPU)
      .def("num_used_blocks", &BlockManager::num_used_blocks, "device"_a = Device::GPU)
      .def("kv_waste", &BlockManager::kv_waste)
      .def("num_shared_blocks", &BlockManager::num_shared_blocks)
      .def("num_blocks_saved_by_sharing", &BlockManager::num_blocks_saved_by_sharing)
      .def("prefix_cache_query_tokens", &BlockManager::prefix_cache_query_tokens)
      .def("prefix_cache_hit_tokens", &BlockManager::prefix_cache_hit_tokens)
      .def("num_cached_blocks", &BlockManager::num_cached_blocks, "device"_a = Device::GPU)
      .def("num_pinned_blocks", &BlockManager::num_pinned_blocks, "device"_a)
      .def("has_seq", &BlockManager::has_seq, "seq_id"_a)
      .def("seq_device", &BlockManager::seq_device, "seq_id"_a)
      .def("num_tokens", &BlockManager::num_tokens, "seq_id"_a)
      .def("block_table", &BlockManager::block_table, "seq_id"_a)
      .def("ref_count", &BlockManager::ref_count, "block_id"_a, "device"_a = Device::GPU)
      .def("free_block_ids", &BlockManager::free_block_ids, "device"_a = Device::GPU)
      .def("seq_ids", &BlockManager::seq_ids);
}
