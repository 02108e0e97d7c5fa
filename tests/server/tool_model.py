"""A tiny random model with Qwen's chat template (it renders tools and tool calls), for tool
calling tests: the tokenizer of tests/tokenizer_utils.py and a model of exactly its vocabulary
(every id the model can sample has text)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny models, tokenizers
from model_utils import save_hf_model  # noqa: E402
from tokenizer_utils import build_hf_tokenizer  # noqa: E402

from pydaemon.tokenizer.hf import HFTokenizer  # noqa: E402


def build_tool_model(tmp: Path) -> Path:
    """-> the model directory (its served name is the directory's name)."""
    probe = build_hf_tokenizer(tmp / "tokenizer", "qwen2")
    vocab_size = HFTokenizer.from_dir(probe).vocab_size
    model_dir = save_hf_model(tmp, vocab_size=vocab_size, max_position_embeddings=4096)
    build_hf_tokenizer(model_dir, "qwen2")
    return model_dir
