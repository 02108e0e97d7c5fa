"""Single fields of an OpenAI request body, checked and converted with vLLM's rules and
words: seeds (int64), logprob counts (-1 and the server's maximum), logit_bias keys and size,
``response_format`` and vLLM's ``structured_outputs``. ``InvalidParam`` names the field."""

from __future__ import annotations

import re
from typing import Any

from pydaemon.entrypoints.common.limits import LimitError
from pydaemon.logprobs_limit import logprobs_over_limit
from pydaemon.sampling_params import MAX_LOGIT_BIAS_TOKENS, StructuredOutputsParams


class InvalidParam(LimitError):
    """A request field with a bad value; ``param`` names the field."""


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# A token id as a logit_bias key: ASCII decimal digits, no sign, space or leading zero (int()
# would also read " 5", "+5", "05" and "\u0665" as 5, and "05" would then collide with "5").
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")
_LOGIT_BIAS_OBJECT = re.compile(rb'"logit_bias"\s*:\s*\{')


def is_token_id_text(key: str) -> bool:
    return _TOKEN_ID_KEY.fullmatch(key) is not None


def check_logit_bias_size(body: bytes) -> None:
    """Refuses a raw request body whose logit_bias has more than MAX_LOGIT_BIAS_TOKENS
    entries, before it is parsed: a million keys (14 MB) take ~1.5 s to parse while holding the
    GIL (a thread would stall the event loop as much), this scan ~10 ms. An entry is a colon
    between the object's brace and the first closing one; keys are digits, so a key holding a
    colon or a brace is refused later anyway: miscounting such a body refuses nothing valid.
    A body that hides the key from this scan (a \\u escape in its name) is still refused by
    the field's own bound, after parsing."""
    for match in _LOGIT_BIAS_OBJECT.finditer(body):
        end = body.find(b"}", match.end())
        num_entries = body.count(b":", match.end(), len(body) if end < 0 else end)
        if num_entries > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidParam(
                f"logit_bias has more than {MAX_LOGIT_BIAS_TOKENS} entries (at most "
                f"{MAX_LOGIT_BIAS_TOKENS} token ids may be biased)",
                "logit_bias",
            )


def int64_seed(seed: int | None) -> int | None:
    """vLLM takes any int64 seed; -1 means none (a random stream). A negative seed is the
    same 64 bits as an unsigned one (SamplingParams.seed is in [0, 2**64))."""
    if seed is None or seed == -1:
        return None
    if not INT64_MIN <= seed <= INT64_MAX:
        raise InvalidParam(f"seed must be in [-2**63, 2**63 - 1] (got {seed})", "seed")
    return seed % 2**64


def check_logprobs_count(value: int | None, param: str, vocab_size: int, limit: int) -> int | None:
    """vLLM's rules and words: a count >= 0, or -1 for the whole vocabulary, at most ``limit``
    (the server's --max-logprobs, the vocabulary size where that is -1) -> the count (-1 as
    the vocabulary size)."""
    whole_vocab = value == -1
    if value is not None and value < 0:
        if not whole_vocab:
            raise InvalidParam(f"`{param}` must be a positive value or -1.", param)
        value = vocab_size
    if value is None:
        return None
    over = logprobs_over_limit("prompt" if param == "prompt_logprobs" else "sample", value, limit)
    if over:
        if whole_vocab:  # say where the number came from
            over = over.replace(f"of {value},", f"of {value} ({param} -1: the vocabulary),")
        raise InvalidParam(over, param)
    return value


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
