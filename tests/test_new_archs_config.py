"""Config parsing of Gemma 2 / Gemma 3 / gpt-oss and of YaRN and partial rotary RoPE: the old
and the transformers 5.x ways of writing them, the defaults transformers fills in, the errors
that name what is unsupported; YaRN's inverse frequencies and attention factor equal
transformers' own; the benchmark shapes of issue 44 parse and build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.config.model import ModelConfig
from pydaemon.layers.rotary_embedding import RotaryEmbedding, apply_rotary, rotate_half
from pydaemon.models import get_model_class

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.throughput_models import MODEL_CONFIGS  # noqa: E402

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}


def test_gemma3_old_style_config():
    """gemma-3-1b-it's form: rope_local_base_freq, sliding_window_pattern, no layer_types."""
    cfg = ModelConfig.from_dict({
        **SMALL, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512,
        "sliding_window_pattern": 4, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh",
    })  # fmt: skip
    assert cfg.layer_sliding_windows == [512, 512, 512, None] * 2
    assert cfg.layer_types[3] == "full_attention"
    assert cfg.layer_rope(0).theta == 1e4 and cfg.layer_rope(0).scaling is None
    assert cfg.layer_rope(3).theta == 1e6 and cfg.layer_rope(3).scaling.factor == 8.0
    assert cfg.attention_scale == 24**-0.5 and cfg.qk_norm and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.attn_logit_softcapping is None and cfg.tie_word_embeddings


def test_gemma3_local_rope_even_without_a_window():
    """A window covering the context is no window, but the local layers keep their RoPE."""
    cfg = ModelConfig.from_dict(
        {**SMALL, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 1 << 20}
    )
    assert not cfg.has_sliding_window
    assert cfg.layer_rope(0).theta == 1e4 and cfg.layer_rope(5).theta == 1e6


def test_gemma3_multimodal_text_config_takes_transformers_defaults():
    cfg = ModelConfig.from_dict({
        "architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
        "eos_token_id": [1, 106], "vision_config": {"hidden_size": 1152},
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "num_hidden_layers": 34, "sliding_window": 1024,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    })  # fmt: skip
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 256)
    assert cfg.vocab_size == 262208 and cfg.attention_scale == 256**-0.5
    assert cfg.eos_token_ids == [1, 106] and cfg.torch_dtype == "bfloat16"
    assert sum(w is None for w in cfg.layer_sliding_windows) == 34 // 6
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_gemma2_defaults():
    cfg = ModelConfig.from_dict({**SMALL, "architectures": ["Gemma2ForCausalLM"]})
    assert cfg.attn_logit_softcapping == 50.0 and cfg.final_logit_softcapping == 30.0
    assert cfg.layer_sliding_windows == [None] * 8  # 4096 covers the context
    cfg = ModelConfig.from_dict(
        {**SMALL, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 64,
         "final_logit_softcapping": None}
    )  # fmt: skip
    assert cfg.layer_sliding_windows == [64, None] * 4 and cfg.final_logit_softcapping is None
    assert cfg.local_rope is None


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "dynamic", "factor": 2.0},
                                 "full_attention": {"rope_type": "default"}}},
            "dynamic",
        ),
    ],
)  # fmt: skip
def test_gemma_refusals_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**SMALL, "architectures": ["Gemma3ForCausalLM"], **overrides})


def test_gpt_oss_config_as_released():
    """gpt-oss-20b's config.json form: rope_scaling + rope_theta, experts_per_token."""
    cfg = ModelConfig.from_dict({
        **SMALL, "architectures": ["GptOssForCausalLM"], "num_local_experts": 8,
        "experts_per_token": 2, "sliding_window": 128, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
        "swiglu_limit": 7.0,
    })  # fmt: skip
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias
    assert cfg.layer_sliding_windows == [128, None] * 4
    assert cfg.rope_theta == 150000 and cfg.rope_scaling.rope_type == "yarn"
    assert not cfg.rope_scaling.truncate and cfg.rope_scaling.attention_factor == pytest.approx(
        0.1 * torch.log(torch.tensor(32.0)).item() + 1
    )
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 96)
    assert moe.activation == "swigluoai" and moe.has_bias and moe.router_bias
    assert moe.checkpoint_layout == "gpt_oss"
    default = ModelConfig.from_dict({**SMALL, "architectures": ["GptOssForCausalLM"],
                                     "num_local_experts": 4})  # fmt: skip
    assert default.rope_theta == 150000.0 and default.rope_scaling.factor == 32.0
    assert default.moe.top_k == 4 and default.layer_sliding_windows == [128, None] * 4


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 4096},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
         "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
         "attention_factor": 0.9},
    ],
)  # fmt: skip
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_yarn_equals_transformers(rope, partial):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.Qwen3Config(
        **{**SMALL, "head_dim": 64}, rope_parameters={**rope, "rope_theta": 1e6},
        partial_rotary_factor=partial,
    )  # fmt: skip
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    d = hf.to_dict()
    d["architectures"] = ["Qwen3ForCausalLM"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.rotary_dim == int(64 * partial)
    rope_layer = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(rope_layer.inv_freq, inv_freq)
    assert rope_layer.attention_factor == attention_factor
    cos, sin = rope_layer(torch.arange(10))
    freqs = torch.arange(10)[:, None].float() * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    assert torch.equal(cos, emb.cos() * attention_factor)
    assert torch.equal(sin, emb.sin() * attention_factor)


def test_yarn_without_factor_takes_the_context_ratio():
    """DeepSeek-style: the factor is max_position_embeddings / original (transformers' yarn
    code path; its config validation wants a factor, so it is compared by value)."""
    cfg = ModelConfig.from_dict({**SMALL, "architectures": ["Qwen3ForCausalLM"],
        "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 1024}})  # fmt: skip
    assert cfg.rope_scaling.factor == 4.0 and cfg.rope_scaling.truncate


def test_partial_rotary_rotates_the_first_dims_only():
    """transformers' partial-rotary convention (Phi-3, Qwen3-Next): rotate_half on
    x[..., :rotary_dim], the rest passed through."""
    rope = RotaryEmbedding(16, 10000.0, None)
    cos, sin = rope(torch.arange(5))
    x = torch.randn(5, 3, 64)
    out = apply_rotary(x, cos, sin)
    rot = x[..., :16] * cos[:, None] + rotate_half(x[..., :16]) * sin[:, None]
    assert torch.equal(out[..., :16], rot) and torch.equal(out[..., 16:], x[..., 16:])


@pytest.mark.parametrize("name", ["mistral-7b", "gemma3-27b", "gpt-oss-20b", "gpt-oss-120b"])
def test_issue_44_bench_shapes_build(name):
    cfg = ModelConfig.from_dict(MODEL_CONFIGS[name])
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg)
    params = sum(p.numel() for p in model.parameters())
    expected = {"mistral-7b": 7.2e9, "gemma3-27b": 27.0e9, "gpt-oss-20b": 20.9e9,
                "gpt-oss-120b": 116.8e9}[name]  # fmt: skip
    assert abs(params - expected) / expected < 0.03, f"{name}: {params / 1e9:.2f}B parameters"
