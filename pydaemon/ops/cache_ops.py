"""KV-cache writes and block moves on the GPU, and a swap stream ordered with events."""

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


class SwapStream:
    """Swaps whole blocks between the GPU kv_cache and a pinned CPU kv_cache on its own stream.

    gpu_kv_cache: [num_gpu_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] (cuda)
    cpu_kv_cache: [num_cpu_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] (pinned)

    Ordering: each swap first waits for the work already queued on the caller's current
    stream (the blocks it reads or overwrites may still be in use there); ``wait()`` makes the
    compute stream wait for the swaps issued so far, so call it before the forward pass that
    reads swapped-in blocks or reuses swapped-out ones. Nothing here blocks the host.
    """

    def __init__(self, gpu_kv_cache: torch.Tensor, cpu_kv_cache: torch.Tensor) -> None:
        if not gpu_kv_cache.is_cuda or cpu_kv_cache.is_cuda:
            raise ValueError("gpu_kv_cache must be on the GPU and cpu_kv_cache on the CPU")
        if not cpu_kv_cache.is_pinned():
            raise ValueError("cpu_kv_cache must be pinned (torch.empty(..., pin_memory=True))")
        if gpu_kv_cache.shape[1:] != cpu_kv_cache.shape[1:]:
            raise ValueError(
                f"block shapes differ: gpu {tuple(gpu_kv_cache.shape[1:])} vs "
                f"cpu {tuple(cpu_kv_cache.shape[1:])}"
            )
        self.gpu_kv_cache = gpu_kv_cache
        self.cpu_kv_cache = cpu_kv_cache
        self.device = gpu_kv_cache.device
        self.stream = torch.cuda.Stream(self.device)
        self._done = torch.cuda.Event()
        self._pending = False

    def _issue(self, src: torch.Tensor, dst: torch.Tensor, pairs: BlockPairs) -> None:
        if len(pairs) == 0:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        swap_blocks(src, dst, pairs, stream=self.stream.cuda_stream)
        self._done.record(self.stream)
        self._pending = True

    def swap_out(self, blocks_to_swap_out: BlockPairs) -> None:
        """(gpu_block, cpu_block) pairs: copy GPU blocks to the CPU cache."""
        self._issue(self.gpu_kv_cache, self.cpu_kv_cache, blocks_to_swap_out)

    def swap_in(self, blocks_to_swap_in: BlockPairs) -> None:
        """(cpu_block, gpu_block) pairs: copy CPU blocks back into the GPU cache."""
        self._issue(self.cpu_kv_cache, self.gpu_kv_cache, blocks_to_swap_in)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for every swap issued so far."""
        if self._pending:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self._done)

    def synchronize(self) -> None:
        """Block the host until the swaps issued so far are done (for tests / shutdown)."""
        if self._pending:
            self._done.synchronize()
