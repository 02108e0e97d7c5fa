"""Test helpers: tiny GGUF files written with the ``gguf`` package's own writer, and the
reference model transformers' GGUF loader builds from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from pydaemon.tokenizer.gguf import bytes_to_unicode

# K-quant block layouts (ggml-common.h): bytes per block of 256, and where the f16 scales are.
_K_BLOCKS = {
    "Q4_K": (144, (0, 2)),  # d, dmin, scales[12], qs[128]
    "Q5_K": (176, (0, 2)),  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (210, (208,)),  # ql[128], qh[64], scales[16], d
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_vocab() -> list[str]:
    """Three specials, the 256 byte symbols, then the merged tokens."""
    merged = [m.replace(" ", "") for m in MERGES]
    return [*SPECIAL_TOKENS, *bytes_to_unicode().values(), *merged]


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` (the inverse of the loader's)."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str, layer_names: dict[str, str] | None = None) -> str:
    """The GGUF name of a checkpoint tensor (``layer_names``: GGUF part -> module path; the
    loader's llama names by default)."""
    from pydaemon.gguf.weights import _GLOBAL_NAMES, _LAYER_NAMES

    for name_in_file, name in _GLOBAL_NAMES.items():
        if hf_name == name:
            return name_in_file
    parts = hf_name.split(".")  # model.layers.N.<module path>.<weight|bias>
    module = ".".join(parts[3:-1])
    part = next(g for g, h in (layer_names or _LAYER_NAMES).items() if h == module)
    return f"blk.{parts[2]}.{part}.{parts[-1]}"


def _encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """-> (array to write, raw_dtype) for a 2D float32 weight stored as ``kind``."""
    if kind == "F32":
        return values, None
    if kind == "F16":
        return values.astype(np.float16), None
    if kind in _K_BLOCKS:  # no quantizer in gguf-py: random blocks with sane f16 scales
        block_bytes, scale_offsets = _K_BLOCKS[kind]
        rows, cols = values.shape
        blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
        for offset in scale_offsets:
            scales = rng.uniform(-0.02, 0.02, size=(rows, cols // 256)).astype(np.float16)
            blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
        return blocks.reshape(rows, -1), GGMLQuantizationType[kind]
    qtype = GGMLQuantizationType[kind]
    return quantize(values, qtype), qtype


def write_gguf(
    path: Path,
    state_dict: dict[str, torch.Tensor],
    hf_config: dict,
    arch: str = "llama",
    weight_type: str = "F32",
    seed: int = 0,
) -> Path:
    """Writes an HF-named float32 state dict as a GGUF file, as llama.cpp's converter would:
    Q/K rows permuted for llama, 2D weights in ``weight_type``, 1D tensors in F32."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(hf_config["num_hidden_layers"])
    writer.add_context_length(hf_config["max_position_embeddings"])
    writer.add_embedding_length(hf_config["hidden_size"])
    writer.add_feed_forward_length(hf_config["intermediate_size"])
    writer.add_head_count(hf_config["num_attention_heads"])
    writer.add_head_count_kv(hf_config["num_key_value_heads"])
    head_dim = (
        hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    )
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(hf_config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(hf_config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(hf_config["vocab_size"])
    tokens = tiny_vocab()
    tokens += [f"<|unused{i}|>" for i in range(hf_config["vocab_size"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    for name, tensor in state_dict.items():
        values = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = permute_rotary(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute_rotary(values, kv_heads)
        data, raw_dtype = (values, None) if values.ndim == 1 else _encode(values, weight_type, rng)
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf_model(path: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """-> (transformers' float32 model, its state dict) loaded through its GGUF loader
    (``load_gguf_checkpoint``: what ``from_pretrained(gguf_file=...)`` runs, without the
    ``accelerate`` dependency from_pretrained insists on)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = dict(load_gguf_checkpoint(str(path))["config"])
    cfg.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)
    tensors = parsed["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.generation_config.pad_token_id = 0
    return model.eval(), tensors
