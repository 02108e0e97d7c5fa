"""Chat templates rendered as transformers' apply_chat_template renders them, on templates in
the styles of Llama 3, Qwen2 and Mistral, with both tokenizer kinds."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizer_utils import MISTRAL_TEMPLATE, STYLES, build_hf_tokenizer

from pydaemon.model_loader.demo_model import demo_model_dir
from pydaemon.tokenizer.chat_template import render_chat_template
from pydaemon.tokenizer.hf import HFTokenizer
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.sentencepiece import SentencePieceTokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, e.g. “Zürich”",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3? 日本語 😀"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "tool_calls": None, "name": None},
        {"role": "user", "content": "bye"},
    ],
]
QWEN2_TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"rain": false}'},
]


@pytest.fixture(scope="module", params=STYLES)
def pair(request, tmp_path_factory):
    model_dir = build_hf_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return request.param, HFTokenizer.from_dir(model_dir), ref


def _ref_render(ref, messages, **kwargs):
    return ref.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_transformers(pair, add_generation_prompt):
    style, ours, ref = pair
    chats = CHATS if style != "mistral" else [CHATS[0], CHATS[1]]
    for messages in chats:
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        want = _ref_render(ref, messages, add_generation_prompt=add_generation_prompt)
        assert got == want
    # The rendered prompt tokenizes as transformers tokenizes it (no second BOS).
    want_ids = ref.apply_chat_template(CHATS[1], add_generation_prompt=True, return_dict=False)
    assert ours.encode(ours.apply_chat_template(CHATS[1]), add_bos=False) == want_ids


def test_tools_and_tool_calls_pass_through(pair):
    style, ours, ref = pair
    if style == "mistral":
        pytest.skip("the Mistral v0.1 template has no tools")
    messages = QWEN2_TOOL_CHAT if style == "qwen2" else CHATS[0]
    got = ours.apply_chat_template(messages, tools=TOOLS)
    assert got == _ref_render(ref, messages, tools=TOOLS, add_generation_prompt=True)
    assert "get_weather" in got and "Zürich" in got  # tojson does not escape to \\u


def test_extra_kwargs_reach_the_template():
    template = "{{ bos_token }}{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    out = render_chat_template(
        template,
        [{"role": "user", "content": "x"}],
        model_name="m",
        special_tokens={"bos_token": "<s>"},
        greeting="hi ",
        bos_token="<B>",  # kwargs override the special tokens, as in transformers
    )
    assert out == "<B>hi x"


def test_template_errors_are_value_errors(pair):
    style, ours, _ = pair
    with pytest.raises(ValueError, match="non-empty list"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with a string 'role'"):
        ours.apply_chat_template([{"content": "no role"}])
    if style == "mistral":
        bad = [{"role": "assistant", "content": "first"}]
        with pytest.raises(ValueError, match="chat template of model .* roles must alternate"):
            ours.apply_chat_template(bad)


def test_sandbox_refuses_attribute_escape():
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match="unsafe|access"):
        render_chat_template(template, [{"role": "user"}], model_name="m", special_tokens={})


def test_no_template_is_a_clear_error(tmp_path):
    model_dir = build_hf_tokenizer(tmp_path / "my-model", "llama3")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(model_dir)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="model 'my-model' has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_sources(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; named variants give 'default'."""
    model_dir = build_hf_tokenizer(tmp_path, "qwen2")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T"},
    ]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    msgs = [{"role": "user", "content": "x"}]
    assert load_tokenizer(model_dir).apply_chat_template(msgs) == "Dx"
    (model_dir / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_tokenizer(model_dir).apply_chat_template(msgs) == "Jx"


def test_sentencepiece_tokenizer_renders_like_transformers(tmp_path):
    shutil.copy(demo_model_dir(tmp_path / "cache") / "tokenizer.model", tmp_path)
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": MISTRAL_TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, SentencePieceTokenizer)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for messages in CHATS[:2]:
        assert ours.apply_chat_template(messages) == _ref_render(
            ref, messages, add_generation_prompt=True
        )
    # Without tokenizer_config.json the special tokens come from the SentencePiece model.
    (tmp_path / "tokenizer_config.json").unlink()
    assert SentencePieceTokenizer(tmp_path / "tokenizer.model").special_tokens_map == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }


def test_jinja_features_as_transformers(pair):
    """{% generation %}, loop controls, namespace, dict(), tojson options, raise_exception
    inside a branch not taken."""
    _, ours, ref = pair
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% if ns.n > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ dict(r=m.role, c=m.content) | tojson(sort_keys=True) }}{% endif %}"
        "{% if m.role == 'nobody' %}{{ raise_exception('unreachable') }}{% endif %}"
        "{% endfor %}{{ ns.n }}{{ eos_token }}"
    )
    own, ours.chat_template = ours.chat_template, template
    try:
        for messages in CHATS:
            got = ours.apply_chat_template(messages, add_generation_prompt=False)
            assert got == _ref_render(ref, messages, chat_template=template)
    finally:
        ours.chat_template = own
