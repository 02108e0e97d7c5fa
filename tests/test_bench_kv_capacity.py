"""bench/kv_capacity.py's W1 replay (issue 50: Gemma-3-27B's preemptions on an H100, replayed
on the CPU scheduler at the device's KV budget): the first W1 requests on the Gemma-3-27B
shape, in a cache that holds every one of them at its full length (nothing is preempted or
computed twice) and in one that holds a few (the tail is preempted by recompute and its
prompts computed again, as on the device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

from bench import kv_capacity  # noqa: E402

BLOCK_GIB = 1.25 / 1024  # a Gemma-3-27B block: 10 layer slots x 16 tokens x 16 KV heads x 128


def _replay(tmp_path: Path, num_blocks: int) -> dict[str, dict]:
    out = tmp_path / f"w1_{num_blocks}.json"
    kv_capacity.main(["--shape", "gemma3-27b", "--workload", "w1", "--num-requests", "24",
                      "--kv-gib", str(num_blocks * BLOCK_GIB), "--out", str(out)])  # fmt: skip
    return {row["mode"]: row for row in json.loads(out.read_text())["rows"]}


def test_w1_replay_preempts_only_when_the_cache_cannot_hold_the_batch(tmp_path):
    # The first 24 W1 requests at full length (prompt + 256) need at most 7 x 80 blocks each.
    roomy = _replay(tmp_path, 24 * 7 * 80 + 200)["freeing"]
    assert roomy["num_groups"] == 7 and roomy["max_running"] == 24
    assert roomy["preemptions"] == roomy["recomputed_prompt_tokens"] == 0
    tight = _replay(tmp_path, 7 * 80 * 4)["freeing"]  # about 4 at full length
    assert tight["preemptions"] >= tight["requests_preempted"] > 0
    assert tight["recomputed_prompt_tokens"] > 0 and tight["max_running"] < 24
