"""Test helpers: small real tokenizers trained here and saved in the Hugging Face layout
(``tokenizer.json`` + ``tokenizer_config.json`` with a chat template), in the styles of
Llama 3 (byte-level BPE, BOS added by the post-processor), Qwen2 (byte-level BPE, no BOS) and
Mistral v0.1 (SentencePiece-style BPE with byte fallback, ``add_bos_token``)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "Hello world, how are you today? I'm fine, thanks!",
    " leading space and  two spaces,   three spaces",
    "The price is 5€, or 10 € for two. Don't you think so?",
    "Emoji 😀🎉 in the middle of a sentence 👍 and 🧑‍🚀 too",
    "日本語のテキストと中文 mixed with English. 한국어도 있습니다.",
    "Lines\nwith\ttabs and newlines\n\n\nand\r\nwindows ends",
    "ü ß é ñ — “quotes” … naïve café Ελληνικά русский",
    "def f(x):\n    return x ** 2  # code with    indentation",
    "Numbers 1234567890 and 3.14159, 1e-9, 0xFF.",
    "Once upon a time there was a little model that learned to talk.",
]
TEXTS = [
    *CORPUS,
    "unseen wörds: Ξ ∑ ∞ ≈ 🤖🦾 ÿ ŋ",
    "   ",
    "\n\t \n",
    "a",
    "<|im_end|> special text inside <s> user text",
]

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if tools is not none %}{{ '<|start_header_id|>tools<|end_header_id|>\n\n' }}"
    "{% for t in tools %}{{ t | tojson(indent=4) }}{{ '\n\n' }}{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}
            {{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
STYLES = ("llama3", "qwen2", "mistral")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 splits digits one by one.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def build_hf_tokenizer(out_dir: Path, style: str, vocab_size: int = 400) -> Path:
    """Writes tokenizer.json and tokenizer_config.json (with its chat template) to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, config = {"llama3": _llama3, "qwen2": _qwen2, "mistral": _mistral}[style](vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _byte_level(specials: list[str], vocab_size: int, split: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def _llama3(vocab_size: int) -> tuple[Tokenizer, dict]:
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tok = _byte_level(specials, vocab_size, _LLAMA3_SPLIT)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", 0)],
            ),
        ]
    )
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": LLAMA3_TEMPLATE,
    }
    return tok, config


def _qwen2(vocab_size: int) -> tuple[Tokenizer, dict]:
    tok = _byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size, _QWEN2_SPLIT)
    tok.normalizer = normalizers.NFC()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special: kept by decode
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        "chat_template": QWEN2_TEMPLATE,
    }
    return tok, config


def _mistral(vocab_size: int) -> tuple[Tokenizer, dict]:
    """SentencePiece-style BPE: '▁' for spaces, a prepended '▁', <0xNN> byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    # Insert the 256 byte tokens right after the specials, as SentencePiece lays them out.
    data = json.loads(tok.to_str())
    learned = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, (t, _) in enumerate(learned[:3])}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for t, _ in learned[3:]:
        vocab.setdefault(t, len(vocab))
    data["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
    )
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False},
        "unk_token": {"__type": "AddedToken", "content": "<unk>", "lstrip": False},
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 32768,
        "pad_token": None,
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "LlamaTokenizer",
        "use_default_system_prompt": False,
        "chat_template": MISTRAL_TEMPLATE,
    }
    return tok, config
