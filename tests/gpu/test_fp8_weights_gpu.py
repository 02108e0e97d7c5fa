"""FP8 weights on CUDA (sm_89+): the torch._scaled_mm path against the emulated one, the
default model (SmolLM2-135M) in FP8 against bf16, and pre-quantized checkpoints.

Figures are printed (run with ``-s``) and recorded as properties. Skipped below sm_89, where
``quantization="fp8"`` is refused (tested on the CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import make_hf_model  # noqa: E402
from fp8_utils import PASSAGE, fp8_weight, write_fp8_checkpoint  # noqa: E402
from model_utils import Seq, SimpleAllocator, build_step, make_kv_cache  # noqa: E402

from pydaemon import LLM, SamplingParams, ops  # noqa: E402
from pydaemon.model_loader.loader import load_model  # noqa: E402
from pydaemon.quantization.fp8 import (  # noqa: E402
    Fp8LinearMethod,
    emulated_scaled_mm,
    quantize_per_channel,
    quantize_per_token,
    quantize_per_token_native,
    scaled_mm,
)

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability 8.9+", allow_module_level=True)

BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens, d", [(1, 64), (7, 4096), (300, 14336), (5, 100)])
def test_per_token_kernel_is_the_torch_code_bit_for_bit(dtype, num_tokens, d):
    gen = torch.Generator(device="cuda").manual_seed(d + num_tokens)
    spread = torch.logspace(-3, 2, num_tokens, device="cuda")[:, None]
    # rows strided (a slice of a wider tensor); d = 100 takes the scalar path
    x = (torch.randn(num_tokens, d + 8, device="cuda", generator=gen) * spread)[:, :d]
    x = x.to(dtype)
    if num_tokens > 1:
        x[1] = 0.0
    xq, scale = ops.per_token_fp8_quant(x)
    ref_q, ref_scale = quantize_per_token_native(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (num_tokens, 1)
    # (torch computes 448 / amax as amax.reciprocal() * 448: the kernel must round the same
    # way, or the scale and the codes next to a rounding midpoint differ now and then.)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8))
    nonzero = x.float().abs().amax(dim=1) > 0
    assert torch.equal(scale[nonzero], ref_scale[nonzero])
    assert bool((scale[~nonzero] < 1e-11).all()) and not bool(xq.float()[~nonzero].any())


def _same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    assert got[0].dtype == torch.float8_e4m3fn and got[1].shape == want[1].shape
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 4096), (300, 4096), (5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_rms_norm_then_per_token_quant_bit_for_bit(
    dtype, num_tokens, hidden, with_residual
):
    gen = torch.Generator(device="cuda").manual_seed(hidden + num_tokens)
    spread = torch.logspace(-2, 2, num_tokens, device="cuda")[:, None]
    x = (torch.randn(num_tokens, hidden, device="cuda", generator=gen) * spread).to(dtype)
    residual = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype)
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype)
    if with_residual:
        res_ref, res_fused = residual.clone(), residual.clone()
        want = ops.per_token_fp8_quant(ops.fused_add_rms_norm(x, res_ref, weight, 1e-5))
        got = ops.rms_norm_fp8_quant(x, weight, 1e-5, res_fused)
        assert torch.equal(res_fused, res_ref)  # the residual sum is stored as before
    else:
        want = ops.per_token_fp8_quant(ops.rms_norm(x, weight, 1e-5))
        got = ops.rms_norm_fp8_quant(x, weight, 1e-5)
    _same_fp8(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens, d", [(1, 64), (7, 14336), (300, 1792), (5, 100)])
def test_silu_and_mul_fp8_is_silu_and_mul_then_per_token_quant_bit_for_bit(dtype, num_tokens, d):
    gen = torch.Generator(device="cuda").manual_seed(d + num_tokens)
    spread = torch.logspace(-2, 1, num_tokens, device="cuda")[:, None]
    # rows strided (a slice of a wider tensor); d = 100 takes the scalar path
    x = (torch.randn(num_tokens, 2 * d + 16, device="cuda", generator=gen) * spread)[:, : 2 * d]
    x = x.to(dtype)
    _same_fp8(ops.silu_and_mul_fp8_quant(x), ops.per_token_fp8_quant(ops.silu_and_mul(x)))


def test_fused_fp8_ops_reject_bad_arguments():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4, 64, device="cuda", dtype=torch.uint8)
    scale = torch.empty(4, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(TypeError, match="out"):
        ops.core().rms_norm_fp8(out.view(torch.int8), scale, x, w, 1e-5, stream)
    with pytest.raises(ValueError, match="scale"):
        ops.core().rms_norm_fp8(out, scale[:3], x, w, 1e-5, stream)
    with pytest.raises(TypeError, match="scale"):
        ops.core().silu_and_mul_fp8(out[:, :32], scale.double(), x, stream)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("n, k", [(128, 64), (6144, 4096), (4096, 14336), (28672, 4096)])
def test_scaled_mm_matches_emulation(num_tokens, n, k):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens * 7 + n)
    x = torch.randn(num_tokens, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    xq, x_scale = quantize_per_token(x)
    wq, w_scale = quantize_per_channel(w)
    got = scaled_mm(xq, x_scale, wq, w_scale)  # [T, N] bf16
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, n)
    ref = emulated_scaled_mm(xq, x_scale, wq, w_scale)  # float32: exact products
    # bf16 output rounding (2^-9 relative) plus the tensor cores' accumulation (its error
    # scales with sum |products|, so it shows on the outputs that cancel to near zero)
    err = (got.float() - ref).abs()
    typical = ref.abs().mean()
    bound = ref.abs() * 2**-8 + typical * 2e-2
    worst = (err / typical).max().item()
    assert bool((err <= bound).all()), f"max error {worst:.3e} of the mean |output|"


def test_fp8_linear_method_real_against_emulated():
    layer = torch.nn.Module()
    method, emulated = Fp8LinearMethod(emulate=False), Fp8LinearMethod(emulate=True)
    w = torch.randn(512, 256, device="cuda") * 0.05
    wq, scale = quantize_per_channel(w)
    layer.weight, layer.weight_scale = (
        torch.nn.Parameter(wq, False),
        torch.nn.Parameter(scale, False),
    )
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        # a non-contiguous input, as attention outputs and qkv slices can be
        x = torch.randn(33, 512, device="cuda", dtype=dtype)[:, ::2]
        got, ref = method.apply(layer, x, bias.to(dtype)), emulated.apply(layer, x, bias.to(dtype))
        assert got.dtype == dtype and got.shape == (33, 512)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


@torch.inference_mode()
def _all_logits(model, tokens: list[int]) -> torch.Tensor:
    num_blocks = len(tokens) // BLOCK_SIZE + 1
    seq = Seq(list(tokens))
    SimpleAllocator(num_blocks).ensure(seq, len(tokens), BLOCK_SIZE)
    ids, pos, md = build_step([seq], [len(tokens)], 1, BLOCK_SIZE, device="cuda")
    hidden = model(ids, pos, make_kv_cache(model, num_blocks, BLOCK_SIZE), md)
    return model.compute_logits(hidden)


def _compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, float]:
    ref_lp, got_lp = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    return kl.mean().item(), kl.max().item(), agree.item()


def _default_model() -> Path:
    from pydaemon.model_loader.default_model import default_model_path

    try:
        return default_model_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_logits():
    """SmolLM2-135M's logits over PASSAGE: bf16, FP8 through torch._scaled_mm, FP8 emulated."""
    path = _default_model()
    from pydaemon.tokenizer.loader import load_tokenizer

    tokens = load_tokenizer(path).encode(PASSAGE)
    logits = {}
    for name, quantization in (("bf16", None), ("fp8", "fp8"), ("emulated", "fp8_emulated")):
        model, _ = load_model(path, dtype="bfloat16", device="cuda", quantization=quantization)
        if name == "fp8":
            qkv = model.model.layers[0].self_attn.qkv_proj
            assert qkv.weight.dtype == torch.float8_e4m3fn and not qkv.quant_method.emulate
        logits[name] = _all_logits(model, tokens)
        del model
    return logits


