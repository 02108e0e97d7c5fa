"""A tiny random model that thinks: Qwen's tokenizer with "<think>" and "</think>" added (not
special, as in Qwen3 and DeepSeek R1) and a Qwen3-style template whose generation prompt opens
the reasoning ("<think>\\n"), or closes it at once with enable_thinking false."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny models, tokenizers
from model_utils import save_hf_model  # noqa: E402
from tokenizer_utils import build_hf_tokenizer  # noqa: E402

from pydaemon.tokenizer.hf import HFTokenizer  # noqa: E402

THINKING_TEMPLATE = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""


def _tokenizer(out_dir: Path) -> Path:
    build_hf_tokenizer(out_dir, "qwen2")
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(out_dir / "tokenizer.json"))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return out_dir


def build_reasoning_model(tmp: Path) -> Path:
    """-> the model directory (its served name is the directory's name)."""
    vocab_size = HFTokenizer.from_dir(_tokenizer(tmp / "tokenizer")).vocab_size
    model_dir = save_hf_model(tmp, vocab_size=vocab_size, max_position_embeddings=4096)
    _tokenizer(model_dir)
    return model_dir
