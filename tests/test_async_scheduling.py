"""Async scheduling on CPU (``async_scheduling=True`` runs the GPU's code path): the same
outputs as synchronous steps, token for token, for every feature; the fallbacks to
synchronous steps; blocks freed at once on abort, stop and finish; placeholders never hashed."""

from __future__ import annotations

import pytest
from engine_utils import hf_greedy, make_hf_model, random_prompts

from pydaemon import LLM, SamplingParams
from pydaemon._core import Device
from pydaemon.config.engine import EngineConfig
from pydaemon.core.messages import EngineCoreRequest

VOCAB = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("llama_async"), vocab_size=VOCAB)


def _llm(path, is_async: bool, **kwargs) -> LLM:
    kwargs = {"num_kv_blocks": 128, "block_size": 8, **kwargs}
    return LLM(str(path), device="cpu", dtype="float32", async_scheduling=is_async, **kwargs)


def _is_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)


def _completions(outputs) -> list[list[tuple]]:
    """Per request, per sequence: (token ids, finish reason, stop reason)."""
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def _both(path, prompts, params, eos_token_ids=None, **kwargs):
    """Runs the prompts with async scheduling off, then on: (sync outputs, async outputs,
    the async LLM). Both engines end with every block free."""
    results, llm = [], None
    for is_async in (False, True):
        llm = _llm(path, is_async, **kwargs)
        if eos_token_ids is not None:
            llm.engine.eos_token_ids = eos_token_ids
        results.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        assert _is_free(llm)
        assert not llm.engine.has_unfinished_requests()
    return results[0], results[1], llm


def _stepper(llm: LLM):
    return llm.engine.core.async_stepper


def test_flag_defaults_and_validation(model):
    path, _ = model
    assert _stepper(LLM(str(path), device="cpu", num_kv_blocks=16)) is None  # auto: off on CPU
    assert _stepper(_llm(path, True)) is not None
    # Allowed with tensor parallelism (tests/test_tensor_parallel_async.py), auto off there.
    assert EngineConfig(
        model="demo", async_scheduling=True, tensor_parallel_size=2
    ).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="demo", async_scheduling="yes")
    from pydaemon.entrypoints.cli import build_parser
    from pydaemon.entrypoints.daemon.settings import resolve

    for argv, want in (
        ([], None),
        (["--no-async-scheduling"], False),
        (["--async-scheduling"], True),
    ):
        engine_kwargs, _, _ = resolve(build_parser().parse_args(["serve", *argv]))
        assert engine_kwargs.get("async_scheduling") is want, argv


def test_greedy_and_lengths_match_sync(model):
    path, hf = model
    prompts = random_prompts(6, VOCAB, 3, 30, seed=1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 9, 17, 24)
    ]
    sync, asyn, llm = _both(path, prompts, params)
    assert _completions(asyn) == _completions(sync)
    assert [len(o.outputs[0].token_ids) for o in asyn] == [1, 2, 5, 9, 17, 24]
    assert asyn[4].outputs[0].token_ids == hf_greedy(hf, prompts[4], 17)
    stepper = _stepper(llm)
    assert stepper.num_overlapped_steps > 20  # decode steps overlapped
    assert stepper.in_flight is None


def test_chunked_prefills_beside_overlapped_decodes_match_sync(model):
    """A small token budget: long prompts prefill in chunks in the same steps as the decodes
    of others, whose tokens are placeholders."""
    path, _ = model
    prompts = random_prompts(6, VOCAB, 20, 60, seed=13)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 20) * 3]
    sync, asyn, llm = _both(path, prompts, params, max_num_batched_tokens=12, max_num_seqs=4)
    assert _completions(asyn) == _completions(sync)
    assert _stepper(llm).num_overlapped_steps > 20


