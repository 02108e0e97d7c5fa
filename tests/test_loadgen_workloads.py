"""Benchmark workloads: W1 exactly as bench/README.md defines it, and the other generators."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

from bench import workloads as wl  # noqa: E402


def _w1_by_definition() -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(512):
        n = rng.randint(64, 1024)
        prompts.append([rng.randrange(100, 30000) for _ in range(n)])
    return prompts


def test_w1_is_bench_md_definition():
    reqs = wl.w1()
    expected = _w1_by_definition()
    assert [r.prompt for r in reqs] == expected
    assert [r.prompt_len for r in reqs[:6]] == [928, 190, 412, 457, 643, 633]
    assert wl.summarize(reqs) == {
        "num_requests": 512,
        "total_prompt_tokens": sum(map(len, expected)),
        "total_output_tokens": 512 * 256,
    }
    assert sum(map(len, expected)) == 278363
    assert all(r.output_len == 256 and not r.is_text for r in reqs)


def test_w1_prefix_and_bounds():
    assert [r.prompt for r in wl.w1(5, 8)] == _w1_by_definition()[:5]
    assert wl.w1(5, 8)[0].output_len == 8
    for bad in (0, 513):
        with pytest.raises(ValueError, match="num_requests"):
            wl.w1(bad)


def test_synthetic_workloads_respect_their_parameters():
    fixed = wl.fixed(5, 33, 7, seed=1, token_low=3, token_high=9)
    assert all(r.prompt_len == 33 and r.output_len == 7 for r in fixed)
    assert all(3 <= t < 9 for r in fixed for t in r.prompt)
    uni = wl.uniform(200, (10, 20), (1, 3), seed=2)
    assert {r.prompt_len for r in uni} == set(range(10, 21))
    assert {r.output_len for r in uni} == {1, 2, 3}
    assert [r.prompt for r in uni] == [r.prompt for r in wl.uniform(200, (10, 20), (1, 3), seed=2)]
    sg = wl.sharegpt(3000, seed=0)
    lens = sorted(r.prompt_len for r in sg)
    assert 4 <= lens[0] and lens[-1] <= 2048
    assert 100 < lens[1500] < 160 and lens[2970] > 800  # median about 128, a long tail
    sp = wl.shared_prefix(6, 50, 5, 9, num_prefixes=2)
    assert sp[0].prompt[:50] == sp[2].prompt[:50] != sp[1].prompt[:50]
    assert all(r.prompt_len == 55 and r.output_len == 9 for r in sp)
    assert sp[0].prompt[50:] != sp[2].prompt[50:]
    with pytest.raises(ValueError, match="range"):
        wl.uniform(3, (5, 2), (1, 1))


def test_jsonl_texts_and_ids(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        json.dumps({"prompt": "Hello there", "output_len": 5}) + "\n\n"
        + json.dumps({"prompt_token_ids": [4, 5, 6]}) + "\n"
    )  # fmt: skip
    reqs = wl.jsonl(path, output_len=11)
    assert reqs[0].is_text and reqs[0].prompt == "Hello there" and reqs[0].output_len == 5
    assert reqs[0].prompt_len is None
    assert reqs[1].prompt == [4, 5, 6] and reqs[1].output_len == 11
    assert wl.summarize(reqs)["total_prompt_tokens"] is None
    path.write_text('{"prompt_token_ids": []}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1: prompt_token_ids"):
        wl.jsonl(path, 4)


def test_flags_build_the_workload():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    wl.add_workload_flags(p)
    args = p.parse_args(["--workload", "fixed", "--num-requests", "3", "--input-len", "8"])
    reqs = wl.build_workload(args, vocab_size=50)
    assert len(reqs) == 3 and all(r.prompt_len == 8 and r.output_len == 256 for r in reqs)
    assert all(49 <= t < 50 for r in reqs for t in r.prompt)  # [min(100, 49), 50)
    args = p.parse_args(["--num-requests", "2", "--output-len", "3"])
    assert [r.prompt for r in wl.build_workload(args)] == _w1_by_definition()[:2]
    args = p.parse_args(["--workload", "w1"])
    with pytest.raises(ValueError, match="vocabulary has 512"):
        wl.build_workload(args, vocab_size=512)


def test_default_workload_fits_the_demo_model():
    """The default used to be W1, whose ids and lengths the demo model cannot take."""
    from pydaemon.config.engine import EngineConfig
    from pydaemon.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="demo", device="cpu", num_kv_blocks=64))
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    wl.add_workload_flags(p)
    args = p.parse_args(["--num-requests", "50"])
    reqs = wl.build_workload(args, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len)
    assert args.workload == "uniform" and len(reqs) == 50
    for r in reqs:
        assert r.prompt_len + r.output_len <= engine.max_model_len
        assert all(0 <= t < engine.vocab_size for t in r.prompt)
    args = p.parse_args(["--num-requests", "2"])
    assert (
        wl.build_workload(args, vocab_size=128256, max_model_len=8192)[0].prompt
        == (_w1_by_definition()[0])
    )


def _workload_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    wl.add_workload_flags(p)
    return p.parse_args(list(argv))


def test_output_len_sets_every_sharegpt_output():
    """Issue 55 item 20: --output-len was ignored for sharegpt (3 requests ran 5 minutes).
    Now every output is that long (vLLM's --sharegpt-output-len); the inputs are unchanged."""
    tail = wl.build_workload(_workload_args("--workload", "sharegpt", "--num-requests", "40"))
    short = wl.build_workload(
        _workload_args("--workload", "sharegpt", "--num-requests", "40", "--output-len", "4")
    )
    assert {r.output_len for r in short} == {4}
    assert len({r.output_len for r in tail}) > 10  # the long tail without the flag
    assert [r.prompt for r in short] == [r.prompt for r in tail]


def test_output_len_with_uniform_is_an_error_naming_output_range():
    args = _workload_args("--workload", "uniform", "--output-len", "4")
    with pytest.raises(ValueError, match="--output-len does not apply.*--output-range"):
        wl.build_workload(args)
    args = _workload_args("--output-len", "4")  # auto picks uniform lengths within the cap
    assert max(r.output_len for r in wl.build_workload(args, 512, 2048)) <= 4


def test_help_cites_only_files_the_repository_has():
    """`--help` cited BENCH.md, which is not in the repository; W1 is in bench/README.md."""
    from bench import loadgen, throughput

    for parser in (loadgen.build_parser(), throughput.build_parser()):
        text = parser.format_help()
        assert "BENCH.md" not in text
        assert "bench/README.md" in text
    assert "Workload W1" in (Path(REPO_ROOT) / "bench" / "README.md").read_text()
