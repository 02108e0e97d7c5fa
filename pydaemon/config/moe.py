"""Mixture-of-experts settings of a Hugging Face ``config.json``.

- ``MixtralForCausalLM``: ``num_local_experts`` experts of ``intermediate_size``, top
  ``num_experts_per_tok``, softmax scores always renormalised over the chosen experts; every
  layer is sparse; checkpoint expert names w1 (gate), w3 (up), w2 (down).
- ``Qwen3MoeForCausalLM``: ``num_experts`` (transformers 5 also writes
  ``num_local_experts``) of ``moe_intermediate_size``, renormalised when ``norm_topk_prob``;
  layer i is sparse unless it is in ``mlp_only_layers`` or (i + 1) is not a multiple of
  ``decoder_sparse_step`` (those are dense MLPs of ``intermediate_size``).
- ``Qwen2MoeForCausalLM``: as Qwen3-MoE, plus a shared expert of
  ``shared_expert_intermediate_size`` on every sparse layer, scaled by a sigmoid gate.
- ``GptOssForCausalLM``: ``num_local_experts`` of ``intermediate_size`` on every layer, top
  ``num_experts_per_tok`` (or ``experts_per_token``) with a softmax over the chosen logits
  (the same as a renormalised softmax), a router with a bias, expert biases and the clamped
  SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate,
  limit)`` (alpha 1.702, ``swiglu_limit`` 7.0); the checkpoint stacks each layer's experts
  (``experts.gate_up_proj`` [E, H, 2I], gate and up interleaved, ``experts.down_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPT_OSS = "GptOssForCausalLM"
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", GPT_OSS)
# The experts' activation on the fused gate/up projection: SiLU-and-multiply, or gpt-oss's
# clamped SwiGLU (vLLM calls it "swigluoai").
MOE_ACTIVATIONS = ("silu", "swigluoai")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    renormalize: bool  # the top-k weights divided by their sum
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block (True) or a dense MLP
    scoring: str = "softmax"
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # How the checkpoint holds the experts: one tensor per expert and projection
    # ("per_expert"), or gpt-oss's stacked tensors with interleaved gate/up ("gpt_oss").
    checkpoint_layout: str = "per_expert"
    activation: str = "silu"  # one of MOE_ACTIVATIONS
    swiglu_alpha: float = 1.702  # swigluoai only
    swiglu_limit: float = 7.0  # swigluoai only
    has_bias: bool = False  # a bias on every expert's gate/up and down projections
    router_bias: bool = False  # a bias on the router's logits


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json's {key!r} must be a positive integer, got {value!r}")
    return value


def parse_moe_config(arch: str, cfg: dict[str, Any], num_layers: int) -> MoeConfig | None:
    """-> the MoE settings of ``arch`` (None for a dense architecture); ValueError naming a
    missing or bad field."""
    if arch not in MOE_ARCHITECTURES:
        return None
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"unsupported scoring_func {cfg['scoring_func']!r} (only 'softmax')")
    if arch == GPT_OSS:
        return _gpt_oss(cfg, num_layers)
    top_k = _positive_int(cfg, "num_experts_per_tok")
    if arch == "MixtralForCausalLM":
        num_experts = _positive_int(cfg, "num_local_experts")
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) > num_local_experts ({num_experts})")
        return MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=_positive_int(cfg, "intermediate_size"),
            renormalize=True,
            sparse_layers=(True,) * num_layers,
            expert_names=("w1", "w3", "w2"),
        )
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    num_experts = _positive_int(cfg, key)
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) > {key} ({num_experts})")
    step = _positive_int(cfg, "decoder_sparse_step") if "decoder_sparse_step" in cfg else 1
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = _positive_int(cfg, "shared_expert_intermediate_size")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_positive_int(cfg, "moe_intermediate_size"),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared,
    )


def _gpt_oss(cfg: dict[str, Any], num_layers: int) -> MoeConfig:
    key = "num_experts_per_tok" if "num_experts_per_tok" in cfg else "experts_per_token"
    top_k = _positive_int({key: cfg.get(key, 4)}, key)
    num_experts = _positive_int(cfg, "num_local_experts")
    if top_k > num_experts:
        raise ValueError(f"{key} ({top_k}) > num_local_experts ({num_experts})")
    limit = cfg.get("swiglu_limit", 7.0)
    alpha = cfg.get("swiglu_alpha", 1.702)
    for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"config.json's {name!r} must be a positive number, got {value!r}")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        renormalize=True,  # softmax over the top-k logits = the renormalised top-k softmax
        sparse_layers=(True,) * num_layers,
        checkpoint_layout="gpt_oss",
        activation="swigluoai",
        swiglu_alpha=float(alpha),
        swiglu_limit=float(limit),
        has_bias=True,
        router_bias=True,
    )
