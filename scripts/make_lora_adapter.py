"""Writes a LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) for a
model pagedd serves, with random weights: an adapter to try pagedd's LoRA paths with
(``--lora-modules``, ``/v1/load_lora_adapter``, ``pagedd generate --adapter``) without
training one. It changes the model's output (that is how you see it is applied); it teaches
the model nothing. The shapes come from the model itself (the default model's GGUF metadata,
or a directory's config.json), so no download is needed.

    .venv/bin/python scripts/make_lora_adapter.py /tmp/smol-lora          # the default model
    .venv/bin/python scripts/make_lora_adapter.py OUT --model /path/to/model-dir --rank 16 \\
        --targets q_proj,v_proj --seed 1

A trained adapter of the default model is PEFT's usual recipe on its Hugging Face checkpoint
(``HuggingFaceTB/SmolLM2-135M-Instruct``: ``peft.get_peft_model(model, LoraConfig(r=8,
target_modules=[...]))``, train, ``save_pretrained(OUT)``); pagedd serves the directory that
writes (docs/serving.md, "LoRA adapters").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pydaemon.config.engine import DEFAULT_MODEL
from pydaemon.config.lora import CONFIG_FILE, SUPPORTED_TARGET_MODULES, WEIGHTS_FILE
from pydaemon.model_loader.model_paths import load_model_config, resolve_model_dir

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_shapes(model: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """-> (layers, module -> (in_features, out_features)) of the model ``--model`` names."""
    config = load_model_config(resolve_model_dir(model))
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    i = config.intermediate_size
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    return config.num_hidden_layers, shapes


def make_adapter(
    out: Path,
    model: str = DEFAULT_MODEL,
    rank: int = 8,
    targets: tuple[str, ...] = SUPPORTED_TARGET_MODULES,
    seed: int = 0,
    std: float = 0.04,
) -> Path:
    """Writes the adapter into ``out`` (created) and returns it. lora_A and lora_B are
    N(0, std²), lora_alpha = 2 * rank (PEFT's would start B at zero: no effect)."""
    unknown = sorted(set(targets) - set(SUPPORTED_TARGET_MODULES))
    if unknown:
        raise ValueError(
            f"--targets: {', '.join(unknown)} not among {', '.join(SUPPORTED_TARGET_MODULES)}"
        )
    num_layers, shapes = module_shapes(model)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in targets:
            in_features, out_features = shapes[module]
            block = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="make_lora_adapter", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    p.add_argument("out", help="directory to write (created)")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"as pagedd serve's (default {DEFAULT_MODEL})"
    )
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8; the daemon's "
                   "--max-lora-rank, 16 by default, must be at least this)")  # fmt: skip
    p.add_argument("--targets", default=",".join(SUPPORTED_TARGET_MODULES),
                   help="comma-separated modules (default: all seven projections)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--std", type=float, default=0.04,
                   help="std of the random weights (default 0.04: on SmolLM2, a visible change "
                        "that still reads as text)")  # fmt: skip
    args = p.parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    try:
        out = make_adapter(Path(args.out), args.model, args.rank, targets, args.seed, args.std)
    except ValueError as e:
        print(f"make_lora_adapter: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / CONFIG_FILE} and {out / WEIGHTS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
