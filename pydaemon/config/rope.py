"""RoPE settings of a Hugging Face ``config.json``, read as transformers 5.x reads them.

Both ways of writing them are accepted: the old ``rope_theta`` + ``rope_scaling`` (+
``partial_rotary_factor``) and the newer ``rope_parameters`` dict, which may also be nested by
layer type (``{"sliding_attention": {...}, "full_attention": {...}}``: Gemma 3, whose local
layers rotate with their own theta). Types: ``default``, ``linear``, ``llama3`` and ``yarn``
(Qwen3 long context, gpt-oss), with every YaRN field transformers' ``_compute_yarn_parameters``
reads (``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
``truncate``, ``attention_factor`` or ``mscale`` / ``mscale_all_dim``). Any other type is a
``ValueError`` naming it.

``partial_rotary_factor`` rotates only the first ``int(head_dim * factor)`` dims of each head
(``rotary_dim``), as transformers' models with partial rotary embeddings do; the rest pass
through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``rope_type`` ``"linear"``, ``"llama3"`` or ``"yarn"``."""

    rope_type: str
    factor: float
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn: cos and sin are multiplied by it (transformers' attention_scaling, the mscale)
    attention_factor: float = 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling: RopeScaling | None


def parse_rope(
    cfg: dict[str, Any], max_pos: int, layer_type: str | None = None, default_theta: float = 1e4
) -> RopeConfig:
    """The RoPE of ``cfg`` (of the layers of ``layer_type`` when ``rope_parameters`` is nested
    by layer type; ``None``: refuse a nested dict). ``default_theta``: when none is given."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict, got {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or null, got {scaling!r}")
    if is_nested(params):
        if layer_type is None:
            raise ValueError("unsupported per-layer-type rope_parameters")
        params = params.get(layer_type) or {}
    merged: dict[str, Any] = {}
    if scaling:
        merged.update(scaling)
    if params:
        merged.update(params)
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", default_theta)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig(theta, None)
    if rope_type == "yarn":
        return RopeConfig(
            theta, _yarn(merged, max_pos, cfg.get("original_max_position_embeddings"))
        )
    if "factor" not in merged:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta, RopeScaling("linear", float(merged["factor"])))
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in merged:
            raise ValueError(f"rope type 'llama3' needs {key!r}")
    return RopeConfig(
        theta,
        RopeScaling(
            "llama3",
            float(merged["factor"]),
            float(merged["low_freq_factor"]),
            float(merged["high_freq_factor"]),
            int(merged.get("original_max_position_embeddings", max_pos)),
        ),
    )


def is_nested(params: Any) -> bool:
    """Whether ``rope_parameters`` is a dict of per-layer-type dicts."""
    return (
        isinstance(params, dict)
        and bool(params)
        and all(isinstance(v, dict) or v is None for v in params.values())
    )


def _yarn(merged: dict[str, Any], max_pos: int, top_original: Any) -> RopeScaling:
    # A top-level original_max_position_embeddings wins, as in transformers (Phi-3 style).
    original = int(top_original or merged.get("original_max_position_embeddings", max_pos))
    factor = merged.get("factor")
    # DeepSeek-style configs leave the factor to the ratio of the two context lengths.
    factor = float(max_pos / original if factor is None else factor)
    attention_factor = merged.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        beta_fast=float(merged.get("beta_fast") or 32),
        beta_slow=float(merged.get("beta_slow") or 1),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, Eq. 21 of the paper: ``0.1 * mscale * ln(scale) + 1``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """Dims of each head the rotary embedding rotates: ``int(head_dim *
    partial_rotary_factor)``; the factor may sit at the top level or in ``rope_parameters``."""
    factor = cfg.get("partial_rotary_factor")
    params = cfg.get("rope_parameters")
    if factor is None and isinstance(params, dict) and not is_nested(params):
        factor = params.get("partial_rotary_factor")
    if factor is None:
        return head_dim
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {dim} rotary dims of head_dim {head_dim}: "
            "expected an even number >= 2"
        )
    return dim
