"""gpt-oss and Gemma under tensor parallelism on CPU: 2 ranks over gloo (this process and one
spawned worker). Greedy output of TP=2 equals TP=1 token for token: gpt-oss's sinks split by
heads with q, each rank's slice of every expert read from the interleaved gate/up columns, the
replicated down bias summed once; Gemma 2's soft-caps, (1 + w) norms and tied embeddings; with
chunked prefill longer than the windows."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from pydaemon.entrypoints.llm import LLM
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from new_arch_utils import save_hf_new_arch  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 75)), [3] * 17]
COMMON = dict(device="cpu", dtype="float32", max_num_seqs=4, block_size=8, num_kv_blocks=64)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_gpt_oss_tp2_equals_tp1(tmp_path):
    model_dir = save_hf_new_arch(tmp_path, "gpt_oss")
    one = LLM(str(model_dir), **COMMON, max_num_batched_tokens=16)
    ref = _tokens(one)
    two = LLM(str(model_dir), tensor_parallel_size=2, **COMMON, max_num_batched_tokens=16)
    layer1, layer2 = (m.engine.runner.model.model.layers[0] for m in (one, two))
    assert torch.equal(layer2.self_attn.sinks, layer1.self_attn.sinks[:2])  # rank 0's heads
    e1, e2 = layer1.mlp.experts, layer2.mlp.experts
    i = e2.intermediate_per_rank  # 48 of 96
    assert torch.equal(e2.w13_weight[:, :i], e1.w13_weight[:, :i])  # gate columns 0..47
    assert torch.equal(e2.w13_weight[:, i:], e1.w13_weight[:, 96 : 96 + i])  # up columns
    assert torch.equal(e2.w2_weight, e1.w2_weight[:, :, :i])
    assert _tokens(two) == ref
    two.engine.shutdown()


def test_gemma2_tp2_equals_tp1(tmp_path):
    model_dir = save_hf_new_arch(tmp_path, "gemma2")
    ref = _tokens(LLM(str(model_dir), **COMMON))
    two = LLM(str(model_dir), tensor_parallel_size=2, **COMMON)
    assert _tokens(two) == ref
    two.engine.shutdown()
