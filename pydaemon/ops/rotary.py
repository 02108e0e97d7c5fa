"""The rotary position embedding on the GPU: query and key rotated in place, one launch."""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import core, stream_handle


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates query and key in place, rounded as transformers' apply_rotary_pos_emb.

    query:    [num_tokens, num_heads, head_dim] fp16/bf16/fp32, last dim contiguous (a view
              of the fused QKV output is fine)
    key:      [num_tokens, num_kv_heads, head_dim], same dtype
    cos, sin: [num_tokens, head_dim] float32, last dim contiguous
    """
    core().rotary_embedding(query, key, cos, sin, stream_handle(query.device))
