// Validating binding of the mixture-of-experts kernels in cpp/cuda/moe_kernels.h: top-k
// routing, moe_align, the weighted combine, the two decode kernels (bf16 / fp16 weights, and
// FP8 e4m3 weights with per-channel or block scales). Same conventions as
// layer_bindings.cpp: every tensor is checked (a bad one raises TypeError / ValueError naming
// it), written tensors are .noconvert(), the stream is passed in, the GIL is released around
// the launch. Expert ids are device data and are not read here (a host sync; the kernels
// give an id out of range no weights instead).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <limits>
#include <string>

#include "array_checks.h"
#include "moe_kernels.h"

namespace nb = nanobind;
using namespace pagedd::bindings;  // Array and the argument checks

namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

// a: a contiguous [rows, cols] tensor on the device (written by the kernel, or read densely).
void check_dense(const Array& a, const char* name, int64_t rows, int64_t cols, int dev) {
  check_cuda(a, name, dev);
  check_ndim(a, name, 2);
  check_dim(a, name, 0, rows, "num_tokens");
  check_dim(a, name, 1, cols, "top_k");
  check_contiguous_from(a, name, 0);
}

void check_vector(const Array& a, const char* name, int64_t size, const char* what, int dev) {
  check_cuda(a, name, dev);
  check_dtype(a, name, kInt, 32, "int32");
  check_ndim(a, name, 1);
  check_dim(a, name, 0, size, what);
  check_contiguous_from(a, name, 0);
}

void check_top_k(int64_t top_k, int64_t num_experts) {
  if (num_experts < 1 || num_experts > pagedd::cuda::kMoeMaxExperts)
    throw nb::value_error(("num_experts must be in [1, " +
                           std::to_string(pagedd::cuda::kMoeMaxExperts) + "], got " +
                           std::to_string(num_experts))
                              .c_str());
  if (top_k < 1 || top_k > pagedd::cuda::kMoeMaxTopK || top_k > num_experts)
    throw nb::value_error(("top_k must be in [1, min(num_experts, " +
                           std::to_string(pagedd::cuda::kMoeMaxTopK) + ")], got " +
                           std::to_string(top_k))
                              .c_str());
}

void topk_route(Array topk_weights, Array topk_ids, Array logits, bool softmax,
                bool renormalize, uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = float_dtype(logits, "logits");
  check_cuda(logits, "logits", dev);
  check_ndim(logits, "logits", 2);
  const int64_t num_tokens = logits.shape(0), num_experts = logits.shape(1);
  if (num_experts > 1 && logits.stride(1) != 1)
    throw nb::value_error("logits' last dim must be contiguous");
  if (num_tokens > kMaxInt) throw nb::value_error("at most 2^31 - 1 tokens per call");
  check_ndim(topk_ids, "topk_ids", 2);
  const int64_t top_k = topk_ids.shape(1);
  check_top_k(top_k, num_experts);
  check_dtype(topk_weights, "topk_weights", kFloat, 32, "float32");
  check_dtype(topk_ids, "topk_ids", kInt, 32, "int32");
  check_dense(topk_weights, "topk_weights", num_tokens, top_k, dev);
  check_dense(topk_ids, "topk_ids", num_tokens, top_k, dev);

  pagedd::cuda::TopkRouteParams p{};
  p.topk_weights = static_cast<float*>(topk_weights.data());
  p.topk_ids = static_cast<int32_t*>(topk_ids.data());
  p.logits = logits.data();
  p.logits_stride = logits.stride(0);
  p.num_tokens = (int)num_tokens;
  p.num_experts = (int)num_experts;
  p.top_k = (int)top_k;
  p.softmax = softmax;
  p.renormalize = renormalize;
  p.dtype = dtype;
  launch_without_gil("topk_route", [&] { return pagedd::cuda::topk_route(p, as_stream(stream)); });
}

