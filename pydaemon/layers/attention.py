"""The paged attention layer: writes new K/V through the slot mapping, then attends through
the block table. Backend selection lives here and only here."""

from __future__ import annotations

import torch
from torch import nn

from pydaemon.attention_metadata import AttentionMetadata
from pydaemon.layers.paged_attention_torch import paged_attention_torch, write_kv_cache_torch


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        write_kv_cache_torch(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        out = paged_attention_torch(query, key_cache, value_cache, attn_metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
