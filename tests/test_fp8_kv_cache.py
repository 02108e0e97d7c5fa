"""FP8 (e4m3) KV cache on the CPU: quantization against float64, the torch path (which emulates
the CUDA kernels' numbers) against a float64 reference on the dequantized cache, the block
count, config errors, checkpoint scales, and a tiny random Llama's next-token distributions
with an fp8 cache against the full-precision one (KL divergence and greedy agreement)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_hf_model, random_prompts
from kv_logprobs import compare_logprobs, next_token_logprobs
from model_utils import Seq, SimpleAllocator, build_step

from pydaemon import LLM, SamplingParams
from pydaemon.config.engine import EngineConfig
from pydaemon.layers.attention import PagedAttention
from pydaemon.layers.paged_attention_torch import paged_attention_torch, write_kv_cache_torch
from pydaemon.model_loader.loader import load_model
from pydaemon.quantization.kv_cache_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    kv_scales_from_checkpoint,
    quantize_fp8,
    resolve_kv_cache_dtype,
)
from pydaemon.worker.kv_cache import KVCacheSpec

MIN_NORMAL = 2.0**-6  # smallest normal e4m3 magnitude; subnormals are spaced 2**-9


@pytest.mark.parametrize("scale", [1.0, 0.03125, 0.37, 5.0])
def test_quantize_round_trip_within_fp8_tolerance(scale):
    gen = torch.Generator().manual_seed(0)
    # Magnitudes from 2**-12 to 2**10 (past the saturation point 448), both signs.
    x = torch.randn(20000, generator=gen, dtype=torch.float64)
    x = x.sign() * torch.exp2(torch.empty_like(x).uniform_(-12, 10, generator=gen)) * scale
    q = quantize_fp8(x, scale)
    assert q.dtype == FP8_DTYPE
    back = dequantize_fp8(q, scale, torch.float64)
    u = (x / scale).abs()
    normal = (u >= MIN_NORMAL) & (u <= FP8_MAX)
    # Round to nearest with 3 mantissa bits: relative error <= 2**-4 on normal values ...
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0**-4 * (1 + 1e-9), rel.max()
    assert rel.mean() < 0.03  # ~2**-6 expected
    # ... absolute error <= half the subnormal spacing below them, saturation above.
    sub = u < MIN_NORMAL
    assert ((back - x).abs()[sub] <= 2.0**-10 * scale * (1 + 1e-9)).all()
    sat = u > FP8_MAX
    assert sat.any() and torch.equal(back[sat], x[sat].sign() * FP8_MAX * scale)
    # Every e4m3 value times the scale survives the round trip exactly.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float64)
    grid = grid[grid.isfinite()] * scale
    assert torch.equal(dequantize_fp8(quantize_fp8(grid, scale), scale, torch.float64), grid)


def test_kv_cache_dtype_resolution_and_config_errors():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        resolve_kv_cache_dtype("int8", torch.float16)
    with pytest.raises(
        ValueError, match=r"EngineConfig.kv_cache_dtype must be one of .*'fp8_e5m2'"
    ):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_cli_flag_reaches_the_engine_config():
    from pydaemon.entrypoints.cli import build_parser
    from pydaemon.entrypoints.daemon.settings import resolve

    args = build_parser().parse_args(["serve", "--model", "demo", "--kv-cache-dtype", "fp8"])
    engine_kwargs, _, _ = resolve(args)
    assert EngineConfig(**engine_kwargs).kv_cache_dtype == "fp8"


@pytest.mark.parametrize("model_dtype, ratio", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_fp8_blocks_take_less_memory(model_dtype, ratio):
    shape = dict(num_layers=32, num_kv_heads=8, block_size=16, head_dim=128)
    full = KVCacheSpec(**shape, dtype=model_dtype)
    fp8 = KVCacheSpec(**shape, dtype=FP8_DTYPE)
    assert fp8.block_bytes * ratio == full.block_bytes
    budget = 10 * 2**30
    assert fp8.num_blocks_for_bytes(budget) == ratio * full.num_blocks_for_bytes(budget)
    assert fp8.allocate(3, torch.device("cpu")).dtype == FP8_DTYPE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("fp8"), num_heads=4, num_kv_heads=2, seed=5)
    return str(path)


def test_engine_sizes_fp8_cache_from_the_same_budget(model_dir):
    """The same cpu_kv_cache_space gives 4x the blocks of a float32 cache."""
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(
            model_dir,
            device="cpu",
            dtype="float32",
            cpu_kv_cache_space=0.0005,
            kv_cache_dtype=kv_dtype,
        )
        runner = llm.engine.runner
        blocks[kv_dtype] = runner.num_gpu_blocks
        assert runner.kv_cache.dtype == (FP8_DTYPE if kv_dtype == "fp8" else torch.float32)
    assert blocks["fp8"] // 4 == blocks["auto"] > 0, blocks  # floor(4x) of the same bytes


def _dense_reference(q, k, v, q_pos, scale, window):
    """float64 causal attention; q: [Tq, Hq, D], k/v: [L, Hkv, D], q_pos: [Tq] -> [Tq, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = k_pos > q_pos[:, None]
    if window is not None:
        mask |= k_pos <= q_pos[:, None] - window
    s.masked_fill_(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.02, 0.5)])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_torch_path_reads_the_dequantized_cache(k_scale, v_scale, sliding_window):
    """A prefill chunk with a cached prefix and two decodes through an fp8 cache: equal to a
    float64 reference on the dequantized K/V, and close to the full-precision result."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, bs, num_blocks = 8, 2, 32, 8, 40
    lens, q_lens = [29, 13, 20], [11, 1, 1]  # prefill (18 cached + 11 new), then two decodes
    alloc = SimpleAllocator(num_blocks, shuffle_seed=3)
    seqs = [Seq(list(range(n))) for n in lens]
    for s, n in zip(seqs, lens, strict=True):
        alloc.ensure(s, n, bs)
    k_all = [torch.randn(n, hkv, d, generator=gen) * 2 for n in lens]
    v_all = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    caches = {}
    for dtype in (FP8_DTYPE, torch.float32):
        kc = torch.full((num_blocks, hkv, bs, d), float("nan")).to(dtype)
        vc = kc.clone()
        for s, k, v in zip(seqs, k_all, v_all, strict=True):
            slots = torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(len(k))])
            write_kv_cache_torch(k, v, kc, vc, slots, k_scale, v_scale)
        caches[dtype] = (kc, vc)
    for s, n, q in zip(seqs, lens, q_lens, strict=True):
        s.num_computed_tokens = n - q
    _, _, md = build_step(seqs, q_lens, 1, bs)
    query = torch.randn(sum(q_lens), hq, d, generator=gen)
    scale = d**-0.5
    out = paged_attention_torch(
        query, *caches[FP8_DTYPE], md, scale, sliding_window, k_scale, v_scale
    )
    full = paged_attention_torch(query, *caches[torch.float32], md, scale, sliding_window)
    start = 0
    for k, v, n, q in zip(k_all, v_all, lens, q_lens, strict=True):
        kq = dequantize_fp8(quantize_fp8(k, k_scale), k_scale, torch.float64)
        vq = dequantize_fp8(quantize_fp8(v, v_scale), v_scale, torch.float64)
        q_pos = torch.arange(n - q, n)
        ref = _dense_reference(query[start : start + q], kq, vq, q_pos, scale, sliding_window)
        torch.testing.assert_close(out[start : start + q].double(), ref, atol=2e-5, rtol=1e-5)
        start += q
    # Quantization error against the full-precision cache stays at the fp8 level.
    err = (out - full).abs()
    assert err.max() < 0.4 and err.mean() < 0.03, (err.max(), err.mean())


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_keeps_next_token_distributions(model_dir, model_dtype):
    """Tiny random Llama (CPU), 4 prompts x 201 next tokens: the fp8 cache's next-token
    distributions against those of a cache in the model's dtype, on the same teacher-forced
    tokens. Measured (float32 / bf16 model): mean KL 2.9e-4 / 1.8e-4 nats, max 1.1e-3 /
    7.4e-4; greedy agreement 0.938 / 0.929, every disagreement at a near-tie (reference top-2
    gap <= 0.08 nats; this random model's distributions are nearly flat, entropy 5.3 of 5.5
    nats). For scale: K/V rounded to bf16 instead give KL 1e-6 and agreement 0.997, and the
    KL ratio (~256) is the square of the two formats' step ratio (2**-3 / 2**-7), as rounding
    noise predicts."""
    model, _ = load_model(model_dir, dtype=model_dtype)
    prompts = random_prompts(4, 256, 24, 40, seed=7)
    ref_tokens, ref_logp = next_token_logprobs(model, model_dtype, prompts, 200)
    _, fp8_logp = next_token_logprobs(model, FP8_DTYPE, prompts, 200, forced=ref_tokens)
    kl, disagree, gap = compare_logprobs(ref_tokens, ref_logp, fp8_logp)
    print(
        f"fp8 KV vs {model_dtype} KV over {kl.numel()} positions: mean KL {kl.mean():.2e}, "
        f"max KL {kl.max():.2e}, greedy agreement {1 - disagree.double().mean():.4f}, largest "
        f"reference gap at a disagreement {gap[disagree].max() if disagree.any() else 0:.3f}"
    )
    assert kl.min() >= -1e-9
    assert kl.mean() < 1e-3 and kl.max() < 1e-2
    assert disagree.double().mean() <= 0.10
    assert (gap[disagree] < 0.2).all()  # fp8 never overturns a clear choice


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _fp8_llm(model_dir, **kwargs):
    return LLM(model_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8", **kwargs)


@pytest.fixture(scope="module")
def fp8_reference(model_dir):
    """fp8-cache outputs with plenty of blocks, no prefix caching, no preemption."""
    llm = _fp8_llm(model_dir, num_kv_blocks=512, enable_prefix_caching=False)
    prompts = random_prompts(8, 256, 20, 70, seed=11)
    return prompts, llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fp8_preemption_keeps_outputs(model_dir, fp8_reference, mode):
    """Swap moves fp8 blocks byte for byte; recompute rewrites the same quantized K/V."""
    prompts, ref = fp8_reference
    llm = _fp8_llm(model_dir, block_size=8, num_kv_blocks=24, preemption_mode=mode, watermark=0.0)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert _tokens(outputs) == _tokens(ref)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0
        assert llm.engine.runner.cpu_kv_cache.dtype == FP8_DTYPE


def test_fp8_parallel_sampling_groups_swap_and_copy_on_write(model_dir):
    prompts = random_prompts(6, 256, 10, 40, seed=3)
    params = [
        SamplingParams(n=3, temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
        if i % 2 == 0
        else GREEDY
        for i in range(len(prompts))
    ]
    ref = _fp8_llm(model_dir, num_kv_blocks=512).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    small = _fp8_llm(
        model_dir, block_size=8, num_kv_blocks=20, preemption_mode="swap", watermark=0.0
    )
    outputs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert _tokens(outputs) == _tokens(ref)
    assert small.engine.get_stats().num_preemptions > 0


def test_fp8_prefix_cache_keeps_outputs(model_dir):
    shared = random_prompts(1, 256, 64, 64, seed=9)[0]
    prompts = [shared + [10 + i] for i in range(3)]
    llm = _fp8_llm(model_dir, block_size=16, num_kv_blocks=128)
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY)
    assert llm.engine.get_stats().prefix_cache_hit_tokens >= 2 * 64
    nocache = _fp8_llm(model_dir, num_kv_blocks=128, enable_prefix_caching=False)
    ref = nocache.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert _tokens(first + rest) == _tokens(ref)


def test_checkpoint_kv_scales_are_read_and_used(tmp_path):
    """Per-layer scales under vLLM / compressed-tensors names reach the attention layers."""
    from safetensors.torch import load_file, save_file

    path, _ = make_hf_model(tmp_path / "scaled", num_heads=4, num_kv_heads=2, seed=5)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    weights["model.layers.1.self_attn.kv_scale"] = torch.tensor([3.0])
    save_file(weights, str(path / "model.safetensors"))
    assert kv_scales_from_checkpoint(path, 2) == [(0.5, 0.25), (3.0, 3.0)]
    llm = _fp8_llm(str(path), num_kv_blocks=64)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PagedAttention)]
    assert [(m.k_scale, m.v_scale) for m in layers] == [(0.5, 0.25), (3.0, 3.0)]
    out = llm.generate(
        prompt_token_ids=random_prompts(2, 256, 20, 30, seed=1), sampling_params=GREEDY
    )
    assert [len(o.outputs[0].token_ids) for o in out] == [24, 24]
    # A model directory without scales (or auto KV) keeps 1.0.
    assert kv_scales_from_checkpoint(tmp_path / "nowhere", 2) == [(1.0, 1.0)] * 2


def test_layer_stores_with_its_scales():
    """The attention layer quantizes with its own k_scale / v_scale (torch path)."""
    gen = torch.Generator().manual_seed(4)
    layer = PagedAttention(4, 2, 16, scale=0.25)
    layer.k_scale, layer.v_scale = 0.5, 0.03
    seq = Seq(list(range(10)))
    SimpleAllocator(4).ensure(seq, 10, 8)
    _, _, md = build_step([seq], [10], 1, 8)
    q, k, v = (torch.randn(10, h, 16, generator=gen) for h in (4, 2, 2))
    key_cache = torch.zeros(4, 2, 8, 16, dtype=FP8_DTYPE)
    value_cache = key_cache.clone()
    layer(q, k, v, key_cache, value_cache, md)
    stored_k = key_cache[:2].permute(1, 0, 2, 3).reshape(2, 16, 16)[:, :10].transpose(0, 1)
    stored_v = value_cache[:2].permute(1, 0, 2, 3).reshape(2, 16, 16)[:, :10].transpose(0, 1)
    assert torch.equal(stored_k.view(torch.uint8), quantize_fp8(k, 0.5).view(torch.uint8))
    assert torch.equal(stored_v.view(torch.uint8), quantize_fp8(v, 0.03).view(torch.uint8))


def test_bad_checkpoint_kv_scale_is_named(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale .* must be > 0"):
        kv_scales_from_checkpoint(tmp_path, 1)
    save_file(
        {"model.layers.0.self_attn.v_scale": torch.ones(4)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ValueError, match="only per-layer"):
        kv_scales_from_checkpoint(tmp_path, 1)
