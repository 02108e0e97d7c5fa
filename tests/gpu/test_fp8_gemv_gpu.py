"""ops.fp8_gemv (cpp/cuda/fp8_gemv.cu): the FP8 scaled product of 1 to 16 rows on FP8 tensor
cores, against a float64 reference of the same FP8 codes and scales, against torch._scaled_mm,
strided and misaligned inputs, a CUDA graph, bad arguments, and the FP8 linear path with the
kernel switched on (``FP8_GEMV_MAX_TOKENS``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_engine_check import assert_decodes_as_emulated  # noqa: E402

from pydaemon import ops  # noqa: E402
from pydaemon.quantization import fp8  # noqa: E402
from pydaemon.quantization.fp8 import quantize_per_channel, quantize_per_token  # noqa: E402

if not torch.cuda.is_available() or not ops.is_available() or not ops.fp8_gemv_available():
    pytest.skip("needs CUDA and pagedd's kernels", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 tensor cores need compute capability 8.9+", allow_module_level=True)


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spread = torch.logspace(-2, 1, m, device="cuda")[:, None]  # rows of different scales
    x = (torch.randn(m, k, device="cuda", generator=gen) * spread).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    xq, x_scale = quantize_per_token(x)
    wq, w_scale = quantize_per_channel(w)
    return xq, x_scale, wq, w_scale


def _reference(xq, x_scale, wq, w_scale) -> torch.Tensor:  # float64
    acc = xq.double() @ wq.double().t()
    return acc * x_scale.double().view(-1, 1) * w_scale.double().view(1, -1)


def _assert_bf16_of(got: torch.Tensor, ref: torch.Tensor) -> None:
    """got: the bf16 rounding of ref, up to float32 sums in another order: half a bf16 ulp
    (2^-9 relative) plus the sums' error, which scales with the mean |output|."""
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    err = (got.double() - ref).abs()
    bound = ref.abs() * 2**-8 + ref.abs().mean() * 1e-4
    worst = (err / ref.abs().mean()).max().item()
    assert bool((err <= bound).all()), f"max error {worst:.3e} of the mean |output|"


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16])
@pytest.mark.parametrize(
    "n, k",
    # 8B shapes (qkv, o, gate_up, down), a K not a multiple of 64, N not a multiple of 8
    [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1003, 2064), (8, 16)],
)
def test_fp8_gemv_against_float64(m, n, k):
    xq, x_scale, wq, w_scale = _operands(m, n, k, seed=m * 31 + n + k)
    got = ops.fp8_gemv(xq, x_scale, wq, w_scale)
    _assert_bf16_of(got, _reference(xq, x_scale, wq, w_scale))


@pytest.mark.parametrize("m", [1, 5, 16])
def test_fp8_gemv_agrees_with_scaled_mm(m):
    xq, x_scale, wq, w_scale = _operands(m, 4096, 4096, seed=m)
    ours = ops.fp8_gemv(xq, x_scale, wq, w_scale).double()
    theirs = torch._scaled_mm(
        xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16
    ).double()
    ref = _reference(xq, x_scale, wq, w_scale)
    # cuBLASLt's FP8 accumulation keeps fewer bits: ours is at least as close to float64
    assert (ours - ref).abs().mean() <= (theirs - ref).abs().mean() * 1.05 + 1e-12
    typical = ref.abs().mean()
    assert bool(((ours - theirs).abs() <= ref.abs() * 2**-7 + typical * 2e-2).all())


def test_strided_rows_and_zero_rows():
    m, n, k = 6, 512, 1024
    xq, x_scale, wq, w_scale = _operands(m, n, k, seed=7)
    wide = torch.zeros(m, k + 64, dtype=torch.float8_e4m3fn, device="cuda")
    wide[:, :k] = xq
    wide[2] = 0  # an all-zero token row
    strided = wide[:, :k]  # rows 16-byte aligned, stride k + 64
    got = ops.fp8_gemv(strided, x_scale, wq, w_scale)
    _assert_bf16_of(got, _reference(strided.contiguous(), x_scale, wq, w_scale))
    assert not bool(got[2].any())


