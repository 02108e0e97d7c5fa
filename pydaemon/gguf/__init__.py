"""GGUF checkpoints (llama.cpp's single-file format): config, weights and tokenizer.

The weights (``pydaemon.gguf.weights.iter_gguf_weights``) are imported from their module by
the loader: they need torch, and this package is also read by the daemon's front end (GGUF
metadata, tokenizer), which does not load torch.
"""

from pydaemon.gguf.config import GGUF_ARCHITECTURES, load_gguf_config
from pydaemon.gguf.reader import SUPPORTED_TENSOR_TYPES, GGUFFile, is_gguf_file
from pydaemon.gguf.tokenizer import load_gguf_tokenizer

__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "GGUFFile",
    "is_gguf_file",
    "load_gguf_config",
    "load_gguf_tokenizer",
]
