// Argument checks shared by the CUDA bindings (cuda, layer, moe, lora and fp8_gemm bindings).
//
// Tensors arrive as nb::ndarray through DLPack; each check raises TypeError (dtype) or
// ValueError (device, rank, shape, strides) naming the argument, and check_cuda_error turns a
// kernel's cudaError_t into RuntimeError.
#pragma once

#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "pagedd_cuda.h"

namespace pagedd::bindings {

namespace nb = nanobind;
using pagedd::cuda::DType;

using Array = nb::ndarray<>;

inline std::string dtype_name(const nb::dlpack::dtype& dt) {
  const char* code = "?";
  switch ((nb::dlpack::dtype_code)dt.code) {
    case nb::dlpack::dtype_code::Int: code = "int"; break;
    case nb::dlpack::dtype_code::UInt: code = "uint"; break;
    case nb::dlpack::dtype_code::Float: code = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: code = "bfloat"; break;
    default: break;
  }
  return std::string(code) + std::to_string(dt.bits);
}

inline bool is_dtype(const Array& a, nb::dlpack::dtype_code code, int bits) {
  return a.dtype().code == (uint8_t)code && a.dtype().bits == bits && a.dtype().lanes == 1;
}

inline constexpr auto kFloat = nb::dlpack::dtype_code::Float;
inline constexpr auto kBfloat = nb::dlpack::dtype_code::Bfloat;
inline constexpr auto kInt = nb::dlpack::dtype_code::Int;
inline constexpr auto kUInt = nb::dlpack::dtype_code::UInt;

inline void check_dtype(const Array& a, const char* name, nb::dlpack::dtype_code code,
                        int bits, const char* expected) {
  if (!is_dtype(a, code, bits))
    throw nb::type_error((std::string(name) + " must be " + expected + ", got " +
                          dtype_name(a.dtype()))
                             .c_str());
}

inline DType attention_dtype(const Array& a, const char* name) {
  if (is_dtype(a, kFloat, 16)) return DType::kFloat16;
  if (is_dtype(a, kBfloat, 16)) return DType::kBFloat16;
  throw nb::type_error((std::string(name) + " must be float16 or bfloat16, got " +
                        dtype_name(a.dtype()))
                           .c_str());
}

// The activations of the per-token layer and MoE kernels: half, bfloat16 or float32.
inline DType float_dtype(const Array& a, const char* name) {
  if (is_dtype(a, kFloat, 16)) return DType::kFloat16;
  if (is_dtype(a, kBfloat, 16)) return DType::kBFloat16;
  if (is_dtype(a, kFloat, 32)) return DType::kFloat32;
  throw nb::type_error((std::string(name) + " must be float16, bfloat16 or float32, got " +
                        dtype_name(a.dtype()))
                           .c_str());
}

inline void check_same_dtype(const Array& a, const char* name, const Array& ref,
                             const char* ref_name) {
  if (a.dtype() != ref.dtype())
    throw nb::type_error((std::string(name) + " must have the dtype of " + ref_name + " (" +
                          dtype_name(ref.dtype()) + "), got " + dtype_name(a.dtype()))
                             .c_str());
}

inline int current_device() {
  int dev = -1;
  const cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("pagedd: no usable CUDA device: ") +
                             cudaGetErrorString(err));
  return dev;
}

inline void check_cuda(const Array& a, const char* name, int device) {
  if (a.device_type() != nb::device::cuda::value)
    throw nb::value_error((std::string(name) + " must be a CUDA tensor").c_str());
  if (a.device_id() != device)
    throw nb::value_error((std::string(name) + " is on cuda:" + std::to_string(a.device_id()) +
                           " but the current device is cuda:" + std::to_string(device))
                              .c_str());
}

inline void check_cpu(const Array& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value &&
      a.device_type() != nb::device::cuda_host::value)
    throw nb::value_error((std::string(name) + " must be a CPU tensor").c_str());
}

