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
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
            _ct_matches(entry, module_name) for entry in self.targets
        )
        return not targeted or any(_ct_matches(entry, module_name) for entry in self.ignored_layers)

    def is_layer_skipped(self, layer_name: str, parts: Sequence[str] | None = None) -> bool:
        """True when the model's layer ``layer_name`` stays unquantized. ``parts``: the
        checkpoint modules fused into it (e.g. ``...q_proj``, ``...k_proj``, ``...v_proj``),
        None when it is one checkpoint module. ValueError when only some parts are ignored."""
        names = list(parts) if parts else [layer_name]
        ignored = [name for name in names if self.is_ignored(name)]
        if ignored and len(ignored) != len(names):
            kept = [name for name in names if name not in ignored]
            raise ValueError(
                f"config.json quantization_config.{self.skip_source} leaves "
                f"{', '.join(ignored)} unquantized but not {', '.join(kept)}: this engine fuses "
                f"them into one layer ({layer_name}), whose parts must all be quantized or all "
                "be left unquantized"
            )
        return bool(ignored)


def parse_quantization_config(raw: Any) -> CheckpointQuantization | None:
    """config.json's ``quantization_config`` (None when absent) -> its FP8 layout, or a
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
    raise ValueError(
        f"unsupported quant_method {method!r} in config.json quantization_config "
        "(supported: 'fp8', 'compressed-tensors' with FP8 weights)"
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


def _ct_matches(entry: str, module_name: str) -> bool:
    """A compressed-tensors ``ignore`` / ``targets`` entry against a module name."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module_name) is not None
    return entry == module_name


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


def _parse_compressed_tensors(raw: dict[str, Any]) -> CheckpointQuantization:
    fmt = raw.get("format", "float-quantized")
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"unsupported compressed-tensors format {fmt!r} (supported: {', '.join(_CT_FORMATS)})"
        )
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
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
