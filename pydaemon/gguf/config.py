"""A GGUF file's metadata as pagedd's ModelConfig.

The ``{arch}.*`` keys are renamed to their ``config.json`` names (as transformers' GGUF loader
does), then go through ``ModelConfig.from_dict`` so every check of a Hugging Face config
applies. Tied embeddings: the file has no ``output.weight``. Attention bias: the file has
``blk.0.attn_q.bias``. RoPE frequencies stored as a ``rope_freqs.weight`` tensor (Llama 3.1
style scaling) and partial rotary embeddings are unsupported and said so.

Gemma 2 and Gemma 3 (``gemma2``, ``gemma3``) follow llama.cpp's reading (``llama-model.cpp``),
since the file leaves out what it hard-codes: the attention scale is ``head_dim ** -0.5``
except for the 27B shapes (46 and 62 layers: ``(hidden / heads) ** -0.5``); Gemma 3's local
layers are five of every six (unless ``{arch}.attention.sliding_window_pattern`` says) and
rotate with base 10,000 (or ``{arch}.rope.freq_base_swa``); the soft-caps come from
``{arch}.attn_logit_softcapping`` / ``final_logit_softcapping`` (absent: none); the window
from ``{arch}.attention.sliding_window``.

gpt-oss (``gpt-oss``): experts from ``expert_count`` / ``expert_used_count`` /
``expert_feed_forward_length``, every other layer windowed (windowed first, as llama.cpp
hard-codes), the window from ``attention.sliding_window``, YaRN from ``rope.scaling.*``
(``original_context_length``; ``yarn_beta_fast`` / ``_slow``, else 32 and 1; untruncated, as
gpt-oss's own config says), the SwiGLU clamp from ``swiglu_clamp_exp`` (else llama.cpp's 7).
"""

from __future__ import annotations

from typing import Any

from pydaemon.config.model import ModelConfig
from pydaemon.gguf.model_sizes import check_counts
from pydaemon.gguf.reader import GGUFFile

# general.architecture -> the Hugging Face architecture pagedd serves it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# llama.cpp's 27B Gemma shapes (by layer count), whose attention scale is (hidden / heads)^-0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_MOE_KEYS = {  # {arch}.<key> -> config.json key, for mixtures of experts
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}

# {arch}.<key> -> config.json key
_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}


