"""A GGUF file's tensors under pagedd's (Hugging Face) parameter names.

llama.cpp's converter permutes the rows of the query and key projections of ``llama``
models (weights and biases) so that rotary pairs are interleaved, GPT-J style; this undoes it
exactly as transformers' GGUF loader does (``LlamaTensorProcessor._reverse_permute_weights``)
so the rotate-half RoPE of the model sees the original layout. ``qwen2`` and ``qwen3`` are
stored unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from pydaemon.config.model import ModelConfig
from pydaemon.gguf.reader import GGUFFile

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_PERMUTED_ARCHITECTURES = ("llama",)


def hf_name(gguf_name: str) -> str | None:
    """-> the parameter name of a GGUF tensor, None for one pagedd does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """weight: [num_heads * head_dim, ...] with each head's rows in llama.cpp's order ->
    the same in Hugging Face's order (rows 2i and 2i+1 of a head go to i and i + head_dim/2)."""
    rows = weight.shape[0]
    # Stored as [heads, half, 2, ...] (pairs interleaved); Hugging Face's is [heads, 2, half, ...].
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(
    f: GGUFFile, config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (parameter name, tensor in ``dtype``) for every tensor the model uses, one at a
    time, so at most one dequantized tensor is alive beside the model."""
    f.check_tensor_types()
    permuted = f.architecture in _PERMUTED_ARCHITECTURES
    for name in f.tensors:
        param_name = hf_name(name)
        if param_name is None:
            continue
        # Dequantize in float32 and cast once at the end: the permutation is exact either way.
        tensor = f.load(name, torch.float32)
        if permuted and ".attn_q." in name:
            tensor = unpermute_rotary(tensor, config.num_attention_heads)
        elif permuted and ".attn_k." in name:
            tensor = unpermute_rotary(tensor, config.num_key_value_heads)
        yield param_name, tensor.to(dtype)
