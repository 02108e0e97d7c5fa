"""bench/bench_kv_tiers.py's workloads and TTFT breakdown (issue 51), on the CPU with a tiny
model: the long-document workload (each conversation over a document of its own, a history
that grows by one question and one answer a turn, nothing shared between conversations), and
a real run where a small GPU cache evicts each conversation between its turns: with a CPU tier
the later turns are served from it (hits counted by tier, cached tokens per request), without
one they are computed again; every finished request carries the engine's queue / prefill
breakdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, str(Path(__file__).parent))

from engine_utils import make_hf_model  # noqa: E402

from bench import bench_kv_tiers  # noqa: E402
from bench.chat_workload import long_document_chat  # noqa: E402


def test_long_document_chat_grows_each_history_and_shares_nothing():
    w = long_document_chat(5, 3, doc_len=100, question_len=(4, 9), reply_len=7, seed=3,
                           token_low=10, token_high=5000)  # fmt: skip
    assert w == long_document_chat(5, 3, doc_len=100, question_len=(4, 9), reply_len=7, seed=3,
                                   token_low=10, token_high=5000)  # fmt: skip
    assert len(w.conversations) == 5 and w.num_turns == 15
    for conv in w.conversations:
        first = conv[0].prompt
        assert 104 <= len(first) <= 109 and all(10 <= t < 5000 for t in first)
        for before, turn in zip(conv, conv[1:], strict=False):
            grown = len(turn.prompt) - len(before.prompt) - 7  # the answer, then a question
            assert turn.prompt[: len(before.prompt)] == before.prompt and 4 <= grown <= 9
            assert turn.reply_len == 7
    docs = [tuple(c[0].prompt[:16]) for c in w.conversations]
    assert len(set(docs)) == 5  # every conversation its own document
    with pytest.raises(ValueError, match="doc_len"):
        long_document_chat(2, 2, doc_len=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = make_hf_model(tmp_path_factory.mktemp("tiers_bench"), vocab_size=512, seed=1)
    return str(path)


def _run(model_dir: str, out: Path, *extra: str) -> dict:
    # 4 conversations over 160-token documents, 2 at a time, in 24 blocks of 16 tokens: a
    # conversation's history is evicted from the GPU while the other two take their turn.
    bench_kv_tiers.main([
        "--model", model_dir, "--load-format", "auto", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "512", "--num-gpu-blocks", "24", "--workload", "document",
        "--conversations", "4", "--turns", "2", "--doc-len", "160", "--question-len", "8,16",
        "--reply-len", "4", "--max-active", "2", "--token-range", "3,500", "--out", str(out),
        *extra,
    ])  # fmt: skip
    return json.loads(out.read_text())


def test_document_workload_later_turns_come_from_the_cpu_tier(model_dir, tmp_path, capsys):
    off = _run(model_dir, tmp_path / "off.json")
    cpu = _run(model_dir, tmp_path / "cpu.json", "--kv-offloading-size", "0.01")
    for r in (off, cpu):
        f = r["figures"]
        assert f["num_requests"] == 8 and "document" in r["label"]
        assert f["queue_p50_s"] >= 0 and f["prefill_p50_s"] > 0  # the engine's breakdown
        assert f["ttft_first_turns_p50_s"] > 0
        assert f["cached_fraction_first_turns"] == 0  # nothing shared between documents
    assert off["figures"]["cached_fraction_later_turns"] < 0.5  # evicted: computed again
    assert cpu["hits"]["cpu_hit_rate"] > 0.3
    assert cpu["figures"]["cached_fraction_later_turns"] > 0.7  # the history, from the tier
    capsys.readouterr()
    bench_kv_tiers.main(["--compare", str(tmp_path / "off.json"), str(tmp_path / "cpu.json")])
    table = capsys.readouterr().out
    assert "1st turns" in table and "prefill" in table and "tiers cpu 0.01 GiB" in table
