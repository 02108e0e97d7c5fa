"""The load generator's gRPC side: a channel pool, arrival processes, one Generate call per
request, timestamps of every streamed chunk, and a poller of the server's live counters.
(bench/loadgen_openai.py is the same through the OpenAI HTTP API.)"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen_metrics import RequestRecord
from bench.workloads import WorkloadRequest
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc

STATUS_FIELDS = ("num_running", "num_waiting", "num_swapped", "num_gpu_blocks",
                 "num_free_gpu_blocks", "kv_waste_slots", "num_preemptions",
                 "prefix_cache_query_tokens", "prefix_cache_hit_tokens",
                 "num_prompt_tokens", "num_generation_tokens")  # fmt: skip


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start): all at 0 for an infinite rate, else gamma-distributed
    gaps of mean 1/rate and shape ``burstiness`` (1 is Poisson; < 1 burstier, > 1 smoother).
    The first request leaves at 0, as in vLLM's benchmark."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive (got {rate}, {burstiness})")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


@dataclass
class ClientOptions:
    target: str = "127.0.0.1:50051"
    num_channels: int = 8
    api_key: str | None = None
    tls_ca: str | None = None
    timeout_s: float | None = None  # gRPC deadline per request


class ChannelPool:
    """``num_channels`` channels, each its own HTTP/2 connection (a local subchannel pool:
    channels with equal arguments would otherwise share one connection), used round robin."""

    def __init__(self, options: ClientOptions) -> None:
        if options.num_channels < 1:
            raise ValueError(f"num_channels must be >= 1 (got {options.num_channels})")
        args = [("grpc.use_local_subchannel_pool", 1),
                ("grpc.max_receive_message_length", 64 << 20)]  # fmt: skip
        creds = None
        if options.tls_ca:
            with open(options.tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(f.read())
        self.channels = [
            grpc.aio.secure_channel(options.target, creds, options=args)
            if creds
            else grpc.aio.insecure_channel(options.target, options=args)
            for _ in range(options.num_channels)
        ]
        self.stubs = [pb_grpc.GenerationStub(c) for c in self.channels]
        self.metadata = (
            (("authorization", f"Bearer {options.api_key}"),) if options.api_key else None
        )
        self._next = 0
        self.cache_salt: str | None = None  # set per run by loadgen.py (--cache-salt)

    def stub(self) -> pb_grpc.GenerationStub:
        self._next = (self._next + 1) % len(self.stubs)
        return self.stubs[self._next]

    # The surface run_load and loadgen.py use; bench/loadgen_openai.py's OpenAIPool has it too.

    @staticmethod
    def sampling(temperature: float, ignore_eos: bool) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=temperature, ignore_eos=ignore_eos)

    async def send(self, request_id: str, req: WorkloadRequest, sampling: pb.SamplingParams,
                   record: RequestRecord, t0: float, timeout_s: float | None) -> None:  # fmt: skip
        frame = start_frame(request_id, req, sampling, self.cache_salt)
        await run_one(self, frame, record, t0, timeout_s)

    async def status(self) -> dict | None:
        return await server_status(self.stubs[0], self.metadata)

    async def info(self) -> dict:
        return await model_info(self)

    async def wait_ready(self, timeout_s: float) -> None:
        await wait_ready(self, timeout_s)

    async def close(self) -> None:
        for c in self.channels:
            await c.close()


def _status_name(code: int) -> str:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return f"CODE_{code}"


def start_frame(
    request_id: str,
    req: WorkloadRequest,
    sampling: pb.SamplingParams,
    cache_salt: str | None = None,
) -> pb.GenerateRequest:
    params = pb.SamplingParams()
    params.CopyFrom(sampling)
    params.max_tokens = req.output_len
    start = pb.StartRequest(request_id=request_id, sampling=params, cache_salt=cache_salt or "")
    if req.is_text:
        start.text = req.prompt
    else:
        start.token_ids.ids.extend(req.prompt)
    return pb.GenerateRequest(start=start)


async def run_one(pool: ChannelPool, frame: pb.GenerateRequest, record: RequestRecord,
                  t0: float, timeout_s: float | None) -> None:  # fmt: skip
    """Sends one request on its own call and fills ``record`` from the stream."""
    record.start_s = time.perf_counter() - t0
    call = pool.stub().Generate(iter([frame]), timeout=timeout_s, metadata=pool.metadata)
    filler = RecordFiller(record)
    try:
        async for msg in call:
            filler.on_frame(msg, time.perf_counter() - t0)
    except grpc.aio.AioRpcError as e:
        filler.on_rpc_error(e, time.perf_counter() - t0)
    filler.close(time.perf_counter() - t0)


class RecordFiller:
    """Fills one request's RequestRecord from its frames (times in s from the run's start)."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.num_streamed = 0

    def on_frame(self, msg: pb.GenerateResponse, now: float) -> bool:
        """Returns True for the request's terminal frame."""
        record = self.record
        event = msg.WhichOneof("event")
        if event == "delta":
            n = len(msg.delta.token_ids)
            if n:
                record.chunk_times_s.append(now)
                record.chunk_num_tokens.append(n)
                self.num_streamed += n
            return False
        if event == "finished":
            f = msg.finished
            record.end_s = now
            record.num_output_tokens = f.usage.completion_tokens or self.num_streamed
            record.num_cached_tokens = f.usage.cached_tokens
            if record.prompt_len is None:
                record.prompt_len = f.usage.prompt_tokens
            record.finish_reason = (
                pb.FinishReason.Name(f.finish_reason).removeprefix("FINISH_REASON_").lower()
            )
            record.server_timings_ms = {"queue_ms": f.timings.queue_ms,
                                        "ttft_ms": f.timings.time_to_first_token_ms,
                                        "total_ms": f.timings.total_ms}  # fmt: skip
            return True
        if event == "error":
            record.end_s = now
            record.error_code = _status_name(msg.error.code)
            record.error_message = msg.error.message
            return True
        return False

    def on_rpc_error(self, e: grpc.aio.AioRpcError, now: float) -> None:
        self.record.end_s = now
        self.record.error_code = e.code().name
        self.record.error_message = e.details() or ""

    def close(self, now: float) -> None:
        record = self.record
        if record.end_s is None:
            record.end_s = now
            record.error_code = "NO_FINISHED_FRAME"
            record.error_message = "the stream ended without a Finished frame"
        elif record.error_code is None and record.finish_reason in (
            "cancelled",
            "aborted",
            "time_limit",
        ):
            record.error_code = f"FINISHED_{record.finish_reason.upper()}"


