"""Load generator for a running pagedd daemon (a gRPC client of pagedd.v1.Generation).

    PYTHONPATH=. python bench/loadgen.py --server 127.0.0.1:50051 --workload w1 \\
        --request-rate 8 --slo ttft_ms=500,tpot_ms=50 --out bench/results/serve_w1.json
    PYTHONPATH=. python bench/loadgen.py --sweep-rates 2,4,8,16,inf --num-requests 200 ...

Each request is its own Generate call, spread over a pool of channels (one HTTP/2
connection each); with ``--protocol openai``, its own streamed POST /v1/completions (one
HTTP/1.1 connection each, see bench/loadgen_openai.py). Arrivals: all at once (default, ``--request-rate inf``), Poisson at a rate,
or gamma gaps with ``--burstiness``. Metrics follow vLLM's benchmark_serving (see
bench/loadgen_metrics.py). Prints a summary table; with ``--out FILE.json``, writes every
figure and every request's timings there and draws PNG plots next to it (when matplotlib is
installed). Without ``--out`` nothing is written: a run never lands in the repository's
curated ``bench/results/`` by itself. Workloads and W1: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import loadgen_client as client  # noqa: E402
from bench.loadgen_env import environment, write_json  # noqa: E402
from bench.loadgen_metrics import aggregate, parse_slo, timeseries  # noqa: E402
from bench.loadgen_report import summary_table, sweep_table  # noqa: E402
from bench.workloads import add_workload_flags, build_workload, summarize  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the daemon")
    p.add_argument("--protocol", choices=("grpc", "grpc-mux", "openai"), default="grpc",
                   help="gRPC Generate, one call per request (default); grpc-mux: every "
                        "request on one shared GenerateBatched call per channel (frames of "
                        "one engine step packed per message); or the OpenAI HTTP API "
                        "(--server is then the --http-port address; streamed "
                        "/v1/completions)")  # fmt: skip
    p.add_argument("--model", default=None,
                   help="model name for --protocol openai (default: the server's only model)")  # fmt: skip
    p.add_argument("--num-channels", type=int, default=8, help="gRPC channels (HTTP/2 connections)")
    p.add_argument("--api-key", default=None, help="bearer token (or $PAGEDD_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle: connect with TLS")
    p.add_argument("--wait-ready", type=float, default=0.0,
                   help="wait up to this many seconds for health SERVING before starting")  # fmt: skip
    p.add_argument("--timeout", type=float, default=None, help="gRPC deadline per request (s)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once; default inf)")  # fmt: skip
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 is Poisson, < 1 burstier, > 1 more regular")  # fmt: skip
    a.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    a.add_argument("--sweep-rates", default=None,
                   help="comma-separated rates (inf allowed): one run per rate and a sweep plot")  # fmt: skip
    a.add_argument("--seed", type=int, default=0, help="seed of the arrivals and synthetic prompts")
    add_workload_flags(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    s.add_argument("--no-ignore-eos", action="store_true",
                   help="stop at EOS (default: ignore it, so every request makes its output_len)")  # fmt: skip
    p.add_argument("--cache-salt", default="run",
                   help="prefix-cache salt sent with every request: 'run' (default) a fresh one "
                        "per run, so that no run (nor a sweep's next rate) reuses the cached "
                        "prompts of an earlier one; 'none' for no salt; else this text")  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None,
                   help="goodput targets, e.g. ttft_ms=500,tpot_ms=50 (keys: ttft_ms, tpot_ms, e2el_ms)")  # fmt: skip
    o.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report")
    o.add_argument(
        "--out",
        default=None,
        help="JSON file of every figure and request timing, with PNG plots beside it "
        "(default: none written, the summary table only)",
    )
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--status-interval", type=float, default=0.5,
                   help="poll GetServerStatus every this many seconds (0: never)")  # fmt: skip
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--quiet", action="store_true", help="no summary table")
    return p


def _rates(args: argparse.Namespace) -> list[float]:
    if not args.sweep_rates:
        return [args.request_rate]
    try:
        return [float(r) for r in args.sweep_rates.split(",") if r.strip()]
    except ValueError:
        raise ValueError(
            f"--sweep-rates must be numbers or inf (got {args.sweep_rates!r})"
        ) from None


async def _one_rate(pool, requests, sampling, args, rate: float, slo, percentiles, label) -> dict:
    if args.cache_salt == "run":
        pool.cache_salt = f"loadgen-{os.getpid()}-{time.time_ns()}"
    else:
        pool.cache_salt = None if args.cache_salt == "none" else args.cache_salt
    before = await pool.status()
    samples: list[dict] = []
    t0 = time.perf_counter()
    poller = (asyncio.create_task(client.poll_status(pool, args.status_interval, t0, samples))
              if args.status_interval > 0 else None)  # fmt: skip
    progress = client.Progress(len(requests), label, enabled=not args.no_progress)
    records, duration = await client.run_load(
        pool, requests, sampling, rate=rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, timeout_s=args.timeout,
        progress=progress,
    )  # fmt: skip
    if poller is not None:
        poller.cancel()
    after = await pool.status()
    run = {
        "config": {
            "workload": args.workload,
            "request_rate": rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "num_channels": args.num_channels,
            "protocol": args.protocol,
        },  # fmt: skip
        "metrics": aggregate(records, duration, slo, percentiles),
        "timeseries": timeseries(records, duration),
        "server_status_samples": samples,
        "requests": [r.to_json() for r in records],
    }
    if before and after:
        run["server_delta"] = {k: after[k] - before[k] for k in
                               ("num_preemptions", "prefix_cache_hit_tokens",
                                "prefix_cache_query_tokens", "num_prompt_tokens",
                                "num_generation_tokens")}  # fmt: skip
    if samples:
        run["peak_kv_blocks_used"] = max(
            s["num_gpu_blocks"] - s["num_free_gpu_blocks"] for s in samples
        )
    return run


async def run(args: argparse.Namespace) -> dict:
    slo = parse_slo(args.slo)
    percentiles = tuple(float(q) for q in args.percentiles.split(","))
    rates = _rates(args)
    options = client.ClientOptions(args.server, args.num_channels,
                                   args.api_key or os.environ.get("PAGEDD_API_KEY"),
                                   args.tls_ca, args.timeout)  # fmt: skip
    if args.protocol == "openai":
        from bench.loadgen_openai import OpenAIPool

        pool = OpenAIPool(options, model=args.model)
    elif args.protocol == "grpc-mux":
        from bench.loadgen_mux import MuxPool

        pool = MuxPool(options)
    else:
        pool = client.ChannelPool(options)
    try:
        if args.wait_ready > 0:
            await pool.wait_ready(args.wait_ready)
        info = await pool.info()
        requests = build_workload(args, vocab_size=info.get("vocab_size") or None,
                                  max_model_len=info.get("max_model_len") or None)  # fmt: skip
        sampling = pool.sampling(args.temperature, not args.no_ignore_eos)
        result = {
            "meta": {
                **environment(),
                "server": args.server,
                "protocol": args.protocol,
                "model_info": info,
                "benchmark": "loadgen",
            },  # fmt: skip
            "workload": {
                "name": args.workload,
                **summarize(requests),
                "temperature": args.temperature,
                "ignore_eos": not args.no_ignore_eos,
            },  # fmt: skip
            "runs": [],
        }
        for i, rate in enumerate(rates):
            label = f"rate {rate:g}" + (f" ({i + 1}/{len(rates)})" if len(rates) > 1 else "")
            result["runs"].append(
                await _one_rate(pool, requests, sampling, args, rate, slo, percentiles, label)
            )
        return result
    finally:
        await pool.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except (ValueError, TimeoutError, OSError) as e:
        print(f"loadgen: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"loadgen: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    if not args.quiet:
        for r in result["runs"]:
            print(summary_table(r))
        if len(result["runs"]) > 1:
            print(sweep_table(result["runs"]))
    if args.out is None:
        print("(--out FILE.json keeps every figure and request timing, and plots)", file=sys.stderr)
    else:
        out = Path(args.out)
        if argv is not None:
            result["meta"]["command"] = shlex.join([sys.executable, "bench/loadgen.py", *argv])
        write_json(out, result)
        print(f"wrote {out}", file=sys.stderr)
    if args.out is not None and not args.no_plots:
        from bench.loadgen_plots import plot_all

        for path in plot_all(result, out.with_suffix("")):
            print(f"wrote {path}", file=sys.stderr)
    failed = sum(r["metrics"]["failed"] for r in result["runs"])
    return 1 if failed == sum(r["metrics"]["num_requests"] for r in result["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
