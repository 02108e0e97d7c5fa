"""One generation request from admission to its last byte, for completions and chat alike.

The engine is asked first; the HTTP response starts only with the first output, so a request
the engine refuses (a prompt that cannot fit) is still a plain 400. Every way the request ends
early leaves the engine stream, which aborts the engine requests (KV blocks freed at once):
- the client disconnects: aiohttp cancels the handler (``handler_cancellation``);
- a streaming client stops reading for the stall timeout: the connection is closed;
- the drain's grace period ends: the handler is cancelled with ``is_aborted_by_server`` and
  still answers, every unfinished choice with finish_reason "abort";
- the engine core stalls before the first output: the handler is cancelled with a
  ``failure`` (503 engine_stalled), which it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from aiohttp import web

from pydaemon.entrypoints.common.constraint_errors import (
    http_constraint_field,
    is_constraint_error,
    rename_constraint_field,
)
from pydaemon.entrypoints.openai.accumulator import Accumulator, ChoiceDelta, ChoiceState
from pydaemon.entrypoints.openai.engine_stream import EnginePrompt, engine_requests, generate_all
from pydaemon.entrypoints.openai.errors import ApiError, bad_request, error_event
from pydaemon.entrypoints.openai.responses import Usage
from pydaemon.entrypoints.openai.serving import LiveRequest, OpenAIServing, engine_stalled
from pydaemon.entrypoints.openai.sse import EventStream
from pydaemon.lora_request import LoRARequest
from pydaemon.outputs import RequestOutput
from pydaemon.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Formatter(Protocol):
    """Turns accumulated engine outputs into one endpoint's JSON."""

    request_id: str
    logprob_tokenizer: object  # what names logprobs' tokens (None: "token_id:<id>")

    def start_chunks(self, acc: Accumulator) -> list[str]: ...
    def delta_chunks(self, deltas: list[ChoiceDelta], acc: Accumulator) -> list[str]: ...
    def abort_chunks(self, choices: list[ChoiceState]) -> list[str]: ...
    def usage_chunk(self, usage: Usage) -> str: ...
    def response_json(self, acc: Accumulator) -> str: ...


async def respond(
    serving: OpenAIServing,
    request: web.Request,
    prompts: list[EnginePrompt],
    params: SamplingParams | list[SamplingParams],
    formatter: Formatter,
    *,
    stream: bool,
    include_usage: bool,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
    constraint_source: str | None = None,
) -> web.StreamResponse:
    if serving.is_stalled():  # declared while the prompt was rendered: it would only wait
        raise engine_stalled()
    if isinstance(params, list):  # a batch: the same n, each prompt its own max_tokens
        n, max_tokens = params[0].n, [p.max_tokens for p in params]
    else:
        n, max_tokens = params.n, params.max_tokens
    acc = Accumulator(prompts, n, formatter.logprob_tokenizer, max_tokens)
    with serving.track() as live:
        requests = engine_requests(formatter.request_id, prompts, params, cache_salt, lora_request)
        outputs = generate_all(serving.engine, requests)
        try:
            async with contextlib.aclosing(outputs):
                try:
                    first = await outputs.__anext__()
                except asyncio.CancelledError:
                    if live.failure is not None:  # the engine core stalled (fail_waiting)
                        _uncancel()
                        live.is_failed = True
                        raise live.failure from None
                    if not live.is_aborted_by_server:
                        raise
                    _uncancel()
                    raise ApiError(503, "the server is shutting down", code="not_serving") from None
                except Exception as e:  # e.g. refused by the engine: nothing was sent yet
                    live.is_failed = True
                    raise _engine_error(serving, e, constraint_source) from None
                live.has_output = True
                deltas = acc.add(*first)
                if stream:
                    return await _stream(
                        request, serving, live, acc, deltas, outputs, formatter, include_usage,
                        constraint_source,
                    )  # fmt: skip
                return await _collect(serving, live, acc, outputs, formatter, constraint_source)
        finally:
            if not live.is_failed:  # failures are errors, not finished requests (as in gRPC)
                serving.observe(acc, "aborted" if live.is_aborted_by_server else None)


async def _collect(
    serving: OpenAIServing,
    live: LiveRequest,
    acc: Accumulator,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    formatter: Formatter,
    constraint_source: str | None = None,
) -> web.Response:
    try:
        async for item in outputs:
            acc.add(*item)
    except asyncio.CancelledError:
        if not live.is_aborted_by_server:
            raise
        _uncancel()
        acc.abort_unfinished()
    except Exception as e:  # a later prompt of a batch refused, or the engine failed
        live.is_failed = True
        raise _engine_error(serving, e, constraint_source) from None
    return web.Response(text=formatter.response_json(acc), content_type="application/json")


async def _stream(
    request: web.Request,
    serving: OpenAIServing,
    live: LiveRequest,
    acc: Accumulator,
    deltas: list[ChoiceDelta],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    formatter: Formatter,
    include_usage: bool,
    constraint_source: str | None = None,
) -> web.StreamResponse:
    events = EventStream(request, serving.options.stall_timeout_s)
    try:
        await events.open()
        try:
            await events.send(formatter.start_chunks(acc) + formatter.delta_chunks(deltas, acc))
            async for item in outputs:
                await events.send(formatter.delta_chunks(acc.add(*item), acc))
        except asyncio.CancelledError:
            if not live.is_aborted_by_server:
                raise
            _uncancel()
            await events.send(formatter.abort_chunks(acc.abort_unfinished()))
        except (asyncio.TimeoutError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - after the headers: an error event ends the stream
            live.is_failed = True
            await events.send([error_event(_engine_error(serving, e, constraint_source))])
            return await events.close()
        if include_usage:
            await events.send([formatter.usage_chunk(acc.usage())])
        return await events.close()
    except asyncio.TimeoutError:
        logger.warning(
            "client stopped reading for %.1f s: aborting %s",
            serving.options.stall_timeout_s,
            formatter.request_id,
        )
        _drop_connection(request)
    except ConnectionResetError:
        _drop_connection(request)
    # The client is gone: end the handler quietly (aiohttp logs a cancelled handler at debug).
    raise asyncio.CancelledError


def _engine_error(
    serving: OpenAIServing, e: Exception, constraint_source: str | None = None
) -> ApiError:
    """``constraint_source``: the request field the output's constraint came from
    ("response_format", "tools", "structured_outputs"), which a constraint error names."""
    if isinstance(e, ValueError):
        message = str(e)
        if constraint_source is not None and is_constraint_error(message):
            field = http_constraint_field(constraint_source)
            return bad_request(rename_constraint_field(message, field), constraint_source)
        return bad_request(message)
    if not serving.engine.is_alive:
        return ApiError(503, f"the engine failed: {e}", code="engine_dead")
    logger.error("generation failed", exc_info=e)
    return ApiError(500, f"internal error: {e!r}")


def _drop_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def _uncancel() -> None:
    """After a drain's cancel was handled: the task goes on answering (3.11+ counts cancels)."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()
