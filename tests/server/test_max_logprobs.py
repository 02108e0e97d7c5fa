"""vLLM's --max-logprobs (issue 55): the most logprobs / top_logprobs / prompt_logprobs a
request may ask for (default 20, -1: the vocabulary). More is a 400 naming the limit on HTTP,
INVALID_ARGUMENT on gRPC, and a ValueError offline, before the request takes a KV block."""

from __future__ import annotations

import openai
import pytest
from conftest import DEMO_NUM_KV_BLOCKS, make_server_thread
from http_helpers import MODEL, openai_client
from server_helpers import BidiClient

from pydaemon.config.engine import EngineConfig
from pydaemon.engine.llm_engine import LLMEngine
from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.daemon.settings import resolve
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Hello"}]


def _engine(max_logprobs: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="demo", device="cpu", num_kv_blocks=DEMO_NUM_KV_BLOCKS, max_logprobs=max_logprobs
        )
    )


@pytest.fixture(scope="module")
def server5():
    engine = _engine(5)
    st = make_server_thread(lambda: engine, http_port=0)
    yield st
    st.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_lower_limit_is_a_400_naming_it(server5, stream):
    client = openai_client(server5)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       logprobs=True, top_logprobs=6, stream=stream)  # fmt: skip
    assert e.value.body["param"] == "top_logprobs"
    assert (
        "Requested sample logprobs of 6, which is greater than max allowed: 5"
        in (e.value.body["message"])
    )
    assert "--max-logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=6,
                                  stream=stream)  # fmt: skip
    assert e.value.body["param"] == "logprobs"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       logprobs=True, top_logprobs=5)  # fmt: skip
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 5


def test_prompt_logprobs_are_bounded_too(server5):
    client = openai_client(server5)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                  extra_body={"prompt_logprobs": 6})  # fmt: skip
    assert e.value.body["param"] == "prompt_logprobs"
    assert (
        "Requested prompt logprobs of 6, which is greater than max allowed: 5"
        in (e.value.body["message"])
    )


def test_grpc_over_the_limit_is_invalid_argument_and_takes_no_block(server5):
    frames = (
        BidiClient(server5.stub())
        .start("big", "Hi", sampling=pb.SamplingParams(max_tokens=1, logprobs=6))
        .start("ok", "Hi", sampling=pb.SamplingParams(max_tokens=1, logprobs=5, temperature=0))
        .close_send()
        .collect()
    )
    error = frames["big"][0].error
    assert error.code == 3  # INVALID_ARGUMENT
    assert "greater than max allowed: 5" in error.message
    assert len(frames["ok"][0].delta.logprobs[0].top_logprobs) == 5
    server5.wait_all_blocks_free()


def test_minus_one_lifts_the_limit_to_the_vocabulary():
    """--max-logprobs -1: logprobs -1 (the whole vocabulary) is served, offline and on HTTP."""
    engine = _engine(-1)
    vocab = engine.vocab_size
    st = make_server_thread(lambda: engine, http_port=0)
    try:
        r = openai_client(st).completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                                 logprobs=-1)  # fmt: skip
        assert len(r.choices[0].logprobs.top_logprobs[0]) >= vocab - 1  # texts may collide
        r = openai_client(st).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=vocab
        )
        assert len(r.choices[0].logprobs.content[0].top_logprobs) == vocab
    finally:
        st.close()


def test_offline_engine_takes_its_limit():
    engine = _engine(3)
    from pydaemon.generate_request import GenerateRequest

    with pytest.raises(ValueError, match="Requested sample logprobs of 4, which is greater"):
        engine.add_request(GenerateRequest("a", "Hi", SamplingParams(max_tokens=1, logprobs=4)))
    assert engine.block_manager.num_free_blocks() == engine.block_manager.num_total_blocks()


def test_flag_and_toml_key_reach_the_engine(tmp_path):
    args = build_parser().parse_args(["serve", "--max-logprobs", "-1"])
    assert resolve(args)[0]["max_logprobs"] == -1
    toml = tmp_path / "p.toml"
    toml.write_text("max_logprobs = 7\n")
    assert (
        resolve(build_parser().parse_args(["serve", "--config", str(toml)]))[0]["max_logprobs"] == 7
    )
    assert EngineConfig().max_logprobs == 20  # vLLM's default
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        EngineConfig(max_logprobs=-2)
