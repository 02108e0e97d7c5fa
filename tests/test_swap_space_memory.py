"""Issue 55 item 15: the swap space is not memory taken at start.

The default CPU daemon took 6.4 GB for SmolLM2-135M, 4.1 GB of it the default 4 GiB of
``--swap-space``, zero-filled at start (2.2 GB with the pool allocated unfilled, measured on
``pagedd serve``). The CPU pool is written before it is read, so an unpinned one is left to the
OS to commit as swapped blocks are written; a pinned one (CUDA) is resident at once and is
checked against the host's memory, as vLLM checks its swap space.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pydaemon.config.engine import EngineConfig
from pydaemon.engine.layer_configs import runner_config
from pydaemon.worker import kv_host_pool
from pydaemon.worker.kv_cache import GiB, KVCacheSpec
from pydaemon.worker.kv_host_pool import build_host_kv

# SmolLM2-135M's KV block: 30 layers, 3 KV heads, head_dim 64, float32 (0.7 MiB of 16 tokens)
SMOLLM2_SPEC = KVCacheSpec(30, 3, 16, 64, torch.float32)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_cpu_engines_swap_space_costs_memory_only_as_blocks_are_swapped():
    config = runner_config(EngineConfig(model="demo", device="cpu", swap_space=2.0))
    before = _rss_bytes()
    host = build_host_kv(config, SMOLLM2_SPEC, 1 << 20, torch.device("cpu"), "float32")
    grown = _rss_bytes() - before
    assert host.num_swap_blocks == int(2 * GiB // SMOLLM2_SPEC.block_bytes)
    assert host.cpu_kv_cache.shape[0] == host.num_swap_blocks
    assert grown < 64 << 20, f"the 2 GiB swap pool took {grown / 2**20:.0f} MiB at start"
    # A swapped-out block is written, then read back as written.
    block = torch.randn(SMOLLM2_SPEC.block_shape)
    host.cpu_kv_cache[7] = block
    assert torch.equal(host.cpu_kv_cache[7], block)
    assert _rss_bytes() - before < grown + (8 << 20)  # one block's pages, not the pool's


def test_a_pinned_swap_space_is_checked_against_the_hosts_memory(monkeypatch, caplog):
    monkeypatch.setattr(kv_host_pool, "_host_memory_bytes", lambda: 8 * GiB)
    with pytest.raises(ValueError, match=r"--swap-space\) 6 GiB.*more than 70% of this host"):
        kv_host_pool._check_swap_space(6 * GiB, 6 * GiB, pinned=True)
    with caplog.at_level(logging.WARNING, logger=kv_host_pool.__name__):
        kv_host_pool._check_swap_space(6 * GiB, 4 * GiB, pinned=True)  # 50 %: said
        kv_host_pool._check_swap_space(6 * GiB, 6 * GiB, pinned=False)  # lazy: fine
        assert len(caplog.records) == 1 and "pinned host memory" in caplog.records[0].message
        kv_host_pool._check_swap_space(6 * GiB, 9 * GiB, pinned=False)
        assert "may exhaust it" in caplog.records[-1].message
