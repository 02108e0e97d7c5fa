"""FP8 (e4m3) experts: per-output-channel or block weight scales.

Parameters: ``w13_weight`` [E, 2 * I, H] and ``w2_weight`` [E, H, I] float8_e4m3fn, and
their float32 scales, one of two layouts (``Fp8MoEMethod.block_shape``):

- per output channel: ``w13_weight_scale`` [E, 2 * I], ``w2_weight_scale`` [E, H]; from
  per-tensor or per-channel FP8 checkpoints, or quantized at load from unquantized weights
  (the linear layers' rules: pydaemon/model_loader/fp8_loading.py);
- per block (bn, bk) of an HF / compressed-tensors block-FP8 checkpoint (128 x 128):
  ``w13_weight_scale`` [E, 2 * I / bn, ceil(H / bk)], ``w2_weight_scale`` [E, ceil(H / bn),
  I / bk], the checkpoint's scales as they are (no re-quantization). Taken when the
  checkpoint is block-wise and this rank's intermediate size is a multiple of bn and of bk
  (the gate and up halves and the tensor-parallel slices fall on block boundaries:
  Qwen3-30B-A3B's 768 and Mixtral's 14336 are); otherwise the loader re-quantizes per
  channel, as for linear layers.

Four ways to run them:

- a few tokens (``0 < T * k <= experts.MOE_DECODE_MAX_SLOTS``, as for bf16, on CUDA with
  pagedd's kernels): the two FP8 decode kernels (``ops.moe_decode_gate_up_fp8``,
  ``ops.moe_decode_down_combine_fp8``: w8a16, 2 launches a layer where the Triton path takes 5);
- ``FP8_MOE_BACKEND = "triton"`` (CUDA, triton importable): the FP8 Triton fused-MoE GEMMs of
  triton_moe_fp8.py, w8a16 for decode-sized steps and w8a8 above, either scale layout;
- ``"grouped"`` (per-channel scales on Hopper, the path before): activations quantized per
  token before the gather, the SiLU-and-mul output per row (one kernel with the product on
  CUDA), ``torch._scaled_grouped_mm`` with row-wise scales:

      y[r, n] = sum_k xq[r, k] * wq[e, n, k] * x_scale[r] * w_scale[e, n]   (rows r of expert e)

- emulation (``quantization="fp8_emulated"``, any device: the CPU tests, and the oracle of the
  GPU paths; also a GPU without either path): the grouped path's quantized activations, the
  FP8 weights dequantized (with either layout), one float32 product per expert group.
"""

from __future__ import annotations

import torch
from torch import nn

from pydaemon import ops
from pydaemon.layers.activation import SiluAndMul
from pydaemon.layers.moe import experts, triton_moe_fp8
from pydaemon.layers.moe.align import moe_align
from pydaemon.layers.moe.experts import _capability_major, moe_combine, per_expert
from pydaemon.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Activation,
    dequantize_blocks,
    emulated_scaled_mm,
    quantize_per_token,
)

_act = SiluAndMul()
# The FP8 experts' GEMMs on CUDA: "triton" (triton_moe_fp8.py) or "grouped" (the
# torch._scaled_grouped_mm path; per-channel scales only). Triton by default: the grouped path
# made FP8 MoE slower than bf16 (W1 15.31 s against 13.28 s, Qwen3-30B-A3B shape, H200,
# 2026-12-04); the A/B is bench/throughput.py / bench_moe.py --moe-fp8-backend.
FP8_MOE_BACKENDS = ("triton", "grouped")
FP8_MOE_BACKEND = "triton"


