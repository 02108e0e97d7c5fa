"""EagleHead: an EAGLE-1 draft head (Li et al., 2024), as vLLM's ``method: "eagle"`` loads it.

A Llama decoder of a few layers (one, in the published heads) whose input is not a token but
a token and a feature: at position p it reads the target's hidden state h_p (the input of its
LM head, i.e. after the final norm) and the embedding of the token at p + 1, and regresses
the feature of position p + 1:

    x_p = fc(cat(embed(t_{p+1}), h_p))              fc: [hidden, 2 * hidden] (+ bias)
    g_p = decoder layers(x_p)                        layer 0 without input_layernorm
    logits of t_{p+2} = lm_head(g_p)                 the target's LM head; no final norm

Drafting chains: g_p stands in for h_{p+1} at the next position. Each layer is pagedd's Llama
layer (paged attention over the head's own KV cache, RoPE with the head's config); the
checkpoint names are the Hugging Face ones without the ``model.`` prefix (``fc.weight``,
``layers.0.self_attn.q_proj.weight``, ...). The embedding and the LM head are not part of
this module: the proposer passes the embeddings in and computes logits with the head's own
tensors if its checkpoint has them, else the target's (pydaemon/model_loader/eagle_head.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pydaemon.config.model import ModelConfig
from pydaemon.layers.attention_metadata import AttentionMetadata
from pydaemon.layers.rotary_embedding import RotaryEmbedding
from pydaemon.models.llama import LlamaDecoderLayer


class NoInputNorm(nn.Module):
    """Stands for the input_layernorm EAGLE's first layer leaves out (the identity; with a
    residual, only the add)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8_out: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return x
        x = x + residual
        return x, x


class EagleHead(nn.Module):
    def __init__(self, config: ModelConfig, fc_bias: bool) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.layers[0].input_layernorm = NoInputNorm()
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden_size]: embed(t_{p+1}) at each row
        hidden_states: torch.Tensor,  # [T, hidden_size]: h_p (the target's, or a draft's g)
        positions: torch.Tensor,  # [T] int64: p
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]: g_p, the LM head's input
        x = self.fc(torch.cat([inputs_embeds, hidden_states.to(inputs_embeds.dtype)], dim=-1))
        cos, sin = self.rotary_emb(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(
                x, residual, cos, sin, kv_cache[:, i, 0], kv_cache[:, i, 1], attn_metadata
            )
        return x + residual
