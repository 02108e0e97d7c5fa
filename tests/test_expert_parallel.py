"""Expert parallelism with the ``mp`` backend on CPU: the experts are partitioned over the
tensor-parallel ranks (whole experts per rank) and the greedy tokens equal one process's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.entrypoints.llm import LLM
from pydaemon.layers.moe.layer import local_routing
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from moe_utils import save_hf_moe_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 75)), [3] * 17]
COMMON = dict(
    device="cpu", dtype="float32", max_num_seqs=4, block_size=8, max_num_batched_tokens=16
)


def test_local_routing_keeps_this_ranks_slots_and_zeroes_the_others():
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    ids = torch.tensor([[5, 1], [2, 7]], dtype=torch.int32)
    # Rank 1 of 2 over 8 experts: experts 4..7, local ids 0..3.
    w, local = local_routing(weights, ids, expert_start=4, num_local_experts=4)
    assert w.tolist() == [[pytest.approx(0.6), 0.0], [0.0, pytest.approx(0.3)]]
    assert local.tolist() == [[1, 0], [0, 3]] and local.dtype == torch.int32


def test_ep2_equals_one_process(tmp_path):
    # Mixtral here; Qwen2-MoE (shared expert, dense layers) in tests/test_ray_executor.py.
    model_dir = save_hf_moe_model(tmp_path, "mixtral")
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(model_dir), **COMMON).generate(
            prompt_token_ids=PROMPTS, sampling_params=GREEDY
        )
    ]
    llm = LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True, **COMMON)
    try:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.outputs[0].token_ids for o in got] == expected
        # Rank 0 holds experts 0..3 whole (8 experts, EP=2), not a slice of all 8.
        experts = llm.engine.runner.model.model.layers[0].mlp.experts
        assert (experts.num_local_experts, experts.expert_start) == (4, 0)
        inter = experts.intermediate_size
        assert experts.w13_weight.shape == (4, 2 * inter, 64)
        assert experts.w2_weight.shape == (4, 64, inter)
    finally:
        llm.engine.shutdown()


def test_experts_that_do_not_divide_are_a_clear_error(tmp_path):
    model_dir = save_hf_moe_model(
        tmp_path, "mixtral", num_local_experts=6, num_experts_per_tok=2, num_key_value_heads=4
    )
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible"):
        LLM(
            str(model_dir),
            tensor_parallel_size=4,
            enable_expert_parallel=True,
            **{**COMMON, "max_num_seqs": 4},
        )
