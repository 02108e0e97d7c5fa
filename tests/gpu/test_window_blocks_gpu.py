"""Window block freeing on the GPU (issue 44): a Mistral-style model whose every layer is
windowed, through the pagedd kernels (decode, prefill, CUDA graphs, FP8 KV): the tokens with
blocks freed as they leave the window equal those of a cache that keeps every block, and a
decoding sequence holds about window / block_size blocks."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import run_engine, save_hf_model  # noqa: E402

from pydaemon.config.engine import EngineConfig  # noqa: E402
from pydaemon.engine import layer_configs  # noqa: E402
from pydaemon.engine.llm_engine import LLMEngine  # noqa: E402
from pydaemon.sampling_params import SamplingParams  # noqa: E402

WINDOW = 64
PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(n)] for i, n in
           enumerate([300, 77, 513, 140, 64, 1])]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64 (a kernel size), GQA 8 over 2
    return save_hf_model(tmp_path_factory.mktemp("winmodel"), "mistral", seed=5,
                         sliding_window=WINDOW, hidden_size=512, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)  # fmt: skip


def _run(model_dir, block_size, **config):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float16",
                                    block_size=block_size, num_kv_blocks=512, seed=0,
                                    **config))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    max_live = 0

    def count_live(engine) -> None:
        nonlocal max_live
        scheduler = engine.scheduler
        for request in scheduler.requests.values():
            for seq in request.seqs:
                if scheduler.block_manager.has_seq(seq.seq_id) and len(seq.output_token_ids) > 2:
                    table = scheduler.block_manager.block_table(seq.seq_id)
                    max_live = max(max_live, len(table) - table.count(-1))

    return run_engine(engine, PROMPTS, params, count_live), max_live


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "config",
    [{}, {"enforce_eager": True}, {"kv_cache_dtype": "fp8"}, {"async_scheduling": False}],
    ids=["graphs", "eager", "fp8kv", "sync"],
)
def test_freed_blocks_change_no_token(model_dir, block_size, config, monkeypatch):
    freeing, max_live = _run(model_dir, block_size, **config)
    assert max_live <= WINDOW // block_size + 3, max_live
    monkeypatch.setattr(layer_configs, "kv_window", lambda *a: None)
    keeping, _ = _run(model_dir, block_size, **config)
    assert freeing == keeping
