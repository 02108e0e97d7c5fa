"""The rotary embedding fused with the KV-cache write (ops.rotary_embedding_and_cache): bit for
bit ``rotary_embedding`` then ``reshape_and_cache`` run separately (q, k, the rest of the
fused QKV buffer and the whole cache compared as bytes), for fp16/bf16/fp32 caches of the
model's dtype and fp8 e4m3 caches with scales, head dims 64/128, MHA and GQA, block sizes
16/32, padding slots, views of a fused QKV output and unaligned views (the scalar path); the
attention layer with ``rotary=(cos, sin)`` against rotating first; and whole engines with the
fused kernel against the separate kernels, token for token."""

from __future__ import annotations

import gc
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from pydaemon import LLM, SamplingParams, ops
from pydaemon.config.model import RopeScaling
from pydaemon.layers.rotary_embedding import RotaryEmbedding
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import gaps_to_fp32_argmax, make_hf_model, random_prompts  # noqa: E402

LLAMA3 = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)  # fmt: skip
HEADS = [(8, 8, 64), (16, 4, 64), (8, 8, 128), (32, 8, 128), (16, 2, 128)]  # MHA and GQA
NUM_BLOCKS, NUM_LAYERS = 40, 2


def _qkv(num_tokens, heads, kv_heads, head_dim, dtype, pad=0):
    """q, k, v as views of one fused [T, pad + (heads + 2 kv_heads) * head_dim] buffer (the
    model's layout: row stride > the heads' extent); ``pad`` elements in front shift them off
    16-byte alignment."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (3 * torch.randn(num_tokens, pad + q_size + 2 * kv_size, device="cuda")).to(dtype)
    q, k, v = qkv[:, pad:].split([q_size, kv_size, kv_size], dim=-1)
    return (
        qkv,
        q.view(num_tokens, heads, head_dim),
        k.view(num_tokens, kv_heads, head_dim),
        v.view(num_tokens, kv_heads, head_dim),
    )


def _inputs(num_tokens, heads, kv_heads, head_dim, block_size, dtype, cache_dtype, pad=0):
    """(qkv, q, k, v, kv_cache, slot_mapping, cos, sin): a random cache of NUM_LAYERS layers
    (layer 1's key/value caches are strided views, as the model passes them), distinct
    random slots, every fifth from the fourth on -1 (padding), Llama-3 cos/sin at random
    positions."""
    qkv, q, k, v = _qkv(num_tokens, heads, kv_heads, head_dim, dtype, pad)
    shape = (NUM_BLOCKS, NUM_LAYERS, 2, kv_heads, block_size, head_dim)
    kv_cache = torch.randn(shape, device="cuda").to(cache_dtype)
    slots = torch.randperm(NUM_BLOCKS * block_size)[:num_tokens]
    slots[3::5] = -1
    rope = RotaryEmbedding(head_dim, 500000.0, LLAMA3, device="cuda")
    cos, sin = rope(torch.randint(0, 8192, (num_tokens,), device="cuda"))
    return qkv, q, k, v, kv_cache, slots.cuda(), cos, sin


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
    return f"{len(diff)} bytes differ, first at {diff[:3].tolist()}"


def _fused_and_separate(q, k, v, qkv, kv_cache, slots, cos, sin, k_scale, v_scale):
    """Runs the fused op on (qkv, kv_cache) and the two kernels on clones; -> the clones."""
    qkv2, kv_cache2 = qkv.clone(), kv_cache.clone()
    # The same views into the clones (same offsets and strides).
    q2, k2, v2 = (qkv2.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k, v))
    ops.rotary_embedding(q2, k2, cos, sin)
    ops.reshape_and_cache(k2, v2, kv_cache2[:, 1, 0], kv_cache2[:, 1, 1], slots, k_scale, v_scale)
    ops.rotary_embedding_and_cache(
        q, k, v, kv_cache[:, 1, 0], kv_cache[:, 1, 1], slots, cos, sin, k_scale, v_scale
    )
    return qkv2, kv_cache2


CACHES = [  # (model dtype, cache dtype, k_scale, v_scale)
    (torch.float16, torch.float16, 1.0, 1.0),
    (torch.bfloat16, torch.bfloat16, 1.0, 1.0),
    (torch.float32, torch.float32, 1.0, 1.0),
    (torch.float16, FP8_DTYPE, 1.0, 1.0),
    (torch.bfloat16, FP8_DTYPE, 1.0, 1.0),
    (torch.float16, FP8_DTYPE, 0.37, 1.3),  # scales that are not powers of two
    (torch.bfloat16, FP8_DTYPE, 0.05, 0.3),
]


@pytest.mark.parametrize("num_tokens", [1, 37, 300])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEADS, ids=str)
@pytest.mark.parametrize(("dtype", "cache_dtype", "k_scale", "v_scale"), CACHES, ids=str)
def test_fused_equals_rotary_then_reshape_and_cache(
    dtype, cache_dtype, k_scale, v_scale, heads, kv_heads, head_dim, block_size, num_tokens
):
    qkv, q, k, v, kv_cache, slots, cos, sin = _inputs(
        num_tokens, heads, kv_heads, head_dim, block_size, dtype, cache_dtype
    )
    qkv0 = qkv.clone()
    qkv2, kv_cache2 = _fused_and_separate(q, k, v, qkv, kv_cache, slots, cos, sin, k_scale, v_scale)
    # q and k rotated in place, v untouched: the whole fused buffer, padding tokens included.
    assert _same_bits(qkv, qkv2), "q/k/v: " + _first_diff(qkv, qkv2)
    assert not torch.equal(qkv, qkv0), "q/k were not rotated"
    # The step's slots in layer 1, and nothing else (other layers, padding) touched.
    assert _same_bits(kv_cache, kv_cache2), "cache: " + _first_diff(kv_cache, kv_cache2)


@pytest.mark.parametrize(("dtype", "cache_dtype", "k_scale", "v_scale"), CACHES, ids=str)
def test_unaligned_views_take_the_scalar_path_with_the_same_bits(
    dtype, cache_dtype, k_scale, v_scale
):
    """q/k/v 2 elements off a 16-byte boundary (no vector loads): the same bits."""
    qkv, q, k, v, kv_cache, slots, cos, sin = _inputs(29, 16, 4, 64, 16, dtype, cache_dtype, pad=2)
    assert q.data_ptr() % 16 != 0
    qkv2, kv_cache2 = _fused_and_separate(q, k, v, qkv, kv_cache, slots, cos, sin, k_scale, v_scale)
    assert _same_bits(qkv, qkv2), "q/k/v: " + _first_diff(qkv, qkv2)
    assert _same_bits(kv_cache, kv_cache2), "cache: " + _first_diff(kv_cache, kv_cache2)


def test_all_padding_rotates_and_stores_nothing():
    qkv, q, k, v, kv_cache, slots, cos, sin = _inputs(9, 8, 2, 128, 16, torch.bfloat16, FP8_DTYPE)
    cache0, qkv0 = kv_cache.clone(), qkv.clone()
    slots.fill_(-1)
    ops.rotary_embedding_and_cache(q, k, v, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots, cos, sin)
    assert _same_bits(kv_cache, cache0), "a padding token was stored"
    q0, k0 = (qkv0.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k))
    ops.rotary_embedding(q0, k0, cos, sin)
    assert _same_bits(qkv, qkv0), "padding tokens must still be rotated"


def test_zero_tokens_and_bad_arguments():
    cos = torch.zeros(0, 64, device="cuda")
    _, q, k, v = _qkv(0, 4, 2, 64, torch.bfloat16)
    cache = torch.zeros(4, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    empty_slots = torch.zeros(0, dtype=torch.int64, device="cuda")
    ops.rotary_embedding_and_cache(q, k, v, cache, cache.clone(), empty_slots, cos, cos)

    qkv, q, k, v, kv_cache, slots, cos, sin = _inputs(4, 4, 2, 64, 16, torch.bfloat16,
                                                      torch.bfloat16)  # fmt: skip
    kc, vc = kv_cache[:, 0, 0], kv_cache[:, 0, 1]

    def call(**kw):
        args = dict(query=q, key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots,
                    cos=cos, sin=sin)  # fmt: skip
        args.update(kw)
        ops.rotary_embedding_and_cache(**args)

    with pytest.raises(TypeError, match="value must have the dtype of key"):
        call(value=v.half())
    with pytest.raises(TypeError, match="key_cache must have the dtype of key"):
        call(key_cache=kc.half(), value_cache=vc.half())
    with pytest.raises(TypeError, match="value_cache must have the dtype of key_cache"):
        call(value_cache=vc.half())
    with pytest.raises(TypeError, match="slot_mapping must be int64"):
        call(slot_mapping=slots.int())
    with pytest.raises(ValueError, match="slot_mapping.shape\\[0\\] must be 4"):
        call(slot_mapping=slots[:3])
    with pytest.raises(ValueError, match="key_cache.shape\\[1\\] must be 2 \\(num_kv_heads\\)"):
        call(key_cache=kv_cache[:, 0, 0, :1], value_cache=kv_cache[:, 0, 1, :1])
    with pytest.raises(ValueError, match="value.shape\\[1\\] must be 2"):
        call(value=q[:, :3])
    with pytest.raises(ValueError, match="value_cache must have the same strides"):
        call(value_cache=vc.contiguous())
    with pytest.raises(TypeError, match="cos must be float32"):
        call(cos=cos.half())
    with pytest.raises(ValueError, match="head_dim must be even"):
        call(query=q[..., :63], key=k[..., :63], value=v[..., :63])
    with pytest.raises(ValueError, match="value must be a CUDA tensor"):
        call(value=v.cpu())
    fp8 = kv_cache.to(FP8_DTYPE)
    with pytest.raises(ValueError, match="k_scale and v_scale must be positive"):
        call(key_cache=fp8[:, 0, 0], value_cache=fp8[:, 0, 1], k_scale=0.0)
    _, q32, k32, v32 = _qkv(4, 4, 2, 64, torch.float32)
    with pytest.raises(TypeError, match="fp8 .* needs float16 or bfloat16"):
        call(query=q32, key=k32, value=v32, key_cache=fp8[:, 0, 0], value_cache=fp8[:, 0, 1])


# ---------------------------------------------------------------- the attention layer


@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=str)
def test_attention_layer_with_rotary_equals_rotating_first(cache_dtype, sliding_window):
    """PagedAttention(..., rotary=(cos, sin)) on CUDA (fused kernel, then attention; windowed
    layers attend on the torch path) against the rotary kernel, then the layer without rotary:
    the same output, query and cache bits, prefill chunks and decode rows in one step."""
    from pydaemon.layers.attention import PagedAttention, uses_kernels
    from pydaemon.layers.attention_metadata import AttentionMetadata

    heads, kv_heads, head_dim, bs = 16, 4, 128, 16
    chunks = [(0, 40), (20, 77), (99, 1), (15, 1)]  # (cached, new): two prefills, two decodes
    query_lens = [n for _, n in chunks]
    seq_lens = [c + n for c, n in chunks]
    num_tokens = sum(query_lens)
    qkv, q, k, v, kv_cache, _, cos, sin = _inputs(
        num_tokens, heads, kv_heads, head_dim, bs, torch.bfloat16, cache_dtype
    )
    # Sequence s owns blocks [8 s, 8 s + 8) (<= 128 tokens each).
    tables = torch.arange(len(chunks) * 8, dtype=torch.int32).view(len(chunks), 8)
    slots = [int(tables[s, p // bs]) * bs + p % bs
             for s, (c, n) in enumerate(chunks) for p in range(c, c + n)]  # fmt: skip
    md = AttentionMetadata(
        num_prefills=2,
        num_prefill_tokens=117,
        num_decode_tokens=2,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
        block_tables=tables.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).cuda(),
        max_seq_len=max(seq_lens),
        max_query_len=max(query_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    layer = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window)
    if cache_dtype == FP8_DTYPE:
        layer.k_scale, layer.v_scale = 0.37, 1.3
    assert uses_kernels(kv_cache)
    qkv2, kv_cache2 = qkv.clone(), kv_cache.clone()
    q2, k2, v2 = (qkv2.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k, v))
    got = layer(q, k, v, kv_cache[:, 1, 0], kv_cache[:, 1, 1], md, rotary=(cos, sin))
    ops.rotary_embedding(q2, k2, cos, sin)  # what the model did before: rotate in place first
    want = layer(q2, k2, v2, kv_cache2[:, 1, 0], kv_cache2[:, 1, 1], md)
    assert _same_bits(qkv, qkv2), "q/k/v: " + _first_diff(qkv, qkv2)
    assert _same_bits(kv_cache, kv_cache2), "cache: " + _first_diff(kv_cache, kv_cache2)
    assert _same_bits(got, want), "attention output: " + _first_diff(got, want)


# ---------------------------------------------------------------- whole engines


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # tests/gpu/test_engine_gpu.py's model: head_dim 64, GQA 8 query heads over 2 KV heads,
    # contexts <= 512: decode steps run on a tensor-core kernel, whose sums have a fixed order
    # (the MHA split-KV kernel adds warps by atomics), so two engines give the same bits.
    return make_hf_model(
        tmp_path_factory.mktemp("rotary_cache"),
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        seed=1,
    )


def _separate_kernels(query, key, value, key_cache, value_cache, slot_mapping, cos, sin,
                      k_scale=1.0, v_scale=1.0):  # fmt: skip
    ops.rotary_embedding(query, key, cos, sin)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_engine_with_fused_kernel_equals_separate_kernels(
    model, dtype, kv_cache_dtype, enforce_eager, monkeypatch
):
    """The Llama attention calls the fused kernel once per layer and step (never the rotary or
    cache-write kernel on their own: no double rotation, no missed write); its greedy tokens
    equal an engine whose fused op is replaced by the two kernels, token for token, and
    follow float32 transformers (fp16 cache: tests/gpu/test_engine_gpu.py's criterion)."""
    path, hf = model
    prompts = random_prompts(6, 512, 5, 300, seed=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    calls: Counter[str] = Counter()
    fused, rotary, write = (
        ops.rotary_embedding_and_cache,
        ops.rotary_embedding,
        ops.reshape_and_cache,
    )

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(ops, "rotary_embedding_and_cache", counted("fused", fused))
    monkeypatch.setattr(ops, "rotary_embedding", counted("rotary", rotary))
    monkeypatch.setattr(ops, "reshape_and_cache", counted("write", write))

    def run():
        llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16, num_kv_blocks=256,
                  kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager)  # fmt: skip
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                                 sampling_params=greedy)]  # fmt: skip
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return tokens

    fused_tokens = run()
    assert calls["fused"] > 0, "the fused kernel was never called"
    assert calls["fused"] % 2 == 0, "one call per layer (2 layers) and step"
    assert calls["rotary"] == 0 and calls["write"] == 0, f"separate kernels ran: {calls}"
    monkeypatch.setattr(ops, "rotary_embedding_and_cache", _separate_kernels)
    separate_tokens = run()
    for i, (a, b) in enumerate(zip(fused_tokens, separate_tokens, strict=True)):
        assert a == b, f"sequence {i}: fused {a} != separate kernels {b}"
    if dtype == "float16" and kv_cache_dtype == "auto":
        hf32 = hf.to("cuda", torch.float32)
        gaps = torch.cat([gaps_to_fp32_argmax(hf32, p, t)
                          for p, t in zip(prompts, fused_tokens, strict=True)])  # fmt: skip
        assert float(gaps.max()) < 0.05, f"largest gap {float(gaps.max()):.3f} logit std"
