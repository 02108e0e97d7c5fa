"""Acceptance: per architecture, a tiny random model saved by transformers with a real
tokenizer.json and chat template, run text in / text out through LLM.generate, LLM.chat and
the gRPC stream, against transformers (greedy ids, tokenizer.decode, apply_chat_template)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from model_utils import hf_greedy, save_hf_model
from tokenizer_utils import build_hf_tokenizer

from pydaemon import LLM, SamplingParams
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent / "server"))
from server_helpers import BidiClient, ServerThread, joined_ids, joined_text  # noqa: E402

from pydaemon.entrypoints.daemon.app import ServerOptions  # noqa: E402

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 24
PROMPT = "Hello world, how are you today? 日本語 😀"
CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, I think."},
    {"role": "user", "content": "And in 日本語? 🎉"},
]
# architecture -> (tokenizer style, model overrides); Mistral with a window shorter than
# the prompts plus outputs.
ARCHS = {
    "llama": ("llama3", {}),
    "mistral": ("mistral", {"sliding_window": 16}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen2", {}),
}


def build_real_model(tmp_path: Path, arch: str) -> Path:
    """A transformers-saved random model whose vocabulary is a real tokenizer's."""
    style, overrides = ARCHS[arch]
    tok_dir = build_hf_tokenizer(tmp_path / "tokenizer", style)
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    model_dir = save_hf_model(
        tmp_path,
        arch,
        vocab_size=len(ref),
        bos_token_id=ref.bos_token_id,
        eos_token_id=ref.eos_token_id,
        pad_token_id=ref.eos_token_id,
        **overrides,
    )
    for f in tok_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    return model_dir


@pytest.fixture(scope="module", params=list(ARCHS))
def real(request, tmp_path_factory):
    model_dir = build_real_model(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    llm = LLM(model=str(model_dir), device="cpu", num_kv_blocks=128, block_size=8)
    return model_dir, ref, llm


def _greedy() -> SamplingParams:
    # ignore_eos: random weights may pick EOS; transformers' reference never stops early.
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_generate_text_in_text_out(real):
    model_dir, ref, llm = real
    (out,) = llm.generate(PROMPT, _greedy())
    assert out.prompt_token_ids == ref.encode(PROMPT)
    (want,) = hf_greedy(model_dir, [out.prompt_token_ids], MAX_TOKENS)
    completion = out.outputs[0]
    assert completion.token_ids == want
    assert completion.text == ref.decode(want, skip_special_tokens=True)


def test_chat_prompt_and_reply(real):
    model_dir, ref, llm = real
    (out,) = llm.chat(CHAT, _greedy())
    assert out.prompt == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    want_ids = ref.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert out.prompt_token_ids == want_ids
    (want,) = hf_greedy(model_dir, [want_ids], MAX_TOKENS)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text == ref.decode(want, skip_special_tokens=True)
    with pytest.raises(ValueError, match="messages is empty"):
        llm.chat([])


def test_grpc_stream_text_and_messages(real):
    model_dir, ref, llm = real
    st = ServerThread(ServerOptions(port=0)).start(lambda: llm.engine)
    try:
        client = BidiClient(st.stub())
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        client.start("text", PROMPT, sampling=sampling)
        messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
        start = pb.StartRequest(request_id="chat", messages=messages, sampling=sampling)
        client.send(pb.GenerateRequest(start=start)).close_send()
        frames = client.collect()
        info = st.stub().GetModelInfo(pb.GetModelInfoRequest())
    finally:
        st.close()
    chat_ids = ref.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    want_text, want_chat = hf_greedy(model_dir, [ref.encode(PROMPT), chat_ids], MAX_TOKENS)
    for rid, want in (("text", want_text), ("chat", want_chat)):
        assert frames[rid][-1].HasField("finished"), frames[rid][-1]
        assert joined_ids(frames[rid]) == want
        assert joined_text(frames[rid]) == ref.decode(want, skip_special_tokens=True)
    assert frames["chat"][-1].finished.usage.prompt_tokens == len(chat_ids)
    assert info.has_tokenizer and info.has_chat_template
    assert list(info.eos_token_ids) == [ref.eos_token_id]


def test_every_generation_config_eos_stops_and_defaults_apply(real, tmp_path):
    """An extra EOS id in generation_config.json ends the sequence; its temperature is the
    default of requests that set none."""
    model_dir, ref, llm = real
    (out,) = llm.generate(PROMPT, _greedy())
    tokens = out.outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and t != ref.eos_token_id)
    work = tmp_path / model_dir.name
    work.mkdir()
    for f in model_dir.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    gen = json.loads((work / "generation_config.json").read_text())
    gen.update(eos_token_id=[ref.eos_token_id, tokens[stop_at]], temperature=0.25, top_k=5)
    (work / "generation_config.json").write_text(json.dumps(gen))
    llm2 = LLM(model=str(work), device="cpu", num_kv_blocks=64, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    (stopped,) = llm2.generate(PROMPT, params)
    assert stopped.outputs[0].token_ids == tokens[: stop_at + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    defaults = llm2.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.25, 5, 1.0)
    assert set(llm2.engine.eos_token_ids) == {ref.eos_token_id, tokens[stop_at]}