def gguf_config_dict(f: GGUFFile) -> dict[str, Any]:
    """-> the ``config.json`` this file's metadata describes."""
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{f.path.name}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    cfg: dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch}
    cfg.update(_moe(f, arch))  # Mixtral: a llama with experts
    for key, name in _KEYS.items():
        value = f.get(f"{arch}.{key}")
        if value is not None:
            cfg[name] = value
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        f.require(f"{arch}.{key}")
    if "vocab_size" not in cfg:  # older files: the vocabulary, else the embedding's rows
        tokens = f.get("tokenizer.ggml.tokens")
        cfg["vocab_size"] = len(tokens) if tokens else f.shape("token_embd.weight")[0]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_dim = f.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{f.path.name}: unsupported partial rotary embedding "
            f"({arch}.rope.dimension_count={rope_dim}, head_dim={head_dim})"
        )
    cfg.update(_rope_scaling(f, arch))
    cfg.update(_gemma(f, arch, cfg, head_dim))
    cfg.update(_gpt_oss(f, arch))
    cfg["tie_word_embeddings"] = not f.has_tensor("output.weight")
    cfg["attention_bias"] = f.has_tensor("blk.0.attn_q.bias")
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = f.get(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[name] = int(value)
    return cfg


def _gpt_oss(f: GGUFFile, arch: str) -> dict[str, Any]:
    """gpt-oss's settings as llama.cpp writes and reads them (module docstring)."""
    if arch != "gpt-oss":
        return {}
    out: dict[str, Any] = {
        "model_type": "gpt_oss",
        "num_local_experts": int(f.require(f"{arch}.expert_count")),
        "num_experts_per_tok": int(f.require(f"{arch}.expert_used_count")),
        "attention_bias": True,
    }
    ffn = f.get(f"{arch}.expert_feed_forward_length")
    if ffn:
        out["intermediate_size"] = int(ffn)
    window = f.get(f"{arch}.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    clamp = f.get(f"{arch}.swiglu_clamp_exp")
    if isinstance(clamp, list):  # one value a layer: gpt-oss has one for all
        clamp = max(clamp) if clamp else None
    out["swiglu_limit"] = float(clamp) if clamp else 7.0
    return out


def _moe(f: GGUFFile, arch: str) -> dict[str, Any]:
    """The experts' settings: ``llama`` with ``llama.expert_count`` is Mixtral; ``qwen2moe``
    and ``qwen3moe`` name their expert size. llama.cpp renormalises the top-k weights of
    Mixtral and Qwen3-MoE, not of Qwen2-MoE (unless ``{arch}.expert_weights_norm`` says); a
    layer without a router (``blk.N.ffn_gate_inp``) is dense."""
    num_experts = f.get(f"{arch}.expert_count")
    if not num_experts or arch == "gpt-oss":
        return {}
    cfg: dict[str, Any] = {
        key: f.get(f"{arch}.{gguf_key}")
        for gguf_key, key in _MOE_KEYS.items()
        if f.get(f"{arch}.{gguf_key}") is not None
    }
    if arch == "llama":
        cfg["architectures"] = ["MixtralForCausalLM"]
        cfg["num_local_experts"] = num_experts
        return cfg
    cfg["num_experts"] = num_experts
    cfg["norm_topk_prob"] = bool(f.get(f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    layers = int(f.require(f"{arch}.block_count"))
    cfg["mlp_only_layers"] = [
        i for i in range(layers) if not f.has_tensor(f"blk.{i}.ffn_gate_inp.weight")
    ]
    cfg["qkv_bias"] = f.has_tensor("blk.0.attn_q.bias")
    return cfg


def _gemma(f: GGUFFile, arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma 2 / 3's settings as llama.cpp reads them (module docstring)."""
    if arch not in _GEMMA_27B_LAYERS:
        return {}
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    window = f.get(f"{arch}.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = f.get(f"{arch}.{key}")
        out[key] = float(value) if value else None
    is_27b = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    out["query_pre_attn_scalar"] = (
        cfg["hidden_size"] // cfg["num_attention_heads"] if is_27b else head_dim
    )
    if arch == "gemma3":
        pattern = f.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # one flag per layer: windowed or not
            out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            out["sliding_window_pattern"] = int(pattern) if pattern else 6
        base = f.get(f"{arch}.rope.freq_base_swa")
        if base:
            out["rope_local_base_freq"] = float(base)
    return out


def load_gguf_config(f: GGUFFile) -> ModelConfig:
    check_counts(f)  # the sizes the model is built from, against the tensors present
    cfg = gguf_config_dict(f)
    try:
        return ModelConfig.from_dict(cfg)
    except ValueError as e:
        raise ValueError(f"{f.path.name}: {e}") from e


def _rope_scaling(f: GGUFFile, arch: str) -> dict[str, Any]:
    if f.has_tensor("rope_freqs.weight"):
        raise ValueError(
            f"{f.path.name}: unsupported RoPE frequency factors (tensor rope_freqs.weight, "
            "Llama 3.1-style scaling)"
        )
    kind = f.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind == "yarn":  # gpt-oss: module docstring
        scaling = {
            "rope_type": "yarn",
            "factor": float(f.require(f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                f.require(f"{arch}.rope.scaling.original_context_length")
            ),
            "beta_fast": float(f.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(f.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        }
        if arch == "gpt-oss":
            scaling["truncate"] = False
        return {"rope_scaling": scaling}
    if kind != "linear":
        raise ValueError(f"{f.path.name}: unsupported {arch}.rope.scaling.type {kind!r}")
    factor = f.require(f"{arch}.rope.scaling.factor")
    return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
