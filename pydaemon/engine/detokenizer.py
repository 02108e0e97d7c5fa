"""Incremental detokenization: token ids in, text deltas out.

Each step decodes only a small window of recent tokens (vLLM's prefix/read offsets): the text
of ``tokens[prefix_offset:read_offset]`` (already emitted) and of ``tokens[prefix_offset:]``;
the delta is the difference. Decoding both from the same start token makes SentencePiece's
stripping of a leading space cancel out, so the first generated token keeps its space. A
window whose text ends in U+FFFD (an incomplete UTF-8 sequence from byte-fallback pieces) is
held back until the character is complete, and so is a window that ends in a byte-fallback
piece (``<0xE2>``): the decoder turns a whole run of them into text or, if the run is not
valid UTF-8, into one U+FFFD per byte, so a run's text is known only once it has ended. With ``skip_special_tokens`` the special ids are
dropped on the way in (the tokenizers drop them before decoding too), so a window never starts
with a skipped token, which would let the decoder strip the next token's leading space.
"""

from __future__ import annotations

from pydaemon.tokenizer.loader import AnyTokenizer

# Prompt tokens decoded before the first generated one, so its leading space is kept.
_INITIAL_WINDOW = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: AnyTokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skipped: set[int] = tokenizer.special_token_ids if skip_special_tokens else set()
        self.token_ids: list[int] = [t for t in prompt_token_ids if t not in self._skipped]
        self.prefix_offset = max(len(self.token_ids) - _INITIAL_WINDOW, 0)
        self.read_offset = len(self.token_ids)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_ids: list[int]) -> str:
        """Appends generated tokens; returns the new text (possibly empty)."""
        self.token_ids.extend(t for t in token_ids if t not in self._skipped)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a sequence: returns text held back for an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        new_text = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if not final and (
            new_text.endswith(_REPLACEMENT)
            or self.token_ids[-1] in self.tokenizer.byte_run_token_ids
        ):
            return ""
        # The window may hold a partial character from the prompt: compare lengths, not bytes.
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if delta:
            self._chunks.append(delta)
        return delta
