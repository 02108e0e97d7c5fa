"""Test helpers: tiny random Hugging Face checkpoints (float32) of Gemma 2, Gemma 3 (text and
multimodal) and gpt-oss, with the features that set them apart made to matter: windows shorter
than the prompts, soft-caps small enough to bend the scores, sinks and biases drawn away from
zero, norms away from their neutral value."""

from __future__ import annotations

from pathlib import Path

import torch

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    initializer_range=0.1,
    sliding_window=8,
)

# name -> (transformers architecture, config overrides)
CONFIGS: dict[str, tuple[str, dict]] = {
    # Soft-caps low enough that tanh bends real scores; query_pre_attn_scalar != head_dim.
    "gemma2": (
        "Gemma2ForCausalLM",
        dict(attn_logit_softcapping=1.5, final_logit_softcapping=3.0, query_pre_attn_scalar=24),
    ),
    # Two local layers to one global, local RoPE theta 10k, global theta 1M with linear x2.
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            query_pre_attn_scalar=32,
        ),
    ),
    # Alternating 8-token windows, YaRN x4 over 64 original positions, 8 experts top-2.
    "gpt_oss": (
        "GptOssForCausalLM",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
            swiglu_limit=0.4,  # the clamps bite at this model's activation sizes
        ),
    ),
}


def _hf_classes(arch: str):
    import transformers

    return {
        "Gemma2ForCausalLM": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "Gemma3ForCausalLM": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "GptOssForCausalLM": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]


def _perturb(model: torch.nn.Module, arch: str) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("norm.weight") and arch.startswith("Gemma"):
                p.normal_(0.0, 0.3)  # (1 + w): around 1


def save_hf_new_arch(tmp_path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """Saves the tiny random model ``name`` of CONFIGS and returns its directory."""
    arch, arch_overrides = CONFIGS[name]
    config_cls, model_cls = _hf_classes(arch)
    kw = {**_BASE, **arch_overrides, **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).float().eval()
    _perturb(model, arch)
    out = tmp_path / f"{name}-{seed}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_hf_gemma3_multimodal(tmp_path: Path, seed: int = 0) -> Path:
    """A tiny Gemma3ForConditionalGeneration (a 2-layer SigLIP tower) whose text model is
    CONFIGS["gemma3"]'s."""
    import transformers

    text = transformers.Gemma3TextConfig(**{**_BASE, **CONFIGS["gemma3"][1]})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    _perturb(model, "Gemma3ForCausalLM")
    out = tmp_path / f"gemma3-mm-{seed}"
    model.save_pretrained(out, safe_serialization=True)
    return out
