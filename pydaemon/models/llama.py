"""Llama-family decoder: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias, sliding
window), Qwen3 dense (RMSNorm of q and k per head, before RoPE). Its attention also serves
Gemma (models/gemma.py: its own norms, scale and soft-cap, from the config) and gpt-oss
(models/moe.py: attention sinks, a learned logit per query head, ``self_attn.sinks``).

Fused as in vLLM: q/k/v are one GEMM (``qkv_proj``), gate/up one GEMM (``gate_up_proj``)
followed by SiLU-and-multiply, and each residual add is fused with the RMSNorm after it (the
decoder layer hands ``(hidden_states, residual)`` to the next). Other parameter names equal
the Hugging Face checkpoint names; pydaemon/model_loader/weight_targets.py maps the checkpoint's separate
q/k/v and gate/up tensors into the packed ones.

Tensor parallel (Megatron): qkv_proj and gate_up_proj are column-parallel (each rank its
heads / its MLP columns, of each part), o_proj and down_proj row-parallel with an all-reduce,
embedding and LM head vocabulary-parallel. At TP=1 o_proj, down_proj, the embedding and LM
head are plain nn.Linear / nn.Embedding.

Pipeline parallel (vLLM's scheme): a stage builds only its layers (``pp_layer_range``; the
others are ``PPMissingLayer`` placeholders, so that parameter names keep their layer
index), the first stage the embedding, the last one the final norm and the LM head (and
the embedding too when the LM head is tied to it). A stage other than the last returns its
intermediate tensors (the last layer's output and residual), which the next stage takes
instead of the embedding.

Quantization: a ``quant_config`` (pydaemon/quantization/config.py) makes qkv_proj, o_proj,
gate_up_proj and down_proj quantized layers; the embedding and the LM head stay unquantized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pydaemon.config.model import ModelConfig
from pydaemon.distributed import parallel_state as ps
from pydaemon.layers.activation import gated_activation
from pydaemon.layers.attention import PagedAttention
from pydaemon.layers.attention_metadata import AttentionMetadata
from pydaemon.layers.parallel_linear import (
    MergedColumnParallelLinear,
    lm_head,
    parallel_logits,
    row_linear,
    takes_fp8_input,
    vocab_embedding,
)
from pydaemon.layers.rms_norm import RMSNorm
from pydaemon.layers.rotary_embedding import RotaryEmbedding
from pydaemon.models.pipeline import PPMissingLayer, pp_layer_range

if TYPE_CHECKING:
    from pydaemon.quantization.config import Fp8Config
    from pydaemon.quantization.fp8 import Fp8Activation


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        quant_config: Fp8Config | None = None,
        norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        """``norm_cls``: the q/k norm's class (Gemma's differs)."""
        super().__init__()
        check_tensor_parallel(config, ps.get_tp_world_size())
        tp = ps.get_tp_world_size()
        self.num_heads = config.num_attention_heads // tp  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // tp
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        num_q, num_kv = config.num_attention_heads * d, config.num_key_value_heads * d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d  # this rank's
        parts = {"q_proj": num_q, "k_proj": num_kv, "v_proj": num_kv}
        self.qkv_proj = MergedColumnParallelLinear(h, parts, bias, "qkv_proj", quant_config)
        self.o_proj = row_linear(num_q, h, config.o_proj_bias, "o_proj in_features", quant_config)
        # Qwen3: q and k normalised per head over head_dim (weights shared by all heads).
        self.q_norm = norm_cls(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm_cls(d, config.rms_norm_eps) if config.qk_norm else None
        # gpt-oss: this rank's heads' sink logits (sharded by heads, as q).
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            self.tp_shards = {"sinks": (0, config.num_attention_heads)}
        window = config.layer_sliding_windows[layer_idx] if config.layer_sliding_windows else None
        scale = config.attention_scale if config.attention_scale is not None else d**-0.5
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            d,
            scale=scale,
            sliding_window=window,
            softcap=config.attn_logit_softcapping,
        )

    def forward(
        self,
        hidden_states: torch.Tensor | Fp8Activation,  # [T, hidden_size]
        cos: torch.Tensor,  # [T, rotary_dim] float32
        sin: torch.Tensor,  # [T, rotary_dim] float32
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        qkv = self.qkv_proj(hidden_states)  # [T, q_size + 2 * kv_size]
        t = qkv.shape[0]
        # Views of qkv (row stride q_size + 2 * kv_size), no copies.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per head, after the split
            q = self.q_norm(q)
            k = self.k_norm(k)
        # The attention layer rotates q/k: on CUDA fused with its cache write (one launch).
        out = self.attn(
            q, k, v, key_cache, value_cache, attn_metadata, rotary=(cos, sin), sinks=self.sinks
        )
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: Fp8Config | None = None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        parts = {"gate_proj": i, "up_proj": i}
        self.gate_up_proj = MergedColumnParallelLinear(
            h, parts, bias, "intermediate_size", quant_config
        )
        self.down_proj = row_linear(i, h, bias, "intermediate_size", quant_config)
        self.act_fn = gated_activation(config.hidden_act)  # SwiGLU; Gemma: GeGLU (tanh)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:  # x: [T, hidden_size]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate_size / tp]
        return self.down_proj(self.act_fn(gate_up, fp8_out=takes_fp8_input(self.down_proj)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        quant_config: Fp8Config | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: the feed-forward block (a MoE block: pydaemon/models/moe.py), None for
        the dense SwiGLU MLP."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, quant_config)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden_size]: the previous layer's MLP output
        residual: torch.Tensor | None,  # [T, hidden_size]; None in the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (MLP output, residual): this layer's output is their sum, which the next
        layer's input_layernorm (or the final norm) adds while it normalises."""
        # FP8 linear layers take their input quantized by the norm's own kernel.
        qkv_fp8 = takes_fp8_input(self.self_attn.qkv_proj)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states, fp8_out=qkv_fp8)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual, fp8_out=qkv_fp8)
        hidden_states = self.self_attn(
            hidden_states, cos, sin, key_cache, value_cache, attn_metadata
        )
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states,
            residual,
            fp8_out=takes_fp8_input(getattr(self.mlp, "gate_up_proj", None)),
        )
        return self.mlp(hidden_states), residual


