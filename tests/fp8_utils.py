"""Test helpers: FP8 checkpoints written by hand from a tiny random transformers model, in the
formats Hugging Face models publish (HF ``quant_method: "fp8"`` with block-wise
``weight_scale_inv``; compressed-tensors with per-tensor or per-channel ``weight_scale``),
and the reference quantization they were made with (plain loops, float32)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# English text for teacher-forced comparisons on a trained model (~240 SmolLM2 tokens).
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg developed a system of movable metal type in Mainz. Before that, books were "
    "copied by hand, usually by monks working in the scriptoria of monasteries, and a single "
    "Bible could take a scribe more than a year to finish. Gutenberg combined several "
    "existing technologies: the screw press used by winemakers, oil-based inks that stuck "
    "to metal, and a hand mould that could cast letters quickly and in large numbers. The "
    "result was a machine that could print hundreds of pages a day. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe, and millions "
    "of books were in circulation. Prices fell, literacy rose, and ideas travelled faster "
    "than ever before. Scholars could compare identical copies of a text, which made it "
    "easier to correct errors and to build on the work of others. Historians often link the "
    "press to the Reformation, the Scientific Revolution and the rise of newspapers, "
    "although each of these had many causes. Today the word press still names the "
    "journalists who report the news, a reminder of the machine that first made it "
    "possible to share the same words with thousands of readers at once."
)


def is_linear_weight(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def block_quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (wq [N, K] fp8, scales [ceil(N / bn), ceil(K / bk)] float32), one scale
    per block (its largest |value| / 448), as DeepSeek / HF FP8 checkpoints are made."""
    n, k = w.shape
    scales = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    wq = torch.empty(n, k, dtype=FP8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            scales[i, j] = block.abs().max() / FP8_MAX
            wq[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (block / scales[i, j]).to(FP8)
    return wq, scales


def block_dequantize(wq: torch.Tensor, scales: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """-> [N, K] float32: each value times its block's scale."""
    out = wq.float().clone()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scales[i, j]
    return out


def tensor_quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (wq fp8, weight_scale): strategy "tensor" ([1]) or "channel" ([N, 1])."""
    if strategy == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w / scale).to(FP8), scale.float()


def write_bf16_checkpoint(src: Path, dst: Path) -> None:
    """The float checkpoint ``src`` cast to bfloat16, in ``dst``."""
    tensors = load_file(str(src / "model.safetensors"))
    dst.mkdir(parents=True)
    for extra in src.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config))
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, str(dst / "model.safetensors"))


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    fmt: str,
    block=(32, 48),
    unquantized: tuple[str, ...] = (),
    ignore: list[str] | None = None,
) -> dict[str, tuple]:
    """Rewrites the float checkpoint ``src`` as an FP8 one in ``dst``: fmt "hf-block",
    "ct-tensor" or "ct-channel". Weights go to one shard, scales (and a per-tensor
    input_scale, which loaders read past) to another, so a weight and its scale are never in
    the same file. The linear modules named in ``unquantized`` are written in bf16 without
    scales; ``ignore``: the list config.json names them with (``modules_to_not_convert`` /
    ``ignore``, replacing the default). -> linear weight name -> (wq, scales) as written."""
    tensors = load_file(str(src / "model.safetensors"))
    weights, scales, written = {}, {}, {}
    for name, t in tensors.items():
        if not is_linear_weight(name) or name.removesuffix(".weight") in unquantized:
            weights[name] = t.to(torch.bfloat16)
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "hf-block":
            wq, s = block_quantize(t, *block)
            scales[f"{prefix}.weight_scale_inv"] = s
        else:
            wq, s = tensor_quantize(t, fmt.removeprefix("ct-"))
            scales[f"{prefix}.weight_scale"] = s
            scales[f"{prefix}.input_scale"] = torch.ones(1)
        weights[name] = wq
        written[name] = (wq, s)
    dst.mkdir(parents=True)
    for extra in src.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    config["quantization_config"] = quantization_config(fmt, block)
    if ignore is not None:
        key = "modules_to_not_convert" if fmt == "hf-block" else "ignore"
        config["quantization_config"][key] = ignore
    (dst / "config.json").write_text(json.dumps(config))
    save_file(weights, str(dst / "model-00001-of-00002.safetensors"))
    save_file(scales, str(dst / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in weights}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in scales})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return written


def quantization_config(fmt: str, block=(32, 48)) -> dict:
    if fmt == "hf-block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    strategy = fmt.removeprefix("ct-")
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                },  # fmt: skip
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "tensor",
                    "symmetric": True,
                    "dynamic": False,
                },  # fmt: skip
            }
        },
    }


def fp8_weight(model, name: str) -> torch.Tensor:
    """The dequantized weight [N, K] float32 the model holds for checkpoint tensor ``name``
    (a q/k/v or gate/up part of a fused layer, or a plain layer's weight). TP=1 only."""
    module_name, _, _ = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    packed = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
    if leaf not in packed:
        layer = model.get_submodule(module_name)
        return layer.weight.float() * layer.weight_scale[:, None]
    layer = model.get_submodule(f"{parent}.{packed[leaf]}")
    index = layer.packed_parts.index(leaf)
    offset, size, _, _ = layer.part_range(index)
    rows = slice(offset, offset + size)
    return layer.weight[rows].float() * layer.weight_scale[rows, None]
