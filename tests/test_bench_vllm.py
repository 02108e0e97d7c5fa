"""bench/throughput.py's vLLM backend and TPOT-at-batch-1 measurement, without vLLM or a GPU:
a stand-in ``vllm`` module records what the backend asks of vLLM's offline API (the engine
arguments, the token-id prompts, the sampling parameters) and answers like it; the pagedd side
runs for real on the demo model on the CPU. bench/side_by_side_summary.py reads the files."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

from bench import side_by_side_summary, throughput, tpot_generate  # noqa: E402
from bench.throughput_models import write_model_config  # noqa: E402
from bench.workloads import W1_TOKEN_HIGH, w1  # noqa: E402


class _FakeLLM:
    instances: list[_FakeLLM] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[list, list]] = []
        self.resets = 0
        self.llm_engine = types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(
                scheduler_config=types.SimpleNamespace(
                    max_num_seqs=1024, max_num_batched_tokens=16384
                ),  # fmt: skip
                cache_config=types.SimpleNamespace(
                    block_size=16,
                    num_gpu_blocks=None,
                    cache_dtype="auto",
                    enable_prefix_caching=True,
                ),  # fmt: skip
                model_config=types.SimpleNamespace(
                    max_model_len=8192, quantization=None, enforce_eager=False
                ),  # fmt: skip
                compilation_config=types.SimpleNamespace(mode=3),
            )
        )
        _FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append((prompts, params))
        return [
            types.SimpleNamespace(
                prompt_token_ids=p["prompt_token_ids"],
                outputs=[types.SimpleNamespace(token_ids=[7] * sp.max_tokens)],
            )
            for p, sp in zip(prompts, params, strict=True)
        ]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


class _FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.__dict__.update(kwargs)


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__version__ = "0.26.0-fake"
    module.LLM, module.SamplingParams = _FakeLLM, _FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    _FakeLLM.instances.clear()
    return module


def _run(argv: list[str], out: Path) -> dict:
    assert throughput.main([*argv, "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())["results"][0]


def test_vllm_backend_runs_w1_as_token_ids_with_vllm_defaults(fake_vllm, tmp_path, capsys):
    model = write_model_config("llama3-8b", tmp_path / "m")
    r = _run(["--backend", "vllm", "--model", str(model), "--load-format", "dummy",
              "--workload", "w1", "--num-requests", "8"], tmp_path / "out.json")  # fmt: skip
    (llm,) = _FakeLLM.instances
    assert llm.kwargs == {"model": str(model), "skip_tokenizer_init": True, "seed": 0,
                          "enable_prefix_caching": True, "enforce_eager": False,
                          "load_format": "dummy"}  # fmt: skip
    (warmup, _), (prompts, params) = llm.calls
    assert all(min(p["prompt_token_ids"]) >= W1_TOKEN_HIGH for p in warmup)  # no W1 prefix
    assert llm.resets == 1
    assert [p["prompt_token_ids"] for p in prompts] == [q.prompt for q in w1(8)]
    assert {(p.temperature, p.max_tokens, p.ignore_eos, p.detokenize) for p in params} == {
        (0.0, 256, True, False)
    }
    assert r["backend"] == "vllm" and r["num_output_tokens"] == 8 * 256
    assert r["num_prompt_tokens"] == sum(len(q.prompt) for q in w1(8))
    assert r["engine"]["max_num_batched_tokens"] == 16384 and r["engine"]["version"].endswith(
        "fake"
    )
    assert "tpot_batch1" not in r
    table = capsys.readouterr().out
    assert "None" not in table and "vllm" in table


def test_vllm_fp8_backend_and_flags(fake_vllm, tmp_path):
    model = write_model_config("llama3-8b", tmp_path / "m")
    r = _run(["--backend", "vllm-fp8", "--model", str(model), "--workload", "w1",
              "--num-requests", "2", "--kv-cache-dtype", "fp8", "--max-num-batched-tokens",
              "8192", "--max-num-seqs", "256", "--tpot-batch1", "2", "--tpot-prompt-len", "16",
              "--tpot-output-len", "5"], tmp_path / "out.json")  # fmt: skip
    (llm,) = _FakeLLM.instances
    assert llm.kwargs["quantization"] == "fp8" and llm.kwargs["kv_cache_dtype"] == "fp8"
    assert llm.kwargs["max_num_batched_tokens"] == 8192 and llm.kwargs["max_num_seqs"] == 256
    tpot = r["tpot_batch1"]
    assert len(tpot["runs"]) == 2 and tpot["prompt_len"] == 16 and tpot["output_len"] == 5
    timed = llm.calls[2:]  # after the warm-up and the workload: tpot's warm-up, then pairs
    assert [params[0].max_tokens for _, params in timed] == [8, 5, 1, 5, 1]
    ids = [tuple(prompts[0]["prompt_token_ids"]) for prompts, _ in timed]
    assert len(set(ids)) == len(ids) and all(len(i) == 16 for i in ids)  # fresh prompts


def test_vllm_backend_rejects_what_vllm_cannot_run(fake_vllm, tmp_path, capsys):
    model = write_model_config("llama3-8b", tmp_path / "m")
    argv = ["--backend", "vllm", "--model", str(model), "--num-requests", "2"]
    assert throughput.main([*argv, "--quantization", "fp8_emulated"]) == 2
    assert "--quantization fp8 only" in capsys.readouterr().err
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hello"}\n')
    assert throughput.main([*argv, "--workload", "jsonl", "--jsonl", str(jsonl)]) == 2
    assert "token-id workloads only" in capsys.readouterr().err


def test_tpot_by_difference_on_a_fake_clock(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(tpot_generate.time, "perf_counter", lambda: clock[0])
    seen: list[list[int]] = []

    def generate_one(ids: list[int], n: int) -> int:
        seen.append(ids)
        clock[0] += 0.020 + 0.005 * (n - 1)  # 20 ms to the first token, then 5 ms a token
        return n

    r = tpot_generate.measure_tpot_batch1(generate_one, 3, prompt_len=32, output_len=9)
    assert r["tpot_ms"] == pytest.approx(5.0) and r["ttft_ms"] == pytest.approx(20.0)
    assert len(seen) == 1 + 2 * 3 and len({tuple(s) for s in seen}) == len(seen)
    assert all(len(s) == 32 and min(s) >= 100 and max(s) < 30000 for s in seen)
    with pytest.raises(RuntimeError, match="asked for 9 tokens, the engine returned 8"):
        tpot_generate.measure_tpot_batch1(lambda ids, n: min(n, 8), 1, output_len=9)
    with pytest.raises(ValueError, match="output_len >= 2"):
        tpot_generate.measure_tpot_batch1(generate_one, 1, output_len=1)
    assert tpot_generate.token_range_for(512) == (100, 512)
    assert tpot_generate.token_range_for(128) == (0, 128)


def test_tpot_at_a_batch_size_by_difference(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(tpot_generate.time, "perf_counter", lambda: clock[0])
    batches: list[list[list[int]]] = []

    def generate_batch(prompts: list[list[int]], n: int) -> list[int]:
        batches.append(prompts)
        clock[0] += 0.050 + 0.008 * (n - 1)  # a 50 ms batched prefill, then 8 ms a step
        return [n] * len(prompts)

    r = tpot_generate.measure_tpot_batch(generate_batch, 2, 64, prompt_len=16, output_len=5)
    assert r["tpot_ms"] == pytest.approx(8.0) and r["batch_size"] == 64
    assert len(batches) == 1 + 2 * 2 and all(len(b) == 64 for b in batches)
    assert all(len(p) == 16 for b in batches for p in b)
    assert len({tuple(p) for b in batches for p in b}) == 64 * len(batches)  # all fresh
    with pytest.raises(RuntimeError, match=r"asked for \d+ tokens, the engine returned 1"):
        tpot_generate.measure_tpot_batch(lambda ps, n: [n] * (len(ps) - 1) + [1], 1, 4,
                                         output_len=5)  # fmt: skip


def test_pagedd_tpot_batch1_on_the_demo_model(tmp_path):
    r = _run(["--backend", "pagedd", "--model", "demo", "--device", "cpu", "--workload", "fixed",
              "--input-len", "8", "--output-len", "4", "--num-requests", "2",
              "--tpot-batch1", "1", "--tpot-prompt-len", "8", "--tpot-output-len", "3"],
             tmp_path / "out.json")  # fmt: skip
    assert r["num_output_tokens"] == 8
    tpot = r["tpot_batch1"]
    assert tpot["output_len"] == 3 and len(tpot["runs"]) == 1
    assert tpot["runs"][0]["full_ms"] > 0 and tpot["runs"][0]["one_token_ms"] > 0


def _result(path: Path, backend: str, wall: float, tpot: float | None = None, **extra) -> None:
    r = {"backend": backend, "wall_s": wall, "output_throughput": 131072 / wall, "load_s": 1.0}
    if tpot is not None:
        r["tpot_batch1"] = {"tpot_ms": tpot}
    r.update(extra)
    path.write_text(json.dumps({"meta": {}, "results": [r]}))


def test_side_by_side_summary(tmp_path, capsys):
    _result(tmp_path / "w1_pagedd_bf16.json", "pagedd", 12.0, 4.8)
    _result(tmp_path / "w1_vllm_bf16.json", "vllm", 13.2, 5.1)
    _result(tmp_path / "w1_vllm_fp8.json", "vllm", 9.2, 4.0)  # pagedd fp8 missing: failed
    _result(tmp_path / "w1_pagedd_bf16_budget16k.json", "pagedd", 11.5)
    gpu = {"busy_ms": 11000.0, "idle_ms": 900.0, "span_ms": 11900.0,
           "ms_by_kind": {"gemm": 8000.0, "attention (decode)": 2500.0}}  # fmt: skip
    _result(tmp_path / "w1_pagedd_bf16_profile.json", "pagedd", 12.4, gpu_breakdown=gpu)
    assert side_by_side_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "side_by_side.json").read_text())
    bf16, fp8 = summary["w1"]
    assert bf16["pagedd_speed_over_vllm"] == pytest.approx(1.1)
    assert bf16["tpot_batch1_vllm_over_pagedd"] == pytest.approx(5.1 / 4.8)
    assert "pagedd" not in fp8 and "pagedd_speed_over_vllm" not in fp8
    (lever,) = summary["levers"]
    assert lever["speed_over_baseline"] == pytest.approx(12.0 / 11.5)
    _result(tmp_path / "w1_pagedd_bf16_again.json", "pagedd", 12.2)  # the repeat, at the end
    assert side_by_side_summary.main([str(tmp_path)]) == 0
    (lever,) = json.loads((tmp_path / "side_by_side.json").read_text())["levers"]
    assert lever["speed_over_baseline"] == pytest.approx(12.1 / 11.5)
    out = capsys.readouterr().out
    assert summary["gpu_breakdown"]["pagedd"]["ms_by_kind"]["gemm"] == 8000.0
    assert "W1 bf16" in out and "1.100" in out and "step budget 16,384" in out
    assert "attention (decode)" in out and "12400" in out


def _sweep(path: Path, ttft_p99: float) -> None:
    def pct(p50, p99):
        return {"p50": p50, "p99": p99}

    runs = [
        {
            "config": {"request_rate": rate},
            "metrics": {
                "ttft_ms": pct(40.0, ttft_p99),
                "tpot_ms": pct(7.5, 11.0),
                "output_throughput": 2000.0,
                "goodput": 11.5,
                "failed": 0,
            },
        }  # fmt: skip
        for rate in (12.0, 24.0)
    ]
    path.write_text(json.dumps({"meta": {}, "runs": runs}))


def test_serve_summary(tmp_path, capsys):
    _sweep(tmp_path / "serve_pagedd.json", 146.0)
    _sweep(tmp_path / "serve_vllm.json", 165.0)
    assert side_by_side_summary.main(["--serve", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "serve_side_by_side.json").read_text())["rates"]
    assert [r["request_rate"] for r in rows] == ["12.0", "24.0"]
    assert rows[0]["pagedd"]["ttft_p99"] == 146.0 and rows[0]["vllm"]["ttft_p99"] == 165.0
    assert capsys.readouterr().out.count("vllm") == 2


VLLM_METRICS_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/m"} 7.0
vllm:num_requests_waiting{engine="0",model_name="/tmp/m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="/tmp/m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="/tmp/m"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="/tmp/m"} 64.0
vllm:prompt_tokens_total{engine="0",model_name="/tmp/m"} 600.0
vllm:prompt_tokens_total{engine="1",model_name="/tmp/m"} 40.0
vllm:generation_tokens_total{engine="0",model_name="/tmp/m"} 99.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
"""


def test_loadgen_reads_vllm_and_pagedd_metrics():
    from bench.loadgen_client import STATUS_FIELDS
    from bench.loadgen_openai import parse_metrics

    got = parse_metrics(VLLM_METRICS_PAGE)
    assert set(got) == set(STATUS_FIELDS)
    assert (got["num_running"], got["num_waiting"], got["num_preemptions"]) == (7, 2, 1)
    assert (got["num_gpu_blocks"], got["num_free_gpu_blocks"]) == (1000, 750)
    assert (got["prefix_cache_query_tokens"], got["prefix_cache_hit_tokens"]) == (640, 64)
    assert (got["num_prompt_tokens"], got["num_generation_tokens"]) == (640, 99)  # summed
    page = "pagedd_num_requests_running 3\npagedd_kv_blocks_total 512\npagedd_kv_blocks_used 12\n"
    got = parse_metrics(page)
    assert (got["num_running"], got["num_gpu_blocks"], got["num_free_gpu_blocks"]) == (3, 512, 500)
