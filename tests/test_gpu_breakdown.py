"""bench/gpu_breakdown.py: kernels sorted into kinds by name (pagedd's and vLLM's), busy time as
the union of kernel intervals, idle time between the first kernel and the last."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

from bench.gpu_breakdown import Profiled, breakdown, kind_of  # noqa: E402


@pytest.mark.parametrize(
    "name, kind",
    [
        ("void pagedd::cuda::paged_prefill_kernel<__nv_bfloat16, 128, 4, 2, 32>(...)",
         "attention (prefill)"),
        ("void pagedd::cuda::paged_decode_tc_kernel<__nv_bfloat16, __nv_bfloat16, 128>(...)",
         "attention (decode)"),
        ("void flash::FlashAttnFwdSm90<...>(...)", "attention"),
        ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "gemm"),
        ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_fp8<...>>(...)", "gemm"),
        ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<...>(...)", "fp8 quantization"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("void pagedd::cuda::rms_norm_kernel<__nv_bfloat16, 8, true, false>(...)", "norm"),
        ("void vllm::act_and_mul_kernel<...>(...)", "activation"),
        ("void pagedd::cuda::rotary_cache_kernel<__nv_bfloat16, false, 8>(...)",
         "rotary + cache write"),
        ("void vllm::reshape_and_cache_flash_kernel<...>(...)", "rotary + cache write"),
        ("void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>(...)",
         "sampling"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("some_unknown_kernel", "other"),
        ("void pagedd::cuda::moe_align_kernel<...>(...)", "moe"),
        ("fused_moe_kernel", "moe"),
        ("void cutlass::device_kernel<...GroupProblemShape<...>>(...)", "moe"),
    ],
)  # fmt: skip
def test_kinds(name, kind):
    assert kind_of(name) == kind


def test_busy_idle_and_kinds():
    kernels = [
        ("nvjet_gemm", 0.0, 1000.0),
        ("paged_decode_tc_kernel", 1000.0, 500.0),
        ("Memcpy DtoH", 1200.0, 100.0),  # overlaps the decode kernel (another stream)
        ("rms_norm_kernel", 2500.0, 500.0),  # after a 1,000 us gap
    ]
    r = breakdown(kernels)
    assert r["num_kernels"] == 4
    assert r["span_ms"] == pytest.approx(3.0) and r["busy_ms"] == pytest.approx(2.0)
    assert r["idle_ms"] == pytest.approx(1.0) and r["kernel_ms"] == pytest.approx(2.1)
    assert r["ms_by_kind"] == pytest.approx(
        {"gemm": 1.0, "attention (decode)": 0.5, "norm": 0.5, "copies": 0.1}
    )
    assert list(r["ms_by_kind"])[0] == "gemm"  # largest first
    assert breakdown([])["busy_ms"] == 0.0


def test_idle_by_gap_length_and_tenth_of_run():
    kernels = [
        ("a", 0.0, 100.0),
        ("b", 105.0, 100.0),  # 5 us launch gap, first tenth of the 10 ms run
        ("c", 2205.0, 100.0),  # 2 ms stall, starting at 205 us: first tenth
        ("d", 9000.0, 1000.0),  # 6.695 ms stall from 2.305 ms: the third tenth
    ]
    idle = breakdown(kernels)["idle"]
    by_length = idle["gaps_by_length"]
    assert by_length["<10us"] == {"count": 1, "ms": pytest.approx(0.005)}
    assert by_length["<10000us"] == {"count": 2, "ms": pytest.approx(2.0 + 6.695)}
    assert by_length["<100us"]["count"] == by_length[">=10000us"]["count"] == 0
    assert idle["ms_by_tenth_of_run"][0] == pytest.approx(2.005)
    assert idle["ms_by_tenth_of_run"][2] == pytest.approx(6.695)
    assert sum(idle["ms_by_tenth_of_run"]) == pytest.approx(breakdown(kernels)["idle_ms"])
    assert idle["longest_gaps_ms_at_ms"][0] == pytest.approx((6.695, 2.305))


def test_profiled_off_is_a_no_op():
    with Profiled(False) as p:
        pass
    assert p.result is None
