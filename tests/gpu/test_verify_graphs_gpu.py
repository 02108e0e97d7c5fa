"""Verify steps (speculative decoding: every sequence a decode plus k drafts) replayed from
CUDA graphs against the same steps run eagerly, and whole greedy generations of a graph
engine against an eager one (oracle and n-gram drafts).

Tolerances as tests/gpu/test_cuda_graphs_gpu.py (its docstring says why): a graph runs the
batch padded to its bucket, so cuBLAS may pick another GEMM for the padded row count; the
attention is the same paged prefill launch (its grid depends on the bucket and q only). A
wrong graph input (stale slot, wrong block table, wrong query start) moves logits by O(1).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import make_hf_model, random_prompts  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon._core import Device  # noqa: E402
from pydaemon.worker.cuda_graph_inputs import GraphKey, make_graph_plan  # noqa: E402
from pydaemon.worker.input_batch import StepInput  # noqa: E402
from pydaemon.worker.spec_decode.ngram_proposer import NgramProposer  # noqa: E402
from pydaemon.worker.spec_decode.oracle_proposer import OracleProposer  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 2048
VOCAB = 512
MAX_LEN = 1024
MAX_NUM_SEQS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(
        tmp_path_factory.mktemp("verify_graphs"),
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        num_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_LEN,
        seed=3,
    )


def _llm(path, k: int | None, **kw) -> LLM:
    """No prefix caching: the logits test fills the cache with noise, which a prefix hit of a
    later generation would read."""
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
    return LLM(str(path), device="cuda", dtype="float16", block_size=BLOCK_SIZE,
               num_kv_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS, speculative_config=spec,
               enable_prefix_caching=False, **kw)  # fmt: skip


@pytest.fixture(scope="module", params=[2, 4], ids=lambda k: f"k{k}")
def engines(request, model):
    """(k, graph engine, eager engine), both speculating with k."""
    path, _ = model
    k = request.param
    graph_llm, eager_llm = _llm(path, k), _llm(path, k, enforce_eager=True)
    yield k, graph_llm, eager_llm
    del graph_llm, eager_llm
    gc.collect()
    torch.cuda.empty_cache()


def test_verify_graphs_are_captured_for_the_configured_k_only(engines):
    k, llm, eager = engines
    graphs = llm.engine.runner.cuda_graphs
    assert eager.engine.runner.cuda_graphs is None
    plain = make_graph_plan(MAX_NUM_SEQS, MAX_LEN, BLOCK_SIZE, num_kv_heads=2, num_q_heads=8,
                            head_dim=64)  # fmt: skip
    tier = plain.seq_len_tiers[-1]
    verify = {GraphKey(b, tier, tier // BLOCK_SIZE, k + 1) for b in (1, 2, 4, 8, 16)}
    assert set(graphs.graphs) == set(plain.keys()) | verify
    assert len(graphs.graphs) == len(plain.keys()) + 5


def verify_step(seq_lens: list[int], q: int, rng: np.random.Generator) -> StepInput:
    """A verify step: each sequence computes its last q positions (a decode and q - 1
    drafts) on distinct random blocks; every position is a logits row."""
    n = len(seq_lens)
    lens = np.array(seq_lens, dtype=np.int32)
    need = -(-lens // BLOCK_SIZE)
    perm = rng.permutation(NUM_BLOCKS).astype(np.int32)
    tables = np.zeros((n, int(need.max())), dtype=np.int32)
    ends = np.cumsum(need)
    for i in range(n):
        tables[i, : need[i]] = perm[ends[i] - need[i] : ends[i]]
    positions = np.concatenate([np.arange(s - q, s) for s in seq_lens]).astype(np.int64)
    rows = np.repeat(np.arange(n), q)
    slots = tables[rows, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
    return StepInput(
        seq_ids=list(range(n)),
        num_prefills=n,
        input_ids=rng.integers(3, VOCAB, n * q).astype(np.int64),
        positions=positions,
        slot_mapping=slots + positions % BLOCK_SIZE,
        block_tables=tables,
        seq_lens=lens,
        query_lens=np.full(n, q, dtype=np.int32),
        query_start_loc=np.arange(0, (n + 1) * q, q, dtype=np.int32),
        is_sampled=np.zeros(n, dtype=bool),
        sample_index=np.arange(n * q, dtype=np.int64),
    )


@pytest.mark.parametrize("batch_size", [1, 3, 8, 16])
def test_verify_graph_logits_equal_eager(engines, batch_size):
    k, llm, _ = engines
    runner = llm.engine.runner
    rng = np.random.default_rng(batch_size + 10 * k)
    # Contexts across block boundaries (the drafts spill into a new block at 17 + k) and up
    # to the model's length.
    lens = [k + 1, 17 + k, 33, 300, 513, MAX_LEN, *rng.integers(k + 2, MAX_LEN, 16).tolist()]
    step = verify_step(lens[:batch_size], k + 1, rng)
    graphs = runner.cuda_graphs
    key = graphs.key_for(step)
    assert key is not None and key.query_len == k + 1 and key.batch_size >= batch_size
    with torch.inference_mode():
        cache = runner.kv_cache
        torch.manual_seed(batch_size)
        cache.normal_()
        before = cache.clone()
        _, eager = runner._forward_eager(step)
        eager_cache = cache.clone()
        cache.copy_(before)
        replays = graphs.num_verify_replays
        _, graph = runner._forward(step)
        torch.cuda.synchronize()
    assert graphs.num_verify_replays == replays + 1, "the step did not replay a verify graph"
    assert graph.shape == eager.shape == (batch_size * (k + 1), VOCAB)
    scale = float(eager.std())
    err = (graph - eager).abs().amax(dim=-1) / scale
    assert float(err.max()) < 0.02, f"{key}: logits differ by {float(err.max()):.3g} std"
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
    assert torch.equal(graph.argmax(-1)[clear], eager.argmax(-1)[clear])

    def by_slot(c):  # -> [num_blocks, block_size, num_layers, 2, num_kv_heads, head_dim]
        return c.permute(0, 4, 1, 2, 3, 5)

    written = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool, device=cache.device)
    slots = torch.from_numpy(step.slot_mapping).to(cache.device)
    written[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = True
    assert torch.equal(by_slot(cache)[~written], by_slot(before)[~written]), (
        "a verify graph wrote outside the step's slots (padding rows must write nothing)"
    )
    torch.testing.assert_close(
        by_slot(cache)[written], by_slot(eager_cache)[written], rtol=3e-2, atol=3e-2
    )


def _generate(llm: LLM, prompts, proposer) -> list[list[int]]:
    llm.engine.runner.spec_decoder.proposer = proposer
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("proposer", ["oracle", "ngram"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_generation_with_verify_graphs_equals_eager(model, engines, batch_size, proposer):
    """The same drafts verified through graphs and eagerly give the same greedy tokens (all
    sequences but at most one at batch > 1: a last-ulp difference of a padded GEMM may flip a
    near-tie, after which that sequence goes its own way; a wrong graph input breaks all)."""
    k, llm, eager = engines
    path, _ = model
    if proposer == "oracle":
        prompts = random_prompts(batch_size, VOCAB, 5, 200, seed=batch_size)
        plain = _llm(path, None)
        refs = [p + t for p, t in zip(prompts, _generate_plain(plain, prompts), strict=True)]
        del plain
        gc.collect()

        def make():
            return OracleProposer(refs, 0, VOCAB, max_drafts=k)
    else:
        # Repetitive, and every token of the vocabulary once at the end: whatever token the
        # model emits, the n-gram lookup finds it (at least a 1-gram) and drafts.
        phrases = random_prompts(batch_size, VOCAB, 8, 12, seed=batch_size)
        every = np.random.default_rng(batch_size).permutation(VOCAB).tolist()
        prompts = [p * 4 + every for p in phrases]

        def make():
            return NgramProposer(k, 1, 5)

    graphs = llm.engine.runner.cuda_graphs
    replays = graphs.num_verify_replays
    decoder = llm.engine.runner.spec_decoder
    plans = []
    propose = decoder.propose
    decoder.propose = lambda out: _kept(plans, propose(out))
    try:
        got = _generate(llm, prompts, make())
    finally:
        del decoder.propose  # the bound method again
    num_replays = graphs.num_verify_replays - replays
    ref = _generate(eager, prompts, make())
    diverged = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b]
    assert len(diverged) <= (0 if batch_size == 1 else 1), f"diverged sequences: {diverged}"
    # 24 tokens at k + 1 a step when every draft is right: full verify steps replayed (fewer
    # where fp16 near-ties make a sequence leave its reference: mixed steps run eagerly). The
    # n-gram proposer drafts fewer than k tokens in most steps of these prompts; the graph
    # engine pads decode-only steps to k drafts a sequence (SpecDecoder.pad_drafts), so they
    # replay verify graphs too (the eager engine does not pad: the tokens must still agree).
    assert llm.engine.runner.spec_decoder.pad_drafts
    assert not eager.engine.runner.spec_decoder.pad_drafts
    assert num_replays >= (2 if proposer == "oracle" else 1), f"{num_replays} verify replays"
    if proposer == "ngram":  # every decode step drafts; padded, most replay a verify graph
        num_plans = sum(p is not None for p in plans)
        assert num_plans >= 24 // (k + 1), f"only {num_plans} steps with drafts"
        assert num_replays >= num_plans // 2, f"{num_replays} replays of {num_plans} verify steps"


def _kept(plans: list, plan):
    plans.append(plan)
    return plan


def _generate_plain(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.outputs[0].token_ids for o in outputs]
