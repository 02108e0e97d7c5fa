"""Decode CUDA graphs, the parts that run anywhere: batch buckets, seq-len tiers, which graph
serves a step, the padded static buffer, padding rows being no-ops (on the torch path, with
the kernels' conventions), and the configuration / CLI switches."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_utils import save_hf_model  # noqa: E402

from pydaemon.config.engine import EngineConfig  # noqa: E402
from pydaemon.engine.layer_configs import runner_config  # noqa: E402
from pydaemon.layers.attention_metadata import AttentionMetadata  # noqa: E402
from pydaemon.model_loader.loader import load_model  # noqa: E402
from pydaemon.worker.cuda_graph_inputs import (  # noqa: E402
    GraphKey,
    buffer_words,
    capture_batch_sizes,
    capture_seq_len_tiers,
    cuda_graph_plan,
    graph_input_views,
    make_graph_plan,
    pack_graph_inputs,
)
from pydaemon.worker.cuda_graphs import CUDAGraphRunner  # noqa: E402


def test_batch_buckets():
    assert capture_batch_sizes(512) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112,
                                        128, 160, 192, 224, 256, 320, 384, 448, 512]  # fmt: skip
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(100)[-3:] == [80, 96, 100]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_batch_sizes(0)


def test_seq_len_tiers():
    assert capture_seq_len_tiers(8192) == [512, 2048, 8192]
    assert capture_seq_len_tiers(1000) == [512, 1000]
    assert capture_seq_len_tiers(300) == [300]
    assert capture_seq_len_tiers(512) == [512]


def test_plan_llama3_8b_shape():
    # 8 kv heads, 32 query heads: decode runs on the tensor-core kernel, with one partition
    # at every context from 12 sequences (96 pairs), so only the smaller buckets need a
    # graph per tier (their partition count follows the context).
    plan = make_graph_plan(512, 8192, 16, num_kv_heads=8, num_q_heads=32, head_dim=128)
    assert sorted(plan.tiered) == [1, 2, 4, 8]
    keys = plan.keys()
    assert len(keys) == 4 * 3 + 19
    assert keys[0] == GraphKey(512, 8192, 512)  # largest first
    assert keys[-1] == GraphKey(1, 512, 32)
    assert plan.key_for(1, 1024) == GraphKey(1, 2048, 128)
    assert plan.key_for(5, 300) == GraphKey(8, 512, 32)
    assert plan.key_for(5, 513) == GraphKey(8, 2048, 128)
    assert plan.key_for(40, 100) == GraphKey(40, 8192, 512)  # one partition at 40
    assert plan.key_for(70, 100) == GraphKey(80, 8192, 512)
    assert plan.key_for(512, 8192) == GraphKey(512, 8192, 512)
    assert plan.key_for(513, 10) is None  # more sequences than the largest bucket
    assert plan.key_for(1, 8193) is None  # longer than max_seq_len_to_capture
    # MHA (tensor cores too: 32 kv heads, one partition at every tier from 3 sequences, 96
    # pairs), a group of 32 (the CUDA-core kernel at every batch) and TP=4 of the same model:
    # 2 kv heads, group 4, one partition from 48 sequences.
    mha = make_graph_plan(64, 4096, 16, num_kv_heads=32, num_q_heads=32)
    assert sorted(mha.tiered) == [1, 2]
    wide = make_graph_plan(64, 4096, 16, num_kv_heads=1, num_q_heads=32)
    assert wide.tiered == frozenset(wide.batch_sizes)
    tp4 = make_graph_plan(512, 8192, 16, num_kv_heads=2, num_q_heads=8)
    assert max(tp4.tiered) == 40
    # An fp8 cache splits up to 512 pairs: llama3 needs graphs per tier up to 56 sequences.
    fp8 = make_graph_plan(512, 8192, 16, num_kv_heads=8, num_q_heads=32, fp8_cache=True)
    assert sorted(fp8.tiered) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56]
    assert len(fp8.keys()) == 10 * 3 + 13
    assert fp8.key_for(40, 100) == GraphKey(40, 512, 32)


def _decode_batch():
    # 5 sequences, block size 16; the step's block table is 3 wide, one row holds a block
    # allocated ahead of its context (column 2 of row 4).
    input_ids = np.array([11, 12, 13, 14, 15], dtype=np.int64)
    seq_lens = np.array([3, 17, 1, 32, 20], dtype=np.int32)
    positions = (seq_lens - 1).astype(np.int64)
    tables = np.array([[7, 0, 0], [2, 9, 0], [4, 0, 0], [5, 6, 0], [1, 3, 8]], dtype=np.int32)
    slots = tables[np.arange(5), positions // 16].astype(np.int64) * 16 + positions % 16
    return input_ids, positions, slots, tables, seq_lens


def test_pack_pads_a_batch_of_5_to_bucket_8():
    input_ids, positions, slots, tables, seq_lens = _decode_batch()
    key = GraphKey(batch_size=8, max_seq_len=32, block_table_width=2)
    words = pack_graph_inputs(input_ids, positions, slots, tables, seq_lens, key)
    assert words.dtype == np.int64 and words.size == buffer_words(8, 2)
    views = graph_input_views(torch.from_numpy(words), key)
    assert views["input_ids"].tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert views["positions"].tolist() == [2, 16, 0, 31, 19, 0, 0, 0]
    assert views["slot_mapping"].tolist() == [7 * 16 + 2, 9 * 16, 4 * 16, 6 * 16 + 15,
                                              3 * 16 + 3, -1, -1, -1]  # fmt: skip
    # Width 2: the ahead-allocated third column is dropped; padding rows read block 0.
    assert views["block_tables"].dtype == torch.int32
    assert views["block_tables"].tolist() == [[7, 0], [2, 9], [4, 0], [5, 6], [1, 3],
                                              [0, 0], [0, 0], [0, 0]]  # fmt: skip
    assert views["seq_lens"].tolist() == [3, 17, 1, 32, 20, 1, 1, 1]
    assert views["query_start_loc"].tolist() == list(range(9))
    # A wider graph keeps every column and zero-fills the rest.
    wide = GraphKey(8, 64, 4)
    views = graph_input_views(
        torch.from_numpy(pack_graph_inputs(input_ids, positions, slots, tables, seq_lens, wide)),
        wide,
    )
    assert views["block_tables"][4].tolist() == [1, 3, 8, 0]
    with pytest.raises(ValueError, match="5 sequences do not fit"):
        pack_graph_inputs(input_ids, positions, slots, tables, seq_lens, GraphKey(4, 32, 2))


def test_views_are_one_buffer_shared_by_every_graph():
    buffer = torch.zeros(buffer_words(16, 8), dtype=torch.int64)
    small, big = GraphKey(2, 16, 1), GraphKey(16, 128, 8)
    views = graph_input_views(buffer, small)
    for view in views.values():
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    host = pack_graph_inputs(*(a[:2] for a in _decode_batch()), small)
    buffer[: host.size].copy_(torch.from_numpy(host))  # what a replay does
    assert views["seq_lens"].tolist() == [3, 17]
    assert graph_input_views(buffer, big)["block_tables"].shape == (16, 8)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = save_hf_model(tmp_path_factory.mktemp("graphs"), num_attention_heads=4,
                         num_key_value_heads=2)  # fmt: skip
    model, config = load_model(str(path), dtype="float32", device=torch.device("cpu"))
    return model.eval(), config


def _eager_meta(step: tuple, num_seqs: int) -> AttentionMetadata:
    _, _, slots, tables, seq_lens = step
    return AttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decode_tokens=num_seqs,
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(tables),
        seq_lens=torch.from_numpy(seq_lens),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        max_seq_len=int(seq_lens.max()),
        max_query_len=1,
        seq_lens_cpu=seq_lens.tolist(),
        query_lens_cpu=[1] * num_seqs,
    )


@torch.inference_mode()
def test_static_forward_equals_eager_and_padding_rows_are_no_ops(tiny_model):
    """What a graph captures (CUDAGraphRunner.forward on the static buffer) for 5 sequences
    padded to 8, against the plain forward on the 5, on the torch path of a CPU cache: it
    follows the kernels' conventions (negative slots skipped, reads through block tables)."""
    model, cfg = tiny_model
    num_blocks, bs = 12, 16
    torch.manual_seed(0)
    shape = (num_blocks, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, bs, cfg.head_dim)
    kv_cache = torch.randn(shape)
    plan = make_graph_plan(8, 32, bs, cfg.num_key_value_heads, cfg.num_attention_heads)
    graph_cache = kv_cache.clone()
    runner = CUDAGraphRunner(model, graph_cache, plan)
    assert not graph_cache[0].any(), "block 0 (read by padding rows) is zeroed"
    kv_cache[0].zero_()
    step = _decode_batch()
    key = plan.key_for(5, int(step[4].max()))
    assert key == GraphKey(8, 32, 2)

    eager_cache = kv_cache.clone()
    eager = model(torch.from_numpy(step[0]), torch.from_numpy(step[1]), eager_cache,
                  _eager_meta(step, 5))  # fmt: skip
    runner.load_inputs(*step, key)
    hidden = runner.forward(key)  # [8, hidden_size]
    assert hidden.shape == (8, cfg.hidden_size)
    assert torch.isfinite(hidden).all(), "padding rows must stay finite"
    torch.testing.assert_close(hidden[:5], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(graph_cache, eager_cache, rtol=1e-5, atol=1e-5)
    # Only the 5 real slots changed; block 0 is still zero.
    changed = (graph_cache != kv_cache).any(dim=(1, 2, 3, 5))  # [num_blocks, bs]
    slots = sorted((int(s) // bs, int(s) % bs) for s in step[2])
    assert sorted(map(tuple, changed.nonzero().tolist())) == slots
    assert not graph_cache[0].any()
    # A second, smaller step through the same buffer (3 sequences, bucket 4): row 3 held a
    # real sequence a step ago and must be padding now (it would rewrite slot 6 * 16 + 15).
    small = (step[0][:3] + 7, *(a[:3] for a in step[1:]))  # other tokens: other K/V
    key2 = plan.key_for(3, int(small[4].max()))
    assert key2.batch_size == 4
    before = graph_cache.clone()
    runner.load_inputs(*small, key2)
    again = model(torch.from_numpy(small[0]), torch.from_numpy(small[1]), graph_cache.clone(),
                  _eager_meta(small, 3))  # fmt: skip
    torch.testing.assert_close(runner.forward(key2)[:3], again, rtol=1e-5, atol=1e-5)
    changed = (graph_cache != before).any(dim=(1, 2, 3, 5))
    assert sorted(map(tuple, changed.nonzero().tolist())) == sorted(
        (int(s) // bs, int(s) % bs) for s in small[2]
    )


def test_no_graphs_off_the_cuda_kernels_path(tiny_model):
    cache = torch.empty(2, 2, 2, 2, 16, 64, dtype=torch.float16)  # a CPU cache
    assert cuda_graph_plan(runner_config(EngineConfig()), tiny_model[1], cache, 512) is None


def test_config_and_cli_switches():
    from pydaemon.entrypoints.cli import build_parser
    from pydaemon.entrypoints.daemon.settings import resolve

    assert EngineConfig().enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig(enforce_eager="yes")
    for bad in (0, -5, True, 2.5):
        with pytest.raises(ValueError, match="max_seq_len_to_capture must be a positive"):
            EngineConfig(max_seq_len_to_capture=bad)
    args = build_parser().parse_args(
        ["serve", "--model", "demo", "--enforce-eager", "--max-seq-len-to-capture", "4096"]
    )
    engine_kwargs, _, _ = resolve(args)
    config = EngineConfig(**engine_kwargs)
    assert (config.enforce_eager, config.max_seq_len_to_capture) == (True, 4096)
    args = build_parser().parse_args(["serve", "--model", "demo", "--no-enforce-eager"])
    assert EngineConfig(**resolve(args)[0]).enforce_eager is False
