"""The GPTQ checkpoint layout (AutoGPTQ / GPTQModel, ``quant_method: "gptq"``), read into the
engine's int4 layout (int4.py). For a linear layer of weight [N, K], groups of G columns:

    qweight [K / 8, N] int32   packed along the inputs: bits 4j..4j+3 of qweight[i, n] hold
                               q[n, 8i + j]
    qzeros  [K / G, N / 8] int32, packed along the outputs: bits 4j.. of qzeros[g, c] hold
                               the zero point of output 8c + j, minus one in the original
                               ``checkpoint_format: "gptq"`` (stored z - 1, read back + 1,
                               modulo 16); as it is in "gptq_v2"
    scales  [K / G, N] float16
    g_idx   [K] int32          the group of each input column: i // G, or with act-order
                               (``desc_act``) the groups in the order GPTQ quantized the columns

    w[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]]

Symmetric checkpoints (``sym: true``) still store zero points, all 8.
"""

from __future__ import annotations

import torch

from pydaemon.config.weight_only_format import Int4Checkpoint
from pydaemon.quantization.int4 import unpack_int4


class _GptqReader:
    def roles(self, fmt: Int4Checkpoint) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    def required(self, fmt: Int4Checkpoint) -> tuple[str, ...]:
        return (
            ("qweight", "qzeros", "scales", "g_idx")
            if fmt.desc_act
            else ("qweight", "qzeros", "scales")
        )

    def shapes(self, shape: tuple[int, int], group: int, fmt: Int4Checkpoint) -> dict:
        n, k = shape
        return {
            "qweight": (k // 8, n),
            "qzeros": (k // group, n // 8),
            "scales": (k // group, n),
            "g_idx": (k,),
        }

    def unpack(self, tensors: dict, shape: tuple[int, int], fmt: Int4Checkpoint) -> tuple:
        """-> (q [N, K] uint8, scales [N, K / G], zeros [N, K / G] uint8, g_idx [K] or None)."""
        q = unpack_int4(tensors["qweight"].t())
        zeros = (unpack_int4(tensors["qzeros"]).t().to(torch.int32) + fmt.zero_offset) & 0xF
        return q, tensors["scales"].t(), zeros.to(torch.uint8), tensors.get("g_idx")


READER = _GptqReader()
