// Validating binding of the per-token layer kernels in cpp/cuda/layer_kernels.h: RMSNorm,
// residual-add + RMSNorm, SiLU-and-multiply, rotary embedding (alone or fused with the KV-cache
// write), per-token FP8 quantization.
// Same conventions as cuda_bindings.cpp: every tensor is checked (a bad one raises TypeError /
// ValueError naming it), written tensors are .noconvert(), the stream is passed in, the GIL is
// released around the launch.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "array_checks.h"
#include "layer_kernels.h"

namespace nb = nanobind;
using namespace pagedd::bindings;  // Array and the argument checks

namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

void check_sizes(int64_t num_tokens, int64_t row_length, const char* what) {
  if (row_length <= 0 || row_length > kMaxInt)
    throw nb::value_error(
        (std::string(what) + " must be in [1, 2^31), got " + std::to_string(row_length)).c_str());
  if (num_tokens > kMaxInt) throw nb::value_error("at most 2^31 - 1 tokens per call");
}

// FP8 outputs of a kernel that quantizes its rows per token: out [num_tokens, d] uint8 (a
// float8_e4m3fn tensor's bytes), scale [num_tokens] float32.
void check_fp8_out(const Array& out, const Array& scale, int64_t num_tokens, int64_t d, int dev) {
  check_dtype(out, "out", nb::dlpack::dtype_code::UInt, 8,
              "uint8 (a float8_e4m3fn tensor's bytes)");
  check_dtype(scale, "scale", kFloat, 32, "float32");
  check_rows(out, "out", num_tokens, d, dev, true);
  check_cuda(scale, "scale", dev);
  check_ndim(scale, "scale", 1);
  check_dim(scale, "scale", 0, num_tokens, "num_tokens");
  if (num_tokens > 1 && scale.stride(0) != 1) throw nb::value_error("scale must be contiguous");
}

// scale == nullptr: out has input's dtype; otherwise out holds e4m3 codes, scale the rows' scales.
void run_rms_norm(Array& out, Array* scale, const Array& input, Array* residual,
                  const Array& weight, double eps, bool round_once, double weight_offset,
                  uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = float_dtype(input, "input");
  if (scale == nullptr) check_same_dtype(out, "out", input, "input");
  check_same_dtype(weight, "weight", input, "input");
  check_ndim(input, "input", 2);
  const int64_t num_tokens = input.shape(0), hidden_size = input.shape(1);
  check_sizes(num_tokens, hidden_size, "hidden_size (input.shape[1])");
  check_rows(input, "input", num_tokens, hidden_size, dev, false);
  if (scale == nullptr)
    check_rows(out, "out", num_tokens, hidden_size, dev, true);
  else
    check_fp8_out(out, *scale, num_tokens, hidden_size, dev);
  check_cuda(weight, "weight", dev);
  check_ndim(weight, "weight", 1);
  check_dim(weight, "weight", 0, hidden_size, "hidden_size");
  if (hidden_size > 1 && weight.stride(0) != 1)
    throw nb::value_error("weight must be contiguous");
  if (!std::isfinite(eps) || eps < 0.0)
    throw nb::value_error(("eps must be finite and >= 0, got " + std::to_string(eps)).c_str());
  if (!std::isfinite(weight_offset) || (weight_offset != 0.0 && !round_once))
    throw nb::value_error(("weight_offset must be finite, and 0 unless round_once, got " +
                           std::to_string(weight_offset))
                              .c_str());

  pagedd::cuda::RMSNormParams p{};
  p.round_once = round_once;
  p.weight_offset = (float)weight_offset;
  if (residual != nullptr) {
    check_same_dtype(*residual, "residual", input, "input");
    check_rows(*residual, "residual", num_tokens, hidden_size, dev, true);
    if (residual->data() == out.data() || residual->data() == input.data())
      throw nb::value_error("residual must be a tensor of its own (not input or out)");
    p.residual = residual->data();
    p.residual_stride = residual->stride(0);
  }
  if (scale != nullptr) {
    p.out_fp8 = out.data();
    p.out_scale = static_cast<float*>(scale->data());
  } else {
    p.out = out.data();
  }
  p.input = input.data();
  p.weight = weight.data();
  p.out_stride = out.stride(0);
  p.input_stride = input.stride(0);
  p.num_tokens = (int)num_tokens;
  p.hidden_size = (int)hidden_size;
  p.eps = (float)eps;
  p.dtype = dtype;
  cudaError_t err;
  {
    nb::gil_scoped_release release;
    err = pagedd::cuda::rms_norm(p, as_stream(stream));
  }
  const char* what[2][2] = {{"rms_norm", "fused_add_rms_norm"},
                            {"rms_norm_fp8", "fused_add_rms_norm_fp8"}};
  check_cuda_error(err, what[scale != nullptr][residual != nullptr]);
}

