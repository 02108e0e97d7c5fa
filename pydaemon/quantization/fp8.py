"""FP8 (e4m3) linear layers: per-output-channel weight scales, dynamic per-token activation
scales, one scaled GEMM.

    y[t, n] = sum_k xq[t, k] * wq[n, k] * x_scale[t] * weight_scale[n]   (+ bias[n])

with xq = fp8(x[t, :] / x_scale[t]), x_scale[t] = max_k |x[t, k]| / 448, computed for every
call (dynamic), and wq = fp8(w[n, :] / weight_scale[n]) stored at load. Two ways to run it:

- ``torch._scaled_mm`` with row-wise scales (scale_a [M, 1], scale_b [1, N], float32; the
  second operand column-major; bf16 output): the real path, CUDA compute capability 8.9+.
  For at most ``FP8_GEMV_MAX_TOKENS`` rows (decode) pagedd's ``ops.fp8_gemv`` computes the
  same product as one pass over the weights on FP8 tensor cores (cuBLASLt tiles M by 64 or
  more: at one token its FP8 product is no faster than bf16's).
- emulation (``quantization="fp8_emulated"``): the same FP8 weights and the same activation
  quantization, then the product of the dequantized values in float32, cast to the
  activation dtype. It runs on any device (the CPU tests use it) and is the oracle of the
  GPU path: FP8 x FP8 products are exact in float32, so the two differ only in the order of
  the float32 sums and in the output rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from pydaemon import ops

if TYPE_CHECKING:
    from pydaemon.config.checkpoint_format import CheckpointQuantization

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# Smallest scale: an all-zero row or token quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with FP8 tensor cores
# Rows (tokens) up to which scaled_mm runs ops.fp8_gemv: 0 (off) until the kernel has been
# checked and measured on a GPU (tests/gpu/test_fp8_gemv_gpu.py; then 16, its m16 tile).
FP8_GEMV_MAX_TOKENS = 0
# Rows up to which scaled_mm swaps its operands (``scaled_mm_swapped``): 0 (off) until
# measured. At one token cuBLASLt's FP8 GEMM read the weights at ~1-2 TB/s on the H200
# (bench_fp8_gemm.py), half bf16's rate; vLLM's CUTLASS FP8 path swaps A and B below 64 tokens.
FP8_SWAP_AB_MAX_TOKENS = 0


def quantize_per_channel(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] -> (wq [N, K] float8_e4m3fn, scale [N] float32), wq * scale ~ weight.
    ``amax``: [N], the largest |value| of each row when ``weight`` is only some of the row's
    columns (a row-parallel shard), so that the scales do not depend on the TP size."""
    if amax is None:
        amax = weight.abs().amax(dim=1)
    scale = (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(weight.float() / scale[:, None]), scale


class Fp8Activation(NamedTuple):
    """An activation already quantized per token by the op that produced it (RMSNorm,
    SiLU-and-multiply: one kernel instead of two), handed to an FP8 linear layer instead of
    the tensor: exactly ``quantize_per_token`` of what that op would have returned."""

    xq: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # of the activation it stands for: the layer's output dtype


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] -> (xq [T, K] float8_e4m3fn, scale [T, 1] float32), xq * scale ~ x.

    On CUDA with pagedd's kernels: one kernel (pydaemon/ops/fp8_quant.py), bit for bit the
    torch code below, which runs elsewhere."""
    if x.is_cuda and x.stride(-1) == 1 and ops.is_available():
        return ops.per_token_fp8_quant(x)
    return quantize_per_token_native(x)


def quantize_per_token_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token in torch. Three passes over x, no float32 copy of it for bf16: the
    max-abs reduction (no |x| temporary), x times the inverse scale (in bf16 for bf16 x), the
    cast. The returned scale is the exact inverse of the multiplier used, so dequantization
    stays consistent; no clamp: |x| * inverse <= 448 up to one rounding, and the cast rounds
    anything below 464 to 448 at most."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True)  # [T, 1]
    inverse = FP8_MAX / amax.float().clamp(min=FP8_MAX * MIN_SCALE)
    if x.dtype == torch.bfloat16:  # float32's range: the inverse cannot overflow
        inverse = inverse.to(torch.bfloat16)
    return (x * inverse).to(FP8_DTYPE), 1.0 / inverse.float()


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    # The cast does not saturate (out-of-range values become NaN): clamp first.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """wq: [N, K] fp8, scale: [N] float32 -> [N, K] float32."""
    return wq.float() * scale[:, None]


def dequantize_blocks(
    wq: torch.Tensor,  # [N, K] fp8
    scales: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block_shape: tuple[int, int],  # (bn, bk)
) -> torch.Tensor:  # [N, K] float32: each value times its block's scale
    bn, bk = block_shape
    n, k = wq.shape
    full = scales.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return wq.float() * full


def scaled_mm(
    xq: torch.Tensor,  # [T, K] fp8, row-major
    x_scale: torch.Tensor,  # [T, 1] float32
    wq: torch.Tensor,  # [N, K] fp8, row-major (so wq.t() is column-major, as cuBLASLt wants)
    weight_scale: torch.Tensor,  # [N] float32
) -> torch.Tensor:  # [T, N] bfloat16
    if xq.shape[0] <= FP8_GEMV_MAX_TOKENS and _gemv_fits(xq, wq):
        return ops.fp8_gemv(xq, x_scale, wq, weight_scale)
    if xq.shape[0] <= FP8_SWAP_AB_MAX_TOKENS:
        return scaled_mm_swapped(xq, x_scale, wq, weight_scale)
    return torch._scaled_mm(
        xq, wq.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16
    )


def scaled_mm_swapped(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:  # [T, N] bfloat16, contiguous; arguments as scaled_mm's
    """The same product as (wq @ xq.T).T: cuBLASLt then sees the thousands of weight rows as
    its M and the few tokens as its N (the "swap AB" of vLLM's small-batch FP8 kernels).
    torch._scaled_mm wants both sizes of its second operand divisible by 16: the tokens are
    padded with zero rows (scale 1) to a multiple of 16, and the [N, T] result is transposed
    back into a contiguous [T, N] (one small copy)."""
    num_tokens = xq.shape[0]
    pad = -num_tokens % 16
    if pad:
        zeros = xq.new_zeros((pad, xq.shape[1]), dtype=torch.uint8)
        xq = torch.cat([xq.view(torch.uint8), zeros]).view(xq.dtype)
        x_scale = torch.cat([x_scale.view(-1, 1), x_scale.new_ones((pad, 1))])
    out_t = torch._scaled_mm(
        wq,
        xq.t(),
        scale_a=weight_scale.view(-1, 1),
        scale_b=x_scale.view(1, -1),
        out_dtype=torch.bfloat16,
    )  # [N, T + pad]
    return out_t[:, :num_tokens].t().contiguous()


def _gemv_fits(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    """ops.fp8_gemv's layout: 16-byte aligned rows, a contiguous weight, K % 16 == 0."""
    return (
        xq.is_cuda
        and ops.fp8_gemv_available()
        and xq.shape[0] >= 1
        and xq.shape[1] % 16 == 0
        and xq.stride(-1) == 1
        and (xq.shape[0] == 1 or xq.stride(0) % 16 == 0)
        and xq.data_ptr() % 16 == 0
        and wq.is_contiguous()
        and wq.data_ptr() % 16 == 0
    )


def emulated_scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:  # [T, N] float32; arguments as scaled_mm's
    return (xq.float() @ wq.float().t()) * x_scale * weight_scale


class Fp8LinearMethod:
    """Creates and applies a linear layer's FP8 parameters (vLLM's Fp8LinearMethod):
    ``weight`` [out, in] float8_e4m3fn and ``weight_scale`` [out] float32. Both keep their
    dtype when the model is materialised in the activation dtype (``own_dtype_params``).
    ``checkpoint``: how the checkpoint stores the weights (None: unquantized)."""

    own_dtype_params = ("weight", "weight_scale")
    takes_fp8_input = True  # the op before may hand it an Fp8Activation

    def __init__(self, emulate: bool, checkpoint: CheckpointQuantization | None = None) -> None:
        self.emulate = emulate
        self.checkpoint = checkpoint

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        if not self.emulate and (out_features % 16 or in_features % 16):
            raise ValueError(
                f"quantization='fp8' needs linear layers whose in and out features (per "
                f"tensor-parallel rank) are multiples of 16 (torch._scaled_mm); this model has "
                f"one of [out {out_features}, in {in_features}]"
            )
        weight = torch.empty(out_features, in_features, dtype=FP8_DTYPE)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        scale = torch.empty(out_features, dtype=torch.float32)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:  # x: [..., in] -> [..., out], x's dtype
        mm = emulated_scaled_mm if self.emulate else scaled_mm
        if isinstance(x, Fp8Activation):  # [T, in], quantized by the op before
            out = mm(x.xq, x.scale, layer.weight, layer.weight_scale).to(x.dtype)
            return out if bias is None else out + bias
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:  # rows may be strided (a slice of qkv), elements not
            x2d = x2d.contiguous()
        xq, x_scale = quantize_per_token(x2d)
        out = mm(xq, x_scale, layer.weight, layer.weight_scale).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1])
