"""The summary of bench/issue44_suite.sh: one row per engine, shape and workload from the JSON
files in OUT (throughput.py's, named ENGINE_SHAPE_KIND.json), and vLLM over pagedd per shape.

    python bench/issue44_summary.py OUT     # prints the table, writes OUT/issue44_summary.json

Columns: the workload's wall time and output tokens/s; TPOT at batch 1 and 64 (ms, 1k-token
prompts, by difference of generate() calls) and TTFT at batch 1; the engine's load time; for
MoE rows with routing statistics, the experts each layer step touched at batch 64 against
uniform routing. Ratios are vLLM's time over pagedd's (> 1: pagedd faster). Files that are
missing (a step failed or was skipped) leave their rows out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen_env import write_json  # noqa: E402

ENGINES = ("pagedd", "vllm")
SHAPES = ("llama3-8b", "mistral-7b", "gemma3-27b", "gpt-oss-20b", "gpt-oss-20b-mxfp4")
KINDS = ("w1", "long")
TIMES = ("wall_s", "tpot_b1_ms", "tpot_b64_ms")


def _routing_b64(result: dict) -> dict | None:
    """Experts touched per layer step at the batch TPOT's (64's) most common step size."""
    size = (result.get("tpot_batch") or {}).get("batch_size")
    summary = (result.get("moe_routing") or {}).get(f"tpot_batch{size}") or {}
    steps = summary.get("by_step_tokens")
    if not steps:
        return None
    t = summary["most_common_step_tokens"]
    step = steps.get(str(t), steps.get(t))
    if not step:
        return None
    return {"step_tokens": t, "experts_touched": step["experts_touched"],
            "uniform": step["uniform_expectation"]}  # fmt: skip


def row(path: Path) -> dict | None:
    data = json.loads(path.read_text())
    if not data.get("results"):
        return None
    r = data["results"][0]
    b1, b64 = r.get("tpot_batch1") or {}, r.get("tpot_batch") or {}
    engine = r.get("engine") or {}
    return {
        "wall_s": r["wall_s"],
        "output_tok_s": r["output_throughput"],
        "requests": r["workload"]["num_requests"],
        "prompt_tokens": r["workload"].get("total_prompt_tokens"),
        "tpot_b1_ms": b1.get("tpot_ms"),
        "ttft_b1_ms": b1.get("ttft_ms"),
        "tpot_b64_ms": b64.get("tpot_ms"),
        "tpot_output_len": b1.get("output_len") or b64.get("output_len"),
        "load_s": r.get("load_s"),
        "num_gpu_blocks": r.get("num_gpu_blocks"),
        "num_preemptions": r.get("num_preemptions"),
        "vllm_version": engine.get("version") if isinstance(engine, dict) else None,
        "routing_b64": _routing_b64(r),
        "gpu": (data.get("meta") or {}).get("gpu"),
        "commit": (data.get("meta") or {}).get("git_commit"),
    }


def rows(out: Path) -> list[dict]:
    found = []
    for shape in SHAPES:
        for kind in KINDS:
            by_engine = {}
            for engine in ENGINES:
                path = out / f"{engine}_{shape}_{kind}.json"
                figures = row(path) if path.is_file() else None
                if figures is not None:
                    by_engine[engine] = figures
            if not by_engine:
                continue
            entry = {"shape": shape, "kind": kind, **by_engine}
            if len(by_engine) == 2:
                p, v = by_engine["pagedd"], by_engine["vllm"]
                entry["vllm_over_pagedd"] = {
                    k: (v[k] / p[k] if p.get(k) and v.get(k) else None) for k in TIMES
                }
            found.append(entry)
    # gpt-oss: vLLM on MXFP4 experts when it ran only that way, against pagedd's bf16 experts
    bf16 = next((e for e in found if e["shape"] == "gpt-oss-20b" and e["kind"] == "w1"), None)
    mx = next((e for e in found if e["shape"] == "gpt-oss-20b-mxfp4" and "vllm" in e), None)
    if bf16 and mx and "pagedd" in bf16 and "vllm" not in bf16:
        p, v = bf16["pagedd"], mx["vllm"]
        bf16["vllm_mxfp4_over_pagedd_bf16"] = {
            k: (v[k] / p[k] if p.get(k) and v.get(k) else None) for k in TIMES
        }
    return found


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(found: list[dict]) -> str:
    head = (
        "| shape | workload | engine | wall s | out tok/s | TPOT b1 ms | TTFT b1 ms "
        "| TPOT b64 ms | load s | experts/step b64 (uniform) |"
    )
    lines = [head, "|---" * 10 + "|"]
    for e in found:
        for engine in ENGINES:
            r = e.get(engine)
            if not r:
                continue
            rt = r["routing_b64"]
            routing = f"{rt['experts_touched']:.1f} ({rt['uniform']:.1f})" if rt else "-"
            lines.append(
                f"| {e['shape']} | {e['kind']} | {engine} | {r['wall_s']:.2f} "
                f"| {r['output_tok_s']:,.0f} | {_f(r['tpot_b1_ms'], '.2f')} "
                f"| {_f(r['ttft_b1_ms'], '.1f')} | {_f(r['tpot_b64_ms'], '.2f')} "
                f"| {_f(r['load_s'], '.0f')} | {routing} |"
            )
        for key, label in (("vllm_over_pagedd", "vLLM / pagedd"),
                           ("vllm_mxfp4_over_pagedd_bf16", "vLLM MXFP4 / pagedd bf16")):  # fmt: skip
            ratio = e.get(key)
            if ratio:
                lines.append(
                    f"| {e['shape']} | {e['kind']} | {label} | {_f(ratio['wall_s'], '.2f')}x | "
                    f"| {_f(ratio['tpot_b1_ms'], '.2f')}x | | {_f(ratio['tpot_b64_ms'], '.2f')}x "
                    f"| | |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: issue44_summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    found = rows(out)
    print("\nIssue 44: dummy bf16 weights, W1 and long prompts; TPOT by difference, "
          "1k-token prompts; ratios: vLLM's time over pagedd's (> 1: pagedd faster)")  # fmt: skip
    print(table(found) if found else "(no results)")
    write_json(out / "issue44_summary.json", {"rows": found})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
