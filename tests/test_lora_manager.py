"""The worker's LoRA manager: adapters loaded once (every tensor checked) and kept until
removed, device slots handed out lowest first and reused least recently used first, and the
per-token slot buffer (all -1 again after a step without adapters, since a CUDA graph reads it
whatever the step holds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from model_utils import save_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lora_adapters import write_adapter  # noqa: E402
from pydaemon.config.lora import read_lora_config  # noqa: E402
from pydaemon.lora_request import LoRARequest  # noqa: E402
from pydaemon.model_loader.loader import load_model  # noqa: E402
from pydaemon.worker.lora_manager import LoRAManager  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-manager")
    model_dir = save_hf_model(tmp, "llama")
    config = json.loads((model_dir / "config.json").read_text())
    loras = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(config, tmp / f"a{i}", rank=4, seed=i)))
        for i in range(3)
    ]
    return model_dir, loras


def _manager(model_dir, max_loras: int) -> LoRAManager:
    model, _ = load_model(model_dir, dtype="float32")
    return LoRAManager(model, max_loras=max_loras, max_lora_rank=8,
                       max_num_tokens=32, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip


def _add(manager: LoRAManager, lora: LoRARequest) -> None:
    manager.add_adapter(lora, read_lora_config(lora.lora_path, 8))


def test_slots_lru_and_the_token_buffer(setup):
    model_dir, (a0, a1, a2) = setup
    manager = _manager(model_dir, max_loras=2)
    for lora in (a0, a1, a2):
        _add(manager, lora)
    manager.set_step([a0, None, a1], np.array([2, 1, 3], dtype=np.int32))
    assert manager.slots.token_slots[:6].tolist() == [0, 0, -1, 1, 1, 1]
    assert manager.slots.num_active_slots == 2
    assert manager.active_lora_ids == [1, 2]
    manager.set_step([a0], np.array([1], dtype=np.int32))  # a0 used last: a1 is the LRU slot
    manager.set_step([a2, a0], np.array([1, 1], dtype=np.int32))
    assert manager.slots.token_slots[:2].tolist() == [1, 0]  # a2 took a1's slot
    assert sorted(manager.active_lora_ids) == [1, 3]
    assert manager.loaded_lora_ids == [1, 2, 3]  # all kept in host memory until removed
    wrapper, part = manager.layers[(0, "q_proj")]
    assert wrapper.lora_a[1].abs().sum() > 0 and wrapper.lora_a[2].abs().sum() == 0  # zero slot
    manager.set_step([None, None], np.array([4, 1], dtype=np.int32))
    assert manager.slots.num_active_slots == 0
    assert (manager.slots.token_slots == -1).all()
    with pytest.raises(RuntimeError, match="more LoRA adapters than max_loras"):
        manager.set_step([a0, a1, a2], np.array([1, 1, 1], dtype=np.int32))


def test_graph_capture_warms_up_every_lora_slot(tmp_path, monkeypatch):
    """After a step without adapters eager steps skip LoRA; the warm-ups before a (deferred)
    graph capture must run it anyway, so that the Triton kernels compile outside the capture
    (punica_triton.py): model_runner._capture activates every slot around capture_all."""
    from engine_utils import make_hf_model

    from pydaemon import LLM, SamplingParams
    from pydaemon.worker import model_runner

    path, _ = make_hf_model(tmp_path / "m", vocab_size=128)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32, enable_lora=True,
              max_loras=3)  # fmt: skip
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
    runner = llm.engine.runner
    slots = runner.lora_manager.slots
    assert slots.num_active_slots == 0  # the step had no adapter
    seen = []

    def fake_capture_all(graphs):
        seen.append((graphs, slots.num_active_slots))
        return "captured"

    monkeypatch.setattr(model_runner, "capture_all", fake_capture_all)
    assert runner._capture("graphs") == "captured"
    assert seen == [("graphs", 3)] and slots.num_active_slots == 0  # restored after


def test_an_adapter_must_be_loaded_before_use_and_is_never_read_again(setup, tmp_path):
    """What was checked at load is what runs: replacing (or deleting) the files afterwards
    changes nothing, and an adapter never loaded is an invariant break, not a disk read."""
    model_dir, (a0, a1, _) = setup
    manager = _manager(model_dir, max_loras=1)
    with pytest.raises(RuntimeError, match="not loaded"):
        manager.set_step([a0], np.array([1], dtype=np.int32))
    import shutil

    copy = LoRARequest("copy", 9, str(tmp_path / "copy"))
    shutil.copytree(a0.lora_path, copy.lora_path)
    _add(manager, copy)
    wrapper, _ = manager.layers[(0, "q_proj")]
    manager.set_step([copy], np.array([1], dtype=np.int32))
    loaded = wrapper.lora_a[0].clone()
    shutil.rmtree(copy.lora_path)  # gone from disk
    _add(manager, a1)
    manager.set_step([a1], np.array([1], dtype=np.int32))  # evicts copy from the only slot
    manager.set_step([copy], np.array([1], dtype=np.int32))  # back from host memory
    assert torch.equal(wrapper.lora_a[0], loaded)


def test_loading_and_unloading_100_adapters_returns_every_byte(setup):
    """Unloading frees the slot and the host copy: after 100 load/use/unload cycles nothing is
    held (the tensors themselves are gone: weak references die) and the slots are all free."""
    import gc
    import weakref

    model_dir, (a0, _, _) = setup
    manager = _manager(model_dir, max_loras=2)
    config = read_lora_config(a0.lora_path, 8)
    refs = []
    for i in range(100):
        lora = LoRARequest(f"n{i}", 100 + i, a0.lora_path)
        manager.add_adapter(lora, config)
        assert manager.host_bytes > 0
        manager.set_step([lora], np.array([2], dtype=np.int32))
        refs.extend(
            weakref.ref(a)
            for parts in manager._host[lora.lora_int_id].values()
            for a, _ in parts.values()
        )
        manager.remove_adapter(lora.lora_int_id)
    gc.collect()
    assert manager.loaded_lora_ids == [] and manager.active_lora_ids == []
    assert manager.host_bytes == 0
    assert sorted(manager._free_slots) == [0, 1]
    assert all(r() is None for r in refs)
