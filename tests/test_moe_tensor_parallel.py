"""MoE models under tensor parallelism on CPU: 2 ranks over gloo (this process and one
spawned worker). Every rank holds a slice of every expert (and of the shared expert); one
all-reduce per MoE block. Greedy output of TP=2 equals TP=1 token for token, with chunked
prefill and swap preemption (Qwen2-MoE: shared expert, dense and sparse layers), with
dummy weights (Mixtral), and with FP8 (emulated) experts quantized at load (Qwen3-MoE)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.entrypoints.llm import LLM
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from moe_utils import save_hf_moe_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 75)), [3] * 17]
COMMON = dict(device="cpu", dtype="float32", max_num_seqs=4, block_size=8)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _tp1_and_tp2(model_dir: Path, **kw) -> tuple[list, list, LLM]:
    ref = _tokens(LLM(str(model_dir), **COMMON, **kw))
    llm = LLM(str(model_dir), tensor_parallel_size=2, **COMMON, **kw)
    return ref, _tokens(llm), llm


def test_qwen2_moe_chunked_and_swapped(tmp_path):
    model_dir = save_hf_moe_model(tmp_path, "qwen2_moe")
    ref, got, llm = _tp1_and_tp2(
        model_dir, num_kv_blocks=9, max_num_batched_tokens=16, preemption_mode="swap"
    )
    block = llm.engine.runner.model.model.layers[1].mlp
    assert block.experts.w13_weight.shape == (8, 2 * 16, 64)  # half of each expert's columns
    assert block.experts.w2_weight.shape == (8, 64, 16)
    assert block.shared_expert.down_proj.weight.shape == (64, 24)
    stats = llm.engine.get_stats()
    assert stats.num_swapped_out_blocks > 0
    assert got == ref
    llm.engine.shutdown()


def test_mixtral_dummy_weights_do_not_depend_on_tp(tmp_path):
    model_dir = save_hf_moe_model(tmp_path, "mixtral")
    ref, got, llm = _tp1_and_tp2(model_dir, num_kv_blocks=64, load_format="dummy", seed=3)
    assert got == ref
    llm.engine.shutdown()


def test_qwen3_moe_fp8_emulated_weights_are_the_tp1_ones_sliced(tmp_path):
    """FP8 experts quantized at load: rank 0's weights and scales are TP=1's, sliced (the
    scale of a down_proj row is over the whole checkpoint row). Tokens are not compared:
    the row-parallel GEMMs quantize their input per token over the rank's columns."""
    model_dir = save_hf_moe_model(tmp_path, "qwen3_moe")
    one = LLM(str(model_dir), **COMMON, num_kv_blocks=64, quantization="fp8_emulated")
    two = LLM(str(model_dir), tensor_parallel_size=2, **COMMON, num_kv_blocks=64,
              quantization="fp8_emulated")  # fmt: skip
    e1 = one.engine.runner.model.model.layers[0].mlp.experts
    e2 = two.engine.runner.model.model.layers[0].mlp.experts
    i = e2.intermediate_per_rank
    gate_up = torch.cat([e1.w13_weight[:, :i], e1.w13_weight[:, 2 * i : 3 * i]], dim=1)
    assert torch.equal(e2.w13_weight.view(torch.uint8), gate_up.view(torch.uint8))
    assert torch.equal(
        e2.w13_weight_scale,
        torch.cat([e1.w13_weight_scale[:, :i], e1.w13_weight_scale[:, 2 * i : 3 * i]], 1),
    )
    assert torch.equal(e2.w2_weight.view(torch.uint8), e1.w2_weight[:, :, :i].view(torch.uint8))
    assert torch.equal(e2.w2_weight_scale, e1.w2_weight_scale)
    assert all(len(t) == GREEDY.max_tokens for t in _tokens(two))
    two.engine.shutdown()


def test_moe_intermediate_not_divisible_is_a_clear_error(tmp_path):
    model_dir = save_hf_moe_model(tmp_path, "qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(33\).*tensor_parallel_size"):
        LLM(str(model_dir), tensor_parallel_size=2, **COMMON, num_kv_blocks=16)