void moe_align(Array sorted_token_ids, Array inverse, Array expert_offsets, Array topk_ids,
               uintptr_t stream) {
  const int dev = current_device();
  check_dtype(topk_ids, "topk_ids", kInt, 32, "int32");
  check_cuda(topk_ids, "topk_ids", dev);
  check_ndim(topk_ids, "topk_ids", 2);
  const int64_t num_tokens = topk_ids.shape(0), top_k = topk_ids.shape(1);
  const int64_t num_experts = expert_offsets.ndim() == 1 ? expert_offsets.shape(0) : 0;
  check_top_k(top_k, num_experts);
  check_contiguous_from(topk_ids, "topk_ids", 0);
  if (num_tokens * top_k > kMaxInt) throw nb::value_error("at most 2^31 - 1 slots per call");
  const int64_t num_slots = num_tokens * top_k;
  check_vector(sorted_token_ids, "sorted_token_ids", num_slots, "num_tokens * top_k", dev);
  check_vector(inverse, "inverse", num_slots, "num_tokens * top_k", dev);
  check_vector(expert_offsets, "expert_offsets", num_experts, "num_experts", dev);

  pagedd::cuda::MoeAlignParams p{};
  p.sorted_token_ids = static_cast<int32_t*>(sorted_token_ids.data());
  p.inverse = static_cast<int32_t*>(inverse.data());
  p.expert_offsets = static_cast<int32_t*>(expert_offsets.data());
  p.topk_ids = static_cast<const int32_t*>(topk_ids.data());
  p.num_tokens = (int)num_tokens;
  p.top_k = (int)top_k;
  p.num_experts = (int)num_experts;
  launch_without_gil("moe_align", [&] { return pagedd::cuda::moe_align(p, as_stream(stream)); });
}

void moe_combine(Array out, Array expert_out, Array inverse, Array topk_weights,
                 uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = float_dtype(expert_out, "expert_out");
  check_same_dtype(out, "out", expert_out, "expert_out");
  check_dtype(topk_weights, "topk_weights", kFloat, 32, "float32");
  check_cuda(topk_weights, "topk_weights", dev);
  check_ndim(topk_weights, "topk_weights", 2);
  const int64_t num_tokens = topk_weights.shape(0), top_k = topk_weights.shape(1);
  check_dense(topk_weights, "topk_weights", num_tokens, top_k, dev);
  if (top_k < 1 || num_tokens * top_k > kMaxInt)
    throw nb::value_error("topk_weights must be [num_tokens, top_k], top_k >= 1, < 2^31 slots");
  for (const Array* a : {&out, &expert_out}) {
    const char* name = a == &out ? "out" : "expert_out";
    check_cuda(*a, name, dev);
    check_ndim(*a, name, 2);
  }
  const int64_t hidden = out.shape(1);
  if (hidden < 1 || hidden > kMaxInt) throw nb::value_error("hidden size must be in [1, 2^31)");
  check_dim(out, "out", 0, num_tokens, "num_tokens");
  check_dim(expert_out, "expert_out", 0, num_tokens * top_k, "num_tokens * top_k");
  check_dim(expert_out, "expert_out", 1, hidden, "hidden size");
  for (const Array* a : {&out, &expert_out}) {
    const char* name = a == &out ? "out" : "expert_out";
    if (hidden > 1 && a->stride(1) != 1)
      throw nb::value_error((std::string(name) + "'s last dim must be contiguous").c_str());
  }
  if (num_tokens > 1 && out.stride(0) < hidden) throw nb::value_error("out's rows overlap");
  check_vector(inverse, "inverse", num_tokens * top_k, "num_tokens * top_k", dev);

  pagedd::cuda::MoeCombineParams p{};
  p.out = out.data();
  p.expert_out = expert_out.data();
  p.inverse = static_cast<const int32_t*>(inverse.data());
  p.topk_weights = static_cast<const float*>(topk_weights.data());
  p.out_stride = out.stride(0);
  p.expert_out_stride = expert_out.stride(0);
  p.num_tokens = (int)num_tokens;
  p.top_k = (int)top_k;
  p.hidden = (int)hidden;
  p.dtype = dtype;
  launch_without_gil("moe_combine", [&] {
    return pagedd::cuda::moe_combine(p, as_stream(stream));
  });
}

// topk_ids [num_tokens, top_k] int32 contiguous on the device; returns top_k.
int64_t check_topk_ids(const Array& topk_ids, int64_t num_tokens, int64_t num_experts, int dev) {
  check_dtype(topk_ids, "topk_ids", kInt, 32, "int32");
  check_cuda(topk_ids, "topk_ids", dev);
  check_ndim(topk_ids, "topk_ids", 2);
  const int64_t top_k = topk_ids.shape(1);
  check_top_k(top_k, num_experts);
  check_dense(topk_ids, "topk_ids", num_tokens, top_k, dev);
  return top_k;
}

