"""``load_tokenizer``: the tokenizer of a model directory or .gguf file, whichever kind it has
(``encode_chat``, a conversation rendered and encoded, is in ``chat_encoding``)."""

from __future__ import annotations

import logging
from pathlib import Path

from pydaemon.gguf.reader import GGUFFile, is_gguf_file
from pydaemon.tokenizer.gguf import load_gguf_tokenizer
from pydaemon.tokenizer.hf import TOKENIZER_JSON, HFTokenizer
from pydaemon.tokenizer.sentencepiece import TOKENIZER_FILE, SentencePieceTokenizer

logger = logging.getLogger(__name__)

AnyTokenizer = SentencePieceTokenizer | HFTokenizer


def load_tokenizer(model_dir: str | Path) -> AnyTokenizer | None:
    """-> the directory's tokenizer: ``tokenizer.json`` (preferred, as transformers does) or
    ``tokenizer.model``; None, with a warning, when it has neither. A .gguf file: the
    tokenizer in its metadata."""
    model_dir = Path(model_dir)
    if is_gguf_file(model_dir):
        return load_gguf_tokenizer(GGUFFile(model_dir))
    if (model_dir / TOKENIZER_JSON).is_file():
        return HFTokenizer.from_dir(model_dir)
    path = model_dir / TOKENIZER_FILE
    if path.is_file():
        return SentencePieceTokenizer(path, model_dir)
    logger.warning(
        "model %s has no tokenizer (neither tokenizer.json nor tokenizer.model): "
        "requests must send token ids, and responses carry no text",
        model_dir,
    )
    return None
