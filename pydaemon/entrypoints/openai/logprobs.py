"""Engine logprobs ({token_id: logprob} per position) -> OpenAI's completion and chat formats;
each token's text comes from entrypoints/common/token_texts.py (in context)."""

from __future__ import annotations

from pydaemon.entrypoints.common.token_texts import TokenTexts
from pydaemon.entrypoints.openai.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)
from pydaemon.outputs import TokenLogprobs


def _top(position: TokenLogprobs, k: int | list[int] | None) -> list[tuple[int, float]]:
    """The ``k`` most likely (all: None), or the token ids ``k`` lists, in its order."""
    if isinstance(k, list):
        return [(t, position[t]) for t in k if t in position]
    ranked = sorted(position.items(), key=lambda kv: -kv[1])
    return ranked if k is None else ranked[:k]


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], positions: list[TokenLogprobs], text_offset: int
) -> CompletionLogprobs:
    """``text_offset``: characters of the choice's text before the first of these tokens."""
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for token_id, position, names in zip(
        token_ids, positions, texts.texts(token_ids, positions), strict=False
    ):
        out.tokens.append(names[token_id])
        out.token_logprobs.append(position.get(token_id))
        out.text_offset.append(text_offset)
        out.top_logprobs.append(_by_text(names, _top(position, None)))
        text_offset += len(names[token_id])
    return out


def _by_text(names: dict[int, str], ranked: list[tuple[int, float]]) -> dict[str, float]:
    """OpenAI's completions format keys alternatives by text; tokens that read the same (byte
    pieces of one character, say) would collapse into one key and lose alternatives, so a
    repeated text is keyed ``token_id:<id>`` instead."""
    out: dict[str, float] = {}
    for token_id, lp in ranked:
        key = names[token_id]
        out[key if key not in out else f"token_id:{token_id}"] = lp
    return out


def chat_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    positions: list[TokenLogprobs],
    top_k: int | list[int],
) -> ChatLogprobs:
    """``top_k``: how many alternatives, or the token ids to list (logprob_token_ids)."""
    content = []
    for token_id, position, names in zip(
        token_ids, positions, texts.texts(token_ids, positions), strict=False
    ):
        token = names[token_id]
        content.append(
            TokenLogprob(
                token=token,
                logprob=position.get(token_id, float("-inf")),
                bytes=list(token.encode()),
                top_logprobs=[
                    TopLogprob(token=names[t], logprob=lp, bytes=list(names[t].encode()))
                    for t, lp in _top(position, top_k)
                ],
            )
        )
    return ChatLogprobs(content=content)
