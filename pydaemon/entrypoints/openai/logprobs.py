"""Engine logprobs ({token_id: logprob} per position) -> OpenAI's completion and chat formats.

A token's text is what it adds after the tokens before it: decoded alone, a SentencePiece
piece loses its leading space ("▁the" -> "the"), so each token is decoded after a short window
of its predecessors and the window's own text is cut off. Without a tokenizer a token is
written ``token_id:<id>`` (vLLM's convention).
"""

from __future__ import annotations

from pydaemon.entrypoints.openai.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)
from pydaemon.outputs import TokenLogprobs

_WINDOW = 4  # predecessors decoded with each token


class TokenTexts:
    """The text of each generated token of one sequence, in context."""

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.context = list(prompt_token_ids[-_WINDOW:])

    def texts(
        self, token_ids: list[int], alternatives: list[TokenLogprobs]
    ) -> list[dict[int, str]]:
        """For each position: {token_id: text} of the chosen token and its alternatives."""
        out = []
        for chosen, position in zip(token_ids, alternatives, strict=False):
            out.append({t: self._text(t) for t in {chosen, *position}})
            self.context = [*self.context, chosen][-_WINDOW:]
        return out

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        decode = self.tokenizer.decode
        before = decode(self.context, skip_special_tokens=False)
        return decode([*self.context, token_id], skip_special_tokens=False)[len(before) :]


def _top(position: TokenLogprobs, k: int | None) -> list[tuple[int, float]]:
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
    texts: TokenTexts, token_ids: list[int], positions: list[TokenLogprobs], top_k: int
) -> ChatLogprobs:
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
