"""Model configuration read from a Hugging Face ``config.json``.

Supported architectures: ``LlamaForCausalLM``, ``MistralForCausalLM`` (sliding window on every
layer when ``sliding_window`` is set), ``Qwen2ForCausalLM`` (q/k/v projections always carry a
bias; sliding window with ``use_sliding_window`` on the layers ``layer_types`` names, or on
layers >= ``max_window_layers``), ``Qwen3ForCausalLM`` (dense; RMSNorm of q and k per head;
sliding window as Qwen2); the mixture-of-experts ``MixtralForCausalLM`` (attention as
Mistral), ``Qwen2MoeForCausalLM`` (as Qwen2, biases per ``qkv_bias``) and
``Qwen3MoeForCausalLM`` (as Qwen3), whose expert settings config/moe.py reads. Both the old (``rope_theta`` + ``rope_scaling``) and the
transformers 5.x (``rope_parameters``) ways of writing RoPE settings are accepted.
Every unsupported architecture or option is a ``ValueError`` naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from pydaemon.config.checkpoint_format import (
    CheckpointQuantization,
    parse_quantization_config,
)
from pydaemon.config.json_files import normalize_token_ids
from pydaemon.config.moe import MOE_ARCHITECTURES, MoeConfig, parse_moe_config
from pydaemon.config.weight_only_format import Int4Checkpoint, Mxfp4Checkpoint

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_QWEN_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_QWEN2_ARCHS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # q/k/v biases, none elsewhere
_QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MISTRAL_ARCHS = ("MistralForCausalLM", "MixtralForCausalLM")  # a window on every layer
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# config.json's torch_dtype names -> torch dtype names (torch is imported only to resolve them:
# the daemon's front end reads configs without loading torch).
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


@dataclass
class RopeScaling:
    """RoPE frequency scaling; ``rope_type`` is ``"llama3"`` or ``"linear"``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    torch_dtype: str | None  # as written in the config ("bfloat16", ...), None if absent
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    # Per layer: the attention window in tokens (a query sees itself and the window - 1
    # tokens before it), or None for full causal attention.
    layer_sliding_windows: list[int | None] = field(default_factory=list)
    # How the checkpoint's linear weights are quantized (config.json quantization_config).
    quantization: CheckpointQuantization | Int4Checkpoint | Mxfp4Checkpoint | None = None
    moe: MoeConfig | None = None  # mixture-of-experts settings (config/moe.py)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.layer_sliding_windows)

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = _architecture(cfg)
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (only 'silu')")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if key not in cfg:
                raise ValueError(f"config.json lacks required field {key!r}")
        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg.get("num_attention_heads") or 0)
        if num_heads <= 0:
            raise ValueError(f"num_attention_heads must be > 0, got {num_heads}")
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = cfg.get("head_dim") or hidden_size // num_heads
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        num_layers = int(cfg["num_hidden_layers"])
        windows = _layer_sliding_windows(arch, cfg, num_layers, max_pos)
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor {cfg['partial_rotary_factor']}")
        rope_theta, rope_scaling = _rope(cfg, max_pos)
        is_qwen2 = arch in _QWEN2_ARCHS  # Qwen3 takes attention_bias from the config
        attention_bias = bool(
            cfg.get("qkv_bias", True) if is_qwen2 else cfg.get("attention_bias", False)
        )
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=False if is_qwen2 else bool(cfg.get("mlp_bias", False)),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=normalize_token_ids(eos, "config.json eos_token_id"),
            qk_norm=arch in _QK_NORM_ARCHS,
            layer_sliding_windows=windows,
            quantization=parse_quantization_config(cfg.get("quantization_config")),
            moe=parse_moe_config(arch, cfg, num_layers),
            raw=dict(cfg),
        )


def resolve_dtype(config: ModelConfig, dtype: str | torch.dtype = "auto") -> torch.dtype:
    """``"auto"`` takes the checkpoint's dtype (float32 when the config names none)."""
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype == "auto":
        name = config.torch_dtype or "float32"
        if name not in _DTYPES:
            raise ValueError(f"unsupported torch_dtype {name!r} in config.json")
        return getattr(torch, _DTYPES[name])
    if dtype not in _DTYPES:
        raise ValueError(
            f"unsupported dtype {dtype!r}: expected 'auto', 'float32', 'float16' or 'bfloat16'"
        )
    return getattr(torch, _DTYPES[dtype])


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures")
    if not archs:
        model_type = cfg.get("model_type")
        if model_type not in _MODEL_TYPE_TO_ARCH:
            raise ValueError(
                f"config.json names no architectures and model_type {model_type!r} is not "
                f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return _MODEL_TYPE_TO_ARCH[model_type]
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return archs[0]


def _layer_sliding_windows(
    arch: str, cfg: dict[str, Any], num_layers: int, max_pos: int
) -> list[int | None]:
    """Each layer's window, as transformers reads these configs; a window that covers the
    whole context is no window."""
    window = cfg.get("sliding_window")
    if arch in _QWEN_ARCHS and not cfg.get("use_sliding_window", False):
        window = None
    if arch not in (*_MISTRAL_ARCHS, *_QWEN_ARCHS) or window is None:
        return [None] * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    if window >= max_pos:
        return [None] * num_layers
    # Mistral windows every layer (transformers ignores layer_types there).
    layer_types = cfg.get("layer_types") if arch in _QWEN_ARCHS else None
    if layer_types is None:
        first = int(cfg.get("max_window_layers", 28)) if arch in _QWEN_ARCHS else 0
        return [window if i >= first else None for i in range(num_layers)]
    if len(layer_types) != num_layers or any(
        t not in ("sliding_attention", "full_attention") for t in layer_types
    ):
        raise ValueError(
            f"layer_types must list 'sliding_attention' or 'full_attention' for each of the "
            f"{num_layers} layers, got {layer_types!r}"
        )
    return [window if t == "sliding_attention" else None for t in layer_types]


def _rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict, got {params!r}")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("unsupported per-layer-type rope_parameters")
    merged: dict[str, Any] = {}
    if scaling:
        merged.update(scaling)
    if params:
        merged.update(params)
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    if "factor" not in merged:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(merged["factor"]))
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in merged:
            raise ValueError(f"rope type 'llama3' needs {key!r}")
    return theta, RopeScaling(
        "llama3",
        float(merged["factor"]),
        float(merged["low_freq_factor"]),
        float(merged["high_freq_factor"]),
        int(merged.get("original_max_position_embeddings", max_pos)),
    )