class Progress:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = self.tokens = self.in_flight = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < 0.2):
            return
        self._last = now
        elapsed = now - self.start
        filled = 30 * self.done // max(1, self.total)
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
            f"({self.failed} failed) in flight {self.in_flight:4d} | "
            f"{self.tokens / max(elapsed, 1e-9):8.1f} tok/s | {elapsed:6.1f}s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(force=True)
            sys.stderr.write("\n")


async def run_load(
    pool,
    requests: list[WorkloadRequest],
    sampling,
    *,
    rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout_s: float | None = None,
    progress: Progress | None = None,
    on_tick: Callable[[float], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Runs every request under the arrival process; returns the records and the duration
    (first send to last terminal frame, in s). ``pool``: a ChannelPool (gRPC) or an
    OpenAIPool (HTTP); ``sampling``: what its ``sampling()`` built."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(i, r.prompt_len, r.output_len) for i, r in enumerate(requests)]
    run_id = f"lg{seed}-{int(time.time() * 1e3) % 10**9}"
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        records[i].scheduled_s = time.perf_counter() - t0
        if semaphore is not None:
            await semaphore.acquire()
        try:
            if progress:
                progress.in_flight += 1
            await pool.send(f"{run_id}-{i}", requests[i], sampling, records[i], t0, timeout_s)
        finally:
            if semaphore is not None:
                semaphore.release()
            if progress:
                progress.in_flight -= 1
                progress.done += 1
                progress.failed += not records[i].is_success
                progress.tokens += records[i].num_output_tokens
                progress.update()

    tasks = []
    for i, offset in enumerate(offsets):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    if progress:
        progress.close()
    starts = [r.start_s for r in records]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (max(ends) - min(starts)) if ends else 0.0
    return records, duration


async def server_status(channel_stub: pb_grpc.GenerationStub, metadata) -> dict | None:
    try:
        s = await channel_stub.GetServerStatus(
            pb.GetServerStatusRequest(), metadata=metadata, timeout=5
        )
    except grpc.aio.AioRpcError:
        return None
    return {name: getattr(s, name) for name in STATUS_FIELDS}


async def poll_status(pool, interval_s: float, t0: float, out: list[dict]) -> None:
    """Appends the server's counters every ``interval_s`` until cancelled."""
    while True:
        status = await pool.status()
        if status is not None:
            out.append({"time_s": time.perf_counter() - t0, **status})
        await asyncio.sleep(interval_s)


async def model_info(pool: ChannelPool) -> dict:
    info = await pool.stubs[0].GetModelInfo(
        pb.GetModelInfoRequest(), metadata=pool.metadata, timeout=10
    )
    out: dict = {}
    for f in pb.ModelInfo.DESCRIPTOR.fields:  # as JSON-ready values
        value = getattr(info, f.name)
        if f.message_type is not None:
            value = {g.name: v for g, v in value.ListFields()}
        elif not isinstance(value, (str, int, float, bool)):
            value = list(value)  # a repeated field
        out[f.name] = value
    return out


async def wait_ready(pool: ChannelPool, timeout_s: float) -> None:
    """Waits until grpc.health.v1 says SERVING, or raises TimeoutError."""
    stub = health_pb2_grpc.HealthStub(pool.channels[0])
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2,
                                    metadata=pool.metadata)  # fmt: skip
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as e:
            last = e.code().name
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the server was not SERVING within {timeout_s:.0f} s (last: {last})")
