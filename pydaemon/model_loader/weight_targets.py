"""Where each checkpoint tensor goes in a model: Hugging Face tensor name -> destination.

Checkpoints keep q_proj / k_proj / v_proj and gate_proj / up_proj apart; the model packs them
into one GEMM each (``qkv_proj``, ``gate_up_proj``: MergedColumnParallelLinear). This is vLLM's
stacked_params_mapping, at the level of names: ``model.layers.3.self_attn.k_proj.weight`` goes
to the k rows of ``model.layers.3.self_attn.qkv_proj.weight``. Mixture-of-experts checkpoints
keep one tensor per expert (``mlp.experts.5.up_proj.weight``): each goes to its expert's rows
of the stacked ``w13_weight`` / ``w2_weight`` of the FusedMoE layer (layers/moe/layer.py); gpt-oss's stacked, interleaved expert tensors
are de-interleaved and transposed on the way (stacked_experts.py). Under tensor parallelism each
destination also says which slice of the checkpoint tensor this rank reads.

Every source of HF-named tensors (safetensors files, dummy weights, GGUF after its name
mapping) loads through ``WeightLoader``, so each gets the packed layout and the TP slicing:

    loader = WeightLoader(model)
    for name, tensor in tensors:        # HF names; a tensor or a lazy safetensors slice
        loader.load(name, tensor, tensor.shape, where="model.gguf")
    loader.check_complete(where="model.gguf")

A quantized layer (``LinearBase.quant_method``) takes its weights through the method's own
targets (pydaemon/model_loader/fp8_loading.py: an FP8 weight and its scales, or an
unquantized weight quantized as it is copied); its bias loads as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pydaemon.layers.moe import FusedMoE
from pydaemon.layers.parallel_linear import LinearBase, MergedColumnParallelLinear, shard_range
from pydaemon.model_loader.fp8_loading import FP8_DTYPES, Fp8Target, fp8_targets
from pydaemon.model_loader.stacked_experts import gpt_oss_expert_parts


@dataclass(frozen=True)
class WeightTarget:
    """dest: the parameter data one checkpoint tensor fills (a parameter, or the rows of one
    part of a packed parameter). shard: (dim, start, stop, full_size), the slice of the
    checkpoint tensor this rank reads along dim, or None when it reads all of it; stop -
    start may be below dest's size along dim (vocabulary padding on the last rank: zeroed)."""

    dest: torch.Tensor
    shard: tuple[int, int, int, int] | None
    # A checkpoint tensor stored in another layout (stacked_experts.py): maps this rank's part
    # to dest's shape; full_shape is then the checkpoint tensor's shape.
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    full_shape: tuple[int, ...] | None = None
    required = True  # check_complete reports it when the checkpoint lacks it

    @property
    def checkpoint_shape(self) -> list[int]:
        if self.full_shape is not None:
            return list(self.full_shape)
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
        if self.transform is not None:
            self.dest.copy_(self.transform(part))
            return
        if self.shard is None:
            self.dest.copy_(part)
            return
        dim, start, stop, _ = self.shard
        self.dest.narrow(dim, 0, stop - start).copy_(part)
        padding = self.dest.shape[dim] - (stop - start)
        if padding > 0:  # vocabulary padding of the last rank
            self.dest.narrow(dim, stop - start, padding).zero_()

    def load(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> None:
        """Copies this rank's part of checkpoint tensor ``name`` (shape ``shape``)."""
        expected = self.checkpoint_shape
        if list(shape) != expected:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {list(shape)}, expected {expected}"
            )
        part = tensor[self.read_index()]
        if part.dtype in FP8_DTYPES:  # a plain copy would drop its scale
            raise ValueError(
                f"tensor {name!r} in {where} is {part.dtype}, but the model holds it unquantized "
                "(the LM head, the embedding, or a layer config.json's quantization_config "
                "lists as not quantized)"
            )
        self.copy_(part)

    def finish(self, where: str) -> None:
        """Nothing to do once every tensor is loaded (quantized targets convert here)."""


