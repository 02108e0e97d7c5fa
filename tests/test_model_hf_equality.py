"""Greedy token-for-token equality with transformers on tiny random float32 models."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import Driver, Seq, hf_greedy, save_hf_model

from pydaemon.model_loader.loader import load_model

MAX_NEW = 32

CONFIGS = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "qwen2-bias": ("qwen2", {}),
    "llama3-rope-tied": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral-mqa": ("mistral", {"num_key_value_heads": 1}),
    "qwen3-qknorm": ("qwen3", {}),
    "qwen3-bias-mha": ("qwen3", {"attention_bias": True, "num_key_value_heads": 4}),
    # Windows shorter than most prompts + outputs (every layer / layers >= max_window_layers).
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    ),
    "qwen3-window": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0},
    ),
}


def _prompts(lengths: list[int], seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            arch, overrides = CONFIGS[name]
            d = save_hf_model(tmp_path_factory.mktemp(name), arch, seed=len(cache), **overrides)
            model, _ = load_model(d)
            cache[name] = (d, model)
        return cache[name]

    return get


# Unequal prompts crossing block boundaries (8/16/32) and a one-token prompt.
PROMPTS = _prompts([7, 16, 17, 33, 1], seed=0)
_HF_REFS: dict[str, list[list[int]]] = {}


def _hf_ref(name: str, model_dir) -> list[list[int]]:
    if name not in _HF_REFS:
        _HF_REFS[name] = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    return _HF_REFS[name]


@pytest.mark.parametrize(
    "name,block_size",
    [
        ("llama-gqa", 8),
        ("llama-gqa", 16),
        ("llama-gqa", 32),
        ("llama-mha", 16),
        ("qwen2-bias", 8),
        ("qwen2-bias", 32),
        ("llama3-rope-tied", 16),
        ("mistral-mqa", 32),
        ("qwen3-qknorm", 8),
        ("qwen3-bias-mha", 16),
        ("mistral-window", 8),
        ("mistral-window", 16),
        ("qwen2-window", 8),
        ("qwen3-window", 16),
    ],
)
def test_greedy_matches_hf_batched(model_dirs, name, block_size):
    model_dir, model = model_dirs(name)
    prompts = PROMPTS
    ours = Driver(model, block_size).generate(prompts, MAX_NEW)
    ref = _hf_ref(name, model_dir)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a == b, f"prompt {i} (len {len(prompts[i])}): {a} != {b}"
    assert len(set(map(tuple, ours))) > 1


def test_loaded_config_flags(model_dirs):
    _, model = model_dirs("qwen2-bias")
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    _, tied = model_dirs("llama3-rope-tied")
    assert tied.lm_head is None and tied.config.rope_scaling.rope_type == "llama3"


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "mistral-window"])
def test_prefill_mixed_with_decodes(model_dirs, name):
    """A new prompt is prefilled in the same step as two running sequences decode."""
    model_dir, model = model_dirs(name)
    pa, pb, pc = PROMPTS[1], PROMPTS[3], PROMPTS[2]
    drv = Driver(model, block_size=8)
    a, b, c = Seq(list(pa)), Seq(list(pb)), Seq(list(pc))
    drv.step([a, b], [len(pa), len(pb)], num_prefills=2)
    for _ in range(3):
        drv.step([a, b], [1, 1], num_prefills=0)
    drv.step([c, a, b], [len(pc), 1, 1], num_prefills=1)
    while len(c.token_ids) < len(pc) + MAX_NEW:
        drv.step([a, b, c], [1, 1, 1], num_prefills=0)
    ref = _hf_ref(name, model_dir)
    assert c.token_ids[len(pc) :] == ref[2]
    assert a.token_ids[len(pa) : len(pa) + MAX_NEW] == ref[1]
    assert b.token_ids[len(pb) : len(pb) + MAX_NEW] == ref[3]


@pytest.mark.parametrize(
    "name,block_size", [("llama-gqa", 8), ("llama-gqa", 16), ("mistral-window", 8)]
)
def test_chunked_prefill(model_dirs, name, block_size):
    """A prompt prefilled in two chunks (the second one with a cached prefix), next to a
    full prefill and then a decode."""
    model_dir, model = model_dirs(name)
    pa, pb = PROMPTS[3], PROMPTS[0]
    drv = Driver(model, block_size)
    a, b = Seq(list(pa)), Seq(list(pb))
    drv.step([b, a], [len(pb), 13], num_prefills=2)
    assert len(a.token_ids) == len(pa)  # no token after a partial chunk
    drv.step([a, b], [len(pa) - 13, 1], num_prefills=1)
    while len(a.token_ids) < len(pa) + MAX_NEW:
        drv.step([a, b], [1, 1], num_prefills=0)
    ref = _hf_ref(name, model_dir)
    assert a.token_ids[len(pa) :] == ref[3]
    assert b.token_ids[len(pb) : len(pb) + MAX_NEW] == ref[0]


def test_logits_dtype_and_shape(model_dirs):
    _, model = model_dirs("llama-gqa")
    logits = model.compute_logits(torch.zeros(3, 64))
    assert logits.shape == (3, 256) and logits.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "name", ["llama-gqa", "qwen2-bias", "llama3-rope-tied", "qwen3-qknorm", "mistral-window"]
)
@pytest.mark.parametrize("block_size", [16])
def test_greedy_matches_hf_on_cuda(model_dirs, name, block_size):
    """The torch path on CUDA tensors, against transformers on CPU."""
    model_dir, _ = model_dirs(name)
    model, _ = load_model(model_dir, device="cuda")
    ours = Driver(model, block_size).generate(PROMPTS, MAX_NEW)
    assert ours == _hf_ref(name, model_dir)
