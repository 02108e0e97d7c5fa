"""The summary of bench/vllm_side_by_side.sh: pagedd and vLLM on W1 (bf16, FP8 weights + FP8 KV)
and TPOT at batch 1, then the A/B rows of pagedd's levers, from the JSON files of one run.

    python bench/side_by_side_summary.py OUT_DIR      # prints the table, writes OUT_DIR/side_by_side.json
    python bench/side_by_side_summary.py --serve OUT_DIR    # bench/vllm_serve_side_by_side.sh's

Missing files (a step that failed or was skipped) leave their rows out. Ratios are speed
ratios (> 1: pagedd faster): vLLM's wall time over pagedd's, vLLM's TPOT over pagedd's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen_env import write_json  # noqa: E402

# (label, pagedd file, vLLM file): the W1 pairs, each file one throughput.py result
PAIRS = (
    ("W1 bf16", "w1_pagedd_bf16.json", "w1_vllm_bf16.json"),
    ("W1 FP8 weights + FP8 KV", "w1_pagedd_fp8.json", "w1_vllm_fp8.json"),
)
# (label, file): pagedd W1 runs of one lever each, against w1_pagedd_bf16.json
LEVERS = (
    ("step budget 16,384 tokens", "w1_pagedd_bf16_budget16k.json"),
    ("plain kernel arguments (PAGEDD_FAST_KERNEL_ARGS=0)", "w1_pagedd_bf16_plainargs.json"),
)
BASELINE_AGAIN = "w1_pagedd_bf16_again.json"  # pagedd's bf16 row once more, at the end
EAGER_TPOT = (("fast", "tpot_eager_fast.json"), ("plain", "tpot_eager_plain.json"))
# (engine, file): profiled W1 bf16 runs with a gpu_breakdown
PROFILES = (("pagedd", "w1_pagedd_bf16_profile.json"), ("vllm", "w1_vllm_bf16_profile.json"))


def _load(out: Path, name: str) -> dict | None:
    path = out / name
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _w1(out: Path, name: str) -> dict | None:
    data = _load(out, name)
    return data["results"][0] if data and data.get("results") else None


def summarize(out: Path) -> dict:
    summary: dict = {"w1": [], "levers": [], "eager_tpot_batch1_ms": {}, "op_overhead": None,
                     "gpu_breakdown": {}}  # fmt: skip
    for label, ours_file, peer_file in PAIRS:
        ours, peer = _w1(out, ours_file), _w1(out, peer_file)
        row: dict = {"label": label}
        for who, r in (("pagedd", ours), ("vllm", peer)):
            if r is not None:
                row[who] = {"wall_s": r["wall_s"], "output_throughput": r["output_throughput"],
                            "load_s": r.get("load_s"),
                            "tpot_batch1_ms": (r.get("tpot_batch1") or {}).get("tpot_ms")}  # fmt: skip
        if ours and peer:
            row["pagedd_speed_over_vllm"] = peer["wall_s"] / ours["wall_s"]
            a, b = row["pagedd"]["tpot_batch1_ms"], row["vllm"]["tpot_batch1_ms"]
            if a and b:
                row["tpot_batch1_vllm_over_pagedd"] = b / a
        summary["w1"].append(row)
    # The levers' baseline: pagedd's bf16 row, and its repeat at the end of the call when
    # there is one (their spread is the noise floor the levers are read against).
    bases = [r["wall_s"] for r in (_w1(out, PAIRS[0][1]), _w1(out, BASELINE_AGAIN)) if r]
    if bases:
        summary["baseline_wall_s"] = bases
    for label, name in LEVERS:
        r = _w1(out, name)
        if r is not None:
            lever = {"label": label, "file": name, "wall_s": r["wall_s"]}
            if bases:
                base = sum(bases) / len(bases)
                lever["baseline_wall_s"] = base
                lever["speed_over_baseline"] = base / r["wall_s"]
            summary["levers"].append(lever)
    for mode, name in EAGER_TPOT:
        data = _load(out, name)
        if data and "eager" in data.get("results", {}):
            summary["eager_tpot_batch1_ms"][mode] = data["results"]["eager"]["tpot_ms"]
    for engine, name in PROFILES:
        r = _w1(out, name)
        if r is not None and r.get("gpu_breakdown"):
            summary["gpu_breakdown"][engine] = {"wall_s": r["wall_s"], **r["gpu_breakdown"]}
    data = _load(out, "op_overhead.json")
    if data:
        res = data["results"]
        summary["op_overhead"] = {
            "fast_us_sum": sum(r["fast_us"] for r in res.values()),
            "plain_us_sum": sum(r["plain_us"] for r in res.values()),
            "per_wrapper": {
                k: {"fast_us": r["fast_us"], "plain_us": r["plain_us"]} for k, r in res.items()
            },  # fmt: skip
        }
    return summary


SERVE_FILES = (("pagedd", "serve_pagedd.json"), ("vllm", "serve_vllm.json"))


def summarize_serve(out: Path) -> list[dict]:
    """One row per request rate: each server's TTFT / TPOT p50 and p99 (ms), output tok/s and
    goodput (requests/s within the SLO), from loadgen.py's sweep files."""
    rows: dict[str, dict] = {}
    for who, name in SERVE_FILES:
        data = _load(out, name)
        for run in (data or {}).get("runs", []):
            m = run["metrics"]
            row = rows.setdefault(str(run["config"]["request_rate"]), {})
            row[who] = {"ttft_p50": m["ttft_ms"]["p50"], "ttft_p99": m["ttft_ms"]["p99"],
                        "tpot_p50": m["tpot_ms"]["p50"], "tpot_p99": m["tpot_ms"]["p99"],
                        "output_throughput": m["output_throughput"],
                        "goodput": m.get("goodput"), "failed": m["failed"]}  # fmt: skip
    return [{"request_rate": rate, **servers} for rate, servers in rows.items()]


