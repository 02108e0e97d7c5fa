"""Model-shaped configurations for dummy-weight benchmarks: a directory with only config.json.

python bench/throughput_models.py llama3-8b /tmp/llama3-8b   # writes /tmp/llama3-8b/config.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

# BENCH.md's W1 model: the Llama-3-8B shape (weights are random, "dummy").
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
# vocab 201088) on the Qwen3-MoE architecture, for the MXFP4 expert path (issue 45) until the
# gpt-oss model itself (attention sinks, alternating windows, expert biases) is measured: the
# experts' bytes and shapes are gpt-oss-20b's, its attention is plain full attention here.
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

MODEL_CONFIGS = {
    "llama3-8b": LLAMA3_8B,
    "llama3-8b-32k": LLAMA3_8B_32K,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "mixtral-8x7b": MIXTRAL_8X7B,
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
