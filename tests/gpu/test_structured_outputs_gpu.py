"""Structured outputs on a GPU: CUDA graphs for decode (the mask is applied to the logits
outside the graph), async scheduling (the mask is filled while the forward runs), the pinned
bitmask buffer reused step after step; every output obeys its constraint. The device bitmask
equals xgrammar's own CUDA kernel."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import make_hf_model  # noqa: E402
from test_constraints import SCHEMAS  # noqa: E402

from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.model_loader.demo_model import demo_model_dir  # noqa: E402
from pydaemon.sampling.bitmask import apply_grammar_bitmask  # noqa: E402
from pydaemon.sampling_params import StructuredOutputsParams  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Head size 64 (the kernels' and graphs' sizes), the demo's SentencePiece tokenizer (its
    vocabulary: 512 tokens, EOS 2)."""
    path, _ = make_hf_model(
        tmp_path_factory.mktemp("gpu_structured"),
        hidden_size=512, num_heads=8, num_kv_heads=2, num_layers=2, vocab_size=512, seed=3,
    )  # fmt: skip
    shutil.copy(demo_model_dir() / "tokenizer.model", path / "tokenizer.model")
    return path


@pytest.mark.parametrize("is_async", [True, False])
def test_constrained_outputs_with_graphs(model, is_async):
    llm = LLM(
        str(model),
        device="cuda",
        dtype="bfloat16",  # graphs serve 16-bit caches only
        async_scheduling=is_async,
        num_kv_blocks=512,
        seed=0,
    )
    assert llm.engine.runner.cuda_graphs is not None
    specs = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in SCHEMAS]
    specs.append(StructuredOutputsParams(regex="[a-z]{2}-[0-9]{3}"))
    prompts = ["Once upon a time", "Hello world!"] * 16
    params = [
        SamplingParams(temperature=t, max_tokens=160, seed=i, structured_outputs=specs[i % 7])
        for i, t in enumerate([0.0, 1.0] * 16)
    ]
    outputs = llm.generate(prompts, params)
    for i, output in enumerate(outputs):
        seq = output.outputs[0]
        assert seq.finish_reason == "stop", seq.text
        if i % 7 < len(SCHEMAS):
            jsonschema.validate(json.loads(seq.text), SCHEMAS[i % 7])
        else:
            assert re.fullmatch("[a-z]{2}-[0-9]{3}", seq.text)
    stats = llm.engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_bitmask_equals_xgrammar_cuda_kernel():
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = 128256
    words = -(-vocab // 32)
    full = torch.randint(-(2**31), 2**31 - 1, (256, words), dtype=torch.int32, device="cuda",
                         generator=gen)  # fmt: skip
    logits = torch.randn(256, vocab, device="cuda", generator=gen)
    ours, ref = logits.clone(), logits.clone()
    apply_grammar_bitmask(ours, full)
    xgr.apply_token_bitmask_inplace(ref, full)
    assert torch.equal(ours, ref)
