"""The Generate and GenerateBatched calls: many requests on one bidirectional stream.

A reader task turns client frames into request tasks (one asyncio task per request, consuming
EngineClient.generate); every frame for the client goes through one queue to the single
writer (the handler coroutine itself). Every way a request can end early — cancel frame,
closed stream, expired deadline, time limit, stalled client, drain, an engine core that stalls
before the request's first output (it then ends UNAVAILABLE) — cancels its task, and the
task's cancellation aborts the engine request (freeing its blocks before the engine's next
step). If the engine-core process dies, every stream ends with UNAVAILABLE. A servicer mixes
this in (pydaemon/entrypoints/grpc/servicer.py) and provides ``engine``, ``options``,
``metrics``, ``is_admitting`` and ``lora_request_for``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from pydaemon.engine.engine_client import EngineClient, EngineCoreDiedError, EngineDeadError
from pydaemon.entrypoints.common.reasoning_parsers import (
    ReasoningStreams,
    apply_reasoning,
    chat_reasoning_parser,
    prompt_tail,
)
from pydaemon.entrypoints.grpc.admission import admit, check_chat_size, render_chat
from pydaemon.entrypoints.grpc.frames import RequestAccount, error_frame
from pydaemon.entrypoints.grpc.validation import EngineArgs, RequestInvalid, check_request_id
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)

ENGINE_STALLED = (
    "the engine core has stopped making progress (no step or heartbeat within the stall "
    "timeout): retry later or on another replica"
)
_READER_DONE = object()  # the client half-closed its side
_MAX_FRAMES_PER_WRITE = 4096  # a GenerateBatched message stays far below 4 MiB
# Frames a stream may hold for a client that reads slowly. Past this, its requests wait for
# the writer, and the engine client merges their deltas meanwhile (one growing delta per
# request, bounded by max_tokens) instead of this queue growing by a frame per token.
_MAX_BUFFERED_FRAMES = 2 * _MAX_FRAMES_PER_WRITE


@dataclass
class _StreamFatal:
    """A malformed stream: ends the call with this status."""

    code: grpc.StatusCode
    message: str


@dataclass
class _Live:
    account: RequestAccount
    engine_request_id: str
    task: asyncio.Task | None = None
    cancel_reason: int | None = None  # FinishReason reported when the task is cancelled
    failure: RequestInvalid | None = None  # cancelled to end with this error instead
    has_output: bool = False  # the engine has answered it at least once
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Stream:
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    live: dict[str, _Live] = field(default_factory=dict)  # client request_id -> request
    is_open: bool = True
    has_room: asyncio.Event = field(default_factory=asyncio.Event)  # out is below its bound


class GenerateCalls:
    """Mixed into the servicer, which sets ``engine``, ``options`` (ServingOptions),
    ``metrics``, ``is_admitting``, ``is_stalled`` and provides ``lora_request_for``
    (AdapterCalls)."""

    engine: EngineClient | None
    is_admitting: bool
    is_stalled: Callable[[], bool]  # the engine core missed its heartbeat (liveness.py)

    def init_streams(self) -> None:
        self._ids = itertools.count()
        self._streams: set[_Stream] = set()

    @property
    def num_live_requests(self) -> int:
        return sum(len(s.live) for s in self._streams)

    def abort_all(self, reason: int = pb.FINISH_REASON_ABORTED) -> None:
        for stream in list(self._streams):
            for live in list(stream.live.values()):
                self._cancel(live, reason)

    def fail_waiting(self) -> int:
        """The engine core stalled: every live request with no output yet ends UNAVAILABLE
        now (its stream lives on). -> how many."""
        waiting = [
            live
            for stream in self._streams
            for live in stream.live.values()
            if not live.has_output and live.failure is None
        ]
        for live in waiting:
            live.failure = RequestInvalid(grpc.StatusCode.UNAVAILABLE, ENGINE_STALLED)
            self._cancel(live, pb.FINISH_REASON_ABORTED)
        return len(waiting)

    # ---- Generate ----------------------------------------------------------------------

    async def Generate(self, request_iterator: AsyncIterator[pb.GenerateRequest], context):
        async def write(frames: list[pb.GenerateResponse]) -> None:
            for frame in frames:
                await context.write(frame)

        await self._serve_stream(request_iterator, context, write)

    async def GenerateBatched(self, request_iterator: AsyncIterator[pb.GenerateRequest], context):
        async def write(frames: list[pb.GenerateResponse]) -> None:
            await context.write(pb.GenerateResponseBatch(frames=frames))

        await self._serve_stream(request_iterator, context, write)

    async def _serve_stream(self, request_iterator, context, write) -> None:
        """The writer of one call: takes every item ready in the stream's queue at once (the
        frames of one engine step, typically) and hands the frames to ``write``."""
        stream = _Stream()
        stream.has_room.set()
        self._streams.add(stream)
        reader = asyncio.create_task(self._read(stream, request_iterator))
        reader_done = False
        try:
            while not (reader_done and not stream.live and stream.out.empty()):
                items = [await stream.out.get()]
                while not stream.out.empty() and len(items) < _MAX_FRAMES_PER_WRITE:
                    items.append(stream.out.get_nowait())
                if stream.out.qsize() < _MAX_BUFFERED_FRAMES:
                    stream.has_room.set()
                frames: list[pb.GenerateResponse] = []
                for item in items:
                    if item is _READER_DONE:
                        reader_done = True
                    elif isinstance(item, _StreamFatal):
                        await self._write(stream, context, write, frames)
                        frames = []
                        await self._end_stream(stream, context, item)
                    elif item is not None:
                        frames.append(item)
                await self._write(stream, context, write, frames)
        finally:
            stream.is_open = False
            reader.cancel()
            for live in list(stream.live.values()):
                self._cancel(live, pb.FINISH_REASON_CANCELLED)
            self._streams.discard(stream)

    async def _write(self, stream: _Stream, context, write, frames) -> None:
        if not frames or not stream.is_open:
            return
        try:
            await _with_timeout(write(frames), self.options.stall_timeout_s)
        except asyncio.TimeoutError:
            logger.warning(
                "client stopped reading for %.1f s: aborting its %d requests",
                self.options.stall_timeout_s,
                len(stream.live),
            )
            fatal = _StreamFatal(
                grpc.StatusCode.ABORTED,
                f"client stopped reading for {self.options.stall_timeout_s} s; "
                "its requests were aborted",
            )
            await self._end_stream(stream, context, fatal)

    async def _end_stream(self, stream: _Stream, context, fatal: _StreamFatal) -> None:
        stream.is_open = False
        for live in list(stream.live.values()):
            self._cancel(live, pb.FINISH_REASON_ABORTED)
        await context.abort(fatal.code, fatal.message)

    async def _read(self, stream: _Stream, request_iterator) -> None:
        try:
            await self._read_frames(stream, request_iterator)
        except asyncio.CancelledError:
            raise
        except DecodeError as e:  # an undecodable frame (bad UTF-8, garbage bytes)
            stream.out.put_nowait(
                _StreamFatal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a GenerateRequest frame could not be decoded: {e}",
                )
            )
        except Exception as e:  # noqa: BLE001 - the transport failed: the call is ending anyway
            logger.debug("reading the stream failed: %r", e)
            stream.out.put_nowait(_READER_DONE)

    async def _read_frames(self, stream: _Stream, request_iterator) -> None:
        async for frame in request_iterator:
            action = frame.WhichOneof("action")
            if action is None:
                stream.out.put_nowait(
                    _StreamFatal(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "a GenerateRequest frame has no action: set start or cancel",
                    )
                )
                return
            request_id = getattr(frame, action).request_id
            problem = check_request_id(request_id)
            if problem is not None:
                stream.out.put_nowait(
                    _StreamFatal(grpc.StatusCode.INVALID_ARGUMENT, f"{action}: {problem}")
                )
                return
            if action == "cancel":
                live = stream.live.get(request_id)
                if live is not None:
                    self._cancel(live, pb.FINISH_REASON_CANCELLED)
                continue
            if request_id in stream.live:
                stream.out.put_nowait(
                    _StreamFatal(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"request_id {request_id!r} is already live on this stream",
                    )
                )
                return
            self._start(stream, frame.start)
        stream.out.put_nowait(_READER_DONE)

    def _start(self, stream: _Stream, start: pb.StartRequest) -> None:
        request_id = start.request_id
        try:
            if start.WhichOneof("prompt") == "messages":
                # Rendering and tokenizing take long for a big conversation: they run off the
                # event loop, in the request's task; only the size is checked here.
                self._check_serving()
                check_chat_size(start, self.engine)
                args = None
            else:
                args = self._admit(start)
        except RequestInvalid as e:
            stream.out.put_nowait(error_frame(request_id, e.code, e.message))
            return
        account = RequestAccount(
            request_id,
            num_sequences=args.params.n if args else 1,
            max_tokens=args.params.max_tokens if args else None,
            tokenizer=self.engine.tokenizer,
        )
        live = _Live(account, f"{next(self._ids)}-{request_id}")
        stream.live[request_id] = live
        live.task = asyncio.create_task(self._run(stream, live, args or start))
        if args is not None:
            self._arm_time_limit(live, args)

    def _arm_time_limit(self, live: _Live, args: EngineArgs) -> None:
        if args.time_limit_s is not None:
            live.timer = asyncio.get_running_loop().call_later(
                args.time_limit_s, self._cancel, live, pb.FINISH_REASON_TIME_LIMIT
            )

    def _check_serving(self) -> None:
        if not self.is_admitting or self.engine is None or not self.engine.is_alive:
            raise RequestInvalid(
                grpc.StatusCode.UNAVAILABLE, "server is not serving (starting or draining)"
            )
        if self.is_stalled():  # fail fast: the request would wait for a core that is not moving
            raise RequestInvalid(grpc.StatusCode.UNAVAILABLE, ENGINE_STALLED)

    def _admit(self, start: pb.StartRequest) -> EngineArgs:
        self._check_serving()
        args = admit(start, self.engine, self.options.max_queued_requests)
        args.lora_request = self.lora_request_for(start.adapter)
        return args

    def _reasoning(self, account: RequestAccount, args: EngineArgs) -> None:
        """A chat request on a reasoning model: the account splits the outputs, the constraint
        waits for the answer (--reasoning-parser, or the harmony template's own)."""
        tokenizer = self.engine.tokenizer
        parser = chat_reasoning_parser(self.options.reasoning_parser, tokenizer)
        if parser is None or not isinstance(args.prompt, list):
            return
        tail = prompt_tail(tokenizer, args.prompt)
        account.reasoning = ReasoningStreams(parser, tail)
        apply_reasoning(args.params, parser, tokenizer, tail)

    def _cancel(self, live: _Live, reason: int) -> None:
        if live.cancel_reason is None:
            live.cancel_reason = reason
        if live.task is not None:
            live.task.cancel()

    async def _run(self, stream: _Stream, live: _Live, args: EngineArgs | pb.StartRequest) -> None:
        account = live.account
        final: pb.GenerateResponse | None = None
        try:
            if isinstance(args, pb.StartRequest):  # chat messages, not rendered yet
                opts = self.options
                rendered, tool_parser = await render_chat(
                    args, self.engine, opts.parse_special_tokens_in_chat, opts.tool_call_parser
                )
                args = self._admit(rendered)
                args.tool_parser = account.tool_parser = tool_parser
                self._reasoning(account, args)
                account.num_sequences = args.params.n
                account.max_tokens = args.params.max_tokens
                self._arm_time_limit(live, args)
            async for output in self.engine.generate(args.engine_request(live.engine_request_id)):
                live.has_output = True
                for frame in account.frames(output):
                    stream.out.put_nowait(frame)
                if stream.out.qsize() >= _MAX_BUFFERED_FRAMES:
                    stream.has_room.clear()
                    await stream.has_room.wait()  # backpressure: see _MAX_BUFFERED_FRAMES
                if output.finished:
                    final = account.finished()
        except asyncio.CancelledError:
            if live.failure is not None:  # the engine core stalled (fail_waiting)
                final = error_frame(account.request_id, live.failure.code, live.failure.message)
            else:
                final = account.finished(live.cancel_reason or pb.FINISH_REASON_CANCELLED)
        except RequestInvalid as e:
            final = error_frame(account.request_id, e.code, e.message)
        except ValueError as e:
            message = account.user_facing(str(e))
            final = error_frame(account.request_id, grpc.StatusCode.INVALID_ARGUMENT, message)
        except EngineCoreDiedError as e:
            if stream.is_open:  # the whole stream ends UNAVAILABLE, not just this request
                stream.out.put_nowait(_StreamFatal(grpc.StatusCode.UNAVAILABLE, str(e)))
        except EngineDeadError as e:
            final = error_frame(account.request_id, grpc.StatusCode.INTERNAL, str(e))
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the stream
            logger.exception("request %s failed", account.request_id)
            final = error_frame(
                account.request_id, grpc.StatusCode.INTERNAL, f"internal error: {e!r}"
            )
        finally:
            if live.timer is not None:
                live.timer.cancel()
            stream.live.pop(account.request_id, None)
            if final is not None and final.HasField("finished") and self.metrics is not None:
                self.metrics.observe_request(account, final.finished.finish_reason)
            if stream.is_open and final is not None:
                stream.out.put_nowait(final)
            stream.out.put_nowait(None)  # wakes the writer to check whether the call is done


async def _with_timeout(write, timeout_s: float) -> None:
    """Awaits a write, failing with TimeoutError after timeout_s (a client that stopped
    reading). asyncio.timeout (3.11+) arms one timer; wait_for would create a task per write."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            await write
    else:  # Python 3.10
        await asyncio.wait_for(write, timeout_s)
