"""The MoE kernels (cpp/cuda/moe_kernels.cu) and the fused CUDA path against the torch path
and float64 references: routing (softmax / sigmoid, renormalised or not, ties to the lower
id), grouping by expert, the weighted combine, the whole layer in bf16 (torch._grouped_mm)
and FP8 (torch._scaled_grouped_mm against the emulated FP8 path), replayed from a CUDA graph
with another routing; tiny MoE models greedy-equal to transformers on CUDA (float32) and
graphs against eager (bf16)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_utils import Driver, hf_greedy  # noqa: E402
from moe_utils import MOE_ARCHS, reference_moe, save_hf_moe_model  # noqa: E402

from pydaemon import LLM, SamplingParams, ops  # noqa: E402
from pydaemon.layers.moe import FusedMoE, experts  # noqa: E402
from pydaemon.layers.moe import fp8 as moe_fp8  # noqa: E402
from pydaemon.layers.moe.align import moe_align_native  # noqa: E402
from pydaemon.layers.moe.experts import moe_combine_native  # noqa: E402
from pydaemon.layers.moe.router import select_experts_native  # noqa: E402
from pydaemon.model_loader.loader import load_model  # noqa: E402
from pydaemon.quantization.config import Fp8Config  # noqa: E402
from pydaemon.quantization.fp8 import quantize_per_channel  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not ops.moe_kernels_available(),
    reason="needs a CUDA GPU and pagedd's MoE kernels",
)


def _distinct_logits(t: int, e: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Distinct values, exact in bf16 (integers < 256 times 2^-4): no tie anywhere."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(e, generator=g)[:e] % 256 for _ in range(t)]
    logits = torch.stack(rows).float() * 0.0625 - 4.0
    if e > 256:  # values repeat beyond 256 experts: break the ties by position
        logits = logits + torch.arange(e) * 1e-3
    return logits.to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e,k", [(8, 2), (128, 8), (160, 6), (64, 1)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False),
                                                 ("sigmoid", True), ("sigmoid", False)])  # fmt: skip
def test_topk_route_matches_torch(dtype, e, k, scoring, renormalize):
    t = 77 if dtype != torch.float32 else 33
    logits = _distinct_logits(t, e, dtype)
    weights, ids = ops.topk_route(logits, k, scoring == "softmax", renormalize)
    ref_w, ref_ids = select_experts_native(logits, k, scoring, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)


def test_topk_route_ties_go_to_the_lower_id():
    logits = torch.zeros(5, 16, device="cuda")
    logits[:, 9] = 1.0
    weights, ids = ops.topk_route(logits, 4, True, True)
    assert ids.tolist() == [[9, 0, 1, 2]] * 5
    assert torch.equal(weights[:, 1], weights[:, 3])


def test_topk_route_masked_logits_give_valid_ids():
    """-inf (masked) and NaN logits never yield an out-of-range id."""
    logits = torch.full((3, 8), float("-inf"), device="cuda")
    logits[0, 5] = 1.0
    logits[2] = float("nan")
    _, ids = ops.topk_route(logits, 2, False, False)
    assert ids[0, 0].item() == 5
    assert bool(((ids >= 0) & (ids < 8)).all())
    assert bool((ids[:, 0] != ids[:, 1]).all())  # two distinct experts per token


@pytest.mark.parametrize("t,k,e", [(1, 8, 128), (5, 2, 8), (64, 8, 128), (3000, 8, 128),
                                   (100, 4, 1024), (0, 2, 8)])  # fmt: skip
def test_moe_align_groups_slots(t, k, e):
    g = torch.Generator().manual_seed(t)
    ids = (
        torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        if t
        else (torch.zeros(0, k, dtype=torch.int64))
    )
    ids = ids.to("cuda", torch.int32)
    sorted_ids, inverse, offsets = ops.moe_align(ids, e)
    _, _, ref_offsets = moe_align_native(ids, e)
    assert torch.equal(offsets, ref_offsets)
    if t == 0:
        return
    flat = ids.flatten().long()
    rows = inverse.long()
    assert torch.equal(sorted_ids.long()[rows], torch.arange(t * k, device="cuda") // k)
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]]).long()
    assert bool(((starts[flat] <= rows) & (rows < offsets.long()[flat])).all())
    assert torch.equal(torch.sort(rows).values, torch.arange(t * k, device="cuda"))


@pytest.mark.parametrize("dtype,h", [(torch.bfloat16, 2048), (torch.float16, 200),
                                     (torch.float32, 96), (torch.bfloat16, 36)])  # fmt: skip
def test_moe_combine_matches_torch(dtype, h):
    t, k = 41, 4
    y = torch.randn(t * k, h, device="cuda").to(dtype)
    inverse = torch.randperm(t * k, device="cuda").to(torch.int32)
    w = torch.rand(t, k, device="cuda")
    out = ops.moe_combine(y, inverse, w)
    ref = (y.double()[inverse.long()].view(t, k, h) * w.double()[..., None]).sum(1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out, moe_combine_native(y, inverse, w), rtol=tol, atol=tol)


def test_binding_errors_name_the_argument():
    with pytest.raises(TypeError, match="topk_ids"):
        ops.moe_align(torch.zeros(4, 2, dtype=torch.int64, device="cuda"), 8)
    with pytest.raises(ValueError, match="num_experts"):
        ops.moe_align(torch.zeros(4, 2, dtype=torch.int32, device="cuda"), 2048)
    with pytest.raises(ValueError, match="top_k"):
        ops.topk_route(torch.zeros(4, 8, device="cuda"), 9, True, True)
    with pytest.raises(TypeError, match="logits"):
        ops.topk_route(torch.zeros(4, 8, dtype=torch.int32, device="cuda"), 2, True, True)


def _cuda_layer(e, k, h, i, quant=None, seed=0) -> FusedMoE:
    with torch.device("cuda"):
        layer = FusedMoE(e, k, h, i, renormalize=True, quant_config=quant)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.05
    w2 = torch.randn(e, h, i, device="cuda", generator=g) * 0.05
    if quant is None:
        layer.w13_weight.data = w13.bfloat16()
        layer.w2_weight.data = w2.bfloat16()
    else:
        for name, w in (("w13", w13), ("w2", w2)):
            for x in range(e):
                q, s = quantize_per_channel(w[x])
                getattr(layer, f"{name}_weight").data[x].copy_(q)
                getattr(layer, f"{name}_weight_scale").data[x].copy_(s)
    return layer


@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_bf16_layer_against_float64(t):
    e, k, h, i = 128, 8, 256, 128
    layer = _cuda_layer(e, k, h, i)
    x = torch.randn(t, h, device="cuda").bfloat16()
    logits = _distinct_logits(t, e, torch.bfloat16, seed=t)
    out = layer(x, logits)
    ref = reference_moe(x.cpu(), layer.w13_weight.cpu(), layer.w2_weight.cpu(), logits.cpu(),
                        k, renormalize=True)  # fmt: skip
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < 1e-2, err


@pytest.mark.parametrize(
    "t",
    [
        pytest.param(
            1,
            marks=pytest.mark.xfail(
                reason="H200 2026-12-02: relative error 0.019 against the emulated FP8 path at "
                "one token (64 and 300 tokens: < 1e-2); cause not found yet (issue 29)",
                strict=False,
            ),
        ),
        64,
        300,
    ],
)
def test_fp8_layer_against_emulated(t, monkeypatch):
    """The grouped FP8 path (torch._scaled_grouped_mm); the Triton one, on by default, and the
    FP8 decode kernels: tests/gpu/test_moe_triton_fp8_gpu.py, test_moe_decode_fp8_gpu.py."""
    monkeypatch.setattr(moe_fp8, "FP8_MOE_BACKEND", "grouped")
    monkeypatch.setattr(experts, "MOE_DECODE_MAX_SLOTS", 0)
    e, k, h, i = 64, 4, 256, 128
    layer = _cuda_layer(e, k, h, i, quant=Fp8Config(None, emulate=False))
    x = torch.randn(t, h, device="cuda").bfloat16()
    logits = _distinct_logits(t, e, torch.bfloat16, seed=t)
    out = layer(x, logits)
    layer.quant_method.emulate = True
    ref = layer(x, logits)
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < 1e-2, err


def test_layer_replays_from_a_cuda_graph_with_another_routing():
    e, k, h, i, t = 128, 8, 256, 128, 16
    layer = _cuda_layer(e, k, h, i)
    x = torch.randn(t, h, device="cuda").bfloat16()
    logits = _distinct_logits(t, e, torch.bfloat16, seed=1)
    with torch.inference_mode():
        layer(x, logits)  # warm-up outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        logits.copy_(_distinct_logits(t, e, torch.bfloat16, seed=2))
        x.copy_(torch.randn(t, h, device="cuda").bfloat16())
        graph.replay()
        eager = layer(x, logits)
    # Rows may sit elsewhere within their expert's group (moe_align's atomics): bf16 ulps at
    # most; a replay with the captured routing would be off by O(1).
    torch.testing.assert_close(out, eager)


def test_float16_layer_captured_through_the_masked_path():
    """float16 has no grouped GEMM: captured in a graph, every expert runs on all rows,
    masked (no host read); the replay equals the eager per-group loop."""
    e, k, h, i, t = 16, 2, 128, 64, 8
    layer = _cuda_layer(e, k, h, i)
    layer.w13_weight.data = layer.w13_weight.data.half()
    layer.w2_weight.data = layer.w2_weight.data.half()
    x = torch.randn(t, h, device="cuda").half()
    logits = _distinct_logits(t, e, torch.float16, seed=3)
    with torch.inference_mode():
        layer(x, logits)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        logits.copy_(_distinct_logits(t, e, torch.float16, seed=4))
        graph.replay()
        eager = layer(x, logits)
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_tiny_models_greedy_match_hf_on_cuda(tmp_path, arch):
    """float32 on CUDA: the routing, align and combine kernels, per-expert GEMMs."""
    prompts = [[5, 6, 7, 8, 9], list(range(40, 75)), [3] * 17]
    model_dir = save_hf_moe_model(tmp_path, arch)
    model, _ = load_model(model_dir, device="cuda")
    ours = Driver(model, block_size=16).generate(prompts, 16)
    assert ours == hf_greedy(model_dir, prompts, 16)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_graphs_follow_eager_bf16(tmp_path, arch):
    """bf16 through torch._grouped_mm: decode steps from CUDA graphs against eager ones; all
    but at most one sequence token for token (a last-ulp near-tie may flip one)."""
    # head_dim 64: a size the CUDA attention kernels (and so the decode graphs) serve.
    model_dir = save_hf_moe_model(
        tmp_path, arch, hidden_size=256, head_dim=64, moe_intermediate_size=128
    )
    prompts = [[(7 * j + i) % 250 + 3 for j in range(10 + 3 * i)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", enforce_eager=eager,
                  num_kv_blocks=256, max_num_seqs=16)  # fmt: skip
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=params)]  # fmt: skip
        if not eager:
            assert llm.engine.runner.cuda_graphs.num_replays > 0
        llm.engine.shutdown()
    same = sum(a == b for a, b in zip(outs[True], outs[False], strict=True))
    assert same >= len(prompts) - 1
