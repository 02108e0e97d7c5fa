"""How a checkpoint stores its quantized linear weights, parsed from config.json's
``quantization_config`` (no torch here: the daemon's front end reads model configs too)."""

from __future__ import annotations

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
    block = raw.get("weight_block_size")
    if block is None:
        return CheckpointQuantization("fp8", "tensor", None)
    return CheckpointQuantization("fp8", "block", _block_size(block, "weight_block_size"))


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
    if len(layouts) != 1:
        raise ValueError(
            f"compressed-tensors config groups use different weight layouts {sorted(layouts)}: "
            "only one per checkpoint is supported"
        )
    strategy, block = layouts.pop()
    return CheckpointQuantization("compressed-tensors", strategy, block)
