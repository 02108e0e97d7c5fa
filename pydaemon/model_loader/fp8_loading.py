"""Loading checkpoint tensors into FP8 linear layers: whatever the checkpoint gives becomes
the layout the GEMM uses, FP8 e4m3 ``weight`` [out, in] and per-output-channel float32
``weight_scale`` [out].

- an unquantized (bf16 / fp16 / fp32) weight is quantized per channel as it is copied; the
  scale of a row is its largest |value| over the whole checkpoint row, also when this rank
  holds only some of its columns (row-parallel), so the FP8 weights of a rank are the TP=1
  ones sliced, whatever the TP size;
- an FP8 weight with a per-tensor scale: that scale on each of its rows (exact; the parts of
  a fused qkv / gate_up with different scales keep each their own, still exact);
- an FP8 weight with per-channel scales [N] or [N, 1]: this rank's rows of them (exact);
- an FP8 weight with block scales [ceil(N / bn), ceil(K / bk)] (``weight_scale_inv``, or
  compressed-tensors ``block``): dequantized and re-quantized per channel once the weight
  and its scales are both loaded (``finish``). The new scale of a row is the largest of its
  blocks' scales, so the blocks that have it keep their FP8 values exactly and the others
  are rounded once more to the e4m3 grid: at most half an e4m3 step (2^-4 relative) more
  error on those values (tests/test_fp8_loading.py measures it). A layer that keeps block
  scales itself (FP8 MoE experts, pydaemon/layers/moe/fp8.py: ``weight_scale`` given as
  [rows / bn, col blocks]) takes this rank's blocks of them as they are instead; an
  unquantized weight is then quantized per block, a per-tensor scale fills every block.

A ``WeightLoader`` (pydaemon/model_loader/weight_targets.py) sends each checkpoint tensor of module P to
``Fp8Target``s: ``P.weight`` (required), ``P.weight_scale`` / ``P.weight_scale_inv`` and
``P.input_scale`` (read past: activations are always quantized per token, dynamically).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from pydaemon.config.checkpoint_format import CheckpointQuantization
from pydaemon.quantization.config import SCALE_NAMES
from pydaemon.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_per_channel, to_fp8

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_REQUANT_ROWS = 1024  # rows re-quantized at a time (bounds the float32 temporaries)


class Fp8WeightPart:
    """Checkpoint module ``prefix`` (e.g. ``model.layers.0.self_attn.k_proj``) in an FP8
    layer. weight: [rows, cols] float8 (its rows in the layer's weight), weight_scale: [rows]
    float32, or [rows / bn, ceil(cols / bk)] for a layer that keeps the checkpoint's block
    scales (``keeps_blocks``); shard: (dim, start, stop, full_size), the slice of the
    checkpoint weight [N, K] this rank holds, or None for all of it."""

    def __init__(
        self,
        prefix: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        shard: tuple[int, int, int, int] | None,
        checkpoint: CheckpointQuantization | None,
    ) -> None:
        self.prefix = prefix
        self.weight, self.weight_scale = weight, weight_scale
        if shard is not None and shard[1] == 0 and shard[2] == shard[3]:
            shard = None  # the whole tensor (TP=1)
        self.shard = shard
        self.checkpoint = checkpoint
        self.checkpoint_shape = list(weight.shape)
        if shard is not None:
            self.checkpoint_shape[shard[0]] = shard[3]
        self.weight_format: str | None = None  # "fp8" or "float": what the checkpoint held
        self.scale_name: str | None = None
        self.block_scales: torch.Tensor | None = None  # [ceil(N / bn), ceil(K / bk)] float32
        self.keeps_blocks = weight_scale.dim() == 2
        if self.keeps_blocks and (checkpoint is None or checkpoint.block_size is None):
            raise ValueError(f"{prefix}: block scales need the checkpoint's block size")

    def _range(self, dim: int) -> tuple[int, int]:
        """-> [start, stop) of this rank's rows (dim 0) or columns (dim 1)."""
        if self.shard is not None and self.shard[0] == dim:
            return self.shard[1], self.shard[2]
        return 0, self.checkpoint_shape[dim]

    def _index(self) -> tuple[slice, ...]:
        if self.shard is None:
            return (slice(None),)
        dim, start, stop, _ = self.shard
        return (slice(None),) * dim + (slice(start, stop),)

    def load_weight(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> None:
        if list(shape) != self.checkpoint_shape:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {list(shape)}, "
                f"expected {self.checkpoint_shape}"
            )
        part = tensor[self._index()]
        if part.dtype == FP8_DTYPE:
            self.weight.copy_(part)
            self.weight_format = "fp8"
            return
        if part.dtype in FP8_DTYPES or not part.dtype.is_floating_point:
            raise ValueError(
                f"tensor {name!r} in {where} has dtype {part.dtype}: FP8 layers load "
                "float8_e4m3fn weights (with scales) or bf16 / fp16 / fp32 ones"
            )
        device = self.weight.device
        if self.keeps_blocks:
            self._quantize_blocks(part.to(device))
            self.weight_format = "float"
            return
        amax = None
        if self.shard is not None and self.shard[0] == 1:  # scales over the whole rows
            amax = tensor[...].to(device).abs().amax(dim=1)
        wq, scale = quantize_per_channel(part.to(device), amax)
        self.weight.copy_(wq)
        self.weight_scale.copy_(scale)
        self.weight_format = "float"

    def load_scale(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> None:
        self.scale_name = name
        n, k = self.checkpoint_shape
        ckpt = self.checkpoint
        if name.endswith(".weight_scale_inv") or (ckpt is not None and ckpt.strategy == "block"):
            if ckpt is None or ckpt.block_size is None:
                raise ValueError(
                    f"tensor {name!r} in {where} is a block-wise weight scale, but config.json's "
                    "quantization_config names no block size (weight_block_size)"
                )
            bn, bk = ckpt.block_size
            expected = [math.ceil(n / bn), math.ceil(k / bk)]
            if list(shape) != expected:
                raise ValueError(
                    f"tensor {name!r} in {where} has shape {list(shape)}, expected {expected}: "
                    f"the scales of a [{n}, {k}] weight in blocks of [{bn}, {bk}]"
                )
            self.block_scales = tensor[...].to(self.weight_scale.device, torch.float32)
            if self.keeps_blocks:  # this rank's blocks, as they are
                rows, cols = self._block_range(0, bn), self._block_range(1, bk)
                self.weight_scale.copy_(self.block_scales[rows[0] : rows[1], cols[0] : cols[1]])
            return
        numel = math.prod(shape)
        if numel == 1:  # per tensor
            self.weight_scale.fill_(float(tensor[...].float().reshape(())))
        elif self.keeps_blocks:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {list(shape)}: this layer keeps block "
                f"scales of {list(ckpt.block_size)}, so it takes a per-tensor scale or block "
                "scales, not per-channel ones"
            )
        elif list(shape) in ([n], [n, 1]):  # per output channel
            start, stop = self._range(0)
            scale = tensor[...].reshape(n)[start:stop]
            self.weight_scale.copy_(scale.to(torch.float32))
        else:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {list(shape)}: expected a per-tensor "
                f"scale ([] or [1]) or per-channel scales ([{n}] or [{n}, 1])"
            )

    def finish(self, where: str) -> None:
        """Checks that the weight and its scales agree; re-quantizes block-wise weights."""
        if self.weight_format == "fp8" and self.scale_name is None:
            raise ValueError(
                f"tensor {self.prefix}.weight in {where} is FP8 but has no scale: expected "
                f"{self.prefix}.{' or .'.join(SCALE_NAMES)}"
            )
        if self.weight_format == "float" and self.scale_name is not None:
            raise ValueError(
                f"{where} has {self.scale_name!r}, but {self.prefix}.weight is not FP8"
            )
        if self.block_scales is not None and not self.keeps_blocks:
            self._requantize_blocks()
        self.block_scales = None

    def _block_range(self, dim: int, block: int) -> tuple[int, int]:
        """-> [start, stop) of the scale blocks of this rank's rows (0) or columns (1)."""
        start, stop = self._range(dim)
        if start % block:
            raise ValueError(f"{self.prefix}: this rank's slice starts inside a scale block")
        return start // block, -(-stop // block)

    def _quantize_blocks(self, part: torch.Tensor) -> None:
        """An unquantized [rows, cols] weight -> FP8 values and one scale per block (the
        largest |value| of the block / 448), blocks counted from this rank's first row and
        column (on block boundaries: _block_range)."""
        bn, bk = self.checkpoint.block_size
        self._block_range(0, bn)  # raises unless the slice is block-aligned
        self._block_range(1, bk)
        rows, cols = part.shape
        w = part.float()
        padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, device=w.device)
        padded[:rows, :cols] = w
        blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scales = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
        full = scales.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
        self.weight.copy_(to_fp8(w / full))
        self.weight_scale.copy_(scales)

    def _requantize_blocks(self) -> None:
        bn, bk = self.checkpoint.block_size
        device = self.weight.device
        row_start, row_stop = self._range(0)
        col_start, col_stop = self._range(1)
        # A row's new scale: the largest scale of its blocks, over the whole checkpoint row.
        row_blocks = torch.arange(row_start, row_stop, device=device) // bn
        col_blocks = torch.arange(col_start, col_stop, device=device) // bk
        new_scale = self.block_scales.amax(dim=1)[row_blocks]  # [rows]
        for r0 in range(0, row_stop - row_start, _REQUANT_ROWS):
            r1 = min(r0 + _REQUANT_ROWS, row_stop - row_start)
            block_scales = self.block_scales[row_blocks[r0:r1]][:, col_blocks]  # [r, cols]
            ratio = block_scales / new_scale[r0:r1, None]  # <= 1: no value grows
            self.weight[r0:r1] = to_fp8(self.weight[r0:r1].float() * ratio)
        self.weight_scale.copy_(new_scale)