// An expert weight tensor [num_experts, rows, cols] of dtype `like`, contiguous, on the device.
void check_expert_weights(const Array& w, const char* name, const Array& like,
                          const char* like_name, int dev) {
  check_same_dtype(w, name, like, like_name);
  check_cuda(w, name, dev);
  check_ndim(w, name, 3);
  check_contiguous_from(w, name, 0);
  if (w.shape(0) < 1 || w.shape(1) < 1 || w.shape(2) < 1 || w.shape(1) > kMaxInt ||
      w.shape(2) > kMaxInt)
    throw nb::value_error((std::string(name) + " must have sizes in [1, 2^31)").c_str());
}

// act: the [num_slots, intermediate] activations between the two decode kernels, contiguous.
void check_act(const Array& act, int64_t num_slots, int64_t intermediate, const char* what,
               int dev) {
  check_cuda(act, "act", dev);
  check_ndim(act, "act", 2);
  check_dim(act, "act", 0, num_slots, "num_tokens * top_k");
  check_dim(act, "act", 1, intermediate, what);
  check_contiguous_from(act, "act", 0);
}

void moe_decode_gate_up(Array act, Array x, Array topk_ids, Array w13, uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = attention_dtype(x, "x");
  check_cuda(x, "x", dev);
  check_ndim(x, "x", 2);
  check_same_dtype(act, "act", x, "x");
  check_expert_weights(w13, "w13", x, "x", dev);
  const int64_t num_tokens = x.shape(0), hidden = x.shape(1);
  const int64_t num_experts = w13.shape(0), intermediate = w13.shape(1) / 2;
  if (w13.shape(1) % 2 != 0)
    throw nb::value_error("w13.shape[1] must be even (gate rows, then as many up rows)");
  check_dim(w13, "w13", 2, hidden, "hidden size, x.shape[1]");
  if (hidden > pagedd::cuda::kMoeDecodeMaxHidden)
    throw nb::value_error(("moe_decode_gate_up takes a hidden size of at most " +
                           std::to_string(pagedd::cuda::kMoeDecodeMaxHidden) + ", got " +
                           std::to_string(hidden))
                              .c_str());
  check_rows(x, "x", num_tokens, hidden, dev, false, "hidden size");
  const int64_t top_k = check_topk_ids(topk_ids, num_tokens, num_experts, dev);
  if (num_tokens * top_k > pagedd::cuda::kMoeDecodeMaxRows)
    throw nb::value_error(("moe_decode_gate_up takes at most " +
                           std::to_string(pagedd::cuda::kMoeDecodeMaxRows) +
                           " slots (num_tokens * top_k), got " + std::to_string(num_tokens * top_k))
                              .c_str());
  check_act(act, num_tokens * top_k, intermediate, "intermediate size, w13.shape[1] / 2", dev);

  pagedd::cuda::MoeDecodeGateUpParams p{};
  p.act = act.data();
  p.x = x.data();
  p.topk_ids = static_cast<const int32_t*>(topk_ids.data());
  p.w13 = w13.data();
  p.x_stride = num_tokens > 1 ? x.stride(0) : hidden;
  p.num_tokens = (int)num_tokens;
  p.top_k = (int)top_k;
  p.num_experts = (int)num_experts;
  p.hidden = (int)hidden;
  p.intermediate = (int)intermediate;
  p.dtype = dtype;
  launch_without_gil("moe_decode_gate_up", [&] {
    return pagedd::cuda::moe_decode_gate_up(p, as_stream(stream));
  });
}

