"""The small JSON files a tokenizer is configured by, read the same way for every kind.

``tokenizer_config.json`` (with ``special_tokens_map.json`` filling in what it lacks) names the
special tokens and the BOS/EOS rules; ``generation_config.json`` and ``config.json`` list the
ids that end a sequence (``eos_token_id``: an int or a list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydaemon.config.json_files import normalize_token_ids, read_json

# The named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """``tokenizer_config.json``, with the tokens of ``special_tokens_map.json`` it lacks."""
    config = read_json(model_dir / "tokenizer_config.json")
    for key, value in read_json(model_dir / "special_tokens_map.json").items():
        if config.get(key) is None:
            config[key] = value
    return config


def token_content(value: Any) -> str | None:
    """A special token as written in the configs (a string or an AddedToken dict) -> its text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"a special token must be a string or {{'content': ...}}, got {value!r}")


def named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """{"bos_token": "<s>", ...} for the named special tokens the config sets."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = token_content(config.get(name))
        if content is not None:
            out[name] = content
    return out


def model_eos_token_ids(model_dir: Path) -> list[int]:
    """Every EOS id of ``generation_config.json`` then ``config.json``, in order, once each."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        for i in normalize_token_ids(read_json(model_dir / name).get("eos_token_id"), name):
            if i not in ids:
                ids.append(i)
    return ids


def model_bos_token_id(model_dir: Path) -> int | None:
    """``bos_token_id`` of ``generation_config.json``, else of ``config.json``."""
    for name in ("generation_config.json", "config.json"):
        bos = read_json(model_dir / name).get("bos_token_id")
        if bos is not None:
            return int(bos)
    return None
