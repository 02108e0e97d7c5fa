"""The final table of bench/run_gpu_suite.sh, from the JSON files it wrote into one folder.

python bench/loadgen_suite_summary.py OUT_DIR     # prints it and writes OUT_DIR/summary.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _offline_rows(data: dict | None, label: str) -> list[str]:
    if not data:
        return [f"| {label} | (missing) | | | | | | |"]
    rows = []
    for r in data["results"]:
        waste = r.get("kv_waste", {}).get("fraction_at_peak")
        rows.append(
            f"| {label}: {r['backend']} | {r['workload']['num_requests']} | {r['wall_s']:.2f} | "
            f"{r['output_throughput']:.0f} | {r['total_token_throughput']:.0f} | "
            f"{r.get('peak_kv_blocks_used', '-')} | "
            f"{'-' if waste is None else f'{100 * waste:.1f} %'} | {r.get('num_preemptions', '-')} |"
        )
    return rows


def summarize(out_dir: Path) -> str:
    w1 = _load(out_dir / "w1_pagedd.json")
    peers = _load(out_dir / "w1_64_peers.json")
    served = _load(out_dir / "w1_loadgen.json")
    served_mux = _load(out_dir / "w1_mux.json")
    served_http = _load(out_dir / "w1_openai.json")
    sweep = _load(out_dir / "sweep.json")
    meta = next((d["meta"] for d in (w1, peers, served, sweep) if d), {})
    lines = [
        f"# GPU suite, {meta.get('date', '?')}: {meta.get('gpu', '?')}, commit {meta.get('git_commit', '?')}",
        "",
        "Offline (in process). The peers ran on the first 64 W1 requests only (full W1 takes "
        "transformers about 250 s); pagedd ran both the full W1 and the same 64. Nothing is "
        "scaled. Weights are random and not identical across backends (no effect on throughput: "
        "EOS ignored, every request makes 256 tokens).",
        "",
        "| run | requests | wall s | out tok/s | total tok/s | peak KV blocks | KV waste at peak | preemptions |",
        "|---|---|---|---|---|---|---|---|",
        *_offline_rows(w1, "W1"),
        *_offline_rows(peers, "W1[:64]"),
        "",
    ]
    if peers:
        res = {r["backend"]: r for r in peers["results"]}
        base = res.get("pagedd")
        for name, r in res.items():
            if base and r is not base:
                ratio = base["output_throughput"] / r["output_throughput"]
                lines.append(f"- pagedd / {name} on W1[:64]: **{ratio:.2f}x** output tok/s")
        lines.append("")
    for data, via, target in (
        (served, "gRPC, one call per request", 5),
        (served_mux, "gRPC, requests multiplexed on GenerateBatched calls", 5),
        (served_http, "the OpenAI HTTP API", 10),
    ):
        if not data:
            continue
        m = data["runs"][0]["metrics"]
        lines += [
            f"Through {via} (loadgen, all at once, {m['num_requests']} W1 requests): duration "
            f"{m['duration_s']:.2f} s, {m['output_throughput']:.0f} out tok/s, "
            f"{m['completed']} completed, errors {m['errors_by_status'] or 'none'}; TTFT median "
            f"{m['ttft_ms'].get('median', float('nan')):.0f} ms, TPOT median "
            f"{m['tpot_ms'].get('median', float('nan')):.1f} ms.",
        ]
        if w1 and w1["results"]:
            offline = w1["results"][0]
            overhead = m["duration_s"] / offline["wall_s"] - 1
            lines.append(
                f"- {via} overhead against the offline W1 run: **{100 * overhead:+.1f} %** "
                f"({m['duration_s']:.2f} s against {offline['wall_s']:.2f} s; "
                f"target <= {target} %)"
            )
        lines.append("")
    if sweep:
        from bench.loadgen_report import sweep_table

        lines += ["Rate sweep (W1 prompts):", "", "```", sweep_table(sweep["runs"]), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    text = summarize(out)
    (out / "summary.md").write_text(text)
    print(text)
