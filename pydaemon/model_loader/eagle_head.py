"""Loads an EAGLE-1 head (pydaemon/models/eagle.py) beside its target model, checking it fits.

The format vLLM's ``method: "eagle"`` reads (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): a Llama
``config.json`` (its ``architectures`` is not read: the head is Llama-shaped by definition)
and weights in ``model.safetensors`` (or its index) or ``pytorch_model.bin`` (or its index):

    fc.weight [hidden, 2 * hidden], fc.bias [hidden] (optional)
    layers.{i}.* (Llama layer names; layer 0 has no input_layernorm)
    embed_tokens.weight, lm_head.weight (optional: the target's when absent, or when equal)

A ``model.`` prefix on the names is accepted. Tensors the head does not use (a final
``norm.weight``: EAGLE-1 feeds its output to the LM head without one, as vLLM does) are
logged and left out. Every mismatch with the target (hidden size, vocabulary) or with the
format (no ``fc.weight``, an EAGLE-3 ``fc`` over 3 * hidden) is a ValueError at start-up
naming the tensor or key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pydaemon.config.model import ModelConfig, resolve_dtype
from pydaemon.model_loader.loader import fill_dummy, materialize
from pydaemon.model_loader.weight_targets import WeightLoader
from pydaemon.models.eagle import EagleHead

logger = logging.getLogger(__name__)

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
TORCH_BIN = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class LoadedEagleHead:
    head: EagleHead
    config: ModelConfig
    embed_tokens: nn.Module  # token ids [T] -> [T, hidden]: the head's own, else the target's
    lm_head_weight: torch.Tensor | None  # [vocab, hidden]: the head's own; None: the target's


def load_eagle_head(
    head_dir: Path,
    target: nn.Module,
    target_config: ModelConfig,
    dtype: str | torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> LoadedEagleHead:
    """``target``: the loaded target model (a pagedd Llama-family model, TP=1)."""
    where = f"speculative_config.model {str(head_dir)!r}"
    config = _head_config(head_dir, target_config, where)
    torch_dtype = resolve_dtype(target_config, dtype)
    tensors = {} if load_format == "dummy" else dict(_checkpoint_tensors(head_dir, where))
    h, vocab = config.hidden_size, target_config.vocab_size
    if load_format != "dummy":
        _check_shape(tensors, "fc.weight", None, where)
        fc_in = tensors["fc.weight"][1][1]
        if fc_in == 3 * h:
            raise ValueError(
                f"{where}: fc.weight is [{h}, {fc_in}], an EAGLE-3 head (fc over three target "
                "layers): use method 'eagle3'"
            )
        _check_shape(tensors, "fc.weight", [h, 2 * h], where)
        _check_shape(tensors, "fc.bias", [h], where, optional=True)
        _check_shape(tensors, "embed_tokens.weight", [vocab, h], where, optional=True)
        _check_shape(tensors, "lm_head.weight", [vocab, h], where, optional=True)
    with torch.device("meta"):
        head = EagleHead(config, fc_bias="fc.bias" in tensors)
    materialize(head, torch_dtype, device)
    if load_format == "dummy":
        fill_dummy(head, seed + 1, torch_dtype)
    loader = WeightLoader(head)
    extra = {}
    for name, (tensor, shape, fname) in tensors.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            extra[name] = tensor
        elif not loader.load(name, tensor, shape, fname):
            logger.warning("%s: tensor %s is not used by an EAGLE-1 head", where, name)
    loader.check_complete(where)
    target_embed = target.model.embed_tokens
    target_lm = target_embed.weight if target.lm_head is None else target.lm_head.weight
    embed, lm_weight = target_embed, None
    if "embed_tokens.weight" in extra:
        own = extra["embed_tokens.weight"].to(device=device, dtype=torch_dtype)
        if not torch.equal(own, target_embed.weight):  # most heads keep the target's frozen
            embed = nn.Embedding.from_pretrained(own, freeze=True)
    if "lm_head.weight" in extra:
        own = extra["lm_head.weight"].to(device=device, dtype=torch_dtype)
        lm_weight = None if torch.equal(own, target_lm) else own
    return LoadedEagleHead(head.eval(), config, embed, lm_weight)


def _head_config(head_dir: Path, target_config: ModelConfig, where: str) -> ModelConfig:
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no config.json in {head_dir}")
    with open(path, encoding="utf-8") as f:
        raw: dict[str, Any] = json.load(f)
    if raw.get("add_para_norm"):
        raise ValueError(f"{where}: add_para_norm (HASS heads) is not supported")
    config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(
            f"{where}: hidden_size {config.hidden_size}, the target's "
            f"{target_config.hidden_size}: an EAGLE head reads the target's hidden states"
        )
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"{where}: vocabulary of {config.vocab_size} tokens (vocab_size), the target "
            f"{target_config.vocab_size}: an EAGLE head drafts the target's tokens"
        )
    return config


def _check_shape(
    tensors: dict, name: str, shape: list[int] | None, where: str, optional: bool = False
) -> None:
    if name not in tensors:
        if optional:
            return
        raise ValueError(
            f"{where}: the checkpoint has no {name}, so it is not an EAGLE head "
            f"(tensors: {', '.join(sorted(tensors)[:6])}{', ...' if len(tensors) > 6 else ''})"
        )
    got = list(tensors[name][1])
    if shape is not None and got != shape:
        what = "vocabulary" if name in ("embed_tokens.weight", "lm_head.weight") else "shape"
        raise ValueError(f"{where}: {name} is {got}, expected {shape} ({what} of the target)")


def _checkpoint_tensors(
    head_dir: Path, where: str
) -> Iterator[tuple[str, tuple[torch.Tensor, list[int], str]]]:
    """-> (name without a ``model.`` prefix, (tensor on the CPU, shape, file name))."""
    head_dir = Path(head_dir)
    for single, index in (SAFETENSORS, TORCH_BIN):
        if (head_dir / single).is_file():
            files = [head_dir / single]
        elif (head_dir / index).is_file():
            with open(head_dir / index, encoding="utf-8") as f:
                files = sorted({head_dir / n for n in json.load(f)["weight_map"].values()})
        else:
            continue
        for path in files:
            for name, value in _read_file(path):
                yield name.removeprefix("model."), (value, list(value.shape), path.name)
        return
    raise FileNotFoundError(
        f"{where}: no weights in {head_dir} (expected one of {', '.join(SAFETENSORS + TORCH_BIN)})"
    )


def _read_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:  # read whole: a head is small
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    # weights_only: a pickle is code; only tensors are accepted. mmap: no second copy.
    yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()
