"""Per-token layer kernels (RMSNorm, residual-add + RMSNorm, SiLU-and-mul) against float64
torch references on fresh random inputs; outputs are poisoned with NaN before each run.

Hidden sizes 576 (SmolLM2), 4096, 5120 take the 16-byte vector path; 4100 and 7 (and rows
whose stride is not a multiple of 16 bytes) take the scalar path.
"""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops
from pydaemon.layers.activation import SiluAndMul
from pydaemon.layers.rms_norm import RMSNorm

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HIDDEN = [576, 4096, 5120, 4100, 7]
TOKENS = [1, 5, 257, 4096]
# (rtol, atol): a few roundings to the dtype (half an ulp each) on values of order 1-10.
TOL = {torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.4e-2, 2.4e-2), torch.float32: (2e-5, 2e-5)}
EPS = 1e-5
# Row padding in elements: 0 contiguous, 8 strided but aligned, 1 strided and unaligned.
PADS = [0, 8, 1]


def _rows(num_tokens: int, width: int, dtype: torch.dtype, pad: int = 0, scale: float = 1.0):
    """[num_tokens, width] in dtype on the GPU; with pad > 0, a view into wider rows."""
    buf = (torch.randn(num_tokens, width + pad, device="cuda") * scale).to(dtype)
    return buf[:, :width]


def _weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(hidden, device="cuda")).to(dtype)


