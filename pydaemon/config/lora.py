"""LoRA adapter directories in PEFT's format, checked without torch.

An adapter is ``adapter_config.json`` + ``adapter_model.safetensors``. ``read_lora_config``
reads the config and the safetensors header (names and shapes, not the tensors), so that the
front ends can refuse an adapter the engine could not serve with a clear message when it is
registered, never in an engine step. The weights are read by
pydaemon/model_loader/lora_adapter.py.

Supported: plain LoRA (no DoRA, no trained biases, no ``modules_to_save``, no
``alpha_pattern``) on the decoder layers' q/k/v/o and gate/up/down projections. The scaling
is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``, where r is each
module's own rank (PEFT's ``rank_pattern`` gives modules their own rank; it is read from the
tensors' shapes).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pydaemon.config.model import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
# e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight -> (3, q_proj, A)
LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# A real adapter's header is ~150 bytes per tensor (a 80-layer, 7-module adapter: ~170 KB).
# The core parses it between two steps: 16 MB parses in well under a second, where the old
# 100 MB bound let a 91 MB header pause every stream for ~4 s.
_MAX_HEADER_BYTES = 16 * 1024 * 1024


class LoRAAdapterError(ValueError):
    """The adapter directory cannot be served (missing files, unsupported options)."""


@dataclass(frozen=True)
class LoRAAdapterConfig:
    path: Path
    rank: int  # the largest module rank
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the supported module names its weights cover
    # ((layer, module), lora_A shape [r, in], lora_B shape [out, r]) for every module
    shapes: tuple[tuple[tuple[int, str], tuple[int, ...], tuple[int, ...]], ...]

    def scaling(self, module_rank: int) -> float:
        if self.use_rslora:
            return self.lora_alpha / math.sqrt(module_rank)
        return self.lora_alpha / module_rank


def read_lora_config(path: str | Path, max_lora_rank: int) -> LoRAAdapterConfig:
    """Checks the adapter at ``path``: its config, and its tensors' names and shapes."""
    path = Path(path)
    shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:200]}..."
    where = f"LoRA adapter {shown!r}"
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    try:
        has_config, has_weights = config_file.is_file(), weights_file.is_file()
    except OSError as e:  # a name too long, say
        raise LoRAAdapterError(f"{where}: cannot be read ({e.strerror})") from None
    if not has_config:
        raise LoRAAdapterError(f"{where}: no {CONFIG_FILE}")
    if not has_weights:
        raise LoRAAdapterError(f"{where}: no {WEIGHTS_FILE} (only safetensors are read)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        # The reason only, never the file's text (a path may point at any file).
        raise LoRAAdapterError(f"{where}: unreadable {CONFIG_FILE}: not JSON") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    _check_options(config, where)
    targets: set[str] = set()
    max_rank = 0
    shapes = _lora_shapes(weights_file, where)
    for (layer, module), (a_shape, b_shape) in shapes.items():
        if module not in SUPPORTED_TARGET_MODULES:
            raise LoRAAdapterError(
                f"{where}: target module {module!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_TARGET_MODULES)})"
            )
        if (
            not a_shape
            or not b_shape
            or len(a_shape) != 2
            or len(b_shape) != 2
            or (a_shape[0] != b_shape[1])
        ):
            raise LoRAAdapterError(f"{where}: layer {layer} {module}: lora_A and lora_B differ")
        targets.add(module)
        max_rank = max(max_rank, a_shape[0])
    if not targets:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    config_ranks = [config.get("r", 0), *(config.get("rank_pattern") or {}).values()]
    for rank in (max_rank, *config_ranks):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise LoRAAdapterError(f"{where}: rank {rank!r} in {CONFIG_FILE} is not an integer")
        if rank > max_lora_rank:
            raise LoRAAdapterError(f"{where}: rank {rank} exceeds max_lora_rank ({max_lora_rank})")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAAdapterError(f"{where}: lora_alpha must be a positive number (got {alpha!r})")
    return LoRAAdapterConfig(
        path=path,
        rank=max_rank,
        lora_alpha=float(alpha),
        use_rslora=bool(config.get("use_rslora", False)),
        target_modules=tuple(m for m in SUPPORTED_TARGET_MODULES if m in targets),
        shapes=tuple((key, a, b) for key, (a, b) in sorted(shapes.items())),
    )


def check_lora_fits_model(adapter: LoRAAdapterConfig, model: ModelConfig) -> None:
    """Raises LoRAAdapterError when the adapter was not trained on this model's shapes."""
    h, i, d = model.hidden_size, model.intermediate_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_key_value_heads * d
    in_out = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    for (layer, module), a_shape, b_shape in adapter.shapes:
        where = f"LoRA adapter {str(adapter.path)!r}: layer {layer} {module}"
        if layer >= model.num_hidden_layers:
            raise LoRAAdapterError(f"{where}: the model has {model.num_hidden_layers} layers")
        in_features, out_features = in_out[module]
        if a_shape[1] != in_features or b_shape[0] != out_features:
            raise LoRAAdapterError(
                f"{where}: lora_A {list(a_shape)} / lora_B {list(b_shape)} do not fit the "
                f"model's {in_features} -> {out_features} projection"
            )


# PEFT initialisations that rewrite the base model's weights (the adapter is trained against a
# residual base): served as plain LoRA on the unchanged base, their output would be wrong.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


def _check_options(config: dict, where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise LoRAAdapterError(
            f"{where}: init_lora_weights {init!r} changes the base model's weights, which "
            "pagedd serves unchanged; convert the adapter to plain LoRA first (PEFT's "
            "save_pretrained(path_initial_model_for_weight_conversion=...))"
        )
    for key, what in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("alpha_pattern", "alpha_pattern"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"),
    ):
        if config.get(key):
            raise LoRAAdapterError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"{where}: trained biases (bias={config['bias']!r}) are not supported"
        )


def _lora_shapes(weights_file: Path, where: str) -> dict[tuple[int, str], list]:
    """(layer, module) -> [lora_A shape, lora_B shape], from the safetensors header (an
    8-byte little-endian length, then JSON: name -> dtype, shape, offsets)."""
    try:
        with weights_file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            file_size = os.fstat(f.fileno()).st_size
            if size > min(_MAX_HEADER_BYTES, max(0, file_size - 8)):
                raise ValueError("header size")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("header type")
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        # The reason only, never the file's bytes (a path may point at any file).
        raise LoRAAdapterError(
            f"{where}: unreadable {WEIGHTS_FILE}: not a safetensors file (its header is "
            "missing, too large or not JSON)"
        ) from None
    shapes: dict[tuple[int, str], list] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        match = LORA_KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is not a supported LoRA weight")
        pair = shapes.setdefault((int(match[1]), match[2]), [None, None])
        pair[0 if match[3] == "A" else 1] = tuple(entry.get("shape", ()))
    return shapes
