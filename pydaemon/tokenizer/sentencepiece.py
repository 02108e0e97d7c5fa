"""The SentencePiece tokenizer of a model directory (``tokenizer.model``).

BOS comes from ``generation_config.json``, then ``config.json``, then the SentencePiece model.
EOS: every id of ``generation_config.json`` and ``config.json`` (``eos_token_id`` may be a list),
else the SentencePiece model's; ``eos_token_ids`` holds all of them. The chat template and the
named special tokens come from ``tokenizer_config.json`` when there is one.

Special tokens written in the text (``<s>``, ``</s>``: chat templates write them) encode to
their ids, as transformers does: the text is split around them, and a part after a special
token gets no SentencePiece dummy prefix (with ``legacy: true`` in ``tokenizer_config.json``
it gets one unless it starts with a space).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import sentencepiece as spm

from pydaemon.tokenizer.chat_template import load_chat_template, render_chat_template
from pydaemon.tokenizer.files import (
    model_bos_token_id,
    model_eos_token_ids,
    named_special_tokens,
    read_tokenizer_config,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.model"


class SentencePieceTokenizer:
    def __init__(self, model_file: str | Path, model_dir: str | Path | None = None) -> None:
        model_file = Path(model_file)
        if not model_file.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {model_file}")
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        model_dir = Path(model_dir) if model_dir else model_file.parent
        self.name = model_dir.name
        bos = model_bos_token_id(model_dir)
        sp_bos = self.sp.bos_id()
        self.bos_token_id: int | None = (
            bos if bos is not None else (sp_bos if sp_bos >= 0 else None)
        )
        eos = model_eos_token_ids(model_dir)
        if not eos and self.sp.eos_id() >= 0:
            eos = [self.sp.eos_id()]
        self.eos_token_ids: set[int] = set(eos)
        self.eos_token_id: int | None = eos[0] if eos else None
        self.vocab_size: int = self.sp.get_piece_size()
        self.special_token_ids: set[int] = {
            i for i in range(self.vocab_size) if self.sp.is_control(i)
        } | self.eos_token_ids
        if self.bos_token_id is not None:
            self.special_token_ids.add(self.bos_token_id)
        # SentencePiece decodes byte pieces one by one (unlike tokenizers' ByteFallback runs),
        # so no token's text waits on the next: see HFTokenizer.byte_run_token_ids.
        self.byte_run_token_ids: set[int] = set()
        tokenizer_config = read_tokenizer_config(model_dir)
        self.init_kwargs: dict = dict(tokenizer_config or {})  # as transformers keeps it
        self.chat_template: str | None = load_chat_template(model_dir, tokenizer_config)
        self.special_tokens_map: dict[str, str] = {
            **self._own_special_tokens(),
            **named_special_tokens(tokenizer_config),
        }
        self.legacy = bool(tokenizer_config.get("legacy", False)) if tokenizer_config else False
        # Special-token strings that are one piece of the model, longest first for the split.
        self._special_text_ids: dict[str, int] = {}
        for piece in self.special_tokens_map.values():
            token_id = self.sp.piece_to_id(piece) if isinstance(piece, str) and piece else -1
            if 0 <= token_id < self.vocab_size and self.sp.id_to_piece(token_id) == piece:
                self._special_text_ids[piece] = token_id
        self._special_split = (
            re.compile(
                "("
                + "|".join(map(re.escape, sorted(self._special_text_ids, key=len, reverse=True)))
                + ")"
            )
            if self._special_text_ids
            else None
        )
        unk = self.sp.unk_id()
        self._unk_piece = self.sp.id_to_piece(unk) if unk >= 0 else None
        # ids the text of ``<unk>`` encodes to: dropped after encoding "<unk>" + a part
        self._unk_text_len = len(self.sp.encode(self._unk_piece)) if self._unk_piece else 0

    def _own_special_tokens(self) -> dict[str, str]:
        out = {}
        if self.bos_token_id is not None:
            out["bos_token"] = self.sp.id_to_piece(self.bos_token_id)
        if self.eos_token_id is not None:
            out["eos_token"] = self.sp.id_to_piece(self.eos_token_id)
        if self.sp.unk_id() >= 0:
            out["unk_token"] = self.sp.id_to_piece(self.sp.unk_id())
        return out

    @property
    def special_token_texts(self) -> frozenset[str]:
        """Texts that ``encode`` turns into a control token (``<s>``, ``</s>``)."""
        return frozenset(self._special_text_ids)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._encode_parsed(text, is_start=True)
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """One text given in consecutive parts, each ``(text, parse_special_tokens)``: a part
        with False is plain text even where it spells a special token. No BOS is added."""
        ids: list[int] = []
        for k, (text, parse_special) in enumerate(segments):
            if parse_special:
                ids.extend(self._encode_parsed(text, is_start=k == 0))
            else:
                ids.extend(self.sp.encode(text) if k == 0 else self._encode_no_prefix(text))
        return ids

    def _encode_parsed(self, text: str, is_start: bool) -> list[int]:
        """Special-token text -> its id; ``is_start``: the text begins the prompt (it gets
        SentencePiece's dummy prefix)."""
        parts = self._special_split.split(text) if self._special_split is not None else [text]
        if len(parts) == 1:
            return self.sp.encode(text) if is_start else self._encode_no_prefix(text)
        ids = []  # parts: [text, special, text, special, ..., text]
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self._special_text_ids[part])
            elif part:
                # legacy: a dummy prefix unless the part starts with a space already
                prefix = (k == 0 and is_start) or (
                    k > 0 and self.legacy and not part.startswith(" ")
                )
                ids.extend(self.sp.encode(part) if prefix else self._encode_no_prefix(part))
        return ids

    def _encode_no_prefix(self, text: str) -> list[int]:
        """``text`` without SentencePiece's dummy prefix (the way transformers does it: encode
        after an ``<unk>`` and drop the ids of the ``<unk>`` text)."""
        if self._unk_piece is None:
            return self.sp.encode(text)
        return self.sp.encode(self._unk_piece + text)[self._unk_text_len :]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_token_ids])
        # Special tokens are written as their piece; the runs between them decode normally.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_token_ids:
                if run:
                    parts.append(self.sp.decode(run))
                    run = []
                parts.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            parts.append(self.sp.decode(run))
        return "".join(parts)

    def id_to_piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (see :meth:`HFTokenizer.apply_chat_template`)."""
        return render_chat_template(
            self.chat_template,
            messages,
            model_name=self.name,
            special_tokens=self.special_tokens_map,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )
