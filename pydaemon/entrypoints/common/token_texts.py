"""The text of each generated token in context, for logprobs (OpenAI's and gRPC's).

A token's text is what it adds after the tokens before it: decoded alone, a SentencePiece
piece loses its leading space ("▁the" -> "the"), so each token is decoded after a short window
of its predecessors and the window's own text is cut off. Without a tokenizer a token is
written ``token_id:<id>`` (vLLM's convention).
"""

from __future__ import annotations

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
