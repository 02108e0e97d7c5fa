"""Where each checkpoint tensor goes in a model: Hugging Face tensor name -> destination.

Checkpoints keep q_proj / k_proj / v_proj and gate_proj / up_proj apart; the model packs them
into one GEMM each (``qkv_proj``, ``gate_up_proj``: MergedColumnParallelLinear). This is vLLM's
stacked_params_mapping, at the level of names: ``model.layers.3.self_attn.k_proj.weight`` goes
to the k rows of ``model.layers.3.self_attn.qkv_proj.weight``. Mixture-of-experts checkpoints
keep one tensor per expert (``mlp.experts.5.up_proj.weight``): each goes to its expert's rows
of the stacked ``w13_weight`` / ``w2_weight`` of the FusedMoE layer (layers/moe/layer.py). Under tensor parallelism each
destination also says which slice of the checkpoint tensor this rank reads.

Every source of HF-named tensors (safetensors files, dummy weights, GGUF after its name
mapping) loads through ``WeightLoader``, so each gets the packed layout and the TP slicing:

    loader = WeightLoader(model)
    for name, tensor in tensors:        # HF names; a tensor or a lazy safetensors slice
        loader.load(name, tensor, tensor.shape, where="model.gguf")
    loader.check_complete(where="model.gguf")

A quantized layer (``LinearBase.quant_method``) takes its weights through the method's own
targets (pydaemon/model_loader/fp8_loading.py: an FP8 weight and its scales, or an
unquantized weight quantized as it is copied; int4_loading.py: a 4-bit checkpoint's packed
tensors; mxfp4_loading.py: gpt-oss's MXFP4 experts); its bias loads as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.moe import FusedMoE
from pydaemon.layers.moe.int4 import Int4MoEMethod
from pydaemon.layers.moe.mxfp4 import Mxfp4MoEMethod
from pydaemon.layers.parallel_linear import LinearBase, MergedColumnParallelLinear, shard_range
from pydaemon.model_loader.fp8_loading import FP8_DTYPES, Fp8Target, fp8_targets
from pydaemon.model_loader.int4_loading import Int4Dest, Int4Target, int4_targets
from pydaemon.model_loader.mxfp4_loading import Mxfp4Target, mxfp4_targets
from pydaemon.quantization.int4_linear import Int4LinearMethod


@dataclass(frozen=True)
class WeightTarget:
    """dest: the parameter data one checkpoint tensor fills (a parameter, or the rows of one
    part of a packed parameter). shard: (dim, start, stop, full_size), the slice of the
    checkpoint tensor this rank reads along dim, or None when it reads all of it; stop -
    start may be below dest's size along dim (vocabulary padding on the last rank: zeroed)."""

    dest: torch.Tensor
    shard: tuple[int, int, int, int] | None
    required = True  # check_complete reports it when the checkpoint lacks it

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


AnyTarget = WeightTarget | Fp8Target | Int4Target | Mxfp4Target


def weight_targets(model: nn.Module) -> dict[str, AnyTarget]:
    """-> checkpoint tensor name -> destination, for every tensor the model needs (and the
    optional ones a quantized checkpoint may hold), in the model's parameter order (packed
    parameters expanded part by part: q.weight, q.bias, k.weight, ...; the order dummy
    weights are drawn in)."""
    targets: dict[str, AnyTarget] = {}
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if isinstance(module, FusedMoE):
            targets.update(_expert_targets(module_name, module))
            continue
        quant = module.quant_method if isinstance(module, LinearBase) else None
        if quant is not None:  # the quantized weight loads through its own targets
            params = [(local, param) for local, param in params if local == "bias"]
        if isinstance(quant, Int4LinearMethod):
            targets.update(_int4_linear_targets(module_name, module, quant))
            quant = None  # its bias loads as an unquantized layer's
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


def _int4_dest(module: nn.Module, prefix: str, offset: int, size: int, shared: dict) -> Int4Dest:
    """Rows [offset, offset + size) of an int4 layer's (or one expert's: prefix "w13_", "w2_"
    and the expert's slices) parameters."""

    def rows(name: str) -> torch.Tensor | None:
        t = getattr(module, f"{prefix}{name}", None)
        return None if t is None else t.data.narrow(0, offset, size)

    perm = getattr(module, f"{prefix}perm", None)
    return Int4Dest(rows("qweight"), rows("scales"), rows("qzeros"),
                    None if perm is None else perm.data, rows("weight"), shared)  # fmt: skip


def _int4_linear_targets(
    module_name: str, module: LinearBase, quant: Int4LinearMethod
) -> dict[str, Int4Target]:
    targets: dict[str, Int4Target] = {}
    fmt, shared = quant.checkpoint, {}
    if isinstance(module, MergedColumnParallelLinear):
        parent = module_name.rpartition(".")[0]
        for index, part in enumerate(module.packed_parts):
            offset, size, start, full_size = module.part_range(index)
            prefix = f"{parent}.{part}" if parent else part
            dest = _int4_dest(module, "", offset, size, shared)
            shape = (full_size, module.in_features)
            shard = (0, start, start + size, full_size)
            targets.update(int4_targets(prefix, fmt, dest, shape, shard))
        return targets
    # Row-parallel: this rank's input columns.
    full_in = module.tp_shards["weight"][1]
    start = ps.get_tp_rank() * module.in_features
    shard = (1, start, start + module.in_features, full_in)
    dest = _int4_dest(module, "", 0, module.out_features, shared)
    return int4_targets(module_name, fmt, dest, (module.out_features, full_in), shard)


def _expert_targets(module_name: str, module: FusedMoE) -> dict[str, AnyTarget]:
    """The checkpoint's per-expert tensors -> their rows of the stacked expert weights."""
    targets: dict[str, AnyTarget] = {}
    quant = module.quant_method
    if isinstance(quant, Mxfp4MoEMethod):
        return mxfp4_targets(module_name, module)
    if isinstance(quant, Int4MoEMethod):
        shared: dict[int, dict] = {}
        for part, e, proj, offset, size, shard in module.expert_parts():
            expert_view = _ExpertView(module, proj, e)
            dest = _int4_dest(expert_view, "", offset, size, shared.setdefault((e, proj), {}))
            k = module.hidden_size if proj == "w13" else module.intermediate_size
            n = module.intermediate_size if proj == "w13" else module.hidden_size
            prefix = f"{module_name}.{part}"
            targets.update(int4_targets(prefix, quant.checkpoint, dest, (n, k), shard))
        return targets
    for part, weight, scale, shard in module.checkpoint_parts():
        prefix = f"{module_name}.{part}"
        if quant is None:
            targets[f"{prefix}.weight"] = WeightTarget(weight, shard)
        else:
            targets.update(fp8_targets(prefix, weight, scale, shard, quant.checkpoint))
    return targets


class _ExpertView:
    """One expert's int4 parameters of a FusedMoE layer (``w13_qweight[e]``, ...) under the
    names of a linear layer's (``qweight``, ...)."""

    def __init__(self, module: FusedMoE, proj: str, e: int) -> None:
        for name in ("qweight", "scales", "qzeros", "perm"):
            t = getattr(module, f"{proj}_{name}", None)
            if t is not None:
                setattr(self, name, t.data[e])


def _rename(name: str, renames: dict[str, str]) -> str:
    return ".".join(renames.get(part, part) for part in name.split("."))


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
