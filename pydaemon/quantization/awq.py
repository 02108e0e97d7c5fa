"""AutoAWQ's GEMM checkpoint layout (``quant_method: "awq"``, ``version: "gemm"``), read into
the engine's int4 layout (int4.py). For a linear layer of weight [N, K], groups of G input
columns:

    qweight [K, N / 8] int32   packed along the outputs: bits 4i..4i+3 of qweight[k, c] hold
                               q[8c + AWQ_ORDER[i], k] (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7)
    qzeros  [K / G, N / 8] int32, packed the same way: the zero point of each group, 0..15
    scales  [K / G, N] float16

    w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]
"""

from __future__ import annotations

import torch

from pydaemon.config.weight_only_format import Int4Checkpoint
from pydaemon.quantization.int4 import unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column of each nibble within its word
_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(j) for j in range(8))  # 0, 4, 1, 5, 2, 6, 3, 7


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] int32 packed in AWQ's order -> [R, N] uint8."""
    nibbles = unpack_int4(packed).reshape(packed.shape[0], -1, 8)  # by nibble position
    order = torch.tensor(_NIBBLE_OF_COLUMN, device=packed.device)
    return nibbles.index_select(2, order).reshape(packed.shape[0], -1)


class _AwqReader:
    def roles(self, fmt: Int4Checkpoint) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def required(self, fmt: Int4Checkpoint) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def shapes(self, shape: tuple[int, int], group: int, fmt: Int4Checkpoint) -> dict:
        n, k = shape
        return {"qweight": (k, n // 8), "qzeros": (k // group, n // 8), "scales": (k // group, n)}

    def unpack(self, tensors: dict, shape: tuple[int, int], fmt: Int4Checkpoint) -> tuple:
        """-> (q [N, K] uint8, scales [N, K / G], zeros [N, K / G] uint8, g_idx None)."""
        q = unpack_awq(tensors["qweight"]).t()
        zeros = unpack_awq(tensors["qzeros"]).t()
        return q, tensors["scales"].t(), zeros, None


READER = _AwqReader()
