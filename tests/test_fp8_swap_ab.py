"""scaled_mm_swapped (pydaemon/quantization/fp8.py): the FP8 product with cuBLASLt's operands
swapped for a few tokens, checked on the CPU through a stand-in for torch._scaled_mm that
enforces its layout rules (first operand row-major, second column-major, sizes divisible by
16, row-wise scale shapes) and computes in float32."""

from __future__ import annotations

import pytest
import torch

from pydaemon.quantization import fp8


def _scaled_mm_standin(a, b, *, scale_a, scale_b, out_dtype):
    assert a.dtype == b.dtype == fp8.FP8_DTYPE
    assert a.stride(1) == 1, "the first operand must be row-major"
    assert b.stride(0) == 1, "the second operand must be column-major"
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
    assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
    return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 17])
def test_swapped_product_equals_the_plain_one(num_tokens, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_standin)
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 64, generator=g)
    w = torch.randn(48, 64, generator=g) * 0.05
    xq, x_scale = fp8.quantize_per_token(x)
    wq, w_scale = fp8.quantize_per_channel(w)
    got = fp8.scaled_mm_swapped(xq, x_scale, wq, w_scale)
    assert got.shape == (num_tokens, 48) and got.is_contiguous() and got.dtype == torch.bfloat16
    want = fp8.emulated_scaled_mm(xq, x_scale, wq, w_scale)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-3)


def test_scaled_mm_takes_the_swap_up_to_its_bound(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: calls.append(a.shape) or
                        _scaled_mm_standin(a, b, **kw))  # fmt: skip
    monkeypatch.setattr(fp8, "FP8_GEMV_MAX_TOKENS", 0)
    monkeypatch.setattr(fp8, "FP8_SWAP_AB_MAX_TOKENS", 4)
    wq, w_scale = fp8.quantize_per_channel(torch.randn(32, 16))
    for num_tokens in (4, 5):
        xq, x_scale = fp8.quantize_per_token(torch.randn(num_tokens, 16))
        fp8.scaled_mm(xq, x_scale, wq, w_scale)
    assert calls == [(32, 16), (5, 16)]  # swapped: the weight first; plain: the tokens first
