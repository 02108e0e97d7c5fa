"""Builds a model from a Hugging Face-format directory or a GGUF file.

Weights come from ``model.safetensors`` or from the shards named by
``model.safetensors.index.json``, read tensor by tensor through ``safetensors.safe_open`` and
copied straight into parameters that were allocated once on the target device and dtype (no
second full copy of the model in host memory). ``load_format="dummy"`` fills random weights
of the right shapes instead, with only ``config.json`` needed. A ``.gguf`` file (see
pydaemon/gguf/) gives config and weights at once; its weights are dequantized at load, to
float32 on the CPU and bfloat16 on CUDA when ``dtype="auto"``.

Tensor parallel: a sharded parameter (see layers/parallel_linear.py) is read as this rank's
slice only (``get_slice``), so no rank ever holds the whole model. Dummy weights are drawn at
the full shape one tensor at a time and sliced, so that they do not depend on the TP size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pydaemon.gguf import GGUFFile, is_gguf_file, iter_gguf_weights, load_gguf_config
from pydaemon.layers.parallel_linear import shard_range
from pydaemon.layers.rotary_embedding import RotaryEmbedding
from pydaemon.model_config import ModelConfig, resolve_dtype
from pydaemon.models import get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[nn.Module, ModelConfig]:
    """-> (model in eval mode on ``device``, its config). ``model_dir`` may be a .gguf file."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unsupported load_format {load_format!r}: expected 'auto' or 'dummy'")
    model_dir = Path(model_dir)
    device = torch.device(device)
    gguf = GGUFFile(model_dir) if is_gguf_file(model_dir) else None
    if gguf is not None:
        config = load_gguf_config(gguf)
        if dtype == "auto":  # quantized weights name no dtype: the device's usual one
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        config = ModelConfig.from_model_dir(model_dir)
    torch_dtype = resolve_dtype(config, dtype)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    _materialize(model, torch_dtype, device)
    if load_format == "dummy":
        _fill_dummy(model, seed)
    elif gguf is not None:
        _load_gguf_weights(model, config, gguf)
    else:
        _load_weights(model, config, model_dir)
    return model.eval(), config


def load_model_config(model: str | Path) -> ModelConfig:
    """-> the config of a model directory (config.json) or of a .gguf file (its metadata)."""
    if is_gguf_file(model):
        return load_gguf_config(GGUFFile(model))
    return ModelConfig.from_model_dir(model)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """-> tensor name -> shard holding it, from ``model.safetensors.index.json``."""
    index = model_dir / INDEX_FILE
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map'")
    return {name: model_dir / fname for name, fname in weight_map.items()}


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace meta parameters by uninitialised ones on ``device`` in ``dtype``."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            module._parameters[name] = nn.Parameter(empty, requires_grad=False)
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters(device)


def _shards(model: nn.Module) -> dict[str, tuple[int, int, int, int] | None]:
    """-> parameter name -> its (dim, start, stop, full_size) slice, None if not sharded."""
    out = {}
    for module_name, module in model.named_modules():
        for local, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            out[name] = shard_range(module, local)
    return out


def _copy_shard(param: torch.Tensor, full: torch.Tensor, shard: tuple[int, int, int, int]) -> None:
    """param: this rank's slice; full: [..., stop - start, ...] already cut along dim."""
    dim, start, stop, _ = shard
    param.data.narrow(dim, 0, stop - start).copy_(full)
    if stop - start < param.shape[dim]:  # vocabulary padding of the last rank
        param.data.narrow(dim, stop - start, param.shape[dim] - (stop - start)).zero_()


def _fill_dummy(model: nn.Module, seed: int) -> None:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shards = _shards(model)
    for name, param in model.named_parameters():
        shard = shards.get(name)
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif shard is None:
            param.data.normal_(0.0, 0.02, generator=gen)
        else:  # the same draws as the unsharded model, one tensor at a time
            dim, start, stop, full_size = shard
            shape = list(param.shape)
            shape[dim] = full_size
            full = torch.empty(shape, dtype=param.dtype, device=device).normal_(
                0.0, 0.02, generator=gen
            )
            _copy_shard(param, full.narrow(dim, start, stop - start), shard)
            del full


def _load_weights(model: nn.Module, config: ModelConfig, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    shards = _shards(model)
    if (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    elif (model_dir / INDEX_FILE).is_file():
        files = sorted(set(weight_files(model_dir).values()))
    else:
        raise FileNotFoundError(
            f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} "
            "(or use load_format='dummy')"
        )
    loaded: set[str] = set()
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"weight shard not found: {path}")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                param = params.get(name)
                if param is None:
                    continue  # lm_head of a tied model, rotary inv_freq, ...: ignored
                # get_slice keeps the read lazy until the copy below.
                tensor_slice = f.get_slice(name)
                shape = tuple(tensor_slice.get_shape())
                shard = shards.get(name)
                expected = list(param.shape)
                if shard is not None:
                    expected[shard[0]] = shard[3]
                if list(shape) != expected:
                    raise ValueError(
                        f"tensor {name!r} in {path.name} has shape {list(shape)}, "
                        f"expected {expected}"
                    )
                if shard is None:
                    param.data.copy_(f.get_tensor(name))
                else:  # read only this rank's rows / columns
                    dim, start, stop, _ = shard
                    index = (slice(None),) * dim + (slice(start, stop),)
                    _copy_shard(param, tensor_slice[index], shard)
                loaded.add(name)
    missing = [name for name in params if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"missing tensors in checkpoint {model_dir}: {shown}")


def _load_gguf_weights(model: nn.Module, config: ModelConfig, gguf: GGUFFile) -> None:
    params = dict(model.named_parameters())
    shards = _shards(model)
    loaded: set[str] = set()
    for name, tensor in iter_gguf_weights(gguf, config, next(iter(params.values())).dtype):
        param = params.get(name)
        if param is None:
            continue  # output.weight of a model pagedd runs tied, ...
        shard = shards.get(name)
        expected = list(param.shape)
        if shard is not None:
            expected[shard[0]] = shard[3]
        if list(tensor.shape) != expected:
            raise ValueError(
                f"tensor {name!r} in {gguf.path.name} has shape {list(tensor.shape)}, "
                f"expected {expected}"
            )
        if shard is None:
            param.data.copy_(tensor)
        else:
            dim, start, stop, _ = shard
            _copy_shard(param, tensor.narrow(dim, start, stop - start), shard)
        loaded.add(name)
    missing = [name for name in params if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"missing tensors in {gguf.path.name}: {shown}")
