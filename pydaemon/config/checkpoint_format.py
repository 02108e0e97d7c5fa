"""How a checkpoint stores its quantized linear weights, parsed from config.json's
``quantization_config`` (no torch here: the daemon's front end reads model configs too).

Layers a checkpoint leaves unquantized (``ignored_layers``, matched by ``is_layer_skipped``):

- HF ``quant_method: "fp8"``: ``modules_to_not_convert``, module names. An entry matches a
  module when it is a run of whole dotted components of the module's name: the name itself
  (``model.layers.0.mlp.down_proj``), a prefix (``model.layers.0``: every linear of layer 0)
  or a suffix (``lm_head``, ``down_proj``: in every layer). transformers matches substrings;
  whole components keep ``model.layers.1`` from also naming layer 10.
- compressed-tensors: ``ignore``, exact module names or ``re:<regex>`` patterns matched from
  the start of the name (``re.match``, as compressed-tensors and vLLM do): ``re:.*mlp.gate$``;
  and every linear layer its config groups do not target. A group's ``targets`` name layers
  by class (``Linear``: every linear layer, the usual case), exact module name or ``re:``
  pattern; a group without ``targets`` targets every linear layer.

A fused layer of this engine (``qkv_proj``: q/k/v_proj, ``gate_up_proj``: gate/up_proj) is
skipped when all its checkpoint parts are; some but not all is an error, as in vLLM.

The 4-bit formats (AWQ, GPTQ, compressed-tensors ``pack-quantized``, MXFP4) are parsed in
config/weight_only_format.py; ``parse_quantization_config`` dispatches to them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydaemon.config.skipped_layers import ct_matches, layer_skipped
from pydaemon.config.weight_only_format import (
    Int4Checkpoint,
    Mxfp4Checkpoint,
    parse_awq,
    parse_ct_pack_quantized,
    parse_gptq,
    parse_mxfp4,
)

SUPPORTED_QUANT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4")
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint stores its linear weights: FP8 e4m3 with scales."""

    quant_method: str  # "fp8" | "compressed-tensors"
    strategy: str  # "tensor" | "channel" | "block": the granularity of the weight scales
    block_size: tuple[int, int] | None  # (rows, columns) of a scale block, for "block"
    # The checkpoint's list of modules left unquantized, as written (see the module docstring).
    ignored_layers: tuple[str, ...] = ()
    # compressed-tensors: the config groups' targets, as written ("Linear": every linear layer).
    targets: tuple[str, ...] = ("Linear",)

    @property
    def targets_all_linear(self) -> bool:
        return "Linear" in self.targets

    @property
    def ignore_key(self) -> str:
        """The quantization_config key that lists the ignored layers."""
        return "modules_to_not_convert" if self.quant_method == "fp8" else "ignore"

    @property
    def skip_source(self) -> str:
        """Where the checkpoint says which layers stay unquantized, for error messages."""
        if self.quant_method == "fp8" or self.targets_all_linear:
            return self.ignore_key
        return "ignore (and config_groups targets)"

    @property
    def skips_layers(self) -> bool:
        """Whether some linear layer may stay unquantized."""
        return bool(self.ignored_layers) or not (
            self.quant_method == "fp8" or self.targets_all_linear
        )

    def is_ignored(self, module_name: str) -> bool:
        """True when the checkpoint's list names module ``module_name`` (a checkpoint name,
        e.g. ``model.layers.0.self_attn.q_proj``)."""
        if self.quant_method == "fp8":
            padded = f".{module_name}."
            return any(f".{entry}." in padded for entry in self.ignored_layers)
        targeted = self.targets_all_linear or any(
            ct_matches(entry, module_name) for entry in self.targets
        )
        return not targeted or any(ct_matches(entry, module_name) for entry in self.ignored_layers)

    def is_layer_skipped(self, layer_name: str, parts: Sequence[str] | None = None) -> bool:
        """True when the model's layer ``layer_name`` stays unquantized (skipped_layers.py)."""
        return layer_skipped(self, layer_name, parts)


