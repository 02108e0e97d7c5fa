// Validating binding of the batched LoRA kernels in cpp/cuda/layer_kernels.h (lora_shrink,
// lora_expand). Same conventions as layer_bindings.cpp: every tensor is checked (a bad one
// raises TypeError / ValueError naming it), written tensors are .noconvert(), the stream is
// passed in, the GIL is released around the launch. Nothing here reads a device value, so the
// calls can be captured in a CUDA graph.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "array_checks.h"
#include "layer_kernels.h"

namespace nb = nanobind;
using namespace pagedd::bindings;  // Array and the argument checks

namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
constexpr int64_t kMaxOutputs = 65535;  // lora_shrink's grid.y

void check_size(int64_t value, int64_t limit, const char* what) {
  if (value <= 0 || value > limit)
    throw nb::value_error((std::string(what) + " must be in [1, " + std::to_string(limit) +
                           "], got " + std::to_string(value))
                              .c_str());
}

// xa: [num_tokens, num_cols] float32, contiguous.
void check_xa(const Array& xa, int64_t num_tokens, int64_t num_cols, const char* what, int dev) {
  check_dtype(xa, "xa", kFloat, 32, "float32");
  check_cuda(xa, "xa", dev);
  check_ndim(xa, "xa", 2);
  check_dim(xa, "xa", 0, num_tokens, "num_tokens");
  check_dim(xa, "xa", 1, num_cols, what);
  check_contiguous_from(xa, "xa", 0);
}

// token_slots: [num_tokens] int64, contiguous.
void check_token_slots(const Array& token_slots, int64_t num_tokens, int dev) {
  check_dtype(token_slots, "token_slots", kInt, 64, "int64");
  check_cuda(token_slots, "token_slots", dev);
  check_ndim(token_slots, "token_slots", 1);
  check_dim(token_slots, "token_slots", 0, num_tokens, "num_tokens");
  check_contiguous_from(token_slots, "token_slots", 0);
}

// weights: [num_slots, rows, cols] of the activations' dtype, contiguous.
void check_slots_tensor(const Array& w, const char* name, const Array& ref, const char* ref_name,
                        int dev) {
  check_same_dtype(w, name, ref, ref_name);
  check_cuda(w, name, dev);
  check_ndim(w, name, 3);
  check_contiguous_from(w, name, 0);
  check_size((int64_t)w.shape(0), kMaxInt, (std::string(name) + ".shape[0] (slots)").c_str());
}

void lora_shrink(Array xa, Array x, Array lora_a, Array token_slots, uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = attention_dtype(x, "x");
  check_ndim(x, "x", 2);
  const int64_t num_tokens = x.shape(0), in_features = x.shape(1);
  if (num_tokens > kMaxInt) throw nb::value_error("at most 2^31 - 1 tokens per call");
  check_size(in_features, kMaxInt, "in_features (x.shape[1])");
  check_rows(x, "x", num_tokens, in_features, dev, true);
  check_slots_tensor(lora_a, "lora_a", x, "x", dev);
  check_dim(lora_a, "lora_a", 2, in_features, "in_features, x.shape[1]");
  const int64_t num_outputs = lora_a.shape(1);
  check_size(num_outputs, kMaxOutputs, "lora_a.shape[1] (num_parts * rank)");
  check_xa(xa, num_tokens, num_outputs, "lora_a.shape[1]", dev);
  check_token_slots(token_slots, num_tokens, dev);

  pagedd::cuda::LoRAShrinkParams p{};
  p.xa = static_cast<float*>(xa.data());
  p.x = x.data();
  p.lora_a = lora_a.data();
  p.token_slots = static_cast<const int64_t*>(token_slots.data());
  p.x_stride = x.stride(0);
  p.num_tokens = (int)num_tokens;
  p.num_outputs = (int)num_outputs;
  p.in_features = (int)in_features;
  p.num_slots = (int)lora_a.shape(0);
  p.dtype = dtype;
  launch_without_gil("lora_shrink", [&] {
    return pagedd::cuda::lora_shrink(p, as_stream(stream));
  });
}

