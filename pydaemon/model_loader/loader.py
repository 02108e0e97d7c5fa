"""Builds a model from a Hugging Face-format directory or a GGUF file.

Weights come from ``model.safetensors`` or from the shards named by
``model.safetensors.index.json``, read tensor by tensor through ``safetensors.safe_open`` and
copied straight into parameters that were allocated once on the target device and dtype (no
second full copy of the model in host memory). ``load_format="dummy"`` fills random weights
of the right shapes instead, with only ``config.json`` needed. A ``.gguf`` file (see
pydaemon/gguf/) gives config and weights at once; its weights are dequantized at load, to
float32 on the CPU and bfloat16 on CUDA when ``dtype="auto"``.

Checkpoint tensors are matched by their Hugging Face names through
pydaemon/model_loader/weight_targets.py, which packs q/k/v and gate/up into the model's fused
``qkv_proj`` / ``gate_up_proj`` parameters.

Tensor parallel: a sharded parameter (see layers/parallel_linear.py) is read as this rank's
slice only (``get_slice``), so no rank ever holds the whole model. Dummy weights are drawn at
the full shape one checkpoint tensor at a time and sliced, so that they do not depend on the
TP size (nor on the packing). A rank holding part of the model only (a pipeline stage, or
some experts under expert parallelism) makes the whole model's draws in the whole model's
order, keeping its own: every split of the model gets the same dummy weights.

Quantization (``quantization="fp8"``, or a checkpoint whose config.json says it is FP8; see
pydaemon/quantization/): the linear layers hold FP8 weights with per-channel scales, filled
from the checkpoint's FP8 tensors or quantized from unquantized ones as they are copied
(dummy weights too: the same draws as the unquantized model, then quantized). A 4-bit
checkpoint (AWQ, GPTQ, compressed-tensors pack-quantized; gpt-oss's MXFP4 experts) is
repacked at load into the engine's layout (model_loader/int4_loading.py, mxfp4_loading.py);
``load_format="dummy"`` with ``quantization="awq"`` (or another 4-bit method) quantizes the
unquantized model's draws into that layout. The layers a
quantized checkpoint lists as left unquantized (pydaemon/model_loader/ignored_layers.py)
stay in the model's dtype and load their checkpoint weights as they are.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pydaemon.config.model import ModelConfig, resolve_dtype
from pydaemon.distributed import parallel_state as ps
from pydaemon.gguf import GGUFFile, is_gguf_file, load_gguf_config
from pydaemon.gguf.weights import iter_gguf_weights
from pydaemon.layers.rotary_embedding import RotaryEmbedding
from pydaemon.model_loader import mxfp4_loading
from pydaemon.model_loader.fp8_loading import Fp8Target
from pydaemon.model_loader.ignored_layers import skip_ignored_layers
from pydaemon.model_loader.int4_loading import Int4Target
from pydaemon.model_loader.mxfp4_loading import Mxfp4Target
from pydaemon.model_loader.weight_targets import WeightLoader, weight_targets
from pydaemon.models import get_model_class
from pydaemon.quantization.config import resolve_quantization

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

logger = logging.getLogger(__name__)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """-> (model in eval mode on ``device``, its config). ``model_dir`` may be a .gguf file.
    ``quantization``: None (as the checkpoint is), "fp8" or "fp8_emulated"."""
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
    quant_config = resolve_quantization(
        quantization,
        config.quantization,
        device,
        model_dtype=torch_dtype,
        checkpoint_dtype=resolve_dtype(config, "auto") if gguf is None else None,
        load_format=load_format,
        tp_size=ps.get_tp_world_size(),
    )
    model = _build_on_meta(config, quant_config, log=True)
    materialize(model, torch_dtype, device)
    if load_format == "dummy":
        whole = None
        if ps.get_pp_world_size() > 1 or ps.get_ep_world_size() > 1:  # this rank: a part
            with ps.unsharded():
                whole = weight_targets(_build_on_meta(config, quant_config))
        fill_dummy(model, seed, torch_dtype, whole)
    elif gguf is not None:
        _load_gguf_weights(model, config, gguf)
    else:
        _load_weights(model, config, model_dir)
    return model.eval(), config


def _build_on_meta(config: ModelConfig, quant_config, log: bool = False) -> nn.Module:
    """The model (this rank's part of it) on the meta device: shapes, no memory."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, quant_config)
    if quant_config is not None:
        skipped = skip_ignored_layers(model, quant_config.checkpoint)
        if skipped and log:
            logger.info(
                "%d linear layers left unquantized, as the checkpoint lists them: %s",
                len(skipped),
                ", ".join(skipped),
            )
    return model


def weight_files(model_dir: Path) -> dict[str, Path]:
    """-> tensor name -> shard holding it, from ``model.safetensors.index.json``."""
    index = model_dir / INDEX_FILE
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map'")
    return {name: model_dir / fname for name, fname in weight_map.items()}


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace meta parameters by uninitialised ones on ``device`` in ``dtype`` (those of a
    quantization method in their own dtype: FP8 weights, float32 scales)."""
    for module in model.modules():
        # A quantized linear or MoE layer: its method's parameters keep their own dtype.
        quant = getattr(module, "quant_method", None)
        own_dtype = quant.own_dtype_params if quant is not None else ()
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            param_dtype = param.dtype if name in own_dtype else dtype
            empty = torch.empty(param.shape, dtype=param_dtype, device=device)
            module._parameters[name] = nn.Parameter(empty, requires_grad=False)
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters(device)


def fill_dummy(model: nn.Module, seed: int, dtype: torch.dtype, whole: dict | None = None) -> None:
    """Random weights. ``whole``: the whole model's weight targets (on the meta device) when
    ``model`` is a part of it: their draws are made in their order, this part's kept."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    drawn: set[int] = set()  # int4 parts and MXFP4 layers already drawn
    targets = weight_targets(model)
    for name, whole_target in (whole or targets).items():
        target = targets.get(name)
        if target is None:  # another rank's: drawn as the whole model would, then dropped
            _skip_draw(name, whole_target, drawn, gen, dtype)
            continue
        if isinstance(target, Int4Target):
            if id(target.part) not in drawn:  # the unquantized model's draws, quantized
                drawn.add(id(target.part))
                full = torch.empty(target.checkpoint_shape, dtype=dtype, device=device)
                target.part.load_float(full.normal_(0.0, 0.02, generator=gen))
                del full
        elif isinstance(target, Mxfp4Target):
            if whole is not None:
                raise ValueError(
                    "dummy MXFP4 experts cannot be split over pipeline stages or experts yet "
                    "(pipeline_parallel_size > 1 or enable_expert_parallel): load the "
                    "checkpoint's weights"
                )
            if id(target.module) not in drawn:
                drawn.add(id(target.module))
                mxfp4_loading.fill_dummy(target.module, gen, dtype)
        elif isinstance(target, Fp8Target):
            if target.required:  # the unquantized model's draws, quantized as they load
                full = torch.empty(target.checkpoint_shape, dtype=dtype, device=device)
                target.load(name, full.normal_(0.0, 0.02, generator=gen), full.shape, "dummy")
                target.finish("dummy")
                del full
        elif name.endswith("norm.weight"):
            target.dest.fill_(1.0)
        elif target.shard is None:
            target.dest.normal_(0.0, 0.02, generator=gen)
        else:  # the same draws as the unsharded model, one checkpoint tensor at a time
            full = torch.empty(target.checkpoint_shape, dtype=target.dest.dtype, device=device)
            target.copy_(full.normal_(0.0, 0.02, generator=gen)[target.read_index()])
            del full


def _skip_draw(name: str, whole_target, drawn: set[int], gen, dtype: torch.dtype) -> None:
    """The draws of a checkpoint tensor this rank does not hold (its target in the whole model,
    on the meta device), made and dropped: the generator moves as the whole model's does."""
    if isinstance(whole_target, Mxfp4Target):
        raise ValueError(
            "dummy MXFP4 experts cannot be split over pipeline stages or experts yet "
            "(pipeline_parallel_size > 1 or enable_expert_parallel): load the checkpoint's weights"
        )
    if isinstance(whole_target, Int4Target):
        if id(whole_target.part) in drawn:
            return
        drawn.add(id(whole_target.part))
    elif name.endswith("norm.weight") or not whole_target.required:
        return  # filled, not drawn
    shape = whole_target.checkpoint_shape
    torch.empty(shape, dtype=dtype, device=gen.device).normal_(0.0, 0.02, generator=gen)


def _load_weights(model: nn.Module, config: ModelConfig, model_dir: Path) -> None:
    if (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    elif (model_dir / INDEX_FILE).is_file():
        files = sorted(set(weight_files(model_dir).values()))
    else:
        raise FileNotFoundError(
            f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} "
            "(or use load_format='dummy')"
        )
    loader = WeightLoader(model)
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"weight shard not found: {path}")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                # get_slice keeps the read lazy: only this rank's rows / columns are read.
                tensor_slice = f.get_slice(name)
                loader.load(name, tensor_slice, tensor_slice.get_shape(), path.name)
    loader.check_complete(f"checkpoint {model_dir}")


def _load_gguf_weights(model: nn.Module, config: ModelConfig, gguf: GGUFFile) -> None:
    loader = WeightLoader(model)
    for name, tensor in iter_gguf_weights(gguf, config, next(model.parameters()).dtype):
        loader.load(name, tensor, tensor.shape, gguf.path.name)
    loader.check_complete(gguf.path.name)
