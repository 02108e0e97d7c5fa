"""The Triton SGMV path of LoRA (pydaemon/layers/lora/punica_triton.py) on the CPU.

The kernels themselves run under Triton's interpreter in ONE subprocess started with
TRITON_INTERPRET=1 (tests/lora_triton_interp.py): the variable is read when a kernel is
decorated, so it must be set before the kernel module is imported, and setting it in this
process would leak into every later test (GPU tests compiling Triton kernels would run them
in the interpreter). The subprocess checks each case (fp32, fp16 and bf16; 4 adapters and
tokens without one, unsorted; slots without a token; one token; every token in one slot; no
adapter at all; qkv-like parts 64/16/16, gate/up, one part, parts that straddle column tiles;
a rank-8 adapter zero-padded to 16 and a rank-8 layer; T = 1, 17, 65, 130; split-K over an
``in`` of 2.5 K-blocks; 40 slots) against a float64 per-token loop and ``add_lora_torch``,
and rows without an adapter bit for bit. The interpreter's tl.dot is wrong for bfloat16
operands (triton 3.9), so there the kernels' bf16 dots take float32 copies of the same rounded
operands (``DOT_F32``): loads, stores, roundings and the tile mapping are the GPU's; the bf16
tensor-core dot itself is covered by tests/gpu/test_lora_triton_gpu.py only.

Skipped where triton is not installed. CI's venv (scripts/setup_venv.sh) installs
torch==2.13.0 from PyPI, whose Linux x86_64 wheel depends on triton; a CPU-only torch wheel
(as in this repository's development venv) does not, and there these tests skip unless triton
was installed separately.

Also here, without triton: ``add_lora``'s choice of the path, and pydaemon importing without
triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_triton_interp import CASES, reference

from pydaemon.layers.lora import punica, punica_triton
from pydaemon.layers.lora.punica import add_lora, uses_grouped_path

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "lora_triton_interp.py")],
                         env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-6000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_triton
def test_the_kernels_ran_in_the_interpreter(interpreted):
    assert interpreted["interpreted"], "TRITON_INTERPRET=1 did not reach the kernels"
    assert set(interpreted["cases"]) == set(CASES)


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_loop_and_torch_path(interpreted, name):
    result = interpreted["cases"][name]
    assert result["ok"], result["msg"]


# ---- add_lora's choice (no kernel runs: the path is recorded, then the torch path runs) -----


def _case(num_tokens, sizes=(64, 16, 16), num_slots=6, rank=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(num_tokens)
    starts = (0, *torch.tensor(sizes).cumsum(0).tolist())
    lora_a = (torch.randn(num_slots + 1, len(sizes) * rank, 64, generator=g) / 8).to(dtype)
    lora_b = (torch.randn(num_slots + 1, rank, starts[-1], generator=g) / 5).to(dtype)
    lora_a[num_slots] = 0
    lora_b[num_slots] = 0
    token_slots = torch.randint(-1, 4, (num_tokens,), generator=g)
    x = torch.randn(num_tokens, 64, generator=g).to(dtype)
    y = torch.randn(num_tokens, starts[-1], generator=g).to(dtype)
    return y, x, token_slots, lora_a, lora_b, tuple(starts)


@pytest.fixture
def triton_on(monkeypatch):
    """As on a GPU with the switch on: every fp16/bf16 step above the bound is offered the
    Triton path; it is recorded and served by the torch path."""
    calls = []

    def record(y, x, token_slots, lora_a, lora_b, part_starts, grouping):
        calls.append(grouping)
        punica.add_lora_torch(y, x, token_slots, lora_a, lora_b, part_starts)

    monkeypatch.setattr(punica_triton, "use_triton", lambda x: x.dtype != torch.float32)
    monkeypatch.setattr(punica, "add_lora_triton", record)
    return calls


def test_add_lora_takes_the_triton_path_above_the_kernel_bound(triton_on):
    num_tokens = punica.LORA_KERNEL_MAX_TOKENS + 1
    y, x, token_slots, lora_a, lora_b, starts = _case(num_tokens)
    grouping = object()
    want = reference(y, x, token_slots, lora_a, lora_b, starts)
    add_lora(y, x, token_slots, lora_a, lora_b, starts, grouping=grouping)
    assert triton_on == [grouping]  # the step's grouping is passed on
    torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2)
    assert uses_grouped_path(x), "LoRALinear would not make the step's grouping"


@pytest.mark.parametrize("what", ["kernel bound", "five parts", "strided x"])
def test_add_lora_keeps_another_path(triton_on, what):
    num_tokens, sizes = punica.LORA_KERNEL_MAX_TOKENS + 1, (64, 16, 16)
    if what == "kernel bound":
        num_tokens -= 1
    elif what == "five parts":
        sizes = (16,) * 5
    y, x, token_slots, lora_a, lora_b, starts = _case(num_tokens, sizes)
    if what == "strided x":  # columns of stride 2: the kernels want unit strides
        x = torch.stack([x, x], dim=2).view(x.shape[0], -1)[:, ::2]
    want = reference(y, x, token_slots, lora_a, lora_b, starts)
    add_lora(y, x, token_slots, lora_a, lora_b, starts)
    assert triton_on == []
    torch.testing.assert_close(y.double(), want, rtol=3e-2, atol=3e-2)


def test_the_switch_is_on_by_default_and_gates_the_path(monkeypatch):
    assert punica_triton.LORA_TRITON is True  # measured: punica_triton.py's docstring
    x = torch.empty(punica.LORA_KERNEL_MAX_TOKENS + 1, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(punica_triton, "LORA_TRITON", True)
    assert not punica_triton.use_triton(x), "a CPU tensor must not take the Triton path"


def test_split_k_and_layout_rules():
    assert [punica_triton._split_k(n) for n in (64, 1024, 4096, 14336)] == [1, 1, 4, 8]
    y, x, token_slots, lora_a, lora_b, starts = _case(70)
    assert punica_triton.layout_ok(y, x, lora_a, lora_b, starts)
    assert not punica_triton.layout_ok(y, x, lora_a.transpose(1, 2), lora_b, starts)
    assert not punica_triton.layout_ok(y[:, ::2], x, lora_a, lora_b, starts)
    assert punica_triton.ready(y, x, lora_a, lora_b, starts)  # CPU: never capturing


def test_pydaemon_imports_without_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # import triton now fails, find_spec finds nothing\n"
        "import pydaemon.layers.lora.lora_linear\n"
        "from pydaemon.layers.lora import punica_triton\n"
        "assert not punica_triton.triton_available()\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
