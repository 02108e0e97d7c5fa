"""Operator-facing settings: `serve --help` shows real defaults, the API key can come from a
file, and every `pagedd` command line in the docs parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.daemon.settings import resolve

ROOT = Path(__file__).resolve().parents[2]


def _serve_help() -> str:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001 - argparse
    return " ".join(serve.format_help().split())


def test_serve_help_shows_defaults_once():
    text = _serve_help()
    assert "(default: None)" not in text
    # --metrics-port, --http-port, --enforce-eager, --calculate-kv-scales,
    # --allow-unauthenticated, --parse-special-tokens-in-chat, --enable-lora,
    # --enable-expert-parallel, --return-tokens-as-token-ids, --enable-tokenizer-info-endpoint
    assert text.count("(default: off)") == 10
    for expected in (
        "tokens per KV block (8, 16, 32) (default: 16)",
        "most sequences per step (default: 512)",
        "gRPC port (default: 50051)",
        "automatic prefix caching (default: on)",
        "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS token budget per step (default: 4096",
    ):
        assert expected in text, expected
    assert "prefer $PAGEDD_API_KEY or --api-key-file" in text


def test_api_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDD_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    args = build_parser().parse_args(["serve", "--api-key-file", str(key_file)])
    _, options, _ = resolve(args)
    assert options.api_key == "s3cret" and options.metrics_auth
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        resolve(args)
    args = build_parser().parse_args(["serve", "--api-key-file", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--api-key-file"):
        resolve(args)
    args = build_parser().parse_args(["serve", "--no-metrics-auth"])
    assert resolve(args)[1].metrics_auth is False


def test_new_vllm_flags_reach_their_options():
    """Issue 55: --root-path, --return-tokens-as-token-ids, --structured-outputs-compile-timeout
    (checked where they are read: the HTTP and engine tests)."""
    args = build_parser().parse_args(
        ["serve", "--root-path", "/llm", "--return-tokens-as-token-ids",
         "--structured-outputs-compile-timeout", "5"]
    )  # fmt: skip
    engine_kwargs, options, _ = resolve(args)
    assert options.root_path == "/llm" and options.serving.return_tokens_as_token_ids
    assert engine_kwargs["structured_outputs_compile_timeout"] == 5.0
    defaults = resolve(build_parser().parse_args(["serve"]))
    assert defaults[1].root_path is None and not defaults[1].serving.return_tokens_as_token_ids
    bad = build_parser().parse_args(["serve", "--structured-outputs-compile-timeout", "0"])
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout must be a finite"):
        from pydaemon.config.engine import EngineConfig

        EngineConfig(**resolve(bad)[0])


def _doc_commands() -> list[str]:
    """`pagedd ...` lines of the shell blocks in README.md and docs/."""
    commands = []
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        in_shell = False
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                in_shell = line.strip() == "```bash"
                continue
            if in_shell:
                line = re.sub(r"^(\.venv/bin/|/opt/pagedd/\.venv/bin/)", "", line.strip())
                if line.startswith("pagedd "):
                    commands.append(line.split("  #")[0].split(";")[0].rstrip(" &\\"))
    return commands


def test_every_documented_command_parses():
    commands = _doc_commands()
    assert len(commands) >= 8
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"documented command does not parse: {command}")
