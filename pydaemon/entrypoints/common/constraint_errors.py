"""The engine names a bad constraint by its own field (``structured_outputs.json: invalid or
unsupported JSON schema: ...``); a client must read the field it sent instead: OpenAI's
``response_format`` or ``tools``, vLLM's ``structured_outputs``, gRPC's
``structured_output.json_schema``. ``rename_constraint_field`` rewrites the message."""

from __future__ import annotations

import re
from collections.abc import Callable

# What grammar_spec.py and the engine's compile errors start with; group 1: the kind.
_ENGINE_FIELD = re.compile(r"^structured_outputs(?:\.(json_object|json|regex|choice|grammar))?\b")


def is_constraint_error(message: str) -> bool:
    return _ENGINE_FIELD.match(message) is not None


def rename_constraint_field(message: str, field: Callable[[str | None], str]) -> str:
    """``message`` with the engine's field replaced by ``field(kind)`` (kind: "json",
    "regex"..., None when the engine named none); other messages unchanged."""
    return _ENGINE_FIELD.sub(lambda m: field(m.group(1)), message, count=1)


def http_constraint_field(source: str) -> Callable[[str | None], str]:
    """The OpenAI request's field for a constraint that came from ``source``: the top-level
    field "response_format", "tools" or "structured_outputs"."""

    def field(kind: str | None) -> str:
        if source == "response_format":
            return "response_format.json_schema.schema" if kind == "json" else "response_format"
        if source == "structured_outputs" and kind is not None:
            return f"structured_outputs.{kind}"
        return source

    return field


_GRPC_KINDS = {"json": "json_schema"}


def grpc_constraint_field(kind: str | None) -> str:
    """StartRequest's field for a constraint of ``kind``."""
    if kind is None:
        return "structured_output"
    return f"structured_output.{_GRPC_KINDS.get(kind, kind)}"
