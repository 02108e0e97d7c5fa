"""Soak: many requests over many streams with random cancels, deadlines, disconnects, n > 1,
beam search and shared prefixes; asserts zero lost requests, zero leaked KV blocks and bounded
daemon RSS, and writes a JSON report.

    PYTHONPATH=. python bench/soak.py --num-requests 2000 --out soak.json   # spawns the demo daemon
    PYTHONPATH=. python bench/soak.py --server 127.0.0.1:50051 --daemon-pid PID --num-requests 10000

Exit status 0 when every check passed, 1 otherwise (the report says which failed). RSS is read
from /proc/PID/status (spawned daemon, or --daemon-pid); it is judged from the point where a
fifth of the requests are done (allocators and caches warm) to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen_env import environment  # noqa: E402
from bench.soak_streams import Ledger, SoakShape, StreamPlan, run_stream  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=None, help="HOST:PORT of a running daemon (default: "
                   "spawn `pagedd serve --model demo --device cpu` on a free port)")  # fmt: skip
    p.add_argument("--serve-args", default="--num-kv-blocks 512 --swap-space 0.25",
                   help="extra `pagedd serve` flags for the spawned daemon")  # fmt: skip
    p.add_argument("--daemon-pid", type=int, default=None, help="PID whose RSS to watch")
    p.add_argument("--api-key", default=os.environ.get("PAGEDD_API_KEY"))
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--max-requests-per-stream", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32, help="streams open at once")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds for the daemon to be idle with every block free at the end")  # fmt: skip
    p.add_argument("--out", default=None, help="write the JSON report here")
    return p.parse_args(argv)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def spawn_daemon(serve_args: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pydaemon", "serve", "--model", "demo", "--device", "cpu",
           "--port", str(port), "--log-level", "warning", *serve_args.split()]  # fmt: skip
    # The repo first, then the caller's path (packages carried beside the interpreter's).
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL)
    return proc, f"127.0.0.1:{port}"


async def wait_serving(channel: grpc.aio.Channel, timeout_s: float) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True)
    async for reply in call:
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            call.cancel()
            return


async def wait_idle(stub, metadata, timeout_s: float) -> pb.ServerStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        s = await stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=metadata, timeout=10)
        idle = s.num_running == s.num_waiting == s.num_swapped == 0
        if (idle and s.num_free_gpu_blocks == s.num_gpu_blocks) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


async def soak(args: argparse.Namespace, target: str, pid: int | None) -> dict:
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
    channel = grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    await wait_serving(channel, 300)
    stub = pb_grpc.GenerationStub(channel)
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
    before = await stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=metadata, timeout=10)
    rng = random.Random(args.seed)
    shape = SoakShape(vocab_size=info.vocab_size, max_tokens=args.max_tokens)
    prefixes = [[rng.randrange(3, info.vocab_size) for _ in range(shape.prefix_len)]
                for _ in range(shape.num_prefixes)]  # fmt: skip
    plans, remaining = [], args.num_requests
    while remaining:
        k = min(remaining, rng.randint(1, args.max_requests_per_stream))
        plans.append(StreamPlan(len(plans), k, shape, rng, prefixes))
        remaining -= k
    ledger = Ledger()
    rss = {"start": rss_mib(pid), "samples": []}
    semaphore = asyncio.Semaphore(args.concurrency)
    warm_mark = args.num_requests // 5

    async def one(plan: StreamPlan) -> None:
        async with semaphore:
            await run_stream(stub, plan, ledger, metadata)
        if "after_warmup" not in rss and ledger.num_sent >= warm_mark:
            rss["after_warmup"] = rss_mib(pid)

    async def sample_rss() -> None:
        while True:
            rss["samples"].append(rss_mib(pid))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_rss())
    t0 = time.monotonic()
    await asyncio.gather(*(one(p) for p in plans))
    elapsed = time.monotonic() - t0
    final = await wait_idle(stub, metadata, args.drain_timeout)
    sampler.cancel()
    health = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    await channel.close()
    rss["end"] = rss_mib(pid)
    samples = [s for s in rss.pop("samples") if s is not None]
    rss["peak"] = max(samples, default=None)
    growth = (rss["end"] - rss["after_warmup"]) if rss.get("after_warmup") and rss["end"] else None
    internal = {k: v for k, v in ledger.outcomes.items() if k == "error:INTERNAL"}
    checks = {
        "zero_lost_requests": not ledger.losses,
        "zero_internal_errors": not internal,
        "zero_leaked_blocks": final.num_free_gpu_blocks == final.num_gpu_blocks,
        "idle_at_end": final.num_running == final.num_waiting == final.num_swapped == 0,
        "serving_at_end": health.status == health_pb2.HealthCheckResponse.SERVING,
        "bounded_rss": growth is None or growth <= args.max_rss_growth_mib,
    }
    return {
        "meta": environment(),
        "checks": checks,
        "passed": all(checks.values()),
        "num_requests": ledger.num_sent,
        "num_streams": len(plans),
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(ledger.num_sent / elapsed, 1),
        "completion_tokens": ledger.num_tokens,
        "outcomes": dict(sorted(ledger.outcomes.items())),
        "request_kinds": dict(sorted(ledger.by_kind.items())),
        "call_statuses": dict(sorted(ledger.call_statuses.items())),
        "losses": ledger.losses[:50],
        "num_losses": len(ledger.losses),
        "kv_blocks": {"total": final.num_gpu_blocks, "free_at_end": final.num_free_gpu_blocks},
        "preemptions": final.num_preemptions - before.num_preemptions,
        "rss_mib": {**rss, "growth_after_warmup": growth, "limit": args.max_rss_growth_mib},
        "model": info.model_name,
        "target": target,
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    target, pid = args.server, args.daemon_pid
    if target is None:
        proc, target = spawn_daemon(args.serve_args)
        pid = proc.pid
    try:
        report = asyncio.run(soak(args, target, pid))
        if proc is not None:
            proc.terminate()
            report["checks"]["clean_exit"] = proc.wait(60) == 0
            report["passed"] = all(report["checks"].values())
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
