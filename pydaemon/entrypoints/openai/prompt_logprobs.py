"""Prompt logprobs in vLLM's formats: the ``prompt_logprobs`` field (per prompt token, None
for the first, else ``{token_id: {"logprob", "rank", "decoded_token"}}`` of the token and its
top-k), and the prompt's part of a completion's ``logprobs`` under ``echo``."""

from __future__ import annotations

from typing import Any

from pydaemon.entrypoints.common.token_texts import TokenTexts
from pydaemon.entrypoints.openai.logprobs import completion_logprobs
from pydaemon.entrypoints.openai.responses import CompletionLogprobs
from pydaemon.outputs import TokenLogprobs


def vllm_prompt_logprobs(
    tokenizer, prompt_ids: list[int], positions: list[TokenLogprobs | None], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """``k``: the top-k asked for. ``rank`` is 1 for the most likely token; the prompt token's
    rank is known when it is among the top-k (else None: the top-k is all the engine sends)."""
    texts = TokenTexts(tokenizer, [])
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt_ids, positions, strict=False):
        if entry is None:
            texts.texts([token_id], [{}])  # context for the tokens after it
            out.append(None)
            continue
        [names] = texts.texts([token_id], [entry])
        # The k most likely come first; a prompt token outside them is last.
        rank = {t: i + 1 for i, t in enumerate(sorted(entry, key=lambda t: -entry[t])[:k])}
        out.append(
            {
                str(t): {"logprob": entry[t], "rank": rank.get(t), "decoded_token": names[t]}
                for t in entry
            }
        )
    return out


def echo_logprobs(
    tokenizer, prompt_ids: list[int], positions: list[TokenLogprobs | None]
) -> CompletionLogprobs:
    """The prompt's tokens in a completion's ``logprobs`` (echo): the first has none."""
    texts = TokenTexts(tokenizer, [])
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = 0
    if prompt_ids and positions and positions[0] is None:
        [names] = texts.texts(prompt_ids[:1], [{}])
        first = names[prompt_ids[0]]
        out.tokens.append(first)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(0)
        offset = len(first)
        prompt_ids, positions = prompt_ids[1:], positions[1:]
    rest = completion_logprobs(texts, prompt_ids, positions, offset)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, name).extend(getattr(rest, name))
    return out
