"""The load generator's multiplexed gRPC mode: every request shares one long-lived
``GenerateBatched`` call per channel, as a router or a batch client would use the daemon.

Where the default mode opens one call per request (one gRPC message per request per token on
both sides), here each channel carries one call, requests are started and cancelled in band,
and each server message packs the frames of one engine step for every request of that call.
Timestamps are taken when the message holding a frame arrives.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from bench.loadgen_client import ChannelPool, RecordFiller, start_frame
from bench.loadgen_metrics import RequestRecord
from bench.workloads import WorkloadRequest
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


class _MuxCall:
    """One GenerateBatched call: a queue of frames to send, and a reader that routes every
    received frame to its request's filler."""

    def __init__(self, stub, metadata, t0: float) -> None:
        self.t0 = t0
        self.outgoing: asyncio.Queue[pb.GenerateRequest | None] = asyncio.Queue()
        self.pending: dict[str, tuple[RecordFiller, asyncio.Future]] = {}
        self.call = stub.GenerateBatched(self._frames(), metadata=metadata)
        self.reader = asyncio.create_task(self._read())

    async def _frames(self):
        while (frame := await self.outgoing.get()) is not None:
            yield frame

    async def _read(self) -> None:
        try:
            async for batch in self.call:
                now = time.perf_counter() - self.t0
                for frame in batch.frames:
                    entry = self.pending.get(frame.request_id)
                    if entry is not None and entry[0].on_frame(frame, now):
                        del self.pending[frame.request_id]
                        entry[1].set_result(None)
        except grpc.aio.AioRpcError as e:
            now = time.perf_counter() - self.t0
            for filler, _ in self.pending.values():
                filler.on_rpc_error(e, now)
        for _, done in self.pending.values():  # the call ended: nothing more will come
            if not done.done():
                done.set_result(None)
        self.pending.clear()

    async def send(self, frame: pb.GenerateRequest, record: RequestRecord) -> None:
        filler = RecordFiller(record)
        done = asyncio.get_running_loop().create_future()
        if self.reader.done():
            record.end_s = time.perf_counter() - self.t0
            record.error_code, record.error_message = "STREAM_CLOSED", "the shared call ended"
            return
        self.pending[frame.start.request_id] = (filler, done)
        record.start_s = time.perf_counter() - self.t0
        self.outgoing.put_nowait(frame)
        await done
        filler.close(time.perf_counter() - self.t0)

    async def close(self) -> None:
        self.outgoing.put_nowait(None)
        try:
            await asyncio.wait_for(self.reader, 10)
        except asyncio.TimeoutError:
            self.call.cancel()


class MuxPool(ChannelPool):
    """ChannelPool's surface; requests go round robin over one shared call per channel."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self._calls: list[_MuxCall] = []
        self._t0: float | None = None

    async def send(self, request_id: str, req: WorkloadRequest, sampling: pb.SamplingParams,
                   record: RequestRecord, t0: float, timeout_s: float | None) -> None:  # fmt: skip
        if self._t0 != t0:  # a new run (a sweep's next rate): fresh calls on the same channels
            await self._close_calls()
            self._t0 = t0
            self._calls = [_MuxCall(stub, self.metadata, t0) for stub in self.stubs]
        self._next = (self._next + 1) % len(self._calls)
        call = self._calls[self._next]
        frame = start_frame(request_id, req, sampling, self.cache_salt)
        if timeout_s is not None:
            frame.start.time_limit_ms = int(timeout_s * 1e3)  # in band: the call is shared
        await call.send(frame, record)

    async def _close_calls(self) -> None:
        for call in self._calls:
            await call.close()
        self._calls = []

    async def close(self) -> None:
        await self._close_calls()
        await super().close()
