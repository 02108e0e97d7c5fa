"""A real PageddServer on a free local port, on its own event loop thread, and a bidi client."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pydaemon.engine.inproc_client import InprocEngineClient
from pydaemon.entrypoints.daemon.app import PageddServer, ServerOptions
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc


class ServerThread:
    def __init__(self, options: ServerOptions | None = None, notifier=None) -> None:
        self.options = options or ServerOptions(port=0)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server: PageddServer = self.call(self._make(notifier))
        self.channel: grpc.Channel | None = None

    async def _make(self, notifier) -> PageddServer:
        return PageddServer(self.options, notifier)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def listen(self) -> int:
        return self.call(self.server.listen())

    def start(self, engine_factory: Callable, timeout: float = 60.0) -> ServerThread:
        """Serves the engine ``engine_factory`` builds through an in-process InprocEngineClient."""
        self.call(self.server.start(lambda: InprocEngineClient.load(engine_factory)), timeout)
        return self

    def start_async(self, engine_factory: Callable):
        factory = lambda: InprocEngineClient.load(engine_factory)  # noqa: E731
        return asyncio.run_coroutine_threadsafe(self.server.start(factory), self.loop)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stub(self, **channel_kwargs) -> pb_grpc.GenerationStub:
        if self.channel is None:
            self.channel = grpc.insecure_channel(self.address, **channel_kwargs)
        return pb_grpc.GenerationStub(self.channel)

    def stats(self):
        """Fresh EngineStats, read by the engine thread."""
        return self.call(self.server.async_engine.stats())

    def wait_all_blocks_free(self, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats.num_free_gpu_blocks == stats.num_gpu_blocks or time.monotonic() > deadline:
                return stats
            time.sleep(0.01)

    def drain(self, timeout: float = 60.0) -> None:
        self.call(self.server.drain(), timeout)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if not self.server.is_drained.is_set():
            try:
                self.drain()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        engine = self.server.async_engine
        if engine is not None and engine.is_alive:
            # A drain that failed must not leave the engine thread stepping the shared demo
            # engine under the next test's server.
            self.call(engine.shutdown(), 60)
        # The loop's default executor ran the engine's load and the chat rendering: its worker
        # threads outlived every server (128 idle threads after tests/server, issue 55).
        with contextlib.suppress(Exception):
            self.call(self.loop.shutdown_default_executor(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()
        # grpc keeps the servicer alive past the loop: drop the engine ourselves
        self.server.servicer.engine = None
        self.server.async_engine = None


@dataclass
class BidiClient:
    """One Generate call; frames are sent from a queue so a test can send them over time."""

    stub: pb_grpc.GenerationStub
    timeout: float | None = 30.0
    metadata: tuple | None = None
    batched: bool = False  # GenerateBatched: frames arrive packed, batch_sizes records how
    _queue: queue.Queue = field(default_factory=queue.Queue)
    batch_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        rpc = self.stub.GenerateBatched if self.batched else self.stub.Generate
        self.rpc = rpc(iter(self._queue.get, None), timeout=self.timeout, metadata=self.metadata)
        self.call = self._unpacked() if self.batched else self.rpc

    def _unpacked(self):
        for batch in self.rpc:
            self.batch_sizes.append(len(batch.frames))
            yield from batch.frames

    def start(self, request_id: str, prompt: str | list[int] | None = None, **kw) -> BidiClient:
        sampling = kw.pop("sampling", None) or pb.SamplingParams()
        start = pb.StartRequest(request_id=request_id, sampling=sampling, **kw)
        if isinstance(prompt, str):
            start.text = prompt
        elif prompt is not None:
            start.token_ids.ids.extend(prompt)
        return self.send(pb.GenerateRequest(start=start))

    def cancel(self, request_id: str) -> BidiClient:
        return self.send(pb.GenerateRequest(cancel=pb.CancelRequest(request_id=request_id)))

    def send(self, frame: pb.GenerateRequest) -> BidiClient:
        self._queue.put(frame)
        return self

    def close_send(self) -> BidiClient:
        self._queue.put(None)
        return self

    def next(self) -> pb.GenerateResponse:
        return next(self.call)

    def collect(self) -> dict[str, list[pb.GenerateResponse]]:
        """All frames until the call ends, by request_id."""
        by_id: dict[str, list[pb.GenerateResponse]] = {}
        for frame in self.call:
            by_id.setdefault(frame.request_id, []).append(frame)
        return by_id


def joined_text(frames: list[pb.GenerateResponse], index: int = 0) -> str:
    return "".join(f.delta.text for f in frames if f.HasField("delta") and f.delta.index == index)


def joined_ids(frames: list[pb.GenerateResponse], index: int = 0) -> list[int]:
    return [
        t
        for f in frames
        if f.HasField("delta") and f.delta.index == index
        for t in f.delta.token_ids
    ]


def raw_generate(channel: grpc.Channel, frames: list[bytes], timeout: float = 30.0) -> list[bytes]:
    """One Generate call sending pre-serialised (possibly malformed) frames; the raw replies."""
    call = channel.stream_stream("/pagedd.v1.Generation/Generate")  # no (de)serializers: bytes
    return list(call(iter(frames), timeout=timeout))
