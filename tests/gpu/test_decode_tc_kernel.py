"""The tensor-core GQA decode kernel (ops.paged_attention_decode_tc) against a float64
reference on fresh random inputs (outputs poisoned with NaN), single and split-KV partitions,
fp8 caches, its agreement with the CUDA-core decode kernel, CUDA-graph replay, and the
attention layer / engine routing decode steps to it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon import ops

from .kv_factory import fp8_batch, make_paged_batch, reference_decode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import gaps_to_fp32_argmax, make_hf_model, random_prompts  # noqa: E402

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (num_q_heads, num_kv_heads): groups 1 (MHA), 2, 4, 8 and the largest, 16.
HEADS = [(4, 4), (8, 4), (16, 4), (16, 2), (32, 2)]
# Around the 16-key sub-tile, the 64-key multiple, block and partition boundaries.
LENS = [1, 15, 16, 17, 63, 64, 65, 255, 1000, 4097]
# partition_size: None = the default rule (one partition for these few sequences up to 256
# keys, else partitions of 256+); 64 = many partitions, several sub-tiles per warp only at 4k.
PARTITIONS = [None, 64]


def run_tc(batch, num_q_heads, head_dim, dtype, max_seq_len=None, **kw):
    num_seqs = len(batch.seq_lens_cpu)
    query = torch.randn(num_seqs, num_q_heads, head_dim, device="cuda", dtype=dtype)
    out = torch.full_like(query, float("nan"))  # poison: every element must be written
    scale = head_dim**-0.5
    got = ops.paged_attention_decode_tc(
        query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        max(batch.seq_lens_cpu) if max_seq_len is None else max_seq_len,
        scale=scale,
        out=out,
        **kw,
    )
    assert got is out, "out= must be written in place and returned"
    return out, query, scale


def assert_close_per_seq(out, ref, tol, what="", lens=None):
    for s in range(out.shape[0]):
        ctx = f"{what} seq {s}" + (f" (len {lens[s]})" if lens else "")
        assert not torch.isnan(out[s]).any(), f"{ctx}: NaN in output (unwritten or bad)"
        for h in range(out.shape[1]):
            r = ref[s, h]
            err = (out[s, h].double() - r).norm() / r.norm()
            assert err < tol, f"{ctx} head {h}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("partition_size", PARTITIONS, ids=lambda p: f"part{p}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_tc_matches_reference(heads, block_size, head_dim, dtype, partition_size):
    num_q_heads, num_kv_heads = heads
    batch = make_paged_batch(LENS, num_kv_heads, head_dim, block_size, dtype)
    out, query, scale = run_tc(batch, num_q_heads, head_dim, dtype, partition_size=partition_size)
    assert_close_per_seq(out, reference_decode(query, batch, scale), TOL[dtype], lens=LENS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(32, 8), (64, 8), (32, 4)], ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("partition_size", [None, 16384, 512, 64], ids=lambda p: f"part{p}")
def test_decode_tc_long_context_16k(dtype, heads, partition_size):
    """16k keys in one partition (16384), in 32 (512), in 256 (64), and the default split."""
    lens = [16384, 3, 9000]
    batch = make_paged_batch(lens, heads[1], 128, 16, dtype)
    out, query, scale = run_tc(batch, heads[0], 128, dtype, partition_size=partition_size)
    assert_close_per_seq(out, reference_decode(query, batch, scale), TOL[dtype], lens=lens)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_tc_many_long_blocks_three_per_sm(dtype):
    """1,024 (sequence, kv head) pairs, one partition, max_seq_len >= 2048: the 16-bit head-128
    kernel's 2-stage, 3-blocks-per-SM configuration (decode_tc_three_blocks)."""
    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 300, (128,), generator=gen).tolist()
    lens[5], lens[64], lens[127] = 2048, 2100, 2049
    batch = make_paged_batch(lens, 8, 128, 16, dtype)
    out, query, scale = run_tc(batch, 32, 128, dtype)
    assert_close_per_seq(out, reference_decode(query, batch, scale), TOL[dtype], lens=lens)


