"""Request limits that the gRPC and HTTP front ends share, checked before any tokenizing.

One place for the bounds (prompt bytes, stop strings, stop token ids, vocabulary range), so the
two APIs refuse the same requests with the same words. A failed check raises ``LimitError``
(a ValueError) naming the request field in ``param``; each front end words ``param`` its own
way (``sampling.stop`` in gRPC, ``stop`` in HTTP) and maps it to INVALID_ARGUMENT or 400.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# A text longer than max_model_len * this many UTF-8 bytes cannot fit in the context (no real
# token is that long), so it is refused before anyone spends seconds tokenizing it.
MAX_PROMPT_BYTES_PER_TOKEN = 64


class LimitError(ValueError):
    """A request field over a limit; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def max_prompt_bytes(max_model_len: int) -> int:
    return max_model_len * MAX_PROMPT_BYTES_PER_TOKEN


def check_text_size(text: str, max_model_len: int, param: str) -> None:
    """Refuses a text too long for any prompt of this model, before tokenizing it."""
    check_texts_size((text,), max_model_len, param)


def check_texts_size(texts: Iterable[str], max_model_len: int, param: str) -> None:
    """The same for the texts of one prompt together (chat messages)."""
    limit = max_prompt_bytes(max_model_len)
    total = 0
    for text in texts:
        total += len(text)  # characters first: no copy of a huge text
        if total > limit:
            break
    if total > limit or sum(len(t.encode()) for t in texts) > limit:
        raise LimitError(
            f"{param} is over {limit} bytes: it cannot fit in max_model_len {max_model_len} "
            f"tokens (at most {MAX_PROMPT_BYTES_PER_TOKEN} bytes per token are accepted)",
            param,
        )


def check_stop(stop: Sequence[str], param: str) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise LimitError(f"{param} has {len(stop)} strings, at most {MAX_STOP_STRINGS}", param)
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise LimitError(
            f"{param} has a string of {longest} characters, at most {MAX_STOP_STRING_CHARS}",
            param,
        )


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str, max_len: int) -> None:
    if len(ids) > max_len:
        raise LimitError(f"{param} has {len(ids)} ids, at most {max_len}", param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise LimitError(f"{param} {bad[:8]} are outside the vocabulary [0, {vocab_size})", param)


# A chat message's role: the five OpenAI roles or a custom one, which vLLM passes to the chat
# template as it is; a name, so that it cannot write a turn of its own into the prompt (a
# template writes it verbatim, e.g. "<|im_start|>{{ role }}\n").
MAX_ROLE_LEN = 64
_ROLE = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_ROLE_LEN}}}")


def check_chat_role(role: str, param: str) -> None:
    """The one rule of HTTP and gRPC (LimitError naming ``param``)."""
    if not isinstance(role, str) or _ROLE.fullmatch(role) is None:
        raise LimitError(
            f"{param} must be a role name (letters, digits, '_', '.', ':' or '-', 1 to "
            f"{MAX_ROLE_LEN} characters), got {str(role)[:80]!r}",
            param,
        )


# vLLM's messages, which clients match on (its input processor's and completion protocol's).
EMPTY_PROMPT = "The decoder prompt cannot be empty"
EMPTY_TEXT_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


def out_of_vocabulary(bad: Sequence[int], vocab_size: int, where: str) -> str:
    """vLLM's "Token id N is out of vocabulary" (N: the largest bad id), then which field and
    the range."""
    return (
        f"Token id {max(bad)} is out of vocabulary ({where}: ids must be in [0, {vocab_size}); "
        f"out of it: {list(bad[:8])})"
    )


def iter_strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value (dict keys too): what a chat template may copy."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from iter_strings(k)
            yield from iter_strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_strings(v)
