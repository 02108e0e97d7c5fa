"""Sliding windows, attention sinks and logit soft-capping in every attention kernel (the
CUDA-core and tensor-core decode kernels, the mma.sync and wgmma prefill kernels) against a
float64 reference on fresh random inputs: dtypes, head sizes, block sizes, GQA ratios,
contexts from 1 to 5k keys, windows shorter and longer than them, one and several split-KV
partitions, fp8 caches. Blocks wholly before a sequence's window point at a block of NaN: a
kernel that read one would return NaN. Bad arguments are clear errors."""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops

from .kv_factory import fp8_batch, make_paged_batch
from .mods_reference import Mods, poison_out_of_window, reference_paged

TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
# head_dim -> (num_q_heads, num_kv_heads): MHA, GQA 8 and 16 (one mma atom), GQA 4
HEADS = {64: (8, 8), 80: (16, 2), 128: (32, 2), 256: (8, 2)}
DECODE_LENS = [1, 7, 64, 100, 300, 1000, 2050, 5000]
# (cached prefix, new tokens): chunks after prefixes longer than the windows, decode rows.
CHUNKS = [(0, 1), (0, 17), (5, 64), (16, 100), (37, 129), (0, 300), (250, 1), (1000, 33),
          (600, 600), (3, 513)]  # fmt: skip
WINDOWS = [1, 13, 128, 700]


def _mods(case: str, num_q_heads: int, dtype: torch.dtype, window: int) -> Mods:
    """Scores here are ~N(0, 1): a cap of 1.5 bends them, sinks ~N(0, 2) take real weight."""
    sinks = (2 * torch.randn(num_q_heads, device="cuda")).to(dtype)
    return {
        "window": Mods(sliding_window=window),
        "softcap": Mods(softcap=1.5),
        "sinks": Mods(sinks=sinks),
        "all": Mods(sliding_window=window, softcap=1.5, sinks=sinks),
    }[case]


def _check(out, ref, query_lens, tol, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (a poisoned block was read?)"
    start = 0
    for s, q_len in enumerate(query_lens):
        o, r = out[start : start + q_len].double(), ref[start : start + q_len]
        err = (o - r).norm() / r.norm().clamp_min(1e-30)
        assert err < tol, f"{what}: sequence {s} (query_len {q_len}): relative error {err:.2e}"
        start += q_len


def _decode(kernel, lens, heads, head_dim, block_size, dtype, mods, partition_size=None):
    num_q_heads, num_kv_heads = heads
    batch = make_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype)
    poisoned = poison_out_of_window(batch, [n - 1 for n in lens], mods.sliding_window)
    query = torch.randn(len(lens), num_q_heads, head_dim, device="cuda", dtype=dtype)
    out = torch.full_like(query, float("nan"))
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    if kernel == "tc":
        extra = {} if partition_size is None else {"partition_size": partition_size}
        ops.paged_attention_decode_tc(*args, max(lens), out=out, **mods.kwargs(), **extra)
    else:
        ops.paged_attention_decode(*args, max(lens), out=out, **mods.kwargs())
    return out, query, batch, poisoned


@pytest.mark.parametrize("case", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["tc", "cuda_cores"])
def test_decode_with_mods_matches_float64(kernel, dtype, head_dim, block_size, case):
    heads = HEADS[head_dim]
    for window in WINDOWS if case in ("window", "all") else [None]:
        mods = _mods(case, heads[0], dtype, window or 1)
        if window is None:
            mods = Mods(softcap=mods.softcap, sinks=mods.sinks)
        out, query, batch, poisoned = _decode(
            kernel, DECODE_LENS, heads, head_dim, block_size, dtype, mods
        )
        assert poisoned > 0 or window is None or window >= max(DECODE_LENS)
        ref = reference_paged(query, batch, [1] * len(DECODE_LENS), head_dim**-0.5, mods)
        _check(out, ref, [1] * len(DECODE_LENS), TOL[dtype], f"{kernel} {mods.describe()}")


