"""MPEngineClient: the engine core in its own process gives the same outputs as LLM in
process (greedy, seeded n > 1, stop strings, beam search), rejects bad input with a clear
ValueError, frees the blocks of an abandoned request, and stops its process cleanly."""

from __future__ import annotations

import asyncio
import re

import pytest

from pydaemon import LLM, SamplingParams
from pydaemon.config.engine import EngineConfig
from pydaemon.engine.mp_client import MPEngineClient
from pydaemon.generate_request import GenerateRequest
from pydaemon.sampling_params import StructuredOutputsParams

CONFIG = dict(model="demo", device="cpu", num_kv_blocks=128, max_num_seqs=16)
CASES = {
    "greedy": ("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=12)),
    "seeded-n2": ([5, 6, 7, 8], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8)),
    "best-of": ([9, 10, 11], SamplingParams(n=1, best_of=3, temperature=0.8, seed=1, max_tokens=6)),
    "beam": ([12, 13, 14], SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=6)),
    "logprobs": ([15, 16], SamplingParams(temperature=0.0, max_tokens=5, logprobs=2)),
    "regex": (  # the grammar compiled in the core process
        "Once upon a time",
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=4,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(regex="[a-z]{2}-[0-9]{3}"),
        ),
    ),
}


def _summary(output) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]


def _merge(outputs) -> list[tuple]:
    """Streamed deltas folded into whole completions, as LLM.generate returns them."""
    whole: dict[int, list] = {}
    for out in outputs:
        for c in out.outputs:
            acc = whole.setdefault(c.index, [c.index, [], "", None, None])
            acc[1] += c.token_ids
            acc[2] += c.text
            acc[3], acc[4] = c.finish_reason, c.stop_reason
    return [tuple(whole[i]) for i in sorted(whole)]


@pytest.fixture(scope="module")
def offline():
    llm = LLM(**CONFIG)
    first_text = llm.generate(*CASES["greedy"])[0].outputs[0].text
    stop = first_text.strip().split(" ")[-1][:3] or first_text[-2:]
    cases = {
        **CASES,
        "stop": (CASES["greedy"][0], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])),
    }
    ids = list(cases)
    results = llm.generate([cases[k][0] for k in ids], [cases[k][1] for k in ids])
    return cases, {k: _summary(r) for k, r in zip(ids, results, strict=True)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_same_outputs_as_in_process_and_clean_errors(offline, async_scheduling):
    """Also with async scheduling forced on in the core process (its loop, stop strings from
    the front end, an abandoned stream): the same outputs as the synchronous in-process run."""
    cases, expected = offline
    assert expected["stop"][0][3] == "stop" and isinstance(expected["stop"][0][4], str)

    async def main():
        client = await asyncio.get_running_loop().run_in_executor(
            None, MPEngineClient.launch, EngineConfig(**CONFIG, async_scheduling=async_scheduling)
        )
        client.start()
        try:
            assert (client.model_info.device, client.model_info.dtype) == ("cpu", "float32")

            async def one(key):
                prompt, params = cases[key]
                return [o async for o in client.generate(GenerateRequest(key, prompt, params))]

            got = dict(zip(cases, await asyncio.gather(*map(one, cases)), strict=True))
            with pytest.raises(ValueError, match="is out of vocabulary"):
                await one_bad(client)
            bad_regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b"))
            with pytest.raises(ValueError, match="structured_outputs.regex: invalid regex"):
                async for _ in client.generate(GenerateRequest("bad-regex", [3, 4], bad_regex)):
                    pass
            # Leaving a stream early aborts the request and frees its blocks.
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            async for _ in client.generate(GenerateRequest("long", [3, 4, 5], long)):
                break
            deadline = asyncio.get_running_loop().time() + 20
            while asyncio.get_running_loop().time() < deadline:
                stats = await client.stats()
                if stats.num_free_gpu_blocks == stats.num_gpu_blocks:
                    break
                await asyncio.sleep(0.02)
            assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
            return got
        finally:
            await client.shutdown()
            assert client.process.exitcode == 0

    async def one_bad(client):
        async for _ in client.generate(
            GenerateRequest("bad", [10**6], SamplingParams(max_tokens=2))
        ):
            pass

    got = asyncio.run(main())
    assert all(re.fullmatch("[a-z]{2}-[0-9]{3}", c[2]) for c in expected["regex"])
    for key in ("greedy", "seeded-n2", "stop", "logprobs", "regex"):
        assert _merge(got[key]) == expected[key], key
        assert got[key][-1].finished and sum(o.finished for o in got[key]) == 1
    for key in ("best-of", "beam"):  # not streamed: one whole, final output
        (only,) = got[key]
        assert _summary(only) == expected[key], key
