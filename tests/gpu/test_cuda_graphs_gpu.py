"""Decode steps replayed from CUDA graphs against the same steps run eagerly.

Why a tolerance and not bitwise equality: a graph runs the batch padded to its bucket, and
cuBLAS may pick another GEMM kernel (another reduction order) for 8 rows than for 5; the
decode attention kernel sums partial outputs with shared-memory atomics (order varies run to
run) and, captured at a seq-len tier, may merge partitions through its reduce kernel where the
eager launch had one partition. All of that moves logits by a few fp16/bf16 ulps; a wrong
input (stale slot, wrong block table, wrong length) moves them by O(1). The bounds below sit
between the two: max |graph - eager| under 2% (fp16; bf16 5%) of the logits' standard
deviation, the same argmax wherever the top two logits are apart, and the KV cache identical
outside the step's own slots. Whole generations: greedy tokens of the graph engine follow
float32 transformers as the eager engine's do (tests/gpu/test_engine_gpu.py's criterion), and
all but at most one sequence are token-for-token the eager engine's (a last-ulp difference
may flip a near-tie, after which a sequence goes its own way; a wrong graph input breaks all).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import gaps_to_fp32_argmax, make_hf_model, random_prompts  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.worker.input_batch import StepInput  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 12800  # 100 sequences of up to 2048 tokens
VOCAB = 512
# head_dim 64; GQA 8 query heads over 2 KV heads (group 4: tensor-core decode at <= 512
# tokens, split-KV above) and MHA 8/8 (always the split-KV decode kernel).
HEADS = {"gqa": (8, 2), "mha": (8, 8)}


def _model(tmp_path_factory, kind: str, max_len: int = 2048):
    num_heads, num_kv_heads = HEADS[kind]
    return make_hf_model(
        tmp_path_factory.mktemp(kind),
        hidden_size=512,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=max_len,
        seed=5,
    )


@pytest.fixture(scope="module", params=[("gqa", "float16"), ("mha", "bfloat16")], ids=str)
def runner(request, tmp_path_factory):
    kind, dtype = request.param
    path, _ = _model(tmp_path_factory, kind)
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=BLOCK_SIZE,
              num_kv_blocks=NUM_BLOCKS, max_num_seqs=128)  # fmt: skip
    runner = llm.engine.runner
    graphs = runner.cuda_graphs
    assert graphs is not None, "CUDA graphs are off on a CUDA fp16/bf16 model"
    assert len(graphs.graphs) == len(graphs.plan.keys())
    yield runner
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def decode_step(seq_lens: list[int], rng: np.random.Generator) -> StepInput:
    """A decode step of len(seq_lens) sequences on distinct random blocks; each computes the
    token at position seq_len - 1 (seq_len = 16k + 1: the first slot of a new block)."""
    n = len(seq_lens)
    lens = np.array(seq_lens, dtype=np.int32)
    need = -(-lens // BLOCK_SIZE)
    assert need.sum() <= NUM_BLOCKS
    perm = rng.permutation(NUM_BLOCKS).astype(np.int32)
    tables = np.zeros((n, int(need.max())), dtype=np.int32)
    ends = np.cumsum(need)
    for i in range(n):
        tables[i, : need[i]] = perm[ends[i] - need[i] : ends[i]]
    positions = (lens - 1).astype(np.int64)
    slots = tables[np.arange(n), positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
    return StepInput(
        seq_ids=list(range(n)),
        num_prefills=0,
        input_ids=rng.integers(3, VOCAB, n).astype(np.int64),
        positions=positions,
        slot_mapping=slots + positions % BLOCK_SIZE,
        block_tables=tables,
        seq_lens=lens,
        query_lens=np.ones(n, dtype=np.int32),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        is_sampled=np.ones(n, dtype=bool),
        sample_index=np.arange(n, dtype=np.int64),
    )


# Boundaries: a new block (17, 33, 1025), a new split-KV partition (257, 513), the first
# seq-len tier (512 / 513), the longest context the model allows (2048).
EDGES = [1, 2, 17, 33, 256, 257, 512, 513, 1025, 2048]


def _seq_lens(batch_size: int, regime: str, rng: np.random.Generator) -> list[int]:
    if batch_size == 1:
        return [1025 if regime == "mixed" else 300]  # 1k context, first slot of a new block
    hi = 2048 if regime == "mixed" else 512
    edges = [e for e in EDGES if e <= hi]
    lens = rng.integers(1, hi + 1, batch_size).tolist()
    lens[: len(edges)] = edges[:batch_size]
    return lens


@pytest.mark.parametrize("regime", ["short", "mixed"])
@pytest.mark.parametrize("batch_size", [1, 3, 8, 17, 100])
def test_graph_logits_equal_eager(runner, batch_size, regime):
    with torch.inference_mode():
        _check_graph_step(runner, batch_size, regime)


def _check_graph_step(runner, batch_size: int, regime: str) -> None:
    rng = np.random.default_rng(batch_size)
    step = decode_step(_seq_lens(batch_size, regime, rng), rng)
    graphs = runner.cuda_graphs
    key = graphs.key_for(step)
    assert key is not None and key.batch_size >= batch_size
    assert key.max_seq_len >= int(step.seq_lens.max())
    cache = runner.kv_cache  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
    torch.manual_seed(batch_size)
    cache.normal_()
    before = cache.clone()
    _, eager = runner._forward_eager(step)
    eager_cache = cache.clone()
    cache.copy_(before)
    replays = graphs.num_replays
    _, graph = runner._forward(step)
    torch.cuda.synchronize()
    assert graphs.num_replays == replays + 1, "the step did not replay a graph"
    assert graph.shape == eager.shape == (batch_size, VOCAB)

    scale = float(eager.std())
    tol = 0.02 if runner.dtype == torch.float16 else 0.05  # bf16 keeps 3 fewer mantissa bits
    err = (graph - eager).abs().amax(dim=-1) / scale  # [batch_size]
    worst = int(err.argmax())
    assert float(err.max()) < tol, (
        f"{key}: logits differ by {float(err.max()):.3g} std at row {worst} "
        f"(seq_len {int(step.seq_lens[worst])}); rows over {tol}: "
        f"{(err >= tol).nonzero().flatten().tolist()}"
    )
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
    assert torch.equal(graph.argmax(-1)[clear], eager.argmax(-1)[clear])

    # The cache: the step's own slots as eager wrote them, every other slot untouched (the
    # padding rows' slot -1 wrote nothing).
    def by_slot(c):  # -> [num_blocks, block_size, num_layers, 2, num_kv_heads, head_dim]
        return c.permute(0, 4, 1, 2, 3, 5)

    written = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool, device=cache.device)
    slots = torch.from_numpy(step.slot_mapping).to(cache.device)
    written[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = True
    assert torch.equal(by_slot(cache)[~written], by_slot(before)[~written]), (
        "a graph replay wrote outside the step's slots"
    )
    torch.testing.assert_close(
        by_slot(cache)[written], by_slot(eager_cache)[written], rtol=3e-2, atol=3e-2
    )


def test_steps_graphs_cannot_serve_run_eagerly(runner):
    rng = np.random.default_rng(0)
    graphs = runner.cuda_graphs
    assert graphs.key_for(decode_step([5] * 129, rng)) is None  # past the largest bucket (128)
    prefill = decode_step([40, 3], rng)
    prefill.num_prefills = 1
    assert graphs.key_for(prefill) is None


def test_longer_context_than_captured_runs_eagerly(tmp_path_factory):
    path, _ = _model(tmp_path_factory, "gqa")
    llm = LLM(str(path), device="cuda", dtype="float16", block_size=BLOCK_SIZE,
              num_kv_blocks=1024, max_num_seqs=8, max_seq_len_to_capture=600)  # fmt: skip
    graphs = llm.engine.runner.cuda_graphs
    assert graphs.plan.seq_len_tiers == (512, 600)
    rng = np.random.default_rng(1)
    assert graphs.key_for(decode_step([600, 3], rng)) is not None
    assert graphs.key_for(decode_step([601, 3], rng)) is None


def _generate(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_generate_with_graphs_equals_eager_and_follows_transformers(tmp_path_factory, kind):
    """11 sequences (bucket 16), contexts growing across blocks and past the 512 tier; the
    graph engine sizes its KV cache from memory (measuring the graphs first)."""
    path, hf = _model(tmp_path_factory, kind, max_len=1024)
    prompts = random_prompts(11, VOCAB, 5, 600, seed=7)
    common = dict(device="cuda", dtype="float16", block_size=BLOCK_SIZE, max_num_seqs=16,
                  gpu_memory_utilization=0.5)  # fmt: skip
    eager_llm = LLM(str(path), enforce_eager=True, **common)
    assert eager_llm.engine.runner.cuda_graphs is None
    eager = _generate(eager_llm, prompts, 48)
    del eager_llm
    gc.collect()
    torch.cuda.empty_cache()

    llm = LLM(str(path), **common)
    graphs = llm.engine.runner.cuda_graphs
    got = _generate(llm, prompts, 48)
    assert graphs.num_replays >= 40, f"only {graphs.num_replays} of ~47 decode steps replayed"
    _assert_mostly_equal(got, eager)
    hf32 = hf.to("cuda", torch.float32)
    gaps = torch.cat([gaps_to_fp32_argmax(hf32, p, t) for p, t in zip(prompts, got, strict=True)])
    # Greedy in fp16 follows float32's argmax except at near-ties (gap < 5% of a logit std).
    assert float(gaps.max()) < 0.05, f"largest gap {float(gaps.max()):.3f} logit std"
    assert float((gaps == 0).float().mean()) > 0.9


def _assert_mostly_equal(got: list[list[int]], ref: list[list[int]]) -> None:
    """All sequences equal but at most one (see the module docstring)."""
    diverged = {
        i: next(j for j, (a, b) in enumerate(zip(g, r, strict=True)) if a != b)
        for i, (g, r) in enumerate(zip(got, ref, strict=True))
        if g != r
    }
    assert len(diverged) <= 1, f"sequences that left the eager tokens (at position): {diverged}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_generate_with_graphs_equals_eager(tmp_path_factory):
    """Each rank captures its own graphs (NCCL all-reduces inside); same tokens as TP=2 eager."""
    path, _ = _model(tmp_path_factory, "gqa", max_len=1024)
    prompts = random_prompts(6, VOCAB, 5, 300, seed=9)
    common = dict(device="cuda", dtype="float16", block_size=BLOCK_SIZE, max_num_seqs=8,
                  num_kv_blocks=1024, tensor_parallel_size=2)  # fmt: skip
    results = {}
    for enforce_eager in (True, False):
        llm = LLM(str(path), enforce_eager=enforce_eager, **common)
        try:
            results[enforce_eager] = _generate(llm, prompts, 32)
            graphs = llm.engine.runner.cuda_graphs
            assert (graphs is None) == enforce_eager
            if graphs is not None:
                assert graphs.num_replays >= 25
        finally:
            llm.engine.shutdown()
    _assert_mostly_equal(results[False], results[True])