void lora_expand(Array y, Array xa, Array lora_b, const std::vector<int64_t>& part_starts,
                 Array token_slots, uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = attention_dtype(y, "y");
  check_ndim(y, "y", 2);
  const int64_t num_tokens = y.shape(0), out_features = y.shape(1);
  if (num_tokens > kMaxInt) throw nb::value_error("at most 2^31 - 1 tokens per call");
  check_size(out_features, kMaxInt, "out_features (y.shape[1])");
  check_rows(y, "y", num_tokens, out_features, dev, true);
  check_slots_tensor(lora_b, "lora_b", y, "y", dev);
  check_dim(lora_b, "lora_b", 2, out_features, "out_features, y.shape[1]");
  const int64_t rank = lora_b.shape(1);
  check_size(rank, kMaxInt, "lora_b.shape[1] (rank)");

  const int64_t num_parts = (int64_t)part_starts.size() - 1;
  if (num_parts < 1 || num_parts > pagedd::cuda::kMaxLoRAParts)
    throw nb::value_error(("part_starts must hold num_parts + 1 column offsets, num_parts in [1, " +
                           std::to_string(pagedd::cuda::kMaxLoRAParts) + "], got " +
                           std::to_string(part_starts.size()) + " offsets")
                              .c_str());
  bool is_increasing = part_starts.front() == 0 && part_starts.back() == out_features;
  for (int64_t j = 0; j < num_parts; ++j)
    is_increasing = is_increasing && part_starts[j + 1] > part_starts[j];
  if (!is_increasing)
    throw nb::value_error(("part_starts must rise strictly from 0 to out_features (" +
                           std::to_string(out_features) + ")")
                              .c_str());
  check_xa(xa, num_tokens, num_parts * rank, "num_parts * rank", dev);
  check_token_slots(token_slots, num_tokens, dev);

  pagedd::cuda::LoRAExpandParams p{};
  p.y = y.data();
  p.xa = static_cast<const float*>(xa.data());
  p.lora_b = lora_b.data();
  p.token_slots = static_cast<const int64_t*>(token_slots.data());
  p.y_stride = y.stride(0);
  for (int64_t j = 0; j <= num_parts; ++j) p.part_starts[j] = (int)part_starts[j];
  p.num_parts = (int)num_parts;
  p.rank = (int)rank;
  p.num_tokens = (int)num_tokens;
  p.out_features = (int)out_features;
  p.num_slots = (int)lora_b.shape(0);
  p.dtype = dtype;
  launch_without_gil("lora_expand", [&] {
    return pagedd::cuda::lora_expand(p, as_stream(stream));
  });
}

}  // namespace

void bind_lora_ops(nb::module_& m) {
  m.def("lora_shrink", &lora_shrink, nb::arg("xa").noconvert(), nb::arg("x"),
        nb::arg("lora_a"), nb::arg("token_slots"), nb::arg("stream"),
        "xa[t, k] = sum_i x[t, i] * lora_a[token_slots[t], k, i] in float32; a slot outside\n"
        "[0, num_slots) (-1: no adapter) gives xa[t, :] = 0. xa: [num_tokens, num_outputs]\n"
        "float32; x: [num_tokens, in_features] float16 or bfloat16; lora_a: [num_slots,\n"
        "num_outputs, in_features] of x's dtype, contiguous; token_slots: [num_tokens] int64.");
  m.def("lora_expand", &lora_expand, nb::arg("y").noconvert(), nb::arg("xa"), nb::arg("lora_b"),
        nb::arg("part_starts"), nb::arg("token_slots"), nb::arg("stream"),
        "y[t, c] += sum_r xa[t, j * rank + r] * lora_b[token_slots[t], r, c] for the part j\n"
        "holding column c (float32 sums, one rounding); a slot outside [0, num_slots) leaves\n"
        "the row alone. y: [num_tokens, out_features] float16 or bfloat16; xa: [num_tokens,\n"
        "num_parts * rank] float32; lora_b: [num_slots, rank, out_features] of y's dtype,\n"
        "contiguous; part_starts: num_parts + 1 (<= 5) column offsets from 0 to out_features.");
}
