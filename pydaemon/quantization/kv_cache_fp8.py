"""The FP8 (e4m3) KV cache: the cache dtype a ``kv_cache_dtype`` names, quantization to and from
e4m3 with a per-layer scale, and the scales a checkpoint may carry.

Storage: the cache tensor is ``torch.float8_e4m3fn`` (1 byte an element, max 448, no
infinities); a layer stores ``saturate(k / k_scale)`` and ``saturate(v / v_scale)`` and reads
back ``e4m3 * scale``. On CUDA the cache-write kernel quantizes and the attention kernels
dequantize in registers; the torch path (CPU, float32 models, windowed layers) stores e4m3 in
the same tensor and dequantizes after its gather: on the CPU this is an emulation (the same
numbers, not a speed-up). Block moves (swap, copy-on-write) copy bytes and are unchanged.

Scales are 1.0 unless the checkpoint has per-layer tensors named as vLLM and
compressed-tensors / llm-compressor / AutoFP8 checkpoints name them (``...self_attn.k_scale``,
``...self_attn.v_scale``, ``...self_attn.kv_scale``, ``...self_attn.attn.k_scale``,
``...self_attn.k_proj.output_scale``, ``...self_attn.v_proj.output_scale``); with
``calculate_kv_scales`` the missing ones are measured on the first step
(``measure_kv_scales``; see kv_scale_calibration.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from pydaemon.config.engine import KV_CACHE_DTYPES
from pydaemon.distributed import parallel_state as ps

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# calculate_kv_scales: the measured amax|k| is stored as 200, amax|v| as 100 (vLLM's
# K_SCALE_CONSTANT / V_SCALE_CONSTANT), leaving headroom below 448 for later tokens.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0
MIN_KV_SCALE = 1e-12  # a layer whose measured K or V is all zeros

_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\."
    r"(?:attn\.)?(?:(k_scale|v_scale|kv_scale)|(k_proj|v_proj)\.output_scale)$"
)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``"auto"``: the model's dtype; ``"fp8"`` / ``"fp8_e4m3"``: float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(
        f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    )


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """-> saturate(x / scale) as float8_e4m3fn (round to nearest even), x's shape."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """-> x * scale in ``dtype`` (exact before the scale: every e4m3 value fits fp16/bf16)."""
    out = x.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def measure_kv_scales(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]: the step's K, before its cache write
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T]; negative: a padding row, not written
) -> tuple[float, float]:
    """-> (k_scale, v_scale) = (amax|k| / K_SCALE_RANGE, amax|v| / V_SCALE_RANGE) over the
    rows written, the amax taken over every tensor-parallel rank (each holds its own heads),
    so that all ranks get TP=1's scales. One host-device sync (the floats)."""
    written = (slot_mapping >= 0)[:, None, None]
    amax = torch.stack([key.abs().where(written, 0).amax(), value.abs().where(written, 0).amax()])
    k_amax, v_amax = ps.all_reduce_max(amax.float()).tolist()
    if not (math.isfinite(k_amax) and math.isfinite(v_amax)):
        raise ValueError(
            f"calculate_kv_scales: this step's largest |k|, |v| are {k_amax}, {v_amax}: "
            "the model's K/V overflow the model dtype"
        )
    return max(k_amax / K_SCALE_RANGE, MIN_KV_SCALE), max(v_amax / V_SCALE_RANGE, MIN_KV_SCALE)


def kv_scales_from_checkpoint(
    model_dir: str | Path, num_layers: int, default: float | None = 1.0
) -> list[tuple[float | None, float | None]]:
    """-> (k_scale, v_scale) per layer from a safetensors checkpoint; ``default`` where it
    has none.

    Reads only the scale tensors (a checkpoint without them costs one listing of names). A
    GGUF file, a directory without safetensors, or ``"demo"`` gives ``default`` everywhere.
    """
    scales = [[default, default] for _ in range(num_layers)]
    for path, names in _scale_tensors(Path(model_dir)).items():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for name in names:
                m = _SCALE_NAME.search(name)
                assert m is not None
                layer = int(m.group(1))
                if layer >= num_layers:
                    raise ValueError(f"{name} in {path} names layer {layer} of {num_layers}")
                value = f.get_tensor(name).float()
                if value.numel() != 1:
                    raise ValueError(
                        f"{name} in {path} has {value.numel()} elements; only per-layer "
                        "(scalar) KV-cache scales are supported"
                    )
                scale = float(value.item())
                if not scale > 0.0 or scale == float("inf"):
                    raise ValueError(f"{name} in {path} is {scale}: a KV scale must be > 0")
                which = m.group(2) or ("k_scale" if m.group(3) == "k_proj" else "v_scale")
                if which in ("k_scale", "kv_scale"):
                    scales[layer][0] = scale
                if which in ("v_scale", "kv_scale"):
                    scales[layer][1] = scale
    return [(k, v) for k, v in scales]


def _scale_tensors(model_dir: Path) -> dict[Path, list[str]]:
    """-> shard -> names of the KV-scale tensors it holds."""
    if not model_dir.is_dir():
        return {}
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        found: dict[Path, list[str]] = {}
        for name, fname in weight_map.items():
            if _SCALE_NAME.search(name):
                found.setdefault(model_dir / fname, []).append(name)
        return found
    single = model_dir / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        names = [n for n in f.keys() if _SCALE_NAME.search(n)]
    return {single: names} if names else {}
