"""Random PEFT LoRA adapters for a model shape (benchmarks): adapter_config.json +
adapter_model.safetensors, every decoder projection targeted, no peft package needed.

``--distinct`` weight sets are written; the other adapters are directories of symbolic links to
them (a serving engine reads, slots and computes each adapter on its own all the same: only
the disk is spared, 84 MB per rank-16 adapter of the Llama-3-8B shape).

    python bench/lora_adapters.py /tmp/llama3-8b /tmp/loras --num 128 --rank 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT target module -> (in_features, out_features) in ``config``'s decoder layer."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * d
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * d
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def write_adapter(config: dict, out: Path, rank: int, seed: int, alpha: float = 32.0) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=g) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(_peft_config(rank, alpha), indent=2))
    return out


def _peft_config(rank: int, alpha: float) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "use_rslora": False,
        "base_model_name_or_path": None,
    }


def write_adapters(
    model_dir: str | Path, out_dir: str | Path, num: int, rank: int, distinct: int = 8
) -> list[Path]:
    """``num`` adapters under ``out_dir`` (adapter-0, ...), ``distinct`` of them real files."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    out_dir = Path(out_dir)
    paths = []
    for n in range(num):
        path = out_dir / f"adapter-{n}"
        source = out_dir / f"adapter-{n % distinct}"
        if n < distinct:
            if not (path / "adapter_model.safetensors").is_file():
                write_adapter(config, path, rank, seed=n)
        elif not path.exists():
            path.mkdir(parents=True)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                (path / name).symlink_to((source / name).resolve())
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora_adapters", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", help="a directory with the model's config.json")
    p.add_argument("out_dir")
    p.add_argument("--num", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--distinct", type=int, default=8, help="weight sets actually written")
    args = p.parse_args(argv)
    for path in write_adapters(args.model_dir, args.out_dir, args.num, args.rank, args.distinct):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
