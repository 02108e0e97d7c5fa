"""EAGLE-1 heads for tests: a checkpoint writer (the format vLLM's ``method: "eagle"`` reads)
and an independent plain-torch (float64) reference of the published EAGLE-1 math."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from engine_utils import make_hf_model
from safetensors.torch import save_file

LAYER = "layers.0."
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def head_tensors(
    hidden: int,
    vocab: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    fc_bias: bool = True,
    embed: bool = False,
    lm_head: bool = False,
) -> dict[str, torch.Tensor]:
    """Random EAGLE-1 head tensors (one layer, intermediate 2 * hidden)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    head_dim = hidden // num_heads
    out = {"fc.weight": rand(hidden, 2 * hidden)}
    if fc_bias:
        out["fc.bias"] = rand(hidden)
    sizes = {
        "q_proj": num_heads * head_dim,
        "k_proj": num_kv_heads * head_dim,
        "v_proj": num_kv_heads * head_dim,
    }
    for name, rows in sizes.items():
        out[f"{LAYER}self_attn.{name}.weight"] = rand(rows, hidden)
    out[f"{LAYER}self_attn.o_proj.weight"] = rand(hidden, num_heads * head_dim)
    out[f"{LAYER}mlp.gate_proj.weight"] = rand(2 * hidden, hidden)
    out[f"{LAYER}mlp.up_proj.weight"] = rand(2 * hidden, hidden)
    out[f"{LAYER}mlp.down_proj.weight"] = rand(hidden, 2 * hidden)
    out[f"{LAYER}post_attention_layernorm.weight"] = 1.0 + rand(hidden)
    if embed:
        out["embed_tokens.weight"] = rand(vocab, hidden)
    if lm_head:
        out["lm_head.weight"] = rand(vocab, hidden)
    return out


def save_head(
    path: Path,
    tensors: dict[str, torch.Tensor],
    hidden: int,
    vocab: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    **config,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **config,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [T, heads, d], rotate-half convention (Hugging Face Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None]  # [T, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_head(
    w: dict[str, torch.Tensor],
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    theta: float = 10000.0,
) -> torch.Tensor:
    """EAGLE-1 over one sequence from position 0, all rows at once (causal attention):
    embeds [T, H] (embed(t_{p+1})), hidden [T, H] (h_p) -> g [T, H], float64."""
    w = {k: v.double() for k, v in w.items()}
    t, h = hidden.shape
    d = h // num_heads
    x = torch.cat([embeds.double(), hidden.double()], -1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    residual = x  # layer 0: no input_layernorm
    a = f"{LAYER}self_attn."
    positions = torch.arange(t)
    q = _rope((x @ w[a + "q_proj.weight"].T).view(t, num_heads, d), positions, theta)
    k = _rope((x @ w[a + "k_proj.weight"].T).view(t, num_kv_heads, d), positions, theta)
    v = (x @ w[a + "v_proj.weight"].T).view(t, num_kv_heads, d)
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, h)
    x = residual + attn @ w[a + "o_proj.weight"].T
    m = _rms(x, w[f"{LAYER}post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(m @ w[f"{LAYER}mlp.gate_proj.weight"].T)
    mlp = (mlp * (m @ w[f"{LAYER}mlp.up_proj.weight"].T)) @ w[f"{LAYER}mlp.down_proj.weight"].T
    return x + mlp  # no final norm: the LM head reads it as is


def reference_drafts(
    w: dict[str, torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    tokens: list[int],
    target_hidden: torch.Tensor,
    k: int,
    min_gap: float = 1e-3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> list[int]:
    """EAGLE-1's greedy chain after ``tokens`` (N of them; target_hidden: [N, H], the target's
    LM-head inputs), recomputed from scratch for each draft: rows (h_p, t_{p+1}) for p < N - 1,
    then (g, draft) rows. Stops early where the top-2 logits are within ``min_gap`` (a tie
    float32 may break either way)."""
    embed, lm_head = embed.double(), lm_head.double()
    ids = torch.tensor(tokens)
    hiddens = target_hidden[: len(tokens) - 1].double()
    next_ids = ids[1:]
    drafts: list[int] = []
    for _ in range(k):
        g = reference_head(w, embed[next_ids], hiddens, num_heads, num_kv_heads)
        logits = g[-1] @ lm_head.T
        top = logits.topk(2).values
        if float(top[0] - top[1]) < min_gap:
            break
        d = int(logits.argmax())
        drafts.append(d)
        hiddens = torch.cat([hiddens, g[-1:]])
        next_ids = torch.cat([next_ids, torch.tensor([d])])
    return drafts


def make_exact_eagle(
    tmp: Path,
    noises: tuple[float, ...],
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
):
    """A target whose next token depends only on the current one (o_proj and down_proj
    zero: hidden = rmsnorm(embed(t)), next = argmax lm_head(that) = f(t)) and heads that
    reproduce f: fc = [I | noise * N] with no attention or MLP output, so at noise 0
    g = embed(t_{p+1}) and argmax lm_head(g) = f(t_{p+1}) (RMSNorm with unit weights only
    rescales); a little noise reads the hidden state and gets some drafts rejected.
    -> (target dir, its transformers model, {noise: (head dir, head tensors)})."""
    shape = dict(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    path, hf = make_hf_model(tmp / "target", vocab_size=vocab_size, seed=21, **shape)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    hf.save_pretrained(path, safe_serialization=True)
    heads = {}
    h, heads_kv = hidden_size, dict(num_heads=num_heads, num_kv_heads=num_kv_heads)
    for noise in noises:
        w = head_tensors(h, vocab_size, seed=22, fc_bias=False, **heads_kv)
        mix = torch.randn(h, h, generator=torch.Generator().manual_seed(23)) * noise
        w["fc.weight"] = torch.cat([torch.eye(h), mix], dim=1)
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
        heads[noise] = (save_head(tmp / f"head_{noise}", w, h, vocab_size, **heads_kv), w)
    return path, hf, heads
