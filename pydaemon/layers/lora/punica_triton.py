"""The segmented LoRA path in Triton (SGMV, as Punica / S-LoRA): a step's tokens grouped by
adapter slot (the grouping of punica_grouped.slot_grouping, made once a step and shared by the
layers), then two launches a layer (pydaemon/layers/lora/punica_triton_kernels.py):

    shrink  xa[row, k-split] = x[sorted_ids[row]] @ A[slot].T over a split of ``in``
            (every part at once: [T, SPLIT_K, n * R] float32)
    expand  y[sorted_ids[row], cols] += sum_k xa[row, k, part(cols)] @ B[slot][:, cols]
            (every part's columns at once, load-add-store in y's dtype, no atomics)

Each token meets only its own slot's A and B (the dense torch path multiplies every token by
every slot's: ~17 % extra FLOPs at 32 slots), and the tiles fit the shapes: 16 rows (~12
tokens a slot at W1 over 32 adapters), the shrink's 16-64 columns (n * R), the expand's one
K step of R (torch._grouped_mm's CUTLASS tiles in punica_grouped.py are 64 x 128 x 128).
Tokens without an adapter (the zero slot) get no tile at all: their rows of y are untouched.

Tiles and grid (see the kernels' module for the mapping of programs to slot tiles): both
kernels run ``cdiv(T, 16) + min(S, T)`` M-programs, fixed by T and S, so nothing is read
back and a CUDA graph captures them; programs past the step's tiles return at once.

- shrink: 16 x BLOCK_N (16..64, covering n * R) x 128 (in) tiles, split-K over ``in`` in up
  to 8 programs (``_split_k``): the output is tiny (16 x 48 a tile) and ``in`` long (4096,
  14336), so one program a tile would leave most SMs idle with ~one tile a slot, each
  streaming its slot's whole A. The splits write separate float32 partials (no atomics, no
  zeroing kernel, deterministic) that the expand sums when it loads xa (T x SPLIT_K x n*R x 4
  bytes: 0.4 MB at T = 512 for qkv). float32 also keeps the shrink's sum unrounded until the
  expand rounds it to B's dtype for its tensor-core dot, as vLLM's expand does.
- expand: 16 x 128 tiles of y's columns, K = R (padded to >= 16) in one step; a column tile
  that straddles two parts does one dot per part.

The kernels' specialisation depends on the layer's shapes, strides and pointer alignment,
never on T: one compilation a layer shape, in the first eager step. Compiling inside a CUDA
graph capture (module loading) is not allowed, so a capture whose layer was never launched
eagerly in this process takes the next path instead (``ready``); pagedd's graph runner runs
every graph's forward eagerly just before capturing it, with every LoRA slot active
(model_runner._capture), so its layers compile there.

``LORA_TRITON`` (on) chooses this path in ``add_lora`` (pydaemon/layers/lora/punica.py)
above ``LORA_KERNEL_MAX_TOKENS``, before the torch._grouped_mm one, for fp16/bf16 CUDA
tensors. On the H200 (Llama-3-8B shape, rank 16 on all 7 projections, 32 slots, 2026-12-02,
one device session): W1 over 32 adapters 14.96 s against 15.93 s for the dense torch path and
23.28 s for the grouped GEMMs (the base model: 13.14 s, so 0.88x against 0.82x); over 8
adapters 14.83 s (0.89x). A/B:
  python bench/bench_lora.py --mode w1 --adapters 0,8,32,128 --max-loras 32 --lora-triton 0|1
Triton is imported only when a step takes this path.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pydaemon.layers.lora.punica_grouped import Grouping, slot_grouping

LORA_TRITON = True
_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_M = 16  # rows of a slot tile (both kernels)
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_N = 128
MAX_SPLIT_K = 8
_MAX_PARTS = 4  # the expand kernel takes the ends of up to 3 parts before the last
_MAX_SLOTS = 1024  # S + 1 (the kernels hold every slot's offset in one vector)

# Layer signatures launched outside a capture in this process (their kernels are compiled).
_launched: set[tuple] = set()


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """The Triton path serves a step of these tokens (before a layer's layout is checked)."""
    return LORA_TRITON and x.is_cuda and x.dtype in _DTYPES and triton_available()


def layout_ok(
    y: torch.Tensor,  # [T, sum(out_j)]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S + 1, n * R, in]
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]
    part_starts: tuple[int, ...],
) -> bool:
    """The kernels' assumptions: one dtype, unit column strides, contiguous weights, at most
    4 parts of R rows of A each, at most 1023 adapter slots."""
    num_parts = len(part_starts) - 1
    return (
        y.dtype == x.dtype == lora_a.dtype == lora_b.dtype
        and x.stride(-1) == 1
        and y.stride(-1) == 1
        and lora_a.is_contiguous()
        and lora_b.is_contiguous()
        and 1 <= num_parts <= _MAX_PARTS
        and lora_a.shape[0] == lora_b.shape[0] <= _MAX_SLOTS
        and lora_a.shape[1] == num_parts * lora_b.shape[1]
        and lora_a.shape[2] == x.shape[1]
        and part_starts[-1] == lora_b.shape[2] == y.shape[1]
    )


