"""vLLM's ``GET /tokenizer_info`` (served with ``--enable-tokenizer-info-endpoint``, off by
default, as in vLLM): the tokenizer's configuration, as its ``tokenizer_config.json`` holds it
(what transformers keeps as ``init_kwargs``) with file paths left out and special tokens as
their text, plus ``tokenizer_class`` and the chat template in force. pagedd also fills in what
the config may lack and the server knows: the named special tokens, ``model_max_length`` (the
served max_model_len) and ``vocab_size``."""

from __future__ import annotations

from typing import Any

FILE_PATH_KEYS = ("vocab_file", "merges_file")  # vLLM leaves these out
# The fields of a transformers AddedToken as tokenizer_config.json writes one
ADDED_TOKEN_KEYS = frozenset(
    {"__type", "content", "lstrip", "rstrip", "normalized", "single_word", "special"}
)


def _plain(value: Any) -> Any:
    """JSON-ready: a ``{"content": ...}`` special token as its text (vLLM's AddedToken ->
    content), containers walked."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and value.keys() <= ADDED_TOKEN_KEYS:
            return value["content"]
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in FILE_PATH_KEYS:
        config.pop(key, None)
    info = _plain(config)
    for name, text in getattr(tokenizer, "special_tokens_map", {}).items():
        if not isinstance(info.get(name), str):
            info[name] = text
    info.setdefault("model_max_length", max_model_len)
    info["vocab_size"] = tokenizer.vocab_size
    info["tokenizer_class"] = config.get("tokenizer_class") or type(tokenizer).__name__
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info
