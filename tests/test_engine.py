"""The engine end to end on CPU: greedy equality with transformers, continuous batching,
blocks freed, and request validation."""

from __future__ import annotations

import pytest
from engine_utils import hf_greedy, make_hf_model, random_prompts

from pydaemon import LLM, SamplingParams
from pydaemon._core import Device
from pydaemon.generate_request import GenerateRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_gqa(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("llama_gqa"), num_heads=4, num_kv_heads=2)


def _free_all(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_greedy_batch_matches_transformers(llama_gqa, block_size):
    path, hf = llama_gqa
    prompts = random_prompts(5, 256, 3, 40, seed=block_size)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=block_size, num_kv_blocks=64)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
        assert out.outputs[0].finish_reason == "length"
    assert _free_all(llm)


@pytest.mark.parametrize("arch,heads,kv_heads", [("llama", 4, 4), ("qwen2", 4, 2)])
def test_other_shapes_match_transformers(tmp_path, arch, heads, kv_heads):
    path, hf = make_hf_model(tmp_path, arch=arch, num_heads=heads, num_kv_heads=kv_heads, seed=3)
    prompts = random_prompts(3, 256, 10, 33, seed=1)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=32)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)


def test_requests_added_while_others_run(llama_gqa):
    path, _ = llama_gqa
    prompts = random_prompts(6, 256, 5, 30, seed=7)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(GenerateRequest(f"r{i}", prompt, GREEDY))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)
        steps += 1
    assert finished == {f"r{i}" for i in range(len(prompts))}
    for i, ref in enumerate(alone):
        assert tokens[f"r{i}"] == ref.outputs[0].token_ids
    assert _free_all(llm)


def test_abort_frees_blocks_at_once(llama_gqa):
    path, _ = llama_gqa
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    engine.add_request(
        GenerateRequest("a", list(range(3, 60)), SamplingParams(temperature=0, max_tokens=100))
    )
    engine.step()
    engine.step()
    assert not _free_all(llm)
    assert engine.abort_request("a") is True
    assert _free_all(llm)
    assert engine.abort_request("a") is False
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([], "empty"),
        ([5, 300], "is out of vocabulary"),
        ([-1], "is out of vocabulary"),
        (list(range(3, 200)) * 3, "context"),
    ],
)
def test_bad_prompts_are_rejected(llama_gqa, prompt, match):
    path, _ = llama_gqa
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(GenerateRequest("x", prompt, GREEDY))
    assert not llm.engine.has_unfinished_requests()


def test_prompt_larger_than_cache_and_duplicates(llama_gqa):
    path, _ = llama_gqa
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.engine.add_request(GenerateRequest("x", list(range(3, 60)), GREEDY))
    llm.engine.add_request(GenerateRequest("y", [5, 6, 7], GREEDY))
    with pytest.raises(ValueError, match="already running"):
        llm.engine.add_request(GenerateRequest("y", [5, 6, 7], GREEDY))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.engine.add_request(GenerateRequest("z", "text prompt", GREEDY))


def test_demo_model_text_round_trip():
    llm = LLM("demo", device="cpu")
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12))[0]
    completion = out.outputs[0]
    assert 1 <= len(completion.token_ids) <= 12
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == 12
    ids = llm.tokenizer.encode("The quick brown fox")
    assert out.prompt_token_ids == ids
    full = llm.tokenizer.decode(ids + completion.token_ids)
    assert full.endswith(completion.text)


def test_seeded_sampling_is_reproducible(llama_gqa):
    path, _ = llama_gqa
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    prompts = random_prompts(3, 256, 5, 12, seed=2)
    first = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    # Same seed, different batch around it: the same tokens.
    second = llm.generate(prompt_token_ids=prompts[::-1], sampling_params=params)[::-1]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    other = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
    )
    assert [o.outputs[0].token_ids for o in other] != [o.outputs[0].token_ids for o in first]
