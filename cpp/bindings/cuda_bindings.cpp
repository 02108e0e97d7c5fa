// Thin validating binding of the CUDA kernels in cpp/cuda/ (tensors arrive through DLPack).
//
// Every tensor argument is checked (dtype, device, rank, shapes, strides) and a bad one raises
// TypeError / ValueError naming it; outputs are .noconvert() so that no silent temporary copy
// is ever written instead of the caller's tensor. The stream is an integer (e.g.
// torch.cuda.current_stream().cuda_stream); the GIL is released around the launch; a CUDA error
// raises RuntimeError with cudaGetErrorString.
//
// An fp8 (e4m3) KV cache arrives as its uint8 storage (torch: cache.view(torch.uint8)), with
// per-layer k_scale / v_scale; a cache of the query's dtype ignores the scales.
// Every attention kernel also takes the layer's score modifiers (AttentionMods): a sliding
// window (0: none), a soft-cap (0: none) and sinks (None, or [num_q_heads] of the query's dtype).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "array_checks.h"
#include "pagedd_cuda.h"

namespace nb = nanobind;
using pagedd::cuda::DType;

namespace {

using namespace pagedd::bindings;  // Array and the argument checks

// The cache element type: uint8 storage means fp8 e4m3, else the cache must have ref's dtype.
DType kv_cache_dtype(const Array& cache, const char* name, const Array& ref, const char* ref_name) {
  if (is_dtype(cache, kUInt, 8)) return DType::kFp8E4M3;
  if (!(cache.dtype() == ref.dtype()))
    throw nb::type_error((std::string(name) + " must have the dtype of " + ref_name + " (" +
                          dtype_name(ref.dtype()) +
                          ") or be the uint8 storage of an fp8 e4m3 cache, got " +
                          dtype_name(cache.dtype()))
                             .c_str());
  return attention_dtype(ref, ref_name);
}

// Shared checks of the attention kernels' query / cache arguments; returns head_dim.
int64_t check_attention_args(const Array& out, const Array& query, const Array& key_cache,
                             const Array& value_cache, const Array& block_tables,
                             const Array& seq_lens, int dev) {
  attention_dtype(query, "query");
  check_same_dtype(out, "out", query, "query");
  const DType cache_dtype = kv_cache_dtype(key_cache, "key_cache", query, "query");
  check_same_dtype(value_cache, "value_cache", key_cache, "key_cache");
  check_dtype(block_tables, "block_tables", kInt, 32, "int32");
  check_dtype(seq_lens, "seq_lens", kInt, 32, "int32");
  for (auto [a, n] : {std::pair{&query, "query"}, {&out, "out"}, {&key_cache, "key_cache"},
                      {&value_cache, "value_cache"}, {&block_tables, "block_tables"},
                      {&seq_lens, "seq_lens"}})
    check_cuda(*a, n, dev);
  check_ndim(query, "query", 3);
  check_ndim(out, "out", 3);
  check_ndim(key_cache, "key_cache", 4);
  check_ndim(value_cache, "value_cache", 4);
  check_ndim(block_tables, "block_tables", 2);
  check_ndim(seq_lens, "seq_lens", 1);
  const int64_t num_q_heads = query.shape(1), head_dim = query.shape(2);
  const int64_t num_kv_heads = key_cache.shape(1), block_size = key_cache.shape(2);
  if (head_dim != 64 && head_dim != 80 && head_dim != 96 && head_dim != 128 && head_dim != 256)
    throw nb::value_error(("head_dim (query.shape[2]) must be 64, 80, 96, 128 or 256, got " +
                           std::to_string(head_dim))
                              .c_str());
  if (block_size != 8 && block_size != 16 && block_size != 32)
    throw nb::value_error(("block_size (key_cache.shape[2]) must be 8, 16 or 32, got " +
                           std::to_string(block_size))
                              .c_str());
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0)
    throw nb::value_error(("num_q_heads (" + std::to_string(num_q_heads) +
                           ") must be a multiple of num_kv_heads (" +
                           std::to_string(num_kv_heads) + ")")
                              .c_str());
  check_dim(key_cache, "key_cache", 3, head_dim, "head_dim");
  for (size_t i = 0; i < 4; ++i) {
    check_dim(value_cache, "value_cache", i, key_cache.shape(i), "key_cache's shape");
    if (value_cache.stride(i) != key_cache.stride(i))
      throw nb::value_error("value_cache must have the same strides as key_cache");
  }
  check_contiguous_from(key_cache, "key_cache", 2);
  if (query.stride(2) != 1) throw nb::value_error("query's last dim must be contiguous");
  if (query.stride(0) % 8 != 0 || query.stride(1) % 8 != 0 || key_cache.stride(0) % 8 != 0 ||
      key_cache.stride(1) % 8 != 0)
    throw nb::value_error("query and key_cache strides must be multiples of 8 elements");
  if (cache_dtype == DType::kFp8E4M3 &&
      (key_cache.stride(0) % 16 != 0 || key_cache.stride(1) % 16 != 0 ||
       reinterpret_cast<uintptr_t>(key_cache.data()) % 16 != 0 ||
       reinterpret_cast<uintptr_t>(value_cache.data()) % 16 != 0))
    throw nb::value_error("an fp8 key_cache / value_cache must be 16-byte aligned, with block "
                          "and head strides that are multiples of 16");
  for (int i = 0; i < 3; ++i) check_dim(out, "out", i, query.shape(i), "query's shape");
  check_contiguous_from(out, "out", 0);
  if (block_tables.stride(1) != 1 && block_tables.shape(1) > 1)
    throw nb::value_error("block_tables' last dim must be contiguous");
  if (seq_lens.stride(0) != 1 && seq_lens.shape(0) > 1)
    throw nb::value_error("seq_lens must be contiguous");
  return head_dim;
}