def serve_table(rows: list[dict]) -> str:
    lines = [f"{'rate':>5} {'server':7} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} "
             f"{'out tok/s':>9} {'goodput':>8} {'failed':>6}"]  # fmt: skip
    for row in rows:
        for who, _ in SERVE_FILES:
            r = row.get(who)
            if r is None:
                continue
            lines.append(
                f"{row['request_rate']:>5} {who:7} {r['ttft_p50']:9.1f} {r['ttft_p99']:7.1f} "
                f"{_f(r['tpot_p50'], '9.2f')} {_f(r['tpot_p99'], '7.2f')} "
                f"{r['output_throughput']:9.0f} {_f(r['goodput'], '8.2f')} {r['failed']:6d}"
            )
    return "\n".join(lines)


def _f(x, fmt: str) -> str:
    """x in fmt, or "-" right-aligned to fmt's width when x is missing."""
    if x is not None:
        return format(x, fmt)
    width = fmt.split(".")[0]
    return format("-", f">{width}" if width else "")


def table(summary: dict) -> str:
    head = (f"{'W1 run':26} {'pagedd s':>9} {'vLLM s':>8} {'pagedd x':>9} "
            f"{'TPOT1 ms':>9} {'vLLM':>7} {'load s':>7} {'vLLM':>6}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for row in summary["w1"]:
        ours, peer = row.get("pagedd", {}), row.get("vllm", {})
        lines.append(
            f"{row['label']:26} {_f(ours.get('wall_s'), '9.2f')} {_f(peer.get('wall_s'), '8.2f')} "
            f"{_f(row.get('pagedd_speed_over_vllm'), '9.3f')} "
            f"{_f(ours.get('tpot_batch1_ms'), '9.3f')} {_f(peer.get('tpot_batch1_ms'), '7.3f')} "
            f"{_f(ours.get('load_s'), '7.1f')} {_f(peer.get('load_s'), '6.1f')}"
        )
    if len(summary.get("baseline_wall_s", [])) > 1:
        first, again = summary["baseline_wall_s"]
        lines.append(f"pagedd bf16 again at the end: {again:.2f} s (first {first:.2f} s: "
                     f"{100 * (again / first - 1):+.1f} %, the noise floor of the levers)")  # fmt: skip
    for lever in summary["levers"]:
        lines.append(
            f"lever: {lever['label']}: {lever['wall_s']:.2f} s "
            f"(speed x{_f(lever.get('speed_over_baseline'), '.3f')} against the bf16 rows)"
        )
    tp = summary["eager_tpot_batch1_ms"]
    if tp:
        lines.append("eager TPOT batch 1 (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in tp.items()))
    oo = summary["op_overhead"]
    if oo:
        lines.append(f"wrapper host us (sum over wrappers, 1 token): fast {oo['fast_us_sum']:.1f}, "
                     f"plain {oo['plain_us_sum']:.1f}")  # fmt: skip
    lines.extend(_breakdown_lines(summary["gpu_breakdown"]))
    return "\n".join(lines)


def _breakdown_lines(profiles: dict) -> list[str]:
    """GPU ms per kernel kind, one column per profiled engine."""
    if not profiles:
        return []
    engines = list(profiles)
    kinds = list(dict.fromkeys(k for p in profiles.values() for k in p["ms_by_kind"]))
    lines = ["GPU ms, profiled W1 bf16: " + " | ".join(engines)]
    for label, key in (("wall (profiled)", "wall_s"), ("busy", "busy_ms"), ("idle", "idle_ms")):
        scale = 1e3 if key == "wall_s" else 1.0
        lines.append(
            f"  {label:22}" + "".join(f"{profiles[e][key] * scale:10.0f}" for e in engines)
        )
    for kind in kinds:
        cells = "".join(f"{profiles[e]['ms_by_kind'].get(kind, 0.0):10.0f}" for e in engines)
        lines.append(f"  {kind:22}{cells}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="side_by_side_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="the directory bench/vllm_side_by_side.sh wrote")
    p.add_argument("--serve", action="store_true",
                   help="the serving sweep of bench/vllm_serve_side_by_side.sh instead")  # fmt: skip
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    if not out.is_dir():
        print(f"side_by_side_summary: {out} is not a directory", file=sys.stderr)
        return 2
    if args.serve:
        rows = summarize_serve(out)
        write_json(out / "serve_side_by_side.json", {"rates": rows})
        print(serve_table(rows))
        return 0
    summary = summarize(out)
    write_json(out / "side_by_side.json", summary)
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
