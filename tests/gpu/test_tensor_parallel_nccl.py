"""Tensor parallelism on two GPUs over NCCL: greedy output of TP=2 equals TP=1 token for token.

Float32 on purpose: the row-parallel all-reduce sums in another order than one GPU does, which
in bf16 can flip a near-tie; in float32 the difference stays far below any logit gap of these
prompts. bf16 speed under TP is what bench/throughput.py --tensor-parallel-size measures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.llm import LLM
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1]))
from engine_utils import make_hf_model  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL tensor parallelism)"
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 110)), [3] * 33]
COMMON = dict(device="cuda", dtype="float32", max_num_seqs=4, block_size=16)


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def test_nccl_tp2_greedy_equals_tp1(tmp_path):
    # GQA 8/4 with a vocabulary that does not split evenly: both ranks hold KV heads and the
    # last rank's vocabulary slice is padded.
    model_dir, _ = make_hf_model(
        tmp_path / "llama", num_heads=8, num_kv_heads=4, vocab_size=1001, hidden_size=128
    )
    ref = _tokens(LLM(str(model_dir), **COMMON))
    llm = LLM(str(model_dir), tensor_parallel_size=2, **COMMON)
    try:
        got = _tokens(llm)
    finally:
        llm.engine.shutdown()
    assert got == ref
