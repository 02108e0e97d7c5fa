"""FP8 weights on the CPU (the emulated path, ``quantization="fp8_emulated"``): quantization
round trips, each checkpoint format loaded to the expected values, dummy weights, TP=2 over
gloo, and the clear errors. Accuracy against the unquantized model: test_fp8_accuracy.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pydaemon.config.engine import EngineConfig
from pydaemon.model_loader.loader import load_model
from pydaemon.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    emulated_scaled_mm,
    quantize_per_channel,
    quantize_per_token,
)

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402
from fp8_utils import (  # noqa: E402
    block_dequantize,
    fp8_weight,
    is_linear_weight,
    write_bf16_checkpoint,
    write_fp8_checkpoint,
)

E4M3_REL = 2.0**-4  # half the spacing of 3-bit mantissas, relative to the value
E4M3_SUBNORMAL = 2.0**-10  # half the subnormal spacing (2^-9), relative to the scale


def _within_e4m3(
    approx: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, slack: float = 1.0
) -> bool:
    """|approx - exact| <= half an e4m3 step (times ``slack``), elementwise; scale: [N, 1]
    or [T, 1]."""
    rel = E4M3_REL * slack
    bound = torch.maximum(rel * exact.abs(), E4M3_SUBNORMAL * scale) * (1 + 1e-6)
    return bool(((approx - exact).abs() <= bound).all())


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> Path:
    """A tiny float32 Llama (GQA 4 / 2 heads), saved with save_pretrained."""
    path = tmp_path_factory.mktemp("fp8") / "float"
    make_hf_model(path, num_heads=4, num_kv_heads=2)
    return path


def test_per_channel_round_trip_within_e4m3_tolerance():
    gen = torch.Generator().manual_seed(0)
    w = (
        torch.randn(96, 200, generator=gen, dtype=torch.float64)
        * torch.logspace(-3, 1, 96)[:, None]
    )
    w[5] = 0.0  # an all-zero row quantizes to zeros, not NaN
    wq, scale = quantize_per_channel(w)
    assert wq.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (96,)
    back = dequantize(wq, scale).double()
    assert _within_e4m3(back, w, scale.double()[:, None])
    assert torch.equal(back[5], torch.zeros(200, dtype=torch.float64))
    # each row's largest |value| maps to +-448 exactly
    assert torch.equal(wq.float().abs().amax(dim=1)[scale > 1e-11], torch.full((95,), FP8_MAX))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_quantization_and_emulated_gemm(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 64, generator=gen) * torch.logspace(-4, 2, 7)[:, None]).to(dtype)
    x[3] = 0.0
    w = torch.randn(48, 64, generator=gen) * 0.05
    xq, x_scale = quantize_per_token(x)
    assert xq.dtype == FP8_DTYPE and x_scale.shape == (7, 1) and x_scale.dtype == torch.float32
    # bf16 rows are scaled in bf16: one more rounding (2^-9 relative) before the e4m3 one,
    # so 2^-4 + 2^-9 + 2^-13 <= 2^-4 * (1 + 2^-4) relative
    slack = 1 + 2**-4 if dtype == torch.bfloat16 else 1.0
    back = xq.double() * x_scale.double()
    assert _within_e4m3(back, x.double(), x_scale.double() * slack, slack)
    assert not bool(xq[3].float().any()) and bool(torch.isfinite(x_scale).all())
    x = x.float()
    wq, w_scale = quantize_per_channel(w)
    got = emulated_scaled_mm(xq, x_scale, wq, w_scale)  # [7, 48]
    # FP8 x FP8 products are exact: the float64 product of the dequantized operands
    ref = (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double()[:, None]).t()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_checkpoint_quantized_at_load(float_model, tmp_path):
    write_bf16_checkpoint(float_model, tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    model, _ = load_model(tmp_path / "bf16", quantization="fp8_emulated")
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert layer.mlp.down_proj.weight_scale.dtype == torch.float32
    # the embedding and the LM head stay in the activation dtype
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    checked = 0
    for name, w in tensors.items():
        if is_linear_weight(name):  # quantized per channel from the checkpoint's bf16 values
            wq, scale = quantize_per_channel(w)
            assert torch.equal(fp8_weight(model, name), dequantize(wq, scale)), name
            checked += 1
    assert checked == 2 * 7


def test_hf_fp8_block_checkpoint(float_model, tmp_path):
    bn, bk = 32, 48  # partial blocks on every 64-wide dimension
    written = write_fp8_checkpoint(float_model, tmp_path / "hf", "hf-block", (bn, bk))
    model, config = load_model(tmp_path / "hf", quantization="fp8_emulated")
    assert config.quantization.strategy == "block" and config.quantization.block_size == (bn, bk)
    originals = load_file(str(float_model / "model.safetensors"))
    worst, errors = 0.0, []
    for name, (wq, block_scales) in written.items():
        got = fp8_weight(model, name)
        exact = block_dequantize(wq, block_scales, bn, bk)  # the checkpoint's values
        # re-quantized per channel with the row's largest block scale: half an e4m3 step
        row_scale = block_scales.amax(dim=1).repeat_interleave(bn)[: wq.shape[0], None]
        assert _within_e4m3(got, exact, row_scale), name
        # the blocks that hold a row's largest scale keep their values exactly
        has_max = block_scales == block_scales.amax(dim=1, keepdim=True)
        keep = has_max.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[
            : wq.shape[0], : wq.shape[1]
        ]
        assert torch.equal(got[keep], exact[keep]), name
        error = ((got - exact).norm() / exact.norm()).item()
        # what quantizing the float weight per channel in one go costs, for scale
        w = originals[name]
        one_step = ((dequantize(*quantize_per_channel(w)) - w).norm() / w.norm()).item()
        worst = max(worst, error / one_step)
        errors.append(error)
    print(
        f"block -> per-channel re-quantization: relative Frobenius error mean "
        f"{sum(errors) / len(errors):.4f}, at most {worst:.2f}x a direct per-channel quantization"
    )
    assert worst < 1.5


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_compressed_tensors_checkpoint(float_model, tmp_path, strategy):
    written = write_fp8_checkpoint(float_model, tmp_path / "ct", f"ct-{strategy}")
    model, config = load_model(tmp_path / "ct", quantization="fp8_emulated")
    assert config.quantization.quant_method == "compressed-tensors"
    assert config.quantization.strategy == strategy
    for name, (wq, scale) in written.items():  # exact: the checkpoint's FP8 values and scales
        expected = wq.float() * scale.reshape(-1, 1)
        assert torch.equal(fp8_weight(model, name), expected), name
    # q, k, v keep their own per-tensor scales inside the fused qkv_proj
    qkv_scale = model.model.layers[0].self_attn.qkv_proj.weight_scale
    if strategy == "tensor":
        assert len(set(qkv_scale.tolist())) == 3


def test_dummy_fp8_is_the_dummy_bf16_model_quantized(float_model):
    ref, _ = load_model(float_model, dtype="bfloat16", load_format="dummy", seed=3)
    fp8, _ = load_model(
        float_model, dtype="bfloat16", load_format="dummy", seed=3, quantization="fp8_emulated"
    )
    for (name, a), (_, b) in zip(ref.named_modules(), fp8.named_modules(), strict=True):
        if name.endswith(("proj", "gate_up_proj")):
            wq, scale = quantize_per_channel(a.weight)
            assert torch.equal(b.weight.view(torch.uint8), wq.view(torch.uint8)), name
            assert torch.equal(b.weight_scale, scale), name
    assert torch.equal(ref.model.embed_tokens.weight, fp8.model.embed_tokens.weight)


def test_tp2_fp8_equals_tp1(float_model, tmp_path):
    """Block-wise FP8 checkpoint, shards not aligned to the blocks: each rank's FP8 weights
    and scales are exactly TP=1's sliced. Outputs agree within FP8 noise, not bitwise: a
    row-parallel layer (o_proj, down_proj) quantizes each rank's half of the activations
    with that half's per-token scale. Compared teacher-forced: every prefix of TP=1's
    greedy continuations, one next token each, with the logprobs of the top 5."""
    from pydaemon.entrypoints.llm import LLM
    from pydaemon.sampling_params import SamplingParams

    write_fp8_checkpoint(float_model, tmp_path / "hf", "hf-block", (24, 40))
    common = dict(device="cpu", dtype="float32", max_num_seqs=16, block_size=8)
    common.update(quantization="fp8_emulated")
    prompts = [[5, 6, 7, 8, 9], list(range(40, 75)), [3] * 17]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tp1 = LLM(str(tmp_path / "hf"), **common)
    outs = tp1.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    prefixes = [
        p + o.outputs[0].token_ids[:n]
        for p, o in zip(prompts, outs, strict=True)
        for n in range(len(o.outputs[0].token_ids))
    ]
    one_token = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ref = tp1.generate(prompt_token_ids=prefixes, sampling_params=one_token, use_tqdm=False)
    tp2 = LLM(str(tmp_path / "hf"), tensor_parallel_size=2, **common)
    try:
        got = tp2.generate(prompt_token_ids=prefixes, sampling_params=one_token, use_tqdm=False)
        one = tp1.engine.runner.model.model.layers[1]
        two = tp2.engine.runner.model.model.layers[1]  # rank 0's half
        q, kv = 64, 32
        rows = torch.cat([torch.arange(0, q // 2), q + torch.arange(0, kv // 2),
                          q + kv + torch.arange(0, kv // 2)])  # fmt: skip
        for attr in ("weight", "weight_scale"):
            a = getattr(one.self_attn.qkv_proj, attr)[rows]
            assert torch.equal(getattr(two.self_attn.qkv_proj, attr).float(), a.float())
        down_one, down_two = one.mlp.down_proj, two.mlp.down_proj
        assert torch.equal(down_two.weight.float(), down_one.weight[:, :64].float())
        assert torch.equal(down_two.weight_scale, down_one.weight_scale)
    finally:
        tp2.engine.shutdown()
    float_out = LLM(str(float_model), **{**common, "quantization": None}).generate(
        prompt_token_ids=prefixes, sampling_params=one_token, use_tqdm=False
    )
    tp_agree, tp_worst = _compare_next_tokens(ref, got)
    fp8_agree, fp8_worst = _compare_next_tokens(ref, float_out)
    print(
        f"next tokens, teacher-forced, {len(ref)} positions: TP=2 vs TP=1 FP8 {tp_agree} agree, "
        f"|d logprob| <= {tp_worst:.3f}; TP=1 FP8 vs float32 {fp8_agree} agree, "
        f"|d logprob| <= {fp8_worst:.3f}"
    )
    # the TP split moves the outputs less than FP8 itself does (a near-uniform random model)
    assert tp_agree >= 0.85 * len(ref) and tp_worst < fp8_worst


def _compare_next_tokens(ref, got) -> tuple[int, float]:
    """-> (positions whose greedy token agrees, largest |logprob difference| of a top-5
    token both runs report)."""
    agree, worst = 0, 0.0
    for r, g in zip(ref, got, strict=True):
        agree += g.outputs[0].token_ids == r.outputs[0].token_ids
        ref_lp, got_lp = r.outputs[0].logprobs[0], g.outputs[0].logprobs[0]
        for t in set(ref_lp) & set(got_lp):
            worst = max(worst, abs(ref_lp[t] - got_lp[t]))
    return agree, worst


def _write_config(tmp_path: Path, float_model: Path, qc: dict) -> Path:
    d = tmp_path / "bad"
    d.mkdir()
    config = json.loads((float_model / "config.json").read_text())
    config["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").symlink_to(float_model / "model.safetensors")
    return d


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "bitsandbytes"}, "unsupported quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "unsupported block size"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "unsupported block size"),
        ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme 'weird'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}},
            },
            "compressed-tensors format 'nvfp4-pack-quantized'",
        ),  # fmt: skip
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "only FP8 (num_bits 8, type 'float')",
        ),  # fmt: skip
    ],
)
def test_unsupported_quantization_configs(float_model, tmp_path, qc, message):
    d = _write_config(tmp_path, float_model, qc)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(d, quantization="fp8_emulated")


def test_scaled_mm_shapes_checked_at_construction():
    from torch import nn

    from pydaemon.quantization.fp8 import Fp8LinearMethod

    with pytest.raises(ValueError, match=r"multiples of 16.*\[out 100, in 64\]"):
        Fp8LinearMethod(emulate=False).create_weights(nn.Module(), 100, 64)
    Fp8LinearMethod(emulate=True).create_weights(nn.Module(), 100, 64)  # emulation: any shape


def test_fp8_refused_on_cpu_with_the_reason(float_model, tmp_path):
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*runs on cpu"):
        load_model(float_model, quantization="fp8")
    # an FP8 checkpoint runs FP8 without being asked: the CPU refuses it too, saying why
    write_fp8_checkpoint(float_model, tmp_path / "ct", "ct-channel")
    with pytest.raises(ValueError, match="this checkpoint is FP8-quantized.*fp8_emulated"):
        load_model(tmp_path / "ct")
    with pytest.raises(ValueError, match="EngineConfig.quantization"):
        EngineConfig(quantization="int8")


def test_fp8_checkpoint_tensor_errors(float_model, tmp_path):
    from safetensors.torch import save_file

    written = write_fp8_checkpoint(float_model, tmp_path / "hf", "hf-block", (32, 48))
    scales = tmp_path / "hf" / "model-00002-of-00002.safetensors"
    tensors = load_file(str(scales))
    name = next(iter(written)).removesuffix(".weight") + ".weight_scale_inv"
    tensors[name] = torch.ones(1, 1)  # the wrong number of blocks
    save_file(tensors, str(scales))
    with pytest.raises(
        ValueError,
        match=r"expected \[2, 3\]: the scales of a \[64, 128\] weight in blocks of \[32, 48\]",
    ):
        load_model(tmp_path / "hf", quantization="fp8_emulated")
    del tensors[name]  # an FP8 weight without its scale
    save_file(tensors, str(scales))
    with pytest.raises(ValueError, match="is FP8 but has no scale"):
        load_model(tmp_path / "hf", quantization="fp8_emulated")
