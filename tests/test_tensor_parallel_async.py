"""Async scheduling under tensor parallelism on CPU (2 ranks over gloo; this process is rank 0).

Rank 0 alone samples; the worker fills the placeholder tokens of overlapped steps from rank
0's sampled ids, broadcast to it. A wrong or missing id on the worker changes its half of the
embedding and of every all-reduce, so its outputs would differ: TP=2 with async scheduling
must give token for token the outputs of TP=1 and of TP=2 with synchronous steps (greedy,
seeded sampling, penalties, EOS mid-run, different lengths, chunked prefills beside overlapped
decodes), free an aborted request's blocks at once, and fall back to synchronous steps on
every rank for n > 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pydaemon._core import Device
from pydaemon.core.messages import EngineCoreRequest
from pydaemon.entrypoints.llm import LLM
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model, random_prompts  # noqa: E402

VOCAB = 255  # the last rank's vocabulary slice is padded
# A 16-token budget chunks the long prompts beside the decodes of others.
COMMON = dict(
    device="cpu",
    dtype="float32",
    max_num_seqs=4,
    block_size=8,
    max_num_batched_tokens=16,
    num_kv_blocks=48,
)
PROMPTS = random_prompts(6, VOCAB, 3, 40, seed=21)
EOS_PROMPT = 1  # the request that meets EOS mid-run


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20),  # meets EOS (EOS_PROMPT)
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=17, repetition_penalty=1.5, logprobs=2, ignore_eos=True
        ),
        SamplingParams(temperature=0.7, seed=9, max_tokens=24, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]


FORK_PROMPTS = PROMPTS[:2]
FORK_PARAMS = [
    SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
]
ABORT_PROMPTS = PROMPTS[2:5]
ABORT_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _completions(outputs) -> list[list[tuple]]:
    """Per request, per sequence: (token ids, finish reason)."""
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def _logprobs(outputs) -> list[float]:
    return [c.cumulative_logprob for o in outputs for c in o.outputs]


def _is_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)


def _run_all(llm: LLM, eos: int) -> dict:
    llm.engine.eos_token_ids = [eos]
    mixed = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_mixed_params())
    fork = llm.generate(prompt_token_ids=FORK_PROMPTS, sampling_params=FORK_PARAMS)
    abort = llm.generate(prompt_token_ids=ABORT_PROMPTS, sampling_params=ABORT_PARAMS)
    assert _is_free(llm)
    return {
        "mixed": _completions(mixed),
        "mixed_logprobs": _logprobs(mixed),
        "fork": _completions(fork),
        "abort": [o.outputs[0].token_ids for o in abort],
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(TP=1 results, TP=2 synchronous results, EOS id, a live TP=2 engine, async on)."""
    model_dir, _ = make_hf_model(
        tmp_path_factory.mktemp("tp_async") / "llama", num_heads=4, num_kv_heads=2, vocab_size=VOCAB
    )
    tp1 = LLM(str(model_dir), **COMMON)
    probe = tp1.generate(
        prompt_token_ids=[PROMPTS[EOS_PROMPT]],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    eos = probe[0].outputs[0].token_ids[4]  # emitted at output position 4 (or before)
    ref = _run_all(tp1, eos)
    tp2_sync = LLM(str(model_dir), tensor_parallel_size=2, **COMMON)  # auto: no async under TP
    assert tp2_sync.engine.core.async_stepper is None
    ref_tp2 = _run_all(tp2_sync, eos)
    tp2_sync.engine.shutdown()  # one tensor-parallel engine per process
    llm = LLM(str(model_dir), tensor_parallel_size=2, async_scheduling=True, **COMMON)
    llm.engine.eos_token_ids = [eos]
    yield ref, ref_tp2, eos, llm
    llm.engine.shutdown()


def _stepper(llm: LLM):
    return llm.engine.core.async_stepper


def test_mixed_sampling_matches_tp1_and_tp2_sync(engines):
    ref, ref_tp2, _, llm = engines
    # The baseline itself: TP=2 synchronous equals TP=1.
    for key in ("mixed", "fork", "abort"):
        assert ref_tp2[key] == ref[key], key
    assert ref_tp2["mixed_logprobs"] == pytest.approx(ref["mixed_logprobs"], rel=1e-4)
    stepper = _stepper(llm)
    before = stepper.num_overlapped_steps
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_mixed_params())
    got = _completions(outputs)
    assert got == ref["mixed"]
    assert _logprobs(outputs) == pytest.approx(ref["mixed_logprobs"], rel=1e-4)
    assert stepper.num_overlapped_steps - before > 20  # decodes ran on placeholders
    assert [len(got[i][0][0]) for i in (0, 2, 3, 5)] == [1, 14, 17, 30]
    eos_run = got[EOS_PROMPT][0]
    assert eos_run[1] == "stop" and len(eos_run[0]) <= 5  # EOS mid-run, before max_tokens
    assert _is_free(llm) and stepper.in_flight is None