@pytest.mark.parametrize("partition_size", [64, 1024], ids=lambda p: f"part{p}")
def test_decode_tc_empty_sequence_zeros_and_too_long_nan(partition_size):
    lens = [0, 600, 0, 17]
    batch = make_paged_batch(lens, 2, 64, 16, torch.bfloat16)
    out, query, scale = run_tc(batch, 8, 64, torch.bfloat16, partition_size=partition_size)
    ref = reference_decode(query, batch, scale)
    for s in (0, 2):
        assert torch.equal(out[s], torch.zeros_like(out[s])), f"seq {s} (len 0) must be zeros"
    assert_close_per_seq(out[[1, 3]], ref[[1, 3]], TOL[torch.bfloat16], "non-empty")
    # max_seq_len understated: the long sequence is NaN (not truncated), the others exact.
    out, query, scale = run_tc(
        batch, 8, 64, torch.bfloat16, max_seq_len=300, partition_size=partition_size
    )
    assert torch.isnan(out[1]).all(), "seq 1 (600 > max_seq_len 300) must be NaN"
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = reference_decode(query, batch, scale)
    assert_close_per_seq(out[3:], ref[3:], TOL[torch.bfloat16], "len 17")


def test_decode_tc_generous_max_seq_len_and_strided_query():
    """max_seq_len far above every length (idle partitions), a standalone contiguous cache,
    and a query that is a strided view of a qkv tensor."""
    lens = [40, 700, 5]
    batch = make_paged_batch(lens, 4, 128, 32, torch.float16, num_layers=1, layer=0)
    batch.block_tables = torch.cat(
        [batch.block_tables, torch.zeros(3, 100, dtype=torch.int32, device="cuda")], dim=1
    )
    qkv = torch.randn(3, 3 * 16, 128, device="cuda", dtype=torch.float16)
    query = qkv[:, 16:32]  # stride(0) = 48 * 128
    for part in (None, 64, 4096):
        out = ops.paged_attention_decode_tc(
            query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 3000,
            partition_size=part,
        )  # fmt: skip
        assert_close_per_seq(out, reference_decode(query, batch, 128**-0.5), 2e-3, f"part {part}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(32, 8), (16, 2)], ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_tc_agrees_with_cuda_core_decode(dtype, heads):
    lens = [1, 300, 2049, 777, 16]
    batch = make_paged_batch(lens, heads[1], 128, 16, dtype)
    query = torch.randn(len(lens), heads[0], 128, device="cuda", dtype=dtype)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 2049)
    a = ops.paged_attention_decode(*args)
    ref = reference_decode(query, batch, 128**-0.5)
    for part in (None, 256):
        b = ops.paged_attention_decode_tc(*args, partition_size=part)
        assert_close_per_seq(b, a.double(), 2 * TOL[dtype], f"tc (part {part}) vs cuda-core")
        assert_close_per_seq(b, ref, TOL[dtype], f"tc (part {part}) vs reference")


# ---------------------------------------------------------------- fp8 cache


