"""InprocEngineClient on its own: the engine thread, command queue and per-request queues."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine

from pydaemon.engine.inproc_client import EngineDeadError, InprocEngineClient
from pydaemon.generate_request import GenerateRequest
from pydaemon.sampling_params import SamplingParams


def run(coro_fn, engine: FakeEngine):
    async def main():
        async_engine = InprocEngineClient(engine)
        async_engine.start()
        try:
            return await coro_fn(async_engine)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


def test_concurrent_requests_stream_their_own_deltas():
    async def body(ae: InprocEngineClient):
        async def one(rid, prompt, n):
            ids = []
            async for out in ae.generate(
                GenerateRequest(rid, prompt, SamplingParams(max_tokens=n))
            ):
                ids += out.outputs[0].token_ids
            return ids

        return await asyncio.gather(one("a", [10], 3), one("b", [20], 5))

    a, b = run(body, FakeEngine())
    assert a == [11, 12, 13] and b == [21, 22, 23, 24, 25]


def test_bad_input_raises_value_error_from_the_engine_thread():
    async def body(ae: InprocEngineClient):
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in ae.generate(GenerateRequest("a", [], SamplingParams())):
                pass
        return await ae.stats()

    assert run(body, FakeEngine(num_gpu_blocks=8)).num_free_gpu_blocks == 8


def test_leaving_early_aborts_and_frees_blocks():
    async def body(ae: InprocEngineClient):
        async for _ in ae.generate(GenerateRequest("a", [1], SamplingParams(max_tokens=100))):
            break
        for _ in range(100):
            stats = await ae.stats()
            if stats.num_free_gpu_blocks == 64:
                return stats
            await asyncio.sleep(0.01)
        return stats

    engine = FakeEngine(num_gpu_blocks=64, max_model_len=512, step_delay_s=0.01)
    stats = run(body, engine)
    assert stats.num_free_gpu_blocks == 64 and stats.num_running == 0


def test_engine_failure_fails_live_and_new_requests():
    async def body(ae: InprocEngineClient):
        with pytest.raises(EngineDeadError, match="simulated internal failure"):
            async for _ in ae.generate(GenerateRequest("a", [1], SamplingParams(max_tokens=4))):
                pass
        assert not ae.is_alive
        with pytest.raises(EngineDeadError):
            async for _ in ae.generate(GenerateRequest("b", [1], SamplingParams(max_tokens=4))):
                pass

    run(body, FakeEngine(fail_on_step=1))


def test_idle_engine_thread_keeps_beating():
    async def body(ae: InprocEngineClient):
        before = ae.num_loop_iterations
        await asyncio.sleep(1.2)
        return ae.num_loop_iterations - before, ae.seconds_since_progress()

    beats, since = run(body, FakeEngine())
    assert beats >= 2 and since < 0.6


def test_one_engine_thread_per_engine():
    """A second client on an engine another client's thread steps is refused before its
    warm-up (two threads would step one scheduler); once the first shuts down, it is served."""
    engine = FakeEngine()

    async def main():
        first = InprocEngineClient(engine)
        first.start()
        try:
            with pytest.raises(RuntimeError, match="already served"):
                InprocEngineClient.load(lambda: engine)
            assert not engine.warmed_up  # refused before its warm-up
        finally:
            await first.shutdown()
        second = InprocEngineClient.load(lambda: engine)
        second.start()
        try:
            ids = []
            async for out in second.generate(
                GenerateRequest("a", [10], SamplingParams(max_tokens=2))
            ):
                ids += out.outputs[0].token_ids
            return ids
        finally:
            await second.shutdown()

    assert asyncio.run(main()) == [11, 12]