void rms_norm(Array out, Array input, Array weight, double eps, uintptr_t stream,
              bool round_once, double weight_offset) {
  run_rms_norm(out, nullptr, input, nullptr, weight, eps, round_once, weight_offset, stream);
}

void fused_add_rms_norm(Array out, Array input, Array residual, Array weight, double eps,
                        uintptr_t stream, bool round_once, double weight_offset) {
  run_rms_norm(out, nullptr, input, &residual, weight, eps, round_once, weight_offset, stream);
}

void rms_norm_fp8(Array out, Array scale, Array input, Array weight, double eps,
                  uintptr_t stream, bool round_once, double weight_offset) {
  run_rms_norm(out, &scale, input, nullptr, weight, eps, round_once, weight_offset, stream);
}

void fused_add_rms_norm_fp8(Array out, Array scale, Array input, Array residual, Array weight,
                            double eps, uintptr_t stream, bool round_once,
                            double weight_offset) {
  run_rms_norm(out, &scale, input, &residual, weight, eps, round_once, weight_offset, stream);
}

void run_silu_and_mul(Array& out, Array* scale, const Array& input, int activation,
                      double alpha, double limit, uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = float_dtype(input, "input");
  if (scale == nullptr) check_same_dtype(out, "out", input, "input");
  check_ndim(input, "input", 2);
  const int64_t num_tokens = input.shape(0), width = input.shape(1);
  if (width % 2 != 0)
    throw nb::value_error(
        ("input.shape[1] must be even (gate and up halves), got " + std::to_string(width))
            .c_str());
  const int64_t d = width / 2;
  check_sizes(num_tokens, d, "d (input.shape[1] / 2)");
  check_rows(input, "input", num_tokens, width, dev, false);
  if (scale == nullptr)
    check_rows(out, "out", num_tokens, d, dev, true);
  else
    check_fp8_out(out, *scale, num_tokens, d, dev);
  if (out.data() == input.data())
    throw nb::value_error("out must not be input (the kernel reads input while writing out)");
  if (activation < 0 || activation > 2)
    throw nb::value_error(("activation must be 0 (silu), 1 (gelu_tanh) or 2 (swigluoai), got " +
                           std::to_string(activation))
                              .c_str());
  if (!(alpha > 0.0) || !(limit > 0.0) || !std::isfinite(alpha) || !std::isfinite(limit))
    throw nb::value_error("alpha and limit must be finite and > 0");

  pagedd::cuda::SiluAndMulParams p{};
  p.activation = static_cast<pagedd::cuda::GatedActivation>(activation);
  p.alpha = (float)alpha;
  p.limit = (float)limit;
  if (scale != nullptr) {
    p.out_fp8 = out.data();
    p.out_scale = static_cast<float*>(scale->data());
  } else {
    p.out = out.data();
  }
  p.input = input.data();
  p.out_stride = out.stride(0);
  p.input_stride = input.stride(0);
  p.num_tokens = (int)num_tokens;
  p.d = (int)d;
  p.dtype = dtype;
  cudaError_t err;
  {
    nb::gil_scoped_release release;
    err = pagedd::cuda::silu_and_mul(p, as_stream(stream));
  }
  check_cuda_error(err, scale != nullptr ? "silu_and_mul_fp8" : "silu_and_mul");
}

void silu_and_mul(Array out, Array input, uintptr_t stream, int activation, double alpha,
                  double limit) {
  run_silu_and_mul(out, nullptr, input, activation, alpha, limit, stream);
}

void silu_and_mul_fp8(Array out, Array scale, Array input, uintptr_t stream, int activation,
                      double alpha, double limit) {
  run_silu_and_mul(out, &scale, input, activation, alpha, limit, stream);
}

// a: [num_tokens, heads, head_dim] on the device, last dim contiguous, heads not overlapping.
void check_heads(const Array& a, const char* name, int64_t num_tokens, int64_t head_dim,
                 int dev) {
  check_cuda(a, name, dev);
  check_ndim(a, name, 3);
  check_dim(a, name, 0, num_tokens, "num_tokens");
  check_dim(a, name, 2, head_dim, "head_dim");
  if (head_dim > 1 && a.stride(2) != 1)
    throw nb::value_error((std::string(name) + "'s last dim must be contiguous").c_str());
  if (a.shape(1) > 1 && a.stride(1) < head_dim)
    throw nb::value_error((std::string(name) + "'s heads overlap").c_str());
}

