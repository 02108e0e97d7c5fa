"""gpt-oss from GGUF files (issue 44): a tiny random Hugging Face checkpoint written as
llama.cpp's converter writes it (the stacked, interleaved gate/up experts split into gate and
up [E, I, H], down transposed to [E, H, I], biases split alike, sinks, router, YaRN and the
window as metadata) gives transformers' greedy tokens on the original checkpoint; with the
experts stored as MXFP4, the tokens of that checkpoint with its experts rounded the same way;
and the o200k pre-tokenizer (``gpt-4o``) splits text as transformers' GGUF tokenizer does."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from gguf_utils import MERGES, tiny_vocab
from model_utils import Driver, hf_greedy
from new_arch_utils import save_hf_new_arch

from pydaemon.gguf import GGUFFile
from pydaemon.model_loader.loader import load_model
from pydaemon.tokenizer.gguf import load_gguf_tokenizer

MAX_NEW = 16
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (7, 16, 21, 33, 1)]
_NAMES = {  # HF module path -> GGUF part, besides the experts
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}


def _write(path, model, *, mxfp4: bool = False, tokenizer: tuple | None = None):
    """The checkpoint as llama.cpp's GptOssModel converter writes it."""
    cfg = model.config
    rope = cfg.rope_parameters
    writer = GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_swiglu_clamp_exp([cfg.swiglu_limit] * cfg.num_hidden_layers)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer is not None:
        tokens, merges = tokenizer
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-4o")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for module, part in _NAMES.items():
            for kind in ("weight", "bias"):
                if pre + f"{module}.{kind}" in sd:
                    writer.add_tensor(
                        f"blk.{i}.{part}.{kind}", sd[pre + f"{module}.{kind}"].numpy()
                    )
        writer.add_tensor(f"blk.{i}.attn_sinks.weight", sd[pre + "self_attn.sinks"].numpy())
        gate_up = sd[pre + "mlp.experts.gate_up_proj"].transpose(-1, -2)  # [E, 2I, H]
        down = sd[pre + "mlp.experts.down_proj"].transpose(-1, -2)  # [E, H, I]
        bias = sd[pre + "mlp.experts.gate_up_proj_bias"]
        for part, weight in (("gate", gate_up[:, ::2]), ("up", gate_up[:, 1::2]), ("down", down)):
            values = weight.contiguous().numpy()
            if mxfp4:
                writer.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", _mxfp4(values),
                                  raw_dtype=GGMLQuantizationType.MXFP4)  # fmt: skip
            else:
                writer.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", values)
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.bias", bias[:, ::2].contiguous().numpy())
        writer.add_tensor(f"blk.{i}.ffn_up_exps.bias", bias[:, 1::2].contiguous().numpy())
        writer.add_tensor(
            f"blk.{i}.ffn_down_exps.bias", sd[pre + "mlp.experts.down_proj_bias"].numpy()
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _mxfp4(values: np.ndarray) -> np.ndarray:
    return quantize(values.reshape(-1, values.shape[-1]), GGMLQuantizationType.MXFP4).reshape(
        *values.shape[:-1], -1
    )


def _rounded(values: torch.Tensor) -> torch.Tensor:
    """``values`` [..., K] as MXFP4 reads them back."""
    q = _mxfp4(values.contiguous().numpy())
    flat = dequantize(q.reshape(-1, q.shape[-1]), GGMLQuantizationType.MXFP4)
    return torch.from_numpy(flat.reshape(values.shape))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    import transformers

    d = save_hf_new_arch(tmp_path_factory.mktemp("oss"), "gpt_oss")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return d, model.eval()


def test_greedy_tokens_equal_transformers_on_the_original_checkpoint(tmp_path, hf_model):
    d, model = hf_model
    path = _write(tmp_path / "oss.gguf", model)
    ours, config = load_model(path, dtype="float32")
    assert config.architecture == "GptOssForCausalLM" and config.moe.num_experts == 8
    assert config.layer_sliding_windows == [8, None, 8, None]
    ids = Driver(ours, 8).generate(PROMPTS, MAX_NEW)
    assert ids == hf_greedy(d, PROMPTS, MAX_NEW)
    assert len(set(map(tuple, ids))) > 1


def test_mxfp4_experts_give_the_tokens_of_their_rounded_weights(tmp_path, hf_model):
    import transformers

    d, model = hf_model
    path = _write(tmp_path / "oss-mxfp4.gguf", model, mxfp4=True)
    assert "MXFP4" in {t.tensor_type.name for t in GGUFFile(path).reader.tensors}
    ours, _ = load_model(path, dtype="float32")
    # The reference: transformers with its experts rounded as the file holds them.
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in ref.model.layers:
            experts = layer.mlp.experts
            gate_up = experts.gate_up_proj.data.transpose(-1, -2)  # [E, 2I, H]
            experts.gate_up_proj.data = _rounded(gate_up).transpose(-1, -2).contiguous()
            down = experts.down_proj.data.transpose(-1, -2)  # [E, H, I]
            experts.down_proj.data = _rounded(down).transpose(-1, -2).contiguous()
    out = tmp_path / "rounded"
    ref.save_pretrained(out)
    assert Driver(ours, 8).generate(PROMPTS, MAX_NEW) == hf_greedy(out, PROMPTS, MAX_NEW)


def test_gpt4o_pre_tokenizer_equals_transformers(tmp_path):
    import transformers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    # An embedding row for every piece, as llama.cpp's converter writes (more pieces than
    # rows is refused: pydaemon/gguf/bounds.py).
    d = save_hf_new_arch(tmp_path, "gpt_oss", vocab_size=len(tiny_vocab()))
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    path = _write(tmp_path / "tok.gguf", model, tokenizer=(tiny_vocab(), MERGES))
    ours = load_gguf_tokenizer(GGUFFile(path))
    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    ref, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    for text in [
        "Hello World's THE they'LL 12345 x",
        "  spaces\n\n\tand/slashes//\r\nend",
        "naïve 東京",
    ]:
        assert ours.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False).ids
        assert ours.decode(ours.encode(text, add_bos=False)) == text
