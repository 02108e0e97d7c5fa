"""The W4A16 Triton kernels on CUDA (pydaemon/quantization/w4a16_kernels.py): dense GEMV and
GEMM against a float64 reference of the dequantized weights on Llama-3-8B shapes (bf16 and
fp16, symmetric and with zero points, groups 32 / 128 / per channel, act-order), replay from a
CUDA graph after the input changed in place (bitwise equal to an eager call), the MoE paths
(int4 and MXFP4, with biases) against a float64 reference, and whole tiny models: greedy
tokens of AWQ / GPTQ act-order / compressed-tensors / MXFP4 checkpoints through the engine
(CUDA graphs on) equal those of the same models written dequantized."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pydaemon.quantization import w4a16

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or w4a16.triton_unavailable_reason() is not None,
    reason="needs a CUDA GPU and triton",
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _layer(n, k, group, zero_points, act_order, seed):
    from pydaemon.quantization.int4 import pack_int4

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=g)
    groups = k // (group or k)
    scales = (torch.rand(n, groups, device="cuda", generator=g) * 0.02 + 0.002).half()
    zeros = None
    if zero_points:
        zeros = torch.randint(0, 16, (n, groups), device="cuda", generator=g).to(torch.uint8)
    perm = torch.randperm(k, device="cuda", generator=g).to(torch.int32) if act_order else None
    return pack_int4(q), scales, zeros, perm


def _reference(x, qweight, scales, zeros, perm):
    from pydaemon.quantization.int4 import dequantize_int4

    w = dequantize_int4(qweight, scales, zeros, torch.float64)
    xs = x.double() if perm is None else x.double()[:, perm.long()]
    return xs @ w.t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,zero_points,act_order", [
    (4096, 4096, 128, False, False), (4096, 14336, 128, True, False),
    (6144, 4096, 32, True, False), (1024, 4096, None, False, False),
    (2048, 4096, 128, False, True),
])  # fmt: skip
@pytest.mark.parametrize("m", [1, 2, 3, 16, 100, 512])
def test_dense_against_float64(dtype, n, k, group, zero_points, act_order, m):
    qweight, scales, zeros, perm = _layer(n, k, group, zero_points, act_order, seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    want = _reference(x, qweight, scales, zeros, perm)
    got = w4a16.linear(x, qweight, scales, zeros, perm)
    err = float((got.double() - want).abs().max() / want.abs().max())
    # the weights rounded to the activation dtype for the tensor cores, float32 sums
    assert err < (1.5e-2 if dtype == torch.bfloat16 else 3e-3), err


@pytest.mark.parametrize("m", [1, 64])
def test_replay_from_a_cuda_graph(m):
    qweight, scales, zeros, _ = _layer(4096, 4096, 128, True, False, seed=3)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w4a16.linear(x, qweight, scales, zeros, None)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16.linear(x, qweight, scales, zeros, None)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, w4a16.linear(x, qweight, scales, zeros, None))


def _moe_reference(x, w13, w2, topk_weights, topk_ids):
    from pydaemon.layers.moe.int4 import dequantize_expert

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device="cuda")
    for e in torch.unique(topk_ids).tolist():
        a13 = dequantize_expert(w13, e, torch.float64)
        a2 = dequantize_expert(w2, e, torch.float64)
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = x[rows].double() @ a13.t()
        if w13.bias is not None:
            h = h + w13.bias[e].double()
        inter = h.shape[1] // 2
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ a2.t()
        if w2.bias is not None:
            y = y + w2.bias[e].double()
        out.index_add_(0, rows, y * topk_weights[rows, slot].double()[:, None])
    return out


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 4, 8, 64, 256])
def test_moe_against_float64(fmt, tokens):
    from pydaemon.layers.activation import SiluAndMul
    from pydaemon.layers.moe import w4a16_moe
    from pydaemon.layers.moe.router import select_experts
    from pydaemon.layers.moe.w4a16_moe import ExpertWeights
    from pydaemon.quantization.mxfp4 import quantize_mxfp4

    e, h, inter, top_k = 16, 2048 if fmt == "int4" else 2880, 768 if fmt == "int4" else 2880, 4
    g = torch.Generator(device="cuda").manual_seed(tokens)

    def weights(n, k):
        if fmt == "int4":
            qweight, scales, zeros, _ = _layer(e * n, k, 128, True, False, seed=n + k)
            groups = scales.shape[1]
            return ExpertWeights(qweight.view(e, n, -1), scales.view(e, n, groups),
                                 zeros.view(e, n, groups), None, None, "int4")  # fmt: skip
        packed, scales = quantize_mxfp4(torch.randn(e, n, k, device="cuda", generator=g) * 0.05)
        bias = (torch.randn(e, n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        return ExpertWeights(packed, scales, None, None, bias, "mxfp4")

    w13, w2 = weights(2 * inter, h), weights(h, inter)
    x = torch.randn(tokens, h, device="cuda", generator=g).to(torch.bfloat16)
    topk_weights, topk_ids = select_experts(torch.randn(tokens, e, device="cuda", generator=g),
                                            top_k, "softmax", True)  # fmt: skip
    want = _moe_reference(x, w13, w2, topk_weights, topk_ids)
    got = w4a16_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, SiluAndMul())
    diff = got.double() - want
    rms = float(diff.pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    worst = float(diff.abs().max() / want.abs().max())
    # bf16 roundings of the weights, of h and of the output, through the SiLU product
    assert rms < 1.5e-2 and worst < 6e-2, (rms, worst)


@pytest.mark.parametrize("fmt,kw", [
    ("awq", dict(group=32)), ("gptq", dict(group=32, sym=True, desc_act=True)),
    ("ct", dict(group=None, sym=False)), ("mxfp4", {}),
])  # fmt: skip
def test_engine_greedy_equals_the_dequantized_model(tmp_path, fmt, kw):
    from model_utils import save_hf_model
    from moe_utils import save_hf_moe_model
    from w4_checkpoints import (
        write_dequantized_checkpoint,
        write_int4_checkpoint,
        write_mxfp4_checkpoint,
    )

    from pydaemon import LLM, SamplingParams

    if fmt == "mxfp4":
        src = save_hf_moe_model(tmp_path, "qwen3_moe", seed=1, moe_intermediate_size=64)
        reference = write_mxfp4_checkpoint(src, tmp_path / "q")
    else:
        src = save_hf_model(tmp_path, "llama", seed=1)
        reference = write_int4_checkpoint(src, tmp_path / "q", fmt, **kw)
    write_dequantized_checkpoint(src, tmp_path / "deq", reference)
    prompts = [[5, 6, 7, 8], [9] * 11, list(range(30, 60))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for name in ("q", "deq"):
        llm = LLM(str(tmp_path / name), device="cuda", dtype="float16", num_kv_blocks=64)
        try:
            got = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in got])
        finally:
            llm.engine.shutdown()
    assert outs[0] == outs[1]
