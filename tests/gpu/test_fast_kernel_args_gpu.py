"""The fast kernel-argument path (DLPack capsules, the raw stream handle) against the plain one
(torch's ``Tensor.__dlpack__``, ``torch.cuda.current_stream``): every wrapper gives the same
bits, runs on the caller's current stream, is captured by a CUDA graph, and keeps the
bindings' error messages."""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops
from pydaemon.ops import _core_ext

from .test_layer_kernels import test_layer_kernels_reject_bad_arguments as _reject_bad_arguments

BF16 = torch.bfloat16


@pytest.fixture
def restore_mode():
    before = _core_ext.fast_kernel_args()
    yield
    _core_ext.set_fast_kernel_args(before)


def _inputs(num_tokens: int = 5, context: int = 40, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv_heads, head_dim, block = 8, 2, 128, 16
    num_blocks = 8

    def randn(*shape, dtype=BF16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    seq_len = context + num_tokens
    return {
        "x": randn(num_tokens, 256),
        "residual": randn(num_tokens, 256),
        "weight": randn(256),
        "gate_up": randn(num_tokens, 512),
        "q": randn(num_tokens, heads, head_dim),
        "k": randn(num_tokens, kv_heads, head_dim),
        "v": randn(num_tokens, kv_heads, head_dim),
        "cache": randn(num_blocks, 2, kv_heads, block, head_dim),
        "cos": randn(num_tokens, head_dim, dtype=torch.float32),
        "sin": randn(num_tokens, head_dim, dtype=torch.float32),
        "slots": torch.arange(context, seq_len, device="cuda", dtype=torch.int64),
        "block_tables": torch.arange(4, device="cuda", dtype=torch.int32).view(1, 4),
        "seq_lens": torch.tensor([seq_len], device="cuda", dtype=torch.int32),
        "qsl": torch.tensor([0, num_tokens], device="cuda", dtype=torch.int32),
        "seq_len": seq_len,
    }


def _layer(t: dict) -> list[torch.Tensor]:
    """One layer's worth of wrapper calls on ``t`` (updated in place as the kernels do)."""
    outs = [ops.fused_add_rms_norm(t["x"], t["residual"], t["weight"], 1e-5), t["residual"]]
    outs.append(ops.rms_norm(t["x"], t["weight"], 1e-5))
    outs.append(ops.silu_and_mul(t["gate_up"]))
    outs.extend(ops.silu_and_mul_fp8_quant(t["gate_up"]))
    outs.extend(ops.per_token_fp8_quant(t["x"]))
    kc, vc = t["cache"][:, 0], t["cache"][:, 1]
    ops.rotary_embedding_and_cache(t["q"], t["k"], t["v"], kc, vc, t["slots"], t["cos"], t["sin"])
    outs.extend([t["q"], t["k"], t["cache"]])
    outs.append(
        ops.paged_attention_prefill(
            t["q"], kc, vc, t["block_tables"], t["seq_lens"], t["qsl"], t["q"].shape[0]
        )
    )
    outs.append(
        ops.paged_attention_decode_tc(
            t["q"][-1:], kc, vc, t["block_tables"], t["seq_lens"], t["seq_len"]
        )
    )
    return [o.view(torch.uint8) if o.dtype == torch.float8_e4m3fn else o for o in outs]


def test_fast_and_plain_paths_give_the_same_bits(restore_mode) -> None:
    got = {}
    for fast in (True, False):
        _core_ext.set_fast_kernel_args(fast)
        got[fast] = _layer(_inputs())
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(got[True], got[False], strict=True)):
        assert torch.equal(a, b), f"output {i} differs between the two argument paths"


def test_stream_handle_is_the_current_stream(restore_mode) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    for fast in (True, False):
        _core_ext.set_fast_kernel_args(fast)
        assert _core_ext.stream_handle(dev) == torch.cuda.current_stream().cuda_stream
        with torch.cuda.stream(side):
            assert _core_ext.stream_handle(dev) == side.cuda_stream
            assert _core_ext.stream_handle(torch.device("cuda")) == side.cuda_stream


def test_a_cuda_graph_captures_the_fast_path(restore_mode) -> None:
    _core_ext.set_fast_kernel_args(True)
    t = _inputs()
    eager_in = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    want = _layer(eager_in)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream, as cuda_graphs.py does
        _layer({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()})
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _layer(t)
    fresh = _inputs()
    for k, v in fresh.items():
        if isinstance(v, torch.Tensor):
            t[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(captured, want, strict=True)):
        assert torch.equal(a, b), f"output {i}: the replay differs from the eager run"


@pytest.mark.parametrize("fast", [True, False])
def test_binding_errors_are_unchanged(restore_mode, fast) -> None:
    _core_ext.set_fast_kernel_args(fast)
    _reject_bad_arguments()  # every message of the layer kernels' bad-argument test
