// Python binding of pagedd::BlockManager (pydaemon._core.BlockManager).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
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

namespace {

using AnyArray = nb::ndarray<nb::ro, nb::device::cpu>;     // read-only inputs
using OutArray = nb::ndarray<nb::device::cpu>;             // writable outputs

const char* dtype_name(nb::dlpack::dtype dt) {
  if (dt == nb::dtype<int32_t>()) return "int32";
  if (dt == nb::dtype<int64_t>()) return "int64";
  if (dt == nb::dtype<float>()) return "float32";
  if (dt == nb::dtype<double>()) return "float64";
  return "another dtype";
}

// Checks dtype, rank, shape and C-contiguity of one argument; throws a Python error naming it.
template <typename T, typename Array>
void check_array(const Array& a, const char* name, size_t ndim, const int64_t* shape) {
  if (a.dtype() != nb::dtype<T>())
    throw nb::type_error((std::string("build_step_metadata: ") + name + " must have dtype " +
                          dtype_name(nb::dtype<T>()) + ", got " + dtype_name(a.dtype()))
                             .c_str());
  if (a.ndim() != ndim)
    throw nb::value_error((std::string("build_step_metadata: ") + name + " must be " +
                           std::to_string(ndim) + "-D, got " + std::to_string(a.ndim()) + "-D")
                              .c_str());
  int64_t expected_stride = 1;
  for (size_t d = ndim; d-- > 0;) {
    if (shape[d] >= 0 && static_cast<int64_t>(a.shape(d)) != shape[d])
      throw nb::value_error((std::string("build_step_metadata: ") + name + " has shape[" +
                             std::to_string(d) + "]=" + std::to_string(a.shape(d)) +
                             ", expected " + std::to_string(shape[d]))
                                .c_str());
    if (a.shape(d) > 1 && a.stride(d) != expected_stride)
      throw nb::value_error(
          (std::string("build_step_metadata: ") + name + " must be C-contiguous").c_str());
    expected_stride *= static_cast<int64_t>(a.shape(d));
  }
}

void build_step_metadata(const BlockManager& bm, const AnyArray& seq_ids,
                         const AnyArray& query_start, const AnyArray& query_len,
                         const OutArray& block_tables, const OutArray& slot_mapping,
                         const OutArray& seq_lens) {
  // Runs without the GIL: only C++ objects are touched and errors are C++ exceptions.
  if (seq_ids.ndim() != 1)
    throw nb::value_error("build_step_metadata: seq_ids must be 1-D");
  const int64_t n = static_cast<int64_t>(seq_ids.shape(0));
  const int64_t vec_n[1] = {n};
  check_array<int64_t>(seq_ids, "seq_ids", 1, vec_n);
  check_array<int32_t>(query_start, "query_start", 1, vec_n);
  check_array<int32_t>(query_len, "query_len", 1, vec_n);
  check_array<int32_t>(seq_lens, "seq_lens", 1, vec_n);
  if (block_tables.ndim() != 2)
    throw nb::value_error(("build_step_metadata: block_tables must be 2-D [num_seqs, "
                           "max_blocks], got " + std::to_string(block_tables.ndim()) + "-D")
                              .c_str());
  const int64_t bt_shape[2] = {n, -1};
  check_array<int32_t>(block_tables, "block_tables", 2, bt_shape);
  const int64_t any_len[1] = {-1};
  check_array<int64_t>(slot_mapping, "slot_mapping", 1, any_len);
  bm.build_step_metadata(static_cast<const int64_t*>(seq_ids.data()),
                         static_cast<const int32_t*>(query_start.data()),
                         static_cast<const int32_t*>(query_len.data()), n,
                         static_cast<int32_t*>(block_tables.data()),
                         static_cast<int64_t>(block_tables.shape(1)),
                         static_cast<int64_t*>(slot_mapping.data()),
                         static_cast<int64_t>(slot_mapping.shape(0)),
                         static_cast<int32_t*>(seq_lens.data()));
}

}  // namespace

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
                           "swap, prefix caching and per-step metadata (see block_manager.h).")
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
      .def("build_step_metadata", &build_step_metadata, "seq_ids"_a, "query_start"_a,
           "query_len"_a, "block_tables"_a.noconvert(), "slot_mapping"_a.noconvert(),
           "seq_lens"_a.noconvert(), nb::call_guard<nb::gil_scoped_release>(),
           "Fill block_tables [n, max_blocks] int32, slot_mapping [sum(query_len)] int64 and "
           "seq_lens [n] int32 for seq_ids [n] int64, query_start [n] int32, query_len [n] "
           "int32 (all CPU, C-contiguous; numpy or torch).")
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
