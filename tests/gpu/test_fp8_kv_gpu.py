"""FP8 (e4m3) KV cache on the GPU: the cache-write kernel against torch's quantization, the
decode and prefill kernels against a float64 reference on the dequantized cache, block moves,
argument errors, and a tiny model's next-token distributions with fp8 KV (kernels) against
fp16 KV and against the torch path's fp8 emulation."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from pydaemon import ops
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8

from .kv_factory import fp8_batch, make_paged_batch, reference_decode, reference_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import make_hf_model, random_prompts  # noqa: E402
from kv_logprobs import compare_logprobs, next_token_logprobs  # noqa: E402

# The kernels compute on exactly the dequantized values, so the tolerances are those of the
# fp16 / bf16 kernels against float64 (tests/gpu/test_kernels.py).
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
HEADS = [(8, 8), (16, 4), (16, 2)]  # GQA ratios 1, 4, 8
MIXED_LENS = [1, 7, 256, 257, 1000, 33, 2049, 512]  # around partition and block boundaries
CHUNKS = [(0, 1), (0, 17), (5, 64), (16, 100), (37, 129), (0, 300), (250, 1), (1000, 33),
          (64, 64), (3, 513)]  # fmt: skip
SCALES = [(1.0, 1.0), (0.05, 0.3)]


def assert_close_rows(out, ref, row_slices, tol, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or bad)"
    for i, rows in enumerate(row_slices):
        o, r = out[rows].double(), ref[rows]
        err = (o - r).norm() / r.norm()
        assert err < tol, f"{what}: sequence {i}: relative error {err:.2e} >= {tol:.0e}"


# ---------------------------------------------------------------- cache write


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.5, 0.125)])
def test_reshape_and_cache_fp8_matches_torch_quantization(dtype, head_dim, k_scale, v_scale):
    """Power-of-two scales: x * (1 / s) == x / s, so the bytes must equal torch's e4m3
    rounding (nearest even, saturating) exactly; padding slots stay untouched."""
    num_blocks, num_layers, num_kv_heads, block_size, num_tokens = 10, 3, 4, 16, 50
    kv_cache = torch.randn(
        num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim, device="cuda"
    ).to(FP8_DTYPE)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::7] = -1
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda") * 40).to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda") * 40).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 300.0, 2e-4])  # saturation and subnormals
    expected = kv_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 1, 0, :, slot % block_size] = quantize_fp8(key[t], k_scale)
            expected[slot // block_size, 1, 1, :, slot % block_size] = quantize_fp8(
                value[t], v_scale
            )
    ops.reshape_and_cache(
        key, value, kv_cache[:, 1, 0], kv_cache[:, 1, 1], slots.cuda(), k_scale, v_scale
    )
    diff = (kv_cache.view(torch.uint8) != expected.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, (
        f"{len(diff)} bytes differ from torch's e4m3, first at {diff[:3].tolist()}"
    )


def test_reshape_and_cache_fp8_unaligned_key_and_any_scale():
    """key/value 8 bytes off 16-byte alignment (the element-load path) and a scale that is not
    a power of two: within one e4m3 rounding step of torch's quantization."""
    num_tokens, head_dim, k_scale, v_scale = 9, 64, 0.37, 1.3
    flat = torch.randn(num_tokens, 4 + 4 * head_dim, device="cuda", dtype=torch.bfloat16) * 20
    key = flat[:, 4 : 4 + 2 * head_dim].unflatten(1, (2, head_dim))
    value = flat[:, 4 + 2 * head_dim :].unflatten(1, (2, head_dim))
    kv_cache = torch.zeros(4, 1, 2, 2, 8, head_dim, device="cuda", dtype=FP8_DTYPE)
    slots = torch.tensor([3, -1, 8, 31, 0, 9, 10, 11, 12], device="cuda")
    ops.reshape_and_cache(key, value, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots, k_scale, v_scale)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for which, x, s in ((0, key[t], k_scale), (1, value[t], v_scale)):
            got = kv_cache[slot // 8, 0, which, :, slot % 8].double() * s
            want = dequantize_fp8(quantize_fp8(x, s), s, torch.float64)
            step = 2.0**-3 * want.abs() + 2.0**-9 * s  # one e4m3 step
            assert ((got - want).abs() <= step).all(), f"token {t}, {'kv'[which]}"


# ---------------------------------------------------------------- attention kernels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("k_scale, v_scale", SCALES)
def test_decode_fp8_cache_matches_reference(dtype, head_dim, block_size, heads, k_scale, v_scale):
    num_q_heads, num_kv_heads = heads
    batch, deq = fp8_batch(MIXED_LENS, num_kv_heads, head_dim, block_size, k_scale, v_scale)
    query = torch.randn(len(MIXED_LENS), num_q_heads, head_dim, device="cuda", dtype=dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    ops.paged_attention_decode(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        max(MIXED_LENS), scale=scale, out=out, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    ref = reference_decode(query, deq, scale)
    assert_close_rows(out, ref, range(len(MIXED_LENS)), TOL[dtype], "decode")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["decode", "decode_tc", "prefill"])
def test_every_e4m3_code_is_read_exactly(dtype, kernel):
    """The kernels turn e4m3 into fp16 / bf16 / fp32 with bit moves and a power-of-two
    multiply (dtype_utils.cuh), not with cvt: every code, subnormals and negatives included,
    must come out exactly. One key per sequence: softmax weight 1, so out = V exactly."""
    head_dim, block_size, num_q_heads = 128, 16, 4
    codes = torch.arange(256, dtype=torch.int32)
    codes[codes == 0x7F], codes[codes == 0xFF] = 0x7E, 0xFE  # no NaN codes in a cache
    cache = torch.zeros(2, 2, 2, block_size, head_dim, dtype=torch.uint8)  # [blocks, k/v, ...]
    cache[:, 0] = 0x38  # every K element 1.0
    cache[0, 1, :, 0] = codes[:128].to(torch.uint8)  # sequence 0's one V row: codes 0..127
    cache[1, 1, :, 0] = codes[128:].to(torch.uint8)  # sequence 1's: 128..255
    cache = cache.view(FP8_DTYPE).cuda()
    key_cache, value_cache = cache[:, 0], cache[:, 1]
    block_tables = torch.tensor([[0], [1]], dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(2, dtype=torch.int32, device="cuda")
    query = torch.randn(2, num_q_heads, head_dim, device="cuda", dtype=dtype)
    args = (query, key_cache, value_cache, block_tables, seq_lens)
    if kernel == "decode":
        out = ops.paged_attention_decode(*args, 1)
    elif kernel == "decode_tc":
        out = ops.paged_attention_decode_tc(*args, 1)
    else:
        start = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
        out = ops.paged_attention_prefill(*args, start, 1)
    want = torch.stack([cache[0, 1, 0, 0], cache[1, 1, 0, 0]]).float().to(dtype)  # [2, 128]
    for h in range(num_q_heads):
        bad = (out[:, h] != want).nonzero()
        if len(bad):
            seq, dim = bad[0].tolist()
            code = int(codes.view(2, 128)[seq, dim])
            raise AssertionError(f"{kernel}: head {h}: code {code:#04x} read as {out[seq, h, dim]}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32)], ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_fp8_cache_long_context_16k(dtype, heads):
    lens = [16384, 9000, 16001]
    batch, deq = fp8_batch(lens, heads[1], 128, 16, 0.05, 0.3)
    query = torch.randn(len(lens), heads[0], 128, device="cuda", dtype=dtype)
    out = ops.paged_attention_decode(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        max(lens), k_scale=0.05, v_scale=0.3,
    )  # fmt: skip
    ref = reference_decode(query, deq, 128**-0.5)
    assert_close_rows(out, ref, range(len(lens)), TOL[dtype], "decode 16k")


def _prefill_rows(query_lens):
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("k_scale, v_scale", SCALES)
def test_prefill_fp8_cache_matches_reference(dtype, head_dim, block_size, heads, k_scale, v_scale):
    num_q_heads, num_kv_heads = heads
    query_lens = [q for _, q in CHUNKS]
    batch, deq = fp8_batch([p + q for p, q in CHUNKS], num_kv_heads, head_dim, block_size,
                           k_scale, v_scale)  # fmt: skip
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, device="cuda", dtype=dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    scale = head_dim**-0.5
    ref = reference_prefill(query, deq, query_lens, scale)
    tiles = [(64, 32)] if head_dim == 256 else [(128, 32), (128, 64), (64, 64)]
    for tile in tiles:
        out = torch.full_like(query, float("nan"))
        ops.paged_attention_prefill(
            query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            starts.cuda(), max(query_lens), scale=scale, out=out, block_m=tile[0],
            block_n=tile[1], k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        assert_close_rows(out, ref, _prefill_rows(query_lens), TOL[dtype], f"prefill tile {tile}")


def test_fp8_and_fp16_caches_agree_to_fp8_precision():
    """The fp8 kernels against the fp16 kernels on the unquantized cache: the difference is the
    quantization error (a few percent), not a bug-sized one."""
    lens = [300, 1000, 17]
    full = make_paged_batch(lens, 2, 128, 16, torch.float16)
    fp8 = dataclasses.replace(full, kv_cache=quantize_fp8(full.kv_cache, 1.0))
    query = torch.randn(len(lens), 16, 128, device="cuda", dtype=torch.float16)
    args = (full.block_tables, full.seq_lens, max(lens))
    a = ops.paged_attention_decode(query, full.key_cache, full.value_cache, *args)
    b = ops.paged_attention_decode(query, fp8.key_cache, fp8.value_cache, *args)
    rel = ((a.double() - b.double()).norm() / a.double().norm()).item()
    assert 1e-3 < rel < 0.1, rel


# ---------------------------------------------------------------- block moves, errors


def test_copy_and_swap_fp8_blocks_exact():
    kv_cache = torch.randn(12, 4, 2, 2, 16, 64, device="cuda").to(FP8_DTYPE)
    expected = kv_cache.clone()
    for src, dst in [(0, 5), (3, 7), (11, 2)]:
        expected[dst] = expected[src]
    ops.copy_blocks(kv_cache, [(0, 5), (3, 7), (11, 2)])
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    cpu = torch.zeros(6, 4, 2, 2, 16, 64, dtype=FP8_DTYPE).pin_memory()
    ops.swap_blocks(kv_cache, cpu, [(3, 0), (4, 1), (9, 5)])
    ops.swap_blocks(cpu, kv_cache, [(0, 10)])  # after the swap-out on the same stream
    torch.cuda.synchronize()
    assert torch.equal(
        cpu[[0, 1, 5]].view(torch.uint8), kv_cache[[3, 4, 9]].cpu().view(torch.uint8)
    )
    assert torch.equal(kv_cache[10].view(torch.uint8), kv_cache[3].view(torch.uint8))


def test_fp8_arguments_are_checked():
    batch, _ = fp8_batch([10, 20], 2, 64, 16, 1.0, 1.0)
    query = torch.randn(2, 4, 64, device="cuda", dtype=torch.float16)
    args = (batch.block_tables, batch.seq_lens, 20)
    with pytest.raises(ValueError, match="k_scale and v_scale must be positive"):
        ops.paged_attention_decode(query, batch.key_cache, batch.value_cache, *args, k_scale=0.0)
    with pytest.raises(TypeError, match="value_cache must have the dtype of key_cache"):
        ops.paged_attention_decode(query, batch.key_cache, batch.value_cache.half(), *args)
    key = torch.randn(3, 2, 64, device="cuda")
    slots = torch.tensor([0, 1, 2], device="cuda")
    with pytest.raises(TypeError, match="needs float16 or bfloat16 key"):
        ops.reshape_and_cache(key, key, batch.key_cache, batch.value_cache, slots)
    with pytest.raises(ValueError, match="k_scale and v_scale must be positive"):
        ops.reshape_and_cache(key.half(), key.half(), batch.key_cache, batch.value_cache, slots,
                              1.0, float("nan"))  # fmt: skip
    assert FP8_MAX == torch.finfo(FP8_DTYPE).max


# ---------------------------------------------------------------- a model end to end


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("fp8gpu"), hidden_size=512, num_heads=8,
                            num_kv_heads=2, num_layers=2, vocab_size=512, seed=1)  # fmt: skip
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_next_token_distributions_with_fp8_kv(model_dir, dtype, monkeypatch):
    """4 prompts x 201 teacher-forced positions through the kernels.

    fp8 KV against fp16/bf16 KV: this random model is very sensitive to K/V rounding (its
    attention logits have a std of ~3): the torch path's fp8 emulation of the same model on
    the CPU gives mean KL 2.8e-2 nats, max 0.15, greedy agreement 0.79 (K/V rounded to bf16:
    KL 1.0e-4, agreement 0.978; to fp16: 1.6e-6, 0.995: KL scales with the square of the
    format's step, as rounding noise does). The bounds leave room around those figures.
    fp8 kernels against the torch path's fp8 emulation on the same GPU: both store the same
    bytes, so they differ by fp16/bf16 arithmetic only: a small fraction of the fp8 KL."""
    from pydaemon.layers import attention
    from pydaemon.model_loader.loader import load_model

    model, _ = load_model(model_dir, dtype=dtype, device="cuda")
    prompts = random_prompts(4, 512, 24, 300, seed=7)
    ref_tokens, ref_logp = next_token_logprobs(model, dtype, prompts, 200)
    _, fp8_logp = next_token_logprobs(model, FP8_DTYPE, prompts, 200, forced=ref_tokens)
    kl, disagree, gap = compare_logprobs(ref_tokens, ref_logp, fp8_logp)
    print(f"fp8 vs {dtype} KV (kernels): mean KL {kl.mean():.2e}, max {kl.max():.2e}, "
          f"greedy agreement {1 - disagree.double().mean():.4f}")  # fmt: skip
    assert kl.mean() < 6e-2 and kl.max() < 0.6
    assert disagree.double().mean() <= 0.30
    monkeypatch.setattr(attention, "BACKEND", "torch")
    _, emu_logp = next_token_logprobs(model, FP8_DTYPE, prompts, 200, forced=ref_tokens)
    kl_emu, _, _ = compare_logprobs(ref_tokens, fp8_logp, emu_logp)
    print(f"fp8 kernels vs fp8 torch path: mean KL {kl_emu.mean():.2e}, max {kl_emu.max():.2e}")
    assert kl_emu.mean() < 0.25 * kl.mean()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_generate_with_fp8_kv_and_preemption(model_dir, mode):
    from pydaemon import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(8, 512, 20, 90, seed=3)
    params = [SamplingParams(n=3, temperature=0.9, seed=i, max_tokens=24, ignore_eos=True)
              if i % 2 else greedy for i in range(len(prompts))]  # fmt: skip
    common = dict(device="cuda", dtype="float16", block_size=16, kv_cache_dtype="fp8")
    big = LLM(model_dir, num_kv_blocks=512, **common)
    assert big.engine.runner.kv_cache.dtype == FP8_DTYPE
    ref = big.generate(prompt_token_ids=prompts, sampling_params=params)
    small = LLM(model_dir, num_kv_blocks=24, preemption_mode=mode, watermark=0.0, **common)
    outputs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    tokens = [[c.token_ids for c in o.outputs] for o in outputs]
    assert tokens == [[c.token_ids for c in o.outputs] for o in ref]
    stats = small.engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0
