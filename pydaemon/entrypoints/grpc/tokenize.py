"""Tokenize: a text's token ids and pieces, as Generate would tokenize it, and whether a BOS
was prepended (add_bos adds what the model's tokenizer adds: many models add none)."""

from __future__ import annotations

from typing import Any

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


def tokenize(tokenizer: Any, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
    """Blocking (run it in the executor). Tokenizers are read-only after loading, so encoding
    here races with nothing."""
    ids = tokenizer.encode(request.text, add_bos=request.add_bos)
    bos = tokenizer.bos_token_id
    added_bos = (
        request.add_bos
        and bos is not None
        and ids[:1] == [bos]
        and len(ids) > len(tokenizer.encode(request.text, add_bos=False))
    )
    pieces = [tokenizer.decode([t]) for t in ids]
    return pb.TokenizeResponse(token_ids=ids, pieces=pieces, added_bos=added_bos)
