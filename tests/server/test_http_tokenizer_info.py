"""vLLM's GET /tokenizer_info behind --enable-tokenizer-info-endpoint (issue 55): the
tokenizer's config without file paths, special tokens as text, tokenizer_class and the chat
template in force; 404 without the flag, behind the API key with one."""

from __future__ import annotations

import tokenizers
from http_helpers import request

from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.daemon.settings import resolve
from pydaemon.entrypoints.openai.tokenizer_info import tokenizer_info
from pydaemon.tokenizer.hf import HFTokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_the_endpoint_answers_only_with_the_flag(demo_server):
    off = demo_server(http_port=0)
    assert request(off, "GET", "/tokenizer_info").status == 404
    on = demo_server(http_port=0, api_key="k", chat_template=TEMPLATE,
                     enable_tokenizer_info_endpoint=True)  # fmt: skip
    tok = on.server.async_engine.tokenizer
    max_model_len = on.server.async_engine.model_info.max_model_len
    assert request(on, "GET", "/tokenizer_info").status == 401
    r = request(on, "GET", "/tokenizer_info", headers={"Authorization": "Bearer k"})
    assert r.status == 200
    info = r.json()
    assert info["tokenizer_class"]
    assert info["chat_template"] == TEMPLATE  # the --chat-template in force
    assert info["vocab_size"] == tok.vocab_size
    assert info["model_max_length"] == tok.init_kwargs.get("model_max_length", max_model_len)
    for name, text in tok.special_tokens_map.items():
        assert info[name] == text
    assert "vocab_file" not in info and "merges_file" not in info


def test_config_fields_as_vllm_returns_them():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, "a"))
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "model_max_length": 4096,
        "vocab_file": "/secret/path/tokenizer.model",
        "add_bos_token": True,
        "added_tokens_decoder": {"1": {"content": "</s>", "special": True, "lstrip": False}},
        "chat_template": TEMPLATE,
    }
    info = tokenizer_info(HFTokenizer.from_tokenizer_object(tok, config), max_model_len=64)
    assert info["tokenizer_class"] == "LlamaTokenizer"
    assert info["bos_token"] == "<s>" and info["eos_token"] == "</s>"
    assert info["added_tokens_decoder"] == {"1": "</s>"}
    assert info["model_max_length"] == 4096 and info["add_bos_token"] is True
    assert info["chat_template"] == TEMPLATE and info["vocab_size"] == 3
    assert "vocab_file" not in info


def test_flag_and_toml_key(tmp_path):
    assert resolve(build_parser().parse_args(["serve"]))[1].enable_tokenizer_info_endpoint is False
    args = build_parser().parse_args(["serve", "--enable-tokenizer-info-endpoint"])
    assert resolve(args)[1].enable_tokenizer_info_endpoint is True
    toml = tmp_path / "p.toml"
    toml.write_text("enable_tokenizer_info_endpoint = true\n")
    args = build_parser().parse_args(["serve", "--config", str(toml)])
    assert resolve(args)[1].enable_tokenizer_info_endpoint is True
