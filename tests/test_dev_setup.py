"""The README's development loop on a fresh clone (issue 46): its lint line runs (ruff is
installed by the dev setup, and ``ruff format`` leaves the Markdown alone), and
``scripts/dev_build.sh`` builds for the project's .venv without it being activated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.prefix) / "bin"  # the environment running the tests: setup_venv.sh's .venv


def test_the_readme_lint_line_passes():
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("ruff format"))
    assert line.split("#")[0].split() == ["ruff", "format", ".", "&&", "ruff", "check", "."]
    ruff = BIN / "ruff"
    assert ruff.exists(), "ruff is not installed: scripts/setup_venv.sh installs the dev extra"
    for args in (["format", "--check", "."], ["check", "."]):
        done = subprocess.run([str(ruff), *args], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_dev_build_uses_the_venv_without_activation(tmp_path):
    """A cmake stand-in records how the script configures the build, then stops it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    record = tmp_path / "cmake-args"
    (fake / "cmake").write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit 3\n')
    (fake / "cmake").chmod(0o755)
    env = {
        "PATH": f"{fake}:/usr/bin:/bin",  # no venv on PATH, nothing activated
        "HOME": os.environ.get("HOME", "/tmp"),
        "VENV": sys.prefix,
        "PAGEDD_CUDA": "OFF",
        "BUILD": str(tmp_path / "build"),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "dev_build.sh")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 3, done.stderr  # it reached cmake, which stopped it
    python = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True
    ).stdout.strip()
    assert f"-DPython_EXECUTABLE={python}" in record.read_text().split()
