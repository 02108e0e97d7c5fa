"""4-bit checkpoints on the CPU: AWQ, GPTQ (v1 / v2 zero points, act-order), compressed-tensors
pack-quantized (symmetric / asymmetric, group / channel, actorder "group") and gpt-oss MXFP4
experts, written by hand from tiny random models (tests/w4_checkpoints.py). Each layer's
weights, dequantized from what the engine loaded, equal the float64 unpacking of the written
tensors exactly; greedy tokens equal those of the same model written dequantized; dummy
weights in each layout; the errors for what is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.layers.moe.int4 import dequantize_expert
from pydaemon.model_loader.loader import load_model
from pydaemon.quantization.int4 import dequantize_int4

sys.path.insert(0, str(Path(__file__).parent))
from model_utils import Driver, save_hf_model  # noqa: E402
from moe_utils import save_hf_moe_model  # noqa: E402
from w4_checkpoints import (  # noqa: E402
    write_dequantized_checkpoint,
    write_int4_checkpoint,
    write_mxfp4_checkpoint,
)

PROMPTS = [[5, 6, 7, 8], [9] * 11, [20, 21]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_hf_model(tmp_path_factory.mktemp("w4"), "llama", seed=1)


def _linear_weight(model, name: str) -> torch.Tensor:
    """The float64 [N, K] weight of checkpoint linear ``name`` as the engine holds it."""
    module_name, _, _ = name.rpartition(".")
    parent, _, part = module_name.rpartition(".")
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
             "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
    layer = model.get_submodule(f"{parent}.{fused.get(part, part)}")
    if layer.quant_method is None:
        w = layer.weight
    else:
        zeros = getattr(layer, "qzeros", None)
        w = dequantize_int4(layer.qweight, layer.scales, zeros, torch.float64)
        if hasattr(layer, "perm"):
            unpermuted = torch.empty_like(w)
            unpermuted[:, layer.perm.long()] = w
            w = unpermuted
    if part in fused:
        offset, size, _, _ = layer.part_range(layer.packed_parts.index(part))
        w = w[offset : offset + size]
    return w.double()


CASES = {
    "awq-g32": dict(fmt="awq", group=32),
    "awq-g64-skip": dict(fmt="awq", group=64, unquantized=("model.layers.1.mlp.down_proj",)),
    "gptq-g32-sym": dict(fmt="gptq", group=32, sym=True),
    "gptq-g64-asym-v2": dict(fmt="gptq", group=64, v2=True),
    "gptq-g32-desc-act": dict(fmt="gptq", group=32, sym=True, desc_act=True),
    "gptq-channel": dict(fmt="gptq", group=None, sym=True),
    "ct-g32-sym": dict(fmt="ct", group=32, sym=True),
    "ct-g16-asym": dict(fmt="ct", group=16, sym=False),
    "ct-channel-asym": dict(fmt="ct", group=None, sym=False),
    "ct-g32-actorder": dict(fmt="ct", group=32, sym=True, desc_act=True),
}


@pytest.mark.parametrize("case", CASES)
def test_int4_checkpoint_weights_and_greedy_tokens(llama, tmp_path, case):
    kw = CASES[case]
    reference = write_int4_checkpoint(llama, tmp_path / "q", **kw)
    model, config = load_model(tmp_path / "q", dtype="float32")
    assert config.quantization.quant_method == {"ct": "compressed-tensors"}.get(
        kw["fmt"], kw["fmt"]
    )
    for name, want in reference.items():
        got = _linear_weight(model, name)
        assert torch.equal(got, want), name
    for name in kw.get("unquantized", ()):
        assert model.get_submodule(name).quant_method is None
    write_dequantized_checkpoint(llama, tmp_path / "deq", reference)
    ref_model, _ = load_model(tmp_path / "deq", dtype="float32")
    want_tokens = Driver(ref_model, block_size=16).generate(PROMPTS, 6)
    assert Driver(model, block_size=16).generate(PROMPTS, 6) == want_tokens


@pytest.mark.parametrize("arch,group", [("qwen3_moe", 32), ("mixtral", 32), ("qwen2_moe", 16)])
def test_int4_moe_experts(tmp_path, arch, group):
    src = save_hf_moe_model(tmp_path, arch, seed=2)
    reference = write_int4_checkpoint(
        src, tmp_path / "q", "gptq", group=group, desc_act=arch == "qwen3_moe"
    )
    model, _ = load_model(tmp_path / "q", dtype="float32")
    index = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    experts = model.model.layers[index].mlp.experts
    method = experts.quant_method
    w13, w2 = method.weights(experts, "w13"), method.weights(experts, "w2")
    mlp = "block_sparse_moe" if arch == "mixtral" else "mlp"
    prefix = f"model.layers.{index}.{mlp}.experts"
    gate, up, down = experts.expert_names
    for e in range(experts.num_experts):
        want13 = torch.cat([reference[f"{prefix}.{e}.{gate}.weight"],
                            reference[f"{prefix}.{e}.{up}.weight"]])  # fmt: skip
        assert torch.equal(dequantize_expert(w13, e, torch.float64), want13)
        assert torch.equal(
            dequantize_expert(w2, e, torch.float64), reference[f"{prefix}.{e}.{down}.weight"]
        )
    write_dequantized_checkpoint(src, tmp_path / "deq", reference)
    ref_model, _ = load_model(tmp_path / "deq", dtype="float32")
    want = Driver(ref_model, block_size=16).generate(PROMPTS, 5)
    assert Driver(model, block_size=16).generate(PROMPTS, 5) == want


def test_mxfp4_experts(tmp_path):
    src = save_hf_moe_model(tmp_path, "qwen3_moe", seed=3, hidden_size=64,
                            moe_intermediate_size=64)  # fmt: skip
    reference = write_mxfp4_checkpoint(src, tmp_path / "q")
    model, config = load_model(tmp_path / "q", dtype="float32")
    assert config.quantization.quant_method == "mxfp4"
    experts = model.model.layers[0].mlp.experts
    method = experts.quant_method
    for proj in ("w13", "w2"):
        w = method.weights(experts, proj)
        want = reference[f"model.layers.0.mlp.experts.{proj}"]
        for e in range(experts.num_experts):
            assert torch.equal(dequantize_expert(w, e, torch.float64), want[e]), (proj, e)
    assert model.model.layers[0].self_attn.qkv_proj.quant_method is None
    # Expert tensors only: write the others' float weights back for the dequantized model.
    deq = {}
    for key, w in reference.items():
        deq[key] = w
    write_dequantized_checkpoint(src, tmp_path / "deq", deq)
    ref_model, _ = load_model(tmp_path / "deq", dtype="float32")
    want = Driver(ref_model, block_size=16).generate(PROMPTS, 5)
    assert Driver(model, block_size=16).generate(PROMPTS, 5) == want