inline void check_ndim(const Array& a, const char* name, size_t ndim) {
  if (a.ndim() != ndim)
    throw nb::value_error((std::string(name) + " must have " + std::to_string(ndim) +
                           " dimensions, got " + std::to_string(a.ndim()))
                              .c_str());
}

inline void check_dim(const Array& a, const char* name, size_t dim, int64_t expected,
                      const char* what) {
  if ((int64_t)a.shape(dim) != expected)
    throw nb::value_error((std::string(name) + ".shape[" + std::to_string(dim) + "] must be " +
                           std::to_string(expected) + " (" + what + "), got " +
                           std::to_string(a.shape(dim)))
                              .c_str());
}

// Dimensions [from, ndim) laid out densely (row-major), ignoring size-1 dims.
inline void check_contiguous_from(const Array& a, const char* name, size_t from) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > from;) {
    if (a.shape(i) != 1 && a.stride(i) != expected)
      throw nb::value_error((std::string(name) + " must be contiguous in dims >= " +
                             std::to_string(from) + " (stride[" + std::to_string(i) + "] is " +
                             std::to_string(a.stride(i)) + ", expected " +
                             std::to_string(expected) + ")")
                                .c_str());
    expected *= (int64_t)a.shape(i);
  }
}

// a: [num_rows, num_cols] on the device with a contiguous last dim; a written tensor's rows
// (is_written) must not overlap. ``what`` names dim 1 in the error.
inline void check_rows(const Array& a, const char* name, int64_t num_rows, int64_t num_cols,
                       int dev, bool is_written, const char* what = "the row length") {
  check_cuda(a, name, dev);
  check_ndim(a, name, 2);
  check_dim(a, name, 0, num_rows, "num_tokens");
  check_dim(a, name, 1, num_cols, what);
  if (num_cols > 1 && a.stride(1) != 1)
    throw nb::value_error((std::string(name) + "'s last dim must be contiguous").c_str());
  if (is_written && num_rows > 1 && a.stride(0) < num_cols)
    throw nb::value_error((std::string(name) + "'s rows overlap (stride[0] is " +
                           std::to_string(a.stride(0)) + ", the row length " +
                           std::to_string(num_cols) + ")")
                              .c_str());
}

// An fp8 (uint8 storage) cache that the cache-write kernels store 8 bytes at a time
// (cuda_bindings.cpp, layer_bindings.cpp): head_dim, the block and head strides (elements) and
// both base addresses must be multiples of 8.
inline void check_fp8_cache_layout(int64_t head_dim, int64_t block_stride, int64_t head_stride,
                                   const void* key_cache, const void* value_cache) {
  if (head_dim % 8 != 0 || block_stride % 8 != 0 || head_stride % 8 != 0 ||
      reinterpret_cast<uintptr_t>(key_cache) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(value_cache) % 8 != 0)
    throw nb::value_error("an fp8 key_cache / value_cache needs head_dim and strides that are "
                          "multiples of 8 and 8-byte aligned data");
}

// Per-layer fp8 KV-cache scales (cuda_bindings.cpp, layer_bindings.cpp).
inline void check_kv_scales(double k_scale, double v_scale) {
  if (!(k_scale > 0.0) || !(v_scale > 0.0) || !std::isfinite(k_scale) || !std::isfinite(v_scale))
    throw nb::value_error(("k_scale and v_scale must be positive and finite, got " +
                           std::to_string(k_scale) + " and " + std::to_string(v_scale))
                              .c_str());
}

inline void check_cuda_error(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("pagedd.") + what + ": CUDA error: " +
                             cudaGetErrorString(err));
}

// Runs a kernel launcher (a callable returning cudaError_t) without the GIL, then raises if it
// failed: every binding's launch.
template <class Launch>
void launch_without_gil(const char* what, Launch&& launch) {
  cudaError_t err;
  {
    nb::gil_scoped_release release;
    err = launch();
  }
  check_cuda_error(err, what);
}

inline cudaStream_t as_stream(uintptr_t stream) {
  return reinterpret_cast<cudaStream_t>(stream);
}

}  // namespace pagedd::bindings
