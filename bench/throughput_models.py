"""Model-shaped configurations for dummy-weight benchmarks: a directory with only config.json.

python bench/throughput_models.py llama3-8b /tmp/llama3-8b   # writes /tmp/llama3-8b/config.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

# bench/README.md's W1 model: the Llama-3-8B shape (weights are random, "dummy").
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "vocab_size": 128256,
}

# The same shape with a 32k context, for long-context workloads (e.g. 64 x 16k-token prompts:
# --workload fixed --input-len 16384 --num-requests 64); plain RoPE, random weights anyway.
LLAMA3_8B_32K = {**LLAMA3_8B, "max_position_embeddings": 32768}

# Mixture-of-experts shapes (issue 29): Qwen3-30B-A3B (48 layers, 128 experts of 768, top-8
# renormalised, GQA 32/4, head 128) and Mixtral-8x7B (32 layers, 8 experts of 14336, top-2).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vocab_size": 151936,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size": 32000,
}

# gpt-oss-20b's sizes (24 layers, hidden 2880, 32 experts of 2880, top-4, GQA 64/8 of head 64,
# vocab 201088) on the Qwen3-MoE architecture, for the MXFP4 expert path (issue 45): the
# experts' bytes and shapes are gpt-oss-20b's, its attention is plain full attention here (the
# gpt-oss model itself, with sinks, windows and expert biases, is "gpt-oss-20b").
GPT_OSS_20B_SHAPE = {
    **QWEN3_30B_A3B,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "moe_intermediate_size": 2880,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 150000.0,
    "vocab_size": 201088,
    "bos_token_id": 199998,
    "eos_token_id": 200002,
}

# Issue 44's shapes. Mistral-7B v0.1: a 4,096-token window on every layer, 32k context (long
# prompts: --workload fixed --input-len 16384). Gemma-3-27B (text): 5 local layers (1,024-token
# window, RoPE theta 10k) to 1 global (theta 1M, linear x8), GQA 32/16 of head 128, GeGLU,
# tied 262k vocabulary. gpt-oss-20b with bf16 experts (the checkpoint's are MXFP4): 24 layers
# alternating 128-token windows and full attention, sinks, YaRN x32, 32 experts of 2,880 top-4
# with biases and the clamped SwiGLU, GQA 64/8 of head 64.
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size": 32000,
}
GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 168,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "vocab_size": 262208,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "vocab_size": 201088,
}  # fmt: skip
# gpt-oss-120b: the same layers x 36, 128 experts.
GPT_OSS_120B = {
    **GPT_OSS_20B,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}

MODEL_CONFIGS = {
    "llama3-8b": LLAMA3_8B,
    "llama3-8b-32k": LLAMA3_8B_32K,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "mistral-7b": MISTRAL_7B,
    "gemma3-27b": GEMMA3_27B,
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": GPT_OSS_120B,
    "gpt-oss-20b-shape": GPT_OSS_20B_SHAPE,
}


def write_model_config(name: str, directory: str | Path | None = None) -> Path:
    """Writes ``name``'s config.json into ``directory`` (a new temp dir when None); returns the dir."""
    if name not in MODEL_CONFIGS:
        raise ValueError(
            f"unknown model config {name!r}: expected one of {', '.join(MODEL_CONFIGS)}"
        )
    path = Path(directory) if directory else Path(tempfile.mkdtemp(prefix=f"pagedd-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIGS[name], indent=2) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODEL_CONFIGS)}}} DIR")
    print(write_model_config(sys.argv[1], sys.argv[2]))
