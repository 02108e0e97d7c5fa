"""The README's request examples bound their output (issue 46): without ``max_tokens`` a
request may generate the rest of the context, minutes on a CPU (a small model under a JSON
constraint can loop inside a string), so every example request sets it."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _calls(text: str) -> list[str]:
    """The text of every ``.create(...)`` / ``.parse(...)`` call and JSON request body."""
    calls = []
    for match in re.finditer(r"\.(?:create|parse)\(", text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[match.start() : end + 1])
    calls += re.findall(r"-d '(\{.*?\})'", text, flags=re.DOTALL)
    return calls


def test_every_readme_request_sets_max_tokens():
    calls = _calls(README.read_text())
    assert len(calls) >= 5
    unbounded = [c for c in calls if "max_tokens" not in c and "max_completion_tokens" not in c]
    assert not unbounded, unbounded


# ---- issue 55 item 21: what a new user tripped on in the README -----------------------------

ROOT = README.parent


def _code_blocks(text: str) -> list[str]:
    """The shell blocks (```bash, ```sh) of a Markdown text."""
    blocks, current, language = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language in ("bash", "sh"):
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _commands(text: str) -> list[list[str]]:
    """Every `pagedd ...` command of the README's shell blocks, as arguments (comments,
    `;`/`&`/`|` and what follows them cut off)."""
    import shlex

    commands = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            if not re.search(r"(^|/|\s)pagedd\s", line):
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            words: list[str] = []
            for word in [*lexer, ";"]:
                if word.strip(";&|"):
                    words.append(word)
                    continue
                if words and words[0].endswith("pagedd") and len(words) > 1:
                    commands.append(words[1:])
                words = []
    return commands


def test_every_file_a_readme_command_names_is_shipped():
    """`--json-schema city.schema.json` named a file the repository did not have."""
    text = README.read_text()
    paths = []
    for block in _code_blocks(text):
        for token in re.findall(
            r"(?<![\w/.-])((?:[\w-]+/)*[\w.-]+\.(?:json|py|sh|toml|md))\b", block
        ):
            if not token.startswith(("/", ".venv")):
                paths.append(token)
    assert "examples/city.schema.json" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_pagedd_command_of_the_readme_parses():
    """Flags the README uses exist (`pagedd generate --adapter` did not)."""
    from pydaemon.entrypoints.cli import build_parser

    commands = _commands(README.read_text())
    assert any(c[0] == "generate" and "--adapter" in c for c in commands)
    for argv in commands:
        build_parser().parse_args(argv)  # SystemExit (argparse's error) for a bad flag


def test_grpcurl_examples_say_how_to_get_grpcurl():
    for path in (README, ROOT / "docs" / "serving.md"):
        text = path.read_text()
        if "grpcurl -plaintext" in text:
            assert "github.com/fullstorydev/grpcurl" in text, path


def test_the_readme_adapter_recipe_fits_the_default_model(tmp_path):
    """scripts/make_lora_adapter.py writes an adapter the daemon accepts for the default model
    (the checks `--lora-modules` runs at start)."""
    import importlib.util

    from pydaemon.config.engine import DEFAULT_MODEL
    from pydaemon.config.lora import check_lora_fits_model, read_lora_config
    from pydaemon.model_loader.model_paths import load_model_config, resolve_model_dir

    assert "scripts/make_lora_adapter.py" in README.read_text()
    spec = importlib.util.spec_from_file_location(
        "make_lora_adapter", ROOT / "scripts" / "make_lora_adapter.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "smol-lora"
    assert script.main([str(out), "--rank", "4"]) == 0
    config = read_lora_config(out, max_lora_rank=16)
    assert config.rank == 4 and len(config.target_modules) == 7
    check_lora_fits_model(config, load_model_config(resolve_model_dir(DEFAULT_MODEL)))