// The layer's score modifiers, checked: window >= 0, a finite softcap >= 0, sinks None or a
// contiguous [num_q_heads] tensor of the query's dtype on its device.
pagedd::cuda::AttentionMods attention_mods(int sliding_window, double softcap,
                                           nb::object sinks_obj, const Array& query, int dev) {
  if (sliding_window < 0)
    throw nb::value_error(("sliding_window must be >= 0 (0: none), got " +
                           std::to_string(sliding_window))
                              .c_str());
  if (!(softcap >= 0.0) || !std::isfinite(softcap))
    throw nb::value_error(
        ("softcap must be a finite number >= 0 (0: none), got " + std::to_string(softcap))
            .c_str());
  pagedd::cuda::AttentionMods mods;
  mods.sliding_window = sliding_window;
  mods.softcap = (float)softcap;
  if (!sinks_obj.is_none()) {
    Array sinks = nb::cast<Array>(sinks_obj);
    check_same_dtype(sinks, "sinks", query, "query");
    check_cuda(sinks, "sinks", dev);
    check_ndim(sinks, "sinks", 1);
    check_dim(sinks, "sinks", 0, query.shape(1), "num_q_heads (query.shape[1])");
    if (sinks.stride(0) != 1 && sinks.shape(0) > 1)
      throw nb::value_error("sinks must be contiguous");
    mods.sinks = sinks.data();
  }
  return mods;
}

// The split-KV workspaces of a decode with num_partitions > 1 (checked; null otherwise).
void decode_workspaces(float* (&ws)[3], nb::object tmp_out_obj, nb::object exp_sums_obj,
                       nb::object max_logits_obj, int64_t num_seqs, int64_t num_q_heads,
                       int64_t head_dim, int num_partitions, const std::string& why, int dev) {
  ws[0] = ws[1] = ws[2] = nullptr;
  if (num_partitions <= 1) return;
  const char* names[3] = {"tmp_out", "exp_sums", "max_logits"};
  nb::object objs[3] = {tmp_out_obj, exp_sums_obj, max_logits_obj};
  for (int i = 0; i < 3; ++i) {
    if (objs[i].is_none())
      throw nb::value_error((std::string(names[i]) + " is required when " + why).c_str());
    Array a = nb::cast<Array>(objs[i]);
    check_dtype(a, names[i], kFloat, 32, "float32");
    check_cuda(a, names[i], dev);
    check_ndim(a, names[i], i == 0 ? 4 : 3);
    check_dim(a, names[i], 0, num_seqs, "num_seqs");
    check_dim(a, names[i], 1, num_q_heads, "num_q_heads");
    check_dim(a, names[i], 2, num_partitions, "num_partitions");
    if (i == 0) check_dim(a, names[i], 3, head_dim, "head_dim");
    check_contiguous_from(a, names[i], 0);
    ws[i] = static_cast<float*>(a.data());
  }
}

