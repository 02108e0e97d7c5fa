"""scaled_mm_swapped on the GPU: torch._scaled_mm with the operands swapped (the weight rows as
cuBLASLt's M, the few tokens padded to 16 as its N) against a float64 reference and against
the plain call, and an FP8 engine with the swap on decoding as the emulated FP8 path does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import make_hf_model  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.quantization import fp8  # noqa: E402

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 tensor cores need CUDA compute capability 8.9+", allow_module_level=True)


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_swapped_equals_plain_and_reference(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, k, device="cuda", generator=gen)).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    xq, x_scale = fp8.quantize_per_token(x)
    wq, w_scale = fp8.quantize_per_channel(w)
    got = fp8.scaled_mm_swapped(xq, x_scale, wq, w_scale)
    assert got.shape == (m, n) and got.is_contiguous() and got.dtype == torch.bfloat16
    ref = (xq.double() @ wq.double().t()) * x_scale.double().view(-1, 1) * w_scale.double()
    scale = float(ref.abs().mean())
    assert float((got.double() - ref).abs().max()) < 2e-2 * scale + 2**-8 * float(ref.abs().max())
    plain = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                             out_dtype=torch.bfloat16)  # fmt: skip
    assert float((got.float() - plain.float()).abs().max()) < 2e-2 * scale + 2**-8 * float(
        plain.float().abs().max()
    )


def test_engine_with_the_swap_decodes_as_the_emulated_path(tmp_path, monkeypatch):
    path, _ = make_hf_model(tmp_path, num_heads=4, num_kv_heads=2)
    prompts = [[5 + i, 9, 17 + 2 * i, 33] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = []
    for quantization, bound in (("fp8_emulated", 0), ("fp8", 64)):
        monkeypatch.setattr(fp8, "FP8_SWAP_AB_MAX_TOKENS", bound)
        llm = LLM(str(path), device="cuda", dtype="bfloat16", quantization=quantization,
                  num_kv_blocks=64)  # fmt: skip
        runs.append([o.outputs[0] for o in llm.generate(prompt_token_ids=prompts,
                                                         sampling_params=params)])  # fmt: skip
        del llm
    for i, (ref, got) in enumerate(zip(*runs, strict=True)):
        for pos, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
            if a != b:  # only where the reference's top two are (nearly) tied
                top2 = sorted(ref.logprobs[pos].values(), reverse=True)[:2]
                assert top2[0] - top2[1] < 0.1, f"sequence {i} left the reference at {pos}"
                break
            assert abs(ref.logprobs[pos][a] - got.logprobs[pos][a]) < 0.1, (i, pos)
