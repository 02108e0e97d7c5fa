"""Reading the JSON files of a model directory: an object or nothing, and token-id fields as
configs write them (None, an int, a list of ints)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """-> the file's object, or {} when it does not exist."""
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def normalize_token_ids(value: Any, field: str) -> list[int]:
    """``eos_token_id`` as configs write it (None, an int, a list of ints) -> a list."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"{field} must be an int or a list of ints, got {value!r}")
