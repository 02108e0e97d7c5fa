"""Per-layer-group KV tables on the GPU (issue 44): Gemma 3 and gpt-oss shapes, windowed and
global layers mixed, through the pagedd kernels (decode, prefill, CUDA graphs with one table
per group, FP8 KV): the tokens with per-group tables (the windowed ones freeing what leaves
their window) equal those of one table that keeps every block."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import run_engine  # noqa: E402
from new_arch_utils import save_hf_new_arch  # noqa: E402

from pydaemon.config.engine import EngineConfig  # noqa: E402
from pydaemon.engine.llm_engine import LLMEngine  # noqa: E402
from pydaemon.sampling_params import SamplingParams  # noqa: E402
from pydaemon.worker import model_runner  # noqa: E402

WINDOW = 64
PROMPTS = [[random.Random(i).randrange(3, 256) for _ in range(n)] for i, n in
           enumerate([300, 77, 513, 140, 64, 1])]  # fmt: skip


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def model_dir(request, tmp_path_factory):
    # head_dim 64 (a kernel size), 4 query heads over 2
    return save_hf_new_arch(tmp_path_factory.mktemp(request.param), request.param,
                            sliding_window=WINDOW, head_dim=64, max_position_embeddings=2048)  # fmt: skip


def _run(model_dir, block_size, **config):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                                    block_size=block_size, num_kv_blocks=512, seed=0,
                                    **config))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    return run_engine(engine, PROMPTS, params), engine.scheduler.blocks.num_groups


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "config",
    [{}, {"enforce_eager": True}, {"kv_cache_dtype": "fp8"}, {"async_scheduling": False}],
    ids=["graphs", "eager", "fp8kv", "sync"],
)
def test_group_tables_change_no_token(model_dir, block_size, config, monkeypatch):
    grouped, num_groups = _run(model_dir, block_size, **config)
    assert num_groups > 1
    monkeypatch.setattr(model_runner, "kv_groups", lambda *a: None)
    keeping, one = _run(model_dir, block_size, **config)
    assert one == 1
    assert grouped == keeping