def test_smollm2_fp8_logits_against_bf16(smollm2_logits, record_property):
    figures = _compare(smollm2_logits["bf16"], smollm2_logits["fp8"])
    print(
        f"\nSmolLM2-135M on CUDA, FP8 (_scaled_mm) vs bf16: mean KL {figures[0]:.2e}, max KL "
        f"{figures[1]:.2e}, argmax agreement {figures[2]:.3f}"
    )
    record_property("fp8_vs_bf16", figures)
    assert figures[0] < 0.05 and figures[1] < 0.4 and figures[2] >= 0.88


@pytest.mark.xfail(
    strict=True,
    reason="measured on the H200 (2026-12-02, the first run with SmolLM2 there): _scaled_mm "
    "against the emulated FP8 path, mean KL 1.86e-2 and argmax agreement 0.904, ten times the "
    "bound: not understood yet (cuBLASLt's FP8 accumulation is the suspect; ops.fp8_gemv sums "
    "in float32 and can tell). Strict: the day it holds, this marker must go.",
)
def test_smollm2_scaled_mm_against_emulated_fp8(smollm2_logits, record_property):
    same = _compare(smollm2_logits["emulated"], smollm2_logits["fp8"])
    print(f"\n_scaled_mm vs emulated FP8: mean KL {same[0]:.2e}, agreement {same[2]:.3f}")
    record_property("scaled_mm_vs_emulated", same)
    assert same[0] < 2e-3 and same[2] >= 0.97