def parse_quantization_config(
    raw: Any,
) -> CheckpointQuantization | Int4Checkpoint | Mxfp4Checkpoint | None:
    """config.json's ``quantization_config`` (None when absent) -> its layout, or a
    ValueError naming what is not supported."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_hf_fp8(raw)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "awq":
        return parse_awq(raw)
    if method == "gptq":
        return parse_gptq(raw)
    if method == "mxfp4":
        return parse_mxfp4(raw)
    raise ValueError(
        f"unsupported quant_method {method!r} in config.json quantization_config "
        f"(supported: {', '.join(repr(m) for m in SUPPORTED_QUANT_METHODS)}; compressed-tensors "
        "with FP8 or 4-bit integer weights)"
    )


def _block_size(value: Any, where: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(
            f"unsupported block size {where} = {value!r}: expected [rows, columns], two "
            "positive integers (e.g. [128, 128])"
        )
    return int(value[0]), int(value[1])


def _parse_hf_fp8(raw: dict[str, Any]) -> CheckpointQuantization:
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"unsupported activation_scheme {scheme!r} in quantization_config "
            "(expected 'dynamic' or 'static')"
        )
    ignored = _ignored_layers(raw, "modules_to_not_convert", allow_regex=False)
    block = raw.get("weight_block_size")
    if block is None:
        return CheckpointQuantization("fp8", "tensor", None, ignored)
    return CheckpointQuantization("fp8", "block", _block_size(block, "weight_block_size"), ignored)


def _ignored_layers(raw: dict[str, Any], key: str, allow_regex: bool) -> tuple[str, ...]:
    return _module_list(raw.get(key), key, allow_regex)


def _module_list(value: Any, key: str, allow_regex: bool) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(
            f"config.json quantization_config.{key} must be a list of module names, got {value!r}"
        )
    for entry in value:
        if allow_regex and entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as e:
                raise ValueError(
                    f"config.json quantization_config.{key} entry {entry!r} is not a valid "
                    f"regular expression: {e}"
                ) from None
    return tuple(value)


def _parse_compressed_tensors(raw: dict[str, Any]) -> CheckpointQuantization | Int4Checkpoint:
    fmt = raw.get("format", "float-quantized")
    if fmt not in (*_CT_FORMATS, "pack-quantized"):
        raise ValueError(
            f"unsupported compressed-tensors format {fmt!r} (supported: "
            f"{', '.join(_CT_FORMATS)}, pack-quantized)"
        )
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    if fmt == "pack-quantized":
        targets: list[str] = []
        for group_name, group in groups.items():
            group_targets = group.get("targets", ["Linear"]) if isinstance(group, dict) else None
            targets.extend(_module_list(group_targets, f"config_groups.{group_name}.targets", True))
        ignored = _ignored_layers(raw, "ignore", allow_regex=True)
        return parse_ct_pack_quantized(raw, ignored, tuple(targets))
    layouts = set()
    targets: list[str] = []
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"compressed-tensors config group {group_name!r} has no 'weights'")
        bits, kind = weights.get("num_bits"), weights.get("type")
        if bits != 8 or kind != "float":
            raise ValueError(
                f"compressed-tensors config group {group_name!r} quantizes weights to "
                f"num_bits={bits!r} type={kind!r}: only FP8 (num_bits 8, type 'float') is "
                "supported"
            )
        strategy = weights.get("strategy", "tensor")
        if strategy not in _CT_STRATEGIES:
            raise ValueError(
                f"unsupported weight strategy {strategy!r} in compressed-tensors config group "
                f"{group_name!r} (supported: {', '.join(_CT_STRATEGIES)})"
            )
        block = None
        if strategy == "block":
            block = _block_size(weights.get("block_structure"), f"{group_name}.block_structure")
        layouts.add((strategy, block))
        group_targets = group.get("targets", ["Linear"])
        targets.extend(
            _module_list(group_targets, f"config_groups.{group_name}.targets", allow_regex=True)
        )
    if len(layouts) != 1:
        raise ValueError(
            f"compressed-tensors config groups use different weight layouts {sorted(layouts)}: "
            "only one per checkpoint is supported"
        )
    strategy, block = layouts.pop()
    ignored = _ignored_layers(raw, "ignore", allow_regex=True)
    return CheckpointQuantization("compressed-tensors", strategy, block, ignored, tuple(targets))
