"""MoE models from GGUF: ``qwen3moe``, ``qwen2moe`` (shared expert, dense layers) and
``llama`` with experts (Mixtral), written as llama.cpp's converter does (all experts of a
projection merged in one [E, rows, cols] tensor, Mixtral's q/k rows permuted). With F32
tensors the model is the checkpoint's: greedy tokens equal transformers' on the safetensors
checkpoint the file was made from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFWriter
from gguf_utils import permute_rotary
from model_utils import Driver, hf_greedy
from moe_utils import save_hf_moe_model
from safetensors.torch import load_file

from pydaemon.gguf.weights import _LAYER_NAMES
from pydaemon.model_loader.loader import load_model

GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                "w1": "gate", "w3": "up", "w2": "down"}  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 75)), [3] * 17]


def _write_moe_gguf(hf_dir: Path, path: Path, arch: str) -> Path:
    import json

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = GGUFWriter(str(path), arch)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    reverse = {hf: g for g, hf in _LAYER_NAMES.items()}
    merged: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t  # fmt: skip
            continue
        parts = name.split(".")
        layer, kind = parts[2], parts[-1]
        if parts[4] == "experts":  # model.layers.L.mlp.experts.E.<proj>.weight
            key = f"blk.{layer}.ffn_{EXPERT_PARTS[parts[6]]}_exps.weight"
            merged.setdefault(key, {})[int(parts[5])] = t
            continue
        module = ".".join(parts[3:-1])
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg["num_attention_heads" if "q_proj" in module else "num_key_value_heads"]
            t = torch.from_numpy(permute_rotary(t.numpy(), heads))
        if module == "mlp.shared_expert_gate":
            t = t.reshape(-1)  # llama.cpp keeps it 1D
        out[f"blk.{layer}.{reverse[module]}.{kind}"] = t
    for key, experts in merged.items():
        out[key] = torch.stack([experts[e] for e in sorted(experts)])
    for key, t in out.items():
        w.add_tensor(key, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_moe_greedy_matches_hf(tmp_path, arch):
    hf_dir = save_hf_moe_model(tmp_path, arch, seed=7)
    path = _write_moe_gguf(hf_dir, tmp_path / f"{arch}.gguf", GGUF_ARCH[arch])
    model, config = load_model(path)
    hf_arch = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe"}[arch]
    assert config.architecture == f"{hf_arch}ForCausalLM"
    ours = Driver(model, block_size=16).generate(PROMPTS, 12)
    assert ours == hf_greedy(hf_dir, PROMPTS, 12)