@pytest.mark.parametrize(
    "k_scale, v_scale, partition_size",
    [(1.0, 1.0, None), (0.05, 0.3, 64), (0.05, 0.3, 1024)],
    ids=["scale1-partNone", "scales-part64", "scales-part1024"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_tc_fp8_cache_matches_reference(
    heads, block_size, head_dim, dtype, k_scale, v_scale, partition_size
):
    num_q_heads, num_kv_heads = heads
    batch, deq = fp8_batch(LENS, num_kv_heads, head_dim, block_size, k_scale, v_scale)
    out, query, scale = run_tc(
        batch, num_q_heads, head_dim, dtype, k_scale=k_scale, v_scale=v_scale,
        partition_size=partition_size,
    )  # fmt: skip
    assert_close_per_seq(out, reference_decode(query, deq, scale), TOL[dtype], "fp8", LENS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_tc_fp8_cache_long_context_16k(dtype):
    lens = [16384, 9000, 16001]
    batch, deq = fp8_batch(lens, 8, 128, 16, 0.05, 0.3)
    for part in (None, 16384):
        out, query, scale = run_tc(
            batch, 32, 128, dtype, k_scale=0.05, v_scale=0.3, partition_size=part
        )
        ref = reference_decode(query, deq, scale)
        assert_close_per_seq(out, ref, TOL[dtype], f"fp8 16k part {part}", lens)


# ---------------------------------------------------------------- CUDA graphs, errors


def test_decode_tc_cuda_graph_replay_with_new_seq_lens_equals_eager():
    """Capture at max_seq_len 2048 (several partitions, workspaces from the graph's pool),
    then change seq_lens (and queries) in place: replay equals an eager call, bit for bit."""
    lens = [2048, 100, 1500, 7]
    batch = make_paged_batch(lens, 8, 128, 16, torch.bfloat16)
    query = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)

    def step():
        ops.paged_attention_decode_tc(
            query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 2048,
            out=out, partition_size=256,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in ([5, 2048, 300, 1], [1024, 1, 1, 2000], [0, 17, 256, 257]):
        batch.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        batch.seq_lens_cpu = new_lens
        query.copy_(torch.randn_like(query))
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.paged_attention_decode_tc(
            query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 2048,
            partition_size=256,
        )  # fmt: skip
        assert torch.equal(out, eager), f"replay != eager for seq_lens {new_lens}"
        nonzero = [s for s, n in enumerate(new_lens) if n > 0]
        ref = reference_decode(query, batch, 128**-0.5)
        assert_close_per_seq(out[nonzero], ref[nonzero], TOL[torch.bfloat16], f"{new_lens}")


def test_decode_tc_argument_errors_name_the_problem():
    batch = make_paged_batch([10, 200], 2, 64, 16, torch.float16)  # block table: 224 keys
    query = torch.randn(2, 8, 64, device="cuda", dtype=torch.float16)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    with pytest.raises(ValueError, match="partition_size"):
        ops.paged_attention_decode_tc(*args, 200, partition_size=100)
    with pytest.raises(ValueError, match="at most 16 query heads per kv head"):
        q34 = torch.randn(2, 34, 64, device="cuda", dtype=torch.float16)
        ops.paged_attention_decode_tc(q34, *args[1:], 200)
    with pytest.raises(ValueError, match="max_seq_len"):
        ops.paged_attention_decode_tc(*args, 10_000)  # past the block table
    stream = torch.cuda.current_stream().cuda_stream
    # 200 keys in partitions of 64: 4 partitions, so the workspaces are required ...
    with pytest.raises(ValueError, match="tmp_out is required"):
        ops.core().paged_attention_decode_tc(
            torch.empty_like(query), query, batch.key_cache, batch.value_cache,
            batch.block_tables, batch.seq_lens, 0.125, 200, 64, None, None, None, 1.0, 1.0,
            0, 0.0, None, stream,
        )  # fmt: skip
    # ... and must have 4 of them.
    bad = torch.empty(2, 8, 3, 64, device="cuda")
    with pytest.raises(ValueError, match="num_partitions"):
        ops.core().paged_attention_decode_tc(
            torch.empty_like(query), query, batch.key_cache, batch.value_cache,
            batch.block_tables, batch.seq_lens, 0.125, 200, 64, bad, bad[..., 0], bad[..., 0],
            1.0, 1.0, 0, 0.0, None, stream,
        )  # fmt: skip


# ---------------------------------------------------------------- layer and engine routing


def test_layer_decode_step_uses_tc_kernel_up_to_16_heads_a_group(monkeypatch):
    from pydaemon.layers.attention import PagedAttention, decode_kernel
    from pydaemon.layers.attention_metadata import AttentionMetadata

    assert decode_kernel(4, 128) == "tensor_cores"
    assert decode_kernel(1, 128) == "tensor_cores"  # MHA
    assert decode_kernel(32, 128) == "cuda_cores"  # more than one mma atom of rows
    calls = []
    for name in ("paged_attention_decode_tc", "paged_attention_decode", "paged_attention_prefill"):
        real = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    for heads, expected in (
        ((32, 8), "paged_attention_decode_tc"),
        ((8, 8), "paged_attention_decode_tc"),
        ((32, 1), "paged_attention_decode"),
    ):
        calls.clear()
        lens = [700, 3000, 5]
        batch = make_paged_batch(lens, heads[1], 128, 16, torch.bfloat16)
        tables = batch.block_tables.cpu()
        slots = [int(tables[s, (n - 1) // 16]) * 16 + (n - 1) % 16 for s, n in enumerate(lens)]
        query = torch.randn(3, heads[0], 128, device="cuda", dtype=torch.bfloat16)
        key = torch.randn(3, heads[1], 128, device="cuda", dtype=torch.bfloat16)
        value = torch.randn_like(key)
        md = AttentionMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=3,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
            block_tables=batch.block_tables,
            seq_lens=batch.seq_lens,
            query_start_loc=torch.arange(4, dtype=torch.int32, device="cuda"),
            max_seq_len=max(lens),
            max_query_len=1,
            seq_lens_cpu=lens,
            query_lens_cpu=[1, 1, 1],
        )
        layer = PagedAttention(heads[0], heads[1], 128, 128**-0.5)
        out = layer(query, key, value, batch.key_cache, batch.value_cache, md)
        assert calls == [expected], f"heads {heads}: {calls}"
        ref = reference_decode(query, batch, 128**-0.5)  # the cache holds the new K/V
        assert_close_per_seq(out.view(3, heads[0], 128), ref, TOL[torch.bfloat16], f"{heads}")


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    # head_dim 64, 8 query heads over 2 KV heads (group 4): decode runs on the tc kernel.
    return make_hf_model(
        tmp_path_factory.mktemp("tc"),
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=512,
        max_position_embeddings=2048,  # prompts up to 600 tokens + 32 new ones
        seed=2,
    )


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_engine_gqa_decode_on_tc_kernel_follows_fp32_and_torch_path(
    gqa_model, enforce_eager, monkeypatch
):
    from pydaemon import LLM, SamplingParams
    from pydaemon.layers import attention

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    path, hf = gqa_model
    prompts = random_prompts(6, 512, 5, 600, seed=7)
    calls = []
    real = ops.paged_attention_decode_tc
    monkeypatch.setattr(
        ops, "paged_attention_decode_tc", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    # Graphs: buckets 1..8 at tiers 512 and 1024 (every step of these 6 sequences fits).
    llm = LLM(
        str(path), device="cuda", dtype="float16", block_size=16, num_kv_blocks=512,
        enforce_eager=enforce_eager, max_num_seqs=8, max_seq_len_to_capture=1024,
    )  # fmt: skip
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert calls, "no decode step reached paged_attention_decode_tc"
    monkeypatch.setattr(attention, "BACKEND", "torch")
    llm_torch = LLM(
        str(path), device="cuda", dtype="float16", block_size=16, num_kv_blocks=512,
        enforce_eager=True,
    )  # fmt: skip
    torch_outputs = llm_torch.generate(prompt_token_ids=prompts, sampling_params=greedy)
    hf32 = hf.to("cuda", torch.float32)
    same = 0
    for p, o, t in zip(prompts, outputs, torch_outputs, strict=True):
        ours, theirs = o.outputs[0].token_ids, t.outputs[0].token_ids
        same += ours == theirs
        gaps = gaps_to_fp32_argmax(hf32, p, ours)
        # fp16 greedy follows float32's argmax except at near-ties (gap < 5% of a logit std).
        assert float(gaps.max()) < 0.05, f"largest gap {float(gaps.max()):.3f} logit std"
    # fp16 rounding differs between the kernel and the torch path only at near-ties.
    assert same >= len(prompts) - 1, f"only {same}/{len(prompts)} sequences equal the torch path"


@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (32, 1)], ids=["gqa", "mha", "group32"])
def test_layer_mixed_step_splits_prefill_and_decode_rows(heads, monkeypatch):
    """A step with prefill chunks and decode rows: a layer whose decode runs on tensor cores
    (GQA, MHA) sends the chunks to the prefill kernel and the decode rows to the decode
    kernel (two launches, one output); a group of 32 keeps one prefill launch. Either way the
    output is the torch path's."""
    from pydaemon.layers.attention import PagedAttention
    from pydaemon.layers.attention_metadata import AttentionMetadata
    from pydaemon.layers.paged_attention_torch import paged_attention_torch

    calls = []
    for name in ("paged_attention_decode_tc", "paged_attention_decode", "paged_attention_prefill"):
        real = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    torch.manual_seed(3)
    # two prefills (a 50-token chunk after 30 cached tokens, a fresh 70-token prompt), then
    # three decode rows
    prefixes, query_lens = [30, 0, 699, 2999, 4], [50, 70, 1, 1, 1]
    lens = [p + q for p, q in zip(prefixes, query_lens, strict=True)]
    batch = make_paged_batch(lens, heads[1], 128, 16, torch.bfloat16)
    tables = batch.block_tables.cpu()
    slots = [
        int(tables[s, pos // 16]) * 16 + pos % 16
        for s, (p, n) in enumerate(zip(prefixes, lens, strict=True))
        for pos in range(p, n)
    ]
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, heads[0], 128, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(num_tokens, heads[1], 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).cuda()
    md = AttentionMetadata(
        num_prefills=2,
        num_prefill_tokens=120,
        num_decode_tokens=3,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=starts,
        max_seq_len=max(lens),
        max_query_len=max(query_lens),
        seq_lens_cpu=lens,
        query_lens_cpu=query_lens,
    )
    layer = PagedAttention(heads[0], heads[1], 128, 128**-0.5)
    out = layer(query, key, value, batch.key_cache, batch.value_cache, md)
    expected = ["paged_attention_prefill"]
    if heads[0] // heads[1] <= 16:
        expected.append("paged_attention_decode_tc")
    assert calls == expected
    ref = paged_attention_torch(query, batch.key_cache, batch.value_cache, md, 128**-0.5)
    ref = ref.view(num_tokens, heads[0], 128).double()
    got = out.view(num_tokens, heads[0], 128).double()
    for s in range(len(lens)):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        err = (got[rows] - ref[rows]).norm() / ref[rows].norm()
        assert err < TOL[torch.bfloat16], f"sequence {s}: relative error {err:.2e}"
