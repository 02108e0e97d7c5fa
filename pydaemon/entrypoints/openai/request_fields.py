"""Single fields of an OpenAI request body, checked and converted with vLLM's rules and
words: seeds (int64), logprob counts (-1 and the server's maximum), logit_bias keys,
``response_format`` and vLLM's ``structured_outputs``. ``InvalidParam`` names the field."""

from __future__ import annotations

from typing import Any

from pydaemon.entrypoints.common.limits import LimitError
from pydaemon.sampling_params import MAX_LOGPROBS, StructuredOutputsParams


class InvalidParam(LimitError):
    """A request field with a bad value; ``param`` names the field."""


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def is_int_text(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return len(key) <= 20


def int64_seed(seed: int | None) -> int | None:
    """vLLM takes any int64 seed; -1 means none (a random stream). A negative seed is the
    same 64 bits as an unsigned one (SamplingParams.seed is in [0, 2**64))."""
    if seed is None or seed == -1:
        return None
    if not INT64_MIN <= seed <= INT64_MAX:
        raise InvalidParam(f"seed must be in [-2**63, 2**63 - 1] (got {seed})", "seed")
    return seed % 2**64


def check_logprobs_count(value: int | None, param: str, vocab_size: int) -> None:
    """vLLM's rules and words: a count >= 0, or -1 for the whole vocabulary, which is more
    than the server's maximum (MAX_LOGPROBS, vLLM's --max-logprobs default)."""
    if value is None or value >= 0:
        if value is not None and value > MAX_LOGPROBS:
            raise InvalidParam(
                f"Requested sample logprobs of {value}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                param,
            )
        return
    if value != -1:
        raise InvalidParam(f"`{param}` must be a positive value or -1.", param)
    raise InvalidParam(
        f"Requested sample logprobs of {vocab_size} ({param} -1: the whole vocabulary), which "
        f"is greater than max allowed: {MAX_LOGPROBS}",
        param,
    )


def structured_outputs_field(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    try:
        return StructuredOutputsParams(**value)
    except TypeError:
        raise InvalidParam(
            "structured_outputs takes one of json, regex, choice, grammar, json_object (and "
            f"disable_any_whitespace); got {sorted(value)}",
            "structured_outputs",
        ) from None
    except ValueError as e:
        raise InvalidParam(str(e), "structured_outputs") from None


def response_format_field(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""
    kind = None if value is None else value.get("type")
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidParam(
                "response_format json_schema needs json_schema.schema (a JSON schema object)",
                "response_format",
            )
        return StructuredOutputsParams(json=schema)
    raise InvalidParam(
        "response_format type must be 'text', 'json_object' or 'json_schema'", "response_format"
    )
