// Validating binding of the few-row FP8 scaled product (fp8_gemv, cpp/cuda/layer_kernels.h).
// Same conventions as layer_bindings.cpp: every tensor is checked (a bad one raises TypeError /
// ValueError naming it), the written tensor is .noconvert(), the stream is passed in, the GIL
// is released around the launch. Nothing here reads a device value: capturable in a CUDA graph.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <limits>
#include <string>

#include "array_checks.h"
#include "layer_kernels.h"

namespace nb = nanobind;
using namespace pagedd::bindings;  // Array and the argument checks

namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

void check_fp8(const Array& a, const char* name) {
  check_dtype(a, name, kUInt, 8, "uint8 (a float8_e4m3fn tensor's bytes)");
}

void check_aligned16(const Array& a, const char* name) {
  if (reinterpret_cast<uintptr_t>(a.data()) % 16)
    throw nb::value_error((std::string(name) + "'s data must be 16-byte aligned").c_str());
}

// scale: [rows] float32, contiguous.
void check_scale(const Array& scale, const char* name, int64_t rows, const char* what, int dev) {
  check_dtype(scale, name, kFloat, 32, "float32");
  check_cuda(scale, name, dev);
  check_ndim(scale, name, 1);
  check_dim(scale, name, 0, rows, what);
  check_contiguous_from(scale, name, 0);
}

void fp8_gemv(Array out, Array xq, Array x_scale, Array wq, Array w_scale, uintptr_t stream) {
  const int dev = current_device();
  check_fp8(xq, "xq");
  check_fp8(wq, "wq");
  check_cuda(xq, "xq", dev);
  check_cuda(wq, "wq", dev);
  check_ndim(xq, "xq", 2);
  check_ndim(wq, "wq", 2);
  const int64_t m = xq.shape(0), k = xq.shape(1), n = wq.shape(0);
  if (m < 1 || m > pagedd::cuda::kFp8GemvMaxRows)
    throw nb::value_error(("xq must have 1 to " + std::to_string(pagedd::cuda::kFp8GemvMaxRows) +
                           " rows (tokens), got " + std::to_string(m))
                              .c_str());
  if (k < 16 || k % 16 || k > kMaxInt)
    throw nb::value_error(("K (xq.shape[1]) must be a positive multiple of 16, got " +
                           std::to_string(k))
                              .c_str());
  if (n < 1 || n > kMaxInt) throw nb::value_error("wq must have 1 to 2^31 - 1 rows");
  check_dim(wq, "wq", 1, k, "K, xq.shape[1]");
  check_contiguous_from(wq, "wq", 0);
  if (k > 1 && xq.stride(1) != 1) throw nb::value_error("xq's last dim must be contiguous");
  if (m > 1 && (xq.stride(0) < k || xq.stride(0) % 16))
    throw nb::value_error(("xq's row stride must be at least K and a multiple of 16, got " +
                           std::to_string(xq.stride(0)))
                              .c_str());
  check_aligned16(xq, "xq");
  check_aligned16(wq, "wq");
  check_scale(x_scale, "x_scale", m, "xq.shape[0]", dev);
  check_scale(w_scale, "w_scale", n, "wq.shape[0]", dev);
  check_dtype(out, "out", kBfloat, 16, "bfloat16");
  check_rows(out, "out", m, n, dev, true, "wq.shape[0]");

  pagedd::cuda::Fp8GemvParams p{};
  p.out = out.data();
  p.xq = xq.data();
  p.x_scale = static_cast<const float*>(x_scale.data());
  p.wq = wq.data();
  p.w_scale = static_cast<const float*>(w_scale.data());
  p.out_stride = m > 1 ? out.stride(0) : n;
  p.x_stride = m > 1 ? xq.stride(0) : k;
  p.m = (int)m;
  p.n = (int)n;
  p.k = (int)k;
  cudaError_t err;
  {
    nb::gil_scoped_release release;
    err = pagedd::cuda::fp8_gemv(p, as_stream(stream));
  }
  if (err == cudaErrorNotSupported)
    throw nb::value_error("fp8_gemv needs FP8 tensor cores (compute capability 8.9 or newer)");
  check_cuda_error(err, "fp8_gemv");
}

}  // namespace

void bind_fp8_gemm_ops(nb::module_& m) {
  m.def("fp8_gemv", &fp8_gemv, nb::arg("out").noconvert(), nb::arg("xq"), nb::arg("x_scale"),
        nb::arg("wq"), nb::arg("w_scale"), nb::arg("stream"),
        "out[m, n] = bf16((sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]) for 1 to 16\n"
        "rows m, on FP8 tensor cores (compute capability 8.9+). out: [m, n] bfloat16; xq: [m, K]\n"
        "and wq: [N, K] uint8 (float8_e4m3fn bytes), K a multiple of 16, rows 16-byte aligned,\n"
        "wq contiguous; x_scale: [m], w_scale: [N] float32.");
}