def weight_targets(model: nn.Module) -> dict[str, WeightTarget | Fp8Target]:
    """-> checkpoint tensor name -> destination, for every tensor the model needs (and the
    optional ones a quantized checkpoint may hold), in the model's parameter order (packed
    parameters expanded part by part: q.weight, q.bias, k.weight, ...; the order dummy
    weights are drawn in)."""
    targets: dict[str, WeightTarget | Fp8Target] = {}
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if isinstance(module, FusedMoE):
            targets.update(_expert_targets(module_name, module))
            continue
        quant = module.quant_method if isinstance(module, LinearBase) else None
        if quant is not None:  # the quantized weight loads through its own targets
            params = [(local, param) for local, param in params if local == "bias"]
        if isinstance(module, MergedColumnParallelLinear):
            parent = module_name.rpartition(".")[0]
            for index, part in enumerate(module.packed_parts):
                offset, size, start, full_size = module.part_range(index)
                prefix = f"{parent}.{part}" if parent else part
                shard = (0, start, start + size, full_size)
                if quant is not None:
                    weight = module.weight.data.narrow(0, offset, size)
                    scale = module.weight_scale.data.narrow(0, offset, size)
                    targets.update(fp8_targets(prefix, weight, scale, shard, quant.checkpoint))
                for local, param in params:
                    dest = param.data.narrow(0, offset, size)
                    targets[f"{prefix}.{local}"] = WeightTarget(dest, shard)
            continue
        if quant is not None:
            shard = shard_range(module, "weight")
            weight, scale = module.weight.data, module.weight_scale.data
            targets.update(fp8_targets(module_name, weight, scale, shard, quant.checkpoint))
        for local, param in params:
            name = f"{module_name}.{local}" if module_name else local
            targets[name] = WeightTarget(param.data, shard_range(module, local))
    renames = getattr(model, "checkpoint_module_renames", None)
    if renames:  # the checkpoint's names for some modules (Mixtral's block_sparse_moe)
        targets = {_rename(name, renames): target for name, target in targets.items()}
    return targets


def _expert_targets(module_name: str, module: FusedMoE) -> dict[str, WeightTarget | Fp8Target]:
    """The checkpoint's per-expert tensors -> their rows of the stacked expert weights."""
    targets: dict[str, WeightTarget | Fp8Target] = {}
    if module.checkpoint_layout == "gpt_oss":
        for name, p in gpt_oss_expert_parts(module_name, module).items():
            targets[name] = WeightTarget(p.dest, p.shard, p.transform, p.shape)
        return targets
    quant = module.quant_method
    for part, weight, scale, shard in module.checkpoint_parts():
        prefix = f"{module_name}.{part}"
        if quant is None:
            targets[f"{prefix}.weight"] = WeightTarget(weight, shard)
        else:
            targets.update(fp8_targets(prefix, weight, scale, shard, quant.checkpoint))
    return targets


def _rename(name: str, renames: dict[str, str]) -> str:
    return ".".join(renames.get(part, part) for part in name.split("."))


class WeightLoader:
    """Copies HF-named checkpoint tensors into a model's parameters, one at a time."""

    def __init__(self, model: nn.Module) -> None:
        self.targets = weight_targets(model)
        self.loaded: set[str] = set()
        # Checkpoint name prefix -> the model's (a multimodal checkpoint's text model).
        self.prefixes: dict[str, str] = getattr(model, "checkpoint_prefixes", {})

    def load(self, name: str, tensor: Any, shape: Sequence[int], where: str) -> bool:
        """Copies this rank's part of checkpoint tensor ``name`` (shape ``shape``, from
        ``where``) into the model; -> False for a tensor the model does not use (the LM head
        of a tied model, rotary inv_freq, ...). ``tensor``: a torch.Tensor or a lazy
        safetensors slice (only this rank's part is read)."""
        for prefix, ours in self.prefixes.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        target = self.targets.get(name)
        if target is None:
            return False
        target.load(name, tensor, shape, where)
        self.loaded.add(name)
        return True

    def check_complete(self, where: str) -> None:
        """ValueError naming the checkpoint tensors the model needs and never got; then the
        conversions that need several tensors (block-wise FP8 weights and their scales)."""
        missing = [n for n, t in self.targets.items() if t.required and n not in self.loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"missing tensors in {where}: {shown}")
        for target in self.targets.values():
            target.finish(where)