// The paged-cache fields of the decode and prefill parameters, from checked arguments.
template <typename Params>
void fill_paged_kv(Params& p, const Array& key_cache, const Array& value_cache,
                   const Array& block_tables, const Array& seq_lens) {
  p.key_cache = key_cache.data();
  p.value_cache = value_cache.data();
  p.kv_block_stride = key_cache.stride(0);
  p.kv_head_stride = key_cache.stride(1);
  p.block_tables = static_cast<const int32_t*>(block_tables.data());
  p.block_table_stride = block_tables.stride(0);
  p.seq_lens = static_cast<const int32_t*>(seq_lens.data());
}

// The parameters both decode kernels share, from checked arguments.
void fill_decode_params(pagedd::cuda::PagedDecodeParams& p, const Array& out, const Array& query,
                        const Array& key_cache, const Array& value_cache,
                        const Array& block_tables, const Array& seq_lens, float* (&ws)[3],
                        int num_partitions, double scale, double k_scale, double v_scale) {
  p.out = out.data();
  p.query = query.data();
  p.q_seq_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  fill_paged_kv(p, key_cache, value_cache, block_tables, seq_lens);
  p.tmp_out = ws[0];
  p.exp_sums = ws[1];
  p.max_logits = ws[2];
  p.num_partitions = num_partitions;
  p.num_seqs = (int)query.shape(0);
  p.num_q_heads = (int)query.shape(1);
  p.num_kv_heads = (int)key_cache.shape(1);
  p.head_dim = (int)query.shape(2);
  p.block_size = (int)key_cache.shape(2);
  p.scale = (float)scale;
  p.dtype = attention_dtype(query, "query");
  p.cache_dtype = kv_cache_dtype(key_cache, "key_cache", query, "query");
  p.k_scale = (float)k_scale;
  p.v_scale = (float)v_scale;
}

void paged_attention_decode(Array out, Array query, Array key_cache, Array value_cache,
                            Array block_tables, Array seq_lens, double scale, int max_seq_len,
                            nb::object tmp_out_obj, nb::object exp_sums_obj,
                            nb::object max_logits_obj, double k_scale, double v_scale,
                            int sliding_window, double softcap, nb::object sinks,
                            uintptr_t stream) {
  const int dev = current_device();
  const int64_t head_dim =
      check_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, dev);
  check_kv_scales(k_scale, v_scale);
  const auto mods = attention_mods(sliding_window, softcap, sinks, query, dev);
  const int64_t num_seqs = query.shape(0), num_q_heads = query.shape(1);
  const int64_t block_size = key_cache.shape(2);
  check_dim(block_tables, "block_tables", 0, num_seqs, "num_seqs");
  check_dim(seq_lens, "seq_lens", 0, num_seqs, "num_seqs");
  if (num_seqs == 0) return;
  if (num_seqs > 65535) throw nb::value_error("at most 65535 sequences per call");
  if (max_seq_len > block_tables.shape(1) * block_size)
    throw nb::value_error(("max_seq_len (" + std::to_string(max_seq_len) +
                           ") exceeds block_tables.shape[1] * block_size (" +
                           std::to_string(block_tables.shape(1) * block_size) + ")")
                              .c_str());
  // With a window the partitions cover its keys only.
  const int num_partitions =
      pagedd::cuda::num_partitions_for(pagedd::cuda::decode_span(max_seq_len, sliding_window, 1));

  float* ws[3];
  decode_workspaces(ws, tmp_out_obj, exp_sums_obj, max_logits_obj, num_seqs, num_q_heads,
                    head_dim, num_partitions,
                    "min(max_seq_len, sliding_window or max_seq_len) > " +
                        std::to_string(pagedd::cuda::kPartitionSize),
                    dev);
  pagedd::cuda::PagedDecodeParams p{};
  fill_decode_params(p, out, query, key_cache, value_cache, block_tables, seq_lens, ws,
                     num_partitions, scale, k_scale, v_scale);
  p.mods = mods;
  launch_without_gil("paged_attention_decode", [&] {
    return pagedd::cuda::paged_attention_decode(p, as_stream(stream));
  });
}

