"""Test helpers: tiny random Hugging Face mixture-of-experts checkpoints (float32) and a
float64 reference of a MoE layer."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

# Tiny shapes of each architecture; several experts per token so that tokens of different
# sequences meet in the same experts.
MOE_ARCHS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    # Layer 1 dense (mlp_only_layers), top-3 renormalised, head_dim != hidden / heads.
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        head_dim=32,
    ),
    # Sparse every second layer (decoder_sparse_step 2), shared expert, no renormalisation.
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
        num_hidden_layers=3,
    ),
}


def save_hf_moe_model(tmp_path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Saves a tiny random transformers MoE model (float32) and returns its directory."""
    import transformers

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    kw.update(MOE_ARCHS[arch])
    kw.update(overrides)
    config_cls, model_cls = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)  # a router that prefers some experts clearly
    out = tmp_path / f"{arch}-{seed}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def reference_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
) -> torch.Tensor:  # [T, H] float64
    """Token by token in float64; ties go to the lower expert id."""
    x, w13, w2, logits = x.double(), w13.double(), w2.double(), logits.double()
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        scores = logits[t].softmax(-1) if scoring == "softmax" else logits[t].sigmoid()
        order = sorted(range(len(scores)), key=lambda e: (-float(logits[t, e]), e))[:top_k]
        weights = scores[order]
        if renormalize:
            weights = weights / weights.sum()
        for e, w in zip(order, weights, strict=True):
            h = w13[e] @ x[t]
            out[t] += w * (w2[e] @ (F.silu(h[:i]) * h[i:]))
    return out
