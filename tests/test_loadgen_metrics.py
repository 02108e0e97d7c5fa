"""Load-generator metrics against streams with known timestamps (vLLM benchmark definitions)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # bench/ is imported as a package from the repository root
    sys.path.insert(0, REPO_ROOT)

from bench import loadgen_client as client  # noqa: E402
from bench.loadgen_metrics import (  # noqa: E402
    RequestRecord,
    aggregate,
    meets_slo,
    parse_slo,
    percentile,
    timeseries,
)
from bench.workloads import WorkloadRequest  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb  # noqa: E402


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeCall:
    """A server stream: each item is (time at which the frame arrives, frame)."""

    def __init__(self, clock: FakeClock, frames: list[tuple[float, pb.GenerateResponse]]) -> None:
        self.clock, self.frames = clock, frames

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for t, frame in self.frames:
            self.clock.t = t
            yield frame


class FakePool:
    metadata = None

    def __init__(self, call: FakeCall) -> None:
        self.call = call
        self.sent: list[pb.GenerateRequest] = []

    def stub(self):
        pool = self

        class Stub:
            def Generate(self, frames, timeout=None, metadata=None):  # noqa: N802 - gRPC name
                pool.sent.extend(frames)
                return pool.call

        return Stub()


def delta(ids: list[int]) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", delta=pb.TokenDelta(token_ids=ids, text="x"))


def finished(completion_tokens: int, prompt_tokens: int = 5) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id="r",
        finished=pb.Finished(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
        ),
    )


def _stream(
    monkeypatch, frames, prompt=(1, 2, 3, 4, 5), output_len=4
) -> tuple[RequestRecord, FakePool]:
    clock = FakeClock(100.0)  # the request is sent at t = 100.0 (t0 = 99.0)
    monkeypatch.setattr(client.time, "perf_counter", clock)
    pool = FakePool(FakeCall(clock, frames))
    req = WorkloadRequest(list(prompt), output_len)
    record = RequestRecord(0, req.prompt_len, output_len)
    frame = client.start_frame("r", req, pb.SamplingParams(temperature=0, ignore_eos=True))
    asyncio.run(client.run_one(pool, frame, record, 99.0, None))
    return record, pool


def test_timings_from_a_stream_with_known_timestamps(monkeypatch):
    frames = [
        (100.5, delta([7])),
        (100.6, delta([8, 9])),
        (100.9, delta([10])),
        (101.0, finished(4)),
    ]
    record, pool = _stream(monkeypatch, frames)
    sent = pool.sent[0].start
    assert list(sent.token_ids.ids) == [1, 2, 3, 4, 5] and sent.sampling.max_tokens == 4
    assert sent.sampling.ignore_eos and sent.sampling.temperature == 0
    assert record.start_s == pytest.approx(1.0)
    assert record.ttft_s == pytest.approx(0.5)
    assert record.latency_s == pytest.approx(1.0)
    assert record.tpot_s == pytest.approx((1.0 - 0.5) / (4 - 1))
    assert record.itls_s == pytest.approx([0.1, 0.3])  # gaps between chunks, not tokens
    assert record.chunk_num_tokens == [1, 2, 1] and record.num_output_tokens == 4
    assert record.finish_reason == "length" and record.is_success
    j = record.to_json()
    assert j["ttft_ms"] == pytest.approx(500) and j["e2el_ms"] == pytest.approx(1000)
    assert j["chunk_times_s"] == pytest.approx([1.5, 1.6, 1.9])


def test_in_band_error_and_missing_finished_frame(monkeypatch):
    err = pb.GenerateResponse(request_id="r", error=pb.RequestError(code=3, message="too long"))
    record, _ = _stream(monkeypatch, [(100.2, err)])
    assert record.error_code == "INVALID_ARGUMENT" and record.error_message == "too long"
    assert not record.is_success and record.latency_s == pytest.approx(0.2)
    record, _ = _stream(monkeypatch, [(100.2, delta([1]))])
    assert record.error_code == "NO_FINISHED_FRAME"


def _record(i, start, chunks, end, n=None, error=None) -> RequestRecord:
    return RequestRecord(
        index=i, prompt_len=10, requested_output_len=4, scheduled_s=start, start_s=start,
        chunk_times_s=[t for t, _ in chunks], chunk_num_tokens=[k for _, k in chunks],
        end_s=end, num_output_tokens=sum(k for _, k in chunks) if n is None else n,
        error_code=error,
    )  # fmt: skip


def test_aggregate_figures():
    a = _record(0, 0.0, [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)], 0.4)  # ttft 100, tpot 100
    b = _record(1, 0.5, [(1.0, 1), (1.2, 3)], 1.5)  # ttft 500, tpot (1000-500)/3
    c = _record(2, 0.6, [], 0.7, error="RESOURCE_EXHAUSTED")
    m = aggregate([a, b, c], duration_s=2.0, slo=parse_slo("ttft_ms=200,tpot_ms=150"))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["errors_by_status"] == {"RESOURCE_EXHAUSTED": 1}
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(14.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(300) and m["ttft_ms"]["median"] == pytest.approx(
        300
    )
    assert m["ttft_ms"]["p90"] == pytest.approx(100 + 0.9 * 400)
    assert m["tpot_ms"]["mean"] == pytest.approx((100 + 500 / 3) / 2)
    assert m["itl_ms"]["count"] == 4 and m["itl_ms"]["max"] == pytest.approx(200)
    assert m["e2el_ms"]["median"] == pytest.approx((400 + 1000) / 2)
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(0.5)  # b misses TTFT


def test_percentile_matches_linear_interpolation():
    rng = random.Random(1)
    values = [rng.random() for _ in range(37)]
    s = sorted(values)
    assert percentile(values, 0) == s[0] and percentile(values, 100) == s[-1]
    assert percentile(values, 50) == pytest.approx(statistics.median(values))
    pos = 36 * 0.99
    assert percentile(values, 99) == pytest.approx(s[35] + (s[36] - s[35]) * (pos - 35))
    assert math.isnan(percentile([], 50))


def test_slo_parsing_and_one_token_requests():
    assert parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    for bad in ("ttft=5", "ttft_ms", "tpot_ms=abc", "e2el_ms=-1"):
        with pytest.raises(ValueError, match="bad SLO"):
            parse_slo(bad)
    one = _record(0, 0.0, [(0.1, 1)], 0.1)
    assert one.tpot_s is None and meets_slo(one, {"tpot_ms": 1.0, "ttft_ms": 200})
    assert not meets_slo(one, {"ttft_ms": 50})


def test_timeseries_bins_tokens_and_concurrency():
    a = _record(0, 0.0, [(0.25, 2), (0.75, 1)], 1.0)
    b = _record(1, 0.5, [(1.5, 4)], 2.0)
    ts = timeseries([a, b], duration_s=2.0, bin_s=0.5)
    assert ts["output_tokens_per_s"] == pytest.approx([4.0, 2.0, 0.0, 8.0])
    assert ts["requests_in_flight"] == pytest.approx([1.0, 2.0, 1.0, 1.0])


def test_arrival_processes():
    assert client.arrival_offsets(4, float("inf"), 1.0, 0) == [0.0] * 4
    poisson = client.arrival_offsets(4000, 20.0, 1.0, seed=3)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert poisson[0] == 0.0 and poisson == client.arrival_offsets(4000, 20.0, 1.0, seed=3)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20, rel=0.08)  # exponential: sd = mean
    bursty = client.arrival_offsets(4000, 20.0, 0.25, seed=3)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.fmean(bgaps) == pytest.approx(1 / 20, rel=0.1)
    assert statistics.pstdev(bgaps) == pytest.approx(1 / 20 / 0.25**0.5, rel=0.15)  # gamma sd
    with pytest.raises(ValueError):
        client.arrival_offsets(3, 0.0, 1.0, 0)
