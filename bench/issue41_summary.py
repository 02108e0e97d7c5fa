"""The summary of bench/issue41_suite.sh: one table per group from the JSON files in OUT.

    python bench/issue41_summary.py OUT     # prints the tables, writes OUT/issue41_summary.json

- MoE layer (bench_moe.py): us per token count for each variant, the experts hit, the share
  of the weight floor, and FP8 over bf16 (> 1: FP8 faster) at the same shape and token count;
- engines (throughput.py, controlled routing): W1, TPOT at batch 1 and 64, the experts each
  layer step touched at batch 64 against uniform routing, the histogram's max / mean, and
  pagedd over vLLM (speed: their time over ours) where both ran;
- dense FP8 decode A/B, short prefill (ours at its best backend against flash), profiles
  (the largest kinds of GPU time).

Files that are missing (a step failed or was skipped) leave their rows out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen_env import write_json  # noqa: E402

LAYERS = (  # file stem, label; bf16 reference of the same shape
    ("layer_qwen3_bf16", "Qwen3-30B-A3B bf16", None),
    ("layer_qwen3_fp8", "Qwen3-30B-A3B FP8 (channel)", "layer_qwen3_bf16"),
    ("layer_qwen3_fp8_block", "Qwen3-30B-A3B FP8 (128x128 blocks)", "layer_qwen3_bf16"),
    ("layer_qwen3_fp8_grouped", "Qwen3-30B-A3B FP8 grouped (before)", "layer_qwen3_bf16"),
    ("layer_qwen3_fp8_w8a8", "Qwen3-30B-A3B FP8 all w8a8", "layer_qwen3_bf16"),
    ("layer_mixtral_bf16", "Mixtral-8x7B bf16", None),
    ("layer_mixtral_bf16_triton", "Mixtral-8x7B bf16 Triton (spread)", "layer_mixtral_bf16"),
    ("layer_mixtral_fp8", "Mixtral-8x7B FP8 (channel)", "layer_mixtral_bf16"),
    (
        "layer_mixtral_fp8_triton",
        "Mixtral-8x7B FP8 Triton (no decode kernels)",
        "layer_mixtral_bf16",
    ),
    ("layer_qwen3_fp8_triton", "Qwen3-30B-A3B FP8 Triton (no decode kernels)", "layer_qwen3_bf16"),
)
ENGINES = [(m, q) for m in ("qwen3", "mixtral") for q in ("bf16", "fp8")]
DENSE = ("dense_bf16", "dense_fp8_scaled_mm", "dense_fp8_gemv16", "dense_fp8_swap16")


def _load(out: Path, stem: str) -> dict | None:
    path = out / f"{stem}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def layer_rows(out: Path) -> list[dict]:
    rows = []
    for stem, label, ref_stem in LAYERS:
        data = _load(out, stem)
        if data is None:
            continue
        ref = _load(out, ref_stem) if ref_stem else None
        ref_ms = {r["tokens"]: r["total_ms"] for r in ref["rows"]} if ref else {}
        for r in data["rows"]:
            rows.append({
                "variant": label, "tokens": r["tokens"], "us": r["total_ms"] * 1e3,
                "experts_hit": r["experts_hit"], "of_floor": r.get("of_floor"),
                "vs_bf16": ref_ms[r["tokens"]] / r["total_ms"] if r["tokens"] in ref_ms else None,
            })  # fmt: skip
    return rows


def _routing_at(result: dict, phase: str) -> dict:
    summary = (result.get("moe_routing") or {}).get(phase) or {}
    if "by_step_tokens" not in summary:
        return {}
    t = summary["most_common_step_tokens"]
    step = (
        summary["by_step_tokens"][str(t)]
        if str(t) in summary["by_step_tokens"]
        else (summary["by_step_tokens"][t])
    )
    return {"step_tokens": t, "experts_touched": step["experts_touched"],
            "uniform": step["uniform_expectation"],
            "max_over_mean": max(h["max_over_mean"] for h in summary["histogram"])}  # fmt: skip


def engine_rows(out: Path) -> list[dict]:
    rows = []
    for model, quant in ENGINES:
        found = {}
        for engine in ("pagedd", "vllm"):
            data = _load(out, f"engine_{model}_{quant}_{engine}")
            if data is None or not data.get("results"):
                continue
            r = data["results"][0]
            found[engine] = {
                "w1_s": r["wall_s"],
                "tpot_b1_ms": (r.get("tpot_batch1") or {}).get("tpot_ms"),
                "tpot_b64_ms": (r.get("tpot_batch") or {}).get("tpot_ms"),
                "routing_b64": _routing_at(r, "tpot_batch64"),
                "routing_w1": _routing_at(r, "workload"),
            }
        if not found:
            continue
        row = {"model": model, "quant": quant, **found}
        if len(found) == 2:
            p, v = found["pagedd"], found["vllm"]
            row["pagedd_over_vllm"] = {
                k: (v[k] / p[k] if p.get(k) and v.get(k) else None)
                for k in ("w1_s", "tpot_b1_ms", "tpot_b64_ms")
            }
        rows.append(row)
    return rows


def dense_rows(out: Path) -> list[dict]:
    rows = []
    for stem in DENSE:
        data = _load(out, stem)
        if data is None or not data.get("results"):
            continue
        r = data["results"][0]
        rows.append({"run": stem, "w1_s": r["wall_s"],
                     "tpot_b1_ms": (r.get("tpot_batch1") or {}).get("tpot_ms"),
                     "switches": r.get("kernel_switches")})  # fmt: skip
    return rows


def prefill_rows(out: Path) -> list[dict]:
    """Ours at its fastest backend against the fastest peer (flash, or any SDPA backend)."""
    rows = []
    for stem in ("prefill_32x32", "prefill_32x8"):
        data = _load(out, stem)
        for r in (data or {}).get("rows", []):
            peer = r.get("best_peer_tflops", r["peer_tflops"])
            rows.append({"heads": stem.removeprefix("prefill_"), "q_len": r["q_len"],
                         "prefix": r["prefix"], "best": r["ours"], "tflops": r["ours_tflops"],
                         "peer_tflops": peer, "x_peer": r["ours_tflops"] / peer})  # fmt: skip
    return rows


def profile_rows(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.glob("profile_step_*.json")):
        r = json.loads(path.read_text())
        kinds = r.get("gpu_ms_per_step_by_kind", {})
        step = r.get("profiled_step_wall_ms") or 0.0
        rows.append({"run": path.stem, "batch": r.get("batch_size_median"),
                     "step_ms": step, "gpu_busy": r.get("gpu_busy_fraction"),
                     "shares": {k: v / step for k, v in kinds.items()} if step else {}})  # fmt: skip
    data = _load(out, "profile_w1_bf16")
    if data and data.get("results"):
        gpu = data["results"][0].get("gpu_breakdown") or {}
        if gpu:
            rows.append({"run": "profile_w1_bf16", "busy_ms": gpu.get("busy_ms"),
                         "idle_ms": gpu.get("idle_ms"), "ms_by_kind": gpu.get("ms_by_kind")})  # fmt: skip
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: issue41_summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = {"layer": layer_rows(out), "engines": engine_rows(out), "dense": dense_rows(out),
               "prefill": prefill_rows(out), "profiles": profile_rows(out)}  # fmt: skip
    if summary["layer"]:
        print("\nMoE layer alone (CUDA graphs, uniform routing)")
        print(f"{'variant':36} {'T':>5} {'us':>9} {'experts':>7} {'of floor':>8} {'vs bf16':>7}")
        for r in summary["layer"]:
            print(f"{r['variant']:36} {r['tokens']:5} {r['us']:9.1f} {r['experts_hit']:7} "
                  f"{_f(r['of_floor'], '8.1%')} {_f(r['vs_bf16'], '7.2f')}")  # fmt: skip
    if summary["engines"]:
        print("\nEngines, controlled routing (W1 s, TPOT ms; experts touched per layer step at "
              "batch 64 vs uniform; histogram max/mean)")  # fmt: skip
        for r in summary["engines"]:
            for engine in ("pagedd", "vllm"):
                e = r.get(engine)
                if not e:
                    continue
                rt = e["routing_b64"]
                routing = (f"{rt['experts_touched']:.1f} vs {rt['uniform']:.1f} "
                           f"(T={rt['step_tokens']}), max/mean {rt['max_over_mean']:.2f}"
                           if rt else "no routing stats")  # fmt: skip
                print(f"  {r['model']:8} {r['quant']:5} {engine:7} W1 {_f(e['w1_s'], '7.2f')}  "
                      f"TPOT b1 {_f(e['tpot_b1_ms'], '6.2f')}  b64 {_f(e['tpot_b64_ms'], '6.2f')}"
                      f"  {routing}")  # fmt: skip
            ratio = r.get("pagedd_over_vllm")
            if ratio:
                print(f"  {r['model']:8} {r['quant']:5} pagedd/vLLM W1 {_f(ratio['w1_s'], '.2f')}x"
                      f"  TPOT b1 {_f(ratio['tpot_b1_ms'], '.2f')}x"
                      f"  b64 {_f(ratio['tpot_b64_ms'], '.2f')}x")  # fmt: skip
    if summary["dense"]:
        print("\nLlama-3-8B shape (FP8: weights + KV)")
        for r in summary["dense"]:
            print(
                f"  {r['run']:22} W1 {r['w1_s']:7.2f} s  TPOT b1 {_f(r['tpot_b1_ms'], '6.3f')} ms"
            )
    if summary["prefill"]:
        print("\nPrefill attention, best backend against flash (TFLOP/s)")
        for r in summary["prefill"]:
            print(f"  {r['heads']:6} q_len {r['q_len']:5} prefix {r['prefix']:5} "
                  f"{r['best']:20} {r['tflops']:7.1f} vs {r['peer_tflops']:7.1f} "
                  f"= {r['x_peer']:.2f}x")  # fmt: skip
    for r in summary["profiles"]:
        if "shares" in r:
            top = sorted(r["shares"].items(), key=lambda kv: -kv[1])[:5]
            kinds = ", ".join(f"{k} {v:.0%}" for k, v in top)
            print(f"  {r['run']}: batch {r['batch']}, step {r['step_ms']:.2f} ms: {kinds}")
        elif r.get("ms_by_kind"):
            top = sorted(r["ms_by_kind"].items(), key=lambda kv: -kv[1])[:6]
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in top)
            print(f"  {r['run']}: busy {r['busy_ms']:.0f} ms, idle {r['idle_ms']:.0f} ms: {kinds}")
    write_json(out / "issue41_summary.json", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