def test_fp8_gemv_in_a_cuda_graph():
    m, n, k = 4, 2048, 2048
    xq, x_scale, wq, w_scale = _operands(m, n, k, seed=11)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.fp8_gemv(xq, x_scale, wq, w_scale)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = ops.fp8_gemv(xq, x_scale, wq, w_scale)
    torch.cuda.current_stream().wait_stream(stream)
    new_xq, new_scale, _, _ = _operands(m, n, k, seed=12)
    xq.copy_(new_xq)
    x_scale.copy_(new_scale)
    graph.replay()
    torch.cuda.synchronize()
    _assert_bf16_of(out, _reference(new_xq, new_scale, wq, w_scale))


def test_bad_arguments_are_named():
    xq, x_scale, wq, w_scale = _operands(4, 64, 64, seed=3)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        big, big_scale, _, _ = _operands(17, 64, 64, seed=4)
        ops.fp8_gemv(big, big_scale, wq, w_scale)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.fp8_gemv(xq[:, :40], x_scale, wq[:, :40].contiguous(), w_scale)
    with pytest.raises(ValueError, match="wq"):
        ops.fp8_gemv(xq, x_scale, wq[:, :48].contiguous(), w_scale)  # K differs
    with pytest.raises(ValueError, match="w_scale"):
        ops.fp8_gemv(xq, x_scale, wq, w_scale[:10])
    with pytest.raises(TypeError, match="xq"):
        core_args = (xq.float(), x_scale, wq, w_scale)
        ops.core().fp8_gemv(
            torch.empty(4, 64, dtype=torch.bfloat16, device="cuda"),
            *core_args,
            ops._core_ext.stream_handle(xq.device),
        )
    buf = torch.empty(4 * 64 + 8, dtype=torch.uint8, device="cuda")
    misaligned = buf[8:].view(4, 64).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="16-byte aligned"):
        ops.fp8_gemv(misaligned, x_scale, wq, w_scale)


def test_scaled_mm_takes_the_kernel_when_switched_on(monkeypatch):
    xq, x_scale, wq, w_scale = _operands(3, 1024, 512, seed=5)
    off = fp8.scaled_mm(xq, x_scale, wq, w_scale)
    monkeypatch.setattr(fp8, "FP8_GEMV_MAX_TOKENS", 16)
    on = fp8.scaled_mm(xq, x_scale, wq, w_scale)
    assert torch.equal(on, ops.fp8_gemv(xq, x_scale, wq, w_scale))
    typical = on.float().abs().mean()
    assert bool(
        ((on.float() - off.float()).abs() <= off.float().abs() * 2**-7 + typical * 2e-2).all()
    )
    # rows the kernel cannot read (not 16-byte aligned) stay with torch._scaled_mm
    wide = torch.zeros(3, 520, dtype=torch.float8_e4m3fn, device="cuda")
    assert fp8._gemv_fits(xq, wq)
    assert not fp8._gemv_fits(wide[:, 8:520], wq)
    assert not fp8._gemv_fits(xq[:, :40], wq[:, :40].contiguous())


def test_fp8_engine_decodes_the_same_with_the_kernel(tmp_path, monkeypatch):
    """An FP8 engine (CUDA graphs, decode at 1 to 4 tokens) with the kernel on: the
    log-probabilities of the emulated FP8 path (the same FP8 operands, exact float32 sums)
    up to where a sequence's tokens differ, and they differ only at a near-tie of the
    reference's top two. (torch._scaled_mm is not the reference: cuBLASLt's FP8 accumulation
    keeps fewer bits; on the H200 it was 0.06 nats off the kernel in this test.)"""
    assert_decodes_as_emulated(tmp_path, monkeypatch, "FP8_GEMV_MAX_TOKENS", 16, tol=0.02)
