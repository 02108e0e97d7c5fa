"""`pagedd generate` against an in-process server; `pagedd serve` settings from flags + TOML."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pydaemon.config.engine import EngineConfig
from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.daemon.settings import resolve
from pydaemon.entrypoints.grpc.client import run_generate

ROOT = Path(__file__).resolve().parents[2]


def test_generate_streams_text_and_prints_finish_and_usage(start_server):
    st = start_server()
    args = build_parser().parse_args(
        ["generate", "--server", st.address, "--max-tokens", "5", "--temperature", "0", "hi"]
    )
    out, err = io.StringIO(), io.StringIO()
    assert run_generate(args, out, err) == 0
    # fake engine: prompt "hi" -> last id 3 + ord("i") % 61; then +1, +2, ...
    last = 3 + ord("i") % 61
    expected = "".join(chr(ord("a") + (last + 1 + k) % 64 % 26) for k in range(5))
    assert out.getvalue() == expected + "\n"
    assert "[finish: length | tokens: prompt 3, completion 5, cached 0" in err.getvalue()


def test_generate_n_and_in_band_error(start_server):
    st = start_server()
    args = build_parser().parse_args(
        ["generate", "--server", st.address, "-n", "2", "--max-tokens", "3", "hi"]
    )
    out, err = io.StringIO(), io.StringIO()
    assert run_generate(args, out, err) == 0
    assert out.getvalue().count("--- sequence") == 2
    args = build_parser().parse_args(["generate", "--server", st.address, "--top-p", "5", "hi"])
    out, err = io.StringIO(), io.StringIO()
    assert run_generate(args, out, err) == 1
    assert "INVALID_ARGUMENT" in err.getvalue() and "top_p" in err.getvalue()


def test_serve_settings_flags_override_toml(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDD_API_KEY", raising=False)
    toml = tmp_path / "p.toml"
    toml.write_text(
        'model = "demo"\nmax-num-seqs = 8\nport = 6000\ngrace_period = 5.0\nenable_prefix_caching = false\n'
    )
    args = build_parser().parse_args(
        ["serve", "--config", str(toml), "--port", "7000", "--block-size", "32"]
    )
    engine_kwargs, options, level = resolve(args)
    assert engine_kwargs == {
        "model": "demo",
        "max_num_seqs": 8,
        "block_size": 32,
        "enable_prefix_caching": False,
    }
    assert (options.port, options.grace_period_s, options.host, level) == (
        7000,
        5.0,
        "127.0.0.1",
        "info",
    )
    EngineConfig(**engine_kwargs)


def test_serve_settings_errors_name_the_key(tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text("max_num_sequences = 8\n")
    args = build_parser().parse_args(["serve", "--config", str(toml)])
    with pytest.raises(ValueError, match="unknown key 'max_num_sequences'"):
        resolve(args)
    toml.write_text("port = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        resolve(args)


def test_example_config_is_valid(monkeypatch):
    monkeypatch.setenv("PAGEDD_API_KEY", "k")
    args = build_parser().parse_args(
        ["serve", "--config", str(ROOT / "deploy" / "pagedd.example.toml")]
    )
    engine_kwargs, options, _ = resolve(args)
    config = EngineConfig(**engine_kwargs)
    assert config.device == "cuda" and options.metrics_port == 9400 and options.api_key == "k"


def test_version_and_start_up_failure_exit_codes():
    import subprocess
    import sys

    from pydaemon import __version__

    run = subprocess.run(
        [sys.executable, "-m", "pydaemon", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert (run.returncode, run.stdout.strip()) == (0, f"pagedd {__version__}")
    run = subprocess.run(
        [sys.executable, "-m", "pydaemon", "serve", "--model", "/nonexistent/model", "--port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 1
    assert (
        "start-up failed: model '/nonexistent/model' is neither 'demo', "
        "'SmolLM2-135M-Instruct', a model directory nor a .gguf file" in run.stderr
    )
    run = subprocess.run(
        [sys.executable, "-m", "pydaemon", "serve", "--block-size", "7"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 2 and "--block-size must be one of" in run.stderr
    assert "EngineConfig" not in run.stderr  # issue 55 item 18: the flag, not the field


def test_generate_logprobs_prints_text_and_alternatives(demo_server):
    """Issue 46: --logprobs printed "id:logprob" pairs only. Each token now has its text in
    context (TokenLogprobs.text) and the N most likely tokens at its place with theirs."""
    import ast

    st = demo_server()
    args = build_parser().parse_args(
        ["generate", "--server", st.address, "--max-tokens", "4", "--temperature", "0",
         "--ignore-eos", "--logprobs", "2", "Once upon a time"]
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert run_generate(args, out, err) == 0, err.getvalue()
    lines = [x for x in err.getvalue().splitlines() if x.startswith("  ")]
    assert len(lines) == 4, err.getvalue()
    texts = []
    for line in lines:
        chosen, _, top = line.partition(" | ")
        text_repr, logprob = chosen.strip().rsplit(None, 1)
        texts.append(ast.literal_eval(text_repr))
        assert float(logprob) <= 0.0
        alternatives = top.split(", ")
        assert len(alternatives) == 2  # greedy: the chosen token is the most likely one
        assert alternatives[0].rsplit(None, 1)[0] == text_repr
    assert "".join(texts) == out.getvalue().rstrip("\n")


def test_generate_adapter_names_the_lora_adapter():
    """Issue 55 item 21: `pagedd generate` had no way to ask for a LoRA adapter."""
    from pydaemon.entrypoints.grpc.client import _start_request

    args = build_parser().parse_args(["generate", "--adapter", "smol", "--chat", "Hi"])
    assert _start_request(args).adapter == "smol"
    assert _start_request(build_parser().parse_args(["generate", "Hi"])).adapter == ""