void moe_decode_down_combine(Array out, Array act, Array topk_ids, Array topk_weights, Array w2,
                             uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = attention_dtype(act, "act");
  check_same_dtype(out, "out", act, "act");
  check_expert_weights(w2, "w2", act, "act", dev);
  const int64_t num_experts = w2.shape(0), hidden = w2.shape(1), intermediate = w2.shape(2);
  check_cuda(topk_weights, "topk_weights", dev);
  check_dtype(topk_weights, "topk_weights", kFloat, 32, "float32");
  check_ndim(topk_weights, "topk_weights", 2);
  const int64_t num_tokens = topk_weights.shape(0);
  if (num_tokens > pagedd::cuda::kMoeDecodeMaxRows)
    throw nb::value_error(("moe_decode_down_combine takes at most " +
                           std::to_string(pagedd::cuda::kMoeDecodeMaxRows) + " tokens, got " +
                           std::to_string(num_tokens))
                              .c_str());
  const int64_t top_k = check_topk_ids(topk_ids, num_tokens, num_experts, dev);
  check_dense(topk_weights, "topk_weights", num_tokens, top_k, dev);
  check_act(act, num_tokens * top_k, intermediate, "intermediate size, w2.shape[2]", dev);
  check_rows(out, "out", num_tokens, hidden, dev, true, "hidden size, w2.shape[1]");

  pagedd::cuda::MoeDecodeDownParams p{};
  p.out = out.data();
  p.act = act.data();
  p.topk_ids = static_cast<const int32_t*>(topk_ids.data());
  p.topk_weights = static_cast<const float*>(topk_weights.data());
  p.w2 = w2.data();
  p.out_stride = num_tokens > 1 ? out.stride(0) : hidden;
  p.num_tokens = (int)num_tokens;
  p.top_k = (int)top_k;
  p.num_experts = (int)num_experts;
  p.hidden = (int)hidden;
  p.intermediate = (int)intermediate;
  p.dtype = dtype;
  launch_without_gil("moe_decode_down_combine", [&] {
    return pagedd::cuda::moe_decode_down_combine(p, as_stream(stream));
  });
}

// FP8 expert weights [num_experts, rows, cols] as uint8 (e4m3 bytes), contiguous, on the device,
// and their float32 scales: [num_experts, rows] (block_n = block_k = 0) or [num_experts,
// ceil(rows / block_n), ceil(cols / block_k)]. Returns the kernels' scale description.
pagedd::cuda::MoeDecodeFp8Scales check_fp8_experts(const Array& w, const char* name,
                                                   const Array& scale, int64_t block_n,
                                                   int64_t block_k, int dev) {
  check_dtype(w, name, kUInt, 8, "uint8 (float8_e4m3fn bytes)");
  check_cuda(w, name, dev);
  check_ndim(w, name, 3);
  check_contiguous_from(w, name, 0);
  if (w.shape(0) < 1 || w.shape(1) < 1 || w.shape(2) < 1 || w.shape(1) > kMaxInt ||
      w.shape(2) > kMaxInt || w.shape(1) % 16 || w.shape(2) % 16)
    throw nb::value_error((std::string(name) + " must have sizes in [1, 2^31), its last two "
                                               "multiples of 16")
                              .c_str());
  const std::string sname = std::string(name) + "_scale";
  check_dtype(scale, sname.c_str(), kFloat, 32, "float32");
  check_cuda(scale, sname.c_str(), dev);
  check_contiguous_from(scale, sname.c_str(), 0);
  const int64_t e = w.shape(0), rows = w.shape(1), cols = w.shape(2);
  if ((block_n == 0) != (block_k == 0) || block_n < 0 || block_k < 0 || block_k % 16 ||
      block_n > kMaxInt || block_k > kMaxInt)
    throw nb::value_error("block_n and block_k: both 0 (per-channel scales) or both positive, "
                          "block_k a multiple of 16");
  if (block_n == 0) {
    check_ndim(scale, sname.c_str(), 2);
    check_dim(scale, sname.c_str(), 0, e, "num_experts");
    check_dim(scale, sname.c_str(), 1, rows, "the weight's rows");
  } else {
    check_ndim(scale, sname.c_str(), 3);
    check_dim(scale, sname.c_str(), 0, e, "num_experts");
    check_dim(scale, sname.c_str(), 1, (rows + block_n - 1) / block_n, "row blocks");
    check_dim(scale, sname.c_str(), 2, (cols + block_k - 1) / block_k, "column blocks");
  }
  pagedd::cuda::MoeDecodeFp8Scales s;
  s.w_scale = static_cast<const float*>(scale.data());
  s.block_n = (int)block_n;
  s.block_k = (int)block_k;
  return s;
}