@pytest.mark.parametrize("partition_size", [64, 256, 1024])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4), (32, 2)], ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("window", [5, 100, 1000])
def test_decode_tc_window_over_several_partitions(heads, window, partition_size):
    """A window's keys split into partitions that start at its (16-aligned) first key, merged
    by the reduce kernel with the sink; GQA 1, 4 and 16."""
    sinks = torch.randn(heads[0], device="cuda").to(torch.bfloat16)
    mods = Mods(sliding_window=window, softcap=20.0, sinks=sinks)
    out, query, batch, _ = _decode(
        "tc", DECODE_LENS, heads, 128, 16, torch.bfloat16, mods, partition_size
    )
    ref = reference_paged(query, batch, [1] * len(DECODE_LENS), 128**-0.5, mods)
    _check(out, ref, [1] * len(DECODE_LENS), TOL[torch.bfloat16], f"partition {partition_size}")


@pytest.mark.parametrize("kernel", ["tc", "cuda_cores"])
def test_decode_with_mods_on_an_fp8_cache(kernel):
    lens = DECODE_LENS
    batch, deq = fp8_batch(lens, 2, 128, 16, k_scale=0.02, v_scale=0.03, spread=1.0)
    sinks = torch.randn(16, device="cuda").to(torch.bfloat16)
    mods = Mods(sliding_window=100, softcap=1.5, sinks=sinks)
    poison_out_of_window([batch, deq], [n - 1 for n in lens], 100)  # they share the tables
    num_q_heads, head_dim = 16, 128
    query = torch.randn(len(lens), num_q_heads, head_dim, device="cuda").to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    fn = ops.paged_attention_decode_tc if kernel == "tc" else ops.paged_attention_decode
    fn(*args, max(lens), out=out, k_scale=0.02, v_scale=0.03, **mods.kwargs())
    ref = reference_paged(query, deq, [1] * len(lens), head_dim**-0.5, mods)
    _check(out, ref, [1] * len(lens), 2e-2, f"{kernel} fp8")


def _prefill(backend, chunks, heads, head_dim, block_size, dtype, mods):
    num_q_heads, num_kv_heads = heads
    query_lens = [q for _, q in chunks]
    batch = make_paged_batch([p + q for p, q in chunks], num_kv_heads, head_dim, block_size, dtype)
    poison_out_of_window(batch, [p for p, _ in chunks], mods.sliding_window)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, device="cuda", dtype=dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    ops.paged_attention_prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        starts.cuda(), max(query_lens), out=out, backend=backend, **mods.kwargs(),
    )  # fmt: skip
    return out, query, batch, query_lens


def _skip_unavailable(backend: str, head_dim: int) -> None:
    if backend == "wgmma":
        why = ops.paged_prefill.wgmma_unavailable_reason(head_dim)
        if why:
            pytest.skip(why)


@pytest.mark.parametrize("case", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["mma", "auto"])
def test_prefill_with_mods_matches_float64(backend, dtype, head_dim, case, block_size=16):
    _skip_unavailable(backend, head_dim)
    heads = HEADS[head_dim]
    for window in WINDOWS if case in ("window", "all") else [None]:
        mods = _mods(case, heads[0], dtype, window or 1)
        if window is None:
            mods = Mods(softcap=mods.softcap, sinks=mods.sinks)
        out, query, batch, query_lens = _prefill(
            backend, CHUNKS, heads, head_dim, block_size, dtype, mods
        )
        ref = reference_paged(query, batch, query_lens, head_dim**-0.5, mods)
        _check(out, ref, query_lens, TOL[dtype], f"{backend} {mods.describe()}")


