"""SentencePiece tokenizer of a model directory (``tokenizer.model``).

BOS/EOS come from ``generation_config.json``, then ``config.json``, then the SentencePiece
model itself, in that order of preference. ``eos_token_id`` may be a list in the configs;
``eos_token_ids`` holds all of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sentencepiece as spm

from pydaemon.model_config import normalize_eos

TOKENIZER_FILE = "tokenizer.model"


class Tokenizer:
    def __init__(self, model_file: str | Path, model_dir: str | Path | None = None) -> None:
        model_file = Path(model_file)
        if not model_file.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {model_file}")
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        configs = _read_configs(Path(model_dir) if model_dir else model_file.parent)
        bos = _first_present(configs, "bos_token_id")
        sp_bos = self.sp.bos_id()
        self.bos_token_id: int | None = (
            bos if bos is not None else (sp_bos if sp_bos >= 0 else None)
        )
        eos = normalize_eos(_first_present(configs, "eos_token_id"))
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

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

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


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """-> the directory's tokenizer, or None when it has no ``tokenizer.model``."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    return Tokenizer(path, model_dir)


def _read_configs(model_dir: Path) -> list[dict[str, Any]]:
    out = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                out.append(json.load(f))
    return out


def _first_present(configs: list[dict[str, Any]], key: str) -> Any:
    for cfg in configs:
        if cfg.get(key) is not None:
            return cfg[key]
    return None