void paged_attention_decode_tc(Array out, Array query, Array key_cache, Array value_cache,
                               Array block_tables, Array seq_lens, double scale, int max_seq_len,
                               int partition_size, nb::object tmp_out_obj,
                               nb::object exp_sums_obj, nb::object max_logits_obj,
                               double k_scale, double v_scale, int sliding_window,
                               double softcap, nb::object sinks, uintptr_t stream) {
  const int dev = current_device();
  const int64_t head_dim =
      check_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, dev);
  check_kv_scales(k_scale, v_scale);
  const auto mods = attention_mods(sliding_window, softcap, sinks, query, dev);
  const int64_t num_seqs = query.shape(0), num_q_heads = query.shape(1);
  const int64_t num_kv_heads = key_cache.shape(1), block_size = key_cache.shape(2);
  if (!pagedd::cuda::decode_tc_is_built((int)head_dim))
    throw nb::value_error(("paged_attention_decode_tc is not built for head_dim " +
                           std::to_string(head_dim))
                              .c_str());
  const int64_t group = num_q_heads / num_kv_heads;
  if (group > pagedd::cuda::kDecodeTcMaxGroup)
    throw nb::value_error(("paged_attention_decode_tc takes at most " +
                           std::to_string(pagedd::cuda::kDecodeTcMaxGroup) +
                           " query heads per kv head, got " + std::to_string(num_q_heads) +
                           " / " + std::to_string(num_kv_heads))
                              .c_str());
  check_dim(block_tables, "block_tables", 0, num_seqs, "num_seqs");
  check_dim(seq_lens, "seq_lens", 0, num_seqs, "num_seqs");
  if (partition_size <= 0 || partition_size % 64 != 0)
    throw nb::value_error(("partition_size must be a positive multiple of 64, got " +
                           std::to_string(partition_size))
                              .c_str());
  if (max_seq_len < 0)
    throw nb::value_error(("max_seq_len must be >= 0, got " + std::to_string(max_seq_len)).c_str());
  if (max_seq_len > block_tables.shape(1) * block_size)
    throw nb::value_error(("max_seq_len (" + std::to_string(max_seq_len) +
                           ") exceeds block_tables.shape[1] * block_size (" +
                           std::to_string(block_tables.shape(1) * block_size) + ")")
                              .c_str());
  if (num_seqs == 0) return;
  if (num_seqs > 65535) throw nb::value_error("at most 65535 sequences per call");
  // With a window the partitions cover its keys only (from a 16-aligned first key).
  const int span = pagedd::cuda::decode_span(max_seq_len, sliding_window,
                                             pagedd::cuda::kDecodeTcWindowAlign);
  const int64_t parts64 = span <= 0 ? 1 : ((int64_t)span + partition_size - 1) / partition_size;
  if (parts64 > 65535)
    throw nb::value_error(("the keys a sequence spans / partition_size gives " +
                           std::to_string(parts64) + " partitions, at most 65535")
                              .c_str());
  const int num_partitions = (int)parts64;
  float* ws[3];
  decode_workspaces(ws, tmp_out_obj, exp_sums_obj, max_logits_obj, num_seqs, num_q_heads,
                    head_dim, num_partitions,
                    "min(max_seq_len, sliding_window + 15) > partition_size (num_partitions = "
                    "ceil(that / partition_size))",
                    dev);

  pagedd::cuda::PagedDecodeTcParams p{};
  fill_decode_params(p, out, query, key_cache, value_cache, block_tables, seq_lens, ws,
                     num_partitions, scale, k_scale, v_scale);
  p.mods = mods;
  p.partition_size = partition_size;
  p.max_seq_len = max_seq_len;
  launch_without_gil("paged_attention_decode_tc", [&] {
    return pagedd::cuda::paged_attention_decode_tc(p, as_stream(stream));
  });
}

