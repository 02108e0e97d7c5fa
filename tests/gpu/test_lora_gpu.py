"""Multi-LoRA on a GPU: requests of four PEFT adapters and of the base model in one batch,
eager and through CUDA graphs (the graphs hold every slot; the step's slot indices are a
device buffer): float32 tokens equal transformers + PEFT's, and bf16 with the pagedd kernels
follows float32 PEFT's argmax (teacher-forced gaps)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import gaps_to_fp32_argmax  # noqa: E402
from lora_utils import ALL_TARGETS, peft_greedy, save_peft_adapter  # noqa: E402
from model_utils import save_hf_model  # noqa: E402

from pydaemon import LLM, LoRARequest, SamplingParams  # noqa: E402
from pydaemon._core import Device  # noqa: E402

pytest.importorskip("peft", reason="the reference is transformers + PEFT: pip install peft")

MAX_NEW = 16
ADAPTERS = [
    dict(rank=8, targets=ALL_TARGETS),
    dict(rank=4, targets=["q_proj", "v_proj"]),
    dict(rank=16, targets=["gate_proj", "down_proj", "o_proj"], use_rslora=True),
    dict(rank=2, targets=["k_proj", "up_proj"], lora_alpha=4.0),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-gpu")
    # head_dim 64 (a kernel head size), GQA 8 over 2
    model_dir = save_hf_model(
        tmp, "llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=512, initializer_range=0.05,
    )  # fmt: skip
    loras = [
        LoRARequest(f"a{i}", i + 1, str(save_peft_adapter(model_dir, tmp / f"a{i}", seed=i, std=0.05, **s)))
        for i, s in enumerate(ADAPTERS)
    ]  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 3, 90, 17, 6, 33, 64)]
    choice = [loras[0], None, loras[1], loras[2], loras[3], loras[0], None, loras[2]]
    expected = [
        peft_greedy(model_dir, None if c is None else c.lora_path, [p], MAX_NEW)[0]
        for p, c in zip(prompts, choice, strict=True)
    ]
    return model_dir, prompts, choice, expected


def _run(model_dir, prompts, choice, **kwargs):
    llm = LLM(str(model_dir), device="cuda", num_kv_blocks=256, enable_lora=True, max_loras=8,
              max_lora_rank=16, max_num_seqs=16, **kwargs)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=choice)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)
    return llm, [o.outputs[0].token_ids for o in outs]


def _base_only(llm, prompts) -> list[list[int]]:
    """Base-model requests alone, after adapters' steps (graphs read the slot buffer anyway)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                         sampling_params=params)]  # fmt: skip


def test_float32_mixed_adapters_equal_peft(setup):
    """Float32 runs eagerly (the attention kernels and their CUDA graphs are 16-bit only): the
    graphs are covered by the bf16 test below."""
    model_dir, prompts, choice, expected = setup
    llm, got = _run(model_dir, prompts, choice, dtype="float32")
    assert got == expected
    base = [i for i, c in enumerate(choice) if c is None]
    assert _base_only(llm, [prompts[i] for i in base]) == [expected[i] for i in base]
    assert llm.engine.runner.cuda_graphs is None


def test_bf16_with_kernels_follows_peft_fp32(setup):
    import peft
    import transformers

    model_dir, prompts, choice, _ = setup
    llm, got = _run(model_dir, prompts, choice, dtype="bfloat16")
    assert llm.engine.runner.cuda_graphs.num_replays > 0  # adapters' decode steps in graphs
    gaps = []
    for lora in {c for c in choice}:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora is not None:
            hf = peft.PeftModel.from_pretrained(hf, lora.lora_path)
        hf = hf.to("cuda").eval()
        for p, c, tokens in zip(prompts, choice, got, strict=True):
            if c is lora:
                gaps.append(gaps_to_fp32_argmax(hf, p, tokens))
    gaps = torch.cat(gaps)
    # bf16 follows float32's argmax except at near-ties (gap < 10% of a logit std).
    assert float(gaps.max()) < 0.1, f"largest gap {float(gaps.max()):.3f} logit std"
    assert float((gaps == 0).float().mean()) > 0.85
