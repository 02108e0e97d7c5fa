"""LoRA settings and metrics: --lora-modules (flags and TOML) turn LoRA on and reach the front
ends; bad specs are refused; requests per adapter appear in the Prometheus text, also as vLLM's
vllm:lora_requests_info."""

from __future__ import annotations

import dataclasses

import pytest

from pydaemon.core.stats import EngineStats
from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.common.metrics import Metrics
from pydaemon.entrypoints.daemon.settings import resolve


def test_lora_modules_flag_and_toml(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "a=/x/a", "b=/x/b", "--max-loras", "4"]
    )
    engine, options, _ = resolve(args)
    assert engine["enable_lora"] is True and engine["max_loras"] == 4
    assert options.lora.lora_modules == {"a": "/x/a", "b": "/x/b"}
    assert options.lora.is_enabled and "max_lora_rank" not in engine  # EngineConfig's default
    toml = tmp_path / "pagedd.toml"
    toml.write_text('max-lora-rank = 64\n[lora_modules]\nc = "/x/c"\n')
    engine, options, _ = resolve(build_parser().parse_args(["serve", "--config", str(toml)]))
    assert engine["enable_lora"] is True and engine["max_lora_rank"] == 64
    assert options.lora.lora_modules == {"c": "/x/c"}
    for bad in (["a"], ["a=/x", "a=/y"], ["=/x"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            resolve(build_parser().parse_args(["serve", "--lora-modules", *bad]))
    engine, options, _ = resolve(build_parser().parse_args(["serve"]))
    assert "enable_lora" not in engine and not options.lora.is_enabled


def _stats(**kw) -> EngineStats:
    required = [f.name for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING]
    zeros = {name: 0 for name in required if name != "lora_requests"}
    return EngineStats(**{**zeros, "num_gpu_blocks": 8, "num_free_gpu_blocks": 8, **kw})


def test_requests_per_adapter_in_metrics():
    stats = _stats(max_loras=4, lora_requests={"a": (2, 0), 'q"x': (1, 3)})
    text = Metrics(lambda: stats).render()
    assert 'pagedd_lora_requests_running{adapter="a"} 2' in text
    assert 'pagedd_lora_requests_waiting{adapter="q\\"x"} 3' in text
    assert (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,q\\"x",'
        'waiting_lora_adapters="q\\"x"} 1.0' in text
    )
    assert "lora" not in Metrics(lambda: _stats()).render()  # LoRA off: no LoRA lines
