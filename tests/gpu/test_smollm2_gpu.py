"""The default model (SmolLM2-135M-Instruct) in bfloat16 through the CUDA kernels against
float32: greedy over a few hundred tokens follows float32's argmax except at near-ties.

Two measures, printed (run with ``-s``) and recorded as properties for the report:
- teacher-forced: float32 transformers (the same GGUF file) is fed prompt + our bf16 tokens;
  at each position, the gap between float32's best logit and the logit of our token, in
  units of that position's logit standard deviation (0 = the same argmax);
- free-running: the length of the common prefix of our bf16 greedy tokens and float32's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_utils import transformers_gguf_model  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.layers.attention import uses_kernels  # noqa: E402
from pydaemon.model_loader.default_model import default_model_path  # noqa: E402

MAX_TOKENS = 300
QUESTIONS = [
    "Explain how a refrigerator works, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between Python and C++? Give examples.",
    "Describe the water cycle to a ten-year-old.",
]


@torch.no_grad()
def _gaps(hf32, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens], device="cuda")
    logits = hf32(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    return (logits.max(dim=-1).values - chosen) / logits.std(dim=-1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_bf16_kernels_follow_float32_greedy(record_property):
    try:
        path = default_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=512)
    assert uses_kernels(llm.engine.runner.kv_cache)
    tok = llm.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_bos=False)
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [
        o.outputs[0].token_ids
        for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    hf32, _ = transformers_gguf_model(path)
    hf32 = hf32.to("cuda")
    gaps = torch.cat([_gaps(hf32, p, o) for p, o in zip(prompts, outputs, strict=True)])
    prefixes = []
    for prompt, ours in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            ref = hf32.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None)
        prefixes.append(_common_prefix(ours, ref[0, len(prompt) :].tolist()))
    agreement = float((gaps == 0).float().mean())
    report = {
        "tokens": int(gaps.numel()),
        "argmax_agreement": round(agreement, 4),
        "max_gap_std": round(float(gaps.max()), 4),
        "free_running_common_prefix": prefixes,
    }
    for key, value in report.items():
        record_property(key, value)
    print(f"\nSmolLM2 bf16 (kernels) vs float32: {report}")
    # bf16 keeps 8 mantissa bits (and rounds the dequantized weights): a flip is allowed only
    # where float32 itself nearly ties. On the CPU torch path, bf16 over 2 x 64 tokens gave
    # agreement 0.98 and a largest gap of 0.03 std; a broken kernel gives gaps of whole stds.
    assert float(gaps.max()) < 0.1, report
    assert agreement > 0.9, report
