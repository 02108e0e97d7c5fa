"""`--quantization fp8` where no GPU can run it is refused before anything loads (issue 46:
on a CPU the refusal came from the engine core, after ~30 s of start-up)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pydaemon.config.engine import EngineConfig
from pydaemon.entrypoints.daemon import device_probe
from pydaemon.entrypoints.daemon.settings import add_serve_flags, resolve

ROOT = Path(__file__).resolve().parents[2]


def _resolve(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return resolve(parser.parse_args(list(argv)))


def test_fp8_on_the_cpu_is_a_bad_config():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*fp8_emulated.*device is 'cpu'"):
        EngineConfig(quantization="fp8", device="cpu")
    EngineConfig(quantization="fp8_emulated", device="cpu")  # the emulation runs anywhere


def test_fp8_with_device_auto_and_no_driver_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(device_probe, "NVIDIA_DRIVER", tmp_path / "absent")
    with pytest.raises(ValueError, match="needs a CUDA GPU.*no NVIDIA driver"):
        _resolve("--quantization", "fp8")
    (tmp_path / "absent").write_text("NVRM version: 550\n")  # a driver: the core decides
    engine_kwargs, _, _ = _resolve("--quantization", "fp8")
    assert engine_kwargs["quantization"] == "fp8"


def test_pagedd_serve_refuses_before_loading():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pydaemon", "serve", "--quantization", "fp8", "--device", "cpu"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "needs a CUDA GPU" in out.stderr and "loading" not in out.stderr, out.stderr
