"""Gemma's and gpt-oss's chat formats through pagedd's tokenizer and jinja renderer, as
transformers renders and tokenizes them: a Gemma-style tokenizer (SentencePiece-style BPE with
byte fallback, BOS added by the tokenizer.json post-processor, <start_of_turn> / <end_of_turn>
specials) with a template in the style of Gemma's (BOS first, the system prompt folded into
the first user turn, "assistant" rendered as "model"); and a byte-level tokenizer with
gpt-oss's harmony specials and a template in the style of gpt-oss's own (the harmony format:
system and developer messages, namespace()-built state, recursive macros rendering tool
schemas as TypeScript, strftime_now, tool calls to the commentary channel, the ``thinking``
field, ``reasoning_effort``). The templates here are written for these tests in those styles,
not copies of the models' files. pagedd renders harmony through the model's own jinja template
(the openai-harmony package ships a Rust core: no pure wheel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_utils import _LLAMA3_SPLIT, CORPUS, _byte_level
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pydaemon.tokenizer.hf import HFTokenizer

transformers = pytest.importorskip("transformers")

GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

HARMONY_STYLE_TEMPLATE = """{%- macro ts_type(spec) -%}
    {%- if spec.type == "array" -%}{{- ts_type(spec['items']) + "[]" -}}
    {%- elif spec.type == "object" and spec.properties -%}
        {{- "{ " }}{%- for name, sub in spec.properties.items() -%}
            {{- name }}{% if name not in (spec.required or []) %}?{% endif %}: {{ ts_type(sub) }}
            {%- if not loop.last %}, {% endif -%}
        {%- endfor -%}{{- " }" }}
    {%- elif spec.type == "string" and spec.enum -%}{{- '"' + spec.enum|join('" | "') + '"' -}}
    {%- elif spec.type in ("integer", "number") -%}number
    {%- elif spec.type is defined -%}{{- spec.type -}}
    {%- else -%}any{%- endif -%}
{%- endmacro -%}
{%- macro render_tools(tools) -%}
    {{- "## functions\\n\\nnamespace functions {\\n\\n" }}
    {%- for tool in tools %}{%- set fn = tool.function %}
        {{- "// " + fn.description + "\\ntype " + fn.name + " = (_: " + ts_type(fn.parameters) + ") => any;\\n\\n" }}
    {%- endfor %}
    {{- "} // namespace functions" }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" }}
{%- if model_identity is not defined %}{% set model_identity = "You are a test model." %}{% endif %}
{{- model_identity + "\\nCurrent date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final." }}
{%- if tools %}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif %}
{{- "<|end|>" }}
{%- if messages[0].role in ("developer", "system") %}
    {%- set developer = messages[0].content %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set developer = "" %}{%- set loop_messages = messages %}{%- endif %}
{%- if developer or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer %}{{- "# Instructions\\n\\n" + developer }}{% endif %}
    {%- if tools %}{{- "\\n\\n# Tools\\n\\n" + render_tools(tools) }}{% endif %}
    {{- "<|end|>" }}
{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == "assistant" -%}
        {%- if "tool_calls" in message and message.tool_calls %}
            {%- set call = message.tool_calls[0] %}
            {%- if call.function %}{%- set call = call.function %}{%- endif %}
            {%- if message.thinking is defined and message.thinking %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
            {{- call.arguments|tojson + "<|call|>" }}
            {%- set last_call.name = call.name %}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "tool" -%}
        {%- if last_call.name is none %}{{ raise_exception("tool message without a tool call") }}{% endif %}
        {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" }}
        {{- message.content|tojson + "<|end|>" }}
    {%- elif message.role == "user" -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""

HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>",
                    "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]  # fmt: skip
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, e.g. “Zürich”",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "array", "items": {"type": "integer"}}}}}}]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3? 日本語 😀"},
    ],
]
HARMONY_TOOL_CHAT = [
    {"role": "developer", "content": "Answer in Celsius."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "thinking": "Use the tool.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"city": "Oslo", "unit": "C"}}}]},
    {"role": "tool", "content": '{"temp": -3}'},
    {"role": "assistant", "content": "It is -3 °C."},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip


def _gemma_style(out_dir: Path) -> Path:
    """SentencePiece-style BPE with byte fallback, Gemma's special tokens and BOS."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=False
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    data = json.loads(tok.to_str())  # the 256 byte tokens after the specials
    learned = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, (t, _) in enumerate(learned[: len(specials)])}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for t, _ in learned[len(specials) :]:
        vocab.setdefault(t, len(vocab))
    data["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B:1", special_tokens=[("<bos>", 2)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
              "tokenizer_class": "GemmaTokenizer", "chat_template": GEMMA_STYLE_TEMPLATE}  # fmt: skip
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


def _harmony_style(out_dir: Path) -> Path:
    tok = _byte_level(HARMONY_SPECIALS, 600, _LLAMA3_SPLIT)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
              "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (out_dir / "chat_template.jinja").write_text(HARMONY_STYLE_TEMPLATE)
    return out_dir


_PAIRS: dict[str, tuple] = {}


def _pair(style: str, tmp_path_factory) -> tuple:
    if style not in _PAIRS:
        d = tmp_path_factory.mktemp(style)
        d = _gemma_style(d) if style == "gemma" else _harmony_style(d)
        ref = transformers.AutoTokenizer.from_pretrained(d)
        _PAIRS[style] = (style, HFTokenizer.from_dir(d), ref)
    return _PAIRS[style]


@pytest.fixture(scope="module", params=["gemma", "harmony"])
def pair(request, tmp_path_factory):
    return _pair(request.param, tmp_path_factory)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_ids_equal_transformers(pair, add_generation_prompt):
    style, ours, ref = pair
    for messages in CHATS:
        kwargs = {"add_generation_prompt": add_generation_prompt}
        got = ours.apply_chat_template(messages, **kwargs)
        assert got == ref.apply_chat_template(messages, tokenize=False, **kwargs)
        # The rendered prompt's ids are transformers' (Gemma: one BOS, from the template).
        want = ref.apply_chat_template(messages, return_dict=False, **kwargs)
        assert ours.encode(got, add_bos=False) == want
    if style == "gemma":
        assert got.startswith("<bos><start_of_turn>user\nYou are terse.\n\n")
        assert ours.encode("Hello")[0] == ours.bos_token_id  # plain text: BOS added


def test_harmony_tools_calls_and_kwargs(tmp_path_factory):
    _, ours, ref = _pair("harmony", tmp_path_factory)
    kwargs = {"tools": TOOLS, "add_generation_prompt": True, "reasoning_effort": "high",
              "model_identity": "You are pagedd's test."}  # fmt: skip
    got = ours.apply_chat_template(HARMONY_TOOL_CHAT, **kwargs)
    assert got == ref.apply_chat_template(HARMONY_TOOL_CHAT, tokenize=False, **kwargs)
    assert 'type get_weather = (_: { city: string, unit?: "C" | "F", days?: number[] })' in got
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"' in got
    assert got.endswith("<|start|>assistant") and "Reasoning: high" in got


def test_gemma_roles_must_alternate(tmp_path_factory):
    _, ours, _ = _pair("gemma", tmp_path_factory)
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_grpc_chat_message_reasoning_is_rendered_back(tmp_path_factory):
    """gRPC ChatMessage.reasoning (a previous Finished.reasoning) reaches the template as the
    message's reasoning: gpt-oss renders the analysis before the assistant's tool call."""
    from pydaemon.entrypoints.grpc.model_prompt import _message
    from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

    _, ours, _ = _pair("harmony", tmp_path_factory)
    call = pb.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Oslo"}')
    messages = [
        pb.ChatMessage(role="user", content="Weather in Oslo?"),
        pb.ChatMessage(role="assistant", reasoning="Use the tool.", tool_calls=[call]),
        pb.ChatMessage(role="tool", content='{"temp": -3}', tool_call_id="call_1"),
    ]
    got = ours.apply_chat_template([_message(m) for m in messages], tools=TOOLS)
    assert "<|channel|>analysis<|message|>Use the tool.<|end|>" in got
    plain = [_message(m) for m in messages]
    plain[1].pop("reasoning_content")
    assert "Use the tool." not in ours.apply_chat_template(plain, tools=TOOLS)
