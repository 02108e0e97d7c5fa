"""Gemma 2 and Gemma 3 text decoders (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` and the text
part of ``Gemma3ForConditionalGeneration``), config-driven (pydaemon/config/gemma.py):

    x = embed(ids) * sqrt(hidden_size)                  (the factor rounded to the dtype)
    per layer:  h = x + post_attention_norm(attn(input_norm(x)))
                x = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))
    logits = final_norm(x) @ embed.T                    (tied), soft-capped on Gemma 2

- RMSNorms scale by ``(1 + weight)`` in float32 and round once (GemmaRMSNorm); Gemma 3 also
  normalises q and k per head with them (QK-norm).
- attention (models/llama.py's LlamaAttention): scale ``query_pre_attn_scalar ** -0.5``,
  local layers windowed (``sliding_window``, per ``layer_types``), Gemma 2's scores
  soft-capped (``cap * tanh(s / cap)``, 50); Gemma 3's local layers rotate with their own
  RoPE theta (10,000), its global layers with ``rope_theta`` and ``rope_scaling``.
- MLP: GeGLU, ``gelu_tanh(gate) * up`` (LlamaMLP with ``hidden_act`` gelu_pytorch_tanh).
- Gemma 2's logits are soft-capped (30) in float32 (LlamaForCausalLM.compute_logits).

Each residual add is fused with the norm after it, as in Llama: the pre-feed-forward norm adds
the attention branch, the next layer's input norm (or the final norm) the MLP branch.
Tensor parallel as Llama. A multimodal Gemma 3 checkpoint's tensors (``language_model.model.*``
or ``model.language_model.*``) load through ``checkpoint_prefixes``; its vision tower is not
loaded (text-only prompts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pydaemon.config.gemma import GEMMA3_MULTIMODAL
from pydaemon.config.model import ModelConfig
from pydaemon.layers.attention_metadata import AttentionMetadata
from pydaemon.layers.parallel_linear import takes_fp8_input, vocab_embedding
from pydaemon.layers.rms_norm import GemmaRMSNorm
from pydaemon.layers.rotary_embedding import RotaryEmbedding
from pydaemon.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, MlpFactory

if TYPE_CHECKING:
    from pydaemon.quantization.config import Fp8Config

# A multimodal Gemma 3 checkpoint's names -> this model's (transformers 4.5x and 5.x layouts).
MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, quant_config: Fp8Config | None = None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, quant_config, norm_cls=GemmaRMSNorm)
        self.mlp = LlamaMLP(config, quant_config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden_size]: the previous layer's MLP branch
        residual: torch.Tensor | None,  # [T, hidden_size]; None in the first layer
        cos: torch.Tensor,  # [T, rotary_dim] float32: this layer's RoPE
        sin: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (MLP branch, residual): this layer's output is their sum."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(
            hidden_states, cos, sin, key_cache, value_cache, attn_metadata
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(
            hidden_states, residual, fp8_out=takes_fp8_input(self.mlp.gate_up_proj)
        )
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class GemmaModel(nn.Module):
    # One pipeline stage only (GemmaForCausalLM.supports_pp is False).
    is_first_stage = is_last_stage = True

    def __init__(self, config: ModelConfig, quant_config: Fp8Config | None = None) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        self.normalizer = config.hidden_size**0.5
        self._rounded_normalizers: dict[torch.dtype, float] = {}
        self.layers = nn.ModuleList(
            [GemmaDecoderLayer(config, i, quant_config) for i in range(config.num_hidden_layers)]
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)
        # Gemma 3: the local layers' own RoPE (None: every layer takes rotary_emb).
        local = config.local_rope
        self.rotary_emb_local = (
            None
            if local is None
            else RotaryEmbedding(config.rotary_dim, local.theta, local.scaling)
        )
        self.layer_is_local = [
            local is not None and config.layer_rope(i) is local
            for i in range(config.num_hidden_layers)
        ]

    def _normalizer(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded to the activation dtype first, as transformers does
        (55.5 in bf16 for 3,072), as a Python number: no tensor per step."""
        if dtype not in self._rounded_normalizers:
            self._rounded_normalizers[dtype] = float(torch.tensor(self.normalizer, dtype=dtype))
        return self._rounded_normalizers[dtype]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
        intermediate_tensors: torch.Tensor | None = None,  # pipeline stages: unsupported
    ) -> torch.Tensor:  # [T, hidden_size]
        hidden_states = self.embed_tokens(input_ids)
        hidden_states = hidden_states * self._normalizer(hidden_states.dtype)
        ropes = [self.rotary_emb(positions)]
        if self.rotary_emb_local is not None:
            ropes.append(self.rotary_emb_local(positions))
        residual = None
        for layer_idx, layer in enumerate(self.layers):
            cos, sin = ropes[1 if self.layer_is_local[layer_idx] else 0]
            hidden_states, residual = layer(
                hidden_states,
                residual,
                cos,
                sin,
                kv_cache[:, layer_idx, 0],
                kv_cache[:, layer_idx, 1],
                attn_metadata,
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3: LlamaForCausalLM's head (tied, soft-capped logits when the config
    says) on the Gemma decoder."""

    supports_pp = False  # its decoder is not split into stages yet

    def __init__(self, config: ModelConfig, quant_config: Fp8Config | None = None) -> None:
        super().__init__(config, quant_config)
        if config.architecture == GEMMA3_MULTIMODAL:
            self.checkpoint_prefixes = MULTIMODAL_PREFIXES

    @staticmethod
    def build_model(
        config: ModelConfig, quant_config: Fp8Config | None, make_mlp: MlpFactory | None
    ) -> nn.Module:
        return GemmaModel(config, quant_config)
