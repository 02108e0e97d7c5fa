"""Where and how a benchmark ran: date, GPU and CPU names, git commit, command line."""

from __future__ import annotations

import datetime
import json
import math
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO,
                              check=True).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_name() -> str | None:
    """The first GPU's name, from torch when it is already imported, else nvidia-smi."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    out = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return out.splitlines()[0] if out else None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    commit = _run(["git", "rev-parse", "HEAD"])
    if commit and _run(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += "-dirty"
    return commit


def environment(argv: list[str] | None = None) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *(sys.argv if argv is None else argv)]),
        "git_commit": git_commit(),
        "gpu": gpu_name(),
        "cpu": cpu_name(),
        "hostname": platform.node(),
        "python": platform.python_version(),
    }


def write_json(path: str | Path, data: dict) -> None:
    """Strict JSON: NaN becomes null and an infinite rate the string "inf"."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