def test_the_model_length_limit_matches_sync(model):
    """A sequence that reaches max_model_len still computes its last token in the step
    launched before its end was known: no write past the context, the same outputs."""
    path, _ = model
    prompts = random_prompts(4, VOCAB, 10, 28, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    sync, asyn, _ = _both(path, prompts, params, max_model_len=32)
    assert _completions(asyn) == _completions(sync)
    for prompt, out in zip(prompts, asyn, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert len(prompt) + len(out.outputs[0].token_ids) == 32


def test_seeded_sampling_penalties_and_logprobs_match_sync(model):
    path, _ = model
    prompts = random_prompts(5, VOCAB, 4, 20, seed=2)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=8, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(
            temperature=0.7, seed=9, max_tokens=16, frequency_penalty=1.0, repetition_penalty=1.3
        ),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.5, logprobs=2),
    ]
    sync, asyn, _ = _both(path, prompts, params)
    assert _completions(asyn) == _completions(sync)
    for a, s in zip(asyn, sync, strict=True):
        assert a.outputs[0].cumulative_logprob == pytest.approx(s.outputs[0].cumulative_logprob)
    for a, s in ((asyn[1], sync[1]), (asyn[4], sync[4])):
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids)
        for got, want in zip(a.outputs[0].logprobs, s.outputs[0].logprobs, strict=True):
            assert got.keys() == want.keys()
            assert list(got.values()) == pytest.approx(list(want.values()))


def test_penalties_see_the_token_sampled_one_step_before(model):
    """The step after a sample reads history that holds it only once its copy arrived: with
    penalties this strong the next token depends on it at every step."""
    path, _ = model
    prompts = random_prompts(6, VOCAB, 3, 8, seed=11)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=10.0, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=-2.0, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=2.0, ignore_eos=True),
    ] * 2
    sync, asyn, _ = _both(path, prompts, params)
    assert _completions(asyn) == _completions(sync)
    first = sync[0].outputs[0].token_ids
    assert len(set(first)) == len(first)  # the penalty bars every repeat


def _first_emitted(path, prompts, at: int) -> int:
    """A token the model emits at output position ``at`` of the first prompt (greedy)."""
    llm = _llm(path, False)
    out = llm.generate(
        prompt_token_ids=prompts[:1],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=at + 1, ignore_eos=True),
    )
    return out[0].outputs[0].token_ids[at]