// The rotary arguments checked: query [num_tokens, num_heads, head_dim] and key
// [num_tokens, num_kv_heads, head_dim] of one dtype, cos / sin [num_tokens, rotary_dim]
// float32 (rotary_dim even, <= head_dim: a partial rotary embedding below head_dim).
pagedd::cuda::RotaryParams rotary_params(const Array& query, const Array& key, const Array& cos,
                                         const Array& sin, int dev) {
  const DType dtype = float_dtype(query, "query");
  check_same_dtype(key, "key", query, "query");
  check_ndim(query, "query", 3);
  const int64_t num_tokens = query.shape(0), head_dim = query.shape(2);
  if (head_dim % 2 != 0)
    throw nb::value_error(("head_dim must be even, got " + std::to_string(head_dim)).c_str());
  check_sizes(num_tokens, head_dim, "head_dim (query.shape[2])");
  check_heads(query, "query", num_tokens, head_dim, dev);
  check_heads(key, "key", num_tokens, head_dim, dev);
  if (query.shape(1) + key.shape(1) > kMaxInt) throw nb::value_error("too many heads");
  check_ndim(cos, "cos", 2);
  const int64_t rotary_dim = cos.shape(1);
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    throw nb::value_error(("cos.shape[1] (rotary_dim) must be even, >= 2 and <= head_dim (" +
                           std::to_string(head_dim) + "), got " + std::to_string(rotary_dim))
                              .c_str());
  for (const Array* a : {&cos, &sin}) {
    const char* name = a == &cos ? "cos" : "sin";
    if (!is_dtype(*a, kFloat, 32))
      throw nb::type_error((std::string(name) + " must be float32, got " +
                            dtype_name(a->dtype())).c_str());
    check_rows(*a, name, num_tokens, rotary_dim, dev, false, "rotary_dim");
  }
  if (num_tokens > 1 && cos.stride(0) != sin.stride(0))
    throw nb::value_error("cos and sin must have the same row stride");

  pagedd::cuda::RotaryParams p{};
  p.query = query.data();
  p.key = key.data();
  p.cos = static_cast<const float*>(cos.data());
  p.sin = static_cast<const float*>(sin.data());
  p.query_token_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.cos_sin_stride = cos.stride(0);
  p.num_tokens = (int)num_tokens;
  p.num_heads = (int)query.shape(1);
  p.num_kv_heads = (int)key.shape(1);
  p.head_dim = (int)head_dim;
  p.dtype = dtype;
  p.rotary_dim = (int)rotary_dim;
  return p;
}

void rotary_embedding(Array query, Array key, const Array& cos, const Array& sin,
                      uintptr_t stream) {
  const pagedd::cuda::RotaryParams p = rotary_params(query, key, cos, sin, current_device());
  launch_without_gil("rotary_embedding", [&] {
    return pagedd::cuda::rotary_embedding(p, as_stream(stream));
  });
}

