"""PNG plots of a load run: latency distributions, throughput and concurrency over time, and
throughput against latency for a rate sweep. matplotlib is optional (the ``bench`` extra)."""

from __future__ import annotations

import sys
from pathlib import Path


def load_pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a note on stderr) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed (pip install 'pagedd[bench]'): no plots", file=sys.stderr
        )
        return None
    return plt


def plot_latencies(run: dict, path: Path, plt) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2E latency (ms) with their median and p99."""
    reqs = [r for r in run["requests"] if r["error_code"] is None]
    series = {
        "TTFT (ms)": [r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None],
        "TPOT (ms)": [r["tpot_ms"] for r in reqs if r["tpot_ms"] is not None],
        "ITL (ms)": [
            1e3 * (b - a)
            for r in reqs
            for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:], strict=False)
        ],
        "E2E latency (ms)": [r["e2el_ms"] for r in reqs if r["e2el_ms"] is not None],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=False):
        ax.set_xlabel(name)
        ax.set_ylabel("count")
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=50, color="tab:blue", alpha=0.8)
        s = sorted(values)
        for q, style in ((50, "-"), (99, "--")):
            v = s[min(len(s) - 1, int(round((len(s) - 1) * q / 100)))]
            ax.axvline(v, color="tab:red", linestyle=style, label=f"p{q} {v:.1f}")
        ax.legend(fontsize=8)
    fig.suptitle(_title(run))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(run: dict, path: Path, plt) -> Path:
    """Output tokens/s, requests in flight (client) and, when polled, the server's running /
    waiting requests and KV blocks in use, against time."""
    ts = run["timeseries"]
    status = run.get("server_status_samples") or []
    rows = 3 if status else 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.6 * rows), sharex=True)
    axes[0].plot(ts["time_s"], ts["output_tokens_per_s"], color="tab:blue")
    axes[0].set_ylabel("output tok/s")
    axes[1].plot(
        ts["time_s"], ts["requests_in_flight"], color="tab:green", label="client in flight"
    )
    if status:
        t = [s["time_s"] for s in status]
        axes[1].plot(
            t, [s["num_running"] for s in status], color="tab:orange", label="server running"
        )
        axes[1].plot(t, [s["num_waiting"] for s in status], color="tab:red", label="server waiting")
        used = [s["num_gpu_blocks"] - s["num_free_gpu_blocks"] for s in status]
        axes[2].plot(t, used, color="tab:purple")
        axes[2].set_ylabel("KV blocks in use")
    axes[1].set_ylabel("requests")
    axes[1].legend(fontsize=8)
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle(_title(run))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(runs: list[dict], path: Path, plt) -> Path:
    """For each rate of a sweep: achieved output tok/s against TTFT, TPOT and E2E (p50, p99)."""
    runs = sorted(runs, key=lambda r: r["metrics"]["output_throughput"])
    x = [r["metrics"]["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, name in zip(
        axes, ("ttft_ms", "tpot_ms", "e2el_ms"), ("TTFT", "TPOT", "E2E latency"), strict=False
    ):
        for q, style in (("median", "o-"), ("p99", "s--")):
            ys = [r["metrics"][key].get(q, float("nan")) for r in runs]  # NaN: no data at that rate
            ax.plot(x, ys, style, label=q)
        for r, xi in zip(runs, x, strict=True):
            y = r["metrics"][key].get("median")
            if y is not None:
                label = _rate_label(r["config"]["request_rate"])
                ax.annotate(label, (xi, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.legend(fontsize=8)
    fig.suptitle("rate sweep: throughput against latency (labels: offered request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rate_label(rate) -> str:
    return "inf" if rate in ("inf", float("inf")) else f"{rate:g}/s"


def _title(run: dict) -> str:
    c = run["config"]
    return (f"{c['workload']}: {run['metrics']['num_requests']} requests, rate "
            f"{_rate_label(c['request_rate'])}, max concurrency {c['max_concurrency'] or '-'}")  # fmt: skip


def plot_all(result: dict, prefix: Path) -> list[Path]:
    """Every plot of a result (one pair per run, plus the sweep plot); [] without matplotlib."""
    plt = load_pyplot()
    if plt is None:
        return []
    paths = []
    runs = result["runs"]
    for run in runs:
        tag = (
            ""
            if len(runs) == 1
            else f"_rate{_rate_label(run['config']['request_rate']).replace('/s', '')}"
        )
        paths.append(plot_latencies(run, Path(f"{prefix}{tag}_latency.png"), plt))
        paths.append(plot_timeline(run, Path(f"{prefix}{tag}_timeline.png"), plt))
    if len(runs) > 1:
        paths.append(plot_sweep(runs, Path(f"{prefix}_sweep.png"), plt))
    return paths
