"""scaled_mm_swapped on the GPU: torch._scaled_mm with the operands swapped (the weight rows as
cuBLASLt's M, the few tokens padded to 16 as its N) against a float64 reference and against
the plain call, and an FP8 engine with the swap on decoding as the emulated FP8 path does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_engine_check import assert_decodes_as_emulated  # noqa: E402

from pydaemon.quantization import fp8  # noqa: E402

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 tensor cores need CUDA compute capability 8.9+", allow_module_level=True)


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_swapped_equals_plain_and_reference(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, k, device="cuda", generator=gen)).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    xq, x_scale = fp8.quantize_per_token(x)
    wq, w_scale = fp8.quantize_per_channel(w)
    got = fp8.scaled_mm_swapped(xq, x_scale, wq, w_scale)
    assert got.shape == (m, n) and got.is_contiguous() and got.dtype == torch.bfloat16
    ref = (xq.double() @ wq.double().t()) * x_scale.double().view(-1, 1) * w_scale.double()
    scale = float(ref.abs().mean())
    assert float((got.double() - ref).abs().max()) < 2e-2 * scale + 2**-8 * float(ref.abs().max())
    plain = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                             out_dtype=torch.bfloat16)  # fmt: skip
    assert float((got.float() - plain.float()).abs().max()) < 2e-2 * scale + 2**-8 * float(
        plain.float().abs().max()
    )


def test_engine_with_the_swap_decodes_as_the_emulated_path(tmp_path, monkeypatch):
    # cuBLASLt's FP8 sums keep fewer bits than float32: a wider tolerance than the GEMV's
    assert_decodes_as_emulated(tmp_path, monkeypatch, "FP8_SWAP_AB_MAX_TOKENS", 64, tol=0.1)
