"""The rotary position embedding on the GPU: query and key rotated in place, one launch;
alone, or fused with the KV-cache write of the rotated key and the value."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, kv_cache_arg, stream_handle


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates query and key in place, rounded as transformers' apply_rotary_pos_emb.

    query:    [num_tokens, num_heads, head_dim] fp16/bf16/fp32, last dim contiguous (a view
              of the fused QKV output is fine)
    key:      [num_tokens, num_kv_heads, head_dim], same dtype
    cos, sin: [num_tokens, head_dim] float32, last dim contiguous
    """
    core().rotary_embedding(arg(query), arg(key), arg(cos), arg(sin), stream_handle(query.device))


def rotary_embedding_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``rotary_embedding(query, key, cos, sin)`` then ``reshape_and_cache(key, value, ...)``
    in one launch, with the same bits: query and key rotated in place, the rotated key and the
    value stored in the paged cache.

    query:        [num_tokens, num_heads, head_dim] fp16/bf16/fp32, last dim contiguous (a
                  view of the fused QKV output is fine)
    key, value:   [num_tokens, num_kv_heads, head_dim], query's dtype, last dim contiguous
    key_cache:    [num_blocks, num_kv_heads, block_size, head_dim] (kv_cache[:, l, 0]), the
                  dtype of key, or float8_e4m3fn (then query / key / value are fp16 / bf16)
    value_cache:  same shape, dtype and strides (kv_cache[:, l, 1])
    slot_mapping: [num_tokens] int64 on the GPU; slot = block_id * block_size + offset; a
                  negative slot (padding) is rotated but not stored
    cos, sin:     [num_tokens, head_dim] float32, last dim contiguous
    k_scale, v_scale: fp8 cache only: it stores saturate(key / k_scale), saturate(value /
                  v_scale), rounded to nearest even
    """
    core().rotary_embedding_and_cache(
        arg(query),
        arg(key),
        arg(value),
        kv_cache_arg(key_cache),
        kv_cache_arg(value_cache),
        arg(slot_mapping),
        arg(cos),
        arg(sin),
        float(k_scale),
        float(v_scale),
        stream_handle(query.device),
    )