# layer index -> that layer's feed-forward block, or None for the dense MLP.
MlpFactory = Callable[[int], nn.Module | None]


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        quant_config: Fp8Config | None = None,
        make_mlp: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = pp_layer_range(
            config.num_hidden_layers, ps.get_pp_rank(), ps.get_pp_world_size()
        )
        self.is_first_stage, self.is_last_stage = ps.is_first_pp_rank(), ps.is_last_pp_rank()
        # The last stage keeps a tied embedding as its LM head's weight.
        has_embedding = self.is_first_stage or (self.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = (
            vocab_embedding(config.vocab_size, config.hidden_size) if has_embedding else None
        )
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(config, i, quant_config, make_mlp(i) if make_mlp else None)
                if self.start_layer <= i < self.end_layer
                else PPMissingLayer()
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_stage_layers, 2, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
        intermediate_tensors: torch.Tensor | None = None,  # [2, T, hidden_size], stages > 0
    ) -> torch.Tensor:  # [T, hidden_size]; [2, T, hidden_size] on stages but the last
        if self.is_first_stage:
            hidden_states = self.embed_tokens(input_ids)
            residual = None
        else:  # the previous stage's last (output, residual)
            hidden_states, residual = intermediate_tensors[0], intermediate_tensors[1]
        cos, sin = self.rotary_emb(positions)
        start = self.start_layer
        for layer_idx in range(start, self.end_layer):
            hidden_states, residual = self.layers[layer_idx](
                hidden_states,
                residual,
                cos,
                sin,
                kv_cache[:, layer_idx - start, 0],
                kv_cache[:, layer_idx - start, 1],
                attn_metadata,
            )
        if not self.is_last_stage:
            return torch.stack([hidden_states, residual])
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        quant_config: Fp8Config | None = None,
        make_mlp: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, quant_config, make_mlp)
        # Tied: the logits reuse model.embed_tokens.weight, there is no lm_head parameter.
        # Pipeline parallel: the last stage alone computes logits.
        has_lm_head = not config.tie_word_embeddings and self.model.is_last_stage
        self.lm_head = lm_head(config.hidden_size, config.vocab_size) if has_lm_head else None
        self.tp_size = ps.get_tp_world_size()

    supports_pp = True  # pipeline stages: see the module docstring

    @staticmethod
    def build_model(
        config: ModelConfig, quant_config: Fp8Config | None, make_mlp: MlpFactory | None
    ) -> nn.Module:
        """The decoder stack (``self.model``); a subclass may build its own."""
        return LlamaModel(config, quant_config, make_mlp)

    @staticmethod
    def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
        check_tensor_parallel(config, tp)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_stage_layers, 2, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
        intermediate_tensors: torch.Tensor | None = None,  # [2, T, hidden_size], stages > 0
    ) -> torch.Tensor:  # [T, hidden_size]; [2, T, hidden_size] on stages but the last
        return self.model(input_ids, positions, kv_cache, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # hidden_states: [N, hidden_size] -> [N, vocab_size] float32 (None on TP ranks > 0)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp_size > 1:
            logits = parallel_logits(hidden_states, weight, self.config.vocab_size)
        else:
            logits = F.linear(hidden_states, weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None and logits is not None:  # Gemma 2: in float32
            logits = torch.tanh(logits / cap) * cap
        return logits


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Heads and MLP columns must split evenly over ``tp`` ranks (no head replication)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    for name in ("num_key_value_heads", "num_attention_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % tp != 0:
            raise ValueError(
                f"{name} ({value}) is not divisible by tensor_parallel_size ({tp}): "
                f"each rank must hold {name} / {tp} of them"
            )
