"""Launching the W4A16 Triton kernels (w4a16_kernels.py) for dense linear layers and, through
``launch_gemv`` / ``launch_gemm``, for MoE experts (layers/moe/w4a16_moe.py).

Which kernel: steps of at most ``GEMV_MAX_TOKENS`` rows run the GEMV (a pass over the weights
per row, CUDA cores), larger ones the tensor-core GEMM. Tiles by rows: ``gemv_config`` and
``GEMM_CONFIGS``. All of these are UNMEASURED starting points (reasoned from the H200's 132
SMs and the byte counts below, not timed): ``bench/bench_int4_gemm.py --sweep`` times the
alternatives on the GPU and prints the table to put here.

- GEMV: BLOCK_N 16 rows x BLOCK_K 1024 columns a tile (8 KB of int32 words: two 16-byte
  loads per thread of 8 warps, and as many prefetched for the next tile), so that a Llama-3-8B
  o_proj (N 4096) has 256 programs (~2 per SM, 57 registers a thread: up to 4 fit) and ~32 KB
  of loads in flight per SM without split-K. BLOCK_K / 8 must stay within the program's
  threads (32 x num_warps): the activations are then loaded straight into the layout of the
  weight tile (checked on the sm_90 compile: one layout conversion, outside the loop).
- GEMM: the shapes of a usual Triton bf16 GEMM by M, with BLOCK_K <= the group size (one
  group's scale per K tile).

Everything depends on shapes only: nothing is read back, so a CUDA graph captures a step;
kernels compile on their first launch for a (shape, tile) pair, which pagedd makes eagerly
before capturing (the runner's warm-up of each graph's batch size).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

GEMV_MAX_TOKENS = 2  # UNMEASURED: bench_int4_gemm.py --sweep finds the crossover
DTYPES = (torch.float16, torch.bfloat16)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


# (at most this many rows, config), first match. UNMEASURED (see the module docstring).
GEMM_CONFIGS: tuple[tuple[int, GemmConfig], ...] = (
    (16, GemmConfig(16, 64, 128, 8, 4, 4)),
    (32, GemmConfig(32, 64, 128, 8, 4, 4)),
    (64, GemmConfig(64, 64, 128, 8, 4, 4)),
    (128, GemmConfig(64, 128, 128, 8, 4, 4)),
    (1 << 62, GemmConfig(128, 128, 64, 8, 8, 3)),
)
GEMV_CONFIG = GemvConfig(16, 1024, 8)


@functools.cache
def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable: {exc!r}"
    return None


def supports(x: torch.Tensor) -> bool:
    """The Triton kernels can serve these activations: fp16 / bf16 on CUDA, triton there."""
    return x.is_cuda and x.dtype in DTYPES and triton_unavailable_reason() is None


def _p2_at_most(v: int) -> int:
    return 1 << (v.bit_length() - 1)


def gemm_config(num_rows: int, n: int, k: int, group: int) -> GemmConfig:
    cfg = next(c for bound, c in GEMM_CONFIGS if num_rows <= bound)
    block_k = min(cfg.block_k, group, max(16, _p2_at_most(k)))
    block_n = min(cfg.block_n, max(16, 1 << (n - 1).bit_length()))
    return cfg._replace(block_k=block_k, block_n=block_n)


def gemv_config(n: int, k: int, group: int, config: GemvConfig | None = None) -> GemvConfig:
    """BLOCK_K: the config's, or K rounded up to a power of two when smaller (the tail of K
    is masked). A tile holds whole groups (power-of-two G below BLOCK_K) or lies in one
    (G a multiple of BLOCK_K, or G = K: one group per channel)."""
    cfg = config or GEMV_CONFIG
    block_k = min(cfg.block_k, max(64, 1 << (k - 1).bit_length()), 8 * 32 * cfg.num_warps)
    return cfg._replace(block_k=block_k)


class PackedWeights(NamedTuple):
    """The kernels' weight operands; E = 1 for a dense layer."""

    qweight: torch.Tensor  # [E, N, K / 8] int32
    scales: torch.Tensor  # [E, N, K / G] fp16 / bf16 (int4) or uint8 (MXFP4 e8m0)
    qzeros: torch.Tensor | None  # [E, N, K / G] uint8 (int4, asymmetric)
    perm: torch.Tensor | None  # [E, K] int32 (act-order)
    bias: torch.Tensor | None  # [E, N]
    fmt: int  # 0: int4, 1: MXFP4
    group: int  # columns per scale

    @property
    def n(self) -> int:
        return self.qweight.shape[1]

    @property
    def k(self) -> int:
        return self.qweight.shape[2] * 8


