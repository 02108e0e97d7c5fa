"""Mixtral, Qwen3-MoE and Qwen2-MoE: greedy tokens equal transformers' on tiny random float32
checkpoints, all prompts in one batch (tokens of different sequences share experts), with
mixed prefill / decode steps and a chunked prefill; the config fields that shape the layers."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import Driver, Seq, hf_greedy
from moe_utils import MOE_ARCHS, save_hf_moe_model

from pydaemon.config.model import ModelConfig
from pydaemon.layers.moe import FusedMoE, SparseMoeBlock
from pydaemon.model_loader.loader import load_model

MAX_NEW = 16
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (7, 16, 17, 33, 1)]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """get(name) -> (model dir, our model, transformers' greedy tokens), built once per
    module: the models go with the module (a module-level cache kept them all session)."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            d = save_hf_moe_model(tmp_path_factory.mktemp(arch), arch, seed=len(cache))
            model, _ = load_model(d)
            cache[arch] = (d, model, hf_greedy(d, PROMPTS, MAX_NEW))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_greedy_matches_hf_batched(moe_model, arch):
    _, model, ref = moe_model(arch)
    ours = Driver(model, block_size=16).generate(PROMPTS, MAX_NEW)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a == b, f"{arch} prompt {i} (len {len(PROMPTS[i])}): {a} != {b}"
    assert len(set(map(tuple, ours))) > 1


@pytest.mark.parametrize("arch", ["qwen2_moe"])  # the engine test chunks Qwen3-MoE
def test_chunked_prefill_mixed_with_decodes(moe_model, arch):
    """A prompt prefilled in two chunks, the second next to a decode."""
    _, model, ref = moe_model(arch)
    pa, pb = PROMPTS[3], PROMPTS[0]
    drv = Driver(model, block_size=8)
    a, b = Seq(list(pa)), Seq(list(pb))
    drv.step([b, a], [len(pb), 13], num_prefills=2)
    drv.step([a, b], [len(pa) - 13, 1], num_prefills=1)
    while len(a.token_ids) < len(pa) + MAX_NEW:
        drv.step([a, b], [1, 1], num_prefills=0)
    assert a.token_ids[len(pa) :] == ref[3]
    assert b.token_ids[len(pb) : len(pb) + MAX_NEW] == ref[0]


def test_layer_kinds_follow_the_config(moe_model):
    _, qwen3, _ = moe_model("qwen3_moe")
    layers = qwen3.model.layers
    assert isinstance(layers[0].mlp, SparseMoeBlock) and not isinstance(
        layers[1].mlp, SparseMoeBlock
    )
    assert layers[0].mlp.experts.top_k == 3 and layers[0].mlp.experts.renormalize
    assert layers[0].mlp.shared_expert is None and layers[0].self_attn.q_norm is not None
    _, qwen2, _ = moe_model("qwen2_moe")
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in qwen2.model.layers]
    assert kinds == [False, True, False]  # decoder_sparse_step 2
    block = qwen2.model.layers[1].mlp
    assert block.shared_expert is not None and not block.experts.renormalize
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None
    _, mixtral, _ = moe_model("mixtral")
    experts = mixtral.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE) and experts.renormalize
    assert experts.w13_weight.shape == (8, 2 * 96, 64) and experts.w2_weight.shape == (8, 64, 96)


def test_dummy_weights_load_from_config_only(moe_model, tmp_path):
    model_dir, _, _ = moe_model("qwen2_moe")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    model, config = load_model(tmp_path, load_format="dummy", seed=1)
    assert config.moe is not None and config.moe.num_experts == 8
    ids = torch.tensor([5, 6, 7])
    block = model.model.layers[1].mlp
    out = block(model.model.embed_tokens(ids))
    assert out.shape == (3, 64) and torch.isfinite(out).all() and out.abs().sum() > 0


def test_config_errors_name_the_field():
    base = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    assert ModelConfig.from_dict(base).moe.num_experts == 4
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "moe_intermediate_size"})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_dict({**base, "mlp_only_layers": "all"})


@pytest.mark.parametrize("async_scheduling", [True])
def test_engine_features_with_moe(moe_model, async_scheduling):
    """Through the engine: prefix caching (a shared prefix), chunked prefill (16-token
    budget), recompute preemption (9 blocks of 8 tokens for all), sync and async scheduling:
    greedy tokens equal transformers'."""
    from pydaemon.entrypoints.llm import LLM
    from pydaemon.sampling_params import SamplingParams

    model_dir, _, _ = moe_model("qwen3_moe")
    prompts = [PROMPTS[3], PROMPTS[3][:20] + [9, 8, 7], PROMPTS[1], PROMPTS[2]]
    ref = hf_greedy(model_dir, prompts, 10)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=8, num_kv_blocks=9,
              max_num_seqs=4, max_num_batched_tokens=16, preemption_mode="recompute",
              enable_prefix_caching=True, async_scheduling=async_scheduling)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    llm.engine.shutdown()


def test_benchmark_shapes():
    """bench/throughput_models.py's MoE shapes are the models the issue names."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.throughput_models import MODEL_CONFIGS

    qwen = ModelConfig.from_dict(MODEL_CONFIGS["qwen3-30b-a3b"])
    assert (qwen.num_hidden_layers, qwen.hidden_size, qwen.head_dim) == (48, 2048, 128)
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.qk_norm) == (32, 4, True)
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size) == (128, 8, 768)
    assert qwen.moe.renormalize and all(qwen.moe.sparse_layers)
    mixtral = ModelConfig.from_dict(MODEL_CONFIGS["mixtral-8x7b"])
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (
        8,
        2,
        14336,
    )
