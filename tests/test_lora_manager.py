"""The worker's LoRA manager: device slots handed out lowest first and reused least recently
used first, the host LRU, and the per-token slot buffer (all -1 again after a step without
adapters, since a CUDA graph reads it whatever the step holds)."""

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


def _manager(model_dir, max_loras: int, max_cpu_loras: int) -> LoRAManager:
    model, _ = load_model(model_dir, dtype="float32")
    return LoRAManager(model, max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_cpu_loras,
                       max_num_tokens=32, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip


def test_slots_lru_and_the_token_buffer(setup):
    model_dir, (a0, a1, a2) = setup
    manager = _manager(model_dir, max_loras=2, max_cpu_loras=2)
    manager.set_step([a0, None, a1], np.array([2, 1, 3], dtype=np.int32))
    assert manager.slots.token_slots[:6].tolist() == [0, 0, -1, 1, 1, 1]
    assert manager.slots.num_active_slots == 2
    assert manager.active_lora_ids == [1, 2]
    manager.set_step([a0], np.array([1], dtype=np.int32))  # a0 used last: a1 is the LRU slot
    manager.set_step([a2, a0], np.array([1, 1], dtype=np.int32))
    assert manager.slots.token_slots[:2].tolist() == [1, 0]  # a2 took a1's slot
    assert sorted(manager.active_lora_ids) == [1, 3]
    assert manager.cached_lora_ids == [3, 1]  # host LRU of 2: a1 went with its slot
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
    runner = llm.engine.core.runner
    slots = runner.lora_manager.slots
    assert slots.num_active_slots == 0  # the step had no adapter
    seen = []

    def fake_capture_all(graphs):
        seen.append((graphs, slots.num_active_slots))
        return "captured"

    monkeypatch.setattr(model_runner, "capture_all", fake_capture_all)
    assert runner._capture("graphs") == "captured"
    assert seen == [("graphs", 3)] and slots.num_active_slots == 0  # restored after