void moe_decode_gate_up_fp8(Array act, Array x, Array topk_ids, Array w13, Array w13_scale,
                            int64_t block_n, int64_t block_k, uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = attention_dtype(x, "x");
  check_cuda(x, "x", dev);
  check_ndim(x, "x", 2);
  check_same_dtype(act, "act", x, "x");
  const auto scales = check_fp8_experts(w13, "w13", w13_scale, block_n, block_k, dev);
  const int64_t num_tokens = x.shape(0), hidden = x.shape(1);
  const int64_t num_experts = w13.shape(0), intermediate = w13.shape(1) / 2;
  if (intermediate % 16)
    throw nb::value_error("w13.shape[1] must be twice a multiple of 16 (gate rows, then up rows)");
  check_dim(w13, "w13", 2, hidden, "hidden size, x.shape[1]");
  if (hidden > pagedd::cuda::kMoeDecodeMaxHidden)
    throw nb::value_error(("moe_decode_gate_up_fp8 takes a hidden size of at most " +
                           std::to_string(pagedd::cuda::kMoeDecodeMaxHidden))
                              .c_str());
  check_rows(x, "x", num_tokens, hidden, dev, false, "hidden size");
  if (num_tokens > 1 && x.stride(0) % 8)
    throw nb::value_error("x's row stride must be a multiple of 8 elements (16-byte rows)");
  const int64_t top_k = check_topk_ids(topk_ids, num_tokens, num_experts, dev);
  if (num_tokens * top_k > pagedd::cuda::kMoeDecodeMaxRows)
    throw nb::value_error("moe_decode_gate_up_fp8: too many slots (num_tokens * top_k)");
  check_act(act, num_tokens * top_k, intermediate, "intermediate size, w13.shape[1] / 2", dev);

  pagedd::cuda::MoeDecodeGateUpParams p{};
  p.act = act.data();
  p.x = x.data();
  p.topk_ids = static_cast<const int32_t*>(topk_ids.data());
  p.w13 = w13.data();
  p.x_stride = num_tokens > 1 ? x.stride(0) : hidden;
  p.num_tokens = (int)num_tokens;
  p.top_k = (int)top_k;
  p.num_experts = (int)num_experts;
  p.hidden = (int)hidden;
  p.intermediate = (int)intermediate;
  p.dtype = dtype;
  launch_without_gil("moe_decode_gate_up_fp8", [&] {
    return pagedd::cuda::moe_decode_gate_up_fp8(p, scales, as_stream(stream));
  });
}

void moe_decode_down_combine_fp8(Array out, Array act, Array topk_ids, Array topk_weights,
                                 Array w2, Array w2_scale, int64_t block_n, int64_t block_k,
                                 uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = attention_dtype(act, "act");
  check_same_dtype(out, "out", act, "act");
  const auto scales = check_fp8_experts(w2, "w2", w2_scale, block_n, block_k, dev);
  const int64_t num_experts = w2.shape(0), hidden = w2.shape(1), intermediate = w2.shape(2);
  check_cuda(topk_weights, "topk_weights", dev);
  check_dtype(topk_weights, "topk_weights", kFloat, 32, "float32");
  check_ndim(topk_weights, "topk_weights", 2);
  const int64_t num_tokens = topk_weights.shape(0);
  if (num_tokens > pagedd::cuda::kMoeDecodeMaxRows)
    throw nb::value_error("moe_decode_down_combine_fp8: too many tokens");
  const int64_t top_k = check_topk_ids(topk_ids, num_tokens, num_experts, dev);
  check_dense(topk_weights, "topk_weights", num_tokens, top_k, dev);
  check_act(act, num_tokens * top_k, intermediate, "intermediate size, w2.shape[2]", dev);
  check_rows(out, "out", num_tokens, hidden, dev, true, "hidden size, w2.shape[1]");

  pagedd::cuda::MoeDecodeDownParams p{};
  p.out = out.data();
  p.act = act.data();
  p.topk_ids = static_cast<const int32_t*>(topk_ids.data());
  p.topk_weights = static_cast<const float*>(topk_weights.data());
  p.w2 = w2.data();
  p.out_stride = num_tokens > 1 ? out.stride(0) : hidden;
  p.num_tokens = (int)num_tokens;
  p.top_k = (int)top_k;
  p.num_experts = (int)num_experts;
  p.hidden = (int)hidden;
  p.intermediate = (int)intermediate;
  p.dtype = dtype;
  launch_without_gil("moe_decode_down_combine_fp8", [&] {
    return pagedd::cuda::moe_decode_down_combine_fp8(p, scales, as_stream(stream));
  });
}

}  // namespace

