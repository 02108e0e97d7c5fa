"""The engine-core process: an EngineCore stepping in a loop that never waits on the front end.

Transport: one duplex ``multiprocessing`` pipe (a Unix socketpair) of length-framed
messages. Core -> front end, once a step: ``EngineCoreOutputs`` as msgpack through msgspec
(a decode step of 512 sequences encodes in ~0.05 ms and decodes in ~0.3 ms; pickle took
1-4 ms for the same records, on a thread that shares the core's GIL). Front end -> core,
once per event-loop turn: ``CoreCommands`` pickled with protocol 5 (a handful of requests,
with SamplingParams as whatever dataclass it is). Why a pipe: it is local, needs no port, and
gives EOF the moment either side dies, which is exactly the signal each side needs (the core
exits when the front end is gone; the front end fails every stream UNAVAILABLE when the core
is gone). The start-up handshake (``CoreReady`` / ``CoreStartupFailed``) is pickled.

Threads: an input thread reads and unpickles ``CoreCommands`` into a queue; the core loop
drains that queue between steps (waiting on it only when it has nothing to run) and puts one
``EngineCoreOutputs`` per step on the output queue; an output thread pickles and writes. A
slow reader on the other side therefore slows only the output thread, never the step loop.
SIGINT and SIGTERM are ignored (the front end drains first, then says ``shutdown``).
"""

from __future__ import annotations

import gc
import logging
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

import msgspec

from pydaemon.config.engine import EngineConfig
from pydaemon.core.messages import (
    CoreCommands,
    CoreReady,
    CoreStartupFailed,
    EngineCall,
    EngineCoreOutputs,
    UtilityCall,
    UtilityResult,
)
from pydaemon.engine.engine_client import IDLE_HEARTBEAT_S

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1  # stats ride along with step outputs at most this often
_FRONTEND_GONE = object()


def _dumps(message: object) -> bytes:
    return pickle.dumps(message, protocol=5)


def run_engine_core(
    config: EngineConfig, conn: Connection, eos_token_ids: list[int], log_level: int
) -> None:
    """The process's target: load, warm up, say ready, then serve until told or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s"
    )
    from pydaemon.engine.engine_core import EngineCore

    try:
        started = time.monotonic()
        core = EngineCore(config)
        logger.info("engine built in %.1f s; warming up", time.monotonic() - started)
        started = time.monotonic()
        eos_token_ids = core.resolve_eos_token_ids(eos_token_ids)
        core.warmup(eos_token_ids)
        core.structured_outputs.prepare(eos_token_ids)  # not on the first request's step
        logger.info(
            "warm-up done in %.1f s (a request end to end, the grammar compiler's vocabulary)",
            time.monotonic() - started,
        )
        conn.send_bytes(_dumps(CoreReady(core.model_info(eos_token_ids), core.get_stats())))
    except BaseException as e:  # noqa: BLE001 - reported to the front end, then exit
        bad_setting = isinstance(e, ValueError)
        message = str(e) if bad_setting else traceback.format_exc()
        try:
            conn.send_bytes(_dumps(CoreStartupFailed(message, bad_setting)))
        except OSError:
            pass
        raise SystemExit(1) from None
    loop = EngineCoreLoop(core, conn)
    try:
        loop.run()
    finally:
        core.shutdown()
        # The I/O threads outlive the loop: drop the core now, not at interpreter exit
        # (nanobind reports C++ objects still alive then as leaks).
        loop.core = None
        del core, loop
        gc.collect()


class EngineCoreLoop:
    def __init__(self, core, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.last_stats_time = 0.0
        self.is_frontend_gone = False

    def run(self) -> None:
        threading.Thread(target=self._read, name="core-input", daemon=True).start()
        writer = threading.Thread(target=self._write, name="core-output", daemon=True)
        writer.start()
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - tell the front end why, then exit non-zero
            logger.exception("the engine core failed")
            self.output_queue.put(EngineCoreOutputs(fatal_error=traceback.format_exc()))
            self.output_queue.put(None)
            writer.join(5.0)
            raise SystemExit(1) from None
        self.output_queue.put(None)
        writer.join(5.0)

    def _loop(self) -> None:
        core = self.core
        while True:
            outputs = EngineCoreOutputs()
            want_stats = self._apply_commands(outputs, block=not core.has_unfinished_requests())
            if self.is_frontend_gone:
                logger.info("the front end is gone: the engine core exits")
                return
            if want_stats is None:  # shutdown
                return
            is_busy = core.has_unfinished_requests()
            if not is_busy:  # idle: a dead rank fails the engine now, not at the next step
                core.check_health()
            if is_busy:
                step = core.step()
                outputs.outputs = step.outputs
            now = time.monotonic()
            # Stats also go with the step that empties the engine: counters are exact as soon
            # as the last request's final output arrives.
            is_drained = is_busy and not core.has_unfinished_requests()
            if want_stats or is_drained or now - self.last_stats_time > STATS_INTERVAL_S:
                outputs.stats = core.get_stats()
                self.last_stats_time = now
            has_news = outputs.outputs or outputs.rejected or outputs.utility_results
            if has_news or outputs.stats is not None:
                self.output_queue.put(outputs)  # one message per step

    def _apply_commands(self, outputs: EngineCoreOutputs, block: bool) -> bool | None:
        """Applies every queued command; waits (a heartbeat long) only when ``block``.
        -> whether stats were asked for, None on shutdown."""
        want_stats = False
        try:
            first = self.input_queue.get(timeout=IDLE_HEARTBEAT_S) if block else None
        except queue.Empty:
            return True  # idle: the stats message doubles as the heartbeat
        batch = [] if first is None else [first]
        while True:
            try:
                batch.append(self.input_queue.get_nowait())
            except queue.Empty:
                break
        for commands in batch:
            if commands is _FRONTEND_GONE:
                self.is_frontend_gone = True
                return want_stats
            want_stats |= commands.want_stats
            for request_id in commands.aborts:
                self.core.abort_request(request_id)
            for request_id, index in commands.finish_seqs:
                self.core.finish_seq(request_id, index)
            for request in commands.adds:
                try:
                    self.core.add_request(request)
                except ValueError as e:
                    outputs.rejected.append((request.request_id, str(e)))
            for call in commands.calls:
                outputs.utility_results.append(self._call(call))
            if commands.shutdown:
                return None
        return want_stats

    def _call(self, call: UtilityCall) -> UtilityResult:
        """A front end's control call; a ValueError is its answer, never the core's end."""
        if not isinstance(call.call, EngineCall):
            return UtilityResult(call.call_id, error=f"unknown engine call {call.call!r}")
        try:
            result = call.call.run(self.core)
        except ValueError as e:
            return UtilityResult(call.call_id, error=str(e))
        return UtilityResult(call.call_id, result=_dumps(result))

    def _read(self) -> None:
        try:
            while True:
                commands: CoreCommands = pickle.loads(self.conn.recv_bytes())
                self.input_queue.put(commands)
        except (EOFError, OSError):
            self.input_queue.put(_FRONTEND_GONE)

    def _write(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            outputs = self.output_queue.get()
            if outputs is None:
                return
            try:
                self.conn.send_bytes(encoder.encode(outputs))
            except OSError:  # the front end is gone; the input thread tells the loop
                return