void paged_attention_prefill(Array out, Array query, Array key_cache, Array value_cache,
                             Array block_tables, Array seq_lens, Array query_start_loc,
                             double scale, int max_query_len, int block_m, int block_n,
                             double k_scale, double v_scale, int backend, int sliding_window,
                             double softcap, nb::object sinks, uintptr_t stream) {
  const int dev = current_device();
  const int64_t head_dim =
      check_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, dev);
  check_kv_scales(k_scale, v_scale);
  const auto mods = attention_mods(sliding_window, softcap, sinks, query, dev);
  if (backend < 0 || backend > 2)
    throw nb::value_error(("backend must be 0 (auto), 1 (mma) or 2 (wgmma), got " +
                           std::to_string(backend))
                              .c_str());
  check_dtype(query_start_loc, "query_start_loc", kInt, 32, "int32");
  check_cuda(query_start_loc, "query_start_loc", dev);
  check_ndim(query_start_loc, "query_start_loc", 1);
  const int64_t num_seqs = seq_lens.shape(0);
  check_dim(query_start_loc, "query_start_loc", 0, num_seqs + 1, "num_seqs + 1");
  check_dim(block_tables, "block_tables", 0, num_seqs, "num_seqs");
  if (query_start_loc.stride(0) != 1)
    throw nb::value_error("query_start_loc must be contiguous");
  if (num_seqs > 65535) throw nb::value_error("at most 65535 sequences per call");
  if (num_seqs > 0 && (max_query_len < 1 || max_query_len > query.shape(0)))
    throw nb::value_error(("max_query_len must be in [1, num_tokens = " +
                           std::to_string(query.shape(0)) + "], got " +
                           std::to_string(max_query_len))
                              .c_str());
  const auto cache_dtype = kv_cache_dtype(key_cache, "key_cache", query, "query");
  if (backend == (int)pagedd::cuda::PrefillBackend::kWgmma) {
    const char* why = pagedd::cuda::prefill_wgmma_unavailable_reason((int)head_dim, cache_dtype);
    if (why != nullptr)
      throw nb::value_error((std::string("backend 'wgmma' is unavailable: ") + why).c_str());
    if (!pagedd::cuda::prefill_wgmma_tile_is_built(block_m, block_n))
      throw nb::value_error(("block_m x block_n = " + std::to_string(block_m) + " x " +
                             std::to_string(block_n) +
                             " is not built for backend 'wgmma' (block_m 0 or 128, block_n 0, "
                             "64 or 128)")
                                .c_str());
  } else {  // auto with a tile given runs mma.sync (prefill_backend_for)
    int bm = block_m, bn = block_n;
    pagedd::cuda::prefill_tile_shape((int)head_dim, max_query_len, bm, bn);
    if (!pagedd::cuda::prefill_tile_is_built((int)head_dim, bm, bn))
      throw nb::value_error(("block_m x block_n = " + std::to_string(block_m) + " x " +
                             std::to_string(block_n) + " is not built for head_dim " +
                             std::to_string(head_dim) +
                             " (0 = default; 128x64, 128x32, 64x64, or 64x32 for 256)")
                                .c_str());
  }
  if (num_seqs == 0 || query.shape(0) == 0) return;

  pagedd::cuda::PagedPrefillParams p{};
  p.out = out.data();
  p.query = query.data();
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  fill_paged_kv(p, key_cache, value_cache, block_tables, seq_lens);
  p.num_blocks = key_cache.shape(0);
  p.query_start_loc = static_cast<const int32_t*>(query_start_loc.data());
  p.num_seqs = (int)num_seqs;
  p.num_q_heads = (int)query.shape(1);
  p.num_kv_heads = (int)key_cache.shape(1);
  p.head_dim = (int)head_dim;
  p.block_size = (int)key_cache.shape(2);
  p.max_query_len = max_query_len;
  p.block_m = block_m;
  p.block_n = block_n;
  p.scale = (float)scale;
  p.dtype = attention_dtype(query, "query");
  p.cache_dtype = cache_dtype;
  p.k_scale = (float)k_scale;
  p.v_scale = (float)v_scale;
  p.backend = static_cast<pagedd::cuda::PrefillBackend>(backend);
  p.mods = mods;
  launch_without_gil("paged_attention_prefill", [&] {
    return pagedd::cuda::paged_attention_prefill(p, as_stream(stream));
  });
}

std::string prefill_wgmma_unavailable_reason(int head_dim, bool fp8_cache) {
  const char* why = pagedd::cuda::prefill_wgmma_unavailable_reason(
      head_dim, fp8_cache ? DType::kFp8E4M3 : DType::kBFloat16);
  return why ? why : "";
}

