"""Where each checkpoint tensor goes in a model: Hugging Face tensor name -> destination.

Checkpoints keep q_proj / k_proj / v_proj and gate_proj / up_proj apart; the model packs them
into one GEMM each (``qkv_proj``, ``gate_up_proj``: MergedColumnParallelLinear). This is vLLM's
stacked_params_mapping, at the level of names: ``model.layers.3.self_attn.k_proj.weight`` goes
to the k rows of ``model.layers.3.self_attn.qkv_proj.weight``. Under tensor parallelism each
destination also says which slice of the checkpoint tensor this rank reads.

Every source of HF-named tensors (safetensors files, dummy weights, GGUF after its name
mapping) loads through ``WeightLoader``, so each gets the packed layout and the TP slicing:

    loader = WeightLoader(model)
    for name, tensor in tensors:        # HF names; a tensor or a lazy safetensors slice
        loader.load(name, tensor, tensor.shape, where="model.gguf")
    loader.check_complete(where="model.gguf")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pydaemon.layers.parallel_linear import MergedColumnParallelLinear, shard_range


@dataclass(frozen=True)
class WeightTarget:
    """dest: the parameter data one checkpoint tensor fills (a parameter, or the rows of one
    part of a packed parameter). shard: (dim, start, stop, full_size), the slice of the
    checkpoint tensor this rank reads along dim, or None when it reads all of it; stop -
    start may be below dest's size along dim (vocabulary padding on the last rank: zeroed)."""

    dest: torch.Tensor
    shard: tuple[int, int, int, int] | None

    @property
    def checkpoint_shape(self) -> list[int]:
        shape = list(self.dest.shape)
        if self.shard is not None:
            shape[self.shard[0]] = self.shard[3]
        return shape

    def read_index(self) -> tuple[slice, ...]:
        """Index of this rank's part of the checkpoint tensor."""
        if self.shard is None:
            return (slice(None),)
        dim, start, stop, _ = self.shard
        return (slice(None),) * dim + (slice(start, stop),)

    def copy_(self, part: torch.Tensor) -> None:
        """part: the checkpoint tensor indexed by ``read_index()``."""
        if self.shard is None:
            self.dest.copy_(part)
            return
        dim, start, stop, _ = self.shard
        self.dest.narrow(dim, 0, stop - start).copy_(part)
        padding = self.dest.shape[dim] - (stop - start)
        if padding > 0:  # vocabulary padding of the last rank
            self.dest.narrow(dim, stop - start, padding).zero_()


def weight_targets(model: nn.Module) -> dict[str, WeightTarget]:
    """-> checkpoint tensor name -> destination, for every tensor the model needs, in the
    model's parameter order (packed parameters expanded part by part: q.weight, q.bias,
    k.weight, ...; the order dummy weights are drawn in)."""
    targets: dict[str, WeightTarget] = {}
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if isinstance(module, MergedColumnParallelLinear):
            parent = module_name.rpartition(".")[0]
            for index, part in enumerate(module.packed_parts):
                offset, size, start, full_size = module.part_range(index)
                for local, param in params:
                    name = f"{parent}.{part}.{local}" if parent else f"{part}.{local}"
                    dest = param.data.narrow(0, offset, size)
                    targets[name] = WeightTarget(dest, (0, start, start + size, full_size))
            continue
        for local, param in params:
            name = f"{module_name}.{local}" if module_name else local
            targets[name] = WeightTarget(param.data, shard_range(module, local))
    return targets


class WeightLoader:
    """Copies HF-named checkpoint tensors into a model's parameters, one at a time."""

    def __init__(self, model: nn.Module) -> None:
        self.targets = weight_targets(model)
        self.loaded: set[str] = set()

    def load(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> bool:
        """Copies this rank's part of checkpoint tensor ``name`` (shape ``shape``, from
        ``where``) into the model; -> False for a tensor the model does not use (the LM head
        of a tied model, rotary inv_freq, ...). ``tensor``: a torch.Tensor or a lazy
        safetensors slice (only this rank's part is read)."""
        target = self.targets.get(name)
        if target is None:
            return False
        expected = target.checkpoint_shape
        if list(shape) != expected:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {list(shape)}, expected {expected}"
            )
        target.copy_(tensor[target.read_index()])
        self.loaded.add(name)
        return True

    def check_complete(self, where: str) -> None:
        """ValueError naming the checkpoint tensors the model needs and never got."""
        missing = [name for name in self.targets if name not in self.loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"missing tensors in {where}: {shown}")
