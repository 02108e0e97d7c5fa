"""The rotary embedding kernel: bit-equal to the torch expression it replaces (the one that
matches transformers), close to a float64 reference, in place on views of the fused QKV
output, for GQA ratios 1/4/8 and head dims 64/128/256."""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops
from pydaemon.config.model import RopeScaling
from pydaemon.layers.rotary_embedding import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_qk,
    rotate_half,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Inputs reach |x| ~ 15, where one fp16 ulp is 2^-7 and one bf16 ulp 2^-4: cos/sin rounded to
# the dtype, two rounded products and a rounded sum (a difference, near zero) give up to about
# two ulps of absolute error there. Bit equality with the torch path is the strict check.
TOL = {torch.float16: (4e-3, 1.6e-2), torch.bfloat16: (3e-2, 1.3e-1), torch.float32: (1e-5, 1e-5)}
LLAMA3 = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)  # fmt: skip


def _qkv(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v as views of one fused [T, (heads + 2 kv_heads) * head_dim] buffer."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (3 * torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda")).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    shape = (num_tokens, -1, head_dim)
    return qkv, q.view(*shape), k.view(*shape), v.view(*shape)


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("num_tokens", [1, 7, 513])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(32, 32, 128), (32, 8, 128), (16, 2, 64), (8, 1, 256)])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_the_torch_path_and_is_close_to_float64(
    dtype, heads, kv_heads, head_dim, num_tokens
):
    rope = RotaryEmbedding(head_dim, 500000.0, LLAMA3, device="cuda")
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    cos, sin = rope(positions)
    qkv, q, k, v = _qkv(num_tokens, heads, kv_heads, head_dim, dtype)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    want_q, want_k = apply_rotary(q0, cos, sin), apply_rotary(k0, cos, sin)
    got_q, got_k = apply_rotary_qk(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr(), "in place"
    assert torch.equal(got_q, want_q), (got_q - want_q).abs().max()
    assert torch.equal(got_k, want_k), (got_k - want_k).abs().max()
    assert torch.equal(v, v0), "v (the rest of the fused buffer) must be untouched"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got_q.double(), _reference(q0, cos, sin), rtol=rtol, atol=atol)
    torch.testing.assert_close(got_k.double(), _reference(k0, cos, sin), rtol=rtol, atol=atol)


def test_zero_tokens_and_bad_arguments():
    cos = torch.zeros(0, 128, device="cuda")
    q = torch.zeros(0, 4, 128, device="cuda", dtype=torch.bfloat16)
    ops.rotary_embedding(q, q[:, :1], cos, cos)  # nothing to do, no error
    _, q, k, _ = _qkv(4, 4, 2, 64, torch.bfloat16)
    cos = torch.zeros(4, 64, device="cuda")
    with pytest.raises(TypeError, match="cos must be float32"):
        ops.rotary_embedding(q, k, cos.half(), cos)
    with pytest.raises(TypeError, match="key must have the dtype of query"):
        ops.rotary_embedding(q, k.half(), cos, cos)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ops.rotary_embedding(q[..., :63], k[..., :63], cos[:, :63], cos[:, :63])
    with pytest.raises(ValueError, match="cos.shape\\[0\\] must be 4"):
        ops.rotary_embedding(q, k, cos[:3], cos)
    strided = torch.zeros(4, 64, 4, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match="query's last dim must be contiguous"):
        ops.rotary_embedding(strided, k, cos, cos)