void reshape_and_cache(Array key, Array value, Array key_cache, Array value_cache,
                       Array slot_mapping, double k_scale, double v_scale, uintptr_t stream) {
  const int dev = current_device();
  if (!is_dtype(key, kFloat, 16) && !is_dtype(key, kBfloat, 16) && !is_dtype(key, kFloat, 32))
    throw nb::type_error(("key must be float16, bfloat16 or float32, got " +
                          dtype_name(key.dtype()))
                             .c_str());
  check_same_dtype(value, "value", key, "key");
  const bool cache_fp8 = is_dtype(key_cache, kUInt, 8);
  if (cache_fp8) {
    if (is_dtype(key, kFloat, 32))
      throw nb::type_error("an fp8 (uint8 storage) key_cache needs float16 or bfloat16 key / "
                           "value, got float32");
    check_kv_scales(k_scale, v_scale);
  } else {
    check_same_dtype(key_cache, "key_cache", key, "key");
  }
  check_same_dtype(value_cache, "value_cache", key_cache, "key_cache");
  check_dtype(slot_mapping, "slot_mapping", kInt, 64, "int64");
  for (auto [a, n] : {std::pair{&key, "key"}, {&value, "value"}, {&key_cache, "key_cache"},
                      {&value_cache, "value_cache"}, {&slot_mapping, "slot_mapping"}})
    check_cuda(*a, n, dev);
  check_ndim(key, "key", 3);
  check_ndim(value, "value", 3);
  check_ndim(key_cache, "key_cache", 4);
  check_ndim(value_cache, "value_cache", 4);
  check_ndim(slot_mapping, "slot_mapping", 1);
  const int64_t num_tokens = key.shape(0);
  for (int i = 0; i < 3; ++i) check_dim(value, "value", i, key.shape(i), "key's shape");
  check_dim(slot_mapping, "slot_mapping", 0, num_tokens, "num_tokens");
  check_dim(key_cache, "key_cache", 1, key.shape(1), "num_kv_heads");
  check_dim(key_cache, "key_cache", 3, key.shape(2), "head_dim");
  for (size_t i = 0; i < 4; ++i) {
    check_dim(value_cache, "value_cache", i, key_cache.shape(i), "key_cache's shape");
    if (value_cache.stride(i) != key_cache.stride(i))
      throw nb::value_error("value_cache must have the same strides as key_cache");
  }
  check_contiguous_from(key_cache, "key_cache", 2);
  if (key.stride(2) != 1 || value.stride(2) != 1)
    throw nb::value_error("key and value must be contiguous in their last dim");
  if (slot_mapping.stride(0) != 1 && num_tokens > 1)
    throw nb::value_error("slot_mapping must be contiguous");
  if (num_tokens > 2147483647) throw nb::value_error("too many tokens");
  pagedd::cuda::ReshapeAndCacheParams p{};
  p.key = key.data();
  p.value = value.data();
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.key_cache = key_cache.data();
  p.value_cache = value_cache.data();
  p.cache_block_stride = key_cache.stride(0);
  p.cache_head_stride = key_cache.stride(1);
  p.slot_mapping = static_cast<const int64_t*>(slot_mapping.data());
  p.num_tokens = (int)num_tokens;
  p.num_kv_heads = (int)key.shape(1);
  p.head_dim = (int)key.shape(2);
  p.block_size = (int)key_cache.shape(2);
  p.elem_size = key.dtype().bits / 8;
  p.cache_fp8 = cache_fp8;
  if (cache_fp8) {
    check_fp8_cache_layout(p.head_dim, p.cache_block_stride, p.cache_head_stride, p.key_cache,
                           p.value_cache);
    p.dtype = attention_dtype(key, "key");
    p.k_scale = (float)k_scale;
    p.v_scale = (float)v_scale;
  }
  launch_without_gil("reshape_and_cache", [&] {
    return pagedd::cuda::reshape_and_cache(p, as_stream(stream));
  });
}

int64_t block_bytes_of(const Array& a, const char* name) {
  if (a.ndim() < 1) throw nb::value_error((std::string(name) + " must have a block dim").c_str());
  check_contiguous_from(a, name, 0);
  int64_t n = a.dtype().bits / 8;
  for (size_t i = 1; i < a.ndim(); ++i) n *= (int64_t)a.shape(i);
  return n;
}

void check_block_mapping(const Array& m, const char* name) {
  check_dtype(m, name, kInt, 64, "int64");
  check_ndim(m, name, 2);
  check_dim(m, name, 1, 2, "(src, dst) pairs");
  check_contiguous_from(m, name, 0);
}

