"""Sizing the KV cache on a GPU (``ModelRunner._profile_num_blocks``), checked on the CPU: a
small fake device stands behind torch.cuda's memory counters (weights resident, the profile's
probe cache and its step's activations allocated on top), so that the budget's arithmetic is
exact. The cache must get every block that gpu_memory_utilization leaves once the weights, the
largest step's activations and the sampling buffers are counted; the probe cache the profiling
step runs on is KV cache, not activations (counted as activations it left its 257 blocks unused
on every model, issue 50)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pydaemon.config.engine import EngineConfig
from pydaemon.engine.layer_configs import runner_config
from pydaemon.worker.kv_cache import KVCacheSpec
from pydaemon.worker.model_runner import ModelRunner

MIB = 1 << 20


class FakeGPUMemory:
    """torch.cuda's memory counters over a device that holds ``weights`` bytes to start with."""

    def __init__(self, total: int, weights: int) -> None:
        self.total = total
        self.allocated = self.peak = weights

    def alloc(self, num_bytes: int) -> None:
        self.allocated += num_bytes
        self.peak = max(self.peak, self.allocated)

    def free(self, num_bytes: int) -> None:
        self.allocated -= num_bytes

    def install(self, monkeypatch) -> None:
        def reset_peak(device=None) -> None:
            self.peak = self.allocated

        cuda = torch.cuda
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset_peak)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        # Everything allocated is torch's: no other process, no CUDA context.
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.allocated)
        monkeypatch.setattr(
            cuda, "mem_get_info", lambda device=None: (self.total - self.allocated, self.total)
        )


@dataclass(frozen=True)
class FakeDeviceSpec(KVCacheSpec):
    """A KV spec whose caches count on the fake device (their tensors live on the CPU)."""

    memory: FakeGPUMemory | None = None

    def allocate(self, num_blocks, device) -> torch.Tensor:
        self.memory.alloc(num_blocks * self.block_bytes)
        return torch.empty((num_blocks, *self.block_shape), dtype=self.dtype)


def test_the_cache_gets_every_block_the_budget_leaves(monkeypatch):
    weights, activations = 256 * MIB, 64 * MIB
    memory = FakeGPUMemory(total=1024 * MIB, weights=weights)
    memory.install(monkeypatch)
    config = runner_config(EngineConfig(device="cuda", enforce_eager=True, max_num_seqs=4))
    runner = ModelRunner.__new__(ModelRunner)  # the sizing alone: no model is loaded
    runner.config = config
    runner.device = torch.device("cuda")
    runner.max_model_len = 1 << 20  # the useful-block cap stays far above the budget
    runner.max_num_batched_tokens = 4096
    runner.vocab_size = 1000
    runner.kv_groups = None
    runner.model_config = None  # read by the graph plan only, which enforce_eager skips
    runner.spec = FakeDeviceSpec(2, 2, config.block_size, 16, torch.float16, memory)

    def dummy_forward(num_tokens: int) -> None:  # the largest step: activations come and go
        memory.alloc(activations)
        memory.free(activations)

    runner._dummy_forward = dummy_forward
    num_blocks = runner._profile_num_blocks()

    probe_blocks = math.ceil(4096 / config.block_size) + 1
    block = runner.spec.block_bytes
    sampling = 4 * config.max_num_seqs * runner.vocab_size * 4
    budget = memory.total * config.gpu_memory_utilization - sampling
    # At run time: the weights, the cache, and the largest step's activations on top.
    assert weights + num_blocks * block + activations <= budget
    assert weights + (num_blocks + 1) * block + activations > budget, (
        f"{num_blocks} blocks leave {(budget - weights - activations) // block - num_blocks:.0f} "
        f"blocks of the budget unused (the probe had {probe_blocks})"
    )
