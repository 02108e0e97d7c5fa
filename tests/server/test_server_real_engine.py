"""The server on the real LLMEngine with the demo model (CPU): streams are correct and every
early end frees every block."""

from __future__ import annotations

import os

import grpc
import pytest
from server_helpers import BidiClient, ServerThread, joined_ids, joined_text

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

if os.environ.get("PAGEDD_SERVER_TEST_ENGINE") == "fake":
    pytest.skip("PAGEDD_SERVER_TEST_ENGINE=fake", allow_module_level=True)
engine_mod = pytest.importorskip("pydaemon.engine.llm_engine", exc_type=ImportError)

from pydaemon.config.engine import EngineConfig  # noqa: E402
from pydaemon.entrypoints.daemon.app import ServerOptions  # noqa: E402

PROMPTS = ("Hello, my name is", "The capital of France is", "1 2 3 4 5")
MAX_TOKENS = (12, 20, 7)


def _demo_engine(num_kv_blocks: int):
    return engine_mod.LLMEngine(
        EngineConfig(model="demo", device="cpu", num_kv_blocks=num_kv_blocks)
    )


@pytest.fixture(scope="module")
def server():
    from conftest import shared_demo_engine

    st = ServerThread(ServerOptions(port=0, grace_period_s=5.0)).start(
        shared_demo_engine, timeout=60
    )
    st.stub()
    yield st
    st.close()


def test_three_interleaved_requests_match_llm_generate(server):
    from pydaemon import LLM, SamplingParams

    client = BidiClient(server.stub())
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        client.start(
            f"r{i}", prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens)
        )
    client.close_send()
    frames = client.collect()
    llm = LLM(model="demo", device="cpu")
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[
            0
        ].outputs[0]
        got = frames[f"r{i}"]
        assert got[-1].HasField("finished"), got[-1]
        assert joined_text(got) == expected.text
        assert joined_ids(got) == list(expected.token_ids)
        finished = got[-1].finished
        assert finished.usage.completion_tokens == len(expected.token_ids)
        assert finished.finish_reason == (
            pb.FINISH_REASON_LENGTH if expected.finish_reason == "length" else pb.FINISH_REASON_STOP
        )
        assert finished.timings.total_ms >= finished.timings.time_to_first_token_ms > 0
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


LONG = pb.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)


def _busy_then(server, how: str) -> None:
    total = server.stats().num_gpu_blocks
    client = BidiClient(server.stub(), timeout=1.0 if how == "deadline" else 30)
    client.start("a", PROMPTS[0], sampling=LONG).start("b", PROMPTS[1], sampling=LONG)
    first = client.next()
    assert first.HasField("delta")
    assert server.stats().num_free_gpu_blocks < total
    if how == "cancel":
        client.cancel("a").cancel("b").close_send()
        frames = client.collect()
        assert {f[-1].finished.finish_reason for f in frames.values()} == {
            pb.FINISH_REASON_CANCELLED
        }
    elif how == "disconnect":
        client.call.cancel()
    else:
        with pytest.raises(grpc.RpcError) as e:
            client.collect()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == total
    assert stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("how", ["cancel", "disconnect", "deadline"])
def test_early_end_frees_every_block(server, how):
    _busy_then(server, how)


def test_prompt_too_long_for_context_and_for_kv_cache():
    st = ServerThread(ServerOptions(port=0)).start(lambda: _demo_engine(2), timeout=60)
    try:
        info = st.stub().GetModelInfo(pb.GetModelInfoRequest())
        client = BidiClient(st.stub())
        client.start("ctx", [5] * (info.max_model_len + 1))
        client.start("kv", [5] * (2 * info.block_size + 1))
        client.close_send()
        frames = client.collect()
        assert frames["ctx"][0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "context" in frames["ctx"][0].error.message
        assert frames["kv"][0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "KV blocks" in frames["kv"][0].error.message
    finally:
        st.close()


def test_n_sequences_and_logprobs_in_deltas(server):
    client = BidiClient(server.stub())
    sampling = pb.SamplingParams(
        n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, logprobs=2
    )
    client.start("n2", PROMPTS[0], sampling=sampling).close_send()
    *deltas, last = client.collect()["n2"]
    for index in (0, 1):
        ids = joined_ids(deltas, index)
        assert len(ids) == 6
    for frame in deltas:
        assert len(frame.delta.logprobs) == len(frame.delta.token_ids)
        for token_id, lp in zip(frame.delta.token_ids, frame.delta.logprobs, strict=True):
            assert lp.token_id == token_id and lp.logprob <= 0.0
            assert len(lp.top_logprobs) >= 2
    assert list(last.finished.sequence_finish_reasons) == [pb.FINISH_REASON_LENGTH] * 2
    assert last.finished.usage.completion_tokens == 12
