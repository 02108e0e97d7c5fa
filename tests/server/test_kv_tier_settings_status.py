"""KV tiers at the daemon's edges: the --kv-offloading-* flags and TOML keys reach the engine
config (bad values refused by name), and the tiers' figures appear in /metrics (vLLM's names
and pagedd's, counted from when serving began), in GetServerStatus and in `pagedd status`."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from fake_engine import FakeEngine

from pydaemon.config.engine import EngineConfig
from pydaemon.core.stats import EngineStats, KVTierStats
from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.common.metrics import Metrics
from pydaemon.entrypoints.daemon.settings import resolve
from pydaemon.entrypoints.grpc.admin import run_admin


def test_flags_and_toml_reach_the_engine_config(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--kv-offloading-size", "64", "--kv-offloading-backend", "native"]
    )
    engine, _, _ = resolve(args)
    assert engine["kv_offloading_size"] == 64.0 and engine["kv_offloading_backend"] == "native"
    EngineConfig(**engine)
    toml = tmp_path / "pagedd.toml"
    toml.write_text(
        'kv-offloading-size = 8.5\nkv_offloading_dir = "/var/cache/kv"\n'
        "kv_offloading_disk_size = 100\n"
    )
    engine, _, _ = resolve(build_parser().parse_args(["serve", "--config", str(toml)]))
    config = EngineConfig(**engine)
    assert (config.kv_offloading_size, config.kv_offloading_dir) == (8.5, "/var/cache/kv")
    assert config.kv_offloading_disk_size == 100
    args = build_parser().parse_args(["serve", "--kv-offloading-dir", "/x"])
    with pytest.raises(ValueError, match="kv_offloading_dir needs kv_offloading_disk_size"):
        EngineConfig(**resolve(args)[0])
    with pytest.raises(SystemExit):  # not a number: argparse says which flag
        build_parser().parse_args(["serve", "--kv-offloading-size", "lots"])


def _stats(tiers: KVTierStats | None, **kw) -> EngineStats:
    required = [
        f.name
        for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    values = {name: 0 for name in required}
    values.update(num_gpu_blocks=8, num_free_gpu_blocks=8, num_cpu_blocks=32, kv_tiers=tiers)
    return EngineStats(**{**values, **kw})


def _tiers(**kw) -> KVTierStats:
    return KVTierStats(
        gpu_hit_tokens=16,
        cpu_hit_tokens=32,
        disk_hit_tokens=8,
        gpu_to_cpu_bytes=4096,
        cpu_to_gpu_bytes=2048,
        cpu_to_disk_bytes=1024,
        disk_to_cpu_bytes=512,
        num_cpu_cached_blocks=5,
        num_disk_blocks=100,
        num_disk_cached_blocks=7,
        **kw,
    )


def test_metrics_by_tier_and_under_vllm_names():
    warmup = _stats(_tiers(), prefix_cache_query_tokens=100)
    now = _stats(
        dataclasses.replace(
            _tiers(),
            cpu_hit_tokens=96,
            cpu_to_gpu_bytes=6144,
            num_failed_disk_reads=2,
            are_disk_writes_stopped=True,
        ),
        prefix_cache_query_tokens=300,
    )
    metrics = Metrics(lambda: now)
    metrics.set_baseline(warmup)
    metrics.model_name = "m"
    lines = set(metrics.render().splitlines())
    for line in (
        'pagedd_kv_tier_hit_tokens_total{tier="gpu"} 0',
        'pagedd_kv_tier_hit_tokens_total{tier="cpu"} 64',
        'pagedd_kv_tier_bytes_total{transfer_type="CPU_to_GPU"} 4096',
        'pagedd_kv_tier_bytes_total{transfer_type="DISK_to_CPU"} 0',
        'pagedd_kv_tier_blocks{tier="cpu"} 32',
        'pagedd_kv_tier_cached_blocks{tier="disk"} 7',
        'vllm:prefix_cache_queries_total{model_name="m"} 200',
        'vllm:prefix_cache_hits_total{model_name="m"} 0',
        'vllm:external_prefix_cache_queries_total{model_name="m"} 200',
        'vllm:external_prefix_cache_hits_total{model_name="m"} 64',
        'vllm:kv_offload_total_bytes_total{model_name="m",transfer_type="CPU_to_GPU"} 4096',
        'pagedd_kv_tier_disk_errors_total{op="read"} 2',
        'pagedd_kv_tier_disk_errors_total{op="write"} 0',
        "pagedd_kv_tier_disk_writes_stopped 1",
    ):
        assert line in lines, line
    assert "kv_tier" not in Metrics(lambda: _stats(None)).render()  # tiers off: no lines


class TieredEngine(FakeEngine):
    has_served = False  # until then (the warm-up): the tiers hold blocks, no traffic yet

    def get_stats(self):
        stats = super().get_stats()
        if self.has_served:
            stats.kv_tiers = _tiers(num_restored_disk_blocks=3)
        else:
            stats.kv_tiers = KVTierStats(
                num_cpu_cached_blocks=5,
                num_disk_blocks=100,
                num_disk_cached_blocks=7,
                num_restored_disk_blocks=3,
            )
        return stats


def _status(address: str, *flags: str) -> str:
    out = io.StringIO()
    assert run_admin(build_parser().parse_args(["status", "--server", address, *flags]), out) == 0
    return out.getvalue()


def test_server_status_and_pagedd_status(start_server):
    engine = TieredEngine(num_gpu_blocks=64)
    st = start_server(lambda: engine)
    assert json.loads(_status(st.address, "--json"))["kv_tiers"]["cpu_hit_tokens"] == 0
    engine.has_served = True  # counters since serving began, as /metrics counts them
    tiers = json.loads(_status(st.address, "--json"))["kv_tiers"]
    assert tiers["cpu_hit_tokens"] == 32 and tiers["num_disk_blocks"] == 100
    assert tiers["num_dropped_loads"] == 0  # zeros printed too
    assert tiers["num_restored_disk_blocks"] == 3
    lines = dict(line.split(None, 1) for line in _status(st.address).splitlines())
    assert lines["kv_tiers.disk_to_cpu_bytes"] == "512"
    plain = start_server()  # tiers off: no kv_tiers at all
    assert "kv_tiers" not in json.loads(_status(plain.address, "--json"))