def _scaled_grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._scaled_grouped_mm with row-wise float32 scales: Hopper (9.x)."""
    return (
        x.is_cuda
        and hasattr(torch, "_scaled_grouped_mm")
        and _capability_major(x.device.index if x.device.index is not None else 0) == 9
    )


def use_fp8_decode_kernels(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H] fp8
    topk_ids: torch.Tensor,  # [T, k]
    block_shape: tuple[int, int] | None,
) -> bool:
    """The two FP8 decode kernels serve this step: few slots (the bf16 decode kernels' bound),
    fp16/bf16 activations on CUDA in 16-byte rows, sizes multiples of 16, kernels built. By
    shapes, dtype and device only (a captured CUDA graph holds one path for its shapes)."""
    h, i = x.shape[1], w13.shape[1] // 2
    return (
        0 < topk_ids.numel() <= experts.MOE_DECODE_MAX_SLOTS
        and x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.stride(-1) == 1
        and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
        and x.data_ptr() % 16 == 0
        and h % 16 == 0
        and i % 16 == 0
        and h <= ops.MOE_DECODE_MAX_HIDDEN
        and (block_shape is None or block_shape[1] % 16 == 0)
        and ops.moe_decode_fp8_kernels_available()
    )


def block_shape_for(checkpoint, intermediate_per_rank: int) -> tuple[int, int] | None:
    """The block scales' (bn, bk) the layer keeps, or None (per channel): a block-wise
    checkpoint whose blocks this rank's gate, up and down slices fall on."""
    if checkpoint is None or checkpoint.strategy != "block" or checkpoint.block_size is None:
        return None
    bn, bk = checkpoint.block_size
    if intermediate_per_rank % bn or intermediate_per_rank % bk:
        return None
    return (bn, bk)


class Fp8MoEMethod:
    """Creates and applies a FusedMoE layer's FP8 weights (vLLM's Fp8MoEMethod)."""

    own_dtype_params = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    def __init__(self, emulate: bool, checkpoint=None) -> None:  # checkpoint: its format
        self.emulate = emulate
        self.checkpoint = checkpoint
        self.block_shape: tuple[int, int] | None = None

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate: int
    ) -> None:
        if not self.emulate and (hidden_size % 16 or intermediate % 16):
            raise ValueError(
                f"quantization='fp8' needs expert sizes (per tensor-parallel rank) that are "
                f"multiples of 16 (FP8 grouped GEMMs); this model has hidden_size "
                f"{hidden_size}, intermediate {intermediate}"
            )
        e, h, i = num_experts, hidden_size, intermediate
        self.block_shape = block_shape_for(self.checkpoint, i)

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        layer.w13_weight = param(e, 2 * i, h, dtype=FP8_DTYPE)
        layer.w2_weight = param(e, h, i, dtype=FP8_DTYPE)
        if self.block_shape is None:
            layer.w13_weight_scale = param(e, 2 * i, dtype=torch.float32)
            layer.w2_weight_scale = param(e, h, dtype=torch.float32)
        else:
            bn, bk = self.block_shape
            layer.w13_weight_scale = param(e, 2 * i // bn, -(-h // bk), dtype=torch.float32)
            layer.w2_weight_scale = param(e, -(-h // bn), i // bk, dtype=torch.float32)

    def scale_rows(self, scale: torch.Tensor, part: str, offset: int, size: int) -> torch.Tensor:
        """The scales of weight rows [offset, offset + size) of one expert's w13 (part
        "w13") or of all its w2 rows: [size] per channel, [size / bn, K blocks] per block."""
        if self.block_shape is None:
            return scale.narrow(0, offset, size) if part == "w13" else scale
        bn = self.block_shape[0]
        return scale.narrow(0, offset // bn, size // bn) if part == "w13" else scale

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int32
    ) -> torch.Tensor:  # [T, H], x's dtype
        w13, w2 = layer.w13_weight, layer.w2_weight
        if not self.emulate and use_fp8_decode_kernels(x, w13, topk_ids, self.block_shape):
            act = ops.moe_decode_gate_up_fp8(
                x, topk_ids, w13, layer.w13_weight_scale, self.block_shape
            )  # [T * k, I]
            return ops.moe_decode_down_combine_fp8(
                act, topk_ids, topk_weights, w2, layer.w2_weight_scale, self.block_shape
            )
        if not self.emulate and FP8_MOE_BACKEND == "triton" and triton_moe_fp8.supports(x, w13, w2):
            return triton_moe_fp8.fused_experts_triton_fp8(
                x, w13, layer.w13_weight_scale, w2, layer.w2_weight_scale,
                topk_weights, topk_ids, block_shape=self.block_shape,
            )  # fmt: skip
        sorted_token_ids, inverse, offsets = moe_align(topk_ids, w13.shape[0])
        xq, x_scale = quantize_per_token(x)  # [T, H] fp8, [T, 1]
        index = sorted_token_ids
        rows_q = xq.view(torch.uint8).index_select(0, index).view(FP8_DTYPE)  # [T * k, H]
        rows = Fp8Activation(rows_q, x_scale.index_select(0, index), x.dtype)
        h = self._mm(rows, w13, layer.w13_weight_scale, offsets)
        a = _act(h, fp8_out=True)  # quantized per row
        y = self._mm(a, w2, layer.w2_weight_scale, offsets)
        return moe_combine(y, inverse, topk_weights)

    def _mm(
        self,
        a: Fp8Activation,  # [M, K] rows grouped by expert
        wq: torch.Tensor,  # [E, N, K] fp8
        w_scale: torch.Tensor,  # [E, N] or [E, N / bn, K / bk] float32
        offsets: torch.Tensor,  # [E] int32
    ) -> torch.Tensor:  # [M, N], a.dtype
        if not self.emulate and self.block_shape is None and _scaled_grouped_mm_ok(a.xq):
            return torch._scaled_grouped_mm(
                a.xq,
                wq.transpose(1, 2),
                a.scale.view(-1),
                w_scale,
                offs=offsets,
                out_dtype=torch.bfloat16,
            ).to(a.dtype)
        out = torch.empty(a.xq.shape[0], wq.shape[1], dtype=a.dtype, device=a.xq.device)

        def expert(rows: slice, e: int) -> torch.Tensor:
            if self.block_shape is None:
                return emulated_scaled_mm(a.xq[rows], a.scale[rows], wq[e], w_scale[e])
            w = dequantize_blocks(wq[e], w_scale[e], self.block_shape)  # [N, K] float32
            return (a.xq[rows].float() @ w.t()) * a.scale[rows]

        return per_expert(out, offsets, expert)
