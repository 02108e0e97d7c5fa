"""Layers a quantized checkpoint leaves unquantized (its ``modules_to_not_convert`` /
``ignore`` list, or compressed-tensors config groups that do not target them, parsed in
checkpoint_format.py) stay in the model's dtype: their checkpoint
weights load as they are, with no FP8 conversion. A bf16 checkpoint quantized at load
(``quantization="fp8"``) has no list: every linear layer but the LM head is quantized."""

from __future__ import annotations

from typing import Any

from torch import nn

from pydaemon.config.checkpoint_format import CheckpointQuantization
from pydaemon.layers.moe import FusedMoE
from pydaemon.layers.parallel_linear import LinearBase, MergedColumnParallelLinear


def skip_ignored_layers(
    model: nn.Module, checkpoint: CheckpointQuantization | Any | None
) -> list[str]:
    """Makes the quantized linear layers that ``checkpoint`` ignores unquantized, on a model
    not materialised yet (meta parameters). -> the names of those layers (this model's
    names: a fused ``qkv_proj`` is skipped when all of q/k/v_proj are ignored; ValueError
    when only some are)."""
    if checkpoint is None or not checkpoint.skips_layers:
        return []
    skipped = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.quant_method is not None:
            first = f"{name}.0.{module.expert_names[0]}"
            if checkpoint.is_ignored(first):
                raise ValueError(
                    f"config.json quantization_config.{checkpoint.skip_source} leaves the "
                    f"experts of {name} unquantized: a MoE layer's experts are read quantized "
                    "or the whole checkpoint unquantized"
                )
            continue
        if not isinstance(module, LinearBase) or module.quant_method is None:
            continue
        parts = None
        if isinstance(module, MergedColumnParallelLinear):
            parent = name.rpartition(".")[0]
            parts = [f"{parent}.{part}" if parent else part for part in module.packed_parts]
        if checkpoint.is_layer_skipped(name, parts):
            module.skip_quantization()
            skipped.append(name)
    return skipped
