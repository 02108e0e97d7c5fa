"""Weight-only 4-bit checkpoint formats, parsed from config.json's ``quantization_config`` (no
torch here: the front end reads model configs too). What each format stores, tensor by
tensor, is in pydaemon/quantization/ (awq.py, gptq.py, compressed_tensors_int4.py, mxfp4.py).

- ``quant_method: "awq"`` (AutoAWQ, ``version: "gemm"``): ``bits`` 4, ``group_size``,
  ``zero_point`` true; ``modules_to_not_convert`` as HF FP8's (whole dotted components).
- ``quant_method: "gptq"`` (AutoGPTQ / GPTQModel): ``bits`` 4, ``group_size`` (-1: one group
  per output channel), ``desc_act`` (act-order: a per-input-column group index ``g_idx``),
  ``sym``, ``checkpoint_format`` "gptq" (zero points stored minus one, the historical
  offset) or "gptq_v2"; ``modules_in_block_to_quantize`` (names inside a decoder layer, e.g.
  ``self_attn.q_proj``: the others stay unquantized) and ``dynamic`` rules whose ``-:<regex>``
  keys leave the modules they match unquantized (``re.match`` on the module name).
- ``quant_method: "compressed-tensors"``, ``format: "pack-quantized"`` (llm-compressor W4A16):
  config groups of ``weights`` ``num_bits`` 4, ``type`` "int", ``strategy`` "group" (with
  ``group_size``) or "channel", ``symmetric`` or not, ``actorder`` null / "weight" (groups in
  column order) / "group" (a ``weight_g_idx``); no input activation quantization.
- ``quant_method: "mxfp4"`` (gpt-oss): only the experts of MoE layers are MXFP4 (e2m1 values,
  one e8m0 scale per 32); every other linear layer is in the model dtype.

Group sizes are powers of two from 16 to 1024 (the kernels' tiles) or per channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydaemon.config.skipped_layers import component_match, ct_matches, layer_skipped

INT4_METHODS = ("awq", "gptq", "compressed-tensors")
MIN_GROUP, MAX_GROUP = 16, 1024


@dataclass(frozen=True)
class Int4Checkpoint:
    """A checkpoint whose linear weights are 4-bit integers: w = (q - zero) * scale per group
    of ``group_size`` input columns (None: one group per output channel)."""

    quant_method: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int | None
    has_zero_point: bool  # asymmetric: a zero point per group (else 8, the middle)
    desc_act: bool  # a g_idx tensor gives each input column's group (GPTQ / CT "group")
    zero_offset: int = 0  # GPTQ v1 stores zero - 1: add this back
    ignored_layers: tuple[str, ...] = ()  # as the format writes them (see is_ignored)
    targets: tuple[str, ...] = ("Linear",)  # CT config group targets, GPTQ block modules

    @property
    def skip_source(self) -> str:
        return {
            "awq": "modules_to_not_convert",
            "gptq": "modules_in_block_to_quantize / dynamic",
            "compressed-tensors": "ignore (and config_groups targets)",
        }[self.quant_method]

    @property
    def skips_layers(self) -> bool:
        return bool(self.ignored_layers) or "Linear" not in self.targets

    def is_ignored(self, module_name: str) -> bool:
        if self.quant_method == "awq":
            return any(component_match(e, module_name) for e in self.ignored_layers)
        if self.quant_method == "gptq":
            targeted = "Linear" in self.targets or any(
                module_name.endswith(f".{t}") for t in self.targets
            )
            return not targeted or any(ct_matches(e, module_name) for e in self.ignored_layers)
        targeted = "Linear" in self.targets or any(ct_matches(e, module_name) for e in self.targets)
        return not targeted or any(ct_matches(e, module_name) for e in self.ignored_layers)

    def is_layer_skipped(self, layer_name: str, parts: list[str] | None = None) -> bool:
        return layer_skipped(self, layer_name, parts)


@dataclass(frozen=True)
class Mxfp4Checkpoint:
    """gpt-oss's MXFP4 experts; every linear layer outside the experts is unquantized."""

    ignored_layers: tuple[str, ...] = ()  # modules_to_not_convert (``*`` per component)
    quant_method = "mxfp4"
    skip_source = "modules_to_not_convert"
    skips_layers = False  # linear layers are never MXFP4: nothing to skip among them

    def is_ignored(self, module_name: str) -> bool:
        return any(component_match(e, module_name) for e in self.ignored_layers)

    def is_layer_skipped(self, layer_name: str, parts: list[str] | None = None) -> bool:
        return True


def _int(raw: dict[str, Any], key: str, default: Any, where: str) -> Any:
    value = raw.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{where}.{key} must be an integer, got {value!r}")
    return value


def _group_size(value: int | None, where: str) -> int | None:
    """-1 / None -> None (per channel); a power of two in [MIN_GROUP, MAX_GROUP]."""
    if value is None or value == -1:
        return None
    if value < MIN_GROUP or value > MAX_GROUP or value & (value - 1):
        raise ValueError(
            f"unsupported {where} {value}: 4-bit weights need a power-of-two group size from "
            f"{MIN_GROUP} to {MAX_GROUP}, or -1 (one group per output channel)"
        )
    return value


