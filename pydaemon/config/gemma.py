"""Gemma 2 and Gemma 3 settings of a Hugging Face ``config.json``, as transformers reads them.

- ``Gemma2ForCausalLM``: local (``sliding_window``) and global layers alternating, local
  first, unless ``layer_types`` lists them; ``attn_logit_softcapping`` and
  ``final_logit_softcapping``; one RoPE for every layer.
- ``Gemma3ForCausalLM``: five local layers to one global (``sliding_window_pattern``, 6 by
  default) unless ``layer_types`` lists them; the local layers rotate with
  ``rope_local_base_freq`` (10,000) and no scaling, the global ones with ``rope_theta``
  (1,000,000) and ``rope_scaling``; or the newer ``rope_parameters`` nested by layer type.
- ``Gemma3ForConditionalGeneration``: its ``text_config`` is a Gemma 3 text model (the vision
  tower is not served: text-only prompts); a field the nested config leaves out takes
  ``Gemma3TextConfig``'s default, as transformers does.

Both: ``query_pre_attn_scalar`` sets the attention scale (its inverse square root),
``hidden_activation`` must be ``gelu_pytorch_tanh`` (GeLU, tanh approximation).
"""

from __future__ import annotations

from typing import Any

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"
GEMMA_ARCHITECTURES = (GEMMA2, GEMMA3, GEMMA3_MULTIMODAL)
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)

# The defaults of transformers' Gemma2Config / Gemma3TextConfig for the fields a checkpoint
# may leave out (Gemma 3's multimodal checkpoints write only a few fields of text_config).
_SHARED_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    GEMMA2: {
        **_SHARED_DEFAULTS,
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    GEMMA3: {
        **_SHARED_DEFAULTS,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "max_position_embeddings": 131072,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "rope_theta": 1_000_000.0,
    },
}
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6


def gemma_text_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with transformers' defaults filled in; for a multimodal Gemma 3 checkpoint, its
    ``text_config`` (top-level dtype and EOS ids kept where the text config has none)."""
    if arch == GEMMA3_MULTIMODAL:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{GEMMA3_MULTIMODAL}'s config.json lacks a 'text_config' dict")
        inherited = {
            k: cfg[k] for k in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id") if k in cfg
        }
        cfg = {**inherited, **text}
        arch = GEMMA3
    out = {**_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None}}
    # Explicit nulls mean "off" for these (the defaults above would turn them on).
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "rope_scaling"):
        if key in cfg and cfg[key] is None:
            out[key] = None
    act = out.get("hidden_activation") or out.get("hidden_act")
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_activation {act!r} for {arch} (only 'gelu_pytorch_tanh')"
        )
    out["hidden_act"] = act
    return out


def gemma_layer_types(arch: str, cfg: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's type, ``sliding_attention`` (local) or ``full_attention`` (global)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    if arch == GEMMA2:
        period = 2
    else:
        period = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
        period = GEMMA3_SLIDING_WINDOW_PATTERN if period is None else period
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"sliding_window_pattern must be a positive integer, got {period!r}")
    return [
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)
    ]


def gemma_softcap(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} must be a positive number or null, got {value!r}")
    return float(value)
