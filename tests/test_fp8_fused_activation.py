"""FP8 linear layers take their input quantized by the op before them (RMSNorm, SiLU-and-
multiply: ``fp8_out=True`` -> ``Fp8Activation``), in one kernel on CUDA. On the CPU the ops
quantize with the torch code, so the fused path must give exactly the unfused one's numbers;
the kernels are checked bit for bit in tests/gpu/test_fp8_weights_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.layers.activation import SiluAndMul
from pydaemon.layers.rms_norm import RMSNorm
from pydaemon.model_loader.loader import load_model
from pydaemon.models import llama
from pydaemon.quantization.fp8 import Fp8Activation, quantize_per_token

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402
from model_utils import Seq, SimpleAllocator, build_step, make_kv_cache  # noqa: E402

BLOCK_SIZE = 16


def _same(a: Fp8Activation, xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    assert isinstance(a, Fp8Activation) and a.dtype == dtype
    assert torch.equal(a.xq.view(torch.uint8), xq.view(torch.uint8))
    assert torch.equal(a.scale, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_fp8_out_is_the_norm_then_per_token_quantization(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 64, dtype=dtype) * 3
    residual = torch.randn(5, 64, dtype=dtype)
    _same(norm(x, fp8_out=True), *quantize_per_token(norm(x)), dtype)
    out, new_residual = norm(x, residual, fp8_out=True)
    ref, ref_residual = norm(x, residual)
    _same(out, *quantize_per_token(ref), dtype)
    assert torch.equal(new_residual, ref_residual)


def test_silu_and_mul_fp8_out_is_the_product_then_per_token_quantization():
    x = torch.randn(7, 2 * 48, dtype=torch.bfloat16) * 4
    _same(SiluAndMul()(x, fp8_out=True), *quantize_per_token(SiluAndMul()(x)), torch.bfloat16)


@torch.inference_mode()
def _logits(model, tokens: list[int]) -> torch.Tensor:
    num_blocks = len(tokens) // BLOCK_SIZE + 1
    seq = Seq(list(tokens))
    SimpleAllocator(num_blocks).ensure(seq, len(tokens), BLOCK_SIZE)
    ids, pos, md = build_step([seq], [len(tokens)], 1, BLOCK_SIZE)
    return model.compute_logits(model(ids, pos, make_kv_cache(model, num_blocks, BLOCK_SIZE), md))


def test_fp8_model_fused_quantization_gives_the_unfused_logits(tmp_path, monkeypatch):
    make_hf_model(tmp_path, num_heads=4, num_kv_heads=2)
    model, _ = load_model(tmp_path, dtype="bfloat16", quantization="fp8_emulated")
    tokens = [
        int(t) for t in torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(1))
    ]
    calls = {"norm": 0, "act": 0}
    norm_fp8, act_forward = RMSNorm._forward_fp8, SiluAndMul.forward

    def counting_norm(self, x, residual):
        calls["norm"] += 1
        return norm_fp8(self, x, residual)

    def counting_act(self, x, fp8_out=False):
        calls["act"] += fp8_out
        return act_forward(self, x, fp8_out)

    monkeypatch.setattr(RMSNorm, "_forward_fp8", counting_norm)
    monkeypatch.setattr(SiluAndMul, "forward", counting_act)
    fused = _logits(model, tokens)
    layers = len(model.model.layers)
    assert calls == {"norm": 2 * layers, "act": layers}  # both norms and the MLP, every layer
    monkeypatch.setattr(llama, "takes_fp8_input", lambda layer: False)
    unfused = _logits(model, tokens)
    assert calls == {"norm": 2 * layers, "act": layers}  # no fused call this time
    assert torch.equal(fused, unfused)


def test_unquantized_model_takes_no_fp8_path(tmp_path, monkeypatch):
    make_hf_model(tmp_path, num_heads=4, num_kv_heads=2)
    model, _ = load_model(tmp_path, dtype="bfloat16")

    def refuse(self, x, residual):
        raise AssertionError("an unquantized model must not quantize activations")

    monkeypatch.setattr(RMSNorm, "_forward_fp8", refuse)
    assert torch.isfinite(_logits(model, list(range(3, 30)))).all()