def _names(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(
            f"config.json quantization_config.{key} must be a list of module names, got {value!r}"
        )
    return tuple(value)


def parse_awq(raw: dict[str, Any]) -> Int4Checkpoint:
    where = "quantization_config"
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"unsupported AWQ version {raw.get('version')!r}: only the GEMM layout ('gemm') is "
            "read (GEMV / exllama / marlin / ipex layouts pack differently)"
        )
    bits = _int(raw, "bits", _int(raw, "w_bit", None, where), where)
    if bits != 4:
        raise ValueError(f"unsupported AWQ bits={bits!r}: only 4-bit AWQ checkpoints are read")
    if raw.get("zero_point", True) is not True:
        raise ValueError("unsupported AWQ zero_point=false: AWQ GEMM checkpoints carry zero points")
    group = _int(raw, "group_size", _int(raw, "q_group_size", 128, where), where)
    ignored = _names(raw.get("modules_to_not_convert"), "modules_to_not_convert")
    return Int4Checkpoint("awq", _group_size(group, "AWQ group_size"), True, False, 0, ignored)


def parse_gptq(raw: dict[str, Any]) -> Int4Checkpoint:
    where = "quantization_config"
    bits = _int(raw, "bits", None, where)
    if bits != 4:
        raise ValueError(f"unsupported GPTQ bits={bits!r}: only 4-bit GPTQ checkpoints are read")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"unsupported GPTQ checkpoint_format {fmt!r} (supported: 'gptq', 'gptq_v2'; "
            "marlin / bitblas layouts are not read)"
        )
    if raw.get("lm_head"):
        raise ValueError("unsupported GPTQ lm_head=true: a quantized LM head is not read")
    group = _group_size(_int(raw, "group_size", 128, where), "GPTQ group_size")
    targets: list[str] = []
    blocks = raw.get("modules_in_block_to_quantize")
    if blocks:
        flat = [n for row in blocks for n in (row if isinstance(row, list) else [row])]
        targets = list(_names(flat, "modules_in_block_to_quantize"))
    ignored: list[str] = []
    dynamic = raw.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ValueError(f"GPTQ quantization_config.dynamic must be an object, got {dynamic!r}")
    for key, override in dynamic.items():
        if key.startswith("-:"):
            ignored.append("re:" + key[2:])
            continue
        pattern = key[2:] if key.startswith("+:") else key
        base = {"bits": bits, "group_size": raw.get("group_size", 128), "sym": raw.get("sym", True),
                "desc_act": raw.get("desc_act", False)}  # fmt: skip
        changed = {k: v for k, v in (override or {}).items() if k in base and v != base[k]}
        if changed:
            raise ValueError(
                f"unsupported GPTQ dynamic rule {key!r}: modules matching {pattern!r} override "
                f"{changed}; only one layout per checkpoint is read"
            )
    zero_offset = 1 if fmt == "gptq" else 0
    has_zp = not bool(raw.get("sym", True))
    return Int4Checkpoint(
        "gptq",
        group,
        has_zp,
        bool(raw.get("desc_act", False)),
        zero_offset,
        tuple(ignored),
        tuple(targets) if targets else ("Linear",),
    )


def parse_ct_pack_quantized(
    raw: dict[str, Any], ignored: tuple[str, ...], targets: tuple[str, ...]
) -> Int4Checkpoint:
    """compressed-tensors ``pack-quantized``: ``ignore`` and ``targets`` already parsed."""
    layouts = set()
    for name, group in raw["config_groups"].items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"compressed-tensors config group {name!r} has no 'weights'")
        bits, kind = weights.get("num_bits"), weights.get("type", "int")
        if bits != 4 or kind != "int":
            raise ValueError(
                f"compressed-tensors config group {name!r} packs num_bits={bits!r} "
                f"type={kind!r}: only 4-bit integers (W4A16) are read from pack-quantized"
            )
        if group.get("input_activations"):
            raise ValueError(
                f"compressed-tensors config group {name!r} quantizes input activations: only "
                "weight-only (W4A16) pack-quantized checkpoints are read"
            )
        strategy = weights.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise ValueError(
                f"unsupported weight strategy {strategy!r} in compressed-tensors config group "
                f"{name!r} (4-bit: 'group' or 'channel')"
            )
        size = None
        if strategy == "group":
            size = _group_size(weights.get("group_size"), f"config group {name!r} group_size")
            if size is None:
                raise ValueError(f"compressed-tensors config group {name!r} has no group_size")
        actorder = weights.get("actorder")
        if actorder not in (None, False, "weight", "group", "static", "dynamic"):
            raise ValueError(f"unsupported actorder {actorder!r} in config group {name!r}")
        # "group" (and the old "dynamic") store weight_g_idx; "weight" / "static" keep groups
        # in column order.
        g_idx = actorder in ("group", "dynamic")
        layouts.add((size, not weights.get("symmetric", True), g_idx))
    if len(layouts) != 1:
        raise ValueError(
            f"compressed-tensors config groups use different 4-bit layouts {sorted(layouts, key=str)}:"
            " only one per checkpoint is read"
        )
    size, asym, g_idx = layouts.pop()
    return Int4Checkpoint("compressed-tensors", size, asym, g_idx, 0, ignored, targets)


def parse_mxfp4(raw: dict[str, Any]) -> Mxfp4Checkpoint:
    return Mxfp4Checkpoint(_names(raw.get("modules_to_not_convert"), "modules_to_not_convert"))
