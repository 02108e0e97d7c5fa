"""FP8 MoE checkpoints load: per-expert FP8 tensors (HF block-wise ``weight_scale_inv``,
compressed-tensors per-channel ``weight_scale``) go to their expert's rows of the stacked FP8
weights; per-channel scales load exactly, block scales are re-quantized per channel (the
loader's rule for linear layers). Also an unquantized MoE checkpoint quantized at load."""

from __future__ import annotations

import pytest
import torch
from fp8_utils import block_dequantize, write_fp8_checkpoint
from model_utils import Driver
from moe_utils import save_hf_moe_model

from pydaemon.model_loader.loader import load_model

BLOCK = (16, 32)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return save_hf_moe_model(tmp_path_factory.mktemp("src"), "qwen2_moe")


def _expert_weight(model, layer: int, expert: int, part: str) -> torch.Tensor:
    """The dequantized [N, K] float32 weight the model holds for one expert projection."""
    moe = model.model.layers[layer].mlp.experts
    i = moe.intermediate_per_rank
    if part == "down_proj":
        return moe.w2_weight[expert].float() * moe.w2_weight_scale[expert, :, None]
    rows = slice(0, i) if part == "gate_proj" else slice(i, 2 * i)
    return moe.w13_weight[expert, rows].float() * moe.w13_weight_scale[expert, rows, None]


@pytest.mark.parametrize("fmt", ["ct-channel", "hf-block"])
def test_fp8_moe_checkpoint_loads(qwen2_moe, tmp_path, fmt):
    written = write_fp8_checkpoint(qwen2_moe, tmp_path / fmt, fmt, block=BLOCK)
    model, config = load_model(tmp_path / fmt, quantization="fp8_emulated")
    assert config.quantization is not None
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    checked = 0
    for name, (wq, scale) in written.items():
        parts = name.split(".")
        if "experts" not in parts:
            continue
        layer, expert, part = int(parts[2]), int(parts[5]), parts[6]
        ours = _expert_weight(model, layer, expert, part)
        if fmt == "ct-channel":
            torch.testing.assert_close(ours, wq.float() * scale, rtol=0, atol=0)
        else:  # re-quantized per channel: within half an e4m3 step of the row's largest scale
            ref = block_dequantize(wq, scale, *BLOCK)
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
