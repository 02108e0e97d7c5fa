"""pydaemon/heap_freeze.py: an engine freezes what is alive once it is built (no full
collection walks the model and the imports during serving), thaws at shutdown, and a new
engine collects the garbage the last freeze kept."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402

from pydaemon import (  # noqa: E402
    LLM,
    SamplingParams,
    heap_freeze,  # noqa: E402
)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def model_path(tmp_path):
    path, _ = make_hf_model(tmp_path)
    return str(path)


@pytest.fixture(autouse=True)
def _thawed():
    yield
    gc.unfreeze()


def test_engine_freezes_its_heap_and_thaws_at_shutdown(model_path, monkeypatch):
    monkeypatch.delenv("PAGEDD_GC_FREEZE", raising=False)
    llm = LLM(model_path, device="cpu", dtype="float32", num_kv_blocks=64)
    frozen = gc.get_freeze_count()
    # The imports and the model are frozen: a full collection walks a small remainder.
    assert frozen > 10_000 and len(gc.get_objects()) < frozen / 4
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=params)
    assert len(out.outputs[0].token_ids) == 4
    assert gc.get_freeze_count() <= frozen  # serving froze nothing (refcounts may free some)
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_new_engine_collects_what_the_last_freeze_kept(model_path, monkeypatch):
    monkeypatch.delenv("PAGEDD_GC_FREEZE", raising=False)
    garbage = _Cycle()
    dead = weakref.ref(garbage)
    heap_freeze.freeze_startup_heap()  # an earlier engine froze it while it was alive
    del garbage
    gc.collect()
    assert dead() is not None, "a frozen cycle is not collected"
    LLM(model_path, device="cpu", dtype="float32", num_kv_blocks=64)
    assert dead() is None, "the new engine's thaw + collect freed it"


def test_turned_off(model_path, monkeypatch):
    monkeypatch.setenv("PAGEDD_GC_FREEZE", "0")
    gc.unfreeze()
    LLM(model_path, device="cpu", dtype="float32", num_kv_blocks=64)
    assert gc.get_freeze_count() == 0


def test_an_offline_script_exits_without_leak_reports(model_path, tmp_path):
    """Frozen at exit, cycles holding nanobind objects (pagedd's, triton's) would never be
    collected and nanobind would report them as leaks: the freeze thaws at exit."""
    script = tmp_path / "offline.py"
    script.write_text(
        "from pydaemon import LLM, SamplingParams\n"
        f"llm = LLM({model_path!r}, device='cpu', dtype='float32', num_kv_blocks=64)\n"
        "p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)\n"
        "(out,) = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=p)\n"
        "assert len(out.outputs[0].token_ids) == 3\n"
        "import gc; assert gc.get_freeze_count() > 0\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PAGEDD_GC_FREEZE"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_warmup_freezes_what_the_first_request_built(model_path, monkeypatch):
    """The daemon's engine core warms up before it is ready: what that first request
    created and kept (lazy imports, caches) is frozen too."""
    monkeypatch.delenv("PAGEDD_GC_FREEZE", raising=False)
    llm = LLM(model_path, device="cpu", dtype="float32", num_kv_blocks=64)
    gc.collect()
    before = len(gc.get_objects())  # tracked and not frozen
    llm.engine.warmup()
    gc.collect()
    assert len(gc.get_objects()) <= before
