"""``calculate_kv_scales`` with CUDA graphs: the decode graphs bake the KV scales in as kernel
arguments, so the runner captures them after the calibrating (first) step. A model whose K/V
exceed e4m3's range (tests/test_kv_scale_calibration.py) makes stale 1.0 scales in a graph
visible: its decode steps would saturate and leave the eager tokens at once."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import random_prompts  # noqa: E402
from test_kv_scale_calibration import _attention_layers, _write_large_kv_model  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", max_num_seqs=16,
               gpu_memory_utilization=0.3, **kwargs)  # fmt: skip


def _generate(llm: LLM) -> tuple[list[list[int]], list[tuple[float, float]]]:
    outs = llm.generate(prompt_token_ids=random_prompts(8, 256, 10, 200, seed=3),
                        sampling_params=GREEDY)  # fmt: skip
    scales = [(m.k_scale, m.v_scale) for m in _attention_layers(llm.engine.runner.model)]
    return [o.outputs[0].token_ids for o in outs], scales


def _free(llm: LLM) -> None:
    llm.engine.runner.release_cuda_graphs()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_graphs_captured_after_the_scales_are_measured(tmp_path):
    # head_dim 64: the CUDA kernels serve the cache, so the engine captures graphs
    path = _write_large_kv_model(tmp_path / "m", hidden_size=256)
    llm = _llm(path, calculate_kv_scales=True, enforce_eager=True)
    eager, eager_scales = _generate(llm)
    _free(llm)
    llm = _llm(path, enforce_eager=True)  # scales 1.0
    saturated, _ = _generate(llm)
    _free(llm)

    llm = _llm(path, calculate_kv_scales=True)
    assert llm.engine.runner.cuda_graphs is None, "graphs captured before the scales were measured"
    got, scales = _generate(llm)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and graphs.num_replays >= 25, "decode steps did not replay graphs"
    # captured after the engine froze its heap: the capture left it frozen (heap_freeze.py)
    assert gc.get_freeze_count() > 10_000, "the deferred capture thawed the engine's heap"
    # the same eager first step measured them (approx: cuBLAS may pick another algorithm)
    flat = [s for pair in scales for s in pair]
    assert flat == pytest.approx([s for pair in eager_scales for s in pair], rel=2**-7)
    assert all(k > 2.0 and v > 4.0 for k, v in scales), scales  # K, V past 448 at scale 1.0
    same = sum(g == e for g, e in zip(got, eager, strict=True))
    same_saturated = sum(s == e for s, e in zip(saturated, eager, strict=True))
    assert same >= len(eager) - 1, f"only {same} of {len(eager)} sequences equal eager's"
    assert same_saturated <= len(eager) // 2, "the test model does not saturate a 1.0 scale"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_nccl_scales_equal_tp1_and_graphs_follow(tmp_path):
    """NCCL all-reduce (max) of the measured amax: rank 0 (half the KV heads) gets TP=1's
    scales; both ranks capture their graphs after that step (collectives inside match)."""
    path = _write_large_kv_model(tmp_path / "m", hidden_size=256)
    llm = _llm(path, calculate_kv_scales=True, enforce_eager=True)
    tp1_tokens, tp1_scales = _generate(llm)
    _free(llm)
    llm = _llm(path, calculate_kv_scales=True, tensor_parallel_size=2)
    try:
        tokens, scales = _generate(llm)
        graphs = llm.engine.runner.cuda_graphs
        assert graphs is not None and graphs.num_replays >= 25
    finally:
        llm.engine.shutdown()
    for (k1, v1), (k2, v2) in zip(tp1_scales, scales, strict=True):
        # bf16 K/V: TP=2's GEMMs and all-reduces round differently, within a bf16 step
        assert k2 == pytest.approx(k1, rel=2**-7) and v2 == pytest.approx(v1, rel=2**-7)
    same = sum(a == b for a, b in zip(tokens, tp1_tokens, strict=True))
    assert same >= len(tokens) // 2, f"only {same} of {len(tokens)} sequences equal TP=1's"
