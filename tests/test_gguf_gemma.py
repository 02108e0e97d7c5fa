"""Gemma 2 and Gemma 3 from GGUF files (issue 44): a tiny random Hugging Face checkpoint
written as llama.cpp's converter writes it (norms stored as 1 + w, Gemma's tensor names,
the window and soft-caps as metadata, Gemma 3's five local layers to one global and its
linear RoPE scaling as llama.cpp hard-codes or reads them) gives transformers' greedy tokens
on the original checkpoint, batched, with prompts longer than the windows; the attention scale
follows llama.cpp's rule for the 27B shapes."""

from __future__ import annotations

import random

import pytest
import torch
from gguf import GGUFWriter
from gguf_utils import gguf_name
from model_utils import Driver, hf_greedy
from new_arch_utils import save_hf_new_arch

from pydaemon.gguf import GGUFFile
from pydaemon.gguf.config import gguf_config_dict
from pydaemon.gguf.weights import _GEMMA_LAYER_NAMES
from pydaemon.model_loader.loader import load_model
from pydaemon.tokenizer.gguf import load_gguf_tokenizer

MAX_NEW = 16
# A SentencePiece vocabulary as Gemma's GGUF files hold it: specials, the 256 byte pieces,
# pieces (test_gguf_spm_tokenizer.py's); the tiny models get exactly this many rows.
S = "\u2581"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = [S, "  ", "\n", "h", "e", "l", "o", "w", "r", "d", "he", "ll", S + "w", S + "world",
          "hello", "lo", "hel"]  # fmt: skip
TOKENS = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (7, 16, 21, 33, 1)]

# Gemma 3 as llama.cpp reads a GGUF: five local layers (base 10,000, no scaling) to one global
# (rope.freq_base, linear scaling from the metadata).
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=32, vocab_size=len(TOKENS)),
    "gemma3": dict(
        vocab_size=len(TOKENS),
        num_hidden_layers=6,
        layer_types=GEMMA3_LAYERS,
        query_pre_attn_scalar=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
}


def write_gemma_gguf(path, model_dir, arch: str, *, softcaps: bool = True):
    """The checkpoint in ``model_dir`` as llama.cpp's convert_hf_to_gguf.py writes it."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2" and softcaps:
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        writer.add_rope_freq_base(1e6)
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("llama")  # SentencePiece, as Gemma's files hold it
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [6] * 256 + [1] * len(PIECES))
    writer.add_token_scores([0.0] * len(TOKENS))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output.weight
            continue
        values = tensor.detach().float()
        if name.endswith("norm.weight"):
            values = values + 1.0  # Gemma2Model / Gemma3Model.modify_tensors
        writer.add_tensor(gguf_name(name, _GEMMA_LAYER_NAMES), values.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    d = save_hf_new_arch(tmp, arch, **OVERRIDES[arch])
    return arch, d, write_gemma_gguf(tmp / f"{arch}.gguf", d, arch)


def test_greedy_tokens_equal_transformers_on_the_original_checkpoint(gemma):
    arch, hf_dir, path = gemma
    model, config = load_model(path, dtype="float32")
    assert (
        config.architecture == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    )
    windows = config.layer_sliding_windows
    assert windows == [8 if t == "sliding_attention" else None for t in config.layer_types]
    if arch == "gemma3":
        assert config.layer_types == GEMMA3_LAYERS
    ours = Driver(model, 8).generate(PROMPTS, MAX_NEW)
    assert ours == hf_greedy(hf_dir, PROMPTS, MAX_NEW)
    assert len(set(map(tuple, ours))) > 1


def test_norms_are_taken_back_from_one_plus_w(gemma):
    import transformers

    _, hf_dir, path = gemma
    model, _ = load_model(path, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ours = dict(model.named_parameters())
    for name, tensor in ref.state_dict().items():
        if name.endswith("norm.weight"):
            assert torch.allclose(ours[name], tensor, rtol=0, atol=1e-6), name  # (1 + w) - 1


def test_llama_cpp_attention_scale_and_softcaps(tmp_path):
    """The scale llama.cpp hard-codes: head_dim ** -0.5, except the 27B shapes (46 / 62
    layers): (hidden / heads) ** -0.5; soft-caps absent from the metadata are off."""
    d = save_hf_new_arch(tmp_path, "gemma2", **OVERRIDES["gemma2"])
    path = write_gemma_gguf(tmp_path / "nocap.gguf", d, "gemma2", softcaps=False)
    cfg = gguf_config_dict(GGUFFile(path))
    assert cfg["query_pre_attn_scalar"] == 32  # head_dim (hidden 64 / 4 heads would be 16)
    assert cfg["attn_logit_softcapping"] is None and cfg["final_logit_softcapping"] is None
    assert cfg["sliding_window"] == 8

    class Fake:
        path = tmp_path / "x.gguf"
        architecture = "gemma3"
        meta = {
            "gemma3.block_count": 62,
            "gemma3.embedding_length": 5376,
            "gemma3.feed_forward_length": 21504,
            "gemma3.attention.head_count": 32,
            "gemma3.attention.head_count_kv": 16,
            "gemma3.attention.key_length": 128,
            "gemma3.attention.sliding_window": 1024,
            "gemma3.context_length": 131072,
            "gemma3.vocab_size": 262208,
        }

        def get(self, key, default=None):
            return self.meta.get(key, default)

        def require(self, key):
            return self.meta[key]

        def has_tensor(self, name):
            return False

        def shape(self, name):
            raise KeyError(name)

    cfg = gguf_config_dict(Fake())
    assert cfg["query_pre_attn_scalar"] == 168  # 5376 / 32: Gemma-3-27B's
    assert cfg["sliding_window_pattern"] == 6 and cfg["tie_word_embeddings"]


def test_text_prompts_through_the_files_tokenizer(gemma):
    """The engine serves the file alone: its SentencePiece tokenizer (BOS added) and weights
    give transformers' tokens for a text prompt."""
    from pydaemon import LLM, SamplingParams

    _, hf_dir, path = gemma
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    out = llm.generate(["hello world", "he  llo\nworld"], params)
    tok = load_gguf_tokenizer(GGUFFile(path))
    ids = [[2, *tok.encode(text, add_bos=False)] for text in ("hello world", "he  llo\nworld")]
    assert 6 + 256 + PIECES.index("  ") in ids[1]  # two spaces: one piece
    assert [list(o.prompt_token_ids) for o in out] == ids
    assert [list(o.outputs[0].token_ids) for o in out] == hf_greedy(hf_dir, ids, MAX_NEW)
