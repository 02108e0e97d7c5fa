"""compressed-tensors' ``pack-quantized`` 4-bit layout (llm-compressor W4A16), read into the
engine's int4 layout (int4.py), which it already is up to the zero points. For a linear layer
of weight [N, K], groups of G input columns (strategy "group"; "channel": G = K):

    weight_packed     [N, K / 8] int32     bits 4j..4j+3 of weight_packed[n, i] hold
                                           q[n, 8i + j] + 8 (q signed, -8..7)
    weight_scale      [N, K / G]           the model dtype
    weight_zero_point [ceil(N / 8), K / G] int32, asymmetric only: packed along the outputs,
                                           bits 4j.. of [r, g] hold zero[8r + j, g] + 8
    weight_g_idx      [K] int32            actorder "group" only: each input column's group
    weight_shape      [2]                  [N, K]

    w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]     (zero 0 when symmetric)

In unsigned terms (what the engine keeps) the stored nibbles are the codes and the zero points
as they are, 8 when symmetric.
"""

from __future__ import annotations

import torch

from pydaemon.config.weight_only_format import Int4Checkpoint
from pydaemon.quantization.int4 import unpack_int4


class _CompressedTensorsReader:
    def roles(self, fmt: Int4Checkpoint) -> tuple[str, ...]:
        return (
            "weight_packed",
            "weight_scale",
            "weight_zero_point",
            "weight_g_idx",
            "weight_shape",
        )

    def required(self, fmt: Int4Checkpoint) -> tuple[str, ...]:
        roles = ["weight_packed", "weight_scale"]
        if fmt.has_zero_point:
            roles.append("weight_zero_point")
        if fmt.desc_act:
            roles.append("weight_g_idx")
        return tuple(roles)

    def shapes(self, shape: tuple[int, int], group: int, fmt: Int4Checkpoint) -> dict:
        n, k = shape
        return {
            "weight_packed": (n, k // 8),
            "weight_scale": (n, k // group),
            "weight_zero_point": (-(-n // 8), k // group),
            "weight_g_idx": (k,),
            "weight_shape": (2,),
        }

    def unpack(self, tensors: dict, shape: tuple[int, int], fmt: Int4Checkpoint) -> tuple:
        """-> (q [N, K] uint8, scales [N, K / G], zeros [N, K / G] uint8, g_idx [K] or None)."""
        n, k = shape
        if "weight_shape" in tensors and tensors["weight_shape"].tolist() != [n, k]:
            raise ValueError(
                f"weight_shape {tensors['weight_shape'].tolist()} does not match the model's "
                f"[{n}, {k}]"
            )
        q = unpack_int4(tensors["weight_packed"])
        scales = tensors["weight_scale"]
        if fmt.has_zero_point:
            zeros = unpack_int4(tensors["weight_zero_point"].t()).t()[:n]
        else:
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8, device=q.device)
        return q, scales, zeros, tensors.get("weight_g_idx")


READER = _CompressedTensorsReader()
