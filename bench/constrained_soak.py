"""Constrained requests under a grammar bomb (issue 55, item 6): while one client keeps asking
for grammars that take many seconds to compile, how long do the others' small constrained
requests take, end to end?

    PYTHONPATH=. python bench/constrained_soak.py --duration 120 --out soak_constrained.json

Spawns `pagedd serve --model demo --device cpu` (or --server HOST:PORT). ``--clients`` gRPC
streams (default 24) each send, one after another, small JSON-schema requests of their own
(--schemas-per-client distinct schemas each, cycled: each compiles once, with 0 every request
compiles) and time each from the start frame to its last frame; one more stream sends grammars of thousands of
``[a-z]*`` (each a new one: ~10 s or more to compile on a 2-core CPU, stopped at the daemon's
--structured-outputs-compile-timeout). Exit status 0 when every small request finished and the
slowest took under --max-latency-s (5 s, the issue's bound), else 1; the JSON says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen_env import environment  # noqa: E402
from bench.soak import spawn_daemon, wait_serving  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=None, help="HOST:PORT of a running daemon (default: "
                   "spawn the demo daemon on the CPU)")  # fmt: skip
    p.add_argument("--serve-args", default="--num-kv-blocks 512 --structured-outputs-compile-timeout 20",
                   help="extra `pagedd serve` flags for the spawned daemon")  # fmt: skip
    p.add_argument("--clients", type=int, default=24, help="streams of small requests")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--bomb-size", type=int, default=9300, help="[a-z]* terms per slow grammar")
    p.add_argument("--schemas-per-client", type=int, default=3,
                   help="each client cycles through this many schemas of its own (compiled "
                   "once each, then served from the grammar cache); 0: a new one every request")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--max-latency-s", type=float, default=5.0)
    p.add_argument("--out", default=None, help="write the JSON report here")
    return p.parse_args(argv)


def _small_schema(client: int, n: int) -> str:
    """A schema no earlier request used (so each one compiles)."""
    return json.dumps({
        "type": "object",
        "properties": {f"c{client}_{n}": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": [f"c{client}_{n}"],
    })  # fmt: skip


def _start(request_id: str, constraint: pb.StructuredOutput, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        start=pb.StartRequest(
            request_id=request_id,
            text="Answer in JSON:",
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            structured_output=constraint,
        )
    )


async def _one(stub, frame: pb.GenerateRequest, timeout_s: float) -> tuple[str, float]:
    """Sends one request on its own stream -> (outcome, seconds to its last frame)."""
    start = time.monotonic()
    outcome = "lost"

    async def frames():
        yield frame

    try:
        async for reply in stub.Generate(frames(), timeout=timeout_s):
            if reply.HasField("finished"):
                outcome = "finished"
            elif reply.HasField("error"):
                outcome = f"error:{reply.error.code}"
    except grpc.aio.AioRpcError as e:
        outcome = f"rpc:{e.code().name}"
    return outcome, time.monotonic() - start


async def _small_client(stub, client: int, args, stop_at: float, results: list) -> None:
    n = 0
    while time.monotonic() < stop_at:
        k = n % args.schemas_per_client if args.schemas_per_client > 0 else n
        constraint = pb.StructuredOutput(json_schema=_small_schema(client, k))
        outcome, seconds = await _one(
            stub, _start(f"s{client}-{n}", constraint, args.max_tokens), 120
        )
        results.append({"client": client, "outcome": outcome, "latency_s": seconds,
                        "at_s": stop_at - time.monotonic()})  # fmt: skip
        n += 1


async def _bomb_client(stub, args, stop_at: float, results: list) -> None:
    n = 0
    while time.monotonic() < stop_at:
        grammar = "root ::= " + " ".join(["[a-z]*"] * (args.bomb_size + n))  # a new one each time
        frame = _start(f"bomb-{n}", pb.StructuredOutput(grammar=grammar), args.max_tokens)
        outcome, seconds = await _one(stub, frame, 300)
        results.append({"outcome": outcome, "latency_s": seconds})
        n += 1


async def run(args: argparse.Namespace, target: str) -> dict:
    channel = grpc.aio.insecure_channel(target)
    await wait_serving(channel, 300)
    stub = pb_grpc.GenerationStub(channel)
    # Warm: the compile server starts with the first constrained request (~3 s of imports).
    await _one(stub, _start("warm", pb.StructuredOutput(json_schema=_small_schema(-1, 0)), 4), 120)
    small: list[dict] = []
    bombs: list[dict] = []
    stop_at = time.monotonic() + args.duration
    await asyncio.gather(
        _bomb_client(stub, args, stop_at, bombs),
        *(_small_client(stub, c, args, stop_at, small) for c in range(args.clients)),
    )
    await channel.close()
    latencies = [r["latency_s"] for r in small]
    outcomes = Counter(r["outcome"] for r in small)
    slowest = max(latencies) if latencies else None
    checks = {
        "every_small_request_finished": bool(small) and outcomes["finished"] == len(small),
        f"slowest_small_under_{args.max_latency_s:g}_s": slowest is not None
        and slowest < args.max_latency_s,
        "bombs_were_sent": bool(bombs),
    }
    return {
        "small": {
            "count": len(small),
            "outcomes": dict(outcomes),
            "latency_p50_s": statistics.median(latencies) if latencies else None,
            "latency_p99_s": sorted(latencies)[int(0.99 * (len(latencies) - 1))]
            if latencies
            else None,
            "latency_max_s": slowest,
        },
        "bombs": {
            "count": len(bombs),
            "outcomes": dict(Counter(b["outcome"] for b in bombs)),
            "latency_s": [round(b["latency_s"], 2) for b in bombs],
        },  # fmt: skip
        "checks": checks,
        "passed": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    target = args.server
    if target is None:
        proc, target = spawn_daemon(args.serve_args)
    try:
        report = asyncio.run(run(args, target))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    report = {"environment": environment(), "args": vars(args), **report}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("small", "checks", "passed")}, indent=1))
    print(json.dumps({"bombs": {k: v for k, v in report["bombs"].items() if k != "latency_s"}}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
