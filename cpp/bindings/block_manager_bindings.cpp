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
using pagedd::Device;

void bind_block_manager(nb::module_& m) {
  nb::enum_<Device>(m, "Device", "Which pool a block or sequence lives in.")
      .value("GPU", Device::GPU)
      .value("CPU", Device::CPU);
  nb::enum_<AllocStatus>(m, "AllocStatus",
                         "OK: fits now; LATER: fits in an emptier pool; NEVER: never fits.")
      .value("OK", AllocStatus::OK)
      .value("LATER", AllocStatus::LATER)
      .value("NEVER", AllocStatus::NEVER);

  auto base = nb::exception<pagedd::BlockManagerError>(m, "BlockManagerError", PyExc_RuntimeError);
  nb::exception<pagedd::NoFreeBlocksError>(m, "NoFreeBlocksError", base);

  nb::class_<BlockManager>(m, "BlockManager",
                           "KV-cache block manager: block pools, block tables, copy-on-write, "
                           "swap and prefix caching (see block_manager.h).")
      .def(nb::init<int, int, int, double, bool>(), "block_size"_a, "num_gpu_blocks"_a,
           "num_cpu_blocks"_a, "watermark"_a = 0.01, "enable_prefix_caching"_a = true)
      .def("can_allocate", &BlockManager::can_allocate, "token_ids"_a, "cache_salt"_a = "")
      .def("allocate", &BlockManager::allocate, "seq_id"_a, "token_ids"_a, "cache_salt"_a = "",
           "Create seq_id with blocks for every token; returns the number of cached tokens.")
      .def("can_append_slots", &BlockManager::can_append_slots, "seq_ids"_a)
      .def("append_slot", &BlockManager::append_slot, "seq_id"_a, "token_id"_a,
           "One more token; returns (src, dst) to copy on write, else None.")
      .def("set_last_token_id", &BlockManager::set_last_token_id, "seq_id"_a, "token_id"_a,
           "Replace the last token's (placeholder) id before its block is marked computed.")
      .def("replace_tail", &BlockManager::replace_tail, "seq_id"_a, "start"_a, "token_ids"_a,
           "Keep start slots, give the next ones token_ids, drop the rest (rejected drafts).")
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
      .def("num_cached_blocks", &BlockManager::num_cached_blocks)
      .def("has_seq", &BlockManager::has_seq, "seq_id"_a)
      .def("seq_device", &BlockManager::seq_device, "seq_id"_a)
      .def("num_tokens", &BlockManager::num_tokens, "seq_id"_a)
      .def("block_table", &BlockManager::block_table, "seq_id"_a)
      .def("ref_count", &BlockManager::ref_count, "block_id"_a, "device"_a = Device::GPU)
      .def("free_block_ids", &BlockManager::free_block_ids, "device"_a = Device::GPU)
      .def("seq_ids", &BlockManager::seq_ids);
}
