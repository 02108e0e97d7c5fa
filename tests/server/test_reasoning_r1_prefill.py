"""Issue 55 item 16: ``--reasoning-parser deepseek_r1`` on a model without think tags answered
``content: null`` with the whole answer as reasoning, and a prefilled ``</think>`` (an assistant
message continued with ``continue_final_message``) did not help once answer text followed it.

A think-tag parser on a model whose tokenizer has no ``<think>``/``</think>`` is refused at
start, naming the flag (vLLM refuses it too); on a thinking model, a continued assistant
message's own markers decide whether the output starts as reasoning or as the answer.
"""

from __future__ import annotations

import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import openai_client
from reasoning_model import build_reasoning_model
from server_helpers import ServerThread

from pydaemon.config.engine import EngineConfig
from pydaemon.engine.llm_engine import LLMEngine
from pydaemon.entrypoints.common.reasoning_parsers import (
    check_reasoning_parser,
    get_reasoning_parser,
    prompt_tail,
)
from pydaemon.entrypoints.daemon.app import ServerOptions
from pydaemon.entrypoints.grpc.servicer import ServingOptions
from pydaemon.tokenizer.chat_encoding import encode_chat

QUESTION = {"role": "user", "content": "What is 2+2?"}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model_dir = build_reasoning_model(tmp_path_factory.mktemp("thinker"))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))
    st = make_server_thread(
        lambda: engine, http_port=0, serving=ServingOptions(reasoning_parser="deepseek_r1")
    )
    [end_id] = engine.tokenizer.encode("</think>", add_bos=False)
    yield st, openai_client(st), model_dir.name, end_id, engine.tokenizer
    st.close()


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_think_parser_on_a_model_without_think_tags_is_refused_at_start(parser):
    """The demo model's tokenizer (byte-level BPE, as SmolLM2's) has no think tags."""
    with pytest.raises(ValueError, match=rf"--reasoning-parser {parser} .*no <think> or </think>"):
        check_reasoning_parser(parser, shared_demo_engine().tokenizer)
    st = ServerThread(ServerOptions(port=0, serving=ServingOptions(reasoning_parser=parser)))
    try:
        with pytest.raises(ValueError, match=rf"--reasoning-parser {parser}"):
            st.start(shared_demo_engine)
    finally:
        st.close()  # drains: the engine it loaded is released


def test_a_thinking_model_passes_the_check(thinker):
    tokenizer = thinker[4]
    check_reasoning_parser("deepseek_r1", tokenizer)
    check_reasoning_parser("qwen3", tokenizer)
    check_reasoning_parser(None, shared_demo_engine().tokenizer)


@pytest.mark.parametrize(
    "prefill, opening",
    [
        ("</think>", "answer"),
        ("<think>\n</think>\n\n", "answer"),
        ("<think>ok</think>Answer:", "answer"),  # answer text after the close
        ("<think>Let me see", "reasoning"),  # opened, not closed: the model goes on thinking
        ("Sure.", "answer"),  # a continued answer goes on as one
    ],
)
def test_a_continued_message_decides_how_the_output_starts(thinker, prefill, opening):
    """What the server does with continue_final_message (openai/chat.py): the message's own
    markers say whether the output goes on reasoning or answering."""
    tokenizer = thinker[4]
    r1 = get_reasoning_parser("deepseek_r1")
    tail = r1.continued_tail(prefill)
    split = r1.split("The answer is 4.", tail)
    if opening == "answer":
        assert (split.reasoning, split.content) == (None, "The answer is 4.")
        assert r1.markers(tokenizer, tail) is None  # a constraint holds from the first token
    else:
        assert (split.reasoning, split.content) == ("The answer is 4.", None)


def test_a_previous_turns_close_does_not_count(thinker):
    tokenizer = thinker[4]
    messages = [
        QUESTION,
        {"role": "assistant", "content": "</think>4"},
        {"role": "user", "content": "hi"},
    ]
    _, ids = encode_chat(tokenizer, messages, True)
    tail = prompt_tail(tokenizer, ids)  # the generation prompt opened the reasoning again
    assert get_reasoning_parser("deepseek_r1").split("hmm</think>4", tail).content == "4"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefilled_close_makes_the_output_the_answer_over_http(thinker, stream):
    st, client, model, end_id, _ = thinker
    messages = [QUESTION, {"role": "assistant", "content": "<think>ok</think>Answer:"}]
    kwargs = dict(model=model, messages=messages, max_tokens=6, temperature=0,
                  logit_bias={str(end_id): -100},  # no </think> in the output
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})  # fmt: skip
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = (message.model_extra or {}).get("reasoning_content"), message.content
    else:
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
        reasoning = reasoning or None
    assert reasoning is None and content, (reasoning, content)
    st.wait_all_blocks_free()
