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

MODEL_CONFIGS = {"llama3-8b": LLAMA3_8B, "llama3-8b-32k": LLAMA3_8B_32K}


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
