"""The deploy/ files: systemd units that systemd reads as meant, an example config that
lists every key and listens on loopback only."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pydaemon.entrypoints.daemon import settings

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "systemd" / "pagedd.service"
TEMPLATE = ROOT / "deploy" / "systemd" / "pagedd@.service"
EXAMPLE = ROOT / "deploy" / "pagedd.example.toml"


def sections(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            out[current] = []
        else:
            out[current].append(line)
    return out


@pytest.mark.parametrize("unit", [UNIT, TEMPLATE], ids=lambda p: p.name)
def test_start_limits_in_unit_section_and_no_optional_groups(unit):
    s = sections(unit)
    for key in ("StartLimitIntervalSec", "StartLimitBurst"):
        assert any(line.startswith(key + "=") for line in s["Unit"]), key
        assert not any(line.startswith(key + "=") for line in s["Service"]), key
    assert not any(line.startswith("SupplementaryGroups=") for line in s["Service"])


@pytest.mark.parametrize("unit", [UNIT, TEMPLATE], ids=lambda p: p.name)
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_finds_no_misplaced_key(unit, tmp_path):
    name = "pagedd@gpu0.service" if "@" in unit.name else unit.name
    (tmp_path / name).write_text(unit.read_text())
    if "@" in unit.name:
        (tmp_path / "pagedd@.service").write_text(unit.read_text())
    run = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True
    )
    complaints = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if "Unknown key" in line or "ignoring" in line or "Unknown section" in line
    ]
    assert complaints == []


def test_template_differs_from_the_unit_only_per_instance():
    unit, template = sections(UNIT), sections(TEMPLATE)
    assert (
        "ExecStart=/opt/pagedd/.venv/bin/pagedd serve --config /etc/pagedd/%i.toml"
        in (template["Service"])
    )
    assert "EnvironmentFile=/etc/pagedd/%i.env" in template["Service"]
    for name in unit:
        only_in_template = set(template[name]) - set(unit[name])
        assert all("%i" in line for line in only_in_template), only_in_template


def test_example_config_lists_every_key_and_listens_on_loopback():
    text = EXAMPLE.read_text()
    listed = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, flags=re.M))
    keys = {
        f[0].lstrip("-").replace("-", "_")
        for group in (
            settings.ENGINE_FLAGS,
            settings.ENGINE_BOOL_FLAGS,
            settings.SERVER_FLAGS,
            settings.SERVER_BOOL_FLAGS,
        )
        for f in group
    }
    assert keys - listed == set()
    assert re.search(r'^host = "127\.0\.0\.1"', text, flags=re.M)