def _flags(w: PackedWeights) -> dict:
    return dict(
        FORMAT=w.fmt,
        GROUP=w.group,
        HAS_ZP=w.qzeros is not None,
        HAS_PERM=w.perm is not None,
        HAS_BIAS=w.bias is not None,
    )


def launch_gemv(
    a: torch.Tensor,  # [rows_a, K]
    w: PackedWeights,
    num_rows: int,
    expert_ids: torch.Tensor | None = None,  # [rows] int32: MoE slots' experts
    a_row_div: int = 1,
    weights: torch.Tensor | None = None,  # [rows] float32 routing weights
    config: GemvConfig | None = None,
) -> torch.Tensor:  # [rows, N], a's dtype
    from pydaemon.quantization.w4a16_kernels import w4a16_gemv_kernel

    n, k = w.n, w.k
    cfg = gemv_config(n, k, w.group, config)
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    dummy = w.qweight  # stands for the pointers a flag leaves unread
    grid = (-(-n // cfg.block_n), num_rows)
    w4a16_gemv_kernel[grid](
        a, w.qweight, w.scales,
        w.qzeros if w.qzeros is not None else dummy,
        w.perm if w.perm is not None else dummy,
        w.bias if w.bias is not None else dummy,
        expert_ids if expert_ids is not None else dummy,
        weights if weights is not None else dummy,
        out, num_rows, n, k, a.stride(0), out.stride(0),
        **_flags(w),
        MUL_WEIGHT=weights is not None,
        MOE=expert_ids is not None,
        A_ROW_DIV=a_row_div,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def launch_gemm(
    a: torch.Tensor,  # [rows_a, K]
    w: PackedWeights,
    num_rows: int,
    cfg: GemmConfig,
    sorted_slots: torch.Tensor | None = None,  # MoE: [max_blocks * BLOCK_M] int32
    block_expert: torch.Tensor | None = None,  # MoE: [max_blocks] int32
    a_row_div: int = 1,
    weights: torch.Tensor | None = None,  # [rows] float32 routing weights
) -> torch.Tensor:  # [rows, N], a's dtype
    from pydaemon.quantization.w4a16_kernels import INTERPRETED, w4a16_gemm_kernel

    n, k = w.n, w.k
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    moe = block_expert is not None
    num_pid_m = block_expert.numel() if moe else -(-num_rows // cfg.block_m)
    grid = (num_pid_m * -(-n // cfg.block_n),)
    dummy = w.qweight
    w4a16_gemm_kernel[grid](
        a, w.qweight, w.scales,
        w.qzeros if w.qzeros is not None else dummy,
        w.perm if w.perm is not None else dummy,
        w.bias if w.bias is not None else dummy,
        sorted_slots if moe else dummy,
        block_expert if moe else dummy,
        weights if weights is not None else dummy,
        out, num_rows, num_pid_m, n, k, a.stride(0), out.stride(0),
        **_flags(w),
        MUL_WEIGHT=weights is not None,
        MOE=moe,
        A_ROW_DIV=a_row_div,
        DOT_F32=INTERPRETED,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def linear(
    x: torch.Tensor,  # [T, K] fp16 / bf16, CUDA
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, K / G]
    qzeros: torch.Tensor | None,  # [N, K / G] uint8
    perm: torch.Tensor | None,  # [K] int32
) -> torch.Tensor:  # [T, N], x's dtype
    if x.stride(-1) != 1:
        x = x.contiguous()
    k = x.shape[1]
    w = PackedWeights(
        qweight[None],
        scales[None],
        None if qzeros is None else qzeros[None],
        None if perm is None else perm[None],
        None,
        0,
        k // scales.shape[1],
    )
    t = x.shape[0]
    if t <= GEMV_MAX_TOKENS:
        return launch_gemv(x, w, t)
    return launch_gemm(x, w, t, gemm_config(t, w.n, k, w.group))
