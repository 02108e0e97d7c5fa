"""Helpers for engine tests: tiny random HF models on disk and a plain greedy reference."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def make_hf_model(
    path: Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    **extra,
):
    """Save a random transformers model with save_pretrained; returns (dir, model)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    # Spread the weights a little so that logits are not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full recompute: the unambiguous reference (EOS ignored)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def gaps_to_fp32_argmax(hf32, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Teacher-force the float32 transformers model on prompt + our tokens: for each generated
    position, how far (in logits) our token is below float32's best token. 0 = exact argmax;
    a near-tie that fp16 rounding may flip gives a tiny gap; a wrong kernel gives large ones."""
    device = next(hf32.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    logits = hf32(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return (logits.max(dim=-1).values - chosen) / logits.std(dim=-1)


def gaps_of_outputs(hf32, prompts: list[list[int]], outputs) -> torch.Tensor:
    """gaps_to_fp32_argmax over every request's prompt and generated tokens, concatenated."""
    return torch.cat(
        [
            gaps_to_fp32_argmax(hf32, p, o.outputs[0].token_ids)
            for p, o in zip(prompts, outputs, strict=True)
        ]
    )


def all_blocks_free(llm) -> bool:
    """Every GPU (device) KV block of the engine is free: nothing lost or leaked."""
    from pydaemon._core import Device

    bm = llm.engine.block_manager
    return bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)


def random_prompts(count: int, vocab_size: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(count)
    ]
