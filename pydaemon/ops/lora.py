"""Batched LoRA on the GPU: Punica's BGMV shrink and expand, each token with its own slot.

Both read ``token_slots`` on the device and allocate nothing inside the kernels, so a CUDA
graph that captured them stays right when the slots' contents or ``token_slots`` change in
place. A slot outside ``[0, num_slots)`` (-1: no adapter) reads no weights.
"""

from __future__ import annotations

import torch

from pydaemon.ops._core_ext import arg, core, stream_handle


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """xa[t, k] = sum_i x[t, i] * lora_a[token_slots[t], k, i], summed in float32.

    x:            [num_tokens, in_features] fp16/bf16, last dim contiguous
    lora_a:       [num_slots, num_parts * rank, in_features], x's dtype, contiguous
    token_slots:  [num_tokens] int64 (-1: no adapter, xa[t, :] = 0)
    out:          optional xa to write, [num_tokens, num_parts * rank] float32, contiguous
                  (allocated by the caller on another stream: see punica.fork_lora_shrink)
    returns       xa [num_tokens, num_parts * rank] float32
    """
    xa = out
    if xa is None:
        xa = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    core().lora_shrink(arg(xa), arg(x), arg(lora_a), arg(token_slots), stream_handle(x.device))
    return xa


def lora_expand(
    y: torch.Tensor,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    part_starts: tuple[int, ...],
    token_slots: torch.Tensor,
) -> None:
    """y[t, c] += sum_r xa[t, j * rank + r] * lora_b[token_slots[t], r, c], in place, for the
    part j whose columns hold c; float32 sums, rounded once to y's dtype.

    y:            [num_tokens, out_features] fp16/bf16, last dim contiguous (updated)
    xa:           [num_tokens, num_parts * rank] float32, contiguous (lora_shrink's)
    lora_b:       [num_slots, rank, out_features], y's dtype, contiguous
    part_starts:  num_parts + 1 column offsets (num_parts <= 4): part j owns
                  [part_starts[j], part_starts[j + 1]), from 0 to out_features
    token_slots:  [num_tokens] int64 (-1: no adapter, the row is left alone)
    """
    core().lora_expand(
        arg(y), arg(xa), arg(lora_b), part_starts, arg(token_slots), stream_handle(y.device)
    )
