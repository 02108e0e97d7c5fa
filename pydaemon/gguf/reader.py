"""A GGUF file opened for loading: its metadata, and its tensors dequantized to torch.

Read with the format's own reader (``gguf.GGUFReader``, memory-mapped: nothing is copied
until a tensor is asked for), once its header is within bounds (bounds.py). Quantized tensors are dequantized block by block with
``gguf.quants.dequantize`` (the same routine transformers' GGUF loader uses), then cast to
the serving dtype; only the types in ``SUPPORTED_TENSOR_TYPES`` are accepted, every other is
an error naming it and the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from pydaemon.gguf.bounds import check_file

if TYPE_CHECKING:
    import torch

GGUF_SUFFIX = ".gguf"
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


class GGUFFile:
    """Metadata (``get``) and tensors (``names``, ``load``) of one ``.gguf`` file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            check_file(self.path)  # every count bounded before the reader trusts them
            self.reader = GGUFReader(self.path)
        except ValueError as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from None
        except Exception as e:  # noqa: BLE001 - whatever else the reader trips on, one line
            raise ValueError(
                f"{self.path} is not a readable GGUF file: {type(e).__name__}: {e}"
            ) from None
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self.architecture: str = self.require("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        """-> the metadata value under ``key`` (str, number, bool or list), else ``default``."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path.name} lacks the GGUF metadata key {key!r}")
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """-> the tensor's shape in torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def check_tensor_types(self) -> None:
        """Every tensor's type must be one we dequantize: else a ValueError naming them."""
        bad = sorted(
            {
                (t.tensor_type.name, t.name)
                for t in self.reader.tensors
                if t.tensor_type not in SUPPORTED_TENSOR_TYPES
            }
        )
        if bad:
            types = sorted({kind for kind, _ in bad})
            shown = ", ".join(f"{name} ({kind})" for kind, name in bad[:3])
            supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
            raise ValueError(
                f"{self.path.name}: unsupported GGUF tensor type(s) {', '.join(types)} "
                f"(in {shown}{', ...' if len(bad) > 3 else ''}); supported: {supported}"
            )

    def load(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> the tensor dequantized to ``dtype`` (float32 by default), shape
        ``self.shape(name)``, on the CPU. (torch is imported here, not with the module: the
        daemon's front end reads GGUF metadata and tokenizers without loading torch.)"""
        import torch

        tensor = self.tensors[name]
        kind = tensor.tensor_type
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"{self.path.name}: tensor {name!r} has unsupported GGUF type {kind.name}"
            )
        values = dequantize(np.asarray(tensor.data), kind)  # float32
        # np.array copies out of the read-only memory map (float32 was a view of it).
        out = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype or torch.float32)
        return out.reshape(self.shape(name))
