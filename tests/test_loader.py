"""Config parsing and weight loading: errors, sharding, dtypes, dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import Driver, save_hf_model
from safetensors.torch import load_file, save_file

from pydaemon.config.model import ModelConfig, resolve_dtype
from pydaemon.model_loader.loader import load_model
from pydaemon.models import get_model_class

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def _write_config(d: Path, **overrides) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**BASE, **overrides}))
    return d


def _copy_with(hf_dir: Path, out: Path, edit) -> Path:
    out.mkdir()
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


def test_config_defaults_and_eos_list():
    cfg = ModelConfig.from_dict({**BASE, "num_key_value_heads": None, "eos_token_id": [2, 7]})
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 8
    assert cfg.eos_token_ids == [2, 7] and cfg.max_model_len == 256
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_config_rope_formats():
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64}}
    )  # fmt: skip
    new = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64}}
    )  # fmt: skip
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling and new.rope_scaling.factor == 8.0
    default = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert default.rope_scaling is None and default.rope_theta == 1e6


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),  # 0 dims of head_dim 8
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention"],
            },
            "layer_types",
        ),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_config_rejects_unsupported(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**BASE, **overrides})


def test_sliding_window_per_layer():
    def windows(**cfg):
        return ModelConfig.from_dict({**BASE, "num_hidden_layers": 3, **cfg}).layer_sliding_windows

    mistral = {"architectures": ["MistralForCausalLM"]}
    assert windows(**mistral, sliding_window=16) == [16, 16, 16]
    assert windows(**mistral, sliding_window=None) == [None] * 3
    assert windows(**mistral, sliding_window=1 << 20) == [None] * 3  # covers the context
    assert windows(sliding_window=16) == [None] * 3  # Llama has no window
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 16}
    assert windows(**qwen2) == [None] * 3  # use_sliding_window defaults to false
    assert windows(**qwen2, use_sliding_window=True, max_window_layers=1) == [None, 16, 16]
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert windows(**qwen2, use_sliding_window=True, layer_types=types) == [16, None, 16]
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.has_sliding_window


def test_mistral_without_window_ok():
    cfg = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"]})
    assert get_model_class(cfg.architecture).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="FooForCausalLM"):
        get_model_class("FooForCausalLM")


def test_resolve_dtype():
    cfg = ModelConfig.from_dict(BASE)
    assert resolve_dtype(cfg, "auto") == torch.bfloat16
    assert resolve_dtype(cfg, "float16") == torch.float16
    assert resolve_dtype(ModelConfig.from_dict({**BASE, "torch_dtype": None})) == torch.float32
    assert resolve_dtype(ModelConfig.from_dict({**BASE, "dtype": "float16"})) == torch.float16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype(cfg, "int8")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(_write_config(tmp_path / "m"))


def test_missing_tensor(hf_dir, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    d = _copy_with(hf_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name):
        load_model(d)


def test_wrong_shape(hf_dir, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(16, 64)

    d = _copy_with(hf_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=r"k_proj.weight.*\[16, 64\].*\[32, 64\]"):
        load_model(d)


def test_unexpected_tensors_ignored(hf_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["something.else"] = torch.ones(2)

    model, _ = load_model(_copy_with(hf_dir, tmp_path / "m", edit))
    assert "something.else" not in dict(model.named_parameters())


def test_sharded_load_equals_single(hf_dir, tmp_path):
    tensors = load_file(hf_dir / "model.safetensors")
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((hf_dir / "config.json").read_text())
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, d / fname)
        weight_map.update({n: fname for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    single, _ = load_model(hf_dir)
    sharded, _ = load_model(d)
    for (n1, p1), (n2, p2) in zip(
        single.named_parameters(), sharded.named_parameters(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(d)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtype_conversion(hf_dir, dtype):
    model, cfg = load_model(hf_dir, dtype=dtype)
    want = getattr(torch, dtype)
    assert all(p.dtype == want for p in model.parameters())
    assert all(not p.requires_grad for p in model.parameters())
    ref = load_file(hf_dir / "model.safetensors")["model.embed_tokens.weight"].to(want)
    assert torch.equal(model.model.embed_tokens.weight, ref)
    out = Driver(model, block_size=16).generate([[5, 6, 7]], 4)
    assert len(out[0]) == 4


def test_dummy_load_config_only(tmp_path):
    d = _write_config(tmp_path / "dummy", torch_dtype="float32")
    model, cfg = load_model(d, load_format="dummy", seed=3)
    again, _ = load_model(d, load_format="dummy", seed=3)
    assert cfg.architecture == "LlamaForCausalLM"
    w = model.model.layers[0].self_attn.qkv_proj.weight  # q 32 rows, k and v 16 each
    assert w.shape == (64, 32) and 0.015 < w.std().item() < 0.025
    assert torch.equal(w, again.model.layers[0].self_attn.qkv_proj.weight)
    assert model.model.norm.weight.eq(1).all()
    assert len(Driver(model, block_size=8).generate([[1, 2, 3]], 3)[0]) == 3
    with pytest.raises(ValueError, match="load_format"):
        load_model(d, load_format="pt")
