"""FP8 MoE checkpoints load: per-expert FP8 tensors (HF block-wise ``weight_scale_inv``,
compressed-tensors per-channel ``weight_scale``) go to their expert's rows of the stacked FP8
weights; per-channel scales load exactly; block scales load exactly too where the experts'
intermediate size is a multiple of the block (the layer keeps them: pydaemon/layers/moe/
fp8.py), else they are re-quantized per channel (the loader's rule for linear layers). Also
an unquantized MoE checkpoint quantized at load."""

from __future__ import annotations

import pytest
import torch
from fp8_utils import block_dequantize, write_fp8_checkpoint
from model_utils import Driver
from moe_utils import save_hf_moe_model

from pydaemon.model_loader.loader import load_model
from pydaemon.quantization.fp8 import dequantize_blocks

BLOCK = (16, 32)  # divides the experts' intermediate size 32: block scales kept
ODD_BLOCK = (16, 24)  # does not: re-quantized per channel


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return save_hf_moe_model(tmp_path_factory.mktemp("src"), "qwen2_moe")


def _expert_weight(model, layer: int, expert: int, part: str) -> torch.Tensor:
    """The dequantized [N, K] float32 weight the model holds for one expert projection."""
    moe = model.model.layers[layer].mlp.experts
    i = moe.intermediate_per_rank
    blocks = moe.quant_method.block_shape
    if blocks is not None:
        w13 = dequantize_blocks(moe.w13_weight[expert], moe.w13_weight_scale[expert], blocks)
        w2 = dequantize_blocks(moe.w2_weight[expert], moe.w2_weight_scale[expert], blocks)
    else:
        w13 = moe.w13_weight[expert].float() * moe.w13_weight_scale[expert, :, None]
        w2 = moe.w2_weight[expert].float() * moe.w2_weight_scale[expert, :, None]
    if part == "down_proj":
        return w2
    return w13[:i] if part == "gate_proj" else w13[i:]


@pytest.mark.parametrize(
    "fmt,block", [("ct-channel", BLOCK), ("hf-block", BLOCK), ("hf-block", ODD_BLOCK)]
)
def test_fp8_moe_checkpoint_loads(qwen2_moe, tmp_path, fmt, block):
    written = write_fp8_checkpoint(qwen2_moe, tmp_path / fmt, fmt, block=block)
    model, config = load_model(tmp_path / fmt, quantization="fp8_emulated")
    assert config.quantization is not None
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    kept = fmt == "hf-block" and block == BLOCK
    assert experts.quant_method.block_shape == (BLOCK if kept else None)
    if kept:  # [E, 2 * I / bn, H / bk] and [E, H / bn, I / bk]
        assert experts.w13_weight_scale.shape == (8, 4, 2)
        assert experts.w2_weight_scale.shape == (8, 4, 1)
    checked = 0
    for name, (wq, scale) in written.items():
        parts = name.split(".")
        if "experts" not in parts:
            continue
        layer, expert, part = int(parts[2]), int(parts[5]), parts[6]
        ours = _expert_weight(model, layer, expert, part)
        if fmt == "ct-channel":
            torch.testing.assert_close(ours, wq.float() * scale, rtol=0, atol=0)
        elif kept:  # the checkpoint's values and block scales, exactly
            torch.testing.assert_close(ours, block_dequantize(wq, scale, *block), rtol=0, atol=0)
        else:  # re-quantized per channel: within half an e4m3 step of the row's largest scale
            ref = block_dequantize(wq, scale, *block)
            bound = ref.abs().amax(dim=1, keepdim=True) / 16
            assert bool(((ours - ref).abs() <= bound).all())
        checked += 1
    assert checked == 8 * 3  # one sparse layer: 8 experts x gate, up, down
    shared = model.model.layers[1].mlp.shared_expert.gate_up_proj
    assert shared.weight.dtype == torch.float8_e4m3fn
    tokens = Driver(model, block_size=16).generate([[5, 6, 7], [8] * 9], 4)
    assert all(len(t) == 4 for t in tokens)


def test_unquantized_moe_checkpoint_quantized_at_load(qwen2_moe):
    model, _ = load_model(qwen2_moe, quantization="fp8_emulated")
    ref, _ = load_model(qwen2_moe)
    for part in ("gate_proj", "up_proj", "down_proj"):
        ours = _expert_weight(model, 1, 3, part)
        moe = ref.model.layers[1].mlp.experts
        i = moe.intermediate_per_rank
        full = {
            "gate_proj": moe.w13_weight[3, :i],
            "up_proj": moe.w13_weight[3, i:],
            "down_proj": moe.w2_weight[3],
        }[part]
        bound = full.abs().amax(dim=1, keepdim=True) / 16
        assert bool(((ours - full).abs() <= bound).all())
