"""An FP8 engine with one of scaled_mm's small-batch paths on, against the emulated FP8 path
(the same FP8 operands, exact float32 sums): shared by the GPU tests of those paths."""

from __future__ import annotations

from engine_utils import make_hf_model

from pydaemon import LLM, SamplingParams
from pydaemon.quantization import fp8


def assert_decodes_as_emulated(tmp_path, monkeypatch, switch: str, bound: int, tol: float):
    """Greedy outputs of an engine with ``fp8.<switch> = bound`` follow the emulated engine's
    log-probabilities within ``tol`` nats up to where a sequence's tokens differ, and they
    differ only where the reference's top two are within ``tol``."""
    path, _ = make_hf_model(tmp_path, num_heads=4, num_kv_heads=2)
    prompts = [[5 + i, 9, 17 + 2 * i, 33] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = []
    for quantization, value in (("fp8_emulated", 0), ("fp8", bound)):
        monkeypatch.setattr(fp8, switch, value)
        llm = LLM(str(path), device="cuda", dtype="bfloat16", quantization=quantization,
                  num_kv_blocks=64)  # fmt: skip
        runs.append(
            [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        )
        del llm
    for i, (ref, got) in enumerate(zip(*runs, strict=True)):
        for pos, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
            ref_lp, got_lp = ref.logprobs[pos], got.logprobs[pos]
            if a != b:
                top2 = sorted(ref_lp.values(), reverse=True)[:2]
                assert top2[0] - top2[1] < tol, (
                    f"sequence {i} left the reference at token {pos} ({b} for {a}) where "
                    f"the reference's top two differ by {top2[0] - top2[1]:.3f} nats"
                )
                break
            assert abs(ref_lp[a] - got_lp[a]) < tol, (
                f"sequence {i}, token {pos}: log-probability {got_lp[a]:.4f} against "
                f"{ref_lp[a]:.4f}"
            )
