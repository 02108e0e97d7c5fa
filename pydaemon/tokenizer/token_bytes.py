"""The raw bytes each token id writes, for every id of a tokenizer's vocabulary.

A grammar matcher (pydaemon.structured_output) must know what text a token adds to decide
whether the grammar allows it; decoding token by token loses that (a byte-level token may be
half a UTF-8 character, SentencePiece drops a leading space). Special tokens (control, BOS,
EOS, chat markers) write nothing a grammar can use: ``b""``. Supported: byte-level BPE
(GPT-2 alphabet: Llama 3, Qwen, SmolLM2, GGUF ``gpt2``), SentencePiece-style pieces with
``▁`` and ``<0xNN>`` byte fallback (``tokenizer.model`` and such ``tokenizer.json`` files),
and otherwise each token's own decoded text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydaemon.tokenizer.hf import HFTokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # SentencePiece's ▁


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: the character that spells each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer: Any) -> list[bytes]:
    """-> [tokenizer.vocab_size] the bytes of each token id; b"" for special tokens."""
    if isinstance(tokenizer, HFTokenizer):
        return _hf_token_bytes(tokenizer)
    return _sentencepiece_token_bytes(tokenizer.sp)


def _piece_bytes(piece: str) -> bytes:
    """A SentencePiece-style piece: ``<0xNN>`` is one byte, ``▁`` a space."""
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(_SPACE, " ").encode("utf-8")


def _sentencepiece_token_bytes(sp: Any) -> list[bytes]:
    out = []
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            out.append(b"")
        elif sp.is_byte(i):
            out.append(_piece_bytes(sp.id_to_piece(i)))
        else:
            out.append(sp.id_to_piece(i).replace(_SPACE, " ").encode("utf-8"))
    return out


def _decoder_kind(decoder: dict | None) -> str:
    """'byte_level', 'sentencepiece' or 'text', from tokenizer.json's decoder."""
    if decoder is None:
        return "text"
    kinds = [decoder["type"]]
    if decoder["type"] == "Sequence":
        kinds = [d["type"] for d in decoder.get("decoders", [])]
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "text"


def _hf_token_bytes(tokenizer: HFTokenizer) -> list[bytes]:
    tok = tokenizer.tokenizer
    kind = _decoder_kind(json.loads(tok.to_str()).get("decoder"))
    added = tok.get_added_tokens_decoder()
    alphabet = byte_level_alphabet()
    out = [b""] * tokenizer.vocab_size
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if not 0 <= i < len(out):
            continue
        if i in added:  # added tokens are matched whole, written as their content
            out[i] = b"" if added[i].special else added[i].content.encode("utf-8")
        elif kind == "byte_level":
            out[i] = bytes(alphabet[c] for c in piece) if set(piece) <= alphabet.keys() else b""
        elif kind == "sentencepiece":
            out[i] = _piece_bytes(piece)
        else:
            out[i] = tok.decode([i], skip_special_tokens=False).encode("utf-8")
    return out
