"""GGUF checkpoints (llama.cpp's single-file format): config and weights (the tokenizer
in its metadata: pydaemon.tokenizer.gguf).

The weights (``pydaemon.gguf.weights.iter_gguf_weights``) are imported from their module by
the loader: they need torch, and this package is also read by the daemon's front end (GGUF
metadata, tokenizer), which does not load torch.
"""

from pydaemon.gguf.config import GGUF_ARCHITECTURES, load_gguf_config
from pydaemon.gguf.reader import SUPPORTED_TENSOR_TYPES, GGUFFile, is_gguf_file

__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "GGUFFile",
    "is_gguf_file",
    "load_gguf_config",
]