def test_wgmma_refuses_mods_and_auto_takes_mma():
    """The wgmma kernel's modifier instances hung on the H200 (a window at head 64): a layer
    with a window, sinks or a soft-cap runs mma.sync, and asking wgmma for them is an error."""
    dtype, heads = torch.bfloat16, HEADS[128]
    mods = _mods("all", heads[0], dtype, WINDOWS[0])
    with pytest.raises(ValueError, match="does not take a sliding window"):
        _prefill("wgmma", CHUNKS, heads, 128, 16, dtype, mods)
    # The same inputs for both (each _prefill draws its own: seeded alike).
    torch.manual_seed(1)
    auto, *_ = _prefill("auto", CHUNKS, heads, 128, 16, dtype, mods)
    torch.manual_seed(1)
    mma, *_ = _prefill("mma", CHUNKS, heads, 128, 16, dtype, mods)
    # bit for bit (rows no query owns stay NaN in both: the outputs start as NaN)
    torch.testing.assert_close(auto, mma, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("backend", ["mma"])
def test_prefill_block_sizes_with_all_mods(backend, block_size):
    _skip_unavailable(backend, 128)
    dtype, heads = torch.bfloat16, HEADS[128]
    for window in WINDOWS:
        mods = _mods("all", heads[0], dtype, window)
        out, query, batch, query_lens = _prefill(
            backend, CHUNKS, heads, 128, block_size, dtype, mods
        )
        ref = reference_paged(query, batch, query_lens, 128**-0.5, mods)
        _check(out, ref, query_lens, TOL[dtype], f"{backend} bs {block_size} window {window}")


@pytest.mark.parametrize("tile", [(128, 64), (64, 64), (128, 32)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_prefill_mma_tiles_with_window(tile):
    """Every mma.sync tile; a 4k prompt with a 1k window skips most tiles."""
    chunks = [(0, 4096), *CHUNKS]
    heads, head_dim, dtype = (16, 4), 128, torch.bfloat16
    mods = Mods(sliding_window=1000, sinks=torch.randn(16, device="cuda").to(dtype))
    query_lens = [q for _, q in chunks]
    batch = make_paged_batch([p + q for p, q in chunks], heads[1], head_dim, 16, dtype)
    poison_out_of_window(batch, [p for p, _ in chunks], 1000)
    query = torch.randn(sum(query_lens), heads[0], head_dim, device="cuda", dtype=dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = ops.paged_attention_prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        starts.cuda(), max(query_lens), block_m=tile[0], block_n=tile[1], backend="mma",
        **mods.kwargs(),
    )  # fmt: skip
    ref = reference_paged(query, batch, query_lens, head_dim**-0.5, mods)
    _check(out, ref, query_lens, TOL[dtype], f"tile {tile}")


def test_prefill_with_mods_on_an_fp8_cache():
    chunks = CHUNKS
    lens = [p + q for p, q in chunks]
    query_lens = [q for _, q in chunks]
    batch, deq = fp8_batch(lens, 2, 128, 16, k_scale=0.02, v_scale=0.03, spread=1.0)
    poison_out_of_window([batch, deq], [p for p, _ in chunks], 128)
    sinks = torch.randn(16, device="cuda").to(torch.bfloat16)
    mods = Mods(sliding_window=128, softcap=1.5, sinks=sinks)
    query = torch.randn(sum(query_lens), 16, 128, device="cuda").to(torch.bfloat16)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = ops.paged_attention_prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        starts.cuda(), max(query_lens), k_scale=0.02, v_scale=0.03, **mods.kwargs(),
    )  # fmt: skip
    ref = reference_paged(query, deq, query_lens, 128**-0.5, mods)
    _check(out, ref, query_lens, 2e-2, "prefill fp8")


def test_mods_without_effect_equal_the_plain_kernels():
    """A window covering every context gives the plain instances' result (the same partitions
    and tiles: equal to within a rounding)."""
    heads, head_dim, dtype = (16, 2), 128, torch.bfloat16
    lens = DECODE_LENS
    batch = make_paged_batch(lens, heads[1], head_dim, 16, dtype)
    query = torch.randn(len(lens), heads[0], head_dim, device="cuda", dtype=dtype)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    for fn in (ops.paged_attention_decode_tc, ops.paged_attention_decode):
        plain = fn(*args, max(lens))
        wide = fn(*args, max(lens), sliding_window=1 << 20)
        torch.testing.assert_close(wide, plain, rtol=2**-7, atol=1e-5, msg=fn.__name__)


def test_bad_mods_are_clear_errors():
    heads, head_dim, dtype = (8, 2), 128, torch.bfloat16
    batch = make_paged_batch([10], heads[1], head_dim, 16, dtype)
    query = torch.randn(1, heads[0], head_dim, device="cuda", dtype=dtype)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 10)
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        ops.paged_attention_decode_tc(*args, sliding_window=-1)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        ops.paged_attention_decode(*args, softcap=float("nan"))
    with pytest.raises(TypeError, match="sinks must have the dtype of query"):
        ops.paged_attention_decode_tc(*args, sinks=torch.zeros(8, device="cuda"))
    with pytest.raises(ValueError, match="sinks.shape\\[0\\] must be 8"):
        ops.paged_attention_decode_tc(*args, sinks=torch.zeros(4, device="cuda", dtype=dtype))
    with pytest.raises(ValueError, match="sinks must be a CUDA tensor"):
        ops.paged_attention_decode(*args, sinks=torch.zeros(8, dtype=dtype))
    starts = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        ops.paged_attention_prefill(*args[:5], starts, 1, sliding_window=-3)