def ready(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    part_starts: tuple[int, ...],
) -> bool:
    """``layout_ok``, and under a CUDA graph capture, kernels already compiled for the layer."""
    if not layout_ok(y, x, lora_a, lora_b, part_starts):
        return False
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _signature(y, x, lora_a, lora_b, part_starts) in _launched
    return True


def _signature(y, x, lora_a, lora_b, part_starts) -> tuple:
    """What Triton specialises the kernels on, besides constants derived from these: dtype,
    shapes and strides, and 16-byte alignment of the pointers (xa, sorted_ids and offsets
    are fresh allocations, always aligned). T is not among the kernels' arguments."""
    aligned = tuple(t.data_ptr() % 16 == 0 for t in (y, x, lora_a, lora_b))
    return (x.device, x.dtype, x.stride(0), y.stride(0), tuple(lora_a.shape),
            tuple(lora_b.shape), part_starts, aligned)  # fmt: skip


def _split_k(in_features: int) -> int:
    """K splits of the shrink: about 1024 columns of ``in`` each, 1..MAX_SPLIT_K."""
    return max(1, min(MAX_SPLIT_K, in_features // 1024))


def _pow2(n: int, low: int) -> int:
    return max(low, 1 << (n - 1).bit_length())


def add_lora_triton(
    y: torch.Tensor,  # [T, sum(out_j)], updated in place
    x: torch.Tensor,  # [T, in], lora_a's dtype
    token_slots: torch.Tensor,  # [T] int64: each token's slot, -1 = no adapter
    lora_a: torch.Tensor,  # [S + 1, n * R, in]: part j's A at rows [j * R, (j + 1) * R)
    lora_b: torch.Tensor,  # [S + 1, R, sum(out_j)]: part j's B.T * scaling in its columns
    part_starts: tuple[int, ...],  # n + 1 column offsets: part j = [starts[j], starts[j + 1])
    grouping: Grouping | None = None,  # slot_grouping(token_slots, S + 1), if already made
    split_k: int | None = None,  # default _split_k(in) (tests set it)
) -> None:
    """y += the LoRA delta of each token's slot (callers check ``layout_ok`` / ``ready``)."""
    from pydaemon.layers.lora import punica_triton_kernels as kernels

    num_tokens, in_features = x.shape
    if num_tokens == 0:
        return
    if grouping is None:
        grouping = slot_grouping(token_slots, lora_a.shape[0])
    sorted_ids, offsets = grouping
    num_slots = lora_a.shape[0] - 1  # the zero slot, last, is skipped
    n_cols, rank = lora_a.shape[1], lora_b.shape[1]
    out_features = lora_b.shape[2]
    split_k = split_k or _split_k(in_features)
    k_per_split = triton_cdiv(triton_cdiv(in_features, split_k), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    slots_pad = _pow2(num_slots, 16)
    grid_m = triton_cdiv(num_tokens, BLOCK_M) + min(num_slots, num_tokens)
    block_n = min(64, _pow2(n_cols, 16))
    dot_f32 = kernels.INTERPRETED and x.dtype == torch.bfloat16
    xa = torch.empty(num_tokens, split_k, n_cols, dtype=torch.float32, device=x.device)
    kernels.sgmv_shrink_kernel[(grid_m, triton_cdiv(n_cols, block_n), split_k)](
        x, lora_a, xa, sorted_ids, offsets, num_slots, n_cols, in_features, x.stride(0),
        lora_a.stride(0), lora_a.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=SHRINK_BLOCK_K, K_PER_SPLIT=k_per_split,
        SPLIT_K=split_k, SLOTS_PAD=slots_pad, DOT_F32=dot_f32,
    )  # fmt: skip
    ends = [*part_starts[1:-1], *[out_features] * (_MAX_PARTS - len(part_starts) + 1)]
    kernels.sgmv_expand_kernel[(triton_cdiv(out_features, EXPAND_BLOCK_N), grid_m)](
        y, xa, lora_b, sorted_ids, offsets, num_slots, n_cols, out_features, rank, *ends,
        y.stride(0), lora_b.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=_pow2(rank, 16), SPLIT_K=split_k,
        SLOTS_PAD=slots_pad, DOT_F32=dot_f32,
    )  # fmt: skip
    if x.is_cuda and not torch.cuda.is_current_stream_capturing():
        _launched.add(_signature(y, x, lora_a, lora_b, part_starts))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