void copy_blocks(Array kv_cache, Array block_mapping, uintptr_t stream) {
  const int dev = current_device();
  check_cuda(kv_cache, "kv_cache", dev);
  check_cuda(block_mapping, "block_mapping", dev);
  check_block_mapping(block_mapping, "block_mapping");
  const int64_t block_bytes = block_bytes_of(kv_cache, "kv_cache");
  launch_without_gil("copy_blocks", [&] {
    return pagedd::cuda::copy_blocks(kv_cache.data(), block_bytes,
                                     static_cast<const int64_t*>(block_mapping.data()),
                                     (int64_t)block_mapping.shape(0), as_stream(stream));
  });
}

void swap_blocks(Array src, Array dst, Array block_mapping, uintptr_t stream) {
  const int dev = current_device();
  const bool src_gpu = src.device_type() == nb::device::cuda::value;
  const bool dst_gpu = dst.device_type() == nb::device::cuda::value;
  if (!src_gpu && !dst_gpu) throw nb::value_error("swap_blocks: src or dst must be on the GPU");
  if (src_gpu) check_cuda(src, "src", dev); else check_cpu(src, "src");
  if (dst_gpu) check_cuda(dst, "dst", dev); else check_cpu(dst, "dst");
  check_same_dtype(dst, "dst", src, "src");
  if (src.ndim() != dst.ndim())
    throw nb::value_error("src and dst must have the same rank");
  for (size_t i = 1; i < src.ndim(); ++i) check_dim(dst, "dst", i, src.shape(i), "src's shape");
  check_cpu(block_mapping, "block_mapping");
  check_block_mapping(block_mapping, "block_mapping");
  const int64_t block_bytes = block_bytes_of(src, "src");
  block_bytes_of(dst, "dst");
  const int64_t* m = static_cast<const int64_t*>(block_mapping.data());
  const int64_t num_pairs = block_mapping.shape(0);
  for (int64_t i = 0; i < num_pairs; ++i) {
    if (m[2 * i] < 0 || m[2 * i] >= (int64_t)src.shape(0) || m[2 * i + 1] < 0 ||
        m[2 * i + 1] >= (int64_t)dst.shape(0))
      throw nb::value_error(("block_mapping[" + std::to_string(i) + "] = (" +
                             std::to_string(m[2 * i]) + ", " + std::to_string(m[2 * i + 1]) +
                             ") is out of range for src/dst with " +
                             std::to_string(src.shape(0)) + "/" + std::to_string(dst.shape(0)) +
                             " blocks")
                                .c_str());
  }
  launch_without_gil("swap_blocks", [&] {
    return pagedd::cuda::swap_blocks(dst.data(), src.data(), block_bytes, m, num_pairs,
                                     as_stream(stream));
  });
}

}  // namespace

