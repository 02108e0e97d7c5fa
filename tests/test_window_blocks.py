"""Sliding windows free the blocks that leave them (issue 44): a model whose every layer is
windowed holds about window / block_size blocks per sequence, not its whole length, so a KV
cache of the same size runs more sequences at once, and greedy tokens stay those of
transformers (long prompts and outputs, chunked prefill, preemption by recompute and by swap,
n > 1, prefix caching, async scheduling)."""

from __future__ import annotations

import random

import pytest
from model_utils import hf_greedy, save_hf_model

from pydaemon.config.engine import EngineConfig
from pydaemon.engine import layer_configs
from pydaemon.engine.llm_engine import LLMEngine
from pydaemon.generate_request import GenerateRequest
from pydaemon.sampling_params import SamplingParams

WINDOW, BLOCK = 16, 8
MAX_NEW = 32
PROMPTS = [
    [random.Random(i).randrange(3, 256) for _ in range(n)] for i, n in enumerate([75, 104, 18, 88])
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("win"), "mistral", seed=3, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_greedy(model_dir, PROMPTS, MAX_NEW)


def _run(model_dir, prompts, *, n=1, long_at=100, **config):
    """-> (outputs per request, the most sequences past ``long_at`` tokens held at once, the
    most blocks one decoding sequence held at once)."""
    kw = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK,
              num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=16, seed=0)  # fmt: skip
    kw.update(config)
    engine = LLMEngine(EngineConfig(**kw))
    params = SamplingParams(temperature=0.0 if n == 1 else 1.0, max_tokens=MAX_NEW, n=n,
                            ignore_eos=True, seed=1)  # fmt: skip
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), list(p), params))
    outputs: dict[str, list[list[int]]] = {}
    max_running = max_live = 0
    scheduler = engine.scheduler
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas: each step's new tokens
            seqs = outputs.setdefault(out.request_id, [[] for _ in range(n)])
            for o in out.outputs:
                seqs[o.index] += o.token_ids
        long = [  # sequences past long_at tokens: the ones whose blocks add up
            seq
            for request in scheduler.requests.values()
            for seq in request.seqs
            if scheduler.block_manager.has_seq(seq.seq_id) and seq.num_computed_tokens > long_at
        ]
        max_running = max(max_running, len(long))
        for request in scheduler.requests.values():
            for seq in request.seqs:
                if scheduler.block_manager.has_seq(seq.seq_id) and len(seq.output_token_ids) > 2:
                    table = scheduler.block_manager.block_table(seq.seq_id)
                    max_live = max(max_live, len(table) - table.count(-1))
    stats = engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks  # nothing leaked
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    return [outputs[str(i)] for i in range(len(prompts))], max_running, max_live


def test_tokens_equal_transformers_while_blocks_are_freed(model_dir, reference):
    outs, _, max_live = _run(model_dir, PROMPTS)
    assert [o[0] for o in outs] == reference
    # Up to 136 tokens (17 blocks) per sequence; once it decodes, one keeps its window (2-3
    # blocks), one step of lag and its last block.
    assert max_live <= WINDOW // BLOCK + 3, max_live


@pytest.mark.parametrize(
    "config",
    [
        {"preemption_mode": "recompute", "num_kv_blocks": 24},
        {"preemption_mode": "swap", "num_kv_blocks": 24, "swap_space": 0.01},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16},  # prompts prefilled in many chunks
        {"async_scheduling": True},
    ],
)
def test_tokens_stay_exact_under_every_scheduler_path(model_dir, reference, config):
    outs, _, _ = _run(model_dir, PROMPTS, **config)
    assert [o[0] for o in outs] == reference


def test_forked_sequences_share_and_free_their_blocks(model_dir):
    """n > 1: the children share the prompt's blocks, each frees its own as it goes."""
    outs, _, _ = _run(model_dir, PROMPTS[:2], n=3)
    assert all(len(o) == 3 and all(len(t) == MAX_NEW for t in o) for o in outs)


def test_the_same_cache_runs_more_sequences_at_once(model_dir, monkeypatch):
    """24 sequences of 88 + 32 tokens in 64 blocks of 8: past 100 tokens one holds 13 blocks
    without freeing (4 fit at once), about 4 with it."""
    prompts = [[random.Random(100 + i).randrange(3, 256) for _ in range(88)] for i in range(24)]
    kw = dict(preemption_mode="recompute", max_num_seqs=32)
    _, freeing, _ = _run(model_dir, prompts, **kw)
    monkeypatch.setattr(layer_configs, "kv_window", lambda *a: None)
    _, keeping, _ = _run(model_dir, prompts, **kw)
    assert keeping <= 64 // 12 and freeing >= 2 * keeping, (freeing, keeping)


def test_no_freeing_where_a_layer_sees_everything(tmp_path):
    """Only every layer windowed frees through ``kv_window``: Qwen2 with windows on layers >= 1
    mixes windowed and global layers, which per-layer-group tables serve (test_kv_groups.py)."""
    d = save_hf_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1)  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(d), device="cpu", dtype="float32", block_size=BLOCK,
                                    num_kv_blocks=64))  # fmt: skip
    assert engine.scheduler.blocks.kv_window is None


def test_beam_search_gives_the_beams_of_a_cache_that_keeps_every_block(model_dir, monkeypatch):
    """Beams fork and drop sequences every step: with freeing, the same beams as without."""

    def beams():
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                        block_size=BLOCK, num_kv_blocks=96, max_num_seqs=16))  # fmt: skip
        params = SamplingParams(beam_width=3, n=3, temperature=0.0, max_tokens=MAX_NEW,
                                ignore_eos=True)  # fmt: skip
        for i, p in enumerate(PROMPTS[:2]):
            engine.add_request(GenerateRequest(str(i), list(p), params))
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = [o.token_ids for o in out.outputs]
        stats = engine.get_stats()
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
        return final

    freeing = beams()
    monkeypatch.setattr(layer_configs, "kv_window", lambda *a: None)
    assert freeing == beams()
