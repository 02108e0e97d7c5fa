"""MPEngineClient: the front end of ``pagedd serve``; the engine core runs in its own process.

This process tokenizes (off the event loop), detokenizes incrementally, checks stop strings
and streams (``OutputProcessor``), so protobuf, HTTP and text work never share a GIL with the
step loop. Commands for the core are batched: everything posted during one turn of the event
loop goes as one ``CoreCommands`` message. A reader thread receives one ``EngineCoreOutputs``
per step and hands it to the event loop, which updates the request streams. If the core
process dies (EOF on the pipe), every open stream fails with EngineCoreDiedError (the server
ends it UNAVAILABLE) and ``is_alive`` turns False (the daemon drains and exits non-zero).
Transport and serialization: see ``pydaemon.engine.core_proc``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from pydaemon.config.cache_info import cache_config_info
from pydaemon.config.engine import EngineConfig
from pydaemon.core.messages import (
    CoreCommands,
    CoreReady,
    EngineCall,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
)
from pydaemon.engine.core_launch import start_engine_core
from pydaemon.engine.engine_client import (
    EngineClient,
    EngineCoreDiedError,
    EngineDeadError,
    ServedModelInfo,
    num_sequences,
    stream_request,
)
from pydaemon.engine.output_processor import OutputProcessor
from pydaemon.engine.prompt_input import first_eos_token_id, to_core_request, tokenize_prompt
from pydaemon.engine.startup import prepare_front_end
from pydaemon.generate_request import GenerateRequest
from pydaemon.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class MPEngineClient(EngineClient):
    def __init__(
        self, process, conn: Connection, tokenizer, model_info: ServedModelInfo, ready: CoreReady
    ) -> None:
        self.process = process
        self.conn = conn
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.latest_stats = ready.stats
        self.error: BaseException | None = None
        self.num_unscheduled = 0
        self.last_progress_time = time.monotonic()
        self._eos_token_ids = ready.model_info.eos_token_ids
        self._processor = OutputProcessor(tokenizer, model_info.max_model_len)
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending = CoreCommands()
        self._is_flush_scheduled = False
        self._stats_waiters: list[asyncio.Future] = []
        self._calls: dict[int, asyncio.Future] = {}  # UtilityCall.call_id -> its answer
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_shut_down = False

    # ---- start-up ---------------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig) -> MPEngineClient:
        """Starts the engine-core process and waits until its model is loaded and warm
        (blocking: run it off the event loop). Not started: call ``start()`` on the loop."""
        started = time.monotonic()
        front = prepare_front_end(config)
        tokenizer = front.tokenizer
        logger.info(
            "model %s (%s); tokenizer read in %.1f s; starting the engine core (it loads the "
            "weights, then warms up)",
            front.model_name,
            front.model_dir,
            time.monotonic() - started,
        )
        process, conn, ready = start_engine_core(front.core_config, front.eos_token_ids)
        info = ready.model_info
        model_info = ServedModelInfo(
            model_name=front.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            device=info.device,
            dtype=info.dtype,
            eos_token_id=first_eos_token_id(tokenizer, info.eos_token_ids),
            has_tokenizer=tokenizer is not None,
            eos_token_ids=list(info.eos_token_ids),
            generation_defaults=front.generation_defaults,
            has_chat_template=tokenizer is not None and tokenizer.chat_template is not None,
            max_logprobs=info.max_logprobs,
            cache_config=cache_config_info(config),
        )
        logger.info("engine core: pid %d, on %s (%s)", process.pid, info.device, info.dtype)
        return cls(process, conn, tokenizer, model_info, ready)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="pagedd-core-reader", daemon=True).start()

    # ---- EngineClient -----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.error is None and not self._is_shut_down and self.process.is_alive()

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress_time

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise self.error
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        arrival = time.monotonic()
        prompt = request.prompt
        if isinstance(prompt, str) and self.tokenizer is not None:
            # Tokenizers release the GIL: encoding a long prompt never stalls the loop.
            loop = asyncio.get_running_loop()
            prompt_text, token_ids = await loop.run_in_executor(
                None, tokenize_prompt, prompt, self.tokenizer
            )
        else:
            prompt_text, token_ids = tokenize_prompt(prompt, self.tokenizer)
        if self.error is not None:
            raise self.error
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._processor.add_request(
            request_id,
            prompt_text,
            token_ids,
            request.params,
            set(self._eos_token_ids),
            RequestMetrics(arrival_time=arrival),
        )
        num_seqs = num_sequences(request.params)
        self.num_unscheduled += num_seqs
        self._post_add(to_core_request(request, token_ids, self._eos_token_ids, arrival))

        def scheduled() -> None:
            self.num_unscheduled -= num_seqs

        async for output in stream_request(queue, scheduled, lambda: self.abort(request_id)):
            yield output

    def abort(self, request_id: str) -> None:
        """Call on the event loop (as everything here but ``launch``)."""
        if self._queues.pop(request_id, None) is None:
            return
        self._processor.abort_request(request_id)
        self._pending.aborts.append(request_id)
        self._schedule_flush()

    async def _call(self, call: EngineCall) -> Any:
        """``call`` run on the EngineCore in its process, between two steps; its ValueError is
        raised here."""
        if not self.is_alive:
            raise self.error or EngineDeadError("engine is not running")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._pending.calls.append(UtilityCall(call_id, call))
        self._schedule_flush()
        return await future

    async def stats(self) -> Any:
        if not self.is_alive:
            return self.latest_stats
        future = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(future)
        self._pending.want_stats = True
        self._schedule_flush()
        return await future

    async def shutdown(self) -> None:
        """Aborts what is live, tells the core to stop, and waits for it (then kills it)."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._pending.aborts.extend(self._queues)
        self._pending.shutdown = True
        self._flush()
        self._fail_all(EngineDeadError("engine is shut down"))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine core did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
            self.process.kill()
            await loop.run_in_executor(None, self.process.join)
        self.conn.close()

    # ---- to the core ------------------------------------------------------------------------
    def _post_add(self, request: EngineCoreRequest) -> None:
        self._pending.adds.append(request)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._is_flush_scheduled:
            self._is_flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Everything posted in this turn of the event loop, as one message."""
        self._is_flush_scheduled = False
        commands, self._pending = self._pending, CoreCommands()
        if commands.is_empty or self.error is not None:
            return
        try:
            self.conn.send_bytes(pickle.dumps(commands, protocol=5))
        except OSError:
            pass  # the core is gone; the reader thread reports it

    # ---- from the core ----------------------------------------------------------------------
    def _read(self) -> None:
        """Reader thread: one EngineCoreOutputs per step, handed to the event loop."""
        reason = "the engine-core process closed its pipe"
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        try:
            while True:
                outputs = decoder.decode(self.conn.recv_bytes())
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)
                if outputs.fatal_error is not None:
                    reason = f"the engine core failed:\n{outputs.fatal_error}"
                    break
        except (EOFError, OSError):
            pass
        if not self._is_shut_down:
            self.process.join(2.0)
            reason += f" (pid {self.process.pid}, exit code {self.process.exitcode})"
        try:
            self._loop.call_soon_threadsafe(self._on_core_died, reason)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self.last_progress_time = time.monotonic()
        if outputs.stats is not None:
            self.latest_stats = outputs.stats
            waiters, self._stats_waiters = self._stats_waiters, []
            for future in waiters:
                if not future.done():
                    future.set_result(outputs.stats)
        for answer in outputs.utility_results:
            future = self._calls.pop(answer.call_id, None)
            if future is None or future.done():
                continue
            if answer.error is not None:
                future.set_exception(ValueError(answer.error))
            else:
                future.set_result(pickle.loads(answer.result))
        for request_id, message in outputs.rejected:
            queue = self._queues.pop(request_id, None)
            self._processor.abort_request(request_id)
            if queue is not None:
                queue.put_nowait(ValueError(message))
        if not outputs.outputs:
            return
        request_outputs, stopped = self._processor.process(outputs)
        for output in request_outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue  # aborted since
            if output.finished:
                del self._queues[output.request_id]
            queue.put_nowait(output)
        if stopped:
            self._pending.finish_seqs.extend(stopped)
            self._schedule_flush()

    def _on_core_died(self, reason: str) -> None:
        if self._is_shut_down:
            return
        logger.error("%s; failing %d live requests", reason, len(self._queues))
        self.error = EngineCoreDiedError(reason)
        self._fail_all(self.error)

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        for future in self._stats_waiters:
            if not future.done():
                future.set_result(self.latest_stats)
        self._stats_waiters = []
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls = {}