def test_eos_stop_ids_and_min_tokens_match_sync(model):
    path, _ = model
    prompts = random_prompts(6, VOCAB, 4, 24, seed=3)
    eos = _first_emitted(path, prompts, 4)  # the first request meets EOS mid-run
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8),
        SamplingParams(temperature=0.8, seed=3, max_tokens=20, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[eos + 1, eos + 2]),
        SamplingParams(temperature=0.8, seed=4, max_tokens=20, stop_token_ids=[eos + 1]),
    ]
    sync, asyn, llm = _both(path, prompts, params, eos_token_ids=[eos])
    assert _completions(asyn) == _completions(sync)
    first = asyn[0].outputs[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == eos
    assert len(first.token_ids) <= 5  # it stopped before its max_tokens
    assert len(asyn[2].outputs[0].token_ids) >= 8  # min_tokens barred EOS
    assert _stepper(llm).num_overlapped_steps > 0


def test_stop_strings_match_sync():
    """Stop strings end sequences in the front end (finish_seq), a step or two after the
    core launched more work for them: no token after the stop, blocks freed."""
    prompts = ["The quick brown fox", "Once upon a time", "Hello world"]
    probe = LLM("demo", device="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in probe.generate(prompts, greedy)]
    stops = [t[len(t) // 3 : len(t) // 3 + 3] for t in texts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
        for stop in stops
    ]
    results = []
    for is_async in (False, True):
        llm = LLM("demo", device="cpu", async_scheduling=is_async)
        results.append(llm.generate(prompts, params))
        assert _is_free(llm)
    for a, s, stop in zip(results[1], results[0], stops, strict=True):
        assert (a.outputs[0].text, a.outputs[0].token_ids) == (
            s.outputs[0].text,
            s.outputs[0].token_ids,
        )
        assert a.outputs[0].finish_reason == "stop" and a.outputs[0].stop_reason == stop


def test_n_and_beam_search_fall_back_to_sync_steps(model):
    path, _ = model
    prompts = random_prompts(3, VOCAB, 4, 16, seed=4)
    params = [
        SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),  # ends first
    ]
    sync, asyn, llm = _both(path, prompts, params)
    assert _completions(asyn) == _completions(sync)
    stepper = _stepper(llm)
    assert stepper.num_overlapped_steps == 0 and stepper.num_sync_steps >= 10
    # Alone, the plain request overlaps again.
    llm.generate(prompt_token_ids=prompts[2:], sampling_params=params[2])
    assert stepper.num_overlapped_steps > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_cache_matches_sync(model, mode):
    path, hf = model
    prompts = random_prompts(6, VOCAB, 10, 20, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(num_kv_blocks=16, block_size=8, preemption_mode=mode, watermark=0.0)
    sync, asyn, llm = _both(path, prompts, params, **kwargs)
    assert _completions(asyn) == _completions(sync)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0
    stepper = _stepper(llm)
    assert stepper.num_overlapped_steps > 0 and stepper.num_sync_steps > 1
    for prompt, out in zip(prompts[:2], asyn[:2], strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)


def test_prefix_cache_holds_real_ids_not_placeholders(model):
    """Generated tokens fill blocks whose last token was a placeholder when its slot was
    taken: a new prompt equal to prompt + output hits every full block of it."""
    path, _ = model
    prompt = random_prompts(1, VOCAB, 13, 13, seed=6)[0]  # 13 tokens: blocks of 8 cross twice
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = _llm(path, True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
    before = llm.engine.get_stats().prefix_cache_hit_tokens
    again = prompt + first.token_ids  # 33 tokens: 4 full blocks, 3 of them hold outputs
    second = llm.generate(prompt_token_ids=[again], sampling_params=params)[0].outputs[0]
    assert llm.engine.get_stats().prefix_cache_hit_tokens - before == 32
    sync = _llm(path, False).generate(prompt_token_ids=[again], sampling_params=params)
    assert second.token_ids == sync[0].outputs[0].token_ids


def test_shared_prefixes_across_block_boundaries_match_sync(model):
    path, _ = model
    base = random_prompts(1, VOCAB, 19, 19, seed=7)[0]
    prompts = [base + random_prompts(1, VOCAB, k, k, seed=10 + k)[0] for k in (1, 5, 9, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    sync, asyn, llm = _both(path, prompts + prompts, params, max_num_seqs=2)
    assert _completions(asyn) == _completions(sync)
    assert _completions(asyn[:4]) == _completions(asyn[4:])
    assert llm.engine.get_stats().prefix_cache_hit_tokens > 0


def _core_request(request_id: str, prompt: list[int], params, eos: list[int]):
    return EngineCoreRequest(request_id, prompt, params, eos, arrival_time=0.0)


def test_core_never_emits_after_a_finish_or_abort(model):
    """At the core's own outputs (the front end would drop strays): requests that meet EOS or
    max_tokens while the next step is already launched, and one aborted mid-run."""
    path, _ = model
    llm = _llm(path, True)
    core = llm.engine.core
    prompts = random_prompts(4, VOCAB, 9, 15, seed=8)
    eos = _first_emitted(path, prompts, 3)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=8 + 6 * i)
        core.add_request(_core_request(str(i), prompt, params, [eos]))
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()

    def collect(outputs) -> None:
        for out in outputs.outputs:
            assert out.request_id not in finished, f"output after the finish of {out.request_id}"
            tokens.setdefault(out.request_id, []).extend(
                t for seq in out.seqs for t in seq.new_token_ids
            )
            if out.finished:
                finished.add(out.request_id)

    for _ in range(6):
        collect(core.step())
    assert core.async_stepper.in_flight is not None
    for request_id, end in (("3", core.abort_request), ("2", lambda r: core.finish_seq(r, 0))):
        # An abort, and a stop string matched by the front end: blocks freed at once.
        seq_ids = [s.seq_id for s in core.scheduler.requests[request_id].seqs]
        used = core.scheduler.block_manager.num_used_blocks(Device.GPU)
        assert end(request_id)
        finished.add(request_id)
        assert not any(core.scheduler.block_manager.has_seq(s) for s in seq_ids)
        assert core.scheduler.block_manager.num_used_blocks(Device.GPU) < used
        collect(core.step())
    while core.has_unfinished_requests():
        collect(core.step())
    assert finished == {"0", "1", "2", "3"}
    assert tokens["0"][-1] == eos and len(tokens["0"]) <= 4  # EOS mid-run
    assert len(tokens["1"]) <= 14 and len(tokens["2"]) < 20
    assert _is_free(llm)
    # Abort everything while a step is in flight: the engine drains it and idles clean.
    core.add_request(_core_request("4", prompts[0], SamplingParams(max_tokens=30), []))
    core.step()
    core.step()
    core.abort_request("4")
    assert core.has_unfinished_requests()  # the step in flight
    assert core.step().outputs == []
    assert not core.has_unfinished_requests() and _is_free(llm)