def test_n_greater_than_one_falls_back_to_sync_steps_on_every_rank(engines):
    ref, _, _, llm = engines
    stepper = _stepper(llm)
    overlapped, synced = stepper.num_overlapped_steps, stepper.num_sync_steps
    got = llm.generate(prompt_token_ids=FORK_PROMPTS, sampling_params=FORK_PARAMS)
    assert _completions(got) == ref["fork"]
    assert len(got[0].outputs) == 2
    assert stepper.num_overlapped_steps == overlapped  # the n=2 request outlives the other
    assert stepper.num_sync_steps - synced >= 9
    assert _is_free(llm)


def test_abort_mid_run_frees_blocks_and_the_others_match(engines):
    ref, _, _, llm = engines
    core = llm.engine.core
    for i, prompt in enumerate(ABORT_PROMPTS):
        core.add_request(EngineCoreRequest(f"a{i}", prompt, ABORT_PARAMS, [], arrival_time=0.0))
    tokens: dict[str, list[int]] = {}
    aborted = False

    def collect(outputs) -> None:
        for out in outputs.outputs:
            assert out.request_id != "a1" or not aborted, "output after the abort"
            tokens.setdefault(out.request_id, []).extend(
                t for seq in out.seqs for t in seq.new_token_ids
            )

    for _ in range(8):
        collect(core.step())
    assert core.async_stepper.in_flight is not None  # aborted while a step runs on it
    seq_ids = [s.seq_id for s in core.scheduler.requests["a1"].seqs]
    used = core.scheduler.block_manager.num_used_blocks(Device.GPU)
    assert core.abort_request("a1")
    aborted = True
    assert not any(core.scheduler.block_manager.has_seq(s) for s in seq_ids)
    assert core.scheduler.block_manager.num_used_blocks(Device.GPU) < used
    while core.has_unfinished_requests():
        collect(core.step())
    assert tokens["a0"] == ref["abort"][0] and tokens["a2"] == ref["abort"][2]
    assert 0 < len(tokens["a1"]) < len(ref["abort"][1])
    assert tokens["a1"] == ref["abort"][1][: len(tokens["a1"])]
    assert _is_free(llm)
    # The engine goes on after the abort: the same outputs again.
    again = llm.generate(prompt_token_ids=ABORT_PROMPTS, sampling_params=ABORT_PARAMS)
    assert [o.outputs[0].token_ids for o in again] == ref["abort"]


def test_shutdown_with_a_step_in_flight_finishes_it_first(engines):
    """Runs last (it stops the shared engine): the workers are stopped after the step in
    flight, never under it."""
    _, _, _, llm = engines
    core = llm.engine.core
    core.add_request(EngineCoreRequest("s", PROMPTS[0], ABORT_PARAMS, [], arrival_time=0.0))
    for _ in range(3):
        core.step()
    assert core.async_stepper.in_flight is not None
    pids = [p.pid for p in core.executor.workers]
    llm.engine.shutdown()
    assert core.async_stepper.in_flight is None
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids), "a worker outlived shutdown"
