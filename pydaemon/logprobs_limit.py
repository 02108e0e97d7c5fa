"""The most logprobs a request may ask for (vLLM's ``--max-logprobs``, default 20): for
``logprobs`` (top_logprobs in chat) and ``prompt_logprobs`` alike; -1 lifts the limit to the
vocabulary. A request over it is refused with vLLM's words before it takes a KV block."""

from __future__ import annotations

DEFAULT_MAX_LOGPROBS = 20  # vLLM's default


def check_max_logprobs_setting(value: object) -> None:
    """ValueError unless ``value`` is a valid --max-logprobs (an integer >= -1)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(
            f"max_logprobs must be -1 (no limit but the vocabulary) or an integer >= 0 "
            f"(got {value!r})"
        )


def resolve_max_logprobs(configured: int, vocab_size: int) -> int:
    """The limit in force: ``configured``, or the vocabulary size where it is -1."""
    return vocab_size if configured == -1 else configured


def logprobs_over_limit(kind: str, value: int, limit: int) -> str | None:
    """vLLM's message for ``value`` logprobs over ``limit`` (``kind``: "sample" or
    "prompt"), or None where it is within."""
    if value <= limit:
        return None
    return (
        f"Requested {kind} logprobs of {value}, which is greater than max allowed: {limit} "
        "(the server's --max-logprobs)"
    )
