"""FP8 weights against the unquantized model, on the CPU (emulated FP8 GEMMs): the logits of
a few hundred teacher-forced tokens, as KL divergence and greedy (argmax) agreement.

Two models: a tiny random Llama, and the trained SmolLM2-135M (the default model's GGUF,
dequantized, then FP8 at load) on an English passage. Both models compute the logits of
every position in one prefill. The figures are printed (``pytest -s``) and bounded. A random model's next-token distributions are far
flatter than a trained one's (top-1 probability ~0.05 here against ~0.7), so its argmax
flips under much smaller logit noise: its agreement figure is low by nature.

Why the FP8 figures depend on the machine, and which ones the tests bound. ATen picks its CPU
kernels by instruction set (``ATEN_CPU_CAPABILITY``: default, avx2, avx512); the CPU
flash-attention kernel behind ``scaled_dot_product_attention`` (its vectorised exp, its
blocking) then differs in the last bit of float32 from one to another. The float32 model
absorbs that (its logits move by < 1e-4), the FP8 model does not: per-token FP8 activations
round to 3 mantissa bits, so a value one float32 ulp from an e4m3 rounding midpoint moves by a
whole step (1/16) when the ulp changes, and 30 layers compound those flips. The emulated GEMM
itself is not the cause (FP8 x FP8 products are exact, its outputs were bit-identical across
the three kernel sets), nor the float -> e4m3 cast (round-to-nearest-even everywhere).
Measured on SmolLM2 (one AMD EPYC with AVX-512, forcing each kernel set; then nudging one
float32 ulp into random embedding elements, 8 seeds): argmax agreement 0.866 (avx2: the
figures the issue reported from an AVX2 machine, max KL 0.224), 0.900 (avx512), 0.916
(default), 0.874-0.929 over the seeds, so a bound of 0.88 on it passed or failed by machine.
Stable across all of them: the mean KL (0.0237-0.0263) and the agreement where float32's top
token leads by more than 0.5 nats (0.981-1.0, 156 of 239 positions). Those are bounded with
margin; the whole-passage agreement and the largest KL only loosely (a broken FP8 path, wrong
scales say, sends the mean KL past 1 and the agreement near 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.model_loader.loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402
from fp8_utils import PASSAGE  # noqa: E402
from model_utils import Seq, SimpleAllocator, build_step, make_kv_cache  # noqa: E402

BLOCK_SIZE = 16
# Positions where the reference's top token leads by more than this (nats) keep their argmax
# under FP8 whatever the CPU's kernels (a near-tie flips with the last bit of float32).
CONFIDENT_MARGIN = 0.5


@torch.inference_mode()
def _all_logits(model, tokens: list[int]) -> torch.Tensor:
    """-> [len(tokens), vocab] float32: the logits after each prefix, in one prefill."""
    num_blocks = len(tokens) // BLOCK_SIZE + 1
    seq = Seq(list(tokens))
    SimpleAllocator(num_blocks).ensure(seq, len(tokens), BLOCK_SIZE)
    ids, pos, md = build_step([seq], [len(tokens)], 1, BLOCK_SIZE)
    hidden = model(ids, pos, make_kv_cache(model, num_blocks, BLOCK_SIZE), md)
    return model.compute_logits(hidden)


def _compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, float]:
    """-> (mean KL(ref || got), largest per-position KL, argmax agreement)."""
    ref_lp, got_lp = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1)  # [T]
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    return kl.mean().item(), kl.max().item(), agree.item()


def _top_margin(logits: torch.Tensor) -> torch.Tensor:
    """[T]: how far each position's most likely token leads the second, in nats."""
    top2 = logits.double().log_softmax(-1).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def _report(what: str, num_tokens: int, figures: tuple[float, float, float]) -> None:
    mean_kl, max_kl, agree = figures
    print(
        f"\n{what}, {num_tokens} positions: mean KL {mean_kl:.2e}, max KL {max_kl:.2e}, "
        f"argmax agreement {agree:.3f}"
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_llama_fp8_against_unquantized(tmp_path, dtype):
    make_hf_model(tmp_path / "m", hidden_size=256, num_heads=4, num_kv_heads=2,
                  vocab_size=512, seed=1)  # fmt: skip
    tokens = torch.randint(3, 512, (320,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _all_logits(load_model(tmp_path / "m", dtype=dtype)[0], tokens)
    fp8 = load_model(tmp_path / "m", dtype=dtype, quantization="fp8_emulated")[0]
    figures = _compare(ref, _all_logits(fp8, tokens))
    _report(f"random Llama, FP8 vs {dtype}", len(tokens), figures)
    mean_kl, max_kl, agree = figures
    assert mean_kl < 0.05 and max_kl < 0.2 and agree >= 0.6


def test_smollm2_fp8_against_float32():
    from pydaemon.model_loader.default_model import default_model_path
    from pydaemon.tokenizer.loader import load_tokenizer

    try:
        path = default_model_path()
    except ValueError as e:  # pragma: no cover - the setup script installs it
        pytest.skip(str(e))
    tokens = load_tokenizer(path).encode(PASSAGE)
    ref = _all_logits(load_model(path, dtype="float32")[0], tokens)
    fp8 = _all_logits(load_model(path, dtype="float32", quantization="fp8_emulated")[0], tokens)
    figures = _compare(ref, fp8)
    # (bf16 vs float32 here, measured once: mean KL 1.1e-03, max 5.4e-03, agreement 0.958)
    _report("SmolLM2-135M, FP8 vs float32", len(tokens), figures)
    mean_kl, max_kl, agree = figures
    confident = _top_margin(ref) > CONFIDENT_MARGIN
    agree_confident = (ref.argmax(-1) == fp8.argmax(-1))[confident].double().mean().item()
    print(
        f"argmax agreement where float32 leads by > {CONFIDENT_MARGIN} nats: "
        f"{agree_confident:.3f} ({int(confident.sum())} positions)"
    )
    # Bounds far from every figure measured on any kernel set (module docstring).
    assert mean_kl < 0.05 and agree_confident >= 0.95
    assert max_kl < 0.6 and agree >= 0.75
