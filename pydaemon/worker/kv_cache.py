"""The paged KV cache tensors: sizing and allocation (layout in attention_metadata.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return math.prod(self.block_shape) * elem

    def num_blocks_for_bytes(self, num_bytes: float) -> int:
        return int(num_bytes // self.block_bytes)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """kv_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]. A device
        cache starts zero-filled: a block a sliding window released may be read (and masked)
        through a table entry that now shows block 0, so every block must read finite."""
        return torch.zeros((num_blocks, *self.block_shape), dtype=self.dtype, device=device)

    def allocate_host_pool(self, num_blocks: int, pin_memory: bool) -> torch.Tensor:
        """The CPU pool (swap space + CPU tier): [num_blocks, num_layers, 2, num_kv_heads,
        block_size, head_dim]. Every block is written before it is read, so it is not filled:
        unpinned (a CPU engine), the OS commits its pages only as blocks are written (the
        default 4 GiB of swap, zero-filled, took 4.1 GB of the CPU daemon's 6.4 GB at start);
        pinned pages are resident at once."""
        return torch.empty((num_blocks, *self.block_shape), dtype=self.dtype, pin_memory=pin_memory)


def layer_caches(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided views key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]


class LayerSlotCache:
    """The model's view of a cache of per-layer-group tables (core/kv_groups.py): the pool is
    [num_blocks, num_slots, 2, num_kv_heads, block_size, head_dim] and a model's
    ``kv_cache[:, layer, kv]`` reads layer ``layer``'s slot."""

    def __init__(self, pool: torch.Tensor, layer_slot: tuple[int, ...]) -> None:
        self.pool = pool
        self.layer_slot = layer_slot

    def __getitem__(self, key: tuple) -> torch.Tensor:
        rows, layer, *rest = key
        return self.pool[(rows, self.layer_slot[layer], *rest)]
