"""bench/throughput.py on the demo model (CPU): pagedd in process, and the static HF peer."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

pytest.importorskip("pydaemon._core", exc_type=ImportError)

from bench import throughput  # noqa: E402
from bench.throughput_models import LLAMA3_8B, write_model_config  # noqa: E402

SMALL = ["--model", "demo", "--device", "cpu", "--workload", "fixed", "--input-len", "40",
         "--output-len", "8", "--num-requests", "6", "--no-progress"]  # fmt: skip


def test_pagedd_run_writes_figures(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert throughput.main([*SMALL, "--num-kv-blocks", "256", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "bench/throughput.py --model demo" in data["meta"]["command"]
    assert data["meta"]["date"] and data["meta"]["cpu"] and data["meta"]["git_commit"]
    (r,) = data["results"]
    assert r["backend"] == "pagedd" and r["workload"]["num_requests"] == 6
    assert r["num_output_tokens"] == 6 * 8 and r["num_prompt_tokens"] == 6 * 40
    assert r["output_throughput"] == pytest.approx(48 / r["wall_s"])
    assert r["total_token_throughput"] == pytest.approx(288 / r["wall_s"])
    # six sequences of 48 tokens, all running at once: 3 blocks of 16 each at the peak
    assert r["peak_kv_blocks_used"] == 18 and r["num_gpu_blocks"] == 256
    assert r["num_preemptions"] == 0
    assert 0 <= r["kv_waste"]["fraction_at_peak"] < 1 / 3
    stalls = r["host_stalls"]  # the slowest steps, longest first, and the GC's share
    slowest = [ms for _, ms in stalls["slowest_steps_ms"]]
    assert 1 <= len(slowest) <= min(10, r["num_steps"]) and slowest == sorted(slowest)[::-1]
    assert sum(slowest) < r["wall_s"] * 1e3
    assert set(stalls["gc_by_generation"]) == {"gen0", "gen1", "gen2"}
    assert "pagedd" in capsys.readouterr().out


def test_hf_static_peer_runs_the_same_workload(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    argv = [*SMALL, "--backend", "hf-static", "--static-batch-size", "4", "--out", str(out)]
    assert throughput.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["backend"] == "hf-static" and r["num_output_tokens"] == 48
    assert r["static_batch_size"] == 4 and math.isfinite(r["output_throughput"])


def test_w1_needs_a_big_enough_vocabulary(capsys):
    argv = ["--model", "demo", "--device", "cpu", "--num-requests", "2", "--workload", "w1"]
    assert throughput.main(argv) == 2
    assert "vocabulary has 512" in capsys.readouterr().err


def test_child_argv_and_compare_table(tmp_path):
    argv = ["--model-config", "llama3-8b", "--backend=pagedd,hf-static", "--compare",
            "--num-requests", "64", "--out", "x.json"]  # fmt: skip
    child = throughput._child_argv(argv, "hf-static", tmp_path / "c.json")
    assert child == ["--num-requests", "64", "--backend", "hf-static", "--out",
                     str(tmp_path / "c.json"), "--quiet"]  # fmt: skip
    rows = [
        {"backend": "pagedd", "workload": {"num_requests": 8}, "wall_s": 1.0,
         "output_throughput": 300.0, "total_token_throughput": 900.0,
         "peak_kv_blocks_used": 10, "kv_waste": {"fraction_at_peak": 0.05}, "num_preemptions": 0},
        {"backend": "hf-static", "workload": {"num_requests": 8}, "wall_s": 3.0,
         "output_throughput": 100.0, "total_token_throughput": 300.0},
    ]  # fmt: skip
    text = throughput.table(rows, compare=True)
    assert "pagedd / hf-static: 3.00x output tok/s" in text and "not the same" not in text


def test_llama3_8b_config(tmp_path):
    path = write_model_config("llama3-8b", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg == LLAMA3_8B
    shape = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "rope_theta", "torch_dtype", "max_position_embeddings")}  # fmt: skip
    assert shape == {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "vocab_size": 128256, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
                     "max_position_embeddings": 8192}  # fmt: skip
    from pydaemon.config.model import ModelConfig

    parsed = ModelConfig.from_model_dir(path)  # pagedd reads it
    assert (parsed.head_dim, parsed.rope_theta, parsed.max_model_len) == (128, 500000.0, 8192)


def test_fp8_quantization_flag(tmp_path, capsys):
    # The emulated FP8 path runs anywhere; the real one refuses the CPU by name.
    out = tmp_path / "fp8.json"
    argv = [*SMALL, "--num-kv-blocks", "256", "--quantization", "fp8_emulated", "--out", str(out)]
    assert throughput.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["engine"]["quantization"] == "fp8_emulated" and r["num_output_tokens"] == 48
    assert throughput.main([*SMALL, "--backend", "pagedd-fp8", "--out", str(out)]) == 2
    assert "quantization 'fp8' needs a CUDA GPU" in capsys.readouterr().err
