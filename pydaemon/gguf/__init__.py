"""GGUF checkpoints (llama.cpp's single-file format): config, weights and tokenizer."""

from pydaemon.gguf.config import GGUF_ARCHITECTURES, load_gguf_config
from pydaemon.gguf.reader import SUPPORTED_TENSOR_TYPES, GGUFFile, is_gguf_file
from pydaemon.gguf.tokenizer import load_gguf_tokenizer
from pydaemon.gguf.weights import iter_gguf_weights

__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "GGUFFile",
    "is_gguf_file",
    "iter_gguf_weights",
    "load_gguf_config",
    "load_gguf_tokenizer",
]
