"""InprocEngineClient: an EngineClient whose engine (LLMEngine, or a test double) steps in a thread
of this process. ``pagedd serve`` runs the engine core in its own process instead
(``pydaemon.engine.mp_client``); this one serves tests and in-process embedding.

The engine is not thread-safe, so only the engine thread touches it. The asyncio side posts
commands (add, abort, stats, LoRA calls) on a queue guarded by a condition; the engine thread drains the
queue before every step, sleeps on the condition when there is nothing to do, and hands each
RequestOutput to its request's asyncio queue with ``loop.call_soon_threadsafe``. Neither side
ever waits on the other: posting a command never blocks on a step, and delivering an output
never blocks on a client.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydaemon.config.cache_info import cache_config_info
from pydaemon.core.messages import EngineCall
from pydaemon.engine.engine_client import (
    IDLE_HEARTBEAT_S,
    EngineClient,
    EngineDeadError,
    ServedModelInfo,
    merge_deltas,
    num_sequences,
    stream_request,
)
from pydaemon.engine.prompt_input import first_eos_token_id
from pydaemon.generate_request import GenerateRequest
from pydaemon.logprobs_limit import DEFAULT_MAX_LOGPROBS, resolve_max_logprobs
from pydaemon.outputs import RequestOutput

__all__ = ["InprocEngineClient", "EngineDeadError", "merge_deltas", "served_model_info"]

logger = logging.getLogger(__name__)


@dataclass
class _Sink:
    """Where the outputs of one request go: an asyncio queue on its loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _send(sink: _Sink, item: object) -> None:
    try:
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
    except RuntimeError:  # the client's loop is closed: nobody is listening any more
        pass


