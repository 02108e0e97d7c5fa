"""Multi-LoRA: greedy tokens equal transformers + PEFT's, with requests of four adapters
(several ranks, target sets, alpha, rslora) and of the base model in one batch (CPU,
float32), through the offline LLM: slots, the scheduler's adapter budget, the prefix cache."""

from __future__ import annotations

import random

import pytest
from lora_utils import ALL_TARGETS, peft_greedy, save_peft_adapter
from model_utils import save_hf_model

from pydaemon import LLM, LoRARequest, SamplingParams

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ADAPTERS = [
    dict(rank=8, targets=ALL_TARGETS),
    dict(rank=4, targets=["q_proj", "v_proj"]),
    dict(rank=16, targets=["gate_proj", "down_proj", "o_proj"], use_rslora=True),
    dict(rank=2, targets=["k_proj", "up_proj"], lora_alpha=4.0),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = save_hf_model(tmp, "llama")
    loras = [
        LoRARequest(f"a{i}", i + 1, str(save_peft_adapter(model_dir, tmp / f"a{i}", seed=i, **s)))
        for i, s in enumerate(ADAPTERS)
    ]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 9, 3, 12, 7, 6, 17, 4)]
    # Each prompt's adapter: all four and the base, two of them twice.
    choice = [loras[0], None, loras[1], loras[2], loras[3], loras[0], None, loras[2]]
    expected = {}
    for lora in [None, *loras]:
        mine = [i for i, c in enumerate(choice) if c is lora]
        path = None if lora is None else lora.lora_path
        for i, out in zip(
            mine, peft_greedy(model_dir, path, [prompts[i] for i in mine], MAX_NEW), strict=True
        ):
            expected[i] = out
    base = peft_greedy(model_dir, None, prompts, MAX_NEW)
    return model_dir, prompts, choice, [expected[i] for i in range(len(prompts))], base


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_loras=4),  # all four adapters in slots at once
        dict(max_loras=2, async_scheduling=True),  # slots churn: adapters back from host memory
        dict(max_loras=4, tensor_parallel_size=2),  # sharded A / B, delta before all-reduce
    ],
    ids=["4-slots", "2-slots-async", "tp2"],
)
def test_mixed_adapters_match_peft(setup, kwargs):
    model_dir, prompts, choice, expected, base = setup
    assert all(
        e != b for e, b, c in zip(expected, base, choice, strict=True) if c is not None
    )  # they act
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=96, enable_lora=True,
              max_lora_rank=16, **kwargs)  # fmt: skip
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=choice)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.engine.get_stats()
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    finally:
        llm.engine.shutdown()  # stops the tensor-parallel worker, if any


def test_prefix_cache_is_per_adapter(setup):
    """The same prompt under the base model, then an adapter, then the base model again:
    the adapter never reads the base model's cached KV (and vice versa)."""
    model_dir, prompts, _, _, base = setup
    prompt = prompts[6]  # 17 tokens: one full block of 16 to cache
    lora = LoRARequest("x", 7, str(model_dir.parent / "a0"))
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=96, enable_lora=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    adapted = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=lora)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    assert first.outputs[0].token_ids == base[6] == again.outputs[0].token_ids
    assert adapted[0].metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens == 16
    assert (
        adapted[0].outputs[0].token_ids
        == peft_greedy(model_dir, lora.lora_path, [prompt], MAX_NEW)[0]
    )


def test_bad_lora_requests_fail_before_any_block(setup, tmp_path):
    model_dir, prompts, choice, _, _ = setup
    params = SamplingParams(temperature=0.0, max_tokens=2)
    off = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        off.generate(prompt_token_ids=[prompts[0]], sampling_params=params, lora_request=choice[0])
    on = LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        enable_lora=True,
        max_lora_rank=8,
    )
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank"):
        on.generate(prompt_token_ids=[prompts[0]], sampling_params=params, lora_request=choice[3])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        on.generate(
            prompt_token_ids=[prompts[0]],
            sampling_params=params,
            lora_request=LoRARequest("missing", 9, str(tmp_path)),
        )
    other = save_hf_model(tmp_path, "llama", hidden_size=32, intermediate_size=64)
    wrong = save_peft_adapter(other, tmp_path / "wrong", rank=4, targets=["q_proj"], seed=0)
    with pytest.raises(ValueError, match="do not fit"):
        on.generate(
            prompt_token_ids=[prompts[0]],
            sampling_params=params,
            lora_request=LoRARequest("wrong", 10, str(wrong)),
        )
    stats = on.engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
