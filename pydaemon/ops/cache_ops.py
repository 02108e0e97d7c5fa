"""KV-cache writes and block moves on the GPU (the copy stream and its events that order the
moves with a step are the worker's: pydaemon/worker/kv_transfer.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pydaemon.ops._core_ext import arg, core, kv_cache_arg, stream_handle

BlockPairs = Sequence[tuple[int, int]] | torch.Tensor


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store the new tokens' K and V in the paged cache, in place.

    key, value:   [num_tokens, num_kv_heads, head_dim], last dim contiguous
    key_cache:    [num_blocks, num_kv_heads, block_size, head_dim] (kv_cache[:, l, 0]), the
                  dtype of key, or float8_e4m3fn (then key / value must be fp16 / bf16)
    value_cache:  same shape, dtype and strides (kv_cache[:, l, 1])
    slot_mapping: [num_tokens] int64 on the GPU; slot = block_id * block_size + offset,
                  negative slots (padding) are skipped
    k_scale, v_scale: fp8 cache only: it stores saturate(key / k_scale), saturate(value /
                  v_scale), rounded to nearest even
    """
    core().reshape_and_cache(
        arg(key),
        arg(value),
        kv_cache_arg(key_cache),
        kv_cache_arg(value_cache),
        arg(slot_mapping),
        float(k_scale),
        float(v_scale),
        stream_handle(key.device),
    )


def _pairs_tensor(pairs: BlockPairs, device: torch.device) -> torch.Tensor:
    """[n, 2] int64 on ``device``; a host list goes through pinned memory without a sync."""
    if isinstance(pairs, torch.Tensor):
        return pairs.to(device=device, non_blocking=True)
    host = torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)
    return host.pin_memory().to(device, non_blocking=True)


def copy_blocks(kv_cache: torch.Tensor, blocks_to_copy: BlockPairs) -> None:
    """Copy-on-write: kv_cache[dst] = kv_cache[src] for every (src, dst), all layers at once.

    kv_cache:       [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] contiguous
                    (any contiguous [num_blocks, ...] tensor works)
    blocks_to_copy: (src, dst) pairs, a list or an [n, 2] int64 tensor. No dst may also be
                    a src of the same call (copies run concurrently).
    """
    if len(blocks_to_copy) == 0:
        return
    mapping = _pairs_tensor(blocks_to_copy, kv_cache.device)
    core().copy_blocks(kv_cache_arg(kv_cache), arg(mapping), stream_handle(kv_cache.device))


def swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, block_mapping: BlockPairs, stream: int | None = None
) -> None:
    """dst[d] = src[s] for every (s, d): whole blocks between a GPU and a pinned CPU cache.

    src, dst:      [num_blocks_src / num_blocks_dst, ...] contiguous, same per-block shape
                   and dtype; one on the GPU, the other pinned on the CPU (or both GPU)
    block_mapping: (src_block, dst_block) pairs, a list or an [n, 2] int64 CPU tensor
    stream:        raw CUDA stream handle, default the current stream of the GPU side
    """
    if len(block_mapping) == 0:
        return
    if isinstance(block_mapping, torch.Tensor):
        mapping = block_mapping.to("cpu").contiguous()
    else:
        mapping = torch.tensor(list(block_mapping), dtype=torch.int64).reshape(-1, 2)
    gpu = src if src.is_cuda else dst
    if stream is None:
        stream = stream_handle(gpu.device)
    core().swap_blocks(kv_cache_arg(src), kv_cache_arg(dst), arg(mapping), stream)
