"""Partial rotary embeddings (rotary_dim < head_dim) and YaRN's scaled cos/sin in the rotary
kernels: bit-equal to the torch expression (transformers' convention: the first rotary_dim dims
rotate, the rest pass), alone and fused with the KV-cache write (the whole cache compared, the
key's passed-through dims stored as they are), fp16/bf16/fp32 and an fp8 cache."""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops
from pydaemon.config.rope import RopeScaling
from pydaemon.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE

YARN = RopeScaling("yarn", 32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                   beta_slow=1.0, truncate=False, attention_factor=1.3465735902799727)  # fmt: skip
# (head_dim, rotary_dim): halves, quarters, odd vector counts (the scalar path), the whole head.
DIMS = [(128, 64), (128, 32), (64, 16), (96, 48), (80, 24), (128, 128)]


def _inputs(num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype, scaling):
    q = (3 * torch.randn(num_tokens, heads, head_dim, device="cuda")).to(dtype)
    k = (3 * torch.randn(num_tokens, kv_heads, head_dim, device="cuda")).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, device="cuda").to(dtype)
    rope = RotaryEmbedding(rotary_dim, 150000.0, scaling, device="cuda")
    cos, sin = rope(torch.randint(0, 100_000, (num_tokens,), device="cuda"))
    return q, k, v, cos, sin


@pytest.mark.parametrize("scaling", [None, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"hd{d[0]}r{d[1]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_partial_rotary_kernel_equals_torch(dtype, dims, scaling):
    head_dim, rotary_dim = dims
    q, k, _, cos, sin = _inputs(37, 8, 2, head_dim, rotary_dim, dtype, scaling)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ops.rotary_embedding(q, k, cos, sin)
    assert torch.equal(q, want_q), (q - want_q).abs().max()
    assert torch.equal(k, want_k), (k - want_k).abs().max()


@pytest.mark.parametrize("cache", ["model", "fp8"])
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"hd{d[0]}r{d[1]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_partial_rotary_fused_with_the_cache_write(dtype, dims, cache):
    head_dim, rotary_dim = dims
    num_tokens, block_size, num_blocks = 37, 16, 8
    q, k, v, cos, sin = _inputs(num_tokens, 8, 2, head_dim, rotary_dim, dtype, YARN)
    cache_dtype = FP8_DTYPE if cache == "fp8" else dtype
    shape = (num_blocks, 2, 2, block_size, head_dim)  # [blocks, K/V, kv heads, block, dim]
    kv = torch.randn(shape, device="cuda").to(cache_dtype)
    want = kv.clone()
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[5::7] = -1  # padding: rotated, not stored
    q_ref, k_ref = q.clone(), k.clone()
    ops.rotary_embedding(q_ref, k_ref, cos, sin)
    ops.reshape_and_cache(k_ref, v, want[:, 0], want[:, 1], slots, 0.5, 0.25)
    ops.rotary_embedding_and_cache(q, k, v, kv[:, 0], kv[:, 1], slots, cos, sin, 0.5, 0.25)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(kv.view(torch.uint8), want.view(torch.uint8))


def test_partial_rotary_bad_arguments():
    q, k, _, cos, sin = _inputs(4, 4, 2, 64, 32, torch.bfloat16, None)
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rotary_embedding(q, k, cos[:, :31].contiguous(), sin[:, :31].contiguous())
    wide = torch.zeros(4, 66, device="cuda")
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rotary_embedding(q, k, wide, wide)
