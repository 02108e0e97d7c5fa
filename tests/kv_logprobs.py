"""Test helper: next-token log-probs of a model driven by hand over a paged KV cache of a given
dtype (greedy or teacher-forced), to compare KV-cache formats position by position."""

from __future__ import annotations

import math

import torch
from model_utils import Seq, SimpleAllocator, build_step


def next_token_logprobs(model, kv_dtype, prompts, num_steps, forced=None, block_size=16):
    """Prefill the prompts in one step, then ``num_steps`` decode steps; the next tokens are
    greedy, or ``forced`` (teacher forcing). -> (tokens [B, num_steps + 1], log-probs
    [B, num_steps + 1, vocab] float64), on the model's device."""
    cfg = model.config
    device = next(model.parameters()).device
    max_len = max(len(p) for p in prompts) + num_steps + 1
    num_blocks = len(prompts) * math.ceil(max_len / block_size)
    shape = (num_blocks, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, block_size)
    # NaN-filled: a slot read before it is written poisons the output.
    kv_cache = torch.full((*shape, cfg.head_dim), float("nan"), device=device).to(kv_dtype)
    alloc = SimpleAllocator(num_blocks, shuffle_seed=2)
    seqs = [Seq(list(p)) for p in prompts]
    tokens, logps = [], []
    for step in range(num_steps + 1):
        q_lens = [len(s.token_ids) - s.num_computed_tokens for s in seqs]
        for s, q in zip(seqs, q_lens, strict=True):
            alloc.ensure(s, s.num_computed_tokens + q, block_size)
        ids, pos, md = build_step(seqs, q_lens, len(seqs) if step == 0 else 0, block_size, device)
        with torch.inference_mode():
            hidden = model(ids, pos, kv_cache, md)
            logits = model.compute_logits(hidden[md.query_start_loc[1:].long() - 1])
        logp = logits.double().log_softmax(-1)  # [B, vocab]
        nxt = logp.argmax(-1) if forced is None else forced[:, step]
        for s, q, t in zip(seqs, q_lens, nxt.tolist(), strict=True):
            s.num_computed_tokens += q
            s.token_ids.append(t)
        tokens.append(nxt)
        logps.append(logp)
    return torch.stack(tokens, 1), torch.stack(logps, 1)


def compare_logprobs(ref_tokens, ref_logp, logp):
    """-> (KL(ref || other) per position, greedy disagreement mask, reference top-2 gap)."""
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    disagree = logp.argmax(-1) != ref_tokens
    top2 = ref_logp.topk(2, dim=-1).values
    return kl, disagree, top2[..., 0] - top2[..., 1]