class Fp8Target:
    """One checkpoint tensor name of an Fp8WeightPart: role "weight", "scale" or
    "input_scale" (accepted and unused)."""

    def __init__(self, part: Fp8WeightPart, role: str) -> None:
        self.part, self.role = part, role
        self.required = role == "weight"

    @property
    def checkpoint_shape(self) -> list[int]:
        return self.part.checkpoint_shape

    def load(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> None:
        if self.role == "weight":
            self.part.load_weight(name, tensor, shape, where)
        elif self.role == "scale":
            self.part.load_scale(name, tensor, shape, where)

    def finish(self, where: str) -> None:
        if self.role == "weight":
            self.part.finish(where)


def fp8_targets(
    prefix: str,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    shard: tuple[int, int, int, int] | None,
    checkpoint: CheckpointQuantization | None,
) -> dict[str, Fp8Target]:
    """-> checkpoint tensor name -> target, for the FP8 weight of checkpoint module
    ``prefix`` (weight, weight_scale: this part's rows of the layer's parameters)."""
    part = Fp8WeightPart(prefix, weight, weight_scale, shard, checkpoint)
    targets = {f"{prefix}.weight": Fp8Target(part, "weight")}
    for scale_name in SCALE_NAMES:
        targets[f"{prefix}.{scale_name}"] = Fp8Target(part, "scale")
    targets[f"{prefix}.input_scale"] = Fp8Target(part, "input_scale")
    return targets
