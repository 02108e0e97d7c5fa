"""A GGUF file's tensors under pagedd's (Hugging Face) parameter names.

llama.cpp's converter permutes the rows of the query and key projections of ``llama``
models (weights and biases) so that rotary pairs are interleaved, GPT-J style; this undoes it
exactly as transformers' GGUF loader does (``LlamaTensorProcessor._reverse_permute_weights``)
so the rotate-half RoPE of the model sees the original layout. ``qwen2`` and ``qwen3`` are
stored unpermuted. Mixtures of experts keep each projection of all experts in one tensor
(``blk.N.ffn_gate_exps`` [E, I, H] ...): it is split into the per-expert names of a Hugging
Face checkpoint, which the loader stacks again.

Gemma 2 / 3 (``gemma2``, ``gemma3``): their norms are stored as llama.cpp's converter writes
them, ``1 + w`` (it folds Gemma's ``(1 + w)`` RMSNorm into the weight), so ``w`` is taken back;
``ffn_norm`` is their pre-feed-forward norm and ``post_attention_norm`` / ``post_ffw_norm``
the norms after attention and the feed-forward.

gpt-oss (``gpt-oss``): llama.cpp's converter splits the stacked, interleaved
``experts.gate_up_proj`` [E, H, 2I] into ``ffn_gate_exps`` and ``ffn_up_exps`` [E, I, H] (and
their biases), writes ``ffn_down_exps`` [E, H, I] (MXFP4 from an MXFP4 checkpoint); they are
put back into the checkpoint's stacked layout (stacked_experts.py reads it). The router is
``ffn_gate_inp``, the sinks ``attn_sinks``, the pre-feed-forward norm ``post_attention_norm``.
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
    # Mixtures of experts: the router, the shared expert and its gate (Qwen2-MoE).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Merged expert tensors [E, rows, cols] -> (gate, up, down) index of the per-expert name.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
_GPT_OSS_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "attn_sinks": "self_attn.sinks",
}
# gpt-oss's expert tensors: (gate, up) pairs joined into one stacked tensor, and down.
_GPT_OSS_GATE = re.compile(r"blk\.(\d+)\.ffn_gate_exps\.(weight|bias)")
_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_PERMUTED_ARCHITECTURES = ("llama",)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """-> the parameter name of a GGUF tensor of architecture ``arch``, None for one pagedd
    does not use."""
    names = (
        _GEMMA_LAYER_NAMES
        if arch in _GEMMA_ARCHITECTURES
        else _GPT_OSS_LAYER_NAMES
        if arch == "gpt-oss"
        else _LAYER_NAMES
    )
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is not None and match.group(2) in _EXPERT_TENSORS:
        return f"model.layers.{match.group(1)}.mlp.experts"
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


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
    gemma = f.architecture in _GEMMA_ARCHITECTURES
    mixtral = config.architecture == "MixtralForCausalLM"
    if f.architecture == "gpt-oss":
        yield from _gpt_oss_weights(f, dtype)
        return
    for name in f.tensors:
        param_name = hf_name(name, f.architecture)
        if param_name is None:
            continue
        # Dequantize in float32 and cast once at the end: the permutation is exact either way.
        tensor = f.load(name, torch.float32)
        if permuted and ".attn_q." in name:
            tensor = unpermute_rotary(tensor, config.num_attention_heads)
        elif permuted and ".attn_k." in name:
            tensor = unpermute_rotary(tensor, config.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # stored as 1 + w
        if mixtral:  # Mixtral's checkpoints call the MoE block block_sparse_moe
            param_name = param_name.replace(".mlp.", ".block_sparse_moe.")
        if param_name.endswith(".experts"):  # [E, rows, cols]: one tensor per expert
            part = _EXPERT_TENSORS[_LAYER_TENSOR.fullmatch(name).group(2)]
            for e in range(tensor.shape[0]):
                yield expert_name(param_name, e, part, config), tensor[e].to(dtype)
            continue
        if param_name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor[None]  # llama.cpp stores the [1, H] gate as [H]
        yield param_name, tensor.to(dtype)


def expert_name(prefix: str, expert: int, part: int, config: ModelConfig) -> str:
    """-> the checkpoint name of expert ``expert``'s gate (0), up (1) or down (2) weight."""
    assert config.moe is not None
    return f"{prefix}.{expert}.{config.moe.expert_names[part]}.weight"


def _gpt_oss_weights(f: GGUFFile, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's tensors under the checkpoint's names (module docstring)."""
    for name in f.tensors:
        match = _LAYER_TENSOR.fullmatch(name)
        part = match.group(2) if match else None
        if part in ("ffn_up_exps",):
            continue  # joined with its gate
        if part == "ffn_gate_exps":
            layer, kind = match.group(1), match.group(3)
            gate = f.load(name, torch.float32)
            up = f.load(f"blk.{layer}.ffn_up_exps.{kind}", torch.float32)
            prefix = f"model.layers.{layer}.mlp.experts.gate_up_proj"
            if kind == "weight":  # [E, I, H] each -> [E, H, 2I], gate j at 2j, up j at 2j + 1
                joined = torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2)
                yield prefix, joined.contiguous().to(dtype)
            else:  # [E, I] each -> [E, 2I]
                yield f"{prefix}_bias", torch.stack((gate, up), dim=2).flatten(1).to(dtype)
            continue
        if part == "ffn_down_exps":
            layer, kind = match.group(1), match.group(3)
            tensor = f.load(name, torch.float32)
            prefix = f"model.layers.{layer}.mlp.experts.down_proj"
            if kind == "weight":  # [E, H, I] -> [E, I, H]
                yield prefix, tensor.transpose(1, 2).contiguous().to(dtype)
            else:
                yield f"{prefix}_bias", tensor.to(dtype)
            continue
        param_name = hf_name(name, "gpt-oss")
        if param_name is None:
            continue
        if param_name.endswith(".sinks.weight"):
            param_name = param_name.removesuffix(".weight")
        yield param_name, f.load(name, torch.float32).to(dtype)