void bind_cuda_ops(nb::module_& m) {
  m.attr("partition_size") = pagedd::cuda::kPartitionSize;
  m.def("paged_attention_decode", &paged_attention_decode, nb::arg("out").noconvert(),
        nb::arg("query"), nb::arg("key_cache"), nb::arg("value_cache"), nb::arg("block_tables"),
        nb::arg("seq_lens"), nb::arg("scale"), nb::arg("max_seq_len"),
        nb::arg("tmp_out").none(), nb::arg("exp_sums").none(), nb::arg("max_logits").none(),
        nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("sliding_window"), nb::arg("softcap"),
        nb::arg("sinks").none(), nb::arg("stream"),
        "Paged decode attention (one query token per sequence), split-KV and GQA-aware.\n"
        "out, query: [num_seqs, num_q_heads, head_dim]; key_cache, value_cache: [num_blocks,\n"
        "num_kv_heads, block_size, head_dim]; block_tables: [num_seqs, max_blocks] int32;\n"
        "seq_lens: [num_seqs] int32 (each <= max_seq_len); tmp_out: [num_seqs, num_q_heads,\n"
        "num_partitions, head_dim] f32, exp_sums / max_logits: [num_seqs, num_q_heads,\n"
        "num_partitions] f32 (None when max_seq_len <= partition_size). An fp8 e4m3 cache\n"
        "is passed as uint8 storage and read as e4m3 * k_scale / v_scale. sliding_window:\n"
        "keys a query sees (0: all; num_partitions then covers min(max_seq_len, window));\n"
        "softcap: scores s -> softcap * tanh(s / softcap) (0: none); sinks: None or\n"
        "[num_q_heads] of the query's dtype, a logit per head in the softmax's denominator.");
  m.def("paged_attention_decode_tc", &paged_attention_decode_tc, nb::arg("out").noconvert(),
        nb::arg("query"), nb::arg("key_cache"), nb::arg("value_cache"), nb::arg("block_tables"),
        nb::arg("seq_lens"), nb::arg("scale"), nb::arg("max_seq_len"), nb::arg("partition_size"),
        nb::arg("tmp_out").none(), nb::arg("exp_sums").none(), nb::arg("max_logits").none(),
        nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("sliding_window"), nb::arg("softcap"),
        nb::arg("sinks").none(), nb::arg("stream"),
        "Paged decode attention on tensor cores for grouped query heads (<= 16 per kv head),\n"
        "split-KV with partition_size keys (a multiple of 64) per partition. Arguments as\n"
        "paged_attention_decode; num_partitions = ceil(max_seq_len / partition_size) (with a\n"
        "window: ceil(min(max_seq_len, window + 15) / partition_size)), and the workspaces\n"
        "are needed when it is > 1. head_dim 64, 80, 96, 128 or 256.");
  m.def("paged_attention_prefill", &paged_attention_prefill, nb::arg("out").noconvert(),
        nb::arg("query"), nb::arg("key_cache"), nb::arg("value_cache"), nb::arg("block_tables"),
        nb::arg("seq_lens"), nb::arg("query_start_loc"), nb::arg("scale"),
        nb::arg("max_query_len"), nb::arg("block_m"), nb::arg("block_n"), nb::arg("k_scale"),
        nb::arg("v_scale"), nb::arg("backend"), nb::arg("sliding_window"), nb::arg("softcap"),
        nb::arg("sinks").none(), nb::arg("stream"),
        "Causal paged attention of a packed batch of new tokens (prefill chunks and decodes),\n"
        "tensor cores, GQA-packed. out, query: [num_tokens, num_q_heads, head_dim]; key_cache,\n"
        "value_cache: [num_blocks, num_kv_heads, block_size, head_dim]; block_tables:\n"
        "[num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (context after the step);\n"
        "query_start_loc: [num_seqs + 1] int32; max_query_len: host int >= every query length;\n"
        "block_m, block_n: tile shape (tuning), 0 = default. An fp8 e4m3 cache is passed as\n"
        "uint8 storage and read as e4m3 * k_scale / v_scale. backend: 0 auto, 1 mma.sync,\n"
        "2 wgmma (sm_90a build on a compute capability 9.0 GPU, head_dim 64 / 128).\n"
        "sliding_window, softcap, sinks: as paged_attention_decode.");
  m.def("prefill_wgmma_unavailable_reason", &prefill_wgmma_unavailable_reason,
        nb::arg("head_dim"), nb::arg("fp8_cache"),
        "Why backend 'wgmma' cannot run this head size / cache on the current device, or ''.");
  m.def("reshape_and_cache", &reshape_and_cache, nb::arg("key"), nb::arg("value"),
        nb::arg("key_cache").noconvert(), nb::arg("value_cache").noconvert(),
        nb::arg("slot_mapping"), nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("stream"),
        "Scatter key/value [num_tokens, num_kv_heads, head_dim] into the caches through\n"
        "slot_mapping [num_tokens] int64 (negative slots are skipped). A uint8 cache is fp8\n"
        "e4m3 storage: it receives saturate(key / k_scale), saturate(value / v_scale).");
  m.def("copy_blocks", &copy_blocks, nb::arg("kv_cache").noconvert(), nb::arg("block_mapping"),
        nb::arg("stream"),
        "kv_cache[dst] = kv_cache[src] for each row of block_mapping [n, 2] int64 (on the\n"
        "GPU); kv_cache: [num_blocks, ...] contiguous. No dst may be another pair's src.");
  m.def("swap_blocks", &swap_blocks, nb::arg("src"), nb::arg("dst").noconvert(),
        nb::arg("block_mapping"), nb::arg("stream"),
        "dst[d] = src[s] for each (s, d) row of block_mapping [n, 2] int64 (on the CPU);\n"
        "src, dst: [num_blocks, ...] contiguous with equal block shapes, GPU <-> pinned CPU.");
}
