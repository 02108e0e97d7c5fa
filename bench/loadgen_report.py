"""The summary tables printed at the end of a load run or a sweep."""

from __future__ import annotations


def _rate(rate) -> str:
    return "inf" if rate in ("inf", float("inf")) else f"{rate:g}"


def summary_table(run: dict) -> str:
    """One run's figures, laid out like vLLM's benchmark_serving summary."""
    m, c = run["metrics"], run["config"]
    lines = [f"{' Serving Benchmark Result ':=^60}"]

    def row(name: str, value, fmt: str = "") -> None:
        text = "-" if value is None else format(value, fmt)
        lines.append(f"{name:<44}{text:>16}")

    row("Workload", c["workload"])
    row("Request rate (req/s)", _rate(c["request_rate"]))
    row("Burstiness", c["burstiness"], "g")
    row("Max concurrency", c["max_concurrency"] or "-")
    row("Successful requests", m["completed"])
    row("Failed requests", m["failed"])
    for status, count in m["errors_by_status"].items():
        row(f"  {status}", count)
    row("Benchmark duration (s)", m["duration_s"], ".2f")
    row("Total input tokens", m["total_input_tokens"])
    row("Total generated tokens", m["total_output_tokens"])
    row("Prefix-cache hit tokens", m["total_cached_tokens"])
    row("Request throughput (req/s)", m["request_throughput"], ".2f")
    if "goodput" in m:
        slo = ",".join(f"{k}={v:g}" for k, v in m["slo"].items())
        row(f"Goodput (req/s) [{slo}]", m["goodput"], ".2f")
    row("Output token throughput (tok/s)", m["output_throughput"], ".2f")
    row("Total token throughput (tok/s)", m["total_token_throughput"], ".2f")
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):  # fmt: skip
        lines.append(f"{' ' + name + ' ':-^60}")
        d = m[key]
        for stat in [k for k in d if k in ("mean", "median") or (k.startswith("p") and k != "p50")]:
            label = stat.upper() if stat.startswith("p") else stat.capitalize()
            row(f"{label} {key.split('_')[0].upper()} (ms)", d.get(stat), ".2f")
    server = run.get("server_delta")
    if server:
        lines.append(f"{' Server counters (during the run) ':-^60}")
        row("Preemptions", server.get("num_preemptions"))
        row("Peak KV blocks in use (polled)", run.get("peak_kv_blocks_used"))
        row("Prefix-cache hit tokens (server)", server.get("prefix_cache_hit_tokens"))
    lines.append("=" * 60)
    return "\n".join(lines)


def sweep_table(runs: list[dict]) -> str:
    head = (f"{'rate':>8} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'E2E p50':>9} {'E2E p99':>9} {'good/s':>7} {'fail':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for run in runs:
        m = run["metrics"]
        cells = [m["ttft_ms"].get("median"), m["ttft_ms"].get("p99"), m["tpot_ms"].get("median"),
                 m["tpot_ms"].get("p99"), m["e2el_ms"].get("median"), m["e2el_ms"].get("p99")]  # fmt: skip
        lines.append(
            f"{_rate(run['config']['request_rate']):>8} {m['request_throughput']:8.2f} "
            f"{m['output_throughput']:10.1f} "
            + " ".join("        -" if v is None else f"{v:9.1f}" for v in cells)
            + f" {m.get('goodput', float('nan')):7.2f} {m['failed']:5d}"
        )
    return "\n".join(lines)
