"""Test helpers: random PEFT LoRA adapters of a tiny model, and PEFT's own greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(
    model_dir: Path,
    out: Path,
    *,
    rank: int,
    targets: list[str],
    seed: int,
    lora_alpha: float = 16.0,
    use_rslora: bool = False,
    std: float = 0.1,
) -> Path:
    """A LoRA adapter of ``model_dir`` saved by PEFT (adapter_config.json +
    adapter_model.safetensors), its A and B random (PEFT starts B at zero: no effect)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=lora_alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return out


@torch.no_grad()
def peft_greedy(
    model_dir: Path, adapter_dir: Path | str | None, prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    """Greedy tokens of transformers (+ PEFT's adapter), full recompute, EOS ignored."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
        outs.append(ids[len(prompt) :])
    return outs


def reference_add_lora_loop(y, x, token_slots, lora_a, lora_b, starts) -> torch.Tensor:
    """float64: y + A[slot] x @ B[slot] part by part, per token; tokens of -1 unchanged."""
    rank = lora_b.shape[1]
    out = y.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        for j in range(len(starts) - 1):
            cols = slice(starts[j], starts[j + 1])
            xa = lora_a[s, j * rank : (j + 1) * rank].double() @ x[t].double()
            out[t, cols] += xa @ lora_b[s, :, cols].double()
    return out