// The checks of rotary_embedding and of reshape_and_cache (cuda_bindings.cpp) together.
void rotary_embedding_and_cache(Array query, Array key, const Array& value, Array key_cache,
                                Array value_cache, Array slot_mapping, const Array& cos,
                                const Array& sin, double k_scale, double v_scale,
                                uintptr_t stream) {
  const int dev = current_device();
  pagedd::cuda::RotaryCacheParams p{};
  p.rotary = rotary_params(query, key, cos, sin, dev);
  const int64_t num_tokens = query.shape(0), num_kv_heads = key.shape(1);
  const int64_t head_dim = query.shape(2);
  if (num_kv_heads == 0) throw nb::value_error("key must have at least one head");
  if (head_dim > pagedd::cuda::kMaxRotaryCacheHeadDim)
    throw nb::value_error(("head_dim must be at most " +
                           std::to_string(pagedd::cuda::kMaxRotaryCacheHeadDim) + ", got " +
                           std::to_string(head_dim))
                              .c_str());
  check_same_dtype(value, "value", key, "key");
  check_heads(value, "value", num_tokens, head_dim, dev);
  check_dim(value, "value", 1, num_kv_heads, "num_kv_heads");
  p.cache_fp8 = is_dtype(key_cache, kUInt, 8);
  if (p.cache_fp8) {
    if (p.rotary.dtype == DType::kFloat32)
      throw nb::type_error("an fp8 (uint8 storage) key_cache needs float16 or bfloat16 query / "
                           "key / value, got float32");
    check_kv_scales(k_scale, v_scale);
  } else {
    check_same_dtype(key_cache, "key_cache", key, "key");
  }
  check_same_dtype(value_cache, "value_cache", key_cache, "key_cache");
  check_dtype(slot_mapping, "slot_mapping", kInt, 64, "int64");
  for (auto [a, n] : {std::pair{&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                      {&slot_mapping, "slot_mapping"}})
    check_cuda(*a, n, dev);
  check_ndim(key_cache, "key_cache", 4);
  check_ndim(value_cache, "value_cache", 4);
  check_ndim(slot_mapping, "slot_mapping", 1);
  check_dim(slot_mapping, "slot_mapping", 0, num_tokens, "num_tokens");
  check_dim(key_cache, "key_cache", 1, num_kv_heads, "num_kv_heads");
  check_dim(key_cache, "key_cache", 3, head_dim, "head_dim");
  for (size_t i = 0; i < 4; ++i) {
    check_dim(value_cache, "value_cache", i, key_cache.shape(i), "key_cache's shape");
    if (value_cache.stride(i) != key_cache.stride(i))
      throw nb::value_error("value_cache must have the same strides as key_cache");
  }
  check_contiguous_from(key_cache, "key_cache", 2);
  if (slot_mapping.stride(0) != 1 && num_tokens > 1)
    throw nb::value_error("slot_mapping must be contiguous");
  if (key_cache.shape(2) <= 0 || key_cache.shape(2) > kMaxInt)
    throw nb::value_error("key_cache.shape[2] (block_size) must be in [1, 2^31)");
  p.value = value.data();
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.key_cache = key_cache.data();
  p.value_cache = value_cache.data();
  p.cache_block_stride = key_cache.stride(0);
  p.cache_head_stride = key_cache.stride(1);
  p.slot_mapping = static_cast<const int64_t*>(slot_mapping.data());
  p.block_size = (int)key_cache.shape(2);
  if (p.cache_fp8) {
    check_fp8_cache_layout(head_dim, p.cache_block_stride, p.cache_head_stride, p.key_cache,
                           p.value_cache);
    p.k_scale = (float)k_scale;
    p.v_scale = (float)v_scale;
  }
  launch_without_gil("rotary_embedding_and_cache", [&] {
    return pagedd::cuda::rotary_embedding_and_cache(p, as_stream(stream));
  });
}

void per_token_fp8_quant(Array out, Array scale, Array input, uintptr_t stream) {
  const int dev = current_device();
  const DType dtype = float_dtype(input, "input");
  check_ndim(input, "input", 2);
  const int64_t num_tokens = input.shape(0), d = input.shape(1);
  check_sizes(num_tokens, d, "d (input.shape[1])");
  check_rows(input, "input", num_tokens, d, dev, false);
  check_fp8_out(out, scale, num_tokens, d, dev);

  pagedd::cuda::PerTokenFp8QuantParams p{};
  p.out = out.data();
  p.scale = static_cast<float*>(scale.data());
  p.input = input.data();
  p.out_stride = out.stride(0);
  p.input_stride = input.stride(0);
  p.num_tokens = (int)num_tokens;
  p.d = (int)d;
  p.dtype = dtype;
  launch_without_gil("per_token_fp8_quant", [&] {
    return pagedd::cuda::per_token_fp8_quant(p, as_stream(stream));
  });
}

}  // namespace