def _poisoned(num_tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_tokens, width), float("nan"), device="cuda", dtype=dtype)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, hidden] float64 -> weight * x / sqrt(mean(x^2) + eps), float64."""
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return weight.double() * (x * inv_rms)


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate, up = x[:, :d].double(), x[:, d:].double()
    return gate / (1.0 + torch.exp(-gate)) * up


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(got).any(), f"{what}: NaN (an element was never written)"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        got.double(), want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_float64(dtype, hidden, num_tokens):
    x = _rows(num_tokens, hidden, dtype)
    residual = _rows(num_tokens, hidden, dtype, scale=4.0)
    weight = _weight(hidden, dtype)
    want_sum = x.double() + residual.double()
    out = _poisoned(num_tokens, hidden, dtype)
    ops.fused_add_rms_norm(x, residual, weight, EPS, out=out)
    assert_close(residual, want_sum, dtype, "residual (updated in place)")
    assert_close(out, reference_rms_norm(want_sum, weight), dtype, "out")


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_float64(dtype, hidden, num_tokens):
    x = _rows(num_tokens, hidden, dtype, scale=3.0)
    weight = _weight(hidden, dtype)
    x0 = x.clone()
    out = _poisoned(num_tokens, hidden, dtype)
    ops.rms_norm(x, weight, EPS, out=out)
    assert_close(out, reference_rms_norm(x0.double(), weight), dtype, "out")
    assert torch.equal(x, x0), "input was written"


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("hidden", [576, 4096, 4100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norms_strided_rows_and_in_place(dtype, hidden, pad):
    num_tokens = 37
    x = _rows(num_tokens, hidden, dtype, pad)
    residual = _rows(num_tokens, hidden, dtype, pad, scale=4.0)
    weight = _weight(hidden, dtype)
    want_sum = x.double() + residual.double()
    ops.fused_add_rms_norm(x, residual, weight, EPS, out=x)  # out = x: in place
    assert_close(residual, want_sum, dtype, "residual")
    assert_close(x, reference_rms_norm(want_sum, weight), dtype, "out (in place over input)")
    y = _rows(num_tokens, hidden, dtype, pad)
    want = reference_rms_norm(y.double(), weight)
    out = _poisoned(num_tokens, hidden + pad, dtype)[:, :hidden]  # strided output rows too
    ops.rms_norm(y, weight, EPS, out=out)
    assert_close(out, want, dtype, "out (strided)")
    ops.rms_norm(y, weight, EPS, out=y)
    assert_close(y, want, dtype, "out (in place)")


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("d", [576, 1536, 14336, 4100, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_float64(dtype, d, num_tokens):
    x = _rows(num_tokens, 2 * d, dtype, scale=3.0)
    out = _poisoned(num_tokens, d, dtype)
    ops.silu_and_mul(x, out=out)
    assert_close(out, reference_silu_and_mul(x), dtype, "out")


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_strided_rows(dtype, pad):
    x = _rows(33, 2 * 1024, dtype, pad, scale=3.0)
    out = _poisoned(33, 1024 + pad, dtype)[:, :1024]
    ops.silu_and_mul(x, out=out)
    assert_close(out, reference_silu_and_mul(x), dtype, "out")
    assert ops.silu_and_mul(x).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_layers_run_the_kernels_on_cuda_and_agree_with_their_torch_paths(dtype):
    norm = RMSNorm(576, EPS).to(device="cuda", dtype=dtype)
    norm.weight.data.copy_(_weight(576, dtype))
    x, residual = _rows(64, 576, dtype), _rows(64, 576, dtype, scale=4.0)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    assert new_residual is residual, "the kernel updates residual in place"
    assert torch.equal(residual, x0 + r0)  # the same rounded sum as torch's x + residual
    assert_close(out, norm.forward_native(x0 + r0).double(), dtype, "fused vs torch path")
    # Qwen3's per-head norm on a slice of the packed qkv output: rows not evenly strided.
    qkv = _rows(64, 3 * 128, dtype)
    heads = qkv[:, :256].view(64, 2, 128)
    head_norm = RMSNorm(128, EPS).to(device="cuda", dtype=dtype)
    got = head_norm(heads)
    assert got.shape == heads.shape
    assert_close(got, head_norm.forward_native(heads).double(), dtype, "per-head norm")
    gate_up = _rows(64, 2 * 1536, dtype, scale=3.0)
    act = SiluAndMul()
    assert_close(act(gate_up), act.forward_native(gate_up).double(), dtype, "silu_and_mul")


def test_layer_kernels_reject_bad_arguments():
    x = _rows(4, 64, torch.float16)
    residual, weight = _rows(4, 64, torch.float16), _weight(64, torch.float16)
    with pytest.raises(TypeError, match="input must be float16, bfloat16 or float32"):
        ops.rms_norm(x.double(), weight.double(), EPS)
    with pytest.raises(TypeError, match="weight must have the dtype of input"):
        ops.rms_norm(x, weight.float(), EPS)
    with pytest.raises(TypeError, match="out must have the dtype of input"):
        ops.rms_norm(x, weight, EPS, out=torch.empty(4, 64, device="cuda"))
    with pytest.raises(ValueError, match="weight.shape\\[0\\] must be 64"):
        ops.rms_norm(x, weight[:32], EPS)
    with pytest.raises(ValueError, match="input must be a CUDA tensor"):
        ops.rms_norm(x.cpu(), weight, EPS, out=torch.empty_like(x))
    with pytest.raises(ValueError, match="input's last dim must be contiguous"):
        ops.rms_norm(_rows(64, 4, torch.float16).t(), weight, EPS, out=torch.empty_like(x))
    with pytest.raises(ValueError, match="eps must be finite"):
        ops.rms_norm(x, weight, float("nan"))
    with pytest.raises(ValueError, match="residual must be a tensor of its own"):
        ops.fused_add_rms_norm(x, residual, weight, EPS, out=residual)
    with pytest.raises(ValueError, match="residual.shape\\[0\\] must be 4"):
        ops.fused_add_rms_norm(x, residual[:3], weight, EPS)
    with pytest.raises(ValueError, match="out's rows overlap"):
        ops.rms_norm(x, weight, EPS, out=torch.empty(1, 64, device="cuda").half().expand(4, 64))
    with pytest.raises(ValueError, match="input.shape\\[1\\] must be even"):
        ops.silu_and_mul(_rows(4, 63, torch.float16))
    with pytest.raises(ValueError, match="out.shape\\[1\\] must be 32"):
        ops.silu_and_mul(x, out=torch.empty(4, 64, device="cuda", dtype=torch.float16))
