"""The tokenizer a GGUF file describes, built in memory as a ``tokenizers.Tokenizer``.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: the vocabulary is already
spelled in GPT-2's byte alphabet, merges are "a b" strings) and ``"llama"`` (SentencePiece:
Gemma, Llama 2, Mistral; gguf_spm.py). The pre-tokenizer follows
``tokenizer.ggml.pre`` as llama.cpp does (``llama-vocab.cpp``); an unknown one is an error
naming it rather than a silently different split. Tokens typed CONTROL (3) become special
added tokens, USER_DEFINED (4) plain added tokens, so both are matched whole in text.

Returned as an HFTokenizer configured as by a ``tokenizer_config.json``: the special tokens
as strings, ``add_bos_token`` / ``add_eos_token`` from the metadata (there is no
post-processor, so these decide whether BOS / EOS are added) and the ``chat_template``.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from pydaemon.gguf.reader import GGUFFile
from pydaemon.tokenizer.gguf_spm import spm_tokenizer
from pydaemon.tokenizer.hf import HFTokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss, GPT-4o): cased words with their contraction, numbers in threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how llama.cpp splits text before BPE:
#   "gpt2": GPT-2's regex; "digits": every digit alone, then GPT-2's regex; else a regex.
_PRE_TOKENIZERS: dict[str, str] = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_gguf_tokenizer(f: GGUFFile) -> HFTokenizer:
    kind = f.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{f.path.name} has no tokenizer (no tokenizer.ggml.model)")
    if kind == "llama":
        tok, add_bos = spm_tokenizer(f)
        config = _tokenizer_config(f, list(f.require("tokenizer.ggml.tokens")))
        config["add_bos_token"] = add_bos
        return HFTokenizer.from_tokenizer_object(tok, config, f.get("tokenizer.chat_template"))
    if kind != "gpt2":
        raise ValueError(
            f"{f.path.name}: unsupported GGUF tokenizer {kind!r} (supported: 'gpt2', byte-level "
            "BPE; 'llama', SentencePiece)"
        )
    tokens: list[str] = f.require("tokenizer.ggml.tokens")
    merges: list[str] = f.require("tokenizer.ggml.merges")
    token_types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"{f.path.name}: tokenizer.ggml.token_type has {len(token_types)} entries for "
            f"{len(tokens)} tokens"
        )
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # written as raw text: respell it in the byte alphabet
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    for pair in pairs:  # tokenizers panics on these; name the bad merge instead
        if len(pair) != 2 or pair[0] + pair[1] not in vocab or not set(pair) <= vocab.keys():
            raise ValueError(
                f"{f.path.name}: tokenizer.ggml.merges has {' '.join(pair)!r}, whose parts or "
                "result are not in the vocabulary"
            )
    tok = Tokenizer(BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(f)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, token_type in zip(tokens, token_types, strict=True)
            if token_type == TOKEN_TYPE_CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, token_type in zip(tokens, token_types, strict=True)
            if token_type == TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
    )
    return HFTokenizer.from_tokenizer_object(
        tok, _tokenizer_config(f, tokens), f.get("tokenizer.chat_template")
    )


def _pre_tokenizer(f: GGUFFile) -> pre_tokenizers.PreTokenizer:
    pre = f.get("tokenizer.ggml.pre", "default")
    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        raise ValueError(
            f"{f.path.name}: unsupported GGUF pre-tokenizer {pre!r} "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "gpt2":
        return gpt2
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _tokenizer_config(f: GGUFFile, tokens: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name_or_path": f.path.stem,
        "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(f.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = f.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise ValueError(
                    f"{f.path.name}: tokenizer.ggml.{key}={token_id} is outside the "
                    f"vocabulary of {len(tokens)} tokens"
                )
            config[name] = tokens[token_id]
    chat_template = f.get("tokenizer.chat_template")
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
