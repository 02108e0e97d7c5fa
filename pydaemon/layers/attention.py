"""The paged attention layer: writes new K/V through the slot mapping, then attends through
the block table. Backend selection lives here and only here:

- CUDA with the pagedd kernels (fp16/bf16): ``reshape_and_cache`` kernel for the cache
  writes, the split-KV paged decode kernel for decode tokens, torch SDPA over K/V gathered
  through the block table for prefill (chunks); no host-device sync.
- otherwise (CPU, float32, or a build without kernels): the plain torch path.

A layer with a sliding window (Mistral, Qwen2/3) keeps the kernel cache writes but attends on
the torch path, which applies the window (the CUDA decode kernel has none).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from pydaemon.attention_metadata import AttentionMetadata
from pydaemon.layers.paged_attention_torch import (
    paged_attention_torch,
    paged_decode_torch,
    paged_prefill_torch,
    write_kv_cache_torch,
)

# "auto": the CUDA kernels where they apply; "torch": always the torch path (debugging, A/B).
BACKEND = os.environ.get("PAGEDD_ATTENTION_BACKEND", "auto")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (64, 80, 96, 128, 256)


@functools.cache
def _kernels_available() -> bool:
    from pydaemon import ops

    return ops.is_available()


def uses_kernels(cache: torch.Tensor) -> bool:
    """True when this cache tensor is served by the CUDA kernels."""
    return (
        BACKEND != "torch"
        and cache.is_cuda
        and cache.dtype in KERNEL_DTYPES
        and cache.shape[-1] in KERNEL_HEAD_DIMS
        and _kernels_available()
    )


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # tokens a query sees (itself included); None: all

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        if uses_kernels(key_cache):
            out = self._forward_cuda(query, key, value, key_cache, value_cache, attn_metadata)
        else:
            write_kv_cache_torch(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
            out = paged_attention_torch(
                query, key_cache, value_cache, attn_metadata, self.scale, self.sliding_window
            )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _forward_cuda(self, query, key, value, key_cache, value_cache, md: AttentionMetadata):
        from pydaemon import ops

        ops.reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping)
        out = torch.empty_like(query)
        window = self.sliding_window
        start = paged_prefill_torch(query, key_cache, value_cache, md, self.scale, out, window)
        if window is not None:
            paged_decode_torch(query, key_cache, value_cache, md, self.scale, out, start, window)
        elif md.num_decodes > 0:
            p = md.num_prefills
            ops.paged_attention_decode(
                query[start:],
                key_cache,
                value_cache,
                md.block_tables[p:],
                md.seq_lens[p:],
                max(md.seq_lens_cpu[p:]),  # host list: no device read-back
                scale=self.scale,
                out=out[start:],
            )
        return out