void bind_layer_ops(nb::module_& m) {
  m.def("rms_norm", &rms_norm, nb::arg("out").noconvert(), nb::arg("input"), nb::arg("weight"),
        nb::arg("eps"), nb::arg("stream"), nb::arg("round_once") = false,
        nb::arg("weight_offset") = 0.0,
        "out = weight * rmsnorm(input). out, input: [num_tokens, hidden_size] (out may be\n"
        "input); weight: [hidden_size]; float16, bfloat16 or float32, all one dtype.\n"
        "round_once: out = round(rmsnorm_f32(input) * (weight + weight_offset)) (gpt-oss: offset\n"
        "0; Gemma: 1).");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, nb::arg("out").noconvert(), nb::arg("input"),
        nb::arg("residual").noconvert(), nb::arg("weight"), nb::arg("eps"), nb::arg("stream"),
        nb::arg("round_once") = false, nb::arg("weight_offset") = 0.0,
        "residual = input + residual (in place), then out = weight * rmsnorm(residual), in one\n"
        "kernel. out, input, residual: [num_tokens, hidden_size] (out may be input, residual\n"
        "is its own tensor); weight: [hidden_size]; float16, bfloat16 or float32.\n"
        "round_once, weight_offset: as rms_norm.");
  m.def("silu_and_mul", &silu_and_mul, nb::arg("out").noconvert(), nb::arg("input"),
        nb::arg("stream"), nb::arg("activation") = 0, nb::arg("alpha") = 1.702,
        nb::arg("limit") = 7.0,
        "out = silu(input[:, :d]) * input[:, d:]. input: [num_tokens, 2 * d]; out:\n"
        "[num_tokens, d]; float16, bfloat16 or float32. activation 1: gelu_tanh(gate) * up\n"
        "(GeGLU); 2: gpt-oss's clamped SwiGLU (clamp(up, -limit, limit) + 1) * g *\n"
        "sigmoid(alpha * g), g = min(gate, limit).");
  m.def("rms_norm_fp8", &rms_norm_fp8, nb::arg("out").noconvert(), nb::arg("scale").noconvert(),
        nb::arg("input"), nb::arg("weight"), nb::arg("eps"), nb::arg("stream"),
        nb::arg("round_once") = false, nb::arg("weight_offset") = 0.0,
        "rms_norm with its rows quantized per token to FP8 e4m3 in the same kernel (bit for\n"
        "bit per_token_fp8_quant of rms_norm's out). out: [num_tokens, hidden_size] uint8 (a\n"
        "float8_e4m3fn tensor's bytes); scale: [num_tokens] float32.");
  m.def("fused_add_rms_norm_fp8", &fused_add_rms_norm_fp8, nb::arg("out").noconvert(),
        nb::arg("scale").noconvert(), nb::arg("input"), nb::arg("residual").noconvert(),
        nb::arg("weight"), nb::arg("eps"), nb::arg("stream"), nb::arg("round_once") = false,
        nb::arg("weight_offset") = 0.0,
        "fused_add_rms_norm with its output rows quantized per token to FP8 e4m3 in the same\n"
        "kernel. out: [num_tokens, hidden_size] uint8; scale: [num_tokens] float32.");
  m.def("silu_and_mul_fp8", &silu_and_mul_fp8, nb::arg("out").noconvert(),
        nb::arg("scale").noconvert(), nb::arg("input"), nb::arg("stream"),
        nb::arg("activation") = 0, nb::arg("alpha") = 1.702, nb::arg("limit") = 7.0,
        "silu_and_mul with its rows quantized per token to FP8 e4m3 in the same kernel. input:\n"
        "[num_tokens, 2 * d]; out: [num_tokens, d] uint8; scale: [num_tokens] float32.");
  m.def("rotary_embedding", &rotary_embedding, nb::arg("query").noconvert(),
        nb::arg("key").noconvert(), nb::arg("cos"), nb::arg("sin"), nb::arg("stream"),
        "Rotates query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads,\n"
        "head_dim] in place (rotate_half convention, rounded as transformers does); cos, sin:\n"
        "[num_tokens, rotary_dim] float32 (rotary_dim <= head_dim: the first rotary_dim dims\n"
        "rotate, the rest pass). query and key: float16, bfloat16 or float32.");
  m.def("rotary_embedding_and_cache", &rotary_embedding_and_cache, nb::arg("query").noconvert(),
        nb::arg("key").noconvert(), nb::arg("value"), nb::arg("key_cache").noconvert(),
        nb::arg("value_cache").noconvert(), nb::arg("slot_mapping"), nb::arg("cos"),
        nb::arg("sin"), nb::arg("k_scale"), nb::arg("v_scale"), nb::arg("stream"),
        "rotary_embedding, then reshape_and_cache of the rotated key and the value, in one\n"
        "launch (the same bits). query [num_tokens, num_heads, head_dim], key / value\n"
        "[num_tokens, num_kv_heads, head_dim]; key_cache, value_cache [num_blocks,\n"
        "num_kv_heads, block_size, head_dim] of key's dtype, or uint8 (fp8 e4m3 storage,\n"
        "saturate(x / scale)); slot_mapping [num_tokens] int64 (negative: rotate, don't store).");
  m.def("per_token_fp8_quant", &per_token_fp8_quant, nb::arg("out").noconvert(),
        nb::arg("scale").noconvert(), nb::arg("input"), nb::arg("stream"),
        "Dynamic per-token FP8 e4m3: scale[t] = max |input[t]| / 448 (as an exact inverse),\n"
        "out[t] = e4m3(input[t] / scale[t]). input: [num_tokens, d] float16, bfloat16 or\n"
        "float32; out: [num_tokens, d] uint8 (a float8_e4m3fn tensor viewed as bytes); scale:\n"
        "[num_tokens] float32.");
}