void bind_moe_ops(nb::module_& m) {
  m.def("topk_route", &topk_route, nb::arg("topk_weights").noconvert(),
        nb::arg("topk_ids").noconvert(), nb::arg("logits"), nb::arg("softmax"),
        nb::arg("renormalize"), nb::arg("stream"),
        "Top-k experts per token of logits [num_tokens, num_experts] (float16, bfloat16 or\n"
        "float32): topk_ids [num_tokens, top_k] int32 (ties to the lower id), topk_weights\n"
        "[num_tokens, top_k] float32 (softmax or sigmoid scores, renormalised if asked).");
  m.def("moe_align", &moe_align, nb::arg("sorted_token_ids").noconvert(),
        nb::arg("inverse").noconvert(), nb::arg("expert_offsets").noconvert(),
        nb::arg("topk_ids"), nb::arg("stream"),
        "Groups the num_tokens * top_k slots of topk_ids [num_tokens, top_k] int32 by expert:\n"
        "sorted_token_ids and inverse [num_tokens * top_k] int32, expert_offsets [num_experts]\n"
        "int32 (cumulative ends).");
  m.def("moe_combine", &moe_combine, nb::arg("out").noconvert(), nb::arg("expert_out"),
        nb::arg("inverse"), nb::arg("topk_weights"), nb::arg("stream"),
        "out[t] = sum_j topk_weights[t, j] * expert_out[inverse[t * top_k + j]] (float32 sum).\n"
        "out [num_tokens, hidden], expert_out [num_tokens * top_k, hidden]: one dtype.");
  m.def("moe_decode_gate_up", &moe_decode_gate_up, nb::arg("act").noconvert(), nb::arg("x"),
        nb::arg("topk_ids"), nb::arg("w13"), nb::arg("stream"),
        "Decode experts, first half: act [num_tokens * top_k, I] = silu(x @ w13[e, :I].T) *\n"
        "(x @ w13[e, I:].T) per slot t * top_k + j, e = topk_ids[t, j] (int32). x [num_tokens,\n"
        "H], w13 [E, 2 * I, H]: float16 or bfloat16, one dtype.");
  m.def("moe_decode_down_combine", &moe_decode_down_combine, nb::arg("out").noconvert(),
        nb::arg("act"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w2"),
        nb::arg("stream"),
        "Decode experts, second half: out[t] = sum_j topk_weights[t, j] * (act[t * top_k + j] @\n"
        "w2[topk_ids[t, j]].T) (float32 sum). out [num_tokens, H], act [num_tokens * top_k, I],\n"
        "w2 [E, H, I]: one dtype (float16 or bfloat16); topk_weights float32.");
  m.def("moe_decode_gate_up_fp8", &moe_decode_gate_up_fp8, nb::arg("act").noconvert(),
        nb::arg("x"), nb::arg("topk_ids"), nb::arg("w13"), nb::arg("w13_scale"),
        nb::arg("block_n"), nb::arg("block_k"), nb::arg("stream"),
        "moe_decode_gate_up with FP8 weights: w13 [E, 2 * I, H] float8_e4m3fn bytes (uint8),\n"
        "w13_scale float32 [E, 2 * I] (block_n = block_k = 0) or [E, ceil(2 * I / block_n),\n"
        "ceil(H / block_k)]; x and act float16 or bfloat16.");
  m.def("moe_decode_down_combine_fp8", &moe_decode_down_combine_fp8, nb::arg("out").noconvert(),
        nb::arg("act"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w2"),
        nb::arg("w2_scale"), nb::arg("block_n"), nb::arg("block_k"), nb::arg("stream"),
        "moe_decode_down_combine with FP8 weights: w2 [E, H, I] float8_e4m3fn bytes (uint8),\n"
        "w2_scale float32 [E, H] or [E, ceil(H / block_n), ceil(I / block_k)].");
}