def _put_many(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def served_model_info(engine: Any) -> ServedModelInfo:
    """What a server shows of an engine (LLMEngine or a double with the same attributes)."""
    tokenizer = engine.tokenizer
    return ServedModelInfo(
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        block_size=engine.config.block_size,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        eos_token_id=first_eos_token_id(tokenizer, engine.eos_token_ids),
        has_tokenizer=tokenizer is not None,
        eos_token_ids=sorted(engine.eos_token_ids),
        generation_defaults=engine.generation_defaults,
        has_chat_template=tokenizer is not None and tokenizer.chat_template is not None,
        max_logprobs=resolve_max_logprobs(
            getattr(engine.config, "max_logprobs", DEFAULT_MAX_LOGPROBS), engine.vocab_size
        ),
        cache_config=cache_config_info(engine.config),
    )


def serving_client(engine: Any) -> InprocEngineClient | None:
    """The InprocEngineClient whose engine thread is stepping ``engine`` now, if any."""
    client = getattr(engine, "_pagedd_served_by", None)
    return client if client is not None and client.steps_engine else None


def _ensure_unserved(engine: Any) -> None:
    """One engine thread per engine: a second one would step the first's requests (and a
    warm-up) concurrently, and deliver their outputs to nobody."""
    if serving_client(engine) is not None:
        raise RuntimeError(
            "this engine is already served by a running InprocEngineClient: shut that one "
            "down first (an engine is stepped by one thread)"
        )


class InprocEngineClient(EngineClient):
    """Runs ``engine.step()`` in a dedicated thread; serves many asyncio clients."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model_info = served_model_info(engine)
        self.tokenizer = engine.tokenizer
        self._cond = threading.Condition()
        self._commands: collections.deque[tuple] = collections.deque()  # guarded by _cond
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # set when the engine thread died
        # Heartbeat for the sd_notify watchdog: bumped after every step and every idle wake.
        self.num_loop_iterations = 0
        self.last_progress_time = time.monotonic()
        self.latest_stats = engine.get_stats()  # refreshed by the engine thread
        self.num_unscheduled = 0  # posted sequences with no output yet (admission control)

    @classmethod
    def load(cls, engine_factory: Callable[[], Any]) -> InprocEngineClient:
        """Builds and warms the engine (blocking: run it off the event loop); not started."""
        engine = engine_factory()
        _ensure_unserved(engine)  # before the warm-up steps it
        engine.warmup()
        return cls(engine)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("InprocEngineClient.start() called twice")
        _ensure_unserved(self.engine)
        self._thread = threading.Thread(target=self._run, name="pagedd-engine", daemon=True)
        with contextlib.suppress(AttributeError):  # (a double with __slots__)
            self.engine._pagedd_served_by = self
        self._thread.start()

    @property
    def steps_engine(self) -> bool:
        """Whether this client's engine thread is running (it alone may step the engine)."""
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self) -> None:
        """Aborts every live request and stops the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join)
        shutdown = getattr(self.engine, "shutdown", None)  # stops tensor-parallel workers
        if shutdown is not None:
            await loop.run_in_executor(None, shutdown)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress_time

    # ---- asyncio side ------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yields the request's RequestOutput deltas until the finished one.

        Raises ValueError (from the engine thread) for bad input, EngineDeadError when the
        engine failed. Leaving the iteration early (break, cancellation) aborts the request.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error!r}")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        num_seqs = num_sequences(request.params)
        self.num_unscheduled += num_seqs
        self._post(("add", request, time.monotonic(), sink))

        def scheduled() -> None:
            self.num_unscheduled -= num_seqs

        request_id = request.request_id
        async for output in stream_request(sink.queue, scheduled, lambda: self.abort(request_id)):
            yield output

    def abort(self, request_id: str) -> None:
        """Aborts a request; its blocks are freed before the engine's next step."""
        self._post(("abort", request_id))

    async def _call(self, call: EngineCall) -> Any:
        """``call`` run on the engine thread, between two steps."""
        if not self.is_alive:
            raise EngineDeadError("engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", call, future))
        return await asyncio.wrap_future(future)

    async def stats(self) -> Any:
        """A fresh EngineStats, read by the engine thread between steps."""
        if not self.is_alive:
            return self.latest_stats
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("stats", future))
        return await asyncio.wrap_future(future)

    def _post(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping:
                        if self.engine.has_unfinished_requests():
                            break
                        self._check_engine_health()
                        self._beat()
                        self._cond.wait(IDLE_HEARTBEAT_S)
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                for command in commands:
                    self._apply(command)
                if stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver_all(self.engine.step())
                    self.latest_stats = self.engine.get_stats()
                self._beat()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine thread failed; failing every live request")
            self.error = e
            dead = EngineDeadError(f"engine failed: {e!r}")
            for sink in self._sinks.values():
                _send(sink, dead)
            self._sinks.clear()
            self._fail_pending(dead)
            return
        for request_id in list(self._sinks):
            self.engine.abort_request(request_id)
        self._sinks.clear()
        self._fail_pending(EngineDeadError("engine is shut down"))

    def _fail_pending(self, error: BaseException) -> None:
        """Answers commands still queued after the engine thread stopped."""
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if command[0] == "add":
                sink = command[-1]
                _send(sink, error)
            elif command[0] == "call":
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    command[-1].set_exception(error)
            elif command[0] == "stats":
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    command[1].set_result(self.latest_stats)

    def _check_engine_health(self) -> None:
        """While idle: a dead tensor-parallel worker fails the engine now, not at the next step."""
        check = getattr(self.engine, "check_health", None)
        if check is not None:
            check()

    def _beat(self) -> None:
        self.num_loop_iterations += 1
        self.last_progress_time = time.monotonic()

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request, arrival, sink = command
            try:
                self.engine.add_request(request, arrival_time=arrival)
            except ValueError as e:
                _send(sink, e)
                return
            self._sinks[request.request_id] = sink
        elif kind == "call":
            _, call, future = command
            try:
                result = call.run(self.engine)
            except ValueError as e:  # the caller's to report (a bad adapter, say)
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(e)
                return
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_result(result)
        elif kind == "abort":
            if self._sinks.pop(command[1], None) is not None:
                self.engine.abort_request(command[1])
            self.latest_stats = self.engine.get_stats()
        elif kind == "stats":
            stats = self.engine.get_stats()
            self.latest_stats = stats
            # The caller's deadline may have passed (its future is cancelled).
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                command[1].set_result(stats)
        else:
            raise AssertionError(f"unknown command {kind!r}")

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per client loop per step, not one per request (hundreds per step)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:  # aborted by the client since it was stepped
                continue
            if output.finished:
                del self._sinks[output.request_id]
            batches.setdefault(sink.loop, []).append((sink.queue, output))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_many, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass
