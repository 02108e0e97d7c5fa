"""Gemma 2, Gemma 3 (text and the text part of the multimodal checkpoint) and gpt-oss: greedy
tokens equal transformers' on tiny random float32 checkpoints, all prompts in one batch with
prompts and outputs longer than the 8-token windows; chunked prefill next to decodes; Gemma 2's
final soft-cap (which greedy tokens cannot see) through the logits themselves."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import Driver, Seq, build_step, hf_greedy, make_kv_cache
from new_arch_utils import CONFIGS, save_hf_gemma3_multimodal, save_hf_new_arch

from pydaemon.layers.rms_norm import GemmaRMSNorm
from pydaemon.model_loader.loader import load_model

MAX_NEW = 24
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (7, 16, 17, 33, 1)]


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    """get(name) -> (model dir, our model, transformers' greedy tokens), built once per
    module: the models go with the module (a module-level cache kept them all session)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(name)
            d = (
                save_hf_gemma3_multimodal(tmp)
                if name == "gemma3_mm"
                else save_hf_new_arch(tmp, name)
            )
            model, _ = load_model(d)
            cache[name] = (d, model, hf_greedy(d, PROMPTS, MAX_NEW))
        return cache[name]

    return get


@pytest.mark.parametrize(
    "name,block_size",
    [("gemma2", 8), ("gemma2", 32), ("gemma3", 16), ("gpt_oss", 8), ("gpt_oss", 16)],
)
def test_greedy_matches_hf_batched(arch_model, name, block_size):
    _, model, ref = arch_model(name)
    ours = Driver(model, block_size).generate(PROMPTS, MAX_NEW)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a == b, f"{name} prompt {i} (len {len(PROMPTS[i])}): {a} != {b}"
    assert len(set(map(tuple, ours))) > 1


def test_gemma3_multimodal_checkpoint_text_part(arch_model):
    """Gemma3ForConditionalGeneration's text model, from the multimodal checkpoint's names;
    text-only prompts give transformers' tokens (its vision tower is never loaded)."""
    _, model, ref = arch_model("gemma3_mm")
    assert model.config.architecture == "Gemma3ForConditionalGeneration"
    assert Driver(model, 16).generate(PROMPTS, MAX_NEW) == ref


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_chunked_prefill_mixed_with_decodes(arch_model, name):
    """A prompt prefilled in two chunks (the second over a cached prefix longer than the
    window), the second chunk in the same step as a decode."""
    _, model, ref = arch_model(name)
    pa, pb = PROMPTS[3], PROMPTS[0]
    drv = Driver(model, block_size=8)
    a, b = Seq(list(pa)), Seq(list(pb))
    drv.step([b, a], [len(pb), 13], num_prefills=2)
    drv.step([a, b], [len(pa) - 13, 1], num_prefills=1)
    while len(a.token_ids) < len(pa) + MAX_NEW:
        drv.step([a, b], [1, 1], num_prefills=0)
    assert a.token_ids[len(pa) :] == ref[3]
    assert b.token_ids[len(pb) : len(pb) + MAX_NEW] == ref[0]


def test_gemma2_logits_match_hf(arch_model):
    """The final soft-cap (30 * tanh(x / 30), here 3) keeps the argmax: compare the logits."""
    import transformers

    model_dir, model, _ = arch_model("gemma2")
    prompt = PROMPTS[3]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]  # [L, vocab]
        kv = make_kv_cache(model, 16, 8)
        seq = Seq(list(prompt), block_table=list(range(5)))
        ids, pos, md = build_step([seq], [len(prompt)], 1, 8)
        ours = model.compute_logits(model(ids, pos, kv, md))
    assert ref.abs().max() < 3.0  # capped
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_layers_follow_the_config(arch_model):
    _, gemma2, _ = arch_model("gemma2")
    attn = gemma2.model.layers[0].self_attn
    assert attn.attn.sliding_window == 8 and attn.attn.softcap == 1.5
    assert attn.attn.scale == 24**-0.5 and attn.q_norm is None
    assert gemma2.model.layers[1].self_attn.attn.sliding_window is None
    assert isinstance(gemma2.model.norm, GemmaRMSNorm) and gemma2.lm_head is None
    _, gemma3, _ = arch_model("gemma3")
    assert gemma3.model.layer_is_local == [True, True, False]
    assert isinstance(gemma3.model.layers[0].self_attn.q_norm, GemmaRMSNorm)
    assert gemma3.model.rotary_emb_local.theta == 10_000.0
    assert gemma3.model.rotary_emb.scaling.rope_type == "linear"
    _, gpt_oss, _ = arch_model("gpt_oss")
    layer = gpt_oss.model.layers[0]
    assert layer.self_attn.sinks.shape == (4,) and layer.self_attn.o_proj.bias is not None
    experts = layer.mlp.experts
    assert experts.activation.name == "swigluoai" and experts.activation.limit == 0.4
    assert experts.w13_bias.shape == (8, 2 * 96) and layer.mlp.gate.bias is not None
    assert [lyr.self_attn.attn.sliding_window for lyr in gpt_oss.model.layers] == [8, None] * 2
    assert gpt_oss.model.rotary_emb.scaling.rope_type == "yarn"


def test_gpt_oss_experts_are_deinterleaved(arch_model):
    """w13 holds gate rows then up rows: checkpoint column 2j is gate j, 2j + 1 up j."""
    from safetensors import safe_open

    model_dir, model, _ = arch_model("gpt_oss")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")  # [E, H, 2I]
        bias = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias")
        down = f.get_tensor("model.layers.1.mlp.experts.down_proj")  # [E, I, H]
    experts = model.model.layers[1].mlp.experts
    i = experts.intermediate_size
    assert torch.equal(experts.w13_weight[:, :i], gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(experts.w13_weight[:, i:], gate_up[..., 1::2].transpose(1, 2))
    assert torch.equal(experts.w13_bias[:, i:], bias[:, 1::2])
    assert torch.equal(experts.w2_weight, down.transpose(1, 2))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dummy_weights_load_from_config_only(arch_model, name, tmp_path):
    model_dir, _, _ = arch_model(name)
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    model, _ = load_model(tmp_path, load_format="dummy", seed=1)
    out = Driver(model, 16).generate(PROMPTS[:2], 4)
    assert all(len(o) == 4 for o in out)