def test_llm_generate_fp8_follows_bf16(record_property):
    """FP8 greedy through the engine (kernels, paged KV): each FP8 token, teacher-forced,
    is bf16's argmax after the same prefix at most positions."""
    path = _default_model()
    questions = [
        "Explain how a refrigerator works, step by step.",
        "Describe the water cycle to a ten-year-old.",
        "What are the main differences between Python and C++?",
    ]
    llm = LLM(str(path), device="cuda", dtype="bfloat16", quantization="fp8", num_kv_blocks=256)
    tok = llm.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_bos=False)
        for q in questions
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    llm.engine.shutdown()
    bf16, _ = load_model(path, dtype="bfloat16", device="cuda")
    agree = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        logits = _all_logits(bf16, prompt + tokens)[len(prompt) - 1 : -1]
        agree += int((logits.argmax(-1).cpu() == torch.tensor(tokens)).sum())
        total += len(tokens)
    print(f"\nLLM.generate FP8: {agree}/{total} greedy tokens are bf16's argmax (teacher-forced)")
    record_property("fp8_tokens_bf16_argmax", agree / total)
    assert agree >= 0.85 * total


@pytest.mark.parametrize("fmt", ["hf-block", "ct-tensor", "ct-channel"])
def test_prequantized_checkpoint_loads_on_cuda(tmp_path, fmt):
    make_hf_model(tmp_path / "float", num_heads=4, num_kv_heads=2)
    written = write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", fmt)
    # FP8 because config.json says so (no quantization asked for): the _scaled_mm path
    gpu, _ = load_model(tmp_path / "fp8", device="cuda")
    cpu, _ = load_model(tmp_path / "fp8", quantization="fp8_emulated")
    assert not gpu.model.layers[0].mlp.gate_up_proj.quant_method.emulate
    for name in written:  # the same conversion on both devices
        assert torch.equal(fp8_weight(gpu, name).cpu(), fp8_weight(cpu, name)), name
    llm = LLM(str(tmp_path / "fp8"), device="cuda", num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=greedy, use_tqdm=False)
    llm.engine.shutdown()
    assert len(out.outputs[0].token_ids) == 8


def test_fused_norm_and_activation_quantization_give_the_unfused_logits(tmp_path, monkeypatch):
    """The model on CUDA: RMSNorm and SiLU-and-multiply quantize their outputs in their own
    kernels for the FP8 layers after them; the logits are those of the separate kernels."""
    from pydaemon.models import llama

    make_hf_model(tmp_path, num_heads=4, num_kv_heads=2)
    model, _ = load_model(tmp_path, dtype="bfloat16", device="cuda", quantization="fp8")
    tokens = list(range(3, 80))
    fused = _all_logits(model, tokens)
    monkeypatch.setattr(llama, "takes_fp8_input", lambda layer: False)
    assert torch.equal(fused, _all_logits(model, tokens))
