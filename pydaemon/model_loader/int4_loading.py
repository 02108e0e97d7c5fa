"""Loading 4-bit integer checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) into the
engine's int4 layout (pydaemon/quantization/int4.py), one checkpoint module at a time.

A module's tensors (e.g. AWQ's ``qweight``, ``qzeros``, ``scales``) may sit in different
shards: an ``Int4WeightPart`` collects them, then (``finish``) unpacks them with its format's
reader (pydaemon/quantization/awq.py, gptq.py, compressed_tensors_int4.py) into the logical
[N, K] codes, [N, K / G] scales and zero points and [K] group index, takes this rank's slice
(output rows for a column-parallel part, whole groups of input columns for a row-parallel
one), sorts act-order columns into groups (the layer's ``perm``, which every part of a fused
layer must share) and packs them into the layer's parameters. A row-parallel act-order shard
under tensor parallelism is dequantized into the layer's ``weight`` instead (int4_linear.py).

Dummy weights (``load_format="dummy"``): ``load_float`` quantizes a float [N, K] weight to
nearest per group (symmetric, or with zero points for asymmetric formats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pydaemon.config.weight_only_format import Int4Checkpoint
from pydaemon.quantization import awq, compressed_tensors_int4, gptq
from pydaemon.quantization.int4 import (
    act_order_permutation,
    pack_int4,
    quantize_int4,
)

_READERS = {
    "awq": awq.READER,
    "gptq": gptq.READER,
    "compressed-tensors": compressed_tensors_int4.READER,
}


@dataclass
class Int4Dest:
    """Where one checkpoint module goes: its rows of the layer's (or expert's) parameters."""

    qweight: torch.Tensor | None  # [rows, K_local / 8] int32 (None: dense)
    scales: torch.Tensor | None  # [rows, K_local / G]
    qzeros: torch.Tensor | None  # [rows, K_local / G] uint8, asymmetric formats
    perm: torch.Tensor | None  # [K_local] int32, act-order (shared by a fused layer's parts)
    weight: torch.Tensor | None = None  # [rows, K_local]: a dense (dequantized) layer
    # Shared by the parts of one fused layer (or expert): whether ``perm`` was written.
    perm_written: dict[str, bool] | None = None


class Int4WeightPart:
    """Checkpoint module ``prefix`` of logical weight [N, K] in an int4 layer. shard: (dim,
    start, stop, full_size), the slice of [N, K] this rank holds, or None for all of it."""

    def __init__(
        self,
        prefix: str,
        fmt: Int4Checkpoint,
        dest: Int4Dest,
        shape: tuple[int, int],
        shard: tuple[int, int, int, int] | None,
    ) -> None:
        self.prefix, self.fmt, self.dest = prefix, fmt, dest
        self.reader = _READERS[fmt.quant_method]
        self.shape = shape
        self.shard = None if shard is None or (shard[1] == 0 and shard[2] == shard[3]) else shard
        self.tensors: dict[str, torch.Tensor] = {}
        self.done = False

    @property
    def device(self) -> torch.device:
        t = self.dest.weight if self.dest.weight is not None else self.dest.qweight
        return t.device

    @property
    def group_size(self) -> int:
        return self.fmt.group_size or self.shape[1]

    def load(self, role: str, name: str, tensor: Any, shape: Sequence[int], where: str) -> None:
        expected = self.reader.shapes(self.shape, self.group_size, self.fmt).get(role)
        if expected is not None and list(shape) != list(expected):
            raise ValueError(
                f"tensor {name!r} in {where} has shape {list(shape)}, expected {list(expected)} "
                f"({self.fmt.quant_method}, weight [{self.shape[0]}, {self.shape[1]}], group "
                f"size {self.group_size})"
            )
        self.tensors[role] = tensor[...].to(self.device)

    def load_float(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float -> quantized to nearest (dummy weights)."""
        q, scales, zeros = quantize_int4(
            weight.to(self.device), self.group_size, symmetric=not self.fmt.has_zero_point
        )
        self._store(q, scales, zeros, None, "dummy")
        self.done = True

    def finish(self, where: str) -> None:
        if self.done:
            return
        self.done = True
        missing = [r for r in self.reader.required(self.fmt) if r not in self.tensors]
        if missing:
            names = ", ".join(f"{self.prefix}.{r}" for r in missing)
            raise ValueError(f"missing tensors in {where}: {names}")
        q, scales, zeros, g_idx = self.reader.unpack(self.tensors, self.shape, self.fmt)
        self.tensors.clear()
        self._store(q, scales, zeros, g_idx, where)

    def _store(
        self,
        q: torch.Tensor,  # [N, K] uint8 codes 0..15
        scales: torch.Tensor,  # [N, K / G]
        zeros: torch.Tensor,  # [N, K / G] uint8
        g_idx: torch.Tensor | None,  # [K] the group of each input column, or None
        where: str,
    ) -> None:
        g = self.group_size
        if g_idx is not None and not self.fmt.desc_act:
            if not torch.equal(g_idx.long().cpu(), torch.arange(self.shape[1]) // g):
                raise ValueError(
                    f"{self.prefix}.g_idx in {where} orders the input columns out of groups "
                    "(act-order), but config.json's quantization_config does not say desc_act"
                )
            g_idx = None
        if self.fmt.desc_act and g_idx is None:
            raise ValueError(
                f"missing tensors in {where}: {self.prefix}'s group index (g_idx): the "
                "checkpoint is act-order (desc_act)"
            )
        dest = self.dest
        if dest.weight is not None:  # a dense layer: dequantize this rank's columns
            cols = (
                g_idx.long()
                if g_idx is not None
                else torch.arange(q.shape[1], device=q.device) // g
            )
            cols = cols.to(q.device)
            w = (q.float() - zeros.float()[:, cols]) * scales.float()[:, cols]
            dest.weight.copy_(w[self._index()])
            return
        if self.shard is not None:
            dim, start, stop, _ = self.shard
            if dim == 0:
                q, scales, zeros = q[start:stop], scales[start:stop], zeros[start:stop]
            else:
                q = q[:, start:stop]
                if self.fmt.group_size is not None:
                    scales = scales[:, start // g : stop // g]
                    zeros = zeros[:, start // g : stop // g]
        if g_idx is not None:
            perm = act_order_permutation(g_idx, g)
            if perm is None:
                raise ValueError(
                    f"{self.prefix}.g_idx in {where} does not put exactly {g} input columns in "
                    "each group: not an act-order group index this engine reads"
                )
            q = q[:, perm]
            perm32 = perm.to(torch.int32)
            written = dest.perm_written if dest.perm_written is not None else {}
            if written.get("perm") and not torch.equal(dest.perm, perm32):
                raise ValueError(
                    f"{self.prefix}.g_idx in {where} differs from the other parts fused "
                    "with it into one layer (q/k/v, gate/up): their act-order must agree"
                )
            dest.perm.copy_(perm32)
            written["perm"] = True
        dest.qweight.copy_(pack_int4(q))
        dest.scales.copy_(scales.to(dest.scales.dtype))
        if dest.qzeros is not None:
            dest.qzeros.copy_(zeros)
        elif not bool((zeros == 8).all()):
            raise ValueError(
                f"{self.prefix} in {where} has zero points other than 8, but config.json's "
                "quantization_config says the checkpoint is symmetric"
            )

    def _index(self) -> tuple[slice, ...]:
        if self.shard is None:
            return (slice(None),)
        dim, start, stop, _ = self.shard
        return (slice(None),) * dim + (slice(start, stop),)


class Int4Target:
    """One checkpoint tensor name of an Int4WeightPart (``role``: the format's name for it,
    e.g. "qweight")."""

    def __init__(self, part: Int4WeightPart, role: str, required: bool) -> None:
        self.part, self.role, self.required = part, role, required

    @property
    def checkpoint_shape(self) -> list[int]:
        return list(self.part.shape)

    def load(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> None:
        self.part.load(self.role, name, tensor, shape, where)

    def finish(self, where: str) -> None:
        self.part.finish(where)


def int4_targets(
    prefix: str,
    fmt: Int4Checkpoint,
    dest: Int4Dest,
    shape: tuple[int, int],
    shard: tuple[int, int, int, int] | None,
) -> dict[str, Int4Target]:
    """-> checkpoint tensor name -> target, for the int4 weight of checkpoint module
    ``prefix`` (logical [N, K] = ``shape``)."""
    part = Int4WeightPart(prefix, fmt, dest, shape, shard)
    reader = part.reader
    required = reader.required(fmt)
    return {
        f"{prefix}.{role}": Int4Target(part, role, role in required) for role in reader.roles(fmt)
    }
