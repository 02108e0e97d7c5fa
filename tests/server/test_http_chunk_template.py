"""The fast stream-chunk path writes exactly what the pydantic models would."""

from __future__ import annotations

import pytest

from pydaemon.entrypoints.openai.chunk_template import IDS_MARKER, TEXT_MARKER, ChunkTemplate
from pydaemon.entrypoints.openai.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)

# Every BMP character outside the surrogates (decoded text never holds a lone surrogate),
# in runs, plus the cases JSON escapes and a few astral ones.
_ALL = "".join(chr(c) for c in range(0xD800)) + "".join(chr(c) for c in range(0xE000, 0x10000))
TEXTS = ["", "abc", ' "quoted" \\ back', "tab\tnew\nline\r\x00\x1f\x7f", "é中🙂\U0010ffff",
         *(_ALL[i : i + 4096] for i in range(0, len(_ALL), 4096))]  # fmt: skip


def _completion(index: int, text, token_ids) -> CompletionResponse:
    choice = CompletionChoice(index=index, text=text, token_ids=token_ids)
    return CompletionResponse(id="cmpl-1", created=7, model="m", choices=[choice])


@pytest.mark.parametrize("text", TEXTS)
def test_completion_chunk_with_and_without_token_ids(text):
    no_ids = {"choices": {"__all__": {"token_ids"}}}
    plain = ChunkTemplate(_completion(3, TEXT_MARKER, None), no_ids)
    assert plain.render(text) == _completion(3, text, None).model_dump_json(exclude=no_ids)
    with_ids = ChunkTemplate(_completion(0, TEXT_MARKER, IDS_MARKER), has_ids=True)
    for ids in ([], [5], [0, 511, 70000]):
        assert with_ids.render(text, ids) == _completion(0, text, ids).model_dump_json()


@pytest.mark.parametrize("text", TEXTS)
def test_chat_chunk(text):
    def chunk(content):
        choice = ChatChunkChoice(index=1, delta=DeltaMessage(content=content))
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[choice])

    assert ChunkTemplate(chunk(TEXT_MARKER)).render(text) == chunk(text).model_dump_json()
