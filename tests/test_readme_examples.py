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
