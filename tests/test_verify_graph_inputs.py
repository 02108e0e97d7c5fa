"""Verify-step CUDA graphs (speculative decoding), the parts that run anywhere: which graphs a
plan holds with k configured, which graph serves a step, and the padded static buffer of a
verify step (exact values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydaemon.worker.cuda_graph_inputs import (
    GraphKey,
    buffer_words,
    graph_input_views,
    make_graph_plan,
    pack_graph_inputs,
)
from pydaemon.worker.cuda_graphs import CUDAGraphRunner
from pydaemon.worker.input_batch import StepInput

LLAMA3 = dict(num_kv_heads=8, num_q_heads=32, head_dim=128)


def test_plan_with_speculation_adds_one_verify_graph_per_bucket_up_to_the_cap():
    plain = make_graph_plan(512, 8192, 16, **LLAMA3)
    plan = make_graph_plan(512, 8192, 16, **LLAMA3, num_speculative_tokens=4, max_verify_seqs=32)
    assert plain.verify_query_lens == () and plain.verify_batch_sizes == ()
    assert plan.verify_query_lens == (5,)
    assert plan.verify_batch_sizes == (1, 2, 4, 8, 16, 24, 32)
    verify = [k for k in plan.keys() if k.query_len > 1]
    # One graph per bucket at the last tier: the prefill kernel's grid ignores the context.
    assert sorted(verify, key=lambda k: k.batch_size) == [
        GraphKey(b, 8192, 512, 5) for b in (1, 2, 4, 8, 16, 24, 32)
    ]
    assert [k for k in plan.keys() if k.query_len == 1] == plain.keys()
    tokens = [k.num_tokens for k in plan.keys()]
    assert tokens == sorted(tokens, reverse=True)  # most tokens first: the pool's order
    assert plan.key_for(3, 1000, 5) == GraphKey(4, 8192, 512, 5)
    assert plan.key_for(32, 8192, 5) == GraphKey(32, 8192, 512, 5)
    assert plan.key_for(33, 10, 5) is None  # past disable_by_batch_size: no drafts there
    assert plan.key_for(1, 10, 3) is None  # only the configured k has graphs
    assert plan.key_for(1, 8193, 5) is None  # past the last tier
    assert plan.key_for(1, 1024) == plain.key_for(1, 1024)  # decode keys unchanged
    # The cap past max_num_seqs: every bucket; a cap between buckets: the bucket above it.
    assert make_graph_plan(5, 512, 16, **LLAMA3, num_speculative_tokens=2,
                           max_verify_seqs=32).verify_batch_sizes == (1, 2, 4, 5)  # fmt: skip
    assert make_graph_plan(64, 512, 16, **LLAMA3, num_speculative_tokens=8,
                           max_verify_seqs=10).verify_batch_sizes == (1, 2, 4, 8, 16)  # fmt: skip
    assert plan.max_buffer_words == max(
        buffer_words(k.batch_size, k.block_table_width, k.query_len) for k in plan.keys()
    )


def _verify_batch():
    # 3 sequences verifying 2 drafts each (q = 3), block size 16, block tables 3 wide.
    seq_lens = np.array([5, 18, 33], dtype=np.int32)
    tables = np.array([[7, 0, 0], [2, 9, 0], [4, 6, 8]], dtype=np.int32)
    positions = np.concatenate([np.arange(n - 3, n) for n in seq_lens]).astype(np.int64)
    rows = np.repeat(np.arange(3), 3)
    slots = tables[rows, positions // 16].astype(np.int64) * 16 + positions % 16
    input_ids = np.arange(101, 110, dtype=np.int64)
    return input_ids, positions, slots, tables, seq_lens


def test_pack_pads_a_verify_batch_of_3_to_bucket_4():
    input_ids, positions, slots, tables, seq_lens = _verify_batch()
    key = GraphKey(batch_size=4, max_seq_len=48, block_table_width=3, query_len=3)
    words = pack_graph_inputs(input_ids, positions, slots, tables, seq_lens, key)
    assert words.size == buffer_words(4, 3, 3) == 3 * 12 + 11
    views = graph_input_views(torch.from_numpy(words), key)
    assert views["input_ids"].tolist() == [*range(101, 110), 0, 0, 0]
    assert views["positions"].tolist() == [2, 3, 4, 15, 16, 17, 30, 31, 32, 0, 0, 0]
    assert views["slot_mapping"].tolist() == [7 * 16 + 2, 7 * 16 + 3, 7 * 16 + 4,
                                              2 * 16 + 15, 9 * 16, 9 * 16 + 1,
                                              6 * 16 + 14, 6 * 16 + 15, 8 * 16,
                                              -1, -1, -1]  # fmt: skip
    assert views["block_tables"].tolist() == [[7, 0, 0], [2, 9, 0], [4, 6, 8], [0, 0, 0]]
    # The padding row: its 3 queries are its whole context (none past it: no NaN rows).
    assert views["seq_lens"].tolist() == [5, 18, 33, 3]
    assert views["query_start_loc"].tolist() == [0, 3, 6, 9, 12]
    with pytest.raises(ValueError, match="9 tokens are not 3 sequences of 2 tokens"):
        pack_graph_inputs(input_ids, positions, slots, tables, seq_lens, GraphKey(4, 48, 3, 2))
    # A decode graph after a verify one reads its own layout from the same buffer.
    buffer = torch.zeros(64, dtype=torch.int64)
    buffer[: words.size].copy_(torch.from_numpy(words))
    decode = GraphKey(2, 16, 1)
    host = pack_graph_inputs(
        np.array([5, 6]), np.array([0, 1]), np.array([3, 4]), tables[:2, :1], seq_lens[:2], decode
    )
    buffer[: host.size].copy_(torch.from_numpy(host))
    assert graph_input_views(buffer, decode)["query_start_loc"].tolist() == [0, 1, 2]


def _step(query_lens: list[int], num_prefills: int) -> StepInput:
    query_lens = np.array(query_lens, dtype=np.int32)
    n, t = len(query_lens), int(query_lens.sum())
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return StepInput(
        seq_ids=list(range(n)),
        num_prefills=num_prefills,
        input_ids=np.zeros(t, np.int64),
        positions=np.zeros(t, np.int64),
        slot_mapping=np.zeros(t, np.int64),
        block_tables=np.zeros((n, 4), np.int32),
        seq_lens=np.full(n, 40, np.int32),
        query_lens=query_lens,
        query_start_loc=qsl,
        is_sampled=np.ones(n, bool),
        sample_index=np.arange(t, dtype=np.int64),
    )


def test_which_steps_a_verify_graph_serves():
    plan = make_graph_plan(8, 512, 16, **LLAMA3, num_speculative_tokens=2, max_verify_seqs=8)
    runner = CUDAGraphRunner(None, torch.zeros(2, 1, 2, 1, 16, 8), plan)
    runner.graphs = dict.fromkeys(plan.keys())  # as if every graph was captured
    assert runner.key_for(_step([3, 3, 3], 3)) == GraphKey(4, 512, 32, 3)
    assert runner.key_for(_step([1, 1, 1], 0)) == plan.key_for(3, 40)  # decode
    assert runner.key_for(_step([3, 3, 1], 2)) is None  # a plain decode beside the verified
    assert runner.key_for(_step([3, 2], 2)) is None  # one sequence got fewer drafts
    assert runner.key_for(_step([2, 2], 2)) is None  # k = 1 has no graph
    assert runner.key_for(_step([7, 3, 3], 3)) is None  # a prefill chunk first
    assert runner.key_for(_step([3] * 9, 9)) is None  # past the largest verify bucket
    del runner.graphs[GraphKey(4, 512, 32, 3)]  # not captured (e.g. a capture failed)
    assert runner.key_for(_step([3, 3, 3], 3)) is None
