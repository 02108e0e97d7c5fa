// pydaemon._core: the only translation units that include nanobind live in this folder.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void bind_block_manager(nb::module_& m);
#ifdef PAGEDD_WITH_CUDA
void bind_cuda_ops(nb::module_& m);
void bind_layer_ops(nb::module_& m);
void bind_moe_ops(nb::module_& m);
void bind_lora_ops(nb::module_& m);
void bind_fp8_gemm_ops(nb::module_& m);
#endif

NB_MODULE(_core, m) {
  m.doc() = "pagedd C++ core: KV-cache block manager and paged-attention kernels";
  bind_block_manager(m);
#ifdef PAGEDD_WITH_CUDA
  m.attr("has_cuda") = true;
  bind_cuda_ops(m);
  bind_layer_ops(m);
  bind_moe_ops(m);
  bind_lora_ops(m);
  bind_fp8_gemm_ops(m);
#else
  m.attr("has_cuda") = false;
#endif
}
